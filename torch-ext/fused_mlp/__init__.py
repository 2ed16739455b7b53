"""fused-mlp: fast, exactly-rounded kernels for the layers around every transformer MLP block.

Functional API (any leading dims; float32/float16/bfloat16; CPU and CUDA; differentiable; usable inside
``torch.compile(fullgraph=True)``; fp32 math, each result rounded once):

- ``rms_norm(x, weight=None, eps=1e-6, *, offset=0.0, residual=None, residual_dtype=None)``
- ``geglu(gate, up, *, approximate="tanh")``, ``swiglu(gate, up)``, ``gated_mlp(...)`` (the fused MLP)
- ``addmm(bias, mat1, mat2, *, activation=None)``, ``linear(input, weight, bias=None, *, activation=None)``

``*_reference`` are the plain-PyTorch definitions the tests and benchmarks compare against. Layers for
``kernels.kernelize`` live in ``fused_mlp.layers``.
"""

from . import layers
from .addmm import addmm, addmm_reference, linear, linear_reference
from .gated_mlp import gated_mlp, gated_mlp_reference
from .geglu import geglu, geglu_reference, swiglu, swiglu_reference
from .rms_norm import rms_norm, rms_norm_reference

__all__ = [
    "addmm",
    "addmm_reference",
    "gated_mlp",
    "gated_mlp_reference",
    "geglu",
    "geglu_reference",
    "layers",
    "linear",
    "linear_reference",
    "rms_norm",
    "rms_norm_reference",
    "swiglu",
    "swiglu_reference",
]
