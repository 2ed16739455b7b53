// fused-mlp: the C++ entry points behind the op schemas in torch_binding.cpp.
// Every op takes 2-D row-major views ([rows, hidden], unit stride along hidden, any row stride); the Python
// layer reshapes and checks arguments before calling. Math is fp32; results are rounded once.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <optional>
#include <tuple>

// ---- RMSNorm -------------------------------------------------------------------------------------------
// fwd: h = x (+ residual, rounded to residual_dtype); y = h * rstd * (offset + weight), rstd = rsqrt(mean(h^2)+eps)
// returns (y [M,N] out_dtype, h [M,N] residual_dtype or [0] without residual, rstd [M] fp32)
std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_fwd_cpu(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& weight,
    double eps, double offset, at::ScalarType out_dtype, std::optional<at::ScalarType> residual_dtype);
// bwd: dx = rstd * (g - xhat * mean(g * xhat)) + dh_extra, g = dy * (offset + w), xhat = h * rstd;
// dw = sum_rows(dy * xhat). returns (dx [M,N] dx_dtype, dw [N] weight dtype or [0] when not computed)
std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_cpu(
    const at::Tensor& dy, const at::Tensor& h, const at::Tensor& rstd, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& dh_extra, double offset, at::ScalarType dx_dtype, bool compute_dw);

#if defined(CUDA_KERNEL)
std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_fwd_cuda(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& weight,
    double eps, double offset, at::ScalarType out_dtype, std::optional<at::ScalarType> residual_dtype);
std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_cuda(
    const at::Tensor& dy, const at::Tensor& h, const at::Tensor& rstd, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& dh_extra, double offset, at::ScalarType dx_dtype, bool compute_dw);
#endif

// ---- Gated activations (GeGLU / SwiGLU) ------------------------------------------------------------------
#include <c10/util/string_view.h>

// activation: "gelu_tanh" | "gelu" (erf) | "silu". gate, up, dh: [T, I], unit stride along I, any row stride.
// fwd: h = act(gate) * up -> [T, I] contiguous, gate's dtype (gate and up share one dtype).
// bwd: dgate = dh * up * act'(gate), dup = dh * act(gate) -> ([T, I], [T, I]) contiguous, gate's dtype;
//      dh is float32 or gate's dtype. The activation is recomputed from gate, never stored.
// bwd_ (in place, for the fused MLP whose gate/up are its own intermediates): writes h = act(gate) * up into
//      dh's buffer, dgate into gate's buffer and dup into up's buffer (each element is read before it is written).
at::Tensor geglu_fwd_cpu(const at::Tensor& gate, const at::Tensor& up, c10::string_view activation);
std::tuple<at::Tensor, at::Tensor> geglu_bwd_cpu(const at::Tensor& dh, const at::Tensor& gate, const at::Tensor& up,
                                                 c10::string_view activation);
void geglu_bwd_inplace_cpu(const at::Tensor& dh, const at::Tensor& gate, const at::Tensor& up,
                           c10::string_view activation);

#if defined(CUDA_KERNEL)
at::Tensor geglu_fwd_cuda(const at::Tensor& gate, const at::Tensor& up, c10::string_view activation);
std::tuple<at::Tensor, at::Tensor> geglu_bwd_cuda(const at::Tensor& dh, const at::Tensor& gate, const at::Tensor& up,
                                                  c10::string_view activation);
void geglu_bwd_inplace_cuda(const at::Tensor& dh, const at::Tensor& gate, const at::Tensor& up,
                            c10::string_view activation);
#endif
