"""Chapter 2 exercises: multi-round speculative sampling (MSS) over several candidates, and trees.

References:
    Miao et al., "SpecInfer" (2023): multi-round speculative sampling over the children of a
        tree node (candidates drawn i.i.d. from q).
    Jeon et al., "Recursive Speculative Decoding" (2024); Yang et al., "Multi-Candidate
        Speculative Decoding" (2024): candidates drawn without replacement, recursive rejection
        sampling.
    Li et al., "EAGLE" (2024): top-k drafts verified as if q were one-hot.

Notation: ``p`` target distribution and ``q`` draft distribution, [V] float64 tensors; the
candidates x_0..x_{n-1} are tried in order. Round i is one chapter-1 step of a target p_i
against a draft q_i, starting from p_0 = p; if every candidate is rejected, a token is drawn
from p_n. Which p_{i+1} (and q_{i+1}) keep the emitted law exactly p is what the exercises ask.

Randomness goes through ``chooser.bernoulli(prob)`` and ``chooser.categorical(weights)`` only
(see chapter 1), so the grader can enumerate every outcome exactly.

Check your work: ``python -m minispec grade 2``, or ``minispec.grading.check("2.1")``, or
``pytest tests/test_exercises.py -m ch02 --impl exercises``.
"""

from __future__ import annotations

import torch


# Given (you wrote them in chapter 1): the acceptance probability and the residual.
def accept_prob(p_x: float, q_x: float) -> float:
    """min(1, p(x) / q(x)); for q(x) = 0: 1 if p(x) > 0 else 0."""
    if q_x > 0:
        return min(1.0, p_x / q_x)
    return 1.0 if p_x > 0 else 0.0


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) for [V] tensors; p itself when the residual is empty."""
    r = (p - q).clamp(min=0)  # [V]
    return r / r.sum() if r.sum() > 0 else p


def mss_with_replacement(candidates: list[int], p: torch.Tensor, q: torch.Tensor, chooser) -> tuple[int | None, int]:
    """MSS for candidates drawn i.i.d. from q (with replacement).

    Questions before coding: after x_i is rejected, what is the law of the token still to be
    emitted, so which target must round i + 1 test against? Does the draft distribution change
    between rounds when the candidates were drawn independently? The emitted token must have
    law exactly p.

    Args:
        candidates: [n] token ids, each drawn independently from q.
        p: [V] target distribution at the node.
        q: [V] draft distribution the candidates were drawn from.
        chooser: ``bernoulli(prob)`` / ``categorical(weights)``.
    Returns:
        (i, x_i) if candidate i is the first accepted, else (None, token drawn from p_n).
    """
    # EXERCISE 2.1: one chapter-1 step per candidate; which target must the next round use to keep the output p?
    # BEGIN SOLUTION
    for i, x in enumerate(candidates):
        if chooser.bernoulli(accept_prob(p[x].item(), q[x].item())):
            return i, x
        p = residual(p, q)  # [V]
    return None, chooser.categorical(p)
    # END SOLUTION


def mss_without_replacement(candidates: list[int], p: torch.Tensor, q: torch.Tensor, chooser) -> tuple[int | None, int]:
    """MSS for distinct candidates drawn from q without replacement (recursive rejection sampling).

    Questions before coding: from which distribution was candidate i really drawn, given that
    x_0..x_{i-1} could not be drawn again? So which q must round i use, and which target p_{i+1}
    follows a rejection? The emitted token must have law exactly p.

    Args:
        candidates: [n] distinct token ids, drawn from q without replacement in this order.
        p: [V] target distribution at the node.
        q: [V] draft distribution (before any candidate was removed).
        chooser: ``bernoulli(prob)`` / ``categorical(weights)``.
    Returns:
        (i, x_i) if candidate i is the first accepted, else (None, token drawn from p_n).
    """
    # EXERCISE 2.2: as 2.1, but each round must use the distribution its own candidate was drawn from
    # BEGIN SOLUTION
    for i, x in enumerate(candidates):
        if chooser.bernoulli(accept_prob(p[x].item(), q[x].item())):
            return i, x
        p = residual(p, q)  # [V]
        q = q.clone()
        q[x] = 0.0
        if q.sum() > 0:
            q = q / q.sum()
    return None, chooser.categorical(p)
    # END SOLUTION


def mss_onehot(candidates: list[int], p: torch.Tensor, chooser) -> tuple[int | None, int]:
    """MSS treating each candidate as drawn from a one-hot q (EAGLE's top-k drafts).

    Assumes the candidates were chosen deterministically from the context (e.g. the top-k of
    the draft model), not sampled, so there is no real q: treat each as drawn from
    q = one_hot(x_i). Questions to answer before coding: what does chapter 1's acceptance
    probability min(1, p/q) become for x_i under that q? What is left of p after x_i is
    rejected, i.e. what does residual(p, one_hot(x_i)) simplify to?

    Args:
        candidates: [n] token ids (a deterministic function of the context).
        p: [V] target distribution at the node.
        chooser: ``bernoulli(prob)`` / ``categorical(weights)``.
    Returns:
        (i, x_i) if candidate i is the first accepted, else (None, token drawn from p_n).
    """
    # EXERCISE 2.3: MSS with q a point mass on the candidate: what do the acceptance and the residual become?
    # BEGIN SOLUTION
    for i, x in enumerate(candidates):
        if chooser.bernoulli(min(1.0, p[x].item())):
            return i, x
        p = p.clone()
        p[x] = 0.0
        if p.sum() > 0:
            p = p / p.sum()
    return None, chooser.categorical(p)
    # END SOLUTION


def verify_tree(parents: list[int], tokens: list[int], p: torch.Tensor, q: torch.Tensor | None,
                mode: str, chooser) -> tuple[list[int], int]:
    """Verify a draft tree level by level, running MSS over the children of each accepted node.

    Layout ("row = node + 1"): node i has token tokens[i] and parent parents[i] (-1 for a child
    of the root, otherwise an earlier node index). Row 0 of p/q is the distribution at the root
    (for the root's children); row i + 1 is the distribution after node i (for node i's
    children, or the bonus token if node i is a leaf). Start at the root; at the current node
    run MSS over its children in increasing index order; if child c is accepted, move to it
    and repeat; if none is accepted (or the node has no children) stop with the emitted token.
    A chain is the tree parents = [-1, 0, 1, ..., k-1], and then this is ``verify_chain``.

    Args:
        parents: [N] parent index of each node, -1 for the root's children, parents[i] < i.
        tokens: [N] token id of each node.
        p: [N+1, V] target distributions by row.
        q: [N+1, V] draft distributions by row (None for mode "onehot").
        mode: "mss_replacement" (2.1), "mss_no_replacement" (2.2) or "onehot" (2.3).
        chooser: ``bernoulli(prob)`` / ``categorical(weights)``.
    Returns:
        (path, next_token): the accepted node indices from the root down (possibly empty) and
        the token emitted after the last of them. The step commits [tokens[i] for i in path]
        + [next_token].
    """
    # EXERCISE 2.4: group the nodes by parent, then walk down from the root with one MSS per level (2.1-2.3)
    # BEGIN SOLUTION
    children: list[list[int]] = [[] for _ in range(len(tokens) + 1)]  # by row: children[0] = root's
    for i, j in enumerate(parents):
        children[j + 1].append(i)
    path, row = [], 0
    while True:
        kids = children[row]
        xs = [tokens[i] for i in kids]
        if mode == "mss_replacement":
            idx, token = mss_with_replacement(xs, p[row], q[row], chooser)
        elif mode == "mss_no_replacement":
            idx, token = mss_without_replacement(xs, p[row], q[row], chooser)
        elif mode == "onehot":
            idx, token = mss_onehot(xs, p[row], chooser)
        else:
            raise ValueError(f"unknown mode {mode!r}")
        if idx is None:
            return path, token
        path.append(kids[idx])
        row = kids[idx] + 1
    # END SOLUTION
