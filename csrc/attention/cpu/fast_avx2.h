// AVX2/FMA kernels of the CPU attention, forward and backward, fp32 and bf16 (widened to fp32;
// every product and sum in fp32, outputs rounded to nearest even), on ukernel_avx2.h.
//
// Same algorithm and tiling as the AVX-512 kernels (fast_avx512.h): the score tile is kept
// transposed, S^T (kFastBKAvx2 = 128 keys x kFastBQ = 64 query lanes), computed as K rows times a
// Q^T tile packed once per item; the online softmax runs vertically over key rows, 8 query rows per ymm (no
// horizontal reductions; the causal mask is one integer compare per key row), and O += P V reads
// P^T with a stride. Query-side tiles are zero-padded to whole 8-lane vectors, so the query tail
// (m % 8 rows) costs no masks; the head size must be a multiple of 8.
//
// bf16: K and V (and Q, dO in the backward) are widened to fp32 scratch (forward: all of K and V
// once per call; backward: K, V once per group, Q, dO once per query tile), an O(rows x D) pass
// next to the O(rows x keys x D) products; fp32 inputs are read in place.
#pragma once

#include "isa.h"

#if RAG_ATTN_X86_DISPATCH
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "common.h"
#include "ukernel_avx2.h"

RAG_ATTN_BEGIN_AVX2
namespace rag_attn::cpu::avx2 {

// The raw element type a kernel reads: fp32 as is, bf16 as its 16-bit pattern.
template <typename scalar_t>
using raw_t = std::conditional_t<std::is_same_v<scalar_t, float>, float, uint16_t>;

// A row of D outputs (D % 8 == 0) = a * s, as fp32 or rounded to bf16.
inline void store_row(float* o, const float* a, int64_t D, float s) {
  const __m256 sv = _mm256_set1_ps(s);
  for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(a + d), sv));
}
inline void store_row(c10::BFloat16* o, const float* a, int64_t D, float s) {
  const __m256 sv = _mm256_set1_ps(s);
  uint16_t* o16 = reinterpret_cast<uint16_t*>(o);
  for (int64_t d = 0; d < D; d += 8) store_bf16(o16 + d, _mm256_mul_ps(_mm256_loadu_ps(a + d), sv));
}

// Q^T tile (D x BQ fp32): qt[d * BQ + i] = Q[i, d] for rows i < m, 0 for the padding rows
// m <= i < mp (mp = m rounded up to 8), so the padded lanes hold finite scores.
template <typename src_t>
inline void pack_transposed(float* qt, const src_t* Q, int64_t rs, int64_t m, int64_t mp, int64_t D,
                            int64_t BQ) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t d = 0; d < D; ++d) {
      if constexpr (std::is_same_v<src_t, float>)
        qt[d * BQ + i] = Q[i * rs + d];
      else
        qt[d * BQ + i] = float(c10::BFloat16(Q[i * rs + d], c10::BFloat16::from_bits()));
    }
  for (int64_t d = 0; d < D; ++d)
    for (int64_t i = m; i < mp; ++i) qt[d * BQ + i] = 0.f;
}

template <typename scalar_t>
void forward_fast(const Plan& plan, const scalar_t* q, const scalar_t* k, const scalar_t* v, scalar_t* out,
                  float* lse, int64_t D, double scale_d) {
  using src_t = raw_t<scalar_t>;
  constexpr bool kBf16 = !std::is_same_v<scalar_t, float>;
  constexpr int64_t BQ = kFastBQ;
  const int64_t BK = kFastBKAvx2;
  const float scale = float(scale_d);
  const int64_t rs = plan.row_stride;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const src_t* q_ = reinterpret_cast<const src_t*>(q);
  const src_t* k_ = reinterpret_cast<const src_t*>(k);
  const src_t* v_ = reinterpret_cast<const src_t*>(v);

  // K and V as fp32 with the inputs' layout (kf[i] = k[i] for every element of a group's rows).
  // bf16: widened once here, on the calling thread (O(tokens x D), < 1% of the attention; a
  // second fork/join would cost more on a busy machine); fp32: the inputs themselves.
  std::unique_ptr<float[]> kf, vf;
  const float *Kall, *Vall;
  if constexpr (kBf16) {
    int64_t extent = 0;
    for (const Group& g : plan.groups)
      if (g.len > 0) extent = std::max(extent, g.off + (g.len - 1) * rs + D);
    kf.reset(new float[extent]);
    vf.reset(new float[extent]);
    for (const Group& g : plan.groups)
      for (int64_t j = 0; j < g.len; ++j) {
        widen_row(kf.get() + g.off + j * rs, k_ + g.off + j * rs, D);
        widen_row(vf.get() + g.off + j * rs, v_ + g.off + j * rs, D);
      }
    Kall = kf.get(), Vall = vf.get();
  } else {
    Kall = k_, Vall = v_;
  }

  WorkQueue queue(item_costs(plan));
  at::parallel_for(0, queue.tasks(), 1, [&](int64_t tb, int64_t te) {
    // scratch: Q^T (D x BQ), S^T / P^T (BK x BQ), output accumulator (BQ x D), per-query-row
    // running max / sum / rescale factor and the tile's column max
    std::vector<float> qt(D * BQ), st(BK * BQ, 0.f), acc(BQ * D), m_i(BQ), l_i(BQ), al(BQ), cmax(BQ);
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t t = tb; t < te; ++t) {
      for (int64_t ix; queue.pop(ix);) {
        const Item& it = plan.items[ix];
        const Group& g = plan.groups[it.group];
        const int64_t m = it.r1 - it.r0;
        const int64_t nvq = (m + 7) / 8;  // 8-lane vectors of query rows
        const int64_t mp = 8 * nvq;
        pack_transposed(qt.data(), q_ + g.off + it.r0 * rs, rs, m, mp, D, BQ);
        std::fill(acc.begin(), acc.begin() + m * D, 0.f);
        std::fill(m_i.begin(), m_i.end(), neg_inf);
        std::fill(l_i.begin(), l_i.end(), 0.f);
        const int64_t k_end = it.causal ? std::min<int64_t>(it.k_hi, it.r1) : it.k_hi;
        for (int64_t kb = it.k_lo; kb < k_end; kb += BK) {
          const int64_t n = std::min<int64_t>(BK, k_end - kb);
          const float* Kb = Kall + g.off + kb * rs;  // K and V rows [kb, kb + n), row stride rs
          const float* Vb = Vall + g.off + kb * rs;
          // keys after some row of the tile (causal diagonal) need the mask
          const bool masked = it.causal && kb + n - 1 > it.r0;
          // S^T (n x mp) = scale * K_b Q^T; unmasked tiles also get their column max here
          std::fill(cmax.begin(), cmax.end(), neg_inf);
          gemm<false>(n, mp, D, Kb, rs, 1, qt.data(), BQ, st.data(), BQ, scale, masked ? nullptr : cmax.data());
          for (int64_t c = 0; c < nvq; ++c) {  // query rows 8c .. 8c+7, down the key rows
            float* sc = st.data() + 8 * c;
            const __m256i rows = _mm256_add_epi32(_mm256_set1_epi32(int(it.r0 + 8 * c)), iota);
            // score of key row jj for the 8 query rows, -inf where the key lies after the row
            auto load_s = [&](int64_t jj) -> __m256 {
              const __m256 s = _mm256_loadu_ps(sc + jj * BQ);
              if (!masked) return s;
              const __m256 ok = _mm256_castsi256_ps(_mm256_cmpgt_epi32(rows, _mm256_set1_epi32(int(kb + jj) - 1)));
              return _mm256_blendv_ps(_mm256_set1_ps(neg_inf), s, ok);
            };
            __m256 mx;
            if (masked) {
              mx = _mm256_set1_ps(neg_inf);
              for (int64_t jj = 0; jj < n; ++jj) mx = _mm256_max_ps(mx, load_s(jj));
            } else {
              mx = _mm256_loadu_ps(cmax.data() + 8 * c);
            }
            const __m256 mo = _mm256_loadu_ps(m_i.data() + 8 * c);
            const __m256 mn = _mm256_max_ps(mo, mx);
            // rows that have seen no key yet keep m = -inf; subtract 0 so exp(-inf - m) = 0, not NaN
            const __m256 none = _mm256_cmp_ps(mn, _mm256_set1_ps(neg_inf), _CMP_EQ_OQ);
            const __m256 mu = _mm256_blendv_ps(mn, _mm256_setzero_ps(), none);
            const __m256 alpha = exp256(_mm256_sub_ps(mo, mu));
            _mm256_storeu_ps(m_i.data() + 8 * c, mn);
            _mm256_storeu_ps(al.data() + 8 * c, alpha);
            __m256 ls = _mm256_setzero_ps();
            for (int64_t jj = 0; jj < n; ++jj) {
              const __m256 p = exp256(_mm256_sub_ps(load_s(jj), mu));
              ls = _mm256_add_ps(ls, p);
              _mm256_storeu_ps(sc + jj * BQ, p);
            }
            _mm256_storeu_ps(l_i.data() + 8 * c, _mm256_fmadd_ps(_mm256_loadu_ps(l_i.data() + 8 * c), alpha, ls));
          }
          for (int64_t i = 0; i < m; ++i)
            if (al[i] != 1.f) {
              const __m256 a = _mm256_set1_ps(al[i]);
              float* row = acc.data() + i * D;
              for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(row + d, _mm256_mul_ps(_mm256_loadu_ps(row + d), a));
            }
          // O (m x D) += P (m x n) V_b; P^T element (i, j) at st[j * BQ + i]
          gemm<true>(m, D, n, st.data(), 1, BQ, Vb, rs, acc.data(), D, 1.f, nullptr);
        }
        for (int64_t i = 0; i < m; ++i) {
          store_row(out + g.off + (it.r0 + i) * rs, acc.data() + i * D, D, l_i[i] > 0 ? 1.f / l_i[i] : 0.f);
          lse[g.lse_off + it.r0 + i] = l_i[i] > 0 ? m_i[i] + std::log(l_i[i]) : neg_inf;
        }
      }
    }
  });
}

// Backward (FlashAttention-2 Alg. 2, transposed tiles). Per (sequence, head) group, per query
// tile, per key block: S^T = scale K Q^T and dP^T = V dO^T, then vertically over key rows
// P^T = exp(S^T - lse) and dS^T = scale * P^T (dP^T - D_i) (lse, D_i per query lane), then
// dV += P^T dO, dK += dS^T Q (reductions over the tile's m query rows) and dQ += dS K (over the
// key block). dK, dV accumulate in fp32 for the whole group.
template <typename scalar_t>
void backward_fast(const Plan& plan, const scalar_t* dout, const scalar_t* q, const scalar_t* k, const scalar_t* v,
                   const scalar_t* out, const float* lse, scalar_t* dq, scalar_t* dk, scalar_t* dv, int64_t D,
                   double scale_d) {
  using src_t = raw_t<scalar_t>;
  constexpr bool kBf16 = !std::is_same_v<scalar_t, float>;
  constexpr int64_t BQ = kFastBQ;
  const int64_t BK = kFastBKAvx2;
  const float scale = float(scale_d);
  const int64_t rs = plan.row_stride;
  const src_t* q_ = reinterpret_cast<const src_t*>(q);
  const src_t* k_ = reinterpret_cast<const src_t*>(k);
  const src_t* v_ = reinterpret_cast<const src_t*>(v);
  const src_t* do_ = reinterpret_cast<const src_t*>(dout);

  WorkQueue queue(group_costs(plan));
  at::parallel_for(0, queue.tasks(), 1, [&](int64_t tb, int64_t te) {
    // Q^T, dO^T (D x BQ); S^T -> P^T and dP^T -> dS^T (BK x BQ); dQ accumulator (BQ x D);
    // D_i and lse per query lane; bf16: Q, dO of the tile (BQ x D) and K, V of the group as fp32
    std::vector<float> qt(D * BQ), dot(D * BQ), st(BK * BQ, 0.f), dpt(BK * BQ, 0.f), dq_acc(BQ * D);
    std::vector<float> di(BQ, 0.f), lsev(BQ, 0.f), dk_acc, dv_acc;
    std::vector<float> qf(kBf16 ? BQ * D : 0), dof(kBf16 ? BQ * D : 0), kf, vf;
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t t = tb; t < te; ++t) {
      for (int64_t gi; queue.pop(gi);) {
        const Group& g = plan.groups[gi];
        if (plan.item_begin[gi] == plan.item_begin[gi + 1]) continue;
        dk_acc.assign(g.len * D, 0.f);
        dv_acc.assign(g.len * D, 0.f);
        // K, V of the group as fp32 rows, row stride ldk
        const float *Kg, *Vg;
        int64_t ldk;
        if constexpr (kBf16) {
          kf.resize(g.len * D);
          vf.resize(g.len * D);
          for (int64_t j = 0; j < g.len; ++j) {
            widen_row(kf.data() + j * D, k_ + g.off + j * rs, D);
            widen_row(vf.data() + j * D, v_ + g.off + j * rs, D);
          }
          Kg = kf.data(), Vg = vf.data(), ldk = D;
        } else {
          Kg = k_ + g.off, Vg = v_ + g.off, ldk = rs;
        }
        for (int64_t x = plan.item_begin[gi]; x < plan.item_begin[gi + 1]; ++x) {
          const Item& it = plan.items[x];
          const int64_t m = it.r1 - it.r0;
          const int64_t nvq = (m + 7) / 8;
          const int64_t mp = 8 * nvq;
          const src_t* Q = q_ + g.off + it.r0 * rs;
          const src_t* dO = do_ + g.off + it.r0 * rs;
          const scalar_t* O = out + g.off + it.r0 * rs;
          std::fill(di.begin(), di.end(), 0.f);
          std::fill(lsev.begin(), lsev.end(), 0.f);
          for (int64_t i = 0; i < m; ++i) {  // D_i = rowsum(dO * O)  (FA2 preprocessing)
            const scalar_t* dOs = dout + g.off + (it.r0 + i) * rs;
            float s = 0;
            for (int64_t d = 0; d < D; ++d) s += float(dOs[d]) * float(O[i * rs + d]);
            di[i] = s;
            lsev[i] = lse[g.lse_off + it.r0 + i];
          }
          pack_transposed(qt.data(), Q, rs, m, mp, D, BQ);
          pack_transposed(dot.data(), dO, rs, m, mp, D, BQ);
          // Q and dO rows as fp32 (the B operands of dK and dV), row stride ldq
          const float *Qf, *dOf;
          int64_t ldq;
          if constexpr (kBf16) {
            for (int64_t i = 0; i < m; ++i) {
              widen_row(qf.data() + i * D, Q + i * rs, D);
              widen_row(dof.data() + i * D, dO + i * rs, D);
            }
            Qf = qf.data(), dOf = dof.data(), ldq = D;
          } else {
            Qf = Q, dOf = dO, ldq = rs;
          }
          std::fill(dq_acc.begin(), dq_acc.begin() + m * D, 0.f);
          const int64_t k_end = it.causal ? std::min<int64_t>(it.k_hi, it.r1) : it.k_hi;
          for (int64_t kb = it.k_lo; kb < k_end; kb += BK) {
            const int64_t n = std::min<int64_t>(BK, k_end - kb);
            const bool masked = it.causal && kb + n - 1 > it.r0;
            const float* Kb = Kg + kb * ldk;
            gemm<false>(n, mp, D, Kb, ldk, 1, qt.data(), BQ, st.data(), BQ, scale, nullptr);
            gemm<false>(n, mp, D, Vg + kb * ldk, ldk, 1, dot.data(), BQ, dpt.data(), BQ, 1.f, nullptr);
            const __m256 sc_v = _mm256_set1_ps(scale);
            for (int64_t c = 0; c < nvq; ++c) {
              const __m256i rows = _mm256_add_epi32(_mm256_set1_epi32(int(it.r0 + 8 * c)), iota);
              const __m256 lv = _mm256_loadu_ps(lsev.data() + 8 * c), dv_i = _mm256_loadu_ps(di.data() + 8 * c);
              for (int64_t jj = 0; jj < n; ++jj) {
                float* sp = st.data() + jj * BQ + 8 * c;
                float* dpp = dpt.data() + jj * BQ + 8 * c;
                __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(sp), lv));
                if (masked) {  // zero where the key lies after the query row
                  const __m256i ok = _mm256_cmpgt_epi32(rows, _mm256_set1_epi32(int(kb + jj) - 1));
                  p = _mm256_and_ps(p, _mm256_castsi256_ps(ok));
                }
                const __m256 ds = _mm256_mul_ps(_mm256_mul_ps(p, _mm256_sub_ps(_mm256_loadu_ps(dpp), dv_i)), sc_v);
                _mm256_storeu_ps(sp, p);
                _mm256_storeu_ps(dpp, ds);
              }
            }
            // dV[kb:kb+n] += P^T dO ; dK[kb:kb+n] += dS^T Q  (P^T, dS^T rows are key rows)
            gemm<true>(n, D, m, st.data(), BQ, 1, dOf, ldq, dv_acc.data() + kb * D, D, 1.f, nullptr);
            gemm<true>(n, D, m, dpt.data(), BQ, 1, Qf, ldq, dk_acc.data() + kb * D, D, 1.f, nullptr);
            // dQ += dS K_b; dS element (i, j) at dpt[j * BQ + i]
            gemm<true>(m, D, n, dpt.data(), 1, BQ, Kb, ldk, dq_acc.data(), D, 1.f, nullptr);
          }
          for (int64_t i = 0; i < m; ++i) store_row(dq + g.off + (it.r0 + i) * rs, dq_acc.data() + i * D, D, 1.f);
        }
        for (int64_t j = 0; j < g.len; ++j) {
          store_row(dk + g.off + j * rs, dk_acc.data() + j * D, D, 1.f);
          store_row(dv + g.off + j * rs, dv_acc.data() + j * D, D, 1.f);
        }
      }
    }
  });
}

}  // namespace rag_attn::cpu::avx2
RAG_ATTN_END_ISA
#endif  // RAG_ATTN_X86_DISPATCH
