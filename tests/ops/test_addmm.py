"""addmm / linear: act(bias + mat1 @ mat2) with the bias and the GeLU on the fp32 accumulator, rounded once.

Checked against fp64 references: element-wise "rounded once" bounds, the flash-attention 2x rule for gradients,
the precision evidence of background fact 1 (ours <= torch's fused path < the "mm rounded, then add" path, on one
layer and through a 24-layer bf16 stack), strided / transposed / misaligned operands, empty and tiny shapes, bad
input, opcheck, torch.compile without recompiles, the cuBLASLt fallbacks (forced), and fp32 gradients reaching the
backward uncast. Runs on the CPU here and on the GPU machine (CUDA-only tests skip cleanly without a GPU).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from _utils import assert_2x_rule, max_err
from conftest import CUDA, requires_cuda

ACTS = [None, "gelu_tanh", "gelu"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Unit roundoff (half an ulp, relative) of one round-to-nearest, and the absolute floor below the normal range.
UNIT = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
TINY = {torch.float32: 2.0**-149, torch.float16: 2.0**-25, torch.bfloat16: 2.0**-133}

# (M, K, N): awkward sizes on purpose (N = 1 and 3, odd K, M = 1).
SHAPES = [(1, 64, 48), (7, 96, 200), (83, 128, 3), (33, 40, 1), (16, 130, 127)]
SEED = 0  # base seed of the generated operands (tools may sweep it to measure the tolerances' margins)
SHAPES_CUDA = [(2048, 512, 1000), (257, 1024, 2304), (64, 4096, 1001)]


def _act64(z: torch.Tensor, act: str | None) -> torch.Tensor:
    if act == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if act == "gelu":
        return F.gelu(z)
    return z


def _torch_same_dtype(bias, x, w_kn, act):
    """How PyTorch users compute it in the input dtype: a fused linear (bias in the GEMM), then a GeLU."""
    b = bias.to(x.dtype) if bias is not None else None
    y = F.linear(x, w_kn.t(), b)
    if act == "gelu_tanh":
        y = F.gelu(y, approximate="tanh")
    elif act == "gelu":
        y = F.gelu(y)
    return y


def assert_rounded_once(out: torch.Tensor, bias, x: torch.Tensor, w_kn: torch.Tensor, act, *, name="out"):
    """Every element is the fp64 value rounded once to out.dtype, up to the fp32 accumulation error:
    |out - ref| <= u*|ref| + (1 + u) * 1.13 * gamma_K * (|x| @ |w| + |b|) + act slack + subnormal floor.
    gamma_K = K * 2^-24 bounds fp32 summation in any order; 1.13 bounds |gelu'|; the act slack covers the fp32
    evaluation of tanh/erf (cuBLASLt's epilogue measured 5e-6 from the fp32 formula). Two roundings (mm rounded,
    then + bias) break this bound wherever both round the same way."""
    dt = out.dtype
    k = x.shape[-1]
    x64 = x.double().reshape(math.prod(x.shape[:-1]), k)
    w64 = w_kn.double()
    z = x64 @ w64
    mag = x64.abs() @ w64.abs()
    if bias is not None:
        z = z + bias.double().reshape(-1)
        mag = mag + bias.double().abs().reshape(-1)
    ref = _act64(z, act)
    acc = 1.13 * k * 2.0**-24 * mag
    slack = (1e-5 + 2e-6 * ref.abs()) if act is not None else 0.0
    bound = UNIT[dt] * ref.abs() + (1 + UNIT[dt]) * acc + slack + TINY[dt]
    err = (out.double().reshape(ref.shape) - ref).abs()
    bad = err > bound
    assert not bool(bad.any()), (
        f"{name}: {int(bad.sum())} elements not rounded once; worst err {err.max().item():.3g}, "
        f"at ref {ref[bad][0].item():.6g} err {err[bad][0].item():.3g} bound {bound[bad][0].item():.3g}"
    )


def _make(shape, dtype, device, *, seed=0, bias=True, layout="linear"):
    """x [M, K]; w_kn [K, N] (for layout 'linear' a [N, K] weight seen through .t()); bias [N]."""
    m, k, n = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(n, k, generator=g) / max(k, 1) ** 0.5).to(device=device, dtype=dtype)
    b = torch.randn(n, generator=g).to(device=device, dtype=dtype) if bias else None
    w_kn = w.t() if layout == "linear" else w.t().contiguous()
    return x, w_kn, b


def _call(fm, layout, bias, x, w_kn, act):
    if layout == "linear":
        return fm.linear(x, w_kn.t(), bias, activation=act)
    return fm.addmm(bias, x, w_kn, activation=act)


# ---- forward ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES + (SHAPES_CUDA if CUDA else []))
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["linear", "conv1d"])
def test_forward_rounded_once(fm, device, shape, act, dtype, layout):
    if device == "cpu" and shape in SHAPES_CUDA:
        pytest.skip("large shapes run on the GPU only")
    x, w_kn, b = _make(shape, dtype, device, layout=layout)
    out = _call(fm, layout, b, x, w_kn, act)
    assert out.shape == (shape[0], shape[2]) and out.dtype == dtype and out.device == x.device
    assert_rounded_once(out, b, x, w_kn, act)
    ref32 = fm.addmm_reference(b, x, w_kn, activation=act)
    assert_2x_rule(out, ref32, _torch_same_dtype(b, x, w_kn, act))


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_leading_dims_and_bias_forms(fm, device, act, dtype):
    x, w_kn, b = _make((30, 64, 40), dtype, device)
    x3 = x.reshape(2, 3, 5, 64)
    ref = fm.addmm(b, x, w_kn, activation=act)
    for bias in (b, b.reshape(1, 40), b.reshape(1, 1, 40)):
        out = fm.addmm(bias, x3, w_kn, activation=act)
        assert out.shape == (2, 3, 5, 40)
        torch.testing.assert_close(out.reshape(30, 40), ref, rtol=0, atol=0)
    # scalar-like biases broadcast over N
    for bias in (b[:1].reshape(()), b[:1]):
        out = fm.addmm(bias, x, w_kn, activation=act)
        assert_rounded_once(out, bias.reshape(1).expand(40), x, w_kn, act)
    # 1-D input (linear of a single vector)
    out1 = fm.linear(x[3], w_kn.t(), b, activation=act)
    assert out1.shape == (40,)
    torch.testing.assert_close(out1, ref[3], rtol=0, atol=UNIT[dtype] * 4 * ref[3].abs().max().item())


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp32_bias_with_half_inputs_is_added_in_fp32(fm, device, act, dtype):
    x, w_kn, _ = _make((65, 96, 72), dtype, device)
    b32 = (torch.randn(72, generator=torch.Generator().manual_seed(2)) * 3 + 0.1234567).to(device)  # not a half
    out = fm.addmm(b32, x, w_kn, activation=act)
    assert out.dtype == dtype
    assert_rounded_once(out, b32, x, w_kn, act)


@pytest.mark.parametrize("act", ACTS)
def test_bias_none(fm, device, act):
    x, w_kn, _ = _make((19, 64, 24), torch.bfloat16, device)
    out = fm.linear(x, w_kn.t(), None, activation=act)
    assert_rounded_once(out, None, x, w_kn, act)
    out2 = fm.addmm(None, x, w_kn, activation=act)
    torch.testing.assert_close(out, out2, rtol=0, atol=0)


@requires_cuda
@pytest.mark.parametrize("shape", [(64, 16384, 2048), (33, 16384, 2048), (16, 8192, 2048), (64, 14336, 4096),
                                   (83, 128, 3), (7, 96, 200), (1, 4096, 48)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_sized_plain_gemm_rounded_once(fm, shape, dtype):
    """The plain (bias-free, activation-free) cuBLASLt GEMM gets a workspace for split-K at decode sizes with a long
    K; its partial sums must stay fp32 (one rounding) and be reduced in a fixed order (the same bits twice)."""
    x, w_kn, _ = _make(shape, dtype, "cuda", bias=False)
    op = fm._ops.ops.addmm_fwd
    out = op(None, x, w_kn, "none", False, [shape[0], shape[2]])[0]
    assert_rounded_once(out, None, x, w_kn, None)
    again = op(None, x, w_kn, "none", False, [shape[0], shape[2]])[0]
    assert torch.equal(out, again)


def test_gelu_variants_are_the_named_functions(fm, device):
    """'gelu_tanh' is the tanh approximation, 'gelu' the exact erf GeLU (they differ by up to 4.7e-4; fp32
    resolves it)."""
    x, w_kn, b = _make((64, 64, 256), torch.float32, device)
    x = x * 3
    z = x.double() @ w_kn.double() + b.double()
    out_t = fm.addmm(b, x, w_kn, activation="gelu_tanh").double()
    out_e = fm.addmm(b, x, w_kn, activation="gelu").double()
    assert (F.gelu(z, approximate="tanh") - F.gelu(z)).abs().max() > 1e-4
    assert (out_t - F.gelu(z, approximate="tanh")).abs().max() < 3e-5
    assert (out_e - F.gelu(z)).abs().max() < 3e-5
    assert (out_t - F.gelu(z)).abs().max() > 1e-4 and (out_e - F.gelu(z, approximate="tanh")).abs().max() > 1e-4


# ---- strided, transposed, misaligned operands --------------------------------------------------------------

SM, SK, SN = 37, 72, 56


def _strided_cases():
    """name -> (x base shape, x view fn, w base shape, w view fn). The view of the base is what the op gets:
    x [SM, SK], w [SK, SN] (a Conv1D-style [K, N] operand; .t() views are nn.Linear weights)."""
    m, k, n = SM, SK, SN
    lin = ((n, k), lambda w: w.t())  # nn.Linear weight, contiguous
    xc = ((m, k), lambda x: x)
    return {
        "x rows strided": (((2 * m, k + 3), lambda x: x[::2, :k]), lin),
        "x misaligned, odd ld": (((m + 1, k + 3), lambda x: x[:m, 1 : k + 1]), lin),
        "x column-strided (copied)": (((m, 2 * k), lambda x: x[:, ::2]), lin),
        "Linear weight slice (ld > K)": (xc, ((n + 8, k + 9), lambda w: w[:n, :k].t())),
        "Linear weight misaligned": (xc, ((n + 8, k + 9), lambda w: w[1 : n + 1, 1 : k + 1].t())),
        "weight stored [K, N] contiguous": (xc, ((k, n), lambda w: w)),
        "Conv1D weight slice (ld > N)": (xc, ((k, n + 5), lambda w: w[:, :n])),
        "weight both strides != 1 (copied)": (xc, ((2 * k, 2 * n), lambda w: w[::2, ::2])),
        "weight broadcast, stride 0 (copied)": (xc, ((1, n), lambda w: w.expand(k, n))),
    }


def _bias_views():
    """bias base shape and views: contiguous, misaligned (offset 1 element), strided."""
    return (2 * SN + 1,), [lambda b: b[:SN], lambda b: b[1 : SN + 1], lambda b: b[::2][:SN]]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_operands(fm, device, act, dtype):
    g = torch.Generator().manual_seed(3)
    bshape, bviews = _bias_views()
    b_base = torch.randn(*bshape, generator=g).to(device=device, dtype=dtype)
    for name, ((xs, xv), (ws, wv)) in _strided_cases().items():
        x = xv(torch.randn(*xs, generator=g).to(device=device, dtype=dtype))
        w_kn = wv((torch.randn(*ws, generator=g) / SK**0.5).to(device=device, dtype=dtype))
        for bv in bviews:
            bias = bv(b_base)
            out = fm.addmm(bias, x, w_kn, activation=act)
            assert_rounded_once(out, bias, x, w_kn, act, name=name)


@pytest.mark.parametrize("act", [None, "gelu_tanh", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_operands_backward(fm, device, act, dtype):
    g = torch.Generator().manual_seed(4)
    bshape, bviews = _bias_views()
    for name, ((xs, xv), (ws, wv)) in _strided_cases().items():
        bv = bviews[1]  # misaligned bias
        bases = [
            torch.randn(*xs, generator=g),
            torch.randn(*ws, generator=g) / SK**0.5,
            torch.randn(*bshape, generator=g),
        ]
        gy = torch.randn(SM, SN, generator=g).to(device=device, dtype=dtype)
        ours = [t.to(device=device, dtype=dtype).clone().requires_grad_() for t in bases]
        fm.addmm(bv(ours[2]), xv(ours[0]), wv(ours[1]), activation=act).backward(gy)
        ref = [t.to(device=device, dtype=torch.float64).clone().requires_grad_() for t in bases]
        _act64(xv(ref[0]) @ wv(ref[1]) + bv(ref[2]), act).backward(gy.double())
        theirs = [t.to(device=device, dtype=dtype).clone().requires_grad_() for t in bases]
        _torch_same_dtype(bv(theirs[2]), xv(theirs[0]), wv(theirs[1]), act).backward(gy)
        for o, r, t, what in zip(ours, ref, theirs, ("dx", "dw", "db")):
            assert_2x_rule(o.grad, r.grad, t.grad, name=f"{name}: {what}")


# ---- backward -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 64, 48), (83, 128, 3), (300, 96, 200)] + ([(4096, 1024, 1000)] if CUDA else []))
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["linear", "conv1d"])
def test_backward(fm, device, shape, act, dtype, layout):
    if device == "cpu" and shape[0] == 4096:
        pytest.skip("large shape runs on the GPU only")
    m, k, n = shape
    x, w_kn, b = _make(shape, dtype, device, layout=layout, seed=SEED)
    w_param = w_kn.t().contiguous() if layout == "linear" else w_kn.contiguous()  # the module's parameter
    gy = torch.randn(m, n, generator=torch.Generator().manual_seed(SEED + 1)).to(device=device, dtype=dtype)

    def run(xx, ww, bb, fn):
        xx, ww, bb = (t.detach().clone().requires_grad_() for t in (xx, ww, bb))
        fn(xx, ww, bb).backward(gy.to(xx.dtype))
        return xx.grad, ww.grad, bb.grad

    if layout == "linear":
        ours = run(x, w_param, b, lambda xx, ww, bb: fm.linear(xx, ww, bb, activation=act))
        ref = run(x.double(), w_param.double(), b.double(), lambda xx, ww, bb: _act64(F.linear(xx, ww, bb), act))
        theirs = run(x, w_param, b, lambda xx, ww, bb: _torch_same_dtype(bb, xx, ww.t(), act))
    else:
        ours = run(x, w_param, b, lambda xx, ww, bb: fm.addmm(bb, xx, ww, activation=act))
        ref = run(x.double(), w_param.double(), b.double(), lambda xx, ww, bb: _act64(torch.addmm(bb, xx, ww), act))
        theirs = run(x, w_param, b, lambda xx, ww, bb: _torch_same_dtype(bb, xx, ww, act))
    for o, r, t, what in zip(ours, ref, theirs, ("dx", "dw", "db")):
        assert o.dtype == dtype
        assert_2x_rule(o, r, t, name=what)
    # the weight gradient has the parameter's own layout (no copy in AccumulateGrad)
    assert ours[1].stride() == w_param.stride()


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_pack_and_scalar_paths_agree(fm, device, act, dtype):
    """dY whose rows hold whole 16-byte packs takes the vector column-sum pass, a dY view offset by one element the
    scalar one: with an activation the same dX and dW bits (dZ is elementwise), db within the 2x rule of the fp64 sum and within a
    rounding step of each other (the chunking of the sum differs)."""
    shapes = [(300, 96, 256), (37, 64, 1000)] + ([(4096, 256, 14336)] if device == "cuda" else [])
    ops = fm._ops.ops
    for m, k, n in shapes:
        x, w_kn, b = _make((m, k, n), dtype, device, seed=m + n)
        pre = torch.addmm(b, x, w_kn) if act else None
        g = torch.Generator().manual_seed(n)
        base = torch.randn(m, n + 1, generator=g).to(device=device, dtype=dtype)
        dy_packed, dy_offset = base[:, :n].contiguous(), base[:, 1:]
        dy_offset.copy_(dy_packed)
        act_name = act or "none"
        got = [ops.addmm_bwd(dy, pre, x, w_kn, act_name, True, True, False, True, dtype) for dy in (dy_packed, dy_offset)]
        if act is not None:  # dZ is the pass's own output (without an activation the GEMMs read dY's own layout)
            assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1]), (m, k, n)
        z64 = (x.double() @ w_kn.double() + b.double()).requires_grad_()
        _act64(z64, act).backward(dy_packed.double())
        z_same = (x.float() @ w_kn.float() + b.float()).to(dtype).requires_grad_()
        _act64(z_same.float(), act).to(dtype).backward(dy_packed)
        for db in (got[0][2], got[1][2]):
            assert_2x_rule(db, z64.grad.sum(0), z_same.grad.float().sum(0).to(dtype), name=f"db {(m, k, n)}")
        torch.testing.assert_close(got[0][2].float(), got[1][2].float(), rtol=2 ** -7, atol=1e-5)


def test_backward_partial_requires_grad(fm, device):
    x, w_kn, b = _make((40, 64, 32), torch.bfloat16, device)
    w = w_kn.t().contiguous()
    for req in [(True, False, False), (False, True, False), (False, False, True), (True, False, True)]:
        xx, ww, bb = (t.clone().requires_grad_(r) for t, r in zip((x, w, b), req))
        y = fm.linear(xx, ww, bb, activation="gelu")
        y.sum().backward()
        for t, r in zip((xx, ww, bb), req):
            assert (t.grad is not None) == r


@pytest.mark.parametrize("act", ACTS)
def test_backward_gets_no_zero_filled_preactivation_gradient(fm, device, act, monkeypatch):
    """The saved pre-activation z is a (non-differentiable) output of the autograd Function; with materialized
    gradients the engine would allocate and zero-fill an [M, N] tensor for it on every backward."""
    fn = sys.modules[fm.addmm.__module__]._AddmmFunction
    seen = []
    orig = fn.backward

    def spy(ctx, dy, dz):
        seen.append(dz)
        return orig(ctx, dy, dz)

    monkeypatch.setattr(fn, "backward", staticmethod(spy))
    x, w_kn, b = _make((24, 32, 16), torch.bfloat16, device)
    b = b.float()  # keeps the Function where bf16 would take ATen's / oneDNN's ops on the CPU (test_cpu_16bit_*_training*)
    w = w_kn.t().contiguous().requires_grad_()
    y = fm.linear(x, w, b, activation=act)
    y.float().sum().backward()
    assert len(seen) == 1 and seen[0] is None
    assert w.grad is not None and w.grad.shape == w.shape


def test_backward_is_deterministic(fm, device):
    x, w_kn, b = _make((1000, 128, 96), torch.bfloat16, device)
    grads = []
    for _ in range(2):
        w = w_kn.t().contiguous().requires_grad_()
        bb = b.clone().requires_grad_()
        fm.linear(x, w, bb, activation="gelu_tanh").float().pow(2).sum().backward()
        grads.append((w.grad, bb.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


@pytest.mark.skipif(
    not hasattr(torch.autograd.function.FunctionCtx, "set_output_grad_dtype"),
    reason="ctx.set_output_grad_dtype needs torch >= 2.14",
)
@pytest.mark.parametrize("act", ACTS)
def test_fp32_grad_reaches_backward_uncast(fm, device, act):
    """A bf16 output consumed by an fp32 op gets an fp32 gradient; declared None, it reaches the kernel uncast, so
    the fp32 bias gradient is the fp32 sum of it (cast to bf16 first, the error would be ~100x larger).
    Operands are small multiples of 1/16 so that Z = x @ w + b is exact in bf16 and gelu'(Z) is known exactly."""
    m, k, n = 4096, 64, 32
    g = torch.Generator().manual_seed(5)
    x = torch.randint(-2, 3, (4, m // 4, k), generator=g).to(device=device, dtype=torch.bfloat16)
    w = (torch.randint(-1, 2, (n, k), generator=g) / 16).to(device=device, dtype=torch.bfloat16).requires_grad_()
    b = torch.randint(-2, 3, (n,), generator=g).float().to(device).requires_grad_()  # fp32 bias: fp32 grad
    up = torch.randn(4, m // 4, n, generator=g).to(device)  # fp32 upstream gradient
    y = fm.linear(x, w, b, activation=act)
    assert y.dtype == torch.bfloat16
    (y * up).sum().backward()
    z64 = F.linear(x.double(), w.detach().double(), b.detach().double())
    assert torch.equal(z64.to(torch.bfloat16).double(), z64)  # Z exact in bf16
    db_ref = (up.double() * _grad_act64(z64, act)).reshape(-1, n).sum(0)
    # fp32 sum of 4096 fp32 values ~ N(0, 1): error ~1e-4; a bf16-cast gradient gives ~1e-2 and more
    assert max_err(b.grad, db_ref) < 2e-3, max_err(b.grad, db_ref)
    db_cast = (up.to(torch.bfloat16).double() * _grad_act64(z64, act)).reshape(-1, n).sum(0)
    assert max_err(db_cast, db_ref) > 5e-3  # the test can tell the two apart


def _grad_act64(z: torch.Tensor, act) -> torch.Tensor:
    if act is None:
        return torch.ones_like(z)
    zz = z.detach().clone().requires_grad_()
    _act64(zz, act).sum().backward()
    return zz.grad


# ---- empty and tiny shapes --------------------------------------------------------------------------------------


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mkn", [(0, 32, 16), (1, 32, 16), (5, 0, 16), (5, 32, 0), (1, 1, 1), (3, 17, 1), (2, 1, 9)])
def test_empty_and_tiny(fm, device, act, dtype, mkn):
    m, k, n = mkn
    x, w_kn, b = _make(mkn, dtype, device)
    xl, wl, bl = (t.clone().requires_grad_() for t in (x, w_kn.t().contiguous(), b))
    y = fm.linear(xl, wl, bl, activation=act)
    assert y.shape == (m, n) and y.dtype == dtype
    if y.numel():
        assert_rounded_once(y, b, x, w_kn, act)
    gy = torch.randn(m, n, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    y.backward(gy)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (xl, wl, bl))
    _act64(F.linear(x64, w64, b64), act).backward(gy.double())
    xt, wt, bt = (t.detach().clone().requires_grad_() for t in (xl, wl, bl))
    _torch_same_dtype(bt, xt, wt.t(), act).backward(gy)
    for got, want, theirs, what in ((xl.grad, x64.grad, xt.grad, "dx"), (wl.grad, w64.grad, wt.grad, "dw"),
                                    (bl.grad, b64.grad, bt.grad, "db")):
        assert got.shape == want.shape, what
        assert_2x_rule(got, want, theirs, name=what)


# ---- precision evidence (background fact 1) ---------------------------------------------------------------------


def _torch_gelu_flavour(device: str) -> str:
    """torch._addmm_activation(use_gelu=True): cuBLASLt's GELU epilogue (tanh) on CUDA, erf GeLU on the CPU
    (verified in the research notes; bf16 cannot tell the two apart, so it is fixed here, not measured)."""
    return "gelu_tanh" if device == "cuda" else "gelu"


@pytest.mark.parametrize("with_gelu", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_precision_evidence(fm, device, dtype, with_gelu):
    """Max error vs fp64: ours <= torch's fused path (torch.addmm / torch._addmm_activation) and clearly below the
    "mm rounded to half, then + bias (then GeLU)" path. Measured on an H200 at 4096^3 bf16 with GeLU:
    fused 0.0156, unfused 0.031. The only slack is 2^-10 relative for fp32 accumulation-order noise at a rounding
    boundary (seen: 9e-8 on 0.00195)."""
    m, k, n = (4096, 4096, 4096) if device == "cuda" else (384, 768, 512)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(k, n, generator=g) / k**0.5).to(device=device, dtype=dtype)
    b = torch.randn(n, generator=g).to(device=device, dtype=dtype)  # same magnitude as x @ w
    act = _torch_gelu_flavour(device) if with_gelu else None
    ref = _act64(torch.addmm(b.double(), x.double(), w.double()), act)
    ours = fm.addmm(b, x, w, activation=act)
    fused = torch._addmm_activation(b, x, w, use_gelu=True) if with_gelu else torch.addmm(b, x, w)
    unfused = _act64((x @ w) + b, act)
    e_ours, e_fused, e_unfused = max_err(ours, ref), max_err(fused, ref), max_err(unfused, ref)
    print(f"\n{device} {dtype} {m}x{k}x{n} act={act}: ours {e_ours:.4g}  torch fused {e_fused:.4g}  "
          f"unfused {e_unfused:.4g}")
    assert e_ours <= e_fused * (1 + 2.0**-10), (e_ours, e_fused)
    assert e_ours < 0.85 * e_unfused, (e_ours, e_unfused)


def test_deep_stack_drift_stays_fused(fm, device):
    """24 Linear + tanh-GeLU layers in bf16: the drift from fp64 (relative Frobenius) stays at the level of the
    exactly-fused computation (fp32 math, one rounding per layer), not at the unfused one (mm rounded, + bias
    rounded, GeLU rounded). Measured on the CPU prototype: fused ~0.007, unfused ~0.0125."""
    width, tokens, layers = (1024, 512, 24) if device == "cuda" else (256, 128, 24)
    g = torch.Generator().manual_seed(12)
    bf = torch.bfloat16
    ws = [(torch.randn(width, width, generator=g) * (2.0 / width) ** 0.5).to(device=device, dtype=bf)
          for _ in range(layers)]
    bs = [(torch.randn(width, generator=g) * 0.5).to(device=device, dtype=bf) for _ in range(layers)]
    x = torch.randn(tokens, width, generator=g).to(device=device, dtype=bf)
    h64, ours, emul, unf = x.double(), x, x, x
    fused_torch = x
    for w, b in zip(ws, bs):
        h64 = F.gelu(F.linear(h64, w.double(), b.double()), approximate="tanh")
        ours = fm.linear(ours, w, b, activation="gelu_tanh")
        emul = F.gelu(F.linear(emul.float(), w.float(), b.float()), approximate="tanh").to(bf)
        unf = F.gelu((unf @ w.t()) + b, approximate="tanh")
        if device == "cuda":
            fused_torch = torch._addmm_activation(b, fused_torch, w.t(), use_gelu=True)

    def drift(t: torch.Tensor) -> float:
        return ((t.double() - h64).norm() / h64.norm()).item()

    d_ours, d_emul, d_unf = drift(ours), drift(emul), drift(unf)
    print(f"\n{device} 24-layer bf16 drift: ours {d_ours:.4g}  exact-fused {d_emul:.4g}  unfused {d_unf:.4g}"
          + (f"  torch._addmm_activation {drift(fused_torch):.4g}" if device == "cuda" else ""))
    assert d_ours <= 1.1 * d_emul, (d_ours, d_emul)
    assert d_ours <= 0.8 * d_unf, (d_ours, d_unf)
    if device == "cuda":
        assert d_ours <= 1.1 * drift(fused_torch)


# ---- bad input ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_bad_input_raises_before_launch(fm, device, grad):
    """The documented errors, in inference and in training (where the eager fast path hands plain tensors to the
    autograd Function first and takes the checked path for whatever its op rejects)."""
    x, w_kn, b = _make((8, 32, 16), torch.float32, device)
    w = w_kn.t().contiguous()
    x.requires_grad_(grad)
    with pytest.raises(ValueError, match="inner dimensions differ"):
        fm.addmm(b, x, torch.randn(31, 16, device=device))
    with pytest.raises(ValueError, match="inner dimensions differ"):
        fm.linear(x, torch.randn(16, 33, device=device), b)
    with pytest.raises(ValueError, match=r"bias must have shape \[16\]"):
        fm.addmm(torch.randn(15, device=device), x, w_kn)
    with pytest.raises(ValueError, match=r"bias must have shape \[16\]"):
        fm.linear(x, w, torch.randn(8, 16, device=device))  # a full [M, N] addend is not a bias
    for bad in ((16, 1), (2, 8)):  # N elements, but not a row
        with pytest.raises(ValueError, match=r"bias must have shape \[16\]"):
            fm.linear(x, w, torch.randn(*bad, device=device).requires_grad_(grad))
    with pytest.raises(ValueError, match="activation must be None, 'gelu_tanh' or 'gelu'"):
        fm.addmm(b, x, w_kn, activation="relu")
    with pytest.raises(ValueError, match="activation"):
        fm.linear(x, w, b, activation="tanh")
    with pytest.raises(TypeError, match="same dtype"):
        fm.addmm(b, x.bfloat16(), w_kn)
    with pytest.raises(TypeError, match="bias must be"):
        fm.addmm(b.half(), x.bfloat16(), w_kn.bfloat16())
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        fm.addmm(b, x.double(), w_kn.double())
    with pytest.raises(ValueError, match="mat2 must be a 2-D tensor"):
        fm.addmm(b, x, w_kn[None])
    with pytest.raises(ValueError, match="weight must be a 2-D tensor"):
        fm.linear(x, b, b)
    with pytest.raises(TypeError, match="mat1 must be a torch.Tensor"):
        fm.addmm(b, x.tolist(), w_kn)
    with pytest.raises(ValueError, match="at least one dimension"):
        fm.addmm(b, torch.tensor(1.0, device=device), w_kn[:1])


def test_direct_op_calls_check_arguments(fm, device):
    """The C++ entry points check too (RuntimeError, no launch) for callers that bypass the Python API."""
    ops = fm._ops.ops
    x, w_kn, b = _make((8, 32, 16), torch.float32, device)
    with pytest.raises(RuntimeError, match="inner dims differ"):
        ops.addmm_fwd(b, x, torch.randn(31, 16, device=device), "none", False, [8, 16])
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.addmm_fwd(b[:15], x, w_kn, "none", False, [8, 16])
    for bad in ("silu", "relu", ""):  # silu is a gated activation only
        with pytest.raises(RuntimeError, match="activation must be 'none', 'gelu_tanh' or 'gelu'"):
            ops.addmm_fwd(b, x, w_kn, bad, False, [8, 16])
    with pytest.raises(RuntimeError, match="out_shape"):
        ops.addmm_fwd(b, x, w_kn, "none", False, [8, 15])
    with pytest.raises(RuntimeError, match="pre-activation"):
        ops.addmm_bwd(torch.randn(8, 16, device=device), None, x, w_kn, "gelu_tanh", True, True, False, True,
                      torch.float32)


@requires_cuda
def test_device_mismatch_raises_before_launch(fm):
    x, w_kn, b = _make((8, 32, 16), torch.float32, "cuda")
    with pytest.raises(ValueError, match="mat2 is on cpu but mat1 is on cuda"):
        fm.addmm(b, x, w_kn.cpu())
    with pytest.raises(ValueError, match="bias is on cpu but input is on cuda"):
        fm.linear(x, w_kn.t(), b.cpu())
    with pytest.raises(ValueError, match="weight is on cuda"):
        fm.linear(x.cpu(), w_kn.t(), None)


# ---- opcheck, torch.compile ----------------------------------------------------------------------------------------


def test_opcheck(fm, device):
    ops = fm._ops.ops
    x, w_kn, b = _make((9, 24, 16), torch.bfloat16, device)
    w_row = w_kn.contiguous()
    b32 = b.float()
    dy = torch.randn(9, 16, generator=torch.Generator().manual_seed(2)).to(device=device, dtype=torch.bfloat16)
    fwd_cases = [
        (b, x, w_kn, "none", False, [9, 16]), (b, x, w_kn, "gelu_tanh", True, [3, 3, 16]),
        (b, x, w_row, "gelu", True, [9, 16]), (None, x, w_row, "gelu_tanh", False, [9, 1, 16]),
        (b32, x, w_kn, "gelu", True, [9, 16]), (b, x[:0], w_kn, "gelu_tanh", True, [0, 16]),
    ]
    for args in fwd_cases:
        torch.library.opcheck(ops.addmm_fwd.default, args)
    _, z = ops.addmm_fwd(b, x, w_kn, "gelu_tanh", True, [9, 16])
    bwd_cases = [
        (dy, None, x, w_kn, "none", True, True, True, True, torch.bfloat16),
        (dy.float(), z, x, w_kn, "gelu_tanh", True, True, True, True, torch.float32),
        (dy, z, x, w_row, "gelu", False, True, False, True, torch.bfloat16),
        (dy, None, x, w_row, "none", True, False, False, False, torch.bfloat16),
    ]
    for args in bwd_cases:
        torch.library.opcheck(ops.addmm_bwd.default, args)


def test_compile_fullgraph_no_recompiles(fm, device):
    """linear(+erf GeLU) -> addmm (Conv1D style), forward and backward, compiled once for token counts 1, 7, 4096."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(13)
    k, h, n = 64, 96, 48
    w1 = (torch.randn(h, k, generator=g) / k**0.5).to(device).requires_grad_()
    b1 = torch.randn(h, generator=g).to(device).requires_grad_()
    w2 = (torch.randn(h, n, generator=g) / h**0.5).to(device).requires_grad_()
    b2 = torch.randn(n, generator=g).to(device).requires_grad_()

    def fn(x: torch.Tensor) -> torch.Tensor:
        return fm.addmm(b2, fm.linear(x, w1, b1, activation="gelu"), w2, activation="gelu_tanh")

    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in (1, 7, 4096):
            x = torch.randn(2, t, k, generator=g).to(device).requires_grad_()
            torch._dynamo.decorators.mark_unbacked(x, 1)
            gy = torch.randn(2, t, n, generator=g).to(device)
            out = compiled(x)
            out.backward(gy)
            got = (out.detach(), x.grad, w1.grad, b1.grad, w2.grad, b2.grad)
            for p in (x, w1, b1, w2, b2):
                p.grad = None
            out_e = fn(x)
            out_e.backward(gy)
            want = (out_e.detach(), x.grad, w1.grad, b1.grad, w2.grad, b2.grad)
            for p in (x, w1, b1, w2, b2):
                p.grad = None
            for a, e in zip(got, want):
                torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


# ---- cuBLASLt fallbacks ------------------------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cublaslt_fallback_paths(fm, mode, act, dtype):
    """Forced: 1 = no fused epilogue (fp32-accumulator path), 2 = no cuBLASLt (at::mm on fp32 copies). Same
    numerics (rounded once), gradients as before, and the warning is shown once."""
    ops = fm._ops.ops
    x, w_kn, b = _make((300, 128, 200), dtype, "cuda")
    w = w_kn.t().contiguous()
    gy = torch.randn(300, 200, generator=torch.Generator().manual_seed(2)).to(device="cuda", dtype=dtype)
    xl, wl, bl = (t.clone().requires_grad_() for t in (x, w, b))
    normal = fm.linear(xl, wl, bl, activation=act)
    normal.backward(gy)
    normal_grads = (xl.grad, wl.grad, bl.grad)
    prev = ops._addmm_lt_force_fallback(mode)
    try:
        xl, wl, bl = (t.clone().requires_grad_() for t in (x, w, b))
        # Fused epilogues are only attempted for no activation, and for "gelu_tanh" with fp32 outputs (cuBLASLt's
        # GELU epilogue is not one rounding in bf16/fp16; "gelu" has no epilogue at all).
        fused_attempted = act is None or (act == "gelu_tanh" and dtype == torch.float32)
        expect_warning = mode == 2 or fused_attempted
        if expect_warning:
            with pytest.warns(UserWarning, match="cuBLASLt"):
                y = fm.linear(xl, wl, bl, activation=act)
        else:
            y = fm.linear(xl, wl, bl, activation=act)
        y.backward(gy)
        assert_rounded_once(y, b, x, w_kn, act, name=f"forced fallback {mode}")
        for got, want, what in zip((xl.grad, wl.grad, bl.grad), normal_grads, ("dx", "dw", "db")):
            tol = (2 * UNIT[dtype] + 300 * 2.0**-24) * want.abs().max().item() + 1e-5  # order of fp32 sums
            assert max_err(got, want) <= tol, (what, max_err(got, want), tol)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once already: no second warning
            fm.linear(x, w, b, activation=act)
    finally:
        ops._addmm_lt_force_fallback(prev)


@requires_cuda
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_cublaslt_workspace_takes_an_algorithm_without_one(fm, monkeypatch, act, dtype):
    """Mode 3: every cuBLASLt workspace allocation comes back empty (as when the caching allocator has no block for
    it). cuBLASLt then runs an algorithm without workspace: no fallback and no warning, the output rounded once,
    gradients as with the workspace; a decode-size plain GEMM (in bf16 the 32 MiB split-K case) too."""
    monkeypatch.setenv("FUSED_MLP_LINEAR_DECODE", "off")  # the 64-token GEMM through cuBLASLt, not linear_decode
    ops = fm._ops.ops
    x, w_kn, b = _make((300, 128, 200), dtype, "cuda")
    w = w_kn.t().contiguous()
    gy = torch.randn(300, 200, generator=torch.Generator().manual_seed(2)).to(device="cuda", dtype=dtype)
    xl, wl, bl = (t.clone().requires_grad_() for t in (x, w, b))
    fm.linear(xl, wl, bl, activation=act).backward(gy)
    normal_grads = (xl.grad, wl.grad, bl.grad)
    xd = torch.randn(64, 4096, device="cuda", dtype=dtype)
    wd = torch.randn(512, 4096, device="cuda", dtype=dtype) * 4096**-0.5
    prev = ops._addmm_lt_force_fallback(3)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # neither fallback warns
            xl, wl, bl = (t.clone().requires_grad_() for t in (x, w, b))
            y = fm.linear(xl, wl, bl, activation=act)
            y.backward(gy)
            yd = fm.linear(xd, wd)
        assert_rounded_once(y, b, x, w_kn, act, name="no workspace")
        for got, want, what in zip((xl.grad, wl.grad, bl.grad), normal_grads, ("dx", "dw", "db")):
            tol = (2 * UNIT[dtype] + 300 * 2.0**-24) * want.abs().max().item() + 1e-5  # order of fp32 sums
            assert max_err(got, want) <= tol, (what, max_err(got, want), tol)
        assert_rounded_once(yd, None, xd, wd.t(), None, name="decode-size GEMM, no workspace")
    finally:
        ops._addmm_lt_force_fallback(prev)


@requires_cuda
def test_fp32_never_uses_tf32(fm):
    """fp32 inputs use CUBLAS_COMPUTE_32F whatever torch's TF32 flag says (TF32 would break the fp32 bound)."""
    x, w_kn, b = _make((512, 1024, 512), torch.float32, "cuda")
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        for act in ACTS:
            assert_rounded_once(fm.addmm(b, x, w_kn, activation=act), b, x, w_kn, act)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@requires_cuda
def test_plan_cache_repeats_bitwise(fm):
    """Cached plans: repeated calls (and calls on other buffers of the same shape) give identical results."""
    x, w_kn, b = _make((777, 512, 640), torch.bfloat16, "cuda")
    first = [fm.addmm(b, x, w_kn, activation=a) for a in ACTS]
    x2, w2, b2 = x.clone(), w_kn.clone(), b.clone()
    for a, f in zip(ACTS, first):
        assert torch.equal(fm.addmm(b2, x2, w2, activation=a), f)


@requires_cuda
def test_other_device_and_stream(fm):
    """Runs on the current stream of the tensors' device (CUDAGuard); a side stream works."""
    x, w_kn, b = _make((100, 64, 72), torch.bfloat16, "cuda")
    ref = fm.addmm(b, x, w_kn, activation="gelu_tanh")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = fm.addmm(b, x, w_kn, activation="gelu_tanh")
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(out, ref)
    if torch.cuda.device_count() > 1:
        x1, w1, b1 = x.to("cuda:1"), w_kn.to("cuda:1"), b.to("cuda:1")
        assert torch.equal(fm.addmm(b1, x1, w1, activation="gelu_tanh").cpu(), ref.cpu())


def test_cpu_variant_matches(fm, fm_cpu):
    """The CPU variant and the CUDA variant's CPU path are the same code."""
    x, w_kn, b = _make((31, 64, 40), torch.bfloat16, "cpu")
    for act in ACTS:
        assert torch.equal(fm.addmm(b, x, w_kn, activation=act), fm_cpu.addmm(b, x, w_kn, activation=act))


def test_autocast(fm, device):
    """Under autocast the operands are cast like F.linear's (fp32 parameters, bf16/fp16 math)."""
    x, w_kn, b = _make((20, 64, 32), torch.float32, device)
    w = w_kn.t().contiguous()
    dt = torch.bfloat16
    with torch.autocast(device_type=device, dtype=dt):
        out = fm.linear(x, w, b, activation="gelu_tanh")
        want = F.linear(x, w, b)
    assert out.dtype == want.dtype == dt
    assert_rounded_once(out, b.to(dt), x.to(dt), w.t().to(dt), "gelu_tanh")


@requires_cuda
def test_opt_in_autotune_keeps_numerics():
    """FUSED_MLP_ADDMM_AUTOTUNE=1 (read once per process, hence a child process): large GEMMs time the heuristic's
    candidates once; the results stay rounded once and the gradients pass the 2x rule; repeated calls are equal."""
    import os
    import subprocess
    import sys
    import textwrap

    from conftest import ROOT

    code = textwrap.dedent(
        """
        import pathlib, sys, torch, kernels
        sys.path[:0] = ["tests", "tests/ops"]
        import test_addmm as T
        from _utils import assert_2x_rule
        fm = kernels.get_local_kernel(pathlib.Path(T_ROOT))
        torch.backends.cuda.matmul.allow_tf32 = False
        x, w_kn, b = T._make((2048, 2048, 2048), torch.bfloat16, "cuda")  # 17 GFLOP: above the tuning threshold
        for act in T.ACTS:
            out = fm.addmm(b, x, w_kn, activation=act)
            T.assert_rounded_once(out, b, x, w_kn, act)
            assert torch.equal(out, fm.addmm(b, x, w_kn, activation=act))
        w = w_kn.t().contiguous()
        gy = torch.randn(2048, 2048, generator=torch.Generator().manual_seed(3)).to("cuda", torch.bfloat16)
        grads = {}
        for name, dt, fn in (("ours", torch.bfloat16, lambda xx, ww, bb: fm.linear(xx, ww, bb, activation="gelu_tanh")),
                             ("torch", torch.bfloat16, lambda xx, ww, bb: T._torch_same_dtype(bb, xx, ww.t(), "gelu_tanh")),
                             ("ref", torch.float64, lambda xx, ww, bb: T._act64(torch.nn.functional.linear(xx, ww, bb), "gelu_tanh"))):
            xx, ww, bb = (t.to(dt).clone().requires_grad_() for t in (x, w, b))
            fn(xx, ww, bb).backward(gy.to(dt))
            grads[name] = (xx.grad, ww.grad, bb.grad)
        for o, t, r, what in zip(grads["ours"], grads["torch"], grads["ref"], ("dx", "dw", "db")):
            assert_2x_rule(o, r, t, name=what)
        print("AUTOTUNE-OK")
        """
    ).replace("T_ROOT", repr(str(ROOT)))
    env = {**os.environ, "FUSED_MLP_ADDMM_AUTOTUNE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "AUTOTUNE-OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("act", ACTS)
def test_inplace_on_output_is_allowed(fm, device, act, dtype):
    """Models modify linear outputs in place (nn.Linear allows it): the output must not be a view created inside
    the autograd Function. Gradients then follow the in-place op. bf16 takes other paths on a CPU whose oneDNN runs
    it natively (oneDNN's linear with the GeLU post-op, which returns a view for x of rank 3)."""
    x, w_kn, b = _make((12, 32, 16), dtype, device)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for shape in ((12, 32), (3, 4, 32)):
        xs, ws, bs = (t.clone().requires_grad_() for t in (x.reshape(shape), w_kn.t().contiguous(), b))
        y = fm.linear(xs, ws, bs, activation=act)
        y.mul_(2).add_(1)
        y.sum().backward()
        xr, wr, br = (t.detach().double().requires_grad_() for t in (xs, ws, bs))
        (_act64(F.linear(xr, wr, br), act) * 2 + 1).sum().backward()
        for got, want in ((xs.grad, xr.grad), (ws.grad, wr.grad), (bs.grad, br.grad)):
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


# ---- no memory kept across calls ----------------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc (Linux)")
def test_cpu_calls_keep_no_memory(fm):
    """Forward and backward on the CPU (bf16: an fp32 accumulator and fp32 GEMMs each call) 60 times: resident
    memory must not grow by the ~4 MB per call a leaked temporary would keep (the first stable-ABI build leaked the
    result handle of every `mm.out` call)."""
    x = torch.randn(1024, 1024, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1024, 1024, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(3):  # warm-up: allocator pools, thread pools
        fm.linear(x, w).float().sum().backward()
    before = _rss_bytes()
    for _ in range(60):
        fm.linear(x, w).float().sum().backward()
    grown = _rss_bytes() - before
    assert grown < 64 * 2**20, f"resident memory grew by {grown / 2**20:.0f} MiB over 60 calls"


@requires_cuda
@pytest.mark.parametrize("mode", [0, 2])
def test_cuda_calls_keep_no_memory(fm, mode):
    """The same on the GPU, on the cuBLASLt path and on the torch-mm fallbacks (mode 2): the caching allocator's
    count of allocated bytes returns to where it was."""
    ops = fm._ops.ops
    x = torch.randn(512, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(640, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(640, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    prev = ops._addmm_lt_force_fallback(mode)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fm.linear(x, w, b, activation="gelu").float().sum().backward()
            x.grad = w.grad = b.grad = None
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            for _ in range(10):
                fm.linear(x, w, b, activation="gelu").float().sum().backward()
                x.grad = w.grad = b.grad = None
            torch.cuda.synchronize()
            assert torch.cuda.memory_allocated() == before
    finally:
        ops._addmm_lt_force_fallback(prev)


# ---- sm_90: the CUTLASS GEMM with bias + activation in its epilogue (kernels_src/cuda/addmm_sm90.cu) -------------
# The private op _addmm_sm90_mode switches the path in-process (FUSED_MLP_ADDMM_SM90 is read once): -1 follow the
# environment, 0 off, 1 auto, 2 on, 3 on with ping-pong, 4 on with cooperative.
SM90 = CUDA and torch.cuda.get_device_capability() == (9, 0)
requires_sm90 = pytest.mark.skipif(not SM90, reason="needs an sm_90 (Hopper) GPU")
SM90_MODES = {"off": 0, "auto": 1, "on": 2, "pingpong": 3, "cooperative": 4}
# M not a multiple of any tile, N and K 8 x odd; a tiny one and one with a single k-tile
SM90_SHAPES = [(1100, 504, 1000), (5, 40, 24), (300, 8, 136)]


@contextlib.contextmanager
def _sm90_mode(fm, mode: str):
    prev = fm._ops.ops._addmm_sm90_mode(SM90_MODES[mode])
    try:
        yield
    finally:
        fm._ops.ops._addmm_sm90_mode(prev)


def _sm90_kernel_ran(fn) -> bool:
    """Whether fn() launched the sm_90 addmm kernel (its name carries the namespace fm_addmm_sm90)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return any("fm_addmm_sm90" in e.name for e in prof.events())


@requires_sm90
@pytest.mark.parametrize("shape", SM90_SHAPES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["linear", "conv1d"])
@pytest.mark.parametrize("bias_kind", ["same", "fp32", "none"])
@pytest.mark.parametrize("config", ["pingpong", "cooperative"])
def test_sm90_forward_rounded_once(fm, monkeypatch, shape, act, dtype, layout, bias_kind, config):
    monkeypatch.setenv("FUSED_MLP_LINEAR_DECODE", "off")  # a bias-free linear at T <= 16 would take the decode GEMV
    x, w_kn, b = _make(shape, dtype, "cuda", layout=layout, bias=bias_kind != "none")
    if bias_kind == "fp32":
        b = (b.float() + 0.1234567).contiguous()  # not representable in the input dtype
    with _sm90_mode(fm, config):
        assert _sm90_kernel_ran(lambda: _call(fm, layout, b, x, w_kn, act))
        out = _call(fm, layout, b, x, w_kn, act)
    assert out.shape == (shape[0], shape[2]) and out.dtype == dtype
    assert_rounded_once(out, b, x, w_kn, act)
    ref32 = fm.addmm_reference(b, x, w_kn, activation=act)
    assert_2x_rule(out, ref32, _torch_same_dtype(b, x, w_kn, act))


@requires_sm90
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["linear", "conv1d"])
@pytest.mark.parametrize("bias_dtype", ["same", "fp32"])
def test_sm90_epilogue_matches_the_cublaslt_path_bitwise(fm, act, dtype, layout, bias_dtype):
    """With operands whose products sum exactly in fp32 (multiples of 1/8, K = 64) both paths see the same fp32
    accumulator, so y and the saved preact Z must be bit-identical to the fp32-accumulator path (the same epilogue
    math, kernels_src/cuda/addmm_act.cuh)."""
    m, k, n = 1100, 64, 264
    g = torch.Generator().manual_seed(5)
    x = (torch.randint(-8, 9, (m, k), generator=g) / 8).to("cuda", dtype)
    w = (torch.randint(-8, 9, (n, k), generator=g) / 32).to("cuda", dtype)
    w_kn = w.t() if layout == "linear" else w.t().contiguous()
    b = torch.randn(n, generator=g).to("cuda", dtype if bias_dtype == "same" else torch.float32)
    actname = act or "none"
    ops = fm._ops.ops
    with _sm90_mode(fm, "on"):
        assert _sm90_kernel_ran(lambda: ops.addmm_fwd(b, x, w_kn, actname, True, [m, n]))
        y, z = ops.addmm_fwd(b, x, w_kn, actname, True, [m, n])
    prev = ops._addmm_lt_force_fallback(1)  # cuBLASLt's fp32 GEMM + the bias/activation kernel
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            y_lt, z_lt = ops.addmm_fwd(b, x, w_kn, actname, True, [m, n])
    finally:
        ops._addmm_lt_force_fallback(prev)
    assert torch.equal(y, y_lt)
    assert torch.equal(z, z_lt)
    assert z.numel() == (0 if act is None else m * n)


@requires_sm90
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["linear", "conv1d"])
def test_sm90_training(fm, act, dtype, layout):
    """Training forward through the CUTLASS kernel (preact Z saved by its epilogue): the output equals the
    inference forward's bit for bit, and the gradients pass the 2x rule against fp64."""
    shape = (1100, 504, 1000)
    m, k, n = shape
    x, w_kn, b = _make(shape, dtype, "cuda", layout=layout)
    w_param = w_kn.t().contiguous() if layout == "linear" else w_kn.contiguous()
    gy = torch.randn(m, n, generator=torch.Generator().manual_seed(7)).to("cuda", dtype)

    def fn(xx, ww, bb):
        return fm.linear(xx, ww, bb, activation=act) if layout == "linear" else fm.addmm(bb, xx, ww, activation=act)

    def run(xx, ww, bb, f):
        xx, ww, bb = (t.detach().clone().requires_grad_() for t in (xx, ww, bb))
        y = f(xx, ww, bb)
        y.backward(gy.to(xx.dtype))
        return y.detach(), (xx.grad, ww.grad, bb.grad)

    with _sm90_mode(fm, "on"):
        assert _sm90_kernel_ran(lambda: run(x, w_param, b, fn))
        y, ours = run(x, w_param, b, fn)
        with torch.no_grad():
            assert torch.equal(y, fn(x, w_param, b))
    if layout == "linear":
        _, ref = run(x.double(), w_param.double(), b.double(), lambda xx, ww, bb: _act64(F.linear(xx, ww, bb), act))
        _, theirs = run(x, w_param, b, lambda xx, ww, bb: _torch_same_dtype(bb, xx, ww.t(), act))
    else:
        _, ref = run(x.double(), w_param.double(), b.double(),
                     lambda xx, ww, bb: _act64(torch.addmm(bb, xx, ww), act))
        _, theirs = run(x, w_param, b, lambda xx, ww, bb: _torch_same_dtype(bb, xx, ww, act))
    assert_rounded_once(y, b, x, w_kn, act)
    for o, r, t, what in zip(ours, ref, theirs, ("dx", "dw", "db")):
        assert o.dtype == dtype
        assert_2x_rule(o, r, t, name=what)


@requires_sm90
def test_sm90_dispatch_rule(fm):
    """auto: from 256 output tiles of 128 x 128 with an activation (a bias only keeps cuBLASLt's BIAS epilogue); on:
    wherever runnable; off: never. Operands the kernel cannot take (N % 8 != 0, a misaligned row stride, fp32) keep cuBLASLt,
    with the same numerics."""
    x, w_kn, b = _make((8192, 256, 512), torch.bfloat16, "cuda")  # N = 512: 4 tile columns, 256 tiles from M = 8065
    runs = lambda *a, act="gelu": _sm90_kernel_ran(lambda: fm.addmm(*a, activation=act))  # noqa: E731
    with _sm90_mode(fm, "auto"):
        assert runs(b, x, w_kn) and runs(None, x, w_kn)
        assert not runs(b, x, w_kn, act=None)  # bias only: cuBLASLt's BIAS epilogue
        assert runs(b, x[:8065], w_kn) and runs(None, x[:8065], w_kn, act="gelu_tanh")
        assert not runs(None, x, w_kn, act=None)  # plain mm: cuBLASLt
        assert not runs(b, x[:8064], w_kn) and not runs(b, x[:256], w_kn)  # below the tile threshold
        xw, ww, bw = _make((256, 256, 16384), torch.bfloat16, "cuda")  # 2 x 128 tiles: M = 256 qualifies here
        assert runs(bw, xw, ww) and not runs(bw, xw[:128], ww)
    with _sm90_mode(fm, "on"):
        assert runs(b, x[:512], w_kn) and runs(None, x, w_kn, act=None)
        xs, ws, bs = _make((1030, 256, 1001), torch.bfloat16, "cuda")  # N = 1001
        assert not runs(bs, xs, ws)
        assert_rounded_once(fm.addmm(bs, xs, ws, activation="gelu"), bs, xs, ws, "gelu")
        xp = torch.zeros(1030, 260, device="cuda", dtype=torch.bfloat16)[:, :256].copy_(x[:1030])  # row stride 260
        assert not runs(b, xp, w_kn)
        assert_rounded_once(fm.addmm(b, xp, w_kn, activation="gelu"), b, xp, w_kn, "gelu")
        x32, w32, b32 = _make((1030, 256, 512), torch.float32, "cuda")
        assert not runs(b32, x32, w32)
    with _sm90_mode(fm, "off"):
        assert not runs(b, x, w_kn)


@requires_sm90
@pytest.mark.parametrize("sched", ["swizzle=8", "swizzle=2,raster=m", "raster=n"])
def test_sm90_tile_schedule_knob_keeps_the_bits(fm, monkeypatch, sched):
    """FUSED_MLP_SM90_SCHED reorders the persistent CTAs' tiles only: the same bits as the default schedule, both
    layouts, with and without the saved pre-activation (training)."""
    for layout in ("linear", "conv1d"):
        x, w_kn, b = _make((2048, 512, 3072), torch.bfloat16, "cuda", layout=layout)
        with _sm90_mode(fm, "on"):
            monkeypatch.delenv("FUSED_MLP_SM90_SCHED", raising=False)
            base = fm._ops.ops.addmm_fwd(b, x, w_kn, "gelu_tanh", True, [2048, 3072])
            monkeypatch.setenv("FUSED_MLP_SM90_SCHED", sched)
            other = fm._ops.ops.addmm_fwd(b, x, w_kn, "gelu_tanh", True, [2048, 3072])
        for a, c in zip(base, other):
            assert torch.equal(a, c), (sched, layout)


@requires_sm90
@pytest.mark.parametrize("act", ACTS)
def test_sm90_off_is_the_cublaslt_path(fm, act):
    """Off: cuBLASLt exactly as before (bit-identical to a second off call, no sm_90 kernel); on vs off: both are
    one rounding of the same value, so they differ at most by the fp32 accumulation order."""
    x, w_kn, b = _make((2048, 1024, 1000), torch.bfloat16, "cuda")
    with _sm90_mode(fm, "off"):
        assert not _sm90_kernel_ran(lambda: fm.addmm(b, x, w_kn, activation=act))
        off = fm.addmm(b, x, w_kn, activation=act)
        assert torch.equal(off, fm.addmm(b, x, w_kn, activation=act))
    with _sm90_mode(fm, "on"):
        on = fm.addmm(b, x, w_kn, activation=act)
    assert_rounded_once(off, b, x, w_kn, act)
    assert_rounded_once(on, b, x, w_kn, act)
    torch.testing.assert_close(on, off, rtol=2 * UNIT[torch.bfloat16], atol=1e-3)


@requires_sm90
@pytest.mark.parametrize("value", ["off", "cooperative", "bogus"])
def test_sm90_environment_knob(value):
    """FUSED_MLP_ADDMM_SM90 is read once per process (hence a child process)."""
    import subprocess
    import sys
    import textwrap

    from conftest import ROOT

    code = textwrap.dedent(
        """
        import pathlib, sys, torch, kernels
        sys.path[:0] = ["tests", "tests/ops"]
        import test_addmm as T
        fm = kernels.get_local_kernel(pathlib.Path(T_ROOT))
        x, w_kn, b = T._make((2048, 256, 512), torch.bfloat16, "cuda")
        try:
            ran = T._sm90_kernel_ran(lambda: fm.addmm(b, x, w_kn, activation="gelu"))
        except RuntimeError as e:
            print("ERROR", e)
        else:
            T.assert_rounded_once(fm.addmm(b, x, w_kn, activation="gelu"), b, x, w_kn, "gelu")
            print("RAN" if ran else "NOT-RAN")
        """
    ).replace("T_ROOT", repr(str(ROOT)))
    env = {**os.environ, "FUSED_MLP_ADDMM_SM90": value, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    want = {"off": "NOT-RAN", "cooperative": "RAN", "bogus": "ERROR"}[value]
    assert proc.returncode == 0 and want in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    if value == "bogus":
        assert "FUSED_MLP_ADDMM_SM90 must be" in proc.stdout


# ---- CPU, fp32, no activation: ATen's GEMM without the op ---------------------------------------------------------
def _op_calls(fm, monkeypatch) -> list[str]:
    """Record every call of the addmm forward op from addmm.py (eager C++ entry and OpOverload alike)."""
    mod = sys.modules[fm.__name__ + ".addmm"]
    calls: list[str] = []
    for name in ("_fwd", "_fwd_call"):
        real = getattr(mod, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(mod, name, spy)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["linear", "conv1d"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rank", [2, 3])
def test_cpu_inference_is_atens_gemm(fm, monkeypatch, dtype, layout, bias, rank):
    """On the CPU the op computes an fp32 product with ATen's GEMM and then copies it into y (adding the bias) in a
    second pass, widening 16-bit operands to fp32 copies first; without an activation, inference (functional API and
    layers) calls F.linear instead when x, w and the bias share a dtype: ATen's CPU GEMM accumulates in fp32 and
    rounds once with the bias added first, which this test checks on the machine that runs it (a GEMM rounded
    before the bias, or accumulated in 16 bits, fails assert_rounded_once at K = 4096 with a large bias). An
    activation, autocast, autograd or a bias of another dtype keep the op."""
    from transformers.pytorch_utils import Conv1D

    calls = _op_calls(fm, monkeypatch)
    x, w_kn, b = _make((29, 48, 40), torch.float32, "cpu", bias=bias, layout=layout)
    x, w_kn, b = x.to(dtype), w_kn.to(dtype), (None if b is None else b.to(dtype))
    if rank == 3:
        x = x.view(29, 1, 48)
    expect = F.linear(x, w_kn.t(), b)
    with torch.no_grad():
        got = [_call(fm, layout, b, x, w_kn, None)]
        if layout == "linear":
            mod = torch.nn.Linear(48, 40, bias=bias, dtype=dtype)
            mod.weight.data, mod.bias = w_kn.t(), (torch.nn.Parameter(b) if bias else None)
            got.append(fm.layers.Linear.forward(mod, x))
        else:
            mod = Conv1D(40, 48).to(dtype)
            mod.weight.data = w_kn
            mod.bias.data = b if bias else torch.zeros(40, dtype=dtype)
            if not bias:
                expect = F.linear(x, w_kn.t(), mod.bias)
                got = [_call(fm, layout, mod.bias, x, w_kn, None)]
            got.append(fm.layers.Conv1D.forward(mod, x))
    for g in got:
        assert g.shape == expect.shape and torch.equal(g, expect)
    assert calls == []
    if dtype != torch.float32 and rank == 2:  # ATen's 16-bit GEMM: one rounding of the fp32 sum incl. the bias
        xl, wl, bl = _make((31, 4096, 96), torch.float32, "cpu", seed=7, bias=bias, layout=layout)
        xl, wl = xl.to(dtype), wl.to(dtype)
        bl = None if bl is None else (4 * bl).to(dtype)
        with torch.no_grad():
            assert_rounded_once(_call(fm, layout, bl, xl, wl, None), bl, xl, wl, None)
        assert calls == []
        # above 32 rows: ATen's GEMM only where oneDNN runs the dtype natively, else the op's fp32 GEMM
        native = sys.modules[fm.__name__ + ".addmm"]._onednn_native(dtype)
        x40 = torch.cat([x, x[:11]])
        with torch.no_grad():
            assert_rounded_once(_call(fm, layout, b, x40, w_kn, None), b, x40, w_kn, None)
        assert calls == ([] if native else ["_fwd_call"])
        calls.clear()
    # autocast casts every operand to its dtype (as for F.linear), which is then ATen's 16-bit GEMM too
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        bf = None if b is None else b.float()
        assert torch.equal(_call(fm, layout, bf, x.float(), w_kn.float(), None),
                           F.linear(x.float(), w_kn.float().t(), bf))
    assert calls == []
    # the op where it is more than ATen's GEMM, or where autograd needs its Function
    addmm_mod = sys.modules[fm.__name__ + ".addmm"]
    native16 = dtype != torch.float32 and addmm_mod._onednn_native(dtype)
    with torch.no_grad():
        _call(fm, layout, b, x, w_kn, "gelu_tanh")  # oneDNN where native: test_cpu_16bit_gelu_inference_is_onednn
        if bias and dtype != torch.float32:
            _call(fm, layout, b.float(), x, w_kn, None)  # an fp32 bias with 16-bit operands
    gelu_op = 0 if native16 and addmm_mod._LINEAR_POINTWISE is not None else 1
    assert calls == ["_fwd_call"] * (gelu_op + (1 if bias and dtype != torch.float32 else 0))
    before = len(calls)
    _call(fm, layout, b, x.requires_grad_(), w_kn, None)  # training: test_cpu_16bit_training_is_atens
    assert calls[before:] == ([] if native16 else ["_fwd"])
    if layout == "linear":  # a 1-D weight is still refused (F.linear would take it as a vector)
        bad = torch.nn.Linear(48, 40, bias=False)
        bad.weight = torch.nn.Parameter(torch.randn(48))
        with torch.no_grad(), pytest.raises(ValueError, match="2-D"):
            fm.layers.Linear.forward(bad, x.detach())


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_strided_nd_input_rounds_once(fm, dtype, training):
    """ATen's F.linear rounds a non-contiguous N-D input twice in 16 bits (matmul, then bias.add_: ~2500 of these 16384
    outputs break the bound); the CPU routes that hand calls to ATen take such inputs only as 2-D rows or leave them
    to the op, so they still come out rounded once."""
    x, w_kn, b = _make((32, 64, 512), torch.float32, "cpu", seed=5)
    x = x.to(dtype).view(8, 4, 64).transpose(0, 1)  # [4, 8, K], not contiguous
    w_kn, b = w_kn.to(dtype), b.to(dtype)
    with torch.set_grad_enabled(training):
        y = fm.linear(x.requires_grad_(training), w_kn.t(), b)
        y_layer = fm.layers.Linear.forward(_linear_module(w_kn.t(), b), x)
    for out in (y, y_layer):
        assert out.shape == (4, 8, 512)
        assert_rounded_once(out.detach().reshape(32, 512), b, x.detach().reshape(32, 64), w_kn, None)


def _linear_module(w: torch.Tensor, b: torch.Tensor) -> torch.nn.Linear:
    mod = torch.nn.Linear(w.shape[1], w.shape[0], dtype=w.dtype)
    mod.weight.data, mod.bias.data = w.contiguous(), b
    return mod


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["linear", "conv1d"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("act", ["gelu_tanh", "gelu"])
def test_cpu_16bit_gelu_inference_is_onednn(fm, monkeypatch, dtype, layout, bias, act):
    """16-bit CPU inference with a GeLU, where oneDNN runs the dtype natively: oneDNN's linear with a GeLU post-op
    (bias + GeLU on its fp32 accumulator, one rounding), not the op's fp32 copy of the weight. Checked here on the
    machine that runs it: one rounding at K = 2048 over 131072 outputs with a bias 4x the products (in bf16 the
    unfused eager form, two roundings, fails the same bound), and the GeLU form itself on fp32 operands (tanh and erf differ by up to 5e-4,
    far above fp32's bound). Without native oneDNN or without that op: the op."""
    addmm_mod = sys.modules[fm.__name__ + ".addmm"]
    lp = addmm_mod._LINEAR_POINTWISE
    native = addmm_mod._onednn_native(dtype) and lp is not None
    calls = _op_calls(fm, monkeypatch)
    x, w_kn, b = _make((16, 2048, 8192), torch.float32, "cpu", seed=11, bias=bias, layout=layout)
    x, w_kn = x.to(dtype), w_kn.to(dtype)
    b = None if b is None else (4 * b).to(dtype)
    with torch.no_grad():
        y = _call(fm, layout, b, x.view(16, 1, 2048), w_kn, act).view(16, 8192)
        y2 = _call(fm, layout, b, x, w_kn, act)
    assert torch.equal(y, y2)
    assert_rounded_once(y, b, x, w_kn, act)
    if not native:
        assert calls == ["_fwd_call"] * 2
        return
    assert calls == []
    algorithm = "tanh" if act == "gelu_tanh" else "none"
    assert torch.equal(y, lp(x, w_kn.t(), b, "gelu", [], algorithm))
    if bias and dtype == torch.bfloat16:  # the discrimination: two roundings break bf16's bound here (not fp16's)
        two = F.gelu(F.linear(x, w_kn.t(), b), approximate=algorithm)
        with pytest.raises(AssertionError, match="not rounded once"):
            assert_rounded_once(two, b, x, w_kn, act)
    xf, wf = x.float()[:, :256], w_kn.float()[:256]  # the GeLU form (fp32 operands: the post-op's own math)
    bf = None if b is None else b.float()
    assert_rounded_once(lp(xf, wf.t(), bf, "gelu", [], algorithm), bf, xf, wf, act)


# M x K x N with a long reduction for each of y (K), dW and db (M) and dX (N) in the CPU training tests.
_LONG_REDUCTIONS = [(31, 4096, 96), (4096, 64, 40), (64, 32, 4096)]


def _took_op(calls: list[str], native: bool) -> bool:
    """Where oneDNN runs the dtype natively, ATen's / oneDNN's route ran (no op call); elsewhere the op's Function,
    once. True for the op (the caller then skips the route's checks)."""
    assert calls == ([] if native else ["_fwd"])
    calls.clear()
    return not native


def _cpu_training_operands(shape, dtype, seed, dy_seed, bias, layout):
    """x, w_kn and the bias (4x the products' size, or None) in dtype, all requiring grad, and a dY for them."""
    m, _, n = shape
    x, w_kn, b = _make(shape, torch.float32, "cpu", seed=seed, bias=bias, layout=layout)
    x, w_kn = x.to(dtype).requires_grad_(), w_kn.to(dtype).requires_grad_()
    b = None if b is None else (4 * b).to(dtype).requires_grad_()
    return x, w_kn, b, torch.randn(m, n, generator=torch.Generator().manual_seed(dy_seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["linear", "conv1d"])
@pytest.mark.parametrize("bias", [True, False])
def test_cpu_16bit_training_is_atens(fm, monkeypatch, dtype, layout, bias):
    """16-bit CPU training without an activation, where oneDNN runs the dtype natively: F.linear and ATen's backward
    (the op would widen x, w and dY to fp32 copies for every GEMM). The same bits as eager, and each of y, dX, dW and
    db one rounding of its fp32 accumulation, checked on the machine that runs it with a long reduction for each
    (K, N and M = 4096: a GEMM or a sum accumulated in 16 bits fails the bound there). Without native oneDNN (ATen's
    fp16 GEMMs are 17-156x the op's time there), with an activation or an fp32 bias: the op's Function."""
    native = sys.modules[fm.__name__ + ".addmm"]._onednn_native(dtype)
    calls = _op_calls(fm, monkeypatch)
    for i, (m, k, n) in enumerate(_LONG_REDUCTIONS):
        x, w_kn, b, dy = _cpu_training_operands((m, k, n), dtype, 3 + i, i, bias, layout)
        y = _call(fm, layout, b, x, w_kn, None)
        y.backward(dy)
        if _took_op(calls, native):
            continue
        leaves = [t.detach().clone().requires_grad_() for t in (x, w_kn) + ((b,) if bias else ())]
        y_eager = F.linear(leaves[0], leaves[1].t(), leaves[2] if bias else None)
        y_eager.backward(dy)
        assert torch.equal(y, y_eager)
        for got, want in zip((x, w_kn) + ((b,) if bias else ()), leaves):
            assert torch.equal(got.grad, want.grad)
        xd, wd = x.detach(), w_kn.detach()
        assert_rounded_once(y.detach(), None if b is None else b.detach(), xd, wd, None, name="y")
        assert_rounded_once(x.grad, None, dy, wd.t(), None, name="dX")
        assert_rounded_once(w_kn.grad, None, xd.t(), dy, None, name="dW")
        if bias:
            assert_rounded_once(b.grad.unsqueeze(0), None, torch.ones(1, m, dtype=dtype), dy, None, name="db")
    x, w_kn, b = _make((8, 16, 24), torch.float32, "cpu", bias=True, layout=layout)  # an fp32 bias
    x, w_kn = x.to(dtype).requires_grad_(), w_kn.to(dtype)
    calls.clear()
    _call(fm, layout, b, x, w_kn, None)
    assert calls == ["_fwd"]


def _graph_ops(gm: torch.fx.GraphModule) -> set[str]:
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["linear", "conv1d"])
@pytest.mark.parametrize("training", [False, True])
def test_cpu_compiled_traces_atens_gemm(fm, dtype, layout, training):
    """Under torch.compile on the CPU, a call without an activation that the eager rules hand to ATen's GEMM
    (fp32 inference; 16-bit where oneDNN runs the dtype natively, training included) traces F.linear: Inductor gets the
    plain model's graph (extern mm, fused neighbours), not an opaque op call that copies the product once more
    (compiled tiny-model decode: 0.77-0.92x the plain compiled model with the op). One graph for token counts 1, 7
    and 300 (no guard on the count: without native oneDNN a symbolic count keeps the op), the same bits as F.linear
    traced alone, gradients included."""
    addmm_mod = sys.modules[fm.__name__ + ".addmm"]
    native = dtype is torch.float32 or addmm_mod._onednn_native(dtype)
    aten = native and (not training or dtype is not torch.float32)  # fp32 training keeps the op (fp64 bias sums)
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(40, 48, generator=g) / 7).to(dtype)
    b = torch.randn(40, generator=g).to(dtype)
    w_kn = w.t() if layout == "linear" else w.t().contiguous()
    if training:
        w_kn.requires_grad_()
        b.requires_grad_()
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def fn(x):
        return _call(fm, layout, b, x, w_kn, None)

    def ref(x):
        return F.linear(x, w_kn.t(), b)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True), (contextlib.nullcontext() if training
                                                               else torch.no_grad()):
        for t in (1, 7, 300):
            x = torch.randn(2, t, 48, generator=g).to(dtype).requires_grad_(training)
            torch._dynamo.decorators.mark_unbacked(x, 1)
            y = compiled(x)
            y_ref = ref(x)
            if aten:
                assert torch.equal(y, y_ref)
            else:  # the op: its own rounding (test_forward_rounded_once), F.linear's within a few ulps
                torch.testing.assert_close(y, y_ref)
            if training:
                dy = torch.randn(y.shape, generator=g).to(dtype)
                got = torch.autograd.grad(y, (x, w_kn, b), dy)
                want = torch.autograd.grad(y_ref, (x, w_kn, b), dy)
                if aten:
                    for a, e in zip(got, want):
                        assert torch.equal(a, e)
    torch._dynamo.reset()
    assert len(graphs) == 1
    ops_in_graph = _graph_ops(graphs[0])
    took_op = any("addmm_fwd" in o for o in ops_in_graph) or any("Function" in o or "apply" in o
                                                               for o in ops_in_graph)
    assert took_op != aten, ops_in_graph


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["linear", "conv1d"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("act", ["gelu_tanh", "gelu"])
def test_cpu_16bit_gelu_training_is_onednn(fm, monkeypatch, dtype, layout, bias, act):
    """16-bit CPU training with a GeLU, where oneDNN runs the dtype natively: the forward is oneDNN's linear with the
    GeLU post-op (the inference path's bits), the backward recomputes Z with ATen's 16-bit GEMM and runs ATen's dX
    and dW GEMMs on dZ rounded to the input dtype, as on the GPU (the op widens x, w and dY to fp32 copies for each
    GEMM). Checked on the machine that runs it, with a long reduction for each of y, dX, dW and db: each one rounding
    of its fp32 accumulation (a GEMM on the fp32 dZ, or accumulated in 16 bits, fails the bound), Z one rounding, and
    dZ the fp32 value of dY * act'(Z) for this activation (tanh and erf GeLU differ by far more). Without native
    oneDNN: the op's Function."""
    native = sys.modules[fm.__name__ + ".addmm"]._onednn_native(dtype)
    calls = _op_calls(fm, monkeypatch)
    algorithm = "tanh" if act == "gelu_tanh" else "none"
    for i, (m, k, n) in enumerate(_LONG_REDUCTIONS):
        x, w_kn, b, dy = _cpu_training_operands((m, k, n), dtype, 5 + i, i, bias, layout)
        raw_dw = []
        w_kn.register_hook(raw_dw.append)  # the gradient backward returns, before accumulation copies it
        y = _call(fm, layout, b, x, w_kn, act)
        y.backward(dy)
        if _took_op(calls, native):
            continue
        assert raw_dw[0].stride() == w_kn.stride()  # dW made in the weight's own layout (no copy into it)
        xd, wd, bd = x.detach(), w_kn.detach(), None if b is None else b.detach()
        with torch.no_grad():
            assert torch.equal(y, _call(fm, layout, bd, xd, wd, act))
        assert_rounded_once(y.detach(), bd, xd, wd, act, name="y")
        z = F.linear(xd, wd.t(), bd)
        assert_rounded_once(z, bd, xd, wd, None, name="z")
        dz32 = torch.ops.aten.gelu_backward(dy.float(), z.float(), approximate=algorithm)
        z64 = z.double().requires_grad_()
        _act64(z64, act).backward(dy.double())
        torch.testing.assert_close(dz32.double(), z64.grad, rtol=1e-5, atol=1e-5)  # tanh vs erf: ~1e-3
        dz = dz32.to(dtype)
        assert_rounded_once(x.grad, None, dz, wd.t(), None, name="dX")
        assert_rounded_once(w_kn.grad, None, xd.t(), dz, None, name="dW")
        if bias:
            assert_rounded_once(b.grad.unsqueeze(0), None, torch.ones(1, m), dz32, None, name="db")
        if i == 1:  # an fp32 gradient at y reaches dZ uncast (rounded to 16 bits first, dX breaks its bound here)
            up = torch.randn(m, n, generator=torch.Generator().manual_seed(7))
            x.grad = w_kn.grad = None
            if bias:
                b.grad = None
            (_call(fm, layout, b, x, w_kn, act) * up).sum().backward()
            dz32 = torch.ops.aten.gelu_backward(up, z.float(), approximate=algorithm)
            assert_rounded_once(x.grad, None, dz32.to(dtype), wd.t(), None, name="dX (fp32 dY)")
            if bias:
                assert_rounded_once(b.grad.unsqueeze(0), None, torch.ones(1, m), dz32, None, name="db (fp32 dY)")
        if i == 0:  # [..., K] input: the same bits
            x3 = xd.view(m, 1, k).requires_grad_()
            y3 = _call(fm, layout, bd, x3, wd, act)
            y3.backward(dy.view(m, 1, n))
            assert torch.equal(y3.view(m, n), y) and torch.equal(x3.grad.view(m, k), x.grad)
