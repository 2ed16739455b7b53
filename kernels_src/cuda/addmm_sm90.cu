// Hopper (sm_90a) addmm / Linear forward with the bias and the activation in the GEMM's epilogue, one rounding:
//
//   y = act(x @ B + bias)   [M, N] in x's dtype (bf16 or fp16), from the fp32 accumulator: + bias (y's dtype or
//                           fp32) in fp32, the activation (none, gelu_tanh, gelu erf) in fp32 with addmm.cu's own
//                           formulas (kernels_src/cuda/addmm_act.cuh), then one rounding;
//   z = x @ B + bias        [M, N], rounded once, in training (the backward's saved pre-activation: the contract of
//                           addmm_fwd's `preact`, see addmm.cu).
//   B is either layout used in place: K-major ([N, K] rows: nn.Linear's weight, x @ W^T) or N-major ([K, N] rows:
//   GPT-2 Conv1D's weight).
// The cuBLASLt path (addmm.cu) does the same math as a GEMM into an fp32 buffer plus one bias/activation kernel
// (cuBLASLt's own GELU epilogue is not one rounding for 16-bit outputs); this kernel saves that fp32 [M, N] write
// and read: docs/tuning-log.md#addmm-sm90-epilogue.
//
// Built like gated_gemm_sm90.cu (its patterns, copied rather than shared so that file stays untouched): CUTLASS 3's
// persistent warp-specialised kernel (one TMA producer warp; a 2x1 cluster multicasting B) with the stock sm_90
// TMA/WGMMA mainloop and our epilogue on the accumulators in registers (CUTLASS's "no-smem" adapter). The four
// lanes of a quad transpose their fp32 accumulators with shuffles, so each thread owns 8 adjacent columns of a row:
// one 16-byte (fp16/bf16) or 2 x 16-byte (fp32) bias load per 8 columns, reused over the thread's rows, and 16-byte
// stores of y (and z), 64 contiguous bytes per quad and row.
//
// Template parameters:
//   E         the element type of x, B, y, z: __nv_bfloat16 or __half (the only two built).
//   Cfg       the kernel configuration: PingPong (two consumer warpgroups, a 128x128x64 tile each, one's epilogue
//             runs under the other's mainloop) or Cooperative (both warpgroups on one 128x256x64 tile); cluster 2x1
//             for both. Chosen at run time by FUSED_MLP_ADDMM_SM90 (below; default ping-pong).
//   kKMajorB  true: B is [N, K] rows (nn.Linear); false: [K, N] rows (Conv1D).
// The epilogue's run<ACT> is instantiated for the three activations inside each kernel (a switch per tile); the bias
// dtype and whether z is written are warp-uniform run-time branches: 2 dtypes x 2 layouts x 2 configs = 8 kernels.
//
// Knob: FUSED_MLP_ADDMM_SM90 = auto (default: addmm.cu's size rule) | on (wherever runnable, default config) | off
// (cuBLASLt always) | pingpong | cooperative (on, with that config); read once. The private op _addmm_sm90_mode
// overrides it at run time (tests, benchmarks/addmm_epilogue.py).
// Other architectures never launch this kernel (addmm.cu asks addmm_sm90_available first); without sm_90a in the
// build (FUSED_MLP_NO_ARCH) only the host code is compiled and addmm_sm90_available says no.
// Release build of CUTLASS: its device-side assert()s are calls, and a call between WGMMAs makes ptxas serialise
// the whole WGMMA pipeline (warning C7510).
#ifndef NDEBUG
#define NDEBUG
#endif

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

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

#include "activation.h"
#include "cuda/addmm_act.cuh"
#include "cuda/addmm_sm90.h"
#include "cuda/common.cuh"
#include "cuda/sm90_sched.cuh"
#include "torch_binding.h"

#ifndef FUSED_MLP_NO_ARCH

namespace fm_addmm_sm90 {

using cute::_1;
using cute::_2;
using cute::Int;

using Stride2D = cute::Stride<int64_t, _1, int64_t>;  // row-major [rows, cols] (+ unused batch)

// Kernel configurations (schedule, CTA tile, cluster): the gated GEMMs' two (gated_gemm_sm90.cu).
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

// The stock sm_90 mainloop (TMA + WGMMA, warp-specialised); the epilogue keeps no shared memory, the stages get it.
template <class Cfg, class E, class LayoutB>
using StockMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    E, cutlass::layout::RowMajor, 8,  // A: [M, K] row-major
    E, LayoutB, 8,                    // B: ColumnMajor = [N, K] rows (nn.Linear), RowMajor = [K, N] rows (Conv1D)
    float, typename Cfg::TileShape, typename Cfg::ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<0>,
    typename Cfg::Schedule>::CollectiveOp;

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
// one of two adjacent columns, b one of two rows 8 apart, j a group of 8 columns and mm the 64-row block. The quad
// transpose relies on value (a, b, j) of thread t being in column 8j + 2 (t % 4) + a, in one row for every j:
// checked at compile time on the TiledMMA's (thread, value) -> (row, column) layout (a sample of threads: all of
// them exceeds nvcc's constexpr budget).
template <class TiledMma, int BN>
constexpr bool quad_layout_ok() {
  using namespace cute;
  auto tv = TiledMma{}.get_layoutC_TV();
  constexpr int TM = tile_size<0>(TiledMma{}), TN = tile_size<1>(TiledMma{});
  constexpr int nthr = size<0>(decltype(tv){}), nv = size<1>(decltype(tv){});
  if (TN != BN) return false;
  for (int t : {0, 1, 2, 3, 5, 6, 11, 30, 31, 32, 63, 66, 127, nthr - 128, nthr - 3, nthr - 1}) {
    for (int v = 0; v < nv; ++v) {
      const int i = tv(t, v);
      if (i / TM != 8 * (v / 4) + 2 * (t % 4) + v % 2 || i % TM != tv(t, v % 4) % TM) return false;
    }
  }
  return true;
}

struct EpiArgs {
  void* y = nullptr;           // [M, N] output
  void* z = nullptr;           // [M, N] output (training: acc + bias), or null
  const void* bias = nullptr;  // [N], E or fp32 (bias_fp32), 16-byte aligned, or null
  bool bias_fp32 = false;
  int64_t ld = 0;  // row stride of y and z (elements)
  int M = 0, N = 0;
  int act = 0;  // Act
};

template <class E, class TileShape>
struct BiasActEpilogue {
  using ElementC = cutlass::bfloat16_t;  // the kernel layer names these types; C/D are ours (EpiArgs)
  using ElementD = cutlass::bfloat16_t;
  using StrideC = Stride2D;
  using StrideD = Stride2D;
  using ElementAccumulator = float;
  struct SharedStorage {};
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
    return a.N % 8 == 0 && a.ld % 8 == 0 && reinterpret_cast<uintptr_t>(a.y) % 16 == 0 &&
           reinterpret_cast<uintptr_t>(a.z) % 16 == 0 && reinterpret_cast<uintptr_t>(a.bias) % 16 == 0;
  }

  CUTLASS_HOST_DEVICE BiasActEpilogue(Params const& p, SharedStorage const& = SharedStorage()) : params(p) {}

  // The bias of columns [n, n + 8) as floats (zeros past N; the caller skips the add without a bias).
  CUTLASS_DEVICE void load_bias(int n, float (&bv)[8]) const {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 8; ++i) bv[i] = 0.f;
    if (n >= params.N) return;
    if (params.bias_fp32) {
      const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(params.bias) + n);
      const float4 lo = __ldg(p), hi = __ldg(p + 1);
      bv[0] = lo.x, bv[1] = lo.y, bv[2] = lo.z, bv[3] = lo.w, bv[4] = hi.x, bv[5] = hi.y, bv[6] = hi.z, bv[7] = hi.w;
    } else {
      const uint4 w = __ldg(reinterpret_cast<const uint4*>(static_cast<const E*>(params.bias) + n));
      const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < 4; ++i) {
        const float2 f = unpack2<E>(ws[i]);
        bv[2 * i] = f.x;
        bv[2 * i + 1] = f.y;
      }
    }
  }

  // For each group of four 8-column blocks g: the quad transposes its fp32 accumulators (quad_transpose) so that
  // lane q holds block 4g + q whole, for each of its rows (mm, b); the bias of that block is loaded once per g.
  // v = acc + bias (fp32), z = round(v), y = round(act(v)): the same operations, in the same order, as addmm.cu's
  // bias_act_kernel on the fp32 accumulator.
  template <int ACT, class Acc, class Crd>
  CUTLASS_DEVICE void run(Acc const& acc, Crd const& crd, int m0, int n0) const {
    using namespace cute;
    constexpr int J = size<2>(Acc{}), MM = size<3>(Acc{}), G = J / 4;
    static_assert(size<0>(Acc{}) == 2 && size<1>(Acc{}) == 2 && size<4>(Acc{}) == 1, "unexpected accumulator layout");
    static_assert(J % 4 == 0, "the quad transpose takes the accumulator's 8-column blocks four at a time");
    E* y = static_cast<E*>(params.y);
    E* z = static_cast<E*>(params.z);
    const bool has_bias = params.bias != nullptr;
    const int q = static_cast<int>(threadIdx.x & 3);
    CUTLASS_PRAGMA_UNROLL
    for (int g = 0; g < G; ++g) {
      // first column of block 4g + q: block 4g's first column is 2q left of this lane's own pair in it, and
      // blocks are 8 columns apart (quad_layout_ok); the same for every row of the thread
      const int n = n0 + get<1>(crd(0, 0, 4 * g, 0, 0)) + 6 * q;
      float bv[8];
      if (has_bias) load_bias(n, bv);
      CUTLASS_PRAGMA_UNROLL
      for (int mm = 0; mm < MM; ++mm) {
        CUTLASS_PRAGMA_UNROLL
        for (int b = 0; b < 2; ++b) {
          // every lane of the quad takes part in the shuffles: before the bounds test
          float d0[4], d1[4];
          CUTLASS_PRAGMA_UNROLL
          for (int c = 0; c < 4; ++c) {
            d0[c] = acc(0, b, 4 * g + c, mm, 0);
            d1[c] = acc(1, b, 4 * g + c, mm, 0);
          }
          quad_transpose(d0, q);  // d0[w], d1[w]: columns 2w, 2w + 1 of block 4g + q
          quad_transpose(d1, q);
          const int m = m0 + get<0>(crd(0, b, 4 * g, mm, 0));
          if (m < params.M && n < params.N) {  // N % 8 == 0: a block is all in or all out
            const int64_t off = static_cast<int64_t>(m) * params.ld + n;
            uint32_t yw[4], zw[4];
            CUTLASS_PRAGMA_UNROLL
            for (int w = 0; w < 4; ++w) {
              float v0 = d0[w], v1 = d1[w];
              if (has_bias) {
                v0 += bv[2 * w];
                v1 += bv[2 * w + 1];
              }
              zw[w] = pack2<E>(v0, v1);
              using fused_mlp::cuda::addmm_math::act_fwd;
              yw[w] = ACT == fused_mlp::cuda::addmm_math::kActNone ? zw[w]
                                                                    : pack2<E>(act_fwd<ACT, true>(v0), act_fwd<ACT, true>(v1));
            }
            *reinterpret_cast<uint4*>(y + off) = make_uint4(yw[0], yw[1], yw[2], yw[3]);
            if (z != nullptr) *reinterpret_cast<uint4*>(z + off) = make_uint4(zw[0], zw[1], zw[2], zw[3]);
          }
        }
      }
    }
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

  // The 4x4 transpose within a quad: on entry x[k] is this lane's item of block 4g + k, on return x[p] is lane p's
  // item of block 4g + q. All four lanes of the quad must call it (gated_gemm_sm90.cu's, unchanged).
  template <class T>
  CUTLASS_DEVICE static void quad_transpose(T (&x)[4], int q) {
    xor_permute(x, q);
    CUTLASS_PRAGMA_UNROLL
    for (int m = 1; m < 4; ++m) x[m] = __shfl_xor_sync(0xffffffffu, x[m], m);
    xor_permute(x, q);
  }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL, BlockShapeMNK, BlockCoordMNKL blk_coord_mnkl,
                                 cute::Tensor<FrgEngine, FrgLayout> const& accumulators, TiledMma tiled_mma,
                                 ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    static_assert(quad_layout_ok<TiledMma, kBN>(), "accumulator layout: expected column 8j + 2 (lane % 4) + a");
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    auto cD = make_identity_tensor(make_shape(Int<kBM>{}, Int<kBN>{}));
    auto tCcD = thr_mma.partition_C(cD);  // (row, column) in the CTA tile of each accumulator element
    auto acc = make_tensor(accumulators.data(), flatten(accumulators.layout()));  // (2, 2, J, MM, NN)
    auto crd = make_tensor(tCcD.data(), flatten(tCcD.layout()));
    const int m0 = static_cast<int>(get<0>(blk_coord_mnkl)) * kBM;
    const int n0 = static_cast<int>(get<1>(blk_coord_mnkl)) * kBN;
    using namespace fused_mlp::cuda::addmm_math;
    switch (params.act) {
      case kActGeluTanh: run<kActGeluTanh>(acc, crd, m0, n0); break;
      case kActGeluErf: run<kActGeluErf>(acc, crd, m0, n0); break;
      default: run<kActNone>(acc, crd, m0, n0); break;
    }
  }

  Params params;
};

template <class E> struct CutlassElement;
template <> struct CutlassElement<__nv_bfloat16> { using type = cutlass::bfloat16_t; };
template <> struct CutlassElement<__half> { using type = cutlass::half_t; };

template <class E, class Cfg, bool kKMajorB>
struct Gemm {
  using CE = typename CutlassElement<E>::type;
  using EpilogueOp = BiasActEpilogue<E, typename Cfg::TileShape>;
  using Mainloop =
      StockMainloop<Cfg, CE, cute::conditional_t<kKMajorB, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>>;
  using Epilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<EpilogueOp>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using ClusterShape = typename Cfg::ClusterShape;
  static_assert(Kernel::SharedStorageSize <= cutlass::gemm::collective::detail::sm90_smem_capacity_bytes,
                "more shared memory than an sm_90 block can have");
};

}  // namespace fm_addmm_sm90
#endif  // FUSED_MLP_NO_ARCH

namespace fused_mlp::cuda {
namespace {

#ifndef FUSED_MLP_NO_ARCH
int sm_count(int device) {
  static std::mutex mu;
  static int counts[64] = {};
  std::lock_guard<std::mutex> lock(mu);
  if (device < 0 || device >= 64) return 0;
  if (counts[device] == 0)
    FM_CUDA_CHECK(cudaDeviceGetAttribute(&counts[device], cudaDevAttrMultiProcessorCount, device));
  return counts[device];
}

bool descriptor_built(const void* desc) {
  const auto* bytes = static_cast<const unsigned char*>(desc);
  bool any = false;
  for (size_t i = 0; i < sizeof(CUtensorMap); ++i) any |= bytes[i] != 0;
  return any;
}

// false: the kernel cannot take these arguments (nothing launched). gated_gemm_sm90.cu's launch(), less the checks
// that fail there: here the caller has a fallback.
template <class G>
bool launch(typename G::Kernel::Arguments const& args, int device, cudaStream_t stream) {
  using K = typename G::Kernel;
  if (!K::can_implement(args) || K::get_workspace_size(args) != 0) return false;
  // The TMA descriptors are built with the driver API, which needs a current context on this thread (autograd's
  // device threads may have none yet: gated_gemm_sm90.cu's launch); we are inside the caller's DeviceGuard.
  FM_CUDA_CHECK(cudaSetDevice(device));
  auto params = K::to_underlying_arguments(args, nullptr);
  // NDEBUG compiles out CUTLASS's host asserts on the descriptors; a refused one is left zero and would fault.
  if (!descriptor_built(params.mainloop.tma_load_a.get_tma_descriptor()) ||
      !descriptor_built(params.mainloop.tma_load_b.get_tma_descriptor()))
    return false;
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
  FM_CHECK(st == cutlass::Status::kSuccess, "fused_mlp: launching the sm_90 addmm GEMM failed: ",
           cudaGetErrorString(cudaGetLastError()));
  FM_KERNEL_LAUNCH_CHECK();
  return true;
}

// The tile schedule (sm90_sched.cuh): raster along N, no swizzle (H100: 1.00-1.20x CUTLASS's heuristic, most at
// 8192 x 4096 x 14336; H200: 0.99-1.00x) -- docs/tuning-log.md#sm90-tile-schedule
constexpr Sm90Sched kDefaultSched{1, 2};

template <class E, class Cfg, bool kKMajorB>
bool run_gemm(const AddmmSm90Args& a) {
  using G = fm_addmm_sm90::Gemm<E, Cfg, kKMajorB>;
  using CE = typename G::CE;
  using StrideB = typename G::Mainloop::StrideB;
  StrideB db;
  if constexpr (kKMajorB) {
    db = StrideB{a.ldb, {}, 0};  // [N, K] rows
  } else {
    db = StrideB{{}, a.ldb, 0};  // [K, N] rows
  }
  const fm_addmm_sm90::EpiArgs epi{a.y, a.z, a.bias, a.bias_fp32, a.N, static_cast<int>(a.M), static_cast<int>(a.N),
                                   a.act};
  cutlass::KernelHardwareInfo hw;
  hw.device_id = a.device;
  hw.sm_count = sm_count(a.device);
  typename G::Kernel::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {static_cast<int>(a.M), static_cast<int>(a.N), static_cast<int>(a.K), 1},
      {static_cast<const CE*>(a.a), fm_addmm_sm90::Stride2D{a.lda, {}, 0}, static_cast<const CE*>(a.b), db},
      epi,
      hw,
      sm90_sched_args<typename G::Kernel::TileSchedulerArguments>(sm90_sched(kDefaultSched))};
  return launch<G>(args, a.device, a.stream);
}

// The default configuration of `on` and `auto`: docs/tuning-log.md#addmm-sm90-epilogue (H200 numbers pending)
constexpr Sm90Mode kDefaultConfig = Sm90Mode::kPingPong;

template <class E>
bool run_dtype(const AddmmSm90Args& a, Sm90Mode mode) {
  const bool coop = (mode == Sm90Mode::kOn || mode == Sm90Mode::kAuto ? kDefaultConfig : mode) ==
                    Sm90Mode::kCooperative;
  if (coop) {
    return a.b_k_major ? run_gemm<E, fm_addmm_sm90::Cooperative, true>(a)
                       : run_gemm<E, fm_addmm_sm90::Cooperative, false>(a);
  }
  return a.b_k_major ? run_gemm<E, fm_addmm_sm90::PingPong, true>(a) : run_gemm<E, fm_addmm_sm90::PingPong, false>(a);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
#endif

Sm90Mode env_mode() {
  static const Sm90Mode mode = [] {
    const char* e = std::getenv("FUSED_MLP_ADDMM_SM90");
    const std::string v = e != nullptr ? e : "";
    if (v.empty() || v == "auto") return Sm90Mode::kAuto;
    if (v == "on") return Sm90Mode::kOn;
    if (v == "off") return Sm90Mode::kOff;
    if (v == "pingpong") return Sm90Mode::kPingPong;
    if (v == "cooperative") return Sm90Mode::kCooperative;
    FM_CHECK(false, "fused_mlp: FUSED_MLP_ADDMM_SM90 must be auto, on, off, pingpong or cooperative, got '", v, "'");
    return Sm90Mode::kAuto;
  }();
  return mode;
}

}  // namespace

Sm90Mode addmm_sm90_mode() {
  const int o = addmm_sm90_override();
  return o >= 0 ? static_cast<Sm90Mode>(o) : env_mode();
}

bool addmm_sm90_available([[maybe_unused]] int device) {
#ifdef FUSED_MLP_NO_ARCH
  return false;
#else
  static std::mutex mu;
  static signed char known[64] = {};  // 0 unknown, 1 yes, -1 no
  if (device < 0 || device >= 64) return false;
  std::lock_guard<std::mutex> lock(mu);
  if (known[device] == 0) {
    int major = 0, minor = 0;
    FM_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    FM_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    known[device] = major == 9 && minor == 0 ? 1 : -1;
  }
  return known[device] > 0;
#endif
}

bool addmm_sm90_fwd([[maybe_unused]] const AddmmSm90Args& a, [[maybe_unused]] Sm90Mode mode) {
#ifdef FUSED_MLP_NO_ARCH
  return false;
#else
  constexpr int64_t kMax = int64_t{1} << 30;
  // TMA: 16-byte aligned bases and row strides; the epilogue: 8-column blocks (N % 8 == 0), 16-byte stores.
  if (a.M <= 0 || a.N <= 0 || a.K <= 0 || a.M >= kMax || a.N >= kMax || a.K >= kMax) return false;
  if (a.N % 8 != 0 || a.K % 8 != 0 || a.lda % 8 != 0 || a.ldb % 8 != 0) return false;
  if (!aligned16(a.a) || !aligned16(a.b) || !aligned16(a.y) || !aligned16(a.z) || !aligned16(a.bias)) return false;
  return a.bf16 ? run_dtype<__nv_bfloat16>(a, mode) : run_dtype<__half>(a, mode);
#endif
}

}  // namespace fused_mlp::cuda
