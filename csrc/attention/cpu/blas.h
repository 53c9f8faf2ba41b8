// Small row-major GEMM front end for the CPU attention kernels.
//
// C (m x n, ldc) = alpha * op(A) * op(B) + beta * C, all row-major, op = optional transpose.
// Inputs are scalar_t (float / double / bfloat16), the accumulator C is acc_t (float / double):
// FlashAttention keeps every running sum in fp32 even for 16-bit inputs.
//
// The fast path calls the BLAS that libtorch_cpu already carries (MKL's sgemm_/dgemm_ and
// cblas_gemm_bf16bf16f32 on x86 builds). They are declared weak so the extension still loads on
// builds without them (aarch64, OpenBLAS builds): a null symbol selects the portable loops below.
#pragma once

#include <c10/util/BFloat16.h>
#include <cstdint>

extern "C" {
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
            const int*, const float*, const int*, const float*, float*, const int*) __attribute__((weak));
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*, const double*,
            const int*, const double*, const int*, const double*, double*, const int*)
    __attribute__((weak));
// MKL: layout 101 = row major; trans 111 = no, 112 = yes; MKL_BF16 is a uint16 bit pattern.
void cblas_gemm_bf16bf16f32(int, int, int, int, int, int, float, const uint16_t*, int, const uint16_t*,
                            int, float, float*, int) __attribute__((weak));
}

namespace rag_attn::cpu {

inline bool have_fast_blas() { return sgemm_ != nullptr; }

// Portable fallback: C = alpha * op(A) op(B) + beta * C, accumulated in acc_t.
template <typename scalar_t, typename acc_t>
inline void gemm_ref(bool ta, bool tb, int m, int n, int k, acc_t alpha, const scalar_t* A, int lda,
                     const scalar_t* B, int ldb, acc_t beta, acc_t* C, int ldc) {
  for (int i = 0; i < m; ++i) {
    acc_t* c = C + (int64_t)i * ldc;
    if (beta == acc_t(0)) {
      for (int j = 0; j < n; ++j) c[j] = 0;
    } else if (beta != acc_t(1)) {
      for (int j = 0; j < n; ++j) c[j] *= beta;
    }
    for (int p = 0; p < k; ++p) {
      const acc_t a = alpha * acc_t(ta ? A[(int64_t)p * lda + i] : A[(int64_t)i * lda + p]);
      if (!tb) {
        const scalar_t* b = B + (int64_t)p * ldb;
#pragma omp simd
        for (int j = 0; j < n; ++j) c[j] += a * acc_t(b[j]);
      } else {
        for (int j = 0; j < n; ++j) c[j] += a * acc_t(B[(int64_t)j * ldb + p]);
      }
    }
  }
}

// Row-major C = A.B is column-major C^T = B^T.A^T: swap the operands for Fortran BLAS.
inline void gemm(bool ta, bool tb, int m, int n, int k, float alpha, const float* A, int lda,
                 const float* B, int ldb, float beta, float* C, int ldc) {
  if (m == 0 || n == 0) return;
  if (sgemm_ != nullptr && k > 0) {
    const char tA = ta ? 'T' : 'N', tB = tb ? 'T' : 'N';
    sgemm_(&tB, &tA, &n, &m, &k, &alpha, B, &ldb, A, &lda, &beta, C, &ldc);
  } else {
    gemm_ref<float, float>(ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc);
  }
}

inline void gemm(bool ta, bool tb, int m, int n, int k, double alpha, const double* A, int lda,
                 const double* B, int ldb, double beta, double* C, int ldc) {
  if (m == 0 || n == 0) return;
  if (dgemm_ != nullptr && k > 0) {
    const char tA = ta ? 'T' : 'N', tB = tb ? 'T' : 'N';
    dgemm_(&tB, &tA, &n, &m, &k, &alpha, B, &ldb, A, &lda, &beta, C, &ldc);
  } else {
    gemm_ref<double, double>(ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc);
  }
}

inline void gemm(bool ta, bool tb, int m, int n, int k, float alpha, const c10::BFloat16* A, int lda,
                 const c10::BFloat16* B, int ldb, float beta, float* C, int ldc) {
  if (m == 0 || n == 0) return;
  if (cblas_gemm_bf16bf16f32 != nullptr && k > 0) {
    cblas_gemm_bf16bf16f32(101, ta ? 112 : 111, tb ? 112 : 111, m, n, k, alpha,
                           reinterpret_cast<const uint16_t*>(A), lda,
                           reinterpret_cast<const uint16_t*>(B), ldb, beta, C, ldc);
  } else {
    gemm_ref<c10::BFloat16, float>(ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc);
  }
}

}  // namespace rag_attn::cpu
