#!/usr/bin/env python3
"""Scale-out benchmark: training tokens/s per GPU of a Gemma-shaped model on 1 and 2 GPUs, under DDP and FSDP2
(``fully_shard``), eager vs kernelized (``kernels.kernelize``, Mode.TRAINING, this checkout's GemmaRMSNorm and
GeGLUMLP mapped through ``LocalLayerRepository``, exactly as tests/scripts/distributed_train.py and a user do it).

    python benchmarks/scale.py --out DIR                 # GPU: 1 and 2 GPUs (2 when present), ddp + fsdp2
    python benchmarks/scale.py --out DIR --quick         # smaller model, fewer steps
    python benchmarks/scale.py --out DIR --device cpu --quick   # CPU smoke run (gloo, tiny model, fp32)

The launcher starts ``python -m torch.distributed.run --standalone --nproc_per_node {1,2}`` on this file in worker
mode for every (world, engine, kernelized), collects the JSON every run writes, and writes ``DIR/scale.csv``,
``DIR/scale.png`` and ``DIR/runs/*.json|log``; it prints a table with kernelized/eager ratios and the 2-GPU
scaling efficiency (per-GPU tokens/s on 2 GPUs over 1 GPU). Every launch gets NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 (NVLink multicast stays off on shared hosts), and
OMP_NUM_THREADS=1 on the CPU.

Methodology (worker):
- Model: GemmaForCausalLM from a GemmaConfig (tanh-GeLU, sdpa attention), seed-0 random weights initialised on the
  device, identical in every process and for eager and kernelized (built by tests/scripts/distributed_train.make_model).
  GPU: **bf16 parameters, gradients and AdamW states** (no fp32 master weights, no autocast: the simplest
  set-up that runs the bf16 kernels; FSDP2 with its default policy, i.e. bf16 all-gather and reduce-scatter; DDP
  all-reduces bf16 gradients). CPU: fp32.
- Data: per step and rank a fixed random batch of ``batch x seq`` token ids (seed ``1000 * step + rank``), made
  before timing; ``labels = input_ids``. ``batch`` is per GPU (weak scaling: 2 GPUs process twice the tokens).
- Step: ``zero_grad; model(input_ids, labels).loss.backward(); AdamW.step``. ``warmup`` untimed steps, then
  ``steps`` timed ones. GPU: CUDA events around every step, one synchronize at the end; CPU: perf_counter.
  ``step_ms_median`` is the median over timed steps of the slowest rank's step time; ``tokens_per_s_total`` is
  all ranks' timed tokens over the slowest rank's total timed time; ``tokens_per_s_per_gpu`` = total / world.
- ``peak_mem_gb``: ``torch.cuda.max_memory_allocated`` of the process (model, grads, AdamW states, activations),
  max over ranks; empty on the CPU. ``loss_first`` / ``loss_last``: the mean over ranks of the first (warmup) and
  last step's loss (same weights and data, so eager and kernelized ``loss_first`` agree up to rounding).
- ``kernel_modules`` counts the modules running this package's layers; ``fallbacks`` lists any "runs the module's
  own math" warning seen during training (empty = the fused kernels ran on every step).

On the CPU the launcher runs eager and kernelized in one launch per (world, engine) by default (``--pairs``):
process start-up (importing torch and transformers) dominates there, and the numbers are only a smoke test. On a
GPU every variant gets its own processes (``--separate``, the default there).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "scripts"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

LAUNCH_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _k, _v in LAUNCH_ENV.items():  # also when the worker is started by hand
    os.environ.setdefault(_k, _v)

# GemmaConfig keyword arguments and run sizes per (device, quick).
GEMMA_FULL = dict(vocab_size=32000, hidden_size=2048, intermediate_size=16384, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=1, head_dim=256)
PRESETS = {
    ("cuda", False): dict(config=GEMMA_FULL, batch=4, seq=2048, warmup=5, steps=30, dtype="bf16"),
    ("cuda", True): dict(config={**GEMMA_FULL, "num_hidden_layers": 2}, batch=2, seq=2048, warmup=3, steps=8,
                         dtype="bf16"),
    ("cpu", False): dict(config=dict(vocab_size=256, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=1, head_dim=32),
                         batch=2, seq=64, warmup=2, steps=6, dtype="fp32"),
    ("cpu", True): dict(config=dict(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=1, head_dim=16),
                        batch=2, seq=32, warmup=1, steps=3, dtype="fp32"),
}
CONFIG_COLUMNS = {"hidden": "hidden_size", "intermediate": "intermediate_size", "layers": "num_hidden_layers",
                  "heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "head_dim": "head_dim",
                  "vocab": "vocab_size"}
COLUMNS = ["device", "gpu_name", "world", "engine", "kernelized", *CONFIG_COLUMNS, "params_m", "batch", "seq",
           "dtype", "warmup", "steps", "tokens_per_s_total", "tokens_per_s_per_gpu", "step_ms_median",
           "peak_mem_gb", "loss_first", "loss_last", "kernel_modules", "fallbacks", "torch", "git_rev"]
ENGINES = ("ddp", "fsdp2")


# ---------------------------------------------------------------------------------------------------------------
# Worker (one process per rank, under torch.distributed.run)
# ---------------------------------------------------------------------------------------------------------------


def _kernel_module_counts(model) -> dict[str, int]:
    counts: dict[str, int] = {}
    for m in model.modules():
        fn = getattr(m.forward, "__func__", None)
        mod = getattr(fn, "__module__", "") or ""
        if fn is not None and "fused_mlp" in mod and mod.endswith(".layers"):
            name = fn.__qualname__.split(".")[0]
            counts[name] = counts.get(name, 0) + 1
    return counts


def run_variant(kernelized: bool, args, device, dist) -> dict:
    import torch
    from distributed_train import kernelize_model, make_model, wrap

    rank, world = dist.get_rank(), dist.get_world_size()
    on_gpu = device.type == "cuda"
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    config = json.loads(args.config)
    model = make_model(device, config, init_device=device, dtype=dtype)
    n_params = sum(p.numel() for p in model.parameters())
    counts: dict[str, int] = {}
    if kernelized:
        model = kernelize_model(model, device)
        counts = _kernel_module_counts(model)
    wrapped = wrap(model, args.engine, device)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3, weight_decay=0.0)
    vocab = config["vocab_size"]
    total_steps = args.warmup + args.steps
    batches = [torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1000 * s + rank))
               .to(device) for s in range(total_steps)]
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(args.steps)]
    losses, cpu_times = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s, ids in enumerate(batches):
            timed = s - args.warmup
            if timed >= 0:
                if on_gpu:
                    events[timed][0].record()
                else:
                    t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = wrapped(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            if timed >= 0:
                if on_gpu:
                    events[timed][1].record()
                else:
                    cpu_times.append((time.perf_counter() - t0) * 1e3)
        if on_gpu:
            torch.cuda.synchronize()
            step_ms = [a.elapsed_time(b) for a, b in events]
            total_ms = events[0][0].elapsed_time(events[-1][1])
        else:
            step_ms, total_ms = cpu_times, sum(cpu_times)
    fallbacks = sorted({str(w.message) for w in caught if "fused_mlp" in str(w.message)})
    # Slowest rank per step and in total; mean loss over ranks.
    times = torch.tensor([*step_ms, total_ms], dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    loss_t = torch.stack(losses).float()
    dist.all_reduce(loss_t)
    loss_t /= world
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30 if on_gpu else 0.0], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    step_ms_max, total_max = times[:-1].tolist(), times[-1].item()
    tokens = world * args.batch * args.seq * args.steps
    tps = tokens / (total_max / 1e3)
    result = {
        "world": world, "engine": args.engine, "kernelized": kernelized,
        **{col: config[key] for col, key in CONFIG_COLUMNS.items()},
        "params_m": round(n_params / 1e6, 2), "batch": args.batch, "seq": args.seq, "dtype": args.dtype,
        "warmup": args.warmup, "steps": args.steps,
        "tokens_per_s_total": tps, "tokens_per_s_per_gpu": tps / world,
        "step_ms_median": statistics.median(step_ms_max), "step_ms": step_ms_max,
        "peak_mem_gb": peak.item() if on_gpu else None,
        "loss_first": loss_t[0].item(), "loss_last": loss_t[-1].item(), "losses": loss_t.tolist(),
        "kernel_modules": ";".join(f"{k}:{v}" for k, v in sorted(counts.items())),
        "fallbacks": " | ".join(fallbacks),
    }
    del wrapped, model, opt, batches, losses
    if on_gpu:
        torch.cuda.empty_cache()
    return result


def worker(args) -> NoReturn:
    import torch
    import torch.distributed as dist

    from bench_lib import cpu_name

    on_gpu = args.device == "cuda"
    dist.init_process_group("nccl" if on_gpu else "gloo")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    results = []
    for kernelized in [{"eager": False, "kernelized": True}[v] for v in args.variants.split(",")]:
        r = run_variant(kernelized, args, device, dist)
        r.update(device=args.device, gpu_name=torch.cuda.get_device_name(device) if on_gpu else cpu_name(),
                 torch=torch.__version__)
        results.append(r)
        dist.barrier()
    if dist.get_rank() == 0:
        args.json.write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
    # Leave without the interpreter's teardown, as tests/scripts/distributed_train.py does: there a gloo rank
    # sometimes aborts after the results are written ("terminate called without an active exception", SIGABRT).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------------------------


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def launch(args, world: int, engine: str, variants: list[str], preset: dict, runs: Path) -> list[dict]:
    tag = f"w{world}_{engine}_{'+'.join(variants)}"
    out_json, log = runs / f"{tag}.json", runs / f"{tag}.log"
    env = {**os.environ, **LAUNCH_ENV}
    if args.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU run on a GPU host: torch.distributed must not pick the GPUs
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
           str(Path(__file__).resolve()), "--worker", "--device", args.device, "--engine", engine,
           "--variants", ",".join(variants), "--config", json.dumps(preset["config"]),
           "--batch", str(preset["batch"]), "--seq", str(preset["seq"]), "--warmup", str(preset["warmup"]),
           "--steps", str(preset["steps"]), "--dtype", preset["dtype"], "--json", str(out_json)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = "timeout", f"{e.stdout or ''}{e.stderr or ''}"
        text = text.decode() if isinstance(text, bytes) else text
    log.write_text(text)
    took = time.perf_counter() - t0
    if rc != 0 or not out_json.exists():
        print(f"[scale] {tag}: FAILED (rc {rc}, {took:.0f} s), log {log}:\n{text[-3000:]}", file=sys.stderr)
        return []
    results = json.loads(out_json.read_text())
    speeds = ", ".join(f"{'kernelized' if r['kernelized'] else 'eager'} {r['tokens_per_s_per_gpu']:.0f} tok/s per rank"
                       for r in results)
    print(f"[scale] {tag}: {took:.0f} s, {speeds}", file=sys.stderr)
    return results


def write_csv(path: Path, results: list[dict], git_rev: str) -> list[dict[str, str]]:
    rows = [{c: _fmt({**r, "git_rev": git_rev}.get(c)) for c in COLUMNS} for r in results]
    tmp = path.with_suffix(".csv.tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)
    return rows


def plot(path: Path, rows: list[dict[str, str]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit = "GPU" if rows and rows[0]["device"] == "cuda" else "process"
    groups = sorted({(r["engine"], int(r["world"])) for r in rows}, key=lambda g: (ENGINES.index(g[0]), g[1]))
    val = {(r["engine"], int(r["world"]), r["kernelized"] == "true"): float(r["tokens_per_s_per_gpu"]) for r in rows}
    fig, ax = plt.subplots(figsize=(1.9 * max(len(groups), 2) + 1.5, 4.2))
    width = 0.38
    for i, (label, kern, color) in enumerate((("eager", False, "#9e9e9e"), ("kernelized", True, "#1f77b4"))):
        xs = [g + (i - 0.5) * width for g in range(len(groups))]
        ys = [val.get((e, w, kern), 0.0) for e, w in groups]
        ax.bar(xs, ys, width, label=label, color=color)
        if kern:
            for x, (e, w), y in zip(xs, groups, ys):
                base = val.get((e, w, False))
                if base and y:
                    ax.annotate(f"{y / base:.2f}x", (x, y), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(groups)))
    plural = "es" if unit == "process" else "s"
    ax.set_xticklabels([f"{e}\n{w} {unit}{plural if w > 1 else ''}" for e, w in groups])
    ax.set_ylabel(f"training tokens/s per {unit}")
    r0 = rows[0] if rows else {}
    ax.set_title(f"{r0.get('gpu_name', '')}: Gemma-shaped h{r0.get('hidden')} i{r0.get('intermediate')} "
                 f"L{r0.get('layers')}, {r0.get('batch')}x{r0.get('seq')} tokens/{unit}, {r0.get('dtype')}",
                 fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def launcher(args) -> int:
    import torch

    from bench_lib import git_revision
    from report import scale_table

    preset = dict(PRESETS[(args.device, args.quick)])
    for k in ("batch", "seq", "warmup", "steps"):
        if getattr(args, k) is not None:
            preset[k] = getattr(args, k)
    if args.layers is not None:
        preset["config"] = {**preset["config"], "num_hidden_layers": args.layers}
    if args.device == "cuda":
        n_gpu = torch.cuda.device_count()
        if n_gpu == 0:
            print("[scale] no CUDA device; use --device cpu", file=sys.stderr)
            return 2
        worlds = [1, 2] if n_gpu >= 2 else [1]
        if n_gpu < 2:
            print("[scale] one GPU only: measuring world 1", file=sys.stderr)
    else:
        worlds = [1, 2]
    engines = args.engines.split(",")
    pairs = args.pairs if args.pairs is not None else args.device == "cpu"
    variant_sets = [["eager", "kernelized"]] if pairs else [["eager"], ["kernelized"]]
    args.out.mkdir(parents=True, exist_ok=True)
    runs = args.out / "runs"
    runs.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    results: list[dict] = []
    failed = 0
    for world in worlds:
        for engine in engines:
            for variants in variant_sets:
                got = launch(args, world, engine, variants, preset, runs)
                failed += len(got) < len(variants)
                results += got
    rows = write_csv(args.out / "scale.csv", results, git_revision())
    if rows:
        plot(args.out / "scale.png", rows)
    print("\n".join(scale_table(rows)))
    print(f"\n[scale] {len(rows)} rows, {failed} failed launches, {time.perf_counter() - t0:.0f} s; wrote "
          f"{args.out / 'scale.csv'} and {args.out / 'scale.png'}", file=sys.stderr)
    return 1 if failed or not rows else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    p.add_argument("--quick", action="store_true", help="smaller model and fewer steps")
    p.add_argument("--out", type=Path, help="launcher: output folder (scale.csv, scale.png, runs/)")
    p.add_argument("--engines", default="ddp,fsdp2", help="launcher: comma-separated subset of ddp,fsdp2")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--pairs", dest="pairs", action="store_true", default=None,
                   help="launcher: eager and kernelized in one launch (default on the CPU)")
    g.add_argument("--separate", dest="pairs", action="store_false",
                   help="launcher: one launch per variant (default on a GPU)")
    p.add_argument("--timeout", type=int, default=600, help="launcher: seconds per launch")
    for k in ("batch", "seq", "warmup", "steps", "layers"):
        p.add_argument(f"--{k}", type=int, default=None, help="override the preset")
    # worker mode (set by the launcher)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--variants", default="eager,kernelized", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--dtype", choices=["bf16", "fp32"], help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.worker:
        return worker(args)
    if args.out is None:
        p.error("--out is required")
    return launcher(args)


if __name__ == "__main__":
    raise SystemExit(main())
