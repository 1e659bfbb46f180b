"""Draft trees: tokens + parent indices -> attention mask, positions, paths.

A chain is the tree with parents [-1, 0, 1, ...]; vanilla decoding is the empty tree (only
the root, which is the last committed token). Nodes are in topological order: a node's
parent is -1 (the root) or an earlier node.

The target scores a tree in one forward over T = N + 1 new tokens: the root at index 0 and
node i at index i + 1. Each sees the committed prefix (in the KV cache), its ancestors and
itself; its position is prefix length + depth.

References: SpecInfer (Miao et al. 2023) token-tree attention; EAGLE (Li et al. 2024).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


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

    def __post_init__(self):
        self.tokens, self.parents = [int(t) for t in self.tokens], [int(j) for j in self.parents]
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"tree has {len(self.tokens)} tokens but {len(self.parents)} parents")
        for i, j in enumerate(self.parents):
            if not -1 <= j < i:
                raise ValueError(f"not a tree in topological order: parents[{i}] = {j} (must be -1 or < {i})")

    @classmethod
    def chain(cls, tokens: Sequence[int], q: torch.Tensor | None = None) -> "Tree":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), q)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self.parents) - 1))

    def depths(self) -> list[int]:
        """Depth of each node (children of the root have depth 1)."""
        d: list[int] = []
        for j in self.parents:
            d.append(1 if j < 0 else d[j] + 1)
        return d

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
