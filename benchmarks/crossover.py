#!/usr/bin/env python3
"""Where the few-rows (decode) kernels stop paying: CUDA-graph device time of the latency path forced on vs the
persistent path forced off, per row count, with torch.compile of the plain definition (Inductor) as the anchor. The
launchers' "auto" limits (kernels_src/cuda/rms_norm.cu small_max_rows, geglu.cu small_max_elems and its block size
kSmallWideElems, from --configs) come from this.

    python benchmarks/crossover.py --quick     # M in {1, 4, 16, 64, 256, 1024}, rms_norm + add_rms_norm, geglu/swiglu
                                               # at I 8192/16384, the backward at N 2048/4096/8192 (~2.5 min)
    python benchmarks/crossover.py             # M in {1, 2, 4, ..., 1024} x N {2048, 4096, 8192}, gemma too, I 14336
    python benchmarks/crossover.py --configs   # also every packs-per-thread / block-size choice of the new kernels

Method. Each (op, shape, provider) is captured once into a CUDA graph of 20 calls (inference: no autograd). Every
round replays each graph of an (op, N) group once, in a fresh random order, between two CUDA events; the time per
call is the median over rounds / 20 (p20/p80 recorded too). Providers:
  ours_small  FUSED_MLP_*_SMALL=on     the few-rows kernel wherever it applies
  ours_small_nopdl                     the same without programmatic dependent launch (FUSED_MLP_*_PDL=0)
  ours_old    FUSED_MLP_*_SMALL=off    the persistent kernels
  ours_auto   FUSED_MLP_*_SMALL=auto   what ships (one of the two, by the launcher's limit)
  inductor    torch.compile of the plain fp32-math definition (token dim dynamic, size 1 its own graph, as sweep.py)
The knobs switch between captures in this one process: it sets FUSED_MLP_KNOBS_DYNAMIC=1 before the first kernel
call, which makes the launchers re-read their variables at every call (prime_knobs checks that they do); a graph
replays what was captured.
Backward (rms_norm_bwd, dx and dW from the saved rstd; "bwd_graph" rows): the few-rows backward on / off / auto
(FUSED_MLP_RMS_NORM_BWD_SMALL) against Inductor's code for the plain backward formula at M in {1, 4, 16, ..., 256}.

Writes ``<results-root>/<device-slug>/crossover.csv`` (bench_lib.COLUMNS, mode fwd_graph / bwd_graph, times per call
in ms) and prints, per op and N (I), the per-M table and the measured crossover: the largest M up to which the
few-rows path is never slower than the persistent one.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Before the kernel's first call: the launchers then re-read the knobs at every call (see the docstring).
os.environ["FUSED_MLP_KNOBS_DYNAMIC"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lib import (  # noqa: E402
    DTYPES,
    GraphCalls,
    ResultWriter,
    add_result_args,
    collect_env,
    load_kernel,
    log,
    max_abs_err,
    measure_graphs,
    result_writer,
    round_quantiles,
    two_x_rule,
)

EPS = 1e-6
CALLS = 20  # calls per graph
M_FULL = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
M_QUICK = (1, 4, 16, 64, 256, 1024)
N_ALL = (2048, 4096, 8192)
I_FULL = (8192, 14336, 16384)
I_QUICK = (8192, 16384)
BWD_M = (1, 4, 16, 64, 128, 256)
# The few-rows backward forced on / off / as shipped (FUSED_MLP_RMS_NORM_BWD_SMALL, re-read per call).
BWD_SMALL_KNOB = "FUSED_MLP_RMS_NORM_BWD_SMALL"
BWD_KNOBS = (("ours_small", "on"), ("ours_old", "off"), ("ours_auto", "auto"))
RMS_OPS = ("rms_norm", "add_rms_norm", "gemma_rms_norm")
ACT_OPS = ("geglu_act", "swiglu_act")
KNOB = {"rms": "FUSED_MLP_RMS_NORM_SMALL", "act": "FUSED_MLP_GEGLU_SMALL"}
PDL_KNOB = {"rms": "FUSED_MLP_RMS_NORM_PDL", "act": "FUSED_MLP_GEGLU_PDL"}  # read per call by the launchers


# ---- the plain definitions (what Inductor compiles; also the references) -------------------------------------------


def rms_plain(x: torch.Tensor, w: torch.Tensor, offset: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * (offset + w.float())).to(x.dtype)


def add_rms_plain(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = x + r
    return rms_plain(h, w, 0.0), h


def act_plain(act: str, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    a = F.silu(g.float()) if act == "swiglu_act" else F.gelu(g.float(), approximate="tanh")
    return (a * u.float()).to(g.dtype)


def rms_bwd_plain(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, w: torch.Tensor):
    xhat = x.float() * rstd[:, None]
    g = dy.float() * w.float()
    c = (g * xhat).mean(-1, keepdim=True)
    return (rstd[:, None] * (g - xhat * c)).to(x.dtype), (dy.float() * xhat).sum(0).to(w.dtype)


# ---- graphs and timing ------------------------------------------------------------------------------------------


# ---- providers ------------------------------------------------------------------------------------------------------


def knob_settings(kind: str, configs: bool) -> list[tuple[str, str]]:
    """(provider, knob value) for our kernels."""
    base = [("ours_small", "on"), ("ours_small_nopdl", "on"), ("ours_old", "off"), ("ours_auto", "auto")]
    if configs:
        if kind == "rms":
            base += [(f"ours_small_p{p}", f"on,packs={p}") for p in (1, 2, 4, 8)]
        else:
            base += [(f"ours_small_t{t}", f"on,threads={t}") for t in (64, 128, 256, 512)]
    return base


class Compiled:
    """torch.compile of a plain definition: one compiled function per (op, N), the token dim dynamic (size 1
    specialises, as in sweep.py)."""

    def __init__(self) -> None:
        self.fns: dict[Any, Callable[..., Any]] = {}

    def get(self, key: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
        if key not in self.fns:
            self.fns[key] = torch.compile(fn)
        return self.fns[key]


def mark_tokens_dynamic(*ts: torch.Tensor) -> None:
    for t in ts:
        if t.shape[0] > 1:
            torch._dynamo.maybe_mark_dynamic(t, 0)


def rms_case(fm, op: str, M: int, N: int, dtype: torch.dtype, compiled: Compiled):
    """(inputs, {provider: fn}, reference fp32 outputs, same-dtype eager outputs)."""
    g = torch.Generator(device="cuda").manual_seed(M * 7919 + N)
    x = torch.randn(M, N, device="cuda", dtype=dtype, generator=g)
    r = torch.randn(M, N, device="cuda", dtype=dtype, generator=g)
    offset = 1.0 if op == "gemma_rms_norm" else 0.0
    w = (0.1 if offset else 1.0) + 0.25 * torch.randn(N, device="cuda", dtype=dtype, generator=g)
    mark_tokens_dynamic(x, r)
    if op == "add_rms_norm":
        ours = lambda: fm.rms_norm(x, w, EPS, residual=r)  # noqa: E731
        ind = compiled.get((op, N, M == 1), add_rms_plain)
        anchor = lambda: ind(x, r, w)  # noqa: E731
        h = x + r
        ref = rms_plain(h.float(), w.float(), 0.0)
        same = rms_plain(h, w, 0.0)
    else:
        ours = lambda: fm.rms_norm(x, w, EPS, offset=offset)  # noqa: E731
        ind = compiled.get((op, N, M == 1), rms_plain)
        anchor = lambda: ind(x, w, offset)  # noqa: E731
        ref = rms_plain(x.float(), w.float(), offset)
        same = rms_plain(x, w, offset)
    return ours, anchor, ref, same


def act_case(fm, op: str, T: int, I: int, dtype: torch.dtype, compiled: Compiled):
    g = torch.Generator(device="cuda").manual_seed(T * 7919 + I)
    gate = 3 * torch.randn(T, I, device="cuda", dtype=dtype, generator=g)
    up = torch.randn(T, I, device="cuda", dtype=dtype, generator=g)
    mark_tokens_dynamic(gate, up)
    if op == "swiglu_act":
        ours = lambda: fm.swiglu(gate, up)  # noqa: E731
    else:
        ours = lambda: fm.geglu(gate, up, approximate="tanh")  # noqa: E731
    ind = compiled.get((op, I, T == 1), lambda a, b: act_plain(op, a, b))
    anchor = lambda: ind(gate, up)  # noqa: E731
    ref = act_plain(op, gate.float(), up.float())
    same = (F.silu(gate) if op == "swiglu_act" else F.gelu(gate, approximate="tanh")) * up
    return ours, anchor, ref, same


# ---- the run --------------------------------------------------------------------------------------------------------


def prime_knobs(fm) -> None:
    """Checks that each launcher re-reads its knob variable at every call (FUSED_MLP_KNOBS_DYNAMIC): "on" and "off"
    must launch different kernels. Without that every provider would run the same kernel (the crossover rows before
    2026-12-04 did: a knob's first read fixed its value for the process)."""
    bf = torch.bfloat16
    x = torch.ones(2, 2048, device="cuda", dtype=bf)
    ops = fm._ops.ops
    calls = {
        KNOB["rms"]: lambda: fm.rms_norm(x, x[0]),
        KNOB["act"]: lambda: fm.geglu(x, x, approximate="tanh"),
        BWD_SMALL_KNOB: lambda: ops.rms_norm_bwd(x, x, torch.ones(2, device="cuda"), x[0], None, 0.0, bf, True),
    }
    assert os.environ.get("FUSED_MLP_KNOBS_DYNAMIC") == "1"
    for var, call in calls.items():
        names = {}
        for value in ("on", "off"):
            os.environ[var] = value
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                call()
                torch.cuda.synchronize()
            names[value] = sorted(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        os.environ[var] = "auto"
        if names["on"] == names["off"]:
            raise SystemExit(f"{var}: on and off launch the same kernels ({names['on']}): the knob is not re-read")


def first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def run_group(fm, writer: ResultWriter, compiled: Compiled, op: str, n: int, ms: Sequence[int], dtype_name: str,
              rounds: int, configs: bool) -> dict[tuple[int, str], float]:
    """All row counts x providers of one (op, N): capture, measure interleaved, write rows. -> {(M, provider): us}."""
    dtype = DTYPES[dtype_name]
    kind = "act" if op in ACT_OPS else "rms"
    graphs: dict[tuple[int, str], GraphCalls] = {}
    checks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for m in ms:
        ours, anchor, ref, same = (act_case if kind == "act" else rms_case)(fm, op, m, n, dtype, compiled)
        for provider, value in knob_settings(kind, configs):
            os.environ[KNOB[kind]] = value
            if provider.endswith("_nopdl"):  # the few-rows kernel launched without programmatic dependent launch
                os.environ[PDL_KNOB[kind]] = "0"
            graphs[(m, provider)] = GraphCalls(ours, CALLS)
            os.environ.pop(PDL_KNOB[kind], None)
        os.environ[KNOB[kind]] = "auto"
        try:
            graphs[(m, "inductor")] = GraphCalls(anchor, CALLS)
        except Exception as e:  # noqa: BLE001 - an anchor that cannot compile here is reported, not fatal
            log(f"  {op} M={m} N={n}: inductor failed: {type(e).__name__}: {str(e)[:200]}")
        checks[(m, "ref")] = (ref, same)
    measure_graphs(graphs, rounds)
    result: dict[tuple[int, str], float] = {}
    elem = torch.empty((), dtype=dtype).element_size()
    for (m, provider), g in graphs.items():
        p20, p50, p80 = round_quantiles(g.times)
        ref, same = checks[(m, "ref")]
        err = max_abs_err(first(g.out), ref)
        ok = two_x_rule(err, max_abs_err(same, ref), dtype)
        # rms: read x (+ residual), write y (+ h), read w; act: read gate and up, write h
        tensors = 3 if kind == "act" else (4 if op == "add_rms_norm" else 2)
        nbytes = tensors * m * n * elem + (n * elem if kind == "rms" else 0)
        shape = {"T": m, "I": n} if kind == "act" else {"M": m, "N": n}
        writer.add(op=op, provider=provider, role="anchor" if provider == "inductor" else "ours", source="crossover.py",
                   mode="fwd_graph", dtype=dtype_name, shape=",".join(f"{k}={v}" for k, v in shape.items()), **shape,
                   time_p20_ms=p20, time_p50_ms=p50, time_p80_ms=p80, bytes=nbytes, gbps=nbytes / p50 / 1e6,
                   max_err=err, verified=ok, status="ok" if ok else "error",
                   note=f"CUDA graph of {CALLS} calls, {len(g.times)} interleaved rounds")
        result[(m, provider)] = p50 * 1e3
    writer.checkpoint()
    del graphs
    torch.cuda.empty_cache()
    return result


def run_bwd(fm, writer: ResultWriter, compiled: Compiled, n: int, dtype_name: str, rounds: int,
            bwd_ms: Sequence[int] = BWD_M) -> None:
    """rms_norm_bwd (the op alone: dx and dW from the saved rstd) with the few-rows backward forced on
    (``ours_small``) and off (``ours_old``: the register / rows kernels and the dW column sum), what ships
    (``ours_auto``), and Inductor's code for the plain formula, per M."""
    dtype = DTYPES[dtype_name]
    ops = fm._ops.ops
    graphs: dict[tuple[int, str], GraphCalls] = {}
    checks = {}
    for m in bwd_ms:
        g = torch.Generator(device="cuda").manual_seed(m + n)
        x = torch.randn(m, n, device="cuda", dtype=dtype, generator=g)
        w = 1 + 0.25 * torch.randn(n, device="cuda", dtype=dtype, generator=g)
        dy = torch.randn(m, n, device="cuda", dtype=dtype, generator=g)
        rstd = torch.rsqrt(x.float().pow(2).mean(-1) + EPS)
        mark_tokens_dynamic(x, dy, rstd)
        for provider, value in BWD_KNOBS:
            os.environ[BWD_SMALL_KNOB] = value
            # Inputs bound per M (a late-binding closure would leave earlier M's inputs to be freed under the graph).
            graphs[(m, provider)] = GraphCalls(
                lambda dy=dy, x=x, rstd=rstd, w=w: ops.rms_norm_bwd(dy, x, rstd, w, None, 0.0, dtype, True), CALLS)
        os.environ[BWD_SMALL_KNOB] = "auto"
        ind = compiled.get(("rms_norm_bwd", n, m == 1), rms_bwd_plain)
        graphs[(m, "inductor")] = GraphCalls(lambda ind=ind, dy=dy, x=x, rstd=rstd, w=w: ind(dy, x, rstd, w), CALLS)
        xd, dyd, wd = x.double(), dy.double(), w.double()
        rs = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS)
        xhat = xd * rs
        dx_ref = rs * (dyd * wd - xhat * (dyd * wd * xhat).mean(-1, keepdim=True))
        checks[m] = (dx_ref, (dyd * xhat).sum(0))
    measure_graphs(graphs, rounds)
    provs = [p for p, _ in BWD_KNOBS] + ["inductor"]
    log(f"rms_norm_bwd N={n} ({dtype_name}), us per call (CUDA graph):  M: " + " / ".join(provs))
    for m in bwd_ms:
        t = {p: round_quantiles(graphs[(m, p)].times) for p in provs}
        ind_dx, ind_dw = graphs[(m, "inductor")].out
        dx_ref, dw_ref = checks[m]
        same = (max_abs_err(ind_dx, dx_ref), max_abs_err(ind_dw, dw_ref))
        for p, (p20, p50, p80) in t.items():
            dx, dw = graphs[(m, p)].out
            err = (max_abs_err(dx, dx_ref), max_abs_err(dw, dw_ref))
            ok = p == "inductor" or all(two_x_rule(e, se, dtype) for e, se in zip(err, same))
            writer.add(op="rms_norm", provider=p, role="anchor" if p == "inductor" else "ours", source="crossover.py",
                       mode="bwd_graph", dtype=dtype_name, shape=f"M={m},N={n}", M=m, N=n, time_p20_ms=p20,
                       time_p50_ms=p50, time_p80_ms=p80, max_err=max(err), verified=ok,
                       status="ok" if ok else "error",
                       note=f"CUDA graph of {CALLS} calls; dx and dW from the saved rstd; max_err over dx and dW")
        ms = {p: t[p][1] * 1e3 for p in provs}
        log(f"  M={m:5d}: " + " / ".join(f"{ms[p]:6.2f}" for p in provs)
            + f"  (small/old {ms['ours_small'] / ms['ours_old']:.2f}x, auto/inductor "
            f"{ms['ours_auto'] / ms['inductor']:.2f}x)")
    writer.checkpoint()
    del graphs
    torch.cuda.empty_cache()


def report(op: str, n: int, res: dict[tuple[int, str], float], ms: Sequence[int], configs: bool) -> None:
    kind = "act" if op in ACT_OPS else "rms"
    provs = [p for p, _ in knob_settings(kind, configs)] + ["inductor"]
    dim = ("T", "I") if kind == "act" else ("M", "N")
    log(f"{op} {dim[1]}={n}: us per call (CUDA graph, median)")
    log(f"  {dim[0]:>5}  " + "  ".join(f"{p:>13}" for p in provs) + "   small/old  small/inductor")
    for m in ms:
        row = [res.get((m, p), math.nan) for p in provs]
        s, o, i = res.get((m, "ours_small")), res.get((m, "ours_old")), res.get((m, "inductor"))
        ratios = f"   {s / o:9.2f}  {s / i:14.2f}" if s and o and i else ""
        log(f"  {m:5d}  " + "  ".join(f"{v:13.2f}" for v in row) + ratios)
    # Crossover: the largest M up to which the few-rows path is never slower than the persistent one.
    last_ok = 0
    for m in ms:
        if res.get((m, "ours_small"), math.inf) <= res.get((m, "ours_old"), 0.0):
            last_ok = m
        else:
            break
    worse = [m for m in ms if m > last_ok]
    log(f"  crossover {op} {dim[1]}={n}: few-rows path <= persistent up to {dim[0]}={last_ok}"
        + (f" (persistent faster from {dim[0]}={worse[0]})" if worse else " (the whole range)"))
    if configs:
        cfg = [p for p in provs if p.startswith("ours_small_")]
        best = {m: min(cfg, key=lambda p: res.get((m, p), math.inf)) for m in ms}
        log("  fastest config per " + dim[0] + ": " + ", ".join(f"{m}:{best[m][11:]}" for m in ms))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer row counts, ops and rounds (~1.5 min on an H200)")
    p.add_argument("--ops", default=None, help=f"comma list of {', '.join(RMS_OPS + ACT_OPS)}, rms_norm_bwd")
    p.add_argument("--dtypes", default="bf16", help="comma list of bf16, fp16, fp32 (default bf16)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 15 quick, 40 full)")
    p.add_argument("--configs", action="store_true", help="also each packs-per-thread (rms) / block size (act)")
    p.add_argument("--ms", default=None, help="comma list of row counts (M / T) for the forward ops")
    p.add_argument("--bwd-ms", default=None, help=f"comma list of row counts for rms_norm_bwd (default {BWD_M})")
    p.add_argument("--ns", default=None, help=f"comma list of N for the RMSNorm ops (default {N_ALL})")
    p.add_argument("--is", dest="inters", default=None,
                   help=f"comma list of I for the gated activations (default {I_QUICK} quick, {I_FULL} full)")
    add_result_args(p, "crossover.csv", plot=False)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        log("crossover.py measures CUDA-graph device time: it needs a CUDA GPU")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch._dynamo.config.automatic_dynamic_shapes = False  # dims static unless marked (mark_tokens_dynamic)
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)
    ms = tuple(int(v) for v in args.ms.split(",")) if args.ms else (M_QUICK if args.quick else M_FULL)
    bwd_ms = tuple(int(v) for v in args.bwd_ms.split(",")) if args.bwd_ms else BWD_M
    ns = tuple(int(v) for v in args.ns.split(",")) if args.ns else N_ALL
    i_list = tuple(int(v) for v in args.inters.split(",")) if args.inters else (I_QUICK if args.quick else I_FULL)
    default_ops = ("rms_norm", "add_rms_norm", "geglu_act", "swiglu_act", "rms_norm_bwd") if args.quick else \
        RMS_OPS + ACT_OPS + ("rms_norm_bwd",)
    ops = [o.strip() for o in args.ops.split(",")] if args.ops else list(default_ops)
    rounds = args.rounds or (15 if args.quick else 40)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]

    fm = load_kernel(args.kernel)
    env = collect_env("cuda", fm)
    writer = result_writer(args, env)
    log(f"fused-mlp crossover: {env['device_name']}, torch {env['torch']}, kernel {env['kernel_build']}, "
        f"git {env['git_rev']}; writing {writer.path}; {rounds} rounds of CUDA graphs of {CALLS} calls")
    prime_knobs(fm)
    compiled = Compiled()
    for dtype_name in dtypes:
        for op in ops:
            if op == "rms_norm_bwd":
                for n in ns:
                    run_bwd(fm, writer, compiled, n, dtype_name, rounds, bwd_ms)
                continue
            for n in (i_list if op in ACT_OPS else ns):
                res = run_group(fm, writer, compiled, op, n, ms, dtype_name, rounds, args.configs)
                report(op, n, res, ms, args.configs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
