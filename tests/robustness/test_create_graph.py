"""Backward with ``create_graph=True`` (gradient penalties, Hessian-vector products, meta-learning): every autograd
Function of the package gives the first-order gradients its kernels give, and gradients of those gradients equal to
its fp32 reference's. The backward kernels have no derivative of their own, so under ``create_graph`` the Functions
differentiate the op's plain-PyTorch fp32 reference instead, and say so once (docs/design.md#double-backward)."""

from __future__ import annotations

import importlib
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

F32 = torch.float32


def _leaf(*shape, device, scale=1.0):
    return (torch.randn(*shape, device=device) * scale).requires_grad_()


def _rms(fm, d, offset):
    x, w = _leaf(3, 5, 16, device=d), _leaf(16, device=d, scale=0.5)
    return (lambda x, w: fm.rms_norm(x, w, 1e-6, offset=offset),
            lambda x, w: fm.rms_norm_reference(x, w, 1e-6, offset=offset), [x, w])


def _rms_residual(fm, d):
    x, r, w = _leaf(4, 16, device=d), _leaf(4, 16, device=d), _leaf(16, device=d, scale=0.5)
    # both outputs reach the loss: y and the new residual stream h
    return (lambda x, r, w: torch.cat(fm.rms_norm(x, w, 1e-6, residual=r), -1),
            lambda x, r, w: torch.cat(fm.rms_norm_reference(x, w, 1e-6, residual=r), -1), [x, r, w])


def _gated(fm, d, name):
    g, u = _leaf(2, 3, 24, device=d), _leaf(2, 3, 24, device=d)
    return getattr(fm, name), getattr(fm, f"{name}_reference"), [g, u]


def _addmm(fm, d, act):
    b, x, w = _leaf(8, device=d), _leaf(6, 16, device=d, scale=0.5), _leaf(16, 8, device=d, scale=0.5)
    return (lambda b, x, w: fm.addmm(b, x, w, activation=act),
            lambda b, x, w: fm.addmm_reference(b, x, w, activation=act), [b, x, w])


def _linear_layer(fm, d):
    """The layer kernelize installs on an nn.Linear (reads the module's parameters, which are the inputs here)."""
    lin = torch.nn.Linear(16, 8, device=d)
    fwd = types.MethodType(fm.layers.Linear.forward, lin)
    x = _leaf(2, 3, 16, device=d)
    return (lambda x, w, b: fwd(x), lambda x, w, b: F.linear(x, w, b), [x, lin.weight, lin.bias])


def _mlp(fm, d, act):
    x = _leaf(5, 16, device=d, scale=0.5)
    ws = [_leaf(24, 16, device=d, scale=0.3), _leaf(24, 16, device=d, scale=0.3), _leaf(16, 24, device=d, scale=0.3)]
    bs = [_leaf(24, device=d, scale=0.1), _leaf(24, device=d, scale=0.1), _leaf(16, device=d, scale=0.1)]
    return (lambda x, wg, wu, wd, bg, bu, bd: fm.gated_mlp(x, wg, wu, wd, bg, bu, bd, activation=act),
            lambda x, wg, wu, wd, bg, bu, bd: fm.gated_mlp_reference(x, wg, wu, wd, bg, bu, bd, activation=act),
            [x, *ws, *bs])


CASES = {
    "rms_norm": lambda fm, d: _rms(fm, d, 0.0),
    "rms_norm gemma": lambda fm, d: _rms(fm, d, 1.0),
    "rms_norm residual": _rms_residual,
    "geglu": lambda fm, d: _gated(fm, d, "geglu"),
    "swiglu": lambda fm, d: _gated(fm, d, "swiglu"),
    "addmm": lambda fm, d: _addmm(fm, d, None),
    "addmm gelu_tanh": lambda fm, d: _addmm(fm, d, "gelu_tanh"),
    "addmm gelu": lambda fm, d: _addmm(fm, d, "gelu"),
    "Linear layer": _linear_layer,
    "gated_mlp gelu_tanh": lambda fm, d: _mlp(fm, d, "gelu_tanh"),
    "gated_mlp silu": lambda fm, d: _mlp(fm, d, "silu"),
}


def _loss(f, inputs, c):
    out = f(*inputs)
    # a constant-weighted term (only the op's own second derivative carries its curvature) and a square
    return (out * c).sum() + 0.5 * out.float().square().sum()


def _hvp(f, inputs, c, vs, *, create_graph=True):
    grads = torch.autograd.grad(_loss(f, inputs, c), inputs, create_graph=create_graph)
    if not create_graph:
        return grads, None
    second = torch.autograd.grad(sum((g * v).sum() for g, v in zip(grads, vs)), inputs, allow_unused=True)
    return grads, second


def _setup(fm, device, name):
    torch.manual_seed(0)
    f, ref, inputs = CASES[name](fm, device)
    with torch.no_grad():
        c = torch.randn_like(f(*inputs))
    vs = [torch.randn_like(t) for t in inputs]
    return f, ref, inputs, c, vs


@pytest.mark.parametrize("name", list(CASES))
def test_create_graph_gradients(fm, device, name):
    f, ref, inputs, c, vs = _setup(fm, device, name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the once-per-op notice: test_create_graph_warns_once
        kernels, _ = _hvp(f, inputs, c, vs, create_graph=False)
        first, second = _hvp(f, inputs, c, vs)
        _, want = _hvp(ref, inputs, c, vs)
    for i, (got, k) in enumerate(zip(first, kernels)):  # the same first-order gradients as the kernels'
        torch.testing.assert_close(got, k, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name} input {i}: {m}")
    for i, (got, w) in enumerate(zip(second, want)):  # and their own gradients: the reference's
        assert got is not None and w is not None, (name, i)
        tol = 1e-4 * max(1.0, w.abs().max().item())
        torch.testing.assert_close(got, w, rtol=1e-4, atol=tol, msg=lambda m: f"{name} input {i}: {m}")


def test_create_graph_warns_once(fm, device):
    f, _, inputs, c, _ = _setup(fm, device, "swiglu")
    warned = importlib.import_module(f"{fm.__name__}._common")._WARNED
    warned.difference_update([k for k in warned if k.startswith("create_graph:")])  # other tests' notices stay used
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.autograd.grad(_loss(f, inputs, c), inputs)  # no create_graph: the kernels, no notice
        for _ in range(2):
            torch.autograd.grad(_loss(f, inputs, c), inputs, create_graph=True)
    notes = [str(w.message) for w in caught if "create_graph" in str(w.message)]
    assert len(notes) == 1 and "reference" in notes[0], notes
