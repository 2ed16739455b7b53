#!/usr/bin/env python3
"""Train a tiny Gemma-shaped model for a few steps under DDP or FSDP2, kernelized and not, and compare.

Launched by tests/models/test_distributed.py through torchrun (2 processes; gloo on CPU, NCCL on GPUs):
    torchrun --nproc_per_node 2 tests/scripts/distributed_train.py --engine ddp --out result.json
Both runs start from the same weights and see the same data; rank 0 writes the per-step losses and the largest
difference of the final weights to --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# NVLink multicast stays off on shared multi-GPU hosts.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")


# The tiny Gemma shape these tests train (GemmaConfig keyword arguments); benchmarks/scale.py overrides it.
TINY_CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=1, head_dim=16)


def make_model(device: torch.device, config: dict | None = None, *, init_device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None):
    """A GemmaForCausalLM (tanh-GeLU, sdpa) with seed-0 random weights and non-zero norm weights (Gemma
    initialises them to 0, which would hide the `1 + w` term). `config` overrides TINY_CONFIG; `init_device`
    is where the weights are initialised (the device itself for large models: the same seed gives the same
    weights in every process of one GPU type); `dtype` casts the parameters."""
    import transformers as tf

    cfg = tf.GemmaConfig(**{**TINY_CONFIG, **(config or {})}, hidden_activation="gelu_pytorch_tanh",
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(init_device):
        model = tf.GemmaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.1)
    return model.to(device) if dtype is None else model.to(device, dtype)


def kernelize_model(model, device: torch.device):
    import logging

    from kernels import LocalLayerRepository, Mode, kernelize, replace_kernel_forward_from_hub, use_kernel_mapping
    from transformers.models.gemma.modeling_gemma import GemmaMLP, GemmaRMSNorm

    logging.getLogger("kernels").setLevel(logging.ERROR)
    replace_kernel_forward_from_hub(GemmaRMSNorm, "GemmaRMSNorm")
    replace_kernel_forward_from_hub(GemmaMLP, "GeGLUMLP")
    mapping = {n: {device.type: LocalLayerRepository(repo_path=ROOT, layer_name=n)} for n in ("GemmaRMSNorm", "GeGLUMLP")}
    with use_kernel_mapping(mapping, inherit_mapping=False):
        return kernelize(model, mode=Mode.TRAINING, device=device.type)


def wrap(model, engine: str, device: torch.device):
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def train(model, engine: str, device: torch.device, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    wrapped = wrap(model, engine, device)
    # SGD: weight differences stay proportional to gradient differences (Adam can amplify rounding-level ones).
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.5)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own batch, same across runs
        ids = torch.randint(0, 256, (2, 32), generator=g).to(device)
        opt.zero_grad(set_to_none=True)
        loss = wrapped(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    state = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):  # FSDP2 DTensor shard -> the full parameter
            t = t.full_tensor()
        state[name] = t.float().cpu()
    return losses, state


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["ddp", "fsdp2"], required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("WORLD_SIZE", "1"))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    base = make_model(device)
    eager_losses, eager_state = train(copy.deepcopy(base), args.engine, device, args.steps)
    fused_losses, fused_state = train(kernelize_model(copy.deepcopy(base), device), args.engine, device, args.steps)
    result = None
    if rank == 0:
        max_w = max((eager_state[n] - fused_state[n]).abs().max().item() for n in eager_state)
        result = {"engine": args.engine, "device": device.type, "world": dist.get_world_size(),
                  "eager_losses": eager_losses, "fused_losses": fused_losses, "max_weight_diff": max_w,
                  "max_weight": max(v.abs().max().item() for v in eager_state.values())}
    return finish(result, args.out)


def finish(result: dict | None, out: Path) -> NoReturn:
    """The end of every torchrun check script here: rank 0 (the one passing a result) writes it to `out` as JSON
    and prints it; every rank leaves the process group."""
    if result is not None:
        out.write_text(json.dumps(result, indent=1))
        print(json.dumps(result))
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: there a gloo rank sometimes aborted after its result was written
    # ("terminate called without an active exception", SIGABRT from a thread torch still held; 2 of 18 CPU runs).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
