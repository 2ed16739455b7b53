"""addmm / linear with the bias and the GeLU applied to the fp32 GEMM accumulator: ``y = act(bias + mat1 @ mat2)``.

Shapes: ``mat1`` ``[..., K]`` (any leading dims; torch.addmm's 2-D ``[M, K]`` is the common case), ``mat2``
``[K, N]`` in either memory orientation (a Conv1D ``[in, out]`` weight, or ``nn.Linear``'s ``[out, in]`` weight
seen through ``.t()`` — both used in place, no copy), ``bias`` ``[N]`` (or anything that broadcasts to it:
``[]``, ``[1]``, ``[1, N]``). ``linear(input, weight, bias)`` is ``addmm(bias, input, weight.t())``.

Numerics contract: the product accumulates in fp32, the bias is added to the fp32 accumulator, the activation is
evaluated in fp32, and the result is rounded once to the input dtype — never an mm rounded to bf16 and then an
add. ``activation``: ``None``; ``"gelu_tanh"`` (tanh approximation; on CUDA this is cuBLASLt's GELU epilogue,
which is the tanh form); ``"gelu"`` (exact erf GeLU: cuBLASLt has no such epilogue, so the GEMM writes the fp32
accumulator and one kernel applies bias + erf-GeLU and rounds once). An fp32 bias with bf16/fp16 inputs is added
in fp32 too (cuBLASLt's epilogue wants the bias in the output dtype, which would round it first).

Backward: ``dZ = dY * act'(Z)`` in fp32 with ``Z`` the saved pre-activation (input dtype), the bias gradient
summed in fp32 in a fixed order (deterministic; a broadcast bias's gradient reduced to the bias's own shape in fp32
too, so every bias gradient is rounded once), then two plain GEMMs for ``dX`` and ``dW``; ``dW`` has the
weight's own memory layout. An fp32 gradient arriving at a bf16/fp16 output reaches the kernel uncast
(``ctx.set_output_grad_dtype`` on torch >= 2.14), except on the CPU route of 16-bit training without an activation,
which is ATen's own ops (``_cpu_aten_training``: rounded to the output dtype first, as in eager). Under ``torch.autocast`` the inputs are cast like
``F.linear``/``torch.addmm`` are. Design notes and the exact cuBLASLt mapping: ``kernels_src/cuda/addmm.cu``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ._common import (
    EPILOGUE_ACTIVATIONS,
    FLOAT_DTYPES,
    autocast_dtype,
    check_device,
    check_tensor,
    declare_grad_dtypes,
    functorch_active,
    plain_when_traced,
    reference_backward,
    say_functorch_fallback,
    statically_true,
    warn_once,
)
from ._decode import linear_runtime_limit as _linear_runtime_limit
from ._decode import use_linear_decode as _use_linear_decode
from ._ops import add_op_namespace_prefix, ops

__all__ = ["addmm", "linear", "addmm_reference", "linear_reference"]

# The public `activation` (None for no activation) -> the op's name for it.
_OP_ACTIVATION = {None: "none", **{a: a for a in EPILOGUE_ACTIVATIONS if a != "none"}}


# ---- custom ops: fake implementations for torch.compile --------------------------------------------------


# The OpOverloads (calling them skips the packet's overload resolution, ~1 us per call); eager inference calls the
# C++ entry (`_op`) directly, as rms_norm's fast path does (docs/tuning-log.md#host-path).
_fwd = ops.addmm_fwd.default
_bwd = ops.addmm_bwd.default
_fwd_call = getattr(_fwd, "_op", _fwd)
# Bias-free inference at decode sizes (T and N within _decode.py's measured table): the GEMV op linear_decode.
_linear_decode = ops.linear_decode.default if hasattr(ops, "linear_decode") else None
_linear_decode_call = getattr(_linear_decode, "_op", _linear_decode)  # eager: the C++ entry, as _fwd_call
_linear_auto = ops.linear_auto.default if hasattr(ops, "linear_auto") else None
_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter
_F32 = torch.float32
_grad_enabled = torch.is_grad_enabled
_is_compiling = torch.compiler.is_compiling
_any_autocast = torch._C._is_any_autocast_enabled
# What the op raises on arguments the full path may still accept (bias forms, 1-D x) or rejects with its own error.
_FALLBACK_ERRORS = (RuntimeError, TypeError, NotImplementedError)


@torch.library.register_fake(add_op_namespace_prefix("addmm_fwd"))
def _addmm_fwd_fake(bias, mat1, mat2, activation, save_preact, out_shape):
    # The C++ op's shape and dtype checks: the eager fast path sends meta tensors here, and a call that raises on
    # real tensors must raise on meta ones (RuntimeError, as the op's: the full path then raises the documented one).
    torch._check(mat1.dim() == 2 and mat2.dim() == 2 and mat1.shape[1] == mat2.shape[0] and mat1.dtype == mat2.dtype,
                 lambda: "addmm_fwd: mat1 [M, K] and mat2 [K, N] of one dtype expected")
    torch._check(bias is None or (bias.dim() == 1 and bias.shape[0] == mat2.shape[1]
                                  and bias.dtype in (mat1.dtype, torch.float32)),
                 lambda: "addmm_fwd: bias [N] of mat1's dtype or float32 expected")
    m = mat1.shape[0]
    n = mat2.shape[1]
    y = mat1.new_empty(out_shape)
    z = mat1.new_empty((m, n)) if (save_preact and activation != "none") else mat1.new_empty((0,))
    return y, z


@torch.library.register_fake(add_op_namespace_prefix("addmm_bwd"))
def _addmm_bwd_fake(dy, preact, mat1, mat2, activation, need_dx, need_dw, dw_transposed, need_db, db_dtype):
    m, k = mat1.shape
    n = mat2.shape[1]
    dx = mat1.new_empty((m, k)) if need_dx else mat1.new_empty((0,))
    if need_dw:
        dw = mat1.new_empty((n, k) if dw_transposed else (k, n))
    else:
        dw = mat1.new_empty((0,))
    db = mat1.new_empty((n,), dtype=db_dtype) if need_db else mat1.new_empty((0,), dtype=db_dtype)
    return dx, dw, db


# ---- autograd ---------------------------------------------------------------------------------------------


def _bias_as_row(bias: torch.Tensor, n: int) -> torch.Tensor:
    """A bias of one element ([], [1]) or [1, N], as the [N] row with unit stride the kernels read."""
    row = bias.reshape(-1).expand(n)
    return row.contiguous() if n > 1 and row.stride(0) != 1 else row


class _AddmmFunction(torch.autograd.Function):
    """``mat1`` is already 2-D ``[M, K]`` (reshaped before ``apply`` so ranks stay stable under torch.compile);
    ``mat2`` is ``[K, N]`` in a layout the kernels use in place (see ``_mat2_layout``).

    The op allocates the output directly in the caller's shape ``out_shape`` (``[..., N]``). Neither a view taken
    after ``apply`` (a ViewBackward node in between: the engine would cast an fp32 gradient to the output dtype
    there, defeating ``set_output_grad_dtype``) nor a view returned from ``forward`` (in-place ops on the output,
    which nn.Linear allows, would then be refused) would do."""

    @staticmethod
    def forward(ctx, bias, mat1, mat2, activation, save_preact, dw_transposed, out_shape):
        # Classic forward(ctx, ...) form: with a separate setup_context, apply() binds the signature with inspect on
        # every call (tens of microseconds: decode-sized GEMMs would pay that on every token).
        # A broadcast bias ([], [1], [1, N]) arrives as given and is expanded here, so that backward reduces its
        # gradient to that shape in fp32 and rounds once (autograd's expand backward would sum the rounded [N]
        # gradient again: two roundings).
        ctx.bias_shape = None
        # The bias as given (backward reads its dtype; a backward under create_graph=True reads the tensor): an
        # attribute, not a saved tensor, to keep the training call's host cost (docs/tuning-log.md#host-path).
        ctx.bias = bias
        if bias is not None and (bias.dim() != 1 or bias.shape[0] != mat2.shape[1]):
            ctx.bias_shape = bias.shape
            bias = _bias_as_row(bias, mat2.shape[1])
        y, z = _fwd(bias, mat1, mat2, activation, save_preact, out_shape)
        ctx.save_for_backward(mat1, mat2, z if activation != "none" else None)
        ctx.mark_non_differentiable(z)
        # No zero-filled gradient for z (with an activation an [M, N] memset per backward) or for an unused y.
        ctx.set_materialize_grads(False)
        ctx.activation = activation
        ctx.dw_transposed = dw_transposed
        # An fp32 gradient arriving at a bf16/fp16 output reaches the kernel uncast (it reads either dtype).
        declare_grad_dtypes(ctx, None, None, out_dtype=y.dtype)  # z is non-differentiable: y's dtype decides
        return y, z

    @staticmethod
    def backward(ctx, dy, _dz):
        if dy is None:  # y took no part in the loss (set_materialize_grads(False): no zeros were made for it)
            return None, None, None, None, None, None, None
        mat1, mat2, z = ctx.saved_tensors
        if _grad_enabled():  # create_graph=True: a backward that can be differentiated again
            act = None if ctx.activation == "none" else ctx.activation
            db, dx, dw = reference_backward(
                "addmm", lambda b, m1, m2: addmm_reference(b, m1, m2, activation=act, out_dtype=dy.dtype),
                (ctx.bias, mat1, mat2), ctx.needs_input_grad[:3], (dy,))
            return db, dx, dw, None, None, None, None
        bias = ctx.bias  # the bias as given: db takes its shape and dtype
        need_db = bias is not None and ctx.needs_input_grad[0]
        need_dx, need_dw = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        dy = dy.reshape(mat1.shape[0], mat2.shape[1])  # [..., N] -> [M, N]; the kernels take any row stride
        if dy.dtype != mat1.dtype and dy.dtype != torch.float32:
            dy = dy.to(mat1.dtype)
        bias_shape = ctx.bias_shape
        db_dtype = (bias.dtype if bias_shape is None else torch.float32) if need_db else mat1.dtype
        dx, dw, db = _bwd(
            dy, z, mat1, mat2, ctx.activation, need_dx, need_dw, ctx.dw_transposed, need_db, db_dtype
        )
        if need_dw and ctx.dw_transposed:
            dw = dw.t()
        if need_db and bias_shape is not None:  # [N] in fp32 -> the bias's own shape, rounded once
            db = (db if db.numel() == bias_shape.numel() else db.sum()).reshape(bias_shape).to(bias.dtype)
        return (db if need_db else None), (dx if need_dx else None), (dw if need_dw else None), None, None, None, None


# ---- argument handling ------------------------------------------------------------------------------------


_CPU_GEMM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# 16-bit rows up to which ATen's GEMM beats the op's fp32 copy of the weight where oneDNN has no native kernel for
# the dtype (fp16 on an AVX-512 CPU without FP16: 0.78-0.86x the op's time at 32 rows, 1.26x at 64).
_CPU_16BIT_ATEN_MAX_ROWS = 32
_ONEDNN_NATIVE: dict[torch.dtype, bool] = {}


@torch.compiler.assume_constant_result  # a constant to torch.compile (evaluated when the graph is traced)
def _onednn_native(dt: torch.dtype) -> bool:
    """Does this CPU's oneDNN run dt's GEMM natively (then ATen's 16-bit GEMM beats the op's widened one at any
    size)? Feature-detected once per dtype; False where torch has no such probe."""
    v = _ONEDNN_NATIVE.get(dt)
    if v is None:
        name = "_is_mkldnn_bf16_supported" if dt is torch.bfloat16 else "_is_mkldnn_fp16_supported"
        try:
            v = bool(getattr(torch.ops.mkldnn, name)())
        except Exception:  # no such op in this torch build
            v = False
        _ONEDNN_NATIVE[dt] = v
    return v


def _cpu_aten_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, n: int) -> bool:
    """CPU inference without an activation (the caller checks those two), x, w and the bias (if any, [N]) of one
    dtype: ATen's CPU GEMM accumulates in fp32 and rounds each output once, the bias added before that rounding --
    the op's own math -- so ``F.linear`` computes it without the op's copies: in fp32 the op's second pass and extra
    [M, N] buffer (docs/tuning-log.md#addmm-cpu-fp32); in bf16 / fp16 the fp32 copy of the whole weight it makes on
    every call (0.07x eager at 1-16 rows), where ATen's 16-bit GEMM is the faster one: up to
    _CPU_16BIT_ATEN_MAX_ROWS rows, or at any size where oneDNN runs the dtype natively
    (docs/tuning-log.md#addmm-cpu-epilogue). test_cpu_inference_is_atens_gemm checks the one rounding on the machine
    that runs it."""
    dt = x.dtype
    if not (x.device.type == "cpu" and dt in _CPU_GEMM_DTYPES and w.dtype is dt
            and (bias is None or (bias.dtype is dt and bias.dim() == 1 and bias.shape[0] == n))):
        return False
    if dt is _F32:
        return True
    if x.dim() != 2 and not x.is_contiguous():  # F.linear runs such x as matmul + bias.add_: two roundings in 16 bits
        return False
    k = x.shape[-1]
    if _is_compiling():  # decided without a guard on the (possibly symbolic) token count
        return _onednn_native(dt) or statically_true(x.numel() <= _CPU_16BIT_ATEN_MAX_ROWS * k)
    return (x.numel() // k if k else 0) <= _CPU_16BIT_ATEN_MAX_ROWS or _onednn_native(dt)


def _cpu_aten_training(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, n: int) -> bool:
    """CPU training without an activation, x, w and the bias (if any, [N]) of one 16-bit dtype that oneDNN runs
    natively: ``F.linear`` and ATen's backward -- dX and dW from 16-bit GEMMs that accumulate in fp32 and round once,
    db a sum accumulated in fp32 and rounded once: the op's own math without the fp32 copies of x, w and dY it makes
    for every GEMM (0.18-0.33x eager: docs/tuning-log.md#addmm-cpu-epilogue). An fp32 gradient arriving at y is
    rounded to y's dtype first, as in eager. test_cpu_16bit_training_is_atens checks the roundings on the machine that
    runs it. fp32 keeps the op (its bias gradient sums in fp64); so does fp16 without native oneDNN (ATen's fp16
    GEMMs there: 17-156x the op's time)."""
    dt = x.dtype
    if dt is _F32 or x.device.type != "cpu":
        return False
    return _onednn_native(dt) and _cpu_aten_gemm(x, w, bias, n)


def _linear_pointwise_op() -> Any:
    """oneDNN's linear with an eltwise post-op (torch.ops.mkldnn._linear_pointwise, the kernel Inductor fuses CPU
    linear + activation into), or None in a torch built without it."""
    try:
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):
        return None


_LINEAR_POINTWISE = _linear_pointwise_op()
_ONEDNN_GELU = {"gelu_tanh": "tanh", "gelu": "none"}  # the op's activation -> the post-op's GeLU algorithm


def _cpu_onednn_gelu(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, n: int) -> bool:
    """CPU inference (and training: `_CpuOneDnnGeluFunction`) with a GeLU, x, w and the bias (if any, [N]) of one
    16-bit dtype that oneDNN runs natively: oneDNN's linear with a GeLU post-op computes bias + GeLU on its fp32
    accumulator and rounds once -- the op's own epilogue -- without the op's fp32 copy of the whole weight (0.08-0.40x
    eager: docs/tuning-log.md#addmm-cpu-epilogue).
    test_cpu_16bit_gelu_inference_is_onednn checks the rounding and the GeLU form on the machine that runs it.
    Non-empty contiguous x, weight ([N, K] or [K, N]) and bias only: torch 2.14's op returned wrong values for x rows
    with a row stride (test_strided_operands) and refuses K = 0; other cases keep the op."""
    dt = x.dtype
    return (dt is not _F32 and _LINEAR_POINTWISE is not None and x.device.type == "cpu" and _onednn_native(dt)
            and x.numel() != 0 and n != 0 and x.is_contiguous() and (w.is_contiguous() or w.t().is_contiguous())
            and (bias is None or bias.is_contiguous()) and _cpu_aten_gemm(x, w, bias, n))


class _CpuOneDnnGeluFunction(torch.autograd.Function):
    """16-bit CPU training with a GeLU where `_cpu_onednn_gelu` holds (x, w and the bias as it checks them). Forward:
    oneDNN's linear with the GeLU post-op, as in inference (one rounding). Backward: Z = bias + x @ w recomputed by
    ATen's 16-bit GEMM (one rounding: the pre-activation the op would have saved, not kept here), dZ = dY * act'(Z) in
    fp32, db its fp32 column sum rounded once, and dZ rounded to the input dtype for ATen's dX and dW GEMMs (fp32
    accumulation, one rounding each), as on the GPU. Four 16-bit GEMMs against eager's three, where the op widens x, w
    and dY to fp32 copies for each of its three (docs/tuning-log.md#addmm-cpu-epilogue).
    test_cpu_16bit_gelu_training_is_onednn checks the roundings on the machine that runs it."""

    @staticmethod
    def forward(ctx, x, w_kn, bias, activation):
        ctx.save_for_backward(x, w_kn, bias)
        ctx.algorithm = _ONEDNN_GELU[activation]
        ctx.set_materialize_grads(False)
        declare_grad_dtypes(ctx, None)  # an fp32 dY reaches the fp32 dZ uncast, as in the op's Function
        y = _LINEAR_POINTWISE(x, w_kn.t(), bias, "gelu", [], ctx.algorithm)
        # For x of rank > 2 the op returns a view of its 2-D result, which autograd would keep from in-place ops (as
        # nn.Linear allows them); detached, it is an output of its own (nothing else refers to the 2-D result).
        return y.detach() if y._is_view() else y

    @staticmethod
    def backward(ctx, dy):
        if dy is None:
            return None, None, None, None
        x, w_kn, bias = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        k, n = w_kn.shape
        x2 = x.view(-1, k)  # contiguous (checked before apply)
        z = F.linear(x2, w_kn.t(), bias)
        dz32 = torch.ops.aten.gelu_backward(dy.reshape(-1, n).float(), z.float(), approximate=ctx.algorithm)
        db = dz32.sum(0).to(bias.dtype) if need_db else None
        dz = dz32.to(x.dtype)
        dx = (dz @ w_kn.t()).view(x.shape) if need_dx else None
        dw = None
        if need_dw:  # in the weight's own layout: nn.Linear's [N, K] behind .t(), or Conv1D's [K, N]
            dw = x2.t() @ dz if w_kn.is_contiguous() else (dz.t() @ x2).t()
        return dx, dw, db, None


def cpu_gemm_inference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, n: int) -> bool:
    """For the layers (plain tensors): an eager CPU call without autograd or autocast, which they hand to
    ``F.linear`` directly (see `_cpu_aten_gemm`). The callers test ``x``'s device inline first."""
    return (not _is_compiling() and not _any_autocast() and _cpu_aten_gemm(x, w, bias, n)
            and not (_grad_enabled() and (x.requires_grad or w.requires_grad
                                          or (bias is not None and bias.requires_grad))))


def _op_activation(activation: str | None) -> str:
    """The op's spelling of the public `activation`, or ValueError."""
    op_name = _OP_ACTIVATION.get(activation) if activation is None or type(activation) is str else None
    if op_name is None:
        raise ValueError(f"activation must be None, 'gelu_tanh' or 'gelu', got {activation!r}")
    return op_name


def _mat2_layout(w: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``w`` ``[K, N]`` as the kernels read it: row-major (-> False) or column-major (-> True, e.g. an nn.Linear
    weight ``.t()``), or a contiguous copy when neither stride pattern fits. The C++ side makes the same choice;
    the flag only fixes the layout of dW (the parameter's own, so autograd never copies the gradient)."""
    k, n = w.shape
    s0, s1 = w.stride()
    if (n <= 1 or s1 == 1) and (k <= 1 or s0 >= max(n, 1)):
        return w, False
    if (k <= 1 or s0 == 1) and (n <= 1 or s1 >= max(k, 1)):
        return w, True
    return w.contiguous(), False


def _addmm_impl(
    bias: torch.Tensor | None,
    x: torch.Tensor,
    w_kn: torch.Tensor,
    activation: str | None,
    names: tuple[str, str, str],
    w_shape: tuple[int, ...],
) -> torch.Tensor:
    """Shared checks and dispatch. ``w_kn`` is the ``[K, N]`` operand (``weight.t()`` for linear).

    Every check runs before anything is launched; the common case (plain float tensors on one device) takes the
    cheap tests first and builds the error text only on failure: decode calls this per Linear per token."""
    # Eager inference fast path (decode calls this per Linear per token): plain tensors straight to the op, whose C++
    # checks (dims, dtypes, devices, sizes) run before anything is launched; whatever it rejects takes the full path
    # below, which converts it or raises the documented error. Same op, same arguments as the full path's inference
    # call (the op picks mat2's layout itself): docs/tuning-log.md#host-path.
    # Eager training fast path, the same way: the autograd Function straight away (its op checks before launching;
    # whatever it rejects takes the full path): docs/tuning-log.md#host-path-training.
    # Meta operands take the full path: its device check (ATen's F.linear and the op's fake implementation would
    # pair a meta weight with a CPU input and return uninitialised memory).
    if (type(x) is _Tensor and (type(w_kn) is _Tensor or type(w_kn) is _Parameter)
            and (bias is None or type(bias) is _Tensor or type(bias) is _Parameter)
            and not _is_compiling() and not _any_autocast()
            and not x.is_meta and not w_kn.is_meta and (bias is None or not bias.is_meta)):
        op_act = _OP_ACTIVATION.get(activation) if activation is None or type(activation) is str else None
        x_dim = x.dim()
        training = _grad_enabled() and (x.requires_grad or w_kn.requires_grad
                                        or (bias is not None and bias.requires_grad))
        # Training: [N] biases only (the Function flattens other bias shapes, which the full path vets first).
        if (op_act is not None and x_dim >= 2 and w_kn.dim() == 2
                and not (training and bias is not None and (bias.dim() != 1 or bias.shape[0] != w_kn.shape[1]))):
            try:
                x2 = x if x_dim == 2 else x.flatten(0, -2)
                out_shape = [x.shape[0], w_kn.shape[1]] if x_dim == 2 else [*x.shape[:-1], w_kn.shape[1]]
                if training:
                    if not x.is_cuda:
                        if op_act == "none":
                            if _cpu_aten_training(x, w_kn, bias, w_kn.shape[1]):
                                return F.linear(x, w_kn.t(), bias)
                        elif _cpu_onednn_gelu(x, w_kn, bias, w_kn.shape[1]):
                            return _CpuOneDnnGeluFunction.apply(x, w_kn, bias, op_act)
                    w2, dw_transposed = _mat2_layout(w_kn)
                    return _AddmmFunction.apply(bias, x2, w2, op_act, op_act != "none", dw_transposed,
                                                out_shape)[0]
                if op_act == "none":
                    if x.is_cuda:
                        if bias is None and _use_linear_decode(x2, w_kn):
                            y = _linear_decode_call(x2, w_kn.t())
                            return y if x_dim == 2 else y.view(out_shape)
                    elif _cpu_aten_gemm(x, w_kn, bias, w_kn.shape[1]):
                        return F.linear(x, w_kn.t(), bias)
                elif not x.is_cuda and _cpu_onednn_gelu(x, w_kn, bias, w_kn.shape[1]):
                    return _LINEAR_POINTWISE(x, w_kn.t(), bias, "gelu", [], _ONEDNN_GELU[op_act])
                return _fwd_call(bias, x2, w_kn, op_act, False, out_shape)[0]
            except _FALLBACK_ERRORS:
                pass
    bias_name, x_name, w_name = names
    act = _op_activation(activation)
    if not (isinstance(x, torch.Tensor) and x.dtype in FLOAT_DTYPES):
        check_tensor(x, x_name)
    if not (isinstance(w_kn, torch.Tensor) and w_kn.dtype in FLOAT_DTYPES):
        check_tensor(w_kn, w_name)
    x_device = x.device
    if w_kn.device != x_device:
        check_device(w_kn, x, w_name, x_name)
    x_dim = x.dim()
    if x_dim < 1:
        raise ValueError(f"{x_name} must have at least one dimension [..., K], got a 0-d tensor")
    k = x.shape[-1]
    k_w, n = w_kn.shape
    if k_w != k:
        raise ValueError(
            f"{x_name} [..., {k}] and {w_name} {list(w_shape)} cannot be multiplied: inner dimensions differ "
            f"({k} vs {k_w})"
        )
    if bias is not None:
        if not (isinstance(bias, torch.Tensor) and bias.dtype in FLOAT_DTYPES):
            check_tensor(bias, bias_name)
        if bias.device != x_device:
            check_device(bias, x, bias_name, x_name)
        if not (bias.numel() == 1 or (bias.dim() >= 1 and bias.shape[-1] == n and bias.numel() == n)):
            raise ValueError(
                f"{bias_name} must have shape [{n}] (or broadcast to it along the rows: [], [1], [1, {n}]), "
                f"got {list(bias.shape)}"
            )

    cast = autocast_dtype(x)
    if cast is not None:  # what autocast does for F.linear / torch.addmm: every operand in the autocast dtype
        x, w_kn = x.to(cast), w_kn.to(cast)
        bias = bias.to(cast) if bias is not None else None
    if x.dtype != w_kn.dtype:
        raise TypeError(f"{x_name} ({x.dtype}) and {w_name} ({w_kn.dtype}) must have the same dtype")
    if bias is not None:
        if bias.dtype != x.dtype and bias.dtype != torch.float32:
            allowed = f"{x.dtype} or torch.float32 (added in fp32)" if x.dtype != torch.float32 else "torch.float32"
            raise TypeError(f"{bias_name} must be {allowed}, got {bias.dtype}")
        if bias.dim() == 1 and n > 1 and bias.stride(0) != 1:
            bias = bias.contiguous()

    if x_dim == 2:  # [M, K]: no reshape, output [M, N]
        x2 = x
        out_shape = [x.shape[0], n]
    else:
        x2 = x.flatten(0, -2) if x_dim > 1 else x.unsqueeze(0)  # [M, K]; reshape(-1, k) is ambiguous for K == 0
        out_shape = [*x.shape[:-1], n]
    w2, dw_transposed = _mat2_layout(w_kn)
    training = torch.is_grad_enabled() and (
        x2.requires_grad or w2.requires_grad or (bias is not None and bias.requires_grad)
    )
    if not training:  # inference: no autograd node, no saved pre-activation
        if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
            bias = _bias_as_row(bias, n)
        if act == "none" and _cpu_aten_gemm(x2, w2, bias, n):
            # ATen's GEMM is the op's math here; under torch.compile it is also what Inductor gets from the plain
            # model (extern mm, fused neighbours), where the op was an opaque call (docs/tuning-log.md#compile-policy)
            return F.linear(x2, w2.t(), bias).view(out_shape)
        if act != "none" and not torch.compiler.is_compiling() and _cpu_onednn_gelu(x2, w2, bias, n):
            return _LINEAR_POINTWISE(x2, w2.t(), bias, "gelu", [], _ONEDNN_GELU[act]).view(out_shape)
        if bias is None and act == "none":
            if _use_linear_decode(x2, w2):
                return _linear_decode(x2, w2.t()).view(out_shape)
            if torch.compiler.is_compiling():  # a symbolic token count: the GEMV or the GEMM, chosen at run time
                limit = _linear_runtime_limit(x2, w2)
                if limit:
                    return _linear_auto(x2, w2.t(), limit).view(out_shape)
        fwd = _fwd if torch.compiler.is_compiling() else _fwd_call
        return fwd(bias, x2, w2, act, False, out_shape)[0]
    if functorch_active():  # torch.func transforms: the fp32 definition, rounded once
        say_functorch_fallback("linear / addmm")
        return addmm_reference(bias, x2, w2, activation=activation, out_dtype=x2.dtype).view(out_shape)
    if torch.compiler.is_compiling() and plain_when_traced(bias, x2, w2):
        # torch.export inlines an autograd Function's forward and drops its backward (the op has no derivative of its
        # own, so the exported program would lose the gradients); dynamo refuses a tensor passed twice (x @ x): the
        # fp32 definition, rounded once, instead.
        warn_once("export:addmm", "fused_mlp: under torch.export, linear / addmm with gradients trace their fp32 "
                  "reference, not the op (see docs/design.md#torchexport)")
        return addmm_reference(bias, x2, w2, activation=activation, out_dtype=x2.dtype).view(out_shape)
    if act == "none" and _cpu_aten_training(x2, w2, bias, n):  # 2-D x2: one rounding whatever x's layout
        return F.linear(x2, w2.t(), bias).view(out_shape)
    if act != "none" and not torch.compiler.is_compiling() and _cpu_onednn_gelu(x, w_kn, bias, n):
        return _CpuOneDnnGeluFunction.apply(x, w_kn, bias, act)
    y, _ = _AddmmFunction.apply(bias, x2, w2, act, act != "none", dw_transposed, out_shape)
    return y


# ---- public API -------------------------------------------------------------------------------------------


def addmm(
    bias: torch.Tensor | None,
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    *,
    activation: str | None = None,
) -> torch.Tensor:
    """``act(bias + mat1 @ mat2)`` with the bias and the activation applied to the fp32 accumulator, rounded once.

    Args:
        bias: ``[N]`` (or ``[]``, ``[1]``, ``[1, N]``), the input dtype or float32; None for no bias.
        mat1: ``[..., K]`` float32/float16/bfloat16 (torch.addmm's ``[M, K]`` included).
        mat2: ``[K, N]``, same dtype as ``mat1``; any orientation (e.g. GPT-2's Conv1D weight ``[in, out]``).
        activation: None, ``"gelu_tanh"`` (tanh approximation) or ``"gelu"`` (exact erf).

    Returns:
        ``[..., N]`` in ``mat1``'s dtype.
    """
    if not isinstance(mat2, torch.Tensor) or mat2.dim() != 2:
        raise ValueError(f"mat2 must be a 2-D tensor [K, N], got {_describe(mat2)}")
    return _addmm_impl(bias, mat1, mat2, activation, ("bias", "mat1", "mat2"), mat2.shape)


def linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = None,
) -> torch.Tensor:
    """``act(input @ weight.T + bias)`` (``F.linear`` plus an optional GeLU), fused like :func:`addmm`.

    Args:
        input: ``[..., in]`` float32/float16/bfloat16.
        weight: ``[out, in]`` (nn.Linear's layout; used in place through ``.t()``), same dtype as ``input``.
        bias: ``[out]`` or None; the input dtype or float32.
        activation: None, ``"gelu_tanh"`` or ``"gelu"``.
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D tensor [out, in], got {_describe(weight)}")
    return _addmm_impl(bias, input, weight.t(), activation, ("bias", "input", "weight"), weight.shape)


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"a {t.dim()}-D tensor of shape {list(t.shape)}"
    return type(t).__name__


# ---- references -------------------------------------------------------------------------------------------


def addmm_reference(
    bias: torch.Tensor | None,
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    *,
    activation: str | None = None,
    compute_dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Plain-PyTorch definition: everything in ``compute_dtype`` (fp32; fp64 for error studies), rounded once."""
    _op_activation(activation)
    z = mat1.to(compute_dtype) @ mat2.to(compute_dtype)
    if bias is not None:
        z = z + bias.to(compute_dtype)
    if activation == "gelu_tanh":
        z = F.gelu(z, approximate="tanh")
    elif activation == "gelu":
        z = F.gelu(z)
    return z.to(out_dtype if out_dtype is not None else mat1.dtype)


def linear_reference(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = None,
    compute_dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """:func:`addmm_reference` with an ``[out, in]`` weight."""
    return addmm_reference(
        bias, input, weight.t(), activation=activation, compute_dtype=compute_dtype, out_dtype=out_dtype
    )
