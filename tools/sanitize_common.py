"""Shared pieces of the compute-sanitizer drivers (tools/sanitize.sh): the activations' fp32 references, a GEMM-free
fp32 matmul for references and the frame of an sm_90-only driver."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
ACT = {"gelu_tanh": lambda g: F.gelu(g, approximate="tanh"), "gelu": F.gelu, "silu": F.silu}


def mm32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T in fp32 by broadcasting, not a GEMM library call: racecheck cannot run cuBLAS's Hopper GEMMs
    (docs/releasing.md#compute-sanitizer)."""
    return (x.float().unsqueeze(1) * w.float().unsqueeze(0)).sum(2)


def run_sm90_driver(cases: Callable[[object, list[str]], None]) -> int:
    """Skips (exit 0, says so) on a GPU other than sm_90; else runs ``cases(fm, bad)``, which appends a line to
    ``bad`` for every result that disagrees with its reference, prints them and exits non-zero if there is any (so a
    kernel that computes nothing fails too)."""
    import kernels

    if torch.cuda.get_device_capability() != (9, 0):
        print("done: skipped (not an sm_90 GPU)")
        return 0
    bad: list[str] = []
    cases(kernels.get_local_kernel(ROOT), bad)
    torch.cuda.synchronize()
    for line in bad:
        print("mismatch:", line)
    print("done" if not bad else f"done with {len(bad)} mismatches", flush=True)
    return 1 if bad else 0
