#!/usr/bin/env python3
"""Prefill attention under torch.compile vs eager, in isolation: ``F.scaled_dot_product_attention`` (causal, bf16) at
the e2e stacks' shapes, with cuDNN's SDPA backend on and off (``torch.backends.cuda.enable_cudnn_sdp``), and the
kernel each runs (profiler). Evidence for docs/using-with-transformers.md ("Generation and torch.compile").

    python benchmarks/sdpa_compile.py          # CUDA only; prints median us per call (5 do_bench runs)
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

# (batch, query heads, kv heads, tokens, head dim): Gemma-2B 2 x 2048 and 1 x 4096, Llama-3.2-1B 2 x 2048
SHAPES = ((2, 8, 1, 2048, 256), (1, 8, 1, 4096, 256), (2, 32, 8, 2048, 64))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def main() -> int:
    if not torch.cuda.is_available():
        print("sdpa_compile.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from torch.profiler import ProfilerActivity, profile
    from triton.testing import do_bench

    torch.manual_seed(0)
    dt = torch.bfloat16
    for b, hq, hkv, s, d in SHAPES:
        q = torch.randn(b, hq, s, d, device="cuda", dtype=dt)
        k = torch.randn(b, hkv, s, d, device="cuda", dtype=dt).repeat_interleave(hq // hkv, 1)
        v = torch.randn(b, hkv, s, d, device="cuda", dtype=dt).repeat_interleave(hq // hkv, 1)
        for cudnn in (True, False):
            torch.backends.cuda.enable_cudnn_sdp(cudnn)
            torch._dynamo.reset()
            compiled = torch.compile(attention)
            for label, fn in (("eager", lambda: attention(q, k, v)), ("compiled", lambda: compiled(q, k, v))):
                t = sorted(do_bench(fn, warmup=10, rep=50) for _ in range(5))[2]
                with profile(activities=[ProfilerActivity.CUDA]) as p:
                    fn()
                    torch.cuda.synchronize()
                kern = max(p.key_averages(), key=lambda e: e.self_device_time_total).key[:70]
                print(f"B{b} H{hq}/{hkv} S{s} D{d} cudnn={cudnn!s:5} {label:8s} {t * 1e3:8.1f} us  {kern}")
        torch.backends.cuda.enable_cudnn_sdp(True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
