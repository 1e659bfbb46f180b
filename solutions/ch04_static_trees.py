"""Chapter 4 exercises: static draft trees, the tree attention mask, positions and paths.

References:
    Miao et al., "SpecInfer" (2023): token-tree attention, one target forward for a whole tree.
    Cai et al., "Medusa" (2024) and Li et al., "EAGLE" (2024): static trees given as "choices"
        (``mc_sim_7b_63``) and ``retrieve_indices`` (the root-to-leaf paths, padded with -1).

Layout (the same everywhere in minispec, see ``minispec.tree``): a tree of N nodes is given by
``parents`` [N], in topological order: parents[i] is -1 (a child of the root, the last committed
token) or an earlier node index < i. The target scores the tree in one forward over N + 1 new
tokens: the root at row 0 and node i at row i + 1 ("row = node + 1").

Check your work: ``python -m minispec grade 4``, or ``minispec.grading.check("4.1")``, or
``pytest tests/test_exercises.py -m ch04 --impl exercises``.
"""

from __future__ import annotations

from typing import Sequence

import torch


def choices_to_parents(choices: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Turn a static tree's choices (Medusa / EAGLE format) into parents and sibling ranks.

    A choice is a tuple of ranks from the root: (0,) is the root's top-1 child, (0, 1) the
    top-2 child of that node. Node order, as Medusa and EAGLE number the nodes: by depth
    (length), then lexicographically; node i is the i-th choice in that order, so every parent
    comes before its children. parents[i] is the node index of choice[:-1] (-1 for a choice of
    length 1); ranks[i] = choice[-1] (which candidate of its parent the drafter puts at node i).

    Args:
        choices: the choices, in any order; each a non-empty sequence of integer ranks >= 0.
    Returns:
        (parents, ranks), two lists of N = len(choices) ints in node order.
    Raises:
        ValueError: an empty list of choices, a duplicate choice, or a choice whose prefix
            (its parent) is not a choice.
    """
    # EXERCISE 4.1: which order puts parents first; how do you find choice[:-1] fast, and what do the errors look like there?
    # BEGIN SOLUTION
    if len(choices) == 0:
        raise ValueError("no choices: a static tree needs at least one node")
    cs = sorted((tuple(int(r) for r in c) for c in choices), key=lambda t: (len(t), t))
    index: dict[tuple[int, ...], int] = {}
    parents, ranks = [], []
    for i, t in enumerate(cs):
        if not t:
            raise ValueError("empty choice (): the root is implicit")
        if t in index:
            raise ValueError(f"duplicate choice {t}")
        if len(t) > 1 and t[:-1] not in index:
            raise ValueError(f"choice {t} has no parent: {t[:-1]} is not a choice")
        parents.append(index[t[:-1]] if len(t) > 1 else -1)
        ranks.append(t[-1])
        index[t] = i
    return parents, ranks
    # END SOLUTION


def tree_mask(parents: list[int]) -> torch.Tensor:
    """The tree attention mask of root + N nodes.

    Row a is the query of row a (root = 0, node i = i + 1), column b a key: entry (a, b) is True
    when b is a itself or one of a's ancestors. The root sees only itself; every node sees the
    root. (The committed prefix in the KV cache is visible to every row and is not part of
    this mask.) A chain gives the lower-triangular causal mask.

    Args:
        parents: [N] parent of each node, -1 for the root's children, parents[i] < i.
    Returns:
        [N + 1, N + 1] bool tensor.
    """
    # EXERCISE 4.2: in topological order, what do you already know about a node's parent when you reach the node?
    # BEGIN SOLUTION
    n = len(parents) + 1
    m = torch.zeros(n, n, dtype=torch.bool)
    m[:, 0] = True  # everyone sees the root
    for i, j in enumerate(parents):
        m[i + 1] = m[j + 1]  # the parent's ancestors (the root's row when j = -1) ...
        m[i + 1, i + 1] = True  # ... and itself
    return m
    # END SOLUTION


def tree_positions(parents: list[int], prefix_len: int) -> torch.Tensor:
    """Position ids of root + N nodes for the target's forward (RoPE / learned positions).

    The root is the token right after the ``prefix_len`` tokens already in the KV cache, so its
    position is prefix_len; a node at depth d (children of the root have depth 1) sits at
    prefix_len + d: siblings share a position, as they are alternatives for the same slot.

    Args:
        parents: [N] parent of each node, -1 for the root's children, parents[i] < i.
        prefix_len: number of committed tokens in the KV cache before the root.
    Returns:
        [N + 1] LongTensor.
    """
    # EXERCISE 4.3: can a node's depth be read off something you have already computed?
    # BEGIN SOLUTION
    depths = [0]  # by row: the root has depth 0
    for j in parents:
        depths.append(depths[j + 1] + 1)
    return torch.tensor(depths, dtype=torch.long) + prefix_len
    # END SOLUTION


def retrieve_indices(parents: list[int]) -> torch.Tensor:
    """The root-to-leaf paths of node indices, padded with -1 (Medusa / EAGLE ``retrieve_indices``).

    One row per leaf (a node without children), leaves in increasing index order. Row r lists
    the nodes on the path from the root's child down to that leaf (root excluded), then -1 up
    to the tree's depth. Entries are node indices 0..N-1; add 1 to index rows of the target's
    logits or of the mask.

    Args:
        parents: [N] parent of each node, -1 for the root's children, parents[i] < i.
    Returns:
        [n_leaves, depth] LongTensor, depth = the deepest node's depth ([0, 0] for N = 0).
    """
    # EXERCISE 4.4: which nodes are leaves, which way can you walk from one, and in what order does that give its path?
    # BEGIN SOLUTION
    has_child = [False] * len(parents)
    for j in parents:
        if j >= 0:
            has_child[j] = True
    paths = []
    for leaf in (i for i in range(len(parents)) if not has_child[i]):
        path, i = [], leaf
        while i >= 0:
            path.append(i)
            i = parents[i]
        paths.append(path[::-1])
    depth = max((len(p) for p in paths), default=0)
    out = torch.full((len(paths), depth), -1, dtype=torch.long)
    for r, path in enumerate(paths):
        out[r, : len(path)] = torch.tensor(path, dtype=torch.long)
    return out
    # END SOLUTION


def greedy_verify(parents: list[int], tokens: list[int], logits: torch.Tensor) -> tuple[list[int], int]:
    """Greedy verification of a draft tree against the target's logits from one tree forward.

    Greedy verification accepts exactly the drafts the target would have emitted itself: a
    node is accepted when its parent is (the root always is) and its token is the target's
    argmax at its parent's row. Where several children of one node carry that token, the one
    of lowest index is accepted. After the accepted path the step emits the target's own
    argmax at the row of the path's last node (the root's row when nothing is accepted): the
    correction, or the bonus token after a leaf.

    Args:
        parents: [N] parent of each node, -1 for the root's children, parents[i] < i.
        tokens: [N] token of each node.
        logits: [N + 1, V] target logits by row (row 0 = root, row i + 1 = after node i).
    Returns:
        (path, next_token): accepted node indices from the root down (maybe empty) and the token
        emitted after them. The step commits [tokens[i] for i in path] + [next_token].
    """
    # EXERCISE 4.5: what does the target want at a row, which nodes may offer it, and what must you know per row to ask fast?
    # BEGIN SOLUTION
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, j in enumerate(parents):
        children[j + 1].append(i)
    path, row = [], 0
    while True:
        best = int(logits[row].argmax())
        match = [i for i in children[row] if tokens[i] == best]
        if not match:
            return path, best
        path.append(match[0])
        row = match[0] + 1
    # END SOLUTION


def best_static_tree(rank_acc: Sequence[float], n: int, max_depth: int) -> list[tuple[int, ...]]:
    """The static tree of n nodes with the most expected tokens per step, as a choices list.

    Model (Medusa, Sequoia): the draft's rank-r candidate under any node is accepted with
    probability rank_acc[r], independently of the depth, so the node at choice (r_1, ..., r_d) is
    reached and accepted with probability rank_acc[r_1] * ... * rank_acc[r_d], and a tree's
    expected tokens per step is 1 + the sum of that over its nodes. A choice may only be in the tree
    if its parent (choice[:-1]) is.

    Args:
        rank_acc: acceptance probability of each rank, each in [0, 1].
        n: how many nodes (0 <= n <= the number of choices of depth <= max_depth).
        max_depth: the longest choice allowed.
    Returns:
        n choices, sorted by (len, tuple) as choices_to_parents orders them (any of the best trees
        where several tie).
    """
    # EXERCISE 4.6: can a node be worth more than its parent? Then which node turns a best tree of n nodes into one of n + 1?
    # BEGIN SOLUTION
    import heapq

    frontier = [(-rank_acc[r], 1, (r,)) for r in range(len(rank_acc))]  # (-value, depth, choice)
    heapq.heapify(frontier)
    chosen = []
    while len(chosen) < n:
        neg_value, depth, choice = heapq.heappop(frontier)
        chosen.append(choice)
        if depth < max_depth:
            for r, a in enumerate(rank_acc):
                heapq.heappush(frontier, (neg_value * a, depth + 1, choice + (r,)))
    return sorted(chosen, key=lambda c: (len(c), c))
    # END SOLUTION
