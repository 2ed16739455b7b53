"""RMSNorm: ``y = h * rsqrt(mean(h^2) + eps) * (offset + w)`` with ``h = x (+ residual)``.

Shapes: ``x`` and ``residual`` ``[..., N]``, ``weight`` ``[N]``. The kernels do all math in fp32 and round each
output once; with a residual, ``h`` is rounded to ``residual_dtype`` and exactly that value is normalised (it is
what the residual stream carries). Backward is one pass over the rows for ``dx`` plus per-block fp32 ``dW``
partials reduced in a fixed order (deterministic). Without autograd (inference, ``no_grad``) the call goes
straight to the kernel, skipping the autograd.Function.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from ._common import (
    as_rows,
    check_device,
    check_dtype_arg,
    check_finite,
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

__all__ = ["rms_norm", "rms_norm_reference"]

_INF = float("inf")


# ---- custom ops: fake implementations for torch.compile --------------------------------------------------


@torch.library.register_fake(add_op_namespace_prefix("rms_norm_fwd"))
def _rms_norm_fwd_fake(x, residual, weight, eps, offset, out_dtype, residual_dtype):
    # x: [..., N] (the op views the leading dims as rows); y and h take x's shape, rstd is [rows].
    y = x.new_empty(x.shape, dtype=out_dtype)
    if residual is not None:
        h = x.new_empty(x.shape, dtype=residual_dtype if residual_dtype is not None else x.dtype)
    else:
        h = x.new_empty((0,))
    return y, h, x.new_empty((math.prod(x.shape[:-1]),), dtype=torch.float32)


@torch.library.register_fake(add_op_namespace_prefix("rms_norm_bwd"))
def _rms_norm_bwd_fake(dy, h, rstd, weight, dh_extra, offset, dx_dtype, compute_dw):
    dx = h.new_empty(h.shape, dtype=dx_dtype)
    dw = weight.new_empty(weight.shape) if (compute_dw and weight is not None) else h.new_empty((0,))
    return dx, dw


@torch.library.register_fake(add_op_namespace_prefix("rms_norm_infer"))
def _rms_norm_infer_fake(x, weight, eps, offset, out_f32):
    return x.new_empty(x.shape, dtype=torch.float32 if out_f32 else x.dtype)


@torch.library.register_fake(add_op_namespace_prefix("rms_norm_add_infer"))
def _rms_norm_add_infer_fake(x, residual, weight, eps, offset, out_f32):
    return x.new_empty(x.shape, dtype=torch.float32 if out_f32 else x.dtype), residual.new_empty(x.shape)


# The OpOverloads themselves: calling them skips the OpOverloadPacket's overload resolution (~1 us per call).
_fwd = ops.rms_norm_fwd.default
_bwd = ops.rms_norm_bwd.default
# Inference (no autograd): y alone (add: y and h). The eager fast path calls their C++ entry (`_op`) directly:
# OpOverload.__call__ adds only a Python frame (~0.2 us) for ops without a Python-object dispatcher, as these are.
_infer = ops.rms_norm_infer.default
_add_infer = ops.rms_norm_add_infer.default
_infer_call = getattr(_infer, "_op", _infer)
_add_infer_call = getattr(_add_infer, "_op", _add_infer)
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_F32 = torch.float32
_grad_enabled = torch.is_grad_enabled
# Dynamo's own flag, not torch.compiler.is_compiling (two Python calls, ~0.05 us more per call): the fast paths must
# not run where Dynamo traces; non-strict export and other dispatcher-level tracing see fake or subclass tensors,
# which fail the fast paths' `type(x) is torch.Tensor` check anyway.
_is_compiling = torch.compiler.is_dynamo_compiling
# What an inference op raises on arguments the full path may still accept (or rejects with its own error): a C++
# check (RuntimeError), a schema mismatch (TypeError), a device without a kernel (NotImplementedError).
_FALLBACK_ERRORS = (RuntimeError, TypeError, NotImplementedError)


# ---- autograd ---------------------------------------------------------------------------------------------


def _grad_in(g: torch.Tensor, n: int, base: torch.dtype) -> torch.Tensor:
    """An incoming gradient as kernel rows: [rows, n], unit stride, fp32 or the base dtype (kept uncast)."""
    if g.dtype != base and g.dtype != torch.float32:
        g = g.float()
    return as_rows(g, n)  # grads may be expanded (stride 0) views


class _RMSNormFunction(torch.autograd.Function):
    """Inputs are contiguous ``[..., N]`` (eager: the outputs then have the caller's shape, no view after ``apply``)
    or 2-D rows (under torch.compile, reshaped before ``apply`` so ranks stay stable, and for strided inputs).

    Classic ``forward(ctx, ...)`` form on purpose: with a separate ``setup_context`` torch binds the arguments
    through ``inspect.signature`` on every ``apply`` (~100 us per call on a slow CPU)."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset, out_dtype, residual_dtype):
        y, h, rstd = _fwd(x, residual, weight, eps, offset, out_dtype, residual_dtype)
        ctx.save_for_backward(h if residual is not None else x, rstd, weight)
        ctx.mark_non_differentiable(rstd)
        ctx.set_materialize_grads(False)  # an unused y or h gets no zero-filled gradient tensor
        ctx.offset = offset
        ctx.eps = eps
        ctx.has_residual = residual is not None
        ctx.x_dtype = x.dtype
        ctx.out_dtype = out_dtype
        ctx.residual_dtype = residual.dtype if residual is not None else None
        # fp32 gradients arriving at bf16/fp16 outputs reach the kernel uncast (the kernel reads either).
        declare_grad_dtypes(ctx, None, None, None)
        return y, h, rstd

    @staticmethod
    def backward(ctx, dy, dh, _drstd):
        h, rstd, weight = ctx.saved_tensors
        need_x, need_res, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        if _grad_enabled():  # create_graph=True: a backward that can be differentiated again
            dh_total, dw = _create_graph_grads(ctx, h, weight, dy, (need_x or need_res, need_w))
            if ctx.has_residual and dh is not None:  # h was used downstream: its gradient passes to x and the residual
                dh_total = dh if dh_total is None else dh_total + dh
            dres = dh_total.to(ctx.residual_dtype) if ctx.has_residual and need_res and dh_total is not None else None
            dx_out = dh_total.to(ctx.x_dtype) if need_x and dh_total is not None else None
            return dx_out, dres, dw, None, None, None, None
        if dy is None:  # only h was used downstream
            dy = torch.zeros_like(h, dtype=ctx.out_dtype)
        # dx and d(residual) are the same values; compute them in the wider of the two dtypes, once.
        grad_dtype = ctx.x_dtype
        if ctx.has_residual and need_res and ctx.residual_dtype == torch.float32:
            grad_dtype = torch.float32
        dx, dw = _rms_norm_backward(ctx, dy, dh if ctx.has_residual else None, h, rstd, weight, grad_dtype,
                                    need_w)
        dres = None
        if ctx.has_residual and need_res:
            dres = dx if ctx.residual_dtype == dx.dtype else dx.to(ctx.residual_dtype)
        dx_out = (dx if dx.dtype == ctx.x_dtype else dx.to(ctx.x_dtype)) if need_x else None
        return dx_out, dres, dw, None, None, None, None


class _RMSNormYFunction(torch.autograd.Function):
    """``_RMSNormFunction`` without a residual: y is the only output through autograd (rstd stays in the context),
    which saves the engine's bookkeeping of two outputs per call (host cost of a training forward:
    docs/tuning-log.md#host-path). Same kernels, same bits."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset, out_dtype):
        y, _, rstd = _fwd(x, None, weight, eps, offset, out_dtype, None)
        ctx.save_for_backward(x, rstd, weight)
        ctx.offset = offset
        ctx.eps = eps
        ctx.out_dtype = out_dtype
        ctx.x_dtype = x.dtype
        # An fp32 gradient at a bf16/fp16 y reaches the kernel uncast.
        declare_grad_dtypes(ctx, None, out_dtype=out_dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, rstd, weight = ctx.saved_tensors
        if _grad_enabled():  # create_graph=True: a backward that can be differentiated again
            dx, dw = _create_graph_grads(ctx, x, weight, dy, ctx.needs_input_grad[:2])
            return dx, dw, None, None, None
        dx, dw = _rms_norm_backward(ctx, dy, None, x, rstd, weight, ctx.x_dtype, ctx.needs_input_grad[1])
        return (dx if ctx.needs_input_grad[0] else None), dw, None, None, None


def _create_graph_grads(ctx, h, weight, dy, needs):
    """[d h, d weight] of y = norm(h) (h: x, or x + residual) through the fp32 reference (`reference_backward`)."""
    def ref(h, weight):
        return rms_norm_reference(h, weight, ctx.eps, offset=ctx.offset, out_dtype=ctx.out_dtype)
    return reference_backward("rms_norm", ref, (h, weight), needs, (dy,))


def _rms_norm_backward(ctx, dy, dh, h, rstd, weight, grad_dtype, need_w):
    """dx (in grad_dtype, the caller's shape) and dW (None unless needed) from the saved h (x without a residual)."""
    shape = h.shape  # the caller's [..., N] (eager, contiguous inputs) or 2-D rows
    n = shape[-1]
    h = as_rows(h, n)  # a view: h is contiguous when it is not 2-D already
    base = ctx.x_dtype
    dy = _grad_in(dy, n, base)
    extra = _grad_in(dh, n, base) if dh is not None else None
    compute_dw = bool(need_w and weight is not None)
    dx, dw = _bwd(dy, h, rstd, weight, extra, ctx.offset, grad_dtype, compute_dw)
    if len(shape) != 2:
        dx = dx.view(shape)
    return dx, (dw if compute_dw else None)


def _rows_viewable(t: torch.Tensor, n: int) -> bool:
    """Whether ``t`` ([..., n], unit stride along n) is viewable as [rows, n] without a copy (what reshape would do)."""
    if t.is_contiguous():
        return True
    try:
        t.view(math.prod(t.shape[:-1]), n)
    except RuntimeError:
        return False
    return True


# ---- public API -------------------------------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    residual: torch.Tensor | None = None,
    residual_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of ``x``: ``y = h * rsqrt(mean(h^2) + eps) * (offset + weight)``.

    Args:
        x: ``[..., N]`` float32/float16/bfloat16.
        weight: ``[N]`` or None (no affine scale; ``offset`` is then ignored).
        eps: finite, >= 0.
        offset: added to ``weight`` in fp32; ``offset=1.0`` is Gemma's ``(1 + w)``.
        residual: optional ``[..., N]``; then ``h = x + residual`` rounded to ``residual_dtype``
            (default ``x.dtype``) and ``(y, h)`` is returned.
        residual_dtype: dtype of ``h`` (``torch.float32`` keeps an fp32 residual stream).
        out_dtype: dtype of ``y`` (default ``x.dtype``); the layers pass the transformers module's dtype.
    """
    # Inference fast path (eager, no gradient needed; per-call host cost at decode: docs/tuning-log.md#host-path).
    # The kernel's y (and h) straight from rms_norm_infer(_add), before the checks below: whatever the op rejects
    # (a weight to widen or make contiguous, a layout it cannot view, wrong shapes, mixed devices) raises there,
    # before any work, and takes the full path, which converts it or raises the documented error. What the op cannot
    # check is meta tensors (the dispatcher runs the fake implementation, which checks nothing): excluded, as in the
    # training fast path.
    if (type(x) is _Tensor and not _is_compiling() and type(eps) is float and 0.0 <= eps < _INF
            and type(offset) is float and -_INF < offset < _INF and not x.is_meta
            and (weight is None or (isinstance(weight, _Tensor) and not weight.is_meta))
            and (residual is None or (type(residual) is _Tensor and not residual.is_meta))
            and (not _grad_enabled() or not (x.requires_grad or (weight is not None and weight.requires_grad)
                                             or (residual is not None and residual.requires_grad)))):
        x_dtype = x.dtype
        out_f32 = False if (out_dtype is None or out_dtype is x_dtype) else (True if out_dtype is _F32 else None)
        if out_f32 is not None:
            try:
                if residual is None:
                    if residual_dtype is None:  # else the full path checks it (ignored without a residual)
                        return _infer_call(x, weight, eps, offset, out_f32)
                elif residual.dtype is (x_dtype if residual_dtype is None else residual_dtype):
                    return _add_infer_call(x, residual, weight, eps, offset, out_f32)
            except _FALLBACK_ERRORS:
                pass  # the full path below
    # Training fast path (eager, no residual): contiguous x (or 2-D rows) and a contiguous weight of x's dtype or fp32
    # straight into the Function, whose op checks shapes, dtypes and devices before anything is launched; whatever it
    # rejects takes the full path below (host cost per call: docs/tuning-log.md#host-path).
    elif (residual is None and residual_dtype is None and type(x) is _Tensor and not _is_compiling() and _grad_enabled()
            and not x.is_meta
            and type(eps) is float and 0.0 <= eps < _INF and type(offset) is float and -_INF < offset < _INF
            and (weight is None or ((type(weight) is _Parameter or type(weight) is _Tensor)
                                    and not weight.is_meta and weight.is_contiguous()
                                    and (weight.dtype is x.dtype or weight.dtype is _F32)))
            and (x.is_contiguous() or (x.dim() == 2 and x.stride(1) == 1))):
        x_dtype = x.dtype
        k_out = x_dtype if (out_dtype is None or out_dtype is x_dtype) else (_F32 if out_dtype is _F32 else None)
        if k_out is not None:
            try:
                return _RMSNormYFunction.apply(x, weight, eps, offset, k_out)
            except _FALLBACK_ERRORS:
                pass  # the full path below
    check_tensor(x, "x")
    # The weight's dtype before the other arguments: the layers derive out_dtype from it, so a float64 weight names
    # the weight, not an out_dtype the user never passed.
    if weight is not None:
        check_tensor(weight, "weight")
    # Then cheap checks first (this runs on every call, inference included); anything unusual gets the full check.
    if type(eps) is not float or not (0.0 <= eps < _INF):  # NaN fails the comparison
        eps = check_finite(eps, "eps", nonnegative=True)
    if type(offset) is not float or not (-_INF < offset < _INF):
        offset = check_finite(offset, "offset")
    if residual_dtype is not None:
        check_dtype_arg(residual_dtype, "residual_dtype")
    if out_dtype is not None:
        check_dtype_arg(out_dtype, "out_dtype")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension [..., N]")
    n = x.shape[-1]
    if weight is not None:
        check_device(weight, x, "weight", "x")
        if weight.dim() != 1 or weight.shape[0] != n:
            raise ValueError(f"weight must have shape [{n}] (the last dim of x), got {list(weight.shape)}")
        # The kernels take weights in x's dtype or fp32; any other half type is widened (exact).
        if weight.dtype != x.dtype and weight.dtype != torch.float32:
            weight = weight.float()
        if not weight.is_contiguous():
            weight = weight.contiguous()
    out_dtype = x.dtype if out_dtype is None else out_dtype
    kernel_out_dtype = out_dtype if (out_dtype == x.dtype or out_dtype == torch.float32) else torch.float32

    res2 = None
    h_dtype = None
    if residual is not None:
        check_tensor(residual, "residual")
        check_device(residual, x, "residual", "x")
        if torch.compiler.is_compiling():
            # Token counts may be unbacked symbols (one per input): assert equality for the runtime instead of
            # branching on it.
            torch._check(residual.dim() == x.dim(), lambda: "residual must have the shape of x")
            for a, b in zip(residual.shape, x.shape):
                torch._check(a == b, lambda: "residual must have the shape of x")
        elif residual.shape != x.shape:
            raise ValueError(f"residual must have the shape of x {list(x.shape)}, got {list(residual.shape)}")
        h_dtype = x.dtype if residual_dtype is None else residual_dtype
        if h_dtype != x.dtype and h_dtype != torch.float32:
            raise ValueError(f"residual_dtype must be x's dtype ({x.dtype}) or torch.float32, got {h_dtype}")
        res2 = residual if residual.dtype == h_dtype else residual.to(h_dtype)

    if functorch_active():  # torch.func transforms: the fp32 definition, which they can differentiate and batch
        say_functorch_fallback("rms_norm")
        return rms_norm_reference(x, weight, eps, offset=offset, residual=res2, residual_dtype=h_dtype,
                                  out_dtype=out_dtype)
    if decompose_under_compile("rms_norm", x):
        # Under torch.compile: the fp32 definition, for Inductor to fuse with the ops around it (_common.py).
        return rms_norm_reference(x, weight, eps, offset=offset, residual=res2, residual_dtype=h_dtype,
                                  out_dtype=out_dtype)

    if torch.is_grad_enabled() and (
        x.requires_grad
        or (weight is not None and weight.requires_grad)
        or (residual is not None and residual.requires_grad)
    ):
        if torch.compiler.is_compiling() and plain_when_traced(x, res2, weight):  # (FUSED_MLP_UNDER_COMPILE=kernel)
            warn_once("export:rms_norm", "fused_mlp: under torch.export, rms_norm with gradients traces its fp32 "
                      "definition, not the op (see docs/design.md#torchexport)")
            return rms_norm_reference(x, weight, eps, offset=offset, residual=res2, residual_dtype=h_dtype,
                                      out_dtype=out_dtype)
        if x.dim() != 2 and not torch.compiler.is_compiling():
            # Eager, any rank but 2: the op takes [..., N] and allocates y and h in the caller's shape.
            # A view taken after `apply` would put a ViewBackward node in front of the Function, where the engine
            # casts an fp32 incoming gradient to y's dtype (defeating set_output_grad_dtype). Strided rows go in as
            # they are (the op views them as rows, or copies a layout it cannot view), as on the inference path: the
            # same kernel, so the same bits; only a non-unit stride along N is copied here. Without a residual the
            # Function saves x for backward: a layout the op could not view as rows is copied once here, not twice
            # (in the op's forward and again as rows in backward).
            if (n > 1 and x.stride(-1) != 1) or (res2 is None and not _rows_viewable(x, n)):
                x = x.contiguous()
            if res2 is not None and n > 1 and res2.stride(-1) != 1:
                res2 = res2.contiguous()
            if res2 is None:
                y = _RMSNormYFunction.apply(x, weight, eps, offset, kernel_out_dtype)
            else:
                y, h, _ = _RMSNormFunction.apply(x, res2, weight, eps, offset, kernel_out_dtype, h_dtype)
        else:
            # 2-D inputs (any row stride: the kernels read it in place; y already has x's shape) and torch.compile
            # (stable ranks; AOTAutograd traces the backward as one graph anyway): 2-D rows into the Function.
            x2 = as_rows(x, n)
            if res2 is not None:
                res2 = as_rows(res2, n)
            if res2 is None:
                y = _RMSNormYFunction.apply(x2, weight, eps, offset, kernel_out_dtype)
            else:
                y, h, _ = _RMSNormFunction.apply(x2, res2, weight, eps, offset, kernel_out_dtype, h_dtype)
            if x.dim() != 2:
                y = y.view(x.shape)
                if residual is not None:
                    h = h.view(x.shape)
    else:
        # Inference: straight to the kernel, through the ops that return y (and h) only. They take [..., N]
        # themselves (viewing the rows in C++ is far cheaper than a reshape and a view here); only non-viewable
        # layouts are made contiguous first. x and the residual go in together: both as they are, or both as 2-D
        # rows (the op wants one shape).
        out_f32 = kernel_out_dtype == torch.float32
        x_in = x
        if not (((x.dim() == 2 and (n <= 1 or x.stride(1) == 1)) or x.is_contiguous()) and (
            res2 is None or (res2.dim() == 2 and (n <= 1 or res2.stride(1) == 1)) or res2.is_contiguous()
        )):
            x = as_rows(x, n)
            res2 = None if res2 is None else as_rows(res2, n)
        if res2 is None:
            y = _infer(x, weight, eps, offset, out_f32)
        else:
            y, h = _add_infer(x, res2, weight, eps, offset, out_f32)
        if x is not x_in and x_in.dim() != 2:
            y = y.view(x_in.shape)
            h = h.view(x_in.shape) if residual is not None else None
    if y.dtype != out_dtype:
        y = y.to(out_dtype)
    if residual is None:
        return y
    return y, h


def _rms_norm_layer_call(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                         out_dtype: torch.dtype) -> torch.Tensor:
    """``rms_norm(x, weight, eps, offset=offset, out_dtype=out_dtype)`` for the layers (plain tensors, no residual;
    ``offset`` a finite float): positional, with the inference fast path of rms_norm inline (one Python frame less
    per norm per token: docs/tuning-log.md#host-path)."""
    if (type(x) is _Tensor and not _is_compiling() and type(eps) is float and 0.0 <= eps < _INF
            and not x.is_meta and not weight.is_meta
            and (not _grad_enabled() or not (x.requires_grad or weight.requires_grad))):
        x_dtype = x.dtype
        out_f32 = False if out_dtype is x_dtype else (True if out_dtype is _F32 else None)
        if out_f32 is not None:
            try:
                return _infer_call(x, weight, eps, offset, out_f32)
            except _FALLBACK_ERRORS:
                pass  # rms_norm's full path
    return rms_norm(x, weight, _module_eps(eps), offset=offset, out_dtype=out_dtype)


def _module_eps(eps: Any) -> Any:
    """A module's eps as the Python float `rms_norm` takes: a transformers module may hold a numpy scalar or a
    one-element tensor (its own forward adds it to a tensor), which the layers' swap must not turn into an error.
    Anything else is returned as it is, for `rms_norm` to reject."""
    if type(eps) is float or isinstance(eps, bool):
        return eps
    if isinstance(eps, numbers.Real) or (isinstance(eps, torch.Tensor) and eps.numel() == 1
                                         and eps.is_floating_point()):
        return float(eps)
    return eps


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    residual: torch.Tensor | None = None,
    residual_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch definition (math in ``compute_dtype``, fp32 by default; fp64 for error studies)."""
    h = x
    if residual is not None:
        rd = residual_dtype if residual_dtype is not None else x.dtype
        h = x.to(rd) + residual.to(rd)
    hf = h.to(compute_dtype)
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (offset + weight.to(compute_dtype))
    y = y.to(out_dtype if out_dtype is not None else x.dtype)
    return (y, h) if residual is not None else y

