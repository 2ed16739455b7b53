"""Reliability across every public op: a table-driven bad-input matrix, NaN/Inf propagation, huge N, empty
inputs, bitwise determinism, CUDA graphs / streams / threads, and loading failures."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from conftest import CUDA, ROOT, requires_cuda

F32, BF16 = torch.float32, torch.bfloat16


# ---- the bad-input matrix -----------------------------------------------------------------------------------


@dataclass
class Bad:
    name: str
    call: Callable  # (fm, device) -> anything; must raise
    arg: str  # the argument the message must name
    needs_cuda: bool = False
    on_meta: bool = True  # False: a device mismatch against meta, which all-meta inputs do not have


def _t(*shape, dtype=F32, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device)


def _i(*shape, device="cpu"):
    return torch.randint(0, 5, shape, device=device)


BAD_INPUTS = [
    # rms_norm
    Bad("rms int x", lambda fm, d: fm.rms_norm(_i(4, 8, device=d), _t(8, device=d)), "x"),
    Bad("rms int weight", lambda fm, d: fm.rms_norm(_t(4, 8, device=d), _i(8, device=d)), "weight"),
    Bad("rms weight length", lambda fm, d: fm.rms_norm(_t(4, 8, device=d), _t(7, device=d)), "weight"),
    Bad("rms weight 2-D", lambda fm, d: fm.rms_norm(_t(4, 8, device=d), _t(1, 8, device=d)), "weight"),
    Bad("rms nan eps", lambda fm, d: fm.rms_norm(_t(4, 8, device=d), _t(8, device=d), float("nan")), "eps"),
    Bad("rms inf eps", lambda fm, d: fm.rms_norm(_t(4, 8, device=d), _t(8, device=d), float("inf")), "eps"),
    Bad("rms negative eps", lambda fm, d: fm.rms_norm(_t(4, 8, device=d), _t(8, device=d), -1e-6), "eps"),
    Bad("rms residual shape", lambda fm, d: fm.rms_norm(_t(4, 8, device=d), _t(8, device=d),
                                                        residual=_t(4, 9, device=d)), "residual"),
    Bad("rms residual int", lambda fm, d: fm.rms_norm(_t(4, 8, device=d), _t(8, device=d),
                                                      residual=_i(4, 8, device=d)), "residual"),
    Bad("rms residual_dtype", lambda fm, d: fm.rms_norm(_t(4, 8, device=d), _t(8, device=d),
                                                        residual=_t(4, 8, device=d), residual_dtype=torch.int32),
        "residual_dtype"),
    Bad("rms device mismatch", lambda fm, d: fm.rms_norm(_t(4, 8, device="cuda"), _t(8)), "weight", True),
    # empty inputs are checked as others are (the op's dtype checks come before its empty-input return)
    Bad("rms float64 weight, 0 rows", lambda fm, d: fm.rms_norm(_t(0, 8, device=d), _t(8, dtype=torch.float64,
                                                                                          device=d)), "weight"),
    Bad("rms int weight, 0 columns", lambda fm, d: fm.rms_norm(_t(3, 0, device=d), _i(0, device=d)), "weight"),
    Bad("rms float64 x, 0 rows", lambda fm, d: fm.rms_norm(_t(0, 8, dtype=torch.float64, device=d)), "x"),
    # residual_dtype is checked without a residual too, whatever eps's Python type (the fast paths took float eps)
    Bad("rms residual_dtype, no residual", lambda fm, d: fm.rms_norm(_t(4, 8, device=d), _t(8, device=d), 1e-6,
                                                                     residual_dtype=torch.float64), "residual_dtype"),
    # geglu / swiglu
    Bad("geglu shape", lambda fm, d: fm.geglu(_t(4, 8, device=d), _t(4, 9, device=d)), "up"),
    Bad("geglu int", lambda fm, d: fm.geglu(_i(4, 8, device=d), _t(4, 8, device=d)), "gate"),
    Bad("geglu approximate", lambda fm, d: fm.geglu(_t(4, 8, device=d), _t(4, 8, device=d), approximate="fast"),
        "approximate"),
    Bad("geglu device mismatch", lambda fm, d: fm.geglu(_t(4, 8, device="cuda"), _t(4, 8)), "up", True),
    Bad("swiglu shape", lambda fm, d: fm.swiglu(_t(4, 8, device=d), _t(3, 8, device=d)), "up"),
    Bad("swiglu int", lambda fm, d: fm.swiglu(_t(4, 8, device=d), _i(4, 8, device=d)), "up"),
    # addmm / linear
    Bad("addmm inner dim", lambda fm, d: fm.addmm(_t(5, device=d), _t(4, 8, device=d), _t(7, 5, device=d)), "mat2"),
    Bad("addmm bias length", lambda fm, d: fm.addmm(_t(6, device=d), _t(4, 8, device=d), _t(8, 5, device=d)), "bias"),
    Bad("addmm activation", lambda fm, d: fm.addmm(_t(5, device=d), _t(4, 8, device=d), _t(8, 5, device=d),
                                                   activation="relu"), "activation"),
    Bad("addmm int", lambda fm, d: fm.addmm(_t(5, device=d), _i(4, 8, device=d), _t(8, 5, device=d)), "mat1"),
    Bad("addmm device mismatch", lambda fm, d: fm.addmm(_t(5), _t(4, 8, device="cuda"), _t(8, 5, device="cuda")),
        "bias", True),
    # a meta operand beside a real one is a device mismatch (ATen's F.linear would return uninitialised memory)
    Bad("addmm meta mat2", lambda fm, d: fm.addmm(_t(5, device=d), _t(4, 8, device=d), _t(8, 5, device="meta")),
        "mat2", on_meta=False),
    Bad("linear meta weight", lambda fm, d: fm.linear(_t(4, 8, device=d), _t(5, 8, device="meta"), _t(5, device=d)),
        "weight", on_meta=False),
    Bad("linear meta bias", lambda fm, d: fm.linear(_t(4, 8, device=d), _t(5, 8, device=d), _t(5, device="meta"),
                                                    activation="gelu"), "bias", on_meta=False),
    Bad("linear fp16 bias, fp32 x", lambda fm, d: fm.linear(_t(4, 8, device=d), _t(5, 8, device=d),
                                                            _t(5, dtype=torch.float16, device=d)),
        "bias must be torch.float32, got torch.float16"),
    Bad("linear weight shape", lambda fm, d: fm.linear(_t(4, 8, device=d), _t(5, 7, device=d)), "weight"),
    Bad("linear bias length", lambda fm, d: fm.linear(_t(4, 8, device=d), _t(5, 8, device=d), _t(4, device=d)),
        "bias"),
    Bad("linear activation", lambda fm, d: fm.linear(_t(4, 8, device=d), _t(5, 8, device=d),
                                                     activation="swish"), "activation"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c.name for c in BAD_INPUTS])
def test_bad_input_raises_naming_the_argument(fm, device, case):
    if case.needs_cuda and not CUDA:
        pytest.skip("device-mismatch cases need a GPU")
    if case.needs_cuda and device != "cuda":
        pytest.skip("device-mismatch cases run once, on the CUDA parametrisation")
    with pytest.raises((ValueError, TypeError, RuntimeError)) as info:
        case.call(fm, device)
    assert case.arg in str(info.value), f"message does not name {case.arg!r}: {info.value}"


@pytest.mark.parametrize("case", [c for c in BAD_INPUTS if not c.needs_cuda and c.on_meta],
                         ids=[c.name for c in BAD_INPUTS if not c.needs_cuda and c.on_meta])
def test_bad_input_raises_on_meta_tensors(fm, case):
    """The same calls on the meta device (shape inference, deferred initialisation) raise the same errors: the
    eager fast paths leave meta tensors to the checked path, and the fake implementations check what the ops do."""
    with pytest.raises((ValueError, TypeError, RuntimeError)) as info:
        case.call(fm, "meta")
    assert case.arg in str(info.value), f"message does not name {case.arg!r}: {info.value}"


# ---- the bad-input matrix for the layers ---------------------------------------------------------------------
# A kernelized module gets whatever the model feeds it. Each case either gives the module's own result, or raises
# a clear error naming the argument, or refuses exactly what the module itself refuses — never a crash, a hang or
# a silently different value.


@dataclass
class BadLayer:
    name: str
    layer: str  # attribute of fm.layers
    module: Callable  # () -> the transformers / torch module (CPU, fp32 unless the case says otherwise)
    x: Callable  # () -> the input
    args: tuple  # names any of which the message may use for the offending argument


def _hf(path: str, cls: str):
    transformers = pytest.importorskip("transformers")
    del transformers
    import importlib

    return getattr(importlib.import_module(path), cls)


def _llama_norm(n=8, **kw):
    m = _hf("transformers.models.llama.modeling_llama", "LlamaRMSNorm")(n)
    for k, v in kw.items():
        setattr(m, k, v)
    return m


def _gemma_norm(n=8, **kw):
    m = _hf("transformers.models.gemma.modeling_gemma", "GemmaRMSNorm")(n)
    for k, v in kw.items():
        setattr(m, k, v)
    return m


def _gemma_mlp(dtype=F32):
    mod = _hf("transformers.models.gemma.modeling_gemma", "GemmaMLP")
    cfg = _hf("transformers.models.gemma.modeling_gemma", "GemmaConfig")(hidden_size=8, intermediate_size=16,
                                                                        hidden_act="gelu_pytorch_tanh")
    return mod(cfg).to(dtype)


def _conv1d(nf=5, nx=8):
    return _hf("transformers.pytorch_utils", "Conv1D")(nf, nx)


def _with(module, **params):
    for k, v in params.items():
        setattr(module, k, torch.nn.Parameter(v, requires_grad=v.is_floating_point()) if v is not None else None)
    return module


F64 = torch.float64
BAD_LAYER_INPUTS = [
    BadLayer("RMSNorm int input", "RMSNorm", _llama_norm, lambda: _i(4, 8), ("x", "hidden_states")),
    BadLayer("RMSNorm fp64 input", "RMSNorm", lambda: _llama_norm().double(), lambda: _t(4, 8, dtype=F64),
             ("x", "hidden_states")),
    BadLayer("RMSNorm wrong hidden size", "RMSNorm", _llama_norm, lambda: _t(4, 9), ("weight",)),
    BadLayer("RMSNorm 2-D weight", "RMSNorm", lambda: _with(_llama_norm(), weight=torch.ones(1, 8)),
             lambda: _t(4, 8), ("weight",)),
    BadLayer("RMSNorm int weight", "RMSNorm", lambda: _with(_llama_norm(), weight=torch.ones(8, dtype=torch.int32)),
             lambda: _t(4, 8), ("weight",)),
    BadLayer("RMSNorm NaN eps", "RMSNorm", lambda: _llama_norm(variance_epsilon=float("nan")), lambda: _t(4, 8),
             ("eps", "variance_epsilon")),
    BadLayer("RMSNorm negative eps", "RMSNorm", lambda: _llama_norm(variance_epsilon=-1.0), lambda: _t(4, 8),
             ("eps", "variance_epsilon")),
    BadLayer("RMSNorm 0-d input", "RMSNorm", lambda: _llama_norm(1), lambda: torch.tensor(1.0), ("x", "hidden")),
    BadLayer("GemmaRMSNorm int input", "GemmaRMSNorm", _gemma_norm, lambda: _i(4, 8), ("x",)),
    BadLayer("GemmaRMSNorm wrong hidden size", "GemmaRMSNorm", _gemma_norm, lambda: _t(2, 3, 7), ("weight",)),
    BadLayer("GemmaRMSNorm inf eps", "GemmaRMSNorm", lambda: _gemma_norm(eps=float("inf")), lambda: _t(4, 8),
             ("eps",)),
    BadLayer("GemmaRMSNorm fp64", "GemmaRMSNorm", lambda: _gemma_norm().double(), lambda: _t(4, 8, dtype=F64),
             ("x",)),
    BadLayer("GeGLUMLP wrong hidden size", "GeGLUMLP", _gemma_mlp, lambda: _t(4, 9), ("x", "mat1", "input")),
    BadLayer("GeGLUMLP int input", "GeGLUMLP", _gemma_mlp, lambda: _i(4, 8), ("x",)),
    BadLayer("GeGLUMLP fp64 module", "GeGLUMLP", lambda: _gemma_mlp(F64), lambda: _t(4, 8, dtype=F64), ("x",)),
    BadLayer("GeGLUMLP bf16 input, fp32 weights", "GeGLUMLP", _gemma_mlp, lambda: _t(4, 8, dtype=BF16), ("x",)),
    BadLayer("Linear wrong in_features", "Linear", lambda: torch.nn.Linear(8, 5), lambda: _t(4, 9),
             ("input", "weight")),
    BadLayer("Linear int input", "Linear", lambda: torch.nn.Linear(8, 5), lambda: _i(4, 8), ("input",)),
    BadLayer("Linear bf16 input, fp32 weight", "Linear", lambda: torch.nn.Linear(8, 5),
             lambda: _t(4, 8, dtype=BF16), ("input", "weight")),
    BadLayer("Linear fp64", "Linear", lambda: torch.nn.Linear(8, 5).double(), lambda: _t(4, 8, dtype=F64),
             ("input",)),
    BadLayer("Linear bias length", "Linear", lambda: _with(torch.nn.Linear(8, 5), bias=torch.zeros(4)),
             lambda: _t(4, 8), ("bias",)),
    BadLayer("Linear 1-D weight", "Linear", lambda: _with(torch.nn.Linear(8, 5), weight=torch.ones(8)),
             lambda: _t(4, 8), ("weight",)),
    BadLayer("Conv1D wrong nx", "Conv1D", _conv1d, lambda: _t(4, 9), ("mat1", "mat2", "x")),
    BadLayer("Conv1D int input", "Conv1D", _conv1d, lambda: _i(4, 8), ("mat1", "x")),
    BadLayer("Conv1D fp16 input, fp32 weight", "Conv1D", _conv1d, lambda: _t(4, 8, dtype=torch.float16),
             ("mat1", "mat2")),
    BadLayer("Conv1D bias length", "Conv1D", lambda: _with(_conv1d(), bias=torch.zeros(6)), lambda: _t(4, 8),
             ("bias",)),
    BadLayer("Conv1D 0-d input", "Conv1D", _conv1d, lambda: torch.tensor(1.0), ("mat1", "x")),
]


@pytest.mark.parametrize("case", BAD_LAYER_INPUTS, ids=[c.name for c in BAD_LAYER_INPUTS])
def test_layer_bad_input_matches_module_or_raises_clearly(fm, case):
    module, x = case.module(), case.x()
    try:
        expected = type(module).forward(module, x)
        module_error = None
    except Exception as e:  # what the replaced module itself does with this input
        expected, module_error = None, e
    try:
        with warnings.catch_warnings():  # a documented fallback to the module's own math is announced: fine here
            warnings.filterwarnings("ignore", message="fused_mlp: .* runs ", category=UserWarning)
            out = getattr(fm.layers, case.layer).forward(module, x)
    except (ValueError, TypeError, RuntimeError) as e:
        named = any(a in str(e) for a in case.args)
        assert named or module_error is not None, (
            f"the module accepts this input but the layer refuses it without naming {case.args}: {e}")
        return
    assert module_error is None, f"the layer silently accepted an input the module refuses ({module_error!r})"
    assert out.dtype == expected.dtype and out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_import_touches_no_network():
    """Loading the package and running every op and layer works with every socket call blocked and without
    HF_HUB_OFFLINE (tests/packaging/test_loading.py's NO_NETWORK child)."""
    sys.path.insert(0, str(ROOT / "tests" / "packaging"))  # also when this directory runs alone
    from test_loading import run_child

    out = run_child(
        f"""
        import os, pathlib, torch, kernels
        os.environ.pop("HF_HUB_OFFLINE", None)
        fm = kernels.get_local_kernel(pathlib.Path({str(ROOT)!r}))
        x = torch.randn(3, 16)
        fm.rms_norm(x, torch.ones(16)); fm.geglu(x, x); fm.swiglu(x, x)
        fm.addmm(None, x, torch.randn(16, 4)); fm.linear(x, torch.randn(4, 16))
        fm.gated_mlp(x, torch.randn(8, 16), torch.randn(8, 16), torch.randn(16, 8))
        lin = torch.nn.Linear(16, 4)
        print("ok", tuple(fm.layers.Linear.forward(lin, x).shape))
        """,
        {"HF_HUB_OFFLINE": "0"},
    )
    assert "ok (3, 4)" in out


# ---- values that are valid but extreme ------------------------------------------------------------------------


def _ops(fm, device: str, n: int, m: int = 2, dtype=F32):
    """(name, ours(), reference()) for every op at [m, n]."""
    g = torch.Generator(device="cpu").manual_seed(n)
    x = torch.randn(m, n, generator=g).to(device=device, dtype=dtype)
    u = torch.randn(m, n, generator=g).to(device=device, dtype=dtype)
    w = torch.randn(n, generator=g).to(device=device, dtype=dtype)
    k = 16
    a = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(k, n, generator=g).to(device=device, dtype=dtype)
    return [
        ("rms_norm", lambda: fm.rms_norm(x, w), lambda: fm.rms_norm_reference(x, w)),
        ("rms_norm+res", lambda: fm.rms_norm(x, w, residual=u)[0], lambda: fm.rms_norm_reference(x, w, residual=u)[0]),
        ("geglu", lambda: fm.geglu(x, u), lambda: fm.geglu_reference(x, u)),
        ("swiglu", lambda: fm.swiglu(x, u), lambda: fm.swiglu_reference(x, u)),
        ("addmm_gelu", lambda: fm.addmm(w, a, b, activation="gelu_tanh"),
         lambda: fm.addmm_reference(w, a, b, activation="gelu_tanh")),
    ]


def test_nan_and_inf_propagate_like_the_reference(fm, device):
    n = 64
    for name, ours, ref in _ops(fm, device, n):
        out, expected = ours(), ref()
        assert torch.equal(torch.isnan(out), torch.isnan(expected)), name
    # Planted NaN/Inf in the input of each op.
    x = torch.randn(3, n, device=device)
    x[0, 5] = float("nan")
    x[1, 7] = float("inf")
    w = torch.rand(n, device=device)
    for out, ref in [
        (fm.rms_norm(x, w), fm.rms_norm_reference(x, w)),
        (fm.geglu(x, x.flip(0)), fm.geglu_reference(x, x.flip(0))),
        (fm.swiglu(x, x.flip(0)), fm.swiglu_reference(x, x.flip(0))),
    ]:
        assert torch.equal(torch.isnan(out), torch.isnan(ref))
        assert torch.equal(torch.isinf(out), torch.isinf(ref))


def test_huge_hidden_size(fm, device):
    n = 262144
    for name, ours, ref in _ops(fm, device, n, m=2):
        torch.testing.assert_close(ours(), ref(), rtol=2e-5, atol=2e-5, msg=name)


def _huge_n_cases(fm, device: str, n: int):
    """(name, fn(*inputs), reference(*inputs), inputs) for every public op at hidden size n, with small other dims:
    the inputs require grad so forward and backward are both checked."""
    g = torch.Generator(device="cpu").manual_seed(1)

    def t(*shape, scale=1.0, dtype=F32):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    x, r, w = t(2, n), t(2, n), 1 + 0.25 * t(n)
    wg, wu, wd = t(4, n, scale=n**-0.5), t(4, n, scale=n**-0.5), t(n, 4, scale=0.5)
    a, b16, lw, lb = t(2, 16), t(16, n, scale=0.25), t(3, n, scale=n**-0.5), t(3)
    return [
        ("rms_norm", lambda x, w: fm.rms_norm(x, w), lambda x, w: fm.rms_norm_reference(x, w), (x, w)),
        ("rms_norm gemma+residual fp32 stream",
         lambda x, w, r: fm.rms_norm(x, w, offset=1.0, residual=r, residual_dtype=F32)[0],
         lambda x, w, r: fm.rms_norm_reference(x, w, offset=1.0, residual=r, residual_dtype=F32)[0], (x, w - 1, r)),
        ("rms_norm bf16 fp32-weight", lambda x, w: fm.rms_norm(x, w), lambda x, w: fm.rms_norm_reference(x, w),
         (x.to(BF16), w)),
        ("geglu", lambda a, b: fm.geglu(a, b), lambda a, b: fm.geglu_reference(a, b), (x, r)),
        ("geglu erf", lambda a, b: fm.geglu(a, b, approximate="none"),
         lambda a, b: fm.geglu_reference(a, b, approximate="none"), (x, r)),
        ("swiglu", lambda a, b: fm.swiglu(a, b), lambda a, b: fm.swiglu_reference(a, b), (x, r)),
        ("gated_mlp H=n", lambda *p: fm.gated_mlp(*p, activation="silu"),
         lambda *p: fm.gated_mlp_reference(*p, activation="silu"), (x, wg, wu, wd)),
        ("gated_mlp I=n", lambda *p: fm.gated_mlp(*p), lambda *p: fm.gated_mlp_reference(*p),
         (a[:, :4], wd, wd.clone(), wg)),
        ("addmm N=n gelu", lambda bias, m1, m2: fm.addmm(bias, m1, m2, activation="gelu"),
         lambda bias, m1, m2: fm.addmm_reference(bias, m1, m2, activation="gelu"), (w, a, b16)),
        ("linear K=n", lambda i, w, b: fm.linear(i, w, b, activation="gelu_tanh"),
         lambda i, w, b: fm.linear_reference(i, w, b, activation="gelu_tanh"), (x, lw, lb)),
    ]


def test_huge_n_every_op_forward_and_backward(fm, device):
    """N = 262144 for every op (the wide / multi-pass kernel paths), forward and backward, against the fp32
    reference's autograd (inputs are fp32 except the bf16 case, whose reference runs on fp32 copies)."""
    n = 262144
    for name, ours, ref, inputs in _huge_n_cases(fm, device, n):
        mine = [i.detach().clone().requires_grad_() for i in inputs]
        theirs = [i.detach().float().requires_grad_() for i in inputs]
        out, expected = ours(*mine), ref(*theirs)
        tol = 2e-2 if out.dtype == BF16 else 2e-5
        torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol, msg=name)
        dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(device)
        torch.autograd.backward(out, dy.to(out.dtype))
        torch.autograd.backward(expected, dy)
        for k, (a, b) in enumerate(zip(mine, theirs)):
            scale = max(b.grad.abs().max().item(), 1.0)
            torch.testing.assert_close(a.grad.float(), b.grad, rtol=tol, atol=tol * scale,
                                       msg=lambda m, k=k: f"{name}: grad {k}: {m}")


def test_huge_n_layers(fm, device):
    """The layers at N = 262144 against the modules they replace (fp32: equal to ~1e-5)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.pytorch_utils import Conv1D

    n = 262144
    torch.manual_seed(3)
    x = torch.randn(2, n, device=device)
    modules = [(fm.layers.RMSNorm, LlamaRMSNorm(n)), (fm.layers.GemmaRMSNorm, GemmaRMSNorm(n)),
               (fm.layers.Linear, torch.nn.Linear(n, 3)), (fm.layers.Conv1D, Conv1D(3, n))]
    for layer, module in modules:
        module = module.to(device)
        with torch.no_grad():
            for p in module.parameters():
                p.normal_(0, 0.05)
        torch.testing.assert_close(layer.forward(module, x), module(x), rtol=2e-5, atol=2e-5,
                                   msg=type(module).__name__)
    del transformers


def test_empty_inputs_give_empty_results(fm, device):
    for name, ours, ref in _ops(fm, device, 64, m=0):
        out = ours()
        assert out.shape == ref().shape and out.numel() == 0, name


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_empty_rms_norm_backward_of_a_sum(fm, device, dtype, residual):
    """y.sum().backward() on 0 rows hands backward an expanded [0, N] gradient (stride 0), which counts as
    contiguous: it must reach the kernel with unit stride like any other (it raised "dy must have unit stride")."""
    x = torch.randn(0, 8, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(8, device=device, dtype=dtype, requires_grad=True)
    r = torch.randn(0, 8, device=device, dtype=dtype, requires_grad=True) if residual else None
    out = fm.rms_norm(x, w, residual=r)
    (out[0].sum() + out[1].sum() if residual else out.sum()).backward()
    assert x.grad.shape == (0, 8) and torch.equal(w.grad, torch.zeros_like(w))
    if residual:
        assert r.grad.shape == (0, 8)


# ---- determinism ----------------------------------------------------------------------------------------------


def _fwd_bwd(fm, device, dtype, seed):
    torch.manual_seed(seed)
    m, n, h = 300, 1000, 64
    x = torch.randn(m, n, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(n, device=device, dtype=dtype, requires_grad=True)
    r = torch.randn(m, n, device=device, dtype=dtype, requires_grad=True)
    up = torch.randn(m, n, device=device, dtype=dtype, requires_grad=True)
    wl = torch.randn(h, n, device=device, dtype=dtype, requires_grad=True)
    bl = torch.randn(h, device=device, dtype=dtype, requires_grad=True)
    y, hres = fm.rms_norm(x, w, residual=r)
    a = fm.geglu(y, up)
    z = fm.linear(a, wl, bl, activation="gelu_tanh")
    (z.float().square().mean() + hres.float().mean()).backward()
    return [t.detach().clone() for t in (y, a, z, x.grad, w.grad, r.grad, up.grad, wl.grad, bl.grad)]


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_bitwise_deterministic(fm, device, dtype):
    first = _fwd_bwd(fm, device, dtype, 0)
    second = _fwd_bwd(fm, device, dtype, 0)
    for i, (a, b) in enumerate(zip(first, second)):
        assert torch.equal(a, b), f"output {i} differs between identical runs"


def _op_runs(fm, device: str):
    """(name, run) for every op and layer: run() builds the inputs from a fixed seed, does forward and backward, and
    returns every output and gradient. Shapes span several blocks / row chunks of each reduction (dW, db)."""
    big = device == "cuda"
    m, n = (4096, 1536) if big else (700, 384)

    def inputs(seed, *shapes, dtype=F32, scale=1.0):
        g = torch.Generator().manual_seed(seed)
        return [(torch.randn(*s, generator=g) * scale).to(device=device, dtype=dtype).requires_grad_()
                for s in shapes]

    def grads(outs, leaves):
        g = torch.Generator().manual_seed(99)
        dys = [torch.randn(o.shape, generator=g).to(device=device, dtype=o.dtype) for o in outs]
        torch.autograd.backward(outs, dys)
        return [o.detach().clone() for o in outs] + [t.grad.clone() for t in leaves]

    def rms(dtype, **kw):
        def run():
            x, w, r = inputs(0, (m, n), (n,), (m, n), dtype=dtype)
            y, h = fm.rms_norm(x, w, residual=r, **kw)
            return grads([y, h], [x, w, r])
        return run

    def rms_wide():
        x, w = inputs(1, (8 if big else 2, 65537), (65537,), dtype=BF16)
        return grads([fm.rms_norm(x, w, offset=1.0)], [x, w])

    def gated(approximate):
        def run():
            gate, up = inputs(2, (m, n), (m, n), dtype=BF16)
            fn = fm.swiglu if approximate is None else (lambda a, b: fm.geglu(a, b, approximate=approximate))
            return grads([fn(gate, up)], [gate, up])
        return run

    def mlp():
        x, wg, wu, wd, bd = inputs(3, (m // 4, 256), (512, 256), (512, 256), (256, 512), (256,), dtype=BF16,
                                   scale=0.06)
        return grads([fm.gated_mlp(x, wg, wu, wd, None, None, bd)], [x, wg, wu, wd, bd])

    def addmm(act, bias_dtype):
        def run():
            x, w = inputs(4, (m, 96), (96, 200), dtype=BF16)
            (b,) = inputs(5, (200,), dtype=bias_dtype)
            return grads([fm.addmm(b, x, w, activation=act)], [b, x, w])
        return run

    def linear_layer():
        torch.manual_seed(6)
        lin = torch.nn.Linear(96, 200).to(device=device, dtype=BF16)
        (x,) = inputs(6, (m, 96), dtype=BF16)
        y = fm.layers.Linear.forward(lin, x)
        return grads([y], [x, lin.weight, lin.bias])

    return [
        ("rms_norm+residual fp32", rms(F32)),
        ("rms_norm+residual bf16 fp32 stream", rms(BF16, residual_dtype=F32, offset=1.0)),
        ("rms_norm wide", rms_wide),
        ("geglu tanh", gated("tanh")),
        ("geglu erf", gated("none")),
        ("swiglu", gated(None)),
        ("gated_mlp", mlp),
        ("addmm gelu fp32 bias", addmm("gelu", F32)),
        ("addmm gelu_tanh", addmm("gelu_tanh", BF16)),
        ("addmm none", addmm(None, BF16)),
        ("Linear layer", linear_layer),
    ]


def test_every_op_bitwise_deterministic(fm, device):
    """Forward outputs and every gradient (dW, db reductions included) are bitwise identical run to run."""
    for name, run in _op_runs(fm, device):
        first, second = run(), run()
        for i, (a, b) in enumerate(zip(first, second)):
            assert torch.equal(a, b), f"{name}: result {i} differs between identical runs"


def test_cpu_results_independent_of_thread_count(fm):
    """What the CPU kernels promise (kernels_src/cpu/*.cpp): rms_norm's dW is summed from a fixed number of row
    chunks (a function of M and N only) and addmm's db per column in a fixed row order, so torch.set_num_threads(1) and
    (2) give bitwise the same dW / db — and the same y, dx, h (row-parallel, no cross-row sums) and geglu results
    (elementwise). addmm's dX / dW and gated_mlp go through ATen's GEMMs / sums, which promise nothing across
    thread counts: not checked."""
    old = torch.get_num_threads()
    runs = dict(_op_runs(fm, "cpu"))
    checks = {
        "rms_norm+residual fp32": None, "rms_norm+residual bf16 fp32 stream": None, "rms_norm wide": None,
        "geglu tanh": None, "geglu erf": None, "swiglu": None,
        # addmm: db is result 1 (the bias is the first leaf); y, dx, dW come from ATen's GEMM
        "addmm gelu fp32 bias": (1,), "addmm gelu_tanh": (1,), "addmm none": (1,),
    }
    try:
        results = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results[threads] = {name: runs[name]() for name in checks}
    finally:
        torch.set_num_threads(old)
    for name, which in checks.items():
        one, two = results[1][name], results[2][name]
        for i in (range(len(one)) if which is None else which):
            assert torch.equal(one[i], two[i]), f"{name}: result {i} depends on the thread count"


# ---- CUDA graphs, streams, threads ---------------------------------------------------------------------------


def _layer_stack(fm, dtype=BF16):
    """Functional forward of norm -> gated MLP -> linear on CUDA, for capture tests."""
    torch.manual_seed(0)
    n, i = 512, 1024
    w = torch.randn(n, device="cuda", dtype=dtype)
    wg = torch.randn(i, n, device="cuda", dtype=dtype) / n**0.5
    wu = torch.randn(i, n, device="cuda", dtype=dtype) / n**0.5
    wd = torch.randn(n, i, device="cuda", dtype=dtype) / i**0.5
    bd = torch.randn(n, device="cuda", dtype=dtype)

    def fn(x, r):
        y, h = fm.rms_norm(x, w, residual=r, offset=1.0)
        a = fm.geglu(fm.linear(y, wg), fm.linear(y, wu))
        return fm.linear(a, wd, bd, activation="gelu_tanh") + h

    return fn, n


@requires_cuda
def test_cuda_graph_capture_and_replay(fm):
    fn, n = _layer_stack(fm)
    x = torch.randn(64, n, device="cuda", dtype=BF16)
    r = torch.randn(64, n, device="cuda", dtype=BF16)
    expected = fn(x, r)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn(x, r)  # warm-up: heuristics cached, workspaces allocated
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x, r)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, fn(x, r), rtol=0, atol=0)
    assert not torch.equal(out, expected)


@requires_cuda
def test_reduce_overhead_compile(fm):
    """mode="reduce-overhead" (CUDA graphs around the compiled graph, our ops inside it) replays with new inputs
    bitwise what the same compiled graph gives without CUDA graphs, and stays within two bf16 roundings (of the
    output's largest magnitude) of the eager kernels: under torch.compile the norm and the activation are Inductor's
    fp32 decomposition (another summation order: a 1-ulp flip in y reaches every output of the GEMMs after it, which
    round once more), docs/design.md#under-torchcompile."""
    fn, n = _layer_stack(fm)
    graphs = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    x = torch.randn(64, n, device="cuda", dtype=BF16)
    r = torch.randn(64, n, device="cuda", dtype=BF16)
    for _ in range(3):
        graphs(x, r)  # warm-up, then the recorded graph
    x2 = torch.randn_like(x)
    out = graphs(x2, r).clone()  # a replay on new inputs (the output buffer belongs to the graph)
    no_graphs = torch.compile(_layer_stack(fm)[0], fullgraph=True)
    torch.testing.assert_close(out, no_graphs(x2, r), rtol=0, atol=0)
    eager = fn(x2, r)
    assert not torch.equal(out, graphs(x, r))  # the replay follows its inputs
    scale = eager.float().abs().max().item()
    torch.testing.assert_close(out.float(), eager.float(), rtol=0, atol=2 * 2.0**-8 * scale)


@requires_cuda
def test_non_default_stream_and_two_threads(fm):
    fn, n = _layer_stack(fm)
    inputs = [(torch.randn(256, n, device="cuda", dtype=BF16), torch.randn(256, n, device="cuda", dtype=BF16))
              for _ in range(2)]
    expected = [fn(x, r) for x, r in inputs]
    torch.cuda.synchronize()
    results: list = [None, None]
    errors: list = []

    def worker(k: int) -> None:
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for _ in range(20):
                    results[k] = fn(*inputs[k])
            stream.synchronize()
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in range(2):
        torch.testing.assert_close(results[k], expected[k], rtol=0, atol=0)


# ---- loading failures -----------------------------------------------------------------------------------------


def _copy_build(tmp_path):
    dst = tmp_path / "checkout"
    shutil.copytree(ROOT / "build", dst / "build", ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def _load_in_child(path, backend: str = "cpu") -> subprocess.CompletedProcess:
    code = f"import kernels, pathlib; kernels.get_local_kernel(pathlib.Path({str(path)!r}), backend={backend!r})"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_corrupted_metadata_gives_a_clear_error(tmp_path):
    root = _copy_build(tmp_path)
    for meta in root.glob("build/*/metadata.json"):
        meta.write_text("{ this is not json")
    proc = _load_in_child(root)
    assert proc.returncode != 0
    assert "metadata" in proc.stderr.lower() or "json" in proc.stderr.lower(), proc.stderr[-2000:]


def test_metadata_missing_fields_gives_a_clear_error(tmp_path):
    root = _copy_build(tmp_path)
    for meta in root.glob("build/*/metadata.json"):
        data = json.loads(meta.read_text())
        del data["name"]
        meta.write_text(json.dumps(data))
    # a backend that was built here (a GPU machine's checkout may hold the CUDA variant only)
    built_cpu = any("-cpu-" in v.name for v in (root / "build").iterdir())
    proc = _load_in_child(root, backend="cpu" if built_cpu else "cuda")
    assert proc.returncode != 0 and "name" in proc.stderr, proc.stderr[-2000:]


def test_missing_variant_gives_a_clear_error(tmp_path):
    root = _copy_build(tmp_path)
    for variant in list((root / "build").iterdir()):
        if "-cpu-" in variant.name:
            shutil.rmtree(variant)
    proc = _load_in_child(root, backend="cpu")
    assert proc.returncode != 0 and "Cannot find a build variant" in proc.stderr, proc.stderr[-2000:]


def test_digest_detects_a_changed_file(tmp_path):
    """SECURITY.md's integrity check: the metadata digest (kernels' Digest API) rejects a variant whose files
    changed after the build, and accepts the untouched copy."""
    from kernels._rust import Digest, DigestValidationError, Metadata

    root = _copy_build(tmp_path)
    for v in sorted(p for p in (root / "build").iterdir() if p.is_dir()):
        meta = Metadata.read_from_file(v / "metadata.json")
        meta.digest.validate(Digest.hash_variant(meta.digest.algorithm, str(v)))
        layers = v / "layers.py"
        layers.write_text(layers.read_text() + "\nimport os  # tampered\n")
        with pytest.raises(DigestValidationError):
            meta.digest.validate(Digest.hash_variant(meta.digest.algorithm, str(v)))
