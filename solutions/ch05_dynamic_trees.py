"""Chapter 5 exercises: EAGLE-2 dynamic draft trees, and the size of tree that pays on a machine.

References:
    Li et al., "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees" (2024):
        a node's score estimates its "global acceptance probability" from the draft's own
        probabilities along its path; the tree is grown where that estimate is high (expand),
        then cut to a budget of nodes (rerank).
    Chen et al., "Sequoia: Scalable, Robust, and Hardware-aware Speculative Decoding" (2024):
        the size of tree worth verifying depends on the hardware.

The tree is built in two phases (minispec's ``TreeDrafter._dynamic``):

    expand   depth levels; at each level a few of the best nodes so far (the "frontier") get
             their most likely children from the draft. Every child is a candidate.
    rerank   keep total_tokens of all the candidates, as a tree, in topological order.

Scores are log-probabilities, so in the code a "product of probabilities" is a sum of logs.

Check your work: ``python -m minispec grade 5``, or ``minispec.grading.check("5.1")``, or
``pytest tests/test_exercises.py -m ch05 --impl exercises``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


def expand_level(frontier_scores: torch.Tensor, child_logp: torch.Tensor, top_k: int):
    """One EAGLE-2 expansion step: the top_k children of every frontier node, and the next frontier.

    Questions to answer before coding: a child's score is the log of the product of q along its
    path; how does it follow from its parent's? "The best" appears twice in an expansion: which
    children does one frontier node get, and which of all the level's children are expanded next?

    Args:
        frontier_scores: [F] path scores (log-probabilities) of the F frontier nodes.
        child_logp: [F, V] log q(. | path of frontier node f): the draft's log-softmax at each.
        top_k: children per frontier node, and the size of the next frontier.
    Returns:
        (child_scores, child_tokens, child_parent, next_frontier):
        child_scores [F * top_k] float: each child's path score; row by row (the children of
            frontier node 0 first), each row's children best first (``torch.topk`` order);
        child_tokens [F * top_k] long: the children's tokens, in the same order;
        child_parent [F * top_k] long: the frontier index f (0..F-1) of each child's parent;
        next_frontier [min(top_k, F * top_k)] long: indices into the children of the top_k
            best-scoring ones, best first (``torch.topk`` order): the nodes expanded next.
    """
    # EXERCISE 5.1: which children does each frontier node get, what does a child score, and which children are expanded next?
    # BEGIN SOLUTION
    F = child_logp.shape[0]
    top = torch.topk(child_logp, top_k, dim=-1)  # values, indices: [F, top_k]
    child_scores = (frontier_scores.to(child_logp.dtype)[:, None] + top.values).flatten()  # [F * top_k]
    child_tokens = top.indices.flatten()  # [F * top_k]
    child_parent = torch.arange(F).repeat_interleave(top_k)  # [F * top_k]: f, f, ..., f + 1, ...
    next_frontier = torch.topk(child_scores, min(top_k, child_scores.numel())).indices
    return child_scores, child_tokens, child_parent, next_frontier
    # END SOLUTION


def rerank(scores: list[float], parents_cand: list[int], depths: list[int], total_tokens: int):
    """Keep the total_tokens best candidates as a tree (EAGLE-2's rerank).

    Candidates are numbered 0..M-1 in the order they were created (level by level), so a
    parent's id is smaller than its children's. The kept set: the total_tokens highest scores,
    where among equal scores the shallower candidate, then the smaller id, counts as better.
    The output order: by depth, then by candidate id.

    Questions to answer before coding: why is the kept set always a connected tree, and which
    part of the tie rule does that need (think of a child whose q is 1)? Parents are returned as
    positions in your output, not as candidate ids: how does a kept child find its parent's?

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
    # BEGIN SOLUTION
    best = sorted(range(len(scores)), key=lambda c: (-scores[c], depths[c], c))[:total_tokens]
    selected = sorted(best, key=lambda c: (depths[c], c))  # topological order
    index = {c: i for i, c in enumerate(selected)}
    parents = [index[parents_cand[c]] if parents_cand[c] >= 0 else -1 for c in selected]
    return selected, parents
    # END SOLUTION


def dynamic_tree(next_logits: Callable[[tuple], torch.Tensor], depth: int, top_k: int,
                 total_tokens: int) -> tuple[list[int], list[int]]:
    """A whole EAGLE-2 tree from a draft's next-token function, with your 5.1 and 5.2: the tree
    that ``TreeDrafter._dynamic`` drafts for ``TreeSpec.dynamic(depth, top_k, total_tokens)``.

    The draft's log-probabilities after a path are ``log_softmax(next_logits(path), -1)`` in
    float32 (path = the tokens below the root, root excluded; () for the root itself).

    Questions to answer before coding: what are the root's score and the first frontier? How
    many levels does ``depth`` make, and what must you remember between two levels about each
    frontier node (to ask ``next_logits`` for its children, and to score them)? Which list per
    candidate does 5.2 need at the end, and how do you turn its answer into tokens?

    Args:
        next_logits: path (tuple of token ids below the root, () for the root) -> logits [V].
        depth: number of levels (>= 1).
        top_k: children per expanded node and frontier size.
        total_tokens: nodes kept by the rerank.
    Returns:
        (tokens, parents) of the tree, in rerank's topological order.
    """
    # EXERCISE 5.3: grow the tree one level at a time with your 5.1, keep what 5.2 will need about every candidate, then let 5.2 choose
    # BEGIN SOLUTION
    tok: list[int] = []
    par: list[int] = []
    dep: list[int] = []
    score: list[float] = []
    path: list[tuple] = []
    frontier, frontier_scores = [-1], torch.zeros(1)  # the root (candidate -1)
    for d in range(1, depth + 1):
        logp = torch.stack([torch.log_softmax(next_logits(path[c] if c >= 0 else ()).float(), -1)
                            for c in frontier])  # [F, V]
        s, t, f, nxt = expand_level(frontier_scores, logp, top_k)
        new = []
        for sj, tj, fj in zip(s.tolist(), t.tolist(), f.tolist()):
            parent = frontier[fj]
            new.append(len(tok))
            tok.append(tj), par.append(parent), dep.append(d), score.append(sj)
            path.append((path[parent] if parent >= 0 else ()) + (tj,))
        frontier = [new[j] for j in nxt.tolist()]
        frontier_scores = s[nxt]
    selected, parents = rerank(score, par, dep, total_tokens)
    return [tok[c] for c in selected], parents
    # END SOLUTION


def best_tree_size(path_probs: Sequence[float], verify_s: Sequence[float], draft_s: float,
                   max_nodes: int) -> tuple[int, float]:
    """The tree size that pays on this machine: the number of nodes n in 0..max_nodes with the
    highest predicted tokens per second, under the dispatcher's cost model (section 6).

    The candidates come from one EAGLE-2 expansion, and the draft is taken as calibrated: a
    candidate's path product is the probability that the target accepts it (section 2). A step
    with n >= 1 nodes drafts (draft_s seconds, whatever n), runs one target forward over the root
    and the n nodes (verify_s[n] seconds) and keeps, of the candidates, the n that serve it best;
    n = 0 is vanilla decoding (nothing drafted, one forward over the root alone). A tree cannot
    hold more nodes than there are candidates. Do not modify the arguments.

    Questions to answer before coding: what does a step with n nodes commit on average, bonus
    included, and which n candidates make that largest? (Do they form a tree?) What does a step
    cost, with n nodes and with none? Is the predicted speed monotone in n, and can vanilla win?

    Args:
        path_probs: [M] the candidates' path products (acceptance estimates in [0, 1]), in any
            order; M may be 0.
        verify_s: seconds of one target forward over the root and n nodes, for n = 0, 1, ...,
            len(verify_s) - 1 (len(verify_s) > max_nodes).
        draft_s: seconds of drafting one tree (>= 0).
        max_nodes: the budget of nodes (>= 0).
    Returns:
        (n, tokens_per_s): the best n (an int; on a tie, the smallest) and its predicted tokens
        per second (a float).
    """
    # EXERCISE 5.4: the expected tokens and the cost of a step for every n, then the fastest n (the smallest on a tie)
    # BEGIN SOLUTION
    probs = sorted(path_probs, reverse=True)  # the best n candidates are the n largest products
    best_n, best = 0, 1.0 / verify_s[0]  # vanilla: one token per forward over the root, no drafting
    tau = 1.0  # the bonus token
    for n in range(1, min(max_nodes, len(probs)) + 1):
        tau += probs[n - 1]
        speed = tau / (verify_s[n] + draft_s)
        if speed > best:  # strictly faster: a tie keeps the smaller tree
            best_n, best = n, speed
    return best_n, best
    # END SOLUTION
