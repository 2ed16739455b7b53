// RMSNorm backward, register path ("bwd reg"): included by rms_norm.cu at the end of its anonymous namespace, after
// the helpers it uses (Pack, ld16, load_scale, row_reduce_sum, launder_pack, BwdArgs, DeviceInfo, blocks_per_sm,
// kernel_spills, next_pow2). Not a standalone header.
//
// Aligned rows only (every base pointer and row stride 16-byte aligned, N % VEC == 0, so every pack is whole):
//   persistent grid (SMs x resident CTAs, from the occupancy query), each CTA loops over its row groups; a thread
//   owns PACKS fixed 16-byte column packs (lane + i * tpr) of one row slot and keeps its dW partial sums for them in
//   fp32 REGISTERS across all its rows (no smem traffic per row). Per row: the row's h / dy packs (PF: the next row's,
//   issued before this row's reduction and held in a second register buffer), dW += dy * xhat, the row dot product
//   sum(dy * s * xhat) (shuffles + one smem round when a row spans warps; in a cluster, + one exchange through
//   distributed smem), and dx = rs * (dy * s - xhat * dot / N) + dh_extra. At the end the CTA sums its row slots
//   (smem, fixed order, once) and writes one fp32 partial row (a cluster: one row, each CTA its slice);
//   rms_norm_dw_column_sum_kernel reduces the partial rows in a fixed order (bitwise reproducible).
// Rows beyond one CTA (sm_90+): a thread-block cluster of C = 2, 4 or 8 CTAs holds the row, each CTA a slice of
//   nvc = ceil(NV / C) packs, and loops over the rows of its cluster.
// Config (host): auto (sm_90, 16-byte h and dy packs: 16-bit h and dy, or fp32 x) takes PACKS = 4 single-buffered,
//   or 2 where over a fifth of a row's thread slots would idle (bf16 N = 2304), and the fewest CTAs per cluster whose
//   slices fit 512 threads (bf16 N <= 16384: one CTA; 32768: 2; 65536: 4; 131072: 8; beyond: the wide kernel); fp32 x
//   only without a cluster. Threads per row tpr = ceil(nvc / PACKS) (a power of two below 32 without a cluster, else
//   whole warps), rpb = 256 / tpr row slots for short rows. Knob FUSED_MLP_RMS_NORM_BWD (below) forces the others.
//   Register budget (ptxas sm_90, CUDA 13.0, docs/tuning-log.md#rmsnorm-bwd-reg): 4 packs single-buffered 128
//   registers at __launch_bounds__(512, 1), 0 spills (double-buffered it spilled 188 B: no such variant); 2 packs 87 /
//   117 (double-buffered); 1 pack with 16-byte packs 64 at (1024, 1), fp32 h or dy with a 16-bit x 91-112 at 512.
//   Shared memory: 272 B static, dynamic rpb * N * 4 (the row slots' dW sum, short rows) checked against the budget.
#pragma once

// Largest PACKS for (TX, TH, TD): 4 when the h and dy packs are one 16-byte unit each, else 1 (register budget).
template <typename TX, typename TH, typename TD>
constexpr int bwd_reg_max_packs() {
  constexpr int vec = 16 / static_cast<int>(sizeof(TX));
  return vec * sizeof(TH) == 16 && vec * sizeof(TD) == 16 ? 4 : 1;
}

// Does the (PACKS, PF) variant exist for (TX, TH, TD)? 1 pack double-buffered everywhere; 2 packs either way and 4
// packs single-buffered only with 16-byte h and dy packs (register budget, header).
template <typename TX, typename TH, typename TD, int PACKS, bool PF>
constexpr bool bwd_reg_variant() {
  if constexpr (PACKS == 1) return PF;
  else if constexpr (PACKS == 2) return bwd_reg_max_packs<TX, TH, TD>() >= 2;
  else return PACKS == 4 && !PF && bwd_reg_max_packs<TX, TH, TD>() >= 4;  // double-buffered: 188 B of spills
}

// Threads per CTA the variant is compiled for (its __launch_bounds__; see the register budget above).
template <typename TX, typename TH, typename TD, int PACKS, bool PF>
constexpr int bwd_reg_threads() {
  constexpr int vec = 16 / static_cast<int>(sizeof(TX));
  return PACKS == 1 && PF && vec * sizeof(TH) == 16 && vec * sizeof(TD) == 16 ? 1024 : 512;
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

// (offset + w) for each of a thread's P whole packs of an aligned row (pack i at column (lane + i * tpr) * VEC);
// zeros for packs past the row.
template <typename TX, int VEC, int P>
__device__ __forceinline__ void load_scale_packs(float (&s)[P][VEC], const BwdArgs& a, const bool (&has)[P], int lane,
                                                 int tpr, int N) {
#pragma unroll
  for (int i = 0; i < P; ++i) {
    if (has[i]) {
      load_scale<TX, VEC>(s[i], a.w, a.w_f32, a.offset, (lane + i * tpr) * VEC, N, true);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) s[i][j] = 0.f;
    }
  }
}

template <typename TX, typename TH, typename TD, int PACKS, bool PF>
__global__ void __launch_bounds__((bwd_reg_threads<TX, TH, TD, PACKS, PF>()), 1)
    rms_norm_bwd_reg_kernel(const BwdArgs a) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(TX));
  using HPack = Pack<TH, VEC>;
  using DPack = Pack<TD, VEC>;
  constexpr int EU = VEC * 4 / 16;  // 16-byte units of an fp32 pack (a 16-bit pack uses the first half)
  extern __shared__ uint4 dyn_smem[];
  __shared__ float red[64];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ float cl_part[2];  // this CTA's row sum, read by the cluster's other CTAs (double-buffered by row)
#endif

  const int64_t M = a.M;
  const int N = static_cast<int>(a.N), NV = N / VEC;
  const int tpr0 = a.tpr, lane0 = threadIdx.x % tpr0, rib = threadIdx.x / tpr0;
  // In a cluster of 2^c_shift CTAs every CTA holds the slice [col0, col0 + nvc) of the packs of the cluster's row.
  const int cs = a.c_shift;
  const int64_t cid = static_cast<int64_t>(blockIdx.x >> cs), ncl = static_cast<int64_t>(gridDim.x >> cs);
  const int col0 = cs > 0 ? static_cast<int>(blockIdx.x & ((1u << cs) - 1u)) * a.nvc : 0;
  const int nvc = cs > 0 ? min(a.nvc, NV - col0) : NV;  // <= 0 only for a forced cluster wider than the row
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
  // Loads of row group g's row for this slot into (hv, dv, rs); zeros for rows past M (they then add nothing).
  auto load_row = [&](int64_t g, HPack (&hv)[PACKS], DPack (&dv)[PACKS], float& rs) {
    int tpr = tpr0, lane = lane0;
    opaque(tpr, lane);  // per-pack addresses stay out of the loop's hoisting (as in the rows kernel)
    const int64_t row = g * a.rpb + rib;
    const bool valid = g < groups && row < M;
    rs = valid ? a.rstd[row] : 0.f;
    const TH* hr = static_cast<const TH*>(a.h) + (valid ? row : 0) * a.h_stride + col0 * VEC;
    const TD* dr = static_cast<const TD*>(a.dy) + (valid ? row : 0) * a.dy_stride + col0 * VEC;
#pragma unroll
    for (int i = 0; i < PACKS; ++i) {
      const int v = lane + i * tpr;
      if (valid && v < nvc) {
        ld_units<TH, HPack::kUnits>(hv[i].u, hr + v * VEC);
        ld_units<TD, DPack::kUnits>(dv[i].u, dr + v * VEC);
      } else {
#pragma unroll
        for (int k = 0; k < HPack::kUnits; ++k) hv[i].u[k] = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int k = 0; k < DPack::kUnits; ++k) dv[i].u[k] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
  };

  int parity = 0;
  int cpar = 0;
  int64_t g = cid;
  if constexpr (PF) load_row(g, hn, dn, rs_n);
  for (; g < groups; g += ncl) {
    int tpr = tpr0, lane = lane0;
    const int64_t row = g * a.rpb + rib;
    const bool valid = row < M;
    float rs;
    if constexpr (PF) {
#pragma unroll
      for (int i = 0; i < PACKS; ++i) {
        hc[i] = hn[i];
        dc[i] = dn[i];
      }
      rs = rs_n;
      // Next row first: its loads stay in flight through this row's reduction and dx.
      load_row(g + ncl, hn, dn, rs_n);
    } else {
      load_row(g, hc, dc, rs);
    }
    opaque(tpr, lane);
    bool has[PACKS];
#pragma unroll
    for (int i = 0; i < PACKS; ++i) has[i] = lane + i * tpr < nvc;
    float dot = 0.f;  // one accumulator, not VEC: registers are the budget here
#pragma unroll
    for (int i = 0; i < PACKS; ++i) {
      if (has[i]) {
        float s[VEC];
        load_scale<TX, VEC>(s, a.w, a.w_f32, a.offset, (col0 + lane + i * tpr) * VEC, N, true);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float xhat = hc[i].f(j) * rs;
          const float d = dc[i].f(j);
          dot += d * s[j] * xhat;
          dw[i][j] += d * xhat;  // rows past M: h = dy = 0 (and rs = 0): adds 0
        }
      }
    }
    // The dx pass unpacks h and dy again instead of keeping the unpacked fp32 values live through the reduction
    // (2 registers per 16-bit pair: 4 packs took 128 registers): see launder_pack.
#pragma unroll
    for (int i = 0; i < PACKS; ++i) {
      launder_pack(hc[i], a.zero);
      launder_pack(dc[i], a.zero);
    }
    float c = row_reduce_sum(dot, tpr, red, parity);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (cs > 0) {
      // The cluster's CTAs hold slices of one row: their sums meet in distributed shared memory, added in rank order
      // (a butterfly over lanes = ranks) so every CTA gets the same bits. cl_part alternates by row: a CTA writes
      // row k + 2's sum only after every CTA has passed row k + 1's barrier, i.e. finished reading row k's.
      namespace cg = cooperative_groups;
      const cg::cluster_group cl = cg::this_cluster();
      if (threadIdx.x == 0) cl_part[cpar] = c;
      cl.sync();
      const int l = threadIdx.x & 31;
      float p = l < (1 << cs) ? *cl.map_shared_rank(&cl_part[cpar], l) : 0.f;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) p += __shfl_xor_sync(0xffffffffu, p, o);
      c = p;
      cpar ^= 1;
    }
#else
    if (cs > 0) __trap();  // the host launches clusters on sm_90+ only
#endif
    c *= inv_n;
    if (valid) {
      char* dxr = dx_row<TX>(a, row);
      const void* er = has_extra ? extra_row<TX>(a, row) : nullptr;
#pragma unroll
      for (int i = 0; i < PACKS; ++i) {
        const int v = col0 + lane + i * tpr;
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
          store_full_pack_rt<TX, VEC>(dxr, a.dx_f32, v * VEC, o);
        }
      }
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (cs > 0) cooperative_groups::this_cluster().sync();  // no CTA leaves while its cl_part may still be read
#endif
  if (!want_dw) return;
  const int tpr = tpr0, lane = lane0;
  bool has[PACKS];
#pragma unroll
  for (int i = 0; i < PACKS; ++i) has[i] = lane + i * tpr < nvc;

  // dW: one fp32 row per CTA, or per cluster (each CTA its slice), or dW itself when the grid is one CTA. Several
  // row slots: summed in smem, slot order.
  auto put = [&](int col, float val) {  // direct dW, weight dtype
    if (a.w_f32) {
      static_cast<float*>(a.dw)[col] = val;
    } else {
      static_cast<TX*>(a.dw)[col] = from_float<TX>(val);
    }
  };
  if (a.rpb == 1) {
    float* prow = a.direct_dw ? nullptr : a.partial + cid * a.pstride;
#pragma unroll
    for (int i = 0; i < PACKS; ++i) {
      const int v = col0 + lane + i * tpr;
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

// FUSED_MLP_RMS_NORM_BWD = auto | reg | legacy | rg [,packs=1|2|4] [,cluster=2|4|8] [,pf=0|1] [,rows=2|4], read once
// per process (common.cuh knob_dynamic: at every call, so one process can A/B the kernels). auto: the rows / wide
// kernels (-- docs/tuning-log.md#rmsnorm-bwd-reg), on sm_90 the row-group kernel for rows of 128..768 packs;
// reg: the register kernel wherever it applies (aligned rows,
// N % VEC == 0, a row within its reach); legacy: = auto; rg: the row-group kernel wherever it applies (else as auto).
// packs: force PACKS (where the variant exists); cluster (sm_90+): force the cluster size; pf: double-buffer the next
// row in registers (2 packs only: 1 pack always does, 4 never); rows: rg's rows per group.
struct BwdKnob {
  enum Mode { kAuto, kReg, kLegacy, kRg };
  Mode mode = kAuto;
  int packs = 0;
  int rows = 0;  // rg: rows per group
  int cluster = 0;
  int pf = -1;
};

inline BwdKnob parse_bwd_knob(const char* e) {
  BwdKnob k;
  if (e == nullptr) return k;
  const std::string s(e);
  const std::string head = s.substr(0, s.find(','));
  if (head == "reg") k.mode = BwdKnob::kReg;
  else if (head == "legacy") k.mode = BwdKnob::kLegacy;
  else if (head == "rg") k.mode = BwdKnob::kRg;
  k.packs = knob_value(s, "packs", 0);
  k.rows = knob_value(s, "rows", 0);
  if (const int c = knob_value(s, "cluster", 0); c == 2 || c == 4 || c == 8) k.cluster = c;
  if (const int pf = knob_value(s, "pf", -1); pf >= 0) k.pf = pf != 0;
  return k;
}

inline BwdKnob bwd_knob() {
  static const char* const first = std::getenv("FUSED_MLP_RMS_NORM_BWD");
  static const bool dynamic = knob_dynamic(first);
  static const BwdKnob fixed = parse_bwd_knob(first);
  return dynamic ? parse_bwd_knob(std::getenv("FUSED_MLP_RMS_NORM_BWD")) : fixed;
}

struct BwdRegConfig {
  int packs = 1, tpr = 1, rpb = 1, csize = 1, c_shift = 0, nvc = 0;
  bool pf = true;
  int threads() const { return tpr * rpb; }
};

// PACKS, prefetch, cluster size, threads per row and row slots per CTA for rows of NV packs; false when the register
// kernel cannot hold the row. `max_threads(packs, pf)`: the variant's launch bound. Without forcing: 1 pack
// (double-buffered), and on sm_90 (`cluster_ok`) the fewest CTAs per cluster (2, 4, 8) whose slices fit.
template <typename F>
bool bwd_reg_config(int64_t NV, int max_packs, const BwdKnob& k, bool cluster_ok, F&& max_threads, BwdRegConfig& c) {
  if (NV < 1) return false;
  const int packs = (k.packs == 2 || k.packs == 4) && k.packs <= max_packs ? k.packs : 1;
  const bool pf = packs == 1 || (packs == 2 && k.pf > 0);  // 2 packs: single-buffered unless pf=1; 4: always
  const int limit = max_threads(packs, pf);
  int C = 1;
  if (k.cluster > 1) {
    if (!cluster_ok) return false;
    C = k.cluster;
  } else if ((NV + packs - 1) / packs > limit) {
    if (!cluster_ok) return false;
    for (C = 2; C <= 8 && ((NV + C - 1) / C + packs - 1) / packs > limit; C *= 2) {
    }
    if (C > 8) return false;
  }
  const int64_t nvc = (NV + C - 1) / C;
  const int64_t need = (nvc + packs - 1) / packs;
  if (need > limit) return false;
  c.packs = packs;
  c.pf = pf;
  c.csize = C;
  c.c_shift = C == 8 ? 3 : C == 4 ? 2 : C == 2 ? 1 : 0;
  c.nvc = static_cast<int>(nvc);
  c.tpr = C == 1 && need <= 32 ? next_pow2(need) : static_cast<int>((need + 31) / 32 * 32);
  c.rpb = C == 1 && c.tpr < 256 ? 256 / c.tpr : 1;  // CTAs of >= 256 threads: short rows share a CTA
  return true;
}

int reg_active_clusters(const void* kernel, int threads, int csize, int dev);  // below (the forward's launcher)

// The register kernel's (PACKS, PF) variant for (TX, TH, TD) as a launchable pointer; null where it does not exist.
template <typename TX, typename TH, typename TD>
const void* bwd_reg_kernel_ptr(int packs, bool pf) {
  const void* k = nullptr;
  auto pick = [&](auto pk, auto pft) {
    constexpr int P = decltype(pk)::value;
    constexpr bool F = decltype(pft)::value;
    if constexpr (bwd_reg_variant<TX, TH, TD, P, F>())
      if (packs == P && pf == F) k = reinterpret_cast<const void*>(&rms_norm_bwd_reg_kernel<TX, TH, TD, P, F>);
  };
  using I1 = std::integral_constant<int, 1>;
  using I2 = std::integral_constant<int, 2>;
  using I4 = std::integral_constant<int, 4>;
  using T = std::true_type;
  using Fl = std::false_type;
  pick(I1{}, T{});
  pick(I2{}, T{});
  pick(I2{}, Fl{});
  pick(I4{}, Fl{});
  return k;
}

template <typename TX, typename TH, typename TD>
constexpr int bwd_reg_max_threads(int packs, bool pf) {
  if (packs == 1 && pf) return bwd_reg_threads<TX, TH, TD, 1, true>();
  return 512;
}

// Launches the register kernel for (TX, TH, TD) when the knob and the layout allow it; false: the caller takes the
// rows / wide kernels. Sets a.partial (allocating `partial`) and partial_rows when dW goes through partial rows.
template <typename TX, typename TH, typename TD>
bool launch_bwd_reg(BwdArgs& a, const DeviceInfo& info, int dev, cudaStream_t stream, bool want_dw,
                    const Tensor& like, Tensor& partial, int& partial_rows) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(TX));
  constexpr int kMaxPacks = bwd_reg_max_packs<TX, TH, TD>();
  const BwdKnob knob = bwd_knob();
  // auto: the register kernel on sm_90 where h and dy packs are 16 bytes (the measured cases); else the rows / wide
  // kernels, as with legacy.
  // rg (forced) where the row-group kernel does not apply: as auto.
  const bool autoish = knob.mode == BwdKnob::kAuto || knob.mode == BwdKnob::kRg;
  const bool use = knob.mode == BwdKnob::kReg || (autoish && info.major == 9 && kMaxPacks >= 4);
  if (!use || !a.vec_ok || a.N % VEC != 0) return false;
  const int64_t NV = a.N / VEC;
  BwdRegConfig c;
  auto max_threads = [](int packs, bool pf) { return bwd_reg_max_threads<TX, TH, TD>(packs, pf); };
  if (autoish) {
    // 4 packs per thread, single-buffered; 2 where over a fifth of a row's thread slots would idle
    // (docs/tuning-log.md#rmsnorm-bwd-reg).
    BwdKnob k4, k2;
    k4.packs = 4;
    k2.packs = 2;
    if (!bwd_reg_config(NV, kMaxPacks, k4, true, max_threads, c)) return false;
    if (sizeof(TX) == 4 && c.csize > 1) return false;  // fp32 rows past one CTA: 0.96x the rows kernel at N = 16384
    auto idle = [](const BwdRegConfig& q) {
      return 1.0 - static_cast<double>((q.nvc + q.packs - 1) / q.packs) / q.tpr;
    };
    BwdRegConfig c2;
    if (idle(c) > 0.2 && bwd_reg_config(NV, kMaxPacks, k2, true, max_threads, c2) && c2.csize == c.csize &&
        idle(c2) < idle(c))
      c = c2;
  } else if (!bwd_reg_config(NV, kMaxPacks, knob, info.major >= 9, max_threads, c)) {
    return false;
  }
  const void* kern = bwd_reg_kernel_ptr<TX, TH, TD>(c.packs, c.pf);
  if (kern == nullptr || kernel_spills(kern, dev)) return false;  // sm_100 / sm_120 allocate differently
  const int64_t smem = c.rpb > 1 && want_dw ? static_cast<int64_t>(c.rpb) * a.N * 4 : 0;
  if (smem > smem_budget(info)) return false;
  int64_t grid = 0;
  if (c.csize > 1) {
    const int ncl = reg_active_clusters(kern, c.threads(), c.csize, dev);
    if (ncl < 1) return false;
    grid = std::min<int64_t>(a.M, ncl) * c.csize;
  } else {
    const int occ = blocks_per_sm(kern, c.threads(), smem, dev);
    if (occ <= 0) return false;
    const int64_t groups = (a.M + c.rpb - 1) / c.rpb;
    grid = std::min<int64_t>(groups, static_cast<int64_t>(info.sms) * occ);
  }
  a.tpr = c.tpr;
  a.rpb = c.rpb;
  a.nvc = c.nvc;
  a.c_shift = c.c_shift;
  a.prefetch = false;
  a.dw_smem = false;
  a.direct_dw = want_dw && grid == 1;
  a.partial = nullptr;
  partial_rows = static_cast<int>(grid / c.csize);  // one partial row per CTA, or per cluster
  if (want_dw && !a.direct_dw) {
    partial = fused_mlp::empty({partial_rows, a.pstride}, kFloat, like);
    a.partial = static_cast<float*>(partial.data_ptr());
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(grid), 1, 1);
  cfg.blockDim = dim3(static_cast<unsigned>(c.threads()), 1, 1);
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  if (c.csize > 1) {
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = static_cast<unsigned>(c.csize);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  void* args[] = {&a};
  FM_CUDA_CHECK(cudaLaunchKernelExC(&cfg, kern, args));
  return true;
}

// ---- row groups (bwd "rg") ---------------------------------------------------------------------------------------
// The register kernel holds PACKS packs of ONE row per thread and a dW sum per held element (4 packs: 32 fp32 sums,
// 128 registers, one 512-thread CTA per SM). Here a thread holds P packs of each of R consecutive rows (its columns
// are the same in every row), so one set of P * VEC dW sums serves R rows: the same bytes in flight per thread at a
// quarter of the sums (P = 1, R = 4: 8 sums), hence more warps per SM. One CTA = one row's packs (tpr = ceil(NV / P)
// threads in whole warps, <= 768), persistent over groups of R rows; the R row dot products reduce together
// (shuffles, one smem round, one barrier per group, fixed order). dW: the CTA's partial row, written by the thread
// that owns each column (no smem). 16-byte h and dy packs only (16-bit h = dy = x, or fp32 throughout), aligned
// rows, no cluster. Registers: docs/tuning-log.md#rmsnorm-bwd-rg.
// Rows of up to 768 * P packs: 768 threads at 80 registers use 61440 of an SM's 65536; a variant whose CTA does not
// fit (P = 2 at 104 registers past 608 threads) fails the occupancy check in launch_bwd_rg and is not taken.
constexpr int kBwdRgMaxThreads = 768;

// `zero` as a value that depends on `after`: packs laundered with it are unpacked only once `after` exists.
__device__ __forceinline__ uint32_t rg_after(uint32_t zero, float after) {
  asm volatile("" : "+r"(zero) : "f"(after));
  return zero;
}

template <int R>
__device__ __forceinline__ void rg_reduce(float (&v)[R], float* red, int& parity) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v[r] += __shfl_xor_sync(0xffffffffu, v[r], o);
  const int warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  float* s = red + parity * (kBwdRgMaxThreads / 32) * R;  // double-buffered: one barrier per group
  parity ^= 1;
  if ((threadIdx.x & 31) == 0)
#pragma unroll
    for (int r = 0; r < R; ++r) s[warp * R + r] = v[r];
  __syncthreads();
#pragma unroll
  for (int r = 0; r < R; ++r) v[r] = 0.f;
  for (int w = 0; w < nw; ++w)
#pragma unroll
    for (int r = 0; r < R; ++r) v[r] += s[w * R + r];
}

template <typename TX, int P, int R, int REGS>
__global__ void __maxnreg__(REGS) rms_norm_bwd_rg_kernel(const BwdArgs a) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(TX));
  using XPack = Pack<TX, VEC>;
  constexpr int EU = VEC * 4 / 16;  // 16-byte units of an fp32 pack
  __shared__ float red[2 * (kBwdRgMaxThreads / 32) * R];
  const int64_t M = a.M;
  const int N = static_cast<int>(a.N), NV = N / VEC;
  const int tpr = static_cast<int>(blockDim.x), lane = static_cast<int>(threadIdx.x);
  const int64_t groups = (M + R - 1) / R;
  const bool has_extra = a.extra != nullptr;
  const float inv_n = 1.f / static_cast<float>(N);
  bool has[P];
#pragma unroll
  for (int i = 0; i < P; ++i) has[i] = lane + i * tpr < NV;

  float dw[P][VEC];
#pragma unroll
  for (int i = 0; i < P; ++i)
#pragma unroll
    for (int j = 0; j < VEC; ++j) dw[i][j] = 0.f;

  int parity = 0;
  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {
    XPack hv[R][P], dv[R][P];
    float rs[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t row = g * R + r;
      const bool valid = row < M;
      rs[r] = valid ? a.rstd[row] : 0.f;
      const TX* hr = static_cast<const TX*>(a.h) + (valid ? row : 0) * a.h_stride;
      const TX* dr = static_cast<const TX*>(a.dy) + (valid ? row : 0) * a.dy_stride;
#pragma unroll
      for (int i = 0; i < P; ++i) {
        const int v = lane + i * tpr;
        const bool ok = valid && has[i];
        hv[r][i].u[0] = ok ? ld16<Ld::Stream>(reinterpret_cast<const uint4*>(hr + v * VEC)) : make_uint4(0u, 0u, 0u, 0u);
        dv[r][i].u[0] = ok ? ld16<Ld::Stream>(reinterpret_cast<const uint4*>(dr + v * VEC)) : make_uint4(0u, 0u, 0u, 0u);
      }
    }
    // Row by row: row r's packs are unpacked only after row r - 1's sums exist (rg_after), so one row's fp32 values
    // are live at a time instead of all R rows' (ptxas hoisted every unpack: 119 registers at P = 1, R = 4).
    float s[P][VEC];
    load_scale_packs<TX>(s, a, has, lane, tpr, N);
    float dot[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      dot[r] = 0.f;
      const uint32_t z = rg_after(a.zero, r > 0 ? dot[r > 0 ? r - 1 : 0] : 0.f);
#pragma unroll
      for (int i = 0; i < P; ++i) {
        launder_pack(hv[r][i], z);
        launder_pack(dv[r][i], z);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float xhat = hv[r][i].f(j) * rs[r];
          const float d = dv[r][i].f(j);
          dot[r] += d * s[i][j] * xhat;
          dw[i][j] += d * xhat;  // rows past M and packs past the row: h = dy = 0 (and rs = 0): adds 0
        }
      }
    }
    rg_reduce<R>(dot, red, parity);
    float last = 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t row = g * R + r;
      if (row >= M) break;
      const float c = dot[r] * inv_n;
      const uint32_t z = rg_after(a.zero, last);
      char* dxr = dx_row<TX>(a, row);
      const void* er = has_extra ? extra_row<TX>(a, row) : nullptr;
#pragma unroll
      for (int i = 0; i < P; ++i) {
        if (!has[i]) continue;
        const int v = lane + i * tpr;
        launder_pack(hv[r][i], z);
        launder_pack(dv[r][i], z);
        uint4 ev[EU];
        if (has_extra) {
          if (a.extra_f32) {
            ld_units<float, EU>(ev, static_cast<const float*>(er) + v * VEC);
          } else {
            ev[0] = ld16<Ld::Stream>(reinterpret_cast<const uint4*>(static_cast<const TX*>(er) + v * VEC));
          }
        }
        float o[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float xhat = hv[r][i].f(j) * rs[r];
          o[j] = rs[r] * (dv[r][i].f(j) * s[i][j] - xhat * c);
          if (has_extra) o[j] += elem_rt<TX>(ev, a.extra_f32, j);
        }
        last = o[VEC - 1];
        store_full_pack_rt<TX, VEC>(dxr, a.dx_f32, v * VEC, o);
      }
    }
  }
  if (a.partial == nullptr && !a.direct_dw) return;
  // dW: this CTA's partial row (or dW itself for a one-CTA grid); each column belongs to exactly one thread.
#pragma unroll
  for (int i = 0; i < P; ++i) {
    if (!has[i]) continue;
    const int v = lane + i * tpr;
    if (a.direct_dw) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        if (a.w_f32) {
          static_cast<float*>(a.dw)[v * VEC + j] = dw[i][j];
        } else {
          static_cast<TX*>(a.dw)[v * VEC + j] = from_float<TX>(dw[i][j]);
        }
      }
    } else {
      float* prow = a.partial + static_cast<int64_t>(blockIdx.x) * a.pstride + v * VEC;
#pragma unroll
      for (int k = 0; k < VEC / 4; ++k)
        reinterpret_cast<float4*>(prow)[k] = make_float4(dw[i][4 * k], dw[i][4 * k + 1], dw[i][4 * k + 2], dw[i][4 * k + 3]);
    }
  }
}

// The (P, R) variant for TX as a launchable pointer; null where it does not exist.
template <typename TX>
const void* bwd_rg_kernel_ptr(int packs, int rows) {
  const void* k = nullptr;
  if (packs == 1 && rows == 2) k = reinterpret_cast<const void*>(&rms_norm_bwd_rg_kernel<TX, 1, 2, 72>);
  if (packs == 1 && rows == 4) k = reinterpret_cast<const void*>(&rms_norm_bwd_rg_kernel<TX, 1, 4, 80>);
  if (packs == 2 && rows == 2) k = reinterpret_cast<const void*>(&rms_norm_bwd_rg_kernel<TX, 2, 2, 104>);
  return k;
}

// Launches the row-group kernel for (TX, TH, TD) when the knob (or auto) picks it and the layout allows it; false:
// the caller takes the other kernels. Sets a.partial (allocating `partial`) and partial_rows when dW goes through
// partial rows.
template <typename TX, typename TH, typename TD>
bool launch_bwd_rg(BwdArgs& a, const DeviceInfo& info, int dev, cudaStream_t stream, bool want_dw, const Tensor& like,
                   Tensor& partial, int& partial_rows) {
  if constexpr (!std::is_same_v<TH, TX> || !std::is_same_v<TD, TX>) {
    return false;  // 16-byte h and dy packs of x's dtype only
  } else {
    constexpr int VEC = 16 / static_cast<int>(sizeof(TX));
    const BwdKnob knob = bwd_knob();
    if (!a.vec_ok || a.N % VEC != 0) return false;
    const int64_t NV = a.N / VEC;
    // auto: sm_90, rows of 128..768 packs, i.e. one pack per thread (bf16 N 1024..6144, fp32 512..3072; H100:
    // 1.03-1.22x the register kernel; bf16 at 2 packs per thread, N = 8192, 0.88x -- docs/tuning-log.md#rmsnorm-bwd-rg).
    const bool pick = knob.mode == BwdKnob::kRg ||
                      (knob.mode == BwdKnob::kAuto && info.major == 9 && NV >= 128 && NV <= kBwdRgMaxThreads);
    if (!pick) return false;
    // Packs per thread: the fewest whose row fits kBwdRgMaxThreads; rows per group: 4 at 1 pack, 2 at 2 (the knob's
    // ",packs=" / ",rows=" force others where the variant exists).
    const int packs = knob.packs == 1 || knob.packs == 2 ? knob.packs : NV <= kBwdRgMaxThreads ? 1 : 2;
    const int rows = knob.rows == 2 || knob.rows == 4 ? knob.rows : packs == 1 ? 4 : 2;
    const void* kern = bwd_rg_kernel_ptr<TX>(packs, rows);
    const int64_t threads = (NV + packs - 1) / packs;
    if (kern == nullptr || threads > kBwdRgMaxThreads || kernel_spills(kern, dev)) return false;
    const int tpr = static_cast<int>((threads + 31) / 32 * 32);
    const int occ = blocks_per_sm(kern, tpr, 0, dev);
    if (occ <= 0) return false;
    const int64_t groups = (a.M + rows - 1) / rows;
    const int64_t grid = std::min<int64_t>(groups, static_cast<int64_t>(info.sms) * occ);
    a.tpr = tpr;
    a.rpb = 1;
    a.prefetch = false;
    a.dw_smem = false;
    a.direct_dw = want_dw && grid == 1;
    a.partial = nullptr;
    partial_rows = static_cast<int>(grid);
    if (want_dw && !a.direct_dw) {
      partial = fused_mlp::empty({partial_rows, a.pstride}, kFloat, like);
      a.partial = static_cast<float*>(partial.data_ptr());
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned>(grid), 1, 1);
    cfg.blockDim = dim3(static_cast<unsigned>(tpr), 1, 1);
    cfg.stream = stream;
    void* args[] = {&a};
    FM_CUDA_CHECK(cudaLaunchKernelExC(&cfg, kern, args));
    return true;
  }
}

// ---- few rows (small-M training, M <= bwd_small_max_rows) --------------------------------------------------------
// One launch, no dW partial rows, no column-sum kernel: the grid's first `row_blocks` CTAs compute dx (one row group
// each: rpb rows of tpr threads, PACKS 16-byte packs per thread, the forward's few-rows layout), the rest compute
// dW, kBwdSmallColPacks column packs each over all M rows (blockDim / 32 row lanes, fp32 sums in registers, the
// lanes' sums added in lane order through shared memory: bitwise reproducible), written in the weight dtype. dW does
// not depend on the row dot products, so the two kinds of CTA share nothing; the dW CTAs re-read h and dy from L2.
// Aligned rows of whole packs only. PDL as the forward's few-rows kernel. Register budget: PACKS <= 4 h, dy and scale
// packs at __launch_bounds__(512) (<= 128 registers; ptxas: docs/tuning-log.md#rms-norm-bwd-small).
// Shared memory: static, 32 floats + (512 / 32) row lanes x kBwdSmallColPacks x 8 fp32 sums = 16.1 KB.
constexpr int kBwdSmallColPacks = 32;      // column packs per dW CTA (one per lane of a row lane's warp)
// auto: up to 128 rows, 256 for rows of >= 8 KB (H200 bf16, CUDA graphs: 0.26-0.73x the other kernels' time at
// M <= 128; at M = 256 0.61-0.81x at N = 4096 / 8192 and 1.19x at N = 2048).
constexpr int64_t bwd_small_max_rows(int64_t row_bytes) { return row_bytes >= 8192 ? 256 : 128; }
constexpr int kBwdSmallMaxThreads = 512;   // the kernel's __launch_bounds__

template <typename TX, typename TH, typename TD, int PACKS>
__global__ void __launch_bounds__(kBwdSmallMaxThreads) rms_norm_bwd_small_kernel(const BwdArgs a) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(TX));
  using HPack = Pack<TH, VEC>;
  using DPack = Pack<TD, VEC>;
  constexpr int EU = VEC * 4 / 16;  // 16-byte units of an fp32 pack
  constexpr int kCols = kBwdSmallColPacks * VEC;  // columns per dW CTA
  __shared__ float red[32];
  __shared__ __align__(16) float dws[kBwdSmallMaxThreads / 32][kBwdSmallColPacks * 8];
  const int N = static_cast<int>(a.N), NV = N / VEC;
  const int64_t M = a.M;

  pdl_wait_and_release();  // every global access below follows the previous grid (PDL launch)
  if (static_cast<int>(blockIdx.x) >= a.row_blocks) {
    // dW for columns [c0, c0 + kCols): lane = column pack, warp = row lane.
    const int cp = static_cast<int>(threadIdx.x) & 31, rl = static_cast<int>(threadIdx.x) >> 5;
    const int lanes = static_cast<int>(blockDim.x) >> 5;
    const int c0 = (static_cast<int>(blockIdx.x) - a.row_blocks) * kCols;
    const int v = c0 / VEC + cp;
    float acc[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = 0.f;
    if (v < NV) {
      const TH* hb = static_cast<const TH*>(a.h) + v * VEC;
      const TD* db = static_cast<const TD*>(a.dy) + v * VEC;
#pragma unroll 4
      for (int64_t r = rl; r < M; r += lanes) {
        HPack hv;
        DPack dv;
#pragma unroll
        for (int k = 0; k < HPack::kUnits; ++k)
          hv.u[k] = ld16<Ld::Keep>(reinterpret_cast<const uint4*>(hb + r * a.h_stride) + k);
#pragma unroll
        for (int k = 0; k < DPack::kUnits; ++k)
          dv.u[k] = ld16<Ld::Keep>(reinterpret_cast<const uint4*>(db + r * a.dy_stride) + k);
        const float rs = a.rstd[r];
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[j] += dv.f(j) * (hv.f(j) * rs);
      }
    }
    float4* mine = reinterpret_cast<float4*>(&dws[rl][cp * VEC]);
#pragma unroll
    for (int k = 0; k < VEC / 4; ++k) mine[k] = make_float4(acc[4 * k], acc[4 * k + 1], acc[4 * k + 2], acc[4 * k + 3]);
    __syncthreads();
    for (int e = static_cast<int>(threadIdx.x); e < kCols; e += static_cast<int>(blockDim.x)) {
      const int col = c0 + e;
      if (col >= N) break;
      float t = dws[0][e];
      for (int l = 1; l < lanes; ++l) t += dws[l][e];
      if (a.w_f32) {
        static_cast<float*>(a.dw)[col] = t;
      } else {
        static_cast<TX*>(a.dw)[col] = from_float<TX>(t);
      }
    }
    return;
  }

  // dx for one row slot: dx = rs * (dy * s - xhat * sum(dy * s * xhat) / N) + dh_extra.
  const int tpr = a.tpr;
  const int rib = static_cast<int>(threadIdx.x) >> a.tpr_shift;
  const int lane = static_cast<int>(threadIdx.x) - rib * tpr;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * a.rpb + rib;
  const bool valid = row < M;  // false only in the last block of short rows
  bool has[PACKS];
#pragma unroll
  for (int i = 0; i < PACKS; ++i) has[i] = valid && lane + i * tpr < NV;
  const float rs = valid ? a.rstd[row] : 0.f;
  const TH* hr = static_cast<const TH*>(a.h) + (valid ? row : 0) * a.h_stride;
  const TD* dr = static_cast<const TD*>(a.dy) + (valid ? row : 0) * a.dy_stride;
  HPack hv[PACKS];
  DPack dv[PACKS];
#pragma unroll
  for (int i = 0; i < PACKS; ++i) {
    const int v = lane + i * tpr;
#pragma unroll
    for (int k = 0; k < HPack::kUnits; ++k)
      hv[i].u[k] = has[i] ? ld16<Ld::Keep>(reinterpret_cast<const uint4*>(hr + v * VEC) + k)
                          : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int k = 0; k < DPack::kUnits; ++k)
      dv[i].u[k] = has[i] ? ld16<Ld::Keep>(reinterpret_cast<const uint4*>(dr + v * VEC) + k)
                          : make_uint4(0u, 0u, 0u, 0u);
  }
  float s[PACKS][VEC];
  load_scale_packs<TX>(s, a, has, lane, tpr, N);
  float dot = 0.f;
#pragma unroll
  for (int i = 0; i < PACKS; ++i)
#pragma unroll
    for (int j = 0; j < VEC; ++j) dot += dv[i].f(j) * s[i][j] * (hv[i].f(j) * rs);
  const float c = small_row_sum(dot, tpr, rib, red) * (1.f / static_cast<float>(N));
  if (!valid) return;  // after the block-wide reduction
  char* dxr = dx_row<TX>(a, row);
  const void* er = a.extra != nullptr ? extra_row<TX>(a, row) : nullptr;
#pragma unroll
  for (int i = 0; i < PACKS; ++i) {
    if (!has[i]) continue;
    const int v = lane + i * tpr;
    uint4 ev[EU];
    if (er != nullptr) {
      if (a.extra_f32) {
#pragma unroll
        for (int k = 0; k < EU; ++k)
          ev[k] = ld16<Ld::Stream>(reinterpret_cast<const uint4*>(static_cast<const float*>(er) + v * VEC) + k);
      } else {
        ev[0] = ld16<Ld::Stream>(reinterpret_cast<const uint4*>(static_cast<const TX*>(er) + v * VEC));
      }
    }
    float o[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float xhat = hv[i].f(j) * rs;
      o[j] = rs * (dv[i].f(j) * s[i][j] - xhat * c);
      if (er != nullptr) o[j] += elem_rt<TX>(ev, a.extra_f32, j);
    }
    store_full_pack_rt<TX, VEC>(dxr, a.dx_f32, v * VEC, o);
  }
}

// FUSED_MLP_RMS_NORM_BWD_SMALL = auto | on | off [,packs=1|2|4] (common.cuh: SmallKnob), read once per process
// (knob_dynamic: at every call). auto: M <= bwd_small_max_rows unless FUSED_MLP_RMS_NORM_BWD forces a kernel; on: every M
// (where the row fits); off: never.
inline SmallKnob rms_bwd_small_knob() {
  static const SmallKnobReader reader("FUSED_MLP_RMS_NORM_BWD_SMALL", "packs");
  return reader.get();
}

// Launches the few-rows backward for (TX, TH, TD) where the knob, M and the layout allow it; false: the caller takes
// the other kernels. dW (when wanted) is written directly.
template <typename TX, typename TH, typename TD>
bool launch_bwd_small(BwdArgs& a, const DeviceInfo& info, int dev, cudaStream_t stream, bool want_dw) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(TX));
  const SmallKnob k = rms_bwd_small_knob();
  if (k.mode == SmallKnob::kOff) return false;
  // auto: few rows, and only where FUSED_MLP_RMS_NORM_BWD leaves the choice (reg / legacy force those kernels).
  if (k.mode == SmallKnob::kAuto &&
      (a.M > bwd_small_max_rows(a.N * static_cast<int64_t>(sizeof(TX))) || bwd_knob().mode != BwdKnob::kAuto))
    return false;
  if (!a.vec_ok || a.N % VEC != 0 || a.M >= (int64_t{1} << 31)) return false;
  const int64_t NV = a.N / VEC;
  // Packs per thread: the fewest whose row fits 512 threads (1 / 2 / 4 packs: 0.75-0.9x the next larger count's time
  // at M = 1..128, bf16 N = 4096 / 8192, fp32 N = 4096); the knob's ",packs=" forces 1, 2 or 4 where the row fits.
  auto fits = [&](int p) { return (NV + p - 1) / p <= kBwdSmallMaxThreads; };
  const bool forced = (k.value == 1 || k.value == 2 || k.value == 4) && fits(k.value);
  const int packs = forced ? k.value : fits(1) ? 1 : fits(2) ? 2 : 4;
  SmallConfig sc;
  // The dW CTAs' row lanes are whole warps: the block must be too (small_config makes it so; checked, not assumed).
  if (!fits(packs) || !small_config(NV, a.M, info.sms, packs, sc) || sc.packs != packs ||
      sc.threads() > kBwdSmallMaxThreads || sc.threads() % 32 != 0)
    return false;
  const int64_t row_blocks = (a.M + sc.rpb - 1) / sc.rpb;
  const int64_t dw_blocks = want_dw ? (NV + kBwdSmallColPacks - 1) / kBwdSmallColPacks : 0;
  if (row_blocks + dw_blocks > INT32_MAX) return false;
  void (*kern)(BwdArgs) = nullptr;
  dispatch_int<1, 2, 4>(sc.packs, [&](auto pk) { kern = &rms_norm_bwd_small_kernel<TX, TH, TD, decltype(pk)::value>; });
  // Measured spill-free on sm_90 only; other architectures allocate differently.
  if (kernel_spills(reinterpret_cast<const void*>(kern), dev)) return false;
  a.tpr = sc.tpr;
  a.rpb = sc.rpb;
  a.tpr_shift = sc.tpr_shift;
  a.row_blocks = static_cast<int>(row_blocks);
  a.partial = nullptr;
  a.direct_dw = want_dw;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(row_blocks + dw_blocks), 1, 1);
  cfg.blockDim = dim3(static_cast<unsigned>(sc.threads()), 1, 1);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  if (small_pdl(info)) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  FM_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kern, a));
  return true;
}
