# Exercises generated from solutions/ch05_dynamic_trees.py by tools/make_exercises.py.
# Replace each `raise NotImplementedError(...)` with your code; keep the signatures.
"""Chapter 5 exercises: EAGLE-2 dynamic draft trees and the cost model that picks a tree.

References:
    Li et al., "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees" (2024):
        a node's score is the product of the draft's probabilities along its path (an estimate
        of its "global acceptance probability"); expand the best nodes level by level, then
        rerank all candidates and keep the best total_tokens of them.

The tree is built in two phases (minispec's ``TreeDrafter._dynamic``):

    expand   depth levels. Level 1: the root's top_k children. Level d + 1: the "frontier" (the
             top_k best-scoring candidates of level d) each get their top_k children; the score
             of a child is its parent's score + log q(child | path). Nodes are candidates.
    rerank   keep the total_tokens best candidates of all levels (ties to the shallower one),
             in topological order. A child never scores above its parent (log q <= 0), so the
             kept set is a connected tree.

Scores are log-probabilities (sums of log q), so "product of probabilities" is a sum here.

Check your work: ``python -m minispec grade 5``, or ``minispec.grading.check("5.1")``, or
``pytest tests/test_exercises.py -m ch05 --impl exercises``.
"""

from __future__ import annotations

from typing import Callable

import torch


def expand_level(frontier_scores: torch.Tensor, child_logp: torch.Tensor, top_k: int):
    """One EAGLE-2 expansion step: the top_k children of every frontier node, and the next frontier.

    Args:
        frontier_scores: [F] path scores (log-probabilities) of the F frontier nodes.
        child_logp: [F, V] log q(. | path of frontier node f): the draft's log-softmax at each.
        top_k: children per frontier node, and the size of the next frontier.
    Returns:
        (child_scores, child_tokens, child_parent, next_frontier):
        child_scores [F * top_k] float: frontier_scores[f] + the f-th row's top_k log-probs, row
            by row (children of frontier node 0 first), each row's children best first
            (``torch.topk`` order);
        child_tokens [F * top_k] long: the children's tokens, in the same order;
        child_parent [F * top_k] long: the frontier index f (0..F-1) of each child's parent;
        next_frontier [min(top_k, F * top_k)] long: indices into the children of the top_k
            highest child_scores, best first (``torch.topk`` order): the nodes expanded next.
    """
    # EXERCISE 5.1: which children does each frontier node get, what does a child score, and which children are expanded next?
    raise NotImplementedError("Exercise 5.1: which children does each frontier node get, what does a child score, and which children are expanded next?")


def rerank(scores: list[float], parents_cand: list[int], depths: list[int], total_tokens: int):
    """Keep the total_tokens best candidates as a tree (EAGLE-2's rerank).

    Candidates are numbered 0..M-1 in the order they were created (level by level), so a
    parent's id is smaller than its children's. Select the total_tokens candidates with the
    highest score; on equal scores prefer the shallower one, then the smaller id (this is what
    keeps the tree connected when a child's log q is 0). Return them in topological order:
    sorted by depth, then by candidate id.

    Args:
        scores: [M] path score (log-probability) of each candidate.
        parents_cand: [M] the parent's candidate id, -1 for children of the root.
        depths: [M] depth of each candidate (children of the root have depth 1).
        total_tokens: how many to keep (all M if M is smaller).
    Returns:
        (selected, parents): selected [n] candidate ids in that order; parents [n] the parent of
        each as an index into ``selected`` (-1 for children of the root).
    """
    # EXERCISE 5.2: which candidates survive, in what order must they come out, and how does a child find its parent then?
    raise NotImplementedError("Exercise 5.2: which candidates survive, in what order must they come out, and how does a child find its parent then?")


def predicted_tokens_per_s(tau: float, verify_s: float, draft_s: float) -> float:
    """The dispatcher's cost model: predicted decoding speed of a tree shape.

    One decoding step drafts a tree (draft_s seconds) and runs the target once over it
    (verify_s seconds, which grows with the tree's size), and commits tau tokens on average
    (tau = mean tokens per target forward, bonus included; vanilla decoding has tau = 1 and
    draft_s = 0). Works elementwise on tensors too.

    Args:
        tau: mean tokens committed per step (>= 1).
        verify_s: seconds of one target forward over root + tree.
        draft_s: seconds of drafting per step.
    Returns:
        predicted tokens per second.
    """
    # EXERCISE 5.3: what does one step produce, and what does one step cost?
    raise NotImplementedError("Exercise 5.3: what does one step produce, and what does one step cost?")


def dynamic_tree(next_logits: Callable[[tuple], torch.Tensor], depth: int, top_k: int,
                 total_tokens: int) -> tuple[list[int], list[int]]:
    """A whole EAGLE-2 tree from a draft's next-token function, with 5.1 and 5.2.

    Level 1 is one expansion of the root (frontier = the root alone, score 0, so its next
    frontier is all of its top_k children). Each further level (up to ``depth``) expands the
    frontier of the level before with ``expand_level``, whose child_logp rows are
    log_softmax(next_logits(path), -1) in float32 (path = the tokens from the root's child down
    to the frontier node). Then ``rerank`` all candidates.

    Args:
        next_logits: path (tuple of token ids below the root, () for the root) -> logits [V].
        depth: number of levels (>= 1).
        top_k: children per expanded node and frontier size.
        total_tokens: nodes kept by the rerank.
    Returns:
        (tokens, parents) of the tree, in rerank's topological order.
    """
    # EXERCISE 5.4: grow the tree one level at a time with your 5.1, keep what 5.2 will need about every candidate, then let 5.2 choose
    raise NotImplementedError("Exercise 5.4: grow the tree one level at a time with your 5.1, keep what 5.2 will need about every candidate, then let 5.2 choose")
