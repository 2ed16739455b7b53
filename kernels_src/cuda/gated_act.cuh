// Gated-activation math shared by the elementwise kernels (geglu.cu) and the GEMM epilogues (gated_gemm_sm90.cu):
// act in {tanh-GeLU, erf-GeLU, SiLU}, forward and derivative, fp32 math. Formulas: see geglu.cu's header.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "activation.h"  // Act, parse_activation, dispatch_act (shared with the CPU backend)

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

// FAST (16-bit outputs): the MUFU forms ex2.approx.ftz and rcp.approx.ftz (~2 ulp of fp32) instead of the
// IEEE-accurate expf and reciprocal, whose range reduction and slow-path subroutine calls made the bf16 kernels
// issue-bound (docs/tuning-log.md#gated-act-mufu). 2 ulp of fp32 is 2^-15 of a bf16 ulp and 2^-12 of an fp16 ulp,
// so the rounded result is the correctly rounded one except in rare ties. The .ftz forms: without it ptxas wraps
// every ex2 in a denormal-range test, two predicated multiplies and one shared predicate register, which serialised
// the GEMM epilogues' eight independent elements (docs/tuning-log.md#gated-act-ftz). ftz only changes e^z below
// 2^-126 (|z| > 87) from a denormal to 0, where act(x) is below 1e-36 and 0 in fp32 PyTorch as well. log2(e) is
// folded into the callers' constants (zl = z log2 e), saving one multiply per element. fp32 outputs keep the
// accurate functions.
constexpr float kLog2e = 1.44269504088896340736f;

__device__ __forceinline__ float ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float rcp_ftz(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// s = sigmoid(z) and ds = s (1 - s) = d sigmoid / dz. FAST takes zl = z log2(e), the accurate form z itself.
// FAST: s = 1 / (1 + 2^-zl) and ds = s - s^2, four instructions (MUFU ex2, add, MUFU rcp, fma). For zl -> -inf,
// 2^-zl overflows to inf and s to 0 (below 2^-126: 0, ftz), both relative-accurate until then (s - s^2 ~ s). For
// zl -> +inf, s rounds to 1 and s - s^2 loses its relative accuracy to cancellation once it is below ~1e-6: its
// absolute error stays below 2^-24, and the callers add it to s ~ 1 (times x dz: a few 1e-6 of s at most, far below a
// 16-bit ulp); at s = 1 exactly, ds = 0 (the 2^-24-accurate rounding of e^-z). Before: e = exp(-|z|), r = 1/(1+e),
// s = z >= 0 ? r : e r, ds = e r^2, which is relative-accurate on both tails but took three more instructions per
// element (a multiply, a compare and a select): docs/tuning-log.md#gated-act-sigmoid.
// Accurate form: e = exp(-|z|) (never overflows): for z >= 0 s = 1 / (1 + e), else e / (1 + e); ds = e / (1 + e)^2.
template <bool FAST>
__device__ __forceinline__ void sigmoid_and_slope(float z_or_zl, float& s, float& ds) {
  if constexpr (FAST) {
    s = rcp_ftz(1.0f + ex2_ftz(-z_or_zl));  // NaN in: NaN out
    ds = fmaf(-s, s, s);
  } else {
    const float e = expf(-fabsf(z_or_zl));
    const float r = __frcp_rn(1.0f + e);
    const float er = e * r;
    s = z_or_zl >= 0.0f ? r : er;  // NaN in: e, r, and so s are NaN
    ds = er * r;
  }
}

template <bool FAST>
__device__ __forceinline__ float exp_of(float x) {
  if constexpr (FAST) {
    return ex2_ftz(x * kLog2e);
  } else {
    return expf(x);
  }
}

// tanh-GeLU: act = x sigmoid(z), z = 2 sqrt(2/pi) (x + c x^3); act' = s + x s (1 - s) dz/dx. FAST: z log2(e) =
// x (B + A x^2) with the factors folded into two constants (one FFMA, one FMUL), dz/dx = D + C x^2 (one FFMA); the
// accurate form keeps the formula it always had (fp32 outputs unchanged to the bit).
template <bool FAST>
__device__ __forceinline__ float gelu_tanh_z(float x, float x2) {
  if constexpr (FAST) {
    return x * fmaf(2.0f * kSqrt2OverPi * kGeluTanhCubic * kLog2e, x2, 2.0f * kSqrt2OverPi * kLog2e);
  } else {
    return 2.0f * kSqrt2OverPi * x * fmaf(kGeluTanhCubic, x2, 1.0f);
  }
}
template <bool FAST>
__device__ __forceinline__ float gelu_tanh_dz(float x2) {
  if constexpr (FAST) {
    return fmaf(2.0f * kSqrt2OverPi * 3.0f * kGeluTanhCubic, x2, 2.0f * kSqrt2OverPi);
  } else {
    return 2.0f * kSqrt2OverPi * fmaf(3.0f * kGeluTanhCubic, x2, 1.0f);
  }
}

template <Act A, bool FAST>
__device__ __forceinline__ float act_fwd(float x) {
  if constexpr (A == Act::kGeluTanh) {
    const float z = gelu_tanh_z<FAST>(x, x * x);
    float s, ds;
    sigmoid_and_slope<FAST>(z, s, ds);
    return x * s;
  } else if constexpr (A == Act::kGeluErf) {
    return x * fmaf(0.5f, erff(x * kInvSqrt2), 0.5f);
  } else {
    float s, ds;
    sigmoid_and_slope<FAST>(FAST ? x * kLog2e : x, s, ds);
    return x * s;
  }
}

template <Act A, bool FAST>
__device__ __forceinline__ void act_fwd_bwd(float x, float& a, float& da) {
  if constexpr (A == Act::kGeluTanh) {
    const float x2 = x * x;
    const float z = gelu_tanh_z<FAST>(x, x2);
    const float dz = gelu_tanh_dz<FAST>(x2);
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
    sigmoid_and_slope<FAST>(FAST ? x * kLog2e : x, s, ds);
    a = x * s;
    da = fmaf(x, ds, s);
  }
}

}  // namespace fused_mlp::cuda
