// The gated MLP's activations, for host code of both backends (kernels_src/cpu/geglu.cpp, kernels_src/cuda/
// gated_act.cuh): the enum, the op argument's spelling, and the switch from a runtime value to a compile-time one.
// The math itself is per backend (CPU: vectorisable fp32 with or without FMA; CUDA: MUFU forms for 16-bit outputs).
#pragma once

#include <string>
#include <string_view>
#include <type_traits>

#include "torch_binding.h"

namespace fused_mlp {

enum class Act { kGeluTanh, kGeluErf, kSilu };

// The ops' `activation` string (anything with data() and size(): std::string_view, the binding's StrArg).
template <typename S>
Act parse_activation(const S& s) {
  const std::string_view v(s.data(), s.size());
  if (v == "gelu_tanh") return Act::kGeluTanh;
  if (v == "gelu") return Act::kGeluErf;
  if (v == "silu") return Act::kSilu;
  FM_CHECK(false, "fused_mlp: activation must be 'gelu_tanh', 'gelu' or 'silu', got '", std::string(v), "'");
}

// f(std::integral_constant<Act, a>{}): one instantiation per activation.
template <typename F>
void dispatch_act(Act a, F&& f) {
  switch (a) {
    case Act::kGeluTanh: f(std::integral_constant<Act, Act::kGeluTanh>{}); break;
    case Act::kGeluErf: f(std::integral_constant<Act, Act::kGeluErf>{}); break;
    case Act::kSilu: f(std::integral_constant<Act, Act::kSilu>{}); break;
  }
}

}  // namespace fused_mlp
