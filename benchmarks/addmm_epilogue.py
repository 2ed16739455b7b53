#!/usr/bin/env python3
"""addmm / Linear forward with bias + GeLU on sm_90: the CUTLASS epilogue kernel (kernels_src/cuda/addmm_sm90.cu) vs
our cuBLASLt path vs torch's fused op, mm alone and the unfused eager form, in one process with interleaved rounds.

    python benchmarks/addmm_epilogue.py --out /tmp/addmm_epilogue.csv
    python benchmarks/addmm_epilogue.py --act gelu --layout conv1d --rounds 7 --out /tmp/a.csv

Providers (the sm_90 path is switched per provider with the private op ``_addmm_sm90_mode``, so one process serves
all): ``ours-cutlass`` (on, default config), ``ours-pingpong`` / ``ours-cooperative`` (on, that config),
``ours-cublaslt`` (off: cuBLASLt, FUSED_MLP_ADDMM_SM90=off), ``torch._addmm_activation`` (bias, x, W^T,
use_gelu=True: cuBLASLt's tanh-GeLU epilogue; only with --act gelu_tanh), ``torch.mm`` (x @ W^T alone, no bias, no
activation: the ceiling), ``unfused`` (F.gelu(F.linear(x, W, b))). Shapes are M x K x N (x [M, K], weight [N, K],
or [K, N] with --layout conv1d). Per round each provider runs --iters calls after a warm-up, in an order rotated
every round (a fixed order read the same kernel 14% apart in first and second place at 8192 x 4096 x 14336 on the
H200, where a round's sustained GEMMs lower the clock). ``--l2 cold`` (the default) zeroes a 256 MB buffer before
each call and times each call between its own two CUDA events, as the sweep's do_bench does and as a model's
distinct layers see their weights; ``--l2 warm`` times the --iters calls back to back between two events, on the
same operands (partly L2-resident: on an H100 that put the bias-only CUTLASS kernel ahead of cuBLASLt where the cold
timing has it 0.83-0.94x, docs/tuning-log.md#addmm-sm90-epilogue);
the table shows the median over rounds as TFLOP/s, the ratio to torch.mm and to torch._addmm_activation, and the
max |error| against an fp64 reference (torch.mm's error is against x @ W^T). Targets (issue 28):
ours-cutlass >= 0.98 x torch.mm and >= torch._addmm_activation at every shape, error <= torch's fused op.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_lib as bl  # noqa: E402

SHAPES = [(4096, 4096, 4096), (8192, 2048, 8192), (8192, 4096, 14336)]  # M x K x N (issue 28)
MODES = {"ours-cutlass": 2, "ours-pingpong": 3, "ours-cooperative": 4, "ours-cublaslt": 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="CSV file (or directory: addmm_epilogue.csv in it)")
    ap.add_argument("--kernel", help="checkout path or Hub repo id (default: this checkout)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--act", default="gelu_tanh", choices=["gelu_tanh", "gelu", "none"])
    ap.add_argument("--layout", default="linear", choices=["linear", "conv1d"])
    ap.add_argument("--shapes", help="M,K,N;M,K,N;... (default: the three issue-28 shapes)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--providers", help="comma-separated subset")
    ap.add_argument("--l2", default="cold", choices=["cold", "warm"],
                    help="cold: L2 flushed before every call (default); warm: back-to-back calls")
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        sys.exit("needs an sm_90 GPU")
    fm = bl.load_kernel(args.kernel)
    ops = fm._ops.ops
    dt = getattr(torch, args.dtype)
    act = None if args.act == "none" else args.act
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";")] if args.shapes else SHAPES
    torch.backends.cuda.matmul.allow_tf32 = False
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda") if args.l2 == "cold" else None
    rows = []
    try:
        for m, k, n in shapes:
            g = torch.Generator(device="cuda").manual_seed(0)
            x = torch.randn(m, k, device="cuda", dtype=dt, generator=g)
            w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dt)  # nn.Linear's [N, K]
            b = torch.randn(n, device="cuda", dtype=dt, generator=g)
            w_kn = w.t() if args.layout == "linear" else w.t().contiguous()  # the [K, N] operand as used
            w_t = w if args.layout == "linear" else w_kn.t()  # what F.linear takes

            def gelu(t: torch.Tensor) -> torch.Tensor:
                return t if act is None else F.gelu(t, approximate="tanh" if act == "gelu_tanh" else "none")

            providers = {name: (mode, lambda: fm.addmm(b, x, w_kn, activation=act)) for name, mode in MODES.items()}
            if act == "gelu_tanh":
                providers["torch._addmm_activation"] = (
                    None, lambda: torch._addmm_activation(b, x, w_kn, use_gelu=True))
            providers["torch.mm"] = (None, lambda: torch.mm(x, w_kn))
            providers["unfused"] = (None, lambda: gelu(F.linear(x, w_t, b)))
            if args.providers:
                keep = set(args.providers.split(","))
                providers = {p: v for p, v in providers.items() if p in keep}

            z64 = torch.mm(x.double(), w_kn.double())
            ref_mm, ref = z64, gelu(z64 + b.double())
            err = {}
            for name, (mode, fn) in providers.items():
                if mode is not None:
                    ops._addmm_sm90_mode(mode)
                out = fn()
                err[name] = (out.double() - (ref_mm if name == "torch.mm" else ref)).abs().max().item()
                del out
            del z64, ref_mm, ref
            times: dict[str, list[float]] = {p: [] for p in providers}
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(args.iters)]
            stops = [torch.cuda.Event(enable_timing=True) for _ in range(args.iters)]
            names = list(providers)
            for r in range(args.rounds):  # interleaved: every provider once per round, the order rotated per round
                for name in names[r % len(names):] + names[:r % len(names)]:
                    mode, fn = providers[name]
                    if mode is not None:
                        ops._addmm_sm90_mode(mode)
                    for _ in range(3):
                        fn()
                    if args.l2 == "cold":
                        for i in range(args.iters):
                            flush.zero_()
                            starts[i].record()
                            fn()
                            stops[i].record()
                        stops[-1].synchronize()
                        times[name].append(sum(a.elapsed_time(b) for a, b in zip(starts, stops)) / args.iters)
                        continue
                    start.record()
                    for _ in range(args.iters):
                        fn()
                    stop.record()
                    stop.synchronize()
                    times[name].append(start.elapsed_time(stop) / args.iters)
            flop = 2.0 * m * n * k
            med = {p: statistics.median(v) for p, v in times.items()}
            print(f"\n{m} x {k} x {n} (M x K x N), {args.dtype}, {args.act}, {args.layout}, L2 {args.l2}")
            print(f"  {'provider':26s} {'ms':>8s} {'TFLOP/s':>8s} {'/mm':>6s} {'/torch':>7s} {'max err':>10s}")
            for p, t in med.items():
                vs_mm = med["torch.mm"] / t if "torch.mm" in med else float("nan")
                vs_t = med["torch._addmm_activation"] / t if "torch._addmm_activation" in med else float("nan")
                print(f"  {p:26s} {t:8.4f} {flop / t / 1e9:8.1f} {vs_mm:6.3f} {vs_t:7.3f} {err[p]:10.3g}")
                rows.append({"M": m, "K": k, "N": n, "dtype": args.dtype, "act": args.act, "layout": args.layout,
                             "l2": args.l2,
                             "provider": p, "ms": f"{t:.5f}", "tflops": f"{flop / t / 1e9:.1f}",
                             "vs_mm": f"{vs_mm:.4f}", "vs_torch_fused": f"{vs_t:.4f}", "max_err": f"{err[p]:.4g}",
                             "rounds_ms": " ".join(f"{v:.5f}" for v in times[p])})
    finally:
        ops._addmm_sm90_mode(-1)
    if args.out and rows:
        out = args.out / "addmm_epilogue.csv" if args.out.is_dir() else args.out
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)
        print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
