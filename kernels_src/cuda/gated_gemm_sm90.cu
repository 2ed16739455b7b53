// Hopper (sm_90a) GEMMs with the gated activation in the epilogue: the GeGLU MLP's up projection and the
// backward's dh GEMM, so the [T, I] intermediate is written once per pass and never re-read by a separate kernel.
//
//   forward   h = act(x W_g^T) * (x W_u^T)          [T, I], one rounding of the fp32 accumulators; in training
//             also gate = x W_g^T and up = x W_u^T (rounded once each) for the backward.
//   backward  dh = dy W_d (fp32, never stored); from the saved gate, up:
//             h = act(gate) * up, dgate = dh * up * act'(gate), dup = dh * act(gate); dgate and dup are written over
//             gate and up (each element is read and written by one thread), h into its own buffer (for dW_down).
//   the slopes form (both passes fused, see EpiArgs): the forward saves P = up * act'(gate) and Q = act(gate)
//             next to h, the backward writes dgate = dh * P over P and dup = dh * Q over Q, and no h.
//
// Built on CUTLASS 3 (headers from the nvidia-cutlass registry package): the persistent warp-specialised kernels
// (one TMA producer warp; ping-pong: two consumer warpgroups with a 128x128x64 tile each, taking turns at the
// tensor cores, the default; cooperative: both on one 128x256x64 tile; a 2x1 cluster multicasting B) with their
// stock sm_90 TMA/WGMMA mainloop, and two pieces of ours:
//   * DualBMainloop: the stock mainloop with a second B operand. Each stage's BN-row B tile is filled by two TMA
//     loads of BN/2 rows, one from W_gate and one from W_up (the module's own tensors, no concatenated copy):
//     accumulator columns [0, BN/2) are gate and [BN/2, BN) up for the same BN/2 output features. The virtual GEMM
//     is [T, 2I]; the MMA and the pipeline are the stock ones.
//   * GatedEpilogue: an epilogue on the accumulators in registers (CUTLASS's "no-smem" adapter) that pairs
//     accumulator column c with c + BN/2 (the WGMMA accumulator layout gives one thread both, checked at compile
//     time); the four lanes of a quad then transpose their values with shuffles, so that each thread reads and
//     writes 8 adjacent elements (16 bytes) at a time. The backward's ping-pong epilogue streams its tile's
//     gate/up with cp.async through a ring of 8 blocks per thread in 32 KB of shared memory of its own (the
//     mainloop keeps 6 stages instead of 7), so the loads run 8 groups ahead of the math.
// Other architectures never launch these kernels (Python dispatch checks the device; the entry points check it
// again); on them the cuBLAS path runs. Without sm_90a in the build (FUSED_MLP_NO_ARCH) the entry points report
// that.
// Release build of CUTLASS: its device-side assert()s are calls, and a call between WGMMAs makes ptxas serialise
// the whole WGMMA pipeline (warning C7510).
#ifndef NDEBUG
#define NDEBUG
#endif

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <tuple>

// CUTLASS before the torch headers: its templates name `Tensor` unqualified (cute's), and the binding header
// declares a global one.
#ifndef FUSED_MLP_NO_ARCH
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cute/tensor.hpp>
#include <cutlass/cluster_launch.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/detail.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/kernel_hardware_info.h>
#endif

#include "cuda/common.cuh"
#include "cuda/sm90_sched.cuh"
#include "cuda/gated_act.cuh"
#include "torch_binding.h"

#ifndef FUSED_MLP_NO_ARCH

namespace fm_sm90 {

using fused_mlp::cuda::Act;
using cute::_1;
using cute::_2;
using cute::Int;

using Stride2D = cute::Stride<int64_t, _1, int64_t>;  // row-major [rows, cols] (+ unused batch)

// Kernel configurations (schedule, CTA tile, cluster). Cooperative: two consumer warpgroups share one 128x256 tile
// (m64n256 WGMMAs), the epilogue runs after the tile's mainloop. Ping-pong: each consumer warpgroup owns a 128x128
// tile (two m64n128 WGMMAs per k-step) and runs its epilogue while the other warpgroup's mainloop runs.
struct Cooperative {
  using Schedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using TileShape = cute::Shape<Int<128>, Int<256>, Int<64>>;
  using ClusterShape = cute::Shape<_2, _1, _1>;
};
struct PingPong {
  using Schedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using TileShape = cute::Shape<Int<128>, Int<128>, Int<64>>;
  using ClusterShape = cute::Shape<_2, _1, _1>;
};

// ---- the stock sm_90 mainloop (TMA + WGMMA, warp-specialised) ----------------------------------------------------
// EpiSmem: the bytes of shared memory the epilogue keeps (GatedEpilogue::SharedStorage); the stages get the rest.
template <class Cfg, class E, class LayoutB, int EpiSmem>
using StockMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    E, cutlass::layout::RowMajor, 8,  // A: [T, K] row-major
    E, LayoutB, 8,                    // B: ColumnMajor = [N, K] rows (weights), RowMajor = [K, N] rows
    float, typename Cfg::TileShape, typename Cfg::ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<EpiSmem>,
    typename Cfg::Schedule>::CollectiveOp;

// ---- the stock mainloop with two B operands ------------------------------------------------------------------
template <class Base>
struct DualBMainloop : Base {
  using ClusterShape = typename Base::DispatchPolicy::ClusterShape;
  using typename Base::ElementA;
  using typename Base::ElementB;
  using typename Base::GmemTiledCopyB;
  using typename Base::InternalElementB;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutAtomB;
  using typename Base::SmemLayoutB;
  using typename Base::StrideA;
  using typename Base::StrideB;
  using typename Base::TensorStorage;
  using typename Base::TileShape;
  static constexpr int Stages = Base::DispatchPolicy::Stages;
  static constexpr int kBM = cute::size<0>(TileShape{}), kHalfN = cute::size<1>(TileShape{}) / 2,
                       kBK = cute::size<2>(TileShape{});
  using HalfTile = cute::Shape<Int<kBM>, Int<kHalfN>, Int<kBK>>;
  static_assert(cutlass::gemm::detail::is_k_major<StrideB>(), "the dual-B mainloop takes K-major weights");
  // One half of a stage's B tile (the stage's first or last BN/2 rows of SmemLayoutB).
  using SmemLayoutBHalf = decltype(cute::tile_to_shape(
      SmemLayoutAtomB{}, cute::make_shape(Int<kHalfN>{}, Int<kBK>{}, Int<Stages>{}), cute::Step<_1, _2, cute::_3>{}));
  using TMA_BH = decltype(cute::make_tma_copy_B_sm90(
      GmemTiledCopyB{},
      cute::make_tensor(static_cast<InternalElementB const*>(nullptr), cute::repeat_like(StrideB{}, int32_t(0)),
                        StrideB{}),
      SmemLayoutBHalf{}(cute::_, cute::_, Int<0>{}), HalfTile{}, ClusterShape{}));

  struct Arguments {
    ElementA const* ptr_A;
    StrideA dA;
    ElementB const* ptr_B_gate;
    ElementB const* ptr_B_up;
    StrideB dB;
  };
  struct Params {
    typename Base::Params base;  // A's TMA (B's is built for the gate weight and not used)
    TMA_BH tma_load_b_gate;
    TMA_BH tma_load_b_up;
    uint32_t tma_transaction_bytes = Base::TmaTransactionBytes;  // A tile + both B halves
  };

  template <class ProblemShape>
  CUTLASS_HOST_DEVICE static auto real_problem(ProblemShape const& p) {  // the virtual [M, 2N] GEMM -> the [M, N] one
    auto [M, N2, K, L] = cute::append<4>(p, 1);
    return cute::make_shape(M, N2 / 2, K, L);
  }

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* ws) {
    auto [M, N, K, L] = real_problem(problem_shape);
    Params p;
    p.base = Base::to_underlying_arguments(cute::make_shape(M, N, K, L),
                                           typename Base::Arguments{args.ptr_A, args.dA, args.ptr_B_gate, args.dB},
                                           ws);
    auto tma_half = [&](ElementB const* ptr) {
      auto t = cute::make_tensor(reinterpret_cast<InternalElementB const*>(ptr),
                                 cute::make_layout(cute::make_shape(N, K, L), args.dB));
      return cute::make_tma_copy_B_sm90(GmemTiledCopyB{}, t, SmemLayoutBHalf{}(cute::_, cute::_, Int<0>{}),
                                        HalfTile{}, ClusterShape{});
    };
    p.tma_load_b_gate = tma_half(args.ptr_B_gate);
    p.tma_load_b_up = tma_half(args.ptr_B_up);
    p.tma_transaction_bytes = Base::TmaTransactionBytes;
    return p;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    auto [M, N, K, L] = real_problem(problem_shape);
    return Base::can_implement(cute::make_shape(M, N, K, L),
                               typename Base::Arguments{args.ptr_A, args.dA, args.ptr_B_gate, args.dB});
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& p) {
    cute::prefetch_tma_descriptor(p.base.tma_load_a.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_load_b_gate.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_load_b_up.get_tma_descriptor());
  }

  // (gA_mkl, gBg_nkl, gBu_nkl): the B tensors tiled by 128 rows, so their tile count is the virtual GEMM's.
  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& problem_shape_MNKL, Params const& p) const {
    using X = cute::Underscore;
    auto [M, N, K, L] = real_problem(problem_shape_MNKL);
    auto mA = p.base.tma_load_a.get_tma_tensor(cute::make_shape(M, K, L));
    auto mBg = p.tma_load_b_gate.get_tma_tensor(cute::make_shape(N, K, L));
    auto mBu = p.tma_load_b_up.get_tma_tensor(cute::make_shape(N, K, L));
    auto gA = cute::local_tile(mA, TileShape{}, cute::make_coord(cute::_, cute::_, cute::_), cute::Step<_1, X, _1>{});
    auto gBg = cute::local_tile(mBg, HalfTile{}, cute::make_coord(cute::_, cute::_, cute::_), cute::Step<X, _1, _1>{});
    auto gBu = cute::local_tile(mBu, HalfTile{}, cute::make_coord(cute::_, cute::_, cute::_), cute::Step<X, _1, _1>{});
    return cute::make_tuple(gA, gBg, gBu);
  }

  // Producer: per k-tile, A once and the two B halves into one stage, one transaction barrier.
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& p, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB, TensorB> const& load_inputs, BlockCoord const& blk_coord,
                           KTileIterator k_tile_iter, int k_tile_count, int /*thread_idx*/,
                           uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
    using namespace cute;
    if (!cute::elect_one_sync()) return;
    auto sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), typename Base::SmemLayoutA{});
    auto sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});  // (256, BK, PIPE)
    auto sB_halves = flat_divide(sB, Shape<Int<kHalfN>, Int<kBK>>{});                  // (BN/2, BK, 2, 1, PIPE)
    auto sBg = sB_halves(_, _, 0, 0, _);
    auto sBu = sB_halves(_, _, 1, 0, _);

    constexpr uint32_t cluster_shape_x = get<0>(ClusterShape{});
    uint2 cluster_local_block_id = {block_rank_in_cluster % cluster_shape_x, block_rank_in_cluster / cluster_shape_x};
    auto block_tma_a = p.base.tma_load_a.get_slice(cluster_local_block_id.y);
    auto block_tma_bg = p.tma_load_b_gate.get_slice(cluster_local_block_id.x);
    auto block_tma_bu = p.tma_load_b_up.get_slice(cluster_local_block_id.x);

    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    auto tAgA = block_tma_a.partition_S(get<0>(load_inputs)(_, _, m_coord, _, l_coord));
    auto tAsA = block_tma_a.partition_D(sA);
    auto tBgBg = block_tma_bg.partition_S(get<1>(load_inputs)(_, _, n_coord, _, l_coord));
    auto tBsBg = block_tma_bg.partition_D(sBg);
    auto tBgBu = block_tma_bu.partition_S(get<2>(load_inputs)(_, _, n_coord, _, l_coord));
    auto tBsBu = block_tma_bu.partition_D(sBu);

    uint16_t mcast_mask_a = 0, mcast_mask_b = 0;
    auto block_layout = Layout<ClusterShape>{};  // (m, n) -> block id
    if constexpr (cute::is_same_v<typename Base::GmemTiledCopyA, SM90_TMA_LOAD_MULTICAST>) {
      for (int n = 0; n < size<1>(block_layout); ++n)
        mcast_mask_a |= uint16_t(1) << block_layout(cluster_local_block_id.x, n, Int<0>{});
    }
    if constexpr (cute::is_same_v<GmemTiledCopyB, SM90_TMA_LOAD_MULTICAST>) {
      for (int m = 0; m < size<0>(block_layout); ++m)
        mcast_mask_b |= uint16_t(1) << block_layout(m, cluster_local_block_id.y, Int<0>{});
    }

    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(smem_pipe_write);
      auto* bar = pipeline.producer_get_barrier(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      copy(p.base.tma_load_a.with(*bar, mcast_mask_a), tAgA(_, _, _, *k_tile_iter), tAsA(_, _, _, stage));
      copy(p.tma_load_b_gate.with(*bar, mcast_mask_b), tBgBg(_, _, _, *k_tile_iter), tBsBg(_, _, _, stage));
      copy(p.tma_load_b_up.with(*bar, mcast_mask_b), tBgBu(_, _, _, *k_tile_iter), tBsBu(_, _, _, stage));
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }

  // Consumer: the stock MMA (it does not read the TMA parameters).
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum, int k_tile_count,
                          int thread_idx, TensorStorage& shared_tensors, Params const& p) {
    Base::mma(pipeline, smem_pipe_read, accum, k_tile_count, thread_idx, shared_tensors, p.base);
  }
};

// ---- the epilogues -----------------------------------------------------------------------------------------
template <class E>
__device__ __forceinline__ float2 unpack2(uint32_t w) {  // two 16-bit values (low address first) as floats
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
  }
}
template <class E>
__device__ __forceinline__ uint32_t pack2(float a, float b) {  // two values rounded once, low address first
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// The epilogue reads the accumulator fragment as (a, b, j, mm): the WGMMA C layout ((2, 2, J), MM, 1), where a picks
// one of two adjacent columns, b one of two rows 8 apart, j a group of 8 columns and mm the 64-row block. Checked
// on the TiledMMA's (thread, value) -> (row, column) layout: adjacent columns for a = 0, 1, and (dual B) column
// c + BN/2 at j + J/2 (value v + 2J).
template <class TiledMma, int BN>
constexpr bool accumulator_pairs_ok(bool dual) {
  using namespace cute;
  // (thread, value) -> column-major index in the TiledMMA's own (TM, TN) tile: one 64-row WGMMA block per thread
  // (the CTA tile repeats it MM times along M).
  auto tv = TiledMma{}.get_layoutC_TV();
  constexpr int TM = tile_size<0>(TiledMma{}), TN = tile_size<1>(TiledMma{});
  constexpr int nthr = size<0>(decltype(tv){}), nv = size<1>(decltype(tv){}), J = nv / 4;
  if (TN != BN) return false;
  // every value of a sample of threads (lanes and warps of each warpgroup; all threads exceeds nvcc's constexpr
  // budget)
  for (int t : {0, 1, 2, 3, 4, 5, 9, 17, 31, 32, 45, 64, 101, 127, nthr - 128, nthr - 77, nthr - 1}) {
    for (int v = 0; v < nv; v += 2) {
      const int i0 = tv(t, v), i1 = tv(t, v + 1);
      if (i1 != i0 + TM) return false;  // values v, v + 1: one row, adjacent columns
      const int j = v / 4;
      if (dual && j < J / 2 && (tv(t, v + 2 * J) != i0 + (BN / 2) * TM || i0 / TM >= BN / 2)) return false;
    }
  }
  return true;
}

// The epilogues' quad transpose (GatedEpilogue::quad_transpose) relies on the same layout in more detail: value
// (a, b, j) of thread t is in column 8j + 2 (t % 4) + a, and in one row for every j.
template <class TiledMma>
constexpr bool quad_layout_ok() {
  using namespace cute;
  auto tv = TiledMma{}.get_layoutC_TV();
  constexpr int TM = tile_size<0>(TiledMma{});
  constexpr int nthr = size<0>(decltype(tv){}), nv = size<1>(decltype(tv){});
  for (int t : {0, 1, 2, 3, 5, 6, 11, 30, 31, 32, 63, 66, 127, nthr - 128, nthr - 3, nthr - 1}) {
    for (int v = 0; v < nv; ++v) {
      const int i = tv(t, v);
      if (i / TM != 8 * (v / 4) + 2 * (t % 4) + v % 2 || i % TM != tv(t, v % 4) % TM) return false;
    }
  }
  return true;
}

// What the training forward saves for the backward, and so what the backward's epilogue reads (`slopes`):
//   preact (slopes = false): gate and up, rounded once each; the backward recomputes act and act' from gate and
//     writes h (for dW_down) next to dgate and dup.
//   slopes (slopes = true): P = up * act'(gate) and Q = act(gate) (rounded once each), next to h, which the forward
//     writes anyway and which is then kept; the backward's epilogue is two multiplies per element, dgate = dh P and
//     dup = dh Q, and writes no h. One [M, N] tensor more is saved (h), the backward's largest live set stays three
//     (h, P, Q against gate, up, h), and the backward epilogue moves its activation math into the forward's, which
//     runs behind the dual-B GEMM's twice-as-long mainloop.
struct EpiArgs {
  void* h = nullptr;        // fwd: [M, N] output (always); bwd: [M, N] output (preact), unused (slopes)
  void* gate = nullptr;     // fwd: optional [M, N] output (training: gate or P); bwd: input (gate or P), dgate over it
  void* up = nullptr;       // fwd: optional output (up or Q); bwd: input (up or Q), dup written over it
  int64_t ld = 0;           // row stride of all of them (elements)
  int M = 0, N = 0;         // the real output shape
  Act act = Act::kGeluTanh;
  bool slopes = false;      // the saved form (above)
};

// 16 bytes from global to shared memory without passing through registers (cp.async, L2 only), and its waits.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {  // all but the newest N committed groups have landed
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
template <int kMax>
__device__ __forceinline__ void cp_async_wait_upto(int n) {  // cp_async_wait<n> for a constant (unrolled) n <= kMax
  if constexpr (kMax > 0) {
    if (n >= kMax) {
      cp_async_wait<kMax>();
      return;
    }
    cp_async_wait_upto<kMax - 1>(n);
  } else {
    cp_async_wait<0>();
  }
}

// kBwd = false: accumulator columns [0, BN/2) are gate and [BN/2, BN) up (DualBMainloop); kBwd = true: the
// accumulator is dh over BN output columns. kStaged (backward, ping-pong only): the epilogue reads the tile's
// gate/up through shared memory (see run); it relies on one warpgroup of 128 threads per tile and on the ping-pong
// kernel running the two warpgroups' epilogues one after the other (its math order barrier), so one buffer serves
// both.
template <class E, bool kBwd, class TileShape, bool kStaged = false>
struct GatedEpilogue {
  using ElementC = cutlass::bfloat16_t;  // the kernel layer names these types; C/D are ours (EpiArgs)
  using ElementD = cutlass::bfloat16_t;
  using StrideC = Stride2D;
  using StrideD = Stride2D;
  using ElementAccumulator = float;
  static_assert(!kStaged || kBwd, "only the backward epilogue reads inputs");
  // per thread: kBM * kBN / 128 accumulators in groups of 8 columns (one 16-byte access of gate and of up each)
  static constexpr int kStagedGroups = cute::size<0>(TileShape{}) * cute::size<1>(TileShape{}) / (128 * 8);
  static constexpr int kStagedDepth = kStagedGroups / 2;  // groups in flight per thread (slots)
  struct StagedStorage {
    alignas(128) uint4 gate[kStagedDepth][128];  // [slot][thread]: a warp's accesses are 512 contiguous bytes
    alignas(128) uint4 up[kStagedDepth][128];
  };
  struct NoStorage {};
  using SharedStorage = cute::conditional_t<kStaged, StagedStorage, NoStorage>;
  static constexpr int kSmemBytes = kStaged ? static_cast<int>(sizeof(StagedStorage)) : 0;
  using Arguments = EpiArgs;
  using Params = EpiArgs;
  static constexpr int kBM = cute::size<0>(TileShape{}), kBN = cute::size<1>(TileShape{});

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& a, void*) {
    return a;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& a) {
    return a.N % 2 == 0 && a.ld % 2 == 0;
  }

  CUTLASS_HOST_DEVICE GatedEpilogue(Params const& p, SharedStorage const& = SharedStorage()) : params(p) {}

  // A: the activation; kSlopes (backward only): the saved form is P, Q (EpiArgs), and A is not used.
  template <Act A, bool kSlopes, class Acc, class Crd>
  CUTLASS_DEVICE void run(Acc const& acc, Crd const& crd, int m0, int n0, int tid, char* smem) const {
    using namespace cute;
    constexpr int J = size<2>(Acc{}), MM = size<3>(Acc{});
    static_assert(size<0>(Acc{}) == 2 && size<1>(Acc{}) == 2 && size<4>(Acc{}) == 1, "unexpected accumulator layout");
    E* h = static_cast<E*>(params.h);
    E* gate = static_cast<E*>(params.gate);
    E* up = static_cast<E*>(params.up);
    const int64_t ld = params.ld;
    const int q = static_cast<int>(threadIdx.x & 3);
    if constexpr (!kBwd) {
      // h (and in training gate, up) for the 8-column blocks j < J/2 of the gate half, rounded to 16-bit pairs in
      // the accumulator layout; then the quad transposes the packed words (quad_transpose) so that lane q stores
      // block 4g + q whole: 16-byte stores, 64 contiguous bytes per quad and row (see the backward below).
      constexpr int G = J / 8;
      static_assert(J % 8 == 0, "the quad transpose takes the gate half's 8-column blocks four at a time");
      // save: gate and up (or P = up act'(gate) and Q = act(gate), params.slopes) next to h; a warp-uniform branch
      // per group, which keeps one kernel for the three forms.
      const bool save = gate != nullptr, slopes = params.slopes;
      CUTLASS_PRAGMA_UNROLL
      for (int mm = 0; mm < MM; ++mm) {
        CUTLASS_PRAGMA_UNROLL
        for (int b = 0; b < 2; ++b) {
          CUTLASS_PRAGMA_UNROLL
          for (int g = 0; g < G; ++g) {
            uint32_t hw[4], gw[4], uw[4];
            if (!slopes) {
              CUTLASS_PRAGMA_UNROLL
              for (int k = 0; k < 4; ++k) {
                const int j = 4 * g + k;
                const float g0 = acc(0, b, j, mm, 0), g1 = acc(1, b, j, mm, 0);
                const float u0 = acc(0, b, j + J / 2, mm, 0), u1 = acc(1, b, j + J / 2, mm, 0);
                using fused_mlp::cuda::act_fwd;
                hw[k] = pack2<E>(act_fwd<A, true>(g0) * u0, act_fwd<A, true>(g1) * u1);
                gw[k] = pack2<E>(g0, g1);
                uw[k] = pack2<E>(u0, u1);
              }
            } else {
              CUTLASS_PRAGMA_UNROLL
              for (int k = 0; k < 4; ++k) {
                const int j = 4 * g + k;
                const float g0 = acc(0, b, j, mm, 0), g1 = acc(1, b, j, mm, 0);
                const float u0 = acc(0, b, j + J / 2, mm, 0), u1 = acc(1, b, j + J / 2, mm, 0);
                float a0, da0, a1, da1;
                fused_mlp::cuda::act_fwd_bwd<A, true>(g0, a0, da0);
                fused_mlp::cuda::act_fwd_bwd<A, true>(g1, a1, da1);
                hw[k] = pack2<E>(a0 * u0, a1 * u1);
                gw[k] = pack2<E>(u0 * da0, u1 * da1);  // P
                uw[k] = pack2<E>(a0, a1);              // Q
              }
            }
            quad_transpose(hw, q);
            if (save) {
              quad_transpose(gw, q);
              quad_transpose(uw, q);
            }
            int64_t off;
            if (block_at(crd, mm, b, g, q, m0, n0, off)) {
              *reinterpret_cast<uint4*>(h + off) = make_uint4(hw[0], hw[1], hw[2], hw[3]);
              if (save) {
                *reinterpret_cast<uint4*>(gate + off) = make_uint4(gw[0], gw[1], gw[2], gw[3]);
                *reinterpret_cast<uint4*>(up + off) = make_uint4(uw[0], uw[1], uw[2], uw[3]);
              }
            }
          }
        }
      }
    } else {
      // The saved gate/up are read here and dgate/dup written over them, h into its own buffer. In the WGMMA
      // accumulator layout a thread holds two adjacent columns per 8-column block, so its own accesses would be
      // 4-byte words, 8 rows per warp instruction (a quarter of a sector used per row and word: the epilogue then
      // cost more than the cuBLAS path's separate elementwise pass, docs/tuning-log.md#gated-gemm-bwd-16byte). So
      // the four lanes of a quad first transpose their fp32 dh (quad_transpose): for each group of four blocks,
      // lane q takes block 4g + q, all 8 columns. Every access is then 16 bytes (8 bf16/fp16) per thread, 64
      // contiguous bytes per quad and row.
      constexpr int G = J / 4, NG = MM * 2 * G;
      static_assert(J % 4 == 0, "the quad transpose takes the accumulator's 8-column blocks four at a time");
      // group k = (mm, b, g): where this lane's block of it is (block_at)
      auto where = [&](int k, int64_t& off) {
        return block_at(crd, k / (2 * G), (k / G) % 2, k % G, q, m0, n0, off);
      };
      // Group k's dGeGLU from its gate/up block (8 elements each): h, dgate, dup stored 16 bytes at a time.
      auto finish = [&](int k, uint4 gv, uint4 uv) {
        const int mm = k / (2 * G), b = (k / G) % 2, g = k % G;
        // dh of block 4g + q: d0[p], d1[p] = columns 2p, 2p + 1 (every lane of the quad takes part: before the
        // bounds test)
        float d0[4], d1[4];
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < 4; ++c) {
          d0[c] = acc(0, b, 4 * g + c, mm, 0);
          d1[c] = acc(1, b, 4 * g + c, mm, 0);
        }
        quad_transpose(d0, q);
        quad_transpose(d1, q);
        int64_t off;
        if (kSlopes) {  // gv, uv: P and Q; dgate = dh P, dup = dh Q, no h
          if (where(k, off)) {
            const uint32_t* pw = reinterpret_cast<const uint32_t*>(&gv);
            const uint32_t* qw = reinterpret_cast<const uint32_t*>(&uv);
            uint32_t dgw[4], duw[4];
            CUTLASS_PRAGMA_UNROLL
            for (int w = 0; w < 4; ++w) {
              const float2 pp = unpack2<E>(pw[w]), qq = unpack2<E>(qw[w]);
              dgw[w] = pack2<E>(d0[w] * pp.x, d1[w] * pp.y);
              duw[w] = pack2<E>(d0[w] * qq.x, d1[w] * qq.y);
            }
            *reinterpret_cast<uint4*>(gate + off) = make_uint4(dgw[0], dgw[1], dgw[2], dgw[3]);
            *reinterpret_cast<uint4*>(up + off) = make_uint4(duw[0], duw[1], duw[2], duw[3]);
          }
        } else if (where(k, off)) {
          const uint32_t* gw = reinterpret_cast<const uint32_t*>(&gv);
          const uint32_t* uw = reinterpret_cast<const uint32_t*>(&uv);
          uint32_t hw[4], dgw[4], duw[4];
          CUTLASS_PRAGMA_UNROLL
          for (int w = 0; w < 4; ++w) {
            const float2 gg = unpack2<E>(gw[w]), uu = unpack2<E>(uw[w]);
            float a0, da0, a1, da1;
            fused_mlp::cuda::act_fwd_bwd<A, true>(gg.x, a0, da0);
            fused_mlp::cuda::act_fwd_bwd<A, true>(gg.y, a1, da1);
            hw[w] = pack2<E>(a0 * uu.x, a1 * uu.y);
            dgw[w] = pack2<E>(d0[w] * uu.x * da0, d1[w] * uu.y * da1);
            duw[w] = pack2<E>(d0[w] * a0, d1[w] * a1);
          }
          *reinterpret_cast<uint4*>(h + off) = make_uint4(hw[0], hw[1], hw[2], hw[3]);
          *reinterpret_cast<uint4*>(gate + off) = make_uint4(dgw[0], dgw[1], dgw[2], dgw[3]);
          *reinterpret_cast<uint4*>(up + off) = make_uint4(duw[0], duw[1], duw[2], duw[3]);
        }
      };
      if constexpr (kStaged) {
        // The tile's gate/up blocks stream through shared memory, which holds no registers (the accumulators take
        // most of them), with cp.async: a ring of D = NG/2 slots per thread, one commit group per accumulator group,
        // D groups in flight; group k's slot is refilled with group k + D right after group k is done. So the
        // loads run D groups ahead of the math, in 32 KB: the mainloop keeps 6 stages (faster than the whole tile
        // at once into 64 KB with 5 stages: docs/tuning-log.md#gated-gemm-bwd-staging). Each thread reads back
        // and refills only its own slots (cp.async.wait_group orders that), so no barrier is needed; the other
        // warpgroup's epilogue, which reuses the buffer, starts only after this one has ended (the ping-pong's
        // math order barrier).
        static_assert(NG == kStagedGroups && NG % 2 == 0, "staged epilogue: unexpected accumulator size");
        constexpr int D = kStagedDepth;
        auto& st = *reinterpret_cast<StagedStorage*>(smem);
        auto issue = [&](int k) {
          int64_t off;
          if (where(k, off)) {
            cp_async_16(&st.gate[k % D][tid], gate + off);
            cp_async_16(&st.up[k % D][tid], up + off);
          }
          cp_async_commit();  // one commit group per accumulator group, empty or not (the waits count them)
        };
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < D; ++k) issue(k);
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < NG; ++k) {
          // group k has landed: all but the newest (committed - k - 1) groups (a constant once unrolled)
          cp_async_wait_upto<D>(((D + k < NG) ? D + k : NG) - k - 1);
          finish(k, st.gate[k % D][tid], st.up[k % D][tid]);
          // slot k % D is free again: finish's stores consumed what it read (and the asm's memory clobber keeps
          // them in program order before the next cp.async)
          if (k + D < NG) issue(k + D);
        }
      } else {
        // Each element is read before it is written, by the same thread; the compiler cannot know that a later
        // load does not read an earlier store's address, so it would issue load, compute, store group by group:
        // one memory latency each. The loads therefore run kAhead groups ahead in program order, after asking
        // L2 for this thread's rows of gate/up in the tile (the four lanes of a quad share two rows per 64-row
        // block; lane 0 of the quad prefetches them, one 128-byte line at a time).
        constexpr int kAhead = 3;
        if ((threadIdx.x & 3) == 0) {
          const int cols = min(kBN, params.N - n0);
          CUTLASS_PRAGMA_UNROLL
          for (int mm = 0; mm < MM; ++mm) {
            CUTLASS_PRAGMA_UNROLL
            for (int b = 0; b < 2; ++b) {
              const int m = m0 + get<0>(crd(0, b, 0, mm, 0));
              if (m < params.M) {
                const int64_t row = static_cast<int64_t>(m) * ld + n0;
                for (int c = 0; c < cols; c += 128 / static_cast<int>(sizeof(E))) {
                  asm volatile("prefetch.global.L2 [%0];" ::"l"(gate + row + c));
                  asm volatile("prefetch.global.L2 [%0];" ::"l"(up + row + c));
                }
              }
            }
          }
        }
        uint4 gbuf[kAhead], ubuf[kAhead];
        auto load = [&](int k) {
          int64_t off;
          const bool live = where(k, off);
          gbuf[k % kAhead] = live ? *reinterpret_cast<const uint4*>(gate + off) : make_uint4(0, 0, 0, 0);
          ubuf[k % kAhead] = live ? *reinterpret_cast<const uint4*>(up + off) : make_uint4(0, 0, 0, 0);
        };
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < kAhead - 1 && k < NG; ++k) load(k);
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < NG; ++k) {
          if (k + kAhead - 1 < NG) load(k + kAhead - 1);
          finish(k, gbuf[k % kAhead], ubuf[k % kAhead]);
        }
      }
    }
  }

  // Lane q's 8-column block after quad_transpose in accumulator group (mm, b, g), i.e. block 4g + q of row b of the
  // 64-row block mm: its offset in the outputs (row stride ld), and whether it lies inside [M, N] (N is a multiple
  // of 8: a block is all in or all out). Block 4g's first column is 2q left of lane q's own pair in it, and blocks
  // are 8 columns apart (checked by quad_layout_ok): hence + 6q. One definition for both epilogues.
  template <class Crd>
  CUTLASS_DEVICE bool block_at(Crd const& crd, int mm, int b, int g, int q, int m0, int n0, int64_t& off) const {
    const int m = m0 + cute::get<0>(crd(0, b, 4 * g, mm, 0)), n = n0 + cute::get<1>(crd(0, b, 4 * g, mm, 0)) + 6 * q;
    off = static_cast<int64_t>(m) * params.ld + n;
    return m < params.M && n < params.N;
  }

  // a[i] <- a[i ^ q] for i in 0..3 (q = lane & 3): two levels of conditional swaps, selects only.
  template <class T>
  CUTLASS_DEVICE static void xor_permute(T (&a)[4], int q) {
    const bool s1 = q & 1, s2 = q & 2;
    const T t0 = s1 ? a[1] : a[0], t1 = s1 ? a[0] : a[1], t2 = s1 ? a[3] : a[2], t3 = s1 ? a[2] : a[3];
    a[0] = s2 ? t2 : t0;
    a[1] = s2 ? t3 : t1;
    a[2] = s2 ? t0 : t2;
    a[3] = s2 ? t1 : t3;
  }

  // The 4x4 transpose within a quad: on entry x[k] is this lane's item of block 4g + k (items: 32-bit, one per
  // lane and block), on return x[p] is lane p's item of block 4g + q. Lane p sends its item of block 4g + q to lane
  // q in the shuffle round with mask p ^ q. All four lanes of the quad must call it.
  template <class T>
  CUTLASS_DEVICE static void quad_transpose(T (&x)[4], int q) {
    xor_permute(x, q);  // x[m] = item of block 4g + (q ^ m), the block of lane q ^ m
    CUTLASS_PRAGMA_UNROLL
    for (int m = 1; m < 4; ++m) x[m] = __shfl_xor_sync(0xffffffffu, x[m], m);  // now lane q ^ m's item of ours
    xor_permute(x, q);  // x[p] = lane p's item
  }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL, BlockShapeMNK, BlockCoordMNKL blk_coord_mnkl,
                                 cute::Tensor<FrgEngine, FrgLayout> const& accumulators, TiledMma tiled_mma,
                                 ResidueMNK, int thread_idx, char* smem) {
    using namespace cute;
    static_assert(accumulator_pairs_ok<TiledMma, kBN>(!kBwd),
                  "accumulator layout: expected adjacent column pairs (and column c + BN/2 at j + J/2)");
    static_assert(quad_layout_ok<TiledMma>(), "accumulator layout: expected column 8j + 2 (lane % 4) + a");
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    auto cD = make_identity_tensor(make_shape(Int<kBM>{}, Int<kBN>{}));
    auto tCcD = thr_mma.partition_C(cD);  // (row, column) in the CTA tile of each accumulator element
    auto acc = make_tensor(accumulators.data(), flatten(accumulators.layout()));  // (2, 2, J, MM, NN)
    auto crd = make_tensor(tCcD.data(), flatten(tCcD.layout()));
    const int m0 = static_cast<int>(get<0>(blk_coord_mnkl)) * kBM;
    const int n0 = static_cast<int>(get<1>(blk_coord_mnkl)) * (kBwd ? kBN : kBN / 2);
    if (kBwd && params.slopes) {  // no activation math at all
      run<Act::kGeluTanh, kBwd>(acc, crd, m0, n0, thread_idx, smem);
      return;
    }
    switch (params.act) {
      case Act::kGeluTanh: run<Act::kGeluTanh, false>(acc, crd, m0, n0, thread_idx, smem); break;
      case Act::kGeluErf: run<Act::kGeluErf, false>(acc, crd, m0, n0, thread_idx, smem); break;
      case Act::kSilu: run<Act::kSilu, false>(acc, crd, m0, n0, thread_idx, smem); break;
    }
  }

  Params params;
};

template <class E> struct CutlassElement;
template <> struct CutlassElement<__nv_bfloat16> { using type = cutlass::bfloat16_t; };
template <> struct CutlassElement<__half> { using type = cutlass::half_t; };

template <class E, bool kBwd, class Cfg = Cooperative>
struct Gemm {
  using CE = typename CutlassElement<E>::type;
  // The backward's ping-pong epilogue stages gate/up in shared memory (GatedEpilogue::run); the cooperative one
  // (two warpgroups' epilogues at once, twice the buffer) loads them into registers.
  static constexpr bool kStaged = kBwd && cute::is_same_v<Cfg, PingPong>;
  using EpilogueOp = GatedEpilogue<E, kBwd, typename Cfg::TileShape, kStaged>;
  using Stock = StockMainloop<Cfg, CE, cute::conditional_t<kBwd, cutlass::layout::RowMajor, cutlass::layout::ColumnMajor>,
                              EpilogueOp::kSmemBytes>;
  using Mainloop = cute::conditional_t<kBwd, Stock, DualBMainloop<Stock>>;
  using Epilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<EpilogueOp>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using ClusterShape = typename Cfg::ClusterShape;
  static constexpr bool kDual = !kBwd;
  static_assert(Kernel::SharedStorageSize <= cutlass::gemm::collective::detail::sm90_smem_capacity_bytes,
                "more shared memory than an sm_90 block can have");
};

}  // namespace fm_sm90
#endif  // FUSED_MLP_NO_ARCH

namespace fused_mlp::cuda {
namespace {

#ifndef FUSED_MLP_NO_ARCH
// Default schedules: ping-pong for both passes (it hides the activation math behind the other warpgroup's MMAs;
// the cooperative schedule and other tiles and clusters measured slower) -- docs/tuning-log.md#gated-gemm-schedules
constexpr bool kFwdPingPong = true;
constexpr bool kBwdPingPong = true;

int sm_count(int device) {
  static std::mutex mu;
  static int counts[64] = {};
  std::lock_guard<std::mutex> lock(mu);
  if (device < 0 || device >= 64) return 0;
  if (counts[device] == 0) FM_CUDA_CHECK(cudaDeviceGetAttribute(&counts[device], cudaDevAttrMultiProcessorCount, device));
  return counts[device];
}

void check_descriptor(const void* desc, const char* what) {
  const auto* bytes = static_cast<const unsigned char*>(desc);
  bool any = false;
  for (size_t i = 0; i < sizeof(CUtensorMap); ++i) any |= bytes[i] != 0;
  FM_CHECK(any, "fused_mlp: the sm_90 gated GEMM's TMA descriptor for ", what,
           " could not be built (cuTensorMapEncodeTiled refused the tensor)");
}

template <class G>
void launch(typename G::Kernel::Arguments const& args, int device, cudaStream_t stream) {
  using K = typename G::Kernel;
  FM_CHECK(K::can_implement(args), "fused_mlp: the sm_90 gated GEMM cannot take these shapes/strides");
  FM_CHECK(K::get_workspace_size(args) == 0, "fused_mlp: the sm_90 gated GEMM unexpectedly needs a workspace");
  // The TMA descriptors are built with the driver API (cuTensorMapEncodeTiled), which needs a current context on
  // this thread. The autograd engine runs backward on its own device threads, where none may be current yet: the
  // H200 runs then logged "Failed to initialize the TMA descriptor 201" (CUDA_ERROR_INVALID_CONTEXT) and the kernel
  // faulted on the zero descriptor. cudaSetDevice makes the device's primary context current (we are inside the
  // caller's DeviceGuard for this device, which restores the previous device afterwards).
  FM_CUDA_CHECK(cudaSetDevice(device));
  auto params = K::to_underlying_arguments(args, nullptr);
  // This file is built with NDEBUG (see the top), which compiles out CUTLASS's host asserts on the TMA descriptors;
  // a descriptor cuTensorMapEncodeTiled refused is left zero and would fault in the kernel, so refuse it here.
  if constexpr (G::kDual) {
    check_descriptor(params.mainloop.base.tma_load_a.get_tma_descriptor(), "A");
    check_descriptor(params.mainloop.tma_load_b_gate.get_tma_descriptor(), "B (gate)");
    check_descriptor(params.mainloop.tma_load_b_up.get_tma_descriptor(), "B (up)");
  } else {
    check_descriptor(params.mainloop.tma_load_a.get_tma_descriptor(), "A");
    check_descriptor(params.mainloop.tma_load_b.get_tma_descriptor(), "B");
  }
  const void* kernel = reinterpret_cast<const void*>(&cutlass::device_kernel<K>);
  {  // once per kernel and device (a mutex, not std::call_once: that needs glibc 2.34's pthread_once)
    static std::mutex mu;
    static bool smem_set[64] = {};
    std::lock_guard<std::mutex> lock(mu);
    if (!smem_set[device & 63]) {
      FM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, K::SharedStorageSize));
      smem_set[device & 63] = true;
    }
  }
  const dim3 grid = K::get_grid_shape(params), block = K::get_block_shape();
  const dim3 cluster(cute::size<0>(typename G::ClusterShape{}), cute::size<1>(typename G::ClusterShape{}), 1);
  cutlass::ClusterLaunchParams lp{grid, block, cluster, static_cast<int>(K::SharedStorageSize), stream};
  const cutlass::Status st = cutlass::launch_kernel_on_cluster(lp, kernel, params);
  FM_CHECK(st == cutlass::Status::kSuccess, "fused_mlp: launching the sm_90 gated GEMM failed: ",
           cudaGetErrorString(cudaGetLastError()));
  FM_KERNEL_LAUNCH_CHECK();
}

// The kernel schedule of each pass: FUSED_MLP_GATED_GEMM_SCHEDULE = "cooperative" | "pingpong" (both passes) or
// "<fwd>,<bwd>" overrides the default (benchmarks compare them); read per call, it is a getenv.
template <class F>
void with_schedule(const char* pass, F&& f) {
  const bool fwd = pass[0] == 'f';
  bool pingpong = fwd ? kFwdPingPong : kBwdPingPong;
  if (const char* env = std::getenv("FUSED_MLP_GATED_GEMM_SCHEDULE"); env != nullptr && *env != '\0') {
    std::string v(env);
    const size_t comma = v.find(',');
    if (comma != std::string::npos) v = fwd ? v.substr(0, comma) : v.substr(comma + 1);
    FM_CHECK(v == "cooperative" || v == "pingpong",
             "fused_mlp: FUSED_MLP_GATED_GEMM_SCHEDULE must be cooperative or pingpong (or '<fwd>,<bwd>'), got ", env);
    pingpong = v == "pingpong";
  }
  if (pingpong) {
    f(fm_sm90::PingPong{});
  } else {
    f(fm_sm90::Cooperative{});
  }
}

// The 16-bit dtypes (callers have checked the dtype: check_dtype).
template <class F>
void dispatch_16bit(ScalarType t, const char* what, F&& f) {
  dispatch_float(t, what, [&](auto tag) {
    if constexpr (!std::is_same_v<decltype(tag), float>) f(tag);
  });
}

// The tile schedules (sm90_sched.cuh), forward: raster along N, no swizzle (H100: 1.03-1.55x CUTLASS's heuristic, most
// at large T x H=4096; H200: 0.99-1.01x); backward: raster along N in groups of 4 tiles (H100: 1.04-1.30x; raster N
// alone read 0.84-1.18x) -- docs/tuning-log.md#sm90-tile-schedule
constexpr Sm90Sched kDefaultSched{1, 2};
constexpr Sm90Sched kDefaultSchedBwd{4, 2};

cutlass::KernelHardwareInfo hw_info(int device) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = sm_count(device);
  return hw;
}
#endif

void check_sm90(const Tensor& t) {
  int major = 0, minor = 0;
  const int dev = device_index(t);
  FM_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  FM_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  FM_CHECK(major == 9 && minor == 0, "fused_mlp: the gated-epilogue GEMMs run on sm_90 (Hopper) only; this device is sm_",
           major, minor, " (use the default backend)");
#ifdef FUSED_MLP_NO_ARCH
  FM_CHECK(false, "fused_mlp: this build has no sm_90a code (built without capability 9.0); use the default backend");
#endif
}

void check_2d(const Tensor& t, const char* name, const Tensor& like) {
  FM_CHECK(t.dim() == 2, "fused_mlp: ", name, " must be 2-D, got ", t.dim(), "-D");
  FM_CHECK(t.scalar_type() == like.scalar_type(), "fused_mlp: ", name, " must have dtype ", like.scalar_type(),
           ", got ", t.scalar_type());
  FM_CHECK(same_cuda_device(t, like), "fused_mlp: ", name, " must be a CUDA tensor on ", device_str(like));
  FM_CHECK(t.size(1) <= 1 || t.stride(1) == 1, "fused_mlp: ", name, " must be contiguous");
  FM_CHECK(t.size(0) <= 1 || t.stride(0) == t.size(1), "fused_mlp: ", name, " must be contiguous");
  FM_CHECK(t.size(1) % 8 == 0, "fused_mlp: ", name, " needs a multiple of 8 columns (16-byte TMA rows), got ",
           t.size(1));
  FM_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "fused_mlp: ", name, " must be 16-byte aligned");
}

void check_dtype(const Tensor& x) {
  FM_CHECK(x.scalar_type() == kBFloat16 || x.scalar_type() == kHalf,
           "fused_mlp: the gated-epilogue GEMMs take bfloat16 or float16, got ", x.scalar_type());
}

}  // namespace
}  // namespace fused_mlp::cuda

using namespace fused_mlp::cuda;

namespace {

// h = act(x w_gate^T) * (x w_up^T); save (EpiArgs): nothing, gate/up (preact) or P/Q (slopes) as the second and
// third tensors, empty ([0, 0]) when nothing is saved.
std::tuple<Tensor, Tensor, Tensor> gated_gemm_fwd_impl(const char* op, const Tensor& x, const Tensor& w_gate,
                                                       const Tensor& w_up, StrArg activation, bool save, bool slopes) {
  const Act act = parse_activation(activation);
  FM_CHECK(x.is_cuda(), "fused_mlp: ", op, " takes CUDA tensors");
  check_dtype(x);
  check_2d(x, "x", x);
  check_2d(w_gate, "w_gate", x);
  check_2d(w_up, "w_up", x);
  FM_CHECK(w_gate.size(1) == x.size(1) && fused_mlp::same_shape(w_gate, w_up), "fused_mlp: ", op, ": x ",
           fused_mlp::shape_str(x), ", w_gate ", fused_mlp::shape_str(w_gate), ", w_up ", fused_mlp::shape_str(w_up),
           " do not match ([T, H], [I, H], [I, H])");
  check_sm90(x);
  const int64_t T = x.size(0), H = x.size(1), I = w_gate.size(0);
  FM_CHECK(H > 0 && I % 8 == 0 && I < (int64_t{1} << 30) && T < (int64_t{1} << 30) && H < (int64_t{1} << 30),
           "fused_mlp: ", op, ": H must be positive, I a multiple of 8 and every size below 2^30");
  DeviceGuard guard(x);
  Tensor h = fused_mlp::empty({T, I}, x.scalar_type(), x);
  Tensor gate = fused_mlp::empty({save ? T : 0, save ? I : 0}, x.scalar_type(), x);
  Tensor up = fused_mlp::empty({save ? T : 0, save ? I : 0}, x.scalar_type(), x);
#ifndef FUSED_MLP_NO_ARCH
  if (T > 0 && I > 0) {
    const int dev = device_index(x);
    const fm_sm90::EpiArgs epi{h.data_ptr(), save ? gate.data_ptr() : nullptr, save ? up.data_ptr() : nullptr, I,
                               static_cast<int>(T), static_cast<int>(I), act, save && slopes};
    dispatch_16bit(x.scalar_type(), "x", [&](auto tag) {
      using E = decltype(tag);
      with_schedule("fwd", [&](auto cfg) {
        using G = fm_sm90::Gemm<E, false, decltype(cfg)>;
        using CE = typename G::CE;
        typename G::Kernel::Arguments args{
            cutlass::gemm::GemmUniversalMode::kGemm,
            {static_cast<int>(T), static_cast<int>(2 * I), static_cast<int>(H), 1},
            {static_cast<const CE*>(x.data_ptr()), fm_sm90::Stride2D{H, {}, 0},
             static_cast<const CE*>(w_gate.data_ptr()), static_cast<const CE*>(w_up.data_ptr()),
             fm_sm90::Stride2D{H, {}, 0}},
            epi,
            hw_info(dev),
            sm90_sched_args<typename G::Kernel::TileSchedulerArguments>(sm90_sched(kDefaultSched))};
        launch<G>(args, dev, current_stream(x));
      });
    });
  }
#endif
  return {h, gate, up};
}

// dh = dy w_down (fp32, not stored) from dy [T, H], w_down [H, I]; a, b [T, I] are the saved gate, up (preact:
// h = act(gate) * up is written into the returned tensor) or P, Q (slopes: nothing else is written); dgate is
// written over a, dup over b.
Tensor gated_gemm_bwd_impl(const char* op, const Tensor& dy, const Tensor& w_down, const Tensor& a, const Tensor& b,
                           Act act, bool slopes) {
  const char* an = slopes ? "p" : "gate";
  const char* bn = slopes ? "q" : "up";
  FM_CHECK(dy.is_cuda(), "fused_mlp: ", op, " takes CUDA tensors");
  check_dtype(dy);
  check_2d(dy, "dy", dy);
  check_2d(w_down, "w_down", dy);
  check_2d(a, an, dy);
  check_2d(b, bn, dy);
  FM_CHECK(w_down.size(0) == dy.size(1) && a.size(0) == dy.size(0) && a.size(1) == w_down.size(1) &&
               fused_mlp::same_shape(a, b),
           "fused_mlp: ", op, ": dy ", fused_mlp::shape_str(dy), ", w_down ", fused_mlp::shape_str(w_down), ", ", an,
           " ", fused_mlp::shape_str(a), ", ", bn, " ", fused_mlp::shape_str(b),
           " do not match ([T, H], [H, I], [T, I], [T, I])");
  // a and b are written in place while other CTAs still read dy and w_down through TMA
  const std::string ab = std::string(op) + ": " + an + " and " + bn;
  fused_mlp::check_no_overlap(a, b, ab.c_str());
  fused_mlp::check_no_overlap(a, dy, (std::string(op) + ": " + an + " and dy").c_str());
  fused_mlp::check_no_overlap(b, dy, (std::string(op) + ": " + bn + " and dy").c_str());
  fused_mlp::check_no_overlap(a, w_down, (std::string(op) + ": " + an + " and w_down").c_str());
  fused_mlp::check_no_overlap(b, w_down, (std::string(op) + ": " + bn + " and w_down").c_str());
  check_sm90(dy);
  const int64_t T = dy.size(0), H = dy.size(1), I = w_down.size(1);
  FM_CHECK(H > 0 && T < (int64_t{1} << 30) && I < (int64_t{1} << 30) && H < (int64_t{1} << 30),
           "fused_mlp: ", op, ": H must be positive and every size below 2^30");
  DeviceGuard guard(dy);
  Tensor h = fused_mlp::empty({slopes ? 0 : T, slopes ? 0 : I}, dy.scalar_type(), dy);
#ifndef FUSED_MLP_NO_ARCH
  if (T > 0 && I > 0) {
    const int dev = device_index(dy);
    const fm_sm90::EpiArgs epi{slopes ? nullptr : h.data_ptr(), a.data_ptr(), b.data_ptr(), I, static_cast<int>(T),
                               static_cast<int>(I), act, slopes};
    dispatch_16bit(dy.scalar_type(), "dy", [&](auto tag) {
      using E = decltype(tag);
      with_schedule("bwd", [&](auto cfg) {
        using G = fm_sm90::Gemm<E, true, decltype(cfg)>;
        using CE = typename G::CE;
        // B = w_down as the [K = H, N = I] row-major matrix: N-major, stride (1, I).
        typename G::Kernel::Arguments args{
            cutlass::gemm::GemmUniversalMode::kGemm,
            {static_cast<int>(T), static_cast<int>(I), static_cast<int>(H), 1},
            {static_cast<const CE*>(dy.data_ptr()), fm_sm90::Stride2D{H, {}, 0},
             static_cast<const CE*>(w_down.data_ptr()), typename G::Stock::StrideB{{}, I, 0}},
            epi,
            hw_info(dev),
            sm90_sched_args<typename G::Kernel::TileSchedulerArguments>(sm90_sched(kDefaultSchedBwd))};
        launch<G>(args, dev, current_stream(dy));
      });
    });
  }
#endif
  return h;
}

}  // namespace

// h = act(x w_gate^T) * (x w_up^T); with save_preact also gate = x w_gate^T and up = x w_up^T.
std::tuple<Tensor, Tensor, Tensor> gated_gemm_fwd_cuda(const Tensor& x, const Tensor& w_gate, const Tensor& w_up,
                                                       StrArg activation, bool save_preact) {
  return gated_gemm_fwd_impl("gated_gemm_fwd", x, w_gate, w_up, activation, save_preact, false);
}

// h as above, and for the backward P = up * act'(gate), Q = act(gate) (each rounded once from fp32).
std::tuple<Tensor, Tensor, Tensor> gated_gemm_fwd_slopes_cuda(const Tensor& x, const Tensor& w_gate,
                                                              const Tensor& w_up, StrArg activation) {
  return gated_gemm_fwd_impl("gated_gemm_fwd_slopes", x, w_gate, w_up, activation, true, true);
}

// From dy [T, H], w_down [H, I] and the saved gate, up [T, I]: dh = dy w_down (fp32, not stored),
// returns h = act(gate) * up and writes dgate over gate, dup over up.
Tensor gated_gemm_bwd_cuda(const Tensor& dy, const Tensor& w_down, const Tensor& gate, const Tensor& up,
                           StrArg activation) {
  const Act act = parse_activation(activation);
  return gated_gemm_bwd_impl("gated_gemm_bwd", dy, w_down, gate, up, act, false);
}

// From dy, w_down and the saved P, Q [T, I] (gated_gemm_fwd_slopes): dgate = dh P over P, dup = dh Q over Q.
void gated_gemm_bwd_slopes_cuda(const Tensor& dy, const Tensor& w_down, const Tensor& p, const Tensor& q) {
  gated_gemm_bwd_impl("gated_gemm_bwd_slopes", dy, w_down, p, q, Act::kGeluTanh, true);
}
