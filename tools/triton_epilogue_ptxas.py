#!/usr/bin/env python3
"""Compile every autotune config of the Triton epilogue kernels ahead of time for one GPU target, without a GPU,
and report shared memory, whether the K loop is pipelined (cp.async) and what ptxas spills.

    python tools/triton_epilogue_ptxas.py                 # sm_90, bf16, every activation
    python tools/triton_epilogue_ptxas.py --arch 80 --dtype fp16

Uses triton's own ptxas. Pointer arguments and strides are declared 16-divisible, as triton specialises them at a
real launch with contiguous tensors whose dims are multiples of 8. Takes ~5 s per kernel variant on one core.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--acts", default="gelu_tanh,gelu,silu")
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    spec = importlib.util.spec_from_file_location("kern", ROOT / "torch-ext" / "fused_mlp" / "_triton_mlp_kernels.py")
    kern = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kern)
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    target = GPUTarget("cuda", args.arch, 32)
    arch = f"sm_{args.arch}a" if args.arch == 90 else f"sm_{args.arch}"
    kernels = {
        "fwd_train": (kern._gated_dual_gemm_kernel, ("x_ptr", "wg_ptr", "wu_ptr", "h_ptr", "g_ptr", "u_ptr"),
                      ("M", "N", "K", "M_BUCKET", "stride_xm", "stride_wn", "stride_om"), {"STORE_GATE_UP": True}),
        "fwd_infer": (kern._gated_dual_gemm_kernel, ("x_ptr", "wg_ptr", "wu_ptr", "h_ptr", "g_ptr", "u_ptr"),
                      ("M", "N", "K", "M_BUCKET", "stride_xm", "stride_wn", "stride_om"), {"STORE_GATE_UP": False}),
        "bwd": (kern._gated_bwd_gemm_kernel, ("dy_ptr", "wd_ptr", "g_ptr", "u_ptr", "h_ptr"),
                ("M", "N", "K", "M_BUCKET", "stride_am", "stride_wk", "stride_om"), {}),
    }
    print(f"{'kernel':10} {'act':9} {'config':24} {'smem KB':>7} {'pipelined':>9} {'regs':>5} {'spill B':>8}")
    worst = 0
    for name, (autotuner, ptrs, ints, extra) in kernels.items():
        fn = autotuner.fn.fn  # Autotuner -> Heuristics -> JITFunction
        names = list(fn.arg_names)
        for cfg in kern._CONFIGS:
            for act in args.acts.split(","):
                const = dict(cfg.kwargs, ACT=kern.ACT_IDS[act], INTERP_BF16=False, EVEN_K=True, **extra)
                sig = {p: "*" + args.dtype for p in ptrs} | {i: "i32" for i in ints} | {c: "constexpr" for c in const}
                attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in (*ptrs, *ints) if n != "M"}
                out = triton.compile(ASTSource(fn, sig, const, attrs), target=target,
                                     options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
                with tempfile.TemporaryDirectory() as d:
                    ptx = Path(d) / "k.ptx"
                    ptx.write_text(out.asm["ptx"])
                    rep = subprocess.run([str(ptxas), f"-arch={arch}", "-v", str(ptx), "-o", str(Path(d) / "k.o")],
                                         capture_output=True, text=True).stderr
                regs = re.search(r"Used (\d+) registers", rep)
                spill = re.search(r"(\d+) bytes spill stores", rep)
                spill_b = int(spill.group(1)) if spill else -1
                worst = max(worst, spill_b)
                kw = cfg.kwargs
                desc = (f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']} w{cfg.num_warps} s{cfg.num_stages}"
                        f"{' halves' if kw['EPI_HALVES'] else ''}")
                pipelined = "async_copy_global_to_local" in out.asm["ttgir"]
                print(f"{name:10} {act:9} {desc:24} {out.metadata.shared / 1024:7.0f} {str(pipelined):>9} "
                      f"{regs.group(1) if regs else '?':>5} {spill_b:8d}", flush=True)
    print(f"largest spill: {worst} B per thread")
    return 0


if __name__ == "__main__":
    sys.exit(main())
