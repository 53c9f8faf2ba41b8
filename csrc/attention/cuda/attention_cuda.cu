// CUDA kernels of rag_attn::fwd / rag_attn::bwd (sm80+), same schema and layouts as the CPU ones.
//
// A straightforward FlashAttention-2 formulation, written for correctness first: one thread owns
// one query row (forward, dQ) or one key row (dK/dV); K/V (or Q/dO) tiles are staged through shared
// memory in fp32; online softmax per row; the backward recomputes P from the saved lse and uses
// D_i = rowsum(dO_i * O_i). Key tiles outside the block's key interval are skipped, so causal,
// retrieval and packed layouts do no work on masked-out blocks. It uses no tensor cores yet, so it
// is far from FlashAttention's throughput (see BENCHMARKS.md); the schema and layout logic are
// final, the inner loops are the part to replace with mma.sync tiles.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <limits>

namespace rag_attn::cuda {
namespace {

constexpr int kRows = 64;  // query (or key) rows per block = threads per block
// Rows staged per shared-memory tile: two fp32 tiles of kTile x DMAX stay at 32 KiB (< 48 KiB static).
template <int DMAX>
struct TileOf {
  static constexpr int value = DMAX <= 64 ? 64 : (DMAX <= 128 ? 32 : 16);
};

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Where the rows of sequence (b, h) live, and which keys row i may see.
struct Layout {
  const int* seg;  // (B, n_seg + 1) or nullptr
  const int* cu;   // (B + 1,) or nullptr
  int n_seg, B, H, S, T, D;
  bool causal;

  __device__ int len(int b) const { return cu ? cu[b + 1] - cu[b] : S; }
  __device__ int64_t off(int b, int h) const {  // element offset of row 0 in q/k/v/o
    return cu ? (int64_t(cu[b]) * H + h) * D : (int64_t(b) * H + h) * S * D;
  }
  __device__ int64_t row_stride() const { return cu ? int64_t(H) * D : D; }
  __device__ int64_t lse_off(int b, int h) const { return cu ? int64_t(h) * T + cu[b] : (int64_t(b) * H + h) * S; }
  // keys [lo, hi) visible from row i (empty for padding rows)
  __device__ void interval(int b, int i, int L, int& lo, int& hi) const {
    if (i >= L) { lo = hi = 0; return; }
    if (seg == nullptr) { lo = 0; hi = causal ? i + 1 : L; return; }
    const int* o = seg + int64_t(b) * (n_seg + 1);
    if (i >= o[n_seg]) { lo = hi = 0; return; }
    if (i >= o[n_seg - 1]) { lo = 0; hi = i + 1; return; }  // query: documents + causal prefix
    int s = 0;
    while (o[s + 1] <= i) ++s;
    lo = o[s]; hi = o[s + 1];  // document: itself
  }
};

template <typename T, int DMAX>
__global__ void fwd_kernel(Layout ly, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                           T* __restrict__ out, float* __restrict__ lse, float scale) {
  constexpr int kTile = TileOf<DMAX>::value;
  const int b = blockIdx.z, h = blockIdx.y, L = ly.len(b);
  const int i = blockIdx.x * kRows + threadIdx.x;
  if (blockIdx.x * kRows >= L) return;
  const int64_t base = ly.off(b, h), rs = ly.row_stride();
  const int D = ly.D;
  int lo, hi;
  ly.interval(b, i, L, lo, hi);
  __shared__ int s_lo, s_hi;
  if (threadIdx.x == 0) { s_lo = INT_MAX; s_hi = 0; }
  __syncthreads();
  if (hi > lo) { atomicMin(&s_lo, lo); atomicMax(&s_hi, hi); }
  __syncthreads();
  float qr[DMAX], acc[DMAX];
#pragma unroll
  for (int d = 0; d < DMAX; ++d) {
    qr[d] = (d < D && hi > lo) ? to_f(q[base + i * rs + d]) * scale : 0.f;
    acc[d] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  __shared__ float ks[kTile][DMAX], vs[kTile][DMAX];
  for (int t0 = s_lo; t0 < s_hi; t0 += kTile) {
    __syncthreads();
    for (int x = threadIdx.x; x < kTile * DMAX; x += blockDim.x) {  // columns >= D zeroed: the
      const int r = x / DMAX, d = x % DMAX, j = t0 + r;           // dot products run to DMAX
      const bool in = j < s_hi && d < D;
      ks[r][d] = in ? to_f(k[base + j * rs + d]) : 0.f;
      vs[r][d] = in ? to_f(v[base + j * rs + d]) : 0.f;
    }
    __syncthreads();
    for (int r = 0; r < kTile; ++r) {
      const int j = t0 + r;
      if (j < lo || j >= hi) continue;
      float s = 0.f;
#pragma unroll
      for (int d = 0; d < DMAX; ++d) s += qr[d] * ks[r][d];
      if (s > m) {  // new running max: rescale the accumulator (online softmax)
        const float c = __expf(m - s);
        l *= c;
#pragma unroll
        for (int d = 0; d < DMAX; ++d) acc[d] *= c;
        m = s;
      }
      const float p = __expf(s - m);
      l += p;
#pragma unroll
      for (int d = 0; d < DMAX; ++d) acc[d] += p * vs[r][d];
    }
  }
  if (i < L && hi > lo) {
    const float inv = 1.f / l;
    for (int d = 0; d < D; ++d) out[base + i * rs + d] = from_f<T>(acc[d] * inv);
    lse[ly.lse_off(b, h) + i] = m + logf(l);
  }
}

// dQ and D_i = rowsum(dO * O); one thread per query row.
template <typename T, int DMAX>
__global__ void bwd_dq_kernel(Layout ly, const T* __restrict__ dout, const T* __restrict__ q, const T* __restrict__ k,
                              const T* __restrict__ v, const T* __restrict__ out, const float* __restrict__ lse,
                              float* __restrict__ delta, T* __restrict__ dq, float scale) {
  constexpr int kTile = TileOf<DMAX>::value;
  const int b = blockIdx.z, h = blockIdx.y, L = ly.len(b);
  const int i = blockIdx.x * kRows + threadIdx.x;
  if (blockIdx.x * kRows >= L) return;
  const int64_t base = ly.off(b, h), rs = ly.row_stride(), lb = ly.lse_off(b, h);
  const int D = ly.D;
  int lo, hi;
  ly.interval(b, i, L, lo, hi);
  __shared__ int s_lo, s_hi;
  if (threadIdx.x == 0) { s_lo = INT_MAX; s_hi = 0; }
  __syncthreads();
  if (hi > lo) { atomicMin(&s_lo, lo); atomicMax(&s_hi, hi); }
  __syncthreads();
  float qr[DMAX], gr[DMAX], acc[DMAX];
  float di = 0.f;
#pragma unroll
  for (int d = 0; d < DMAX; ++d) {
    const bool ok = d < D && hi > lo;
    qr[d] = ok ? to_f(q[base + i * rs + d]) * scale : 0.f;
    gr[d] = ok ? to_f(dout[base + i * rs + d]) : 0.f;
    di += ok ? gr[d] * to_f(out[base + i * rs + d]) : 0.f;
    acc[d] = 0.f;
  }
  const float li = hi > lo ? lse[lb + i] : 0.f;
  if (hi > lo) delta[lb + i] = di;
  __shared__ float ks[kTile][DMAX], vs[kTile][DMAX];
  for (int t0 = s_lo; t0 < s_hi; t0 += kTile) {
    __syncthreads();
    for (int x = threadIdx.x; x < kTile * DMAX; x += blockDim.x) {  // columns >= D zeroed: the
      const int r = x / DMAX, d = x % DMAX, j = t0 + r;           // dot products run to DMAX
      const bool in = j < s_hi && d < D;
      ks[r][d] = in ? to_f(k[base + j * rs + d]) : 0.f;
      vs[r][d] = in ? to_f(v[base + j * rs + d]) : 0.f;
    }
    __syncthreads();
    for (int r = 0; r < kTile; ++r) {
      const int j = t0 + r;
      if (j < lo || j >= hi) continue;
      float s = 0.f, dp = 0.f;
#pragma unroll
      for (int d = 0; d < DMAX; ++d) { s += qr[d] * ks[r][d]; dp += gr[d] * vs[r][d]; }
      const float ds = __expf(s - li) * (dp - di);
#pragma unroll
      for (int d = 0; d < DMAX; ++d) acc[d] += ds * ks[r][d];
    }
  }
  if (i < L && hi > lo)
    for (int d = 0; d < D; ++d) dq[base + i * rs + d] = from_f<T>(acc[d] * scale);
}

// dK, dV; one thread per key row, looping over the query rows that see it.
template <typename T, int DMAX>
__global__ void bwd_dkdv_kernel(Layout ly, const T* __restrict__ dout, const T* __restrict__ q, const T* __restrict__ k,
                                const T* __restrict__ v, const float* __restrict__ lse, const float* __restrict__ delta,
                                T* __restrict__ dk, T* __restrict__ dv, float scale) {
  constexpr int kTile = TileOf<DMAX>::value;
  const int b = blockIdx.z, h = blockIdx.y, L = ly.len(b);
  const int j = blockIdx.x * kRows + threadIdx.x;
  if (blockIdx.x * kRows >= L) return;
  const int64_t base = ly.off(b, h), rs = ly.row_stride(), lb = ly.lse_off(b, h);
  const int D = ly.D;
  const bool valid = j < L;
  float kr[DMAX], vr[DMAX], dka[DMAX], dva[DMAX];
#pragma unroll
  for (int d = 0; d < DMAX; ++d) {
    kr[d] = (valid && d < D) ? to_f(k[base + j * rs + d]) : 0.f;
    vr[d] = (valid && d < D) ? to_f(v[base + j * rs + d]) : 0.f;
    dka[d] = dva[d] = 0.f;
  }
  __shared__ float qs[kTile][DMAX], gs[kTile][DMAX];
  __shared__ float ls[kTile], ds_[kTile];
  __shared__ int los[kTile], his[kTile];
  for (int t0 = 0; t0 < L; t0 += kTile) {
    __syncthreads();
    for (int x = threadIdx.x; x < kTile * DMAX; x += blockDim.x) {  // columns >= D zeroed (as above)
      const int r = x / DMAX, d = x % DMAX, i = t0 + r;
      const bool in = i < L && d < D;
      qs[r][d] = in ? to_f(q[base + i * rs + d]) * scale : 0.f;
      gs[r][d] = in ? to_f(dout[base + i * rs + d]) : 0.f;
    }
    for (int r = threadIdx.x; r < kTile; r += blockDim.x) {
      const int i = t0 + r;
      int lo, hi;
      ly.interval(b, i, L, lo, hi);
      los[r] = lo; his[r] = hi;
      ls[r] = hi > lo ? lse[lb + i] : 0.f;
      ds_[r] = hi > lo ? delta[lb + i] : 0.f;
    }
    __syncthreads();
    if (!valid) continue;
    for (int r = 0; r < kTile; ++r) {
      if (j < los[r] || j >= his[r]) continue;
      float s = 0.f, dp = 0.f;
#pragma unroll
      for (int d = 0; d < DMAX; ++d) { s += qs[r][d] * kr[d]; dp += gs[r][d] * vr[d]; }
      const float p = __expf(s - ls[r]);
      const float dsv = p * (dp - ds_[r]);
#pragma unroll
      for (int d = 0; d < DMAX; ++d) { dva[d] += p * gs[r][d]; dka[d] += dsv * qs[r][d]; }
    }
  }
  if (valid)
    for (int d = 0; d < D; ++d) {
      dk[base + j * rs + d] = from_f<T>(dka[d]);  // qs already carries the scale
      dv[base + j * rs + d] = from_f<T>(dva[d]);
    }
}

Layout make_layout(const at::Tensor& q, const c10::optional<at::Tensor>& seg, const c10::optional<at::Tensor>& cu,
                   bool causal, int64_t max_seqlen, int& n_groups, int& max_len) {
  Layout ly{};
  ly.causal = causal;
  if (cu.has_value()) {
    TORCH_CHECK(q.dim() == 3, "rag_attn varlen: q must be (T, H, D)");
    TORCH_CHECK(cu->is_cuda() && cu->scalar_type() == at::kInt, "rag_attn: cu_seqlens must be int32 on the GPU");
    ly.cu = cu->data_ptr<int>();
    ly.B = int(cu->size(0) - 1); ly.T = int(q.size(0)); ly.H = int(q.size(1)); ly.D = int(q.size(2));
    n_groups = ly.B; max_len = int(max_seqlen);
  } else {
    TORCH_CHECK(q.dim() == 4, "rag_attn: q must be (B, H, S, D)");
    ly.B = int(q.size(0)); ly.H = int(q.size(1)); ly.S = int(q.size(2)); ly.D = int(q.size(3));
    if (seg.has_value()) {
      TORCH_CHECK(seg->is_cuda() && seg->scalar_type() == at::kInt, "rag_attn: seg_offsets must be int32 on the GPU");
      ly.seg = seg->data_ptr<int>();
      ly.n_seg = int(seg->size(1) - 1);
      ly.causal = false;
    }
    n_groups = ly.B; max_len = ly.S;
  }
  TORCH_CHECK(ly.D <= 256, "rag_attn (CUDA): head size must be <= 256");
  return ly;
}

#define RAG_ATTN_DISPATCH_D(D, ...)                        \
  [&] {                                                     \
    if ((D) <= 64) { constexpr int DMAX = 64; return __VA_ARGS__(); }   \
    if ((D) <= 128) { constexpr int DMAX = 128; return __VA_ARGS__(); } \
    constexpr int DMAX = 256; return __VA_ARGS__();                     \
  }()

template <typename F>
void dispatch_type(at::ScalarType st, F&& f) {
  if (st == at::kFloat) f(float{});
  else if (st == at::kHalf) f(__half{});
  else if (st == at::kBFloat16) f(__nv_bfloat16{});
  else TORCH_CHECK(false, "rag_attn (CUDA): dtype must be float32, float16 or bfloat16, got ", st);
}

// One dtype for q, k and v: the kernels read all three buffers as q's element type.
void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.sizes() == k.sizes() && q.sizes() == v.sizes(), "rag_attn: q, k, v must have the same shape");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "rag_attn: q, k, v must have the same dtype (got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
              v.scalar_type(), ")");
}

std::tuple<at::Tensor, at::Tensor> fwd_cuda(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                                            const c10::optional<at::Tensor>& seg, const c10::optional<at::Tensor>& cu,
                                            int64_t max_seqlen, bool causal, double scale) {
  check_inputs(q_, k_, v_);
  const c10::cuda::CUDAGuard guard(q_.device());
  const auto q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
  int n_groups = 0, max_len = 0;
  const Layout ly = make_layout(q, seg, cu, causal, max_seqlen, n_groups, max_len);
  auto out = at::zeros_like(q);
  std::vector<int64_t> lse_shape = cu.has_value() ? std::vector<int64_t>{q.size(1), q.size(0)}
                                                  : std::vector<int64_t>{q.size(0), q.size(1), q.size(2)};
  auto lse = at::full(lse_shape, -std::numeric_limits<float>::infinity(), q.options().dtype(at::kFloat));
  if (q.numel() == 0 || max_len == 0) return {out, lse};
  const dim3 grid((max_len + kRows - 1) / kRows, ly.H, n_groups);
  auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch_type(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    RAG_ATTN_DISPATCH_D(ly.D, [&] {
      fwd_kernel<T, DMAX><<<grid, kRows, 0, stream>>>(
          ly, reinterpret_cast<const T*>(q.data_ptr()), reinterpret_cast<const T*>(k.data_ptr()),
          reinterpret_cast<const T*>(v.data_ptr()), reinterpret_cast<T*>(out.data_ptr()), lse.data_ptr<float>(),
          float(scale));
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cuda(const at::Tensor& dout_, const at::Tensor& q_,
                                                        const at::Tensor& k_, const at::Tensor& v_,
                                                        const at::Tensor& out_, const at::Tensor& lse_,
                                                        const c10::optional<at::Tensor>& seg,
                                                        const c10::optional<at::Tensor>& cu, int64_t max_seqlen,
                                                        bool causal, double scale) {
  check_inputs(q_, k_, v_);
  TORCH_CHECK(lse_.scalar_type() == at::kFloat, "rag_attn (CUDA): lse must be float32");
  const c10::cuda::CUDAGuard guard(q_.device());
  const auto q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
  const auto dout = dout_.to(q.scalar_type()).contiguous(), out = out_.contiguous(), lse = lse_.contiguous();
  int n_groups = 0, max_len = 0;
  const Layout ly = make_layout(q, seg, cu, causal, max_seqlen, n_groups, max_len);
  auto dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
  auto delta = at::zeros_like(lse);
  if (q.numel() == 0 || max_len == 0) return {dq, dk, dv};
  const dim3 grid((max_len + kRows - 1) / kRows, ly.H, n_groups);
  auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch_type(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    RAG_ATTN_DISPATCH_D(ly.D, [&] {
      const T* qp = reinterpret_cast<const T*>(q.data_ptr());
      const T* kp = reinterpret_cast<const T*>(k.data_ptr());
      const T* vp = reinterpret_cast<const T*>(v.data_ptr());
      const T* gp = reinterpret_cast<const T*>(dout.data_ptr());
      bwd_dq_kernel<T, DMAX><<<grid, kRows, 0, stream>>>(ly, gp, qp, kp, vp, reinterpret_cast<const T*>(out.data_ptr()),
                                                         lse.data_ptr<float>(), delta.data_ptr<float>(),
                                                         reinterpret_cast<T*>(dq.data_ptr()), float(scale));
      bwd_dkdv_kernel<T, DMAX><<<grid, kRows, 0, stream>>>(ly, gp, qp, kp, vp, lse.data_ptr<float>(),
                                                           delta.data_ptr<float>(), reinterpret_cast<T*>(dk.data_ptr()),
                                                           reinterpret_cast<T*>(dv.data_ptr()), float(scale));
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY_IMPL(rag_attn, CUDA, m) {
  m.impl("fwd", &fwd_cuda);
  m.impl("bwd", &bwd_cuda);
}

}  // namespace rag_attn::cuda
