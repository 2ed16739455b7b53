"""torch.export of the functional ops, and the raw ops called with inputs that require grad: an exported program
runs and keeps its gradients, as the same program built from plain PyTorch does. Export inlines an autograd
Function's forward and drops its backward, and the ops have no derivative of their own, so under export the training
paths take differentiable math (docs/design.md#torchexport)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

H, I = 32, 48


class _Op(nn.Module):
    """A module around one functional op, with its weights as parameters."""

    def __init__(self, fm, kind, device):
        super().__init__()
        self.fm, self.kind = fm, kind
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter((torch.randn(I, H, generator=g) / H**0.5).to(device))
        self.w2 = nn.Parameter((torch.randn(I, H, generator=g) / H**0.5).to(device))
        self.wd = nn.Parameter((torch.randn(H, I, generator=g) / I**0.5).to(device))
        self.b = nn.Parameter((torch.randn(I, generator=g) / 10).to(device))

    def forward(self, x):
        fm = self.fm
        if self.kind == "linear":
            return fm.linear(x, self.w, self.b)
        if self.kind == "linear gelu_tanh":
            return fm.linear(x, self.w, self.b, activation="gelu_tanh")
        if self.kind == "addmm gelu":
            return fm.addmm(self.b, x.reshape(-1, H), self.w.t(), activation="gelu")
        return fm.gated_mlp(x, self.w, self.w2, self.wd, self.b, self.b, activation="silu")  # one bias twice


KINDS = ["linear", "linear gelu_tanh", "addmm gelu", "gated_mlp"]


def _grads(module, x):
    x = x.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    y = module(x)
    (y * torch.linspace(-1, 1, y.numel(), device=y.device).view(y.shape)).sum().backward()
    return y.detach(), [x.grad] + [p.grad for _, p in sorted(module.named_parameters())]


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
@pytest.mark.parametrize("kind", KINDS)
def test_exported_program_runs_and_keeps_gradients(fm, device, kind, strict):
    module = _Op(fm, kind, device)
    x = torch.randn(2, 5, H, device=device)
    want_y, want = _grads(module, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(module, (x,), strict=strict)
    exported = ep.module()
    got_y, got = _grads(exported, x)  # run in grad mode, parameters requiring grad: as a user calls it
    torch.testing.assert_close(got_y, want_y, rtol=1e-4, atol=1e-4)
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:  # a parameter this op does not use
            assert g is None, (kind, i)
            continue
        assert g is not None, f"{kind}: gradient {i} lost in the exported program"
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=lambda m: f"{kind} gradient {i}: {m}")


def test_gated_mlp_with_a_tensor_passed_twice_compiles(fm, device):
    """Dynamo refuses an autograd Function given one tensor twice (tied biases or weights): that call takes the
    plain math when traced, with no graph break."""
    module = _Op(fm, "gated_mlp", device)
    x = torch.randn(3, H, device=device)
    want_y, want = _grads(module, x)
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    got_y, got = _grads(compiled, x)
    torch.testing.assert_close(got_y, want_y, rtol=1e-4, atol=1e-4)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["linear gelu_tanh", "addmm gelu", "gated_mlp distinct biases"])
def test_plain_compile_of_training_keeps_the_ops(fm, device, kind):
    """Plain torch.compile is not export: training traces the ops, not the plain math (dynamo of torch 2.11 answers
    ``torch.compiler.is_exporting()`` with True under every compile)."""
    module = _Op(fm, kind.split(" distinct")[0], device)
    if kind.endswith("distinct biases"):
        module.forward = lambda x: fm.gated_mlp(x, module.w, module.w2, module.wd, module.b, module.b * 2,
                                                activation="silu")
    x = torch.randn(3, 4, H, device=device, requires_grad=True)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.print_readable(print_output=False))
        return gm.forward

    torch._dynamo.reset()
    try:
        y = torch.compile(module, fullgraph=True, backend=backend)(x)
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1
    op = ("geglu_fwd", "gated_gemm_fwd") if kind.startswith("gated") else ("addmm_fwd",)
    assert any(f"::{o}" in graphs[0] or f".{o}" in graphs[0] for o in op), graphs[0]
    y.sum().backward()  # the traced autograd Function keeps its backward
    assert x.grad is not None and module.w.grad is not None


@pytest.mark.parametrize("act", ["none", "gelu_tanh"])
def test_raw_addmm_op_takes_inputs_that_require_grad(fm, act):
    """What an exported program does when it holds the op: a direct call in grad mode with inputs that require grad
    (the op has no derivative: torch warns, the values are right, grad mode is as it was)."""
    x, w, b = (torch.randn(*s).requires_grad_() for s in ((4, 8), (8, 5), (5,)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y, _ = fm._ops.ops.addmm_fwd(b, x, w, act, False, [4, 5])
    assert torch.is_grad_enabled()
    ref = fm.addmm_reference(b, x, w, activation=None if act == "none" else act)
    torch.testing.assert_close(y, ref.detach(), rtol=1e-5, atol=1e-5)


def test_export_says_once_that_it_traces_plain_math(fm):
    """The traced plain math is a documented fallback from the ops: announced once per op."""
    import importlib

    warned = importlib.import_module(f"{fm.__name__}._common")._WARNED
    warned.difference_update({"export:addmm", "traced:gated_mlp"})
    x = torch.randn(2, 5, H)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for kind in ("linear gelu_tanh", "gated_mlp", "linear gelu_tanh", "gated_mlp"):
            torch.export.export(_Op(fm, kind, "cpu"), (x,), strict=False)
    said = [str(w.message) for w in caught if str(w.message).startswith("fused_mlp: under torch.export")]
    assert len(said) == 2 and any("linear" in s for s in said) and any("gated_mlp" in s for s in said), said
