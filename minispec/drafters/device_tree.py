"""The chain and EAGLE-2's dynamic tree built on the device, with fixed shapes (chapters 5 and 8).

``TreeDrafter`` builds a draft tree on the host: at every level it reads the chosen tokens and
parents back (``.tolist()``), which makes the GPU wait, and the candidate lists grow as it goes.
A CUDA graph can hold neither. Here the same trees are built from tensors whose shapes depend
only on the tree's parameters, never on the values drawn:

    chain    depth k: one node a level, the argmax of its parent's logits (greedy).
    dynamic  EAGLE-2 (depth D, top_k K, total_tokens N): level 1 scores the root's top K
             children, every later level expands the K best of the level before, K children
             each (``tree_drafter.expand_level``, the very same calls), so level d >= 2 holds
             exactly K * K candidates: M = K + (D - 1) K^2 candidates in all, in the order
             ``TreeDrafter._dynamic`` numbers them. The rerank keeps the N best by
             (-score, depth, id), which is a stable descending sort of the scores (candidates
             are numbered level by level, so id order is depth order), and puts them in
             topological order (by depth, then id: ascending ids).

The drafter supplies one hook, ``extend(tokens [n], parents [n]) -> logits [n, V]``: the logits
of the children of n new nodes, whose parents index the nodes extended before (-1 = the root),
as ``TreeDrafter._extend`` takes them, but as device tensors. ``Ancestry`` is the device twin of
``GrowingTree`` (the positions and masks of the extended nodes), and ``verify_inputs`` gives the
target's verify forward the tree as tensors (root + nodes, depths, ancestor mask) so that it runs
without a host round trip; the host reads the tree once, for the acceptance walk.

Everything here is plain tensor code: on a CPU it runs as it is (and is tested against
``TreeDrafter`` bit for bit, ties included); on a GPU ``minispec.drafters.graphed_draft``
captures a whole draft in one CUDA graph.

References: Li et al., "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees"
(2024), expand and rerank; SGLang's EAGLE worker (2024-2025) and Tang et al., "Efficient
Speculative Decoding for Llama at Scale" (2025) build the tree on the GPU for the same reason.

Shapes: n nodes of a level, E extended nodes at most, M candidates, N kept nodes, V vocab.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .tree_drafter import expand_level

Extend = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class TreeTensors(NamedTuple):
    """A drafted tree on the device, root first: the inputs of the target's verify forward.

    tokens: [N + 1] the root (the last committed token), then the nodes' tokens.
    depths: [N + 1] 0 for the root, each node's depth (positions = committed length + depths).
    mask: bool [N + 1, N + 1], True where column b is row a or an ancestor of it (``Tree.mask``).
    parents: [N] parent node index of each node, -1 = the root (``Tree.parents``).
    """

    tokens: torch.Tensor
    depths: torch.Tensor
    mask: torch.Tensor
    parents: torch.Tensor


class Ancestry:
    """The nodes a draft has extended so far, on the device: ``GrowingTree`` with fixed shapes.

    Holds room for ``capacity`` extended nodes; node e is the e-th node handed to the drafter's
    head (in the order ``add`` receives them). Only ``count`` lives on the host, and it follows
    from the shapes alone.
    """

    def __init__(self, capacity: int, device):
        self.anc = torch.zeros(capacity, capacity, dtype=torch.bool, device=device)  # [E, E] ancestor-or-self
        self.depth = torch.zeros(capacity, dtype=torch.long, device=device)  # [E] each node's depth (root's children: 1)
        self.count = 0

    def add(self, parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add n nodes whose ``parents`` [n] index earlier nodes (-1 = the root).

        Returns:
            (depth [n], rows bool [n, E]): each new node's depth and its ancestor-or-self row
            over the E node slots.
        """
        n, E = parents.shape[0], self.anc.shape[0]
        if self.count + n > E:
            raise ValueError(f"{self.count} + {n} nodes exceed the room for {E}")
        idx = torch.arange(self.count, self.count + n, device=parents.device)  # [n] the new nodes' indices
        has = parents >= 0  # [n]
        p = parents.clamp(min=0)
        own = idx[:, None] == torch.arange(E, device=parents.device)  # [n, E] itself (no host scalar in a graph)
        rows = (self.anc[p] & has[:, None]) | own  # [n, E] + the parent's row (its ancestors and itself); root: none
        depth = torch.where(has, self.depth[p] + 1, torch.ones_like(p))  # [n]
        self.anc[idx] = rows
        self.depth[idx] = depth
        self.count += n
        return depth, rows


def chain(root_logits: torch.Tensor, extend: Extend, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A greedy chain of ``depth`` drafts: each the argmax of its parent's logits (``TreeDrafter._chain``).

    Args:
        root_logits: [V] logits of the root's children.
        extend: the drafter's hook (tokens [1], parents [1]) -> logits [1, V].
    Returns:
        (tokens [depth], parents [depth] = -1, 0, 1, ...).
    """
    dev = root_logits.device
    x = root_logits.argmax().reshape(1)  # [1]
    drafts = [x]
    for i in range(1, depth):
        parent = torch.full((1,), i - 2, dtype=torch.long, device=dev)  # draft i - 1's parent: draft i - 2
        x = extend(x, parent)[0].argmax().reshape(1)
        drafts.append(x)
    return torch.cat(drafts), torch.arange(-1, depth - 1, device=dev)


def dynamic(root_logits: torch.Tensor, extend: Extend, depth: int, top_k: int,
            total_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-2's dynamic tree (``TreeDrafter._dynamic``: expand level by level, then rerank), fixed shapes.

    Args:
        root_logits: [V] logits of the root's children.
        extend: the drafter's hook (tokens [K], parents [K]) -> logits [K, V], called depth - 1 times.
        depth, top_k, total_tokens: D, K, N.
    Returns:
        (tokens [N'], parents [N']) in topological order, N' = min(N, M) with M = K + (D - 1) K^2.
    """
    K, dev = top_k, root_logits.device
    M = K + (depth - 1) * K * K
    tok = torch.zeros(M, dtype=torch.long, device=dev)  # [M] candidate tokens
    par = torch.full((M,), -1, dtype=torch.long, device=dev)  # [M] parent candidate (-1 = root)
    score = torch.zeros(M, dtype=torch.float32, device=dev)  # [M] log of the path's draft probability
    ext = torch.full((M,), -1, dtype=torch.long, device=dev)  # [M] index among the extended nodes, -1 if not
    frontier = torch.full((1,), -1, dtype=torch.long, device=dev)  # level 1 expands the root alone
    fscores = torch.zeros(1, dtype=torch.float32, device=dev)
    logp = torch.log_softmax(root_logits.float(), -1)[None]  # [1, V]
    start = extended = 0
    for d in range(1, depth + 1):
        if d > 1:  # the frontier's nodes (K candidates of level d - 1) go through the head
            fp = par[frontier]  # [K] their parents, extended at the level before (or the root)
            parents = torch.where(fp >= 0, ext[fp.clamp(min=0)], fp)  # [K] as extended-node indices
            out = extend(tok[frontier], parents)  # [K, V]
            ext[frontier] = torch.arange(extended, extended + K, device=dev)
            extended += K
            logp = torch.log_softmax(out.float(), -1)  # [K, V]
        s, t, f, nxt = expand_level(fscores, logp, K)  # [F * K] scores, tokens, frontier index; [K] next
        n = s.shape[0]
        tok[start:start + n], score[start:start + n] = t, s
        par[start:start + n] = frontier[f]
        frontier, fscores = start + nxt, s[nxt]  # [K] candidate ids, their scores
        start += n
    best = torch.sort(score, descending=True, stable=True).indices[:total_tokens]  # (-score, then id = depth, id)
    nodes = best.sort().values  # [N'] topological order: by depth, then id
    index = torch.full((M,), -1, dtype=torch.long, device=dev)
    index[nodes] = torch.arange(nodes.shape[0], device=dev)  # candidate -> position in the tree
    pn = par[nodes]  # [N'] parent candidates
    return tok[nodes], torch.where(pn >= 0, index[pn.clamp(min=0)], pn)


def verify_inputs(root: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, max_depth: int) -> TreeTensors:
    """The target's verify inputs for a tree drafted on the device (``Tree.mask`` / ``Tree.positions``'s twins).

    Args:
        root: [1] the last committed token; tokens, parents: [N] (parents -1 = the root, topological).
        max_depth: no node is deeper (the draft's levels): ancestors are found in that many steps.
    Returns:
        TreeTensors(tokens [N + 1], depths [N + 1], mask [N + 1, N + 1], parents [N]).
    """
    n = tokens.shape[0] + 1
    dev = tokens.device
    up = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), parents + 1])  # [N + 1] each row's parent's (root: 0)
    mask = torch.eye(n, dtype=torch.bool, device=dev)  # [N + 1, N + 1]
    for _ in range(max_depth):
        mask = mask | mask[up]  # a row gains its parent's row: one more level of ancestors
    depths = mask.sum(-1) - 1  # [N + 1] ancestors-or-self, the root among them, minus one
    return TreeTensors(torch.cat([root.reshape(1), tokens]), depths, mask, parents)
