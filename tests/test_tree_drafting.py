"""Tree drafting (chapters 4-5): static choices and EAGLE-2 dynamic trees through the one decode loop."""

import pytest
import torch
from lawcheck import assert_same_law, exact_law, sample_law

from minispec import generate, load
from minispec.drafters import DraftModel, TreeSpec
from minispec.sampling import GREEDY

PROMPTS = ["Hello world, hello world, hello", "abcabcabcabc", "def f(x):\n    return x", "1, 2, 3, 4, 5, 6"]
TREES = ["eagle", "medusa", "4,3,10", "5,4,16", "chain:3"]


@pytest.fixture(scope="module")
def target():
    return load("tiny-llama")


@pytest.fixture(scope="module")
def noisy():
    """A noisy copy of the target (q close to p): drafts are often accepted."""
    d = load("tiny-llama")[0]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        d.lm_head.weight.add_(0.02 * torch.randn(d.lm_head.weight.shape, generator=g))
    return d


def test_tree_spec_parsing_and_errors():
    assert TreeSpec.parse("chain:5") == TreeSpec.chain(5) == TreeSpec.parse(5)
    eagle = TreeSpec.parse("eagle")
    assert (eagle.kind, eagle.depth, eagle.max_nodes) == ("static", 5, 25)
    assert TreeSpec.parse("medusa").max_nodes == 63 and TreeSpec.parse("medusa").depth == 4
    dyn = TreeSpec.parse("6,10,60")
    assert (dyn.kind, dyn.depth, dyn.top_k, dyn.total_tokens) == ("dynamic", 6, 10, 60)
    assert TreeSpec.parse("dynamic:6,10,60") == dyn
    for bad, msg in [("oak", "unknown tree"), ("chain:0", "positive"), ("0,3,4", ">= 1"), ("2,2,99", "exceeds")]:
        with pytest.raises(ValueError, match=msg):
            TreeSpec.parse(bad)
    with pytest.raises(ValueError, match="prefix"):
        TreeSpec.static([[0], [1, 0]])  # (1,) is missing: not a tree


@pytest.mark.ch04
@pytest.mark.ch05
@pytest.mark.parametrize("tree", TREES)
def test_tree_draft_logits_equal_sequential_logits(target, noisy, tree):
    """Level-by-level drafting with the tree mask gives each node the draft logits of its own path."""
    model, tok = target
    dm = DraftModel(noisy, tree=tree)
    ctx = tok.encode("The tree mask at work")
    dm.prefill(ctx)
    seen = {}
    orig = dm._extend

    def spy(tokens, parents):
        out = orig(tokens, parents)
        base = len(spy.paths)
        for j, (t, p) in enumerate(zip(tokens, parents)):
            spy.paths.append((spy.paths[p] if p >= 0 else []) + [t])
            seen[tuple(spy.paths[base + j])] = out[j]
        return out
    spy.paths = []
    dm._extend = spy
    t = dm.propose(GREEDY, budget=10)
    assert len(t) == dm.max_nodes if TreeSpec.parse(tree).kind != "dynamic" else len(t) == TreeSpec.parse(tree).total_tokens
    assert seen, "no node was extended"
    with torch.no_grad():
        for path, logits in seen.items():
            ref = noisy(torch.tensor([ctx + list(path)])).logits[0, -1]
            torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    # the drafter's cache holds the context again (a tree is rolled back, a chain kept)
    assert dm.kv.length == len(dm.cached) and dm.cached[:len(ctx)] == ctx


@pytest.mark.ch04
@pytest.mark.ch05
@pytest.mark.parametrize("tree", TREES)
def test_greedy_tree_decoding_equals_vanilla(target, noisy, tree):
    model, tok = target
    for prompt in PROMPTS:
        vanilla = generate(model, tok, prompt, max_new_tokens=60)
        spec = generate(model, tok, prompt, drafter=DraftModel(noisy, tree=tree), max_new_tokens=60)
        assert spec.tokens == vanilla.tokens
        assert spec.stats.target_forwards < vanilla.stats.target_forwards  # the noisy copy is often right


@pytest.mark.ch04
def test_self_draft_static_tree_accepts_the_whole_depth(target):
    """The target as its own draft: the top-1 path of the EAGLE tree is always right, tau = depth + 1."""
    model, tok = target
    r = generate(model, tok, "abc", drafter=DraftModel(model, tree="eagle"), max_new_tokens=61)
    assert r.stats.acceptance_by_position == [1.0] * 5
    assert r.stats.tokens_per_step[1:] == [6] * 10


@pytest.mark.ch05
def test_dynamic_tree_equals_a_brute_force_eagle2(target, noisy):
    """EAGLE-2 recomputed path by path with full forwards: expand the top_k best of each level,
    top_k children each, then keep the total_tokens best-scoring candidates of all levels."""
    model, tok = target
    depth, K, N = 3, 4, 9
    dm = DraftModel(noisy, tree=f"{depth},{K},{N}")
    ctx = tok.encode("scores")
    dm.prefill(ctx)
    t = dm.propose(GREEDY, budget=10)
    got = set()
    for p_idx in t.paths():
        for d in range(len(p_idx)):
            got.add(tuple(t.tokens[i] for i in p_idx[: d + 1]))
    with torch.no_grad():
        def logp(path):
            return torch.log_softmax(noisy(torch.tensor([ctx + list(path)])).logits[0, -1].double(), -1)
        cands = {}  # path -> score
        frontier = [()]
        for d in range(depth):
            level = {}
            for path in frontier:
                lp = logp(path)
                for x in lp.topk(K).indices.tolist():
                    level[path + (x,)] = cands.get(path, 0.0) + float(lp[x])
            cands.update(level)
            frontier = sorted(level, key=lambda c: -level[c])[:K]
    want = set(sorted(cands, key=lambda c: (-cands[c], len(c)))[:N])
    assert len(t) == N and got == want


@pytest.mark.ch04
@pytest.mark.ch05
@pytest.mark.parametrize("tree", [TreeSpec.parse("2,2,3"), TreeSpec.static([[0], [1], [0, 0]])], ids=["dynamic", "static"])
def test_sampled_tree_decoding_has_the_target_law(target, tree):
    """Trees hold deterministic top-k drafts, verified as one-hot q: the first three tokens
    (top-k 3 sampling: 27 outcomes) follow the target's exact joint law. The target drafts for
    itself: its top-k children are accepted often but not always (p is not one-hot)."""
    model, tok = target
    params = dict(temperature=0.7, top_k=3)
    ids = tok.encode("aaaa")
    exact = exact_law(model, ids, params)
    law = sample_law(model, tok, ids, lambda: DraftModel(model, tree=tree), exact, 1000, params)
    assert law.n / 3 < law.accepted < law.tested  # drafts were accepted, so the one-hot verification mattered
    assert_same_law(law, exact)


def test_a_drafter_breaking_its_limits_gets_a_clear_error(target):
    from minispec.drafters import Drafter
    from minispec.tree import Tree

    model, tok = target

    class Greedy(Drafter):
        def __init__(self, tree, max_nodes):
            self.tree, self.max_nodes = tree, max_nodes

        def propose(self, params, budget, generator=None):
            return self.tree

    with pytest.raises(ValueError, match="max_nodes=2"):
        generate(model, tok, "hi", drafter=Greedy(Tree([1, 2, 3], [-1, -1, -1]), 2), max_new_tokens=8)
    with pytest.raises(ValueError, match="exceeds the limit 2"):  # 4 tokens wanted: budget 2 after the first
        generate(model, tok, "hi", drafter=Greedy(Tree.chain([1, 2, 3]), 3), max_new_tokens=4)
