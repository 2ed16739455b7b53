#!/usr/bin/env python3
"""The tile schedule of the sm_90 CUTLASS GEMMs (kernels_src/cuda/sm90_sched.cuh): CTA swizzle x raster order for
the addmm/Linear epilogue kernel and the gated GEMM forward (and with --gated-bwd its backward), against torch.mm of
the same shape, in one process.

    python benchmarks/sm90_schedule.py --out /tmp/sched.csv            # ~30 s on an H200

Each (kernel, shape, schedule) is captured into a CUDA graph of --calls calls with FUSED_MLP_SM90_SCHED set for that
schedule (the launchers read it at every call, so the graph keeps it); bench_lib.cuda_graph_times replays the graphs
of one shape in interleaved rounds. Prints TFLOP/s, the ratio to the first schedule listed (swizzle 1 with CUTLASS's
raster heuristic, the default before stop 56) and to torch.mm; writes one CSV row per cell. Decides kDefaultSched /
kDefaultSchedBwd in addmm_sm90.cu / gated_gemm_sm90.cu.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_lib as bl  # noqa: E402

VAR = "FUSED_MLP_SM90_SCHED"
SCHEDULES = ["swizzle=1,raster=h", "swizzle=2,raster=h", "swizzle=4,raster=h", "swizzle=8,raster=h",
             "swizzle=1,raster=m", "swizzle=1,raster=n", "swizzle=4,raster=m", "swizzle=4,raster=n",
             "swizzle=8,raster=m", "swizzle=8,raster=n"]
# addmm (M, K, N: x [M, K] @ W[N, K]^T + b, tanh-GeLU) and the gated forward (T, H, I: [T, H] @ [H, 2I])
ADDMM = [(4096, 4096, 4096), (8192, 2048, 8192), (8192, 4096, 14336), (4096, 4096, 14336)]
GATED = [(4096, 2048, 8192), (8192, 2048, 8192), (4096, 2048, 16384), (4096, 4096, 14336)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--kernel", help="checkout path or Hub repo id (default: this checkout)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--schedules", help="';'-separated subset of the schedules ('default': the kernels' own, "
                    "FUSED_MLP_SM90_SCHED unset)")
    ap.add_argument("--addmm", help="addmm shapes M,K,N;M,K,N;... (default: the four above; '' for none)")
    ap.add_argument("--gated", help="gated forward shapes T,H,I;... (default: the four above; '' for none)")
    ap.add_argument("--gated-bwd", default="", help="gated backward shapes T,H,I;... (gated_gemm_bwd_: dy [T, H] @ "
                    "w_down [H, I], dGeGLU in the epilogue; default none)")
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        sys.exit("needs an sm_90 GPU")
    fm = bl.load_kernel(args.kernel)
    ops = fm._ops.ops
    scheds = args.schedules.split(";") if args.schedules else SCHEDULES
    dt = torch.bfloat16
    rows = []

    def with_sched(sched: str, fn):
        def call():
            if sched == "default":  # the kernels' own kDefaultSched
                return fn()
            os.environ[VAR] = sched
            try:
                return fn()
            finally:
                os.environ.pop(VAR, None)
        return call

    def shapes(arg, dflt):
        return dflt if arg is None else [tuple(int(v) for v in s.split(",")) for s in arg.split(";") if s]

    cases = [("addmm", s) for s in shapes(args.addmm, ADDMM)] + [("gated_fwd", s) for s in shapes(args.gated, GATED)] \
        + [("gated_bwd", s) for s in shapes(args.gated_bwd, [])]
    for kind, shape in cases:
        g = torch.Generator(device="cuda").manual_seed(0)
        if kind == "addmm":
            m, k, n = shape
            x = torch.randn(m, k, device="cuda", dtype=dt, generator=g)
            w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dt)
            b = torch.randn(n, device="cuda", dtype=dt, generator=g)
            ops._addmm_sm90_mode(2)  # on: the CUTLASS kernel at every shape here
            op = lambda: fm.addmm(b, x, w.t(), activation="gelu_tanh")  # noqa: E731
            ref = lambda: x @ w.t()  # noqa: E731
            flop = 2.0 * m * k * n
        elif kind == "gated_bwd":
            t, h, i = shape
            dy = torch.randn(t, h, device="cuda", dtype=dt, generator=g)
            wd = (torch.randn(h, i, device="cuda", generator=g) / i**0.5).to(dt)
            gate = torch.randn(t, i, device="cuda", dtype=dt, generator=g)
            up = torch.randn(t, i, device="cuda", dtype=dt, generator=g)
            # gate / up are overwritten with dgate / dup by every call: the values change, the work does not
            op = lambda: ops.gated_gemm_bwd_(dy, wd, gate, up, "gelu_tanh")  # noqa: E731
            ref = lambda: dy @ wd  # noqa: E731
            x = dy
            flop = 2.0 * t * h * i
        else:
            t, h, i = shape
            x = torch.randn(t, h, device="cuda", dtype=dt, generator=g)
            wg = (torch.randn(i, h, device="cuda", generator=g) / h**0.5).to(dt)
            wu = (torch.randn(i, h, device="cuda", generator=g) / h**0.5).to(dt)
            wgu = torch.cat([wg, wu]).t()
            op = lambda: ops.gated_gemm_fwd(x, wg, wu, "gelu_tanh", False)  # noqa: E731
            ref = lambda: x @ wgu  # noqa: E731
            flop = 2.0 * t * h * 2 * i
        fns = {s: with_sched(s, op) for s in scheds}
        fns["torch.mm"] = ref
        with torch.no_grad():
            times = bl.cuda_graph_times(fns, calls=args.calls, rounds=args.rounds)
        ops._addmm_sm90_mode(-1)
        base = times[scheds[0]].p50
        mm = times["torch.mm"].p50
        print(f"\n{kind} {shape}: TFLOP/s, vs {scheds[0]}, vs torch.mm")
        for s, tm in times.items():
            tf = flop / tm.p50 / 1e9
            print(f"  {s:22s} {tf:7.1f} {base / tm.p50:6.3f} {mm / tm.p50:6.3f}")
            rows.append({"kind": kind, "shape": "x".join(map(str, shape)), "schedule": s, "ms": f"{tm.p50:.5f}",
                         "tflops": f"{tf:.1f}", "vs_default": f"{base / tm.p50:.4f}", "vs_mm": f"{mm / tm.p50:.4f}"})
        del x, fns
        torch.cuda.empty_cache()
    if args.out and rows:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
