#!/usr/bin/env python3
"""Plots from the benchmark CSVs: per (op, mode, dtype), throughput vs shape for every provider, the ceiling measured
in the same run as a dashed line and recorded anchors as dotted lines; below it, ours' speedup over each anchor as
bars. The e2e CSV gets time and peak-memory bars per provider; decode.csv ms per token per model, batch and cache;
linear_decode.csv time per call against T per model; decode_stack.csv time per layer / cuBLAS against T.

    python benchmarks/plot.py benchmarks/results/nvidia-h200/sweep.csv         # PNGs next to the CSV
    python benchmarks/plot.py <csv> --out-dir <dir> --ops rms_norm,geglu_mlp

Needs matplotlib; without it the script says so and exits 0 (plots are optional, the CSV is the result).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lib import fnum, read_rows  # noqa: E402

STYLE = {  # provider -> (color, linestyle, marker)
    "ours": ("#d62728", "-", "o"),
    "eager": ("#7f7f7f", "-", "s"),
    "torch.nn.RMSNorm": ("#8c564b", "-", "v"),
    "torch.compile": ("#1f77b4", "-", "^"),
    "liger": ("#2ca02c", "-", "D"),
    "quack": ("#9467bd", "-", "P"),
    "quack (recorded, not run)": ("#9467bd", ":", "P"),
    "torch._addmm_activation": ("#ff7f0e", "-", "X"),
    "mm only": ("#17becf", "--", "x"),
    "ours+torch.compile": ("#e377c2", "-", "*"),
    "ours_nopdl": ("#d62728", ":", "o"),  # linear_decode.py: the op without PDL, our GEMM path, cuBLAS
    "ours_gemm": ("#ff7f0e", "--", "s"),
    "cublas": ("#7f7f7f", "-", "s"),
}


def _save(fig: Any, path: Path) -> Path:
    """Lay out, write at the plots' common resolution, close; the path written."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _style(p: str) -> tuple[str, str, str]:
    return STYLE.get(p, ("#bcbd22", "-", "."))


def plot_op(rows: list[dict[str, str]], op: str, mode: str, dtype: str, out: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grp = [r for r in rows if r.get("op") == op and r.get("mode") == mode and r.get("dtype") == dtype
           and r.get("status") == "ok" and r.get("shape")]
    if not grp:
        return None
    metric = "gbps" if any(fnum(r.get("gbps")) for r in grp) else "tflops"
    unit = "GB/s" if metric == "gbps" else "TFLOP/s"
    shapes: list[str] = []
    for r in grp:
        if r["shape"] not in shapes and r.get("source") == "measured":
            shapes.append(r["shape"])
    if not shapes:
        return None
    # Natural order of the shape fields as written (M, N / H, I, T / M, K, N / T, I), not the sweep's priority order.
    shapes.sort(key=lambda s: tuple(int(kv.split("=")[1]) for kv in s.split(",") if kv.split("=")[1].isdigit()))
    xs = {s: i for i, s in enumerate(shapes)}
    providers = sorted({r["provider"] for r in grp}, key=lambda p: (p != "ours", p))
    fig, (ax, axb) = plt.subplots(2, 1, figsize=(max(8.0, 0.45 * len(shapes) + 3), 8.5),
                                  gridspec_kw={"height_ratios": [3, 2]}, sharex=True)
    for p in providers:
        vals = {xs[r["shape"]]: fnum(r[metric]) for r in grp
                if r["provider"] == p and r["shape"] in xs and fnum(r.get(metric))}
        if not vals:
            continue
        color, ls, marker = _style(p)
        ys = [vals.get(i, float("nan")) for i in range(len(shapes))]  # gaps break the line
        ax.plot(range(len(shapes)), ys, ls, color=color, marker=marker, label=p,
                linewidth=2.5 if p == "ours" else 1.3, markersize=5)
    ceil = [fnum(r.get("ceiling_value")) for r in grp if fnum(r.get("ceiling_value"))]
    if ceil:
        c = max(set(ceil), key=ceil.count)
        what = "copy bandwidth" if metric == "gbps" else f"{dtype} GEMM rate"
        ax.axhline(c, color="black", linestyle="--", linewidth=1.2, label=f"measured {what} ({c:.4g} {unit})")
    ax.set_yscale("log")
    ax.set_ylabel(f"{unit} (analytic {'bytes' if metric == 'gbps' else 'FLOPs'} / median time)")
    dev = grp[0].get("device_name", "")
    if grp[0].get("device") == "cpu":
        dev += f", {grp[0].get('threads')} threads, load avg {grp[0].get('load_avg') or '?'} at start"
    ax.set_title(f"{op} · {mode} · {dtype} · {dev}\nsmall shapes include launch and Python overhead")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")

    # Speedup bars: time(other) / time(ours) per shape, for every anchor and reference (e.g. "mm only").
    anchors = [p for p in providers if p != "ours" and any(r["provider"] == p and r.get("role") in ("anchor",
                                                                                                "reference")
                                                           for r in grp)]
    ours = {r["shape"]: fnum(r["time_p50_ms"]) for r in grp if r["provider"] == "ours"}
    width = 0.8 / max(1, len(anchors))
    for k, p in enumerate(anchors):
        pts = [(xs[r["shape"]], fnum(r["time_p50_ms"]) / ours[r["shape"]]) for r in grp
               if r["provider"] == p and r["shape"] in xs and ours.get(r["shape"]) and fnum(r.get("time_p50_ms"))]
        if pts:
            color, _, _ = _style(p)
            # Bars grow from 1x: up where ours is faster, down where it is slower.
            axb.bar([x - 0.4 + width * (k + 0.5) for x, _ in pts], [y - 1.0 for _, y in pts], bottom=1.0,
                    width=width, color=color, label=f"vs {p}", hatch="//" if "recorded" in p else None, alpha=0.85)
    axb.axhline(1.0, color="black", linewidth=1)
    axb.set_ylabel("ours speedup (x): other time / ours")
    axb.set_yscale("log")
    from matplotlib.ticker import FormatStrFormatter

    axb.yaxis.set_major_formatter(FormatStrFormatter("%.3g"))
    axb.yaxis.set_minor_formatter(FormatStrFormatter("%.3g"))
    axb.grid(True, axis="y", which="both", alpha=0.3)
    if anchors:
        axb.legend(fontsize=8, ncol=min(4, len(anchors)))
    axb.set_xticks(range(len(shapes)))
    axb.set_xticklabels(shapes, rotation=60, ha="right", fontsize=8)
    return _save(fig, out / f"{op}_{mode.replace('+', '_')}_{dtype}.png")


def plot_e2e(rows: list[dict[str, str]], op: str, out: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grp = [r for r in rows if r.get("op") == op and r.get("status") == "ok"]
    if not grp:
        return None
    modes = [m for m in ("train_step", "prefill") if any(r["mode"] == m for r in grp)]
    mem = [r for r in grp if r["mode"] == "train_step" and fnum(r.get("peak_mem_bytes"))]
    n_panels = len(modes) + (1 if mem else 0)
    fig, axes = plt.subplots(1, n_panels, figsize=(5 * n_panels, 4.5), squeeze=False)
    axes = list(axes[0])
    for ax, m in zip(axes, modes):
        sub = [r for r in grp if r["mode"] == m and r.get("source") == "measured"]
        ax.bar([r["provider"] for r in sub], [fnum(r["time_p50_ms"]) for r in sub],
               color=[_style(r["provider"])[0] for r in sub])
        ax.set_title(f"{m} (ms, lower is better)")
        ax.tick_params(axis="x", rotation=30)
    if mem:
        ax = axes[-1]
        ax.bar([r["provider"] for r in mem], [fnum(r["peak_mem_bytes"]) / 1e9 for r in mem],
               color=[_style(r["provider"])[0] for r in mem])
        ax.set_title("train_step peak memory (GB)")
        ax.tick_params(axis="x", rotation=30)
    first = grp[0]
    fig.suptitle(f"{op}: {first.get('shape')} · {first.get('dtype')} · {first.get('device_name')}")
    return _save(fig, out / f"{op}.png")


def plot_decode(rows: list[dict[str, str]], out: Path) -> Path | None:
    """``decode.csv`` (benchmarks/decode.py): one panel per model, ms per decoded token for every (batch, cache) as
    bars of the plain model and the kernelized one, the kernelized / plain speed ratio written over each pair."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok" and fnum(r.get("ms_per_token"))]
    models = sorted({r["model"] for r in ok})
    if not models:
        return None
    fig, axes = plt.subplots(len(models), 1, figsize=(9, 3.6 * len(models)), squeeze=False)
    for ax, model in zip(axes[:, 0], models):
        sub = [r for r in ok if r["model"] == model]
        cells = sorted({(r["cache"], int(r["batch"])) for r in sub}, key=lambda c: (c[0] != "static", c[1]))
        val = {(r["cache"], int(r["batch"]), r["provider"]): fnum(r["ms_per_token"]) for r in sub}
        for i, (cache, batch) in enumerate(cells):
            for k, prov in enumerate(("eager", "ours")):
                v = val.get((cache, batch, prov))
                if v is None:
                    continue
                color = _style(prov)[0]
                ax.bar(i + (k - 0.5) * 0.38, v, width=0.36, color=color, alpha=0.9 if cache == "static" else 0.55,
                       label=("plain" if prov == "eager" else "kernelized") if i == 0 else None)
            e, o = val.get((cache, batch, "eager")), val.get((cache, batch, "ours"))
            if e and o:
                ax.annotate(f"{e / o:.3f}x", (i, max(e, o)), ha="center", va="bottom", fontsize=8,
                            color="#2ca02c" if e / o >= 1.0 else "#d62728")
        ax.set_xticks(range(len(cells)))
        ax.set_xticklabels([f"{'static+compile' if c == 'static' else 'dynamic, eager'}\nB={b}" for c, b in cells],
                           fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("ms per decoded token (median)")
        first = sub[0]
        ax.set_title(f"{model}: {first.get('layers')} layers, hidden {first.get('hidden')}, {first.get('dtype')}, "
                     f"{first.get('prompt_len')} + {first.get('new_tokens')} tokens · {first.get('device_name')}",
                     fontsize=9)
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    fig.suptitle("greedy generate(): kernelized vs plain (ratio = plain ms / kernelized ms; > 1 is faster)",
                 fontsize=10)
    return _save(fig, out / "decode.png")


def plot_linear_decode(rows: list[dict[str, str]], out: Path) -> Path | None:
    """``linear_decode.csv`` (benchmarks/linear_decode.py): per model, time per call against T for a decoder layer's
    four projections in a row and for the lm_head, every provider; the op / cuBLAS ratio written at each T."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok" and r.get("op", "").startswith("linear_decode_")
          and fnum(r.get("time_p50_ms"))]
    models = sorted({r["op"][len("linear_decode_"):].rsplit("_", 1)[0] for r in ok if r["op"].endswith("_layer")})
    if not models:
        return None
    parts = ("layer", "lm_head")
    fig, axes = plt.subplots(len(models), len(parts), figsize=(11, 3.4 * len(models)), squeeze=False)
    for row, model in enumerate(models):
        for col, part in enumerate(parts):
            ax = axes[row, col]
            sub = [r for r in ok if r["op"] == f"linear_decode_{model}_{part}"]
            val = {(r["provider"], int(r["T"])): fnum(r["time_p50_ms"]) * 1e3 for r in sub}
            ts = sorted({t for _, t in val})
            for prov in sorted({p for p, _ in val}, key=lambda p: (p != "ours", p)):
                pts = [(t, val[(prov, t)]) for t in ts if (prov, t) in val]
                color, ls, marker = _style(prov)
                ax.plot([t for t, _ in pts], [v for _, v in pts], color=color, linestyle=ls, marker=marker,
                        label=prov)
            for t in ts:
                o, c = val.get(("ours", t)), val.get(("cublas", t))
                if o and c:
                    ax.annotate(f"{o / c:.2f}", (t, o), ha="center", va="bottom", fontsize=7,
                                color="#2ca02c" if o <= c else "#d62728")
            ax.set_xscale("log", base=2)
            ax.set_xticks(ts)
            ax.set_xticklabels([str(t) for t in ts])
            ax.set_xlabel("tokens T")
            ax.set_ylabel("us per call (CUDA graph, median)")
            shape = sub[0]["shape"].split(",", 1)[1] if sub else ""
            ax.set_title(f"{model} {'q, k, v, o in a row' if part == 'layer' else 'lm_head'} ({shape})", fontsize=9)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7, loc="upper left")
    first = ok[0]
    fig.suptitle(f"bias-free Linear at decode sizes: linear_decode vs cuBLAS (ratio ours / cublas; < 1 is faster) · "
                 f"{first.get('device_name')}, {first.get('dtype')}", fontsize=10)
    return _save(fig, out / "linear_decode.png")


def plot_decode_stack(rows: list[dict[str, str]], out: Path) -> Path | None:
    """``decode_stack.csv`` (benchmarks/decode_stack.py): per model, time per layer / cuBLAS's against T for the decode
    projections (``lin``), the decode MLP (``mlp``) and both; below 1 the decode kernels are faster."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok" and r.get("op", "").startswith("decode_stack_")
          and fnum(r.get("time_p50_ms"))]
    models = sorted({r["op"][len("decode_stack_"):] for r in ok})
    if not models:
        return None
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False)
    for col, model in enumerate(models):
        ax = axes[0, col]
        val = {(r["provider"], int(r["T"])): fnum(r["time_p50_ms"]) for r in ok if r["op"] == f"decode_stack_{model}"}
        ts = sorted({t for _, t in val})
        drawn = False
        for prov, color, marker in (("lin", "#1f77b4", "o"), ("mlp", "#ff7f0e", "s"), ("both", "#2ca02c", "^")):
            pts = [(t, val[(prov, t)] / val[("cublas", t)]) for t in ts if (prov, t) in val and ("cublas", t) in val]
            if pts:
                ax.plot([t for t, _ in pts], [v for _, v in pts], color=color, marker=marker, label=f"{prov} / cublas")
                drawn = True
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(ts)
        ax.set_xlabel("tokens T")
        ax.set_ylabel("time per layer / cuBLAS path")
        ax.set_title(model, fontsize=9)
        ax.grid(True, alpha=0.3)
        if drawn:
            ax.legend(fontsize=7)
    first = ok[0]
    fig.suptitle(f"decode kernels in a {first.get('L')}-layer stack (distinct weights, CUDA graph; < 1 is faster) · "
                 f"{first.get('device_name')}, {first.get('dtype')}", fontsize=10)
    return _save(fig, out / "decode_stack.png")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv", nargs="+", type=Path)
    p.add_argument("--out-dir", type=Path, help="default: next to each CSV")
    p.add_argument("--ops", default="", help="comma list of ops to draw (default: all in the CSV)")
    args = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot.py: matplotlib is not installed (pip install matplotlib); no plots drawn", file=sys.stderr)
        return 0
    wanted = set(filter(None, args.ops.split(",")))
    for csv_path in args.csv:
        rows = read_rows(csv_path)
        out = args.out_dir or csv_path.parent
        out.mkdir(parents=True, exist_ok=True)
        if rows and "ms_per_token" in rows[0]:  # benchmarks/decode.py's CSV
            path = plot_decode(rows, out)
            if path:
                print(f"wrote {path}")
            continue
        if rows and all(r.get("source") == "linear_decode.py" for r in rows):  # benchmarks/linear_decode.py's CSV
            path = plot_linear_decode(rows, out)
            if path:
                print(f"wrote {path}")
            continue
        if rows and all(r.get("source") == "decode_stack.py" for r in rows):  # benchmarks/decode_stack.py's CSV
            path = plot_decode_stack(rows, out)
            if path:
                print(f"wrote {path}")
            continue
        keys: dict[tuple[str, str, str], int] = defaultdict(int)
        for r in rows:
            if r.get("op") and r["op"] != "ceiling" and r.get("mode") and r.get("status") == "ok":
                keys[(r["op"], r["mode"], r["dtype"])] += 1
        drawn_e2e: set[str] = set()
        for op, mode, dtype in sorted(keys):
            if wanted and op not in wanted:
                continue
            if op.startswith("e2e_"):
                if op in drawn_e2e:
                    continue
                drawn_e2e.add(op)
                path = plot_e2e(rows, op, out)
            else:
                path = plot_op(rows, op, mode, dtype, out)
            if path:
                print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
