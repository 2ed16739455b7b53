#!/usr/bin/env python3
"""A compact run of every CUDA kernel and configuration branch, for compute-sanitizer (tools/sanitize.sh).

Small M, but N spanning every configuration of the kernels (tiny, odd, register-resident, shared-memory,
general/large), all dtypes, unaligned row strides, residual and fp32-residual paths, all activations, with and
without bias, forward and backward. Exits non-zero if a result disagrees with the reference, so a kernel that
"passes" the sanitizer by computing nothing is caught too.

Sections (argv or SANITIZE_CASES, comma-separated; default: all but addmm_no_lt):
  rms_norm     rms_norm fwd/bwd (plain, fp32-residual + Gemma offset, residual bwd)
  gated        geglu (tanh, erf) / swiglu fwd/bwd
  addmm        linear/addmm through cuBLASLt (epilogues, fp32-accumulator path, backward)
  addmm_no_lt  the same cases with cuBLASLt switched off (_addmm_lt_force_fallback(2): at::mm + our kernels only)
  decode       the decode-class ops (kernels_src/cuda/gated_gemv.cu): gated_mlp_decode and linear_decode at every
               token class and its edges, K and row tails, every activation; references without GEMM calls (racecheck
               cannot run cuBLAS's Hopper GEMMs); sm_80+ only
Every case prints a line (flushed) before it runs, so a log cut short by a crash names the case that was running.
The racecheck run of the whole driver on the H200 ended in "Internal Sanitizer Error: failed to handle a hardware
exception" (memcheck was clean on the same driver, racecheck clean on tools/sanitize_rms_norm.py); tools/sanitize.sh
therefore runs racecheck once per section, addmm_no_lt included, which separates cuBLASLt's kernels (not
instrumented: --kernel-name kns=fused_mlp) from ours. See docs/releasing.md.
"""

from __future__ import annotations

import os
import sys
import torch
from sanitize_common import ACT, ROOT, mm32


SECTIONS = ("rms_norm", "gated", "addmm", "addmm_no_lt", "decode")


def main(argv: list[str]) -> int:
    import kernels

    wanted = [s for a in (argv or [os.environ.get("SANITIZE_CASES", "")]) for s in a.split(",") if s]
    sections = wanted or [s for s in SECTIONS if s != "addmm_no_lt"]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        print(f"unknown section(s) {unknown}; choose from {SECTIONS}")
        return 2
    fm = kernels.get_local_kernel(ROOT)
    dev = "cuda"
    torch.manual_seed(0)
    bad = []

    def case(text: str) -> None:
        print(f"case: {text}", flush=True)

    def check(name, out, ref, tol):
        err = (out.double() - ref.double()).abs().max().item() if out.numel() else 0.0
        if not err <= tol:
            bad.append(f"{name}: max err {err:.3g} > {tol:g}")

    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    tol = {torch.bfloat16: 0.1, torch.float16: 0.02, torch.float32: 1e-3}
    for n in [1, 3, 127, 1000, 2304, 4096, 8192, 16385, 65536, 131072]:
        if "rms_norm" not in sections and "gated" not in sections:
            break
        for dt in dtypes:
            m = 3 if n >= 65536 else 7
            # row stride n + 8 (and +1 for an unaligned one) exercises the strided / scalar paths
            for pad in (0, 1):
                # pad=1: a row stride of n + 1 breaks 16-byte alignment and exercises the scalar/strided paths
                x = torch.randn(m, n + pad, device=dev, dtype=dt)[:, :n]
                w = torch.randn(n, device=dev, dtype=dt)
                r = torch.randn(m, n, device=dev, dtype=dt)
                g = torch.randn(m, n, device=dev, dtype=dt)
                up = torch.randn(m, n, device=dev, dtype=dt, requires_grad=True)
                if "gated" in sections:
                    case(f"gated m={m} n={n} {dt} pad={pad}")
                    gate = x.detach().requires_grad_(True)
                    for name, fn, ref in (("geglu", fm.geglu, fm.geglu_reference),
                                          ("swiglu", fm.swiglu, fm.swiglu_reference)):
                        out = fn(gate, up)
                        check(f"{name} n={n} {dt} pad={pad}", out, ref(gate, up), tol[dt])
                        out.backward(g)
                    out = fm.geglu(gate, up, approximate="none")
                    check(f"geglu-erf n={n} {dt} pad={pad}", out, fm.geglu_reference(gate, up, approximate="none"),
                          tol[dt])
                    out.backward(g)
                    torch.cuda.synchronize()
                if "rms_norm" not in sections:
                    continue
                case(f"rms_norm m={m} n={n} {dt} pad={pad}")
                y = fm.rms_norm(x, w)
                check(f"rms fwd n={n} {dt} pad={pad}", y, fm.rms_norm_reference(x, w), tol[dt])
                y2, _ = fm.rms_norm(x, w, residual=r, residual_dtype=torch.float32, offset=1.0)
                ref2, _ = fm.rms_norm_reference(x, w, residual=r, residual_dtype=torch.float32, offset=1.0)
                check(f"rms res fwd n={n} {dt} pad={pad}", y2, ref2, tol[dt])
                xg, wg = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
                rg = r.detach().requires_grad_(True)
                y3, h3 = fm.rms_norm(xg, wg, residual=rg)
                (y3.float().square().sum() + h3.float().sum()).backward()
                torch.cuda.synchronize()
    for section in ("addmm", "addmm_no_lt"):
        if section not in sections:
            continue
        fm._ops.ops._addmm_lt_force_fallback(2 if section == "addmm_no_lt" else 0)
        try:
            run_addmm(fm, dev, dtypes, tol, check, case, section)
        finally:
            fm._ops.ops._addmm_lt_force_fallback(0)
    if "decode" in sections:
        run_decode(fm, tol, check, case)
    torch.cuda.synchronize()
    for line in bad:
        print("MISMATCH", line)
    print(f"sanitize cases done ({','.join(sections)}): {len(bad)} mismatches")
    return 1 if bad else 0


def run_addmm(fm, dev, dtypes, tol, check, case, section) -> None:
    for (m, k, n) in [(1, 64, 64), (7, 100, 33), (64, 256, 512), (300, 512, 1000)]:
        for dt in dtypes:
            for act in (None, "gelu_tanh", "gelu"):
                for with_bias in (True, False):
                    case(f"{section} m={m} k={k} n={n} {dt} act={act} bias={with_bias}")
                    a = torch.randn(m, k, device=dev, dtype=dt, requires_grad=True)
                    wt = (torch.randn(n, k, device=dev, dtype=dt) / k**0.5).requires_grad_(True)
                    b = torch.randn(n, device=dev, dtype=dt, requires_grad=True) if with_bias else None
                    out = fm.linear(a, wt, b, activation=act)
                    ref = fm.linear_reference(a.float(), wt.float(), None if b is None else b.float(), activation=act)
                    check(f"linear m={m} k={k} n={n} {dt} {act} bias={with_bias}", out, ref.to(dt), tol[dt] * 4)
                    out.float().sum().backward()
                    torch.cuda.synchronize()


def run_decode(fm, tol, check, case) -> None:
    if torch.cuda.get_device_capability() < (8, 0):
        print("decode section skipped (needs sm_80+)", flush=True)
        return
    ops = fm._ops.ops
    # (H, I, H_out): K tails (8 past a multiple of 32) and row tails (8 past a multiple of 16) in both passes, K
    # shorter than one chunk, H_out below one row tile
    for h, i, h_out in ((264, 1032, 264), (136, 520, 24), (8, 8, 8)):
        for dt in (torch.bfloat16, torch.float16):
            x = torch.randn(64, h, device="cuda").to(dt)
            wg = (torch.randn(i, h, device="cuda") * h ** -0.5).to(dt)
            wu = (torch.randn(i, h, device="cuda") * h ** -0.5).to(dt)
            wd = (torch.randn(h_out, i, device="cuda") * i ** -0.5).to(dt)
            for t in (1, 8, 9, 16, 17, 33, 64):  # every token class (1, 2, 4, 8 n8-tiles) and its edges
                case(f"decode linear T={t} N={h_out} K={i} {dt}")
                xi = (torch.randn(t, i, device="cuda")).to(dt)
                check(f"linear_decode T={t} {h_out}x{i} {dt}", ops.linear_decode(xi, wd), mm32(xi, wd), tol[dt] * 4)
                for act, fn in ACT.items():
                    case(f"decode gated_mlp T={t} H={h} I={i} H_out={h_out} {dt} {act}")
                    y = ops.gated_mlp_decode(x[:t], wg, wu, wd, act)
                    hh = (fn(mm32(x[:t], wg)) * mm32(x[:t], wu)).to(dt)  # h is rounded once to dt by the op
                    check(f"gated_mlp_decode T={t} {h}x{i}x{h_out} {dt} {act}", y, mm32(hh, wd), tol[dt] * 4)
            torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
