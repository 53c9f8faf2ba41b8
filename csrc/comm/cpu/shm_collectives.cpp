// CPU kernels of the shared-memory collectives and point-to-point channel.
//
// all_reduce: one-shot (copy in -> barrier -> every rank sums all buffers) for small messages;
// two-shot otherwise (publish the slices others reduce -> barrier -> each rank sums its own
// slice -> barrier -> every rank copies the other reduced slices out), which moves about 2n
// bytes per rank instead of (world + 2) n. Both walk the message in chunks of one buffer half, alternating halves, so one barrier
// per phase suffices: a rank can only overwrite a half after every peer passed the barrier
// that follows its last read of that half. Sums run in rank order with fp32 accumulation, so
// every rank gets bitwise-identical results (vLLM's custom all-reduce does the same).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "../shm.h"

namespace rmm_comm {

namespace {

// ---------------------------------------------------------------- element access (fp32 / bf16)
inline float to_f(float x) { return x; }
inline float to_f(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
template <class T>
inline T from_f(float f);
template <>
inline float from_f<float>(float f) { return f; }
template <>
inline uint16_t from_f<uint16_t>(float f) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// dst[i] = sum_r srcs[r][i] (rank order, fp32 accumulation); dst may alias a source.
template <class T>
void reduce_into(T* dst, const T* const* srcs, int nsrc, int64_t n) {
  constexpr int64_t kTile = 256;  // fp32 accumulator tile: stays in registers / L1
  constexpr int64_t kGrain = 1 << 15;
  at::parallel_for(0, (n + kTile - 1) / kTile, kGrain / kTile, [&](int64_t t0, int64_t t1) {
    float acc[kTile];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i0 = t * kTile;
      const int64_t m = std::min(kTile, n - i0);
      const T* s0 = srcs[0] + i0;
      for (int64_t i = 0; i < m; ++i) acc[i] = to_f(s0[i]);
      for (int r = 1; r < nsrc; ++r) {
        const T* s = srcs[r] + i0;
        for (int64_t i = 0; i < m; ++i) acc[i] += to_f(s[i]);
      }
      T* d = dst + i0;
      for (int64_t i = 0; i < m; ++i) d[i] = from_f<T>(acc[i]);
    }
  });
}

void copy_bytes(void* dst, const void* src, size_t bytes) {
  constexpr size_t kGrain = 1 << 20;
  if (bytes < 2 * kGrain || at::get_num_threads() == 1) {
    std::memcpy(dst, src, bytes);
    return;
  }
  at::parallel_for(0, static_cast<int64_t>(bytes), kGrain, [&](int64_t b0, int64_t b1) {
    std::memcpy(static_cast<char*>(dst) + b0, static_cast<const char*>(src) + b0, b1 - b0);
  });
}

void check_input(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu(), "rmm_comm::", op, ": shared-memory collectives need CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "rmm_comm::", op,
              ": dtype must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.is_contiguous(), "rmm_comm::", op, ": input must be contiguous");
}

// One-shot message limit (vLLM uses 256-512 KB for 4-8 GPUs; one barrier instead of two).
constexpr int64_t kOneShotBytes = 256 * 1024;

template <class T>
void all_reduce_impl(Group& g, const T* in, T* out, int64_t n) {
  const int W = g.nranks;
  const int64_t C = g.half_bytes / static_cast<int64_t>(sizeof(T));  // elements per chunk
  const bool one_shot = n * static_cast<int64_t>(sizeof(T)) <= kOneShotBytes;
  const T* srcs[kMaxRanks];
  for (int64_t off = 0; off < n; off += C) {
    const int64_t c = std::min(C, n - off);
    const uint64_t b = g.chunk_seq++;
    T* mine = reinterpret_cast<T*>(g.buf(g.rank, b));
    if (one_shot) {
      copy_bytes(mine, in + off, c * sizeof(T));
      g.barrier("all_reduce (copy-in)");
      for (int r = 0; r < W; ++r) srcs[r] = reinterpret_cast<const T*>(g.buf(r, b));
      reduce_into(out + off, srcs, W, c);
      continue;
    }
    // Two-shot. Slice r (boundaries on 16-element multiples) is reduced by rank r, so a rank
    // publishes only the other slices, reads its own from `in`, and writes the reduced slice
    // into its own buffer (where its unpublished slice would be) and into `out`.
    auto lo = [&](int r) { return std::min(c, ((c * r / W) + 15) / 16 * 16); };
    auto hi = [&](int r) { return r + 1 == W ? c : lo(r + 1); };
    for (int r = 0; r < W; ++r) {
      if (r != g.rank && hi(r) > lo(r)) copy_bytes(mine + lo(r), in + off + lo(r), (hi(r) - lo(r)) * sizeof(T));
    }
    g.barrier("all_reduce (copy-in)");
    const int64_t s0 = lo(g.rank), s1 = hi(g.rank);
    for (int r = 0; r < W; ++r) {
      srcs[r] = r == g.rank ? in + off + s0 : reinterpret_cast<const T*>(g.buf(r, b)) + s0;
    }
    if (s1 > s0) {
      reduce_into(out + off + s0, srcs, W, s1 - s0);
      copy_bytes(mine + s0, out + off + s0, (s1 - s0) * sizeof(T));
    }
    g.barrier("all_reduce (reduce-scatter)");
    for (int r = 0; r < W; ++r) {
      if (r != g.rank && hi(r) > lo(r)) {
        copy_bytes(out + off + lo(r), reinterpret_cast<const T*>(g.buf(r, b)) + lo(r), (hi(r) - lo(r)) * sizeof(T));
      }
    }
  }
}

template <class T>
void all_gather_impl(Group& g, const T* in, T* out, int64_t n) {
  const int64_t C = g.half_bytes / static_cast<int64_t>(sizeof(T));
  for (int64_t off = 0; off < n; off += C) {
    const int64_t c = std::min(C, n - off);
    const uint64_t b = g.chunk_seq++;
    copy_bytes(g.buf(g.rank, b), in + off, c * sizeof(T));
    g.barrier("all_gather");
    for (int r = 0; r < g.nranks; ++r) {
      const void* src = r == g.rank ? static_cast<const void*>(in + off) : g.buf(r, b);
      copy_bytes(out + r * n + off, src, c * sizeof(T));
    }
  }
}

// in holds W blocks of n elements; rank r receives sum over ranks of block r.
template <class T>
void reduce_scatter_impl(Group& g, const T* in, T* out, int64_t n) {
  const int W = g.nranks;
  const int64_t C = std::max<int64_t>(1, g.half_bytes / static_cast<int64_t>(sizeof(T)) / W);
  const T* srcs[kMaxRanks];
  for (int64_t off = 0; off < n; off += C) {
    const int64_t c = std::min(C, n - off);
    const uint64_t b = g.chunk_seq++;
    T* mine = reinterpret_cast<T*>(g.buf(g.rank, b));
    for (int j = 0; j < W; ++j) {
      if (j != g.rank) copy_bytes(mine + j * C, in + j * n + off, c * sizeof(T));
    }
    g.barrier("reduce_scatter");
    for (int r = 0; r < W; ++r) {
      srcs[r] = r == g.rank ? in + g.rank * n + off
                            : reinterpret_cast<const T*>(g.buf(r, b)) + g.rank * C;
    }
    reduce_into(out + off, srcs, W, c);
  }
}

template <class F>
void dispatch_dtype(const at::Tensor& x, F f) {
  if (x.scalar_type() == at::kFloat) {
    f(float{});
  } else {
    f(uint16_t{});  // bfloat16 as raw bits
  }
}

// ------------------------------------------------------------------------------------ the ops
void all_reduce_inplace(at::Tensor x, int64_t handle) {
  check_input(x, "all_reduce_");
  Group& g = group_from_handle(handle);
  dispatch_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    all_reduce_impl<T>(g, static_cast<const T*>(x.data_ptr()), static_cast<T*>(x.data_ptr()), x.numel());
  });
}

at::Tensor all_reduce(const at::Tensor& x, int64_t handle) {
  check_input(x, "all_reduce");
  Group& g = group_from_handle(handle);
  at::Tensor out = at::empty_like(x);
  dispatch_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    all_reduce_impl<T>(g, static_cast<const T*>(x.data_ptr()), static_cast<T*>(out.data_ptr()), x.numel());
  });
  return out;
}

at::Tensor all_gather(const at::Tensor& x, int64_t handle) {
  check_input(x, "all_gather");
  Group& g = group_from_handle(handle);
  std::vector<int64_t> shape{g.nranks};
  for (auto s : x.sizes()) shape.push_back(s);
  at::Tensor out = at::empty(shape, x.options());  // (W, *x.shape)
  dispatch_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    all_gather_impl<T>(g, static_cast<const T*>(x.data_ptr()), static_cast<T*>(out.data_ptr()), x.numel());
  });
  return out;
}

at::Tensor reduce_scatter(const at::Tensor& x, int64_t handle) {
  check_input(x, "reduce_scatter");
  Group& g = group_from_handle(handle);
  TORCH_CHECK(x.dim() >= 1 && x.size(0) % g.nranks == 0, "rmm_comm::reduce_scatter: dim 0 (",
              x.dim() ? x.size(0) : 0, ") must be a multiple of the group size ", g.nranks);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape[0] /= g.nranks;
  at::Tensor out = at::empty(shape, x.options());  // (x.shape[0] / W, *x.shape[1:])
  dispatch_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    reduce_scatter_impl<T>(g, static_cast<const T*>(x.data_ptr()), static_cast<T*>(out.data_ptr()),
                           out.numel());
  });
  return out;
}

// --------------------------------------------------------------------------- point to point
template <class Ready>
void chan_wait(Channel& c, Ready ready, const char* what) {
  const int peer = 1 - c.side;
  TORCH_CHECK(__atomic_load_n(&c.hdr->abort_side, __ATOMIC_ACQUIRE) < 0, "rmm_comm shm ", what, " (rank ",
              c.src_rank, " -> rank ", c.dst_rank, "): the channel was aborted earlier");
  wait_until(ready, [&](double waited) {
    int64_t ab = __atomic_load_n(&c.hdr->abort_side, __ATOMIC_ACQUIRE);
    if (ab >= 0 && ab != c.side) {
      TORCH_CHECK(false, "rmm_comm shm ", what, " (rank ", c.src_rank, " -> rank ", c.dst_rank,
                  "): the peer gave up on the channel");
    }
    if (!pid_alive(c.hdr->pids[peer])) {
      __atomic_store_n(&c.hdr->abort_side, static_cast<int64_t>(c.side), __ATOMIC_RELEASE);
      TORCH_CHECK(false, "rmm_comm shm ", what, " (rank ", c.src_rank, " -> rank ", c.dst_rank,
                  "): rank ", peer == 0 ? c.src_rank : c.dst_rank, " (pid ", c.hdr->pids[peer],
                  ") died");
    }
    if (waited > c.timeout_s) {
      __atomic_store_n(&c.hdr->abort_side, static_cast<int64_t>(c.side), __ATOMIC_RELEASE);
      TORCH_CHECK(false, "rmm_comm shm ", what, " (rank ", c.src_rank, " -> rank ", c.dst_rank,
                  "): timed out after ", c.timeout_s, " s; is the peer calling ",
                  c.side == 0 ? "recv" : "send", "?");
    }
  });
}

void send(const at::Tensor& x, int64_t handle) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "rmm_comm::send: needs a contiguous CPU tensor");
  Channel& c = channel_from_handle(handle);
  TORCH_CHECK(c.side == 0, "rmm_comm::send on the receiving end of a channel");
  const char* p = static_cast<const char*>(x.data_ptr());
  const int64_t total = x.numel() * x.element_size();
  uint64_t* written = &c.hdr->written.v;
  const uint64_t* consumed = &c.hdr->consumed.v;
  const uint64_t slots = static_cast<uint64_t>(c.hdr->slots);
  for (int64_t off = 0; off < total || (total == 0 && off == 0); off += c.hdr->slot_bytes) {
    const uint64_t w = __atomic_load_n(written, __ATOMIC_RELAXED);  // only we write it
    chan_wait(c, [&] { return w - __atomic_load_n(consumed, __ATOMIC_ACQUIRE) < slots; }, "send");
    const int64_t m = std::min<int64_t>(c.hdr->slot_bytes, total - off);
    if (m > 0) copy_bytes(c.slot(w), p + off, m);
    __atomic_store_n(written, w + 1, __ATOMIC_RELEASE);
    if (total == 0) break;
  }
}

void recv_(at::Tensor out, int64_t handle) {
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous(), "rmm_comm::recv_: needs a contiguous CPU tensor");
  Channel& c = channel_from_handle(handle);
  TORCH_CHECK(c.side == 1, "rmm_comm::recv_ on the sending end of a channel");
  char* p = static_cast<char*>(out.data_ptr());
  const int64_t total = out.numel() * out.element_size();
  const uint64_t* written = &c.hdr->written.v;
  uint64_t* consumed = &c.hdr->consumed.v;
  for (int64_t off = 0; off < total || (total == 0 && off == 0); off += c.hdr->slot_bytes) {
    const uint64_t r = __atomic_load_n(consumed, __ATOMIC_RELAXED);  // only we write it
    chan_wait(c, [&] { return __atomic_load_n(written, __ATOMIC_ACQUIRE) > r; }, "recv");
    const int64_t m = std::min<int64_t>(c.hdr->slot_bytes, total - off);
    if (m > 0) copy_bytes(p + off, c.slot(r), m);
    __atomic_store_n(consumed, r + 1, __ATOMIC_RELEASE);
    if (total == 0) break;
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(rmm_comm, CPU, m) {
  m.impl("all_reduce_", &all_reduce_inplace);
  m.impl("all_reduce", &all_reduce);
  m.impl("all_gather", &all_gather);
  m.impl("reduce_scatter", &reduce_scatter);
  m.impl("send", &send);
  m.impl("recv_", &recv_);
}

}  // namespace rmm_comm
