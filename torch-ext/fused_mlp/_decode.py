"""When the gated MLP's inference forward runs as one decode-class op (kernels_src/cuda/gated_gemv.cu).

``gated_mlp_decode(x, w_gate, w_up, w_down, activation)`` computes ``y = down(act(x W_g^T) * (x W_u^T))`` for
``x [T, H]`` with ``T <= 64`` in two GEMV-class kernels on tensor cores (gate/up with the activation in the epilogue,
then down): one host call per MLP, the weights streamed once at close to HBM bandwidth, where the cuBLAS path pays
three GEMMs sized for larger T and an activation kernel. fp32 accumulators, ``act(gate) * up`` in fp32, h and y each
rounded once.

``use_decode`` is asked on every inference call of ``gated_mlp`` (decode: every layer, every token), so the cheap
tests come first and nothing here adds a guard under torch.compile: sizes are decided only where they are known
(concrete ints, or ``statically_known_true``). A symbolic token count (Dynamo's automatic dynamic shapes make the
batch dimension dynamic once a second batch size is seen) takes ``gated_mlp_auto``, which compares T with the
table's limit at run time and runs either the decode kernels or the GEMM path (``runtime_limit``).
``FUSED_MLP_DECODE_MLP`` overrides the table: ``off`` never, ``on`` wherever the op can run (tests, benchmarks),
``auto`` (default) where the measured table below says it is faster. Bias-free ``linear`` has the same pair:
``linear_decode`` / ``linear_auto`` (``FUSED_MLP_LINEAR_DECODE``).
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ._common import CAPABILITY, compile_mode, device_capability, env_mode, misaligned16
from ._ops import add_op_namespace_prefix, ops

ENV = "FUSED_MLP_DECODE_MLP"
MODES = ("auto", "on", "off")

KERNEL_MAX_TOKENS = 64  # the op's limit (kMaxTokens in gated_gemv.cu)
# auto: per compute capability, (largest hidden size H, largest T) pairs in order of H: the op runs while T <= the
# first entry's T whose H bound covers x's hidden size (measured crossover against the cuBLAS path and Inductor).
# Capabilities without an entry keep the cuBLAS path unless forced on.
# H200: T <= 16 at every measured H, from a stack of layers (weights from HBM) -- docs/tuning-log.md#decode-stack,
# #decode-t16-registers
MAX_TOKENS: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {(9, 0): ((1 << 30, 16),)}
# Majors with SASS in the build (build.toml: 8.0, 9.0, 10.0, 12.0; binary-compatible within a major).
_MAJORS = (8, 9, 10, 12)

_AVAILABLE = hasattr(ops, "gated_mlp_decode")  # every build registers the schema; only CUDA builds implement it
_AUTO_AVAILABLE = hasattr(ops, "gated_mlp_auto")
_CAPABILITY = CAPABILITY  # (the shared per-device cache; tests patch it here)


@torch.library.register_fake(add_op_namespace_prefix("gated_mlp_decode"))
def _gated_mlp_decode_fake(x, w_gate, w_up, w_down, activation):
    return x.new_empty((x.shape[0], w_down.shape[0]))


@torch.library.register_fake(add_op_namespace_prefix("gated_mlp_auto"))
def _gated_mlp_auto_fake(x, w_gate, w_up, w_down, activation, max_tokens):
    return x.new_empty((x.shape[0], w_down.shape[0]))


def _forced_limit(cap: tuple[int, int]) -> int:
    """Forced on: the kernels' own limit wherever the build has code for the capability."""
    return KERNEL_MAX_TOKENS if cap[0] in _MAJORS and cap >= (8, 0) else 0


def _aligned(*ts: torch.Tensor) -> bool:
    """Every data pointer on a 16-byte boundary (``misaligned16``). Not traceable under torch.compile: there the
    decode ops' own check reports a misaligned view (the *_auto ops take the GEMM path instead)."""
    if torch.compiler.is_compiling():
        return True
    for t in ts:  # (a loop, not all(<generator>): decode asks this per layer per token)
        if misaligned16(t):
            return False
    return True


# The environment and device queries are constants to torch.compile (evaluated when the graph is traced).
@torch.compiler.assume_constant_result
def mode() -> str:
    return env_mode(ENV, MODES)


def auto_limit(cap: tuple[int, int], h: int) -> int:
    """The table's largest T for hidden size ``h`` on a device of capability ``cap`` (0: never in auto)."""
    for max_h, max_t in MAX_TOKENS.get(cap, ()):
        if h <= max_h:
            return max_t
    return 0


@torch.compiler.assume_constant_result
def _token_limit(idx: int, forced: bool, h: int) -> int:
    """The largest T the op takes on device ``idx`` for hidden size ``h``: the table's entry (auto), the kernel's limit
    (forced on) where the capability is supported, else 0."""
    cap = device_capability(idx)
    return _forced_limit(cap) if forced else auto_limit(cap, h)


def _limit(x: torch.Tensor, b_gate: torch.Tensor | None, b_up: torch.Tensor | None,
           b_down: torch.Tensor | None) -> int:
    """The cheap half of the decision: the largest T the decode op takes for x on its device (0: none)."""
    if not (_AVAILABLE and x.is_cuda) or b_gate is not None or b_up is not None or b_down is not None:
        return 0
    if x.dtype != torch.bfloat16 and x.dtype != torch.float16:
        return 0
    m = mode()
    if m == "off":
        return 0
    h = x.shape[-1]
    if not isinstance(h, int):  # a symbolic hidden size: the other path
        return 0
    return _token_limit(x.device.index if x.device.index is not None else torch.cuda.current_device(), m == "on", h)


def _operands_fit(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """The per-tensor half: one dtype, 2-D contiguous weights, a contiguous x, 16-byte rows (alignment aside)."""
    for w in (w_gate, w_up, w_down):
        if w.dtype != x.dtype or w.dim() != 2 or not w.is_contiguous():
            return False
    if not x.is_contiguous():
        return False
    return statically_known_true(x.shape[-1] % 8 == 0) and statically_known_true(w_gate.shape[0] % 8 == 0)


def _tokens(x: torch.Tensor):
    t = 1
    for d in x.shape[:-1]:  # (torch.Size.numel() would specialise a symbolic size outside dynamo)
        t = t * d
    return t


def use_decode(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
               b_gate: torch.Tensor | None, b_up: torch.Tensor | None, b_down: torch.Tensor | None) -> bool:
    """Run ``gated_mlp``'s inference forward through ``gated_mlp_decode``? x: ``[..., H]`` (any rank; the op takes
    its contiguous [T, H] view), weights as ``gated_mlp`` takes them, no biases."""
    limit = _limit(x, b_gate, b_up, b_down)
    if not limit or not statically_known_true(_tokens(x) <= limit):  # a symbolic T: False, and no guard added
        return False
    return _operands_fit(x, w_gate, w_up, w_down) and _aligned(x, w_gate, w_up, w_down)


def runtime_limit(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                  b_gate: torch.Tensor | None, b_up: torch.Tensor | None, b_down: torch.Tensor | None) -> int:
    """Under torch.compile, a token count that is neither known to fit the decode op nor known not to (a symbolic T:
    e.g. the batch dimension Dynamo made dynamic): the limit to pass to ``gated_mlp_auto``, which compares T at run
    time, without a guard or a recompile; else 0 (``use_decode`` or the GEMM path decide when the graph is traced).
    FUSED_MLP_UNDER_COMPILE=decompose: 0 (the caller traces F.linear and the activation's decomposition)."""
    limit = _limit(x, b_gate, b_up, b_down)
    if not limit or not _AUTO_AVAILABLE or compile_mode() == "decompose":
        return 0
    t = _tokens(x)
    if statically_known_true(t <= limit) or statically_known_true(t > limit):
        return 0
    return limit if _operands_fit(x, w_gate, w_up, w_down) else 0


# ---- Linear (no bias) at decode sizes: ``linear_decode(x, w)`` = x [T, K] @ w[N, K]^T, the down pass alone ----------

LINEAR_ENV = "FUSED_MLP_LINEAR_DECODE"
# auto: the largest T per compute capability where a decoder layer's q/k/v/o projections beat the cuBLAS path, and an
# N cap below an lm_head's (which loses); no entry: never in auto -- docs/tuning-log.md#decode-t16-registers
LINEAR_MAX_TOKENS: dict[tuple[int, int], int] = {(9, 0): 16}
LINEAR_AUTO_MAX_N = 16384

_LINEAR_AVAILABLE = hasattr(ops, "linear_decode")
_LINEAR_AUTO_AVAILABLE = hasattr(ops, "linear_auto")


@torch.library.register_fake(add_op_namespace_prefix("linear_decode"))
def _linear_decode_fake(x, w):
    return x.new_empty((x.shape[0], w.shape[0]))


@torch.library.register_fake(add_op_namespace_prefix("linear_auto"))
def _linear_auto_fake(x, w, max_tokens):
    return x.new_empty((x.shape[0], w.shape[0]))


@torch.compiler.assume_constant_result
def linear_mode() -> str:
    return env_mode(LINEAR_ENV, MODES)


@torch.compiler.assume_constant_result
def _linear_token_limit(idx: int, forced: bool) -> int:
    cap = device_capability(idx)
    return _forced_limit(cap) if forced else LINEAR_MAX_TOKENS.get(cap, 0)


def _linear_limit(x2: torch.Tensor, w_kn: torch.Tensor) -> int:
    """The cheap half: the largest T ``linear_decode`` takes for x2 on its device, for w_kn's N (capped in auto; 0:
    none). ``w_kn`` is 2-D here (both callers have checked)."""
    if not (_LINEAR_AVAILABLE and x2.is_cuda) or (x2.dtype != torch.bfloat16 and x2.dtype != torch.float16):
        return 0
    m = linear_mode()
    if m == "off" or (m == "auto" and not statically_known_true(w_kn.shape[1] <= LINEAR_AUTO_MAX_N)):
        return 0
    return _linear_token_limit(x2.device.index if x2.device.index is not None else torch.cuda.current_device(),
                               m == "on")


def _linear_operands_fit(x2: torch.Tensor, w_kn: torch.Tensor) -> bool:
    """The per-tensor half: one dtype, x2 contiguous, w_kn the transpose of a contiguous [N, K] weight, 16-byte rows
    (alignment aside)."""
    if w_kn.dtype != x2.dtype or not x2.is_contiguous() or not w_kn.t().is_contiguous():
        return False
    return statically_known_true(x2.shape[1] % 8 == 0)


def use_linear_decode(x2: torch.Tensor, w_kn: torch.Tensor) -> bool:
    """Run a bias-free, activation-free inference ``linear`` through ``linear_decode``? ``x2``: the ``[M, K]`` rows,
    ``w_kn``: ``[K, N]`` as ``_addmm_impl`` gets it (``weight.t()`` of a contiguous ``[N, K]`` weight qualifies; a
    row-major ``[K, N]`` mat2, e.g. GPT-2's Conv1D weight, does not). Same rules as ``use_decode``: no guard under
    torch.compile, a symbolic token count does not take it here (``linear_runtime_limit``)."""
    limit = _linear_limit(x2, w_kn)
    if not limit or not statically_known_true(x2.shape[0] <= limit):
        return False
    return _linear_operands_fit(x2, w_kn) and _aligned(x2, w_kn)


def linear_runtime_limit(x2: torch.Tensor, w_kn: torch.Tensor) -> int:
    """As ``runtime_limit`` for ``linear_auto``: under torch.compile, a token count neither known to fit nor known not
    to gets the limit that ``linear_auto`` compares at run time; else 0."""
    limit = _linear_limit(x2, w_kn)
    if not limit or not _LINEAR_AUTO_AVAILABLE:
        return 0
    t = x2.shape[0]
    if statically_known_true(t <= limit) or statically_known_true(t > limit):
        return 0
    return limit if _linear_operands_fit(x2, w_kn) else 0
