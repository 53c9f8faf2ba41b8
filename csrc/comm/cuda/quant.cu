// Block-wise symmetric int8 quantisation, CUDA. Same contract as cpu/quant.cpp:
//   scale = amax / 127, q = clamp(rint(y * 127 / amax), -127, 127), y = x (+ err), err = y - q*scale.
// One thread block per quantisation block: a block-wide max reduction, then a second pass.
#include <ATen/Dispatch.h>
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace rmm_comm {

namespace {

constexpr int kThreads = 256;

__device__ inline float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

template <class T>
__global__ void quantize_kernel(const T* __restrict__ x, float* __restrict__ err, int8_t* __restrict__ q,
                                float* __restrict__ scales, int64_t n, int64_t nb, int64_t block) {
  __shared__ float red[kThreads / 32];
  const int64_t bi = blockIdx.x;  // (row, blk) flattened
  const int64_t row = bi / nb, blk = bi % nb;
  const int64_t i0 = row * n + blk * block;
  const int64_t m = min(block, n - blk * block);
  float amax = 0.f;
  for (int64_t i = threadIdx.x; i < m; i += blockDim.x) {
    float v = static_cast<float>(x[i0 + i]);
    if (err) {
      v += err[i0 + i];
      err[i0 + i] = v;  // keep y for the second pass
    }
    amax = fmaxf(amax, fabsf(v));
  }
  amax = warp_max(amax);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = amax;
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.f;
    v = warp_max(v);
    if (threadIdx.x == 0) red[0] = v;
  }
  __syncthreads();
  amax = red[0];
  const float scale = amax / 127.f;
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  if (threadIdx.x == 0) scales[bi] = scale;
  for (int64_t i = threadIdx.x; i < m; i += blockDim.x) {
    const float v = err ? err[i0 + i] : static_cast<float>(x[i0 + i]);
    const float r = fminf(127.f, fmaxf(-127.f, rintf(v * inv)));
    q[i0 + i] = static_cast<int8_t>(r);
    if (err) err[i0 + i] = v - r * scale;
  }
}

__global__ void dequant_sum_kernel(const int8_t* __restrict__ q, const float* __restrict__ s,
                                   float* __restrict__ out, int64_t G, int64_t total, int64_t n,
                                   int64_t nb, int64_t block) {
  const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (j >= total) return;
  const int64_t row = j / n, col = j % n;
  const int64_t si = row * nb + col / block;
  const int64_t rows_nb = total / n * nb;
  float acc = 0.f;
  for (int64_t g = 0; g < G; ++g) acc += static_cast<float>(q[g * total + j]) * s[g * rows_nb + si];
  out[j] = acc;
}

std::vector<int64_t> scales_shape(const at::Tensor& x, int64_t block) {
  std::vector<int64_t> s(x.sizes().begin(), x.sizes().end());
  s.back() = (s.back() + block - 1) / block;
  return s;
}

std::tuple<at::Tensor, at::Tensor> quantize_cuda(const at::Tensor& x_, float* err, int64_t block) {
  TORCH_CHECK(block > 0 && x_.dim() >= 1 && x_.size(-1) > 0 && x_.is_floating_point(),
              "rmm_comm: quantize needs a floating tensor with a non-empty last dim and block_size > 0");
  c10::cuda::CUDAGuard guard(x_.device());
  at::Tensor x = x_.contiguous();
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kChar));
  at::Tensor s = at::empty(scales_shape(x, block), x.options().dtype(at::kFloat));
  const int64_t n = x.size(-1), nb = s.size(-1), nblocks = x.numel() / n * nb;
  if (nblocks == 0) return {q, s};
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_int8_cuda", [&] {
    quantize_kernel<scalar_t><<<nblocks, kThreads, 0, stream>>>(x.data_ptr<scalar_t>(), err, q.data_ptr<int8_t>(),
                                                               s.data_ptr<float>(), n, nb, block);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {q, s};
}

std::tuple<at::Tensor, at::Tensor> quantize_int8_cuda(const at::Tensor& x, int64_t block) {
  return quantize_cuda(x, nullptr, block);
}

std::tuple<at::Tensor, at::Tensor> quantize_int8_ef_cuda(const at::Tensor& x, at::Tensor err, int64_t block) {
  TORCH_CHECK(err.is_cuda() && err.scalar_type() == at::kFloat && err.is_contiguous() && err.sizes() == x.sizes(),
              "rmm_comm: error buffer must be contiguous float32 (CUDA) with the input's shape");
  return quantize_cuda(x, err.data_ptr<float>(), block);
}

at::Tensor dequant_cuda(const at::Tensor& q_, const at::Tensor& s_, int64_t block, bool sum_groups) {
  TORCH_CHECK(block > 0 && q_.scalar_type() == at::kChar && s_.scalar_type() == at::kFloat && q_.dim() >= 1 &&
                  s_.dim() == q_.dim() && s_.size(-1) == (q_.size(-1) + block - 1) / block,
              "rmm_comm: dequantize needs int8 values and float32 scales of shape (..., ceil(n / block))");
  TORCH_CHECK(!sum_groups || (q_.dim() >= 2 && s_.size(0) == q_.size(0)),
              "rmm_comm: dequantize_sum needs a leading group dim");
  c10::cuda::CUDAGuard guard(q_.device());
  at::Tensor q = q_.contiguous(), s = s_.contiguous();
  const int64_t G = sum_groups ? q.size(0) : 1;
  at::Tensor out = at::empty(sum_groups ? q.sizes().slice(1) : q.sizes(), q.options().dtype(at::kFloat));
  const int64_t total = out.numel(), n = q.size(-1), nb = s.size(-1);
  if (total == 0) return out;
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t grid = (total + kThreads - 1) / kThreads;
  dequant_sum_kernel<<<grid, kThreads, 0, stream>>>(q.data_ptr<int8_t>(), s.data_ptr<float>(), out.data_ptr<float>(),
                                                    G, total, n, nb, block);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor dequantize_int8_cuda(const at::Tensor& q, const at::Tensor& s, int64_t block) {
  return dequant_cuda(q, s, block, false);
}
at::Tensor dequantize_sum_int8_cuda(const at::Tensor& q, const at::Tensor& s, int64_t block) {
  return dequant_cuda(q, s, block, true);
}

}  // namespace

TORCH_LIBRARY_IMPL(rmm_comm, CUDA, m) {
  m.impl("quantize_int8", &quantize_int8_cuda);
  m.impl("quantize_int8_ef", &quantize_int8_ef_cuda);
  m.impl("dequantize_int8", &dequantize_int8_cuda);
  m.impl("dequantize_sum_int8", &dequantize_sum_int8_cuda);
}

}  // namespace rmm_comm
