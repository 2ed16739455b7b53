"""Gated-MLP GEMMs with fused epilogues in Triton (opt-in path of ``gated_mlp``; project issue 10).

Forward: ``h = act(x W_gate^T) * (x W_up^T)`` as one dual-B GEMM (each ``x`` tile is read once for both weights,
two fp32 accumulators, ``h`` rounded once; in training gate and up are also stored, in x's dtype), then
``y = h W_down^T`` by cuBLAS. Backward: ``dh = dy W_down`` with the dGeGLU epilogue (``dgate = dh up act'(gate)``,
``dup = dh act(gate)`` written over the saved gate/up, ``h`` rebuilt for ``dW_down``; dh never reaches memory), the
rest (dx, weight grads) by cuBLAS. Shapes: x ``[T, H]``, W_gate/W_up ``[I, H]`` (the module's own weights, no
concatenated copy), W_down ``[H_out, I]``. CUDA, bf16/fp16, no biases; anything else takes the cuBLAS path.

Why Triton and not CUTLASS 3: Triton JIT-compiles for whatever GPU it runs on, so the package gains no per-arch
build cost (the non-Nix build and the CI run on 2 cores) and needs no CUTLASS headers; and a dual-B mainloop
with a custom epilogue is a few dozen lines. A CUTLASS 3 Hopper warp-specialised kernel with an epilogue
visitor tree (TMA + WGMMA, persistent, ping-pong) is the likely ceiling on sm_90 but costs CUTLASS headers and a
compile per architecture in every variant. Nothing here has been measured yet: ``benchmarks/epilogue.py`` writes
the comparison (cuBLAS path, this path, torch.compile) and the dispatch table below is to be filled from it.

Importing this module imports torch only; triton is imported inside the custom ops, when the path runs.
Numerics: fp32 math on the fp32 accumulators, every output rounded once (the activations use the formulas of
kernels_src/cuda/geglu.cu).
"""

import importlib.util
import os

import torch

from ._common import declare_grad_dtypes, is_plain
from ._ops import add_op_namespace_prefix

__all__ = ["BACKENDS", "EPILOGUE_DISPATCH", "gated_mlp_triton", "use_triton"]

BACKENDS = ("auto", "cublas", "triton")
HAS_TRITON = importlib.util.find_spec("triton") is not None  # located, not imported
# Under TRITON_INTERPRET=1 (CPU tests) the kernels run in Triton's interpreter on CPU tensors.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# When `backend="auto"` takes the Triton path: {(compute capability, dtype): minimum token count}. Filled from
# benchmarks/results/<gpu>/epilogue.csv (`python benchmarks/epilogue.py --out benchmarks/results/<gpu>`), one entry
# per measured win with the measurement in a comment next to it. Empty: nothing measured yet, so "auto" is the
# cuBLAS path everywhere.
EPILOGUE_DISPATCH: dict[tuple[tuple[int, int], torch.dtype], int] = {}


# ---- custom ops (opaque to torch.compile; fake impls give the shapes) --------------------------------------


@torch.library.custom_op(add_op_namespace_prefix("triton_gated_dual_gemm"), mutates_args=())
def gated_dual_gemm(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, activation: str) -> torch.Tensor:
    """h = act(x @ w_gate^T) * (x @ w_up^T); x [T, H], w_gate/w_up [I, H] -> h [T, I] (inference)."""
    from . import _triton_mlp_kernels as kern

    return kern.gated_dual_gemm(x, w_gate, w_up, activation, False)[0]


@gated_dual_gemm.register_fake
def _gated_dual_gemm_fake(x, w_gate, w_up, activation):
    return x.new_empty((x.shape[0], w_gate.shape[0]))


@torch.library.custom_op(add_op_namespace_prefix("triton_gated_dual_gemm_train"), mutates_args=())
def gated_dual_gemm_train(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                          activation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, gate, up), each [T, I] in x's dtype (training: gate and up are saved for backward)."""
    from . import _triton_mlp_kernels as kern

    return kern.gated_dual_gemm(x, w_gate, w_up, activation, True)


@gated_dual_gemm_train.register_fake
def _gated_dual_gemm_train_fake(x, w_gate, w_up, activation):
    shape = (x.shape[0], w_gate.shape[0])
    return x.new_empty(shape), x.new_empty(shape), x.new_empty(shape)


@torch.library.custom_op(add_op_namespace_prefix("triton_gated_bwd_gemm_inplace"), mutates_args=("gate", "up"))
def gated_bwd_gemm_inplace(dy: torch.Tensor, w_down: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                           activation: str) -> torch.Tensor:
    """dh = dy @ w_down in fp32 (never stored); gate <- dgate, up <- dup in place; returns h = act(gate) * up.
    dy [T, H_out], w_down [H_out, I], gate/up [T, I] contiguous, one dtype."""
    from . import _triton_mlp_kernels as kern

    return kern.gated_bwd_gemm_(dy, w_down, gate, up, activation)


@gated_bwd_gemm_inplace.register_fake
def _gated_bwd_gemm_inplace_fake(dy, w_down, gate, up, activation):
    return gate.new_empty(gate.shape)


# ---- autograd ----------------------------------------------------------------------------------------------

try:  # as in geglu.py: does the running backward keep the graph (retain_graph=True)?
    from torch._C._autograd import _get_current_graph_task_keep_graph as _keep_graph
except ImportError:  # pragma: no cover
    def _keep_graph() -> bool:
        return True


class _TritonGatedMLPFunction(torch.autograd.Function):
    """``down(act(x W_g^T) * (x W_u^T))`` on 2-D x; saves x, gate, up (not h), like the cuBLAS path."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, activation):
        h, gate, up = gated_dual_gemm_train(x, w_gate, w_up, activation)
        y = torch.mm(h, w_down.t())
        ctx.save_for_backward(x, w_gate, w_up, w_down, gate, up)
        ctx.activation = activation
        declare_grad_dtypes(ctx, None)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, w_gate, w_up, w_down, gate, up = ctx.saved_tensors
        need = ctx.needs_input_grad
        if dy.dtype != x.dtype:  # an fp32 gradient at a bf16/fp16 output: the GEMMs need one dtype
            dy = dy.to(x.dtype)
        if not torch.compiler.is_compiling() and _keep_graph():
            gate, up = gate.clone(), up.clone()  # retain_graph=True: the saved tensors must survive (rare)
        h = gated_bwd_gemm_inplace(dy, w_down, gate, up, ctx.activation)  # gate <- dgate, up <- dup
        dgate, dup = gate, up
        d_w_down = torch.mm(dy.t(), h) if need[3] else None
        del h
        dx = None
        if need[0]:
            dx = torch.mm(dgate, w_gate)
            dx.addmm_(dup, w_up)  # accumulated in the GEMM (one rounding for the sum)
        d_w_gate = torch.mm(dgate.t(), x) if need[1] else None
        d_w_up = torch.mm(dup.t(), x) if need[2] else None
        return dx, d_w_gate, d_w_up, d_w_down, None


# ---- dispatch ----------------------------------------------------------------------------------------------


def use_triton(backend: str, x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
               has_bias: bool, autocast: bool) -> bool:
    """Does this call take the Triton path? ``backend="triton"`` asks for it; ``"auto"`` takes it only where
    EPILOGUE_DISPATCH records a measured win. Unsupported calls (no triton, not CUDA, fp32, biases, tensor
    subclasses, mixed dtypes) take the cuBLAS path, which is the package's regular kernel path."""
    if backend == "cublas" or not HAS_TRITON or has_bias:
        return False
    if backend == "auto" and not EPILOGUE_DISPATCH:
        return False
    if not (x.is_cuda or (INTERPRET and x.device.type == "cpu")):
        return False
    if not (is_plain(x) and is_plain(w_gate) and is_plain(w_up) and is_plain(w_down)):
        return False
    dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
    if dtype is not torch.bfloat16 and dtype is not torch.float16:
        return False
    if not autocast and not (w_gate.dtype is dtype and w_up.dtype is dtype and w_down.dtype is dtype):
        return False
    if backend == "auto":
        if not x.is_cuda:
            return False
        min_tokens = EPILOGUE_DISPATCH.get((torch.cuda.get_device_capability(x.device), dtype))
        return min_tokens is not None and x.shape[:-1].numel() >= min_tokens
    return True


def gated_mlp_triton(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                     activation: str, training: bool, autocast: bool) -> torch.Tensor:
    """The MLP through the Triton epilogue GEMMs; call only where `use_triton` said yes."""
    if autocast:  # cast once, as autocast would cast each F.linear's operands (differentiable casts)
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w_gate, w_up, w_down = x.to(dtype), w_gate.to(dtype), w_up.to(dtype), w_down.to(dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if training:
        y = _TritonGatedMLPFunction.apply(x2, w_gate, w_up, w_down, activation)
    else:
        y = torch.mm(gated_dual_gemm(x2, w_gate, w_up, activation), w_down.t())
    return y.view(*lead, y.shape[-1])
