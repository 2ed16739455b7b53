"""The opt-in Triton path of ``gated_mlp`` (``backend="triton"``): dual-B GEMM with the gated activation in its
epilogue, dGeGLU in the epilogue of ``dy @ W_down``.

On a CPU machine: the kernels run in Triton's interpreter in a subprocess (``TRITON_INTERPRET=1`` has to be set
before triton is imported and must not leak into the other test modules), the package imports and works without
triton, and every unsupported call takes the cuBLAS path with exactly its results. On a GPU: real shapes, bf16 and
fp16, ``torch.library.opcheck`` and ``torch.compile(fullgraph=True)`` without recompiles across token counts.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from _utils import assert_2x_rule
from conftest import ROOT, requires_cuda

HAS_TRITON = importlib.util.find_spec("triton") is not None
ACTS = ("gelu_tanh", "gelu", "silu")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FUSED_MLP_TRITON_CONFIG")}
    env.update(HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT / "tests"), **extra)
    return env


def _weights(t: int, h: int, i: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(device=device, dtype=dtype)
    ws = [(torch.randn(i, h, generator=g) * h ** -0.5).to(device=device, dtype=dtype),
          (torch.randn(i, h, generator=g) * h ** -0.5).to(device=device, dtype=dtype),
          (torch.randn(h, i, generator=g) * i ** -0.5).to(device=device, dtype=dtype)]
    dy = torch.randn(t, h, generator=g).to(device=device, dtype=dtype)
    return x, ws, dy


def _fwd_bwd(fn, x, ws, dy):
    xs = [x.detach().clone().requires_grad_()] + [w.detach().clone().requires_grad_() for w in ws]
    y = fn(*xs)
    y.backward(dy.to(y.dtype))
    return y.detach(), [t.grad for t in xs]


# ---- CPU: interpreter, import without triton, fallbacks ------------------------------------------------------


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (the Triton path is optional)")
@pytest.mark.parametrize("config", ["default", "whole_tile_epilogue"])
def test_kernels_in_triton_interpreter(fm_cpu, config):
    """fwd h, bwd dgate/dup/h of the custom ops and y, dx, dW through autograd, bf16 and fp16, every activation,
    ragged M/N/K tiles, 3-D and strided x, retain_graph, opcheck, torch.compile(fullgraph) without recompiles --
    in Triton's interpreter on CPU tensors (the CPU variant of this checkout's build, loaded in the subprocess).
    The interpreter's tile config splits the epilogue in halves; the second run pins one that does not."""
    extra, args = {}, []
    if config == "whole_tile_epilogue":
        extra, args = {"FUSED_MLP_TRITON_CONFIG": "32,64,32,4,1,0"}, ["--quick"]
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "triton_interpret_check.py"), *args],
                          env=_env(TRITON_INTERPRET="1", **extra), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert "triton interpreter checks passed" in proc.stdout


def test_package_imports_and_runs_without_triton(fm_cpu):
    """Importing the package never imports triton; with triton absent, backend="triton" is the cuBLAS path."""
    script = textwrap.dedent(f"""
        import sys
        class NoTriton:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("triton blocked for this test")
        import torch, kernels
        fm = kernels.get_local_kernel(__import__("pathlib").Path({str(ROOT)!r}), backend="cpu")
        assert "triton" not in sys.modules, "importing the package imported triton"
        sys.meta_path.insert(0, NoTriton())
        sys.modules.pop("triton", None)
        fm._triton_mlp.HAS_TRITON = False  # what the package sees where triton is not installed
        x = torch.randn(3, 8, 16, dtype=torch.bfloat16)
        w = [torch.randn(24, 16, dtype=torch.bfloat16), torch.randn(24, 16, dtype=torch.bfloat16),
             torch.randn(16, 24, dtype=torch.bfloat16)]
        assert torch.equal(fm.gated_mlp(x, *w, backend="triton"), fm.gated_mlp(x, *w, backend="cublas"))
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, (proc.stdout + proc.stderr)[-4000:]


def test_default_path_is_unchanged(fm_cpu):
    """Nothing has been measured yet: the dispatch table is empty and "auto" is the cuBLAS path."""
    assert fm_cpu._triton_mlp.EPILOGUE_DISPATCH == {}
    x, ws, _ = _weights(5, 16, 24, torch.bfloat16, "cpu")
    base = fm_cpu.gated_mlp(x, *ws, backend="cublas")
    assert torch.equal(fm_cpu.gated_mlp(x, *ws), base)
    assert torch.equal(fm_cpu.gated_mlp(x, *ws, backend="auto"), base)


@pytest.mark.parametrize("case", ["cpu", "fp32", "bias", "mixed_dtypes"])
def test_unsupported_calls_take_the_cublas_path(fm_cpu, case):
    """backend="triton" where the Triton path does not apply (CPU without the interpreter, fp32, biases): exactly
    the cuBLAS path's results, forward and backward."""
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    x, ws, dy = _weights(7, 16, 24, dtype, "cpu")
    b = [torch.randn(24, dtype=dtype), None, torch.randn(16, dtype=dtype)] if case == "bias" else [None] * 3
    if case == "mixed_dtypes":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ws = [w.float() for w in ws]
            y_t = fm_cpu.gated_mlp(x, *ws, backend="triton")
            y_c = fm_cpu.gated_mlp(x, *ws, backend="cublas")
        assert torch.equal(y_t, y_c)
        return
    y_t, g_t = _fwd_bwd(lambda *a: fm_cpu.gated_mlp(*a, *b, backend="triton"), x, ws, dy)
    y_c, g_c = _fwd_bwd(lambda *a: fm_cpu.gated_mlp(*a, *b, backend="cublas"), x, ws, dy)
    assert torch.equal(y_t, y_c)
    for a, c in zip(g_t, g_c):
        assert torch.equal(a, c)


def test_backend_argument_is_checked(fm_cpu):
    x, ws, _ = _weights(2, 16, 24, torch.float32, "cpu")
    with pytest.raises(ValueError, match="backend"):
        fm_cpu.gated_mlp(x, *ws, backend="cutlass")


# ---- GPU -----------------------------------------------------------------------------------------------------

GPU_SHAPES = [(1, 2048, 16384), (7, 2048, 16384), (512, 2048, 16384), (4096, 2048, 16384), (83, 1000, 2304)]


def _ops_of(fm):
    return fm._triton_mlp


@requires_cuda
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("t,h,i", GPU_SHAPES)
def test_gpu_forward_and_backward(fm, t, h, i, dtype):
    if t == 4096 and dtype == torch.float16:
        pytest.skip("largest shape in bf16 only (time)")
    ref = fm.gated_mlp_reference
    acts = ACTS if t <= 512 else ("gelu_tanh",)
    for act in acts:
        x, ws, dy = _weights(t, h, i, dtype, "cuda", seed=t)
        with torch.no_grad():
            y = fm.gated_mlp(x, *ws, activation=act, backend="triton")
            y32 = ref(x.float(), *(w.float() for w in ws), activation=act)
            assert_2x_rule(y, y32, ref(x, *ws, activation=act, compute_dtype=dtype),
                           name=f"{act} y inference")
        y, g = _fwd_bwd(lambda *a: fm.gated_mlp(*a, activation=act, backend="triton"), x, ws, dy)
        y32, g32 = _fwd_bwd(lambda *a: ref(*(v.float() for v in a), activation=act), x, ws, dy)
        ys, gs = _fwd_bwd(lambda *a: ref(*a, activation=act, compute_dtype=dtype), x, ws, dy)
        assert_2x_rule(y, y32, ys, name=f"{act} y")
        for name, a, b, c in zip(("dx", "dW_gate", "dW_up", "dW_down"), g, g32, gs):
            assert_2x_rule(a, b, c, name=f"{act} {name}")


@requires_cuda
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("act", ACTS)
def test_gpu_epilogue_ops(fm, act):
    """The custom ops alone at a real shape: h, gate, up; dgate, dup, h of the backward epilogue."""
    import torch.nn.functional as F

    tm = _ops_of(fm)
    f = F.silu if act == "silu" else (lambda z: F.gelu(z, approximate="tanh" if act == "gelu_tanh" else "none"))
    dtype = torch.bfloat16
    x, (wg, wu, wd), dy = _weights(512, 2048, 16384, dtype, "cuda", seed=1)
    h, gate, up = tm.gated_dual_gemm_train(x, wg, wu, act)
    g32, u32 = x.float() @ wg.float().t(), x.float() @ wu.float().t()
    gs, us = x @ wg.t(), x @ wu.t()
    assert_2x_rule(gate, g32, gs, name="gate")
    assert_2x_rule(up, u32, us, name="up")
    assert_2x_rule(h, f(g32) * u32, f(gs) * us, name="h")
    gr, ur = gate.float().requires_grad_(), up.float().requires_grad_()
    (f(gr) * ur).backward(dy.float() @ wd.float())
    gl, ul = gate.clone().requires_grad_(), up.clone().requires_grad_()
    (f(gl) * ul).backward(dy @ wd)
    dgate, dup = gate.clone(), up.clone()
    hb = tm.gated_bwd_gemm_inplace(dy, wd, dgate, dup, act)
    assert_2x_rule(dgate, gr.grad, gl.grad, name="dgate")
    assert_2x_rule(dup, ur.grad, ul.grad, name="dup")
    assert_2x_rule(hb, f(gate.float()) * up.float(), f(gate) * up, name="bwd h")


@requires_cuda
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_gpu_opcheck(fm):
    tm = _ops_of(fm)
    x, (wg, wu, wd), dy = _weights(83, 256, 1000, torch.bfloat16, "cuda")
    torch.library.opcheck(tm.gated_dual_gemm, (x, wg, wu, "gelu_tanh"))
    torch.library.opcheck(tm.gated_dual_gemm_train, (x, wg, wu, "silu"))
    _, gate, up = tm.gated_dual_gemm_train(x, wg, wu, "gelu")
    torch.library.opcheck(tm.gated_bwd_gemm_inplace, (dy, wd, gate, up, "gelu"))


@requires_cuda
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_gpu_torch_compile_fullgraph_no_recompile(fm, training):
    import torch._dynamo

    torch._dynamo.reset()
    dtype = torch.bfloat16
    _, ws, _ = _weights(8, 256, 1024, dtype, "cuda")
    ws = [w.requires_grad_(training) for w in ws]

    def mlp(x, wg, wu, wd):
        return fm.gated_mlp(x, wg, wu, wd, backend="triton")

    compiled = torch.compile(mlp, fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in (17, 64, 300):
            x, _, dy = _weights(t, 256, 1024, dtype, "cuda", seed=t)
            x.requires_grad_(training)
            with torch.set_grad_enabled(training):
                y = compiled(x, *ws)
                y_eager = mlp(x, *ws)
            assert torch.allclose(y, y_eager, atol=2e-2, rtol=2e-2)
            if training:
                gc = torch.autograd.grad(y, [x, *ws], dy)
                ge = torch.autograd.grad(y_eager, [x, *ws], dy)
                for a, b in zip(gc, ge):
                    assert torch.allclose(a, b, atol=5e-2, rtol=5e-2)


@requires_cuda
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_gpu_peak_memory_not_above_cublas_path(fm):
    """Training saves x, gate, up only (as the cuBLAS path does); backward's live set is gate, up, h."""
    dtype = torch.bfloat16
    x, ws, dy = _weights(4096, 2048, 16384, dtype, "cuda")
    peaks = {}
    _fwd_bwd(lambda *a: fm.gated_mlp(*a, backend="triton"), x, ws, dy)  # autotuning (clones gate/up) done here
    for backend in ("cublas", "triton"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _fwd_bwd(lambda *a: fm.gated_mlp(*a, backend=backend), x, ws, dy)
        torch.cuda.synchronize()
        peaks[backend] = torch.cuda.max_memory_allocated() - base
    assert peaks["triton"] <= peaks["cublas"] * 1.02 + (8 << 20), peaks
