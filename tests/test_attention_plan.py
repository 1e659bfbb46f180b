"""One attention for the target and the heads (issue 26 items 5, 6): the attention plan built before
the forward, the KV-cache protocol the three caches implement, and the EAGLE heads on the target's
``Attention`` / ``MLP`` under the official checkpoint names."""

import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minispec import load
from minispec.attention.plan import ROW_CALL_SCORES, Plan, RaggedPlan, prepare, prepare_ragged
from minispec.cuda_graphs import static_forward
from minispec.drafters.eagle import EagleConfig, EagleHead
from minispec.drafters.eagle3 import Eagle3Config, Eagle3Head
from minispec.kv import KVCache, KVCacheProtocol, PagedKVCache, RaggedKVCache, StaticKVCache
from minispec.model import Attention, MLP

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")[0]


def test_the_three_caches_implement_the_protocol(tiny):
    caches = [KVCache.for_model(tiny, 16), PagedKVCache.for_model(tiny, 16, batch_size=2),
              StaticKVCache.for_model(tiny, 16)]
    assert all(isinstance(c, KVCacheProtocol) for c in caches)
    assert [isinstance(c, RaggedKVCache) for c in caches] == [False, True, False]  # only the paged one stores rows
    assert not isinstance(object(), KVCacheProtocol)


def test_model_imports_no_cache_class():
    """model.py reaches caches only through the protocol: no import of kv.contiguous / kv.paged / cuda_graphs."""
    tree = ast.parse((ROOT / "minispec" / "model.py").read_text())
    imported = {(n.module or "") + ":" + a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert "kv.protocol:KVCacheProtocol" in imported
    assert not [i for i in imported if i.split(":")[1] in ("KVCache", "PagedKVCache", "StaticKVCache")
                or i.startswith(("kv:", "kv.contiguous", "kv.paged", "cuda_graphs"))]


def test_a_given_plan_equals_the_default_and_reserves_the_slots(tiny):
    x = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.inference_mode():
        kv = KVCache.for_model(tiny, 16)
        plan = prepare(1, 5, x.device, kv, backend=tiny.attention, context=tiny.cfg.max_seq_len)
        assert isinstance(plan, Plan) and kv.pending == 5  # begin ran when the plan was built
        a = tiny(x, kv=kv, plan=plan).logits
        kv.discard()
        b = tiny(x, kv=kv).logits
        assert torch.equal(a, b)
        kv.discard()
        with pytest.raises(ValueError, match="not beside it"):
            tiny(x, positions=torch.arange(5), plan=plan)
        with pytest.raises(ValueError, match="beyond the model's context"):
            prepare(1, 1, x.device, kv, positions=torch.tensor([tiny.cfg.max_seq_len]), context=tiny.cfg.max_seq_len)
        assert kv.pending == 0  # a refused plan reserves nothing


def test_a_failing_forward_discards_its_pending_entries(tiny):
    kv = KVCache.for_model(tiny, 16)
    with torch.inference_mode(), pytest.raises(IndexError):
        tiny(torch.tensor([[tiny.cfg.vocab_size]]), kv=kv)  # an id past the embedding
    assert kv.pending == 0 and kv.length == 0


def test_static_forward_is_the_model_forward_on_a_static_plan(tiny):
    x = torch.tensor([[2, 7, 1, 8]])
    with torch.inference_mode():
        eager = tiny(x, kv=KVCache.for_model(tiny, 16)).logits
        skv = StaticKVCache.for_model(tiny, 16)
        skv.begin(1, 4)
        with pytest.raises(RuntimeError, match="pending"):
            skv.begin(1, 4)
        causal = torch.ones(4, 4, dtype=torch.bool).tril()[None]
        out = static_forward(tiny, skv, x, torch.arange(4)[None], causal)
    assert torch.equal(out.logits, eager)  # row-invariant attention: bits equal over the whole capacity


def _llama_layer_reference(x, rope_pos, weights, nh, nkv, hd, theta):
    """A Llama attention + SwiGLU written from the official q/k/v/o, gate/up/down weights with SDPA."""
    from minispec.model import apply_rope, rope_cos_sin

    B, T, _ = x.shape
    cos, sin = rope_cos_sin(rope_pos, hd, theta)
    q = apply_rope((x @ weights["q_proj"].T).view(B, T, nh, hd).transpose(1, 2), cos, sin)
    k = apply_rope((x @ weights["k_proj"].T).view(B, T, nkv, hd).transpose(1, 2), cos, sin)
    v = (x @ weights["v_proj"].T).view(B, T, nkv, hd).transpose(1, 2)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    attn = a.transpose(1, 2).reshape(B, T, nh * hd) @ weights["o_proj"].T

    def mlp(h):
        return (F.silu(h @ weights["gate_proj"].T) * (h @ weights["up_proj"].T)) @ weights["down_proj"].T
    return attn, mlp


def test_eagle_head_runs_the_official_weights_through_the_target_modules(tiny):
    c = EagleConfig.for_target(tiny.cfg)
    torch.manual_seed(0)
    head = EagleHead(c)
    lay = head.layers[0]
    assert isinstance(lay.self_attn, Attention) and isinstance(lay.mlp, MLP)
    sd = head.state_dict()
    w = {k.split(".")[-2]: v for k, v in sd.items() if k.startswith("layers.0.") and "_proj" in k}
    assert sorted(w) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    T, H = 6, c.hidden_size
    emb, feat = torch.randn(1, T, H), torch.randn(1, T, H)
    with torch.no_grad():
        got = head(emb, feat, torch.arange(T))
        x = head.fc(torch.cat([emb, feat], -1))
        attn, mlp = _llama_layer_reference(x, torch.arange(T)[None], w, c.num_attention_heads, c.num_key_value_heads,
                                           c.head_dim, c.rope_theta)
        x = x + attn
        want = x + mlp(lay.post_attention_layernorm(x))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # the official names load back into the fused modules, bit for bit
    other = EagleHead(c)
    other.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(other.parameters(), head.parameters()))
    with pytest.raises(RuntimeError, match="v_proj"):
        other.load_state_dict({k: v for k, v in sd.items() if "v_proj" not in k})


def test_eagle3_head_attends_with_gqa_and_trains(tiny):
    c = Eagle3Config.for_target(tiny, draft_vocab_size=16)
    torch.manual_seed(0)
    head = Eagle3Head(c)
    assert head.midlayer.self_attn.wqkv.in_features == 2 * c.hidden_size
    keys = [k for k in head.state_dict() if k.startswith("midlayer.")]
    assert "midlayer.self_attn.q_proj.weight" in keys and "midlayer.mlp.gate_proj.weight" in keys
    assert not [k for k in keys if "wqkv" in k or "gate_up" in k]
    T, H = 5, c.hidden_size
    emb, h = torch.randn(1, T, H), torch.randn(1, T, 3 * H)
    with torch.no_grad():
        got = head(emb, h, torch.arange(T)[None], KVCache(1, c.num_key_value_heads, c.head_dim, 16))
        hh = head.fc(h)
        q, k, v = head.attn_input(emb, hh, torch.arange(T)[None])
        G = c.num_attention_heads // c.num_key_value_heads
        ref = F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), is_causal=True)
        want = head.finish(hh, ref)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    loss = head(emb, h, torch.arange(T)[None], KVCache(1, c.num_key_value_heads, c.head_dim, 16)).square().mean()
    loss.backward()  # autograd through the shared modules and the attention
    assert head.midlayer.self_attn.wqkv.weight.grad.abs().sum() > 0


def test_ragged_plan_needs_a_paged_cache_and_rows_that_fit(tiny):
    kv = PagedKVCache.for_model(tiny, 16, batch_size=2, block_size=4)
    plan = prepare_ragged(2, 3, "cpu", kv, {1: 3, 0: 1})
    assert isinstance(plan, RaggedPlan) and [r.seq for r in plan.rows] == [1, 0] and kv.pendings == [1, 3]
    assert plan.last(torch.arange(6.).view(2, 3, 1)).flatten().tolist() == [2.0, 3.0]  # row r's n_r-th token
    kv.discard()
    with pytest.raises(ValueError, match="one mask"):
        prepare_ragged(2, 3, "cpu", kv, {0: 1, 1: 1}, masks=[None])
    assert kv.pending == 0


def _ragged_forward(tiny, one_call: bool, masks, ns, prompts):
    """A paged cache with ``prompts`` tokens committed per sequence, then one ragged forward of ``ns`` new tokens
    (row by row or in one attention call): the logits [R, T, V]."""
    g = torch.Generator().manual_seed(1)
    kv = PagedKVCache.for_model(tiny, 160, batch_size=len(prompts), block_size=4)
    for b, n in enumerate(prompts):  # each sequence prefilled alone
        plan = prepare_ragged(1, n, "cpu", kv, {b: n}, backend=tiny.attention)
        tiny(torch.randint(0, tiny.cfg.vocab_size, (1, n), generator=g), kv=kv, plan=plan)
        kv.commit()
    T = max(ns)
    tokens = torch.randint(0, tiny.cfg.vocab_size, (len(ns), T), generator=g)
    plan = prepare_ragged(len(ns), T, "cpu", kv, dict(enumerate(ns)), masks=masks, backend=tiny.attention)
    assert plan.mask is not None  # these rows are close enough in length for one call
    if not one_call:
        plan.mask = None  # row by row
    logits = tiny(tokens, kv=kv, plan=plan).logits  # [R, T, V]
    return [logits[r, :n] for r, n in enumerate(ns)]


def test_a_ragged_batch_attends_in_one_call_with_the_bits_of_row_by_row(tiny):
    """Rows of different prefixes (some past one key block of the CPU attention's 128 keys), one new token, a causal
    run, a draft tree and padding: one attention call over ``read_rows`` gives every row the bits the row-by-row
    reads give (hidden keys add exact zeros)."""
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a root and two children
    prompts, ns, masks = [120, 131, 100, 126], [1, 3, 3, 2], [None, tree, None, None]
    with torch.inference_mode():
        batched = _ragged_forward(tiny, True, masks, ns, prompts)
        rows = _ragged_forward(tiny, False, masks, ns, prompts)
    for a, b in zip(batched, rows):
        assert torch.equal(a, b)


def test_a_prefill_of_very_different_lengths_attends_row_by_row_and_a_ragged_decode_step_in_one_call(tiny):
    kv = PagedKVCache.for_model(tiny, 64, batch_size=3, block_size=4)
    # 3 x 60 x 60 scores padded, for 60 x 60 + 2 x 4 of the rows' own: more than the 3 calls' ROW_CALL_SCORES save
    assert 3 * 60 * 60 > 2 * (60 * 60 + 2 * 4) + 3 * ROW_CALL_SCORES
    assert prepare_ragged(3, 60, "cpu", kv, {0: 60, 1: 2, 2: 2}).mask is None
    kv.discard()
    assert prepare_ragged(2, 40, "cpu", kv, {0: 40, 2: 30}).mask is not None
    kv.discard()
    assert prepare_ragged(2, 4, "cpu", kv, {0: 4, 1: 3}, backend="split_torch").mask is None
    kv.discard()
    prepare_ragged(3, 40, "cpu", kv, {0: 40, 1: 2, 2: 2}, backend="split_torch")
    kv.commit()  # prefixes of 40, 2 and 2 keys
    # a decode step: 3 x 41 scores padded against 41 + 3 + 3 of the rows' own, more than twice as many,
    # but far cheaper than two more attention calls in every layer
    assert 3 * 41 > 2 * (41 + 3 + 3) and 3 * 41 <= 2 * (41 + 3 + 3) + 3 * ROW_CALL_SCORES
    assert prepare_ragged(3, 1, "cpu", kv, {0: 1, 1: 1, 2: 1}).mask is not None


def test_a_plan_works_its_mask_out_once_for_every_layer_with_the_same_bits(tiny, monkeypatch):
    """A verify over a prefix past one key block, on the exact backend: the hidden keys and key blocks of the
    plan's mask are worked out once (``masked_keys``, kept in ``plan.memo``), not in each of the layers, and the
    logits equal those of each layer working the raw mask out itself; a mask that does not fit the keys is still
    refused with its shape."""
    import minispec.exact.attention as exact_attention

    calls = []
    real = exact_attention.masked_keys

    def counted(mask):
        calls.append(mask)
        return real(mask)

    monkeypatch.setattr(exact_attention, "masked_keys", counted)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    x = torch.tensor([[7, 8, 9, 10]])
    assert tiny.attention == "exact"
    with torch.inference_mode():
        kv = KVCache.for_model(tiny, 200)
        tiny(torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(0)), kv=kv)
        kv.commit()
        calls.clear()
        once = tiny(x, kv=kv, mask=tree).logits
        kv.discard()
        assert len(calls) == 1 and tiny.cfg.n_layer > 1
        monkeypatch.setattr(exact_attention, "keys_of", lambda plan: real(plan.mask))  # every layer its own
        each = tiny(x, kv=kv, mask=tree).logits
        kv.discard()
    assert torch.equal(once, each)
    q, k = torch.zeros(1, 4, 4, 16), torch.zeros(1, 2, 150, 16)
    with pytest.raises(ValueError, match=r"mask must be boolean \[4, 150\]"):
        exact_attention.invariant_attention(q, k, k, real(torch.ones(4, 154, dtype=torch.bool)))
    with pytest.raises(ValueError, match="mask must be boolean"):
        real(torch.ones(4, 150))
