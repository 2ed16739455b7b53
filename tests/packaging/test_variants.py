"""The stable-ABI variant (torch-stable-abi210-*, one binary for every torch >= 2.10) and the per-torch variant
(torch<XY>-cxx11-*) are built from the same sources through torch_compat.h: loaded side by side in one process,
every op gives bitwise the same outputs and gradients, on the CPU and (where present) on the GPU; and the
stable-ABI binaries import none of torch's C++ symbols.

The rest of the suite runs on the variant `kernels` prefers (the stable one when it is built);
`FUSED_MLP_VARIANT=torch python -m pytest tests` runs it all on the per-torch one.

tools/build.py builds, like kernel-builder, only the stable-ABI variants by default; `python tools/build.py --abi all`
adds the per-torch ones (CI does). Without a per-torch variant for the running torch (not built, or a newer torch than
the build's) these tests skip, saying so."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEVICES, ROOT, TORCH_TAG, load_local, variant_root

BUILD = ROOT / "build"
BUILT = sorted(d.name for d in BUILD.iterdir() if d.is_dir() and not d.name.startswith(".")) if BUILD.is_dir() else []
HAVE_STABLE = any(n.startswith("torch-stable-abi") for n in BUILT)
# `kernels` loads a per-torch variant only under the torch it was built for.
HAVE_PER_TORCH = any(n.startswith(f"{TORCH_TAG}-cxx11-") for n in BUILT)
pytestmark = pytest.mark.skipif(
    not (HAVE_STABLE and HAVE_PER_TORCH),
    reason=f"needs a stable-ABI variant and a per-torch variant for torch {torch.__version__} ({TORCH_TAG}-cxx11-*) "
           f"built; built: {BUILT or 'nothing'}; the per-torch ones come from `python tools/build.py --abi all`")


@pytest.fixture(scope="module")
def pair():
    stable = load_local(variant_root("stable"))
    classic = load_local(variant_root("torch"))
    assert stable.__name__ != classic.__name__  # two namespaces, loaded side by side
    return stable, classic


def _run(fm, device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every op forward and backward on fixed inputs; returns outputs and gradients."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype).requires_grad_()

    outs: list[torch.Tensor] = []
    x, w, res = rnd(37, 1000), rnd(1000, scale=0.1), rnd(37, 1000)
    y, h = fm.rms_norm(x, w, residual=res, eps=1e-6)
    (y.float().square().sum() + h.float().sum()).backward()
    outs += [y, h, x.grad, w.grad, res.grad]

    gate, up = rnd(19, 333), rnd(19, 333)
    for act in ("gelu_tanh", "gelu", "silu"):
        gate.grad = up.grad = None
        hh = fm.geglu(gate, up, approximate="tanh" if act == "gelu_tanh" else "none") if act != "silu" \
            else fm.swiglu(gate, up)
        hh.float().square().sum().backward()
        outs += [hh, gate.grad, up.grad]

    xm = rnd(23, 64)
    wg, wu, wd = rnd(160, 64, scale=0.1), rnd(160, 64, scale=0.1), rnd(64, 160, scale=0.1)
    bg = rnd(160, scale=0.1)
    ym = fm.gated_mlp(xm, wg, wu, wd, bg, activation="gelu_tanh")
    ym.float().square().sum().backward()
    outs += [ym, xm.grad, wg.grad, wu.grad, wd.grad, bg.grad]

    xl, wl, bl = rnd(45, 96), rnd(72, 96, scale=0.1), rnd(72, scale=0.1)
    for act in (None, "gelu_tanh", "gelu"):
        xl.grad = wl.grad = bl.grad = None
        yl = fm.linear(xl, wl, bl, activation=act)
        yl.float().square().sum().backward()
        outs += [yl, xl.grad, wl.grad, bl.grad]
    return [t.detach() for t in outs]


def _compilers(module) -> str:
    """The compilers recorded in the binary's .comment section ("GCC: (...) 12.2.0" ...), or "" if unknown."""
    so = next(iter(Path(module.__file__).parent.glob("*.so")), None)
    try:
        out = subprocess.run(["readelf", "-p", ".comment", str(so)], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ""
    return " ".join(sorted(set(re.findall(r"GCC: \([^)]*\) [\d.]+", out.stdout))))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_stable_and_per_torch_variants_agree_bitwise(pair, device, dtype):
    """Bitwise, when one toolchain built both (CI, a local build). Built by different host compilers (e.g. the
    stable binary shipped from elsewhere, the per-torch one built on the GPU machine), the CPU code may contract
    a*b+c into FMAs differently: there the CPU results must agree to within 4 units of the last place; the GPU
    code comes from one nvcc either way and stays bitwise."""
    stable, classic = pair
    same_toolchain = _compilers(stable) != "" and _compilers(stable) == _compilers(classic)
    a, b = _run(stable, device, dtype), _run(classic, device, dtype)
    assert len(a) == len(b)
    for k, (u, v) in enumerate(zip(a, b)):
        assert u.dtype == v.dtype and u.shape == v.shape, k
        if same_toolchain or device != "cpu":
            assert torch.equal(u, v), f"result {k} differs between the stable-ABI and the per-torch variant"
        else:
            eps = torch.finfo(dtype).eps
            torch.testing.assert_close(u, v, rtol=4 * eps, atol=4 * eps * v.abs().max().item(),
                                       msg=lambda m: f"result {k}: {m}")


def test_stable_variant_imports_no_torch_cxx_symbols():
    sys.path.insert(0, str(ROOT / "tools"))
    from abi_check import torch_cxx_symbols

    sos = [so for n in BUILT if n.startswith("torch-stable-abi") for so in (BUILD / n).glob("*.so")]
    assert sos
    for so in sos:
        assert torch_cxx_symbols(so) == [], so
