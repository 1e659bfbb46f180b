"""minispec.graph_rules: what keeps a step from being captured in a CUDA graph, found on the CPU."""

import pytest
import torch

from minispec import KVCache, load
from minispec.cuda_graphs import StaticKVCache, static_forward
from minispec.graph_rules import find_hazards, record_ops
from minispec.model import Transformer
from minispec.scale import llama_config

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
    assert rec.kernels > 20 * cfg.n_layer  # hundreds of launches for one token: what a graph replays at once
