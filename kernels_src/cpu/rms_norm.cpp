// RMSNorm on the CPU: y = h * rsqrt(mean(h^2) + eps) * (offset + w), h = x (+ residual, rounded to h's dtype).
// x, residual, dy, dh_extra: [M, N] (unit stride along N, any row stride); weight: [N]; y, h, dx: [M, N]
// contiguous; rstd: [M] fp32. fp32 math, one rounding per output.
//
// The row kernels (rms_norm_rows.h) are compiled three times — AVX-512 with BF16, AVX2+FMA+F16C and baseline
// x86-64 (no FMA: last-bit differences) — and one is picked once at run time from the CPU's features (GCC function
// multi-versioning done by hand, so the fast copies use F16C and AVX-512 without lifting the module's baseline
// ISA). Rows are spread over torch's thread pool. dW: a fixed number of row chunks (independent of the thread
// count), one fp32 partial row each, summed in a fixed order -> bitwise reproducible.
// The F16C copy matters (generic code, even auto-vectorised, was several times slower in bf16/fp16): timings vs
// transformers' LlamaRMSNorm in docs/tuning-log.md#rmsnorm-cpu.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define FUSED_MLP_HAVE_AVX2_COPY 1
#endif

#include "cpu/cpu_common.h"
#include "torch_binding.h"

// Baseline copy.
#define FUSED_MLP_ROWS_NS base
#define FUSED_MLP_ROWS_AVX2 0
#define FUSED_MLP_ROWS_AVX512BF16 0
#include "cpu/rms_norm_rows.h"
#undef FUSED_MLP_ROWS_AVX512BF16
#undef FUSED_MLP_ROWS_AVX2
#undef FUSED_MLP_ROWS_NS

#if defined(FUSED_MLP_HAVE_AVX2_COPY)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define FUSED_MLP_ROWS_NS avx2
#define FUSED_MLP_ROWS_AVX2 1
#define FUSED_MLP_ROWS_AVX512BF16 0
#include "cpu/rms_norm_rows.h"
#undef FUSED_MLP_ROWS_AVX512BF16
#undef FUSED_MLP_ROWS_AVX2
#undef FUSED_MLP_ROWS_NS
#pragma GCC pop_options
// AVX-512 (VL, BW, DQ) with BF16: the AVX2 copy with one-instruction bf16 stores (0.75-0.9x the time of bf16 rows).
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512bf16")
#define FUSED_MLP_ROWS_NS avx512
#define FUSED_MLP_ROWS_AVX2 1
#define FUSED_MLP_ROWS_AVX512BF16 1
#include "cpu/rms_norm_rows.h"
#undef FUSED_MLP_ROWS_AVX512BF16
#undef FUSED_MLP_ROWS_AVX2
#undef FUSED_MLP_ROWS_NS
#pragma GCC pop_options
#endif

namespace fused_mlp::cpu {
namespace {

// The copy this CPU runs, chosen once: cpu_level() (cpu_common.h: the CPU's features and the environment variables
// that force the lesser copies), and the AVX2 copy needs F16C too, the AVX-512 one AVX512_BF16 (else: the AVX2 copy).
CpuLevel cpu_isa() {
#if defined(FUSED_MLP_HAVE_AVX2_COPY)
  static const CpuLevel isa = [] {
    const CpuLevel level = cpu_level();
    if (level == CpuLevel::kBase || !__builtin_cpu_supports("f16c")) return CpuLevel::kBase;
    if (level == CpuLevel::kAvx512 && !__builtin_cpu_supports("avx512bf16")) return CpuLevel::kAvx2;
    return level;
  }();
  return isa;
#else
  return CpuLevel::kBase;
#endif
}

// Tag dispatch over the three float dtypes.
template <typename F>
void dispatch_cpu(ScalarType t, const char* what, F&& f) {
  switch (t) {
    case kFloat: f(float{}); break;
    case kHalf: f(Half{}); break;
    case kBFloat16: f(BFloat16{}); break;
    default: FM_CHECK(false, "fused_mlp: ", what, " has unsupported dtype ", t);
  }
}

// (offset + w) in fp32, or null when there is no weight (or n == 0). Not zero-filled first: load_row writes it all.
std::unique_ptr<float[]> scale_row(const std::optional<Tensor>& weight, double offset, int64_t n) {
  if (!weight.has_value() || n == 0) return nullptr;
  auto w = std::make_unique_for_overwrite<float[]>(n);
  load_row(weight->const_data_ptr(), weight->scalar_type(), w.get(), n);
  const float off = static_cast<float>(offset);
  for (int64_t i = 0; i < n; ++i) w[i] += off;
  return w;
}

// The rows of a [M, N] tensor (unit stride along N): its data pointer and row stride, read once before the
// parallel loops (in the stable-ABI build every Tensor accessor is a call through torch's C shim).
template <typename T>
struct RowsOf {
  T* base;
  int64_t stride;
  T* operator()(int64_t r) const { return base + r * stride; }
};

template <typename T>
RowsOf<const T> rows_of(const Tensor& t) {
  return {static_cast<const T*>(t.const_data_ptr()), t.stride(0)};
}

// Rows per parallel task: ~32K elements of work per task keeps the pool busy without per-row overhead.
int64_t row_grain(int64_t N) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(N, 1)); }

// dW row chunks: a function of M and N only (never of the thread count), so dW is reproducible.
constexpr int64_t kMaxDwChunks = 64;

}  // namespace
}  // namespace fused_mlp::cpu

using namespace fused_mlp::cpu;

namespace {
// The forward's outputs: h only with a residual, rstd only where the caller keeps it (not the inference entries:
// docs/tuning-log.md#host-path).
struct FwdOut {
  Tensor y;
  std::optional<Tensor> h, rstd;
};

FwdOut rms_norm_fwd_impl(const Tensor& x_in, const std::optional<Tensor>& residual_in,
                         const std::optional<Tensor>& weight, double eps, double offset, ScalarType out_dtype,
                         std::optional<ScalarType> residual_dtype, bool keep_rstd) {
  // [..., N] inputs are viewed as [M, N] rows here (a C++ view is far cheaper than a Python reshape); outputs
  // take x's shape.
  FM_CHECK(x_in.dim() >= 1, "fused_mlp: x must have at least one dimension [..., N]");
  const Tensor x = fused_mlp::as_rows_view(x_in);
  const std::optional<Tensor> residual =
      residual_in.has_value() ? std::optional<Tensor>(fused_mlp::as_rows_view(*residual_in)) : std::nullopt;
  check_rows(x, "x");
  const int64_t M = x.size(0), N = x.size(1);
  const ScalarType xt = x.scalar_type();
  // dtypes before the empty-input return below, as the CUDA op checks them: an empty x is no exception
  FM_CHECK(xt == kFloat || xt == kHalf || xt == kBFloat16, "fused_mlp: x must be float32/float16/bfloat16");
  const ScalarType h_dtype = residual_dtype.value_or(xt);
  FM_CHECK(h_dtype == xt || h_dtype == kFloat, "fused_mlp: residual_dtype must be x's dtype or float32");
  FM_CHECK(out_dtype == xt || out_dtype == kFloat, "fused_mlp: out_dtype must be x's dtype or float32");
  if (residual.has_value()) {
    check_rows(*residual, "residual");
    FM_CHECK(fused_mlp::sizes_of(*residual_in) == fused_mlp::sizes_of(x_in), "fused_mlp: residual shape ",
             shape_str(*residual_in), " != x shape ", shape_str(x_in));
    FM_CHECK(residual->scalar_type() == h_dtype, "fused_mlp: residual dtype must equal residual_dtype");
  }
  if (weight.has_value()) {
    FM_CHECK(weight->dim() == 1 && weight->size(0) == N && weight->is_contiguous(),
             "fused_mlp: weight must be contiguous [", N, "]");
    FM_CHECK(weight->scalar_type() == xt || weight->scalar_type() == kFloat,
             "fused_mlp: weight must be x's dtype or float32");
  }
  const fused_mlp::Sizes out_sizes = fused_mlp::sizes_of(x_in);
  FwdOut out{fused_mlp::empty(out_sizes, out_dtype, x), std::nullopt, std::nullopt};
  if (residual.has_value()) out.h = fused_mlp::empty(out_sizes, h_dtype, x);
  if (keep_rstd) out.rstd = fused_mlp::empty({M}, kFloat, x);
  if (M == 0) return out;

  const std::unique_ptr<float[]> w = scale_row(weight, offset, N);
  const float* s = w.get();
  const float feps = static_cast<float>(eps);
  float* rstd_p = keep_rstd ? static_cast<float*>(out.rstd->data_ptr()) : nullptr;
  const bool has_res = residual.has_value();
  const CpuLevel isa = cpu_isa();
  void* const y_p = out.y.data_ptr();
  void* const h_p = has_res ? out.h->data_ptr() : nullptr;

  dispatch_cpu(xt, "x", [&](auto xtag) {
    using TX = decltype(xtag);
    auto go = [&](auto htag, auto otag) {
      using TH = decltype(htag);
      using TO = decltype(otag);
      const RowsOf<const TX> x_rows = rows_of<TX>(x);
      const RowsOf<const TH> res_rows = has_res ? rows_of<TH>(*residual) : RowsOf<const TH>{nullptr, 0};
      const TX* x0 = x_rows(0);
      const TH* r0 = res_rows(0);
      TH* h0 = static_cast<TH*>(h_p);
      TO* y0 = static_cast<TO*>(y_p);
      // Overlap the passes of neighbouring rows for fp32 x (memory-bound); 16-bit x spends its time converting and
      // runs a row at a time (docs/tuning-log.md#rmsnorm-cpu).
      constexpr bool kOverlap = std::is_same_v<TX, float>;
      auto rows = [&](auto scale, auto res, int64_t begin, int64_t end) {
        constexpr bool kScale = decltype(scale)::value, kRes = decltype(res)::value;
#if defined(FUSED_MLP_HAVE_AVX2_COPY)
        if (isa == CpuLevel::kAvx512) {
          avx512::fwd_rows<kOverlap, kScale, kRes>(x0, x_rows.stride, r0, res_rows.stride, h0, s, y0, rstd_p, begin,
                                                   end, N, feps);
          return;
        }
        if (isa == CpuLevel::kAvx2) {
          avx2::fwd_rows<kOverlap, kScale, kRes>(x0, x_rows.stride, r0, res_rows.stride, h0, s, y0, rstd_p, begin,
                                                 end, N, feps);
          return;
        }
#endif
        base::fwd_rows<kOverlap, kScale, kRes>(x0, x_rows.stride, r0, res_rows.stride, h0, s, y0, rstd_p, begin, end,
                                               N, feps);
      };
      fused_mlp::parallel_for(0, M, row_grain(N), [&](int64_t begin, int64_t end) {
        using T = std::true_type;
        using F = std::false_type;
        if (s != nullptr) {
          has_res ? rows(T{}, T{}, begin, end) : rows(T{}, F{}, begin, end);
        } else {
          has_res ? rows(F{}, T{}, begin, end) : rows(F{}, F{}, begin, end);
        }
      });
    };
    auto with_out = [&](auto htag) {
      if (out_dtype == kFloat) {
        go(htag, float{});
      } else {
        go(htag, TX{});
      }
    };
    if (has_res && h_dtype == kFloat) {
      with_out(float{});
    } else {
      with_out(TX{});
    }
  });
  return out;
}
}  // namespace

std::tuple<Tensor, Tensor, Tensor> rms_norm_fwd_cpu(
    const Tensor& x, const std::optional<Tensor>& residual, const std::optional<Tensor>& weight,
    double eps, double offset, ScalarType out_dtype, std::optional<ScalarType> residual_dtype) {
  FwdOut out = rms_norm_fwd_impl(x, residual, weight, eps, offset, out_dtype, residual_dtype, true);
  Tensor h = out.h.has_value() ? *out.h : fused_mlp::empty({0}, x.scalar_type(), x);
  return {out.y, h, *out.rstd};
}

std::tuple<Tensor, Tensor> rms_norm_bwd_cpu(
    const Tensor& dy, const Tensor& h, const Tensor& rstd, const std::optional<Tensor>& weight,
    const std::optional<Tensor>& dh_extra, double offset, ScalarType dx_dtype, bool compute_dw) {
  check_rows(dy, "dy");
  check_rows(h, "h");
  const int64_t M = h.size(0), N = h.size(1);
  FM_CHECK(fused_mlp::sizes_of(dy) == fused_mlp::sizes_of(h), "fused_mlp: dy shape ", shape_str(dy),
           " != h shape ", shape_str(h));
  FM_CHECK(rstd.dim() == 1 && rstd.size(0) == M && rstd.scalar_type() == kFloat && rstd.is_contiguous(),
           "fused_mlp: rstd must be contiguous float32 [", M, "]");
  FM_CHECK(is_float_type(dx_dtype), "fused_mlp: dx dtype must be float32/float16/bfloat16, got ", dx_dtype);
  if (dh_extra.has_value()) {
    check_rows(*dh_extra, "dh_extra");
    FM_CHECK(fused_mlp::sizes_of(*dh_extra) == fused_mlp::sizes_of(h), "fused_mlp: dh_extra shape ",
             shape_str(*dh_extra), " != ", shape_str(h));
  }
  if (weight.has_value()) {
    FM_CHECK(weight->dim() == 1 && weight->size(0) == N && weight->is_contiguous(),
             "fused_mlp: weight must be contiguous [", N, "]");
  }
  const bool want_dw = compute_dw && weight.has_value();
  Tensor dx = fused_mlp::empty({M, N}, dx_dtype, h);
  Tensor dw = want_dw ? fused_mlp::empty({N}, weight->scalar_type(), *weight)
                      : fused_mlp::empty({0}, h.scalar_type(), h);
  if (M == 0 || N == 0) {
    if (want_dw) fused_mlp::zero_(dw);
    return {dx, dw};
  }

  const std::unique_ptr<float[]> w = scale_row(weight, offset, N);
  const float* s = w.get();
  const float* rstd_p = static_cast<const float*>(rstd.const_data_ptr());
  const bool has_extra = dh_extra.has_value();
  const CpuLevel isa = cpu_isa();
  // Fixed chunking (independent of the thread count) keeps dW bitwise reproducible; a chunk has >= the row grain.
  const int64_t chunks = want_dw ? std::min<int64_t>(kMaxDwChunks, (M + row_grain(N) - 1) / row_grain(N)) : 0;
  const int64_t rows_per_chunk = want_dw ? (M + chunks - 1) / chunks : 0;
  std::vector<float> partial(want_dw ? chunks * N : 0, 0.f);

  // Every tensor is float32 or one common 16-bit "base" dtype (the same rule as the CUDA kernels).
  const ScalarType dtypes[] = {dx_dtype, h.scalar_type(), dy.scalar_type(),
                               has_extra ? dh_extra->scalar_type() : kFloat};
  ScalarType base_t = kFloat;
  for (ScalarType t : dtypes)
    if (t != kFloat) base_t = t;
  for (ScalarType t : dtypes) {
    FM_CHECK(t == kFloat || t == base_t, "fused_mlp: rms_norm_bwd mixes 16-bit dtypes (", t, " and ", base_t,
             "); each of dx, h, dy, dh_extra must be float32 or one common 16-bit dtype");
  }
  void* const dx_p = dx.data_ptr();

  dispatch_cpu(base_t, "h", [&](auto btag) {
    using TB = decltype(btag);
    auto pick = [](ScalarType t, auto&& f) {
      if (t == kFloat) {
        f(float{});
      } else {
        f(TB{});
      }
    };
    pick(h.scalar_type(), [&](auto htag) {
      using TH = decltype(htag);
      pick(dy.scalar_type(), [&](auto dtag) {
        using TD = decltype(dtag);
        pick(dx_dtype, [&](auto xtag) {
          using TX = decltype(xtag);
          pick(has_extra ? dh_extra->scalar_type() : kFloat, [&](auto etag) {
            using TE = decltype(etag);
            const RowsOf<const TH> h_rows = rows_of<TH>(h);
            const RowsOf<const TD> dy_rows = rows_of<TD>(dy);
            const RowsOf<const TE> e_rows = has_extra ? rows_of<TE>(*dh_extra) : RowsOf<const TE>{nullptr, 0};
            auto rows = [&](int64_t begin, int64_t end, float* acc) {
              for (int64_t r = begin; r < end; ++r) {
                const TH* hr = h_rows(r);
                const TD* dr = dy_rows(r);
                const TE* er = has_extra ? e_rows(r) : nullptr;
                TX* xr = static_cast<TX*>(dx_p) + r * N;
#if defined(FUSED_MLP_HAVE_AVX2_COPY)
                if (isa == CpuLevel::kAvx512) {
                  avx512::bwd_row<TH, TD, TE, TX>(hr, dr, rstd_p[r], s, er, xr, acc, N);
                  continue;
                }
                if (isa == CpuLevel::kAvx2) {
                  avx2::bwd_row<TH, TD, TE, TX>(hr, dr, rstd_p[r], s, er, xr, acc, N);
                  continue;
                }
#endif
                base::bwd_row<TH, TD, TE, TX>(hr, dr, rstd_p[r], s, er, xr, acc, N);
              }
            };
            if (want_dw) {
              fused_mlp::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
                for (int64_t c = cb; c < ce; ++c)
                  rows(c * rows_per_chunk, std::min(M, (c + 1) * rows_per_chunk), partial.data() + c * N);
              });
            } else {
              fused_mlp::parallel_for(0, M, row_grain(N), [&](int64_t b, int64_t e) { rows(b, e, nullptr); });
            }
          });
        });
      });
    });
  });

  if (want_dw) {
    dispatch_cpu(dw.scalar_type(), "weight", [&](auto wtag) {
      using TW = decltype(wtag);
      TW* out = static_cast<TW*>(dw.data_ptr());
      fused_mlp::parallel_for(0, N, 4096, [&](int64_t b, int64_t e) {
#if defined(FUSED_MLP_HAVE_AVX2_COPY)
        if (isa == CpuLevel::kAvx512) {
          avx512::sum_columns<TW>(partial.data(), chunks, N, b, e, out);
          return;
        }
        if (isa == CpuLevel::kAvx2) {
          avx2::sum_columns<TW>(partial.data(), chunks, N, b, e, out);
          return;
        }
#endif
        base::sum_columns<TW>(partial.data(), chunks, N, b, e, out);
      });
    });
  }
  return {dx, dw};
}

// Inference entry points: the forward above, returning y (and h) only and storing no rstd. Fewer outputs through the
// op boundary and fewer allocations are the saving (each output boxed, wrapped and freed by Python;
// docs/tuning-log.md#host-path); the kernel is the same.
Tensor rms_norm_infer_cpu(const Tensor& x, const std::optional<Tensor>& weight, double eps, double offset,
                          bool out_f32) {
  return rms_norm_fwd_impl(x, std::nullopt, weight, eps, offset, out_f32 ? kFloat : x.scalar_type(), std::nullopt,
                           false).y;
}

std::tuple<Tensor, Tensor> rms_norm_add_infer_cpu(const Tensor& x, const Tensor& residual,
                                                  const std::optional<Tensor>& weight, double eps, double offset,
                                                  bool out_f32) {
  FwdOut out = rms_norm_fwd_impl(x, residual, weight, eps, offset, out_f32 ? kFloat : x.scalar_type(),
                                 residual.scalar_type(), false);
  return {out.y, *out.h};
}
