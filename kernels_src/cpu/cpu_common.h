// Shared helpers for the CPU kernels: row loads/stores between fp32 scratch rows and fp32/fp16/bf16 storage.
// Kernels convert a row (or a chunk of it) to fp32 once, do all math in fp32, and round once on store; the
// loops are plain and unit-stride so the compiler vectorises them.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>

#include "torch_compat.h"

namespace fused_mlp::cpu {

template <typename T>
inline void load_f32(const T* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
inline void store_from_f32(const float* __restrict src, T* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// Row access by runtime dtype (one switch per row, not per element).
inline void load_row(const void* src, ScalarType t, float* dst, int64_t n) {
  switch (t) {
    case kFloat: load_f32(static_cast<const float*>(src), dst, n); break;
    case kHalf: load_f32(static_cast<const Half*>(src), dst, n); break;
    case kBFloat16: load_f32(static_cast<const BFloat16*>(src), dst, n); break;
    default: FM_CHECK(false, "fused_mlp: unsupported dtype ", t);
  }
}

inline void store_row(const float* src, ScalarType t, void* dst, int64_t n) {
  switch (t) {
    case kFloat: store_from_f32(src, static_cast<float*>(dst), n); break;
    case kHalf: store_from_f32(src, static_cast<Half*>(dst), n); break;
    case kBFloat16: store_from_f32(src, static_cast<BFloat16*>(dst), n); break;
    default: FM_CHECK(false, "fused_mlp: unsupported dtype ", t);
  }
}

inline const char* row_ptr(const Tensor& t, int64_t row) {
  return static_cast<const char*>(t.const_data_ptr()) + row * t.stride(0) * t.element_size();
}

inline char* row_ptr_mut(const Tensor& t, int64_t row) {
  return static_cast<char*>(t.data_ptr()) + row * t.stride(0) * t.element_size();
}

using fused_mlp::shape_str;  // "[2, 3]" in error messages (torch_compat.h)

// Which copy of the vectorised loops this CPU runs (x86-64 kernels are compiled for the baseline ISA, AVX2+FMA and
// AVX-512 and pick one at run time; each kernel file adds the extra features its own copies need, e.g. the norms'
// F16C and AVX512_BF16). Chosen once per process: FUSED_MLP_CPU_BASELINE=1 forces the baseline copy and
// FUSED_MLP_CPU_NO_AVX512=1 the AVX2 one (read once, at the first call), so the tests run every copy on an AVX-512
// machine. kAvx512 means AVX-512 F, VL, BW and DQ. Other targets: kBase (their kernels decide what that runs).
enum class CpuLevel { kBase, kAvx2, kAvx512 };

// A switch variable is on when set to 1, true, yes or on (any case); unset, empty, 0 or anything else: off.
inline bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return false;
  std::string s(v);
  for (char& c : s) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  return s == "1" || s == "true" || s == "yes" || s == "on";
}

#if defined(__x86_64__) || defined(_M_X64)
inline CpuLevel cpu_level() {
  static const CpuLevel level = [] {
    __builtin_cpu_init();
    if (env_flag("FUSED_MLP_CPU_BASELINE") || !__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
      return CpuLevel::kBase;
    }
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
    return avx512 && !env_flag("FUSED_MLP_CPU_NO_AVX512") ? CpuLevel::kAvx512 : CpuLevel::kAvx2;
  }();
  return level;
}
#else
constexpr CpuLevel cpu_level() { return CpuLevel::kBase; }
#endif

inline bool is_float_type(ScalarType t) {
  return t == kFloat || t == kHalf || t == kBFloat16;
}

// 2-D, unit stride along the last dim, floating dtype. Python checks first; this keeps the C++ entry safe.
inline void check_rows(const Tensor& t, const char* name) {
  FM_CHECK(t.dim() == 2, "fused_mlp: ", name, " must be 2-D [rows, hidden], got ", t.dim(), "-D");
  FM_CHECK(t.size(1) <= 1 || t.stride(1) == 1, "fused_mlp: ", name, " must have unit stride along hidden");
  FM_CHECK(is_float_type(t.scalar_type()), "fused_mlp: ", name, " must be float32/float16/bfloat16, got ",
           t.scalar_type());
}

}  // namespace fused_mlp::cpu
