"""Checks of chapter 1's exercises (solutions/ch01_rejection_sampling.py): rejection sampling.

    1.1 accept_prob       min(1, p/q) on fixed and random cases, q = 0 included
    1.2 residual          norm(max(0, p - q)) against minispec.verify.residual, p == q, batches
    1.3 verify_chain      exact law of the emitted tokens == target (enumeration over every random
                          choice), and exact law of (n, next token) == minispec's verify_chain
    1.4 expected_tokens   the geometric series, alpha = 0 and 1 included
    1.5 best_k            the chain length of the highest modelled speedup, smallest on ties, against
                          brute force over k
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import numpy as np
import torch

from minispec.lab import exactness as ex
from minispec.lab import analysis
from minispec import verify as vf
from minispec.lab.cost_check import best_k

from .checks import as_int, compare_laws, exercise, get, law

TITLE = "Rejection sampling (speculative sampling of one chain)"
MODULE = "ch01_rejection_sampling"  # solutions/<MODULE>.py, exercises/<MODULE>.py
EXERCISES: list = []


def library():
    """minispec's own functions behind the exercises' signatures (``--impl minispec``)."""
    return SimpleNamespace(
        __name__="minispec.verify (chapter 1 adapter)",
        accept_prob=vf.accept_prob,
        residual=vf.residual,
        verify_chain=lambda draft_tokens, p, q, chooser: vf.verify_chain(draft_tokens, p, q, chooser=chooser),
        expected_tokens=analysis.expected_tokens,
        best_k=best_k,
    )


def _pairs(settings, V: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(s, *ex.make_pair(s, V, g)) for s in settings]


@exercise(EXERCISES, "1.1", "accept_prob")
def check_accept_prob(impl):
    fn = get(impl, "accept_prob")
    cases = [(0.5, 0.25), (0.2, 0.4), (0.3, 0.3), (0.0, 0.5), (1.0, 1e-3), (0.4, 0.0), (0.0, 0.0)]
    rng = np.random.default_rng(0)
    cases += [tuple(float(v) for v in rng.random(2)) for _ in range(30)]
    for p_x, q_x in cases:
        got, want = fn(p_x, q_x), vf.accept_prob(p_x, q_x)
        try:
            got_f = float(got)
        except (TypeError, ValueError):
            raise AssertionError(f"accept_prob({p_x!r}, {q_x!r}) returned {got!r}, not a number") from None
        if not abs(got_f - want) <= 1e-12:
            raise AssertionError(f"accept_prob(p_x={p_x:.4g}, q_x={q_x:.4g}) returned {got_f!r}, expected {want!r}")


@exercise(EXERCISES, "1.2", "residual")
def check_residual(impl):
    fn = get(impl, "residual")
    V = 6
    cases = _pairs(("random", "temperature", "top_k", "sparse_q", "disjoint", "near_equal"), V, 12)
    for setting, p, q in cases:
        p0, q0 = p.clone(), q.clone()
        r = fn(p, q)
        if not torch.equal(p, p0) or not torch.equal(q, q0):
            raise AssertionError("residual modified its inputs p or q in place")
        if not torch.is_tensor(r) or tuple(r.shape) != (V,):
            raise AssertionError(f"residual(p, q) for p, q of shape [{V}] returned {getattr(r, 'shape', type(r))}")
        want = vf.residual(p, q)
        err = (r.double() - want).abs().max().item()
        if not err <= 1e-12:
            raise AssertionError(f"residual(p, q) differs from norm(max(0, p - q)) by {err:.3g} (max abs) on V={V} "
                                 f"({setting!r} pair): got {[round(v, 4) for v in r.tolist()]}, "
                                 f"expected {[round(v, 4) for v in want.tolist()]}")
    p = cases[0][1]
    r = fn(p, p.clone())
    if not torch.is_tensor(r) or not bool(torch.isfinite(r).all()) or (r.double() - p).abs().max().item() > 1e-12:
        raise AssertionError(f"when p == q the residual is empty; return p itself (got {r})")
    P = torch.stack([c[1] for c in cases[:3]] + [p])  # [4, V]: the last row has p == q
    Q = torch.stack([c[2] for c in cases[:3]] + [p])  # [4, V]
    R = fn(P, Q)
    if not torch.is_tensor(R) or tuple(R.shape) != (4, V):
        raise AssertionError(f"residual on a batch p, q of shape [4, {V}] returned {getattr(R, 'shape', type(R))}")
    err = (R.double() - vf.residual(P, Q)).abs().max().item()
    if not err <= 1e-12:
        raise AssertionError(f"on a batch of shape [4, {V}] (normalise each row over the last dimension; "
                             f"the last row has p == q) the result differs by {err:.3g} (max abs)")


def _chain_program(fn, k):
    def verifier(xs, p, q, chooser):
        n, nxt = fn(list(xs), p, q, chooser)
        return as_int(n, "n"), as_int(nxt, "next_token")

    return lambda lm, ctx, ch: ex.chain_step(lm, ctx, k, ch, verifier)


@exercise(EXERCISES, "1.3", "verify_chain")
def check_verify_chain(impl):
    fn = get(impl, "verify_chain")
    # 1. The emitted tokens have exactly the target's law: every random outcome enumerated.
    for (V, k, length), setting in itertools.product([(4, 1, 1), (4, 2, 1), (3, 2, 2), (3, 3, 2)],
                                                     ("random", "top_k", "sparse_q", "disjoint", "p_equals_q")):
        lm = ex.ToyLM(V, setting, seed=31)
        got = ex.sequence_distribution(lambda c, ch: _chain_program(fn, k)(lm, c, ch), length)
        what = "output distribution" if length == 1 else f"law of the first {length} emitted tokens"
        compare_laws(got, ex.target_distribution(lm, length), f"{what} differs from p",
                     f"on V={V}, k={k} ({setting!r} toy model)", label=lambda s: f"tokens={list(s)}")
    # 2. For fixed drafts, the law of (n, next token) is the reference's: same acceptance, not only same output.
    V, k = 4, 2
    for setting in ("random", "top_k", "sparse_q"):
        lm = ex.ToyLM(V, setting, seed=57)
        for xs in itertools.product(range(V), repeat=k):
            q = torch.stack([lm.q(xs[:i]) for i in range(k)])  # [k, V]
            if any(q[i, x] == 0 for i, x in enumerate(xs)):
                continue  # a draft q could not have produced
            p = torch.stack([lm.p(xs[:i]) for i in range(k + 1)])  # [k+1, V]
            got = law(lambda ch: tuple(as_int(v, "verify_chain's output") for v in fn(list(xs), p, q, ch)))
            want = law(lambda ch: vf.verify_chain(list(xs), p, q, chooser=ch))
            compare_laws(got, want, "the law of (n accepted, next token) differs from minispec's verify_chain",
                         f"for drafts {list(xs)} on V={V}, k={k} ({setting!r} pair)",
                         label=lambda o: f"n={o[0]}, next={o[1]}" if isinstance(o, tuple) and len(o) == 2 else repr(o))


@exercise(EXERCISES, "1.4", "expected_tokens")
def check_expected_tokens(impl):
    fn = get(impl, "expected_tokens")
    for alpha in (0.0, 0.1, 0.5, 0.8, 0.95, 0.999999, 1.0):
        for k in (0, 1, 2, 4, 8):
            want = sum(alpha ** i for i in range(k + 1))
            got = fn(alpha, k)
            if not math.isclose(float(got), want, rel_tol=1e-6):
                raise AssertionError(f"expected_tokens(alpha={alpha}, k={k}) returned {got!r}, expected {want:.6g}")


@exercise(EXERCISES, "1.5", "best_k")
def check_best_k(impl):
    fn = get(impl, "best_k")
    cases = [(0.0, 0.0, 8), (0.0, 0.3, 8), (1.0, 0.0, 8), (1.0, 0.5, 8), (0.5, 0.0, 0), (0.8, 0.1, 16),
             (0.6, 0.05, 16), (0.9, 0.02, 16), (0.8, 0.2, 16), (0.3, 0.5, 16), (0.95, 0.01, 40)]
    rng = np.random.default_rng(0)
    cases += [(float(a), float(c), 16) for a, c in zip(rng.random(40), rng.random(40) * 0.3)]
    for alpha, c, k_max in cases:
        want = best_k(alpha, c, k_max)
        got = fn(alpha, c, k_max)
        if as_int(got, f"best_k(alpha={alpha:.4g}, c={c:.4g}, k_max={k_max})") != want:
            s = [analysis.speedup(alpha, k, c) for k in range(k_max + 1)]
            raise AssertionError(
                f"best_k(alpha={alpha:.4g}, c={c:.4g}, k_max={k_max}) returned {got!r}, expected {want} (modelled "
                f"speedup {s[want]:.4f}x there" + (f", {s[int(got)]:.4f}x at {int(got)}" if 0 <= int(got) <= k_max else "")
                + "; on a tie the smallest k)")
