#!/usr/bin/env python3
"""Check every extension module under a build tree with kernel-abi-check: Python abi3 (>= 3.9) and
manylinux_2_28, as the Hub requires.   python tools/abi_check.py build"""

from __future__ import annotations

import sys
from pathlib import Path

from kernel_abi_check import ObjectFile

PYTHON_ABI = "3.9"
MANYLINUX = "manylinux_2_28"


def check_file(so: Path) -> list[str]:
    """Problems kernel-abi-check reports for one shared object (empty when it passes)."""
    obj = ObjectFile(str(so))
    return [str(p) for p in list(obj.check_python_abi(PYTHON_ABI)) + list(obj.check_manylinux(MANYLINUX))]


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
            print(f"abi-check: ok   {so} (abi3 >= {PYTHON_ABI}, {MANYLINUX})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
