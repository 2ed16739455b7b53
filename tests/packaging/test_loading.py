"""Loading the build the ways users do: get_local_kernel, LOCAL_KERNELS + get_kernel, an offline Hub cache,
two builds in one process, `kernels info`, metadata and digests."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
import torch

from conftest import REPO_ID, ROOT, TORCH_TAG

BUILD = ROOT / "build"
TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
# kernels' variant names: torch<XY>-cxx11-<backend>-... (per-torch) or torch-stable-abi<XY>-<backend>-... (stable ABI)
VARIANT = re.compile(r"^torch(?:(\d)(\d+)-cxx11|-stable-abi(\d)(\d+))-cu(\d\d)(\d+)-[a-z0-9_]+-linux$")


def _cuda_variant_loads(name: str) -> bool:
    """kernels loads this CUDA variant under the installed torch: the per-torch one of this torch or a stable-ABI
    one whose target is not newer, built for torch's CUDA major and a minor no newer than torch's (CUDA's minor
    version compatibility: torch 2.15's cu132 takes a cu130 variant)."""
    m = VARIANT.match(name)
    if m is None or torch.version.cuda is None:
        return False
    major, minor = (int(p) for p in torch.version.cuda.split(".")[:2])
    if int(m.group(5)) != major or int(m.group(6)) > minor:
        return False
    if m.group(3) is not None:
        return TORCH_VERSION >= (int(m.group(3)), int(m.group(4)))
    return f"torch{m.group(1)}{m.group(2)}" == TORCH_TAG


HAS_CUDA_BUILD = BUILD.is_dir() and any(d.is_dir() and _cuda_variant_loads(d.name) for d in BUILD.iterdir())

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
    expected = "cuda" if HAS_CUDA_BUILD else "cpu"
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


# The keys of kernel-builder's metadata.json (kernels-data Metadata; `kernels-minver` is read by kernels >= 0.17).
METADATA_KEYS = {"name", "id", "version", "license", "kernels-minver", "upstream", "source", "python-depends",
                 "kernel-depends", "backend", "digest", "provenance"}


def test_metadata_and_digest():
    from kernels._rust import Digest, DigestAlgorithm, Metadata

    general = tomllib.loads((ROOT / "build.toml").read_text())["general"]
    variants = [d for d in BUILD.iterdir() if d.is_dir() and not d.name.startswith(".")]
    assert variants, "no variants built"
    for v in variants:
        meta = Metadata.read_from_file(v / "metadata.json")
        raw = json.loads((v / "metadata.json").read_text())
        assert set(raw) <= METADATA_KEYS, set(raw) - METADATA_KEYS
        assert str(meta.name) == "fused-mlp" and meta.version == 1 and meta.license == "Apache-2.0"
        assert meta.id.startswith("_fused_mlp_") and (v / f"{meta.id}.abi3.so").exists()
        # kernel-builder writes `upstream` (the repository the kernels' code comes from) only when build.toml has it
        assert raw.get("upstream") == general.get("upstream") and raw.get("source") == general.get("source")
        assert raw["kernel-depends"] == [] and raw["python-depends"] == []
        assert raw["backend"]["type"] in ("cpu", "cuda")
        if raw["backend"]["type"] == "cuda":
            assert meta.backend.archs and all(a in ("8.0", "9.0", "9.0a", "10.0", "12.0") for a in meta.backend.archs)
            assert raw["backend"]["archs"] == sorted(set(raw["backend"]["archs"]))  # as kernel-builder writes them
        else:
            assert "archs" not in raw["backend"]
        assert meta.digest is not None
        meta.digest.validate(Digest.hash_variant(DigestAlgorithm.SHA256, str(v)))


def test_newer_torch_without_per_torch_variant_skips(tmp_path):
    """A user on a newer torch than the build's (torch 2.15 with this 2.14 build) has the stable-ABI variants and
    per-torch ones for another torch only: the stable variant loads, and the tests that compare it with a per-torch
    build skip with a reason instead of failing in `kernels` ("Cannot find a build variant"). Simulated: a checkout
    whose build/ holds this build's stable-ABI variants and its per-torch ones renamed to a torch that is not
    installed."""
    stable = sorted(d for d in BUILD.glob("torch-stable-abi*") if (d / "metadata.json").exists())
    per_torch = sorted(d for d in BUILD.glob(f"{TORCH_TAG}-cxx11-*") if (d / "metadata.json").exists())
    if not stable:
        pytest.skip("no stable-ABI variant built")
    shutil.copytree(ROOT / "tests", tmp_path / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "build").mkdir()
    for d in stable:
        (tmp_path / "build" / d.name).symlink_to(d, target_is_directory=True)
    for d in per_torch:  # built for "torch 2.99", which nobody runs
        (tmp_path / "build" / d.name.replace(TORCH_TAG, "torch299", 1)).symlink_to(d, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "FUSED_MLP_VARIANT", "LOCAL_KERNELS")}
    copied = tmp_path / "tests" / "packaging"
    proc = subprocess.run([sys.executable, "-m", "pytest", str(copied / "test_variants.py"),
                           str(copied / "test_loading.py") + "::test_local_kernel_picks_variant_from_installed_torch",
                           "-p", "no:cacheprovider", "-q", "-rs"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    summary = proc.stdout.strip().splitlines()[-1]  # stderr may end with a plugin's warning (pytest-benchmark)
    assert "1 passed" in summary and "skipped" in summary and "error" not in summary and "failed" not in summary, out
    assert f"per-torch variant for torch {torch.__version__}" in out, out[-4000:]


def _kernels_cli(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "kernels.cli", *args], capture_output=True, text=True)
    if proc.returncode != 0 and "No module named kernels.cli" in proc.stderr:
        # the script next to this interpreter first: a virtual environment's bin/ is on PATH only when activated
        exe = next((str(c) for c in (Path(sys.executable).parent / "kernels",) if c.exists()), shutil.which("kernels"))
        if exe:
            return subprocess.run([exe, *args], capture_output=True, text=True)
        # No script anywhere (`pip install --target` puts it in the target's bin/, off PATH): the console-script entry
        # point the script would run, from the installed package's metadata.
        from importlib.metadata import entry_points

        eps = [ep for ep in entry_points(group="console_scripts", name="kernels") if ep.module.startswith("kernels")]
        assert eps, "the `kernels` CLI is not installed"
        mod, fn = eps[0].module, eps[0].attr
        call = f"import sys; from {mod} import {fn}; sys.argv[0] = 'kernels'; sys.exit({fn}())"
        proc = subprocess.run([sys.executable, "-c", call, *args], capture_output=True, text=True)
    return proc


def test_kernels_info_accepts_the_build():
    pytest.importorskip("cryptography", reason="kernels' own dependencies (sigstore, cryptography) not installed")
    proc = _kernels_cli("info", str(ROOT))
    assert proc.returncode == 0, proc.stderr
    assert "fused-mlp" in proc.stdout and "cpu" in proc.stdout


def test_symbols_json_lists_the_loaded_api(fm):
    """Every variant's symbols.json (what `kernels describe-api` prints, kernels >= 0.19) names exactly the loaded
    package's public functions and its layers, with the attributes kernelize reads; kernels' own reader and CLI
    accept it where they exist."""
    import types

    functions = [{"name": n} for n in fm.__all__ if not isinstance(getattr(fm, n), types.ModuleType)]
    assert functions and all(callable(getattr(fm, f["name"])) for f in functions)
    layers = [{"name": n, "attributes": {a: getattr(getattr(fm.layers, n), a, None)
                                         for a in ("has_backward", "can_torch_compile")}}
              for n in fm.layers.__all__]
    want = {"schema_version": 1, "functions": functions, "layers": layers}
    variants = [d for d in BUILD.iterdir() if d.is_dir() and not d.name.startswith(".")]
    assert variants, "no variants built"
    for v in variants:
        assert json.loads((v / "symbols.json").read_text()) == want, v.name
    try:
        from kernels._internals.cli.describe_api import _read_symbols
    except ImportError:
        return  # kernels < 0.19 has no describe-api
    assert _read_symbols(variants[0] / "symbols.json") == want
    proc = _kernels_cli("describe-api", "--json", str(ROOT))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["functions"] == functions and out["layers"] == layers
