"""Checks of chapter 5's exercises (solutions/ch05_dynamic_trees.py): EAGLE-2 dynamic trees.

    5.1 expand_level    one expansion step: top_k children per frontier node, next frontier
    5.2 rerank          the total_tokens best candidates, as a connected tree in topological order
    5.3 dynamic_tree    a whole EAGLE-2 tree from a toy next-token function
    5.4 best_tree_size  the number of nodes with the best predicted tokens/s, from the candidates'
                        path products, a verify-time curve and a draft time

The reference of 5.1-5.3 is minispec's own ``TreeDrafter._dynamic`` (minispec/drafters/tree_drafter.py).
It is one method, so the checks reach it through a toy drafter, ``PathDrafter``, whose hooks
return logits from a seeded table indexed by the path below the root. 5.1 and 5.2 are compared
(a) step by step with ``reference_expand_level`` / ``reference_rerank``, the two phases of
``_dynamic`` line for line, and (b) end to end: the learner's function, composed with the
reference of the other phase, must draft exactly the tree ``TreeDrafter`` drafts. 5.4 is compared
with a brute force: for every n, the best E[tau] over every subset of n candidates, divided by the
step time (``auto.predicted_tokens_per_s``), on hand-made cases (ties, vanilla winning, a
budget above the number of candidates) and on the candidates of real toy-model expansions.
"""

from __future__ import annotations

import itertools
import math
import random
from types import SimpleNamespace
from typing import Callable

import torch

from minispec import auto
from minispec.drafters import tree_drafter
from minispec.drafters.tree_drafter import TreeDrafter, TreeSpec
from minispec.sampling import GREEDY

from .checks import _where, as_int, exercise, get

TITLE = "Dynamic trees (EAGLE-2): expand, rerank, and the tree size that pays"
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


def library_best_tree_size(path_probs, verify_s, draft_s: float, max_nodes: int):
    """5.4 with the library's cost model: E[tau](n) of the n best candidates, priced by
    ``auto.predicted_tokens_per_s`` for every n at once (torch.argmax: the first best n)."""
    m = min(max_nodes, len(path_probs))
    top = torch.sort(torch.tensor(list(path_probs), dtype=torch.float64), descending=True).values[:m]
    tau = torch.cat([torch.ones(1, dtype=torch.float64), 1 + torch.cumsum(top, 0)])  # [m + 1]
    verify = torch.tensor(list(verify_s)[:m + 1], dtype=torch.float64)  # [m + 1]
    draft = torch.full((m + 1,), float(draft_s), dtype=torch.float64)
    draft[0] = 0.0  # vanilla drafts nothing
    speed = auto.predicted_tokens_per_s(tau, verify, draft)
    n = int(torch.argmax(speed))
    return n, float(speed[n])


def library():
    """minispec's own functions behind the exercises' signatures (``--impl minispec``).

    5.1 / 5.2 are ``tree_drafter.expand_level`` / ``tree_drafter.rerank``, the two phases of
    ``TreeDrafter._dynamic``; 5.3 runs ``TreeDrafter._dynamic`` itself on the toy model; 5.4
    prices every size with ``auto.predicted_tokens_per_s``.
    """
    return SimpleNamespace(
        __name__="minispec.drafters.tree_drafter (chapter 5 adapter)",
        expand_level=reference_expand_level,
        rerank=reference_rerank,
        dynamic_tree=library_dynamic_tree,
        best_tree_size=library_best_tree_size,
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


@exercise(EXERCISES, "5.3", "dynamic_tree")
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


# --------------------------------------------------------------------------- 5.4: the tree size that pays
def brute_force_speeds(path_probs, verify_s, draft_s: float, max_nodes: int) -> list[float]:
    """Predicted tokens/s of the best tree of n nodes, n = 0..min(max_nodes, M): the largest
    E[tau] = 1 + sum over any n of the candidates (every subset tried, exact sums), over the time
    of a step (no drafting for n = 0)."""
    speeds = [auto.predicted_tokens_per_s(1.0, verify_s[0], 0.0)]
    for n in range(1, min(max_nodes, len(path_probs)) + 1):
        tau = max(math.fsum((1.0, *subset)) for subset in itertools.combinations(path_probs, n))
        speeds.append(auto.predicted_tokens_per_s(tau, verify_s[n], draft_s))
    return speeds


def _best_tree_cases():
    """(path_probs, verify_s, draft_s, max_nodes, what) cases for 5.4."""
    # hand-made; the ties use dyadic numbers, so every order of summation gives the same bits
    yield [], [0.02], 0.01, 0, "no candidates at all"
    yield [0.6, 0.3], [0.02, 0.021, 0.022], 0.004, 0, "a budget of 0 nodes"
    yield [0.3, 0.1, 0.2], [0.02, 0.021, 0.022, 0.023], 0.02, 3, "drafting dearer than it gains: vanilla wins"
    yield [0.125, 0.5, 0.25], [1.0, 1.5, 1.75, 2.0], 0.0, 3, "vanilla tied with 1 and 2 nodes"
    yield [0.25, 0.75, 0.5], [0.625, 0.625, 0.875, 1.125], 0.25, 3, "1 and 2 nodes tied, both above vanilla"
    yield [0.5, 0.0], [1.0, 1.0, 1.0], 0.0, 2, "a candidate of product 0 on a flat curve"
    yield [0.9, 0.8, 0.7, 0.6], [0.02] * 5, 0.001, 4, "a flat verify curve: every node pays"
    yield [0.9, 0.8, 0.7, 0.6], [0.02] * 5, 0.001, 2, "a budget below the number of candidates"
    yield [0.05, 0.6, 0.4], [0.02 * (1 + n / 8) for n in range(9)], 0.003, 8, \
        "a budget above the number of candidates (curve measured further)"
    yield [0.1, 0.05, 0.9, 0.3, 0.85, 0.02], [0.02 * (1 + n / 5) for n in range(10)], 0.002, 6, \
        "a rising curve (a CPU): the best n is in the middle"
    # the candidates of real expansions of the toy models (their path products), on random curves
    rng = random.Random(54)
    real = []
    for toy in _toys():
        for depth, top_k, total in [(1, 3, 3), (2, 2, 6), (3, 2, 10), (2, 3, 12)]:
            rec: list = []
            compose(reference_expand_level, reference_rerank, toy, depth, top_k, total, record=rec)
            probs = [math.exp(x) for x in rec[0][0]]
            rng.shuffle(probs)  # any order
            real.append((probs, f"the candidates of a toy expansion depth={depth}, top_k={top_k} (seed {toy.seed})"))
    for k in range(60):
        if k < len(real):
            probs, what = real[k]
        else:
            probs = [rng.random() ** rng.choice([1, 2, 4]) for _ in range(rng.randint(1, 10))]
            what = "random candidates"
        max_nodes = rng.randint(0, len(probs) + 2)
        base = rng.uniform(0.005, 0.05)
        knee, slope = rng.randint(0, 12), rng.choice([0.0, 0.01, 0.05, 0.2])
        verify = [base * (1 + rng.uniform(0, 0.02) + slope * max(0, n - knee)) for n in range(max_nodes + 1)]
        verify = [max(verify[:n + 1]) for n in range(len(verify))]  # non-decreasing, as the dispatcher makes it
        draft = rng.choice([0.0, rng.uniform(0, 0.5) * base, rng.uniform(0.5, 2) * base])
        speeds = brute_force_speeds(probs, verify, draft, max_nodes)
        top2 = sorted(speeds, reverse=True)[:2]
        if len(top2) == 2 and top2[0] - top2[1] <= 1e-7 * top2[0]:
            continue  # a near tie decided by rounding: not a fair case
        yield probs, verify, draft, max_nodes, what


@exercise(EXERCISES, "5.4", "best_tree_size")
def check_best_tree_size(impl):
    fn = get(impl, "best_tree_size")
    for probs, verify, draft, max_nodes, what in _best_tree_cases():
        speeds = brute_force_speeds(probs, verify, draft, max_nodes)
        want = speeds.index(max(speeds))  # the first best: the smallest n on a tie
        args = (list(probs), list(verify), draft, max_nodes)
        call = (f"best_tree_size(path_probs={[round(p, 4) for p in probs]}, verify_s="
                f"{[round(v, 5) for v in verify]}, draft_s={draft:.4g}, max_nodes={max_nodes}) ({what})")
        try:
            out = fn(*args)
        except NotImplementedError:
            raise
        except Exception as e:
            raise AssertionError(f"{call} raised {type(e).__name__}: {e}{_where(e)}") from e
        if args != (list(probs), list(verify), draft, max_nodes):
            raise AssertionError(f"{call} modified its arguments (sort a copy instead)")
        try:
            n, tps = out
            n, tps = as_int(n, "n"), float(tps)
        except (TypeError, ValueError):
            raise AssertionError(f"{call} must return (n, tokens_per_s), got {out!r}") from None
        table = ", ".join(f"n={i}: {s:.4g}" for i, s in enumerate(speeds))
        if n != want:
            raise AssertionError(f"{call} returned n={n}, expected n={want} ({speeds[want]:.6g} tokens/s; on a tie "
                                 f"the smallest n). Predicted tokens/s of the best tree of each size: {table}")
        if not math.isclose(tps, speeds[want], rel_tol=1e-6):
            raise AssertionError(f"{call} returned n={n} (right) with tokens_per_s={tps:.6g}, expected "
                                 f"{speeds[want]:.6g}. Predicted tokens/s of the best tree of each size: {table}")
