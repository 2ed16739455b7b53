"""benchmarks/decode.py end to end on the CPU (``--device cpu --quick``): tiny fp32 Llama-, Gemma- and Qwen3-shaped
models, batch 1 and 2, plain and kernelized, DynamicCache and the compiled static cache; a complete CSV, the plot and
the table. The compiled cells use ``--backend aot_eager`` here (the same transformers auto-compile path and Dynamo
capture; Inductor's C++ code generation would add 15-45 s per graph on 2 cores, and this run compiles 12 graphs).
About 60 s of CPU time."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

from conftest import ROOT

MODELS = ("llama3_2_1b", "gemma2b", "qwen3_1_7b")


def test_decode_benchmark_cpu_quick(tmp_path):
    env = {**os.environ, "FUSED_MLP_GIT_REV": "test-rev"}
    env.pop("OUT", None)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--device", "cpu", "--quick", "--backend",
           "aot_eager", "--results-root", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"decode.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    (csv_path,) = tmp_path.glob("cpu-*/decode.csv")
    with csv_path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    for col in ("model", "batch", "cache", "compiled", "provider", "ms_per_token"):
        assert col in rows[0], col
    by = {(r["model"], r["cache"], r["batch"], r["provider"]): r for r in rows}
    expected = {(m, c, b, p) for m in MODELS for c in ("static", "dynamic") for b in ("1", "2")
                for p in ("eager", "ours")}
    assert len(rows) == len(expected) and set(by) == expected, sorted(by)
    for (model, cache, batch, prov), r in by.items():
        assert r["status"] == "ok", r
        assert r["device"] == "cpu" and r["dtype"] == "fp32" and r["git_rev"] == "test-rev", r
        assert r["compiled"] == ("true" if cache == "static" else "false"), r
        ms = float(r["ms_per_token"])
        assert ms > 0 and float(r["ms_per_token_p20"]) <= ms <= float(r["ms_per_token_p80"]), r
        assert int(r["graph_breaks"]) == 0, r
        assert r["gpu_busy_ms_per_token"] == "" and r["busy_speedup_vs_plain"] == "", r  # CUDA only
        if cache == "static":
            # transformers compiled the decode step once per provider and cell (batch 1: a static graph; batch 2:
            # one with a dynamic batch dim), with no recompile over the decode steps and the timed calls
            assert int(r["graphs"]) == 1, r
            # the guard checks before each compiled step, host time per token (measured on every device)
            assert float(r["dynamo_lookup_us_per_token"]) > 0, r
            # fp32: the plain model's DynamicCache tokens again (rounding-level differences cannot flip greedy here)
            assert float(r["tokens_equal_vs_dynamic"]) == 1.0, r
        else:
            assert int(r["graphs"]) == 0 and r["dynamo_lookup_us_per_token"] == "", r
        if prov == "ours":
            assert "GeGLUMLPx2" in r["note"] and "RMSNorm" in r["note"], r  # the layers really were swapped in
            assert float(r["tokens_equal"]) == 1.0 and r["first_mismatch"] == "", r
            plain = by[(model, cache, batch, "eager")]
            ratio = float(plain["ms_per_token"]) / ms
            assert abs(float(r["speedup_vs_plain"]) - ratio) <= 1e-4 * ratio, (r, plain)
    assert "ours/plain" in proc.stdout and "Dynamo lookup us/token" in proc.stdout
    assert (csv_path.parent / "decode.png").stat().st_size > 1000
