// addmm / linear on CUDA through cuBLASLt: y = act(mat1 @ mat2 + bias), the bias and the activation applied to the
// fp32 accumulator, the result rounded once to the output (= input) dtype.
// mat1, dy, dx: [M, K] / [M, N] (unit stride along the last dim, any row stride >= the row length);
// mat2, dw: [K, N] with either orientation (row-major [K, N] = Conv1D's weight, or column-major = nn.Linear's
// [N, K] weight seen through .t()) used in place; bias, db: [N]; preact (Z): [M, N] contiguous, output dtype.
//
// ---- sm_90: the CUTLASS epilogue kernel first (kernels_src/cuda/addmm_sm90.cu) ----
// On an sm_90 device, for bf16/fp16 with 16-byte aligned operands whose row strides, K and N are multiples of 8, the
// forward runs a CUTLASS 3 GEMM with bias + activation in its epilogue instead of cuBLASLt: the same fp32 math
// (kernels_src/cuda/addmm_act.cuh), one rounding, and Z in training, without the fp32 [M, N] round trip of the
// exact path below. FUSED_MLP_ADDMM_SM90 (read once; the private op _addmm_sm90_mode overrides it) picks: auto (the
// default: >= kSm90MinTiles output tiles with an activation; without one cuBLASLt's BIAS epilogue, also one rounding),
// on (wherever it can run), off (cuBLASLt always), pingpong / cooperative (on, with that kernel config). The cuBLASLt
// fallback test hook (_addmm_lt_force_fallback) bypasses it. Everything else, and the backward, is the cuBLASLt path
// described here.
//
// ---- Layout mapping (cuBLASLt is column-major; a row-major [R, C] tensor is a column-major C x R matrix) ----
// Forward   Y^T (N x M, ld N)  = op(mat2) (N x K) * mat1^T (K x M):  m=N, n=M, k=K, A=mat2, B=mat1 (op N).
//           mat2 row-major [K,N] (stride(1)==1): stored N x K, ld=stride(0), op N.   (Conv1D, no copy)
//           mat2 column-major (stride(0)==1):    stored K x N, ld=stride(1), op T.   (nn.Linear weight.t(), no copy)
//           Bias = a vector over the rows of D (length m = N) broadcast over its columns (the M tokens): exactly
//           torch.addmm's broadcast. AUX (Z) has D's layout, ld = N.
// dX        dX^T (K x M, ld K) = op(mat2) (K x N) * dZ^T (N x M): op T for row-major mat2, op N for column-major.
// dW [K,N]  dW^T (N x K, ld N) = dZ^T (N x M, op N) * op(mat1^T) (M x K, op T):  m=N, n=K, k=M.
// dW [N,K]  (returned for a column-major mat2, so the gradient has the parameter's own layout and autograd does
//           not copy it)  (K x N, ld K) = mat1^T (K x M, op N) * op(dZ^T) (M x N, op T):  m=K, n=N, k=M.
//
// ---- Epilogues and what "gelu_tanh" / "gelu" mean here (H200 evidence: docs/tuning-log.md#addmm-gelu-epilogue)
// * None, bias in the output dtype: CUBLASLT_EPILOGUE_BIAS (DEFAULT without bias). One rounding.
// * "gelu_tanh", fp32 output: CUBLASLT_EPILOGUE_GELU_BIAS. cuBLASLt's GELU epilogue IS the tanh approximation
//   0.5x(1+tanh(sqrt(2/pi)(x+0.044715x^3))), computed on the fp32 accumulator + bias, rounded once. For bf16/fp16
//   outputs the same epilogue is NOT one rounding of that function (several output ulps off), so half-precision
//   "gelu_tanh" takes the fp32-accumulator path described under "gelu" (exact, a little slower). In training
//   GELU_AUX_BIAS also stores Z = acc + bias (rounded to the output dtype, AUX dtype must equal D's) for the
//   backward. AUX_LD must be a multiple of 8 (documented rule), so for N % 8 != 0 the training forward takes the
//   fp32-accumulator path below instead (exact, a little slower).
// * "gelu" (exact erf GeLU): no cuBLASLt epilogue computes it, so it is NOT faked with the tanh epilogue. The GEMM
//   writes the fp32 accumulator (A/B in the input dtype, C/D fp32, DEFAULT epilogue), and one elementwise kernel
//   adds the bias in fp32, applies erf-GeLU in fp32 and rounds once (also writing Z in training). Still one
//   rounding; the price is an fp32 [M, N] write + read (2x the output bytes; for fp32 outputs it is free: the
//   accumulator buffer is Z or Y itself).
// * fp32 bias with bf16/fp16 inputs: cuBLASLt rejects a bias dtype != D dtype (INVALID_VALUE, verified), and
//   rounding the bias to bf16 first would be a second rounding. torch.addmm refuses mixed dtypes altogether; we
//   accept it and take the same fp32-accumulator path (bias added in fp32, one rounding).
//
// ---- Backward ----
// One elementwise kernel: dZ = dY * act'(Z) in fp32 (dY fp32 or the output dtype: with ctx.set_output_grad_dtype an
// fp32 gradient arrives uncast), written in the input dtype for the two GEMMs (cuBLASLt wants A and B of one type),
// and the bias gradient db = sum over rows of the fp32 dZ, accumulated in fp64 (free in this memory-bound pass) as
// per-block partials + a column reduction in a fixed order (deterministic, no atomics), rounded once. Without an
// activation and with dY already in the input dtype, dY is the GEMM operand as is and the kernel only sums.
// dX and dW are plain cuBLASLt GEMMs (DEFAULT epilogue).
// Not used, deliberately: DGELU_BGRAD (needs the dGeLU to follow a GEMM, but here dY is an input; measured slower)
// and BGRADA/BGRADB on the dW GEMM (measured no faster than plain dW + a column sum; the bias grad would also be
// rounded to the output dtype instead of summed from the fp32 dZ) -- docs/tuning-log.md#addmm-bwd-epilogues
//
// ---- Precision rules kept in every cuBLASLt call ----
// compute type CUBLAS_COMPUTE_32F for every dtype (fp32 inputs never use TF32 here, whatever torch's TF32 flag);
// for bf16/fp16 outputs the split-K reduction scheme is restricted to NONE | COMPUTE_TYPE (never INPLACE or
// OUTPUT_TYPE, which would round partial sums to the half output type before the epilogue).
//
// ---- Speed ----
// Workspace and handle are torch's (getCUDABlasLtWorkspace / getCurrentCUDABlasLtHandle) on the current stream; the
// stable-ABI build, which cannot reach those, keeps one cuBLASLt handle per device (cuBLASLt handles carry no
// stream and may be shared by threads) and takes the workspace from torch's caching allocator for each call
// (stream-ordered, graph-capture safe): 1 MiB for the fused epilogues, 32 MiB for plain 16-bit GEMMs (split-K at
// decode sizes), CUBLASLT_WORKSPACE_SIZE (KiB) for every call where set (lt_workspace_bytes).
// Descriptors, layouts and the heuristic's algorithm are cached per (device, shape, lds, ops, dtypes, epilogue,
// pointer alignments, workspace size) in a thread-local table; a cached call only updates the bias/aux pointers
// and launches. Opt-in (FUSED_MLP_ADDMM_AUTOTUNE=1): large GEMMs time the heuristic's top 8 candidates once and keep
// the fastest (see the tuning table below). No device allocation besides the outputs, except the fp32 accumulator
// of the exact paths, the dZ operand and the small [blocks, N] fp64 partial-sum buffer of the backward.
//
// ---- Fallback ----
// If cuBLASLt has no algorithm for a fused epilogue (or the matmul returns an error), warn once and take the
// fp32-accumulator path (DEFAULT epilogue into fp32, then the bias/activation kernel: same numerics). If cuBLASLt
// fails even there, warn once and use torch's mm on fp32 copies of the operands (bf16/fp16 values are exact in fp32,
// and in TF32 too) followed by the same kernel. Backward GEMMs fall back to torch's mm in the input dtype (also one
// rounding of an fp32-accumulated product). The private op _addmm_lt_force_fallback(mode) forces these paths for
// the tests: 1 = no fused epilogue, 2 = no cuBLASLt at all, 3 = no cuBLASLt workspace (an algorithm without one, as
// when the allocator has no block for it; the fallbacks above only where cuBLASLt has no such algorithm).
#include <atomic>
#include <cublasLt.h>

#include <algorithm>
#include <mutex>
#include <sstream>
#include <type_traits>
#include <array>
#include <cstdlib>
#include <functional>
#include <memory>
#include <unordered_map>

#include "activation.h"  // Act: the epilogue activation codes (shared with the CPU backend)
#include "cuda/addmm_act.cuh"
#include "cuda/addmm_sm90.h"
#include "cuda/common.cuh"
#include "torch_binding.h"

#if !defined(FUSED_MLP_STABLE_ABI)
#include <ATen/cuda/CUDAContextLight.h>  // torch's cuBLASLt handle and workspace
#endif

namespace fused_mlp::cuda {
namespace {

// Device math: act_fwd / act_grad and the activation codes (kernels_src/cuda/addmm_act.cuh, shared with the sm_90
// CUTLASS epilogue).
using namespace addmm_math;

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// ---------------------------------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------------------------------

// y = act(acc + bias), z = acc + bias: fp32 math, one rounding each. acc may alias y or z (fp32 outputs: the
// accumulator buffer is the output), so those three pointers are not __restrict__; every element is read before
// it is written by the same thread. VEC elements per step (N % VEC == 0; all buffers are fresh allocations).
template <typename TO, typename TB, int ACT, int VEC>
__global__ void bias_act_kernel(const float* acc,             // [M, N] contiguous fp32, or null (= zeros, K == 0)
                                const TB* __restrict__ bias,  // [N] or null
                                TO* y,                        // [M, N] contiguous
                                TO* z,                        // [M, N] contiguous, or null
                                int64_t M, int64_t N) {
  const int64_t total = M * N / VEC;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = i * VEC;
    const int64_t col = e % N;
    float v[VEC];
    if (acc != nullptr) {
      const Pack<float, VEC> a = *reinterpret_cast<const Pack<float, VEC>*>(acc + e);
#pragma unroll
      for (int j = 0; j < VEC; ++j) v[j] = a.v[j];
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) v[j] = 0.f;
    }
    if (bias != nullptr) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) v[j] += to_float(bias[col + j]);
    }
    if (z != nullptr) {
      Pack<TO, VEC> p;
#pragma unroll
      for (int j = 0; j < VEC; ++j) p.v[j] = from_float<TO>(v[j]);
      *reinterpret_cast<Pack<TO, VEC>*>(z + e) = p;
    }
    Pack<TO, VEC> p;
#pragma unroll
    for (int j = 0; j < VEC; ++j) p.v[j] = from_float<TO>(act_fwd<ACT, !std::is_same_v<TO, float>>(v[j]));
    *reinterpret_cast<Pack<TO, VEC>*>(y + e) = p;
  }
}

// Backward elementwise pass over a [rows_per_chunk, 32] tile per block (32 x 8 threads; a warp reads 32
// consecutive columns of one row): g = dY * act'(Z) in fp32; writes dZ (if dz) and the tile's fp32 column sums of g
// to partial[blockIdx.y, col] (if partial), summed over the block's rows in a fixed order.
constexpr int kColTile = 32;
constexpr int kRowLanes = 8;

// The sums are accumulated in fp64: the pass is memory-bound (fp64 adds are free here), and db is then rounded once.
template <typename TD, typename TZ, typename TG, int ACT>
__global__ void __launch_bounds__(kColTile* kRowLanes)
    act_bwd_colsum_kernel(const TD* __restrict__ dy, int64_t ldy,  // [M, N], row stride ldy
                          const TZ* __restrict__ z,                // [M, N] contiguous (ACT != none)
                          TG* __restrict__ dz,                     // [M, N] contiguous, or null
                          double* __restrict__ partial,            // [gridDim.y, N], or null
                          int64_t M, int64_t N, int64_t rows_per_chunk) {
  __shared__ double red[kRowLanes][kColTile + 1];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kColTile + threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < M ? r0 + rows_per_chunk : M;
  double s = 0.0;
  if (col < N) {
#pragma unroll 4
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kRowLanes) {
      float g = to_float(dy[r * ldy + col]);
      if constexpr (ACT != kActNone) g *= act_grad<ACT>(to_float(z[r * N + col]));
      if (dz != nullptr) dz[r * N + col] = from_float<TG>(g);
      s += g;
    }
  }
  if (partial != nullptr) {  // uniform over the block: every thread reaches the barrier or none does
    red[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && col < N) {
      double t = 0.0;
#pragma unroll
      for (int j = 0; j < kRowLanes; ++j) t += red[j][threadIdx.x];
      partial[static_cast<int64_t>(blockIdx.y) * N + col] = t;
    }
  }
}

// act_bwd_colsum_kernel on VEC columns per thread (16-byte loads of dY and Z, stores of dZ; a warp reads 512 bytes of
// a row, where the scalar kernel reads 64): a tile of kColTile * VEC columns, the same fixed summation order per
// column (a lane's rows in order, then the lanes, then the chunks). Needs N % VEC == 0 and the rows of dY, Z, dZ
// aligned to a whole pack. The scalar form took 2x torch's `dy.sum(0)` at N = 14336 -- docs/tuning-log.md#addmm-bwd-colsum
template <typename TD, typename TZ, typename TG, int ACT, int VEC>
__global__ void __launch_bounds__(kColTile* kRowLanes)
    act_bwd_colsum_vec_kernel(const TD* __restrict__ dy, int64_t ldy, const TZ* __restrict__ z,
                              TG* __restrict__ dz, double* __restrict__ partial, int64_t M, int64_t N,
                              int64_t rows_per_chunk) {
  constexpr int kTile = kColTile * VEC;
  __shared__ double red[kRowLanes][kTile];
  const int64_t tile0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t col = tile0 + static_cast<int64_t>(threadIdx.x) * VEC;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < M ? r0 + rows_per_chunk : M;
  double s[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) s[j] = 0.0;
  if (col < N) {  // N % VEC == 0: the whole pack is in the row
#pragma unroll 4
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kRowLanes) {
      const Pack<TD, VEC> d = *reinterpret_cast<const Pack<TD, VEC>*>(dy + r * ldy + col);
      float g[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) g[j] = to_float(d.v[j]);
      if constexpr (ACT != kActNone) {
        const Pack<TZ, VEC> zv = *reinterpret_cast<const Pack<TZ, VEC>*>(z + r * N + col);
#pragma unroll
        for (int j = 0; j < VEC; ++j) g[j] *= act_grad<ACT>(to_float(zv.v[j]));
      }
      if (dz != nullptr) {
        Pack<TG, VEC> o;
#pragma unroll
        for (int j = 0; j < VEC; ++j) o.v[j] = from_float<TG>(g[j]);
        *reinterpret_cast<Pack<TG, VEC>*>(dz + r * N + col) = o;
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j) s[j] += g[j];
    }
  }
  if (partial != nullptr) {  // uniform over the block: every thread reaches the barrier or none does
#pragma unroll
    for (int j = 0; j < VEC; ++j) red[threadIdx.y][threadIdx.x * VEC + j] = s[j];
    __syncthreads();
    for (int c = threadIdx.y * kColTile + threadIdx.x; c < kTile; c += kColTile * kRowLanes) {
      if (tile0 + c < N) {
        double t = 0.0;
#pragma unroll
        for (int k = 0; k < kRowLanes; ++k) t += red[k][c];
        partial[static_cast<int64_t>(blockIdx.y) * N + tile0 + c] = t;
      }
    }
  }
}

// fp64 -> fp32 rounded to odd: rounding that to bf16/fp16 gives the correctly rounded fp64 value (one rounding).
__device__ __forceinline__ float round_to_odd_f32(double d) {
  float f = __double2float_rz(d);
  if (static_cast<double>(f) != d) f = __uint_as_float(__float_as_uint(f) | 1u);
  return f;
}

// db[col] = sum over the partial rows, in order (deterministic), rounded once.
template <typename TB>
__global__ void column_sum_finalize_kernel(const double* __restrict__ partial, int rows, int64_t N,
                                           TB* __restrict__ out) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= N) return;
  double s = 0.0;
  for (int r = 0; r < rows; ++r) s += partial[static_cast<int64_t>(r) * N + col];
  if constexpr (std::is_same_v<TB, float>) {
    out[col] = __double2float_rn(s);
  } else {
    out[col] = from_float<TB>(round_to_odd_f32(s));
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Host helpers
// ---------------------------------------------------------------------------------------------------------------

// Row chunks of the backward column pass (col_tiles x chunks blocks, `slots` of them resident at once): the fewest
// whose grid fills >= 90% of its waves, else the best fill up to 4 waves' worth of blocks (more chunks: more fp64
// partials to add). A grid of 1.4 waves ran the pass at ~2/3 of its bandwidth -- docs/tuning-log.md#addmm-bwd-colsum
int64_t colsum_chunks(int64_t col_tiles, int64_t max_chunks, int64_t slots) {
  const int64_t limit = std::min<int64_t>(max_chunks, std::max<int64_t>(1, 4 * slots / col_tiles));
  int64_t best = 1;
  double best_fill = 0.0;
  for (int64_t c = 1; c <= limit; ++c) {
    const int64_t blocks = col_tiles * c;
    const double fill = static_cast<double>(blocks) / static_cast<double>(((blocks + slots - 1) / slots) * slots);
    if (fill >= 0.9) return c;
    if (fill > best_fill) best = c, best_fill = fill;
  }
  return best;
}

int device_sm_count(int device) {
  static std::atomic<int> cached[64];  // zero-initialised; callers may be several threads (autograd workers)
  const bool slot = device >= 0 && device < 64;
  if (slot) {
    const int c = cached[device].load(std::memory_order_relaxed);
    if (c > 0) return c;
  }
  int n = 0;
  FM_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  if (slot) cached[device].store(n, std::memory_order_relaxed);
  return n;
}

cudaDataType_t lt_dtype(ScalarType t) {
  switch (t) {
    case kFloat: return CUDA_R_32F;
    case kHalf: return CUDA_R_16F;
    case kBFloat16: return CUDA_R_16BF;
    default: FM_CHECK(false, "fused_mlp: unsupported dtype ", t);
  }
}

uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && (a % al) != 0) al >>= 1;
  return al;
}

// A 2-D operand with unit stride along its last dim and a row stride usable as a leading dimension
// (>= the row length; any stride for a single row or a single column). Otherwise a contiguous copy.
Tensor as_gemm_rows(const Tensor& t) {
  const int64_t R = t.size(0), C = t.size(1);
  const bool unit = C <= 1 || t.stride(1) == 1;
  const bool ld_ok = R <= 1 || t.stride(0) >= std::max<int64_t>(C, 1);
  return unit && ld_ok ? t : fused_mlp::contiguous(t);
}

int64_t gemm_ld(const Tensor& rows) {  // leading dimension of an as_gemm_rows() operand
  return rows.size(0) <= 1 ? std::max<int64_t>(rows.size(1), 1) : rows.stride(0);
}

// mat2 [K, N]: row-major usable (-> false) or column-major usable (-> true); else made contiguous (row-major).
// Python's _mat2_layout() makes the same decision, which fixes the layout of dW.
struct Mat2 {
  Tensor t;
  bool col_major;
  int64_t ld;
};
Mat2 prepare_mat2(const Tensor& w) {
  const int64_t K = w.size(0), N = w.size(1);
  if ((N <= 1 || w.stride(1) == 1) && (K <= 1 || w.stride(0) >= std::max<int64_t>(N, 1)))
    return {w, false, K <= 1 ? std::max<int64_t>(N, 1) : w.stride(0)};
  if ((K <= 1 || w.stride(0) == 1) && (N <= 1 || w.stride(1) >= std::max<int64_t>(K, 1)))
    return {w, true, N <= 1 ? std::max<int64_t>(K, 1) : w.stride(1)};
  const Tensor c = fused_mlp::contiguous(w);
  return {c, false, std::max<int64_t>(N, 1)};
}

// ---------------------------------------------------------------------------------------------------------------
// cuBLASLt: one GEMM with an epilogue, plans cached per thread
// ---------------------------------------------------------------------------------------------------------------

// Column-major D (m x n, ld ldd) = op(A) (m x k) * op(B) (k x n) [+ epilogue]. A is stored k x m when trans_a,
// else m x k; B is stored n x k when trans_b, else k x n.
struct LtGemm {
  const void* a = nullptr;
  int64_t lda = 0;
  bool trans_a = false;
  const void* b = nullptr;
  int64_t ldb = 0;
  bool trans_b = false;
  void* d = nullptr;
  int64_t ldd = 0;
  ScalarType ab_type = kFloat, d_type = kFloat;
  int64_t m = 0, n = 0, k = 0;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;  // [m], D's dtype, 16-byte aligned (BIAS epilogues only)
  void* aux = nullptr;         // like D, ld aux_ld (AUX epilogues only)
  int64_t aux_ld = 0;
  int device = 0;                // the entry point's device (its guard makes it current) and torch's stream there
  cudaStream_t stream = nullptr;
};

// Everything the descriptors and the heuristic's choice depend on, as plain int64 fields (no padding to compare).
enum PlanField : int {
  kDevice, kAbType, kDType, kTransA, kTransB, kM, kN, kK, kLda, kLdb, kLdd, kAuxLd, kEpilogue,
  kAlignA, kAlignB, kAlignD, kAlignBias, kAlignAux, kWorkspace, kNumPlanFields
};
using PlanKey = std::array<int64_t, kNumPlanFields>;

struct PlanKeyHash {
  size_t operator()(const PlanKey& k) const {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the fields
    for (int64_t v : k) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

// ---- Tuning table (host side) ----
// kMaxPlans: cached cuBLASLt plans per thread; the table is simply cleared when it grows past this (serving with
//   many distinct token counts re-queries the heuristic, ~tens of us, once per new shape).
// kAutotune*: opt-in timing of the heuristic's top candidates (see autotune_plan): its first pick is not always
//   the fastest on large GEMMs. Only for GEMMs of >= 8.6 GFLOP (>= ~12 us), where one-time tuning (~8 candidates
//   x 4 runs) is amortised; small/decode shapes keep the heuristic's pick -- docs/tuning-log.md#addmm-autotune
// The backward column pass's grid: whole waves of its resident blocks (colsum_chunks). Not swept: its 32 x 8 tiles
//   and the bias/activation kernel grid (8 blocks per SM, grid-stride; <= 32 registers: 8 fit)
//   -- docs/tuning-log.md#addmm-grids
// kSm90MinTiles: under FUSED_MLP_ADDMM_SM90=auto, bf16/fp16 forwards with an activation take the sm_90 CUTLASS kernel
//   (addmm_sm90.cu) from 256 output tiles of 128 x 128 (about two waves on an H200; below, it lost to the cuBLASLt
//   fp32-accumulator path at every measured shape: 0.50-1.02x); bias-only ones keep cuBLASLt's one-rounding BIAS
//   epilogue (the CUTLASS kernel: 0.83-0.94x its time, L2 flushed) -- docs/tuning-log.md#addmm-sm90-epilogue
constexpr int64_t kSm90MinTiles = 256;
constexpr size_t kMaxPlans = 4096;
constexpr int kAutotuneCandidates = 8;
constexpr int kAutotuneRuns = 3;
constexpr double kAutotuneMinFlops = 8.0 * 1024 * 1024 * 1024;

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  // The heuristic's ranked list, kept until tuned (autotune only). A plain array: nvcc 13's front end crashes on
  // std::vector<cublasLtMatmulAlgo_t> in C++20 mode (construct_at).
  cublasLtMatmulAlgo_t candidates[kAutotuneCandidates] = {};
  int num_candidates = 0;
  bool ok = false;  // the heuristic returned an algorithm and no call has failed
  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};


using PlanTable = std::unordered_map<PlanKey, std::unique_ptr<Plan>, PlanKeyHash>;
PlanTable& plan_table() {
  thread_local PlanTable table;
  return table;
}

// ---- handle and workspace of one cuBLASLt call ----
cublasLtHandle_t lt_handle([[maybe_unused]] int dev) {
#if defined(FUSED_MLP_STABLE_ABI)
  constexpr int kMaxDevices = 64;
  static std::mutex mu;
  static cublasLtHandle_t handles[kMaxDevices] = {};
  FM_CHECK(dev >= 0 && dev < kMaxDevices, "fused_mlp: device index ", dev, " out of range");
  std::lock_guard<std::mutex> lock(mu);
  if (handles[dev] == nullptr) {
    const cublasStatus_t st = cublasLtCreate(&handles[dev]);
    FM_CHECK(st == CUBLAS_STATUS_SUCCESS, "fused_mlp: cublasLtCreate failed with status ", static_cast<int>(st));
  }
  return handles[dev];
#else
  return at::cuda::getCurrentCUDABlasLtHandle();
#endif
}

// Bytes of the cuBLASLt workspace: torch's own size (classic build), or in the stable build CUBLASLT_WORKSPACE_SIZE
// (KiB) where set, else 1024 KiB (torch's cuBLASLt default) for the fused epilogues -- a larger workspace let the
// heuristic pick a bf16 BIAS algorithm that does not round once (docs/tuning-log.md#addmm-workspace) -- and 32 MiB
// (torch's cuBLAS workspace on sm_90) for plain 16-bit GEMMs (DEFAULT epilogue), whose split-K partials stay fp32
// (the reduction mask in build_plan): a decode-sized GEMM with a long K (the MLP's down projection at T = 64) then
// gets the split-K kernels torch's mm gets (docs/tuning-log.md#lt-workspace-splitk). (The stable build does not see
// torch.cuda's runtime workspace setters.)
[[maybe_unused]] constexpr size_t kPlainGemmWorkspace = size_t{32} << 20;  // stable build only

size_t lt_workspace_bytes([[maybe_unused]] const LtGemm& g) {
#if defined(FUSED_MLP_STABLE_ABI)
  static const long env_kib = [] {
    const char* e = std::getenv("CUBLASLT_WORKSPACE_SIZE");
    return e != nullptr ? std::strtol(e, nullptr, 10) : 0L;
  }();
  if (env_kib > 0) return static_cast<size_t>(env_kib) * 1024u;
  const bool plain_16bit = g.epilogue == CUBLASLT_EPILOGUE_DEFAULT && g.bias == nullptr && g.aux == nullptr &&
                           g.d_type != kFloat;
  return plain_16bit ? kPlainGemmWorkspace : size_t{1024} * 1024u;
#else
  return at::cuda::getCUDABlasLtWorkspaceSize();
#endif
}

// The workspace of one call: torch's own (classic build) or a block of torch's caching allocator held for the call
// (stable build; stream-ordered on the current stream, so it stays valid for the asynchronous matmul). If that
// allocation fails the workspace is empty and `size()` is 0: lt_gemm then asks for an algorithm without one
// (_addmm_lt_force_fallback mode 3 makes every workspace empty, for the tests).
class LtWorkspace {
 public:
  explicit LtWorkspace(size_t bytes) {
    if (addmm_lt_fallback_mode() == 3) return;
#if defined(FUSED_MLP_STABLE_ABI)
    if (aoti_torch_cuda_caching_allocator_raw_alloc(bytes, &ptr_) == AOTI_TORCH_SUCCESS && ptr_ != nullptr) {
      size_ = bytes;
    } else {
      ptr_ = nullptr;
      (void)cudaGetLastError();
    }
#else
    ptr_ = at::cuda::getCUDABlasLtWorkspace();
    size_ = bytes;
#endif
  }
  ~LtWorkspace() {
#if defined(FUSED_MLP_STABLE_ABI)
    if (ptr_ != nullptr) aoti_torch_cuda_caching_allocator_raw_delete(ptr_);
#endif
  }
  LtWorkspace(const LtWorkspace&) = delete;
  LtWorkspace& operator=(const LtWorkspace&) = delete;
  void* ptr() const { return ptr_; }
  size_t size() const { return size_; }

 private:
  void* ptr_ = nullptr;
  size_t size_ = 0;
};

#define FM_LT_TRY(expr)                                  \
  do {                                                   \
    if ((expr) != CUBLAS_STATUS_SUCCESS) return false;   \
  } while (0)

bool set_pointer_attrs(const Plan& p, const LtGemm& g) {
  if (g.bias != nullptr)
    FM_LT_TRY(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof(g.bias)));
  if (g.aux != nullptr)
    FM_LT_TRY(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &g.aux,
                                             sizeof(g.aux)));
  return true;
}

// Builds the descriptors and asks the heuristic for one algorithm. Returns false when cuBLASLt refuses.
bool build_plan(Plan& p, const LtGemm& g, size_t workspace, bool want_candidates, cublasLtHandle_t handle) {
  FM_LT_TRY(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  FM_LT_TRY(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  FM_LT_TRY(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  const cublasLtEpilogue_t epi = g.epilogue;
  FM_LT_TRY(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
  // Only the attributes the epilogue uses (an unused bias pointer made DGELU fail with INVALID_VALUE).
  if (g.aux != nullptr)
    FM_LT_TRY(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &g.aux_ld,
                                             sizeof(g.aux_ld)));
  if (!set_pointer_attrs(p, g)) return false;  // the heuristic reads the pointers' alignment

  const cudaDataType_t abt = lt_dtype(g.ab_type), dt = lt_dtype(g.d_type);
  FM_LT_TRY(g.trans_a ? cublasLtMatrixLayoutCreate(&p.a, abt, g.k, g.m, g.lda)
                      : cublasLtMatrixLayoutCreate(&p.a, abt, g.m, g.k, g.lda));
  FM_LT_TRY(g.trans_b ? cublasLtMatrixLayoutCreate(&p.b, abt, g.n, g.k, g.ldb)
                      : cublasLtMatrixLayoutCreate(&p.b, abt, g.k, g.n, g.ldb));
  FM_LT_TRY(cublasLtMatrixLayoutCreate(&p.d, dt, g.m, g.n, g.ldd));

  cublasLtMatmulPreference_t pref = nullptr;
  FM_LT_TRY(cublasLtMatmulPreferenceCreate(&pref));
  std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>, decltype(&cublasLtMatmulPreferenceDestroy)>
      pref_guard(pref, &cublasLtMatmulPreferenceDestroy);
  FM_LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                 sizeof(workspace)));
  if (g.d_type != kFloat) {
    // Split-K partial sums stay fp32 until the epilogue (never reduced in the bf16/fp16 output buffer or type).
    const uint32_t mask = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    FM_LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask,
                                                   sizeof(mask)));
  }
  // The defaults assume 256-byte aligned buffers; sliced inputs must tell the heuristic the truth.
  const uint32_t aa = alignment_of(g.a), ab = alignment_of(g.b), ad = alignment_of(g.d);
  FM_LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa, sizeof(aa)));
  FM_LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ab, sizeof(ab)));
  FM_LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ad, sizeof(ad)));
  FM_LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ad, sizeof(ad)));

  const int wanted = want_candidates ? kAutotuneCandidates : 1;
  cublasLtMatmulHeuristicResult_t results[kAutotuneCandidates] = {};
  int returned = 0;
  FM_LT_TRY(cublasLtMatmulAlgoGetHeuristic(handle, p.desc, p.a, p.b, p.d, p.d, pref,
                                           wanted, results, &returned));
  for (int i = 0; i < returned && i < kAutotuneCandidates; ++i)
    if (results[i].state == CUBLAS_STATUS_SUCCESS && results[i].workspaceSize <= workspace)
      p.candidates[p.num_candidates++] = results[i].algo;
  if (p.num_candidates == 0) return false;
  p.algo = p.candidates[0];
  return true;
}

// Opt-in (FUSED_MLP_ADDMM_AUTOTUNE=1): the first call of a large GEMM times the heuristic's top candidates on the
// real buffers (each run overwrites the outputs completely; the caller's run follows) and keeps the fastest.
// Off by default: the pick depends on timing, so results may differ in the last bit between processes, and the
// first call synchronises the stream. Skipped while the stream is being captured into a CUDA graph.
bool autotune_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("FUSED_MLP_ADDMM_AUTOTUNE");
    return e != nullptr && e[0] == '1';
  }();
  return on;
}

void autotune_plan(Plan& p, const LtGemm& g, const LtWorkspace& ws, cublasLtHandle_t handle, cudaStream_t stream) {
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capturing) != cudaSuccess || capturing != cudaStreamCaptureStatusNone) return;
  cudaEvent_t start = nullptr, stop = nullptr;
  if (cudaEventCreate(&start) != cudaSuccess) return;
  if (cudaEventCreate(&stop) != cudaSuccess) {
    cudaEventDestroy(start);
    return;
  }
  const float alpha = 1.f, beta = 0.f;
  const auto run = [&](const cublasLtMatmulAlgo_t& algo) {
    return cublasLtMatmul(handle, p.desc, &alpha, g.a, p.a, g.b, p.b, &beta, g.d, p.d, g.d, p.d, &algo, ws.ptr(),
                          ws.size(), stream);
  };
  float best_ms = -1.f;
  for (int i = 0; i < p.num_candidates; ++i) {
    const cublasLtMatmulAlgo_t& algo = p.candidates[i];
    if (run(algo) != CUBLAS_STATUS_SUCCESS) continue;  // warm-up; an algorithm that fails is skipped
    bool ok = cudaEventRecord(start, stream) == cudaSuccess;
    for (int r = 0; r < kAutotuneRuns && ok; ++r) ok = run(algo) == CUBLAS_STATUS_SUCCESS;
    ok = ok && cudaEventRecord(stop, stream) == cudaSuccess && cudaEventSynchronize(stop) == cudaSuccess;
    float ms = 0.f;
    if (ok && cudaEventElapsedTime(&ms, start, stop) == cudaSuccess && (best_ms < 0.f || ms < best_ms)) {
      best_ms = ms;
      p.algo = algo;
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  (void)cudaGetLastError();  // nothing above may leave a sticky error behind for unrelated launches
}

// Runs one GEMM through cuBLASLt on the current stream. false = cuBLASLt has no algorithm or failed (the caller
// falls back; nothing was written that the fallback does not overwrite).
bool lt_gemm(const LtGemm& g) {
  const size_t workspace_bytes = lt_workspace_bytes(g);
  PlanKey key{};
  key[kDevice] = g.device;
  key[kAbType] = static_cast<int64_t>(g.ab_type);
  key[kDType] = static_cast<int64_t>(g.d_type);
  key[kTransA] = g.trans_a;
  key[kTransB] = g.trans_b;
  key[kM] = g.m;
  key[kN] = g.n;
  key[kK] = g.k;
  key[kLda] = g.lda;
  key[kLdb] = g.ldb;
  key[kLdd] = g.ldd;
  key[kAuxLd] = g.aux != nullptr ? g.aux_ld : 0;
  key[kEpilogue] = static_cast<int64_t>(g.epilogue);
  key[kAlignA] = alignment_of(g.a);
  key[kAlignB] = alignment_of(g.b);
  key[kAlignD] = alignment_of(g.d);
  key[kAlignBias] = g.bias != nullptr ? alignment_of(g.bias) : 0;
  key[kAlignAux] = g.aux != nullptr ? alignment_of(g.aux) : 0;
  key[kWorkspace] = static_cast<int64_t>(workspace_bytes);

  PlanTable& table = plan_table();
  auto it = table.find(key);
  if (it != table.end() && !it->second->ok) return false;  // cuBLASLt refused this configuration before
  // Where the allocator has no block for the workspace, the call is planned without one (a key of its own) rather
  // than handed to the caller's slower fallback.
  const LtWorkspace ws(workspace_bytes);
  const size_t workspace = ws.size();
  if (workspace != workspace_bytes) {
    key[kWorkspace] = static_cast<int64_t>(workspace);
    it = table.find(key);
    if (it != table.end() && !it->second->ok) return false;
  }
  const cublasLtHandle_t handle = lt_handle(g.device);
  const cudaStream_t stream = g.stream;
  Plan* plan;
  if (it != table.end()) {
    plan = it->second.get();
    if (!set_pointer_attrs(*plan, g)) return false;
  } else {
    if (table.size() >= kMaxPlans) table.clear();
    const bool tune = autotune_enabled() && 2.0 * g.m * g.n * g.k >= kAutotuneMinFlops;
    auto fresh = std::make_unique<Plan>();
    fresh->ok = build_plan(*fresh, g, workspace, tune, handle);
    plan = table.emplace(key, std::move(fresh)).first->second.get();
    if (!plan->ok) return false;
    if (tune && plan->num_candidates > 1) autotune_plan(*plan, g, ws, handle, stream);
    plan->num_candidates = 0;
  }
  const float alpha = 1.f, beta = 0.f;
  const cublasStatus_t st = cublasLtMatmul(handle, plan->desc, &alpha, g.a, plan->a, g.b, plan->b, &beta, g.d,
                                           plan->d, g.d, plan->d, &plan->algo, ws.ptr(), workspace, stream);
  if (st != CUBLAS_STATUS_SUCCESS) {
    plan->ok = false;  // do not retry this configuration
    return false;
  }
  return true;
}

void warn_fallback(int slot, const char* what, const LtGemm& g) {
  if (!addmm_lt_first_warning(slot)) return;
  std::ostringstream msg;
  msg << "fused_mlp.addmm: cuBLASLt " << what << " (m=" << g.m << ", n=" << g.n << ", k=" << g.k << ", dtype "
      << g.ab_type << ", epilogue " << static_cast<int>(g.epilogue) << "); using "
      << (slot == 0 ? "the fp32-accumulator path (GEMM to fp32, then bias/activation, one rounding)"
                    : "torch's mm fallbacks (fp32 accumulation, one rounding; slower)")
      << ". Results keep the same numerics. This warning is shown once.";
  fused_mlp::warn(msg.str());
}

// ---------------------------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------------------------

void launch_bias_act(const float* acc, const Tensor* bias, const Tensor& y, const Tensor* z, int act,
                     int64_t M, int64_t N, cudaStream_t stream) {
  const bool vec4 = N % 4 == 0;
  const int64_t items = M * N / (vec4 ? 4 : 1);
  constexpr int kThreads = 256;
  const int64_t max_blocks = static_cast<int64_t>(device_sm_count(device_index(y))) * 8;
  const unsigned blocks =
      static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((items + kThreads - 1) / kThreads, max_blocks)));
  const ScalarType bias_t = bias != nullptr ? bias->scalar_type() : y.scalar_type();
  dispatch_float(y.scalar_type(), "output", [&](auto ot) {
    using TO = decltype(ot);
    dispatch_base_or_float<TO>(bias_t, "bias", [&](auto bt) {
      using TB = decltype(bt);
      const TB* bp = bias != nullptr ? static_cast<const TB*>(bias->const_data_ptr()) : nullptr;
      TO* yp = static_cast<TO*>(y.data_ptr());
      TO* zp = z != nullptr ? static_cast<TO*>(z->data_ptr()) : nullptr;
      auto go = [&](auto act_tag, auto vec_tag) {
        constexpr int A = decltype(act_tag)::value, V = decltype(vec_tag)::value;
        bias_act_kernel<TO, TB, A, V><<<blocks, kThreads, 0, stream>>>(acc, bp, yp, zp, M, N);
        FM_KERNEL_LAUNCH_CHECK();
      };
      auto with_vec = [&](auto act_tag) {
        if (vec4) go(act_tag, std::integral_constant<int, 4>{});
        else go(act_tag, std::integral_constant<int, 1>{});
      };
      if (act == kActGeluTanh) with_vec(std::integral_constant<int, kActGeluTanh>{});
      else if (act == kActGeluErf) with_vec(std::integral_constant<int, kActGeluErf>{});
      else with_vec(std::integral_constant<int, kActNone>{});
    });
  });
}

void check_cuda_args(const std::optional<Tensor>& bias, const Tensor& mat1, const Tensor& mat2) {
  FM_CHECK(mat1.dim() == 2 && mat2.dim() == 2, "fused_mlp: addmm takes 2-D mat1 [M, K] and mat2 [K, N], got ",
              mat1.dim(), "-D and ", mat2.dim(), "-D");
  FM_CHECK(mat1.is_cuda() && fused_mlp::same_device(mat2, mat1), "fused_mlp: mat1 and mat2 must be on one CUDA device");
  const ScalarType T = mat1.scalar_type();
  FM_CHECK(T == kFloat || T == kHalf || T == kBFloat16,
              "fused_mlp: mat1 must be float32/float16/bfloat16, got ", T);
  FM_CHECK(mat2.scalar_type() == T, "fused_mlp: mat2 dtype ", mat2.scalar_type(), " must equal mat1 dtype ", T);
  FM_CHECK(mat1.size(1) == mat2.size(0), "fused_mlp: mat1 [", mat1.size(0), ", ", mat1.size(1), "] and mat2 [",
              mat2.size(0), ", ", mat2.size(1), "] cannot be multiplied (inner dims differ)");
  if (bias.has_value()) {
    FM_CHECK(bias->dim() == 1 && bias->size(0) == mat2.size(1), "fused_mlp: bias must be [", mat2.size(1),
                "], got ", fused_mlp::shape_str(*bias));
    FM_CHECK(bias->scalar_type() == T || bias->scalar_type() == kFloat,
                "fused_mlp: bias dtype must be float32 or ", T, ", got ", bias->scalar_type());
    FM_CHECK(fused_mlp::same_device(*bias, mat1), "fused_mlp: bias must be on mat1's device");
  }
}

}  // namespace
}  // namespace fused_mlp::cuda

using namespace fused_mlp::cuda;

namespace {

// addmm_fwd_cuda after its argument checks, the output allocated with out_sizes (the caller's [..., N]).
std::tuple<Tensor, Tensor> addmm_fwd_checked(const std::optional<Tensor>& bias_in, const Tensor& mat1_in,
                                             const Tensor& mat2_in, int act, bool save_preact,
                                             const fused_mlp::Sizes& out_sizes);

}  // namespace

std::tuple<Tensor, Tensor> addmm_fwd_cuda(const std::optional<Tensor>& bias_in, const Tensor& mat1_in,
                                                  const Tensor& mat2_in, StrArg activation, bool save_preact,
                                                  ShapeArg out_shape) {
  const int act = static_cast<int>(fused_mlp::parse_epilogue_activation(activation));
  check_cuda_args(bias_in, mat1_in, mat2_in);
  return addmm_fwd_checked(bias_in, mat1_in, mat2_in, act, save_preact,
                           check_out_shape(out_shape, mat1_in.size(0), mat2_in.size(1)));
}

Tensor mm_rows_cuda(const Tensor& mat1, const Tensor& mat2) {
  check_cuda_args(std::nullopt, mat1, mat2);
  return std::get<0>(addmm_fwd_checked(std::nullopt, mat1, mat2, kActNone, false, {mat1.size(0), mat2.size(1)}));
}

namespace {

std::tuple<Tensor, Tensor> addmm_fwd_checked(const std::optional<Tensor>& bias_in, const Tensor& mat1_in,
                                             const Tensor& mat2_in, int act, bool save_preact,
                                             const fused_mlp::Sizes& out_sizes) {
  // (fused_mlp::mm_out is never re-cast by an enclosing torch.autocast: the Python API already cast.)
  const DeviceGuard guard(mat1_in);
  const int64_t M = mat1_in.size(0), K = mat1_in.size(1), N = mat2_in.size(1);
  const ScalarType T = mat1_in.scalar_type();
  const bool want_z = save_preact && act != kActNone;
  auto y_out = fused_mlp::empty(out_sizes, T, mat1_in);  // the caller's [..., N]
  // y_out is fresh and contiguous: its [M, N] rows through one shim call (a view or contiguous() is a boxed
  // dispatcher call by name, ~1 us each of the decode-size host cost: docs/tuning-log.md#host-path).
  const Tensor y = fused_mlp::as_rows_view(y_out);
  auto z = want_z ? fused_mlp::empty({M, N}, T, mat1_in) : fused_mlp::empty({0}, T, mat1_in);
  if (M == 0 || N == 0) return {y_out, z};
  const cudaStream_t stream = current_stream(mat1_in);

  // Bias: contiguous, 16-byte aligned (cuBLASLt's alignment preferences do not cover the epilogue's bias pointer;
  // an under-aligned bias slice has faulted elsewhere), N elements: the copy is negligible.
  std::optional<Tensor> bias;
  if (bias_in.has_value()) {
    Tensor b = bias_in->is_contiguous() ? *bias_in : fused_mlp::contiguous(*bias_in);
    if (alignment_of(b.const_data_ptr()) < 16) b = fused_mlp::clone(b);
    bias = b;
  }
  const Tensor* bias_p = bias.has_value() ? &*bias : nullptr;

  if (K == 0) {  // empty product: y = act(bias), z = bias (or zeros)
    launch_bias_act(nullptr, bias_p, y, want_z ? &z : nullptr, act, M, N, stream);
    return {y_out, z};
  }

  const Tensor mat1 = as_gemm_rows(mat1_in);
  const Mat2 w = prepare_mat2(mat2_in);
  const int mode = addmm_lt_fallback_mode();

  // 0. sm_90, bf16/fp16: the CUTLASS GEMM with bias + activation in its epilogue (addmm_sm90.cu), one rounding and
  //    no fp32 [M, N] round trip. Not while the cuBLASLt fallback test hook is set (those tests exercise cuBLASLt).
  if ((T == kBFloat16 || T == kHalf) && mode == 0) {
    const Sm90Mode sm = addmm_sm90_mode();
    const int64_t tiles = ((M + 127) / 128) * ((N + 127) / 128);
    const bool wanted = sm == Sm90Mode::kAuto
                            ? tiles >= kSm90MinTiles && act != kActNone
                            : sm != Sm90Mode::kOff;
    if (wanted && addmm_sm90_available(device_index(mat1_in))) {
      AddmmSm90Args s;
      s.a = mat1.const_data_ptr();
      s.lda = gemm_ld(mat1);
      s.b = w.t.const_data_ptr();
      s.ldb = w.ld;
      s.b_k_major = w.col_major;  // column-major [K, N] = [N, K] rows (nn.Linear's weight)
      if (bias.has_value()) {
        s.bias = bias->const_data_ptr();
        s.bias_fp32 = bias->scalar_type() == kFloat;
      }
      s.y = y.data_ptr();
      s.z = want_z ? z.data_ptr() : nullptr;
      s.M = M;
      s.N = N;
      s.K = K;
      s.act = act;
      s.bf16 = T == kBFloat16;
      s.device = device_index(mat1_in);
      s.stream = stream;
      if (addmm_sm90_fwd(s, sm)) return {y_out, z};
    }
  }

  LtGemm g;
  g.device = device_index(mat1_in);
  g.stream = stream;
  g.a = w.t.const_data_ptr();
  g.lda = w.ld;
  g.trans_a = w.col_major;
  g.b = mat1.const_data_ptr();
  g.ldb = gemm_ld(mat1);
  g.trans_b = false;
  g.ab_type = T;
  g.m = N;
  g.n = M;
  g.k = K;
  g.ldd = N;

  // 1. The fused epilogue, when cuBLASLt can compute exactly what was asked for.
  const bool bias_in_out_dtype = !bias.has_value() || bias->scalar_type() == T;
  const bool aux_ok = !want_z || N % 8 == 0;  // documented AUX_LD rule (multiple of 8)
  // cuBLASLt's GELU epilogue is exact (one rounding) only for fp32 outputs (docs/tuning-log.md#addmm-gelu-epilogue),
  // so half-precision GeLU takes the fp32-accumulator path below, which rounds once.
  const bool epilogue_exact = act == kActNone || T == kFloat;
  if (act != kActGeluErf && epilogue_exact && bias_in_out_dtype && aux_ok) {
    LtGemm f = g;
    f.d = y.data_ptr();
    f.d_type = T;
    if (bias.has_value()) f.bias = bias->const_data_ptr();
    if (act == kActNone) {
      f.epilogue = bias.has_value() ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    } else if (want_z) {
      f.epilogue = bias.has_value() ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
      f.aux = z.data_ptr();
      f.aux_ld = N;
    } else {
      f.epilogue = bias.has_value() ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
    }
    if (mode == 0 || mode == 3) {
      if (lt_gemm(f)) return {y_out, z};
      warn_fallback(0, "has no algorithm for this fused epilogue", f);
    } else {
      warn_fallback(0, "fused epilogue disabled by _addmm_lt_force_fallback", f);
    }
  }

  // 2. The fp32-accumulator path: D = mat1 @ mat2 in fp32, then bias + activation in one kernel, one rounding.
  //    For fp32 outputs the accumulator is Z (training) or Y itself (the kernel works in place).
  Tensor acc = T != kFloat ? fused_mlp::empty({M, N}, kFloat, mat1) : (want_z ? z : y);
  LtGemm a32 = g;
  a32.d = acc.data_ptr();
  a32.d_type = kFloat;
  a32.epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  bool done = mode != 2 && lt_gemm(a32);
  if (!done) {
    warn_fallback(1, mode == 2 ? "disabled by _addmm_lt_force_fallback" : "has no algorithm for the fp32 GEMM", a32);
    fused_mlp::mm_out(acc, fused_mlp::to_dtype(mat1, kFloat), fused_mlp::to_dtype(w.t, kFloat));
  }
  launch_bias_act(static_cast<const float*>(acc.const_data_ptr()), bias_p, y, want_z ? &z : nullptr, act, M, N, stream);
  return {y_out, z};
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> addmm_bwd_cuda(
    const Tensor& dy_in, const std::optional<Tensor>& preact, const Tensor& mat1_in,
    const Tensor& mat2_in, StrArg activation, bool need_dx, bool need_dw, bool dw_transposed, bool need_db,
    ScalarType db_dtype) {
  const int act = static_cast<int>(fused_mlp::parse_epilogue_activation(activation));
  check_cuda_args(std::nullopt, mat1_in, mat2_in);
  const DeviceGuard guard(mat1_in);
  const int64_t M = mat1_in.size(0), K = mat1_in.size(1), N = mat2_in.size(1);
  const ScalarType T = mat1_in.scalar_type();
  FM_CHECK(dy_in.is_cuda() && fused_mlp::same_device(dy_in, mat1_in) && dy_in.dim() == 2 && dy_in.size(0) == M &&
               dy_in.size(1) == N,
           "fused_mlp: dy must be [", M, ", ", N, "] on mat1's device, got ", fused_mlp::shape_str(dy_in));
  FM_CHECK(dy_in.scalar_type() == T || dy_in.scalar_type() == kFloat, "fused_mlp: dy dtype must be float32 or ",
              T, ", got ", dy_in.scalar_type());
  FM_CHECK(db_dtype == kFloat || db_dtype == kHalf || db_dtype == kBFloat16,
              "fused_mlp: db_dtype must be a float dtype");
  if (act != kActNone)
    FM_CHECK(preact.has_value() && fused_mlp::same_device(*preact, mat1_in) && preact->dim() == 2 &&
                    preact->size(0) == M && preact->size(1) == N && preact->scalar_type() == T,
                "fused_mlp: the saved pre-activation must be [", M, ", ", N, "] ", T, " on mat1's device");

  auto dx = fused_mlp::empty(need_dx ? fused_mlp::Sizes{M, K} : fused_mlp::Sizes{0}, T, mat1_in);
  auto dw = fused_mlp::empty(!need_dw ? fused_mlp::Sizes{0} : dw_transposed ? fused_mlp::Sizes{N, K} : fused_mlp::Sizes{K, N},
                             T, mat1_in);
  auto db = fused_mlp::empty({need_db ? N : 0}, db_dtype, mat1_in);
  if (M == 0 || N == 0) {  // empty sums: zeros (dx is [M, K] = zeros when N == 0)
    if (need_dx) fused_mlp::zero_(dx);
    if (need_dw) fused_mlp::zero_(dw);
    if (need_db) fused_mlp::zero_(db);
    return {dx, dw, db};
  }
  const cudaStream_t stream = current_stream(mat1_in);
  const bool gemms = (need_dx || need_dw) && K > 0;

  // dZ: the GEMM operand in the input dtype. Without activation and with dY in that dtype, dY itself.
  const Tensor dy = as_gemm_rows(dy_in);
  const bool dz_is_dy = act == kActNone && dy.scalar_type() == T;
  Tensor dz = dz_is_dy ? dy : (gemms ? fused_mlp::empty({M, N}, T, mat1_in) : Tensor());
  const bool write_dz = gemms && !dz_is_dy;
  if (write_dz || need_db) {
    const Tensor zc = act != kActNone ? fused_mlp::contiguous(*preact) : Tensor();
    // 16-byte packs of the GEMM dtype where every row of dY, Z (and dZ, a fresh allocation) holds whole packs
    const int64_t vec = T == kFloat ? 4 : 8;
    const int64_t dy_pack = vec * static_cast<int64_t>(dy.element_size());
    const bool use_vec = N % vec == 0 && gemm_ld(dy) % vec == 0 &&
                         reinterpret_cast<uintptr_t>(dy.const_data_ptr()) % dy_pack == 0 &&
                         (act == kActNone || reinterpret_cast<uintptr_t>(zc.const_data_ptr()) % 16 == 0);
    const int64_t tile = use_vec ? kColTile * vec : kColTile;
    const int64_t col_tiles = (N + tile - 1) / tile;
    FM_CHECK(col_tiles <= 0x7fffffff, "fused_mlp: addmm backward grid too large");
    const int device = device_index(mat1_in);
    const dim3 block(kColTile, kRowLanes);
    Tensor partial;
    int64_t chunks = 0;
    dispatch_float(T, "input", [&](auto tt) {
      using TT = decltype(tt);
      constexpr int VEC = 16 / static_cast<int>(sizeof(TT));
      dispatch_base_or_float<TT>(dy.scalar_type(), "dy", [&](auto dt) {
        using TD = decltype(dt);
        const TD* dyp = static_cast<const TD*>(dy.const_data_ptr());
        const TT* zp = act != kActNone ? static_cast<const TT*>(zc.const_data_ptr()) : nullptr;
        TT* dzp = write_dz ? static_cast<TT*>(dz.data_ptr()) : nullptr;
        const int64_t ldy = gemm_ld(dy);
        auto launch = [&](auto act_tag) {
          constexpr int A = decltype(act_tag)::value;
          const auto kernel =
              use_vec ? act_bwd_colsum_vec_kernel<TD, TT, TT, A, VEC> : act_bwd_colsum_kernel<TD, TT, TT, A>;
          const int64_t slots = static_cast<int64_t>(device_sm_count(device)) *
                                resident_blocks_per_sm(reinterpret_cast<const void*>(kernel), device,
                                                       kColTile * kRowLanes);
          chunks = need_db ? colsum_chunks(col_tiles, (M + kRowLanes - 1) / kRowLanes, slots)
                           : std::min<int64_t>(65535, (M + kRowLanes * 16 - 1) / (kRowLanes * 16));
          const int64_t rows_per_chunk = (M + chunks - 1) / chunks;
          chunks = (M + rows_per_chunk - 1) / rows_per_chunk;
          FM_CHECK(chunks <= 65535, "fused_mlp: addmm backward grid too large");
          if (need_db) partial = fused_mlp::empty({chunks, N}, kDouble, mat1_in);
          double* pp = need_db ? static_cast<double*>(partial.data_ptr()) : nullptr;
          const dim3 grid(static_cast<unsigned>(col_tiles), static_cast<unsigned>(chunks));
          kernel<<<grid, block, 0, stream>>>(dyp, ldy, zp, dzp, pp, M, N, rows_per_chunk);
        };
        if (act == kActGeluTanh) {
          launch(std::integral_constant<int, kActGeluTanh>{});
        } else if (act == kActGeluErf) {
          launch(std::integral_constant<int, kActGeluErf>{});
        } else {
          launch(std::integral_constant<int, kActNone>{});
        }
        FM_KERNEL_LAUNCH_CHECK();
      });
    });
    if (need_db) {
      dispatch_float(db_dtype, "db", [&](auto bt) {
        using TB = decltype(bt);
        column_sum_finalize_kernel<TB><<<ceil_div(N, 256), 256, 0, stream>>>(
            static_cast<const double*>(partial.const_data_ptr()), static_cast<int>(chunks), N, static_cast<TB*>(db.data_ptr()));
        FM_KERNEL_LAUNCH_CHECK();
      });
    }
  }
  if (!gemms) {
    if (need_dx) fused_mlp::zero_(dx);  // K == 0: dx and dw have no elements; kept for clarity
    return {dx, dw, db};
  }

  const int mode = addmm_lt_fallback_mode();
  const Tensor mat1 = as_gemm_rows(mat1_in);
  const Mat2 w = prepare_mat2(mat2_in);
  const int64_t ldz = gemm_ld(dz);
  if (need_dx) {  // dX^T (K x M) = op(mat2) (K x N) * dZ^T (N x M)
    LtGemm g;
    g.device = device_index(mat1_in);
    g.stream = stream;
    g.a = w.t.const_data_ptr();
    g.lda = w.ld;
    g.trans_a = !w.col_major;
    g.b = dz.const_data_ptr();
    g.ldb = ldz;
    g.trans_b = false;
    g.d = dx.data_ptr();
    g.ldd = K;
    g.ab_type = T;
    g.d_type = T;
    g.m = K;
    g.n = M;
    g.k = N;
    if (!(mode != 2 && lt_gemm(g))) {
      warn_fallback(1, mode == 2 ? "disabled by _addmm_lt_force_fallback" : "has no algorithm for the dX GEMM", g);
      fused_mlp::mm_out(dx, dz, fused_mlp::transposed(w.t));
    }
  }
  if (need_dw) {
    LtGemm g;
    g.device = device_index(mat1_in);
    g.stream = stream;
    g.ab_type = T;
    g.d_type = T;
    g.d = dw.data_ptr();
    if (!dw_transposed) {  // dW [K, N]: (N x K) = dZ^T (N x M, op N) * mat1 (M x K, op T)
      g.a = dz.const_data_ptr();
      g.lda = ldz;
      g.trans_a = false;
      g.b = mat1.const_data_ptr();
      g.ldb = gemm_ld(mat1);
      g.trans_b = true;
      g.m = N;
      g.n = K;
      g.k = M;
      g.ldd = N;
    } else {  // dW [N, K]: (K x N) = mat1^T (K x M, op N) * dZ (M x N, op T)
      g.a = mat1.const_data_ptr();
      g.lda = gemm_ld(mat1);
      g.trans_a = false;
      g.b = dz.const_data_ptr();
      g.ldb = ldz;
      g.trans_b = true;
      g.m = K;
      g.n = N;
      g.k = M;
      g.ldd = K;
    }
    if (!(mode != 2 && lt_gemm(g))) {
      warn_fallback(1, mode == 2 ? "disabled by _addmm_lt_force_fallback" : "has no algorithm for the dW GEMM", g);
      if (dw_transposed) fused_mlp::mm_out(dw, fused_mlp::transposed(dz), mat1);
      else fused_mlp::mm_out(dw, fused_mlp::transposed(mat1), dz);
    }
  }
  return {dx, dw, db};
}
