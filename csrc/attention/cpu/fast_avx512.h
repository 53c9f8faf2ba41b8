// AVX-512 kernels of the CPU attention (forward and backward, fp32; bf16 with AVX512-BF16), on
// the register-blocked micro-kernels of ukernel.h. Compiled for AVX-512 whatever -march says and
// called only on CPUs that have it (attention_cpu.cpp dispatches on isa.h's active_isa()).
#pragma once

#include "isa.h"

#if RAG_ATTN_X86_DISPATCH
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <vector>

#include "common.h"
#include "ukernel.h"
#include "vec.h"

RAG_ATTN_BEGIN_AVX512
namespace rag_attn::cpu::avx512 {

// ---- Forward with register-blocked AVX-512 micro-kernels (fp32; bf16 with AVX512-BF16) -------
//
// Same algorithm as forward_impl, but the score tile is kept transposed, S^T (keys x queries,
// kFastBQ = 64 query lanes per key row): scores come from K rows times a Q^T tile packed once per
// item, the online-softmax max / exp / sum run vertically over key rows with the 16 query rows of
// a zmm in parallel (no horizontal reductions, the causal mask is one vector compare), and
// O += P V reads P^T with a stride, so neither K nor V (fp32) is ever repacked. bf16 pairs
// the reduction dimension for vdpbf16ps: Q^T and P^T are written as bf16 pairs, V is packed to
// pairs of rows once per call (one extra V-sized buffer).

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
    const uint32_t *a = static_cast<const uint32_t*>(A), *b = static_cast<const uint32_t*>(B);
    switch (nv) {
      case 1: gemm_rows_bf16<12, 1, ACC>(M, K, a, sa, sp, b, ldb, C, ldc, last, alpha, cmax); break;
      case 2: gemm_rows_bf16<12, 2, ACC>(M, K, a, sa, sp, b, ldb, C, ldc, last, alpha, cmax); break;
      case 3: gemm_rows_bf16<8, 3, ACC>(M, K, a, sa, sp, b, ldb, C, ldc, last, alpha, cmax); break;
      default: gemm_rows_bf16<6, 4, ACC>(M, K, a, sa, sp, b, ldb, C, ldc, last, alpha, cmax); break;
    }
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
              if constexpr (!kMask) return s;
              const int64_t key = kb + jj;
              if (key < it.k_lo) return _mm512_set1_ps(neg_inf);
              if (!it.causal) return s;
              const __mmask16 ok = _mm512_cmpge_epi32_mask(rows, _mm512_set1_epi32(int(key)));
              return _mm512_mask_mov_ps(_mm512_set1_ps(neg_inf), ok, s);
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

}  // namespace rag_attn::cpu::avx512
RAG_ATTN_END_ISA
#endif  // RAG_ATTN_X86_DISPATCH
