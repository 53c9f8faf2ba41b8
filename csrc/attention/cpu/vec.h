// Vectorised row helpers of the CPU attention kernels: max, exp-and-sum (online softmax),
// P/dS recomputation for the backward, and fp32 -> bf16 rounding. AVX-512 paths when the
// compiler targets it (-march=native on AVX-512 machines), portable loops otherwise.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace rag_attn::cpu {

// exp for x <= ~88 (Cody-Waite reduction to [-ln2/2, ln2/2], degree-6 Taylor, 2^n by exponent
// bits); relative error ~2e-7, below fp32 rounding of the sums. Inputs below -87 flush to 0.
inline float exp_fast(float x) {
  const bool tiny = x < -87.0f;
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (int32_t(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(float));
  return tiny ? 0.0f : p * two_n;
}
inline double exp_fast(double x) { return std::exp(x); }

#if defined(__AVX512F__)
inline __m512 exp512(__m512 x) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(~tiny, _mm512_scalef_ps(p, n));  // p * 2^n
}
inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1); }
#endif

template <typename acc_t>
inline acc_t row_max(const acc_t* x, int64_t n) {
  acc_t m = -std::numeric_limits<acc_t>::infinity();
  for (int64_t j = 0; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

// x[j] = exp(x[j] - sub) for j < n, returning the sum.
template <typename acc_t>
inline acc_t exp_sub_sum(acc_t* x, int64_t n, acc_t sub) {
  acc_t s = 0;
  for (int64_t j = 0; j < n; ++j) {
    const acc_t e = exp_fast(x[j] - sub);
    x[j] = e;
    s += e;
  }
  return s;
}

// Backward: p[j] = exp(p[j] - lse); dp[j] = p[j] * (dp[j] - di)  (dS of FlashAttention-2).
template <typename acc_t>
inline void softmax_grad_row(acc_t* p, acc_t* dp, int64_t n, acc_t lse, acc_t di) {
  for (int64_t j = 0; j < n; ++j) {
    const acc_t e = exp_fast(p[j] - lse);
    p[j] = e;
    dp[j] = e * (dp[j] - di);
  }
}

#if defined(__AVX512F__)
template <>
inline float row_max<float>(const float* x, int64_t n) {
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < n; j += 16) m = _mm512_max_ps(m, _mm512_mask_loadu_ps(m, tail_mask(n - j), x + j));
  return _mm512_reduce_max_ps(m);
}

template <>
inline float exp_sub_sum<float>(float* x, int64_t n, float sub) {
  const __m512 s = _mm512_set1_ps(sub);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = tail_mask(n - j);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + j), s));
    _mm512_mask_storeu_ps(x + j, k, e);
    acc = _mm512_mask_add_ps(acc, k, acc, e);
  }
  return _mm512_reduce_add_ps(acc);
}

template <>
inline void softmax_grad_row<float>(float* p, float* dp, int64_t n, float lse, float di) {
  const __m512 l = _mm512_set1_ps(lse), d = _mm512_set1_ps(di);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = tail_mask(n - j);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p + j), l));
    _mm512_mask_storeu_ps(p + j, k, e);
    _mm512_mask_storeu_ps(dp + j, k, _mm512_mul_ps(e, _mm512_sub_ps(_mm512_maskz_loadu_ps(k, dp + j), d)));
  }
}
#endif

template <typename dst_t, typename src_t>
inline void convert(dst_t* dst, const src_t* src, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = dst_t(src[j]);
}

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
template <>
inline void convert<c10::BFloat16, float>(c10::BFloat16* dst, const float* src, int64_t n) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m256bh b = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + j));  // round to nearest even
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), (__m256i)b);
  }
  for (; j < n; ++j) dst[j] = c10::BFloat16(src[j]);
}
#endif

inline void scale_row(float* a, int64_t n, float s) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) a[j] *= s;
}
inline void scale_row(double* a, int64_t n, double s) {
  for (int64_t j = 0; j < n; ++j) a[j] *= s;
}

}  // namespace rag_attn::cpu
