#!/usr/bin/env python3
"""Compile every C++ and CUDA source of every variant for aarch64-linux with a cross compiler (compile only: the
objects are checked to be aarch64 code, then thrown away). kernel-builder builds each variant for aarch64-linux as
well as x86_64-linux; this machine cannot run aarch64 code, but it can compile it. The flags are tools/build.py's
own (`compile_flags`, `source_includes`, `source_nvcc_flags`), with the cross compiler as the C++ compiler and as
nvcc's host compiler.

    python tools/cross_compile_check.py                        # CPU and CUDA variants, per-torch and stable ABI
    python tools/cross_compile_check.py --backend cpu          # only the CPU variant's sources
    python tools/cross_compile_check.py --source kernels_src/cpu/geglu.cpp   # one source

What is compiled, for each backend and each ABI mode (per-torch; stable ABI where build.toml's [torch.stable-abi]
names the backend): the binding and every kernel source of the variant, the `.cpp` files with the cross g++ and the
`.cu` files with nvcc -ccbin <cross g++> for the variant's CUDA capabilities (FUSED_MLP_CUDA_CAPABILITIES or
--capabilities narrow them, as for the build).

nvcc: given an aarch64 host compiler it looks for the CUDA headers under <toolkit>/targets/aarch64-linux (or
sbsa-linux), which an x86_64 toolkit does not have (NVIDIA ships them as a separate cross package; neither Debian nor
PyPI has them). The headers are one set for every host (they branch on __aarch64__ / __x86_64__ themselves), so when
no aarch64 target directory exists nvcc is pointed at the installed one (-target-dir x86_64-linux): the host pass
then still preprocesses and compiles as aarch64 (cudafe++ --arm_cross_compiler, aarch64-linux-gnu-g++), and the
objects are checked to be aarch64 code.

Exit status 0 when every source compiled to aarch64 code; 1 otherwise, with the compiler output of each failure.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from build_config import BuildConfig, BuildConfigError, load_build_config  # noqa: E402

import build  # noqa: E402

TARGET = "aarch64-linux"
DEFAULT_CXX = "aarch64-linux-gnu-g++"
EM_AARCH64 = 183  # ELF e_machine


class CrossError(RuntimeError):
    """A problem reported to the user as one line."""


@dataclass
class Job:
    backend: str
    stable_abi: str | None
    src: Path
    cmd: list[str]
    obj: Path

    @property
    def label(self) -> str:
        mode = f"stable ABI {self.stable_abi}" if self.stable_abi else "per-torch"
        return f"{self.src.relative_to(ROOT)} ({self.backend}, {mode})"


def elf_machine(path: Path) -> int | None:
    """e_machine of an ELF file, or None when it is not one."""
    with open(path, "rb") as f:
        head = f.read(20)
    if len(head) < 20 or head[:4] != b"\x7fELF":
        return None
    return struct.unpack("<H" if head[5] == 1 else ">H", head[18:20])[0]


def nvcc_target_flags(cuda_home: Path) -> tuple[list[str], str]:
    """nvcc flags that make it find CUDA headers for an aarch64 host pass, and what was chosen."""
    targets = cuda_home / "targets"
    for name in ("aarch64-linux", "sbsa-linux"):
        if (targets / name / "include" / "cuda_runtime.h").exists():
            return ([] if name == "aarch64-linux" else ["-target-dir", name]), f"targets/{name}"
    if (targets / "x86_64-linux" / "include" / "cuda_runtime.h").exists():
        return ["-target-dir", "x86_64-linux"], "targets/x86_64-linux (no aarch64 target headers installed)"
    raise CrossError(f"no CUDA target headers under {targets}")


def plan(cfg: BuildConfig, cxx: str, backends: list[str], abi: str, caps: list[str], work: Path,
         only: set[Path] | None = None) -> tuple[list[Job], list[str]]:
    """Every (backend, ABI mode, source) compile, with the build's flags; and notes on how CUDA is driven."""
    jobs: list[Job] = []
    notes: list[str] = []
    gen = work / "gen"  # the generated registration.h the binding includes
    for backend in backends:
        tc = build.Toolchain(cxx=cxx, nvcc=None, cuda_home=None, ninja="")
        target_flags: list[str] = []
        if backend == "cuda":
            nvcc, home = build.find_cuda()
            if nvcc is None or home is None:
                raise CrossError("the cuda backend needs nvcc and a CUDA toolkit (set CUDA_HOME or put nvcc on PATH)")
            tc = build.Toolchain(cxx=cxx, nvcc=nvcc, cuda_home=home, ninja="")
            target_flags, where = nvcc_target_flags(home)
            notes.append(f"nvcc {'.'.join(map(str, build.nvcc_version(nvcc)))} -ccbin {cxx}, CUDA headers from {where}, "
                         f"capabilities {' '.join(caps)}")
        modes: list[str | None] = []
        if abi in ("all", "torch"):
            modes.append(None)
        if abi in ("all", "stable") and cfg.stable_abi.get(backend):
            modes.append(cfg.stable_abi[backend])
        for mode in modes:
            flags = build.compile_flags(cfg, backend, tc, caps if backend == "cuda" else [], stable_abi=mode)
            for src in build.compiled_sources(cfg, backend):
                if only is not None and src not in only:
                    continue
                obj = work / "obj" / f"{backend}-{mode or 'torch'}-{src.name}.o"
                incs = build.source_includes(cfg, src, backend, gen)
                defs = [f"-DTORCH_EXTENSION_NAME=_{cfg.python_name}_{backend}_crosscheck"] if src in cfg.torch_src else []
                if src.suffix == ".cu":
                    nv = shlex.split(" ".join(build.source_nvcc_flags(cfg, src, caps, flags.nvcc)))
                    cmd = [tc.nvcc, *nv, *target_flags, *incs, *defs, "-c", str(src), "-o", str(obj)]
                else:
                    cmd = [cxx, *shlex.split(" ".join(flags.cxx)), *incs, *defs, "-c", str(src), "-o", str(obj)]
                jobs.append(Job(backend, mode, src, cmd, obj))
    return jobs, notes


def run_job(job: Job) -> tuple[Job, str | None, float]:
    """(job, None, seconds) when the source compiled to aarch64 code, else (job, the reason, seconds)."""
    t0 = time.monotonic()
    proc = subprocess.run(job.cmd, capture_output=True, text=True, cwd=ROOT)
    dt = time.monotonic() - t0
    try:
        if proc.returncode != 0:
            return job, (proc.stdout + proc.stderr)[-6000:], dt
        machine = elf_machine(job.obj) if job.obj.exists() else None
        if machine != EM_AARCH64:
            return job, f"{job.obj.name} is not aarch64 code (ELF e_machine {machine}, want {EM_AARCH64})", dt
        return job, None, dt
    finally:
        job.obj.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cxx", default=os.environ.get("FUSED_MLP_CROSS_CXX", DEFAULT_CXX),
                    help=f"the {TARGET} C++ compiler (default: {DEFAULT_CXX}; Debian package g++-aarch64-linux-gnu)")
    ap.add_argument("--backend", choices=["auto", "all", "cpu", "cuda"], default="auto",
                    help="auto: cpu, plus cuda when nvcc exists (default); all/cuda: fail without nvcc")
    ap.add_argument("--abi", choices=["all", "torch", "stable"], default="all",
                    help="the per-torch compile, the stable-ABI one (build.toml [torch.stable-abi]) or both (default)")
    ap.add_argument("--capabilities", default=None,
                    help="comma-separated subset of build.toml's cuda-capabilities (default: "
                         f"{build.CAPS_ENV}, else all of them)")
    ap.add_argument("--source", action="append", type=Path, help="only this source (repeatable)")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiler processes")
    args = ap.parse_args(argv)
    try:
        if shutil.which(args.cxx) is None:
            raise CrossError(f"{args.cxx} not found: install the {TARGET} cross compiler "
                             "(Debian/Ubuntu: apt-get install g++-aarch64-linux-gnu; tools/setup.sh does it as root)")
        cfg = load_build_config(ROOT / "build.toml")
        if args.capabilities:
            os.environ[build.CAPS_ENV] = args.capabilities
        caps = build.narrow_capabilities(cfg.cuda_capabilities()) if "cuda" in cfg.backends else []
        nvcc, home = build.find_cuda()
        have_nvcc = nvcc is not None
        if home is not None:  # torch's cpp_extension would guess it (and warn) while computing the CPU flags
            os.environ.setdefault("CUDA_HOME", str(home))
        backends = [b for b in ("cpu", "cuda") if b in cfg.backends]
        if args.backend in ("cpu", "cuda"):
            backends = [args.backend]
        skipped = []
        if args.backend == "auto" and "cuda" in backends and not have_nvcc:
            backends.remove("cuda")
            skipped.append("the CUDA variant's sources (no nvcc)")
        only = {(Path.cwd() / s).resolve() for s in args.source} if args.source else None
        work = Path(tempfile.mkdtemp(prefix="fused-mlp-cross."))
        (work / "gen").mkdir()
        (work / "obj").mkdir()
        (work / "gen" / "registration.h").write_text(build.REGISTRATION_H.format(variant=f"cross-check-{TARGET}"))
        jobs, notes = plan(cfg, args.cxx, backends, args.abi, caps, work, only)
        if not jobs:
            raise CrossError("nothing to compile (check --source and --backend)")
    except (CrossError, build.BuildError, BuildConfigError) as e:
        print(f"fused-mlp cross-compile error: {e}", file=sys.stderr)
        return 1

    print(f"[cross] {TARGET}: {len(jobs)} compiles with {args.cxx} ({', '.join(backends)}; ABI {args.abi}), "
          f"{args.jobs} jobs", flush=True)
    for note in notes:
        print(f"[cross] {note}", flush=True)
    t0 = time.monotonic()
    failed = []
    try:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            for job, problem, dt in pool.map(run_job, jobs):
                print(f"[cross]   {'ok  ' if problem is None else 'FAIL'} {job.label} ({dt:.0f} s)", flush=True)
                if problem is not None:
                    failed.append((job, problem))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for job, problem in failed:
        print(f"\n===== {job.label} does not compile for {TARGET} =====\n{shlex.join(job.cmd)}\n{problem}",
              file=sys.stderr)
    if failed:
        print(f"fused-mlp cross-compile error: {len(failed)} of {len(jobs)} compiles failed for {TARGET}: "
              + ", ".join(job.label for job, _ in failed), file=sys.stderr)
        return 1
    print(f"[cross] all {len(jobs)} compiles produced {TARGET} code ({time.monotonic() - t0:.0f} s)"
          + (f"; not checked: {', '.join(skipped)}" if skipped else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
