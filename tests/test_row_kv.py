"""The row cache (``minispec.kv.RowKVCache``): every sequence in a contiguous row of its own, the ragged interface of
the paged cache, read without gathers. Checked against ``PagedKVCache`` entry for entry, and through
``generate_batch`` token for token."""

import pytest
import torch

from minispec import generate, load
from minispec.batch import generate_batch
from minispec.drafters import DraftModel, PromptLookup
from minispec.kv import KVCacheOverflow, PagedKVCache, RaggedKVCache, RowKVCache

L, Hkv, hd = 2, 2, 4


def _same_entries(rows: RowKVCache, paged: PagedKVCache) -> None:
    """Every sequence's entries are equal: during a forward its committed and pending ones, read alone and with
    the forward's rows; between forwards its committed ones (``gather``)."""
    for layer in range(L):
        for s in range(rows.batch_size):
            want = paged.read(layer, s) if paged._plan is not None else (x[layer][None] for x in paged.gather(s))
            for a, b in zip(rows.read(layer, s), want):
                assert torch.equal(a, b)
        if paged._plan is not None:
            got, want = rows.read_rows(layer), paged.read_rows(layer)
            for r, s in enumerate(rows.rows):
                n = rows.lengths[s] + rows.pendings[s]
                for a, b in zip(got, want):
                    assert torch.equal(a[r, :, :n], b[r, :, :n])


def test_the_row_cache_holds_what_the_paged_cache_holds_through_a_ragged_decode():
    """Random ragged forwards over some or all of 3 sequences, each kept whole, as a tree path (compaction), or
    dropped; rollbacks and a freed sequence: after every move both caches hold the same entries."""
    g = torch.Generator().manual_seed(0)
    B = 3
    rows, paged = RowKVCache(L, Hkv, hd, 64, B), PagedKVCache(L, Hkv, hd, 48, block_size=4, batch_size=B)
    assert isinstance(rows, RaggedKVCache)
    done = {"free": 0, "compaction": 0, "rollback": 0, "subset": 0}
    for step in range(40):
        seqs = [s for s in range(B) if torch.rand(1, generator=g) < 0.8] or [0]
        ns = {s: int(torch.randint(1, 6, (1,), generator=g)) for s in seqs}
        if any(rows.lengths[s] + n > 40 for s, n in ns.items()):
            longest = max(ns, key=lambda s: rows.lengths[s])
            for c in (rows, paged):
                c.free(longest)
            done["free"] += 1
            continue
        done["subset"] += len(seqs) < B
        T = max(ns.values())
        for c in (rows, paged):
            c.begin(len(seqs), ns)
        for layer in range(L):
            k, v = torch.randn(len(seqs), Hkv, T, hd, generator=g), torch.randn(len(seqs), Hkv, T, hd, generator=g)
            for c in (rows, paged):
                c.store(layer, k, v)
        _same_entries(rows, paged)
        move, keep = step % 4, None
        if move == 1:  # a path through each tree: the root and some later nodes
            keep = [sorted({0} | {i for i in range(1, n) if torch.rand(1, generator=g) < 0.5}) if s in ns else None
                    for s, n in ((s, ns.get(s, 0)) for s in range(B))]
        done["compaction"] += move == 1 and any(k is not None and k != list(range(len(k))) for k in keep)
        if move == 3:
            for c in (rows, paged):
                c.discard()
        else:
            for c in (rows, paged):
                c.commit(keep)
        if move == 2 and min(rows.lengths) > 1:
            for c in (rows, paged):
                c.rollback([1] * B)
            done["rollback"] += 1
        assert rows.lengths == paged.lengths
        _same_entries(rows, paged)
    assert all(done.values()), done  # the walk made every kind of move


def test_the_row_cache_refuses_what_it_cannot_hold_and_stays_as_it_was():
    kv = RowKVCache(L, Hkv, hd, 8, batch_size=2)
    kv.begin(2, [5, 3])
    kv.commit()
    with pytest.raises(KVCacheOverflow, match=r"sequences \[0\] would hold \[9\] tokens, capacity 8"):
        kv.begin(2, [4, 1])
    assert kv.lengths == [5, 3] and kv.pending == 0
    with pytest.raises(ValueError, match="distinct indices"):
        kv.begin(2, {0: 1, 5: 1})
    with pytest.raises(ValueError, match="cannot roll back"):
        kv.rollback([6, 0])
    kv.reserve(20)
    kv.begin(2, [4, 1])
    assert kv.capacity >= 20 and torch.equal(kv.read(0, 0)[0][..., :5, :], kv.read(0, 0)[0][..., :5, :])


@pytest.mark.parametrize("drafters", ["vanilla", "mixed"])
def test_generate_batch_on_the_row_cache_gives_each_sequence_its_answer_alone(drafters):
    """Vanilla, and chains and branching trees (compaction), sequences leaving early: the same tokens on the row
    cache as on the paged cache and as each prompt alone."""
    (model, tok), (draft, _) = load("tiny-llama"), load("tiny-gpt2-draft")
    prompts = ["abcabcabc abc ab", "the cat", "x", "a quick brown fox jumps over the lazy dog", "0101010"]
    makers = [lambda: None] * 5 if drafters == "vanilla" else \
        [lambda: PromptLookup(k=4), lambda: DraftModel(draft, k=3), lambda: DraftModel(draft, tree="3,2,6")] * 2
    alone = [generate(model, tok, p, drafter=m(), max_new_tokens=24).tokens for p, m in zip(prompts, makers)]
    for kv in ("rows", "paged"):
        got, batch = generate_batch(model, tok, prompts, drafter=[m() for m in makers[:5]], max_new_tokens=24, kv=kv)
        assert [r.tokens for r in got] == alone, kv
        assert batch.kv.lengths == [0] * 5  # every finished sequence freed
    with pytest.raises(ValueError, match="kv must be 'paged' or 'rows'"):
        generate_batch(model, tok, prompts[:1], kv="blocks")
