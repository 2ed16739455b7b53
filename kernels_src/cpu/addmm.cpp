// addmm / linear on the CPU: y = act(mat1 @ mat2 + bias), rounded once to the output dtype.
// mat1: [M, K]; mat2: [K, N] (any strides: nn.Linear's weight.t() and Conv1D's [in, out] weight both work
// without copies in fp32); bias: [N] (mat dtype or fp32); y, preact: [M, N] mat dtype.
// activation: "none", "gelu_tanh" (0.5x(1+tanh(sqrt(2/pi)(x+0.044715x^3)))), "gelu" (0.5x(1+erf(x/sqrt2))).
//
// Numerics: the product goes through ATen's fp32 BLAS (mm on fp32 operands; bf16/fp16 inputs are widened
// first, which is exact), so the accumulator is fp32 exactly as on the GPU; the bias and the activation (the fp32
// GeLU forms of cpu/act_math.h, vectorised, a few fp32 ulp) are then applied to that fp32 accumulator and the result
// is rounded once. Cost of "correct first": for bf16/fp16 inputs both operands are widened to fp32 copies on every
// call (K*(M+N) extra fp32 elements written and read), and the [M, N] fp32 accumulator is a temporary. fp32 inputs
// are used in place, and the GEMM writes an fp32 output directly (the epilogue then runs in place).
// Backward: dZ = dY * act'(Z) in fp32 (Z = the saved pre-activation; act_math.h's derivative forms), db = column
// sums of dZ accumulated in fp64 in a fixed order (independent of the thread count), dX = dZ @ mat2^T and
// dW = mat1^T @ dZ as fp32 GEMMs on the fp32 dZ (unrounded: slightly more exact than the GPU path, whose GEMM operands
// must be in the input dtype), each rounded once.
//
// Also home of the test hooks that force the CUDA path's cuBLASLt fallbacks and the sm_90 CUTLASS path's mode (this
// file is compiled into every variant; the CUDA code reads the flags through torch_binding.h).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "activation.h"  // Act: the epilogue activation codes (shared with the CUDA backend)
#include "cpu/act_math.h"  // the epilogue's fp32 GeLU (geglu.cpp's vectorised formulas) and the per-CPU copies
#include "cpu/cpu_common.h"
#include "torch_binding.h"

// ---- cuBLASLt fallback test hook (see addmm.cu) ------------------------------------------------------------
namespace {
std::atomic<int> g_lt_fallback_mode{0};
std::atomic<bool> g_lt_warned[2] = {false, false};
}  // namespace

int64_t addmm_lt_force_fallback(int64_t mode) {
  FM_CHECK(mode >= 0 && mode <= 3, "fused_mlp: _addmm_lt_force_fallback mode must be 0, 1, 2 or 3, got ", mode);
  for (auto& w : g_lt_warned) w.store(false);  // a fresh "warn once" for the test that sets the mode
  return g_lt_fallback_mode.exchange(static_cast<int>(mode));
}

int addmm_lt_fallback_mode() { return g_lt_fallback_mode.load(std::memory_order_relaxed); }

bool addmm_lt_first_warning(int which) {
  FM_CHECK(which >= 0 && which < 2, "fused_mlp: bad warning slot");
  return !g_lt_warned[which].exchange(true);
}

// ---- sm_90 CUTLASS path override (see addmm_sm90.cu) -------------------------------------------------------
namespace {
std::atomic<int> g_sm90_override{-1};
}  // namespace

int64_t addmm_sm90_set_mode(int64_t mode) {
  FM_CHECK(mode >= -1 && mode <= 4, "fused_mlp: _addmm_sm90_mode mode must be -1 (environment), 0 off, 1 auto, 2 on, "
           "3 pingpong or 4 cooperative, got ", mode);
  return g_sm90_override.exchange(static_cast<int>(mode));
}

int addmm_sm90_override() { return g_sm90_override.load(std::memory_order_relaxed); }

namespace fused_mlp::cpu {
namespace {

// ---- the epilogue's element loops (fp32 in, one rounding out), compiled once per CPU copy (act_math.h) -----------
// act(x) for the epilogue: act_math.h's fp32 GeLU forms (the gated kernels' math: a few fp32 ulp, vectorised), or x.
template <Act A, bool kFma>
FM_INLINE float epi_act(float x) {
  if constexpr (A == Act::kNone) return x;
  else return act_fwd<A, kFma>(x);
}

// One row: v = acc + b (fp32), z = v rounded (training's saved pre-activation), y = act(v) rounded. y may be the
// accumulator itself (fp32 output: the GEMM wrote into y), so acc and y are not __restrict.
template <Act A, bool kFma, bool kBias, bool kZ, typename T>
FM_INLINE void epi_fwd_row(const float* acc, const float* __restrict b, T* __restrict z, T* y, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    if (static_cast<const void*>(acc) == static_cast<const void*>(y)) {  // in place: one pointer, still vectorised
      for (int64_t i = 0; i < n; ++i) {
        const float v = kBias ? y[i] + b[i] : y[i];
        if constexpr (kZ) z[i] = v;
        y[i] = epi_act<A, kFma>(v);
      }
      return;
    }
  }
  const float* __restrict a_ = acc;
  T* __restrict y_ = y;
  for (int64_t i = 0; i < n; ++i) {
    const float v = kBias ? a_[i] + b[i] : a_[i];
    if constexpr (kZ) store(z + i, v);
    store(y_ + i, epi_act<A, kFma>(v));
  }
}

// One row of the backward: dz = dy * act'(z) in fp32.
template <Act A, bool kFma, typename T, typename TD>
FM_INLINE void epi_bwd_row(const TD* __restrict dy, const T* __restrict z, float* __restrict dz, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float a, da;
    act_fwd_bwd<A, kFma>(load(z[i]), a, da);
    dz[i] = load(dy[i]) * da;
  }
}

template <Act A, bool kBias, bool kZ, typename T>
FM_FAST_COPY void epi_fwd_row_fast(const float* acc, const float* b, T* z, T* y, int64_t n) {
  epi_fwd_row<A, kFastCopyFma, kBias, kZ>(acc, b, z, y, n);
}
template <Act A, bool kBias, bool kZ, typename T>
void epi_fwd_row_base(const float* acc, const float* b, T* z, T* y, int64_t n) {
  epi_fwd_row<A, false, kBias, kZ>(acc, b, z, y, n);
}
template <Act A, typename T, typename TD>
FM_FAST_COPY void epi_bwd_row_fast(const TD* dy, const T* z, float* dz, int64_t n) {
  epi_bwd_row<A, kFastCopyFma>(dy, z, dz, n);
}
template <Act A, typename T, typename TD>
void epi_bwd_row_base(const TD* dy, const T* z, float* dz, int64_t n) {
  epi_bwd_row<A, false>(dy, z, dz, n);
}
#if defined(__x86_64__)
template <Act A, bool kBias, bool kZ, typename T>
FM_AVX512_COPY void epi_fwd_row_avx512(const float* acc, const float* b, T* z, T* y, int64_t n) {
  epi_fwd_row<A, true, kBias, kZ>(acc, b, z, y, n);
}
template <Act A, typename T, typename TD>
FM_AVX512_COPY void epi_bwd_row_avx512(const TD* dy, const T* z, float* dz, int64_t n) {
  epi_bwd_row<A, true>(dy, z, dz, n);
}
#endif

template <Act A, bool kBias, bool kZ, typename T>
void epi_fwd_row_copy(CpuLevel copy, const float* acc, const float* b, T* z, T* y, int64_t n) {
#if defined(__x86_64__)
  if (copy == CpuLevel::kAvx512) return epi_fwd_row_avx512<A, kBias, kZ>(acc, b, z, y, n);
#endif
  if (copy == CpuLevel::kAvx2) epi_fwd_row_fast<A, kBias, kZ>(acc, b, z, y, n);
  else epi_fwd_row_base<A, kBias, kZ>(acc, b, z, y, n);
}

template <Act A, typename T, typename TD>
void epi_bwd_row_copy(CpuLevel copy, const TD* dy, const T* z, float* dz, int64_t n) {
#if defined(__x86_64__)
  if (copy == CpuLevel::kAvx512) return epi_bwd_row_avx512<A>(dy, z, dz, n);
#endif
  if (copy == CpuLevel::kAvx2) epi_bwd_row_fast<A>(dy, z, dz, n);
  else epi_bwd_row_base<A>(dy, z, dz, n);
}

// f(std::integral_constant<Act, a>{}) for the epilogue's activations (none, tanh-GeLU, erf-GeLU).
template <typename F>
void dispatch_epi_act(Act a, F&& f) {
  switch (a) {
    case Act::kNone: f(std::integral_constant<Act, Act::kNone>{}); break;
    case Act::kGeluTanh: f(std::integral_constant<Act, Act::kGeluTanh>{}); break;
    case Act::kGeluErf: f(std::integral_constant<Act, Act::kGeluErf>{}); break;
    case Act::kSilu: FM_CHECK(false, "fused_mlp: addmm has no silu epilogue"); break;
  }
}

// fp64 -> fp32 rounded to odd: converting that to bf16/fp16 (round to nearest) is the correctly rounded fp64 value
// (fp32 carries more than 2 extra bits), i.e. one rounding, not two.
inline float round_to_odd_f32(double d) {
  float f = static_cast<float>(d);
  if (static_cast<double>(f) == d || std::isnan(d)) return f;
  if (std::fabs(static_cast<double>(f)) > std::fabs(d)) f = std::nextafter(f, 0.0f);  // now rounded toward zero
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  bits |= 1u;
  std::memcpy(&f, &bits, sizeof(bits));
  return f;
}

void check_addmm_args(const std::optional<Tensor>& bias, const Tensor& mat1, const Tensor& mat2) {
  FM_CHECK(mat1.dim() == 2 && mat2.dim() == 2, "fused_mlp: addmm takes 2-D mat1 [M, K] and mat2 [K, N], got ",
              mat1.dim(), "-D and ", mat2.dim(), "-D");
  FM_CHECK(is_float_type(mat1.scalar_type()), "fused_mlp: mat1 must be float32/float16/bfloat16, got ",
              mat1.scalar_type());
  FM_CHECK(mat2.scalar_type() == mat1.scalar_type(), "fused_mlp: mat2 dtype ", mat2.scalar_type(),
              " must equal mat1 dtype ", mat1.scalar_type());
  FM_CHECK(mat1.size(1) == mat2.size(0), "fused_mlp: mat1 [", mat1.size(0), ", ", mat1.size(1),
              "] and mat2 [", mat2.size(0), ", ", mat2.size(1), "] cannot be multiplied (inner dims differ)");
  FM_CHECK(same_device(mat1, mat2), "fused_mlp: mat1 and mat2 must be on one device");
  if (bias.has_value()) {
    FM_CHECK(bias->dim() == 1 && bias->size(0) == mat2.size(1), "fused_mlp: bias must be [", mat2.size(1),
                "], got ", shape_str(*bias));
    FM_CHECK(bias->scalar_type() == mat1.scalar_type() || bias->scalar_type() == kFloat,
                "fused_mlp: bias dtype must be float32 or the input dtype ", mat1.scalar_type(), ", got ",
                bias->scalar_type());
    FM_CHECK(same_device(*bias, mat1), "fused_mlp: bias must be on mat1's device");
  }
}

}  // namespace
}  // namespace fused_mlp::cpu

// [..., N] with M * N elements: the shape y is allocated with (shared with the CUDA entry point).
std::vector<int64_t> check_out_shape(ShapeArg out_shape, int64_t M, int64_t N) {
  const std::vector<int64_t> shape = fused_mlp::shape_arg(out_shape);
  int64_t numel = 1;
  for (const int64_t s : shape) numel *= s;
  FM_CHECK(!shape.empty() && shape.back() == N && numel == M * N, "fused_mlp: out_shape ",
           fused_mlp::shape_str(shape), " must be [..., ", N, "] with ", M, " x ", N, " elements");
  return shape;
}

namespace fused_mlp::cpu {
namespace {

// bias as an fp32 row (empty without bias).
std::vector<float> bias_row(const std::optional<Tensor>& bias, int64_t n) {
  std::vector<float> b;
  if (bias.has_value()) {
    const Tensor bc = fused_mlp::contiguous(*bias);
    b.resize(n);
    load_row(bc.const_data_ptr(), bc.scalar_type(), b.data(), n);
  }
  return b;
}

}  // namespace
}  // namespace fused_mlp::cpu

using namespace fused_mlp::cpu;
namespace fm = fused_mlp;

std::tuple<Tensor, Tensor> addmm_fwd_cpu(const std::optional<Tensor>& bias, const Tensor& mat1,
                                                 const Tensor& mat2, StrArg activation, bool save_preact,
                                                 ShapeArg out_shape) {
  // (fm::mm is never re-cast by an enclosing torch.autocast: the Python API already cast.)
  const int act = static_cast<int>(fm::parse_epilogue_activation(activation));
  check_addmm_args(bias, mat1, mat2);
  const int64_t M = mat1.size(0), K = mat1.size(1), N = mat2.size(1);
  const ScalarType T = mat1.scalar_type();
  const bool want_z = save_preact && act != 0;
  auto y_out = fm::empty(check_out_shape(out_shape, M, N), T, mat1);
  const Tensor y = fm::view(y_out, {M, N});
  auto z = want_z ? fm::empty({M, N}, T, mat1) : fm::empty({0}, T, mat1);
  if (M == 0 || N == 0) return {y_out, z};

  // fp32 accumulator [M, N] (contiguous): an fp32 GEMM of the (exactly) widened operands; for fp32 output the GEMM
  // writes y itself and the epilogue runs in place (no [M, N] temporary).
  Tensor acc = y;
  if (K == 0) {
    acc = fm::zeros({M, N}, kFloat, mat1);
  } else if (T == kFloat) {
    Tensor yv = y;
    fm::mm_out(yv, mat1, mat2);
  } else {
    acc = fm::mm(fm::to_dtype(mat1, kFloat), fm::to_dtype(mat2, kFloat));
  }
  const std::vector<float> b = bias_row(bias, N);
  const float* acc_p = static_cast<const float*>(acc.const_data_ptr());
  const int64_t grain = std::max<int64_t>(1, 16384 / N);
  const CpuLevel copy = cpu_copy();
  dispatch_epi_act(static_cast<Act>(act), [&](auto ac) {
    constexpr Act A = decltype(ac)::value;
    dispatch_dtype(T, "mat1", [&](auto tt) {
      using TT = decltype(tt);
      auto rows = [&](auto kb, auto kz) {
        constexpr bool kBias = decltype(kb)::value, kZ = decltype(kz)::value && A != Act::kNone;
        if constexpr (A == Act::kNone && !kBias) {
          if (acc_p == y.const_data_ptr()) return;  // the GEMM wrote y: nothing left to apply (no z without an act)
        }
        fm::parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r)
            epi_fwd_row_copy<A, kBias, kZ, TT>(copy, acc_p + r * N, b.data(),
                                               kZ ? reinterpret_cast<TT*>(row_ptr_mut(z, r)) : nullptr,
                                               reinterpret_cast<TT*>(row_ptr_mut(y, r)), N);
        });
      };
      auto with_z = [&](auto kb) {
        if (want_z) rows(kb, std::true_type{});
        else rows(kb, std::false_type{});
      };
      if (b.empty()) with_z(std::false_type{});
      else with_z(std::true_type{});
    });
  });
  return {y_out, z};
}

std::tuple<Tensor, Tensor, Tensor> addmm_bwd_cpu(
    const Tensor& dy, const std::optional<Tensor>& preact, const Tensor& mat1, const Tensor& mat2,
    StrArg activation, bool need_dx, bool need_dw, bool dw_transposed, bool need_db, ScalarType db_dtype) {
  const int act = static_cast<int>(fm::parse_epilogue_activation(activation));
  check_addmm_args(std::nullopt, mat1, mat2);
  const int64_t M = mat1.size(0), N = mat2.size(1);
  const ScalarType T = mat1.scalar_type();
  FM_CHECK(dy.dim() == 2 && dy.size(0) == M && dy.size(1) == N, "fused_mlp: dy must be [", M, ", ", N,
              "], got ", fm::shape_str(dy));
  FM_CHECK(dy.scalar_type() == T || dy.scalar_type() == kFloat, "fused_mlp: dy dtype must be float32 or ",
              T, ", got ", dy.scalar_type());
  FM_CHECK(is_float_type(db_dtype), "fused_mlp: db_dtype must be a float dtype");
  if (act != 0)
    FM_CHECK(preact.has_value() && preact->dim() == 2 && preact->size(0) == M && preact->size(1) == N &&
                    preact->scalar_type() == T,
                "fused_mlp: the saved pre-activation must be [", M, ", ", N, "] ", T);

  // dZ in fp32 (contiguous [M, N]).
  Tensor dz;
  if (act == 0) {
    dz = fm::contiguous(fm::to_dtype(dy, kFloat));
  } else {
    dz = fm::empty({M, N}, kFloat, dy);
    const Tensor dyc = dy.stride(1) == 1 || N <= 1 ? dy : fm::contiguous(dy);
    const Tensor zc = preact->stride(1) == 1 || N <= 1 ? *preact : fm::contiguous(*preact);
    float* dz_p = static_cast<float*>(dz.data_ptr());
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(N, 1));
    const CpuLevel copy = cpu_copy();
    dispatch_epi_act(static_cast<Act>(act), [&](auto ac) {
      constexpr Act A = decltype(ac)::value;
      if constexpr (A != Act::kNone) {
        dispatch_dtype(T, "mat1", [&](auto tt) {
          using TT = decltype(tt);
          auto rows = [&](auto dt) {
            using TD = decltype(dt);
            fm::parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
              for (int64_t r = begin; r < end; ++r)
                epi_bwd_row_copy<A, TT, TD>(copy, reinterpret_cast<const TD*>(row_ptr(dyc, r)),
                                            reinterpret_cast<const TT*>(row_ptr(zc, r)), dz_p + r * N, N);
            });
          };
          if (dyc.scalar_type() == kFloat) rows(float{});
          else rows(TT{});
        });
      }
    });
  }

  Tensor db = fm::empty({need_db ? N : 0}, db_dtype, mat1);
  if (need_db && N > 0) {
    // Column sums in a fixed row order per column (deterministic whatever the thread count), accumulated in
    // fp64: this pass is memory-bound, so the wider accumulator is free and db is rounded once.
    std::vector<double> sums(N, 0.0);
    const float* dz_p = static_cast<const float*>(dz.const_data_ptr());
    constexpr int64_t kCols = 256;
    fm::parallel_for(0, (N + kCols - 1) / kCols, 1, [&](int64_t begin, int64_t end) {
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t c0 = blk * kCols, c1 = std::min(N, c0 + kCols);
        for (int64_t r = 0; r < M; ++r) {
          const float* d = dz_p + r * N;
          for (int64_t c = c0; c < c1; ++c) sums[c] += d[c];
        }
      }
    });
    std::vector<float> sums32(N);
    for (int64_t c = 0; c < N; ++c)
      sums32[c] = db_dtype == kFloat ? static_cast<float>(sums[c]) : round_to_odd_f32(sums[c]);
    store_row(sums32.data(), db_dtype, db.data_ptr(), N);
  }

  Tensor dx = fm::empty({0}, T, mat1), dw = fm::empty({0}, T, mat1);
  if (need_dx) dx = fm::contiguous(fm::to_dtype(fm::mm(dz, fm::transposed(fm::to_dtype(mat2, kFloat))), T));
  if (need_dw) {
    const Tensor x32 = fm::to_dtype(mat1, kFloat);
    dw = fm::contiguous(fm::to_dtype(dw_transposed ? fm::mm(fm::transposed(dz), x32) : fm::mm(fm::transposed(x32), dz), T));
  }
  return {dx, dw, db};
}
