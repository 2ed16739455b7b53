// Gated activations on the CPU: h = act(gate) * up with act in {tanh-GeLU, erf-GeLU, SiLU}, and backward.
// gate, up, dh: [T, I] (unit stride along I, any row stride, e.g. the two halves of one [T, 2I] tensor).
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
#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>

#include "cpu/cpu_common.h"
#include "activation.h"  // Act, parse_activation, dispatch_act (shared with the CUDA backend)
#include "torch_binding.h"

namespace fused_mlp::cpu {
namespace {

using fused_mlp::Act;
using fused_mlp::dispatch_act;
using fused_mlp::parse_activation;

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

// ---- element loops over one contiguous span ----------------------------------------------------------------
// Out of place, one fused loop over __restrict pointers. In place, chunks of kChunk elements go through fp32
// scratch arrays (load/convert, math, convert/store: separate unit-stride loops): the scratch arrays alias
// nothing, so GCC vectorises every loop without run-time alias checks (it gives up on six same-typed pointers
// that may alias), and each chunk is read entirely before any of it is written.
constexpr int64_t kChunk = 256;

template <typename T>
FM_INLINE void load_chunk(const T* src, float* __restrict dst, int64_t m) {
  for (int64_t i = 0; i < m; ++i) dst[i] = load(src[i]);
}
template <typename T>
FM_INLINE void store_chunk(const float* __restrict src, T* dst, int64_t m) {
  for (int64_t i = 0; i < m; ++i) store(dst + i, src[i]);
}

template <Act A, bool kFma, typename T>
FM_INLINE void fwd_span(const T* __restrict gate, const T* __restrict up, T* __restrict out, int64_t n) {
  // out is always a fresh tensor: no aliasing, so one fused loop (no scratch round trip).
  for (int64_t i = 0; i < n; ++i) store(out + i, act_fwd<A, kFma>(load(gate[i])) * load(up[i]));
}

// dgate = dh * up * act'(gate), dup = dh * act(gate) and, when kWriteH, h = act(gate) * up.
// In place (kWriteH: h_out == dh, dgate == gate, dup == up) through the fp32 scratch chunks; out of place (fresh
// dgate/dup, nothing aliases) as one fused loop.
template <Act A, bool kFma, bool kWriteH, typename T, typename TD>
FM_INLINE void bwd_span(const TD* dh, const T* gate, const T* up, TD* h_out, T* dgate, T* dup, int64_t n) {
  if constexpr (!kWriteH) {
    const TD* __restrict d_ = dh;
    const T* __restrict g_ = gate;
    const T* __restrict u_ = up;
    T* __restrict dg_ = dgate;
    T* __restrict du_ = dup;
    for (int64_t i = 0; i < n; ++i) {
      const float dv = load(d_[i]), uv = load(u_[i]);
      float a, da;
      act_fwd_bwd<A, kFma>(load(g_[i]), a, da);
      store(dg_ + i, dv * uv * da);
      store(du_ + i, dv * a);
    }
  } else {
    alignas(64) float d[kChunk], g[kChunk], u[kChunk];
    for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
      const int64_t m = std::min(kChunk, n - c0);
      load_chunk(dh + c0, d, m);
      load_chunk(gate + c0, g, m);
      load_chunk(up + c0, u, m);
      for (int64_t i = 0; i < m; ++i) {
        float a, da;
        act_fwd_bwd<A, kFma>(g[i], a, da);
        const float dv = d[i], uv = u[i];
        d[i] = a * uv;        // h
        g[i] = dv * uv * da;  // dgate
        u[i] = dv * a;        // dup
      }
      store_chunk(d, h_out + c0, m);
      store_chunk(g, dgate + c0, m);
      store_chunk(u, dup + c0, m);
    }
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
CpuLevel cpu_copy() { return cpu_level(); }
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

template <Act A, typename T>
FM_FAST_COPY void fwd_span_fast(const T* gate, const T* up, T* out, int64_t n) {
  fwd_span<A, kFastCopyFma>(gate, up, out, n);
}
#if defined(__x86_64__)
template <Act A, typename T>
FM_AVX512_COPY void fwd_span_avx512(const T* gate, const T* up, T* out, int64_t n) {
  fwd_span<A, true>(gate, up, out, n);
}
template <Act A, bool kWriteH, typename T, typename TD>
FM_AVX512_COPY void bwd_span_avx512(const TD* dh, const T* gate, const T* up, TD* h_out, T* dgate, T* dup,
                                    int64_t n) {
  bwd_span<A, true, kWriteH>(dh, gate, up, h_out, dgate, dup, n);
}
#endif
template <Act A, typename T>
void fwd_span_base(const T* gate, const T* up, T* out, int64_t n) {
  fwd_span<A, false>(gate, up, out, n);
}
template <Act A, bool kWriteH, typename T, typename TD>
FM_FAST_COPY void bwd_span_fast(const TD* dh, const T* gate, const T* up, TD* h_out, T* dgate, T* dup, int64_t n) {
  bwd_span<A, kFastCopyFma, kWriteH>(dh, gate, up, h_out, dgate, dup, n);
}
template <Act A, bool kWriteH, typename T, typename TD>
void bwd_span_base(const TD* dh, const T* gate, const T* up, TD* h_out, T* dgate, T* dup, int64_t n) {
  bwd_span<A, false, kWriteH>(dh, gate, up, h_out, dgate, dup, n);
}

// Work split: (row, column block) tasks; a task is at most kColBlock elements so that a few long rows (decode:
// T = 1..16, I = 16K) still spread over the threads; tasks are grouped so a thread gets >= kGrainElems.
constexpr int64_t kColBlock = 8192;
constexpr int64_t kGrainElems = 32768;

template <typename F>
void for_each_span(int64_t rows, int64_t cols, F&& f) {
  if (rows == 0 || cols == 0) return;
  const int64_t blocks_per_row = (cols + kColBlock - 1) / kColBlock;
  const int64_t span = std::min(cols, kColBlock);
  const int64_t grain = std::max<int64_t>(1, kGrainElems / span);
  fused_mlp::parallel_for(0, rows * blocks_per_row, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / blocks_per_row;
      const int64_t c0 = (task - r * blocks_per_row) * kColBlock;
      f(r, c0, std::min(kColBlock, cols - c0));
    }
  });
}

// Row view of a tensor the ops accept: 2-D [rows, cols] with unit stride along cols and any row stride, or a
// contiguous tensor of any rank (rows = all leading dims; geglu_fwd only: the inference path skips reshapes).
int64_t n_cols(const Tensor& t) { return t.dim() == 0 ? 1 : t.size(t.dim() - 1); }
int64_t n_rows(const Tensor& t) { return t.dim() == 2 ? t.size(0) : (n_cols(t) ? t.numel() / n_cols(t) : 0); }
int64_t row_stride(const Tensor& t) { return t.dim() == 2 ? t.stride(0) : n_cols(t); }

// A tensor's data pointer and row stride, read once before the parallel loops (in the stable-ABI build every
// Tensor accessor is a call through torch's C shim).
struct RowsView {
  void* base;
  int64_t stride;
  template <typename T>
  T* elem(int64_t r, int64_t c) const {
    return static_cast<T*>(base) + r * stride + c;
  }
};

RowsView rows_view(const Tensor& t) { return {t.data_ptr(), row_stride(t)}; }

template <typename F>
void dispatch_dtype(ScalarType t, const char* what, F&& f) {
  switch (t) {
    case kFloat: f(float{}); break;
    case kHalf: f(Half{}); break;
    case kBFloat16: f(BFloat16{}); break;
    default: FM_CHECK(false, "fused_mlp: ", what, " must be float32/float16/bfloat16, got ", t);
  }
}

// 2-D, float, unit stride along I (any strides for an empty tensor: nothing is addressed); with allow_nd, a
// contiguous tensor of another rank is accepted as well.
void check_rows_any(const Tensor& t, const char* name, bool allow_nd = false) {
  FM_CHECK(is_float_type(t.scalar_type()), "fused_mlp: ", name, " must be float32/float16/bfloat16, got ",
           t.scalar_type());
  if (allow_nd && t.dim() != 2) {
    FM_CHECK(t.dim() >= 1 && t.is_contiguous(), "fused_mlp: ", name, " must be 2-D [rows, cols] or contiguous");
    return;
  }
  if (t.numel() == 0) {
    FM_CHECK(t.dim() == 2, "fused_mlp: ", name, " must be 2-D [rows, cols], got ", t.dim(), "-D");
    return;
  }
  check_rows(t, name);
}

void check_pair(const Tensor& gate, const Tensor& up, bool allow_nd = false) {
  check_rows_any(gate, "gate", allow_nd);
  check_rows_any(up, "up", allow_nd);
  FM_CHECK(sizes_of(gate) == sizes_of(up), "fused_mlp: gate shape ", shape_str(gate), " != up shape ",
           shape_str(up));
  FM_CHECK(gate.scalar_type() == up.scalar_type(), "fused_mlp: gate dtype ", gate.scalar_type(), " != up dtype ",
           up.scalar_type());
  FM_CHECK(gate.device() == up.device(), "fused_mlp: gate and up must be on one device");
}

void check_dh(const Tensor& dh, const Tensor& gate) {
  check_rows_any(dh, "dh");
  FM_CHECK(sizes_of(dh) == sizes_of(gate), "fused_mlp: dh shape ", shape_str(dh), " != gate shape ",
           shape_str(gate));
  FM_CHECK(dh.scalar_type() == gate.scalar_type() || dh.scalar_type() == kFloat,
           "fused_mlp: dh must be float32 or gate's dtype (", gate.scalar_type(), "), got ", dh.scalar_type());
  FM_CHECK(dh.device() == gate.device(), "fused_mlp: dh and gate must be on one device");
}

// h_out is read only when kWriteH.
template <bool kWriteH>
void run_bwd(Act act, const Tensor& dh, const Tensor& gate, const Tensor& up, const Tensor& h_out,
             const Tensor& dgate, const Tensor& dup) {
  const int64_t rows = gate.size(0), cols = gate.size(1);
  if (rows == 0 || cols == 0) return;  // nothing to do (for_each_span's own early exit; dtypes are checked)
  const CpuLevel copy = cpu_copy();
  const RowsView dh_v = rows_view(dh), gate_v = rows_view(gate), up_v = rows_view(up);
  const RowsView h_v = kWriteH ? rows_view(h_out) : RowsView{nullptr, 0};
  const RowsView dgate_v = rows_view(dgate), dup_v = rows_view(dup);
  dispatch_act(act, [&](auto ac) {
    constexpr Act A = decltype(ac)::value;
    dispatch_dtype(gate.scalar_type(), "gate", [&](auto tt) {
      using T = decltype(tt);
      auto run = [&](auto dt) {
        using TD = decltype(dt);
        for_each_span(rows, cols, [&](int64_t r, int64_t c0, int64_t n) {
          const TD* d = dh_v.elem<TD>(r, c0);
          const T* g = gate_v.elem<T>(r, c0);
          const T* u = up_v.elem<T>(r, c0);
          TD* h = kWriteH ? h_v.elem<TD>(r, c0) : nullptr;
          T* dg = dgate_v.elem<T>(r, c0);
          T* du = dup_v.elem<T>(r, c0);
#if defined(__x86_64__)
          if (copy == CpuLevel::kAvx512) {
            bwd_span_avx512<A, kWriteH, T, TD>(d, g, u, h, dg, du, n);
            return;
          }
#endif
          if (copy == CpuLevel::kAvx2) bwd_span_fast<A, kWriteH, T, TD>(d, g, u, h, dg, du, n);
          else bwd_span_base<A, kWriteH, T, TD>(d, g, u, h, dg, du, n);
        });
      };
      if (dh.scalar_type() == kFloat) run(float{});
      else run(T{});
    });
  });
}

}  // namespace
}  // namespace fused_mlp::cpu

using namespace fused_mlp::cpu;

Tensor geglu_fwd_cpu(const Tensor& gate, const Tensor& up, StrArg activation) {
  const Act act = parse_activation(std::string_view(activation.data(), activation.size()));
  check_pair(gate, up, /*allow_nd=*/true);
  const int64_t rows = n_rows(gate), cols = n_cols(gate);
  Tensor out = fused_mlp::empty(fused_mlp::sizes_of(gate), gate.scalar_type(), gate);
  if (rows == 0 || cols == 0) return out;  // nothing to do (for_each_span's own early exit; dtypes are checked)
  const CpuLevel copy = cpu_copy();
  const RowsView gate_v = rows_view(gate), up_v = rows_view(up), out_v = rows_view(out);
  dispatch_act(act, [&](auto ac) {
    constexpr Act A = decltype(ac)::value;
    dispatch_dtype(gate.scalar_type(), "gate", [&](auto tt) {
      using T = decltype(tt);
      for_each_span(rows, cols, [&](int64_t r, int64_t c0, int64_t n) {
        const T* g = gate_v.elem<T>(r, c0);
        const T* u = up_v.elem<T>(r, c0);
        T* o = out_v.elem<T>(r, c0);
#if defined(__x86_64__)
        if (copy == CpuLevel::kAvx512) {
          fwd_span_avx512<A, T>(g, u, o, n);
          return;
        }
#endif
        if (copy == CpuLevel::kAvx2) fwd_span_fast<A, T>(g, u, o, n);
        else fwd_span_base<A, T>(g, u, o, n);
      });
    });
  });
  return out;
}

std::tuple<Tensor, Tensor> geglu_bwd_cpu(const Tensor& dh, const Tensor& gate, const Tensor& up,
                                         StrArg activation) {
  const Act act = parse_activation(std::string_view(activation.data(), activation.size()));
  check_pair(gate, up);
  check_dh(dh, gate);
  const fused_mlp::Sizes sizes = fused_mlp::sizes_of(gate);
  Tensor dgate = fused_mlp::empty(sizes, gate.scalar_type(), gate);
  Tensor dup = fused_mlp::empty(sizes, gate.scalar_type(), gate);
  run_bwd<false>(act, dh, gate, up, /*h_out (unused)=*/dh, dgate, dup);
  return {dgate, dup};
}

void geglu_bwd_inplace_cpu(const Tensor& dh, const Tensor& gate, const Tensor& up, StrArg activation) {
  const Act act = parse_activation(std::string_view(activation.data(), activation.size()));
  check_pair(gate, up);
  check_dh(dh, gate);
  // Each element is read, then its three results are written by the same thread: safe only when no two
  // elements share memory (no expanded/overlapping views) and the three buffers are disjoint.
  fused_mlp::check_no_internal_overlap(dh, "geglu_bwd_inplace: dh");
  fused_mlp::check_no_internal_overlap(gate, "geglu_bwd_inplace: gate");
  fused_mlp::check_no_internal_overlap(up, "geglu_bwd_inplace: up");
  fused_mlp::check_no_overlap(dh, gate, "geglu_bwd_inplace: dh and gate");
  fused_mlp::check_no_overlap(dh, up, "geglu_bwd_inplace: dh and up");
  fused_mlp::check_no_overlap(gate, up, "geglu_bwd_inplace: gate and up");
  run_bwd<true>(act, dh, gate, up, dh, gate, up);
}
