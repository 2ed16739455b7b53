#!/usr/bin/env python3
"""Compile the CUDA sources with several CUDA toolkits, for every capability in build.toml (compile only: the
objects are thrown away). The flags are tools/build.py's own (`compile_flags`, `source_includes`), so this
checks exactly what the build compiles.

    python tools/check_cuda_toolkits.py                       # CUDA 13.0 and 12.9, every capability
    python tools/check_cuda_toolkits.py --capabilities 9.0    # one capability (what .ci/run does)
    python tools/check_cuda_toolkits.py --toolkit 12.9        # one toolkit
    python tools/check_cuda_toolkits.py --abi stable          # only the stable-ABI compile (default: both)

Toolkits:
  13.0  the system toolkit (CUDA_HOME, else nvcc on PATH, else /usr/local/cuda): a real CUDA 13.0 compile.
  12.9  CUDA 12.9's headers from PyPI, in front of the system toolkit's: cuda_runtime & co
        (nvidia-cuda-runtime-cu12), CCCL 2.8 (nvidia-cuda-cccl-cu12), and the cuBLAS/cuBLASLt, cuSPARSE and
        cuSOLVER headers that torch's CUDA headers include (nvidia-{cublas,cusparse,cusolver}-cu12). Only the
        wheels' include/ trees are kept, in ~/.cache/fused-mlp/cuda-toolkits/ (FUSED_MLP_TOOLKIT_CACHE overrides),
        so a machine downloads them (~1.2 GB of wheels) once.
        PyPI has no CUDA 12 compiler: every nvidia-cuda-nvcc-cu12 wheel (12.1 ... 12.9.86) ships ptxas, libnvvm and
        the crt/ headers but no nvcc driver, cudafe++ or cicc, and 12.9's crt/ headers do not work with 13.0's
        cudafe++ (its launch stubs call `__cudaLaunch`, which 12.9's crt does not declare). So the 12.9 check
        compiles with the 13.0 compiler (and its crt/) against 12.9's library headers (CUDA_VERSION == 12090,
        CCCL 2.8, cuBLASLt 12.9): it catches CUDA-13-only runtime/library APIs and CCCL 3 features in our
        sources and in the torch headers they pull in, not 12.9 front-end bugs or 12.9 ptxas register use.
        The Nix build (flake.nix) compiles with the real CUDA 12.x toolkits of kernel-builder's matrix.

Exit status 0 when every (toolkit, source) compiled; 1 otherwise, with the compiler output of each failure.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from build_config import BuildConfigError, load_build_config  # noqa: E402

import build  # noqa: E402

CACHE = Path(os.environ.get("FUSED_MLP_TOOLKIT_CACHE")
             or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fused-mlp" / "cuda-toolkits")
# CUDA 12.9.1's library headers from PyPI (pinned: a toolkit check must not drift).
CU129_WHEELS = [
    "nvidia-cuda-runtime-cu12==12.9.79",  # cuda_runtime.h & co (CUDART_VERSION 12090)
    "nvidia-cuda-cccl-cu12==12.9.27",  # CCCL 2.8 (cub, thrust, libcu++)
    "nvidia-cublas-cu12==12.9.1.4",  # cublas_v2.h, cublasLt.h
    "nvidia-cusparse-cu12==12.5.10.65",  # cusparse.h (ATen/cuda/CUDAContextLight.h includes it)
    "nvidia-cusolver-cu12==11.7.5.82",  # cusolverDn.h (likewise)
]


@dataclass
class Toolkit:
    name: str  # "13.0", "12.9"
    tc: build.Toolchain
    extra_includes: list[Path]  # searched before the toolkit's own headers
    note: str


PROBE = """\
#include <cuda_runtime.h>
#include <cublasLt.h>
#include <cusolverDn.h>
#include <cuda/version>
#if CUDART_VERSION / 1000 != {major} || CUDART_VERSION % 1000 / 10 != {minor}
#error "cuda_runtime.h is not CUDA {major}.{minor}"
#endif
#if CUBLAS_VER_MAJOR != {major}
#error "cublasLt.h is not from CUDA {major}"
#endif
#if CCCL_MAJOR_VERSION != {cccl}
#error "CCCL is not {cccl}.x"
#endif
"""
CCCL_MAJOR = {"13.0": 3, "12.9": 2}


def probe(tk: Toolkit, cfg, caps: list[str], tmp: Path) -> None:
    """Preprocess a probe with the check's own flags: the headers found must be the toolkit's."""
    major, minor = tk.name.split(".")
    src = tmp / f"probe-{tk.name}.cu"
    src.write_text(PROBE.format(major=major, minor=minor, cccl=CCCL_MAJOR[tk.name]))
    flags = build.compile_flags(cfg, "cuda", tk.tc, caps, extra_cuda_includes=tk.extra_includes)
    proc = subprocess.run([tk.tc.nvcc, *" ".join(flags.nvcc).split(), "-E", str(src), "-o", os.devnull],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise build.BuildError(f"CUDA {tk.name}: the headers found are not CUDA {tk.name}'s: "
                               + " ".join(line for line in proc.stderr.splitlines() if "error" in line)[:500])


def system_toolkit(cxx: str, ninja: str) -> Toolkit:
    nvcc, home = build.find_cuda()
    if nvcc is None or home is None:
        raise build.BuildError("no system CUDA toolkit (set CUDA_HOME or put nvcc on PATH)")
    major, minor = build.nvcc_version(nvcc)
    return Toolkit(f"{major}.{minor}", build.Toolchain(cxx=cxx, nvcc=nvcc, cuda_home=home, ninja=ninja), [],
                   f"system nvcc {major}.{minor} ({nvcc})")


def pip_headers_129(base: Toolkit) -> Toolkit:
    """The CUDA 12.9 headers from PyPI, fetched once with pip (a no-op afterwards), in front of `base`'s.
    Only the wheels' include/ trees are kept (the wheels are mostly libraries: cuBLAS alone is ~580 MB)."""
    target = CACHE / "cu129"
    stamp = target / ".installed"
    want = "\n".join(CU129_WHEELS)
    if not stamp.exists() or stamp.read_text() != want:
        print(f"[toolkits] fetching the CUDA 12.9 headers into {target} (once per machine) ...", flush=True)
        shutil.rmtree(target, ignore_errors=True)
        with tempfile.TemporaryDirectory(prefix="fused-mlp-wheels.") as dl:
            proc = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                                   "--no-deps", "--only-binary=:all:", "-d", dl, *CU129_WHEELS])
            if proc.returncode != 0:
                raise build.BuildError(f"downloading {', '.join(CU129_WHEELS)} failed (see above)")
            for whl in sorted(Path(dl).glob("*.whl")):
                with zipfile.ZipFile(whl) as z:
                    for name in z.namelist():
                        parts = name.split("/")
                        if len(parts) > 3 and parts[0] == "nvidia" and parts[2] == "include" and not name.endswith("/"):
                            z.extract(name, target)
        stamp.write_text(want)
    nv = target / "nvidia"
    incs = [nv / "cuda_runtime" / "include", nv / "cuda_cccl" / "include", nv / "cublas" / "include",
            nv / "cusparse" / "include", nv / "cusolver" / "include"]
    missing = [str(d) for d in incs if not d.is_dir()]
    if missing:
        raise build.BuildError(f"CUDA 12.9 header directories missing: {missing} (delete {target} and retry)")
    api = (nv / "cuda_runtime" / "include" / "cuda_runtime_api.h").read_text(errors="replace")
    if not re.search(r"#define\s+CUDART_VERSION\s+12090\b", api):
        raise build.BuildError("the fetched cuda_runtime_api.h is not CUDA 12.9")
    return Toolkit("12.9", base.tc, incs, f"CUDA 12.9 headers (PyPI) with the {base.name} compiler")


def compile_one(cfg, tk: Toolkit, caps: list[str], src: Path, out_dir: Path,
                stable_abi: str | None = None) -> tuple[Path, bool, str, float]:
    flags = build.compile_flags(cfg, "cuda", tk.tc, caps, extra_cuda_includes=tk.extra_includes,
                                stable_abi=stable_abi)
    gen = out_dir / "gen"
    obj = out_dir / (src.name + (".stable" if stable_abi else "") + ".o")
    cmd = [tk.tc.nvcc, *" ".join(flags.nvcc).split(), *build.source_includes(cfg, src, "cuda", gen),
           "-c", str(src), "-o", str(obj)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    dt = time.monotonic() - t0
    obj.unlink(missing_ok=True)
    return src, proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:], dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--toolkit", action="append", choices=["13.0", "12.9"],
                    help="toolkit(s) to check (default: both)")
    ap.add_argument("--capabilities", default=None,
                    help="comma-separated subset of build.toml's cuda-capabilities (default: all of them)")
    ap.add_argument("--abi", choices=["all", "torch", "stable"], default="all",
                    help="the per-torch compile, the stable-ABI one (build.toml [torch.stable-abi]) or both")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="parallel nvcc processes")
    args = ap.parse_args(argv)
    try:
        cfg = load_build_config(ROOT / "build.toml")
        all_caps = cfg.cuda_capabilities()
        if args.capabilities:
            os.environ[build.CAPS_ENV] = args.capabilities
        caps = build.narrow_capabilities(all_caps)
        os.environ.pop(build.CAPS_ENV, None)
        cxx, ninja = build.find_cxx(), build.find_ninja()
        system = system_toolkit(cxx, ninja)
        wanted = args.toolkit or ["13.0", "12.9"]
        toolkits = []
        for name in wanted:
            if name == "12.9":
                toolkits.append(pip_headers_129(system))
            elif system.name != name:
                raise build.BuildError(f"the system toolkit is CUDA {system.name}, not {name}")
            else:
                toolkits.append(system)
        sources = [s for s in build.compiled_sources(cfg, "cuda") if s.suffix == ".cu"]
        stable = cfg.stable_abi.get("cuda")
        modes = ([None] if args.abi in ("all", "torch") else []) + ([stable] if args.abi != "torch" and stable else [])
        if not modes:
            raise build.BuildError("build.toml sets no [torch.stable-abi] version for cuda")
        jobs = [(s, m) for m in modes for s in sources]
    except (build.BuildError, BuildConfigError) as e:
        print(f"fused-mlp toolkit check error: {e}", file=sys.stderr)
        return 1

    failed = []
    with tempfile.TemporaryDirectory(prefix="fused-mlp-toolkits.") as tmp:
        gen = Path(tmp) / "gen"
        gen.mkdir()
        (gen / "registration.h").write_text(build.REGISTRATION_H.format(variant="toolkit-check"))
        skipped: list[str] = []
        for tk in toolkits:
            print(f"[toolkits] CUDA {tk.name}: {tk.note}; capabilities {' '.join(caps)}; "
                  f"{len(sources)} sources x {len(modes)} ABI mode(s), {args.jobs} jobs", flush=True)
            t0 = time.monotonic()
            try:
                probe(tk, cfg, caps, Path(tmp))
            except build.BuildError as e:
                print(f"fused-mlp toolkit check error: {e}", file=sys.stderr)
                return 1
            out_dir = Path(tmp) / tk.name
            out_dir.mkdir()
            (out_dir / "gen").symlink_to(gen)
            # CUTLASS picks its headers and type specialisations from the compiler's version (__CUDACC_VER_MAJOR__
            # >= 13: <cccl/cuda/std/...>, CUDA 13 vector types), so the 12.9 headers behind the 13.0 nvcc cannot
            # check a CUTLASS source: that needs a real CUDA 12.9 toolkit. Said here, not skipped silently.
            tk_jobs = jobs
            if tk.extra_includes:
                cutlass_srcs = {s for s, _ in jobs if any(d.startswith("cutlass_") for d in cfg.source_depends(s, "cuda"))}
                for s in sorted(cutlass_srcs):
                    skipped.append(f"{s.relative_to(ROOT)} (CUDA {tk.name} headers)")
                    print(f"[toolkits]   SKIP {s.relative_to(ROOT)}: CUTLASS source, needs a CUDA {tk.name} nvcc "
                          f"(not {tk.note})", flush=True)
                tk_jobs = [j for j in jobs if j[0] not in cutlass_srcs]
            with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
                results = list(pool.map(lambda j: (compile_one(cfg, tk, caps, j[0], out_dir, j[1]), j[1]), tk_jobs))
            for (src, ok, out, dt), mode in results:
                rel = f"{src.relative_to(ROOT)}" + (f" (stable ABI {mode})" if mode else "")
                print(f"[toolkits]   {'ok  ' if ok else 'FAIL'} {rel} ({dt:.0f} s)", flush=True)
                if not ok:
                    failed.append((tk.name, rel, out))
            print(f"[toolkits] CUDA {tk.name}: {time.monotonic() - t0:.0f} s wall", flush=True)
    if skipped:
        print(f"[toolkits] not checked: {', '.join(skipped)}", flush=True)
    for name, rel, out in failed:
        print(f"\n===== CUDA {name}: {rel} failed to compile =====\n{out}", file=sys.stderr)
    if failed:
        print(f"fused-mlp toolkit check error: {len(failed)} compile(s) failed: "
              + ", ".join(f"{rel} with CUDA {name}" for name, rel, _ in failed), file=sys.stderr)
        return 1
    print(f"[toolkits] all {'checked ' if skipped else ''}CUDA sources compile with CUDA {', '.join(t.name for t in toolkits)} "
          f"for capabilities {' '.join(caps)}" + (" (per-torch and stable-ABI builds)" if len(modes) > 1 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
