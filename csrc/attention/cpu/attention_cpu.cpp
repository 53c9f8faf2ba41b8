// CPU kernels of rag_attn::fwd / rag_attn::bwd: FlashAttention-2 on the CPU.
//
// Forward (Dao 2023, Alg. 1): for each block of query rows, walk the key interval in blocks,
// S = scale * Q K^T (BLAS), online softmax (running max m, running sum l, rescale the fp32 output
// accumulator by exp(m_old - m_new)), O += P V; finally O /= l and lse = m + log l. Only the
// (block_q x block_k) score tile exists at any time; key blocks outside an item's interval are
// never visited (that skip is where causal, varlen and retrieval layouts gain).
//
// Backward (Alg. 2): per (sequence, head) group, recompute P = exp(scale * Q K^T - lse),
// dV += P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)), dQ += scale * dS K,
// dK += scale * dS^T Q. dK/dV accumulate in fp32 per group, so groups run independently.
//
// Parallelism: at::parallel_for starts one task per thread; tasks pull work (items forward, groups
// backward, costliest first) from an atomic counter, which balances ragged layouts.
//
// Three implementations of that algorithm, picked per call (kernel_for): the AVX-512 and AVX2
// kernels (fast_avx512.h, fast_avx2.h: register-blocked micro-kernels, transposed score tile,
// vector exp; fp32 and bf16) and the generic kernels below (BLAS per tile + loops; every dtype,
// head size and CPU). Which vector ISA may run is decided at run time (isa.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "../layout.h"
#include "blas.h"
#include "common.h"
#include "fast_avx2.h"
#include "fast_avx512.h"
#include "isa.h"
#include "vec.h"

namespace rag_attn::cpu {

// ---- ISA selection (isa.h) -----------------------------------------------------------------------
const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "generic";
  }
}

Isa isa_from_name(const std::string& name) {
  if (name == "avx512") return Isa::kAvx512;
  if (name == "avx2") return Isa::kAvx2;
  if (name == "generic") return Isa::kGeneric;
  TORCH_CHECK(false, "rag_attn: unknown CPU ISA '", name, "' (expected avx512, avx2 or generic)");
}

Isa best_isa() {
#if RAG_ATTN_X86_DISPATCH
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
  return Isa::kGeneric;
}

bool cpu_has_avx512_bf16() {
#if RAG_ATTN_X86_DISPATCH
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

namespace {
// The ISA in force: best_isa(), capped by RAG_ATTN_ISA (read once) or set_isa(); RAG_ATTN_FAST=0
// (the older switch) means generic.
std::atomic<int> g_isa{-1};

Isa initial_isa() {
  Isa isa = kFastEnabled ? best_isa() : Isa::kGeneric;
  if (const char* env = std::getenv("RAG_ATTN_ISA"); env != nullptr && *env != '\0') {
    const Isa want = isa_from_name(env);
    TORCH_CHECK(int(want) <= int(best_isa()), "rag_attn: RAG_ATTN_ISA=", env, " but this CPU (or build) supports ",
                isa_name(best_isa()), " at most");
    isa = want;
  }
  return isa;
}
}  // namespace

Isa active_isa() {
  int v = g_isa.load(std::memory_order_relaxed);
  if (v < 0) {
    int expected = -1;
    g_isa.compare_exchange_strong(expected, int(initial_isa()));
    v = g_isa.load();
  }
  return Isa(v);
}

void set_isa(Isa isa) {
  TORCH_CHECK(int(isa) <= int(best_isa()), "rag_attn: ISA ", isa_name(isa), " requested but this CPU (or build) supports ",
              isa_name(best_isa()), " at most");
  g_isa.store(int(isa));
}

namespace {


template <typename scalar_t>
void forward_impl(const Plan& plan, const scalar_t* q, const scalar_t* k, const scalar_t* v, scalar_t* out,
                  acc_of<scalar_t>* lse, int64_t D, double scale_d) {
  using acc_t = acc_of<scalar_t>;
  constexpr bool kNeedCast = !std::is_same_v<scalar_t, acc_t>;
  const acc_t scale = acc_t(scale_d);
  const int64_t rs = plan.row_stride;
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();

  WorkQueue queue(item_costs(plan));
  at::parallel_for(0, queue.tasks(), 1, [&](int64_t tb, int64_t te) {
    // per-task scratch, reused across items: scores, cast probabilities, accumulator, row stats
    std::vector<acc_t> s_buf(kBlockQ * kBlockK), acc(kBlockQ * D), m_i(kBlockQ), l_i(kBlockQ);
    std::vector<scalar_t> p_cast(kNeedCast ? kBlockQ * kBlockK : 0);
    for (int64_t t = tb; t < te; ++t) {
      for (int64_t ix; queue.pop(ix);) {
        const Item& it = plan.items[ix];
        const Group& g = plan.groups[it.group];
        const int64_t m = it.r1 - it.r0;
        const scalar_t* Q = q + g.off + it.r0 * rs;
        const int64_t k_end = it.causal ? std::min<int64_t>(it.k_hi, it.r1) : it.k_hi;
        std::fill(acc.begin(), acc.begin() + m * D, acc_t(0));
        std::fill(m_i.begin(), m_i.begin() + m, neg_inf);
        std::fill(l_i.begin(), l_i.begin() + m, acc_t(0));
        for (int64_t kb = it.k_lo; kb < k_end; kb += kBlockK) {
          const int64_t n = std::min<int64_t>(kBlockK, k_end - kb);
          acc_t* S = s_buf.data();
          gemm(false, true, int(m), int(n), int(D), scale, Q, int(rs), k + g.off + kb * rs, int(rs), acc_t(0), S,
               int(kBlockK));
          for (int64_t i = 0; i < m; ++i) {
            acc_t* row = S + i * kBlockK;
            const int64_t nv = visible(it.causal, it.r0 + i, kb, n);
            if (nv == 0) {  // every key of this block lies after the row (causal)
              std::fill(row, row + n, acc_t(0));
              if constexpr (kNeedCast) std::fill(p_cast.data() + i * kBlockK, p_cast.data() + i * kBlockK + n, scalar_t(0));
              continue;
            }
            const acc_t m_new = std::max(m_i[i], row_max(row, nv));
            const acc_t alpha = m_i[i] == neg_inf ? acc_t(0) : exp_fast(m_i[i] - m_new);
            const acc_t s = exp_sub_sum(row, nv, m_new);
            std::fill(row + nv, row + n, acc_t(0));
            l_i[i] = l_i[i] * alpha + s;
            m_i[i] = m_new;
            if (alpha != acc_t(1)) scale_row(acc.data() + i * D, D, alpha);
            if constexpr (kNeedCast) convert(p_cast.data() + i * kBlockK, row, n);
          }
          const scalar_t* P;
          if constexpr (kNeedCast) P = p_cast.data(); else P = S;
          gemm(false, false, int(m), int(D), int(n), acc_t(1), P, int(kBlockK), v + g.off + kb * rs, int(rs),
               acc_t(1), acc.data(), int(D));
        }
        for (int64_t i = 0; i < m; ++i) {
          const acc_t inv = l_i[i] > 0 ? acc_t(1) / l_i[i] : acc_t(0);
          scalar_t* o = out + g.off + (it.r0 + i) * rs;
          const acc_t* a = acc.data() + i * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] = scalar_t(a[d] * inv);
          lse[g.lse_off + it.r0 + i] =
              l_i[i] > 0 ? m_i[i] + std::log(l_i[i]) : neg_inf;
        }
      }
    }
  });
}


template <typename scalar_t>
void backward_impl(const Plan& plan, const scalar_t* dout, const scalar_t* q, const scalar_t* k,
                   const scalar_t* v, const scalar_t* out, const acc_of<scalar_t>* lse, scalar_t* dq, scalar_t* dk,
                   scalar_t* dv, int64_t D, double scale_d) {
  using acc_t = acc_of<scalar_t>;
  constexpr bool kNeedCast = !std::is_same_v<scalar_t, acc_t>;
  const acc_t scale = acc_t(scale_d);
  const int64_t rs = plan.row_stride;

  WorkQueue queue(group_costs(plan));
  at::parallel_for(0, queue.tasks(), 1, [&](int64_t tb, int64_t te) {
    std::vector<acc_t> p_buf(kBlockQ * kBlockK), dp_buf(kBlockQ * kBlockK), dq_acc(kBlockQ * D), di(kBlockQ);
    std::vector<scalar_t> p_cast(kNeedCast ? kBlockQ * kBlockK : 0), ds_cast(kNeedCast ? kBlockQ * kBlockK : 0);
    std::vector<acc_t> dk_acc, dv_acc;  // (len, D) of the current group, fp32
    for (int64_t t = tb; t < te; ++t) {
      for (int64_t gi; queue.pop(gi);) {
        const Group& g = plan.groups[gi];
        if (plan.item_begin[gi] == plan.item_begin[gi + 1]) continue;
        dk_acc.assign(g.len * D, acc_t(0));
        dv_acc.assign(g.len * D, acc_t(0));
        const scalar_t* K = k + g.off;
        const scalar_t* V = v + g.off;
        for (int64_t x = plan.item_begin[gi]; x < plan.item_begin[gi + 1]; ++x) {
          const Item& it = plan.items[x];
          const int64_t m = it.r1 - it.r0;
          const scalar_t* Q = q + g.off + it.r0 * rs;
          const scalar_t* dO = dout + g.off + it.r0 * rs;
          const scalar_t* O = out + g.off + it.r0 * rs;
          const acc_t* L = lse + g.lse_off + it.r0;
          for (int64_t i = 0; i < m; ++i) {  // D_i = rowsum(dO * O)  (FA2 preprocessing)
            acc_t s = 0;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; ++d) s += acc_t(dO[i * rs + d]) * acc_t(O[i * rs + d]);
            di[i] = s;
          }
          std::fill(dq_acc.begin(), dq_acc.begin() + m * D, acc_t(0));
          const int64_t k_end = it.causal ? std::min<int64_t>(it.k_hi, it.r1) : it.k_hi;
          for (int64_t kb = it.k_lo; kb < k_end; kb += kBlockK) {
            const int64_t n = std::min<int64_t>(kBlockK, k_end - kb);
            acc_t* P = p_buf.data();
            acc_t* dP = dp_buf.data();
            gemm(false, true, int(m), int(n), int(D), scale, Q, int(rs), K + kb * rs, int(rs), acc_t(0), P,
                 int(kBlockK));
            gemm(false, true, int(m), int(n), int(D), acc_t(1), dO, int(rs), V + kb * rs, int(rs), acc_t(0), dP,
                 int(kBlockK));
            for (int64_t i = 0; i < m; ++i) {
              acc_t* p = P + i * kBlockK;
              acc_t* dp = dP + i * kBlockK;
              const int64_t nv = visible(it.causal, it.r0 + i, kb, n);
              const acc_t li = acc_t(L[i]);
              const acc_t dii = di[i];
              softmax_grad_row(p, dp, nv, li, dii);  // p = P, dp = dS
              for (int64_t j = nv; j < n; ++j) p[j] = dp[j] = acc_t(0);
              if constexpr (kNeedCast) {
                convert(p_cast.data() + i * kBlockK, p, n);
                convert(ds_cast.data() + i * kBlockK, dp, n);
              }
            }
            const scalar_t *Pc, *dSc;
            if constexpr (kNeedCast) {
              Pc = p_cast.data();
              dSc = ds_cast.data();
            } else {
              Pc = P;
              dSc = dP;
            }
            // dV[kb:kb+n] += P^T dO ;  dK[kb:kb+n] += scale dS^T Q ;  dQ += scale dS K
            gemm(true, false, int(n), int(D), int(m), acc_t(1), Pc, int(kBlockK), dO, int(rs), acc_t(1),
                 dv_acc.data() + kb * D, int(D));
            gemm(true, false, int(n), int(D), int(m), scale, dSc, int(kBlockK), Q, int(rs), acc_t(1),
                 dk_acc.data() + kb * D, int(D));
            gemm(false, false, int(m), int(D), int(n), scale, dSc, int(kBlockK), K + kb * rs, int(rs), acc_t(1),
                 dq_acc.data(), int(D));
          }
          for (int64_t i = 0; i < m; ++i) convert(dq + g.off + (it.r0 + i) * rs, dq_acc.data() + i * D, D);
        }
        for (int64_t j = 0; j < g.len; ++j) {
          convert(dk + g.off + j * rs, dk_acc.data() + j * D, D);
          convert(dv + g.off + j * rs, dv_acc.data() + j * D, D);
        }
      }
    }
  });
}

// The kernel a call runs, by the ISA in force, the dtype and the head size D: AVX-512 for fp32
// with D % 16 == 0 (bf16 also needs AVX512-BF16), else AVX2 for fp32 / bf16 with D % 8 == 0, else
// generic (float64, other head sizes, RAG_ATTN_BQ above the vector kernels' 64-row tile).
Isa kernel_for(at::ScalarType dtype, int64_t D) {
  const Isa isa = active_isa();
  const bool bf16 = dtype == at::kBFloat16;
  if ((dtype != at::kFloat && !bf16) || kBlockQ > kFastBQ) return Isa::kGeneric;
  if (isa == Isa::kAvx512 && D % 16 == 0 && (!bf16 || cpu_has_avx512_bf16())) return Isa::kAvx512;
  if (int(isa) >= int(Isa::kAvx2) && D % 8 == 0) return Isa::kAvx2;
  return Isa::kGeneric;
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.sizes() == k.sizes() && q.sizes() == v.sizes(), "rag_attn: q, k, v must have the same shape");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "rag_attn: q, k, v must have the same dtype");
  const auto st = q.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kDouble,
              "rag_attn (CPU): dtype must be float32, bfloat16 or float64, got ", st);
}

std::tuple<at::Tensor, at::Tensor> fwd_cpu(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                                           const c10::optional<at::Tensor>& seg_offsets,
                                           const c10::optional<at::Tensor>& cu_seqlens, int64_t max_seqlen,
                                           bool causal, double scale) {
  check_inputs(q_, k_, v_);
  const auto q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
  const Plan plan = make_plan(q, seg_offsets, cu_seqlens, causal, kBlockQ);
  const int64_t D = q.size(-1);
  std::vector<int64_t> lse_shape = cu_seqlens.has_value() ? std::vector<int64_t>{q.size(1), q.size(0)}
                                                          : std::vector<int64_t>{q.size(0), q.size(1), q.size(2)};
  auto out = plan.has_padding ? at::zeros_like(q) : at::empty_like(q);
  auto lse = at::full(lse_shape, -std::numeric_limits<float>::infinity(), 
                       q.options().dtype(q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
  [[maybe_unused]] const Isa isa = kernel_for(q.scalar_type(), D);  // unused without x86 dispatch
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "rag_attn_fwd_cpu", [&] {
#if RAG_ATTN_X86_DISPATCH
    if constexpr (!std::is_same_v<scalar_t, double>) {
      if (isa == Isa::kAvx512)
        return avx512::forward_fast<scalar_t>(plan, q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(),
                                              v.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                              lse.data_ptr<float>(), D, scale);
      if (isa == Isa::kAvx2)
        return avx2::forward_fast<scalar_t>(plan, q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(),
                                            v.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), lse.data_ptr<float>(),
                                            D, scale);
    }
#endif
    forward_impl<scalar_t>(plan, q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                           out.data_ptr<scalar_t>(), lse.data_ptr<acc_of<scalar_t>>(), D, scale);
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cpu(const at::Tensor& dout_, const at::Tensor& q_,
                                                       const at::Tensor& k_, const at::Tensor& v_,
                                                       const at::Tensor& out_, const at::Tensor& lse_,
                                                       const c10::optional<at::Tensor>& seg_offsets,
                                                       const c10::optional<at::Tensor>& cu_seqlens,
                                                       int64_t max_seqlen, bool causal, double scale) {
  check_inputs(q_, k_, v_);
  TORCH_CHECK(dout_.sizes() == q_.sizes() && out_.sizes() == q_.sizes(), "rag_attn: grad_out/out shape mismatch");
  TORCH_CHECK(lse_.scalar_type() == (q_.scalar_type() == at::kDouble ? at::kDouble : at::kFloat),
              "rag_attn: lse must be float32 (float64 for float64 inputs)");
  const auto q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
  const auto dout = dout_.to(q.scalar_type()).contiguous(), out = out_.contiguous(), lse = lse_.contiguous();
  const Plan plan = make_plan(q, seg_offsets, cu_seqlens, causal, kBlockQ);
  const int64_t D = q.size(-1);
  auto dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
  [[maybe_unused]] const Isa isa = kernel_for(q.scalar_type(), D);  // unused without x86 dispatch
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "rag_attn_bwd_cpu", [&] {
#if RAG_ATTN_X86_DISPATCH
    if constexpr (!std::is_same_v<scalar_t, double>) {
      if (isa == Isa::kAvx512)
        return avx512::backward_fast<scalar_t>(plan, dout.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(),
                                               k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                                               out.data_ptr<scalar_t>(), lse.data_ptr<float>(),
                                               dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(),
                                               dv.data_ptr<scalar_t>(), D, scale);
      if (isa == Isa::kAvx2)
        return avx2::backward_fast<scalar_t>(plan, dout.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(),
                                             k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                             lse.data_ptr<float>(), dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(),
                                             dv.data_ptr<scalar_t>(), D, scale);
    }
#endif
    backward_impl<scalar_t>(plan, dout.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(),
                            v.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), lse.data_ptr<acc_of<scalar_t>>(),
                            dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(), D, scale);
  });
  return {dq, dk, dv};
}

std::string cpu_isa_op(bool best) { return isa_name(best ? best_isa() : active_isa()); }

std::string cpu_set_isa_op(const std::string& name) {
  const std::string before = isa_name(active_isa());
  set_isa(name.empty() ? best_isa() : isa_from_name(name));
  return before;
}

std::string cpu_kernel_op(at::ScalarType dtype, int64_t head_dim) { return isa_name(kernel_for(dtype, head_dim)); }

}  // namespace

// CPU-only helpers (no tensor arguments, so registered as catch-all kernels with their schema):
//   cpu_isa(best=False) -> str       ISA in force: "avx512", "avx2" or "generic" (best: the CPU's best)
//   cpu_set_isa(str isa) -> str      cap it ("" = the CPU's best); returns the previous one
//   cpu_kernel(dtype, head_dim)      the kernel fwd/bwd run for that dtype and head size
TORCH_LIBRARY_FRAGMENT(rag_attn, m) {
  m.def("cpu_isa(bool best=False) -> str", &cpu_isa_op);
  m.def("cpu_set_isa(str isa) -> str", &cpu_set_isa_op);
  m.def("cpu_kernel(ScalarType dtype, int head_dim) -> str", &cpu_kernel_op);
}

TORCH_LIBRARY_IMPL(rag_attn, CPU, m) {
  m.impl("fwd", &fwd_cpu);
  m.impl("bwd", &bwd_cpu);
}

}  // namespace rag_attn::cpu
