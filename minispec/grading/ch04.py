"""Checks of chapter 4's exercises (solutions/ch04_static_trees.py): static trees and tree masks.

    4.1 choices_to_parents  a choices list -> parents and sibling ranks (plus its errors)
    4.2 tree_mask           [N+1, N+1] ancestor mask, row/column 0 = the root
    4.3 tree_positions      prefix_len + depth, root included
    4.4 retrieve_indices    root-to-leaf paths padded with -1 (Medusa / EAGLE)
    4.5 greedy_verify       the accepted path of a tree under greedy verification
    4.6 best_static_tree    the n-node tree of most expected tokens from per-rank acceptance

Each check runs the learner's function on many seeded random trees (chains, stars, the empty
tree and EAGLE's / Medusa's ``mc_sim_7b_63`` included) and compares with minispec's own
``Tree`` / ``parse_choices`` / ``verify_tree``.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from minispec import verify as vf
from minispec.tree import EAGLE_MC_SIM_7B_63, MEDUSA_MC_SIM_7B_63, Tree, best_static_tree, parse_choices, path_value

from .checks import as_int, exercise, get

TITLE = "Static trees: tree attention mask, positions, paths, choices"
MODULE = "ch04_static_trees"
EXERCISES: list = []


def library():
    """minispec's own functions behind the exercises' signatures (``--impl minispec``)."""

    def tree(parents):
        return Tree([0] * len(parents), list(parents))

    def choices_to_parents(choices):
        ct = parse_choices(choices)
        return ct.parents, ct.ranks

    def greedy_verify(parents, tokens, logits):
        r = vf.verify_tree(Tree(tokens, parents), logits, mode="greedy")
        return r.path, r.next_token

    return SimpleNamespace(
        __name__="minispec.tree (chapter 4 adapter)",
        tree_mask=lambda parents: tree(parents).mask(),
        tree_positions=lambda parents, prefix_len: tree(parents).positions(prefix_len),
        retrieve_indices=lambda parents: tree(parents).retrieve_indices(),
        choices_to_parents=choices_to_parents,
        greedy_verify=greedy_verify,
        best_static_tree=best_static_tree,
    )


# --------------------------------------------------------------------------- test trees
def random_parents(n: int, rng: random.Random, bushy: float = 0.5) -> list[int]:
    """A random tree of n nodes in topological order (bushy: chance to attach near the root)."""
    parents = []
    for i in range(n):
        if i == 0 or rng.random() < bushy * 0.3:
            parents.append(-1)
        elif rng.random() < bushy:
            parents.append(rng.randrange(-1, i))  # anywhere: wide trees
        else:
            parents.append(rng.randrange(max(0, i - 3), i))  # a recent node: deep trees
    return parents


def trees(seed: int = 0, count: int = 60) -> list[tuple[str, list[int]]]:
    """(description, parents) for special shapes, the two mc_sim_7b_63 trees and random trees."""
    out = [("the empty tree", []), ("a single node", [-1]), ("a chain of 5", [-1, 0, 1, 2, 3]),
           ("a star of 4", [-1, -1, -1, -1]), ("a tree [-1, -1, 0, 0, 1, 2]", [-1, -1, 0, 0, 1, 2])]
    out += [("EAGLE's mc_sim_7b_63", parse_choices(EAGLE_MC_SIM_7B_63).parents),
            ("Medusa's mc_sim_7b_63", parse_choices(MEDUSA_MC_SIM_7B_63).parents)]
    rng = random.Random(seed)
    for k in range(count):
        parents = random_parents(rng.randint(2, 40), rng, bushy=rng.random())
        out.append((f"random tree #{k} parents={parents}", parents))
    return out


def _short(desc: str, limit: int = 160) -> str:
    return desc if len(desc) <= limit else desc[:limit] + "...]"


def _tensor(x, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise AssertionError(f"{what} must return a torch.Tensor, got {type(x).__name__}")
    return x


def _same(got: torch.Tensor, want: torch.Tensor, what: str, where: str) -> None:
    if tuple(got.shape) != tuple(want.shape):
        raise AssertionError(f"{what} has shape {tuple(got.shape)}, expected {tuple(want.shape)} for {where}")
    if got.numel() and not torch.equal(got.to(want.dtype), want):
        bad = (got.to(want.dtype) != want).nonzero()[0].tolist()
        raise AssertionError(f"{what}{bad} = {got[tuple(bad)].item()}, expected {want[tuple(bad)].item()} for {where}")


# --------------------------------------------------------------------------- 4.1
def random_choices(rng: random.Random) -> list[tuple[int, ...]]:
    """A random valid choices list, shuffled (ranks among siblings distinct, gaps allowed)."""
    parents = random_parents(rng.randint(1, 30), rng, bushy=rng.random())
    kids: dict[int, list[int]] = {}
    for i, j in enumerate(parents):
        kids.setdefault(j, []).append(i)
    ranks = [0] * len(parents)
    for ks in kids.values():
        for i, r in zip(ks, sorted(rng.sample(range(len(ks) + 2), len(ks)))):
            ranks[i] = r
    cs = Tree([0] * len(parents), parents).to_choices(ranks)
    rng.shuffle(cs)
    return cs


def _choices_output(out, n: int):
    try:
        parents, ranks = out
        parents = [as_int(j, "a parent") for j in parents]
        ranks = [as_int(r, "a rank") for r in ranks]
    except (TypeError, ValueError):
        raise AssertionError(f"choices_to_parents must return (parents, ranks), two lists, got {out!r}") from None
    if len(parents) != n or len(ranks) != n:
        raise AssertionError(f"choices_to_parents returned {len(parents)} parents and {len(ranks)} ranks for {n} choices")
    return parents, ranks


@exercise(EXERCISES, "4.1", "choices_to_parents")
def check_choices_to_parents(impl):
    fn = get(impl, "choices_to_parents")
    rng = random.Random(44)
    cases = [("EAGLE's mc_sim_7b_63", EAGLE_MC_SIM_7B_63), ("Medusa's mc_sim_7b_63", MEDUSA_MC_SIM_7B_63),
             ("[(1,), (0,), (0, 0)]", [(1,), (0,), (0, 0)]), ("[[0], [0, 0], [0, 0, 0]]", [[0], [0, 0], [0, 0, 0]])]
    cases += [(f"choices {cs}", cs) for cs in (random_choices(rng) for _ in range(40))]
    for desc, cs in cases:
        want = parse_choices(cs)
        parents, ranks = _choices_output(fn([list(c) for c in cs]), len(cs))
        where = _short(desc)
        if parents != want.parents:
            i = next(i for i, (a, b) in enumerate(zip(parents, want.parents)) if a != b)
            raise AssertionError(f"parents[{i}] = {parents[i]}, expected {want.parents[i]} (node {i} is choice "
                                 f"{want.choices[i]}; nodes sorted by depth, then lexicographically) for {where}")
        if ranks != want.ranks:
            i = next(i for i, (a, b) in enumerate(zip(ranks, want.ranks)) if a != b)
            raise AssertionError(f"ranks[{i}] = {ranks[i]}, expected {want.ranks[i]} (node {i} is choice "
                                 f"{want.choices[i]}) for {where}")
    bad = [([], "an empty list"), ([(0,), (1, 0)], "a choice whose parent (1,) is missing"),
           ([(0,), (0, 0), (0,)], "a duplicate choice (0,)")]
    for cs, what in bad:
        try:
            fn(cs)
        except ValueError:
            continue
        except Exception as e:
            raise AssertionError(f"choices_to_parents({cs}) raised {type(e).__name__}: {e}; expected ValueError "
                                 f"for {what}") from None
        raise AssertionError(f"choices_to_parents({cs}) returned instead of raising ValueError for {what}")


# --------------------------------------------------------------------------- 4.2 - 4.4
@exercise(EXERCISES, "4.2", "tree_mask")
def check_tree_mask(impl):
    fn = get(impl, "tree_mask")
    for desc, parents in trees(seed=41):
        got = _tensor(fn(list(parents)), "tree_mask")
        if got.dtype != torch.bool:
            raise AssertionError(f"tree_mask must return a bool tensor, got dtype {got.dtype} (use dtype=torch.bool)")
        _same(got, Tree([0] * len(parents), parents).mask(), "mask", _short(desc))


@exercise(EXERCISES, "4.3", "tree_positions")
def check_tree_positions(impl):
    fn = get(impl, "tree_positions")
    for k, (desc, parents) in enumerate(trees(seed=42)):
        prefix = (0, 7, 123)[k % 3]
        got = _tensor(fn(list(parents), prefix), "tree_positions")
        if got.dtype.is_floating_point or got.dtype == torch.bool:
            raise AssertionError(f"tree_positions must return integer positions (torch.long), got dtype {got.dtype}")
        _same(got, Tree([0] * len(parents), parents).positions(prefix), "positions",
              f"{_short(desc)} with prefix_len={prefix}")


@exercise(EXERCISES, "4.4", "retrieve_indices")
def check_retrieve_indices(impl):
    fn = get(impl, "retrieve_indices")
    for desc, parents in trees(seed=43):
        got = _tensor(fn(list(parents)), "retrieve_indices")
        if got.dtype.is_floating_point or got.dtype == torch.bool:
            raise AssertionError(f"retrieve_indices must return node indices (torch.long), got dtype {got.dtype}")
        _same(got, Tree([0] * len(parents), parents).retrieve_indices(), "retrieve_indices", _short(desc))


# --------------------------------------------------------------------------- 4.5
@exercise(EXERCISES, "4.5", "greedy_verify")
def check_greedy_verify(impl):
    fn = get(impl, "greedy_verify")
    g = torch.Generator().manual_seed(45)
    for k, (desc, parents) in enumerate(trees(seed=45, count=40)):
        V = 6 + k % 5
        logits = torch.randn(len(parents) + 1, V, generator=g)  # [N + 1, V]
        tokens = torch.randint(0, V, (len(parents),), generator=g).tolist()
        plant = torch.rand(len(parents), generator=g).tolist()
        for i, j in enumerate(parents):  # plant the target's choice on many nodes, so paths get long
            if plant[i] < 0.6:
                tokens[i] = int(logits[j + 1].argmax())
        want = vf.verify_tree(Tree(tokens, parents), logits, mode="greedy")
        out = fn(list(parents), list(tokens), logits.clone())
        try:
            path, nxt = out
            path = [as_int(i, "a path entry") for i in path]
        except (TypeError, ValueError):
            raise AssertionError(f"greedy_verify must return (path, next_token), got {out!r}") from None
        nxt = as_int(nxt, "next_token")
        if (path, nxt) != (want.path, want.next_token):
            raise AssertionError(f"returned path={path}, next_token={nxt}; expected path={want.path}, "
                                 f"next_token={want.next_token} for {_short(desc)} with tokens={tokens}")


def static_tree_cases() -> list[tuple[list[float], int, int]]:
    """(rank_acc, n, max_depth): measured-looking rates, ties, zeros and ones, chains and stars."""
    rng = random.Random(46)
    cases = [([0.6, 0.15, 0.07, 0.04], 25, 5), ([0.6, 0.15, 0.07, 0.04], 1, 5), ([0.9], 6, 6),
             ([0.5, 0.5], 5, 3), ([0.5, 0.25, 0.5], 7, 3), ([1.0, 0.0, 0.3], 6, 4), ([0.3, 0.3, 0.3], 9, 2), ([0.3, 0.3, 0.3], 3, 1),
             ([0.8, 0.1], 0, 3), ([0.0, 0.0], 4, 2)]
    for _ in range(30):
        k = rng.randint(1, 4)
        acc = sorted((round(rng.random(), 2) for _ in range(k)), reverse=rng.random() < 0.7)
        depth = rng.randint(1, 5)
        total = sum(k ** d for d in range(1, depth + 1))
        cases.append((acc, rng.randint(0, min(total, 40)), depth))
    return cases


@exercise(EXERCISES, "4.6", "best_static_tree")
def check_best_static_tree(impl):
    fn = get(impl, "best_static_tree")
    for acc, n, depth in static_tree_cases():
        want = best_static_tree(acc, n, depth)
        out = fn(list(acc), n, depth)
        try:
            got = [tuple(as_int(r, "a rank") for r in c) for c in out]
        except TypeError:
            raise AssertionError(f"best_static_tree must return a list of choices (tuples of ranks), got {out!r}") from None
        where = f"best_static_tree(rank_acc={acc}, n={n}, max_depth={depth})"
        if len(got) != n or len(set(got)) != n:
            raise AssertionError(f"{where} returned {len(got)} choices ({len(set(got))} distinct); expected {n} distinct")
        for c in got:
            if not c or len(c) > depth or any(not 0 <= r < len(acc) for r in c):
                raise AssertionError(f"{where}: choice {c} is empty, deeper than {depth} or has a rank >= {len(acc)}")
            if len(c) > 1 and c[:-1] not in set(got):
                raise AssertionError(f"{where}: choice {c} is in the tree but its parent {c[:-1]} is not")
        value, best = sum(path_value(c, acc) for c in got), sum(path_value(c, acc) for c in want)
        if value < best - 1e-12:
            raise AssertionError(f"{where}: your tree's expected tokens per step is {1 + value:.6f}, the best "
                                 f"is {1 + best:.6f} (e.g. {_short(str(want))})")
        if got != sorted(got, key=lambda c: (len(c), c)):
            raise AssertionError(f"{where} returned {_short(str(got))}: not in (len, tuple) order")
