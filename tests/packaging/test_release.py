"""Release engineering: the official build files (flake.nix, the GitHub workflow, build.toml), the nvcc/torch
CUDA-major guard, the ABI gate, kernel-builder's test closure, and the Hub-ready tree (tools/hub_tree.py).
Everything here runs offline on the CPU variant; nothing compiles CUDA code."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO_ID, ROOT

if not (ROOT / "tools" / "build_config.py").exists():  # kernel-builder's test closure ships only tests/ and sources
    pytest.skip("tools/ is not part of this source tree (Nix test closure)", allow_module_level=True)
sys.path.insert(0, str(ROOT / "tools"))
from build_config import BuildConfigError, check_includes, load_build_config  # noqa: E402

GOOD = (ROOT / "build.toml").read_text()
CFG = load_build_config(ROOT / "build.toml")
TORCH_TAG = "torch{}{}".format(*torch.__version__.split("+")[0].split(".")[:2])
# The CPU variant this torch loads: kernel-builder's stable-ABI one (what tools/build.py builds by default), else the
# per-torch one.
CPU_VARIANT = next((d.name for pattern in ("torch-stable-abi*-cpu-*-linux", f"{TORCH_TAG}-cxx11-cpu-*-linux")
                    for d in sorted((ROOT / "build").glob(pattern)) if (d / "metadata.json").exists()), "")
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.y*ml"))


def run(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None, timeout: int = 600):
    return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=cwd,
                          timeout=timeout)


def error_lines(stderr: str) -> list[str]:
    """stderr without torch's `W...` warnings."""
    return [line for line in stderr.strip().splitlines() if line and not line.startswith("W")]


# ------------------------------------------------------------------------------------------------------------
# flake.nix
# ------------------------------------------------------------------------------------------------------------

FLAKE = (ROOT / "flake.nix").read_text()


@pytest.mark.skipif(shutil.which("nix-instantiate") is None,
                    reason="nix-instantiate not installed (Debian: apt-get install nix-bin)")
def test_flake_parses():
    proc = run(["nix-instantiate", "--parse", str(ROOT / "flake.nix")])
    assert proc.returncode == 0, proc.stderr


def test_flake_is_the_current_kernel_builder_form():
    assert re.search(r'kernel-builder\.url\s*=\s*"github:huggingface/kernels"', FLAKE)
    assert "kernel-builder.lib.genKernelFlakeOutputs" in FLAKE
    assert re.search(r"inherit self;", FLAKE) and re.search(r"path = \./\.;", FLAKE)
    assert "genFlakeOutputs" not in FLAKE.replace("genKernelFlakeOutputs", "")  # the deprecated alias
    assert not re.search(r"\brev\s*=", FLAKE)  # `rev` now throws


def _third_party_test_imports() -> set[str]:
    local = {p.stem for p in (ROOT / "tests").rglob("*.py")} | {p.stem for p in (ROOT / "tools").glob("*.py")}
    provided = {"torch", "pytest", "kernels"}  # in kernel-builder's test Python already
    names = set()
    for f in (ROOT / "tests").rglob("*.py"):
        for node in ast.parse(f.read_text()).body:  # module level only: collection imports these
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in local and n not in provided}


def test_flake_check_inputs_cover_test_imports():
    """`nix build .#ci-test` collects every test module: each third-party module a test imports at module
    level must be in pythonCheckInputs, or collection fails before a single kernels_ci test runs."""
    m = re.search(r"pythonCheckInputs\s*=\s*pkgs:\s*with pkgs;\s*\[([^\]]*)\]", FLAKE)
    assert m, "flake.nix has no pythonCheckInputs list"
    listed = set(m.group(1).split())
    missing = _third_party_test_imports() - listed
    assert not missing, f"add {sorted(missing)} to pythonCheckInputs in flake.nix"


# ------------------------------------------------------------------------------------------------------------
# GitHub workflows
# ------------------------------------------------------------------------------------------------------------


def test_requirements_pin_the_release_checkers():
    reqs = (ROOT / "tools" / "requirements.txt").read_text()
    assert re.search(r"^check-jsonschema==\S+", reqs, re.M)
    assert re.search(r"^kernel-abi-check==\S+", reqs, re.M)


@pytest.mark.skipif(importlib.util.find_spec("check_jsonschema") is None,
                    reason="check-jsonschema not installed (pip install -r tools/requirements.txt)")
def test_workflows_pass_the_github_schema():
    assert WORKFLOWS, "no workflow files"
    # through this interpreter: a virtual environment's scripts are not on PATH unless it is activated
    proc = run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows",
                *map(str, WORKFLOWS)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _workflow() -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((ROOT / ".github" / "workflows" / "build.yaml").read_text())


def test_workflow_follows_kernels_community_shape():
    wf = _workflow()
    text = (ROOT / ".github" / "workflows" / "build.yaml").read_text()
    jobs = wf["jobs"]
    build = jobs["build"]
    # the build matrix comes from the flake, through the matrix job's output
    assert build["needs"] == "matrix" or build["needs"] == ["matrix"]
    assert build["strategy"]["matrix"] == "${{ fromJSON(needs.matrix.outputs.matrix) }}"
    assert build["runs-on"] == "${{ matrix.runner }}"
    steps = build["steps"]
    uses = [s.get("uses", "") for s in steps]
    cachix = next(s for s in steps if s.get("uses", "").startswith("cachix/cachix-action"))
    assert cachix["with"]["name"] == "huggingface" and cachix["env"]["USER"] == "runner"
    nix = next(s for s in steps if s.get("uses", "").startswith("DeterminateSystems/nix-installer-action"))
    assert "sandbox-fallback = false" in nix["with"]["extra-conf"]
    assert any(u.startswith("actions/setup-python") for u in uses)  # no pip into the runner's system Python
    run_text = "\n".join(s.get("run", "") for s in steps) + json.dumps([s.get("env", {}) for s in steps])
    assert "backendCi" in run_text and "backendBundle" in run_text
    assert "cp -rL result build" in run_text and "cp CARD.md build/CARD.md" in run_text
    abi = next(s for s in steps if "tools/abi_check.py build" in s.get("run", ""))
    assert "if" not in abi, "the ABI check must run for pull requests too"
    assert "cosign sign-blob" in run_text
    # kernel-builder's test closure on a GPU runner (a runner group; GitHub's ubuntu-* runners have no GPU), for
    # pull requests and pushes alike
    test = jobs["test"]
    assert isinstance(test["runs-on"], dict) and test["runs-on"].get("group"), test["runs-on"]
    assert "if" not in test
    assert any("nvidia-smi" in s.get("run", "") for s in test["steps"])
    assert test["steps"][-1]["run"].strip().endswith("./result/bin/ci-test")
    # the upload waits for every build of the matrix (both platforms) and for the GPU tests
    upload = jobs["upload"]
    assert {"matrix", "build", "test"} <= set(upload["needs"])
    assert wf["env"]["REPO_ID"] == CFG.hub_repo_id
    assert text.count("upload --repo-type kernel --repo-id \"$REPO_ID\"") == 2


def _step(job: str, pred) -> dict:
    return next(s for s in _workflow()["jobs"][job]["steps"] if pred(s))


def _fake_nix(tmp_path: Path, backends: dict[str, str]) -> Path:
    """A `nix` stand-in answering `nix eval --json .#backendCi --apply builtins.attrNames --system <platform>`."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    cases = "".join(f"    {arch}) echo '{out}'; exit 0;;\n" for arch, out in backends.items())
    nix = bindir / "nix"
    nix.write_text('#!/bin/sh\ncase "$*" in\n  "eval --json .#backendCi --apply builtins.attrNames --system "*)\n'
                   '    case "$7" in\n' + cases + "    esac;;\nesac\necho \"unexpected: nix $*\" >&2\nexit 2\n")
    nix.chmod(0o755)
    return bindir


@pytest.mark.skipif(shutil.which("jq") is None, reason="jq not installed (GitHub's runners have it)")
@pytest.mark.parametrize("arm", ['["cpu","cuda"]', '["cpu"]'])
def test_workflow_matrix_comes_from_the_flake(tmp_path, arm):
    """The matrix job, run with a stand-in nix: one (backend, platform) entry per backend the flake offers on each
    platform, and a failure when a platform lacks one of build.toml's backends (it would be missing from the Hub)."""
    step = _step("matrix", lambda s: s.get("id") == "matrix")
    shutil.copy2(ROOT / "build.toml", tmp_path / "build.toml")
    (tmp_path / "out").write_text("")
    bindir = _fake_nix(tmp_path, {"x86_64-linux": '["cpu","cuda"]', "aarch64-linux": arm})
    proc = run(["bash", "-c", step["run"]], cwd=tmp_path,
               env={"PATH": f"{bindir}:{os.environ['PATH']}", "GITHUB_OUTPUT": str(tmp_path / "out")})
    if arm != '["cpu","cuda"]':
        assert proc.returncode != 0 and "::error::" in proc.stdout, proc.stdout + proc.stderr
        return
    assert proc.returncode == 0, proc.stdout + proc.stderr
    matrix = json.loads((tmp_path / "out").read_text().strip().removeprefix("matrix="))
    got = {(e["backend"], e["arch"]) for e in matrix["include"]}
    assert got == {(b, a) for b in CFG.backends for a in ("x86_64-linux", "aarch64-linux")}
    assert {e["runner"] for e in matrix["include"] if e["arch"] == "aarch64-linux"} == {"ubuntu-24.04-arm"}


@pytest.mark.skipif(shutil.which("jq") is None, reason="jq not installed (GitHub's runners have it)")
def test_upload_needs_every_backend_of_both_platforms(tmp_path):
    step = _step("upload", lambda s: s.get("name") == "Every backend of both platforms is here")
    pairs = [(b, a) for a in ("x86_64-linux", "aarch64-linux") for b in CFG.backends]
    matrix = json.dumps({"include": [{"backend": b, "arch": a} for b, a in pairs]})

    def check(variants: list[str], m: str = matrix) -> subprocess.CompletedProcess:
        shutil.rmtree(tmp_path / "build", ignore_errors=True)
        for v in variants:
            (tmp_path / "build" / v).mkdir(parents=True)
        return run(["bash", "-c", step["run"]], cwd=tmp_path, env={"MATRIX": m})

    names = [f"torch-stable-abi210-{'cu130' if b == 'cuda' else b}-{a}" for b, a in pairs]
    assert check(names).returncode == 0
    proc = check([n for n in names if not n.endswith("cu130-aarch64-linux")])
    assert proc.returncode != 0 and "no cuda variant for aarch64-linux" in proc.stdout
    x86_only = json.dumps({"include": [{"backend": b, "arch": a} for b, a in pairs if a == "x86_64-linux"]})
    proc = check(names, x86_only)
    assert proc.returncode != 0 and "no aarch64-linux build in the matrix" in proc.stdout


# ------------------------------------------------------------------------------------------------------------
# build.toml (the cases test_build.py does not cover)
# ------------------------------------------------------------------------------------------------------------


def test_repository_build_toml_includes_resolve_like_kernel_builder():
    check_includes(CFG)  # raises on the first quoted #include kernel-builder's CMake would not find


def _drop_sections(text: str, header_re: str) -> str:
    return "".join(p for p in re.split(r"(?m)^(?=\[)", text) if not re.match(header_re, p))


def _write(tmp_path: Path, text: str) -> Path:
    for d in ("kernels_src", "torch-ext"):
        (tmp_path / d).symlink_to(ROOT / d)
    (tmp_path / "build.toml").write_text(text)
    return tmp_path / "build.toml"


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda t: t.replace('depends = ["torch"]', 'depends = ["torch", "cutlass_9_9"]', 1), "depends.*unknown"),
        (lambda t: t.replace('depends = ["torch"]\n', "", 1), "has no depends"),
        (lambda t: t.replace('include = ["kernels_src", "torch-ext"]', 'include = ["no-such-dir"]', 1),
         "not a directory"),
        (lambda t: t.replace('"12.0"]', '"13.7"]', 1), "not a capability kernel-builder supports"),
        (lambda t: t.replace('src = ["torch-ext/torch_binding.cpp"', 'minver = "2"\nsrc = ["torch-ext/torch_binding.cpp"'),
         "must be a version"),
        (lambda t: t.replace('repo-id = "kernels-community/fused-mlp"',
                             'repo-id = "kernels-community/fused-mlp"\nbranch = 3'), "branch"),
        (lambda t: t.replace('[general.hub]', '[general.cuda]\nmaxver = "13"\n\n[general.hub]'), "must be a version"),
        (lambda t: t + '\n[extra]\nx = 1\n', "unknown key"),
        (lambda t: _drop_sections(t, r"\[kernel\.\w+_cuda\]"), "no \\[kernel.\\*\\] section has backend 'cuda'"),
    ],
)
def test_build_toml_schema_gaps_fail_loudly(tmp_path, mutate, message):
    text = mutate(GOOD)
    assert text != GOOD, "mutation did not apply"
    with pytest.raises(BuildConfigError, match=message):
        load_build_config(_write(tmp_path, text))


def test_missing_include_directory_fails_the_include_check(tmp_path):
    """Without `include`, kernel-builder's CMake cannot find "cpu/cpu_common.h": the check says so in one line."""
    text = GOOD.replace('include = ["kernels_src", "torch-ext"]\n', "", 1)
    cfg = load_build_config(_write(tmp_path, text))
    with pytest.raises(BuildConfigError, match=r'#include "cpu/cpu_common.h".*add it to `include`'):
        check_includes(cfg)


# ------------------------------------------------------------------------------------------------------------
# nvcc's CUDA major must be torch's
# ------------------------------------------------------------------------------------------------------------


def _fake_cuda_home(tmp_path: Path, release: str) -> Path:
    home = tmp_path / f"cuda-{release}"
    (home / "bin").mkdir(parents=True)
    (home / "include").mkdir()
    (home / "include" / "cuda_runtime.h").write_text("/* fake */\n")
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                    f"echo 'Cuda compilation tools, release {release}, V{release}.86'\n")
    nvcc.chmod(0o755)
    return home


@pytest.mark.skipif(torch.version.cuda is None or torch.version.cuda.startswith("12."),
                    reason="needs a CUDA 13 (not 12) build of torch to provoke the mismatch")
@pytest.mark.parametrize("backend", ["cuda", "auto"])
def test_nvcc_major_mismatch_is_one_line_error(tmp_path, backend):
    home = _fake_cuda_home(tmp_path, "12.9")
    out = tmp_path / "out"
    proc = run([sys.executable, str(ROOT / "tools" / "build.py"), "--backend", backend, "--out", str(out)],
               env={"CUDA_HOME": str(home)})
    assert proc.returncode == 1
    err = error_lines(proc.stderr)
    assert len(err) == 1, proc.stderr
    assert err[0].startswith("fused-mlp build error: nvcc is CUDA 12.9 but torch was built with CUDA 13")
    assert not out.exists(), "nothing may be built when the toolchain is wrong"


# ------------------------------------------------------------------------------------------------------------
# ABI gate
# ------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def glibc232_so(tmp_path_factory) -> Path:
    """A shared object that needs GLIBC_2.32 (`__libc_single_threaded`), above manylinux_2_28."""
    pytest.importorskip("kernel_abi_check")
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp("abi") / "variant"
    d.mkdir()
    src = d.parent / "bad.c"
    src.write_text("extern char __libc_single_threaded;\nint fused_mlp_probe(void) { return __libc_single_threaded; }\n")
    proc = run([cc, "-shared", "-fPIC", str(src), "-o", str(d / "_bad.abi3.so")])
    if proc.returncode != 0:
        pytest.skip(f"cannot build the probe: {proc.stderr[-300:]}")
    return d / "_bad.abi3.so"


def test_abi_check_fails_on_newer_glibc_symbols(glibc232_so):
    proc = run([sys.executable, str(ROOT / "tools" / "abi_check.py"), str(glibc232_so.parent)])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout and "_bad.abi3.so" in proc.stdout


def test_build_abi_check_is_strict(glibc232_so):
    import build

    with pytest.raises(build.BuildError, match="ABI check failed for _bad.abi3.so"):
        build.abi_check(glibc232_so.parent, strict=True)


def test_every_built_extension_passes_the_abi_check():
    sos = sorted((ROOT / "build").rglob("*.so"))
    if not sos:
        pytest.skip("nothing built")
    pytest.importorskip("kernel_abi_check", reason="kernel-abi-check not installed (tools/requirements.txt has it)")
    proc = run([sys.executable, str(ROOT / "tools" / "abi_check.py"), str(ROOT / "build")])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("abi-check: ok") == len(sos)


def test_ci_run_gates_on_the_abi_of_every_variant():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "set -euo pipefail" in ci
    assert re.search(r'^"\$PY" tools/abi_check\.py build\b', ci, re.M), ".ci/run must check every .so under build/"
    assert re.search(r'^PY="\$VENV/bin/python"$', ci, re.M) and re.search(r"^VENV=\.venv$", ci, re.M)


# ------------------------------------------------------------------------------------------------------------
# kernel-builder's test closure, emulated: the Nix source set, `pytest tests -m kernels_ci`, LOCAL_KERNELS
# ------------------------------------------------------------------------------------------------------------


def nix_source_set(dst: Path) -> Path:
    """What nix-builder/lib/source-set.nix puts in `extension.src`: build.toml, the [torch] and [kernel.*]
    sources, torch-ext/**/*.py and tests/**/*.py (no tools/, README, benchmarks/)."""
    files = {ROOT / "build.toml", *CFG.torch_src, *(s for k in CFG.kernels for s in k.src)}
    files |= set((ROOT / "torch-ext").rglob("*.py")) | set((ROOT / "tests").rglob("*.py"))
    for f in files:
        if "__pycache__" in f.parts:
            continue
        rel = f.relative_to(ROOT)
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dst / rel)
    return dst


def test_nix_test_closure_runs_the_kernels_ci_tests(tmp_path):
    variant_dirs = [d for pattern in (f"{TORCH_TAG}-*", "torch-stable-abi*") for d in (ROOT / "build").glob(pattern)
                    if (d / "metadata.json").exists()]
    if not variant_dirs:
        pytest.skip("nothing built for this torch")
    src = nix_source_set(tmp_path / "src")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env.update(LOCAL_KERNELS=f"{REPO_ID}={ROOT}", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", str(src / "tests"), "-m", "kernels_ci",
                           "-p", "no:cacheprovider", "-q", "-x"], capture_output=True, text=True, env=env,
                          timeout=900)
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert re.search(r"\d+ passed", proc.stdout), tail
    assert "error" not in proc.stdout.splitlines()[-1].lower(), tail


# ------------------------------------------------------------------------------------------------------------
# The Hub-ready tree
# ------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hub_tree():
    import hub_tree as mod

    return mod


@pytest.mark.parametrize("tag, torch_cuda, loads", [
    ("cu130", "13.0", True), ("cu130", "13.2", True),    # torch 2.15's PyPI build (cu132) takes our cu130 variant
    ("cu132", "13.0", False), ("cu129", "13.0", False),  # a newer minor or another major does not load
    ("cu126", "12.9", True), ("cu128", "12.6", False), ("cpu", "13.0", False), ("cu130", None, False),
])
def test_cuda_variant_rule_is_kernels_minor_version_rule(hub_tree, tag, torch_cuda, loads):
    assert hub_tree.cuda_tag_loads(tag, torch_cuda) is loads


def test_card_is_a_kernels_hub_card(hub_tree):
    assert hub_tree.card_problems(ROOT / "CARD.md", CFG) == []


def test_card_check_catches_a_bad_front_matter(hub_tree, tmp_path):
    bad = tmp_path / "CARD.md"
    bad.write_text("---\nlicense: mit\ntags:\n  - other\n---\n# x\n")
    problems = hub_tree.card_problems(bad, CFG)
    assert any("library_name" in p for p in problems)
    assert any("license" in p for p in problems)
    assert any("'kernel'" in p for p in problems)


def test_hub_tree_for_the_cpu_variant(tmp_path):
    if not (ROOT / "build" / CPU_VARIANT / "metadata.json").exists():
        pytest.skip("CPU variant not built")
    pytest.importorskip("cryptography", reason="kernels' own dependencies (sigstore, cryptography) not installed")
    out = tmp_path / "hub"
    proc = run([sys.executable, str(ROOT / "tools" / "hub_tree.py"), "--out", str(out), "--variant", CPU_VARIANT],
               env={"LOCAL_KERNELS": ""})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rel in ("build.toml", "README.md", "build/CARD.md", f"build/{CPU_VARIANT}/metadata.json",
                f"build/{CPU_VARIANT}/__init__.py", f"build/{CPU_VARIANT}/_ops.py"):
        assert (out / rel).is_file(), rel
    assert list((out / "build" / CPU_VARIANT).glob("_fused_mlp_cpu_*.abi3.so"))
    assert sorted(p.name for p in (out / "benchmarks").iterdir()) == sorted(
        p.name for p in (ROOT / "benchmarks").glob("benchmark*.py"))
    assert not list(out.rglob("__pycache__"))
    assert f"kernels info ok: {CPU_VARIANT}" in proc.stdout
    assert f"get_kernel ok: {CPU_VARIANT} -> _fused_mlp_cpu_" in proc.stdout
    assert (out / "build" / "CARD.md").read_text() == (ROOT / "CARD.md").read_text()
    lines = proc.stdout.strip().splitlines()
    assert lines[-2] == f"kernel-builder upload --repo-type kernel --repo-id {REPO_ID} {out}"
    assert lines[-1] == f"kernel-builder upload --repo-type kernel --repo-id {REPO_ID} --branch main {out}"


def test_hub_tree_refuses_a_tampered_variant(tmp_path):
    if not (ROOT / "build" / CPU_VARIANT / "metadata.json").exists():
        pytest.skip("CPU variant not built")
    pytest.importorskip("cryptography", reason="kernels' own dependencies (sigstore, cryptography) not installed")
    build = tmp_path / "build"
    shutil.copytree(ROOT / "build" / CPU_VARIANT, build / CPU_VARIANT, ignore=shutil.ignore_patterns("__pycache__"))
    init = build / CPU_VARIANT / "__init__.py"
    init.write_text(init.read_text() + "\n# tampered\n")
    out = tmp_path / "hub"
    proc = run([sys.executable, str(ROOT / "tools" / "hub_tree.py"), "--out", str(out), "--build", str(build),
                "--no-load"])
    assert proc.returncode == 1
    err = error_lines(proc.stderr)
    assert err and all(line.startswith("fused-mlp hub-tree error:") for line in err)
    assert any("digest mismatch" in line for line in err), proc.stderr
    assert "kernel-builder upload" not in proc.stdout
    assert not out.exists()


# ------------------------------------------------------------------------------------------------------------
# .ci/run: the README's test command in a virtual environment the run creates
# ------------------------------------------------------------------------------------------------------------


def _ci_tree(tmp_path: Path, command: str, setup: str) -> Path:
    """A checkout holding .ci/run, a README whose test command is `command`, and a stand-in tools/setup.sh."""
    (tmp_path / ".ci").mkdir()
    shutil.copy2(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "README.md").write_text(f"# x\n\n<!-- ci:test-command -->\n```bash\n{command}\n```\n")
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "setup.sh").write_text(f"set -e\n{setup}\n")
    return tmp_path


def _ci_run(root: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "VIRTUAL_ENV")}
    return subprocess.run(["bash", ".ci/run"], cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_ci_run_wants_the_readme_command_to_use_the_venv(tmp_path):
    root = _ci_tree(tmp_path, "bash tools/setup.sh && python -m pytest tests -q", "true")
    proc = _ci_run(root)
    assert proc.returncode == 1
    assert "does not run the tests with .venv/bin/python" in proc.stderr, proc.stdout + proc.stderr
    assert "CI: finished in" in proc.stdout


def test_ci_run_refuses_a_venv_with_system_site_packages(tmp_path):
    """The README command must build its environment from nothing: a .venv that sees the machine's packages would
    hide a missing install step. .ci/run also removes a .venv left from before, so the command has to create it."""
    setup = f'[ ! -e .venv ] || exit 7\n"{sys.executable}" -m venv --without-pip --system-site-packages .venv'
    root = _ci_tree(tmp_path, "bash tools/setup.sh && .venv/bin/python -c pass", setup)
    (root / ".venv").mkdir()
    (root / ".venv" / "stale").write_text("")
    proc = _ci_run(root)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "removing .venv" in proc.stdout
    assert ".venv sees the system site-packages" in proc.stderr, proc.stdout + proc.stderr
