// AVX2/FMA building blocks of the CPU attention: vector exp, bf16 <-> fp32 rows and
// register-blocked fp32 micro-kernels (8-lane ymm vectors).
//
// C (M x N fp32, ldc) = alpha * A B (or C += A B), where A element (i, p) is read at
// A + i*sa + p*sp (broadcast, so any stride works: K rows, or the transposed probability tile)
// and B is row-major (K x N, ldb). N is a multiple of 8 and every caller keeps B's and C's rows
// readable/writable up to it (query-side tiles are zero-padded to whole vectors, D % 8 == 0), so
// the inner loops need no masks. Register blocking as in the BLIS Haswell kernel (Goto & van de
// Geijn 2008): an MR x NV block of ymm accumulators, MR*NV + NV + 1 <= 16 registers (6 x 2 and
// 12 x 1 here), lives across the whole reduction; A is not packed.
//
// Compiled for AVX2+FMA whatever -march says (RAG_ATTN_BEGIN_AVX2, isa.h); called only on CPUs
// that have both.
#pragma once

#include "isa.h"

#if RAG_ATTN_X86_DISPATCH
#include <immintrin.h>

#include <cstdint>

RAG_ATTN_BEGIN_AVX2
namespace rag_attn::cpu::avx2 {

// exp for x <= ~88, the same approximation as avx512::exp512 and exp_fast: Cody-Waite reduction
// x = n ln2 + r with |r| <= ln2/2, degree-6 Taylor polynomial for e^r, and 2^n built from the
// exponent bits ((n + 127) << 23; AVX2 has no scalef). Relative error ~2e-7. x < -87 (and -inf,
// the masked scores) gives 0; the clamp keeps n in [-126, 127], a normal exponent.
inline __m256 exp256(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);  // ln2 split in two
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));  // p * 2^n, 0 where tiny
}

// 8 bf16 -> 8 fp32: a bf16 is the upper half of an fp32, so widening is a 16-bit left shift.
inline __m256 load_bf16(const uint16_t* src) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 fp32 -> 8 bf16, rounded to nearest even (bits + 0x7FFF + lsb of the kept half, then the upper
// 16 bits); NaN becomes the quiet NaN 0x7FC0, as c10::BFloat16 does.
inline void store_bf16(uint16_t* dst, __m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  // pack the eight 32-bit words (each < 2^16) to 16 bits: packus works per 128-bit half, the
  // 64-bit permute (0, 2, 1, 3) brings the two halves' results together
  const __m256i pk = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(pk));
}

// Row of n (a multiple of 8) values as fp32, from fp32 or bf16.
inline void widen_row(float* dst, const float* src, int64_t n) {
  for (int64_t j = 0; j < n; j += 8) _mm256_storeu_ps(dst + j, _mm256_loadu_ps(src + j));
}
inline void widen_row(float* dst, const uint16_t* src, int64_t n) {
  for (int64_t j = 0; j < n; j += 8) _mm256_storeu_ps(dst + j, load_bf16(src + j));
}

// One MR x (8*NV) block of C over the whole reduction K. Epilogue: C = alpha * c (ACC = false; the
// column maxima of the stored block are also folded into cmax[0, 8*NV) when cmax is given: the
// online-softmax max of an unmasked score tile without a second pass) or C += c (ACC = true).
template <int MR, int NV, bool ACC>
inline void uk_f32(int64_t K, const float* A, int64_t sa, int64_t sp, const float* B, int64_t ldb, float* C,
                   int64_t ldc, float alpha, float* cmax) {
  __m256 c[MR][NV];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) c[i][v] = _mm256_setzero_ps();
  for (int64_t p = 0; p < K; ++p) {
    __m256 b[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) b[v] = _mm256_loadu_ps(B + p * ldb + 8 * v);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_broadcast_ss(A + i * sa + p * sp);
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) c[i][v] = _mm256_fmadd_ps(a, b[v], c[i][v]);
    }
  }
  __m256 mx[NV];
#pragma GCC unroll 16
  for (int v = 0; v < NV; ++v) mx[v] = _mm256_set1_ps(-__builtin_inff());
  const __m256 al = _mm256_set1_ps(alpha);
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      float* dst = C + i * ldc + 8 * v;
      const __m256 r = ACC ? _mm256_add_ps(_mm256_loadu_ps(dst), c[i][v]) : _mm256_mul_ps(c[i][v], al);
      _mm256_storeu_ps(dst, r);
      if (!ACC) mx[v] = _mm256_max_ps(mx[v], r);
    }
  if (!ACC && cmax != nullptr) {
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(cmax + 8 * v, _mm256_max_ps(_mm256_loadu_ps(cmax + 8 * v), mx[v]));
  }
}

// Rows [0, M) of one column block, MR at a time; the remainder (< MR rows) by a kernel compiled
// for exactly that many rows.
template <int MR, int NV, bool ACC>
inline void gemm_rows(int64_t M, int64_t K, const float* A, int64_t sa, int64_t sp, const float* B, int64_t ldb,
                      float* C, int64_t ldc, float alpha, float* cmax) {
  int64_t i = 0;
  for (; i + MR <= M; i += MR) uk_f32<MR, NV, ACC>(K, A + i * sa, sa, sp, B, ldb, C + i * ldc, ldc, alpha, cmax);
  const int64_t r = M - i;
  A += i * sa;
  C += i * ldc;
  switch (r) {
#define RAG_TAIL(R) \
  case R: if constexpr (R < MR) uk_f32<R, NV, ACC>(K, A, sa, sp, B, ldb, C, ldc, alpha, cmax); break;
    RAG_TAIL(1) RAG_TAIL(2) RAG_TAIL(3) RAG_TAIL(4) RAG_TAIL(5) RAG_TAIL(6) RAG_TAIL(7) RAG_TAIL(8) RAG_TAIL(9)
    RAG_TAIL(10) RAG_TAIL(11)
#undef RAG_TAIL
    default: break;
  }
}

// C (M x N) = alpha A B (+ column maxima into cmax[0, N)) or C += A B; N % 8 == 0. Column blocks
// of 16 (6 x 2 kernel), a last block of 8 (12 x 1 kernel); each block's B slice (K x 16 fp32,
// 16 KiB for K = 256) stays in L1 while the row blocks stream A.
template <bool ACC>
inline void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t sa, int64_t sp, const float* B,
                 int64_t ldb, float* C, int64_t ldc, float alpha, float* cmax) {
  for (int64_t j = 0; j < N; j += 16) {
    float* cm = cmax == nullptr ? nullptr : cmax + j;
    if (N - j >= 16)
      gemm_rows<6, 2, ACC>(M, K, A, sa, sp, B + j, ldb, C + j, ldc, alpha, cm);
    else
      gemm_rows<12, 1, ACC>(M, K, A, sa, sp, B + j, ldb, C + j, ldc, alpha, cm);
  }
}

}  // namespace rag_attn::cpu::avx2
RAG_ATTN_END_ISA
#endif  // RAG_ATTN_X86_DISPATCH
