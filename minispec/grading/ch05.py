"""Checks of chapter 5's exercises (solutions/ch05_dynamic_trees.py): EAGLE-2 dynamic trees.

    5.1 expand_level            one expansion step: top_k children per frontier node, next frontier
    5.2 rerank                  the total_tokens best candidates, as a connected tree in topological order
    5.3 predicted_tokens_per_s  the dispatcher's cost model: tau / (verify time + draft time)
    5.4 dynamic_tree            a whole EAGLE-2 tree from a toy next-token function

The reference is minispec's own ``TreeDrafter._dynamic`` (minispec/drafters/tree_drafter.py).
It is one method, so the checks reach it through a toy drafter, ``PathDrafter``, whose hooks
return logits from a seeded table indexed by the path below the root. 5.1 and 5.2 are compared
(a) step by step with ``reference_expand_level`` / ``reference_rerank``, the two phases of
``_dynamic`` line for line, and (b) end to end: the learner's function, composed with the
reference of the other phase, must draft exactly the tree ``TreeDrafter`` drafts.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Callable

import torch

from minispec import dispatch
from minispec.drafters import tree_drafter
from minispec.drafters.tree_drafter import TreeDrafter, TreeSpec
from minispec.sampling import GREEDY

from .checks import as_int, exercise, get

TITLE = "Dynamic trees (EAGLE-2): expand, rerank, and the cost model"
MODULE = "ch05_dynamic_trees"
EXERCISES: list = []


# --------------------------------------------------------------------------- toy drafter
class ToyNext:
    """A toy draft model: next-token logits [V] for every path below the root (a tuple of
    tokens), seeded by (seed, path); ``sharpness`` scales them (sharper = more confident)."""

    def __init__(self, V: int = 32, seed: int = 0, sharpness: float = 2.0):
        self.V, self.seed, self.sharpness = V, seed, sharpness
        self.calls = 0
        self._memo: dict[tuple, torch.Tensor] = {}

    def __call__(self, path: tuple) -> torch.Tensor:
        self.calls += 1
        path = tuple(int(t) for t in path)
        if path not in self._memo:
            code = self.seed + 1
            for t in path:
                code = (code * 1_000_003 + t + 1) % (1 << 61)
            g = torch.Generator().manual_seed(code)
            self._memo[path] = self.sharpness * torch.randn(self.V, generator=g)  # [V]
        return self._memo[path].clone()


class PathDrafter(TreeDrafter):
    """TreeDrafter whose hooks read ``next_logits(path)``: minispec's own tree drafting on a toy model."""

    def __init__(self, next_logits: Callable[[tuple], torch.Tensor], tree="4,3,10"):
        super().__init__(tree)
        self.next_logits = next_logits
        self._paths: list[tuple] = []

    def _start(self):
        self._paths = []
        return self.next_logits(())

    def _extend(self, tokens, parents):
        for t, p in zip(tokens, parents):
            self._paths.append((self._paths[p] if p >= 0 else ()) + (int(t),))
        new = self._paths[len(self._paths) - len(tokens):]
        return torch.stack([self.next_logits(path) for path in new])  # [n, V]


def library_dynamic_tree(next_logits, depth: int, top_k: int, total_tokens: int):
    """(tokens, parents) of ``TreeDrafter._dynamic`` on the toy model ``next_logits``."""
    drafter = PathDrafter(next_logits, TreeSpec.dynamic(depth, top_k, total_tokens))
    drafter.prefill([0])  # a context of one token: the root
    tree = drafter.propose(GREEDY, budget=depth)
    return tree.tokens, tree.parents


# --------------------------------------------------------------------------- the two phases of _dynamic
# TreeDrafter._dynamic is built from these two library functions; the checks compare with them.
reference_expand_level = tree_drafter.expand_level
reference_rerank = tree_drafter.rerank


def compose(expand: Callable, rerank: Callable, next_logits, depth: int, top_k: int, total_tokens: int,
            record: list | None = None):
    """An EAGLE-2 tree from an expand_level and a rerank (either the learner's or the reference).

    Level 1 expands the root alone (score 0); level d + 1 expands level d's next frontier.
    ``record`` (if given) receives the candidates (scores, parents, depths) handed to rerank.
    Returns (tokens, parents).
    """
    tok, par, dep, score, path = [], [], [], [], []
    frontier, fscores = [-1], torch.zeros(1)
    for d in range(1, depth + 1):
        logp = torch.stack([torch.log_softmax(next_logits(path[c] if c >= 0 else ()).float(), -1)
                            for c in frontier])  # [F, V]
        s, t, f, nxt = _expand_output(expand(fscores, logp, top_k), len(frontier), top_k)
        new = []
        for sj, tj, fj in zip(s.tolist(), t.tolist(), f.tolist()):
            new.append(len(tok))
            tok.append(tj), par.append(frontier[fj]), dep.append(d), score.append(sj)
            path.append((path[frontier[fj]] if frontier[fj] >= 0 else ()) + (tj,))
        frontier, fscores = [new[j] for j in nxt.tolist()], s[nxt]
    if record is not None:
        record.append((list(score), list(par), list(dep)))
    selected, parents = _rerank_output(rerank(list(score), list(par), list(dep), total_tokens), len(tok))
    return [tok[c] for c in selected], parents


def library():
    """minispec's own functions behind the exercises' signatures (``--impl minispec``).

    5.1 / 5.2 are ``tree_drafter.expand_level`` / ``tree_drafter.rerank``, the two phases of
    ``TreeDrafter._dynamic``; 5.3 is ``dispatch.predicted_tokens_per_s``; 5.4 runs
    ``TreeDrafter._dynamic`` itself on the toy model.
    """
    return SimpleNamespace(
        __name__="minispec.drafters.tree_drafter (chapter 5 adapter)",
        expand_level=reference_expand_level,
        rerank=reference_rerank,
        predicted_tokens_per_s=dispatch.predicted_tokens_per_s,
        dynamic_tree=library_dynamic_tree,
    )


# --------------------------------------------------------------------------- output parsing
def _long(x, what: str) -> torch.Tensor:
    try:
        t = torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError):
        raise AssertionError(f"{what} must be a tensor or a list of ints, got {type(x).__name__}") from None
    if t.dtype.is_floating_point:
        raise AssertionError(f"{what} must hold integers (token ids / indices), got dtype {t.dtype}")
    return t.long().flatten()


def _expand_output(out, F: int, top_k: int):
    try:
        s, t, f, nxt = out
    except (TypeError, ValueError):
        raise AssertionError("expand_level must return (child_scores, child_tokens, child_parent, next_frontier), "
                             f"got {type(out).__name__}") from None
    s = torch.as_tensor(s).flatten()
    t, f, nxt = _long(t, "child_tokens"), _long(f, "child_parent"), _long(nxt, "next_frontier")
    n = F * top_k
    for name, x, want in (("child_scores", s, n), ("child_tokens", t, n), ("child_parent", f, n),
                          ("next_frontier", nxt, min(top_k, n))):
        if x.numel() != want:
            raise AssertionError(f"{name} has {x.numel()} entries, expected {want} (F={F} frontier nodes, "
                                 f"top_k={top_k})")
    return s, t, f, nxt


def _rerank_output(out, M: int):
    try:
        selected, parents = out
        selected = [as_int(c, "a selected candidate id") for c in selected]
        parents = [as_int(j, "a parent") for j in parents]
    except (TypeError, ValueError):
        raise AssertionError(f"rerank must return (selected, parents), two lists of ints, got {out!r}") from None
    if len(selected) != len(parents):
        raise AssertionError(f"rerank returned {len(selected)} selected candidates but {len(parents)} parents")
    if any(not 0 <= c < M for c in selected):
        raise AssertionError(f"rerank selected candidate ids outside 0..{M - 1}: {selected}")
    return selected, parents


# --------------------------------------------------------------------------- cases
TREES = [(1, 3, 3), (2, 2, 6), (3, 4, 9), (4, 3, 10), (5, 4, 16), (6, 6, 30)]  # (depth, top_k, total_tokens)


def _toys(n: int = 4):
    for k in range(n):
        yield ToyNext(V=24 + 8 * (k % 2), seed=500 + k, sharpness=(1.0, 2.5, 4.0, 1.7)[k % 4])


def _end_to_end(expand, rr, what: str) -> None:
    for toy in _toys():
        for depth, top_k, total in TREES:
            want = library_dynamic_tree(toy, depth, top_k, total)
            got = compose(expand, rr, toy, depth, top_k, total)
            if got != want:
                raise AssertionError(
                    f"{what} does not draft TreeDrafter's tree for depth={depth}, top_k={top_k}, total_tokens={total} "
                    f"(toy model seed {toy.seed}, V={toy.V}): got tokens={got[0]}, parents={got[1]}; "
                    f"expected tokens={want[0]}, parents={want[1]}")


@exercise(EXERCISES, "5.1", "expand_level")
def check_expand_level(impl):
    fn = get(impl, "expand_level")
    g = torch.Generator().manual_seed(51)
    for F, V, top_k in [(1, 8, 3), (3, 8, 2), (4, 20, 4), (2, 20, 1), (5, 12, 3), (4, 16, 6)]:
        fs = -3 * torch.rand(F, generator=g)  # [F] path scores (log-probabilities)
        logp = torch.log_softmax(2 * torch.randn(F, V, generator=g), -1)  # [F, V]
        s, t, f, nxt = _expand_output(fn(fs.clone(), logp.clone(), top_k), F, top_k)
        ws, wt, wf, wn = reference_expand_level(fs, logp, top_k)
        where = f"for F={F} frontier nodes, V={V}, top_k={top_k}"
        if not torch.equal(t, wt):
            raise AssertionError(f"child_tokens = {t.tolist()}, expected {wt.tolist()} {where} (each row's top_k, best first)")
        if not torch.equal(f, wf):
            raise AssertionError(f"child_parent = {f.tolist()}, expected {wf.tolist()} {where}")
        err = (s.double() - ws.double()).abs().max().item()
        if not err <= 1e-5:
            raise AssertionError(f"child_scores differ from parent score + log q by {err:.3g} {where}: "
                                 f"got {[round(x, 4) for x in s.tolist()]}, expected {[round(x, 4) for x in ws.tolist()]}")
        if not torch.equal(nxt, wn):
            raise AssertionError(f"next_frontier = {nxt.tolist()}, expected {wn.tolist()} {where} (the top_k best "
                                 "children of the whole level, best first, as indices into the children)")
    _end_to_end(fn, reference_rerank, "expand_level (with the reference rerank)")


@exercise(EXERCISES, "5.2", "rerank")
def check_rerank(impl):
    fn = get(impl, "rerank")
    # a tie: node 2 is node 0's child with log q = 0, so it has its parent's score; the parent must win
    tie = ([-0.5, -1.0, -0.5, -1.2, -3.0], [-1, -1, 0, 1, 0], [1, 1, 2, 2, 2])
    cases = [(tie, n, "hand-made candidates with a child as likely as its parent") for n in (1, 2, 3, 5)]
    for toy in _toys():
        for depth, top_k, total in TREES:
            rec: list = []
            compose(reference_expand_level, reference_rerank, toy, depth, top_k, total, record=rec)
            cases.append((rec[0], total, f"the candidates of depth={depth}, top_k={top_k} (toy seed {toy.seed})"))
    for (scores, par, dep), n, where in cases:
        got = _rerank_output(fn(list(scores), list(par), list(dep), n), len(scores))
        want = reference_rerank(scores, par, dep, n)
        if got != want:
            raise AssertionError(f"rerank(total_tokens={n}) returned selected={got[0]}, parents={got[1]}; expected "
                                 f"selected={want[0]}, parents={want[1]} on {where}: scores="
                                 f"{[round(s, 3) for s in scores][:12]}..., parents_cand={list(par)[:12]}...")
    _end_to_end(reference_expand_level, fn, "rerank (with the reference expand_level)")


@exercise(EXERCISES, "5.3", "predicted_tokens_per_s")
def check_predicted_tokens_per_s(impl):
    fn = get(impl, "predicted_tokens_per_s")
    for tau, verify_s, draft_s in [(1.0, 0.02, 0.0), (3.2, 0.03, 0.01), (4.5, 0.05, 0.025), (2.0, 1.5, 0.5)]:
        got = float(fn(tau, verify_s, draft_s))
        want = tau / (verify_s + draft_s)
        if not math.isclose(got, want, rel_tol=1e-9):
            raise AssertionError(f"predicted_tokens_per_s(tau={tau}, verify_s={verify_s}, draft_s={draft_s}) = "
                                 f"{got:.6g}, expected {want:.6g} tokens/s")
    tau = torch.tensor([1.0, 2.5, 3.5], dtype=torch.float64)
    verify_s = torch.tensor([0.020, 0.024, 0.040], dtype=torch.float64)
    draft_s = torch.tensor([0.0, 0.010, 0.015], dtype=torch.float64)
    got = torch.as_tensor(fn(tau, verify_s, draft_s))
    if tuple(got.shape) != (3,) or not torch.allclose(got.double(), tau / (verify_s + draft_s)):
        raise AssertionError(f"on tensors (one entry per tree shape) got {got.tolist()}, expected "
                             f"{(tau / (verify_s + draft_s)).tolist()}")


@exercise(EXERCISES, "5.4", "dynamic_tree")
def check_dynamic_tree(impl):
    fn = get(impl, "dynamic_tree")
    for toy in _toys():
        for depth, top_k, total in TREES:
            want = library_dynamic_tree(toy, depth, top_k, total)
            out = fn(toy, depth, top_k, total)
            try:
                tokens, parents = out
                got = ([as_int(t, "a token") for t in tokens], [as_int(j, "a parent") for j in parents])
            except (TypeError, ValueError):
                raise AssertionError(f"dynamic_tree must return (tokens, parents), got {out!r}") from None
            if got != want:
                raise AssertionError(
                    f"dynamic_tree(depth={depth}, top_k={top_k}, total_tokens={total}) on the toy model seed {toy.seed} "
                    f"(V={toy.V}) returned tokens={got[0]}, parents={got[1]}; TreeDrafter drafts tokens={want[0]}, "
                    f"parents={want[1]}")
