"""Property tests for minispec.tree: mask, positions, paths, children, static choices."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minispec.tree import (EAGLE_MC_SIM_7B_63, MEDUSA_MC_SIM_7B_63, Tree, parse_choices)

SETTINGS = settings(max_examples=100, deadline=None)


@st.composite
def trees(draw, min_size=0, max_size=24):
    """Random trees in topological order: parents[i] in [-1, i - 1]."""
    n = draw(st.integers(min_size, max_size))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = draw(st.lists(st.integers(0, 99), min_size=n, max_size=n))
    return Tree(tokens, parents)


def ancestors_or_self(parents, i):
    """Brute force: walk up from node i; returns node indices (root = -1 included)."""
    out = {i}
    while i >= 0:
        i = parents[i]
        out.add(i)
    return out


@SETTINGS
@given(trees())
def test_mask_is_ancestor_or_self(t):
    m = t.mask()
    n = len(t)
    assert m.shape == (n + 1, n + 1) and m.dtype == torch.bool
    for a in range(-1, n):  # -1 = root, row a + 1
        anc = ancestors_or_self(t.parents, a) if a >= 0 else {-1}
        for b in range(-1, n):
            assert bool(m[a + 1, b + 1]) == (b in anc), (a, b)


@SETTINGS
@given(trees(), st.integers(0, 1000))
def test_positions_are_prefix_plus_depth(t, prefix):
    depth = [len(ancestors_or_self(t.parents, i)) - 1 for i in range(len(t))]  # edges up to the root
    assert t.depths() == depth
    assert t.positions(prefix).tolist() == [prefix] + [prefix + d for d in depth]
    assert t.depth == max(depth, default=0)


@SETTINGS
@given(trees())
def test_children_match_parents(t):
    kids = t.children()
    assert len(kids) == len(t) + 1
    for row, ks in enumerate(kids):
        assert ks == sorted(ks)
        assert all(t.parents[i] == row - 1 for i in ks)
    assert sorted(i for ks in kids for i in ks) == list(range(len(t)))


@SETTINGS
@given(trees())
def test_paths_and_retrieve_indices_consistent_with_parents(t):
    paths = t.paths()
    has_child = set(j for j in t.parents if j >= 0)
    leaves = [i for i in range(len(t)) if i not in has_child]
    assert [p[-1] for p in paths] == leaves  # every leaf once, in index order
    assert t.leaves() == leaves
    for p in paths:
        assert t.parents[p[0]] == -1  # starts at a child of the root
        assert all(t.parents[b] == a for a, b in zip(p, p[1:]))  # parent -> child
        assert len(p) == t.depths()[p[-1]]
    # every node lies on some path
    assert set(i for p in paths for i in p) == set(range(len(t)))
    ri = t.retrieve_indices()
    assert ri.dtype == torch.long and ri.shape == (len(leaves), t.depth)
    for row, p in zip(ri.tolist(), paths):
        assert row == p + [-1] * (t.depth - len(p))


@SETTINGS
@given(st.lists(st.integers(0, 99), max_size=24), st.integers(0, 100))
def test_chain_gives_chain_results(tokens, prefix):
    t = Tree.chain(tokens)
    n = len(tokens)
    assert t.is_chain
    assert torch.equal(t.mask(), torch.ones(n + 1, n + 1, dtype=torch.bool).tril())
    assert t.positions(prefix).tolist() == list(range(prefix, prefix + n + 1))
    assert t.paths() == ([list(range(n))] if n else [])
    assert t.retrieve_indices().tolist() == ([list(range(n))] if n else [])
    assert t.children() == [[i] for i in range(n)] + [[]]


@SETTINGS
@given(trees(min_size=1))
def test_choices_round_trip(t):
    choices = t.to_choices()
    assert len(set(choices)) == len(t)
    u = Tree.from_choices(choices)
    assert len(u) == len(t) and u.tokens == [0] * len(t)
    assert sorted(u.depths()) == sorted(t.depths())
    assert len(u.paths()) == len(t.paths())
    assert sorted(u.to_choices()) == sorted(choices)
    # node order is by depth then lexicographic, so from_choices is a fixed point
    shape = parse_choices(choices)
    assert u.to_choices(shape.ranks) == shape.choices == sorted(choices, key=lambda c: (len(c), c))
    again = Tree.from_choices(u.to_choices())
    assert again.parents == u.parents
    # shuffled input gives the same tree; tokens are taken in node order
    v = Tree.from_choices(list(reversed(choices)), tokens=range(len(t)))
    assert v.parents == u.parents and v.tokens == list(range(len(t)))


def test_parse_choices_ranks_and_parents():
    shape = parse_choices([[1], [0, 2], [0]])
    assert shape.choices == [(0,), (1,), (0, 2)]
    assert shape.parents == [-1, -1, 0]
    assert shape.ranks == [0, 1, 2]


@pytest.mark.parametrize("choices, n, depth, leaves", [
    (EAGLE_MC_SIM_7B_63, 25, 5, 15),
    (MEDUSA_MC_SIM_7B_63, 63, 4, 42),
])
def test_static_choices_lists(choices, n, depth, leaves):
    t = Tree.from_choices(choices)
    assert len(t) == n and t.depth == depth
    assert t.retrieve_indices().shape == (leaves, depth)
    assert sorted(map(tuple, choices)) == sorted(t.to_choices(parse_choices(choices).ranks))
    t.check_depth(depth)
    with pytest.raises(ValueError, match="exceeds"):
        t.check_depth(depth - 1)


def test_validation_errors():
    with pytest.raises(ValueError, match="topological"):
        Tree([1, 2], [-1, 1])  # own parent
    with pytest.raises(ValueError, match="cycle"):
        Tree([1, 2], [-1, 1])
    with pytest.raises(ValueError, match="parent after its child"):
        Tree([1, 2, 3], [2, -1, -1])
    with pytest.raises(ValueError, match="empty"):
        Tree.from_choices([])
    with pytest.raises(ValueError, match="empty choice"):
        Tree.from_choices([(0,), ()])
    with pytest.raises(ValueError, match=r"duplicate choice \(0, 1\)"):
        Tree.from_choices([(0,), (0, 1), [0, 1]])
    with pytest.raises(ValueError, match=r"prefix \(1,\) is not a choice"):
        Tree.from_choices([(0,), (1, 0)])
    with pytest.raises(ValueError, match=r"prefix \(0, 0\) is not a choice"):
        Tree.from_choices([(0,), (0, 0, 3)])
    with pytest.raises(ValueError, match="negative"):
        Tree.from_choices([(0,), (-1,)])
    with pytest.raises(ValueError, match="integer"):
        Tree.from_choices([(0,), (0.5,)])
    with pytest.raises(ValueError, match="max_depth"):
        Tree.from_choices([(0,), (0, 0), (0, 0, 0)], max_depth=2)
    assert Tree.from_choices([(0,), (0, 0)], max_depth=2).depth == 2
    with pytest.raises(ValueError, match="2 tokens for 3 choices"):
        Tree.from_choices([(0,), (1,), (0, 0)], tokens=[5, 6])
    Tree([], []).check_depth(0)
    with pytest.raises(ValueError, match="exceeds the limit 1"):
        Tree.chain([1, 2]).check_depth(1)


@st.composite
def _levels(draw):
    """A tree given level by level, as TreeDrafter hands it to a drafter: lists of parents (-1 = root)."""
    levels, n = [], 0
    for d in range(draw(st.integers(1, 5))):
        prev = list(range(n - len(levels[-1]), n)) if levels else [-1]
        level = draw(st.lists(st.sampled_from(prev), min_size=1, max_size=4))
        levels.append(level)
        n += len(level)
    return levels


@settings(max_examples=60, deadline=None)
@given(_levels(), st.integers(1, 6))
def test_growing_tree_matches_the_tree_mask(levels, committed):
    """The drafters' incremental builder gives every node the ancestors Tree.mask() gives it, the
    position committed - 1 + depth, and calls it a chain only when it is one."""
    from minispec.drafters.tree_drafter import GrowingTree

    g, parents = GrowingTree(), []
    for level in levels:
        done = len(parents)
        positions, mask = g.add(level, committed)
        parents += level
        assert mask.shape == (len(level), committed + len(parents))
        assert mask[:, :committed].all()  # every node sees the committed context
        full = Tree([0] * len(parents), parents)
        want = full.mask()[1 + done:, 1:]  # new nodes' rows over the nodes, without the root column
        assert torch.equal(mask[:, committed:], want)
        assert positions.tolist() == [committed - 1 + d for d in full.depths()[done:]]
    assert g.is_chain == (parents == list(range(-1, len(parents) - 1)))
    with pytest.raises(ValueError, match="must index"):
        g.add([len(parents)], committed)


def _all_trees(rank_acc, n, max_depth):
    """Every prefix-closed set of n choices (brute force, small spaces only)."""
    import itertools

    nodes = [c for d in range(1, max_depth + 1) for c in itertools.product(range(len(rank_acc)), repeat=d)]
    for subset in itertools.combinations(nodes, n):
        s = set(subset)
        if all(len(c) == 1 or c[:-1] in s for c in subset):
            yield subset


@pytest.mark.parametrize("rank_acc, max_depth", [([0.6, 0.3], 3), ([0.5, 0.5, 0.2], 2), ([0.9, 0.05], 4),
                                                 ([0.2, 0.7], 3)])
def test_best_static_tree_matches_brute_force(rank_acc, max_depth):
    from minispec.tree import best_static_tree, path_value

    total = sum(len(rank_acc) ** d for d in range(1, max_depth + 1))
    for n in range(0, min(total, 7) + 1):
        got = best_static_tree(rank_acc, n, max_depth)
        assert len(set(got)) == n and got == sorted(got, key=lambda c: (len(c), c))
        assert all(len(c) == 1 or c[:-1] in set(got) for c in got)
        best = max(sum(path_value(c, rank_acc) for c in t) for t in _all_trees(rank_acc, n, max_depth))
        assert sum(path_value(c, rank_acc) for c in got) == pytest.approx(best, abs=1e-12)


def test_best_static_tree_rejects_bad_input():
    from minispec.tree import best_static_tree

    with pytest.raises(ValueError, match="must lie in"):
        best_static_tree([1.2, 0.1], 3, 2)
    with pytest.raises(ValueError, match="only 2 nodes"):
        best_static_tree([0.5, 0.1], 3, 1)
    assert best_static_tree([0.5], 0, 3) == []
