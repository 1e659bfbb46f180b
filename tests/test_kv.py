"""KV cache: commit (all / compacted subset), rollback, and errors that leave the cache unchanged."""

import pytest
import torch

from minispec import KVCache, KVCacheOverflow, load

TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return load("tiny-llama")[0]


def _logits_after(model, kv, token):
    out = model(torch.tensor([[token]]), kv=kv).logits[0, -1]
    kv.discard()
    return out


@torch.no_grad()
def test_commit_subset_compacts_like_a_fresh_run(model):
    """Write a 'tree' of 4 tokens, keep nodes 1 and 3 as the accepted path: the next step must
    equal a cache that only ever saw prefix + those two tokens."""
    prefix = torch.tensor([[3, 1, 4, 1, 5]])
    kv = KVCache.for_model(model, 32)
    model(prefix, kv=kv)
    kv.commit()
    tree = torch.tensor([[10, 11, 12, 13]])
    # node 0, 1 children of the prefix; node 2 child of 0; node 3 child of 1
    mask = torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool)
    model(tree, positions=torch.tensor([5, 5, 6, 6]), mask=mask, kv=kv)
    kv.commit([1, 3])
    assert kv.length == 7 and kv.pending == 0

    ref = KVCache.for_model(model, 32)
    model(torch.tensor([[3, 1, 4, 1, 5, 11, 13]]), kv=ref)
    ref.commit()
    assert (kv.k[:, :, :, :7] - ref.k[:, :, :, :7]).abs().max() <= TOL
    assert (_logits_after(model, kv, 20) - _logits_after(model, ref, 20)).abs().max() <= TOL


@torch.no_grad()
def test_rollback_equals_never_having_seen_the_tokens(model):
    x = torch.tensor([[9, 8, 7, 6, 5, 4]])
    kv = KVCache.for_model(model, 16)
    model(x, kv=kv)
    kv.commit()
    kv.rollback(2)
    ref = KVCache.for_model(model, 16)
    model(x[:, :4], kv=ref)
    ref.commit()
    assert kv.length == 4
    assert (_logits_after(model, kv, 1) - _logits_after(model, ref, 1)).abs().max() <= TOL


@torch.no_grad()
def test_overflow_raises_and_leaves_cache_unchanged(model):
    kv = KVCache.for_model(model, 8)
    model(torch.tensor([[1, 2, 3, 4, 5, 6]]), kv=kv)
    kv.commit()
    before = kv.k.clone()
    with pytest.raises(KVCacheOverflow, match="overflow.*6 cached \\+ 3 new.*capacity 8"):
        model(torch.tensor([[7, 8, 9]]), kv=kv)
    assert kv.length == 6 and kv.pending == 0 and torch.equal(kv.k, before)
    model(torch.tensor([[7, 8]]), kv=kv)  # still usable
    kv.commit()
    assert kv.length == 8


@torch.no_grad()
def test_misuse_raises_clear_errors(model):
    kv = KVCache.for_model(model, 8)
    model(torch.tensor([[1, 2]]), kv=kv)
    with pytest.raises(RuntimeError, match="pending"):
        model(torch.tensor([[3]]), kv=kv)
    with pytest.raises(RuntimeError, match="pending"):
        kv.rollback(1)
    with pytest.raises(ValueError, match="strictly increasing"):
        kv.commit([1, 0])
    with pytest.raises(ValueError, match="strictly increasing"):
        kv.commit([2])
    assert kv.pending == 2 and kv.length == 0  # failed commits changed nothing
    kv.commit([1])
    with pytest.raises(ValueError, match="roll back 2"):
        kv.rollback(2)
    with pytest.raises(ValueError, match="batch"):
        model(torch.tensor([[1], [2]]), kv=kv)
    with pytest.raises(ValueError, match="positive"):
        KVCache(1, 1, 4, capacity=0)


@torch.no_grad()
def test_reserve_grows_and_keeps_the_cached_prefix(model):
    kv = KVCache.for_model(model, 4)
    model(torch.tensor([[1, 2, 3]]), kv=kv)
    kv.commit()
    ref = KVCache.for_model(model, 16)
    model(torch.tensor([[1, 2, 3]]), kv=ref)
    ref.commit()
    kv.reserve(10)
    assert kv.capacity >= 10 and kv.length == 3
    assert (_logits_after(model, kv, 4) - _logits_after(model, ref, 4)).abs().max() <= TOL
    model(torch.tensor([[5, 6, 7, 8, 9, 1, 2]]), kv=kv)  # would overflow the old capacity of 4
    kv.commit()
    assert kv.length == 10
