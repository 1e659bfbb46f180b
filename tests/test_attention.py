"""Chapter 6: split tree attention (PyTorch reference and Triton kernels) against dense attention.

The Triton kernels run on CPU through the interpreter (tests/conftest.py sets TRITON_INTERPRET=1
when there is no GPU); shapes are kept small so that the whole file stays fast.
"""

import functools
import math

import pytest
import torch

from minispec import generate, load
from minispec.attention import BACKENDS, attention, triton_available
from minispec.attention.plan import Plan
from minispec.attention.reference import dense_attention, dense_backend, expand_kv, merge, prefix_attention, \
    sdpa_backend, split_attention, suffix_attention
from minispec.drafters import Drafter, PromptLookup
from minispec.tree import Tree

pytestmark = pytest.mark.ch06

needs_triton = pytest.mark.skipif(
    not triton_available("cpu"), reason="Triton interpreter is off (TRITON_INTERPRET=1 must precede importing triton)")


def random_tree_mask(T: int, g: torch.Generator) -> torch.Tensor:
    """[T, T] ancestor mask of a tree with random parents (node 0 the root): each node sees itself and its ancestors."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, T)]
    m = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def dense64(q, k, v, prefix_len, tree_mask):
    """float64 softmax attention with the mask [all prefix | tree]: the ground truth."""
    B, H, T, hd = q.shape
    G = H // k.shape[1]
    k, v = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)  # [B, H, S, hd]
    tm = tree_mask if tree_mask.dim() == 3 else tree_mask[None]
    full = torch.cat([torch.ones(tm.shape[0], T, prefix_len, dtype=torch.bool), tm], -1)[:, None]  # [B|1, 1, T, S]
    s = (q.double() @ k.transpose(-1, -2)) / math.sqrt(hd)
    return torch.softmax(s.masked_fill(~full, float("-inf")), -1) @ v


def make_case(B, H, Hkv, T, P, hd, seed, per_batch_mask=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, hd, generator=g)
    cache_k = torch.randn(B, Hkv, P + T + 5, hd, generator=g)  # a cache with spare capacity: k is a strided view
    cache_v = torch.randn(B, Hkv, P + T + 5, hd, generator=g)
    k, v = cache_k[:, :, :P + T], cache_v[:, :, :P + T]
    if per_batch_mask:
        mask = torch.stack([random_tree_mask(T, g) for _ in range(B)])  # [B, T, T]
    else:
        mask = random_tree_mask(T, g)  # [T, T]
    return q.to(dtype), k.to(dtype), v.to(dtype), mask


# (B, H, Hkv, T, prefix, hd): empty prefix, 1, non-multiples of the tile, T up to 64, GQA groups 1 / 4 / 8
CASES = [
    (1, 2, 2, 1, 0, 16),
    (2, 4, 1, 3, 0, 16),
    (1, 4, 1, 7, 1, 16),
    (2, 8, 1, 16, 37, 32),
    (4, 4, 4, 5, 100, 16),
    (1, 8, 2, 64, 37, 16),
    (3, 16, 2, 12, 100, 8),
    (1, 2, 2, 33, 64, 16),
]
IDS = [f"B{c[0]}-H{c[1]}-Hkv{c[2]}-T{c[3]}-P{c[4]}-hd{c[5]}" for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_torch_split_equals_dense(case):
    B, H, Hkv, T, P, hd = case
    q, k, v, mask = make_case(*case, seed=sum(case), per_batch_mask=B > 1)
    want = dense64(q, k, v, P, mask)
    got = split_attention(q, k, v, P, mask)
    full = torch.cat([torch.ones(*mask.shape[:-1], P, dtype=torch.bool), mask], -1)  # [(B,) T, S]
    sdpa = dense_attention(q, k, v, full if full.dim() == 2 else full[:, None])
    assert got.shape == (B, H, T, hd) and got.dtype == q.dtype
    assert (got.double() - want).abs().max() < 1e-5
    assert (sdpa.double() - want).abs().max() < 1e-5


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_triton_split_equals_references(case):
    from minispec.attention.triton_split import split_attention_triton

    B, H, Hkv, T, P, hd = case
    q, k, v, mask = make_case(*case, seed=sum(case) + 1, per_batch_mask=B % 2 == 0)
    got = split_attention_triton(q, k, v, P, mask)
    assert got.shape == (B, H, T, hd) and got.dtype == q.dtype
    assert (got.double() - dense64(q, k, v, P, mask)).abs().max() < 1e-5
    assert (got - split_attention(q, k, v, P, mask)).abs().max() < 1e-5


@needs_triton
@pytest.mark.parametrize("splits, block_n", [(1, 16), (3, 16), (4, 32), (7, 16)])
def test_triton_split_counts_and_tiles(splits, block_n):
    """More splits than tiles (empty splits), ragged last tile, several tiles per split: same result."""
    from minispec.attention.triton_split import split_attention_triton

    q, k, v, mask = make_case(2, 4, 2, 9, 77, 16, seed=splits)
    got = split_attention_triton(q, k, v, 77, mask, num_splits=splits, block_n=block_n, block_m=16)
    assert (got.double() - dense64(q, k, v, 77, mask)).abs().max() < 1e-5


@needs_triton
def test_triton_causal_suffix_when_mask_is_none():
    from minispec.attention.triton_split import split_attention_triton

    q, k, v, _ = make_case(1, 4, 2, 6, 20, 16, seed=3)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    assert (split_attention_triton(q, k, v, 20, None).double() - dense64(q, k, v, 20, causal)).abs().max() < 1e-5
    assert (split_attention(q, k, v, 20, None).double() - dense64(q, k, v, 20, causal)).abs().max() < 1e-5


def test_prefix_and_suffix_parts():
    q, k, v, mask = make_case(2, 4, 2, 6, 13, 16, seed=4)
    out_p, lse_p = prefix_attention(q, k[:, :, :13], v[:, :, :13])
    out_s, lse_s = suffix_attention(q, k[:, :, 13:], v[:, :, 13:], mask)
    assert out_p.shape == (2, 4, 6, 16) and lse_p.shape == (2, 4, 6) and lse_p.dtype == torch.float32
    # each part alone is attention over its own keys
    no_tree = torch.zeros(6, 0, dtype=torch.bool)
    assert (out_p.double() - dense64(q, k[:, :, :13], v[:, :, :13], 13, no_tree)).abs().max() < 1e-5
    kk = k[:, :, :13].double().repeat_interleave(2, 1)
    s = q.double() @ kk.transpose(-1, -2) / 4.0  # hd = 16
    assert (lse_p.double() - torch.logsumexp(s, -1)).abs().max() < 1e-5
    assert (out_s.double() - dense64(q, k[:, :, 13:], v[:, :, 13:], 0, mask)).abs().max() < 1e-5
    empty_o, empty_l = prefix_attention(q, k[:, :, :0], v[:, :, :0])
    assert (empty_o == 0).all() and torch.isneginf(empty_l).all()


def test_merge_is_exact_and_stable():
    g = torch.Generator().manual_seed(0)
    out_a, out_b = torch.randn(3, 5, 8, generator=g), torch.randn(3, 5, 8, generator=g)
    lse_a, lse_b = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g) + 2
    got, lse = merge(out_a, lse_a, out_b, lse_b, return_lse=True)
    wa = torch.sigmoid(lse_a - lse_b)[..., None]  # exp(lse_a) / (exp(lse_a) + exp(lse_b))
    assert torch.allclose(got, wa * out_a + (1 - wa) * out_b, atol=1e-6)
    assert torch.allclose(lse, torch.logaddexp(lse_a, lse_b))
    # empty prefix (lse -inf): the suffix alone; both empty: zeros, never nan
    ninf = torch.full_like(lse_a, float("-inf"))
    assert torch.equal(merge(torch.zeros_like(out_a), ninf, out_b, lse_b), out_b)
    assert torch.equal(merge(out_a, ninf, out_b, ninf), torch.zeros_like(out_a))
    # huge log-sum-exps: no overflow
    big = merge(out_a, lse_a + 1000, out_b, lse_b + 1000)
    assert torch.isfinite(big).all() and torch.allclose(big, got, atol=1e-3)  # float32 ulp at 1000 is 6e-5


def test_merge_of_two_halves_equals_attention_over_all_keys():
    q, k, v, _ = make_case(1, 4, 4, 3, 40, 16, seed=6)
    k, v = k[:, :, :40], v[:, :, :40]
    a = prefix_attention(q, k[:, :, :17], v[:, :, :17])
    b = prefix_attention(q, k[:, :, 17:], v[:, :, 17:])
    whole = prefix_attention(q, k, v)
    out, lse = merge(*a, *b, return_lse=True)
    assert (out - whole[0]).abs().max() < 1e-5 and (lse - whole[1]).abs().max() < 1e-5


def test_bad_inputs_raise():
    q, k, v, mask = make_case(1, 4, 2, 5, 10, 16, seed=7)
    with pytest.raises(ValueError, match="prefix_len"):
        split_attention(q, k, v, 9, mask)
    with pytest.raises(ValueError, match="multiple"):
        split_attention(q[:, :3], k, v, 10, mask)
    with pytest.raises(ValueError, match="does not fit"):
        split_attention(q, k, v, 10, torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="boolean"):
        split_attention(q, k, v, 10, mask.float())
    with pytest.raises(ValueError, match="does not fit"):
        split_attention(q, k[..., :8], v[..., :8], 10, mask)
    with pytest.raises(ValueError, match="cannot merge"):
        merge(q, q[..., 0], q[..., :4], q[..., 0])


def test_general_mask_falls_back_to_dense():
    """A [T, S] mask hiding part of the prefix: the split backends must give dense's answer."""
    q, k, v, _ = make_case(1, 4, 2, 4, 6, 16, seed=8)
    full = torch.ones(4, 10, dtype=torch.bool).tril(6)
    full[:, 2] = False  # a prefix token nobody sees
    plan = Plan(torch.arange(6, 10)[None], mask=full)
    want = BACKENDS["dense"](q, k, v, plan)
    assert torch.equal(BACKENDS["split_torch"](q, k, v, plan), want)
    assert (want.double() - dense64(q, k, v, 6, full[:, 6:])).abs().max() > 1e-3  # it does matter


# --------------------------------------------------------------------------- the model with each backend
@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


def _backends():
    return ["split_torch", pytest.param("split_triton", marks=needs_triton)]


def test_backend_attribute_and_errors(tiny):
    model, _ = tiny
    assert model.attention == "exact"  # load() gives a CPU float32 model the exact backend (minispec.exact)
    assert set(BACKENDS) == {"dense", "flash", "split_torch", "split_triton", "exact"}
    with pytest.raises(ValueError, match="unknown attention backend 'sparse'"):
        model.set_attention("sparse")
    with pytest.raises(ValueError, match="unknown attention backend"):
        model.attention = "sdpa"
    assert model.attention == "exact"
    try:
        model.attention = "split_torch"
        assert model.plan(torch.zeros(1, 2, dtype=torch.long)).attention is BACKENDS["split_torch"]
    finally:
        model.set_attention("exact")


def test_split_triton_needs_gpu_or_interpreter(tiny, monkeypatch):
    model, _ = tiny
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if torch.cuda.is_available():
        pytest.skip("with CUDA the kernels can run; the CPU-without-interpreter case is what this checks")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        model.set_attention("split_triton")
    assert model.attention == "exact"


def test_attention_package_imports_without_triton():
    import subprocess
    import sys

    script = ("import sys; sys.modules['triton'] = None\n"  # any 'import triton' now raises ImportError
              "import minispec, minispec.attention as a\n"
              "assert not a.triton_available('cpu') and 'minispec.attention.triton_split' not in sys.modules\n"
              "print('ok')")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_model_general_mask_falls_back_to_dense(tiny):
    """A [T, S] mask over prefix + tree (here hiding one prefix token) is served by dense SDPA."""
    from minispec import KVCache

    model, _ = tiny
    x = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(11))
    full = torch.ones(4, 10, dtype=torch.bool).tril(6)
    full[:, 1] = False
    out = {}
    try:
        for name in ("dense", "split_torch"):
            model.set_attention(name)
            with torch.no_grad():
                kv = KVCache.for_model(model, 16)
                model(x[:, :6], kv=kv)
                kv.commit()
                out[name] = model(x[:, 6:], mask=full, kv=kv).logits
                kv.discard()
                out[name + " tree form"] = model(x[:, 6:], mask=full[:, 6:], kv=kv).logits  # whole prefix visible
    finally:
        model.set_attention("exact")
    assert (out["dense"] - out["split_torch"]).abs().max() < 1e-5  # the prefill ran split: rounding only
    assert (out["dense"] - out["split_torch tree form"]).abs().max() > 1e-3  # the hidden prefix token matters


class TwoBranches(Drafter):
    """A non-chain tree drafter (as in tests/test_speculative.py): two root children, each with a child."""

    max_nodes = 4

    def __init__(self, model):
        self.model = model

    def propose(self, params, budget, generator=None):
        if budget < 2:
            return Tree([], [])
        with torch.no_grad():
            top = self.model(torch.tensor([self.context])).logits[0, -1].topk(2).indices.tolist()
        return Tree([top[1], top[0], top[0], top[1]], [-1, -1, 0, 1])


@pytest.mark.parametrize("backend", _backends())
def test_greedy_decoding_matches_dense(tiny, backend):
    model, tok = tiny
    prompt = "abcabcabc abc"
    want = {name: generate(model, tok, prompt, drafter=make(), max_new_tokens=16).tokens
            for name, make in [("vanilla", lambda: None), ("lookup", lambda: PromptLookup(k=4)),
                               ("tree", lambda: TwoBranches(model))]}
    try:
        model.set_attention(backend)
        for name, make in [("vanilla", lambda: None), ("lookup", lambda: PromptLookup(k=4)),
                           ("tree", lambda: TwoBranches(model))]:
            got = generate(model, tok, prompt, drafter=make(), max_new_tokens=16).tokens
            assert got == want[name], f"{backend} with {name} drafter differs from exact"
    finally:
        model.set_attention("exact")


@pytest.mark.parametrize("backend", _backends())
def test_tree_forward_logits_match_dense(tiny, backend):
    from minispec import KVCache

    model, _ = tiny
    g = torch.Generator().manual_seed(9)
    prefix, tree = torch.randint(0, 256, (1, 11), generator=g), torch.randint(0, 256, (1, 6), generator=g)
    mask = random_tree_mask(6, g)
    out = {}
    try:
        for name in ("dense", backend):
            model.set_attention(name)
            with torch.no_grad():
                kv = KVCache.for_model(model, 32)
                model(prefix, kv=kv)
                kv.commit()
                out[name] = model(tree, mask=mask, kv=kv).logits
    finally:
        model.set_attention("exact")
    assert (out["dense"] - out[backend]).abs().max() < 1e-4


# --------------------------------------------------------------------------- GPU, bf16
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", [(1, 32, 8, 16, 1000, 128), (4, 32, 8, 64, 4099, 128), (2, 8, 8, 1, 0, 64)])
def test_gpu_bf16(case):
    """bf16 inputs, fp32 accumulation: within 2e-2 (bf16 has an 8-bit mantissa, ~4e-3 relative) of float64."""
    from minispec.attention.triton_split import split_attention_triton

    B, H, Hkv, T, P, hd = case
    q, k, v, mask = make_case(*case, seed=P)
    want = dense64(q, k, v, P, mask)
    q, k, v, mask = (x.cuda() for x in (q.bfloat16(), k.bfloat16(), v.bfloat16(), mask))
    got = split_attention_triton(q, k, v, P, mask)
    ref = split_attention(q, k, v, P, mask)
    assert got.dtype == torch.bfloat16
    assert (got.double().cpu() - want).abs().max() < 2e-2
    assert (ref.double().cpu() - want).abs().max() < 2e-2


# --------------------------------------------------------------------------- chapter 6 checks catch wrong answers
def _ch06_with(**overrides):
    from types import SimpleNamespace

    from minispec.grading import load_impl

    mod = load_impl(6, "solutions", reload=False)
    ns = SimpleNamespace(**{k: v for k, v in vars(mod).items() if not k.startswith("__")})
    ns.__dict__.update(overrides)
    return ns


def _merge_no_weights(out_a, lse_a, out_b, lse_b):
    return out_a + out_b, torch.logaddexp(lse_a, lse_b)


def _merge_naive_exp(out_a, lse_a, out_b, lse_b):
    lse = torch.log(torch.exp(lse_a) + torch.exp(lse_b))  # overflows at lse ~ 710
    return out_a * torch.exp(lse_a - lse)[..., None] + out_b * torch.exp(lse_b - lse)[..., None], lse


def _softmax_nan_rows(q, k, v, mask):
    s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)  # softmax of an all -inf row is nan


def _tiles_without_rescale(q, k, v, block):
    outs, lses = [], []
    for j in range(0, k.shape[-2], block):  # each tile normalised alone, then averaged: wrong weights
        visible = torch.ones(q.shape[-2], min(block, k.shape[-2] - j), dtype=torch.bool)
        o, l_ = _ch06_with().masked_attention_lse(q, k[..., j:j + block, :], v[..., j:j + block, :], visible)
        outs.append(o)
        lses.append(l_)
    if not outs:
        return torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    return torch.stack(outs).mean(0), torch.logsumexp(torch.stack(lses), 0)


def _split_ignoring_tree(q, k, v, prefix_len, tree_mask, block=16):
    return _ch06_with().split_tree_attention(q, k, v, prefix_len, torch.ones_like(tree_mask), block)


@functools.cache
def _wrong_prefix_kernel():
    """Exercise 6.5's kernel with three possible mistakes, each switched on by a constexpr flag."""
    import triton
    import triton.language as tl

    def kernel(Q, K, V, Lens, O, L, R, N, D, chunk, scale, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr, RESCALE: tl.constexpr, TAIL_MASK: tl.constexpr, EMPTY_GUARD: tl.constexpr):
        b, split = tl.program_id(0), tl.program_id(1)
        r, d = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_D)
        rd_ok = (r < R)[:, None] & (d < D)[None, :]
        q = tl.load(Q + b * R * D + r[:, None] * D + d[None, :], mask=rd_ok, other=0.0)
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_ = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        start = split * chunk
        end = tl.minimum(start + chunk, tl.load(Lens + b))
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            if TAIL_MASK:
                n_ok = n < end
            else:
                n_ok = n < N  # only in bounds: keys past the split and past P_b leak in
            kv = b * N * D + n[:, None] * D + d[None, :]
            k = tl.load(K + kv, mask=n_ok[:, None] & (d < D)[None, :], other=0.0)
            v = tl.load(V + kv, mask=n_ok[:, None] & (d < D)[None, :], other=0.0)
            s = tl.where(n_ok[None, :], tl.dot(q, tl.trans(k), input_precision="ieee") * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            if RESCALE:
                alpha = tl.exp(m - m_new)
                l_ = l_ * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:  # the old sum and output stay scaled to the old max
                l_ = l_ + tl.sum(p, 1)
                acc = acc + tl.dot(p, v, input_precision="ieee")
            m = m_new
        if EMPTY_GUARD:
            seen = l_ > 0
            out = acc / tl.where(seen, l_, 1.0)[:, None]
            lse = tl.where(seen, m + tl.log(tl.where(seen, l_, 1.0)), float("-inf"))
        else:  # an empty split: 0 / 0
            out = acc / l_[:, None]
            lse = m + tl.log(l_)
        row = (b * tl.num_programs(1) + split) * R + r
        tl.store(O + row[:, None] * D + d[None, :], out, mask=rd_ok)
        tl.store(L + row, lse, mask=r < R)

    return triton.jit(kernel)


class _PrefixWith:
    """``kernel[grid](...)`` of the wrong prefix kernel with some of its mistakes on."""

    def __init__(self, **mistakes):
        self.flags = {**dict(RESCALE=True, TAIL_MASK=True, EMPTY_GUARD=True), **mistakes}

    def __getitem__(self, grid):
        return lambda *args, **meta: _wrong_prefix_kernel()[grid](*args, **meta, **self.flags)

    def __call__(self, *args, **kwargs):
        raise TypeError("launch a kernel with kernel[grid](...)")


CH06_WRONG = [
    ("6.1", dict(merge_partials=_merge_no_weights), "differs from the reference"),
    ("6.1", dict(merge_partials=_merge_naive_exp), "+1000"),
    ("6.3", dict(masked_attention_lse=_softmax_nan_rows), "contains nan"),
    ("6.4", dict(tiled_attention=_tiles_without_rescale), "in tiles of"),
    ("6.5", dict(prefix_split_kernel=_PrefixWith(RESCALE=False)), "differs from float64 softmax attention"),
    ("6.5", dict(prefix_split_kernel=_PrefixWith(TAIL_MASK=False)),
     "(P_b=37), split 1: keys 32..36 (1 tile(s) of 16, the last one running past key 36)"),
    ("6.5", dict(prefix_split_kernel=_PrefixWith(EMPTY_GUARD=False)), "is nan in batch 0 (P_b=0), split 0: no key"),
    ("6.5", dict(prefix_split_kernel=_PrefixWith()), None),  # all mistakes off: the same kernel passes
    ("6.6", dict(split_tree_attention=_split_ignoring_tree), "differs from the reference"),
]


@pytest.mark.parametrize("ex_id, overrides, needle", CH06_WRONG, ids=[f"{w[0]}-{i}" for i, w in enumerate(CH06_WRONG)])
def test_ch06_checks_catch_wrong_answers(ex_id, overrides, needle):
    from minispec.grading import find_exercise

    ex = find_exercise(ex_id)
    passed, msg = ex.run(_ch06_with(**overrides))
    if needle is None:  # the control: the harness itself does not fail a correct kernel
        assert passed, msg
        return
    assert not passed
    assert msg.startswith(f"Exercise {ex_id} {ex.name}: ") and needle in msg, msg


# --------------------------------------------------------------------------- SDPA's kernel under a mask (GQA)
def test_expand_kv_is_repeat_interleave():
    k = torch.randn(2, 3, 5, 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(expand_kv(k, 12), k.repeat_interleave(4, 1))  # head h reads KV head h // 4


@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("H, Hkv", [(8, 2), (6, 6)])
def test_dense_attention_under_a_mask_folds_the_query_heads_and_equals_the_expanded_form(per_batch, H, Hkv):
    """With a mask and Hkv < H, ``attention`` folds the G query heads of a KV head into its query rows (q
    [B, H, T, hd] -> [B, Hkv, G*T, hd], the mask repeated over G) and never expands K / V: SDPA then sees Hkv
    heads and no GQA. It equals SDPA over K / V expanded to every query head (``expand_kv``)."""
    B, T, P, hd = 2, 6, 21, 16
    q, k, v, mask = make_case(B, H, Hkv, T, P, hd, seed=12, per_batch_mask=per_batch)
    tm = mask if mask.dim() == 3 else mask[None]
    full = torch.cat([torch.ones(tm.shape[0], T, P, dtype=torch.bool), tm], -1)[:, None]  # [B|1, 1, T, S]
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q_, k_, v_, **kw):
        seen.append((tuple(q_.shape), tuple(k_.shape), kw.get("enable_gqa", False)))
        return real(q_, k_, v_, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
        got = dense_attention(q, k, v, full)
        two_d = attention(q, k, v, full[0, 0]) if not per_batch else None
    G = H // Hkv
    assert seen[0] == ((B, Hkv, G * T, hd), (B, Hkv, P + T, hd), False)  # K / V as they are, no GQA in SDPA
    expanded = real(q, expand_kv(k, H), expand_kv(v, H), attn_mask=full)
    torch.testing.assert_close(got, expanded, atol=1e-6, rtol=1e-5)
    if two_d is not None:  # a [T, S] mask: the same
        torch.testing.assert_close(two_d, expanded, atol=1e-6, rtol=1e-5)
    assert (got.double() - dense64(q, k, v, P, mask)).abs().max() < 1e-5


def _meta(B, H, T, hd, dtype):
    return torch.empty(B, H, T, hd, dtype=dtype, device="meta")  # shapes only: the rules read no data


BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
SDPA_RULES = [  # (dtype, H, Hkv, T, S, hd, mask?, is_causal, capability) -> backend, by PyTorch's documented rules
    ((BF16, 32, 8, 16, 1040, 128, False, False, (9, 0)), "flash"),  # no mask: flash, GQA and all
    ((BF16, 32, 8, 16, 1040, 128, True, False, (9, 0)), "math"),  # the defect: mask + GQA -> math
    ((BF16, 32, 32, 16, 1040, 128, True, False, (9, 0)), "efficient"),  # what dense_attention runs: query heads folded into rows, no GQA
    ((F32, 32, 32, 16, 1040, 128, False, False, (9, 0)), "efficient"),  # flash takes no fp32
    ((F32, 32, 8, 16, 1040, 128, False, False, (9, 0)), "math"),  # fp32 with GQA: efficient has none
    ((BF16, 8, 8, 16, 1040, 264, False, False, (9, 0)), "efficient"),  # head dim past flash's 256
    ((BF16, 8, 8, 16, 1040, 260, False, False, (9, 0)), "math"),  # ... and not a multiple of 8
    ((BF16, 8, 8, 16, 1040, 64, False, True, (9, 0)), "efficient"),  # is_causal with T != S: not flash
    ((BF16, 8, 8, 16, 16, 64, False, True, (9, 0)), "flash"),
    ((F16, 8, 8, 16, 1040, 64, False, False, (7, 5)), "efficient"),  # Turing: no flash
    ((BF16, 8, 8, 16, 1040, 64, False, False, (7, 5)), "math"),  # ... and no bf16
]


@pytest.mark.parametrize("case, want", SDPA_RULES, ids=[f"{w}-{i}" for i, (_, w) in enumerate(SDPA_RULES)])
def test_sdpa_backend_rules_for_cuda_inputs(case, want):
    dtype, H, Hkv, T, S, hd, masked, is_causal, cap = case
    q, k = _meta(2, H, T, hd, dtype), _meta(2, Hkv, S, hd, dtype)
    mask = torch.ones(T, S, dtype=torch.bool) if masked else None
    assert sdpa_backend(q, k, mask, is_causal, device_type="cuda", capability=cap) == want
    assert sdpa_backend(q, k, mask, is_causal) == "cpu"  # a non-CUDA device: not modelled


def test_dense_backend_names_the_kernel_after_folding():
    q, k = _meta(4, 32, 16, 128, BF16), _meta(4, 8, 1040, 128, BF16)
    mask = torch.ones(4, 1, 16, 1040, dtype=torch.bool)
    assert dense_backend(q, k, mask, device_type="cuda", capability=(9, 0)) == "efficient"  # not math
    assert dense_backend(q, k, None, device_type="cuda", capability=(9, 0)) == "flash"


NEEDED = [(case, want) for case, want in SDPA_RULES[:9] if want != "math"]  # inputs minispec hands a fused kernel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case, want", NEEDED, ids=[f"{w}-{i}" for i, (_, w) in enumerate(NEEDED)])
def test_gpu_sdpa_backend_rules(case, want):
    """What minispec needs on this GPU: the fused kernel the rules predict for an input runs it, alone. Not
    asserted: that the kernels PyTorch tries before it refuse (a newer PyTorch may accept more, e.g. GQA with a
    mask in the memory-efficient kernel, and minispec loses nothing by it)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype, H, Hkv, T, S, hd, masked, is_causal, _ = case
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, H, T, hd, dtype=dtype, device="cuda", generator=g)
    k, v = (torch.randn(2, Hkv, S, hd, dtype=dtype, device="cuda", generator=g) for _ in range(2))
    mask = torch.ones(T, S, dtype=torch.bool, device="cuda") if masked else None
    if sdpa_backend(q, k, mask, is_causal) != want:
        pytest.skip(f"this GPU's capability {torch.cuda.get_device_capability()} gives another prediction")
    kernel = dict(flash=SDPBackend.FLASH_ATTENTION, efficient=SDPBackend.EFFICIENT_ATTENTION)[want]
    with sdpa_kernel([kernel]):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                                               enable_gqa=H != Hkv)
    assert out.shape == q.shape and bool(torch.isfinite(out).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_masked_gqa_attention_runs_without_the_math_kernel():
    """minispec's dense attention over a tree mask with GQA (a verify step of a Llama-shaped model in bf16) runs
    with the math fallback disabled, and gives the float64 reference's answer to bf16 precision."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H, Hkv, T, P, hd = 2, 32, 8, 16, 1024, 128
    q, k, v, mask = make_case(B, H, Hkv, T, P, hd, seed=5, per_batch_mask=True)
    full = torch.cat([torch.ones(B, T, P, dtype=torch.bool), mask], -1)[:, None]  # [B, 1, T, P + T]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        got = dense_attention(*(x.to("cuda", torch.bfloat16) for x in (q, k, v)), full.cuda())
    assert (got.double().cpu() - dense64(q, k, v, P, mask)).abs().max() < 3e-2


# --------------------------------------------------------------------------- Triton: fp32 precision and tiles
def test_launch_config_fp32_takes_smaller_tiles_and_fewer_stages():
    from minispec.attention.triton_split import launch_config

    bf16, fp32 = (launch_config(dt, 128, 64, gpu=True) for dt in (torch.bfloat16, torch.float32))
    assert (bf16["BLOCK_N"], bf16["num_stages"]) == (64, 3)
    assert (fp32["BLOCK_N"], fp32["num_stages"]) == (32, 2)

    def kv_smem(cfg, itemsize):  # K and V tiles over the pipeline's stages
        return cfg["num_stages"] * 2 * cfg["BLOCK_N"] * cfg["BLOCK_D"] * itemsize

    assert kv_smem(fp32, 4) == 64 * 1024 < kv_smem(bf16, 4) == 192 * 1024  # fp32 in the 2-byte tiles: 192 KiB
    assert launch_config(torch.float32, 128, 64, gpu=True, block_m=16, block_n=16)["BLOCK_N"] == 16  # overrides
    assert launch_config(torch.bfloat16, 128, 64, gpu=False)["BLOCK_N"] == 32  # interpreter


@needs_triton
def test_triton_fp32_hd128_matches_float64():
    """fp32 with head dim 128 through the fp32 launch config: within 1e-5 of float64 (IEEE products; a
    GPU's TF32 default would be ~1e-3 off, which only test_gpu_fp32_matches_float64 can show)."""
    from minispec.attention.triton_split import split_attention_triton

    q, k, v, mask = make_case(2, 4, 2, 5, 70, 128, seed=13, per_batch_mask=True)
    got = split_attention_triton(q, k, v, 70, mask)
    assert (got.double() - dense64(q, k, v, 70, mask)).abs().max() < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fp32_matches_float64():
    """On a GPU, fp32 kernels multiply in IEEE precision: the interpreter's 1e-5 holds there too."""
    from minispec.attention.triton_split import split_attention_triton

    q, k, v, mask = make_case(2, 32, 8, 16, 1000, 128, seed=14)
    want = dense64(q, k, v, 1000, mask)
    got = split_attention_triton(q.cuda(), k.cuda(), v.cuda(), 1000, mask.cuda())
    assert (got.double().cpu() - want).abs().max() < 1e-5


# --------------------------------------------------------------------------- Triton: per-row prefix lengths
@needs_triton
def test_triton_split_per_row_prefix_lengths_tensor():
    """Prefix lengths as a tensor [B]: each row equals the PyTorch split over its own prefix."""
    from minispec.attention.triton_split import SplitWorkspace, split_attention_triton

    B, H, Hkv, T, hd, S = 4, 4, 2, 5, 16, 60
    g = torch.Generator().manual_seed(15)
    q = torch.randn(B, H, T, hd, generator=g)
    k, v = torch.randn(B, Hkv, S, hd, generator=g), torch.randn(B, Hkv, S, hd, generator=g)
    mask = torch.stack([random_tree_mask(T, g) for _ in range(B)])  # [B, T, T]
    lens = torch.tensor([0, 1, 33, S - T], dtype=torch.int32)
    out, ws = torch.empty(B, H, T, hd), SplitWorkspace()
    for prefix, kw in ((lens, {}), (lens.long(), {}), (lens, dict(num_splits=3, out=out, workspace=ws))):
        got = split_attention_triton(q, k, v, prefix, mask, **kw)
        for b, P in enumerate(lens.tolist()):
            kb, vb = k[b:b + 1, :, :P + T], v[b:b + 1, :, :P + T]  # row b's keys: its prefix, then its tree
            want = split_attention(q[b:b + 1], kb, vb, P, mask[b])
            assert (got[b:b + 1] - want).abs().max() < 1e-5, (b, P, kw)
    assert got is out
    with pytest.raises(ValueError, match="must fit"):
        split_attention_triton(q, k, v, torch.tensor([0, 1, 2, S - T + 1]), mask)
    with pytest.raises(ValueError, match=r"integer \[B=4\]"):
        split_attention_triton(q, k, v, torch.tensor([3, 4]), mask)
    with pytest.raises(ValueError, match="out must be"):
        split_attention_triton(q, k, v, lens, mask, num_splits=3, out=out[:, :1], workspace=ws)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_split_triton_graph_replays_with_new_prefix_lengths():
    """Captured once in a CUDA graph, the kernels read the lengths from the device: new lengths, same graph."""
    from minispec.attention.triton_split import SplitWorkspace, split_attention_triton

    B, H, Hkv, T, hd, S, ns = 2, 8, 2, 4, 64, 300, 4
    g = torch.Generator().manual_seed(16)
    q = torch.randn(B, H, T, hd, generator=g).cuda()
    k, v = torch.randn(B, Hkv, S, hd, generator=g).cuda(), torch.randn(B, Hkv, S, hd, generator=g).cuda()
    mask = torch.ones(T, T, dtype=torch.bool, device="cuda").tril()
    lens = torch.tensor([100, 250], dtype=torch.int32, device="cuda")
    out, ws = torch.empty_like(q), SplitWorkspace()
    run = lambda: split_attention_triton(q, k, v, lens, mask, num_splits=ns, out=out, workspace=ws)  # noqa: E731
    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for new in ([100, 250], [7, S - T], [0, 0]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        for b, P in enumerate(new):
            want = split_attention(q[b:b + 1], k[b:b + 1, :, :P + T], v[b:b + 1, :, :P + T], P, mask)
            assert (out[b:b + 1] - want).abs().max() < 1e-4, (new, b)
