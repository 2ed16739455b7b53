"""Loading the build the ways users do: get_local_kernel, LOCAL_KERNELS + get_kernel, an offline Hub cache,
two builds in one process, `kernels info`, metadata and digests."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import REPO_ID, ROOT

BUILD = ROOT / "build"
TORCH_TAG = "torch{}{}".format(*torch.__version__.split("+")[0].split(".")[:2])
CPU_VARIANT = f"{TORCH_TAG}-cxx11-cpu-x86_64-linux"
CUDA_VARIANT = (
    f"{TORCH_TAG}-cxx11-cu{torch.version.cuda.replace('.', '')}-x86_64-linux" if torch.version.cuda else None
)
HAS_CUDA_BUILD = CUDA_VARIANT is not None and (BUILD / CUDA_VARIANT).is_dir()
# a stable-ABI CUDA variant (torch-stable-abi<XY>-cu<Z>-...) serves a CUDA torch too
HAS_STABLE_CUDA_BUILD = torch.version.cuda is not None and any(BUILD.glob("torch-stable-abi*-cu*-x86_64-linux"))

# Imported in child processes before anything else: any attempt to open a network connection fails loudly.
NO_NETWORK = textwrap.dedent(
    """
    import socket
    def _blocked(*a, **k):
        raise RuntimeError("network access attempted")
    socket.socket.connect = _blocked
    socket.create_connection = _blocked
    socket.getaddrinfo = _blocked
    """
)


def run_child(code: str, env: dict[str, str]) -> str:
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **env}
    proc = subprocess.run([sys.executable, "-c", NO_NETWORK + textwrap.dedent(code)], env=full_env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"child failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_local_kernel_cpu_backend(fm_cpu):
    assert fm_cpu.__name__.startswith("_fused_mlp_cpu_")
    x = torch.randn(3, 5, 64)
    y = fm_cpu.rms_norm(x, torch.ones(64))
    assert y.shape == x.shape


def test_local_kernel_picks_variant_from_installed_torch(fm):
    expected = "cuda" if HAS_CUDA_BUILD or HAS_STABLE_CUDA_BUILD else "cpu"
    assert fm.__name__.startswith(f"_fused_mlp_{expected}_")
    # Whatever the variant, CPU tensors work: every variant registers the CPU implementation.
    assert fm.rms_norm(torch.randn(2, 8), torch.ones(8)).shape == (2, 8)


def test_get_kernel_through_local_kernels():
    out = run_child(
        f"""
        import torch, kernels
        k = kernels.get_kernel("{REPO_ID}", version=1)
        y = k.rms_norm(torch.randn(4, 32), torch.ones(32))
        print(k.__name__, tuple(y.shape))
        """,
        {"LOCAL_KERNELS": f"{REPO_ID}={ROOT}"},
    )
    assert "_fused_mlp_" in out and "(4, 32)" in out


def make_offline_cache(tmp_path: Path) -> Path:
    """A Hub cache laid out as huggingface_hub writes it: refs/v1 -> commit, snapshots/<commit>/build/..."""
    cache = tmp_path / "hub"
    repo = cache / ("kernels--" + REPO_ID.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "v1").write_text(commit)
    snap = repo / "snapshots" / commit / "build"
    snap.mkdir(parents=True)
    for variant in BUILD.iterdir():
        if variant.is_dir() and not variant.name.startswith("."):
            shutil.copytree(variant, snap / variant.name, ignore=shutil.ignore_patterns("__pycache__"))
    return cache


def test_get_kernel_offline_from_hub_cache(tmp_path):
    cache = make_offline_cache(tmp_path)
    out = run_child(
        f"""
        import torch, kernels
        k = kernels.get_kernel("{REPO_ID}", version=1)
        print(k.__name__, k.__file__)
        print(tuple(k.rms_norm(torch.randn(2, 16), torch.ones(16)).shape))
        """,
        {"HF_HUB_CACHE": str(cache), "KERNELS_CACHE": str(cache)},
    )
    assert str(cache) in out and "(2, 16)" in out


def test_layer_repository_offline_local(tmp_path):
    out = run_child(
        f"""
        from pathlib import Path
        import torch
        from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping
        from torch import nn

        class Norm(nn.Module):
            def __init__(self):
                super().__init__()
                self.weight = nn.Parameter(torch.ones(8))
                self.variance_epsilon = 1e-6
            def forward(self, hidden_states):
                raise AssertionError("not replaced")

        from kernels import replace_kernel_forward_from_hub
        replace_kernel_forward_from_hub(Norm, "RMSNorm")
        mapping = {{"RMSNorm": {{"cpu": LocalLayerRepository(repo_path=Path("{ROOT}"), layer_name="RMSNorm")}}}}
        with use_kernel_mapping(mapping):
            m = kernelize(nn.Sequential(Norm()), mode=Mode.INFERENCE, device="cpu")
        print(tuple(m(torch.randn(3, 8)).shape))
        """,
        {},
    )
    assert "(3, 8)" in out


@pytest.mark.skipif(not HAS_CUDA_BUILD, reason="needs the CUDA variant built (torch CUDA build + nvcc)")
def test_two_builds_in_one_process(fm, fm_cpu):
    assert fm.__name__ != fm_cpu.__name__
    ns_cuda = fm._ops.add_op_namespace_prefix("rms_norm_fwd").split("::")[0]
    ns_cpu = fm_cpu._ops.add_op_namespace_prefix("rms_norm_fwd").split("::")[0]
    assert ns_cuda != ns_cpu
    x, w = torch.randn(4, 64), torch.rand(64)
    torch.testing.assert_close(fm.rms_norm(x, w), fm_cpu.rms_norm(x, w), rtol=0, atol=0)


def test_metadata_and_digest():
    from kernels._rust import Digest, DigestAlgorithm, Metadata

    variants = [d for d in BUILD.iterdir() if d.is_dir() and not d.name.startswith(".")]
    assert variants, "no variants built"
    for v in variants:
        meta = Metadata.read_from_file(v / "metadata.json")
        raw = json.loads((v / "metadata.json").read_text())
        assert str(meta.name) == "fused-mlp" and meta.version == 1 and meta.license == "Apache-2.0"
        assert meta.id.startswith("_fused_mlp_") and (v / f"{meta.id}.abi3.so").exists()
        assert raw["backend"]["type"] in ("cpu", "cuda")
        if raw["backend"]["type"] == "cuda":
            assert meta.backend.archs and all(a in ("8.0", "9.0", "9.0a", "10.0", "12.0") for a in meta.backend.archs)
        assert meta.digest is not None
        meta.digest.validate(Digest.hash_variant(DigestAlgorithm.SHA256, str(v)))


def test_kernels_info_accepts_the_build():
    pytest.importorskip("cryptography", reason="kernels' own dependencies (sigstore, cryptography) not installed")
    proc = subprocess.run([sys.executable, "-m", "kernels.cli", "info", str(ROOT)], capture_output=True, text=True)
    if proc.returncode != 0 and "No module named kernels.cli" in proc.stderr:
        # the CLI sits next to the interpreter in a virtual environment that is not activated (CI runs .venv/bin/python)
        beside = Path(sys.executable).parent / "kernels"
        exe = str(beside) if beside.exists() else shutil.which("kernels")
        assert exe, "the `kernels` CLI is not installed"
        proc = subprocess.run([exe, "info", str(ROOT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "fused-mlp" in proc.stdout and "cpu" in proc.stdout
