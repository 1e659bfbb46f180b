"""CUDA graphs (chapter 8): buckets and padding, the static KV cache, eager fallback == model, replay == eager."""

import pytest
import torch

from minispec import KVCache, generate, load
from minispec.cuda_graphs import GraphedForward, StaticKVCache, greedy_decode, pad_inputs, pick_bucket, static_forward
from minispec.kv import KVCacheOverflow

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TREE = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 0, 1, 1, 0], [1, 1, 0, 0, 1]], dtype=torch.bool)
TREE_POS = torch.tensor([0, 1, 1, 2, 2])  # depths of the five tree tokens (root first)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-gpt2"])
def tiny(request):
    return load(request.param)


def test_pick_bucket():
    assert pick_bucket(1, (1, 2, 4)) == 1
    assert pick_bucket(3, (4, 1, 2)) == 4
    assert pick_bucket(4, (1, 2, 4)) == 4
    with pytest.raises(ValueError):
        pick_bucket(5, (1, 2, 4))


def test_pad_inputs():
    tokens, pos = torch.tensor([[5, 6, 7]]), torch.tensor([[10, 11, 11]])
    mask = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)
    t, p, m = pad_inputs(tokens, pos, mask, 2, 4)
    assert t.tolist() == [[5, 6, 7, 0], [0, 0, 0, 0]] and p.tolist() == [[10, 11, 11, 0], [0] * 4]
    assert m.shape == (2, 4, 4)
    assert torch.equal(m[0, :3, :3], mask[0])
    assert not m[0, :3, 3].any()  # real tokens never see a padded one
    assert torch.equal(m[0, 3], torch.tensor([False, False, False, True]))  # a padded row sees itself only
    assert torch.equal(m[1], torch.eye(4, dtype=torch.bool))
    with pytest.raises(ValueError):
        pad_inputs(tokens, pos, mask, 1, 2)


def test_graphed_forward_buckets_fit_the_cache(tiny):
    model, _ = tiny
    gf = GraphedForward(model, StaticKVCache.for_model(model, 32, batch_size=3))
    assert gf.batch_buckets == (1, 2, 3)  # padded rows must exist in the cache
    assert gf.bucket(3, 5) == (3, 8)
    assert not gf.use_graphs  # CPU: eager fallback


def _steps(model, forward, commit, B):
    """Prefill 9 tokens, verify a 5-token tree, keep a path per row, decode one token: the logits of each."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.cfg.vocab_size, (B, 9), generator=g)
    tree_tokens = torch.randint(0, model.cfg.vocab_size, (B, 5), generator=g)
    nxt = torch.randint(0, model.cfg.vocab_size, (B, 1), generator=g)
    out = [forward(prompt, None, None).logits.clone()]
    commit(None)
    out.append(forward(tree_tokens, (TREE_POS + 9).expand(B, 5), TREE).logits.clone())
    commit([0, 2, 3])  # root, node 1, node 2: a path whose entries move (compaction)
    out.append(forward(nxt, None, None).logits.clone())
    commit(None)
    return out


@pytest.mark.parametrize("pad", [False, True])
def test_eager_fallback_equals_model(tiny, pad):
    model, _ = tiny
    B = 3
    kv = KVCache.for_model(model, 32, batch_size=B)

    def model_forward(tokens, pos, mask):
        with torch.no_grad():
            return model(tokens, positions=pos, mask=mask, kv=kv)

    want = _steps(model, model_forward, lambda keep: kv.commit(keep), B)
    skv = StaticKVCache.for_model(model, 32, batch_size=4)  # room for a padded fourth row
    gf = GraphedForward(model, skv, batch_buckets=(1, 2, 4), token_buckets=(1, 4, 8, 16), pad=pad)
    got = _steps(model, lambda t, p, m: gf(t, p, m), lambda keep: skv.commit(None if keep is None else [keep] * B), B)
    assert skv.host_lengths[:B] == [13] * B and skv.lengths[:B].tolist() == [13] * B
    for w, g in zip(want, got):
        assert w.shape == g.shape
        assert (w - g).abs().max() < 1e-5  # the same math; SDPA over the whole capacity sums in another order
        assert torch.equal(w.argmax(-1), g.argmax(-1))


def test_greedy_decode_eager_equals_generate(tiny):
    model, tok = tiny
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = generate(model, tok, prompt, max_new_tokens=24, chat=False, stop_at_eos=False).tokens
    for pad in (False, True):
        assert greedy_decode(model, torch.tensor([prompt]), 24, pad=pad)[0].tolist() == want


def test_static_cache_checks(tiny):
    model, _ = tiny
    kv = StaticKVCache.for_model(model, 12, batch_size=2)
    gf = GraphedForward(model, kv, token_buckets=(1, 8, 16), pad=True)
    gf(torch.zeros(2, 8, dtype=torch.long))
    with pytest.raises(RuntimeError, match="pending"):
        gf(torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError):
        kv.commit([[0, 0]] * 2)  # not strictly increasing
    kv.commit()
    with pytest.raises(KVCacheOverflow):  # 8 cached + 3 tokens padded to 8 > 12
        gf(torch.zeros(2, 3, dtype=torch.long))
    kv.set_lengths([0, 0])
    assert kv.lengths.tolist() == [0, 0]


def test_static_forward_sees_only_committed_and_tree():
    """Stale keys past a row's length must not leak in: fill them with garbage, the logits must not move."""
    model, _ = load("tiny-llama")
    kv = StaticKVCache.for_model(model, 24, batch_size=1)
    tokens, pos = torch.tensor([[1, 2, 3]]), torch.tensor([[0, 1, 2]])
    causal = torch.ones(3, 3, dtype=torch.bool).tril()[None]
    with torch.no_grad():
        clean = static_forward(model, kv, tokens, pos, causal).logits.clone()
        kv.k[:, :, :, 3:].normal_()
        kv.v[:, :, :, 3:].normal_()
        assert torch.equal(static_forward(model, kv, tokens, pos, causal).logits, clean)


# --------------------------------------------------------------------------- GPU: replay == eager
@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_equals_eager_padded(dtype):
    """The graph replays exactly the kernels eager padded execution runs: bitwise equal logits."""
    model = load("tiny-llama")[0].to("cuda", dtype)
    B = 3
    outs = {}
    for enabled in (True, False):
        kv = StaticKVCache.for_model(model, 64, batch_size=4)
        gf = GraphedForward(model, kv, batch_buckets=(1, 2, 4), token_buckets=(1, 4, 8, 16), enabled=enabled, pad=True)
        assert gf.use_graphs == enabled
        outs[enabled] = _gpu_steps(model, gf, kv, B)
        if enabled:
            assert set(gf.graphs) == {(4, 16), (4, 8), (4, 1)}
    for a, b in zip(outs[True], outs[False]):
        assert torch.equal(a, b)


def _gpu_steps(model, gf, kv, B):
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (B, 9), generator=g).cuda()
    tree = torch.randint(0, 256, (B, 5), generator=g).cuda()
    out = [gf(prompt).logits.clone()]  # 9 tokens: bucket 16
    kv.commit()
    out.append(gf(tree, (TREE_POS.cuda() + 9).expand(B, 5), TREE.cuda()).logits.clone())  # bucket 8
    kv.commit([[0, 2, 3]] * B)
    for _ in range(3):  # bucket 1, replayed
        out.append(gf(out[-1][:, -1:].argmax(-1)).logits.clone())
        kv.commit()
    return out


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_graph_greedy_tokens_equal_eager_and_generate(name):
    model, tok = load(name)
    model = model.cuda()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = generate(model, tok, prompt, max_new_tokens=32, chat=False, stop_at_eos=False).tokens
    graphed = greedy_decode(model, torch.tensor([prompt], device="cuda"), 32, enabled=True)[0].tolist()
    eager = greedy_decode(model, torch.tensor([prompt], device="cuda"), 32, enabled=False)[0].tolist()
    assert graphed == eager == want


@pytest.mark.gpu
@cuda
def test_replay_does_not_synchronise():
    model = load("tiny-llama")[0].cuda()
    kv = StaticKVCache.for_model(model, 64, batch_size=2)
    gf = GraphedForward(model, kv)
    x = torch.tensor([[1], [2]], device="cuda")
    gf(x)  # capture
    kv.commit()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            x = gf(x).logits[:, -1:].argmax(-1)
            kv.commit()
    finally:
        torch.cuda.set_sync_debug_mode("default")
