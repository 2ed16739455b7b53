// RMSNorm on CUDA: y = h * rsqrt(mean(h^2) + eps) * (offset + w), h = x (+ residual).
// x, residual, dy, dx: [M, N] (unit stride along N, any row stride); weight, dw: [N]; rstd: [M] fp32.
// fp32 math, one rounding per output. Forward: one block per row. Backward: a grid of row-blocks, each writing
// an fp32 dW partial row [blocks, N], then a column reduction in a fixed order (deterministic, no atomics).
#include <ATen/ops/empty.h>

#include "cuda/common.cuh"
#include "torch_binding.h"

namespace fused_mlp::cuda {
namespace {

constexpr int kThreads = 256;

template <typename TX, typename TR, typename TW, typename TO>
__global__ void rms_norm_fwd_kernel(const TX* __restrict__ x, int64_t x_stride,     // [M, N]
                                    const TR* __restrict__ res, int64_t res_stride,  // [M, N] or null
                                    TR* __restrict__ h, int64_t h_stride,            // [M, N] or null
                                    const TW* __restrict__ w,                        // [N] or null
                                    TO* __restrict__ y,                              // [M, N] contiguous
                                    float* __restrict__ rstd,                        // [M]
                                    int64_t N, float eps, float offset) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const TX* xr = x + row * x_stride;
  float ss = 0.f;
  if (res != nullptr) {
    const TR* rr = res + row * res_stride;
    TR* hr = h + row * h_stride;
    for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
      const TR hv = from_float<TR>(to_float(xr[i]) + to_float(rr[i]));
      hr[i] = hv;
      const float f = to_float(hv);  // normalise the rounded residual stream value
      ss += f * f;
    }
  } else {
    for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
      const float f = to_float(xr[i]);
      ss += f * f;
    }
  }
  ss = block_reduce_sum(ss, scratch);
  const float rs = rsqrtf(ss / static_cast<float>(N) + eps);
  if (threadIdx.x == 0) rstd[row] = rs;
  TO* yr = y + row * N;
  if (res != nullptr) {
    // Each thread re-reads the h elements it wrote itself: no barrier needed.
    const TR* hr = h + row * h_stride;
    for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
      const float s = w != nullptr ? offset + to_float(w[i]) : 1.f;
      yr[i] = from_float<TO>(to_float(hr[i]) * rs * s);
    }
  } else {
    for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
      const float s = w != nullptr ? offset + to_float(w[i]) : 1.f;
      yr[i] = from_float<TO>(to_float(xr[i]) * rs * s);
    }
  }
}

template <typename TH, typename TD, typename TW, typename TX, typename TE>
__global__ void rms_norm_bwd_kernel(const TD* __restrict__ dy, int64_t dy_stride,  // [M, N]
                                    const TH* __restrict__ h, int64_t h_stride,    // [M, N]
                                    const float* __restrict__ rstd,                // [M]
                                    const TW* __restrict__ w,                      // [N] or null
                                    const TE* __restrict__ extra, int64_t e_stride,  // [M, N] or null
                                    TX* __restrict__ dx,                           // [M, N] contiguous
                                    float* __restrict__ dw_partial,                // [gridDim.x, N] or null
                                    int64_t M, int64_t N, float offset) {
  __shared__ float scratch[32];
  float* part = dw_partial != nullptr ? dw_partial + blockIdx.x * N : nullptr;
  if (part != nullptr)
    for (int64_t i = threadIdx.x; i < N; i += blockDim.x) part[i] = 0.f;
  for (int64_t row = blockIdx.x; row < M; row += gridDim.x) {
    const TD* dyr = dy + row * dy_stride;
    const TH* hr = h + row * h_stride;
    const float rs = rstd[row];
    float dotv = 0.f;
    for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
      const float s = w != nullptr ? offset + to_float(w[i]) : 1.f;
      const float xhat = to_float(hr[i]) * rs;
      const float g = to_float(dyr[i]);
      dotv += g * s * xhat;
      if (part != nullptr) part[i] += g * xhat;  // same thread, same column every row: no race
    }
    const float c = block_reduce_sum(dotv, scratch) / static_cast<float>(N);
    TX* dxr = dx + row * N;
    for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
      const float s = w != nullptr ? offset + to_float(w[i]) : 1.f;
      const float xhat = to_float(hr[i]) * rs;
      float v = rs * (to_float(dyr[i]) * s - xhat * c);
      if (extra != nullptr) v += to_float(extra[row * e_stride + i]);
      dxr[i] = from_float<TX>(v);
    }
  }
}

template <typename TW>
__global__ void column_sum_kernel(const float* __restrict__ partial, int rows, int64_t N, TW* __restrict__ out) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= N) return;
  float s = 0.f;
  for (int r = 0; r < rows; ++r) s += partial[static_cast<int64_t>(r) * N + col];
  out[col] = from_float<TW>(s);
}

int sm_count(int device) {
  static int cached[64] = {0};
  if (device < 64 && cached[device] > 0) return cached[device];
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  if (device < 64) cached[device] = n;
  return n;
}

void check_rows_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "fused_mlp: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.dim() == 2, "fused_mlp: ", name, " must be 2-D [rows, hidden], got ", t.dim(), "-D");
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, "fused_mlp: ", name, " must have unit stride along hidden");
}

}  // namespace
}  // namespace fused_mlp::cuda

using namespace fused_mlp::cuda;

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_fwd_cuda(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& weight,
    double eps, double offset, at::ScalarType out_dtype, std::optional<at::ScalarType> residual_dtype) {
  check_rows_cuda(x, "x");
  const int64_t M = x.size(0), N = x.size(1);
  if (residual.has_value()) {
    check_rows_cuda(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "fused_mlp: residual shape mismatch");
  }
  if (weight.has_value())
    TORCH_CHECK(weight->is_cuda() && weight->dim() == 1 && weight->size(0) == N && weight->is_contiguous(),
                "fused_mlp: weight must be a contiguous CUDA tensor [", N, "]");
  const at::ScalarType h_dtype = residual_dtype.value_or(x.scalar_type());
  TORCH_CHECK(!residual.has_value() || residual->scalar_type() == h_dtype,
              "fused_mlp: residual dtype must equal residual_dtype");
  c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty({M, N}, x.options().dtype(out_dtype));
  auto h = residual.has_value() ? at::empty({M, N}, x.options().dtype(h_dtype)) : at::empty({0}, x.options());
  auto rstd = at::empty({M}, x.options().dtype(at::kFloat));
  if (M == 0) return {y, h, rstd};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const at::ScalarType w_dtype = weight.has_value() ? weight->scalar_type() : x.scalar_type();
  dispatch_float(x.scalar_type(), "x", [&](auto xt) {
    using TX = decltype(xt);
    dispatch_base_or_float<TX>(h_dtype, "residual", [&](auto rt) {
      using TR = decltype(rt);
      dispatch_base_or_float<TX>(w_dtype, "weight", [&](auto wt) {
        using TW = decltype(wt);
        dispatch_base_or_float<TX>(out_dtype, "out", [&](auto ot) {
          using TO = decltype(ot);
          rms_norm_fwd_kernel<TX, TR, TW, TO><<<static_cast<unsigned>(M), kThreads, 0, stream>>>(
              static_cast<const TX*>(x.const_data_ptr()), x.stride(0),
              residual.has_value() ? static_cast<const TR*>(residual->const_data_ptr()) : nullptr,
              residual.has_value() ? residual->stride(0) : 0,
              residual.has_value() ? static_cast<TR*>(h.data_ptr()) : nullptr, N,
              weight.has_value() ? static_cast<const TW*>(weight->const_data_ptr()) : nullptr,
              static_cast<TO*>(y.data_ptr()), rstd.data_ptr<float>(), N, static_cast<float>(eps),
              static_cast<float>(offset));
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      });
    });
  });
  return {y, h, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_cuda(
    const at::Tensor& dy, const at::Tensor& h, const at::Tensor& rstd, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& dh_extra, double offset, at::ScalarType dx_dtype, bool compute_dw) {
  check_rows_cuda(dy, "dy");
  check_rows_cuda(h, "h");
  const int64_t M = h.size(0), N = h.size(1);
  TORCH_CHECK(dy.sizes() == h.sizes(), "fused_mlp: dy shape mismatch");
  TORCH_CHECK(rstd.is_cuda() && rstd.dim() == 1 && rstd.size(0) == M && rstd.scalar_type() == at::kFloat &&
                  rstd.is_contiguous(),
              "fused_mlp: rstd must be contiguous float32 [", M, "]");
  if (dh_extra.has_value()) {
    check_rows_cuda(*dh_extra, "dh_extra");
    TORCH_CHECK(dh_extra->sizes() == h.sizes(), "fused_mlp: dh_extra shape mismatch");
  }
  if (weight.has_value())
    TORCH_CHECK(weight->is_cuda() && weight->dim() == 1 && weight->size(0) == N && weight->is_contiguous(),
                "fused_mlp: weight must be a contiguous CUDA tensor [", N, "]");
  c10::cuda::CUDAGuard guard(h.device());
  const bool want_dw = compute_dw && weight.has_value();
  auto dx = at::empty({M, N}, h.options().dtype(dx_dtype));
  at::Tensor dw = want_dw ? at::empty({N}, weight->options()) : at::empty({0}, h.options());
  if (want_dw && M == 0) dw.zero_();
  if (M == 0) return {dx, dw};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int blocks = static_cast<int>(std::min<int64_t>(M, 2 * sm_count(h.get_device())));
  at::Tensor partial = want_dw ? at::empty({blocks, N}, h.options().dtype(at::kFloat)) : at::Tensor();
  const at::ScalarType w_dtype = weight.has_value() ? weight->scalar_type() : dx_dtype;
  const at::ScalarType e_dtype = dh_extra.has_value() ? dh_extra->scalar_type() : dx_dtype;
  dispatch_float(dx_dtype, "dx", [&](auto xt) {
    using TX = decltype(xt);
    dispatch_base_or_float<TX>(h.scalar_type(), "h", [&](auto ht) {
      using TH = decltype(ht);
      dispatch_base_or_float<TX>(dy.scalar_type(), "dy", [&](auto dt) {
        using TD = decltype(dt);
        dispatch_base_or_float<TX>(w_dtype, "weight", [&](auto wt) {
          using TW = decltype(wt);
          dispatch_base_or_float<TX>(e_dtype, "dh_extra", [&](auto et) {
            using TE = decltype(et);
            rms_norm_bwd_kernel<TH, TD, TW, TX, TE><<<blocks, kThreads, 0, stream>>>(
                static_cast<const TD*>(dy.const_data_ptr()), dy.stride(0), static_cast<const TH*>(h.const_data_ptr()),
                h.stride(0), rstd.const_data_ptr<float>(),
                weight.has_value() ? static_cast<const TW*>(weight->const_data_ptr()) : nullptr,
                dh_extra.has_value() ? static_cast<const TE*>(dh_extra->const_data_ptr()) : nullptr,
                dh_extra.has_value() ? dh_extra->stride(0) : 0, static_cast<TX*>(dx.data_ptr()),
                want_dw ? partial.data_ptr<float>() : nullptr, M, N, static_cast<float>(offset));
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          });
        });
      });
    });
  });
  if (want_dw) {
    dispatch_float(dw.scalar_type(), "weight", [&](auto wt) {
      using TW = decltype(wt);
      column_sum_kernel<TW><<<ceil_div(N, 256), 256, 0, stream>>>(partial.data_ptr<float>(), blocks, N,
                                                                 static_cast<TW*>(dw.data_ptr()));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  return {dx, dw};
}
