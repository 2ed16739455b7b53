"""Reliability across every public op: a table-driven bad-input matrix, NaN/Inf propagation, huge N, empty
inputs, bitwise determinism, CUDA graphs / streams / threads, and loading failures."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from conftest import CUDA, ROOT, requires_cuda

F32, BF16 = torch.float32, torch.bfloat16


# ---- the bad-input matrix -----------------------------------------------------------------------------------


@dataclass
class Bad:
    name: str
    call: Callable  # (fm, device) -> anything; must raise
    arg: str  # the argument the message must name
    needs_cuda: bool = False


def _t(*shape, dtype=F32, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device)


def _i(*shape, device="cpu"):
    return torch.randint(0, 5, shape, device=device)


BAD_INPUTS = [
    # rms_norm
    Bad("rms int x", lambda fm, d: fm.rms_norm(_i(4, 8, device=d), _t(8, device=d)), "x"),
    Bad("rms int weight", lambda fm, d: fm.rms_norm(_t(4, 8, device=d), _i(8, device=d)), "weight"),
    Bad("rms weight length", lambda fm, d: fm.rms_norm(_t(4, 8, device=d), _t(7, device=d)), "weight"),
    Bad("rms weight 2-D", lambda fm, d: fm.rms_norm(_t(4, 8, device=d), _t(1, 8, device=d)), "weight"),
    Bad("rms nan eps", lambda fm, d: fm.rms_norm(_t(4, 8, device=d), _t(8, device=d), float("nan")), "eps"),
    Bad("rms inf eps", lambda fm, d: fm.rms_norm(_t(4, 8, device=d), _t(8, device=d), float("inf")), "eps"),
    Bad("rms negative eps", lambda fm, d: fm.rms_norm(_t(4, 8, device=d), _t(8, device=d), -1e-6), "eps"),
    Bad("rms residual shape", lambda fm, d: fm.rms_norm(_t(4, 8, device=d), _t(8, device=d),
                                                        residual=_t(4, 9, device=d)), "residual"),
    Bad("rms residual int", lambda fm, d: fm.rms_norm(_t(4, 8, device=d), _t(8, device=d),
                                                      residual=_i(4, 8, device=d)), "residual"),
    Bad("rms residual_dtype", lambda fm, d: fm.rms_norm(_t(4, 8, device=d), _t(8, device=d),
                                                        residual=_t(4, 8, device=d), residual_dtype=torch.int32),
        "residual_dtype"),
    Bad("rms device mismatch", lambda fm, d: fm.rms_norm(_t(4, 8, device="cuda"), _t(8)), "weight", True),
    # geglu / swiglu
    Bad("geglu shape", lambda fm, d: fm.geglu(_t(4, 8, device=d), _t(4, 9, device=d)), "up"),
    Bad("geglu int", lambda fm, d: fm.geglu(_i(4, 8, device=d), _t(4, 8, device=d)), "gate"),
    Bad("geglu approximate", lambda fm, d: fm.geglu(_t(4, 8, device=d), _t(4, 8, device=d), approximate="fast"),
        "approximate"),
    Bad("geglu device mismatch", lambda fm, d: fm.geglu(_t(4, 8, device="cuda"), _t(4, 8)), "up", True),
    Bad("swiglu shape", lambda fm, d: fm.swiglu(_t(4, 8, device=d), _t(3, 8, device=d)), "up"),
    Bad("swiglu int", lambda fm, d: fm.swiglu(_t(4, 8, device=d), _i(4, 8, device=d)), "up"),
    # addmm / linear
    Bad("addmm inner dim", lambda fm, d: fm.addmm(_t(5, device=d), _t(4, 8, device=d), _t(7, 5, device=d)), "mat2"),
    Bad("addmm bias length", lambda fm, d: fm.addmm(_t(6, device=d), _t(4, 8, device=d), _t(8, 5, device=d)), "bias"),
    Bad("addmm activation", lambda fm, d: fm.addmm(_t(5, device=d), _t(4, 8, device=d), _t(8, 5, device=d),
                                                   activation="relu"), "activation"),
    Bad("addmm int", lambda fm, d: fm.addmm(_t(5, device=d), _i(4, 8, device=d), _t(8, 5, device=d)), "mat1"),
    Bad("addmm device mismatch", lambda fm, d: fm.addmm(_t(5), _t(4, 8, device="cuda"), _t(8, 5, device="cuda")),
        "bias", True),
    Bad("linear weight shape", lambda fm, d: fm.linear(_t(4, 8, device=d), _t(5, 7, device=d)), "weight"),
    Bad("linear bias length", lambda fm, d: fm.linear(_t(4, 8, device=d), _t(5, 8, device=d), _t(4, device=d)),
        "bias"),
    Bad("linear activation", lambda fm, d: fm.linear(_t(4, 8, device=d), _t(5, 8, device=d),
                                                     activation="swish"), "activation"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c.name for c in BAD_INPUTS])
def test_bad_input_raises_naming_the_argument(fm, device, case):
    if case.needs_cuda and not CUDA:
        pytest.skip("device-mismatch cases need a GPU")
    if case.needs_cuda and device != "cuda":
        pytest.skip("device-mismatch cases run once, on the CUDA parametrisation")
    with pytest.raises((ValueError, TypeError, RuntimeError)) as info:
        case.call(fm, device)
    assert case.arg in str(info.value), f"message does not name {case.arg!r}: {info.value}"


# ---- values that are valid but extreme ------------------------------------------------------------------------


def _ops(fm, device: str, n: int, m: int = 2, dtype=F32):
    """(name, ours(), reference()) for every op at [m, n]."""
    g = torch.Generator(device="cpu").manual_seed(n)
    x = torch.randn(m, n, generator=g).to(device=device, dtype=dtype)
    u = torch.randn(m, n, generator=g).to(device=device, dtype=dtype)
    w = torch.randn(n, generator=g).to(device=device, dtype=dtype)
    k = 16
    a = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(k, n, generator=g).to(device=device, dtype=dtype)
    return [
        ("rms_norm", lambda: fm.rms_norm(x, w), lambda: fm.rms_norm_reference(x, w)),
        ("rms_norm+res", lambda: fm.rms_norm(x, w, residual=u)[0], lambda: fm.rms_norm_reference(x, w, residual=u)[0]),
        ("geglu", lambda: fm.geglu(x, u), lambda: fm.geglu_reference(x, u)),
        ("swiglu", lambda: fm.swiglu(x, u), lambda: fm.swiglu_reference(x, u)),
        ("addmm_gelu", lambda: fm.addmm(w, a, b, activation="gelu_tanh"),
         lambda: fm.addmm_reference(w, a, b, activation="gelu_tanh")),
    ]


def test_nan_and_inf_propagate_like_the_reference(fm, device):
    n = 64
    for name, ours, ref in _ops(fm, device, n):
        out, expected = ours(), ref()
        assert torch.equal(torch.isnan(out), torch.isnan(expected)), name
    # Planted NaN/Inf in the input of each op.
    x = torch.randn(3, n, device=device)
    x[0, 5] = float("nan")
    x[1, 7] = float("inf")
    w = torch.rand(n, device=device)
    for out, ref in [
        (fm.rms_norm(x, w), fm.rms_norm_reference(x, w)),
        (fm.geglu(x, x.flip(0)), fm.geglu_reference(x, x.flip(0))),
        (fm.swiglu(x, x.flip(0)), fm.swiglu_reference(x, x.flip(0))),
    ]:
        assert torch.equal(torch.isnan(out), torch.isnan(ref))
        assert torch.equal(torch.isinf(out), torch.isinf(ref))


def test_huge_hidden_size(fm, device):
    n = 262144
    for name, ours, ref in _ops(fm, device, n, m=2):
        torch.testing.assert_close(ours(), ref(), rtol=2e-5, atol=2e-5, msg=name)


def test_empty_inputs_give_empty_results(fm, device):
    for name, ours, ref in _ops(fm, device, 64, m=0):
        out = ours()
        assert out.shape == ref().shape and out.numel() == 0, name


# ---- determinism ----------------------------------------------------------------------------------------------


def _fwd_bwd(fm, device, dtype, seed):
    torch.manual_seed(seed)
    m, n, h = 300, 1000, 64
    x = torch.randn(m, n, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(n, device=device, dtype=dtype, requires_grad=True)
    r = torch.randn(m, n, device=device, dtype=dtype, requires_grad=True)
    up = torch.randn(m, n, device=device, dtype=dtype, requires_grad=True)
    wl = torch.randn(h, n, device=device, dtype=dtype, requires_grad=True)
    bl = torch.randn(h, device=device, dtype=dtype, requires_grad=True)
    y, hres = fm.rms_norm(x, w, residual=r)
    a = fm.geglu(y, up)
    z = fm.linear(a, wl, bl, activation="gelu_tanh")
    (z.float().square().mean() + hres.float().mean()).backward()
    return [t.detach().clone() for t in (y, a, z, x.grad, w.grad, r.grad, up.grad, wl.grad, bl.grad)]


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_bitwise_deterministic(fm, device, dtype):
    first = _fwd_bwd(fm, device, dtype, 0)
    second = _fwd_bwd(fm, device, dtype, 0)
    for i, (a, b) in enumerate(zip(first, second)):
        assert torch.equal(a, b), f"output {i} differs between identical runs"


# ---- CUDA graphs, streams, threads ---------------------------------------------------------------------------


def _layer_stack(fm, dtype=BF16):
    """Functional forward of norm -> gated MLP -> linear on CUDA, for capture tests."""
    torch.manual_seed(0)
    n, i = 512, 1024
    w = torch.randn(n, device="cuda", dtype=dtype)
    wg = torch.randn(i, n, device="cuda", dtype=dtype) / n**0.5
    wu = torch.randn(i, n, device="cuda", dtype=dtype) / n**0.5
    wd = torch.randn(n, i, device="cuda", dtype=dtype) / i**0.5
    bd = torch.randn(n, device="cuda", dtype=dtype)

    def fn(x, r):
        y, h = fm.rms_norm(x, w, residual=r, offset=1.0)
        a = fm.geglu(fm.linear(y, wg), fm.linear(y, wu))
        return fm.linear(a, wd, bd, activation="gelu_tanh") + h

    return fn, n


@requires_cuda
def test_cuda_graph_capture_and_replay(fm):
    fn, n = _layer_stack(fm)
    x = torch.randn(64, n, device="cuda", dtype=BF16)
    r = torch.randn(64, n, device="cuda", dtype=BF16)
    expected = fn(x, r)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn(x, r)  # warm-up: heuristics cached, workspaces allocated
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x, r)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, fn(x, r), rtol=0, atol=0)
    assert not torch.equal(out, expected)


@requires_cuda
def test_reduce_overhead_compile(fm):
    fn, n = _layer_stack(fm)
    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    x = torch.randn(64, n, device="cuda", dtype=BF16)
    r = torch.randn(64, n, device="cuda", dtype=BF16)
    for _ in range(3):
        out = compiled(x, r)
    torch.testing.assert_close(out, fn(x, r), rtol=0, atol=0)


@requires_cuda
def test_non_default_stream_and_two_threads(fm):
    fn, n = _layer_stack(fm)
    inputs = [(torch.randn(256, n, device="cuda", dtype=BF16), torch.randn(256, n, device="cuda", dtype=BF16))
              for _ in range(2)]
    expected = [fn(x, r) for x, r in inputs]
    torch.cuda.synchronize()
    results: list = [None, None]
    errors: list = []

    def worker(k: int) -> None:
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for _ in range(20):
                    results[k] = fn(*inputs[k])
            stream.synchronize()
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in range(2):
        torch.testing.assert_close(results[k], expected[k], rtol=0, atol=0)


# ---- loading failures -----------------------------------------------------------------------------------------


def _copy_build(tmp_path):
    dst = tmp_path / "checkout"
    shutil.copytree(ROOT / "build", dst / "build", ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def _load_in_child(path, backend: str = "cpu") -> subprocess.CompletedProcess:
    code = f"import kernels, pathlib; kernels.get_local_kernel(pathlib.Path({str(path)!r}), backend={backend!r})"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_corrupted_metadata_gives_a_clear_error(tmp_path):
    root = _copy_build(tmp_path)
    for meta in root.glob("build/*/metadata.json"):
        meta.write_text("{ this is not json")
    proc = _load_in_child(root)
    assert proc.returncode != 0
    assert "metadata" in proc.stderr.lower() or "json" in proc.stderr.lower(), proc.stderr[-2000:]


def test_metadata_missing_fields_gives_a_clear_error(tmp_path):
    root = _copy_build(tmp_path)
    for meta in root.glob("build/*/metadata.json"):
        data = json.loads(meta.read_text())
        del data["name"]
        meta.write_text(json.dumps(data))
    proc = _load_in_child(root)
    assert proc.returncode != 0 and "name" in proc.stderr, proc.stderr[-2000:]


def test_missing_variant_gives_a_clear_error(tmp_path):
    root = _copy_build(tmp_path)
    for variant in list((root / "build").iterdir()):
        if "-cpu-" in variant.name:
            shutil.rmtree(variant)
    proc = _load_in_child(root, backend="cpu")
    assert proc.returncode != 0 and "Cannot find a build variant" in proc.stderr, proc.stderr[-2000:]
