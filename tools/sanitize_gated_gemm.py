#!/usr/bin/env python3
"""The sm_90 gated-epilogue GEMMs (kernels_src/cuda/gated_gemm_sm90.cu) under compute-sanitizer (tools/sanitize.sh
runs it with --kernel-name kns=fm_sm90: the CUTLASS kernels are named after their template, not the op namespace).

Both schedules (cooperative, ping-pong), bf16 and fp16, every activation, ragged shapes (T, I not multiples of the
tiles, H not a multiple of the k-tile), forward with and without the saved pre-activations, backward in place; and the slopes form (forward saving
P and Q, backward in place over them).
Exits non-zero if a result disagrees with the fp32 reference, so a kernel that computes nothing fails too. Skips
(exit 0, says so) on a GPU other than sm_90.
"""

from __future__ import annotations

import os
import sys

import torch
from sanitize_common import ACT, run_sm90_driver


def cases(fm, bad: list[str]) -> None:
    ops = fm._ops.ops
    tol = {torch.bfloat16: 0.05, torch.float16: 0.01}
    for schedule in ("cooperative", "pingpong"):
        os.environ["FUSED_MLP_GATED_GEMM_SCHEDULE"] = schedule
        for dt in (torch.bfloat16, torch.float16):
            for t, h, i in ((37, 72, 200), (130, 64, 264)):
                for act, fn in ACT.items():
                    print(f"case: {schedule} {dt} T={t} H={h} I={i} {act}", flush=True)
                    torch.manual_seed(0)
                    x = torch.randn(t, h, device="cuda").to(dt)
                    wg = (torch.randn(i, h, device="cuda") * h ** -0.5).to(dt)
                    wu = (torch.randn(i, h, device="cuda") * h ** -0.5).to(dt)
                    wd = (torch.randn(h, i, device="cuda") * i ** -0.5).to(dt)
                    dy = torch.randn(t, h, device="cuda").to(dt)
                    hh, gate, up = ops.gated_gemm_fwd(x, wg, wu, act, True)
                    h_only = ops.gated_gemm_fwd(x, wg, wu, act, False)[0]
                    g32, u32 = x.float() @ wg.float().t(), x.float() @ wu.float().t()
                    ref = fn(g32) * u32
                    for name, out, r in (("h", hh, ref), ("h (inference)", h_only, ref), ("gate", gate, g32),
                                         ("up", up, u32)):
                        err = (out.float() - r).abs().max().item()
                        if not err <= tol[dt]:
                            bad.append(f"{schedule} {dt} {t}x{h}x{i} {act} fwd {name}: {err:.3g}")
                    gs, us = gate.float().requires_grad_(), up.float().requires_grad_()
                    (fn(gs) * us).backward(dy.float() @ wd.float())
                    h_b = ops.gated_gemm_bwd_(dy, wd, gate, up, act)
                    for name, out, r in (("h", h_b, fn(gs.detach()) * us.detach()), ("dgate", gate, gs.grad),
                                         ("dup", up, us.grad)):
                        err = (out.float() - r).abs().max().item()
                        if not err <= tol[dt] * max(1.0, r.abs().max().item()):
                            bad.append(f"{schedule} {dt} {t}x{h}x{i} {act} bwd {name}: {err:.3g}")
                    # the slopes form: h, P = up act'(gate), Q = act(gate); dgate = dh P, dup = dh Q in place
                    hs, p, q = ops.gated_gemm_fwd_slopes(x, wg, wu, act)
                    g2, u2 = g32.clone().requires_grad_(), u32.clone()
                    fn(g2).backward(torch.ones_like(g2))
                    for name, out, r in (("h", hs, ref), ("P", p, u32 * g2.grad), ("Q", q, fn(g32))):
                        err = (out.float() - r).abs().max().item()
                        if not err <= tol[dt] * max(1.0, r.abs().max().item()):
                            bad.append(f"{schedule} {dt} {t}x{h}x{i} {act} fwd_slopes {name}: {err:.3g}")
                    dh32 = dy.float() @ wd.float()
                    p0, q0 = p.float(), q.float()
                    ops.gated_gemm_bwd_slopes_(dy, wd, p, q)
                    for name, out, r in (("dgate", p, dh32 * p0), ("dup", q, dh32 * q0)):
                        err = (out.float() - r).abs().max().item()
                        if not err <= tol[dt] * max(1.0, r.abs().max().item()):
                            bad.append(f"{schedule} {dt} {t}x{h}x{i} {act} bwd_slopes {name}: {err:.3g}")


if __name__ == "__main__":
    sys.exit(run_sm90_driver(cases))
