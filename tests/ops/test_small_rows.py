"""Few-rows (decode-class) CUDA paths, chosen by the C++ launchers by size: rms_norm's latency kernel
(``rms_norm_fwd_small_kernel``: one row per block, the row in registers) and the gated activations' one-pack-per-thread
kernel (``geglu_fwd_small_kernel``: first built for decode, now every 16-bit forward on the vector path), against the
fp32 reference with the 2x rule.

The knobs ``FUSED_MLP_RMS_NORM_SMALL`` / ``FUSED_MLP_GEGLU_SMALL`` (auto | on | off, read once per process) pick the
path. Every case here runs in the mode of the test process (auto unless set) and, from
``test_forced_paths_subprocess``, again in fresh processes with both paths forced on and both forced off, so the new
kernels and the persistent ones are checked at the same shapes; ``test_path_follows_knob`` checks with the profiler
that each setting launches the kernel it names. GPU only (skipped on CPU machines).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from _utils import assert_2x_rule, exact_act
from conftest import CUDA, ROOT
from test_geglu import ACTS, call, floor_for, inputs, torch_act
from test_rms_norm import make, run_case

pytestmark = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (runs on the GPU machine, not in CI)")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MS = [1, 2, 3, 7, 16, 63, 64, 65]
NS = [1, 3, 128, 256, 512, 1000, 2048, 2304, 4096, 5376, 8192, 16384]
# The launchers' "auto" limits (kernels_src/cuda/rms_norm.cu small_max_rows: rms_norm's few-rows kernel up to
# M = 64 rows at every N it holds, and for 16-bit rows of N = 2048..8192 up to M * N = 2^21 elements; geglu.cu
# small_max_elems: every 16-bit size, fp32 up to 2^21 elements, and its block size switch at 2^20): the row counts on
# both sides are tested too.
RMS_AUTO_MAX_ELEMS_16 = 1 << 21
GEGLU_AUTO_MAX_ELEMS = {2: None, 4: 1 << 21}  # by element size (None: no limit)
GEGLU_WIDE_BLOCK_ELEMS = 1 << 20


def rms_auto_max_rows(n: int, dtype: torch.dtype) -> int | None:
    """The few-rows forward's auto row limit for rows of n elements (None: rows it does not hold)."""
    elem = torch.empty(0, dtype=dtype).element_size()
    if n * elem > 16384 * 2:
        return None
    return max(64, RMS_AUTO_MAX_ELEMS_16 // n) if elem == 2 and 2048 <= n <= 8192 else 64


def rms_row_counts(n: int, dtype: torch.dtype) -> list[int]:
    limit = rms_auto_max_rows(n, dtype)
    return MS + ([limit - 1, limit, limit + 1] if limit is not None and limit > 64 else [])


def check_rstd(fm, x, w, *, eps=1e-6, offset=0.0, residual=None, residual_dtype=None):
    """The op's saved rstd (what the backward uses) vs the fp64 value of the rounded h."""
    ops = fm._ops.ops
    _, h, rstd = ops.rms_norm_fwd(x, residual, w, eps, offset, x.dtype, residual_dtype)
    hh = h if residual is not None else x
    ref = torch.rsqrt(hh.double().pow(2).mean(-1) + eps)
    assert rstd.shape == (x.shape[0],) and rstd.dtype == torch.float32
    torch.testing.assert_close(rstd.double(), ref, rtol=4e-6, atol=0.0)


# ---- rms_norm ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("N", NS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_fwd_shapes(fm, dtype, N):
    """y (2x rule) and rstd at every row count around the decode sizes and the auto limit."""
    w = 1 + 0.25 * make((N,), dtype, "cuda", seed=1)
    for M in rms_row_counts(N, dtype):
        x = make((M, N), dtype, "cuda", seed=M)
        run_case(fm, x, w, check_grads=False)
        check_rstd(fm, x, w)


VARIANTS = ["plain", "residual", "residual_fp32", "gemma", "fp32_weight", "no_weight", "row_stride"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_variants(fm, dtype, variant):
    """Every feature of the forward through the few-rows path, with the backward (which reads the saved rstd)."""
    for N in (128, 2048, 4096, 5376, 8192):
        for M in (1, 7, 64, 65):
            x = make((M, N), dtype, "cuda", seed=M + N)
            w = 1 + 0.25 * make((N,), dtype, "cuda", seed=1)
            if variant == "plain":
                run_case(fm, x, w)
                check_rstd(fm, x, w)
            elif variant in ("residual", "residual_fp32"):
                rd = torch.float32 if variant == "residual_fp32" else None
                r = make((M, N), rd or dtype, "cuda", seed=2)
                run_case(fm, x, w, residual=r, residual_dtype=rd)
                check_rstd(fm, x, w, residual=r, residual_dtype=rd)
            elif variant == "gemma":
                wg = 0.1 * make((N,), dtype, "cuda", seed=3)
                run_case(fm, x, wg, offset=1.0)
                run_case(fm, x, wg, offset=1.0, residual=make((M, N), dtype, "cuda", seed=2))
                check_rstd(fm, x, wg, offset=1.0)
            elif variant == "fp32_weight":
                w32 = w.float()
                run_case(fm, x, w32, out_dtype=torch.float32)
                run_case(fm, x, w32)
                run_case(fm, x, w32, residual=make((M, N), torch.float32, "cuda", seed=2),
                         residual_dtype=torch.float32, out_dtype=torch.float32)
                check_rstd(fm, x, w32)
            elif variant == "no_weight":
                run_case(fm, x, None)
                run_case(fm, x, None, offset=1.0, residual=make((M, N), dtype, "cuda", seed=2))
                check_rstd(fm, x, None)
            else:  # rows of a wider buffer: a row stride other than N (still 16-byte aligned)
                xs = make((M, N + 16), dtype, "cuda", seed=5)[:, 8:N + 8]
                rs = make((M, N + 32), dtype, "cuda", seed=6)[:, :N]
                run_case(fm, xs, w)
                run_case(fm, xs, w, residual=rs)
                check_rstd(fm, xs, w, residual=rs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_nan_inf(fm, dtype):
    """NaN/Inf in a row propagate as in the fp32 reference (NaN/Inf patterns are part of the 2x rule)."""
    M, N = 4, 4096
    x = make((M, N), dtype, "cuda")
    x[0, 5] = float("nan")
    x[1, 7] = float("inf")
    x[2, 9] = -float("inf")
    w = 1 + 0.25 * make((N,), dtype, "cuda", seed=1)
    w[11] = float("inf")
    run_case(fm, x, w, check_grads=False)
    x[0, 5] = 3.0  # with a residual: Inf only (run_case checks h bitwise, and NaN != NaN)
    run_case(fm, x, w, residual=make((M, N), dtype, "cuda", seed=2), check_grads=False)


def test_rms_norm_misaligned_and_odd_stay_correct(fm):
    """Layouts the few-rows kernel does not take (odd N, misaligned base, odd row stride) at few rows."""
    for N in (1000, 4096):
        flat = make((3 * N + 1,), torch.bfloat16, "cuda")
        run_case(fm, flat[1:].view(3, N), 1 + 0.25 * make((N,), torch.bfloat16, "cuda", seed=1))
        run_case(fm, make((3, N + 1), torch.bfloat16, "cuda")[:, :N], 1 + 0.25 * make((N,), torch.bfloat16, "cuda"))
    run_case(fm, make((5, 4099), torch.float16, "cuda"), None)


# ---- gated activations ------------------------------------------------------------------------------------------

IS = [8, 24, 1000, 2048, 8192, 14336, 16384]


def geglu_token_counts(i: int, dtype: torch.dtype) -> list[int]:
    limit = GEGLU_AUTO_MAX_ELEMS[torch.empty(0, dtype=dtype).element_size()]
    wide = GEGLU_WIDE_BLOCK_ELEMS // i
    return MS + [wide, wide + 1] + ([limit // i, limit // i + 1] if limit else [])


def check_act(fm, act, gate, up):
    out = call(fm, act, gate, up)
    dtype = gate.dtype
    ref32 = (torch_act(act, gate.float()) * up.float()).to(dtype)
    same = torch_act(act, gate) * up
    assert out.shape == gate.shape and out.dtype == dtype and out.is_contiguous()
    assert_2x_rule(out, ref32, same, floor=floor_for(ref32.float()) if dtype == torch.float32 else None)


@pytest.mark.parametrize("I", IS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ACTS)
def test_gated_act_shapes(fm, act, dtype, I):
    for T in geglu_token_counts(I, dtype):
        gate, up = inputs((T, I), dtype, "cuda", seed=T)
        check_act(fm, act, gate, up)


@pytest.mark.parametrize("act", ACTS)
def test_gated_act_layouts(fm, act):
    """Halves of one [T, 2I] tensor (row stride 2I: the row-division path), 3-D, and a misaligned view."""
    for dtype in DTYPES:
        for T, I in ((1, 8192), (3, 2048), (16, 14336), (65, 1000), (80, 16384)):  # 80 x 16384: 512-thread blocks
            both = inputs((T, 2 * I), dtype, "cuda", seed=T)[0]
            check_act(fm, act, both[:, :I], both[:, I:])
            gate, up = inputs((2, T, I), dtype, "cuda", seed=1)
            check_act(fm, act, gate, up)
            g, u = inputs((T * I + 1,), dtype, "cuda", seed=2)
            check_act(fm, act, g[1:].view(T, I), u[1:].view(T, I))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ACTS)
def test_gated_act_nan_inf(fm, act, dtype):
    """NaN/Inf through the vector path: the pattern of the exact definition (Python doubles, _utils.exact_act)."""
    specials = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 30.0, -30.0, 90.0, -90.0]
    gate, up = inputs((2, 64), dtype, "cuda")
    gate.view(-1)[: len(specials)] = torch.tensor(specials, dtype=dtype)
    up.view(-1)[64:64 + len(specials)] = torch.tensor(specials, dtype=dtype)
    out = call(fm, act, gate, up)
    exact = torch.tensor([exact_act(act, v) for v in gate.double().flatten().tolist()], dtype=torch.float64)
    ref = exact.view(gate.shape).to(gate.device) * up.double()
    floor = floor_for(ref.float()) if dtype == torch.float32 else None
    assert_2x_rule(out, ref, torch_act(act, gate) * up, floor=floor)


@pytest.mark.parametrize("var", ["FUSED_MLP_RMS_NORM_PDL", "FUSED_MLP_GEGLU_PDL"])
def test_pdl_same_bits_and_ordering(fm, monkeypatch, var):
    """Programmatic dependent launch (sm_90+, on by default; the variable is read per call): the few-rows kernels give
    the same bits without it, and each waits for the kernel before it -- inputs written by the preceding kernel,
    eagerly and replayed in a CUDA graph, are read after that write."""
    T, N = 16, 8192
    base = make((T, N), torch.bfloat16, "cuda", seed=3)
    w = 1 + 0.25 * make((N,), torch.bfloat16, "cuda", seed=4)
    x = torch.empty_like(base)

    def step(scale: float) -> torch.Tensor:
        torch.mul(base, scale, out=x)  # the producer: a torch kernel right before ours, writing its input
        if var == "FUSED_MLP_RMS_NORM_PDL":
            return fm.rms_norm(x, w)
        return fm.swiglu(x, x)

    def expect(scale: float) -> torch.Tensor:
        xs = base * scale
        return fm.rms_norm(xs, w) if var == "FUSED_MLP_RMS_NORM_PDL" else fm.swiglu(xs, xs)

    with_pdl = [step(s).clone() for s in (1.0, -2.0, 0.5)]
    monkeypatch.setenv(var, "0")
    without = [step(s).clone() for s in (1.0, -2.0, 0.5)]
    monkeypatch.delenv(var)
    for a, b in zip(with_pdl, without):
        assert torch.equal(a, b), f"{var}: PDL changed the result"
    for s, a in zip((1.0, -2.0, 0.5), with_pdl):
        assert torch.equal(a, expect(s))
    # In a CUDA graph: the producer and ours captured back to back, replayed with a new scale each time.
    scale = torch.ones((), device="cuda", dtype=torch.bfloat16)
    out_holder: list[torch.Tensor] = []
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside capture
            torch.mul(base, scale, out=x)
            (fm.rms_norm(x, w) if var == "FUSED_MLP_RMS_NORM_PDL" else fm.swiglu(x, x))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.mul(base, scale, out=x)
        out_holder.append(fm.rms_norm(x, w) if var == "FUSED_MLP_RMS_NORM_PDL" else fm.swiglu(x, x))
    for s in (3.0, -0.25, 1.0):
        scale.fill_(s)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_holder[0], expect(s)), f"{var}: graph replay read stale input (scale {s})"


# ---- which kernel runs --------------------------------------------------------------------------------------------


def _kernel_names(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if "rms_norm" in e.name or "geglu" in e.name]


def _mode(var: str) -> str:
    return os.environ.get(var, "auto").split(",")[0]


def test_path_follows_knob(fm):
    """Under each knob setting the launcher takes the kernel it names (auto: rms_norm's few-rows kernel at M = 1 and
    the reg kernel at M = 8192, the gated activation's few-elements kernel at T = 1)."""
    rms, act = _mode("FUSED_MLP_RMS_NORM_SMALL"), _mode("FUSED_MLP_GEGLU_SMALL")
    if rms == "dynamic" or act == "dynamic":
        pytest.skip("dynamic knobs (benchmarks only)")
    x1 = make((1, 4096), torch.bfloat16, "cuda")
    w = make((4096,), torch.bfloat16, "cuda", seed=1)
    xl = torch.randn((8192, 4096), device="cuda", dtype=torch.bfloat16)
    small1 = any("rms_norm_fwd_small_kernel" in n for n in _kernel_names(lambda: fm.rms_norm(x1, w)))
    small_l = any("rms_norm_fwd_small_kernel" in n for n in _kernel_names(lambda: fm.rms_norm(xl, w)))
    assert small1 == (rms != "off"), (rms, small1)  # auto: the few-rows kernel up to M = 64
    assert small_l == (rms == "on"), (rms, small_l)
    # auto's limit by (N, dtype): both sides of it (rms_auto_max_rows).
    for dtype, n, m in ((torch.bfloat16, 4096, 512), (torch.bfloat16, 4096, 513), (torch.float16, 2048, 1024),
                        (torch.bfloat16, 8192, 257), (torch.bfloat16, 16384, 65), (torch.float32, 2048, 65)):
        x = make((m, n), dtype, "cuda")
        wn = make((n,), dtype, "cuda", seed=1)
        small = any("rms_norm_fwd_small_kernel" in k for k in _kernel_names(lambda: fm.rms_norm(x, wn)))
        assert small == (rms == "on" or (rms == "auto" and m <= rms_auto_max_rows(n, dtype))), (rms, dtype, n, m)
    g1, u1 = inputs((1, 8192), torch.bfloat16, "cuda")
    gl, ul = (torch.randn((4096, 16384), device="cuda", dtype=torch.bfloat16) for _ in range(2))
    small1 = any("geglu_fwd_small_kernel" in n for n in _kernel_names(lambda: fm.swiglu(g1, u1)))
    small_l = any("geglu_fwd_small_kernel" in n for n in _kernel_names(lambda: fm.swiglu(gl, ul)))
    assert small1 == (act != "off"), (act, small1)
    assert small_l == (act != "off"), (act, small_l)  # 16-bit: one pack per thread at every size
    for t in (256, 257):  # fp32: up to 2^21 elements
        g, u = inputs((t, 8192), torch.float32, "cuda")
        small = any("geglu_fwd_small_kernel" in n for n in _kernel_names(lambda: fm.swiglu(g, u)))
        assert small == (act == "on" or (act == "auto" and t * 8192 <= GEGLU_AUTO_MAX_ELEMS[4])), (act, t)
    g, u = inputs((4, 1001), torch.bfloat16, "cuda")  # not whole 16-byte packs: the scalar persistent kernel
    assert not any("geglu_fwd_small_kernel" in n for n in _kernel_names(lambda: fm.swiglu(g, u))), act


@pytest.mark.parametrize("knobs", ["on", "off", "on,packs=8|on,threads=64"])
def test_forced_paths_subprocess(knobs):
    """This file again in a fresh process per setting (the knobs are read once per process): both few-rows paths
    forced on (incl. the other packs-per-thread / block-size choices) and both forced off."""
    rms, act = (knobs.split("|") + [knobs])[:2]
    env = {**os.environ, "FUSED_MLP_RMS_NORM_SMALL": rms, "FUSED_MLP_GEGLU_SMALL": act}
    args = [sys.executable, "-m", "pytest", str(ROOT / "tests" / "ops" / "test_small_rows.py"), "-q", "-x",
            "-p", "no:cacheprovider", "-p", "no:xdist", "-k", "not subprocess"]
    if "packs" in rms:  # the other configurations: the shape sweeps suffice
        args[-1] = "fwd_shapes or gated_act_shapes"
    proc = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{knobs}:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
