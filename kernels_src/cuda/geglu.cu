// Gated activations on CUDA: h = act(gate) * up, act in {tanh-GeLU, erf-GeLU, SiLU}, and the backward.
// gate, up, dh: [T, I] (unit stride along I, any row stride: e.g. the two halves of one [T, 2I] tensor);
// outputs of the out-of-place ops are contiguous [T, I]. fp32 math, each output rounded once.
//
// Memory-bound elementwise kernels (bf16 fwd moves 6 bytes/element, bwd 10-12): a grid-stride loop over
// "packs" of N elements. N = 16 bytes / sizeof(T) (8 for bf16/fp16, 4 for fp32) when every pointer is 16-byte
// aligned and every row stride and I are multiples of N (the pack never straddles a row); otherwise N = 1 (the
// scalar path: odd I, unaligned views). Each thread keeps U packs of every input in flight per iteration
// (fwd U = 2, bf16: 2 x (16 + 16) B = 64 B; vector bwd U = 1: 16 + 16 + 16 B, 32 + 16 + 16 with an fp32 dh).
// The grid is sized to exactly the resident blocks (occupancy API, cached per kernel and device), so there is no
// tail wave. The forward's vector path takes one pack per thread with no loop instead (small_max_elems: every 16-bit
// size, fp32 up to 2^21 elements; FUSED_MLP_GEGLU_SMALL).
// 16-bit outputs take MUFU exp / reciprocal (sigmoid_and_slope) and word-wise conversions (unit_elem): with the
// IEEE reciprocal and shift-based conversions the kernels were issue-bound -- docs/tuning-log.md#gated-act-mufu
// Numerics (the CPU file's formulas; fp32 outputs with CUDA's accurate expf/erff):
//   sigmoid(z): e = expf(-|z|) (never overflows), r = 1/(1+e), sigmoid = z >= 0 ? r : e*r,
//               sigmoid'(z) = e*r*r (no cancellation on either side).
//   tanh-GeLU:  x * sigmoid(2u), u = sqrt(2/pi)(x + 0.044715x^3); derivative sigmoid(2u) + x sigmoid'(2u) 2u'.
//   erf-GeLU:   x * Phi(x), Phi(x) = 0.5 + 0.5 erff(x/sqrt2) as PyTorch computes it (erfcf(-x/sqrt2)/2 would keep
//               relative accuracy in the x < -3 tail, where |gelu| < 4e-3, but costs ~2.5x erff's instructions
//               and would make this path compute-bound: ~66 vs ~33 PTX instructions per element in the bf16
//               forward, whose budget at full bandwidth is ~47); derivative Phi(x) + x phi(x),
//               phi(x) = expf(-x^2/2)/sqrt(2pi).
//   SiLU:       x * sigmoid(x); derivative sigmoid(x) + x sigmoid'(x).
#include <atomic>
#include <cuda_runtime.h>

#include <cstdlib>
#include <type_traits>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>

#include "cuda/common.cuh"
#include "cuda/gated_act.cuh"
#include "torch_binding.h"

namespace fused_mlp::cuda {
namespace {

// ---- tuning table (H200, sm_90). Confirm with benchmarks/ (activation kernel GB/s vs copy bandwidth). ------
// kThreads = 256: 8 warps per block; the grid is capped at the resident block count, so the block size only sets
//   the granularity of the grid-stride loop.
// kUnroll = 2: packs per thread per iteration (forward, and the scalar backward). Little's law on the H200:
//   4.8 TB/s x ~0.8 us ~= 3.8 MB in flight ~= 29 KB per SM; 64-128 B per thread needs >= 512 resident threads
//   per SM. The vector backward takes 1 (kBwdUnrollDefault): 2 costs registers and occupancy and was nowhere
//   faster -- docs/tuning-log.md#geglu-bwd-unroll
constexpr int kThreads = 256;
constexpr int kUnroll = 2;
// One pack per thread, no loop (geglu_fwd_small_kernel, first built for decode), launched with PDL on sm_90+: taken
// under "auto" while rows * cols <= small_max_elems -- 16-bit: every size (0.92-0.96x the persistent kernel's device
// time at T = 1024..8192, 0.48-0.76x below); fp32: 2^21 elements (not measured above). 128 threads per block up to 2^20
// elements, 512 above (fewer blocks: 0.68-0.91x 128's time at T = 256) -- docs/tuning-log.md#gated-act-decode
constexpr int kSmallThreads = 128;
constexpr int kSmallThreadsWide = 512;
constexpr int64_t kSmallWideElems = int64_t{1} << 20;
constexpr int64_t small_max_elems(size_t elem) { return elem == 2 ? INT64_MAX : int64_t{1} << 21; }

// ---- packed loads/stores ------------------------------------------------------------------------------------
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// N elements of D at p as 16-byte accesses (vector path: N * sizeof(D) is a multiple of 16 and p is 16-byte
// aligned) or as one scalar (N == 1).
template <int N, typename D>
__device__ __forceinline__ void load_pack(const D* p, float (&f)[N]) {
  constexpr int kChunk = (N * sizeof(D) >= 16) ? static_cast<int>(16 / sizeof(D)) : N;
  if constexpr (N * sizeof(D) >= 16) {  // whole 16-byte units, converted word by word (unit_elem)
#pragma unroll
    for (int c = 0; c < N; c += kChunk) {
      const uint4 q = *reinterpret_cast<const uint4*>(p + c);
#pragma unroll
      for (int j = 0; j < kChunk; ++j) f[c + j] = unit_elem<D>(&q, j);
    }
  } else {
#pragma unroll
    for (int c = 0; c < N; c += kChunk) {
      const Pack<D, kChunk> v = *reinterpret_cast<const Pack<D, kChunk>*>(p + c);
#pragma unroll
      for (int j = 0; j < kChunk; ++j) f[c + j] = to_float(v.v[j]);
    }
  }
}

template <int N, typename D>
__device__ __forceinline__ void store_pack(D* p, const float (&f)[N]) {
  constexpr int kChunk = (N * sizeof(D) >= 16) ? static_cast<int>(16 / sizeof(D)) : N;
#pragma unroll
  for (int c = 0; c < N; c += kChunk) {
    Pack<D, kChunk> v;
#pragma unroll
    for (int j = 0; j < kChunk; ++j) v.v[j] = from_float<D>(f[c + j]);
    *reinterpret_cast<Pack<D, kChunk>*>(p + c) = v;
  }
}

// n / d for 32-bit n and a fixed d >= 1 by multiply-high (round-up method): s = ceil(log2 d),
// m = floor(2^32 (2^s - d) / d) + 1, n / d = (umulhi(n, m) + n) >> s, with the sum taken in 64 bits.
struct FastDiv {
  uint32_t d, m, s;
  explicit FastDiv(uint32_t divisor) : d(divisor), s(0) {
    while ((uint64_t{1} << s) < divisor) ++s;
    m = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << s) - divisor)) / divisor + 1);
  }
  __device__ __forceinline__ uint32_t div(uint32_t n) const {
    return static_cast<uint32_t>((static_cast<uint64_t>(__umulhi(n, m)) + n) >> s);
  }
};

// ---- kernels ----------------------------------------------------------------------------------------------
template <Act A, typename T, int N>
__global__ void __launch_bounds__(kThreads) geglu_fwd_kernel(
    const T* __restrict__ gate, int64_t gate_stride,  // [rows, cols], row stride in elements
    const T* __restrict__ up, int64_t up_stride,      // [rows, cols]
    T* __restrict__ out,                              // [rows, cols] contiguous
    uint32_t n_packs, FastDiv packs_per_row) {        // n_packs = rows * cols / N < 2^31
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t base = blockIdx.x * blockDim.x + threadIdx.x; base < n_packs; base += kUnroll * stride) {
    float g[kUnroll][N], u[kUnroll][N];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const uint32_t p = base + k * stride;
      if (p < n_packs) {
        const uint32_t row = packs_per_row.div(p);
        const int64_t col = static_cast<int64_t>(p - row * packs_per_row.d) * N;
        load_pack<N>(gate + row * gate_stride + col, g[k]);
        load_pack<N>(up + row * up_stride + col, u[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const uint32_t p = base + k * stride;
      if (p < n_packs) {
        float h[N];
#pragma unroll
        for (int j = 0; j < N; ++j) h[j] = act_fwd<A, kFast<T>>(g[k][j]) * u[k][j];
        store_pack<N>(out + static_cast<int64_t>(p) * N, h);
      }
    }
  }
}

// One 16-byte pack of gate and of up per thread, grid = ceil(packs / blockDim), no loop (built for decode; every 16-bit
// forward on the vector path since: small_max_elems). At small T * I the persistent kernel above has few blocks (2 at
// T = 1, I = 8192) whose threads each run kUnroll packs and the row division; here every pack's latency overlaps on
// as many SMs as there are packs / blockDim. `flat`: the rows are contiguous (or there is one), so pack p is at p * N
// in all three tensors.
template <Act A, typename T, int N>
__global__ void __launch_bounds__(512) geglu_fwd_small_kernel(
    const T* __restrict__ gate, int64_t gate_stride,  // [rows, cols], row stride in elements
    const T* __restrict__ up, int64_t up_stride,      // [rows, cols]
    T* __restrict__ out,                              // [rows, cols] contiguous
    uint32_t n_packs, FastDiv packs_per_row, bool flat) {
  static_assert(N * sizeof(T) == 16, "one 16-byte pack per thread");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Programmatic dependent launch (no-ops when launched without it): wait for the previous grid's writes (gate/up
  // come from the GEMM before), then let the next grid start launching at once.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  const uint32_t p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= n_packs) return;
  int64_t go = static_cast<int64_t>(p) * N, uo = go;
  if (!flat) {
    const uint32_t row = packs_per_row.div(p);
    const int64_t col = static_cast<int64_t>(p - row * packs_per_row.d) * N;
    go = row * gate_stride + col;
    uo = row * up_stride + col;
  }
  float g[N], u[N], h[N];
  load_pack<N>(gate + go, g);
  load_pack<N>(up + uo, u);
#pragma unroll
  for (int j = 0; j < N; ++j) h[j] = act_fwd<A, kFast<T>>(g[j]) * u[j];
  store_pack<N>(out + static_cast<int64_t>(p) * N, h);
}

// Reads dh, gate, up; writes dgate = dh * up * act'(gate), dup = dh * act(gate) and (kWriteH) h = act(gate) * up.
// In place the outputs alias the inputs element for element (h_out == dh, dgate == gate, dup == up): a thread
// loads all of its elements before it stores any of them, and no other thread touches them; hence no
// __restrict__ here.
template <Act A, typename T, typename TD, int N, bool kWriteH, int U>
__global__ void __launch_bounds__(kThreads) geglu_bwd_kernel(
    const TD* dh, int64_t dh_stride,        // [rows, cols] fp32 or T
    const T* gate, int64_t gate_stride,     // [rows, cols]
    const T* up, int64_t up_stride,         // [rows, cols]
    TD* h_out, int64_t h_stride,            // [rows, cols] or null (kWriteH == false)
    T* dgate, int64_t dgate_stride,         // [rows, cols]
    T* dup, int64_t dup_stride,             // [rows, cols]
    uint32_t n_packs, FastDiv packs_per_row) {
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t base = blockIdx.x * blockDim.x + threadIdx.x; base < n_packs; base += U * stride) {
    float d[U][N], g[U][N], u[U][N];
    uint32_t rows[U];
    int64_t cols[U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const uint32_t p = base + k * stride;
      if (p < n_packs) {
        rows[k] = packs_per_row.div(p);
        cols[k] = static_cast<int64_t>(p - rows[k] * packs_per_row.d) * N;
        load_pack<N>(dh + rows[k] * dh_stride + cols[k], d[k]);
        load_pack<N>(gate + rows[k] * gate_stride + cols[k], g[k]);
        load_pack<N>(up + rows[k] * up_stride + cols[k], u[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const uint32_t p = base + k * stride;
      if (p < n_packs) {
        float hv[N], dg[N], du[N];
#pragma unroll
        for (int j = 0; j < N; ++j) {
          float a, da;
          act_fwd_bwd<A, kFast<T>>(g[k][j], a, da);
          hv[j] = a * u[k][j];
          dg[j] = d[k][j] * u[k][j] * da;
          du[j] = d[k][j] * a;
        }
        if constexpr (kWriteH) store_pack<N>(h_out + rows[k] * h_stride + cols[k], hv);
        store_pack<N>(dgate + rows[k] * dgate_stride + cols[k], dg);
        store_pack<N>(dup + rows[k] * dup_stride + cols[k], du);
      }
    }
  }
}

// ---- host helpers -----------------------------------------------------------------------------------------
int sm_count(int device) {
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

// Blocks of kThreads that fit on the device at once for `kernel`.
int resident_blocks(const void* kernel, int device) {
  return resident_blocks_per_sm(kernel, device, kThreads) * sm_count(device);
}

int grid_for(const void* kernel, int device, uint32_t n_packs, int unroll = kUnroll) {
  const int64_t wanted = (static_cast<int64_t>(n_packs) + int64_t{kThreads} * unroll - 1) / (int64_t{kThreads} * unroll);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(wanted, resident_blocks(kernel, device))));
}

// Row view of a tensor the ops accept: 2-D [rows, cols] with unit stride along cols and any row stride, or a
// contiguous tensor of any rank (rows = all leading dims; geglu_fwd only: the inference path skips reshapes).
int64_t n_cols(const Tensor& t) { return t.size(t.dim() - 1); }
int64_t n_rows(const Tensor& t) { return t.dim() == 2 ? t.size(0) : (n_cols(t) ? t.numel() / n_cols(t) : 0); }
// The row stride the kernels use: any value for a single row (torch reports arbitrary strides for size-1 dims).
int64_t row_stride(const Tensor& t) {
  if (t.dim() != 2) return n_cols(t);
  return t.size(0) > 1 ? t.stride(0) : 0;
}

// 16-byte accesses are legal for t: aligned base and a row stride that keeps every row aligned.
bool aligned16(const Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0 &&
         (row_stride(t) * static_cast<int64_t>(t.element_size())) % 16 == 0;
}

// Splits the rows so that each launch indexes < 2^31 packs in 32-bit arithmetic.
template <typename F>
void for_row_chunks(int64_t rows, int64_t packs_per_row, F&& f) {
  constexpr int64_t kMaxPacks = (int64_t{1} << 31) - 1;
  FM_CHECK(packs_per_row <= kMaxPacks, "fused_mlp: rows of ", packs_per_row, " packs are too long");
  const int64_t chunk = std::max<int64_t>(1, kMaxPacks / packs_per_row);
  for (int64_t r0 = 0; r0 < rows; r0 += chunk) f(r0, std::min(chunk, rows - r0));
}

void check_rows_cuda(const Tensor& t, const char* name, bool allow_nd = false) {
  FM_CHECK(t.is_cuda(), "fused_mlp: ", name, " must be a CUDA tensor, got ", device_str(t));
  if (allow_nd && t.dim() != 2) {
    FM_CHECK(t.dim() >= 1 && t.is_contiguous(), "fused_mlp: ", name, " must be 2-D [rows, cols] or contiguous");
    return;
  }
  FM_CHECK(t.dim() == 2, "fused_mlp: ", name, " must be 2-D [rows, cols], got ", t.dim(), "-D");
  FM_CHECK(t.numel() == 0 || t.size(1) <= 1 || t.stride(1) == 1, "fused_mlp: ", name,
           " must have unit stride along cols");
}

void check_pair(const Tensor& gate, const Tensor& up, bool allow_nd = false) {
  check_rows_cuda(gate, "gate", allow_nd);
  check_rows_cuda(up, "up", allow_nd);
  FM_CHECK(fused_mlp::same_shape(gate, up), "fused_mlp: gate shape ", fused_mlp::shape_str(gate), " != up shape ", fused_mlp::shape_str(up));
  FM_CHECK(gate.scalar_type() == up.scalar_type(), "fused_mlp: gate dtype ", gate.scalar_type(),
           " != up dtype ", up.scalar_type());
  FM_CHECK(same_cuda_device(gate, up), "fused_mlp: gate and up must be on one device");
}

void check_dh(const Tensor& dh, const Tensor& gate) {
  check_rows_cuda(dh, "dh");
  FM_CHECK(fused_mlp::same_shape(dh, gate), "fused_mlp: dh shape ", fused_mlp::shape_str(dh), " != gate shape ", fused_mlp::shape_str(gate));
  FM_CHECK(dh.scalar_type() == gate.scalar_type() || dh.scalar_type() == kFloat,
           "fused_mlp: dh must be float32 or gate's dtype (", gate.scalar_type(), "), got ", dh.scalar_type());
  FM_CHECK(same_cuda_device(dh, gate), "fused_mlp: dh and gate must be on one device");
}

template <typename T>
const T* cptr(const Tensor& t, int64_t r0) {
  return static_cast<const T*>(t.const_data_ptr()) + r0 * row_stride(t);
}
template <typename T>
T* mptr(const Tensor& t, int64_t r0) {
  return static_cast<T*>(t.data_ptr()) + r0 * row_stride(t);
}

template <Act A, typename T, int N>
void launch_fwd(const Tensor& gate, const Tensor& up, const Tensor& out, int device,
                cudaStream_t stream) {
  const int64_t rows = n_rows(gate), packs_per_row = n_cols(gate) / N;
  auto kernel = geglu_fwd_kernel<A, T, N>;
  for_row_chunks(rows, packs_per_row, [&](int64_t r0, int64_t nr) {
    const auto n_packs = static_cast<uint32_t>(nr * packs_per_row);
    const int grid = grid_for(reinterpret_cast<const void*>(kernel), device, n_packs);
    kernel<<<grid, kThreads, 0, stream>>>(cptr<T>(gate, r0), row_stride(gate), cptr<T>(up, r0), row_stride(up),
                                          mptr<T>(out, r0), n_packs, FastDiv(static_cast<uint32_t>(packs_per_row)));
    FM_KERNEL_LAUNCH_CHECK();
  });
}

// FUSED_MLP_GEGLU_SMALL = auto | on | off [,threads=64|128|256|512] (common.cuh: SmallKnob), read once per process
// (knob_dynamic: at every call).
SmallKnob geglu_small_knob() {
  static const SmallKnobReader reader("FUSED_MLP_GEGLU_SMALL", "threads");
  return reader.get();
}

// Compute capability major of `device`, cached.
int cc_major(int device) {
  static std::atomic<int> cached[64];  // as sm_count's
  const bool slot = device >= 0 && device < 64;
  if (slot) {
    const int c = cached[device].load(std::memory_order_relaxed);
    if (c > 0) return c;
  }
  int v = 0;
  FM_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrComputeCapabilityMajor, device));
  if (slot) cached[device].store(v, std::memory_order_relaxed);
  return v;
}

// Programmatic dependent launch of the few-elements forward on sm_90+ (FUSED_MLP_GEGLU_PDL=0 turns it off; read per
// call, so one process can A/B it) -- docs/tuning-log.md#gated-act-decode
bool small_pdl(int device) {
  if (cc_major(device) < 9) return false;
  const char* e = std::getenv("FUSED_MLP_GEGLU_PDL");
  return e == nullptr || e[0] != '0';
}

// The few-elements forward (vector path only): one launch, one pack per thread.
template <Act A, typename T, int N>
void launch_fwd_small(const Tensor& gate, const Tensor& up, const Tensor& out, int threads, int device,
                      cudaStream_t stream) {
  const int64_t rows = n_rows(gate), packs_per_row = n_cols(gate) / N;
  const auto n_packs = static_cast<uint32_t>(rows * packs_per_row);  // < 2^31 (the caller checks)
  const bool flat = rows == 1 || (row_stride(gate) == n_cols(gate) && row_stride(up) == n_cols(gate));
  const int grid = static_cast<int>((int64_t{n_packs} + threads - 1) / threads);
  auto* kern = &geglu_fwd_small_kernel<A, T, N>;
  const T* g = cptr<T>(gate, 0);
  const T* u = cptr<T>(up, 0);
  T* o = mptr<T>(out, 0);
  const int64_t gs = row_stride(gate), us = row_stride(up);
  const FastDiv ppr(static_cast<uint32_t>(packs_per_row));
  if (!small_pdl(device)) {
    kern<<<grid, threads, 0, stream>>>(g, gs, u, us, o, n_packs, ppr, flat);
    FM_KERNEL_LAUNCH_CHECK();
    return;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(grid), 1, 1);
  cfg.blockDim = dim3(static_cast<unsigned>(threads), 1, 1);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  FM_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kern, g, gs, u, us, o, n_packs, ppr, flat));
}

// Packs per thread per iteration of the vector bwd kernel: kBwdUnrollDefault, or FUSED_MLP_GEGLU_TUNE="bwd_unroll=1|2"
// (read once per process) for the tuning sweep.
constexpr int kBwdUnrollDefault = 1;
int bwd_unroll() {
  static const int u = [] {
    const char* e = std::getenv("FUSED_MLP_GEGLU_TUNE");
    if (e != nullptr) {
      const std::string_view v(e);
      if (v.find("bwd_unroll=1") != std::string_view::npos) return 1;
      if (v.find("bwd_unroll=2") != std::string_view::npos) return 2;
    }
    return kBwdUnrollDefault;
  }();
  return u;
}

template <bool kWriteH>
void run_bwd(Act act, const Tensor& dh, const Tensor& gate, const Tensor& up, const Tensor& h_out,
             const Tensor& dgate, const Tensor& dup) {
  const int64_t rows = gate.size(0), cols = gate.size(1);
  if (rows == 0 || cols == 0) return;
  DeviceGuard guard(gate);
  const auto stream = current_stream(gate);
  const int device = device_index(gate);
  dispatch_act(act, [&](auto ac) {
    constexpr Act A = decltype(ac)::value;
    dispatch_float(gate.scalar_type(), "gate", [&](auto tt) {
      using T = decltype(tt);
      dispatch_base_or_float<T>(dh.scalar_type(), "dh", [&](auto dt) {
        using TD = decltype(dt);
        constexpr int kVec = static_cast<int>(16 / sizeof(T));
        const bool vec = cols % kVec == 0 && aligned16(dh) && aligned16(gate) && aligned16(up) &&
                         aligned16(dgate) && aligned16(dup) && (!kWriteH || aligned16(h_out));
        auto launch = [&](auto n_tag, auto u_tag) {
          constexpr int N = decltype(n_tag)::value;
          constexpr int U = decltype(u_tag)::value;
          const int64_t packs_per_row = cols / N;
          auto kernel = geglu_bwd_kernel<A, T, TD, N, kWriteH, U>;
          for_row_chunks(rows, packs_per_row, [&](int64_t r0, int64_t nr) {
            const auto n_packs = static_cast<uint32_t>(nr * packs_per_row);
            const int grid = grid_for(reinterpret_cast<const void*>(kernel), device, n_packs, U);
            kernel<<<grid, kThreads, 0, stream>>>(
                cptr<TD>(dh, r0), row_stride(dh), cptr<T>(gate, r0), row_stride(gate), cptr<T>(up, r0),
                row_stride(up), kWriteH ? mptr<TD>(h_out, r0) : nullptr, kWriteH ? row_stride(h_out) : 0,
                mptr<T>(dgate, r0), row_stride(dgate), mptr<T>(dup, r0), row_stride(dup), n_packs,
                FastDiv(static_cast<uint32_t>(packs_per_row)));
            FM_KERNEL_LAUNCH_CHECK();
          });
        };
        // Vector path: packs per thread per iteration from the tuning table (bwd_unroll); scalar path: 2.
        if (vec && bwd_unroll() == 1) launch(std::integral_constant<int, kVec>{}, std::integral_constant<int, 1>{});
        else if (vec) launch(std::integral_constant<int, kVec>{}, std::integral_constant<int, 2>{});
        else launch(std::integral_constant<int, 1>{}, std::integral_constant<int, 2>{});
      });
    });
  });
}

}  // namespace
}  // namespace fused_mlp::cuda

using namespace fused_mlp::cuda;

Tensor geglu_fwd_cuda(const Tensor& gate, const Tensor& up, StrArg activation) {
  const Act act = parse_activation(activation);
  check_pair(gate, up, /*allow_nd=*/true);
  DeviceGuard guard(gate);
  const int64_t rows = n_rows(gate), cols = n_cols(gate);
  auto out = fused_mlp::empty(fused_mlp::sizes_of(gate), gate.scalar_type(), gate);
  if (rows == 0 || cols == 0) return out;
  const auto stream = current_stream(gate);
  const int device = device_index(gate);
  const SmallKnob small = geglu_small_knob();
  const int64_t elems = rows * cols;
  const int64_t max_elems = small_max_elems(gate.element_size());
  const bool few = small.mode == SmallKnob::kOn || (small.mode == SmallKnob::kAuto && elems <= max_elems);
  const int small_threads = small.value == 64 || small.value == 128 || small.value == 256 || small.value == 512
                                ? small.value
                                : elems <= kSmallWideElems ? kSmallThreads : kSmallThreadsWide;
  dispatch_act(act, [&](auto ac) {
    constexpr Act A = decltype(ac)::value;
    dispatch_float(gate.scalar_type(), "gate", [&](auto tt) {
      using T = decltype(tt);
      constexpr int kVec = static_cast<int>(16 / sizeof(T));
      // `out` is fresh (aligned, stride cols): the vector path needs I % kVec == 0 and aligned inputs.
      const bool vec = cols % kVec == 0 && aligned16(gate) && aligned16(up);
      if (vec && few && elems / kVec < (int64_t{1} << 31))
        launch_fwd_small<A, T, kVec>(gate, up, out, small_threads, device, stream);
      else if (vec) launch_fwd<A, T, kVec>(gate, up, out, device, stream);
      else launch_fwd<A, T, 1>(gate, up, out, device, stream);
    });
  });
  return out;
}

std::tuple<Tensor, Tensor> geglu_bwd_cuda(const Tensor& dh, const Tensor& gate, const Tensor& up,
                                          StrArg activation) {
  const Act act = parse_activation(activation);
  check_pair(gate, up);
  check_dh(dh, gate);
  DeviceGuard guard(gate);
  auto dgate = fused_mlp::empty(fused_mlp::sizes_of(gate), gate.scalar_type(), gate);
  auto dup = fused_mlp::empty(fused_mlp::sizes_of(gate), gate.scalar_type(), gate);
  run_bwd<false>(act, dh, gate, up, Tensor(), dgate, dup);
  return {dgate, dup};
}

void geglu_bwd_inplace_cuda(const Tensor& dh, const Tensor& gate, const Tensor& up,
                            StrArg activation) {
  const Act act = parse_activation(activation);
  check_pair(gate, up);
  check_dh(dh, gate);
  // Each element is read, then its three results are written by the same thread: safe only when no two
  // elements share memory (no expanded/overlapping views) and the three buffers are disjoint.
  for (const Tensor* t : {&dh, &gate, &up}) fused_mlp::check_no_internal_overlap(*t, "geglu_bwd_");
  fused_mlp::check_no_overlap(dh, gate, "geglu_bwd_");
  fused_mlp::check_no_overlap(dh, up, "geglu_bwd_");
  fused_mlp::check_no_overlap(gate, up, "geglu_bwd_");
  run_bwd<true>(act, dh, gate, up, dh, gate, up);
}
