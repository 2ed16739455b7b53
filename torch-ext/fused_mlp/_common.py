"""Shared argument checks and autograd helpers for the fused_mlp ops (standard library and torch only)."""

from __future__ import annotations

import math
from typing import Any

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_tensor(t: Any, name: str) -> torch.Tensor:
    """`t` is a float32/float16/bfloat16 tensor, else TypeError naming the argument."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    return t


def check_device(t: torch.Tensor, ref: torch.Tensor, name: str, ref_name: str) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}; they must be on one device")


def check_dtype_arg(dtype: Any, name: str) -> None:
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be None or one of float32/float16/bfloat16, got {dtype}")


def check_finite(value: Any, name: str, *, nonnegative: bool = False) -> float:
    if isinstance(value, torch.Tensor) or not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a Python float, got {type(value).__name__}")
    value = float(value)
    if not (-math.inf < value < math.inf):  # plain comparisons: dynamo cannot trace math.isfinite
        raise ValueError(f"{name} must be finite, got {value}")
    if nonnegative and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


# ---- activations: one spelling for every op (kernels_src/activation.h parses the same strings) -----------------
GATED_ACTIVATIONS = ("gelu_tanh", "gelu", "silu")  # act(gate) * up: geglu, swiglu, gated_mlp
EPILOGUE_ACTIVATIONS = ("none", "gelu_tanh", "gelu")  # act(bias + mat1 @ mat2): addmm, linear (None means "none")
GELU_APPROXIMATE = {"tanh": "gelu_tanh", "none": "gelu"}  # F.gelu's `approximate` -> the activation's name


def as_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """[..., n] -> [rows, n] with unit stride along n (any row stride), a view where the strides allow it. The row
    count is spelled out so that n == 0 works too (reshape(-1, 0) is ambiguous); 2-D input is taken as it is."""
    if t.dim() != 2:
        t = t.reshape(math.prod(t.shape[:-1]), n)
    if n <= 1 or t.stride(1) == 1:
        return t
    # An empty tensor counts as contiguous whatever its strides (an expanded [0, n] gradient keeps stride 0): a fresh
    # one has the unit stride the kernels check for.
    return t.contiguous() if t.numel() else t.new_empty(t.shape)


def misaligned16(t: torch.Tensor) -> bool:
    """Whether t's data does not start on a 16-byte boundary (the vector kernels' need). For plain tensors the pointer
    itself: a storage need not start aligned (DLPack imports and wrapped pointers have offset 0 anywhere). Subclasses
    (fake tensors, which have no real pointer, ...) answer by their offset."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return t.data_ptr() % 16 != 0
    return t.storage_offset() * t.element_size() % 16 != 0


def declare_grad_dtypes(ctx: Any, *dtypes: torch.dtype | None, out_dtype: torch.dtype | None = None) -> None:
    """On torch >= 2.14, have the autograd engine hand backward the incoming gradients uncast (None) or in the
    given dtype, instead of casting an fp32 gradient down to a bf16/fp16 output's dtype. Older torch: no-op.
    ``out_dtype``: the outputs' one dtype where the caller knows it; fp32 outputs have nothing to keep uncast and
    skip the declaration, which costs host time (docs/tuning-log.md#host-path-training).

    Skipped while dynamo traces (torch 2.14's dynamo does not model the declaration: its traced ctx lacks the
    attribute the setter writes); compiled graphs get their backward dtypes from AOTAutograd instead."""
    if out_dtype is torch.float32:
        return
    setter = getattr(ctx, "set_output_grad_dtype", None)
    if setter is not None and not torch.compiler.is_compiling():
        setter(*dtypes)


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype ``torch.autocast`` casts x's device's matmuls to, or None outside autocast. Eagerly, the any-device
    flag answers the common "no" without building a device object (decode asks once per layer per token); dynamo
    traces the public per-device query instead."""
    if not torch.compiler.is_compiling() and not torch._C._is_any_autocast_enabled():
        return None
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


# ---- torch.compile: our kernel, or a decomposition Inductor can fuse ---------------------------------------------
# Under torch.compile an op either calls its kernel (opaque to Inductor) or traces its plain fp32 definition, which
# keeps the numerics contract (fp32 math, one rounding) and which Inductor fuses with its neighbours (the decoder
# layer's residual add into the norm, casts, the activation between GEMMs). Per op, the smallest token count at which
# the kernel is measured faster than Inductor's code in a compiled model (None: never); docs/tuning-log.md
# #compile-policy has the measurements. Only sizes known when the graph is traced decide (a static-shape graph, e.g.
# transformers' static-cache decode): a symbolic token count never adds a guard (no recompiles when it changes) and
# takes the decomposition, which is what the user's compiled model runs without this package.
KERNEL_UNDER_COMPILE: dict[str, int | None] = {
    "rms_norm": None,  # decomposition at every size: docs/tuning-log.md#compile-policy
    "gated_act": None,  # decomposition at every size: docs/tuning-log.md#compile-policy
}
COMPILE_ENV = "FUSED_MLP_UNDER_COMPILE"
COMPILE_MODES = ("auto", "kernel", "decompose")  # kernel / decompose: force one side (tests, benchmarks)

try:
    from torch.fx.experimental.symbolic_shapes import statically_known_true as _statically_true
except ImportError:  # pragma: no cover - older torch
    def _statically_true(cond) -> bool:
        return bool(cond) if not isinstance(cond, torch.SymBool) else False


def env_mode(env: str, modes: tuple[str, ...]) -> str:
    """An environment switch: lower-cased, "auto" when unset or empty; ValueError for a value outside ``modes``."""
    import os

    m = os.environ.get(env, "auto").strip().lower() or "auto"
    if m not in modes:
        raise ValueError(f"{env} must be one of {modes}, got {m!r}")
    return m


# Compute capability per device index, read once (the dispatch tables of _epilogue.py and _decode.py are keyed by it).
CAPABILITY: dict[int, tuple[int, int]] = {}


def device_capability(idx: int) -> tuple[int, int]:
    cap = CAPABILITY.get(idx)
    if cap is None:
        cap = CAPABILITY[idx] = torch.cuda.get_device_capability(idx)
    return cap


@torch.compiler.assume_constant_result
def compile_mode() -> str:
    """FUSED_MLP_UNDER_COMPILE (read when a graph is traced): "auto" (the table above), "kernel", "decompose"."""
    return env_mode(COMPILE_ENV, COMPILE_MODES)


def decompose_under_compile(op: str, x: torch.Tensor) -> bool:
    """True when torch.compile is tracing and `op` should trace its fp32 decomposition instead of its kernel for a
    call on x ``[..., N]`` (its token rows may be symbolic; deciding never adds a guard). Eager calls: False, at the
    cost of one query (decode calls this per layer per token)."""
    if not torch.compiler.is_compiling():
        return False
    mode = compile_mode()
    if mode != "auto":
        return mode == "decompose"
    min_rows = KERNEL_UNDER_COMPILE[op]
    return min_rows is None or not _statically_true(math.prod(x.shape[:-1]) >= min_rows)


_EXPORT_FLAG = hasattr(torch.compiler, "_is_exporting_flag")


def exporting() -> bool:
    """Whether torch.export is tracing. Dynamo up to torch 2.11 answers ``torch.compiler.is_exporting()`` with True
    under every torch.compile, so a dynamo trace reads the flag export sets (a guarded constant) instead."""
    if _EXPORT_FLAG and torch.compiler.is_dynamo_compiling():
        return bool(torch.compiler._is_exporting_flag)
    return torch.compiler.is_exporting()


def plain_when_traced(*tensors: torch.Tensor | None) -> bool:
    """While traced, whether training takes differentiable PyTorch math instead of the autograd Function: under
    torch.export, which inlines a Function's forward and drops its backward (the ops have no derivative of their own,
    so the exported program would lose the gradients), and where one tensor is passed twice (dynamo refuses duplicate
    Function inputs)."""
    if exporting():
        return True
    given = [t for t in tensors if t is not None]
    return any(given[i] is given[j] for i in range(len(given)) for j in range(i))  # `is`: no guard on ids


def functorch_active() -> bool:
    """Whether a torch.func transform (grad, vjp, jvp, vmap, functionalize) is active: the autograd Functions leave out
    ``setup_context`` (docs/design.md#torchfunc), which those transforms require, so the ops run their fp32 definition
    in PyTorch ops instead (announced once per op)."""
    return _functorch_transforms_active()


_functorch_transforms_active = torch._C._are_functorch_transforms_active


def say_functorch_fallback(op: str) -> None:
    """The once-per-op warning of the torch.func fallback."""
    warn_once(f"functorch:{op}", f"fused_mlp: under a torch.func transform, {op} runs its fp32 definition in PyTorch "
              "ops, not the fused kernel (see docs/design.md#torchfunc)")


def statically_true(cond) -> bool:
    """`cond` provably true at trace time, without adding a guard (plain bools pass through)."""
    return _statically_true(cond)


_WARNED: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """A UserWarning the first time `key` is seen in this process (fallbacks to plain PyTorch are announced). Not
    while dynamo traces (it cannot trace warnings.warn: a graph break); the first eager call says it."""
    if not torch.compiler.is_dynamo_compiling() and key not in _WARNED:  # (no guard on the set)
        _WARNED.add(key)
        import warnings

        warnings.warn(message, UserWarning, stacklevel=3)


def reference_backward(op: str, reference: Any, inputs: tuple, needs: tuple, grads: tuple) -> list:
    """An autograd Function's backward under ``create_graph=True`` (the only case in which grad mode is on inside it):
    the gradients of the op's plain-PyTorch fp32 ``reference(*inputs)`` by autograd, a graph of their own, so that
    differentiating them again (Hessian-vector products, gradient penalties) includes the op's second-order terms,
    which the backward kernels cannot give (they have no derivative). Values: fp32 math rounded once, as the kernels'
    (the 2x rule, not their bits). Announced once per op (docs/design.md#double-backward).

    ``inputs``: the saved tensors the reference takes (None where absent); ``needs``: which of them get a gradient;
    ``grads``: the incoming gradient of each reference output (None: unused). Returns one gradient or None per input.
    """
    warn_once(f"create_graph:{op}", f"fused_mlp.{op}: backward with create_graph=True runs the op's plain-PyTorch "
              "fp32 reference (differentiable again) instead of its backward kernels; see docs/design.md")
    out: list = [None] * len(inputs)
    wanted = [i for i, need in enumerate(needs) if need and inputs[i] is not None]
    outs = reference(*inputs) if wanted else ()
    if isinstance(outs, torch.Tensor):
        outs = (outs,)
    # An incoming gradient in another dtype (fp32 at a bf16 output) is rounded to the output's, as autograd does for
    # a plain-PyTorch op; it may also arrive in the caller's shape where the reference ran on 2-D rows.
    pairs = [(o, g.reshape(o.shape).to(o.dtype)) for o, g in zip(outs, grads) if g is not None]
    if pairs:
        got = torch.autograd.grad([o for o, _ in pairs], [inputs[i] for i in wanted], [g for _, g in pairs],
                                  create_graph=True, allow_unused=True)
        for i, g in zip(wanted, got):
            out[i] = g
    return out


def is_plain(t: Any) -> bool:
    """A plain tensor or parameter (not a DTensor, quantised or other tensor subclass), or a fake tensor: non-strict
    torch.export and FakeTensorMode run module code on those, and the ops' fake implementations take them."""
    tt = type(t)
    return tt is torch.Tensor or tt is torch.nn.Parameter or tt is _FakeTensor


from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor  # noqa: E402 (imported by torch itself)


def dtensor_type() -> Any:
    """torch.distributed.tensor.DTensor, or None where torch.distributed is unavailable."""
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # pragma: no cover - builds without distributed support
        return None
    return DTensor
