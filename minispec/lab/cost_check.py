"""Closing the cost model on a run: a speculative run's speedup predicted from its own clock, step by
step from chapter 1's formula to the measured figure.

Chapter 1 (Leviathan et al. 2023, Thm 3.8) predicts, in units of one target forward,

    speedup = E[tau](alpha, k) / (k c + 1),   E[tau] = 1 + alpha + ... + alpha^k

with i.i.d. acceptance alpha, a verification that costs one forward whatever k, and nothing else
in a step. A real run breaks each assumption a little; ``cost_check`` measures by how much, from
the decode loop's own clock (``GenerationStats.phase_s``) of a vanilla run and a speculative run of
the same prompts, in units of t0 = one vanilla decode step:

    alpha        drafts accepted / drafts tested, pooled over depths (the i.i.d. fit)
    alpha_d      acceptance at depth d given the earlier depths accepted: E[tau] = 1 + a1 + a1 a2 + ...
    tau          tokens committed per decode step, measured
    c            draft time per draft forward / t0;  k' = draft forwards per step, measured (a
                 model-free drafter, prompt lookup, counts k per step)
    v            target time per speculative step / t0: verifying k + 1 rows costs more than one
    l0           the rest of a vanilla step (sampling, KV commit, Python) / t0; its forward is 1 - l0
    l            the rest of a speculative step (sampling, verification, KV commit, hand-off, Python) / t0

and each line of ``CostCheck.table()`` swaps one assumption for its measurement:

    Leviathan                E[tau](alpha, k) / (k c + 1)
    + alpha by depth         (1 + a1 + a1 a2 + ...) / (k c + 1)
    + measured tau           tau / (k c + 1)
    + verify cost            tau / (k' c + v + l0)       (the forward costs v, the rest as vanilla's)
    + loop                   tau / (k' c + v + l)        = the measured decode speedup (the phases
                                                           add up to the decode time)

Only the decode phase is compared (prefill excluded), so the last line equals
(tokens / decode s of the speculative run) / (tokens / decode s of the vanilla run).

No line predicts a speedup above its tokens per step: that would need a speculative step cheaper
than a vanilla one, while it runs the same forward over more rows and drafts besides. A
prediction that would (``predicted_speedup``: a step cost below one vanilla step) is refused, with
the reason: the clock put time in the wrong phase (a GPU timed without events put the forward's
time into verification, docs/gpu.md), the two runs differ by noise, or the device runs one row
slower than several. The measured line is a measurement and is kept as measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence

from .analysis import expected_tokens, speedup
from .text_table import Col, text_table
from ..generate import add_by_depth


def best_k(alpha: float, c: float, k_max: int = 16) -> int:
    """The chain length k in 0..k_max that chapter 1's model (``minispec.lab.analysis.speedup``) predicts
    fastest for acceptance alpha and cost ratio c; the smallest k on a tie (within 1e-12 relative)."""
    if not isinstance(k_max, int) or k_max < 0:
        raise ValueError(f"k_max must be an integer >= 0, got {k_max!r}")
    s = [speedup(alpha, k, c) for k in range(k_max + 1)]  # validates alpha and c
    top = max(s)
    return next(k for k, v in enumerate(s) if v >= top / (1 + 1e-12))


def predicted_speedup(tau: float, step_cost: float) -> tuple[float | None, str | None]:
    """The cost model's speedup of a speculative step that commits ``tau`` tokens and costs ``step_cost``
    vanilla steps: (tau / step_cost, None), or (None, why) where that would exceed tau (``step_cost`` < 1).

    The model assumes that a speculative step, which runs the target's forward over the root and its drafts
    and drafts besides, costs at least the vanilla step, whose forward is over the root alone. A step priced
    below it says one of: the phases were timed wrongly (a GPU timed without events put the forward's time
    into verification), the runs differ by noise, or the device runs a forward of one row slower than one of
    several (then vanilla should pad its row, as minispec's CPU kernels do, rather than speculation claim
    the difference). None of these is a speedup of speculation, so no figure is given. ValueError for a step
    cost that is not positive."""
    if not step_cost > 0:
        raise ValueError(f"a speculative step must cost a positive time, got {step_cost!r} vanilla steps")
    if step_cost < 1.0:
        return None, (f"refused: a speculative step priced at {step_cost:.3f} vanilla steps would give "
                      f"{tau / step_cost:.2f}x at tau {tau:.2f}, above tau: the phases were timed wrongly, the runs "
                      "differ by noise, or one row's forward is slower than several on this device (docs/gpu.md)")
    return tau / step_cost, None


@dataclass(frozen=True)
class CostCheck:
    """The measured inputs of the cost model (units: one vanilla decode step) and its predictions."""
    k: int  # drafts per chain step in chapter 1's formula
    alpha: float
    alpha_by_depth: tuple[float, ...]
    tau: float
    c: float
    drafts_per_step: float
    v: float
    loop: float
    measured: float
    vanilla_loop: float = 0.0  # l0: the part of a vanilla step outside its target forward

    def predictions(self) -> list[tuple[str, float, float, float | None]]:
        """(assumption replaced, tokens per step, step cost in vanilla steps, predicted speedup) per line; the
        speedup is None where the model refuses it (``predicted_speedup``: above tau; ``refusals`` says why).
        The last line is the measured speedup, kept as measured."""
        return [(name, t, cost, s) for name, t, cost, s, _ in self._lines()]

    @property
    def refusals(self) -> dict[str, str]:
        """{line: why} for every line whose prediction the model refused (``predicted_speedup``)."""
        return {name: why for name, _, _, _, why in self._lines() if why}

    def _lines(self) -> list[tuple[str, float, float, float | None, str | None]]:
        k, c = self.k, self.c
        by_depth, prod = 1.0, 1.0
        for a in self.alpha_by_depth[:k]:
            prod *= a
            by_depth += prod
        lines = [("Leviathan: iid alpha, verify = 1 forward", expected_tokens(min(max(self.alpha, 0.0), 1.0), k), k * c + 1),
                 ("+ alpha by depth", by_depth, k * c + 1),
                 ("+ measured tau", self.tau, k * c + 1),
                 ("+ verify cost v", self.tau, self.drafts_per_step * c + self.v + self.vanilla_loop)]
        out = [(name, t, cost, *predicted_speedup(t, cost)) for name, t, cost in lines]
        loop_cost = self.drafts_per_step * c + self.v + self.loop  # = the measured ratio: reported as measured
        return out + [("+ loop l (sampling, commit, Python)", self.tau, loop_cost, self.tau / loop_cost, None)]

    def table(self) -> str:
        rows = [f"alpha {self.alpha:.3f} (by depth " + " ".join(f"{a:.2f}" for a in self.alpha_by_depth) +
                f"), tau {self.tau:.2f}, k {self.k}, c {self.c:.3f}, draft forwards/step {self.drafts_per_step:.2f}, "
                f"v {self.v:.3f}, l0 {self.vanilla_loop:.3f}, l {self.loop:.3f} (units: one vanilla decode step)"]
        cols = [Col("model", width=40, left=True), Col("tokens/step", ".2f"), Col("step cost", ".2f"), Col("speedup", width=8)]
        rows += text_table(cols, [[name, t, cost, "refused" if s is None else f"{s:.2f}x"]
                                  for name, t, cost, s in self.predictions()]
                           + [["measured (decode tokens/s ratio)", "", "", f"{self.measured:.2f}x"]])
        rows += [f"{name}: {why}" for name, why in self.refusals.items()]
        return "\n".join(rows)


def _decode(stats) -> tuple[int, int, float]:
    """(decode steps, tokens they committed, decode seconds) of one GenerationStats: entry 0 of
    tokens_per_step is the prefill's token."""
    steps = stats.tokens_per_step[1:]
    return len(steps), sum(steps), stats.decode_s


def cost_check(vanilla: Sequence, spec: Sequence, k: int | None = None) -> CostCheck:
    """Chapter 1's cost model against a run: ``vanilla`` and ``spec`` are GenerationStats (or results with
    ``.stats``) of the same prompts, one per prompt. ``k``: drafts per step in the formula (default:
    the deepest depth the speculative run tested). ValueError if a run has no decode step or tested no draft."""
    van = [getattr(s, "stats", s) for s in vanilla]
    sp = [getattr(s, "stats", s) for s in spec]
    if not van or not sp:
        raise ValueError("cost_check needs at least one vanilla and one speculative run")
    v_steps, v_tokens, v_s = (sum(x) for x in zip(*map(_decode, van)))
    s_steps, s_tokens, s_s = (sum(x) for x in zip(*map(_decode, sp)))
    tested, accepted = [], []
    for s in sp:
        add_by_depth(tested, s.tested_at_depth)
        add_by_depth(accepted, s.accepted_at_depth)
    accepted += [0] * (len(tested) - len(accepted))
    if not v_steps or not s_steps or not sum(tested):
        raise ValueError("both runs need decode steps, and the speculative run tested drafts")
    k = k if k is not None else len(tested)
    t0 = v_s / v_steps  # one vanilla decode step
    v_target = sum(s.phase_s.get("target", 0.0) for s in van)  # vanilla's forwards; the rest of its steps is l0
    phase = {ph: sum(s.phase_s.get(ph, 0.0) for s in sp) for ph in sp[0].phase_s}
    # a model-free drafter (prompt lookup) runs no draft forward: its draft time counts as k per step
    drafts = sum(s.draft_forwards for s in sp) or k * s_steps
    rest = s_s - phase.get("draft", 0.0) - phase.get("target", 0.0)  # every other phase (and untimed gaps)
    return CostCheck(
        k=k,
        alpha=sum(accepted) / sum(tested),
        alpha_by_depth=tuple(a / t for a, t in zip(accepted, tested) if t),
        tau=s_tokens / s_steps,
        c=phase.get("draft", 0.0) / drafts / t0,
        drafts_per_step=drafts / s_steps,
        v=phase.get("target", 0.0) / s_steps / t0,
        loop=rest / s_steps / t0,
        measured=(s_tokens / s_s) / (v_tokens / v_s),
        vanilla_loop=(v_s - v_target) / v_steps / t0)


