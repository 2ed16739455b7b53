#!/usr/bin/env python3
"""Non-Nix build of the fused-mlp kernel: reads build.toml, writes build/<variant>/ like kernel-builder.

    python tools/build.py                     # the variants kernel-builder builds, for every backend this machine can
    python tools/build.py --backend cpu       # only the CPU variant
    FUSED_MLP_CUDA_CAPABILITIES=9.0 python tools/build.py --backend cuda   # quick CUDA build
    python tools/build.py --abi all           # also the per-torch variants (the tests that compare the two builds)

The variant set is kernel-builder's: for a backend that build.toml's `[torch.stable-abi]` names, only the stable-ABI
variant (`torch-stable-abi210-cpu-<arch>-linux`, `torch-stable-abi210-cu<VER>-<arch>-linux`: one binary for every
torch >= 2.10); for any other backend the per-torch one (`torch<XY>-cxx11-cpu-<arch>-linux`, ...). `--abi torch`
builds the per-torch variants instead, `--abi all` both. Each variant holds
the Python package from torch-ext/fused_mlp/, a generated `_ops.py`, an abi3 extension module
`_fused_mlp_<backend>_<hash>.abi3.so` whose op namespace is the same unique name, `symbols.json` (the public
functions and layers, which `kernels describe-api` lists: kernels >= 0.19) and `metadata.json`.
Compilation goes through ninja (incremental, header dependencies tracked) with the include and library paths
that `torch.utils.cpp_extension` reports; intermediate files live in `.build/` (git-ignored). A variant
directory is assembled aside and moved into place only when everything succeeded, so a failed build never
leaves a half-written variant behind.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from build_config import BuildConfig, BuildConfigError, load_build_config  # noqa: E402

CAPS_ENV = "FUSED_MLP_CUDA_CAPABILITIES"


class BuildError(RuntimeError):
    """A build problem reported to the user as one line."""


@dataclass
class Toolchain:
    cxx: str
    nvcc: str | None
    cuda_home: Path | None
    ninja: str


@dataclass
class Variant:
    backend: str  # "cpu" or "cuda"
    name: str  # build/<name>
    namespace: str = ""  # op namespace == extension module name
    capabilities: list[str] = field(default_factory=list)
    stable_abi: str | None = None  # "2.10": built against torch's stable ABI, loads under every torch >= 2.10


# --------------------------------------------------------------------------------------------------------
# Environment discovery
# --------------------------------------------------------------------------------------------------------


def _torch():
    try:
        import torch  # noqa: F401
    except ImportError as e:  # pragma: no cover - reported to the user
        raise BuildError(f"torch is not importable ({e}); install torch first") from e
    import torch

    return torch


def torch_tag(torch) -> str:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return f"torch{major}{minor}"


def find_ninja() -> str:
    exe = shutil.which("ninja")
    if exe:
        return exe
    try:
        import ninja  # type: ignore

        cand = Path(ninja.BIN_DIR) / "ninja"
        if cand.exists():
            return str(cand)
    except ImportError:
        pass
    raise BuildError("ninja was not found; `pip install ninja`")


def find_cxx() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx or not shutil.which(cxx):
        raise BuildError("no C++ compiler found (set CXX or install g++)")
    return cxx


def find_cuda() -> tuple[str | None, Path | None]:
    """nvcc and the CUDA toolkit root, or (None, None). CUDA_HOME, when set, is the only place looked at."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        candidates = [Path(home) / "bin" / "nvcc"]
    else:
        candidates = [Path(p) for p in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc") if p]
    for nvcc in candidates:
        if not nvcc.exists():
            continue
        # The toolkit root holds include/cuda_runtime.h; a /usr/local/bin/nvcc symlink points into it.
        for root in (nvcc.resolve().parent.parent, nvcc.parent.parent, Path("/usr/local/cuda")):
            if (root / "include" / "cuda_runtime.h").exists():
                return str(nvcc), root
    return None, None


def nvcc_version(nvcc: str) -> tuple[int, int]:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise BuildError(f"cannot parse `{nvcc} --version`")
    return int(m.group(1)), int(m.group(2))


def pip_nvidia_dirs(kind: str) -> list[Path]:
    """include/ or lib/ directories of the NVIDIA pip packages torch depends on (cuBLAS lives there)."""
    import site

    out = []
    for sp in {*site.getsitepackages(), site.getusersitepackages(), sysconfig.get_paths()["purelib"]}:
        base = Path(sp) / "nvidia"
        if not base.is_dir():
            continue
        for sub in sorted(base.iterdir()):
            d = sub / kind
            if d.is_dir():
                out.append(d)
    return out


def find_cublaslt(cuda_home: Path) -> tuple[Path, Path, str]:
    """(include dir, lib dir, linker name) for cuBLASLt: the toolkit's, else the one torch's wheels bring."""
    for inc, lib in [(cuda_home / "include", cuda_home / "lib64")] + [
        (d, d.parent / "lib") for d in pip_nvidia_dirs("include")
    ]:
        if not (inc / "cublasLt.h").exists() or not lib.is_dir():
            continue
        libs = sorted(lib.glob("libcublasLt.so*"))
        if not libs:
            continue
        plain = lib / "libcublasLt.so"
        return inc, lib, "-lcublasLt" if plain.exists() else f"-l:{libs[0].name}"
    raise BuildError("cuBLASLt headers/library not found (CUDA toolkit or the nvidia-cublas pip package)")


# --------------------------------------------------------------------------------------------------------
# Variant planning
# --------------------------------------------------------------------------------------------------------


def host_arch() -> str:
    """The variant-name platform of this machine: `x86_64-linux`, `aarch64-linux`."""
    machine = platform.machine().lower()
    return f"{ {'amd64': 'x86_64', 'arm64': 'aarch64'}.get(machine, machine)}-linux"


def stable_tag(version: str) -> str:
    """`torch-stable-abi210` for "2.10" (the `kernels` loader's name for a stable-ABI variant)."""
    major, minor = version.split(".")[:2]
    return f"torch-stable-abi{major}{minor}"


def stable_define(version: str) -> str:
    """TORCH_TARGET_VERSION for "2.10": 0xMMmmpppp00000000 (major, minor, patch 0), as torch/headeronly/version.h."""
    major, minor = (int(p) for p in version.split(".")[:2])
    return f"-DTORCH_TARGET_VERSION=0x{major:02X}{minor:02X}000000000000"


ABI_CHOICES = ("auto", "torch", "stable", "all")


def plan_variants(cfg: BuildConfig, requested: str, tc: Toolchain, abi: str = "auto") -> list[Variant]:
    """The variants to build. abi "auto" is kernel-builder's set: the stable-ABI variant (`torch-stable-abi<XY>-...`)
    for a backend that build.toml's `[torch.stable-abi]` names, else the per-torch one (`torch<XY>-cxx11-...`);
    "torch": per-torch only; "stable": stable-ABI only; "all": both."""
    if abi not in ABI_CHOICES:
        raise BuildError(f"unknown ABI selection {abi!r} (one of {', '.join(ABI_CHOICES)})")
    torch = _torch()
    tag = torch_tag(torch)
    plat = host_arch()
    want_cpu = requested in ("auto", "all", "cpu")
    want_cuda = requested in ("auto", "all", "cuda")
    variants: list[Variant] = []

    def add(backend: str, arch: str, caps: list[str] | None = None) -> None:
        target = cfg.stable_abi.get(backend)
        if abi in ("torch", "all") or (abi == "auto" and target is None):
            variants.append(Variant(backend, f"{tag}-cxx11-{arch}", capabilities=list(caps or [])))
        if abi in ("stable", "all", "auto") and target is not None:
            have = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
            if have < tuple(int(p) for p in target.split(".")[:2]):
                raise BuildError(f"the stable-ABI variant targets torch {target} but torch {torch.__version__} is "
                                 "older: build it with a newer torch")
            variants.append(Variant(backend, f"{stable_tag(target)}-{arch}", capabilities=list(caps or []),
                                    stable_abi=target))
        elif abi == "stable" and target is None:
            raise BuildError(f"build.toml sets no [torch.stable-abi] version for the {backend} backend")

    if want_cpu:
        if "cpu" not in cfg.backends:
            raise BuildError("build.toml does not list the cpu backend")
        add("cpu", f"cpu-{plat}")
    if want_cuda and "cuda" in cfg.backends:
        explicit = requested in ("cuda", "all")
        if torch.version.cuda is None:
            if explicit:
                raise BuildError(f"the installed torch {torch.__version__} is not a CUDA build; cannot build cuda")
        elif tc.nvcc is None:
            if explicit:
                raise BuildError("CUDA backend requested but nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
        else:
            t_major, t_minor = (int(v) for v in torch.version.cuda.split(".")[:2])
            n_major, n_minor = nvcc_version(tc.nvcc)
            if n_major != t_major:
                raise BuildError(
                    f"nvcc is CUDA {n_major}.{n_minor} but torch was built with CUDA {torch.version.cuda}: "
                    "the major versions must match for the variant to load"
                )
            caps = narrow_capabilities(cfg.cuda_capabilities())
            add("cuda", f"cu{t_major}{t_minor}-{plat}", caps)
    elif requested == "cuda":
        raise BuildError("build.toml does not list the cuda backend")
    return variants


def cap_base(c: str) -> str:
    """"9.0a" -> "9.0": the capability an arch-specific ("a") or family ("f") target belongs to."""
    return re.sub(r"[af]?(\+PTX)?$", "", c)


def narrow_capabilities(all_caps: list[str]) -> list[str]:
    """build.toml's capabilities cut to those FUSED_MLP_CUDA_CAPABILITIES names; naming "9.0" keeps "9.0a" too."""
    env = os.environ.get(CAPS_ENV, "").replace(";", ",").replace(" ", ",")
    wanted = [c for c in env.split(",") if c]
    if not wanted:
        return all_caps
    unknown = [c for c in wanted if c not in all_caps and c not in {cap_base(a) for a in all_caps}]
    if unknown:
        raise BuildError(f"{CAPS_ENV} names {unknown}, not in build.toml's cuda-capabilities {all_caps}")
    return [c for c in all_caps if c in wanted or cap_base(c) in wanted]


def source_nvcc_flags(cfg: BuildConfig, src: Path, variant_caps: list[str], nvcc_flags: list[str]) -> list[str]:
    """The variant's nvcc flags for one .cu source: -gencode for the capabilities of the build.toml section(s)
    that list it (as kernel-builder compiles each kernel for its own list), cut to the variant's. A source none of
    whose capabilities is in the build is still compiled (the binding links its entry points) for the variant's
    capabilities, with -DFUSED_MLP_NO_ARCH: it must then compile its host code only and report that at run time."""
    own = [c for c in variant_caps if c in set(cfg.source_capabilities(src))]
    rest = [f for f in nvcc_flags if not f.startswith("-gencode=")]
    if own:
        return rest + gencode_flags(own)
    plain = [c for c in variant_caps if c == cap_base(c)] or variant_caps
    return rest + gencode_flags(plain) + ["-DFUSED_MLP_NO_ARCH"]


def cutlass_include() -> Path:
    """CUTLASS's headers, from the nvidia-cutlass registry package (tools/requirements.txt pins it)."""
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        raise BuildError("a kernel depends on CUTLASS but the nvidia-cutlass package is not installed "
                         "(pip install -r tools/requirements.txt)")
    inc = Path(list(spec.submodule_search_locations)[0]) / "source" / "include"
    if not (inc / "cutlass" / "cutlass.h").exists():
        raise BuildError(f"nvidia-cutlass is installed but has no headers at {inc}")
    return inc


# --------------------------------------------------------------------------------------------------------
# Generated glue (what kernel-builder generates)
# --------------------------------------------------------------------------------------------------------

REGISTRATION_H = """\
// Generated by tools/build.py for {variant}; do not edit.
// The op namespace and the extension module name are the same unique identifier, so that several builds of
// this kernel can be loaded into one process.
#pragma once
#include <Python.h>

#define _CONCAT(A, B) A##B
#define CONCAT(A, B) _CONCAT(A, B)
#define _STRINGIFY(A) #A
#define STRINGIFY(A) _STRINGIFY(A)

// TORCH_LIBRARY (and the stable-ABI forms) with a macro-expanded namespace.
#define TORCH_LIBRARY_EXPAND(NAME, MODULE) TORCH_LIBRARY(NAME, MODULE)
#define STABLE_TORCH_LIBRARY_EXPAND(NAME, MODULE) STABLE_TORCH_LIBRARY(NAME, MODULE)
#define STABLE_TORCH_LIBRARY_IMPL_EXPAND(NAME, DEVICE, MODULE) STABLE_TORCH_LIBRARY_IMPL(NAME, DEVICE, MODULE)

// An empty Python module, so that `from . import <name>` loads the shared library and its registrations.
#define REGISTER_EXTENSION(NAME)                                                         \\
  PyMODINIT_FUNC CONCAT(PyInit_, NAME)() {{                                               \\
    static struct PyModuleDef module = {{PyModuleDef_HEAD_INIT, STRINGIFY(NAME), nullptr, 0, nullptr}}; \\
    return PyModule_Create(&module);                                                     \\
  }}
"""

OPS_PY = '''\
# Generated by tools/build.py for {variant}; do not edit.
import torch

from . import {namespace}

ops = torch.ops.{namespace}


def add_op_namespace_prefix(op_name: str) -> str:
    """Prefix op by namespace."""
    return f"{namespace}::{{op_name}}"
'''


# --------------------------------------------------------------------------------------------------------
# Ninja file
# --------------------------------------------------------------------------------------------------------


@dataclass
class CompileFlags:
    """Everything the compilers get for one variant, shared by the ninja build and tools/check_cuda_toolkits.py.
    Per-source include directories come from `source_includes` (kernel-builder sets them per file)."""

    cxx: list[str]  # g++ flags, defines and system includes
    nvcc: list[str]  # nvcc flags (incl. -gencode), defines and system includes
    ldflags: list[str]


def gencode_flags(capabilities: list[str]) -> list[str]:
    """SASS for every capability, plus PTX of the newest one so newer GPUs can JIT-compile the kernels."""
    out = []
    for cap in capabilities:
        num = cap.replace(".", "")
        out.append(f"-gencode=arch=compute_{num},code=sm_{num}")
    newest = capabilities[-1].replace(".", "")
    out.append(f"-gencode=arch=compute_{newest},code=compute_{newest}")
    return out


def torch_nvcc_flags() -> list[str]:
    """The nvcc flags kernel-builder derives from torch (utils.cmake get_torch_gpu_compiler_flags): torch's
    COMMON_NVCC_FLAGS, minus the __CUDA_NO_HALF*/BFLOAT16 defines (removed for CUDA >= 11.8), plus -DENABLE_FP8."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    drop = {"-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
            "-D__CUDA_NO_HALF2_OPERATORS__"}
    return [f for f in COMMON_NVCC_FLAGS if f not in drop] + ["-DENABLE_FP8"]


def nvcc_std_flags(torch, stable_abi: str | None) -> list[str]:
    """nvcc's -std. kernel-builder passes none (nvcc's default, C++17) and builds only the stable-ABI variants when
    build.toml sets [torch.stable-abi], so those compile the .cu files, our headers and torch's header-only API as
    C++17. A per-torch variant includes ATen/c10, which torch >= 2.12 writes in C++20 (c10/util/intrusive_ptr.h
    declares operator<=>; torch's own extension builds pass -std=c++20 to nvcc): there, C++20."""
    if stable_abi is not None:
        return []
    major, minor = (int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    return ["-std=c++20"] if (major, minor) >= (2, 12) else []


def compile_flags(cfg: BuildConfig, backend: str, tc: Toolchain, capabilities: list[str],
                  extra_cuda_includes: list[Path] | None = None, stable_abi: str | None = None) -> CompileFlags:
    """Compiler and linker flags of a `backend` variant built with toolchain `tc` for `capabilities`.
    `extra_cuda_includes` go before the toolkit's own headers (the CUDA-toolkit check uses it)."""
    torch = _torch()
    if tc.cuda_home is not None:
        os.environ.setdefault("CUDA_HOME", str(tc.cuda_home))  # keeps cpp_extension from guessing (and warning)
    from torch.utils import cpp_extension

    torch_inc = cpp_extension.include_paths("cpu")[0]  # .../torch/include (no heavy api/ dir needed)
    torch_lib = cpp_extension.library_paths("cpu")[0]
    py_inc = sysconfig.get_paths()["include"]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)

    defs = [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DPy_LIMITED_API=0x03090000"]
    sys_inc = [f"-isystem {torch_inc}", f"-isystem {py_inc}"]
    libs = [f"-L{torch_lib}", "-lc10", "-ltorch_cpu", "-ltorch"]
    if stable_abi is not None:  # only torch's stable C shim and header-only parts: torch/csrc/stable, headeronly
        defs.append(stable_define(stable_abi))
    if backend == "cpu":
        defs.append("-DCPU_KERNEL")
    cxx = ["-O3", "-std=c++20", "-fPIC", "-fvisibility=hidden", "-fopenmp", "-Wall", "-Wno-unknown-pragmas"]
    nvcc: list[str] = []
    if backend == "cuda":
        if tc.cuda_home is None or tc.nvcc is None:
            raise BuildError("the cuda backend needs nvcc and a CUDA toolkit")
        blas_inc, blas_lib, blas_link = find_cublaslt(tc.cuda_home)
        defs += ["-DCUDA_KERNEL", "-DUSE_CUDA=1"]  # kernel-builder's per-backend macros
        first = [f"-I{d}" for d in (extra_cuda_includes or [])]  # -I is searched before every -isystem
        sys_inc += [f"-isystem {tc.cuda_home / 'include'}"]
        if blas_inc != tc.cuda_home / "include":
            sys_inc.append(f"-isystem {blas_inc}")
        libs += ["-lc10_cuda", "-ltorch_cuda", f"-L{tc.cuda_home / 'lib64'}", "-lcudart", f"-L{blas_lib}", blas_link]
        nvcc = (["-O3", *nvcc_std_flags(torch, stable_abi), "-lineinfo", "-Xcompiler=-fPIC",
                 "-Xcompiler=-fvisibility=hidden", f"-ccbin={tc.cxx}"] + torch_nvcc_flags() + gencode_flags(capabilities)
                + cfg.cuda_flags() + defs + first + sys_inc)
    return CompileFlags(cxx=cxx + defs + sys_inc + cfg.cxx_flags(), nvcc=nvcc,
                        ldflags=["-shared", "-fopenmp"] + libs + libstdcxx_link_flags(tc.cxx))


def libstdcxx_link_flags(cxx: str) -> list[str]:
    """Make sure the extension links the shared libstdc++ (the one torch and the interpreter use).

    A toolchain whose g++ has only ``libstdc++.a`` in its own directory (the ``libstdc++.so`` symlink missing, as
    on the GPU machine's gcc 13.3) silently links a *static* copy of libstdc++ into the extension. Two copies of
    the iostream/locale machinery in one process then crash the first time the extension formats a number into
    an error message (seen: a segfault in ``ostream::_M_insert<long>`` under ``TORCH_CHECK``). Name the shared
    library explicitly when the driver would not find it by itself."""
    def where(name: str) -> Path | None:
        try:
            out = subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return None
        p = Path(out.stdout.strip())
        return p if out.returncode == 0 and p.is_absolute() and p.exists() else None

    if where("libstdc++.so") is not None:
        return []  # the driver's own -lstdc++ finds the shared library
    if where("libstdc++.so.6") is not None:
        return ["-l:libstdc++.so.6"]
    if where("libstdc++.a") is None:
        return []  # not GNU libstdc++ (clang with libc++, say): nothing to force
    raise BuildError(f"{cxx} can only link libstdc++ statically (no libstdc++.so or libstdc++.so.6 next to it); "
                     "install the shared libstdc++ development package (e.g. libstdc++-<ver>-dev)")


# Symbols only a static copy of libstdc++ defines inside an extension (a normal build imports them).
_STATIC_LIBSTDCXX_MARKERS = ("std::locale::classic()", "std::ios_base::Init::Init()")


def static_libstdcxx_problem(so: Path) -> str | None:
    """Why `so` carries its own copy of libstdc++ (see libstdcxx_link_flags), or None. Needs binutils' nm."""
    nm = shutil.which("nm")
    if nm is None:
        return None
    out = subprocess.run([nm, "-C", "--defined-only", str(so)], capture_output=True, text=True)
    found = [m for m in _STATIC_LIBSTDCXX_MARKERS if m in out.stdout]
    if not found:
        return None
    return (f"{so.name} defines libstdc++'s own {found[0]}: a static copy of libstdc++ was linked in, which crashes "
            "next to torch's shared one; link the shared libstdc++ (install libstdc++-<ver>-dev)")


def source_includes(cfg: BuildConfig, src: Path, backend: str, gen: Path) -> list[str]:
    """-I flags of one source, as kernel-builder gives them: the include directories of the build.toml section
    that lists it (plus, for the binding, the directory of the generated registration.h)."""
    dirs = cfg.include_dirs_for(src, backend)
    if src in cfg.torch_src:
        dirs = [gen, *dirs]
    flags = [f"-I{d}" for d in dirs]
    if any(d.startswith("cutlass_") for d in cfg.source_depends(src, backend)):
        flags += ["-isystem", str(cutlass_include())]  # kernel-builder: the cutlass_<X_Y> dependency's headers
    return flags


def compiled_sources(cfg: BuildConfig, backend: str) -> list[Path]:
    return [s for s in cfg.sources_for(backend) if s.suffix not in (".h", ".cuh", ".hpp")]


def _esc(p: str | Path) -> str:
    return str(p).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def write_ninja(cfg: BuildConfig, v: Variant, tc: Toolchain, work: Path) -> Path:
    gen = work / "gen"
    flags = compile_flags(cfg, v.backend, tc, v.capabilities, stable_abi=v.stable_abi)

    # TORCH_EXTENSION_NAME changes with every build's content hash, so only the binding files get it (a ninja
    # per-edge variable): a change elsewhere then recompiles the binding and relinks, not every kernel.
    objs = []
    lines = [
        f"# Generated by tools/build.py for {v.name}; do not edit.",
        "ninja_required_version = 1.3",
        f"cxx = {tc.cxx}",
        f"cxxflags = {' '.join(flags.cxx)}",
        "rule cxx",
        "  command = $cxx -MMD -MF $out.d $cxxflags $incs $defs -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = CXX $in",
    ]
    if v.backend == "cuda":
        lines += [
            f"nvcc = {tc.nvcc}",
            f"nvccflags = {' '.join(flags.nvcc)}",
            "rule nvcc",
            "  command = $nvcc -MD -MF $out.d $nvccflags $incs $defs -c $in -o $out",
            "  depfile = $out.d",
            "  deps = gcc",
            "  description = NVCC $in",
        ]
    lines += [
        f"ldflags = {' '.join(flags.ldflags)}",
        "rule link",
        "  command = $cxx $in -o $out $ldflags",
        "  description = LINK $out",
    ]
    for src in compiled_sources(cfg, v.backend):
        rule = "nvcc" if src.suffix == ".cu" else "cxx"
        obj = work / "obj" / (str(src.relative_to(ROOT)).replace("/", "__") + ".o")
        objs.append(obj)
        lines.append(f"build {_esc(obj)}: {rule} {_esc(src)}")
        lines.append(f"  incs = {' '.join(source_includes(cfg, src, v.backend, gen))}")
        if rule == "nvcc":
            lines.append(f"  nvccflags = {' '.join(source_nvcc_flags(cfg, src, v.capabilities, flags.nvcc))}")
        if src in cfg.torch_src:
            lines.append(f"  defs = -DTORCH_EXTENSION_NAME={v.namespace}")
    so = work / f"{v.namespace}.abi3.so"
    lines.append(f"build {_esc(so)}: link {' '.join(_esc(o) for o in objs)}")
    lines.append(f"default {_esc(so)}")
    text = "\n".join(lines) + "\n"
    ninja_file = work / "build.ninja"
    if not ninja_file.exists() or ninja_file.read_text() != text:
        ninja_file.write_text(text)
    return so


# --------------------------------------------------------------------------------------------------------
# Build one variant
# --------------------------------------------------------------------------------------------------------


def content_hash(cfg: BuildConfig, v: Variant) -> str:
    h = hashlib.sha256()
    h.update(v.name.encode())
    h.update(" ".join(v.capabilities).encode())
    files = sorted(set(cfg.sources_for(v.backend)) | set((ROOT / "torch-ext" / cfg.python_name).rglob("*.py")))
    for f in files:
        h.update(str(f.relative_to(ROOT)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:10]


def write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


KERNELS_MINVER = "0.17.0"  # the oldest `kernels` this layout and metadata were checked with


def variant_digest(variant_dir: Path) -> dict | None:
    """sha256 of every file of the variant, in kernel-builder's format, so `kernels` can verify the build."""
    try:
        from kernels._rust import Digest, DigestAlgorithm
    except ImportError:
        return None
    return {"algorithm": "sha256", "files": dict(Digest.hash_variant(DigestAlgorithm.SHA256, str(variant_dir)).files)}


def _all_names(tree: ast.Module, path: Path) -> list[str]:
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
                and isinstance(node.value, (ast.List, ast.Tuple))):
            return [ast.literal_eval(e) for e in node.value.elts]
    raise BuildError(f"{path} has no literal __all__ (symbols.json lists the public names from it)")


def symbols_for(pkg_src: Path) -> dict:
    """symbols.json, schema 1 as `kernels describe-api` reads it (kernels >= 0.19): the package's public functions
    (`__all__` of __init__.py, less the submodules it imports) and its layers (`__all__` of layers.py) with their
    `has_backward` / `can_torch_compile` class attributes (null where a class does not set one). Read from the source,
    so it needs no import of the built extension (tests/packaging/test_loading.py checks it against the module)."""
    init = pkg_src / "__init__.py"
    tree = ast.parse(init.read_text())
    submodules = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) and n.level == 1
                  and n.module is None for a in n.names}
    symbols: dict = {"schema_version": 1,
                     "functions": [{"name": n} for n in _all_names(tree, init) if n not in submodules],
                     "layers": []}
    layers_py = pkg_src / "layers.py"
    if layers_py.exists():
        tree = ast.parse(layers_py.read_text())
        classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        for name in _all_names(tree, layers_py):
            if name not in classes:
                raise BuildError(f"{layers_py}: __all__ names {name!r}, which is not a class defined there")
            attrs: dict = {"has_backward": None, "can_torch_compile": None}
            for stmt in classes[name].body:
                if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant):
                    for t in stmt.targets:
                        if isinstance(t, ast.Name) and t.id in attrs and isinstance(stmt.value.value, bool):
                            attrs[t.id] = stmt.value.value
            symbols["layers"].append({"name": name, "attributes": attrs})
    return symbols


def metadata_for(cfg: BuildConfig, v: Variant) -> dict:
    """metadata.json as kernel-builder writes it (kernels-data Metadata::for_backend, serialised in its field order):
    `upstream` and `source` only when build.toml's [general] sets them, `kernel-depends` always, `backend.archs`
    for CUDA as the sorted set of the capabilities compiled (add_build_metadata.py: sorted(set(archs)))."""
    backend: dict = {"type": v.backend}
    if v.backend == "cuda":
        backend["archs"] = sorted(set(v.capabilities))
    meta: dict = {"name": cfg.name, "id": v.namespace, "version": cfg.version, "license": cfg.license,
                  "kernels-minver": KERNELS_MINVER}
    if cfg.upstream is not None:
        meta["upstream"] = cfg.upstream
    if cfg.source is not None:
        meta["source"] = cfg.source
    meta["python-depends"] = cfg.python_depends_for(v.backend)
    meta["kernel-depends"] = cfg.kernel_depends_for(v.backend)
    meta["backend"] = backend
    return meta


def build_variant(cfg: BuildConfig, v: Variant, tc: Toolchain, out_dir: Path, jobs: int | None, verbose: bool) -> Path:
    v.namespace = f"_{cfg.python_name}_{v.backend}_{content_hash(cfg, v)}"
    work = ROOT / ".build" / v.name
    (work / "gen").mkdir(parents=True, exist_ok=True)
    (work / "obj").mkdir(parents=True, exist_ok=True)
    write_if_changed(work / "gen" / "registration.h", REGISTRATION_H.format(variant=v.name))
    so = write_ninja(cfg, v, tc, work)

    cmd = [tc.ninja, "-C", str(work)]
    if jobs:
        cmd += ["-j", str(jobs)]
    if verbose:
        cmd.append("-v")
    print(f"[fused-mlp] building {v.name} ({v.namespace}"
          + (f", capabilities {' '.join(v.capabilities)}" if v.capabilities else "") + ")", flush=True)
    proc = subprocess.run(cmd)
    if proc.returncode != 0:
        raise BuildError(f"compilation of {v.name} failed (see the compiler output above)")
    problem = static_libstdcxx_problem(so)
    if problem is not None:
        raise BuildError(problem)
    # Old extension modules of earlier builds of this variant are stale: keep only the current one.
    for old in work.glob("_*.abi3.so"):
        if old != so:
            old.unlink()

    # Assemble the variant aside, then move it into place in one step.
    out_dir.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{v.name}.", dir=ROOT / ".build"))
    stage.chmod(0o755)  # mkdtemp makes it private; the variant is read by whoever loads the kernel
    try:
        pkg_src = ROOT / "torch-ext" / cfg.python_name
        for py in sorted(pkg_src.rglob("*.py")):
            if "__pycache__" in py.parts:
                continue
            dst = stage / py.relative_to(pkg_src)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(py, dst)
        (stage / "_ops.py").write_text(OPS_PY.format(variant=v.name, namespace=v.namespace))
        shutil.copy2(so, stage / so.name)
        (stage / "symbols.json").write_text(json.dumps(symbols_for(pkg_src), indent=2) + "\n")
        meta = metadata_for(cfg, v)
        digest = variant_digest(stage)  # before metadata.json exists: the digest never covers it
        if digest is not None:
            meta["digest"] = digest
        (stage / "metadata.json").write_text(json.dumps(meta, indent=2) + "\n")
        target = out_dir / v.name
        trash = None
        if target.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".old.{v.name}.", dir=ROOT / ".build"))
            os.replace(target, trash / "old")
        os.replace(stage, target)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
    finally:
        if stage.exists():
            shutil.rmtree(stage, ignore_errors=True)
    return out_dir / v.name


def abi_check(variant_dir: Path, strict: bool) -> None:
    try:
        import kernel_abi_check  # noqa: F401  (abi_check imports it lazily: test for it here)
        from abi_check import MANYLINUX, PYTHON_ABI, check_file
    except ImportError:
        msg = "kernel-abi-check is not installed; skipping the ABI check (`pip install kernel-abi-check`)"
        if strict:
            raise BuildError(msg)
        print(f"[fused-mlp] {msg}")
        return
    stable = variant_dir.name.startswith("torch-stable-abi")
    for so in variant_dir.glob("*.so"):
        problems = check_file(so)
        if problems:
            text = "; ".join(problems[:8])
            if strict:
                raise BuildError(f"ABI check failed for {so.name}: {text}")
            print(f"[fused-mlp] ABI check problems in {so.name}: {text}")
        else:
            print(f"[fused-mlp] ABI check passed: {so.name} (abi3 >= {PYTHON_ABI}, {MANYLINUX}"
                  + (", torch stable ABI: no torch C++ symbols" if stable else "") + ")")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=["auto", "all", "cpu", "cuda"], default="auto",
                    help="auto: cpu, plus cuda when torch is a CUDA build and nvcc exists (default); "
                         "all/cuda: fail if cuda cannot be built")
    ap.add_argument("--abi", choices=ABI_CHOICES, default="auto",
                    help="auto: what kernel-builder builds, the stable-ABI variant (torch-stable-abi<XY>-*, one binary "
                         "for every torch >= the target) for each backend build.toml's [torch.stable-abi] names, the "
                         "per-torch one (torch<XY>-cxx11-*) otherwise (default); torch: the per-torch variants; "
                         "stable: the stable-ABI variants; all: both")
    ap.add_argument("--out", type=Path, default=ROOT / "build", help="output directory (default: build/)")
    ap.add_argument("-j", "--jobs", type=int, default=None, help="parallel compile jobs (default: ninja's)")
    ap.add_argument("--abi-check", action="store_true", help="fail if kernel-abi-check reports a problem")
    ap.add_argument("--clean", action="store_true", help="remove .build/ and the output directory first")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    try:
        cfg = load_build_config(ROOT / "build.toml")
        if args.clean:
            shutil.rmtree(ROOT / ".build", ignore_errors=True)
            shutil.rmtree(args.out, ignore_errors=True)
        nvcc, cuda_home = find_cuda()
        tc = Toolchain(cxx=find_cxx(), nvcc=nvcc, cuda_home=cuda_home, ninja=find_ninja())
        variants = plan_variants(cfg, args.backend, tc, args.abi)
        for v in variants:
            path = build_variant(cfg, v, tc, args.out, args.jobs, args.verbose)
            abi_check(path, args.abi_check)
            print(f"[fused-mlp] built {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}", flush=True)
    except (BuildError, BuildConfigError) as e:
        print(f"fused-mlp build error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
