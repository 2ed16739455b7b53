"""The decode GPU benchmarks' CPU side (the benchmarks themselves need a GPU): benchmarks/plot.py draws the recorded
H200 CSVs of linear_decode.py and decode_stack.py (whole, a one-model subset, nothing when no row is ok; the CLI routes
each CSV to its plot); decode_stack.py's crossover rule, --tunes providers and recorded rows; bench_lib's output
helpers (add_result_args, result_writer, draw_plot)."""

from __future__ import annotations

import argparse
import csv
import shutil
import subprocess
from pathlib import Path
import sys

import pytest
from conftest import ROOT

RESULTS = ROOT / "benchmarks" / "results" / "nvidia-h200"
sys.path.insert(0, str(ROOT / "benchmarks"))

# (CSV, plot function, PNG, a one-model subset of the rows)
PLOTS = [
    ("linear_decode.csv", "plot_linear_decode", "linear_decode.png",
     lambda r: r["op"].startswith("linear_decode_gemma2b_")),
    ("decode_stack.csv", "plot_decode_stack", "decode_stack.png", lambda r: r["op"] == "decode_stack_gemma2b"),
]


def _rows(name: str) -> list[dict[str, str]]:
    with (RESULTS / name).open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("name, fn, png, subset", PLOTS, ids=[p[0] for p in PLOTS])
def test_plot_draws_the_recorded_csv(tmp_path, name, fn, png, subset):
    pytest.importorskip("matplotlib")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plot.py"), str(RESULTS / name), "--out-dir",
                           str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert png in proc.stdout
    assert (tmp_path / png).stat().st_size > 10000


@pytest.mark.parametrize("name, fn, png, subset", PLOTS, ids=[p[0] for p in PLOTS])
def test_plot_subset_and_nothing_to_draw(tmp_path, name, fn, png, subset):
    pytest.importorskip("matplotlib")
    import plot

    one = [r for r in _rows(name) if subset(r)]
    assert one and getattr(plot, fn)(one, tmp_path) == tmp_path / png
    assert (tmp_path / png).stat().st_size > 5000
    assert getattr(plot, fn)([dict(r, status="error") for r in one], tmp_path / "none") is None


def test_decode_stack_rows_are_verified_for_every_provider():
    rows = _rows("decode_stack.csv")
    cells: dict[tuple[str, str], set[str]] = {}
    for r in rows:
        assert r["status"] == "ok" and r["verified"].lower() == "true", r
        cells.setdefault((r["op"], r["T"]), set()).add(r["provider"])
    assert cells and all(p >= {"cublas", "lin", "mlp", "both"} for p in cells.values())


def test_crossover_is_the_last_t_of_the_first_winning_run():
    from decode_stack import crossover

    assert crossover({1: 0.8, 2: 0.9, 4: 0.99, 8: 1.01, 16: 0.95}) == 4
    assert crossover({1: 1.0, 2: 0.5}) == 0
    assert crossover({8: 0.9, 1: 0.7}) == 8


def test_tunes_become_providers():
    from decode_stack import tune_providers

    got = tune_providers(["gu_wk=8", "lin_wk=4", "lin_wk=4,lin_wr=2", "dn_ks=2,lin_wk=4", "pdl=0"])
    assert got == {"mlp:gu_wk=8": (False, True, "gu_wk=8"), "lin:lin_wk=4": (True, False, "lin_wk=4"),
                   "lin:lin_wk=4,lin_wr=2": (True, False, "lin_wk=4,lin_wr=2"),
                   "both:dn_ks=2,lin_wk=4": (True, True, "dn_ks=2,lin_wk=4"), "both:pdl=0": (True, True, "pdl=0")}


def test_result_helpers_write_merge_and_plot(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import bench_lib

    p = argparse.ArgumentParser()
    bench_lib.add_result_args(p, "decode_stack.csv")
    args = p.parse_args(["--results-root", str(tmp_path)])
    assert (args.csv_name, args.fresh, args.no_plot) == ("decode_stack.csv", False, False)
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    recorded = _rows("decode_stack.csv")
    env = {k: recorded[0][k] for k in ("device", "device_name")}
    slug = bench_lib.device_slug(env)
    (tmp_path / slug).mkdir()
    shutil.copy(RESULTS / "decode_stack.csv", tmp_path / slug / "decode_stack.csv")
    writer = bench_lib.result_writer(args, env)
    assert writer.path == tmp_path / slug / "decode_stack.csv" and writer.mirror == tmp_path / "out" / slug / \
        "decode_stack.csv"
    assert len(writer.kept) == len(recorded)
    row = dict(recorded[0])  # rerun one op: its recorded rows are replaced, the other ops' rows stay
    writer.add(**{k: row[k] for k in ("op", "provider", "dtype", "shape", "T", "time_p50_ms", "status")})
    writer.checkpoint()
    after = bench_lib.read_rows(writer.path)
    assert [r for r in after if r["op"] == row["op"]] == [dict(writer.rows[0])]
    assert [r for r in after if r["op"] != row["op"]] == [r for r in recorded if r["op"] != row["op"]]
    assert (tmp_path / "out" / slug / "decode_stack.csv").read_text() == writer.path.read_text()
    bench_lib.draw_plot("plot_decode_stack", writer.path)
    assert (tmp_path / slug / "decode_stack.png").stat().st_size > 10000
    p = argparse.ArgumentParser()
    bench_lib.add_result_args(p, "crossover.csv", plot=False)
    args = p.parse_args(["--fresh"])
    assert args.fresh and not hasattr(args, "no_plot")


def test_stack_rows_fail_verification_when_a_decode_kernel_is_wrong(monkeypatch):
    """decode_stack.run_model on the CPU with stand-ins for the CUDA pieces (the graph is one plain call; the decode
    ops are fp32 references): every provider verifies; a wrong linear_decode fails exactly the providers that use it
    (its q projection is checked), a wrong decode MLP those that use that."""
    import torch.nn.functional as F

    import bench_lib
    import decode_stack as ds

    class OneCall:
        def __init__(self, fn, calls=1):
            self.out, self.times = fn(), [1.0, 1.2, 0.8]

    monkeypatch.setattr(ds, "GraphCalls", OneCall)
    monkeypatch.setattr(ds, "measure_graphs", lambda graphs, rounds, seed=0: None)
    monkeypatch.setattr(ds, "MODELS", {"tiny": (64, 64, 16, 128, "silu")})
    monkeypatch.setattr(ds, "LAYERS", 2)

    def lin(x, w):
        return F.linear(x.float(), w.float()).to(x.dtype)

    def mlp(x, g, u, d, act):
        return lin(ds.act_mul(lin(x, g).float(), lin(x, u).float(), act).to(x.dtype), d)

    def run(linear_decode, gated_mlp_decode):
        ops = type("Ops", (), {"linear_decode": staticmethod(linear_decode),
                               "gated_mlp_decode": staticmethod(gated_mlp_decode)})
        writer = bench_lib.ResultWriter(Path("unused.csv"), {}, merge=False)
        monkeypatch.setattr(writer, "checkpoint", lambda: None)
        ds.run_model(ops, writer, "tiny", (1, 4), "bf16", 3, ["gu_wk=8", "lin_wk=4", "pdl=0"], device="cpu")
        return {(r["T"], r["provider"]): r["verified"] for r in writer.rows}

    good = run(lin, mlp)
    assert len(good) == 2 * 7 and set(good.values()) == {"true"}, good
    zero_lin = run(lambda x, w: x.new_zeros(x.shape[0], w.shape[0]), mlp)
    assert {k for k, v in zero_lin.items() if v == "false"} == \
        {(t, p) for t in ("1", "4") for p in ("lin", "both", "lin:lin_wk=4", "both:pdl=0")}, zero_lin
    zero_mlp = run(lin, lambda x, g, u, d, act: x.new_zeros(x.shape[0], d.shape[0]))
    assert {k for k, v in zero_mlp.items() if v == "false"} == \
        {(t, p) for t in ("1", "4") for p in ("mlp", "both", "mlp:gu_wk=8", "both:pdl=0")}, zero_mlp


def test_busy_time_is_the_union_of_kernel_intervals():
    from bench_lib import busy_intervals_us

    assert busy_intervals_us([]) == 0
    # overlapping (a PDL launch starts under its predecessor's tail), nested, touching and disjoint intervals
    assert busy_intervals_us([(10, 20), (0, 5), (15, 30), (16, 18), (30, 31), (40, 42)]) == 5 + 21 + 2


def test_decode_table_shows_gpu_busy_where_measured():
    import report

    base = dict(device_name="NVIDIA H200", model="llama3_2_1b", status="ok", layers="16", hidden="2048",
                intermediate="8192", vocab="128256", dtype="bf16", prompt_len="64", new_tokens="48", rounds="5")
    rows = [dict(base, cache="static", batch="16", provider="eager", ms_per_token="2.5", gpu_busy_ms_per_token="1.8"),
            dict(base, cache="static", batch="16", provider="ours", ms_per_token="2.4", gpu_busy_ms_per_token="1.5"),
            dict(base, cache="dynamic", batch="1", provider="eager", ms_per_token="11", gpu_busy_ms_per_token=""),
            dict(base, cache="dynamic", batch="1", provider="ours", ms_per_token="10", gpu_busy_ms_per_token="")]
    lines = report.decode_tables(rows)
    (static,) = [ln for ln in lines if ln.startswith("| static + compile | 16 |")]
    assert "| 1.042x | 1.800 / 1.500 (1.200x) |" in static, static
    (dynamic,) = [ln for ln in lines if ln.startswith("| dynamic (eager) | 1 |")]
    assert "| 1.100x |  |" in dynamic, dynamic
    header = next(ln for ln in lines if ln.startswith("| cache |"))
    assert header.count("|") == lines[lines.index(header) + 1].count("|") == static.count("|")
