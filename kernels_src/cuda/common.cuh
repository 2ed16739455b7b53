// Shared device helpers for the fused-mlp CUDA kernels: scalar conversions (fp32 math, one rounding on store),
// warp/block reductions, dtype dispatch and launch checks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>

#include "torch_compat.h"

#if defined(FUSED_MLP_STABLE_ABI)
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/macros.h>
#else
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

// A CUDA runtime call that must succeed, and the check after a kernel launch (torch's error text either way).
#if defined(FUSED_MLP_STABLE_ABI)
#define FM_CUDA_CHECK(EXPR) STD_CUDA_CHECK(EXPR)
#define FM_KERNEL_LAUNCH_CHECK() STD_CUDA_KERNEL_LAUNCH_CHECK()
#else
#define FM_CUDA_CHECK(EXPR) C10_CUDA_CHECK(EXPR)
#define FM_KERNEL_LAUNCH_CHECK() C10_CUDA_KERNEL_LAUNCH_CHECK()
#endif

namespace fused_mlp::cuda {

// Makes `t`'s device current for the scope (the caller's device is restored at exit).
class DeviceGuard {
 public:
  explicit DeviceGuard(const Tensor& t)
#if defined(FUSED_MLP_STABLE_ABI)
      : guard_(t.get_device_index()) {
  }
#else
      : guard_(t.device()) {
  }
#endif

 private:
#if defined(FUSED_MLP_STABLE_ABI)
  torch::stable::accelerator::DeviceGuard guard_;
#else
  c10::cuda::CUDAGuard guard_;
#endif
};

// torch's current stream on `t`'s device (kernels run there: graph capture and user streams work).
inline cudaStream_t current_stream(const Tensor& t) {
#if defined(FUSED_MLP_STABLE_ABI)
  void* s = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(t.get_device_index(), &s));
  return static_cast<cudaStream_t>(s);
#else
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
#endif
}

// Error-message helpers (the stable ABI has no printers for devices): a device as torch prints it, "cuda:0".
inline std::string device_str(const Tensor& t) {
#if defined(FUSED_MLP_STABLE_ABI)
  // c10's lower-case DeviceType names, in enum order.
  static constexpr const char* kNames[] = {"cpu",  "cuda", "mkldnn", "opengl", "opencl", "ideep", "hip",
                                           "fpga", "maia", "xla",    "vulkan", "metal",  "xpu",   "mps",
                                           "meta", "hpu",  "ve",     "lazy",   "ipu",    "mtia",  "privateuseone"};
  const auto dev = t.device();
  const int type = static_cast<int>(dev.type());
  std::string s = type >= 0 && type < static_cast<int>(sizeof(kNames) / sizeof(kNames[0])) ? kNames[type] : "unknown";
  if (dev.has_index()) s += ":" + std::to_string(static_cast<int>(dev.index()));
  return s;
#else
  std::ostringstream os;
  os << t.device();
  return os.str();
#endif
}

inline int device_index(const Tensor& t) {
#if defined(FUSED_MLP_STABLE_ABI)
  return static_cast<int>(t.get_device_index());
#else
  return static_cast<int>(t.device().index());
#endif
}

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Element j of a run of packed 16-byte units, as fp32, read from its 32-bit word: one instruction per element
// for bf16 (a shift or a mask: bf16 is the top half of an fp32) and fp16 (one cvt), where element-wise access
// to a T[] view made nvcc extract 16-bit halves with 64-bit funnel shifts (two instructions per element, in
// the SASS of the rms_norm kernels). j must be a compile-time constant after unrolling.
__device__ __forceinline__ uint32_t unit_word(const uint4* u, int k) {
  const uint4& q = u[k >> 2];
  switch (k & 3) {
    case 0: return q.x;
    case 1: return q.y;
    case 2: return q.z;
    default: return q.w;
  }
}

template <typename T>
__device__ __forceinline__ float unit_elem(const uint4* u, int j) {
  if constexpr (std::is_same_v<T, float>) {
    return __uint_as_float(unit_word(u, j));
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const uint32_t w = unit_word(u, j >> 1);
    return __uint_as_float((j & 1) ? (w & 0xffff0000u) : (w << 16));
  } else {
    const uint32_t w = unit_word(u, j >> 1);
    const __half h = __ushort_as_half(static_cast<unsigned short>((j & 1) ? (w >> 16) : (w & 0xffffu)));
    return __half2float(h);
  }
}

__device__ __forceinline__ float warp_reduce_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over the block; every thread gets the result. `scratch` holds >= 32 floats; blockDim.x % 32 == 0.
__device__ __forceinline__ float block_reduce_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_reduce_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? scratch[lane] : 0.f;
  return warp_reduce_sum(v);
}

// Both CUDA tensors, on one device.
inline bool same_cuda_device(const Tensor& a, const Tensor& b) {
  return a.is_cuda() && b.is_cuda() && device_index(a) == device_index(b);
}

// Host: the device type behind a torch float dtype.
template <typename F>
void dispatch_float(ScalarType t, const char* what, F&& f) {
  switch (t) {
    case ScalarType::Float: f(float{}); break;
    case ScalarType::Half: f(__half{}); break;
    case ScalarType::BFloat16: f(__nv_bfloat16{}); break;
    default: FM_CHECK(false, "fused_mlp: ", what, " has unsupported dtype ", t);
  }
}

// Host: dispatch a dtype that must be either `Base` or float32 (keeps instantiations few).
template <typename Base, typename F>
void dispatch_base_or_float(ScalarType t, const char* what, F&& f) {
  if (t == kFloat) {
    f(float{});
    return;
  }
  bool ok = false;
  dispatch_float(t, what, [&](auto tag) {
    if constexpr (std::is_same_v<decltype(tag), Base>) {
      ok = true;
      f(Base{});
    }
  });
  FM_CHECK(ok, "fused_mlp: ", what, " dtype ", t, " must be float32 or the input's dtype");
}

inline int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// Host: blocks of `threads` threads (and `smem` bytes of dynamic shared memory) of `kernel` resident at once on one
// SM of the current device `device` (the occupancy API; cached, a query costs microseconds). At least 1.
inline int resident_blocks_per_sm(const void* kernel, int device, int threads, size_t smem = 0) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, int, size_t>, int> cache;
  const auto key = std::make_tuple(kernel, device, threads, smem);
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  int per_sm = 0;
  FM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  per_sm = per_sm > 0 ? per_sm : 1;
  std::lock_guard<std::mutex> lock(mu);
  cache[key] = per_sm;
  return per_sm;
}

// Host: the ",<key>=<int>" value of a tuning knob's string (`absent` when the key is not there or its value is not a
// number: "wpre=on" must not read as 0).
inline int knob_value(const std::string& s, const char* key, int absent) {
  const std::string pat = std::string(",") + key + "=";
  const size_t at = s.find(pat);
  if (at == std::string::npos) return absent;
  const char* begin = s.c_str() + at + pat.size();
  char* end = nullptr;
  const long v = std::strtol(begin, &end, 10);
  return end == begin ? absent : static_cast<int>(v);
}

// Host: whether a tuning knob whose value at its first read was `first` is re-read at every call (a getenv per call,
// for benchmarks and tests that switch knobs between calls in one process): its value then started with "dynamic", or
// FUSED_MLP_KNOBS_DYNAMIC=1 (itself read once: set it before the first kernel call). Otherwise a knob is read once
// per process, and a later change of the variable has no effect.
inline bool knob_dynamic(const char* first) {
  static const bool all = [] {
    const char* e = std::getenv("FUSED_MLP_KNOBS_DYNAMIC");
    return e != nullptr && e[0] == '1';
  }();
  return all || (first != nullptr && std::strncmp(first, "dynamic", 7) == 0);
}

// Host: the switch of a "few rows" (decode-class) path, from an environment variable read once per process
// (knob_dynamic: at every call):
//   "auto" (or unset / unknown): the launcher's measured threshold | "on": wherever the path applies | "off": never;
//   an optional ",<key>=<int>" tuning value (e.g. "on,packs=2"; 0 when absent).
struct SmallKnob {
  enum Mode { kAuto, kOn, kOff };
  Mode mode = kAuto;
  int value = 0;
};

class SmallKnobReader {
 public:
  SmallKnobReader(const char* var, const char* key) : var_(var), key_(key) {
    const char* e = std::getenv(var);
    dynamic_ = knob_dynamic(e);
    fixed_ = parse(e);
  }
  SmallKnob get() const { return dynamic_ ? parse(std::getenv(var_)) : fixed_; }

 private:
  SmallKnob parse(const char* e) const {
    SmallKnob k;
    if (e == nullptr) return k;
    const std::string s(e);
    const std::string head = s.substr(0, s.find(','));
    if (head == "on") k.mode = SmallKnob::kOn;
    else if (head == "off") k.mode = SmallKnob::kOff;
    k.value = knob_value(s, key_, 0);
    return k;
  }
  const char* var_;
  const char* key_;
  bool dynamic_ = false;
  SmallKnob fixed_;
};

}  // namespace fused_mlp::cuda
