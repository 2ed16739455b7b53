"""The Triton epilogue path of ``gated_mlp(backend="triton")`` run by Triton's interpreter on CPU tensors.

Run by tests/test_triton_mlp.py in a subprocess (``TRITON_INTERPRET=1`` must be set before triton is imported,
and must not leak into other test modules): ``TRITON_INTERPRET=1 python tests/triton_interpret_check.py``.
Loads the CPU variant of this checkout's build the way users do (``kernels.get_local_kernel``), compares against
the fp32 reference with the 2x rule, and exits non-zero with the failing check on stderr.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _utils import assert_2x_rule  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ACTS = ("gelu_tanh", "gelu", "silu")


class OpLog(TorchDispatchMode):
    """Records the names of the ops that ran (to prove which path a call took)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


def ran(log: OpLog, op: str) -> bool:
    return any(n.split("::")[-1].split(".")[0] == op for n in log.names)


def make(t: int, h: int, i: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    ws = [(torch.randn(i, h, generator=g) * h ** -0.5).to(dtype),
          (torch.randn(i, h, generator=g) * h ** -0.5).to(dtype),
          (torch.randn(h, i, generator=g) * i ** -0.5).to(dtype)]
    dy = torch.randn(t, h, generator=g).to(dtype)
    return x, ws, dy


def grads(fn, x, ws, dy):
    xs = [x.detach().clone().requires_grad_()] + [w.detach().clone().requires_grad_() for w in ws]
    y = fn(*xs)
    y.backward(dy.to(y.dtype))
    return y.detach(), [t.grad for t in xs]


def check_mlp(fm, t: int, h: int, i: int, dtype: torch.dtype, act: str, seed: int) -> None:
    ref = fm.gated_mlp_reference
    x, ws, dy = make(t, h, i, dtype, seed)
    tag = f"[T={t} H={h} I={i} {dtype} {act}]"
    # inference
    log = OpLog()
    with torch.no_grad(), log:
        y = fm.gated_mlp(x, *ws, activation=act, backend="triton")
    assert ran(log, "triton_gated_dual_gemm"), f"{tag} inference did not take the Triton path: {log.names}"
    with torch.no_grad():
        y32 = ref(x.float(), *(w.float() for w in ws), activation=act)
        ysame = ref(x, *ws, activation=act, compute_dtype=dtype)
    assert_2x_rule(y, y32, ysame, name=f"{tag} y (inference)")
    # training: y, dx, dW_gate, dW_up, dW_down through autograd
    log = OpLog()
    with log:
        y, g = grads(lambda *a: fm.gated_mlp(*a, activation=act, backend="triton"), x, ws, dy)
    assert ran(log, "triton_gated_dual_gemm_train") and ran(log, "triton_gated_bwd_gemm_inplace"), (
        f"{tag} training did not take the Triton path: {sorted(set(log.names))}")
    y32, g32 = grads(lambda *a: ref(*(v.float() for v in a), activation=act), x, ws, dy)
    ysame, gsame = grads(lambda *a: ref(*a, activation=act, compute_dtype=dtype), x, ws, dy)
    assert_2x_rule(y, y32, ysame, name=f"{tag} y")
    for name, a, b, c in zip(("dx", "dW_gate", "dW_up", "dW_down"), g, g32, gsame):
        assert a.dtype == dtype, f"{tag} {name} dtype {a.dtype}"
        assert_2x_rule(a, b, c, name=f"{tag} {name}")


def act_fn(act: str):
    import torch.nn.functional as F

    if act == "silu":
        return F.silu
    return lambda z: F.gelu(z, approximate="tanh" if act == "gelu_tanh" else "none")


def check_ops(fm, t: int, h: int, i: int, dtype: torch.dtype, act: str, seed: int) -> None:
    """The custom ops alone: h (and stored gate, up) of the dual GEMM, dgate/dup/h of the backward epilogue."""
    tm = fm._triton_mlp
    x, (wg, wu, wd), dy = make(t, h, i, dtype, seed)
    tag = f"[ops T={t} H={h} I={i} {dtype} {act}]"
    f = act_fn(act)
    h_, gate, up = tm.gated_dual_gemm_train(x, wg, wu, act)
    g32, u32 = x.float() @ wg.float().t(), x.float() @ wu.float().t()
    gs, us = x @ wg.t(), x @ wu.t()
    assert_2x_rule(gate, g32, gs, name=f"{tag} gate")
    assert_2x_rule(up, u32, us, name=f"{tag} up")
    assert_2x_rule(h_, f(g32) * u32, f(gs) * us, name=f"{tag} h")
    assert torch.equal(tm.gated_dual_gemm(x, wg, wu, act), h_), f"{tag} inference h != training h"
    # backward epilogue on the stored (rounded) gate, up: reference in fp32 from the same inputs
    gr, ur = gate.float().requires_grad_(), up.float().requires_grad_()
    (f(gr) * ur).backward(dy.float() @ wd.float())
    gl, ul = gate.clone().requires_grad_(), up.clone().requires_grad_()
    (f(gl) * ul).backward(dy @ wd)  # same-dtype PyTorch
    dgate, dup = gate.clone(), up.clone()
    hb = tm.gated_bwd_gemm_inplace(dy, wd, dgate, dup, act)
    assert_2x_rule(dgate, gr.grad, gl.grad, name=f"{tag} dgate")
    assert_2x_rule(dup, ur.grad, ul.grad, name=f"{tag} dup")
    assert_2x_rule(hb, f(gate.float()) * up.float(), f(gate) * up, name=f"{tag} bwd h")


def check_layouts(fm) -> None:
    """3-D and strided x, retain_graph (the saved gate/up survive a second backward)."""
    dtype = torch.bfloat16
    x, ws, dy = make(2 * 19, 64, 96, dtype, 7)
    xs = x.view(2, 19, 64)[:, ::2]  # [2, 10, 64] non-contiguous
    with torch.no_grad():
        y = fm.gated_mlp(xs, *ws, backend="triton")
        assert y.shape == (2, 10, 64)
        y32 = fm.gated_mlp_reference(xs.float(), *(w.float() for w in ws))
        assert_2x_rule(y, y32, fm.gated_mlp_reference(xs, *ws, compute_dtype=dtype),
                       name="strided 3-D y")
    xg = x.clone().requires_grad_()
    y = fm.gated_mlp(xg, *ws, backend="triton")
    y.backward(dy, retain_graph=True)
    first = xg.grad.clone()
    xg.grad = None
    y.backward(dy)
    assert torch.equal(xg.grad, first), "retain_graph: the second backward differs"


def check_opcheck(fm) -> None:
    tm = fm._triton_mlp
    x, (wg, wu, wd), dy = make(9, 64, 96, torch.bfloat16, 3)
    torch.library.opcheck(tm.gated_dual_gemm, (x, wg, wu, "gelu_tanh"))
    torch.library.opcheck(tm.gated_dual_gemm_train, (x, wg, wu, "silu"))
    _, gate, up = tm.gated_dual_gemm_train(x, wg, wu, "gelu")
    torch.library.opcheck(tm.gated_bwd_gemm_inplace, (dy, wd, gate, up, "gelu"))


def check_compile(fm) -> None:
    """torch.compile(fullgraph=True, dynamic=True) through backend="triton": no graph break, no recompile across
    token counts, the same results as eager (inference and training)."""
    import torch._dynamo

    def mlp(x, wg, wu, wd):
        return fm.gated_mlp(x, wg, wu, wd, backend="triton")

    for training in (False, True):
        torch._dynamo.reset()
        compiled = torch.compile(mlp, fullgraph=True, dynamic=True)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for t in (17, 40):
                x, ws, dy = make(t, 64, 96, torch.bfloat16, t)
                xs = [v.requires_grad_(training) for v in (x, *ws)]
                with torch.set_grad_enabled(training):
                    y, ye = compiled(*xs), mlp(*xs)
                assert torch.equal(y, ye), f"compiled != eager (T={t}, training={training})"
                if training:
                    for a, b in zip(torch.autograd.grad(y, xs, dy), torch.autograd.grad(ye, xs, dy)):
                        assert torch.equal(a, b), f"compiled grads != eager (T={t})"
    torch._dynamo.reset()


def main(argv: list[str]) -> int:
    """Every check; ``--quick``: the custom ops and one MLP only (for a second, pinned tile configuration)."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    import kernels

    fm = kernels.get_local_kernel(ROOT, backend="cpu")
    assert fm._triton_mlp.INTERPRET and fm._triton_mlp.HAS_TRITON
    torch.manual_seed(0)
    if "--quick" in argv:
        for seed, (dtype, act) in enumerate([(torch.bfloat16, "gelu_tanh"), (torch.float16, "silu")]):
            check_ops(fm, 37, 72, 96, dtype, act, seed)
        check_mlp(fm, 37, 64, 96, torch.bfloat16, "gelu", 5)
        print("triton interpreter checks passed")
        return 0
    seed = 0
    for dtype in (torch.bfloat16, torch.float16):
        for act in ACTS:
            seed += 1
            # ragged everywhere: T=37 over BLOCK_M=32, I=96 over BLOCK_N=64, H=72 over BLOCK_K=32
            check_ops(fm, 37, 72, 96, dtype, act, seed)
            check_mlp(fm, 37, 64, 96, dtype, act, seed)
    check_mlp(fm, 1, 72, 80, torch.bfloat16, "gelu_tanh", 99)  # one token
    check_layouts(fm)
    check_opcheck(fm)
    check_compile(fm)
    print("triton interpreter checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
