#!/usr/bin/env python3
"""End-to-end benchmark: a stack of Gemma-2B-shaped (and Llama-3-8B- and Llama-3.2-1B-shaped) decoder layers from transformers configs
with random weights, bf16 -- training step (fwd + bwd of the LM loss) and prefill forward, for eager vs kernelized
(``kernels.kernelize`` with ``LocalLayerRepository`` mappings for RMSNorm, GemmaRMSNorm, GeGLUMLP, Linear) vs
``torch.compile`` vs Liger-Kernel's patching; tokens/s and peak memory, rows in the sweep's CSV format.

    python benchmarks/e2e.py                                 # GPU: 4 layers each of Gemma-2B, Llama-3-8B, Llama-3.2-1B
    python benchmarks/e2e.py --models gemma2b --providers eager,ours,torch.compile,liger,ours+torch.compile
    python benchmarks/e2e.py --tiny                          # CPU smoke run with a tiny config (about a minute)
    python benchmarks/e2e.py --sdpa-causal-skip              # with the docs' SDPA mask recipe (torch < 2.14)

Definitions mirror ``anchors/e2e_bench.py`` so the numbers compare with ``anchors/e2e.json``: GemmaConfig(vocab 4096,
hidden 2048, intermediate 16384, 8 heads, 1 KV head, head_dim 256, gelu_pytorch_tanh), ``input_ids`` of shape
(2, 2048), ``labels = input_ids``; the step is ``model(input_ids, labels).loss.backward()`` timed by ``do_bench``
with ``grad_to_none`` = all parameters; prefill is the forward under ``no_grad``. Every provider of a model is built
first, then steps and prefills are timed in ``--rounds`` interleaved rounds (p50 = median of the rounds' medians).
Peak memory is ``max_memory_allocated`` over one step minus what was allocated before that provider's model was built
(the anchor's figure also held do_bench's 256 MB cache-flush buffer). Liger's patching replaces transformers' classes
process-wide, so Liger's rows come after every model's other providers.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lib import (  # noqa: E402
    DTYPES,
    ROOT,
    ResultWriter,
    Timer,
    Timing,
    collect_env,
    combine_rounds,
    describe_exception,
    device_slug,
    load_kernel,
    log,
    out_mirror,
    run_docs_recipe,
    synchronize,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PROVIDERS = ("eager", "ours", "torch.compile", "ours+torch.compile", "liger")
KERNEL_LAYERS = ("RMSNorm", "GemmaRMSNorm", "GeGLUMLP", "Linear")
_TAGGED: list[type] = []  # classes this script opted in (replace_kernel_forward_from_hub), untagged afterwards


@dataclass(frozen=True)
class ModelSpec:
    name: str               # CSV op is e2e_<name>
    family: str             # "gemma" | "llama"
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int = 4096


MODELS = {
    "gemma2b": ModelSpec("gemma2b", "gemma", 2048, 16384, 8, 1, 256, 4),
    "llama3_8b": ModelSpec("llama3_8b", "llama", 4096, 14336, 32, 8, 128, 4),
    "llama3_2_1b": ModelSpec("llama3_2_1b", "llama", 2048, 8192, 32, 8, 64, 4),  # SwiGLU, the gated GEMMs' I=8192
}
TINY = {
    "gemma2b": ModelSpec("gemma2b", "gemma", 64, 256, 4, 1, 16, 2, vocab=256),
    "llama3_8b": ModelSpec("llama3_8b", "llama", 64, 224, 4, 2, 16, 2, vocab=256),
    "llama3_2_1b": ModelSpec("llama3_2_1b", "llama", 64, 128, 4, 2, 16, 2, vocab=256),
}


def build_model(spec: ModelSpec, device: str, dtype: torch.dtype, seq: int) -> nn.Module:
    import transformers as tf

    common = dict(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.inter,
                  num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                  head_dim=spec.head_dim, max_position_embeddings=max(4096, seq))
    torch.manual_seed(0)
    # Initialised on the device (a 4-layer Llama-3-8B stack has ~0.9 B parameters: CPU init would take seconds).
    with torch.device(device):
        if spec.family == "gemma":
            model = tf.GemmaForCausalLM(tf.GemmaConfig(hidden_act="gelu_pytorch_tanh", **common))
        else:
            model = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_act="silu", **common))
    return model.to(device, dtype)


def kernelize_model(model: nn.Module, device: str, mode_names: Sequence[str], layers: Sequence[str],
                    available: set[str], repo_path: Path) -> dict[str, int]:
    """Opts transformers' undecorated classes in, maps every layer name to this checkout, kernelizes; returns the
    number of modules whose forward is now one of our layers, per layer."""
    from kernels import LocalLayerRepository, Mode, kernelize, replace_kernel_forward_from_hub, use_kernel_mapping
    from transformers.models.gemma import modeling_gemma
    from transformers.models.llama import modeling_llama

    opt_in: list[tuple[type, str]] = [(modeling_gemma.GemmaRMSNorm, "GemmaRMSNorm"),
                                      (modeling_gemma.GemmaMLP, "GeGLUMLP"), (modeling_llama.LlamaMLP, "GeGLUMLP"),
                                      (nn.Linear, "Linear")]
    for cls, name in opt_in:
        if name in layers and name in available and getattr(cls, "kernel_layer_name", None) is None:
            replace_kernel_forward_from_hub(cls, name)
            _TAGGED.append(cls)
    mapping = {name: {device: LocalLayerRepository(repo_path=repo_path, layer_name=name)}
               for name in layers if name in available}
    mode = Mode.TRAINING if "training" in mode_names else Mode.INFERENCE
    if "compile" in mode_names:
        mode |= Mode.TORCH_COMPILE
    kernels_log = logging.getLogger("kernels")
    old = kernels_log.level
    kernels_log.setLevel(logging.ERROR)  # "no mapping for rotary_pos_emb" etc. is expected
    try:
        with use_kernel_mapping(mapping, inherit_mapping=False):
            kernelize(model, mode=mode, device=device)
    finally:
        kernels_log.setLevel(old)
    counts: dict[str, int] = {}
    for m in model.modules():
        fn = getattr(m.forward, "__func__", None)
        mod_name = getattr(fn, "__module__", "") or ""
        if fn is not None and mod_name.startswith("_fused_mlp") and mod_name.endswith(".layers"):
            layer = fn.__qualname__.split(".")[0]
            counts[layer] = counts.get(layer, 0) + 1
    return counts


def undo_opt_in() -> None:
    """Leave nn.Linear and transformers' classes as we found them (kernelize is per model, the tag is per class)."""
    while _TAGGED:
        cls = _TAGGED.pop()
        for attr in ("kernel_layer_name", "kernel_condition"):
            with contextlib.suppress(AttributeError):
                delattr(cls, attr)


def apply_liger(spec: ModelSpec) -> None:
    """Liger's documented patching (rms_norm + gated MLP; no RoPE / fused CE, as the anchor)."""
    from liger_kernel.transformers import apply_liger_kernel_to_gemma, apply_liger_kernel_to_llama

    kw = dict(rope=False, cross_entropy=False, fused_linear_cross_entropy=False, rms_norm=True)
    if spec.family == "gemma":
        apply_liger_kernel_to_gemma(geglu=True, **kw)
    else:
        apply_liger_kernel_to_llama(swiglu=True, **kw)


@dataclass
class _Ready:
    """A provider's model, built, kernelized / compiled and run once, waiting for its timed rounds."""

    prov: str
    base: dict
    model: nn.Module
    run: nn.Module
    params: list
    note: str
    setup_s: float
    peak: int | None
    loss: float


def run_model(spec: ModelSpec, args: argparse.Namespace, writer: ResultWriter, timer: Timer, device: str,
              available_layers: set[str], providers: Sequence[str], eager_losses: dict[str, float]) -> None:
    """Every provider's model is built and run once, then the training steps and the prefills are timed in
    interleaved rounds (rotating order; each round gives every provider rep_ms / rounds): the host is noisy and a
    provider timed in its own window can read 1.3x off (the kernelized Llama stack read 13.5-19.9 ms per step in
    single windows on one build). Peak memory: max_memory_allocated over one step minus what was allocated before the
    provider's model was built (its parameters, gradients and activations)."""
    dtype = DTYPES[args.dtype]
    op = f"e2e_{spec.name}"
    tokens = args.batch * args.seq
    shape = dict(L=spec.layers, T=tokens, H=spec.hidden, I=spec.inter)
    shape_s = f"L={spec.layers},B={args.batch},S={args.seq},H={spec.hidden},I={spec.inter}"
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec.vocab, (args.batch, args.seq), generator=gen).to(device)
    torch._dynamo.reset()
    ready: list[_Ready] = []

    def step_of(run: nn.Module):
        return lambda: run(input_ids=ids, labels=ids).loss.backward()

    def prefill_of(run: nn.Module):
        def f() -> None:
            with torch.no_grad():
                run(input_ids=ids)
        return f

    try:
        for prov in [p for p in PROVIDERS if p in providers]:
            base = dict(op=op, provider=prov, role="ours" if prov.startswith("ours") else "anchor", source="measured",
                        dtype=args.dtype, shape=shape_s, **shape)
            if prov == "liger" and device != "cuda":
                writer.add(**base, status="skipped: liger-kernel needs a CUDA GPU")
                continue
            if prov.startswith("ours") and not available_layers:
                writer.add(**base, status="skipped: the loaded kernel has no layers to kernelize")
                continue
            t0 = time.monotonic()
            model = None
            try:
                if prov == "liger":
                    apply_liger(spec)
                synchronize(device)
                mem0 = torch.cuda.memory_allocated() if device == "cuda" else 0
                model = build_model(spec, device, dtype, args.seq)
                note = ""
                if prov.startswith("ours"):
                    counts = kernelize_model(model, device, ["training"] + (["compile"] if "compile" in prov else []),
                                             args.kernel_layers.split(","), available_layers, args.kernel_path)
                    note = "kernelized: " + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
                    log(f"[{op}] {prov}: {note}")
                run = torch.compile(model) if "compile" in prov else model
                params = list(model.parameters())
                step = step_of(run)
                step()  # warm-up / compile
                synchronize(device)
                setup_s = time.monotonic() - t0
                for p in params:
                    p.grad = None
                peak = None
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                    step()
                    synchronize(device)
                    peak = int(torch.cuda.max_memory_allocated()) - mem0
                with torch.no_grad():
                    loss = float(run(input_ids=ids, labels=ids).loss.item())
                if prov == "eager":
                    eager_losses[spec.name] = loss
                ready.append(_Ready(prov, base, model, run, params, note, setup_s, peak, loss))
                log(f"[{op}] {prov}: ready in {setup_s:.0f} s, loss {loss:.5f}")
            except Exception as e:  # noqa: BLE001 - recorded, the other providers still run
                writer.add(**base, mode="train_step", status=f"error: {describe_exception(e)}")
                log(f"[{op}] {prov}: FAILED {describe_exception(e)}")
                del model
                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()

        def timed_rounds(fns: dict[str, tuple]) -> tuple[dict[str, Timing], dict[str, float]]:
            """Timings, and each provider's host time per call: the median over the rounds of the time one call takes
            to return with the device idle before it (the launches; the device runs behind). A host time close to
            the call's device time means the row measures the host as much as the kernels."""
            names = list(fns)
            per: dict[str, list[Timing]] = {n: [] for n in names}
            host: dict[str, list[float]] = {n: [] for n in names}
            for r in range(args.rounds):
                k = r % len(names) if names else 0
                for n in names[k:] + names[:k]:
                    fn, grads = fns[n]
                    per[n].append(timer.time(fn, grad_to_none=grads, warmup_ms=timer.warmup_ms / args.rounds,
                                             rep_ms=timer.rep_ms / args.rounds))
                    for p in grads or ():
                        p.grad = None
                    synchronize(device)
                    t0 = time.perf_counter()
                    fn()
                    host[n].append((time.perf_counter() - t0) * 1e3)
                    synchronize(device)
            return {n: combine_rounds(v) for n, v in per.items()}, {n: statistics.median(v) for n, v in host.items()}

        steps, host_step = timed_rounds({e.prov: (step_of(e.run), e.params) for e in ready})
        for e in ready:
            for p in e.params:
                p.grad = None
            if e.prov.startswith("ours") and "compile" not in e.prov:
                # Prefill through the INFERENCE-mode kernelization (what an inference user gets).
                kernelize_model(e.model, device, ["inference"], args.kernel_layers.split(","), available_layers,
                                args.kernel_path)
            prefill_of(e.run)()
        synchronize(device)
        prefills, host_pre = timed_rounds({e.prov: (prefill_of(e.run), None) for e in ready})
        eager_loss = eager_losses.get(spec.name)
        for e in ready:
            t_step, t_pre = steps[e.prov], prefills[e.prov]
            common = dict(e.base, status="ok", compile_s=e.setup_s if "compile" in e.prov else None,
                          max_err=abs(e.loss - eager_loss) if eager_loss is not None else None,
                          note=f"loss {e.loss:.6f}; {args.rounds} interleaved rounds" + (f"; {e.note}" if e.note else ""))
            hs, hp = host_step[e.prov], host_pre[e.prov]
            writer.add(**dict(common, note=f"{common['note']}; host {hs:.3f} ms per call"), mode="train_step",
                       time_p20_ms=t_step.p20, time_p50_ms=t_step.p50, time_p80_ms=t_step.p80,
                       tokens_per_s=tokens / t_step.p50 * 1e3, peak_mem_bytes=e.peak)
            writer.add(**dict(common, note=f"{common['note']}; host {hp:.3f} ms per call"), mode="prefill",
                       time_p20_ms=t_pre.p20, time_p50_ms=t_pre.p50, time_p80_ms=t_pre.p80,
                       tokens_per_s=tokens / t_pre.p50 * 1e3)
            log(f"[{op}] {e.prov}: step {t_step.p50:.2f} ms ({tokens / t_step.p50 * 1e3:.0f} tok/s; host {hs:.2f} ms), "
                f"prefill {t_pre.p50:.2f} ms (host {hp:.2f} ms), peak {e.peak / 1e9 if e.peak else float('nan'):.2f} "
                f"GB, loss {e.loss:.5f}")
    finally:
        if any(p.startswith("ours") for p in providers):
            undo_opt_in()
        ready.clear()
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    writer.checkpoint()
    _speedups(writer, op)


def _speedups(writer: ResultWriter, op: str) -> None:
    """Fill ``speedup_vs_best_anchor`` for this op's rows (best = fastest measured anchor per mode)."""
    rows = [r for r in writer.rows if r["op"] == op and r["status"] == "ok"]
    for mode in {r["mode"] for r in rows}:
        anchors = [r for r in rows if r["mode"] == mode and r["role"] == "anchor"]
        if not anchors:
            continue
        best = min(anchors, key=lambda r: float(r["time_p50_ms"]))
        for r in rows:
            if r["mode"] == mode:
                r["best_anchor"] = best["provider"]
                r["speedup_vs_best_anchor"] = f"{float(best['time_p50_ms']) / float(r['time_p50_ms']):.6g}"
    writer.checkpoint()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gemma2b,llama3_8b,llama3_2_1b", help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--providers", default=None, help=f"comma list of {', '.join(PROVIDERS)} (default GPU: eager,ours,"
                   "torch.compile,liger; CPU: eager,ours)")
    p.add_argument("--kernel-layers", default=",".join(KERNEL_LAYERS), help="layer names kernelize maps to this "
                   "checkout (default: all four)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; --tiny 2)")
    p.add_argument("--batch", type=int, default=None, help="default 2")
    p.add_argument("--seq", type=int, default=None, help="default 2048 (--tiny 32)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--tiny", action="store_true", help="tiny configs (a CPU smoke run of the same code)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--kernel", default=str(ROOT), help="checkout path (default: this one); kernelize maps the layers "
                   "to it with LocalLayerRepository")
    p.add_argument("--results-root", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--csv-name", default=None, help="default e2e.csv (with --sdpa-causal-skip: e2e_sdpa_causal_skip.csv)")
    p.add_argument("--sdpa-causal-skip", action="store_true", help="register docs/using-with-transformers.md's "
                   "recipe (SDPA is_causal=True instead of a materialised mask under torch.compile on torch < 2.14) "
                   "for every provider")
    p.add_argument("--fresh", action="store_true")
    p.add_argument("--warmup-ms", type=float, default=None, help="default GPU 25, CPU 20")
    p.add_argument("--rep-ms", type=float, default=None, help="default GPU 600, CPU 200 (split over the rounds; "
                   "several calls per round let the host run ahead of the device)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per model (default 3)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    on_gpu = device == "cuda"
    args.providers = (args.providers or ("eager,ours,torch.compile,liger" if on_gpu else "eager,ours")).split(",")
    unknown = [p for p in args.providers if p not in PROVIDERS]
    if unknown:
        raise SystemExit(f"unknown providers {unknown}; known: {', '.join(PROVIDERS)}")
    args.batch = args.batch or 2
    args.seq = args.seq or (32 if args.tiny else 2048)
    torch.backends.cuda.matmul.allow_tf32 = False
    # The loaded variant is the one kernelize's LocalLayerRepository loads (get_local_kernel on this checkout).
    args.kernel_path = Path(args.kernel).resolve()
    if not args.kernel_path.exists():
        raise SystemExit(f"--kernel must be a checkout path (LocalLayerRepository), got {args.kernel!r}")
    args.csv_name = args.csv_name or ("e2e_sdpa_causal_skip.csv" if args.sdpa_causal_skip else "e2e.csv")
    if args.sdpa_causal_skip:
        run_docs_recipe("sdpa-causal-skip")
        log("SDPA mask: docs/using-with-transformers.md's sdpa-causal-skip recipe registered for every provider")
    fm = load_kernel(str(args.kernel_path))
    available = {n for n in KERNEL_LAYERS if hasattr(getattr(fm, "layers", None), n)}
    missing = [n for n in args.kernel_layers.split(",") if n not in available]
    env = collect_env(device, fm)
    out = Path(args.results_root) / device_slug(env) / args.csv_name
    writer = ResultWriter(out, env, merge=not args.fresh,
                          mirror=out_mirror(device_slug(env), args.csv_name))
    log(f"fused-mlp e2e: {env['device_name']} ({device}), torch {env['torch']}, kernel {env['kernel_build']}, "
        f"layers available {sorted(available)}" + (f"; not in the kernel yet: {missing}" if missing else ""))
    warmup = args.warmup_ms if args.warmup_ms is not None else (25.0 if on_gpu else 20.0)
    rep = args.rep_ms if args.rep_ms is not None else (600.0 if on_gpu else 200.0)
    timer = Timer(device, warmup_ms=warmup, rep_ms=rep)
    specs = []
    for name in args.models.split(","):
        spec = (TINY if args.tiny else MODELS)[name]
        if args.layers:
            spec = ModelSpec(**{**spec.__dict__, "layers": args.layers})
        specs.append(spec)
    # Liger's patching replaces transformers' classes for the rest of the process: its rows come last, after every
    # model's other providers (a Llama model after a Liger-patched Llama would otherwise run Liger's modules).
    eager_losses: dict[str, float] = {}
    first = [p for p in args.providers if p != "liger"]
    for spec in specs:
        run_model(spec, args, writer, timer, device, available, first, eager_losses)
    if "liger" in args.providers:
        for spec in specs:
            run_model(spec, args, writer, timer, device, available, ["liger"], eager_losses)
    writer.checkpoint()
    log(f"wrote {out} in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
