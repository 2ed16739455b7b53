"""Stateless layers for ``kernels.kernelize``: each replaces the ``forward`` of a transformers module and reads
that module's own parameters. No ``__init__``, no members but ``forward`` (the ``kernels`` layer rules)."""

from __future__ import annotations

import torch
from torch import nn

from .rms_norm import rms_norm

__all__ = ["RMSNorm", "GemmaRMSNorm"]


class RMSNorm(nn.Module):
    """LlamaRMSNorm / Qwen3RMSNorm / every transformers class decorated ``"RMSNorm"``.

    Reads ``weight`` and ``variance_epsilon``. The output dtype is the module's own,
    ``promote(weight.dtype, input.dtype)`` (fp32 weights with bf16 activations give fp32), but the result is
    rounded once from fp32 math instead of twice.
    """

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        out_dtype = torch.promote_types(weight.dtype, hidden_states.dtype)
        return rms_norm(hidden_states, weight, self.variance_epsilon, out_dtype=out_dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma / Gemma2 / Gemma3 RMSNorm: ``y = norm(x) * (1 + w)`` in fp32, returned in ``x``'s dtype.

    Reads ``weight`` and ``eps``.
    """

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, offset=1.0, out_dtype=x.dtype)


# ---- addmm / linear layers ------------------------------------------------------------------------------------

from .addmm import addmm as _addmm  # noqa: E402
from .addmm import linear as _linear  # noqa: E402

__all__ += ["Linear", "Conv1D"]


class Linear(nn.Module):
    """``nn.Linear``: ``input @ weight.T + bias`` with the bias added to the fp32 GEMM accumulator (one rounding)
    and the bias gradient summed in fp32.

    Reads ``weight`` ``[out, in]`` (used in place, no transpose copy) and ``bias`` (may be None). Output dtype as
    ``nn.Linear``'s (the input's; under autocast, the autocast dtype).
    """

    can_torch_compile = True
    has_backward = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _linear(input, self.weight, self.bias)


class Conv1D(nn.Module):
    """transformers' GPT-2 style ``Conv1D``: ``addmm(bias, x.view(-1, in), weight).view(..., out)`` with
    ``weight`` ``[in, out]`` (used in place) and ``bias`` ``[out]``, fused on the fp32 accumulator.
    """

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _addmm(self.bias, x, self.weight)
