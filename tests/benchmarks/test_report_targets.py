"""benchmarks/report.py's verdicts: on the recorded decode CSV, a target over named batches (a `where` "in" filter or
an explicit ``shapes`` count) is met only when every one of them was measured; a ratio pairs rows of one dtype."""

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


def test_a_ratio_compares_rows_of_one_dtype():
    """A CSV holds fp32 and bf16 rows of one shape: ours in bf16 is compared with eager in bf16, never in fp32."""
    import report

    target = _target(report, "cpu-geglu")

    def row(dtype, provider, ms):
        return {"device": "cpu", "op": "geglu_act", "mode": "fwd", "threads": "2", "shape": "T=16,I=9216",
                "dtype": dtype, "provider": provider, "source": "measured", "status": "ok", "time_p50_ms": str(ms)}

    # fp32: 2.1x; bf16: 2.1x; fp32 eager over bf16 ours would read 1.05x
    rows = [row("fp32", "eager", 2.1), row("fp32", "ours", 1.0), row("bf16", "ours", 2.0), row("bf16", "eager", 4.2)]
    v = report.evaluate(target, rows)
    assert v.status == "met" and v.value == "2.100x", v
    assert "fp32" in v.detail or "bf16" in v.detail, v  # two dtypes: the worst cell names its dtype
    rows[-1]["time_p50_ms"] = "3.0"  # bf16 now 1.5x
    v = report.evaluate(target, rows)
    assert v.status == "not met" and v.value == "1.500x" and "bf16" in v.detail, v
    rows[-1]["dtype"] = "bfloat16"  # one CSV's spelling of the same dtype: still the bf16 cell's anchor
    v = report.evaluate(target, rows)
    assert v.status == "not met" and v.value == "1.500x", v


def test_a_verdict_names_the_runs_behind_it():
    """The targets table says when, and from which commit, our rows were measured: stale rows show."""
    import report

    target = _target(report, "cpu-geglu")

    def row(provider, ms, date, rev):
        return {"device": "cpu", "op": "geglu_act", "mode": "fwd", "threads": "2", "shape": "T=16,I=9216",
                "dtype": "bf16", "provider": provider, "source": "measured", "status": "ok", "time_p50_ms": str(ms),
                "date_utc": date, "git_rev": rev}

    rows = [row("ours", 1.0, "2026-12-02T18:00:55Z", "ce9b1c9"), row("eager", 2.5, "2026-12-02T18:00:55Z", "ce9b1c9")]
    assert report.evaluate(target, rows).runs == "2026-12-02 ce9b1c9"
    rows.append(dict(row("ours", 1.0, "2026-12-04T01:00:00Z", "a29987d"), shape="T=512,I=9216"))
    rows.append(dict(row("eager", 2.5, "2026-12-04T01:00:00Z", "a29987d"), shape="T=512,I=9216"))
    assert report.evaluate(target, rows).runs == "2026-12-02..2026-12-04 (2 runs)"


def test_gpu_targets_read_h200_rows_only():
    """An H100 or GH200 CSV beside the H200 ones (evidence from a session without an H200) leaves every verdict as it
    was."""
    import report

    target = _target(report, "addnorm-fwd")

    def row(gpu, gbps):
        return {"device": "cuda", "device_name": f"NVIDIA {gpu}", "op": "add_rms_norm", "mode": "fwd",
                "shape": "M=8192,N=4096", "M": "8192", "N": "4096", "dtype": "bfloat16", "provider": "ours",
                "source": "measured", "status": "ok", "gbps": str(gbps), "time_p50_ms": "0.1"}

    h200 = [row("H200", 4200)]
    assert report.evaluate(target, h200).status == "met"
    assert report.evaluate(target, h200 + [row("H100 80GB HBM3", 3000)]).status == "met"
    assert report.evaluate(target, [row("H100 80GB HBM3", 4200)]).status == "not measured"
    assert report.evaluate(target, [row("GH200 480GB", 4200)]).status == "not measured"


def _cpu_row(provider, ms, shape="T=16,I=9216", run=("2026-12-02T18:00:55Z", "ce9b1c9"), **extra):
    return {"device": "cpu", "op": "geglu_act", "mode": "fwd", "threads": "2", "shape": shape, "dtype": "bf16",
            "provider": provider, "source": "measured", "status": "ok", "time_p50_ms": str(ms),
            "date_utc": run[0], "git_rev": run[1], **extra}


def test_an_anchor_pairs_with_rows_of_its_own_run():
    """docs/targets.md: anchors measured in the same run. An anchor row of another run at the same shape is not a
    comparison (it used to be taken, whichever CSV came first)."""
    import report

    target = _target(report, "cpu-geglu")
    other_run = ("2026-12-04T01:00:00Z", "a29987d")
    rows = [_cpu_row("ours", 1.0), _cpu_row("eager", 1.5), _cpu_row("ours", 1.0, run=other_run),
            _cpu_row("eager", 3.0, run=other_run)]
    v = report.evaluate(target, rows)
    assert v.status == "not met" and v.value == "1.500x" and "1 shapes" in v.detail, v  # each run's own pair
    v = report.evaluate(target, rows[:1] + rows[3:])  # ours of one run, eager of the other only
    assert v.status == "not measured", v
    v = report.evaluate(target, rows[2:] + rows[:1])  # a pair of the second run, ours of the first unpaired
    assert v.status == "not met" and "no same-run comparison" in v.detail, v


def test_a_failed_or_missing_shape_fails_an_every_shape_target():
    """A shape whose row of ours errored or failed its correctness check (verified=false, status still ok), or whose
    anchor is missing, leaves a target over every shape not met: it is not dropped from the range."""
    import report

    target = _target(report, "cpu-geglu")
    good = [_cpu_row("ours", 1.0), _cpu_row("eager", 2.5)]
    assert report.evaluate(target, good).status == "met"
    other = "T=512,I=9216"
    for bad in ({"status": "error: RuntimeError"}, {"verified": "false"}):
        rows = good + [_cpu_row("ours", 1.0, shape=other, **bad), _cpu_row("eager", 2.5, shape=other)]
        v = report.evaluate(target, rows)
        assert v.status == "not met" and other in v.detail, (bad, v)
    v = report.evaluate(target, good + [_cpu_row("ours", 1.0, shape=other)])  # no eager row at that shape
    assert v.status == "not met" and other in v.detail, v
    abs_target = _target(report, "e2e-step")  # an absolute target: an errored row fails it too
    row = {"device": "cuda", "device_name": "NVIDIA H200", "op": "e2e_gemma2b", "mode": "train_step", "L": "4",
           "T": "4096", "shape": "L=4,T=4096", "provider": "ours", "source": "measured", "status": "ok",
           "time_p50_ms": "19.0"}
    assert report.evaluate(abs_target, [row]).status == "met"
    v = report.evaluate(abs_target, [row, dict(row, shape="L=4,T=4096,B=4", status="error: OOM")])
    assert v.status == "not met" and "failed or errored" in v.detail, v


def test_a_miss_that_rounds_to_the_threshold_shows_more_digits():
    import report

    target = _target(report, "cpu-geglu")
    v = report.evaluate(target, [_cpu_row("ours", 1.0), _cpu_row("eager", 1.99994)])
    assert v.status == "not met" and v.value == "1.99994x", v
