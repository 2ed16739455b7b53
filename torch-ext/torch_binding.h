// fused-mlp: the C++ entry points behind the op schemas in torch_binding.cpp.
// Every op takes 2-D row-major views ([rows, hidden], unit stride along hidden, any row stride); the Python
// layer reshapes and checks arguments before calling. Math is fp32; results are rounded once.
#pragma once

#include <optional>
#include <tuple>
#include <vector>

#include "torch_compat.h"

// The entry points are spelled with fused_mlp's names (torch_compat.h): one source, two builds (the classic
// per-torch API and torch's stable ABI).
using fused_mlp::kBFloat16;
using fused_mlp::kDouble;
using fused_mlp::kFloat;
using fused_mlp::kHalf;
using fused_mlp::ScalarType;
using fused_mlp::ShapeArg;
using fused_mlp::StrArg;
using fused_mlp::Tensor;

// ---- RMSNorm -------------------------------------------------------------------------------------------
// fwd: h = x (+ residual, rounded to residual_dtype); y = h * rstd * (offset + weight), rstd = rsqrt(mean(h^2)+eps)
// returns (y [M,N] out_dtype, h [M,N] residual_dtype or [0] without residual, rstd [M] fp32)
std::tuple<Tensor, Tensor, Tensor> rms_norm_fwd_cpu(
    const Tensor& x, const std::optional<Tensor>& residual, const std::optional<Tensor>& weight,
    double eps, double offset, ScalarType out_dtype, std::optional<ScalarType> residual_dtype);
// bwd: dx = rstd * (g - xhat * mean(g * xhat)) + dh_extra, g = dy * (offset + w), xhat = h * rstd;
// dw = sum_rows(dy * xhat). returns (dx [M,N] dx_dtype, dw [N] weight dtype or [0] when not computed)
std::tuple<Tensor, Tensor> rms_norm_bwd_cpu(
    const Tensor& dy, const Tensor& h, const Tensor& rstd, const std::optional<Tensor>& weight,
    const std::optional<Tensor>& dh_extra, double offset, ScalarType dx_dtype, bool compute_dw);
// Inference: the forward's y (x's dtype, fp32 when out_f32) and, with a residual, h (the residual's dtype); no rstd
// is returned (fewer outputs to box: the per-call host cost at decode size, docs/tuning-log.md#host-path).
Tensor rms_norm_infer_cpu(const Tensor& x, const std::optional<Tensor>& weight, double eps, double offset,
                          bool out_f32);
std::tuple<Tensor, Tensor> rms_norm_add_infer_cpu(const Tensor& x, const Tensor& residual,
                                                  const std::optional<Tensor>& weight, double eps, double offset,
                                                  bool out_f32);

#if defined(CUDA_KERNEL)
std::tuple<Tensor, Tensor, Tensor> rms_norm_fwd_cuda(
    const Tensor& x, const std::optional<Tensor>& residual, const std::optional<Tensor>& weight,
    double eps, double offset, ScalarType out_dtype, std::optional<ScalarType> residual_dtype);
std::tuple<Tensor, Tensor> rms_norm_bwd_cuda(
    const Tensor& dy, const Tensor& h, const Tensor& rstd, const std::optional<Tensor>& weight,
    const std::optional<Tensor>& dh_extra, double offset, ScalarType dx_dtype, bool compute_dw);
Tensor rms_norm_infer_cuda(const Tensor& x, const std::optional<Tensor>& weight, double eps, double offset,
                           bool out_f32);
std::tuple<Tensor, Tensor> rms_norm_add_infer_cuda(const Tensor& x, const Tensor& residual,
                                                   const std::optional<Tensor>& weight, double eps, double offset,
                                                   bool out_f32);
#endif

// ---- addmm / linear ------------------------------------------------------------------------------------------
// fwd: y = act(mat1 @ mat2 + bias), bias and activation applied to the fp32 accumulator, rounded once.
// mat1 [M, K], mat2 [K, N] (row- or column-major, used in place), bias [N] (mat dtype or fp32) or none;
// activation: "none" | "gelu_tanh" | "gelu" (erf) (kernels_src/activation.h). returns (y allocated as out_shape =
// [..., N] with M*N elements (the caller's final shape, so autograd never sees a view of the op's output), preact
// Z = mat1 @ mat2 + bias [M, N] in the mat dtype when save_preact and activation != "none", else [0]).
std::tuple<Tensor, Tensor> addmm_fwd_cpu(const std::optional<Tensor>& bias, const Tensor& mat1,
                                                 const Tensor& mat2, StrArg activation, bool save_preact,
                                                 ShapeArg out_shape);
// bwd: dZ = dy * act'(Z); dx = dZ @ mat2^T [M, K]; dw = mat1^T @ dZ as [K, N], or as [N, K] when dw_transposed;
// db = sum over rows of dZ (fp32 sums) in db_dtype. Unrequested outputs are [0]. dy: mat dtype or fp32.
std::tuple<Tensor, Tensor, Tensor> addmm_bwd_cpu(
    const Tensor& dy, const std::optional<Tensor>& preact, const Tensor& mat1, const Tensor& mat2,
    StrArg activation, bool need_dx, bool need_dw, bool dw_transposed, bool need_db, ScalarType db_dtype);
// Test hook: 0 normal, 1 = treat cuBLASLt's fused epilogues as unavailable, 2 = treat cuBLASLt as unavailable.
// Returns the previous mode and re-arms the warn-once messages. No effect on CPU tensors.
int64_t addmm_lt_force_fallback(int64_t mode);
std::vector<int64_t> check_out_shape(ShapeArg out_shape, int64_t M, int64_t N);
int addmm_lt_fallback_mode();
bool addmm_lt_first_warning(int which);  // true the first time per slot (0: fused epilogue, 1: cuBLASLt)
// Test/benchmark hook: the sm_90 CUTLASS path's mode (kernels_src/cuda/addmm_sm90.h, Sm90Mode): -1 = follow
// FUSED_MLP_ADDMM_SM90 (the default), 0 off, 1 auto, 2 on, 3 on with ping-pong, 4 on with cooperative. Returns the
// previous value. No effect on CPU tensors or off sm_90.
int64_t addmm_sm90_set_mode(int64_t mode);
int addmm_sm90_override();

#if defined(CUDA_KERNEL)
std::tuple<Tensor, Tensor> addmm_fwd_cuda(const std::optional<Tensor>& bias, const Tensor& mat1,
                                                  const Tensor& mat2, StrArg activation, bool save_preact,
                                                  ShapeArg out_shape);
std::tuple<Tensor, Tensor, Tensor> addmm_bwd_cuda(
    const Tensor& dy, const std::optional<Tensor>& preact, const Tensor& mat1, const Tensor& mat2,
    StrArg activation, bool need_dx, bool need_dw, bool dw_transposed, bool need_db, ScalarType db_dtype);
#endif

// ---- Gated activations (GeGLU / SwiGLU) ------------------------------------------------------------------

// activation: "gelu_tanh" | "gelu" (erf) | "silu". gate, up, dh: [T, I], unit stride along I, any row stride.
// fwd: h = act(gate) * up -> [T, I] contiguous, gate's dtype (gate and up share one dtype).
// bwd: dgate = dh * up * act'(gate), dup = dh * act(gate) -> ([T, I], [T, I]) contiguous, gate's dtype;
//      dh is float32 or gate's dtype. The activation is recomputed from gate, never stored.
// bwd_ (in place, for the fused MLP whose gate/up are its own intermediates): writes h = act(gate) * up into
//      dh's buffer, dgate into gate's buffer and dup into up's buffer (each element is read before it is written).
Tensor geglu_fwd_cpu(const Tensor& gate, const Tensor& up, StrArg activation);
std::tuple<Tensor, Tensor> geglu_bwd_cpu(const Tensor& dh, const Tensor& gate, const Tensor& up,
                                                 StrArg activation);
void geglu_bwd_inplace_cpu(const Tensor& dh, const Tensor& gate, const Tensor& up,
                           StrArg activation);

#if defined(CUDA_KERNEL)
Tensor geglu_fwd_cuda(const Tensor& gate, const Tensor& up, StrArg activation);
std::tuple<Tensor, Tensor> geglu_bwd_cuda(const Tensor& dh, const Tensor& gate, const Tensor& up,
                                                  StrArg activation);
void geglu_bwd_inplace_cuda(const Tensor& dh, const Tensor& gate, const Tensor& up,
                            StrArg activation);
// GeGLU MLP GEMMs with the activation in the epilogue (sm_90 only; gated_gemm_sm90.cu).
std::tuple<Tensor, Tensor, Tensor> gated_gemm_fwd_cuda(const Tensor& x, const Tensor& w_gate, const Tensor& w_up,
                                                       StrArg activation, bool save_preact);
Tensor gated_gemm_bwd_cuda(const Tensor& dy, const Tensor& w_down, const Tensor& gate, const Tensor& up,
                           StrArg activation);
std::tuple<Tensor, Tensor, Tensor> gated_gemm_fwd_slopes_cuda(const Tensor& x, const Tensor& w_gate,
                                                              const Tensor& w_up, StrArg activation);
void gated_gemm_bwd_slopes_cuda(const Tensor& dy, const Tensor& w_down, const Tensor& p, const Tensor& q);
// The whole gated MLP at decode sizes (gated_gemv.cu): y = down(act(x w_gate^T) * (x w_up^T)), x [T, H] with
// T <= 64, w_gate / w_up [I, H], w_down [H_out, I], one 16-bit dtype, contiguous, no biases; returns y [T, H_out].
Tensor gated_mlp_decode_cuda(const Tensor& x, const Tensor& w_gate, const Tensor& w_up, const Tensor& w_down,
                             StrArg activation);
// Linear without bias at decode sizes (gated_gemv.cu, the down pass alone): y = x w^T, x [T, K] with T <= 64,
// w [N, K], one 16-bit dtype, contiguous; returns y [T, N], rounded once from fp32 sums.
Tensor linear_decode_cuda(const Tensor& x, const Tensor& w);
// y = mat1 @ mat2 ([M, K] x [K, N] -> [M, N]) through addmm_fwd's GEMM path (no bias, no activation, one rounding).
Tensor mm_rows_cuda(const Tensor& mat1, const Tensor& mat2);
// gated_mlp_decode / linear_decode where T <= max_tokens (and the storages are 16-byte aligned), else the GEMM path
// (gated: gate and up GEMMs, geglu_fwd, down GEMM): the token count decided at run time, for torch.compile graphs
// with a symbolic T (gated_gemv.cu).
Tensor gated_mlp_auto_cuda(const Tensor& x, const Tensor& w_gate, const Tensor& w_up, const Tensor& w_down,
                           StrArg activation, int64_t max_tokens);
Tensor linear_auto_cuda(const Tensor& x, const Tensor& w, int64_t max_tokens);
#endif
