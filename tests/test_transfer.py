"""``minispec.transfer.to_device``: a step's host values reach the device through pinned memory, without a
pageable copy (which waits for the GPU); the KV caches' commits and the decode loop's inputs use it."""

import pytest
import torch

from minispec import KVCache, load
from minispec.kv import StaticKVCache
from minispec.transfer import to_device

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_on_the_cpu_it_is_a_plain_tensor():
    t = to_device([[3, 1], [4, 1]], "cpu")
    assert t.device.type == "cpu" and t.dtype == torch.long and t.tolist() == [[3, 1], [4, 1]]
    assert to_device([1, 2], torch.device("cpu"), torch.int32).dtype == torch.int32
    x = torch.arange(4)
    assert to_device(x, "cpu") is x  # already there: no copy
    assert to_device([True, False], "cpu").dtype == torch.bool


def test_to_cuda_it_stages_in_pinned_memory_and_does_not_block(monkeypatch):
    """What only the copy's arguments show on a machine without CUDA: a CPU tensor bound for CUDA is pinned
    first and copied with non_blocking=True (a pageable, blocking copy would wait for the GPU)."""
    calls = []

    def pin(self):
        calls.append("pin")
        return self

    def to(self, *args, **kw):
        calls.append(("to", str(args[0]), kw.get("non_blocking", False)))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    monkeypatch.setattr(torch.Tensor, "to", to)
    to_device([0, 2, 3], "cuda")
    assert calls == ["pin", ("to", "cuda", True)]
    calls.clear()
    to_device([0, 2, 3], "meta")  # another device: a plain copy, nothing pinned
    assert calls == [("to", "meta", False)]


def _write(kv, n: int, seed: int) -> torch.Tensor:
    """Write n new entries in every layer (through the cache protocol); returns the keys written [L, Hkv, n, hd]."""
    from minispec.cuda_graphs import static_plan

    L, _, H, _, hd = kv.k.shape
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, 1, H, n, hd, generator=g)
    kv.begin(1, n)
    if isinstance(kv, StaticKVCache):  # the plan sets the slots of the new tokens
        static_plan(kv, torch.zeros(1, n, dtype=torch.long), torch.ones(1, n, n, dtype=torch.bool))
    for layer in range(L):
        (kv.store if hasattr(kv, "store") else kv.write)(layer, k[layer], k[layer])
    return k[:, 0]


@pytest.mark.parametrize("cache", ["static", "contiguous", "rows"])
def test_a_compacting_commit_uploads_its_index_through_to_device(cache, monkeypatch):
    """Each KV cache's commit of an accepted tree path (a compaction) builds its gather index with ``to_device``,
    and moves the accepted entries down."""
    import importlib

    from minispec.kv import RowKVCache

    module = {"static": "minispec.kv.static", "contiguous": "minispec.kv.contiguous", "rows": "minispec.kv.rows"}[cache]
    make = {"static": StaticKVCache, "contiguous": KVCache, "rows": RowKVCache}[cache]
    seen = []

    def spy(values, device, dtype=None):
        seen.append(list(values))
        return to_device(values, device, dtype)

    monkeypatch.setattr(importlib.import_module(module), "to_device", spy)
    kv = make(2, 2, 8, 16)
    _write(kv, 4, 0)
    kv.commit()
    seen.clear()
    new = _write(kv, 5, 1)
    kv.commit([0, 2, 3])
    assert seen[0] == ([4, 6, 7] if cache == "rows" else [0, 2, 3])  # the rows cache adds the length on the host
    assert seen[1:] == ([[7]] if cache == "static" else [])  # and the static one uploads its new lengths
    assert torch.equal(kv.k[:, 0, :, 4:7], new[:, :, [0, 2, 3]])


@pytest.mark.gpu
@cuda
def test_gpu_commits_do_not_synchronise():
    """A compacting commit on CUDA (the static cache of the graphed loop, the contiguous one of the eager loop)
    makes no synchronising call: ``torch.cuda.set_sync_debug_mode("error")`` raises on one."""
    model = load("tiny-llama")[0].cuda()
    for make in (StaticKVCache.for_model, KVCache.for_model):
        kv = make(model, 32)
        if isinstance(kv, StaticKVCache):
            from minispec.cuda_graphs import GraphedForward

            step = GraphedForward(model, kv, enabled=False)
            step(torch.tensor([[5, 6, 7, 8]], device="cuda"))
            kv.commit()
            step(torch.tensor([[1, 2, 3, 4, 5]], device="cuda"))
        else:
            model(torch.tensor([[5, 6, 7, 8]], device="cuda"), kv=kv)
            kv.commit()
            model(torch.tensor([[1, 2, 3, 4, 5]], device="cuda"), kv=kv)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            kv.commit([0, 2, 3])
            to_device([[1, 2, 3]], "cuda")
        finally:
            torch.cuda.set_sync_debug_mode("default")
