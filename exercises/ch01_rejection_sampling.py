# Exercises generated from solutions/ch01_rejection_sampling.py by tools/make_exercises.py.
# Replace each `raise NotImplementedError(...)` with your code; keep the signatures.
"""Chapter 1 exercises: speculative sampling of one chain of drafts (rejection sampling).

References:
    Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative Decoding" (2023).
    Chen et al., "Accelerating Large Language Model Decoding with Speculative Sampling" (2023).

Notation: ``p`` is the target distribution and ``q`` the draft distribution, both [V] (or
[..., V]) float64 tensors summing to 1; ``k`` (gamma) is the number of drafted tokens. The
notebook derives the acceptance rule and the residual; these exercises turn the derivation
into code, edge cases included.

Randomness: every random choice goes through a ``chooser`` with two methods,
``chooser.bernoulli(prob) -> bool`` (True with probability prob) and
``chooser.categorical(weights) -> int`` (an index drawn from non-negative weights [V], normalised
for you). The grader passes a chooser that walks every outcome, so it can compute the exact law
of your function's output: do not call torch.rand / random / numpy.random yourself.

Check your work: ``python -m minispec grade 1``, or ``minispec.grading.check("1.2")`` in a
notebook, or ``pytest tests/test_exercises.py -m ch01 --impl exercises``.
"""

from __future__ import annotations

import torch


def accept_prob(p_x: float, q_x: float) -> float:
    """Probability of accepting a drafted token x, given the target's and the draft's probabilities of it.

    The one property the proof of exactness needs: the mass that gets through, q(x) times this
    probability, must be min(p(x), q(x)). Define it also for q(x) = 0, which cannot happen for a
    token really drawn from q, so that the rule is total: what must it be there for a token the
    target emits (p(x) > 0), and for one it never emits?

    Args:
        p_x: p(x), the target's probability of the drafted token (a float in [0, 1]).
        q_x: q(x), the draft's probability of the same token (a float in [0, 1]).
    Returns:
        The acceptance probability, a float in [0, 1].
    """
    # EXERCISE 1.1: accept so that q(x) * P(accept x) = min(p(x), q(x)); the docstring covers q_x = 0
    raise NotImplementedError("Exercise 1.1: accept so that q(x) * P(accept x) = min(p(x), q(x)); the docstring covers q_x = 0")


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The distribution to sample from after a rejection.

    Questions before coding: after drafts are accepted as in 1.1, which tokens are still
    under-represented in the output, and by how much each? What is the total mass of that
    shortfall, and how does it relate to the rejection probability? When p == q that mass is
    0 (every draft is accepted, so the residual is never used): return p itself then, so the
    result is always a distribution.

    Args:
        p: [..., V] target distribution(s).
        q: [..., V] draft distribution(s), same shape as p.
    Returns:
        [..., V] residual distribution(s), each row summing to 1 (p's row where the residual
        is empty). The inputs are not modified.
    """
    # EXERCISE 1.2: what accepted drafts leave of p, as a distribution per row (mind an empty residual)
    raise NotImplementedError("Exercise 1.2: what accepted drafts leave of p, as a distribution per row (mind an empty residual)")


def verify_chain(draft_tokens: list[int], p: torch.Tensor, q: torch.Tensor, chooser) -> tuple[int, int]:
    """Speculative sampling of one chain of k drafted tokens (Leviathan et al. 2023, Alg. 1).

    Walk the drafts in order, deciding each with 1.1; decide what to emit at the first
    rejection (1.2) and what to emit when all k drafts survive (a "bonus" token: which row of p
    is it drawn from?). Why must the walk stop at the first rejection?

    Args:
        draft_tokens: [k] token ids x_0..x_{k-1}, x_i drawn from q_i.
        p: [k+1, V] target distributions; row i is the target's distribution for position i
            (after the context and x_0..x_{i-1}); row k is for the bonus token.
        q: [k, V] draft distributions; row i is the distribution x_i was drawn from.
        chooser: source of randomness: ``chooser.bernoulli(prob)`` and
            ``chooser.categorical(weights)`` (see the module docstring).
    Returns:
        (n, next_token): n accepted drafts (0..k) and the token emitted after them. The step
        commits draft_tokens[:n] + [next_token]: between 1 and k+1 tokens.
    """
    # EXERCISE 1.3: one accept/reject per draft, in order: what ends the step, and what is emitted after it?
    raise NotImplementedError("Exercise 1.3: one accept/reject per draft, in order: what ends the step, and what is emitted after it?")


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens committed per target forward by a chain of k drafts.

    Each draft is accepted independently with probability alpha, and a step always commits
    one more token after its accepted drafts (the residual or bonus token). Questions to answer
    before coding: with what probability does a step accept at least i drafts? What does the
    sum of those probabilities become in closed form, and what happens to that closed form at
    alpha = 1? (Sanity checks: k = 0 is plain decoding; alpha = 0 commits one token a step.)

    Args:
        alpha: acceptance rate in [0, 1].
        k: number of drafted tokens, an integer >= 0.
    Returns:
        The expected number of tokens per step, a float in [1, k + 1].
    """
    # EXERCISE 1.4: a finite geometric series; what does its closed form become at alpha = 1?
    raise NotImplementedError("Exercise 1.4: a finite geometric series; what does its closed form become at alpha = 1?")


def best_k(alpha: float, c: float, k_max: int = 16) -> int:
    """The draft length k in 0..k_max with the highest expected speedup over plain decoding, under
    section 5's cost model: each draft accepted independently with probability alpha, a draft
    forward costing c target forwards, a verification costing one target forward. On a tie, the
    smallest k (as fast, with fewer drafts).

    Questions to answer before coding: what does a step of k drafts commit on average (your
    ``expected_tokens``), and what does it cost in target forwards? Is the speedup monotone in
    k, or does it have a best k? When does drafting not pay at all, and what must k be then?

    Args:
        alpha: acceptance rate in [0, 1].
        c: draft/target cost ratio, >= 0.
        k_max: the longest chain considered, an integer >= 0.
    Returns:
        k, an int in [0, k_max].
    """
    # EXERCISE 1.5: the speedup of every k from expected_tokens and the cost of a step; pick the best, smallest on ties
    raise NotImplementedError("Exercise 1.5: the speedup of every k from expected_tokens and the cost of a step; pick the best, smallest on ties")
