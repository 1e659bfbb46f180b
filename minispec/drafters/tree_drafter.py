"""Chains, static trees and EAGLE-2 dynamic trees, for any drafter that scores a node's children.

A branching drafter (draft model, EAGLE heads, Medusa heads) implements three hooks:

    _start()                 -> logits [V] of the root's children (the root is self.context[-1];
                                ``prefill`` / ``commit`` keep self.context, see ``base.Drafter``)
    _extend(tokens, parents) -> logits [n, V] of the children of n new nodes; parents index the
                                nodes added since _start (-1 = the root). Called level by level,
                                so a node's ancestors are always in the drafter's state already.
    _end()                   drop the tree from the drafter's state (keep the committed context)

and ``TreeDrafter.propose`` turns them into a ``Tree`` of one of three shapes (``TreeSpec``):

    chain    depth k; each draft sampled from q (the tree carries q: verified by Leviathan/Chen),
             the argmax when greedy.
    static   a choices list (EAGLE / Medusa ``mc_sim_7b_63``): node i is the ranks[i]-th most
             likely child of its parent. Deterministic drafts, verified as one-hot q (lossless).
    dynamic  EAGLE-2: a node's score is the product of draft probabilities along its path (its
             "global acceptance probability" estimate). Each level expands the top_k highest
             scoring nodes of the level before, top_k children each; at the end the total_tokens
             best nodes of all levels form the tree. A child never scores above its parent, so
             picking by (score, then depth) keeps the tree connected. Verified as one-hot q.

             Parameters: minispec's ``D,K,N`` (depth, top_k, total_tokens) count DRAFT nodes only:
             D levels below the root, N drafted nodes. Upstream EAGLE's ``depth``, ``top_k`` and
             ``total_token`` count the root as a token and expand ``depth`` times after the root's
             children, so minispec's D,K,N is upstream's depth = D - 1, top_k = K,
             total_token = N + 1 (upstream's default 5 / 10 / 60 is minispec's 6,10,59).

References: Miao et al., "SpecInfer" (2023) and Cai et al., "Medusa" (2024) for token trees;
Li et al., "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees" (2024).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..sampling import SamplingParams, probs, sample
from ..tree import EAGLE_MC_SIM_7B_63, MEDUSA_MC_SIM_7B_63, Tree, parse_choices
from .base import Drafter

STATIC_TREES = {"eagle": EAGLE_MC_SIM_7B_63, "medusa": MEDUSA_MC_SIM_7B_63}


@dataclass(frozen=True)
class TreeSpec:
    """The shape of the trees a drafter proposes.

    kind: "chain" | "static" | "dynamic".
    depth: most draft tokens on a path (the chain length k).
    choices: the static tree's choices (kind "static").
    top_k, total_tokens: EAGLE-2's branching and tree size (kind "dynamic").
    name: how it was asked for (printed in tables).
    """

    kind: str
    depth: int
    choices: tuple = ()
    top_k: int = 0
    total_tokens: int = 0
    name: str = ""
    parsed: object = field(default=None, compare=False, repr=False)

    @classmethod
    def chain(cls, k: int) -> "TreeSpec":
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"chain length k must be a positive integer, got {k!r}")
        return cls("chain", k, name=f"chain:{k}")

    @classmethod
    def static(cls, choices, name: str = "static") -> "TreeSpec":
        ct = parse_choices(choices)  # validates
        return cls("static", max(len(c) for c in ct.choices), tuple(ct.choices), name=name, parsed=ct)

    @classmethod
    def dynamic(cls, depth: int, top_k: int, total_tokens: int) -> "TreeSpec":
        if depth < 1 or top_k < 1 or total_tokens < 1:
            raise ValueError(f"dynamic tree needs depth, top_k, total_tokens >= 1, got {depth}, {top_k}, {total_tokens}")
        if total_tokens > top_k + (depth - 1) * top_k * top_k:
            raise ValueError(f"total_tokens={total_tokens} exceeds the {top_k + (depth - 1) * top_k * top_k} nodes "
                             f"a depth-{depth}, top-{top_k} expansion drafts")
        return cls("dynamic", depth, top_k=top_k, total_tokens=total_tokens, name=f"dynamic:{depth},{top_k},{total_tokens}")

    @classmethod
    def parse(cls, s: "str | int | TreeSpec") -> "TreeSpec":
        """'chain:5' or 5 (a chain), 'eagle' / 'medusa' (the mc_sim_7b_63 static trees),
        'D,K,N', 'D/K/N' or 'dynamic:D,K,N' (EAGLE-2 with depth D, top_k K, total_tokens N)."""
        if isinstance(s, TreeSpec):
            return s
        if isinstance(s, int):
            return cls.chain(s)
        text = str(s).strip().lower()
        if text in STATIC_TREES:
            return cls.static(STATIC_TREES[text], name=text)
        if text.startswith("chain:") or text.isdigit():
            return cls.chain(int(text.split(":")[-1]))
        body = text.split(":", 1)[1] if text.startswith("dynamic:") else text
        parts = body.replace("/", ",").split(",")  # 6/10/60 fits inside a comma-separated method list
        if len(parts) == 3 and all(p.strip().isdigit() for p in parts):
            return cls.dynamic(*(int(p) for p in parts))
        raise ValueError(f"unknown tree {s!r}: use 'chain:K', 'eagle', 'medusa' or 'DEPTH,TOP_K,TOTAL_TOKENS'")

    @property
    def max_nodes(self) -> int:
        return {"chain": self.depth, "static": len(self.choices), "dynamic": self.total_tokens}[self.kind]


class GrowingTree:
    """The nodes one proposal has drafted so far, grown level by level: the one place where every
    branching drafter (draft model, EAGLE heads) gets the positions and the attention mask of
    the next level's nodes. Vectorised: one ancestor-or-self matrix, no loop over nodes.

    The drafter's cache holds L committed positions (the root is the last, at position L - 1)
    followed by the ``len(self)`` nodes added so far, in the order they were added; a new node
    attends to the L committed positions, its ancestors and itself.
    """

    def __init__(self):
        self.depth = torch.zeros(0, dtype=torch.long)  # [m] depth of each added node (root children: 1)
        self.anc = torch.zeros(0, 0, dtype=torch.bool)  # [m, m] anc[i, j]: node j is node i or an ancestor of it
        self.is_chain = True  # every level so far was one node, the child of the one before

    def __len__(self) -> int:
        return len(self.depth)

    def add(self, parents: list[int], committed: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Add n nodes with ``parents`` (indices of added nodes, -1 = the root).

        Args:
            parents: [n] parent of each new node.
            committed: L, the committed positions in the drafter's cache before the tree.
        Returns:
            positions [n] (L - 1 + depth) and mask [n, L + m + n] over committed positions, the m
            nodes added before, and the new ones (True = may attend).
        """
        done, n = len(self), len(parents)
        par = torch.tensor(parents, dtype=torch.long)  # [n]
        if ((par < -1) | (par >= done)).any():
            raise ValueError(f"parents {parents} must index the {done} nodes added before (-1 = the root)")
        self.is_chain = self.is_chain and n == 1 and parents[0] == done - 1
        has = par >= 0
        depth = torch.ones(n, dtype=torch.long)
        depth[has] = self.depth[par[has]] + 1  # [n]
        rows = torch.zeros(n, done + n, dtype=torch.bool)  # [n, m + n]: ancestor-or-self of each new node
        rows[has, :done] = self.anc[par[has]]  # the parent's row: its ancestors and itself
        rows[torch.arange(n), done + torch.arange(n)] = True  # itself
        anc = torch.zeros(done + n, done + n, dtype=torch.bool)
        anc[:done, :done] = self.anc
        anc[done:] = rows
        self.anc, self.depth = anc, torch.cat([self.depth, depth])
        mask = torch.cat([torch.ones(n, committed, dtype=torch.bool), rows], dim=1)  # [n, L + m + n]
        return (depth + committed - 1).to(device), mask.to(device)


class TreeDrafter(Drafter):
    """Base class: ``propose`` for chains, static and dynamic trees on top of three hooks."""

    def __init__(self, tree: "TreeSpec | str | int" = 4):
        self.spec = TreeSpec.parse(tree)
        self.forwards = 0  # draft forwards (one per _start / _extend call that runs the model)
        self.context: list[int] = []

    @property
    def max_nodes(self) -> int:
        return self.spec.max_nodes

    # --- hooks ------------------------------------------------------------------------------
    def _start(self) -> torch.Tensor:
        raise NotImplementedError

    def _extend(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        raise NotImplementedError

    def _end(self) -> None:
        pass

    # --- proposals --------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, params: SamplingParams, budget: int, generator: torch.Generator | None = None) -> Tree:
        """Draft a tree after ``self.context`` (its last token is the root), at most ``budget`` deep."""
        depth = min(self.spec.depth, budget)
        if depth <= 0:
            return Tree([], [])
        logits = self._start()  # [V]
        try:
            if self.spec.kind == "chain":
                return self._chain(logits, depth, params, generator)
            if self.spec.kind == "static":
                return self._static(logits, depth)
            return self._dynamic(logits, depth)
        finally:
            self._end()

    def _chain(self, logits, depth, params, generator) -> Tree:
        drafts, qs = [], []
        for i in range(depth):
            if params.greedy:
                x = int(logits.argmax())
            else:
                q = probs(logits, params)  # [V], processed exactly like p
                x = int(sample(q, generator))  # drawn on the generator's device (a CPU one with CUDA logits)
                qs.append(q)
            drafts.append(x)
            if i + 1 < depth:
                logits = self._extend([x], [i - 1])[0]
        return Tree.chain(drafts, torch.stack(qs) if qs else None)

    def _static(self, root_logits, depth) -> Tree:
        ct = self.spec.parsed
        keep = [i for i, c in enumerate(ct.choices) if len(c) <= depth]  # a prefix of the node order
        parents, ranks = ct.parents[: len(keep)], ct.ranks[: len(keep)]
        depths = [len(ct.choices[i]) for i in keep]
        tokens = [0] * len(keep)
        logits_of = {-1: root_logits}  # node -> logits of its children
        added: dict[int, int] = {}  # node -> index among the nodes given to _extend
        for d in range(1, depth + 1):
            level = [i for i in range(len(keep)) if depths[i] == d]
            for i in level:
                tokens[i] = int(torch.topk(logits_of[parents[i]], ranks[i] + 1).indices[-1])
            has_children = [i for i in level if any(parents[j] == i for j in range(len(keep)))]
            if d < depth and has_children:
                out = self._extend([tokens[i] for i in has_children], [added.get(parents[i], -1) for i in has_children])
                for j, i in enumerate(has_children):
                    added[i] = len(added)
                    logits_of[i] = out[j]
        return Tree(tokens, parents)

    def _dynamic(self, root_logits, depth) -> Tree:
        K, N = self.spec.top_k, self.spec.total_tokens
        # candidates: token, parent candidate (-1 root), depth, score (log of the path's draft probability)
        tok: list[int] = []
        par: list[int] = []
        dep: list[int] = []
        score: list[float] = []
        added: dict[int, int] = {}  # candidate -> index among the nodes given to _extend
        frontier, fscores = [-1], torch.zeros(1)  # level 1 expands the root alone (score log 1 = 0)
        logp = torch.log_softmax(root_logits.float(), -1)[None]  # [1, V]
        for d in range(1, depth + 1):
            if d > 1:
                out = self._extend([tok[c] for c in frontier], [added.get(par[c], -1) for c in frontier])  # [K, V]
                for c in frontier:
                    added[c] = len(added)
                logp = torch.log_softmax(out.float(), -1)  # [K, V]
            s, t, f, nxt = expand_level(fscores, logp, K)
            new = list(range(len(tok), len(tok) + len(t)))
            tok += t.tolist()
            par += [frontier[j] for j in f.tolist()]
            dep += [d] * len(t)
            score += s.tolist()
            frontier, fscores = [new[j] for j in nxt.tolist()], s[nxt]
        nodes, parents = rerank(score, par, dep, N)
        return Tree([tok[c] for c in nodes], parents)


def expand_level(frontier_scores: torch.Tensor, child_logp: torch.Tensor, top_k: int):
    """One EAGLE-2 expansion step.

    Args:
        frontier_scores: [F] path scores (log probabilities) of the nodes being expanded.
        child_logp: [F, V] draft log probabilities of each frontier node's children.
        top_k: children per node, and the size of the next frontier.
    Returns:
        (child_scores [F * top_k], child_tokens [F * top_k], child_parent [F * top_k] (index into
        the frontier), next_frontier [top_k] (indices into the children, best first)).
    """
    F = child_logp.shape[0]
    top = torch.topk(child_logp, top_k, dim=-1)  # [F, top_k]
    base = torch.as_tensor(frontier_scores).to(child_logp)[:, None]  # [F, 1], on the logits' device (a GPU's)
    child = (base + top.values).flatten()  # [F * top_k] path scores
    parent = torch.arange(F * top_k, device=child_logp.device) // top_k  # [F * top_k] child j's frontier node
    return child, top.indices.flatten(), parent, torch.topk(child, min(top_k, child.numel())).indices


def rerank(scores, parents_cand, depths, total_tokens):
    """EAGLE-2's rerank: the ``total_tokens`` best candidates, ties to the shallower then the earlier one.

    A child never scores above its parent, so the kept set is connected.

    Returns:
        (kept candidate ids in topological order (by depth, then id), their parents remapped to
        positions in that list, -1 for the root).
    """
    best = sorted(range(len(scores)), key=lambda c: (-scores[c], depths[c], c))[:total_tokens]
    nodes = sorted(best, key=lambda c: (depths[c], c))  # topological order
    index = {c: i for i, c in enumerate(nodes)}
    return nodes, [index[parents_cand[c]] if parents_cand[c] >= 0 else -1 for c in nodes]
