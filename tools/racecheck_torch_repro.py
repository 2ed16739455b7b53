#!/usr/bin/env python3
"""The addmm section of tools/sanitize_cases.py with plain PyTorch only: no fused-mlp code is imported.

    compute-sanitizer --tool racecheck --kernel-name kns=fused_mlp python3 tools/racecheck_torch_repro.py [start]

On the H200 machine (driver of 2026-11, CUDA 13.0, torch 2.11) racecheck ends in "Internal Sanitizer Error: The
Sanitizer failed to handle a hardware exception" at the first case (F.linear, bf16, m=1 k=64 n=64, bias), and, started
at shape index 1, at m=64 k=256 n=512 bf16 with bias -- exactly where the fused-mlp addmm / addmm_no_lt sections
stopped. tools/sanitize.sh runs this first and reports the addmm racecheck sections as a tool limitation when it
fails the same way (docs/releasing.md). Prints a `case:` line before every case, like sanitize_cases.py.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

SHAPES = [(1, 64, 64), (7, 100, 33), (64, 256, 512), (300, 512, 1000)]


def main(argv: list[str]) -> int:
    start = int(argv[0]) if argv else 0
    dev = "cuda"
    for (m, k, n) in SHAPES[start:]:
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            for act in (None, "tanh", "none"):
                for with_bias in (True, False):
                    print(f"case: torch m={m} k={k} n={n} {dt} gelu={act} bias={with_bias}", flush=True)
                    a = torch.randn(m, k, device=dev, dtype=dt, requires_grad=True)
                    w = (torch.randn(n, k, device=dev, dtype=dt) / k**0.5).requires_grad_(True)
                    b = torch.randn(n, device=dev, dtype=dt, requires_grad=True) if with_bias else None
                    y = F.linear(a, w, b)
                    if act is not None:
                        y = F.gelu(y, approximate=act)
                    y.float().sum().backward()
                    torch.cuda.synchronize()
    print("torch repro cases done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
