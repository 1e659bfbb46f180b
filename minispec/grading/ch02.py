"""Checks of chapter 2's exercises (solutions/ch02_multi_round.py): MSS and tree verification.

    2.1 mss_with_replacement     candidates i.i.d. from q
    2.2 mss_without_replacement  distinct candidates drawn without replacement (recursive rejection sampling)
    2.3 mss_onehot               deterministic candidates (top-k), q treated as one-hot
    2.4 verify_tree              level by level over a draft tree; a chain is the degenerate tree

Each check enumerates every random choice (drafting and verification) exactly and asserts
(a) the emitted token(s) have the target's law and (b) the joint law of the drafts, the accepted
candidate / path and the emitted token equals that of minispec's own ``verify_candidates`` /
``verify_tree`` on the same drafts.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import torch

from minispec.lab import exactness as ex
from minispec import verify as vf

from .checks import as_int, compare_laws, exercise, get, law

TITLE = "Multi-round speculative sampling (MSS) and tree verification"
MODULE = "ch02_multi_round"
EXERCISES: list = []


def library():
    """minispec's own functions behind the exercises' signatures (``--impl minispec``)."""

    def node(mode):
        return lambda candidates, p, q, chooser: vf.verify_candidates(candidates, p, q, mode=mode, chooser=chooser)

    def verify_tree(parents, tokens, p, q, mode, chooser):
        r = vf.verify_tree_lists(parents, tokens, p, q, mode=mode, chooser=chooser)
        return r.path, r.next_token

    return SimpleNamespace(
        __name__="minispec.verify (chapter 2 adapter)",
        mss_with_replacement=node("mss_replacement"),
        mss_without_replacement=node("mss_no_replacement"),
        mss_onehot=lambda candidates, p, chooser: vf.verify_candidates(candidates, p, mode="onehot", chooser=chooser),
        verify_tree=verify_tree,
    )


def _node_output(out, name: str) -> tuple:
    try:
        idx, token = out
    except (TypeError, ValueError):
        raise AssertionError(f"{name} must return (index or None, token), got {out!r}") from None
    return (None if idx is None else as_int(idx, "the accepted index"), as_int(token, "the emitted token"))


def _label(o) -> str:
    xs, idx, tok = o
    return f"candidates={list(xs)}, accepted index={idx}, token={tok}"


def _check_node(name: str, call, ref_mode: str, draw, settings, sizes):
    """Law of (candidates, accepted index, token) for candidates from ``draw(q, n, chooser)``.

    call(xs, p, q, chooser) runs the learner's function; ref_mode names verify_candidates' mode.
    """
    for V, n in sizes:
        for seed, setting in enumerate(settings):
            p, q = ex.make_pair(setting, V, torch.Generator().manual_seed(100 * V + 7 * n + seed))

            def program(fn):
                def run(ch):
                    xs = tuple(draw(q, n, ch))
                    return (xs, *fn(list(xs), p, q, ch))
                return run

            got = law(program(lambda xs, p, q, ch: _node_output(call(xs, p, q, ch), name)))
            where = f"on V={V} with n={n} candidates ({setting!r} pair)"
            token_law = defaultdict(float)
            for (_, _, tok), w in got.items():
                token_law[tok] += w
            target = {i: w for i, w in enumerate(p.tolist()) if w > 0}
            compare_laws(dict(token_law), target, "the emitted token's distribution differs from p", where,
                         label=lambda t: f"token={t}")
            want = law(program(lambda xs, p, q, ch: vf.verify_candidates(xs, p, q, mode=ref_mode, chooser=ch)))
            compare_laws(got, want, "the law of (candidates, accepted index, token) differs from minispec's verify_candidates",
                         where, label=_label)


SETTINGS = ("random", "top_k", "sparse_q", "disjoint", "p_equals_q")


@exercise(EXERCISES, "2.1", "mss_with_replacement")
def check_mss_with_replacement(impl):
    fn = get(impl, "mss_with_replacement")
    draw = lambda q, n, ch: vf.sample_candidates(q, n, replacement=True, chooser=ch)  # noqa: E731
    _check_node("mss_with_replacement", fn, "mss_replacement", draw, SETTINGS, [(4, 2), (3, 3)])


@exercise(EXERCISES, "2.2", "mss_without_replacement")
def check_mss_without_replacement(impl):
    fn = get(impl, "mss_without_replacement")
    draw = lambda q, n, ch: vf.sample_candidates(q, n, replacement=False, chooser=ch)  # noqa: E731
    _check_node("mss_without_replacement", fn, "mss_no_replacement", draw, SETTINGS, [(4, 2), (4, 3)])


@exercise(EXERCISES, "2.3", "mss_onehot")
def check_mss_onehot(impl):
    fn = get(impl, "mss_onehot")
    call = lambda xs, p, q, ch: fn(xs, p, ch)  # noqa: E731  (one-hot q: the real q is not passed)
    topk = lambda q, n, ch: torch.argsort(-q, stable=True)[:n].tolist()  # noqa: E731  deterministic drafts
    _check_node("mss_onehot", call, "onehot", topk, SETTINGS, [(4, 2), (5, 3)])
    fixed = [[0, 1], [2, 2], [3, 0, 1]]  # any candidates chosen without looking at the verifier's coins
    for xs in fixed:
        _check_node("mss_onehot", call, "onehot", lambda q, n, ch, xs=xs: xs, ("random", "top_k"), [(4, len(xs))])


def _tree_law(fn, lm, ctx, branching, mode, draft):
    """Law of (tokens, parents, path, next_token) of one tree step."""

    def run(ch):
        parents, tokens, p, q = ex.draft_tree(lm, ctx, branching, draft, ch)
        out = fn(parents, tokens, p, None if mode == "onehot" else q, mode, ch)
        try:
            path, nxt = out
            path = tuple(as_int(i, "a path entry") for i in path)
        except (TypeError, ValueError):
            raise AssertionError(f"verify_tree must return (path, next_token), got {out!r}") from None
        return tuple(tokens), tuple(parents), path, as_int(nxt, "next_token")

    return law(run)


def _emitted(step_law: dict) -> dict:
    out = defaultdict(float)
    for (tokens, _, path, nxt), w in step_law.items():
        out[tuple(tokens[i] for i in path) + (nxt,)] += w
    return dict(out)


@exercise(EXERCISES, "2.4", "verify_tree")
def check_verify_tree(impl):
    fn = get(impl, "verify_tree")
    ref = library().verify_tree
    cases = [([2, 1], "mss_replacement", 3), ([2, 1], "mss_no_replacement", 3), ([2, 1], "onehot", 3),
             ([1, 1], "mss_replacement", 3), ([3], "mss_no_replacement", 4), ([2, 2], "onehot", 3)]
    for setting in ("random", "top_k"):
        for branching, mode, V in cases:
            lm = ex.ToyLM(V, setting, seed=71)
            draft = ex.DEFAULT_DRAFT[mode]
            shape = "a chain (parents [-1, 0])" if branching == [1, 1] else f"a tree with branching {branching}"
            where = f"on {shape}, mode {mode!r}, V={V} ({setting!r} toy model)"
            memo = {}

            def step_law(ctx):
                if ctx not in memo:
                    memo[ctx] = _tree_law(fn, lm, ctx, branching, mode, draft)
                return memo[ctx]

            seq = ex.sequence_distribution(lambda c, ch: _sample(_emitted(step_law(c)), ch), 2)
            compare_laws(seq, ex.target_distribution(lm, 2), "the law of the first 2 emitted tokens differs from the target's",
                         where, label=lambda s: f"tokens={list(s)}")
            compare_laws(step_law(()), _tree_law(ref, lm, (), branching, mode, draft),
                         "the law of (drafts, accepted path, next token) differs from minispec's verify_tree", where,
                         label=lambda o: f"tokens={list(o[0])}, parents={list(o[1])}, path={list(o[2])}, next={o[3]}")


def _sample(dist: dict, ch):
    """Draw an outcome of ``dist`` with the chooser (lets sequence_distribution reuse a step's exact law)."""
    keys = list(dist)
    return keys[ch.categorical(torch.tensor([dist[k] for k in keys], dtype=torch.float64))]
