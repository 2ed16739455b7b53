// Shared device helpers for the fused-mlp CUDA kernels: scalar conversions (fp32 math, one rounding on store),
// warp/block reductions, dtype dispatch and launch checks.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace fused_mlp::cuda {

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

// Host: the device type behind an ATen float dtype.
template <typename F>
void dispatch_float(at::ScalarType t, const char* what, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(__half{}); break;
    case at::kBFloat16: f(__nv_bfloat16{}); break;
    default: TORCH_CHECK(false, "fused_mlp: ", what, " has unsupported dtype ", t);
  }
}

// Host: dispatch a dtype that must be either `Base` or float32 (keeps instantiations few).
template <typename Base, typename F>
void dispatch_base_or_float(at::ScalarType t, const char* what, F&& f) {
  if (t == at::kFloat) {
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
  TORCH_CHECK(ok, "fused_mlp: ", what, " dtype ", t, " must be float32 or the input's dtype");
}

inline int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

}  // namespace fused_mlp::cuda
