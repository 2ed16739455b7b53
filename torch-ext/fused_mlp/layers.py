"""Stateless layers for ``kernels.kernelize``: each replaces the ``forward`` of a transformers module and reads
that module's own parameters. No ``__init__``, no members but ``forward`` (the ``kernels`` layer rules)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._common import FLOAT_DTYPES, GELU_APPROXIMATE, autocast_dtype, check_tensor, dtensor_type, is_plain, warn_once
from .addmm import addmm as _addmm
from .addmm import cpu_gemm_inference as _cpu_gemm_inference
from .addmm import linear as _linear
from .gated_mlp import _gated_mlp
from .rms_norm import _rms_norm_layer_call, _module_eps, rms_norm


__all__ = ["RMSNorm", "GemmaRMSNorm", "GeGLUMLP", "Linear", "Conv1D"]


def _module_forward(module: nn.Module, x: torch.Tensor, why: str) -> torch.Tensor:
    """The replaced module's own forward (kernelize swaps the instance's forward; the class keeps the original),
    announced once per reason."""
    warn_once(
        f"{type(module).__name__}:{why}",
        f"fused_mlp: {type(module).__name__} runs its own PyTorch forward here, not the fused kernel: {why}.",
    )
    return type(module).forward(module, x)


_Tensor, _Parameter = torch.Tensor, nn.Parameter


def _rms_norm_layer(module: nn.Module, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                    out_dtype: torch.dtype) -> torch.Tensor:
    if is_plain(x) and is_plain(weight):
        return _rms_norm_layer_call(x, weight, eps, offset, out_dtype)
    # Tensor parallel / sequence parallel: a DTensor input whose rows are whole on every rank (any sharding but
    # along the hidden dim) with a replicated DTensor weight is normalised locally; every row is independent.
    DTensor = dtensor_type()
    if DTensor is None or not isinstance(x, DTensor) or not isinstance(weight, DTensor):
        return _module_forward(module, x, "the input or weight is a tensor subclass other than DTensor+DTensor")
    from torch.distributed.tensor import Partial, Replicate

    last = x.ndim - 1
    if (weight.device_mesh != x.device_mesh or not all(p.is_replicate() for p in weight.placements)
            or any(p.is_partial() or (p.is_shard() and p.dim in (last, -1)) for p in x.placements)):
        return _module_forward(module, x, "the DTensor layout splits the normalised dimension or the weight")
    # Each rank's weight gradient covers only its own rows: declare it partial along the mesh dims that shard rows.
    grad_placements = [Partial() if p.is_shard() else Replicate() for p in x.placements]
    y = rms_norm(x.to_local(), weight.to_local(grad_placements=grad_placements), _module_eps(eps), offset=offset,
                 out_dtype=out_dtype)
    return DTensor.from_local(y, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())


# transformers' RMSNorm classes that return ``(weight * norm(x)).to(input_dtype)``: their output dtype is the
# input's, where Llama's ``weight * norm(x).to(input_dtype)`` gives promote(weight, input). The set is every such
# class of transformers 5.22.2-5.25.0, decorated "RMSNorm" or not (tests/layers/test_rms_norm_layers.py checks them).
_RMS_OUT_IN_INPUT_DTYPE = frozenset({
    "AfmoeRMSNorm", "BeamRMSNorm", "DeepseekV4RMSNorm", "FlexOlmoRMSNorm", "FlintRMSNorm", "GptOssRMSNorm",
    "Inkling2LoopRMSNorm", "Inkling2RMSNorm", "NemotronHRMSNorm", "NemotronH_Omni_RMSNorm", "Olmo2RMSNorm",
    "Olmo3RMSNorm", "OlmoHybridRMSNorm", "OpenAIPrivacyFilterRMSNorm",
})


class RMSNorm(nn.Module):
    """LlamaRMSNorm / Qwen3RMSNorm / every transformers class decorated ``"RMSNorm"``.

    Reads ``weight`` and ``variance_epsilon``. The output dtype is the module's own: ``promote(weight.dtype,
    input.dtype)`` for Llama's form (fp32 weights with bf16 activations give fp32), the input's for the classes that
    round after the weight (OLMo 2, GPT-OSS, DeepSeek-V4, ...); the result is rounded once from fp32 math.
    """

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        params = self._parameters  # a dict read: nn.Module.__getattr__ costs ~0.5 us per call
        weight = params["weight"] if "weight" in params else self.weight
        w_dtype, x_dtype = weight.dtype, hidden_states.dtype
        out_dtype = (x_dtype if w_dtype is x_dtype or type(self).__name__ in _RMS_OUT_IN_INPUT_DTYPE
                     else torch.promote_types(w_dtype, x_dtype))
        if type(hidden_states) is _Tensor and (type(weight) is _Parameter or type(weight) is _Tensor):
            return _rms_norm_layer_call(hidden_states, weight, self.variance_epsilon, 0.0, out_dtype)
        return _rms_norm_layer(self, hidden_states, weight, self.variance_epsilon, 0.0, out_dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma / Gemma2 / Gemma3 RMSNorm: ``y = norm(x) * (1 + w)`` in fp32, returned in ``x``'s dtype.

    Reads ``weight`` and ``eps``.
    """

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = self._parameters
        weight = params["weight"] if "weight" in params else self.weight
        if type(x) is _Tensor and (type(weight) is _Parameter or type(weight) is _Tensor):
            return _rms_norm_layer_call(x, weight, self.eps, 1.0, x.dtype)
        return _rms_norm_layer(self, x, weight, self.eps, 1.0, x.dtype)


# ---- GeGLUMLP (gated MLP: Gemma GeGLU, Llama/Qwen SwiGLU) ---------------------------------------------------

# Activation modules recognised by (module, class name), exact type only (a subclass may override forward).
# Checked against transformers 5.22.2's ACT2FN: "gelu_pytorch_tanh" -> GELUTanh (PytorchGELUTanh is its alias),
# "gelu_new" -> NewGELUActivation, "gelu_fast" -> FastGELUActivation and AccurateGELUActivation (the tanh formula
# written differently, the same function), "gelu" -> GELUActivation (erf; its `use_gelu_python` variant too),
# "silu" -> SiLUActivation, "swish" -> nn.SiLU. "approx" = read the instance's `approximate` ("none" by default).
_ACTIVATION_BY_CLASS = {
    ("transformers.activations", "GELUTanh"): "gelu_tanh",
    ("transformers.activations", "PytorchGELUTanh"): "gelu_tanh",
    ("transformers.activations", "NewGELUActivation"): "gelu_tanh",
    ("transformers.activations", "FastGELUActivation"): "gelu_tanh",
    ("transformers.activations", "AccurateGELUActivation"): "gelu_tanh",
    ("transformers.activations", "GELUActivation"): "approx",
    ("torch.nn.modules.activation", "GELU"): "approx",
    ("transformers.activations", "SiLUActivation"): "silu",
    ("torch.nn.modules.activation", "SiLU"): "silu",
}


def _activation_kind(act) -> str | None:
    """The kernel activation equal to `act`, or None when `act` is anything else (then the module's own math)."""
    t = type(act)
    kind = _ACTIVATION_BY_CLASS.get((t.__module__, t.__qualname__))
    if kind == "approx":
        approximate = getattr(act, "approximate", "none")
        return GELU_APPROXIMATE.get(approximate) if isinstance(approximate, str) else None
    if kind is None:
        if act is torch.nn.functional.silu:
            return "silu"
        if act is torch.nn.functional.gelu:
            return "gelu"
    return kind


# nn.Module's global hooks (register_module_forward_hook & co.): each fires for every module call, so a gated MLP that
# skipped its submodules' calls would hide them. (The dicts are mutated in place: references taken once stay live.)
_GLOBAL_HOOKS = tuple(getattr(nn.modules.module, n, {}) for n in (
    "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks", "_global_backward_pre_hooks"))


def _unhooked(m: nn.Module) -> bool:
    """No hooks of its own (forward or backward) and a forward that is the class's (kernelize may set that on the
    instance) or kernelize's swap to this package's Linear layer: a forward replaced on the instance by anything else
    (accelerate's offload wrapper, which loads meta weights just in time, a monkey patch) must run, so the module's
    own math does."""
    if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
        return False
    f = m.__dict__.get("forward")
    if f is None:
        return True
    if torch.compiler.is_compiling():
        # Dynamo before torch 2.14 cannot read a bound method's __func__ (getattr answered None, and every kernelized
        # MLP fell back). Compiled graphs skip this check; offloaded weights are still caught by their meta device.
        return True
    fn = getattr(f, "__func__", None)
    return fn is Linear.forward or fn is type(m).forward


def _plain_linear(m) -> bool:
    """An nn.Linear whose forward is F.linear on plain tensors: no subclass, no hooks, no replaced forward, no
    tensor-subclass or meta weight (quantised, DTensor, offloaded). Anything else keeps the module's own math. (Dict
    reads, not attribute reads: nn.Module.__getattr__ costs about a microsecond each, and decode runs this per layer
    per token.)"""
    if type(m) is not nn.Linear or not _unhooked(m):
        return False
    w = m._parameters.get("weight")
    return is_plain(w) and not w.is_meta


def _autocast_casts(*tensors: torch.Tensor | None) -> bool:
    """Whether autocast casts every one of ``tensors`` (None: an absent bias) to its dtype: it leaves float64 alone."""
    return all(t is None or t.dtype in FLOAT_DTYPES for t in tensors)


class GeGLUMLP(nn.Module):
    """Gated MLP ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: Gemma/Gemma2/Gemma3 (tanh-GeLU), exact-GeLU
    MLPs and Llama/Qwen/Mistral (SiLU: SwiGLU).

    Reads ``gate_proj``, ``up_proj``, ``down_proj`` (nn.Linear, bias optional) and ``act_fn``. The projections go
    through cuBLAS, the activation and the product are one kernel (fp32 math, one rounding), and in training only
    ``x``, ``gate`` and ``up`` are kept for backward. Any other activation, a non-plain Linear (subclass, forward or
    backward hooks, a forward replaced on the instance as accelerate's offloading does, quantised or meta weights),
    hooks on ``act_fn``, global module hooks or mixed dtypes outside autocast run the module's own math, with exactly
    its result (the submodules' calls and hooks included);
    float64 inputs or weights raise the ops' TypeError instead.
    """

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mods = self._modules
        gate_proj, up_proj, down_proj = mods.get("gate_proj"), mods.get("up_proj"), mods.get("down_proj")
        act_fn = mods.get("act_fn")
        if act_fn is None:
            act_fn = self.act_fn  # a plain function attribute (F.silu, ...)
        activation = _activation_kind(act_fn)
        act_plain = not isinstance(act_fn, nn.Module) or _unhooked(act_fn)
        g0, g1, g2, g3 = _GLOBAL_HOOKS
        if (
            activation is not None
            and act_plain
            and (type(x) is torch.Tensor or is_plain(x))
            and _plain_linear(gate_proj) and _plain_linear(up_proj) and _plain_linear(down_proj)
            and not (g0 or g1 or g2 or g3)
        ):
            gp, upp, dp = gate_proj._parameters, up_proj._parameters, down_proj._parameters
            w_gate, w_up, w_down = gp["weight"], upp["weight"], dp["weight"]
            b_gate, b_up, b_down = gp.get("bias"), upp.get("bias"), dp.get("bias")
            dtype = x.dtype
            autocast = autocast_dtype(x)
            if (dtype is torch.bfloat16 or dtype is torch.float16 or dtype is torch.float32) and (
                (
                    autocast is None
                    and w_gate.dtype is dtype and w_up.dtype is dtype and w_down.dtype is dtype
                    and (b_gate is None or b_gate.dtype is dtype)
                    and (b_up is None or b_up.dtype is dtype)
                    and (b_down is None or b_down.dtype is dtype)
                )
                # under autocast every operand is cast to its dtype, as F.linear would cast it, float64 excepted
                or (autocast is not None and _autocast_casts(w_gate, w_up, w_down, b_gate, b_up, b_down))
            ):
                return _gated_mlp(x, w_gate, w_up, w_down, b_gate, b_up, b_down, activation, autocast)
            # float64 & co raise, as in the other layers and the ops: an input, or weights (under autocast too, where
            # the module's F.linear raises on them: autocast does not cast float64)
            check_tensor(x, "x")
            for name, t in (("gate_proj.weight", w_gate), ("up_proj.weight", w_up), ("down_proj.weight", w_down),
                            ("gate_proj.bias", b_gate), ("up_proj.bias", b_up), ("down_proj.bias", b_down)):
                if t is not None:
                    check_tensor(t, name)
            why = "the weights' dtypes differ from the input's (outside autocast)"
        elif activation is None:
            why = f"no fused kernel for the activation {type(act_fn).__name__}"
        elif not act_plain:
            why = "the activation module has hooks or a replaced forward"
        elif not is_plain(x):
            why = "the input is a tensor subclass (DTensor, ...)"
        elif g0 or g1 or g2 or g3:
            why = "global nn.Module hooks are registered (register_module_forward_hook & co.)"
        else:
            why = ("the projections are not plain nn.Linear on plain tensors (DTensor, quantised, offloaded, hooks, "
                   "a replaced forward, subclass)")
        warn_once(f"GeGLUMLP:{why}", f"fused_mlp: GeGLUMLP runs the module's own PyTorch math here: {why}.")
        return type(self).forward(self, x)  # the class's (kernelize set the layer's on the instance)


# ---- addmm / linear layers ------------------------------------------------------------------------------------


_OWN_FORWARD: dict[type, bool] = {}


def _is_conv1d(c: type) -> bool:
    return c.__name__ == "Conv1D" and c.__module__ == "transformers.pytorch_utils"


@torch.compiler.assume_constant_result  # a constant to dynamo: reading the cache there guarded on it (a recompile)
def _keeps_own_forward(cls: type) -> bool:
    """Whether kernelize's swap skipped a forward that ``cls`` must keep. kernels swaps every subclass of an opted-in
    class (``replace_kernel_forward_from_hub(nn.Linear, "Linear")`` reaches QAT Linear, MoE routers that return
    tuples, ...): a forward defined below nn.Linear / transformers' Conv1D is kept unless its class, or one below it,
    opted in itself (tagged when first called; the answer is kept per class)."""
    own = _OWN_FORWARD.get(cls)
    if own is None:
        mro = cls.__mro__
        definer = next((c for c in mro if "forward" in vars(c)), None)
        tagger = next((c for c in mro if "kernel_layer_name" in vars(c)), None)
        own = _OWN_FORWARD[cls] = (definer is not None and definer is not nn.Linear and not _is_conv1d(definer)
                                   and not (tagger is not None and issubclass(tagger, definer)))
    return own


def _weight_and_bias(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``module.weight, module.bias`` from ``_parameters`` when they are parameters (nn.Module.__getattr__ costs ~1 us
    a lookup, paid per Linear per token in decode), else through the attributes."""
    params = module._parameters
    weight = params["weight"] if "weight" in params else module.weight
    bias = params["bias"] if "bias" in params else module.bias
    return weight, bias


class Linear(nn.Module):
    """``nn.Linear``: ``input @ weight.T + bias`` with the bias added to the fp32 GEMM accumulator (one rounding)
    and the bias gradient summed in fp32.

    Reads ``weight`` ``[out, in]`` (used in place, no transpose copy) and ``bias`` (may be None). Output dtype as
    ``nn.Linear``'s (the input's; under autocast, the autocast dtype).
    """

    can_torch_compile = True
    has_backward = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        cls = type(self)
        if cls is not nn.Linear and _keeps_own_forward(cls):
            return _module_forward(self, input, "a subclass with a forward of its own that did not opt in itself")
        weight, bias = _weight_and_bias(self)
        if is_plain(input) and is_plain(weight) and (bias is None or is_plain(bias)):
            if (not input.is_cuda and weight.dim() == 2  # GPU calls: one attribute read
                    and _cpu_gemm_inference(input, weight, bias, weight.shape[0])):  # ATen's GEMM either way
                return F.linear(input, weight, bias)
            return _linear(input, weight, bias)
        return _module_forward(self, input, "a DTensor or other tensor subclass operand")


class Conv1D(nn.Module):
    """transformers' GPT-2 style ``Conv1D``: ``addmm(bias, x.view(-1, in), weight).view(..., out)`` with
    ``weight`` ``[in, out]`` (used in place) and ``bias`` ``[out]``, fused on the fp32 accumulator.
    """

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _keeps_own_forward(type(self)):
            return _module_forward(self, x, "a subclass with a forward of its own that did not opt in itself")
        weight, bias = _weight_and_bias(self)
        if is_plain(x) and is_plain(weight) and (bias is None or is_plain(bias)):
            if (not x.is_cuda and weight.dim() == 2
                    and _cpu_gemm_inference(x, weight, bias, weight.shape[1])):  # as Linear's
                return F.linear(x, weight.t(), bias)
            return _addmm(bias, x, weight)
        return _module_forward(self, x, "a DTensor or other tensor subclass operand")
