"""CUDA graphs (chapter 8): buckets and padding, the static KV cache, eager fallback == model, replay == eager."""

import pytest
import torch

from minispec import KVCache, generate, load
from minispec.cuda_graphs import GraphedForward, greedy_decode, pad_inputs, pick_bucket, static_forward
from minispec.kv import KVCacheOverflow, StaticKVCache

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
    for w, g in zip(want, got):  # row-invariant attention: over the whole capacity, padded or not, the same bits
        assert torch.equal(w, g)


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


@pytest.mark.gpu
@cuda
def test_capture_is_thread_local():
    """Capture in thread-local mode: another thread's synchronising CUDA calls (``.item()``, allocations) while the
    graphs are captured neither fail there nor break the capture; in global mode they raise "operation not
    permitted when stream is capturing". The switch interval is shortened so that the threads interleave."""
    import sys
    import threading

    from minispec.cuda_graphs import CAPTURE_MODE

    assert CAPTURE_MODE == "thread_local"
    model = load("tiny-llama")[0].cuda()
    errors, stop = [], threading.Event()

    def busy():
        try:
            while not stop.is_set():
                torch.ones(1 << 16, device="cuda").sum().item()  # an allocation and a device-to-host sync
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    other = threading.Thread(target=busy)
    other.start()
    try:
        kv = StaticKVCache.for_model(model, 64, batch_size=2)
        gf = GraphedForward(model, kv, batch_buckets=(2,), token_buckets=(1, 4, 8))
        x = torch.tensor([[1, 2, 3], [4, 5, 6]], device="cuda")
        got = gf(x).logits.clone()  # captures bucket (2, 4) while the other thread works
        kv.discard()
    finally:
        stop.set()
        other.join()
        sys.setswitchinterval(interval)
    assert not errors, errors
    assert gf.captures == 1
    kv2 = StaticKVCache.for_model(model, 64, batch_size=2)
    want = GraphedForward(model, kv2, batch_buckets=(2,), token_buckets=(1, 4, 8), enabled=False, pad=True)(x).logits
    assert torch.equal(got, want)


# --------------------------------------------------------------------------- the runner inside the decode loop
def _tiny_drafters(name):
    from minispec.drafters.draft_model import DraftModel

    draft = load(name)[0]
    return {"chain": DraftModel(draft, tree="chain:4"), "static tree": DraftModel(draft, tree="eagle"),
            "dynamic tree": DraftModel(draft, tree="4,3,8")}


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_generate_with_graphs_gives_vanilla_tokens(name):
    """generate(cuda_graphs=True): the target's verify forwards and the draft model's steps through
    GraphedForward (on the CPU: its direct-call path, padded to buckets, over static caches)."""
    model, tok = load(name)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = generate(model, tok, prompt, max_new_tokens=40, chat=False, stop_at_eos=False).tokens
    assert generate(model, tok, prompt, max_new_tokens=40, chat=False, stop_at_eos=False, cuda_graphs=True).tokens == want
    for label, drafter in _tiny_drafters(name).items():
        r = generate(model, tok, prompt, drafter=drafter, max_new_tokens=40, chat=False, stop_at_eos=False,
                     cuda_graphs=True)
        assert r.tokens == want, label
        assert drafter.runner is not None and drafter.runner.captures >= 1, label  # its steps went through the runner


def test_decoder_graph_bookkeeping():
    """One bucket per distinct padded step size, one replay per step, padding to the bucket."""
    from minispec.drafters.draft_model import DraftModel
    from minispec.generate import Decoder

    model, tok = load("tiny-llama")
    drafter = DraftModel(load("tiny-llama")[0], tree="4,3,8")  # up to 8 nodes: 9 rows, bucket 16
    dec = Decoder(model, [3, 1, 4, 1, 5, 9, 2, 6], drafter, max_new_tokens=30, graphs=True)
    assert dec.drafter_graphs and dec.runner.pad and dec.runner.batch_buckets == (1,)
    dec.prefill()
    while not dec.done:
        dec.step()
    steps = len(dec.stats.nodes)
    used = {dec.runner.bucket(1, n + 1) for n in dec.stats.nodes}
    assert set(dec.runner.graphs) == used and dec.runner.captures == len(used)
    assert sum(dec.runner.replays.values()) == steps
    assert all(b[1] >= n + 1 for b, n in zip((dec.runner.bucket(1, n + 1) for n in dec.stats.nodes), dec.stats.nodes))
    assert any(dec.runner.bucket(1, n + 1)[1] > n + 1 for n in dec.stats.nodes)  # some step was padded


def test_graphs_refuse_a_paged_cache():
    from minispec.generate import Decoder

    model, _ = load("tiny-llama")
    with pytest.raises(ValueError, match="static KV cache"):
        Decoder(model, [1, 2, 3], kv_block_size=4, graphs=True)


def test_graphs_recapture_after_the_cache_grows():
    model, _ = load("tiny-llama")
    kv = StaticKVCache.for_model(model, 16)
    gf = GraphedForward(model, kv, batch_buckets=(1,), token_buckets=(1, 4), pad=True)
    x = torch.tensor([[7, 8, 9]])
    first = gf(x).logits.clone()
    kv.discard()
    kv.reserve(40)  # new buffers: the captured graph read the old ones
    assert kv.generation == 1 and kv.capacity == 40
    again = gf(x).logits
    assert gf.captures == 2 and torch.equal(again, first)


def test_static_cache_speaks_the_kv_cache_protocol():
    """What the decode loop and a draft model call on any cache: length, flat commit, rollback, reset."""
    model, _ = load("tiny-llama")
    kv = StaticKVCache.for_model(model, 32)
    gf = GraphedForward(model, kv, batch_buckets=(1,), token_buckets=(8,), pad=True)
    gf(torch.tensor([[1, 2, 3, 4, 5]]))
    kv.commit([0, 2, 4])  # one row: a flat list, as KVCache.commit takes
    assert kv.length == 3 and kv.lengths.tolist() == [3]
    kv.rollback(2)
    assert kv.length == 1
    with pytest.raises(ValueError):
        kv.rollback(2)
    kv.reset()
    assert kv.length == 0
    with pytest.raises(ValueError, match="slot_mask"):
        gf(torch.tensor([[1]]), slot_mask=torch.ones(1, 1, 32, dtype=torch.bool))


# every method ``generate(..., cuda_graphs=True)`` takes: the target's verify forwards graphed for all; the draft
# model's steps (sps) and the EAGLE heads' whole drafts (eagle: a chain, eagle2: a dynamic tree, eagle3, copy's
# fallback) graphed too; pld's and copy's lookups and Medusa's heads draft on the host
GRAPHED_DRAFTS = ("eagle", "eagle2", "eagle3", "copy")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["vanilla", "pld", "sps", "eagle", "eagle2", "eagle3", "copy", "medusa"])
def test_smollm2_with_graphs_gives_vanilla_tokens(smollm2, smollm2_vanilla, method):
    """Two prompts x 24 tokens on SmolLM2: every method with graphs on (on the CPU: the runners' direct calls)
    gives vanilla's greedy tokens (``smollm2_vanilla``, decoded without any runner), bit for bit."""
    from minispec.methods import Methods

    model, tok = smollm2
    drafter = Methods(model).drafter(method)
    forwards = tokens = 0
    for prompt, want in list(smollm2_vanilla.items())[:2]:
        r = generate(model, tok, prompt, drafter=drafter, max_new_tokens=24, cuda_graphs=True)
        assert r.tokens == want[:24], prompt
        forwards, tokens = forwards + r.stats.target_forwards, tokens + r.stats.new_tokens
    if method in GRAPHED_DRAFTS:  # the head drafted through its graph runner, and drafts were accepted
        graph = (drafter.fallback if method == "copy" else drafter).graph
        assert graph.captures >= 1 and sum(graph.replays.values()) >= 8
        assert tokens / forwards > 1.1


@pytest.mark.gpu
@cuda
def test_generate_with_graphs_on_cuda_gives_vanilla_tokens():
    """On a GPU the runner captures real graphs: the decode loop's tokens must still be vanilla's."""
    from minispec.drafters.draft_model import DraftModel

    model, tok = load("tiny-llama")
    model = model.cuda()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = generate(model, tok, prompt, max_new_tokens=40, chat=False, stop_at_eos=False).tokens
    for tree in (None, "chain:4", "4,3,8"):
        drafter = None if tree is None else DraftModel(load("tiny-llama")[0].cuda(), tree=tree)
        r = generate(model, tok, prompt, drafter=drafter, max_new_tokens=40, chat=False, stop_at_eos=False,
                     cuda_graphs=True)
        assert r.tokens == want, tree


# --------------------------------------------------------------------------- the split kernel inside the graph runner
def _split_table():
    from minispec.attention.table import BackendTable

    return BackendTable("test: split everywhere", {(1, 1, 1): "split"}, source="forced")


def _needs_triton():
    from minispec.attention import triton_available

    if not triton_available("cpu"):
        pytest.skip("Triton interpreter is off (TRITON_INTERPRET=1 must precede importing triton)")


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])  # 4 heads each; tiny-llama's over 2 KV heads (GQA)
def test_split_buckets_decode_the_dense_greedy_tokens(name):
    """A table that picks the split for every bucket: the runner's direct call attends through the Triton kernel
    (in the interpreter) with the cache's device lengths and the bucket's tree mask; a prompt, a padded 5-token
    tree with a compacting commit and a decode step give dense's logits (to float32 rounding: the kernel sums in
    another order) and its greedy tokens, and vanilla greedy decoding gives dense's tokens."""
    _needs_triton()
    model, _ = load(name)
    B, split = 2, _split_table()
    want, got = [], []
    for table, out in ((None, want), (split, got)):
        kv = StaticKVCache.for_model(model, 32, batch_size=B)
        gf = GraphedForward(model, kv, batch_buckets=(1, 2), token_buckets=(1, 8, 16), pad=True, table=table)
        out += _steps(model, lambda t, p, m: gf(t, p, m), lambda keep: kv.commit(None if keep is None else [keep] * B), B)
        assert set(gf.backends.values()) == {"split" if table else "dense"} and len(gf.backends) == 3
    for w, g in zip(want, got):
        assert (w - g).abs().max() < 1e-4 and torch.equal(w.argmax(-1), g.argmax(-1))
    prompts = torch.randint(0, model.cfg.vocab_size, (B, 7), generator=torch.Generator().manual_seed(1))
    assert torch.equal(greedy_decode(model, prompts, 6, pad=True, table=split), greedy_decode(model, prompts, 6, pad=True))


def test_a_split_bucket_reuses_its_workspace_and_never_syncs_with_the_host():
    """The split bucket's SplitWorkspace and output buffer are allocated by its first call and the same tensors
    (same addresses) at every later call, whatever the lengths; its body (what a graph captures) reads no
    device value on the host and keeps its shapes from one step to the next."""
    from minispec.lab.graph_rules import find_hazards

    _needs_triton()
    model, _ = load("tiny-llama")
    kv = StaticKVCache.for_model(model, 32, batch_size=2)
    gf = GraphedForward(model, kv, batch_buckets=(2,), token_buckets=(4,), pad=True, table=_split_table())

    def buffers(ws):
        return {key: [t.data_ptr() for t in ts] for key, ts in ws._parts.items()}, \
            {key: t.data_ptr() for key, t in ws._outs.items()}

    gf(torch.tensor([[1, 2, 3], [4, 5, 6]]))
    kv.commit()
    replay, _ = gf.graphs[(2, 4)]
    assert gf.backends == {(2, 4): "split"} and set(gf.workspaces) == {(2, 4)}
    ws = gf.workspaces[(2, 4)]
    first, held = buffers(ws), ws.nbytes
    assert first[0] and first[1]  # the partials (two splits under the interpreter) and the output buffer
    for n in (1, 4, 2):
        gf(torch.arange(n * 2).view(2, n))
        kv.commit([list(range(n)), list(range(n - 1))] if n > 1 else None)
        assert buffers(ws) == first and ws.nbytes == held
    kv.begin(2, 4)
    with torch.inference_mode():
        assert find_hazards(replay, ((), {}), ((), {})) == []
    kv.discard()
