// fused-mlp op schemas and their registration: nothing else lives here.
// The namespace (TORCH_EXTENSION_NAME) is unique per build; Python reaches the ops only through the generated
// `_ops.add_op_namespace_prefix`. Every variant registers the CPU implementation of every op (the `kernels`
// loader picks the variant from the installed torch, not from the tensors' device); the CUDA variant adds
// the CUDA implementation, and the dispatcher picks by tensor device. The same schemas are registered through
// the classic API (per-torch variants) or torch's stable ABI (torch-stable-abi variants; see torch_compat.h).
#include "torch_binding.h"

#if defined(FUSED_MLP_STABLE_ABI)
#include <torch/csrc/stable/library.h>

#include <cstdio>
#include <stdexcept>
#else
#include <torch/library.h>
#endif

#include "registration.h"

#define FM_SCHEMAS(ops)                                                                                          \
  ops.def(                                                                                                       \
      "rms_norm_fwd(Tensor x, Tensor? residual, Tensor? weight, float eps, float offset, ScalarType out_dtype, " \
      "ScalarType? residual_dtype) -> (Tensor, Tensor, Tensor)");                                                \
  ops.def(                                                                                                       \
      "rms_norm_bwd(Tensor dy, Tensor h, Tensor rstd, Tensor? weight, Tensor? dh_extra, float offset, "         \
      "ScalarType dx_dtype, bool compute_dw) -> (Tensor, Tensor)");                                              \
  /* Inference (no autograd): the forward's y alone (add: y and h), no rstd. y is x's dtype, or fp32 when       \
     out_f32 (a bool, not a ScalarType: a dtype argument costs ~0.3 us of Python parsing per call); h takes the   \
     residual's dtype. The per-call host cost is what decode pays per norm: docs/tuning-log.md#host-path. */     \
  ops.def("rms_norm_infer(Tensor x, Tensor? weight, float eps, float offset, bool out_f32) -> Tensor");         \
  ops.def(                                                                                                       \
      "rms_norm_add_infer(Tensor x, Tensor residual, Tensor? weight, float eps, float offset, bool out_f32) "    \
      "-> (Tensor, Tensor)");                                                                                    \
  /* addmm / linear. out_shape: the caller's [..., N] (SymInt[]: torch.compile keeps token counts symbolic) */    \
  ops.def(                                                                                                       \
      "addmm_fwd(Tensor? bias, Tensor mat1, Tensor mat2, str activation, bool save_preact, SymInt[] out_shape) " \
      "-> (Tensor, Tensor)");                                                                                    \
  ops.def(                                                                                                       \
      "addmm_bwd(Tensor dy, Tensor? preact, Tensor mat1, Tensor mat2, str activation, bool need_dx, "           \
      "bool need_dw, bool dw_transposed, bool need_db, ScalarType db_dtype) -> (Tensor, Tensor, Tensor)");       \
  /* Gated activations. activation: "gelu_tanh" | "gelu" | "silu". geglu_bwd_ mutates all three arguments      \
     (h into dh, dgate into gate, dup into up); the alias annotations let torch.compile functionalize it. */    \
  ops.def("geglu_fwd(Tensor gate, Tensor up, str activation) -> Tensor");                                        \
  ops.def("geglu_bwd(Tensor dh, Tensor gate, Tensor up, str activation) -> (Tensor, Tensor)");                   \
  ops.def("geglu_bwd_(Tensor(a!) dh, Tensor(b!) gate, Tensor(c!) up, str activation) -> ()");                  \
  /* GeGLU MLP GEMMs with the gated activation in the epilogue (CUDA sm_90 only; kernels_src/cuda/               \
     gated_gemm_sm90.cu). fwd: (h, gate, up), gate/up empty unless save_preact. bwd_: returns h, writes dgate    \
     over gate and dup over up. fwd_slopes: (h, P = up act'(gate), Q = act(gate)); bwd_slopes_: writes dgate =   \
     dh P over P and dup = dh Q over Q. */                                                                       \
  ops.def("gated_gemm_fwd(Tensor x, Tensor w_gate, Tensor w_up, str activation, bool save_preact) "              \
          "-> (Tensor, Tensor, Tensor)");                                                                        \
  ops.def("gated_gemm_bwd_(Tensor dy, Tensor w_down, Tensor(a!) gate, Tensor(b!) up, str activation) -> Tensor"); \
  ops.def("gated_gemm_fwd_slopes(Tensor x, Tensor w_gate, Tensor w_up, str activation) -> (Tensor, Tensor, Tensor)"); \
  ops.def("gated_gemm_bwd_slopes_(Tensor dy, Tensor w_down, Tensor(a!) p, Tensor(b!) q) -> ()");             \
  /* The gated MLP forward at decode sizes, one op of two GEMV-class kernels (CUDA sm_80+; kernels_src/cuda/    \
     gated_gemv.cu): x [T <= 64, H], w_gate / w_up [I, H], w_down [H_out, I], 16-bit, no biases. */             \
  ops.def("gated_mlp_decode(Tensor x, Tensor w_gate, Tensor w_up, Tensor w_down, str activation) -> Tensor");   \
  /* Linear without bias at decode sizes (gated_gemv.cu's down pass alone): x [T <= 64, K], w [N, K], 16-bit. */ \
  ops.def("linear_decode(Tensor x, Tensor w) -> Tensor");                                                       \
  /* Either of the two above or the GEMM path, chosen by T at run time (T <= max_tokens: the decode kernels):     \
     what a torch.compile graph with a symbolic token count calls (_decode.py). */                              \
  ops.def("gated_mlp_auto(Tensor x, Tensor w_gate, Tensor w_up, Tensor w_down, str activation, int max_tokens) " \
          "-> Tensor");                                                                                          \
  ops.def("linear_auto(Tensor x, Tensor w, int max_tokens) -> Tensor")

#if defined(FUSED_MLP_STABLE_ABI)

STABLE_TORCH_LIBRARY_EXPAND(TORCH_EXTENSION_NAME, ops) {
  FM_SCHEMAS(ops);
  ops.def("_addmm_lt_force_fallback(int mode) -> int");  // test hook, no tensors
  ops.def("_addmm_sm90_mode(int mode) -> int");          // test/benchmark hook, no tensors
}

STABLE_TORCH_LIBRARY_IMPL_EXPAND(TORCH_EXTENSION_NAME, CPU, ops) {
  ops.impl("rms_norm_fwd", TORCH_BOX(&rms_norm_fwd_cpu));
  ops.impl("rms_norm_bwd", TORCH_BOX(&rms_norm_bwd_cpu));
  ops.impl("rms_norm_infer", TORCH_BOX(&rms_norm_infer_cpu));
  ops.impl("rms_norm_add_infer", TORCH_BOX(&rms_norm_add_infer_cpu));
  ops.impl("addmm_fwd", TORCH_BOX(&addmm_fwd_cpu));
  ops.impl("addmm_bwd", TORCH_BOX(&addmm_bwd_cpu));
  ops.impl("geglu_fwd", TORCH_BOX(&geglu_fwd_cpu));
  ops.impl("geglu_bwd", TORCH_BOX(&geglu_bwd_cpu));
  ops.impl("geglu_bwd_", TORCH_BOX(&geglu_bwd_inplace_cpu));
}

#if defined(CUDA_KERNEL)
STABLE_TORCH_LIBRARY_IMPL_EXPAND(TORCH_EXTENSION_NAME, CUDA, ops) {
  ops.impl("rms_norm_fwd", TORCH_BOX(&rms_norm_fwd_cuda));
  ops.impl("rms_norm_bwd", TORCH_BOX(&rms_norm_bwd_cuda));
  ops.impl("rms_norm_infer", TORCH_BOX(&rms_norm_infer_cuda));
  ops.impl("rms_norm_add_infer", TORCH_BOX(&rms_norm_add_infer_cuda));
  ops.impl("addmm_fwd", TORCH_BOX(&addmm_fwd_cuda));
  ops.impl("addmm_bwd", TORCH_BOX(&addmm_bwd_cuda));
  ops.impl("geglu_fwd", TORCH_BOX(&geglu_fwd_cuda));
  ops.impl("geglu_bwd", TORCH_BOX(&geglu_bwd_cuda));
  ops.impl("geglu_bwd_", TORCH_BOX(&geglu_bwd_inplace_cuda));
  ops.impl("gated_gemm_fwd", TORCH_BOX(&gated_gemm_fwd_cuda));
  ops.impl("gated_gemm_bwd_", TORCH_BOX(&gated_gemm_bwd_cuda));
  ops.impl("gated_gemm_fwd_slopes", TORCH_BOX(&gated_gemm_fwd_slopes_cuda));
  ops.impl("gated_gemm_bwd_slopes_", TORCH_BOX(&gated_gemm_bwd_slopes_cuda));
  ops.impl("gated_mlp_decode", TORCH_BOX(&gated_mlp_decode_cuda));
  ops.impl("linear_decode", TORCH_BOX(&linear_decode_cuda));
  ops.impl("gated_mlp_auto", TORCH_BOX(&gated_mlp_auto_cuda));
  ops.impl("linear_auto", TORCH_BOX(&linear_auto_cuda));
}
#endif

// No tensor arguments: the composite key serves every call (there is no device to dispatch on).
STABLE_TORCH_LIBRARY_IMPL_EXPAND(TORCH_EXTENSION_NAME, CompositeImplicitAutograd, ops) {
  ops.impl("_addmm_lt_force_fallback", TORCH_BOX(&addmm_lt_force_fallback));
  ops.impl("_addmm_sm90_mode", TORCH_BOX(&addmm_sm90_set_mode));
}

// fused_mlp::warn: a Python UserWarning through the limited C API (the stable ABI has no warning shim). Callers
// may run on an autograd worker thread, so the GIL is taken for the call. A warning filter that turns it into an
// error makes the op fail, as TORCH_WARN does in the classic build (there as the warning's own exception type,
// here as a RuntimeError naming it).
void fused_mlp::warn(const std::string& message) {
  if (!Py_IsInitialized()) {  // interpreter shutting down (or embedding without Python): stderr
    std::fprintf(stderr, "UserWarning: %s\n", message.c_str());
    return;
  }
  const PyGILState_STATE gil = PyGILState_Ensure();
  const bool raised = PyErr_WarnEx(PyExc_UserWarning, message.c_str(), 1) != 0;
  if (raised) PyErr_Clear();
  PyGILState_Release(gil);
  if (raised) throw std::runtime_error("UserWarning raised as an error: " + message);
}

#else  // classic API

TORCH_LIBRARY_EXPAND(TORCH_EXTENSION_NAME, ops) {
  FM_SCHEMAS(ops);
  ops.def("_addmm_lt_force_fallback(int mode) -> int", &addmm_lt_force_fallback);  // test hook, no tensors
  ops.def("_addmm_sm90_mode(int mode) -> int", &addmm_sm90_set_mode);  // test/benchmark hook, no tensors

  ops.impl("rms_norm_fwd", c10::kCPU, &rms_norm_fwd_cpu);
  ops.impl("rms_norm_bwd", c10::kCPU, &rms_norm_bwd_cpu);
  ops.impl("rms_norm_infer", c10::kCPU, &rms_norm_infer_cpu);
  ops.impl("rms_norm_add_infer", c10::kCPU, &rms_norm_add_infer_cpu);
  ops.impl("addmm_fwd", c10::kCPU, &addmm_fwd_cpu);
  ops.impl("addmm_bwd", c10::kCPU, &addmm_bwd_cpu);
  ops.impl("geglu_fwd", c10::kCPU, &geglu_fwd_cpu);
  ops.impl("geglu_bwd", c10::kCPU, &geglu_bwd_cpu);
  ops.impl("geglu_bwd_", c10::kCPU, &geglu_bwd_inplace_cpu);
#if defined(CUDA_KERNEL)
  ops.impl("rms_norm_fwd", c10::kCUDA, &rms_norm_fwd_cuda);
  ops.impl("rms_norm_bwd", c10::kCUDA, &rms_norm_bwd_cuda);
  ops.impl("rms_norm_infer", c10::kCUDA, &rms_norm_infer_cuda);
  ops.impl("rms_norm_add_infer", c10::kCUDA, &rms_norm_add_infer_cuda);
  ops.impl("addmm_fwd", c10::kCUDA, &addmm_fwd_cuda);
  ops.impl("addmm_bwd", c10::kCUDA, &addmm_bwd_cuda);
  ops.impl("geglu_fwd", c10::kCUDA, &geglu_fwd_cuda);
  ops.impl("geglu_bwd", c10::kCUDA, &geglu_bwd_cuda);
  ops.impl("geglu_bwd_", c10::kCUDA, &geglu_bwd_inplace_cuda);
  ops.impl("gated_gemm_fwd", c10::kCUDA, &gated_gemm_fwd_cuda);
  ops.impl("gated_gemm_bwd_", c10::kCUDA, &gated_gemm_bwd_cuda);
  ops.impl("gated_gemm_fwd_slopes", c10::kCUDA, &gated_gemm_fwd_slopes_cuda);
  ops.impl("gated_gemm_bwd_slopes_", c10::kCUDA, &gated_gemm_bwd_slopes_cuda);
  ops.impl("gated_mlp_decode", c10::kCUDA, &gated_mlp_decode_cuda);
  ops.impl("linear_decode", c10::kCUDA, &linear_decode_cuda);
  ops.impl("gated_mlp_auto", c10::kCUDA, &gated_mlp_auto_cuda);
  ops.impl("linear_auto", c10::kCUDA, &linear_auto_cuda);
#endif
}

void fused_mlp::warn(const std::string& message) { TORCH_WARN(message); }

#endif

REGISTER_EXTENSION(TORCH_EXTENSION_NAME)

// libstdc++'s headers (gcc >= 11) read glibc's `__libc_single_threaded` (GLIBC_2.32), which would lift the
// binary above manylinux_2_28. Binding to a module-private flag that says "assume multi-threaded" keeps
// every reference-count update atomic and needs no newer glibc.
extern "C" {
__attribute__((visibility("hidden"))) char __libc_single_threaded = 0;
}
