#!/usr/bin/env python3
"""DTensor inputs to the layers (tensor / sequence parallel), 2 processes (gloo on CPU, NCCL with two GPUs).

Launched by tests/models/test_distributed.py:   torchrun --nproc_per_node 2 tests/scripts/dtensor_check.py --out result.json
For RMSNorm: rows sharded (batch or sequence dim) or replicated -> the fused kernel on the local rows, with the
replicated weight's gradient declared partial; hidden dim sharded -> the module's own math (warned once).
For Linear with a sharded DTensor weight -> nn.Linear's own forward (warned once). Outputs and gradients are
compared with the same computation on full tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path
from types import MethodType

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


class Norm(nn.Module):
    """LlamaRMSNorm's math (the module whose forward the layer replaces)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.variance_epsilon = 1e-6

    def forward(self, hidden_states):
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(hidden_states.dtype)


def main() -> int:
    import kernels
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    device = f"cuda:{rank}" if use_cuda else "cpu"
    if use_cuda:
        torch.cuda.set_device(rank)
    mesh = init_device_mesh("cuda" if use_cuda else "cpu", (dist.get_world_size(),))
    fm = kernels.get_local_kernel(ROOT)
    torch.manual_seed(0)
    x = torch.randn(4, 6, 64, device=device)
    w = torch.rand(64, device=device) + 0.5
    g = torch.randn(4, 6, 64, device=device)
    results = {}

    # Reference on full tensors.
    xr = x.clone().requires_grad_()
    ref_mod = Norm(w.clone())
    yr = ref_mod(xr)
    (yr * g).sum().backward()
    wr_grad = ref_mod.weight.grad

    for name, placement in [("shard_batch", Shard(0)), ("shard_seq", Shard(1)), ("replicate", Replicate()),
                            ("shard_hidden", Shard(2))]:
        mod = Norm(torch.empty(64, device=device))
        mod.weight = nn.Parameter(distribute_tensor(w.clone(), mesh, [Replicate()]))
        mod.forward = MethodType(fm.layers.RMSNorm.forward, mod)  # what kernelize does
        xd = distribute_tensor(x.clone(), mesh, [placement]).requires_grad_()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y = mod(xd)
        y_full = y.full_tensor()
        (y_full * g).sum().backward()
        results[name] = {
            "is_dtensor": type(y).__name__ == "DTensor",
            "placements_kept": str(y.placements) == str(xd.placements),
            "y_err": (y_full - yr).abs().max().item(),
            "dx_err": (xd.grad.full_tensor() - xr.grad).abs().max().item(),
            "dw_err": (mod.weight.grad.full_tensor() - wr_grad).abs().max().item(),
            "warned": any("own PyTorch forward" in str(c.message) for c in caught),
        }

    # Linear with a column-sharded weight: nn.Linear's own forward on DTensors.
    lin = nn.Linear(64, 32, device=device)
    ref = lin(x)
    lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach().clone(), mesh, [Shard(0)]))
    lin.bias = nn.Parameter(distribute_tensor(lin.bias.detach().clone(), mesh, [Shard(0)]))
    lin.forward = MethodType(fm.layers.Linear.forward, lin)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = lin(distribute_tensor(x, mesh, [Replicate()]))
    results["linear_colwise"] = {
        "y_err": (y.full_tensor() - ref).abs().max().item(),
        "warned": any("own PyTorch forward" in str(c.message) for c in caught),
    }
    from distributed_train import finish  # this script's folder is first on sys.path

    return finish({"device": device.split(":")[0], "results": results} if rank == 0 else None, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
