"""A kernelized Gemma-shaped model trains the same as the unkernelized one under DDP and FSDP2 (2 processes via
torchrun: gloo on CPU in CI, NCCL when two GPUs are present)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT

SCRIPT = ROOT / "tests" / "scripts" / "distributed_train.py"


def launch_env() -> dict[str, str]:
    """torchrun's environment: NVLink multicast off (shared multi-GPU hosts); with fewer than two GPUs the two
    processes run on the CPU (gloo) and see no GPU at all (torch.distributed would otherwise bind rank 1 to a GPU
    that does not exist)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}
    if torch.cuda.device_count() < 2:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run_torchrun(engine: str, tmp_path) -> dict:
    out = tmp_path / f"{engine}.json"
    env = launch_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT),
           "--engine", engine, "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_kernelized_training_matches_under(engine, tmp_path):
    result = run_torchrun(engine, tmp_path)
    expected_device = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
    assert result["device"] == expected_device and result["world"] == 2
    eager, fused = result["eager_losses"], result["fused_losses"]
    assert len(eager) == len(fused) >= 3
    # The loss must actually move (the test would be vacuous on a frozen model) ...
    assert abs(eager[-1] - eager[0]) > 1e-3
    # ... and the kernelized run must follow the same curve and end at the same weights (fp32).
    for step, (a, b) in enumerate(zip(eager, fused)):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), f"step {step}: eager loss {a} vs kernelized {b}"
    assert result["max_weight_diff"] <= 1e-4 * max(1.0, result["max_weight"])


def test_dtensor_inputs_tensor_and_sequence_parallel(tmp_path):
    """RMSNorm on DTensors: rows sharded (batch or sequence dim) or replicated run the fused kernel on the local
    rows, keep the placements and give the full-tensor gradients (weight gradient declared partial); a sharded
    hidden dim and a sharded Linear weight run the module's own math, announced with a warning."""
    out = tmp_path / "dtensor.json"
    env = launch_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "scripts" / "dtensor_check.py"), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    res = json.loads(out.read_text())["results"]
    for name in ("shard_batch", "shard_seq", "replicate", "shard_hidden"):
        r = res[name]
        assert r["is_dtensor"] and r["placements_kept"], name
        assert max(r["y_err"], r["dx_err"], r["dw_err"]) < 1e-5, (name, r)
        assert r["warned"] == (name == "shard_hidden"), (name, r)
    assert res["linear_colwise"]["y_err"] < 1e-5 and res["linear_colwise"]["warned"]


def test_transformers_tensor_parallel(tmp_path):
    """transformers' tp_plan="auto" on 2 processes: kernelized logits match the unsharded model; the norms (plain
    weights, local activations) run the fused kernel; the DTensor-sharded MLP is announced as running its own math."""
    pytest.importorskip("accelerate", reason="transformers' tensor parallel loading needs accelerate")
    out = tmp_path / "tp.json"
    env = launch_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "scripts" / "tp_check.py"), "--model-dir", str(tmp_path / "model"), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    res = json.loads(out.read_text())
    assert res["max_err"] < 1e-5, res
    assert {"LlamaRMSNorm", "LlamaMLP"} <= set(res["replaced"]), res
    assert res["norm_weight_type"] == "Parameter" and res["mlp_weight_type"] == "DTensor"
    assert any("GeGLUMLP runs the module's own PyTorch math" in w for w in res["warnings"]), res
