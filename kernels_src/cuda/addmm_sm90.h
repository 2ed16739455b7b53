// The interface between addmm.cu's forward (the dispatch) and the sm_90 CUTLASS kernel in addmm_sm90.cu (built for
// sm_90a only, so it lives in its own translation unit; kernels_src/cuda/addmm_sm90.cu describes the kernel).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fused_mlp::cuda {

// y = act(a @ b + bias) [M, N], rounded once; z = a @ b + bias (rounded once) when z is set.
struct AddmmSm90Args {
  const void* a = nullptr;  // [M, K] rows, row stride lda (elements)
  int64_t lda = 0;
  const void* b = nullptr;  // b_k_major: [N, K] rows (nn.Linear's weight), else [K, N] rows (Conv1D's); stride ldb
  int64_t ldb = 0;
  bool b_k_major = true;
  const void* bias = nullptr;  // [N] contiguous, 16-byte aligned, in y's dtype or fp32 (bias_fp32), or null
  bool bias_fp32 = false;
  void* y = nullptr;  // [M, N] contiguous
  void* z = nullptr;  // [M, N] contiguous, or null
  int64_t M = 0, N = 0, K = 0;
  int act = 0;        // Act: none, gelu_tanh, gelu (erf)
  bool bf16 = true;   // else fp16
  int device = 0;
  cudaStream_t stream = nullptr;
};

// The path choice (FUSED_MLP_ADDMM_SM90, read once; the private op _addmm_sm90_mode overrides it for tests and
// benchmarks): off (cuBLASLt always), auto (the size rule in addmm.cu), on (the CUTLASS kernel wherever it can run,
// default config), or on with a named config.
enum class Sm90Mode : int { kFollowEnv = -1, kOff = 0, kAuto = 1, kOn = 2, kPingPong = 3, kCooperative = 4 };

// The mode in force: the override if set, else the environment variable (read once).
Sm90Mode addmm_sm90_mode();

// Whether this build has the sm_90a kernel and `device` is an sm_90 GPU (cached per device).
bool addmm_sm90_available(int device);

// Launches the kernel on args.stream; false (nothing launched) when the kernel cannot take these operands
// (alignment, strides, sizes): the caller then takes the cuBLASLt path.
bool addmm_sm90_fwd(const AddmmSm90Args& args, Sm90Mode mode);

}  // namespace fused_mlp::cuda
