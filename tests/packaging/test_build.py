"""The non-Nix build: build.toml schema checks, one-line errors, incremental rebuilds, and no half-written
variant after a failed build. Builds run on a copy of the sources (CPU variant only, to stay quick)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT

if not (ROOT / "tools" / "build_config.py").exists():  # kernel-builder's test closure ships only tests/ and sources
    pytest.skip("tools/ is not part of this source tree (Nix test closure)", allow_module_level=True)
sys.path.insert(0, str(ROOT / "tools"))
from build_config import BuildConfigError, load_build_config  # noqa: E402

GOOD = (ROOT / "build.toml").read_text()


def write_toml(tmp_path: Path, text: str) -> Path:
    # Sources are resolved relative to build.toml: link the real ones in.
    for d in ("kernels_src", "torch-ext"):
        if not (tmp_path / d).exists():
            (tmp_path / d).symlink_to(ROOT / d)
    p = tmp_path / "build.toml"
    p.write_text(text)
    return p


def test_repository_build_toml_is_valid():
    cfg = load_build_config(ROOT / "build.toml")
    assert cfg.name == "fused-mlp" and cfg.version == 1 and cfg.python_name == "fused_mlp"
    assert set(cfg.backends) == {"cpu", "cuda"}
    assert cfg.hub_repo_id == "kernels-community/fused-mlp"
    assert {"8.0", "9.0", "10.0", "12.0"} <= set(cfg.cuda_capabilities())
    # Every op's CPU source is compiled into the CUDA variant as well.
    cpu_srcs = {p for p in cfg.sources_for("cpu") if p.suffix == ".cpp" and "kernels_src" in str(p)}
    assert cpu_srcs and cpu_srcs <= set(cfg.sources_for("cuda"))
    assert not any(p.suffix == ".cu" for p in cfg.sources_for("cpu"))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda t: t.replace('name = "fused-mlp"', 'name = "Fused_MLP"'), "must match"),
        (lambda t: t.replace("edition = 5", "edition = 4"), "edition must be 5"),
        (lambda t: t.replace('license = "Apache-2.0"', 'license = "Apache-2.0"\ncolour = "blue"'), "unknown key"),
        (lambda t: t.replace('backends = ["cpu", "cuda"]', 'backends = ["cpu", "cuda", "tpu9"]'), "unknown backend"),
        (lambda t: t.replace('backend = "cpu"', 'backend = "fpga"', 1), "is unknown"),
        (lambda t: t.replace('cuda-capabilities = ["8.0", "9.0", "10.0", "12.0"]\n', "", 1),
         "without cuda-capabilities"),
        (lambda t: t.replace('"9.0"', '"nine"', 1), "is not like"),
        (lambda t: t.replace('depends = ["torch"]', 'depends = ["torch"]\ncuda-flags = ["-O3"]', 1), "unknown key"),
        (lambda t: t.replace('"kernels_src/cpu/rms_norm.cpp"', '"kernels_src/cpu/missing.cpp"', 1),
         "does not exist"),
    ],
)
def test_build_toml_schema_errors(tmp_path, mutate, message):
    text = mutate(GOOD)
    assert text != GOOD, "mutation did not apply"
    with pytest.raises(BuildConfigError, match=message):
        load_build_config(write_toml(tmp_path, text))


def copy_tree(dst: Path) -> Path:
    for d in ("tools", "kernels_src", "torch-ext"):
        shutil.copytree(ROOT / d, dst / d, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "build.toml", dst / "build.toml")
    return dst


def run_build(root: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(root / "tools" / "build.py"), *args], cwd=root,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=900)


def test_unknown_backend_in_build_toml_is_one_line_error(tmp_path):
    root = copy_tree(tmp_path)
    (root / "build.toml").write_text(GOOD.replace('backend = "cpu"', 'backend = "quantum"', 1))
    proc = run_build(root, "--backend", "cpu")
    assert proc.returncode == 1
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "quantum" in err[0] and err[0].startswith("fused-mlp build error:")
    assert not (root / "build").exists()


def test_missing_nvcc_is_one_line_error(tmp_path):
    proc = run_build(ROOT, "--backend", "cuda", "--out", str(tmp_path / "out"),
                     env={"CUDA_HOME": str(tmp_path / "no-cuda-here")})
    assert proc.returncode == 1
    err = [line for line in proc.stderr.strip().splitlines() if not line.startswith("W")]
    assert err and "nvcc" in err[-1] and err[-1].startswith("fused-mlp build error:")
    assert not (tmp_path / "out").exists()


def test_incremental_rebuild_and_failed_build_leaves_previous_variant(tmp_path):
    root = copy_tree(tmp_path)
    first = run_build(root, "--backend", "cpu")
    assert first.returncode == 0, first.stderr
    variants = [d for d in (root / "build").iterdir() if d.is_dir()]
    assert [d.name for d in variants] == [f"torch-stable-abi210-cpu-{build_tool().host_arch()}"]
    before = {p.name: p.read_bytes() for p in variants[0].iterdir() if p.is_file()}

    again = run_build(root, "--backend", "cpu")
    assert again.returncode == 0 and "no work to do" in again.stdout

    # Break a kernel source: the build fails, and the previous variant is left exactly as it was.
    src = root / "kernels_src" / "cpu" / "rms_norm.cpp"
    src.write_text(src.read_text() + "\nthis is not C++;\n")
    broken = run_build(root, "--backend", "cpu")
    assert broken.returncode == 1
    assert broken.stderr.strip().splitlines()[-1].startswith("fused-mlp build error: compilation of")
    after = {p.name: p.read_bytes() for p in variants[0].iterdir() if p.is_file()}
    assert after == before
    assert [d.name for d in (root / "build").iterdir()] == [variants[0].name]


# ---- libstdc++: the extension must use the shared one ------------------------------------------------------------

_TINY = '#include <sstream>\n#include <string>\nstd::string f(long x) { std::ostringstream s; s << x; return s.str(); }\n'


@pytest.mark.skipif(shutil.which("g++") is None or shutil.which("nm") is None, reason="needs g++ and binutils' nm")
def test_static_libstdcxx_copy_is_detected(tmp_path):
    """A GPU-machine toolchain (gcc 13.3) once linked libstdc++ statically into the extension, which then crashed
    formatting a number in an error message; the build now refuses such a binary. Both link modes, for real."""
    import build as build_tool

    src = tmp_path / "t.cpp"
    src.write_text(_TINY)
    for static in (False, True):
        so = tmp_path / f"t_{int(static)}.so"
        cmd = ["g++", "-shared", "-fPIC", "-O1", str(src), "-o", str(so)] + (["-static-libstdc++"] if static else [])
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)
        problem = build_tool.static_libstdcxx_problem(so)
        assert (problem is not None) == static, problem
        if static:
            assert "static copy of libstdc++" in problem
    for so in sorted((ROOT / "build").glob("*/*.abi3.so")):  # whatever this checkout has built
        assert build_tool.static_libstdcxx_problem(so) is None, so


def _fake_cxx(tmp_path: Path, have: set[str]) -> str:
    """A compiler stand-in answering -print-file-name=NAME: a real file for NAMEs in `have`, the bare name (what
    g++ prints for a library it cannot find) otherwise."""
    libdir = tmp_path / "lib"
    libdir.mkdir(parents=True, exist_ok=True)
    for name in have:
        (libdir / name).write_bytes(b"")
    exe = tmp_path / "fake-g++"
    exe.write_text('#!/bin/sh\nname="${1#-print-file-name=}"\n'
                   f'if [ -e "{libdir}/$name" ]; then echo "{libdir}/$name"; else echo "$name"; fi\n')
    exe.chmod(0o755)
    return str(exe)


def test_shared_libstdcxx_is_named_when_the_driver_lacks_it(tmp_path):
    import build as build_tool

    assert build_tool.libstdcxx_link_flags(_fake_cxx(tmp_path / "a", {"libstdc++.so", "libstdc++.a"})) == []
    only_static_dir = _fake_cxx(tmp_path / "b", {"libstdc++.a", "libstdc++.so.6"})
    assert build_tool.libstdcxx_link_flags(only_static_dir) == ["-l:libstdc++.so.6"]
    with pytest.raises(build_tool.BuildError, match="only link libstdc\\+\\+ statically"):
        build_tool.libstdcxx_link_flags(_fake_cxx(tmp_path / "c", {"libstdc++.a"}))
    assert build_tool.libstdcxx_link_flags(_fake_cxx(tmp_path / "d", set())) == []  # not libstdc++ at all


def build_tool():
    import build

    return build


def test_stable_abi_variants_planned_from_build_toml(tmp_path):
    """kernel-builder's variant set by default: with [torch.stable-abi] set for a backend, only its
    torch-stable-abi<XY> variant (compiled with TORCH_TARGET_VERSION for that torch: what `kernels` 0.17 names and
    prefers); a backend the table does not name gets the per-torch variant. The per-torch variants on request."""
    build = build_tool()
    cfg = load_build_config(ROOT / "build.toml")
    assert cfg.stable_abi == {"cpu": "2.10", "cuda": "2.10"}
    tc = build.Toolchain(cxx="g++", nvcc=None, cuda_home=None, ninja="ninja")
    tag, arch = build.torch_tag(torch), build.host_arch()
    both = [f"{tag}-cxx11-cpu-{arch}", f"torch-stable-abi210-cpu-{arch}"]
    assert [v.name for v in build.plan_variants(cfg, "cpu", tc)] == both[1:]  # the default: "auto"
    assert [v.name for v in build.plan_variants(cfg, "cpu", tc, "all")] == both
    assert [v.name for v in build.plan_variants(cfg, "cpu", tc, "stable")] == both[1:]
    assert [v.name for v in build.plan_variants(cfg, "cpu", tc, "torch")] == both[:1]
    cuda_only = load_build_config(write_toml(tmp_path, GOOD.replace('cpu = "2.10"\n', "")))
    assert cuda_only.stable_abi == {"cuda": "2.10"}
    assert [v.name for v in build.plan_variants(cuda_only, "cpu", tc)] == both[:1]
    assert build.stable_define("2.10") == "-DTORCH_TARGET_VERSION=0x020A000000000000"
    flags = build.compile_flags(cfg, "cpu", tc, [], stable_abi="2.10")
    assert "-DTORCH_TARGET_VERSION=0x020A000000000000" in flags.cxx
    assert not any("TORCH_TARGET_VERSION" in f for f in build.compile_flags(cfg, "cpu", tc, []).cxx)


def test_nvcc_standard_as_kernel_builder(monkeypatch):
    """nvcc gets no -std (its default, C++17) for the stable-ABI variants, as kernel-builder builds them; a per-torch
    variant includes ATen/c10, which torch >= 2.12 writes in C++20 (operator<=>), so there nvcc gets -std=c++20 as
    torch's own extension builds give it. The host compiler is C++20 either way."""
    build = build_tool()

    class FakeTorch:
        __version__ = "2.14.1+cu130"

    assert build.nvcc_std_flags(FakeTorch, "2.10") == []
    assert build.nvcc_std_flags(FakeTorch, None) == ["-std=c++20"]
    FakeTorch.__version__ = "2.11.0"
    assert build.nvcc_std_flags(FakeTorch, None) == []
    nvcc, home = build.find_cuda()
    if nvcc is None or torch.version.cuda is None:
        pytest.skip("needs nvcc and a CUDA build of torch for the full flag set")
    cfg = load_build_config(ROOT / "build.toml")
    tc = build.Toolchain(cxx="g++", nvcc=nvcc, cuda_home=home, ninja="ninja")
    stable = build.compile_flags(cfg, "cuda", tc, ["9.0"], stable_abi="2.10")
    assert not any(f.startswith("-std") for f in stable.nvcc) and "-std=c++20" in stable.cxx
    per_torch = build.compile_flags(cfg, "cuda", tc, ["9.0"])
    assert [f for f in per_torch.nvcc if f.startswith("-std")] == build.nvcc_std_flags(torch, None)


def _variant(build, backend: str, caps: list[str]):
    v = build.Variant(backend, f"torch-stable-abi210-{backend}-x86_64-linux", capabilities=caps, stable_abi="2.10")
    v.namespace = f"_fused_mlp_{backend}_0123456789"
    return v


def test_metadata_as_kernel_builder_writes_it(tmp_path):
    """kernel-builder's fields, in its order; `upstream` (and `source`) only when build.toml's [general] sets them,
    never the Hub URL; CUDA archs as the sorted set of the capabilities compiled; backend-specific dependencies only in
    that backend's variant."""
    build = build_tool()
    cfg = load_build_config(ROOT / "build.toml")
    meta = build.metadata_for(cfg, _variant(build, "cuda", ["9.0", "10.0", "8.0", "9.0a", "12.0"]))
    assert list(meta) == ["name", "id", "version", "license", "kernels-minver", "python-depends", "kernel-depends",
                          "backend"]
    assert meta["backend"] == {"type": "cuda", "archs": ["10.0", "12.0", "8.0", "9.0", "9.0a"]}
    assert "upstream" not in meta and "huggingface.co" not in json.dumps(meta)
    assert build.metadata_for(cfg, _variant(build, "cpu", []))["backend"] == {"type": "cpu"}

    text = GOOD.replace('license = "Apache-2.0"\n', 'license = "Apache-2.0"\nupstream = "https://github.com/org/kernels"\n'
                        'source = "git@github.com:org/fused-mlp.git"\n'
                        'kernel-depends = [{ repo-id = "kernels-community/activation", version = 1 }]\n')
    text = text.replace("[general.hub]", '[general.cuda]\npython-depends = ["nvidia-cutlass-dsl"]\n'
                        'kernel-depends = [{ repo-id = "org/dep", revision = "abc123" }]\n\n[general.hub]')
    cfg = load_build_config(write_toml(tmp_path, text))
    cuda = build.metadata_for(cfg, _variant(build, "cuda", ["9.0"]))
    cpu = build.metadata_for(cfg, _variant(build, "cpu", []))
    assert list(cuda)[:7] == ["name", "id", "version", "license", "kernels-minver", "upstream", "source"]
    assert cuda["upstream"] == cpu["upstream"] == "https://github.com/org/kernels"
    assert cuda["source"] == "git@github.com:org/fused-mlp.git"
    assert cuda["python-depends"] == ["nvidia-cutlass-dsl"] and cpu["python-depends"] == []
    assert cpu["kernel-depends"] == [{"repo-id": "kernels-community/activation", "version": 1}]
    assert cuda["kernel-depends"] == cpu["kernel-depends"] + [{"repo-id": "org/dep", "revision": "abc123"}]
    kernels_rust = pytest.importorskip("kernels._rust")  # the `kernels` loader accepts what we write
    parsed = kernels_rust.Metadata.from_bytes(json.dumps(cuda).encode())
    assert parsed.upstream == "https://github.com/org/kernels" and len(parsed.kernel_depends) == 2


@pytest.mark.parametrize(
    "general, message",
    [
        ('upstream = "https://huggingface.co/kernels-community/fused-mlp"', None),  # a URL kernel-builder accepts
        ('upstream = "kernels-community/fused-mlp"', "must be a git URL"),
        ('upstream = "ftp://example.org/repo"', "not a git URL"),
        ('source = "/local/path"', "must be a git URL"),
        ("upstream = 3", "must be a git URL"),
        ('python-depends = ["nvidia-cutlass-dsl"]', "not a dependency kernel-builder knows"),  # CUDA-only
        ('kernel-depends = [{ repo-id = "a/b" }]', "exactly one of `version` and `revision`"),
        ('kernel-depends = [{ repo-id = "a/b", version = 1, revision = "x" }]', "exactly one of"),
        ('kernel-depends = [{ repo-id = "ab", version = 1 }]', "must look like 'org/name'"),
        ('kernel-depends = [{ repo-id = "a/b", version = 1, branch = "x" }]', "unknown key"),
    ],
)
def test_general_metadata_keys_are_checked(tmp_path, general, message):
    text = GOOD.replace('license = "Apache-2.0"\n', f'license = "Apache-2.0"\n{general}\n')
    if message is None:
        load_build_config(write_toml(tmp_path, text))
        return
    with pytest.raises(BuildConfigError, match=message):
        load_build_config(write_toml(tmp_path, text))


def test_per_source_capabilities_and_the_sm90a_kernel(monkeypatch):
    """Each .cu is compiled for its own section's capabilities (the CUTLASS GEMM-epilogue kernel for 9.0a only, the
    others without it); naming "9.0" in FUSED_MLP_CUDA_CAPABILITIES keeps "9.0a"; a build without any of a source's
    capabilities compiles its host code only (-DFUSED_MLP_NO_ARCH); the CUTLASS headers come from nvidia-cutlass."""
    import build

    cfg = load_build_config(ROOT / "build.toml")
    gated = ROOT / "kernels_src" / "cuda" / "gated_gemm_sm90.cu"
    geglu = ROOT / "kernels_src" / "cuda" / "geglu.cu"
    assert cfg.source_capabilities(gated) == ["9.0a"]
    monkeypatch.setenv(build.CAPS_ENV, "9.0")
    caps = build.narrow_capabilities(cfg.cuda_capabilities())
    assert caps == ["9.0", "9.0a"]
    base = ["-O3", "-gencode=arch=compute_80,code=sm_80"]
    g = build.source_nvcc_flags(cfg, gated, caps, base)
    assert "-gencode=arch=compute_90a,code=sm_90a" in g and "-gencode=arch=compute_90,code=sm_90" not in g
    assert not any("sm_80" in f for f in g) and "-DFUSED_MLP_NO_ARCH" not in g
    e = build.source_nvcc_flags(cfg, geglu, caps, base)
    assert "-gencode=arch=compute_90,code=sm_90" in e and not any("90a" in f for f in e)
    none = build.source_nvcc_flags(cfg, gated, ["8.0"], base)
    assert "-DFUSED_MLP_NO_ARCH" in none and "-gencode=arch=compute_80,code=sm_80" in none
    assert any(d.startswith("cutlass_") for d in cfg.source_depends(gated, "cuda"))
    try:
        inc = build.cutlass_include()
    except build.BuildError as err:  # nvidia-cutlass not installed: the error says how to get it
        assert "nvidia-cutlass" in str(err)
    else:
        assert (inc / "cute" / "tensor.hpp").exists()
        assert str(inc) in build.source_includes(cfg, gated, "cuda", ROOT)


def test_abi_check_is_skipped_without_kernel_abi_check(tmp_path, monkeypatch, capsys):
    """Without the kernel-abi-check package the build says so and goes on (it crashed: tools/abi_check.py imports the
    package lazily, so the build's ImportError guard never saw it missing); with --abi-check it is an error."""
    import importlib

    build = importlib.import_module("build")
    monkeypatch.setitem(sys.modules, "kernel_abi_check", None)  # `import kernel_abi_check` raises ImportError
    (tmp_path / "_fused_mlp_cpu_0.abi3.so").write_bytes(b"")
    build.abi_check(tmp_path, strict=False)
    assert "kernel-abi-check is not installed" in capsys.readouterr().out
    with pytest.raises(build.BuildError, match="kernel-abi-check is not installed"):
        build.abi_check(tmp_path, strict=True)


# ---- tools/setup.sh: the virtual environment ---------------------------------------------------------------------


def test_setup_creates_an_isolated_venv_and_builds_with_it(tmp_path):
    """tools/setup.sh makes .venv/ when it is missing (no system site-packages: a package the requirements forget
    fails everywhere), installs the requirements into it and builds with its interpreter (FUSED_MLP_ABI passed on
    as --abi); a second run reuses it; a venv that sees the system site-packages is refused. The installs and the
    build are stand-ins here (the real ones are what CI runs)."""
    (tmp_path / "tools").mkdir()
    shutil.copy2(ROOT / "tools" / "setup.sh", tmp_path / "tools" / "setup.sh")
    (tmp_path / "tools" / "requirements.txt").write_text("pip\n")  # in every venv: installs without a download
    (tmp_path / "tools" / "build.py").write_text(
        "import json, sys\nopen('build-call.json', 'w').write(json.dumps([sys.prefix, sys.argv[1:]]))\n")
    fake_bin = tmp_path / "bin"  # the system tools "are installed": no apt-get from a test
    fake_bin.mkdir()
    for tool in ("aarch64-linux-gnu-g++", "jq"):
        (fake_bin / tool).write_text("#!/bin/sh\nexit 0\n")
        (fake_bin / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}", "PYTHON": sys.executable}
    env.pop("FUSED_MLP_ABI", None)
    env.pop("VIRTUAL_ENV", None)

    def setup(**extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "tools/setup.sh"], cwd=tmp_path, env={**env, **extra}, capture_output=True,
                              text=True, timeout=600)

    proc = setup()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    venv = tmp_path / ".venv"
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()
    prefix, args = json.loads((tmp_path / "build-call.json").read_text())
    assert Path(prefix) == venv and args == ["--abi-check"]
    (venv / "marker").write_text("")
    proc = setup(FUSED_MLP_ABI="all")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (venv / "marker").exists(), "an existing .venv must be reused"
    assert json.loads((tmp_path / "build-call.json").read_text())[1] == ["--abi-check", "--abi", "all"]

    shutil.rmtree(venv)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    proc = setup()
    assert proc.returncode == 1 and "system site-packages" in proc.stderr, proc.stdout + proc.stderr


# ---- tools/cross_compile_check.py: aarch64-linux ----------------------------------------------------------------

CROSS_CXX = "aarch64-linux-gnu-g++"


def cross_tool():
    import cross_compile_check

    return cross_compile_check


def test_cross_compile_plan_covers_every_source_and_abi(tmp_path):
    """Every compiled source of each variant, per-torch and stable ABI, with the build's own flags and the cross
    compiler (as nvcc's host compiler for the .cu files); and an object that is not aarch64 code is refused."""
    cross, build = cross_tool(), build_tool()
    cfg = load_build_config(ROOT / "build.toml")
    # The plan's nvcc is what find_cuda says now: computing the flags sets CUDA_HOME (build.compile_flags), after
    # which find_cuda looks there only and may name the same toolkit's nvcc by another path.
    nvcc = build.find_cuda()[0]
    has_nvcc = nvcc is not None
    try:
        build.cutlass_include()
        has_cutlass = True
    except build.BuildError:
        has_cutlass = False
    backends = ["cpu"] + (["cuda"] if has_nvcc and has_cutlass else [])
    if has_nvcc and not has_cutlass:  # nvcc without tools/requirements.txt (the GPU machine's image): how to fix it
        with pytest.raises(build.BuildError, match="nvidia-cutlass"):
            cross.plan(cfg, CROSS_CXX, ["cuda"], "all", ["9.0", "9.0a"], tmp_path)
    jobs, notes = cross.plan(cfg, CROSS_CXX, backends, "all", ["9.0", "9.0a"], tmp_path)
    want = {(b, m, s) for b in backends for m in (None, cfg.stable_abi[b]) for s in build.compiled_sources(cfg, b)}
    assert {(j.backend, j.stable_abi, j.src) for j in jobs} == want
    for j in jobs:
        stable = any(f.startswith("-DTORCH_TARGET_VERSION=") for f in j.cmd)
        assert stable == (j.stable_abi is not None), j.label
        if j.src.suffix == ".cu":
            assert f"-ccbin={CROSS_CXX}" in j.cmd and j.cmd[0] == nvcc
        else:
            assert j.cmd[0] == CROSS_CXX and "-std=c++20" in j.cmd
        assert j.cmd[-4:] == ["-c", str(j.src), "-o", str(j.obj)]
    if "cuda" in backends:
        assert notes and f"-ccbin {CROSS_CXX}" in notes[0]

    if shutil.which("g++") is None:
        return
    src = tmp_path / "probe.cpp"
    src.write_text("int fused_mlp_probe(int x) { return x + 1; }\n")
    host = cross.Job("cpu", None, ROOT / "kernels_src" / "cpu" / "addmm.cpp",
                     ["g++", "-c", str(src), "-o", str(tmp_path / "probe.o")], tmp_path / "probe.o")
    _, problem, _ = cross.run_job(host)
    assert problem is not None and "is not aarch64 code" in problem


@pytest.mark.skipif(shutil.which(CROSS_CXX) is None, reason=f"{CROSS_CXX} not installed (tools/setup.sh installs it)")
def test_cross_compile_check_catches_x86_only_code(tmp_path):
    """geglu.cpp compiles for aarch64; x86-only code without an `#if defined(__x86_64__)` guard is reported."""
    ok = subprocess.run([sys.executable, str(ROOT / "tools" / "cross_compile_check.py"), "--backend", "cpu", "--abi",
                         "stable", "--source", "kernels_src/cpu/geglu.cpp"], cwd=ROOT, capture_output=True, text=True,
                        timeout=900)
    assert ok.returncode == 0 and "all 1 compiles produced aarch64-linux code" in ok.stdout, ok.stdout + ok.stderr
    root = copy_tree(tmp_path)
    addmm = root / "kernels_src" / "cpu" / "addmm.cpp"
    addmm.write_text(addmm.read_text() + '\n__attribute__((target("avx2"))) int fused_mlp_probe(int x) { return x; }\n')
    bad = subprocess.run([sys.executable, str(root / "tools" / "cross_compile_check.py"), "--backend", "cpu", "--abi",
                          "torch", "--source", "kernels_src/cpu/addmm.cpp"], cwd=root, capture_output=True, text=True,
                         timeout=900)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "kernels_src/cpu/addmm.cpp (cpu, per-torch) does not compile for aarch64-linux" in bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("fused-mlp cross-compile error: 1 of 1 compiles failed")


def test_symbols_from_the_source(tmp_path):
    """symbols.json (kernels >= 0.19 `describe-api`) from the package source: `__all__` less the submodules, the
    layers' kernelize attributes (null where unset); a name that is not a class, or no literal `__all__`, fails."""
    build = build_tool()
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import layers\nfrom .ops import f, g\n__all__ = ['f', 'layers', 'g']\n")
    (pkg / "layers.py").write_text("class A:\n    has_backward = False\n    can_torch_compile = True\n\n\n"
                                   "class B:\n    pass\n\n\nclass _C:\n    pass\n\n\n__all__ = ['B', 'A']\n")
    assert build.symbols_for(pkg) == {
        "schema_version": 1, "functions": [{"name": "f"}, {"name": "g"}],
        "layers": [{"name": "B", "attributes": {"has_backward": None, "can_torch_compile": None}},
                   {"name": "A", "attributes": {"has_backward": False, "can_torch_compile": True}}]}
    (pkg / "layers.py").write_text("D = object\n__all__ = ['D']\n")
    with pytest.raises(build.BuildError, match="not a class defined there"):
        build.symbols_for(pkg)
    (pkg / "layers.py").unlink()
    assert build.symbols_for(pkg)["layers"] == []
    (pkg / "__init__.py").write_text("names = ['f']\n__all__ = names\n")
    with pytest.raises(build.BuildError, match="no literal __all__"):
        build.symbols_for(pkg)
