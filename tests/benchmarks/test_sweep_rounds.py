"""benchmarks/sweep.py's interleaved timing rounds: how per-round Timings become one row, and how a round's share of
the timer is set. Pure functions, no kernel build needed."""

from __future__ import annotations

import importlib
import sys

import pytest
from conftest import ROOT


@pytest.fixture(scope="module")
def sweep():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        yield importlib.import_module("sweep")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_one_round_is_unchanged(sweep):
    t = sweep.Timing(1.0, 2.0, 5.0)
    assert sweep.combine_rounds([t]) == t


def test_rounds_combine_median_of_medians_and_outer_band(sweep):
    T = sweep.Timing
    # One noisy round (the middle one): the median ignores it, the band shows it.
    rounds = [T(1.0, 1.1, 1.2), T(2.0, 3.0, 4.0), T(0.9, 1.0, 1.3)]
    c = sweep.combine_rounds(rounds)
    assert c.p50 == pytest.approx(1.1)
    # p20 = 20th percentile of the p20s (0.9, 1.0, 2.0): 0.9 + 0.4 * (1.0 - 0.9); p80 = 80th of (1.2, 1.3, 4.0).
    assert c.p20 == pytest.approx(0.94)
    assert c.p80 == pytest.approx(1.3 + 0.6 * (4.0 - 1.3))
    assert c.p20 <= c.p50 <= c.p80
    # Order of the rounds does not matter; an even count takes the mean of the two middle medians.
    assert sweep.combine_rounds(rounds[::-1]) == c
    assert sweep.combine_rounds(rounds[:2]).p50 == pytest.approx(2.05)
    with pytest.raises(ValueError):
        sweep.combine_rounds([])


def test_round_share_of_the_timer(sweep):
    timer = sweep.Timer("cpu", warmup_ms=30.0, rep_ms=150.0)
    assert sweep._round_kwargs(timer, 1) == dict(warmup_ms=30.0, rep_ms=150.0, min_reps=5)
    assert sweep._round_kwargs(timer, 3) == dict(warmup_ms=10.0, rep_ms=50.0, min_reps=1)
    args = sweep.parse_args([])
    assert args.rounds == 3
    assert sweep.OPS["addmm"].fwd_no_grad and not sweep.OPS["linear"].fwd_no_grad


def test_merge_keeps_the_modes_a_run_does_not_measure(sweep, tmp_path):
    """`--modes fwd` replaces an op's fwd rows and keeps its bwd, fwd+bwd and fwd_graph rows (and other ops')."""
    import csv

    from bench_lib import ResultWriter

    path = tmp_path / "sweep.csv"
    old = ResultWriter(path, {}, merge=False, key=sweep.sweep_row_key)
    for op, mode in (("rms_norm", "fwd"), ("rms_norm", "bwd"), ("rms_norm", "fwd+bwd"),
                     ("rms_norm", sweep.GRAPH_MODE), ("geglu_act", "fwd")):
        old.add(op=op, mode=mode, dtype="bf16", provider="ours", note="old")
    old.checkpoint()
    new = ResultWriter(path, {}, merge=True, key=sweep.sweep_row_key)
    new.add(op="rms_norm", mode="fwd", dtype="bf16", provider="ours", note="new")
    new.checkpoint()
    with path.open(newline="") as f:
        rows = {(r["op"], r["mode"], r["note"]) for r in csv.DictReader(f)}
    assert rows == {("rms_norm", "fwd", "new"), ("rms_norm", "bwd", "old"), ("rms_norm", "fwd+bwd", "old"),
                    ("rms_norm", sweep.GRAPH_MODE, "old"), ("geglu_act", "fwd", "old")}
