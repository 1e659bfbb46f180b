"""Shared by the sampled-law tests: the exact joint law of the first three new tokens, the empirical
law of speculative generation over many seeds, and the chi-square / TV comparison of the two."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from scipy.stats import chisquare

from minispec import generate
from minispec.sampling import probs


def exact_law(model, ids: list[int], params: dict) -> dict[tuple[int, int, int], float]:
    """P(x1, x2, x3 | ids) under the target's sampling law ``params``, by enumeration of the support."""
    exact = {}
    with torch.no_grad():
        def p_after(seq):
            return probs(model(torch.tensor([seq])).logits[0, -1].double(), **params)
        p1 = p_after(ids)
        for a in p1.nonzero().flatten().tolist():
            p2 = p_after(ids + [a])
            for b in p2.nonzero().flatten().tolist():
                p3 = p_after(ids + [a, b])
                for c in p3.nonzero().flatten().tolist():
                    exact[(a, b, c)] = (p1[a] * p2[b] * p3[c]).item()
    return exact


@dataclass
class Sampled:
    counts: dict
    n: int
    tested: int  # draft nodes verified, summed over the runs
    accepted: int  # draft nodes accepted


def sample_law(model, tok, ids: list[int], make_drafter, exact: dict, n: int, params: dict) -> Sampled:
    """Counts of the first three tokens of ``n`` speculative generations (seeds 0..n-1), each with a fresh
    drafter from ``make_drafter()``. A KeyError means an impossible sequence was emitted."""
    counts = dict.fromkeys(exact, 0)
    tested = accepted = 0
    for s in range(n):
        r = generate(model, tok, ids, drafter=make_drafter(), max_new_tokens=3, seed=s, **params)
        counts[tuple(r.tokens)] += 1
        tested += sum(r.stats.tested_at_depth)
        accepted += sum(r.stats.accepted_at_depth)
    return Sampled(counts, n, tested, accepted)


def assert_same_law(sampled: Sampled, exact: dict, max_tv: float = 0.1, min_p: float = 1e-3) -> None:
    """Chi-square does not reject the exact law, and the TV distance is small."""
    obs = [sampled.counts[k] for k in exact]
    exp = [exact[k] * sampled.n for k in exact]
    tv = 0.5 * sum(abs(o - e) for o, e in zip(obs, exp)) / sampled.n
    p = chisquare(obs, exp).pvalue
    assert p > min_p and tv < max_tv, (tv, p)
