"""docs/using-with-transformers.md's ``sdpa-causal-skip`` recipe, run from the docs text itself (as
``benchmarks/e2e.py --sdpa-causal-skip`` runs it): under ``torch.compile`` a causal SDPA model called without a
padding mask gets ``attn_mask=None, is_causal=True`` even where transformers cannot skip the mask itself (torch <
2.14, simulated here by making transformers' ``is_torchdynamo_exporting`` read True, as Dynamo on those versions
does), with logits equal to the eager model's; a padded batch, a sliding window and a filled cache still get the
materialised mask. Also pins the claim the docs make about this machine's torch: on torch >= 2.14 transformers skips
the mask under compile by itself. CPU, tiny fp32 Llama / Mistral models, Dynamo with a graph-inspecting backend (no
code generation)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

tf = pytest.importorskip("transformers")
from transformers import masking_utils  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def run_docs_recipe(name):
    """bench_lib.run_docs_recipe, imported here: benchmarks/ and docs/ are not in kernel-builder's test source set."""
    if not (ROOT / "benchmarks" / "bench_lib.py").exists() or not (ROOT / "docs").is_dir():
        pytest.skip("needs the checkout's benchmarks/ and docs/")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_lib import run_docs_recipe as run

    return run(name)


def sdpa_calls(model, run):
    """(attn_mask is None, is_causal) of every SDPA call Dynamo captures while ``run(compiled model)`` runs (a
    fullgraph compile whose backend only inspects the graph), and what ``run`` returned."""
    seen = []

    def backend(gm, example_inputs):
        for n in gm.graph.nodes:
            if n.op == "call_function" and "scaled_dot_product_attention" in str(n.target):
                mask = n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None)
                seen.append((mask is None, n.kwargs.get("is_causal", False)))
        return gm.forward

    torch._dynamo.reset()
    try:
        return seen, run(torch.compile(model, backend=backend, fullgraph=True))
    finally:
        torch._dynamo.reset()


def sdpa_masks(model, **inputs):
    """sdpa_calls of an inference forward, and the largest difference of its logits from the eager model's."""
    with torch.no_grad():
        ref = model(**inputs).logits
        seen, out = sdpa_calls(model, lambda c: c(**inputs).logits)
    return seen, (out - ref).abs().max().item()


def tiny(family="llama", **kw):
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, attn_implementation="sdpa", **kw)
    if family == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(**common)).eval()
    return tf.LlamaForCausalLM(tf.LlamaConfig(**common)).eval()


@pytest.fixture
def old_torch_masking(monkeypatch):
    """transformers' mask code as it behaves under Dynamo on torch < 2.14 (is_exporting() folded to True), with the
    stock sdpa mask function restored afterwards (the recipe registers its own globally)."""
    stock = dict(masking_utils.AttentionMaskInterface._global_mapping)
    monkeypatch.setattr(masking_utils, "is_torchdynamo_exporting", lambda: True)
    yield
    masking_utils.AttentionMaskInterface._global_mapping.clear()
    masking_utils.AttentionMaskInterface._global_mapping.update(stock)


def test_stock_transformers_skips_the_mask_on_this_torch():
    if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 14):
        pytest.skip("transformers skips the mask under compile only on torch >= 2.14")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    seen, diff = sdpa_masks(tiny(), input_ids=ids)
    assert seen == [(True, True)] * 2, seen
    assert diff == 0.0


def test_recipe_gives_sdpa_is_causal_under_compile(old_torch_masking):
    model = tiny()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    seen, _ = sdpa_masks(model, input_ids=ids)
    assert seen and all(not none for none, _ in seen), f"the simulated old torch should materialise the mask: {seen}"
    run_docs_recipe("sdpa-causal-skip")
    seen, diff = sdpa_masks(model, input_ids=ids)
    assert seen == [(True, True)] * 2, seen
    assert diff <= 1e-5, diff
    # Training (train mode, labels, backward): the same skip.
    model.train()
    seen, _ = sdpa_calls(model, lambda c: c(input_ids=ids, labels=ids).loss.backward())
    assert seen == [(True, True)] * 2, seen
    # What the recipe returns None for, the stock function returns the plain causal mask for.
    ns = run_docs_recipe("sdpa-causal-skip")
    assert ns["sdpa_mask_causal_skip"](2, 16, 16) is None
    full = masking_utils.sdpa_mask(2, 16, 16, allow_is_causal_skip=False)
    assert torch.equal(full[0, 0], torch.ones(16, 16, dtype=torch.bool).tril())


def test_recipe_keeps_the_mask_where_it_is_needed(old_torch_masking):
    run_docs_recipe("sdpa-causal-skip")
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 128, (2, 16), generator=gen)
    pad = torch.ones(2, 16, dtype=torch.long)
    pad[1, :5] = 0  # a left-padded row
    seen, diff = sdpa_masks(tiny(), input_ids=ids, attention_mask=pad)
    assert seen and all(not none for none, _ in seen), seen
    assert diff <= 1e-5, diff
    # Sliding window shorter than the sequence: the window needs the mask.
    seen, diff = sdpa_masks(tiny("mistral", sliding_window=8), input_ids=ids)
    assert seen and all(not none for none, _ in seen), seen
    assert diff <= 1e-5, diff
    # Each condition of the recipe alone keeps transformers' mask: an offset (a filled cache), a traced (tensor)
    # offset, a rectangular block, a window, a padding mask, another mask function, the caller's veto.
    ns = run_docs_recipe("sdpa-causal-skip")
    fn = ns["sdpa_mask_causal_skip"]
    assert fn(2, 16, 16) is None
    for kw in (dict(q_offset=16), dict(kv_offset=4), dict(q_offset=torch.tensor(0)), dict(local_size=8),
               dict(attention_mask=torch.ones(2, 16, dtype=torch.bool)),
               dict(mask_function=masking_utils.and_masks(masking_utils.causal_mask_function)),
               dict(allow_is_causal_skip=False)):
        assert fn(2, 16, 16, **kw) is not None, kw
    assert fn(2, 4, 20) is not None
