// Block-wise symmetric int8 quantisation for the inter-host stage (ZeRO++ qgZ style), CPU.
//
// Blocks of `block` consecutive elements along the last dim; one fp32 scale per block:
//   scale = amax / 127,  q = clamp(round_half_even(y * 127 / amax), -127, 127)
// With error feedback (1-bit Adam / ZeRO++): y = x + err, and afterwards err = y - q * scale.
#include <ATen/Dispatch.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

namespace rmm_comm {

namespace {

void check_quant_input(const at::Tensor& x, int64_t block) {
  TORCH_CHECK(block > 0, "rmm_comm: block_size must be positive");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "rmm_comm: quantize needs a non-empty last dim");
  TORCH_CHECK(x.is_floating_point(), "rmm_comm: quantize needs a floating tensor");
}

std::vector<int64_t> scales_shape(const at::Tensor& x, int64_t block) {
  std::vector<int64_t> s(x.sizes().begin(), x.sizes().end());
  s.back() = (s.back() + block - 1) / block;
  return s;
}

std::tuple<at::Tensor, at::Tensor> quantize_impl(const at::Tensor& x_, const c10::optional<at::Tensor>& err,
                                                 int64_t block) {
  check_quant_input(x_, block);
  at::Tensor x = x_.contiguous();
  float* e = nullptr;
  if (err.has_value()) {
    TORCH_CHECK(err->scalar_type() == at::kFloat && err->is_contiguous() && err->sizes() == x.sizes(),
                "rmm_comm: error buffer must be contiguous float32 with the input's shape");
    e = err->data_ptr<float>();
  }
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kChar));
  at::Tensor s = at::empty(scales_shape(x, block), x.options().dtype(at::kFloat));
  const int64_t n = x.size(-1), nb = s.size(-1), rows = x.numel() / n;
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = s.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_int8", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, rows * nb, 64, [&](int64_t b0, int64_t b1) {
      float y[1024];
      for (int64_t bi = b0; bi < b1; ++bi) {
        const int64_t row = bi / nb, blk = bi % nb;
        const int64_t i0 = row * n + blk * block;
        const int64_t m = std::min(block, n - blk * block);
        float amax = 0.f;
        // Blocks larger than the stack tile are processed in two passes over memory.
        for (int64_t t0 = 0; t0 < m; t0 += 1024) {
          const int64_t tm = std::min<int64_t>(1024, m - t0);
          for (int64_t i = 0; i < tm; ++i) {
            float v = static_cast<float>(xp[i0 + t0 + i]) + (e ? e[i0 + t0 + i] : 0.f);
            y[i] = v;
            amax = std::max(amax, std::fabs(v));
          }
          if (e && m > 1024) {  // remember y for the second pass
            for (int64_t i = 0; i < tm; ++i) e[i0 + t0 + i] = y[i];
          }
        }
        const float scale = amax / 127.f;
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        sp[row * nb + blk] = scale;
        for (int64_t t0 = 0; t0 < m; t0 += 1024) {
          const int64_t tm = std::min<int64_t>(1024, m - t0);
          for (int64_t i = 0; i < tm; ++i) {
            float v = m > 1024 ? (e ? e[i0 + t0 + i] : static_cast<float>(xp[i0 + t0 + i])) : y[i];
            float r = std::nearbyint(v * inv);
            r = std::min(127.f, std::max(-127.f, r));
            qp[i0 + t0 + i] = static_cast<int8_t>(r);
            if (e) e[i0 + t0 + i] = v - r * scale;
          }
        }
      }
    });
  });
  return {q, s};
}

std::tuple<at::Tensor, at::Tensor> quantize_int8(const at::Tensor& x, int64_t block) {
  return quantize_impl(x, c10::nullopt, block);
}

std::tuple<at::Tensor, at::Tensor> quantize_int8_ef(const at::Tensor& x, at::Tensor err, int64_t block) {
  return quantize_impl(x, err, block);
}

void check_dequant(const at::Tensor& q, const at::Tensor& s, int64_t block) {
  TORCH_CHECK(block > 0, "rmm_comm: block_size must be positive");
  TORCH_CHECK(q.scalar_type() == at::kChar && s.scalar_type() == at::kFloat,
              "rmm_comm: dequantize needs int8 values and float32 scales");
  TORCH_CHECK(q.dim() >= 1 && s.dim() == q.dim(), "rmm_comm: scales must have the values' rank");
  TORCH_CHECK(s.size(-1) == (q.size(-1) + block - 1) / block, "rmm_comm: scales' last dim must be ceil(n / block)");
}

// out[j] = sum over g of q[g, j] * scale[g, block(j)]; G = 1 gives plain dequantisation.
void dequant_sum_kernel(const int8_t* q, const float* s, float* out, int64_t G, int64_t rows, int64_t n,
                        int64_t nb, int64_t block) {
  at::parallel_for(0, rows * nb, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t bi = b0; bi < b1; ++bi) {
      const int64_t row = bi / nb, blk = bi % nb;
      const int64_t i0 = row * n + blk * block;
      const int64_t m = std::min(block, n - blk * block);
      for (int64_t g = 0; g < G; ++g) {
        const float sc = s[g * rows * nb + bi];
        const int8_t* qg = q + g * rows * n + i0;
        if (g == 0) {
          for (int64_t i = 0; i < m; ++i) out[i0 + i] = static_cast<float>(qg[i]) * sc;
        } else {
          for (int64_t i = 0; i < m; ++i) out[i0 + i] += static_cast<float>(qg[i]) * sc;
        }
      }
    }
  });
}

at::Tensor dequantize_int8(const at::Tensor& q_, const at::Tensor& s_, int64_t block) {
  check_dequant(q_, s_, block);
  at::Tensor q = q_.contiguous(), s = s_.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(at::kFloat));
  const int64_t n = q.size(-1);
  dequant_sum_kernel(q.data_ptr<int8_t>(), s.data_ptr<float>(), out.data_ptr<float>(), 1, q.numel() / n, n,
                     s.size(-1), block);
  return out;
}

at::Tensor dequantize_sum_int8(const at::Tensor& q_, const at::Tensor& s_, int64_t block) {
  check_dequant(q_, s_, block);
  TORCH_CHECK(q_.dim() >= 2 && s_.size(0) == q_.size(0), "rmm_comm: dequantize_sum needs a leading group dim");
  at::Tensor q = q_.contiguous(), s = s_.contiguous();
  at::Tensor out = at::empty(q.sizes().slice(1), q.options().dtype(at::kFloat));
  const int64_t n = q.size(-1), G = q.size(0);
  dequant_sum_kernel(q.data_ptr<int8_t>(), s.data_ptr<float>(), out.data_ptr<float>(), G,
                     q.numel() / G / n, n, s.size(-1), block);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(rmm_comm, CPU, m) {
  m.impl("quantize_int8", &quantize_int8);
  m.impl("quantize_int8_ef", &quantize_int8_ef);
  m.impl("dequantize_int8", &dequantize_int8);
  m.impl("dequantize_sum_int8", &dequantize_sum_int8);
}

}  // namespace rmm_comm
