// addmm / linear on the CPU: y = act(mat1 @ mat2 + bias), rounded once to the output dtype.
// mat1: [M, K]; mat2: [K, N] (any strides: nn.Linear's weight.t() and Conv1D's [in, out] weight both work
// without copies in fp32); bias: [N] (mat dtype or fp32); y, preact: [M, N] mat dtype.
// activation: "none", "gelu_tanh" (0.5x(1+tanh(sqrt(2/pi)(x+0.044715x^3)))), "gelu" (0.5x(1+erf(x/sqrt2))).
//
// Numerics: the product goes through ATen's fp32 BLAS (mm on fp32 operands; bf16/fp16 inputs are widened
// first, which is exact), so the accumulator is fp32 exactly as on the GPU; the bias and the activation are then
// applied to that fp32 accumulator and the result is rounded once. Cost of "correct first": for bf16/fp16 inputs
// both operands are widened to fp32 copies on every call (K*(M+N) extra fp32 elements written and read), and the
// [M, N] fp32 accumulator is a temporary. fp32 inputs are used in place.
// Backward: dZ = dY * act'(Z) in fp32 (Z = the saved pre-activation), db = column sums of dZ accumulated in
// fp64 in a fixed order (independent of the thread count), dX = dZ @ mat2^T and dW = mat1^T @ dZ as fp32 GEMMs on
// the fp32 dZ (unrounded: slightly more exact than the GPU path, whose GEMM operands must be in the input dtype),
// each rounded once.
//
// Also home of the test hooks that force the CUDA path's cuBLASLt fallbacks and the sm_90 CUTLASS path's mode (this
// file is compiled into every variant; the CUDA code reads the flags through torch_binding.h).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "activation.h"  // Act: the epilogue activation codes (shared with the CUDA backend)
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

constexpr float kSqrt2OverPi = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kKappa = 0.044715f;
constexpr float kSqrtHalf = 0.7071067811865476f;     // 1/sqrt(2)
constexpr float kInvSqrt2Pi = 0.3989422804014327f;   // 1/sqrt(2*pi)

// The same formulas as PyTorch's gelu / gelu_backward (so NaN/Inf behave like the fp32 reference).
inline float act_fwd(int act, float x) {
  if (act == 1) return 0.5f * x * (1.f + std::tanh(kSqrt2OverPi * (x + kKappa * x * x * x)));
  if (act == 2) return 0.5f * x * (1.f + std::erf(x * kSqrtHalf));
  return x;
}

inline float act_grad(int act, float x) {
  if (act == 1) {
    const float x2 = x * x;
    const float t = std::tanh(kSqrt2OverPi * (x + kKappa * x2 * x));
    return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * kSqrt2OverPi * (1.f + 3.f * kKappa * x2);
  }
  if (act == 2) return 0.5f * (1.f + std::erf(x * kSqrtHalf)) + x * std::exp(-0.5f * x * x) * kInvSqrt2Pi;
  return 1.f;
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

  // fp32 accumulator [M, N] (contiguous): an fp32 GEMM of the (exactly) widened operands.
  Tensor acc = K == 0 ? fm::zeros({M, N}, kFloat, mat1) : fm::mm(fm::to_dtype(mat1, kFloat), fm::to_dtype(mat2, kFloat));
  const std::vector<float> b = bias_row(bias, N);
  const float* acc_p = static_cast<const float*>(acc.const_data_ptr());
  const int64_t grain = std::max<int64_t>(1, 16384 / N);
  fm::parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> row(N);
    for (int64_t r = begin; r < end; ++r) {
      const float* a = acc_p + r * N;
      if (b.empty()) {
        for (int64_t i = 0; i < N; ++i) row[i] = a[i];
      } else {
        for (int64_t i = 0; i < N; ++i) row[i] = a[i] + b[i];
      }
      if (want_z) store_row(row.data(), T, row_ptr_mut(z, r), N);
      if (act != 0)
        for (int64_t i = 0; i < N; ++i) row[i] = act_fwd(act, row[i]);
      store_row(row.data(), T, row_ptr_mut(y, r), N);
    }
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
    fm::parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> zr(N);
      for (int64_t r = begin; r < end; ++r) {
        float* d = dz_p + r * N;
        load_row(row_ptr(dyc, r), dyc.scalar_type(), d, N);
        load_row(row_ptr(zc, r), T, zr.data(), N);
        for (int64_t i = 0; i < N; ++i) d[i] *= act_grad(act, zr[i]);
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
