"""build.toml reader and validator (the subset of kernel-builder's edition-5 schema this kernel uses).

Unknown keys, unknown backends, bad names and CUDA kernels without capabilities are rejected with one line
naming the problem, as kernel-builder rejects them.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

NAME_RE = re.compile(r"^[a-z][-a-z0-9]*[a-z0-9]$")
KNOWN_BACKENDS = {"cpu", "cuda"}  # the backends this non-Nix builder can build
ALL_BACKENDS = {"cpu", "cuda", "metal", "rocm", "xpu"}  # what kernel-builder's [kernel.*] backend accepts

GENERAL_KEYS = {"name", "version", "edition", "license", "backends", "hub", "python-depends", "kernel-depends",
                "upstream", "source", "cuda"}
GENERAL_CUDA_KEYS = {"minver", "maxver", "python-depends"}
HUB_KEYS = {"repo-id", "branch"}
TORCH_KEYS = {"src", "include", "pyext", "minver", "maxver", "cxx-flags", "stable-abi"}
KERNEL_KEYS_ANY = {"backend", "src", "depends", "include", "cxx-flags"}
KERNEL_KEYS_CUDA = KERNEL_KEYS_ANY | {"cuda-capabilities", "cuda-flags", "cuda-minver"}
EDITION = 5
# `python-depends` may only name packages kernel-builder knows.
KNOWN_PYTHON_DEPENDS = {"einops", "helion", "tvm-ffi", "nvidia-cutlass-dsl"}
TOP_KEYS = {"general", "torch", "kernel"}
CAPABILITY_RE = re.compile(r"^\d+\.\d+[af]?(\+PTX)?$")


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

    @property
    def python_name(self) -> str:
        return self.name.replace("-", "_")

    def sources_for(self, backend: str) -> list[Path]:
        """Files compiled into a variant, as kernel-builder does it: the [torch] sources and the kernels whose
        backend is the variant's. (The CUDA kernel sections list the CPU sources too, because `kernels` picks
        the variant from the installed torch, so the CUDA variant must also serve CPU tensors.)"""
        files = list(self.torch_src)
        for k in self.kernels:
            if k.backend == backend:
                files += [f for f in k.src if f not in files]
        return files

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
    root = path.parent
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
            raise BuildConfigError(f"[general] python-depends: {dep!r} is not a dependency kernel-builder knows")
    gcuda = general.get("cuda", {})
    if not isinstance(gcuda, dict):
        raise BuildConfigError("[general.cuda] must be a table")
    _check_keys(gcuda, GENERAL_CUDA_KEYS, "[general.cuda]")

    torch_t = data.get("torch")
    if not isinstance(torch_t, dict):
        raise BuildConfigError("[torch] is missing")
    _check_keys(torch_t, TORCH_KEYS, "[torch]")
    torch_src = [_src(root, s, "[torch] src") for s in _str_list(torch_t.get("src", []), "[torch] src")]
    if not torch_src:
        raise BuildConfigError("[torch] src is empty")

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
        kernels.append(Kernel(
            name=kname, backend=backend, src=src,
            depends=_str_list(k.get("depends", []), f"{where} depends"),
            cuda_capabilities=caps,
            cuda_flags=_str_list(k.get("cuda-flags", []), f"{where} cuda-flags"),
            cxx_flags=_str_list(k.get("cxx-flags", []), f"{where} cxx-flags"),
        ))
    return BuildConfig(root=root, name=name, version=version, license=license_, backends=backends,
                       hub_repo_id=repo_id, python_depends=python_depends, torch_src=torch_src, kernels=kernels)


def _src(root: Path, rel: str, where: str) -> Path:
    p = (root / rel).resolve()
    if not p.is_file():
        raise BuildConfigError(f"{where}: {rel} does not exist")
    return p
