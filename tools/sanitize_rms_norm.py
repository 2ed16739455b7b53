"""Drive every rms_norm CUDA kernel branch once, at sizes compute-sanitizer can get through (not a pytest file):

    compute-sanitizer --tool memcheck  python tools/sanitize_rms_norm.py
    compute-sanitizer --tool racecheck python tools/sanitize_rms_norm.py
    compute-sanitizer --tool synccheck python tools/sanitize_rms_norm.py
    compute-sanitizer --tool initcheck python tools/sanitize_rms_norm.py

Branches: fwd rows with ITERS 1..16 (prefetch on and off, residual in x's dtype and fp32, misaligned rows),
fwd wide (smem cache and L2 re-read), bwd rows (direct dW at one block, partial rows + column sum, prefetch with an
extra gradient), bwd wide (dW partial in smem and in global memory), fwd reg (warp per row, 4 packs with the weight
loaded with the row, clusters), fwd lean (N = 8192 from 1024 rows on sm_90). Values are checked loosely against the
reference so a wrong answer also fails here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    import kernels

    fm = kernels.get_local_kernel(ROOT)
    dev = "cuda"
    cases = [
        # (M, N, dtype, residual dtype or None, misaligned)
        (40000, 64, torch.bfloat16, None, False),  # ITERS 1, many rows per block, prefetch
        (9000, 1000, torch.bfloat16, None, False),  # ITERS 2 / 4
        (6000, 4096, torch.bfloat16, torch.bfloat16, False),  # ITERS 4, residual prefetch; bwd prefetch + extra
        (3000, 4096, torch.float32, torch.float32, False),
        (2000, 16384, torch.float16, torch.float32, False),  # ITERS 8, fp32 residual stream
        (400, 65536, torch.bfloat16, None, False),  # ITERS 16, 128 KB prefetch; bwd wide, global dW
        (300, 32768, torch.bfloat16, None, False),  # bwd rows ITERS 8 with 128 KB dW smem
        (150, 98304, torch.bfloat16, None, False),  # fwd wide with smem cache; bwd wide
        (40, 262144, torch.bfloat16, torch.float32, False),  # fwd wide, L2 re-read
        (8, 131072, torch.bfloat16, None, False),  # fwd reg: a cluster of 8 CTAs (DSMEM reduction)
        (3, 262144, torch.bfloat16, None, False),  # fwd reg: cluster of 8 at 512 threads per CTA
        (5000, 2048, torch.bfloat16, torch.bfloat16, False),  # fwd reg warp-per-row; bwd reg, several rows per CTA
        (3000, 4096, torch.bfloat16, None, False),  # fwd reg at 4 packs, the weight loaded with the row (sm_90)
        (1100, 2056, torch.float16, None, False),  # the same with a partial last pack round (257 packs)
        (1100, 8192, torch.bfloat16, torch.bfloat16, False),  # fwd lean (sm_90: 2 packs x 512 threads), residual
        (1030, 8192, torch.float16, None, False),  # fwd lean without a residual
        (1, 4096, torch.bfloat16, None, False),  # grid 1: direct dW
        (64, 4096, torch.bfloat16, None, False),  # small M: one row per SM, column sum
        (500, 4099, torch.bfloat16, torch.bfloat16, True),  # misaligned: per-element path everywhere
        (7, 65537, torch.float16, None, True),
    ]
    for m, n, dt, rd, misaligned in cases:
        g = torch.Generator(device=dev).manual_seed(m + n)
        x = torch.randn(m, n + (1 if misaligned else 0), device=dev, dtype=dt, generator=g)
        x = x[:, 1:] if misaligned else x
        w = (1 + 0.25 * torch.randn(n, device=dev, generator=g)).to(dt)
        res = torch.randn(m, n, device=dev, dtype=rd, generator=g) if rd is not None else None
        xr = x.detach().requires_grad_()
        wr = w.detach().requires_grad_()
        rr = res.detach().requires_grad_() if res is not None else None
        out = fm.rms_norm(xr, wr, 1e-6, residual=rr, residual_dtype=rd)
        y, h = out if rr is not None else (out, None)
        dy = torch.randn_like(y)
        if h is not None:
            torch.autograd.backward([y, h], [dy, torch.randn_like(h)])
        else:
            y.backward(dy)
        ref = fm.rms_norm_reference(x.float(), w.float(), 1e-6, residual=None if res is None else res.float(),
                                    residual_dtype=torch.float32)
        ref_y = ref[0] if res is not None else ref
        err = (y.float() - ref_y).abs().max().item()
        ok = err <= 0.05 * max(1.0, ref_y.abs().max().item()) and torch.isfinite(xr.grad).all() and torch.isfinite(
            wr.grad).all()
        torch.cuda.synchronize()
        print(f"M={m:6d} N={n:6d} {str(dt):15s} residual={rd} misaligned={misaligned}: max|y-ref|={err:.3g} "
              f"{'ok' if ok else 'WRONG'}")
        if not ok:
            return 1
    print("all branches ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
