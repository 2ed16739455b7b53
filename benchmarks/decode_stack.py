#!/usr/bin/env python3
"""Decode kernels in a layer stack: CUDA-graph device time of a decoder layer's projections (q, k, v, o) and gated
MLP run over L layers of distinct weights, as a model runs them, per token count T; the cuBLAS path against the decode
kernels (``linear_decode`` for the projections, ``gated_mlp_decode`` for the MLP, both or neither). The "auto" tables
of torch-ext/fused_mlp/_decode.py (``MAX_TOKENS``, ``LINEAR_MAX_TOKENS``) come from it:
docs/tuning-log.md#decode-stack.

    python benchmarks/decode_stack.py            # Llama-3.2-1B / Gemma-2B / Llama-3-8B, T in {1, 2, 3, 4, 6, 8, 12, 16}
    python benchmarks/decode_stack.py --quick    # Llama-3.2-1B, T in {1, 8, 16}
    python benchmarks/decode_stack.py --tunes "gu_wk=8;lin_wk=4"   # also the kernels under FUSED_MLP_DECODE_TUNE

Why a stack: linear_decode.py and decode_mlp.py replay one layer's weights, which then sit partly in L2 (50 MB on an
H200; a Llama-3.2-1B layer's projections are 21 MB). In a model every layer's weights come from HBM, and there the
decode kernels' T = 9..16 class loses to cuBLAS where the one-layer benchmarks had it win.

Providers (bf16, no autograd): ``cublas`` (``F.linear`` for every GEMM and the activation as torch ops: what the plain
model and Inductor's extern mm run), ``lin`` (``linear_decode`` for q, k, v, o; cuBLAS MLP), ``mlp`` (cuBLAS
projections; ``gated_mlp_decode``), ``both``. Each provider's pass over the L layers is one CUDA graph; rounds replay
every graph once in a fresh random order (bench_lib.measure_graphs); time per layer = median / L. The last layer's
q projection and MLP output of every provider are checked against the fp32 reference with the 2x rule. ``--tunes``
adds, per FUSED_MLP_DECODE_TUNE setting (gated_gemv.cu's run-time overrides of its work split), a provider captured
with it set: ``lin:<tune>`` when every key is a ``lin_`` one, ``mlp:<tune>`` when none is, ``both:<tune>`` for a mix
or ``pdl`` (which both kernels read); the table's entries are picked from one run.

Writes ``<results-root>/<device-slug>/decode_stack.csv`` (bench_lib.COLUMNS, mode fwd_graph, ms per layer) and
``decode_stack.png`` (plot.py), and prints per model the ratios to cuBLAS and the crossover of each kernel: the
largest T up to which it is faster than cuBLAS at every measured T.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

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

LAYERS = 16  # 336 MB of Llama-3.2-1B projections, 1.6 GB of its MLPs: far beyond L2
T_FULL = (1, 2, 3, 4, 6, 8, 12, 16)
T_QUICK = (1, 8, 16)
# model: hidden H, q width (heads x head_dim), kv width, intermediate I, activation
MODELS = {"llama3_2_1b": (2048, 2048, 512, 8192, "silu"), "gemma2b": (2048, 2048, 256, 16384, "gelu_tanh"),
          "llama3_8b": (4096, 4096, 1024, 14336, "silu")}
PROVIDERS = {"cublas": (False, False), "lin": (True, False), "mlp": (False, True), "both": (True, True)}
TUNE = "FUSED_MLP_DECODE_TUNE"


def tune_providers(tunes: Sequence[str]) -> dict[str, tuple[bool, bool, str]]:
    """``--tunes`` settings as providers: name -> (linear_decode?, decode MLP?, FUSED_MLP_DECODE_TUNE value)."""
    out = {}
    for tune in tunes:
        keys = [item.split("=", 1)[0].strip() for item in tune.split(",") if item.strip()]
        lin = any(k.startswith("lin_") or k == "pdl" for k in keys)
        mlp = any(not k.startswith("lin_") for k in keys)
        name = "both" if lin and mlp else "lin" if lin else "mlp"
        out[f"{name}:{tune}"] = (lin, mlp or not lin, tune)
    return out


def captured(fn, tune: str) -> GraphCalls:
    """``fn`` captured with FUSED_MLP_DECODE_TUNE set to ``tune`` (the kernels read it per call in eager mode, so the
    graph keeps what was set); the caller's setting is restored."""
    saved = os.environ.get(TUNE)
    if tune:
        os.environ[TUNE] = tune
    else:
        os.environ.pop(TUNE, None)
    try:
        return GraphCalls(fn, calls=1)
    finally:
        if saved is None:
            os.environ.pop(TUNE, None)
        else:
            os.environ[TUNE] = saved


def act_mul(g: torch.Tensor, u: torch.Tensor, act: str) -> torch.Tensor:
    return (F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")) * u


def crossover(ratios: dict[int, float]) -> int:
    """The largest T up to which the ratio stays below 1 at every measured T (0: not even at the first)."""
    best = 0
    for t in sorted(ratios):
        if ratios[t] >= 1.0:
            break
        best = t
    return best


def run_model(ops, writer: ResultWriter, model: str, ts: Sequence[int], dtype_name: str, rounds: int,
              tunes: Sequence[str] = (), device: str = "cuda") -> None:
    dtype = DTYPES[dtype_name]
    h, qw, kw, inter, act = MODELS[model]
    g = torch.Generator(device=device).manual_seed(0)

    def w(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, device=device, generator=g) * k ** -0.5).to(dtype)

    layers = [dict(q=w(qw, h), k=w(kw, h), v=w(kw, h), o=w(h, qw), g=w(inter, h), u=w(inter, h), d=w(h, inter))
              for _ in range(LAYERS)]
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = sum(t.numel() for t in layers[0].values()) * elem  # per layer
    res: dict[tuple[int, str], float] = {}
    with torch.no_grad():
        for t in ts:
            x = torch.randn(t, h, device=device, generator=g).to(dtype)
            a = torch.randn(t, qw, device=device, generator=g).to(dtype)

            def make(lin_dec: bool, mlp_dec: bool, x=x, a=a):
                def lin(i: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
                    return ops.linear_decode(i, m) if lin_dec else F.linear(i, m)

                def one_pass() -> tuple[torch.Tensor, torch.Tensor]:
                    q = y = x
                    for ly in layers:
                        q = lin(x, ly["q"])
                        lin(x, ly["k"]), lin(x, ly["v"]), lin(a, ly["o"])
                        y = (ops.gated_mlp_decode(x, ly["g"], ly["u"], ly["d"], act) if mlp_dec else
                             F.linear(act_mul(F.linear(x, ly["g"]), F.linear(x, ly["u"]), act), ly["d"]))
                    return q, y  # the last layer's q projection and MLP output, checked below
                return one_pass

            provs = {p: (*f, "") for p, f in PROVIDERS.items()} | tune_providers(tunes)
            graphs = {p: captured(make(lin_dec, mlp_dec), tune) for p, (lin_dec, mlp_dec, tune) in provs.items()}
            measure_graphs(graphs, rounds, seed=t)
            last = layers[-1]
            xf = x.float()
            ref_q = F.linear(xf, last["q"].float())
            ref = F.linear(act_mul(F.linear(xf, last["g"].float()), F.linear(xf, last["u"].float()), act),
                           last["d"].float())
            same_q, same = (max_abs_err(o, r) for o, r in zip(graphs["cublas"].out, (ref_q, ref)))
            for prov, gr in graphs.items():
                p20, p50, p80 = (v / LAYERS for v in round_quantiles(gr.times))
                err_q, err = (max_abs_err(o, r) for o, r in zip(gr.out, (ref_q, ref)))
                ok = two_x_rule(err_q, same_q, dtype) and two_x_rule(err, same, dtype)
                err = max(err_q, err)
                writer.add(op=f"decode_stack_{model}", provider=prov, role="anchor" if prov == "cublas" else "ours",
                           source="decode_stack.py", mode="fwd_graph", dtype=dtype_name,
                           shape=f"T={t},H={h},I={inter}", T=t, H=h, I=inter, L=LAYERS, time_p20_ms=p20,
                           time_p50_ms=p50, time_p80_ms=p80, bytes=nbytes, gbps=nbytes / p50 / 1e6, max_err=err,
                           verified=ok, status="ok" if ok else "error",
                           note=f"ms per layer: q, k, v, o and the {act} MLP over {LAYERS} layers of distinct "
                                f"weights in one CUDA graph, {len(gr.times)} interleaved rounds; max_err: the last "
                                "layer's q projection or MLP output, whichever is larger")
                res[(t, prov)] = p50 * 1e3
            del graphs
    writer.checkpoint()
    for prov in ("lin", "mlp", "both", *tune_providers(tunes)):
        ratios = {t: res[(t, prov)] / res[(t, "cublas")] for t in ts}
        log(f"[{model}] {prov}/cublas: " + "  ".join(f"T={t} {r:.3f}" for t, r in ratios.items())
            + f"  -> faster up to T = {crossover(ratios)}")
    torch.cuda.empty_cache()  # (layers go with this frame)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"T in {T_QUICK}, Llama-3.2-1B only")
    p.add_argument("--models", default=None, help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--dtypes", default="bf16")
    p.add_argument("--tunes", default="", help="semicolon list of FUSED_MLP_DECODE_TUNE settings to time too")
    p.add_argument("--ts", default=None, help="comma list of token counts (default: the --quick or full set)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 20 quick, 40 full)")
    add_result_args(p, "decode_stack.csv")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        log("decode_stack.py measures CUDA-graph device time: it needs a CUDA GPU")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    ts = tuple(int(t) for t in args.ts.split(",")) if args.ts else T_QUICK if args.quick else T_FULL
    models = [m.strip() for m in args.models.split(",")] if args.models else \
        (["llama3_2_1b"] if args.quick else list(MODELS))
    rounds = args.rounds or (20 if args.quick else 40)
    fm = load_kernel(args.kernel)
    ops = sys.modules[fm.__name__ + "._ops"].ops  # the build's own op namespace
    env = collect_env("cuda", fm)
    writer = result_writer(args, env)
    log(f"fused-mlp decode_stack: {env['device_name']}, torch {env['torch']}, kernel {env['kernel_build']}; "
        f"writing {writer.path}; {LAYERS} layers, {rounds} rounds")
    for dtype_name in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        for model in models:
            run_model(ops, writer, model, ts, dtype_name, rounds,
                      [t.strip() for t in args.tunes.split(";") if t.strip()])
    if not args.no_plot:
        draw_plot("plot_decode_stack", writer.path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
