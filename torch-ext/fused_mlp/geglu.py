"""Gated activations ``h = act(gate) * up`` (GeGLU: tanh- or erf-GeLU; SwiGLU: SiLU) and the gated MLP
``y = down(act(gate_proj(x)) * up_proj(x))`` built on them.

Shapes: ``gate`` and ``up`` ``[..., I]`` with one dtype (unit stride along ``I``, any row stride: the two halves of
one ``[..., 2I]`` tensor work without a copy); the result is ``[..., I]`` contiguous. Numerics: fp32 math, each
output rounded once. Backward takes ``dh`` in fp32 or the output's dtype and recomputes the activation from
``gate`` (nothing but ``gate`` and ``up`` is saved).

The MLP (``gated_mlp``) runs its three projections through cuBLAS (``F.linear``/``torch.mm``, bias in the GEMM)
and the fused activation between them; on sm_90 the gate/up GEMMs and the activation (forward), and the dh GEMM and
the activation's backward, instead run as GEMMs with the activation in their epilogue where the measured dispatch
table says it is faster (``_epilogue.py``). In training it saves ``x``, ``gate`` and ``up`` only (not ``h``); its
backward computes ``dh = dy @ W_down`` and then one in-place kernel that writes ``h`` into ``dh``'s buffer
(for ``dW_down = dy^T h``), ``dgate`` into ``gate``'s and ``dup`` into ``up``'s: the largest live set in backward
is ``gate, up, dh`` (3 x [T, I]) plus one weight gradient. Where both passes run the epilogue GEMMs it saves ``x``,
``h``, ``P = up act'(gate)`` and ``Q = act(gate)`` instead (one [T, I] more), and the backward GEMM's epilogue
writes ``dgate = dh P`` over P and ``dup = dh Q`` over Q (the live set in backward is again 3 x [T, I]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _decode, _epilogue
from ._common import autocast_dtype, check_device, check_tensor, declare_grad_dtypes
from ._ops import add_op_namespace_prefix, ops

__all__ = ["geglu", "swiglu", "gated_mlp", "geglu_reference", "swiglu_reference", "gated_mlp_reference"]

# Kernel activation names; `geglu(approximate=...)` maps onto the first two.
ACTIVATIONS = ("gelu_tanh", "gelu", "silu")
_GELU_APPROXIMATE = {"tanh": "gelu_tanh", "none": "gelu"}

try:  # private engine query: does the running backward keep the graph (retain_graph=True)?
    from torch._C._autograd import _get_current_graph_task_keep_graph as _keep_graph
except ImportError:  # pragma: no cover - torch without it: assume it may (never overwrite saved buffers)
    def _keep_graph() -> bool:
        return True


def _as_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """[..., n] -> [rows, n] with unit stride along n, a view where the strides allow it (any row stride).
    The row count is spelled out so that n == 0 works too (reshape(-1, 0) is ambiguous)."""
    t2 = t.reshape(t.shape[:-1].numel(), n)
    if n > 1 and t2.stride(1) != 1:
        t2 = t2.contiguous()
    return t2


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


@torch.library.register_fake(add_op_namespace_prefix("gated_gemm_fwd"))
def _gated_gemm_fwd_fake(x, w_gate, w_up, activation, save_preact):
    t, i = x.shape[0], w_gate.shape[0]
    saved = (t, i) if save_preact else (0, 0)
    return x.new_empty((t, i)), x.new_empty(saved), x.new_empty(saved)


@torch.library.register_fake(add_op_namespace_prefix("gated_gemm_bwd_"))
def _gated_gemm_bwd_inplace_fake(dy, w_down, gate, up, activation):
    return gate.new_empty(gate.shape)


@torch.library.register_fake(add_op_namespace_prefix("gated_gemm_fwd_slopes"))
def _gated_gemm_fwd_slopes_fake(x, w_gate, w_up, activation):
    t, i = x.shape[0], w_gate.shape[0]
    return x.new_empty((t, i)), x.new_empty((t, i)), x.new_empty((t, i))


@torch.library.register_fake(add_op_namespace_prefix("gated_gemm_bwd_slopes_"))
def _gated_gemm_bwd_slopes_inplace_fake(dy, w_down, p, q):
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
        h = ops.geglu_fwd(gate, up, activation)
        if shape is not None and h.shape != shape:
            # Rows of a strided [..., I] input (eager): hand back the caller's shape from here, as a tensor of its
            # own (detached: a view returned from a Function refuses in-place ops; h is not saved, so nothing else
            # refers to the rows).
            h = h.view(shape).detach()
        ctx.save_for_backward(gate, up)
        ctx.activation = activation
        # An fp32 gradient arriving at a bf16/fp16 h reaches the kernel uncast (it reads fp32 or h's dtype).
        declare_grad_dtypes(ctx, None)
        return h

    @staticmethod
    def backward(ctx, dh):
        gate, up = ctx.saved_tensors
        n = gate.shape[-1]
        dh = _as_rows(dh, n)  # rows; dh may arrive as an expanded (stride-0) or transposed view
        if dh.dtype != gate.dtype and dh.dtype != torch.float32:
            dh = dh.to(gate.dtype)
        dgate, dup = ops.geglu_bwd(dh, _as_rows(gate, n), _as_rows(up, n), ctx.activation)
        shape = gate.shape
        return (
            dgate.view(shape) if ctx.needs_input_grad[0] else None,
            dup.view(shape) if ctx.needs_input_grad[1] else None,
            None,
            None,
        )


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
    n = gate.shape[-1]
    training = torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)
    # Eager, contiguous inputs of any rank: the op allocates h in the caller's shape (no view after the autograd
    # node). Under torch.compile the contiguity test would guard on (possibly unbacked) token counts, and
    # AOTAutograd traces the backward as one graph anyway: rows there.
    compiling = torch.compiler.is_compiling()
    if not compiling and gate.is_contiguous() and up.is_contiguous():
        return _GatedActFunction.apply(gate, up, activation, None) if training else ops.geglu_fwd(gate, up, activation)
    lead = gate.shape[:-1]
    g2 = _as_rows(gate, n)
    u2 = _as_rows(up, n)
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
    activation = _GELU_APPROXIMATE.get(approximate) if isinstance(approximate, str) else None
    if activation is None:
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    return _gated(gate, up, activation)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one pass (Llama/Qwen/Mistral MLPs), fp32 math, one rounding. Args as `geglu`."""
    return _gated(gate, up, "silu")


# ---- autograd: the whole MLP -------------------------------------------------------------------------------


class _GatedMLPFunction(torch.autograd.Function):
    """``down(act(x W_g^T + b_g) * (x W_u^T + b_u))`` on 2-D ``x`` ``[T, H]``. Saves x, gate, up (not h); or, where
    both passes run the sm_90 gated-epilogue GEMMs (``_epilogue.use_slopes``), x, h, ``P = up act'(gate)`` and
    ``Q = act(gate)``, so that the backward's epilogue is two multiplies per element and writes no h."""

    @staticmethod
    def forward(ctx, x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation):
        h_saved = None
        if _epilogue.use_slopes(x, w_gate, w_up, w_down, b_gate, b_up):
            # one dual-B GEMM, act and act' in its epilogue: h, P, Q; h is kept for dW_down
            h, gate, up = ops.gated_gemm_fwd_slopes(x, w_gate, w_up, activation)
            h_saved = h
        elif _epilogue.use_fwd(x, w_gate, w_up, b_gate, b_up, training=True):  # act in the dual-B GEMM's epilogue
            h, gate, up = ops.gated_gemm_fwd(x, w_gate, w_up, activation, True)
        else:
            gate = F.linear(x, w_gate, b_gate)
            up = F.linear(x, w_up, b_up)
            h = ops.geglu_fwd(gate, up, activation)
        y = F.linear(h, w_down, b_down)
        # Unless it is the slopes form, h is dropped here; backward rebuilds it (from gate, up) inside dh's buffer.
        ctx.save_for_backward(x, w_gate, w_up, w_down, gate, up, h_saved)
        ctx.activation = activation
        ctx.has_bias = (b_gate is not None, b_up is not None, b_down is not None)
        declare_grad_dtypes(ctx, None)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, w_gate, w_up, w_down, gate, up, h = ctx.saved_tensors  # gate, up: P, Q when h was saved
        need = ctx.needs_input_grad
        if dy.dtype != x.dtype:  # an fp32 gradient at a bf16/fp16 output: the GEMMs need one dtype
            dy = dy.to(x.dtype)
        if not torch.compiler.is_compiling() and _keep_graph():
            # retain_graph=True: this backward may run again, so the saved gate/up (P/Q) must survive it; work on
            # copies (rare path). Under torch.compile the saved activations are donated to the backward graph
            # (AOTAutograd refuses retain_graph there), so the in-place form is always right.
            gate, up = gate.clone(), up.clone()
        if h is not None:
            # Slopes form: dh = dy @ W_down stays in the GEMM's fp32 accumulators; its epilogue writes dgate = dh P
            # over P and dup = dh Q over Q. The forward chose this form only where this kernel runs (sm_90, 16-bit,
            # sizes); dy's layout is the one thing the forward could not see, so it is made one the kernel takes
            # (a [T, H] copy, 1/I of the GEMM's bytes, in the rare case that it is not already).
            if not dy.is_contiguous() or (not torch.compiler.is_compiling() and dy.data_ptr() % 16):
                dy = dy.clone(memory_format=torch.contiguous_format)
            ops.gated_gemm_bwd_slopes_(dy, w_down, gate, up)
        elif _epilogue.use_bwd(dy, w_down, gate, up):
            # dh = dy @ W_down stays in the GEMM's fp32 accumulators; its epilogue writes h and, over gate/up,
            # dgate/dup.
            h = ops.gated_gemm_bwd_(dy, w_down, gate, up, ctx.activation)
        else:
            h = torch.mm(dy, w_down)  # dh [T, I]
            ops.geglu_bwd_(h, gate, up, ctx.activation)  # dh <- h, gate <- dgate, up <- dup (one pass)
        dgate, dup = gate, up
        d_w_down = torch.mm(dy.t(), h) if need[5] else None
        d_b_down = dy.sum(0) if (need[6] and ctx.has_bias[2]) else None
        del h
        dx = None
        if need[0]:
            dx = torch.mm(dgate, w_gate)
            dx.addmm_(dup, w_up)  # the second product is added in the GEMM (dx: two roundings, as in eager)
        d_w_gate = torch.mm(dgate.t(), x) if need[1] else None
        d_b_gate = dgate.sum(0) if (need[2] and ctx.has_bias[0]) else None
        d_w_up = torch.mm(dup.t(), x) if need[3] else None
        d_b_up = dup.sum(0) if (need[4] and ctx.has_bias[1]) else None
        return dx, d_w_gate, d_b_gate, d_w_up, d_b_up, d_w_down, d_b_down, None


def gated_mlp(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    *,
    activation: str = "gelu_tanh",
) -> torch.Tensor:
    """``F.linear(act(F.linear(x, w_gate, b_gate)) * F.linear(x, w_up, b_up), w_down, b_down)``.

    Args:
        x: ``[..., H]``. w_gate, w_up: ``[I, H]``; w_down: ``[H_out, I]``; biases ``[I]``/``[H_out]`` or None.
            One dtype (float32/float16/bfloat16) and one device; under ``torch.autocast`` all are cast to the
            autocast dtype first, as ``F.linear`` would cast them.
        activation: ``"gelu_tanh"``, ``"gelu"`` (erf) or ``"silu"``.
    Without autograd (no_grad / inference_mode / nothing requires grad) no autograd node is built at all.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    cast = autocast_dtype(x)
    _check_mlp_args(x, w_gate, w_up, w_down, b_gate, b_up, b_down, cast)
    return _gated_mlp(x, w_gate, w_up, w_down, b_gate, b_up, b_down, activation, cast)


def _gated_mlp(x, w_gate, w_up, w_down, b_gate, b_up, b_down, activation: str,
               autocast: torch.dtype | None) -> torch.Tensor:
    """`gated_mlp` without argument checks (the layer checks what it needs itself: decode is latency-bound)."""
    if torch.is_grad_enabled() and (
        x.requires_grad or w_gate.requires_grad or w_up.requires_grad or w_down.requires_grad
        or (b_gate is not None and b_gate.requires_grad) or (b_up is not None and b_up.requires_grad)
        or (b_down is not None and b_down.requires_grad)
    ):
        if autocast is not None:
            # Cast once, outside the autograd Function, as autocast casts each F.linear's operands; the casts
            # are differentiable (fp32 master weights get fp32 grads) and backward runs in one dtype.
            dtype = autocast
            x, w_gate, w_up, w_down = x.to(dtype), w_gate.to(dtype), w_up.to(dtype), w_down.to(dtype)
            b_gate = b_gate.to(dtype) if b_gate is not None else None
            b_up = b_up.to(dtype) if b_up is not None else None
            b_down = b_down.to(dtype) if b_down is not None else None
        lead = x.shape[:-1]
        y = _GatedMLPFunction.apply(x.reshape(-1, x.shape[-1]), w_gate, b_gate, w_up, b_up, w_down, b_down,
                                    activation)
        return y.view(*lead, y.shape[-1])
    if autocast is None and _decode.use_decode(x, w_gate, w_up, w_down, b_gate, b_up, b_down):
        # decode sizes (T <= 64): the whole MLP as one op of two GEMV-class kernels (x is contiguous: a view)
        lead = x.shape[:-1]
        y = ops.gated_mlp_decode(x.view(lead.numel(), x.shape[-1]), w_gate, w_up, w_down, activation)
        return y.view(*lead, w_down.shape[0])
    # Inference: three GEMMs and one activation kernel on the projections' own (contiguous, any-rank) outputs.
    # Under autocast, F.linear casts its operands itself (with autocast's weight-cast cache), as in the module.
    if autocast is None and _epilogue.use_fwd(x, w_gate, w_up, b_gate, b_up):
        # one dual-B GEMM, the activation in its epilogue (x is contiguous: the reshape is a view)
        h = ops.gated_gemm_fwd(x.reshape(-1, x.shape[-1]), w_gate, w_up, activation, False)[0]
        return F.linear(h, w_down, b_down).view(*x.shape[:-1], w_down.shape[0])
    return F.linear(ops.geglu_fwd(F.linear(x, w_gate, b_gate), F.linear(x, w_up, b_up), activation), w_down, b_down)


def _check_mlp_args(x, w_gate, w_up, w_down, b_gate, b_up, b_down, cast: torch.dtype | None) -> None:
    """Shapes and dtypes, before anything is launched (F.linear would only complain half-way through)."""
    check_tensor(x, "x")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension [..., H]")
    for w, name in ((w_gate, "w_gate"), (w_up, "w_up"), (w_down, "w_down")):
        check_tensor(w, name)
        check_device(w, x, name, "x")
        if w.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {list(w.shape)}")
    i, h = w_gate.shape
    if x.shape[-1] != h:
        raise ValueError(f"x's last dim ({x.shape[-1]}) must match w_gate's in_features ({h})")
    if w_up.shape != w_gate.shape:
        raise ValueError(f"w_up must have w_gate's shape {list(w_gate.shape)}, got {list(w_up.shape)}")
    if w_down.shape[1] != i:
        raise ValueError(f"w_down must have shape [H_out, {i}], got {list(w_down.shape)}")
    for b, n, name in ((b_gate, i, "b_gate"), (b_up, i, "b_up"), (b_down, w_down.shape[0], "b_down")):
        if b is not None:
            check_tensor(b, name)
            check_device(b, x, name, "x")
            if b.shape != (n,):
                raise ValueError(f"{name} must have shape [{n}], got {list(b.shape)}")
    if cast is None:
        dts = {x.dtype, w_gate.dtype, w_up.dtype, w_down.dtype}
        dts.update(b.dtype for b in (b_gate, b_up, b_down) if b is not None)
        if len(dts) != 1:
            raise TypeError(f"x, weights and biases must share one dtype (or run under torch.autocast), got x "
                            f"{x.dtype}, w_gate {w_gate.dtype}, w_up {w_up.dtype}, w_down {w_down.dtype}")


# ---- fp32 references ---------------------------------------------------------------------------------------


def geglu_reference(gate: torch.Tensor, up: torch.Tensor, *, approximate: str = "tanh",
                    compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Plain-PyTorch definition (math in ``compute_dtype``; fp64 for error studies), rounded to gate's dtype."""
    out = F.gelu(gate.to(compute_dtype), approximate=approximate) * up.to(compute_dtype)
    return out.to(gate.dtype)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor, *,
                     compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    out = F.silu(gate.to(compute_dtype)) * up.to(compute_dtype)
    return out.to(gate.dtype)


def gated_mlp_reference(x, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None, *,
                        activation: str = "gelu_tanh", compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The MLP with every step in ``compute_dtype`` (default fp32), rounded once to x's dtype at the end."""
    def c(t):
        return None if t is None else t.to(compute_dtype)

    xc = c(x)
    gate = F.linear(xc, c(w_gate), c(b_gate))
    up = F.linear(xc, c(w_up), c(b_up))
    if activation == "silu":
        h = F.silu(gate) * up
    else:
        h = F.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none") * up
    return F.linear(h, c(w_down), c(b_down)).to(x.dtype)
