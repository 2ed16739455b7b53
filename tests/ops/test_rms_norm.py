"""rms_norm: forward and backward vs a high-precision reference (the 2x rule), every variant (fp32 weights with
16-bit activations, 3-D, sliced views, fused residual incl. an fp32 residual stream, Gemma's offset), opcheck,
torch.compile without recompiles, a hypothesis property test, argument errors before any launch, determinism,
the declared gradient dtype (torch >= 2.14), and on a GPU every kernel configuration (row lengths up to 262144,
misaligned pointers and row strides, prefetching, wide rows).

CPU runs stay small (M * N <= 5e5 per case); the GPU runs every shape.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _utils import FLOOR, assert_2x_rule, max_err
from conftest import CUDA, ROOT, requires_cuda

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MS = [0, 1, 7, 83, 2048]
NS = [1, 3, 128, 1000, 2304, 4096, 5376, 65537]
CPU_MAX_ELEMS = 500_000


def rms_mod(fm):
    """The loaded package's rms_norm submodule (the package attribute `rms_norm` is the function)."""
    return sys.modules[fm.__name__ + ".rms_norm"]


# ---- reference ------------------------------------------------------------------------------------------


def reference(x, w, *, eps, offset, residual, residual_dtype, out_dtype, dy, dh, prec):
    """(y, h, dx, dres, dw) with the math in `prec`. h = round(x + residual) exactly as the residual stream
    carries it; gradients pass straight through that rounding (dx == dres)."""
    if residual is not None:
        rd = residual_dtype or x.dtype
        h = x.to(rd) + residual.to(rd)
    else:
        h = x
    hh = h.detach().to(prec).requires_grad_()
    wp = w.detach().to(prec).requires_grad_() if w is not None else None
    y = hh * torch.rsqrt(hh.pow(2).mean(-1, keepdim=True) + eps)
    if wp is not None:
        y = y * (offset + wp)
    y.backward(dy.to(prec))
    dtot = hh.grad if dh is None else hh.grad + dh.to(prec)
    return y.detach(), h, dtot, dtot, (wp.grad if wp is not None else None)


def run_case(fm, x, w, *, eps=1e-6, offset=0.0, residual=None, residual_dtype=None, out_dtype=None,
             dy_dtype=None, check_grads=True):
    """Our fwd+bwd vs the reference (fp64 as truth; fp32 math rounded once to our dtypes as PyTorch's
    same-dtype result), with the 2x rule on every output."""
    x = x.detach().requires_grad_(check_grads)
    w = w.detach().requires_grad_(check_grads) if w is not None else None
    res = residual.detach().requires_grad_(check_grads) if residual is not None else None
    out = fm.rms_norm(x, w, eps, offset=offset, residual=res, residual_dtype=residual_dtype, out_dtype=out_dtype)
    y, h = out if res is not None else (out, None)
    ydt = out_dtype or x.dtype
    assert y.shape == x.shape and y.dtype == ydt
    gen = torch.Generator(device=x.device).manual_seed(1234)
    dy = torch.randn(x.shape, generator=gen, device=x.device, dtype=dy_dtype or ydt)
    dh = torch.randn(x.shape, generator=gen, device=x.device, dtype=h.dtype) if h is not None else None
    kw = dict(eps=eps, offset=offset, residual=residual, residual_dtype=residual_dtype, out_dtype=out_dtype, dy=dy,
              dh=dh)
    y64, h_ref, dx64, dr64, dw64 = reference(x, w, prec=torch.float64, **kw)
    y32, _, dx32, dr32, dw32 = reference(x, w, prec=torch.float32, **kw)
    assert_2x_rule(y, y64, y32.to(ydt), name="y")
    if h is not None:
        assert h.dtype == (residual_dtype or x.dtype) and torch.equal(h, h_ref), "h must be the rounded x + residual"
    if not check_grads or x.numel() == 0 and w is None:
        return y
    torch.autograd.backward([y] + ([h] if h is not None else []), [dy] + ([dh] if dh is not None else []))
    # Floors for results that are differences of larger terms: any fp32 implementation is off by a few fp32
    # ulps of the largest cancelling term (dx = rs * (g - xhat * mean(g * xhat)) cancels completely at N = 1;
    # dW sums M rows of dy * xhat), so the floor adds 4 ulps of that term size to the per-dtype floor.
    ulp32 = 2.0**-24
    h64 = h_ref.double()
    rs64 = torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + eps)
    s64 = (offset + w.double()) if w is not None else torch.ones((), dtype=torch.float64, device=x.device)
    dx_terms = (rs64 * (dy.double() * s64).abs()).max().item() if x.numel() else 0.0
    assert_2x_rule(x.grad, dx64, dx32.to(x.dtype), name="dx", floor=FLOOR[x.dtype] + 4 * ulp32 * dx_terms)
    if res is not None:
        assert_2x_rule(res.grad, dr64, dr32.to(res.dtype), name="dresidual",
                       floor=FLOOR[res.dtype] + 4 * ulp32 * dx_terms)
    if w is not None:
        rows = max(x.numel() // max(x.shape[-1], 1), 1)
        dw_terms = (dy.double() * h64 * rs64).reshape(-1, x.shape[-1]).abs().sum(0).max().item() if x.numel() else 0
        assert_2x_rule(w.grad, dw64, dw32.to(w.dtype), name="dw",
                       floor=FLOOR[w.dtype] + 4 * ulp32 * math.sqrt(rows) * dw_terms)
    return y


def make(shape, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)


def skip_big(device, *shape):
    if device == "cpu" and math.prod(shape) > CPU_MAX_ELEMS:
        pytest.skip("large shape: GPU only (keeps the CPU suite short)")


# ---- the shape sweep --------------------------------------------------------------------------------------


@pytest.mark.parametrize("N", NS)
@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fwd_bwd_shapes(fm, device, dtype, M, N):
    skip_big(device, M, N)
    x = make((M, N), dtype, device)
    w = 1 + 0.25 * make((N,), dtype, device, seed=1)
    run_case(fm, x, w)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("M,N", [(7, 1000), (83, 4096), (3, 65537)])
def test_fp32_weight_with_half_input(fm, device, dtype, M, N):
    """LlamaRMSNorm's fp32-weight case: y in fp32 (promote(w, x)), and the same weights with y in x's dtype."""
    skip_big(device, M, N)
    x = make((M, N), dtype, device)
    w = 1 + 0.25 * make((N,), torch.float32, device, seed=1)
    run_case(fm, x, w, out_dtype=torch.float32)
    run_case(fm, x, w)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_3d_and_1d_inputs(fm, device, dtype):
    w = 1 + 0.25 * make((384,), dtype, device, seed=1)
    run_case(fm, make((2, 5, 384), dtype, device), w)
    run_case(fm, make((384,), dtype, device), w)
    run_case(fm, make((2, 0, 384), dtype, device), w)
    with torch.no_grad():  # the inference path hands [..., N] to the kernel directly
        x = make((3, 4, 384), dtype, device)
        torch.testing.assert_close(fm.rms_norm(x, w), fm.rms_norm(x.reshape(12, 384), w).view(3, 4, 384), rtol=0,
                                   atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_views(fm, device, dtype):
    w = 1 + 0.25 * make((1000,), dtype, device, seed=1)
    base = make((40, 1000), dtype, device)
    run_case(fm, base[::2], w)  # row stride 2N
    run_case(fm, make((40, 1001), dtype, device)[:, 1:], w)  # odd row stride, offset base pointer
    run_case(fm, make((1000, 40), dtype, device).t(), w)  # column stride != 1: made contiguous
    run_case(fm, make((4, 10, 1000), dtype, device)[:, ::3], w)  # 3-D, not viewable as rows
    with torch.no_grad():
        x = make((4, 10, 1000), dtype, device)[:, ::3]
        torch.testing.assert_close(fm.rms_norm(x, w), fm.rms_norm(x.contiguous(), w), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_training_input_saved_once(fm, device, dtype):
    """Eager training on N-D strided x: rows the op can view are saved for backward in place (no copy); a layout it
    cannot view is copied once, before the op, so backward reads the saved copy as rows without a second copy. Both
    give the inference path's bits."""
    w = 1 + 0.25 * make((1000,), dtype, device, seed=1)
    viewable = make((3, 4, 1001), dtype, device)[..., 1:].requires_grad_()  # padded rows: a strided row view
    packed = make((4, 10, 1000), dtype, device)[:, ::3].requires_grad_()  # not viewable as rows
    for x, copied in ((viewable, False), (packed, True)):
        y = fm.rms_norm(x, w)
        saved = y.grad_fn.saved_tensors[0]
        assert (saved.data_ptr() != x.data_ptr()) == copied
        assert saved.is_contiguous() == copied
        with torch.no_grad():
            assert torch.equal(y, fm.rms_norm(x, w))
        dy = make(x.shape, dtype, device, seed=2)
        (dx,) = torch.autograd.grad(y, x, dy)
        xc = x.detach().contiguous().requires_grad_()
        (dx_c,) = torch.autograd.grad(fm.rms_norm(xc, w), xc, dy)
        tol = 0 if copied else (1e-5 if dtype == torch.float32 else 1e-2)  # the copy runs the contiguous kernels
        torch.testing.assert_close(dx, dx_c, rtol=tol, atol=tol)


@pytest.mark.parametrize("residual_dtype", [None, torch.float32], ids=["h=x.dtype", "h=fp32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,N", [(1, 128), (83, 1000), (7, 5376), (2, 65537)])
def test_residual(fm, device, dtype, M, N, residual_dtype):
    skip_big(device, M, N)
    x = make((M, N), dtype, device)
    r = make((M, N), residual_dtype or dtype, device, seed=2)
    w = 1 + 0.25 * make((N,), dtype, device, seed=1)
    run_case(fm, x, w, residual=r, residual_dtype=residual_dtype)


def test_residual_cast_and_h_only_grad(fm, device):
    """A bf16 residual with an fp32 stream is widened before the kernel; a graph that uses only h still
    gets correct gradients (y's gradient is None: no zero-filled tensor)."""
    x = make((5, 256), torch.bfloat16, device).requires_grad_()
    r = make((5, 256), torch.bfloat16, device, seed=2).requires_grad_()
    w = torch.ones(256, device=device, dtype=torch.bfloat16, requires_grad=True)
    y, h = fm.rms_norm(x, w, residual=r, residual_dtype=torch.float32)
    assert h.dtype == torch.float32 and torch.equal(h, x.float() + r.float())
    h.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x)) and torch.equal(r.grad, torch.ones_like(r))
    assert w.grad is not None and torch.count_nonzero(w.grad) == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,N", [(7, 3), (83, 2304), (1, 65537)])
def test_gemma_offset_and_no_weight(fm, device, dtype, M, N):
    skip_big(device, M, N)
    x = make((M, N), dtype, device)
    w = 0.25 * make((N,), dtype, device, seed=1)
    run_case(fm, x, w, offset=1.0)
    run_case(fm, x, w.float(), offset=1.0)
    run_case(fm, x, None)
    run_case(fm, x, w, offset=1.0, residual=make((M, N), dtype, device, seed=3))


def test_nan_inf_propagate(fm, device):
    x = make((4, 64), torch.float32, device)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    w = torch.ones(64, device=device)
    y = fm.rms_norm(x, w)
    ref = fm.rms_norm_reference(x, w)
    assert torch.isnan(y[1]).all() and torch.isnan(y[2, 5]) and torch.count_nonzero(y[2].nan_to_num()) == 0
    torch.testing.assert_close(y, ref, equal_nan=True)


# ---- properties -------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    m=st.integers(0, 40),
    n=st.integers(1, 3000),
    dtype=st.sampled_from(DTYPES),
    variant=st.sampled_from(["plain", "gemma", "no_weight", "residual", "residual_fp32", "fp32_weight"]),
    eps=st.sampled_from([0.0, 1e-6, 1e-5, 0.1]),
    scale=st.sampled_from([1e-3, 1.0, 300.0]),
)
def test_property_vs_reference(fm, m, n, dtype, variant, eps, scale):
    device = "cuda" if CUDA else "cpu"
    x = make((m, n), dtype, device) * scale
    w = 1 + 0.25 * make((n,), dtype, device, seed=1)
    kw = {}
    if variant == "gemma":
        kw["offset"] = 1.0
    elif variant == "no_weight":
        w = None
    elif variant.startswith("residual"):
        kw["residual"] = make((m, n), dtype, device, seed=2) * scale
        kw["residual_dtype"] = torch.float32 if variant == "residual_fp32" else None
        if kw["residual_dtype"] is not None:
            kw["residual"] = kw["residual"].float()
    elif variant == "fp32_weight":
        w = w.float()
    if eps == 0.0:
        x = x + 1e-3 * scale  # keep rows away from all-zero (0 * inf)
    run_case(fm, x, w, eps=eps, **kw)


# ---- argument errors before any launch ------------------------------------------------------------------


def test_bad_arguments(fm, device):
    x = make((4, 8), torch.float32, device)
    w = torch.ones(8, device=device)
    with pytest.raises(ValueError, match=r"weight must have shape \[8\]"):
        fm.rms_norm(x, torch.ones(7, device=device))
    with pytest.raises(ValueError, match="weight must have shape"):
        fm.rms_norm(x, torch.ones(2, 4, device=device))
    other = "meta" if device == "cpu" else "cpu"
    with pytest.raises(ValueError, match="weight is on .* but x is on"):
        fm.rms_norm(x, torch.ones(8, device=other))
    with pytest.raises(ValueError, match="residual is on"):
        fm.rms_norm(x, w, residual=torch.ones(4, 8, device=other))
    with pytest.raises(TypeError, match="x must be float32, float16 or bfloat16"):
        fm.rms_norm(torch.ones(4, 8, dtype=torch.int32, device=device), w)
    with pytest.raises(TypeError, match="weight must be float32"):
        fm.rms_norm(x, torch.ones(8, dtype=torch.int64, device=device))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        fm.rms_norm([1.0, 2.0], w)
    for bad in (-1e-6, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="eps must be"):
            fm.rms_norm(x, w, bad)
    with pytest.raises(TypeError, match="eps must be a Python float"):
        fm.rms_norm(x, w, torch.tensor(1e-6))
    with pytest.raises(ValueError, match="offset must be finite"):
        fm.rms_norm(x, w, offset=float("nan"))
    with pytest.raises(ValueError, match="residual must have the shape of x"):
        fm.rms_norm(x, w, residual=torch.ones(4, 9, device=device))
    with pytest.raises(ValueError, match="residual_dtype must be x's dtype"):
        fm.rms_norm(x.half(), w, residual=x.half(), residual_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="residual_dtype must be None or one of"):
        fm.rms_norm(x, w, residual=x, residual_dtype=torch.int8)
    with pytest.raises(ValueError, match="at least one dimension"):
        fm.rms_norm(torch.tensor(1.0, device=device), None)
    assert fm.rms_norm(x, w, 0) is not None  # an int eps is a valid float


# ---- the inference ops (no autograd: y alone, or y and h) ---------------------------------------------------


class OpSpy(torch.utils._python_dispatch.TorchDispatchMode):
    """Names of the fused-mlp ops that run."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns, _, name = func._schema.name.partition("::")
        if ns.startswith("_fused_mlp"):
            self.names.append(name)
        return func(*args, **(kwargs or {}))


INFER_CASES = [  # (shape, x dtype, weight dtype or None, offset, out_f32)
    ((1, 2048), torch.bfloat16, torch.bfloat16, 0.0, False),
    ((1, 1, 2048), torch.bfloat16, torch.float32, 0.0, True),
    ((1, 1, 2048), torch.float32, torch.float32, 1.0, False),
    ((5, 64), torch.float16, None, 0.0, False),
    ((3, 7, 1000), torch.float16, torch.float16, 1.0, True),
    ((0, 64), torch.bfloat16, torch.bfloat16, 0.0, False),
    ((64, 4096), torch.bfloat16, torch.bfloat16, 1.0, False),
    ((1024, 32768), torch.bfloat16, torch.bfloat16, 0.0, False),  # sm_90: the l2 kernel
]


@pytest.mark.parametrize("case", INFER_CASES, ids=lambda c: f"{list(c[0])}-{str(c[1])[6:]}-w{str(c[2])[6:]}")
def test_infer_ops_equal_fwd(fm, device, case):
    """rms_norm_infer's y and rms_norm_add_infer's (y, h) are the full forward's, bit for bit (the same kernel, which
    stores no rstd for them)."""
    ops = fm._ops.ops
    shape, dtype, w_dtype, offset, out_f32 = case
    x = make(shape, dtype, device)
    w = None if w_dtype is None else (1 + 0.25 * make(shape[-1:], w_dtype, device, seed=1)).to(w_dtype)
    out_dtype = torch.float32 if out_f32 else dtype
    y_full, _, _ = ops.rms_norm_fwd(x, None, w, 1e-6, offset, out_dtype, None)
    y = ops.rms_norm_infer(x, w, 1e-6, offset, out_f32)
    assert y.dtype == out_dtype and y.shape == x.shape and torch.equal(y, y_full)
    for res_dtype in (dtype, torch.float32):
        r = make(shape, res_dtype, device, seed=2)
        y_full, h_full, _ = ops.rms_norm_fwd(x, r, w, 1e-6, offset, out_dtype, res_dtype)
        y, h = ops.rms_norm_add_infer(x, r, w, 1e-6, offset, out_f32)
        assert h.dtype == res_dtype and torch.equal(y, y_full) and torch.equal(h, h_full)


def test_infer_ops_opcheck(fm, device):
    ops = fm._ops.ops
    x = make((5, 64), torch.bfloat16, device)
    w = make((64,), torch.float32, device)
    r = make((5, 64), torch.float32, device)
    for args in [(x, w, 1e-6, 0.0, False), (x, None, 1e-6, 1.0, True), (x.view(5, 1, 64), w, 1e-6, 0.0, False),
                 (x[:0], w, 1e-6, 0.0, False)]:
        torch.library.opcheck(ops.rms_norm_infer.default, args)
    for args in [(x, r, w, 1e-6, 0.0, False), (x, x, None, 1e-5, 0.0, True)]:
        torch.library.opcheck(ops.rms_norm_add_infer.default, args)


@pytest.mark.parametrize("grad", ["no_grad", "inference_mode", "enabled"])
def test_inference_runs_the_infer_op(fm, device, grad):
    """Whenever no gradient is needed (no_grad, inference_mode, or no input requiring one) rms_norm runs the
    inference op, with the full forward's values; the residual path runs the add variant."""
    ops = fm._ops.ops
    x = make((2, 3, 256), torch.bfloat16, device)
    w = make((256,), torch.float32, device, seed=1)
    r = make((2, 3, 256), torch.float32, device, seed=2)
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode, "enabled": torch.enable_grad}[grad]
    with ctx(), OpSpy() as spy:
        y = fm.rms_norm(x, w, 1e-6)
        y2, h2 = fm.rms_norm(x, w, 1e-6, residual=r, residual_dtype=torch.float32)
        y3 = fm.rms_norm(x, w.bfloat16(), 1e-6, offset=1.0, out_dtype=torch.float32)
    assert spy.names == ["rms_norm_infer", "rms_norm_add_infer", "rms_norm_infer"]
    assert torch.equal(y, ops.rms_norm_fwd(x, None, w, 1e-6, 0.0, torch.bfloat16, None)[0])
    y_full, h_full, _ = ops.rms_norm_fwd(x, r, w, 1e-6, 0.0, torch.bfloat16, torch.float32)
    assert torch.equal(y2, y_full) and torch.equal(h2, h_full)
    assert y3.dtype == torch.float32
    assert torch.equal(y3, ops.rms_norm_fwd(x, None, w.bfloat16(), 1e-6, 1.0, torch.float32, None)[0])


def test_grad_needed_runs_the_autograd_function(fm, device):
    """An input requiring a gradient (grad mode on) takes the autograd path: rms_norm_fwd, then rms_norm_bwd."""
    x = make((4, 128), torch.float32, device).requires_grad_()
    w = make((128,), torch.float32, device, seed=1).requires_grad_()
    for inputs in ((x, w.detach()), (x.detach(), w)):
        with OpSpy() as spy:
            y = fm.rms_norm(*inputs)
            y.sum().backward()
        assert spy.names == ["rms_norm_fwd", "rms_norm_bwd"] and y.requires_grad
    with torch.no_grad():
        assert not fm.rms_norm(x, w).requires_grad


def test_infer_fallbacks_keep_the_full_path(fm, device):
    """Arguments the inference op rejects take the full path: a weight in another half dtype (widened), a strided
    weight (made contiguous), an out_dtype the kernel cannot write (cast after), a residual to convert, a
    non-unit-stride 2-D x (copied) -- each the same values as the explicit conversion."""
    x = make((3, 64), torch.bfloat16, device)
    w = make((64,), torch.float32, device, seed=1)
    r = make((3, 64), torch.float16, device, seed=2)

    def rn(*a, **k):
        with torch.no_grad():
            return fm.rms_norm(*a, **k)

    assert torch.equal(rn(x, w.half()), rn(x, w.half().float()))
    strided = make((128,), torch.float32, device)[::2]
    assert torch.equal(rn(x, strided), rn(x, strided.contiguous()))
    assert torch.equal(rn(x, w, out_dtype=torch.float16), rn(x, w, out_dtype=torch.float32).half())
    y, h = rn(x, w, residual=r)
    y0, h0 = rn(x, w, residual=r.bfloat16())
    assert torch.equal(y, y0) and torch.equal(h, h0)
    xt = make((64, 3), torch.bfloat16, device).t()
    assert torch.equal(rn(xt, w), rn(xt.contiguous(), w))
    with torch.no_grad(), pytest.raises(ValueError, match="weight is on .* but x is on"):
        fm.rms_norm(x, w.to("meta"))
    with torch.no_grad(), pytest.raises(ValueError, match="residual is on"):
        fm.rms_norm(x, w, residual=x.to("meta"))


def test_infer_op_level_checks(fm):
    ops = fm._ops.ops
    x = torch.ones(4, 8)
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        ops.rms_norm_infer(x, torch.ones(7), 1e-6, 0.0, False)
    with pytest.raises(RuntimeError, match="residual shape"):
        ops.rms_norm_add_infer(x, torch.ones(4, 7), None, 1e-6, 0.0, False)
    with pytest.raises(RuntimeError, match="residual_dtype must be x's dtype or float32"):
        ops.rms_norm_add_infer(x.bfloat16(), x.half(), None, 1e-6, 0.0, False)


def test_op_level_checks(fm):
    """The C++ ops check what they rely on even when called directly (no crash, a clear error)."""
    ops = fm._ops.ops
    x = torch.ones(4, 8)
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        ops.rms_norm_fwd(x, None, torch.ones(7), 1e-6, 0.0, torch.float32, None)
    with pytest.raises(RuntimeError, match="out_dtype must be x's dtype or float32"):
        ops.rms_norm_fwd(x.bfloat16(), None, None, 1e-6, 0.0, torch.float16, None)
    with pytest.raises(RuntimeError, match="residual dtype"):
        ops.rms_norm_fwd(x, x.half(), None, 1e-6, 0.0, torch.float32, None)
    with pytest.raises(RuntimeError, match="mixes 16-bit dtypes"):
        ops.rms_norm_bwd(x.half(), x.bfloat16(), torch.ones(4), None, None, 0.0, torch.bfloat16, False)
    with pytest.raises(RuntimeError, match="rstd must be"):
        ops.rms_norm_bwd(x, x, torch.ones(3), None, None, 0.0, torch.float32, False)


# ---- custom-op contracts and torch.compile ---------------------------------------------------------------


def test_opcheck(fm, device):
    ops = fm._ops.ops
    x = make((5, 64), torch.bfloat16, device)
    w = make((64,), torch.float32, device)
    r = make((5, 64), torch.float32, device)
    for args in [
        (x, None, w, 1e-6, 0.0, torch.bfloat16, None),
        (x, None, w, 1e-6, 1.0, torch.float32, None),
        (x, r, w, 1e-6, 0.0, torch.bfloat16, torch.float32),
        (x, x, None, 1e-5, 0.0, torch.bfloat16, None),
        (x.view(5, 1, 64), None, w, 1e-6, 0.0, torch.bfloat16, None),
        (x[:0], None, w, 1e-6, 0.0, torch.bfloat16, None),
    ]:
        torch.library.opcheck(ops.rms_norm_fwd.default, args)
    y, h, rstd = ops.rms_norm_fwd(x, r, w, 1e-6, 0.0, torch.bfloat16, torch.float32)
    for args in [
        (y, x, rstd, w, None, 0.0, torch.bfloat16, True),
        (y.float(), h, rstd, w, r, 1.0, torch.float32, True),
        (y, x, rstd, None, None, 0.0, torch.bfloat16, False),
    ]:
        torch.library.opcheck(ops.rms_norm_bwd.default, args)


@pytest.fixture
def no_recompiles():
    import torch._dynamo

    torch._dynamo.reset()
    old = torch._dynamo.config.error_on_recompile
    torch._dynamo.config.error_on_recompile = True
    yield
    torch._dynamo.config.error_on_recompile = old
    torch._dynamo.reset()


@pytest.mark.parametrize("policy", ["auto", "kernel"])
@pytest.mark.parametrize("mode", ["inference", "training", "residual_training", "3d_inference"])
def test_torch_compile_no_recompile(fm, device, no_recompiles, mode, policy, monkeypatch):
    """fullgraph, one graph for token counts 1, 7 and 4096, results within the 2x rule. Policy "auto" traces the fp32
    decomposition (Inductor fuses it with its neighbours; _common.KERNEL_UNDER_COMPILE), "kernel" keeps our op."""
    from torch._dynamo.decorators import mark_unbacked
    from torch._inductor.compile_fx import compile_fx

    monkeypatch.setenv("FUSED_MLP_UNDER_COMPILE", policy)
    dtype = torch.bfloat16
    n = 256
    training = mode.endswith("training")
    w = (1 + 0.25 * make((n,), dtype, device, seed=1)).requires_grad_(training)
    res_kw = dict(residual_dtype=torch.float32) if mode == "residual_training" else {}
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.print_readable(print_output=False))
        return compile_fx(gm, example_inputs)

    def f(x, w):
        if res_kw:
            return fm.rms_norm(x, w, 1e-6, residual=x * 0.5, **res_kw)
        return (fm.rms_norm(x, w, 1e-6),)

    cf = torch.compile(f, fullgraph=True, dynamic=True, backend=backend)
    for t in (1, 7, 4096):
        shape = (2, t, n) if mode == "3d_inference" else (t, n)
        x = make(shape, dtype, device, seed=t).requires_grad_(training)
        mark_unbacked(x, 1 if mode == "3d_inference" else 0)
        with torch.set_grad_enabled(training):
            out = cf(x, w)
        y = out[0]
        dy = make(shape, dtype, device, seed=100 + t)
        dh = make(shape, torch.float32, device, seed=200 + t) if res_kw else None
        kw = dict(eps=1e-6, offset=0.0, residual=x.detach() * 0.5 if res_kw else None, out_dtype=None, dy=dy, dh=dh,
                  residual_dtype=res_kw.get("residual_dtype"))
        y64, h_ref, dx64, _, dw64 = reference(x.detach(), w, prec=torch.float64, **kw)
        y32, _, dx32, _, dw32 = reference(x.detach(), w, prec=torch.float32, **kw)
        assert_2x_rule(y, y64, y32.to(dtype), name=f"y (t={t})")
        if res_kw:
            assert torch.equal(out[1], h_ref), "h must be the fp32 x + residual"
        if training:
            gx, gw = torch.autograd.grad(out, (x, w), (dy,) + ((dh,) if res_kw else ()))
            # d(x + 0.5 x)/dx: the residual's gradient flows into x as well
            scale = 1.5 if res_kw else 1.0
            assert_2x_rule(gx, scale * dx64, (scale * dx32).to(dtype), name=f"dx (t={t})", floor=2 * FLOOR[dtype])
            assert_2x_rule(gw, dw64, dw32.to(dtype), name=f"dw (t={t})", floor=FLOOR[dtype] * math.sqrt(x.numel() / n))
    # error_on_recompile and fullgraph=True rule out recompiles and graph breaks; the graph that runs is the last one
    # dynamo handed to the backend (it may restart a trace once, e.g. to specialise eps). Without autograd the
    # kernel is the inference op (y alone; with a residual y and h).
    op = "rms_norm_fwd" if training else "rms_norm_infer" if not res_kw else "rms_norm_add_infer"
    assert (op in graphs[-1]) == (policy == "kernel"), graphs[-1]


# ---- determinism and gradient dtypes ----------------------------------------------------------------------


@pytest.mark.parametrize("N", [1000, 4096])
def test_deterministic(fm, device, N):
    M = 300 if device == "cpu" else 5000
    x = make((M, N), torch.bfloat16, device)
    w = make((N,), torch.bfloat16, device, seed=1)
    dy = make((M, N), torch.bfloat16, device, seed=2)

    def grads():
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        fm.rms_norm(xr, wr).backward(dy)
        return xr.grad, wr.grad

    (dx1, dw1), (dx2, dw2) = grads(), grads()
    assert torch.equal(dx1, dx2) and torch.equal(dw1, dw2)


def test_declared_grad_dtype_keeps_fp32_upstream_gradient(fm, device, monkeypatch):
    """Record, for the autograd Function (no residual: y its only output): its output dtype, the grad dtype it
    declared and the dtype backward received. On torch >= 2.14 an fp32 gradient arriving at a bf16 output reaches
    the kernel uncast, and the result is closer to an fp64 reference than with the default path (engine casts the
    gradient to bf16)."""
    mod = rms_mod(fm)
    records = []
    orig_backward = mod._RMSNormYFunction.backward
    orig_declare = mod.declare_grad_dtypes

    def recording_declare(ctx, *dtypes, **kw):
        # What the Function declared, as the ctx holds it after the call (the engine consumes it after forward).
        orig_declare(ctx, *dtypes, **kw)
        records.append({"declared": getattr(ctx, "output_grad_dtypes", "unsupported")})

    def recording_backward(ctx, dy):
        records[-1].update(received=dy.dtype)
        return orig_backward(ctx, dy)

    monkeypatch.setattr(mod, "declare_grad_dtypes", recording_declare)
    monkeypatch.setattr(mod._RMSNormYFunction, "backward", staticmethod(recording_backward))
    M, N = 64, 2048
    x = make((M, N), torch.bfloat16, device)
    w = 1 + 0.25 * make((N,), torch.bfloat16, device, seed=1)
    g32 = make((M, N), torch.float32, device, seed=2)

    def dx_with(upstream):
        xr = x.clone().requires_grad_()
        y = fm.rms_norm(xr, w)
        y.backward(upstream)
        records[-1].update(output=y.dtype)
        return xr.grad

    dx_uncast = dx_with(g32)
    rec = records[-1]
    print("recorded (declaring):", rec)
    assert rec["output"] == torch.bfloat16
    supported = hasattr(torch.autograd.function.FunctionCtx, "set_output_grad_dtype")
    if not supported:
        assert rec["declared"] == "unsupported" and rec["received"] == torch.bfloat16
        pytest.skip(f"torch {torch.__version__} has no ctx.set_output_grad_dtype: default path only (recorded)")
    assert rec["declared"] == (None,) and rec["received"] == torch.float32
    # An fp32 y has nothing to keep uncast: no declaration (host time), the gradient still arrives in fp32.
    x32 = x.float()
    xr = x32.clone().requires_grad_()
    fm.rms_norm(xr, w.float()).backward(g32)
    assert records[-1]["declared"] is None and records[-1]["received"] == torch.float32, records[-1]

    monkeypatch.setattr(mod, "declare_grad_dtypes", lambda ctx, *d, **kw: records.append({"declared": None}))
    dx_cast = dx_with(g32)  # the default path: the engine casts the fp32 gradient to the output's bf16
    rec = records[-1]
    print("recorded (default):", rec)
    assert rec["declared"] is None and rec["output"] == torch.bfloat16 and rec["received"] == torch.bfloat16

    _, _, dx64, _, _ = reference(x, w, eps=1e-6, offset=0.0, residual=None, residual_dtype=None, out_dtype=None,
                                 dy=g32, dh=None, prec=torch.float64)
    err_uncast = (dx_uncast.double() - dx64).abs().mean().item()
    err_cast = (dx_cast.double() - dx64).abs().mean().item()
    print(f"mean |dx - fp64|: fp32 upstream kept {err_uncast:.3e}, cast to bf16 {err_cast:.3e}")
    assert err_uncast < err_cast


def test_fp32_upstream_with_fp32_residual_stream(fm, device):
    """The fp32 residual stream end to end: h fp32, d(residual) fp32 computed from the fp32 upstream grads."""
    x = make((16, 512), torch.bfloat16, device).requires_grad_()
    r = make((16, 512), torch.float32, device, seed=2).requires_grad_()
    w = 1 + 0.25 * make((512,), torch.bfloat16, device, seed=1)
    y, h = fm.rms_norm(x, w, residual=r, residual_dtype=torch.float32)
    gy = make((16, 512), torch.float32, device, seed=3)
    gh = make((16, 512), torch.float32, device, seed=4)
    torch.autograd.backward([y, h], [gy, gh])
    _, _, _, dr64, _ = reference(x.detach(), w, eps=1e-6, offset=0.0, residual=r.detach(),
                                 residual_dtype=torch.float32, out_dtype=None, dy=gy, dh=gh, prec=torch.float64)
    assert r.grad.dtype == torch.float32
    tol = 1e-5 if hasattr(torch.autograd.function.FunctionCtx, "set_output_grad_dtype") else 2e-2
    assert max_err(r.grad, dr64) <= tol * dr64.abs().max().item()


def test_cpu_baseline_copy_subprocess(fm_cpu):  # fm_cpu: skipped with it where no CPU variant is built
    """The CPU row kernels exist twice (AVX2+F16C and baseline x86-64, picked at run time); this machine runs the
    AVX2 copy, so the baseline copy is forced in a fresh process (FUSED_MLP_CPU_BASELINE is read once)."""
    code = textwrap.dedent(
        f"""
        import sys, torch
        sys.path[:0] = [{str(ROOT / "tests")!r}, {str(ROOT / "tests" / "ops")!r}]
        import kernels
        from test_rms_norm import run_case, make
        fm = kernels.get_local_kernel(__import__("pathlib").Path({str(ROOT)!r}), backend="cpu")
        for dt in (torch.float32, torch.float16, torch.bfloat16):
            for m, n in ((7, 1000), (3, 13), (2, 4099)):
                x = make((m, n), dt, "cpu")
                w = 1 + 0.25 * make((n,), dt, "cpu", seed=1)
                run_case(fm, x, w)
                run_case(fm, x, w.float(), residual=make((m, n), torch.float32, "cpu", seed=2),
                         residual_dtype=torch.float32)
        print("ok")
        """
    )
    env = {**os.environ, "FUSED_MLP_CPU_BASELINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, f"{proc.stdout}\n{proc.stderr}"


def test_cpu_copy_switches_read_their_value_subprocess(fm_cpu):
    """FUSED_MLP_CPU_BASELINE=0 (or empty) leaves the copy choice alone, =1 / true forces the baseline copy: told
    apart by the bits of an fp32 forward, which the baseline copy sums in another order."""
    code = textwrap.dedent(
        f"""
        import hashlib, kernels, pathlib, torch
        fm = kernels.get_local_kernel(pathlib.Path({str(ROOT)!r}), backend="cpu")
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(64, 1000, generator=g) * 3, torch.randn(1000, generator=g)
        print(hashlib.sha1(fm.rms_norm(x, w).numpy().tobytes()).hexdigest())
        """
    )

    def bits(value):
        env = {k: v for k, v in os.environ.items() if not k.startswith("FUSED_MLP_CPU_")}
        if value is not None:
            env["FUSED_MLP_CPU_BASELINE"] = value
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout.split()[-1]

    default, forced = bits(None), bits("1")
    if default == forced:
        pytest.skip("this CPU runs the baseline copy by default (no AVX2): the switch cannot be told apart")
    assert bits("0") == default and bits("") == default
    assert bits("TRUE") == forced


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_cpu_rows_do_not_depend_on_their_neighbours(fm_cpu, dtype, residual):
    """The CPU forward runs a row's output pass together with the next row's sums (fp32 x): every row's y, h and
    rstd must be bit for bit what the row alone gives, under 1 and 2 threads (other row splits), N with a tail."""
    m, n = 67, 2 * 256 + 8 + 3  # blocks, a tail of 8, a scalar tail
    x = make((m, n), dtype, "cpu")
    w = 1 + 0.25 * make((n,), dtype, "cpu", seed=1)
    r = make((m, n), torch.float32, "cpu", seed=2) if residual else None
    fwd = fm_cpu._ops.ops.rms_norm_fwd.default
    kw = (r, w, 1e-6, 0.0, dtype, torch.float32 if residual else None)
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2):
            torch.set_num_threads(t)
            outs.append(fwd(x, *kw))
        alone = [fwd(x[i:i + 1], *((r[i:i + 1],) if residual else (None,)), *kw[1:]) for i in range(m)]
    finally:
        torch.set_num_threads(threads)
    for y, h, rstd in outs:
        assert torch.equal(y, torch.cat([a[0] for a in alone])) and torch.equal(rstd, torch.cat([a[2] for a in alone]))
        if residual:
            assert torch.equal(h, torch.cat([a[1] for a in alone]))


_COPIES_SCRIPT = """
import pathlib, sys, torch
import kernels
fm = kernels.get_local_kernel(pathlib.Path(sys.argv[1]), backend="cpu")
ops = fm._ops.ops
g = torch.Generator().manual_seed(0)
outs = []
for dt in (torch.float32, torch.bfloat16, torch.float16):
    for m, n in ((5, 64), (9, 523), (3, 4099)):
        x = torch.randn(m, n, generator=g)
        x[0, 0], x[0, 1:] = 1e19, 1e-20 * torch.rand(n - 1, generator=g)  # outputs below fp32's normal range
        x[1, 3] = float("nan")
        x[2, 5] = float("inf")
        x = x.to(dt)
        w = (1 + 0.25 * torch.randn(n, generator=g)).to(dt)
        r = torch.randn(m, n, generator=g).to(dt)
        dy = torch.randn(m, n, generator=g).to(dt)
        for wt, off in ((w, 0.0), (w, 1.0), (None, 0.0)):
            y, h, rstd = ops.rms_norm_fwd.default(x, None, wt, 1e-6, off, dt, None)
            outs += [y, rstd, ops.rms_norm_infer.default(x, wt, 1e-6, off, dt == torch.float32)]
            outs += list(ops.rms_norm_add_infer.default(x, r, wt, 1e-6, off, False))
            outs += list(ops.rms_norm_fwd.default(x, r.float(), wt, 1e-6, off, dt, torch.float32))
            dx, dw = ops.rms_norm_bwd.default(dy, x, rstd, wt, r, off, dt, wt is not None)
            outs += [dx, dw]
torch.save(outs, sys.argv[2])
"""


def _cpu_flags() -> set[str]:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}


@pytest.mark.skipif(not {"avx512f", "avx512vl", "avx512bw", "avx512dq", "avx512_bf16"} <= _cpu_flags(),
                    reason="the AVX-512 copy needs AVX-512 with BF16 (this CPU runs the AVX2 or baseline copy)")
def test_cpu_avx512_copy_stores_the_avx2_bits(fm_cpu, tmp_path):  # fm_cpu: as above
    """The CPU row kernels exist three times (AVX-512 with BF16 stores, AVX2+F16C, baseline x86-64; picked once per
    process). The AVX-512 copy differs from the AVX2 one only in its bf16 stores: the same bits for every op, dtype
    and weight form, incl. rows with NaN and inf and bf16 outputs below fp32's normal range (which its store hands
    to the integer rounding). The baseline copy has no FMA: test_cpu_baseline_copy_subprocess holds it to the 2x
    rule."""
    results = {}
    for name, env in (("auto", {}), ("avx2", {"FUSED_MLP_CPU_NO_AVX512": "1"})):
        out = tmp_path / f"{name}.pt"
        proc = subprocess.run([sys.executable, "-c", _COPIES_SCRIPT, str(ROOT), str(out)], env={**os.environ, **env},
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        results[name] = torch.load(out)
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    ref = results["auto"]
    assert any(t.dtype == torch.bfloat16 and t.isnan().any() for t in ref)
    for name in ("avx2",):
        assert len(results[name]) == len(ref)
        for i, (a, b) in enumerate(zip(ref, results[name])):
            assert a.dtype == b.dtype and a.shape == b.shape, (name, i)
            assert torch.equal(a.view(bits[a.dtype]), b.view(bits[b.dtype])), (name, i, a.dtype)


# ---- GPU: every kernel configuration ---------------------------------------------------------------------


def _misaligned(shape, dtype, device, seed=0):
    """A tensor whose base pointer is 2 bytes off a 16-byte boundary."""
    flat = make((math.prod(shape) + 1,), dtype, device, seed=seed)
    return flat[1:].view(shape)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [2048, 8192, 16384, 24576, 32768, 49152, 65536, 98304, 131072, 262144])
def test_cuda_wide_rows(fm, dtype, N):
    """Rows path up to 65536 (bf16/fp16) / 32768 (fp32), wide path beyond: smem-cached (fits the opt-in smem)
    and re-read from L2 (does not); bwd rows with dW in smem and bwd wide with smem / global dW partials."""
    M = max(8, min(4000, (1 << 25) // N))  # enough row groups for the persistent grid to prefetch
    x = make((M, N), dtype, "cuda")
    w = 1 + 0.25 * make((N,), dtype, "cuda", seed=1)
    run_case(fm, x, w)
    run_case(fm, x[:7], w.float(), residual=make((7, N), torch.float32, "cuda", seed=2),
             residual_dtype=torch.float32)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [8, 1000, 4096, 65536])
@pytest.mark.parametrize("layout", ["base+2B", "odd_row_stride", "both_residual"])
def test_cuda_misaligned(fm, dtype, N, layout):
    """Per-element fallback when a pointer or row stride breaks 16-byte alignment (every config branch)."""
    M = 300 if N <= 4096 else 20
    if layout == "base+2B":
        x = _misaligned((M, N), dtype, "cuda")
        run_case(fm, x, 1 + 0.25 * make((N,), dtype, "cuda", seed=1))
    elif layout == "odd_row_stride":
        x = make((M, N + 1), dtype, "cuda")[:, :N]
        run_case(fm, x, _misaligned((N,), dtype, "cuda", seed=1) + 1)
    else:
        x = make((M, N + 3), dtype, "cuda")[:, 3:]
        r = _misaligned((M, N), dtype, "cuda", seed=2)
        run_case(fm, x, 1 + 0.25 * make((N,), dtype, "cuda", seed=1), residual=r)


@requires_cuda
@pytest.mark.parametrize("M", [1, 64, 131, 132, 133, 1000, 20000])
def test_cuda_row_counts(fm, M):
    """Grid sizing: one row per SM for small M, persistent blocks with prefetch for large M, direct dW."""
    for N in (1, 128, 4096):
        x = make((M, N), torch.bfloat16, "cuda")
        run_case(fm, x, 1 + 0.25 * make((N,), torch.bfloat16, "cuda", seed=1))
        run_case(fm, x, None, residual=make((M, N), torch.bfloat16, "cuda", seed=2))


@requires_cuda
def test_cuda_stream_and_device_guard(fm):
    x = make((512, 4096), torch.bfloat16, "cuda")
    w = make((4096,), torch.bfloat16, "cuda", seed=1)
    ref = fm.rms_norm(x, w)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        out = fm.rms_norm(x, w)
    s.synchronize()
    assert torch.equal(out, ref)
    if torch.cuda.device_count() > 1:
        x1, w1 = x.to("cuda:1"), w.to("cuda:1")
        assert torch.equal(fm.rms_norm(x1, w1).cpu(), ref.cpu())


@requires_cuda
def test_cuda_tuning_knobs_subprocess():
    """The FUSED_MLP_RMS_NORM_TUNE alternatives (no prefetch, other wide block sizes, forced packs per thread)
    are correct too: each runs in a fresh process (the knobs are read once)."""
    code = textwrap.dedent(
        f"""
        import sys, torch
        sys.path[:0] = [{str(ROOT / "tests")!r}, {str(ROOT / "tests" / "ops")!r}]
        import kernels
        from test_rms_norm import run_case, make
        fm = kernels.get_local_kernel(__import__("pathlib").Path({str(ROOT)!r}))
        for N in (256, 4096, 16384, 65536, 131072):
            M = 2000 if N <= 16384 else 64
            x = make((M, N), torch.bfloat16, "cuda")
            run_case(fm, x, 1 + 0.25 * make((N,), torch.bfloat16, "cuda", seed=1))
            run_case(fm, x[:9], None, residual=make((9, N), torch.bfloat16, "cuda", seed=2))
        print("ok")
        """
    )
    for knobs in ["fwd_prefetch=0,bwd_prefetch=0", "wide_threads=256,bwd_dw_smem=0", "fwd_iters=2,bwd_iters=1",
                  "fwd_iters=16,bwd_iters=8"]:
        env = {**os.environ, "FUSED_MLP_RMS_NORM_TUNE": knobs}
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0 and "ok" in proc.stdout, f"{knobs}:\n{proc.stdout}\n{proc.stderr}"


# ---- GPU: the backward's register kernel (FUSED_MLP_RMS_NORM_BWD) -----------------------------------------


def bwd_reg_cases(fm, knob=None):
    """The register kernel's configurations (1 pack per thread: 1..32 threads per row for N <= 256 bf16, then whole
    warps up to 1024 threads at N = 8192 bf16 / 4096 fp32; "packs=2" / "packs=4" halve / quarter that; beyond, on
    sm_90, the row split over a cluster of 2..8 CTAs), its limits (the next N falls to the rows / wide kernels), M
    against the persistent grid, and every feature: dh_extra (fused residual), fp32 residual stream, Gemma's offset,
    no weight, fp32 weight, fp32 dy. Run by test_cuda_bwd_reg_knob under each knob value in a fresh process."""
    bf = torch.bfloat16
    w_of = lambda n, dt=bf: 1 + 0.25 * make((n,), dt, "cuda", seed=1)  # noqa: E731
    if knob in ("legacy", "reg"):  # the kernel the knob names (the "dynamic" / "global" runs switch between them)
        x, w = make((64, 4096), bf, "cuda").requires_grad_(), w_of(4096).requires_grad_()
        y = fm.rms_norm(x, w)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            y.backward(make((64, 4096), bf, "cuda", seed=5))
            torch.cuda.synchronize()
        names = " ".join(e.name for e in prof.events())
        assert ("rms_norm_bwd_reg_kernel" in names) == (knob == "reg"), (knob, names)
    # The row-group kernel where it applies (aligned, a CTA that fits an SM: 768 threads x 1 pack at 80 registers,
    # 2 packs up to 608 threads at 104): forced, and auto's class on sm_90 (rows of 128..768 packs, above the few-rows
    # kernel's M). bf16 N = 12288 (2 packs: 768 threads x 104 registers) does not fit: the register kernel.
    sm90 = torch.cuda.get_device_capability()[0] == 9
    f32 = torch.float32
    for n, dtype, M in [(2048, bf, 64), (4096, bf, 64), (1024, f32, 64), (2048, bf, 1000),
                        (4096, torch.float16, 1000), (8192, bf, 1000), (512, bf, 1000), (5376, bf, 1000),
                        (6144, bf, 300), (12288, bf, 300), (2048, f32, 1000), (3072, f32, 300), (4096, f32, 300),
                        (256, f32, 1000)]:
        nv = n * dtype.itemsize // 16
        packs = {"rg,packs=1": 1, "rg,packs=2": 2}.get(knob, 1 if nv <= 768 else 2)
        fits = (nv + packs - 1) // packs <= (768 if packs == 1 else 608)
        forced = knob is not None and knob.startswith("rg") and fits
        auto = knob == "auto" and sm90 and M > 256 and 128 <= nv <= 768
        if not (knob is not None and knob.startswith("rg") or knob == "auto"):
            continue
        x, w = make((M, n), dtype, "cuda").requires_grad_(), w_of(n, dtype).requires_grad_()
        y = fm.rms_norm(x, w)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            y.backward(make((M, n), dtype, "cuda", seed=5))
            torch.cuda.synchronize()
        names = " ".join(e.name for e in prof.events())
        assert ("rms_norm_bwd_rg_kernel" in names) == (forced or auto), (knob, M, n, names)
    for dtype, ns in [(bf, (8, 256, 264, 2048, 4096, 4104, 5376, 8184, 8192, 8200, 16384, 16392, 32768, 65536,
                            131072)),
                      (torch.float16, (512, 4096, 8192, 24576)),
                      (torch.float32, (4, 256, 2048, 4096, 4100, 8192, 32768))]:
        for n in ns:
            M = max(3, min(3000, (1 << 24) // n))
            run_case(fm, make((M, n), dtype, "cuda"), w_of(n, dtype))
    for M in (1, 2, 131, 1000, 20000):  # one row; direct dW; fewer / not a multiple of / far more than the grid
        for n in (128, 2048, 4096):
            run_case(fm, make((M, n), bf, "cuda"), w_of(n))
    x = make((777, 4096), bf, "cuda")
    run_case(fm, x, None, residual=make((777, 4096), bf, "cuda", seed=2))  # dh_extra (bf16)
    run_case(fm, x, w_of(4096), residual=make((777, 4096), torch.float32, "cuda", seed=2),
             residual_dtype=torch.float32)  # fp32 h, dh_extra and dx
    run_case(fm, x, w_of(4096), offset=1.0)  # Gemma
    run_case(fm, x, None)  # no weight
    run_case(fm, x, w_of(4096, torch.float32))  # fp32 weight
    run_case(fm, x, w_of(4096, torch.float32), out_dtype=torch.float32)  # fp32 dy
    run_case(fm, x, w_of(4096), dy_dtype=torch.float32)
    x2 = make((300, 2048), bf, "cuda")
    run_case(fm, x2, w_of(2048), residual=make((300, 2048), torch.float32, "cuda", seed=3),
             residual_dtype=torch.float32)
    # dW bitwise reproducible across calls (fixed-order sums): one row slot per CTA and several (N = 2048).
    for M, n in [(5000, 4096), (3001, 2048), (2000, 8192)]:
        x, w, dy = make((M, n), bf, "cuda"), w_of(n), make((M, n), bf, "cuda", seed=4)

        def grads():
            xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
            fm.rms_norm(xr, wr).backward(dy)
            return xr.grad, wr.grad

        (dx1, dw1), (dx2, dw2) = grads(), grads()
        assert torch.equal(dx1, dx2) and torch.equal(dw1, dw2), (M, n)


def knob_cases_subprocess(var: str, knob: str, cases: str, modes: tuple[str, str], other: str) -> None:
    """Runs ``test_rms_norm.<cases>(fm, mode)`` in a fresh process (knobs are read once per process) with ``var`` set
    to ``knob``, and ``other`` (the other backward knob) unset. ``knob`` "dynamic": the launcher's first read sees
    "dynamic" (then it re-reads at every call), and the cases run under each of ``modes`` in turn; "global": the
    variable says ``modes[0]`` at the first read, FUSED_MLP_KNOBS_DYNAMIC=1 makes every knob re-read at every call,
    and the cases run under ``modes[0]`` then ``modes[1]`` with no priming (fails where the first read fixes it)."""
    code = textwrap.dedent(
        f"""
        import os, sys, torch
        sys.path[:0] = [{str(ROOT / "tests")!r}, {str(ROOT / "tests" / "ops")!r}]
        import kernels
        from test_rms_norm import {cases} as cases
        fm = kernels.get_local_kernel(__import__("pathlib").Path({str(ROOT)!r}))
        if {knob!r} == "dynamic":
            # The launcher reads the variable first here, while it says "dynamic" (then at every call).
            xp = torch.ones(2, 64, device="cuda", requires_grad=True)
            fm.rms_norm(xp, torch.ones(64, device="cuda", requires_grad=True)).sum().backward()
        if {knob!r} in ("dynamic", "global"):
            for mode in {modes!r}:
                os.environ[{var!r}] = mode
                cases(fm, mode)
        else:
            cases(fm, {knob!r})
        print("ok")
        """
    )
    env = {**os.environ, var: modes[0] if knob == "global" else knob}
    env.pop(other, None)
    env.pop("FUSED_MLP_KNOBS_DYNAMIC", None)
    if knob == "global":
        env["FUSED_MLP_KNOBS_DYNAMIC"] = "1"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and "ok" in proc.stdout, f"{knob}:\n{proc.stdout}\n{proc.stderr}"


@requires_cuda
@pytest.mark.parametrize("knob", ["auto", "reg", "reg,packs=1", "reg,packs=2,pf=0", "reg,packs=4", "reg,packs=4,cluster=2",
                                  "reg,packs=2,cluster=8", "legacy", "rg", "rg,rows=2", "rg,packs=2",
                                  "dynamic", "global"])
def test_cuda_bwd_reg_knob(knob):
    """bwd_reg_cases with FUSED_MLP_RMS_NORM_BWD forced (read once: a fresh process per value). "dynamic" re-reads
    the variable at every call: the cases run with "legacy" then "reg" in one process (the lead's A/B setup);
    "global" does the same from a first read under "legacy" through FUSED_MLP_KNOBS_DYNAMIC=1."""
    knob_cases_subprocess("FUSED_MLP_RMS_NORM_BWD", knob, "bwd_reg_cases", ("legacy", "reg"),
                          "FUSED_MLP_RMS_NORM_BWD_SMALL")


def bwd_small_cases(fm, knob):
    """The few-rows backward (one launch: dx CTAs beside dW CTAs): its packs-per-thread classes (1 / 2 / 4 packs, rows
    of 1..2048 packs), its edges (N not a multiple of the 16-byte pack and rows past 2048 packs take the other
    kernels; auto stops at M = 128, 256 for rows of >= 8 KB), every feature (dh_extra of x's dtype and fp32, Gemma's
    offset, no weight, fp32 weight, fp32 dy and dx), dW bitwise reproducible, and which kernel ran (profiler). Run
    by test_cuda_bwd_small_knob under each knob value in a fresh process."""
    bf = torch.bfloat16
    w_of = lambda n, dt=bf: 1 + 0.25 * make((n,), dt, "cuda", seed=1)  # noqa: E731
    on = knob.startswith("on")

    def takes_small(M, n, elem):
        vec = 16 // elem
        return n % vec == 0 and n // vec <= 2048 and knob != "off" and (on or M <= (256 if n * elem >= 8192 else 128))

    def kernels_of(M, n, dtype, **kw):
        x = make((M, n), dtype, "cuda").requires_grad_()
        w = w_of(n, dtype).requires_grad_()
        y = fm.rms_norm(x, w, **kw)
        dy = make((M, n), dtype, "cuda", seed=5)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            y.backward(dy)
            torch.cuda.synchronize()
        return " ".join(e.name for e in prof.events())

    for dtype, ns in [(bf, (8, 256, 264, 2048, 4096, 4100, 5376, 8192, 16384, 16392)),  # 4100: not whole packs
                      (torch.float16, (512, 4096)),
                      (torch.float32, (4, 2048, 4100, 8192, 8196))]:
        elem = torch.empty(0, dtype=dtype).element_size()
        for n in ns:
            for M in (1, 3, 128, 129):
                run_case(fm, make((M, n), dtype, "cuda"), w_of(n, dtype))
            for M in (1, 3, 16, 128, 129, 256, 257):
                names = kernels_of(M, n, dtype)
                assert ("rms_norm_bwd_small_kernel" in names) == takes_small(M, n, elem), (M, n, dtype, names)
    names = kernels_of(300, 2048, bf)
    assert ("rms_norm_bwd_small_kernel" in names) == takes_small(300, 2048, 2), names
    for M in (2, 37):
        x = make((M, 4096), bf, "cuda")
        run_case(fm, x, None, residual=make((M, 4096), bf, "cuda", seed=2))  # dh_extra (bf16)
        run_case(fm, x, w_of(4096), residual=make((M, 4096), torch.float32, "cuda", seed=2),
                 residual_dtype=torch.float32)  # fp32 h, dh_extra and dx
        run_case(fm, x, w_of(4096), offset=1.0)  # Gemma
        run_case(fm, x, None)  # no weight
        run_case(fm, x, w_of(4096, torch.float32))  # fp32 weight
        run_case(fm, x, w_of(4096, torch.float32), out_dtype=torch.float32)  # fp32 dy
        run_case(fm, x, w_of(4096), dy_dtype=torch.float32)
    # Row-strided and offset rows (aligned: the kernel reads them in place).
    run_case(fm, make((9, 4104), bf, "cuda")[:, 8:], w_of(4096))
    for M, n in [(64, 4096), (7, 8192), (130, 2048)]:
        x, w, dy = make((M, n), bf, "cuda"), w_of(n), make((M, n), bf, "cuda", seed=4)

        def grads():
            xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
            fm.rms_norm(xr, wr).backward(dy)
            return xr.grad, wr.grad

        (dx1, dw1), (dx2, dw2) = grads(), grads()
        assert torch.equal(dx1, dx2) and torch.equal(dw1, dw2), (M, n)


@requires_cuda
@pytest.mark.parametrize("knob", ["auto", "on", "on,packs=1", "on,packs=2", "off", "dynamic", "global"])
def test_cuda_bwd_small_knob(knob):
    """bwd_small_cases with FUSED_MLP_RMS_NORM_BWD_SMALL forced (read once: a fresh process per value). "dynamic"
    re-reads the variable at every call: the cases run with "off" then "on" in one process (crossover.py's A/B);
    "global" does the same from a first read under "on" through FUSED_MLP_KNOBS_DYNAMIC=1."""
    modes = ("on", "off") if knob == "global" else ("off", "on")
    knob_cases_subprocess("FUSED_MLP_RMS_NORM_BWD_SMALL", knob, "bwd_small_cases", modes, "FUSED_MLP_RMS_NORM_BWD")


# The aligned register-row forward ("reg" family) and its knob FUSED_MLP_RMS_NORM_FWD = auto | reg | legacy | l2
# [,cluster=C] [,packs=P] [,wpre=0|1] [,ld=0|1]; each knob value runs in a fresh process (read once). Shapes sit on the config table's class edges
# (kernels_src/cuda/rms_norm.cu, reg_config): N = VEC * NV with NV around 32 * pmax and 512 * pmax (pmax packs per
# thread: 8 without a residual, 4 with one of x's dtype, 2 with an fp32 stream under 16-bit x) and on the cluster path.
_REG_CASES = textwrap.dedent(
    """
    import sys, torch
    sys.path[:0] = [{tests!r}, {ops!r}]
    import kernels
    from test_rms_norm import run_case, make
    fm = kernels.get_local_kernel(__import__("pathlib").Path({root!r}))
    knob, forced = {knob!r}, {forced!r}

    def kernel_names(fn):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return " ".join(e.name for e in prof.events())

    def case(dtype, M, N, *, res=None, w="x", offset=0.0, out=None):
        x = make((M, N), dtype, "cuda")
        wt = None if w is None else (1 + 0.25 * make((N,), dtype, "cuda", seed=1)).to(
            torch.float32 if w == "f32" else dtype)
        r = None if res is None else make((M, N), res, "cuda", seed=2)
        run_case(fm, x, wt, offset=offset, residual=r, residual_dtype=res, out_dtype=out,
                 check_grads=M * N <= (1 << 22))
        # The inference ops (no rstd stored) give the training forward's bits: the same kernel.
        ops, od = fm._ops.ops, out if out is not None else dtype
        y_full, h_full, _ = ops.rms_norm_fwd(x, r, wt, 1e-6, offset, od, res)
        if r is None:
            assert torch.equal(ops.rms_norm_infer(x, wt, 1e-6, offset, od == torch.float32), y_full)
        else:
            y, h = ops.rms_norm_add_infer(x, r, wt, 1e-6, offset, od == torch.float32)
            assert torch.equal(y, y_full) and torch.equal(h, h_full)

    cap = torch.cuda.get_device_capability()
    if forced:
        # Forced cluster sizes on short and odd rows (empty slices when C exceeds the packs of a row).
        for dtype in (torch.bfloat16, torch.float32):
            vec = 16 // torch.empty(0, dtype=dtype).element_size()
            for N in (vec, 8 * vec, 5376, 4096 + vec, 8192):
                case(dtype, 5, N)
                case(dtype, 3, N, res=torch.float32, w="f32", offset=1.0, out=torch.float32)
            case(dtype, 1, 65536, w=None)
    else:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            vec = 16 // torch.empty(0, dtype=dtype).element_size()
            # Without a residual (pmax 8): packs 1/2/4/8 per thread in sub-warp / warp rows, multi-warp rows,
            # one CTA up to 4096 packs, clusters beyond.
            for nv in (1, 2, 31, 32, 33, 64, 65, 128, 129, 256, 257, 672, 1024, 2048, 4096, 4097):
                case(dtype, 37 if nv <= 1024 else 5, nv * vec)
            # A residual of x's dtype (pmax 4) and an fp32 stream (pmax 2 under 16-bit x).
            for nv in (32, 128, 129, 256, 257, 512, 1024, 1025, 2048, 2049):
                case(dtype, 9, nv * vec, res=dtype, offset=1.0)
                case(dtype, 9, nv * vec, res=torch.float32, w="f32", out=torch.float32)
        for N in (65536, 131072, 262144):  # clusters of 4 / 8 CTAs (bf16), wide kernel beyond the reg reach
            case(torch.bfloat16, 3, N)
            case(torch.bfloat16, 2, N, res=torch.float32, w=None)
            case(torch.float32, 2, N, w="f32", out=torch.float32)
        # M = 1, and M not a multiple of the rows per CTA (short rows pack 256 / tpr rows per CTA once M > 32 SMs).
        for M in (1, 4229, 33 * 132 + 7):
            case(torch.bfloat16, M, 64)
            case(torch.bfloat16, M, 2048, w=None, res=torch.bfloat16)
        case(torch.float16, 1, 65536, offset=1.0)
    x = make((64, 4096), torch.bfloat16, "cuda")
    wk = make((4096,), torch.bfloat16, "cuda", seed=3)  # the l2 kernel takes a weight of x's dtype only
    names = kernel_names(lambda: fm.rms_norm(x, wk))
    l2 = knob.startswith("l2")
    want_reg = knob != "legacy" and not l2
    assert ("rms_norm_fwd_reg_kernel" in names) == want_reg, names
    assert ("rms_norm_fwd_l2_kernel" in names) == l2, names
    if "packs=4" in knob:  # the weight loaded with the row at 4 packs (sm_90) unless the knob says wpre=0
        assert ("4, true>" in names) == (cap[0] == 9 and "wpre=0" not in knob), names
    if cap[0] >= 9:
        x = make((2, 65536), torch.bfloat16, "cuda")
        wk = make((65536,), torch.bfloat16, "cuda", seed=3)
        names = kernel_names(lambda: fm.rms_norm(x, wk))
        assert ("rms_norm_fwd_reg_kernel" in names) == want_reg, names
        assert ("rms_norm_fwd_l2_kernel" in names) == l2, names
    print("ok")
    """
)


@requires_cuda
@pytest.mark.parametrize("knob", ["reg", "reg,cluster=2", "reg,cluster=8", "reg,packs=2", "reg,packs=4,wpre=0",
                                  "reg,ld=1", "legacy", "l2", "l2,ctas=1"])
def test_cuda_reg_forward_subprocess(knob):
    """Every class of the reg forward (packs per thread, rows per CTA, clusters of 2..8 CTAs, N up to 262144; packs=2:
    the same shapes with 2 packs per thread and the threads per row to match, or the rows / wide kernels; packs=4,
    wpre=0: 4 packs with the weight read after the reduction, which the profiler confirms; ld=1: the same classes
    with the row loaded under the default cache policy, as auto does from 16384 rows on sm_90 -- a policy that
    changes no bit, so this checks the results under it, not that it took effect) under
    the 2x rule, incl. a residual of x's dtype and an fp32 stream, Gemma's offset, no weight, fp32 weight and output,
    M = 1 and partial CTAs; "legacy" runs the same shapes on the rows / wide kernels, "l2" on the two-pass l2 kernel
    (one row per CTA at a time; ctas=1: one CTA per SM, looping over rows). The profiler confirms which."""
    forced = "cluster=" in knob
    code = _REG_CASES.format(tests=str(ROOT / "tests"), ops=str(ROOT / "tests" / "ops"), root=str(ROOT), knob=knob,
                             forced=forced)
    env = {**os.environ, "FUSED_MLP_RMS_NORM_FWD": knob}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and "ok" in proc.stdout, f"{knob}:\n{proc.stdout}\n{proc.stderr}"


def _cuda_kernel_names(fn):
    """The names of the CUDA kernels `fn` launches (profiler events, after a synchronize)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events()]


@requires_cuda
def test_cuda_auto_takes_four_packs_for_many_16k_rows(fm):
    """Without a knob, sm_90 holds 16-bit rows of 1985..2048 packs (N = 16384) without a residual as 4 packs x 512
    threads once M >= 8192, the table's 8 packs below that, for shorter rows and for fp32 x; 2x rule."""
    if os.environ.get("FUSED_MLP_RMS_NORM_FWD") or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the auto dispatch of sm_90 without FUSED_MLP_RMS_NORM_FWD")

    def packs_of(fn):
        names = [n for n in _cuda_kernel_names(fn) if "rms_norm_fwd_reg_kernel<" in n]
        assert len(names) == 1, names
        return int(names[0].split("<", 1)[1].split(">", 1)[0].split(",")[3])

    for dtype, n, m, want in ((torch.bfloat16, 16384, 4096, 8), (torch.bfloat16, 16384, 8192, 4),
                              (torch.float16, 16384, 8192, 4), (torch.bfloat16, 15880, 8192, 4),
                              (torch.bfloat16, 15872, 8192, 8), (torch.bfloat16, 12800, 8192, 8),
                              (torch.float32, 8192, 8192, 8)):
        x = make((m, n), dtype, "cuda")
        w = 1 + 0.25 * make((n,), dtype, "cuda", seed=1)
        assert packs_of(lambda: fm.rms_norm(x, w, 1e-6)) == want, (dtype, m, n)
        if want == 4:
            run_case(fm, x, w, check_grads=False)


@requires_cuda
def test_cuda_auto_loads_the_weight_with_the_row_at_four_packs(fm):
    """Without a knob, sm_90 holds 16-bit rows of 129..768 packs (N = 1032..6144) without a residual as 4 packs per
    thread, and every 4-packs launch with a weight and y of x's dtype (with or without a residual of x's dtype)
    loads the weight with the row (the kernel's fifth template argument); the results equal, bit for bit, those of an
    fp32 copy of the weight (the same fp32 math, the kernel that loads the weight after the reduction) and pass the
    2x rule."""
    if (os.environ.get("FUSED_MLP_RMS_NORM_FWD") or os.environ.get("FUSED_MLP_RMS_NORM_SMALL")
            or torch.cuda.get_device_capability()[0] != 9):
        pytest.skip("the auto dispatch of sm_90 without FUSED_MLP_RMS_NORM_FWD / _SMALL")

    def reg_args(fn):
        names = [n for n in _cuda_kernel_names(fn) if "rms_norm_fwd_reg_kernel<" in n]
        assert len(names) == 1, names
        return [a.strip() for a in names[0].split("<", 1)[1].split(">", 1)[0].split(",")]

    for dtype in (torch.bfloat16, torch.float16):
        for n, packs in ((1024, 4), (1032, 4), (2048, 4), (2304, 4), (4096, 4), (5376, 4), (6144, 4), (6152, 8)):
            x = make((1100, n), dtype, "cuda")  # above the few-rows kernel's limit (1024 rows at N = 2048)
            w = 1 + 0.25 * make((n,), dtype, "cuda", seed=1)
            r = make((1100, n), dtype, "cuda", seed=2)
            args = reg_args(lambda: fm.rms_norm(x, w, 1e-6))
            assert int(args[3]) == packs and args[4] == ("true" if packs == 4 else "false"), (dtype, n, args)
            y = fm.rms_norm(x, w, 1e-6)
            assert torch.equal(y, fm.rms_norm(x, w.float(), 1e-6, out_dtype=dtype)), (dtype, n)
            assert "true" not in reg_args(lambda: fm.rms_norm(x, w.float(), 1e-6, out_dtype=dtype))
            run_case(fm, x, w, check_grads=False)
            yg = fm.rms_norm(x, w, 1e-6, offset=1.0)  # Gemma's (1 + w)
            assert torch.equal(yg, fm.rms_norm(x, w.float(), 1e-6, offset=1.0, out_dtype=dtype)), (dtype, n)
            y, h = fm.rms_norm(x, w, 1e-6, residual=r)
            ya, ha = fm.rms_norm(x, w.float(), 1e-6, residual=r, out_dtype=dtype)
            assert torch.equal(y, ya) and torch.equal(h, ha), (dtype, n)
            args = reg_args(lambda: fm.rms_norm(x, w, 1e-6, residual=r))
            assert args[4] == ("true" if args[3] == "4" else "false"), (dtype, n, args)


_LEAN_CASES = textwrap.dedent(
    """
    import os, re, sys, torch
    sys.path[:0] = [{tests!r}, {ops!r}]
    import kernels
    from test_rms_norm import run_case, make
    fm = kernels.get_local_kernel(__import__("pathlib").Path({root!r}))
    ops = fm._ops.ops
    sm90 = torch.cuda.get_device_capability()[0] == 9  # elsewhere a variant that spills is declined (reg kernel)

    def names(fn):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return " ".join(e.name for e in prof.events())

    def under(knob, fn):
        os.environ["FUSED_MLP_RMS_NORM_FWD"] = "dynamic," + knob
        try:
            return fn()
        finally:
            os.environ["FUSED_MLP_RMS_NORM_FWD"] = "dynamic,auto"

    for dtype in (torch.bfloat16, torch.float16):
        for p, t in ((1, 512), (2, 256), (2, 512), (4, 256), (4, 512)):
            n = 8 * p * t
            for m, strided in ((37, False), (5, True)):
                xb = make((m, n + 8 if strided else n), dtype, "cuda")
                x = xb[:, :n] if strided else xb
                w = 1 + 0.25 * make((n,), dtype, "cuda", seed=1)
                rb = make((m, n + 8 if strided else n), dtype, "cuda", seed=2)
                r = rb[:, :n] if strided else rb
                for offset in (0.0, 1.0):
                    for res in (None, r):
                        # the training forward (rstd stored) and the inference ops, lean against reg at the same
                        # packs and threads per row: the same bits
                        fwd = lambda: ops.rms_norm_fwd(x, res, w, 1e-6, offset, dtype, None if res is None else dtype)
                        inf = lambda: (ops.rms_norm_infer(x, w, 1e-6, offset, False) if res is None
                                       else ops.rms_norm_add_infer(x, res, w, 1e-6, offset, False))
                        knob = f"lean,packs={{p}}"
                        got = names(lambda: under(knob, fwd))
                        lean_run = re.search(rf"rms_norm_fwd_lean_kernel<[^>]*, {{p}}, {{t}}>", got) is not None
                        assert lean_run or not sm90, (knob, got)
                        lean, lean_i = under(knob, fwd), under(knob, inf)
                        reg, reg_i = under(f"reg,packs={{p}}", fwd), under(f"reg,packs={{p}}", inf)
                        assert "rms_norm_fwd_lean_kernel" not in names(lambda: under(f"reg,packs={{p}}", fwd))
                        for a, b in zip(lean, reg):  # y, h (or None), rstd
                            assert (a is None and b is None) or torch.equal(a, b), (dtype, p, t, m, strided, offset)
                        # the row loads' cache policy (ld=1: default, 0: evict-first) changes no bit, in either kernel
                        for k in (knob, f"reg,packs={{p}}"):
                            for a, b in zip(under(k + ",ld=1", fwd), under(k + ",ld=0", fwd)):
                                assert (a is None and b is None) or torch.equal(a, b), (k, dtype, m, offset)
                        for a, b in zip(lean_i if res is not None else (lean_i,), reg_i if res is not None else (reg_i,)):
                            assert torch.equal(a, b), (dtype, p, t, m, strided, offset)
                        under(knob, lambda: run_case(fm, x, w, offset=offset, residual=res,
                                                     residual_dtype=None if res is None else dtype))
    # Not the lean kernel's variants: fp32 weight or output, no weight, an fp32 stream, rows of no instantiated pair
    x = make((64, 8192), torch.bfloat16, "cuda")
    w = 1 + 0.25 * make((8192,), torch.bfloat16, "cuda", seed=1)
    for fn in (lambda: fm.rms_norm(x, w.float(), 1e-6), lambda: fm.rms_norm(x, w, 1e-6, out_dtype=torch.float32),
               lambda: fm.rms_norm(x, None, 1e-6),
               lambda: fm.rms_norm(x, w, 1e-6, residual=x.float(), residual_dtype=torch.float32),
               lambda: fm.rms_norm(make((64, 8200), torch.bfloat16, "cuda"), w.new_ones(8200), 1e-6)):
        assert "rms_norm_fwd_lean_kernel" not in names(lambda: under("lean", fn))
    print("ok")
    """
)


@requires_cuda
def test_cuda_lean_forward_subprocess():
    """The lean forward kernel (FUSED_MLP_RMS_NORM_FWD=lean,packs=P) at each instantiated (packs, threads) pair,
    bf16 and fp16, plain, Gemma's offset and a residual of x's dtype, contiguous and strided rows: the profiler
    confirms the kernel, y, h and the stored rstd equal the reg kernel's at the same packs and threads per row bit for
    bit (training forward and inference ops), the 2x rule and the gradients hold; the variants it does not cover
    take the other kernels."""
    code = _LEAN_CASES.format(tests=str(ROOT / "tests"), ops=str(ROOT / "tests" / "ops"), root=str(ROOT))
    env = {**os.environ, "FUSED_MLP_RMS_NORM_FWD": "dynamic,auto"}
    env.pop("FUSED_MLP_RMS_NORM_SMALL", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and "ok" in proc.stdout, f"{proc.stdout}\n{proc.stderr}"


@requires_cuda
def test_cuda_auto_takes_the_lean_kernel_for_8k_rows(fm):
    """Without a knob, sm_90 takes the lean kernel for >= 1024 16-bit rows of N = 8192 with a weight and y of x's
    dtype (with or without a residual of x's dtype), the reg family for fewer rows and for the other variants; 2x
    rule."""
    if (os.environ.get("FUSED_MLP_RMS_NORM_FWD") or os.environ.get("FUSED_MLP_RMS_NORM_SMALL")
            or torch.cuda.get_device_capability()[0] != 9):
        pytest.skip("the auto dispatch of sm_90 without FUSED_MLP_RMS_NORM_FWD / _SMALL")
    for dtype in (torch.bfloat16, torch.float16):
        for m, n, want in ((1024, 8192, True), (4100, 8192, True), (8192, 8192, True), (1023, 8192, False),
                           (4096, 4096, False), (4096, 16384, False)):
            x = make((m, n), dtype, "cuda")
            w = 1 + 0.25 * make((n,), dtype, "cuda", seed=1)
            r = make((m, n), dtype, "cuda", seed=2)
            for kwargs, ok in ((dict(), want), (dict(residual=r), want), (dict(offset=1.0), want),
                               (dict(out_dtype=torch.float32), False),
                               (dict(residual=r.float(), residual_dtype=torch.float32), False)):
                got = " ".join(_cuda_kernel_names(lambda: fm.rms_norm(x, w, 1e-6, **kwargs)))
                assert ("rms_norm_fwd_lean_kernel" in got) == ok, (dtype, m, n, list(kwargs), got)
                assert ("rms_norm_fwd_reg_kernel" in got) == (not ok), (dtype, m, n, list(kwargs), got)
            got = " ".join(_cuda_kernel_names(lambda: fm.rms_norm(x, w.float(), 1e-6)))
            assert "rms_norm_fwd_lean_kernel" not in got and "rms_norm_fwd_reg_kernel" in got
            if want and m == 1024:
                run_case(fm, x, w, check_grads=True)
                run_case(fm, x, w, offset=1.0, residual=r, check_grads=False)


@requires_cuda
def test_cuda_auto_takes_the_l2_kernel_for_long_rows(fm):
    """Without a knob, the forward takes the l2 kernel for >= 1024 16-bit rows of 32768..65536 elements with a weight
    and y of x's dtype (with or without a residual of x's dtype) on sm_90 (where the class was measured), and the reg
    family around that class, for fewer rows, or for the other variants (no weight, fp32 weight or output, an fp32
    stream); the l2 results under the 2x rule."""
    if os.environ.get("FUSED_MLP_RMS_NORM_FWD") or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the auto dispatch of sm_90 without FUSED_MLP_RMS_NORM_FWD")

    def names_of(fn):
        return " ".join(_cuda_kernel_names(fn))

    for dtype in (torch.bfloat16, torch.float16):
        for n, l2 in ((24576, False), (32768, True), (40960, True), (65536, True), (131072, False)):
            for m in (3, 1024):
                x = make((m, n), dtype, "cuda")
                w = (1 + 0.25 * make((n,), dtype, "cuda", seed=1))
                r = make((m, n), dtype, "cuda", seed=2)
                for kwargs, want in ((dict(weight=w), l2), (dict(weight=w, residual=r), l2),
                                     (dict(weight=None), False), (dict(weight=w.float()), False),
                                     (dict(weight=w, out_dtype=torch.float32), False),
                                     (dict(weight=w, residual=r.float(), residual_dtype=torch.float32), False)):
                    want = want and m >= 1024
                    names = names_of(lambda: fm.rms_norm(x, kwargs["weight"], 1e-6,
                                                         **{k: v for k, v in kwargs.items() if k != "weight"}))
                    assert ("rms_norm_fwd_l2_kernel" in names) == want, (dtype, m, n, list(kwargs), names)
                    if want and n in (32768, 65536):
                        run_case(fm, x, kwargs["weight"], residual=kwargs.get("residual"), check_grads=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_fast_path_matches_the_full_path(fm, device, dtype):
    """Training calls without a residual go straight to the autograd Function; an ``eps`` that is a float subclass
    (numpy's float64) takes the full, checked path: the same output and gradient bits. Arguments only the full path
    accepts (a narrower half weight, a strided N-D input) or rejects (a wrong weight shape) behave as documented."""
    np = pytest.importorskip("numpy")
    g = torch.Generator().manual_seed(7)
    x0 = torch.randn(3, 5, 64, generator=g).to(device=device, dtype=dtype)
    w0 = (1 + 0.1 * torch.randn(64, generator=g)).to(device=device, dtype=dtype)
    dy = torch.randn(3, 5, 64, generator=g).to(device=device, dtype=dtype)
    got = []
    for eps in (1e-6, np.float64(1e-6)):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = fm.rms_norm(x, w, eps, offset=1.0)
        y.backward(dy)
        got.append((y, x.grad, w.grad))
    for a, b in zip(*got):
        assert torch.equal(a, b)
    # a strided N-D input and a narrower half weight: converted by the full path, same values as contiguous ones
    xs = x0.transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    wn = w0.to(other).requires_grad_()
    y = fm.rms_norm(xs, wn, 1e-6)
    ref = fm.rms_norm(x0.clone().requires_grad_(), wn.detach().float().requires_grad_(), 1e-6)
    assert not xs.is_contiguous() and torch.equal(y, ref)
    y.backward(dy)
    assert xs.grad is not None and wn.grad is not None and wn.grad.dtype == other
    with pytest.raises(ValueError, match="weight must have shape"):
        fm.rms_norm(x0.clone().requires_grad_(), w0[:32], 1e-6)
