"""benchmarks/plot.py on decode_stack.csv (the GPU benchmark's CSV; decode_stack.py itself needs a GPU): the recorded
H200 CSV and a one-model subset of it draw ``decode_stack.png``; plot.py's CLI routes the CSV there; the crossover
rule the benchmark prints."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest
from conftest import ROOT

CSV = ROOT / "benchmarks" / "results" / "nvidia-h200" / "decode_stack.csv"
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_plot_draws_the_recorded_csv(tmp_path):
    pytest.importorskip("matplotlib")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plot.py"), str(CSV), "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "decode_stack.png" in proc.stdout
    assert (tmp_path / "decode_stack.png").stat().st_size > 10000


def test_plot_subset_and_nothing_to_draw(tmp_path):
    pytest.importorskip("matplotlib")
    from plot import plot_decode_stack

    with CSV.open(newline="") as f:
        rows = list(csv.DictReader(f))
    one = [r for r in rows if r["op"] == "decode_stack_gemma2b"]
    assert one and plot_decode_stack(one, tmp_path) == tmp_path / "decode_stack.png"
    assert (tmp_path / "decode_stack.png").stat().st_size > 5000
    assert plot_decode_stack([dict(r, status="error") for r in one], tmp_path / "none") is None


def test_recorded_csv_has_every_provider_verified():
    with CSV.open(newline="") as f:
        rows = list(csv.DictReader(f))
    cells = {(r["op"], r["T"]): set() for r in rows}
    for r in rows:
        assert r["status"] == "ok" and r["verified"].lower() == "true", r
        cells[(r["op"], r["T"])].add(r["provider"])
    assert cells and all(p == {"cublas", "lin", "mlp", "both"} for p in cells.values())


def test_crossover_is_the_last_t_of_the_first_winning_run():
    from decode_stack import crossover

    assert crossover({1: 0.8, 2: 0.9, 4: 0.99, 8: 1.01, 16: 0.95}) == 4
    assert crossover({1: 1.0, 2: 0.5}) == 0
    assert crossover({8: 0.9, 1: 0.7}) == 8
