"""Speculative decoding through the one decode loop: greedy equals vanilla, sampling keeps p's law."""

import pytest
import torch
from lawcheck import assert_same_law, exact_law, sample_law

from minispec import generate, load
from minispec.drafters import DraftModel, Drafter, PromptLookup
from minispec.tree import Tree

PROMPTS = ["Hello world, hello world, hello", "abcabcabcabc", "def f(x):\n    return x", "1, 2, 3, 4, 5, 6"]


@pytest.fixture(scope="module")
def target():
    return load("tiny-llama")


@pytest.fixture(scope="module")
def draft():
    return load("tiny-gpt2-draft")[0]


@pytest.fixture(scope="module")
def correlated_draft():
    """A noisy copy of the target: q is close to p but not equal, so drafts are often accepted and
    a verifier or q bookkeeping bug shows. (An unrelated tiny draft rarely shares the target's
    top-k, so almost every draft is rejected and the output is p whatever the bug.)"""
    d = load("tiny-llama")[0]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        d.lm_head.weight.add_(0.05 * torch.randn(d.lm_head.weight.shape, generator=g))
    return d


@pytest.mark.ch01
@pytest.mark.parametrize("make", [lambda t, d: DraftModel(d, k=4), lambda t, d: DraftModel(t, k=3),
                                  lambda t, d: PromptLookup(k=5)], ids=["draft-model", "self-draft", "prompt-lookup"])
def test_greedy_speculative_equals_vanilla(target, draft, make):
    model, tok = target
    for prompt in PROMPTS:
        vanilla = generate(model, tok, prompt, max_new_tokens=60)
        spec = generate(model, tok, prompt, drafter=make(model, draft), max_new_tokens=60)
        assert spec.tokens == vanilla.tokens
        assert spec.stats.target_forwards <= vanilla.stats.target_forwards


@pytest.mark.ch01
def test_self_draft_accepts_everything(target):
    """A draft identical to the target is always right: tau = k + 1 (greedy and sampled)."""
    model, tok = target
    for temperature in (0.0, 1.0):
        r = generate(model, tok, "abc", drafter=DraftModel(model, k=3), max_new_tokens=41, temperature=temperature, seed=0)
        assert r.stats.acceptance_by_position == [1.0, 1.0, 1.0]
        assert r.stats.tokens_per_step[1:] == [4] * 10 and r.stats.target_forwards == 11


@pytest.mark.ch01
@pytest.mark.parametrize("make, every_token", [(lambda t, d: DraftModel(d, k=2), False),
                                               (lambda t, d: PromptLookup(k=2, max_ngram=1), True)],
                         ids=["draft-model", "prompt-lookup"])
def test_sampled_speculative_output_has_the_target_law(target, correlated_draft, make, every_token):
    """The joint law of the first three new tokens (top-k 3: 27 outcomes) matches the target's exactly
    computed law: chi-square does not reject, and TV is small."""
    model, tok = target
    params = dict(temperature=0.7, top_k=3)
    # prompt lookup: every token occurs earlier, so it always drafts; the draft model drafts after any prompt,
    # and after this one about half its drafts are accepted (both branches of verification run often)
    ids = list(range(256)) + tok.encode("aaaa") if every_token else tok.encode("The quick brown fox")
    exact = exact_law(model, ids, params)
    law = sample_law(model, tok, ids, lambda: make(model, correlated_draft), exact, 2000, params)
    assert law.tested > law.n / 2  # the drafter really proposed tokens
    if isinstance(make(model, correlated_draft), DraftModel):
        assert law.accepted > law.n / 5  # ... and they were often accepted, so q's bookkeeping matters
    assert_same_law(law, exact)


def test_vocab_mismatch_is_rejected(target):
    model, tok = target
    other, _ = load("tiny-llama")
    other.cfg.vocab_size = 300  # pretend
    with pytest.raises(ValueError, match="vocab mismatch"):
        generate(model, tok, "hi", drafter=DraftModel(other, k=2), max_new_tokens=5)


def test_bad_drafter_settings():
    with pytest.raises(ValueError, match="k must be"):
        DraftModel(load("tiny-gpt2-draft")[0], k=0)
    with pytest.raises(ValueError, match="ngram"):
        PromptLookup(k=2, max_ngram=1, min_ngram=2)


def test_prompt_lookup_finds_the_latest_longest_match():
    pl = PromptLookup(k=3, max_ngram=2)
    assert pl.lookup([1, 2, 3, 9, 1, 2, 4, 5, 1, 2], 3) == [4, 5, 1]  # latest match of [1, 2]
    assert pl.lookup([7, 8, 9], 3) == []
    assert pl.lookup([5, 6, 5], 3) == [6, 5]


def test_tree_mask_positions_and_validation():
    t = Tree([10, 11, 12, 13], [-1, -1, 0, 2])
    assert t.depths() == [1, 1, 2, 3]
    assert t.positions(7).tolist() == [7, 8, 8, 9, 10]
    m = t.mask().int().tolist()
    assert m == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]]
    assert Tree.chain([4, 5, 6]).is_chain and not t.is_chain
    assert torch.equal(Tree.chain([4, 5, 6]).mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    with pytest.raises(ValueError, match="topological"):
        Tree([1, 2], [1, -1])
    with pytest.raises(ValueError, match="parents"):
        Tree([1, 2], [-1])


@pytest.mark.ch01
def test_tree_drafts_go_through_the_loop(target):
    """A hand-made branching drafter: greedy output still equals vanilla, and a sibling can be accepted."""
    model, tok = target

    class TwoBranches(Drafter):
        max_nodes = 4  # deterministic drafts: the trees carry no q, verified as one-hot

        def propose(self, params, budget, generator=None):
            with torch.no_grad():
                top = model(torch.tensor([self.context])).logits[0, -1].topk(2).indices.tolist()
            if budget < 2:
                return Tree([], [])
            # first child wrong on purpose (2nd best), second child right; each with a child of its own
            return Tree([top[1], top[0], top[0], top[1]], [-1, -1, 0, 1])

    vanilla = generate(model, tok, "xyz", max_new_tokens=30)
    spec = generate(model, tok, "xyz", drafter=TwoBranches(), max_new_tokens=30)
    assert spec.tokens == vanilla.tokens
    assert spec.stats.accepted_at_depth[0] > 0  # the second sibling was accepted


def test_an_object_that_is_no_drafter_is_rejected(target):
    model, tok = target

    class NotADrafter:  # duck-typed, without the contract (prefill / propose / commit)
        max_nodes = 2

        def propose(self, params, budget, generator=None):
            return Tree([], [])

    with pytest.raises(TypeError, match="not a minispec Drafter"):
        generate(model, tok, "hi", drafter=NotADrafter(), max_new_tokens=4)
    with pytest.raises(TypeError, match=r"is a name, not a Drafter: pass minispec.methods.Methods\(model\).drafter\('pld'\)"):
        generate(model, tok, "hi", drafter="pld", max_new_tokens=4)
    with pytest.raises(TypeError):  # the contract is an abstract base class: propose is required
        type("NoPropose", (Drafter,), {})()


@pytest.mark.ch01
def test_the_loop_tells_the_drafter_what_it_committed(target):
    """prefill gets prompt + first token, each commit the emitted tokens: together they are the
    output, so a drafter never has to rediscover what was accepted."""
    model, tok = target
    seen = {}

    class Recorder(PromptLookup):
        def prefill(self, tokens, features=None):
            super().prefill(tokens, features)
            seen["prefill"], seen["commits"] = list(tokens), []

        def commit(self, tokens, features=None):
            super().commit(tokens, features)
            seen["commits"].append(list(tokens))

    r = generate(model, tok, "abcabcabc abc", drafter=Recorder(k=4), max_new_tokens=24)
    assert seen["prefill"] == r.prompt_tokens + r.tokens[:1]
    assert seen["prefill"][len(r.prompt_tokens):] + sum(seen["commits"], []) == r.tokens
    assert [len(c) for c in seen["commits"]] == r.stats.tokens_per_step[1:]
