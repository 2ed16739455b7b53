// The gated MLP's forward at decode sizes, y = down(act(x W_g^T) * (x W_u^T)), as one op of two GEMV-class kernels:
//
//   gate/up pass  h[t, i] = act(sum_k x[t, k] W_g[i, k]) * (sum_k x[t, k] W_u[i, k])   h: [T, I], rounded once
//   down pass     y[t, o] = sum_i h[t, i] W_d[o, i]                                    y: [T, H_out], rounded once
//
// Shapes: x [T, H], w_gate / w_up [I, H], w_down [H_out, I], all row-major and contiguous, one 16-bit dtype (bf16 or
// fp16), 16-byte aligned; no biases. act(gate) * up is computed in fp32 from the fp32 accumulators (gated_act.cuh's
// 16-bit forms, as every other kernel of the package) and h is rounded once to the dtype: it is the down pass's
// activation operand.
// Limits: 1 <= T <= kMaxTokens (64: four token classes of 1, 2, 4 or 8 n8-tiles), H and I multiples of 8 (every row
// a whole number of 16-byte units), any H_out; sm_80 or newer (bf16 mma.sync). Larger T belongs to the GEMM path.
//
// Why tensor cores in a GEMV: at T = 16..64 tokens each weight element takes part in 16..64 FMAs, which CUDA-core
// FMAs could not keep up with at HBM speed past T ~ 4; mma.sync.m16n8k16 keeps the kernels memory-bound up to T = 64.
// "Swap AB": the weights are the A operand (16 rows x 16 k per MMA), the tokens the B operand (n = 8 tokens per
// n8-tile, tokens beyond T read token T-1 again and are never stored), fp32 accumulators.
//
// Fragments straight from global memory (no shared memory, no ldmatrix). m16n8k16 (PTX ISA; CUTLASS SM80_16x8x16
// traits), lane = 4 g + t (g = groupID 0..7, t = threadID_in_group 0..3):
//   A (row-major 16x16): a0 = (row g,   k 2t..2t+1)   a1 = (row g+8, k 2t..2t+1)
//                        a2 = (row g,   k 2t+8..2t+9) a3 = (row g+8, k 2t+8..2t+9)
//   B (col-major 16x8):  b0 = (k 2t..2t+1, col g)     b1 = (k 2t+8..2t+9, col g)
//   C (16x8, fp32):      c0, c1 = (row g, col 2t, 2t+1)   c2, c3 = (row g+8, col 2t, 2t+1)
// The dot product runs over k, so k may be permuted, the same way for A and B. One "chunk" is 32 consecutive k
// (two k16 steps); lane (g, t) loads the 8 contiguous elements [8t, 8t+8) of the chunk (16 bytes) from weight rows g
// and g+8 and from token g's row, as uint4 {w0, w1, w2, w3} (w0 = elements 8t, 8t+1, ...). Logical k of step s maps to
// the chunk's element 8t + 4s + 2 hi + lo for logical k = 2t + 8 hi + lo (hi, lo in {0, 1}): a bijection onto the 32
// elements. So step 0 takes A regs {lo.x, hi.x, lo.y, hi.y} and B regs {b.x, b.y}; step 1 {lo.z, hi.z, lo.w, hi.w}
// and {b.z, b.w} (lo/hi: the loads of rows g and g+8).
//
// Work split. A warp owns R row tiles (16 rows each) of each weight matrix (both W_g and W_u in the gate/up pass: one
// activation fragment feeds 2R MMAs) over a range of chunks; a CTA is wr x wk warps (wr row slots, wk k-slices); the
// down pass also splits k across CTAs (ks = gridDim.y) so that its few row tiles (H_out / 16 = 128 at H_out = 2048)
// still fill the GPU. Weights are streamed with ld.global.nc.L1::no_allocate.L2::256B, U chunks per batch
// (U x 2 x R x matrices 16-byte loads in flight per lane); the activations (x, h) are small and stay in L1/L2.
// Reductions, all in a fixed order (results are bitwise reproducible): the wk warps of a CTA through shared memory
// (warp wk = 0 adds the others' fragments in order), the ks CTAs of a row group through an fp32 workspace: each CTA
// writes its sums, the last to arrive (a per-group counter the gate/up pass zeroes beforehand) adds all ks of them
// in order and runs the epilogue. The K tail (H or I not a multiple of 32: one partial chunk, a multiple of 8) is
// loaded with a per-lane mask, both operands zero beyond K, by the warp with the last k-slice; rows beyond the matrix
// (I or H_out not a multiple of 16 R wr) read the last row again and are not stored.
// Programmatic dependent launch (sm_90+, on by default; FUSED_MLP_DECODE_TUNE=pdl=0 turns it off): the down pass
// may start while the gate/up pass drains; it prefetches its first weight batch into L2 and waits
// (griddepcontrol.wait) before touching h or the counters.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>

#include "cuda/common.cuh"
#include "cuda/gated_act.cuh"
#include "torch_binding.h"

namespace fused_mlp::cuda {
namespace {

constexpr int kMaxTokens = 64;    // largest T: 8 n8-tiles (_decode.py KERNEL_MAX_TOKENS says the same)
constexpr int kChunk = 32;        // k per chunk: one 16-byte load per lane and row, two m16n8k16 steps
constexpr int kMaxThreads = 256;  // __launch_bounds__: wr x wk <= 8 warps, up to 255 registers per thread
constexpr int kMaxDevices = 64;
constexpr const char* kOp = "fused_mlp: gated_mlp_decode";
constexpr const char* kLinearOp = "fused_mlp: linear_decode";

// ---- tuning table --------------------------------------------------------------------------------------------
// Per pass and token class (NT = 1, 2, 4, 8 n8-tiles: T <= 8, 16, 32, 64). Chosen from the memory model and the
// compiler's output; the H200 variants measured no better (docs/tuning-log.md#gated-mlp-decode;
// FUSED_MLP_DECODE_TUNE overrides wr / wk / ks / pdl at run time, benchmarks/decode_mlp.py times such variants):
//   Little's law on the H200: ~4.3 TB/s x ~0.7 us ~= 3 MB in flight, ~23 KB per SM. A warp's batch is U x 2 x R x M
//   16-byte weight loads (M = 2 matrices in gate/up): 12-16 loads (6-8 KB) up to T = 32, 8 for gate/up at T = 64.
//   Activation traffic per weight byte = NT / (2 M R) (less where T < 8 NT: the repeated last token is merged).
//   The down pass reads h from L2, which also carries the weights: R = 2 keeps it at 0.25 / 0.5 / 1 / 2 for
//   NT = 1 / 2 / 4 / 8 (R = 1 would double L2 traffic at T = 16). The gate/up pass reads x (<= 512 KB) mostly from
//   L1: M = 2 gives 0.25 / 0.5 / 1 / 2 of the weight bytes there, and wr = 2 lets two warps share x chunks for
//   NT >= 4.
//   Register caps (__launch_bounds__(256, mb): 65536 / (256 mb) registers): ptxas issues a batch's loads ahead of its
//   MMAs only when its register target allows; at its default target (64 registers in the down pass) it issued the
//   weight loads two at a time, just ahead of their MMAs (SASS, sm_90). mb = 2 (128 registers) keeps a whole batch
//   in flight for T <= 8 without spills (16 warps per SM). T <= 16 takes mb = 1 (156 / 152 registers) for U = 4: at
//   the 128 cap U = 3 ran 15-19% slower in a stack of layers (docs/tuning-log.md#decode-t16-registers); T <= 32 and
//   64 need mb = 1 too (190-220 registers: 8 warps per SM, 32-64 KB requested per SM).
struct PassCfg {
  int r;   // row tiles (16 rows) per warp: register reuse of each activation fragment
  int u;   // chunks per batch: the loads a lane has in flight
  int wr;  // warps per CTA along rows
  int wk;  // warps per CTA along k (partials reduced through shared memory)
  int mb;  // __launch_bounds__ min blocks of 256 threads: the register cap
};
constexpr PassCfg kGateUpCfg[4] = {
    {1, 4, 1, 4, 2},  // T <= 8:  16 weight loads per lane; I / 16 = 512..1024 CTAs of 4 warps, 4 per SM
    {1, 4, 1, 4, 1},  // T <= 16: no 128-register cap (U = 4 spilled 8 bytes there; U = 3 lost 15-19% in a stack)
    {1, 4, 2, 4, 1},  // T <= 32: wr = 2 shares x chunks through L1
    {1, 2, 2, 4, 1},  // T <= 64: U = 2 (64 accumulator registers): 8 loads per lane
};
constexpr PassCfg kDownCfg[4] = {
    {2, 4, 1, 8, 2},  // T <= 8:  16 weight loads per lane; ks fills one wave (4 at H_out = 2048)
    {2, 4, 1, 8, 1},  // T <= 16: R = 2: h from L2 at half the weight bytes (R = 1: once); no cap, as gate/up
    {2, 4, 1, 8, 1},  // T <= 32: h at the weight bytes
    {2, 4, 1, 8, 1},  // T <= 64: h at twice the weight bytes: L2 traffic, not HBM, may bound this class
};
// linear_decode: the down pass alone, one CTA per row group (no k split: no workspace, no counters to zero, so no
// memset node ahead of it), R = 1 for twice the CTAs of the down pass's R = 2 (N = 2048: 128 CTAs); beats cuBLAS on a
// decoder layer's projections up to T = 16 (FUSED_MLP_DECODE_TUNE's lin_wk overrides wk) --
// docs/tuning-log.md#linear-decode.
constexpr PassCfg kLinearCfg[4] = {
    {1, 4, 1, 8, 2},  // T <= 8
    {1, 4, 1, 8, 2},  // T <= 16
    {1, 4, 1, 8, 1},  // T <= 32
    {1, 4, 1, 8, 1},  // T <= 64
};
constexpr int kMaxSplitCtas = 8;    // down pass: ks = the CTAs resident at once / row groups, at most 8 (workspace
                                    // traffic 2 x ks x T x H_out x 4 bytes, in L2)
// PDL for the down pass: 0.96-0.98x the time without -- docs/tuning-log.md#gated-mlp-decode
constexpr bool kPdlDefault = true;

constexpr int nt_index(int nt) { return nt == 1 ? 0 : nt == 2 ? 1 : nt == 4 ? 2 : 3; }

// ---- device helpers ---------------------------------------------------------------------------------------------

// Weights: read once, never again in this kernel: no L1 allocation; ask L2 for 256-byte lines (a row's next chunks).
__device__ __forceinline__ uint4 ld_weight(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// Activations: x is read-only for the gate/up pass (the non-coherent path); h is written by the gate/up pass, which
// may still run when the down pass starts (PDL), so the down pass reads it with a plain load, which the compiler
// keeps behind griddepcontrol.wait (an asm with a memory clobber) and cannot turn into a non-coherent one (the
// kernel stores through other pointers).
template <bool kReadOnly>
__device__ __forceinline__ uint4 ld_act(const uint4* p) {
  if constexpr (kReadOnly) {
    return __ldg(p);
  } else {
    return *p;
  }
}

__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// d += A B for one m16n8k16 step (A: 4 registers, B: 2), fp32 accumulators.
template <typename E>
__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// Programmatic dependent launch (sm_90+; no-ops when the grid was launched without it).
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

struct GemvArgs {
  const uint4* w0;    // [rows, k] W_gate (gate/up pass) or W_down (down pass), in 16-byte units
  const uint4* w1;    // [rows, k] W_up (gate/up pass); unused in the down pass
  const uint4* act;   // [tokens, k] x (gate/up pass) or h (down pass)
  void* out;          // [tokens, rows] h or y
  float4* partials;   // down pass with ks > 1: [ks, groups, wr, R, NT, 32 lanes] per-CTA sums (fragment layout)
  int* counters;      // down pass with ks > 1: [groups] CTAs arrived per row group
  int* zero;          // gate/up pass: ints it zeroes for the down pass that follows (its counters)
  int n_zero;
  int rows, k, tokens;
  int wr, wk;         // CTA = wr x wk warps (blockDim.x = 32 wr wk)
};

// Accumulates U consecutive chunks starting at chunk c. kMasked (the K tail, U = 1): lanes whose 8 elements lie
// beyond K (ok = false) take zeros for both operands, so nothing beyond the matrix (not even a NaN) is added.
template <typename E, int NT, int R, int M, int U, int kBanks, bool kGateUp, bool kMasked>
__device__ __forceinline__ void accumulate_chunks(float (&acc)[kBanks][M][R][NT][4], const uint4* const (&pa)[M][R][2],
                                                  const uint4* const (&pb)[NT], int c, bool ok) {
  uint4 a[U][M][R][2];
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if constexpr (kMasked) {
            a[u][m][r][h] = make_uint4(0u, 0u, 0u, 0u);
            if (ok) a[u][m][r][h] = ld_weight(pa[m][r][h] + 4 * (c + u));
          } else {
            a[u][m][r][h] = ld_weight(pa[m][r][h] + 4 * (c + u));
          }
        }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    uint4 b[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      if constexpr (kMasked) {
        b[j] = make_uint4(0u, 0u, 0u, 0u);
        if (ok) b[j] = ld_act<kGateUp>(pb[j] + 4 * (c + u));
      } else {
        b[j] = ld_act<kGateUp>(pb[j] + 4 * (c + u));
      }
    }
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const uint4& lo = a[u][m][r][0];  // row g
          const uint4& hi = a[u][m][r][1];  // row g + 8
          mma_16816<E>(acc[0][m][r][j], lo.x, hi.x, lo.y, hi.y, b[j].x, b[j].y);
          mma_16816<E>(acc[kBanks - 1][m][r][j], lo.z, hi.z, lo.w, hi.w, b[j].z, b[j].w);
        }
  }
}

// The table's register caps hold for sm_80 / sm_90. sm_100 and sm_120 allocate more registers for the same code: at
// the 128-register cap the T <= 16 kernels spilled 8-56 bytes there (-Xptxas -v), so those take no cap (mb = 1).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
constexpr bool kTableRegisterCaps = false;
#else
constexpr bool kTableRegisterCaps = true;
#endif

// One pass: gate/up (kGateUp: M = 2 matrices, act(gate) * up stored as h) or down (M = 1, y stored). kTrigger: the
// down pass run alone (linear_decode) lets a dependent grid launched with PDL start at once (its own wait still
// covers this grid's writes), as the gate/up pass does for the down pass.
template <typename E, int NT, int R, int U, int MB, bool kGateUp, Act A, bool kTrigger = false>
__global__ void __launch_bounds__(kMaxThreads, kTableRegisterCaps ? MB : 1) gated_gemv_kernel(const GemvArgs p) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  constexpr int M = kGateUp ? 2 : 1;
  constexpr int kFrags = M * R * NT;             // float4 accumulator fragments per lane
  constexpr int kBanks = kFrags >= 4 ? 1 : 2;    // few fragments: the two k16 steps accumulate into separate banks
                                                 // (two MMA dependency chains instead of one)
  extern __shared__ float4 smem_partials[];      // [wk - 1, wr, kFrags, 32 lanes]
  __shared__ int s_last;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, tq = lane & 3;
  const int wr = warp % p.wr, wk = warp / p.wr;

  if constexpr (kGateUp) {
    pdl_launch_dependents();
    if (blockIdx.x == 0)
      for (int i = threadIdx.x; i < p.n_zero; i += blockDim.x) p.zero[i] = 0;
  } else if constexpr (kTrigger) {
    pdl_launch_dependents();
  }

  const int64_t k16 = p.k >> 3;  // row stride in 16-byte units (k % 8 == 0)
  const int row0 = (blockIdx.x * p.wr + wr) * (16 * R);
  const bool active = row0 < p.rows;  // the last row group's spare warp slots only join the reductions

  const uint4* pa[M][R][2];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = min(row0 + 16 * r + 8 * h + g, p.rows - 1);
        pa[m][r][h] = (m == 0 ? p.w0 : p.w1) + row * k16 + tq;
      }

  // This warp's chunks: the splits (CTA k-slices x warp k-slices) share the full chunks evenly; the last split also
  // takes the partial chunk.
  const int splits = gridDim.y * p.wk, split = blockIdx.y * p.wk + wk;
  const int full = p.k / kChunk;
  const int c_begin = static_cast<int>(static_cast<int64_t>(full) * split / splits);
  const int c_end = static_cast<int>(static_cast<int64_t>(full) * (split + 1) / splits);
  const bool tail = (p.k % kChunk) != 0 && split == splits - 1;

  if constexpr (!kGateUp) {
    // With PDL this runs while the gate/up pass may still be writing h: only the weights are touched before the wait.
    if (active) {
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (c_begin + u < c_end)
#pragma unroll
          for (int r = 0; r < R; ++r)
#pragma unroll
            for (int h = 0; h < 2; ++h) prefetch_l2(pa[0][r][h] + 4 * (c_begin + u));
    }
    pdl_wait();
  }

  const uint4* pb[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) pb[j] = p.act + static_cast<int64_t>(min(8 * j + g, p.tokens - 1)) * k16 + tq;

  float acc[kBanks][M][R][NT][4];
#pragma unroll
  for (int q = 0; q < kBanks; ++q)
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[q][m][r][j][i] = 0.0f;

  if (active) {
    int c = c_begin;
    for (; c + U <= c_end; c += U)
      accumulate_chunks<E, NT, R, M, U, kBanks, kGateUp, false>(acc, pa, pb, c, true);
    for (; c < c_end; ++c) accumulate_chunks<E, NT, R, M, 1, kBanks, kGateUp, false>(acc, pa, pb, c, true);
    if (tail) accumulate_chunks<E, NT, R, M, 1, kBanks, kGateUp, true>(acc, pa, pb, full, full * kChunk + 8 * tq < p.k);
  }

  // acc[0] = this warp's sums (fragment f = (m R + r) NT + j holds rows g, g+8 x tokens 2t, 2t+1 of tile (m, r, j))
  if constexpr (kBanks == 2) {
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[0][m][r][j][i] += acc[kBanks - 1][m][r][j][i];
  }
  // ---- the CTA's k-slices: warps wk > 0 hand their fragments to warp wk = 0 of their row slot ----
  if (p.wk > 1) {
    if (wk > 0) {
      float4* dst = smem_partials + static_cast<int64_t>((wk - 1) * p.wr + wr) * kFrags * 32 + lane;
#pragma unroll
      for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            const float(&f)[4] = acc[0][m][r][j];
            dst[((m * R + r) * NT + j) * 32] = make_float4(f[0], f[1], f[2], f[3]);
          }
    }
    __syncthreads();
    if (wk == 0) {
      for (int q = 1; q < p.wk; ++q) {
        const float4* src = smem_partials + static_cast<int64_t>((q - 1) * p.wr + wr) * kFrags * 32 + lane;
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
          for (int r = 0; r < R; ++r)
#pragma unroll
            for (int j = 0; j < NT; ++j) {
              const float4 v = src[((m * R + r) * NT + j) * 32];
              float(&f)[4] = acc[0][m][r][j];
              f[0] += v.x;
              f[1] += v.y;
              f[2] += v.z;
              f[3] += v.w;
            }
      }
    }
  }

  // ---- the row group's k-slices across CTAs (down pass): the last CTA to arrive adds them all, in order ----
  if constexpr (!kGateUp) {
    if (gridDim.y > 1) {
      const int64_t group_stride = static_cast<int64_t>(p.wr) * kFrags * 32;
      const int64_t slot = static_cast<int64_t>(wr) * kFrags * 32 + lane;
      if (wk == 0) {
        float4* dst = p.partials + (static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x) * group_stride + slot;
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            const float(&f)[4] = acc[0][0][r][j];
            dst[(r * NT + j) * 32] = make_float4(f[0], f[1], f[2], f[3]);
          }
        __threadfence();  // the sums reach L2 before the counter says so
      }
      __syncthreads();
      if (threadIdx.x == 0) s_last = atomicAdd(p.counters + blockIdx.x, 1) == static_cast<int>(gridDim.y) - 1;
      __syncthreads();
      if (!s_last) return;  // uniform across the CTA
      __threadfence();
      if (wk == 0) {
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[0][0][r][j][i] = 0.0f;
        for (int s = 0; s < static_cast<int>(gridDim.y); ++s) {
          const float4* src = p.partials + (static_cast<int64_t>(s) * gridDim.x + blockIdx.x) * group_stride + slot;
#pragma unroll
          for (int r = 0; r < R; ++r)
#pragma unroll
            for (int j = 0; j < NT; ++j) {
              const float4 v = __ldcg(src + (r * NT + j) * 32);  // L2: written by other SMs
              float(&f)[4] = acc[0][0][r][j];
              f[0] += v.x;
              f[1] += v.y;
              f[2] += v.z;
              f[3] += v.w;
            }
        }
      }
    }
  }

  // ---- epilogue: warp wk = 0 of each row slot stores its rows x tokens ----
  if (wk != 0 || !active) return;
  E* out = static_cast<E*>(p.out);
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = row0 + 16 * r + g + 8 * (i >> 1);
        const int tok = 8 * j + 2 * tq + (i & 1);
        if (row < p.rows && tok < p.tokens) {
          float v;
          if constexpr (kGateUp) {
            v = act_fwd<A, kFast<E>>(acc[0][0][r][j][i]) * acc[0][1][r][j][i];
          } else {
            v = acc[0][0][r][j][i];
          }
          out[static_cast<int64_t>(tok) * p.rows + row] = from_float<E>(v);
        }
      }
#endif
}

// ---- host ------------------------------------------------------------------------------------------------------

struct DeviceFacts {
  int sms = 0, major = 0, minor = 0;
};

// Queried once per device (a mutex, not std::call_once: that binds glibc 2.34's pthread_once).
const DeviceFacts& device_facts(int dev) {
  FM_CHECK(dev >= 0 && dev < kMaxDevices, "fused_mlp: device index ", dev, " out of range");
  static DeviceFacts facts[kMaxDevices];
  static std::atomic<bool> ready[kMaxDevices];
  static std::mutex mu;
  if (!ready[dev].load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(mu);
    if (!ready[dev].load(std::memory_order_relaxed)) {
      DeviceFacts f;
      FM_CUDA_CHECK(cudaDeviceGetAttribute(&f.sms, cudaDevAttrMultiProcessorCount, dev));
      FM_CUDA_CHECK(cudaDeviceGetAttribute(&f.major, cudaDevAttrComputeCapabilityMajor, dev));
      FM_CUDA_CHECK(cudaDeviceGetAttribute(&f.minor, cudaDevAttrComputeCapabilityMinor, dev));
      facts[dev] = f;
      ready[dev].store(true, std::memory_order_release);
    }
  }
  return facts[dev];
}

// Run-time overrides of the table for benchmarks: FUSED_MLP_DECODE_TUNE="gu_wr=2,gu_wk=4,dn_wr=1,dn_wk=8,dn_ks=2,
// lin_wr=1,lin_wk=8,pdl=1" (any subset; 0 or absent = the table). Read per call (a getenv; parsed only when set).
struct Tune {
  int gu_wr = 0, gu_wk = 0, dn_wr = 0, dn_wk = 0, dn_ks = 0, lin_wr = 0, lin_wk = 0;
  bool pdl = kPdlDefault;
};

Tune read_tune() {
  Tune t;
  const char* env = std::getenv("FUSED_MLP_DECODE_TUNE");
  if (env == nullptr || *env == '\0') return t;
  const std::string s(env);
  size_t pos = 0;
  while (pos < s.size()) {
    size_t end = s.find(',', pos);
    if (end == std::string::npos) end = s.size();
    const std::string item = s.substr(pos, end - pos);
    pos = end + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    FM_CHECK(eq != std::string::npos, "fused_mlp: FUSED_MLP_DECODE_TUNE: '", item, "' is not key=value");
    const std::string key = item.substr(0, eq), val = item.substr(eq + 1);
    char* stop = nullptr;
    const long v = std::strtol(val.c_str(), &stop, 10);
    FM_CHECK(!val.empty() && *stop == '\0' && v >= 0 && v <= 64, "fused_mlp: FUSED_MLP_DECODE_TUNE: ", key,
             " must be an integer in [0, 64], got '", val, "'");
    const int iv = static_cast<int>(v);
    if (key == "gu_wr") t.gu_wr = iv;
    else if (key == "gu_wk") t.gu_wk = iv;
    else if (key == "dn_wr") t.dn_wr = iv;
    else if (key == "dn_wk") t.dn_wk = iv;
    else if (key == "dn_ks") t.dn_ks = iv;
    else if (key == "lin_wr") t.lin_wr = iv;
    else if (key == "lin_wk") t.lin_wk = iv;
    else if (key == "pdl") t.pdl = iv != 0;
    else FM_CHECK(false, "fused_mlp: FUSED_MLP_DECODE_TUNE: unknown key '", key,
                  "' (gu_wr, gu_wk, dn_wr, dn_wk, dn_ks, lin_wr, lin_wk, pdl)");
  }
  return t;
}

int pick(int override_value, int table_value) { return override_value > 0 ? override_value : table_value; }

// The dynamic shared-memory limit of each kernel instantiation, raised once per device to kMaxDynSmem where a
// launch needs more than the default 48 KB (wk = 8, NT = 8: 7 x 16 fragments x 512 B = 56 KB).
constexpr size_t kMaxDynSmem = 64 * 1024;

void allow_smem(const void* kernel, size_t bytes, int dev) {
  FM_CHECK(bytes <= kMaxDynSmem, kOp, ": the k-slice reduction needs ", bytes, " bytes of shared memory (at most ",
           kMaxDynSmem, "; fewer warps along k)");
  if (bytes <= 48 * 1024) return;
  static std::mutex mu;
  static std::unordered_map<const void*, unsigned long long> raised;  // kernel -> bitmask of devices
  std::lock_guard<std::mutex> lock(mu);
  unsigned long long& mask = raised[kernel];
  if (!(mask & (1ull << dev))) {
    FM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(kMaxDynSmem)));
    mask |= 1ull << dev;
  }
}

// CTAs of (kernel, threads, dynamic smem) resident on the whole device at once (occupancy API, cached per device: it
// costs microseconds).
int resident_ctas(const void* kernel, int threads, size_t smem, int dev) {
  struct Key {
    const void* k;
    int dev, threads;
    size_t smem;
    bool operator==(const Key& o) const { return k == o.k && dev == o.dev && threads == o.threads && smem == o.smem; }
  };
  struct Hash {
    size_t operator()(const Key& k) const {
      return std::hash<const void*>()(k.k) ^ (k.smem * 1000003u) ^ (static_cast<size_t>(k.threads) << 20) ^
             static_cast<size_t>(k.dev);
    }
  };
  static std::mutex mu;
  static std::unordered_map<Key, int, Hash> cache;
  const Key key{kernel, dev, threads, smem};
  {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = cache.find(key); it != cache.end()) return it->second;
  }
  allow_smem(kernel, smem, dev);
  int per_sm = 0;
  FM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  const int n = std::max(1, per_sm) * device_facts(dev).sms;
  std::lock_guard<std::mutex> lock(mu);
  cache.emplace(key, n);
  return n;
}

template <typename Kernel>
void launch(Kernel kernel, dim3 grid, int threads, size_t smem, cudaStream_t stream, bool pdl, const GemvArgs& args,
            int dev) {
  allow_smem(reinterpret_cast<const void*>(kernel), smem, dev);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  FM_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args));
  FM_KERNEL_LAUNCH_CHECK();
}

template <typename F>
void dispatch_token_class(int64_t tokens, F&& f) {
  if (tokens <= 8) {
    f(std::integral_constant<int, 1>{});
  } else if (tokens <= 16) {
    f(std::integral_constant<int, 2>{});
  } else if (tokens <= 32) {
    f(std::integral_constant<int, 4>{});
  } else {
    f(std::integral_constant<int, 8>{});
  }
}

template <typename F>
void dispatch_16bit(ScalarType t, F&& f) {
  if (t == kBFloat16) {
    f(__nv_bfloat16{});
  } else {
    f(__half{});
  }
}

// 2-D, x's dtype and device, row-major contiguous, 16-byte aligned.
void check_operand(const Tensor& t, const char* name, const Tensor& x, const char* op = kOp) {
  FM_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got one on ", device_str(t));
  FM_CHECK(same_cuda_device(t, x), op, ": ", name, " must be on ", device_str(x), " (x's device), got ",
           device_str(t));
  FM_CHECK(t.dim() == 2, op, ": ", name, " must be 2-D, got ", t.dim(), "-D");
  FM_CHECK(t.scalar_type() == x.scalar_type(), op, ": ", name, " must have x's dtype ", x.scalar_type(), ", got ",
           t.scalar_type());
  FM_CHECK(t.numel() == 0 || ((t.size(1) <= 1 || t.stride(1) == 1) && (t.size(0) <= 1 || t.stride(0) == t.size(1))),
           op, ": ", name, " must be contiguous (row-major)");
  FM_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, op, ": ", name, " must be 16-byte aligned");
}

template <typename E, int NT, Act A>
void run_decode(const Tensor& x, const Tensor& w_gate, const Tensor& w_up, const Tensor& w_down, Tensor& y,
                const Tune& tune, int dev, cudaStream_t stream) {
  constexpr PassCfg gu = kGateUpCfg[nt_index(NT)];
  constexpr PassCfg dn = kDownCfg[nt_index(NT)];
  const DeviceFacts& facts = device_facts(dev);
  const int T = static_cast<int>(x.size(0)), H = static_cast<int>(x.size(1)), I = static_cast<int>(w_gate.size(0));
  const int H_out = static_cast<int>(w_down.size(0));

  const int gu_wr = pick(tune.gu_wr, gu.wr), gu_wk = pick(tune.gu_wk, gu.wk);
  const int dn_wr = pick(tune.dn_wr, dn.wr), dn_wk = pick(tune.dn_wk, dn.wk);
  FM_CHECK(gu_wr * gu_wk * 32 <= kMaxThreads && dn_wr * dn_wk * 32 <= kMaxThreads, kOp,
           ": FUSED_MLP_DECODE_TUNE: wr x wk must be at most ", kMaxThreads / 32, " warps per CTA");
  const int gu_groups = ceil_div(I, 16 * gu.r * gu_wr);
  const int dn_groups = ceil_div(H_out, 16 * dn.r * dn_wr);
  const auto down_kernel = gated_gemv_kernel<E, NT, dn.r, dn.u, dn.mb, false, Act::kSilu>;  // (A unused)
  const size_t smem2 = static_cast<size_t>(dn_wk - 1) * dn_wr * dn.r * NT * 32 * sizeof(float4);
  int ks = tune.dn_ks;
  if (ks <= 0) {  // the row groups' k-slices fill the CTAs the down pass has resident at once (one wave)
    const int slots = resident_ctas(reinterpret_cast<const void*>(down_kernel), 32 * dn_wr * dn_wk, smem2, dev);
    ks = slots / dn_groups;
    ks = std::min(ks, (I / kChunk) / (dn_wk * dn.u));  // at least one batch of U chunks per warp
    ks = std::max(1, std::min(ks, kMaxSplitCtas));
  }

  // One scratch allocation: h [T, I] (16-bit), then (ks > 1) the down pass's fp32 partial sums and its counters.
  const int64_t h_bytes = (static_cast<int64_t>(T) * I * 2 + 15) / 16 * 16;
  const int64_t partial_floats = ks > 1 ? int64_t{ks} * dn_groups * dn_wr * dn.r * NT * 32 * 4 : 0;
  const int64_t counter_ints = ks > 1 ? dn_groups : 0;
  const int64_t scratch_floats = h_bytes / 4 + partial_floats + counter_ints;
  Tensor scratch = fused_mlp::empty({scratch_floats}, kFloat, x);
  char* base = static_cast<char*>(scratch.data_ptr());
  void* h = base;
  float4* partials = ks > 1 ? reinterpret_cast<float4*>(base + h_bytes) : nullptr;
  int* counters = ks > 1 ? reinterpret_cast<int*>(base + h_bytes + partial_floats * 4) : nullptr;

  GemvArgs a1{};
  a1.w0 = static_cast<const uint4*>(w_gate.data_ptr());
  a1.w1 = static_cast<const uint4*>(w_up.data_ptr());
  a1.act = static_cast<const uint4*>(x.data_ptr());
  a1.out = h;
  a1.zero = counters;
  a1.n_zero = static_cast<int>(counter_ints);
  a1.rows = I;
  a1.k = H;
  a1.tokens = T;
  a1.wr = gu_wr;
  a1.wk = gu_wk;
  const size_t smem1 = static_cast<size_t>(gu_wk - 1) * gu_wr * 2 * gu.r * NT * 32 * sizeof(float4);
  launch(gated_gemv_kernel<E, NT, gu.r, gu.u, gu.mb, true, A>, dim3(gu_groups), 32 * gu_wr * gu_wk, smem1, stream,
         false, a1, dev);

  GemvArgs a2{};
  a2.w0 = static_cast<const uint4*>(w_down.data_ptr());
  a2.act = static_cast<const uint4*>(h);
  a2.out = y.data_ptr();
  a2.partials = partials;
  a2.counters = counters;
  a2.rows = H_out;
  a2.k = I;
  a2.tokens = T;
  a2.wr = dn_wr;
  a2.wk = dn_wk;
  const bool pdl = tune.pdl && facts.major >= 9;
  launch(down_kernel, dim3(dn_groups, ks), 32 * dn_wr * dn_wk, smem2, stream, pdl, a2, dev);
}

// y [T, N] = x [T, K] w^T: the down pass alone (one CTA per row group, no k split), PDL on sm_90+ so that its CTAs
// prefetch their first weights while the previous kernel drains.
template <typename E, int NT>
void run_linear(const Tensor& x, const Tensor& w, Tensor& y, const Tune& tune, int dev, cudaStream_t stream) {
  constexpr PassCfg lc = kLinearCfg[nt_index(NT)];
  const int wr = pick(tune.lin_wr, lc.wr), wk = pick(tune.lin_wk, lc.wk);
  FM_CHECK(wr * wk * 32 <= kMaxThreads, kLinearOp, ": FUSED_MLP_DECODE_TUNE: lin_wr x lin_wk must be at most ",
           kMaxThreads / 32, " warps per CTA");
  const int N = static_cast<int>(w.size(0));
  GemvArgs a{};
  a.w0 = static_cast<const uint4*>(w.data_ptr());
  a.act = static_cast<const uint4*>(x.data_ptr());
  a.out = y.data_ptr();
  a.rows = N;
  a.k = static_cast<int>(x.size(1));
  a.tokens = static_cast<int>(x.size(0));
  a.wr = wr;
  a.wk = wk;
  const size_t smem = static_cast<size_t>(wk - 1) * wr * lc.r * NT * 32 * sizeof(float4);
  const bool pdl = tune.pdl && device_facts(dev).major >= 9;
  launch(gated_gemv_kernel<E, NT, lc.r, lc.u, lc.mb, false, Act::kSilu, true>, dim3(ceil_div(N, 16 * lc.r * wr)),
         32 * wr * wk, smem, stream, pdl, a, dev);
}

}  // namespace
}  // namespace fused_mlp::cuda

using namespace fused_mlp::cuda;

namespace {
// x of either decode op: a CUDA tensor of 16-bit floats (then check_operand), on a device the build has code for.
void check_decode_x(const Tensor& x, const char* op) {
  FM_CHECK(x.is_cuda(), op, ": x must be a CUDA tensor, got one on ", device_str(x));
  FM_CHECK(x.scalar_type() == kBFloat16 || x.scalar_type() == kHalf, op, ": x must be bfloat16 or float16, got ",
           x.scalar_type());
  check_operand(x, "x", x, op);
  const DeviceFacts& facts = device_facts(device_index(x));
  FM_CHECK(facts.major >= 8, op, ": needs sm_80 or newer (bf16/fp16 mma.sync), this device is sm_", facts.major,
           facts.minor);
#ifdef FUSED_MLP_NO_ARCH
  FM_CHECK(false, op, ": this build has no code for sm_80 / sm_90 / sm_100 / sm_120 (gated_gemv.cu was compiled for "
           "none of its capabilities); use the default backend");
#endif
}
}  // namespace

// y = down(act(x w_gate^T) * (x w_up^T)) for T <= 64 tokens: x [T, H], w_gate / w_up [I, H], w_down [H_out, I].
Tensor gated_mlp_decode_cuda(const Tensor& x, const Tensor& w_gate, const Tensor& w_up, const Tensor& w_down,
                             StrArg activation) {
  const Act act = parse_activation(activation);
  check_decode_x(x, kOp);
  check_operand(w_gate, "w_gate", x);
  check_operand(w_up, "w_up", x);
  check_operand(w_down, "w_down", x);
  const int64_t T = x.size(0), H = x.size(1), I = w_gate.size(0), H_out = w_down.size(0);
  FM_CHECK(w_gate.size(1) == H, kOp, ": w_gate must be [I, H] with H = ", H, " (x is ", fused_mlp::shape_str(x),
           "), got ", fused_mlp::shape_str(w_gate));
  FM_CHECK(fused_mlp::same_shape(w_up, w_gate), kOp, ": w_up must have w_gate's shape ",
           fused_mlp::shape_str(w_gate), ", got ", fused_mlp::shape_str(w_up));
  FM_CHECK(w_down.size(1) == I, kOp, ": w_down must be [H_out, I] with I = ", I, " (w_gate's rows), got ",
           fused_mlp::shape_str(w_down));
  FM_CHECK(T <= kMaxTokens, kOp, ": x has ", T, " rows (tokens); this op takes at most ", kMaxTokens,
           " (larger T: the GEMM path)");
  FM_CHECK(H % 8 == 0 && I % 8 == 0, kOp, ": H and I must be multiples of 8 (16-byte rows), got H = ", H, ", I = ", I);
  FM_CHECK(H < (int64_t{1} << 30) && I < (int64_t{1} << 30) && H_out < (int64_t{1} << 30), kOp,
           ": H, I and H_out must be below 2^30");
  const int dev = device_index(x);
  const Tune tune = read_tune();
  DeviceGuard guard(x);
  if (T == 0 || H_out == 0) return fused_mlp::empty({T, H_out}, x.scalar_type(), x);
  if (I == 0) return fused_mlp::zeros({T, H_out}, x.scalar_type(), x);  // an empty sum
  Tensor y = fused_mlp::empty({T, H_out}, x.scalar_type(), x);
  const cudaStream_t stream = current_stream(x);
  dispatch_16bit(x.scalar_type(), [&](auto tag) {
    using E = decltype(tag);
    dispatch_token_class(T, [&](auto nt) {
      dispatch_act(act, [&](auto a) { run_decode<E, decltype(nt)::value, decltype(a)::value>(x, w_gate, w_up, w_down, y, tune, dev, stream); });
    });
  });
  return y;
}

// y = x w^T for T <= 64 tokens: x [T, K], w [N, K] (nn.Linear's weight), no bias.
Tensor linear_decode_cuda(const Tensor& x, const Tensor& w) {
  check_decode_x(x, kLinearOp);
  check_operand(w, "w", x, kLinearOp);
  const int64_t T = x.size(0), K = x.size(1), N = w.size(0);
  FM_CHECK(w.size(1) == K, kLinearOp, ": w must be [N, K] with K = ", K, " (x is ", fused_mlp::shape_str(x),
           "), got ", fused_mlp::shape_str(w));
  FM_CHECK(T <= kMaxTokens, kLinearOp, ": x has ", T, " rows (tokens); this op takes at most ", kMaxTokens,
           " (larger T: the GEMM path)");
  FM_CHECK(K % 8 == 0, kLinearOp, ": K must be a multiple of 8 (16-byte rows), got ", K);
  FM_CHECK(K < (int64_t{1} << 30) && N < (int64_t{1} << 30), kLinearOp, ": K and N must be below 2^30");
  const int dev = device_index(x);
  const Tune tune = read_tune();
  DeviceGuard guard(x);
  if (T == 0 || N == 0) return fused_mlp::empty({T, N}, x.scalar_type(), x);
  if (K == 0) return fused_mlp::zeros({T, N}, x.scalar_type(), x);  // an empty sum
  Tensor y = fused_mlp::empty({T, N}, x.scalar_type(), x);
  const cudaStream_t stream = current_stream(x);
  dispatch_16bit(x.scalar_type(), [&](auto tag) {
    using E = decltype(tag);
    dispatch_token_class(T, [&](auto nt) { run_linear<E, decltype(nt)::value>(x, w, y, tune, dev, stream); });
  });
  return y;
}


// ---- Token count chosen at run time (torch.compile with a symbolic T: _decode.py passes the table's limit) --------
// The decode kernels where T <= max_tokens and the storages are 16-byte aligned (the Python side has checked dtypes,
// shapes and contiguity when the graph was traced); the GEMM path otherwise: addmm_fwd's cuBLASLt GEMMs (fp32
// accumulation, one rounding each) and, for the gated MLP, geglu_fwd between them. Under CUDA graphs each captured
// size records its own choice.

namespace {
bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }
}  // namespace

Tensor gated_mlp_auto_cuda(const Tensor& x, const Tensor& w_gate, const Tensor& w_up, const Tensor& w_down,
                           StrArg activation, int64_t max_tokens) {
  const int64_t T = x.size(0);
  if (T <= std::min<int64_t>(max_tokens, kMaxTokens) && aligned16(x) && aligned16(w_gate) && aligned16(w_up) &&
      aligned16(w_down))
    return gated_mlp_decode_cuda(x, w_gate, w_up, w_down, activation);
  const Tensor gate = mm_rows_cuda(x, fused_mlp::transposed(w_gate));
  const Tensor up = mm_rows_cuda(x, fused_mlp::transposed(w_up));
  return mm_rows_cuda(geglu_fwd_cuda(gate, up, activation), fused_mlp::transposed(w_down));
}

Tensor linear_auto_cuda(const Tensor& x, const Tensor& w, int64_t max_tokens) {
  if (x.size(0) <= std::min<int64_t>(max_tokens, kMaxTokens) && aligned16(x) && aligned16(w))
    return linear_decode_cuda(x, w);
  return mm_rows_cuda(x, fused_mlp::transposed(w));
}
