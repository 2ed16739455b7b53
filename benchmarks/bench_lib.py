"""Benchmark harness shared by ``sweep.py`` and ``e2e.py``: kernel loading, timing, ceilings, CSV rows, budgets.

Timing. On a GPU every measurement is ``triton.testing.do_bench`` (CUDA events; quantiles 0.2/0.5/0.8 of the
per-call times). ``do_bench`` zeroes a 256 MB buffer before *every* timed call, which evicts the whole L2 (50 MB on
an H100/H200), so inputs are read from HBM even when they would fit in L2 -- the same effect as rotating buffers,
for every shape. On the CPU the timer does the same: warm-up, then per-call ``perf_counter`` samples, with a write
of twice the last-level cache before each call when the working set is smaller than that (larger working sets
stream through the cache by themselves). Small shapes therefore include launch and Python overhead as a user sees
them.

Ceilings are measured in the same process: device copy bandwidth (read + write counted; on the CPU a memcpy of a
buffer far larger than the LLC) and the GEMM rate (bf16 8192^3 on a GPU; 1024^3 on a CPU, only for the dtypes the
GEMM ops run in there).

Rows are long-format CSV (one row per op, provider, mode, dtype and shape), written atomically after every shape so
that a run cut short still leaves its data.
"""

from __future__ import annotations

import csv
import datetime as _dt
import math
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
REPO_ID = "kernels-community/fused-mlp"
QUANTILES = (0.2, 0.5, 0.8)

# Absolute floor per dtype for the 2x rule (same numbers as tests/_utils.py).
FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

ENV_COLUMNS = ["date_utc", "git_rev", "kernel_build", "device", "device_name", "torch", "triton", "cuda",
               "liger", "transformers", "kernels", "threads", "load_avg"]
SHAPE_COLUMNS = ["M", "N", "K", "H", "I", "T", "L"]
COLUMNS = ENV_COLUMNS + [
    "op", "provider", "role", "source", "mode", "dtype", "shape", *SHAPE_COLUMNS,
    "time_p20_ms", "time_p50_ms", "time_p80_ms",
    "bytes", "flops", "gbps", "tflops", "tokens_per_s",
    "ceiling", "ceiling_value", "pct_of_ceiling",
    "peak_mem_bytes", "max_err", "max_err_eager", "verified", "compile_s",
    "best_anchor", "speedup_vs_best_anchor", "status", "note",
]


# ---------------------------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------------------------


def _version(module: str) -> str:
    try:
        import importlib.metadata as md

        return md.version(module)
    except Exception:  # noqa: BLE001 - not installed
        return ""


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_revision(root: Path = ROOT) -> str:
    """``<sha>`` or ``<sha>-dirty``; ``FUSED_MLP_GIT_REV`` overrides (a copy of the tree without .git)."""
    if os.environ.get("FUSED_MLP_GIT_REV"):
        return os.environ["FUSED_MLP_GIT_REV"]
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        if not sha:
            return "unknown"
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def collect_env(device: str, kernel: ModuleType | None) -> dict[str, str]:
    on_gpu = device == "cuda"
    return {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git_rev": git_revision(),
        "kernel_build": getattr(kernel, "__name__", "") if kernel is not None else "",
        "device": device,
        "device_name": torch.cuda.get_device_name() if on_gpu else cpu_name(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cuda": (torch.version.cuda or "") if on_gpu else "",
        "liger": _version("liger-kernel") or _version("liger_kernel"),
        "transformers": _version("transformers"),
        "kernels": _version("kernels"),
        "threads": str(torch.get_num_threads()),
        # Other processes on a small CPU machine distort CPU timings: recorded so a reader can judge.
        "load_avg": f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "",
    }


def device_slug(env: dict[str, str]) -> str:
    """``nvidia-h200`` for a GPU; ``cpu-<model>-<threads>t`` for the CPU (results differ with the thread count)."""
    name = env["device_name"].lower()
    name = re.sub(r"\(r\)|\(tm\)|processor|\d+-core", " ", name)
    slug = re.sub(r"[^a-z0-9]+", "-", name).strip("-")
    slug = re.sub(r"-+", "-", slug)[:40].strip("-")
    if env["device"] == "cpu":
        return f"cpu-{slug}-{env['threads']}t"
    return slug


def log(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------------------------------
# Loading the kernel the way users do
# ---------------------------------------------------------------------------------------------------------------


def load_kernel(spec: str | None, backend: str | None = None) -> ModuleType:
    """``spec``: a checkout path (``kernels.get_local_kernel``) or a Hub repo id
    (``kernels.get_kernel(..., version=1)``, which honours ``LOCAL_KERNELS``). Default: this checkout.
    ``backend="cpu"`` forces the CPU variant."""
    import kernels

    spec = spec or str(ROOT)
    path = Path(spec)
    if path.exists():
        return kernels.get_local_kernel(path.resolve(), backend=backend) if backend else \
            kernels.get_local_kernel(path.resolve())
    return kernels.get_kernel(spec, version=1)


# ---------------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Timing:
    p20: float
    p50: float
    p80: float

    @staticmethod
    def minus(a: Timing, b: Timing) -> Timing | None:
        """``a - b`` for a derived time (bwd = (fwd+bwd) - fwd): the median is the difference of the medians and
        the 20/80 band is widened to the worst case of the two bands (it is an interval, not a quantile).
        None when the difference of the medians is not positive (noise larger than the backward itself)."""
        if a.p50 <= b.p50:
            return None
        return Timing(max(a.p20 - b.p80, 0.0), a.p50 - b.p50, a.p80 - b.p20)


def _percentile(sorted_vals: Sequence[float], q: float) -> float:
    if len(sorted_vals) == 1:
        return sorted_vals[0]
    pos = (len(sorted_vals) - 1) * q
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def combine_rounds(rounds: Sequence[Timing]) -> Timing:
    """One Timing from the per-round Timings of one (provider, mode): p50 = median of the rounds' medians; p20 =
    20th percentile of the rounds' p20s, p80 = 80th percentile of their p80s (the band holds the spread within and
    across rounds; one round gives that round's Timing unchanged)."""
    if not rounds:
        raise ValueError("no rounds to combine")
    return Timing(_percentile(sorted(t.p20 for t in rounds), QUANTILES[0]),
                  _percentile(sorted(t.p50 for t in rounds), QUANTILES[1]),
                  _percentile(sorted(t.p80 for t in rounds), QUANTILES[2]))


def llc_bytes() -> int:
    """Size of the largest CPU cache (sysfs), 32 MiB when unknown."""
    best = 0
    for idx in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            txt = (idx / "size").read_text().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(txt[-1], 1)
            best = max(best, int(txt.rstrip("KMG")) * mult)
        except (OSError, ValueError):
            continue
    return best or (32 << 20)


@dataclass
class Timer:
    """``time(fn)`` -> quantiles of the per-call time in ms (see the module docstring)."""

    device: str
    warmup_ms: float = 10.0
    rep_ms: float = 30.0
    max_reps: int = 1000
    _flush: torch.Tensor | None = field(default=None, repr=False)

    def time(self, fn: Callable[[], Any], *, grad_to_none: Sequence[torch.Tensor] | None = None,
             working_set_bytes: int = 0, warmup_ms: float | None = None, rep_ms: float | None = None,
             min_reps: int = 5) -> Timing:
        """``warmup_ms`` / ``rep_ms`` override the timer's for this call (one of several interleaved rounds);
        ``min_reps`` is the CPU timer's floor on timed calls (do_bench has none)."""
        warmup = self.warmup_ms if warmup_ms is None else warmup_ms
        rep = self.rep_ms if rep_ms is None else rep_ms
        if self.device == "cuda":
            from triton.testing import do_bench

            q = do_bench(fn, warmup=warmup, rep=rep, grad_to_none=list(grad_to_none or []) or None,
                         quantiles=list(QUANTILES))
            return Timing(float(q[0]), float(q[1]), float(q[2]))
        return self._time_cpu(fn, grad_to_none or [], working_set_bytes, warmup, rep, min_reps)

    def _time_cpu(self, fn: Callable[[], Any], grad_to_none: Sequence[torch.Tensor], working_set: int,
                  warmup_ms: float, rep_ms: float, min_reps: int) -> Timing:
        flush_bytes = 2 * llc_bytes()
        flush = working_set < flush_bytes
        if flush and (self._flush is None or self._flush.numel() < flush_bytes):
            self._flush = torch.empty(flush_bytes, dtype=torch.uint8)

        def one() -> float:
            for t in grad_to_none:
                t.grad = None
            if flush:
                self._flush.zero_()
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3

        # Like do_bench: warm up for warmup_ms, then as many calls as fit in rep_ms of wall time (the cache flush
        # included), at least min_reps (5 by default).
        w0 = time.perf_counter()
        spent, calls = 0.0, 0
        while spent < warmup_ms or calls == 0:
            spent += one()
            calls += 1
        wall_per_call = max((time.perf_counter() - w0) * 1e3 / calls, 1e-4)
        reps = int(min(self.max_reps, max(min_reps, rep_ms / wall_per_call)))
        samples = sorted(one() for _ in range(reps))
        return Timing(*(_percentile(samples, q) for q in QUANTILES))


def cuda_graph_time(fn: Callable[[], Any], *, calls: int = 20, rounds: int = 50, warmup_calls: int = 3) -> Timing:
    """Device time per call of ``fn`` with the host taken out: after ``warmup_calls`` on a side stream (compilation,
    allocator and library warm-up happen there, as ``torch.cuda.graphs`` requires), ``calls`` back-to-back calls are
    captured in one ``torch.cuda.CUDAGraph``; each of ``rounds`` replays is timed with CUDA events and divided by
    ``calls``. Quantiles 0.2/0.5/0.8 over the rounds. No L2 flush: the inputs stay L2-resident across the replay, as
    the activations of a decode step are (written by the kernel before). ``fn`` must not synchronize the host or
    change shapes between calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup_calls):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()  # first replay uploads the graph
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(rounds):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    del graph
    samples.sort()
    return Timing(*(_percentile(samples, q) for q in QUANTILES))


def cuda_graph_times(fns: dict[str, Callable[[], Any]], *, calls: int = 20, rounds: int = 50, warmup_calls: int = 3,
                     warm_ms: float = 20.0) -> dict[str, Timing]:
    """``cuda_graph_time`` for several providers of one shape, decided from interleaved rounds: every ``fn`` is
    captured in its own graph first, the graphs are replayed for ``warm_ms`` each (clocks up, as in a running decode
    loop), then each round replays every graph once, back to back, in an order that rotates (benchmarks/crossover.py's
    method). Timed alone, one synchronised replay at a time right after capture, a ~2 us kernel read 2x slower on
    the H200 than in crossover.py's rounds."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns.values():
            for _ in range(warmup_calls):
                fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graphs = {}
    for name, fn in fns.items():
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        g.replay()  # the first replay uploads the graph
        graphs[name] = g
    torch.cuda.synchronize()
    for g in graphs.values():
        t0 = time.perf_counter()
        while (time.perf_counter() - t0) * 1e3 < warm_ms:
            g.replay()
            torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in graphs}
    names = list(graphs)
    for r in range(rounds):
        # One round: every graph once, back to back between event pairs, one synchronisation at the end (the GPU
        # stays busy, as in a decode loop; crossover.py's method).
        k = r % len(names)
        evs = []
        for name in names[k:] + names[:k]:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graphs[name].replay()
            b.record()
            evs.append((name, a, b))
        torch.cuda.synchronize()
        for name, a, b in evs:
            samples[name].append(a.elapsed_time(b) / calls)
    del graphs
    out = {}
    for name, s in samples.items():
        s.sort()
        out[name] = Timing(*(_percentile(s, q) for q in QUANTILES))
    return out


class GraphCalls:
    """``fn`` captured ``calls`` times into one CUDA graph (warmed up on a side stream first, outside the capture);
    ``out`` holds the last call's outputs, ``times`` the per-call ms of ``measure_graphs``' rounds."""

    def __init__(self, fn: Callable[[], Any], calls: int = 20) -> None:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):  # warm-up (compiles, allocator, lazy init) outside the capture
                fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for _ in range(calls):
                out = fn()
        self.out = out
        self.calls = calls
        self.fn = fn  # keeps the captured inputs alive: a replay reads them (freed inputs faulted at I = 16384)
        self.times: list[float] = []


def measure_graphs(graphs: dict[Any, GraphCalls], rounds: int, seed: int = 0) -> None:
    """Interleaved rounds: every graph once per round, in a fresh random order, between two CUDA events, one
    synchronisation per round (the GPU stays busy, as in a decode loop); per-call ms appended to each ``.times``."""
    keys = list(graphs)
    for g in graphs.values():  # one untimed replay each (first-replay upload)
        g.graph.replay()
    torch.cuda.synchronize()
    rng = random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(keys)
        evs = []
        for k in keys:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graphs[k].graph.replay()
            b.record()
            evs.append((k, a, b))
        torch.cuda.synchronize()
        for k, a, b in evs:
            graphs[k].times.append(a.elapsed_time(b) / graphs[k].calls)


def round_quantiles(ts: Sequence[float]) -> tuple[float, float, float]:
    """p20, median, p80 of per-round times."""
    s = sorted(ts)
    q = statistics.quantiles(s, n=10, method="inclusive") if len(s) > 1 else [s[0]] * 9
    return q[1], statistics.median(s), q[7]


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def busy_intervals_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals: the time at least one of them runs."""
    busy = 0.0
    cur: list[float] | None = None
    for s, e in sorted(intervals):
        if cur is None or s > cur[1]:
            if cur is not None:
                busy += cur[1] - cur[0]
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    if cur is not None:
        busy += cur[1] - cur[0]
    return busy


def gpu_busy_us(fn: Callable[[], Any], kernels: dict[str, float] | None = None) -> float:
    """GPU busy time of one call of ``fn`` on CUDA, in us: the union of the intervals of the kernels (and copies /
    memsets) the profiler records, so overlapping kernels (programmatic dependent launch) count once and host gaps
    not at all. Steadier than wall time where the host is noisy and a step is partly host-bound (decode).
    ``kernels``: also add each kernel's summed duration (us) under its name."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    events = [e for e in prof.events() if e.device_type == cuda and e.device_time_total > 0]
    if kernels is not None:
        for e in events:
            kernels[e.name] = kernels.get(e.name, 0.0) + e.time_range.end - e.time_range.start
    return busy_intervals_us((e.time_range.start, e.time_range.end) for e in events)


def dynamo_lookup_us(fn: Callable[[], Any]) -> float:
    """Host time Dynamo spends looking up its cache (evaluating the compiled frames' guards) during one call of
    ``fn``, in us: the summed "TorchDynamo Cache Lookup" ranges of a CPU profile, one per call of a compiled frame."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.cpu_time_total for e in prof.events() if e.name == "TorchDynamo Cache Lookup")


def peak_memory(fn: Callable[[], Any], device: str) -> int | None:
    """``torch.cuda.max_memory_allocated`` over one call of ``fn`` (absolute: includes what is already allocated,
    as the anchors measured it). None on the CPU."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated())


# ---------------------------------------------------------------------------------------------------------------
# Ceilings measured in the same run
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Ceilings:
    copy_gbps: float
    gemm_tflops: dict[str, float]  # per dtype name

    def for_metric(self, metric: str, dtype: str) -> tuple[str, float]:
        if metric == "bandwidth":
            return "copy_GBps", self.copy_gbps
        return f"gemm_{dtype}_TFLOPs", self.gemm_tflops.get(dtype, float("nan"))


def measure_ceilings(timer: Timer, device: str, dtypes: Iterable[str]) -> tuple[Ceilings, list[dict[str, Any]]]:
    rows: list[dict[str, Any]] = []
    if device == "cuda":
        n_copy = 1 << 30  # 1 Gi bf16 elements = 2 GiB per buffer (the anchors' measurement)
        a = torch.empty(n_copy, dtype=torch.bfloat16, device=device)
        gemm_n = 8192
    else:
        n_copy = max(64 << 20, 4 * llc_bytes()) // 2  # bf16 elements; 4x the LLC, at least 128 MiB per buffer
        a = torch.empty(n_copy, dtype=torch.bfloat16)
        gemm_n = 1024
    a.fill_(1.0)
    b = torch.empty_like(a)
    t = timer.time(lambda a=a, b=b: b.copy_(a), working_set_bytes=4 * n_copy)
    copy_bytes = 2 * n_copy * 2
    copy_gbps = copy_bytes / t.p50 / 1e6
    rows.append(dict(op="ceiling", provider="device copy", role="ceiling", mode="copy", dtype="bf16",
                     shape=f"elems={n_copy}", time_p20_ms=t.p20, time_p50_ms=t.p50, time_p80_ms=t.p80,
                     bytes=copy_bytes, gbps=copy_gbps, status="ok"))
    del a, b
    gemm: dict[str, float] = {}
    for name in dtypes:
        dt = DTYPES[name]
        x = torch.randn(gemm_n, gemm_n, device=device, dtype=dt)
        y = torch.randn(gemm_n, gemm_n, device=device, dtype=dt)
        t = timer.time(lambda x=x, y=y: x @ y, working_set_bytes=3 * x.numel() * x.element_size())
        flops = 2 * gemm_n**3
        gemm[name] = flops / t.p50 / 1e9
        rows.append(dict(op="ceiling", provider="gemm", role="ceiling", mode="fwd", dtype=name,
                         shape=f"M={gemm_n},N={gemm_n},K={gemm_n}", M=gemm_n, N=gemm_n, K=gemm_n,
                         time_p20_ms=t.p20, time_p50_ms=t.p50, time_p80_ms=t.p80, flops=flops, tflops=gemm[name],
                         status="ok"))
        del x, y
    if device == "cuda":
        torch.cuda.empty_cache()
    return Ceilings(copy_gbps, gemm), rows


# ---------------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------------


def max_abs_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| over the entries where ``ref`` is finite (NaN in ``out`` there gives NaN)."""
    o = out.detach().to(ref.dtype)
    r = ref.detach()
    mask = torch.isfinite(r)
    if not bool(mask.any()):
        return 0.0
    return float((o[mask] - r[mask]).abs().max().item())


def two_x_rule(ours: float, eager: float, dtype: torch.dtype) -> bool:
    """flash-attention's rule (tests/_utils.py): ours <= 2 x the same-dtype PyTorch error + a per-dtype floor."""
    return ours <= 2 * eager + FLOOR[dtype]


# ---------------------------------------------------------------------------------------------------------------
# CSV rows
# ---------------------------------------------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.6g}"
    return str(v)


def op_dtype_key(row: dict[str, str]) -> tuple[str, ...]:
    """The default merge key of ``ResultWriter``: rows are replaced per (op, dtype)."""
    return (row.get("op", ""), row.get("dtype", ""))


class ResultWriter:
    """Collects rows and rewrites ``path`` atomically on every ``checkpoint()``.

    With ``merge=True`` rows already in the file whose ``key`` (default (op, dtype)) is *not* measured by this run are
    kept (so one op can be rerun after a merge without losing the others); rows of the keys this run measures are
    replaced. ``columns`` defaults to the sweep's long format (``COLUMNS``); a benchmark with its own table (decode.py)
    passes its own.
    """

    def __init__(self, path: Path, env: dict[str, str], *, merge: bool = True, mirror: Path | None = None,
                 columns: Sequence[str] = COLUMNS,
                 key: Callable[[dict[str, str]], tuple[str, ...]] = op_dtype_key) -> None:
        self.path = path
        self.mirror = mirror  # a second copy (e.g. $OUT/<device>/sweep.csv on the GPU machine)
        self.env = env
        self.columns = list(columns)
        self.key = key
        self.rows: list[dict[str, str]] = []
        self.kept: list[dict[str, str]] = []
        self.ops_run: set[tuple[str, ...]] = set()
        if merge and path.exists():
            with path.open(newline="") as f:
                self.kept = list(csv.DictReader(f))

    def add(self, **row: Any) -> dict[str, str]:
        full = {c: "" for c in self.columns}
        full.update({k: v for k, v in self.env.items() if k in full})
        for k, v in row.items():
            if k not in full:
                raise KeyError(f"unknown CSV column {k!r}")
            full[k] = _fmt(v)
        self.rows.append(full)
        self.ops_run.add(self.key(full))
        return full

    def checkpoint(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        keep = [r for r in self.kept if self.key(r) not in self.ops_run]
        tmp = self.path.with_suffix(".csv.tmp")
        with tmp.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.columns, extrasaction="ignore")
            w.writeheader()
            for r in keep + self.rows:
                w.writerow({c: r.get(c, "") for c in self.columns})
        os.replace(tmp, self.path)
        if self.mirror is not None and self.mirror.resolve() != self.path.resolve():
            self.mirror.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.path, self.mirror)


def out_mirror(slug: str, name: str) -> Path | None:
    """``$OUT/<slug>/<name>`` when ``$OUT`` is set (the GPU machine returns what is written there)."""
    out = os.environ.get("OUT")
    return Path(out) / slug / name if out else None


def add_result_args(p: Any, csv_name: str, *, plot: bool = True,
                    fresh_help: str = "start a new CSV instead of replacing only this run's ops") -> None:
    """The output options of the GPU benchmarks that write one CSV (and a plot) under
    ``<results-root>/<device-slug>/``: --kernel, --results-root, --csv-name, --fresh (and --no-plot)."""
    p.add_argument("--kernel", default=str(ROOT), help="checkout path or Hub repo id (default: this checkout)")
    p.add_argument("--results-root", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--csv-name", default=csv_name)
    p.add_argument("--fresh", action="store_true", help=fresh_help)
    if plot:
        p.add_argument("--no-plot", action="store_true")


def result_writer(args: Any, env: dict[str, str], **kw: Any) -> ResultWriter:
    """The ResultWriter of ``add_result_args``' options: ``<results-root>/<device-slug>/<csv-name>``, merged unless
    --fresh, mirrored under $OUT; ``kw`` goes to ResultWriter (columns, key)."""
    slug = device_slug(env)
    return ResultWriter(Path(args.results_root) / slug / args.csv_name, env, merge=not args.fresh,
                        mirror=out_mirror(slug, args.csv_name), **kw)


def draw_plot(name: str, csv_path: Path) -> None:
    """``plot.<name>`` of the CSV's rows, the PNG next to it; without matplotlib the CSV is the result."""
    try:
        import plot

        path = getattr(plot, name)(read_rows(csv_path), csv_path.parent)
    except ImportError as e:
        log(f"no plot: {e}")
        return
    if path:
        log(f"wrote {path}")


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def fnum(v: str | None) -> float | None:
    """CSV cell -> float, None when empty."""
    if v is None or v == "":
        return None
    try:
        return float(v)
    except ValueError:
        return None


def shape_str(shape: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in shape.items())


# ---------------------------------------------------------------------------------------------------------------
# Time budget
# ---------------------------------------------------------------------------------------------------------------


class Budget:
    """A wall-clock budget split between ops by weight; time an op leaves unused goes to the ops after it."""

    def __init__(self, total_s: float, weights: dict[str, float]) -> None:
        self.start = time.monotonic()
        self.total_s = total_s
        self.weights = dict(weights)

    def remaining(self) -> float:
        return self.total_s - (time.monotonic() - self.start)

    def deadline_for(self, op: str) -> float:
        """Monotonic deadline for ``op``: its weight's share of what is left, among the ops still to run."""
        left = self.remaining()
        total_w = sum(self.weights.values()) or 1.0
        share = left * self.weights.get(op, 0.0) / total_w
        self.weights.pop(op, None)
        return time.monotonic() + max(share, 0.0)


def describe_exception(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}".replace("\n", " ").replace(",", ";")
    return msg[:240]


def eprint(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def run_docs_recipe(name: str, doc: Path = ROOT / "docs" / "using-with-transformers.md") -> dict[str, Any]:
    """Executes the Python block that follows ``<!-- recipe:<name> -->`` in ``doc`` (the user-facing text is what runs)
    and returns its namespace."""
    text = doc.read_text()
    m = re.search(rf"<!-- recipe:{re.escape(name)} -->\s*```python\n(.*?)```", text, re.S)
    if m is None:
        raise LookupError(f"no recipe {name!r} in {doc}")
    # A registered module, as if the user had pasted the block into one: Dynamo imports a traced function's module.
    mod = ModuleType(f"fused_mlp_recipe_{name.replace('-', '_')}")
    sys.modules[mod.__name__] = mod
    exec(compile(m.group(1), f"{doc}:recipe:{name}", "exec"), mod.__dict__)  # noqa: S102 - our own docs
    return mod.__dict__
