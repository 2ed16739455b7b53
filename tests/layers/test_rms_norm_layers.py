"""The RMSNorm layers against the real transformers modules they replace (LlamaRMSNorm, Qwen3RMSNorm,
GemmaRMSNorm, Gemma2RMSNorm, Gemma3RMSNorm): forward and backward with the 2x rule against an fp64 evaluation of
the module (the module's own output is the same-dtype PyTorch result), the module's exact output dtype, and the
swap through `kernels.kernelize` with local layer repositories."""

from __future__ import annotations

import copy
import importlib
import inspect
from pathlib import Path

import pytest
import torch

from _utils import FLOOR, Tagged, assert_2x_rule, fallback_warnings, opted_in
from conftest import ROOT

transformers = pytest.importorskip("transformers")
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # noqa: E402
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm  # noqa: E402
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm  # noqa: E402

LLAMA_STYLE = [LlamaRMSNorm, Qwen3RMSNorm]
GEMMA_STYLE = [GemmaRMSNorm, Gemma2RMSNorm, Gemma3RMSNorm]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def build(cls, n, w_dtype, device, seed=0):
    m = cls(n, eps=1e-6).to(device=device, dtype=w_dtype)
    g = torch.Generator().manual_seed(seed)
    base = 1.0 if cls in LLAMA_STYLE else 0.0  # Llama scales by w, Gemma by (1 + w)
    with torch.no_grad():
        m.weight.copy_(base + 0.25 * torch.randn(n, generator=g))
    return m


def as_fp64(module):
    """The same module in fp64 holding exactly the same weight values (the high-precision reference)."""
    ref = type(module)(module.weight.shape[0], eps=1e-6).to(device=module.weight.device, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(module.weight.double())
    return ref


def layer_for(fm, cls):
    return fm.layers.RMSNorm if cls in LLAMA_STYLE else fm.layers.GemmaRMSNorm


def fwd_bwd(forward, module, x, dy):
    """Output and (dx, dw) of `forward(module, x)` for the upstream gradient dy (in the output's dtype)."""
    x = x.detach().clone().requires_grad_()
    module.weight.grad = None
    y = forward(module, x)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad, module.weight.grad.clone()


@pytest.mark.parametrize("w_dtype", ["same", torch.float32], ids=["w=x.dtype", "w=fp32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cls", LLAMA_STYLE + GEMMA_STYLE, ids=lambda c: c.__name__)
def test_layer_matches_transformers_module(fm, device, cls, dtype, w_dtype):
    n = 1000
    wd = dtype if w_dtype == "same" else w_dtype
    module = build(cls, n, wd, device)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 37, n, generator=g) * 2).to(device=device, dtype=dtype)
    dy = torch.randn(3, 37, n, generator=g).to(device)

    ours = fwd_bwd(layer_for(fm, cls).forward, module, x, dy)
    theirs = fwd_bwd(cls.forward, module, x, dy)
    ref = fwd_bwd(cls.forward, as_fp64(module), x.double(), dy)

    y, dx, dw = ours
    assert y.dtype == theirs[0].dtype, f"output dtype {y.dtype} != transformers' {theirs[0].dtype}"
    assert dx.dtype == theirs[1].dtype and dw.dtype == theirs[2].dtype
    ref = tuple(r.double() for r in ref)
    assert_2x_rule(y, ref[0], theirs[0], name="y")
    assert_2x_rule(dx, ref[1], theirs[1], name="dx")
    # dW sums 111 rows: give the fp32 accumulation order a floor that scales with the magnitude of the sums.
    assert_2x_rule(dw, ref[2], theirs[2], name="dw", floor=max(FLOOR[dw.dtype], 1e-6 * ref[2].abs().max().item()))


# RMSNorm classes whose forward rounds after the weight (the input's dtype out), as of transformers 5.22-5.25.
# 5.22 decorates the first 12 "RMSNorm", 5.23 and 5.24 also the Inkling2 ones, 5.25 none of them (kernelize leaves
# them alone unless opted in). The test keeps its own list, and also finds such classes by the line they end with, so
# a class missing from the layer's list is caught whichever transformers runs.
ROUND_AFTER_WEIGHT = frozenset({
    "AfmoeRMSNorm", "BeamRMSNorm", "DeepseekV4RMSNorm", "FlexOlmoRMSNorm", "FlintRMSNorm", "GptOssRMSNorm",
    "NemotronHRMSNorm", "NemotronH_Omni_RMSNorm", "Olmo2RMSNorm", "Olmo3RMSNorm", "OlmoHybridRMSNorm",
    "OpenAIPrivacyFilterRMSNorm", "Inkling2RMSNorm", "Inkling2LoopRMSNorm",
})
ROUNDS_AFTER_WEIGHT_LINE = "return (self.weight * hidden_states).to(input_dtype)"


def _classes_decorated_rmsnorm() -> list[type]:
    """Every transformers class decorated ``use_kernel_forward_from_hub("RMSNorm")``, those of ROUND_AFTER_WEIGHT,
    and every ``*RMSNorm`` class whose forward holds ROUNDS_AFTER_WEIGHT_LINE."""
    root = Path(transformers.__file__).parent / "models"
    found = []
    for path in sorted(root.glob("*/modeling_*.py")):
        text = path.read_text()
        if ('use_kernel_forward_from_hub("RMSNorm")' not in text and ROUNDS_AFTER_WEIGHT_LINE not in text
                and not any(f"class {name}(" in text for name in ROUND_AFTER_WEIGHT)):
            continue
        mod = importlib.import_module(f"transformers.models.{path.parent.name}.{path.stem}")
        for c in vars(mod).values():
            if not (inspect.isclass(c) and c.__module__ == mod.__name__):
                continue
            rounds_after = (c.__name__.endswith("RMSNorm") and "forward" in c.__dict__
                            and ROUNDS_AFTER_WEIGHT_LINE in inspect.getsource(c.forward))
            if c.__dict__.get("kernel_layer_name") == "RMSNorm" or c.__name__ in ROUND_AFTER_WEIGHT or rounds_after:
                found.append(c)
    return found


@pytest.mark.parametrize("w_dtype, x_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                              (torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16)],
                         ids=["w=fp32,x=bf16", "w=bf16,x=fp32", "w=fp32,x=fp16", "w=x=bf16"])
def test_every_transformers_rmsnorm_class_gets_its_own_output_dtype(fm, w_dtype, x_dtype):
    """The RMSNorm layer against each class it can replace: Llama's form returns promote(weight, input), the classes
    that round after the weight (OLMo 2, GPT-OSS, DeepSeek-V4, ...) the input's dtype; values by the 2x rule."""
    checked, bad = [], []
    g = torch.Generator().manual_seed(5)
    for cls in _classes_decorated_rmsnorm():
        try:
            module = cls(64, eps=1e-6)
        except TypeError:
            module = cls(64)
        module = module.to(w_dtype)
        with torch.no_grad():
            module.weight.copy_(1.0 + 0.25 * torch.randn(64, generator=g))
        x = (torch.randn(5, 64, generator=g) * 2).to(x_dtype)
        with torch.no_grad():
            theirs = cls.forward(module, x)
            ours = fm.layers.RMSNorm.forward(module, x)
            ref = cls.forward(copy.deepcopy(module).double(), x.double())
        try:
            assert_2x_rule(ours, ref, theirs, name=cls.__name__)
        except AssertionError as e:
            bad.append(str(e))
        checked.append(cls.__name__)
    assert not bad, bad
    present = {n for n in ROUND_AFTER_WEIGHT if n in checked}
    assert len(checked) >= 120 and len(present) >= 12, (len(checked), sorted(ROUND_AFTER_WEIGHT - present))


def test_kernelize_swaps_every_module(fm, device, tmp_path):
    """kernelize with LocalLayerRepository mappings replaces the decorated Llama/Qwen3 norms ("RMSNorm") and the
    undecorated Gemma ones once opted in with replace_kernel_forward_from_hub ("GemmaRMSNorm"); the swapped
    modules compute exactly what the layers compute, forward and backward."""
    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping

    n = 256
    modules = [build(cls, n, torch.bfloat16, device, seed=i) for i, cls in enumerate(LLAMA_STYLE + GEMMA_STYLE)]
    model = torch.nn.Sequential(*modules)
    originals = [type(m).forward for m in modules]
    mapping = {
        name: {device: LocalLayerRepository(repo_path=ROOT, layer_name=name)} for name in ("RMSNorm", "GemmaRMSNorm")
    }
    with opted_in([(cls, "GemmaRMSNorm") for cls in GEMMA_STYLE]), use_kernel_mapping(mapping):
        kernelize(model, mode=Mode.TRAINING, device=device, use_fallback=False)

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, n, generator=g).to(device=device, dtype=torch.bfloat16)
    for m, orig in zip(modules, originals):
        layer = layer_for(fm, type(m))
        assert m.forward.__func__ is not orig, f"{type(m).__name__} was not swapped"
        dy = torch.randn(2, 9, n, generator=g).to(device)
        swapped = fwd_bwd(lambda mod, t: mod(t), m, x, dy)
        direct = fwd_bwd(layer.forward, m, x, dy)
        for a, b in zip(swapped, direct):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_kernelize_inference_llama_fp32_weight(fm, device):
    """Inference swap on a model kept in fp32 weights with bf16 activations: the output is fp32 like the
    original module's, and rounded once."""
    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping

    n = 512
    model = torch.nn.Sequential(build(LlamaRMSNorm, n, torch.float32, device))
    x = torch.randn(4, n).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = model(x)
    mapping = {"RMSNorm": {device: LocalLayerRepository(repo_path=ROOT, layer_name="RMSNorm")}}
    with use_kernel_mapping(mapping):
        kernelize(model, mode=Mode.INFERENCE, device=device, use_fallback=False)
    with torch.no_grad():
        got = model(x)
    ref = as_fp64(model[0])(x.double())
    assert got.dtype == expected.dtype == torch.float32
    assert_2x_rule(got, ref, expected, name="y")


class _OpSpy(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.startswith("_fused_mlp"):
            self.names.append(func._schema.name.split("::")[1])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("w_dtype", ["same", torch.float32], ids=["w=x.dtype", "w=fp32"])
@pytest.mark.parametrize("cls", [LlamaRMSNorm, GemmaRMSNorm], ids=lambda c: c.__name__)
def test_layer_decode_inference_path(fm, device, cls, w_dtype):
    """One token without autograd (the decode step): the layer runs rms_norm_infer, with exactly the values and
    dtype of its autograd forward."""
    n = 2048
    module = build(cls, n, torch.bfloat16 if w_dtype == "same" else w_dtype, device)
    forward = layer_for(fm, cls).forward
    x = torch.randn(1, 1, n).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad(), _OpSpy() as spy:
        y = forward(module, x)
    assert spy.names == ["rms_norm_infer"]
    y_grad = forward(module, x.clone().requires_grad_())
    assert y.dtype == y_grad.dtype == cls.forward(module, x).dtype and torch.equal(y, y_grad.detach())


@pytest.mark.parametrize("policy", ["auto", "kernel"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_layer_compile_fullgraph(fm, device, policy, grad, monkeypatch):
    """The layer under torch.compile(fullgraph=True), with and without autograd, under both compile policies
    (decomposition / our op, the inference op without autograd): no graph break, the eager values within the
    2x rule."""
    import torch._dynamo

    monkeypatch.setenv("FUSED_MLP_UNDER_COMPILE", policy)
    torch._dynamo.reset()
    n = 256
    module = build(LlamaRMSNorm, n, torch.bfloat16, device)
    forward = layer_for(fm, LlamaRMSNorm).forward
    compiled = torch.compile(lambda t: forward(module, t), fullgraph=True, backend="inductor")
    x = torch.randn(3, 5, n).to(device=device, dtype=torch.bfloat16).requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        got = compiled(x)
        want = forward(module, x)
    ref = as_fp64(module)(x.detach().double())
    assert_2x_rule(got.detach(), ref, LlamaRMSNorm.forward(module, x.detach()), name="y")
    assert got.dtype == want.dtype
    if grad:
        (gx,) = torch.autograd.grad(got.float().sum(), (x,))
        (wx,) = torch.autograd.grad(want.float().sum(), (x,))
        torch.testing.assert_close(gx, wx, rtol=2e-2, atol=2e-2)
    torch._dynamo.reset()


@pytest.mark.parametrize("cls", [LlamaRMSNorm, GemmaRMSNorm], ids=lambda c: c.__name__)
def test_tensor_subclass_input_runs_the_module_and_warns_once(fm, device, cls):
    m = build(cls, 64, torch.float32, device)
    x = torch.randn(3, 64, device=device).as_subclass(Tagged)
    y, said = fallback_warnings(fm, lambda: [layer_for(fm, cls).forward(m, x) for _ in range(2)])
    assert all(torch.equal(t, cls.forward(m, x)) for t in y)
    assert said == [f"fused_mlp: {cls.__name__} runs its own PyTorch forward here, not the fused kernel: the input or "
                    "weight is a tensor subclass other than DTensor+DTensor."], said


@pytest.mark.parametrize("eps_type", ["numpy float32", "numpy int64", "0-d tensor"])
@pytest.mark.parametrize("cls", [LlamaRMSNorm, GemmaRMSNorm], ids=lambda c: c.__name__)
def test_module_eps_of_another_number_type(fm, device, cls, eps_type):
    """A module built with eps as a numpy scalar or a 0-d tensor runs (its own forward adds eps to a tensor); the
    swapped layer must not turn it into an error. The kernel gets eps as a float: the module's result, one rounding."""
    np = pytest.importorskip("numpy")
    eps = {"numpy float32": np.float32(1e-5), "numpy int64": np.int64(0), "0-d tensor": torch.tensor(1e-5)}[eps_type]
    m = build(cls, 64, torch.float32, device)
    if cls in LLAMA_STYLE:
        m.variance_epsilon = eps
    else:
        m.eps = eps
    x = torch.randn(3, 64, device=device) + 0.5  # eps = 0 needs rows that are not all zero
    want = cls.forward(m, x)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            got = layer_for(fm, cls).forward(m, x.clone().requires_grad_(grad))
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-5)
