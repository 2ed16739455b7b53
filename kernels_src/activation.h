// The activations of every op, for host code of both backends: one enum, the ops' `activation` strings, and the
// switch from a runtime value to a compile-time one. Gated ops (geglu_fwd/bwd, gated_gemm_*: kernels_src/cpu/
// geglu.cpp, kernels_src/cuda/gated_act.cuh) take "gelu_tanh" | "gelu" | "silu"; the GEMM epilogue of addmm
// (kernels_src/{cpu,cuda}/addmm.*) takes "none" | "gelu_tanh" | "gelu". The math itself is per backend (CPU:
// vectorisable fp32 with or without FMA; CUDA: MUFU forms for 16-bit outputs). Python spells the same names once, in
// torch-ext/fused_mlp/_common.py.
#pragma once

#include <string>
#include <string_view>
#include <type_traits>

#include "torch_binding.h"

namespace fused_mlp {

// The values are addmm's activation codes (its kernels switch on the int).
enum class Act { kNone = 0, kGeluTanh = 1, kGeluErf = 2, kSilu = 3 };

inline Act act_from_name(std::string_view v, bool* ok) {
  *ok = true;
  if (v == "gelu_tanh") return Act::kGeluTanh;
  if (v == "gelu") return Act::kGeluErf;
  if (v == "silu") return Act::kSilu;
  if (v == "none") return Act::kNone;
  *ok = false;
  return Act::kNone;
}

// A gated op's `activation` (anything with data() and size(): std::string_view, the binding's StrArg).
template <typename S>
Act parse_activation(const S& s) {
  const std::string_view v(s.data(), s.size());
  bool ok = false;
  const Act a = act_from_name(v, &ok);
  FM_CHECK(ok && a != Act::kNone, "fused_mlp: activation must be 'gelu_tanh', 'gelu' or 'silu', got '",
           std::string(v), "'");
  return a;
}

// addmm's epilogue activation.
template <typename S>
Act parse_epilogue_activation(const S& s) {
  const std::string_view v(s.data(), s.size());
  bool ok = false;
  const Act a = act_from_name(v, &ok);
  FM_CHECK(ok && a != Act::kSilu, "fused_mlp: activation must be 'none', 'gelu_tanh' or 'gelu', got '",
           std::string(v), "'");
  return a;
}

// f(std::integral_constant<Act, a>{}): one instantiation per gated activation (parse_activation never yields kNone).
template <typename F>
void dispatch_act(Act a, F&& f) {
  switch (a) {
    case Act::kGeluTanh: f(std::integral_constant<Act, Act::kGeluTanh>{}); break;
    case Act::kGeluErf: f(std::integral_constant<Act, Act::kGeluErf>{}); break;
    case Act::kSilu: f(std::integral_constant<Act, Act::kSilu>{}); break;
    case Act::kNone: FM_CHECK(false, "fused_mlp: a gated activation is required"); break;
  }
}

}  // namespace fused_mlp
