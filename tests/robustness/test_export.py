"""torch.export of the functional ops, and the raw ops called with inputs that require grad: an exported program
runs and keeps its gradients, as the same program built from plain PyTorch does. Export inlines an autograd
Function's forward and drops its backward, and the ops have no derivative of their own, so under export the training
paths take differentiable math (docs/design.md#torchexport)."""

from __future__ import annotations

import copy
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
        self.nw = nn.Parameter((1 + torch.randn(H, generator=g) / 4).to(device))

    def forward(self, x):
        fm = self.fm
        if self.kind == "linear":
            return fm.linear(x, self.w, self.b)
        if self.kind == "linear gelu_tanh":
            return fm.linear(x, self.w, self.b, activation="gelu_tanh")
        if self.kind == "addmm gelu":
            return fm.addmm(self.b, x.reshape(-1, H), self.w.t(), activation="gelu")
        if self.kind == "rms_norm residual":
            return fm.rms_norm(x, self.nw, 1e-6, residual=x * 0.5)[0]
        return fm.gated_mlp(x, self.w, self.w2, self.wd, self.b, self.b, activation="silu")  # one bias twice


KINDS = ["linear", "linear gelu_tanh", "addmm gelu", "rms_norm residual", "gated_mlp"]


def _grads(module, x):
    x = x.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    y = module(x)
    (y * torch.linspace(-1, 1, y.numel(), device=y.device).view(y.shape)).sum().backward()
    # by name (an exported module may leave out a parameter its op does not use; torch.compile prefixes _orig_mod.)
    params = {n.removeprefix("_orig_mod."): p for n, p in module.named_parameters()}
    return y.detach(), [x.grad] + [params[n].grad if n in params else None for n in ("b", "nw", "w", "w2", "wd")]


@pytest.fixture(params=["auto", "kernel"])
def compile_policy(request, monkeypatch):
    """FUSED_MLP_UNDER_COMPILE (read when a graph is traced): the default, and the ops kept wherever they can be."""
    monkeypatch.setenv("FUSED_MLP_UNDER_COMPILE", request.param)
    torch._dynamo.reset()
    yield request.param
    torch._dynamo.reset()


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
@pytest.mark.parametrize("kind", KINDS)
def test_exported_program_runs_and_keeps_gradients(fm, device, kind, strict, compile_policy):
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


@pytest.mark.parametrize("kind", ["gated_mlp", "addmm x @ x", "rms_norm residual=x", "geglu(x, x)"])
def test_a_tensor_passed_twice_compiles(fm, device, kind, compile_policy):
    """Dynamo refuses an autograd Function given one tensor twice (tied biases or weights, x @ x): that call takes the
    plain math when traced, with no graph break."""
    module = _Op(fm, "gated_mlp", device)
    if kind != "gated_mlp":
        module.forward = {
            "addmm x @ x": lambda x: (lambda s: fm.addmm(module.b[:H], s, s, activation="gelu"))(x.t() @ x / H),
            "rms_norm residual=x": lambda x: fm.rms_norm(x, module.nw, 1e-6, residual=x)[0] * module.b[:H],
            "geglu(x, x)": lambda x: fm.geglu(x, x) * module.nw,
        }[kind]
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


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_export_of_a_kernelized_model_keeps_the_layers(fm, device, strict):
    """Non-strict export runs module code on fake tensors: the layers take them as plain tensors (their ops have fake
    implementations), so the exported program is the kernelized model, not the module's own math."""
    transformers = pytest.importorskip("transformers")
    kernels = pytest.importorskip("kernels")
    from transformers.models.llama import modeling_llama

    from _utils import fallback_warnings, opted_in
    from conftest import ROOT

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=H, intermediate_size=I, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16).eval()
    model = copy.deepcopy(plain)
    names = ("RMSNorm", "GeGLUMLP", "Linear")
    mapping = {n: {device: kernels.LocalLayerRepository(repo_path=ROOT, layer_name=n)} for n in names}
    with opted_in([(modeling_llama.LlamaMLP, "GeGLUMLP"), (nn.Linear, "Linear")]), \
            kernels.use_kernel_mapping(mapping, inherit_mapping=False):
        kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device=device, use_fallback=True)

    class Logits(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids):
            return self.m(input_ids=ids, use_cache=False).logits

    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        want, unkernelized = Logits(model)(ids).float(), Logits(plain)(ids).float()

        def export():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                return torch.export.export(Logits(model), (ids,), strict=strict)

        ep, said = fallback_warnings(fm, export)
        got = ep.module()(ids).float()
    assert not said, said
    assert (want - unkernelized).abs().max() > 1e-3  # the two models round differently in bf16: told apart
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    assert (got - want).abs().max() < (got - unkernelized).abs().max()


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
