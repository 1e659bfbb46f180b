"""EAGLE-1/2 feature-level drafting (chapter 3): the head, its drafter, checkpoints, and the shipped head."""

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import N_REF
from lawcheck import assert_same_law, exact_law, sample_law

from minispec import generate, load
from minispec.drafters.base import Features
from minispec.drafters.eagle import EagleConfig, EagleDrafter, EagleHead, load_eagle
from minispec.drafters.tree_drafter import TreeSpec
from minispec.sampling import GREEDY

pytestmark = pytest.mark.ch03

PROMPTS = ["Hello world, hello world, hello", "abcabcabcabc", "def f(x):\n    return x", "1, 2, 3, 4, 5, 6"]
TREES = ["chain:4", "eagle", "4,3,10"]
OFFICIAL_KEYS = ["fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
                 "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
                 "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
                 "layers.0.post_attention_layernorm.weight"]


@pytest.fixture(scope="module")
def target():
    return load("tiny-llama")


@pytest.fixture(scope="module")
def head(target):
    """A head briefly trained on the tiny target's own greedy text, so drafts are often (not always) accepted."""
    model, tok = target
    torch.manual_seed(0)
    seqs = []
    with torch.no_grad():
        for p in PROMPTS + ["xyz", "The cat", "0101", "zzz top"]:
            r = generate(model, tok, p, max_new_tokens=48, chat=False)
            seqs.append(torch.tensor(r.prompt_tokens + r.tokens))
        for seed in range(8):  # sampled text too, for the sampled-law test
            r = generate(model, tok, "aaaa", max_new_tokens=24, chat=False, temperature=0.7, top_k=3, seed=seed)
            seqs.append(torch.tensor(r.prompt_tokens + r.tokens))
    h = EagleHead(EagleConfig.for_target(model.cfg))
    opt = torch.optim.Adam(h.parameters(), lr=3e-3)
    for step in range(200):
        s = seqs[step % len(seqs)]
        with torch.no_grad():
            f = model(s[None]).hidden  # [1, T, D]
            emb = model.tok_emb(s[None, 1:])
        g = h(emb, f[:, :-1], torch.arange(len(s) - 1))  # [1, T-1, D] predicted f_1..f_{T-1}
        loss = F.smooth_l1_loss(g, f[:, 1:]) + 0.1 * F.cross_entropy(model.lm_head(g)[0], model.lm_head(f[0, 1:]).argmax(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return h.eval()


@pytest.fixture(scope="module")
def head2(target, head):
    """A 2-layer head: the trained head's fc and layer 0, then a random pre-norm layer 1 whose output
    projections are scaled down, so that it changes the predictions but drafts stay often right."""
    model, _ = target
    h = EagleHead(EagleConfig.for_target(model.cfg, num_hidden_layers=2))
    missing, unexpected = h.load_state_dict(head.state_dict(), strict=False)
    assert not unexpected and missing and all(k.startswith("layers.1.") for k in missing)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in h.layers[1].named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                scale = 0.02 if name.startswith(("self_attn.wo", "mlp.down")) else 0.1
                p.copy_(scale * torch.randn(p.shape, generator=g))
    return h.eval()


@pytest.fixture(params=[1, 2], ids=["1layer", "2layers"])
def heads(request):
    """The trained 1-layer head, and the 2-layer head built on it."""
    return request.getfixturevalue("head" if request.param == 1 else "head2")


def head_reference(model, head, ctx, path):
    """Logits of the last node of ``path`` by full recomputation: no KV cache, no tree mask. The committed
    pairs (x_{j+1}, f_j) use the target's features; each draft pair (y_d, g_{d-1}) the head's own prediction."""
    with torch.no_grad():
        f = model(torch.tensor([ctx])).hidden[0, :-1]  # [n-1, D] f_0..f_{n-2}
        toks, feats = list(ctx[1:]), list(f)
        g = head(model.tok_emb(torch.tensor([toks])), torch.stack(feats)[None], torch.arange(len(toks)))[0, -1]
        for y in path:
            toks.append(y)
            feats.append(g)
            g = head(model.tok_emb(torch.tensor([toks])), torch.stack(feats)[None], torch.arange(len(toks)))[0, -1]
        return model.lm_head(g)


@pytest.mark.parametrize("tree", TREES)
def test_tree_node_logits_equal_full_recomputation(target, heads, tree):
    """Level-by-level drafting with the head's KV cache (one layer of it per decoder layer) and tree mask
    gives every node the logits of a full recomputation of the head over its own path."""
    model, tok = target
    head = heads
    ctx = tok.encode("The tree mask at work")
    d = EagleDrafter(model, head, tree=tree)
    with torch.no_grad():
        d.prefill(ctx, Features(model(torch.tensor([ctx])).hidden[0, :-1]))  # every committed token's but the root's
    seen, orig_start, orig_extend = {}, d._start, d._extend

    def start():
        seen[()] = orig_start()
        return seen[()]

    def extend(tokens, parents):
        out = orig_extend(tokens, parents)
        for j, (t, p) in enumerate(zip(tokens, parents)):
            extend.paths.append((extend.paths[p] if p >= 0 else ()) + (t,))
            seen[extend.paths[-1]] = out[j]
        return out
    extend.paths = []
    d._start, d._extend = start, extend
    t = d.propose(GREEDY, budget=10)
    assert len(t) == TreeSpec.parse(tree).max_nodes and len(seen) > 2
    for path, logits in seen.items():
        torch.testing.assert_close(logits, head_reference(model, head, ctx, path), atol=1e-4, rtol=1e-4)
    assert d.kv.length == len(ctx) - 1  # only the committed pairs stay in the head's cache


@pytest.mark.parametrize("tree", ["chain:5", "eagle", "4,3,10"])
def test_greedy_eagle_decoding_equals_vanilla(target, heads, tree):
    model, tok = target
    head = heads
    accepted = 0
    for prompt in PROMPTS:
        vanilla = generate(model, tok, prompt, max_new_tokens=60)
        spec = generate(model, tok, prompt, drafter=EagleDrafter(model, head, tree=tree), max_new_tokens=60)
        assert spec.tokens == vanilla.tokens
        accepted += sum(spec.stats.accepted_at_depth)
        assert spec.stats.tau < 6  # not every draft is right: rejections are exercised too
    assert accepted > 20  # the trained head is often right: acceptances are exercised


@pytest.mark.parametrize("tree", [TreeSpec.chain(2), TreeSpec.parse("2,2,3")], ids=["chain-real-q", "tree-onehot"])
def test_sampled_eagle_decoding_has_the_target_law(target, head, tree):
    """The joint law of the first three new tokens (temperature 0.7, top-k 3: 27 outcomes) matches the
    target's exactly computed law, for a sampled chain (real q) and a dynamic tree (one-hot q)."""
    model, tok = target
    params = dict(temperature=0.7, top_k=3)
    ids = tok.encode("aaaa")
    exact = exact_law(model, ids, params)
    law = sample_law(model, tok, ids, lambda: EagleDrafter(model, head, tree=tree), exact, 1000, params)
    assert law.accepted > law.n / 10  # drafts were accepted, so the verification rule mattered
    assert_same_law(law, exact)


def test_a_head_for_another_target_is_refused(target):
    model, tok = target
    c = EagleConfig.for_target(model.cfg)
    for bad in (dict(hidden_size=32, head_dim=8), dict(vocab_size=1000)):
        head = EagleHead(EagleConfig(**{**c.__dict__, **bad}))
        with pytest.raises(ValueError, match=r"EAGLE head \(hidden_size \d+, vocab_size \d+\) does not fit .*hidden size 64, vocab 256"):
            EagleDrafter(model, head)
    d = EagleDrafter(model, EagleHead(c))
    with pytest.raises(ValueError, match="does not fit"):
        generate(load("tiny-gpt2-draft")[0], tok, "hi", drafter=d, max_new_tokens=4)  # a target of width 32


def test_a_head_without_its_config_is_refused_by_name(target, tmp_path):
    """A head's .safetensors copied without its .json: the error names the missing config, not a vocabulary of -1."""
    from minispec.train.eagle import FORMAT, save_head

    model, _ = target
    c = EagleConfig.for_target(model.cfg)
    out = tmp_path / "head.safetensors"
    save_head(EagleHead(c), out, dict(format=FORMAT, config=c.to_dict()))
    load_eagle(out, model)  # with its config beside it
    out.with_suffix(".json").unlink()
    with pytest.raises(ValueError, match=r"head.safetensors: no EAGLE-1/2 head config .* head.json"):
        load_eagle(out, model)


@pytest.mark.parametrize("bias", [True, False])
def test_state_dict_keys_are_the_official_eagle1_keys(target, bias, tmp_path):
    model, _ = target
    cfg = EagleConfig.for_target(model.cfg, bias=bias)
    head = EagleHead(cfg)
    want = OFFICIAL_KEYS if bias else [k for k in OFFICIAL_KEYS if k != "fc.bias"]
    assert list(head.state_dict()) == want
    H = model.cfg.d_model
    assert head.fc.weight.shape == (H, 2 * H)
    # official layout: a directory with a Llama config.json and model.safetensors (+ an embedding copy)
    from safetensors.torch import save_file

    conf = cfg.to_dict()
    assert conf["num_hidden_layers"] == 1 and EagleConfig.from_dict(conf) == cfg
    if bias:
        del conf["bias"]  # absent means the fc has a bias
    (tmp_path / "config.json").write_text(json.dumps(conf))
    sd = {k: v.contiguous() for k, v in head.state_dict().items()} | {"embed_tokens.weight": model.tok_emb.weight.detach().clone()}
    save_file(sd, str(tmp_path / "model.safetensors"))
    d = load_eagle(tmp_path, model, tree="eagle")
    assert d.head.cfg == cfg and d.spec.name == "eagle"
    for k, v in head.state_dict().items():
        assert torch.equal(v, d.head.state_dict()[k])
    del sd["layers.0.mlp.up_proj.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing .*up_proj"):
        load_eagle(tmp_path, model)


@pytest.mark.slow
def test_shipped_smollm2_head_is_lossless_and_fast(smollm2, smollm2_vanilla):
    """The shipped head on SmolLM2-135M over the full vocabulary (the tree tests of
    tests/test_smollm2_speculative.py draft over the reduced one): greedy chain and dynamic-tree output
    equal vanilla on three prompts (one chat, two code), and tau clears a floor below the measured value."""
    model, tok = smollm2
    vanilla = dict(list(smollm2_vanilla.items())[:3])
    for tree, floor in (("chain:5", 1.8), ("5,8,32", 2.5)):  # measured 2.29 and 3.20 (3 prompts x 32, benchmarks/smollm2_reference_taus.py)
        drafter = EagleDrafter.from_pretrained(model, tree=tree)  # its prefill resets it for each prompt
        new = forwards = 0
        for prompt, ref in vanilla.items():
            spec = generate(model, tok, prompt, drafter=drafter, max_new_tokens=N_REF)
            assert spec.tokens == ref, (tree, prompt)
            new, forwards = new + spec.stats.new_tokens, forwards + spec.stats.target_forwards
        assert new / forwards > floor, (tree, new / forwards)


# --- frequency-ranked draft vocabulary (FR-Spec, minispec.drafters.vocab) -------------------------------

def _counts(model, tok):
    """Token counts of the tiny target's own greedy text: what the draft vocabulary ranks by."""
    text = [generate(model, tok, p, max_new_tokens=48, chat=False) for p in PROMPTS]
    ids = torch.tensor([t for r in text for t in r.prompt_tokens + r.tokens])
    return torch.bincount(ids, minlength=model.cfg.vocab_size)


def test_top_tokens_and_reduced_lm_head(target):
    from minispec.drafters.vocab import ReducedLMHead, top_tokens

    model, _ = target
    counts = torch.tensor([5, 0, 9, 5, 1, 9])
    assert top_tokens(counts, 3).tolist() == [0, 2, 5]  # 9, 9, then the lower id of the two 5s
    for bad in (0, 7, 2.5):
        with pytest.raises(ValueError, match="draft vocabulary size"):
            top_tokens(counts, bad)
    ids = torch.tensor([3, 17, 42, 200])
    head = ReducedLMHead(model.lm_head, ids)
    g = torch.randn(2, 5, model.cfg.d_model)
    with torch.inference_mode():
        full, small = model.lm_head(g), head(g)  # [2, 5, V]
    assert small.shape == full.shape
    torch.testing.assert_close(small[..., ids], full[..., ids])
    outside = torch.ones(model.cfg.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert torch.isinf(small[..., outside]).all() and (small[..., outside] < 0).all()
    with pytest.raises(ValueError, match="draft vocabulary ids"):
        ReducedLMHead(model.lm_head, torch.tensor([model.cfg.vocab_size]))


@pytest.mark.parametrize("tree", ["chain:5", "4,3,10"])
def test_reduced_vocab_greedy_equals_vanilla(target, head, tree):
    model, tok = target
    counts = _counts(model, tok)
    accepted = 0
    for prompt in PROMPTS:
        vanilla = generate(model, tok, prompt, max_new_tokens=60)
        d = EagleDrafter(model, head, tree=tree, draft_vocab=24, token_counts=counts)
        spec = generate(model, tok, prompt, drafter=d, max_new_tokens=60)
        assert spec.tokens == vanilla.tokens
        accepted += sum(spec.stats.accepted_at_depth)
    assert accepted > 20


def test_reduced_vocab_sampling_has_the_target_law(target, head):
    """A sampled chain whose q is 0 outside the draft vocabulary, which misses part of the target's
    support: the residual max(0, p - q) restores it, so the joint law of three tokens is p's."""
    model, tok = target
    params = dict(temperature=0.7, top_k=3)
    ids = tok.encode("aaaa")
    exact = exact_law(model, ids, params)
    first = {}
    for seq, pr in exact.items():
        first[seq[0]] = first.get(seq[0], 0.0) + pr
    missing = min(first, key=first.get)  # the least likely first token: drafts can never propose it
    kept = sorted({t for seq in exact for t in seq} - {missing})
    counts = torch.zeros(model.cfg.vocab_size, dtype=torch.long)
    counts[kept] = 1
    law = sample_law(model, tok, ids, lambda: EagleDrafter(model, head, tree=TreeSpec.chain(2), draft_vocab=len(kept),
                                                           token_counts=counts), exact, 1000, params)
    assert law.accepted > law.n / 10
    assert sum(n for seq, n in law.counts.items() if seq[0] == missing) > 0  # the token outside the draft vocabulary still comes out (from the residual)
    assert_same_law(law, exact)


@pytest.mark.parametrize("draft_vocab", [None, 24], ids=["full-vocab", "draft-vocab"])
def test_a_bfloat16_head_drafts_for_a_float32_target_without_changing_the_output(target, head, draft_vocab):
    """``head_dtype=torch.bfloat16``: the drafter computes in a bf16 copy of the head and of the LM-head rows it
    reads (the given head is left in float32), its logits come back in float32, and the output is the
    target's: greedy tokens equal vanilla's, and a sampled chain's first three tokens have the target's law."""
    model, tok = target
    counts = _counts(model, tok) if draft_vocab else None

    def make():
        return EagleDrafter(model, head, tree="chain:3", draft_vocab=draft_vocab, token_counts=counts,
                            head_dtype=torch.bfloat16)

    d = make()
    assert next(head.parameters()).dtype == torch.float32 and d.head is not head
    assert {p.dtype for p in d.head.parameters()} == {p.dtype for p in d.lm_head.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight.dtype == torch.float32
    assert d._logits(torch.zeros(model.cfg.d_model, dtype=torch.bfloat16)).dtype == torch.float32
    accepted = 0
    for prompt in PROMPTS:
        spec = generate(model, tok, prompt, drafter=make(), max_new_tokens=60)
        assert spec.tokens == generate(model, tok, prompt, max_new_tokens=60).tokens
        accepted += sum(spec.stats.accepted_at_depth)
    assert accepted > 20  # a bf16 head is still often right
    if not draft_vocab:
        return  # the law once, on the shipped configuration (a draft vocabulary)
    params = dict(temperature=0.7, top_k=3)
    ids = tok.encode("aaaa")
    exact = exact_law(model, ids, params)
    law = sample_law(model, tok, ids, make, exact, 1000, params)
    assert law.accepted > law.n / 10
    assert_same_law(law, exact)


def _methods_with_saved(head, model, tmp_path):
    """A ``Methods`` whose EAGLE-1/2 methods load ``head``, saved as a checkpoint, over the full vocabulary."""
    from minispec.methods import Methods
    from minispec.train.eagle import FORMAT, save_head

    path = tmp_path / "head.safetensors"
    save_head(head, path, dict(format=FORMAT, target=model.cfg.name, config=head.cfg.to_dict(), command="test",
                               data=dict(train_tokens=1)))
    return Methods(model, model.cfg.name, drafter_path=path, draft_vocab=0)


def test_a_method_named_with_bf16_loads_a_bfloat16_head(target, head, tmp_path):
    """``eagle+bf16@chain:3`` (``minispec.methods``): the checkpoint's head drafts in bfloat16, beside the float32
    one of ``eagle@chain:3`` from the same file, and the greedy output is still vanilla's."""
    from minispec.drafters import load_drafter
    from minispec.drafters.defaults import shipped_head

    model, tok = target
    methods = _methods_with_saved(head, model, tmp_path)
    d16, d32 = methods.drafter("eagle+bf16@chain:3"), methods.drafter("eagle@chain:3")
    assert d16 is not d32 and d16.spec == d32.spec == TreeSpec.chain(3)
    assert d16.head_dtype == torch.bfloat16 and d32.head_dtype == torch.float32
    assert methods.drafter("copy+bf16@chain:3").fallback.head_dtype == torch.bfloat16
    for prompt in PROMPTS[:2]:
        assert generate(model, tok, prompt, drafter=d16, max_new_tokens=40).tokens == \
            generate(model, tok, prompt, max_new_tokens=40).tokens
    with pytest.raises(ValueError, match="head_dtype applies to EAGLE-1/2 heads"):  # checked before any shape
        load_drafter(str(shipped_head("medusa")), model, head_dtype=torch.bfloat16)


def test_tune_times_the_head_in_each_dtype_and_its_candidates_draft_in_the_faster(target, head, tmp_path, monkeypatch):
    """``lab.tune.head_dtype_costs`` times one draft per dtype; ``tune`` (head_dtype "auto") renames its plain EAGLE-1/2
    candidates to the faster dtype, keeps a candidate that names its own, and reports both times."""
    from minispec.lab import tune
    from minispec.lab.tune_report import format_tune

    model, tok = target
    methods = _methods_with_saved(head, model, tmp_path)
    costs = tune.head_dtype_costs(model, methods, context=16, reps=1)
    assert set(costs) == {"f32", "bf16"} and all(s > 0 for s in costs.values())
    kw = dict(candidates=("vanilla", "eagle@chain:2", "eagle+f32@chain:3", "pld"), max_new_tokens=8, context=16,
              sizes=(0, 2, 4), methods=methods, progress=False, reps=1)
    for fake, want, renamed in (({"f32": 2.0, "bf16": 1.0}, "bf16", "eagle+bf16@chain:2"),
                                ({"f32": 1.0, "bf16": 2.0}, "f32", "eagle@chain:2")):
        monkeypatch.setattr(tune, "head_dtype_costs", lambda *a, **k: dict(fake))
        r = tune.tune(model, tok, ["abcabcabc"], model.cfg.name, **kw)
        assert (r.head_dtype, r.head_dtype_s) == (want, fake)
        assert {c.method for c in r.candidates} == {"vanilla", renamed, "eagle+f32@chain:3", "pld"}
        assert f"the candidates draft in {want}" in format_tune(r)
    r = tune.tune(model, tok, ["abcabcabc"], model.cfg.name, head_dtype="bf16", **kw)  # asked for: not timed
    assert r.head_dtype == "bf16" and r.head_dtype_s == {} and "eagle+bf16@chain:2" in {c.method for c in r.candidates}
    r = tune.tune(model, tok, ["abcabcabc"], model.cfg.name, head_dtype="target", **kw)
    assert r.head_dtype is None and "eagle@chain:2" in {c.method for c in r.candidates}
    with pytest.raises(ValueError, match="head_dtype must be"):
        tune.tune(model, tok, ["abc"], model.cfg.name, head_dtype="fp8", **kw)


def test_warm_start_copies_a_saved_head_and_refuses_another_shape(target, tmp_path):
    from minispec.train.eagle import FORMAT, save_head, warm_start, warm_start_record

    model, _ = target
    torch.manual_seed(0)
    for bias in (True, False):
        cfg = EagleConfig.for_target(model.cfg, bias=bias)
        src = EagleHead(cfg)
        save_head(src, tmp_path / f"h{int(bias)}.safetensors",
                  dict(format=FORMAT, target=model.cfg.name, config=cfg.to_dict(), command="train eagle --steps 1",
                       data=dict(train_tokens=123)))
    head = EagleHead(EagleConfig.for_target(model.cfg))
    warm_start(head, tmp_path / "h1.safetensors", model)
    saved = load_eagle(tmp_path / "h1.safetensors", model).head.state_dict()
    for k, v in head.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, saved[k].float())  # the fp16 checkpoint, as saved
    assert not torch.equal(head.fc.weight, EagleHead(EagleConfig.for_target(model.cfg)).fc.weight)
    with pytest.raises(ValueError, match="differs from the head trained here"):
        warm_start(EagleHead(EagleConfig.for_target(model.cfg)), tmp_path / "h0.safetensors", model)  # no fc bias
    rec = warm_start_record(tmp_path / "h1.safetensors")
    assert rec["path"] == "h1.safetensors" and rec["command"] == "train eagle --steps 1"
    assert rec["data"] == {"train_tokens": 123}


def test_draft_vocabulary_loss_is_the_soft_ce_over_those_tokens(target, head):
    """train.eagle's CE over a draft vocabulary: the head's log-softmax over the K tokens against the target's
    distribution over the same K tokens from the true next feature; with K = V, the full soft CE."""
    from minispec.train.eagle import eagle_loss, make_batch
    from minispec.train.data import Sequence

    model, tok = target
    s = torch.tensor(generate(model, tok, "abcabc", max_new_tokens=16, chat=False).prompt_tokens
                     + generate(model, tok, "abcabc", max_new_tokens=16, chat=False).tokens)
    with torch.no_grad():
        feats = [dict(hidden=model(s[None]).hidden[0].half())]
    seqs = [Sequence(s, 3, "selfdistill")]
    batch = make_batch(seqs, feats, [0])  # no stored top-k: zeros there, unused by this loss
    full = model.lm_head.weight.detach()
    ids = torch.tensor([1, 5, 7, 30, 99])
    with torch.no_grad():
        _, l1, ce, _ = eagle_loss(head, model, batch, 0.1, 1.0, 0.0, draft_head=full[ids])
        tokens, hidden, _, _, mask = batch
        pred = head(model.tok_emb(tokens[:, 1:]).float(), hidden[:, :-1], torch.arange(tokens.shape[1] - 1))
        z, zt = pred[mask] @ full[ids].T, hidden[:, 1:][mask] @ full[ids].T
        want = -(torch.softmax(zt, -1) * torch.log_softmax(z, -1)).sum(-1).mean()
        torch.testing.assert_close(ce, want)
        _, _, ce_v, _ = eagle_loss(head, model, batch, 0.1, 1.0, 0.0, draft_head=full)
        zf, ztf = model.lm_head(pred[mask]), model.lm_head(hidden[:, 1:][mask])
        torch.testing.assert_close(ce_v, -(torch.softmax(ztf, -1) * torch.log_softmax(zf, -1)).sum(-1).mean())


def test_unrolled_training_levels_are_the_drafters_chain(target, heads):
    """train.eagle.unroll's level j at anchor t gives the logits EagleDrafter's chain gives its level-j node
    when it drafts along the true tokens (KV cache and all), for a 1- and a 2-layer head."""
    from minispec.train.eagle import unroll

    model, tok = target
    ctx = tok.encode("The training-time test at work, at work")
    n, m, levels = len(ctx), len(ctx) - 4, 3  # m committed tokens, the root ctx[m-1]: anchor t = m - 2
    with torch.no_grad():
        f = model(torch.tensor([ctx])).hidden  # [1, n, D]
        outs = unroll(heads, model.tok_emb, torch.tensor([ctx]), f[:, :-1], levels)  # levels x [1, n-1, D]
        d = EagleDrafter(model, heads, tree="chain:4")
        d.prefill(ctx[:m], Features(f[0, :m - 1]))
        got = [d._start(), d._extend([ctx[m]], [-1])[0], d._extend([ctx[m + 1]], [0])[0]]
        d._end()
    for j in range(levels):
        torch.testing.assert_close(got[j], model.lm_head(outs[j][0, m - 2]), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(outs[1][0, m - 2], outs[0][0, m - 1], atol=1e-3)  # own features, not the true ones


def test_the_one_level_unrolled_loss_is_the_teacher_forced_loss(target, head):
    """ttt_loss over one level is eagle_loss (same noise, same CE positions), and more levels add the later
    levels' terms, each reported by its accuracy."""
    from minispec.train.data import Sequence
    from minispec.train.eagle import eagle_loss, make_batch, ttt_loss

    model, tok = target
    r = generate(model, tok, "abcabc", max_new_tokens=16, chat=False)
    s = torch.tensor(r.prompt_tokens + r.tokens)
    with torch.no_grad():
        feats = [dict(hidden=model(s[None]).hidden[0].half())]
    batch = make_batch([Sequence(s, 3, "selfdistill")], feats, [0])
    rows = model.lm_head.weight.detach()[:40]
    with torch.no_grad():
        want = eagle_loss(head, model, batch, 0.1, 0.5, 0.1, torch.Generator().manual_seed(1), draft_head=rows)
        one = ttt_loss(head, model, batch, 0.1, 0.5, 0.1, 1, 0.8, rows, torch.Generator().manual_seed(1))
        three = ttt_loss(head, model, batch, 0.1, 0.5, 0.1, 3, 0.8, rows, torch.Generator().manual_seed(1))
    for a, b in zip(want, one[:4]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert len(one[4]) == 1 and len(three[4]) == 3 and not torch.isclose(three[0], one[0])


def test_ttt_levels_need_the_draft_vocabulary_loss(target):
    from minispec.train.eagle import loss_fn

    with pytest.raises(ValueError, match="draft-vocab"):
        loss_fn(target[0], 0.1, 1.0, 0.1, None, ttt_steps=3)


COPY_PROMPTS = ["abcdefabcdefabcdef", "1 2 3 4 1 2 3 4 1 2", "Hello world, hello world, hello"]


def test_copying_drafter_greedy_equals_vanilla_and_copies(target, head):
    from minispec.drafters.copying import CopyingDrafter

    model, tok = target
    copied = 0
    for prompt in COPY_PROMPTS + PROMPTS:
        vanilla = generate(model, tok, prompt, max_new_tokens=48)
        d = CopyingDrafter(EagleDrafter(model, head, tree="chain:4"), k=6)
        assert generate(model, tok, prompt, drafter=d, max_new_tokens=48).tokens == vanilla.tokens, prompt
        copied += d.copied
        assert d.copied + d.asked > 0
    assert copied > 0  # the repetitive prompts were copied from


def test_copying_drafter_sampled_has_the_target_law(target, head):
    """A copied chain carries no q (one-hot verification), the head's chain its q: the first three tokens'
    joint law matches the target's exact law either way."""
    from minispec.drafters.copying import CopyingDrafter

    model, tok = target
    params = dict(temperature=0.7, top_k=3)
    ids = tok.encode("abab")
    exact = exact_law(model, ids, params)
    law = sample_law(model, tok, ids, lambda: CopyingDrafter(EagleDrafter(model, head, tree=TreeSpec.chain(2)), k=4),
                     exact, 1000, params)
    assert law.accepted > law.n / 10
    assert_same_law(law, exact)


# --- heads of more than one decoder layer ------------------------------------------------------------

def test_the_layer_count_round_trips_and_zero_layers_are_refused(target):
    model, _ = target
    for n in (1, 2, 3):
        cfg = EagleConfig.for_target(model.cfg, num_hidden_layers=n)
        conf = cfg.to_dict()
        assert conf["num_hidden_layers"] == n and EagleConfig.from_dict(conf) == cfg
        assert len(EagleHead(cfg).layers) == n
    conf = EagleConfig.for_target(model.cfg).to_dict()
    del conf["num_hidden_layers"]
    assert EagleConfig.from_dict(conf).num_hidden_layers == 1  # absent: the official one layer
    for bad in (0, -1):
        with pytest.raises(ValueError, match="at least one decoder layer"):
            EagleConfig.from_dict({**conf, "num_hidden_layers": bad})


def test_two_layer_keys_are_official_llama_names_and_load_as_written(target, head2, tmp_path):
    from safetensors.torch import save_file

    from minispec.drafters.loader import load_drafter
    from minispec.lab.export import export_head

    model, _ = target
    layer1 = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
              "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
              "post_attention_layernorm.weight"]
    assert list(head2.state_dict()) == OFFICIAL_KEYS + [f"layers.1.{k}" for k in layer1]
    assert "layers.0.input_layernorm.weight" not in head2.state_dict()  # EAGLE's layer 0 has none
    d = load_drafter(export_head(head2, tmp_path / "official", dtype=torch.float32), model, verbose=False)
    assert d.head.cfg.num_hidden_layers == 2 and d.kv.k.shape[0] == 2  # one cache layer per decoder layer
    for k, v in head2.state_dict().items():
        assert torch.equal(v, d.head.state_dict()[k]), k
    conf = json.loads((tmp_path / "official" / "config.json").read_text())
    (tmp_path / "official" / "config.json").write_text(json.dumps({**conf, "num_hidden_layers": 1}))
    with pytest.raises(ValueError, match="layers.1"):  # a config that does not count the layers the weights hold
        load_drafter(tmp_path / "official", model, verbose=False)
    sd = {k: v.contiguous() for k, v in head2.state_dict().items() if k != "layers.1.input_layernorm.weight"}
    save_file(sd, str(tmp_path / "official" / "model.safetensors"))
    (tmp_path / "official" / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="input_layernorm"):
        load_drafter(tmp_path / "official", model, verbose=False)


def test_the_second_layer_changes_the_prediction(target, head, head2):
    """head2 is not head in disguise: its layer 1 moves the predicted features (so the 2-layer tests test it)."""
    model, tok = target
    ctx = torch.tensor([tok.encode("The tree mask at work")])
    with torch.no_grad():
        f = model(ctx).hidden[:, :-1]
        emb = model.tok_emb(ctx[:, 1:])
        g1, g2 = head(emb, f, torch.arange(f.shape[1])), head2(emb, f, torch.arange(f.shape[1]))
    assert (g1 - g2).abs().max() > 1e-2


def test_two_layer_kv_rollback_redrafts_what_a_fresh_head_drafts(target, head2):
    """Drafting a tree leaves both layers of the head's cache as they were: proposing again, and after a
    commit, gives the proposals of a fresh drafter on the same context."""
    model, tok = target
    ctx = tok.encode("Hello world, hello world, hello")
    with torch.no_grad():
        f = model(torch.tensor([ctx])).hidden[0]  # [n, D]: features of every token of ctx

    def fresh(n):
        d = EagleDrafter(model, head2, tree="4,3,10")
        d.prefill(ctx[:n], Features(f[:n - 1]))
        t = d.propose(GREEDY, budget=10)
        return t.tokens, t.parents

    n = len(ctx) - 4
    d = EagleDrafter(model, head2, tree="4,3,10")
    d.prefill(ctx[:n], Features(f[:n - 1]))
    first = d.propose(GREEDY, budget=10)
    assert d.kv.length == n - 1 and len(first) == 10
    again = d.propose(GREEDY, budget=10)
    assert (again.tokens, again.parents) == (first.tokens, first.parents) == fresh(n)
    d.commit(ctx[n:], Features(f[n - 1:len(ctx) - 1]))
    t = d.propose(GREEDY, budget=10)
    assert (t.tokens, t.parents) == fresh(len(ctx)) and d.kv.length == len(ctx) - 1


@pytest.mark.parametrize("tree", ["chain:4", "4,3,10"])
def test_graphed_drafts_are_the_eager_drafts(target, heads, tree):
    """Chapter 8: with graphs on (on the CPU: ``GraphedDraft``'s direct call over a static head cache, the tree
    built on the device) the head drafts the trees it drafts eagerly: the same tokens (vanilla's), the same
    tokens committed at every step, the same nodes; the drafts went through the graph runner."""
    model, tok = target
    for prompt in PROMPTS[:2]:
        want = generate(model, tok, prompt, max_new_tokens=40, chat=False, stop_at_eos=False)
        eager = generate(model, tok, prompt, drafter=EagleDrafter(model, heads, tree=tree), max_new_tokens=40,
                         chat=False, stop_at_eos=False)
        d = EagleDrafter(model, heads, tree=tree)
        graphed = generate(model, tok, prompt, drafter=d, max_new_tokens=40, chat=False, stop_at_eos=False,
                           cuda_graphs=True)
        assert graphed.tokens == eager.tokens == want.tokens
        assert graphed.stats.tokens_per_step == eager.stats.tokens_per_step and max(eager.stats.tokens_per_step) > 2
        assert graphed.stats.nodes == eager.stats.nodes and graphed.stats.draft_forwards == eager.stats.draft_forwards
        assert d.graph.captures >= 2 and sum(d.graph.replays.values()) == sum(n > 0 for n in graphed.stats.nodes)


@pytest.mark.parametrize("tree", ["chain:2", "2,2,3"])
def test_graphed_sampling_draws_what_eager_sampling_draws(target, head, tree):
    """Sampled decoding with graphs on: a dynamic tree is still one graph (its drafts are deterministic, verified
    as one-hot q); a sampled chain drafts eagerly over the static head cache (q is drawn on the decode loop's CPU
    generator). Seed for seed the tokens are eager sampling's, whose law
    ``test_sampled_eagle_decoding_has_the_target_law`` checks: graphs keep the target's law."""
    model, tok = target
    d = EagleDrafter(model, head, tree=tree)
    longer = 0
    for seed in range(4):
        kw = dict(max_new_tokens=16, chat=False, temperature=0.7, top_k=3, seed=seed)
        eager = generate(model, tok, "aaaa", drafter=EagleDrafter(model, head, tree=tree), **kw)
        graphed = generate(model, tok, "aaaa", drafter=d, cuda_graphs=True, **kw)
        assert graphed.tokens == eager.tokens and graphed.stats.tokens_per_step == eager.stats.tokens_per_step
        longer += sum(n > 1 for n in eager.stats.tokens_per_step)
    assert longer > 4  # drafts were accepted: the verification of what the graphs drafted mattered
    assert (sum(d.graph.replays.values()) > 0) == (TreeSpec.parse(tree).kind == "dynamic")
