"""How many ATen ops one decode forward runs (issue 61 item 5): a one-row decode step on the exact backend, counted
with torch.profiler (every op, nested ones and views included), per layer and for the rest of the forward, so that a
change that adds ops to every layer fails here. The counts follow the code path, not the machine: the row recipes
and the attention's padding, which a CPU's probes choose, are fixed here (one row padded to two, no attention
padding), as a CPU might choose them. ``benchmarks/forward_ops.py`` counts SmolLM2's forward the same way."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

import minispec
from minispec.exact import attention as exact_attention
from minispec.exact import recipes
from minispec.exact.kernels import onednn_available
from minispec.exact.linear import ExactLinear
from minispec.kv import KVCache
from minispec.model import Block

# At most this many ops per layer of a one-row decode step after 300 keys (three key blocks), and for the rest of
# the forward (embedding, RoPE rows, the plan, the final norm, the LM head), as counted on torch 2.13 with every
# linear layer's one row padded to two. The panels' linear layer runs more ops than oneDNN's one (x expanded over
# the panels, its product with two resolve_conj, the first row of each panel copied out); docs/results.md says
# where a SmolLM2 layer's ops go.
PER_LAYER = {"onednn": 90, "panels": 110}
REST = {"onednn": 45, "panels": 50}


def count_ops(model, context: int = 300) -> tuple[list[int], int]:
    """Ops of each block, and of the rest, in one one-row forward after ``context`` tokens."""
    kv = KVCache.for_model(model, context + 16)  # room to spare, as a decode loop's cache has
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        model(torch.randint(0, model.cfg.vocab_size, (1, context), generator=g), kv=kv)
        kv.commit()
        x = torch.tensor([[1]])
        model(x, kv=kv)  # warm: recipes, prepacked weights
        kv.discard()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(x, kv=kv)
        kv.discard()
    events = [e for e in prof.events() if e.name.startswith("aten::") or e.name.startswith("block ")]
    blocks = [e.time_range for e in events if e.name.startswith("block ")]
    per_block = Counter()
    rest = 0
    for e in events:
        if e.name.startswith("aten::"):
            b = next((i for i, r in enumerate(blocks) if r.start <= e.time_range.start and e.time_range.end <= r.end), None)
            if b is None:
                rest += 1
            else:
                per_block[b] += 1
    return [per_block[i] for i in range(len(blocks))], rest


@pytest.mark.parametrize("kernel", ["onednn", "panels"])
def test_a_one_row_decode_forward_runs_few_ops_per_layer(kernel, monkeypatch):
    if kernel == "onednn" and not onednn_available():
        pytest.skip("this PyTorch build has no oneDNN")
    monkeypatch.setattr(ExactLinear, "cpu_kernel", kernel)
    monkeypatch.setattr(recipes, "_RECIPES", {})
    monkeypatch.setattr(recipes, "choose_recipe", lambda kernel, *a: recipes.RowRecipe(kernel, 1, 2, (1,)))
    monkeypatch.setattr(exact_attention, "attention_padding", lambda hd, dtype=None: exact_attention.AttentionPadding())
    block_forward = Block.forward

    def named(self, *args, **kwargs):  # each block's ops under its own name
        with record_function(f"block {self.attn.layer}"):
            return block_forward(self, *args, **kwargs)

    monkeypatch.setattr(Block, "forward", named)
    model, _ = minispec.load("tiny-llama")
    assert model.attention == "exact"
    per_block, rest = count_ops(model)
    assert len(per_block) == model.cfg.n_layer
    assert max(per_block) <= PER_LAYER[kernel], per_block
    assert rest <= REST[kernel], rest
