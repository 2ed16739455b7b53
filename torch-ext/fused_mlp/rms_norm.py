"""RMSNorm: ``y = h * rsqrt(mean(h^2) + eps) * (offset + w)`` with ``h = x (+ residual)``.

Shapes: ``x`` and ``residual`` ``[..., N]``, ``weight`` ``[N]``. The kernels do all math in fp32 and round each
output once; with a residual, ``h`` is rounded to ``residual_dtype`` and exactly that value is normalised (it is
what the residual stream carries). Backward is one pass over the rows for ``dx`` plus per-block fp32 ``dW``
partials reduced in a fixed order (deterministic).
"""

from __future__ import annotations

import torch

from ._common import (
    as_rows,
    check_device,
    check_dtype_arg,
    check_finite,
    check_tensor,
    declare_grad_dtypes,
)
from ._ops import add_op_namespace_prefix, ops

__all__ = ["rms_norm", "rms_norm_reference"]


# ---- custom ops: fake implementations for torch.compile --------------------------------------------------


@torch.library.register_fake(add_op_namespace_prefix("rms_norm_fwd"))
def _rms_norm_fwd_fake(x, residual, weight, eps, offset, out_dtype, residual_dtype):
    m, n = x.shape
    y = x.new_empty((m, n), dtype=out_dtype)
    if residual is not None:
        h = x.new_empty((m, n), dtype=residual_dtype if residual_dtype is not None else x.dtype)
    else:
        h = x.new_empty((0,))
    return y, h, x.new_empty((m,), dtype=torch.float32)


@torch.library.register_fake(add_op_namespace_prefix("rms_norm_bwd"))
def _rms_norm_bwd_fake(dy, h, rstd, weight, dh_extra, offset, dx_dtype, compute_dw):
    dx = h.new_empty(h.shape, dtype=dx_dtype)
    dw = weight.new_empty(weight.shape) if (compute_dw and weight is not None) else h.new_empty((0,))
    return dx, dw


# ---- autograd ---------------------------------------------------------------------------------------------


class _RMSNormFunction(torch.autograd.Function):
    """Inputs are already 2-D rows (reshaped before ``apply`` so ranks stay stable under torch.compile)."""

    @staticmethod
    def forward(x, residual, weight, eps, offset, out_dtype, residual_dtype):
        return ops.rms_norm_fwd(x, residual, weight, eps, offset, out_dtype, residual_dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, residual, weight, eps, offset, out_dtype, residual_dtype = inputs
        _, h, rstd = output
        ctx.save_for_backward(h if residual is not None else x, rstd, weight)
        ctx.mark_non_differentiable(rstd)
        ctx.offset = offset
        ctx.has_residual = residual is not None
        ctx.x_dtype = x.dtype
        ctx.residual_dtype = residual.dtype if residual is not None else None
        # fp32 gradients arriving at bf16/fp16 outputs reach the kernel uncast (the kernel reads either).
        declare_grad_dtypes(ctx, None, None, None)

    @staticmethod
    def backward(ctx, dy, dh, _drstd):
        h, rstd, weight = ctx.saved_tensors
        n = h.shape[1]
        dy = as_rows(dy, n)  # incoming grads may be expanded (stride 0) views
        if dh is not None and ctx.has_residual:
            dh = as_rows(dh, n)
        need_x, need_res, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        # dx and d(residual) are the same values; compute them in the wider of the two dtypes, once.
        grad_dtype = ctx.x_dtype
        if ctx.has_residual and need_res and ctx.residual_dtype == torch.float32:
            grad_dtype = torch.float32
        dx, dw = ops.rms_norm_bwd(
            dy, h, rstd, weight, dh if ctx.has_residual else None, ctx.offset, grad_dtype,
            bool(need_w and weight is not None),
        )
        dres = None
        if ctx.has_residual and need_res:
            dres = dx if ctx.residual_dtype == dx.dtype else dx.to(ctx.residual_dtype)
        dx_out = (dx if dx.dtype == ctx.x_dtype else dx.to(ctx.x_dtype)) if need_x else None
        return dx_out, dres, (dw if need_w else None), None, None, None, None


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
    check_tensor(x, "x")
    eps = check_finite(eps, "eps", nonnegative=True)
    offset = check_finite(offset, "offset")
    check_dtype_arg(residual_dtype, "residual_dtype")
    check_dtype_arg(out_dtype, "out_dtype")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension [..., N]")
    n = x.shape[-1]
    if weight is not None:
        check_tensor(weight, "weight")
        check_device(weight, x, "weight", "x")
        if weight.dim() != 1 or weight.shape[0] != n:
            raise ValueError(f"weight must have shape [{n}] (the last dim of x), got {list(weight.shape)}")
        # The kernels take weights in x's dtype or fp32; any other half type is widened (exact).
        if weight.dtype not in (x.dtype, torch.float32):
            weight = weight.float()
        weight = weight.contiguous()
    out_dtype = out_dtype if out_dtype is not None else x.dtype
    kernel_out_dtype = out_dtype if out_dtype in (x.dtype, torch.float32) else torch.float32

    lead = x.shape[:-1]
    x2 = as_rows(x, n)
    res2 = None
    h_dtype = None
    if residual is not None:
        check_tensor(residual, "residual")
        check_device(residual, x, "residual", "x")
        if residual.shape != x.shape:
            raise ValueError(f"residual must have the shape of x {list(x.shape)}, got {list(residual.shape)}")
        h_dtype = residual_dtype if residual_dtype is not None else x.dtype
        if h_dtype not in (x.dtype, torch.float32):
            raise ValueError(f"residual_dtype must be x's dtype ({x.dtype}) or torch.float32, got {h_dtype}")
        res2 = as_rows(residual if residual.dtype == h_dtype else residual.to(h_dtype), n)

    y2, h2, _ = _RMSNormFunction.apply(x2, res2, weight, eps, offset, kernel_out_dtype, h_dtype)
    y = y2.view(*lead, n)
    if y.dtype != out_dtype:
        y = y.to(out_dtype)
    if residual is None:
        return y
    return y, h2.view(*lead, n)


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

