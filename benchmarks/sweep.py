#!/usr/bin/env python3
"""One sweep for every fused-mlp op against every anchor: ours vs eager PyTorch (the transformers modules) vs
``torch.nn.RMSNorm`` vs ``torch.compile`` vs Liger-Kernel (vs quack where importable), fwd / bwd / fwd+bwd.

    python benchmarks/sweep.py                         # full sweep on the GPU (budgeted: <= 4.5 minutes)
    python benchmarks/sweep.py --quick                 # the target shapes only (~1.5 minutes on an H200)
    python benchmarks/sweep.py --ops rms_norm,add_rms_norm --providers ours,liger --modes fwd
    python benchmarks/sweep.py --device cpu            # CPU mode (CPU variant, CPU-sized shapes)
    python benchmarks/sweep.py --modes fwd_graph       # CUDA-graph device time at decode sizes (~2 minutes)

Writes ``<results-root>/<device-slug>/sweep.csv`` (long format, see ``bench_lib.COLUMNS``), rewritten after every
shape; rows of ops not measured in this run are kept, so one op can be rerun alone. When ``$OUT`` is set (the GPU
machine), every checkpoint is also copied to ``$OUT/<device-slug>/sweep.csv``. Then ``plot.py`` draws it and
``report.py`` turns it into the results page with every target of ``docs/targets.md`` marked met / not met.

Definitions (as the anchors in benchmarks/anchors/ were measured, see anchor_bench.py there):
* ``fwd`` is the forward with autograd recording (the inputs and weights require grad, as in training), except
  ``add_rms_norm`` and ``addmm`` (inference: under ``no_grad``; addmm's anchors, ``torch._addmm_activation`` (no
  autograd formula) and mm alone, are inference calls, so its derived bwd row is (training fwd+bwd) - (inference
  fwd) and its note says so); ``fwd+bwd`` is forward + ``backward(dy)``; ``bwd`` is (fwd+bwd) - fwd of the
  medians. Leaf ``.grad`` are reset to None before every timed call (``grad_to_none``), so no provider pays for
  accumulating into an existing gradient.
* Timing (the host is shared and noisy): per shape every provider is first made, run once and checked; then all
  are timed in ``--rounds`` interleaved rounds (default 3; the provider order rotates each round): per round one
  ``bench_lib.Timer`` call per provider and mode, with warmup-ms, rep-ms and the CPU floor of 5 calls divided by
  the rounds (the total of one timing, except that a call longer than rep-ms / rounds still runs at least once per
  round, plus do_bench's estimate). Per provider and mode: p50 = the median of the rounds' medians; p20 / p80 = the
  20th / 80th percentile of the rounds' p20s / p80s (the band holds the spread within and across rounds;
  ``--rounds 1`` is one timing, as before). Timed rows' note: "3 interleaved rounds". Peak memory (fwd+bwd) is
  measured once, after the rounds.
* Bytes: RMSNorm fwd = read x + write y + read w; bwd = read x, dy + write dx + read w (dW partials not counted);
  fused add + RMSNorm fwd = read x, residual + write y, h; gated activation fwd = read gate, up + write out, bwd =
  read gate, up, dout + write dgate, dup. FLOPs: GEMM 2*M*K*N (fwd), 3x that for fwd+bwd; the GeGLU MLP 3 GEMMs.
* Every shape is first verified: ours vs the fp32 reference (fp64 for GEMMs) with the 2x rule against the same
  dtype eager PyTorch result; the errors of every provider are recorded too (``max_err``).
* ``torch.compile``: one compilation per static size (N for RMSNorm, (H, I) for the MLP, (K, N) for GEMMs) with the
  token dimension marked dynamic (size 1 specialises: one more graph); reductions thus keep a static reduction
  size, as a per-shape compile would. Compilation has its own share of each op's time budget; shapes past it are
  skipped for ``torch.compile`` only and say so in the CSV.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lib import (  # noqa: E402
    DTYPES,
    ROOT,
    Budget,
    Ceilings,
    ResultWriter,
    Timer,
    Timing,
    collect_env,
    combine_rounds,
    cuda_graph_times,
    describe_exception,
    device_slug,
    load_kernel,
    log,
    max_abs_err,
    measure_ceilings,
    out_mirror,
    peak_memory,
    shape_str,
    synchronize,
    two_x_rule,
)

EPS = 1e-6
ANCHORS_DIR = Path(__file__).resolve().parent / "anchors"
QUACK_RECORDED = "quack (recorded, not run)"


class Skip(Exception):
    """A provider or op that cannot run here; the message is the reason written to the CSV."""


# ---------------------------------------------------------------------------------------------------------------
# The transformers modules the providers wrap (local copies only when transformers is not installed)
# ---------------------------------------------------------------------------------------------------------------


class _LlamaRMSNormCopy(nn.Module):
    """transformers' LlamaRMSNorm, as written there (used only when transformers is missing)."""

    def __init__(self, n: int, eps: float = EPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class _GemmaRMSNormCopy(nn.Module):
    def __init__(self, dim: int, eps: float = EPS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class _GemmaMLPCopy(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act_fn = nn.GELU(approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def llama_rms_norm(n: int) -> nn.Module:
    try:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
    except ImportError:
        return _LlamaRMSNormCopy(n)
    return LlamaRMSNorm(n, eps=EPS)


def gemma_rms_norm(n: int) -> nn.Module:
    try:
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    except ImportError:
        return _GemmaRMSNormCopy(n)
    return GemmaRMSNorm(n, eps=EPS)


def gemma_mlp(hidden: int, inter: int) -> nn.Module:
    try:
        import transformers
        from transformers.models.gemma.modeling_gemma import GemmaMLP
    except ImportError:
        return _GemmaMLPCopy(hidden, inter)
    cfg = transformers.GemmaConfig(hidden_size=hidden, intermediate_size=inter, hidden_act="gelu_pytorch_tanh")
    return GemmaMLP(cfg)


# ---------------------------------------------------------------------------------------------------------------
# Context, cases, providers, ops
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Ctx:
    device: str
    dtype: torch.dtype
    dtype_name: str
    fm: types.ModuleType
    timer: Timer
    ceilings: Ceilings
    writer: ResultWriter
    args: argparse.Namespace
    compile_spent: dict[str, float] = field(default_factory=dict)
    compiled_keys: dict[str, set] = field(default_factory=dict)
    compile_budget_s: float = math.inf

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"


@dataclass
class Case:
    """One shape of one op: inputs (created once, shared by all providers), analytic costs and the reference."""

    shape: dict[str, int]
    tokens: int                     # M or T: the dimension torch.compile treats as dynamic
    static_key: tuple               # the sizes torch.compile specialises on
    inputs: dict[str, Any]
    leaves: list[torch.Tensor]      # their .grad is reset before each timed call
    grad_out: torch.Tensor | None
    bytes: dict[str, int]           # per measured mode ("fwd", "bwd")
    flops: dict[str, int]
    reference: Callable[[], torch.Tensor]        # high-precision output (first output)
    eager: Callable[[], Any]                     # same-dtype PyTorch result: the 2x-rule baseline
    working_set: int


@dataclass
class Bound:
    """A provider bound to a case: ``fwd()`` returns the output (or a tuple whose first item is checked)."""

    fwd: Callable[[], Any]
    leaves: list[torch.Tensor] | None = None      # default: the case's
    grad_out: torch.Tensor | None = None          # default: the case's


@dataclass
class Provider:
    name: str
    role: str                                         # "ours" | "anchor" | "reference"
    make: Callable[[Ctx, Case], Bound]
    available: Callable[[Ctx], str | None] = lambda ctx: None   # reason it cannot run here
    compiled: bool = False
    modes: tuple[str, ...] = ("fwd", "fwd+bwd")      # what it can do at all


@dataclass
class OpSpec:
    name: str
    title: str
    metric: str                                       # "bandwidth" | "flops"
    modes: tuple[str, ...]                            # measured: "fwd", "fwd+bwd"
    shapes: Callable[[Ctx], list[dict[str, int]]]     # in priority order (dropped from the end when short of time)
    quick_shapes: Callable[[Ctx], list[dict[str, int]]]
    make_case: Callable[[Ctx, dict[str, int]], Case]
    providers: list[Provider]
    needs: Callable[[types.ModuleType], str | None]   # reason the loaded kernel cannot run it
    weight: float                                     # share of the time budget
    fwd_no_grad: bool = False


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _randn(shape: Sequence[int], ctx: Ctx, *, scale: float = 1.0, grad: bool = False) -> torch.Tensor:
    t = torch.randn(*shape, device=ctx.device, dtype=ctx.dtype)
    if scale != 1.0:
        t.mul_(scale)
    return t.requires_grad_(grad)


def _grid(ms: Sequence[int], ns: Sequence[int], first: Sequence[tuple[int, int]], cap: int) -> list[dict[str, int]]:
    """``first`` (anchor / target shapes) then the rest of the grid, without duplicates, M*N <= cap."""
    seen: set[tuple[int, int]] = set()
    out: list[dict[str, int]] = []
    for m, n in list(first) + [(m, n) for m in ms for n in ns]:
        if (m, n) in seen or m * n > cap:
            continue
        seen.add((m, n))
        out.append({"M": m, "N": n})
    return out


def _has(obj: Any, *names: str) -> str | None:
    missing = [n for n in names if not hasattr(obj, n)]
    return f"the loaded kernel has no {', '.join(missing)} yet" if missing else None


# ---- providers shared by several ops ----------------------------------------------------------------------------


def _liger_reason(ctx: Ctx) -> str | None:
    if not ctx.on_gpu:
        return "liger-kernel needs a CUDA GPU (Triton kernels)"
    try:
        import liger_kernel  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"liger-kernel not importable ({type(e).__name__})"
    return None


def _mark_tokens_dynamic(case: Case, *tensors: torch.Tensor) -> None:
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, 0)


def _compiled(ctx: Ctx, op: str, case: Case, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile(fn)`` under the op's compile budget (a new static size or token count 1 needs a compile)."""
    if case.tokens == 1 and not ctx.args.compile_tokens_1:
        raise Skip("token count 1 needs its own graph (size-1 specialisation); --compile-tokens-1 to measure it")
    key = case.static_key + (case.tokens == 1,)
    seen = ctx.compiled_keys.setdefault(op, set())
    if key not in seen and ctx.compile_spent.get(op, 0.0) > ctx.compile_budget_s:
        raise Skip(f"compile budget of {ctx.compile_budget_s:.0f} s for this op spent")
    seen.add(key)
    return torch.compile(fn)


# ---------------------------------------------------------------------------------------------------------------
# rms_norm (Llama/Qwen style), gemma_rms_norm ((1 + w)), add_rms_norm (fused residual add, inference)
# ---------------------------------------------------------------------------------------------------------------

RMS_M = (1, 64, 4096, 16384, 32768)
RMS_N = (2048, 2304, 4096, 5376, 8192, 16384, 65536)
# Shapes the recorded anchors (anchors.json, quack.json, e2e.json) were measured at: measured first.
RMS_ANCHOR_SHAPES = ((4096, 4096), (32768, 2048), (16384, 4096), (8192, 8192), (4096, 16384), (2048, 32768),
                     (1024, 65536), (1, 4096), (64, 4096), (32768, 2304), (32768, 5376))
RMS_CPU_M = (1, 64, 1024, 4096)
RMS_CPU_N = (2048, 4096, 8192)


def rms_shapes(ctx: Ctx) -> list[dict[str, int]]:
    if ctx.on_gpu:
        return _grid(RMS_M, RMS_N, RMS_ANCHOR_SHAPES, ctx.args.max_elems)
    return _grid(RMS_CPU_M, RMS_CPU_N, ((64, 4096), (1024, 4096), (4096, 4096)), ctx.args.max_elems)


def rms_quick(ctx: Ctx) -> list[dict[str, int]]:
    if ctx.on_gpu:
        first = ((1, 4096), (64, 4096), (4096, 4096), (16384, 4096), (32768, 2048), (32768, 5376), (4096, 16384),
                 (1024, 65536))
        return _grid((), (), first, ctx.args.max_elems)
    return _grid((), (), ((64, 4096), (1024, 4096), (4096, 4096)), ctx.args.max_elems)


def _rms_bytes(m: int, n: int, es: int, wes: int) -> dict[str, int]:
    return {"fwd": 2 * m * n * es + n * wes, "bwd": 3 * m * n * es + n * wes}


def _rms_ref(x: torch.Tensor, w: torch.Tensor, offset: float) -> torch.Tensor:
    xf = x.detach().float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * (offset + w.detach().float())


def make_rms_case(ctx: Ctx, shape: dict[str, int], *, gemma: bool = False) -> Case:
    m, n = shape["M"], shape["N"]
    mod = (gemma_rms_norm(n) if gemma else llama_rms_norm(n)).to(ctx.device, ctx.dtype)
    with torch.no_grad():
        if gemma:
            mod.weight.normal_(0.0, 0.1)   # (1 + w) around 1, like trained Gemma norms
        else:
            mod.weight.normal_(1.0, 0.1)
    x = _randn((m, n), ctx, grad=True)
    dy = _randn((m, n), ctx)
    es = x.element_size()
    offset = 1.0 if gemma else 0.0
    return Case(
        shape=shape, tokens=m, static_key=(n,),
        inputs={"x": x, "mod": mod},
        leaves=[x, mod.weight], grad_out=dy,
        bytes=_rms_bytes(m, n, es, mod.weight.element_size()), flops={},
        reference=lambda: _rms_ref(x, mod.weight, offset),
        eager=lambda: mod(x),
        working_set=3 * m * n * es,
    )


def _rms_ours(ctx: Ctx, case: Case) -> Bound:
    mod = case.inputs["mod"]
    layer = ctx.fm.layers.GemmaRMSNorm if not hasattr(mod, "variance_epsilon") else ctx.fm.layers.RMSNorm
    fwd = types.MethodType(layer.forward, mod)  # exactly what kernels.kernelize installs
    x = case.inputs["x"]
    return Bound(lambda: fwd(x))


def _rms_eager(ctx: Ctx, case: Case) -> Bound:
    mod, x = case.inputs["mod"], case.inputs["x"]
    return Bound(lambda: mod(x))


def _rms_torch_nn(ctx: Ctx, case: Case) -> Bound:
    mod, x = case.inputs["mod"], case.inputs["x"]
    norm = nn.RMSNorm(x.shape[-1], eps=EPS, device=ctx.device, dtype=ctx.dtype)
    with torch.no_grad():
        norm.weight.copy_(mod.weight)
    return Bound(lambda: norm(x), leaves=[x, norm.weight])


def _rms_compile(op: str) -> Callable[[Ctx, Case], Bound]:
    def make(ctx: Ctx, case: Case) -> Bound:
        mod, x = case.inputs["mod"], case.inputs["x"]
        _mark_tokens_dynamic(case, x)
        cmod = _compiled(ctx, op, case, mod)
        return Bound(lambda: cmod(x))

    return make


def _rms_liger(ctx: Ctx, case: Case) -> Bound:
    from liger_kernel.transformers.rms_norm import LigerRMSNorm, LigerRMSNormForGemma

    mod, x = case.inputs["mod"], case.inputs["x"]
    n = x.shape[-1]
    gemma = not hasattr(mod, "variance_epsilon")
    lig = (LigerRMSNormForGemma(n, eps=EPS) if gemma else LigerRMSNorm(n, eps=EPS)).to(ctx.device, ctx.dtype)
    with torch.no_grad():
        lig.weight.copy_(mod.weight)
    # Liger's default in_place=True writes dx into the incoming gradient: give it its own copy.
    return Bound(lambda: lig(x), leaves=[x, lig.weight], grad_out=case.grad_out.clone())


def _quack_fn() -> Callable[..., torch.Tensor]:
    try:
        import quack
    except Exception as e:  # noqa: BLE001
        raise Skip(f"quack not importable ({type(e).__name__})") from e
    fn = getattr(quack, "rmsnorm", None)
    if fn is None:
        from quack.rmsnorm import rmsnorm as fn  # type: ignore[no-redef]
    return fn


def _quack_reason(ctx: Ctx) -> str | None:
    if not ctx.on_gpu:
        return "quack needs a CUDA GPU"
    try:
        _quack_fn()
    except Skip as e:
        return str(e)
    except Exception as e:  # noqa: BLE001
        return f"quack has no rmsnorm ({type(e).__name__})"
    return None


def _rms_quack(ctx: Ctx, case: Case) -> Bound:
    fn = _quack_fn()
    mod, x = case.inputs["mod"], case.inputs["x"]
    return Bound(lambda: fn(x, mod.weight, eps=EPS))


RMS_OP = OpSpec(
    name="rms_norm", title="RMSNorm (LlamaRMSNorm semantics)", metric="bandwidth", modes=("fwd", "fwd+bwd"),
    shapes=rms_shapes, quick_shapes=rms_quick, make_case=make_rms_case,
    providers=[
        Provider("ours", "ours", _rms_ours),
        Provider("eager", "anchor", _rms_eager),
        Provider("torch.nn.RMSNorm", "anchor", _rms_torch_nn),
        Provider("torch.compile", "anchor", _rms_compile("rms_norm"), compiled=True),
        Provider("liger", "anchor", _rms_liger, available=_liger_reason),
        Provider("quack", "anchor", _rms_quack, available=_quack_reason),
    ],
    needs=lambda fm: _has(fm, "rms_norm") or _has(fm.layers, "RMSNorm"),
    weight=0.28,
)

GEMMA_GPU = ({"M": 64, "N": 2304}, {"M": 4096, "N": 2048}, {"M": 16384, "N": 2048}, {"M": 16384, "N": 2304},
             {"M": 16384, "N": 3584}, {"M": 8192, "N": 5376})
GEMMA_CPU = ({"M": 64, "N": 2304}, {"M": 1024, "N": 2048}, {"M": 2048, "N": 2304})

GEMMA_OP = OpSpec(
    name="gemma_rms_norm", title="Gemma RMSNorm ((1 + w) in fp32)", metric="bandwidth", modes=("fwd", "fwd+bwd"),
    shapes=lambda ctx: [dict(s) for s in (GEMMA_GPU if ctx.on_gpu else GEMMA_CPU)],
    quick_shapes=lambda ctx: [dict(s) for s in (GEMMA_GPU if ctx.on_gpu else GEMMA_CPU)[:2]],
    make_case=lambda ctx, shape: make_rms_case(ctx, shape, gemma=True),
    providers=[
        Provider("ours", "ours", _rms_ours),
        Provider("eager", "anchor", _rms_eager),
        Provider("torch.compile", "anchor", _rms_compile("gemma_rms_norm"), compiled=True),
        Provider("liger", "anchor", _rms_liger, available=_liger_reason),
    ],
    needs=lambda fm: _has(fm, "rms_norm") or _has(fm.layers, "GemmaRMSNorm"),
    weight=0.06,
)


def make_add_case(ctx: Ctx, shape: dict[str, int]) -> Case:
    m, n = shape["M"], shape["N"]
    x = _randn((m, n), ctx)
    r = _randn((m, n), ctx)
    w = (1.0 + 0.1 * torch.randn(n, device=ctx.device)).to(ctx.dtype)
    es = x.element_size()

    def reference() -> torch.Tensor:
        h = (x + r).float()  # h is rounded to the residual dtype first (x's dtype), then normalised
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * w.float()

    def eager() -> tuple[torch.Tensor, torch.Tensor]:
        h = x + r
        return F.rms_norm(h, (n,), w, EPS), h

    return Case(shape=shape, tokens=m, static_key=(n,), inputs={"x": x, "r": r, "w": w, "eager": eager},
                leaves=[], grad_out=None, bytes={"fwd": 4 * m * n * es}, flops={}, reference=reference,
                eager=eager, working_set=4 * m * n * es)


def _add_ours(ctx: Ctx, case: Case) -> Bound:
    x, r, w = case.inputs["x"], case.inputs["r"], case.inputs["w"]
    return Bound(lambda: ctx.fm.rms_norm(x, w, EPS, residual=r))


def _add_eager(ctx: Ctx, case: Case) -> Bound:
    return Bound(case.inputs["eager"])


def _add_compile(ctx: Ctx, case: Case) -> Bound:
    x, r, w = case.inputs["x"], case.inputs["r"], case.inputs["w"]
    n = x.shape[-1]

    def add_norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + r
        return F.rms_norm(h, (n,), w, EPS), h

    _mark_tokens_dynamic(case, x, r)
    fn = _compiled(ctx, "add_rms_norm", case, add_norm)
    return Bound(lambda: fn(x, r, w))


def _add_liger(ctx: Ctx, case: Case) -> Bound:
    from liger_kernel.transformers.fused_add_rms_norm import LigerFusedAddRMSNorm

    x, r, w = case.inputs["x"], case.inputs["r"], case.inputs["w"]
    lig = LigerFusedAddRMSNorm(x.shape[-1], eps=EPS).to(ctx.device, ctx.dtype)
    with torch.no_grad():
        lig.weight.copy_(w)
    return Bound(lambda: lig(x, r))


ADD_OP = OpSpec(
    name="add_rms_norm", title="Fused residual add + RMSNorm (inference fwd)", metric="bandwidth", modes=("fwd",),
    shapes=rms_shapes, quick_shapes=lambda ctx: rms_quick(ctx)[2:] if ctx.on_gpu else rms_quick(ctx),
    make_case=make_add_case,
    providers=[
        Provider("ours", "ours", _add_ours),
        Provider("eager", "anchor", _add_eager),
        Provider("torch.compile", "anchor", _add_compile, compiled=True),
        Provider("liger", "anchor", _add_liger, available=_liger_reason),
    ],
    needs=lambda fm: _has(fm, "rms_norm"),
    weight=0.15, fwd_no_grad=True,
)


# ---------------------------------------------------------------------------------------------------------------
# Gated activations alone: geglu_act (tanh-GeLU(gate) * up) and swiglu_act (silu(gate) * up)
# ---------------------------------------------------------------------------------------------------------------

GEGLU_T = (4096, 8192, 16)
GEGLU_I = (16384, 9216, 24576, 14336, 21504)
SWIGLU_I = (14336, 11008)


def _act_shapes(ts: Sequence[int], inters: Sequence[int], cap: int) -> list[dict[str, int]]:
    return [{"T": t, "I": i} for t in ts for i in inters if t * i <= cap]


def make_act_case(ctx: Ctx, shape: dict[str, int], kind: str) -> Case:
    t, i = shape["T"], shape["I"]
    gate = _randn((t, i), ctx, grad=True)
    up = _randn((t, i), ctx, grad=True)
    dout = _randn((t, i), ctx)
    es = gate.element_size()
    act = _act_fn(kind)
    return Case(shape=shape, tokens=t, static_key=(), inputs={"gate": gate, "up": up, "act": act},
                leaves=[gate, up], grad_out=dout, bytes={"fwd": 3 * t * i * es, "bwd": 5 * t * i * es}, flops={},
                reference=lambda: act(gate.detach().float()) * up.detach().float(),
                eager=lambda: act(gate) * up, working_set=5 * t * i * es)


def _gelu_tanh(g: torch.Tensor) -> torch.Tensor:
    return F.gelu(g, approximate="tanh")


def _act_fn(kind: str) -> Callable[[torch.Tensor], torch.Tensor]:
    # Module-level functions: torch.compile guards on the closure's function object, a new lambda per shape
    # would force a recompile per shape.
    return _gelu_tanh if kind == "geglu" else F.silu


def _act_ours(kind: str) -> Callable[[Ctx, Case], Bound]:
    def make(ctx: Ctx, case: Case) -> Bound:
        g, u = case.inputs["gate"], case.inputs["up"]
        if kind == "geglu":
            return Bound(lambda: ctx.fm.geglu(g, u, approximate="tanh"))
        return Bound(lambda: ctx.fm.swiglu(g, u))

    return make


def _act_eager(ctx: Ctx, case: Case) -> Bound:
    g, u, act = case.inputs["gate"], case.inputs["up"], case.inputs["act"]
    return Bound(lambda: act(g) * u)


def _act_compile(op: str) -> Callable[[Ctx, Case], Bound]:
    def make(ctx: Ctx, case: Case) -> Bound:
        g, u, act = case.inputs["gate"], case.inputs["up"], case.inputs["act"]
        # Pointwise: both dims dynamic costs nothing (one flat kernel), so one graph serves every shape.
        for t in (g, u):
            torch._dynamo.maybe_mark_dynamic(t, 0)
            torch._dynamo.maybe_mark_dynamic(t, 1)

        def gated(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
            return act(g) * u

        fn = _compiled(ctx, op, case, gated)
        return Bound(lambda: fn(g, u))

    return make


def _act_liger(kind: str) -> Callable[[Ctx, Case], Bound]:
    def make(ctx: Ctx, case: Case) -> Bound:
        from liger_kernel.ops import LigerGELUMulFunction, LigerSiLUMulFunction

        # Liger's backward writes dgate/dup into the saved gate/up buffers: give it its own leaves.
        g = case.inputs["gate"].detach().clone().requires_grad_(True)
        u = case.inputs["up"].detach().clone().requires_grad_(True)
        if kind == "geglu":
            return Bound(lambda: LigerGELUMulFunction.apply(g, u), leaves=[g, u])
        return Bound(lambda: LigerSiLUMulFunction.apply(g, u), leaves=[g, u])

    return make


def _act_op(kind: str) -> OpSpec:
    inters = GEGLU_I if kind == "geglu" else SWIGLU_I
    name = f"{kind}_act"
    return OpSpec(
        name=name, title=f"{'GeGLU (tanh)' if kind == 'geglu' else 'SwiGLU'} activation alone",
        metric="bandwidth", modes=("fwd", "fwd+bwd"),
        shapes=lambda ctx: _act_shapes(GEGLU_T, inters, ctx.args.max_elems) if ctx.on_gpu
        else _act_shapes((512, 16), inters[:2], ctx.args.max_elems),
        quick_shapes=lambda ctx: _act_shapes((4096, 16), inters[:1], ctx.args.max_elems) if ctx.on_gpu
        else _act_shapes((512,), inters[:1], ctx.args.max_elems),
        make_case=lambda ctx, shape: make_act_case(ctx, shape, kind),
        providers=[
            Provider("ours", "ours", _act_ours(kind)),
            Provider("eager", "anchor", _act_eager),
            Provider("torch.compile", "anchor", _act_compile(name), compiled=True),
            Provider("liger", "anchor", _act_liger(kind), available=_liger_reason),
        ],
        needs=lambda fm: _has(fm, kind),
        weight=0.10 if kind == "geglu" else 0.04,
    )


# ---------------------------------------------------------------------------------------------------------------
# GeGLU MLP (Gemma-style: gate_proj, up_proj, down_proj, tanh-GeLU)
# ---------------------------------------------------------------------------------------------------------------

MLP_HI = ((2048, 16384), (2304, 9216), (3072, 24576), (3584, 14336), (5376, 21504))
MLP_T = (4096, 16, 512, 8192)


def mlp_shapes(ctx: Ctx) -> list[dict[str, int]]:
    if ctx.on_gpu:
        return [{"H": h, "I": i, "T": t} for (h, i) in MLP_HI for t in MLP_T]
    return [{"H": h, "I": i, "T": t} for (h, i) in MLP_HI[:2] for t in (16, 128)]


def mlp_quick(ctx: Ctx) -> list[dict[str, int]]:
    if ctx.on_gpu:
        return [{"H": 2048, "I": 16384, "T": 4096}, {"H": 2048, "I": 16384, "T": 16}]
    return [{"H": 2048, "I": 16384, "T": 16}]


def make_mlp_case(ctx: Ctx, shape: dict[str, int]) -> Case:
    h, i, t = shape["H"], shape["I"], shape["T"]
    with torch.device(ctx.device):
        mlp = gemma_mlp(h, i)
    mlp.to(ctx.dtype)
    with torch.no_grad():
        for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            lin.weight.normal_(0.0, lin.in_features**-0.5)
    x = _randn((t, h), ctx, scale=0.5, grad=True)
    dy = _randn((t, h), ctx)
    flops = 2 * t * h * i * 3

    def reference() -> torch.Tensor:
        xf = x.detach().float()
        g = F.gelu(xf @ mlp.gate_proj.weight.detach().float().t(), approximate="tanh")
        return (g * (xf @ mlp.up_proj.weight.detach().float().t())) @ mlp.down_proj.weight.detach().float().t()

    return Case(shape=shape, tokens=t, static_key=(h, i), inputs={"x": x, "mlp": mlp},
                leaves=[x, *mlp.parameters()], grad_out=dy, bytes={}, flops={"fwd": flops, "bwd": 2 * flops},
                reference=reference, eager=lambda: mlp(x), working_set=3 * h * i * 2)


def _mlp_ours(ctx: Ctx, case: Case) -> Bound:
    mlp, x = case.inputs["mlp"], case.inputs["x"]
    fwd = types.MethodType(ctx.fm.layers.GeGLUMLP.forward, mlp)
    return Bound(lambda: fwd(x))


def _mlp_eager(ctx: Ctx, case: Case) -> Bound:
    mlp, x = case.inputs["mlp"], case.inputs["x"]
    return Bound(lambda: mlp(x))


def _mlp_compile(ctx: Ctx, case: Case) -> Bound:
    mlp, x = case.inputs["mlp"], case.inputs["x"]
    _mark_tokens_dynamic(case, x)
    cm = _compiled(ctx, "geglu_mlp", case, mlp)
    return Bound(lambda: cm(x))


def _mlp_liger(ctx: Ctx, case: Case) -> Bound:
    from liger_kernel.transformers.geglu import LigerGEGLUMLP

    mlp, x = case.inputs["mlp"], case.inputs["x"]
    fwd = types.MethodType(LigerGEGLUMLP.forward, mlp)  # same weights, Liger's forward (gate/up/down + GELUMul)
    return Bound(lambda: fwd(x))


MLP_OP = OpSpec(
    name="geglu_mlp", title="GeGLU MLP (Gemma: 3 GEMMs + tanh-GeLU * up)", metric="flops", modes=("fwd", "fwd+bwd"),
    shapes=mlp_shapes, quick_shapes=mlp_quick, make_case=make_mlp_case,
    providers=[
        Provider("ours", "ours", _mlp_ours),
        Provider("eager", "anchor", _mlp_eager),
        Provider("torch.compile", "anchor", _mlp_compile, compiled=True),
        Provider("liger", "anchor", _mlp_liger, available=_liger_reason),
    ],
    needs=lambda fm: _has(fm.layers, "GeGLUMLP"),
    weight=0.20,
)


# ---------------------------------------------------------------------------------------------------------------
# addmm + bias + tanh-GeLU ([K, N] weight) and linear with bias ([N, K] weight)
# ---------------------------------------------------------------------------------------------------------------

GEMM_M = (4096, 8192, 16)
GEMM_KN = ((4096, 4096), (2048, 8192), (16384, 4096), (4096, 14336))


def gemm_shapes(ctx: Ctx) -> list[dict[str, int]]:
    if ctx.on_gpu:
        return [{"M": m, "K": k, "N": n} for m in GEMM_M for (k, n) in GEMM_KN]
    return [{"M": m, "K": k, "N": n} for m in (16, 512) for (k, n) in GEMM_KN[:2]]


def make_gemm_case(ctx: Ctx, shape: dict[str, int], *, linear: bool) -> Case:
    m, k, n = shape["M"], shape["K"], shape["N"]
    a = _randn((m, k), ctx, grad=True)
    wshape = (n, k) if linear else (k, n)
    w = (torch.randn(*wshape, device=ctx.device) * k**-0.5).to(ctx.dtype).requires_grad_(True)
    bias = _randn((n,), ctx, grad=True)
    dy = _randn((m, n), ctx)
    flops = 2 * m * k * n
    # fp64 reference on the GPU (the anchors' max_err_vs_fp64); on the CPU too (small shapes there).
    ref_dtype = torch.float64

    def reference() -> torch.Tensor:
        wt = w.detach().to(ref_dtype)
        pre = torch.addmm(bias.detach().to(ref_dtype), a.detach().to(ref_dtype), wt.t() if linear else wt)
        return pre if linear else F.gelu(pre, approximate="tanh")

    def eager() -> torch.Tensor:
        if linear:
            return F.linear(a, w, bias)
        return F.gelu(torch.addmm(bias, a, w), approximate="tanh")

    return Case(shape=shape, tokens=m, static_key=(k, n), inputs={"a": a, "w": w, "bias": bias},
                leaves=[a, w, bias], grad_out=dy, bytes={}, flops={"fwd": flops, "bwd": 2 * flops},
                reference=reference, eager=eager, working_set=(m * k + k * n + m * n) * a.element_size())


def _addmm_ours(ctx: Ctx, case: Case) -> Bound:
    a, w, b = case.inputs["a"], case.inputs["w"], case.inputs["bias"]
    return Bound(lambda: ctx.fm.addmm(b, a, w, activation="gelu_tanh"))


def _addmm_eager(ctx: Ctx, case: Case) -> Bound:
    return Bound(case.eager)


def _addmm_activation(ctx: Ctx, case: Case) -> Bound:
    a, w, b = case.inputs["a"], case.inputs["w"], case.inputs["bias"]
    return Bound(lambda: torch._addmm_activation(b, a, w, use_gelu=True))


def _addmm_compile(ctx: Ctx, case: Case) -> Bound:
    a, w, b = case.inputs["a"], case.inputs["w"], case.inputs["bias"]

    def addmm_gelu(b: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.gelu(torch.addmm(b, a, w), approximate="tanh")

    _mark_tokens_dynamic(case, a)
    fn = _compiled(ctx, "addmm", case, addmm_gelu)
    return Bound(lambda: fn(b, a, w))


def _mm_only(linear: bool) -> Callable[[Ctx, Case], Bound]:
    def make(ctx: Ctx, case: Case) -> Bound:
        a, w = case.inputs["a"], case.inputs["w"]
        return Bound(lambda: a @ w.t() if linear else a @ w, leaves=[a, w])

    return make


def _linear_ours(ctx: Ctx, case: Case) -> Bound:
    a, w, b = case.inputs["a"], case.inputs["w"], case.inputs["bias"]
    return Bound(lambda: ctx.fm.linear(a, w, b))


ADDMM_OP = OpSpec(
    name="addmm", title="addmm + bias + tanh-GeLU (weight [K, N])", metric="flops", modes=("fwd", "fwd+bwd"),
    shapes=gemm_shapes,
    quick_shapes=lambda ctx: [s for s in gemm_shapes(ctx) if (s["K"], s["N"]) == (4096, 4096) and s["M"] != 8192],
    make_case=lambda ctx, shape: make_gemm_case(ctx, shape, linear=False),
    providers=[
        Provider("ours", "ours", _addmm_ours),
        Provider("eager", "anchor", _addmm_eager),
        Provider("torch._addmm_activation", "anchor", _addmm_activation, modes=("fwd",)),  # no autograd formula
        Provider("torch.compile", "anchor", _addmm_compile, compiled=True),
        Provider("mm only", "reference", _mm_only(linear=False)),
    ],
    needs=lambda fm: _has(fm, "addmm"),
    weight=0.10, fwd_no_grad=True,  # its anchors (torch._addmm_activation, mm only) are inference calls
)

LINEAR_OP = OpSpec(
    name="linear", title="linear with bias (nn.Linear weight [N, K])", metric="flops", modes=("fwd", "fwd+bwd"),
    shapes=gemm_shapes,
    quick_shapes=lambda ctx: [s for s in gemm_shapes(ctx) if s["M"] == max(x["M"] for x in gemm_shapes(ctx))][:2],
    make_case=lambda ctx, shape: make_gemm_case(ctx, shape, linear=True),
    providers=[
        Provider("ours", "ours", _linear_ours),
        Provider("eager", "anchor", _addmm_eager),
        Provider("mm only", "reference", _mm_only(linear=True)),
    ],
    needs=lambda fm: _has(fm, "linear"),
    weight=0.05,
)

OPS: dict[str, OpSpec] = {op.name: op for op in (RMS_OP, ADD_OP, GEMMA_OP, _act_op("geglu"), _act_op("swiglu"),
                                                 MLP_OP, ADDMM_OP, LINEAR_OP)}


# ---------------------------------------------------------------------------------------------------------------
# fwd_graph: device time of one inference forward at decode sizes, by CUDA-graph replay
# ---------------------------------------------------------------------------------------------------------------
# A decode step is latency-bound: per-call host overhead hides the kernels in do_bench. Here each provider's forward
# (no autograd) is captured 20 times in one CUDA graph and replayed (bench_lib.cuda_graph_times: the providers' graphs
# warmed up, then replayed in interleaved rounds), so only device time
# counts, as in a CUDA-graphed decode step (transformers' static cache + torch.compile). Providers: ours (the layer
# forward kernelize installs, or the functional op), Inductor's code for the package's own fp32 definition
# (``*_reference``: fp32 math, one rounding; torch.compile default mode, static shapes, no CUDA graphs of its own)
# and torch.nn.RMSNorm where it applies (plain rms_norm). Rows: mode "fwd_graph"; they merge into sweep.csv
# separately from the fwd / fwd+bwd rows of the same op.

GRAPH_MODE = "fwd_graph"
GRAPH_M = (1, 16, 64)
GRAPH_N = (2048, 4096, 8192)
GRAPH_I = (2048, 4096, 8192, 16384)  # + Gemma-2B's 16384 for the activations
GRAPH_CALLS, GRAPH_ROUNDS = 20, 50
_GRAPH_FM: types.ModuleType | None = None  # the loaded kernel, whose *_reference definitions Inductor compiles


def _ref_rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _GRAPH_FM.rms_norm_reference(x, w, EPS)


def _ref_gemma(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _GRAPH_FM.rms_norm_reference(x, w, EPS, offset=1.0)


def _ref_add(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _GRAPH_FM.rms_norm_reference(x, w, EPS, residual=r)


def _ref_geglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return _GRAPH_FM.geglu_reference(g, u, approximate="tanh")


def _ref_swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return _GRAPH_FM.swiglu_reference(g, u)


def _graph_inductor(fn: Callable[..., Any], names: Sequence[str]) -> Callable[[Ctx, Case], Bound]:
    def make(ctx: Ctx, case: Case) -> Bound:
        args = [case.inputs["mod"].weight if n == "mod.weight" else case.inputs[n] for n in names]
        cfn = torch.compile(fn, dynamic=False)
        return Bound(lambda: cfn(*args))

    return make


def _rms_shapes_graph(ctx: Ctx) -> list[dict[str, int]]:
    return [{"M": m, "N": n} for m in GRAPH_M for n in GRAPH_N]


def _act_shapes_graph(ctx: Ctx) -> list[dict[str, int]]:
    return [{"T": t, "I": i} for t in GRAPH_M for i in GRAPH_I]


# op -> (shapes, providers); the cases are the sweep's own (make_case of the op)
GRAPH_OPS: dict[str, tuple[Callable[[Ctx], list[dict[str, int]]], list[Provider]]] = {
    "rms_norm": (_rms_shapes_graph, [Provider("ours", "ours", _rms_ours),
                                     Provider("inductor", "anchor", _graph_inductor(_ref_rms, ("x", "mod.weight"))),
                                     Provider("torch.nn.RMSNorm", "anchor", _rms_torch_nn)]),
    "add_rms_norm": (_rms_shapes_graph, [Provider("ours", "ours", _add_ours),
                                         Provider("inductor", "anchor", _graph_inductor(_ref_add, ("x", "r", "w")))]),
    "gemma_rms_norm": (_rms_shapes_graph,
                       [Provider("ours", "ours", _rms_ours),
                        Provider("inductor", "anchor", _graph_inductor(_ref_gemma, ("x", "mod.weight")))]),
    "geglu_act": (_act_shapes_graph, [Provider("ours", "ours", _act_ours("geglu")),
                                      Provider("inductor", "anchor", _graph_inductor(_ref_geglu, ("gate", "up")))]),
    "swiglu_act": (_act_shapes_graph, [Provider("ours", "ours", _act_ours("swiglu")),
                                       Provider("inductor", "anchor", _graph_inductor(_ref_swiglu, ("gate", "up")))]),
}


def sweep_row_key(row: dict[str, str]) -> tuple[str, ...]:
    """ResultWriter merge key: (op, dtype, mode), so a run of some modes (`--modes fwd`) keeps the other modes' rows."""
    return (row.get("op", ""), row.get("dtype", ""), row.get("mode", ""))


def _prepare_graph_provider(ctx: Ctx, op: OpSpec, case: Case, prov: Provider,
                            ref: torch.Tensor) -> tuple[dict[str, Any], Callable[[], Any] | None]:
    """(row fields, the forward to time) of one provider; the forward is None when it failed (row says why)."""
    base = dict(op=op.name, provider=prov.name, role=prov.role, source="measured", mode=GRAPH_MODE,
                dtype=ctx.dtype_name, shape=shape_str(case.shape), **_shape_fields(case.shape),
                note=f"CUDA graph of {GRAPH_CALLS} calls, {GRAPH_ROUNDS} replays interleaved across providers; "
                     "inference (no autograd)")
    try:
        with torch.no_grad():
            bound = prov.make(ctx, case)
            t0 = time.perf_counter()
            out = bound.fwd()  # compilation (inductor) happens here, outside the graph
            synchronize(ctx.device)
            compile_s = time.perf_counter() - t0
            err = max_abs_err(_first(out), ref)
            del out
    except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
        return dict(base, status=f"error: {describe_exception(e)}"), None
    return dict(base, max_err=err, compile_s=compile_s if prov.name == "inductor" else None), bound.fwd


def _run_graph_providers(ctx: Ctx, op: OpSpec, case: Case, providers: Sequence[Provider],
                         ref: torch.Tensor) -> list[dict[str, Any]]:
    """Every provider's fwd_graph row of one shape, timed in interleaved rounds (bench_lib.cuda_graph_times)."""
    prepared = [_prepare_graph_provider(ctx, op, case, p, ref) for p in providers]
    fns = {row["provider"]: fn for row, fn in prepared if fn is not None}
    try:
        with torch.no_grad():
            times = cuda_graph_times(fns, calls=GRAPH_CALLS, rounds=GRAPH_ROUNDS) if fns else {}
    except Exception as e:  # noqa: BLE001
        return [dict(row, status=f"error: {describe_exception(e)}") if fn is not None else row
                for row, fn in prepared]
    rows = []
    for row, fn in prepared:
        if fn is None:
            rows.append(row)
            continue
        fields = _metric_fields(ctx, op, case, "fwd", times[row["provider"]])
        if math.isnan(fields.get("ceiling_value", math.nan)):  # a fwd_graph-only run measures no ceiling
            for k in ("ceiling", "ceiling_value", "pct_of_ceiling"):
                fields.pop(k, None)
        rows.append(dict(row, status="ok", **fields))
    return rows


def run_graph_op(ctx: Ctx, op: OpSpec, budget: Budget) -> None:
    """The fwd_graph rows of one op (see above)."""
    global _GRAPH_FM
    writer = ctx.writer
    deadline = budget.deadline_for(f"{op.name}:{ctx.dtype_name}:graph")
    if not ctx.on_gpu:
        writer.add(op=op.name, provider="*", source="measured", mode=GRAPH_MODE, dtype=ctx.dtype_name,
                   status="skipped: fwd_graph replays CUDA graphs (needs a GPU)")
        return
    reason = op.needs(ctx.fm) or _has(ctx.fm, "rms_norm_reference", "geglu_reference", "swiglu_reference")
    if reason:
        writer.add(op=op.name, provider="*", source="measured", mode=GRAPH_MODE, dtype=ctx.dtype_name,
                   status=f"skipped: {reason}")
        return
    _GRAPH_FM = ctx.fm
    shapes_fn, providers = GRAPH_OPS[op.name]
    wanted = set(ctx.args.providers.split(",")) if ctx.args.providers else None
    providers = [p for p in providers if wanted is None or p.name in wanted]
    shapes = shapes_fn(ctx)
    if ctx.args.max_shapes:
        shapes = shapes[: ctx.args.max_shapes]
    log(f"[{op.name} {ctx.dtype_name}] {GRAPH_MODE}: {len(shapes)} shapes x {[p.name for p in providers]}; "
        f"{max(deadline - time.monotonic(), 0):.0f} s budget")
    for idx, shape in enumerate(shapes):
        if time.monotonic() > deadline:
            for rest in shapes[idx:]:
                writer.add(op=op.name, provider="*", source="measured", mode=GRAPH_MODE, dtype=ctx.dtype_name,
                           shape=shape_str(rest), **_shape_fields(rest), status="skipped: op time budget spent")
            log(f"[{op.name}] {GRAPH_MODE}: time budget spent, {len(shapes) - idx} shapes skipped")
            break
        t_shape = time.perf_counter()
        torch.manual_seed(0)
        try:
            case = op.make_case(ctx, shape)
            with torch.no_grad():
                ref = case.reference()
                eager_err = max_abs_err(_first(case.eager()), ref)
        except Exception as e:  # noqa: BLE001
            writer.add(op=op.name, provider="*", source="measured", mode=GRAPH_MODE, dtype=ctx.dtype_name,
                       shape=shape_str(shape), **_shape_fields(shape), status=f"error: {describe_exception(e)}")
            _free(ctx)
            continue
        rows = _run_graph_providers(ctx, op, case, providers, ref)
        for r in rows:
            r["max_err_eager"] = eager_err
            if r["role"] == "ours" and r.get("max_err") is not None:
                r["verified"] = two_x_rule(r["max_err"], eager_err, ctx.dtype)
        _speedups(rows)
        for r in rows:
            writer.add(**r)
        writer.checkpoint()
        parts = " ".join(f"{r['provider']}={r['time_p50_ms'] * 1e3:.2f}us" if r.get("time_p50_ms") else
                         f"{r['provider']}:{r['status'][:60]}" for r in rows)
        log(f"[{op.name}] {GRAPH_MODE} {shape_str(shape)} ({time.perf_counter() - t_shape:.1f} s) | {parts}")
        del case, ref
        _free(ctx)
    writer.checkpoint()


# ---------------------------------------------------------------------------------------------------------------
# Running one op
# ---------------------------------------------------------------------------------------------------------------


def _shape_fields(shape: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in shape.items() if k in ("M", "N", "K", "H", "I", "T", "L")}


def _metric_fields(ctx: Ctx, op: OpSpec, case: Case, mode: str, t: Timing) -> dict[str, Any]:
    ceiling, cval = ctx.ceilings.for_metric(op.metric, ctx.dtype_name)
    out: dict[str, Any] = {"time_p20_ms": t.p20, "time_p50_ms": t.p50, "time_p80_ms": t.p80,
                           "ceiling": ceiling, "ceiling_value": cval}
    costs = case.bytes if op.metric == "bandwidth" else case.flops
    if mode == "fwd+bwd":
        amount = costs.get("fwd", 0) + costs.get("bwd", 0) if "bwd" in costs else None
    else:
        amount = costs.get(mode)
    if amount:
        if op.metric == "bandwidth":
            gbps = amount / t.p50 / 1e6
            out.update(bytes=amount, gbps=gbps, pct_of_ceiling=100 * gbps / cval)
        else:
            tflops = amount / t.p50 / 1e9
            out.update(flops=amount, tflops=tflops, pct_of_ceiling=100 * tflops / cval)
    return out


def _rounds_note(rounds: int) -> str:
    return f"{rounds} interleaved rounds" if rounds > 1 else ""  # one round: today's rows, no note


def _join_notes(*notes: str | None) -> str:
    return "; ".join(n for n in notes if n)


@dataclass
class Prepared:
    """A provider made, run once and checked on one case, waiting for its timed rounds."""

    prov: Provider
    base: dict[str, Any]
    modes: tuple[str, ...]                           # the op's modes this provider can do, in order
    unsupported: tuple[str, ...]                     # the op's modes it cannot (no autograd formula)
    calls: dict[str, Callable[[], Any]]              # mode -> the timed call
    leaves: list[torch.Tensor]
    err: float | None
    compile_s: float
    status: dict[str, str] = field(default_factory=dict)          # mode -> error status (first call or timing)
    rounds: dict[str, list[Timing]] = field(default_factory=dict)  # mode -> one Timing per round

    def timed_modes(self) -> list[str]:
        return [m for m in self.modes if m not in self.status]

    def release(self) -> None:
        self.calls, self.leaves = {}, []


def _prepare_provider(ctx: Ctx, op: OpSpec, case: Case, prov: Provider,
                      ref: torch.Tensor) -> Prepared | list[dict[str, Any]]:
    """Makes one provider and runs it once (compilation / JIT / cuBLAS heuristics happen here, outside the
    timing), checking the forward against the reference; the rows instead when it is skipped or its forward fails."""
    base = dict(op=op.name, provider=prov.name, role=prov.role, source="measured", dtype=ctx.dtype_name,
                shape=shape_str(case.shape), **_shape_fields(case.shape))
    try:
        bound = prov.make(ctx, case)
    except Skip as e:
        return [dict(base, mode=m, status=f"skipped: {e}") for m in op.modes]
    leaves = case.leaves if bound.leaves is None else bound.leaves
    grad_out = case.grad_out if bound.grad_out is None else bound.grad_out
    modes = tuple(m for m in op.modes if m in prov.modes)
    unsupported = tuple(m for m in op.modes if m not in prov.modes)

    def fwd() -> Any:
        if op.fwd_no_grad:
            with torch.no_grad():
                return bound.fwd()
        return bound.fwd()

    def fwd_bwd() -> None:
        _first(bound.fwd()).backward(grad_out)

    # A failing backward only fails the fwd+bwd row.
    failed: dict[str, str] = {}
    compile_s = 0.0
    try:
        t0 = time.perf_counter()
        out = fwd()
        synchronize(ctx.device)
        compile_s += time.perf_counter() - t0
        err = max_abs_err(_first(out), ref)
        del out
    except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
        return [dict(base, mode=m, status=f"error: {describe_exception(e)}") for m in modes]
    if "fwd+bwd" in modes:
        try:
            t0 = time.perf_counter()
            fwd_bwd()
            synchronize(ctx.device)
            compile_s += time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001
            failed["fwd+bwd"] = f"error: {describe_exception(e)}"
        for leaf in leaves:
            leaf.grad = None
    if prov.compiled:
        ctx.compile_spent[op.name] = ctx.compile_spent.get(op.name, 0.0) + compile_s
    calls = {m: fwd if m == "fwd" else fwd_bwd for m in modes}
    return Prepared(prov, base, modes, unsupported, calls, list(leaves), err, compile_s, status=failed)


def _round_kwargs(timer: Timer, rounds: int) -> dict[str, Any]:
    """Timer arguments of one round: warmup and rep split evenly over the rounds, and the CPU floor of 5 timed calls
    too (the calls of all rounds together cost what one timing did)."""
    return dict(warmup_ms=timer.warmup_ms / rounds, rep_ms=timer.rep_ms / rounds, min_reps=max(1, 5 // rounds))


def _time_rounds(ctx: Ctx, case: Case, prepared: Sequence[Prepared], rounds: int) -> None:
    """Times every prepared provider's modes in ``rounds`` interleaved rounds (the provider order rotates by one
    each round); a mode whose timing fails is recorded as an error and not timed again."""
    for r in range(rounds):
        k = r % max(len(prepared), 1)
        for p in list(prepared[k:]) + list(prepared[:k]):
            for mode in p.timed_modes():
                try:
                    t = ctx.timer.time(p.calls[mode], grad_to_none=p.leaves if mode == "fwd+bwd" else None,
                                       working_set_bytes=case.working_set, **_round_kwargs(ctx.timer, rounds))
                    p.rounds.setdefault(mode, []).append(t)
                except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
                    p.status[mode] = f"error: {describe_exception(e)}"
                    p.rounds.pop(mode, None)
                for leaf in p.leaves:  # the last call's gradients would stay alive through the others' timings
                    leaf.grad = None


def _finish_provider(ctx: Ctx, op: OpSpec, case: Case, p: Prepared, rounds: int) -> list[dict[str, Any]]:
    """The rows of one timed provider (one per mode, plus the derived bwd); peak memory of fwd+bwd measured here."""
    base, err, note = p.base, p.err, _rounds_note(rounds)
    rows: list[dict[str, Any]] = []
    timings: dict[str, Timing] = {}
    for mode in p.modes:
        row = dict(base, mode=mode, max_err=err, compile_s=p.compile_s if p.prov.compiled else None)
        if mode in p.status:
            rows.append(dict(row, status=p.status[mode]))
            continue
        t = combine_rounds(p.rounds[mode])
        timings[mode] = t
        row.update(_metric_fields(ctx, op, case, mode, t), status="ok", note=note)
        if mode == "fwd+bwd":
            fn = p.calls[mode]
            try:
                if ctx.on_gpu:
                    fn()  # leaves hold gradients, as right after a timed call (where the peak was always measured)
                row["peak_mem_bytes"] = peak_memory(fn, ctx.device)
            except Exception as e:  # noqa: BLE001
                row["status"] = f"error: {describe_exception(e)}"
        rows.append(row)
    rows += [dict(base, mode=m, status=f"skipped: {p.prov.name} has no autograd formula") for m in p.unsupported]
    if "fwd" in timings and "fwd+bwd" in timings:
        derived = ("derived: (training fwd+bwd) - (inference fwd, no_grad)" if op.fwd_no_grad
                   else "derived: (fwd+bwd) - fwd")
        t = Timing.minus(timings["fwd+bwd"], timings["fwd"])
        if t is None:
            rows.append(dict(base, mode="bwd", max_err=err, status="invalid: fwd+bwd median <= fwd median (noise)",
                             note=_join_notes(derived, note)))
        else:
            rows.append(dict(base, mode="bwd", max_err=err, status="ok", note=_join_notes(derived, note),
                             **_metric_fields(ctx, op, case, "bwd", t)))
    for leaf in p.leaves:
        leaf.grad = None
    return rows


def _run_providers(ctx: Ctx, op: OpSpec, case: Case, providers: Sequence[Provider],
                   ref: torch.Tensor) -> list[dict[str, Any]]:
    """Every provider's rows of one case, in provider order: all prepared first, then timed in interleaved rounds."""
    rounds = ctx.args.rounds
    slots: list[Prepared | list[dict[str, Any]]] = [_prepare_provider(ctx, op, case, p, ref) for p in providers]
    prepared = [s for s in slots if isinstance(s, Prepared)]
    _time_rounds(ctx, case, prepared, rounds)
    finished: dict[int, list[dict[str, Any]]] = {}
    # Last provider first, each released once finished: an anchor's own copies (Liger's leaves, dy) are freed
    # before the providers listed before it measure their peak memory.
    for p in reversed(prepared):
        finished[id(p)] = _finish_provider(ctx, op, case, p, rounds)
        p.release()
    return [r for s in slots for r in (finished[id(s)] if isinstance(s, Prepared) else s)]


def _speedups(rows: list[dict[str, Any]]) -> None:
    """``speedup_vs_best_anchor`` = the fastest measured anchor's median / this row's median, per mode."""
    for mode in {r["mode"] for r in rows}:
        anchors = [r for r in rows if r["mode"] == mode and r["role"] == "anchor" and r.get("status") == "ok"
                   and r.get("time_p50_ms")]
        if not anchors:
            continue
        best = min(anchors, key=lambda r: r["time_p50_ms"])
        for r in rows:
            if r["mode"] == mode and r.get("status") == "ok" and r.get("time_p50_ms"):
                r["best_anchor"] = best["provider"]
                r["speedup_vs_best_anchor"] = best["time_p50_ms"] / r["time_p50_ms"]


def _recorded_quack_rows(ctx: Ctx, op: OpSpec, shapes: list[dict[str, int]]) -> list[dict[str, Any]]:
    """quack 0.6.5's RMSNorm numbers recorded on the H200 (benchmarks/anchors/quack.json), for the shapes of this
    run, when quack itself is not importable: a reference line, never counted as measured."""
    path = ANCHORS_DIR / "quack.json"
    if op.name != "rms_norm" or not ctx.on_gpu or ctx.dtype != torch.bfloat16 or not path.exists():
        return []
    wanted = {(s["M"], s["N"]) for s in shapes}
    rows = []
    ceiling, cval = ctx.ceilings.for_metric("bandwidth", ctx.dtype_name)
    for rec in json.loads(path.read_text()).get("rmsnorm", []):
        m, n = rec.get("M"), rec.get("N")
        if (m, n) not in wanted or "fwd_ms" not in rec:
            continue
        costs = _rms_bytes(m, n, 2, 2)
        for mode, ms in (("fwd", rec["fwd_ms"]), ("bwd", rec["bwd_ms"])):
            if mode not in op.modes and not (mode == "bwd" and "fwd+bwd" in op.modes):
                continue  # a mode this run does not measure keeps its rows in the merged CSV
            gbps = costs[mode] / ms / 1e6
            rows.append(dict(op=op.name, provider=QUACK_RECORDED, role="anchor", source="recorded", mode=mode,
                             dtype="bf16", shape=shape_str({"M": m, "N": n}), M=m, N=n, time_p50_ms=ms,
                             bytes=costs[mode], gbps=gbps, ceiling=ceiling, ceiling_value=cval,
                             pct_of_ceiling=100 * gbps / cval, max_err=rec.get("max_err"), status="ok",
                             note="recorded by anchors/quack.json on an H200 (quack 0.6.5); not run here"))
    return rows


def _op_reason(ctx: Ctx, op: OpSpec) -> str | None:
    reason = op.needs(ctx.fm)
    if reason is None and op.metric == "flops" and not ctx.on_gpu and ctx.dtype != torch.float32 \
            and not ctx.args.cpu_half_gemm:
        reason = "GEMM ops run in fp32 on the CPU (--cpu-half-gemm to force)"
    return reason


def run_op(ctx: Ctx, op: OpSpec, budget: Budget) -> None:
    writer = ctx.writer
    budget_key = f"{op.name}:{ctx.dtype_name}"
    reason = _op_reason(ctx, op)
    if reason:
        log(f"[{op.name} {ctx.dtype_name}] skipped: {reason}")
        writer.add(op=op.name, provider="ours", role="ours", source="measured", dtype=ctx.dtype_name,
                   status=f"skipped: {reason}")
        writer.checkpoint()
        budget.deadline_for(budget_key)  # hands its share to the ops after it
        return
    deadline = budget.deadline_for(budget_key)
    ctx.compile_budget_s = ctx.args.compile_share * max(deadline - time.monotonic(), 0.0)
    wanted = set(ctx.args.providers.split(",")) if ctx.args.providers else None
    providers: list[Provider] = []
    for p in op.providers:
        if wanted is not None and p.name not in wanted:
            continue
        why = p.available(ctx)
        if why:
            log(f"[{op.name} {ctx.dtype_name}] provider {p.name!r} skipped: {why}")
            writer.add(op=op.name, provider=p.name, role=p.role, source="measured", dtype=ctx.dtype_name,
                       status=f"skipped: {why}")
            continue
        providers.append(p)
    modes = tuple(m for m in op.modes if m in ctx.args.modes)
    if not modes:
        log(f"[{op.name}] no selected mode applies (op modes: {', '.join(op.modes)})")
        return
    op = OpSpec(**{**op.__dict__, "modes": modes})
    shapes = op.quick_shapes(ctx) if ctx.args.quick else op.shapes(ctx)
    if ctx.args.max_shapes:
        shapes = shapes[: ctx.args.max_shapes]
    log(f"[{op.name} {ctx.dtype_name}] {op.title}: {len(shapes)} shapes x {[p.name for p in providers]} x "
        f"{list(modes)}; {max(deadline - time.monotonic(), 0):.0f} s budget")
    if any(p.name == "quack" for p in op.providers) and (wanted is None or "quack" in wanted) and \
            _quack_reason(ctx) is not None:
        for row in _recorded_quack_rows(ctx, op, shapes):
            writer.add(**row)

    for idx, shape in enumerate(shapes):
        if time.monotonic() > deadline:
            for rest in shapes[idx:]:
                writer.add(op=op.name, provider="*", role="", source="measured", dtype=ctx.dtype_name,
                           shape=shape_str(rest), **_shape_fields(rest), status="skipped: op time budget spent")
            log(f"[{op.name}] time budget spent: {len(shapes) - idx} shapes skipped")
            break
        t_shape = time.perf_counter()
        torch.manual_seed(0)
        try:
            case = op.make_case(ctx, shape)
            with torch.no_grad():
                ref = case.reference()
                eager_err = max_abs_err(_first(case.eager()), ref)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory for one shape
            writer.add(op=op.name, provider="*", source="measured", dtype=ctx.dtype_name, shape=shape_str(shape),
                       **_shape_fields(shape), status=f"error: {describe_exception(e)}")
            log(f"[{op.name}] {shape_str(shape)}: setup failed: {describe_exception(e)}")
            _free(ctx)
            continue
        shape_rows = _run_providers(ctx, op, case, providers, ref)
        for r in shape_rows:
            r["max_err_eager"] = eager_err
            if r["role"] == "ours" and r.get("max_err") is not None:
                r["verified"] = two_x_rule(r["max_err"], eager_err, ctx.dtype)
        _speedups(shape_rows)
        for r in shape_rows:
            writer.add(**r)
        writer.checkpoint()
        log(_summary_line(op, shape, shape_rows, time.perf_counter() - t_shape))
        del case, ref
        _free(ctx)
    writer.checkpoint()


def _summary_line(op: OpSpec, shape: dict[str, int], rows: list[dict[str, Any]], secs: float) -> str:
    key = "gbps" if op.metric == "bandwidth" else "tflops"
    unit = "GB/s" if op.metric == "bandwidth" else "TFLOP/s"
    parts = []
    for mode in ("fwd", "bwd", "fwd+bwd"):
        vals = [f"{r['provider']}={r[key]:.4g}" for r in rows if r["mode"] == mode and r.get(key)]
        errs = [f"{r['provider']}:{r['status'][:60]}" for r in rows if r["mode"] == mode
                and not str(r.get("status", "")).startswith("ok")]
        if vals or errs:
            parts.append(f"{mode}: " + " ".join(vals + errs))
    ours = next((r for r in rows if r["provider"] == "ours" and r["mode"] == "fwd"), None)
    ver = "" if ours is None else f" verified={ours.get('verified')} err={ours.get('max_err')}"
    return f"[{op.name}] {shape_str(shape)} ({secs:.1f} s) {unit} | " + " | ".join(parts) + ver


def _free(ctx: Ctx) -> None:
    gc.collect()
    if ctx.on_gpu:
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list of ops (default: all): {', '.join(OPS)}")
    p.add_argument("--providers", default="", help="comma list of providers to run (default: all available)")
    p.add_argument("--modes", default="fwd,fwd+bwd", help="comma list of measured modes; bwd is derived when "
                   "both fwd and fwd+bwd run (default: fwd,fwd+bwd); fwd_graph: CUDA-graph device time at decode "
                   "sizes (M/T 1, 16, 64) for rms_norm, add_rms_norm, gemma_rms_norm, geglu_act, swiglu_act")
    p.add_argument("--dtypes", default=None, help="comma list of bf16, fp16, fp32 (default GPU bf16; CPU fp32,bf16)")
    p.add_argument("--cpu-half-gemm", action="store_true", help="also run the GEMM ops in bf16/fp16 on the CPU "
                   "(off by default: without bf16 matrix hardware a bf16 GEMM runs at well under 1 GFLOP/s)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--kernel", default=str(ROOT), help="checkout path (get_local_kernel) or Hub repo id "
                   "(get_kernel, honours LOCAL_KERNELS); default: this checkout")
    p.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"],
                   help="kernel variant; auto = the CPU variant on a CPU run, the installed torch's otherwise")
    p.add_argument("--results-root", default=str(Path(__file__).resolve().parent / "results"),
                   help="CSV goes to <results-root>/<device-slug>/<csv-name>")
    p.add_argument("--csv-name", default="sweep.csv")
    p.add_argument("--fresh", action="store_true", help="start a new CSV instead of replacing only this run's ops")
    p.add_argument("--quick", action="store_true", help="target shapes only")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-clock budget for the measurements (default: GPU 240 s full / 100 s quick; CPU 1800 s)")
    p.add_argument("--compile-share", type=float, default=0.4, help="share of each op's budget torch.compile may "
                   "spend compiling (default 0.4)")
    p.add_argument("--warmup-ms", type=float, default=None, help="do_bench warmup (default GPU 10, CPU 30)")
    p.add_argument("--rep-ms", type=float, default=None, help="do_bench rep (default GPU 30, CPU 150)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per shape: rep-ms is split "
                   "over them (default 3; 1: each provider timed in one window)")
    p.add_argument("--max-elems", type=int, default=None,
                   help="skip shapes with more elements per tensor (default GPU 2^29, CPU 2^24)")
    p.add_argument("--max-shapes", type=int, default=0, help="at most this many shapes per op (0: all)")
    p.add_argument("--no-ceilings", action="store_true", help="skip measuring copy bandwidth and GEMM rate")
    p.add_argument("--compile-tokens-1", action="store_true", help="also compile for token count 1 (one more graph "
                   "per static size; off by default to keep compile time bounded)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (torch.set_num_threads; 0: torch's default)")
    p.add_argument("--dry-run", action="store_true", help="print the plan (shapes x providers x modes) and a rough "
                   "time estimate for an H200, then exit")
    args = p.parse_args(argv)
    args.modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if args.rounds < 1:
        p.error(f"--rounds takes a count >= 1, got {args.rounds}")
    bad = [m for m in args.modes if m not in ("fwd", "fwd+bwd", GRAPH_MODE)]
    if bad:
        p.error(f"--modes takes fwd, fwd+bwd (bwd is derived) and {GRAPH_MODE}, got {bad}")
    unknown = [o for o in args.ops.split(",") if o and o not in OPS]
    if unknown:
        p.error(f"unknown ops {unknown}; known: {', '.join(OPS)}")
    return args


# Rough H200 model for --dry-run: sustained fraction of the copy bandwidth / GEMM rate per provider, seconds per
# torch.compile graph and per Liger JIT specialisation. Only used to print an estimate, never written to a CSV.
_EST_COPY_GBPS, _EST_GEMM_TFLOPS = 4200.0, 700.0
_EST_EFFICIENCY = {"eager": 0.1, "torch.nn.RMSNorm": 0.6}
_EST_COMPILE_S, _EST_LIGER_JIT_S, _EST_STARTUP_S = 3.5, 1.5, 20.0
_EST_COMPILE_S_GRAPH = 1.5  # one static-shape Inductor graph of a norm / activation


def dry_run(args: argparse.Namespace, device: str, warmup: float, rep: float) -> int:
    """Prints the plan and a rough wall-time estimate (an H200 model when device is cuda)."""
    ctx = Ctx(device=device, dtype=DTYPES["bf16"], dtype_name="bf16", fm=types.ModuleType("plan"),
              timer=Timer(device), ceilings=Ceilings(_EST_COPY_GBPS, {}), writer=None, args=args)  # type: ignore
    total_s, total_meas = _EST_STARTUP_S, 0
    wanted = set(args.providers.split(",")) if args.providers else None
    for name in args.ops.split(",") if any(m != GRAPH_MODE for m in args.modes) else []:
        op = OPS[name]
        shapes = op.quick_shapes(ctx) if args.quick else op.shapes(ctx)
        if args.max_shapes:
            shapes = shapes[: args.max_shapes]
        modes = [m for m in op.modes if m in args.modes]
        provs = [p for p in op.providers if (wanted is None or p.name in wanted) and p.name != "quack"
                 and (device == "cuda" or p.name != "liger")]
        op_s, keys = 0.0, set()
        for shape in shapes:
            bw = op.metric == "bandwidth"
            if bw:
                elems = shape.get("M", shape.get("T", 1)) * shape.get("N", shape.get("I", 1))
                amount = {"fwd": 3 * elems * 2, "fwd+bwd": 8 * elems * 2}
            else:
                if "H" in shape:
                    f = 6 * shape["T"] * shape["H"] * shape["I"]
                else:
                    f = 2 * shape["M"] * shape["K"] * shape["N"]
                amount = {"fwd": f, "fwd+bwd": 3 * f}
            for p in provs:
                for m in modes:
                    eff = _EST_EFFICIENCY.get(p.name, 0.8 if bw else 0.85)
                    t = amount[m] / (eff * (_EST_COPY_GBPS * 1e6 if bw else _EST_GEMM_TFLOPS * 1e9)) + 0.01
                    nr = args.rounds  # each round: warmup / nr, rep / nr and do_bench's 5-call estimate
                    op_s += nr * (max(warmup / nr, t) + max(rep / nr, t) + 5 * (t + 0.08) + 10) / 1e3
                    total_meas += 1
                if p.compiled and shape.get("M", shape.get("T")) != 1:
                    keys.add(() if name.endswith("_act") else tuple(v for k, v in shape.items() if k not in ("M", "T")))
            op_s += 0.03
        n_liger = len({tuple(v for k, v in s.items() if k not in ("M", "T")) for s in shapes}) \
            if any(p.name == "liger" for p in provs) else 0
        op_s += len(keys) * _EST_COMPILE_S + n_liger * _EST_LIGER_JIT_S
        total_s += op_s
        print(f"{name:15s} {len(shapes):3d} shapes x {len(provs)} providers x {len(modes)} modes; "
              f"{len(keys)} compile graphs; ~{op_s:5.0f} s")
    if GRAPH_MODE in args.modes:
        for name in args.ops.split(","):
            if name not in GRAPH_OPS:
                continue
            shapes_fn, provs = GRAPH_OPS[name]
            shapes = shapes_fn(ctx)[: args.max_shapes or None]
            n_prov = len([p for p in provs if wanted is None or p.name in wanted])
            op_s = len(shapes) * (n_prov * 0.3 + _EST_COMPILE_S_GRAPH)
            total_s += op_s
            total_meas += len(shapes) * n_prov
            print(f"{name:15s} {len(shapes):3d} shapes x {n_prov} providers x {GRAPH_MODE}; {len(shapes)} compile "
                  f"graphs; ~{op_s:5.0f} s")
    print(f"total: {total_meas} measurements, ~{total_s:.0f} s estimated without the budget "
          f"(the run stops measuring at --budget-s={args.budget_s:.0f} s plus startup)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    on_gpu = device == "cuda"
    args.max_elems = args.max_elems or (1 << 29 if on_gpu else 1 << 24)
    warmup = args.warmup_ms if args.warmup_ms is not None else (10.0 if on_gpu else 30.0)
    rep = args.rep_ms if args.rep_ms is not None else (30.0 if on_gpu else 150.0)
    if args.budget_s is None:
        args.budget_s = (100.0 if args.quick else 240.0) if on_gpu else 1800.0
    dtypes = [d.strip() for d in (args.dtypes or ("bf16" if on_gpu else "fp32,bf16")).split(",") if d.strip()]
    if any(d not in DTYPES for d in dtypes):
        raise SystemExit(f"--dtypes takes {', '.join(DTYPES)}; got {dtypes}")
    backend = None if args.backend == "auto" and on_gpu else ("cpu" if args.backend == "auto" else args.backend)
    if args.dry_run:
        return dry_run(args, device, warmup, rep)
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.backends.cuda.matmul.allow_tf32 = False
    torch._dynamo.config.automatic_dynamic_shapes = False  # dims are static unless marked (see the docstring)
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)
    for name in ("accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 4096)

    fm = load_kernel(args.kernel, backend)
    env = collect_env(device, fm)
    slug = device_slug(env)
    out_path = Path(args.results_root) / slug / args.csv_name
    writer = ResultWriter(out_path, env, merge=not args.fresh, key=sweep_row_key,
                          mirror=out_mirror(slug, args.csv_name))
    log(f"fused-mlp sweep: {env['device_name']} ({device}), torch {env['torch']}, triton {env['triton'] or '-'}, "
        f"cuda {env['cuda'] or '-'}, liger {env['liger'] or '-'}, kernel {env['kernel_build']}, git {env['git_rev']}")
    log(f"writing {out_path}" + (f" (and a copy in {writer.mirror})" if writer.mirror else "") +
        f"; dtypes {dtypes}; budget {args.budget_s:.0f} s; "
        f"timer warmup/rep {warmup:.0f}/{rep:.0f} ms in {args.rounds} interleaved rounds")

    timer = Timer(device, warmup_ms=warmup, rep_ms=rep)
    ops = [OPS[o] for o in args.ops.split(",") if o]
    gemm_dtypes = [d for d in dtypes if on_gpu or d == "fp32" or args.cpu_half_gemm]
    if not any(op.metric == "flops" for op in ops):
        gemm_dtypes = []
    if args.no_ceilings:
        ceilings = Ceilings(float("nan"), {})
    else:
        ceilings, rows = measure_ceilings(timer, device, gemm_dtypes)
        for r in rows:
            writer.add(**r)
        writer.checkpoint()
        log(f"ceilings: copy {ceilings.copy_gbps:.0f} GB/s; GEMM " +
            ", ".join(f"{d} {v:.2f} TFLOP/s" for d, v in ceilings.gemm_tflops.items()))
    plain_modes = [m for m in args.modes if m != GRAPH_MODE]
    graph_ops = [op for op in ops if GRAPH_MODE in args.modes and op.name in GRAPH_OPS]
    weights = {f"{op.name}:{d}": op.weight for d in dtypes for op in ops if plain_modes}
    weights.update({f"{op.name}:{d}:graph": 0.2 for d in dtypes for op in graph_ops})
    budget = Budget(args.budget_s - (time.monotonic() - t_start), weights)
    for dname in dtypes:
        ctx = Ctx(device=device, dtype=DTYPES[dname], dtype_name=dname, fm=fm, timer=timer, ceilings=ceilings,
                  writer=writer, args=args)
        for op in ops:
            t_op = time.monotonic()
            try:
                if plain_modes:
                    run_op(ctx, op, budget)
                if op in graph_ops:
                    run_graph_op(ctx, op, budget)
            except Exception as e:  # noqa: BLE001 - one op's failure never loses the others' rows
                log(f"[{op.name} {dname}] FAILED: {describe_exception(e)}")
                writer.add(op=op.name, provider="*", source="measured", dtype=dname,
                           status=f"error: {describe_exception(e)}")
            writer.checkpoint()
            log(f"[{op.name} {dname}] done in {time.monotonic() - t_op:.1f} s "
                f"(total {time.monotonic() - t_start:.0f} s)")
    log(f"wrote {out_path} ({len(writer.rows)} rows) in {time.monotonic() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
