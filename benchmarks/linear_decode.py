#!/usr/bin/env python3
"""Bias-free Linear at decode sizes: CUDA-graph device time of ``linear_decode`` (gated_gemv.cu's down pass alone)
against the cuBLAS path (``F.linear``; Inductor calls the same extern mm for it) and our own GEMM path (``linear`` with
``FUSED_MLP_LINEAR_DECODE=off``: cuBLASLt with one rounding), per token count. ``_decode.LINEAR_AUTO_MAX_N`` comes from it
(docs/tuning-log.md#linear-decode); the T limit ``LINEAR_MAX_TOKENS`` from decode_stack.py, which reads every layer's
weights from HBM where these graphs replay one layer's (docs/tuning-log.md#decode-stack).

    python benchmarks/linear_decode.py --quick     # T in {1, 4, 16, 64}, Llama-3.2-1B's projections (~1 min)
    python benchmarks/linear_decode.py             # T in {1, 2, 4, ..., 64}, Llama-3.2-1B / Llama-3-8B / Gemma-2B

Method (as crossover.py). Each (shape, T, provider) is captured once into a CUDA graph of 20 calls; every round
replays each graph of a shape once, in a fresh random order, between two CUDA events; time per call = median over
rounds / 20. Besides each projection alone (q, k, v, o and the lm_head), ``layer`` rows time one decoder layer's four
projections in a row (q, k, v from x; o from the attention output), where the op's programmatic dependent launch lets
a projection's weight prefetch overlap the previous one. ``ours_nopdl`` is the op without it
(FUSED_MLP_DECODE_TUNE=pdl=0). Capture and rounds: bench_lib.GraphCalls / measure_graphs (crossover.py's method).

Writes ``<results-root>/<device-slug>/linear_decode.csv`` (bench_lib.COLUMNS, mode fwd_graph, ms per call) and
``linear_decode.png`` next to it (plot.py), and prints per shape the time per T and the ratio op / cuBLAS (below 1:
the op wins).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lib import (  # noqa: E402
    DTYPES,
    GraphCalls,
    ResultWriter,
    add_result_args,
    collect_env,
    draw_plot,
    load_kernel,
    log,
    max_abs_err,
    measure_graphs,
    result_writer,
    round_quantiles,
    two_x_rule,
)

CALLS = 20
T_QUICK = (1, 4, 16, 64)
T_FULL = (1, 2, 4, 8, 16, 32, 64)
# model: hidden H, q width (heads x head_dim), kv width, vocabulary (the lm_head's N)
MODELS = {"llama3_2_1b": (2048, 2048, 512, 128256), "llama3_8b": (4096, 4096, 1024, 128256),
          "gemma2b": (2048, 2048, 256, 256000)}
ENV = "FUSED_MLP_LINEAR_DECODE"
TUNE = "FUSED_MLP_DECODE_TUNE"
PROVIDERS = (("ours", "on", ""), ("ours_nopdl", "on", "pdl=0"), ("ours_gemm", "off", ""), ("cublas", None, ""))


def capture(fm, provider: str, mode: str | None, tune: str, fn_ours: Callable[[], Any],
            fn_torch: Callable[[], Any]) -> GraphCalls:
    """The op's choice is made per call (env read in eager mode), so a graph records what was set at capture."""
    if mode is None:
        return GraphCalls(fn_torch, CALLS)
    saved = {k: os.environ.get(k) for k in (ENV, TUNE)}
    os.environ[ENV] = mode
    if tune:
        os.environ[TUNE] = tune
    else:
        os.environ.pop(TUNE, None)
    try:
        return GraphCalls(fn_ours, CALLS)
    finally:
        for k, v in saved.items():  # the caller's settings back
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_model(fm, writer: ResultWriter, model: str, ts: Sequence[int], dtype_name: str, rounds: int) -> None:
    dtype = DTYPES[dtype_name]
    h, q, kv, vocab = MODELS[model]
    g = torch.Generator(device="cuda").manual_seed(0)

    def w(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(dtype)

    weights = {"q": w(q, h), "k": w(kv, h), "v": w(kv, h), "o": w(h, q), "lm_head": w(vocab, h)}
    proj = ("q", "k", "v", "o")
    graphs: dict[tuple[str, int, str], GraphCalls] = {}
    checks: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad():
        for t in ts:
            x = torch.randn(t, h, device="cuda", generator=g).to(dtype)
            a = torch.randn(t, q, device="cuda", generator=g).to(dtype)
            for name, wt in weights.items():
                inp = a if name == "o" else x
                checks[(name, t)] = (F.linear(inp.float(), wt.float()), F.linear(inp, wt))
                for prov, mode, tune in PROVIDERS:
                    graphs[(name, t, prov)] = capture(fm, prov, mode, tune, lambda i=inp, m=wt: fm.linear(i, m),
                                                      lambda i=inp, m=wt: F.linear(i, m))

            def layer(lin: Callable, x=x, a=a):
                return (lin(x, weights["q"]), lin(x, weights["k"]), lin(x, weights["v"]), lin(a, weights["o"]))[3]

            checks[("layer", t)] = checks[("o", t)]
            for prov, mode, tune in PROVIDERS:
                graphs[("layer", t, prov)] = capture(fm, prov, mode, tune, lambda: layer(fm.linear),
                                                     lambda: layer(F.linear))
    measure_graphs(graphs, rounds)
    res: dict[tuple[str, int, str], float] = {}
    elem = torch.empty((), dtype=dtype).element_size()
    for (name, t, prov), gr in graphs.items():
        p20, p50, p80 = round_quantiles(gr.times)
        ref, same = checks[(name, t)]
        err = max_abs_err(gr.out, ref)
        ok = two_x_rule(err, max_abs_err(same, ref), dtype)
        ws = [weights[p] for p in proj] if name == "layer" else [weights[name]]
        nbytes = sum(m.numel() for m in ws) * elem
        # layer rows: K of q, k and v (o's K is the q width; equal for every model here), N summed over the four
        k, n = (h, sum(m.shape[0] for m in ws)) if name == "layer" else (ws[0].shape[1], ws[0].shape[0])
        writer.add(op=f"linear_decode_{model}_{name}", provider=prov, role="anchor" if prov == "cublas" else "ours",
                   source="linear_decode.py", mode="fwd_graph", dtype=dtype_name, shape=f"T={t},K={k},N={n}", T=t,
                   K=k, N=n, time_p20_ms=p20, time_p50_ms=p50, time_p80_ms=p80, bytes=nbytes,
                   gbps=nbytes / p50 / 1e6, max_err=err, verified=ok, status="ok" if ok else "error",
                   note=f"CUDA graph of {CALLS} calls, {len(gr.times)} interleaved rounds"
                        + ("; q, k, v, o in a row" if name == "layer" else ""))
        res[(name, t, prov)] = p50 * 1e3
    writer.checkpoint()
    for name in list(weights) + ["layer"]:
        cells = []
        for t in ts:
            ours, ref = res[(name, t, "ours")], res[(name, t, "cublas")]
            cells.append(f"T={t} {ours:.2f}/{ref:.2f} us ({ours / ref:.2f})")
        log(f"[{model} {name}] ours/cublas: " + "  ".join(cells))
    del graphs
    torch.cuda.empty_cache()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="T in {1, 4, 16, 64}, Llama-3.2-1B only (~1 min)")
    p.add_argument("--models", default=None, help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--dtypes", default="bf16", help="comma list of bf16, fp16 (default bf16)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 15 quick, 30 full)")
    add_result_args(p, "linear_decode.csv")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        log("linear_decode.py measures CUDA-graph device time: it needs a CUDA GPU")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    ts = T_QUICK if args.quick else T_FULL
    models = [m.strip() for m in args.models.split(",")] if args.models else \
        (["llama3_2_1b"] if args.quick else list(MODELS))
    rounds = args.rounds or (15 if args.quick else 30)
    fm = load_kernel(args.kernel)
    env = collect_env("cuda", fm)
    writer = result_writer(args, env)
    log(f"fused-mlp linear_decode: {env['device_name']}, torch {env['torch']}, kernel {env['kernel_build']}; "
        f"writing {writer.path}; {rounds} rounds of CUDA graphs of {CALLS} calls")
    for dtype_name in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        for model in models:
            run_model(fm, writer, model, ts, dtype_name, rounds)
    if not args.no_plot:
        draw_plot("plot_linear_decode", writer.path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
