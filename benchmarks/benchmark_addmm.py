"""`kernels benchmark` workloads for fused-mlp's ``addmm`` (bias and GeLU applied to the fp32 accumulator in the GEMM
epilogue) and ``linear`` (``nn.Linear``'s ``[out, in]`` weight), at real model sizes, bf16.

    kernels benchmark .            # from the checkout (loads build/ through kernels.get_local_kernel)

Verified against fp32 math rounded once to bf16 (the CLI uses ``allclose(atol=1e-2)``; inputs are drawn so that
``|out| < 2``). A workload whose op is not in the loaded kernel yet is reported as skipped. Without a GPU the
workloads run on the CPU with fewer rows.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from kernels.benchmark import Benchmark

DTYPE = torch.bfloat16


def _device(requested: str) -> str:
    return requested if requested != "cuda" or torch.cuda.is_available() else "cpu"


def _rows(device: str, gpu_rows: int) -> int:
    return gpu_rows if device != "cpu" else min(gpu_rows, 256)


def _skip_if_missing(bench: Benchmark, workload: str, obj: object, *names: str) -> bool:
    missing = [n for n in names if not hasattr(obj, n)]
    if not missing:
        return False
    print(f"  {type(bench).__name__}.{workload}: SKIPPED, the loaded kernel has no {', '.join(missing)} yet",
          file=sys.stderr)
    setattr(bench, f"benchmark_{workload}", lambda: None)
    setattr(bench, f"verify_{workload}", None)
    return True


class AddmmBenchmark(Benchmark):
    """``act(bias + mat1 @ mat2)``: mat2 ``[K, N]`` (GPT-2 Conv1D layout)."""

    seed: int = 0

    def _make(self, workload: str, m: int, k: int, n: int) -> None:
        self.dev = _device(self.device)
        self.out = None
        if _skip_if_missing(self, workload, self.kernel, "addmm"):
            return
        m = _rows(self.dev, m)
        self.a = 0.2 * torch.randn(m, k, device=self.dev, dtype=DTYPE)
        self.b = (torch.randn(k, n, device=self.dev) / k**0.5).to(DTYPE)
        self.bias = 0.1 * torch.randn(n, device=self.dev, dtype=DTYPE)

    def _pre(self) -> torch.Tensor:
        return self.bias.float() + self.a.float() @ self.b.float()

    def setup_gelu_tanh_4096x4096x4096(self) -> None:
        self._make("gelu_tanh_4096x4096x4096", 4096, 4096, 4096)

    def benchmark_gelu_tanh_4096x4096x4096(self) -> None:
        self.out = self.kernel.addmm(self.bias, self.a, self.b, activation="gelu_tanh")

    def verify_gelu_tanh_4096x4096x4096(self) -> torch.Tensor:
        return F.gelu(self._pre(), approximate="tanh").to(DTYPE)

    def setup_bias_8192x2048x8192(self) -> None:
        self._make("bias_8192x2048x8192", 8192, 2048, 8192)

    def benchmark_bias_8192x2048x8192(self) -> None:
        self.out = self.kernel.addmm(self.bias, self.a, self.b)

    def verify_bias_8192x2048x8192(self) -> torch.Tensor:
        return self._pre().to(DTYPE)

    def setup_gelu_decode_16x4096x4096(self) -> None:
        self._make("gelu_decode_16x4096x4096", 16, 4096, 4096)

    def benchmark_gelu_decode_16x4096x4096(self) -> None:
        self.out = self.kernel.addmm(self.bias, self.a, self.b, activation="gelu_tanh")

    def verify_gelu_decode_16x4096x4096(self) -> torch.Tensor:
        return F.gelu(self._pre(), approximate="tanh").to(DTYPE)


class LinearBenchmark(Benchmark):
    """``input @ weight.T + bias`` with ``weight`` ``[out, in]`` (nn.Linear), forward and forward + backward."""

    seed: int = 0

    def _make(self, workload: str, m: int, k: int, n: int, *, grad: bool = False) -> None:
        self.dev = _device(self.device)
        self.out = None
        if _skip_if_missing(self, workload, self.kernel, "linear"):
            return
        m = _rows(self.dev, m)
        self.x = (0.2 * torch.randn(m, k, device=self.dev, dtype=DTYPE)).requires_grad_(grad)
        self.w = (torch.randn(n, k, device=self.dev) / k**0.5).to(DTYPE).requires_grad_(grad)
        self.bias = (0.1 * torch.randn(n, device=self.dev, dtype=DTYPE)).requires_grad_(grad)
        self.dy = 0.1 * torch.randn(m, n, device=self.dev, dtype=DTYPE)

    # Llama-3-8B down_proj shape: [8192 tokens, 14336] -> 4096.
    def setup_fwd_8192x14336x4096(self) -> None:
        self._make("fwd_8192x14336x4096", 8192, 14336, 4096)

    def benchmark_fwd_8192x14336x4096(self) -> None:
        self.out = self.kernel.linear(self.x, self.w, self.bias)

    def verify_fwd_8192x14336x4096(self) -> torch.Tensor:
        return (self.x.float() @ self.w.float().t() + self.bias.float()).to(DTYPE)

    # Training step of a 4096 -> 4096 projection; out is dX (dW and dbias are checked in verify).
    def setup_fwdbwd_8192x4096x4096(self) -> None:
        self._make("fwdbwd_8192x4096x4096", 8192, 4096, 4096, grad=True)

    def benchmark_fwdbwd_8192x4096x4096(self) -> None:
        self.x.grad = self.w.grad = self.bias.grad = None
        self.kernel.linear(self.x, self.w, self.bias).backward(self.dy)
        self.out = self.x.grad

    def verify_fwdbwd_8192x4096x4096(self) -> torch.Tensor:
        dy = self.dy.float()
        dw = dy.t() @ self.x.detach().float()
        db = dy.sum(0)
        for name, got, ref in (("dW", self.w.grad, dw), ("dbias", self.bias.grad, db)):
            tol = 1e-2 * max(1.0, ref.abs().max().item())
            err = (got.float() - ref).abs().max().item()
            if err > tol:
                raise RuntimeError(f"linear backward: {name} max error {err:.3g} > {tol:.3g}")
        return (dy @ self.w.detach().float()).to(DTYPE)


if __name__ == "__main__":
    print("run with: kernels benchmark <checkout>   (this file is discovered by the kernels CLI)", file=sys.stderr)
