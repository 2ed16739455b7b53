// Gated activations on the CPU: h = act(gate) * up with act in {tanh-GeLU, erf-GeLU, SiLU}, and backward.
// gate, up, dh: [T, I] (unit stride along I, any row stride, e.g. the two halves of one [T, 2I] tensor).
//
// Numerics and the per-CPU copies: cpu/act_math.h (shared with addmm.cpp's epilogue).
#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>

#include "cpu/act_math.h"  // the fp32 activation math and the per-CPU copies (shared with addmm.cpp)
#include "cpu/cpu_common.h"
#include "activation.h"  // Act, parse_activation, dispatch_act (shared with the CUDA backend)
#include "torch_binding.h"

namespace fused_mlp::cpu {
namespace {

using fused_mlp::Act;
using fused_mlp::dispatch_act;
using fused_mlp::parse_activation;

// ---- element loops over one contiguous span ----------------------------------------------------------------
// Out of place, one fused loop over __restrict pointers. In place, chunks of kChunk elements go through fp32
// scratch arrays (load/convert, math, convert/store: separate unit-stride loops): the scratch arrays alias
// nothing, so GCC vectorises every loop without run-time alias checks (it gives up on six same-typed pointers
// that may alias), and each chunk is read entirely before any of it is written.
constexpr int64_t kChunk = 256;

template <typename T>
FM_INLINE void load_chunk(const T* src, float* __restrict dst, int64_t m) {
  for (int64_t i = 0; i < m; ++i) dst[i] = load(src[i]);
}
template <typename T>
FM_INLINE void store_chunk(const float* __restrict src, T* dst, int64_t m) {
  for (int64_t i = 0; i < m; ++i) store(dst + i, src[i]);
}

template <Act A, bool kFma, typename T>
FM_INLINE void fwd_span(const T* __restrict gate, const T* __restrict up, T* __restrict out, int64_t n) {
  // out is always a fresh tensor: no aliasing, so one fused loop (no scratch round trip).
  for (int64_t i = 0; i < n; ++i) store(out + i, act_fwd<A, kFma>(load(gate[i])) * load(up[i]));
}

// dgate = dh * up * act'(gate), dup = dh * act(gate) and, when kWriteH, h = act(gate) * up.
// In place (kWriteH: h_out == dh, dgate == gate, dup == up) through the fp32 scratch chunks; out of place (fresh
// dgate/dup, nothing aliases) as one fused loop.
template <Act A, bool kFma, bool kWriteH, typename T, typename TD>
FM_INLINE void bwd_span(const TD* dh, const T* gate, const T* up, TD* h_out, T* dgate, T* dup, int64_t n) {
  if constexpr (!kWriteH) {
    const TD* __restrict d_ = dh;
    const T* __restrict g_ = gate;
    const T* __restrict u_ = up;
    T* __restrict dg_ = dgate;
    T* __restrict du_ = dup;
    for (int64_t i = 0; i < n; ++i) {
      const float dv = load(d_[i]), uv = load(u_[i]);
      float a, da;
      act_fwd_bwd<A, kFma>(load(g_[i]), a, da);
      store(dg_ + i, dv * uv * da);
      store(du_ + i, dv * a);
    }
  } else {
    alignas(64) float d[kChunk], g[kChunk], u[kChunk];
    for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
      const int64_t m = std::min(kChunk, n - c0);
      load_chunk(dh + c0, d, m);
      load_chunk(gate + c0, g, m);
      load_chunk(up + c0, u, m);
      for (int64_t i = 0; i < m; ++i) {
        float a, da;
        act_fwd_bwd<A, kFma>(g[i], a, da);
        const float dv = d[i], uv = u[i];
        d[i] = a * uv;        // h
        g[i] = dv * uv * da;  // dgate
        u[i] = dv * a;        // dup
      }
      store_chunk(d, h_out + c0, m);
      store_chunk(g, dgate + c0, m);
      store_chunk(u, dup + c0, m);
    }
  }
}


template <Act A, typename T>
FM_FAST_COPY void fwd_span_fast(const T* gate, const T* up, T* out, int64_t n) {
  fwd_span<A, kFastCopyFma>(gate, up, out, n);
}
#if defined(__x86_64__)
template <Act A, typename T>
FM_AVX512_COPY void fwd_span_avx512(const T* gate, const T* up, T* out, int64_t n) {
  fwd_span<A, true>(gate, up, out, n);
}
template <Act A, bool kWriteH, typename T, typename TD>
FM_AVX512_COPY void bwd_span_avx512(const TD* dh, const T* gate, const T* up, TD* h_out, T* dgate, T* dup,
                                    int64_t n) {
  bwd_span<A, true, kWriteH>(dh, gate, up, h_out, dgate, dup, n);
}
#endif
template <Act A, typename T>
void fwd_span_base(const T* gate, const T* up, T* out, int64_t n) {
  fwd_span<A, false>(gate, up, out, n);
}
template <Act A, bool kWriteH, typename T, typename TD>
FM_FAST_COPY void bwd_span_fast(const TD* dh, const T* gate, const T* up, TD* h_out, T* dgate, T* dup, int64_t n) {
  bwd_span<A, kFastCopyFma, kWriteH>(dh, gate, up, h_out, dgate, dup, n);
}
template <Act A, bool kWriteH, typename T, typename TD>
void bwd_span_base(const TD* dh, const T* gate, const T* up, TD* h_out, T* dgate, T* dup, int64_t n) {
  bwd_span<A, false, kWriteH>(dh, gate, up, h_out, dgate, dup, n);
}

// Work split: (row, column block) tasks; a task is at most kColBlock elements so that a few long rows (decode:
// T = 1..16, I = 16K) still spread over the threads; tasks are grouped so a thread gets >= kGrainElems.
constexpr int64_t kColBlock = 8192;
constexpr int64_t kGrainElems = 32768;

template <typename F>
void for_each_span(int64_t rows, int64_t cols, F&& f) {
  if (rows == 0 || cols == 0) return;
  const int64_t blocks_per_row = (cols + kColBlock - 1) / kColBlock;
  const int64_t span = std::min(cols, kColBlock);
  const int64_t grain = std::max<int64_t>(1, kGrainElems / span);
  fused_mlp::parallel_for(0, rows * blocks_per_row, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / blocks_per_row;
      const int64_t c0 = (task - r * blocks_per_row) * kColBlock;
      f(r, c0, std::min(kColBlock, cols - c0));
    }
  });
}

// Row view of a tensor the ops accept: 2-D [rows, cols] with unit stride along cols and any row stride, or a
// contiguous tensor of any rank (rows = all leading dims; geglu_fwd only: the inference path skips reshapes).
int64_t n_cols(const Tensor& t) { return t.dim() == 0 ? 1 : t.size(t.dim() - 1); }
int64_t n_rows(const Tensor& t) { return t.dim() == 2 ? t.size(0) : (n_cols(t) ? t.numel() / n_cols(t) : 0); }
int64_t row_stride(const Tensor& t) { return t.dim() == 2 ? t.stride(0) : n_cols(t); }

// A tensor's data pointer and row stride, read once before the parallel loops (in the stable-ABI build every
// Tensor accessor is a call through torch's C shim).
struct RowsView {
  void* base;
  int64_t stride;
  template <typename T>
  T* elem(int64_t r, int64_t c) const {
    return static_cast<T*>(base) + r * stride + c;
  }
};

RowsView rows_view(const Tensor& t) { return {t.data_ptr(), row_stride(t)}; }

// 2-D, float, unit stride along I (any strides for an empty tensor: nothing is addressed); with allow_nd, a
// contiguous tensor of another rank is accepted as well.
void check_rows_any(const Tensor& t, const char* name, bool allow_nd = false) {
  FM_CHECK(is_float_type(t.scalar_type()), "fused_mlp: ", name, " must be float32/float16/bfloat16, got ",
           t.scalar_type());
  if (allow_nd && t.dim() != 2) {
    FM_CHECK(t.dim() >= 1 && t.is_contiguous(), "fused_mlp: ", name, " must be 2-D [rows, cols] or contiguous");
    return;
  }
  if (t.numel() == 0) {
    FM_CHECK(t.dim() == 2, "fused_mlp: ", name, " must be 2-D [rows, cols], got ", t.dim(), "-D");
    return;
  }
  check_rows(t, name);
}

void check_pair(const Tensor& gate, const Tensor& up, bool allow_nd = false) {
  check_rows_any(gate, "gate", allow_nd);
  check_rows_any(up, "up", allow_nd);
  FM_CHECK(sizes_of(gate) == sizes_of(up), "fused_mlp: gate shape ", shape_str(gate), " != up shape ",
           shape_str(up));
  FM_CHECK(gate.scalar_type() == up.scalar_type(), "fused_mlp: gate dtype ", gate.scalar_type(), " != up dtype ",
           up.scalar_type());
  FM_CHECK(gate.device() == up.device(), "fused_mlp: gate and up must be on one device");
}

void check_dh(const Tensor& dh, const Tensor& gate) {
  check_rows_any(dh, "dh");
  FM_CHECK(sizes_of(dh) == sizes_of(gate), "fused_mlp: dh shape ", shape_str(dh), " != gate shape ",
           shape_str(gate));
  FM_CHECK(dh.scalar_type() == gate.scalar_type() || dh.scalar_type() == kFloat,
           "fused_mlp: dh must be float32 or gate's dtype (", gate.scalar_type(), "), got ", dh.scalar_type());
  FM_CHECK(dh.device() == gate.device(), "fused_mlp: dh and gate must be on one device");
}

// h_out is read only when kWriteH.
template <bool kWriteH>
void run_bwd(Act act, const Tensor& dh, const Tensor& gate, const Tensor& up, const Tensor& h_out,
             const Tensor& dgate, const Tensor& dup) {
  const int64_t rows = gate.size(0), cols = gate.size(1);
  if (rows == 0 || cols == 0) return;  // nothing to do (for_each_span's own early exit; dtypes are checked)
  const CpuLevel copy = cpu_copy();
  const RowsView dh_v = rows_view(dh), gate_v = rows_view(gate), up_v = rows_view(up);
  const RowsView h_v = kWriteH ? rows_view(h_out) : RowsView{nullptr, 0};
  const RowsView dgate_v = rows_view(dgate), dup_v = rows_view(dup);
  dispatch_act(act, [&](auto ac) {
    constexpr Act A = decltype(ac)::value;
    dispatch_dtype(gate.scalar_type(), "gate", [&](auto tt) {
      using T = decltype(tt);
      auto run = [&](auto dt) {
        using TD = decltype(dt);
        for_each_span(rows, cols, [&](int64_t r, int64_t c0, int64_t n) {
          const TD* d = dh_v.elem<TD>(r, c0);
          const T* g = gate_v.elem<T>(r, c0);
          const T* u = up_v.elem<T>(r, c0);
          TD* h = kWriteH ? h_v.elem<TD>(r, c0) : nullptr;
          T* dg = dgate_v.elem<T>(r, c0);
          T* du = dup_v.elem<T>(r, c0);
#if defined(__x86_64__)
          if (copy == CpuLevel::kAvx512) {
            bwd_span_avx512<A, kWriteH, T, TD>(d, g, u, h, dg, du, n);
            return;
          }
#endif
          if (copy == CpuLevel::kAvx2) bwd_span_fast<A, kWriteH, T, TD>(d, g, u, h, dg, du, n);
          else bwd_span_base<A, kWriteH, T, TD>(d, g, u, h, dg, du, n);
        });
      };
      if (dh.scalar_type() == kFloat) run(float{});
      else run(T{});
    });
  });
}

}  // namespace
}  // namespace fused_mlp::cpu

using namespace fused_mlp::cpu;

Tensor geglu_fwd_cpu(const Tensor& gate, const Tensor& up, StrArg activation) {
  const Act act = parse_activation(std::string_view(activation.data(), activation.size()));
  check_pair(gate, up, /*allow_nd=*/true);
  const int64_t rows = n_rows(gate), cols = n_cols(gate);
  Tensor out = fused_mlp::empty(fused_mlp::sizes_of(gate), gate.scalar_type(), gate);
  if (rows == 0 || cols == 0) return out;  // nothing to do (for_each_span's own early exit; dtypes are checked)
  const CpuLevel copy = cpu_copy();
  const RowsView gate_v = rows_view(gate), up_v = rows_view(up), out_v = rows_view(out);
  dispatch_act(act, [&](auto ac) {
    constexpr Act A = decltype(ac)::value;
    dispatch_dtype(gate.scalar_type(), "gate", [&](auto tt) {
      using T = decltype(tt);
      for_each_span(rows, cols, [&](int64_t r, int64_t c0, int64_t n) {
        const T* g = gate_v.elem<T>(r, c0);
        const T* u = up_v.elem<T>(r, c0);
        T* o = out_v.elem<T>(r, c0);
#if defined(__x86_64__)
        if (copy == CpuLevel::kAvx512) {
          fwd_span_avx512<A, T>(g, u, o, n);
          return;
        }
#endif
        if (copy == CpuLevel::kAvx2) fwd_span_fast<A, T>(g, u, o, n);
        else fwd_span_base<A, T>(g, u, o, n);
      });
    });
  });
  return out;
}

std::tuple<Tensor, Tensor> geglu_bwd_cpu(const Tensor& dh, const Tensor& gate, const Tensor& up,
                                         StrArg activation) {
  const Act act = parse_activation(std::string_view(activation.data(), activation.size()));
  check_pair(gate, up);
  check_dh(dh, gate);
  const fused_mlp::Sizes sizes = fused_mlp::sizes_of(gate);
  Tensor dgate = fused_mlp::empty(sizes, gate.scalar_type(), gate);
  Tensor dup = fused_mlp::empty(sizes, gate.scalar_type(), gate);
  run_bwd<false>(act, dh, gate, up, /*h_out (unused)=*/dh, dgate, dup);
  return {dgate, dup};
}

void geglu_bwd_inplace_cpu(const Tensor& dh, const Tensor& gate, const Tensor& up, StrArg activation) {
  const Act act = parse_activation(std::string_view(activation.data(), activation.size()));
  check_pair(gate, up);
  check_dh(dh, gate);
  // Each element is read, then its three results are written by the same thread: safe only when no two
  // elements share memory (no expanded/overlapping views) and the three buffers are disjoint.
  fused_mlp::check_no_internal_overlap(dh, "geglu_bwd_inplace: dh");
  fused_mlp::check_no_internal_overlap(gate, "geglu_bwd_inplace: gate");
  fused_mlp::check_no_internal_overlap(up, "geglu_bwd_inplace: up");
  fused_mlp::check_no_overlap(dh, gate, "geglu_bwd_inplace: dh and gate");
  fused_mlp::check_no_overlap(dh, up, "geglu_bwd_inplace: dh and up");
  fused_mlp::check_no_overlap(gate, up, "geglu_bwd_inplace: gate and up");
  run_bwd<true>(act, dh, gate, up, dh, gate, up);
}
