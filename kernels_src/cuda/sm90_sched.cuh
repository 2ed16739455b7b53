// The tile scheduler of the sm_90 persistent CUTLASS GEMMs (addmm_sm90.cu, gated_gemm_sm90.cu): the CTA swizzle
// (groups of 1 / 2 / 4 / 8 tiles that run together, so they share A and B panels in L2) and the raster order (the
// dimension the persistent CTAs walk first). FUSED_MLP_SM90_SCHED = "swizzle=S[,raster=h|m|n]" overrides a kernel's
// default; it is read at every call (a getenv: these GEMMs run for tens of microseconds or more), so a benchmark can
// A/B it in one process -- docs/tuning-log.md#sm90-tile-schedule
#pragma once

#include <cstdlib>
#include <cstring>

namespace fused_mlp::cuda {

struct Sm90Sched {
  int swizzle;  // 1, 2, 4 or 8
  int raster;   // 0: CUTLASS's heuristic (along M when there are more tile columns than rows), 1: along M, 2: along N
};

inline Sm90Sched sm90_sched(Sm90Sched dflt) {
  const char* e = std::getenv("FUSED_MLP_SM90_SCHED");
  if (e == nullptr || *e == '\0') return dflt;
  Sm90Sched s = dflt;
  if (const char* p = std::strstr(e, "swizzle=")) {
    const int v = std::atoi(p + 8);
    if (v == 1 || v == 2 || v == 4 || v == 8) s.swizzle = v;
  }
  if (const char* p = std::strstr(e, "raster=")) s.raster = p[7] == 'm' ? 1 : p[7] == 'n' ? 2 : 0;
  return s;
}

// The kernel's TileSchedulerArguments (CUTLASS's static persistent scheduler: max_swizzle_size, raster_order).
template <class Args>
Args sm90_sched_args(Sm90Sched s) {
  Args a{};
  a.max_swizzle_size = s.swizzle;
  using R = decltype(a.raster_order);
  a.raster_order = s.raster == 1 ? R::AlongM : s.raster == 2 ? R::AlongN : R::Heuristic;
  return a;
}

}  // namespace fused_mlp::cuda
