#!/usr/bin/env python3
"""Host cost per call, from a layer's forward to the kernel launch, at decode size (one token, inference).

Eager decode is host-bound: each layer's Python and the dispatcher run once per token, and the kernels (2-5 us) finish
before the next launch is issued. This measures that host side alone: the GPU is first given a long sleep kernel, so
every launch below only queues work, and the CPU time per call is the cost a user pays per layer per token.

    python benchmarks/host_path.py                 # CUDA: the table and benchmarks/results/<device>/host_path.csv
    python benchmarks/host_path.py --device cpu    # the same calls on CPU tensors (includes the CPU kernels' time)

Providers, per op (rows M = 1, hidden N = 2048, bf16 on CUDA / fp32 on CPU; interleaved rounds, median):
  rms_norm:  `layer` (fused_mlp.layers.RMSNorm.forward on a LlamaRMSNorm, what kernelize installs), `function`
             (fused_mlp.rms_norm), `op` (the raw custom op that path runs: rms_norm_infer, or rms_norm_fwd in
             builds without it), `op_fwd` (rms_norm_fwd, the autograd forward's op), `torch` (F.rms_norm: the
             target is layer <= torch + 1 us), `module` (LlamaRMSNorm's own forward);
  gated_mlp: `layer` (GeGLUMLP.forward on a LlamaMLP), `module` (LlamaMLP's own forward), at H = 2048, I = 8192
             (CUDA only by default: on a CPU its GEMVs take milliseconds).
--grad-mode: torch.inference_mode (default) or torch.no_grad (what transformers' generate uses).
--clock: `wall` (perf_counter, the default on CUDA) or `thread` (the thread's CPU time, the default on CPU: on a
shared machine other processes' time slices stay out of it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lib import ROOT, ResultWriter, collect_env, device_slug, load_kernel, log, out_mirror  # noqa: E402


def host_us_per_call(fn, device: str, calls: int, rounds: int, clock=time.perf_counter) -> list[float]:
    """CPU microseconds per call of `fn`, one sample per round. On CUDA the stream is kept busy first (a sleep kernel
    longer than the round), so the calls only queue launches and nothing waits for the GPU."""
    samples = []
    for _ in range(rounds):
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda._sleep(int(2e9 * 0.02))  # ~20 ms of GPU time at ~2 GHz: longer than the timed loop
        t0 = clock()
        for _ in range(calls):
            fn()
        samples.append((clock() - t0) / calls * 1e6)
        if device == "cuda":
            torch.cuda.synchronize()
    return samples


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kernel", default=None, help="checkout path or Hub id (default: this checkout)")
    ap.add_argument("--calls", type=int, default=200, help="calls per round (default 200)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    ap.add_argument("--out", type=Path, default=None, help="CSV path (default benchmarks/results/<device>/host_path.csv)")
    ap.add_argument("--ops", default=None, help="comma-separated: rms_norm,gated_mlp (default: both on CUDA, "
                    "rms_norm on CPU)")
    ap.add_argument("--grad-mode", choices=("inference_mode", "no_grad"), default="inference_mode")
    ap.add_argument("--clock", choices=("wall", "thread"), default=None, help="default: wall on CUDA, thread on CPU")
    args = ap.parse_args(argv)

    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    device = args.device
    fm = load_kernel(args.kernel, backend="cpu" if device == "cpu" else None)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    env = collect_env(device, fm)
    out = args.out or ROOT / "benchmarks" / "results" / device_slug(env) / "host_path.csv"
    writer = ResultWriter(out, env, merge=False, mirror=out_mirror(device_slug(env), "host_path.csv"))

    n, inter = 2048, 8192
    norm = LlamaRMSNorm(n).to(device=device, dtype=dtype).eval()
    cfg = LlamaConfig(hidden_size=n, intermediate_size=inter)
    mlp = LlamaMLP(cfg).to(device=device, dtype=dtype).eval()
    x = torch.randn(1, 1, n, device=device, dtype=dtype)
    w = norm.weight
    norm_layer = types.MethodType(fm.layers.RMSNorm.forward, norm)
    mlp_layer = types.MethodType(fm.layers.GeGLUMLP.forward, mlp)
    op_fwd = fm._ops.ops.rms_norm_fwd.default
    infer = getattr(fm._ops.ops, "rms_norm_infer", None)  # builds before the inference op: the full forward
    op = (lambda: infer.default(x, w, 1e-6, 0.0, False)) if infer is not None else \
        (lambda: op_fwd(x, None, w, 1e-6, 0.0, dtype, None))
    cases = {
        ("rms_norm", "layer"): lambda: norm_layer(x),
        ("rms_norm", "function"): lambda: fm.rms_norm(x, w, 1e-6),
        ("rms_norm", "op"): op,
        ("rms_norm", "op_fwd"): lambda: op_fwd(x, None, w, 1e-6, 0.0, dtype, None),
        ("rms_norm", "torch"): lambda: F.rms_norm(x, (n,), w, 1e-6),
        ("rms_norm", "module"): lambda: type(norm).forward(norm, x),
        ("gated_mlp", "layer"): lambda: mlp_layer(x),
        ("gated_mlp", "module"): lambda: type(mlp).forward(mlp, x),
    }
    wanted = set((args.ops or ("rms_norm,gated_mlp" if device == "cuda" else "rms_norm")).split(","))
    cases = {k: f for k, f in cases.items() if k[0] in wanted}
    clock = time.thread_time if (args.clock or ("wall" if device == "cuda" else "thread")) == "thread" \
        else time.perf_counter
    grad_ctx = torch.inference_mode if args.grad_mode == "inference_mode" else torch.no_grad
    samples: dict[tuple[str, str], list[float]] = {k: [] for k in cases}
    with grad_ctx():
        for fn in cases.values():  # warm-up: first-call costs (kernel caches, cuBLAS handles) are not per call
            for _ in range(20):
                fn()
        for _ in range(args.rounds):
            for key, fn in cases.items():
                samples[key] += host_us_per_call(fn, device, args.calls, 1, clock)
    med = {k: statistics.median(v) for k, v in samples.items()}
    for (op_name, provider), us in med.items():
        writer.add(op=f"host_{op_name}", provider=provider, dtype=str(dtype).split(".")[-1],
                   mode="inference" if args.grad_mode == "inference_mode" else "no_grad",
                   shape=f"M=1,N={n}" + (f",I={inter}" if op_name == "gated_mlp" else ""), M=1, N=n,
                   time_p50_ms=us / 1000, note="CPU time per call, launches only queued (GPU kept busy)")
    writer.checkpoint()
    log(f"host cost per call (us, median of {args.rounds} rounds x {args.calls} calls, {device}, {dtype}, "
        f"{args.grad_mode}, {'thread CPU' if clock is time.thread_time else 'wall'} clock):")
    for (op_name, provider), us in med.items():
        log(f"  {op_name:9s} {provider:9s} {us:7.2f}")
    if ("rms_norm", "layer") in med:
        excess = med[("rms_norm", "layer")] - med[("rms_norm", "torch")]
        log(f"rms_norm layer - F.rms_norm: {excess:+.2f} us (target <= +1.00 us)")
    if ("gated_mlp", "layer") in med:
        log(f"gated_mlp layer / module: {med[('gated_mlp', 'layer')] / med[('gated_mlp', 'module')]:.3f}")
    log(f"CSV: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
