"""Chapter 7: the paged KV cache against the contiguous one, its allocator, and paged attention.

Invariants, not golden values: any sequence of forwards (commit all / a tree's path / discard),
rollbacks, frees and resets leaves the paged cache holding exactly the K/V the contiguous cache
holds, with every block either free or owned by one sequence; a pool that runs out raises and
changes nothing; paged attention equals attention over the gathered prefix; a model decodes the
same tokens with either cache.

The Triton kernel runs on CPU through the interpreter (tests/conftest.py sets TRITON_INTERPRET=1
when there is no GPU, before triton is imported); shapes are tiny to keep it fast.
"""

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from minispec import load
from minispec.attention import prefix_attention, split_attention, triton_available
from minispec.attention.paged import gather_paged, paged_prefix_attention, paged_split_attention
from minispec.kv import KVCache, KVCacheOverflow, KVPoolExhausted, PagedKVCache

pytestmark = pytest.mark.ch07

needs_triton = pytest.mark.skipif(
    not triton_available("cpu"), reason="Triton interpreter is off (TRITON_INTERPRET=1 must precede importing triton)")

L, HKV, HD, B, BS, NB = 2, 2, 3, 2, 3, 10  # layers, KV heads, head dim, batch, block size, pool blocks


def check_allocator(kv: PagedKVCache) -> None:
    """No block leaked, none owned twice, no duplicate in the free list; each sequence owns exactly
    the blocks its committed + pending tokens need."""
    used = [blk for table in kv.tables for blk in table]
    assert len(set(kv.free_list)) == len(kv.free_list)
    assert len(set(used)) == len(used)
    assert sorted(used + kv.free_list) == list(range(kv.n_blocks))
    for table, n, p in zip(kv.tables, kv.lengths, kv.pendings):
        assert len(table) == -(-(n + p) // kv.block_size)


def check_same(kv: PagedKVCache, refs: list[KVCache]) -> None:
    """Sequence b of the paged cache holds what the contiguous cache refs[b] holds, bit for bit."""
    check_allocator(kv)
    for b, ref in enumerate(refs):
        assert kv.lengths[b] == ref.length
        k, v = kv.gather(b)  # [L, Hkv, n, hd]
        assert torch.equal(k, ref.k[:, 0, :, :ref.length]) and torch.equal(v, ref.v[:, 0, :, :ref.length])


def snapshot(kv: PagedKVCache):
    return (copy.deepcopy(kv.tables), list(kv.lengths), list(kv.pendings), list(kv.free_list),
            kv.k_pool.clone(), kv.v_pool.clone())


def assert_unchanged(kv: PagedKVCache, snap) -> None:
    tables, lengths, pendings, free, k, v = snap
    assert (kv.tables, kv.lengths, kv.pendings, kv.free_list) == (tables, lengths, pendings, free)
    assert torch.equal(kv.k_pool, k) and torch.equal(kv.v_pool, v)


def _forward(data, kv: PagedKVCache, refs: list[KVCache], g: torch.Generator) -> None:
    """begin + write every layer + commit all / commit a kept subset / discard, on both caches."""
    if data.draw(st.booleans(), label="same count for every sequence"):
        ns = [data.draw(st.integers(0, 5), label="T")] * B
        arg = ns[0]
    else:
        ns = arg = data.draw(st.lists(st.integers(0, 5), min_size=B, max_size=B), label="T per sequence")
    snap = snapshot(kv)
    try:
        kv.begin(B, arg)
    except KVPoolExhausted as e:
        assert "exhausted" in str(e)
        assert_unchanged(kv, snap)
        return
    for b, ref in enumerate(refs):
        ref.begin(1, ns[b])
    check_allocator(kv)  # the whole pending write is reserved before anything is written
    T = max(ns)
    for layer in range(L):
        k, v = torch.randn(B, HKV, T, HD, generator=g), torch.randn(B, HKV, T, HD, generator=g)
        want = [ref.write(layer, k[b:b + 1, :, :ns[b]], v[b:b + 1, :, :ns[b]]) for b, ref in enumerate(refs)]
        if len({ref.length + n for ref, n in zip(refs, ns)}) == 1:  # equal lengths: write() returns prefix + new
            got_k, got_v = kv.write(layer, k, v)
            assert torch.equal(got_k, torch.cat([w[0] for w in want]))
            assert torch.equal(got_v, torch.cat([w[1] for w in want]))
        else:
            kv.store(layer, k, v)
    end = data.draw(st.sampled_from(["all", "keep", "discard"]), label="end")
    if end == "all":
        kv.commit()
        keeps = [None] * B
    elif end == "discard":
        kv.discard()
        for ref in refs:
            ref.discard()
        return
    else:  # a tree's accepted path per sequence: any strictly increasing subset
        keeps = [[i for i in range(n) if data.draw(st.booleans(), label="keep")] for n in ns]
        if len(set(ns)) == 1 and data.draw(st.booleans(), label="one keep for all"):
            keeps = [keeps[0]] * B
            kv.commit(keeps[0])
        else:
            kv.commit(keeps)
    for ref, keep in zip(refs, keeps):
        ref.commit(keep)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_paged_equals_contiguous_under_random_operations(data):
    kv = PagedKVCache(L, HKV, HD, n_blocks=NB, block_size=BS, batch_size=B)
    refs = [KVCache(L, HKV, HD, capacity=NB * BS) for _ in range(B)]  # one contiguous cache per sequence
    g = torch.Generator().manual_seed(0)
    for _ in range(data.draw(st.integers(1, 14), label="steps")):
        op = data.draw(st.sampled_from(["forward"] * 4 + ["rollback", "free", "reset"]), label="op")
        if op == "forward":
            _forward(data, kv, refs, g)
        elif op == "rollback":
            if data.draw(st.booleans(), label="one count for all"):
                n = data.draw(st.integers(0, min(kv.lengths)), label="n")
                ns = [n] * B
                kv.rollback(n)
            else:
                ns = [data.draw(st.integers(0, n), label="n") for n in kv.lengths]
                kv.rollback(ns)
            for ref, n in zip(refs, ns):
                ref.rollback(n)
        elif op == "free":
            b = data.draw(st.integers(0, B - 1), label="seq")
            kv.free(b)
            refs[b].reset()
        else:
            kv.reset()
            for ref in refs:
                ref.reset()
        check_same(kv, refs)


def _filled(lengths, n_blocks, block_size=4, seed=0) -> PagedKVCache:
    """A paged cache whose sequences hold ``lengths`` random tokens, blocks interleaved between them."""
    g, n_seq = torch.Generator().manual_seed(seed), len(lengths)
    kv = PagedKVCache(L, HKV, HD, n_blocks=n_blocks, block_size=block_size, batch_size=n_seq)
    for step in range(max(lengths)):  # one token per sequence per forward: their blocks interleave
        kv.begin(n_seq, [int(step < n) for n in lengths])
        for layer in range(L):
            k, v = torch.randn(n_seq, HKV, 1, HD, generator=g), torch.randn(n_seq, HKV, 1, HD, generator=g)
            kv.store(layer, k, v)
        kv.commit()
    return kv


def test_read_rows_gives_every_row_its_sequence_first_in_whole_blocks():
    """One gather for a ragged forward's rows: row r's first keys are ``read(layer, its sequence)``, in order;
    past them, up to the most blocks of a row, come entries its mask hides; K is the transpose of a row-major
    [R, Hkv, hd, S] (what the CPU attention reads without a copy)."""
    kv = _filled([9, 2, 5], n_blocks=12)
    kv.begin(2, {2: 3, 0: 1})  # rows: sequence 2 with 3 new tokens, then sequence 0 with 1
    g = torch.Generator().manual_seed(1)
    for layer in range(L):
        kv.store(layer, torch.randn(2, HKV, 3, HD, generator=g), torch.randn(2, HKV, 3, HD, generator=g))
    for layer in range(L):
        k, v = kv.read_rows(layer)
        assert k.shape == v.shape == (2, HKV, 12, HD)  # 3 blocks of 4: sequence 0's 10 tokens
        assert k.transpose(-1, -2).is_contiguous()
        for r, seq in enumerate([2, 0]):
            k_r, v_r = kv.read(layer, seq)  # [1, HKV, n, HD]
            n = k_r.shape[2]
            assert n == [8, 10][r] and torch.equal(k[r, :, :n], k_r[0]) and torch.equal(v[r, :, :n], v_r[0])


def test_pool_exhaustion_raises_and_changes_nothing():
    kv = _filled([9, 5], n_blocks=6)  # 3 + 2 blocks of 4 used, 1 free
    before = snapshot(kv)
    with pytest.raises(KVPoolExhausted, match=r"need 2 more blocks of 4 tokens \(per sequence \[1, 1\]\), but only 1 "
                                              r"of 6 are free") as err:
        kv.begin(2, 4)
    assert isinstance(err.value, KVCacheOverflow)
    assert_unchanged(kv, before)
    kv.begin(2, [3, 0])  # fits the blocks sequence 0 already owns: still usable
    kv.discard()
    assert_unchanged(kv, before)
    kv.free(1)  # a finished sequence gives its blocks back
    assert len(kv.free_list) == 3 and kv.tables[1] == []
    kv.begin(2, 4)
    check_allocator(kv)


def test_misuse_raises_and_leaves_the_cache_unchanged():
    kv = _filled([5, 3], n_blocks=8)
    with pytest.raises(ValueError, match="different lengths"):
        kv.length
    kv.begin(2, 2)
    before = snapshot(kv)
    with pytest.raises(RuntimeError, match="ragged batch"):
        kv.write(0, torch.zeros(2, HKV, 2, HD), torch.zeros(2, HKV, 2, HD))
    with pytest.raises(RuntimeError, match="pending"):
        kv.begin(2, 1)
    with pytest.raises(RuntimeError, match="pending"):
        kv.rollback(1)
    with pytest.raises(ValueError, match="strictly increasing"):
        kv.commit([[0, 1], [2]])  # sequence 1 has only 2 pending: nothing committed, not even sequence 0
    assert_unchanged(kv, before)
    kv.commit([[1], []])
    assert kv.lengths == [6, 3]
    with pytest.raises(ValueError, match="roll back"):
        kv.rollback([0, 4])
    with pytest.raises(ValueError, match="batch"):
        kv.begin(1, 1)
    with pytest.raises(ValueError, match="positive"):
        PagedKVCache(1, 1, 4, n_blocks=0)


def test_reserve_grows_the_pool_and_keeps_the_tokens():
    kv = _filled([5, 7], n_blocks=4)
    want = [kv.gather(b) for b in range(2)]
    kv.reserve(20)  # 5 blocks per sequence: 10 needed, 4 owned
    assert kv.n_blocks >= 10 and len(kv.free_list) + 4 == kv.n_blocks
    check_allocator(kv)
    for b in range(2):
        assert all(torch.equal(x, y) for x, y in zip(kv.gather(b), want[b]))
    kv.begin(2, 13)  # would have exhausted the old pool


# --------------------------------------------------------------------------- paged attention
def paged_case(B, H, Hkv, T, hd, bs, lens, n_blocks, seed):
    """q, pools with random contents, and a block table of shuffled (non-contiguous) blocks."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, hd, generator=g)
    k_pool, v_pool = torch.randn(n_blocks, Hkv, bs, hd, generator=g), torch.randn(n_blocks, Hkv, bs, hd, generator=g)
    width = max(1, max(-(-P // bs) for P in lens))
    table = torch.randperm(n_blocks, generator=g)[:B * width].view(B, width).to(torch.int32)  # [B, W]
    return q, k_pool, v_pool, table


# (B, H, Hkv, T, hd, block size, prefix lengths): empty, shorter than a block, not multiples, GQA
PAGED_CASES = [
    (1, 2, 2, 1, 8, 4, [0], 4),
    (2, 4, 2, 3, 8, 4, [7, 13], 12),
    (3, 4, 1, 5, 16, 3, [0, 2, 20], 24),
    (2, 8, 2, 2, 8, 5, [37, 11], 20),
]


@pytest.mark.parametrize("case", PAGED_CASES, ids=[f"B{c[0]}-H{c[1]}-Hkv{c[2]}-T{c[3]}-bs{c[5]}" for c in PAGED_CASES])
def test_paged_reference_equals_prefix_attention_on_the_gathered_prefix(case):
    B, H, Hkv, T, hd, bs, lens, N = case
    q, k_pool, v_pool, table = paged_case(B, H, Hkv, T, hd, bs, lens, N, seed=sum(lens))
    out, lse = paged_prefix_attention(q, k_pool, v_pool, table, lens)
    assert out.shape == (B, H, T, hd) and lse.shape == (B, H, T) and lse.dtype == torch.float32
    for b, P in enumerate(lens):
        k = torch.stack([k_pool[int(table[b, n // bs]), :, n % bs] for n in range(P)], 1) if P else \
            k_pool.new_zeros(Hkv, 0, hd)  # [Hkv, P, hd], token by token
        v = torch.stack([v_pool[int(table[b, n // bs]), :, n % bs] for n in range(P)], 1) if P else k
        assert torch.equal(gather_paged(k_pool, table[b], P), k)
        want_o, want_l = prefix_attention(q[b:b + 1], k[None], v[None])
        assert torch.allclose(out[b:b + 1], want_o, atol=1e-6) and torch.allclose(lse[b:b + 1], want_l, atol=1e-6)
        if P == 0:
            assert (out[b] == 0).all() and torch.isneginf(lse[b]).all()


def test_paged_split_attention_on_a_paged_cache_equals_split_attention():
    """Read a real cache's pool: prefix through the block table + tree suffix = split attention."""
    kv = _filled([6, 6], n_blocks=10, block_size=4, seed=3)  # interleaved blocks: sequence 0 owns 0, 2, ...
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 3, HD, generator=g)
    k_new, v_new = torch.randn(2, HKV, 3, HD, generator=g), torch.randn(2, HKV, 3, HD, generator=g)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    for layer in range(L):
        got = paged_split_attention(q, k_new, v_new, kv.k_pool[layer], kv.v_pool[layer], kv.block_table(),
                                    kv.lengths, tree)
        k = torch.stack([kv.gather(b)[0][layer] for b in range(2)])  # [B, Hkv, P, hd]
        v = torch.stack([kv.gather(b)[1][layer] for b in range(2)])
        want = split_attention(q, torch.cat([k, k_new], 2), torch.cat([v, v_new], 2), 6, tree)
        assert torch.allclose(got, want, atol=1e-6)


@needs_triton
@pytest.mark.parametrize("splits, block_n", [(None, None), (1, 16), (3, 16)])
@pytest.mark.parametrize("case", PAGED_CASES, ids=[f"B{c[0]}-H{c[1]}-Hkv{c[2]}-T{c[3]}-bs{c[5]}" for c in PAGED_CASES])
def test_triton_paged_prefix_equals_the_reference(case, splits, block_n):
    from minispec.attention.triton_paged import paged_prefix_attention_triton

    B, H, Hkv, T, hd, bs, lens, N = case
    q, k_pool, v_pool, table = paged_case(B, H, Hkv, T, hd, bs, lens, N, seed=sum(lens) + 1)
    want_o, want_l = paged_prefix_attention(q, k_pool, v_pool, table, lens)
    got_o, got_l = paged_prefix_attention_triton(q, k_pool, v_pool, table, torch.tensor(lens), num_splits=splits,
                                                 block_n=block_n)
    assert got_o.shape == want_o.shape and got_o.dtype == q.dtype and got_l.dtype == torch.float32
    assert (got_o - want_o).abs().max() < 1e-5
    assert torch.equal(torch.isneginf(got_l), torch.isneginf(want_l))
    finite = torch.isfinite(want_l)
    assert torch.allclose(got_l[finite], want_l[finite], rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- the model with a paged cache
@pytest.fixture(scope="module", params=["tiny-llama", "tiny-gpt2"])
def model(request):
    return load(request.param)[0]


@torch.no_grad()
def _decode(model, kv, prompt: list[list[int]], steps: int) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy decoding with draft trees mixed in: every other step feeds a 4-node tree
    (root x; a, b children of x; c child of a), keeps a path that rotates through the
    tree's shapes (compaction when it skips a sibling) and rolls one token back now and then."""
    x = torch.tensor(prompt)
    out = model(x, kv=kv, last_logits_only=True)
    kv.commit()
    tokens = out.logits[:, -1].argmax(-1)  # [B]
    emitted = [tokens.tolist()]
    paths = [[0, 2], [0, 1, 3], [0], [0, 1]]
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    for step in range(steps):
        if step % 2:
            drafts = torch.stack([tokens, (tokens + 1) % 256, (tokens + 2) % 256, (tokens + 3) % 256], 1)  # [B, 4]
            pos = torch.tensor([0, 1, 1, 2]) + kv.length
            out = model(drafts, positions=pos, mask=mask, kv=kv)
            path = paths[step // 2 % len(paths)]
            kv.commit(path)
            tokens = out.logits[:, path[-1]].argmax(-1)
        else:
            out = model(tokens[:, None], kv=kv)
            kv.commit()
            tokens = out.logits[:, -1].argmax(-1)
        if step % 5 == 4:
            kv.rollback(1)
        emitted.append(tokens.tolist())
    return emitted, out.logits


@pytest.mark.parametrize("batch", [1, 2])
def test_model_decodes_the_same_with_paged_and_contiguous_kv(model, batch):
    prompt = [[3, 1, 4, 1, 5, 9, 2], [2, 7, 1, 8, 2, 8, 1]][:batch]
    want, want_logits = _decode(model, KVCache.for_model(model, 64, batch), prompt, 12)
    paged = PagedKVCache.for_model(model, 64, batch, block_size=4)
    got, got_logits = _decode(model, paged, prompt, 12)
    assert got == want
    assert (got_logits - want_logits).abs().max() <= 1e-5
    check_allocator(paged)


@torch.no_grad()
def test_model_forward_on_an_exhausted_pool_changes_nothing(model):
    kv = PagedKVCache.for_model(model, 12, block_size=4)  # 3 blocks
    model(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]), kv=kv)
    kv.commit()
    before = snapshot(kv)
    with pytest.raises(KVPoolExhausted, match="need 1 more blocks"):
        model(torch.tensor([[11, 12, 13]]), kv=kv)
    assert_unchanged(kv, before)
    model(torch.tensor([[11, 12]]), kv=kv)  # fits the last block
    kv.commit()
    assert kv.length == 12


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_generate_with_a_paged_cache_equals_the_contiguous_one(block_size):
    """The decode loop on a paged cache (``generate(kv_block_size=...)``): vanilla, lookup, a chain and a
    branching tree give the contiguous cache's greedy tokens, and sampling with a seed its samples."""
    from minispec import generate
    from minispec.drafters import DraftModel, PromptLookup

    (model, tok), (draft, _) = load("tiny-llama"), load("tiny-gpt2-draft")
    prompt = "abcabcabc abc ab"
    makers = {"vanilla": lambda: None, "lookup": lambda: PromptLookup(k=4),
              "chain": lambda: DraftModel(draft, k=3), "tree": lambda: DraftModel(draft, tree="3,2,6")}
    for name, make in makers.items():
        want = generate(model, tok, prompt, drafter=make(), max_new_tokens=40)
        got = generate(model, tok, prompt, drafter=make(), max_new_tokens=40, kv_block_size=block_size)
        assert got.tokens == want.tokens, name
    want = generate(model, tok, prompt, drafter=PromptLookup(k=3), max_new_tokens=30, temperature=0.9, seed=3)
    got = generate(model, tok, prompt, drafter=PromptLookup(k=3), max_new_tokens=30, temperature=0.9, seed=3,
                   kv_block_size=block_size)
    assert got.tokens == want.tokens
    with pytest.raises(ValueError, match="kv_block_size"):
        generate(model, tok, prompt, max_new_tokens=4, kv_block_size=0)
