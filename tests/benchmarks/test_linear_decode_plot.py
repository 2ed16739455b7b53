"""benchmarks/plot.py on linear_decode.csv (the GPU benchmark's CSV; linear_decode.py itself needs a GPU): the
recorded H200 CSV and a one-model subset of it draw ``linear_decode.png``; plot.py's CLI routes the CSV there."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest
from conftest import ROOT

CSV = ROOT / "benchmarks" / "results" / "nvidia-h200" / "linear_decode.csv"
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_plot_draws_the_recorded_csv(tmp_path):
    pytest.importorskip("matplotlib")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plot.py"), str(CSV), "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "linear_decode.png" in proc.stdout
    assert (tmp_path / "linear_decode.png").stat().st_size > 10000


def test_plot_subset_and_nothing_to_draw(tmp_path):
    pytest.importorskip("matplotlib")
    from plot import plot_linear_decode

    with CSV.open(newline="") as f:
        rows = list(csv.DictReader(f))
    one = [r for r in rows if r["op"].startswith("linear_decode_gemma2b_")]
    assert one and plot_linear_decode(one, tmp_path) == tmp_path / "linear_decode.png"
    assert (tmp_path / "linear_decode.png").stat().st_size > 5000
    assert plot_linear_decode([dict(r, status="error") for r in one], tmp_path / "none") is None
