"""Draft trees: tokens + parent indices -> attention mask, positions, paths.

A chain is the tree with parents [-1, 0, 1, ...]; vanilla decoding is the empty tree (only
the root, which is the last committed token). Nodes are in topological order: a node's
parent is -1 (the root) or an earlier node.

The target scores a tree in one forward over T = N + 1 new tokens: the root at index 0 and
node i at index i + 1. Each sees the committed prefix (in the KV cache), its ancestors and
itself; its position is prefix length + depth.

Static trees are given as "choices" (the Medusa / EAGLE-1 format): one tuple per node, the
ranks of the candidates on the way from the root, e.g. (0,) = the root's top-1 child and
(0, 1) = the top-2 child of that node. ``Tree.from_choices`` builds the tree's shape; the
drafter then fills in the tokens (node i takes the ranks[i]-th candidate under its parent).

How a static tree is chosen (``best_static_tree``): if the rank-r candidate under a node is
accepted with probability a_r, whatever the depth, a node whose path from the root takes ranks
(r_1, ..., r_d) is reached and accepted with probability a_{r_1} ... a_{r_d}, and the tree's
expected tokens per step is 1 + the sum of those path products. Every factor is <= 1, so a
child is never worth more than its parent: the best tree of N nodes is built by adding, N times,
the candidate of highest path product whose parent is already in (Medusa's and Sequoia's
construction from measured per-rank acceptance).

References: SpecInfer (Miao et al. 2023) token-tree attention; Medusa (Cai et al. 2024)
static tree choices; EAGLE (Li et al. 2024); Sequoia (Chen et al. 2024) trees from measured
acceptance.
"""

from __future__ import annotations

import heapq
import operator
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

# Static trees, copied verbatim (nested lists as in the sources). Both are named "mc_sim_7b_63"
# upstream but are different trees.
#
# EAGLE-1's default tree: 25 nodes, depth 5. Source: github.com/SafeAILab/EAGLE,
# eagle/model/choices.py, ``mc_sim_7b_63`` (commit 08dc06ccb428f2d3cf8380933ea50ed3e4178168).
EAGLE_MC_SIM_7B_63 = [[0],[1],[2],[3],[0,0],[0,1],[0,2],[1,0],[1,1],[2,0],[2,1],[3,0]
                ,[0,0,0],[0,0,1],[0,0,2],[0,1,0],[0,1,1],[0,2,0],[0,2,1],[1,0,0],
                [0,0,0,0],[0,0,0,1],[0,0,0,2],[0,0,0,0,0],[0,0,0,0,1]]  # fmt: skip

# Medusa's default tree: 63 nodes, depth 4. Source: github.com/FasterDecoding/Medusa,
# medusa/model/medusa_choices.py, ``mc_sim_7b_63`` (commit 11af0aa503437b40d45f5a47c001c43699b7ae52).
MEDUSA_MC_SIM_7B_63 = [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5], [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8], [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2], [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0]]  # fmt: skip


class ChoiceTree(NamedTuple):
    """The shape of a static tree, in node order (by depth, then lexicographically).

    choices: [N] the sorted choices, as tuples; node i is choices[i].
    parents: [N] parent node index of each node (-1 = root).
    ranks: [N] rank of each node among its parent's candidates (= choices[i][-1]): the drafter
        puts the ranks[i]-th most likely token under parents[i] at node i.
    """

    choices: list[tuple[int, ...]]
    parents: list[int]
    ranks: list[int]


def parse_choices(choices: Sequence[Sequence[int]], max_depth: int | None = None) -> ChoiceTree:
    """Turn a static choices list (Medusa / EAGLE format) into parents and sibling ranks.

    Nodes are sorted by depth, then lexicographically (as Medusa and EAGLE do), which puts
    every parent before its children and siblings in increasing rank.

    Args:
        choices: non-empty list of choices; each is a non-empty sequence of ranks >= 0 from the
            root, e.g. [(0,), (1,), (0, 0)]. Every prefix of a choice must be a choice too.
        max_depth: if given, the longest choice may have at most this many ranks.
    Returns:
        ChoiceTree(choices, parents, ranks), all of length N = len(choices).
    Raises:
        ValueError: empty list, empty / negative / non-integer choice, duplicate choice,
            missing prefix, or depth above max_depth.
    """
    if len(choices) == 0:
        raise ValueError("choices is empty: a static tree needs at least one node")
    cs: list[tuple[int, ...]] = []
    for c in choices:
        try:
            t = tuple(operator.index(r) for r in c)
        except TypeError:
            raise ValueError(f"choice {c!r} must be a sequence of integer ranks") from None
        if not t:
            raise ValueError("empty choice (): the root is implicit, list only its descendants")
        if min(t) < 0:
            raise ValueError(f"choice {t} has a negative rank")
        cs.append(t)
    index: dict[tuple[int, ...], int] = {}
    for t in cs:
        if t in index:
            raise ValueError(f"duplicate choice {t}")
        index[t] = -1
    cs.sort(key=lambda t: (len(t), t))
    if max_depth is not None and len(cs[-1]) > max_depth:
        raise ValueError(f"choice {cs[-1]} has depth {len(cs[-1])} > max_depth = {max_depth}")
    parents, ranks = [], []
    for i, t in enumerate(cs):
        if len(t) > 1 and t[:-1] not in index:
            raise ValueError(f"choice {t} has no parent: its prefix {t[:-1]} is not a choice")
        parents.append(index[t[:-1]] if len(t) > 1 else -1)
        ranks.append(t[-1])
        index[t] = i
    return ChoiceTree(cs, parents, ranks)


def path_value(choice: Sequence[int], rank_acc: Sequence[float]) -> float:
    """a_{r_1} ... a_{r_d}: the probability that the node at ranks ``choice`` is reached and accepted."""
    out = 1.0
    for r in choice:
        out *= rank_acc[r]
    return out


def best_static_tree(rank_acc: Sequence[float], n: int, max_depth: int) -> list[tuple[int, ...]]:
    """The n choices (rank paths of depth <= max_depth, ranks < len(rank_acc)) whose expected tokens per
    step, 1 + sum of path_value, is highest; in the order parse_choices puts them (depth, then ranks).

    Greedy by a heap over the frontier: the best candidate whose parent is in the tree is always part
    of an optimal tree, because no node is worth more than its parent. Ties go to the shallower,
    then the lexicographically smaller path.
    """
    if any(not 0 <= a <= 1 for a in rank_acc):
        raise ValueError(f"rank acceptance rates must lie in [0, 1], got {list(rank_acc)}")
    if n < 0 or max_depth < 0 or (n > 0 and (not rank_acc or max_depth == 0)):
        raise ValueError(f"cannot build a tree of {n} nodes with {len(rank_acc)} ranks and depth {max_depth}")
    heap = [(-rank_acc[r], 1, (r,)) for r in range(len(rank_acc))]
    heapq.heapify(heap)
    chosen: list[tuple[int, ...]] = []
    while len(chosen) < n:
        if not heap:
            raise ValueError(f"only {len(chosen)} nodes exist with {len(rank_acc)} ranks and depth {max_depth}")
        neg, d, c = heapq.heappop(heap)
        chosen.append(c)
        if d < max_depth:
            for r in range(len(rank_acc)):
                heapq.heappush(heap, (neg * rank_acc[r], d + 1, c + (r,)))
    return sorted(chosen, key=lambda t: (len(t), t))


@dataclass
class Tree:
    """A draft tree.

    tokens: [N] drafted token ids; parents: [N] parent node index (-1 = root);
    q: optional [N(+1), V] draft distributions by row (row 0 = the root's children were drawn
       from it, row i + 1 = node i's children), None for deterministic drafts.
    """

    tokens: list[int]
    parents: list[int]
    q: torch.Tensor | None = None
    tensors = None  # a tree drafted on the device carries its verify inputs there too (``DraftedTree``)

    def __post_init__(self):
        self.tokens, self.parents = [int(t) for t in self.tokens], [int(j) for j in self.parents]
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"tree has {len(self.tokens)} tokens but {len(self.parents)} parents")
        for i, j in enumerate(self.parents):
            if j == i:
                raise ValueError(f"not a tree in topological order: parents[{i}] = {i}, node {i} is its own parent (a cycle)")
            if not -1 <= j < i:
                raise ValueError(f"not a tree in topological order: parents[{i}] = {j} (must be -1 or < {i}; "
                                 "a parent after its child, a cycle, or an index out of range)")

    def verify_mode(self, greedy: bool) -> str:
        """How ``minispec.verify.verify_tree`` checks this proposal: argmax matching when greedy;
        when sampling, Leviathan/Chen (MSS over siblings) if the drafts were sampled from q (the
        tree holds q), else one-hot q (deterministic drafts). All three are lossless."""
        if greedy:
            return "greedy"
        return "chain" if self.q is not None else "onehot"

    @classmethod
    def chain(cls, tokens: Sequence[int], q: torch.Tensor | None = None) -> "Tree":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), q)

    @classmethod
    def from_choices(cls, choices: Sequence[Sequence[int]], tokens: Sequence[int] | None = None,
                     max_depth: int | None = None) -> "Tree":
        """The static tree of a choices list (see ``parse_choices``).

        Args:
            choices: Medusa / EAGLE choices, e.g. ``EAGLE_MC_SIM_7B_63``; any order.
            tokens: [N] token ids in node order (choices sorted by depth, then
                lexicographically), or None for placeholders 0 that the drafter fills in
                (use ``parse_choices(choices).ranks`` to know which candidate goes where).
            max_depth: if given, raise ValueError when the tree is deeper.
        Returns:
            Tree with N = len(choices) nodes and q = None.
        """
        shape = parse_choices(choices, max_depth)
        n = len(shape.parents)
        tokens = [0] * n if tokens is None else list(tokens)
        if len(tokens) != n:
            raise ValueError(f"{len(tokens)} tokens for {n} choices")
        return cls(tokens, shape.parents)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self.parents) - 1))

    @property
    def depth(self) -> int:
        """Depth of the deepest node (0 for the empty tree)."""
        return max(self.depths(), default=0)

    def depths(self) -> list[int]:
        """Depth of each node (children of the root have depth 1)."""
        d: list[int] = []
        for j in self.parents:
            d.append(1 if j < 0 else d[j] + 1)
        return d

    def check_depth(self, limit: int) -> None:
        """Raise ValueError if some node is deeper than ``limit`` (e.g. the drafter's depth)."""
        if self.depth > limit:
            deepest = self.depths().index(self.depth)
            raise ValueError(f"tree depth {self.depth} (node {deepest}) exceeds the limit {limit}")

    def children(self) -> list[list[int]]:
        """[N + 1] children by row, in index order: row 0 = the root's, row i + 1 = node i's.

        Same convention as the rows of p / q in ``minispec.verify.verify_tree``.
        """
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, j in enumerate(self.parents):
            kids[j + 1].append(i)
        return kids

    def leaves(self) -> list[int]:
        """Nodes without children, in index order."""
        kids = self.children()
        return [i for i in range(len(self)) if not kids[i + 1]]

    def paths(self) -> list[list[int]]:
        """Root-to-leaf paths of node indices (root excluded), one per leaf in index order.

        Each path starts with a child of the root and ends with a leaf; [] for the empty tree.
        """
        out = []
        for leaf in self.leaves():
            path, i = [], leaf
            while i >= 0:
                path.append(i)
                i = self.parents[i]
            out.append(path[::-1])
        return out

    def retrieve_indices(self) -> torch.Tensor:
        """[n_leaves, depth] LongTensor: ``paths()`` padded with -1 (Medusa / EAGLE style).

        Entries are node indices (0..N-1, root excluded); add 1 for rows of logits / mask.
        """
        paths = self.paths()
        out = torch.full((len(paths), self.depth), -1, dtype=torch.long)
        for r, path in enumerate(paths):
            out[r, : len(path)] = torch.tensor(path, dtype=torch.long)
        return out

    def to_choices(self, ranks: Sequence[int] | None = None) -> list[tuple[int, ...]]:
        """[N] the choice tuple of each node, in index order (inverse of ``from_choices``).

        Args:
            ranks: [N] rank of each node among its siblings (e.g. ``parse_choices(...).ranks``);
                None = position among its siblings in index order (0, 1, ...).
        """
        if ranks is None:
            ranks = [0] * len(self)
            for kids in self.children():
                for r, i in enumerate(kids):
                    ranks[i] = r
        if len(ranks) != len(self):
            raise ValueError(f"{len(ranks)} ranks for {len(self)} nodes")
        out: list[tuple[int, ...]] = []
        for i, j in enumerate(self.parents):
            out.append((out[j] if j >= 0 else ()) + (int(ranks[i]),))
        return out

    def positions(self, prefix: int) -> torch.Tensor:
        """[N + 1] position ids of root + nodes: prefix + depth."""
        return torch.tensor([prefix] + [prefix + d for d in self.depths()])

    def mask(self) -> torch.Tensor:
        """[N + 1, N + 1] boolean: entry (a, b) is True when b is a or an ancestor of a (root = 0)."""
        n = len(self) + 1
        m = torch.zeros(n, n, dtype=torch.bool)
        m[:, 0] = True
        for i, j in enumerate(self.parents):
            m[i + 1] = m[j + 1]  # ancestors of the parent (root row when j = -1) ...
            m[i + 1, i + 1] = True  # ... and itself
        return m


class DraftedTree(Tree):
    """A tree drafted on the device (chapter 8, ``minispec.drafters.device_tree``): ``tensors`` holds
    root + tokens, depths and the ancestor mask there, which the decode loop hands to the target's
    verify forward as they are; ``tokens`` and ``parents`` are read back to the host once, on first
    use (the acceptance walk, after the target's forward): one device-to-host copy a step.

    Args:
        tensors: ``device_tree.TreeTensors`` (cloned: the draft's graph overwrites its outputs).
        max_depth: no node is deeper (the draft's levels), so ``check_depth`` needs no host read.
        q: as ``Tree.q`` (None: deterministic drafts).
    """

    def __init__(self, tensors, max_depth: int, q: torch.Tensor | None = None):
        self.tensors = type(tensors)(*(t.clone() for t in tensors))
        self.max_depth, self.q, self._host = max_depth, q, None

    def _lists(self) -> tuple[list[int], list[int]]:
        if self._host is None:
            t = self.tensors
            tokens, parents = torch.stack([t.tokens[1:], t.parents]).tolist()  # [2, N]: the one device-to-host copy
            Tree(tokens, parents)  # checks the shape once, as a host-built tree is checked
            self._host = tokens, parents
        return self._host

    @property
    def tokens(self) -> list[int]:
        return self._lists()[0]

    @property
    def parents(self) -> list[int]:
        return self._lists()[1]

    def __len__(self) -> int:
        return self.tensors.parents.shape[0]  # a shape: no host read

    def check_depth(self, limit: int) -> None:
        if self.max_depth > limit:  # only then are the nodes' depths read
            super().check_depth(limit)
