"""Numerical comparison helpers shared by the tests."""

from __future__ import annotations

import contextlib

import torch

# Absolute floor per dtype for the 2x rule: covers outputs whose exact value sits on a rounding boundary.
FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| where b is finite (NaN in `a` there gives NaN, which fails every comparison)."""
    mask = torch.isfinite(b)
    if not bool(mask.any()):
        return 0.0
    return (a.double()[mask] - b.double()[mask]).abs().max().item()


def assert_2x_rule(out: torch.Tensor, ref32: torch.Tensor, torch_same_dtype: torch.Tensor, *, name: str = "out",
                   floor: float | None = None) -> None:
    """flash-attention's rule: our error vs the fp32 reference is at most twice the error of the same-dtype
    PyTorch computation, plus a small per-dtype floor. Shapes and dtypes must match exactly."""
    assert out.shape == ref32.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref32.shape)}"
    assert out.dtype == torch_same_dtype.dtype, f"{name}: dtype {out.dtype} != {torch_same_dtype.dtype}"
    ours = max_err(out, ref32)
    theirs = max_err(torch_same_dtype, ref32)
    fl = FLOOR[out.dtype] if floor is None else floor
    assert ours <= 2 * theirs + fl, f"{name}: max err {ours:.3g} > 2 x PyTorch's {theirs:.3g} + {fl:.1g}"
    assert torch.equal(torch.isnan(out), torch.isnan(ref32)), f"{name}: NaN pattern differs from the reference"
    inf = torch.isinf(ref32)
    assert torch.equal(torch.isinf(out), inf) and torch.equal(out[inf].double(), ref32[inf].double()), (
        f"{name}: Inf pattern differs from the reference")


# torch >= 2.14: ctx.set_output_grad_dtype lets an fp32 gradient reach a Function's backward uncast at a bf16/fp16
# output. On older torch the autograd engine rounds it to the output's dtype before any backward sees it, so tests
# that send an fp32 gradient to a 16-bit output draw it in the output's dtype there (what the kernel then receives).
GRAD_DTYPE_KEPT = hasattr(torch.autograd.function.FunctionCtx, "set_output_grad_dtype")


def incoming_grad_dtype(want_fp32: bool, out_dtype: torch.dtype) -> torch.dtype:
    """The dtype a test's upstream gradient is drawn in: fp32 when asked and the engine passes it through uncast."""
    return torch.float32 if want_fp32 and (GRAD_DTYPE_KEPT or out_dtype == torch.float32) else out_dtype


@contextlib.contextmanager
def opted_in(pairs):
    """``kernels.replace_kernel_forward_from_hub(cls, name)`` for each pair, for the duration of the block: the
    classes (transformers' own: Conv1D, the MLPs, the Gemma norms) get their previous tag attributes back afterwards,
    so no other test sees them tagged. (Forwards already swapped on instances stay swapped: kernelize sets them per
    module.)"""
    import kernels

    attrs = ("kernel_layer_name", "kernel_condition")
    saved = [(cls, {a: cls.__dict__[a] for a in attrs if a in cls.__dict__}) for cls, _ in pairs]
    try:
        for cls, name in pairs:
            kernels.replace_kernel_forward_from_hub(cls, name)
        yield
    finally:
        for cls, old in reversed(saved):
            for a in attrs:
                if a in old:
                    setattr(cls, a, old[a])
                elif a in cls.__dict__:
                    delattr(cls, a)
