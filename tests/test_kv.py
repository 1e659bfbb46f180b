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


def test_keys_are_stored_keys_last_only_for_the_exact_attention():
    """``for_model`` stores keys keys-last ([.., hd, C] in memory) for the CPU's row-invariant attention, which reads
    k^T as a row-major matrix, and hd-last for the plain model, whose SDPA takes its fused kernel only then."""
    exact, _ = load("tiny-llama")
    plain, _ = load("tiny-llama", exact=False)
    assert exact.attention == "exact" and plain.attention == "dense"
    k_exact, k_plain = KVCache.for_model(exact, 8).k, KVCache.for_model(plain, 8).k
    assert k_exact.stride(-2) == 1 and k_plain.stride(-1) == 1
    kv = KVCache.for_model(plain, 8)
    kv.reserve(20)  # a grown cache keeps its layout
    assert kv.k.stride(-1) == 1 and KVCache(1, 1, 4, 8).k.stride(-2) == 1  # the constructor's default: the CPU's
    from minispec.kv import RowKVCache

    assert RowKVCache.for_model(exact, 8).k.stride(-2) == 1 and RowKVCache.for_model(plain, 8).k.stride(-1) == 1


@torch.inference_mode()
def test_the_plain_model_decodes_on_sdpa_s_fused_kernel():
    """A one-row decode step of the plain model (grouped-query heads, keys read from the cache) runs CPU SDPA's fused
    kernel, not its math fallback, which repeats K and V for every query head."""
    from torch.profiler import ProfilerActivity, profile

    model, _ = load("tiny-llama", exact=False)
    assert model.cfg.n_head > model.cfg.n_kv_head
    kv = KVCache.for_model(model, 40)
    model(torch.arange(30)[None], kv=kv)
    kv.commit()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(torch.tensor([[1]]), kv=kv)
    kv.discard()
    names = {e.name for e in prof.events()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names
    assert "aten::repeat_interleave" not in names and "aten::_scaled_dot_product_attention_math" not in names


@torch.inference_mode()
def test_a_write_stores_the_new_entries_and_returns_prefix_and_new(model):
    """``write`` without autograd (one view per slot) and with it (slice assignment) store the same entries and
    return the same prefix + new keys and values."""
    k, v = torch.randn(2, 1, 2, 3, 4).unbind(0)  # [B, Hkv, T, hd] each
    a = KVCache(2, 2, 4, 10)
    a.begin(1, 3)
    ka, va = a.write(1, k, v)
    with torch.inference_mode(False), torch.enable_grad():
        b = KVCache(2, 2, 4, 10)
        b.begin(1, 3)
        kb, vb = b.write(1, k.clone().requires_grad_(), v.clone())
    assert ka.shape == kb.shape == (1, 2, 3, 4)
    assert torch.equal(ka, kb.detach()) and torch.equal(va, vb) and torch.equal(ka, k) and torch.equal(va, v)
    a.commit()
    a.begin(1, 1)
    ka2, _ = a.write(1, k[:, :, :1] + 1, v[:, :, :1])
    assert ka2.shape == (1, 2, 4, 4) and torch.equal(ka2[:, :, :3], k) and torch.equal(ka2[:, :, 3:], k[:, :, :1] + 1)
    assert torch.equal(a.k[0], torch.zeros_like(a.k[0]))  # layer 0 untouched
