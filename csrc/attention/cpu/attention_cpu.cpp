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
#include "vec.h"

namespace rag_attn::cpu {
namespace {

// Query rows per item and keys per inner step. 64 x 256 fp32 scores (64 KiB) plus the output
// accumulator stay in L2 (1 MiB per core here); larger key blocks amortise the BLAS call overhead.
int64_t env_or(const char* name, int64_t dflt) {
  const char* v = std::getenv(name);
  return v ? std::atoll(v) : dflt;
}
const int64_t kBlockQ = env_or("RAG_ATTN_BQ", 64);
const int64_t kBlockK = env_or("RAG_ATTN_BK", 256);

// Number of keys in [kb, kb + n) that row `row` may see (all of them unless causal).
inline int64_t visible(bool causal, int64_t row, int64_t kb, int64_t n) {
  return causal ? std::min<int64_t>(std::max<int64_t>(row - kb + 1, 0), n) : n;
}

// Accumulation type: fp32 for fp32/bf16 inputs (FlashAttention), fp64 for gradcheck inputs.
template <typename T>
using acc_of = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename scalar_t>
void forward_impl(const Plan& plan, const scalar_t* q, const scalar_t* k, const scalar_t* v, scalar_t* out,
                  acc_of<scalar_t>* lse, int64_t D, double scale_d) {
  using acc_t = acc_of<scalar_t>;
  constexpr bool kNeedCast = !std::is_same_v<scalar_t, acc_t>;
  const acc_t scale = acc_t(scale_d);
  const int64_t rs = plan.row_stride;
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();

  std::vector<int64_t> order(plan.items.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return plan.items[a].cost() > plan.items[b].cost(); });

  std::atomic<int64_t> next{0};
  const int64_t n_work = int64_t(order.size());
  const int64_t n_tasks = std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(n_work, 1));
  at::parallel_for(0, n_tasks, 1, [&](int64_t tb, int64_t te) {
    // per-task scratch, reused across items: scores, cast probabilities, accumulator, row stats
    std::vector<acc_t> s_buf(kBlockQ * kBlockK), acc(kBlockQ * D), m_i(kBlockQ), l_i(kBlockQ);
    std::vector<scalar_t> p_cast(kNeedCast ? kBlockQ * kBlockK : 0);
    for (int64_t t = tb; t < te; ++t) {
      for (int64_t w = next.fetch_add(1); w < n_work; w = next.fetch_add(1)) {
        const Item& it = plan.items[order[w]];
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
  const int64_t G = int64_t(plan.groups.size());

  std::vector<int64_t> order(G), cost(G, 0);
  for (int64_t gi = 0; gi < G; ++gi)
    for (int64_t x = plan.item_begin[gi]; x < plan.item_begin[gi + 1]; ++x) cost[gi] += plan.items[x].cost();
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });

  std::atomic<int64_t> next{0};
  const int64_t n_tasks = std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(G, 1));
  at::parallel_for(0, n_tasks, 1, [&](int64_t tb, int64_t te) {
    std::vector<acc_t> p_buf(kBlockQ * kBlockK), dp_buf(kBlockQ * kBlockK), dq_acc(kBlockQ * D), di(kBlockQ);
    std::vector<scalar_t> p_cast(kNeedCast ? kBlockQ * kBlockK : 0), ds_cast(kNeedCast ? kBlockQ * kBlockK : 0);
    std::vector<acc_t> dk_acc, dv_acc;  // (len, D) of the current group, fp32
    for (int64_t t = tb; t < te; ++t) {
      for (int64_t w = next.fetch_add(1); w < G; w = next.fetch_add(1)) {
        const int64_t gi = order[w];
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
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "rag_attn_fwd_cpu", [&] {
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
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "rag_attn_bwd_cpu", [&] {
    backward_impl<scalar_t>(plan, dout.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(),
                            v.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), lse.data_ptr<acc_of<scalar_t>>(),
                            dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(), D, scale);
  });
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY_IMPL(rag_attn, CPU, m) {
  m.impl("fwd", &fwd_cpu);
  m.impl("bwd", &bwd_cpu);
}

}  // namespace rag_attn::cpu
