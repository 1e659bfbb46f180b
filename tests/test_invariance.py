"""Row-count invariance of the decode forward (what makes greedy verification identical to vanilla).

A row of a forward must give the same bits whatever rows come with it: vanilla decoding computes
one row per step, verification the root and N draft nodes. Checked at three levels, at 1 and 2
threads: every ExactLinear shape of SmolLM2 and the shipped heads; the attention on random shapes and
trees (hypothesis); and SmolLM2's logits after a prefill, contiguous and paged cache, chain and
tree. A stand-in kernel whose result depends on the row count shows, on any CPU, that the probe
finds it, that the padding fixes it, and that the check fails without the padding.
"""

from __future__ import annotations

import contextlib
import os
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from minispec.exact import attention as invariant
from minispec.exact import recipes as invariance
from minispec.exact.attention import invariant_attention
from minispec.exact.linear import ExactLinear
from minispec.kv import KVCache, PagedKVCache
from minispec.tree import Tree

THREADS = (1, 2)
# parametrized: two threads marked, so that ``make test`` runs those alone (beside another busy process on a
# 2-core machine, two torch threads wait on each other: 6 s alone became 100 s in CI)
PARAM_THREADS = (1, pytest.param(2, marks=pytest.mark.two_threads))


@contextlib.contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def rows_that_differ(layer, n_in: int, counts=invariance.PROBE_ROWS) -> list[int]:
    """Row counts m at which layer(x[:m]) differs from the first m rows of layer(x) (x: 128 rows)."""
    x = torch.randn(invariance.REF_ROWS, n_in, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        full = layer(x)
        bad = [m for m in counts if not torch.equal(layer(x[:m]), full[:m])]
        bad += [-r for r in (5, 17, 64) if not torch.equal(layer(x[r]), full[r])]  # one row, as a vector
    return bad


# ----------------------------------------------------------------------------------------- linears

def linear_shapes(*objects) -> set[tuple[int, int, bool]]:
    """(in, out, bias) of every linear layer in the modules held by ``objects`` (models, drafters)."""
    shapes, seen = set(), set()
    todo = list(objects)
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            shapes |= {(m.in_features, m.out_features, m.bias is not None) for m in obj.modules()
                       if isinstance(m, torch.nn.Linear)}
        elif hasattr(obj, "__dict__"):
            todo += [v for v in vars(obj).values() if isinstance(v, torch.nn.Module) or hasattr(v, "propose")]
    return shapes


@pytest.mark.slow
@pytest.mark.parametrize("n_threads", PARAM_THREADS)
def test_every_linear_shape_of_smollm2_and_the_shipped_heads_is_row_invariant(smollm2, n_threads):
    from minispec.methods import Methods

    model, _ = smollm2
    methods = Methods(model)
    drafters = [methods.drafter(m) for m in ("sps", "eagle", "eagle3", "medusa")]
    shapes = linear_shapes(model, *drafters)
    assert {(576, 960, False), (1536, 576, False), (576, 49152, False)} <= shapes  # qkv, down, LM head
    assert {(1152, 576, False), (1728, 576, False), (576, 8192, False)} & shapes  # the heads' own (fc, draft LM head)
    with threads(n_threads):
        for n_in, n_out, bias in sorted(shapes):
            torch.manual_seed(0)
            layer = ExactLinear(n_in, n_out, bias=bias)
            assert rows_that_differ(layer, n_in) == [], f"{n_in} -> {n_out} (bias {bias}) at {n_threads} threads"


def stand_in_product(long_inputs: int, max_rows: int = 1):
    """A product whose result for calls of up to ``max_rows`` rows is summed in another order, as a BLAS
    that sends one row to a matrix-vector kernel does: on any CPU, those row counts give other bits,
    for inputs longer than ``long_inputs`` (so that the product over half the inputs can be invariant,
    as 1536 -> 576 is on an AVX-512 CPU when split in two). Otherwise each output is an elementwise
    product summed along the contiguous input dimension: the same reduction for every row whatever M is."""
    def product(self, kernel, x, part=None, rows=None):
        w, b = self._part(part)
        x2 = x.reshape(-1, x.shape[-1])  # [M, in]
        if x2.shape[0] <= max_rows and x2.shape[1] > long_inputs:
            y = (x2.flip(-1)[:, None, :] * w.flip(-1)[None]).sum(-1)  # summed from the last input
        else:
            y = (x2[:, None, :] * w[None]).sum(-1)  # [M, out]
        y = y if b is None else y + b
        return y.reshape(*x.shape[:-1], w.shape[0])[:rows]  # the first ``rows`` (a padded call's own)
    return product


@pytest.mark.parametrize("n_threads", PARAM_THREADS)
def test_a_kernel_that_varies_with_the_row_count_is_found_and_padded(monkeypatch, n_threads):
    monkeypatch.setattr(ExactLinear, "_product", stand_in_product(long_inputs=0))  # halves vary too: pad
    torch.manual_seed(0)
    layer = ExactLinear(256, 96, bias=True)
    with threads(n_threads), torch.inference_mode():
        recipe = layer.row_recipe(torch.zeros(1, 256))
    assert recipe.varies == (1,) and recipe.split == 1 and recipe.min_rows == 2
    assert rows_that_differ(layer, 256) == []  # padded: one row runs as two


def test_a_kernel_that_varies_only_over_long_inputs_is_split(monkeypatch):
    """Where padding would take more than two rows, the product over two input halves is tried."""
    monkeypatch.setattr(ExactLinear, "_product", stand_in_product(long_inputs=128, max_rows=3))
    torch.manual_seed(0)
    layer = ExactLinear(256, 96, bias=True)
    with torch.inference_mode():
        recipe = layer.row_recipe(torch.zeros(1, 256))
        assert recipe.varies == (1, 2, 3) and recipe.split == 2 and recipe.min_rows == 1
        assert rows_that_differ(layer, 256) == []
        x = torch.randn(5, 256)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_a_kernel_that_varies_below_a_small_row_count_is_padded_to_it_after_two_probes(monkeypatch):
    """The weight panels on an AVX2-only CPU: calls of 1 to 3 rows vary (for every input length, so the halves
    do too). Padding such calls to 4 rows is the cheapest recipe, and it needs no probe of its own: the product
    is probed as it is and split, and no multiple of rows (2 would leave 2-row calls as they are; 4 and up pad
    at least as many rows as padding to 4 does)."""
    monkeypatch.setattr(ExactLinear, "_product", stand_in_product(long_inputs=0, max_rows=3))
    probes = []
    monkeypatch.setattr(invariance, "varying_rows",
                        lambda *a, _f=invariance.varying_rows: probes.append(a[1]) or _f(*a))
    torch.manual_seed(0)
    layer = ExactLinear(256, 96, bias=True)
    with torch.inference_mode():
        recipe = layer.row_recipe(torch.zeros(1, 256))
        assert recipe.varies == (1, 2, 3) and recipe.split == 1 and recipe.min_rows == 4 and recipe.multiple == 1
        assert len(probes) == 2 and [recipe.rows(m) for m in (1, 3, 4, 5, 7, 9)] == [4, 4, 4, 5, 7, 9]
        assert "calls of fewer rows padded to 4" in recipe.describe()
        assert rows_that_differ(layer, 256) == []
        monkeypatch.setattr(ExactLinear, "row_invariant", False)
        assert 1 in rows_that_differ(layer, 256)  # the same check fails without the recipe


def test_without_the_recipe_the_check_fails(monkeypatch):
    monkeypatch.setattr(ExactLinear, "_product", stand_in_product(long_inputs=0))
    torch.manual_seed(0)
    layer = ExactLinear(256, 96, bias=True)
    monkeypatch.setattr(ExactLinear, "row_invariant", False)
    assert rows_that_differ(layer, 256) == [1, -5, -17, -64]


def blocks_of_6_product(self, kernel, x, part=None, rows=None):
    """A stand-in for MKL's AVX2 kernels: rows are computed in blocks of 6, and the rows of a last, partial
    block of 1 to 3 rows are summed in another order (from the last input)."""
    w, b = self._part(part)
    x2 = x.reshape(-1, x.shape[-1])  # [M, in]
    y = (x2[:, None, :] * w[None]).sum(-1)  # [M, out]
    tail = x2.shape[0] % 6
    if 1 <= tail <= 3:
        y[-tail:] = (x2[-tail:].flip(-1)[:, None, :] * w.flip(-1)[None]).sum(-1)
    y = y if b is None else y + b
    return y.reshape(*x.shape[:-1], w.shape[0])[:rows]


@pytest.mark.parametrize("n_threads", PARAM_THREADS)
def test_a_kernel_with_partial_row_blocks_gets_rows_padded_to_whole_blocks(monkeypatch, n_threads):
    monkeypatch.setattr(ExactLinear, "_product", blocks_of_6_product)
    torch.manual_seed(0)
    layer = ExactLinear(256, 96, bias=True)
    with threads(n_threads), torch.inference_mode():
        recipe = layer.row_recipe(torch.zeros(1, 256))
        assert recipe.multiple == 6 and recipe.split == 1 and recipe.rows(1) == 6 and recipe.rows(7) == 12
        assert "multiple of 6" in recipe.describe()
        assert rows_that_differ(layer, 256) == []
        monkeypatch.setattr(ExactLinear, "row_invariant", False)
        assert 1 in rows_that_differ(layer, 256)  # the same check fails without the recipe


def test_a_kernel_that_varies_at_many_row_counts_is_reported_not_invariant():
    def by_32(x):  # every row count that is not a multiple of 32 sums in another order: no padding helps
        y = (x[:, None, :] * W[None]).sum(-1)
        return (x.flip(-1)[:, None, :] * W.flip(-1)[None]).sum(-1) if x.shape[0] % 32 else y

    W = torch.randn(32, 64)
    recipe = invariance.choose_recipe("odd", by_32, by_32, 64, torch.float32, torch.device("cpu"))
    assert 1 in recipe.varies and 127 in recipe.varies and recipe.min_rows is None and not recipe.invariant
    assert "no recipe" in recipe.describe()


def test_probe_leaves_the_global_random_stream_alone():
    torch.manual_seed(3)
    want = torch.rand(4)
    torch.manual_seed(3)
    invariance.varying_rows(lambda x: x @ torch.ones(16, 8), 16)
    assert torch.equal(torch.rand(4), want)


# --------------------------------------------------------------------------------------- attention

def row_alone(q, k, v, visible, b, h, t, G):
    """Row t of head h computed alone over exactly its visible keys, in key order (what vanilla sees)."""
    keys = visible.nonzero().flatten()
    return invariant_attention(q[b:b + 1, h:h + 1, t:t + 1], k[b:b + 1, h // G:h // G + 1, keys],
                               v[b:b + 1, h // G:h // G + 1, keys])[0, 0, 0]


@st.composite
def attention_case(draw):
    B, Hkv, G = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.sampled_from([1, 3, 4]))
    T, hd = draw(st.integers(1, 12)), draw(st.sampled_from([8, 16, 64]))
    P = draw(st.one_of(st.integers(0, 40), st.integers(100, 600)))  # short, and across blocks of keys
    parents = [-1] + [draw(st.integers(-1, i - 1)) for i in range(1, T)]  # a forest over the new tokens
    return B, Hkv, G, T, P, hd, parents, draw(st.integers(0, 2 ** 31))


@pytest.mark.parametrize("n_threads", PARAM_THREADS)  # not drawn by hypothesis: two threads must run alone
@settings(max_examples=int(os.environ.get("MINISPEC_HYPOTHESIS_EXAMPLES", 60)), deadline=None)
@given(attention_case())
def test_attention_rows_equal_each_row_alone_over_its_own_keys(n_threads, case):
    B, Hkv, G, T, P, hd, parents, seed = case
    g = torch.Generator().manual_seed(seed)
    H, S = Hkv * G, P + T
    q, k, v = (torch.randn(B, n, m, hd, generator=g) for n, m in ((H, T), (Hkv, S), (Hkv, S)))
    tree = torch.eye(T, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            tree[i] |= tree[p]
    mask = torch.cat([torch.ones(T, P, dtype=torch.bool), tree], dim=1)  # [T, S]
    with threads(n_threads), torch.inference_mode():
        out = invariant_attention(q, k, v, mask)
        for b in range(B):
            for h in range(H):
                for t in range(T):
                    assert torch.equal(out[b, h, t], row_alone(q, k, v, mask[t], b, h, t, G)), (b, h, t)
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask,
                                             enable_gqa=G > 1)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_a_long_prefill_is_chunked_without_changing_a_bit(monkeypatch):

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 6, 40, 16, generator=g), torch.randn(1, 2, 50, 16, generator=g), torch.randn(1, 2, 50, 16, generator=g)
    whole = invariant_attention(q, k, v)
    monkeypatch.setattr(invariant, "ROW_CHUNK", 7)  # 3 query heads per KV head: 2 tokens per chunk
    assert torch.equal(invariant_attention(q, k, v), whole)


def test_the_row_check_catches_an_attention_that_sums_by_key_count():
    """A stand-in whose softmax denominator is summed in a different order when the key count is
    odd (as a kernel that blocks its reduction by the number of keys): the check must flag it."""
    def by_key_count(q, k, v, mask=None):
        S = k.shape[2]
        s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        p = torch.exp(s - s.amax(-1, keepdim=True))
        l = p.flip(-1).cumsum(-1)[..., -1:] if S % 2 else p.cumsum(-1)[..., -1:]
        return (p @ v) / l

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 1, 8, 64, generator=g), torch.randn(1, 1, 40, 64, generator=g), torch.randn(1, 1, 40, 64, generator=g)
    mask = torch.ones(8, 40, dtype=torch.bool).tril(32)
    full = by_key_count(q, k, v, mask)
    alone = [torch.equal(full[0, 0, t], by_key_count(q[:, :, t:t + 1], k[:, :, :33 + t], v[:, :, :33 + t])[0, 0, 0])
             for t in range(8)]
    assert not all(alone)
    full = invariant_attention(q, k, v, mask)
    assert all(torch.equal(full[0, 0, t], invariant_attention(q[:, :, t:t + 1], k[:, :, :33 + t], v[:, :, :33 + t])[0, 0, 0])
               for t in range(8))


def sequential_matmul(a, b, flip=False):
    """a @ b summed along the inner dimension strictly in order (from the last term if ``flip``): a
    stand-in product whose rows never depend on the other rows and to which trailing zeros add nothing."""
    order = range(a.shape[-1] - 1, -1, -1) if flip else range(a.shape[-1])
    y = torch.zeros(*a.shape[:-1], b.shape[-1])  # [..., R, C], accumulated in float32 term by term
    for i in order:
        y = y + a[..., i:i + 1] * b[..., i:i + 1, :]
    return y


def blocks_of_6_matmul(a, b):
    """As ``blocks_of_6_product`` for the attention: a last, partial block of 1 to 3 rows is summed from the last key."""
    y = sequential_matmul(a, b)
    tail = a.shape[-2] % 6
    if 1 <= tail <= 3:
        y[..., -tail:, :] = sequential_matmul(a[..., -tail:, :], b, flip=True)
    return y


def halves_matmul(a, b):
    """A stand-in for a BLAS that splits a reduction longer than 256 into two halves by its length."""
    K = a.shape[-1]
    if K <= 256:
        return sequential_matmul(a, b)
    return sequential_matmul(a[..., :K // 2], b[..., :K // 2, :]) + sequential_matmul(a[..., K // 2:], b[..., K // 2:, :])


def causal_rows_differ(padding, P=24, hd=8, B=1, Hkv=3, G=3, N=20):
    """Query counts n at which the first n rows of a causal block after P keys differ from the same rows of N."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, n, hd, generator=g) for h, n in ((Hkv * G, N), (Hkv, P + N), (Hkv, P + N)))
    full = invariant_attention(q, k, v, padding=padding)
    return [n for n in (1, 2, 3, 5, 7, 13) if not torch.equal(
        invariant_attention(q[:, :, :n], k[:, :, :P + n], v[:, :, :P + n], padding=padding), full[:, :, :n])]


def test_attention_with_partial_row_blocks_gets_its_rows_padded(monkeypatch):
    """On any CPU: a stand-in BLAS whose partial row blocks sum in another order (MKL's AVX2 kernels do)
    is found by the probe, the padding pads the query rows, and the same check fails without it."""

    monkeypatch.setattr(invariant, "_product", blocks_of_6_matmul)
    monkeypatch.setattr(invariant, "_PADDINGS", {})
    monkeypatch.setattr(invariant, "PROBE_LAYOUTS", ((1, 3, 3),))
    padding = invariant.attention_padding(8)
    assert padding.invariant and padding.row_multiple > 1, padding
    assert causal_rows_differ(padding) == []
    assert causal_rows_differ(invariant.AttentionPadding()) != []


def test_attention_sums_long_key_ranges_in_fixed_blocks(monkeypatch):
    """On any CPU: with a stand-in BLAS that blocks a long reduction by its length (MKL does past ~200-500
    keys), summing p @ v over KEY_BLOCK keys at a time keeps rows invariant, and one product over all
    keys does not."""

    monkeypatch.setattr(invariant, "_product", halves_matmul)
    assert causal_rows_differ(invariant.AttentionPadding(), P=517) == []
    monkeypatch.setattr(invariant, "KEY_BLOCK", 10 ** 6)
    assert causal_rows_differ(invariant.AttentionPadding(), P=517) != []


def test_a_short_last_block_past_the_first_is_padded_in_its_own_product_only(monkeypatch):
    """Past the first block, a last block of fewer than MIN_BLOCK_KEYS keys is padded with zeros in its own
    p @ v product: the keys and values are read where they lie (no padded copy of the cache), and each row
    equals, bit for bit, the same attention over keys padded with hidden ones (the padded layout)."""

    KB, MIN = invariant.KEY_BLOCK, invariant.MIN_BLOCK_KEYS
    probed = invariant.attention_padding(64)  # probed (and cached) before the products are recorded
    padding = invariant.AttentionPadding(probed.row_multiple, pad_keys=False)  # the path under test, on any CPU
    products = []
    monkeypatch.setattr(invariant, "_product", lambda a, b: products.append((a.shape, b.shape)) or torch.bmm(a, b))
    g = torch.Generator().manual_seed(0)
    for S in (2 * KB + 1, 2 * KB + MIN - 1):
        T = 3
        q, k, v = (torch.randn(1, h, n, 64, generator=g) for h, n in ((6, T), (2, S), (2, S)))
        products.clear()
        with torch.inference_mode():
            out = invariant_attention(q, k, v, padding=padding)
        assert products[0][1][-1] == S  # the scores: every key, none padded
        assert [a[-1] for a, _ in products[1:]] == [KB, KB, MIN]  # p @ v by block; the last padded to MIN keys
        pad = MIN - S % KB
        mask = torch.cat([torch.ones(T, S, dtype=torch.bool).tril(S - T), torch.zeros(T, pad, dtype=torch.bool)], 1)
        with torch.inference_mode():
            padded = invariant_attention(q, F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad)), mask, padding=padding)
        if not probed.pad_keys:  # bit for bit where this CPU's probe found rows invariant without padded keys
            assert torch.equal(out, padded), S


def tree_rows_differ(P, hd=16, Hkv=3, G=3, B=1):
    """Rows t of a 12-token tree after P keys that differ from row t alone over its visible keys."""
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 5, 6, 4, 8]
    T = len(parents)
    tree = Tree([0] * T, parents).mask()[1:, 1:]  # [T, T] ancestors and self
    mask = torch.cat([torch.ones(T, P, dtype=torch.bool), tree], dim=1)  # [T, P + T]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, n, hd, generator=g) for h, n in ((Hkv * G, T), (Hkv, P + T), (Hkv, P + T)))
    full = invariant_attention(q, k, v, mask)
    return [t for t in range(T) if not torch.equal(full[:, :, t], invariant_attention(
        q[:, :, t:t + 1], k[:, :, mask[t]], v[:, :, mask[t]])[:, :, 0])]


def test_a_tree_across_a_key_block_boundary_is_summed_by_rank(monkeypatch):
    """On any CPU (a stand-in product that sums strictly in key order): a tree whose tokens straddle a
    block boundary puts a row's keys in blocks by their rank, as vanilla sees them packed; by position, a
    deep row's ancestors would fall in the next block (another grouping of the sum) and rows differ."""

    monkeypatch.setattr(invariant, "_product", sequential_matmul)
    P = invariant.KEY_BLOCK - 6  # tree tokens 6.. sit past the boundary; their ranks (P + depth <= P + 4) do not
    with torch.inference_mode():
        assert tree_rows_differ(P) == []
        monkeypatch.setattr(invariant, "key_blocks", lambda mask: None)
        assert tree_rows_differ(P) != []


def test_key_blocks_are_runs_of_positions_unless_a_tree_straddles_a_boundary():
    from minispec.exact.attention import KEY_BLOCK, key_blocks

    S = 2 * KEY_BLOCK + 5
    assert key_blocks(torch.ones(5, S, dtype=torch.bool).tril(S - 5)) is None  # causal: rank = position
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # node 2 sees 0 and itself
    P = KEY_BLOCK - 2
    mask = torch.cat([torch.ones(3, P, dtype=torch.bool), tree], dim=1)  # node 2 at position KEY_BLOCK, rank KEY_BLOCK - 1
    blocks = key_blocks(mask)
    assert [b.tolist() for b in blocks] == [list(range(KEY_BLOCK + 1))]
    assert key_blocks(torch.cat([torch.ones(3, 5, dtype=torch.bool), tree], dim=1)) is None  # within one block
    other = torch.cat([torch.ones(3, P, dtype=torch.bool), torch.ones(3, 3, dtype=torch.bool).tril()], dim=1)  # a chain
    assert key_blocks(torch.stack([mask, other])[:, None]) == "per batch"


def split_when_alone_matmul(a, b):
    """A stand-in for a BLAS that splits a lone product's rows between two threads: a product alone in its
    batch sums its rows past the first thread's share (half, down to a multiple of 4) from the last key."""
    y = sequential_matmul(a, b)
    if a.dim() == 2 or a.shape[0] == 1:
        h = a.shape[-2] // 2 // 4 * 4
        y[..., h:, :] = sequential_matmul(a[..., h:, :], b, flip=True)
    return y


def test_a_lone_product_gets_company_so_no_thread_splits_it(monkeypatch):
    """On any CPU: with one KV head and batch 1 at 2 threads, the products run in a batch of at least 2
    (zero entries), so a stand-in BLAS that splits a lone product's rows between threads never does."""

    monkeypatch.setattr(invariant, "_product", split_when_alone_matmul)
    with threads(2), torch.inference_mode():
        assert causal_rows_differ(invariant.AttentionPadding(), Hkv=1, G=2) == []
        monkeypatch.setattr(invariant, "batch_for_threads", lambda B, Hkv: B)
        assert causal_rows_differ(invariant.AttentionPadding(), Hkv=1, G=2) != []


def test_the_probed_attention_padding_holds_after_long_prefixes():
    """The padding chosen on this CPU, on a chain after 517 keys (more than two key blocks), SmolLM2's layout."""

    for n_threads in THREADS:
        with threads(n_threads), torch.inference_mode():
            padding = invariant.attention_padding(64)
            assert padding.invariant, f"no invariant attention padding at {n_threads} threads"
            assert causal_rows_differ(padding, P=517, hd=64) == []


def test_the_exact_backend_attends_with_the_row_invariant_attention_and_dense_with_sdpa():
    from minispec.attention import BACKENDS, attention
    from minispec.attention.plan import Plan

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 5, 16, generator=g), torch.randn(1, 2, 9, 16, generator=g), torch.randn(1, 2, 9, 16, generator=g)
    plan = Plan(torch.arange(4, 9)[None])
    assert torch.equal(BACKENDS["exact"](q, k, v, plan), invariant_attention(q, k, v))
    assert torch.equal(BACKENDS["dense"](q, k, v, plan), attention(q, k, v))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(5, 9, dtype=torch.bool).tril(4), enable_gqa=True)
    torch.testing.assert_close(attention(q, k, v), ref)


def test_one_call_gives_a_model_built_in_code_the_exact_backend():
    """``minispec.exact.apply``: a ``Transformer(cfg)`` of plain ``nn.Linear`` layers and "dense" attention becomes,
    in place, one whose linears are ``ExactLinear`` on the same parameters (same state_dict) and whose attention is
    "exact"; its rows then do not depend on their company, which the plain model does not promise."""
    from minispec import Transformer, exact
    from minispec.model import ModelConfig

    cfg = ModelConfig("llama", 256, 2, 4, 64, 128, 512, n_kv_head=2, tie_embeddings=False)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    assert model.attention == "dense" and not any(isinstance(m, ExactLinear) for m in model.modules())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert exact.apply(model) is model and exact.applied(model) and model.attention == "exact"
    assert sum(isinstance(m, ExactLinear) for m in model.modules()) == 4 * cfg.n_layer + 1
    assert state.keys() == model.state_dict().keys() and all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        kv = KVCache.for_model(model, 48)
        model(ids[:, :30], kv=kv)
        kv.commit()
        full = model(ids[:, 30:], kv=kv).logits[0]
        kv.discard()
        for n in (1, 2, 3, 7):
            assert torch.equal(model(ids[:, 30:30 + n], kv=kv).logits[0], full[:n])
            kv.discard()


# ------------------------------------------------------------------------------ SmolLM2 forward

def _cache(model, kind: str, capacity: int):
    return KVCache.for_model(model, capacity) if kind == "contiguous" else \
        PagedKVCache.for_model(model, capacity, block_size=16)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize("n_threads", PARAM_THREADS)
@pytest.mark.parametrize("prefill", [24, 520])  # 520: the keys span three blocks of the attention's p @ v
def test_smollm2_logits_do_not_depend_on_the_row_count(smollm2, n_threads, kind, prefill):
    model, _ = smollm2
    P = prefill
    ids = torch.randint(0, model.cfg.vocab_size, (P + 65,), generator=torch.Generator().manual_seed(0))
    kv = _cache(model, kind, P + 65 + 8)
    with threads(n_threads), torch.inference_mode():
        model(ids[None, :P], kv=kv)
        kv.commit()
        full = model(ids[None, P:], kv=kv).logits[0]  # [65, V]
        kv.discard()
        for n in (1, 2, 4, 9, 33):
            rows = model(ids[None, P:P + n], kv=kv).logits[0]
            kv.discard()
            assert torch.equal(rows, full[:n]), f"{n} rows: max difference {(rows - full[:n]).abs().max():.3g}"
        # a tree whose first branch is the chain: every node's logits equal its own path's last row
        parents = [-1, 0, 1, 2, 0, 4, 1, 6, 6, 3, -1, 10, 11]
        tokens = [int(t) for t in ids[P + 1:P + 5]] + [7, 8, 9, 10, 11, 12, 13, 14, 15]
        tree = Tree(tokens, parents)
        root = ids[P:P + 1]
        out = model(torch.cat([root, torch.tensor(tokens)])[None], kv=kv,
                    positions=tree.positions(kv.length), mask=tree.mask()).logits[0]
        kv.discard()
        assert torch.equal(out[:5], full[:5])  # root + the chain's first four tokens
        for i, path in enumerate(_paths(parents)):
            chain = model(torch.cat([root, torch.tensor([tokens[j] for j in path])])[None], kv=kv).logits[0, -1]
            kv.discard()
            assert torch.equal(out[i + 1], chain), f"tree node {i} (path {path})"


def _paths(parents):
    """Root-to-node paths of every node, in node order."""
    paths = []
    for i, p in enumerate(parents):
        paths.append((paths[p] if p >= 0 else []) + [i])
    return paths


def test_attention_is_differentiable():
    """Under autograd the attention runs out of place (a draft model trains through it): gradcheck in float64."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, m, 8, dtype=torch.float64, generator=g, requires_grad=True)
               for n, m in ((4, 5), (2, 9), (2, 9)))
    mask = torch.ones(5, 9, dtype=torch.bool).tril(4)
    assert torch.autograd.gradcheck(lambda q, k, v: invariant_attention(q, k, v, mask), (q, k, v))
