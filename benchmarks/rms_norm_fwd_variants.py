#!/usr/bin/env python3
"""RMSNorm forward kernel variants side by side with the anchors, per call as the sweep times them: the inference
ops (``rms_norm_infer``, ``rms_norm_add_infer`` with ``--add``) under each ``FUSED_MLP_RMS_NORM_FWD`` value, against
``torch.compile`` of the plain definition (the token dimension dynamic, as in sweep.py), Liger-Kernel where
importable and a device copy of the same bytes (``y.copy_(x)``; with ``--add`` two copies), all timed with the
sweep's timer (``triton.testing.do_bench``, the L2 flushed before each call) in interleaved rounds in one process
(the host is noisy). TB/s over x read + y written (+ the residual read and h written). The evidence behind the
forward's kernel choice per shape class (docs/tuning-log.md#rmsnorm-fwd-variants).

    python benchmarks/rms_norm_fwd_variants.py                          # bf16, the default shapes
    python benchmarks/rms_norm_fwd_variants.py --add --shapes 4096x16384 --variants 'auto,ld=1;reg,packs=4'

Output: a table of TB/s per shape and the ratio of every variant to ``auto``; CSV
``benchmarks/results/<device>/rms_norm_fwd_variants.csv`` (one row per op, shape and provider). CUDA only.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lib import ROOT, ResultWriter, Timer, collect_env, combine_rounds, device_slug, load_kernel, log, out_mirror  # noqa: E402

ENV = "FUSED_MLP_RMS_NORM_FWD"
EPS = 1e-6
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SHAPES = "4096x8192,4096x16384,4096x32768,8192x8192,8192x16384,16384x8192,32768x8192"
VARIANTS = "auto,ld=1;reg,packs=8;reg,packs=8,ld=1;reg,packs=4;reg,packs=4,ld=1;lean,packs=2;lean,packs=2,ld=1;" \
           "lean,packs=4;lean,packs=4,ld=1"


def _anchors(add: bool, n: int, dt: torch.dtype) -> dict[str, object]:
    """Callables (x, r, w) -> outputs of the anchors that load here: torch.compile of the plain definition (M
    dynamic) and Liger."""
    out: dict[str, object] = {}
    if add:
        def plain(x, r, w):
            h = x + r
            return F.rms_norm(h, (n,), w, EPS), h
    else:
        def plain(x, r, w):
            return F.rms_norm(x, (n,), w, EPS)
    out["torch.compile"] = torch.compile(plain, dynamic=True)
    try:
        if add:
            from liger_kernel.transformers.fused_add_rms_norm import LigerFusedAddRMSNorm as Lig
        else:
            from liger_kernel.transformers.rms_norm import LigerRMSNorm as Lig
        lig = Lig(n, eps=EPS).to("cuda", dt)
        out["liger"] = (lambda x, r, w: lig(x, r)) if add else (lambda x, r, w: lig(x))
        out["_liger_mod"] = lig
    except Exception as e:  # noqa: BLE001
        log(f"liger not measured ({type(e).__name__}: {e})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", default=None, help="checkout path or Hub id (default: this checkout)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--add", action="store_true", help="the fused residual add + norm (rms_norm_add_infer)")
    ap.add_argument("--shapes", default=SHAPES, help="comma list of MxN")
    ap.add_argument("--variants", default=VARIANTS,
                    help="semicolon list of knob values besides auto (a knob that does not apply to a shape runs "
                         "what auto would: compare the ratios, not the names)")
    ap.add_argument("--no-anchors", action="store_true", help="variants and the copy only")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--rep-ms", type=float, default=25.0, help="do_bench time per provider and round")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        log("CUDA only: nothing to measure on this machine")
        return 0
    os.environ["FUSED_MLP_KNOBS_DYNAMIC"] = "1"  # the knob is re-read at every call
    os.environ[ENV] = "dynamic"
    fm = load_kernel(args.kernel)
    ops = fm._ops.ops
    dt = DTYPES[args.dtype]
    env = collect_env("cuda", fm)
    op_name = "add_rms_norm_infer" if args.add else "rms_norm_infer"
    out = args.out or ROOT / "benchmarks" / "results" / device_slug(env) / "rms_norm_fwd_variants.csv"
    writer = ResultWriter(out, env, merge=True, key=lambda r: (r["op"], r["dtype"], r["shape"], r["provider"]),
                          mirror=out_mirror(device_slug(env), "rms_norm_fwd_variants.csv"))
    timer = Timer("cuda")
    x0 = torch.randn(64, 1024, device="cuda", dtype=dt)
    ops.rms_norm_infer(x0, x0[0], EPS, 0.0, False)  # the knob's first read: "dynamic"
    for spec in args.shapes.split(","):
        m, n = (int(v) for v in spec.lower().split("x"))
        x = torch.randn(m, n, device="cuda", dtype=dt)
        r = torch.randn(m, n, device="cuda", dtype=dt)
        w = 1 + 0.25 * torch.randn(n, device="cuda", dtype=dt)
        ref_h = (x.float() + r.float()).to(dt) if args.add else x
        ref = (ref_h.float() * torch.rsqrt(ref_h.float().pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(dt)
        fns: dict[str, object] = {}
        for knob in ["auto", *[v for v in args.variants.split(";") if v and v != "auto"]]:
            if args.add:
                def call(knob=knob):
                    os.environ[ENV] = knob
                    return ops.rms_norm_add_infer(x, r, w, EPS, 0.0, False)
            else:
                def call(knob=knob):
                    os.environ[ENV] = knob
                    return ops.rms_norm_infer(x, w, EPS, 0.0, False)
            y = call()
            y = y[0] if isinstance(y, (tuple, list)) else y
            err = (y.float() - ref.float()).abs().max().item()
            if err > 2 * torch.finfo(dt).eps * ref.float().abs().max().item():  # one rounding of the same fp32 math
                raise SystemExit(f"{spec} {knob}: max error {err:.3g} against the fp32 reference")
            fns[knob] = call
        ya, yb = torch.empty_like(x), torch.empty_like(x)
        fns["copy"] = (lambda: (ya.copy_(x), yb.copy_(r))) if args.add else (lambda: ya.copy_(x))
        anchors = {} if args.no_anchors else _anchors(args.add, n, dt)
        lig_mod = anchors.pop("_liger_mod", None)
        if lig_mod is not None:
            with torch.no_grad():
                lig_mod.weight.copy_(w)
        with torch.no_grad():
            for name, fn in anchors.items():
                fns[name] = (lambda fn=fn: fn(x, r, w))
                fns[name]()  # compile / JIT outside the timed rounds
            rounds: dict[str, list] = {k: [] for k in fns}
            for i in range(args.rounds):
                order = list(fns) if i % 2 == 0 else list(reversed(fns))
                for k in order:
                    rounds[k].append(timer.time(fns[k], warmup_ms=5, rep_ms=args.rep_ms))
        os.environ[ENV] = "auto"
        times = {k: combine_rounds(v) for k, v in rounds.items()}
        nbytes = (4 if args.add else 2) * m * n * x.element_size()
        tb = {k: nbytes / (t.p50 * 1e-3) / 1e12 for k, t in times.items()}
        for name, t in times.items():
            role = "ours" if name not in ("copy", *anchors) else ("ceiling" if name == "copy" else "anchor")
            writer.add(op=op_name, provider=name, role=role, mode="fwd", dtype=args.dtype, shape=f"M={m},N={n}",
                       M=m, N=n, time_p20_ms=t.p20, time_p50_ms=t.p50, time_p80_ms=t.p80, bytes=nbytes,
                       gbps=tb[name] * 1000, best_anchor="auto", speedup_vs_best_anchor=times["auto"].p50 / t.p50,
                       note=(f"{ENV}={name}; " if role == "ours" else "")
                       + f"do_bench per call (L2 flushed), {args.rounds} interleaved rounds")
        writer.checkpoint()
        log(f"{op_name} M={m} N={n} TB/s: " + " | ".join(f"{k} {v:.2f}" for k, v in tb.items()))
        del x, r, w, fns, anchors
        torch.cuda.empty_cache()
    log(f"CSV: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
