"""Gated activations ``geglu`` (tanh / erf GeLU) and ``swiglu``: forward and backward against the fp32 reference
(flash-attention's 2x rule), awkward sizes, non-contiguous halves of one tensor, NaN/Inf, empty inputs, fp32
incoming gradients, the in-place backward op, opcheck, torch.compile without recompiles, hypothesis, and the
argument errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from _utils import FLOOR, TAIL_ATOL, TAILS, assert_2x_rule, exact_act, exact_grad
from conftest import CUDA, ROOT

ACTS = ["gelu_tanh", "gelu", "silu"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def call(fm, act: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if act == "silu":
        return fm.swiglu(gate, up)
    return fm.geglu(gate, up, approximate="tanh" if act == "gelu_tanh" else "none")


def torch_act(act: str, g: torch.Tensor) -> torch.Tensor:
    if act == "silu":
        return F.silu(g)
    return F.gelu(g, approximate="tanh" if act == "gelu_tanh" else "none")


def floor_for(ref: torch.Tensor) -> float:
    """The 2x rule's floor. In fp32 the same-dtype PyTorch result *is* the reference (error 0), so allow 16 ulp of
    the largest value (our transcendental pieces are accurate to a few ulp, not correctly rounded)."""
    if ref.dtype == torch.float32:
        finite = ref[torch.isfinite(ref)]
        scale = finite.abs().max().item() if finite.numel() else 1.0
        return 16 * 2.0**-23 * max(scale, 1.0)  # the backward composes several: 10 ulp seen (tanh-GeLU, AVX2)
    return FLOOR[ref.dtype]


def inputs(shape, dtype, device, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(shape, generator=g) * scale).to(device=device, dtype=dtype)
    up = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    return gate, up


# ---- forward ----------------------------------------------------------------------------------------------

SHAPES = [(1, 1), (7, 3), (83, 1000), (16, 2304), (5, 9217), (2, 3, 64)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ACTS)
def test_forward_matches_fp32_reference(fm, device, act, dtype, shape):
    gate, up = inputs(shape, dtype, device)
    out = call(fm, act, gate, up)
    ref32 = (torch_act(act, gate.float()) * up.float()).to(dtype)
    same = torch_act(act, gate) * up
    assert out.shape == gate.shape and out.dtype == dtype and out.is_contiguous()
    assert_2x_rule(out, ref32, same, floor=floor_for(ref32.float()) if dtype == torch.float32 else None)


def test_reference_functions(fm, device):
    gate, up = inputs((9, 40), torch.bfloat16, device)
    for approx in ("tanh", "none"):
        ref = fm.geglu_reference(gate, up, approximate=approx)
        assert ref.dtype == torch.bfloat16
        torch.testing.assert_close(ref, (F.gelu(gate.float(), approximate=approx) * up.float()).bfloat16())
    torch.testing.assert_close(fm.swiglu_reference(gate, up), (F.silu(gate.float()) * up.float()).bfloat16())


@pytest.mark.parametrize("act", ACTS)
def test_tails_and_specials(fm, device, act):
    """Far tails (the stable sigmoid/erfc forms), NaN and Inf propagate as the exact definition says."""
    vals = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-30, -1e-30, 5.0, -5.0, 12.0, -12.0, 30.0,
            -30.0, 90.0, -90.0, 1e20, -1e20, 3e38, -3e38]
    gate = torch.tensor(vals, device=device)
    up = torch.ones_like(gate)
    out = call(fm, act, gate, up)
    ref = torch.tensor([exact_act(act, v) for v in vals], dtype=torch.float64).float().to(device)
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), (out, ref)
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isinf(out), torch.isinf(ref)) and torch.equal(out[~fin & ~torch.isnan(ref)],
                                                                         ref[~fin & ~torch.isnan(ref)])
    # Finite values against fp64 (PyTorch's fp32 tanh/erf forms cancel in the negative tail; ours do not).
    ref64 = (torch_act(act, gate.double()) * up.double()).float()
    torch.testing.assert_close(out[fin], ref64[fin], rtol=4e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("act", ACTS)
def test_tails_and_specials_16bit(fm, device, act, dtype):
    """The 16-bit kernels' fast forms: h and dgate in both tails within one rounding of the exact value (up to the
    flushed range, TAIL_ATOL), and NaN/Inf in the forward as the exact definition says."""
    specials = [float("nan"), float("inf"), -float("inf"), 1e20, -1e20, 3e38, -3e38]
    gate = torch.tensor(TAILS + specials, dtype=dtype, device=device)
    xs = gate.double().tolist()  # the values as the dtype holds them (fp16: the large ones are +-inf)
    up = torch.ones_like(gate)
    out = call(fm, act, gate, up)
    ref = torch.tensor([exact_act(act, v) for v in xs], dtype=torch.float64)
    assert torch.equal(torch.isnan(out).cpu(), torch.isnan(ref)), (out, ref)
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isinf(out).cpu(), torch.isinf(ref))
    assert torch.equal(out.cpu()[~fin & ~torch.isnan(ref)].double(), ref[~fin & ~torch.isnan(ref)])
    rtol = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype] * 1.01  # half an ulp of the dtype, and a hair
    torch.testing.assert_close(out.cpu().double()[fin], ref.to(dtype).double()[fin], rtol=2 * rtol, atol=TAIL_ATOL[act])
    # backward on the tails (|x| <= 1000: beyond, x^2 overflows fp32 in act' as in PyTorch's own fp32 formula)
    g = torch.tensor(TAILS, dtype=dtype, device=device).requires_grad_()
    u = torch.ones_like(g).requires_grad_()
    call(fm, act, g, u).backward(torch.ones_like(g))
    ref_d = torch.tensor([exact_grad(act, v) for v in g.detach().double().tolist()], dtype=torch.float64)
    torch.testing.assert_close(g.grad.cpu().double(), ref_d.to(dtype).double(), rtol=2 * rtol, atol=TAIL_ATOL[act])


@pytest.mark.parametrize("act", ACTS)
def test_noncontiguous_halves_and_row_views(fm, device, act):
    """gate/up as the two halves of one [T, 2I] tensor (row stride 2I), every other row, and unaligned
    views (odd element offsets: the CUDA scalar path)."""
    torch.manual_seed(1)
    for dtype in (torch.bfloat16, torch.float32):
        for width in (64, 2304, 17):
            base = (torch.randn(24, 2 * width + 1) * 2).to(device=device, dtype=dtype)
            views = [
                (base[:, :width], base[:, width:2 * width]),          # halves: row stride 2I + 1 (odd)
                (base[:, 1:width + 1], base[:, width + 1:]),           # odd element offsets
                (base[::2, :width], base[1::2, width:2 * width]),      # every other row
            ]
            even = (torch.randn(24, 2 * width) * 2).to(device=device, dtype=dtype)
            views.append(tuple(even.chunk(2, dim=-1)))               # the usual fused-projection layout
            for gate, up in views:
                out = call(fm, act, gate, up)
                ref = call(fm, act, gate.contiguous(), up.contiguous())
                assert torch.equal(out, ref)


def test_empty_inputs(fm, device):
    for shape in [(0, 16), (4, 0), (0, 0), (2, 0, 8)]:
        gate = torch.randn(shape, device=device, requires_grad=True)
        up = torch.randn(shape, device=device, requires_grad=True)
        out = fm.geglu(gate, up)
        assert out.shape == gate.shape
        out.sum().backward()
        assert gate.grad.shape == gate.shape and up.grad.shape == up.shape


# ---- backward ---------------------------------------------------------------------------------------------


def grads_ref(act, gate, up, dh):
    """fp32 reference gradients, and the same-dtype PyTorch ones."""
    g32, u32 = gate.detach().float().requires_grad_(), up.detach().float().requires_grad_()
    torch.autograd.backward(torch_act(act, g32) * u32, dh.float())
    gs, us = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    torch.autograd.backward(torch_act(act, gs) * us, dh.to(gate.dtype))
    return (g32.grad.to(gate.dtype), u32.grad.to(gate.dtype)), (gs.grad, us.grad)


@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (83, 1000), (16, 2304), (5, 9217)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ACTS)
def test_backward_matches_fp32_reference(fm, device, act, dtype, shape):
    gate, up = inputs(shape, dtype, device, seed=2)
    gate.requires_grad_()
    up.requires_grad_()
    # seeded: the global RNG's state depends on which tests ran before (one CI run drew a dh at the floor's edge)
    dh = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(device=device, dtype=dtype)
    out = call(fm, act, gate, up)
    dgate, dup = torch.autograd.grad(out, (gate, up), dh)
    (rg, ru), (sg, su) = grads_ref(act, gate, up, dh)
    fl = floor_for if dtype == torch.float32 else (lambda r: None)
    assert_2x_rule(dgate, rg, sg, name="dgate", floor=fl(rg.float()))
    assert_2x_rule(dup, ru, su, name="dup", floor=fl(ru.float()))


@pytest.mark.parametrize("act", ACTS)
def test_fp32_incoming_gradient_reaches_the_kernel(fm, device, act):
    """A bf16 h whose gradient arrives in fp32 (h.float() downstream): with set_output_grad_dtype the kernel
    reads it uncast; the result matches the fp32-dh reference at least as well as a cast-first computation."""
    gate, up = inputs((33, 257), torch.bfloat16, device, seed=3)
    gate.requires_grad_()
    up.requires_grad_()
    dh32 = torch.randn(33, 257, device=device) * 1e-3 + 1.0
    out = call(fm, act, gate, up)
    dgate, dup = torch.autograd.grad(out.float(), (gate, up), dh32)
    (rg, ru), (sg, su) = grads_ref(act, gate, up, dh32)
    assert_2x_rule(dgate, rg, sg, name="dgate")
    assert_2x_rule(dup, ru, su, name="dup")


def test_backward_with_expanded_and_noncontiguous_grads(fm, device):
    base = torch.randn(16, 2 * 96, device=device, requires_grad=True)
    gate, up = base.chunk(2, dim=-1)
    out = fm.geglu(gate, up)
    out.sum().backward()  # dh is an expanded (stride-0) tensor
    ref = base.detach().clone().requires_grad_()
    g, u = ref.chunk(2, dim=-1)
    (F.gelu(g, approximate="tanh") * u).sum().backward()
    torch.testing.assert_close(base.grad, ref.grad, rtol=1e-5, atol=1e-5)
    base.grad = None
    dh = torch.randn(96, 16, device=device).t()  # transposed gradient
    torch.autograd.backward(fm.geglu(gate, up), dh)
    ref.grad = None
    torch.autograd.backward(F.gelu(g, approximate="tanh") * u, dh)
    torch.testing.assert_close(base.grad, ref.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dh_dtype", [None, torch.float32], ids=["dh_same", "dh_fp32"])
@pytest.mark.parametrize("act", ACTS)
def test_inplace_backward_op(fm, device, act, dh_dtype):
    """geglu_bwd_ writes h into dh's buffer, dgate into gate's and dup into up's, equal to the out-of-place op
    and the forward, also on the two halves of one [T, 2I] buffer."""
    ops = fm._ops.ops
    torch.manual_seed(4)
    for dtype in (torch.bfloat16, torch.float32):
        for width in (40, 1003):
            gu = (torch.randn(9, 2 * width) * 2).to(device=device, dtype=dtype)
            gate, up = gu.chunk(2, dim=-1)
            dh = torch.randn(9, width, device=device, dtype=dh_dtype or dtype)
            dgate, dup = ops.geglu_bwd(dh, gate, up, act)
            h = ops.geglu_fwd(gate, up, act)
            ops.geglu_bwd_(dh, gate, up, act)
            assert torch.equal(gate, dgate) and torch.equal(up, dup)
            assert torch.equal(dh, h.to(dh.dtype)) if dh.dtype == dtype else torch.allclose(
                dh, h.float(), rtol=1e-2, atol=1e-2)


# ---- custom-op machinery ------------------------------------------------------------------------------------


def test_opcheck(fm, device):
    ops = fm._ops.ops
    for dtype in (torch.float32, torch.bfloat16):
        for act in ACTS:
            gate, up = inputs((5, 24), dtype, device)
            dh = torch.randn(5, 24, device=device, dtype=dtype)
            torch.library.opcheck(ops.geglu_fwd, (gate, up, act))
            torch.library.opcheck(ops.geglu_bwd, (dh, gate, up, act))
            torch.library.opcheck(ops.geglu_bwd_, (dh.clone(), gate.clone(), up.clone(), act))
            torch.library.opcheck(ops.geglu_bwd_, (dh.float(), gate.clone(), up.clone(), act))
    halves = torch.randn(6, 64, device=device)
    g, u = halves.chunk(2, dim=-1)
    torch.library.opcheck(ops.geglu_fwd, (g, u, "gelu"))
    # The forward also takes contiguous tensors of any rank (the MLP's inference path feeds it F.linear's
    # outputs as they are); other non-2-D layouts are refused.
    g3, u3 = inputs((2, 3, 40), torch.bfloat16, device)
    torch.library.opcheck(ops.geglu_fwd, (g3, u3, "silu"))
    flat = ops.geglu_fwd(g3.view(6, 40), u3.view(6, 40), "silu")
    assert torch.equal(ops.geglu_fwd(g3, u3, "silu"), flat.view(2, 3, 40))
    with pytest.raises(RuntimeError, match="2-D .* or contiguous"):
        ops.geglu_fwd(g3.transpose(0, 1), u3.transpose(0, 1), "silu")


@pytest.mark.parametrize("copy", ["FUSED_MLP_CPU_BASELINE", "FUSED_MLP_CPU_NO_AVX512"])
def test_cpu_lesser_copies_subprocess(copy):
    """The CPU loops exist three times on x86-64 (baseline, AVX2+FMA, AVX-512; picked once per process): this file's
    CPU forward, backward, tails-and-specials and in-place tests again in a process forced to the baseline or the
    AVX2 copy (this machine runs the best one it has)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
           "cpu and (reference or tails or inplace or backward) and not subprocess",
           str(ROOT / "tests" / "ops" / "test_geglu.py")]
    proc = subprocess.run(cmd, env={**os.environ, copy: "1"}, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_cpu_copies_give_the_same_bits_subprocess(tmp_path):
    """The AVX-512 copy runs the AVX2 copy's per-element math in wider vectors: the same bits for every activation,
    dtype and pass (specials included). On a CPU without AVX-512 both processes run the AVX2 copy."""
    code = f"""
import sys, torch
sys.path[:0] = [{str(ROOT / "tests")!r}, {str(ROOT / "tests" / "ops")!r}]
import conftest
fm = conftest._load(None)
ops = fm._ops.ops
g = torch.Generator().manual_seed(0)
outs = []
for dt in (torch.float32, torch.bfloat16, torch.float16):
    gate = (torch.randn(9, 1003, generator=g) * 4).to(dt)
    gate[0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40, -30.0])
    up, dh = torch.randn(9, 1003, generator=g).to(dt), torch.randn(9, 1003, generator=g).to(dt)
    for act in ("gelu_tanh", "gelu", "silu"):
        outs.append(ops.geglu_fwd(gate, up, act))
        outs += list(ops.geglu_bwd(dh, gate, up, act))
        d, gg, uu = dh.clone(), gate.clone(), up.clone()
        ops.geglu_bwd_(d, gg, uu, act)
        outs += [d, gg, uu]
torch.save(outs, sys.argv[1])
"""
    results = []
    for env in ({}, {"FUSED_MLP_CPU_NO_AVX512": "1"}):
        out = tmp_path / f"copy{len(results)}.pt"
        proc = subprocess.run([sys.executable, "-c", code, str(out)], env={**os.environ, **env}, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(torch.load(out))
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    assert len(results[0]) == len(results[1]) == 3 * 3 * 6
    for i, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a.view(bits[a.dtype]), b.view(bits[b.dtype])), (i, a.dtype)


def test_cpu_variant_matches(fm, fm_cpu):
    """The CPU-only build and the installed-torch build serve CPU tensors identically."""
    gate, up = inputs((13, 300), torch.bfloat16, "cpu")
    gate.requires_grad_()
    for act in ACTS:
        a, b = call(fm, act, gate, up), call(fm_cpu, act, gate, up)
        assert torch.equal(a, b)
        assert torch.equal(torch.autograd.grad(a.sum(), gate)[0], torch.autograd.grad(b.sum(), gate)[0])


def test_compile_fullgraph_no_recompiles(fm, device):
    torch._dynamo.reset()

    def f(gate, up):
        return fm.geglu(gate, up) + fm.swiglu(gate, up) + fm.geglu(gate, up, approximate="none")

    cf = torch.compile(f, fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in (1, 7, 300):
            gu = torch.randn(t, 2 * 48, device=device, requires_grad=True)
            gate, up = gu.chunk(2, dim=-1)
            torch._dynamo.decorators.mark_unbacked(gate, 0)
            torch._dynamo.decorators.mark_unbacked(up, 0)
            out = cf(gate, up)
            (grad,) = torch.autograd.grad(out.sum(), gu)
            ref = gu.detach().clone().requires_grad_()
            out_ref = f(*ref.chunk(2, dim=-1))
            (grad_ref,) = torch.autograd.grad(out_ref.sum(), ref)
            torch.testing.assert_close(out, out_ref, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(grad, grad_ref, rtol=1e-6, atol=1e-6)


# ---- property-based -----------------------------------------------------------------------------------------

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(
    rows=st.integers(0, 40), cols=st.integers(1, 700), act=st.sampled_from(ACTS),
    dtype=st.sampled_from(DTYPES), scale=st.sampled_from([0.1, 1.0, 8.0]), seed=st.integers(0, 2**16),
    split=st.booleans(),
)
def test_hypothesis_forward_backward(fm, rows, cols, act, dtype, scale, seed, split):
    dev = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(seed)
    if split:
        gu = (torch.randn(rows, 2 * cols, generator=g) * scale).to(dev, dtype)
        gate, up = gu.chunk(2, dim=-1)
    else:
        gate = (torch.randn(rows, cols, generator=g) * scale).to(dev, dtype)
        up = torch.randn(rows, cols, generator=g).to(dev, dtype)
    gate = gate.detach().requires_grad_()
    up = up.detach().requires_grad_()
    out = call(fm, act, gate, up)
    ref32 = (torch_act(act, gate.detach().float()) * up.detach().float()).to(dtype)
    same = torch_act(act, gate.detach()) * up.detach()
    fl = floor_for(ref32.float()) if dtype == torch.float32 else None
    assert_2x_rule(out.detach(), ref32, same, floor=fl)
    dh = torch.randn(rows, cols, generator=g).to(dev, dtype)
    dgate, dup = torch.autograd.grad(out, (gate, up), dh)
    (rg, ru), (sg, su) = grads_ref(act, gate, up, dh)
    assert_2x_rule(dgate, rg, sg, name="dgate", floor=floor_for(rg.float()) if dtype == torch.float32 else None)
    assert_2x_rule(dup, ru, su, name="dup", floor=floor_for(ru.float()) if dtype == torch.float32 else None)


# ---- errors, raised from Python before anything runs ----------------------------------------------------------


def test_bad_inputs_raise_clear_errors(fm):
    g = torch.randn(4, 8)
    with pytest.raises(ValueError, match="one shape"):
        fm.geglu(g, torch.randn(4, 9))
    with pytest.raises(ValueError, match="one shape"):
        fm.swiglu(g, torch.randn(1, 8))  # no broadcasting
    with pytest.raises(TypeError, match="one dtype"):
        fm.geglu(g, g.bfloat16())
    with pytest.raises(TypeError, match="gate must be float32"):
        fm.swiglu(g.double(), g.double())
    with pytest.raises(TypeError, match="up must be float32"):
        fm.swiglu(g, g.int())
    with pytest.raises(TypeError, match="gate must be a torch.Tensor"):
        fm.geglu([1.0], g)
    with pytest.raises(ValueError, match="same device|one device"):
        fm.geglu(g, torch.empty(4, 8, device="meta"))
    with pytest.raises(ValueError, match="approximate must be 'tanh' or 'none'"):
        fm.geglu(g, g, approximate="sigmoid")
    with pytest.raises(ValueError, match="approximate must be"):
        fm.geglu(g, g, approximate=None)
    with pytest.raises(ValueError, match="at least one dimension"):
        fm.geglu(torch.tensor(1.0), torch.tensor(1.0))
    # The C++ entry points check their own arguments too (the ops are public through torch.ops).
    with pytest.raises(RuntimeError, match="activation must be 'gelu_tanh', 'gelu' or 'silu'"):
        fm._ops.ops.geglu_fwd(g, g, "relu")
    with pytest.raises(RuntimeError, match="dh must be float32 or gate's dtype"):
        fm._ops.ops.geglu_bwd(g.half(), g.bfloat16(), g.bfloat16(), "silu")
    # The in-place backward refuses buffers that share memory (an expanded dh, gate aliasing up).
    with pytest.raises(RuntimeError, match="overlap|single memory location"):
        fm._ops.ops.geglu_bwd_(torch.zeros(8).expand(4, 8), g.clone(), g.clone(), "silu")
    with pytest.raises(RuntimeError, match="overlap|single memory location"):
        same = g.clone()
        fm._ops.ops.geglu_bwd_(torch.zeros(4, 8), same, same, "silu")


def test_eager_fast_path_and_its_fallbacks(fm, monkeypatch):
    """Contiguous plain tensors go straight to the op (inference) or the autograd Function (training), skipping the
    Python checks; other layouts and every argument the op rejects take the checked path, which raises the
    documented errors in training as well."""
    mod = sys.modules[fm.geglu.__module__]
    checked = []
    full = mod._gated
    monkeypatch.setattr(mod, "_gated", lambda *a: checked.append(1) or full(*a))
    g, u = torch.randn(4, 8), torch.randn(4, 8)
    for grad in (False, True):
        checked.clear()
        gg, uu = g.clone().requires_grad_(grad), u.clone().requires_grad_(grad)
        out = fm.geglu(gg, uu)
        assert out.requires_grad == grad and torch.equal(out, fm._ops.ops.geglu_fwd(g, u, "gelu_tanh"))
        assert fm.swiglu(gg, uu).shape == (4, 8)
        assert not checked
        wide = torch.randn(4, 16, requires_grad=grad)
        fm.swiglu(*wide.chunk(2, -1))  # row-strided halves: the checked path
        assert checked
        with pytest.raises(ValueError, match="one shape"):
            fm.geglu(gg, torch.randn(4, 9, requires_grad=grad))
        with pytest.raises(TypeError, match="one dtype"):
            fm.swiglu(gg, uu.detach().bfloat16().requires_grad_(grad))
        with pytest.raises(ValueError, match="same device|one device"):
            fm.geglu(gg, torch.empty(4, 8, device="meta", requires_grad=grad))
        with pytest.raises(ValueError, match="at least one dimension"):
            fm.geglu(torch.tensor(1.0, requires_grad=grad), torch.tensor(1.0))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (runs on the GPU machine, not in CI)")
def test_device_mismatch_raises_before_launch(fm):
    g = torch.randn(4, 8, device="cuda")
    with pytest.raises(ValueError, match="one device"):
        fm.geglu(g, g.cpu())
    with pytest.raises(RuntimeError, match="must be a CUDA tensor|one device"):
        fm._ops.ops.geglu_fwd(g, g.cpu(), "silu")


# ---- CUDA specifics ------------------------------------------------------------------------------------------


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (runs on the GPU machine, not in CI)")
@pytest.mark.parametrize("act", ACTS)
def test_cuda_matches_cpu_kernel(fm, act):
    """The vector path (16-byte accesses) and the scalar path give the CPU kernel's values to an ulp or two."""
    for dtype in DTYPES:
        gate, up = inputs((64, 4096), dtype, "cpu", seed=5)
        cpu = call(fm, act, gate, up)
        gpu = call(fm, act, gate.cuda(), up.cuda()).cpu()
        torch.testing.assert_close(gpu.float(), cpu.float(), rtol=2e-2 if dtype != torch.float32 else 2e-6,
                                   atol=1e-6)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (runs on the GPU machine, not in CI)")
def test_cuda_large_and_multi_chunk_grid(fm):
    """More rows than one grid covers (grid-stride loop), a current non-default stream, and a second device
    index via the guard when present."""
    gate, up = inputs((8192, 4096), torch.bfloat16, "cuda", seed=6)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        out = fm.geglu(gate, up)
    s.synchronize()
    ref = (F.gelu(gate.float(), approximate="tanh") * up.float()).bfloat16()
    assert_2x_rule(out, ref, F.gelu(gate, approximate="tanh") * up)
    if torch.cuda.device_count() > 1:
        g1, u1 = gate[:64].to("cuda:1"), up[:64].to("cuda:1")
        torch.testing.assert_close(fm.geglu(g1, u1).cpu(), out[:64].cpu())
