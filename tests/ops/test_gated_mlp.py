"""The gated MLP: ``gated_mlp`` (fused activation between cuBLAS projections, custom autograd that saves x, gate,
up only and reuses their buffers in backward) and the ``GeGLUMLP`` layer swapped into the real transformers
modules (Gemma, Gemma2, Gemma3, Llama, Qwen3) with ``kernels.kernelize``: inference and training, every
activation, biases, autocast, fallbacks that give exactly the module's result, torch.compile without
recompiles, saved-tensor accounting, retain_graph, checkpointing and (CUDA) peak memory."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _utils import Tagged, assert_2x_rule, fallback_warnings, opted_in
from conftest import CUDA, ROOT
from torch import nn

kernels = pytest.importorskip("kernels")
transformers = pytest.importorskip("transformers")
from transformers.models.gemma.modeling_gemma import GemmaConfig, GemmaMLP  # noqa: E402
from transformers.models.gemma2.modeling_gemma2 import Gemma2Config, Gemma2MLP  # noqa: E402
from transformers.models.gemma3.modeling_gemma3 import Gemma3MLP, Gemma3TextConfig  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaConfig, LlamaMLP  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3Config, Qwen3MLP  # noqa: E402

H, I = 64, 160  # noqa: E741 (hidden, intermediate: the papers' names)


@pytest.fixture(autouse=True, scope="module")
def _mlps_opted_in():
    """transformers does not decorate its MLPs: opt them in for this module's tests (this only tags the classes for
    kernelize), and untag them afterwards so other test modules see transformers' classes as shipped."""
    with opted_in([(cls, "GeGLUMLP") for cls in (GemmaMLP, Gemma2MLP, Gemma3MLP, LlamaMLP, Qwen3MLP)]):
        yield

MODELS = {
    "gemma": lambda: GemmaMLP(GemmaConfig(hidden_size=H, intermediate_size=I, hidden_act="gelu_pytorch_tanh")),
    "gemma2": lambda: Gemma2MLP(Gemma2Config(hidden_size=H, intermediate_size=I,
                                             hidden_activation="gelu_pytorch_tanh")),
    "gemma3": lambda: Gemma3MLP(Gemma3TextConfig(hidden_size=H, intermediate_size=I,
                                                 hidden_activation="gelu_pytorch_tanh")),
    "llama": lambda: LlamaMLP(LlamaConfig(hidden_size=H, intermediate_size=I, hidden_act="silu")),
    "llama_bias": lambda: LlamaMLP(LlamaConfig(hidden_size=H, intermediate_size=I, hidden_act="silu",
                                               mlp_bias=True)),
    "qwen3": lambda: Qwen3MLP(Qwen3Config(hidden_size=H, intermediate_size=I, hidden_act="silu")),
    "erf_gelu_bias": lambda: LlamaMLP(LlamaConfig(hidden_size=H, intermediate_size=I, hidden_act="gelu",
                                                  mlp_bias=True)),
    "gelu_new": lambda: GemmaMLP(GemmaConfig(hidden_size=H, intermediate_size=I, hidden_act="gelu_new")),
}
# Activations the kernel does not have: the layer must run the module's own math, bit for bit.
FALLBACK_MODELS = {
    "relu": lambda: LlamaMLP(LlamaConfig(hidden_size=H, intermediate_size=I, hidden_act="relu")),
    "quick_gelu": lambda: GemmaMLP(GemmaConfig(hidden_size=H, intermediate_size=I, hidden_act="quick_gelu")),
}
EXPECTED_KIND = {"gemma": "gelu_tanh", "gemma2": "gelu_tanh", "gemma3": "gelu_tanh", "llama": "silu",
                 "llama_bias": "silu", "qwen3": "silu", "erf_gelu_bias": "gelu", "gelu_new": "gelu_tanh"}


class Wrap(nn.Module):
    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


def build(name: str, device: str, dtype: torch.dtype, mode, seed: int = 0):
    """(reference module, the same weights kernelized, fp32 copy of the reference)."""
    torch.manual_seed(seed)
    factory = MODELS.get(name) or FALLBACK_MODELS[name]
    ref = Wrap(factory())
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.15)
    ref32 = copy.deepcopy(ref).to(device=device, dtype=torch.float32)
    ref = ref.to(device=device, dtype=dtype)
    ours = copy.deepcopy(ref)
    mapping = {"GeGLUMLP": {device: kernels.LocalLayerRepository(repo_path=ROOT, layer_name="GeGLUMLP")}}
    with kernels.use_kernel_mapping(mapping):
        # use_fallback: the activation modules are tagged too ("GeluTanh", "SiLU"): they keep their forward.
        kernels.kernelize(ours, mode=mode, device=device, use_fallback=True)
    return ref, ours, ref32


def floor_for(t: torch.Tensor) -> float | None:
    if t.dtype == torch.float32:  # both sides are fp32 GEMMs + activations: allow reassociation-level noise
        return 1e-5 * max(1.0, t.abs().max().item())
    return None


# ---- the layer itself ---------------------------------------------------------------------------------------


def test_layer_follows_the_kernels_layer_contract(fm):
    cls = fm.layers.GeGLUMLP
    assert issubclass(cls, nn.Module) and cls.__init__ is nn.Module.__init__
    assert cls.has_backward is True and cls.can_torch_compile is True
    extra = {n for n in dir(cls)} - {n for n in dir(nn.Module)}
    assert extra <= {"forward", "has_backward", "can_torch_compile"}, extra


def test_activation_dispatch_matches_transformers_act2fn(fm):
    from transformers.activations import ACT2FN

    kind = fm.layers._activation_kind
    expected = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh",
                "gelu": "gelu", "gelu_python": "gelu", "silu": "silu", "swish": "silu",
                "relu": None, "quick_gelu": None, "gelu_10": None, "tanh": None, "sigmoid": None}
    for name, want in expected.items():
        assert kind(ACT2FN[name]) == want, name
    assert kind(nn.GELU()) == "gelu" and kind(nn.GELU(approximate="tanh")) == "gelu_tanh"
    assert kind(nn.SiLU()) == "silu" and kind(F.silu) == "silu" and kind(F.gelu) == "gelu"

    class MyGELU(nn.GELU):  # a subclass may change forward: not trusted
        pass

    assert kind(MyGELU()) is None and kind(lambda t: t) is None


@pytest.mark.parametrize("name", list(MODELS))
def test_kernelize_swaps_the_forward(fm, name):
    _, ours, _ = build(name, "cpu", torch.float32, kernels.Mode.INFERENCE)
    fwd = ours.mlp.forward.__func__
    assert fwd.__qualname__ == "GeGLUMLP.forward" and fwd.__module__.endswith(".layers")
    assert fm.layers._activation_kind(ours.mlp.act_fn) == EXPECTED_KIND[name]


# ---- against the real modules ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(MODELS))
def test_inference_matches_module(fm, device, name, dtype):
    ref, ours, ref32 = build(name, device, dtype, kernels.Mode.INFERENCE)
    x = torch.randn(3, 11, H, device=device, dtype=dtype)
    with torch.no_grad():
        out = ours(x)
        same = ref(x)
        r32 = ref32(x.float()).to(dtype)
    assert out.grad_fn is None
    assert_2x_rule(out, r32, same, floor=floor_for(r32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(MODELS))
def test_training_matches_module(fm, device, name, dtype):
    ref, ours, ref32 = build(name, device, dtype, kernels.Mode.TRAINING)
    x = torch.randn(2, 37, H, device=device, dtype=dtype)
    dy = torch.randn(2, 37, H, device=device, dtype=dtype)
    results = []
    for model, xin in ((ours, x), (ref, x), (ref32, x.float())):
        xg = xin.detach().clone().requires_grad_()
        y = model(xg)
        y.backward(dy.to(y.dtype))
        grads = {"x": xg.grad} | {n: p.grad for n, p in model.named_parameters()}
        results.append((y.detach(), grads))
    (y, g), (ys, gs), (y32, g32) = results
    assert_2x_rule(y, y32.to(dtype), ys, name="y", floor=floor_for(y32))
    assert set(g) == set(gs)
    for k in g:
        assert g[k].dtype == gs[k].dtype
        assert_2x_rule(g[k], g32[k].to(dtype), gs[k], name=f"d{k}", floor=floor_for(g32[k]))


@pytest.mark.parametrize("mode", ["inference", "training"])
@pytest.mark.parametrize("name", list(FALLBACK_MODELS))
def test_other_activations_run_the_module_math_exactly(fm, device, name, mode):
    m = kernels.Mode.INFERENCE if mode == "inference" else kernels.Mode.TRAINING
    ref, ours, _ = build(name, device, torch.bfloat16, m)
    x = torch.randn(5, H, device=device, dtype=torch.bfloat16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    ((y, y_again), said), y2 = fallback_warnings(fm, lambda: (ours(x), ours(x))), ref(x2)
    assert torch.equal(y, y2) and torch.equal(y_again, y2)
    assert said == ["fused_mlp: GeGLUMLP runs the module's own PyTorch math here: no fused kernel for the activation "
                    f"{type(ours.mlp.act_fn).__name__}."], said
    y.sum().backward()
    y2.sum().backward()
    assert torch.equal(x.grad, x2.grad)
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_hooks_and_unplain_linears_fall_back(fm, device):
    ref, ours, _ = build("gemma", device, torch.float32, kernels.Mode.TRAINING)
    x = torch.randn(4, H, device=device)

    def double(mod, inp, out):
        return out * 2

    h1 = ours.mlp.gate_proj.register_forward_hook(double)
    h2 = ref.mlp.gate_proj.register_forward_hook(double)
    (y, _), said = fallback_warnings(fm, lambda: (ours(x), ours(x)))  # twice: one warning
    assert torch.equal(y, ref(x))  # the hook ran: the module's own math
    assert len(said) == 1 and "not plain nn.Linear" in said[0], said
    h1.remove()
    h2.remove()

    class MyLinear(nn.Linear):
        def forward(self, t):
            return super().forward(t) + 1.0

    for model in (ours, ref):
        old = model.mlp.up_proj
        model.mlp.up_proj = MyLinear(old.in_features, old.out_features, bias=False, device=device)
        model.mlp.up_proj.weight.data.copy_(old.weight)
    (y, _), said = fallback_warnings(fm, lambda: (ours(x), ours(x)))  # twice: one warning
    assert torch.equal(y, ref(x))
    assert len(said) == 1 and "not plain nn.Linear" in said[0], said

    ref, ours, _ = build("gemma", device, torch.float32, kernels.Mode.TRAINING)
    xt = x.as_subclass(Tagged)
    (y, _), said = fallback_warnings(fm, lambda: (ours(xt), ours(xt)))
    assert torch.equal(y, ref(xt))
    assert said == ["fused_mlp: GeGLUMLP runs the module's own PyTorch math here: the input is a tensor subclass "
                    "(DTensor, ...)."], said


class _SubNormMLP(LlamaMLP):
    """A gated MLP whose forward differs from the standard one (BitNet's sub-norm before down_proj)."""

    def forward(self, x):
        h = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(h / (1 + h.abs().mean(-1, keepdim=True)))


def test_fallback_is_the_class_forward(fm, device):
    """What runs on a fallback is the class's own forward, not a standard formula."""
    torch.manual_seed(4)
    cfg = LlamaConfig(hidden_size=H, intermediate_size=48, hidden_act="relu2")  # no fused kernel: a fallback
    mlp = _SubNormMLP(cfg).to(device)
    x = torch.randn(5, H, device=device)
    y, said = fallback_warnings(fm, lambda: fm.layers.GeGLUMLP.forward(mlp, x))
    assert torch.equal(y, _SubNormMLP.forward(mlp, x))
    assert len(said) == 1 and "no fused kernel for the activation" in said[0], said


def test_activation_hooks_fall_back(fm, device):
    """A hook on act_fn (activation steering, ablation, capture) runs, as in the plain module."""
    ref, ours, _ = build("llama", device, torch.float32, kernels.Mode.TRAINING)
    x = torch.randn(4, H, device=device)
    calls = []

    def ablate(mod, inp, out):
        calls.append(mod)
        return torch.zeros_like(out)

    handles = [m.mlp.act_fn.register_forward_hook(ablate) for m in (ours, ref)]
    (y, _), said = fallback_warnings(fm, lambda: (ours(x), ours(x)))  # twice: one warning
    assert len(calls) == 2
    assert torch.equal(y, ref(x)) and torch.count_nonzero(y) == 0  # the down_proj has no bias: all zeros
    assert said == ["fused_mlp: GeGLUMLP runs the module's own PyTorch math here: the activation module has hooks or "
                    "a replaced forward."], said
    for h in handles:
        h.remove()
    _, said = fallback_warnings(fm, lambda: ours(x))
    assert said == []  # hooks removed: the fused path again


def test_backward_hooks_on_projections_fire(fm, device):
    """Full backward hooks (and pre-hooks) on gate/up/down_proj (gradient capture: K-FAC, saliency) fire once per
    backward with the module's gradients, as in the plain module."""
    ref, ours, _ = build("gemma", device, torch.float32, kernels.Mode.TRAINING)
    seen = {"ours": [], "ref": []}
    for key, model in (("ours", ours), ("ref", ref)):
        model.mlp.down_proj.register_full_backward_hook(lambda mod, gi, go, k=key: seen[k].append(go[0].clone()))
        model.mlp.gate_proj.register_full_backward_pre_hook(lambda mod, go, k=key: seen[k].append(go[0].clone()))
    x = torch.randn(4, H, device=device, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, said = fallback_warnings(fm, lambda: ours(x))
    assert len(said) == 1 and "not plain nn.Linear" in said[0], said
    y.sum().backward()
    ref(x2).sum().backward()
    assert len(seen["ours"]) == len(seen["ref"]) == 2
    for a, b in zip(seen["ours"], seen["ref"]):
        assert torch.equal(a, b)
    assert torch.equal(x.grad, x2.grad)


def test_global_module_hooks_fall_back(fm, device):
    """nn.Module's global hooks see every submodule call, as in the plain module."""
    ref, ours, _ = build("gemma", device, torch.float32, kernels.Mode.INFERENCE)
    x = torch.randn(4, H, device=device)
    counts = {}
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda mod, inp, out: counts.__setitem__(type(mod).__name__, counts.get(type(mod).__name__, 0) + 1))
    try:
        y, said = fallback_warnings(fm, lambda: ours(x))
        seen, counts = counts, {}
        assert torch.equal(y, ref(x))
    finally:
        handle.remove()
    assert seen == counts and seen["Linear"] == 3, (seen, counts)
    assert said == ["fused_mlp: GeGLUMLP runs the module's own PyTorch math here: global nn.Module hooks are "
                    "registered (register_module_forward_hook & co.)."], said


def test_offloaded_weights_run_the_offload_wrappers(fm, device):
    """accelerate's offloading (from_pretrained with offload, cpu_offload) leaves meta weights in the projections and
    loads them in a forward it installs on each instance: the layer must call those forwards, not read the meta
    weights (it used to return uninitialised memory)."""
    accelerate = pytest.importorskip("accelerate")
    ref, ours, _ = build("gemma", device, torch.float32, kernels.Mode.INFERENCE)
    x = torch.randn(4, H, device=device)
    want = ref(x)
    accelerate.cpu_offload(ours, execution_device=torch.device(device))
    assert ours.mlp.gate_proj.weight.is_meta
    y, said = fallback_warnings(fm, lambda: ours(x))
    assert torch.equal(y, want)
    assert len(said) == 1 and "offloaded" in said[0], said


def test_kernelized_projections_keep_the_fused_path(fm, device):
    """Projections whose forward kernelize swapped to this package's Linear layer (nn.Linear mapped too, as
    benchmarks/decode.py does) are plain: the MLP still takes the fused path, with no fallback warning."""
    ref, ours, _ = build("llama", device, torch.float32, kernels.Mode.INFERENCE)
    mapping = {"Linear": {device: kernels.LocalLayerRepository(repo_path=ROOT, layer_name="Linear")}}
    with opted_in([(nn.Linear, "Linear")]), kernels.use_kernel_mapping(mapping):
        kernels.kernelize(ours, mode=kernels.Mode.INFERENCE, device=device, use_fallback=True)
    assert "forward" in ours.mlp.gate_proj.__dict__  # swapped
    x = torch.randn(4, H, device=device)
    with torch.no_grad():
        y, said = fallback_warnings(fm, lambda: ours(x))
        assert said == []
        torch.testing.assert_close(y, ref(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_float64_raises_like_the_other_layers(fm, device, training):
    """A float64 model is no fallback case: the layer raises the ops' TypeError before any launch, as RMSNorm and
    Linear do (it used to run the module's math with a warning that blamed mixed dtypes)."""
    ref, ours, _ = build("gemma", device, torch.float64, kernels.Mode.TRAINING if training else kernels.Mode.INFERENCE)
    x = torch.randn(3, H, device=device, dtype=torch.float64, requires_grad=training)
    with pytest.raises(TypeError, match=r"^x must be float32, float16 or bfloat16, got torch.float64$"):
        fallback_warnings(fm, lambda: ours(x))
    norm = nn.Module()
    norm.weight, norm.variance_epsilon = nn.Parameter(torch.ones(H, device=device, dtype=torch.float64)), 1e-6
    with pytest.raises(TypeError, match="float32, float16 or bfloat16, got torch.float64"):
        fm.layers.RMSNorm.forward(norm, x)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16, got torch.float64"):
        fm.layers.Linear.forward(nn.Linear(H, 4, device=device, dtype=torch.float64), x)
    # float64 weights with an fp32 input raise the same way, also under autocast: autocast leaves float64 operands
    # alone, so the module's F.linear raises there too (the layer used to cast them and return bf16).
    x32 = x.detach().float().requires_grad_(training)
    with pytest.raises(RuntimeError):
        with torch.autocast(device, dtype=torch.bfloat16):
            ref(x32)
    for autocast in (False, True):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            with pytest.raises(TypeError, match=r"^gate_proj.weight must be float32, float16 or bfloat16, got "
                                                r"torch.float64$"):
                fallback_warnings(fm, lambda: ours(x32))
            with pytest.raises(TypeError, match=r"^weight must be float32, float16 or bfloat16, got torch.float64$"):
                fm.layers.RMSNorm.forward(norm, x32)
            with pytest.raises(TypeError, match=r"^weight must be float32, float16 or bfloat16, got torch.float64$"):
                fm.layers.Linear.forward(nn.Linear(H, 4, device=device, dtype=torch.float64), x32)
    # One float64 projection among fp32 ones is named too (here under autocast, where the others would be cast).
    _, ours32, _ = build("gemma", device, torch.float32, kernels.Mode.TRAINING if training else kernels.Mode.INFERENCE)
    ours32.mlp.down_proj.double()
    with torch.autocast(device, dtype=torch.bfloat16):
        with pytest.raises(TypeError, match=r"^down_proj.weight must be float32, float16 or bfloat16, got "
                                            r"torch.float64$"):
            fallback_warnings(fm, lambda: ours32(x32))


def test_mixed_dtypes_behave_like_the_module(fm, device):
    """fp32 weights with bf16 activations: outside autocast the module raises (F.linear needs one dtype) and so
    does the layer, with the module's own error; under autocast both compute in bf16 and return bf16, and the
    fp32 master weights get fp32 gradients."""
    ref, ours, ref32 = build("gemma", device, torch.float32, kernels.Mode.TRAINING)
    xb = torch.randn(6, H, device=device, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError) as e_ref:
        ref(xb)
    with pytest.raises(RuntimeError) as e_ours:
        fallback_warnings(fm, lambda: ours(xb))
    assert str(e_ours.value) == str(e_ref.value)
    _, said = fallback_warnings(fm, lambda: [pytest.raises(RuntimeError, ours, xb) for _ in range(2)])
    assert said == ["fused_mlp: GeGLUMLP runs the module's own PyTorch math here: the weights' dtypes differ from the "
                    "input's (outside autocast)."], said

    x = torch.randn(6, H, device=device)
    dy = torch.randn(6, H, device=device, dtype=torch.bfloat16)
    outs = []
    for model in (ours, ref):
        model.zero_grad()
        xg = x.clone().requires_grad_()
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            y = model(xg)
        y.backward(dy)
        outs.append((y, xg.grad, [p.grad for p in model.parameters()]))
    (y, gx, gp), (ys, gxs, gps) = outs
    assert y.dtype == ys.dtype == torch.bfloat16
    y32 = ref32(x)
    assert_2x_rule(y, y32.bfloat16(), ys)
    assert gx.dtype == gxs.dtype == torch.float32
    for a, b in zip(gp, gps):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05 * b.abs().max().item())
    # Inference under autocast (no autograd node; F.linear casts, as in the module).
    with torch.no_grad(), torch.autocast(device_type=device, dtype=torch.bfloat16):
        y, ys = ours(x), ref(x)
    assert y.dtype == ys.dtype == torch.bfloat16 and y.grad_fn is None
    assert_2x_rule(y, y32.detach().bfloat16(), ys)


def test_fp32_gradient_at_a_bf16_output(fm, device):
    """y.float() downstream: an fp32 gradient reaches the bf16 MLP output; the backward's GEMMs take it in bf16,
    rounded once as eager's are (docs/design.md#numerics), so the result matches the module fed the same
    gradient, to the bit."""
    ref, ours, ref32 = build("qwen3", device, torch.bfloat16, kernels.Mode.TRAINING)
    x = torch.randn(7, H, device=device, dtype=torch.bfloat16)
    dy = torch.randn(7, H, device=device)
    grads = []
    for model in (ours, ref):
        xg = x.clone().requires_grad_()
        model(xg).float().backward(dy)
        grads.append(xg.grad)
    x32 = x.float().requires_grad_()
    ref32(x32).backward(dy)
    assert grads[0].dtype == torch.bfloat16
    assert_2x_rule(grads[0], x32.grad.bfloat16(), grads[1])
    xg = x.clone().requires_grad_()
    ours(xg).backward(dy.bfloat16())  # the same gradient rounded first: the same bits
    assert torch.equal(xg.grad, grads[0])


def test_compile_kernelized_fullgraph_no_recompiles(fm, device):
    torch._dynamo.reset()
    compile_modes = (kernels.Mode.TRAINING | kernels.Mode.TORCH_COMPILE,
                     kernels.Mode.INFERENCE | kernels.Mode.TORCH_COMPILE)
    for mode in compile_modes:
        ref, ours, _ = build("gemma", device, torch.float32, mode)
        graphs = []

        def backend(gm, example_inputs):
            from torch._inductor.compile_fx import compile_fx

            graphs.append(gm.print_readable(print_output=False))  # nested graphs included
            return compile_fx(gm, example_inputs)

        compiled = torch.compile(ours, fullgraph=True, dynamic=True, backend=backend)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for t in (1, 7, 64):
                x = torch.randn(t, H, device=device, requires_grad=True)
                torch._dynamo.decorators.mark_unbacked(x, 0)
                y = compiled(x)
                y.sum().backward()
                x2 = x.detach().clone().requires_grad_()
                y2 = ref(x2)
                y2.sum().backward()
                torch.testing.assert_close(y, y2, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
                for p, q in zip(ours.parameters(), ref.parameters()):
                    torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)
                ours.zero_grad()
                ref.zero_grad()
        assert len(graphs) == 1 and "geglu_fwd" in graphs[0], graphs  # our op, not the module's math
        torch._dynamo.reset()
    # Inference (decode/prefill) under no_grad: the no-autograd path, one graph for every token count.
    ref, ours, _ = build("llama_bias", device, torch.float32, kernels.Mode.INFERENCE | kernels.Mode.TORCH_COMPILE)
    compiled = torch.compile(ours, fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
        for t in (1, 7, 64):
            x = torch.randn(2, t, H, device=device)
            torch._dynamo.decorators.mark_unbacked(x, 1)
            torch.testing.assert_close(compiled(x), ref(x), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


# ---- the autograd path: what is saved, retain_graph, checkpointing, frozen parts -------------------------------


def saved_bytes(fn) -> int:
    """Bytes of the non-parameter tensors autograd saves while running fn()."""
    params: set[int] = set()
    total = 0

    def pack(t):
        nonlocal total
        if not isinstance(t, nn.Parameter) and t.data_ptr() not in params:
            params.add(t.data_ptr())  # count each buffer once (views of one buffer share it)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def test_saves_only_x_gate_up(fm):
    """The memory design, checked on the CPU: the MLP keeps x, gate and up for backward (not h), i.e.
    T*H + 2*T*I elements; the eager module keeps gate, gelu(gate), up and h as well (T*H + 4*T*I)."""
    ref, ours, _ = build("gemma", "cpu", torch.bfloat16, kernels.Mode.TRAINING)
    t = 50
    x = torch.randn(t, H, dtype=torch.bfloat16, requires_grad=True)
    ours_b = saved_bytes(lambda: ours(x))
    ref_b = saved_bytes(lambda: ref(x))
    assert ours_b == 2 * (t * H + 2 * t * I)
    assert ref_b >= 2 * (t * H + 4 * t * I)


def test_retain_graph_backward_twice(fm, device):
    ref, ours, _ = build("llama_bias", device, torch.float32, kernels.Mode.TRAINING)
    x = torch.randn(9, H, device=device, requires_grad=True)
    y = ours(x)
    g1 = torch.autograd.grad(y.square().sum(), [x, *ours.parameters()], retain_graph=True)
    g2 = torch.autograd.grad(y.square().sum(), [x, *ours.parameters()])
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)
    x2 = x.detach().clone().requires_grad_()
    g3 = torch.autograd.grad(ref(x2).square().sum(), [x2, *ref.parameters()])
    for a, b in zip(g1, g3):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _fake_slopes_kernels(fm, monkeypatch):
    """The slopes form on any device: gated_mlp.py's two sm_90 ops replaced by their plain definitions (the other ops
    stay the package's), and `_epilogue.use_slopes` saying yes."""
    import sys

    mod = sys.modules[fm.__name__ + ".gated_mlp"]
    real = mod.ops

    def fwd_slopes(x, w_gate, w_up, activation):
        z = F.linear(x.float(), w_gate.float()).requires_grad_()
        with torch.enable_grad():
            a = fm.gated_mlp_reference.__globals__["activation_fn"](activation)(z)
            da = torch.autograd.grad(a.sum(), z)[0]
        u = F.linear(x.float(), w_up.float())
        return (a.detach() * u).to(x.dtype), (u * da).to(x.dtype), a.detach().to(x.dtype)

    def bwd_slopes_(dy, w_down, p, q):
        dh = dy.float() @ w_down.float()
        p.copy_(dh * p.float())
        q.copy_(dh * q.float())

    class Ops:
        gated_gemm_fwd_slopes = staticmethod(fwd_slopes)
        gated_gemm_bwd_slopes_ = staticmethod(bwd_slopes_)

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(mod, "ops", Ops())
    monkeypatch.setattr(sys.modules[fm.__name__ + "._epilogue"], "use_slopes", lambda *a, **k: True)


@pytest.mark.parametrize("mode", ["plain", "retain_graph", "save_on_cpu", "checkpoint", "checkpoint_reentrant"])
def test_slopes_backward_frees_h_before_the_input_weight_grads(fm, monkeypatch, mode):
    """Where both passes run the GEMM-epilogue kernels (sm_90), the forward saves h for dW_down only: eager backward
    gives h's memory back before dW_gate and dW_up are allocated (the backward's peak: one [T, I] less). Not when the
    graph is retained (a second backward reads h), nor under saved-tensor hooks (offloading, non-reentrant
    checkpointing: h is theirs); the gradients are right in every mode. On the CPU, with the two kernels replaced by
    their plain definitions."""
    from torch.utils.checkpoint import checkpoint

    _fake_slopes_kernels(fm, monkeypatch)
    torch.manual_seed(11)
    t, dt = 24, torch.float32
    x = torch.randn(t, H, dtype=dt, requires_grad=True)
    w = [(torch.randn(I, H, dtype=dt) * 0.1).requires_grad_(), (torch.randn(I, H, dtype=dt) * 0.1).requires_grad_(),
         (torch.randn(H, I, dtype=dt) * 0.1).requires_grad_()]
    seen_h, h_bytes_at_dw = [], []
    real_mm = torch.mm

    def mm(a, b, *args, **kwargs):
        if a.shape == (H, t) and b.shape == (t, I):  # dW_down = dy^T h
            seen_h.append(b)
        elif a.shape == (I, t) and b.shape == (t, H):  # dW_gate, dW_up = dgate^T x, dup^T x
            h_bytes_at_dw.append(seen_h[-1].untyped_storage().nbytes())
        return real_mm(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "mm", mm)
    dy = torch.randn(t, H, dtype=dt)
    x2 = x.detach().clone().requires_grad_()
    w2 = [p.detach().clone().requires_grad_() for p in w]
    expect = torch.autograd.grad(fm.gated_mlp_reference(x2, *w2), [x2, *w2], dy)
    if mode == "save_on_cpu":
        with torch.autograd.graph.save_on_cpu():
            y = fm.gated_mlp(x, *w)
    elif mode.startswith("checkpoint"):
        y = checkpoint(fm.gated_mlp, x, *w, use_reentrant=mode == "checkpoint_reentrant")
    else:
        y = fm.gated_mlp(x, *w)

    def backward(retain):  # .backward, not autograd.grad: the reentrant checkpoint refuses the latter
        for p in (x, *w):
            p.grad = None
        y.backward(dy, retain_graph=retain)
        return [p.grad for p in (x, *w)]

    got = backward(mode == "retain_graph")
    for a, b in zip(got, expect):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    full = t * I * x.element_size()
    # the reentrant checkpoint recomputes the forward without hooks, inside its own backward: h is the Function's
    freed = mode in ("plain", "checkpoint_reentrant")
    assert h_bytes_at_dw == ([0, 0] if freed else [full, full]), h_bytes_at_dw
    if mode == "retain_graph":  # a second backward (graph not kept) reads the same h, then frees it
        again = backward(False)
        for a, b in zip(got, again):
            assert torch.equal(a, b)
        assert h_bytes_at_dw[2:] == [0, 0], h_bytes_at_dw


def test_checkpointing_and_frozen_parts(fm, device):
    from torch.utils.checkpoint import checkpoint

    ref, ours, _ = build("erf_gelu_bias", device, torch.float32, kernels.Mode.TRAINING)
    x = torch.randn(13, H, device=device, requires_grad=True)
    for reentrant in (False, True):
        ours.zero_grad()
        ref.zero_grad()
        x.grad = None
        checkpoint(ours, x, use_reentrant=reentrant).sum().backward()
        x2 = x.detach().clone().requires_grad_()
        ref(x2).sum().backward()
        torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
        for p, q in zip(ours.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)
    # LoRA-style: frozen base weights, only the input needs a gradient; and the reverse.
    for p in ours.parameters():
        p.requires_grad_(False)
        p.grad = None
    x.grad = None
    ours(x).sum().backward()
    assert x.grad is not None and all(p.grad is None for p in ours.parameters())
    ours.mlp.down_proj.weight.requires_grad_(True)
    xd = x.detach()
    ours(xd).sum().backward()
    ref.zero_grad()
    ref(xd).sum().backward()
    torch.testing.assert_close(ours.mlp.down_proj.weight.grad, ref.mlp.down_proj.weight.grad, rtol=1e-4, atol=1e-4)
    assert ours.mlp.gate_proj.weight.grad is None


# ---- the functional API ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("act", ["gelu_tanh", "gelu", "silu"])
def test_gated_mlp_function_vs_reference(fm, device, act):
    torch.manual_seed(7)
    dtype = torch.bfloat16
    x = torch.randn(4, 9, H, device=device, dtype=dtype)
    w = [torch.randn(I, H, device=device, dtype=dtype) * 0.1, torch.randn(I, H, device=device, dtype=dtype) * 0.1,
         torch.randn(H, I, device=device, dtype=dtype) * 0.1]
    b = [torch.randn(I, device=device, dtype=dtype), None, torch.randn(H, device=device, dtype=dtype)]
    out = fm.gated_mlp(x, *w, *b, activation=act)
    ref = fm.gated_mlp_reference(x, *w, *b, activation=act)
    g = F.linear(x, w[0], b[0])
    h = (F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh" if act == "gelu_tanh" else "none"))
    same = F.linear(h * F.linear(x, w[1]), w[2], b[2])
    assert_2x_rule(out, ref, same)


@pytest.mark.parametrize("dims", [(4, 0, 6), (0, 8, 6), (4, 8, 0)], ids=["H=0", "T=0", "I=0"])
def test_gated_mlp_empty_dims_train_like_the_reference(fm, device, dims):
    """Zero-size token, hidden or intermediate dims: the training path gives what the reference gives (H = 0 once
    failed there: reshape(-1, 0) is ambiguous)."""
    t, h, i = dims
    ins = [torch.randn(*s, device=device).requires_grad_() for s in ((t, h), (i, h), (i, h), (5, i))]
    out, ref = fm.gated_mlp(*ins), fm.gated_mlp_reference(*ins)
    assert out.shape == ref.shape == (t, 5)
    got = torch.autograd.grad(out.sum(), ins)
    want = torch.autograd.grad(ref.sum(), ins)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_gated_mlp_bad_inputs(fm):
    x = torch.randn(3, H)
    wg, wu, wd = torch.randn(I, H), torch.randn(I, H), torch.randn(H, I)
    with pytest.raises(ValueError, match="activation must be one of"):
        fm.gated_mlp(x, wg, wu, wd, activation="relu")
    with pytest.raises(ValueError, match="w_up must have w_gate's shape"):
        fm.gated_mlp(x, wg, torch.randn(I + 1, H), wd)
    with pytest.raises(ValueError, match="last dim"):
        fm.gated_mlp(torch.randn(3, H + 1), wg, wu, wd)
    with pytest.raises(ValueError, match="w_down must have shape"):
        fm.gated_mlp(x, wg, wu, torch.randn(H, I + 2))
    with pytest.raises(ValueError, match="b_up must have shape"):
        fm.gated_mlp(x, wg, wu, wd, None, torch.randn(I + 1))
    with pytest.raises(TypeError, match="share one dtype"):
        fm.gated_mlp(x.bfloat16(), wg, wu, wd)
    with pytest.raises(ValueError, match="one device"):
        fm.gated_mlp(x, wg, wu, torch.empty(H, I, device="meta"))


# ---- CUDA: peak memory ---------------------------------------------------------------------------------------


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (runs on the GPU machine, not in CI)")
def test_training_peak_memory_below_eager(fm):
    """fwd+bwd peak above the resident weights/inputs: ours keeps gate, up and one [T, I] buffer (dh, then h) in
    backward; the eager module also keeps gelu(gate) and h, and materialises dgate/dup next to them."""
    t, h, i = 4096, 1024, 4096
    torch.manual_seed(0)
    ref, ours, _ = build("gemma", "cuda", torch.bfloat16, kernels.Mode.TRAINING)
    for model in (ref, ours):
        model.mlp.gate_proj = nn.Linear(h, i, bias=False, device="cuda", dtype=torch.bfloat16)
        model.mlp.up_proj = nn.Linear(h, i, bias=False, device="cuda", dtype=torch.bfloat16)
        model.mlp.down_proj = nn.Linear(i, h, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)

    def peak(model) -> int:
        model(x).backward(dy)  # warm up: cuBLAS workspaces, .grad buffers exist from now on
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model(x).backward(dy)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    p_ours, p_ref = peak(ours), peak(ref)
    ti, hi = t * i * 2, h * i * 2
    assert p_ours < p_ref, (p_ours, p_ref)
    # gate + up + (dh -> h) + one weight gradient in flight, plus small [T, H] tensors and cuBLAS slack.
    assert p_ours <= 3 * ti + hi + 4 * t * h * 2 + (32 << 20), (p_ours, 3 * ti + hi)
