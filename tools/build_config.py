"""build.toml reader and validator (the subset of kernel-builder's edition-5 schema this kernel uses).

Unknown keys, unknown backends, bad names, unknown `depends`, malformed versions, include directories that do
not exist and CUDA kernels without (or with unsupported) capabilities are rejected with one line naming the
problem, as kernel-builder rejects them. `check_includes` additionally proves that every quoted `#include` of a
listed source resolves the way kernel-builder's CMake resolves it (the file's own directory, then the
`include` directories of the section that lists it), so a build.toml that only works with this builder's
paths fails here instead of in Nix.
"""

from __future__ import annotations

import re
import tomllib
from urllib.parse import urlsplit
from dataclasses import dataclass, field
from pathlib import Path

NAME_RE = re.compile(r"^[a-z][-a-z0-9]*[a-z0-9]$")
KNOWN_BACKENDS = {"cpu", "cuda"}  # the backends this non-Nix builder can build
ALL_BACKENDS = {"cpu", "cuda", "metal", "rocm", "xpu"}  # what kernel-builder's [kernel.*] backend accepts

GENERAL_KEYS = {"name", "version", "edition", "license", "backends", "hub", "python-depends", "kernel-depends",
                "upstream", "source", "cuda"}
GENERAL_CUDA_KEYS = {"minver", "maxver", "python-depends", "kernel-depends"}
HUB_KEYS = {"repo-id", "branch"}
TORCH_KEYS = {"src", "include", "pyext", "minver", "maxver", "cxx-flags", "stable-abi"}
KERNEL_KEYS_ANY = {"backend", "src", "depends", "include", "cxx-flags"}
KERNEL_KEYS_CUDA = KERNEL_KEYS_ANY | {"cuda-capabilities", "cuda-flags", "cuda-minver"}
EDITION = 5
# `python-depends` may only name packages kernel-builder knows (kernels-data/src/python_dependencies.json): these
# in [general], backend-specific ones in [general.<backend>].
KNOWN_PYTHON_DEPENDS = {"einops", "helion", "tvm-ffi"}
KNOWN_CUDA_PYTHON_DEPENDS = {"nvidia-cutlass-dsl"}
KERNEL_DEPENDS_KEYS = {"repo-id", "version", "revision"}
# kernel-builder's GitUrl: a URL with one of these schemes, or scp-like `user@host:path`.
GIT_URL_SCHEMES = ("https", "http", "git", "ssh", "git+ssh", "git+https", "git+http")
TOP_KEYS = {"general", "torch", "kernel"}
CAPABILITY_RE = re.compile(r"^\d+\.\d+[af]?(\+PTX)?$")
# kernel-builder's `depends` values (kernels-data/src/config/deps.rs).
KNOWN_DEPENDS = {"torch", "cutlass_2_10", "cutlass_3_5", "cutlass_3_6", "cutlass_3_8", "cutlass_3_9", "cutlass_4_0",
                 "sycl_tla", "metal-cpp"}
# Capabilities some CUDA toolkit kernel-builder builds with can compile (base numbers; a/f suffixes and +PTX allowed).
SUPPORTED_CAPABILITIES = {"7.0", "7.2", "7.5", "8.0", "8.6", "8.7", "8.9", "9.0", "10.0", "10.1", "10.3", "11.0",
                          "12.0", "12.1"}
VERSION2_RE = re.compile(r"^\d+\.\d+$")  # kernel-builder's Version<2>, e.g. "2.10"


class BuildConfigError(ValueError):
    """build.toml does not follow the schema."""


def _check_keys(table: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise BuildConfigError(f"{where}: unknown key(s) {unknown} (allowed: {sorted(allowed)})")


def _str_list(value, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BuildConfigError(f"{where} must be a list of strings")
    return value


@dataclass
class Kernel:
    name: str
    backend: str
    src: list[Path]
    depends: list[str]
    cuda_capabilities: list[str]
    cuda_flags: list[str]
    cxx_flags: list[str]
    include: list[Path] = field(default_factory=list)


@dataclass
class BuildConfig:
    root: Path
    name: str
    version: int
    license: str
    backends: list[str]
    hub_repo_id: str | None
    python_depends: list[str]
    torch_src: list[Path]
    kernels: list[Kernel]
    torch_include: list[Path] = field(default_factory=list)
    hub_branch: str | None = None
    # backend -> the oldest torch ("2.10") its stable-ABI variant targets; empty: no stable-ABI variant
    stable_abi: dict[str, str] = field(default_factory=dict)
    upstream: str | None = None  # git URL of the repository the kernels' code comes from
    source: str | None = None  # git URL of the kernel-builder source repository (build.toml, flake.nix)
    cuda_python_depends: list[str] = field(default_factory=list)
    # {"repo-id": ..., "version": N} or {"repo-id": ..., "revision": "..."}, as kernel-builder serialises them
    kernel_depends: list[dict] = field(default_factory=list)
    cuda_kernel_depends: list[dict] = field(default_factory=list)

    @property
    def python_name(self) -> str:
        return self.name.replace("-", "_")

    def python_depends_for(self, backend: str) -> list[str]:
        """[general] python-depends, then the backend's own (kernel-builder's all_python_depends)."""
        return self.python_depends + (self.cuda_python_depends if backend == "cuda" else [])

    def kernel_depends_for(self, backend: str) -> list[dict]:
        """[general] kernel-depends, then the backend's own (kernel-builder's all_kernel_depends)."""
        return self.kernel_depends + (self.cuda_kernel_depends if backend == "cuda" else [])

    def sources_for(self, backend: str) -> list[Path]:
        """Files compiled into a variant, as kernel-builder does it: the [torch] sources and the kernels whose
        backend is the variant's. (The CUDA kernel sections list the CPU sources too, because `kernels` picks
        the variant from the installed torch, so the CUDA variant must also serve CPU tensors.)"""
        files = list(self.torch_src)
        for k in self.kernels:
            if k.backend == backend:
                files += [f for f in k.src if f not in files]
        return files

    def include_dirs_for(self, src: Path, backend: str) -> list[Path]:
        """The include directories kernel-builder gives `src` in a `backend` variant: those of the section that
        lists it (its CMake sets INCLUDE_DIRECTORIES per source file: `[torch] include` for the binding files,
        `[kernel.*] include` for a kernel's files); nothing else but the file's own directory is searched."""
        dirs: list[Path] = []
        if src in self.torch_src:
            dirs += self.torch_include
        for k in self.kernels:
            if k.backend == backend and src in k.src:
                dirs += [d for d in k.include if d not in dirs]
        return dirs

    def source_capabilities(self, src: Path) -> list[str]:
        """The cuda-capabilities of the CUDA section(s) that list `src`."""
        caps: list[str] = []
        for k in self.kernels:
            if k.backend == "cuda" and src in k.src:
                caps += [c for c in k.cuda_capabilities if c not in caps]
        return caps

    def source_depends(self, src: Path, backend: str) -> list[str]:
        """The `depends` of the `backend` section(s) that list `src`."""
        deps: list[str] = []
        for k in self.kernels:
            if k.backend == backend and src in k.src:
                deps += [d for d in k.depends if d not in deps]
        return deps

    def cuda_capabilities(self) -> list[str]:
        caps: list[str] = []
        for k in self.kernels:
            if k.backend == "cuda":
                for c in k.cuda_capabilities:
                    if c not in caps:
                        caps.append(c)
        return sorted(caps, key=lambda c: tuple(int(p) for p in re.findall(r"\d+", c)))

    def cuda_flags(self) -> list[str]:
        return [f for k in self.kernels if k.backend == "cuda" for f in k.cuda_flags]

    def cxx_flags(self) -> list[str]:
        return [f for k in self.kernels for f in k.cxx_flags]


def load_build_config(path: Path) -> BuildConfig:
    path = Path(path)
    if not path.exists():
        raise BuildConfigError(f"{path} does not exist")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise BuildConfigError(f"{path.name} is not valid TOML: {e}") from e
    root = path.resolve().parent
    _check_keys(data, TOP_KEYS, path.name)

    general = data.get("general")
    if not isinstance(general, dict):
        raise BuildConfigError("[general] is missing")
    _check_keys(general, GENERAL_KEYS, "[general]")
    name = general.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise BuildConfigError(f"[general] name {name!r} must match {NAME_RE.pattern}")
    version = general.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise BuildConfigError(f"[general] version must be a positive integer, got {version!r}")
    edition = general.get("edition")
    if edition != EDITION:
        raise BuildConfigError(f"[general] edition must be {EDITION} (kernel-builder's current schema), got {edition!r}")
    license_ = general.get("license")
    if not isinstance(license_, str) or not license_:
        raise BuildConfigError("[general] license is missing")
    backends = _str_list(general.get("backends", []), "[general] backends")
    if not backends:
        raise BuildConfigError("[general] backends is empty")
    for b in backends:
        if b not in ALL_BACKENDS:
            raise BuildConfigError(f"[general] backends: unknown backend {b!r} (known: {sorted(ALL_BACKENDS)})")
    hub = general.get("hub", {})
    if not isinstance(hub, dict):
        raise BuildConfigError("[general.hub] must be a table")
    _check_keys(hub, HUB_KEYS, "[general.hub]")
    repo_id = hub.get("repo-id")
    if repo_id is not None and (not isinstance(repo_id, str) or repo_id.count("/") != 1):
        raise BuildConfigError(f"[general.hub] repo-id {repo_id!r} must look like 'org/name'")
    python_depends = _str_list(general.get("python-depends", []), "[general] python-depends")
    for dep in python_depends:
        if dep not in KNOWN_PYTHON_DEPENDS:
            raise BuildConfigError(f"[general] python-depends: {dep!r} is not a dependency kernel-builder knows "
                                   f"(known: {sorted(KNOWN_PYTHON_DEPENDS)})")
    kernel_depends = _kernel_depends(general.get("kernel-depends", []), "[general] kernel-depends")
    upstream = _git_url(general.get("upstream"), "[general] upstream")
    source = _git_url(general.get("source"), "[general] source")
    hub_branch = hub.get("branch")
    if hub_branch is not None and (not isinstance(hub_branch, str) or not hub_branch):
        raise BuildConfigError(f"[general.hub] branch {hub_branch!r} must be a non-empty string")
    gcuda = general.get("cuda", {})
    if not isinstance(gcuda, dict):
        raise BuildConfigError("[general.cuda] must be a table")
    _check_keys(gcuda, GENERAL_CUDA_KEYS, "[general.cuda]")
    for key in ("minver", "maxver"):
        _version2(gcuda.get(key), f"[general.cuda] {key}")
    cuda_python_depends = _str_list(gcuda.get("python-depends", []), "[general.cuda] python-depends")
    for dep in cuda_python_depends:
        if dep not in KNOWN_CUDA_PYTHON_DEPENDS:
            raise BuildConfigError(f"[general.cuda] python-depends: {dep!r} is not a CUDA dependency kernel-builder "
                                   f"knows (known: {sorted(KNOWN_CUDA_PYTHON_DEPENDS)})")
    cuda_kernel_depends = _kernel_depends(gcuda.get("kernel-depends", []), "[general.cuda] kernel-depends")

    torch_t = data.get("torch")
    if not isinstance(torch_t, dict):
        raise BuildConfigError("[torch] is missing")
    _check_keys(torch_t, TORCH_KEYS, "[torch]")
    torch_src = [_src(root, s, "[torch] src") for s in _str_list(torch_t.get("src", []), "[torch] src")]
    if not torch_src:
        raise BuildConfigError("[torch] src is empty")
    torch_include = [_dir(root, d, "[torch] include") for d in _str_list(torch_t.get("include", []), "[torch] include")]
    for key in ("minver", "maxver"):
        _version2(torch_t.get(key), f"[torch] {key}")
    _str_list(torch_t.get("cxx-flags", []), "[torch] cxx-flags")
    _str_list(torch_t.get("pyext", []), "[torch] pyext")
    abi = torch_t.get("stable-abi")
    if abi is not None:
        for where, v in ([("[torch] stable-abi", abi)] if not isinstance(abi, dict)
                         else [(f"[torch.stable-abi] {b}", v) for b, v in abi.items()]):
            _version2(v, where)
        if isinstance(abi, dict):
            for b in abi:
                if b not in ALL_BACKENDS:
                    raise BuildConfigError(f"[torch.stable-abi]: unknown backend {b!r}")
    stable_abi = ({} if abi is None else {str(b): str(v) for b, v in abi.items()} if isinstance(abi, dict)
                  else {b: str(abi) for b in backends})

    kernels = []
    for kname, k in (data.get("kernel") or {}).items():
        where = f"[kernel.{kname}]"
        if not isinstance(k, dict):
            raise BuildConfigError(f"{where} must be a table")
        backend = k.get("backend")
        if backend not in ALL_BACKENDS:
            raise BuildConfigError(f"{where} backend {backend!r} is unknown (known: {sorted(ALL_BACKENDS)})")
        _check_keys(k, KERNEL_KEYS_CUDA if backend == "cuda" else KERNEL_KEYS_ANY, where)
        if backend not in backends:
            raise BuildConfigError(f"{where} backend {backend!r} is not in [general] backends {backends}")
        if backend not in KNOWN_BACKENDS:
            raise BuildConfigError(f"{where} backend {backend!r} cannot be built by this builder")
        src = [_src(root, s, f"{where} src") for s in _str_list(k.get("src", []), f"{where} src")]
        if not src:
            raise BuildConfigError(f"{where} src is empty")
        caps = _str_list(k.get("cuda-capabilities", []), f"{where} cuda-capabilities")
        if backend == "cuda":
            if not caps:
                raise BuildConfigError(f"{where} is a cuda kernel without cuda-capabilities")
            for c in caps:
                if not CAPABILITY_RE.match(c):
                    raise BuildConfigError(f"{where} cuda-capabilities: {c!r} is not like '9.0'")
                base = re.sub(r"[af]?(\+PTX)?$", "", c)
                if base not in SUPPORTED_CAPABILITIES:
                    raise BuildConfigError(f"{where} cuda-capabilities: {c!r} is not a capability kernel-builder "
                                           f"supports ({sorted(SUPPORTED_CAPABILITIES, key=_cap_key)})")
            _version2(k.get("cuda-minver"), f"{where} cuda-minver")
        if "depends" not in k:
            raise BuildConfigError(f"{where} has no depends (kernel-builder requires it, e.g. depends = [\"torch\"])")
        depends = _str_list(k["depends"], f"{where} depends")
        for dep in depends:
            if dep not in KNOWN_DEPENDS:
                raise BuildConfigError(f"{where} depends: {dep!r} is unknown (known: {sorted(KNOWN_DEPENDS)})")
        include = [_dir(root, d, f"{where} include") for d in _str_list(k.get("include", []), f"{where} include")]
        kernels.append(Kernel(
            name=kname, backend=backend, src=src,
            depends=depends,
            cuda_capabilities=caps,
            cuda_flags=_str_list(k.get("cuda-flags", []), f"{where} cuda-flags"),
            cxx_flags=_str_list(k.get("cxx-flags", []), f"{where} cxx-flags"),
            include=include,
        ))
    if not kernels:
        raise BuildConfigError("build.toml has no [kernel.*] section")
    for b in backends:
        if b in KNOWN_BACKENDS and not any(k.backend == b for k in kernels):
            raise BuildConfigError(f"[general] backends lists {b!r} but no [kernel.*] section has backend {b!r}")
    return BuildConfig(root=root, name=name, version=version, license=license_, backends=backends,
                       hub_repo_id=repo_id, python_depends=python_depends, torch_src=torch_src, kernels=kernels,
                       torch_include=torch_include, hub_branch=hub_branch, stable_abi=stable_abi, upstream=upstream,
                       source=source, cuda_python_depends=cuda_python_depends, kernel_depends=kernel_depends,
                       cuda_kernel_depends=cuda_kernel_depends)


def _cap_key(c: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", c))


def _version2(value, where: str) -> None:
    if value is not None and (not isinstance(value, str) or not VERSION2_RE.match(value)):
        raise BuildConfigError(f"{where} {value!r} must be a version like \"2.10\"")


def _git_url(value, where: str) -> str | None:
    """kernel-builder's GitUrl: something `git clone` accepts, a URL with a git scheme or scp-like `git@host:org/repo`."""
    if value is None:
        return None
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise BuildConfigError(f"{where} {value!r} must be a git URL (e.g. https://github.com/org/repo)")
    parsed = urlsplit(value)
    if parsed.scheme:
        if parsed.scheme not in GIT_URL_SCHEMES or not parsed.netloc:
            raise BuildConfigError(f"{where} {value!r}: not a git URL (schemes: {', '.join(GIT_URL_SCHEMES)})")
        return value
    host, sep, path = value.partition(":")
    if not sep or not host or not path or path.startswith("/"):
        raise BuildConfigError(f"{where} {value!r} must be a git URL (e.g. https://github.com/org/repo)")
    return value


def _kernel_depends(value, where: str) -> list[dict]:
    """Kernel dependencies: tables with `repo-id` and exactly one of `version` (int) or `revision` (str)."""
    if not isinstance(value, list) or not all(isinstance(d, dict) for d in value):
        raise BuildConfigError(f"{where} must be a list of tables {{ repo-id = \"org/name\", version = 1 }}")
    out = []
    for d in value:
        _check_keys(d, KERNEL_DEPENDS_KEYS, where)
        repo_id = d.get("repo-id")
        if not isinstance(repo_id, str) or repo_id.count("/") != 1:
            raise BuildConfigError(f"{where}: repo-id {repo_id!r} must look like 'org/name'")
        if ("version" in d) == ("revision" in d):
            raise BuildConfigError(f"{where}: {repo_id}: give exactly one of `version` and `revision`")
        if "version" in d:
            v = d["version"]
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise BuildConfigError(f"{where}: {repo_id}: version must be a non-negative integer, got {v!r}")
            out.append({"repo-id": repo_id, "version": v})
        else:
            r = d["revision"]
            if not isinstance(r, str) or not r:
                raise BuildConfigError(f"{where}: {repo_id}: revision must be a non-empty string")
            out.append({"repo-id": repo_id, "revision": r})
    return out


def _dir(root: Path, rel: str, where: str) -> Path:
    if Path(rel).is_absolute():
        raise BuildConfigError(f"{where}: {rel} must be relative to the project root")
    p = (root / rel).resolve()
    if not p.is_dir():
        raise BuildConfigError(f"{where}: {rel} is not a directory")
    return p


INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)
GENERATED_HEADERS = {"registration.h"}  # written by kernel-builder (and tools/build.py) next to the binding


def check_includes(cfg: BuildConfig) -> None:
    """Every quoted #include of every compiled source (and of the project headers it pulls in) must resolve
    as kernel-builder's CMake resolves it: the including file's directory, then the include directories of
    the section that lists the source. Raises BuildConfigError naming the first include that does not."""
    for backend in sorted(set(cfg.backends) & KNOWN_BACKENDS):
        for src in cfg.sources_for(backend):
            if src.suffix in (".h", ".cuh", ".hpp"):
                continue
            dirs = cfg.include_dirs_for(src, backend)
            seen: set[Path] = set()
            todo = [src]
            while todo:
                f = todo.pop()
                if f in seen:
                    continue
                seen.add(f)
                for name in INCLUDE_RE.findall(f.read_text(errors="replace")):
                    if name in GENERATED_HEADERS and src in cfg.torch_src:
                        continue
                    hit = next((d / name for d in [f.parent, *dirs] if (d / name).is_file()), None)
                    if hit is None:
                        rel = src.relative_to(cfg.root) if src.is_relative_to(cfg.root) else src
                        raise BuildConfigError(
                            f'{rel} ({backend}): #include "{name}" (in {f.name}) is not found in the file\'s '
                            f"directory or the section's include directories "
                            f"{[str(d.relative_to(cfg.root)) for d in dirs]}: add it to `include` in build.toml")
                    if hit.resolve().is_relative_to(cfg.root.resolve()):
                        todo.append(hit.resolve())


def _src(root: Path, rel: str, where: str) -> Path:
    p = (root / rel).resolve()
    if not p.is_file():
        raise BuildConfigError(f"{where}: {rel} does not exist")
    return p
