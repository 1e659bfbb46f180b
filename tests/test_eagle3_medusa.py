"""EAGLE-3 and Medusa drafters (chapter 3) on the tiny Llama preset: exact drafting, lossless decoding.

Small heads are trained here in a few seconds with the library's own training losses
(``minispec.train.eagle3.ttt_loss``, ``minispec.train.medusa.medusa_loss``) on the tiny target's
own greedy text, so their drafts are accepted often enough for the verification to matter.
"""

import random

import pytest
import torch
from lawcheck import assert_same_law, exact_law, sample_law

from minispec import generate, load
from minispec.drafters.base import Features
from minispec.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head, build_vocab_map, eagle3_layers
from minispec.drafters.medusa import MedusaDrafter, MedusaHeads
from minispec.drafters.tree_drafter import TreeSpec
from minispec.drafters.vocab import top_tokens
from minispec.sampling import GREEDY
from minispec.train.data import Sequence, target_features

pytestmark = pytest.mark.ch03

PROMPTS = ["Hello world, hello world, hello", "abcabcabcabc", "def f(x):\n    return x", "1, 2, 3, 4, 5, 6"]
TREES = ["chain:4", "eagle", "4,4,12"]  # EAGLE-3
MEDUSA_TREES = ["chain:4", "medusa", "4,4,12"]  # at most 4 deep: the tiny heads are 4
# the shipped SmolLM2 heads: identical output and tau floors in tests/test_smollm2_speculative.py


@pytest.fixture(scope="module")
def target():
    return load("tiny-llama")


def _data(model, tok):
    """The tiny target's continuations (half greedy, half sampled at temperature 0.7, top-k 3: the
    settings tested below) of 64 seeded byte prompts, and its features on them."""
    rng = random.Random(0)
    seqs = []
    for i in range(64):
        prompt = tok.encode("".join(rng.choice("abcdefgh ,.1234") for _ in range(rng.randint(4, 12))))
        sampled = dict(temperature=0.7, top_k=3, seed=i) if i % 2 else {}
        out = generate(model, tok, prompt, max_new_tokens=40, stop_at_eos=False, **sampled)
        seqs.append(Sequence(torch.tensor(prompt + out.tokens), len(prompt), "test"))
    feats = target_features(model, seqs, layers=eagle3_layers(model.cfg.n_layer), topk=8, cache=False)
    return seqs, feats


def _train(params, loss_fn, steps, lr=1e-2):
    opt = torch.optim.AdamW(params, lr=lr)
    for s in range(steps):
        loss, accs = loss_fn(s)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return accs


def _eagle3_config(model):
    return Eagle3Config.for_target(model, 96)


def _train_eagle3(model, seqs, feats):
    from minispec.train.eagle3 import make_batch, target_map, ttt_loss

    torch.manual_seed(0)
    counts = torch.bincount(torch.cat([s.tokens for s in seqs]), minlength=model.cfg.vocab_size)
    d2t, t2d = build_vocab_map(counts, 96)
    head = Eagle3Head(_eagle3_config(model))
    with torch.no_grad():
        head.d2t.copy_(d2t), head.t2d.copy_(t2d)
    tmap, layers = target_map(head), eagle3_layers(model.cfg.n_layer)
    batch = make_batch(seqs, feats, list(range(len(seqs))), layers)
    with torch.no_grad():
        before = ttt_loss(head, model.tok_emb, batch, 3, 0.8, tmap)[1]
    after = _train(list(head.parameters()), lambda s: ttt_loss(head, model.tok_emb, batch, 3, 0.8, tmap), 120)
    return head, before, after


def _train_medusa(model, seqs, feats):
    from minispec.train.medusa import make_batch, medusa_loss

    torch.manual_seed(0)
    heads = MedusaHeads(model.cfg.d_model, 4, model.cfg.vocab_size)
    batch = make_batch(seqs, feats, list(range(len(seqs))))
    lm = model.lm_head.weight.detach()
    with torch.no_grad():
        before = medusa_loss(heads, lm, *batch)[1]
    after = _train(list(heads.parameters()), lambda s: medusa_loss(heads, lm, *batch), 50)
    return heads, before, after


@pytest.fixture(scope="module")
def trained(target, shared_torch):
    """The heads trained on ``_data`` (and their top-1 accuracy before and after), and the context of the
    sampled-law tests: computed once per test run, read by every pytest-xdist worker (~50 s each time)."""
    def compute():
        model, tok = target
        seqs, feats = _data(model, tok)
        out = {"context": seqs[3].tokens[:seqs[3].prompt_len + 2],  # an odd index: a sampled continuation
               "counts": torch.bincount(torch.cat([s.tokens for s in seqs]), minlength=model.cfg.vocab_size)}
        for kind, train in (("eagle3", _train_eagle3), ("medusa", _train_medusa)):
            head, before, after = train(model, seqs, feats)
            out[kind] = dict(state=head.state_dict(), before=torch.tensor(before), after=torch.tensor(after))
        return out
    return shared_torch("tiny-llama-eagle3-medusa", compute)


def _head(kind, model, saved):
    head = (Eagle3Head(_eagle3_config(model)) if kind == "eagle3"
            else MedusaHeads(model.cfg.d_model, 4, model.cfg.vocab_size))
    head.load_state_dict(saved[kind]["state"])
    return head.eval().requires_grad_(False), saved[kind]["before"].tolist(), saved[kind]["after"].tolist()


@pytest.fixture(scope="module")
def eagle3_head(target, trained):
    return _head("eagle3", target[0], trained)


@pytest.fixture(scope="module")
def medusa_heads(target, trained):
    return _head("medusa", target[0], trained)


def drafter(kind, model, head, tree):
    return Eagle3Drafter(model, head, tree=tree) if kind == "eagle3" else MedusaDrafter(model, head, tree=tree)


@pytest.fixture(scope="module")
def heads(eagle3_head, medusa_heads):
    return {"eagle3": eagle3_head[0], "medusa": medusa_heads[0]}


def test_training_improves_accuracy_on_its_data(eagle3_head, medusa_heads):
    """The library's losses train: top-1 agreement with the target rises on the training text."""
    _, before, after = eagle3_head
    assert after[0] > before[0] + 0.3 and after[-1] > before[-1] + 0.3, (before, after)
    _, before, after = medusa_heads
    assert after[0] > before[0] + 0.05 and sum(after) > sum(before) + 0.1, (before, after)


def test_build_vocab_map_invariants():
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 1000, (300,), generator=g)
    counts[[5, 77, 299]] = 10_000  # the most frequent tokens must be kept
    d2t, t2d = build_vocab_map(counts, 40)
    kept = torch.arange(40) + d2t  # target ids of draft ids 0..39
    assert t2d.dtype == torch.bool and t2d.sum() == 40 and t2d[kept].all()
    assert (kept[1:] > kept[:-1]).all()  # one draft id per kept token, in target-id order
    assert t2d[[5, 77, 299]].all()
    assert counts[t2d].min() >= counts[~t2d].max()  # nothing dropped is more frequent than something kept
    d2t_full, t2d_full = build_vocab_map(counts, 300)
    assert t2d_full.all() and (d2t_full == 0).all()
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_vocab_map(counts, 301)
    # draft logits land on their target ids; the rest of the target vocabulary is -inf
    head = Eagle3Head(Eagle3Config(16, 32, 2, 1, 300, 40))
    head.d2t.copy_(d2t), head.t2d.copy_(t2d)
    z = torch.randn(3, 40)
    full = head.to_target_logits(z)  # [3, 300]
    assert torch.equal(full[:, kept], z) and torch.isinf(full[:, ~t2d]).all()


def _features(model, ctx):
    with torch.no_grad():
        o = model(torch.tensor([ctx]), hidden_layers=eagle3_layers(model.cfg.n_layer))
    return o


def _spy(d):
    """Record the logits _extend returns for every node, keyed by the node's token path."""
    seen, orig = {}, d._extend

    def spy(tokens, parents):
        out = orig(tokens, parents)
        base = len(spy.paths)
        for j, (t, p) in enumerate(zip(tokens, parents)):
            spy.paths.append((spy.paths[p] if p >= 0 else []) + [t])
            seen[tuple(spy.paths[base + j])] = out[j]
        return out
    spy.paths = []
    d._extend = spy
    return seen


@pytest.mark.parametrize("tree", TREES)
def test_eagle3_tree_node_logits_equal_an_unrolled_recomputation(target, eagle3_head, tree):
    """Each node's logits equal the training-time-test unroll (no KV cache, no tree mask) along its path."""
    from minispec.train.eagle3 import unroll

    model, tok = target
    head = eagle3_head[0]
    ctx = tok.encode("The tree mask at work, the tree")
    n = len(ctx)
    o = _features(model, ctx[:-1])
    d = Eagle3Drafter(model, head, tree=tree)
    d.prefill(ctx, Features(o.hidden[0], {i: h[0] for i, h in o.layer_inputs.items()}))
    seen = _spy(d)
    t = d.propose(GREEDY, budget=10)
    assert seen and len(t) == TreeSpec.parse(tree).max_nodes
    fused = torch.cat([o.layer_inputs[i] for i in d.target_layers], -1)  # [1, n-1, 3H]
    for path, logits in seen.items():
        tokens = torch.tensor([ctx + list(path)])
        f = torch.cat([fused, fused.new_zeros(1, len(path) + 1, fused.shape[-1])], 1)  # later features unused
        with torch.no_grad():
            ref = unroll(head, model.tok_emb, f, tokens, len(path) + 1)[len(path)][0, n - 2]
        ref = head.to_target_logits(head.draft_logits(ref))
        assert torch.equal(torch.isinf(ref), torch.isinf(logits))
        torch.testing.assert_close(logits[torch.isfinite(ref)], ref[torch.isfinite(ref)], atol=1e-4, rtol=1e-4)
    assert d.kv.length == n - 1  # the tree was rolled back; the committed positions stay


MEDUSA_VOCAB = 24  # the tiny heads' draft vocabulary in the tests below: 24 of the 256 tokens


def _medusa(model, heads, tree, trained, vocab):
    """A Medusa drafter over the full vocabulary (vocab None) or the ``vocab`` most frequent tokens of the heads'
    training text."""
    return MedusaDrafter(model, heads, tree=tree, draft_vocab=vocab, token_counts=trained["counts"] if vocab else None)


@pytest.mark.parametrize("vocab", [None, MEDUSA_VOCAB], ids=["full-vocab", "draft-vocab"])
@pytest.mark.parametrize("tree", MEDUSA_TREES)
def test_medusa_children_of_depth_d_take_head_d(target, trained, medusa_heads, tree, vocab):
    """Every child of a depth-d node takes head d's logits on f_{n-2}: over the full vocabulary the target's LM
    head, over a draft vocabulary its rows of those tokens (-inf elsewhere, so no other token is drafted)."""
    model, tok = target
    heads = medusa_heads[0]
    ctx = tok.encode("Medusa heads see only f_{n-2}")
    o = _features(model, ctx[:-1])
    d = _medusa(model, heads, tree, trained, vocab)
    d.prefill(ctx, Features(o.hidden[0]))
    seen = _spy(d)
    t = d.propose(GREEDY, budget=10)
    keep = torch.zeros(model.cfg.vocab_size, dtype=torch.bool)
    keep[top_tokens(trained["counts"], vocab) if vocab else slice(None)] = True  # [V] the draft vocabulary
    with torch.no_grad():
        ref = [heads.heads[i][0](o.hidden[0, -1]) @ model.lm_head.weight.t() for i in range(4)]  # head i on f_{n-2}
    ref = [r.masked_fill(~keep, float("-inf")) for r in ref]
    assert seen
    for path, logits in seen.items():
        torch.testing.assert_close(logits, ref[len(path)])
    first = [i for i, p in enumerate(t.parents) if p < 0]
    assert t.tokens[first[0]] == int(ref[0].argmax())
    assert keep[t.tokens].all()


@pytest.mark.parametrize("vocab", [None, MEDUSA_VOCAB], ids=["full-vocab", "draft-vocab"])
def test_a_medusa_step_reads_the_lm_head_rows_once_for_all_heads(target, trained, medusa_heads, vocab):
    """One proposal runs each head's residual block once and ONE LM-head product for all four heads: over a draft
    vocabulary that product reads its rows only ([Vd, H]), not the target's [V, H] once per head."""
    model, tok = target
    heads = medusa_heads[0]
    ctx = tok.encode("Medusa reads the LM head once")
    o = _features(model, ctx[:-1])
    d = _medusa(model, heads, "medusa", trained, vocab)
    d.prefill(ctx, Features(o.hidden[0]))
    calls = []  # (weight shape, rows) of every linear layer a proposal runs
    hooks = [m.register_forward_hook(lambda m, x, y: calls.append((tuple(m.weight.shape), x[0].numel() // m.in_features)))
             for m in {*heads.modules(), *model.modules(), *d.lm_head.modules()} if isinstance(m, torch.nn.Linear)]
    try:
        d.propose(GREEDY, budget=10)
    finally:
        for h in hooks:
            h.remove()
    H, V = model.cfg.d_model, model.cfg.vocab_size
    rows = MEDUSA_VOCAB if vocab else V
    assert sorted(calls) == sorted([((H, H), 1)] * 4 + [((rows, H), 4)]), calls  # 4 residual blocks, 1 LM-head product


@pytest.mark.parametrize("kind, tree", [("eagle3", t) for t in TREES] + [("medusa", t) for t in MEDUSA_TREES])
def test_greedy_decoding_equals_vanilla(target, heads, kind, tree):
    model, tok = target
    saved = 0
    for prompt in PROMPTS:
        vanilla = generate(model, tok, prompt, max_new_tokens=60)
        spec = generate(model, tok, prompt, drafter=drafter(kind, model, heads[kind], tree), max_new_tokens=60)
        assert spec.tokens == vanilla.tokens
        saved += vanilla.stats.target_forwards - spec.stats.target_forwards
    assert saved > 10  # drafts were accepted: the verification mattered


@pytest.mark.parametrize("tree", MEDUSA_TREES)
def test_medusa_over_a_draft_vocabulary_decodes_vanillas_greedy_tokens(target, trained, heads, tree):
    model, tok = target
    saved = 0
    for prompt in PROMPTS:
        vanilla = generate(model, tok, prompt, max_new_tokens=60)
        spec = generate(model, tok, prompt, drafter=_medusa(model, heads["medusa"], tree, trained, MEDUSA_VOCAB),
                        max_new_tokens=60)
        assert spec.tokens == vanilla.tokens
        saved += vanilla.stats.target_forwards - spec.stats.target_forwards
    assert saved > 10  # drafts were accepted: the verification mattered


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
@pytest.mark.parametrize("tree", ["chain:3", "3,3,6"])
def test_sampled_decoding_has_the_target_law(target, trained, heads, kind, tree):
    """First three tokens at temperature 0.7, top-k 3 (27 outcomes): chi-square against the exact law.
    Chains carry a real q (Leviathan/Chen), trees deterministic drafts (one-hot q). The context is one
    of the target's own sampled continuations the heads trained on (its prompt and first two tokens):
    the tiny heads agree with the target there often enough for acceptance to matter, while on an
    arbitrary prompt they may never be accepted (and the test would check nothing)."""
    model, tok = target
    params = dict(temperature=0.7, top_k=3)
    ids = trained["context"].tolist()  # a sampled continuation of the training data: its prompt, two tokens
    exact = exact_law(model, ids, params)
    law = sample_law(model, tok, ids, lambda: drafter(kind, model, heads[kind], tree), exact, 800, params)
    # drafts were accepted (~10% of runs with these tiny heads): verification mattered
    assert law.accepted > law.n / 25, law.accepted
    assert_same_law(law, exact)


@pytest.mark.parametrize("tree", ["chain:3", "3,3,6"])
def test_medusa_over_a_draft_vocabulary_has_the_target_law(target, trained, heads, tree):
    """As above, with the heads drafting over a draft vocabulary that leaves out the least likely first token: a
    chain's q is 0 there and a tree never drafts it, yet it still comes out (from the residual / the bonus),
    and the joint law of three tokens is the target's."""
    model, tok = target
    params = dict(temperature=0.7, top_k=3)
    ids = trained["context"].tolist()
    exact = exact_law(model, ids, params)
    first = {}
    for seq, pr in exact.items():
        first[seq[0]] = first.get(seq[0], 0.0) + pr
    missing = min(first, key=first.get)  # the least likely first token: drafts can never propose it
    counts = torch.zeros(model.cfg.vocab_size, dtype=torch.long)
    counts[sorted({t for seq in exact for t in seq} - {missing})] = 1
    law = sample_law(model, tok, ids, lambda: MedusaDrafter(model, heads["medusa"], tree=tree, draft_vocab=int(counts.sum()),
                                                            token_counts=counts), exact, 800, params)
    assert law.accepted > law.n / 25, law.accepted
    assert sum(n for seq, n in law.counts.items() if seq[0] == missing) > 0  # the left-out token still comes out
    assert_same_law(law, exact)


def test_drafters_refuse_a_target_of_another_size(target, heads):
    with pytest.raises(ValueError, match="hidden 64.*hidden 32"):
        Eagle3Drafter(load("tiny-gpt2-draft")[0], heads["eagle3"])
    with pytest.raises(ValueError, match="hidden 64.*hidden 32"):
        MedusaDrafter(load("tiny-gpt2-draft")[0], heads["medusa"])
    with pytest.raises(ValueError, match="depth 5 needs 5 Medusa heads"):
        MedusaDrafter(target[0], heads["medusa"], tree="eagle")
    d = Eagle3Drafter(target[0], heads["eagle3"], tree="chain:2")
    d.prefill([1, 2, 3])  # no features handed over
    with pytest.raises(RuntimeError, match="prefill and commit"):
        d.propose(GREEDY, budget=2)



@pytest.mark.parametrize("tree", ["chain:4", "4,4,12"])
def test_graphed_eagle3_drafts_are_the_eager_drafts(target, heads, tree):
    """Chapter 8: with graphs on (on the CPU: ``GraphedDraft``'s direct call over a static head cache, the tree
    built on the device) the EAGLE-3 head drafts what it drafts eagerly: vanilla's tokens, the same tokens
    committed at every step, the same nodes; the drafts went through the graph runner."""
    model, tok = target
    accepted = 0
    for prompt in PROMPTS[:2]:
        want = generate(model, tok, prompt, max_new_tokens=40, chat=False, stop_at_eos=False)
        eager = generate(model, tok, prompt, drafter=drafter("eagle3", model, heads["eagle3"], tree), max_new_tokens=40,
                         chat=False, stop_at_eos=False)
        d = drafter("eagle3", model, heads["eagle3"], tree)
        graphed = generate(model, tok, prompt, drafter=d, max_new_tokens=40, chat=False, stop_at_eos=False,
                           cuda_graphs=True)
        assert graphed.tokens == eager.tokens == want.tokens
        assert graphed.stats.tokens_per_step == eager.stats.tokens_per_step and graphed.stats.nodes == eager.stats.nodes
        assert d.graph.captures >= 2 and sum(d.graph.replays.values()) == sum(n > 0 for n in graphed.stats.nodes)
        accepted += sum(eager.stats.accepted_at_depth)
    assert accepted > 5  # drafts were accepted: the trees' steps committed more than one token
