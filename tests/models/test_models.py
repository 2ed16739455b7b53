"""Integration: real transformers model classes kernelized with fused-mlp, the way users do it.

Tiny configs, random weights, no network. Gemma and Gemma3 (Gemma RMSNorm ``(1 + w)`` + GeGLU MLP), Llama and
Qwen3 (their ``@use_kernel_forward_from_hub("RMSNorm")`` norms + SwiGLU MLPs opted in as ``"GeGLUMLP"``) and
GPT-2 (transformers' ``Conv1D``, biased projections, opted in as ``"Conv1D"``). Layers come from this
checkout's build through ``kernels.LocalLayerRepository`` mappings (``use_kernel_mapping(...,
inherit_mapping=False)``); undecorated classes are opted in with ``replace_kernel_forward_from_hub`` for the
duration of each test only.

Each test checks *what* was replaced (module by module, and that the fused-mlp ops really run the expected
number of times: a model that silently kernelizes nothing, or whose layers fall back to the module's own math,
fails), then parity with the unkernelized model:

* fp32: logits and every parameter gradient within ``FP32_RTOL`` of the eager model, relative to the tensor's
  largest magnitude (same maths, only the summation order differs);
* bf16: the 2x rule against an fp32 copy of the same (bf16-rounded) weights: our error <= 2x the eager bf16
  model's error + a floor of ``BF16_REL_FLOOR`` x the tensor's largest magnitude;
* Mode.INFERENCE (no-grad logits), Mode.TRAINING (logits + every gradient), Mode.TRAINING | Mode.TORCH_COMPILE
  followed by ``torch.compile(model, fullgraph=True)`` (forward and backward, no graph break), and a few SGD
  steps giving the same loss curve.

And transformers' own path (``PreTrainedModel.set_use_kernels`` with a ``KernelConfig`` pointing at this
checkout, the from_pretrained-free form of ``use_kernels=True``), plus the version check that catches the
silent "transformers does not accept this kernels version" situation.
"""

from __future__ import annotations

import copy
import json
import logging
import subprocess
import sys
import textwrap
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from _utils import assert_2x_rule, opted_in
from conftest import DEVICES, ROOT
from torch.utils._python_dispatch import TorchDispatchMode

kernels = pytest.importorskip("kernels")
transformers = pytest.importorskip("transformers")
from transformers.models.gemma.modeling_gemma import GemmaMLP, GemmaRMSNorm  # noqa: E402
from transformers.models.gemma3.modeling_gemma3 import Gemma3MLP, Gemma3RMSNorm  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm  # noqa: E402
from transformers.models.olmo2.modeling_olmo2 import Olmo2MLP, Olmo2RMSNorm  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402

if not (ROOT / "tools" / "hf_compat.py").exists():  # kernel-builder's test closure ships only tests/ and sources
    pytest.skip("tools/ is not part of this source tree (Nix test closure)", allow_module_level=True)
sys.path.insert(0, str(ROOT / "tools"))
from hf_compat import hub_kernels_problem  # noqa: E402

Mode = kernels.Mode

# fp32: the kernels compute the modules' maths in fp32; only the summation order differs. Error relative to the
# tensor's largest magnitude; measured worst case on CPU over the first five families, logits, every gradient and the
# SGD loss curves: 1.1e-6 (a Gemma3 gradient), logits <= 5e-7.
FP32_RTOL = 1e-5
# bf16: floor of the 2x rule, relative to the tensor's largest magnitude (half a bf16 ulp at the top of the range is
# 2^-9 of it; one ulp 2^-8): it only matters for tensors whose eager bf16 error happens to be near zero. Measured
# on CPU: our error <= 1.6x eager's on every tensor, without the floor.
BF16_REL_FLOOR = 2**-8
# The loss is computed in fp32 from bf16 logits: its bf16 noise is ~1e-4 relative per step, ~5e-4 after 4 SGD steps.
LOSS_REL_FLOOR = 1e-3
SGD_STEPS, SGD_LR = 4, 0.1
BATCH, SEQ = 2, 16
LAYERS = 2


# ---- the model families ---------------------------------------------------------------------------------------

def _decoder_kw(**extra) -> dict:
    return dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                attn_implementation="sdpa", **extra)


def _gpt2() -> torch.nn.Module:
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=128, n_embd=64, n_layer=LAYERS, n_head=4, n_positions=64, activation_function="gelu_new",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa", bos_token_id=0, eos_token_id=0))
    # GPT2LMHeadModel has no loss_type (its name does not end in ForCausalLM): its loss_function then logs a
    # warning_once on every call, which is a graph break under torch.compile(fullgraph=True).
    model.loss_type = "ForCausalLM"
    return model


@dataclass(frozen=True)
class Family:
    build: Callable[[], torch.nn.Module]  # fp32 model from a config
    opt_in: tuple[tuple[type, str], ...]  # undecorated transformers classes -> fused-mlp layer name
    # Module class name -> (fused-mlp layer that must replace its forward, how many such modules the model has).
    replaced: dict[str, tuple[str, int]]


FAMILIES = {
    "gemma": Family(
        lambda: transformers.GemmaForCausalLM(transformers.GemmaConfig(**_decoder_kw(
            hidden_activation="gelu_pytorch_tanh"))),
        ((GemmaRMSNorm, "GemmaRMSNorm"), (GemmaMLP, "GeGLUMLP")),
        # input + post-attention norm per layer, the final norm; one MLP per layer.
        {"GemmaRMSNorm": ("GemmaRMSNorm", 2 * LAYERS + 1), "GemmaMLP": ("GeGLUMLP", LAYERS)},
    ),
    "gemma3": Family(
        lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**_decoder_kw(
            hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=16, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"]))),
        ((Gemma3RMSNorm, "GemmaRMSNorm"), (Gemma3MLP, "GeGLUMLP")),
        # input/post-attention/pre-/post-feedforward norms and q/k norms per layer, the final norm.
        {"Gemma3RMSNorm": ("GemmaRMSNorm", 6 * LAYERS + 1), "Gemma3MLP": ("GeGLUMLP", LAYERS)},
    ),
    "llama": Family(
        lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**_decoder_kw(hidden_act="silu"))),
        ((LlamaMLP, "GeGLUMLP"),),  # LlamaRMSNorm is decorated "RMSNorm" by transformers itself
        {"LlamaRMSNorm": ("RMSNorm", 2 * LAYERS + 1), "LlamaMLP": ("GeGLUMLP", LAYERS)},
    ),
    "olmo2": Family(
        lambda: transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**_decoder_kw(hidden_act="silu"))),
        # A norm that rounds after the weight. transformers 5.22 decorates it "RMSNorm", 5.25 no longer does: opted
        # in either way, as docs/using-with-transformers.md says. (One dtype for weights and inputs here: the
        # output-dtype rule is tested in tests/layers/test_rms_norm_layers.py.)
        ((Olmo2RMSNorm, "RMSNorm"), (Olmo2MLP, "GeGLUMLP")),
        # post-attention and post-feedforward norms and q/k norms per layer, the final norm.
        {"Olmo2RMSNorm": ("RMSNorm", 4 * LAYERS + 1), "Olmo2MLP": ("GeGLUMLP", LAYERS)},
    ),
    "qwen3": Family(
        lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**_decoder_kw(hidden_act="silu"))),
        ((Qwen3MLP, "GeGLUMLP"),),
        # input + post-attention norms and q/k norms per layer, the final norm.
        {"Qwen3RMSNorm": ("RMSNorm", 4 * LAYERS + 1), "Qwen3MLP": ("GeGLUMLP", LAYERS)},
    ),
    "gpt2": Family(
        _gpt2,
        ((Conv1D, "Conv1D"),),
        # c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj per block (all biased); LayerNorm and lm_head stay.
        {"Conv1D": ("Conv1D", 4 * LAYERS)},
    ),
}
# fused-mlp ops each replaced module runs once per forward (backward) pass.
FWD_OP = {"RMSNorm": "rms_norm_fwd", "GemmaRMSNorm": "rms_norm_fwd", "GeGLUMLP": "geglu_fwd", "Conv1D": "addmm_fwd"}
# Without autograd (no_grad / inference_mode) the norms run the inference op, which returns y alone.
INFER_OP = dict(FWD_OP, RMSNorm="rms_norm_infer", GemmaRMSNorm="rms_norm_infer")
BWD_OP = {"RMSNorm": "rms_norm_bwd", "GemmaRMSNorm": "rms_norm_bwd", "GeGLUMLP": "geglu_bwd_",
          "Conv1D": "addmm_bwd"}
# Layers whose op traces its fp32 decomposition under torch.compile by default (policy "auto": Inductor fuses it with
# the decoder layer's residual add; _common.KERNEL_UNDER_COMPILE), so their ops are absent from a compiled graph.
DECOMPOSED_UNDER_COMPILE = {"RMSNorm", "GemmaRMSNorm"}


def build(family: str, device: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    """The family's model with random weights that make every kernel matter: norm weights away from their
    initial 0 (Gemma) / 1 (Llama), nonzero biases (GPT-2 initialises them to zero)."""
    torch.manual_seed(seed)
    model = FAMILIES[family].build()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p), alpha=0.1)
    return model.to(device=device, dtype=dtype)


def local_mapping(names, device: str) -> dict:
    return {n: {device: kernels.LocalLayerRepository(repo_path=ROOT, layer_name=n)} for n in names}


@pytest.fixture(autouse=True)
def _quiet_kernels():
    """kernels warns once per tagged module it has no mapping for (rotary embeddings, activations): expected
    here, since the mappings hold our layers only; what was replaced is asserted instead."""
    logger = logging.getLogger("kernels")
    old = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(old)


@pytest.fixture(scope="module", autouse=True)
def _hooks_on():
    problem = hub_kernels_problem()
    if problem is not None:
        pytest.fail(problem, pytrace=False)


def kernelize(model: torch.nn.Module, family: str, device: str, mode) -> torch.nn.Module:
    fam = FAMILIES[family]
    names = sorted({layer for layer, _ in fam.replaced.values()})
    with opted_in(fam.opt_in), kernels.use_kernel_mapping(local_mapping(names, device), inherit_mapping=False):
        # use_fallback=True: tagged layers we do not map (rotary_pos_emb, activations) keep their forward; our
        # own layers must load (a load failure still raises) and are checked by replaced_layers().
        kernels.kernelize(model, mode=mode, device=device, use_fallback=True)
    return model


def replaced_layers(model: torch.nn.Module) -> dict[str, tuple[str, int]]:
    """Module class name -> (fused-mlp layer whose forward it now runs, count), for every swapped module."""
    found: dict[str, Counter] = {}
    for mod in model.modules():
        fwd = vars(mod).get("forward")
        func = getattr(fwd, "__func__", None)
        if func is None or func is type(mod).forward:
            continue
        assert func.__module__.endswith(".layers") and "fused_mlp" in func.__module__, (
            f"{type(mod).__name__} runs {func.__module__}.{func.__qualname__}, not a fused-mlp layer")
        found.setdefault(type(mod).__name__, Counter())[func.__qualname__.split(".")[0]] += 1
    out = {}
    for cls, layers in found.items():
        assert len(layers) == 1, f"{cls} instances run different layers: {dict(layers)}"
        ((layer, n),) = layers.items()
        out[cls] = (layer, n)
    return out


def assert_replaced(model: torch.nn.Module, family: str) -> None:
    got, want = replaced_layers(model), FAMILIES[family].replaced
    assert got == want, f"{family}: replaced {got or 'nothing'}, expected {want}"


class OpCounter(TorchDispatchMode):
    """Counts the fused-mlp ops that actually run (the layers fall back to the module's own math on inputs they
    do not cover: the counts prove they did not)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns, _, name = func._schema.name.partition("::")
        if ns.startswith("_fused_mlp"):
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


# Inference on the CPU without an activation: Conv1D / Linear call ATen's GEMM (F.linear) rather than the op: in fp32
# always (the op would compute the same fp32 product through ATen and copy it: docs/tuning-log.md#addmm-cpu-fp32), in
# 16 bits up to 32 rows (these models' BATCH * SEQ) or where oneDNN runs the dtype natively (the op would widen the
# weight to fp32 first: docs/tuning-log.md#addmm-cpu-epilogue). Training in 16 bits too, where oneDNN runs the dtype
# natively (F.linear and ATen's backward).
ATEN_GEMM_ON_CPU = {"Conv1D"}
ATEN_16BIT_MAX_ROWS = 32


def expected_ops(family: str, backward: bool, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                 fm=None) -> Counter:
    """The ops a kernelized model's forward (and backward) calls; on the CPU, 16-bit training's routes follow the loaded
    kernel's own oneDNN probe (fm's addmm._onednn_native)."""
    want: Counter = Counter()
    for layer, n in FAMILIES[family].replaced.values():
        if device == "cpu" and layer in ATEN_GEMM_ON_CPU and (
                (not backward and (dtype == torch.float32 or BATCH * SEQ <= ATEN_16BIT_MAX_ROWS))
                or (backward and dtype != torch.float32
                    and sys.modules[fm.__name__ + ".addmm"]._onednn_native(dtype))):
            continue
        want[(FWD_OP if backward else INFER_OP)[layer]] += n
        if backward:
            want[BWD_OP[layer]] += n
    return want


def batch(device: str, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (BATCH, SEQ), generator=g).to(device)


def forward_backward(model: torch.nn.Module, ids: torch.Tensor, params_of: torch.nn.Module | None = None):
    """(loss, logits, {parameter name: gradient}) of one training step (`params_of`: the module whose parameters
    to read, when `model` is a torch.compile wrapper)."""
    params_of = model if params_of is None else params_of
    params_of.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad for n, p in params_of.named_parameters()}
    missing = [n for n, g in grads.items() if g is None]
    assert not missing, f"parameters without a gradient: {missing}"
    return out.loss.detach(), out.logits.detach(), grads


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def assert_fp32_close(ours: torch.Tensor, eager: torch.Tensor, name: str, rtol: float = FP32_RTOL) -> None:
    assert ours.shape == eager.shape and ours.dtype == eager.dtype, name
    err = rel_err(ours, eager)
    assert err <= rtol, f"{name}: max |ours - eager| / max |eager| = {err:.3g} > {rtol:g}"


def assert_bf16_2x(ours: torch.Tensor, eager: torch.Tensor, ref32: torch.Tensor, name: str,
                   rel_floor: float = BF16_REL_FLOOR) -> None:
    """The 2x rule with a floor relative to the tensor's largest magnitude."""
    assert_2x_rule(ours, ref32, eager, name=name, floor=rel_floor * ref32.abs().max().item())


def trio(family: str, device: str, dtype: torch.dtype, mode):
    """(eager model, the same weights kernelized in `mode`, fp32 copy of the same weights or None for fp32)."""
    eager = build(family, device, dtype)
    ref32 = copy.deepcopy(eager).float() if dtype != torch.float32 else None
    ours = kernelize(copy.deepcopy(eager), family, device, mode)
    for m in (eager, ours, ref32):
        if m is not None:
            m.train(Mode.TRAINING in mode)
    return eager, ours, ref32


# ---- kernels.kernelize on each family --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_inference_logits_match(fm, device, family, dtype):
    eager, ours, ref32 = trio(family, device, dtype, Mode.INFERENCE)
    assert_replaced(ours, family)
    ids = batch(device)
    with torch.no_grad():
        with OpCounter() as ops:
            logits = ours(input_ids=ids, use_cache=False).logits
        want = eager(input_ids=ids, use_cache=False).logits
        ref = ref32(input_ids=ids, use_cache=False).logits if ref32 is not None else None
    assert ops.counts == expected_ops(family, backward=False, device=device, dtype=dtype)
    if dtype == torch.float32:
        assert_fp32_close(logits, want, "logits")
    else:
        assert_bf16_2x(logits, want, ref, "logits")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_training_loss_logits_and_every_gradient_match(fm, device, family, dtype):
    eager, ours, ref32 = trio(family, device, dtype, Mode.TRAINING)
    assert_replaced(ours, family)
    ids = batch(device)
    with OpCounter() as ops:
        got = forward_backward(ours, ids)
    assert ops.counts == expected_ops(family, backward=True, device=device, dtype=dtype, fm=fm)
    want = forward_backward(eager, ids)
    ref = forward_backward(ref32, ids) if ref32 is not None else None
    names = ["loss", "logits"] + [f"grad {n}" for n in got[2]]
    ours_t = [got[0], got[1], *got[2].values()]
    eager_t = [want[0], want[1], *want[2].values()]
    assert list(got[2]) == list(want[2])
    if dtype == torch.float32:
        for name, o, e in zip(names, ours_t, eager_t):
            assert_fp32_close(o, e, name)
    else:
        ref_t = [ref[0], ref[1], *ref[2].values()]
        for name, o, e, r in zip(names, ours_t, eager_t, ref_t):
            assert_bf16_2x(o, e, r, name, rel_floor=LOSS_REL_FLOOR if name == "loss" else BF16_REL_FLOOR)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sgd_loss_curve_matches(fm, device, family, dtype):
    """A few SGD steps on one batch give the same loss curve as the eager model (plain SGD: weight differences stay
    proportional to gradient differences; Adam would amplify rounding-level ones). fp32 within FP32_RTOL, bf16 by
    the 2x rule against the same run in fp32 (the loss itself is computed in fp32 from bf16 logits)."""
    eager, ours, ref32 = trio(family, device, dtype, Mode.TRAINING)
    ids = batch(device)
    curves = {}
    for name, model in (("ours", ours), ("eager", eager), ("fp32", ref32)):
        if model is None:
            continue
        opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
        losses = []
        for _ in range(SGD_STEPS):
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        curves[name] = torch.stack(losses)
    # The loss must move, or the comparison says nothing about the updates.
    assert (curves["eager"][0] - curves["eager"][-1]).item() > 0.1, curves["eager"]
    if dtype == torch.float32:
        assert_fp32_close(curves["ours"], curves["eager"], "loss curve")
    else:
        assert_bf16_2x(curves["ours"], curves["eager"], curves["fp32"], "loss curve", rel_floor=LOSS_REL_FLOOR)


# torch.compile of whole models. Inductor's C++ code generation costs 20-50 s per model on 2 CPU cores, so on CPU
# only Gemma (GemmaRMSNorm + GeGLU) goes through inductor, Llama (RMSNorm + SwiGLU) and GPT-2 (Conv1D) through
# aot_eager (dynamo + AOT autograd: the same fullgraph capture and traced backward, without code generation; the
# ops' inductor lowering is tested op by op in their own files). On CUDA every family goes through inductor.
# Policy "kernel" (FUSED_MLP_UNDER_COMPILE) keeps every op opaque in the graph: one cheap case covers that path on CPU.
COMPILE_CASES = [("cpu", "gemma", "inductor", "auto"), ("cpu", "gpt2", "aot_eager", "auto"),
                 ("cpu", "llama", "aot_eager", "auto"), ("cpu", "llama", "aot_eager", "kernel")]
COMPILE_CASES += [("cuda", f, "inductor", p) for f in sorted(FAMILIES) if "cuda" in DEVICES for p in ("auto", "kernel")]


@pytest.mark.parametrize("device,family,backend,policy", COMPILE_CASES)
def test_torch_compile_fullgraph_training(fm, device, family, backend, policy, monkeypatch):
    """Mode.TRAINING | Mode.TORCH_COMPILE, then torch.compile(model, fullgraph=True): one graph (no break), the
    fused-mlp ops inside it (or, for the layers that decompose under torch.compile, not), forward and backward
    matching the eager model (fp32)."""
    monkeypatch.setenv("FUSED_MLP_UNDER_COMPILE", policy)
    torch._dynamo.reset()
    eager, ours, _ = trio(family, device, torch.float32, Mode.TRAINING | Mode.TORCH_COMPILE)
    assert_replaced(ours, family)
    graphs = []

    compiler = torch._dynamo.backends.registry.lookup_backend(backend)

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return compiler(gm, example_inputs)

    compiled = torch.compile(ours, backend=recording_backend, fullgraph=True)
    ids = batch(device)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = forward_backward(compiled, ids, ours)
        got2 = forward_backward(compiled, batch(device, seed=2), ours)  # a second call reuses the graph
    assert len(graphs) == 1
    code = "\n".join(m.code for m in graphs[0].modules() if isinstance(m, torch.fx.GraphModule))
    for layer, _ in FAMILIES[family].replaced.values():
        for op in (FWD_OP[layer], BWD_OP[layer]):
            if policy == "auto" and layer in DECOMPOSED_UNDER_COMPILE:
                assert op not in code, f"{op} in the compiled graph: {layer} should trace its decomposition"
            else:
                assert op in code, f"{op} not in the compiled graph"
    want = forward_backward(eager, ids)
    assert_fp32_close(got[1], want[1], "logits")
    for name in want[2]:
        assert_fp32_close(got[2][name], want[2][name], f"grad {name}")
    want2 = forward_backward(eager, batch(device, seed=2))
    assert_fp32_close(got2[0], want2[0], "second-call loss")


@pytest.mark.filterwarnings("ignore:fused_mlp. GeGLUMLP runs the module's own PyTorch math:UserWarning")
def test_checks_catch_silent_non_kernelization(fm, device):
    """The harness itself: a model kernelized without its opt-ins (nothing replaced), or whose MLP falls back to the
    module's own math (an activation the kernel does not have), fails the checks above."""
    model = build("gemma", device)
    with kernels.use_kernel_mapping(local_mapping(["GemmaRMSNorm", "GeGLUMLP"], device), inherit_mapping=False):
        kernels.kernelize(model, mode=Mode.INFERENCE, device=device, use_fallback=True)  # no opt_in: no tags
    with pytest.raises(AssertionError, match="replaced nothing"):
        assert_replaced(model, "gemma")

    model = build("gemma", device)
    for layer in model.model.layers:
        layer.mlp.act_fn = torch.nn.ReLU()
    kernelize(model, "gemma", device, Mode.INFERENCE)
    assert_replaced(model, "gemma")  # the forwards are swapped ...
    with torch.no_grad(), OpCounter() as ops:
        model(input_ids=batch(device), use_cache=False)
    assert ops.counts["geglu_fwd"] == 0 and ops.counts != expected_ops("gemma", backward=False)  # ... not the maths


def test_deepcopy_keeps_and_pickle_drops_the_swap(fm, device):
    """What docs/using-with-transformers.md says about saving: a deep copy stays kernelized; a pickled model comes
    back with its classes' own forwards (kernels binds each swapped forward to its module, which pickle records by
    name), with the same logits; kernelize again after loading."""
    import io
    import pickle

    model = kernelize(build("llama", device), "llama", device, Mode.INFERENCE)
    ids = batch(device)
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
    twin = copy.deepcopy(model)
    assert_replaced(twin, "llama")
    with torch.no_grad(), OpCounter() as ops:
        assert torch.equal(twin(input_ids=ids, use_cache=False).logits, want)
    assert ops.counts == expected_ops("llama", backward=False, device=device, dtype=torch.float32)

    buf = io.BytesIO()
    held = {}
    try:
        torch.save(model, buf)
    except (AttributeError, pickle.PicklingError):
        # kernels < 0.19: transformers' attention holds a local class of kernels' that pickle cannot store (a plain
        # model fails the same way); it is set aside for pickling and handed back (kernels 0.18's attention forward
        # needs it), and kernels 0.19 pickles it.
        held = {n: vars(m).pop("_kernel_funcs") for n, m in model.named_modules() if "_kernel_funcs" in vars(m)}
        buf = io.BytesIO()
        torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for name, funcs in held.items():
        vars(model.get_submodule(name))["_kernel_funcs"] = funcs
        vars(loaded.get_submodule(name))["_kernel_funcs"] = funcs
    assert replaced_layers(loaded) == {}
    with torch.no_grad():
        assert_fp32_close(loaded(input_ids=ids, use_cache=False).logits, want, "logits after torch.load")
    kernelize(loaded, "llama", device, Mode.INFERENCE)
    assert_replaced(loaded, "llama")


def test_opt_in_is_undone(fm):
    """The tests leave transformers' classes as they found them (Conv1D is shared by every GPT-2-style model)."""
    before = {cls: {a: cls.__dict__.get(a) for a in ("kernel_layer_name", "kernel_condition")}
              for cls in (Conv1D, GemmaRMSNorm, LlamaMLP)}
    with opted_in(((Conv1D, "Conv1D"), (GemmaRMSNorm, "GemmaRMSNorm"), (LlamaMLP, "GeGLUMLP"))):
        assert Conv1D.kernel_layer_name == "Conv1D"
    after = {cls: {a: cls.__dict__.get(a) for a in ("kernel_layer_name", "kernel_condition")} for cls in before}
    assert after == before


# ---- transformers' own path: set_use_kernels / use_kernels=True with a KernelConfig -----------------------------

def test_transformers_accepts_installed_kernels():
    """The pinned pair keeps transformers' hooks on: LlamaRMSNorm carries its "RMSNorm" tag."""
    assert hub_kernels_problem() is None
    assert getattr(LlamaRMSNorm, "kernel_layer_name", None) == "RMSNorm"


def test_version_mismatch_is_reported(monkeypatch):
    """A kernels version outside transformers' accepted range (or USE_HUB_KERNELS=0) gives one clear message."""
    from transformers.utils import import_utils

    hi = import_utils.KERNELS_MAX_VERSION
    msg = hub_kernels_problem(kernels_version=hi)
    assert msg is not None and f"does not accept kernels {hi}" in msg and "silently" in msg
    assert import_utils.KERNELS_MIN_VERSION in msg and "tools/requirements.txt" in msg
    monkeypatch.setenv("USE_HUB_KERNELS", "0")
    msg = hub_kernels_problem()
    assert msg is not None and "USE_HUB_KERNELS=0" in msg


def test_version_mismatch_detected_in_a_real_process():
    """The real situation, in a fresh process where importlib.metadata reports to transformers a kernels version it
    does not accept (its KERNELS_MAX_VERSION): the decorated class is left untagged (nothing would be replaced) and
    the helper says why."""
    from transformers.utils import import_utils

    bad = import_utils.KERNELS_MAX_VERSION
    code = textwrap.dedent(f"""
        import importlib.metadata as md, json, sys
        real = md.version
        md.version = lambda name: {bad!r} if name == "kernels" else real(name)
        sys.path.insert(0, {str(ROOT / "tools")!r})
        from hf_compat import hub_kernels_problem
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
        print(json.dumps([hasattr(LlamaRMSNorm, "kernel_layer_name"), hub_kernels_problem()]))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tagged, problem = json.loads(proc.stdout.strip().splitlines()[-1])
    assert tagged is False
    assert problem is not None and f"does not accept kernels {bad}" in problem


def _allow_kernel_config_on_cpu(monkeypatch, device: str) -> None:
    """transformers 5.22.2's KernelConfig refuses device "cpu" (KERNELS_SUPPORTED_DEVICE_TYPES: cuda, rocm, xpu,
    npu, neuron, tpu, mps). Everything after that check is device-independent, so on CPU the tests add "cpu" to
    the list and run the very same code path the GPU takes; they first check that the refusal is still there
    (the README tells CPU users to use kernels.kernelize instead)."""
    if device != "cpu":
        return
    from transformers.utils import kernel_config as kc_module

    if "cpu" in kc_module.KERNELS_SUPPORTED_DEVICE_TYPES:
        return
    model = build("llama", device)
    with kernels.use_kernel_mapping({}), pytest.raises(ValueError, match="cpu"):
        model.set_use_kernels(True, transformers.KernelConfig({"RMSNorm": f"{ROOT}:RMSNorm"}, use_local_kernel=True))
    monkeypatch.setattr(kc_module, "KERNELS_SUPPORTED_DEVICE_TYPES", [*kc_module.KERNELS_SUPPORTED_DEVICE_TYPES, "cpu"])


def _rms_norm_is_ours(model) -> bool:
    got = replaced_layers(model)
    return got.get("LlamaRMSNorm") == ("RMSNorm", 2 * LAYERS + 1)


def test_set_use_kernels_with_local_kernel_config(fm, device, monkeypatch):
    """``model.set_use_kernels(True, KernelConfig({"RMSNorm": "<this checkout>:RMSNorm"}, use_local_kernel=True))``
    (what ``from_pretrained(..., use_kernels=True, kernel_config=...)`` ends in) swaps LlamaRMSNorm's forward for
    ours; logits and gradients match the eager model. The mapping is built for the mode the model is in when
    set_use_kernels runs: built in training mode it also serves eval(); built in eval mode, a later train()
    re-kernelizes and silently drops it (transformers 5.22.2) -- calling set_use_kernels again with a fresh
    KernelConfig after train() brings it back."""
    _allow_kernel_config_on_cpu(monkeypatch, device)
    eager = build("llama", device)
    ids = batch(device)

    def config():
        return transformers.KernelConfig({"RMSNorm": f"{ROOT}:RMSNorm"}, use_local_kernel=True)

    # transformers registers its default Hub mapping globally on every set_use_kernels(True): keep it inside a
    # scratch mapping context so that other tests do not see it.
    with kernels.use_kernel_mapping({}):
        model = copy.deepcopy(eager).train()
        model.set_use_kernels(True, config())
        assert model.use_kernels and _rms_norm_is_ours(model), replaced_layers(model)
        with OpCounter() as ops:
            got = forward_backward(model, ids)
        assert ops.counts["rms_norm_fwd"] == ops.counts["rms_norm_bwd"] == 2 * LAYERS + 1
        want = forward_backward(eager.train(), ids)
        for name, o, e in zip(["loss", "logits"], got[:2], want[:2]):
            assert_fp32_close(o, e, name)
        for name in want[2]:
            assert_fp32_close(got[2][name], want[2][name], f"grad {name}")

        model.eval()  # re-kernelizes for inference: the training-mode mapping serves it
        assert _rms_norm_is_ours(model)
        with torch.no_grad():
            assert_fp32_close(model(input_ids=ids).logits, eager.eval()(input_ids=ids).logits, "eval logits")

        # Built in eval mode (as from_pretrained does), the mapping holds Mode.INFERENCE only ...
        model = copy.deepcopy(eager).eval()
        model.set_use_kernels(True, config())
        assert _rms_norm_is_ours(model)
        model.train()
        assert not _rms_norm_is_ours(model), "transformers now keeps the kernels across train(): update README"
        model.set_use_kernels(True, config())  # ... a fresh KernelConfig after train() restores ours
        assert _rms_norm_is_ours(model)


def test_from_pretrained_use_kernels_with_hub_kernel_config(fm, device, monkeypatch, tmp_path):
    """The README's transformers snippet, offline: ``from_pretrained(..., use_kernels=True,
    kernel_config=KernelConfig({"RMSNorm": "kernels-community/fused-mlp:RMSNorm", "GeGLUMLP": ...}))`` with
    LOCAL_KERNELS pointing the Hub repo at this checkout. (An explicit revision instead of the default version 1:
    a version is resolved against the Hub's tags, which LOCAL_KERNELS does not cover offline.) LlamaRMSNorm is
    decorated by transformers; LlamaMLP is opted in first, which is what lets KernelConfig accept "GeGLUMLP"."""
    _allow_kernel_config_on_cpu(monkeypatch, device)
    monkeypatch.setenv("LOCAL_KERNELS", f"kernels-community/fused-mlp={ROOT}")
    eager = build("llama", device).eval()
    eager.save_pretrained(tmp_path)
    hub = ("kernels-community/fused-mlp:{}", {"revision": "main"})
    # inherit_mapping=False: on CUDA transformers would add its own Hub kernels (kernels-community/rotary), which an
    # offline test cannot fetch; online, a user may keep them.
    config = transformers.KernelConfig({n: (hub[0].format(n), hub[1]) for n in ("RMSNorm", "GeGLUMLP")},
                                       inherit_mapping=False)
    with kernels.use_kernel_mapping({}), opted_in(((LlamaMLP, "GeGLUMLP"),)):
        model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, use_kernels=True, kernel_config=config,
                                                              device_map=device)
    assert not model.training and model.use_kernels
    assert_replaced(model, "llama")
    ids = batch(device)
    with torch.no_grad():
        with OpCounter() as ops:
            got = model(input_ids=ids, use_cache=False).logits
        want = eager(input_ids=ids, use_cache=False).logits
    assert ops.counts == expected_ops("llama", backward=False)
    assert_fp32_close(got, want, "logits")


@pytest.mark.xfail(raises=AttributeError, strict=True,
                   reason="transformers 5.22.2: from_pretrained rewrites a use_local_kernel KernelConfig's entries "
                          "into (repo, metadata) tuples, then add_to_mapping_local calls .split on the tuple")
def test_from_pretrained_with_local_kernel_config(fm, device, monkeypatch, tmp_path):
    """Known transformers bug, pinned so that the README's workaround (from_pretrained without kernel_config, then
    model.set_use_kernels(True, KernelConfig(..., use_local_kernel=True))) is revisited when it is fixed."""
    _allow_kernel_config_on_cpu(monkeypatch, device)
    build("llama", device).save_pretrained(tmp_path)
    config = transformers.KernelConfig({"RMSNorm": f"{ROOT}:RMSNorm"}, use_local_kernel=True)
    with kernels.use_kernel_mapping({}):
        transformers.LlamaForCausalLM.from_pretrained(tmp_path, use_kernels=True, kernel_config=config,
                                                      device_map=device)
