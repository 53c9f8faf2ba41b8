// Register-blocked AVX-512 micro-kernels for the CPU attention forward (fp32 FMA, AVX512-BF16 dot).
//
// C (MR x NV*16 fp32, ldc) = alpha * A B  (or C += A B), where A element (i, p) is read at
// A + i*sa + p*sp (broadcast, so any stride works: row-major K, or the transposed probability tile)
// and B is row-major (K x NV*16, ldb) with the last 16-lane column masked by `last` (query-tile
// tails). MR*NV accumulators live in zmm registers for the whole reduction (BLIS-style register
// blocking, Goto & van de Geijn 2008); no packing of A, and B is either already in the needed
// layout (V rows, fp32) or packed once per query tile / per head (bf16 pairs).
//
// Why not one BLAS call per tile: the tiles are small (K = 64..256) so per-call overhead and
// packing inside the BLAS are a large share, and the BLAS in libtorch_cpu (MKL) runs its
// AVX2 code path on AMD CPUs and has no AVX512-BF16 path there; these loops use 512-bit FMAs and
// vdpbf16ps directly.
//
// Compiled for AVX-512 through RAG_ATTN_BEGIN_AVX512 (isa.h) whatever -march says; the callers
// (fast_avx512.h) run only where the CPU has the features (isa.h's cpu_isa()).
#pragma once

#include "isa.h"

#if RAG_ATTN_X86_DISPATCH
#include <immintrin.h>

#include <cstdint>

RAG_ATTN_BEGIN_AVX512
namespace rag_attn::cpu::avx512 {

// exp for x <= ~88 (Cody-Waite reduction to [-ln2/2, ln2/2], degree-6 Taylor, 2^n by scalef);
// relative error ~2e-7 (exp_fast in vec.h is the scalar twin). Inputs below -87 give 0.
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
// Lanes [0, min(left, 16)) of a 16-lane vector.
inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1); }

// Epilogue: C = alpha * c (ACC = false; also folds the column maxima into cmax[0, 16*NV) when
// cmax is given: the online-softmax row max of an unmasked score tile without a second pass) or
// C += c (ACC = true).
template <int MR, int NV, bool ACC>
inline void store_tile(__m512 (&c)[MR][NV], float* C, int64_t ldc, __mmask16 last, float alpha, float* cmax) {
  __m512 mx[NV];
#pragma GCC unroll 16
  for (int v = 0; v < NV; ++v) mx[v] = _mm512_set1_ps(-__builtin_inff());
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      float* dst = C + i * ldc + 16 * v;
      const __mmask16 mk = v == NV - 1 ? last : __mmask16(0xFFFF);
      const __m512 r = ACC ? _mm512_add_ps(_mm512_maskz_loadu_ps(mk, dst), c[i][v])
                           : _mm512_mul_ps(c[i][v], _mm512_set1_ps(alpha));
      _mm512_mask_storeu_ps(dst, mk, r);
      if (!ACC) mx[v] = _mm512_max_ps(mx[v], r);
    }
  if (!ACC && cmax != nullptr) {
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      const __mmask16 mk = v == NV - 1 ? last : __mmask16(0xFFFF);
      _mm512_mask_storeu_ps(cmax + 16 * v, mk, _mm512_max_ps(_mm512_maskz_loadu_ps(mk, cmax + 16 * v), mx[v]));
    }
  }
}

template <int MR, int NV, bool ACC>
inline void uk_f32(int64_t K, const float* A, int64_t sa, int64_t sp, const float* B, int64_t ldb, float* C,
                   int64_t ldc, __mmask16 last, float alpha, float* cmax) {
  __m512 c[MR][NV];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) c[i][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K; ++p) {
    __m512 b[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v)
      b[v] = v == NV - 1 ? _mm512_maskz_loadu_ps(last, B + p * ldb + 16 * v) : _mm512_loadu_ps(B + p * ldb + 16 * v);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const __m512 a = _mm512_set1_ps(A[i * sa + p * sp]);
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) c[i][v] = _mm512_fmadd_ps(a, b[v], c[i][v]);
    }
  }
  store_tile<MR, NV, ACC>(c, C, ldc, last, alpha, cmax);
}

// Rows [0, M) in blocks of MR (a smaller tail kernel for the remainder).
template <int MR, int NV, bool ACC>
inline void gemm_rows_f32(int64_t M, int64_t K, const float* A, int64_t sa, int64_t sp, const float* B, int64_t ldb,
                          float* C, int64_t ldc, __mmask16 last, float alpha, float* cmax) {
  int64_t i = 0;
  for (; i + MR <= M; i += MR) uk_f32<MR, NV, ACC>(K, A + i * sa, sa, sp, B, ldb, C + i * ldc, ldc, last, alpha, cmax);
  const int64_t r = M - i;
  A += i * sa;
  C += i * ldc;
  switch (r) {  // compile-time row counts for the tail
#define RAG_TAIL(R) \
  case R: if constexpr (R < MR) uk_f32<R, NV, ACC>(K, A, sa, sp, B, ldb, C, ldc, last, alpha, cmax); break;
    RAG_TAIL(1) RAG_TAIL(2) RAG_TAIL(3) RAG_TAIL(4) RAG_TAIL(5) RAG_TAIL(6) RAG_TAIL(7) RAG_TAIL(8) RAG_TAIL(9)
    RAG_TAIL(10) RAG_TAIL(11)
#undef RAG_TAIL
    default: break;
  }
}

// Same with bf16 pairs: A and B hold uint32 words = two bf16 along the reduction dimension; B is
// in the VNNI layout (row p = reduction pair p). vdpbf16ps: c += a.lo*b.lo + a.hi*b.hi in fp32.
template <int MR, int NV, bool ACC>
inline void uk_bf16(int64_t K2, const uint32_t* A, int64_t sa, int64_t sp, const uint32_t* B, int64_t ldb, float* C,
                    int64_t ldc, __mmask16 last, float alpha, float* cmax) {
  __m512 c[MR][NV];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) c[i][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K2; ++p) {
    __m512i b[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v)
      b[v] = v == NV - 1 ? _mm512_maskz_loadu_epi32(last, B + p * ldb + 16 * v)
                         : _mm512_loadu_si512(B + p * ldb + 16 * v);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const __m512i a = _mm512_set1_epi32(int(A[i * sa + p * sp]));
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) c[i][v] = _mm512_dpbf16_ps(c[i][v], (__m512bh)a, (__m512bh)b[v]);
    }
  }
  store_tile<MR, NV, ACC>(c, C, ldc, last, alpha, cmax);
}

template <int MR, int NV, bool ACC>
inline void gemm_rows_bf16(int64_t M, int64_t K2, const uint32_t* A, int64_t sa, int64_t sp, const uint32_t* B,
                           int64_t ldb, float* C, int64_t ldc, __mmask16 last, float alpha, float* cmax) {
  int64_t i = 0;
  for (; i + MR <= M; i += MR) uk_bf16<MR, NV, ACC>(K2, A + i * sa, sa, sp, B, ldb, C + i * ldc, ldc, last, alpha, cmax);
  const int64_t r = M - i;
  A += i * sa;
  C += i * ldc;
  switch (r) {
#define RAG_TAIL(R) \
  case R: if constexpr (R < MR) uk_bf16<R, NV, ACC>(K2, A, sa, sp, B, ldb, C, ldc, last, alpha, cmax); break;
    RAG_TAIL(1) RAG_TAIL(2) RAG_TAIL(3) RAG_TAIL(4) RAG_TAIL(5) RAG_TAIL(6) RAG_TAIL(7) RAG_TAIL(8) RAG_TAIL(9)
    RAG_TAIL(10) RAG_TAIL(11)
#undef RAG_TAIL
    default: break;
  }
}
}  // namespace rag_attn::cpu::avx512
RAG_ATTN_END_ISA
#endif  // RAG_ATTN_X86_DISPATCH
