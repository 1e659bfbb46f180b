"""Losslessness of every verifier: exact enumeration and empirical sampling checks."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minispec.lab import exactness as ex
from minispec import verify as vf
from minispec.tree import Tree
from minispec.verify import verify_chain, verify_tree

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- the engine
def test_enumerating_chooser_gives_exact_law():
    def program(ch):
        if ch.bernoulli(0.3):
            return ("heads", ch.categorical(torch.tensor([0.0, 2.0, 6.0])))
        return ("tails", ch.categorical(torch.tensor([1.0, 1.0, 0.0])))

    law = ex.outcome_distribution(program)
    want = {("heads", 1): 0.3 * 0.25, ("heads", 2): 0.3 * 0.75, ("tails", 0): 0.35, ("tails", 1): 0.35}
    assert ex.max_abs_error(law, want) < 1e-15
    assert all(w > 0 for w, _ in ex.enumerate_outcomes(program))  # zero-probability branches pruned
    assert len(ex.enumerate_outcomes(lambda ch: ch.bernoulli(1.0))) == 1


def test_sequence_distribution_of_plain_sampling_is_the_target():
    lm = ex.ToyLM(4, "top_k", seed=3)
    step = lambda ctx, ch: (ch.categorical(lm.p(ctx)),)  # noqa: E731 (vanilla decoding)
    law = ex.sequence_distribution(step, 3)
    assert ex.max_abs_error(law, ex.target_distribution(lm, 3)) < 1e-15
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-14)


# ----------------------------------------------------------------------------- the suite
@pytest.fixture(scope="module")
def suite():
    return [ex.run_enumeration_suite(seed) for seed in (0, 1)]


def test_enumeration_suite_every_verifier_exact(suite):
    for records, _ in suite:
        bad = [r for r in records if not r["passed"]]
        assert not bad, bad
        assert max(r["max_abs_error"] for r in records) <= 1e-12
        names = {r["verifier"] for r in records}
        assert set(ex.VERIFIERS) <= names and set(ex.TREE_VERIFIERS) <= names
        settings_seen = {r["setting"].split("/")[0] for r in records}
        assert settings_seen == set(ex.SETTINGS)
        len2 = {r["verifier"] for r in records if r["setting"].endswith("len2")}
        assert {"chain_k1", "chain_k2", "chain_k3", *ex.TREE_VERIFIERS} <= len2


def test_enumeration_controls_fail(suite):
    for _, controls in suite:
        assert {c["verifier"] for c in controls} == set(ex.CONTROLS)
        assert all(not c["passed"] and c["max_abs_error"] > 1e-4 for c in controls), controls
        on_pair = [c for c in controls if c["setting"].startswith("control_pair")]
        assert all(c["max_abs_error"] > 0.1 for c in on_pair), on_pair


def test_enumeration_really_runs_the_library_code(monkeypatch):
    """Break the library's residual (resample from p instead): the chain check must fail."""
    lm = ex.ToyLM(4, "random", seed=5)
    program, greedy = ex.VERIFIERS["chain_k2"]
    assert ex.enumeration_error(program, greedy, lm) <= 1e-12
    monkeypatch.setattr(vf, "residual", lambda p, q: p / p.sum(-1, keepdim=True))
    assert ex.enumeration_error(program, greedy, lm) > 1e-3


@pytest.mark.parametrize("broken, victim", [
    ("_mss_replacement", "mss_no_replacement_n3"),  # with-replacement rule on no-replacement drafts
    ("_mss_no_replacement", "mss_replacement_n3"),  # and the other way round
])
def test_replacement_rules_are_not_interchangeable(monkeypatch, broken, victim):
    lm = ex.ToyLM(5, "random", seed=3)
    program, greedy = ex.VERIFIERS[victim]
    assert ex.enumeration_error(program, greedy, lm) <= 1e-12
    target = victim.rsplit("_", 1)[0]
    monkeypatch.setattr(vf, "_" + target, getattr(vf, broken))
    assert ex.enumeration_error(program, greedy, lm) > 1e-3


def test_tree_rows_off_by_one_is_caught(monkeypatch):
    """Feed verify_tree the rows shifted by one: the 2-token law of a tree must break."""
    real = ex.verify_tree
    def shifted(tree, p, **kw):
        return real(Tree(tree.tokens, tree.parents, tree.q.roll(1, 0)), p.roll(1, 0), **kw)

    def program(lm, c, ch):  # looks verify_tree up at call time, so the patch applies
        return ex.tree_step(lm, c, [2, 1], "mss_replacement", ch, verifier=ex.verify_tree)

    monkeypatch.setattr(ex, "verify_tree", shifted)
    lm = ex.ToyLM(3, "random", seed=8)
    assert ex.enumeration_error(program, False, lm, length=2) > 1e-3
    monkeypatch.setattr(ex, "verify_tree", real)
    assert ex.enumeration_error(program, False, lm, length=2) <= 1e-12


# ----------------------------------------------------------------------------- random p, q
def _dist(draw, V, allow_zero=True):
    w = draw(st.lists(st.sampled_from([0.0, 0.05, 0.3, 1.0, 2.5]) if allow_zero else
                      st.sampled_from([0.05, 0.3, 1.0, 2.5]), min_size=V, max_size=V))
    if sum(w) == 0:
        w[draw(st.integers(0, V - 1))] = 1.0
    t = torch.tensor(w, dtype=torch.float64)
    return t / t.sum()


@st.composite
def pq_pairs(draw):
    V = draw(st.integers(3, 6))
    p = _dist(draw, V)
    kind = draw(st.sampled_from(["independent", "equal", "disjoint"]))
    if kind == "equal":
        q = p.clone()
    elif kind == "disjoint" and (p == 0).any():
        q = (p == 0).double() / (p == 0).sum()
    else:
        q = _dist(draw, V)
    return p, q


@settings(max_examples=40, deadline=None, derandomize=True)
@given(pq_pairs())
def test_every_verifier_exact_on_random_pq(pq):
    """First-token law of each verifier on hypothesis-made (p, q), with zeros, p == q and
    disjoint supports, using the same (p, q) at every context."""
    p, q = pq
    lm = ex.ToyLM(len(p), const=(p, q))
    for name in ("chain_k1", "chain_k2", "tree_chain_k2", "mss_replacement_n2", "mss_replacement_n3",
                 "mss_no_replacement_n2", "mss_no_replacement_n3", "onehot_n2", "onehot_sampled_n2",
                 "greedy_n2", "chain_greedy_k2"):
        program, greedy = ex.VERIFIERS[name]
        assert ex.enumeration_error(program, greedy, lm) <= 1e-12, name


def test_tree_chain_and_verify_chain_have_the_same_outcome_law():
    """Not just the first token: the law of (n accepted, next token) given the drafts."""
    g = torch.Generator().manual_seed(0)
    for trial in range(10):
        k, V = 1 + trial % 3, 4
        p = torch.softmax(torch.randn(k + 1, V, generator=g, dtype=torch.float64), -1)
        q = torch.softmax(torch.randn(k, V, generator=g, dtype=torch.float64), -1)
        drafts = torch.randint(0, V, (k,), generator=g).tolist()
        a = ex.outcome_distribution(lambda ch: verify_chain(drafts, p, q, chooser=ch))
        b = ex.outcome_distribution(lambda ch: (lambda r: (r.num_accepted, r.next_token))(
            verify_tree(Tree.chain(drafts, q), p, mode="chain", chooser=ch)))
        assert ex.max_abs_error(a, b) <= 1e-15
        assert len(a) > 1


# ----------------------------------------------------------------------------- empirical
def test_empirical_suite_passes_and_controls_fail():
    n = 5000
    records, controls = ex.run_empirical_suite(n_samples=n, seed=0, control_samples=5000)
    assert len(records) == 10 and len(controls) == len(ex.CONTROLS)
    assert {"tree21_mss_replacement", "tree21_mss_no_replacement", "tree21_onehot"} <= {r["verifier"] for r in records}
    for r in records:
        assert r["samples"] == n
        assert r["tv"] < ex.tv_bound(n, int(r["setting"].split("/V")[1])), r
        assert r["p_value"] > 1e-4 and r["passed"], r
    for c in controls:
        assert c["tv"] > c["tv_bound"] and c["p_value"] < 1e-4 and not c["passed"], c


def test_empirical_check_edge_cases():
    target = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    r = ex.empirical_check(lambda p, q, g: 2, target, None, 50)  # a forbidden token
    assert r["p_value"] == 0.0 and r["tv"] == pytest.approx(1.0)
    onehot = torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64)
    r = ex.empirical_check(lambda p, q, g: 1, onehot, None, 50)  # a single bin: nothing to test
    assert r["p_value"] == 1.0 and r["tv"] == 0.0
    tiny = torch.tensor([0.97, 0.01, 0.01, 0.005, 0.005], dtype=torch.float64)  # small bins merged
    g = torch.Generator().manual_seed(0)
    r = ex.empirical_check(lambda p, q, g: int(torch.multinomial(p, 1, generator=g)), tiny, None, 300, g)
    assert 1e-4 < r["p_value"] <= 1.0 and sum(r["counts"]) == 300
    assert ex.tv_bound(20000, 6) < ex.tv_bound(5000, 6) < 0.06
    want = 0.5 * math.sqrt(6 / 20000) + math.sqrt(math.log(1e6) / 40000)
    assert ex.tv_bound(20000, 6) == pytest.approx(want)
