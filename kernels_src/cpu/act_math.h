// fp32 activation math of the CPU kernels: geglu.cpp's gated activations and addmm.cpp's GEMM epilogue, one
// definition for both (the epilogue called libm per element before: docs/tuning-log.md#addmm-cpu-epilogue).
//
// Numerics: every element is widened to fp32 once, all math is fp32, each output is rounded once. The
// transcendental pieces are written as plain arithmetic and bit operations (no libm calls), so GCC vectorises
// the element loops; they are accurate to a few fp32 ulp:
//   exp(x), x <= 0      reduction by ln2 + degree-6 fitted polynomial: ~2 ulp; exactly 0 below -87.
//   sigmoid(z)          e = exp(-|z|) never overflows; r = 1/(1+e); sigmoid(z) = z >= 0 ? r : e*r, and
//                       sigmoid'(z) = sigmoid(z) * sigmoid(-z) = e * r * r (no cancellation on either side).
//   tanh-GeLU           gelu(x) = x * sigmoid(2u), u = sqrt(2/pi) * (x + 0.044715 x^3)  (= 0.5x(1 + tanh u)),
//                       gelu'(x) = sigmoid(2u) + x * sigmoid'(2u) * 2u'.
//   erf-GeLU            Phi(x) = 0.5 erfc(-x/sqrt2) with erfc(|z|) = exp(-z^2) * t * Q(t), t = 1/(1 + |z|/2),
//                       Q a degree-8 least-squares fit made for this file (<= 3e-7 relative for |z| <= 1,
//                       <= 7e-7 for |z| <= 3 in fp32). The x < 0 tail is computed directly (no 1 + erf(x)
//                       cancellation), and phi(x) = exp(-z^2)/sqrt(2 pi) reuses the same exp.
//   SiLU                silu(x) = x * sigmoid(x), silu'(x) = sigmoid(x) + x * sigmoid'(x).
// On x86-64 each loop is compiled three times, baseline (SSE2, no FMA), AVX2+FMA and AVX-512 (the AVX2 copy's
// bits: the same per-element math in 16-wide vectors), picked once at run time (cpu_level() in cpu_common.h, whose
// environment variables force the lesser copies); on other targets (aarch64: Advanced SIMD and FMA are baseline)
// once, for the target itself.
#pragma once

#include <bit>
#include <cstdint>

#include "cpu/cpu_common.h"
#include "activation.h"  // Act

namespace fused_mlp::cpu {
namespace {

using fused_mlp::Act;

#define FM_INLINE inline __attribute__((always_inline))

// a * b + c; fused only in the FMA build (the baseline build has no FMA instruction and libm's fmaf is scalar).
template <bool kFma>
FM_INLINE float madd(float a, float b, float c) {
  if constexpr (kFma) return __builtin_fmaf(a, b, c);
  else return a * b + c;
}

// ---- storage <-> fp32 (bit operations, so the loops vectorise) ------------------------------------------
FM_INLINE float load(float v) { return v; }
FM_INLINE float load(BFloat16 v) { return std::bit_cast<float>(static_cast<uint32_t>(v.x) << 16); }
// Half: bit operations as well (Half's float converters branch, which stops vectorisation). The exponent is
// re-biased by one exact multiply (normals and subnormals alike); Inf/NaN keep their payload.
FM_INLINE float load(Half v) {
  const uint32_t em = static_cast<uint32_t>(v.x) & 0x7FFFu;
  const uint32_t sign = (static_cast<uint32_t>(v.x) & 0x8000u) << 16;
  const uint32_t finite = std::bit_cast<uint32_t>(std::bit_cast<float>(em << 13) * 0x1p112f);
  const uint32_t special = (em << 13) | 0x7F800000u;
  const uint32_t is_special = 0u - static_cast<uint32_t>(em >= 0x7C00u);
  return std::bit_cast<float>(sign | (special & is_special) | (finite & ~is_special));
}

FM_INLINE void store(float* p, float v) { *p = v; }
FM_INLINE void store(BFloat16* p, float v) {
  const uint32_t u = std::bit_cast<uint32_t>(v);
  const uint32_t rne = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;  // round to nearest even
  const uint32_t nan_mask = 0u - static_cast<uint32_t>((u & 0x7FFFFFFFu) > 0x7F800000u);
  p->x = static_cast<uint16_t>((0x7FC0u & nan_mask) | (rne & ~nan_mask));  // NaN stays a quiet NaN
}
// float -> half, round to nearest even: normals by re-biasing the exponent and rounding the dropped 13 bits;
// results below 2^-14 by adding 0.5f, which aligns the value to the half subnormal grid (ulp 2^-24) with the
// hardware's RNE; overflow saturates to Inf; NaN becomes a quiet NaN.
FM_INLINE void store(Half* p, float v) {
  const uint32_t u = std::bit_cast<uint32_t>(v);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  uint32_t normal = (a + 0xC8000FFFu + ((a >> 13) & 1u)) >> 13;  // (a - (112 << 23) + 0xFFF + lsb) >> 13
  normal = normal < 0x7C00u ? normal : 0x7C00u;
  const uint32_t sub = std::bit_cast<uint32_t>(std::bit_cast<float>(a) + 0.5f) - 0x3F000000u;
  const uint32_t is_sub = 0u - static_cast<uint32_t>(a < 0x38800000u);
  const uint32_t is_nan = 0u - static_cast<uint32_t>(a > 0x7F800000u);
  const uint32_t h = (0x7E00u & is_nan) | (((sub & is_sub) | (normal & ~is_sub)) & ~is_nan);
  p->x = static_cast<uint16_t>(h | sign);
}

// f(T{}) for the storage type T of a float tensor.
template <typename F>
void dispatch_dtype(ScalarType t, const char* what, F&& f) {
  switch (t) {
    case kFloat: f(float{}); break;
    case kHalf: f(Half{}); break;
    case kBFloat16: f(BFloat16{}); break;
    default: FM_CHECK(false, "fused_mlp: ", what, " must be float32/float16/bfloat16, got ", t);
  }
}

// ---- fp32 math --------------------------------------------------------------------------------------------
// c ? a : b as bit operations. With a plain ?: GCC (under the default -ftrapping-math) threads the condition
// into branches around the arithmetic feeding the arms and then refuses to vectorise the loop; the mask form
// keeps every loop below branch-free.
FM_INLINE float sel(bool c, float a, float b) {
  const uint32_t m = 0u - static_cast<uint32_t>(c);
  return std::bit_cast<float>((std::bit_cast<uint32_t>(a) & m) | (std::bit_cast<uint32_t>(b) & ~m));
}

// exp(x) for x <= 0 (callers pass -|z| or -z^2); exactly 0 below -87 (results there are < 2^-125, negligible
// next to anything they are added to or multiplied into). k = round(x / ln2) by the 1.5 * 2^23 shift trick;
// r = x - k ln2 in one FMA (error <= |k| * 1.9e-9 <= 2.4e-7 relative, where the result is < e^-60 anyway) or,
// without FMA, Cody-Waite with ln2 split in two; exp(r) on [-ln2/2, ln2/2] by a degree-6 polynomial with the
// first two coefficients pinned to 1 and the rest least-squares fitted for this file (<= 1.4 x 2^-24 relative
// in fp32). Below -87 the reduction may produce garbage (even NaN); the final select discards it. NaN in, NaN out.
template <bool kFma>
FM_INLINE float exp_nonpos(float x) {
  const float shifted = madd<kFma>(x, 1.44269504088896341f, 12582912.0f);
  const float k = shifted - 12582912.0f;
  float r;
  if constexpr (kFma) {
    r = madd<true>(k, -0.693147180559945309f, x);
  } else {
    r = madd<false>(k, -0.693145751953125f, x);  // k * ln2_hi is exact
    r = madd<false>(k, -1.42860682030941723212e-6f, r);
  }
  float p = 0.0013814608100801706f;
  p = madd<kFma>(p, r, 0.008368710987269878f);
  p = madd<kFma>(p, r, 0.04166838899254799f);
  p = madd<kFma>(p, r, 0.1666652113199234f);
  p = madd<kFma>(p, r, 0.4999999403953552f);
  p = madd<kFma>(p, r, 1.0f);
  p = madd<kFma>(p, r, 1.0f);
  // 2^k from k's bits in `shifted` (unsigned arithmetic: no overflow on the garbage path).
  const uint32_t scale_bits = (std::bit_cast<uint32_t>(shifted) - std::bit_cast<uint32_t>(12582912.0f) + 127u) << 23;
  return sel(x < -87.0f, 0.0f, p * std::bit_cast<float>(scale_bits));
}

// sigmoid(z) and sigmoid'(z) = sigmoid(z) * sigmoid(-z), both without overflow or cancellation.
template <bool kFma>
FM_INLINE void sigmoid_and_slope(float z, float& s, float& ds) {
  const float e = exp_nonpos<kFma>(-__builtin_fabsf(z));
  const float r = 1.0f / (1.0f + e);
  const float er = e * r;
  s = sel(z >= 0.0f, r, er);  // NaN in: e, r and so s are NaN
  ds = er * r;
}

template <bool kFma>
FM_INLINE float sigmoid(float z) {
  float s, ds;
  sigmoid_and_slope<kFma>(z, s, ds);
  return s;
}

constexpr float kSqrt2OverPi = 0.79788456080286535588f;
constexpr float kGeluTanhCubic = 0.044715f;
constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;

// erfc(|z|) / exp(-z^2) = t * Q(t), t = 1/(1 + |z|/2); Q: least-squares fit on Chebyshev nodes (t in (1/6, 1]),
// refined towards equal relative error; fitted for this file.
template <bool kFma>
FM_INLINE float erfcx_poly(float t) {
  float q = -0.05906727910041809f;
  q = madd<kFma>(q, t, 0.28456661105155945f);
  q = madd<kFma>(q, t, -0.48718228936195374f);
  q = madd<kFma>(q, t, 0.2780466377735138f);
  q = madd<kFma>(q, t, -0.026611220091581345f);
  q = madd<kFma>(q, t, 0.20268061757087708f);
  q = madd<kFma>(q, t, 0.24310538172721863f);
  q = madd<kFma>(q, t, 0.2823750674724579f);
  q = madd<kFma>(q, t, 0.28208643198013306f);
  return t * q;
}

// Phi(x) (the normal CDF) and, when wanted, phi(x) (its density).
template <bool kFma, bool kWantPdf>
FM_INLINE void normal_cdf_pdf(float x, float& cdf, float& pdf) {
  const float z = x * kInvSqrt2;
  const float az = __builtin_fabsf(z);
  const float e = exp_nonpos<kFma>(-(az * az));  // exp(-x^2/2)
  const float t = 1.0f / madd<kFma>(0.5f, az, 1.0f);
  const float half_erfc = 0.5f * e * erfcx_poly<kFma>(t);  // 0.5 erfc(|z|) = Phi(-|x|)
  cdf = sel(x < 0.0f, half_erfc, 1.0f - half_erfc);  // NaN in: e and so cdf are NaN
  if constexpr (kWantPdf) pdf = e * kInvSqrt2Pi;
}

template <Act A, bool kFma>
FM_INLINE float act_fwd(float x) {
  if constexpr (A == Act::kGeluTanh) {
    const float x2 = x * x;
    const float z = 2.0f * kSqrt2OverPi * x * madd<kFma>(kGeluTanhCubic, x2, 1.0f);  // 2u
    return x * sigmoid<kFma>(z);
  } else if constexpr (A == Act::kGeluErf) {
    float cdf, pdf;
    normal_cdf_pdf<kFma, false>(x, cdf, pdf);
    return x * cdf;
  } else {
    return x * sigmoid<kFma>(x);
  }
}

// act(x) and act'(x).
template <Act A, bool kFma>
FM_INLINE void act_fwd_bwd(float x, float& a, float& da) {
  if constexpr (A == Act::kGeluTanh) {
    const float x2 = x * x;
    const float z = 2.0f * kSqrt2OverPi * x * madd<kFma>(kGeluTanhCubic, x2, 1.0f);
    const float dz = 2.0f * kSqrt2OverPi * madd<kFma>(3.0f * kGeluTanhCubic, x2, 1.0f);
    float s, ds;
    sigmoid_and_slope<kFma>(z, s, ds);
    a = x * s;
    da = madd<kFma>(x * ds, dz, s);
  } else if constexpr (A == Act::kGeluErf) {
    float cdf, pdf;
    normal_cdf_pdf<kFma, true>(x, cdf, pdf);
    a = x * cdf;
    da = madd<kFma>(x, pdf, cdf);
  } else {
    float s, ds;
    sigmoid_and_slope<kFma>(x, s, ds);
    a = x * s;
    da = madd<kFma>(x, ds, s);
  }
}

#if defined(__x86_64__)
// The copy for x86-64 CPUs with AVX2 and FMA (the x86-64 baseline has no FMA instruction), and the same loops for
// CPUs with AVX-512 (F, VL, BW, DQ): 16-wide vectors, 0.5-0.75x the AVX2 copy's time in bf16, 0.85-1.0x in fp32
// (docs/tuning-log.md#gated-act-cpu-avx512).
#define FM_FAST_COPY __attribute__((target("avx2,fma")))
#define FM_AVX512_COPY __attribute__((target("avx2,fma,avx512f,avx512vl,avx512bw,avx512dq")))
constexpr bool kFastCopyFma = true;

// The copy this CPU runs (cpu_common.h, chosen once): kAvx2 is the fast copy.
inline CpuLevel cpu_copy() { return cpu_level(); }
#else
// Other targets: the target's own code generation; fused multiply-adds where the target has them in hardware
// (every aarch64 CPU), otherwise __builtin_fmaf would be a libm call per element.
#define FM_FAST_COPY
#if defined(__FP_FAST_FMAF)
constexpr bool kFastCopyFma = true;
#else
constexpr bool kFastCopyFma = false;
#endif

// One copy, the fast one (kAvx2 names it here as on x86-64).
constexpr CpuLevel cpu_copy() { return CpuLevel::kAvx2; }
#endif

}  // namespace
}  // namespace fused_mlp::cpu
