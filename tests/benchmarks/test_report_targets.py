"""benchmarks/report.py's verdicts on the recorded decode CSV: a target over named batches (a `where` "in" filter or
an explicit ``shapes`` count) is met only when every one of them was measured."""

from __future__ import annotations

import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))


def _target(report, tid):
    return next(t for t in report.TARGETS if t["id"] == tid)


def test_a_missing_batch_fails_a_target_over_named_batches():
    import report

    rows = report.read_rows(ROOT / "benchmarks" / "results" / "nvidia-h200" / "decode.csv")
    for tid, drop in (("decode-static-llama3_2_1b", "16"), ("decode-static-any-llama3_2_1b", "64")):
        target = _target(report, tid)
        full = report.evaluate(target, rows)
        assert "only" not in full.detail, full
        cell = [r for r in rows if r["op"] == target["op"] and r["mode"] == target["mode"] and r["batch"] == drop]
        assert cell, (tid, drop)
        less = report.evaluate(target, [r for r in rows if r not in cell])
        assert less.status == "not met" and "of" in less.detail and "shapes measured" in less.detail, less
