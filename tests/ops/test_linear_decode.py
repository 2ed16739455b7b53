"""Bias-free Linear at decode sizes (kernels_src/cuda/gated_gemv.cu, op ``linear_decode``: the gated MLP's down pass
alone; dispatch in ``_decode.py`` / ``addmm.py``): the op against the fp32 reference (2x rule) at every token class and
its edges, model shapes (attention projections, lm_head-like N) and awkward ones (K tails, K below one chunk, N below
one row tile); bf16 and fp16; the tuning overrides and PDL (same bits); NaN/Inf; opcheck; argument errors; and which
calls of ``linear`` / the ``Linear`` layer take it (auto: T and N within the measured table; biases,
activations, training, Conv1D's row-major weight, the CPU and symbolic token counts never).

The kernel needs an sm_80+ GPU: those tests skip elsewhere (CI has no GPU); the dispatch tests that need no kernel run
on the CPU too."""

from __future__ import annotations

import functools
import sys

import pytest
import torch
import torch.nn.functional as F
from _utils import assert_2x_rule, compile_static_then_dynamic, fake_cuda, symbolic_tokens
from conftest import CUDA

SM80 = CUDA and torch.cuda.get_device_capability() >= (8, 0)
needs_gpu = pytest.mark.skipif(not SM80, reason="the decode GEMV kernels need an sm_80+ GPU (GPU machine only)")
DTYPES = [torch.bfloat16, torch.float16]
TOKENS = [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64]
# (K, N): Llama-3.2-1B q/o and k/v projections, a fused qkv, Llama-3-8B q, a down projection (K = 8192); a K tail
# (8 past a multiple of 32) with a row tail (N 8 past a multiple of 16); K below one chunk; N below one row tile.
SHAPES = [(2048, 2048), (2048, 512), (2048, 3072), (4096, 4096), (8192, 2048), (2056, 1032), (8, 8), (24, 5), (136, 40)]
ENV = "FUSED_MLP_LINEAR_DECODE"
TUNE = "FUSED_MLP_DECODE_TUNE"


@functools.lru_cache(maxsize=2)
def weight(k: int, n: int, dtype: torch.dtype):
    g = torch.Generator(device="cuda").manual_seed(k * 7919 + n)
    w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(dtype)
    return w, w.float()


def tokens(t: int, k: int, dtype: torch.dtype, seed: int = 0, device: str = "cuda") -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(t, k, device=device, generator=g).to(dtype)


def shape_id(s) -> str:
    return "x".join(map(str, s))


# ---- the op -------------------------------------------------------------------------------------------------------


@needs_gpu
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_op_matches_reference_at_every_token_count(fm, monkeypatch, shape, dtype):
    monkeypatch.delenv(TUNE, raising=False)
    k, n = shape
    w, w32 = weight(k, n, dtype)
    x = tokens(64, k, dtype, seed=k + n)
    r32, same = F.linear(x.float(), w32), F.linear(x, w)
    for t in TOKENS:
        y = fm._ops.ops.linear_decode(x[:t], w)
        assert y.shape == (t, n) and y.dtype == dtype and y.is_contiguous()
        assert_2x_rule(y, r32[:t], same[:t], name=f"y (T={t})")
    again = fm._ops.ops.linear_decode(x[:17], w)
    assert torch.equal(again, fm._ops.ops.linear_decode(x[:17], w)), "not bitwise reproducible"


@needs_gpu
@pytest.mark.parametrize("shape", [(2056, 1032), (136, 40)], ids=shape_id)
def test_tuning_overrides_and_pdl(fm, monkeypatch, shape):
    k, n = shape
    w, w32 = weight(k, n, torch.bfloat16)
    x = tokens(64, k, torch.bfloat16, seed=5)
    r32, same = F.linear(x.float(), w32), F.linear(x, w)
    for t in (1, 9, 17, 33, 64):
        monkeypatch.delenv(TUNE, raising=False)
        base = fm._ops.ops.linear_decode(x[:t], w)
        monkeypatch.setenv(TUNE, "pdl=0")
        assert torch.equal(fm._ops.ops.linear_decode(x[:t], w), base), f"PDL changed y (T={t})"
        for tune in ("lin_wk=1", "lin_wr=2,lin_wk=4", "lin_wr=8,lin_wk=1", "lin_wk=3"):
            monkeypatch.setenv(TUNE, tune)
            y = fm._ops.ops.linear_decode(x[:t], w)
            assert_2x_rule(y, r32[:t], same[:t], name=f"y (T={t}, {tune})")
    monkeypatch.setenv(TUNE, "lin_wr=4,lin_wk=4")
    with pytest.raises(RuntimeError, match="at most"):
        fm._ops.ops.linear_decode(x[:1], w)


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_and_inf_propagate(fm, monkeypatch, dtype):
    """A NaN token gives a NaN row; an Inf in weight row 3 gives +-Inf (or NaN) in output column 3, as the fp32
    reference does."""
    monkeypatch.delenv(TUNE, raising=False)
    w, _ = weight(136, 40, dtype)
    w = w.clone()
    w[3, 7] = float("inf")
    x = tokens(5, 136, dtype, seed=1)
    x[2, 11] = float("nan")
    y = fm._ops.ops.linear_decode(x, w)
    ref = F.linear(x.float(), w.float())
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    assert torch.equal(torch.isinf(y), torch.isinf(ref))


@needs_gpu
def test_empty_and_degenerate_sizes(fm):
    w, _ = weight(136, 40, torch.bfloat16)
    assert fm._ops.ops.linear_decode(tokens(0, 136, torch.bfloat16), w).shape == (0, 40)
    assert fm._ops.ops.linear_decode(tokens(3, 136, torch.bfloat16), w[:0]).shape == (3, 0)
    z = fm._ops.ops.linear_decode(tokens(3, 0, torch.bfloat16), torch.empty(40, 0, device="cuda",
                                                                               dtype=torch.bfloat16))
    assert z.shape == (3, 40) and not z.any()


@needs_gpu
def test_op_checks_its_arguments(fm):
    op = fm._ops.ops.linear_decode
    w, _ = weight(136, 40, torch.bfloat16)
    x = tokens(3, 136, torch.bfloat16)
    cases = [((x.float(), w.float()), "bfloat16 or float16"), ((x, w.half()), "dtype"),
             ((x, w[:, :128]), "contiguous"), ((x[:, :128].contiguous(), w), "w must be"),
             ((tokens(65, 136, torch.bfloat16), w), "at most 64"), ((x[:, :132].contiguous(), w[:, :132].contiguous()),
                                                                    "multiple of 8"),
             ((x.cpu(), w), "CUDA"), ((x, w.t()), "contiguous")]
    for args, match in cases:
        with pytest.raises(RuntimeError, match=match):
            op(*args)


@needs_gpu
def test_opcheck(fm):
    w, _ = weight(136, 40, torch.bfloat16)
    for t in (1, 13, 40):
        torch.library.opcheck(fm._ops.ops.linear_decode, (tokens(t, 136, torch.bfloat16), w))
        torch.library.opcheck(fm._ops.ops.linear_auto, (tokens(t, 136, torch.bfloat16), w, 16))


# ---- linear / Linear through it ------------------------------------------------------------------------------------


def spy(fm, monkeypatch) -> list[str]:
    """Records which of linear's two eager inference ops run (addmm.py looks both up at call time)."""
    called: list[str] = []
    mod = sys.modules[fm.linear.__module__]
    real_dec, real_call, real_fwd = mod._linear_decode, mod._linear_decode_call, mod._fwd_call
    monkeypatch.setattr(mod, "_linear_decode", lambda *a: (called.append("linear_decode"), real_dec(*a))[1])
    monkeypatch.setattr(mod, "_linear_decode_call", lambda *a: (called.append("linear_decode"), real_call(*a))[1])
    monkeypatch.setattr(mod, "_fwd_call", lambda *a: (called.append("addmm_fwd"), real_fwd(*a))[1])
    return called


@needs_gpu
def test_full_path_and_alignment(fm, monkeypatch):
    """The checked path (a 1-D x, an nn.Parameter x) takes the op as the fast path does; a view that is contiguous
    but not 16-byte aligned never reaches it (either path), and its result is right."""
    monkeypatch.setenv(ENV, "on")
    monkeypatch.delenv(TUNE, raising=False)
    w, w32 = weight(2056, 1032, torch.bfloat16)
    called = spy(fm, monkeypatch)
    x1 = tokens(1, 2056, torch.bfloat16, seed=5).view(2056)
    with torch.no_grad():
        y1 = fm.linear(x1, w)
        yp = fm.linear(torch.nn.Parameter(x1.clone(), requires_grad=False), w)
    assert called == ["linear_decode", "linear_decode"], called
    assert y1.shape == (1032,) and torch.equal(y1, yp)
    assert torch.equal(y1, fm._ops.ops.linear_decode(x1.view(1, 2056), w).view(1032))
    buf = tokens(1, 2056 + 8, torch.bfloat16, seed=6)
    # the last: a DLPack import of the same view, storage offset 0 at a misaligned address
    for x in (buf[:, 3:3 + 2056], torch.nn.Parameter(buf[:, 3:3 + 2056], requires_grad=False),
              torch.from_dlpack(buf[:, 3:3 + 2056])):
        assert x.is_contiguous() and x.data_ptr() % 16 != 0
        called.clear()
        with torch.no_grad():
            y = fm.linear(x, w)
        assert "linear_decode" not in called, called
        assert_2x_rule(y, F.linear(x.float(), w32), F.linear(x.detach(), w), name="misaligned")
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        fm._ops.ops.linear_decode(buf[:, 3:3 + 2056], w)


@needs_gpu
@pytest.mark.parametrize("t", [1, 16])
def test_lm_head_sized_n(fm, monkeypatch, t):
    """N = 128256 rows (an lm_head's; 8016 row groups), random values, against the fp32 reference."""
    monkeypatch.delenv(TUNE, raising=False)
    g = torch.Generator(device="cuda").manual_seed(11)
    w = (torch.randn(128256, 256, device="cuda", generator=g) * 256 ** -0.5).to(torch.bfloat16)
    x = tokens(t, 256, torch.bfloat16, seed=t)
    y = fm._ops.ops.linear_decode(x, w)
    assert_2x_rule(y, F.linear(x.float(), w.float()), F.linear(x, w), name=f"T={t}")


@needs_gpu
def test_linear_takes_the_op_only_where_it_applies(fm, monkeypatch):
    monkeypatch.setenv(ENV, "on")
    monkeypatch.delenv(TUNE, raising=False)
    w, w32 = weight(2056, 1032, torch.bfloat16)
    x = tokens(12, 2056, torch.bfloat16, seed=3).view(2, 6, 2056)
    called = spy(fm, monkeypatch)
    with torch.no_grad():
        y = fm.linear(x, w)
        layer = torch.nn.Linear(2056, 1032, bias=False, device="cuda", dtype=torch.bfloat16)
        layer.weight.copy_(w)
        y_layer = fm.layers.Linear.forward(layer, x)
    assert called == ["linear_decode", "linear_decode"], called
    assert y.shape == (2, 6, 1032) and torch.equal(y, y_layer)
    assert torch.equal(y, fm._ops.ops.linear_decode(x.view(12, 2056), w).view(2, 6, 1032))
    assert_2x_rule(y, F.linear(x.float(), w32), F.linear(x, w), name="y")
    # what keeps the GEMM path: a bias, an activation, a Conv1D-style row-major mat2, more than 64 tokens, training,
    # the off switch
    bias = torch.zeros(1032, device="cuda", dtype=torch.bfloat16)
    called.clear()
    with torch.no_grad():
        fm.linear(x, w, bias)
        fm.linear(x, w, activation="gelu_tanh")
        fm.addmm(None, x, w.t().contiguous())
        fm.linear(tokens(65, 2056, torch.bfloat16), w)
    fm.linear(x.detach().requires_grad_(), w)
    monkeypatch.setenv(ENV, "off")
    with torch.no_grad():
        fm.linear(x, w)
    assert "linear_decode" not in called, called


@needs_gpu
def test_linear_under_compile(fm, monkeypatch):
    """fullgraph at a concrete T: the op is in the graph and the result is eager's, bit for bit; a symbolic T traces
    ``linear_auto`` without a guard on T (the GEMV up to the limit: eager's bits; the GEMM above it)."""
    monkeypatch.setenv(ENV, "on")
    monkeypatch.delenv(TUNE, raising=False)
    w, w32 = weight(136, 40, torch.bfloat16)

    def f(a):
        return fm.linear(a, w)

    x = tokens(6, 136, torch.bfloat16).view(2, 3, 136)
    with torch.no_grad():
        eager = f(x)
    static, out, dynamic, runs = compile_static_then_dynamic(
        f, x, (4, 9, 70), lambda t: tokens(2 * t, 136, torch.bfloat16, seed=t).view(2, t, 136))
    assert len(static) == 1 and "linear_decode" in static[0], static
    assert torch.equal(out, eager)
    for t, xt, y in runs:
        assert y.shape == (2, t, 40)
        if 2 * t <= fm._decode.KERNEL_MAX_TOKENS:  # "on": the kernel's limit
            with torch.no_grad():
                assert torch.equal(y, f(xt)), t
        else:
            assert_2x_rule(y, F.linear(xt.float(), w32), F.linear(xt, w), name="y")
    assert len(dynamic) == 1 and "linear_auto" in dynamic[0] and "linear_decode" not in dynamic[0], dynamic


@needs_gpu
def test_auto_op_picks_by_token_count_at_run_time(fm, monkeypatch):
    """``linear_auto(x, w, max_tokens)``: T <= max_tokens runs ``linear_decode`` (same bits), above it or with a
    storage that is not 16-byte aligned our GEMM path (``addmm_fwd``'s bits), every result within the 2x rule."""
    monkeypatch.delenv(TUNE, raising=False)
    ops = fm._ops.ops
    w, w32 = weight(2056, 1032, torch.bfloat16)

    def gemm_path(x):
        return ops.addmm_fwd(None, x, w.t(), "none", False, [x.shape[0], w.shape[0]])[0]

    for t in (1, 16, 17, 64, 65, 300):
        x = tokens(t, 2056, torch.bfloat16, seed=t)
        y = ops.linear_auto(x, w, 16)
        assert torch.equal(y, ops.linear_decode(x, w) if t <= 16 else gemm_path(x)), t
        assert_2x_rule(y, F.linear(x.float(), w32), F.linear(x, w), name=f"T={t}")
    x = tokens(65, 2056, torch.bfloat16, seed=65)  # a limit above the kernel's 64 tokens: clamped, the GEMM path
    assert torch.equal(ops.linear_auto(x, w, 128), gemm_path(x))
    buf = tokens(4 * 2056 + 4, 1, torch.bfloat16, seed=7).view(-1)
    x = buf[4:].view(4, 2056)
    assert x.data_ptr() % 16 == 8
    assert torch.equal(ops.linear_auto(x, w, 16), gemm_path(x))


# ---- dispatch without a kernel -------------------------------------------------------------------------------------


def test_schema_is_registered_in_every_build(fm):
    assert hasattr(fm._ops.ops, "linear_decode") and hasattr(fm._ops.ops, "linear_auto")


def test_runtime_limit_takes_a_symbolic_token_count(fm, monkeypatch):
    """Under a symbolic T the limit goes to linear_auto; a static T, an lm_head-sized N in auto, or "off" give 0; no
    guard is added."""
    dec = fm._decode
    monkeypatch.setitem(dec._CAPABILITY, 0, (9, 0))
    x, shape_env = symbolic_tokens(64)
    w = fake_cuda(96, 64)
    wide = fake_cuda(dec.LINEAR_AUTO_MAX_N + 8, 64)
    static_x = fake_cuda(4, 64)
    monkeypatch.setenv(ENV, "auto")
    assert dec.linear_runtime_limit(x, w.t()) == dec.LINEAR_MAX_TOKENS[(9, 0)]
    assert dec.linear_runtime_limit(x, wide.t()) == 0
    assert dec.linear_runtime_limit(static_x, w.t()) == 0
    monkeypatch.setenv(ENV, "on")
    assert dec.linear_runtime_limit(x, wide.t()) == dec.KERNEL_MAX_TOKENS
    monkeypatch.setenv(ENV, "off")
    assert dec.linear_runtime_limit(x, w.t()) == 0
    assert not shape_env.guards, shape_env.guards


def test_mode_is_checked(fm, monkeypatch):
    monkeypatch.setenv(ENV, "sometimes")
    with pytest.raises(ValueError, match=ENV):
        fm._decode.linear_mode()
    for m in ("auto", "on", "off", " ON "):
        monkeypatch.setenv(ENV, m)
        assert fm._decode.linear_mode() == m.strip().lower()
    monkeypatch.delenv(ENV)
    assert fm._decode.linear_mode() == "auto"


def test_auto_table_stays_within_the_kernel(fm):
    d = fm._decode
    assert all(1 <= t <= d.KERNEL_MAX_TOKENS for t in d.LINEAR_MAX_TOKENS.values()), d.LINEAR_MAX_TOKENS
    assert d.LINEAR_AUTO_MAX_N >= 4096  # a Llama-3-8B q projection


@needs_gpu
def test_auto_follows_the_measured_table(fm, monkeypatch):
    """auto: T up to the capability's entry (none: never) and N up to LINEAR_AUTO_MAX_N; "on" lifts the N cap."""
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(TUNE, raising=False)
    d = fm._decode
    limit = d.LINEAR_MAX_TOKENS.get(torch.cuda.get_device_capability(), 0)
    w, _ = weight(2048, 512, torch.bfloat16)
    for t in sorted({1, max(limit, 1), limit + 1}):
        assert d.use_linear_decode(tokens(t, 2048, torch.bfloat16), w.t()) == (t <= limit), (t, limit)
    wide = torch.zeros(d.LINEAR_AUTO_MAX_N + 16, 64, device="cuda", dtype=torch.bfloat16)
    x = tokens(1, 64, torch.bfloat16)
    assert not d.use_linear_decode(x, wide.t())
    monkeypatch.setenv(ENV, "on")
    assert d.use_linear_decode(x, wide.t())
    with torch.no_grad():
        assert torch.equal(fm.linear(x, wide), torch.zeros(1, wide.shape[0], device="cuda", dtype=torch.bfloat16))


def test_cpu_tensors_never_take_the_op(fm, monkeypatch):
    monkeypatch.setenv(ENV, "on")
    x = tokens(3, 64, torch.bfloat16, device="cpu")
    w = tokens(16, 64, torch.bfloat16, seed=1, device="cpu")
    assert not fm._decode.use_linear_decode(x, w.t())
    with torch.no_grad():
        y = fm.linear(x, w)
    assert_2x_rule(y, F.linear(x.float(), w.float()), F.linear(x, w), name="y")


def test_alignment_checks_read_the_data_pointer(fm):
    """The decode and GEMM-epilogue dispatch checks test the data pointer, not the storage offset: a DLPack import
    of a misaligned view has offset 0 at an odd address (it used to pass, and the op then refused it)."""
    import importlib

    dec = importlib.import_module(f"{fm.__name__}._decode")
    ep = importlib.import_module(f"{fm.__name__}._epilogue")
    common = importlib.import_module(f"{fm.__name__}._common")
    big = torch.zeros(8 + 4 * 64, dtype=torch.bfloat16)
    x = torch.from_dlpack(big[1:257].view(4, 64))
    assert x.storage_offset() == 0 and x.data_ptr() % 16 == 2
    assert common.misaligned16(x) and not dec._aligned(x)
    assert ep._runnable((x,)) is False  # refused before any device query
    assert dec._aligned(big[8:].view(4, 64)) and not common.misaligned16(torch.from_dlpack(big[8:].view(4, 64)))
    fake = torch._subclasses.FakeTensorMode()
    with fake:  # no data pointer: the offset answers
        f = torch.empty(2 + 4 * 64, dtype=torch.bfloat16)
        assert common.misaligned16(f[1:].view(-1)) and not common.misaligned16(f[8:].view(-1))
