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
#include "ukernel.h"
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

// The work queue of every kernel here: indices costliest first (ragged layouts balance when the
// big items start early), pulled from an atomic counter by one task per thread.
class WorkQueue {
 public:
  explicit WorkQueue(const std::vector<int64_t>& cost) : order_(cost.size()) {
    std::iota(order_.begin(), order_.end(), 0);
    std::stable_sort(order_.begin(), order_.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  }
  int64_t tasks() const {  // one per thread, at most one per index
    return std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(int64_t(order_.size()), 1));
  }
  bool pop(int64_t& index) {  // the next index to work on; false when none is left
    const int64_t w = next_.fetch_add(1);
    if (w >= int64_t(order_.size())) return false;
    index = order_[w];
    return true;
  }

 private:
  std::vector<int64_t> order_;
  std::atomic<int64_t> next_{0};
};

std::vector<int64_t> item_costs(const Plan& plan) {
  std::vector<int64_t> cost(plan.items.size());
  for (size_t x = 0; x < cost.size(); ++x) cost[x] = plan.items[x].cost();
  return cost;
}

// Backward works per (sequence, head) group: a group costs the sum of its items.
std::vector<int64_t> group_costs(const Plan& plan) {
  std::vector<int64_t> cost(plan.groups.size(), 0);
  for (size_t gi = 0; gi < cost.size(); ++gi)
    for (int64_t x = plan.item_begin[gi]; x < plan.item_begin[gi + 1]; ++x) cost[gi] += plan.items[x].cost();
  return cost;
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

#if defined(__AVX512F__)
// ---- Forward with register-blocked AVX-512 micro-kernels (fp32; bf16 with AVX512-BF16) -------
//
// Same algorithm as forward_impl, but the score tile is kept transposed, S^T (keys x queries,
// kFastBQ = 64 query lanes per key row): scores come from K rows times a Q^T tile packed once per
// item, the online-softmax max / exp / sum run vertically over key rows with the 16 query rows of
// a zmm in parallel (no horizontal reductions, the causal mask is one vector compare), and
// O += P V reads P^T with a stride, so neither K nor V (fp32) is ever repacked. bf16 pairs
// the reduction dimension for vdpbf16ps: Q^T and P^T are written as bf16 pairs, V is packed to
// pairs of rows once per call (one extra V-sized buffer).
constexpr int64_t kFastBQ = 64;
const int64_t kFastBK = env_or("RAG_ATTN_FAST_BK", 256);
const bool kFastEnabled = env_or("RAG_ATTN_FAST", 1) != 0;

template <typename scalar_t>
constexpr bool fast_dtype() {
#if defined(__AVX512BF16__)
  return std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>;
#else
  return std::is_same_v<scalar_t, float>;
#endif
}

// C (M x ncols) = alpha A B or C += A B with ncols = 16*nv (nv in 1..4, last vector masked).
template <typename scalar_t, bool ACC>
inline void tile_gemm(int nv, int64_t M, int64_t K, const void* A, int64_t sa, int64_t sp, const void* B,
                      int64_t ldb, float* C, int64_t ldc, __mmask16 last, float alpha, float* cmax) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    const float *a = static_cast<const float*>(A), *b = static_cast<const float*>(B);
    switch (nv) {
      case 1: gemm_rows_f32<12, 1, ACC>(M, K, a, sa, sp, b, ldb, C, ldc, last, alpha, cmax); break;
      case 2: gemm_rows_f32<12, 2, ACC>(M, K, a, sa, sp, b, ldb, C, ldc, last, alpha, cmax); break;
      case 3: gemm_rows_f32<8, 3, ACC>(M, K, a, sa, sp, b, ldb, C, ldc, last, alpha, cmax); break;
      default: gemm_rows_f32<6, 4, ACC>(M, K, a, sa, sp, b, ldb, C, ldc, last, alpha, cmax); break;
    }
  } else {
#if defined(__AVX512BF16__)
    const uint32_t *a = static_cast<const uint32_t*>(A), *b = static_cast<const uint32_t*>(B);
    switch (nv) {
      case 1: gemm_rows_bf16<12, 1, ACC>(M, K, a, sa, sp, b, ldb, C, ldc, last, alpha, cmax); break;
      case 2: gemm_rows_bf16<12, 2, ACC>(M, K, a, sa, sp, b, ldb, C, ldc, last, alpha, cmax); break;
      case 3: gemm_rows_bf16<8, 3, ACC>(M, K, a, sa, sp, b, ldb, C, ldc, last, alpha, cmax); break;
      default: gemm_rows_bf16<6, 4, ACC>(M, K, a, sa, sp, b, ldb, C, ldc, last, alpha, cmax); break;
    }
#endif
  }
}

template <typename scalar_t>
void forward_fast(const Plan& plan, const scalar_t* q, const scalar_t* k, const scalar_t* v, scalar_t* out,
                  float* lse, int64_t D, double scale_d) {
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  constexpr int64_t BQ = kFastBQ;
  const int64_t BK = (kFastBK + 1) / 2 * 2;  // even: bf16 pairs never straddle two key blocks
  const float scale = float(scale_d);
  const int64_t rs = plan.row_stride;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t G = int64_t(plan.groups.size());

  // bf16: V of every group as pairs of rows (VNNI): vv[g][p][d] = (V[2p, d], V[2p+1, d]).
  std::vector<int64_t> vv_off(G + 1, 0);
  std::vector<uint32_t> vv;
  if constexpr (kBf16) {
    for (int64_t gi = 0; gi < G; ++gi) vv_off[gi + 1] = vv_off[gi] + (plan.groups[gi].len + 1) / 2 * D;
    vv.resize(vv_off[G]);
    // On the calling thread: O(len * D) per group is < 1% of the O(len^2 * D) attention, and a
    // second fork/join per call costs a scheduler tick when the machine is busy.
    for (int64_t gi = 0; gi < G; ++gi) {
      const Group& g = plan.groups[gi];
      const uint16_t* V = reinterpret_cast<const uint16_t*>(v + g.off);
      uint32_t* dst = vv.data() + vv_off[gi];
      for (int64_t p = 0; p < (g.len + 1) / 2; ++p) {
        const uint16_t* r0 = V + 2 * p * rs;
        const bool has1 = 2 * p + 1 < g.len;
        for (int64_t d = 0; d < D; ++d) dst[p * D + d] = uint32_t(r0[d]) | (has1 ? uint32_t(r0[rs + d]) << 16 : 0u);
      }
    }
  }

  WorkQueue queue(item_costs(plan));
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i il_lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i il_hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  at::parallel_for(0, queue.tasks(), 1, [&](int64_t tb, int64_t te) {
    // scratch: Q^T (fp32 D x BQ, or bf16 pairs D/2 x BQ), S^T / P^T (BK x BQ), bf16 P^T pairs,
    // output accumulator (BQ x D), row max / sum / rescale factor
    std::vector<float> qt(kBf16 ? 0 : D * BQ), st(BK * BQ, 0.f), acc(BQ * D), m_i(BQ), l_i(BQ), al(BQ),
        cmax(BQ);
    std::vector<uint32_t> qt2(kBf16 ? D / 2 * BQ : 0), pb(kBf16 ? BK / 2 * BQ : 0, 0u);
    for (int64_t t = tb; t < te; ++t) {
      for (int64_t ix; queue.pop(ix);) {
        const Item& it = plan.items[ix];
        const Group& g = plan.groups[it.group];
        const int64_t m = it.r1 - it.r0;
        const scalar_t* Q = q + g.off + it.r0 * rs;
        const int nv = int((m + 15) / 16);
        const __mmask16 last = tail_mask(m - 16 * (nv - 1));
        if constexpr (kBf16) {
          for (int64_t i = 0; i < m; ++i) {
            const uint32_t* qr = reinterpret_cast<const uint32_t*>(Q + i * rs);
            for (int64_t p = 0; p < D / 2; ++p) qt2[p * BQ + i] = qr[p];
          }
        } else {
          for (int64_t i = 0; i < m; ++i)
            for (int64_t d = 0; d < D; ++d) qt[d * BQ + i] = float(Q[i * rs + d]);
        }
        std::fill(acc.begin(), acc.begin() + m * D, 0.f);
        std::fill(m_i.begin(), m_i.end(), neg_inf);
        std::fill(l_i.begin(), l_i.end(), 0.f);
        const int64_t k_end = it.causal ? std::min<int64_t>(it.k_hi, it.r1) : it.k_hi;
        const int64_t k_start = kBf16 ? (it.k_lo & ~int64_t(1)) : it.k_lo;  // bf16: pair-aligned
        for (int64_t kb = k_start; kb < k_end; kb += BK) {
          const int64_t n = std::min<int64_t>(BK, k_end - kb);
          // keys before k_lo (pair alignment) or after some row (causal diagonal) need a mask
          const bool masked = kb < it.k_lo || (it.causal && kb + n - 1 > it.r0);
          // S^T (n x m) = scale * K[kb:kb+n] Q^T; unmasked tiles also get their column max here
          std::fill(cmax.begin(), cmax.end(), neg_inf);
          float* cm = masked ? nullptr : cmax.data();
          if constexpr (kBf16)
            tile_gemm<scalar_t, false>(nv, n, D / 2, k + g.off + kb * rs, rs / 2, 1, qt2.data(), BQ, st.data(), BQ,
                                       last, scale, cm);
          else
            tile_gemm<scalar_t, false>(nv, n, D, k + g.off + kb * rs, rs, 1, qt.data(), BQ, st.data(), BQ, last,
                                       scale, cm);
          auto softmax_chunk = [&](int c, auto mask_tag) {
            constexpr bool kMask = decltype(mask_tag)::value;
            float* sc = st.data() + 16 * c;
            const __m512i rows = _mm512_add_epi32(_mm512_set1_epi32(int(it.r0 + 16 * c)), iota);
            auto load_s = [&](int64_t jj) -> __m512 {
              const __m512 s = _mm512_loadu_ps(sc + jj * BQ);
              if constexpr (!kMask) {
                return s;
              } else {
                const int64_t key = kb + jj;
                if (key < it.k_lo) return _mm512_set1_ps(neg_inf);
                if (!it.causal) return s;
                const __mmask16 ok = _mm512_cmpge_epi32_mask(rows, _mm512_set1_epi32(int(key)));
                return _mm512_mask_mov_ps(_mm512_set1_ps(neg_inf), ok, s);
              }
            };
            __m512 mx;
            if constexpr (kMask) {
              mx = _mm512_set1_ps(neg_inf);
              for (int64_t jj = 0; jj < n; ++jj) mx = _mm512_max_ps(mx, load_s(jj));
            } else {
              mx = _mm512_loadu_ps(cmax.data() + 16 * c);
            }
            const __m512 mo = _mm512_loadu_ps(m_i.data() + 16 * c);
            const __m512 mn = _mm512_max_ps(mo, mx);
            // rows that have seen no key yet keep m = -inf; subtract 0 so exp(-inf - m) = 0, not NaN
            const __m512 mu = _mm512_mask_mov_ps(mn, _mm512_cmp_ps_mask(mn, _mm512_set1_ps(neg_inf), _CMP_EQ_OQ),
                                                 _mm512_setzero_ps());
            const __m512 alpha = exp512(_mm512_sub_ps(mo, mu));
            _mm512_storeu_ps(m_i.data() + 16 * c, mn);
            _mm512_storeu_ps(al.data() + 16 * c, alpha);
            __m512 ls = _mm512_setzero_ps();
            if constexpr (kBf16) {
              uint32_t* pc = pb.data() + 16 * c;
              for (int64_t jj = 0; jj < n; jj += 2) {
                const __m512 p0 = exp512(_mm512_sub_ps(load_s(jj), mu));
                const __m512 p1 = jj + 1 < n ? exp512(_mm512_sub_ps(load_s(jj + 1), mu)) : _mm512_setzero_ps();
                ls = _mm512_add_ps(ls, _mm512_add_ps(p0, p1));
                const __m512 lo = _mm512_permutex2var_ps(p0, il_lo, p1), hi = _mm512_permutex2var_ps(p0, il_hi, p1);
                _mm512_storeu_si512(pc + jj / 2 * BQ, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
              }
            } else {
              for (int64_t jj = 0; jj < n; ++jj) {
                const __m512 p = exp512(_mm512_sub_ps(load_s(jj), mu));
                ls = _mm512_add_ps(ls, p);
                _mm512_storeu_ps(sc + jj * BQ, p);
              }
            }
            _mm512_storeu_ps(l_i.data() + 16 * c,
                             _mm512_fmadd_ps(_mm512_loadu_ps(l_i.data() + 16 * c), alpha, ls));
          };
          for (int c = 0; c < nv; ++c) {
            if (masked)
              softmax_chunk(c, std::true_type{});
            else
              softmax_chunk(c, std::false_type{});
          }
          for (int64_t i = 0; i < m; ++i)
            if (al[i] != 1.f) scale_row(acc.data() + i * D, D, al[i]);
          // O (m x D) += P (m x n) V[kb:kb+n]; P^T element (i, j) at st[j * BQ + i]
          for (int64_t d0 = 0; d0 < D; d0 += 64) {
            const int pv = int(std::min<int64_t>(64, D - d0) / 16);
            if constexpr (kBf16)
              tile_gemm<scalar_t, true>(pv, m, (n + 1) / 2, pb.data(), 1, BQ,
                                        vv.data() + vv_off[it.group] + kb / 2 * D + d0, D, acc.data() + d0, D,
                                        __mmask16(0xFFFF), 1.f, nullptr);
            else
              tile_gemm<scalar_t, true>(pv, m, n, st.data(), 1, BQ, v + g.off + kb * rs + d0, rs, acc.data() + d0, D,
                                        __mmask16(0xFFFF), 1.f, nullptr);
          }
        }
        for (int64_t i = 0; i < m; ++i) {
          const float inv = l_i[i] > 0 ? 1.f / l_i[i] : 0.f;
          scalar_t* o = out + g.off + (it.r0 + i) * rs;
          const float* a = acc.data() + i * D;
          if constexpr (kBf16) {
            for (int64_t d = 0; d < D; d += 16)
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d),
                                  (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(a + d), _mm512_set1_ps(inv))));
          } else {
            for (int64_t d = 0; d < D; ++d) o[d] = a[d] * inv;
          }
          lse[g.lse_off + it.r0 + i] = l_i[i] > 0 ? m_i[i] + std::log(l_i[i]) : neg_inf;
        }
      }
    }
  });
}

// ---- Backward with the same micro-kernels (FlashAttention-2 Alg. 2, transposed tiles) ----------
//
// Per (sequence, head) group, per query tile, per key block: S^T = K Q^T and dP^T = V dO^T (both
// with a transposed query-side operand packed once per tile), P^T = exp(S^T - lse) and
// dS^T = scale * P^T (dP^T - D_i) vertically (lse and D_i are per query lane), then
// dV += P^T dO, dK += dS^T Q (reductions over the tile's query rows) and dQ += dS K (over the key
// block). bf16: every reduction dimension is paired for vdpbf16ps; P^T / dS^T rows are already
// pairs along the query rows, dS is also written in key pairs, dO and Q are packed in query-row
// pairs per tile and K in key pairs per group.
template <typename scalar_t>
void backward_fast(const Plan& plan, const scalar_t* dout, const scalar_t* q, const scalar_t* k, const scalar_t* v,
                   const scalar_t* out, const float* lse, scalar_t* dq, scalar_t* dk, scalar_t* dv, int64_t D,
                   double scale_d) {
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  constexpr int64_t BQ = kFastBQ;
  const int64_t BK = (kFastBK + 1) / 2 * 2;
  const float scale = float(scale_d);
  const int64_t rs = plan.row_stride;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t Dk = kBf16 ? D / 2 : D;   // reduction length over the head dimension (pairs for bf16)
  const int64_t rsk = kBf16 ? rs / 2 : rs;  // row stride in reduction units

  WorkQueue queue(group_costs(plan));
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i il_lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i il_hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  at::parallel_for(0, queue.tasks(), 1, [&](int64_t tb, int64_t te) {
    // fp32: Q^T / dO^T (D x BQ); bf16: the same as pairs along D (D/2 x BQ words)
    std::vector<float> qt(kBf16 ? 0 : D * BQ, 0.f), dot(kBf16 ? 0 : D * BQ, 0.f);
    std::vector<uint32_t> qt2(kBf16 ? D / 2 * BQ : 0, 0u), dot2(kBf16 ? D / 2 * BQ : 0, 0u);
    // S^T -> P^T and dP^T -> dS^T (BK x BQ fp32); bf16 copies: P^T, dS^T (query pairs), dS (key pairs)
    std::vector<float> st(BK * BQ, 0.f), dpt(BK * BQ, 0.f);
    std::vector<uint16_t> pt16(kBf16 ? BK * BQ : 0), dst16(kBf16 ? BK * BQ : 0);
    std::vector<uint32_t> ds2(kBf16 ? BK / 2 * BQ : 0);
    // bf16: dO and Q in query-row pairs (BQ/2 x D), K of the group in key pairs
    std::vector<uint32_t> dov(kBf16 ? BQ / 2 * D : 0), qv(kBf16 ? BQ / 2 * D : 0), kv;
    std::vector<float> dq_acc(BQ * D), di(BQ, 0.f), lsev(BQ, 0.f), dk_acc, dv_acc;
    for (int64_t t = tb; t < te; ++t) {
      for (int64_t gi; queue.pop(gi);) {
        const Group& g = plan.groups[gi];
        if (plan.item_begin[gi] == plan.item_begin[gi + 1]) continue;
        dk_acc.assign(g.len * D, 0.f);
        dv_acc.assign(g.len * D, 0.f);
        const scalar_t* K = k + g.off;
        const scalar_t* V = v + g.off;
        if constexpr (kBf16) {
          kv.assign((g.len + 1) / 2 * D, 0u);
          const uint16_t* K16 = reinterpret_cast<const uint16_t*>(K);
          for (int64_t p = 0; p < (g.len + 1) / 2; ++p) {
            const bool has1 = 2 * p + 1 < g.len;
            for (int64_t d = 0; d < D; ++d)
              kv[p * D + d] = uint32_t(K16[2 * p * rs + d]) | (has1 ? uint32_t(K16[(2 * p + 1) * rs + d]) << 16 : 0u);
          }
        }
        for (int64_t x = plan.item_begin[gi]; x < plan.item_begin[gi + 1]; ++x) {
          const Item& it = plan.items[x];
          const int64_t m = it.r1 - it.r0;
          const scalar_t* Q = q + g.off + it.r0 * rs;
          const scalar_t* dO = dout + g.off + it.r0 * rs;
          const scalar_t* O = out + g.off + it.r0 * rs;
          const int nv = int((m + 15) / 16);
          const __mmask16 last = tail_mask(m - 16 * (nv - 1));
          std::fill(di.begin(), di.end(), 0.f);
          std::fill(lsev.begin(), lsev.end(), 0.f);
          for (int64_t i = 0; i < m; ++i) {  // D_i = rowsum(dO * O)  (FA2 preprocessing)
            float s = 0;
            for (int64_t d = 0; d < D; ++d) s += float(dO[i * rs + d]) * float(O[i * rs + d]);
            di[i] = s;
            lsev[i] = lse[g.lse_off + it.r0 + i];
          }
          if constexpr (kBf16) {
            for (int64_t i = 0; i < m; ++i) {
              const uint32_t* qr = reinterpret_cast<const uint32_t*>(Q + i * rs);
              const uint32_t* dr = reinterpret_cast<const uint32_t*>(dO + i * rs);
              for (int64_t p = 0; p < D / 2; ++p) {
                qt2[p * BQ + i] = qr[p];
                dot2[p * BQ + i] = dr[p];
              }
            }
            const uint16_t* Q16 = reinterpret_cast<const uint16_t*>(Q);
            const uint16_t* dO16 = reinterpret_cast<const uint16_t*>(dO);
            for (int64_t p = 0; p < (m + 1) / 2; ++p) {
              const bool has1 = 2 * p + 1 < m;
              for (int64_t d = 0; d < D; ++d) {
                qv[p * D + d] = uint32_t(Q16[2 * p * rs + d]) | (has1 ? uint32_t(Q16[(2 * p + 1) * rs + d]) << 16 : 0u);
                dov[p * D + d] =
                    uint32_t(dO16[2 * p * rs + d]) | (has1 ? uint32_t(dO16[(2 * p + 1) * rs + d]) << 16 : 0u);
              }
            }
          } else {
            for (int64_t i = 0; i < m; ++i)
              for (int64_t d = 0; d < D; ++d) {
                qt[d * BQ + i] = float(Q[i * rs + d]);
                dot[d * BQ + i] = float(dO[i * rs + d]);
              }
          }
          std::fill(dq_acc.begin(), dq_acc.begin() + m * D, 0.f);
          const int64_t k_end = it.causal ? std::min<int64_t>(it.k_hi, it.r1) : it.k_hi;
          const int64_t k_start = kBf16 ? (it.k_lo & ~int64_t(1)) : it.k_lo;
          for (int64_t kb = k_start; kb < k_end; kb += BK) {
            const int64_t n = std::min<int64_t>(BK, k_end - kb);
            const bool masked = kb < it.k_lo || (it.causal && kb + n - 1 > it.r0);
            if constexpr (kBf16) {
              tile_gemm<scalar_t, false>(nv, n, Dk, K + kb * rs, rsk, 1, qt2.data(), BQ, st.data(), BQ, last, scale,
                                         nullptr);
              tile_gemm<scalar_t, false>(nv, n, Dk, V + kb * rs, rsk, 1, dot2.data(), BQ, dpt.data(), BQ, last, 1.f,
                                         nullptr);
            } else {
              tile_gemm<scalar_t, false>(nv, n, Dk, K + kb * rs, rsk, 1, qt.data(), BQ, st.data(), BQ, last, scale,
                                         nullptr);
              tile_gemm<scalar_t, false>(nv, n, Dk, V + kb * rs, rsk, 1, dot.data(), BQ, dpt.data(), BQ, last, 1.f,
                                         nullptr);
            }
            for (int c = 0; c < nv; ++c) {
              const __mmask16 lanes = c == nv - 1 ? last : __mmask16(0xFFFF);  // query rows < m
              const __m512i rows = _mm512_add_epi32(_mm512_set1_epi32(int(it.r0 + 16 * c)), iota);
              const __m512 lv = _mm512_loadu_ps(lsev.data() + 16 * c), dv_i = _mm512_loadu_ps(di.data() + 16 * c);
              const __m512 sc_v = _mm512_set1_ps(scale);
              // p, ds of key row jj (zero where masked or beyond the tile's rows)
              auto grad_row = [&](int64_t jj, __m512& p, __m512& ds) {
                if (jj >= n) {
                  p = ds = _mm512_setzero_ps();
                  return;
                }
                __mmask16 ok = lanes;
                if (masked) {
                  const int64_t key = kb + jj;
                  if (key < it.k_lo) ok = 0;
                  else if (it.causal) ok &= _mm512_cmpge_epi32_mask(rows, _mm512_set1_epi32(int(key)));
                }
                const __m512 s = _mm512_loadu_ps(st.data() + jj * BQ + 16 * c);
                p = _mm512_maskz_mov_ps(ok, exp512(_mm512_sub_ps(s, lv)));
                const __m512 dp = _mm512_loadu_ps(dpt.data() + jj * BQ + 16 * c);
                ds = _mm512_mul_ps(_mm512_mul_ps(p, _mm512_sub_ps(dp, dv_i)), sc_v);
              };
              for (int64_t jj = 0; jj < n; jj += 2) {
                __m512 p0, ds0, p1, ds1;
                grad_row(jj, p0, ds0);
                grad_row(jj + 1, p1, ds1);
                if constexpr (kBf16) {
                  auto st16 = [](uint16_t* dst, __m512 x) {
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(x));
                  };
                  st16(pt16.data() + jj * BQ + 16 * c, p0);
                  st16(dst16.data() + jj * BQ + 16 * c, ds0);
                  if (jj + 1 < n) {
                    st16(pt16.data() + (jj + 1) * BQ + 16 * c, p1);
                    st16(dst16.data() + (jj + 1) * BQ + 16 * c, ds1);
                  }
                  const __m512 lo = _mm512_permutex2var_ps(ds0, il_lo, ds1),
                               hi = _mm512_permutex2var_ps(ds0, il_hi, ds1);
                  _mm512_storeu_si512(ds2.data() + jj / 2 * BQ + 16 * c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
                } else {
                  _mm512_storeu_ps(st.data() + jj * BQ + 16 * c, p0);
                  _mm512_storeu_ps(dpt.data() + jj * BQ + 16 * c, ds0);
                  if (jj + 1 < n) {
                    _mm512_storeu_ps(st.data() + (jj + 1) * BQ + 16 * c, p1);
                    _mm512_storeu_ps(dpt.data() + (jj + 1) * BQ + 16 * c, ds1);
                  }
                }
              }
            }
            for (int64_t d0 = 0; d0 < D; d0 += 64) {
              const int pv = int(std::min<int64_t>(64, D - d0) / 16);
              const __mmask16 full = 0xFFFF;
              float* dvb = dv_acc.data() + kb * D + d0;
              float* dkb = dk_acc.data() + kb * D + d0;
              if constexpr (kBf16) {
                const int64_t m2 = (m + 1) / 2;
                // dV += P^T dO ; dK += dS^T Q   (reduction over query-row pairs)
                tile_gemm<scalar_t, true>(pv, n, m2, pt16.data(), BQ / 2, 1, dov.data() + d0, D, dvb, D, full, 1.f,
                                          nullptr);
                tile_gemm<scalar_t, true>(pv, n, m2, dst16.data(), BQ / 2, 1, qv.data() + d0, D, dkb, D, full, 1.f,
                                          nullptr);
                // dQ += dS K   (reduction over key pairs)
                tile_gemm<scalar_t, true>(pv, m, (n + 1) / 2, ds2.data(), 1, BQ, kv.data() + kb / 2 * D + d0, D,
                                          dq_acc.data() + d0, D, full, 1.f, nullptr);
              } else {
                tile_gemm<scalar_t, true>(pv, n, m, st.data(), BQ, 1, dO + d0, rs, dvb, D, full, 1.f, nullptr);
                tile_gemm<scalar_t, true>(pv, n, m, dpt.data(), BQ, 1, Q + d0, rs, dkb, D, full, 1.f, nullptr);
                tile_gemm<scalar_t, true>(pv, m, n, dpt.data(), 1, BQ, K + kb * rs + d0, rs, dq_acc.data() + d0, D,
                                          full, 1.f, nullptr);
              }
            }
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
#endif  // __AVX512F__

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
#if defined(__AVX512F__)
    if constexpr (fast_dtype<scalar_t>()) {
      if (kFastEnabled && kBlockQ <= kFastBQ && D % 16 == 0) {
        forward_fast<scalar_t>(plan, q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                               out.data_ptr<scalar_t>(), lse.data_ptr<float>(), D, scale);
        return;
      }
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
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "rag_attn_bwd_cpu", [&] {
#if defined(__AVX512F__)
    if constexpr (fast_dtype<scalar_t>()) {
      if (kFastEnabled && kBlockQ <= kFastBQ && D % 16 == 0) {
        backward_fast<scalar_t>(plan, dout.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(),
                                v.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), lse.data_ptr<float>(),
                                dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(), D, scale);
        return;
      }
    }
#endif
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
