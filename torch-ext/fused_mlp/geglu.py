"""Gated activations ``h = act(gate) * up`` (GeGLU: tanh- or erf-GeLU; SwiGLU: SiLU).

Shapes: ``gate`` and ``up`` ``[..., I]`` with one dtype (unit stride along ``I``, any row stride: the two halves of
one ``[..., 2I]`` tensor work without a copy); the result is ``[..., I]`` contiguous. Numerics: fp32 math, each
output rounded once. Backward takes ``dh`` in fp32 or the output's dtype and recomputes the activation from
``gate`` (nothing but ``gate`` and ``up`` is saved). The whole MLP built on it is ``gated_mlp.py``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ._common import (
    GELU_APPROXIMATE,
    as_rows,
    check_device,
    check_tensor,
    declare_grad_dtypes,
    decompose_under_compile,
    functorch_active,
    plain_when_traced,
    reference_backward,
    say_functorch_fallback,
    warn_once,
)
from ._ops import add_op_namespace_prefix, ops

__all__ = ["geglu", "swiglu", "geglu_reference", "swiglu_reference"]

_Tensor = torch.Tensor
_grad_enabled = torch.is_grad_enabled
_is_compiling = torch.compiler.is_dynamo_compiling  # as rms_norm.py: one Python call, False wherever Dynamo traces
# The OpOverload (skips the OpOverloadPacket's overload resolution) and, for the eager fast path, its C++ entry (skips
# OpOverload.__call__'s Python frame).
_fwd = ops.geglu_fwd.default
_fwd_call = getattr(_fwd, "_op", _fwd)
# What the op raises on arguments the full path rejects with its own error (or converts): a C++ check
# (RuntimeError), a schema mismatch (TypeError), a device without a kernel (NotImplementedError).
_FALLBACK_ERRORS = (RuntimeError, TypeError, NotImplementedError)


# ---- custom ops: fake implementations for torch.compile --------------------------------------------------


@torch.library.register_fake(add_op_namespace_prefix("geglu_fwd"))
def _geglu_fwd_fake(gate, up, activation):
    return gate.new_empty(gate.shape)


@torch.library.register_fake(add_op_namespace_prefix("geglu_bwd"))
def _geglu_bwd_fake(dh, gate, up, activation):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


@torch.library.register_fake(add_op_namespace_prefix("geglu_bwd_"))
def _geglu_bwd_inplace_fake(dh, gate, up, activation):
    return None


# ---- autograd: the activation alone ------------------------------------------------------------------------


class _GatedActFunction(torch.autograd.Function):
    """``act(gate) * up``. Contiguous inputs of any rank go in as they are, so the op's output already has the
    caller's shape: a view taken after ``apply`` would put a ViewBackward node in front of this Function, where the
    engine casts an fp32 incoming gradient to the output dtype (defeating ``set_output_grad_dtype``). Row-strided
    inputs (e.g. ``x.chunk(2, -1)`` halves) come in as 2-D rows, and in eager mode ``shape`` (the caller's) makes the
    Function hand back h in that shape itself, for the same reason.

    Classic ``forward(ctx, ...)`` form: with a separate ``setup_context``, ``apply`` binds the signature with
    ``inspect`` on every call (tens of microseconds)."""

    @staticmethod
    def forward(ctx, gate, up, activation, shape):
        h = _fwd(gate, up, activation)
        if shape is not None and h.shape != shape:
            # Rows of a strided [..., I] input (eager): hand back the caller's shape from here, as a tensor of its
            # own (detached: a view returned from a Function refuses in-place ops; h is not saved, so nothing else
            # refers to the rows).
            h = h.view(shape).detach()
        ctx.save_for_backward(gate, up)
        ctx.activation = activation
        # An fp32 gradient arriving at a bf16/fp16 h reaches the kernel uncast (it reads fp32 or h's dtype).
        declare_grad_dtypes(ctx, None, out_dtype=h.dtype)
        return h

    @staticmethod
    def backward(ctx, dh):
        gate, up = ctx.saved_tensors
        if _grad_enabled():  # create_graph=True: a backward that can be differentiated again
            dgate, dup = reference_backward(
                "geglu / swiglu", lambda g, u: gated_act_reference(g, u, ctx.activation), (gate, up),
                ctx.needs_input_grad[:2], (dh,))
            return dgate, dup, None, None
        n = gate.shape[-1]
        dh = as_rows(dh, n)  # rows; dh may arrive as an expanded (stride-0) or transposed view
        if dh.dtype != gate.dtype and dh.dtype != torch.float32:
            dh = dh.to(gate.dtype)
        dgate, dup = ops.geglu_bwd(dh, as_rows(gate, n), as_rows(up, n), ctx.activation)
        shape = gate.shape
        return (
            dgate.view(shape) if ctx.needs_input_grad[0] else None,
            dup.view(shape) if ctx.needs_input_grad[1] else None,
            None,
            None,
        )


def _fast(gate: Any, up: Any, activation: str) -> torch.Tensor | None:
    """The eager fast path: plain contiguous tensors straight to the op (no gradient needed) or the Function, before
    the Python checks. The op checks dtypes, shapes and devices before any work; whatever it rejects returns None
    here and takes the full path, which raises the documented error (host cost per call:
    docs/tuning-log.md#host-path). Excluded: tracing, and meta tensors (the dispatcher would run the fake
    implementation, which checks nothing: the checked path validates them)."""
    if (type(gate) is not _Tensor or type(up) is not _Tensor or _is_compiling() or gate.is_meta or up.is_meta
            or not (gate.is_contiguous() and up.is_contiguous())):
        return None
    try:
        if _grad_enabled() and (gate.requires_grad or up.requires_grad):
            return _GatedActFunction.apply(gate, up, activation, None)
        return _fwd_call(gate, up, activation)
    except _FALLBACK_ERRORS:
        return None


def _gated(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    check_tensor(gate, "gate")
    check_tensor(up, "up")
    check_device(up, gate, "up", "gate")
    if torch.compiler.is_compiling() and gate.dim() == up.dim():
        # Token counts may be unbacked symbols (mark_unbacked): assert at run time instead of guarding on them.
        for a, b in zip(gate.shape, up.shape):
            torch._check(a == b, lambda: "gate and up must have one shape")
    elif gate.shape != up.shape:
        raise ValueError(f"gate and up must have one shape, got gate {list(gate.shape)} and up {list(up.shape)}")
    if gate.dtype != up.dtype:
        raise TypeError(f"gate and up must have one dtype, got gate {gate.dtype} and up {up.dtype}")
    if gate.dim() == 0:
        raise ValueError("gate and up must have at least one dimension [..., I]")
    return gated_act(gate, up, activation)


def gated_act(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` on checked arguments (``gated_mlp`` calls it on its own projections)."""
    if functorch_active():  # torch.func transforms: the fp32 definition, which they can differentiate and batch
        say_functorch_fallback("the gated activation")
        return gated_act_reference(gate, up, activation)
    if decompose_under_compile("gated_act", gate):
        # Under torch.compile: the fp32 definition, for Inductor to fuse with the ops around it (_common.py).
        return gated_act_reference(gate, up, activation)
    n = gate.shape[-1]
    training = torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)
    if training and torch.compiler.is_compiling() and plain_when_traced(gate, up):  # (FUSED_MLP_UNDER_COMPILE=kernel)
        warn_once("export:gated_act", "fused_mlp: under torch.export, the gated activation with gradients traces its "
                  "fp32 definition, not the op (see docs/design.md#torchexport)")
        return gated_act_reference(gate, up, activation)
    # Eager, contiguous inputs of any rank: the op allocates h in the caller's shape (no view after the autograd
    # node). Under torch.compile the contiguity test would guard on (possibly unbacked) token counts, and
    # AOTAutograd traces the backward as one graph anyway: rows there.
    compiling = torch.compiler.is_compiling()
    if not compiling and gate.is_contiguous() and up.is_contiguous():
        return _GatedActFunction.apply(gate, up, activation, None) if training else ops.geglu_fwd(gate, up, activation)
    lead = gate.shape[:-1]
    g2 = as_rows(gate, n)
    u2 = as_rows(up, n)
    if training and not compiling:  # strided eager inputs: the Function returns the caller's shape itself
        return _GatedActFunction.apply(g2, u2, activation, gate.shape)
    h = _GatedActFunction.apply(g2, u2, activation, None) if training else ops.geglu_fwd(g2, u2, activation)
    return h.view(*lead, n)


# ---- public API: activations --------------------------------------------------------------------------------


def geglu(gate: torch.Tensor, up: torch.Tensor, *, approximate: str = "tanh") -> torch.Tensor:
    """``gelu(gate, approximate=approximate) * up`` in one pass, fp32 math, one rounding.

    Args:
        gate, up: ``[..., I]``, one shape, one dtype (float32/float16/bfloat16), one device. Rows with unit
            stride along ``I`` are read in place whatever their row stride (``gate, up = x.chunk(2, -1)`` costs
            no copy); other layouts are copied first.
        approximate: ``"tanh"`` (``gelu_pytorch_tanh``, Gemma) or ``"none"`` (exact erf GeLU).
    """
    activation = GELU_APPROXIMATE.get(approximate) if isinstance(approximate, str) else None
    if activation is None:
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    h = _fast(gate, up, activation)
    return h if h is not None else _gated(gate, up, activation)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one pass (Llama/Qwen/Mistral MLPs), fp32 math, one rounding. Args as `geglu`."""
    h = _fast(gate, up, "silu")
    return h if h is not None else _gated(gate, up, "silu")


# ---- fp32 references ---------------------------------------------------------------------------------------


def activation_fn(activation: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The PyTorch function of a gated activation's name (any dtype in, the same dtype out)."""
    if activation == "silu":
        return F.silu
    return functools.partial(F.gelu, approximate="tanh" if activation == "gelu_tanh" else "none")


def gated_act_reference(gate: torch.Tensor, up: torch.Tensor, activation: str, *,
                        compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``act(gate) * up`` with the math in ``compute_dtype`` (fp64 for error studies), rounded once to gate's dtype."""
    out = activation_fn(activation)(gate.to(compute_dtype)) * up.to(compute_dtype)
    return out.to(gate.dtype)


def geglu_reference(gate: torch.Tensor, up: torch.Tensor, *, approximate: str = "tanh",
                    compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Plain-PyTorch definition of :func:`geglu` (math in ``compute_dtype``), rounded to gate's dtype."""
    return gated_act_reference(gate, up, GELU_APPROXIMATE[approximate], compute_dtype=compute_dtype)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor, *,
                     compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Plain-PyTorch definition of :func:`swiglu` (math in ``compute_dtype``), rounded to gate's dtype."""
    return gated_act_reference(gate, up, "silu", compute_dtype=compute_dtype)
