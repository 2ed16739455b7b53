"""Smoke tests for kernel-builder's test closure (`nix build .#ci-test`, which runs `pytest tests -m kernels_ci`
with LOCAL_KERNELS pointing at the variant it built): every op, forward and backward, small shapes, on every
device present, against the fp32 references with the 2x rule. The full suite covers the rest."""

from __future__ import annotations

import pytest
import torch

from _utils import assert_2x_rule

pytestmark = pytest.mark.kernels_ci

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_ci(fm, device, dtype):
    torch.manual_seed(0)
    x = torch.randn(3, 7, 256, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(256, device=device, dtype=dtype, requires_grad=True)
    y = fm.rms_norm(x, w, 1e-6, offset=1.0)
    y32 = fm.rms_norm_reference(x.detach().float(), w.detach().float(), 1e-6, offset=1.0)
    same = fm.rms_norm_reference(x.detach(), w.detach(), 1e-6, offset=1.0, compute_dtype=dtype)
    assert_2x_rule(y, y32, same, name="y")
    y.float().square().sum().backward()
    assert x.grad is not None and w.grad is not None
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()


@pytest.mark.parametrize("act", ["geglu", "swiglu"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_activation_ci(fm, device, dtype, act):
    torch.manual_seed(0)
    gate = torch.randn(5, 384, device=device, dtype=dtype, requires_grad=True)
    up = torch.randn(5, 384, device=device, dtype=dtype, requires_grad=True)
    out = getattr(fm, act)(gate, up)
    ref32 = getattr(fm, f"{act}_reference")(gate.detach().float(), up.detach().float())
    same = getattr(fm, f"{act}_reference")(gate.detach(), up.detach(), compute_dtype=dtype)
    assert_2x_rule(out, ref32, same)
    out.float().sum().backward()
    assert torch.isfinite(gate.grad).all() and torch.isfinite(up.grad).all()


@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_addmm_ci(fm, device, dtype, activation):
    torch.manual_seed(0)
    bias = torch.randn(96, device=device, dtype=dtype, requires_grad=True)
    a = torch.randn(9, 64, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(64, 96, device=device, dtype=dtype, requires_grad=True)
    out = fm.addmm(bias, a, b, activation=activation)
    ref32 = fm.addmm_reference(bias.detach(), a.detach(), b.detach(), activation=activation, out_dtype=torch.float32)
    same = fm.addmm_reference(bias.detach(), a.detach(), b.detach(), activation=activation, compute_dtype=dtype)
    assert_2x_rule(out, ref32, same)
    out.float().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (bias, a, b))


def test_gated_mlp_ci(fm, device):
    torch.manual_seed(0)
    x = torch.randn(4, 64, device=device)
    wg, wu, wd = (torch.randn(128, 64, device=device) / 8, torch.randn(128, 64, device=device) / 8,
                  torch.randn(64, 128, device=device) / 11)
    out = fm.gated_mlp(x, wg, wu, wd, activation="silu")
    ref = fm.gated_mlp_reference(x, wg, wu, wd, activation="silu")
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
