"""fused-mlp: fast, exactly-rounded kernels for the layers around every transformer MLP block.

Functional API (any leading dims; float32/float16/bfloat16; CPU and CUDA; differentiable; torch.compile-able):
``rms_norm``. Layers for ``kernels.kernelize`` live in ``fused_mlp.layers``.
"""

from . import layers
from .rms_norm import rms_norm, rms_norm_reference

__all__ = ["layers", "rms_norm", "rms_norm_reference"]

# ---- gated activations and the gated MLP (geglu.py) ----
from .geglu import (  # noqa: E402
    gated_mlp,
    gated_mlp_reference,
    geglu,
    geglu_reference,
    swiglu,
    swiglu_reference,
)

__all__ += ["geglu", "swiglu", "gated_mlp", "geglu_reference", "swiglu_reference", "gated_mlp_reference"]
