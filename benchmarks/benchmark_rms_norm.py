"""`kernels benchmark` workloads for fused-mlp's RMSNorm: Llama/Qwen style, Gemma's ``(1 + w)``, the fused residual
add, decode-sized batches and the backward pass, at real model hidden sizes, bf16.

    kernels benchmark .            # from the checkout (loads build/ through kernels.get_local_kernel)

Each workload is verified against a plain-PyTorch fp32 computation rounded once to bf16. The CLI compares with
``torch.allclose(out, ref, atol=1e-2)``; the weights are drawn so that ``|y| < 2``, where one bf16 ulp (0.0078) is
below that tolerance (a correctly rounded result may differ from the reference by one ulp where the fp32 value
sits on a rounding boundary). The full error study (2x rule vs PyTorch) is in the tests and in ``sweep.py``.
On a machine without a GPU the workloads run on the CPU with fewer tokens (same hidden sizes).
"""

from __future__ import annotations

import sys

import torch
from kernels.benchmark import Benchmark

EPS = 1e-6
DTYPE = torch.bfloat16


def _device(requested: str) -> str:
    """The CLI picks the device from the installed torch (a CUDA build says "cuda" even without a GPU)."""
    return requested if requested != "cuda" or torch.cuda.is_available() else "cpu"


def _tokens(device: str, gpu_tokens: int) -> int:
    return gpu_tokens if device != "cpu" else min(gpu_tokens, 1024)


def _reference(h: torch.Tensor, w: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS) * (offset + w.float())
    return y.to(h.dtype)


class RMSNormBenchmark(Benchmark):
    seed: int = 0

    def _make(self, tokens: int, hidden: int, *, gemma: bool = False) -> None:
        self.dev = _device(self.device)
        m = _tokens(self.dev, tokens)
        self.x = torch.randn(m, hidden, device=self.dev, dtype=DTYPE)
        # |y| < 2 (see the module docstring): Llama-style w in [0.25, 0.3]; Gemma's (1 + w) in the same range.
        w = 0.25 + 0.05 * torch.rand(hidden, device=self.dev)
        self.offset = 1.0 if gemma else 0.0
        self.w = (w - self.offset).to(DTYPE)
        self.out = None

    # Llama-3-8B / Qwen3-8B hidden size, a 8192-token prefill.
    def setup_llama_8192x4096(self) -> None:
        self._make(8192, 4096)

    def benchmark_llama_8192x4096(self) -> None:
        self.out = self.kernel.rms_norm(self.x, self.w, EPS)

    def verify_llama_8192x4096(self) -> torch.Tensor:
        return _reference(self.x, self.w)

    # Llama-3-70B hidden size.
    def setup_llama_4096x8192(self) -> None:
        self._make(4096, 8192)

    def benchmark_llama_4096x8192(self) -> None:
        self.out = self.kernel.rms_norm(self.x, self.w, EPS)

    def verify_llama_4096x8192(self) -> torch.Tensor:
        return _reference(self.x, self.w)

    # Decode: 64 sequences, one token each (latency-bound; includes the Python call).
    def setup_decode_64x4096(self) -> None:
        self._make(64, 4096)

    def benchmark_decode_64x4096(self) -> None:
        self.out = self.kernel.rms_norm(self.x, self.w, EPS)

    def verify_decode_64x4096(self) -> torch.Tensor:
        return _reference(self.x, self.w)

    # Gemma-2B (hidden 2048), (1 + w).
    def setup_gemma_8192x2048(self) -> None:
        self._make(8192, 2048, gemma=True)

    def benchmark_gemma_8192x2048(self) -> None:
        self.out = self.kernel.rms_norm(self.x, self.w, EPS, offset=1.0)

    def verify_gemma_8192x2048(self) -> torch.Tensor:
        return _reference(self.x, self.w, offset=1.0)

    # Gemma-2 2B (hidden 2304), (1 + w): a hidden size that is not a power of two.
    def setup_gemma_8192x2304(self) -> None:
        self._make(8192, 2304, gemma=True)

    def benchmark_gemma_8192x2304(self) -> None:
        self.out = self.kernel.rms_norm(self.x, self.w, EPS, offset=1.0)

    def verify_gemma_8192x2304(self) -> torch.Tensor:
        return _reference(self.x, self.w, offset=1.0)


class FusedAddRMSNormBenchmark(Benchmark):
    """``h = x + residual`` then RMSNorm of ``h``, one kernel: returns ``(y, h)``; ``out`` is ``y``, ``h`` is checked
    exactly in verify."""

    seed: int = 0

    def _make(self, tokens: int, hidden: int) -> None:
        self.dev = _device(self.device)
        m = _tokens(self.dev, tokens)
        self.x = torch.randn(m, hidden, device=self.dev, dtype=DTYPE)
        self.r = torch.randn(m, hidden, device=self.dev, dtype=DTYPE)
        self.w = (0.25 + 0.05 * torch.rand(hidden, device=self.dev)).to(DTYPE)
        self.out = None
        self.h = None

    def _run(self) -> None:
        self.out, self.h = self.kernel.rms_norm(self.x, self.w, EPS, residual=self.r)

    def _verify(self) -> torch.Tensor:
        h_ref = self.x + self.r  # bf16 add: the exact sum rounded once, as the kernel does
        if not torch.equal(self.h, h_ref):
            raise RuntimeError("fused add + RMSNorm: the residual output h differs from x + residual")
        return _reference(h_ref, self.w)

    # Gemma-3-27B hidden size.
    def setup_gemma3_4096x5376(self) -> None:
        self._make(4096, 5376)

    def benchmark_gemma3_4096x5376(self) -> None:
        self._run()

    def verify_gemma3_4096x5376(self) -> torch.Tensor:
        return self._verify()

    # Llama-3-8B hidden size.
    def setup_llama_8192x4096(self) -> None:
        self._make(8192, 4096)

    def benchmark_llama_8192x4096(self) -> None:
        self._run()

    def verify_llama_8192x4096(self) -> torch.Tensor:
        return self._verify()


class RMSNormBackwardBenchmark(Benchmark):
    """Forward + backward (dx and dW); ``out`` is dx."""

    seed: int = 0

    def _make(self, tokens: int, hidden: int) -> None:
        self.dev = _device(self.device)
        m = _tokens(self.dev, tokens)
        self.x = torch.randn(m, hidden, device=self.dev, dtype=DTYPE).requires_grad_(True)
        self.w = (0.25 + 0.05 * torch.rand(hidden, device=self.dev)).to(DTYPE).requires_grad_(True)
        self.dy = torch.randn(m, hidden, device=self.dev, dtype=DTYPE)
        self.out = None

    def _run(self) -> None:
        self.x.grad = None
        self.w.grad = None
        self.kernel.rms_norm(self.x, self.w, EPS).backward(self.dy)
        self.out = self.x.grad

    def _verify(self) -> torch.Tensor:
        x32 = self.x.detach().float().requires_grad_(True)
        w32 = self.w.detach().float().requires_grad_(True)
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS) * w32
        y.backward(self.dy.float())
        # dW is a sum over all rows: compare it relative to its size (the CLI only compares dx).
        dw_err = (self.w.grad.float() - w32.grad).abs().max().item()
        dw_tol = 1e-2 * max(1.0, w32.grad.abs().max().item())
        if dw_err > dw_tol:
            raise RuntimeError(f"RMSNorm backward: dW max error {dw_err:.3g} > {dw_tol:.3g}")
        return x32.grad.to(DTYPE)

    def setup_bwd_8192x4096(self) -> None:
        self._make(8192, 4096)

    def benchmark_bwd_8192x4096(self) -> None:
        self._run()

    def verify_bwd_8192x4096(self) -> torch.Tensor:
        return self._verify()

    def setup_bwd_decode_64x4096(self) -> None:
        self._make(64, 4096)

    def benchmark_bwd_decode_64x4096(self) -> None:
        self._run()

    def verify_bwd_decode_64x4096(self) -> torch.Tensor:
        return self._verify()


if __name__ == "__main__":
    print("run with: kernels benchmark <checkout>   (this file is discovered by the kernels CLI)", file=sys.stderr)
