"""Chapter 6: split tree attention (PyTorch reference and Triton kernels) against dense attention.

The Triton kernels run on CPU through the interpreter (tests/conftest.py sets TRITON_INTERPRET=1
when there is no GPU); shapes are kept small so that the whole file stays fast.
"""

import math

import pytest
import torch

from minispec import generate, load
from minispec.attention import BACKENDS, attend, dense_attention, merge, prefix_attention, split_attention, \
    suffix_attention, triton_available
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
    with pytest.raises(ValueError, match="unknown attention backend"):
        attend("flash", q, k, v, 10, mask[None])


def test_general_mask_falls_back_to_dense():
    """A [T, S] mask hiding part of the prefix: the split backends must give dense's answer."""
    q, k, v, _ = make_case(1, 4, 2, 4, 6, 16, seed=8)
    full = torch.ones(4, 10, dtype=torch.bool).tril(6)
    full[:, 2] = False  # a prefix token nobody sees
    want = attend("dense", q, k, v, 6, None, full)
    assert torch.equal(attend("split_torch", q, k, v, 6, None, full), want)
    assert (want.double() - dense64(q, k, v, 6, full[:, 6:])).abs().max() > 1e-3  # it does matter


# --------------------------------------------------------------------------- the model with each backend
@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


def _backends():
    return ["split_torch", pytest.param("split_triton", marks=needs_triton)]


def test_backend_attribute_and_errors(tiny):
    model, _ = tiny
    assert model.attention == "dense" and set(BACKENDS) == {"dense", "split_torch", "split_triton"}
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        model.set_attention("flash")
    with pytest.raises(ValueError, match="unknown attention backend"):
        model.attention = "sdpa"
    assert model.attention == "dense"
    try:
        model.attention = "split_torch"
        assert all(b.attn.backend == "split_torch" for b in model.blocks)
    finally:
        model.set_attention("dense")


def test_split_triton_needs_gpu_or_interpreter(tiny, monkeypatch):
    model, _ = tiny
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if torch.cuda.is_available():
        pytest.skip("with CUDA the kernels can run; the CPU-without-interpreter case is what this checks")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        model.set_attention("split_triton")
    assert model.attention == "dense"


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
        model.set_attention("dense")
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
            assert got == want[name], f"{backend} with {name} drafter differs from dense"
    finally:
        model.set_attention("dense")


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
        model.set_attention("dense")
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


CH06_WRONG = [
    ("6.1", dict(merge_partials=_merge_no_weights), "differs from the reference"),
    ("6.1", dict(merge_partials=_merge_naive_exp), "+1000"),
    ("6.2", dict(masked_attention_lse=_softmax_nan_rows), "contains nan"),
    ("6.3", dict(tiled_attention=_tiles_without_rescale), "in tiles of"),
    ("6.4", dict(split_tree_attention=_split_ignoring_tree), "differs from the reference"),
]


@pytest.mark.parametrize("ex_id, overrides, needle", CH06_WRONG, ids=[f"{w[0]}-{i}" for i, w in enumerate(CH06_WRONG)])
def test_ch06_checks_catch_wrong_answers(ex_id, overrides, needle):
    from minispec.grading import find_exercise

    ex = find_exercise(ex_id)
    passed, msg = ex.run(_ch06_with(**overrides))
    assert not passed
    assert msg.startswith(f"Exercise {ex_id} {ex.name}: ") and needle in msg, msg
