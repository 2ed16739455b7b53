#!/usr/bin/env python3
"""RMSNorm backward kernel variants side by side: the op alone (``rms_norm_bwd``: dx and dW from the saved rstd,
incl. the dW column sum) under each ``FUSED_MLP_RMS_NORM_BWD`` value, CUDA-graph device time in interleaved rounds
in one process (the host is noisy); TB/s over h + dy + dx. The evidence behind the backward's kernel choice
(docs/tuning-log.md#rmsnorm-bwd-reg).

    python benchmarks/rms_norm_bwd_variants.py                         # bf16, the default shapes
    python benchmarks/rms_norm_bwd_variants.py --dtype fp32 --shapes 16384x4096,4096x16384

Variants: ``legacy`` (rows / wide kernels), ``auto`` (what a user gets), ``reg,packs=2`` and ``reg,packs=4`` (the
register kernel forced), ``reg,packs=4,cluster=8`` for N >= 16384. Output: a table of TB/s and the ratio auto /
legacy per shape, CSV ``benchmarks/results/<device>/rms_norm_bwd_variants.csv``. CUDA only. ``--variants
'reg,packs=2;reg,packs=2,pf=1'`` compares chosen knob values (legacy and auto always run).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lib import ROOT, ResultWriter, collect_env, cuda_graph_times, device_slug, load_kernel, log, out_mirror  # noqa: E402

ENV = "FUSED_MLP_RMS_NORM_BWD"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SHAPES = "65536x1024,131072x512,4096x4096,16384x2048,32768x2048,32768x2304,16384x4096,8192x8192,32768x8192," \
         "32768x5376,4096x16384,16384x16384,2048x32768,4096x65536,1024x65536"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", default=None, help="checkout path or Hub id (default: this checkout)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--shapes", default=SHAPES, help="comma list of MxN")
    ap.add_argument("--calls", type=int, default=5, help="calls per graph (default 5)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    ap.add_argument("--variants", default=None,
                    help="semicolon list of knob values to compare, e.g. 'reg,packs=2;reg,packs=2,pf=1' (default: "
                         "legacy, auto, reg,packs=2, reg,packs=4, + reg,packs=4,cluster=8 for N >= 16384); legacy "
                         "and auto are always added (the ratios' references)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        log("CUDA only: nothing to measure on this machine")
        return 0
    # Knobs are read once per process unless FUSED_MLP_KNOBS_DYNAMIC=1 at the first read, or the first value starts
    # with "dynamic" (builds before the switch, e.g. --kernel of an older Hub revision): then at every call.
    os.environ["FUSED_MLP_KNOBS_DYNAMIC"] = "1"
    os.environ[ENV] = "dynamic"
    fm = load_kernel(args.kernel)
    ops = fm._ops.ops
    dt = DTYPES[args.dtype]
    env = collect_env("cuda", fm)
    out = args.out or ROOT / "benchmarks" / "results" / device_slug(env) / "rms_norm_bwd_variants.csv"
    writer = ResultWriter(out, env, merge=True, key=lambda r: (r["op"], r["dtype"], r["shape"]),
                          mirror=out_mirror(device_slug(env), "rms_norm_bwd_variants.csv"))
    x0 = torch.randn(64, 4096, device="cuda", dtype=dt)
    w0 = torch.ones(4096, device="cuda", dtype=dt)
    _, _, r0 = ops.rms_norm_fwd(x0, None, w0, 1e-6, 0.0, dt, None)
    ops.rms_norm_bwd(x0, x0, r0, w0, None, 0.0, dt, True)  # the knob's first read: "dynamic"
    for spec in args.shapes.split(","):
        m, n = (int(v) for v in spec.lower().split("x"))
        x = torch.randn(m, n, device="cuda", dtype=dt)
        w = 1 + 0.25 * torch.randn(n, device="cuda", dtype=dt)
        dy = torch.randn(m, n, device="cuda", dtype=dt)
        _, _, rstd = ops.rms_norm_fwd(x, None, w, 1e-6, 0.0, dt, None)
        extra = args.variants.split(";") if args.variants else \
            ["reg,packs=2", "reg,packs=4"] + (["reg,packs=4,cluster=8"] if n >= 16384 else [])
        variants = {v: v for v in ["legacy", "auto", *extra] if v}
        fns, ref = {}, None
        for name, knob in variants.items():
            def call(knob=knob):
                os.environ[ENV] = knob
                return ops.rms_norm_bwd(dy, x, rstd, w, None, 0.0, dt, True)

            dx, dw = call()
            if ref is None:
                ref = (dx.float(), dw.float())
            else:  # every variant computes the same values (fp32 math, one rounding; dW summed in another order)
                ex = (dx.float() - ref[0]).abs().max().item()
                ew = ((dw.float() - ref[1]).abs().max() / ref[1].abs().max().clamp_min(1e-30)).item()
                # fp32 dx and dW keep the summation-order differences (~sqrt(N) / sqrt(M) ulp); 16-bit rounds them away
                k, kw = (64, 64) if dt == torch.float32 else (4, 2)
                if ex > k * torch.finfo(dt).eps * ref[0].abs().max().item() or ew > kw * torch.finfo(dt).eps:
                    raise SystemExit(f"{spec} {name}: dx differs by {ex:.3g}, dW by {ew:.3g} (relative) from legacy")
            fns[name] = call
        times = cuda_graph_times(fns, calls=args.calls, rounds=args.rounds, warm_ms=10)
        os.environ[ENV] = "auto"
        nbytes = 3 * m * n * x.element_size()
        tb = {k: nbytes / (t.p50 * 1e-3) / 1e12 for k, t in times.items()}
        for name, t in times.items():
            writer.add(op="rms_norm_bwd_op", provider=name, role="ours", mode="bwd_graph", dtype=args.dtype,
                       shape=f"M={m},N={n}", M=m, N=n, time_p20_ms=t.p20, time_p50_ms=t.p50, time_p80_ms=t.p80,
                       bytes=nbytes, gbps=tb[name] * 1000, best_anchor="legacy",
                       speedup_vs_best_anchor=times["legacy"].p50 / t.p50,
                       note=f"{ENV}={variants[name]}; CUDA-graph device time, {args.calls} calls per graph")
        writer.checkpoint()
        log(f"M={m} N={n} TB/s: " + " | ".join(f"{k} {v:.2f}" for k, v in tb.items())
            + f" | auto/legacy {times['legacy'].p50 / times['auto'].p50:.2f}x")
        del x, dy, rstd, fns, ref
        torch.cuda.empty_cache()
    log(f"CSV: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
