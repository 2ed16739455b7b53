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
        s, _ = _sigmoid_and_slope(z)
        a = x * s
    elif ACT == 1:
        a = x * tl.fma(0.5, tl.math.erf(x * 0.70710678118654752440), 0.5)
    else:
        s, _ = _sigmoid_and_slope(x)
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
# with 8 warps (two 128x128 fp32 accumulators: 128 registers per thread); the smaller tiles cover other GPUs and
# small token counts. EPI_HALVES runs the epilogue on two [BM, BN/2] halves: with 64 elements per thread the
# activation math spills otherwise (ptxas -v, sm_90, triton 3.8, tanh-GeLU at 128x128, 8 warps, per thread: whole
# tile 412 B fwd / 2.3 KB bwd; halves 0 B bwd and inference fwd, ~230 B training fwd, which also stores gate/up;
# `python tools/triton_epilogue_ptxas.py`). Shared memory per stage: fwd 48 KB, bwd 32 KB at 128x128x64.
# Measured speed of these configs on a GPU: none yet.
def _cfg(bm: int, bn: int, bk: int, warps: int, stages: int, halves: bool) -> "triton.Config":
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "EPI_HALVES": halves},
                         num_warps=warps, num_stages=stages)


_CONFIGS = [
    _cfg(128, 128, 64, 8, 3, True),
    _cfg(128, 128, 64, 8, 4, True),
    _cfg(128, 64, 64, 8, 4, False),
    _cfg(64, 128, 64, 4, 4, True),
]
# The interpreter (CPU tests) runs one small config that leaves ragged M, N and K tiles at the test shapes.
_INTERPRET_CONFIGS = [triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 2, "EPI_HALVES": True},
                                    num_warps=4)]


def _configs() -> list:
    # FUSED_MLP_TRITON_CONFIG="BM,BN,BK,warps,stages,halves" pins one config (debugging, and the interpreter tests
    # of the whole-tile epilogue).
    env = os.environ.get("FUSED_MLP_TRITON_CONFIG")
    if env:
        bm, bn, bk, w, st, halves = (int(v) for v in env.split(","))
        return [_cfg(bm, bn, bk, w, st, bool(halves))]
    return _INTERPRET_CONFIGS if INTERPRET else _CONFIGS


# EVEN_K: no K mask in the main loop (every model shape: H and I are multiples of 64).
_EVEN_K = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})


@triton.autotune(configs=_configs(), key=["M_BUCKET", "N", "K", "STORE_GATE_UP", "ACT"])
@_EVEN_K
@triton.jit(do_not_specialize=["M_BUCKET"])  # the autotune key only: no compile per value
def _gated_dual_gemm_kernel(
    x_ptr, wg_ptr, wu_ptr, h_ptr, g_ptr, u_ptr,  # x [M, K]; W_gate, W_up [N, K]; h, gate, up [M, N]
    M, N, K, M_BUCKET,
    # Unit stride along K for x and the weights (literal 1, not an argument: vectorised loads and the cp.async
    # pipeline depend on it); W_gate and W_up share strides; outputs contiguous.
    stride_xm, stride_wn, stride_om,
    ACT: tl.constexpr, STORE_GATE_UP: tl.constexpr, INTERP_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, EPI_HALVES: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    # 64-bit tile origins as scalars, 32-bit offsets inside the tile (64-bit pointer tensors cost registers the
    # two accumulators need).
    row0 = pid_m.to(tl.int64) * BLOCK_M
    col0 = pid_n.to(tl.int64) * BLOCK_N
    lm = tl.arange(0, BLOCK_M)
    ln = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = lm < M - row0
    mask_n = ln < N - col0
    # Rows/cols past the edge are clamped for the loads (never stored): only K is masked in the K loop.
    rm = tl.where(mask_m, lm, 0)
    rn = tl.where(mask_n, ln, 0)
    x_ptrs = x_ptr + row0 * stride_xm + (rm[:, None] * stride_xm + offs_k[None, :])  # [BM, BK]
    # B tile of x @ W^T is W[n, k] read as [BK, BN]
    w_offs = offs_k[:, None] + rn[None, :] * stride_wn
    wg_ptrs = wg_ptr + col0 * stride_wn + w_offs
    wu_ptrs = wu_ptr + col0 * stride_wn + w_offs
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptrs)
            bg = tl.load(wg_ptrs)
            bu = tl.load(wu_ptrs)
        else:
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
        x_ptrs += BLOCK_K
        wg_ptrs += BLOCK_K
        wu_ptrs += BLOCK_K
    base = row0 * stride_om + col0
    h_ptr += base
    g_ptr += base
    u_ptr += base
    if EPI_HALVES:  # two [BM, BN/2] halves one after the other (register pressure, see the backward kernel)
        g_lo, g_hi = tl.split(tl.permute(tl.reshape(acc_g, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        u_lo, u_hi = tl.split(tl.permute(tl.reshape(acc_u, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        lh = tl.arange(0, BLOCK_N // 2)
        _fwd_epilogue(g_lo, u_lo, h_ptr, g_ptr, u_ptr, lm, lh, mask_m, lh < N - col0, stride_om, ACT,
                      STORE_GATE_UP, INTERP_BF16)
        _fwd_epilogue(g_hi, u_hi, h_ptr + BLOCK_N // 2, g_ptr + BLOCK_N // 2, u_ptr + BLOCK_N // 2, lm, lh, mask_m,
                      lh < N - col0 - BLOCK_N // 2, stride_om, ACT, STORE_GATE_UP, INTERP_BF16)
    else:
        _fwd_epilogue(acc_g, acc_u, h_ptr, g_ptr, u_ptr, lm, ln, mask_m, mask_n, stride_om, ACT, STORE_GATE_UP,
                      INTERP_BF16)


@triton.jit
def _fwd_epilogue(gate, up, h_ptr, g_ptr, u_ptr, lm, ln, mask_m, mask_n, stride_om, ACT: tl.constexpr,
                  STORE_GATE_UP: tl.constexpr, INTERP_BF16: tl.constexpr):
    """h = act(gate) * up from the fp32 accumulators, one rounding; gate and up rounded once when stored."""
    out_offs = lm[:, None] * stride_om + ln[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if STORE_GATE_UP:
        tl.store(g_ptr + out_offs, _round(gate, g_ptr.dtype.element_ty, INTERP_BF16), mask=mask)
        tl.store(u_ptr + out_offs, _round(up, u_ptr.dtype.element_ty, INTERP_BF16), mask=mask)
    tl.store(h_ptr + out_offs, _round(_act(gate, ACT) * up, h_ptr.dtype.element_ty, INTERP_BF16), mask=mask)


# gate/up are overwritten in place: the autotuner must restore them between the configs it times.
@triton.autotune(configs=_configs(), key=["M_BUCKET", "N", "K", "ACT"], restore_value=["g_ptr", "u_ptr"])
@_EVEN_K
@triton.jit(do_not_specialize=["M_BUCKET"])  # the autotune key only: no compile per value
def _gated_bwd_gemm_kernel(
    dy_ptr, wd_ptr, g_ptr, u_ptr, h_ptr,  # dy [M, K]; W_down [K, N]; gate, up (in: saved; out: dgate, dup), h [M, N]
    M, N, K, M_BUCKET,
    stride_am, stride_wk, stride_om,  # unit stride along dy's K and W_down's N (literal 1); gate/up/h contiguous
    ACT: tl.constexpr, INTERP_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, EPI_HALVES: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    row0 = pid_m.to(tl.int64) * BLOCK_M
    col0 = pid_n.to(tl.int64) * BLOCK_N
    lm = tl.arange(0, BLOCK_M)
    ln = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = lm < M - row0
    mask_n = ln < N - col0
    rm = tl.where(mask_m, lm, 0)
    rn = tl.where(mask_n, ln, 0)
    a_ptrs = dy_ptr + row0 * stride_am + (rm[:, None] * stride_am + offs_k[None, :])
    b_ptrs = wd_ptr + col0 + (offs_k[:, None] * stride_wk + rn[None, :])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k0 * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if INTERP_BF16:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_wk
    # Epilogue: dh (fp32, acc) never reaches memory. Each tile of gate/up is read and then overwritten by this
    # program only, so the in-place update is race-free.
    base = row0 * stride_om + col0
    g_ptr += base
    u_ptr += base
    h_ptr += base
    if EPI_HALVES:
        # Two [BM, BN/2] halves one after the other: the activation and its slope need ~8 live fp32 values per
        # element, so the whole tile at once spills at 64 elements per thread (ptxas, sm_90, 128x128, 8 warps).
        acc_lo, acc_hi = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        lh = tl.arange(0, BLOCK_N // 2)
        _bwd_epilogue(acc_lo, g_ptr, u_ptr, h_ptr, lm, lh, mask_m, lh < N - col0, stride_om, ACT, INTERP_BF16)
        _bwd_epilogue(acc_hi, g_ptr + BLOCK_N // 2, u_ptr + BLOCK_N // 2, h_ptr + BLOCK_N // 2, lm, lh, mask_m,
                      lh < N - col0 - BLOCK_N // 2, stride_om, ACT, INTERP_BF16)
    else:
        _bwd_epilogue(acc, g_ptr, u_ptr, h_ptr, lm, ln, mask_m, mask_n, stride_om, ACT, INTERP_BF16)


@triton.jit
def _bwd_epilogue(dh, g_ptr, u_ptr, h_ptr, lm, ln, mask_m, mask_n, stride_om, ACT: tl.constexpr,
                  INTERP_BF16: tl.constexpr):
    """dgate = dh up act'(gate) over gate, dup = dh act(gate) over up, h = act(gate) up; one rounding each."""
    out_offs = lm[:, None] * stride_om + ln[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    gate = tl.load(g_ptr + out_offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(u_ptr + out_offs, mask=mask, other=0.0).to(tl.float32)
    a, da = _act_and_slope(gate, ACT)
    dt = g_ptr.dtype.element_ty
    tl.store(g_ptr + out_offs, _round(dh * up * da, dt, INTERP_BF16), mask=mask)
    tl.store(u_ptr + out_offs, _round(dh * a, dt, INTERP_BF16), mask=mask)
    tl.store(h_ptr + out_offs, _round(a * up, dt, INTERP_BF16), mask=mask)


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"fused_mlp triton epilogue ops: expected {what}")


def _m_bucket(m: int) -> int:
    """Autotune key for the token count: powers of two (a new token count does not re-tune every time)."""
    return 1 << max(m - 1, 0).bit_length()


def _grid(meta: dict, m: int, n: int) -> tuple[int]:
    return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)


def gated_dual_gemm(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, activation: str,
                    store_gate_up: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """x [M, K], w_gate/w_up [N, K] (same strides) -> h [M, N] (and gate, up [M, N] when store_gate_up)."""
    _check(x.dim() == 2 and w_gate.dim() == 2 and w_gate.shape == w_up.shape and w_gate.shape[1] == x.shape[1],
           "x [T, H] and w_gate, w_up [I, H]")
    _check(x.dtype in (torch.float16, torch.bfloat16) and x.dtype == w_gate.dtype == w_up.dtype,
           "one dtype, float16 or bfloat16")
    m, k = x.shape
    n = w_gate.shape[0]
    if k > 1 and x.stride(1) != 1:
        x = x.contiguous()
    if w_up.stride() != w_gate.stride() or (k > 1 and w_gate.stride(1) != 1):
        w_up = w_up.contiguous()  # copies only for unusual layouts (nn.Linear weights are contiguous)
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
            x.stride(0), w_gate.stride(0), h.stride(0),
            ACT=ACT_IDS[activation], STORE_GATE_UP=store_gate_up,
            INTERP_BF16=INTERPRET and x.dtype == torch.bfloat16,
        )
    return h, gate, up


def gated_bwd_gemm_(dy: torch.Tensor, w_down: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                    activation: str) -> torch.Tensor:
    """dy [M, K], w_down [K, N], gate/up [M, N] contiguous: gate <- dgate, up <- dup in place; returns h [M, N]."""
    _check(dy.dim() == 2 and w_down.dim() == 2 and w_down.shape[0] == dy.shape[1],
           "dy [T, H_out] and w_down [H_out, I]")
    _check(dy.dtype in (torch.float16, torch.bfloat16) and dy.dtype == w_down.dtype == gate.dtype == up.dtype,
           "one dtype, float16 or bfloat16")
    m, k = dy.shape
    n = w_down.shape[1]
    if k > 1 and dy.stride(1) != 1:
        dy = dy.contiguous()  # e.g. the expanded (stride-0) gradient of y.sum()
    if n > 1 and w_down.stride(1) != 1:
        w_down = w_down.contiguous()
    if not (gate.is_contiguous() and up.is_contiguous() and gate.shape == up.shape == (m, n)):
        raise ValueError("gate and up must be contiguous [T, I] tensors (they are overwritten in place)")
    h = torch.empty_like(gate)
    if m == 0 or n == 0:
        return h
    with torch.cuda.device(dy.device) if dy.is_cuda else nullcontext():
        _gated_bwd_gemm_kernel[lambda meta: _grid(meta, m, n)](
            dy, w_down, gate, up, h,
            m, n, k, _m_bucket(m),
            dy.stride(0), w_down.stride(0), gate.stride(0),
            ACT=ACT_IDS[activation], INTERP_BF16=INTERPRET and dy.dtype == torch.bfloat16,
        )
    return h
