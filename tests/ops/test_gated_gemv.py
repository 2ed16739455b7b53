"""The gated MLP's decode-class forward (kernels_src/cuda/gated_gemv.cu, op ``gated_mlp_decode``; dispatch in
``_decode.py``): the op against the fp32 reference (2x rule) at every token class and its edges (T = 1..64), model
shapes and awkward ones (K tails, row tails, H_out != H), every activation, bf16 and fp16; the tuning overrides and
PDL; NaN/Inf; ``gated_mlp`` through it (3-D x, torch.compile); opcheck; the op's argument errors; and the dispatch:
which calls take the op, symbolic token counts never (and no guard added), the env override.

The kernels need an sm_80+ GPU: those tests skip elsewhere (CI has no GPU); the dispatch tests that need no kernel
run on the CPU too."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from _utils import as_fake_cuda, assert_2x_rule, compile_static_then_dynamic, fake_cuda, spy_mlp_ops, symbolic_tokens
from conftest import CUDA

SM80 = CUDA and torch.cuda.get_device_capability() >= (8, 0)
needs_gpu = pytest.mark.skipif(not SM80, reason="the decode MLP kernels need an sm_80+ GPU (GPU machine only)")
ACTS = ["gelu_tanh", "gelu", "silu"]
DTYPES = [torch.bfloat16, torch.float16]
# Every token class (n8-tiles 1, 2, 4, 8) at and around its edges.
TOKENS = [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64]
# (H, I, H_out): Gemma-2B, Llama-3.2-1B, Llama-3-8B, a 3072-wide model; then H and I with a K tail (8 past a multiple
# of 32) and a row tail (8 past a multiple of 16) in both passes; and small ones: K shorter than one chunk, fewer
# chunks than warps, H_out below one row tile and not a multiple of 16.
SHAPES = [(2048, 16384, 2048), (2048, 8192, 2048), (4096, 14336, 4096), (3072, 8192, 3072), (2056, 5128, 2056),
          (8, 8, 8), (64, 160, 40), (136, 520, 24)]
ENV = "FUSED_MLP_DECODE_MLP"
TUNE = "FUSED_MLP_DECODE_TUNE"


def act_fn(act: str):
    return {"gelu_tanh": lambda g: F.gelu(g, approximate="tanh"), "gelu": F.gelu, "silu": F.silu}[act]


@functools.lru_cache(maxsize=2)
def weights(h: int, i: int, h_out: int, dtype: torch.dtype):
    """(w_gate, w_up, w_down) in `dtype` and their fp32 copies (cached: the large shapes cost 0.1-0.7 GB)."""
    g = torch.Generator(device="cuda").manual_seed(h * 7919 + i * 31 + h_out)
    wg = (torch.randn(i, h, device="cuda", generator=g) * h ** -0.5).to(dtype)
    wu = (torch.randn(i, h, device="cuda", generator=g) * h ** -0.5).to(dtype)
    wd = (torch.randn(h_out, i, device="cuda", generator=g) * max(i, 1) ** -0.5).to(dtype)
    return (wg, wu, wd), tuple(w.float() for w in (wg, wu, wd))


def tokens(t: int, h: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(t, h, device="cuda", generator=g).to(dtype)


def ref32(x: torch.Tensor, w32, act: str) -> torch.Tensor:
    xf = x.float()
    return F.linear(act_fn(act)(F.linear(xf, w32[0])) * F.linear(xf, w32[1]), w32[2])


def same_dtype(x: torch.Tensor, w, act: str) -> torch.Tensor:
    return F.linear(act_fn(act)(F.linear(x, w[0])) * F.linear(x, w[1]), w[2])


def shape_id(s) -> str:
    return "x".join(map(str, s))


# ---- the op -------------------------------------------------------------------------------------------------------


@needs_gpu
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ACTS)
def test_op_matches_reference_at_every_token_count(fm, monkeypatch, shape, dtype, act):
    monkeypatch.delenv(TUNE, raising=False)
    h, i, h_out = shape
    w, w32 = weights(h, i, h_out, dtype)
    x = tokens(64, h, dtype, seed=h + i)
    r32, same = ref32(x, w32, act), same_dtype(x, w, act)  # rows are independent: slices are the T-row results
    for t in TOKENS:
        y = fm._ops.ops.gated_mlp_decode(x[:t], *w, act)
        assert y.shape == (t, h_out) and y.dtype == dtype and y.is_contiguous()
        assert_2x_rule(y, r32[:t], same[:t], name=f"y (T={t})")
    again = fm._ops.ops.gated_mlp_decode(x[:17], *w, act)
    assert torch.equal(again, fm._ops.ops.gated_mlp_decode(x[:17], *w, act)), "not bitwise reproducible"


# FUSED_MLP_DECODE_TUNE settings that change how the work is split (other summation orders, the reduction paths each
# setting skips or takes), and PDL (the same kernels launched with a programmatic dependency: bitwise the same y).
TUNINGS = ["gu_wk=1,dn_wk=1,dn_ks=1", "gu_wr=2,gu_wk=4,dn_wr=2,dn_wk=4,dn_ks=3", "gu_wr=8,gu_wk=1,dn_wk=8,dn_ks=8",
           "dn_ks=5,dn_wk=2", "gu_wr=4,gu_wk=2,dn_wr=4,dn_wk=2,dn_ks=2"]


@needs_gpu
@pytest.mark.parametrize("shape", [(2056, 5128, 2056), (136, 520, 24)], ids=shape_id)
def test_tuning_overrides_and_pdl(fm, monkeypatch, shape):
    h, i, h_out = shape
    dtype, act = torch.bfloat16, "silu"
    w, w32 = weights(h, i, h_out, dtype)
    x = tokens(64, h, dtype, seed=5)
    r32, same = ref32(x, w32, act), same_dtype(x, w, act)
    for t in (1, 9, 17, 33, 64):
        monkeypatch.delenv(TUNE, raising=False)
        base = fm._ops.ops.gated_mlp_decode(x[:t], *w, act)
        monkeypatch.setenv(TUNE, "pdl=0")  # PDL is on by default (sm_90): without it, the same bits
        assert torch.equal(fm._ops.ops.gated_mlp_decode(x[:t], *w, act), base), f"PDL changed y (T={t})"
        for tune in TUNINGS:
            monkeypatch.setenv(TUNE, tune)
            y = fm._ops.ops.gated_mlp_decode(x[:t], *w, act)
            assert_2x_rule(y, r32[:t], same[:t], name=f"y (T={t}, {tune})")
            monkeypatch.setenv(TUNE, tune + ",pdl=0")
            assert torch.equal(fm._ops.ops.gated_mlp_decode(x[:t], *w, act), y), f"PDL changed y (T={t}, {tune})"


@needs_gpu
def test_tuning_override_is_checked(fm, monkeypatch):
    w, _ = weights(64, 160, 40, torch.bfloat16)
    x = tokens(4, 64, torch.bfloat16)
    for bad, match in (("gu_wk", "key=value"), ("dn_ks=-1", "integer"), ("colour=2", "unknown key"),
                       ("gu_wr=4,gu_wk=4", "at most")):
        monkeypatch.setenv(TUNE, bad)
        with pytest.raises(RuntimeError, match=match):
            fm._ops.ops.gated_mlp_decode(x, *w, "silu")


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_and_inf_propagate(fm, monkeypatch, dtype):
    """A NaN token gives a NaN row; an Inf weight of w_down gives +-Inf in its output column (the sign of h) for the
    other tokens; an Inf in w_gate's row 3 gives NaN or +-Inf gates there, which reach every output of the tokens
    concerned. Patterns as in the fp32 reference."""
    monkeypatch.delenv(TUNE, raising=False)
    h, i = 2056, 5128
    (wg, wu, wd), _ = weights(h, i, h, dtype)
    wd = wd.clone()
    wd[5, 7] = float("inf")
    w = (wg, wu, wd)
    w32 = tuple(t.float() for t in w)
    for t in (1, 5, 16, 40):
        x = tokens(t, h, dtype, seed=t)
        if t > 1:
            x[1, 100] = float("nan")
        y = fm._ops.ops.gated_mlp_decode(x, *w, "gelu_tanh")
        r = ref32(x, w32, "gelu_tanh")
        assert bool(torch.isinf(r[[k for k in range(t) if k != 1], 5]).all())  # the case is what it says
        assert_2x_rule(y, r, same_dtype(x, w, "gelu_tanh"), name=f"y (T={t})")
    wg = wg.clone()
    wg[3, 11] = float("-inf")
    x = tokens(9, h, dtype, seed=9)
    y = fm._ops.ops.gated_mlp_decode(x, wg, wu, wd, "silu")
    r = ref32(x, (wg.float(), wu.float(), wd.float()), "silu")
    assert torch.equal(torch.isnan(y), torch.isnan(r)) and torch.equal(torch.isinf(y), torch.isinf(r))


@needs_gpu
def test_empty_and_degenerate_sizes(fm):
    w, _ = weights(64, 160, 40, torch.bfloat16)
    y = fm._ops.ops.gated_mlp_decode(tokens(0, 64, torch.bfloat16), *w, "gelu")
    assert y.shape == (0, 40)
    x = tokens(3, 64, torch.bfloat16)
    no_i = [torch.empty(0, 64, device="cuda", dtype=torch.bfloat16)] * 2 + [
        torch.empty(40, 0, device="cuda", dtype=torch.bfloat16)]
    assert torch.equal(fm._ops.ops.gated_mlp_decode(x, *no_i, "gelu"), torch.zeros(3, 40, device="cuda",
                                                                                    dtype=torch.bfloat16))
    no_h = [torch.empty(160, 0, device="cuda", dtype=torch.bfloat16)] * 2 + [w[2]]
    assert torch.equal(fm._ops.ops.gated_mlp_decode(x[:, :0], *no_h, "gelu"),  # act(0) * 0 = 0
                       torch.zeros(3, 40, device="cuda", dtype=torch.bfloat16))


@needs_gpu
def test_op_checks_its_arguments(fm, monkeypatch):
    """RuntimeError naming the argument, raised by the op before it launches anything."""
    monkeypatch.delenv(TUNE, raising=False)
    op = fm._ops.ops.gated_mlp_decode
    (wg, wu, wd), _ = weights(64, 160, 40, torch.bfloat16)
    x = tokens(4, 64, torch.bfloat16)
    cases = [
        ((x.float(), wg, wu, wd, "silu"), "x must be bfloat16 or float16"),
        ((x, wg.half(), wu, wd, "silu"), "w_gate must have x's dtype"),
        ((x, wg, wu.half(), wd, "silu"), "w_up must have x's dtype"),
        ((x, wg, wu, wd.half(), "silu"), "w_down must have x's dtype"),
        ((x, wg[:, :56].contiguous(), wu, wd, "silu"), "w_gate must be \\[I, H\\]"),
        ((x, wg, wu[:152].contiguous(), wd, "silu"), "w_up must have w_gate's shape"),
        ((x, wg, wu, wd[:, :152].contiguous(), "silu"), "w_down must be \\[H_out, I\\]"),
        ((x, wg.cpu(), wu, wd, "silu"), "w_gate must be a CUDA tensor"),
        ((x, wg, wu, wd.cpu(), "silu"), "w_down must be a CUDA tensor"),
        ((x, wg.t().contiguous().t(), wu, wd, "silu"), "w_gate must be contiguous"),
        ((x, wg, wu, wd[:, ::2], "silu"), "w_down must be contiguous"),
        ((x[None], wg, wu, wd, "silu"), "x must be 2-D"),
        ((tokens(65, 64, torch.bfloat16), wg, wu, wd, "silu"), "at most 64"),
        ((x, wg, wu, wd, "relu"), "activation"),
    ]
    x60 = tokens(4, 60, torch.bfloat16)
    w60 = torch.randn(160, 60, device="cuda", dtype=torch.bfloat16)
    cases.append(((x60, w60, w60, wd, "silu"), "multiples of 8"))
    buf = torch.zeros(4 * 64 + 1, device="cuda", dtype=torch.bfloat16)
    cases.append(((buf[1:].view(4, 64), wg, wu, wd, "silu"), "x must be 16-byte aligned"))
    if torch.cuda.device_count() > 1:
        cases.append(((x, wg.to("cuda:1"), wu, wd, "silu"), "w_gate must be on cuda:0"))
    for args, match in cases:
        with pytest.raises(RuntimeError, match=match):
            op(*args)


@needs_gpu
def test_opcheck(fm):
    (wg, wu, wd), _ = weights(136, 520, 24, torch.bfloat16)
    for t, act in ((1, "gelu_tanh"), (13, "gelu"), (40, "silu")):
        torch.library.opcheck(fm._ops.ops.gated_mlp_decode, (tokens(t, 136, torch.bfloat16), wg, wu, wd, act))
        torch.library.opcheck(fm._ops.ops.gated_mlp_auto, (tokens(t, 136, torch.bfloat16), wg, wu, wd, act, 16))


# ---- gated_mlp through it ------------------------------------------------------------------------------------------


@needs_gpu
@pytest.mark.parametrize("act", ACTS)
def test_gated_mlp_takes_the_op_for_3d_input(fm, monkeypatch, act):
    monkeypatch.setenv(ENV, "on")
    monkeypatch.delenv(TUNE, raising=False)
    (wg, wu, wd), w32 = weights(2056, 5128, 2056, torch.bfloat16)
    x = tokens(12, 2056, torch.bfloat16, seed=3).view(2, 6, 2056)
    called = spy_mlp_ops(fm, monkeypatch)
    with torch.no_grad():
        y = fm.gated_mlp(x, wg, wu, wd, activation=act)
    assert called == ["gated_mlp_decode"], called
    assert y.shape == (2, 6, 2056)
    assert torch.equal(y, fm._ops.ops.gated_mlp_decode(x.view(12, 2056), wg, wu, wd, act).view(2, 6, 2056))
    assert_2x_rule(y, ref32(x, w32, act), same_dtype(x, (wg, wu, wd), act), name="y")
    # a 1-D x is one token
    with torch.no_grad():
        y1 = fm.gated_mlp(x[0, 0], wg, wu, wd, activation=act)
    # (T = 1 and T = 12 are different token classes: another summation order, so the 2x rule, not equality)
    assert y1.shape == (2056,)
    assert_2x_rule(y1, ref32(x[0, 0], w32, act), same_dtype(x[0, 0], (wg, wu, wd), act), name="y (one token)")
    # training (anything requires grad) and the off switch keep the other paths
    called.clear()
    monkeypatch.setenv(ENV, "off")
    with torch.no_grad():
        fm.gated_mlp(x, wg, wu, wd, activation=act)
    assert "gated_mlp_decode" not in called
    monkeypatch.setenv(ENV, "on")
    fm.gated_mlp(x.detach().requires_grad_(), wg, wu, wd, activation=act)
    assert "gated_mlp_decode" not in called


@needs_gpu
def test_gated_mlp_under_compile(fm, monkeypatch):
    """fullgraph at a concrete T: the op is in the graph and the result is eager's, bit for bit. With a symbolic T
    (the token dimension marked dynamic) ``gated_mlp_auto`` is traced and no guard on T is added (no recompile at
    another T): up to the limit it runs the decode op (eager's bits), above it the GEMM path (2x rule)."""
    monkeypatch.setenv(ENV, "on")
    monkeypatch.delenv(TUNE, raising=False)
    w, w32 = weights(136, 520, 24, torch.bfloat16)

    def f(a):
        return fm.gated_mlp(a, *w, activation="gelu_tanh")

    x = tokens(6, 136, torch.bfloat16).view(2, 3, 136)
    with torch.no_grad():
        eager = f(x)
    static, out, dynamic, runs = compile_static_then_dynamic(
        f, x, (4, 9, 70), lambda t: tokens(2 * t, 136, torch.bfloat16, seed=t).view(2, t, 136))
    assert len(static) == 1 and "gated_mlp_decode" in static[0], static
    assert torch.equal(out, eager)
    for t, xt, y in runs:
        assert y.shape == (2, t, 24)
        if 2 * t <= fm._decode.KERNEL_MAX_TOKENS:  # "on": the kernel's limit
            with torch.no_grad():
                assert torch.equal(y, f(xt)), t
        else:
            assert_2x_rule(y, ref32(xt, w32, "gelu_tanh"), same_dtype(xt, w, "gelu_tanh"), name="y")
    assert len(dynamic) == 1 and "gated_mlp_auto" in dynamic[0] and "gated_mlp_decode" not in dynamic[0], dynamic


@needs_gpu
@pytest.mark.parametrize("act", ACTS)
def test_auto_op_picks_by_token_count_at_run_time(fm, monkeypatch, act):
    """``gated_mlp_auto(..., max_tokens)``: T <= max_tokens runs ``gated_mlp_decode`` (same bits), above it or with a
    storage that is not 16-byte aligned the GEMM path (gate and up GEMMs, ``geglu_fwd``, down GEMM: the same bits as
    those ops called one by one), every result within the 2x rule."""
    monkeypatch.delenv(TUNE, raising=False)
    ops = fm._ops.ops
    w, w32 = weights(2056, 5128, 2056, torch.bfloat16)
    wg, wu, wd = w

    def gemm_path(x):
        mm = lambda a, b: ops.addmm_fwd(None, a, b.t(), "none", False, [a.shape[0], b.shape[0]])[0]  # noqa: E731
        return mm(ops.geglu_fwd(mm(x, wg), mm(x, wu), act), wd)

    for t in (1, 16, 17, 64, 65, 300):
        x = tokens(t, 2056, torch.bfloat16, seed=t)
        y = ops.gated_mlp_auto(x, wg, wu, wd, act, 16)
        want = ops.gated_mlp_decode(x, wg, wu, wd, act) if t <= 16 else gemm_path(x)
        assert torch.equal(y, want), t
        assert_2x_rule(y, ref32(x, w32, act), same_dtype(x, w, act), name=f"T={t}")
    x = tokens(65, 2056, torch.bfloat16, seed=65)  # a limit above the kernel's 64 tokens: clamped, the GEMM path
    assert torch.equal(ops.gated_mlp_auto(x, wg, wu, wd, act, 128), gemm_path(x))
    # a view 8 bytes past a 16-byte boundary: the GEMM path, no error
    buf = tokens(4 * 2056 + 4, 1, torch.bfloat16, seed=7).view(-1)
    x = buf[4:].view(4, 2056)
    assert x.data_ptr() % 16 == 8
    assert torch.equal(ops.gated_mlp_auto(x, wg, wu, wd, act, 16), gemm_path(x))


# ---- dispatch ------------------------------------------------------------------------------------------------------


def test_schema_is_registered_in_every_build(fm):
    assert hasattr(fm._ops.ops, "gated_mlp_decode") and fm._decode.KERNEL_MAX_TOKENS == 64
    assert hasattr(fm._ops.ops, "gated_mlp_auto")


def test_mode_is_checked(fm, monkeypatch):
    monkeypatch.setenv(ENV, "sometimes")
    with pytest.raises(ValueError, match=ENV):
        fm._decode.mode()
    for m in ("auto", "on", "off", " ON "):
        monkeypatch.setenv(ENV, m)
        assert fm._decode.mode() == m.strip().lower()
    monkeypatch.delenv(ENV)
    assert fm._decode.mode() == "auto"


def test_cpu_tensors_never_take_the_op(fm, monkeypatch):
    """On the CPU the op is never chosen, even when forced on, and gated_mlp gives the CPU path's result exactly."""
    monkeypatch.setenv(ENV, "on")
    x = torch.randn(4, 64).bfloat16()
    wg, wu, wd = torch.randn(160, 64).bfloat16(), torch.randn(160, 64).bfloat16(), torch.randn(40, 160).bfloat16()
    assert not fm._decode.use_decode(x, wg, wu, wd, None, None, None)
    with torch.no_grad():
        on = fm.gated_mlp(x, wg, wu, wd, activation="silu")
        monkeypatch.setenv(ENV, "off")
        off = fm.gated_mlp(x, wg, wu, wd, activation="silu")
    assert torch.equal(on, off)


def test_predicate_decisions(fm, monkeypatch):
    """What use_decode says per argument (no kernel runs; on a CPU machine the tensors are fakes on cuda:0 and the
    capability is set to the H200's)."""
    dec = fm._decode
    if SM80:
        dev, wrap, cap = "cuda", (lambda t: t), torch.cuda.get_device_capability()
    else:
        dev, wrap, cap = "meta", as_fake_cuda, (9, 0)
        monkeypatch.setitem(dec._CAPABILITY, 0, cap)

    def mk(shape, dtype=torch.bfloat16, view=lambda t: t):
        return wrap(view(torch.zeros(shape, device=dev, dtype=dtype)))

    h, i = 64, 160
    wg, wu, wd = mk((i, h)), mk((i, h)), mk((h, i))
    x = mk((4, h))
    use = dec.use_decode
    monkeypatch.setenv(ENV, "on")
    forced_ok = cap[0] in (8, 9, 10, 12)
    assert use(x, wg, wu, wd, None, None, None) == forced_ok
    assert use(mk((2, 32, h)), wg, wu, wd, None, None, None) == forced_ok  # T = 64
    assert use(mk((h,)), wg, wu, wd, None, None, None) == forced_ok  # one token
    assert not use(mk((65, h)), wg, wu, wd, None, None, None)  # beyond the kernel
    assert not use(mk((5, 13, h)), wg, wu, wd, None, None, None)
    b = mk((i,))
    assert not use(x, wg, wu, wd, b, None, None) and not use(x, wg, wu, wd, None, b, None)
    assert not use(x, wg, wu, wd, None, None, mk((h,)))  # biases
    f32 = [mk(s, torch.float32) for s in ((4, h), (i, h), (i, h), (h, i))]
    assert not use(*f32, None, None, None)  # fp32
    assert not use(x, wg, mk((i, h), torch.float16), wd, None, None, None)  # mixed dtypes
    assert not use(mk((4, 2 * h), view=lambda t: t[:, :h]), wg, wu, wd, None, None, None)  # x not contiguous
    assert not use(x, wg, wu, mk((i, h), view=lambda t: t.t()), None, None, None)  # w_down not contiguous
    assert not use(mk((4, 60)), mk((i, 60)), mk((i, 60)), wd, None, None, None)  # H % 8
    assert not use(x, mk((156, h)), mk((156, h)), mk((h, 156)), None, None, None)  # I % 8
    assert not use(mk((4 * h + 1,), view=lambda t: t[1:].view(4, h)), wg, wu, wd, None, None, None)  # misaligned
    if SM80:  # a DLPack import of a misaligned view: offset 0 at an odd address (real tensors only)
        assert not use(torch.from_dlpack(mk((4 * h + 1,), view=lambda t: t[1:].view(4, h))), wg, wu, wd, None, None,
                       None)
    monkeypatch.setenv(ENV, "off")
    assert not use(x, wg, wu, wd, None, None, None)
    monkeypatch.setenv(ENV, "auto")
    limit = dec.auto_limit(cap, h)
    assert use(mk((max(limit, 1), h)), wg, wu, wd, None, None, None) == (limit > 0)
    assert not use(mk((limit + 1, h)), wg, wu, wd, None, None, None)
    for entries in dec.MAX_TOKENS.values():  # (max H, max T) pairs, H bounds increasing, T within the kernel's limit
        assert [e[0] for e in entries] == sorted(e[0] for e in entries)
        assert all(0 < t <= dec.KERNEL_MAX_TOKENS for _, t in entries)


def test_auto_limit_follows_the_hidden_size(fm):
    """The H200 table: T <= 16 at H = 2048 (Llama-3.2-1B, Gemma-2B) and H = 4096 (Llama-3-8B), where the decode op was
    measured against the cuBLAS path in a stack of layers (benchmarks/decode_stack.py); no entry: 0."""
    dec = fm._decode
    assert dec.auto_limit((9, 0), 2048) == 16 and dec.auto_limit((9, 0), 3072) == 16
    assert dec.auto_limit((9, 0), 4096) == 16
    assert dec.auto_limit((8, 0), 2048) == 0


def test_runtime_limit_takes_a_symbolic_token_count(fm, monkeypatch):
    """Under a symbolic T the table's limit goes to gated_mlp_auto (the op compares T at run time); a static T, a
    bias, or "off" give 0; deciding adds no guard to the shape environment."""
    dec = fm._decode
    monkeypatch.setitem(dec._CAPABILITY, 0, (9, 0))
    x, shape_env = symbolic_tokens(64)
    w = [fake_cuda(*s) for s in ((160, 64), (160, 64), (64, 160))]
    static_x = fake_cuda(4, 64)
    monkeypatch.setenv(ENV, "on")
    assert dec.runtime_limit(x, *w, None, None, None) == dec.KERNEL_MAX_TOKENS
    monkeypatch.setenv(ENV, "auto")
    assert dec.runtime_limit(x, *w, None, None, None) == dec.auto_limit((9, 0), 64) > 0
    assert dec.runtime_limit(static_x, *w, None, None, None) == 0
    assert dec.runtime_limit(x, *w, None, None, fake_cuda(64)) == 0
    monkeypatch.setenv("FUSED_MLP_UNDER_COMPILE", "decompose")  # forced: F.linear and the activation's decomposition
    assert dec.runtime_limit(x, *w, None, None, None) == 0
    monkeypatch.delenv("FUSED_MLP_UNDER_COMPILE")
    monkeypatch.setenv(ENV, "off")
    assert dec.runtime_limit(x, *w, None, None, None) == 0
    assert not shape_env.guards, shape_env.guards


def test_predicate_says_no_to_a_symbolic_token_count(fm, monkeypatch):
    """A symbolic T (torch.compile with dynamic shapes) takes the other path, whatever the mode, and deciding adds
    no guard on T to the shape environment."""
    dec = fm._decode
    monkeypatch.setitem(dec._CAPABILITY, 0, (9, 0))
    x, shape_env = symbolic_tokens(64)
    w = [fake_cuda(*s) for s in ((160, 64), (160, 64), (64, 160))]
    for m in ("on", "auto"):
        monkeypatch.setenv(ENV, m)
        assert not dec.use_decode(x, *w, None, None, None)
    assert not shape_env.guards, shape_env.guards
