#!/usr/bin/env python3
"""Markdown from the benchmark CSVs: every target of ``docs/targets.md`` marked met / not met with the measured
value, and per op / mode tables of ours vs every anchor. No number here is typed by hand: thresholds are the targets
(encoded below, stated with their reasons in docs/targets.md), every measured value comes from the CSV.

    python benchmarks/report.py benchmarks/results/*/*.csv               # the full report on stdout
    python benchmarks/report.py benchmarks/results/*/*.csv --out benchmarks/results/RESULTS.md \
        --write-results docs/results.md --write-readme README.md         # what is committed
    python benchmarks/report.py --scale DIR/scale.csv     # benchmarks/scale.py's CSV as a markdown table

``--out`` gets the full report (every shape). ``--write-results`` replaces the generated section of the results page
(the text between ``<!-- results:start -->`` and ``<!-- results:end -->``: the targets, the summary, a link to
``--out``); ``--write-readme`` replaces the same section of the README with the headline rows (targets marked
``headline``) and a link to the results page. A page without the markers gets them appended.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parent.parent

from bench_lib import fnum, read_rows  # noqa: E402

START, END = "<!-- results:start -->", "<!-- results:end -->"

# ---------------------------------------------------------------------------------------------------------------
# The targets, as data. docs/targets.md states each one (by id, under its group's heading) and where it comes from;
# tests/packaging/test_docs.py checks that every id here appears there. `group`: the heading in docs/targets.md.
# `headline`: the row's label in the README's status table (a few targets only).
# `where`: column -> (op, value[, value2]) with op in >=, <=, ==, between, in; applied to the CSV row's columns.
# `check`:
#   all_ge / all_le   every matching row of `provider` (default ours) has `column` >= / <= `threshold`
#   vs_provider_ge    for every matching shape, time(`other`) / time(ours) >= threshold   (a speedup)
#   vs_best_ge        for every matching shape, best anchor time / time(ours) >= threshold (in-run anchors, plus
#                     recorded ones when `recorded` is set)
#   err_le_provider   ours' max_err <= `other`'s max_err on every matching shape
# `threads` (CPU targets): only rows measured with that many threads count.
# ---------------------------------------------------------------------------------------------------------------

RMS, ADDNORM, ACT, MLP, EPI, GEMM, E2E, DECODE, CPU = (
    "RMSNorm", "Fused add and RMSNorm", "Gated activations", "GeGLU MLP", "GeGLU MLP, GEMM-epilogue kernels",
    "addmm and Linear", "End to end", "Decode and small shapes", "CPU")
GROUPS = (RMS, ADDNORM, ACT, MLP, EPI, GEMM, E2E, DECODE, CPU)  # the order of docs/targets.md
EPI_SHAPE = {"T": ("==", 4096), "H": ("==", 2048), "I": ("==", 16384)}  # benchmarks/epilogue.py's --quick shape
DECODE_MODELS = (("llama3_2_1b", "Llama-3.2-1B"), ("gemma2b", "Gemma-2B"))
GRAPH_TARGET_OPS = ("rms_norm", "add_rms_norm", "gemma_rms_norm", "geglu_act", "swiglu_act")


def _graph_where(op: str) -> dict[str, tuple]:
    """The fwd_graph targets' sizes: M/T in 1, 16, 64 (all the mode runs) x N (I for the activations) 2048..8192."""
    return {("I" if op.endswith("_act") else "N"): ("between", 2048, 8192)}


TARGETS: list[dict[str, Any]] = [
    # the project's target sheet: ">= 3.9 TB/s where M*N >= 16M" (M >= 4096); smaller shapes: the anchor row only
    dict(id="rms-fwd", device="cuda", op="rms_norm", mode="fwd",
         where={"M": (">=", 4096), "N": ("between", 2048, 65536), "MN": (">=", 16 * 2**20)},
         check="all_ge", column="gbps", threshold=3900, unit="GB/s",
         text="RMSNorm fwd, M >= 4096, M*N >= 16M, N in 2048..65536: >= 3.9 TB/s on every such shape", group=RMS),
    dict(id="rms-fwd-anchor", device="cuda", op="rms_norm", mode="fwd", where={"M": (">=", 4096)},
         check="vs_best_ge", threshold=1.0, recorded=True, unit="x",
         text="RMSNorm fwd never slower than the best anchor (quack's recorded numbers included)", group=RMS,
         headline="RMSNorm fwd, M >= 4096, vs the best anchor"),
    # design/targets.md and issue 27: bwd >= the best anchor at every M >= 4096 shape; >= 3.0 TB/s on the large shapes
    # (M*N >= 64M here, the range of quack's recorded numbers), moonshot 3.4
    dict(id="rms-bwd", device="cuda", op="rms_norm", mode="bwd",
         where={"M": (">=", 4096), "N": ("between", 2048, 65536), "MN": (">=", 64 * 2**20)},
         check="all_ge", column="gbps", threshold=3000, unit="GB/s",
         text="RMSNorm bwd (dx + dW), M >= 4096, M*N >= 64M: >= 3.0 TB/s on every such shape", group=RMS),
    dict(id="rms-bwd-moonshot", device="cuda", op="rms_norm", mode="bwd",
         where={"M": (">=", 4096), "N": ("between", 2048, 65536), "MN": (">=", 64 * 2**20)},
         check="all_ge", column="gbps", threshold=3400, unit="GB/s",
         text="RMSNorm bwd, same shapes: >= 3.4 TB/s (moonshot)", group=RMS),
    dict(id="rms-bwd-anchor", device="cuda", op="rms_norm", mode="bwd", where={"M": (">=", 4096)},
         check="vs_best_ge", threshold=1.0, recorded=True, unit="x",
         text="RMSNorm bwd never slower than the best anchor, M >= 4096 (quack's recorded numbers included)",
         group=RMS),
    dict(id="rms-small-fwd", device="cuda", op="rms_norm", mode="fwd", where={"M": ("<=", 64), "N": ("==", 4096)},
         check="all_le", column="time_p50_ms", threshold=0.006, unit="ms",
         text="RMSNorm M in 1..64, N = 4096: fwd <= 6 us per call", group=RMS),
    dict(id="rms-small-bwd", device="cuda", op="rms_norm", mode="bwd", where={"M": ("<=", 64), "N": ("==", 4096)},
         check="all_le", column="time_p50_ms", threshold=0.015, unit="ms",
         text="RMSNorm M in 1..64, N = 4096: bwd <= 15 us per call", group=RMS),
    dict(id="addnorm-fwd", device="cuda", op="add_rms_norm", mode="fwd", where={"M": (">=", 4096)},
         check="all_ge", column="gbps", threshold=4100, unit="GB/s",
         text="fused residual add + RMSNorm fwd: >= 4.1 TB/s", group=ADDNORM),
    dict(id="addnorm-anchor", device="cuda", op="add_rms_norm", mode="fwd", where={"M": (">=", 4096)},
         check="vs_best_ge", threshold=1.0, unit="x",
         text="fused residual add + RMSNorm fwd: >= the best anchor on every shape", group=ADDNORM),
    dict(id="geglu-act-fwd", device="cuda", op="geglu_act", mode="fwd", where={"TI": (">=", 32 * 2**20)},
         check="all_ge", column="pct_of_ceiling", threshold=90, unit="% of copy",
         text="GeGLU activation fwd, T*I >= 32M: >= 90% of copy bandwidth", group=ACT,
         headline="GeGLU activation kernel fwd, T*I >= 32M, share of copy bandwidth"),
    dict(id="geglu-act-bwd", device="cuda", op="geglu_act", mode="bwd", where={"TI": (">=", 32 * 2**20)},
         check="all_ge", column="pct_of_ceiling", threshold=90, unit="% of copy",
         text="GeGLU activation bwd, T*I >= 32M: >= 90% of copy bandwidth", group=ACT),
    dict(id="swiglu-act-fwd", device="cuda", op="swiglu_act", mode="fwd", where={"TI": (">=", 32 * 2**20)},
         check="all_ge", column="pct_of_ceiling", threshold=90, unit="% of copy",
         text="SwiGLU activation fwd, T*I >= 32M: >= 90% of copy bandwidth", group=ACT),
    dict(id="swiglu-act-bwd", device="cuda", op="swiglu_act", mode="bwd", where={"TI": (">=", 32 * 2**20)},
         check="all_ge", column="pct_of_ceiling", threshold=90, unit="% of copy",
         text="SwiGLU activation bwd, T*I >= 32M: >= 90% of copy bandwidth", group=ACT),
    dict(id="mlp-fwd", device="cuda", op="geglu_mlp", mode="fwd",
         where={"T": ("==", 4096), "H": ("==", 2048), "I": ("==", 16384)},
         check="all_le", column="time_p50_ms", threshold=1.22, unit="ms",
         text="GeGLU MLP fwd, T=4096, H=2048, I=16384: <= 1.22 ms", group=MLP),
    dict(id="mlp-fwdbwd", device="cuda", op="geglu_mlp", mode="fwd+bwd",
         where={"T": ("==", 4096), "H": ("==", 2048), "I": ("==", 16384)},
         check="all_le", column="time_p50_ms", threshold=3.75, unit="ms",
         text="GeGLU MLP fwd+bwd, same shape: <= 3.75 ms", group=MLP),
    dict(id="mlp-peak", device="cuda", op="geglu_mlp", mode="fwd+bwd",
         where={"T": ("==", 4096), "H": ("==", 2048), "I": ("==", 16384)},
         check="all_le", column="peak_mem_bytes", threshold=2.0e9, unit="bytes",
         text="GeGLU MLP fwd+bwd, same shape: peak memory <= 2.0 GB", group=MLP),
    # design/targets.md, "Met (keep them met)": the same shape against torch.compile measured in the same run
    dict(id="mlp-fwd-compile", device="cuda", op="geglu_mlp", mode="fwd",
         where={"T": ("==", 4096), "H": ("==", 2048), "I": ("==", 16384)},
         check="vs_provider_ge", other="torch.compile", threshold=1.10, unit="x",
         text="GeGLU MLP fwd, same shape: >= 1.10x torch.compile (met before; keep)", group=MLP,
         headline="GeGLU MLP fwd, T=4096 H=2048 I=16384, vs torch.compile"),
    dict(id="mlp-fwdbwd-compile", device="cuda", op="geglu_mlp", mode="fwd+bwd",
         where={"T": ("==", 4096), "H": ("==", 2048), "I": ("==", 16384)},
         check="vs_provider_ge", other="torch.compile", threshold=1.03, unit="x",
         text="GeGLU MLP fwd+bwd, same shape: >= 1.03x torch.compile (met before; keep)", group=MLP,
         headline="GeGLU MLP fwd+bwd, same shape, vs torch.compile"),
    dict(id="mlp-peak-compile", device="cuda", op="geglu_mlp", mode="fwd+bwd",
         where={"T": ("==", 4096), "H": ("==", 2048), "I": ("==", 16384)},
         check="vs_provider_ge", other="torch.compile", column="peak_mem_bytes", threshold=1.0, unit="x",
         text="GeGLU MLP fwd+bwd, same shape: peak memory <= torch.compile's (ratio compile / ours; keep)",
         group=MLP),
    # decode is inference: benchmarks/decode_mlp.py, CUDA-graph device time, `ours` = the auto dispatch a user gets
    dict(id="mlp-decode", device="cuda", op="gated_mlp_decode", mode="fwd_graph",
         where={"T": ("<=", 16), "H": ("==", 2048), "I": ("==", 16384)},
         check="all_le", column="time_p50_ms", threshold=0.055, unit="ms",
         text="GeGLU MLP decode (T <= 16), H=2048, I=16384: <= 55 us (CUDA-graph device time)", group=MLP),
    dict(id="mlp-decode-eager", device="cuda", op="gated_mlp_decode", mode="fwd_graph", where={"T": ("<=", 16)},
         check="vs_provider_ge", other="eager", threshold=1.0, unit="x",
         text="gated MLP decode (T <= 16): never slower than eager, every benchmarked (H, I)", group=MLP),
    # anchor: torch.compile's recorded time at this shape (benchmarks/anchors/anchors.json, "geglu", "compile")
    *(row for mode, name, anchor, ms in (("fwd", "fwd", 1.296, 1.22), ("fwd_bwd", "fwd+bwd", 3.96, 3.75)) for row in (
        dict(id=f"epi-{mode.replace('_', '')}", device="cuda", op="gated_mlp_epilogue", mode=mode,
             provider="epilogue", where=EPI_SHAPE, check="all_le", column="time_p50_ms", threshold=ms, unit="ms",
             text=f"GeGLU MLP {name} through the GEMM-epilogue kernels, T=4096, H=2048, I=16384: <= {ms} ms",
             group=EPI),
        # the host is noisy: the same target as a ratio to torch.compile measured in the same run
        dict(id=f"epi-{mode.replace('_', '')}-vs-compile", device="cuda", op="gated_mlp_epilogue", mode=mode,
             provider="epilogue", where=EPI_SHAPE, check="vs_provider_ge", other="torch_compile",
             threshold=round(anchor / ms, 3), unit="x",
             text=f"the same target as a speedup over torch.compile measured in the same run: >= {anchor} / {ms} "
                  "(torch.compile's recorded time over the target)", group=EPI))),
    dict(id="epi-peak", device="cuda", op="gated_mlp_epilogue", mode="fwd_bwd", provider="epilogue",
         where={"T": ("==", 4096), "H": ("==", 2048), "I": ("==", 16384)},
         check="all_le", column="peak_mem_bytes", threshold=2.0e9, unit="bytes",
         text="GeGLU MLP fwd+bwd through the GEMM-epilogue kernels, same shape: peak memory <= 2.0 GB",
         group=EPI),
    dict(id="epi-fwd-vs-cublas", device="cuda", op="gated_mlp_epilogue", mode="fwd", provider="epilogue",
         where={"T": (">=", 512), "H": ("between", 2048, 3072)}, check="vs_provider_ge", other="cublas",
         threshold=1.0, unit="x",
         text="GeGLU MLP inference fwd through the GEMM epilogue: at least as fast as the cuBLAS path it replaces, "
              "every benchmarked (H, I, T >= 512) where fused_mlp._epilogue.DISPATCH sends it (2048 <= H <= 3072; at "
              "H=4096 it measured either way and the cuBLAS path stays: next row)", group=EPI),
    dict(id="epi-fwd-h4096", device="cuda", op="gated_mlp_epilogue", mode="fwd", provider="epilogue",
         where={"T": (">=", 512), "H": (">=", 4096)}, check="vs_provider_ge", other="cublas", threshold=1.0,
         unit="x", text="GeGLU MLP inference fwd through the GEMM epilogue at H >= 4096, T >= 512 (0.99-1.04x the "
                        "cuBLAS path's time at T = 4096 over six runs: DISPATCH keeps the cuBLAS path there)", group=EPI),
    dict(id="epi-train-fwd-vs-cublas", device="cuda", op="gated_mlp_epilogue", mode="fwd_bwd",
         provider="epilogue_fwd", where={"T": (">=", 4096), "H": ("==", 2048), "I": (">=", 14336)}, check="vs_provider_ge",
         other="cublas", threshold=1.0, unit="x",
         text="GeGLU MLP training step with the fused forward (the cuBLAS backward): at least as fast as the cuBLAS "
              "path where fused_mlp._epilogue.DISPATCH sends the training forward (H = 2048, T >= 4096, I >= 14336)",
         group=EPI),
    dict(id="epi-train-bwd-vs-cublas", device="cuda", op="gated_mlp_epilogue", mode="fwd_bwd",
         provider="epilogue_bwd", where={"T": (">=", 4096), "H": ("between", 2048, 3072), "I": (">=", 14336)}, check="vs_provider_ge",
         other="cublas", threshold=1.0, unit="x",
         text="GeGLU MLP training step with the fused backward (the cuBLAS forward): at least as fast as the cuBLAS "
              "path where fused_mlp._epilogue.DISPATCH sends the backward (T >= 4096, 2048 <= H <= 3072, I >= 14336)",
         group=EPI),
    dict(id="epi-train-both-vs-cublas", device="cuda", op="gated_mlp_epilogue", mode="fwd_bwd", provider="epilogue",
         where={"H": ("between", 2048, 3072)},
         where_any=({"T": (">=", 4096), "I": (">=", 14336)}, {"T": (">=", 512), "I": ("==", 8192)}),
         check="vs_provider_ge", other="cublas", threshold=1.0, unit="x",
         text="GeGLU MLP training step with both passes fused (the slopes form: h, up act'(gate), act(gate) saved): "
              "at least as fast as the cuBLAS path where fused_mlp._epilogue.DISPATCH's train entry sends both "
              "(2048 <= H <= 3072 with T >= 4096 and I >= 14336, or T >= 512 at I = 8192)", group=EPI),
    dict(id="epi-fwdbwd-vs-cublas", device="cuda", op="gated_mlp_epilogue", mode="fwd_bwd", provider="epilogue",
         where={"T": (">=", 512)}, check="vs_provider_ge", other="cublas", threshold=1.0, unit="x",
         text="GeGLU MLP fwd+bwd through both GEMM-epilogue kernels: at least as fast as the cuBLAS path, every "
              "benchmarked (H, I, T >= 512) (not met: below T = 4096 and at H = 4096 the fused kernels measured "
              "either way in training, and DISPATCH keeps the cuBLAS path there)", group=EPI),
    # design/targets.md and issue 28: every M >= 4096 shape
    dict(id="addmm-vs-mm", device="cuda", op="addmm", mode="fwd", where={"M": (">=", 4096)},
         check="vs_provider_ge", other="mm only", threshold=0.98, unit="x",
         text="addmm + bias + tanh-GeLU, M >= 4096: >= 98% of mm alone on every shape", group=GEMM),
    dict(id="addmm-vs-fused", device="cuda", op="addmm", mode="fwd", where={"M": (">=", 4096)},
         check="vs_provider_ge", other="torch._addmm_activation", threshold=1.0, unit="x",
         text="addmm + bias + tanh-GeLU, M >= 4096: >= torch._addmm_activation on every shape", group=GEMM),
    dict(id="addmm-err", device="cuda", op="addmm", mode="fwd", where={"M": (">=", 4096)},
         check="err_le_provider", other="torch._addmm_activation", unit="max |err| vs fp64",
         text="addmm + bias + tanh-GeLU, M >= 4096: error <= the fp32-epilogue error (torch._addmm_activation)",
         group=GEMM),
    dict(id="linear-fwdbwd", device="cuda", op="linear", mode="fwd+bwd", where={"M": (">=", 4096)},
         check="vs_provider_ge", other="eager", threshold=1.03, unit="x",
         text="Linear with bias fwd+bwd, M >= 4096: >= 1.03x eager nn.Linear on every shape", group=GEMM),
    dict(id="e2e-step", device="cuda", op="e2e_gemma2b", mode="train_step", where={"L": ("==", 4), "T": ("==", 4096)},
         check="all_le", column="time_p50_ms", threshold=19.8, unit="ms",
         text="4 Gemma-2B layers, 2x2048 tokens, training step: <= 19.8 ms", group=E2E),
    dict(id="e2e-step-peak", device="cuda", op="e2e_gemma2b", mode="train_step",
         where={"L": ("==", 4), "T": ("==", 4096)},
         check="all_le", column="peak_mem_bytes", threshold=4.5e9, unit="bytes",
         text="same, training step: peak memory <= 4.5 GB", group=E2E),
    dict(id="e2e-prefill", device="cuda", op="e2e_gemma2b", mode="prefill", where={"L": ("==", 4), "T": ("==", 4096)},
         check="all_le", column="time_p50_ms", threshold=6.6, unit="ms",
         text="same stack, prefill forward: <= 6.6 ms", group=E2E),
    dict(id="e2e-step-eager", device="cuda", op="e2e_gemma2b", mode="train_step", where={},
         check="vs_provider_ge", other="eager", threshold=1.15, unit="x",
         text="4 Gemma-2B layers: training step >= 1.15x eager", group=E2E,
         headline="4 Gemma-2B layers, 2x2048 tokens, training step, vs eager"),
    dict(id="e2e-step-compile", device="cuda", op="e2e_gemma2b", mode="train_step", where={},
         check="vs_provider_ge", other="torch.compile", threshold=1.05, unit="x",
         text="4 Gemma-2B layers: training step >= 1.05x torch.compile (met before; keep)", group=E2E,
         headline="the same training step, vs torch.compile"),
    dict(id="e2e-prefill-eager", device="cuda", op="e2e_gemma2b", mode="prefill", where={},
         check="vs_provider_ge", other="eager", threshold=1.1, unit="x",
         text="4 Gemma-2B layers: prefill >= 1.1x eager", group=E2E,
         headline="the same stack, prefill, vs eager"),
    dict(id="e2e-peak-eager", device="cuda", op="e2e_gemma2b", mode="train_step", where={},
         check="vs_provider_ge", other="eager", column="peak_mem_bytes", threshold=1.0, unit="x",
         text="4 Gemma-2B layers: training step peak memory <= eager's (ratio eager / ours)", group=E2E),
    dict(id="cpu-rms-fwd", device="cpu", threads=2, op="rms_norm", mode="fwd", where={"M": (">=", 64)},
         check="vs_provider_ge", other="eager", threshold=2.0, unit="x",
         text="CPU (2 cores): rms_norm fwd >= 2x eager PyTorch", group=CPU,
         headline="CPU (2 cores): rms_norm fwd, vs eager PyTorch"),
    dict(id="cpu-rms-bwd", device="cpu", threads=2, op="rms_norm", mode="bwd", where={"M": (">=", 64)},
         check="vs_provider_ge", other="eager", threshold=2.0, unit="x",
         text="CPU (2 cores): rms_norm bwd >= 2x eager PyTorch", group=CPU),
    dict(id="cpu-geglu", device="cpu", threads=2, op="geglu_act", mode="fwd", where={},
         check="vs_provider_ge", other="eager", threshold=2.0, unit="x",
         text="CPU (2 cores): geglu activation >= 2x eager PyTorch", group=CPU),
    # Decode (benchmarks/decode.py, decode.csv: op decode_<model>, mode = cache, provider eager = the plain model; the
    # ratio is the plain model's ms/token over the kernelized one's, same cell of the same run).
    *(row for model, name in DECODE_MODELS for row in (
        dict(id=f"decode-static-{model}", device="cuda", op=f"decode_{model}", mode="static",
             where={"batch": ("in", (1, 16))}, check="vs_provider_ge", other="eager", threshold=1.05, unit="x",
             text=f"decode, static cache + transformers' auto-compile (CUDA graphs), {name} shape, batch 1 and 16: "
                  "kernelized >= 1.05x the same model compiled without kernels", group=DECODE,
             headline=f"{name}-shaped decode, static cache + compile (CUDA graphs), vs the same model compiled"),
        dict(id=f"decode-static-any-{model}", device="cuda", op=f"decode_{model}", mode="static",
             where={"batch": ("in", (1, 4, 16, 64))}, check="vs_provider_ge", other="eager", threshold=1.0, unit="x",
             text=f"same, {name}: never slower than the plain compiled model at any benchmarked batch", group=DECODE),
        dict(id=f"decode-dynamic-{model}", device="cuda", op=f"decode_{model}", mode="dynamic", where={},
             check="vs_provider_ge", other="eager", threshold=1.25, unit="x", shapes=4,
             text=f"eager DynamicCache decode, {name} shape: kernelized >= 1.25x plain transformers, every batch",
             group=DECODE, headline=f"{name}-shaped decode, DynamicCache (eager), vs plain transformers"),
        dict(id=f"decode-dynamic-keep-{model}", device="cuda", op=f"decode_{model}", mode="dynamic", where={},
             check="vs_provider_ge", other="eager", threshold=1.10, unit="x", shapes=4,
             text=f"eager decode, {name} shape: kernelized >= 1.10x plain (met; keep)", group=DECODE))),
    # Small shapes by CUDA-graph device time (sweep.py --modes fwd_graph): ours vs Inductor's code for the package's
    # fp32 definition (*_reference), M/T in 1, 16, 64.
    *(row for op in GRAPH_TARGET_OPS for row in (
        dict(id=f"graph-{op}", device="cuda", op=op, mode="fwd_graph", where=_graph_where(op), shapes=9,
             check="vs_provider_ge", other="inductor", threshold=1.0, unit="x",
             text=f"{op} fwd, CUDA-graph device time, M/T 1..64: <= Inductor's code at every shape (required)",
             group=DECODE),
        dict(id=f"graph-{op}-goal", device="cuda", op=op, mode="fwd_graph", where=_graph_where(op), shapes=9,
             check="vs_provider_ge", other="inductor", threshold=1.25, unit="x",
             text=f"{op} fwd, same: <= 0.8x Inductor's time (goal; Inductor time / ours >= 1.25)", group=DECODE))),
    dict(id="graph-rms-m1", device="cuda", op="rms_norm", mode="fwd_graph", where={"M": ("==", 1), "N": ("<=", 4096)},
         check="all_le", column="time_p50_ms", threshold=0.002, unit="ms",
         text="rms_norm M=1, N <= 4096, CUDA-graph device time: <= 2.0 us", group=DECODE),
    # Prefill of the e2e stacks (benchmarks/e2e.py --providers ...,torch.compile,ours+torch.compile), both compiled.
    *(dict(id=f"e2e-prefill-compiled-{op}", device="cuda", op=op, mode="prefill", provider="ours+torch.compile",
           where={}, check="vs_provider_ge", other="torch.compile", threshold=1.10, unit="x",
           text=f"prefill under torch.compile, {op}: kernelized and compiled >= 1.10x the plain compiled stack",
           group=DECODE) for op in ("e2e_gemma2b", "e2e_llama3_8b", "e2e_llama3_2_1b")),
    # The Llama family through the fused gated GEMMs (I = 8192 in _epilogue.DISPATCH): prefill of 2 x 2048 tokens.
    dict(id="e2e-llama1b-prefill-eager", device="cuda", op="e2e_llama3_2_1b", mode="prefill", where={},
         provider="ours", check="vs_provider_ge", other="eager", threshold=1.25, unit="x",
         text="4 Llama-3.2-1B layers, prefill of 4096 tokens: kernelized >= 1.25x eager", group=E2E),
    dict(id="e2e-llama1b-prefill-compiled", device="cuda", op="e2e_llama3_2_1b", mode="prefill", where={},
         provider="ours", check="vs_provider_ge", other="torch.compile", threshold=1.15, unit="x",
         text="4 Llama-3.2-1B layers, prefill of 4096 tokens: kernelized >= 1.15x the plain stack under torch.compile",
         group=E2E),
    dict(id="e2e-llama8b-step-compile", device="cuda", op="e2e_llama3_8b", mode="train_step", where={},
         provider="ours", check="vs_provider_ge", other="torch.compile", threshold=1.05, unit="x",
         text="4 Llama-3-8B layers, 2x2048 tokens: training step >= 1.05x torch.compile", group=E2E),
]


# ---------------------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------------------


def _shape_val(row: dict[str, str], col: str) -> float | None:
    if col in ("TI", "MN"):
        a, b = (fnum(row.get(c)) for c in col)
        return None if a is None or b is None else a * b
    return fnum(row.get(col))


def _matches(row: dict[str, str], where: dict[str, tuple]) -> bool:
    for col, cond in where.items():
        v = _shape_val(row, col)
        if v is None:
            return False
        op, *vals = cond
        ok = {">=": lambda: v >= vals[0], "<=": lambda: v <= vals[0], "==": lambda: v == vals[0],
              "between": lambda: vals[0] <= v <= vals[1], "in": lambda: v in vals[0]}[op]()
        if not ok:
            return False
    return True


@dataclass
class Verdict:
    target: dict[str, Any]
    status: str                  # "met" | "not met" | "not measured"
    value: str = ""
    detail: str = ""
    runs: str = ""               # when and from which commit our rows behind the verdict were measured


def _fmt_value(v: float, unit: str) -> str:
    if unit == "bytes":
        return f"{v / 1e9:.2f} GB"
    if unit == "ms":
        return f"{v * 1e3:.1f} us" if v < 0.1 else f"{v:.3f} ms"
    if unit == "GB/s":
        return f"{v / 1e3:.2f} TB/s" if v >= 1000 else f"{v:.1f} GB/s"
    if unit == "x":
        return f"{v:.3f}x"
    if unit.startswith("%"):
        return f"{v:.1f}%"
    return f"{v:.4g}"


def _fmt_verdict(v: float, unit: str, target: dict[str, Any], ok: bool) -> str:
    """The worst value as the table shows it; a miss that rounds to the threshold gets more digits (0.9997x, not
    1.000x, under a >= 1.0x target)."""
    text = _fmt_value(v, unit)
    thr = target.get("threshold")
    if ok or thr is None or text != _fmt_value(thr, unit):
        return text
    if unit == "x":
        return f"{v:.5f}x"
    if unit == "ms" and v >= 0.1:
        return f"{v:.5f} ms"
    return f"{v:.6g}"


def _ok(r: dict[str, str]) -> bool:
    """A row that ran and passed its correctness check (``verified`` false: it ran but failed the 2x rule). Benchmarks
    without a check leave ``verified`` empty. benchmarks/epilogue.py's first CSV left status empty and recorded the
    check in ``verified``."""
    if r.get("verified") == "false":
        return False
    return r.get("status") == "ok" or (not r.get("status") and r.get("verified") == "true")


def _run(r: dict[str, str]) -> tuple[str, str]:
    """The run a row comes from (a run writes one start time and one revision into every row)."""
    return r.get("date_utc", ""), r.get("git_rev", "")


_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


def _dtype(r: dict[str, str]) -> str:
    """The row's dtype in one spelling (some CSVs write ``bfloat16``, most ``bf16``); "" when it has none."""
    d = (r.get("dtype") or "").removeprefix("torch.")
    return _DTYPE_NAMES.get(d, d)


def _runs(rows: list[dict[str, str]]) -> str:
    """`<date> <rev>` of the run the rows come from, or the span of dates when they come from several runs."""
    runs = sorted({(r.get("date_utc", "")[:10], r.get("git_rev", "")) for r in rows})
    if not runs:
        return ""
    if len(runs) == 1:
        return " ".join(x for x in runs[0] if x)
    if runs[0][0] == runs[-1][0]:  # one day: the revisions tell the runs apart
        return f"{runs[0][0]} ({len(runs)} runs: {', '.join(rev for _, rev in runs)})"
    return f"{runs[0][0]}..{runs[-1][0]} ({len(runs)} runs)"


# The GPU targets are stated for this GPU (docs/targets.md): rows of another one (an H100 CSV, should one be committed
# as evidence; a GH200) never enter a verdict.
TARGET_GPU = re.compile(r"\bH200\b")


def evaluate(target: dict[str, Any], rows: list[dict[str, str]]) -> Verdict:
    dev_rows = [r for r in rows if r.get("device") == target["device"] and r.get("op") == target["op"]
                and (target["device"] != "cuda" or TARGET_GPU.search(r.get("device_name", "")) is not None)
                and r.get("mode") == target["mode"] and _matches(r, target["where"])
                and (not target.get("where_any") or any(_matches(r, w) for w in target["where_any"]))
                and ("threads" not in target or r.get("threads") == str(target["threads"]))]
    prov = target.get("provider", "ours")
    measured = [r for r in dev_rows if r.get("provider") == prov and r.get("source") == "measured"
                and r.get("status") != "skipped" and not r.get("status", "").startswith("skipped")]
    ours = [r for r in measured if _ok(r)]
    # a cell (shape, dtype) whose every row of ours errored or failed its check: the target is not met there
    good = {(r["shape"], _dtype(r)) for r in ours}
    failed = sorted({r["shape"] + (f" {_dtype(r)}" if _dtype(r) else "") for r in measured
                     if (r["shape"], _dtype(r)) not in good})
    v = _evaluate(target, dev_rows, ours)
    if failed and v.status != "not measured":
        v.status = "not met"
        v.detail = f"{v.detail}; failed or errored at {', '.join(failed)}"
    if v.status != "not measured":
        v.runs = _runs(ours)
    return v


def _evaluate(target: dict[str, Any], dev_rows: list[dict[str, str]], ours: list[dict[str, str]]) -> Verdict:
    if not ours:
        return Verdict(target, "not measured")
    check = target["check"]
    unit = target.get("unit", "")
    col = target.get("column", "time_p50_ms")
    if check in ("all_ge", "all_le"):
        vals = [(fnum(r[col]), r["shape"]) for r in ours if fnum(r.get(col)) is not None]
        if not vals:
            return Verdict(target, "not measured")
        worst = min(vals) if check == "all_ge" else max(vals)
        ok = all((v >= target["threshold"]) if check == "all_ge" else (v <= target["threshold"]) for v, _ in vals)
        best = max(vals) if check == "all_ge" else min(vals)
        detail = f"worst at {worst[1]}" + (f"; best {_fmt_value(best[0], unit)}" if len(vals) > 1 else "")
        n_shapes = len({w for _, w in vals})
        return Verdict(target, "met" if ok else "not met", _fmt_verdict(worst[0], unit, target, ok),
                       f"{detail}; {n_shapes} shapes")
    # A row is compared with the rows of its own shape and dtype only (a CSV holds fp32 and bf16 rows of one shape).
    by_cell = defaultdict(list)
    for r in dev_rows:
        if _ok(r):
            by_cell[(r["shape"], _dtype(r))].append(r)
    dtypes = {_dtype(r) for r in ours}

    def where(r: dict[str, str]) -> str:
        return f"{r['shape']} {_dtype(r)}" if len(dtypes) > 1 else r["shape"]

    # Anchors come from the run of the row they are compared with (docs/targets.md: "measured in the same run");
    # recorded anchors (quack's numbers) from anywhere. An ours row with no comparison is named, not dropped: a
    # target over every benchmarked shape is not met on a subset.
    ratios: list[tuple[float, str, str]] = []
    unpaired: list[str] = []
    for r in ours:
        peers = [p for p in by_cell[(r["shape"], _dtype(r))]
                 if _run(p) == _run(r) or (check == "vs_best_ge" and p.get("source") != "measured")]
        if check == "vs_provider_ge":
            other = next((p for p in peers if p["provider"] == target["other"] and p.get("source") == "measured"), None)
            if other is None or fnum(other.get(col)) is None or not fnum(r.get(col)):
                unpaired.append(where(r))
                continue
            # time or memory: other / ours >= threshold (ours faster or leaner)
            ratios.append((fnum(other[col]) / fnum(r[col]), where(r), target["other"]))
        elif check == "vs_best_ge":
            anchors = [p for p in peers if p.get("role") == "anchor" and fnum(p.get("time_p50_ms"))
                       and (p.get("source") == "measured" or target.get("recorded"))]
            if not anchors:
                unpaired.append(where(r))
                continue
            best = min(anchors, key=lambda p: fnum(p["time_p50_ms"]))
            ratios.append((fnum(best["time_p50_ms"]) / fnum(r["time_p50_ms"]), where(r), best["provider"]))
        elif check == "err_le_provider":
            other = next((p for p in peers if p["provider"] == target["other"]), None)
            if other is None or fnum(other.get("max_err")) is None or fnum(r.get("max_err")) is None:
                unpaired.append(where(r))
                continue
            e_ours, e_other = fnum(r["max_err"]), fnum(other["max_err"])
            ratios.append((e_other - e_ours, where(r), f"ours {e_ours:.4g} vs {e_other:.4g}"))
    if not ratios:
        return Verdict(target, "not measured", detail="no comparison row in the CSV")
    if unpaired:
        worst = min(ratios)
        shown = _fmt_value(worst[0], "x") if check != "err_le_provider" else worst[2]
        return Verdict(target, "not met", shown,
                       f"worst at {worst[1]}; no same-run comparison at {', '.join(sorted(set(unpaired)))}")
    worst = min(ratios)
    if check == "err_le_provider":
        ok = all(d >= 0 for d, _, _ in ratios)
        return Verdict(target, "met" if ok else "not met", worst[2], f"at {worst[1]}")
    ok = all(v >= target["threshold"] for v, _, _ in ratios)
    # how many shapes the target names: "shapes", else the values of a `where` "in" filter (e.g. batch 1 and 16)
    expect = target.get("shapes") or next((len(c[1]) for c in target["where"].values() if c[0] == "in"), None)
    n_shapes = len({w for _, w, _ in ratios})  # a shape measured in two runs counts once (both ratios count)
    if expect and n_shapes < expect:  # a target over every benchmarked size is met only when all were measured
        return Verdict(target, "not met", _fmt_value(worst[0], "x"),
                       f"worst at {worst[1]} (vs {worst[2]}); only {n_shapes} of {expect} shapes measured")
    return Verdict(target, "met" if ok else "not met", _fmt_verdict(worst[0], "x", target, ok),
                   f"worst at {worst[1]} (vs {worst[2]}); {n_shapes} shapes")


# ---------------------------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------------------------

PROVIDER_ORDER = ["ours", "eager", "torch.nn.RMSNorm", "torch.compile", "liger", "quack", "quack (recorded, not run)",
                  "torch._addmm_activation", "mm only", "ours+torch.compile"]


def _provider_key(p: str) -> tuple[int, str]:
    return (PROVIDER_ORDER.index(p) if p in PROVIDER_ORDER else len(PROVIDER_ORDER), p)


def _cell(r: dict[str, str] | None, metric_col: str) -> str:
    if r is None:
        return ""
    if r.get("status") != "ok":
        s = r.get("status", "")
        return "error" if s.startswith("error") else ("skipped" if s.startswith("skipped") else s[:12])
    t = fnum(r.get("time_p50_ms"))
    v = fnum(r.get(metric_col))
    ts = "" if t is None else (f"{t * 1e3:.1f} us" if t < 1 else f"{t:.2f} ms")
    if v is None:
        return ts
    vs = f"{v / 1e3:.2f} TB/s" if metric_col == "gbps" and v >= 1000 else (
        f"{v:.0f} GB/s" if metric_col == "gbps" else (f"{v:.0f} tok/s" if metric_col == "tokens_per_s" else
                                                      f"{v:.0f} TFLOP/s"))
    return f"{ts} ({vs})"


def _metric_col(rows: Iterable[dict[str, str]]) -> str:
    for r in rows:
        if fnum(r.get("gbps")) is not None:
            return "gbps"
        if fnum(r.get("tflops")) is not None:
            return "tflops"
        if fnum(r.get("tokens_per_s")) is not None:
            return "tokens_per_s"
    return "gbps"


def decode_tables(rows: list[dict[str, str]]) -> list[str]:
    """decode.csv: per device and model, ms per decoded token of the plain and the kernelized model for every (cache,
    batch), their ratio, the GPU busy time per token of both (where measured), the kernelized model's token
    agreement with the plain one (and the plain model's own static-vs-dynamic agreement, the scale to read it
    against), compile time and graph breaks / CUDA-graph skips."""
    cells: dict[tuple[str, str], dict[tuple[str, int], dict[str, dict[str, str]]]] = defaultdict(dict)
    for r in rows:
        if "ms_per_token" in r and r.get("status") == "ok" and r.get("model"):
            cells[(r["device_name"], r["model"])].setdefault((r["cache"], int(r["batch"])), {})[r["provider"]] = r
    out: list[str] = []
    for (dev, model), by_cell in sorted(cells.items()):
        first = next(iter(next(iter(by_cell.values())).values()))
        out += [f"**decode · {model}** ({first.get('layers')} layers, hidden {first.get('hidden')}, intermediate "
                f"{first.get('intermediate')}, vocab {first.get('vocab')}; {first.get('dtype')}; "
                f"{first.get('prompt_len')}-token prompt, greedy, ms/token over {first.get('new_tokens')} new tokens, "
                f"{first.get('rounds')} interleaved rounds) · {dev}", "",
                "| cache | batch | plain ms/token | kernelized ms/token | kernelized vs plain | GPU busy ms/token plain / "
                "kernelized (vs plain) | tokens equal to plain | plain: static vs dynamic tokens "
                "| compile s plain / kernelized | graph breaks / CUDA-graph skips |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for (cache, batch), by in sorted(by_cell.items(), key=lambda kv: (kv[0][0] != "static", kv[0][1])):
            e, o = by.get("eager", {}), by.get("ours", {})
            fe, fo = fnum(e.get("ms_per_token")), fnum(o.get("ms_per_token"))

            def num(v: float | None, fmt: str) -> str:
                return "" if v is None else format(v, fmt)

            label = "static + compile" if cache == "static" else "dynamic (eager)"
            comp = " / ".join(num(fnum(x.get("compile_s")), ".1f") or "-" for x in (e, o)) if cache == "static" else ""
            flags = " / ".join(str(int(fnum(o.get(k)) or 0)) for k in ("graph_breaks", "cudagraph_skips")) if o else ""
            ratio = f"{fe / fo:.3f}x" if fe and fo else ""
            agree = num(fnum(o.get("tokens_equal")), ".0%")
            plain_agree = num(fnum(e.get("tokens_equal_vs_dynamic")), ".0%")
            be, bo = fnum(e.get("gpu_busy_ms_per_token")), fnum(o.get("gpu_busy_ms_per_token"))
            busy = f"{be:.3f} / {bo:.3f} ({be / bo:.3f}x)" if be and bo else ""
            out.append(f"| {label} | {batch} | {num(fe, '.3f')} | {num(fo, '.3f')} | {ratio} | {busy} | {agree} | "
                       f"{plain_agree} | {comp} | {flags} |")
        out.append("")
    return out


def op_tables(rows: list[dict[str, str]], *, max_shapes: int | None) -> list[str]:
    """One markdown table per (device, op, dtype, mode): shapes x providers, median time (throughput)."""
    out: list[str] = []
    groups: dict[tuple[str, str, str, str], list[dict[str, str]]] = defaultdict(list)
    for r in rows:
        if r.get("op") in ("ceiling", "") or not r.get("mode") or not r.get("shape") or "ms_per_token" in r:
            continue  # decode.csv rows have their own table (decode_tables)
        groups[(r["device_name"], r["op"], r["dtype"], r["mode"])].append(r)
    mode_order = {"fwd": 0, "bwd": 1, "fwd+bwd": 2, "train_step": 3, "prefill": 4}
    for (dev, op, dtype, mode), grp in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2],
                                                                             mode_order.get(kv[0][3], 9))):
        shapes: list[str] = []
        for r in grp:
            if r["shape"] not in shapes and (r.get("source") == "measured"):
                shapes.append(r["shape"])
        if not shapes:
            continue
        total = len(shapes)
        if max_shapes:
            shapes = shapes[:max_shapes]
        providers = sorted({r["provider"] for r in grp if r["provider"] != "*"}, key=_provider_key)
        metric_col = _metric_col(grp)
        cell = {(r["shape"], r["provider"]): r for r in grp}
        has_peak = any(fnum(r.get("peak_mem_bytes")) for r in grp)
        out.append(f"**{op}** · {mode} · {dtype} · {dev}" + (f" (first {len(shapes)} of {total} shapes; all in "
                                                              f"the full report)" if len(shapes) < total else ""))
        out.append("")
        head = ["shape"] + providers + ["ours vs best anchor", "ours max err (✓: 2x rule)"] + (["peak ours"] if has_peak
                                                                                        else [])
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for s in shapes:
            ours = cell.get((s, "ours"))
            sp = fnum(ours.get("speedup_vs_best_anchor")) if ours else None
            sp_s = f"{sp:.2f}x vs {ours.get('best_anchor')}" if sp else ""
            err = ""
            if ours and ours.get("max_err"):
                err = f"{fnum(ours['max_err']):.3g}" + {"true": " ✓", "false": " ✗"}.get(ours.get("verified", ""), "")
            line = [s] + [_cell(cell.get((s, p)), metric_col) for p in providers] + [sp_s, err]
            if has_peak:
                pk = fnum(ours.get("peak_mem_bytes")) if ours else None
                line.append(f"{pk / 1e9:.2f} GB" if pk else "")
            out.append("| " + " | ".join(line) + " |")
        out.append("")
    return out


def summary_table(rows: list[dict[str, str]]) -> list[str]:
    """Per (device, op, dtype, mode): shapes measured, ours' speedup over the best in-run anchor (geometric mean,
    worst, best) and ours' median share of the ceiling."""
    groups: dict[tuple[str, str, str, str], list[dict[str, str]]] = defaultdict(list)
    for r in rows:
        if r.get("provider") == "ours" and r.get("status") == "ok" and r.get("source") == "measured":
            groups[(r["device_name"], r["op"], r["dtype"], r["mode"])].append(r)
    if not groups:
        return []
    out = ["| device | op | dtype | mode | shapes | ours vs best anchor: geomean (worst .. best) | ours % of ceiling "
           "(median) |", "|---|---|---|---|---|---|---|"]
    mode_order = {"fwd": 0, "bwd": 1, "fwd+bwd": 2, "train_step": 3, "prefill": 4}
    for key in sorted(groups, key=lambda k: (k[0], k[1], k[2], mode_order.get(k[3], 9))):
        grp = groups[key]
        sp = sorted(v for v in (fnum(r.get("speedup_vs_best_anchor")) for r in grp) if v)
        pct = sorted(v for v in (fnum(r.get("pct_of_ceiling")) for r in grp) if v is not None)
        gm = math.exp(sum(math.log(v) for v in sp) / len(sp)) if sp else None
        sp_s = f"{gm:.2f}x ({sp[0]:.2f}x .. {sp[-1]:.2f}x)" if sp else ""
        pct_s = f"{pct[len(pct) // 2]:.0f}%" if pct else ""
        out.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {len(grp)} | {sp_s} | {pct_s} |")
    return out


def environment_lines(rows: list[dict[str, str]]) -> list[str]:
    out = []
    seen = set()
    for r in rows:
        key = (r.get("device_name"), r.get("torch"), r.get("git_rev"), r.get("kernel_build"))
        if key in seen or not r.get("device_name"):
            continue
        seen.add(key)
        bits = [f"**{r['device_name']}**", f"torch {r.get('torch')}"]
        for k in ("triton", "cuda", "liger", "transformers", "kernels"):
            if r.get(k):
                bits.append(f"{k} {r[k]}")
        if r.get("device") == "cpu":
            bits.append(f"{r.get('threads')} threads, load avg {r.get('load_avg') or '?'} at start")
        bits.append(f"git {r.get('git_rev')}, kernel build `{r.get('kernel_build')}`, {r.get('date_utc')}")
        out.append("- " + ", ".join(bits))
    ceil = [r for r in rows if r.get("op") == "ceiling" and r.get("status") == "ok"]
    for r in ceil:
        if r["provider"] == "device copy":
            out.append(f"- ceiling on {r['device_name']}: device copy {fnum(r['gbps']):.0f} GB/s (read + write)")
        else:
            out.append(f"- ceiling on {r['device_name']}: {r['dtype']} GEMM {r['shape']} "
                       f"{fnum(r['tflops']):.2f} TFLOP/s")
    return out


def slug(heading: str) -> str:
    """The anchor GitHub gives a markdown heading (lower case, punctuation dropped, spaces to hyphens)."""
    return "".join(c for c in heading.lower() if c.isalnum() or c in " -_").replace(" ", "-")


def render(rows: list[dict[str, str]], *, max_shapes: int | None, tables: bool = True,
           full_report: str | None = None, targets_link: str = "docs/targets.md") -> str:
    """The results section: environment, every target's verdict (its id linking to docs/targets.md), the summary,
    then per-op tables (``tables``) or a link to the full report."""
    verdicts = [evaluate(t, rows) for t in TARGETS]
    lines = ["## Measured results", "",
             "Generated by `benchmarks/report.py` from the CSVs under `benchmarks/results/` (no number typed by "
             "hand). Times are medians of `triton.testing.do_bench` (CUDA events, L2 flushed before every call) "
             "on the GPU and of per-call timers on the CPU; small shapes include launch and Python overhead, as a "
             "user sees them. `bwd` = (fwd+bwd) - fwd. Anchors were measured in the same run except rows labelled "
             "recorded.", ""]
    lines += environment_lines(rows) + [""]
    met = sum(v.status == "met" for v in verdicts)
    measured = sum(v.status != "not measured" for v in verdicts)
    lines += [f"### Targets ({met} met of {measured} measured; {len(verdicts)} in all)", "",
              "| target | id | status | measured | where | run (ours) |", "|---|---|---|---|---|---|"]
    for v in verdicts:
        ref = f"[{v.target['id']}]({targets_link}#{slug(v.target['group'])})"
        lines.append(f"| {v.target['text']} | {ref} | {ICON[v.status]} | {v.value} | {v.detail} | {v.runs} |")
    summary = summary_table(rows)
    if summary:
        lines += ["", "### Summary", ""] + summary
    decode = decode_tables(rows)
    if decode:
        lines += ["", "### Decode (generate)", ""] + decode
    if tables:
        lines += ["", "### Per op", ""]
        lines += op_tables(rows, max_shapes=max_shapes)
    elif full_report:
        label = os.path.normpath(full_report).lstrip("./") if full_report.startswith("..") else full_report
        lines += ["", f"Every shape and provider: [{label}]({full_report}); plots next to the CSVs in "
                  "`benchmarks/results/<device>/`."]
    return "\n".join(lines).rstrip() + "\n"


ICON = {"met": "✅ met", "not met": "❌ not met", "not measured": "· not measured"}


def _fmt_threshold(target: dict[str, Any]) -> str:
    if target["check"] == "err_le_provider":
        return f"<= {target['other']}'s error"
    if target["check"] == "vs_best_ge":
        return f">= {target['threshold']:g}x the best anchor"
    if target["check"] == "vs_provider_ge":
        return f">= {target['threshold']:g}x"
    op = ">=" if target["check"] == "all_ge" else "<="
    unit = target.get("unit", "")
    return f"{op} {target['threshold']:g}%" if unit.startswith("%") else f"{op} {_fmt_value(target['threshold'], unit)}"


def headline(rows: list[dict[str, str]], *, results_link: str) -> str:
    """The README's status block: how many targets are met, and the targets marked ``headline`` (their worst shape)."""
    verdicts = [evaluate(t, rows) for t in TARGETS]
    met = sum(v.status == "met" for v in verdicts)
    measured = sum(v.status != "not measured" for v in verdicts)
    devices = sorted({r["device_name"] for r in rows if r.get("device_name") and r.get("op") != "ceiling"},
                     key=lambda d: ("H200" not in d, d))
    lines = [f"**{met} of {measured} measured targets met** on {' and '.join(devices)}. Generated by "
             f"`benchmarks/report.py` from the committed CSVs; every target, shape and anchor: "
             f"[{Path(results_link).name}]({results_link}).", "",
             "| workload | measured (worst shape) | target | status |", "|---|---|---|---|"]
    for v in verdicts:
        if v.target.get("headline"):
            lines.append(f"| {v.target['headline']} | {v.value or '—'} | {_fmt_threshold(v.target)} | "
                         f"{ICON[v.status]} |")
    return "\n".join(lines) + "\n"


def scale_table(rows: list[dict[str, str]]) -> list[str]:
    """Markdown from ``benchmarks/scale.py``'s ``scale.csv``: training tokens/s per GPU per (engine, world), eager vs
    kernelized, the kernelized/eager ratio and the scaling efficiency (per-GPU tokens/s on N GPUs over 1 GPU, same
    engine and variant). Every number comes from the CSV."""
    if not rows:
        return ["(no rows)"]
    val: dict[tuple[str, int, bool], dict[str, str]] = {}
    for r in rows:
        val[(r["engine"], int(r["world"]), r["kernelized"] == "true")] = r

    def tps(key: tuple[str, int, bool]) -> float | None:
        r = val.get(key)
        return fnum(r["tokens_per_s_per_gpu"]) if r else None

    def num(v: float | None, fmt: str) -> str:
        return "—" if v is None else format(v, fmt)

    r0 = rows[0]
    unit = "GPU" if r0.get("device") == "cuda" else "process"
    lines = [f"{r0.get('gpu_name', '')} ({r0.get('device', '')}), Gemma-shaped model: hidden {r0.get('hidden')}, "
             f"intermediate {r0.get('intermediate')}, {r0.get('layers')} layers, {r0.get('heads')} heads / "
             f"{r0.get('kv_heads')} KV, head_dim {r0.get('head_dim')}, vocab {r0.get('vocab')} "
             f"({r0.get('params_m')} M parameters); {r0.get('batch')} x {r0.get('seq')} tokens per {unit} and step, "
             f"{r0.get('dtype')}, AdamW, {r0.get('steps')} timed steps after {r0.get('warmup')} warm-up; "
             f"git {r0.get('git_rev', '')}.", "",
             f"| engine | {unit}{'es' if unit == 'process' else 's'} | eager tokens/s/{unit} | "
             f"kernelized tokens/s/{unit} | kernelized / eager | "
             "scaling eff. eager | scaling eff. kernelized | step ms eager / kernelized | peak GB eager / kernelized |",
             "|---|---|---|---|---|---|---|---|---|"]
    engines = sorted({k[0] for k in val}, key=lambda e: (e != "ddp", e))
    for engine in engines:
        for world in sorted({k[1] for k in val if k[0] == engine}):
            e, k = tps((engine, world, False)), tps((engine, world, True))
            ratio = k / e if e and k else None
            eff = []
            for kern in (False, True):
                one, here = tps((engine, 1, kern)), tps((engine, world, kern))
                eff.append(here / one if world > 1 and one and here else None)
            step = [fnum(val[(engine, world, kern)]["step_ms_median"]) if (engine, world, kern) in val else None
                    for kern in (False, True)]
            peak = [fnum(val[(engine, world, kern)]["peak_mem_gb"]) if (engine, world, kern) in val else None
                    for kern in (False, True)]
            ratio_s = "—" if ratio is None else f"{ratio:.3f}x"
            lines.append(f"| {engine} | {world} | {num(e, ',.0f')} | {num(k, ',.0f')} | {ratio_s} | "
                         f"{num(eff[0], '.1%')} | {num(eff[1], '.1%')} | {num(step[0], '.1f')} / "
                         f"{num(step[1], '.1f')} | {num(peak[0], '.2f')} / {num(peak[1], '.2f')} |")
    return lines


def write_section(path: Path, section: str) -> None:
    """Replace the text between the results markers of ``path`` (append the markers when it has none)."""
    text = path.read_text() if path.exists() else ""
    block = f"{START}\n{section}{END}"
    if START in text and END in text:
        head, rest = text.split(START, 1)
        _, tail = rest.split(END, 1)
        text = head + block + tail
    else:
        text = text.rstrip() + ("\n\n" if text else "") + "## Results\n\n" + block + "\n"
    path.write_text(text)


def _link(target: Path, page: Path) -> str:
    """``target`` relative to the directory of ``page`` (both as given on the command line)."""
    return os.path.relpath(target.resolve(), page.resolve().parent)


def generated(rows: list[dict[str, str]], *, out: Path | None = None, results: Path | None = None,
              readme: Path | None = None, results_tables: bool = False,
              results_shapes: int = 8) -> dict[Path, str]:
    """What each page gets: ``out`` the whole text, ``results`` and ``readme`` the text between their markers (links
    relative to each page). tests/packaging/test_docs.py compares the committed pages with this."""
    targets_md = ROOT / "docs" / "targets.md"
    pages: dict[Path, str] = {}
    if out:
        pages[out] = render(rows, max_shapes=None, targets_link=_link(targets_md, out))
    if results:
        pages[results] = render(rows, max_shapes=results_shapes, tables=results_tables,
                                full_report=_link(out, results) if out else None,
                                targets_link=_link(targets_md, results))
    if readme:
        if not results:
            raise ValueError("the README's status block links to the results page: give both")
        pages[readme] = headline(rows, results_link=_link(results, readme))
    return pages


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv", nargs="*", type=Path)
    p.add_argument("--scale", type=Path, help="print the markdown table of benchmarks/scale.py's scale.csv and exit")
    p.add_argument("--out", type=Path, help="write the full report (all shapes) here")
    p.add_argument("--write-results", type=Path, metavar="PAGE",
                   help="replace the generated section of this results page (docs/results.md)")
    p.add_argument("--write-readme", type=Path, metavar="README",
                   help="replace the generated status block of this README (needs --write-results: it links there)")
    p.add_argument("--results-tables", action="store_true", help="also put per-op tables (first --results-shapes "
                   "shapes each) on the results page; by default it gets the targets and the summary and links --out")
    p.add_argument("--results-shapes", type=int, default=8, help="shapes per table on the results page (default 8)")
    args = p.parse_args(argv)
    if args.scale:
        print("\n".join(scale_table(read_rows(args.scale))))
        return 0
    if not args.csv:
        p.error("give the benchmark CSVs (or --scale scale.csv)")
    if args.write_readme and not args.write_results:
        p.error("--write-readme links to the results page: give --write-results too")
    rows: list[dict[str, str]] = []
    for c in args.csv:
        rows += read_rows(c)
    if not (args.out or args.write_results):
        sys.stdout.write(render(rows, max_shapes=None))
        return 0
    pages = generated(rows, out=args.out, results=args.write_results, readme=args.write_readme,
                      results_tables=args.results_tables, results_shapes=args.results_shapes)
    for path, text in pages.items():
        if path == args.out:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
        else:
            write_section(path, text)
            print(f"updated {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
