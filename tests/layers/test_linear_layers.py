"""The ``Linear`` and ``Conv1D`` layers: swapped into models with ``kernels.kernelize`` (LocalLayerRepository
mappings, classes opted in with ``replace_kernel_forward_from_hub``), in training, against ``nn.Linear`` and
transformers' GPT-2 ``Conv1D``; plus the layer contract, autocast and torch.compile of a kernelized model."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _utils import Tagged, assert_2x_rule, fallback_warnings
from conftest import ROOT

kernels = pytest.importorskip("kernels")
pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
HFConv1D = pytorch_utils.Conv1D


# Opted-in subclasses (so the global nn.Linear / Conv1D classes are left untouched by the tests).
class KLinear(nn.Linear):
    pass


class KConv1D(HFConv1D):
    pass


kernels.replace_kernel_forward_from_hub(KLinear, "Linear")
kernels.replace_kernel_forward_from_hub(KConv1D, "Conv1D")


class Block(nn.Module):
    """fc (Linear, bias) -> GeLU -> c_proj (GPT-2 Conv1D [in, out]) -> head (Linear, no bias)."""

    def __init__(self, lin=nn.Linear, conv=HFConv1D):
        super().__init__()
        self.fc = lin(64, 96)
        self.c_proj = conv(48, 96)  # nf=48 outputs, nx=96 inputs
        self.head = lin(48, 40, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.c_proj(F.gelu(self.fc(x), approximate="tanh")))


def _mapping(device: str) -> dict:
    return {
        name: {device: kernels.LocalLayerRepository(repo_path=ROOT, layer_name=name)}
        for name in ("Linear", "Conv1D")
    }


def _pair(device: str, dtype: torch.dtype, seed: int = 0):
    """(reference model with plain classes, the same weights in opted-in classes, kernelized for training)."""
    torch.manual_seed(seed)
    ref = Block().to(device=device, dtype=dtype)
    with torch.no_grad():
        ref.c_proj.bias.normal_()  # transformers initialises it to zeros; make the bias matter
    ours = Block(KLinear, KConv1D).to(device=device, dtype=dtype)
    ours.load_state_dict(ref.state_dict())
    with kernels.use_kernel_mapping(_mapping(device)):
        kernels.kernelize(ours, mode=kernels.Mode.TRAINING, device=device, use_fallback=False)
    return ref, ours


def test_layers_follow_the_kernels_layer_contract(fm):
    for cls in (fm.layers.Linear, fm.layers.Conv1D):
        assert issubclass(cls, nn.Module) and cls.__init__ is nn.Module.__init__
        assert cls.has_backward is True and cls.can_torch_compile is True
        extra = {n for n in dir(cls)} - {n for n in dir(nn.Module)}
        assert extra <= {"forward", "has_backward", "can_torch_compile"}, extra


def test_kernelize_swaps_the_forwards(fm, device):
    _, ours = _pair(device, torch.float32)
    for mod, layer in ((ours.fc, "Linear"), (ours.c_proj, "Conv1D"), (ours.head, "Linear")):
        assert mod.forward.__func__.__qualname__ == f"{layer}.forward"
        assert mod.forward.__func__.__module__.endswith(".layers")
    y = ours(torch.randn(3, 64, device=device))
    assert "AddmmFunctionBackward" in type(y.grad_fn).__name__


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernelized_block_training_matches(fm, device, dtype):
    """Forward and all parameter/input gradients against the same block run by nn.Linear / transformers' Conv1D:
    the 2x rule against an fp64 copy of the reference (fp32 too)."""
    ref, ours = _pair(device, dtype)
    ref64 = copy.deepcopy(ref).double()
    x = torch.randn(2, 33, 64, device=device, dtype=dtype)
    gy = torch.randn(2, 33, 40, device=device, dtype=dtype)
    outs = {}
    for name, model in (("ours", ours), ("torch", ref), ("fp64", ref64)):
        xx = x.to(next(model.parameters()).dtype).clone().requires_grad_()
        y = model(xx)
        y.backward(gy.to(y.dtype))
        outs[name] = [y.detach(), xx.grad] + [p.grad for p in model.parameters()]
    names = ["y", "dx"] + [n for n, _ in ours.named_parameters()]
    for what, o, t, r in zip(names, outs["ours"], outs["torch"], outs["fp64"]):
        assert o.shape == t.shape and o.dtype == t.dtype and o.stride() == t.stride(), what
        assert_2x_rule(o, r, t, name=what)


def test_conv1d_matches_transformers_exactly_in_fp32(fm, device):
    """Same math as torch.addmm(bias, x.view(-1, nx), weight).view(..., nf) in fp32 (different summation order
    only), for 2-D and 3-D inputs."""
    torch.manual_seed(1)
    hf = HFConv1D(24, 40).to(device)
    ours = KConv1D(24, 40).to(device)
    ours.load_state_dict(hf.state_dict())
    with torch.no_grad():
        hf.bias.normal_()
        ours.bias.copy_(hf.bias)
    with kernels.use_kernel_mapping(_mapping(device)):
        kernels.kernelize(ours, mode=kernels.Mode.TRAINING, device=device, use_fallback=False)
    for shape in ((5, 40), (2, 7, 40)):
        x = torch.randn(*shape, device=device)
        torch.testing.assert_close(ours(x), hf(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer", ["Linear", "Conv1D"])
def test_tensor_subclass_input_runs_the_module_and_warns_once(fm, device, layer):
    torch.manual_seed(2)
    mod = (nn.Linear(24, 40) if layer == "Linear" else HFConv1D(40, 24)).to(device)
    x = torch.randn(3, 24, device=device).as_subclass(Tagged)
    y, said = fallback_warnings(fm, lambda: [getattr(fm.layers, layer).forward(mod, x) for _ in range(2)])
    assert all(torch.equal(t, type(mod).forward(mod, x)) for t in y)
    assert said == [f"fused_mlp: {type(mod).__name__} runs its own PyTorch forward here, not the fused kernel: a "
                    "DTensor or other tensor subclass operand."], said


class _HalfLinear(KLinear):
    """A subclass below the opted-in class with a forward of its own (as QAT Linear or an MoE router)."""

    def forward(self, x):
        return super().forward(x) * 0.5


class _HalfConv1D(KConv1D):
    def forward(self, x):
        return super().forward(x) * 0.5


class _OptedInHalfLinear(_HalfLinear):
    """The same forward, opted in by the subclass itself: the swap is asked for."""


kernels.replace_kernel_forward_from_hub(_OptedInHalfLinear, "Linear")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_subclass_with_its_own_forward_keeps_it(fm, device, compiled):
    """kernelize swaps every subclass of an opted-in class: one with a forward of its own keeps it (warned once),
    unless it opted in itself; a subclass without its own forward runs the kernel."""
    torch.manual_seed(3)
    mods = {"half linear": _HalfLinear(24, 40), "half conv1d": _HalfConv1D(40, 24),
            "opted-in half linear": _OptedInHalfLinear(24, 40), "plain subclass": KLinear(24, 40)}
    box = nn.ModuleDict(mods).to(device)
    with kernels.use_kernel_mapping(_mapping(device)):
        kernels.kernelize(box, mode=kernels.Mode.TRAINING, device=device, use_fallback=False)
    x = torch.randn(3, 24, device=device, requires_grad=True)
    torch._dynamo.reset()

    def run(m):
        return torch.compile(m, fullgraph=True, backend="eager")(x) if compiled else m(x)

    (got, said) = fallback_warnings(fm, lambda: {k: (run(m), run(m)) for k, m in box.items()})
    torch._dynamo.reset()
    for k, m in box.items():
        own = type(m).forward(m, x)  # the class's forward (kernelize set the layer's on the instance)
        w = m.weight.t() if "conv1d" in k else m.weight  # Conv1D holds [in, out]
        plain = F.linear(x, w, m.bias) * (0.5 if k in ("half linear", "half conv1d") else 1.0)
        torch.testing.assert_close(got[k][0], plain, rtol=1e-5, atol=1e-5)
        if k in ("half linear", "half conv1d"):
            assert torch.equal(got[k][0], own), k
        else:
            assert "AddmmFunctionBackward" in type(got[k][0].grad_fn).__name__ or compiled, k
    if not compiled:  # (dynamo traces without side effects: no warning from a compiled call)
        assert sorted(said) == [f"fused_mlp: {n} runs its own PyTorch forward here, not the fused kernel: a subclass "
                                "with a forward of its own that did not opt in itself." for n in ("_HalfConv1D",
                                                                                                   "_HalfLinear")], said


class _Router(nn.Linear):
    """An MoE router as transformers writes them (PhimoeTopKRouter, Llama4Router): a tuple, not a tensor."""

    def forward(self, x):
        logits = super().forward(x)
        return logits, logits.argmax(-1)


def test_subclass_keeps_its_forward_after_the_opt_in_is_taken_back(fm, device):
    """nn.Linear opted in for kernelize only (the tag removed afterwards, as tests/_utils.opted_in and decode.py do):
    the router still keeps its forward, the plain Linear beside it runs the layer."""
    from _utils import opted_in

    box = nn.ModuleDict({"router": _Router(24, 8), "proj": nn.Linear(24, 8)}).to(device)
    with opted_in([(nn.Linear, "Linear")]), kernels.use_kernel_mapping(_mapping(device)):
        kernels.kernelize(box, mode=kernels.Mode.INFERENCE, device=device, use_fallback=True)
    assert box["router"].forward.__func__ is fm.layers.Linear.forward  # kernels did swap the subclass
    x = torch.randn(3, 24, device=device)
    out, said = fallback_warnings(fm, lambda: box["router"](x))
    assert isinstance(out, tuple) and torch.equal(out[0], F.linear(x, box["router"].weight, box["router"].bias))
    assert said == ["fused_mlp: _Router runs its own PyTorch forward here, not the fused kernel: a subclass with a "
                    "forward of its own that did not opt in itself."], said
    assert box["proj"].forward.__func__ is fm.layers.Linear.forward and box["proj"](x).shape == (3, 8)


def test_linear_layer_under_autocast(fm, device):
    """fp32 parameters under torch.autocast: the layer computes in the autocast dtype, like nn.Linear."""
    ref, ours = _pair(device, torch.float32)
    x = torch.randn(4, 9, 64, device=device)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        y_ours = ours(x)
        y_ref = ref(x)
    assert y_ours.dtype == y_ref.dtype == torch.bfloat16
    y64 = copy.deepcopy(ref).double()(x.to(torch.bfloat16).double())
    assert_2x_rule(y_ours, y64, y_ref, name="autocast y")
    y_ours.float().sum().backward()
    assert ours.fc.weight.grad is not None and ours.fc.weight.grad.dtype == torch.float32


def test_kernelized_block_compiles_without_recompiles(fm, device):
    """Mode.TRAINING | Mode.TORCH_COMPILE: the kernelized block under torch.compile(fullgraph=True), forward and
    backward, one graph across token counts (from a fresh process's state: the layers' per-class cache empty)."""
    torch._dynamo.reset()
    sys.modules[fm.__name__ + ".layers"]._OWN_FORWARD.clear()
    ref, _ = _pair(device, torch.float32)
    ours = Block(KLinear, KConv1D).to(device)
    ours.load_state_dict(ref.state_dict())
    with kernels.use_kernel_mapping(_mapping(device)):
        kernels.kernelize(ours, mode=kernels.Mode.TRAINING | kernels.Mode.TORCH_COMPILE, device=device,
                          use_fallback=False)
    compiled = torch.compile(ours, fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in (1, 7, 300):
            x = torch.randn(t, 64, device=device)
            torch._dynamo.decorators.mark_unbacked(x, 0)
            y = compiled(x)
            y.sum().backward()
            g_c = [p.grad.clone() for p in ours.parameters()]
            ours.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            y_r = ref(x)
            y_r.sum().backward()
            torch.testing.assert_close(y, y_r, rtol=1e-5, atol=1e-5)
            for a, b in zip(g_c, [p.grad for p in ref.parameters()]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)
            ref.zero_grad(set_to_none=True)
    torch._dynamo.reset()
