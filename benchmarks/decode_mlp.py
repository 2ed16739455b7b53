#!/usr/bin/env python3
"""Gated MLP at decode sizes: the decode-class op ``gated_mlp_decode`` (kernels_src/cuda/gated_gemv.cu) vs the
cuBLAS path of ``gated_mlp`` vs Inductor vs eager PyTorch, CUDA-graph device time per MLP call (targets.md, row
"gated MLP at decode").

    python benchmarks/decode_mlp.py --check                                 # correctness only (~15 s on an H200)
    python benchmarks/decode_mlp.py --out benchmarks/results/nvidia-h200     # 3 shapes x 7 T (~2.5 min)
    python benchmarks/decode_mlp.py --quick --out /tmp/decode                # Gemma-2B shape, T in {1, 16, 64}

Providers (bf16, no_grad, inputs x [T, H] and the model's weights): ``ours`` (``fused_mlp.gated_mlp`` as a user
calls it: FUSED_MLP_DECODE_MLP=auto, the measured table picks the path), ``ours_decode`` (=on: the op at every T <= 64), ``ours_cublas`` (=off: cuBLAS GEMMs and the activation kernel),
``inductor`` (torch.compile of the plain MLP, one static-shape graph per T), ``eager`` (the plain MLP), and, unless
--no-variants, ``ours_decode:<tuning>`` rows: the op with FUSED_MLP_DECODE_TUNE set (work split, PDL), to pick the
table's entries from the same run.

Timing: each provider's call is captured 20 times into one CUDA graph; a measurement replays the graph --reps times
between two events (time per call = elapsed / (20 x reps)); providers are measured in interleaved rounds (the order
rotates) and each row reports the 20/50/80th percentiles of its rounds. Every provider's output is first checked
against the fp32 reference with the 2x rule (the eager bf16 MLP as the same-dtype yardstick). The weights (100-350 MB)
are larger than L2, so every call reads them from HBM; "limit" = weight bytes / the device copy bandwidth measured in
the same run. Writes ``--out/decode_mlp.csv`` (bench_lib.COLUMNS) and prints, per shape, the times, the ratios of
ours_decode to the cuBLAS path and to Inductor, and the crossover: the largest T up to which ours_decode beats both at
every measured T.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_lib as bl  # noqa: E402

# (model, H, I, activation); H_out = H
SHAPES = [("gemma-2b", 2048, 16384, "gelu_tanh"), ("llama-3.2-1b", 2048, 8192, "silu"),
          ("llama-3-8b", 4096, 14336, "silu")]
TOKENS = (1, 2, 4, 8, 16, 32, 64)
QUICK_SHAPES = SHAPES[:1]
QUICK_TOKENS = (1, 16, 64)
# --check: model shapes plus one with K tails and row tails in both passes (and H_out != H below)
CHECK_SHAPES = [(2048, 16384, 2048), (2048, 8192, 2048), (4096, 14336, 4096), (2056, 5128, 2056), (136, 520, 24)]
CHECK_TOKENS = (1, 2, 7, 8, 9, 16, 17, 31, 33, 63, 64)
# Tuning variants of ours_decode (FUSED_MLP_DECODE_TUNE): PDL, and the work split of each pass around the table's.
VARIANTS = ["pdl=0", "gu_wk=2", "gu_wr=1,gu_wk=8", "gu_wr=2,gu_wk=4", "dn_ks=1", "dn_ks=2", "dn_ks=8", "dn_wk=4",
            "dn_wr=2,dn_wk=4"]
TARGET_US = 55.0  # targets.md: Gemma-2B MLP at T <= 16 in <= 55 us
CALLS_PER_GRAPH = 20
DECODE_ENV, TUNE_ENV = "FUSED_MLP_DECODE_MLP", "FUSED_MLP_DECODE_TUNE"


def act_fn(act: str):
    return {"gelu_tanh": lambda g: F.gelu(g, approximate="tanh"), "gelu": F.gelu, "silu": F.silu}[act]


def plain_mlp(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor, act: str) -> torch.Tensor:
    """The MLP as the model computes it (transformers' GemmaMLP / LlamaMLP forward): what Inductor is given."""
    return F.linear(act_fn(act)(F.linear(x, wg)) * F.linear(x, wu), wd)


@contextlib.contextmanager
def env(**values: str | None):
    """Set (or, with None, unset) environment variables for the block."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_weights(h: int, i: int, h_out: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    wg = (torch.randn(i, h, device="cuda", generator=g) * h ** -0.5).to(dtype)
    wu = (torch.randn(i, h, device="cuda", generator=g) * h ** -0.5).to(dtype)
    wd = (torch.randn(h_out, i, device="cuda", generator=g) * i ** -0.5).to(dtype)
    return wg, wu, wd


def reference(x, w, act):
    """fp32 reference (unrounded) and the same-dtype eager result."""
    xf = x.float()
    w32 = [t.float() for t in w]
    r32 = F.linear(act_fn(act)(F.linear(xf, w32[0])) * F.linear(xf, w32[1]), w32[2])
    return r32, plain_mlp(x, *w, act)


# ---- --check ------------------------------------------------------------------------------------------------------


def run_check(fm) -> int:
    """The op (and gated_mlp through it) at every token class, model shapes and tail shapes, every activation, bf16
    and fp16, default tuning and PDL: 2x rule against the fp32 reference, PDL bitwise equal, reproducible."""
    torch.backends.cuda.matmul.allow_tf32 = False
    failures, cases = 0, 0
    t0 = time.perf_counter()
    for h, i, h_out in CHECK_SHAPES:
        for dtype in (torch.bfloat16, torch.float16):
            w = make_weights(h, i, h_out, dtype, seed=h + i)
            xall = torch.randn(64, h, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)).to(dtype)
            for act in ("gelu_tanh", "gelu", "silu"):
                r32, same = reference(xall, w, act)
                for t in CHECK_TOKENS:
                    x = xall[:t]
                    cases += 1
                    problems = []
                    with env(**{TUNE_ENV: None}):
                        y = fm._ops.ops.gated_mlp_decode(x, *w, act)
                        y2 = fm._ops.ops.gated_mlp_decode(x, *w, act)
                    with env(**{TUNE_ENV: "pdl=0"}):
                        y_pdl = fm._ops.ops.gated_mlp_decode(x, *w, act)
                    with env(**{DECODE_ENV: "on", TUNE_ENV: None}), torch.no_grad():
                        y_mlp = fm.gated_mlp(x.view(1, t, h), *w, activation=act).view(t, h_out)
                    ours = bl.max_abs_err(y, r32[:t])
                    theirs = bl.max_abs_err(same[:t], r32[:t])
                    if not bl.two_x_rule(ours, theirs, dtype):
                        problems.append(f"err {ours:.3g} > 2 x {theirs:.3g} + floor")
                    if not torch.equal(torch.isnan(y), torch.isnan(r32[:t])):
                        problems.append("NaN pattern")
                    if not torch.equal(y, y2):
                        problems.append("not reproducible")
                    if not torch.equal(y, y_pdl):
                        problems.append("PDL differs")
                    if not torch.equal(y, y_mlp):
                        problems.append("gated_mlp differs from the op")
                    if problems:
                        failures += 1
                        bl.log(f"FAIL H={h} I={i} H_out={h_out} {str(dtype)[6:]} {act} T={t}: {'; '.join(problems)}")
            del w
            torch.cuda.empty_cache()
        bl.log(f"checked H={h} I={i} H_out={h_out} ({time.perf_counter() - t0:.0f} s)")
    bl.log(f"\n--check: {cases - failures}/{cases} cases pass" + ("" if not failures else f", {failures} FAIL"))
    return 1 if failures else 0


# ---- timing -------------------------------------------------------------------------------------------------------


def capture(fn, calls: int = CALLS_PER_GRAPH) -> torch.cuda.CUDAGraph:
    """`calls` calls of fn() in one CUDA graph (bench_lib.GraphCalls: warmed up on a side stream first)."""
    g = bl.GraphCalls(fn, calls).graph
    torch.cuda.synchronize()
    return g


def replay_us(g: torch.cuda.CUDAGraph, reps: int, calls: int = CALLS_PER_GRAPH) -> float:
    g.replay()  # one unmeasured replay: the clocks and the instruction caches
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * calls)


def crossover(times: dict[int, dict[str, float]]) -> int:
    """The largest measured T such that ours_decode is faster than ours_cublas and inductor at it and every smaller
    measured T (0: not even at the smallest)."""
    best = 0
    for t in sorted(times):
        row = times[t]
        others = [row[p] for p in ("ours_cublas", "inductor") if p in row]
        if "ours_decode" in row and others and row["ours_decode"] < min(others):
            best = t
        else:
            break
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="directory for decode_mlp.csv (required unless --check)")
    ap.add_argument("--check", action="store_true", help="correctness of the op only (every token class and shape)")
    ap.add_argument("--quick", action="store_true", help="Gemma-2B shape, T in {1, 16, 64}")
    ap.add_argument("--rounds", type=int, default=9, help="interleaved timing rounds (default 9)")
    ap.add_argument("--reps", type=int, default=5, help="graph replays per measurement (default 5)")
    ap.add_argument("--no-variants", action="store_true", help="skip the FUSED_MLP_DECODE_TUNE variants")
    ap.add_argument("--no-compile", action="store_true", help="skip the inductor provider")
    ap.add_argument("--kernel", default=None, help="checkout path or Hub repo id (default: this checkout)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_mlp.py needs a CUDA GPU", file=sys.stderr)
        return 2
    fm = bl.load_kernel(args.kernel)
    if not hasattr(fm._ops.ops, "gated_mlp_decode"):
        print(f"{fm.__name__} has no gated_mlp_decode op (an older build?)", file=sys.stderr)
        return 2
    if args.check:
        return run_check(fm)
    if args.out is None:
        ap.error("--out is required (or --check)")
    torch.backends.cuda.matmul.allow_tf32 = False
    for name in ("recompile_limit", "cache_size_limit"):  # one static graph per T for each activation
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)
    env_row = bl.collect_env("cuda", fm)
    slug = bl.device_slug(env_row)
    writer = bl.ResultWriter(args.out / "decode_mlp.csv", env_row, merge=False,
                             mirror=bl.out_mirror(slug, "decode_mlp.csv"))
    t_start = time.perf_counter()
    ceilings, ceiling_rows = bl.measure_ceilings(bl.Timer("cuda"), "cuda", [])
    for r in ceiling_rows:
        writer.add(**r)
    copy_gbps = ceilings.copy_gbps
    bl.log(f"device copy: {copy_gbps:.0f} GB/s")
    dtype = torch.bfloat16
    shapes = QUICK_SHAPES if args.quick else SHAPES
    token_list = QUICK_TOKENS if args.quick else TOKENS
    compiled = {} if args.no_compile else {a: torch.compile(plain_mlp, dynamic=False)
                                           for a in {s[3] for s in shapes}}
    variants = [] if args.no_variants else VARIANTS
    summary = []
    for model, h, i, act in shapes:
        w = make_weights(h, i, h, dtype)
        weight_bytes = sum(t.numel() * t.element_size() for t in w)
        limit_us = weight_bytes / copy_gbps / 1e3
        times: dict[int, dict[str, float]] = {}
        for t in token_list:
            x = torch.randn(t, h, device="cuda", generator=torch.Generator(device="cuda").manual_seed(t)).to(dtype)
            r32, same = reference(x, w, act)
            err_eager = bl.max_abs_err(same, r32)

            def mlp(mode_: str, tune: str | None = None):
                def call():
                    with env(**{DECODE_ENV: mode_, TUNE_ENV: tune}), torch.no_grad():
                        return fm.gated_mlp(x, *w, activation=act)
                return call

            # ours: what a user gets (auto: the measured table of _decode.MAX_TOKENS picks the path)
            providers = {"ours": mlp("auto"), "ours_decode": mlp("on"), "ours_cublas": mlp("off")}
            if act in compiled:
                def inductor(c=compiled[act]):
                    with torch.no_grad():
                        return c(x, *w, act)
                providers["inductor"] = inductor

            def eager():
                with torch.no_grad():
                    return plain_mlp(x, *w, act)
            providers["eager"] = eager
            for v in variants:
                providers[f"ours_decode:{v}"] = mlp("on", v)
            entries = []
            for name, fn in providers.items():
                try:
                    c0 = time.perf_counter()
                    out = fn()  # the first call (compiles inductor's graph for this T)
                    torch.cuda.synchronize()
                    first_s = time.perf_counter() - c0
                    err = bl.max_abs_err(out, r32)
                    ok = bl.two_x_rule(err, err_eager, dtype) and torch.equal(torch.isnan(out), torch.isnan(r32))
                    # the graph replays fn as captured: the env (FUSED_MLP_DECODE_*) is read while capturing
                    graph = capture(fn)
                except Exception as exc:  # noqa: BLE001 - a variant that cannot run or be captured: say so, go on
                    bl.log(f"  {model} T={t} {name}: {bl.describe_exception(exc)}")
                    writer.add(op="gated_mlp_decode", provider=name, mode="fwd_graph", dtype="bf16",
                               shape=bl.shape_str({"H": h, "I": i, "T": t}), H=h, I=i, T=t,
                               status=f"error: {bl.describe_exception(exc)}")
                    if name in ("ours", "ours_decode", "ours_cublas", "eager"):
                        raise
                    continue
                entries.append(dict(name=name, graph=graph, err=err, ok=ok, first_s=first_s, us=[]))
            for rnd in range(args.rounds):
                k = rnd % len(entries)
                for e in entries[k:] + entries[:k]:
                    e["us"].append(replay_us(e["graph"], args.reps))
            times[t] = {}
            for e in entries:
                vals = sorted(e["us"])
                tm = bl.Timing(*(bl._percentile(vals, q) for q in bl.QUANTILES))
                times[t][e["name"]] = tm.p50
                gbps = weight_bytes / tm.p50 / 1e3
                role = ("ours" if e["name"] in ("ours", "ours_decode", "ours_cublas") else
                        "variant" if e["name"].startswith("ours_decode:") else "anchor")
                writer.add(op="gated_mlp_decode", provider=e["name"], role=role, source="measured", mode="fwd_graph",
                           dtype="bf16", shape=bl.shape_str({"H": h, "I": i, "T": t}), H=h, I=i, T=t,
                           time_p20_ms=tm.p20 / 1e3, time_p50_ms=tm.p50 / 1e3, time_p80_ms=tm.p80 / 1e3,
                           bytes=weight_bytes, flops=2 * t * h * i * 3, gbps=gbps, tokens_per_s=t / tm.p50 * 1e6,
                           ceiling="copy_GBps", ceiling_value=copy_gbps, pct_of_ceiling=100 * gbps / copy_gbps,
                           max_err=e["err"], max_err_eager=err_eager, verified=e["ok"],
                           compile_s=e["first_s"] if e["name"] == "inductor" else None,
                           status="ok" if e["ok"] else "fails 2x rule",
                           note=f"model={model}; activation={act}; CUDA graph of {CALLS_PER_GRAPH} calls x "
                                f"{args.reps} replays; {args.rounds} interleaved rounds")
                if not e["ok"]:
                    bl.log(f"  {model} T={t} {e['name']}: FAILS the 2x rule (err {e['err']:.3g}, eager "
                           f"{err_eager:.3g})")
            writer.checkpoint()
            line = "  ".join(f"{n} {v:7.1f}" for n, v in times[t].items() if ":" not in n)
            bl.log(f"{model} T={t:3d}: {line} us (limit {limit_us:.1f})")
            del entries
            torch.cuda.empty_cache()
        summary.append((model, h, i, act, limit_us, times))
        torch.cuda.empty_cache()

    # ---- the table --------------------------------------------------------------------------------------------------
    bl.log(f"\nCUDA-graph device time per MLP call, us (bf16; limit = weight bytes / {copy_gbps:.0f} GB/s)")
    for model, h, i, act, limit_us, times in summary:
        bl.log(f"\n{model} (H={h}, I={i}, {act}), limit {limit_us:.1f} us")
        bl.log(f"{'T':>4} {'ours':>8} {'decode':>8} {'cublas':>8} {'inductor':>8} {'eager':>8} {'eag/ours':>8} "
               f"{'dec/cub':>8} {'dec/ind':>8} {'%limit':>7}  best variant")
        for t, row in times.items():
            d, c = row["ours_decode"], row["ours_cublas"]
            ind, e = row.get("inductor", float("nan")), row["eager"]
            var = {n: v for n, v in row.items() if n.startswith("ours_decode:")}
            best = min(var.items(), key=lambda kv: kv[1]) if var else None
            best_s = f"{best[0].split(':', 1)[1]} {best[1]:.1f} ({best[1] / d:.3f}x)" if best else ""
            flag = "  target <= 55" if model == "gemma-2b" and t <= 16 else ""
            o = row["ours"]
            bl.log(f"{t:4d} {o:8.1f} {d:8.1f} {c:8.1f} {ind:8.1f} {e:8.1f} {e / o:8.3f} {d / c:8.3f} {d / ind:8.3f} "
                   f"{100 * limit_us / d:6.1f}%  {best_s}{flag}")
        cross = crossover(times)
        bl.log(f"crossover: ours_decode beats the cuBLAS path and Inductor at every measured T <= {cross}"
               + (" (all measured T)" if cross == max(times) else ""))
        for v in variants:
            ratios = sorted(row[f"ours_decode:{v}"] / row["ours_decode"] for row in times.values()
                            if f"ours_decode:{v}" in row)
            if ratios:
                bl.log(f"  variant {v:18s} time / ours_decode: median {ratios[len(ratios) // 2]:.3f}, per T "
                       + " ".join(f"{row[f'ours_decode:{v}'] / row['ours_decode']:.3f}" if f"ours_decode:{v}" in row
                                  else "-" for row in times.values()))
    crosses = [crossover(s[5]) for s in summary]
    bl.log(f"\none-layer crossover: {min(crosses)} (per shape {crosses}); _decode.MAX_TOKENS comes from "
           "decode_stack.py (a stack of layers, weights from HBM)")
    gemma = [s for s in summary if s[0] == "gemma-2b"]
    if gemma:
        worst = max(v["ours"] for t, v in gemma[0][5].items() if t <= 16)
        bl.log(f"target (Gemma-2B, T <= 16, <= {TARGET_US:.0f} us): worst {worst:.1f} us -> "
               f"{'met' if worst <= TARGET_US else 'NOT met'}")
    bl.log(f"\nwrote {args.out / 'decode_mlp.csv'} in {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
