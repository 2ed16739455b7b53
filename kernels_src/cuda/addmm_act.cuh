// addmm's epilogue activations in fp32 on the device: the same formulas as PyTorch's gelu / gelu_backward (accurate
// tanhf / erff, no MUFU forms), shared by the cuBLASLt path's bias/activation kernels (addmm.cu) and the sm_90
// CUTLASS epilogue (addmm_sm90.cu), so both paths give the same bits from the same fp32 accumulator.
#pragma once

#include "activation.h"  // Act: the activation codes

namespace fused_mlp::cuda::addmm_math {

constexpr int kActNone = static_cast<int>(Act::kNone), kActGeluTanh = static_cast<int>(Act::kGeluTanh),
              kActGeluErf = static_cast<int>(Act::kGeluErf);
constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kKappa = 0.044715f;
constexpr float kSqrtHalf = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;

template <int ACT>
__device__ __forceinline__ float act_fwd(float x) {
  if constexpr (ACT == kActGeluTanh) {
    return 0.5f * x * (1.f + tanhf(kSqrt2OverPi * (x + kKappa * x * x * x)));
  } else if constexpr (ACT == kActGeluErf) {
    return 0.5f * x * (1.f + erff(x * kSqrtHalf));
  } else {
    return x;
  }
}

template <int ACT>
__device__ __forceinline__ float act_grad(float x) {
  if constexpr (ACT == kActGeluTanh) {
    const float x2 = x * x;
    const float t = tanhf(kSqrt2OverPi * (x + kKappa * x2 * x));
    return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * kSqrt2OverPi * (1.f + 3.f * kKappa * x2);
  } else if constexpr (ACT == kActGeluErf) {
    return 0.5f * (1.f + erff(x * kSqrtHalf)) + x * expf(-0.5f * x * x) * kInvSqrt2Pi;
  } else {
    return 1.f;
  }
}

}  // namespace fused_mlp::cuda::addmm_math
