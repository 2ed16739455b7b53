"""When the GeGLU MLP runs its GEMMs with the gated activation in the epilogue (kernels_src/cuda/gated_gemm_sm90.cu).

Two CUTLASS 3 kernels for sm_90 (Hopper), each replacing a cuBLAS GEMM plus one elementwise pass over [T, I]:

- forward ``gated_gemm_fwd``: ``h = act(x W_g^T) * (x W_u^T)`` from one dual-B GEMM (and, in training, the
  pre-activations gate/up it saves), instead of two cuBLAS GEMMs and the activation kernel;
- backward ``gated_gemm_bwd_``: ``dh = dy W_d`` in fp32 and dGeGLU on it in the epilogue (h, dgate, dup), instead
  of a cuBLAS GEMM and the in-place activation-backward kernel. Not used by ``gated_mlp`` unless
  ``FUSED_MLP_GEMM_EPILOGUE_BWD=1`` (an unexplained fault inside the MLP's backward on the H200; see BWD_ENV).

Which one runs is decided per call from the table below (``DISPATCH``). The cuBLAS path is the default everywhere
else: other GPUs, fp32, biased gate/up projections, sizes that are not multiples of 8, and the shapes where the
benchmark (``benchmarks/epilogue.py``, H200) did not show the fused kernel winning. ``FUSED_MLP_GEMM_EPILOGUE``
overrides the table: ``off`` never uses the fused kernels, ``on`` uses them wherever they can run (tests,
benchmarks), ``fwd`` / ``bwd`` only that pass's kernel, ``auto`` (default) follows the table. Either way the results agree within the "2x the same-dtype
PyTorch error" rule: both paths round each stored value once.
"""

from __future__ import annotations

import os

import torch

from ._common import warn_once
from ._ops import ops

try:  # decide a size test without adding a data-dependent guard (unbacked sizes under torch.compile: False)
    from torch.fx.experimental.symbolic_shapes import guard_or_false as _known_true
except ImportError:  # pragma: no cover - older torch
    def _known_true(cond) -> bool:
        return bool(cond) if not isinstance(cond, torch.SymBool) else False

ENV = "FUSED_MLP_GEMM_EPILOGUE"
MODES = ("auto", "on", "off", "fwd", "bwd")  # fwd / bwd: only that pass fused (benchmarks)
# The backward kernel is not used by gated_mlp unless FUSED_MLP_GEMM_EPILOGUE_BWD=1 (experiments only): on the H200 it
# passed every op-level test and compute-sanitizer (memcheck, racecheck), but inside the MLP's backward it made
# CUDA report "an illegal instruction" in a TMA load of its mainloop in 35 of 103 MLP tests. The logs show why:
# cuTensorMapEncodeTiled failed with CUDA_ERROR_INVALID_CONTEXT on the autograd engine's thread (no current
# context) and the kernel ran with a zero descriptor. The launcher now makes the context current and refuses a
# zero descriptor, but that fix has not run on a GPU yet; until it has, the backward kernel stays opt-in. It also
# measured slower than the cuBLAS path (DISPATCH below).
BWD_ENV = "FUSED_MLP_GEMM_EPILOGUE_BWD"

# Dispatch table: pass -> (minimum tokens T, minimum I, minimum H) from which the fused kernel is used in `auto`
# mode. Passes: "fwd" (inference forward: h only), "fwd_train" (training forward: h, gate, up), "bwd". A pass with
# no entry keeps the cuBLAS path. Every entry names the measurement it rests on (benchmarks/results/nvidia-h200/
# epilogue.csv; ratio = fused / cuBLAS path at the same shape, lower is better).
#
# H200, bf16, gelu_tanh, 5 interleaved rounds (epilogue.csv; fused / cuBLAS path):
#   fwd        H=2048 I=16384 T=512/1024/2048/4096: 0.979 0.958 0.938 0.945; H=3072 I=24576 T=512/4096: 0.982
#              0.980; H=4096 I=14336 T=512/4096: 0.976 0.994. Faster at every benchmarked shape (T >= 512): used
#              from T >= 512 within the measured H >= 2048, I >= 14336. Below (decode, small models): not measured.
#   fwd_train  (fwd+bwd with only the forward fused) 0.835 1.034 1.031 0.975 | 1.003 1.026 | 0.841 1.010: no
#              consistent win (the epilogue also writes gate and up) -> cuBLAS path.
#   bwd        (fwd+bwd with only the backward fused) 0.967 1.079 1.062 1.022 | 1.054 1.030 | 0.915 1.022: slower
#              at most shapes (its epilogue reads gate/up from global memory; see gated_gemm_sm90.cu) -> cuBLAS path.
DISPATCH: dict[str, tuple[int, int, int]] = {"fwd": (512, 14336, 2048)}

_CAPABILITY: dict[int, tuple[int, int]] = {}


# The two environment queries are constants to torch.compile (evaluated when the graph is traced, as a module
# attribute would be), so the dispatch works inside torch.compile(fullgraph=True).
@torch.compiler.assume_constant_result
def mode() -> str:
    m = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if m not in MODES:
        raise ValueError(f"{ENV} must be one of {MODES}, got {m!r}")
    return m


_AVAILABLE = hasattr(ops, "gated_gemm_fwd")  # every build registers the schema; only CUDA builds implement it


def available() -> bool:
    return _AVAILABLE


@torch.compiler.assume_constant_result
def _is_sm90(idx: int) -> bool:
    cap = _CAPABILITY.get(idx)
    if cap is None:
        cap = _CAPABILITY[idx] = torch.cuda.get_device_capability(idx)
    return cap == (9, 0)


def _runnable(tensors: tuple[torch.Tensor, ...]) -> bool:
    """CUDA sm_90, one 16-bit dtype, contiguous non-empty operands whose rows are 16-byte multiples and aligned
    (the first may have any rank: the MLP's x, viewed as [T, H] by the op)."""
    x = tensors[0]
    if x.dtype not in (torch.bfloat16, torch.float16):
        return False
    for t in tensors:
        if t.dtype != x.dtype or not t.is_contiguous():
            return False
        if not (_known_true(t.shape[-1] % 8 == 0) and _known_true(t.numel() > 0)):
            return False
        # Storages start 16-byte aligned, so the offset decides. Under torch.compile neither data_ptr() nor (inside
        # an autograd.Function) storage_offset() can be traced: there the op's own check reports a misaligned view.
        if not torch.compiler.is_compiling() and t.storage_offset() * t.element_size() % 16:
            return False
    return _is_sm90(x.device.index if x.device.index is not None else torch.cuda.current_device())


def _wanted(pass_: str, t, i, h) -> bool:
    m = mode()
    if m != "auto":
        return m in ("on", pass_.split("_")[0])
    rule = DISPATCH.get(pass_)
    return rule is not None and _known_true(t >= rule[0]) and _known_true(i >= rule[1]) and _known_true(h >= rule[2])


# The cheap tests come first (decode calls, T < 512, are latency-bound and must pay next to nothing here): device
# and bias, then the table's size thresholds, and only then the per-tensor checks.
def use_fwd(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, b_gate: torch.Tensor | None,
            b_up: torch.Tensor | None, *, training: bool = False) -> bool:
    """Forward through ``gated_gemm_fwd``? x: ``[..., H]`` (contiguous: the op takes its [T, H] view); gate/up
    without bias. ``training``: the forward also writes the pre-activations for the backward (its own table entry)."""
    if not (_AVAILABLE and x.is_cuda) or b_gate is not None or b_up is not None:
        return False
    h, i = x.shape[-1], w_gate.shape[0]
    if not _wanted("fwd_train" if training else "fwd", x.shape[:-1].numel(), i, h):
        return False
    # I: the [T, I] outputs' rows must be 16-byte multiples too
    return _known_true(i % 8 == 0) and _runnable((x, w_gate, w_up))


@torch.compiler.assume_constant_result
def bwd_enabled() -> bool:
    return os.environ.get(BWD_ENV, "") == "1"


def use_bwd(dy: torch.Tensor, w_down: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Backward's dh GEMM and dGeGLU through ``gated_gemm_bwd_``? dy [T, H], w_down [H, I], gate/up [T, I].
    Only with FUSED_MLP_GEMM_EPILOGUE_BWD=1 (see BWD_ENV above)."""
    if not (_AVAILABLE and dy.is_cuda):
        return False
    if not bwd_enabled():
        if mode() == "bwd" and not torch.compiler.is_compiling():
            warn_once("epilogue-bwd-off", f"{ENV}=bwd: the fused backward kernel runs only with {BWD_ENV}=1 "
                      "(see fused_mlp._epilogue); using the cuBLAS path")
        return False
    if any(t.dim() != 2 for t in (dy, w_down, gate, up)):
        return False
    return _wanted("bwd", dy.shape[0], w_down.shape[1], dy.shape[1]) and _runnable((dy, w_down, gate, up))
