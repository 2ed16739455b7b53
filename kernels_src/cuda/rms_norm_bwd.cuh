// RMSNorm backward, register path ("bwd reg"): included by rms_norm.cu at the end of its anonymous namespace, after
// the helpers it uses (Pack, ld16, load_scale, row_reduce_sum, BwdArgs, DeviceInfo, blocks_per_sm, kernel_spills,
// next_pow2). Not a standalone header.
//
// Aligned rows only (every base pointer and row stride 16-byte aligned, N % VEC == 0, so every pack is whole):
//   persistent grid (SMs x resident CTAs, from the occupancy query), each CTA loops over its row groups; a thread
//   owns PACKS fixed 16-byte column packs (lane + i * tpr) of one row slot and keeps its dW partial sums for them in
//   fp32 REGISTERS across all its rows (no smem traffic per row). Per row: the next row's h / dy (and rstd) loads are
//   issued first (software pipelining in registers: they stay in flight through this row's reduction and dx), then
//   dW += dy * xhat, the row dot product sum(dy * s * xhat) (shuffles + one smem round when a row spans warps), and
//   dx = rs * (dy * s - xhat * dot / N) + dh_extra. At the end the CTA sums its row slots (smem, fixed order, once)
//   and writes one fp32 partial row; rms_norm_dw_column_sum_kernel reduces the partial rows in a fixed order.
// Config (host, bwd_reg_config): PACKS = 1 (knob packs=2: 2 where h and dy packs are 16 bytes each); threads per
//   row tpr = NV / PACKS rounded up (power of two below 32, else a multiple of 32), up to the variant's launch bound;
//   a CTA is max(tpr, 256) threads (rpb = 256 / tpr row slots for short rows).
//   Register budget (ptxas sm_90, docs/tuning-log.md#rmsnorm-bwd-reg): PACKS = 1 with 16-byte h and dy packs (16-bit
//   h and dy, or fp32 x): __launch_bounds__(1024, 1), 64 registers, 0 spills -> >= 50% occupancy, rows up to 1024
//   threads: bf16/fp16 N <= 8192, fp32 N <= 4096. PACKS = 2, and fp32 h or dy with a 16-bit x: 64 registers spill
//   (48-300 B), so those take __launch_bounds__(512, 1) and rows up to 512 threads (bf16 N <= 8192 at 2 packs,
//   N <= 4096 with fp32 h/dy). Longer rows, unaligned rows and N % VEC != 0 stay on the rows / wide kernels.
#pragma once

// Largest PACKS for (TX, TH, TD): 2 when the h and dy packs are one 16-byte unit each, else 1 (register budget).
template <typename TX, typename TH, typename TD>
constexpr int bwd_reg_max_packs() {
  constexpr int vec = 16 / static_cast<int>(sizeof(TX));
  return vec * sizeof(TH) == 16 && vec * sizeof(TD) == 16 ? 2 : 1;
}

// Threads per CTA the variant is compiled for (its __launch_bounds__; see the register budget above).
template <typename TX, typename TH, typename TD, int PACKS>
constexpr int bwd_reg_threads() {
  constexpr int vec = 16 / static_cast<int>(sizeof(TX));
  return PACKS == 1 && vec * sizeof(TH) == 16 && vec * sizeof(TD) == 16 ? 1024 : 512;
}

template <typename T, int U>
__device__ __forceinline__ void ld_units(uint4 (&dst)[U], const T* p) {
  const uint4* s = reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int k = 0; k < U; ++k) dst[k] = ld16<Ld::Stream>(s + k);
}

// Element j of VEC values stored as TB or fp32 (runtime f32) in 16-byte units.
template <typename TB>
__device__ __forceinline__ float elem_rt(const uint4* u, bool f32, int j) {
  return f32 ? unit_elem<float>(u, j) : unit_elem<TB>(u, j);
}

template <typename TX, typename TH, typename TD, int PACKS>
__global__ void __launch_bounds__((bwd_reg_threads<TX, TH, TD, PACKS>()), 1) rms_norm_bwd_reg_kernel(const BwdArgs a) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(TX));
  using HPack = Pack<TH, VEC>;
  using DPack = Pack<TD, VEC>;
  constexpr int EU = VEC * 4 / 16;  // 16-byte units of an fp32 pack (a 16-bit pack uses the first half)
  extern __shared__ uint4 dyn_smem[];
  __shared__ float red[64];

  const int64_t M = a.M;
  const int N = static_cast<int>(a.N), NV = N / VEC;
  const int tpr0 = a.tpr, lane0 = threadIdx.x % tpr0, rib = threadIdx.x / tpr0;
  const int64_t groups = (M + a.rpb - 1) / a.rpb;
  const bool has_extra = a.extra != nullptr;
  const bool want_dw = a.partial != nullptr || a.direct_dw;
  const float inv_n = 1.f / static_cast<float>(N);

  float dw[PACKS][VEC];
#pragma unroll
  for (int i = 0; i < PACKS; ++i)
#pragma unroll
    for (int j = 0; j < VEC; ++j) dw[i][j] = 0.f;

  HPack hc[PACKS], hn[PACKS];
  DPack dc[PACKS], dn[PACKS];
  float rs_n = 0.f;
  // Loads of row group g's row for this slot into (hn, dn, rs_n); zeros for rows past M (they then add nothing).
  auto load_next = [&](int64_t g) {
    int tpr = tpr0, lane = lane0;
    opaque(tpr, lane);  // per-pack addresses stay out of the loop's hoisting (as in the rows kernel)
    const int64_t row = g * a.rpb + rib;
    const bool valid = g < groups && row < M;
    rs_n = valid ? a.rstd[row] : 0.f;
    const TH* hr = static_cast<const TH*>(a.h) + (valid ? row : 0) * a.h_stride;
    const TD* dr = static_cast<const TD*>(a.dy) + (valid ? row : 0) * a.dy_stride;
#pragma unroll
    for (int i = 0; i < PACKS; ++i) {
      const int v = lane + i * tpr;
      if (valid && v < NV) {
        ld_units<TH, HPack::kUnits>(hn[i].u, hr + v * VEC);
        ld_units<TD, DPack::kUnits>(dn[i].u, dr + v * VEC);
      } else {
#pragma unroll
        for (int k = 0; k < HPack::kUnits; ++k) hn[i].u[k] = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int k = 0; k < DPack::kUnits; ++k) dn[i].u[k] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
  };

  int parity = 0;
  int64_t g = blockIdx.x;
  load_next(g);
  for (; g < groups; g += gridDim.x) {
    int tpr = tpr0, lane = lane0;
    const int64_t row = g * a.rpb + rib;
    const bool valid = row < M;
#pragma unroll
    for (int i = 0; i < PACKS; ++i) {
      hc[i] = hn[i];
      dc[i] = dn[i];
    }
    const float rs = rs_n;
    // Next row first: its loads stay in flight through this row's reduction and dx.
    load_next(g + gridDim.x);
    opaque(tpr, lane);
    bool has[PACKS];
#pragma unroll
    for (int i = 0; i < PACKS; ++i) has[i] = lane + i * tpr < NV;
    float dot = 0.f;  // one accumulator, not VEC: registers are the budget here
#pragma unroll
    for (int i = 0; i < PACKS; ++i) {
      if (has[i]) {
        float s[VEC];
        load_scale<TX, VEC>(s, a.w, a.w_f32, a.offset, (lane + i * tpr) * VEC, N, true);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float xhat = hc[i].f(j) * rs;
          const float d = dc[i].f(j);
          dot += d * s[j] * xhat;
          dw[i][j] += d * xhat;  // rows past M: h = dy = 0 (and rs = 0): adds 0
        }
      }
    }
    const float c = row_reduce_sum(dot, tpr, red, parity) * inv_n;
    if (valid) {
      char* dxr = dx_row<TX>(a, row);
      const void* er = has_extra ? extra_row<TX>(a, row) : nullptr;
#pragma unroll
      for (int i = 0; i < PACKS; ++i) {
        const int v = lane + i * tpr;
        if (has[i]) {
          // dh_extra is read here, after the reduction: loaded earlier it spilled (the next row's packs are live).
          uint4 ev[EU];
          if (has_extra) {
            if (a.extra_f32) {
              ld_units<float, EU>(ev, static_cast<const float*>(er) + v * VEC);
            } else {
              ev[0] = ld16<Ld::Stream>(reinterpret_cast<const uint4*>(static_cast<const TX*>(er) + v * VEC));
            }
          }
          float s[VEC], o[VEC];
          load_scale<TX, VEC>(s, a.w, a.w_f32, a.offset, v * VEC, N, true);
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const float xhat = hc[i].f(j) * rs;
            o[j] = rs * (dc[i].f(j) * s[j] - xhat * c);
            if (has_extra) o[j] += elem_rt<TX>(ev, a.extra_f32, j);
          }
          if (a.dx_f32) {
            Pack<float, VEC> p;
#pragma unroll
            for (int j = 0; j < VEC; ++j) p.v[j] = o[j];
            uint4* dst = reinterpret_cast<uint4*>(reinterpret_cast<float*>(dxr) + v * VEC);
#pragma unroll
            for (int k = 0; k < Pack<float, VEC>::kUnits; ++k) dst[k] = p.u[k];
          } else {
            Pack<TX, VEC> p;
#pragma unroll
            for (int j = 0; j < VEC; ++j) p.v[j] = from_float<TX>(o[j]);
            *reinterpret_cast<uint4*>(reinterpret_cast<TX*>(dxr) + v * VEC) = p.u[0];
          }
        }
      }
    }
  }
  if (!want_dw) return;
  const int tpr = tpr0, lane = lane0;
  bool has[PACKS];
#pragma unroll
  for (int i = 0; i < PACKS; ++i) has[i] = lane + i * tpr < NV;

  // dW: one fp32 row per CTA (or dW itself when the grid is one CTA). Several row slots: summed in smem, slot order.
  auto put = [&](int col, float val) {  // direct dW, weight dtype
    if (a.w_f32) {
      static_cast<float*>(a.dw)[col] = val;
    } else {
      static_cast<TX*>(a.dw)[col] = from_float<TX>(val);
    }
  };
  if (a.rpb == 1) {
    float* prow = a.direct_dw ? nullptr : a.partial + static_cast<int64_t>(blockIdx.x) * a.pstride;
#pragma unroll
    for (int i = 0; i < PACKS; ++i) {
      const int v = lane + i * tpr;
      if (has[i]) {
        if (a.direct_dw) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) put(v * VEC + j, dw[i][j]);
        } else {
#pragma unroll
          for (int k = 0; k < VEC / 4; ++k)
            reinterpret_cast<float4*>(prow + v * VEC)[k] =
                make_float4(dw[i][4 * k], dw[i][4 * k + 1], dw[i][4 * k + 2], dw[i][4 * k + 3]);
        }
      }
    }
    return;
  }
  float4* sm = reinterpret_cast<float4*>(dyn_smem);  // [rpb][N / 4]
  const int n4 = N / 4;
#pragma unroll
  for (int i = 0; i < PACKS; ++i) {
    const int v = lane + i * tpr;
    if (has[i])
#pragma unroll
      for (int k = 0; k < VEC / 4; ++k)
        sm[rib * n4 + v * (VEC / 4) + k] = make_float4(dw[i][4 * k], dw[i][4 * k + 1], dw[i][4 * k + 2], dw[i][4 * k + 3]);
  }
  __syncthreads();
  float4* prow = a.direct_dw ? nullptr : reinterpret_cast<float4*>(a.partial + static_cast<int64_t>(blockIdx.x) * a.pstride);
  for (int q = threadIdx.x; q < n4; q += blockDim.x) {
    float4 t = sm[q];
    for (int r = 1; r < a.rpb; ++r) {
      const float4 u = sm[r * n4 + q];
      t.x += u.x;
      t.y += u.y;
      t.z += u.z;
      t.w += u.w;
    }
    if (a.direct_dw) {
      put(4 * q, t.x);
      put(4 * q + 1, t.y);
      put(4 * q + 2, t.z);
      put(4 * q + 3, t.w);
    } else {
      prow[q] = t;
    }
  }
}

// ---- host ------------------------------------------------------------------------------------------------------

// FUSED_MLP_RMS_NORM_BWD = auto | reg | legacy [,packs=1|2], read once per process ("dynamic" at the first read:
// re-read at every call, so one process can A/B the kernels). auto: the rows / wide kernels (the register kernel
// measured no faster on the H200: 0.77-1.0x of the rows kernel's time, -- docs/tuning-log.md#rmsnorm-bwd-reg);
// reg: the register kernel wherever it applies (aligned rows, N % VEC == 0, N <= its limit); legacy: = auto. packs: force PACKS (ignored where it cannot hold the row or exceeds the register budget).
struct BwdKnob {
  enum Mode { kAuto, kReg, kLegacy };
  Mode mode = kAuto;
  int packs = 0;
};

inline BwdKnob parse_bwd_knob(const char* e) {
  BwdKnob k;
  if (e == nullptr) return k;
  const std::string s(e);
  const std::string head = s.substr(0, s.find(','));
  if (head == "reg") k.mode = BwdKnob::kReg;
  else if (head == "legacy") k.mode = BwdKnob::kLegacy;
  if (const size_t at = s.find(",packs="); at != std::string::npos) k.packs = std::atoi(s.c_str() + at + 7);
  return k;
}

inline BwdKnob bwd_knob() {
  static const char* const first = std::getenv("FUSED_MLP_RMS_NORM_BWD");
  static const bool dynamic = first != nullptr && std::strncmp(first, "dynamic", 7) == 0;
  static const BwdKnob fixed = parse_bwd_knob(first);
  return dynamic ? parse_bwd_knob(std::getenv("FUSED_MLP_RMS_NORM_BWD")) : fixed;
}

struct BwdRegConfig {
  int packs = 1, tpr = 1, rpb = 1;
  int threads() const { return tpr * rpb; }
};

// PACKS, threads per row and row slots per CTA for rows of NV packs; false when the register kernel cannot hold it.
// `max_threads(packs)`: the variant's launch bound. 1 pack by default: 64 registers and 50% occupancy beat 2 packs
// at the spill-free 512-thread bound on paper (H200 A/B pending) -- docs/tuning-log.md#rmsnorm-bwd-reg
template <typename F>
bool bwd_reg_config(int64_t NV, int max_packs, int forced, F&& max_threads, BwdRegConfig& c) {
  const int packs = forced == 2 && max_packs >= 2 ? 2 : 1;
  const int64_t need = (NV + packs - 1) / packs;
  if (NV < 1 || need > max_threads(packs)) return false;
  c.packs = packs;
  c.tpr = need <= 32 ? next_pow2(need) : static_cast<int>((need + 31) / 32 * 32);
  c.rpb = c.tpr >= 256 ? 1 : 256 / c.tpr;  // CTAs of >= 256 threads: short rows share a CTA
  return true;
}

// Launches the register kernel for (TX, TH, TD) when the knob and the layout allow it; false: the caller takes the
// rows / wide kernels. Sets a.partial (allocating `partial`) and partial_rows when dW goes through partial rows.
template <typename TX, typename TH, typename TD>
bool launch_bwd_reg(BwdArgs& a, const DeviceInfo& info, int dev, cudaStream_t stream, bool want_dw,
                    const Tensor& like, Tensor& partial, int& partial_rows) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(TX));
  const BwdKnob knob = bwd_knob();
  if (knob.mode != BwdKnob::kReg || !a.vec_ok || a.N % VEC != 0) return false;
  const int64_t NV = a.N / VEC;
  BwdRegConfig c;
  auto max_threads = [](int packs) {
    return packs == 2 ? bwd_reg_threads<TX, TH, TD, 2>() : bwd_reg_threads<TX, TH, TD, 1>();
  };
  if (!bwd_reg_config(NV, bwd_reg_max_packs<TX, TH, TD>(), knob.packs, max_threads, c)) return false;
  const void* kern = nullptr;
  if (c.packs == 2) {
    if constexpr (bwd_reg_max_packs<TX, TH, TD>() >= 2)
      kern = reinterpret_cast<const void*>(&rms_norm_bwd_reg_kernel<TX, TH, TD, 2>);
  } else {
    kern = reinterpret_cast<const void*>(&rms_norm_bwd_reg_kernel<TX, TH, TD, 1>);
  }
  if (kern == nullptr || kernel_spills(kern, dev)) return false;  // sm_100 / sm_120 allocate differently
  const int64_t smem = c.rpb > 1 && want_dw ? static_cast<int64_t>(c.rpb) * a.N * 4 : 0;
  if (smem > smem_budget(info)) return false;
  const int occ = blocks_per_sm(kern, c.threads(), smem, dev);
  if (occ <= 0) return false;
  const int64_t groups = (a.M + c.rpb - 1) / c.rpb;
  const int grid = static_cast<int>(std::min<int64_t>(groups, static_cast<int64_t>(info.sms) * occ));
  a.tpr = c.tpr;
  a.rpb = c.rpb;
  a.prefetch = false;
  a.dw_smem = false;
  a.direct_dw = want_dw && grid == 1;
  a.partial = nullptr;
  partial_rows = grid;
  if (want_dw && !a.direct_dw) {
    partial = fused_mlp::empty({grid, a.pstride}, kFloat, like);
    a.partial = static_cast<float*>(partial.data_ptr());
  }
  if (c.packs == 2) {
    if constexpr (bwd_reg_max_packs<TX, TH, TD>() >= 2)
      rms_norm_bwd_reg_kernel<TX, TH, TD, 2><<<grid, c.threads(), static_cast<size_t>(smem), stream>>>(a);
  } else {
    rms_norm_bwd_reg_kernel<TX, TH, TD, 1><<<grid, c.threads(), static_cast<size_t>(smem), stream>>>(a);
  }
  FM_KERNEL_LAUNCH_CHECK();
  return true;
}
