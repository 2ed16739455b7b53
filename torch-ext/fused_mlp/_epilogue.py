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
the backward's. One [T, I] tensor more is saved per MLP (h); the backward's largest live set is unchanged (h, P, Q
against gate, up, h).

Which one runs is decided per call from the table below (``DISPATCH``). The cuBLAS path is the default everywhere
else: other GPUs, fp32, biased gate/up projections, sizes that are not multiples of 8, and the shapes where the
benchmark (``benchmarks/epilogue.py``, H200) did not show the fused kernel winning. ``FUSED_MLP_GEMM_EPILOGUE``
overrides the table: ``off`` never uses the fused kernels, ``on`` uses them wherever they can run (tests,
benchmarks), ``fwd`` / ``bwd`` only that pass's kernel, ``auto`` (default) follows the table. Either way the results
agree within the "2x the same-dtype PyTorch error" rule: both paths round each stored value once.
"""

from __future__ import annotations

import os

import torch

from ._ops import ops

from ._common import statically_true as _known_true  # sizes decide without adding a guard (symbolic: False)

ENV = "FUSED_MLP_GEMM_EPILOGUE"
MODES = ("auto", "on", "off", "fwd", "bwd")  # fwd / bwd: only that pass fused (benchmarks)

# Dispatch table: pass -> (minimum tokens T, minimum I, minimum H, maximum H): the shapes on which the fused kernel
# is used in `auto` mode. Passes: "fwd" (inference forward: h only), "train" (both training passes fused, the slopes
# form: use_slopes), and where "train" does not apply, "fwd_train" (training forward: h, gate, up) and "bwd" each on
# its own. A pass with no entry keeps the cuBLAS path. Every entry names the measurement it rests on
# (benchmarks/results/nvidia-h200/epilogue.csv; ratio = fused / cuBLAS path at the same shape, lower is better;
# tests/test_gated_gemm.py checks the table against that CSV).
#
# H200, bf16, gelu_tanh, 9 interleaved rounds, shapes H=2048 I=16384 T=512/1024/2048/4096 | H=3072 I=24576 T=512/4096
# | H=4096 I=14336 T=512/4096 (epilogue.csv, build _fused_mlp_cuda_c5b9027a54: the slopes form; "before": build
# 861b0181cb, the sigmoid as 1 / (1 + 2^-z); "earlier": a86c8b067c, the backward's shared-memory ring and the ftz MUFU
# forms, and older builds, and runs of benchmarks/epilogue.py's providers in other processes):
#   fwd        0.954 0.945 0.933 0.920 | 0.987 0.963 | 0.967 0.999 (before: 0.948 0.935 0.944 0.919 | 0.970 0.961 |
#              0.966 1.005; earlier: 0.973 0.926 0.926 0.905 | 0.968 0.960 | 0.931 1.019, 0.946 0.972 0.920 0.906 |
#              0.961 0.953 | 0.963 0.994, and H=4096 T=4096 1.02-1.04 in three runs, 1.010 in build b53cf7c0b1). The
#              fused forward saves one pass over [T, I], worth less against the GEMM the deeper H is: at H=4096, T=4096
#              it wins by little or not at all. Used from T >= 512 and I >= 14336 for 2048 <= H <= 3072; H=4096 keeps
#              the cuBLAS path (its T=512 win is given up: no measurement between T=512 and 4096). Below T=512 (decode)
#              and outside these sizes: not measured.
#   fwd_train  (fwd+bwd with only the forward fused; it also writes gate and up) 1.018 1.048 1.009 0.975 | 1.028 0.987 |
#              1.041 0.987 (before: 1.015 1.015 0.992 0.979 | 1.023 0.984 | 1.030 1.007; earlier: 1.160 1.022 0.987
#              0.978 | 1.019 0.987 | 1.029 0.999, 1.074 1.022 1.000 0.978 | 1.007 0.999 | 1.029 0.997; at H=2048 T=4096
#              also 0.974 0.978 0.980 in three runs). Kernel time per step (torch.profiler, T=4096, H=2048): the fused
#              forward 719 us against 712 + 96 us for the two GEMMs and the activation kernel; alone (do_bench) 843 us
#              against 849 us for one cuBLAS GEMM on the concatenated weights. Used for H = 2048, T >= 4096, I >= 14336;
#              T=2048 and H >= 3072 measured either way, T <= 1024 slower -> cuBLAS path.
#   bwd        (fwd+bwd with only the backward fused) 1.052 1.058 0.990 0.980 | 1.032 0.994 | 1.037 0.979 (before: 0.929
#              1.079 0.993 0.980 | 1.026 0.995 | 1.041 1.005; earlier: 1.312 1.050 0.988 0.974 | 1.019 0.998 | 1.062
#              0.996, 1.206 1.061 1.007 0.982 | 1.025 0.990 | 1.063 0.997). Its kernel alone, T=4096 H=2048: 440-460 us
#              against 390-410 us for the cuBLAS GEMM (before 464-484 against 420-449; earlier 520-541 against 392-417)
#              plus ~207 us for the elementwise pass it replaces; with no epilogue at all the same kernel took 378-389
#              us. At K = H = 64 (the epilogue alone, the two warpgroups' epilogues serialised) 264-272 us, 311 before
#              the ftz forms: the epilogue is issue- and latency-bound (ncu source counters: 37 instructions per element
#              before, 31 with the ftz forms; the denormal test around each non-ftz ex2 shared one predicate register
#              across the eight elements of a group). The sigmoid as 1 / (1 + 2^-z) with ds = s - s^2 (gated_act.cuh)
#              takes about two more per element off: A/B against the previous build, three rounds in one call, kernel
#              alone 440-460 us vs 456-466 (K=64: 259-274 vs 285-324); forward kernels unchanged (806-828 us both). Used
#              for T >= 4096, I >= 14336, 2048 <= H <= 3072; H=4096 (0.979 now; 1.005, 0.996, 0.997 before) and T <=
#              2048 (T=2048: 0.990, 0.993, 0.988, 1.007; T <= 1024 either way) keep the cuBLAS path. Tried too (H200,
#              T=4096 H=2048 I=16384): the epilogue loading gate/up straight into registers, a few groups ahead, after
#              an L2 prefetch (kernel 537 us); all of the tile's gate/up at once into 64 KB of shared memory, 5 stages
#              (520-541 us; 498-510 with the ftz forms; now: a ring of 8 groups in 32 KB, 6 stages, see
#              gated_gemm_sm90.cu); 4-byte accesses in the accumulator layout (fwd+bwd 1.03-1.06; now: 16-byte accesses
#              after a transpose within each quad of lanes); ldmatrix/stmatrix through a row-major staged tile (584 us);
#              the producer warp prefetching each tile's gate/up into L2 ahead of its epilogue (kernel 610-774 us); L2
#              evict-first hints on the epilogue's loads and stores, and tile swizzles 2 and 4 (no gain beyond noise);
#              the stock TMA epilogue with a visitor tree, loading and storing through shared memory that the mainloop's
#              stages give up (1.13-1.29, branch `bwd-evt`). The backward's other GEMMs (dW_down, dx, dW_gate, dW_up:
#              cuBLAS) through CUTLASS's stock sm_90 ping-pong / cooperative kernels in the layouts they come in, no
#              transposed copy: 1.00-1.09x cuBLAS's time per GEMM at T=4096 (H=2048: ping-pong 0.998 / 1.042 / 1.014 for
#              dW_down / dx / dW_gate; H=3072 and 4096: 1.02-1.09; cooperative 1.04-1.10), at T=512-1024 0.94-0.97x for
#              the weight gradients but 1.07-1.52x for dx; fwd+bwd 3.81 ms vs 3.70 (cuBLAS); and dW_gate, dW_up as one
#              GEMM on a [T, 2I] dgate|dup buffer: 793 us vs 2 x 388 (no gain): cuBLAS stays for all of them.
#   train      (fwd+bwd with both passes fused: the slopes form, the forward saving h, P = up act'(gate), Q = act(gate)
#              and the backward's epilogue dgate = dh P, dup = dh Q) 0.984 0.999 0.972 0.948 | 1.013 0.984 | 1.027 0.989
#              (build b53cf7c0b1: 0.900 1.001 0.973 0.951 | 1.014 0.977 | 1.020 1.004); both passes fused in the gate/up
#              form before (the three earlier CSVs): T=2048 0.986 0.985 1.016, T=4096 0.960 0.955 0.961 | H=3072 T=4096
#              0.978 0.975 0.983 | H=4096 T=4096 1.008 1.004 1.016, so at H=3072 both passes fused beat the backward
#              alone (0.995 0.998 0.990) in every run. T=4096 H=2048 I=16384, one call (build c7830f9e71), 5 interleaved
#              rounds, min-median: backward kernel alone 437-451 us against 478-483 us in the gate/up form; a
#              hand-written step of each form with the same cuBLAS GEMMs: median 3722 us against 3804 us; fwd+bwd in the
#              full runs 3.742 and 3.750 ms = 0.948 and 0.951x the cuBLAS path, 1.063 and 1.059x torch.compile;
#              benchmarks/epilogue.py --quick (7 rounds) in four runs: 3.741 3.754 3.746 3.709 ms = 0.934 0.937 0.962
#              0.950x the cuBLAS path, 1.083 1.067 1.048 1.054x torch.compile (the gate/up form: 0.953-0.971x and
#              1.027-1.063x). Peak 1.04 GB against 0.906 (h is kept). Used for T >= 4096, I >= 14336, 2048 <= H <= 3072;
#              T=2048 (0.972 and 0.973 now, 1.016 once before) and H=4096 keep the passes as above.
DISPATCH: dict[str, tuple[int, int, int, int]] = {
    "fwd": (512, 14336, 2048, 3072),
    "fwd_train": (4096, 14336, 2048, 2048),
    "bwd": (4096, 14336, 2048, 3072),
    "train": (4096, 14336, 2048, 3072),
}


def in_table(pass_: str, t, i, h) -> bool:
    """Does DISPATCH select the fused kernel for this pass at [T, H] x [H, I]? (sizes may be symbolic)"""
    rule = DISPATCH.get(pass_)
    return (rule is not None and _known_true(t >= rule[0]) and _known_true(i >= rule[1])
            and _known_true(h >= rule[2]) and _known_true(h <= rule[3]))


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
