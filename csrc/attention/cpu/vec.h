// Vectorised row helpers of the CPU attention kernels: max, exp-and-sum (online softmax),
// P/dS recomputation for the backward, and fp32 -> bf16 rounding, for the generic kernels:
// portable loops the compiler vectorises for -march=native (the AVX2 / AVX-512 kernels keep
// their own vector exp, ukernel.h and ukernel_avx2.h).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
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
