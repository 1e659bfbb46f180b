"""Unit tests of minispec.verify: the chapter 1-2 formulas, chain and tree verification."""

import math

import numpy as np
import pytest
import torch

from minispec import verify as vf
from minispec.lab.analysis import acceptance_rate, expected_tokens, speedup
from minispec.sampling import SamplingParams, probs
from minispec.tree import Tree
from minispec.verify import (VerifyResult, accept_prob, residual, sample_candidates, verify_candidates, verify_chain,
                             verify_tree, verify_tree_lists)

torch.set_num_threads(1)


def _t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def _random_pq(V, rows, seed, zeros=False):
    g = torch.Generator().manual_seed(seed)
    p = probs(torch.randn(rows, V, generator=g, dtype=torch.float64), temperature=1.0)
    q = probs(torch.randn(rows, V, generator=g, dtype=torch.float64), temperature=1.0)
    if zeros:  # truncated supports, like top-k
        p = probs(torch.log(p), SamplingParams(1.0, top_k=max(1, V // 2)))
        q = probs(torch.log(q), SamplingParams(1.0, top_k=max(1, V // 2)))
    return p, q


# ----------------------------------------------------------------------------- formulas
def test_accept_prob_scalars_and_zero_q():
    assert accept_prob(0.2, 0.4) == pytest.approx(0.5)
    assert accept_prob(0.4, 0.2) == 1.0
    assert accept_prob(0.3, 0.0) == 1.0  # q(x) = 0: the limit of p/q
    assert accept_prob(0.0, 0.0) == 0.0  # never accept a token p forbids
    assert accept_prob(0.0, 0.5) == 0.0


def test_accept_prob_vectorised():
    p, q = [0.2, 0.4, 0.3, 0.0], [0.4, 0.2, 0.0, 0.0]
    want = [0.5, 1.0, 1.0, 0.0]
    assert torch.allclose(accept_prob(torch.tensor(p), torch.tensor(q)), torch.tensor(want))
    np.testing.assert_allclose(accept_prob(np.array(p), np.array(q)), want)


def test_residual():
    p, q = _t(0.5, 0.3, 0.2), _t(0.2, 0.6, 0.2)
    assert torch.allclose(residual(p, q), _t(1.0, 0.0, 0.0))
    p, q = _t(0.5, 0.25, 0.25), _t(0.25, 0.25, 0.5)
    assert torch.allclose(residual(p, q), _t(1.0, 0.0, 0.0))
    p, q = _t(0.4, 0.4, 0.2), _t(0.1, 0.2, 0.7)
    assert torch.allclose(residual(p, q), _t(0.6, 0.4, 0.0))
    # empty residual (p == q): p itself, per row
    pp = torch.stack([_t(0.2, 0.3, 0.5), _t(0.4, 0.4, 0.2)])
    qq = torch.stack([_t(0.2, 0.3, 0.5), _t(0.1, 0.2, 0.7)])
    assert torch.allclose(residual(pp, qq), torch.stack([_t(0.2, 0.3, 0.5), _t(0.6, 0.4, 0.0)]))


def test_acceptance_rate_is_one_minus_tv():
    p, q = _random_pq(7, 3, 0)
    tv = 0.5 * (p - q).abs().sum(-1)
    assert torch.allclose(acceptance_rate(p, q), 1 - tv)


def test_expected_tokens_and_speedup():
    for a in (0.0, 0.3, 0.8, 0.999):
        for k in (0, 1, 4):
            assert expected_tokens(a, k) == pytest.approx(sum(a ** i for i in range(k + 1)), rel=1e-12)
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(1 - 1e-12, 5) == pytest.approx(6.0, rel=1e-9)  # continuous at 1
    assert isinstance(expected_tokens(0.5, 3), float)
    a, k = np.linspace(0, 1, 11), np.arange(6)[:, None]
    out = expected_tokens(a, k)
    assert out.shape == (6, 11) and np.allclose(out[:, -1], np.arange(6) + 1)
    out_t = expected_tokens(torch.linspace(0, 1, 11), 3)
    assert torch.is_tensor(out_t)
    assert torch.allclose(out_t, torch.as_tensor(expected_tokens(np.linspace(0, 1, 11), 3)))
    assert speedup(0.8, 4, 0.0) == pytest.approx(expected_tokens(0.8, 4))
    assert speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8 ** 5) / (0.2 * 1.2))
    assert speedup(np.array([0.5, 0.9]), 3, 0.1).shape == (2,)
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens(1.5, 2)
    with pytest.raises(ValueError, match="k must"):
        expected_tokens(0.5, -1)
    with pytest.raises(ValueError, match="cost ratio"):
        speedup(0.5, 2, -0.1)


# ----------------------------------------------------------------------------- chain
def test_verify_chain_greedy_is_argmax_matching():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0], [1.0, 0.0, 0.0]])
    assert verify_chain([1, 0, 2], logits, greedy=True) == (3, 0)  # all match, bonus argmax row 3
    assert verify_chain([1, 2, 2], logits, greedy=True) == (1, 0)  # 2nd draft != argmax row 1
    assert verify_chain([0, 0, 2], logits, greedy=True) == (0, 1)
    assert verify_chain([], logits[:1], greedy=True) == (0, 1)


def test_verify_chain_forced_outcomes():
    # p one-hot (temperature 0): whatever the coins, the output is the argmax path
    p = _t(0, 1, 0, 0, 0, 1, 1, 0, 0).view(3, 3)
    q = torch.full((2, 3), 1 / 3, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    assert verify_chain([1, 2], p, q, g) == (2, 0)
    assert verify_chain([1, 0], p, q, g) == (1, 2)
    assert verify_chain([0, 2], p, q, g) == (0, 1)
    # p == q: every draft is accepted
    p, q = _random_pq(5, 4, 1)
    assert verify_chain([3, 1, 4], p, p[:3], g)[0] == 3
    # disjoint supports: the first draft is always rejected, the token comes from p
    p = _t(0.5, 0.5, 0, 0).expand(2, 4)
    q = _t(0, 0, 0.5, 0.5).expand(1, 4)
    for s in range(20):
        n, t = verify_chain([2], p, q, torch.Generator().manual_seed(s))
        assert n == 0 and t in (0, 1)


class _Rejecting:
    """A chooser that rejects every draft and records the distribution the final token is drawn from."""

    def bernoulli(self, prob):
        return False

    def categorical(self, dist):
        self.dist = dist
        return int(dist.argmax())


@pytest.mark.parametrize("mode", ["onehot", "chain", "mss_no_replacement"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rejections_reach_the_residuals_of_the_formulas_in_float64(mode, dtype):
    """A sampled step converts p and q to float64 only at a rejection, and onehot's residual is written
    without building the one-hot row: after rejecting every candidate the final draw is from exactly
    (bit for bit) the residual chain of ``residual`` in float64, from float32 or float64 inputs."""
    p, q = _random_pq(40, 1, 7)
    p, q = p[0].to(dtype), q[0].to(dtype)
    xs = [int(i) for i in torch.topk(q, 4).indices]
    ch = _Rejecting()
    verify_candidates(xs, p, q, mode=mode, chooser=ch)
    want, qq = p.double(), q.double()
    for x in xs:
        if mode == "onehot":
            want = residual(want, torch.nn.functional.one_hot(torch.tensor(x), 40).double())
        else:
            want = residual(want, qq)
            if mode == "mss_no_replacement":
                qq = qq.clone()
                qq[x] = 0
                qq = qq / qq.sum()
    assert ch.dist.dtype == torch.float64 and torch.equal(ch.dist, want)
    one = torch.zeros(40, dtype=dtype)
    one[xs[0]] = 1.0  # all of p's mass on the candidate: residual's empty case keeps p
    ch2 = _Rejecting()
    verify_candidates(xs[:1], one, mode="onehot", chooser=ch2)
    assert torch.equal(ch2.dist.double(), one.double())


@pytest.mark.parametrize("params", [SamplingParams(0.7), SamplingParams(1.0, top_k=5), SamplingParams(1.3, top_p=0.8)])
def test_verify_tree_turns_only_the_visited_rows_of_the_logits_into_p(params, monkeypatch):
    """``verify_tree(..., params=)``, the decode loop's way: p holds the logits, and only the rows the walk
    reaches are turned into probabilities, each equal to its row of ``probs`` over all of them, so the
    same generator gives the same tokens as verifying ``probs(logits)``, on every sampled mode."""
    calls = []
    real = vf.probs
    monkeypatch.setattr(vf, "probs", lambda x, prm: calls.append(x.shape) or real(x, prm))
    g = torch.Generator().manual_seed(3)
    for trial in range(60):
        N = 1 + trial % 6
        parents = [-1] + [int(torch.randint(-1, i, (), generator=g)) for i in range(1, N)]
        logits = 3 * torch.randn(N + 1, 30, generator=g)
        q = probs(torch.randn(N + 1, 30, generator=g), params)
        toks = [int(torch.multinomial(q[j + 1], 1, generator=g)) for j in parents]
        for mode in ("onehot", "chain"):
            tree = Tree(toks, parents, q)
            calls.clear()
            lazy = verify_tree(tree, logits, mode=mode, generator=torch.Generator().manual_seed(trial), params=params)
            assert len(calls) == len(lazy.path) + 1 and all(c == (30,) for c in calls)  # the path's rows, one by one
            full = verify_tree(tree, real(logits, params), mode=mode, generator=torch.Generator().manual_seed(trial),
                               p_from_probs=True)
            assert (lazy.path, lazy.emitted) == (full.path, full.emitted)
    for r in range(4):
        assert torch.equal(real(logits[r], params), real(logits, params)[r])


def test_tree_on_chain_same_outputs_as_verify_chain():
    for seed in range(40):
        k = seed % 4
        V = 3 + seed % 5
        p, q = _random_pq(V, k + 1, seed, zeros=seed % 3 == 0)
        g = torch.Generator().manual_seed(1000 + seed)
        drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(k)]
        mode = "chain" if seed % 2 else "mss_replacement"
        qk = q[:k] if seed % 4 < 2 else q  # q may have N or N+1 rows
        a = verify_chain(drafts, p, q[:k], torch.Generator().manual_seed(seed))
        b = verify_tree(Tree.chain(drafts, qk), p, mode=mode, generator=torch.Generator().manual_seed(seed))
        assert a == (b.num_accepted, b.next_token)
        assert b.path == list(range(a[0])) and b.emitted == drafts[: a[0]] + [a[1]]


def test_greedy_tree_on_chain_equals_argmax_matching():
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        k, V = trial % 5, 4
        logits = torch.randn(k + 1, V, generator=g)
        best = logits.argmax(-1).tolist()
        # drafts match the argmax for a random prefix length, then differ
        m = int(torch.randint(0, k + 1, (), generator=g))
        drafts = [best[i] if i < m else (best[i] + 1) % V for i in range(k)]
        r = verify_tree(Tree.chain(drafts), logits, mode="greedy")
        assert r.path == list(range(m)) and r.next_token == best[m]
        assert verify_chain(drafts, logits, greedy=True) == (m, best[m])


def _onehot_rows(ids, V):
    return torch.nn.functional.one_hot(torch.tensor(ids), V).double()


@pytest.mark.parametrize("mode", ["greedy", "chain", "mss_replacement", "mss_no_replacement", "onehot"])
def test_tree_row_convention(mode):
    """Row 0 is the root's distribution, row i+1 node i's: with one-hot p every mode must walk
    the argmax path and emit the bonus from the deepest accepted node's row."""
    #        root
    #      /  |   \
    #    0:a  1:b  2:c          (p row 0 -> b)
    #    |    |  \
    #   3:a  4:c  5:a           (row 2 = node 1 -> a)
    #         |
    #        6:b                (row 6 = node 5 -> b; row 7 = node 6 -> bonus c)
    parents = [-1, -1, -1, 0, 1, 1, 5]
    tokens = [0, 1, 2, 0, 2, 0, 1]
    V = 3
    # row:     0  1  2  3  4  5  6  7
    argmax = [1, 2, 0, 1, 1, 2, 1, 2]
    p = _onehot_rows(argmax, V)
    q = torch.full((8, V), 1 / 3, dtype=torch.float64)
    for s in range(5):
        r = verify_tree(Tree(tokens, parents, q), p, mode=mode, generator=torch.Generator().manual_seed(s))
        # root -> b (node 1); row 2 -> a (node 5); row 6 -> b (node 6); row 7 -> bonus c
        assert r.path == [1, 5, 6] and r.next_token == 2 and r.emitted == [1, 0, 1, 2]
    # the same tree without node 6: the path stops at node 5 and the bonus comes from row 6
    g = torch.Generator().manual_seed(0)
    r = verify_tree(Tree(tokens[:6], parents[:6], q[:6]), p[:7], mode=mode, generator=g)
    assert r.path == [1, 5] and r.next_token == 1


def test_duplicate_siblings_first_one_wins():
    """Siblings are tried in index order: of two equal children the first is accepted."""
    V = 3
    p = _onehot_rows([1, 2, 0, 2, 0], V)  # root -> token 1
    q = torch.full((5, V), 1 / 3, dtype=torch.float64)
    for mode in ("greedy", "mss_replacement", "onehot"):
        r = verify_tree(Tree([0, 1, 1, 2], [-1, -1, -1, 2], q), p, mode=mode, generator=torch.Generator())
        assert r.path == [1] and r.next_token == 0, mode  # node 1's row 2 -> token 0


def test_verify_candidates_matches_one_level_tree():
    for seed in range(30):
        V, n = 5, 1 + seed % 3
        p, q = _random_pq(V, 1, seed, zeros=seed % 2 == 0)
        mode = ("mss_replacement", "mss_no_replacement", "onehot", "greedy")[seed % 4]
        xs = sample_candidates(q[0], n, replacement=mode != "mss_no_replacement",
                               generator=torch.Generator().manual_seed(seed))
        a = verify_candidates(xs, p[0], q[0], mode=mode, generator=torch.Generator().manual_seed(7))
        pt = torch.cat([p, p.expand(len(xs), V)])  # leaf rows: anything valid
        b = verify_tree(Tree(xs, [-1] * len(xs), q.expand(len(xs), V)), pt, mode=mode,
                        generator=torch.Generator().manual_seed(7))
        assert a == ((b.path[0] if b.path else None), b.emitted[0])


def test_sample_candidates():
    q = _t(0.5, 0.0, 0.3, 0.2, 0.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        xs = sample_candidates(q, 3, replacement=False, generator=g)
        assert sorted(xs) == [0, 2, 3]
        assert len(sample_candidates(q, 5, replacement=False, generator=g)) == 3  # support ran out
        ys = sample_candidates(q, 6, replacement=True, generator=g)
        assert len(ys) == 6 and set(ys) <= {0, 2, 3}
    assert sample_candidates(q, 0, generator=g) == []


def test_never_emits_a_token_outside_supp_p():
    """Even with drafts q says are impossible (q(x) = 0), no mode ever emits p(x) = 0."""
    V = 6
    for seed in range(60):
        g = torch.Generator().manual_seed(seed)
        p = probs(torch.randn(4, V, generator=g, dtype=torch.float64), SamplingParams(1.0, top_k=2))
        q = probs(torch.randn(4, V, generator=g, dtype=torch.float64), SamplingParams(1.0, top_k=2))
        parents, tokens = [-1, -1, 0], torch.randint(0, V, (3,), generator=g).tolist()
        if tokens[0] == tokens[1]:
            tokens[1] = (tokens[1] + 1) % V
        for mode in ("chain", "mss_no_replacement", "onehot"):
            r = verify_tree(Tree(tokens, parents, q), p, mode=mode, generator=g)
            rows = [0] + [i + 1 for i in r.path]
            assert all(p[row, t] > 0 for row, t in zip(rows, r.emitted))
        n, t = verify_chain(tokens[:1], p[:2], q[:1], g)
        assert p[n, t] > 0


def test_verify_result():
    r = VerifyResult([0, 2], 5, [1, 3, 5])
    assert r.num_accepted == 2


# ----------------------------------------------------------------------------- bad inputs
def _ok_tree():
    p, q = _random_pq(4, 4, 0)
    return [-1, 0, 0], [1, 2, 3], p, q


@pytest.mark.parametrize("change, match", [
    (dict(parents=[-1, 1, 0]), r"topological order: parents\[1\] = 1"),
    (dict(parents=[-1, 0, 2]), r"parents\[2\] = 2"),
    (dict(parents=[-2, 0, 0]), r"parents\[0\] = -2"),
    (dict(parents=[-1, 0]), "tree has 3 tokens but 2 parents"),
    (dict(tokens=[1, 2, 4]), r"tokens\[2\] = 4 is outside the vocabulary"),
    (dict(p="short"), "p must have 4 rows"),
    (dict(p="1d"), "p must be a 2-D tensor"),
    (dict(q="short"), "q must have 3 or 4 rows"),
    (dict(q="V"), "q has vocabulary 5 but p has 4"),
    (dict(q=None), "needs the draft distribution q"),
    (dict(mode="typo"), "unknown mode 'typo'"),
    (dict(p="neg"), "negative entries"),
    (dict(p="unnorm"), "rows must sum to 1"),
    (dict(p="nan"), "NaN"),
    (dict(tokens=[1, 2, 2], parents=[-1, -1, -1], mode="mss_no_replacement"), "distinct siblings"),
    (dict(both=True), "either generator or chooser"),
])
def test_verify_tree_bad_inputs(change, match):
    """The list wrapper: the tree's shape is checked by ``Tree``, the rest by ``verify_tree``."""
    parents, tokens, p, q = _ok_tree()
    kw = dict(mode=change.get("mode", "mss_replacement"), generator=torch.Generator())
    parents = change.get("parents", parents)
    tokens = change.get("tokens", tokens)
    bad_p = {"short": p[:3], "1d": p[0], "neg": p - 0.1, "unnorm": p * 2,
             "nan": p.clone().fill_(math.nan)}
    p = bad_p.get(change.get("p"), p)
    if "q" in change:
        q = {"short": q[:2], "V": torch.full((4, 5), 0.2, dtype=torch.float64), None: None}[change["q"]]
    if change.get("both"):
        kw["chooser"] = vf.TorchChooser()
    with pytest.raises(ValueError, match=match):
        verify_tree_lists(parents, tokens, p, q, **kw)


def test_verify_chain_and_candidates_bad_inputs():
    p, q = _random_pq(4, 3, 0)
    with pytest.raises(ValueError, match="p must have 3 rows"):
        verify_chain([1, 2], p[:2], q[:2])
    with pytest.raises(ValueError, match="q must have 2 or 3 rows"):
        verify_chain([1, 2], p, q[:1])
    with pytest.raises(ValueError, match="needs q unless greedy"):
        verify_chain([1, 2], p)
    with pytest.raises(ValueError, match=r"draft_tokens\[1\] = 9"):
        verify_chain([1, 9], p, q[:2])
    with pytest.raises(ValueError, match="draft_tokens must be 1-D"):
        verify_chain(torch.tensor([[1, 2]]), p, q[:2])
    with pytest.raises(ValueError, match="p must be a 1-D tensor"):
        verify_candidates([1], p, q, mode="onehot")
    with pytest.raises(ValueError, match="q must have p's shape"):
        verify_candidates([1], p[0], q, mode="mss_replacement")
    with pytest.raises(ValueError, match="distinct candidates"):
        verify_candidates([1, 1], p[0], q[0], mode="mss_no_replacement")
    with pytest.raises(ValueError, match="unknown mode"):
        verify_candidates([1], p[0], q[0], mode="tree")


def test_verify_tree_on_a_tree_equals_the_list_wrapper():
    """Seeded random trees, every mode: the Tree and the lists give the same result, draw by draw."""
    rng = torch.Generator().manual_seed(11)
    for seed in range(60):
        V, N = 4 + seed % 4, 1 + seed % 7
        parents = [int(torch.randint(-1, i, (), generator=rng)) for i in range(N)]
        p, q = _random_pq(V, N + 1, seed, zeros=seed % 3 == 0)
        mode = ("greedy", "chain", "mss_replacement", "mss_no_replacement", "onehot")[seed % 5]
        tokens = torch.randint(0, V, (N,), generator=rng).tolist()
        if mode == "mss_no_replacement":  # distinct siblings: a node's token is its rank among them
            tokens = [parents[:i].count(j) for i, j in enumerate(parents)]
            if max(tokens) >= V:
                continue
        a = verify_tree(Tree(tokens, parents, q), p, mode=mode, generator=torch.Generator().manual_seed(seed))
        b = verify_tree_lists(parents, tokens, p, q, mode=mode, generator=torch.Generator().manual_seed(seed))
        c = verify_tree_lists(torch.tensor(parents), torch.tensor(tokens), p, q, mode=mode,
                              generator=torch.Generator().manual_seed(seed))
        assert a == b == c, (seed, mode)


def test_verify_tree_checks_the_vocabulary_and_rows_a_tree_cannot_know():
    p, q = _random_pq(4, 4, 0)
    with pytest.raises(ValueError, match=r"tokens\[1\] = 7 is outside the vocabulary"):
        verify_tree(Tree([1, 7, 2], [-1, 0, 0], q), p, mode="chain")
    with pytest.raises(ValueError, match="p must have 3 rows"):
        verify_tree(Tree([1, 2], [-1, 0], q), p, mode="chain")
    with pytest.raises(ValueError, match="needs the draft distribution q"):
        verify_tree(Tree([1, 2, 3], [-1, 0, 0]), p, mode="chain")
