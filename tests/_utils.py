"""Numerical comparison helpers shared by the tests."""

from __future__ import annotations

import contextlib
import importlib
import math
import warnings

import torch

# Absolute floor per dtype for the 2x rule: covers outputs whose exact value sits on a rounding boundary.
FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


_ERR_CHUNK = 1 << 26  # elements per fp64 slice: a model's logits (Gemma vocab x 4096 tokens) in ~2 GiB pieces


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| where b is finite (NaN in `a` there gives NaN, which fails every comparison). Same-shape
    operands are compared in fp64 slices, so that large outputs do not need fp64 copies of the whole tensors (GPU
    tests run several workers on one card)."""
    if a.shape != b.shape or b.numel() <= _ERR_CHUNK:
        mask = torch.isfinite(b)
        if not bool(mask.any()):
            return 0.0
        return (a.double()[mask] - b.double()[mask]).abs().max().item()
    a, b = a.reshape(-1), b.reshape(-1)
    best = None
    for s in range(0, b.numel(), _ERR_CHUNK):
        bs = b[s:s + _ERR_CHUNK]
        mask = torch.isfinite(bs)
        if not bool(mask.any()):
            continue
        e = (a[s:s + _ERR_CHUNK].double()[mask] - bs.double()[mask]).abs().max()
        best = e if best is None else torch.maximum(best, e)  # maximum propagates NaN
    return 0.0 if best is None else best.item()


def assert_2x_rule(out: torch.Tensor, ref32: torch.Tensor, torch_same_dtype: torch.Tensor, *, name: str = "out",
                   floor: float | None = None) -> None:
    """flash-attention's rule: our error vs the fp32 reference is at most twice the error of the same-dtype
    PyTorch computation, plus a small per-dtype floor. Shapes and dtypes must match exactly."""
    assert out.shape == ref32.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref32.shape)}"
    assert out.dtype == torch_same_dtype.dtype, f"{name}: dtype {out.dtype} != {torch_same_dtype.dtype}"
    ours = max_err(out, ref32)
    theirs = max_err(torch_same_dtype, ref32)
    fl = FLOOR[out.dtype] if floor is None else floor
    assert ours <= 2 * theirs + fl, f"{name}: max err {ours:.3g} > 2 x PyTorch's {theirs:.3g} + {fl:.1g}"
    assert torch.equal(torch.isnan(out), torch.isnan(ref32)), f"{name}: NaN pattern differs from the reference"
    inf = torch.isinf(ref32)
    assert torch.equal(torch.isinf(out), inf) and torch.equal(out[inf].double(), ref32[inf].double()), (
        f"{name}: Inf pattern differs from the reference")


# torch >= 2.14: ctx.set_output_grad_dtype lets an fp32 gradient reach a Function's backward uncast at a bf16/fp16
# output. On older torch the autograd engine rounds it to the output's dtype before any backward sees it, so tests
# that send an fp32 gradient to a 16-bit output draw it in the output's dtype there (what the kernel then receives).
GRAD_DTYPE_KEPT = hasattr(torch.autograd.function.FunctionCtx, "set_output_grad_dtype")


def incoming_grad_dtype(want_fp32: bool, out_dtype: torch.dtype) -> torch.dtype:
    """The dtype a test's upstream gradient is drawn in: fp32 when asked and the engine passes it through uncast."""
    return torch.float32 if want_fp32 and (GRAD_DTYPE_KEPT or out_dtype == torch.float32) else out_dtype


@contextlib.contextmanager
def opted_in(pairs):
    """``kernels.replace_kernel_forward_from_hub(cls, name)`` for each pair, for the duration of the block: the
    classes (transformers' own: Conv1D, the MLPs, the Gemma norms) get their previous tag attributes back afterwards,
    so no other test sees them tagged. (Forwards already swapped on instances stay swapped: kernelize sets them per
    module.)"""
    import kernels

    attrs = ("kernel_layer_name", "kernel_condition")
    saved = [(cls, {a: cls.__dict__[a] for a in attrs if a in cls.__dict__}) for cls, _ in pairs]
    try:
        for cls, name in pairs:
            kernels.replace_kernel_forward_from_hub(cls, name)
        yield
    finally:
        for cls, old in reversed(saved):
            for a in attrs:
                if a in old:
                    setattr(cls, a, old[a])
                elif a in cls.__dict__:
                    delattr(cls, a)


def _sigmoid(z: float) -> float:
    """sigmoid in double, accurate in both tails (never forms 1 - 1)."""
    if z != z:
        return z
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z) if z > -745 else 0.0
    return e / (1.0 + e)


def _gelu_tanh_z(x: float) -> float:
    """2 sqrt(2/pi) (x + 0.044715 x^3): the sigmoid argument of tanh-GeLU (x itself beyond 1e100: no overflow)."""
    return 2.0 * math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x) if abs(x) < 1e100 else x


def exact_act(act: str, x: float) -> float:
    """The activation in Python double arithmetic, element by element: the platform-independent definition (PyTorch's
    own fp32 CPU kernels disagree across machines at the extremes: with AVX-512, erf-GeLU(+inf) is NaN there), in
    forms that keep their relative accuracy in the negative tails (0.5 x (1 + tanh u) and 0.5 x (1 + erf) cancel to
    0 there even in double): tanh-GeLU = x sigmoid(2u), erf-GeLU = 0.5 x erfc(-x / sqrt 2)."""
    if act == "silu":
        return x * _sigmoid(x)
    if act == "gelu":
        return 0.5 * x * math.erfc(-x / math.sqrt(2.0))
    return x * _sigmoid(_gelu_tanh_z(x))


# 16-bit tails, absolute tolerances per activation. tanh-GeLU and SiLU (the MUFU ex2/rcp forms, flushed to zero
# below 2^-126): act(x) far in the negative tail is x e^z with e^z below fp32's normal range, about 1e-36 and less;
# flushing gives 0 there, as PyTorch's own fp32 forms do (its 1 + tanh and 1 / (1 + e^-x) reach 0 sooner). erf-GeLU
# on CUDA takes Phi = 0.5 + 0.5 erff as PyTorch does (kernels_src/cuda/geglu.cu says why: erfcf would make the
# elementwise kernel compute-bound), accurate to ~2^-24 absolute, not relative, below x = -3; the CPU forms are
# relatively accurate there too.
TAIL_ATOL = {"gelu_tanh": 1e-34, "silu": 1e-34, "gelu": 1e-6}
TAILS = [0.0, -0.0, 1e-30, -1e-30, 0.5, -0.5, 2.0, -2.0, 5.0, -5.0, 9.5, -9.5, 10.2, -10.2, 12.0, -12.0, 30.0,
         -30.0, 88.0, -88.0, 90.0, -90.0, 110.0, -110.0, 1000.0, -1000.0]


def exact_grad(act: str, x: float) -> float:
    """d act / dx in double for finite x, accurate in the tails (as exact_act)."""
    if act == "silu":  # s + x s (1 - s), with 1 - s = sigmoid(-x) (no cancellation)
        return _sigmoid(x) + x * _sigmoid(x) * _sigmoid(-x)
    if act == "gelu":
        return 0.5 * math.erfc(-x / math.sqrt(2.0)) + x * math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    z = _gelu_tanh_z(x)
    dz = 2.0 * math.sqrt(2.0 / math.pi) * (1.0 + 3.0 * 0.044715 * x * x)
    return _sigmoid(z) + x * _sigmoid(z) * _sigmoid(-z) * dz


def spy_mlp_ops(fm, monkeypatch) -> list[str]:
    """Record, by name and in order, the ops ``gated_mlp`` (the package's gated_mlp.py) calls."""
    import sys

    mod = sys.modules[fm.__name__ + ".gated_mlp"]
    real, called = mod.ops, []

    class Recorder:
        def __getattr__(self, name):
            called.append(name)
            return getattr(real, name)

    monkeypatch.setattr(mod, "ops", Recorder())
    return called


def compile_static_then_dynamic(f, static_x: torch.Tensor, token_counts, make_x):
    """``f`` under torch.compile(fullgraph=True) with a backend that records each graph's code, twice, without grad:
    at ``static_x``'s concrete shape (dynamic=False), then over ``make_x(t)`` for each t in ``token_counts`` with only
    dim 1 (the tokens) marked dynamic and a recompile an error. Returns (static graphs, static output, dynamic graphs,
    [(t, x, output)])."""
    graphs: list[str] = []

    def backend(gm, example_inputs):
        graphs.append(gm.print_readable(print_output=False))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(f, fullgraph=True, dynamic=False, backend=backend)(static_x)
    static_graphs = list(graphs)
    torch._dynamo.reset()
    graphs.clear()
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    runs = []
    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
        for t in token_counts:
            x = make_x(t)
            torch._dynamo.mark_dynamic(x, 1)
            runs.append((t, x, compiled(x)))
    torch._dynamo.reset()
    return static_graphs, out, list(graphs), runs


# ---- fakes for the decode predicates on a machine without a GPU -----------------------------------------------------

def as_fake_cuda(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor (any view of one) presented as living on cuda:0, without a GPU: a fake tensor, enough for
    predicates that read only metadata. Running an op on it would initialise CUDA: build views on the meta tensor."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    return FakeTensor(FakeTensorMode(allow_non_fake_inputs=True), t, torch.device("cuda", 0))


def fake_cuda(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``as_fake_cuda`` of a new contiguous meta tensor."""
    return as_fake_cuda(torch.empty(shape, dtype=dtype, device="meta"))


def symbolic_tokens(h: int, dtype: torch.dtype = torch.bfloat16):
    """``(x, shape_env)``: a fake ``[T, h]`` tensor on cuda:0 whose T is symbolic (as under torch.compile with a dynamic
    batch dimension), and the shape environment that records any guard a predicate adds on T."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    x = mode.from_tensor(torch.empty(4, h, dtype=dtype), symbolic_context=ctx)
    assert isinstance(x.shape[0], torch.SymInt)
    x.fake_device = torch.device("cuda", 0)  # the predicates ask x.is_cuda first
    return x, shape_env


class Tagged(torch.Tensor):
    """A tensor subclass that is not DTensor (what a wrapper library might pass): no kernel takes it."""


def fallback_warnings(fm, fn, match: str = "own PyTorch"):
    """(fn(), the texts of the warnings holding `match` it raised: by default the layers' fallback warnings), with
    the package's warn-once memory cleared
    first: each fallback reason warns once per process, so an earlier test may have used it up. (What was said before
    counts as said again afterwards: later tests see no warning this one brought back.)"""
    warned = importlib.import_module(f"{fm.__name__}._common")._WARNED
    before = set(warned)
    warned.clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = fn()
    finally:
        warned |= before
    return out, [str(w.message) for w in caught if match in str(w.message)]
