#!/usr/bin/env python3
"""Decode benchmark: greedy ``generate()`` of transformers models with random weights, the plain model (``eager``)
against the same weights kernelized with this checkout (``ours``), with a DynamicCache (not compiled) and with
``cache_implementation="static"`` (transformers' auto-compile: Inductor, ``mode="reduce-overhead"``, CUDA graphs);
median ms per decoded token, kernelized / plain ratio per cell and the fraction of equal tokens.

    python benchmarks/decode.py                         # H200: llama3_2_1b, gemma2b; batch 1, 16, 64 (~6 min)
    python benchmarks/decode.py --models qwen3_1_7b     # the Qwen3-shaped model (28 layers: ~4 min, compile-bound)
    python benchmarks/decode.py --device cpu --quick    # tiny fp32 models, batch 1 and 2: a smoke run of the code
    python benchmarks/decode.py --dry-run               # the plan and a rough H200 time estimate

Models (configs built in code, random weights, no download; bf16 on CUDA): Llama-3.2-1B (hidden 2048, SwiGLU 8192,
16 layers, 32/8 heads, vocab 128256, tied embeddings), Gemma-2B (hidden 2048, tanh-GeGLU 16384, 18 layers, 8/1
heads of 256, vocab 256000), Qwen3-1.7B (hidden 2048, SwiGLU 6144, 28 layers, 16/8 heads of 128, q/k norms, vocab
151936). ``--quick`` builds 2-layer fp32 versions (hidden 64) of each. Kernelized the way a user does it:
``kernels.kernelize(model, mode=Mode.INFERENCE [| Mode.TORCH_COMPILE for the compiled cell], device=...)`` with
this checkout's ``RMSNorm``, ``GemmaRMSNorm``, ``GeGLUMLP`` and ``Linear`` (inference: bias-free projections at
T <= 16 take the decode GEMV) through ``LocalLayerRepository``; the classes transformers does not decorate (the Gemma
norm, the three MLPs, ``nn.Linear``) are opted in with ``replace_kernel_forward_from_hub`` and untagged afterwards.

Method:
* ``generate(ids, attention_mask, max_new_tokens=n, do_sample=False)`` on a random ``prompt``-token prompt of
  ``batch`` rows; EOS is disabled so every call decodes exactly ``n`` tokens. Static cells pass
  ``cache_implementation="static"`` and let transformers compile (on CUDA its default ``CompileConfig``; transformers
  refuses to compile on a CPU, so there the same config with ``mode="default"`` -- no CUDA graphs -- and its
  ``_compile_all_devices`` flag). Prefill is never compiled (transformers compiles the decode step only).
* ms/token = (time(n = ``new_tokens``) - time(n = 2)) / (``new_tokens`` - 2): the difference removes the prefill,
  the cache set-up and the first decode step of every call (with a new StaticCache, CUDA-graph trees re-record on
  that step: its tensors are marked static but have new addresses), leaving steady-state decode steps.
* Rounds are interleaved in one process (the GPU host is noisy), the provider order alternating per round; each round
  times one long and one short call per provider. p20/p50/p80 are quantiles over rounds of the per-round ms/token.
* Warm-up per (provider, cell): one long and one short call, untimed; its wall time is reported (``warmup_s``), and
  ``compile_s`` = warm-up long call - the median long call (compilation + CUDA-graph recording).
* Dynamo keeps its default automatic dynamic shapes, as a user's process gets them: batch 1 compiles a static graph,
  the next batch size a graph with a dynamic batch dimension that later sizes reuse (CUDA graphs are recorded per
  size): batch 4 is the first cell of that graph, where its decode kernels run by T at run time (T <= 16: batches 4
  and 16), 64 takes the GEMM path in it. ``--static-shapes`` specialises every batch size instead (one more compile per size). Compiled graphs are
  kept across rounds; ``torch._dynamo.reset()`` between models (transformers' forward wrapper is one code object for
  every model class, and each model instance is one more cache entry on it).
* Tokens: ``tokens_equal`` is the fraction of generated tokens equal to the plain model's in the same cell (same
  cache, same batch; ``first_mismatch`` the earliest differing position), ``tokens_equal_vs_dynamic`` the same
  against the plain model's DynamicCache tokens. Random-weight models have nearly flat logits, so bf16 rounding
  differences flip near-ties: the plain model's own static-vs-dynamic agreement is the scale to read them against.
* GPU busy time per token (CUDA, ``--busy-rounds`` profiled rounds after the timed ones): the same long - short
  difference over the union of the kernels' intervals in a ``torch.profiler`` trace (``bench_lib.gpu_busy_us``).
  A decode step is partly host-bound (generate's loop between graph replays; a third of the wall time on the H200's
  host), so the wall ratio moves by ~10% between runs while this one is steady: it says whether our kernels make
  the GPU's share faster or slower; the wall ratio is what a user gets.
* Dynamo's cache lookup per token (compiled cells, any device: one CPU-profiled long and short call per provider
  after the timed rounds, the same difference, ``bench_lib.dynamo_lookup_us``): the profiled range in which Dynamo
  evaluates the guards before each step's graph (profiler overhead included), where kernelize's per-instance
  forwards give the kernelized model more guards.
* Per row also: Dynamo graph breaks, graphs compiled and Inductor's CUDA-graph skips counted over that provider's
  calls in the cell (``torch._dynamo.utils.counters``).

Writes ``<results-root>/<device-slug>/decode.csv`` (rows of (model, cache) pairs not run are kept; copied to ``$OUT/<slug>/`` when
``$OUT`` is set) and ``decode.png`` next to it; prints a table with the ratios.
"""

from __future__ import annotations

import argparse
import copy
import gc
import logging
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "tests"))  # _utils.opted_in, shared with the tests

from bench_lib import (  # noqa: E402
    DTYPES,
    ENV_COLUMNS,
    QUANTILES,
    ROOT,
    ResultWriter,
    _percentile,
    collect_env,
    describe_exception,
    device_slug,
    dynamo_lookup_us,
    gpu_busy_us,
    load_kernel,
    log,
    out_mirror,
    read_rows,
    synchronize,
)
from _utils import opted_in  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

PROVIDERS = ("eager", "ours")
CACHES = ("static", "dynamic")  # static first: the compiled cells carry the targets and the compile cost
KERNEL_LAYERS = ("RMSNorm", "GemmaRMSNorm", "GeGLUMLP", "Linear")
COLUMNS = [
    *ENV_COLUMNS, "op", "model", "mode", "cache", "compiled", "batch", "provider", "role", "source", "shape", "dtype",
    "layers", "hidden", "intermediate", "vocab", "prompt_len", "new_tokens", "rounds", "compile_mode",
    "ms_per_token", "ms_per_token_p20", "ms_per_token_p80", "time_p50_ms", "tokens_per_s", "gen_ms", "short_gen_ms",
    "speedup_vs_plain", "best_anchor", "speedup_vs_best_anchor", "tokens_equal", "first_mismatch",
    "tokens_equal_vs_dynamic", "warmup_s", "compile_s", "graphs", "graph_breaks", "cudagraph_skips",
    "gpu_busy_ms_per_token", "busy_speedup_vs_plain", "dynamo_lookup_us_per_token", "status", "note",
]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # "llama" | "gemma" | "qwen3"
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    extra: dict[str, Any] = field(default_factory=dict)


MODELS = {
    "llama3_2_1b": ModelSpec("llama3_2_1b", "llama", 2048, 8192, 16, 32, 8, 64, 128256,
                             dict(tie_word_embeddings=True, rope_theta=500000.0)),
    "gemma2b": ModelSpec("gemma2b", "gemma", 2048, 16384, 18, 8, 1, 256, 256000),
    "qwen3_1_7b": ModelSpec("qwen3_1_7b", "qwen3", 2048, 6144, 28, 16, 8, 128, 151936,
                            dict(tie_word_embeddings=True, rope_theta=1000000.0)),
}
TINY = {
    "llama3_2_1b": ModelSpec("llama3_2_1b", "llama", 64, 224, 2, 4, 2, 16, 256, dict(tie_word_embeddings=True)),
    "gemma2b": ModelSpec("gemma2b", "gemma", 64, 256, 2, 4, 1, 16, 256),
    "qwen3_1_7b": ModelSpec("qwen3_1_7b", "qwen3", 64, 192, 2, 4, 2, 16, 256, dict(tie_word_embeddings=True)),
}


# ---------------------------------------------------------------------------------------------------------------
# Models and kernelization
# ---------------------------------------------------------------------------------------------------------------


def build_model(spec: ModelSpec, device: str, dtype: torch.dtype, max_positions: int) -> nn.Module:
    import transformers as tf

    common = dict(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.inter,
                  num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                  head_dim=spec.head_dim, max_position_embeddings=max_positions, attn_implementation="sdpa",
                  **spec.extra)
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialised in the final dtype, on the device: a 2.5 B model in seconds
    try:
        with torch.device(device):
            if spec.family == "gemma":
                model = tf.GemmaForCausalLM(tf.GemmaConfig(hidden_activation="gelu_pytorch_tanh", **common))
            elif spec.family == "llama":
                model = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_act="silu", **common))
            else:
                model = tf.Qwen3ForCausalLM(tf.Qwen3Config(hidden_act="silu", **common))
    finally:
        torch.set_default_dtype(old)
    # No .to(dtype): like from_pretrained(dtype=...), fp32 buffers computed at init (RoPE inv_freq) stay fp32.
    model = model.eval()
    # Norm weights away from their initial 0 (Gemma's 1 + w) / 1, so the norms' weights matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p), alpha=0.1)
    gc_ = model.generation_config
    gc_.eos_token_id = None  # every call decodes exactly max_new_tokens
    gc_.pad_token_id = 0
    gc_.do_sample = False
    return model


def _opt_in_classes() -> list[tuple[type, str]]:
    from transformers.models.gemma import modeling_gemma
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen3 import modeling_qwen3

    return [(modeling_gemma.GemmaRMSNorm, "GemmaRMSNorm"), (modeling_gemma.GemmaMLP, "GeGLUMLP"),
            (modeling_llama.LlamaMLP, "GeGLUMLP"), (modeling_qwen3.Qwen3MLP, "GeGLUMLP"), (nn.Linear, "Linear")]


def kernelized(model: nn.Module, device: str, compiled: bool, layers: Sequence[str], repo: Path) -> nn.Module:
    """A copy of ``model`` kernelized as a user does it (Mode.INFERENCE, | Mode.TORCH_COMPILE when it is compiled)."""
    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping

    mapping = {n: {device: LocalLayerRepository(repo_path=repo, layer_name=n)} for n in layers}
    mode = Mode.INFERENCE | Mode.TORCH_COMPILE if compiled else Mode.INFERENCE
    ours = copy.deepcopy(model)
    kernels_log = logging.getLogger("kernels")
    old = kernels_log.level
    kernels_log.setLevel(logging.ERROR)  # "no mapping for rotary_emb" etc. is expected: what was replaced is counted
    try:
        with opted_in([(cls, name) for cls, name in _opt_in_classes() if name in layers]), \
                use_kernel_mapping(mapping, inherit_mapping=False):
            kernelize(ours, mode=mode, device=device, use_fallback=True)
    finally:
        kernels_log.setLevel(old)
    return ours


def replaced_counts(model: nn.Module) -> dict[str, int]:
    """Our layer name -> number of modules whose forward it now is."""
    counts: dict[str, int] = {}
    for m in model.modules():
        fn = getattr(vars(m).get("forward"), "__func__", None)
        mod = getattr(fn, "__module__", "") or ""
        if fn is not None and "fused_mlp" in mod and mod.endswith(".layers"):
            name = fn.__qualname__.split(".")[0]
            counts[name] = counts.get(name, 0) + 1
    return counts


# ---------------------------------------------------------------------------------------------------------------
# Generation, timing, counters
# ---------------------------------------------------------------------------------------------------------------


def compile_config(device: str, backend: str, mode: str | None):
    """transformers' default CompileConfig on CUDA; on the CPU (which transformers refuses) the same with
    ``mode="default"`` (no CUDA graphs) and its ``_compile_all_devices`` flag."""
    from transformers import CompileConfig

    cfg = CompileConfig()
    if backend != cfg.backend:
        cfg.backend = backend
    if device != "cuda":
        cfg.mode = "default"
        cfg._compile_all_devices = True
    if mode is not None:
        cfg.mode = mode
    return cfg


_COUNTED = (("graph_breaks", "graph_break", None), ("graphs", "stats", "unique_graphs"),
            ("cudagraph_skips", "inductor", "cudagraph_skips"))


def counter_snapshot() -> dict[str, int]:
    from torch._dynamo.utils import counters

    out = {}
    for name, group, key in _COUNTED:
        out[name] = sum(counters[group].values()) if key is None else int(counters[group].get(key, 0))
    return out


@dataclass
class Stats:
    times_long: list[float] = field(default_factory=list)
    times_short: list[float] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: {k: 0 for k, _, _ in _COUNTED})
    warmup_s: float = 0.0
    warmup_long_s: float = 0.0
    tokens: torch.Tensor | None = None
    busy_ms: list[float] = field(default_factory=list)  # GPU busy ms per token, one per profiled pair of calls
    lookup_us: float | None = None  # Dynamo's cache lookup (guards), host us per token, compiled cells
    dropped_rounds: int = 0  # timed rounds whose short call took longer than the long one (host noise)
    error: str | None = None


def timed_generate(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, n: int, static: bool, cfg,
                   device: str, stats: Stats) -> tuple[float, torch.Tensor]:
    kw: dict[str, Any] = dict(attention_mask=mask, max_new_tokens=n, do_sample=False)
    if static:
        kw.update(cache_implementation="static", compile_config=cfg)
    before = counter_snapshot()
    synchronize(device)
    t0 = time.perf_counter()
    out = model.generate(ids, **kw)
    synchronize(device)
    dt = time.perf_counter() - t0
    after = counter_snapshot()
    for k in stats.counts:
        stats.counts[k] += after[k] - before[k]
    if out.shape[1] != ids.shape[1] + n:
        raise RuntimeError(f"generate returned {out.shape[1] - ids.shape[1]} new tokens, expected {n}")
    return dt, out[:, ids.shape[1]:]


def equal_fraction(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int | None]:
    """Fraction of equal tokens and the earliest position (over rows) where they differ (None: identical)."""
    eq = a == b
    frac = float(eq.float().mean().item())
    if bool(eq.all()):
        return frac, None
    first = [int((~row).nonzero()[0].item()) for row in eq if not bool(row.all())]
    return frac, min(first)


# ---------------------------------------------------------------------------------------------------------------
# One model
# ---------------------------------------------------------------------------------------------------------------


def run_model(spec: ModelSpec, args: argparse.Namespace, writer: ResultWriter, device: str, t_start: float) -> None:
    dtype = DTYPES[args.dtype]
    op = f"decode_{spec.name}"
    torch._dynamo.reset()
    t0 = time.monotonic()
    plain = build_model(spec, device, dtype, args.prompt_len + args.new_tokens + 16)
    models: dict[tuple[str, bool], nn.Module] = {}
    notes: dict[str, str] = {}
    for cache in args.caches:
        compiled = cache == "static"
        for prov in args.providers:
            if prov == "eager":
                models[(prov, compiled)] = plain
            elif (prov, compiled) not in models:
                ours = kernelized(plain, device, compiled, args.kernel_layers, args.kernel_path)
                counts = replaced_counts(ours)
                if not counts:
                    raise RuntimeError("kernelize replaced nothing: the layers did not load")
                notes[f"ours:{compiled}"] = "kernelized " + " ".join(f"{k}x{v}" for k, v in sorted(counts.items()))
                models[(prov, compiled)] = ours
    kernelized_note = notes.get("ours:True", notes.get("ours:False", ""))
    log(f"[{op}] built and kernelized in {time.monotonic() - t0:.1f} s: {kernelized_note}")
    cfg = compile_config(device, args.backend, args.compile_mode)
    dynamic_tokens: dict[int, torch.Tensor] = {}
    pending: list[tuple[dict[str, str], int, torch.Tensor]] = []
    base = dict(op=op, model=spec.name, dtype=args.dtype, layers=spec.layers, hidden=spec.hidden,
                intermediate=spec.inter, vocab=spec.vocab, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                rounds=args.rounds, source="measured")
    for cache in args.caches:
        static = cache == "static"
        for batch in args.batches:
            cell = dict(base, mode=cache, cache=cache, compiled=static, batch=batch, shape=f"B={batch}",
                        compile_mode=f"{cfg.backend}/{cfg.mode}" if static else "")
            if time.monotonic() - t_start > args.budget_s:
                for prov in args.providers:
                    writer.add(**cell, provider=prov, role="ours" if prov == "ours" else "anchor",
                               status="skipped: time budget spent")
                writer.checkpoint()
                log(f"[{op}] {cache} B={batch}: skipped (budget of {args.budget_s:.0f} s spent)")
                continue
            rows, tokens = run_cell(spec, args, device, static, batch, cfg, models, dynamic_tokens)
            for prov, row in rows.items():
                note = "; ".join(filter(None, [row.pop("note", ""), notes.get(f"ours:{static}", "")
                                               if prov == "ours" else ""]))
                written = writer.add(**cell, **row, note=note)
                if static and prov in tokens:
                    pending.append((written, batch, tokens[prov]))
            writer.checkpoint()
    # Static cells run first: their agreement with the plain model's DynamicCache tokens is filled in afterwards.
    for written, batch, toks in pending:
        if batch in dynamic_tokens:
            written["tokens_equal_vs_dynamic"] = f"{equal_fraction(toks, dynamic_tokens[batch])[0]:.6g}"
    writer.checkpoint()
    del models, plain
    gc.collect()
    torch._dynamo.reset()
    if device == "cuda":
        torch.cuda.empty_cache()


def run_cell(spec: ModelSpec, args: argparse.Namespace, device: str, static: bool, batch: int, cfg,
             models: dict[tuple[str, bool], nn.Module], dynamic_tokens: dict[int, torch.Tensor]
             ) -> tuple[dict[str, dict], dict[str, torch.Tensor]]:
    """Warm-up, interleaved rounds and the rows of one (model, cache, batch) cell; also each provider's tokens."""
    op = f"decode_{spec.name}"
    cache = "static" if static else "dynamic"
    gen = torch.Generator().manual_seed(1000 + batch)
    ids = torch.randint(0, spec.vocab, (batch, args.prompt_len), generator=gen).to(device)
    mask = torch.ones_like(ids)
    n_long, n_short = args.new_tokens, 2
    stats = {p: Stats() for p in args.providers}
    t_cell = time.monotonic()
    # Warm-up per provider: compilation and CUDA-graph recording (the long call first: the static cache is sized by
    # the first call's length and reused by the shorter ones; a longer second call would recompile).
    for prov in args.providers:
        st = stats[prov]
        try:
            w0 = time.perf_counter()
            st.warmup_long_s, st.tokens = timed_generate(models[(prov, static)], ids, mask, n_long, static, cfg,
                                                         device, st)
            timed_generate(models[(prov, static)], ids, mask, n_short, static, cfg, device, st)
            st.warmup_s = time.perf_counter() - w0
            log(f"[{op}] {cache} B={batch} {prov}: warm-up {st.warmup_s:.1f} s (graphs {st.counts['graphs']}, "
                f"graph breaks {st.counts['graph_breaks']}, cudagraph skips {st.counts['cudagraph_skips']})")
        except Exception as e:  # noqa: BLE001 - recorded; the other provider still runs
            st.error = describe_exception(e)
            log(f"[{op}] {cache} B={batch} {prov}: FAILED {st.error}")
    live = [p for p in args.providers if stats[p].error is None]
    # A round whose short call outlasted its long one measured a host hiccup, not a token (seen on a loaded 2-core
    # CPU): it is dropped and repeated, up to twice the rounds asked for.
    for r in range(3 * args.rounds):
        live = [p for p in live if len(stats[p].times_long) < args.rounds]
        if not live:
            break
        order = live if r % 2 == 0 else live[::-1]
        for prov in order:
            st = stats[prov]
            model = models[(prov, static)]
            try:
                t_long, _ = timed_generate(model, ids, mask, n_long, static, cfg, device, st)
                t_short, _ = timed_generate(model, ids, mask, n_short, static, cfg, device, st)
                if t_long > t_short:
                    st.times_long.append(t_long)
                    st.times_short.append(t_short)
                else:
                    st.dropped_rounds += 1
            except Exception as e:  # noqa: BLE001
                st.error = describe_exception(e)
        live = [p for p in live if stats[p].error is None]
    live = [p for p in args.providers if stats[p].error is None and stats[p].times_long]
    # GPU busy time per token (CUDA): the same long - short difference over the profiler's kernel intervals, after
    # the timed rounds (the profiler's own overhead stays out of them).
    for r in range(args.busy_rounds if device == "cuda" else 0):
        for prov in (live if r % 2 == 0 else live[::-1]):
            model = models[(prov, static)]
            st = stats[prov]
            k_long: dict[str, float] = {}
            k_short: dict[str, float] = {}
            try:
                b_long = gpu_busy_us(lambda: timed_generate(model, ids, mask, n_long, static, cfg, device, st), k_long)
                b_short = gpu_busy_us(lambda: timed_generate(model, ids, mask, n_short, static, cfg, device, st),
                                      k_short)
                st.busy_ms.append((b_long - b_short) / 1e3 / (n_long - n_short))
                if r == 0 and args.busy_top:
                    per_token = {k: (v - k_short.get(k, 0.0)) / (n_long - n_short) for k, v in k_long.items()}
                    top = sorted(per_token.items(), key=lambda kv: -kv[1])[:args.busy_top]
                    log(f"[{op}] {cache} B={batch} {prov}: top kernels, us per token: "
                        + "; ".join(f"{us:.1f} {name[:100]}" for name, us in top))
            except Exception as e:  # noqa: BLE001 - the wall-time rows stand without it
                log(f"[{op}] {cache} B={batch} {prov}: GPU busy not measured: {describe_exception(e)}")
                break
    # Compiled cells: the profiled host range of Dynamo's cache lookup (guard evaluation) per token, the long - short
    # difference over one CPU-profiled pair of calls per provider: part of the step's host loop, where a kernelized
    # model checks more guards than the plain one (docs/tuning-log.md#compile-guards).
    for prov in live if static else ():
        model = models[(prov, static)]
        st = stats[prov]
        try:
            l_long = dynamo_lookup_us(lambda: timed_generate(model, ids, mask, n_long, static, cfg, device, st))
            l_short = dynamo_lookup_us(lambda: timed_generate(model, ids, mask, n_short, static, cfg, device, st))
            st.lookup_us = (l_long - l_short) / (n_long - n_short)
        except Exception as e:  # noqa: BLE001 - the wall-time rows stand without it
            log(f"[{op}] {cache} B={batch} {prov}: Dynamo lookup not measured: {describe_exception(e)}")

    rows: dict[str, dict] = {}
    busy: dict[str, float] = {}
    ms: dict[str, float] = {}
    for prov in args.providers:
        st = stats[prov]
        role = "ours" if prov == "ours" else "anchor"
        counts = dict(st.counts)
        if st.error is not None or not st.times_long:
            why = st.error or f"no timed round with the long call longer than the short one ({st.dropped_rounds} tried)"
            rows[prov] = dict(provider=prov, role=role, status=f"error: {why}", **counts)
            continue
        per_token = sorted((tl - ts) * 1e3 / (n_long - n_short) for tl, ts in zip(st.times_long, st.times_short))
        p20, p50, p80 = (_percentile(per_token, q) for q in QUANTILES)
        gen_ms = statistics.median(st.times_long) * 1e3
        ms[prov] = p50
        rows[prov] = dict(provider=prov, role=role, status="ok", ms_per_token=p50, ms_per_token_p20=p20,
                          ms_per_token_p80=p80, time_p50_ms=p50, tokens_per_s=batch * 1e3 / p50, gen_ms=gen_ms,
                          short_gen_ms=statistics.median(st.times_short) * 1e3, warmup_s=st.warmup_s,
                          compile_s=max(st.warmup_long_s * 1e3 - gen_ms, 0.0) / 1e3, **counts)
        if st.busy_ms:
            busy[prov] = rows[prov]["gpu_busy_ms_per_token"] = statistics.median(st.busy_ms)
        if st.lookup_us is not None:
            rows[prov]["dynamo_lookup_us_per_token"] = st.lookup_us
        if st.dropped_rounds:
            rows[prov]["note"] = f"{st.dropped_rounds} timed round(s) repeated: the short call outlasted the long one"
    plain_tokens = stats["eager"].tokens if "eager" in stats else None
    if not static and plain_tokens is not None:
        dynamic_tokens[batch] = plain_tokens
    for prov, row in rows.items():
        st = stats[prov]
        if st.tokens is None:
            continue
        if plain_tokens is not None and prov != "eager":
            frac, first = equal_fraction(st.tokens, plain_tokens)
            row.update(tokens_equal=frac, first_mismatch=first)
        if batch in dynamic_tokens and not (prov == "eager" and not static):  # (not the plain model vs itself)
            row["tokens_equal_vs_dynamic"] = equal_fraction(st.tokens, dynamic_tokens[batch])[0]
        if "eager" in ms and prov in ms:
            row.update(speedup_vs_plain=ms["eager"] / ms[prov], best_anchor="eager",
                       speedup_vs_best_anchor=ms["eager"] / ms[prov])
        if "eager" in busy and prov in busy and busy[prov] > 0:
            row["busy_speedup_vs_plain"] = busy["eager"] / busy[prov]
    summary = " ".join(f"{p}={ms[p]:.3f}" for p in ms)
    ratio = f", ours/plain speed {ms['eager'] / ms['ours']:.3f}x" if {"eager", "ours"} <= ms.keys() else ""
    if {"eager", "ours"} <= busy.keys() and busy["ours"] > 0:
        ratio += (f"; GPU busy ms/token eager={busy['eager']:.3f} ours={busy['ours']:.3f}, "
                  f"{busy['eager'] / busy['ours']:.3f}x")
    lookups = {p: stats[p].lookup_us for p in ("eager", "ours") if p in stats and stats[p].lookup_us is not None}
    if len(lookups) == 2:
        ratio += f"; Dynamo lookup us/token eager={lookups['eager']:.1f} ours={lookups['ours']:.1f}"
    eq = rows.get("ours", {}).get("tokens_equal")
    log(f"[{op}] {cache} B={batch}: ms/token {summary}{ratio}" + (f", tokens equal {eq:.3f}" if eq is not None else "")
        + f" ({time.monotonic() - t_cell:.1f} s)")
    return rows, {p: st.tokens for p, st in stats.items() if st.tokens is not None}


# ---------------------------------------------------------------------------------------------------------------
# Table, plot, CLI
# ---------------------------------------------------------------------------------------------------------------


def print_table(rows: list[dict[str, str]]) -> None:
    """model, cache, batch: plain and ours ms/token, ratio, GPU-busy ratio, tokens equal."""
    cells: dict[tuple[str, str, str], dict[str, dict[str, str]]] = {}
    for r in rows:
        if r.get("status") == "ok":
            cells.setdefault((r["model"], r["cache"], r["batch"]), {})[r["provider"]] = r
    log(f"\n{'model':<14} {'cache':<8} {'batch':>5} {'plain ms/tok':>13} {'ours ms/tok':>12} {'ours/plain':>10} "
        f"{'GPU busy':>9} {'tokens equal':>12} {'compile s (plain/ours)':>23}")
    for (model, cache, batch), by in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1], int(kv[0][2]))):
        e, o = by.get("eager"), by.get("ours")
        fe = float(e["ms_per_token"]) if e else float("nan")
        fo = float(o["ms_per_token"]) if o else float("nan")
        eq = o.get("tokens_equal", "") if o else ""
        comp = "/".join(f"{float(x['compile_s']):.1f}" if x and x.get("compile_s") else "-" for x in (e, o))
        busy = f"{float(o['busy_speedup_vs_plain']):.3f}x" if o and o.get("busy_speedup_vs_plain") else "-"
        log(f"{model:<14} {cache:<8} {batch:>5} {fe:>13.3f} {fo:>12.3f} {fe / fo:>9.3f}x {busy:>9} {eq:>12} {comp:>23}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=None, help=f"comma list of {', '.join(MODELS)} (default: llama3_2_1b,gemma2b; "
                   "--quick: all three, tiny)")
    p.add_argument("--batches", default=None, help="comma list (default 1,4,16,64; --quick 1,2)")
    p.add_argument("--caches", default=",".join(CACHES), help="comma list of static (compiled), dynamic (eager)")
    p.add_argument("--providers", default=",".join(PROVIDERS))
    p.add_argument("--rounds", type=int, default=None, help="interleaved timed rounds (default 5; --quick 2)")
    p.add_argument("--busy-rounds", type=int, default=2, help="profiled rounds for the GPU busy time per token "
                   "(CUDA; after the timed rounds; 0: none)")
    p.add_argument("--busy-top", type=int, default=6, help="log the N kernels with the most GPU time per token "
                   "(first profiled round; 0: none)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens per timed call (default 48; --quick 24)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 64 (--quick 16)")
    p.add_argument("--layers", type=int, default=None, help="override the decoder layer count")
    p.add_argument("--quick", action="store_true", help="tiny 2-layer fp32 models, batch 1 and 2 (a CPU smoke run)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--backend", default="inductor", help="torch.compile backend of the static cells (default "
                   "inductor, transformers' default; aot_eager skips Inductor's code generation, for CPU smoke runs)")
    p.add_argument("--compile-mode", default=None, help="override the CompileConfig mode (default: reduce-overhead on "
                   "CUDA, default on the CPU)")
    p.add_argument("--static-shapes", action="store_true", help="one specialised graph per batch size (dynamo's "
                   "automatic_dynamic_shapes off) instead of the default dynamic batch dimension")
    p.add_argument("--kernel", default=str(ROOT), help="checkout path; kernelize maps the layers to it")
    p.add_argument("--kernel-layers", default=",".join(KERNEL_LAYERS))
    p.add_argument("--budget-s", type=float, default=None, help="no new cell starts after this many seconds (default "
                   "GPU 330, CPU 1800); skipped cells are written as such")
    p.add_argument("--results-root", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--csv-name", default="decode.csv")
    p.add_argument("--fresh", action="store_true", help="start a new CSV instead of replacing only this run's (model, cache) rows")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="print the plan and a rough H200 time estimate")
    args = p.parse_args(argv)
    args.model_names = (args.models or ("llama3_2_1b,gemma2b,qwen3_1_7b" if args.quick else
                                        "llama3_2_1b,gemma2b")).split(",")
    unknown = [m for m in args.model_names if m not in MODELS]
    if unknown:
        p.error(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    args.batches = [int(b) for b in (args.batches or ("1,2" if args.quick else "1,4,16,64")).split(",")]
    args.caches = [c for c in args.caches.split(",") if c]
    args.providers = [q for q in args.providers.split(",") if q]
    if any(c not in CACHES for c in args.caches) or any(q not in PROVIDERS for q in args.providers):
        p.error(f"--caches takes {CACHES}, --providers {PROVIDERS}")
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.new_tokens = args.new_tokens or (24 if args.quick else 48)  # quick: 22 tokens of difference outlast CPU jitter
    if args.new_tokens < 4:
        p.error("--new-tokens must be >= 4 (ms/token is the difference of a long and a 2-token call)")
    args.prompt_len = args.prompt_len or (16 if args.quick else 64)
    args.kernel_layers = [n for n in args.kernel_layers.split(",") if n]
    return args


# Rough H200-host model for --dry-run (never written to a CSV): compile seconds per graph and decoder layer, and
# per-token decode time per layer (DynamicCache eager is host-bound, ~11 ms/token for 16 layers; the static compiled
# step is CUDA-graph replay, ~3 ms/token). Compile: on the 2-core CPU machine a 16-layer decode graph (tiny widths: the
# node count does not depend on them) took 3.4 s of Dynamo tracing and ~13 s of Dynamo + AOT + Inductor lowering in
# the main process, plus the kernels' compilation in workers; the estimate assumes about the same on the GPU host
# with Triton in parallel workers.
_EST_COMPILE_S_PER_LAYER, _EST_COMPILE_S_BASE = 0.9, 6.0
_EST_EAGER_MS_PER_LAYER, _EST_STATIC_MS_PER_LAYER, _EST_BUILD_S, _EST_STARTUP_S = 0.7, 0.18, 12.0, 25.0


def dry_run(args: argparse.Namespace) -> int:
    total = _EST_STARTUP_S
    for name in args.model_names:
        spec = (TINY if args.quick else MODELS)[name]
        layers = args.layers or spec.layers
        graphs = (len(args.batches) if args.static_shapes else min(len(args.batches), 2)) * len(args.providers)
        compile_s = graphs * (_EST_COMPILE_S_BASE + _EST_COMPILE_S_PER_LAYER * layers) if "static" in args.caches else 0
        meas = 0.0
        for cache in args.caches:
            per_tok = (_EST_STATIC_MS_PER_LAYER if cache == "static" else _EST_EAGER_MS_PER_LAYER) * layers
            rounds = args.rounds + 1 + args.busy_rounds + (cache == "static")  # + the Dynamo-lookup pair
            calls = rounds * len(args.providers) * len(args.batches)
            meas += calls * (args.new_tokens + 2) * per_tok / 1e3
        s = _EST_BUILD_S + compile_s + meas
        total += s
        print(f"{name}: {layers} layers, batches {args.batches}, caches {args.caches}, {args.rounds} rounds: "
              f"{graphs if 'static' in args.caches else 0} compiled graphs (~{compile_s:.0f} s), measuring "
              f"~{meas:.0f} s; ~{s:.0f} s")
    print(f"total ~{total:.0f} s (rough H200 model; --budget-s {args.budget_s or 330:.0f} stops new cells)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    t_start = time.monotonic()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    args.dtype = args.dtype or ("bf16" if device == "cuda" and not args.quick else "fp32")
    args.budget_s = args.budget_s if args.budget_s is not None else (330.0 if device == "cuda" else 1800.0)
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.static_shapes:
        torch._dynamo.config.automatic_dynamic_shapes = False
    # A few more cache entries than the default 8 per code object: plain and kernelized instances of one model, each
    # with a batch-1 and a dynamic-batch graph (or one per batch with --static-shapes), share transformers' wrapper.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))
    args.kernel_path = Path(args.kernel).resolve()
    fm = load_kernel(str(args.kernel_path))
    missing = [n for n in args.kernel_layers if not hasattr(fm.layers, n)]
    if missing:
        raise SystemExit(f"the loaded kernel has no layers {missing}")
    sys.path.insert(0, str(ROOT / "tools"))
    from hf_compat import hub_kernels_problem  # the transformers / kernels pair must keep the hooks on

    problem = hub_kernels_problem()
    if problem:
        raise SystemExit(problem)
    env = collect_env(device, fm)
    slug = device_slug(env)
    out = Path(args.results_root) / slug / args.csv_name
    writer = ResultWriter(out, env, merge=not args.fresh, mirror=out_mirror(slug, args.csv_name), columns=COLUMNS,
                          key=lambda r: (r.get("model", ""), r.get("cache", ""), r.get("dtype", "")))
    log(f"fused-mlp decode: {env['device_name']} ({device}), torch {env['torch']}, transformers {env['transformers']}, "
        f"kernels {env['kernels']}, kernel {env['kernel_build']}, git {env['git_rev']}; models {args.model_names}, "
        f"batches {args.batches}, caches {args.caches}, {args.rounds} rounds, {args.prompt_len} + {args.new_tokens} "
        f"tokens, {args.dtype}; budget {args.budget_s:.0f} s")
    for name in args.model_names:
        spec = (TINY if args.quick else MODELS)[name]
        if args.layers:
            spec = replace(spec, layers=args.layers)
        try:
            run_model(spec, args, writer, device, t_start)
        except Exception as e:  # noqa: BLE001 - one model's failure keeps the others' rows
            log(f"[decode_{name}] FAILED: {describe_exception(e)}")
            writer.add(op=f"decode_{name}", model=name, dtype=args.dtype, provider="*", source="measured",
                       status=f"error: {describe_exception(e)}")
        writer.checkpoint()
        gc.collect()
    print_table(writer.rows)
    if not args.no_plot:
        try:
            from plot import plot_decode

            merged = read_rows(out)  # this run's rows and the kept ones of other models
            for target in filter(None, [out, writer.mirror]):
                path = plot_decode(merged, target.parent)
                if path:
                    log(f"wrote {path}")
        except ImportError as e:  # matplotlib missing: the CSV is the result
            log(f"no plot: {e}")
    log(f"wrote {out} in {time.monotonic() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
