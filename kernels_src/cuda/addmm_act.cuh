// addmm's epilogue activations in fp32 on the device, shared by the cuBLASLt path's bias/activation kernels (addmm.cu)
// and the sm_90 CUTLASS epilogue (addmm_sm90.cu), so both paths give the same bits from the same fp32 accumulator.
// act_fwd<ACT, FAST>: FAST (16-bit outputs) evaluates tanh-GeLU as x sigmoid(2u) with the MUFU forms of the gated
// kernels (gated_act.cuh: ex2.approx.ftz / rcp.approx.ftz, ~2 ulp of fp32, 2^-15 of a bf16 ulp: still one rounding
// of the fp32 function but for rare ties); tanhf's range reduction made the GEMM epilogue cost 0.82x of mm alone at
// 8192 x 2048 x 8192 -- docs/tuning-log.md#addmm-sm90-epilogue. fp32 outputs and the backward keep PyTorch's formulas
// (accurate tanhf / erff).
#pragma once

#include "activation.h"  // Act: the activation codes
#include "cuda/gated_act.cuh"  // the MUFU (FAST) forms

namespace fused_mlp::cuda::addmm_math {

constexpr int kActNone = static_cast<int>(Act::kNone), kActGeluTanh = static_cast<int>(Act::kGeluTanh),
              kActGeluErf = static_cast<int>(Act::kGeluErf);
constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kKappa = 0.044715f;
constexpr float kSqrtHalf = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;

template <int ACT, bool FAST = false>
__device__ __forceinline__ float act_fwd(float x) {
  if constexpr (ACT == kActGeluTanh && FAST) {
    return fused_mlp::cuda::act_fwd<Act::kGeluTanh, true>(x);
  } else if constexpr (ACT == kActGeluTanh) {
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
