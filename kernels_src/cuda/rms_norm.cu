// RMSNorm on CUDA: y = h * rsqrt(mean(h^2) + eps) * (offset + w), h = x (+ residual, rounded to h's dtype).
// x, residual: [..., N] (viewed as [M, N] rows: unit stride along N, any row stride, any alignment); dy, dh_extra:
// [M, N]; weight, dw: [N]; y, h, dx: contiguous; rstd: [M] fp32. fp32 math, one rounding per output, any N >= 0.
//
// Kernels (`pick` logic in the host launchers below, one table for all of them):
//   fwd small — few rows (decode): one row group per block, no loop; aligned rows of whole packs, N <= 16384 (bf16)
//               / 8192 (fp32), M up to a measured limit per N (FUSED_MLP_RMS_NORM_SMALL; section "few rows" below).
//   fwd reg   — ALIGNED rows of whole packs (the default for them, any M): the row (or its cluster slice) in registers,
//               PACKS (compile-time) 16-byte packs per thread, all loads issued before any use, one predicate per pack,
//               non-persistent grid of many resident CTAs; rows per CTA for short rows; on sm_90+ rows beyond one
//               CTA split over a cluster of 2..8 CTAs (partial sums through distributed smem). Table below.
//   fwd l2    — sm_90, M >= 1024 16-bit rows of 32768..65536 elements (aligned, weight and y of x's dtype, no
//               fp32 stream), ahead of reg: one row per 512-thread CTA at a time, two passes, the second from L2
//               (x read with an L2 evict-last hint in the first).
//   fwd rows  — a thread owns fixed 16-byte packs of its row ("columns") and holds them in registers; `rpb` rows
//               per block for short rows; persistent grid (SMs x resident blocks) looping over row groups; the
//               next row group is cp.async'd into dynamic smem while the current one is reduced and written
//               (registers + smem = a double buffer), whenever it fits and some block has a next group.
//   fwd wide  — rows beyond the register budget, one row per block iteration: the row is cached in dynamic smem
//               when it fits (one HBM read), else re-read from global (L2) in a second pass.
//   bwd reg   — aligned rows (16-byte pointers / strides, N % VEC == 0), the default on sm_90 for 16-bit h and dy (or
//               fp32 x): 4 packs per thread, persistent grid, dW partial sums in REGISTERS, rows beyond one CTA split
//               over a cluster (kernels_src/cuda/rms_norm_bwd.cuh; FUSED_MLP_RMS_NORM_BWD = auto | reg | legacy).
//   bwd small — few rows (M <= 128, 256 for rows of >= 8 KB; aligned rows of <= 2048 packs; rms_norm_bwd.cuh; FUSED_MLP_RMS_NORM_BWD_SMALL):
//               one launch, dx CTAs (the forward's few-rows layout) beside dW CTAs (column slices over all rows).
//   bwd rows  — ONE pass over the rows (the rest of the rows path): persistent grid; per row the row dot product, dx, and dW partial sums in
//               smem owned by the thread (same columns every row); next row group prefetched; at the end the
//               block sums its row slots in a fixed order and writes one fp32 partial row (or dW when grid == 1).
//   bwd wide  — rows beyond that: two passes per row (the second from L2); dW partial row in smem when it fits,
//               else in the block's global fp32 partial row.
//   dW column sum — fixed-order sum of the partial rows into the weight dtype (no atomics: bitwise reproducible).
// Access: 16-byte vector loads/stores when every base pointer and row stride is 16-byte aligned; otherwise (odd
// N, sliced views) the same kernels take per-element loads (`vec_ok` = false): correct for any layout.
//
// Config table. VEC = 8 elements per 16-byte pack for bf16/fp16 x, 4 for fp32; NV = ceil(N / VEC).
//   packs per thread ITERS: NV <= 32 -> 1 | <= 128 -> 2 | <= 1024 (fwd) / 2048 (bwd) -> 4 | <= 4096 -> 8 | else 16
//   threads per row tpr = ceil(NV / ITERS), a power of two below 32, else a multiple of 32, <= 512;
//   rows per block rpb = 256 / tpr (>= 1), lowered for small M so a short batch spreads over all SMs.
//   -> bf16 fwd: N <= 256: 1 pack, 1..32 threads/row, 8..256 rows/block | N = 2048: 4 packs x 64 threads x 4 rows |
//      4096: 4 x 128 x 2 | 8192: 4 x 256 | 16384: 8 x 256 | 32768: 8 x 512 | 65536: 16 x 512 | > 65536: wide.
//   Register budget (both rows kernels: __launch_bounds__(512, 1) = 128 regs/thread):
//     fwd holds ITERS packs of h: 16 B each -> ITERS = 16 is 64 regs of data; fp32 h with a 16-bit x doubles
//       them -> ITERS <= 8.  Rows path: N <= 65536 (bf16/fp16), 32768 (fp32 or an fp32 residual stream).
//     bwd holds h and dy packs: ITERS * VEC * (|h| + |dy|) / 4 <= 64 regs -> 16-bit h and dy: ITERS <= 8; one
//       of them fp32: 4; both fp32 with a 16-bit x: 4 (VEC 8) ; fp32 x: 8.  dW partials are in smem.
//   bwd reg (rms_norm_bwd.cuh): 4 packs of h and dy per thread + 4 * VEC fp32 dW sums: 128 registers, 0 spills,
//     <= 512 threads per CTA; dW smem only at the end (rpb * N * 4, short rows); partial rows = grid (or clusters).
//   No kernel spills on sm_80 / sm_90 (ptxas registers per kernel: docs/tuning-log.md#rmsnorm-registers). The
//     per-pack addresses are kept out of the row loop's hoisting with `opaque()` (without it ITERS >= 8 spills).
//     sm_100 / sm_120 spill in some rows variants: the host reads each kernel's localSizeBytes on the running
//     device and takes fewer packs per thread, or the wide kernel, instead of a spilling variant.
//   Shared memory, checked against cudaDevAttrMaxSharedMemoryPerBlockOptin (minus 1 KB) for the actual N before
//   every launch; a configuration that does not fit is never launched (prefetch / caching is switched off,
//   the rows-path bwd falls to the wide kernel, whose zero-smem form always fits):
//     fwd prefetch rpb * NV * (16 + residual pack bytes) | bwd rows: dW rpb * N * 4 (+ prefetch rpb * NV * VEC *
//     (|h| + |dy| + |dh|)) | fwd wide cache NV * VEC * |h| | bwd wide dW N * 4 | static 256 B (reductions).
//   e.g. H200 (132 SMs, 227 KB): bf16 fwd N=4096, M>=4096: 256 threads, 4 blocks/SM, 16 KB prefetch, grid 528;
//   N=65536: 512 threads, 1 block/SM, 128 KB prefetch; bwd N=4096: 256 threads, 2 blocks/SM, 64 KB smem, 264
//   partial rows; N=16384: 512 threads, 1 block/SM, 128 KB smem; N=65536: wide, dW partials in global (these are
//   the rows / wide kernels: on sm_90 the bwd reg kernel takes 16-bit rows instead).
// Reg family (rms_norm_fwd_reg_kernel, reg_config; FUSED_MLP_RMS_NORM_FWD = auto | reg | legacy | l2 | lean
// [,cluster=C] [,packs=P] [,ctas=K] [,wpre=0|1] [,ld=0|1]: see FwdKnob below):
//   pmax = packs per thread with <= 8 loaded 16-byte units (x + residual): 8 | residual of x's dtype 4 | fp32
//   stream under 16-bit x 2.  NV <= 32 pmax: packs = fewest powers of two filling a warp, tpr <= 32, 256-thread CTAs
//   of 256 / tpr rows (fewer while M < 32 SMs x rows); pmax 4 and NV <= 256: 1 pack, tpr = NV in whole warps, one
//   row per CTA; NV <= 512 pmax: pmax packs, tpr = NV / pmax in whole warps,
//   256 / tpr rows when tpr is a power of two <= 128; beyond, sm_90+: clusters of C = 2/4/8 CTAs (the fewest of
//   <= 256 threads, else 8 of <= 512), each ceil(NV / C) packs; else (sm < 90, NV > 4096 pmax) rows / wide.
//   -> bf16, no residual: N <= 256: 1 pack, 1..32 thr/row | 512: 2 | 1024: 4 | N 1032..6144: on sm_90 4 packs (2048:
//      4 x 64 x 4 rows | 4096: 4 x 128 x 2 | 5376: 4 x 192), on other GPUs the table (2048: 8 x 32, warp/row, 8 rows |
//      4096: 8 x 64 x 4 rows | 5376: 8 x 96) | 8192: 8 x 128 x 2 (sm_90, M >= 1024, a weight and y of x's dtype,
//      with or without a residual of x's dtype: the lean kernel below) | 16384: 8 x 256 (sm_90, M >= 8192: 4 x 512) |
//      32768: 8 x 512 |
//      65536: cluster 4 x (8 x 256) | 131072: 8 x (8 x 256) | 262144: 8 x (8 x 512) | fp32 x: up to 131072.
//   Registers (ptxas sm_90, CUDA 13.0, __launch_bounds__(512), 0 spills, docs/tuning-log.md#rmsnorm-reg-config):
//     bf16 x, packs 1/2/4/8: 31/40/56/76 (4 with the weight loaded with the row: 59); residual same dtype 1/2/4:
//     32/40/54 (58); fp32 stream 1/2: 32/50; fp32 x 1/2/4/8: 31/30/56/64; fp32 residual 1/2/4: 31/40/54 (cuobjdump
//     of build cd0db93606, nvcc 13.0 here; a device-side build once read 87 at 8 packs).  Smem: < 128 B static.
//     -> 256-thread CTAs: 3 (76 regs) .. 8 resident per SM, >= 64 KB of loads in flight per SM at P = 8.
//   Every config launches: <= 512 threads x <= 128 registers fit an SM; a cluster launches only when
//   cudaOccupancyMaxActiveClusters > 0 and a variant that spills on the running device is skipped (else rows/wide).
// These thresholds come from the budget arithmetic above, checked on the H200 with the knobs below; the persistent
// prefetching grid beat every variant tried. Limit today: instruction issue, not DRAM. Conversions read 32-bit
// words (Pack::f, one instruction per bf16 element instead of two). -- docs/tuning-log.md#rmsnorm-cuda-config
// Lean kernel (rms_norm_fwd_lean_kernel): the reg kernel without its generality for one row class -- 16-bit rows of
//   exactly P x T packs, one row per CTA, 32 registers at P <= 2 (4 CTAs of 512 per SM); sm_90 auto: N = 8192 as 2 x
//   512 (M >= 1024, a weight and y of x's dtype, with or without a residual of x's dtype). Row loads: evict-first
//   below kKeepLoadsMinRows* (4096 rows for 16-bit rows of 8192..16384), the default cache policy from there (the reg kernel
//   too, on sm_90)
//   -- docs/tuning-log.md#rmsnorm-lean.
// FUSED_MLP_RMS_NORM_TUNE (read once per process) overrides a few choices for that sweep, e.g.
//   "fwd_prefetch=0,bwd_prefetch=0,wide_threads=256,bwd_dw_smem=0,fwd_iters=4,bwd_iters=2".
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <string>
#include <type_traits>
#include <unordered_map>

#include "cuda/common.cuh"
#include "torch_binding.h"

namespace fused_mlp::cuda {
namespace {

// ---- 16-byte packs -------------------------------------------------------------------------------------

// VEC consecutive elements of one row, moved as one or two 16-byte units.
template <typename T, int VEC>
struct Pack {
  static_assert((sizeof(T) * VEC) % 16 == 0, "a pack is a whole number of 16-byte units");
  static constexpr int kUnits = static_cast<int>(sizeof(T) * VEC / 16);
  union {
    uint4 u[kUnits];
    T v[VEC];
  };
  __device__ __forceinline__ float f(int j) const { return unit_elem<T>(u, j); }  // element j as fp32
};

enum class Ld { Stream, Keep, ReadOnly };  // evict-first (read once) / default / read-only cache (weights)

template <Ld P>
__device__ __forceinline__ uint4 ld16(const uint4* p) {
  if constexpr (P == Ld::Stream) {
    return __ldcs(p);
  } else if constexpr (P == Ld::ReadOnly) {
    return __ldg(p);
  } else {
    return *p;
  }
}

template <typename T>
__device__ __forceinline__ T zero() { return from_float<T>(0.f); }

// Pack at columns [col, col + VEC) of `row`; columns >= n read as 0. Vector access only when `vec_ok`.
template <Ld P, typename T, int VEC>
__device__ __forceinline__ void load_pack(Pack<T, VEC>& p, const T* __restrict__ row, int col, int n,
                                          bool vec_ok) {
  if (vec_ok && col + VEC <= n) {
    const uint4* src = reinterpret_cast<const uint4*>(row + col);
#pragma unroll
    for (int k = 0; k < Pack<T, VEC>::kUnits; ++k) p.u[k] = ld16<P>(src + k);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) p.v[j] = col + j < n ? row[col + j] : zero<T>();
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void store_pack(T* __restrict__ row, int col, int n, bool vec_ok,
                                           const Pack<T, VEC>& p) {
  if (vec_ok && col + VEC <= n) {
    uint4* dst = reinterpret_cast<uint4*>(row + col);
#pragma unroll
    for (int k = 0; k < Pack<T, VEC>::kUnits; ++k) dst[k] = p.u[k];
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j)
      if (col + j < n) row[col + j] = p.v[j];
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void store_floats(T* __restrict__ row, int col, int n, bool vec_ok,
                                             const float (&f)[VEC]) {
  Pack<T, VEC> p;
#pragma unroll
  for (int j = 0; j < VEC; ++j) p.v[j] = from_float<T>(f[j]);
  store_pack(row, col, n, vec_ok, p);
}

// Outputs and side inputs whose dtype is picked at run time: float32 or the base (x) dtype TB. The branch is
// uniform across the grid; it keeps the number of instantiations down.
template <typename TB, int VEC>
__device__ __forceinline__ void store_floats_rt(void* row, bool f32, int col, int n, bool vec_ok,
                                                const float (&f)[VEC]) {
  if (f32) {
    store_floats<float, VEC>(static_cast<float*>(row), col, n, vec_ok, f);
  } else {
    store_floats<TB, VEC>(static_cast<TB*>(row), col, n, vec_ok, f);
  }
}

// One whole, aligned pack of VEC outputs at element col of row: float32 when f32, else rounded once to TB. No bounds
// check: the aligned-row kernels only call it for packs inside the row.
template <typename TB, int VEC>
__device__ __forceinline__ void store_full_pack_rt(void* row, bool f32, int col, const float (&f)[VEC]) {
  if (f32) {
    Pack<float, VEC> p;
#pragma unroll
    for (int j = 0; j < VEC; ++j) p.v[j] = f[j];
    uint4* dst = reinterpret_cast<uint4*>(static_cast<float*>(row) + col);
#pragma unroll
    for (int k = 0; k < Pack<float, VEC>::kUnits; ++k) dst[k] = p.u[k];
  } else {
    Pack<TB, VEC> p;
#pragma unroll
    for (int j = 0; j < VEC; ++j) p.v[j] = from_float<TB>(f[j]);
    uint4* dst = reinterpret_cast<uint4*>(static_cast<TB*>(row) + col);
#pragma unroll
    for (int k = 0; k < Pack<TB, VEC>::kUnits; ++k) dst[k] = p.u[k];
  }
}

template <Ld P, typename TB, int VEC>
__device__ __forceinline__ void load_floats_rt(float (&f)[VEC], const void* row, bool f32, int col, int n,
                                               bool vec_ok) {
  if (f32) {
    Pack<float, VEC> p;
    load_pack<P>(p, static_cast<const float*>(row), col, n, vec_ok);
#pragma unroll
    for (int j = 0; j < VEC; ++j) f[j] = p.v[j];
  } else {
    Pack<TB, VEC> p;
    load_pack<P>(p, static_cast<const TB*>(row), col, n, vec_ok);
#pragma unroll
    for (int j = 0; j < VEC; ++j) f[j] = p.f(j);
  }
}

// (offset + w) in fp32 for one pack (1 without a weight). Weights are re-read from L1 for every row.
template <typename TB, int VEC>
__device__ __forceinline__ void load_scale(float (&s)[VEC], const void* w, bool w_f32, float offset, int col,
                                           int n, bool vec_ok) {
  if (w == nullptr) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) s[j] = 1.f;
    return;
  }
  load_floats_rt<Ld::ReadOnly, TB, VEC>(s, w, w_f32, col, n, vec_ok);
#pragma unroll
  for (int j = 0; j < VEC; ++j) s[j] = offset + s[j];
}

// ---- cp.async (sm_80+): global -> shared without registers --------------------------------------------------

__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src, int src_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_bytes)
               : "memory");
#else
  __trap();  // the host never enables prefetch below sm_80
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void cp_async_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// Pack at [col, col + VEC) -> its smem slot; bytes past the row end are zero-filled. Needs 16-byte alignment.
template <typename T, int VEC>
__device__ __forceinline__ void prefetch_pack(Pack<T, VEC>* slot, const T* row, int col, int n) {
  const int left = (n - col) * static_cast<int>(sizeof(T));
  const char* src = reinterpret_cast<const char*>(row + col);
#pragma unroll
  for (int k = 0; k < Pack<T, VEC>::kUnits; ++k) {
    const int rem = left - 16 * k;
    const int bytes = rem >= 16 ? 16 : (rem > 0 ? rem : 0);
    cp_async16(&slot->u[k], bytes > 0 ? src + 16 * k : reinterpret_cast<const char*>(row), bytes);
  }
}

// ---- row reduction ---------------------------------------------------------------------------------------

// Sum over the `tpr` consecutive threads that share a row (tpr: a power of two <= 32, or a multiple of 32).
// Every thread of the row gets the bitwise same value (butterfly + fixed-order combine). All threads of the
// block must call it (it may hold a barrier). `scratch`: 64 floats, double-buffered by `parity`, so one
// barrier per call suffices: a buffer is rewritten only after the next call's barrier.
__device__ __forceinline__ float row_reduce_sum(float v, int tpr, float* scratch, int& parity) {
  const int width = tpr < 32 ? tpr : 32;
  for (int o = width >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (tpr <= 32) return v;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* s = scratch + parity * 32;
  parity ^= 1;
  if (lane == 0) s[warp] = v;
  __syncthreads();
  const int wpr = tpr >> 5, first = (warp / wpr) * wpr;
  float t = 0.f;
  for (int k = 0; k < wpr; ++k) t += s[first + k];
  return t;
}

template <int VEC>
__device__ __forceinline__ float sum_vec(const float (&a)[VEC]) {
  float t = 0.f;
#pragma unroll
  for (int j = 0; j < VEC; ++j) t += a[j];
  return t;
}

// Per-pack addresses and bounds are loop-invariant across the row loop; left alone, the compiler hoists all
// ITERS of each out of it and spills (ptxas: 128 regs + 600 B spills at ITERS=8). An opaque copy of the
// thread's (tpr, lane) at the top of each use keeps them local: 80 regs, no spills (see header).
__device__ __forceinline__ void opaque(int& tpr, int& lane) { asm volatile("" : "+r"(tpr), "+r"(lane)); }

// ---- forward -----------------------------------------------------------------------------------------------

struct FwdArgs {
  const void* x;          // [M, N] x dtype, row stride x_stride (elements)
  int64_t x_stride;
  const void* res;        // [M, N] h dtype, or null
  int64_t res_stride;
  void* h;                // [M, N] contiguous, h dtype (written with a residual), or null
  const void* w;          // [N] x dtype or fp32, or null
  void* y;                // [M, N] contiguous, x dtype or fp32
  float* rstd;            // [M], or null (inference entries: not stored)
  int64_t M, N;
  float eps, offset;
  int tpr, rpb;           // rows kernel: threads per row, rows per block (blockDim.x == tpr * rpb)
  bool w_f32, y_f32;
  bool vec_ok;            // every base pointer and row stride is 16-byte aligned
  bool prefetch;          // rows kernel: next row group cp.async'd into dynamic smem
  bool cache;             // wide kernel: row cached in dynamic smem
};

template <typename TX, typename TH>
__device__ __forceinline__ char* y_row(const FwdArgs& a, int64_t row) {
  return static_cast<char*>(a.y) + row * a.N * (a.y_f32 ? 4 : static_cast<int64_t>(sizeof(TX)));
}

// TX: x dtype; TH: h dtype (== TX without residual). ITERS packs per thread held in registers.
template <typename TX, typename TH, bool RES, int ITERS>
__global__ void __launch_bounds__(512, 1) rms_norm_fwd_rows_kernel(const FwdArgs a) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(TX));
  using XPack = Pack<TX, VEC>;
  using HPack = Pack<TH, VEC>;
  static_assert(RES || std::is_same_v<TX, TH>, "without a residual h is x");
  extern __shared__ uint4 dyn_smem[];
  __shared__ float red[64];

  const int64_t M = a.M;
  const int N = static_cast<int>(a.N), NV = (N + VEC - 1) / VEC;
  const int tpr0 = a.tpr, lane0 = threadIdx.x % tpr0, rib = threadIdx.x / tpr0;
  const int64_t groups = (M + a.rpb - 1) / a.rpb;
  XPack* x_slot = reinterpret_cast<XPack*>(dyn_smem) + rib * NV;  // prefetch slots: x packs, then residual
  HPack* r_slot = reinterpret_cast<HPack*>(reinterpret_cast<XPack*>(dyn_smem) + a.rpb * NV) + rib * NV;

  auto issue = [&](int64_t g) {  // cp.async this thread's packs of row group g
    int tpr = tpr0, lane = lane0;
    opaque(tpr, lane);
    const int64_t row = g * a.rpb + rib;
    if (row < M) {
      const TX* xr = static_cast<const TX*>(a.x) + row * a.x_stride;
      const TH* rr = RES ? static_cast<const TH*>(a.res) + row * a.res_stride : nullptr;
#pragma unroll
      for (int i = 0; i < ITERS; ++i) {
        const int v = lane + i * tpr;
        if (v < NV) {
          prefetch_pack(x_slot + v, xr, v * VEC, N);
          if constexpr (RES) prefetch_pack(r_slot + v, rr, v * VEC, N);
        }
      }
    }
    cp_async_commit();
  };

  int parity = 0;
  int64_t g = blockIdx.x;
  if (a.prefetch && g < groups) issue(g);
  for (; g < groups; g += gridDim.x) {
    int tpr = tpr0, lane = lane0;
    opaque(tpr, lane);
    const int64_t row = g * a.rpb + rib;
    const bool valid = row < M;
    HPack hv[ITERS];
    float ssv[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) ssv[j] = 0.f;
    if (a.prefetch) cp_async_wait_all();  // own slots only: no barrier needed
    {
      const TX* xr = static_cast<const TX*>(a.x) + (valid ? row : 0) * a.x_stride;
      const TH* rr = RES ? static_cast<const TH*>(a.res) + (valid ? row : 0) * a.res_stride : nullptr;
      TH* hr = RES ? static_cast<TH*>(a.h) + (valid ? row : 0) * a.N : nullptr;
#pragma unroll
      for (int i = 0; i < ITERS; ++i) {
        const int v = lane + i * tpr;
        if (valid && v < NV) {
          XPack xp;
          if (a.prefetch) {
            xp = x_slot[v];
          } else {
            load_pack<Ld::Stream>(xp, xr, v * VEC, N, a.vec_ok);
          }
          if constexpr (RES) {
            HPack rp;
            if (a.prefetch) {
              rp = r_slot[v];
            } else {
              load_pack<Ld::Stream>(rp, rr, v * VEC, N, a.vec_ok);
            }
#pragma unroll
            for (int j = 0; j < VEC; ++j) hv[i].v[j] = from_float<TH>(xp.f(j) + rp.f(j));
            // The residual stream carries h rounded to its dtype; exactly that value is normalised below.
            store_pack(hr, v * VEC, N, a.vec_ok, hv[i]);
          } else {
            hv[i] = xp;
          }
        } else {
#pragma unroll
          for (int j = 0; j < VEC; ++j) hv[i].v[j] = zero<TH>();
        }
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float f = hv[i].f(j);
          ssv[j] += f * f;
        }
      }
    }
    // The slots were consumed into registers (ssv depends on every one of them): refill them with the next
    // row group now, so its loads are in flight while this group is reduced and written.
    if (a.prefetch && g + gridDim.x < groups) issue(g + gridDim.x);
    const float ss = row_reduce_sum(sum_vec(ssv), tpr, red, parity);
    const float rs = rsqrtf(ss / static_cast<float>(N) + a.eps);
    if (valid) {
      if (lane == 0 && a.rstd != nullptr) a.rstd[row] = rs;
      char* yr = y_row<TX, TH>(a, row);
#pragma unroll
      for (int i = 0; i < ITERS; ++i) {
        const int v = lane + i * tpr;
        if (v < NV) {
          float s[VEC], o[VEC];
          load_scale<TX, VEC>(s, a.w, a.w_f32, a.offset, v * VEC, N, a.vec_ok);
#pragma unroll
          for (int j = 0; j < VEC; ++j) o[j] = hv[i].f(j) * rs * s[j];
          store_floats_rt<TX, VEC>(yr, a.y_f32, v * VEC, N, a.vec_ok, o);
        }
      }
    }
  }
}

// Rows wider than the register budget: one row per block iteration, blockDim.x threads, U packs in flight.
template <typename TX, typename TH, bool RES>
__global__ void __launch_bounds__(512, 1) rms_norm_fwd_wide_kernel(const FwdArgs a) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(TX));
  constexpr int U = 4;
  using XPack = Pack<TX, VEC>;
  using HPack = Pack<TH, VEC>;
  static_assert(RES || std::is_same_v<TX, TH>, "without a residual h is x");
  extern __shared__ uint4 dyn_smem[];
  __shared__ float red[64];
  HPack* cache = reinterpret_cast<HPack*>(dyn_smem);

  const int64_t M = a.M;
  const int N = static_cast<int>(a.N), NV = (N + VEC - 1) / VEC;
  const int T = blockDim.x;
  int parity = 0;
  for (int64_t row = blockIdx.x; row < M; row += gridDim.x) {
    const TX* xr = static_cast<const TX*>(a.x) + row * a.x_stride;
    const TH* rr = RES ? static_cast<const TH*>(a.res) + row * a.res_stride : nullptr;
    TH* hr = RES ? static_cast<TH*>(a.h) + row * a.N : nullptr;
    float ssv[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) ssv[j] = 0.f;
    for (int v0 = threadIdx.x; v0 < NV; v0 += U * T) {
      XPack xp[U];
      HPack rp[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int v = v0 + u * T;
        if (v < NV) {
          // Without a cache, x (or h) is read again in the second pass: keep it in L2.
          if (a.cache || RES) {
            load_pack<Ld::Stream>(xp[u], xr, v * VEC, N, a.vec_ok);
          } else {
            load_pack<Ld::Keep>(xp[u], xr, v * VEC, N, a.vec_ok);
          }
          if constexpr (RES) load_pack<Ld::Stream>(rp[u], rr, v * VEC, N, a.vec_ok);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int v = v0 + u * T;
        if (v < NV) {
          HPack hp;
          if constexpr (RES) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) hp.v[j] = from_float<TH>(xp[u].f(j) + rp[u].f(j));
            store_pack(hr, v * VEC, N, a.vec_ok, hp);
          } else {
            hp = xp[u];
          }
          if (a.cache) cache[v] = hp;  // own slots only
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const float f = hp.f(j);
            ssv[j] += f * f;
          }
        }
      }
    }
    const float ss = row_reduce_sum(sum_vec(ssv), T, red, parity);
    const float rs = rsqrtf(ss / static_cast<float>(N) + a.eps);
    if (threadIdx.x == 0 && a.rstd != nullptr) a.rstd[row] = rs;
    char* yr = y_row<TX, TH>(a, row);
    for (int v0 = threadIdx.x; v0 < NV; v0 += U * T) {
      HPack hp[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int v = v0 + u * T;
        if (v < NV) {
          if (a.cache) {
            hp[u] = cache[v];
          } else if constexpr (RES) {
            load_pack<Ld::Stream>(hp[u], static_cast<const TH*>(hr), v * VEC, N, a.vec_ok);  // own writes
          } else {
            load_pack<Ld::Stream>(hp[u], xr, v * VEC, N, a.vec_ok);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int v = v0 + u * T;
        if (v < NV) {
          float s[VEC], o[VEC];
          load_scale<TX, VEC>(s, a.w, a.w_f32, a.offset, v * VEC, N, a.vec_ok);
#pragma unroll
          for (int j = 0; j < VEC; ++j) o[j] = hp[u].f(j) * rs * s[j];
          store_floats_rt<TX, VEC>(yr, a.y_f32, v * VEC, N, a.vec_ok, o);
        }
      }
    }
  }
}

// ---- forward, few rows (decode): latency first ---------------------------------------------------------------
// One row group per block and no loop (grid = row groups; rows per block > 1 only for short rows), the whole row in
// registers (PACKS 16-byte packs per thread, a compile-time N class), no persistent grid or prefetch: x, residual
// and weight are all requested before anything waits on them, so a row costs one memory round trip, one shuffle
// reduction (+ one smem round when a row spans warps) and the stores. The weight is read once per block, with an
// L2 evict-last hint (every block and every decode step reads it again). Only for 16-byte aligned rows with
// N % VEC == 0 (no per-element bounds: a pack is valid or not as a whole, one predicate per pack).
// TW: the weight dtype (x's or fp32); without a weight the kernel takes a scale of 1 and the host passes offset 0.

struct FwdSmallArgs {
  const void* x;          // [M, N] x dtype, row stride x_stride (elements), rows 16-byte aligned
  int64_t x_stride;
  const void* res;        // [M, N] h dtype, row stride res_stride, or null
  int64_t res_stride;
  void* h;                // [M, N] contiguous, h dtype (written with a residual), or null
  const void* w;          // [N] x dtype or fp32, or null
  void* y;                // [M, N] contiguous, x dtype or fp32
  float* rstd;            // [M], or null (inference entries: not stored)
  int64_t M;
  int N, nv;              // nv = N / VEC packs per row
  float inv_n;            // 1 / N
  int tpr;                // threads per row: a power of two (< 32 only with rpb >= 32 / tpr) or a multiple of 32
  int tpr_shift;          // log2(tpr) when rows per block > 1, else 10 (every thread is in row slot 0)
  int rpb;                // rows per block (blockDim.x == tpr * rpb)
  float eps, offset;
  bool w_f32, y_f32;
};

// Read-only 16-byte load with an L2 evict-last policy (what Inductor's evict_last on the weight compiles to).
__device__ __forceinline__ uint64_t l2_evict_last_policy() {
  uint64_t pol = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
#endif
  return pol;
}

__device__ __forceinline__ uint4 ld16_weight(const uint4* p, uint64_t pol) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint4 r;
  asm("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p), "l"(pol));
  return r;
#else
  return __ldg(p);
#endif
}

// Sum over the tpr threads of row slot `rib` (rows are consecutive runs of tpr threads); every thread of the row gets
// the same bits. Shuffles within a warp, then, for rows spanning warps, one smem round: lane k takes warp k's sum
// (<= 16 warps per row) and a butterfly adds them. Called once per block by all of its threads. `red`: 32 floats.
__device__ __forceinline__ float small_row_sum(float v, int tpr, int rib, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    if (o < tpr) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (tpr <= 32) return v;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wpr = tpr >> 5;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = lane < wpr ? red[rib * wpr + lane] : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
  return t;
}

// Programmatic dependent launch (sm_90+; no-ops when the grid was launched without it): the few-rows kernel waits for
// the previous grid before touching memory and lets the next one start launching at once.
__device__ __forceinline__ void pdl_wait_and_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

template <typename TX, typename TH, typename TW, bool RES, int PACKS>
__global__ void __launch_bounds__(PACKS >= 8 ? 256 : 512) rms_norm_fwd_small_kernel(const FwdSmallArgs a) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(TX));
  using XPack = Pack<TX, VEC>;
  using HPack = Pack<TH, VEC>;
  using WPack = Pack<TW, VEC>;
  static_assert(RES || std::is_same_v<TX, TH>, "without a residual h is x");
  static_assert(XPack::kUnits == 1, "an x pack is one 16-byte unit");
  __shared__ float red[32];

  const int tpr = a.tpr;
  const int rib = static_cast<int>(threadIdx.x) >> a.tpr_shift;
  const int lane = static_cast<int>(threadIdx.x) - rib * tpr;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * a.rpb + rib;
  const bool valid = row < a.M;  // false only in the last block of short rows
  bool has[PACKS];                // pack lane + i * tpr exists in the row
#pragma unroll
  for (int i = 0; i < PACKS; ++i) has[i] = valid && lane + i * tpr < a.nv;

  pdl_wait_and_release();  // every global access below follows the previous grid (PDL launch)
  // Every load is issued before anything waits on one: weight, x, residual.
  const uint64_t pol = l2_evict_last_policy();
  WPack wv[PACKS];
#pragma unroll
  for (int i = 0; i < PACKS; ++i) {
    if (a.w != nullptr && has[i]) {
      const uint4* src = reinterpret_cast<const uint4*>(static_cast<const TW*>(a.w) + (lane + i * tpr) * VEC);
#pragma unroll
      for (int k = 0; k < WPack::kUnits; ++k) wv[i].u[k] = ld16_weight(src + k, pol);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) wv[i].v[j] = from_float<TW>(1.f);  // no weight: scale 1 (offset is 0 then)
    }
  }
  const TX* xr = static_cast<const TX*>(a.x) + (valid ? row : 0) * a.x_stride;
  const TH* rr = RES ? static_cast<const TH*>(a.res) + (valid ? row : 0) * a.res_stride : nullptr;
  XPack xv[PACKS];
  HPack rv[PACKS];
#pragma unroll
  for (int i = 0; i < PACKS; ++i) {
    const int v = lane + i * tpr;
    if (has[i]) {
      xv[i].u[0] = ld16<Ld::Stream>(reinterpret_cast<const uint4*>(xr + v * VEC));
      if constexpr (RES) {
        const uint4* src = reinterpret_cast<const uint4*>(rr + v * VEC);
#pragma unroll
        for (int k = 0; k < HPack::kUnits; ++k) rv[i].u[k] = ld16<Ld::Stream>(src + k);
      }
    } else {
      xv[i].u[0] = make_uint4(0u, 0u, 0u, 0u);
      if constexpr (RES) {
#pragma unroll
        for (int k = 0; k < HPack::kUnits; ++k) rv[i].u[k] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
  }

  // h (stored with a residual) and its sum of squares.
  HPack hv[PACKS];
  float ssv[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) ssv[j] = 0.f;
  TH* hr = RES ? static_cast<TH*>(a.h) + (valid ? row : 0) * static_cast<int64_t>(a.N) : nullptr;
#pragma unroll
  for (int i = 0; i < PACKS; ++i) {
    if constexpr (RES) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) hv[i].v[j] = from_float<TH>(xv[i].f(j) + rv[i].f(j));
      // The residual stream carries h rounded to its dtype; exactly that value is normalised below.
      if (has[i]) {
        uint4* dst = reinterpret_cast<uint4*>(hr + (lane + i * tpr) * VEC);
#pragma unroll
        for (int k = 0; k < HPack::kUnits; ++k) dst[k] = hv[i].u[k];
      }
    } else {
      hv[i] = xv[i];
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float f = hv[i].f(j);
      ssv[j] = fmaf(f, f, ssv[j]);
    }
  }
  const float ss = small_row_sum(sum_vec(ssv), tpr, rib, red);
  const float rs = rsqrtf(ss * a.inv_n + a.eps);
  if (!valid) return;  // after the block-wide reduction
  if (lane == 0 && a.rstd != nullptr) a.rstd[row] = rs;

  // y = h * rstd * (offset + w), rounded once.
  char* yr = static_cast<char*>(a.y) + row * a.N * (a.y_f32 ? 4 : static_cast<int64_t>(sizeof(TX)));
#pragma unroll
  for (int i = 0; i < PACKS; ++i) {
    if (!has[i]) continue;
    const int v = lane + i * tpr;
    float o[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) o[j] = hv[i].f(j) * rs * (a.offset + wv[i].f(j));
    store_full_pack_rt<TX, VEC>(yr, a.y_f32, v * VEC, o);
  }
}

// ---- forward, aligned rows in registers (the "reg" family) ---------------------------------------------------------
// For 16-byte aligned rows of whole packs (every base pointer and row stride 16-byte aligned, N % VEC == 0): PACKS
// packs per thread (a compile-time N class), the row (or, in a cluster, the CTA's slice of it) held in registers,
// every 16-byte load of x and the residual issued before any is used, one pass over HBM, one predicate per pack
// (`has`, always true when the class divides the row exactly), 32-bit column math. Non-persistent grid: one row group
// per CTA, many resident CTAs per SM (the loads of the other CTAs cover each CTA's reduction and stores).
// Rows per CTA for short rows (tpr <= 32: sub-warp / warp per row, 256-thread CTAs); long rows on sm_90 split over
// a thread-block cluster of 2..8 CTAs whose partial sums of squares meet in distributed shared memory.
// TH: the held h dtype; the weight / out dtypes are uniform runtime flags (the output loop is instantiated for each).

struct FwdRegArgs {
  const void* x;          // [M, N] x dtype, row stride x_stride (elements), rows 16-byte aligned
  int64_t x_stride;
  const void* res;        // [M, N] h dtype, row stride res_stride, or null
  int64_t res_stride;
  void* h;                // [M, N] contiguous, h dtype (written with a residual), or null
  const void* w;          // [N] x dtype or fp32, or null
  void* y;                // [M, N] contiguous, x dtype or fp32
  float* rstd;            // [M], or null (inference entries: not stored)
  int64_t M;
  int N, nv;              // nv = N / VEC packs per row
  int nvc;                // packs per CTA: nv, or a cluster CTA's slice ceil(nv / cluster size)
  int tpr;                // threads per row (slice): a power of two <= 32 (then rpb >= 32 / tpr), or a multiple of 32
  int tpr_shift;          // log2(tpr) when rpb > 1, else 10 (every thread is in row slot 0)
  int rpb;                // rows per CTA (blockDim.x == tpr * rpb); 1 in a cluster
  int c_shift;            // log2(cluster size): 0 without a cluster (sm_90+ only)
  float inv_n, eps, offset;
  uint32_t zero;          // 0 (see launder_pack)
  bool w_f32, y_f32;
  bool ld_keep;           // x and residual loads with the default cache policy, not evict-first (launchers: by M)
};

constexpr int kRegMaxThreads = 512;  // __launch_bounds__: <= 128 regs, 0 spills -- docs/tuning-log.md#rmsnorm-reg-config

// Register budget of the held row: after the sum of squares the compiler keeps the row's unpacked fp32 values for the
// output (2 registers per bf16 pair: P = 8 took 116 registers, ptxas merges any second unpack of the same words).
// Adding a run-time zero (FwdRegArgs::zero) to the packed words makes them new values to ptxas: the output unpacks
// them again (one add per 32-bit word, a unpack per element) and the row stays at 4 registers per 16-byte pack.
// fp32 packs need no unpack: an opaque copy suffices (fwd P = 8: 78 -> 64 registers).
template <typename T, int VEC>
__device__ __forceinline__ void launder_pack(Pack<T, VEC>& p, uint32_t zero) {
#pragma unroll
  for (int k = 0; k < Pack<T, VEC>::kUnits; ++k) {
    if constexpr (sizeof(T) < 4) {
      asm("add.u32 %0, %0, %1;" : "+r"(p.u[k].x) : "r"(zero));
      asm("add.u32 %0, %0, %1;" : "+r"(p.u[k].y) : "r"(zero));
      asm("add.u32 %0, %0, %1;" : "+r"(p.u[k].z) : "r"(zero));
      asm("add.u32 %0, %0, %1;" : "+r"(p.u[k].w) : "r"(zero));
    } else {
      asm volatile("" : "+r"(p.u[k].x), "+r"(p.u[k].y), "+r"(p.u[k].z), "+r"(p.u[k].w));
    }
  }
}

// Sum over the tpr threads of row slot `rib`: shuffles, then (rows spanning warps) one smem round over the row's
// warps in a fixed order: every thread of the row gets the same bits. Called once by all threads of the CTA.
__device__ __forceinline__ float reg_row_sum(float v, int tpr, int rib, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    if (o < tpr) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (tpr <= 32) return v;
  const int warp = threadIdx.x >> 5, wpr = tpr >> 5;
  if ((threadIdx.x & 31) == 0) red[warp] = v;
  __syncthreads();
  float t = 0.f;
  for (int k = 0; k < wpr; ++k) t += red[rib * wpr + k];
  return t;
}

// y = h * (rstd * (offset + w)) for the thread's packs, G weight packs in registers at a time (the weight is L1/L2
// resident; G bounds the registers it takes next to the held row). TW = NoWeight: no weight (scale = rstd).
struct NoWeight {};

template <typename TW, typename TY, typename TH, int P, int VEC>
__device__ __forceinline__ void reg_store_y(const Pack<TH, VEC> (&hv)[P], const bool (&has)[P], const void* w,
                                            TY* __restrict__ yr, int col, int step, float rs, float offset) {
  using YPack = Pack<TY, VEC>;
  if constexpr (std::is_same_v<TW, NoWeight>) {
#pragma unroll
    for (int i = 0; i < P; ++i) {
      if (!has[i]) continue;
      YPack p;
#pragma unroll
      for (int j = 0; j < VEC; ++j) p.v[j] = from_float<TY>(hv[i].f(j) * rs);
      uint4* dst = reinterpret_cast<uint4*>(yr + col + i * step);
#pragma unroll
      for (int k = 0; k < YPack::kUnits; ++k) dst[k] = p.u[k];
    }
  } else {
    using WPack = Pack<TW, VEC>;
    constexpr int G = P < 4 / WPack::kUnits ? P : 4 / WPack::kUnits;
    const float rs_off = rs * offset;
    const TW* wr = static_cast<const TW*>(w) + col;
#pragma unroll
    for (int g = 0; g < P; g += G) {
      WPack wv[G];
      asm volatile("" ::: "memory");  // the next group's weight loads stay behind this group's stores (registers)
#pragma unroll
      for (int k = 0; k < G; ++k) {
        if (has[g + k]) {
          const uint4* src = reinterpret_cast<const uint4*>(wr + (g + k) * step);
#pragma unroll
          for (int u = 0; u < WPack::kUnits; ++u) wv[k].u[u] = __ldg(src + u);
        }
      }
#pragma unroll
      for (int k = 0; k < G; ++k) {
        const int i = g + k;
        if (!has[i]) continue;
        YPack p;
#pragma unroll
        for (int j = 0; j < VEC; ++j) p.v[j] = from_float<TY>(hv[i].f(j) * fmaf(wv[k].f(j), rs, rs_off));
        uint4* dst = reinterpret_cast<uint4*>(yr + col + i * step);
#pragma unroll
        for (int u = 0; u < YPack::kUnits; ++u) dst[u] = p.u[u];
      }
    }
  }
}

// WPRE (launched for 16-bit x, h of x's dtype, P = 4, a weight and y of x's dtype): the weight's packs are loaded into
// registers with the row, before the reduction, instead of after it -- docs/tuning-log.md#rmsnorm-reg-config
template <typename TX, typename TH, bool RES, int P, bool WPRE = false>
__global__ void __launch_bounds__(kRegMaxThreads) rms_norm_fwd_reg_kernel(const FwdRegArgs a) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(TX));
  using XPack = Pack<TX, VEC>;
  using HPack = Pack<TH, VEC>;
  static_assert(RES || std::is_same_v<TX, TH>, "without a residual h is x");
  static_assert(XPack::kUnits == 1, "an x pack is one 16-byte unit");
  __shared__ float red[kRegMaxThreads / 32];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ float cl_part;  // this CTA's partial sum of squares, read by the cluster's other CTAs
#endif

  const int tid = static_cast<int>(threadIdx.x);
  const int tpr = a.tpr;
  const int rib = tid >> a.tpr_shift;
  const int lane = tid - rib * tpr;
  int64_t row;
  int col0 = 0, nvc = a.nv;  // this CTA's first pack and its pack count
  if (a.c_shift > 0) {
    row = static_cast<int64_t>(blockIdx.x >> a.c_shift);
    col0 = static_cast<int>(blockIdx.x & ((1u << a.c_shift) - 1u)) * a.nvc;  // cluster rank * slice
    nvc = min(a.nvc, a.nv - col0);  // <= 0 only for a forced cluster size wider than the row
  } else {
    row = static_cast<int64_t>(blockIdx.x) * a.rpb + rib;
  }
  const bool valid = row < a.M;  // false only in the last CTA of short rows
  const int64_t r = valid ? row : 0;
  const int col = (col0 + lane) * VEC;  // the thread's first column; pack i is at col + i * step
  const int step = tpr * VEC;
  const int left = valid ? nvc - lane : 0;
  bool has[P];
#pragma unroll
  for (int i = 0; i < P; ++i) has[i] = i * tpr < left;

  // Every load of the row is issued before any is used.
  const TX* xr = static_cast<const TX*>(a.x) + r * a.x_stride + col;
  const TH* rr = RES ? static_cast<const TH*>(a.res) + r * a.res_stride + col : nullptr;
  XPack xv[P];
  HPack rv[RES ? P : 1];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    if (has[i]) {
      const uint4* src = reinterpret_cast<const uint4*>(xr + i * step);
      xv[i].u[0] = a.ld_keep ? *src : __ldcs(src);
    } else {
      xv[i].u[0] = make_uint4(0u, 0u, 0u, 0u);
    }
    if constexpr (RES) {
      const uint4* src = reinterpret_cast<const uint4*>(rr + i * step);
#pragma unroll
      for (int k = 0; k < HPack::kUnits; ++k)
        rv[i].u[k] = has[i] ? (a.ld_keep ? src[k] : __ldcs(src + k)) : make_uint4(0u, 0u, 0u, 0u);
    }
  }
  XPack wpv[WPRE ? P : 1];
  if constexpr (WPRE) {
    const TX* wr = static_cast<const TX*>(a.w) + col;
#pragma unroll
    for (int i = 0; i < P; ++i)
      wpv[i].u[0] = has[i] ? __ldg(reinterpret_cast<const uint4*>(wr + i * step)) : make_uint4(0u, 0u, 0u, 0u);
  }

  HPack hv[P];
  float ssv[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) ssv[j] = 0.f;
  TH* hr = RES ? static_cast<TH*>(a.h) + r * static_cast<int64_t>(a.N) + col : nullptr;
#pragma unroll
  for (int i = 0; i < P; ++i) {
    if constexpr (RES) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) hv[i].v[j] = from_float<TH>(xv[i].f(j) + rv[i].f(j));
      // The residual stream carries h rounded to its dtype; exactly that value is normalised below.
      if (has[i]) {
        uint4* dst = reinterpret_cast<uint4*>(hr + i * step);
#pragma unroll
        for (int k = 0; k < HPack::kUnits; ++k) dst[k] = hv[i].u[k];
      }
    } else {
      hv[i] = xv[i];
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float f = hv[i].f(j);
      ssv[j] = fmaf(f, f, ssv[j]);
    }
  }
#pragma unroll
  for (int i = 0; i < P; ++i) launder_pack(hv[i], a.zero);
  float ss = reg_row_sum(sum_vec(ssv), tpr, rib, red);

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (a.c_shift > 0) {
    // The cluster's CTAs hold slices of one row: exchange the partial sums through distributed shared memory.
    // Every CTA adds them in rank order (a butterfly over lanes = ranks): the same bits in all of them.
    namespace cg = cooperative_groups;
    const cg::cluster_group cl = cg::this_cluster();
    if (tid == 0) cl_part = ss;
    cl.sync();
    const int l = tid & 31;
    float p = l < (1 << a.c_shift) ? *cl.map_shared_rank(&cl_part, l) : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) p += __shfl_xor_sync(0xffffffffu, p, o);
    ss = p;
    cl.barrier_arrive();  // this CTA is done reading the others' cl_part; waited for before exiting
  }
#else
  if (a.c_shift > 0) __trap();  // the host launches clusters on sm_90+ only
#endif
  const float rs = rsqrtf(ss * a.inv_n + a.eps);

  if (valid) {
    if (lane == 0 && col0 == 0 && a.rstd != nullptr) a.rstd[row] = rs;
    const int64_t yo = row * static_cast<int64_t>(a.N);
    if constexpr (WPRE) {
      TX* yr = static_cast<TX*>(a.y) + yo;
      const float rs_off = rs * a.offset;
#pragma unroll
      for (int i = 0; i < P; ++i) {
        if (!has[i]) continue;
        XPack p;
#pragma unroll
        for (int j = 0; j < VEC; ++j) p.v[j] = from_float<TX>(hv[i].f(j) * fmaf(wpv[i].f(j), rs, rs_off));
        *reinterpret_cast<uint4*>(yr + col + i * step) = p.u[0];
      }
    } else {
      auto out = [&](auto wtag) {
        using TW = decltype(wtag);
        if (a.y_f32) {
          reg_store_y<TW, float, TH, P, VEC>(hv, has, a.w, static_cast<float*>(a.y) + yo, col, step, rs, a.offset);
        } else {
          reg_store_y<TW, TX, TH, P, VEC>(hv, has, a.w, static_cast<TX*>(a.y) + yo, col, step, rs, a.offset);
        }
      };
      if (a.w == nullptr) {
        out(NoWeight{});
      } else if (a.w_f32) {
        out(float{});
      } else {
        out(TX{});
      }
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (a.c_shift > 0) cooperative_groups::this_cluster().barrier_wait();  // no CTA leaves while its cl_part is read
#endif
}

// ---- forward, lean rows (the "lean" kernel) -----------------------------------------------------------------------
// 16-bit x (h of x's dtype with a residual), a weight and y of x's dtype, rows of exactly P * T packs: one row per CTA
// of T threads, P packs per thread at compile-time offsets -- no per-pack bounds, row-group, cluster or dtype branches.
// At 2 packs per thread the reg kernel issues 1.6x the instructions of Inductor's kernel for the same row, and holds
// 40 registers where this one holds 32 (4 CTAs of 512 per SM) -- docs/tuning-log.md#rmsnorm-lean. The sum of squares
// is reduced in the reg kernel's order (per-lane partials over the packs, shuffles, warps in order): the same bits as
// rms_norm_fwd_reg_kernel<TX, TX, RES, P> at tpr = T.
constexpr int lean_min_blocks(int P, int T) { return P <= 2 ? 2048 / T : 1024 / T; }

template <typename TX, bool RES, int P, int T>
__global__ void __launch_bounds__(T, lean_min_blocks(P, T)) rms_norm_fwd_lean_kernel(const FwdRegArgs a) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(TX));
  using XPack = Pack<TX, VEC>;
  static_assert(sizeof(TX) == 2 && XPack::kUnits == 1, "16-bit x");
  constexpr int W = T / 32;
  __shared__ float red[W];
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t row = blockIdx.x;
  const uint4* xr = reinterpret_cast<const uint4*>(static_cast<const TX*>(a.x) + row * a.x_stride) + tid;
  XPack xv[P];
#pragma unroll
  for (int i = 0; i < P; ++i) xv[i].u[0] = a.ld_keep ? xr[i * T] : __ldcs(xr + i * T);
  if constexpr (RES) {
    const uint4* rr = reinterpret_cast<const uint4*>(static_cast<const TX*>(a.res) + row * a.res_stride) + tid;
    XPack rv[P];
#pragma unroll
    for (int i = 0; i < P; ++i) rv[i].u[0] = a.ld_keep ? rr[i * T] : __ldcs(rr + i * T);
    uint4* hr = reinterpret_cast<uint4*>(static_cast<TX*>(a.h) + row * a.N) + tid;
#pragma unroll
    for (int i = 0; i < P; ++i) {
      XPack hv;
#pragma unroll
      for (int j = 0; j < VEC; ++j) hv.v[j] = from_float<TX>(xv[i].f(j) + rv[i].f(j));
      xv[i] = hv;  // the residual stream's rounded h is what is normalised
      hr[i * T] = hv.u[0];
    }
  }
  float ssv[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) ssv[j] = 0.f;
#pragma unroll
  for (int i = 0; i < P; ++i) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float f = xv[i].f(j);
      ssv[j] = fmaf(f, f, ssv[j]);
    }
  }
#pragma unroll
  for (int i = 0; i < P; ++i) launder_pack(xv[i], a.zero);
  float ss = sum_vec(ssv);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if ((tid & 31) == 0) red[tid >> 5] = ss;
  __syncthreads();
  ss = 0.f;
#pragma unroll
  for (int k = 0; k < W; ++k) ss += red[k];
  const float rs = rsqrtf(ss * a.inv_n + a.eps);
  if (tid == 0 && a.rstd != nullptr) a.rstd[row] = rs;
  const float rs_off = rs * a.offset;
  const uint4* wr = static_cast<const uint4*>(a.w) + tid;
  uint4* yr = reinterpret_cast<uint4*>(static_cast<TX*>(a.y) + row * a.N) + tid;
#pragma unroll
  for (int i = 0; i < P; ++i) {
    XPack wv, p;
    wv.u[0] = __ldg(wr + i * T);
#pragma unroll
    for (int j = 0; j < VEC; ++j) p.v[j] = from_float<TX>(xv[i].f(j) * fmaf(wv.f(j), rs, rs_off));
    yr[i * T] = p.u[0];
  }
}

// ---- forward, long aligned rows: two passes, the second from L2 (the "l2" family) ---------------------------------
// Aligned rows of whole packs (as the reg family) where the bytes in flight, not the registers, should set the pace:
// a CTA of kL2Threads threads takes one row at a time (grid-stride over rows, as many CTAs as are resident). Pass 1
// streams the row with U 16-byte loads in flight per thread and forms h (written with a residual) and the sum of
// squares; pass 2 reads the row again (x, or the h just written) from L2 with evict-first loads, the weight with it,
// and writes y with streaming stores. HBM sees one read and one write. torch.compile's looped reduction runs
// 32K-element bf16 rows this way at 4.0-4.2 TB/s on the H200, where the register row (one 512-thread CTA per SM)
// stops at 3.4; this kernel reads 3.6-3.8 -- docs/tuning-log.md#rmsnorm-reg-config.
constexpr int kL2Threads = 512;
constexpr int kL2Unroll = 4;  // 16-byte loads per thread and pass in flight (x, or h)

// Pass 2 for the common case only (a weight of x's dtype, y in x's dtype): each variant inlined in one kernel costs
// registers (six took 124 at U = 4, one 82), and the weight pack is read per pack after the h loads are issued (L1 /
// L2 hits), so only the h packs are held.
template <typename TX, typename TH, int U, int VEC>
__device__ __forceinline__ void l2_store_y(const TH* __restrict__ hr, const TX* __restrict__ w, TX* __restrict__ yr,
                                           int nv, float rs, float offset) {
  using HPack = Pack<TH, VEC>;
  using YPack = Pack<TX, VEC>;
  using WPack = Pack<TX, VEC>;
  const float rs_off = rs * offset;
#pragma unroll 1
  for (int base = static_cast<int>(threadIdx.x); base < nv; base += kL2Threads * U) {
    HPack hv[U];
#pragma unroll
    for (int i = 0; i < U; ++i) {
      const int p = base + i * kL2Threads;
      if (p < nv) {
        const uint4* src = reinterpret_cast<const uint4*>(hr + p * VEC);
#pragma unroll
        for (int k = 0; k < HPack::kUnits; ++k) hv[i].u[k] = __ldcs(src + k);  // the row's last use
      }
    }
#pragma unroll
    for (int i = 0; i < U; ++i) {
      const int p = base + i * kL2Threads;
      if (p >= nv) continue;
      WPack wv;
      wv.u[0] = __ldg(reinterpret_cast<const uint4*>(w + p * VEC));
      YPack o;
#pragma unroll
      for (int j = 0; j < VEC; ++j) o.v[j] = from_float<TX>(hv[i].f(j) * fmaf(wv.f(j), rs, rs_off));
      __stcs(reinterpret_cast<uint4*>(yr + p * VEC), o.u[0]);  // y is not read again: keep the L2 for rows
    }
  }
}

template <typename TX, typename TH, bool RES, int U>
__global__ void __launch_bounds__(kL2Threads, RES ? 1 : 2) rms_norm_fwd_l2_kernel(const FwdRegArgs a) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(TX));
  using XPack = Pack<TX, VEC>;
  using HPack = Pack<TH, VEC>;
  static_assert(RES || std::is_same_v<TX, TH>, "without a residual h is x");
  static_assert(XPack::kUnits == 1, "an x pack is one 16-byte unit");
  __shared__ float red[64];  // row_reduce_sum's scratch, double-buffered by row parity: one barrier per row
  const int tid = static_cast<int>(threadIdx.x);
  const int nv = a.nv;
  const uint64_t pol = l2_evict_last_policy();
  int parity = 0;
  for (int64_t row = blockIdx.x; row < a.M; row += gridDim.x) {
    const TX* xr = static_cast<const TX*>(a.x) + row * a.x_stride;
    const TH* rr = RES ? static_cast<const TH*>(a.res) + row * a.res_stride : nullptr;
    TH* hr = RES ? static_cast<TH*>(a.h) + row * static_cast<int64_t>(a.N) : nullptr;
    float ssv[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) ssv[j] = 0.f;
#pragma unroll 1
    for (int base = tid; base < nv; base += kL2Threads * U) {
      XPack xv[U];
      HPack rv[RES ? U : 1];
#pragma unroll
      for (int i = 0; i < U; ++i) {
        const int p = base + i * kL2Threads;
        if (p < nv) {
          const uint4* src = reinterpret_cast<const uint4*>(xr + p * VEC);
          // Without a residual pass 2 reads x again: an L2 evict-last hint keeps it there (as Inductor's pass 1:
          // 4096 x 32768 3.64 -> 3.80 TB/s); else x is read once.
          xv[i].u[0] = RES ? __ldcs(src) : ld16_weight(src, pol);
          if constexpr (RES) {
            const uint4* rs = reinterpret_cast<const uint4*>(rr + p * VEC);
#pragma unroll
            for (int k = 0; k < HPack::kUnits; ++k) rv[i].u[k] = __ldcs(rs + k);
          }
        }
      }
#pragma unroll
      for (int i = 0; i < U; ++i) {
        const int p = base + i * kL2Threads;
        if (p >= nv) continue;
        HPack hv;
        if constexpr (RES) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) hv.v[j] = from_float<TH>(xv[i].f(j) + rv[i].f(j));
          // The residual stream carries h rounded to its dtype; exactly that value is normalised in pass 2.
          uint4* dst = reinterpret_cast<uint4*>(hr + p * VEC);
#pragma unroll
          for (int k = 0; k < HPack::kUnits; ++k) dst[k] = hv.u[k];
        } else {
          hv = xv[i];
        }
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float f = hv.f(j);
          ssv[j] = fmaf(f, f, ssv[j]);
        }
      }
    }
    const float rs = rsqrtf(row_reduce_sum(sum_vec(ssv), kL2Threads, red, parity) * a.inv_n + a.eps);
    if (tid == 0 && a.rstd != nullptr) a.rstd[row] = rs;
    // Pass 2 reads h back: with a residual the h this thread just wrote (same addresses, program order).
    const TH* src = RES ? hr : reinterpret_cast<const TH*>(xr);
    TX* yr = static_cast<TX*>(a.y) + row * static_cast<int64_t>(a.N);
    l2_store_y<TX, TH, U, VEC>(src, static_cast<const TX*>(a.w), yr, nv, rs, a.offset);
  }
}

// ---- backward ----------------------------------------------------------------------------------------------

struct BwdArgs {
  const void* dy;         // [M, N] x dtype or fp32, row stride dy_stride
  int64_t dy_stride;
  const void* h;          // [M, N] h dtype (x dtype or fp32), row stride h_stride
  int64_t h_stride;
  const float* rstd;      // [M]
  const void* w;          // [N] x dtype or fp32, or null
  const void* extra;      // [M, N] incoming gradient of h (x dtype or fp32), or null
  int64_t extra_stride;
  void* dx;               // [M, N] contiguous, x dtype or fp32
  float* partial;         // [P, pstride] fp32 dW partial rows, or null
  int64_t pstride;
  void* dw;               // [N] weight dtype: written directly when there is a single partial row
  int64_t M, N;
  float offset;
  int tpr, rpb;
  int nvc;                // register kernel in a cluster: packs per CTA (its slice of the row)
  int c_shift;            // register kernel: log2(cluster size), 0 without a cluster (sm_90+ only)
  int tpr_shift;          // few-rows kernel: log2(tpr) when rpb > 1, else 10
  int row_blocks;         // few-rows kernel: the dx CTAs (the rest of the grid computes dW)
  uint32_t zero;          // 0 (the register kernel's launder_pack)
  bool w_f32, extra_f32, dx_f32;
  bool vec_ok, prefetch, direct_dw, dw_smem;
};

// Largest packs-per-thread the bwd rows kernel holds in registers: h and dy packs <= 64 registers (see header).
template <typename TX, typename TH, typename TD>
constexpr int bwd_max_iters() {
  constexpr int vec = 16 / static_cast<int>(sizeof(TX));
  for (int it = 8; it > 1; it /= 2)
    if (it * vec * static_cast<int>(sizeof(TH) + sizeof(TD)) / 4 <= 64) return it;
  return 1;
}

template <typename TX>
__device__ __forceinline__ char* dx_row(const BwdArgs& a, int64_t row) {
  return static_cast<char*>(a.dx) + row * a.N * (a.dx_f32 ? 4 : static_cast<int64_t>(sizeof(TX)));
}

template <typename TX>
__device__ __forceinline__ const void* extra_row(const BwdArgs& a, int64_t row) {
  return static_cast<const char*>(a.extra) +
         row * a.extra_stride * (a.extra_f32 ? 4 : static_cast<int64_t>(sizeof(TX)));
}

// TX: base (x) dtype; TH: h dtype; TD: dy dtype. ITERS packs per thread held in registers. dW partial sums live
// in dynamic smem, planar ([row slot][j][pack], consecutive lanes -> consecutive words: conflict-free), each
// word owned by one thread for the whole launch; at the end the row slots are summed in a fixed order and the
// block writes one fp32 partial row (or dW itself when the grid is a single block).
template <typename TX, typename TH, typename TD, int ITERS>
__global__ void __launch_bounds__(512, 1) rms_norm_bwd_rows_kernel(const BwdArgs a) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(TX));
  using HPack = Pack<TH, VEC>;
  using DPack = Pack<TD, VEC>;
  using EPackB = Pack<TX, VEC>;
  using EPackF = Pack<float, VEC>;
  extern __shared__ uint4 dyn_smem[];
  __shared__ float red[64];

  const int64_t M = a.M;
  const int N = static_cast<int>(a.N), NV = (N + VEC - 1) / VEC;
  const int tpr0 = a.tpr, lane0 = threadIdx.x % tpr0, rib = threadIdx.x / tpr0;
  const int64_t groups = (M + a.rpb - 1) / a.rpb;
  const bool has_extra = a.extra != nullptr;
  const bool want_dw = a.partial != nullptr || a.direct_dw;
  // dynamic smem: [dW: rpb * VEC * NV fp32 (when want_dw)] [h slots] [dy slots] [extra slots] (prefetch)
  float* dws = reinterpret_cast<float*>(dyn_smem);
  const int dw_words = want_dw ? a.rpb * VEC * NV : 0;
  uint4* pf = dyn_smem + (dw_words + 3) / 4;
  const int slots = a.rpb * NV;
  HPack* h_slot = reinterpret_cast<HPack*>(pf) + rib * NV;
  DPack* d_slot = reinterpret_cast<DPack*>(reinterpret_cast<HPack*>(pf) + slots) + rib * NV;
  uint4* e_base = reinterpret_cast<uint4*>(reinterpret_cast<DPack*>(reinterpret_cast<HPack*>(pf) + slots) + slots);
  EPackF* ef_slot = reinterpret_cast<EPackF*>(e_base) + rib * NV;
  EPackB* eb_slot = reinterpret_cast<EPackB*>(e_base) + rib * NV;
  float* my_dw = dws + rib * VEC * NV;  // [j][pack] for this row slot

  // Two commit groups per row group: h/dy slots (refilled as soon as they are consumed) and the extra-gradient
  // slots (refilled after dx is written). wait_all at the top of the loop covers both.
  auto issue_hd = [&](int64_t g) {
    int tpr = tpr0, lane = lane0;
    opaque(tpr, lane);
    const int64_t row = g * a.rpb + rib;
    if (row < M) {
      const TH* hr = static_cast<const TH*>(a.h) + row * a.h_stride;
      const TD* dr = static_cast<const TD*>(a.dy) + row * a.dy_stride;
#pragma unroll
      for (int i = 0; i < ITERS; ++i) {
        const int v = lane + i * tpr;
        if (v < NV) {
          prefetch_pack(h_slot + v, hr, v * VEC, N);
          prefetch_pack(d_slot + v, dr, v * VEC, N);
        }
      }
    }
    cp_async_commit();
  };
  auto issue_e = [&](int64_t g) {
    int tpr = tpr0, lane = lane0;
    opaque(tpr, lane);
    const int64_t row = g * a.rpb + rib;
    if (row < M) {
      const void* er = extra_row<TX>(a, row);
#pragma unroll
      for (int i = 0; i < ITERS; ++i) {
        const int v = lane + i * tpr;
        if (v < NV) {
          if (a.extra_f32) {
            prefetch_pack(ef_slot + v, static_cast<const float*>(er), v * VEC, N);
          } else {
            prefetch_pack(eb_slot + v, static_cast<const TX*>(er), v * VEC, N);
          }
        }
      }
    }
    cp_async_commit();
  };

  if (want_dw) {
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {
      const int v = lane0 + i * tpr0;
      if (v < NV)
#pragma unroll
        for (int j = 0; j < VEC; ++j) my_dw[j * NV + v] = 0.f;
    }
  }

  int parity = 0;
  int64_t g = blockIdx.x;
  if (a.prefetch && g < groups) {
    issue_hd(g);
    if (has_extra) issue_e(g);
  }
  for (; g < groups; g += gridDim.x) {
    int tpr = tpr0, lane = lane0;
    opaque(tpr, lane);
    const int64_t row = g * a.rpb + rib;
    const bool valid = row < M;
    const float rs = valid ? a.rstd[row] : 0.f;
    HPack hv[ITERS];
    DPack dv[ITERS];
    if (a.prefetch) cp_async_wait_all();
    {
      const TH* hr = static_cast<const TH*>(a.h) + (valid ? row : 0) * a.h_stride;
      const TD* dr = static_cast<const TD*>(a.dy) + (valid ? row : 0) * a.dy_stride;
#pragma unroll
      for (int i = 0; i < ITERS; ++i) {
        const int v = lane + i * tpr;
        if (valid && v < NV) {
          if (a.prefetch) {
            hv[i] = h_slot[v];
            dv[i] = d_slot[v];
          } else {
            load_pack<Ld::Stream>(hv[i], hr, v * VEC, N, a.vec_ok);
            load_pack<Ld::Stream>(dv[i], dr, v * VEC, N, a.vec_ok);
          }
        } else {
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            hv[i].v[j] = zero<TH>();
            dv[i].v[j] = zero<TD>();
          }
        }
      }
    }
    float dotv[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) dotv[j] = 0.f;
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {
      const int v = lane + i * tpr;
      if (v < NV) {
        float s[VEC];
        load_scale<TX, VEC>(s, a.w, a.w_f32, a.offset, v * VEC, N, a.vec_ok);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float xhat = hv[i].f(j) * rs;
          const float d = dv[i].f(j);
          dotv[j] += d * s[j] * xhat;
          if (want_dw) my_dw[j * NV + v] += d * xhat;
        }
      }
    }
    // h/dy slots are consumed (dotv depends on all of them): refill them with the next row group now.
    if (a.prefetch && g + gridDim.x < groups) issue_hd(g + gridDim.x);
    const float c = row_reduce_sum(sum_vec(dotv), tpr, red, parity) / static_cast<float>(N);
    if (valid) {
      char* dxr = dx_row<TX>(a, row);
      const void* er = has_extra ? extra_row<TX>(a, row) : nullptr;
#pragma unroll
      for (int i = 0; i < ITERS; ++i) {
        const int v = lane + i * tpr;
        if (v < NV) {
          float s[VEC], e[VEC], o[VEC];
          load_scale<TX, VEC>(s, a.w, a.w_f32, a.offset, v * VEC, N, a.vec_ok);
          if (has_extra) {
            if (a.prefetch) {
              if (a.extra_f32) {
                const EPackF p = ef_slot[v];
#pragma unroll
                for (int j = 0; j < VEC; ++j) e[j] = p.v[j];
              } else {
                const EPackB p = eb_slot[v];
#pragma unroll
                for (int j = 0; j < VEC; ++j) e[j] = p.f(j);
              }
            } else {
              load_floats_rt<Ld::Stream, TX, VEC>(e, er, a.extra_f32, v * VEC, N, a.vec_ok);
            }
          } else {
#pragma unroll
            for (int j = 0; j < VEC; ++j) e[j] = 0.f;
          }
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const float xhat = hv[i].f(j) * rs;
            o[j] = rs * (dv[i].f(j) * s[j] - xhat * c) + e[j];
          }
          store_floats_rt<TX, VEC>(dxr, a.dx_f32, v * VEC, N, a.vec_ok, o);
        }
      }
    }
    if (a.prefetch && has_extra && g + gridDim.x < groups) issue_e(g + gridDim.x);
  }
  if (want_dw) {
    __syncthreads();  // every row slot's partial sums are complete
    // Sum the row slots in a fixed order; pack p of the block row is handled by thread p, p + blockDim, ...
    float* prow = a.partial != nullptr ? a.partial + static_cast<int64_t>(blockIdx.x) * a.pstride : nullptr;
    for (int v = threadIdx.x; v < NV; v += blockDim.x) {
      float t[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        float acc = 0.f;
        for (int r = 0; r < a.rpb; ++r) acc += dws[(r * VEC + j) * NV + v];
        t[j] = acc;
      }
      if (a.direct_dw) {
        store_floats_rt<TX, VEC>(a.dw, a.w_f32, v * VEC, N, a.vec_ok, t);
      } else {
        // Whole packs up to pstride (columns >= N hold 0): the column sum reads float4s there.
        store_floats<float, VEC>(prow, v * VEC, static_cast<int>(a.pstride), true, t);
      }
    }
  }
}

// Rows wider than the register budget: per row, pass 1 (dot product, dW partial) and pass 2 (dx, from L2).
template <typename TX, typename TH, typename TD>
__global__ void __launch_bounds__(512, 1) rms_norm_bwd_wide_kernel(const BwdArgs a) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(TX));
  // Packs in flight per thread: 4 while h + dy packs take 32 bytes (16-bit h and dy, or fp32 x), else 2 (mixed
  // fp32/16-bit packs spill at 4 on sm_80/sm_100/sm_120).
  constexpr int U = VEC * static_cast<int>(sizeof(TH) + sizeof(TD)) <= 32 ? 4 : 2;
  using HPack = Pack<TH, VEC>;
  using DPack = Pack<TD, VEC>;
  using FPack = Pack<float, VEC>;
  extern __shared__ uint4 dyn_smem[];
  __shared__ float red[64];

  const int64_t M = a.M;
  const int N = static_cast<int>(a.N), NV = (N + VEC - 1) / VEC;
  const int T = blockDim.x;
  const bool want_dw = a.partial != nullptr;
  // This block's dW partial row: in smem when it fits, else its global partial row. Thread t owns packs
  // t, t + T, ... for every row, so the read-modify-writes never race.
  FPack* acc = a.dw_smem ? reinterpret_cast<FPack*>(dyn_smem)
                         : (want_dw ? reinterpret_cast<FPack*>(a.partial + static_cast<int64_t>(blockIdx.x) * a.pstride)
                                    : nullptr);
  if (want_dw)
    for (int v = threadIdx.x; v < NV; v += T)
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[v].v[j] = 0.f;

  int parity = 0;
  for (int64_t row = blockIdx.x; row < M; row += gridDim.x) {
    const TH* hr = static_cast<const TH*>(a.h) + row * a.h_stride;
    const TD* dr = static_cast<const TD*>(a.dy) + row * a.dy_stride;
    const float rs = a.rstd[row];
    float dotv[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) dotv[j] = 0.f;
    for (int v0 = threadIdx.x; v0 < NV; v0 += U * T) {
      HPack hp[U];
      DPack dp[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int v = v0 + u * T;
        if (v < NV) {
          load_pack<Ld::Keep>(hp[u], hr, v * VEC, N, a.vec_ok);
          load_pack<Ld::Keep>(dp[u], dr, v * VEC, N, a.vec_ok);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int v = v0 + u * T;
        if (v < NV) {
          float s[VEC];
          load_scale<TX, VEC>(s, a.w, a.w_f32, a.offset, v * VEC, N, a.vec_ok);
          FPack accp;
          if (want_dw) {
            accp = acc[v];
          } else {
#pragma unroll
            for (int j = 0; j < VEC; ++j) accp.v[j] = 0.f;
          }
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const float xhat = hp[u].f(j) * rs;
            const float d = dp[u].f(j);
            dotv[j] += d * s[j] * xhat;
            accp.v[j] += d * xhat;
          }
          if (want_dw) acc[v] = accp;
        }
      }
    }
    const float c = row_reduce_sum(sum_vec(dotv), T, red, parity) / static_cast<float>(N);
    char* dxr = dx_row<TX>(a, row);
    const void* er = a.extra != nullptr ? extra_row<TX>(a, row) : nullptr;
    for (int v0 = threadIdx.x; v0 < NV; v0 += U * T) {
      HPack hp[U];
      DPack dp[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int v = v0 + u * T;
        if (v < NV) {
          load_pack<Ld::Stream>(hp[u], hr, v * VEC, N, a.vec_ok);
          load_pack<Ld::Stream>(dp[u], dr, v * VEC, N, a.vec_ok);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int v = v0 + u * T;
        if (v < NV) {
          float s[VEC], e[VEC], o[VEC];
          load_scale<TX, VEC>(s, a.w, a.w_f32, a.offset, v * VEC, N, a.vec_ok);
          if (er != nullptr) {
            load_floats_rt<Ld::Stream, TX, VEC>(e, er, a.extra_f32, v * VEC, N, a.vec_ok);
          } else {
#pragma unroll
            for (int j = 0; j < VEC; ++j) e[j] = 0.f;
          }
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const float xhat = hp[u].f(j) * rs;
            o[j] = rs * (dp[u].f(j) * s[j] - xhat * c) + e[j];
          }
          store_floats_rt<TX, VEC>(dxr, a.dx_f32, v * VEC, N, a.vec_ok, o);
        }
      }
    }
  }
  if (want_dw && a.dw_smem) {
    FPack* prow = reinterpret_cast<FPack*>(a.partial + static_cast<int64_t>(blockIdx.x) * a.pstride);
    for (int v = threadIdx.x; v < NV; v += T) prow[v] = acc[v];  // own slots: no barrier needed
  }
}

// dw[c] = sum_p partial[p, c], p in a fixed order (deterministic). Block: 8 float4 column groups x 32 slices.
template <typename TW>
__global__ void __launch_bounds__(256) rms_norm_dw_column_sum_kernel(const float* __restrict__ partial,  // [P, ps]
                                                                     int64_t pstride, int P, int64_t N,
                                                                     TW* __restrict__ dw) {  // [N]
  __shared__ float4 part[32][8];
  const int tx = threadIdx.x & 7, ty = threadIdx.x >> 3;
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * 8 + tx) * 4;
  float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
  if (col < N) {
    for (int p = ty; p < P; p += 32) {
      const float4 t = *reinterpret_cast<const float4*>(partial + p * pstride + col);  // pstride % 4 == 0
      s.x += t.x;
      s.y += t.y;
      s.z += t.z;
      s.w += t.w;
    }
  }
  part[ty][tx] = s;
  __syncthreads();
  if (ty == 0 && col < N) {
    float4 t = part[0][tx];
    for (int k = 1; k < 32; ++k) {
      const float4 q = part[k][tx];
      t.x += q.x;
      t.y += q.y;
      t.z += q.z;
      t.w += q.w;
    }
    const float r[4] = {t.x, t.y, t.z, t.w};
    for (int j = 0; j < 4 && col + j < N; ++j) dw[col + j] = from_float<TW>(r[j]);
  }
}

// ---- host: device facts, occupancy, tuning knobs -------------------------------------------------------------

constexpr int kMaxDevices = 64;
constexpr int kRowsMaxThreads = 512;  // threads per row in the rows kernels (their __launch_bounds__)
constexpr int64_t kMaxN = (1ll << 31) - 1024;  // column indices are 32-bit
constexpr int kStaticSmemMargin = 1024;  // static smem (256 B) + headroom, subtracted from the opt-in maximum

struct DeviceInfo {
  int sms = 0;
  int smem_optin = 0;  // max dynamic + static smem per block with the opt-in attribute
  int major = 0;
};

// Queried once per device and cached. (A mutex, not std::call_once: call_once binds pthread_once@GLIBC_2.34,
// which breaks manylinux_2_28.)
const DeviceInfo& device_info(int dev) {
  FM_CHECK(dev >= 0 && dev < kMaxDevices, "fused_mlp: device index ", dev, " out of range");
  static DeviceInfo infos[kMaxDevices];
  static std::atomic<bool> ready[kMaxDevices];
  static std::mutex mu;
  if (!ready[dev].load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(mu);
    if (!ready[dev].load(std::memory_order_relaxed)) {
      DeviceInfo d;
      FM_CUDA_CHECK(cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev));
      FM_CUDA_CHECK(cudaDeviceGetAttribute(&d.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
      FM_CUDA_CHECK(cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, dev));
      infos[dev] = d;
      ready[dev].store(true, std::memory_order_release);
    }
  }
  return infos[dev];
}

int64_t smem_budget(const DeviceInfo& d) { return std::max<int64_t>(0, d.smem_optin - kStaticSmemMargin); }

// Resident blocks per SM for (kernel, threads, dynamic smem) on `dev`, cached. The first use of a kernel on a
// device raises its dynamic-smem limit to the device maximum, so every later launch of it may use any size
// up to smem_budget(). 0 means the configuration cannot launch.
int blocks_per_sm(const void* kernel, int threads, int64_t smem, int dev) {
  struct Key {
    const void* k;
    int dev, threads;
    int64_t smem;
    bool operator==(const Key& o) const { return k == o.k && dev == o.dev && threads == o.threads && smem == o.smem; }
  };
  struct Hash {
    size_t operator()(const Key& k) const {
      return std::hash<const void*>()(k.k) ^ (static_cast<size_t>(k.smem) * 1000003u) ^
             (static_cast<size_t>(k.threads) << 20) ^ static_cast<size_t>(k.dev);
    }
  };
  static std::mutex mu;
  static std::unordered_map<Key, int, Hash> occ;
  static std::unordered_map<const void*, unsigned long long> raised;  // kernel -> bitmask of devices
  std::lock_guard<std::mutex> lock(mu);
  const Key key{kernel, dev, threads, smem};
  if (auto it = occ.find(key); it != occ.end()) return it->second;
  unsigned long long& mask = raised[kernel];
  if (!(mask & (1ull << dev))) {
    const int optin = device_info(dev).smem_optin;
    cudaFuncAttributes attr;
    FM_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    const int dyn_max = optin - static_cast<int>(attr.sharedSizeBytes);
    FM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dyn_max));
    mask |= 1ull << dev;
  }
  int n = 0;
  FM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, static_cast<size_t>(smem)));
  occ.emplace(key, n);
  return n;
}

// Local memory (register spills) per thread of `kernel` as compiled for device `dev`, cached. The rows kernels
// are spill-free on sm_90 (see header) but the register allocation differs per architecture (sm_100/sm_120 spill
// at 16 packs per thread): a variant that spills on this device is replaced by one with fewer packs per thread,
// or by the wide kernel.
bool kernel_spills(const void* kernel, int dev) {
  static std::mutex mu;
  static std::unordered_map<const void*, unsigned long long> known, spills;  // kernel -> device bitmasks
  std::lock_guard<std::mutex> lock(mu);
  const unsigned long long bit = 1ull << dev;
  unsigned long long& k = known[kernel];
  unsigned long long& sp = spills[kernel];
  if (!(k & bit)) {
    cudaFuncAttributes attr;
    FM_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    if (attr.localSizeBytes > 0) sp |= bit;
    k |= bit;
  }
  return (sp & bit) != 0;
}

// Knobs for the H200 tuning sweep (defaults are the shipped choices). Parsed once.
struct Tuning {
  bool fwd_prefetch = true;
  bool bwd_prefetch = true;
  bool bwd_dw_smem = true;
  int wide_threads = 512;
  int fwd_iters = 0;  // 0: table; else force packs per thread (clamped to the register budget)
  int bwd_iters = 0;
};

const Tuning& tuning() {
  static const Tuning t = [] {
    Tuning r;
    const char* env = std::getenv("FUSED_MLP_RMS_NORM_TUNE");
    if (env == nullptr) return r;
    std::string s(env);
    size_t pos = 0;
    while (pos < s.size()) {
      size_t end = s.find(',', pos);
      if (end == std::string::npos) end = s.size();
      const std::string item = s.substr(pos, end - pos);
      const size_t eq = item.find('=');
      if (eq != std::string::npos) {
        const std::string k = item.substr(0, eq);
        const int v = std::atoi(item.c_str() + eq + 1);
        if (k == "fwd_prefetch") r.fwd_prefetch = v != 0;
        else if (k == "bwd_prefetch") r.bwd_prefetch = v != 0;
        else if (k == "bwd_dw_smem") r.bwd_dw_smem = v != 0;
        else if (k == "wide_threads" && (v == 128 || v == 256 || v == 512)) r.wide_threads = v;
        else if (k == "fwd_iters" && (v == 1 || v == 2 || v == 4 || v == 8 || v == 16)) r.fwd_iters = v;
        else if (k == "bwd_iters" && (v == 1 || v == 2 || v == 4 || v == 8)) r.bwd_iters = v;
      }
      pos = end + 1;
    }
    return r;
  }();
  return t;
}

// ---- host: the config table -------------------------------------------------------------------------------

struct RowsConfig {
  int iters = 1, tpr = 1, rpb = 1;
  int threads() const { return tpr * rpb; }
};

int next_pow2(int64_t v) {
  int p = 1;
  while (p < v) p <<= 1;
  return p;
}

// Packs per thread from the row length in packs (NV): short rows take few packs per thread and many rows per
// block; long rows take more packs per thread so the threads per row stay <= max_tpr. `forced` (tuning) and
// the register budget `max_iters` bound the choice; the caller guarantees NV <= max_iters * max_tpr.
// `four_up_to`: the largest NV that still takes 4 packs per thread (fwd 1024 -> tpr <= 256 and more blocks per
// SM; bwd 2048 -> 512 threads per block, since its smem (dW + prefetch) allows one block per SM at N = 16384).
RowsConfig rows_config(int64_t NV, int max_iters, int max_tpr, int forced, int64_t M, int sms, int64_t four_up_to,
                       int64_t max_rpb = 0) {
  RowsConfig c;
  int iters = NV <= 32 ? 1 : NV <= 128 ? 2 : NV <= four_up_to ? 4 : NV <= 4096 ? 8 : 16;
  if (forced > 0) iters = forced;
  iters = std::min(iters, max_iters);
  while (iters < max_iters && (NV + iters - 1) / iters > max_tpr) iters *= 2;
  c.iters = iters;
  const int64_t need = std::max<int64_t>(1, (NV + iters - 1) / iters);
  c.tpr = need <= 32 ? next_pow2(need) : static_cast<int>((need + 31) / 32 * 32);
  int rpb = std::max(1, 256 / c.tpr);
  // Small M: one row group per SM before packing rows together (latency: all SMs work on a short batch).
  const int64_t per_sm = std::max<int64_t>(1, (M + sms - 1) / sms);
  if (rpb > per_sm) rpb = static_cast<int>(per_sm);
  const int min_rpb = c.tpr < 32 ? 32 / c.tpr : 1;  // blocks are whole warps
  if (max_rpb > 0) rpb = static_cast<int>(std::min<int64_t>(rpb, std::max<int64_t>(max_rpb / min_rpb * min_rpb, 1)));
  c.rpb = (rpb + min_rpb - 1) / min_rpb * min_rpb;
  return c;
}

// ---- host: the few-rows (decode) forward path --------------------------------------------------------------

// Tuning table of the few-rows path (rms_norm_fwd_small_kernel).
//   packs per thread by row length in packs NV (threads per row = NV / packs): N <= 2048 bf16 -> 1 pack,
//     4096 -> 2, 8192/16384 -> 4, i.e. 256-512 threads per row (not swept yet: the knob's ",packs=" does).
//   "auto" takes it up to M = 64, and for 16-bit rows of N = 2048..8192 up to M * N = 2^21 elements (M = 1024 / 512
//   / 256 at N = 2048 / 4096 / 8192): 0.43-0.98x the reg kernel's CUDA-graph time there, plain and fused add, with and
//   without PDL (H200) -- docs/tuning-log.md#rms-norm-decode. FUSED_MLP_RMS_NORM_SMALL=on|off forces it.
int small_table_packs(int64_t NV) { return NV <= 256 ? 1 : NV <= 512 ? 2 : NV <= 2048 ? 4 : 0; }
constexpr int64_t kSmallMaxElems16 = int64_t{1} << 21;
int64_t small_max_rows(int64_t N, int64_t elem) {
  return elem == 2 && N >= 2048 && N <= 8192 ? std::max<int64_t>(64, kSmallMaxElems16 / N) : 64;
}

// Programmatic dependent launch of the few-rows kernel on sm_90+ (FUSED_MLP_RMS_NORM_PDL=0 turns it off; read per
// call, so one process can A/B it) -- docs/tuning-log.md#rms-norm-decode
bool small_pdl(const DeviceInfo& info) {
  if (info.major < 9) return false;
  const char* e = std::getenv("FUSED_MLP_RMS_NORM_PDL");
  return e == nullptr || e[0] != '0';
}

// FUSED_MLP_RMS_NORM_SMALL = auto | on | off [,packs=1|2|4|8] (common.cuh: SmallKnob), read once per process
// (knob_dynamic: at every call).
SmallKnob rms_small_knob() {
  static const SmallKnobReader reader("FUSED_MLP_RMS_NORM_SMALL", "packs");
  return reader.get();
}

constexpr int small_max_threads(int packs) { return packs >= 8 ? 256 : 512; }  // the kernel's __launch_bounds__

struct SmallConfig {
  int packs = 0, tpr = 0, rpb = 1, tpr_shift = 10;
  int threads() const { return tpr * rpb; }
};

// Packs per thread, threads per row and rows per block of the few-rows kernel for rows of NV packs; false when such
// a row does not fit it. `forced`: packs per thread from the knob (0: the table), ignored where it cannot hold the row.
bool small_config(int64_t NV, int64_t M, int sms, int forced, SmallConfig& c) {
  int packs = small_table_packs(NV);
  const bool valid_forced = forced == 1 || forced == 2 || forced == 4 || forced == 8;
  if (valid_forced && (NV + forced - 1) / forced <= small_max_threads(forced)) packs = forced;
  if (packs == 0 || NV < 1) return false;
  const int64_t need = (NV + packs - 1) / packs;
  const int tpr = need <= 32 ? next_pow2(need) : static_cast<int>((need + 31) / 32 * 32);
  if (tpr > small_max_threads(packs)) return false;
  int rpb = 1;
  if ((tpr & (tpr - 1)) == 0 && tpr < 128) {
    // Short rows: up to 128-thread blocks of several rows, but first one row group per SM (a short batch spreads
    // over all SMs); a block is whole warps.
    const int64_t per_sm = std::max<int64_t>(1, (M + sms - 1) / sms);
    rpb = static_cast<int>(std::min<int64_t>(128 / tpr, per_sm));
    const int min_rpb = tpr < 32 ? 32 / tpr : 1;
    rpb = (rpb + min_rpb - 1) / min_rpb * min_rpb;
  }
  int shift = 0;
  while ((1 << shift) < tpr) ++shift;
  c.packs = packs;
  c.tpr = tpr;
  c.rpb = rpb;
  c.tpr_shift = rpb > 1 ? shift : 10;  // rpb == 1: tid >> 10 == 0 for every thread
  return true;
}

bool rows_aligned16(const Tensor& t) {
  const auto p = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  return (p & 15) == 0 && (t.size(0) <= 1 || (t.stride(0) * t.element_size()) % 16 == 0);
}

// A contiguous [M, N] output (any rank): base pointer and row pitch N * elem_size 16-byte aligned.
bool out_rows_aligned16(const Tensor& t, int64_t M, int64_t N) {
  const auto p = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  return (p & 15) == 0 && (M <= 1 || (N * t.element_size()) % 16 == 0);
}

bool ptr_aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

void check_rows_cuda(const Tensor& t, const char* name, const Tensor& ref) {
  FM_CHECK(t.is_cuda(), "fused_mlp: ", name, " must be a CUDA tensor");
  FM_CHECK(same_cuda_device(t, ref), "fused_mlp: ", name, " is on ", device_str(t), " but expected ", device_str(ref));
  FM_CHECK(t.dim() == 2, "fused_mlp: ", name, " must be 2-D [rows, hidden], got ", t.dim(), "-D");
  FM_CHECK(t.size(1) <= 1 || t.stride(1) == 1, "fused_mlp: ", name, " must have unit stride along hidden");
}

bool is_base_or_f32(ScalarType t, ScalarType base) { return t == base || t == kFloat; }

// Host dispatch of the base (x) dtype and of a dtype that is the base or fp32.
template <typename F>
void dispatch_base(ScalarType t, F&& f) { dispatch_float(t, "x", std::forward<F>(f)); }

template <typename TB, typename F>
void dispatch_b_or_f32(bool f32, F&& f) {
  if (f32) {
    f(float{});
  } else {
    f(TB{});
  }
}

template <int... Is, typename F>
void dispatch_int(int v, F&& f) {
  bool done = false;
  ((v == Is && !done ? (f(std::integral_constant<int, Is>{}), done = true) : false), ...);
  FM_CHECK(done, "fused_mlp: internal error: unsupported config value ", v);
}

// The backward's register kernel and its launcher (aligned rows): see the header's comment.
#include "cuda/rms_norm_bwd.cuh"

// ---- host: the aligned register-row forward ("reg" family) ---------------------------------------------------

// FUSED_MLP_RMS_NORM_FWD = auto | reg | legacy | l2 | lean [,cluster=2|4|8] [,packs=1|2|4|8] [,ctas=K] [,wpre=0|1]
// [,ld=0|1], read
// once per process (common.cuh knob_dynamic: at every call, so a benchmark can A/B in one process). auto: the reg
// kernels for aligned rows of whole packs, after the few-rows path's own switch; reg: the reg kernels wherever they
// apply, ahead of that switch; legacy: the rows / wide kernels as before the reg family. cluster=C (sm_90+): every reg
// launch takes clusters of C CTAs (tests and sweeps; auto takes clusters only beyond one CTA's reach). packs=P (P <=
// the dtype's maximum): every reg launch holds P packs per thread, the threads per row following (tests and tuning
// sweeps). l2: the l2 kernel wherever it applies (aligned rows of whole packs, a weight and y of x's dtype), ctas=K of
// them per SM (at most the resident count); auto takes it on sm_90 for >= 1024 16-bit rows of 32768..65536. wpre=0
// keeps the 4-packs reg kernel's weight load after the reduction (1, the default where it applies: with the row).
// lean: the lean kernel wherever it applies (packs=P: P packs per thread, N / (8 P) threads, among the instantiated
// pairs), ahead of the few-rows switch; elsewhere as auto without packs= / cluster=. Auto's l2 and lean classes
// ignore packs= and cluster=. ld=1 / 0: the reg and lean kernels load the row with the default cache policy /
// evict-first at every M (auto: by M, kKeepLoadsMinRows*).
struct FwdKnob {
  enum Mode { kAuto, kReg, kLegacy, kL2, kLean };
  Mode mode = kAuto;
  int cluster = 0;
  int packs = 0;  // packs per thread of the reg kernels (0: the table's)
  int ctas = 0;   // l2 kernel: CTAs per SM (0: every resident one, launch_fwd_l2)
  int ld = -1;    // reg and lean kernels: 1 / 0 = row loads with the default cache policy / evict-first; -1: by M
  int wpre = -1;  // reg kernel: 1 / 0 = weight loaded with the row or after the reduction; -1: launch_fwd_reg's choice
};

FwdKnob parse_fwd_knob(const char* e) {
  FwdKnob k;
  if (e == nullptr) return k;
  const std::string s(e);
  const std::string body = s.rfind("dynamic,", 0) == 0 ? s.substr(8) : s;  // "dynamic,<mode>,..." (rms_fwd_knob)
  const std::string head = body.substr(0, body.find(','));
  if (head == "reg") k.mode = FwdKnob::kReg;
  else if (head == "legacy") k.mode = FwdKnob::kLegacy;
  else if (head == "l2") k.mode = FwdKnob::kL2;
  else if (head == "lean") k.mode = FwdKnob::kLean;
  if (const int c = knob_value(s, "cluster", 0); c == 2 || c == 4 || c == 8) k.cluster = c;
  if (const int p = knob_value(s, "packs", 0); p == 1 || p == 2 || p == 4 || p == 8) k.packs = p;
  if (const int c = knob_value(s, "ctas", 0); c >= 1 && c <= 32) k.ctas = c;
  if (const int v = knob_value(s, "wpre", -1); v == 0 || v == 1) k.wpre = v;
  if (const int v = knob_value(s, "ld", -1); v == 0 || v == 1) k.ld = v;
  return k;
}

FwdKnob rms_fwd_knob() {
  static const char* const var = "FUSED_MLP_RMS_NORM_FWD";
  static const bool dynamic = knob_dynamic(std::getenv(var));
  static const FwdKnob fixed = parse_fwd_knob(std::getenv(var));
  return dynamic ? parse_fwd_knob(std::getenv(var)) : fixed;
}

// Packs per thread the reg kernel may hold: the loaded 16-byte units per pack (x, plus the residual's) times the
// packs <= 8 units = 32 registers of row data per thread -- docs/tuning-log.md#rmsnorm-reg-config.
template <typename TX, typename TH, bool RES>
constexpr int reg_max_packs() {
  constexpr int units = 1 + (RES ? Pack<TH, 16 / static_cast<int>(sizeof(TX))>::kUnits : 0);
  return units == 1 ? 8 : units == 2 ? 4 : 2;
}

struct RegConfig {
  int packs = 0, tpr = 0, rpb = 1, tpr_shift = 10, csize = 1, c_shift = 0;
  int64_t nvc = 0;
  int threads() const { return tpr * rpb; }
};

// The reg family's config table (rows of NV packs; pmax from reg_max_packs) -- docs/tuning-log.md#rmsnorm-reg-config:
//   NV <= 32 * pmax: one CTA row group, packs = the fewest (power of two) that fit a warp, tpr = next_pow2(NV / packs)
//     <= 32 (sub-warp / warp per row), 256-thread CTAs of 256 / tpr rows (fewer for small M: one group per SM first);
//   NV <= 512 * pmax: packs = pmax, tpr = NV / pmax rounded up to whole warps (64..512), 256 / tpr rows per CTA
//     when tpr is a power of two, else 1;
//   beyond (sm_90+): a cluster of C = 2, 4 or 8 CTAs (the fewest with <= 256 threads each, else 8 of up to 512), each
//     holding ceil(NV / C) packs; no cluster support or NV > 4096 * pmax: false (the rows / wide kernels).
bool reg_config(int64_t NV, int64_t M, int sms, int pmax, bool cluster_ok, int forced_cluster, int forced_packs,
                RegConfig& c) {
  if (NV < 1 || forced_packs > pmax) return false;
  const int pc = forced_packs > 0 ? forced_packs : pmax;  // the packs per thread the cluster size is chosen for
  int C = 1;
  if (forced_cluster > 1) {
    if (!cluster_ok) return false;
    C = forced_cluster;
  } else if (NV > static_cast<int64_t>(kRegMaxThreads) * pc) {
    if (!cluster_ok) return false;
    C = 2;
    while (C < 8 && NV > static_cast<int64_t>(C) * 256 * pc) C *= 2;
  }
  const int64_t nvc = (NV + C - 1) / C;
  if (nvc > static_cast<int64_t>(kRegMaxThreads) * pc) return false;
  int packs = pmax, tpr;
  if (forced_packs > 0) {
    packs = forced_packs;
    const int64_t t = (nvc + packs - 1) / packs;
    tpr = C == 1 && t <= 32 ? next_pow2(t) : static_cast<int>((t + 31) / 32 * 32);
  } else if (C == 1 && nvc <= 32 * pmax) {
    packs = 1;
    while (packs < pmax && nvc > 32 * packs) packs *= 2;
    tpr = next_pow2((nvc + packs - 1) / packs);
  } else if (C == 1 && pmax == 4 && nvc <= 256) {
    // With a residual of x's dtype, rows of 129..256 packs (bf16 N = 2048): one pack per thread, one row per CTA,
    // 32 registers: 8 CTAs per SM instead of 4 (32768 x 2048: 3.8 -> 4.0 TB/s) -- docs/tuning-log.md#rmsnorm-reg-config
    packs = 1;
    tpr = static_cast<int>((nvc + 31) / 32 * 32);
  } else {
    tpr = static_cast<int>(((nvc + pmax - 1) / pmax + 31) / 32 * 32);
    // Over a quarter of the thread slots idle (N = 2304 bf16: 36 of 64 threads busy): half the packs, the threads to
    // match (32768 x 2304: 3.83 -> 4.08 TB/s on the H200) -- docs/tuning-log.md#rmsnorm-reg-config
    if (C == 1 && pmax > 1 && 4 * (static_cast<int64_t>(tpr) * pmax - nvc) > static_cast<int64_t>(tpr) * pmax) {
      packs = pmax / 2;
      tpr = static_cast<int>(((nvc + packs - 1) / packs + 31) / 32 * 32);
    }
  }
  int rpb = 1;
  if (C == 1 && (tpr & (tpr - 1)) == 0 && tpr <= 128) {
    const int64_t per_sm = std::max<int64_t>(1, (M + sms - 1) / sms);
    rpb = static_cast<int>(std::min<int64_t>(256 / tpr, per_sm));
    const int min_rpb = tpr < 32 ? 32 / tpr : 1;  // CTAs are whole warps
    rpb = (rpb + min_rpb - 1) / min_rpb * min_rpb;
  }
  int shift = 0;
  while ((1 << shift) < tpr) ++shift;
  int cs = 0;
  while ((1 << cs) < C) ++cs;
  const int64_t grid = C > 1 ? M * C : (M + rpb - 1) / rpb;
  if (grid > 0x7fffffff) return false;
  c.packs = packs;
  c.tpr = tpr;
  c.rpb = rpb;
  c.tpr_shift = rpb > 1 ? shift : 10;
  c.csize = C;
  c.c_shift = cs;
  c.nvc = nvc;
  return true;
}

// Clusters of `csize` CTAs of `threads` threads that can be resident at once on `dev` (0: the config cannot launch),
// cached per (kernel, device, threads, csize).
int reg_active_clusters(const void* kernel, int threads, int csize, int dev) {
  static std::mutex mu;
  static std::unordered_map<std::string, int> known;
  std::ostringstream key;
  key << kernel << ':' << dev << ':' << threads << ':' << csize;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = known.find(key.str()); it != known.end()) return it->second;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(csize), 1, 1);
  cfg.blockDim = dim3(static_cast<unsigned>(threads), 1, 1);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(csize);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the (non-sticky) error: the caller takes the other kernels
    n = 0;
  }
  known.emplace(key.str(), n);
  return n;
}

// The kernel-argument fields the reg, l2 and few-rows launchers share (FwdRegArgs, FwdSmallArgs), from the forward's
// arguments (nv packs per row); each launcher sets its own row split.
template <typename B>
B row_kernel_args(const FwdArgs& a, int64_t nv) {
  B b{};
  b.x = a.x;
  b.x_stride = a.x_stride;
  b.res = a.res;
  b.res_stride = a.res_stride;
  b.h = a.h;
  b.w = a.w;
  b.y = a.y;
  b.rstd = a.rstd;
  b.M = a.M;
  b.N = static_cast<int>(a.N);
  b.nv = static_cast<int>(nv);
  b.inv_n = static_cast<float>(1.0 / static_cast<double>(a.N));
  b.eps = a.eps;
  b.offset = a.offset;
  b.w_f32 = a.w_f32;
  b.y_f32 = a.y_f32;
  return b;
}

// The lean kernel's row classes on sm_90 (auto): 16-bit rows of 1024 packs (N = 8192) as 2 packs x 512 threads, from
// kLeanMinRows rows -- docs/tuning-log.md#rmsnorm-lean
constexpr int64_t kLeanMinRows = 1024;
// Row loads with the default cache policy instead of evict-first from these row counts (H200: +1.5-5% per call from
// 16384 rows in the reg kernel, from 8192 in the lean one; -1..-4% at 4096) -- docs/tuning-log.md#rmsnorm-lean
constexpr int64_t kKeepLoadsMinRowsReg = 16384;
constexpr int64_t kKeepLoadsMinRowsLean = 8192;
// ... and from 4096 rows for 16-bit rows of 8192..16384 elements (H100: +0.7-1.6% per call at 4096 / 8192 x 8192 /
// 16384, plain and with a residual; longer rows not measured) -- docs/tuning-log.md#rmsnorm-fwd-variants
constexpr int64_t kKeepLoadsLongRowMinRows = 4096;
inline bool keep_loads_long_rows(int64_t M, int64_t N, size_t elem) {
  return elem == 2 && M >= kKeepLoadsLongRowMinRows && N >= 8192 && N <= 16384;
}

// Launches the lean kernel for this call when it applies (16-bit x, h of x's dtype, a weight and y of x's dtype, rows
// of an instantiated (packs, threads) pair: the table's, or forced_packs with N / (8 forced_packs) threads); false:
// the caller takes the reg family.
template <typename TX, typename TH, bool RES>
bool launch_fwd_lean(const FwdArgs& a, int dev, int forced_packs, int ld, cudaStream_t stream) {
  if constexpr (sizeof(TX) != 2 || !std::is_same_v<TX, TH>) {
    return false;
  } else {
    constexpr int VEC = 8;
    if (a.w == nullptr || a.w_f32 || a.y_f32 || a.N % VEC != 0 || a.M > 0x7fffffff) return false;
    const int64_t NV = a.N / VEC;
    const int P = forced_packs > 0 ? forced_packs : NV == 1024 ? 2 : 0;
    if (P == 0 || NV % P != 0) return false;
    const int64_t T = NV / P;
    void (*kern)(FwdRegArgs) = nullptr;
    if (P == 1 && T == 512) kern = &rms_norm_fwd_lean_kernel<TX, RES, 1, 512>;
    else if (P == 2 && T == 256) kern = &rms_norm_fwd_lean_kernel<TX, RES, 2, 256>;
    else if (P == 2 && T == 512) kern = &rms_norm_fwd_lean_kernel<TX, RES, 2, 512>;
    else if (P == 4 && T == 256) kern = &rms_norm_fwd_lean_kernel<TX, RES, 4, 256>;
    else if (P == 4 && T == 512) kern = &rms_norm_fwd_lean_kernel<TX, RES, 4, 512>;
    if (kern == nullptr || kernel_spills(reinterpret_cast<const void*>(kern), dev)) return false;
    FwdRegArgs b = row_kernel_args<FwdRegArgs>(a, NV);
    b.ld_keep = ld >= 0 ? ld == 1
                        : a.M >= kKeepLoadsMinRowsLean || keep_loads_long_rows(a.M, a.N, sizeof(TX));
    kern<<<static_cast<unsigned>(a.M), static_cast<unsigned>(T), 0, stream>>>(b);
    FM_KERNEL_LAUNCH_CHECK();
    return true;
  }
}

// Launches the reg kernel for this call when it applies; false: the caller takes the rows / wide kernels.
template <typename TX, typename TH, bool RES>
bool launch_fwd_reg(const FwdArgs& a, const DeviceInfo& info, int dev, int forced_cluster, int forced_packs,
                    cudaStream_t stream, int wpre, int ld) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(TX));
  constexpr int kPmax = reg_max_packs<TX, TH, RES>();
  const int64_t N = a.N, M = a.M;
  if (N % VEC != 0 || N > (int64_t{1} << 24)) return false;
  const int64_t NV = N / VEC;
  // 16-bit rows of 1985..2048 packs (N = 16384: 4 packs fill 512 threads) without a residual, M >= 8192, sm_90: 4
  // packs x 512 threads (2 CTAs per SM) instead of the table's 8 x 256 (3 per SM): 16384 x 16384 3.85 -> 3.96 TB/s,
  // 8192 rows 3.76 -> 3.85; 4096 rows and N = 12800 (416 threads) keep the table -- docs/tuning-log.md#rmsnorm-reg-config
  if (forced_packs == 0 && forced_cluster == 0 && !RES && sizeof(TX) == 2 && info.major == 9 && NV > 1984 &&
      NV <= 2048 && M >= 8192)
    forced_packs = 4;
  // 16-bit rows of 129..768 packs (N = 1032..6144) without a residual, sm_90: 4 packs (with a weight and y of x's
  // dtype, the weight loaded with the row, below) where the table takes 8 -- docs/tuning-log.md#rmsnorm-reg-config
  if (forced_packs == 0 && forced_cluster == 0 && !RES && sizeof(TX) == 2 && info.major == 9 && NV > 128 && NV <= 768)
    forced_packs = 4;
  RegConfig c;
  if (!reg_config(NV, M, info.sms, kPmax, info.major >= 9, forced_cluster, forced_packs, c)) return false;
  FwdRegArgs b = row_kernel_args<FwdRegArgs>(a, NV);
  b.ld_keep = ld >= 0 ? ld == 1
                      : info.major == 9 && (M >= kKeepLoadsMinRowsReg || keep_loads_long_rows(M, N, sizeof(TX)));
  b.nvc = static_cast<int>(c.nvc);
  b.tpr = c.tpr;
  b.tpr_shift = c.tpr_shift;
  b.rpb = c.rpb;
  b.c_shift = c.c_shift;
  bool launched = false;
  dispatch_int<1, 2, 4, 8>(c.packs, [&](auto pk) {
    constexpr int P = decltype(pk)::value;
    if constexpr (P <= kPmax) {
      auto* const plain = &rms_norm_fwd_reg_kernel<TX, TH, RES, P>;
      auto* kern = plain;
      if constexpr (sizeof(TX) == 2 && std::is_same_v<TX, TH> && P == 4) {
        // The weight loaded with the row (sm_90, where it was measured; a weight and y of x's dtype, one CTA per row
        // group) unless the knob says 0
        if (wpre != 0 && info.major == 9 && c.csize == 1 && a.w != nullptr && !a.w_f32 && !a.y_f32)
          kern = &rms_norm_fwd_reg_kernel<TX, TH, RES, P, true>;
      }
      // A kernel that spills on this device (sm_100/120 may allocate differently): the plain one, else the caller's.
      if (kernel_spills(reinterpret_cast<const void*>(kern), dev)) {
        if (kern == plain || kernel_spills(reinterpret_cast<const void*>(plain), dev)) return;
        kern = plain;
      }
      if (c.csize == 1) {
        const int64_t grid = (M + c.rpb - 1) / c.rpb;
        kern<<<static_cast<unsigned>(grid), c.threads(), 0, stream>>>(b);
        FM_KERNEL_LAUNCH_CHECK();
        launched = true;
        return;
      }
      if (reg_active_clusters(reinterpret_cast<const void*>(kern), c.threads(), c.csize, dev) < 1) return;
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(static_cast<unsigned>(M * c.csize), 1, 1);
      cfg.blockDim = dim3(static_cast<unsigned>(c.threads()), 1, 1);
      cfg.dynamicSmemBytes = 0;
      cfg.stream = stream;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = static_cast<unsigned>(c.csize);
      attr[0].val.clusterDim.y = 1;
      attr[0].val.clusterDim.z = 1;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      FM_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kern, b));
      launched = true;
    }
  });
  return launched;
}

// Launches the l2 kernel for this call when it applies (aligned rows of whole packs, a weight and y of x's dtype, a
// spill-free build); false: the caller takes another kernel. Grid: SMs x the resident CTAs per SM (2 without a
// residual, 1 with one: registers), or `forced_ctas` per SM (at most the resident count). Sizing it to keep the rows
// in flight within half the L2 (1 CTA per SM at N = 65536) read 7% lower -- docs/tuning-log.md#rmsnorm-reg-config.
template <typename TX, typename TH, bool RES>
bool launch_fwd_l2(const FwdArgs& a, const DeviceInfo& info, int dev, int forced_ctas, cudaStream_t stream) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(TX));
  const int64_t N = a.N, M = a.M;
  if (N == 0 || N % VEC != 0 || N > (int64_t{1} << 24)) return false;
  if (a.w == nullptr || a.w_f32 || a.y_f32) return false;  // the kernel's one weight / output variant
  auto* kern = &rms_norm_fwd_l2_kernel<TX, TH, RES, kL2Unroll>;
  if (kernel_spills(reinterpret_cast<const void*>(kern), dev)) return false;
  const int occ = blocks_per_sm(reinterpret_cast<const void*>(kern), kL2Threads, 0, dev);
  if (occ < 1) return false;
  const int64_t per_sm = forced_ctas > 0 ? std::min(forced_ctas, occ) : occ;
  const int64_t grid = std::min<int64_t>(M, per_sm * info.sms);
  const FwdRegArgs b = row_kernel_args<FwdRegArgs>(a, N / VEC);
  kern<<<static_cast<unsigned>(grid), kL2Threads, 0, stream>>>(b);
  FM_KERNEL_LAUNCH_CHECK();
  return true;
}

}  // namespace
}  // namespace fused_mlp::cuda

using namespace fused_mlp::cuda;

namespace {
// The forward's outputs: h only with a residual, rstd only where the caller keeps it (not the inference entries:
// two allocations less per call, docs/tuning-log.md#host-path).
struct FwdOut {
  Tensor y;
  std::optional<Tensor> h, rstd;
};

FwdOut rms_norm_fwd_impl(const Tensor& x_in, const std::optional<Tensor>& residual_in,
                         const std::optional<Tensor>& weight, double eps, double offset, ScalarType out_dtype,
                         std::optional<ScalarType> residual_dtype, bool keep_rstd) {
  // [..., N] inputs are viewed as [M, N] rows here (cheap in C++); outputs take x's shape.
  FM_CHECK(x_in.dim() >= 1, "fused_mlp: x must have at least one dimension [..., N]");
  const Tensor x = fused_mlp::as_rows_view(x_in);
  const std::optional<Tensor> residual =
      residual_in.has_value() ? std::optional<Tensor>(fused_mlp::as_rows_view(*residual_in)) : std::nullopt;
  check_rows_cuda(x, "x", x);
  const int64_t M = x.size(0), N = x.size(1);
  FM_CHECK(N <= kMaxN, "fused_mlp: rms_norm supports rows of up to ", kMaxN, " elements, got ", N);
  const ScalarType xt = x.scalar_type();
  FM_CHECK(xt == kFloat || xt == kHalf || xt == kBFloat16,
           "fused_mlp: x must be float32/float16/bfloat16, got ", xt);
  const ScalarType h_dtype = residual_dtype.value_or(xt);
  FM_CHECK(is_base_or_f32(h_dtype, xt), "fused_mlp: residual_dtype must be x's dtype or float32, got ", h_dtype);
  FM_CHECK(is_base_or_f32(out_dtype, xt), "fused_mlp: out_dtype must be x's dtype or float32, got ", out_dtype);
  if (residual.has_value()) {
    check_rows_cuda(*residual, "residual", x);
    FM_CHECK(fused_mlp::same_shape(*residual_in, x_in), "fused_mlp: residual shape ", fused_mlp::shape_str(*residual_in),
             " != x shape ", fused_mlp::shape_str(x_in));
    FM_CHECK(residual->scalar_type() == h_dtype, "fused_mlp: residual dtype ", residual->scalar_type(),
             " must equal residual_dtype ", h_dtype);
  }
  if (weight.has_value()) {
    FM_CHECK(same_cuda_device(*weight, x), "fused_mlp: weight must be on ", device_str(x));
    FM_CHECK(weight->dim() == 1 && weight->size(0) == N && weight->is_contiguous(),
             "fused_mlp: weight must be contiguous [", N, "]");
    FM_CHECK(is_base_or_f32(weight->scalar_type(), xt), "fused_mlp: weight must be x's dtype or float32, got ",
             weight->scalar_type());
  }
  DeviceGuard guard(x);
  FwdOut out{fused_mlp::empty(fused_mlp::sizes_of(x_in), out_dtype, x), std::nullopt, std::nullopt};
  if (residual.has_value()) out.h = fused_mlp::empty(fused_mlp::sizes_of(x_in), h_dtype, x);
  if (keep_rstd) out.rstd = fused_mlp::empty({M}, kFloat, x);
  if (M == 0) return out;
  const Tensor& y = out.y;

  const int dev = device_index(x);
  const DeviceInfo& info = device_info(dev);
  const Tuning& tune = tuning();
  const SmallKnob small = rms_small_knob();
  const FwdKnob fwd = rms_fwd_knob();
  const auto stream = current_stream(x);
  const bool has_res = residual.has_value();

  FwdArgs a{};
  a.x = x.const_data_ptr();
  a.x_stride = x.stride(0);
  a.res = has_res ? residual->const_data_ptr() : nullptr;
  a.res_stride = has_res ? residual->stride(0) : 0;
  a.h = has_res ? out.h->data_ptr() : nullptr;
  a.w = weight.has_value() ? weight->const_data_ptr() : nullptr;
  a.y = y.data_ptr();
  a.rstd = keep_rstd ? static_cast<float*>(out.rstd->data_ptr()) : nullptr;
  a.M = M;
  a.N = N;
  a.eps = static_cast<float>(eps);
  a.offset = static_cast<float>(offset);
  a.w_f32 = weight.has_value() && weight->scalar_type() == kFloat;
  a.y_f32 = out_dtype == kFloat;
  a.vec_ok = rows_aligned16(x) && out_rows_aligned16(y, M, N) &&
             (!has_res || (rows_aligned16(*residual) && out_rows_aligned16(*out.h, M, N))) &&
             (a.w == nullptr || ptr_aligned16(a.w));

  dispatch_base(xt, [&](auto xtag) {
    using TX = decltype(xtag);
    constexpr int VEC = 16 / static_cast<int>(sizeof(TX));
    const int64_t NV = (N + VEC - 1) / VEC;
    auto run = [&](auto htag, auto res_tag) {
      using TH = decltype(htag);
      constexpr bool RES = decltype(res_tag)::value;
      // Aligned rows of whole packs: the reg family (FUSED_MLP_RMS_NORM_FWD=reg: ahead of the few-rows switch).
      const bool reg_ok = fwd.mode != FwdKnob::kLegacy && a.vec_ok;
      if (reg_ok && fwd.mode == FwdKnob::kL2 && launch_fwd_l2<TX, TH, RES>(a, info, dev, fwd.ctas, stream)) return;
      if (reg_ok && fwd.mode == FwdKnob::kReg && launch_fwd_reg<TX, TH, RES>(a, info, dev, fwd.cluster, fwd.packs, stream, fwd.wpre, fwd.ld)) return;
      if (reg_ok && fwd.mode == FwdKnob::kLean && launch_fwd_lean<TX, TH, RES>(a, dev, fwd.packs, fwd.ld, stream))
        return;
      const bool auto_mode = fwd.mode == FwdKnob::kAuto || fwd.mode == FwdKnob::kLean;
      // Few rows (decode): the latency-first kernel, for aligned rows of whole packs up to its N classes.
      if (small.mode != SmallKnob::kOff && a.vec_ok && N % VEC == 0 && M < (int64_t{1} << 31) &&
          (small.mode == SmallKnob::kOn || M <= small_max_rows(N, static_cast<int64_t>(sizeof(TX))))) {
        SmallConfig sc;
        if (small_config(NV, M, info.sms, small.value, sc)) {
          FwdSmallArgs b = row_kernel_args<FwdSmallArgs>(a, NV);
          b.tpr = sc.tpr;
          b.tpr_shift = sc.tpr_shift;
          b.rpb = sc.rpb;
          const int64_t grid = (M + sc.rpb - 1) / sc.rpb;  // one row group per block: no loop, no persistence
          if (b.w == nullptr) b.offset = 0.f;  // no weight: the kernel scales by offset + 1 = 1
          dispatch_b_or_f32<TX>(b.w_f32, [&](auto wtag) {
            using TW = decltype(wtag);
            dispatch_int<1, 2, 4, 8>(sc.packs, [&](auto pk) {
              auto* kern = &rms_norm_fwd_small_kernel<TX, TH, TW, RES, decltype(pk)::value>;
              if (!small_pdl(info)) {
                kern<<<static_cast<unsigned>(grid), sc.threads(), 0, stream>>>(b);
                FM_KERNEL_LAUNCH_CHECK();
                return;
              }
              cudaLaunchConfig_t cfg = {};
              cfg.gridDim = dim3(static_cast<unsigned>(grid), 1, 1);
              cfg.blockDim = dim3(static_cast<unsigned>(sc.threads()), 1, 1);
              cfg.stream = stream;
              cudaLaunchAttribute attr[1];
              attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
              attr[0].val.programmaticStreamSerializationAllowed = 1;
              cfg.attrs = attr;
              cfg.numAttrs = 1;
              FM_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kern, b));
            });
          });
          return;
        }
      }
      // Long 16-bit rows (32768 <= N <= 65536, M >= 1024) with a weight and y of x's dtype and no fp32 stream, sm_90:
      // the l2 kernel, 1.02-1.16x the reg family there (0.92x at N = 24576 and 131072). The bounds are the measured
      // ones; fewer rows (one CTA per row: idle SMs where the reg kernel splits a row over a cluster) keep reg
      // -- docs/tuning-log.md#rmsnorm-reg-config.
      if (reg_ok && auto_mode && info.major == 9 && sizeof(TX) == 2 && std::is_same_v<TX, TH> &&
          M >= 1024 && N >= 32768 && N <= 65536 && launch_fwd_l2<TX, TH, RES>(a, info, dev, 0, stream))
        return;
      // Rows of the lean kernel's classes (sm_90, where they were measured) -- docs/tuning-log.md#rmsnorm-lean
      // (lean mode tried it above with its own packs)
      if (reg_ok && fwd.mode == FwdKnob::kAuto && info.major == 9 && M >= kLeanMinRows &&
          launch_fwd_lean<TX, TH, RES>(a, dev, 0, fwd.ld, stream))
        return;
      // The reg family for every M (the few-rows kernel above only when its knob says so); it declines rows it
      // cannot hold (sm < 90 beyond one CTA, N > 4096 * pmax packs): those take the kernels below. Lean mode's
      // packs= are the lean kernel's, not passed on.
      const bool lean_mode = fwd.mode == FwdKnob::kLean;
      if (reg_ok && auto_mode &&
          launch_fwd_reg<TX, TH, RES>(a, info, dev, lean_mode ? 0 : fwd.cluster, lean_mode ? 0 : fwd.packs, stream,
                                      fwd.wpre, fwd.ld))
        return;
      constexpr int kHeldUnits = Pack<TH, VEC>::kUnits;      // 16-byte units per held pack
      constexpr int kMaxIters = kHeldUnits == 1 ? 16 : 8;    // register budget (header)
      const int64_t res_unit_bytes = RES ? 16 * kHeldUnits : 0;
      auto rows_kernel = [](int iters) -> const void* {
        const void* k = nullptr;
        dispatch_int<1, 2, 4, 8, 16>(iters, [&](auto it) {
          if constexpr (decltype(it)::value <= kMaxIters)
            k = reinterpret_cast<const void*>(&rms_norm_fwd_rows_kernel<TX, TH, RES, decltype(it)::value>);
        });
        return k;
      };
      bool use_rows = NV <= static_cast<int64_t>(kMaxIters) * kRowsMaxThreads;
      RowsConfig c;
      if (use_rows) {
        c = rows_config(NV, kMaxIters, kRowsMaxThreads, tune.fwd_iters, M, info.sms, 1024);
        while (kernel_spills(rows_kernel(c.iters), dev)) {
          if (c.iters == 1 || NV > static_cast<int64_t>(c.iters / 2) * kRowsMaxThreads) {
            use_rows = false;  // fewer packs per thread cannot cover the row: the wide kernel does not spill
            break;
          }
          c = rows_config(NV, c.iters / 2, kRowsMaxThreads, 0, M, info.sms, 1024);
        }
      }
      if (use_rows) {
        a.tpr = c.tpr;
        a.rpb = c.rpb;
        const int64_t groups = (M + c.rpb - 1) / c.rpb;
        dispatch_int<1, 2, 4, 8, 16>(c.iters, [&](auto it) {
          constexpr int ITERS = decltype(it)::value;
          if constexpr (ITERS <= kMaxIters) {
            const void* kern = reinterpret_cast<const void*>(&rms_norm_fwd_rows_kernel<TX, TH, RES, ITERS>);
            int64_t smem = 0;
            int grid = 0;
            const int64_t pf_smem = c.rpb * NV * (16 + res_unit_bytes);
            if (tune.fwd_prefetch && a.vec_ok && info.major >= 8 && groups > info.sms && pf_smem <= smem_budget(info)) {
              const int occ = blocks_per_sm(kern, c.threads(), pf_smem, dev);
              const int64_t g = std::min<int64_t>(groups, static_cast<int64_t>(info.sms) * occ);
              if (occ > 0 && groups > g) {  // some block has a next group to prefetch
                smem = pf_smem;
                grid = static_cast<int>(g);
              }
            }
            a.prefetch = smem > 0;
            if (!a.prefetch) {
              const int occ = std::max(1, blocks_per_sm(kern, c.threads(), 0, dev));
              grid = static_cast<int>(std::min<int64_t>(groups, static_cast<int64_t>(info.sms) * occ));
            }
            rms_norm_fwd_rows_kernel<TX, TH, RES, ITERS>
                <<<grid, c.threads(), static_cast<size_t>(smem), stream>>>(a);
            FM_KERNEL_LAUNCH_CHECK();
          } else {
            FM_CHECK(false, "fused_mlp: internal error: rms_norm fwd config exceeds the register budget");
          }
        });
      } else {
        const void* kern = reinterpret_cast<const void*>(&rms_norm_fwd_wide_kernel<TX, TH, RES>);
        const int threads = tune.wide_threads;
        const int64_t cache_smem = NV * 16 * kHeldUnits;
        a.cache = cache_smem <= smem_budget(info);
        int occ = a.cache ? blocks_per_sm(kern, threads, cache_smem, dev) : 0;
        if (occ == 0) {
          a.cache = false;
          occ = std::max(1, blocks_per_sm(kern, threads, 0, dev));
        }
        const int grid = static_cast<int>(std::min<int64_t>(M, static_cast<int64_t>(info.sms) * occ));
        rms_norm_fwd_wide_kernel<TX, TH, RES>
            <<<grid, threads, static_cast<size_t>(a.cache ? cache_smem : 0), stream>>>(a);
        FM_KERNEL_LAUNCH_CHECK();
      }
    };
    if (!has_res) {
      run(TX{}, std::false_type{});
    } else {
      dispatch_b_or_f32<TX>(h_dtype == kFloat, [&](auto htag) { run(htag, std::true_type{}); });
    }
  });
  return out;
}
}  // namespace

std::tuple<Tensor, Tensor, Tensor> rms_norm_fwd_cuda(
    const Tensor& x, const std::optional<Tensor>& residual, const std::optional<Tensor>& weight,
    double eps, double offset, ScalarType out_dtype, std::optional<ScalarType> residual_dtype) {
  FwdOut out = rms_norm_fwd_impl(x, residual, weight, eps, offset, out_dtype, residual_dtype, true);
  Tensor h = out.h.has_value() ? *out.h : fused_mlp::empty({0}, x.scalar_type(), x);
  return {out.y, h, *out.rstd};
}

std::tuple<Tensor, Tensor> rms_norm_bwd_cuda(
    const Tensor& dy, const Tensor& h, const Tensor& rstd, const std::optional<Tensor>& weight,
    const std::optional<Tensor>& dh_extra, double offset, ScalarType dx_dtype, bool compute_dw) {
  check_rows_cuda(h, "h", h);
  check_rows_cuda(dy, "dy", h);
  const int64_t M = h.size(0), N = h.size(1);
  FM_CHECK(N <= kMaxN, "fused_mlp: rms_norm supports rows of up to ", kMaxN, " elements, got ", N);
  FM_CHECK(fused_mlp::same_shape(dy, h), "fused_mlp: dy shape ", fused_mlp::shape_str(dy), " != h shape ", fused_mlp::shape_str(h));
  FM_CHECK(same_cuda_device(rstd, h) && rstd.dim() == 1 && rstd.size(0) == M &&
               rstd.scalar_type() == kFloat && rstd.is_contiguous(),
           "fused_mlp: rstd must be a contiguous float32 CUDA tensor [", M, "]");
  // Base dtype: the 16-bit dtype among (dx, h, dy, weight), else fp32. Every tensor is the base or fp32.
  ScalarType base = kFloat;
  for (ScalarType t : {dx_dtype, h.scalar_type(), dy.scalar_type(),
                       weight.has_value() ? weight->scalar_type() : kFloat,
                       dh_extra.has_value() ? dh_extra->scalar_type() : kFloat})
    if (t != kFloat) base = t;
  FM_CHECK(base == kFloat || base == kHalf || base == kBFloat16,
           "fused_mlp: rms_norm_bwd dtypes must be float32/float16/bfloat16");
  FM_CHECK(is_base_or_f32(dx_dtype, base) && is_base_or_f32(h.scalar_type(), base) &&
               is_base_or_f32(dy.scalar_type(), base),
           "fused_mlp: rms_norm_bwd mixes 16-bit dtypes (dx ", dx_dtype, ", h ", h.scalar_type(), ", dy ",
           dy.scalar_type(), "); each must be float32 or one common 16-bit dtype");
  if (dh_extra.has_value()) {
    check_rows_cuda(*dh_extra, "dh_extra", h);
    FM_CHECK(fused_mlp::same_shape(*dh_extra, h), "fused_mlp: dh_extra shape ", fused_mlp::shape_str(*dh_extra), " != ", fused_mlp::shape_str(h));
    FM_CHECK(is_base_or_f32(dh_extra->scalar_type(), base), "fused_mlp: dh_extra dtype ",
             dh_extra->scalar_type(), " must be float32 or ", base);
  }
  if (weight.has_value()) {
    FM_CHECK(same_cuda_device(*weight, h), "fused_mlp: weight must be on ", device_str(h));
    FM_CHECK(weight->dim() == 1 && weight->size(0) == N && weight->is_contiguous(),
             "fused_mlp: weight must be contiguous [", N, "]");
    FM_CHECK(is_base_or_f32(weight->scalar_type(), base), "fused_mlp: weight dtype ", weight->scalar_type(),
             " must be float32 or ", base);
  }
  DeviceGuard guard(h);
  const bool want_dw = compute_dw && weight.has_value();
  auto dx = fused_mlp::empty({M, N}, dx_dtype, h);
  if (M == 0 || N == 0) {
    Tensor dw = want_dw ? fused_mlp::zeros({N}, weight->scalar_type(), *weight)
                        : fused_mlp::empty({0}, h.scalar_type(), h);
    return {dx, dw};
  }
  Tensor dw = want_dw ? fused_mlp::empty({N}, weight->scalar_type(), *weight)
                      : fused_mlp::empty({0}, h.scalar_type(), h);

  const int dev = device_index(h);
  const DeviceInfo& info = device_info(dev);
  const Tuning& tune = tuning();
  const auto stream = current_stream(h);
  const bool has_extra = dh_extra.has_value();

  BwdArgs a{};
  a.dy = dy.const_data_ptr();
  a.dy_stride = dy.stride(0);
  a.h = h.const_data_ptr();
  a.h_stride = h.stride(0);
  a.rstd = static_cast<const float*>(rstd.const_data_ptr());
  a.w = weight.has_value() ? weight->const_data_ptr() : nullptr;
  a.extra = has_extra ? dh_extra->const_data_ptr() : nullptr;
  a.extra_stride = has_extra ? dh_extra->stride(0) : 0;
  a.dx = dx.data_ptr();
  a.dw = want_dw ? dw.data_ptr() : nullptr;
  a.M = M;
  a.N = N;
  a.offset = static_cast<float>(offset);
  a.w_f32 = weight.has_value() && weight->scalar_type() == kFloat;
  a.extra_f32 = has_extra && dh_extra->scalar_type() == kFloat;
  a.dx_f32 = dx_dtype == kFloat;
  a.vec_ok = rows_aligned16(h) && rows_aligned16(dy) && rows_aligned16(dx) &&
             (!has_extra || rows_aligned16(*dh_extra)) && (a.w == nullptr || ptr_aligned16(a.w)) &&
             (!want_dw || ptr_aligned16(a.dw));
  Tensor partial;
  int partial_rows = 0;

  dispatch_base(base, [&](auto xtag) {
    using TX = decltype(xtag);
    constexpr int VEC = 16 / static_cast<int>(sizeof(TX));
    const int64_t NV = (N + VEC - 1) / VEC;
    a.pstride = NV * VEC;  // a multiple of VEC (and of 4): partial rows are 16-byte aligned
    dispatch_b_or_f32<TX>(h.scalar_type() == kFloat, [&](auto htag) {
      using TH = decltype(htag);
      dispatch_b_or_f32<TX>(dy.scalar_type() == kFloat, [&](auto dtag) {
        using TD = decltype(dtag);
        // Few rows (small-M training): one launch, dW written directly -- docs/tuning-log.md#rms-norm-bwd-small.
        if (launch_bwd_small<TX, TH, TD>(a, info, dev, stream, want_dw)) return;
        if (launch_bwd_rg<TX, TH, TD>(a, info, dev, stream, want_dw, h, partial, partial_rows)) return;
        if (launch_bwd_reg<TX, TH, TD>(a, info, dev, stream, want_dw, h, partial, partial_rows)) return;
        constexpr int kMaxIters = bwd_max_iters<TX, TH, TD>();
        const int64_t row_bytes = NV * VEC *
            (static_cast<int64_t>(sizeof(TH)) + static_cast<int64_t>(sizeof(TD)) +
             (has_extra ? (a.extra_f32 ? 4 : static_cast<int64_t>(sizeof(TX))) : 0));
        const int64_t dw_bytes_per_slot = want_dw ? NV * VEC * 4 : 0;
        const int64_t max_rpb = want_dw ? smem_budget(info) / std::max<int64_t>(dw_bytes_per_slot, 1) : 0;
        auto rows_kernel = [](int iters) -> const void* {
          const void* k = nullptr;
          dispatch_int<1, 2, 4, 8>(iters, [&](auto it) {
            if constexpr (decltype(it)::value <= kMaxIters)
              k = reinterpret_cast<const void*>(&rms_norm_bwd_rows_kernel<TX, TH, TD, decltype(it)::value>);
          });
          return k;
        };
        bool use_rows = NV <= static_cast<int64_t>(kMaxIters) * kRowsMaxThreads && dw_bytes_per_slot <= smem_budget(info);
        RowsConfig c;
        if (use_rows) {
          c = rows_config(NV, kMaxIters, kRowsMaxThreads, tune.bwd_iters, M, info.sms, 2048, max_rpb);
          while (kernel_spills(rows_kernel(c.iters), dev)) {
            if (c.iters == 1 || NV > static_cast<int64_t>(c.iters / 2) * kRowsMaxThreads) {
              use_rows = false;
              break;
            }
            c = rows_config(NV, c.iters / 2, kRowsMaxThreads, 0, M, info.sms, 2048, max_rpb);
          }
        }
        if (use_rows) {
          a.tpr = c.tpr;
          a.rpb = c.rpb;
          const int64_t groups = (M + c.rpb - 1) / c.rpb;
          dispatch_int<1, 2, 4, 8>(c.iters, [&](auto it) {
            constexpr int ITERS = decltype(it)::value;
            if constexpr (ITERS <= kMaxIters) {
              const void* kern = reinterpret_cast<const void*>(&rms_norm_bwd_rows_kernel<TX, TH, TD, ITERS>);
              const int64_t dw_smem = (c.rpb * dw_bytes_per_slot + 15) / 16 * 16;
              int64_t smem = dw_smem;
              int grid = 0;
              const int64_t pf_smem = dw_smem + c.rpb * row_bytes;
              a.prefetch = false;
              if (tune.bwd_prefetch && a.vec_ok && info.major >= 8 && groups > info.sms &&
                  pf_smem <= smem_budget(info)) {
                const int occ = blocks_per_sm(kern, c.threads(), pf_smem, dev);
                const int64_t g = std::min<int64_t>(groups, static_cast<int64_t>(info.sms) * occ);
                if (occ > 0 && groups > g) {
                  smem = pf_smem;
                  grid = static_cast<int>(g);
                  a.prefetch = true;
                }
              }
              if (!a.prefetch) {
                const int occ = blocks_per_sm(kern, c.threads(), smem, dev);
                FM_CHECK(occ > 0, "fused_mlp: internal error: rms_norm bwd config does not fit (N=", N, ")");
                grid = static_cast<int>(std::min<int64_t>(groups, static_cast<int64_t>(info.sms) * occ));
              }
              partial_rows = grid;
              a.direct_dw = want_dw && grid == 1;
              if (want_dw && !a.direct_dw) {
                partial = fused_mlp::empty({partial_rows, a.pstride}, kFloat, h);
                a.partial = static_cast<float*>(partial.data_ptr());
              }
              rms_norm_bwd_rows_kernel<TX, TH, TD, ITERS><<<grid, c.threads(), static_cast<size_t>(smem), stream>>>(a);
              FM_KERNEL_LAUNCH_CHECK();
            } else {
              FM_CHECK(false, "fused_mlp: internal error: rms_norm bwd config exceeds the register budget");
            }
          });
        } else {
          const void* kern = reinterpret_cast<const void*>(&rms_norm_bwd_wide_kernel<TX, TH, TD>);
          const int threads = tune.wide_threads;
          const int64_t dw_smem = NV * VEC * 4;
          a.dw_smem = want_dw && tune.bwd_dw_smem && dw_smem <= smem_budget(info);
          int occ = a.dw_smem ? blocks_per_sm(kern, threads, dw_smem, dev) : 0;
          if (occ == 0) {
            a.dw_smem = false;
            occ = std::max(1, blocks_per_sm(kern, threads, 0, dev));
          }
          const int grid = static_cast<int>(std::min<int64_t>(M, static_cast<int64_t>(info.sms) * occ));
          partial_rows = grid;
          if (want_dw) {
            partial = fused_mlp::empty({partial_rows, a.pstride}, kFloat, h);
            a.partial = static_cast<float*>(partial.data_ptr());
          }
          rms_norm_bwd_wide_kernel<TX, TH, TD>
              <<<grid, threads, static_cast<size_t>(a.dw_smem ? dw_smem : 0), stream>>>(a);
          FM_KERNEL_LAUNCH_CHECK();
        }
      });
    });
  });

  if (a.partial != nullptr) {
    dispatch_float(dw.scalar_type(), "weight", [&](auto wtag) {
      using TW = decltype(wtag);
      const int blocks = static_cast<int>((N + 31) / 32);
      rms_norm_dw_column_sum_kernel<TW><<<blocks, 256, 0, stream>>>(a.partial, a.pstride, partial_rows, N,
                                                                    static_cast<TW*>(dw.data_ptr()));
      FM_KERNEL_LAUNCH_CHECK();
    });
  }
  return {dx, dw};
}

// Inference entry points: the forward's kernels, returning y (and h) only and storing no rstd. Fewer outputs through
// the op boundary and fewer allocations are the saving (each output boxed, wrapped and freed by Python;
// docs/tuning-log.md#host-path); the launch is the same.
Tensor rms_norm_infer_cuda(const Tensor& x, const std::optional<Tensor>& weight, double eps, double offset,
                           bool out_f32) {
  return rms_norm_fwd_impl(x, std::nullopt, weight, eps, offset, out_f32 ? kFloat : x.scalar_type(), std::nullopt,
                           false).y;
}

std::tuple<Tensor, Tensor> rms_norm_add_infer_cuda(const Tensor& x, const Tensor& residual,
                                                   const std::optional<Tensor>& weight, double eps, double offset,
                                                   bool out_f32) {
  FwdOut out = rms_norm_fwd_impl(x, residual, weight, eps, offset, out_f32 ? kFloat : x.scalar_type(),
                                 residual.scalar_type(), false);
  return {out.y, *out.h};
}
