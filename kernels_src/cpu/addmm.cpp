// addmm / linear on the CPU: y = act(mat1 @ mat2 + bias), rounded once to the output dtype.
// mat1: [M, K]; mat2: [K, N] (any strides: nn.Linear's weight.t() and Conv1D's [in, out] weight both work
// without copies in fp32); bias: [N] (mat dtype or fp32); y, preact: [M, N] mat dtype.
// activation: 0 none, 1 "gelu_tanh" (0.5x(1+tanh(sqrt(2/pi)(x+0.044715x^3)))), 2 "gelu" (0.5x(1+erf(x/sqrt2))).
//
// Numerics: the product goes through ATen's fp32 BLAS (at::mm on fp32 operands; bf16/fp16 inputs are widened
// first, which is exact), so the accumulator is fp32 exactly as on the GPU; the bias and the activation are then
// applied to that fp32 accumulator and the result is rounded once. Cost of "correct first": for bf16/fp16 inputs
// both operands are widened to fp32 copies on every call (K*(M+N) extra fp32 elements written and read), and the
// [M, N] fp32 accumulator is a temporary. fp32 inputs are used in place.
// Backward: dZ = dY * act'(Z) in fp32 (Z = the saved pre-activation), db = column sums of dZ accumulated in
// fp64 in a fixed order (independent of the thread count), dX = dZ @ mat2^T and dW = mat1^T @ dZ as fp32 GEMMs on
// the fp32 dZ (unrounded: slightly more exact than the GPU path, whose GEMM operands must be in the input dtype),
// each rounded once.
//
// Also home of the test hook that forces the CUDA path's cuBLASLt fallbacks (this file is compiled into every
// variant; the CUDA code reads the flags through torch_binding.h).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/cpu_common.h"
#include "torch_binding.h"

// ---- cuBLASLt fallback test hook (see addmm.cu) ------------------------------------------------------------
namespace {
std::atomic<int> g_lt_fallback_mode{0};
std::atomic<bool> g_lt_warned[2] = {false, false};
}  // namespace

int64_t addmm_lt_force_fallback(int64_t mode) {
  TORCH_CHECK(mode >= 0 && mode <= 2, "fused_mlp: _addmm_lt_force_fallback mode must be 0, 1 or 2, got ", mode);
  for (auto& w : g_lt_warned) w.store(false);  // a fresh "warn once" for the test that sets the mode
  return g_lt_fallback_mode.exchange(static_cast<int>(mode));
}

int addmm_lt_fallback_mode() { return g_lt_fallback_mode.load(std::memory_order_relaxed); }

bool addmm_lt_first_warning(int which) {
  TORCH_CHECK(which >= 0 && which < 2, "fused_mlp: bad warning slot");
  return !g_lt_warned[which].exchange(true);
}

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

void check_addmm_args(const std::optional<at::Tensor>& bias, const at::Tensor& mat1, const at::Tensor& mat2,
                      int64_t activation) {
  TORCH_CHECK(activation >= 0 && activation <= 2, "fused_mlp: activation code must be 0, 1 or 2, got ", activation);
  TORCH_CHECK(mat1.dim() == 2 && mat2.dim() == 2, "fused_mlp: addmm takes 2-D mat1 [M, K] and mat2 [K, N], got ",
              mat1.dim(), "-D and ", mat2.dim(), "-D");
  TORCH_CHECK(is_float_type(mat1.scalar_type()), "fused_mlp: mat1 must be float32/float16/bfloat16, got ",
              mat1.scalar_type());
  TORCH_CHECK(mat2.scalar_type() == mat1.scalar_type(), "fused_mlp: mat2 dtype ", mat2.scalar_type(),
              " must equal mat1 dtype ", mat1.scalar_type());
  TORCH_CHECK(mat1.size(1) == mat2.size(0), "fused_mlp: mat1 [", mat1.size(0), ", ", mat1.size(1),
              "] and mat2 [", mat2.size(0), ", ", mat2.size(1), "] cannot be multiplied (inner dims differ)");
  TORCH_CHECK(mat1.device() == mat2.device(), "fused_mlp: mat1 and mat2 must be on one device");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == mat2.size(1), "fused_mlp: bias must be [", mat2.size(1),
                "], got ", bias->sizes());
    TORCH_CHECK(bias->scalar_type() == mat1.scalar_type() || bias->scalar_type() == at::kFloat,
                "fused_mlp: bias dtype must be float32 or the input dtype ", mat1.scalar_type(), ", got ",
                bias->scalar_type());
    TORCH_CHECK(bias->device() == mat1.device(), "fused_mlp: bias must be on mat1's device");
  }
}

}  // namespace
}  // namespace fused_mlp::cpu

// [..., N] with M * N elements: the shape y is allocated with (shared with the CUDA entry point).
std::vector<int64_t> check_out_shape(c10::SymIntArrayRef out_shape, int64_t M, int64_t N) {
  std::vector<int64_t> shape;
  shape.reserve(out_shape.size());
  int64_t numel = 1;
  for (const c10::SymInt& s : out_shape) {
    shape.push_back(s.expect_int());
    numel *= shape.back();
  }
  TORCH_CHECK(!shape.empty() && shape.back() == N && numel == M * N, "fused_mlp: out_shape ", c10::IntArrayRef(shape),
              " must be [..., ", N, "] with ", M, " x ", N, " elements");
  return shape;
}

namespace fused_mlp::cpu {
namespace {

// bias as an fp32 row (empty without bias).
std::vector<float> bias_row(const std::optional<at::Tensor>& bias, int64_t n) {
  std::vector<float> b;
  if (bias.has_value()) {
    const at::Tensor bc = bias->contiguous();
    b.resize(n);
    load_row(bc.const_data_ptr(), bc.scalar_type(), b.data(), n);
  }
  return b;
}

}  // namespace
}  // namespace fused_mlp::cpu

using namespace fused_mlp::cpu;

std::tuple<at::Tensor, at::Tensor> addmm_fwd_cpu(const std::optional<at::Tensor>& bias, const at::Tensor& mat1,
                                                 const at::Tensor& mat2, int64_t activation, bool save_preact,
                                                 c10::SymIntArrayRef out_shape) {
  // The at::mm calls inside must not be re-cast by an enclosing torch.autocast (the Python API already cast).
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  check_addmm_args(bias, mat1, mat2, activation);
  const int64_t M = mat1.size(0), K = mat1.size(1), N = mat2.size(1);
  const at::ScalarType T = mat1.scalar_type();
  const bool want_z = save_preact && activation != 0;
  auto y_out = at::empty(check_out_shape(out_shape, M, N), mat1.options());
  const at::Tensor y = y_out.view({M, N});
  auto z = want_z ? at::empty({M, N}, mat1.options()) : at::empty({0}, mat1.options());
  if (M == 0 || N == 0) return {y_out, z};

  // fp32 accumulator [M, N] (contiguous): an fp32 GEMM of the (exactly) widened operands.
  at::Tensor acc = K == 0 ? at::zeros({M, N}, mat1.options().dtype(at::kFloat))
                          : at::mm(mat1.to(at::kFloat), mat2.to(at::kFloat)).contiguous();
  const std::vector<float> b = bias_row(bias, N);
  const float* acc_p = acc.const_data_ptr<float>();
  const int act = static_cast<int>(activation);
  const int64_t grain = std::max<int64_t>(1, 16384 / N);
  at::parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
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

std::tuple<at::Tensor, at::Tensor, at::Tensor> addmm_bwd_cpu(
    const at::Tensor& dy, const std::optional<at::Tensor>& preact, const at::Tensor& mat1, const at::Tensor& mat2,
    int64_t activation, bool need_dx, bool need_dw, bool dw_transposed, bool need_db, at::ScalarType db_dtype) {
  // The at::mm calls inside must not be re-cast by an enclosing torch.autocast (the Python API already cast).
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  check_addmm_args(std::nullopt, mat1, mat2, activation);
  const int64_t M = mat1.size(0), N = mat2.size(1);
  const at::ScalarType T = mat1.scalar_type();
  TORCH_CHECK(dy.dim() == 2 && dy.size(0) == M && dy.size(1) == N, "fused_mlp: dy must be [", M, ", ", N,
              "], got ", dy.sizes());
  TORCH_CHECK(dy.scalar_type() == T || dy.scalar_type() == at::kFloat, "fused_mlp: dy dtype must be float32 or ",
              T, ", got ", dy.scalar_type());
  TORCH_CHECK(is_float_type(db_dtype), "fused_mlp: db_dtype must be a float dtype");
  const int act = static_cast<int>(activation);
  if (act != 0)
    TORCH_CHECK(preact.has_value() && preact->dim() == 2 && preact->size(0) == M && preact->size(1) == N &&
                    preact->scalar_type() == T,
                "fused_mlp: the saved pre-activation must be [", M, ", ", N, "] ", T);

  // dZ in fp32 (contiguous [M, N]).
  at::Tensor dz;
  if (act == 0) {
    dz = dy.to(at::kFloat).contiguous();
  } else {
    dz = at::empty({M, N}, dy.options().dtype(at::kFloat));
    const at::Tensor dyc = dy.stride(-1) == 1 || N <= 1 ? dy : dy.contiguous();
    const at::Tensor zc = preact->stride(-1) == 1 || N <= 1 ? *preact : preact->contiguous();
    float* dz_p = dz.data_ptr<float>();
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(N, 1));
    at::parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> zr(N);
      for (int64_t r = begin; r < end; ++r) {
        float* d = dz_p + r * N;
        load_row(row_ptr(dyc, r), dyc.scalar_type(), d, N);
        load_row(row_ptr(zc, r), T, zr.data(), N);
        for (int64_t i = 0; i < N; ++i) d[i] *= act_grad(act, zr[i]);
      }
    });
  }

  at::Tensor db = at::empty({need_db ? N : 0}, mat1.options().dtype(db_dtype));
  if (need_db && N > 0) {
    // Column sums in a fixed row order per column (deterministic whatever the thread count), accumulated in
    // fp64: this pass is memory-bound, so the wider accumulator is free and db is rounded once.
    std::vector<double> sums(N, 0.0);
    const float* dz_p = dz.const_data_ptr<float>();
    constexpr int64_t kCols = 256;
    at::parallel_for(0, (N + kCols - 1) / kCols, 1, [&](int64_t begin, int64_t end) {
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
      sums32[c] = db_dtype == at::kFloat ? static_cast<float>(sums[c]) : round_to_odd_f32(sums[c]);
    store_row(sums32.data(), db_dtype, db.data_ptr(), N);
  }

  at::Tensor dx = at::empty({0}, mat1.options()), dw = at::empty({0}, mat1.options());
  if (need_dx) dx = at::mm(dz, mat2.to(at::kFloat).t()).to(T).contiguous();
  if (need_dw) {
    const at::Tensor x32 = mat1.to(at::kFloat);
    dw = (dw_transposed ? at::mm(dz.t(), x32) : at::mm(x32.t(), dz)).to(T).contiguous();
  }
  return {dx, dw, db};
}
