#!/usr/bin/env python3
"""transformers tensor parallel (`tp_plan="auto"`) with the kernelized layers, 2 processes (gloo on CPU, NCCL with
two GPUs). Launched by tests/models/test_distributed.py:
    torchrun --nproc_per_node 2 tests/scripts/tp_check.py --model-dir DIR --out result.json
Rank 0 saves a tiny random Llama to DIR (no network), every rank loads it with tp_plan="auto", kernelizes it
(RMSNorm and the SwiGLU MLP mapped to this checkout) and compares logits with the unsharded model. What the layers
see under transformers' TP: plain norm weights with plain (local) activations -> the fused RMSNorm runs; DTensor
MLP weights -> GeGLUMLP runs the module's own math, announced once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def main() -> int:
    import transformers as tf
    from kernels import LocalLayerRepository, Mode, kernelize, replace_kernel_forward_from_hub, use_kernel_mapping
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.models.llama.modeling_llama import LlamaMLP

    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    device = "cuda" if use_cuda else "cpu"
    if use_cuda:
        torch.cuda.set_device(rank)
    if rank == 0:
        cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        torch.manual_seed(0)
        tf.LlamaForCausalLM(cfg).save_pretrained(args.model_dir)
    dist.barrier()
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    model = tf.LlamaForCausalLM.from_pretrained(args.model_dir, tp_plan="auto", device_mesh=mesh)
    ref = tf.LlamaForCausalLM.from_pretrained(args.model_dir).to(device)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)

    logging.getLogger("kernels").setLevel(logging.ERROR)
    replace_kernel_forward_from_hub(LlamaMLP, "GeGLUMLP")
    mapping = {n: {device: LocalLayerRepository(repo_path=ROOT, layer_name=n)} for n in ("RMSNorm", "GeGLUMLP")}
    with use_kernel_mapping(mapping, inherit_mapping=False):
        model = kernelize(model, mode=Mode.INFERENCE, device=device)
    replaced = sorted({type(m).__name__ for m in model.modules() if "forward" in vars(m)})
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        out = model(input_ids=ids).logits
        expected = ref(input_ids=ids).logits
    if hasattr(out, "full_tensor"):
        out = out.full_tensor()
    norm = model.model.layers[0].input_layernorm
    result = {
        "device": device,
        "max_err": (out - expected).abs().max().item(),
        "replaced": replaced,
        "norm_weight_type": type(norm.weight).__name__,
        "mlp_weight_type": type(model.model.layers[0].mlp.gate_proj.weight).__name__,
        "warnings": sorted({str(w.message) for w in caught if "fused_mlp" in str(w.message)}),
    }
    from distributed_train import finish  # this script's folder is first on sys.path

    return finish(result if rank == 0 else None, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
