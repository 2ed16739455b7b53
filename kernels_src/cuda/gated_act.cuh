// Gated-activation math shared by the elementwise kernels (geglu.cu) and the GEMM epilogues (gated_gemm_sm90.cu):
// act in {tanh-GeLU, erf-GeLU, SiLU}, forward and derivative, fp32 math. Formulas: see geglu.cu's header.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "gated_activation.h"  // Act, parse_activation, dispatch_act (shared with the CPU backend)

namespace fused_mlp::cuda {

using fused_mlp::Act;
using fused_mlp::dispatch_act;
using fused_mlp::parse_activation;

// 16-bit outputs take the MUFU forms of exp and 1/x (see sigmoid_and_slope); fp32 outputs the accurate ones.
template <typename T>
constexpr bool kFast = !std::is_same_v<T, float>;

// ---- activation math --------------------------------------------------------------------------------------
constexpr float kSqrt2OverPi = 0.79788456080286535588f;
constexpr float kGeluTanhCubic = 0.044715f;
constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;

// FAST (16-bit outputs): ex2.approx and rcp.approx (MUFU, ~2 ulp of fp32) instead of the IEEE-accurate expf and
// reciprocal, whose range reduction and slow-path subroutine calls made the bf16 kernels issue-bound (ncu on the
// H200: 70% issue-active at 73% of copy bandwidth; 16 CALLs per 16 elements in the SASS). 2 ulp of fp32 is
// 2^-15 of a bf16 ulp and 2^-12 of an fp16 ulp, so the rounded result is the correctly rounded one except in
// rare ties; fp32 outputs keep the accurate functions.
template <bool FAST>
__device__ __forceinline__ void sigmoid_and_slope(float z, float& s, float& ds) {
  float e, r;
  if constexpr (FAST) {
    e = __expf(-fabsf(z));
    r = __fdividef(1.0f, 1.0f + e);  // 1 + e in [1, 2]: no range issues
  } else {
    e = expf(-fabsf(z));
    r = __frcp_rn(1.0f + e);
  }
  const float er = e * r;
  s = z >= 0.0f ? r : er;  // NaN in: e, r, and so s are NaN
  ds = er * r;
}

template <bool FAST>
__device__ __forceinline__ float exp_of(float x) {
  if constexpr (FAST) {
    return __expf(x);
  } else {
    return expf(x);
  }
}

template <Act A, bool FAST>
__device__ __forceinline__ float act_fwd(float x) {
  if constexpr (A == Act::kGeluTanh) {
    const float z = 2.0f * kSqrt2OverPi * x * fmaf(kGeluTanhCubic, x * x, 1.0f);
    float s, ds;
    sigmoid_and_slope<FAST>(z, s, ds);
    return x * s;
  } else if constexpr (A == Act::kGeluErf) {
    return x * fmaf(0.5f, erff(x * kInvSqrt2), 0.5f);
  } else {
    float s, ds;
    sigmoid_and_slope<FAST>(x, s, ds);
    return x * s;
  }
}

template <Act A, bool FAST>
__device__ __forceinline__ void act_fwd_bwd(float x, float& a, float& da) {
  if constexpr (A == Act::kGeluTanh) {
    const float x2 = x * x;
    const float z = 2.0f * kSqrt2OverPi * x * fmaf(kGeluTanhCubic, x2, 1.0f);
    const float dz = 2.0f * kSqrt2OverPi * fmaf(3.0f * kGeluTanhCubic, x2, 1.0f);
    float s, ds;
    sigmoid_and_slope<FAST>(z, s, ds);
    a = x * s;
    da = fmaf(x * ds, dz, s);
  } else if constexpr (A == Act::kGeluErf) {
    const float cdf = fmaf(0.5f, erff(x * kInvSqrt2), 0.5f);
    const float pdf = exp_of<FAST>(-0.5f * x * x) * kInvSqrt2Pi;
    a = x * cdf;
    da = fmaf(x, pdf, cdf);
  } else {
    float s, ds;
    sigmoid_and_slope<FAST>(x, s, ds);
    a = x * s;
    da = fmaf(x, ds, s);
  }
}

}  // namespace fused_mlp::cuda
