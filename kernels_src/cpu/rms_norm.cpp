// RMSNorm on the CPU: y = h * rsqrt(mean(h^2) + eps) * (offset + w), h = x (+ residual).
// x, residual, dy: [M, N] (unit stride along N, any row stride); weight: [N]; rstd: [M] fp32.
// Rows are spread over ATen's thread pool; each row is converted to fp32 once, all math is fp32 and results
// are rounded once on store. dW uses a fixed number of row chunks, each with its own fp32 partial row,
// reduced in a fixed order, so the result does not depend on the thread count.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cmath>
#include <vector>

#include "cpu/cpu_common.h"
#include "torch_binding.h"

namespace fused_mlp::cpu {
namespace {

// Sum of squares with 16 independent accumulators (vectorisable without reassociation flags).
inline float sum_squares(const float* __restrict v, int64_t n) {
  float acc[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += v[i + j] * v[i + j];
  float s = 0.f;
  for (int j = 0; j < 16; ++j) s += acc[j];
  for (; i < n; ++i) s += v[i] * v[i];
  return s;
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j];
  float s = 0.f;
  for (int j = 0; j < 16; ++j) s += acc[j];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// (offset + w) in fp32, or empty when there is no weight.
std::vector<float> scale_row(const std::optional<at::Tensor>& weight, double offset, int64_t n) {
  std::vector<float> w;
  if (weight.has_value()) {
    w.resize(n);
    load_row(weight->const_data_ptr(), weight->scalar_type(), w.data(), n);
    const float off = static_cast<float>(offset);
    for (int64_t i = 0; i < n; ++i) w[i] += off;
  }
  return w;
}

}  // namespace
}  // namespace fused_mlp::cpu

using namespace fused_mlp::cpu;

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_fwd_cpu(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& weight,
    double eps, double offset, at::ScalarType out_dtype, std::optional<at::ScalarType> residual_dtype) {
  check_rows(x, "x");
  const int64_t M = x.size(0), N = x.size(1);
  if (residual.has_value()) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "fused_mlp: residual shape ", residual->sizes(),
                " != x shape ", x.sizes());
  }
  if (weight.has_value())
    TORCH_CHECK(weight->dim() == 1 && weight->size(0) == N && weight->is_contiguous(),
                "fused_mlp: weight must be contiguous [", N, "]");
  const at::ScalarType h_dtype = residual_dtype.value_or(x.scalar_type());
  auto y = at::empty({M, N}, x.options().dtype(out_dtype));
  auto h = residual.has_value() ? at::empty({M, N}, x.options().dtype(h_dtype)) : at::empty({0}, x.options());
  auto rstd = at::empty({M}, x.options().dtype(at::kFloat));
  if (M == 0) return {y, h, rstd};

  const std::vector<float> w = scale_row(weight, offset, N);
  const float feps = static_cast<float>(eps);
  float* rstd_p = rstd.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(N, 1));
  at::parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(N), rbuf(residual.has_value() ? N : 0);
    for (int64_t r = begin; r < end; ++r) {
      load_row(row_ptr(x, r), x.scalar_type(), buf.data(), N);
      if (residual.has_value()) {
        load_row(row_ptr(*residual, r), residual->scalar_type(), rbuf.data(), N);
        for (int64_t i = 0; i < N; ++i) buf[i] += rbuf[i];
        // The residual stream carries h rounded to its dtype; normalise exactly that value.
        store_row(buf.data(), h_dtype, row_ptr_mut(h, r), N);
        if (h_dtype != at::kFloat) load_row(row_ptr(h, r), h_dtype, buf.data(), N);
      }
      const float rs = 1.0f / std::sqrt(sum_squares(buf.data(), N) / static_cast<float>(N) + feps);
      rstd_p[r] = rs;
      if (w.empty()) {
        for (int64_t i = 0; i < N; ++i) buf[i] *= rs;
      } else {
        for (int64_t i = 0; i < N; ++i) buf[i] = buf[i] * rs * w[i];
      }
      store_row(buf.data(), out_dtype, row_ptr_mut(y, r), N);
    }
  });
  return {y, h, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_cpu(
    const at::Tensor& dy, const at::Tensor& h, const at::Tensor& rstd, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& dh_extra, double offset, at::ScalarType dx_dtype, bool compute_dw) {
  check_rows(dy, "dy");
  check_rows(h, "h");
  const int64_t M = h.size(0), N = h.size(1);
  TORCH_CHECK(dy.sizes() == h.sizes(), "fused_mlp: dy shape ", dy.sizes(), " != h shape ", h.sizes());
  TORCH_CHECK(rstd.dim() == 1 && rstd.size(0) == M && rstd.scalar_type() == at::kFloat && rstd.is_contiguous(),
              "fused_mlp: rstd must be contiguous float32 [", M, "]");
  if (dh_extra.has_value()) {
    check_rows(*dh_extra, "dh_extra");
    TORCH_CHECK(dh_extra->sizes() == h.sizes(), "fused_mlp: dh_extra shape mismatch");
  }
  if (weight.has_value())
    TORCH_CHECK(weight->dim() == 1 && weight->size(0) == N && weight->is_contiguous(),
                "fused_mlp: weight must be contiguous [", N, "]");
  const bool want_dw = compute_dw && weight.has_value();
  auto dx = at::empty({M, N}, h.options().dtype(dx_dtype));
  at::Tensor dw = want_dw ? at::empty({N}, weight->options()) : at::empty({0}, h.options());
  if (want_dw && M == 0) dw.zero_();
  if (M == 0) return {dx, dw};

  const std::vector<float> w = scale_row(weight, offset, N);
  const float* rstd_p = rstd.const_data_ptr<float>();
  // Fixed chunking (independent of the thread count) keeps dW bitwise reproducible.
  const int64_t chunks = std::min<int64_t>(M, 64);
  const int64_t rows_per_chunk = (M + chunks - 1) / chunks;
  std::vector<float> partial(want_dw ? chunks * N : 0, 0.f);
  at::parallel_for(0, chunks, 1, [&](int64_t cbegin, int64_t cend) {
    std::vector<float> hb(N), g(N), extra(dh_extra.has_value() ? N : 0);
    for (int64_t c = cbegin; c < cend; ++c) {
      float* acc = want_dw ? partial.data() + c * N : nullptr;
      const int64_t rend = std::min(M, (c + 1) * rows_per_chunk);
      for (int64_t r = c * rows_per_chunk; r < rend; ++r) {
        load_row(row_ptr(h, r), h.scalar_type(), hb.data(), N);
        load_row(row_ptr(dy, r), dy.scalar_type(), g.data(), N);
        const float rs = rstd_p[r];
        for (int64_t i = 0; i < N; ++i) hb[i] *= rs;  // xhat
        if (acc)
          for (int64_t i = 0; i < N; ++i) acc[i] += g[i] * hb[i];
        if (!w.empty())
          for (int64_t i = 0; i < N; ++i) g[i] *= w[i];
        const float c_mean = dot(g.data(), hb.data(), N) / static_cast<float>(N);
        for (int64_t i = 0; i < N; ++i) g[i] = rs * (g[i] - hb[i] * c_mean);
        if (dh_extra.has_value()) {
          load_row(row_ptr(*dh_extra, r), dh_extra->scalar_type(), extra.data(), N);
          for (int64_t i = 0; i < N; ++i) g[i] += extra[i];
        }
        store_row(g.data(), dx_dtype, row_ptr_mut(dx, r), N);
      }
    }
  });
  if (want_dw) {
    std::vector<float> total(N, 0.f);
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t i = 0; i < N; ++i) total[i] += partial[c * N + i];
    store_row(total.data(), dw.scalar_type(), dw.data_ptr(), N);
  }
  return {dx, dw};
}
