"""fused-mlp: fast, exactly-rounded kernels for the layers around every transformer MLP block.

Functional API (any leading dims; float32/float16/bfloat16; CPU and CUDA; differentiable; torch.compile-able):
``rms_norm``. Layers for ``kernels.kernelize`` live in ``fused_mlp.layers``.
"""

from . import layers
from .rms_norm import rms_norm, rms_norm_reference

__all__ = ["layers", "rms_norm", "rms_norm_reference"]

# ---- addmm / linear (bias + GeLU on the fp32 GEMM accumulator) ----
from .addmm import addmm, addmm_reference, linear, linear_reference  # noqa: E402

__all__ += ["addmm", "addmm_reference", "linear", "linear_reference"]
