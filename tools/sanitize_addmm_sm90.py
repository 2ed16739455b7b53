#!/usr/bin/env python3
"""The sm_90 addmm / Linear GEMM with bias and activation in its epilogue (kernels_src/cuda/addmm_sm90.cu) under
compute-sanitizer (tools/sanitize.sh runs it with --kernel-name kns=fm_addmm_sm90: the CUTLASS kernels are named after
their template, not the op namespace).

The kernel is forced on (the private op _addmm_sm90_mode; "auto" takes it only from 256 output tiles), both configs
(ping-pong, cooperative), bf16 and fp16, both layouts (Linear's [N, K] weight seen as [K, N], GPT-2's contiguous
[K, N]), every activation and none, bias in the input dtype, in fp32 and absent, ragged shapes (M not a multiple of a
tile, N and K 8 x odd, a single k-tile), inference and the training forward (which also stores Z = acc + bias).
Exits non-zero if a result disagrees with the fp32 reference, so a kernel that computes nothing fails too. Skips
(exit 0, says so) on a GPU other than sm_90.
"""

from __future__ import annotations

import sys

import torch
from sanitize_common import ACT, mm32, run_sm90_driver

MODES = {"pingpong": 3, "cooperative": 4}  # _addmm_sm90_mode: 3 / 4 = on with that config (test_addmm.py's table)
SHAPES = ((300, 504, 136), (5, 40, 24), (130, 8, 264))  # (M, K, N)
ACTS = {"none": lambda z: z, "gelu_tanh": ACT["gelu_tanh"], "gelu": ACT["gelu"]}


def cases(fm, bad: list[str]) -> None:
    ops = fm._ops.ops
    tol = {torch.bfloat16: 0.05, torch.float16: 0.01}
    prev = ops._addmm_sm90_mode(0)
    try:
        for config, mode in MODES.items():
            ops._addmm_sm90_mode(mode)
            for dt in (torch.bfloat16, torch.float16):
                for m, k, n in SHAPES:
                    torch.manual_seed(m + k + n)
                    x = torch.randn(m, k, device="cuda").to(dt)
                    w = (torch.randn(n, k, device="cuda") * k ** -0.5).to(dt)
                    mm = mm32(x, w)  # both layouts compute x @ w.T
                    for layout, w_kn in (("linear", w.t()), ("conv1d", w.t().contiguous())):
                        for bias_kind in ("same", "fp32", "none"):
                            b = None if bias_kind == "none" else torch.randn(n, device="cuda")
                            if bias_kind == "same":
                                b = b.to(dt)
                            z_ref = mm if b is None else mm + b.float()
                            for act, fn in ACTS.items():
                                ref = fn(z_ref)
                                for save in (False, True):
                                    what = f"{config} {dt} {m}x{k}x{n} {layout} bias={bias_kind} {act} save={save}"
                                    print(f"case: {what}", flush=True)
                                    y, z = ops.addmm_fwd(b, x, w_kn, act, save, [m, n])
                                    checks = [("y", y, ref)] + ([("Z", z, z_ref)] if save and act != "none" else [])
                                    for name, out, r in checks:
                                        err = (out.float() - r).abs().max().item()
                                        if not err <= tol[dt] * max(1.0, r.abs().max().item()):
                                            bad.append(f"{what} {name}: {err:.3g}")
    finally:
        ops._addmm_sm90_mode(prev)


if __name__ == "__main__":
    sys.exit(run_sm90_driver(cases))
