#!/usr/bin/env python3
"""The main job: kernelize a Gemma-shaped transformers model with fused-mlp, check parity, print timings.

Builds a Gemma model from a config with random weights (no download, no network), loads this checkout's kernel
the way users do (`get_kernel("kernels-community/fused-mlp", version=1)`, resolved through LOCAL_KERNELS to
this checkout's build/), opts Gemma's undecorated classes in with `replace_kernel_forward_from_hub`, kernelizes
copies of the model in INFERENCE and in TRAINING mode, and prints

  * parity of logits, loss and every parameter gradient against the unkernelized model (fp32: max relative
    error <= 1e-4; bf16/fp16: the 2x rule against an fp32 copy of the model, as the tests use), and
  * time per forward and per training step, eager vs kernelized (and vs torch.compile on CUDA).

Exits non-zero when parity fails.   python example.py [--size tiny|small|2b] [--dtype fp32|bf16] [--device ...]
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
REPO_ID = "kernels-community/fused-mlp"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("LOCAL_KERNELS", f"{REPO_ID}={ROOT}")

import torch  # noqa: E402

sys.path.insert(0, str(ROOT / "tools"))
from hf_compat import check_versions  # noqa: E402  (shared with the tests)

# Gemma-shaped configs. "2b" has Gemma-2B's layer shapes (hidden 2048, GeGLU 16384, 8 heads, 1 KV head of 256).
SIZES = {
    "tiny": dict(hidden_size=128, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=1, head_dim=32, vocab_size=512, batch=2, seq=64),
    "small": dict(hidden_size=256, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=64, vocab_size=1024, batch=2, seq=256),
    "2b": dict(hidden_size=2048, intermediate_size=16384, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=1, head_dim=256, vocab_size=4096, batch=2, seq=2048),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP32_RTOL = 1e-4
HALF_FLOOR = {torch.bfloat16: 8e-3, torch.float16: 1e-3}


def log(msg: str) -> None:
    print(msg, flush=True)


def build_model(size: str, dtype: torch.dtype, device: str, seed: int = 0):
    import transformers as tf

    cfg_kw = {k: v for k, v in SIZES[size].items() if k not in ("batch", "seq")}
    cfg = tf.GemmaConfig(**cfg_kw, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=4096,
                         attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = tf.GemmaForCausalLM(cfg)
    # Gemma initialises its norm weights to zero ((1 + w) = 1); random weights exercise the kernels properly.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.1)
    return model.to(device=device, dtype=dtype)


def layer_mapping(kernel_module) -> dict:
    """kernels' mapping from layer names to this checkout's layers, for the layers the build provides."""
    from kernels import LocalLayerRepository

    names = [n for n in ("RMSNorm", "GemmaRMSNorm", "GeGLUMLP") if hasattr(kernel_module.layers, n)]
    return {n: {d: LocalLayerRepository(repo_path=ROOT, layer_name=n) for d in ("cpu", "cuda")} for n in names}


def opt_in_gemma() -> None:
    from kernels import replace_kernel_forward_from_hub
    from transformers.models.gemma.modeling_gemma import GemmaMLP, GemmaRMSNorm

    replace_kernel_forward_from_hub(GemmaRMSNorm, "GemmaRMSNorm")
    replace_kernel_forward_from_hub(GemmaMLP, "GeGLUMLP")


def kernelized_copy(model, mapping, mode, device: str):
    from kernels import kernelize, use_kernel_mapping

    m = copy.deepcopy(model)
    with use_kernel_mapping(mapping, inherit_mapping=False):
        return kernelize(m, mode=mode, device=device)


def replaced_summary(model) -> str:
    """Which module classes had their forward replaced by a fused-mlp layer, and how many of each."""
    counts: dict[str, int] = {}
    for mod in model.modules():
        fwd = vars(mod).get("forward")
        if fwd is not None and getattr(fwd, "__func__", None) is not type(mod).forward:
            counts[type(mod).__name__] = counts.get(type(mod).__name__, 0) + 1
    return ", ".join(f"{n} x{c}" for n, c in sorted(counts.items())) or "none"


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, device: str, reps: int) -> float:
    fn()  # warm-up (compilation, caches)
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


class Parity:
    """Collects comparisons; fp32 uses a relative tolerance, half dtypes the 2x rule vs an fp32 model."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.rows: list[tuple[str, float, float, str, bool]] = []

    def add(self, name: str, ours: torch.Tensor, eager: torch.Tensor, ref32: torch.Tensor | None) -> None:
        if self.dtype == torch.float32:
            r = rel_err(ours, eager)
            ok = r <= FP32_RTOL
            self.rows.append((name, abs_err(ours, eager), r, f"rel <= {FP32_RTOL:g}", ok))
        else:
            assert ref32 is not None
            ours_e, eager_e = abs_err(ours, ref32), abs_err(eager, ref32)
            bound = 2 * eager_e + HALF_FLOOR[self.dtype] * max(1.0, ref32.abs().max().item())
            ok = ours_e <= bound
            self.rows.append((name, abs_err(ours, eager), rel_err(ours, eager),
                              f"|ours-fp32| {ours_e:.3g} <= 2x eager's {eager_e:.3g} + floor", ok))

    @property
    def ok(self) -> bool:
        return all(r[-1] for r in self.rows)

    def print(self) -> None:
        log(f"\n{'parity check':<34} {'max abs':>10} {'max rel':>10}  {'criterion':<46} result")
        for name, a, r, crit, ok in self.rows:
            log(f"{name:<34} {a:>10.3g} {r:>10.3g}  {crit:<46} {'pass' if ok else 'FAIL'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", choices=sorted(SIZES), default=None, help="default: small on CPU, 2b on CUDA")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: fp32 on CPU, bf16 on CUDA")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default: 5 CPU, 20 CUDA)")
    args = ap.parse_args()
    device = args.device
    size = args.size or ("2b" if device == "cuda" else "small")
    dtype = DTYPES[args.dtype or ("bf16" if device == "cuda" else "fp32")]
    reps = args.reps or (20 if device == "cuda" else 5)
    t_start = time.perf_counter()

    check_versions()
    from kernels import Mode, get_kernel

    # kernels warns once per module for every tagged layer that has no mapping here (rotary embeddings,
    # activations): the summary printed below says what was replaced.
    logging.getLogger("kernels").setLevel(logging.ERROR)

    log(f"[1/5] loading {REPO_ID} (LOCAL_KERNELS -> {ROOT})")
    fm = get_kernel(REPO_ID, version=1)
    log(f"      variant {Path(fm.__file__).parent.name}, module {fm.__name__}")
    opt_in_gemma()
    mapping = layer_mapping(fm)
    log(f"      layers mapped: {', '.join(mapping)}")

    shape = SIZES[size]
    log(f"[2/5] building a Gemma-shaped model ({size}: hidden {shape['hidden_size']}, "
        f"intermediate {shape['intermediate_size']}, {shape['num_hidden_layers']} layers), {dtype}, {device}")
    model = build_model(size, dtype, device)
    torch.manual_seed(1)
    ids = torch.randint(0, shape["vocab_size"], (shape["batch"], shape["seq"]), device=device)
    ref32 = build_model(size, torch.float32, device) if dtype != torch.float32 else None

    parity = Parity(dtype)
    log("[3/5] INFERENCE: kernelize and compare logits")
    model.eval()
    k_inf = kernelized_copy(model, mapping, Mode.INFERENCE, device)
    log(f"      replaced: {replaced_summary(k_inf)}")
    with torch.no_grad():
        logits_eager = model(input_ids=ids).logits
        logits_k = k_inf(input_ids=ids).logits
        logits_32 = ref32.eval()(input_ids=ids).logits if ref32 is not None else None
    parity.add("logits (inference)", logits_k, logits_eager, logits_32)

    log("[4/5] TRAINING: kernelize, loss and every parameter gradient")
    model.train()
    k_train = kernelized_copy(model, mapping, Mode.TRAINING, device)

    def loss_and_grads(m):
        m.zero_grad(set_to_none=True)
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}

    loss_e, grads_e = loss_and_grads(model)
    loss_k, grads_k = loss_and_grads(k_train)
    loss_32, grads_32 = loss_and_grads(ref32.train()) if ref32 is not None else (None, {})
    parity.add("loss (training)", loss_k, loss_e, loss_32)
    worst = None
    for name, g in grads_e.items():
        gk = grads_k.get(name)
        if gk is None:
            parity.rows.append((f"grad {name}", float("nan"), float("nan"), "missing gradient", False))
            continue
        scratch = Parity(dtype)
        scratch.add(name, gk, g, grads_32.get(name))
        row = scratch.rows[0]
        if not row[-1] or worst is None or row[2] > worst[2]:
            worst = row
        if not row[-1]:
            parity.rows.append(("grad " + name, *row[1:]))
    if worst is not None and worst[-1]:
        parity.rows.append((f"grads ({len(grads_e)} params, worst)", *worst[1:]))
    parity.print()

    log(f"\n[5/5] timing ({reps} reps, median)")
    timings: list[tuple[str, float, float]] = []

    def fwd(m):
        with torch.no_grad():
            m(input_ids=ids)

    def step(m):
        m.zero_grad(set_to_none=True)
        m(input_ids=ids, labels=ids).loss.backward()

    t_fe, t_fk = time_ms(lambda: fwd(model), device, reps), time_ms(lambda: fwd(k_inf), device, reps)
    t_se, t_sk = time_ms(lambda: step(model), device, reps), time_ms(lambda: step(k_train), device, reps)
    timings += [("forward (no grad)", t_fe, t_fk), ("training step", t_se, t_sk)]
    compiled = None
    if device == "cuda":
        compiled = torch.compile(model)
        t_fc = time_ms(lambda: fwd(compiled), device, reps)
        t_sc = time_ms(lambda: step(compiled), device, reps)
    log(f"{'':<20} {'eager ms':>10} {'fused-mlp ms':>13} {'speedup':>8}" + (f" {'compile ms':>11}" if compiled is not None else ""))
    for i, (name, te, tk) in enumerate(timings):
        extra = f" {[t_fc, t_sc][i]:>11.2f}" if compiled is not None else ""
        log(f"{name:<20} {te:>10.2f} {tk:>13.2f} {te / tk:>7.2f}x{extra}")
    log(f"\ntotal {time.perf_counter() - t_start:.0f} s; parity {'PASSED' if parity.ok else 'FAILED'}")
    return 0 if parity.ok else 1


if __name__ == "__main__":
    sys.exit(main())
