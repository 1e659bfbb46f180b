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
            want = paged.read(layer, s) if paged._pending_slots is not None else (x[layer][None] for x in paged.gather(s))
            for a, b in zip(rows.read(layer, s), want):
                assert torch.equal(a, b)
        if paged._pending_slots is not None:
            got, want = rows.read_rows(layer), paged.read_rows(layer)
            for r, s in enumerate(rows.rows):
                n = rows.lengths[s] + rows.pendings[s]
                for a, b in zip(got, want):
                    assert torch.equal(a[r, :, :n], b[r, :, :n])


@pytest.mark.parametrize("keys_last", [True, False])
def test_the_row_cache_holds_what_the_paged_cache_holds_through_a_ragged_decode(keys_last):
    """Random ragged forwards over some or all of 3 sequences, each kept whole, as a tree path (compaction), or
    dropped; rollbacks and a freed sequence: after every move both caches hold the same entries. In either key
    layout (keys-last for the exact attention, hd-last for SDPA), which the rows read keep."""
    g = torch.Generator().manual_seed(0)
    B = 3
    rows = RowKVCache(L, Hkv, hd, 64, B, keys_last=keys_last)
    paged = PagedKVCache(L, Hkv, hd, 48, block_size=4, batch_size=B)
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
        assert rows.read_rows(0)[0].stride(-2 if keys_last else -1) == 1
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


def test_a_sequence_moves_to_a_free_row_whole_and_bad_moves_change_nothing():
    g = torch.Generator().manual_seed(1)
    kv = RowKVCache(L, Hkv, hd, 16, batch_size=3)
    kv.begin(3, [5, 3, 7])
    for layer in range(L):
        kv.store(layer, torch.randn(3, Hkv, 7, hd, generator=g), torch.randn(3, Hkv, 7, hd, generator=g))
    with pytest.raises(RuntimeError, match="pending"):
        kv.move(2, 0)
    kv.commit()
    before = [kv.read(layer, 2) for layer in range(L)]
    before = [(k.clone(), v.clone()) for k, v in before]
    for src, dst, match in ((2, 0, "row 0 holds 5 tokens"), (2, 2, "cannot move row 2 to row 2"),
                            (3, 0, "cannot move row 3")):
        with pytest.raises(ValueError, match=match):
            kv.move(src, dst)
        assert kv.lengths == [5, 3, 7]
    kv.free(0)
    kv.move(2, 0)
    assert kv.lengths == [7, 3, 0]
    for layer in range(L):
        for a, b in zip(kv.read(layer, 0), before[layer]):
            assert torch.equal(a, b)


def test_finished_sequences_leave_the_rows_that_decode_a_prefix_read_as_views():
    """Sequences that finish at different steps (budgets of 2 to 20 tokens): after each step the unfinished ones
    hold the cache's first rows, every forward after the prefill reads its rows as views (no index_select), and
    every answer equals the prompt decoded alone."""
    from minispec.batch import BatchDecoder
    from minispec.generate import _eos_ids

    model, tok = load("tiny-llama")
    prompts = ["abcabcabc abc ab", "the cat", "x", "a quick brown fox jumps over the lazy dog", "0101010", "hello"]
    budgets = [20, 2, 9, 14, 4, 17]
    ids = [tok.encode(p) for p in prompts]
    alone = [generate(model, tok, p, max_new_tokens=n, chat=False).tokens for p, n in zip(prompts, budgets)]
    batch = BatchDecoder(model, ids, None, max_new_tokens=budgets, eos=_eos_ids(model, tok), kv="rows")
    batch.prefill()
    reads, moved = [], 0
    real_move = batch.kv.move

    def counting_move(src, dst):
        nonlocal moved
        moved += 1
        real_move(src, dst)

    batch.kv.move = counting_move
    while not batch.done:
        batch.step()
        reads.append(batch.kv._read[2])  # the forward's row index: None when it read the first R rows as views
        assert sorted(batch.row_of.values()) == list(range(len(batch.row_of))), batch.row_of
    assert [dec.new for dec in batch.decs] == alone
    assert moved >= 2 and all(r is None for r in reads), (moved, reads)
