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
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
MODES = {"pingpong": 3, "cooperative": 4}  # _addmm_sm90_mode: 3 / 4 = on with that config (test_addmm.py's table)
SHAPES = ((300, 504, 136), (5, 40, 24), (130, 8, 264))  # (M, K, N)
ACT = {"none": lambda z: z, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"), "gelu": F.gelu}


def mm32(x: torch.Tensor, w_kn: torch.Tensor) -> torch.Tensor:
    """x @ w_kn in fp32 without a GEMM library call: racecheck cannot run cuBLAS's Hopper GEMMs
    (docs/releasing.md#compute-sanitizer)."""
    return (x.float().unsqueeze(2) * w_kn.float().unsqueeze(0)).sum(1)


def main() -> int:
    import kernels

    if torch.cuda.get_device_capability() != (9, 0):
        print("done: skipped (not an sm_90 GPU)")
        return 0
    fm = kernels.get_local_kernel(ROOT)
    ops = fm._ops.ops
    bad = []
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
                    for layout, w_kn in (("linear", w.t()), ("conv1d", w.t().contiguous())):
                        for bias_kind in ("same", "fp32", "none"):
                            b = None if bias_kind == "none" else torch.randn(n, device="cuda")
                            if bias_kind == "same":
                                b = b.to(dt)
                            for act in ("none", "gelu_tanh", "gelu"):
                                for save in (False, True):
                                    print(f"case: {config} {dt} M={m} K={k} N={n} {layout} bias={bias_kind} {act} "
                                          f"save_preact={save}", flush=True)
                                    y, z = ops.addmm_fwd(b, x, w_kn, act, save, [m, n])
                                    z_ref = mm32(x, w_kn) + (0 if b is None else b.float())
                                    ref = ACT[act](z_ref)
                                    scale = max(1.0, ref.abs().max().item())
                                    err = (y.float() - ref).abs().max().item()
                                    if not err <= tol[dt] * scale:
                                        bad.append(f"{config} {dt} {m}x{k}x{n} {layout} {bias_kind} {act} y: {err:.3g}")
                                    if save and act != "none":
                                        err = (z.float() - z_ref).abs().max().item()
                                        if not err <= tol[dt] * max(1.0, z_ref.abs().max().item()):
                                            bad.append(f"{config} {dt} {m}x{k}x{n} {layout} {bias_kind} {act} Z: "
                                                       f"{err:.3g}")
    finally:
        ops._addmm_sm90_mode(prev)
    torch.cuda.synchronize()
    for b in bad:
        print("mismatch:", b)
    print("done" if not bad else f"done with {len(bad)} mismatches", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
