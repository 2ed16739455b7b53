// fused-mlp: the few torch C++ facilities the kernels use, spelled once for both builds of the same sources.
//
//  * the per-torch variants (`torch<XY>-cxx11-*`): the classic ATen/c10 API;
//  * the stable-ABI variant (`torch-stable-abi210-*`, compiled with TORCH_TARGET_VERSION = 2.10): torch's stable C
//    shim through torch/csrc/stable and torch/headeronly only, so one binary loads under every torch >= 2.10.
//
// Kernels write `Tensor`, `ScalarType`, `kFloat`, `FM_CHECK(...)`, `fused_mlp::empty(...)`, `fused_mlp::mm_out(...)`
// etc. and never name at::/c10:: or torch::stable:: themselves. Call the functions qualified: in the classic build
// an unqualified call with at::Tensor arguments also finds ATen's functions of the same name (argument-dependent
// lookup) and can be ambiguous. CUDA-only helpers (device guard, current
// stream, launch checks) are in kernels_src/cuda/common.cuh.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#if defined(TORCH_TARGET_VERSION)
#define FUSED_MLP_STABLE_ABI 1
#endif

#if defined(FUSED_MLP_STABLE_ABI)
#include <torch/csrc/stable/c/shim.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/stableivalue_conversions.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Exception.h>
#include <torch/headeronly/util/Half.h>
#if __has_include(<torch/csrc/stable/macros.h>)
#include <torch/csrc/stable/macros.h>
#endif
#if __has_include(<torch/headeronly/util/shim_utils.h>)
#include <torch/headeronly/util/shim_utils.h>
#endif

#include <array>

// torch 2.10 / 2.11 headers have only the header-only TORCH_ERROR_CODE_CHECK; STABLE_TORCH_ERROR_CODE_CHECK (the same
// check, with the shim's error text in the exception) came later. One source builds against either.
#if !defined(STABLE_TORCH_ERROR_CODE_CHECK)
#define STABLE_TORCH_ERROR_CODE_CHECK(call) TORCH_ERROR_CODE_CHECK(call)
#endif

// torch/csrc/stable/macros.h looks up newer shim functions with dlsym; glibc >= 2.34 versions that symbol
// GLIBC_2.34, above manylinux_2_28. Bind to the baseline version every x86-64 glibc exports.
#if defined(__x86_64__) && defined(__GLIBC__)
__asm__(".symver dlsym,dlsym@GLIBC_2.2.5");
#endif
#else
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/core/ScalarType.h>
#include <c10/core/SymIntArrayRef.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <c10/util/string_view.h>
#endif

namespace fused_mlp {

#if defined(FUSED_MLP_STABLE_ABI)
using Tensor = torch::stable::Tensor;
using ScalarType = torch::headeronly::ScalarType;
using Half = torch::headeronly::Half;
using BFloat16 = torch::headeronly::BFloat16;
using StrArg = std::string;          // a schema `str` argument
using ShapeArg = std::vector<int64_t>;  // a schema `int[]` argument
#define FM_CHECK(cond, ...) STD_TORCH_CHECK(cond, __VA_ARGS__)
#else
using Tensor = at::Tensor;
using ScalarType = at::ScalarType;
using Half = c10::Half;
using BFloat16 = c10::BFloat16;
using StrArg = c10::string_view;
using ShapeArg = c10::SymIntArrayRef;  // `SymInt[]`: torch.compile keeps token counts symbolic
#define FM_CHECK(cond, ...) TORCH_CHECK(cond, __VA_ARGS__)
#endif

inline constexpr ScalarType kFloat = ScalarType::Float;
inline constexpr ScalarType kHalf = ScalarType::Half;
inline constexpr ScalarType kBFloat16 = ScalarType::BFloat16;
inline constexpr ScalarType kDouble = ScalarType::Double;

using Sizes = std::vector<int64_t>;

// ---- tensors -----------------------------------------------------------------------------------------------

// A new contiguous tensor on `like`'s device.
inline Tensor empty(const Sizes& sizes, ScalarType dtype, const Tensor& like) {
#if defined(FUSED_MLP_STABLE_ABI)
  // One direct shim call (CPU: empty_strided_cpu; else at::empty_strided). torch::stable::new_empty goes through
  // torch_call_dispatcher: an op lookup by name and a boxed call per tensor, ~1 us each (docs/tuning-log.md#host-path).
  const int64_t nd = static_cast<int64_t>(sizes.size());
  int64_t strides[16];
  std::vector<int64_t> strides_heap;
  int64_t* st = strides;
  if (nd > 16) {
    strides_heap.resize(static_cast<size_t>(nd));
    st = strides_heap.data();
  }
  int64_t step = 1;
  for (int64_t d = nd - 1; d >= 0; --d) {  // torch's contiguous strides (a 0 or 1 size counts as 1)
    st[d] = step;
    step *= sizes[d] > 1 ? sizes[d] : 1;
  }
  int32_t device_type = 0;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(like.get(), &device_type));
  const int32_t aoti_dtype = torch::stable::detail::to<int32_t>(torch::stable::detail::from(dtype));
  AtenTensorHandle out = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(nd, sizes.data(), st, aoti_dtype, device_type,
                                                         static_cast<int32_t>(like.get_device_index()), &out));
  return Tensor(out);
#else
  return at::empty(sizes, like.options().dtype(dtype));
#endif
}

inline Tensor zeros(const Sizes& sizes, ScalarType dtype, const Tensor& like) {
#if defined(FUSED_MLP_STABLE_ABI)
  return torch::stable::new_zeros(like, sizes, dtype);
#else
  return at::zeros(sizes, like.options().dtype(dtype));
#endif
}

inline Tensor contiguous(const Tensor& t) {
#if defined(FUSED_MLP_STABLE_ABI)
  return torch::stable::contiguous(t);
#else
  return t.contiguous();
#endif
}

// The 2-D transpose (a view).
inline Tensor transposed(const Tensor& t) {
#if defined(FUSED_MLP_STABLE_ABI)
  return torch::stable::transpose(t, 0, 1);
#else
  return t.t();
#endif
}

inline Tensor clone(const Tensor& t) {
#if defined(FUSED_MLP_STABLE_ABI)
  return torch::stable::clone(t);
#else
  return t.clone();
#endif
}

inline Tensor to_dtype(const Tensor& t, ScalarType dtype) {
#if defined(FUSED_MLP_STABLE_ABI)
  return torch::stable::to(t, dtype);
#else
  return t.to(dtype);
#endif
}

inline Tensor view(const Tensor& t, const Sizes& sizes) {
#if defined(FUSED_MLP_STABLE_ABI)
  return torch::stable::view(t, sizes);
#else
  return t.view(sizes);
#endif
}

inline Tensor reshape(const Tensor& t, const Sizes& sizes) {
#if defined(FUSED_MLP_STABLE_ABI)
  return torch::stable::reshape(t, sizes);
#else
  return t.reshape(sizes);
#endif
}

// [..., N] -> [M, N] (a view whenever the strides allow; the Python side passes 2-D views or contiguous tensors).
inline Tensor as_rows_view(const Tensor& t) {
  if (t.dim() == 2) return t;
  int64_t m = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) m *= t.size(d);
  const int64_t n = t.size(t.dim() - 1);
#if defined(FUSED_MLP_STABLE_ABI)
  if (t.is_contiguous()) {
    // A plain alias with the row shape (one shim call); reshape is a boxed dispatcher call by name (~1 us).
    const int64_t sizes[2] = {m, n};
    const int64_t strides[2] = {n, 1};
    AtenTensorHandle out = nullptr;
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch__reinterpret_tensor(t.get(), 2, sizes, strides, 0, &out));
    return Tensor(out);
  }
#endif
  return fused_mlp::reshape(t, {m, n});
}

inline void zero_(Tensor& t) {
#if defined(FUSED_MLP_STABLE_ABI)
  torch::stable::zero_(t);
#else
  t.zero_();
#endif
}

inline Sizes sizes_of(const Tensor& t) {
  Sizes s(static_cast<size_t>(t.dim()));
  for (int64_t d = 0; d < t.dim(); ++d) s[d] = t.size(d);
  return s;
}

// out = a @ b (2-D), into an existing tensor, never re-cast by an enclosing torch.autocast (the Python layer has
// already cast the operands; `mm.out` is on none of autocast's lists, and the classic build also excludes the
// autocast keys for the call).
// Grad mode is off for the call: the ops have no autograd formula of their own, so an exported program (or any
// direct call) may hand them inputs that require grad, and mm.out refuses those in grad mode; nothing here is
// differentiated.
inline void mm_out(Tensor& out, const Tensor& a, const Tensor& b) {
#if defined(FUSED_MLP_STABLE_ABI)
  struct NoGrad {
    const bool was = aoti_torch_grad_mode_is_enabled();
    NoGrad() { if (was) aoti_torch_grad_mode_set_enabled(false); }
    ~NoGrad() { if (was) aoti_torch_grad_mode_set_enabled(true); }
  } no_grad;
  std::array<StableIValue, 3> stack{torch::stable::detail::from(a), torch::stable::detail::from(b),
                                    torch::stable::detail::from(out)};
  STABLE_TORCH_ERROR_CODE_CHECK(torch_call_dispatcher("aten::mm", "out", stack.data(), TORCH_ABI_VERSION));
  // The dispatcher returns `out` as a new owning handle in stack[0]: take it and let it go (else it leaks).
  (void)torch::stable::detail::to<torch::stable::Tensor>(stack[0]);
#else
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  c10::AutoGradMode no_grad(false);
  at::mm_out(out, a, b);
#endif
}

// a @ b (2-D) in the operands' dtype, as mm_out.
inline Tensor mm(const Tensor& a, const Tensor& b) {
  Tensor out = fused_mlp::empty({a.size(0), b.size(1)}, a.scalar_type(), a);
  fused_mlp::mm_out(out, a, b);
  return out;
}

// ---- CPU threading -------------------------------------------------------------------------------------------

template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
#if defined(FUSED_MLP_STABLE_ABI)
  torch::stable::parallel_for(begin, end, grain, f);
#else
  at::parallel_for(begin, end, grain, f);
#endif
}

inline int64_t num_threads() {
#if defined(FUSED_MLP_STABLE_ABI)
  return static_cast<int64_t>(torch::stable::get_num_threads());
#else
  return static_cast<int64_t>(at::get_num_threads());
#endif
}

// ---- aliasing checks -----------------------------------------------------------------------------------------

// `a` and `b` must not share memory (an output and an input of one op, or the in-place operands). As ATen's
// assert_no_overlap: decided for contiguous tensors (their byte ranges), not for strided views (too hard to
// decide cheaply; ATen lets those pass as well).
inline void check_no_overlap(const Tensor& a, const Tensor& b, const char* what) {
#if defined(FUSED_MLP_STABLE_ABI)
  // One tensor passed twice (ATen: full overlap, checked first), then dense operands by byte range.
  FM_CHECK(a.numel() == 0 || b.numel() == 0 || a.const_data_ptr() != b.const_data_ptr() ||
               fused_mlp::sizes_of(a) != fused_mlp::sizes_of(b) || a.stride(a.dim() - 1) != b.stride(b.dim() - 1) ||
               a.dim() != b.dim() || [&] {
                 for (int64_t d = 0; d < a.dim(); ++d)
                   if (a.stride(d) != b.stride(d)) return true;
                 return false;
               }(),
           "fused_mlp: ", what,
           ": unsupported operation: some elements of the input tensor and the written-to tensor refer to a single "
           "memory location");
  if (!a.is_contiguous() || !b.is_contiguous()) return;
  auto span = [](const Tensor& t) -> std::pair<uintptr_t, uintptr_t> {
    if (t.numel() == 0) return {0, 0};
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    const auto lo = reinterpret_cast<uintptr_t>(t.const_data_ptr());
    return {lo, lo + static_cast<uintptr_t>((last + 1) * static_cast<int64_t>(t.element_size()))};
  };
  const auto [a0, a1] = span(a);
  const auto [b0, b1] = span(b);
  FM_CHECK(a0 == a1 || b0 == b1 || a1 <= b0 || b1 <= a0, "fused_mlp: ", what,
           ": unsupported operation: some elements of the input tensor and the written-to tensor refer to a single "
           "memory location");
#else
  (void)what;
  at::assert_no_overlap(a, b);
#endif
}

// No element of `t` is reachable through two indices (e.g. an expanded, stride-0 view) — it is written to.
inline void check_no_internal_overlap(const Tensor& t, const char* what) {
#if defined(FUSED_MLP_STABLE_ABI)
  for (int64_t d = 0; d < t.dim(); ++d) {
    FM_CHECK(t.size(d) <= 1 || t.stride(d) != 0, "fused_mlp: ", what,
             ": unsupported operation: more than one element of the written-to tensor refers to a single memory "
             "location");
  }
#else
  (void)what;
  at::assert_no_internal_overlap(t);
#endif
}

// ---- warnings -------------------------------------------------------------------------------------------------

// A Python UserWarning (the classic build: TORCH_WARN, which torch turns into one; the stable build: through the
// Python C API, defined in torch_binding.cpp).
void warn(const std::string& message);

// ---- small helpers ---------------------------------------------------------------------------------------------

inline bool same_device(const Tensor& a, const Tensor& b) {
#if defined(FUSED_MLP_STABLE_ABI)
  return a.is_cuda() == b.is_cuda() && a.is_cpu() == b.is_cpu() && a.get_device_index() == b.get_device_index();
#else
  return a.device() == b.device();
#endif
}

inline bool same_shape(const Tensor& a, const Tensor& b) { return fused_mlp::sizes_of(a) == fused_mlp::sizes_of(b); }

// "[2, 3]" for error messages.
inline std::string shape_str(const Sizes& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

inline std::string shape_str(const Tensor& t) { return fused_mlp::shape_str(fused_mlp::sizes_of(t)); }

// ---- schema `int[]` / `SymInt[]` arguments -------------------------------------------------------------------

inline Sizes shape_arg(const ShapeArg& shape) {
#if defined(FUSED_MLP_STABLE_ABI)
  return shape;
#else
  Sizes out;
  out.reserve(shape.size());
  for (const auto& s : shape) out.push_back(s.expect_int());
  return out;
#endif
}

}  // namespace fused_mlp
