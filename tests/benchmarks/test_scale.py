"""benchmarks/scale.py end to end on the CPU: the launcher runs every (world in 1, 2; engine in ddp, fsdp2;
eager / kernelized) under torch.distributed.run (gloo, tiny Gemma-shaped model, fp32) and writes a complete CSV and
plot. About 50 s on 2 idle cores (~70 s under load): process start-up (importing torch and transformers; 4
launches, 6 processes) dominates; eager and kernelized share each launch on the CPU."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys

from conftest import ROOT


def test_scale_benchmark_cpu_quick(tmp_path):
    out = tmp_path / "scale"
    env = {**os.environ, "FUSED_MLP_GIT_REV": "test-rev"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--device", "cpu", "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"scale.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    with (out / "scale.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    by = {(r["world"], r["engine"], r["kernelized"]): r for r in rows}
    expected = {(w, e, k) for w in ("1", "2") for e in ("ddp", "fsdp2") for k in ("false", "true")}
    assert len(rows) == len(expected) and set(by) == expected, sorted(by)
    for key, r in by.items():
        assert r["device"] == "cpu" and r["dtype"] == "fp32" and r["git_rev"] == "test-rev", r
        total, per = float(r["tokens_per_s_total"]), float(r["tokens_per_s_per_gpu"])
        assert total > 0 and per > 0 and float(r["step_ms_median"]) > 0, r
        assert math.isclose(per * int(r["world"]), total, rel_tol=1e-3), r
        assert math.isfinite(float(r["loss_first"])) and math.isfinite(float(r["loss_last"])), r
        if r["kernelized"] == "true":
            # The fused layers really ran, on every step (no fallback to the module's own math).
            assert "GemmaRMSNorm:" in r["kernel_modules"] and "GeGLUMLP:" in r["kernel_modules"], r
            assert r["fallbacks"] == "", r
            eager = by[(key[0], key[1], "false")]
            # Same weights, same data, fp32: the first loss agrees to rounding.
            a, b = float(eager["loss_first"]), float(r["loss_first"])
            assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (key, a, b)
        else:
            assert r["kernel_modules"] == "", r
    # The table with ratios is printed; the plot exists.
    assert "kernelized / eager" in proc.stdout and "scaling eff." in proc.stdout
    assert (out / "scale.png").stat().st_size > 1000
