"""benchmarks/e2e.py end to end on the CPU (``--tiny``): two tiny fp32 stacks (Gemma- and Llama-shaped), eager and
kernelized, timed in 2 interleaved rounds; a complete CSV with the rounds noted, the kernelized layers named, the loss
against eager's and each provider's own peak memory left empty off CUDA. About 20 s of CPU time."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys

from conftest import ROOT


def test_e2e_benchmark_cpu_tiny(tmp_path):
    env = {**os.environ, "FUSED_MLP_GIT_REV": "test-rev"}
    env.pop("OUT", None)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "e2e.py"), "--tiny", "--device", "cpu", "--models",
           "gemma2b,llama3_2_1b", "--providers", "eager,ours", "--rounds", "2", "--rep-ms", "40", "--warmup-ms", "10",
           "--results-root", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"e2e.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    (csv_path,) = tmp_path.glob("cpu-*/e2e.csv")
    with csv_path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    by = {(r["op"], r["provider"], r["mode"]): r for r in rows}
    expected = {(f"e2e_{m}", p, mode) for m in ("gemma2b", "llama3_2_1b") for p in ("eager", "ours")
                for mode in ("train_step", "prefill")}
    assert set(by) == expected, sorted(by)
    for (op, prov, mode), r in by.items():
        assert r["status"] == "ok" and r["git_rev"] == "test-rev" and r["dtype"] == "bf16", r
        p50 = float(r["time_p50_ms"])
        assert 0 < float(r["time_p20_ms"]) <= p50 <= float(r["time_p80_ms"]), r
        host = re.search(r"; host ([0-9.]+) ms per call", r["note"])  # each call's host time (e2e-host-cost)
        assert host and float(host.group(1)) > 0, r["note"]
        assert "2 interleaved rounds" in r["note"], r
        assert r["peak_mem_bytes"] == "", r  # CUDA only
        if prov == "ours":
            assert "GeGLUMLP x2" in r["note"] and "RMSNorm x5" in r["note"], r  # the layers were swapped in
            assert float(r["max_err"]) < 0.05, r  # the loss against eager's (bf16, a tiny random model)
        best = by[(op, "eager", mode)]
        assert abs(float(r["speedup_vs_best_anchor"]) - float(best["time_p50_ms"]) / p50) <= 1e-4 * 10, (r, best)
