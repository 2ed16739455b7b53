"""Triton kernels of the gated-MLP GEMM epilogues (see ``_triton_mlp.py`` for the design and the ops).

Imported only from inside the ``_triton_mlp`` custom ops, i.e. only when the opt-in Triton path runs: importing
the package never imports triton.

- ``gated_dual_gemm``: ``gate = x @ W_gate^T``, ``up = x @ W_up^T`` from one ``x`` tile per K step into two fp32
  accumulators; epilogue ``h = act(gate) * up`` rounded once (and, in training, gate/up rounded to x's dtype).
- ``gated_bwd_gemm``: ``dh = dy @ W_down`` in fp32 (never stored); epilogue loads the saved gate/up tile and writes
  ``dgate = dh * up * act'(gate)``, ``dup = dh * act(gate)`` over gate/up in place, and ``h = act(gate) * up``
  (for ``dW_down = dy^T h``), each rounded once.

Activation formulas are the CUDA kernel's (kernels_src/cuda/geglu.cu): sigmoid via ``e = exp(-|z|)``,
``r = 1/(1+e)`` (correctly rounded division, like ``__frcp_rn``), tanh-GeLU as ``x * sigmoid(2u)``, erf-GeLU as
``x * (0.5 + 0.5 erf(x/sqrt2))``, SiLU as ``x * sigmoid(x)``. ``tl.exp``/``tl.math.erf`` are Triton's intrinsics,
which may differ from CUDA's ``expf``/``erff`` in the last ulp of the fp32 intermediate.
"""

import os
from contextlib import nullcontext

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

ACT_IDS = {"gelu_tanh": 0, "gelu": 1, "silu": 2}

# Constants are literals inside the jit functions (sqrt(2/pi), 0.044715, 1/sqrt2, 1/sqrt(2pi)): plain Python
# globals are not visible to @triton.jit code.


@triton.jit
def _sigmoid_and_slope(z):
    e = tl.exp(-tl.abs(z))  # never overflows
    r = tl.math.div_rn(tl.full(z.shape, 1.0, tl.float32), 1.0 + e)
    er = e * r
    s = tl.where(z >= 0.0, r, er)  # NaN in: NaN out (e, r are NaN)
    return s, er * r


@triton.jit
def _act(x, ACT: tl.constexpr):
    if ACT == 0:
        z = (2.0 * 0.79788456080286535588) * x * tl.fma(0.044715, x * x, 1.0)
        s, ds = _sigmoid_and_slope(z)
        a = x * s
    elif ACT == 1:
        a = x * tl.fma(0.5, tl.math.erf(x * 0.70710678118654752440), 0.5)
    else:
        s, ds = _sigmoid_and_slope(x)
        a = x * s
    return a


@triton.jit
def _act_and_slope(x, ACT: tl.constexpr):
    if ACT == 0:
        x2 = x * x
        z = (2.0 * 0.79788456080286535588) * x * tl.fma(0.044715, x2, 1.0)
        dz = (2.0 * 0.79788456080286535588) * tl.fma(3.0 * 0.044715, x2, 1.0)
        s, ds = _sigmoid_and_slope(z)
        a = x * s
        da = tl.fma(x * ds, dz, s)
    elif ACT == 1:
        cdf = tl.fma(0.5, tl.math.erf(x * 0.70710678118654752440), 0.5)
        pdf = tl.exp(-0.5 * x * x) * 0.39894228040143267794
        a = x * cdf
        da = tl.fma(x, pdf, cdf)
    else:
        s, ds = _sigmoid_and_slope(x)
        a = x * s
        da = tl.fma(x, ds, s)
    return a, da


@triton.jit
def _round(v, dt: tl.constexpr, INTERP_BF16: tl.constexpr):
    """fp32 -> dt, round to nearest even. The interpreter truncates fp32 -> bf16 (triton 3.8 ignores the rounding
    mode there), which biases every sum over rounded values: round in fp32 bits first, then the cast is exact."""
    if INTERP_BF16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        v = bits.to(tl.float32, bitcast=True)
    return v.to(dt)


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M row-tiles share each column sweep, so their B tiles are reused from L2."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    group = pid // per_group
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % per_group) % size_m)
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


# Few configs: autotuning runs once per (M bucket, N, K) and its time counts. Hopper (sm_90) favours 128x128x64
# with 8 warps; the 4-warp and 64-wide-N entries cover smaller GPUs/shapes where registers or occupancy bind.
# Two fp32 accumulators of 128x128 take 128 registers/thread at 8 warps.
_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
]
# The interpreter (CPU tests) runs one small config that leaves ragged M, N and K tiles at the test shapes.
_INTERPRET_CONFIGS = [triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 2}, num_warps=4)]


def _configs() -> list:
    if INTERPRET:
        return _INTERPRET_CONFIGS
    env = os.environ.get("FUSED_MLP_TRITON_CONFIG")  # "BM,BN,BK,warps,stages": pin one config (debugging)
    if env:
        bm, bn, bk, w, s = (int(v) for v in env.split(","))
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w,
                              num_stages=s)]
    return _CONFIGS


@triton.autotune(configs=_configs(), key=["M_BUCKET", "N", "K", "STORE_GATE_UP", "ACT"])
@triton.jit
def _gated_dual_gemm_kernel(
    x_ptr, wg_ptr, wu_ptr, h_ptr, g_ptr, u_ptr,  # x [M, K]; W_gate, W_up [N, K]; h, gate, up [M, N]
    M, N, K, M_BUCKET,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om,  # W_gate and W_up share strides; outputs contiguous
    ACT: tl.constexpr, STORE_GATE_UP: tl.constexpr, INTERP_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # Row indices clamped into range for loads (masked rows/cols are never stored): keeps the K loop's loads
    # unmasked along M/N, only K is masked (ragged last K step).
    rm = tl.where(mask_m, offs_m, 0).to(tl.int64)
    rn = tl.where(mask_n, offs_n, 0).to(tl.int64)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + offs_k[None, :] * stride_xk  # [BM, BK]
    # B tile of x @ W^T is W[n, k] read as [BK, BN]
    wg_ptrs = wg_ptr + offs_k[:, None] * stride_wk + rn[None, :] * stride_wn
    wu_ptrs = wu_ptr + offs_k[:, None] * stride_wk + rn[None, :] * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k0 * BLOCK_K
        a = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        bg = tl.load(wg_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        bu = tl.load(wu_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if INTERP_BF16:  # the interpreter's dot multiplies bf16's uint16 storage (triton 3.8): give it fp32
            a = a.to(tl.float32)
            bg = bg.to(tl.float32)
            bu = bu.to(tl.float32)
        acc_g = tl.dot(a, bg, acc_g)
        acc_u = tl.dot(a, bu, acc_u)
        x_ptrs += BLOCK_K * stride_xk
        wg_ptrs += BLOCK_K * stride_wk
        wu_ptrs += BLOCK_K * stride_wk
    h = _act(acc_g, ACT) * acc_u  # fp32 on the fp32 accumulators, one rounding below
    out_offs = offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    tl.store(h_ptr + out_offs, _round(h, h_ptr.dtype.element_ty, INTERP_BF16), mask=mask)
    if STORE_GATE_UP:
        tl.store(g_ptr + out_offs, _round(acc_g, g_ptr.dtype.element_ty, INTERP_BF16), mask=mask)
        tl.store(u_ptr + out_offs, _round(acc_u, u_ptr.dtype.element_ty, INTERP_BF16), mask=mask)


# gate/up are overwritten in place: the autotuner must restore them between the configs it times.
@triton.autotune(configs=_configs(), key=["M_BUCKET", "N", "K", "ACT"], restore_value=["g_ptr", "u_ptr"])
@triton.jit
def _gated_bwd_gemm_kernel(
    dy_ptr, wd_ptr, g_ptr, u_ptr, h_ptr,  # dy [M, K]; W_down [K, N]; gate, up (in: saved; out: dgate, dup), h [M, N]
    M, N, K, M_BUCKET,
    stride_am, stride_ak, stride_wk, stride_wn, stride_om,
    ACT: tl.constexpr, INTERP_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rm = tl.where(mask_m, offs_m, 0).to(tl.int64)
    rn = tl.where(mask_n, offs_n, 0).to(tl.int64)
    a_ptrs = dy_ptr + rm[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = wd_ptr + offs_k[:, None] * stride_wk + rn[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if INTERP_BF16:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_wk
    # Epilogue: dh (fp32, acc) never reaches memory. Each tile of gate/up is read and then overwritten by this
    # program only, so the in-place update is race-free.
    out_offs = offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    gate = tl.load(g_ptr + out_offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(u_ptr + out_offs, mask=mask, other=0.0).to(tl.float32)
    a, da = _act_and_slope(gate, ACT)
    dt = g_ptr.dtype.element_ty
    tl.store(g_ptr + out_offs, _round(acc * up * da, dt, INTERP_BF16), mask=mask)
    tl.store(u_ptr + out_offs, _round(acc * a, dt, INTERP_BF16), mask=mask)
    tl.store(h_ptr + out_offs, _round(a * up, dt, INTERP_BF16), mask=mask)


def _m_bucket(m: int) -> int:
    """Autotune key for the token count: powers of two (a new token count does not re-tune every time)."""
    return 1 << max(m - 1, 0).bit_length()


def _grid(meta: dict, m: int, n: int) -> tuple[int]:
    return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)


def gated_dual_gemm(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, activation: str,
                    store_gate_up: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """x [M, K], w_gate/w_up [N, K] (same strides) -> h [M, N] (and gate, up [M, N] when store_gate_up)."""
    m, k = x.shape
    n = w_gate.shape[0]
    if w_up.stride() != w_gate.stride():
        w_up = w_up.contiguous()
        w_gate = w_gate.contiguous()
    h = torch.empty((m, n), device=x.device, dtype=x.dtype)
    gate = torch.empty_like(h) if store_gate_up else None
    up = torch.empty_like(h) if store_gate_up else None
    if m == 0 or n == 0:
        return h, gate, up
    with torch.cuda.device(x.device) if x.is_cuda else nullcontext():
        _gated_dual_gemm_kernel[lambda meta: _grid(meta, m, n)](
            x, w_gate, w_up, h, gate if store_gate_up else h, up if store_gate_up else h,
            m, n, k, _m_bucket(m),
            x.stride(0), x.stride(1), w_gate.stride(0), w_gate.stride(1), h.stride(0),
            ACT=ACT_IDS[activation], STORE_GATE_UP=store_gate_up,
            INTERP_BF16=INTERPRET and x.dtype == torch.bfloat16,
        )
    return h, gate, up


def gated_bwd_gemm_(dy: torch.Tensor, w_down: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                    activation: str) -> torch.Tensor:
    """dy [M, K], w_down [K, N], gate/up [M, N] contiguous: gate <- dgate, up <- dup in place; returns h [M, N]."""
    m, k = dy.shape
    n = w_down.shape[1]
    h = torch.empty_like(gate)
    if m == 0 or n == 0:
        return h
    with torch.cuda.device(dy.device) if dy.is_cuda else nullcontext():
        _gated_bwd_gemm_kernel[lambda meta: _grid(meta, m, n)](
            dy, w_down, gate, up, h,
            m, n, k, _m_bucket(m),
            dy.stride(0), dy.stride(1), w_down.stride(0), w_down.stride(1), gate.stride(0),
            ACT=ACT_IDS[activation], INTERP_BF16=INTERPRET and dy.dtype == torch.bfloat16,
        )
    return h
