"""`kernels benchmark` workloads for fused-mlp's gated activations (GeGLU with tanh and exact GeLU, SwiGLU) and the
``GeGLUMLP`` layer, at real model sizes, bf16.

    kernels benchmark .            # from the checkout (loads build/ through kernels.get_local_kernel)

Verified against plain-PyTorch fp32 math rounded once to bf16 (the CLI uses ``allclose(atol=1e-2)``: ``up`` is
drawn small so that ``|out| < 2``, where one bf16 ulp is below that tolerance). A workload whose op is not in the
loaded kernel yet is reported as skipped (its timing is a no-op and it has no check). Without a GPU the workloads
run on the CPU with fewer tokens.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F
from kernels.benchmark import Benchmark
from torch import nn

DTYPE = torch.bfloat16


def _device(requested: str) -> str:
    return requested if requested != "cuda" or torch.cuda.is_available() else "cpu"


def _tokens(device: str, gpu_tokens: int, cpu_tokens: int) -> int:
    return gpu_tokens if device != "cpu" else min(gpu_tokens, cpu_tokens)


def _skip_if_missing(bench: Benchmark, workload: str, obj: object, *names: str) -> bool:
    """True (and the workload turned into a visible no-op) when the loaded kernel lacks one of ``names``."""
    missing = [n for n in names if not hasattr(obj, n)]
    if not missing:
        return False
    print(f"  {type(bench).__name__}.{workload}: SKIPPED, the loaded kernel has no {', '.join(missing)} yet",
          file=sys.stderr)
    setattr(bench, f"benchmark_{workload}", lambda: None)
    setattr(bench, f"verify_{workload}", None)
    return True


class GatedActivationBenchmark(Benchmark):
    seed: int = 0

    def _make(self, workload: str, op: str, tokens: int, inter: int) -> None:
        self.dev = _device(self.device)
        self.out = None
        if _skip_if_missing(self, workload, self.kernel, op):
            return
        t = _tokens(self.dev, tokens, 256)
        self.gate = torch.randn(t, inter, device=self.dev, dtype=DTYPE)
        self.up = 0.05 * torch.randn(t, inter, device=self.dev, dtype=DTYPE)

    def _ref(self, act) -> torch.Tensor:
        return (act(self.gate.float()) * self.up.float()).to(DTYPE)

    # Gemma-2B: I = 16384, tanh-GeLU.
    def setup_geglu_tanh_4096x16384(self) -> None:
        self._make("geglu_tanh_4096x16384", "geglu", 4096, 16384)

    def benchmark_geglu_tanh_4096x16384(self) -> None:
        self.out = self.kernel.geglu(self.gate, self.up, approximate="tanh")

    def verify_geglu_tanh_4096x16384(self) -> torch.Tensor:
        return self._ref(lambda g: F.gelu(g, approximate="tanh"))

    # Exact (erf) GeLU at Gemma-2 2B's I = 9216.
    def setup_geglu_erf_8192x9216(self) -> None:
        self._make("geglu_erf_8192x9216", "geglu", 8192, 9216)

    def benchmark_geglu_erf_8192x9216(self) -> None:
        self.out = self.kernel.geglu(self.gate, self.up, approximate="none")

    def verify_geglu_erf_8192x9216(self) -> torch.Tensor:
        return self._ref(F.gelu)

    # Llama-3-8B: I = 14336, SiLU.
    def setup_swiglu_4096x14336(self) -> None:
        self._make("swiglu_4096x14336", "swiglu", 4096, 14336)

    def benchmark_swiglu_4096x14336(self) -> None:
        self.out = self.kernel.swiglu(self.gate, self.up)

    def verify_swiglu_4096x14336(self) -> torch.Tensor:
        return self._ref(F.silu)


class _GemmaStyleMLP(nn.Module):
    """The attributes GeGLUMLP reads (gate_proj, up_proj, down_proj, act_fn), as transformers' GemmaMLP has them."""

    def __init__(self, hidden: int, inter: int, act_fn: nn.Module) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _tanh_gelu_module() -> nn.Module:
    """transformers' tanh-GeLU class when transformers is installed (what Gemma uses), else nn.GELU('tanh')."""
    try:
        from transformers.activations import ACT2FN

        return ACT2FN["gelu_pytorch_tanh"]
    except Exception:  # noqa: BLE001 - transformers is optional for this script
        return nn.GELU(approximate="tanh")


class GeGLUMLPBenchmark(Benchmark):
    """The ``GeGLUMLP`` kernelize layer's forward on a Gemma-shaped MLP (three GEMMs + the fused activation)."""

    seed: int = 0

    def _make(self, workload: str, tokens: int, hidden: int, inter: int) -> None:
        self.dev = _device(self.device)
        self.out = None
        if _skip_if_missing(self, workload, getattr(self.kernel, "layers", None), "GeGLUMLP"):
            return
        t = _tokens(self.dev, tokens, 64)
        self.mlp = _GemmaStyleMLP(hidden, inter, _tanh_gelu_module()).to(self.dev, DTYPE)
        self.fwd = types.MethodType(self.kernel.layers.GeGLUMLP.forward, self.mlp)  # what kernelize installs
        self.x = 0.5 * torch.randn(t, hidden, device=self.dev, dtype=DTYPE)

    def _ref(self) -> torch.Tensor:
        m = self.mlp
        x = self.x.float()
        g = F.gelu(x @ m.gate_proj.weight.float().t(), approximate="tanh")
        return ((g * (x @ m.up_proj.weight.float().t())) @ m.down_proj.weight.float().t()).to(DTYPE)

    # Gemma-2B MLP, a 4096-token prefill.
    def setup_gemma2b_mlp_4096(self) -> None:
        self._make("gemma2b_mlp_4096", 4096, 2048, 16384)

    def benchmark_gemma2b_mlp_4096(self) -> None:
        with torch.no_grad():
            self.out = self.fwd(self.x)

    def verify_gemma2b_mlp_4096(self) -> torch.Tensor:
        return self._ref()

    # Same weights, decode (16 tokens).
    def setup_gemma2b_mlp_16(self) -> None:
        self._make("gemma2b_mlp_16", 16, 2048, 16384)

    def benchmark_gemma2b_mlp_16(self) -> None:
        with torch.no_grad():
            self.out = self.fwd(self.x)

    def verify_gemma2b_mlp_16(self) -> torch.Tensor:
        return self._ref()


if __name__ == "__main__":
    print("run with: kernels benchmark <checkout>   (this file is discovered by the kernels CLI)", file=sys.stderr)
