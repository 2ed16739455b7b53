"""The gated MLP ``y = down(act(gate_proj(x)) * up_proj(x))`` (GeGLU: Gemma; SwiGLU: Llama/Qwen/Mistral).

It runs its three projections through cuBLAS (``F.linear``/``torch.mm``, bias in the GEMM) and the fused activation
(``geglu.py``'s op) between them; on sm_90 the gate/up GEMMs and the activation (forward), and the dh GEMM and
the activation's backward, instead run as GEMMs with the activation in their epilogue where the measured dispatch
table says it is faster (``_epilogue.py``). In training it saves ``x``, ``gate`` and ``up`` only (not ``h``); its
backward computes ``dh = dy @ W_down`` and then one in-place kernel that writes ``h`` into ``dh``'s buffer
(for ``dW_down = dy^T h``), ``dgate`` into ``gate``'s and ``dup`` into ``up``'s: the largest live set in backward
is ``gate, up, dh`` (3 x [T, I]) plus one weight gradient. Where both passes run the epilogue GEMMs it saves ``x``,
``h``, ``P = up act'(gate)`` and ``Q = act(gate)`` instead (one [T, I] more), and the backward GEMM's epilogue
writes ``dgate = dh P`` over P and ``dup = dh Q`` over Q; eagerly h's memory is given back once dW_down is computed, so
the weight gradients (the backward's peak) see 2 x [T, I].
Numerics: fp32 accumulation and activation math, each stored tensor rounded once.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import _decode, _epilogue
from ._common import (
    GATED_ACTIVATIONS,
    autocast_dtype,
    check_device,
    check_tensor,
    functorch_active,
    plain_when_traced,
    reference_backward,
    say_functorch_fallback,
    warn_once,
)
from ._ops import add_op_namespace_prefix, ops
from .geglu import activation_fn, gated_act

__all__ = ["gated_mlp", "gated_mlp_reference"]

_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _no_saved_tensor_hooks() -> bool:
    """No saved-tensor hooks are active (torch.utils.checkpoint's own test; private, so unknown = hooks may be)."""
    try:
        return _top_hooks is not None and _top_hooks(False) is None
    except TypeError:  # an older signature
        return False


try:  # private engine query: does the running backward keep the graph (retain_graph=True)?
    from torch._C._autograd import _get_current_graph_task_keep_graph as _keep_graph
except ImportError:  # pragma: no cover - torch without it: assume it may (never overwrite saved buffers)
    def _keep_graph() -> bool:
        return True


# ---- custom ops: fake implementations for torch.compile (kernels_src/cuda/gated_gemm_sm90.cu) --------------


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
        # Eager, no saved-tensor hooks (offloading, non-reentrant checkpointing): the saved h is this Function's own
        # tensor, so backward may give its memory back once dW_down is done instead of when backward returns ([T, I]
        # off the backward's peak, which comes with dW_gate / dW_up).
        ctx.free_h = (type(h_saved) is torch.Tensor and not torch.compiler.is_compiling()  # not a subclass's storage
                      and _no_saved_tensor_hooks())
        ctx.save_for_backward(x, w_gate, w_up, w_down, gate, up, h_saved)
        ctx.activation = activation
        ctx.biases = (b_gate, b_up, b_down)  # which exist; backward under create_graph=True reads them (no saving)
        # No declare_grad_dtypes: backward starts with GEMMs in the weights' dtype (dy @ W_down, dy.T @ h), so an fp32
        # gradient at a 16-bit output is rounded once to that dtype, as eager's does (the engine's cast, not ours).
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w_gate, w_up, w_down, gate, up, h = ctx.saved_tensors  # gate, up: P, Q when h was saved
        need = ctx.needs_input_grad
        b_gate, b_up, b_down = ctx.biases
        if torch.is_grad_enabled():  # create_graph=True: a backward that can be differentiated again
            dx, d_w_gate, d_w_up, d_w_down, d_b_gate, d_b_up, d_b_down = reference_backward(
                "gated_mlp", lambda *t: gated_mlp_reference(*t, activation=ctx.activation),
                (x, w_gate, w_up, w_down, b_gate, b_up, b_down),
                (need[0], need[1], need[3], need[5], need[2], need[4], need[6]), (dy,))
            return dx, d_w_gate, d_b_gate, d_w_up, d_b_up, d_w_down, d_b_down, None
        if dy.dtype != x.dtype:  # the GEMMs need one dtype (the engine casts the gradient to y's, normally x's)
            dy = dy.to(x.dtype)
        keep = not torch.compiler.is_compiling() and _keep_graph()
        if keep:
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
        d_b_down = dy.sum(0) if (need[6] and b_down is not None) else None
        if ctx.free_h and not keep and not torch.compiler.is_compiling():
            h.untyped_storage().resize_(0)  # stream-ordered, as a freed tensor: the GEMM above still reads it
        del h
        dx = None
        if need[0]:
            dx = torch.mm(dgate, w_gate)
            dx.addmm_(dup, w_up)  # the second product is added in the GEMM (dx: two roundings, as in eager)
        d_w_gate = torch.mm(dgate.t(), x) if need[1] else None
        d_b_gate = dgate.sum(0) if (need[2] and b_gate is not None) else None
        d_w_up = torch.mm(dup.t(), x) if need[3] else None
        d_b_up = dup.sum(0) if (need[4] and b_up is not None) else None
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
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(f"activation must be one of {GATED_ACTIVATIONS}, got {activation!r}")
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
        if functorch_active():  # torch.func transforms: the plain GEMMs around the activation's fp32 definition
            say_functorch_fallback("gated_mlp")
            return F.linear(gated_act(F.linear(x, w_gate, b_gate), F.linear(x, w_up, b_up), activation), w_down,
                            b_down)
        if torch.compiler.is_compiling() and plain_when_traced(x, w_gate, w_up, w_down, b_gate, b_up, b_down):
            # The plain model's GEMMs and the activation's decomposition, which autograd differentiates.
            warn_once("traced:gated_mlp", "fused_mlp: under torch.export, gated_mlp with gradients traces the plain "
                      "GEMMs and the activation's decomposition, not the fused ops (see docs/design.md#torchexport)")
            return F.linear(gated_act(F.linear(x, w_gate, b_gate), F.linear(x, w_up, b_up), activation), w_down,
                            b_down)
        lead = x.shape[:-1]
        # The row count spelled out: reshape(-1, 0) is ambiguous for H = 0.
        y = _GatedMLPFunction.apply(x.reshape(math.prod(lead), x.shape[-1]), w_gate, b_gate, w_up, b_up, w_down,
                                    b_down, activation)
        return y.view(*lead, y.shape[-1])
    if autocast is None and _decode.use_decode(x, w_gate, w_up, w_down, b_gate, b_up, b_down):
        # decode sizes (few tokens): the whole MLP as one op of two GEMV-class kernels (x is contiguous: a view)
        lead = x.shape[:-1]
        y = ops.gated_mlp_decode(x.view(lead.numel(), x.shape[-1]), w_gate, w_up, w_down, activation)
        return y.view(*lead, w_down.shape[0])
    if autocast is None and torch.compiler.is_compiling():
        # a symbolic token count: the decode kernels or the GEMM path, chosen by T at run time (no guard, no recompile)
        limit = _decode.runtime_limit(x, w_gate, w_up, w_down, b_gate, b_up, b_down)
        if limit:
            y = ops.gated_mlp_auto(x.reshape(-1, x.shape[-1]), w_gate, w_up, w_down, activation, limit)
            return y.view(*x.shape[:-1], w_down.shape[0])
    # Inference: three GEMMs and one activation kernel on the projections' own (contiguous, any-rank) outputs.
    # Under autocast, F.linear casts its operands itself (with autocast's weight-cast cache), as in the module.
    if autocast is None and _epilogue.use_fwd(x, w_gate, w_up, b_gate, b_up):
        # one dual-B GEMM, the activation in its epilogue (x is contiguous: the reshape is a view)
        h = ops.gated_gemm_fwd(x.reshape(-1, x.shape[-1]), w_gate, w_up, activation, False)[0]
        return F.linear(h, w_down, b_down).view(*x.shape[:-1], w_down.shape[0])
    return F.linear(gated_act(F.linear(x, w_gate, b_gate), F.linear(x, w_up, b_up), activation), w_down, b_down)


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


# ---- fp32 reference ---------------------------------------------------------------------------------------


def gated_mlp_reference(x, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None, *,
                        activation: str = "gelu_tanh", compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The MLP with every step in ``compute_dtype`` (default fp32), rounded once to x's dtype at the end."""
    def c(t):
        return None if t is None else t.to(compute_dtype)

    xc = c(x)
    h = activation_fn(activation)(F.linear(xc, c(w_gate), c(b_gate))) * F.linear(xc, c(w_up), c(b_up))
    return F.linear(h, c(w_down), c(b_down)).to(x.dtype)
