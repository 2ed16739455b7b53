#!/usr/bin/env python3
"""Check every extension module under a build tree with kernel-abi-check: Python abi3 (>= 3.9) and
manylinux_2_28, as the Hub requires; the binaries of stable-ABI variants (build/torch-stable-abi*/) also must not
import any of torch's C++ symbols.   python tools/abi_check.py build"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

PYTHON_ABI = "3.9"
MANYLINUX = "manylinux_2_28"


def torch_cxx_symbols(so: Path) -> list[str]:
    """A stable-ABI binary may reach torch only through its C shim (aoti_torch_*, torch_* functions): an undefined
    C++ symbol of torch's namespaces (at::, c10::, torch::, caffe2::; header-only code is compiled in, not
    imported) would tie it to one torch build. kernel-abi-check has no such check (0.14)."""
    out = subprocess.run(["nm", "-D", "--undefined-only", "-C", str(so)], capture_output=True, text=True)
    if out.returncode != 0:
        return [f"nm failed: {out.stderr.strip()[:200]}"]
    bad = [ln.split(None, 1)[-1] for ln in out.stdout.splitlines() if re.search(r"\b(at|c10|torch|caffe2)::", ln)]
    return [f"torch C++ symbol imported by a stable-ABI binary: {b}" for b in bad]


def is_stable_abi(so: Path) -> bool:
    return any(p.startswith("torch-stable-abi") for p in so.resolve().parts)


def check_file(so: Path) -> list[str]:
    """Problems kernel-abi-check reports for one shared object (empty when it passes), plus, for a stable-ABI
    variant's binary, every torch C++ symbol it imports."""
    from kernel_abi_check import ObjectFile  # here, so that torch_cxx_symbols works without it

    obj = ObjectFile(str(so))
    problems = [str(p) for p in list(obj.check_python_abi(PYTHON_ABI)) + list(obj.check_manylinux(MANYLINUX))]
    return problems + (torch_cxx_symbols(so) if is_stable_abi(so) else [])


def main(argv: list[str]) -> int:
    roots = [Path(a) for a in argv] or [Path("build")]
    sos = sorted(so for r in roots for so in r.rglob("*.so"))
    if not sos:
        print(f"abi-check: no .so files under {', '.join(map(str, roots))}", file=sys.stderr)
        return 1
    bad = 0
    for so in sos:
        problems = check_file(so)
        if problems:
            bad += 1
            print(f"abi-check: FAIL {so}: " + "; ".join(problems[:10]))
        else:
            print(f"abi-check: ok   {so} (abi3 >= {PYTHON_ABI}, {MANYLINUX}"
                  + (", stable ABI: no torch C++ symbols" if is_stable_abi(so) else "") + ")")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
