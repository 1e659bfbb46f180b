"""Is speculative decoding really lossless? Exact and empirical checks on tiny vocabularies.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) and its tree/MSS variants
(SpecInfer, Miao et al. 2023; EAGLE, Li et al. 2024; recursive rejection sampling, Jeon et
al. 2024 / Yang et al. 2024) claim that the tokens they emit have exactly the law of sampling
from the target p. Here we check that claim two ways.

Exact enumeration. Every random choice of a speculative step (each draft draw, each
accept/reject coin, each residual or bonus draw) goes through a ``Chooser`` (see
``minispec.verify``). ``EnumeratingChooser`` answers those choices from a script and records
the probability of each answer; ``enumerate_outcomes`` replays the step once per script,
depth-first, until every branch with non-zero probability has been visited. So the SAME
drafting and verification code that runs in generation is summed over all of its random
outcomes, exactly, in float64 — no re-implementation that could share or hide a bug. With a
vocabulary of 3..6 tokens that is a few thousand replays per check. The result is compared with
the target's law: max abs error <= 1e-12.

The "model" is a ``ToyLM``: a table of p(. | context) and q(. | context) made lazily from a
seed, so multi-token checks see context-dependent distributions, like a real model. Settings
cover temperature, top-k / top-p truncation (q(x) = 0 for some tokens, partly disjoint
supports), p == q, fully disjoint supports and a one-hot (temperature 0) target.

Empirical check. ``empirical_check`` draws many first tokens from a sampler and reports the
total-variation distance to the target and a chi-square p-value, for distributions too big
to enumerate (real models, added later). Deliberately wrong verifiers (``CONTROLS``) must
fail both checks, which shows the checks have teeth.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable

import numpy as np
import scipy.stats
import torch

from minispec.sampling import GREEDY, SamplingParams, probs
from minispec.tree import Tree
from minispec.verify import TorchChooser, accept_prob, residual, sample_candidates, verify_chain, verify_tree

TOL = 1e-12


# --------------------------------------------------------------------------- enumeration
class EnumeratingChooser:
    """A Chooser that follows a script of answers and branches on everything past it.

    Past the end of the script it takes the first possible answer and pushes the scripts of
    the other answers onto ``pending``, so a depth-first replay visits every branch once.
    ``weight`` is the probability of the branch taken.
    """

    def __init__(self, script: list[int], pending: list[list[int]]):
        self.script, self.pending, self.made, self.weight = script, pending, [], 1.0

    def _choose(self, options: list, weights: list[float]):
        pos = len(self.made)
        if pos < len(self.script):
            j = self.script[pos]
        else:
            j = 0
            self.pending.extend(self.made + [alt] for alt in range(1, len(options)))
        self.made.append(j)
        self.weight *= weights[j]
        return options[j]

    def bernoulli(self, prob: float) -> bool:
        if not 0.0 <= prob <= 1.0:
            raise ValueError(f"bernoulli probability {prob} outside [0, 1]")
        branches = [(b, w) for b, w in ((True, prob), (False, 1.0 - prob)) if w > 0]
        return self._choose([b for b, _ in branches], [w for _, w in branches])

    def categorical(self, dist: torch.Tensor) -> int:
        d = dist.detach().double().cpu()
        idx = d.nonzero().flatten().tolist()  # only outcomes with non-zero probability
        total = d.sum().item()
        return self._choose(idx, [d[i].item() / total for i in idx])


def enumerate_outcomes(program: Callable) -> list[tuple[float, object]]:
    """All (probability, outcome) pairs of ``program(chooser)``; probabilities sum to 1."""
    out, pending = [], [[]]
    while pending:
        ch = EnumeratingChooser(pending.pop(), pending)
        result = program(ch)
        out.append((ch.weight, result))
    return out


def outcome_distribution(program: Callable) -> dict:
    """Law of ``program(chooser)``'s (hashable) outcome, as {outcome: probability}."""
    dist = defaultdict(float)
    for w, o in enumerate_outcomes(program):
        dist[o] += w
    return dict(dist)


def max_abs_error(a: dict, b: dict) -> float:
    """max_x |a(x) - b(x)| over the union of supports."""
    return max(abs(a.get(x, 0.0) - b.get(x, 0.0)) for x in set(a) | set(b))


# --------------------------------------------------------------------------- toy models
SETTINGS = ("random", "temperature", "top_k", "top_p", "sparse_q", "disjoint", "p_equals_q",
            "near_equal", "greedy_target")


def make_pair(setting: str, V: int, g: torch.Generator,
              scale: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One (p, q) pair of [V] float64 distributions of the named kind, via sampling.probs,
    from random logits of standard deviation ``scale``."""
    lp = scale * torch.randn(V, generator=g, dtype=torch.float64)
    lq = scale * torch.randn(V, generator=g, dtype=torch.float64)
    t1 = SamplingParams(1.0)
    if setting == "random":
        return probs(lp, t1), probs(lq, t1)
    if setting == "temperature":
        return probs(lp, SamplingParams(0.7)), probs(lq, SamplingParams(1.5))
    if setting == "top_k":  # supports of sizes 2 and 3, partly disjoint
        return probs(lp, SamplingParams(1.0, top_k=2)), probs(lq, SamplingParams(1.2, top_k=3))
    if setting == "top_p":
        return probs(lp, SamplingParams(0.8, top_p=0.8)), probs(lq, SamplingParams(1.0, top_p=0.7))
    if setting == "sparse_q":  # q(x) = 0 on a random half of the vocabulary
        drop = torch.randperm(V, generator=g)[: V // 2]
        return probs(lp, t1), probs(lq.index_fill(0, drop, -math.inf), t1)
    if setting == "disjoint":  # every draft is rejected
        perm = torch.randperm(V, generator=g)
        return (probs(lp.index_fill(0, perm[V // 2:], -math.inf), t1),
                probs(lq.index_fill(0, perm[: V // 2], -math.inf), t1))
    if setting == "p_equals_q":  # every draft is accepted
        return probs(lp, t1), probs(lp, t1)
    if setting == "near_equal":  # a tiny residual
        return probs(lp, t1), probs(lp + 1e-7 * lq, t1)
    if setting == "greedy_target":  # temperature 0 target, sampled draft
        return probs(lp, GREEDY), probs(lq, t1)
    raise ValueError(f"unknown setting {setting!r}; choose one of {SETTINGS}")


class ToyLM:
    """p(. | ctx) and q(. | ctx) for every context (a tuple of token ids), made lazily and
    deterministically from (seed, ctx). ``const`` fixes one (p, q) pair for every context."""

    def __init__(self, V: int, setting: str = "random", seed: int = 0, const=None):
        self.V, self.setting, self.seed, self.const = V, setting, seed, const
        self._rows: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def _pair(self, ctx: tuple):
        if self.const is not None:
            return self.const
        if ctx not in self._rows:
            code = self.seed
            for t in ctx:
                code = code * (self.V + 1) + t + 1
            g = torch.Generator().manual_seed(code * 7919 + len(ctx))
            self._rows[ctx] = make_pair(self.setting, self.V, g)
        return self._rows[ctx]

    def p(self, ctx: tuple) -> torch.Tensor:
        return self._pair(ctx)[0]

    def q(self, ctx: tuple) -> torch.Tensor:
        return self._pair(ctx)[1]


# --------------------------------------------------------------------------- one step
def chain_step(lm: ToyLM, ctx: tuple, k: int, chooser, verifier=verify_chain) -> tuple:
    """Draft k tokens from q, verify with ``verifier`` (verify_chain's signature).
    Returns the emitted tokens (accepted drafts + next token)."""
    xs: list[int] = []
    for _ in range(k):
        xs.append(chooser.categorical(lm.q(ctx + tuple(xs))))
    p = torch.stack([lm.p(ctx + tuple(xs[:i])) for i in range(k + 1)])  # [k+1, V]
    q = torch.stack([lm.q(ctx + tuple(xs[:i])) for i in range(k)]) if k else p[:0]  # [k, V]
    n, nxt = verifier(xs, p, q, chooser=chooser)
    return tuple(xs[:n]) + (nxt,)


def draft_tree(lm: ToyLM, ctx: tuple, branching: list[int], draft: str, chooser):
    """Grow a tree breadth-first: each node at depth d gets branching[d] children.

    draft: "iid" (from q with replacement), "no_replacement" or "topk" (deterministic).
    Returns (parents, tokens, p [N+1, V], q [N+1, V]) in verify_tree's row = node + 1 layout.
    """
    parents, tokens, ctxs, frontier = [], [], [], [(-1, ctx)]
    for b in branching:
        nxt = []
        for node, c in frontier:
            qc = lm.q(c)
            if draft == "topk":
                xs = torch.argsort(-qc, stable=True)[:b].tolist()
            else:
                xs = sample_candidates(qc, b, replacement=draft == "iid", chooser=chooser)
            for x in xs:
                parents.append(node), tokens.append(x), ctxs.append(c + (x,))
                nxt.append((len(tokens) - 1, c + (x,)))
        frontier = nxt
    p = torch.stack([lm.p(c) for c in [ctx] + ctxs])  # [N+1, V]
    q = torch.stack([lm.q(c) for c in [ctx] + ctxs])  # [N+1, V]
    return parents, tokens, p, q


DEFAULT_DRAFT = {"greedy": "topk", "onehot": "topk", "chain": "iid", "mss_replacement": "iid",
                 "mss_no_replacement": "no_replacement"}


def tree_step(lm: ToyLM, ctx: tuple, branching: list[int], mode: str, chooser,
              draft: str | None = None, verifier=verify_tree) -> tuple:
    """Draft a tree (the way ``mode`` assumes, unless ``draft`` says otherwise), verify it with
    ``verifier`` (verify_tree's signature). Returns the emitted tokens."""
    parents, tokens, p, q = draft_tree(lm, ctx, branching, draft or DEFAULT_DRAFT[mode], chooser)
    return tuple(verifier(Tree(tokens, parents, q), p, mode=mode, chooser=chooser).emitted)


# --------------------------------------------------------------------------- laws
def sequence_distribution(step: Callable, length: int, ctx: tuple = ()) -> dict:
    """Exact law of the first ``length`` tokens emitted by repeated speculative steps.

    step(ctx, chooser) -> emitted tokens. A step that emits fewer than ``length`` tokens is
    followed by another step from the extended context (memoised per context).
    """
    memo: dict = {}

    def law(c: tuple, n: int) -> dict:
        if (c, n) not in memo:
            out = defaultdict(float)
            for e, w in outcome_distribution(lambda ch: step(c, ch)).items():
                if len(e) >= n:
                    out[e[:n]] += w
                else:
                    for rest, w2 in law(c + e, n - len(e)).items():
                        out[e + rest] += w * w2
            memo[(c, n)] = dict(out)
        return memo[(c, n)]

    return law(tuple(ctx), length)


def target_distribution(lm: ToyLM, length: int, ctx: tuple = (), greedy: bool = False) -> dict:
    """Law of ``length`` tokens sampled one by one from p (argmax of p when greedy)."""
    out = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for seq, w in out.items():
            p = lm.p(ctx + seq)
            if greedy:
                p = torch.zeros_like(p).index_fill(0, p.argmax().view(1), 1.0)
            for x in p.nonzero().flatten().tolist():
                nxt[seq + (x,)] = w * p[x].item()
        out = nxt
    return out


# --------------------------------------------------------------------------- controls
def resample_from_p(draft_tokens, p, q, chooser):
    """WRONG: the Leviathan rule, but after a rejection draw from p instead of the residual."""
    for i, x in enumerate(draft_tokens):
        if not chooser.bernoulli(accept_prob(p[i, x].item(), q[i, x].item())):
            return i, chooser.categorical(p[i])
    return len(draft_tokens), chooser.categorical(p[len(draft_tokens)])


def accept_if_argmax(draft_tokens, p, q, chooser):
    """WRONG: greedy's rule used while sampling: keep a draft iff it is argmax p, else sample p."""
    for i, x in enumerate(draft_tokens):
        if x != int(p[i].argmax()):
            return i, chooser.categorical(p[i])
    return len(draft_tokens), chooser.categorical(p[len(draft_tokens)])


def ignore_q(draft_tokens, p, q, chooser):
    """WRONG: accept with min(1, p(x)) (q ignored) but still resample from norm(max(0, p - q))."""
    for i, x in enumerate(draft_tokens):
        if not chooser.bernoulli(min(1.0, p[i, x].item())):
            return i, chooser.categorical(residual(p[i], q[i]))
    return len(draft_tokens), chooser.categorical(p[len(draft_tokens)])


def control_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed (p, q) pair, V = 6, on which every control is off by >= 0.15 in TV."""
    lp = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5], dtype=torch.float64)
    lq = torch.tensor([2.5, -1.0, 1.0, 0.0, 1.5, 0.5], dtype=torch.float64)
    return probs(lp, temperature=1.0), probs(lq, temperature=1.0)


def _chain_program(k, verifier=verify_chain):
    return lambda lm, ctx, ch: chain_step(lm, ctx, k, ch, verifier)


def _tree_program(branching, mode, draft=None):
    return lambda lm, ctx, ch: tree_step(lm, ctx, branching, mode, ch, draft)


# name -> (step program (lm, ctx, chooser) -> emitted tokens, greedy target?)
VERIFIERS: dict[str, tuple[Callable, bool]] = {
    **{f"chain_k{k}": (_chain_program(k), False) for k in (1, 2, 3)},
    "chain_greedy_k2": (_chain_program(2, lambda *a, chooser: verify_chain(*a, greedy=True)), True),
    "tree_chain_k2": (_tree_program([1, 1], "chain"), False),
    **{f"{m}_n{n}": (_tree_program([n], m), False)
       for m in ("mss_replacement", "mss_no_replacement", "onehot") for n in (2, 3)},
    "onehot_sampled_n2": (_tree_program([2], "onehot", "iid"), False),
    "greedy_n2": (_tree_program([2], "greedy"), True),
}
TREE_VERIFIERS = {f"tree21_{m}": (_tree_program([2, 1], m), m == "greedy")
                  for m in ("mss_replacement", "mss_no_replacement", "onehot", "greedy")}
CONTROLS: dict[str, tuple[Callable, bool]] = {
    "resample_from_p": (_chain_program(1, resample_from_p), False),
    "accept_if_argmax": (_chain_program(1, accept_if_argmax), False),
    "ignore_q": (_chain_program(1, ignore_q), False),
    "real_q_rule_on_topk_drafts": (_tree_program([2], "mss_replacement", "topk"), False),
}


def enumeration_error(program: Callable, greedy_target: bool, lm: ToyLM, length: int = 1) -> float:
    """max abs error between the exact law of ``length`` emitted tokens and the target's."""
    law = sequence_distribution(lambda c, ch: program(lm, c, ch), length)
    return max_abs_error(law, target_distribution(lm, length, greedy=greedy_target))


def run_enumeration_suite(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Exact checks of every verifier over every setting; returns (records, controls).

    Each record: verifier, setting, max_abs_error, passed (error <= 1e-12). Controls are
    deliberately wrong verifiers: their records should have passed = False.
    """
    records, controls = [], []
    for i, setting in enumerate(SETTINGS):
        V = 3 + i % 4
        lm = ToyLM(V, setting, seed * 1000 + i)
        for name, (program, greedy) in VERIFIERS.items():
            if name == "chain_k3" and V > 4:
                lm_small = ToyLM(4, setting, seed * 1000 + i)
                err, where = enumeration_error(program, greedy, lm_small), f"{setting}/V4"
            else:
                err, where = enumeration_error(program, greedy, lm), f"{setting}/V{V}"
            records.append(dict(verifier=name, setting=where, max_abs_error=err, passed=err <= TOL))
    for i, setting in enumerate(("random", "top_k", "sparse_q", "greedy_target")):
        lm = ToyLM(3, setting, seed * 1000 + 100 + i)
        seqs = {**{f"chain_k{k}": VERIFIERS[f"chain_k{k}"] for k in (1, 2, 3)}, **TREE_VERIFIERS}
        for name, (program, greedy) in seqs.items():
            err = enumeration_error(program, greedy, lm, length=2)
            records.append(dict(verifier=name, setting=f"{setting}/V3/len2", max_abs_error=err,
                                passed=err <= TOL))
    for where, lm in (("random/V4", ToyLM(4, "random", seed * 1000 + 200)),
                      ("control_pair/V6", ToyLM(6, const=control_pair()))):
        for name, (program, greedy) in CONTROLS.items():
            err = enumeration_error(program, greedy, lm)
            controls.append(dict(verifier=name, setting=where, max_abs_error=err, passed=err <= TOL))
    return records, controls


# --------------------------------------------------------------------------- empirical
def tv_bound(n_samples: int, V: int, delta: float = 1e-6) -> float:
    """TV(empirical, p) stays below this with probability >= 1 - delta.

    E[TV] <= 0.5 * sum_x sqrt(p(x)/n) <= 0.5 * sqrt(V/n) (Cauchy-Schwarz), and TV moves by at
    most 1/n per sample, so McDiarmid adds sqrt(log(1/delta) / (2n)).
    """
    return 0.5 * math.sqrt(V / n_samples) + math.sqrt(math.log(1 / delta) / (2 * n_samples))


def chi_square_p(counts, law, min_expected: float = 5.0) -> float:
    """p-value of Pearson's chi-square test that ``counts`` [K] were drawn from ``law`` [K].

    Bins whose expected count is below ``min_expected`` are merged, smallest first, so that the
    chi-square approximation holds. A draw in a bin of probability 0 gives 0; a single bin left
    after merging gives 1 (nothing to test). Far more powerful than ``tv_bound`` against a small
    deviation spread over many outcomes: it weighs each bin by its own variance.
    """
    counts, law = np.asarray(counts, dtype=float), np.asarray(law, dtype=float)
    expected = law * counts.sum()
    if counts[expected == 0].sum() > 0:
        return 0.0
    order = np.argsort(expected)
    obs_b, exp_b, o, e = [], [], 0.0, 0.0
    for j in order[expected[order] > 0]:  # merge the smallest bins until big enough
        o, e = o + counts[j], e + expected[j]
        if e >= min_expected:
            obs_b.append(o), exp_b.append(e)
            o, e = 0.0, 0.0
    if e > 0:
        if exp_b:
            obs_b[-1] += o
            exp_b[-1] += e
        else:
            obs_b.append(o), exp_b.append(e)
    if len(exp_b) < 2:
        return 1.0
    exp_b = np.array(exp_b) * (sum(obs_b) / sum(exp_b))  # exact totals for scipy
    return float(scipy.stats.chisquare(obs_b, exp_b).pvalue)


def samples_for_tv(tv: float, K: int, delta: float = 1e-6) -> int:
    """The fewest samples n with ``tv_bound(n, K, delta) <= tv``: below it, a sampler whose law is
    ``tv`` away from the target cannot be told from an exact one by the TV check."""
    if not 0 < tv <= 1:
        raise ValueError(f"tv must be in (0, 1], got {tv}")
    return math.ceil(((0.5 * math.sqrt(K) + math.sqrt(math.log(1 / delta) / 2)) / tv) ** 2)


def empirical_check(verifier: Callable, p: torch.Tensor, q: torch.Tensor, n_samples: int,
                    generator: torch.Generator | None = None, target: torch.Tensor | None = None,
                    min_expected: float = 5.0) -> dict:
    """Sample ``verifier(p, q, generator) -> token`` n times and compare with the target.

    Args:
        verifier: draws one token (e.g. the first token of a speculative step).
        p, q: passed to the verifier; the target is p (if 1-D) or p[0] unless given.
        n_samples: number of draws.
        generator: torch.Generator handed to every call.
        target: [V] the law the tokens should have.
        min_expected: bins with smaller expected counts are merged for the chi-square test.
    Returns:
        dict(tv, tv_bound, p_value, samples, counts). p_value is 0 if a token with target
        probability 0 was drawn, 1 if only one bin is left after merging.
    """
    target = (target if target is not None else (p if p.dim() == 1 else p[0])).double().cpu()
    V = target.shape[0]
    counts = np.bincount([int(verifier(p, q, generator)) for _ in range(n_samples)], minlength=V)
    expected = target.numpy() * n_samples
    tv = 0.5 * float(np.abs(counts / n_samples - target.numpy()).sum())
    p_value = chi_square_p(counts, target.numpy(), min_expected)
    return dict(tv=tv, tv_bound=tv_bound(n_samples, V), p_value=p_value, samples=n_samples,
                counts=counts.tolist())


def first_token_sampler(program: Callable) -> Callable:
    """Turn a step program (as in VERIFIERS) into verifier(p, q, generator) -> first token,
    with the same (p, q) at every context."""

    def draw(p, q, generator):
        lm = ToyLM(p.shape[-1], const=(p, q))
        return program(lm, (), TorchChooser(generator))[0]

    return draw


EMPIRICAL_SETTINGS = ("random", "temperature", "top_k", "top_p")
EMPIRICAL_VERIFIERS = ("chain_k1", "chain_k2", "tree_chain_k2", "mss_replacement_n3", "mss_no_replacement_n3", "onehot_n3",
                       "greedy_n2", "tree21_mss_replacement", "tree21_mss_no_replacement", "tree21_onehot")


def run_empirical_suite(n_samples: int = 20000, seed: int = 0,
                        verifiers: tuple[str, ...] | None = None,
                        control_samples: int | None = None) -> tuple[list[dict], list[dict]]:
    """Sample each verifier's first token on a random small (p, q); returns (records, controls).

    Each record: verifier, setting, tv, tv_bound, p_value, samples, passed (tv <= tv_bound
    and p_value > 1e-4). Settings cycle through temperature and top-k / top-p variants made
    by sampling.probs (greedy verifiers are compared with the argmax). Controls (wrong
    verifiers, on ``control_pair()``, ``control_samples`` draws each, default n_samples)
    should have passed = False.
    """
    names = verifiers or EMPIRICAL_VERIFIERS
    g = torch.Generator().manual_seed(seed)
    records, controls = [], []
    programs = {**VERIFIERS, **TREE_VERIFIERS}
    jobs = [(n, programs[n], EMPIRICAL_SETTINGS[i % len(EMPIRICAL_SETTINGS)], records)
            for i, n in enumerate(names)]
    jobs += [(n, c, "control_pair", controls) for n, c in CONTROLS.items()]
    for i, (name, (program, greedy), setting, out) in enumerate(jobs):
        V = 5 + i % 3
        if out is controls:
            (p, q), V, n = control_pair(), 6, control_samples or n_samples
        else:
            p, q = make_pair(setting, V, torch.Generator().manual_seed(seed * 1000 + 17 + i), scale=1.0)
            n = n_samples
        target = torch.zeros_like(p).index_fill(0, p.argmax().view(1), 1.0) if greedy else p
        r = empirical_check(first_token_sampler(program), p, q, n, g, target)
        r.pop("counts")
        r.update(verifier=name, setting=f"{setting}/V{V}",
                 passed=r["tv"] <= r["tv_bound"] and r["p_value"] > 1e-4)
        out.append(r)
    return records, controls
