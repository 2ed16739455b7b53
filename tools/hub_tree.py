#!/usr/bin/env python3
"""Assemble and check the tree a maintainer would upload to the Hub, then print the upload command.

    python tools/hub_tree.py --out /tmp/fused-mlp-hub             # every variant under build/
    python tools/hub_tree.py --out /tmp/hub --variant torch214-cxx11-cpu-x86_64-linux

The tree is what `kernel-builder upload` reads (kernel-builder/src/upload.rs):
    <out>/build.toml                 upload reads the repo id and the version from it
    <out>/build/<variant>/...        every built variant (flat: __init__.py, _ops.py, the .so, metadata.json)
    <out>/build/CARD.md              uploaded as the repository's README.md (main branch): our CARD.md
    <out>/benchmarks/benchmark*.py   uploaded to the version branch (upload sends only these files)
    <out>/README.md                  the same card, for people browsing the tree
Checks, all offline (any failure: one line per problem on stderr, exit status 1, no upload command):
  * CARD.md's front matter is a kernels Hub card: `library_name: kernels`, the license of build.toml, tag `kernel`;
  * every variant's metadata.json matches build.toml (name, version, license), names its extension module, and
    its sha256 digest matches the files (kernels' own Digest machinery, as `kernels` verification does);
  * `kernels info --json` accepts each variant and reports its backend;
  * the benchmark scripts import nothing from benchmarks/ that would not be uploaded;
  * `get_kernel("<repo-id>", version=<version>, backend=...)` loads every variant the installed torch can load
    from an offline Hub cache made from the tree (HF_HUB_OFFLINE=1, refs/v<version> -> snapshots/<rev>/build/,
    network calls blocked) and runs an op; variants for another torch are reported and skipped.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from build_config import BuildConfig, BuildConfigError, load_build_config  # noqa: E402

VARIANT_RE = re.compile(r"^torch(?:(\d)(\d+)-cxx11|-stable-abi(\d)(\d+))-(cpu|cu\d+)-(x86_64|aarch64)-linux$")

# Child processes start with this: every attempt to open a network connection fails loudly.
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


class TreeError(RuntimeError):
    pass


def find_variants(build_dir: Path, only: list[str] | None) -> list[Path]:
    found = sorted(d for d in build_dir.iterdir()
                   if d.is_dir() and not d.name.startswith(".") and (d / "metadata.json").is_file())
    if only:
        missing = [v for v in only if not (build_dir / v / "metadata.json").is_file()]
        if missing:
            raise TreeError(f"variants not built under {build_dir}: {missing}")
        found = [build_dir / v for v in only]
    if not found:
        raise TreeError(f"no built variants under {build_dir} (run `python tools/build.py` first)")
    return found


def card_problems(card: Path, cfg: BuildConfig) -> list[str]:
    """CARD.md is the Hub card: YAML front matter as kernel-builder's card template and kernels-community
    write it (library_name: kernels, license, tags including `kernel`)."""
    text = card.read_text()
    if not text.startswith("---\n"):
        return [f"{card.name}: does not start with YAML front matter ('---')"]
    from huggingface_hub.repocard import metadata_load  # the parser the Hub client uses

    try:
        meta = metadata_load(card) or {}
    except Exception as e:  # noqa: BLE001 - reported as one line
        return [f"{card.name}: front matter is not valid YAML ({e})"]
    problems = []
    if meta.get("library_name") != "kernels":
        problems.append(f"{card.name}: front matter needs `library_name: kernels` (got {meta.get('library_name')!r})")
    if str(meta.get("license", "")).lower() != cfg.license.lower():
        problems.append(f"{card.name}: front matter license {meta.get('license')!r} != build.toml's {cfg.license!r}")
    tags = meta.get("tags") or []
    if not isinstance(tags, list) or "kernel" not in tags:
        problems.append(f"{card.name}: front matter tags {tags!r} must include 'kernel'")
    return problems


def variant_problems(v: Path, cfg: BuildConfig) -> list[str]:
    from kernels._rust import Digest, DigestAlgorithm, DigestValidationError, Metadata

    problems = []
    if not VARIANT_RE.match(v.name):
        problems.append(f"{v.name}: not a variant name kernels recognises")
    try:
        meta = Metadata.read_from_file(v / "metadata.json")
    except (OSError, ValueError) as e:
        return problems + [f"{v.name}: metadata.json cannot be read ({e})"]
    raw = json.loads((v / "metadata.json").read_text())
    if str(meta.name) != cfg.name or meta.version != cfg.version or meta.license != cfg.license:
        problems.append(f"{v.name}: metadata says {meta.name} v{meta.version} {meta.license}, build.toml says "
                        f"{cfg.name} v{cfg.version} {cfg.license}")
    if not (v / f"{meta.id}.abi3.so").is_file():
        problems.append(f"{v.name}: extension {meta.id}.abi3.so (metadata id) is missing")
    if not (v / "__init__.py").is_file() or not (v / "_ops.py").is_file():
        problems.append(f"{v.name}: __init__.py or _ops.py missing")
    backend = raw.get("backend", {}).get("type")
    if backend == "cuda" and not raw["backend"].get("archs"):
        problems.append(f"{v.name}: CUDA variant without backend.archs")
    stray = [p.name for p in v.rglob("*") if p.name == "__pycache__" or p.suffix == ".pyc"]
    if stray:
        problems.append(f"{v.name}: byte-code files would be uploaded: {sorted(set(stray))}")
    if meta.digest is None:
        problems.append(f"{v.name}: metadata.json has no digest")
    else:
        # The digest half of kernels.verify.verify_variant (the signature half needs the CI's cosign bundle).
        try:
            meta.digest.validate(Digest.hash_variant(DigestAlgorithm.SHA256, str(v)))
        except DigestValidationError as e:
            problems.append(f"{v.name}: sha256 digest mismatch: {e.violations}")
    return problems


def kernels_info_problems(v: Path, cfg: BuildConfig, scratch: Path) -> list[str]:
    """`kernels info --json` on a one-variant view of the tree."""
    view = scratch / f"info-{v.name}"
    (view / "build").mkdir(parents=True)
    (view / "build" / v.name).symlink_to(v.resolve())
    exe = shutil.which("kernels")
    cmd = [exe] if exe else [sys.executable, "-c", "from kernels.cli import main; main()"]
    proc = subprocess.run([*cmd, "info", "--json", str(view)], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    if proc.returncode != 0:
        return [f"{v.name}: `kernels info` failed: {proc.stderr.strip()[-500:]}"]
    info = json.loads(proc.stdout)
    backend = json.loads((v / "metadata.json").read_text())["backend"]["type"]
    if info.get("name") != cfg.name or info.get("version") != cfg.version or backend not in info.get("backends", []):
        return [f"{v.name}: `kernels info` reports {info}"]
    print(f"[hub-tree] kernels info ok: {v.name} ({info['name']} v{info['version']}, {', '.join(info['backends'])})")
    return []


def benchmark_problems(bench_dir: Path) -> list[str]:
    """upload sends benchmarks/benchmark*.py only: a benchmark importing a sibling module would break on the Hub."""
    if not bench_dir.is_dir():
        return []
    local = {p.stem for p in bench_dir.glob("*.py")} | {p.name for p in bench_dir.iterdir() if p.is_dir()}
    problems = []
    for script in sorted(bench_dir.glob("benchmark*.py")):
        tree = ast.parse(script.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for name in names:
                top = name.split(".")[0]
                if top in local and not top.startswith("benchmark"):
                    problems.append(f"benchmarks/{script.name}: imports `{top}`, which upload does not send")
    return problems


def assemble(cfg: BuildConfig, variants: list[Path], out: Path) -> None:
    build_out = out / "build"
    build_out.mkdir(parents=True)
    for v in variants:
        shutil.copytree(v, build_out / v.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy2(ROOT / "CARD.md", out / "README.md")
    shutil.copy2(ROOT / "CARD.md", build_out / "CARD.md")
    shutil.copy2(ROOT / "build.toml", out / "build.toml")
    bench = ROOT / "benchmarks"
    if bench.is_dir():
        (out / "benchmarks").mkdir()
        for script in sorted(bench.glob("benchmark*.py")):
            shutil.copy2(script, out / "benchmarks" / script.name)


def offline_cache(cfg: BuildConfig, out: Path, scratch: Path) -> Path:
    """A Hub cache holding the tree as the version branch would: refs/v<N> -> <rev>, snapshots/<rev>/build/."""
    h = hashlib.sha1()
    for p in sorted((out / "build").rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(out)).encode())
            h.update(hashlib.sha256(p.read_bytes()).digest())
    rev = h.hexdigest()
    repo = scratch / "hub" / ("kernels--" + cfg.hub_repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / (cfg.hub_branch or f"v{cfg.version}")).write_text(rev)
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    shutil.copytree(out / "build", snap / "build", ignore=shutil.ignore_patterns("CARD.md"))
    if (out / "benchmarks").is_dir():
        shutil.copytree(out / "benchmarks", snap / "benchmarks")
    return scratch / "hub"


def cuda_version(tag: str) -> tuple[int, int] | None:
    """(major, minor) of a variant's CUDA tag (cu126 -> (12, 6), cu130 -> (13, 0)); None for cpu."""
    m = re.fullmatch(r"cu(\d\d)(\d+)", tag)
    return (int(m.group(1)), int(m.group(2))) if m else None


def cuda_tag_loads(tag: str, torch_cuda: str | None) -> bool:
    """kernels' rule: a variant built for CUDA x.z loads under a torch built for CUDA x.y when z <= y (CUDA's minor
    version compatibility), so torch 2.15's cu132 takes a cu130 variant."""
    v = cuda_version(tag)
    if v is None or torch_cuda is None:
        return False
    major, minor = (int(p) for p in torch_cuda.split(".")[:2])
    return v[0] == major and v[1] <= minor


def get_kernel_problems(cfg: BuildConfig, variants: list[Path], cache: Path) -> list[str]:
    import torch

    tag = "torch{}{}".format(*torch.__version__.split("+")[0].split(".")[:2])
    have = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    problems = []

    def preference(v: Path, backend: str) -> tuple[int, ...] | None:
        """None when kernels would not load v under the installed torch, else its sort key in kernels' order
        (stable ABI first, the newest ABI target, then the newest CUDA minor): the smallest key is the one loaded."""
        m = VARIANT_RE.match(v.name)
        if not m:
            return None
        stable = m.group(3) is not None
        torch_ok = have >= (int(m.group(3)), int(m.group(4))) if stable else f"torch{m.group(1)}{m.group(2)}" == tag
        if not torch_ok or (backend != "cpu" and not cuda_tag_loads(m.group(5), torch.version.cuda)):
            return None
        cuda_minor = cuda_version(m.group(5))[1] if backend != "cpu" else 0
        if stable:
            return (0, -int(m.group(3)), -int(m.group(4)), -cuda_minor)
        return (1, 0, 0, -cuda_minor)

    backends = {v: json.loads((v / "metadata.json").read_text())["backend"]["type"] for v in variants}
    keys = {v: preference(v, b) for v, b in backends.items()}
    chosen = {}
    for v, key in keys.items():
        if key is not None and (backends[v] not in chosen or key < keys[chosen[backends[v]]]):
            chosen[backends[v]] = v
    for v in variants:
        backend = backends[v]
        if keys[v] is None:
            print(f"[hub-tree] get_kernel: {v.name} is not loadable with the installed torch {torch.__version__}; "
                  "skipped")
            continue
        if chosen[backend] != v:
            print(f"[hub-tree] get_kernel: {v.name} is shadowed by {chosen[backend].name}, which `kernels` prefers; "
                  "skipped")
            continue
        code = NO_NETWORK + textwrap.dedent(f"""
            import torch, kernels
            k = kernels.get_kernel({cfg.hub_repo_id!r}, version={cfg.version}, backend={backend!r})
            assert {str(cache)!r} in k.__file__, k.__file__
            assert {v.name!r} in k.__file__, k.__file__
            y = k.rms_norm(torch.randn(2, 16), torch.ones(16))
            assert y.shape == (2, 16)
            print(k.__name__)
            """)
        env = {k: val for k, val in os.environ.items() if k != "LOCAL_KERNELS"}
        env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), KERNELS_CACHE=str(cache),
                   HF_HUB_DISABLE_TELEMETRY="1")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
        if proc.returncode != 0:
            problems.append(f"{v.name}: get_kernel({cfg.hub_repo_id!r}, version={cfg.version}, backend={backend!r}) "
                            f"from the offline cache failed: {proc.stderr.strip()[-800:]}")
        else:
            print(f"[hub-tree] get_kernel ok: {v.name} -> {proc.stdout.strip()}")
    return problems


def upload_commands(cfg: BuildConfig, out: Path) -> list[str]:
    base = f"kernel-builder upload --repo-type kernel --repo-id {cfg.hub_repo_id}"
    cmds = [f"{base} {out}"]
    if cfg.hub_branch:
        cmds = [f"{base} --branch {cfg.hub_branch} {out}"]
    elif cfg.version == 1:
        # kernels-community's release workflow: version-1 kernels without a hub branch also go to main, for
        # loaders that do not ask for a version.
        cmds.append(f"{base} --branch main {out}")
    return cmds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="directory to create (must not exist, or be empty)")
    ap.add_argument("--build", type=Path, default=ROOT / "build", help="the build tree (default: build/)")
    ap.add_argument("--variant", action="append", help="only this variant (repeatable; default: all built)")
    ap.add_argument("--no-load", action="store_true", help="skip the get_kernel check (faster)")
    args = ap.parse_args(argv)
    out = args.out.resolve()
    try:
        cfg = load_build_config(ROOT / "build.toml")
        if not cfg.hub_repo_id:
            raise TreeError("build.toml has no [general.hub] repo-id")
        if out.exists() and any(out.iterdir()):
            raise TreeError(f"{out} exists and is not empty")
        if out.is_relative_to(args.build.resolve()):
            raise TreeError("--out must not be inside the build tree")
        variants = find_variants(args.build, args.variant)
        problems = card_problems(ROOT / "CARD.md", cfg) + benchmark_problems(ROOT / "benchmarks")
        for v in variants:
            problems += variant_problems(v, cfg)
        if problems:
            raise TreeError("\n".join(problems))
        out.mkdir(parents=True, exist_ok=True)
        assemble(cfg, variants, out)
        print(f"[hub-tree] assembled {out}: {len(variants)} variant(s): {', '.join(v.name for v in variants)}")
        tree_variants = [out / "build" / v.name for v in variants]
        with tempfile.TemporaryDirectory(prefix="fused-mlp-hub.") as tmp:
            scratch = Path(tmp)
            for v in tree_variants:
                problems += variant_problems(v, cfg)  # the copies, as uploaded
                problems += kernels_info_problems(v, cfg, scratch)
            if not args.no_load and not problems:
                problems += get_kernel_problems(cfg, tree_variants, offline_cache(cfg, out, scratch))
        if problems:
            raise TreeError("\n".join(problems))
    except (TreeError, BuildConfigError) as e:
        for line in str(e).splitlines():
            print(f"fused-mlp hub-tree error: {line}", file=sys.stderr)
        return 1
    print("[hub-tree] all checks passed. To publish (needs HF_TOKEN with write access to the repo; CI signs each "
          "build/<variant>/metadata.json with cosign first), run:")
    for cmd in upload_commands(cfg, out):
        print(cmd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
