"""Row-count invariance of the decode forward (what makes greedy verification identical to vanilla).

A row of a forward must give the same bits whatever rows come with it: vanilla decoding computes
one row per step, verification the root and N draft nodes. Checked at three levels, at 1 and 2
threads: every Linear shape of SmolLM2 and the shipped heads; the attention on random shapes and
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

from minispec import invariance
from minispec.attention import attend, invariant_attention
from minispec.kv import KVCache, PagedKVCache
from minispec.linear import Linear
from minispec.tree import Tree

THREADS = (1, 2)


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
@pytest.mark.parametrize("n_threads", THREADS)
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
            layer = Linear(n_in, n_out, bias=bias)
            assert rows_that_differ(layer, n_in) == [], f"{n_in} -> {n_out} (bias {bias}) at {n_threads} threads"


def stand_in_product(long_inputs: int, max_rows: int = 1):
    """A product whose result for calls of up to ``max_rows`` rows is summed in another order, as a BLAS
    that sends one row to a matrix-vector kernel does: on any CPU, those row counts give other bits,
    for inputs longer than ``long_inputs`` (so that the product over half the inputs can be invariant,
    as 1536 -> 576 is on an AVX-512 CPU when split in two). Otherwise each output is an elementwise
    product summed along the contiguous input dimension: the same reduction for every row whatever M is."""
    def product(self, kernel, x, part=None):
        w, b = self._part(part)
        x2 = x.reshape(-1, x.shape[-1])  # [M, in]
        if x2.shape[0] <= max_rows and x2.shape[1] > long_inputs:
            y = (x2.flip(-1)[:, None, :] * w.flip(-1)[None]).sum(-1)  # summed from the last input
        else:
            y = (x2[:, None, :] * w[None]).sum(-1)  # [M, out]
        y = y if b is None else y + b
        return y.reshape(*x.shape[:-1], w.shape[0])
    return product


@pytest.mark.parametrize("n_threads", THREADS)
def test_a_kernel_that_varies_with_the_row_count_is_found_and_padded(monkeypatch, n_threads):
    monkeypatch.setattr(Linear, "_product", stand_in_product(long_inputs=0))  # halves vary too: pad
    torch.manual_seed(0)
    layer = Linear(256, 96, bias=True)
    with threads(n_threads), torch.inference_mode():
        plan = layer.row_plan(torch.zeros(1, 256))
    assert plan.varies == (1,) and plan.split == 1 and plan.min_rows == 2
    assert rows_that_differ(layer, 256) == []  # padded: one row runs as two


def test_a_kernel_that_varies_only_over_long_inputs_is_split(monkeypatch):
    """Where padding would take more than two rows, the product over two input halves is tried."""
    monkeypatch.setattr(Linear, "_product", stand_in_product(long_inputs=128, max_rows=3))
    torch.manual_seed(0)
    layer = Linear(256, 96, bias=True)
    with torch.inference_mode():
        plan = layer.row_plan(torch.zeros(1, 256))
        assert plan.varies == (1, 2, 3) and plan.split == 2 and plan.min_rows == 1
        assert rows_that_differ(layer, 256) == []
        x = torch.randn(5, 256)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_without_the_plan_the_check_fails(monkeypatch):
    monkeypatch.setattr(Linear, "_product", stand_in_product(long_inputs=0))
    torch.manual_seed(0)
    layer = Linear(256, 96, bias=True)
    monkeypatch.setattr(Linear, "row_invariant", False)
    assert rows_that_differ(layer, 256) == [1, -5, -17, -64]


def test_a_kernel_that_varies_at_many_row_counts_is_reported_not_invariant():
    def odd_rows(x):  # every odd row count sums in another order
        y = (x[:, None, :] * W[None]).sum(-1)
        return (x.flip(-1)[:, None, :] * W.flip(-1)[None]).sum(-1) if x.shape[0] % 2 else y

    W = torch.randn(32, 64)
    plan = invariance.choose_plan("odd", odd_rows, odd_rows, 64, torch.float32, torch.device("cpu"))
    assert 1 in plan.varies and 127 in plan.varies and plan.min_rows is None and not plan.invariant
    assert "no plan" in plan.describe()


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
    T, P, hd = draw(st.integers(1, 12)), draw(st.integers(0, 40)), draw(st.sampled_from([8, 16, 64]))
    parents = [-1] + [draw(st.integers(-1, i - 1)) for i in range(1, T)]  # a forest over the new tokens
    return B, Hkv, G, T, P, hd, parents, draw(st.integers(0, 2 ** 31))


@settings(max_examples=int(os.environ.get("MINISPEC_HYPOTHESIS_EXAMPLES", 60)), deadline=None)
@given(attention_case(), st.sampled_from(THREADS))
def test_attention_rows_equal_each_row_alone_over_its_own_keys(case, n_threads):
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
    from minispec.attention import invariant

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


def test_dense_backend_on_the_cpu_is_the_row_invariant_one():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 5, 16, generator=g), torch.randn(1, 2, 9, 16, generator=g), torch.randn(1, 2, 9, 16, generator=g)
    assert torch.equal(attend("dense", q, k, v, 4), invariant_attention(q, k, v))


# ------------------------------------------------------------------------------ SmolLM2 forward

def _cache(model, kind: str, capacity: int):
    return KVCache.for_model(model, capacity) if kind == "contiguous" else \
        PagedKVCache.for_model(model, capacity, block_size=16)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize("n_threads", THREADS)
def test_smollm2_logits_do_not_depend_on_the_row_count(smollm2, n_threads, kind):
    model, _ = smollm2
    ids = torch.randint(0, model.cfg.vocab_size, (24 + 65,), generator=torch.Generator().manual_seed(0))
    kv = _cache(model, kind, 24 + 65 + 8)
    with threads(n_threads), torch.inference_mode():
        model(ids[None, :24], kv=kv)
        kv.commit()
        full = model(ids[None, 24:], kv=kv).logits[0]  # [65, V]
        kv.discard()
        for n in (1, 2, 4, 9, 33):
            rows = model(ids[None, 24:24 + n], kv=kv).logits[0]
            kv.discard()
            assert torch.equal(rows, full[:n]), f"{n} rows: max difference {(rows - full[:n]).abs().max():.3g}"
        # a tree whose first branch is the chain: every node's logits equal its own path's last row
        parents = [-1, 0, 1, 2, 0, 4, 1, 6, 6, 3, -1, 10, 11]
        tokens = [int(t) for t in ids[25:29]] + [7, 8, 9, 10, 11, 12, 13, 14, 15]
        tree = Tree(tokens, parents)
        root = ids[24:25]
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
