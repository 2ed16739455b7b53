"""torch.func transforms (grad, vmap of grad: per-sample gradients, functional_call) over the ops and a kernelized
model. The autograd Functions leave out ``setup_context``, which those transforms need, so under a transform the ops
run their fp32 definitions in PyTorch ops, warned once per op (docs/design.md#torchfunc)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.func import functional_call, grad, vmap

from _utils import fallback_warnings, opted_in

H, I = 32, 48


def _operands(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 3, H, generator=g).to(device)
    ws = {"w_norm": 1 + 0.25 * torch.randn(H, generator=g), "w_gate": torch.randn(I, H, generator=g) / H**0.5,
          "w_up": torch.randn(I, H, generator=g) / H**0.5, "w_down": torch.randn(H, I, generator=g) / I**0.5,
          "b": torch.randn(I, generator=g) / 10, "res": torch.randn(4, 3, H, generator=g)}
    return x, {k: v.to(device) for k, v in ws.items()}


def _losses(fm):
    """Each op in a scalar loss of (x, weights), the weighting fixed so that every gradient entry matters."""
    def weigh(y):
        return (y * torch.linspace(-1, 1, y.numel(), device=y.device, dtype=y.dtype).view(y.shape)).sum()

    return {
        "rms_norm": lambda x, w: weigh(fm.rms_norm(x, w["w_norm"], 1e-6)),
        "rms_norm residual": lambda x, w: weigh(fm.rms_norm(x, w["w_norm"], 1e-6, residual=w["res"])[0]),
        "geglu": lambda x, w: weigh(fm.geglu(x @ w["w_gate"].t(), x @ w["w_up"].t())),
        "linear gelu_tanh": lambda x, w: weigh(fm.linear(x, w["w_gate"], w["b"], activation="gelu_tanh")),
        "addmm": lambda x, w: weigh(fm.addmm(w["b"], x.reshape(-1, H), w["w_up"].t())),
        "gated_mlp": lambda x, w: weigh(fm.gated_mlp(x, w["w_gate"], w["w_up"], w["w_down"], activation="silu")),
    }


@pytest.mark.parametrize("op", list(_losses(None)))
def test_grad_of_each_op_matches_autograd(fm, device, op):
    loss = _losses(fm)[op]
    x, ws = _operands(device)
    xs = x.clone().requires_grad_()
    wr = {k: v.clone().requires_grad_() for k, v in ws.items()}
    loss(xs, wr).backward()  # eager autograd through the kernels
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dx, dw = grad(loss, argnums=(0, 1))(x, ws)
    torch.testing.assert_close(dx, xs.grad, rtol=1e-5, atol=1e-5)
    for k, v in dw.items():
        if wr[k].grad is None:
            assert not v.any(), k
        else:
            torch.testing.assert_close(v, wr[k].grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"{op} d{k}: {m}")


def test_per_sample_grads_with_vmap(fm, device):
    """vmap(grad(...)) over the batch: each sample's gradient equals a separate autograd backward of that sample."""
    loss = _losses(fm)["gated_mlp"]
    x, ws = _operands(device, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        per = vmap(grad(lambda xi, w: loss(xi.unsqueeze(0), w), argnums=1), in_dims=(0, None))(x, ws)
    for i in range(x.shape[0]):
        wr = {k: v.clone().requires_grad_() for k, v in ws.items()}
        loss(x[i:i + 1], wr).backward()
        for k in ("w_gate", "w_up", "w_down"):
            torch.testing.assert_close(per[k][i], wr[k].grad, rtol=1e-5, atol=1e-5)


def test_functional_call_grad_of_a_kernelized_model(fm, device):
    """torch.func.grad over functional_call of a kernelized Llama-shaped model equals its own backward; the fallback
    is said once per op."""
    transformers = pytest.importorskip("transformers")
    kernels = pytest.importorskip("kernels")
    from transformers.models.llama import modeling_llama

    from conftest import ROOT

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=H, intermediate_size=I, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(device)
    names = ("RMSNorm", "GeGLUMLP", "Linear")
    mapping = {n: {device: kernels.LocalLayerRepository(repo_path=ROOT, layer_name=n)} for n in names}
    with opted_in([(modeling_llama.LlamaMLP, "GeGLUMLP"), (torch.nn.Linear, "Linear")]), \
            kernels.use_kernel_mapping(mapping, inherit_mapping=False):
        kernels.kernelize(model, mode=kernels.Mode.TRAINING, device=device, use_fallback=True)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1)).to(device)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p):
        return functional_call(model, p, (ids,), {"labels": ids}).loss

    model.zero_grad(set_to_none=True)
    model(ids, labels=ids).loss.backward()
    got, said = fallback_warnings(fm, lambda: [grad(loss)(params) for _ in range(2)][0], match="torch.func transform")
    assert sorted(said) == sorted(f"fused_mlp: under a torch.func transform, {op} runs its fp32 definition in PyTorch ops, "
                          "not the fused kernel (see docs/design.md#torchfunc)"
                          for op in ("rms_norm", "gated_mlp", "the gated activation", "linear / addmm")), said
    for k, p in model.named_parameters():
        torch.testing.assert_close(got[k], p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")
