#!/usr/bin/env python3
"""Gated MLP: the cuBLAS path of ``gated_mlp`` vs the CUTLASS GEMM-epilogue kernels (kernels_src/cuda/
gated_gemm_sm90.cu) vs torch.compile of the plain bf16 MLP, forward and forward+backward, on an sm_90 GPU.

    python benchmarks/epilogue.py --out benchmarks/results/nvidia-h200            # every shape (~3 min on an H200)
    python benchmarks/epilogue.py --quick --out /tmp/epi                          # T=4096, H=2048, I=16384 only
    python benchmarks/epilogue.py --shapes llama --out /tmp/epi                   # Llama MLPs (SwiGLU), T 512-16384

Providers (``FUSED_MLP_GEMM_EPILOGUE`` set per call): ``cublas`` (off: cuBLAS GEMMs + the activation kernels),
``epilogue`` (on: both fused kernels), ``epilogue_fwd`` / ``epilogue_bwd`` (fwd+bwd only: one of the two fused),
``torch_compile``. The dispatch table ``fused_mlp._epilogue.DISPATCH`` is filled from this CSV.

Per (H, I, T) and provider: median time (``triton.testing.do_bench`` through bench_lib.Timer: L2 flushed before
each call), absolute peak memory of one call (weights and inputs included, as the anchors were measured), and the
max error against the fp32 reference (``gated_mlp_reference``) next to the same-dtype eager error (2x rule).
fwd+bwd calls backward with a fixed dy and drops the gradients between calls. Writes ``--out/epilogue.csv`` (the
project's long format, bench_lib.COLUMNS) and prints a table with ratios (fused / cuBLAS path).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_lib as bl  # noqa: E402

FULL = [(2048, 16384, (512, 1024, 2048, 4096)), (3072, 24576, (512, 4096)), (4096, 14336, (512, 4096))]
QUICK = [(2048, 16384, (4096,))]
SMOKE = [(64, 96, (37,))]
# The Llama family (SwiGLU): Llama-3.2-1B, Llama-3.2-3B, Llama-3-8B MLP shapes, prefill-sized token counts.
LLAMA = [(2048, 8192, (512, 2048, 4096, 16384)), (3072, 8192, (512, 4096, 16384)), (4096, 14336, (512, 4096, 16384))]
# The GEMM-epilogue targets (H200, bf16, T=4096, H=2048, I=16384): docs/targets.md#geglu-mlp-gemm-epilogue-kernels.
TARGETS = {"fwd": 1.22, "fwd_bwd": 3.75}
TARGET_PEAK_GB = 2.0


def eager_mlp(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor,
              act: str = "gelu_tanh") -> torch.Tensor:
    """The plain-PyTorch MLP in the model's dtype (what torch.compile is given; the module's forward)."""
    g = F.linear(x, wg)
    a = F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh" if act == "gelu_tanh" else "none")
    return F.linear(a * F.linear(x, wu), wd)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for epilogue.csv")
    ap.add_argument("--quick", action="store_true", help="only T=4096, H=2048, I=16384")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile provider")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds per shape (default 5)")
    ap.add_argument("--kernel", default=None, help="checkout path or Hub repo id (default: this checkout)")
    ap.add_argument("--shapes", choices=["gemma", "llama"], default="gemma",
                    help="gemma: the GeGLU shapes of the targets (default); llama: the Llama family's MLPs")
    ap.add_argument("--activation", default=None, choices=["gelu_tanh", "gelu", "silu"],
                    help="default: gelu_tanh for --shapes gemma, silu for llama")
    ap.add_argument("--only", default=None, help="keep only these (H, T) of the shape set: 'H:T,T;H:T' (e.g. "
                    "'4096:4096,16384')")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script itself (on a CPU the "
                    "fused providers fall back to the cuBLAS path: only the script is checked)")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        print("epilogue.py needs a CUDA GPU (--smoke runs tiny shapes on the CPU)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    fm = bl.load_kernel(args.kernel, backend=None if device == "cuda" else "cpu")
    env = bl.collect_env(device, fm)
    slug = bl.device_slug(env)
    csv_name = "epilogue_llama.csv" if args.shapes == "llama" else "epilogue.csv"
    writer = bl.ResultWriter(args.out / csv_name, env, merge=False, mirror=bl.out_mirror(slug, csv_name))
    timer = bl.Timer(device, warmup_ms=10.0, rep_ms=60.0)
    dtype = torch.bfloat16
    act = args.activation or ("silu" if args.shapes == "llama" else "gelu_tanh")
    t_start = time.perf_counter()
    table = []
    # One compiled function for every shape (dynamic=True): two compilations in all (inference, training) instead
    # of two per shape, which keeps the whole run near 3 minutes.
    compiled = None if args.no_compile else torch.compile(eager_mlp, dynamic=True)
    shapes = SMOKE if args.smoke else LLAMA if args.shapes == "llama" else QUICK if args.quick else FULL
    if args.only:
        keep = {int(h): {int(t) for t in ts.split(",")} for h, ts in (p.split(":") for p in args.only.split(";"))}
        shapes = [(h, i, tuple(t for t in ts if t in keep[h])) for h, i, ts in shapes if h in keep]
    for h, i, tokens in shapes:
        g = torch.Generator(device=device).manual_seed(0)
        wg = torch.randn(i, h, device=device, generator=g).mul_(h ** -0.5).to(dtype).requires_grad_()
        wu = torch.randn(i, h, device=device, generator=g).mul_(h ** -0.5).to(dtype).requires_grad_()
        wd = torch.randn(h, i, device=device, generator=g).mul_(i ** -0.5).to(dtype).requires_grad_()
        for t in tokens:
            x = torch.randn(t, h, device=device, generator=g).to(dtype).requires_grad_()
            dy = torch.randn(t, h, device=device, generator=g).to(dtype)
            params = [x, wg, wu, wd]
            # fp32 reference and the same-dtype eager error, for y (fwd) and dx (fwd_bwd)
            xr = x.detach().float().requires_grad_()
            y32 = fm.gated_mlp_reference(xr, wg.detach(), wu.detach(), wd.detach(), activation=act)
            y32.backward(dy.float())
            dx32 = xr.grad
            xe = x.detach().clone().requires_grad_()
            ye = eager_mlp(xe, wg, wu, wd, act)
            ye.backward(dy)
            err_eager = {"fwd": bl.max_abs_err(ye, y32), "fwd_bwd": bl.max_abs_err(xe.grad, dx32)}
            for p in params:
                p.grad = None
            del ye, xe, xr

            def with_mode(m):
                def run(xx):
                    os.environ["FUSED_MLP_GEMM_EPILOGUE"] = m
                    return fm.gated_mlp(xx, wg, wu, wd, activation=act)
                return run

            providers = {"cublas": with_mode("off"), "epilogue": with_mode("on"),
                         "epilogue_fwd": with_mode("fwd"), "epilogue_bwd": with_mode("bwd")}
            if compiled is not None:
                providers["torch_compile"] = lambda xx: compiled(xx, wg, wu, wd, act)
            shape = {"H": h, "I": i, "T": t}
            # Phase 1: per (provider, mode) a warm-up call (compilation happens there), the error and the peak.
            entries = []
            for name, fn in providers.items():
                for mode in ("fwd", "fwd_bwd"):
                    if mode == "fwd" and name in ("epilogue_fwd", "epilogue_bwd"):
                        continue
                    grads = params

                    if mode == "fwd":
                        def call(fn=fn):
                            with torch.no_grad():
                                return fn(x)
                    else:
                        def call(fn=fn):
                            fn(x).backward(dy)

                    c0 = time.perf_counter()
                    out = call()
                    bl.synchronize(device)
                    first_s = time.perf_counter() - c0
                    err = bl.max_abs_err(out, y32) if mode == "fwd" else bl.max_abs_err(x.grad, dx32)
                    for p in grads:
                        p.grad = None
                    del out
                    peak = bl.peak_memory(call, device)
                    for p in grads:
                        p.grad = None
                    entries.append(dict(name=name, mode=mode, call=call, err=err, peak=peak, first_s=first_s,
                                        p50s=[]))
            # Phase 2: timings in interleaved rounds (the order rotates), so clock drift over the run hits every
            # provider alike; each row reports the 20/50/80th percentiles of its rounds' medians.
            for r in range(args.rounds):
                k = r % len(entries)
                for e in entries[k:] + entries[:k]:
                    e["p50s"].append(timer.time(e["call"], grad_to_none=params).p50)
                    for p in params:
                        p.grad = None
            for e in entries:
                name, mode, err, peak, first_s = e["name"], e["mode"], e["err"], e["peak"], e["first_s"]
                vals = sorted(e["p50s"])
                tm = bl.Timing(*(bl._percentile(vals, q) for q in bl.QUANTILES))
                flops = 2 * t * h * i * 3 * (3 if mode == "fwd_bwd" else 1)
                ok = bl.two_x_rule(err, err_eager[mode], dtype)
                row = dict(op="gated_mlp_epilogue", provider=name, role="ours" if name != "torch_compile"
                           else "anchor", source="measured", mode=mode, dtype="bf16", shape=bl.shape_str(shape),
                           H=h, I=i, T=t, time_p20_ms=tm.p20, time_p50_ms=tm.p50, time_p80_ms=tm.p80,
                           flops=flops, tflops=flops / tm.p50 / 1e9, peak_mem_bytes=peak, max_err=err,
                           max_err_eager=err_eager[mode], verified=ok, status="ok" if ok else "fails 2x rule",
                           compile_s=first_s if name == "torch_compile" else None,
                           note=f"activation={act}; {args.rounds} interleaved rounds; schedule "
                                f"{os.environ.get('FUSED_MLP_GATED_GEMM_SCHEDULE', 'default')}")
                writer.add(**row)
                table.append(row)
                peak_s = f"{peak / 1e9:6.3f} GB" if peak is not None else "   n/a"
                bl.log(f"H={h} I={i} T={t} {name:13s} {mode:7s} {tm.p50:8.4f} ms  peak {peak_s}  "
                       f"err {err:.3g} (eager {err_eager[mode]:.3g}){'' if ok else '  FAILS 2x rule'}")
            writer.checkpoint()
            del x, dy, y32, dx32, params
        del wg, wu, wd
        if device == "cuda":
            torch.cuda.empty_cache()

    os.environ.pop("FUSED_MLP_GEMM_EPILOGUE", None)
    # ratios: fused / cublas and fused / torch_compile per (shape, mode, fused provider)
    bl.log(f"\n{'H':>5} {'I':>6} {'T':>5} {'mode':8} {'provider':13} {'cublas ms':>10} {'fused ms':>10} "
           f"{'compile ms':>10} {'fus/cub':>8} {'fus/comp':>8} {'peak GB':>8}")
    by = {(r["H"], r["I"], r["T"], r["mode"], r["provider"]): r for r in table}
    for (h, i, t, mode, prov), r in by.items():
        if not prov.startswith("epilogue"):
            continue
        cub = by.get((h, i, t, mode, "cublas"))
        comp = by.get((h, i, t, mode, "torch_compile"))
        tt = r["time_p50_ms"]
        ct = cub["time_p50_ms"] if cub else float("nan")
        pt = comp["time_p50_ms"] if comp else float("nan")
        line = (f"{h:5d} {i:6d} {t:5d} {mode:8} {prov:13} {ct:10.4f} {tt:10.4f} {pt:10.4f} {tt / ct:8.3f} "
                f"{tt / pt:8.3f} {(r['peak_mem_bytes'] or 0) / 1e9:8.3f}")
        if (h, i, t) == (2048, 16384, 4096):
            line += f"   target <= {TARGETS[mode]} ms, peak <= {TARGET_PEAK_GB} GB"
        bl.log(line)
    bl.log(f"\nwrote {args.out / csv_name} in {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
