"""When the GeGLU MLP runs its GEMMs with the gated activation in the epilogue (kernels_src/cuda/gated_gemm_sm90.cu).

Two CUTLASS 3 kernels for sm_90 (Hopper), each replacing a cuBLAS GEMM plus one elementwise pass over [T, I]:

- forward ``gated_gemm_fwd``: ``h = act(x W_g^T) * (x W_u^T)`` from one dual-B GEMM (and, in training, the
  pre-activations gate/up it saves), instead of two cuBLAS GEMMs and the activation kernel;
- backward ``gated_gemm_bwd_``: ``dh = dy W_d`` in fp32 and dGeGLU on it in the epilogue (h, dgate, dup), instead
  of a cuBLAS GEMM and the in-place activation-backward kernel.

Where both passes are fused in training (``use_slopes``: the table's ``train`` entry), the forward
(``gated_gemm_fwd_slopes``) saves h, ``P = up act'(gate)`` and ``Q = act(gate)`` instead of gate and up, and the
backward (``gated_gemm_bwd_slopes_``) computes ``dgate = dh P``, ``dup = dh Q`` in its epilogue and writes no h: the
activation's derivative is computed in the forward's epilogue, which runs behind a mainloop twice as long, instead of
the backward's. One [T, I] tensor more is saved per MLP (h); eagerly the backward frees h once dW_down is computed
(gated_mlp.py), before the weight gradients that make its peak.

Which one runs is decided per call from the table below (``DISPATCH``). The cuBLAS path is the default everywhere
else: other GPUs, fp32, biased gate/up projections, sizes that are not multiples of 8, and the shapes where the
benchmark (``benchmarks/epilogue.py``, H200) did not show the fused kernel winning. ``FUSED_MLP_GEMM_EPILOGUE``
overrides the table: ``off`` never uses the fused kernels, ``on`` uses them wherever they can run (tests,
benchmarks), ``fwd`` / ``bwd`` only that pass's kernel, ``auto`` (default) follows the table. Either way the results
agree within the "2x the same-dtype PyTorch error" rule: both paths round each stored value once.
"""

from __future__ import annotations

import torch

from ._common import CAPABILITY, device_capability, env_mode, misaligned16
from ._common import statically_true as _known_true  # sizes decide without adding a guard (symbolic: False)
from ._ops import ops

ENV = "FUSED_MLP_GEMM_EPILOGUE"
MODES = ("auto", "on", "off", "fwd", "bwd")  # fwd / bwd: only that pass fused (benchmarks)

# Dispatch table: pass -> rules (minimum tokens T, minimum I, maximum I, minimum H, maximum H); a shape takes the
# fused kernel in `auto` mode when any rule of its pass covers it. Passes: "fwd" (inference forward: h only), "train"
# (both training passes fused, the slopes form: use_slopes), and where "train" does not apply, "fwd_train" (training
# forward: h, gate, up) and "bwd" each on its own. A pass with no entry keeps the cuBLAS path; so do T < 512 and the
# sizes not benchmarked. The measurement: benchmarks/results/nvidia-h200/epilogue.csv (GeGLU) and epilogue_llama.csv
# (the Llama family, SwiGLU; tests/ops/test_gated_gemm.py checks the table against both); ratio = fused / cuBLAS-path
# time on the H200. Every run, build and rejected variant: docs/tuning-log.md#gated-gemm-dispatch.
_ANY_I = 1 << 30
DISPATCH: dict[str, tuple[tuple[int, int, int, int, int], ...]] = {
    # 0.69-0.98 at 2048 <= H <= 3072, I >= 8192, T >= 512; H=4096 either way -- docs/tuning-log.md#gated-gemm-fwd
    "fwd": ((512, 8192, _ANY_I, 2048, 3072),),
    # fwd+bwd 0.975 at H=2048 T=4096; T=2048, H >= 3072 either way -- docs/tuning-log.md#gated-gemm-fwd-train
    "fwd_train": ((4096, 14336, _ANY_I, 2048, 2048),),
    # fwd+bwd 0.980 / 0.994 at H=2048 / 3072, T=4096; T <= 2048, H=4096 either way -- docs/tuning-log.md#gated-gemm-bwd
    "bwd": ((4096, 14336, _ANY_I, 2048, 3072),),
    # fwd+bwd 0.948 / 0.984 at H=2048 / 3072, T=4096 (I >= 14336); 0.64-0.99 at I=8192 from T=512
    # -- docs/tuning-log.md#gated-gemm-train
    "train": ((4096, 14336, _ANY_I, 2048, 3072), (512, 8192, 8192, 2048, 3072)),
}


def in_table(pass_: str, t, i, h) -> bool:
    """Does DISPATCH select the fused kernel for this pass at [T, H] x [H, I]? (sizes may be symbolic)"""
    return any(_known_true(t >= r[0]) and _known_true(i >= r[1]) and _known_true(i <= r[2])
               and _known_true(h >= r[3]) and _known_true(h <= r[4]) for r in DISPATCH.get(pass_, ()))


_CAPABILITY = CAPABILITY  # (the shared per-device cache; tests patch it here)


# The two environment queries are constants to torch.compile (evaluated when the graph is traced, as a module
# attribute would be), so the dispatch works inside torch.compile(fullgraph=True).
@torch.compiler.assume_constant_result
def mode() -> str:
    return env_mode(ENV, MODES)


_AVAILABLE = hasattr(ops, "gated_gemm_fwd")  # every build registers the schema; only CUDA builds implement it


def available() -> bool:
    return _AVAILABLE


@torch.compiler.assume_constant_result
def _is_sm90(idx: int) -> bool:
    return device_capability(idx) == (9, 0)


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
        # Under torch.compile neither data_ptr() nor (inside an autograd.Function) storage_offset() can be traced:
        # there the op's own check reports a misaligned view.
        if not torch.compiler.is_compiling() and misaligned16(t):
            return False
    return _is_sm90(x.device.index if x.device.index is not None else torch.cuda.current_device())


def _wanted(pass_: str, t, i, h) -> bool:
    m = mode()
    if m != "auto":
        return m in ("on", pass_.split("_")[0])
    return in_table(pass_, t, i, h)


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


def use_slopes(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
               b_gate: torch.Tensor | None, b_up: torch.Tensor | None) -> bool:
    """Both training passes fused: the forward through ``gated_gemm_fwd_slopes`` (it saves h, P = up act'(gate),
    Q = act(gate)) and so the backward through ``gated_gemm_bwd_slopes_``? Where the table's ``train`` entry (or mode
    ``on``) wants it and the kernels can run: the backward's dy [T, H_out] is not known yet, but w_down [H_out, I]
    and the forward's sizes are (gated_mlp's backward makes dy contiguous)."""
    if not (_AVAILABLE and x.is_cuda) or b_gate is not None or b_up is not None:
        return False
    h, i, h_out = x.shape[-1], w_gate.shape[0], w_down.shape[0]
    if not _wanted("train", x.shape[:-1].numel(), i, h):
        return False
    return (_known_true(i % 8 == 0) and _known_true(h_out % 8 == 0) and _known_true(w_down.shape[1] == i)
            and _runnable((x, w_gate, w_up, w_down)))


def use_bwd(dy: torch.Tensor, w_down: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Backward's dh GEMM and dGeGLU through ``gated_gemm_bwd_``? dy [T, H], w_down [H, I], gate/up [T, I]."""
    if not (_AVAILABLE and dy.is_cuda):
        return False
    if any(t.dim() != 2 for t in (dy, w_down, gate, up)):
        return False
    return _wanted("bwd", dy.shape[0], w_down.shape[1], dy.shape[1]) and _runnable((dy, w_down, gate, up))
