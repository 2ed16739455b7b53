"""The GeGLU MLP's GEMMs with the gated activation in the epilogue (kernels_src/cuda/gated_gemm_sm90.cu, issue 10):
the two ops against fp32 references (2x rule), ragged and unaligned-to-tile shapes, every activation, bf16 and
fp16; the MLP through them (FUSED_MLP_GEMM_EPILOGUE=on) against the cuBLAS path and the reference, forward and
backward; opcheck and torch.compile; and the dispatch: which calls may take the fused path, and that every other
call (CPU, fp32, biases, odd sizes, non-Hopper GPUs) runs the cuBLAS path with its exact results.

The kernels run on sm_90 only: those tests skip elsewhere (CI has no GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _utils import TAIL_ATOL, TAILS, assert_2x_rule, exact_act, exact_grad, spy_mlp_ops
from conftest import CUDA

SM90 = CUDA and torch.cuda.get_device_capability() == (9, 0)
needs_sm90 = pytest.mark.skipif(not SM90, reason="the gated-epilogue GEMMs need an sm_90 GPU (GPU machine only)")
ACTS = ["gelu_tanh", "gelu", "silu"]
DTYPES = [torch.bfloat16, torch.float16]
# (T, H, I): tile-aligned, ragged T, I not a multiple of the 128-wide output tile, H not a multiple of the 64-deep
# k-tile, one token, and a wide one.
SHAPES = [(256, 128, 256), (37, 64, 160), (300, 72, 200), (1, 8, 8), (129, 520, 1000), (512, 2048, 4096),
          (1024, 256, 8192)]  # the last: more tiles than SMs, so persistent CTAs run several tiles
# FUSED_MLP_GATED_GEMM_SCHEDULE: the defaults (ping-pong, both passes) and the other two kernels
SCHEDULES = ["", "cooperative,cooperative"]


def op_cases(test):
    """Every (schedule, shape, dtype, activation) of the op-level tests, on sm_90 only."""
    for mark in (pytest.mark.parametrize("schedule", SCHEDULES, ids=["default", "other"]),
                 pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s))),
                 pytest.mark.parametrize("dtype", DTYPES, ids=str), pytest.mark.parametrize("act", ACTS)):
        test = mark(test)
    return needs_sm90(test)


def act_fn(act: str):
    return {"gelu_tanh": lambda g: F.gelu(g, approximate="tanh"), "gelu": F.gelu, "silu": F.silu}[act]


def operands(t, h, i, dtype, seed=0, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(t, h, device=device, generator=g).to(dtype)
    wg = (torch.randn(i, h, device=device, generator=g) * h ** -0.5).to(dtype)
    wu = (torch.randn(i, h, device=device, generator=g) * h ** -0.5).to(dtype)
    wd = (torch.randn(h, i, device=device, generator=g) * i ** -0.5).to(dtype)
    return x, wg, wu, wd


@pytest.fixture
def mode(monkeypatch):
    def set_mode(m: str) -> None:
        monkeypatch.setenv("FUSED_MLP_GEMM_EPILOGUE", m)
    return set_mode


# ---- the ops ---------------------------------------------------------------------------------------------------


@op_cases
def test_fwd_matches_reference(fm, monkeypatch, schedule, shape, dtype, act):
    monkeypatch.setenv("FUSED_MLP_GATED_GEMM_SCHEDULE", schedule)
    t, h, i = shape
    x, wg, wu, _ = operands(t, h, i, dtype)
    out, gate, up = fm._ops.ops.gated_gemm_fwd(x, wg, wu, act, True)
    g32, u32 = x.float() @ wg.float().t(), x.float() @ wu.float().t()
    ref = act_fn(act)(g32) * u32
    g16, u16 = x @ wg.t(), x @ wu.t()
    assert_2x_rule(out, ref, act_fn(act)(g16) * u16, name="h")
    assert_2x_rule(gate, g32, g16, name="gate")
    assert_2x_rule(up, u32, u16, name="up")
    h_only, g0, u0 = fm._ops.ops.gated_gemm_fwd(x, wg, wu, act, False)
    assert torch.equal(h_only, out) and g0.numel() == 0 and u0.numel() == 0


@needs_sm90
@pytest.mark.parametrize("sched", ["swizzle=8", "swizzle=2,raster=m", "swizzle=4,raster=n", "raster=n", "bogus"])
def test_tile_schedule_knob_keeps_the_bits(fm, monkeypatch, sched):
    """FUSED_MLP_SM90_SCHED (kernels_src/cuda/sm90_sched.cuh, read per call) changes only the order in which the
    persistent CTAs take tiles: forward and backward give the same bits as CUTLASS's default schedule (an unknown
    value keeps the default)."""
    t, h, i = 1024, 256, 8192  # more tiles than SMs: every CTA takes several, in the order the schedule sets
    x, wg, wu, wd = operands(t, h, i, torch.bfloat16)
    dy = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    ops = fm._ops.ops

    def run():
        out, gate, up = ops.gated_gemm_fwd(x, wg, wu, "gelu_tanh", True)
        h_bwd = ops.gated_gemm_bwd_(dy, wd, gate, up, "gelu_tanh")
        return out, h_bwd, gate, up

    base = run()
    monkeypatch.setenv("FUSED_MLP_SM90_SCHED", sched)
    for a, b in zip(base, run()):
        assert torch.equal(a, b), sched


@op_cases
def test_bwd_matches_reference(fm, monkeypatch, schedule, shape, dtype, act):
    monkeypatch.setenv("FUSED_MLP_GATED_GEMM_SCHEDULE", schedule)
    t, h, i = shape
    x, wg, wu, wd = operands(t, h, i, dtype, seed=1)
    gate, up = x @ wg.t(), x @ wu.t()
    dy = torch.randn(t, h, device="cuda", dtype=dtype)
    # fp32 reference from the same (rounded) saved gate/up
    g32 = gate.float().requires_grad_()
    u32 = up.float().requires_grad_()
    h32 = act_fn(act)(g32) * u32
    dh32 = dy.float() @ wd.float()
    h32.backward(dh32)
    # same-dtype PyTorch: dh rounded to the dtype, then autograd of the activation in the dtype
    gs, us = gate.clone().requires_grad_(), up.clone().requires_grad_()
    hs = act_fn(act)(gs) * us
    hs.backward(dy @ wd)
    dgate, dup = gate.clone(), up.clone()
    out_h = fm._ops.ops.gated_gemm_bwd_(dy, wd, dgate, dup, act)
    assert_2x_rule(out_h, h32.detach(), hs.detach(), name="h")
    assert_2x_rule(dgate, g32.grad, gs.grad, name="dgate")
    assert_2x_rule(dup, u32.grad, us.grad, name="dup")


def act_slope16(g16: torch.Tensor, act: str) -> torch.Tensor:
    """act'(gate) as same-dtype PyTorch computes it (autograd of the activation in the dtype)."""
    gs = g16.detach().clone().requires_grad_()
    act_fn(act)(gs).backward(torch.ones_like(gs))
    return gs.grad


@op_cases
def test_slopes_ops_match_reference(fm, monkeypatch, schedule, shape, dtype, act):
    """The slopes form: the training forward's h, P = up act'(gate), Q = act(gate), and the backward's dgate = dh P,
    dup = dh Q written over P and Q, each against fp32 math (2x rule)."""
    monkeypatch.setenv("FUSED_MLP_GATED_GEMM_SCHEDULE", schedule)
    t, h, i = shape
    x, wg, wu, wd = operands(t, h, i, dtype, seed=7)
    out, p, q = fm._ops.ops.gated_gemm_fwd_slopes(x, wg, wu, act)
    g32, u32 = x.float() @ wg.float().t(), x.float() @ wu.float().t()
    g16, u16 = x @ wg.t(), x @ wu.t()
    assert_2x_rule(out, act_fn(act)(g32) * u32, act_fn(act)(g16) * u16, name="h")
    assert_2x_rule(p, u32 * act_slope16(g32, act), u16 * act_slope16(g16, act), name="P")
    assert_2x_rule(q, act_fn(act)(g32), act_fn(act)(g16), name="Q")
    h_inf = fm._ops.ops.gated_gemm_fwd(x, wg, wu, act, False)[0]
    assert torch.equal(out, h_inf), "h differs between the slopes and the inference forward"
    # backward from these P, Q (as saved): fp32 dh times them against the same-dtype product
    dy = torch.randn(t, h, device="cuda", dtype=dtype)
    dh32, dh16 = dy.float() @ wd.float(), dy @ wd
    p0, q0 = p.clone(), q.clone()
    fm._ops.ops.gated_gemm_bwd_slopes_(dy, wd, p, q)
    assert_2x_rule(p, dh32 * p0.float(), dh16 * p0, name="dgate")
    assert_2x_rule(q, dh32 * q0.float(), dh16 * q0, name="dup")


@needs_sm90
@pytest.mark.parametrize("schedule", SCHEDULES, ids=["default", "other"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ACTS)
def test_epilogues_on_the_tails(fm, monkeypatch, schedule, dtype, act):
    """Both epilogues on far-tail activations, as the elementwise kernels (test_geglu): within one rounding of the
    exact h, dgate, dup up to the flushed range (TAIL_ATOL). Exact inputs: gate = x[:, 0] and up = x[:, 1] through
    one-hot weights; dh = 1."""
    monkeypatch.setenv("FUSED_MLP_GATED_GEMM_SCHEDULE", schedule)
    t, h, i = len(TAILS), 8, 64
    x = torch.zeros(t, h, device="cuda", dtype=dtype)
    x[:, 0] = torch.tensor(TAILS, dtype=dtype)
    x[:, 1] = 1
    vals = x[:, 0].double().cpu().tolist()
    wg = torch.zeros(i, h, device="cuda", dtype=dtype)
    wg[:, 0] = 1
    wu = torch.zeros(i, h, device="cuda", dtype=dtype)
    wu[:, 1] = 1
    rtol = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype] * 1.01  # one ulp of the dtype
    act_ref = torch.tensor([exact_act(act, v) for v in vals], dtype=torch.float64).to(dtype).double()[:, None]
    grad_ref = torch.tensor([exact_grad(act, v) for v in vals], dtype=torch.float64).to(dtype).double()[:, None]

    def close(out, ref, name):
        torch.testing.assert_close(out.double().cpu(), ref.expand(t, i), rtol=rtol, atol=TAIL_ATOL[act], msg=name)

    out, gate, up = fm._ops.ops.gated_gemm_fwd(x, wg, wu, act, True)
    close(out, act_ref, "h (forward)")
    assert torch.equal(gate.double().cpu(), torch.tensor(vals, dtype=torch.float64)[:, None].expand(t, i))
    assert bool((up == 1).all())
    dy = torch.zeros(t, h, device="cuda", dtype=dtype)
    dy[:, 0] = 1
    wd = torch.zeros(h, i, device="cuda", dtype=dtype)
    wd[0] = 1  # dh = dy @ wd = 1
    out_h = fm._ops.ops.gated_gemm_bwd_(dy, wd, gate, up, act)
    close(out_h, act_ref, "h (backward)")
    close(gate, grad_ref, "dgate")
    close(up, act_ref, "dup")
    # the slopes form: with up = 1, P = act'(gate) and Q = act(gate); with dh = 1 the backward returns them as they
    # are (dgate = P, dup = Q: exact)
    out_s, p, q = fm._ops.ops.gated_gemm_fwd_slopes(x, wg, wu, act)
    close(out_s, act_ref, "h (slopes forward)")
    close(p, grad_ref, "P")
    close(q, act_ref, "Q")
    p0, q0 = p.clone(), q.clone()
    fm._ops.ops.gated_gemm_bwd_slopes_(dy, wd, p, q)
    assert torch.equal(p, p0) and torch.equal(q, q0)


@needs_sm90
def test_ops_check_their_arguments(fm):
    x, wg, wu, wd = operands(64, 64, 128, torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        fm._ops.ops.gated_gemm_fwd(x.float(), wg.float(), wu.float(), "gelu_tanh", False)
    with pytest.raises(RuntimeError, match="do not match"):
        fm._ops.ops.gated_gemm_fwd(x, wg, wu[:64], "gelu_tanh", False)
    with pytest.raises(RuntimeError, match="contiguous"):
        fm._ops.ops.gated_gemm_fwd(x.t().contiguous().t(), wg, wu, "gelu_tanh", False)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        fm._ops.ops.gated_gemm_fwd(x[:, :60].contiguous(), wg[:, :60].contiguous(), wu[:, :60].contiguous(),
                              "gelu_tanh", False)
    with pytest.raises(RuntimeError, match="activation"):
        fm._ops.ops.gated_gemm_fwd(x, wg, wu, "relu", False)
    g = x @ wg.t()
    with pytest.raises(RuntimeError, match="single memory location|refer to a single"):
        fm._ops.ops.gated_gemm_bwd_(x, wd, g, g, "gelu_tanh")
    with pytest.raises(RuntimeError, match="do not match"):
        fm._ops.ops.gated_gemm_bwd_(x, wd[:, :64].contiguous(), g, g.clone(), "gelu_tanh")
    with pytest.raises(RuntimeError, match="single memory location|refer to a single"):
        fm._ops.ops.gated_gemm_bwd_slopes_(x, wd, g, g)
    with pytest.raises(RuntimeError, match="do not match"):
        fm._ops.ops.gated_gemm_bwd_slopes_(x, wd[:, :64].contiguous(), g, g.clone())
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        fm._ops.ops.gated_gemm_fwd_slopes(x.float(), wg.float(), wu.float(), "gelu_tanh")


@needs_sm90
def test_opcheck(fm):
    x, wg, wu, wd = operands(40, 64, 96, torch.bfloat16)
    torch.library.opcheck(fm._ops.ops.gated_gemm_fwd, (x, wg, wu, "gelu_tanh", True))
    torch.library.opcheck(fm._ops.ops.gated_gemm_fwd, (x, wg, wu, "silu", False))
    gate, up = x @ wg.t(), x @ wu.t()
    dy = torch.randn(40, 64, device="cuda", dtype=torch.bfloat16)
    torch.library.opcheck(fm._ops.ops.gated_gemm_bwd_, (dy, wd, gate, up, "gelu_tanh"))
    torch.library.opcheck(fm._ops.ops.gated_gemm_fwd_slopes, (x, wg, wu, "gelu"))
    p, q = fm._ops.ops.gated_gemm_fwd_slopes(x, wg, wu, "gelu_tanh")[1:]
    torch.library.opcheck(fm._ops.ops.gated_gemm_bwd_slopes_, (dy, wd, p, q))


# ---- the MLP through them --------------------------------------------------------------------------------------


# The MLP's ops in training per FUSED_MLP_GEMM_EPILOGUE mode (forward, backward): both passes fused use the slopes
# form; one fused pass saves gate/up.
MLP_OPS = {"on": ["gated_gemm_fwd_slopes", "gated_gemm_bwd_slopes_"], "fwd": ["gated_gemm_fwd", "geglu_bwd_"],
           "bwd": ["geglu_fwd", "gated_gemm_bwd_"], "off": ["geglu_fwd", "geglu_bwd_"]}


def mlp_grads(fm, x, ws, act, dy):
    xx = x.detach().clone().requires_grad_()
    wl = [w.detach().clone().requires_grad_() for w in ws]
    y = fm.gated_mlp(xx, *wl, activation=act)
    y.backward(dy)
    return y.detach(), xx.grad, [w.grad for w in wl]


@needs_sm90
@pytest.mark.parametrize("fused", ["on", "fwd", "bwd"])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mlp_fused_vs_cublas_path_vs_reference(fm, mode, monkeypatch, dtype, act, fused):
    """fused: both passes (the slopes form), or only the forward or the backward (gate/up saved)."""
    t, h, i = 300, 136, 520
    x, wg, wu, wd = operands(t, h, i, dtype, seed=3)
    x = x.view(3, 100, h)
    dy = torch.randn(3, 100, h, device="cuda", dtype=dtype)
    mode(fused)
    called = spy_mlp_ops(fm, monkeypatch)
    y_on, dx_on, dw_on = mlp_grads(fm, x, (wg, wu, wd), act, dy)
    assert called == MLP_OPS[fused], called  # the fused kernels of this mode ran
    with torch.no_grad():
        y_inf = fm.gated_mlp(x, wg, wu, wd, activation=act)
    mode("off")
    y_off, dx_off, dw_off = mlp_grads(fm, x, (wg, wu, wd), act, dy)
    # fp32 reference and same-dtype eager
    x32 = x.float().requires_grad_()
    w32 = [w.float().requires_grad_() for w in (wg, wu, wd)]
    y32 = fm.gated_mlp_reference(x32, *w32, activation=act)
    y32.backward(dy.float())
    xe = x.clone().requires_grad_()
    we = [w.clone().requires_grad_() for w in (wg, wu, wd)]
    ye = F.linear(act_fn(act)(F.linear(xe, we[0])) * F.linear(xe, we[1]), we[2])
    ye.backward(dy)
    assert_2x_rule(y_on, y32.detach(), ye.detach(), name="y")
    assert torch.equal(y_inf, y_on), "inference and training forward differ"
    assert_2x_rule(dx_on, x32.grad, xe.grad, name="dx")
    for name, a, r, e in zip(("dw_gate", "dw_up", "dw_down"), dw_on, (w.grad for w in w32), (w.grad for w in we)):
        assert_2x_rule(a, r, e, name=name)
    # the cuBLAS path: the same math rounded differently, also within the rule
    assert_2x_rule(y_off, y32.detach(), ye.detach(), name="y (cuBLAS path)")
    assert_2x_rule(dx_off, x32.grad, xe.grad, name="dx (cuBLAS path)")
    for name, a, r, e in zip(("dw_gate", "dw_up", "dw_down"), dw_off, (w.grad for w in w32), (w.grad for w in we)):
        assert_2x_rule(a, r, e, name=f"{name} (cuBLAS path)")


@needs_sm90
def test_mlp_fused_under_compile_fullgraph(fm, mode):
    """torch.compile(fullgraph=True) keeps the fused forward op in the traced graph (the backward's choice is made
    when AOTAutograd traces the backward, as in eager); the forward is bitwise equal to eager, the gradients meet
    the 2x rule (the compiled backward may round the other GEMMs differently from eager)."""
    mode("on")
    x, wg, wu, wd = operands(64, 64, 128, torch.bfloat16, seed=4)
    ws = [w.requires_grad_() for w in (wg, wu, wd)]
    xx = x.requires_grad_()

    def f(a):
        return fm.gated_mlp(a, *ws, activation="gelu_tanh")

    eager = f(xx)
    eager.sum().backward()
    xx.grad = None
    for w in ws:
        w.grad = None
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        graphs.append(gm.print_readable(print_output=False))
        return compile_fx(gm, example_inputs)

    out = torch.compile(f, fullgraph=True, backend=backend)(xx)
    out.sum().backward()
    assert len(graphs) == 1 and "gated_gemm_fwd_slopes" in graphs[0], graphs
    assert torch.equal(out, eager)
    # gradients: the 2x rule against the fp32 reference, with PyTorch's eager bf16 MLP as the same-dtype error
    x32 = xx.detach().float().requires_grad_()
    w32 = [w.detach().float().requires_grad_() for w in ws]
    fm.gated_mlp_reference(x32, *w32, activation="gelu_tanh").sum().backward()
    xe = xx.detach().clone().requires_grad_()
    we = [w.detach().clone().requires_grad_() for w in ws]
    F.linear(act_fn("gelu_tanh")(F.linear(xe, we[0])) * F.linear(xe, we[1]), we[2]).sum().backward()
    for name, a, r, e in zip(("dx", "dw_gate", "dw_up", "dw_down"), [xx.grad] + [w.grad for w in ws],
                             [x32.grad] + [w.grad for w in w32], [xe.grad] + [w.grad for w in we]):
        assert_2x_rule(a, r, e, name=name)
    torch._dynamo.reset()


@needs_sm90
@pytest.mark.parametrize("fused", ["on", "fwd", "bwd"])
def test_mlp_retain_graph_with_fused_kernels(fm, mode, fused):
    """A second backward through the same graph gets the same gradients: the in-place backward kernels work on
    copies of the saved tensors then."""
    mode(fused)
    x, wg, wu, wd = operands(48, 64, 128, torch.bfloat16, seed=5)
    xx = x.requires_grad_()
    y = fm.gated_mlp(xx, wg, wu, wd)
    dy = torch.randn_like(y)
    y.backward(dy, retain_graph=True)
    first = xx.grad.clone()
    xx.grad = None
    y.backward(dy)
    assert torch.equal(xx.grad, first)


@needs_sm90
def test_mlp_slopes_form_takes_any_dy_layout(fm, mode):
    """The slopes form is chosen in the forward, before dy's layout is known: an expanded (stride-0) dy, as from
    y.sum().backward(), and a transposed one give the contiguous dy's gradients."""
    mode("on")
    x, wg, wu, wd = operands(64, 64, 128, torch.bfloat16, seed=8)
    g = torch.randn(64, device="cuda", dtype=torch.bfloat16)
    dys = {"contiguous": g.expand(64, 64).contiguous(), "expanded": g.expand(64, 64),
           "transposed": g.expand(64, 64).t().contiguous().t()}
    grads = {}
    for name, dy in dys.items():
        xx = x.detach().clone().requires_grad_()
        fm.gated_mlp(xx, wg, wu, wd).backward(dy)
        grads[name] = xx.grad
    assert torch.equal(grads["expanded"], grads["contiguous"])
    assert torch.equal(grads["transposed"], grads["contiguous"])


# ---- dispatch ----------------------------------------------------------------------------------------------------


def test_dispatch_mode_is_checked(fm, mode):
    mode("sometimes")
    with pytest.raises(ValueError, match="FUSED_MLP_GEMM_EPILOGUE"):
        fm._epilogue.mode()


def test_dispatch_rejects_what_the_kernels_cannot_take(fm, mode):
    """On the CPU (and for fp32, biases, odd sizes, views) the fused path is never chosen, even when forced on."""
    mode("on")
    ep = fm._epilogue
    x, wg, wu = torch.randn(16, 64).bfloat16(), torch.randn(128, 64).bfloat16(), torch.randn(128, 64).bfloat16()
    assert not ep.use_fwd(x, wg, wu, None, None)  # CPU
    assert not ep.use_slopes(x, wg, wu, torch.randn(64, 128).bfloat16(), None, None)
    assert not ep.use_bwd(x, torch.randn(64, 128).bfloat16(), torch.randn(16, 128).bfloat16(),
                          torch.randn(16, 128).bfloat16())
    if CUDA:
        c = [t.cuda() for t in (x, wg, wu)]
        assert not ep.use_fwd(c[0].float(), c[1].float(), c[2].float(), None, None)  # fp32
        assert not ep.use_fwd(*c, torch.zeros(128, device="cuda", dtype=torch.bfloat16), None)  # biased gate
        assert not ep.use_fwd(c[0][:, :56], c[1][:, :56], c[2][:, :56], None, None)  # not contiguous
        c60 = [t[:, :60].contiguous() for t in c]
        assert not ep.use_fwd(*c60, None, None)  # H not a multiple of 8
        assert not ep.use_fwd(c[0], c[1][:124], c[2][:124], None, None)  # I not a multiple of 8
        assert not ep.use_fwd(c[0].flatten()[1:1 + 15 * 64].view(15, 64), *c[1:], None, None)  # misaligned
        assert ep.use_fwd(*c, None, None) == SM90
        wd = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
        assert not ep.use_slopes(*c, wd.float(), None, None)  # w_down fp32
        assert not ep.use_slopes(*c, wd[:60], None, None)  # H_out not a multiple of 8
        assert not ep.use_slopes(*c, wd, torch.zeros(128, device="cuda", dtype=torch.bfloat16), None)  # biased
        assert ep.use_slopes(*c, wd, None, None) == SM90
        for only in ("fwd", "bwd"):  # one fused pass saves gate/up
            mode(only)
            assert not ep.use_slopes(*c, wd, None, None)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_non_hopper_gpus_take_the_cublas_path_exactly(fm, mode, monkeypatch):
    """What an Ampere (or Blackwell) GPU sees: the dispatch says no, and the MLP's results are the cuBLAS path's,
    bit for bit (simulated on this GPU by reporting another capability to the dispatch)."""
    ep = fm._epilogue
    x, wg, wu, wd = operands(64, 64, 128, torch.bfloat16, seed=6)
    dy = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    mode("off")
    ref = mlp_grads(fm, x, (wg, wu, wd), "gelu_tanh", dy)
    mode("on")
    monkeypatch.setitem(ep._CAPABILITY, torch.cuda.current_device(), (8, 0))
    assert not ep.use_fwd(x, wg, wu, None, None)
    got = mlp_grads(fm, x, (wg, wu, wd), "gelu_tanh", dy)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2], ref[2]))


# Which benchmark row measures each dispatch-table pass: (provider, mode) in benchmarks/epilogue.py's CSV.
MEASURED_BY = {"fwd": ("epilogue", "fwd"), "fwd_train": ("epilogue_fwd", "fwd_bwd"), "bwd": ("epilogue_bwd", "fwd_bwd"),
               "train": ("epilogue", "fwd_bwd")}


def test_dispatch_table_bounds(fm):
    """The table's bounds (no GPU needed): the inference forward from T=512, I=14336, for 2048 <= H <= 3072; the
    training forward from T=4096, I=14336, at H=2048; the backward, and both training passes (the slopes form), from
    T=4096, I=14336, for 2048 <= H <= 3072."""
    ep = fm._epilogue
    assert ep.in_table("fwd", 4096, 16384, 2048) and ep.in_table("fwd", 512, 24576, 3072)
    assert not ep.in_table("fwd", 511, 16384, 2048)  # decode-sized: not measured
    assert not ep.in_table("fwd", 4096, 14336, 4096)  # measured no faster (1.00-1.04x the cuBLAS path)
    assert ep.in_table("fwd", 512, 8192, 2048) and ep.in_table("fwd", 4096, 8192, 3072)  # the Llama family
    assert not ep.in_table("fwd", 4096, 4096, 2048) and not ep.in_table("fwd", 4096, 16384, 1024)
    assert ep.in_table("fwd_train", 4096, 16384, 2048) and ep.in_table("fwd_train", 8192, 14336, 2048)
    assert not ep.in_table("fwd_train", 2048, 16384, 2048)  # measured either way
    assert not ep.in_table("fwd_train", 4096, 24576, 3072) and not ep.in_table("fwd_train", 4096, 14336, 4096)
    assert ep.in_table("bwd", 4096, 16384, 2048) and ep.in_table("bwd", 8192, 24576, 3072)
    assert not ep.in_table("bwd", 2048, 16384, 2048)  # measured either way (1.007)
    assert not ep.in_table("bwd", 4096, 14336, 4096)  # 0.997: within the noise
    assert not ep.in_table("bwd", 4096, 8192, 2048) and not ep.in_table("bwd", 4096, 16384, 1024)
    assert ep.in_table("train", 4096, 16384, 2048) and ep.in_table("train", 4096, 24576, 3072)
    assert not ep.in_table("train", 2048, 16384, 2048)  # measured either way
    assert not ep.in_table("train", 4096, 14336, 4096)  # 1.004-1.016
    assert ep.in_table("train", 512, 8192, 2048) and ep.in_table("train", 16384, 8192, 3072)  # Llama-3.2 MLPs
    assert not ep.in_table("train", 2048, 14336, 4096) and not ep.in_table("train", 4096, 4096, 2048)
    assert not ep.in_table("train", 4096, 16384, 1024)


def test_dispatch_table_matches_the_committed_measurement(fm):
    """Every table entry rests on the committed H200 CSV: at each benchmarked shape the entry selects, the fused
    pass was at least as fast as the cuBLAS path measured in the same run; and every pass left out of the table
    (or shape below its thresholds) was measured too."""
    import csv

    from conftest import ROOT

    rows = []
    for name in ("epilogue.csv", "epilogue_llama.csv"):  # GeGLU shapes; the Llama family (SwiGLU)
        rows += list(csv.DictReader((ROOT / "benchmarks" / "results" / "nvidia-h200" / name).open()))
    time = {(r["provider"], r["mode"], int(r["H"]), int(r["I"]), int(r["T"])): float(r["time_p50_ms"])
            for r in rows if r["op"] == "gated_mlp_epilogue" and r["time_p50_ms"]}
    shapes = {k[2:] for k in time}
    assert shapes, "no measurements in epilogue.csv"
    ep = fm._epilogue
    assert set(ep.DISPATCH) <= set(MEASURED_BY)
    for pass_, (provider, mode_) in MEASURED_BY.items():
        for h, i, t in sorted(shapes):
            fused, cublas = time.get((provider, mode_, h, i, t)), time.get(("cublas", mode_, h, i, t))
            assert fused is not None and cublas is not None, (pass_, h, i, t)
            if ep.in_table(pass_, t, i, h):
                assert fused <= cublas, f"{pass_} at H={h} I={i} T={t}: fused {fused} ms > cuBLAS path {cublas} ms"

