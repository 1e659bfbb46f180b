"""minispec.lab.graph_rules: what keeps a step from being captured in a CUDA graph, found on the CPU."""

import itertools
import random

import pytest
import torch

from minispec import KVCache, load
from minispec.cuda_graphs import static_forward
from minispec.kv import StaticKVCache
from minispec.lab.graph_rules import best_buckets, dispatch_cost_s, find_hazards, padding_waste, record_ops
from minispec.model import Transformer
from minispec.lab.scale import llama_config

T = torch.tensor([3, 4])


@pytest.mark.parametrize("fn,what", [
    (lambda: int(T.max()), "int(tensor)"), (lambda: T.max().item(), ".item()"), (lambda: T.tolist(), ".tolist()"),
    (lambda: T.cpu(), ".cpu()"), (lambda: T.to("cpu"), "to('cpu')"), (lambda: T.nonzero(), "nonzero"),
    (lambda: T[T > 3], "boolean-mask"), (lambda: bool(T.sum() > 2), "bool(tensor)"),
])
def test_each_host_sync_is_found(fn, what):
    with torch.inference_mode():
        _, rec = record_ops(fn)
    assert rec.hazards and any(what.split("(")[0].strip(".") in h for h in rec.hazards), rec.hazards


def test_elementwise_work_is_no_hazard():
    _, rec = record_ops(lambda: (T + 1) * 2)
    assert rec.hazards == [] and rec.kernels == 2


def test_transformer_forward_syncs_and_changes_shape_but_the_static_forward_does_not():
    model, _ = load("tiny-llama")
    kv = KVCache.for_model(model, 64)
    skv = StaticKVCache.for_model(model, 64)
    m = torch.ones(1, 1, 1, dtype=torch.bool)
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]), kv=kv)
        kv.commit()

        def eager(tok):
            out = model(tok, kv=kv)
            kv.commit()
            return out
        found = find_hazards(eager, ((torch.tensor([[4]]),), {}), ((torch.tensor([[5]]),), {}))
        assert any("int(tensor)" in h for h in found) and any("shapes change" in h for h in found)
        static = find_hazards(lambda t, p: static_forward(model, skv, t, p, m),
                              ((torch.tensor([[4]]), torch.tensor([[3]])), {}),
                              ((torch.tensor([[5]]), torch.tensor([[4]])), {}))
        assert static == []


def test_kernels_of_an_8b_step_counted_on_the_meta_device():
    cfg = llama_config("llama-3.1-8b")
    with torch.device("meta"):
        model = Transformer(cfg)
    kv = StaticKVCache.for_model(model, 16)
    z = torch.zeros(1, 1, dtype=torch.long, device="meta")
    with torch.inference_mode():
        _, rec = record_ops(lambda: static_forward(model, kv, z, z, torch.ones(1, 1, 1, dtype=torch.bool, device="meta")))
    assert rec.counts()["addmm"] + rec.counts()["mm"] + rec.counts()["linear"] + rec.counts()["_linear_pointwise"] \
        + rec.counts()["matmul"] + rec.counts()["bmm"] >= 4 * cfg.n_layer  # at least the four projections per layer
    assert rec.kernels > 15 * cfg.n_layer  # hundreds of launches for one token: what a graph replays at once


def test_dispatch_cost_is_a_positive_time():
    t = dispatch_cost_s(reps=200)
    assert 0 < t < 1e-2


def test_padding_waste_counts_padded_slots():
    assert padding_waste([1, 3, 5, 8], (1, 2, 4, 8)) == 0 + 1 + 3 + 0
    assert padding_waste([61] * 4, (1, 2, 4, 8, 16, 32, 64)) == 12
    assert padding_waste([], (4,)) == 0
    with pytest.raises(ValueError):
        padding_waste([9], (1, 8))


def _brute_waste(sizes, k):
    vals = sorted(set(sizes))
    best = None
    for r in range(1, min(k, len(vals)) + 1):
        for rest in itertools.combinations(vals[:-1], r - 1):
            w = padding_waste(sizes, (*rest, vals[-1]))
            best = w if best is None else min(best, w)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_best_buckets_equals_brute_force(seed):
    rng = random.Random(seed)
    sizes = [rng.choice([1, 2, 5, 8, 9, 16, 30, 31, 61, rng.randint(1, 64)]) for _ in range(rng.randint(1, 25))]
    k = rng.randint(1, 5)
    got = best_buckets(sizes, k)
    assert got == sorted(set(got)) and len(got) <= k and max(got) == max(sizes)
    assert padding_waste(sizes, got) == _brute_waste(sizes, k)


def test_best_buckets_edges():
    assert best_buckets([7], 3) == [7]
    assert best_buckets([1, 2, 3], 3) == [1, 2, 3]
    assert best_buckets([1, 1, 1, 10], 1) == [10]
    assert best_buckets([1, 1, 1, 10], 2) == [1, 10]
    with pytest.raises(ValueError):
        best_buckets([], 2)
    with pytest.raises(ValueError):
        best_buckets([3], 0)
