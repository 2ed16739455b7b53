"""Tensors of more than 2^31 - 1 elements (GPU only): every kernel indexes them in 64 bits (a long prefill of
128K tokens at hidden size 16384 is 2^31 elements). Each case fills its inputs on the device, runs our op forward
and backward, and checks every row, in chunks of rows, with the 2x rule: the fp32 definition as the truth, PyTorch's
same-dtype computation of the same chunk as the yardstick. Gradients of weights (sums over all rows) are checked
against the chunks' fp32 sums (accumulated in fp64), with the chunks' same-dtype gradients summed as the yardstick.

Each case holds 10-45 GiB of device memory: across pytest-xdist workers they run one at a time (a file lock), and a
case skips when the device has too little free memory for it. They carry the `large_tensors` marker: the GPU session
runs them as a stage of their own (tools/gpu_session.sh `large`), outside the main test run's time limit."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import sys
import tempfile

import pytest
import torch
import torch.nn.functional as F
from _utils import FLOOR, assert_2x_rule, spy_mlp_ops
from conftest import CUDA

pytestmark = [pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU with tens of GiB (GPU machine only)"),
              pytest.mark.large_tensors]

BIG = 2**31  # elements: one past the largest 32-bit signed index
GIB = 2**30
BF16, F32 = torch.bfloat16, torch.float32
SM90 = CUDA and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture
def big_memory():
    """Holds the machine-wide lock for the whole test (its tensors are freed before the lock is released);
    call the returned function with the GiB the case needs (it skips when the device has less free)."""
    path = os.path.join(tempfile.gettempdir(), "fused-mlp-large-tensors.lock")
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)

        def need(gib: float) -> None:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info()
            if free < gib * GIB:
                pytest.skip(f"needs {gib:.0f} GiB of free device memory, {free / GIB:.0f} GiB free")

        try:
            yield need
        finally:
            # A failed test's frames (and tensors) stay reachable from the last traceback: drop it first.
            sys.last_type = sys.last_value = sys.last_traceback = None
            if hasattr(sys, "last_exc"):
                sys.last_exc = None
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)


def randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", dtype=dtype, generator=g).mul_(scale)  # no fp32 copy of a 4 GiB tensor


def chunks(rows: int, cols: int, elems: int = 2**27):
    """Row ranges [a, b) of about `elems` elements each, the last one ending at `rows`."""
    step = max(1, elems // max(cols, 1))
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]


def check_rows(name, fn, rows_in, shared, ours_out, ours_row_grads, ours_shared_grads, dy, *, n_rows, width=None,
               grads=True):
    """fn(*row_inputs, *shared) -> output, plain PyTorch. Every chunk of rows: ours against the truth (fp32; fp64 for
    fp32 inputs) and against the same-dtype PyTorch result of that chunk, output and (`grads`) gradients of the row
    inputs; then the shared inputs' gradients against the chunk sums (truth accumulated in fp64, yardstick the
    same-dtype chunk gradients summed in fp32; the floor adds 4e-6 of the largest sum for fp32 accumulation over all
    rows in any order: a row left out would still show). `width`: elements per row of fn's largest intermediate (sets
    the chunk size; default the output's)."""
    truth_dtype = torch.float64 if any(t.dtype == F32 for t in rows_in) else F32
    truth_shared = [torch.zeros(s.shape, dtype=torch.float64, device="cuda") for s in shared]
    same_shared = [torch.zeros(s.shape, dtype=F32, device="cuda") for s in shared]
    for a, b in chunks(n_rows, width or ours_out.shape[-1]):
        where = f"{name}, rows {a}..{b - 1} of {n_rows}"
        for prec in (truth_dtype, None):
            ins = [t[a:b].detach().to(prec or t.dtype).requires_grad_(grads) for t in rows_in]
            sh = [s.detach().to(prec or s.dtype).requires_grad_(grads) for s in shared]
            with torch.set_grad_enabled(grads):
                out = fn(*ins, *sh)
            g = torch.autograd.grad(out, ins + sh, dy[a:b].to(prec or dy.dtype)) if grads else []
            if prec is truth_dtype:
                out32, g32 = out.detach(), g
                for acc, gk in zip(truth_shared, g[len(ins):]):
                    acc += gk.double()
            else:
                out_same, g_same = out.detach(), g
                for acc, gk in zip(same_shared, g[len(ins):]):
                    acc += gk.float()
        assert_2x_rule(ours_out[a:b], out32, out_same, name=f"{where}: output")
        for k, ours_g in enumerate(ours_row_grads):
            assert_2x_rule(ours_g[a:b], g32[k], g_same[k], name=f"{where}: grad of row input {k}")
        del out32, g32, out_same, g_same, ins, sh, out, g
    for k, (ours_g, truth, same) in enumerate(zip(ours_shared_grads, truth_shared, same_shared)):
        floor = FLOOR[ours_g.dtype] + 4e-6 * truth.abs().max().item()
        assert_2x_rule(ours_g, truth.float(), same.to(ours_g.dtype), name=f"{name}: grad of shared input {k}",
                       floor=floor)


# ---- RMSNorm: the reg kernels (bf16, N = 4096), clusters (N = 65536), the rows kernels (fp32), fused residual -------
RMS_CASES = [(4096, BF16, False), (4096, BF16, True), (65536, BF16, False), (4096, F32, False)]


@pytest.mark.parametrize("n,dtype,residual", RMS_CASES,
                         ids=[f"N{n}-{str(d)[6:]}{'-residual' if r else ''}" for n, d, r in RMS_CASES])
def test_rms_norm(fm, big_memory, n, dtype, residual):
    m = BIG // n + 3
    size = m * n * dtype.itemsize / GIB
    big_memory(size * (6 if residual else 4) + (10 if dtype == F32 else 6))
    x = randn(m, n, dtype=dtype, seed=1).requires_grad_()
    w = (1 + randn(n, dtype=F32, seed=2, scale=0.1)).to(dtype).requires_grad_()
    res = randn(m, n, dtype=dtype, seed=3).requires_grad_() if residual else None
    out = fm.rms_norm(x, w, 1e-6, residual=res)
    y, h = out if residual else (out, None)
    dy = randn(m, n, dtype=dtype, seed=4)
    grads = torch.autograd.grad(y, [x, w] + ([res] if residual else []), dy)
    dx, dw = grads[0], grads[1]
    if residual:
        for a, b in chunks(m, n):  # h is x + residual rounded once to the stream's dtype
            assert torch.equal(h[a:b], x[a:b].detach() + res[a:b].detach()), f"h, rows {a}..{b - 1}"
        # d(residual) is dx itself (the backward returns one tensor for both), checked below by the 2x rule
        del grads, out
        x = h  # the normalised value
    else:
        del grads, out
    check_rows(f"rms_norm N={n} {dtype}", lambda t, wt: F.rms_norm(t, (n,), wt, 1e-6), [x], [w], y, [dx], [dw], dy,
               n_rows=m)


# ---- gated activation: one pack per thread (4096), row halves of one [rows, 2I] tensor, the scalar path (2049) ----
GEGLU_CASES = [(4096, False), (4096, True), (2049, False)]


@pytest.mark.parametrize("cols,halves", GEGLU_CASES, ids=[f"I{c}{'-halves' if h else ''}" for c, h in GEGLU_CASES])
def test_geglu(fm, big_memory, cols, halves):
    rows = BIG // cols + 3
    big_memory(rows * cols * 2 * 6 / GIB + 6)
    if halves:
        both = randn(rows, 2 * cols, dtype=BF16, seed=5)
        gate, up = both[:, :cols], both[:, cols:]
    else:
        gate, up = randn(rows, cols, dtype=BF16, seed=5), randn(rows, cols, dtype=BF16, seed=6)
    gate.requires_grad_()
    up.requires_grad_()
    h = fm.geglu(gate, up)
    dh = randn(rows, cols, dtype=BF16, seed=7)
    dgate, dup = torch.autograd.grad(h, [gate, up], dh)
    check_rows(f"geglu I={cols}", lambda g, u: F.gelu(g, approximate="tanh") * u, [gate, up], [], h, [dgate, dup],
               [], dh, n_rows=rows)


# ---- addmm / Linear with bias and GeLU: an [M, N] output of 2^31 + elements, the CUTLASS kernel and cuBLASLt -------
ADDMM_MODES = ["cutlass", "cublaslt"] if SM90 else ["auto"]


def kernels_run(fn):
    """fn()'s result and the names of the CUDA kernels it launched."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    return out, {e.name for e in prof.events()}


@contextlib.contextmanager
def sm90_mode(fm, mode: str):
    """The private op _addmm_sm90_mode: 0 off (cuBLASLt), 2 on (the CUTLASS kernel wherever it can run)."""
    if mode == "auto":
        yield
        return
    prev = fm._ops.ops._addmm_sm90_mode({"cublaslt": 0, "cutlass": 2}[mode])
    try:
        yield
    finally:
        fm._ops.ops._addmm_sm90_mode(prev)


@pytest.mark.parametrize("mode", ADDMM_MODES)
def test_linear_gelu(fm, big_memory, mode):
    m, k, n = BIG // 4096 + 3, 64, 4096
    big_memory(m * n * (2 * 3 + 4) / GIB + 6)  # y, dy, the saved pre-activation; an fp32 buffer on cuBLASLt's path
    x = randn(m, k, dtype=BF16, seed=8).requires_grad_()
    w = randn(n, k, dtype=BF16, seed=9, scale=k**-0.5).requires_grad_()
    b = randn(n, dtype=BF16, seed=10).requires_grad_()
    with sm90_mode(fm, mode):
        y, names = kernels_run(lambda: fm.linear(x, w, b, activation="gelu_tanh"))
        if mode != "auto":  # the path asked for is the one that ran
            assert any("fm_addmm_sm90" in k for k in names) == (mode == "cutlass"), sorted(names)
        dy = randn(m, n, dtype=BF16, seed=11)
        dx, dw, db = torch.autograd.grad(y, [x, w, b], dy)
    check_rows(f"linear gelu_tanh ({mode})", lambda t, wt, bt: F.gelu(F.linear(t, wt, bt), approximate="tanh"), [x],
               [w, b], y, [dx], [dw, db], dy, n_rows=m)


# ---- gated MLP: h = [T, I] of 2^31 + elements (the sm_90 GEMM-epilogue kernels where DISPATCH takes them) --------
@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_gated_mlp_large_intermediate(fm, big_memory, monkeypatch, train):
    t, hid, inter = BIG // 16384 + 1, 2048, 16384
    big_memory(t * inter * 2 * (5 if train else 2) / GIB + 10)
    x = randn(t, hid, dtype=BF16, seed=12).requires_grad_(train)
    wg, wu = (randn(inter, hid, dtype=BF16, seed=s, scale=hid**-0.5).requires_grad_(train) for s in (13, 14))
    wd = randn(hid, inter, dtype=BF16, seed=15, scale=inter**-0.5).requires_grad_(train)

    def mlp(xt, g, u, d):
        return F.linear(F.gelu(F.linear(xt, g), approximate="tanh") * F.linear(xt, u), d)

    dy = randn(t, hid, dtype=BF16, seed=16)
    called = spy_mlp_ops(fm, monkeypatch)
    with torch.set_grad_enabled(train):
        y = fm.gated_mlp(x, wg, wu, wd)
    grads = torch.autograd.grad(y, [x, wg, wu, wd], dy) if train else [None] * 4
    if SM90:  # DISPATCH takes the GEMM-epilogue kernels at this shape (inference; both training passes)
        want = ["gated_gemm_fwd_slopes", "gated_gemm_bwd_slopes_"] if train else ["gated_gemm_fwd"]
        assert [c for c in called if c.startswith("gated_gemm")] == want, called
    check_rows(f"gated_mlp {'training' if train else 'inference'}", mlp, [x], [wg, wu, wd], y, grads[:1] if train
               else [], grads[1:] if train else [], dy, n_rows=t, width=inter, grads=train)


# ---- decode kernels: weights of 2^31 + elements (T <= 64 tokens, the ops themselves) ---------------------------
def test_decode_ops_with_large_weights(fm, big_memory):
    hid, inter, t = 16384, BIG // 16384 + 8, 4  # I a multiple of 8 (16-byte rows)
    big_memory(3 * hid * inter * 2 / GIB + 10)
    ops = fm._ops.ops
    x = randn(t, hid, dtype=BF16, seed=17)
    wg, wu = (randn(inter, hid, dtype=BF16, seed=s, scale=hid**-0.5) for s in (18, 19))
    wd = randn(hid, inter, dtype=BF16, seed=20, scale=inter**-0.5)
    act = lambda z: F.gelu(z, approximate="tanh")  # noqa: E731
    x32 = x.float()
    y32 = torch.zeros(t, hid, device="cuda", dtype=F32)
    for a, b in chunks(inter, hid):  # the fp32 truth over slices of I (fp32 copies of every weight would be 24 GiB)
        y32 += F.linear(act(F.linear(x32, wg[a:b].float())) * F.linear(x32, wu[a:b].float()), wd[:, a:b].float())
    same = F.linear(act(F.linear(x, wg)) * F.linear(x, wu), wd)
    assert_2x_rule(ops.gated_mlp_decode(x, wg, wu, wd, "gelu_tanh"), y32, same, name="gated_mlp_decode")
    del y32, same
    xi = randn(t, inter, dtype=BF16, seed=21)  # linear_decode: x [T, K] @ w [N, K]^T with w = w_gate's [I, H] as [N, K]
    w = wg.view(hid, inter)
    ref = torch.cat([F.linear(xi.float(), w[a:b].float()) for a, b in chunks(hid, inter)], dim=1)
    assert_2x_rule(ops.linear_decode(xi, w), ref, F.linear(xi, w), name="linear_decode")
