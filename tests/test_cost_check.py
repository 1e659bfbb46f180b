"""Chapter 1's cost model closed on a run (``minispec.lab.cost_check``)."""

from __future__ import annotations

import pytest

from minispec import generate
from minispec.lab.cost_check import CostCheck, cost_check
from minispec.drafters import DraftModel
from minispec.generate import GenerationStats
from minispec.loading import load
from minispec.lab.analysis import speedup


@pytest.fixture(scope="module")
def runs():
    (model, tok), (draft, _) = load("tiny-llama"), load("tiny-gpt2-draft")
    prompts = ["abcabc", "hello world", "the cat"]
    van = [generate(model, tok, p, max_new_tokens=24, chat=False, stop_at_eos=False) for p in prompts]
    spec = [generate(model, tok, p, drafter=DraftModel(draft, k=3), max_new_tokens=24, chat=False, stop_at_eos=False)
            for p in prompts]
    return van, spec


def test_the_lines_go_from_leviathan_to_the_measured_speedup(runs):
    van, spec = runs
    r = cost_check(van, spec)
    lines = r.predictions()
    assert r.k == 3 and 0 <= r.alpha <= 1 and len(r.alpha_by_depth) == 3
    assert lines[0][3] == pytest.approx(speedup(r.alpha, 3, r.c))  # chapter 1's formula, as the course has it
    s_tokens = sum(sum(x.stats.tokens_per_step[1:]) for x in spec)
    s_steps = sum(len(x.stats.tokens_per_step) - 1 for x in spec)
    assert r.tau == pytest.approx(s_tokens / s_steps) and lines[2][1] == r.tau
    assert r.drafts_per_step == pytest.approx(sum(x.stats.draft_forwards for x in spec) / s_steps)
    v_rate = sum(sum(x.stats.tokens_per_step[1:]) for x in van) / sum(x.stats.decode_s for x in van)
    s_rate = s_tokens / sum(x.stats.decode_s for x in spec)
    assert r.measured == pytest.approx(s_rate / v_rate)
    assert lines[-1][3] == pytest.approx(r.measured)  # the phases add up to the decode time: the model closes
    assert "measured" in r.table() and "Leviathan" in r.table()


def test_alpha_by_depth_gives_the_product_form():
    r = CostCheck(k=3, alpha=0.5, alpha_by_depth=(0.8, 0.5, 0.25), tau=1.9, c=0.1, drafts_per_step=3, v=1.2,
                  loop=0.1, measured=1.0)
    assert r.predictions()[1][1] == pytest.approx(1 + 0.8 + 0.8 * 0.5 + 0.8 * 0.5 * 0.25)
    assert r.predictions()[3][2] == pytest.approx(3 * 0.1 + 1.2)


def test_a_model_free_drafter_counts_k_drafts_per_step(runs):
    from minispec.drafters import PromptLookup

    van, _ = runs
    (model, tok) = load("tiny-llama")
    spec = [generate(model, tok, "abcabcabcabc", drafter=PromptLookup(k=4), max_new_tokens=24, chat=False,
                     stop_at_eos=False)]
    r = cost_check(van[:1], spec, k=4)
    assert r.drafts_per_step == 4 and r.predictions()[-1][3] == pytest.approx(r.measured)


def test_runs_without_drafts_are_refused(runs):
    van, _ = runs
    with pytest.raises(ValueError, match="tested drafts"):
        cost_check(van, van)
    with pytest.raises(ValueError, match="at least one"):
        cost_check([], [GenerationStats()])


# --------------------------------------------------------------------------- no prediction above tau
def _stats(steps: int, tokens: int, per_step_ms: dict, drafts: int = 0, depth: int = 0) -> GenerationStats:
    """A run's stats: ``steps`` decode steps committing ``tokens`` in all, each costing ``per_step_ms`` by phase."""
    from minispec.generate import PHASES

    s = GenerationStats()
    base, extra = divmod(tokens, steps)
    s.tokens_per_step = [1] + [base + (i < extra) for i in range(steps)]
    s.phase_s = {p: per_step_ms.get(p, 0.0) * steps / 1e3 for p in PHASES}
    s.decode_s = sum(s.phase_s.values())
    s.draft_forwards = drafts
    s.tested_at_depth = [steps] * depth
    s.accepted_at_depth = [steps] * (depth - 1)
    return s


# benchmarks/results/gpu-h100-fp32-speedup/llama_speedup.json, ms per decode step (host-timed, before events)
H100_VANILLA = dict(target=20.737, verify=0.847, commit=0.017, hand_off=0.012, other=0.016)
H100_CHAIN = dict(draft=0.128, target=13.933, verify=4.425, commit=0.017, hand_off=0.027, other=0.008)


def test_predicted_speedup_refuses_above_tau():
    from minispec.lab.cost_check import predicted_speedup

    assert predicted_speedup(3.0, 1.5) == (2.0, None)
    assert predicted_speedup(3.0, 1.0) == (3.0, None)
    value, why = predicted_speedup(3.0, 0.9)
    assert value is None and why.startswith("refused") and "3.33x" in why and "above tau" in why
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="positive"):
            predicted_speedup(3.0, bad)


def test_the_h100_run_that_predicted_above_tau_is_refused():
    """The 2026-11-24 H100 run: a 6-row chain's forward timed at 13.93 ms against vanilla's one-row 20.74 ms (its
    GPU time landed in verify, 4.43 ms) made the model predict 5.35x at tau 3.63. The model now refuses such a
    line and says why; the measured line stays as measured (4.23x: even the whole chain step, 18.54 ms, was
    shorter than vanilla's 21.63 ms on that GPU)."""
    van = [_stats(127, 127, H100_VANILLA)]
    spec = [_stats(35, 127, H100_CHAIN, drafts=0, depth=5)]
    r = cost_check(van, spec, k=5)
    lines = r.predictions()
    assert r.tau == pytest.approx(127 / 35) and r.v < 1  # a 6-row forward priced below one vanilla step
    assert lines[3][3] is None and "+ verify cost v" in r.refusals and "above tau" in r.refusals["+ verify cost v"]
    assert all(s is None or s <= t + 1e-12 for _, t, _, s in lines[:4])
    assert lines[-1][3] == pytest.approx(r.measured) and r.measured == pytest.approx(4.23, abs=0.01)
    assert "refused" in r.table()
    moved = dict(H100_CHAIN, target=H100_CHAIN["target"] + H100_CHAIN["verify"] - 0.9, verify=0.9)  # GPU time home
    r2 = cost_check(van, [_stats(35, 127, moved, depth=5)], k=5)
    assert r2.predictions()[3][3] is None  # still below a vanilla step: the forward of 6 rows cost less than 1 row


def test_a_line_is_predicted_where_the_step_costs_more_than_vanilla():
    van = [_stats(100, 100, dict(target=10.0, verify=1.0))]
    spec = [_stats(40, 100, dict(draft=4.0, target=12.0, verify=2.0), drafts=160, depth=4)]
    r = cost_check(van, spec, k=4)
    assert r.vanilla_loop == pytest.approx(1 / 11) and r.v == pytest.approx(12 / 11)
    line = r.predictions()[3]
    assert line[2] == pytest.approx((4 + 12 + 1) / 11) and line[3] == pytest.approx(2.5 * 11 / 17)
    assert not r.refusals and r.predictions()[-1][3] == pytest.approx(r.measured)


def test_no_line_of_a_real_run_is_above_its_tokens_per_step(runs):
    van, spec = runs
    r = cost_check(van, spec)
    assert all(s is None or s <= t + 1e-12 for _, t, _, s in r.predictions()[:-1])
    assert set(r.refusals) <= {"+ verify cost v"}


def test_oracle_speedup_refuses_a_prediction_above_tau(monkeypatch):
    """scale.oracle_speedup prices each method's draft + target phases against vanilla's target phase: the H100
    chain's 13.93 + 0.13 ms against 20.74 would predict 5.35x at tau 3.63; it reports no figure and says why."""
    from minispec.lab import scale

    rows = dict(vanilla=dict(tau_step=1.0, target_s=0.02074, draft_s=0.0, decode_tokens_per_s=46.2),
                chain=dict(tau_step=3.63, target_s=0.01393, draft_s=0.00013, decode_tokens_per_s=195.7),
                eagle2=dict(tau_step=3.97, target_s=0.04, draft_s=0.001, decode_tokens_per_s=80.0))

    def run(model, tok, prompt, ref, stream, depth, nodes, *a, **k):
        name = next(m for m, (d, n) in scale.METHODS.items() if (d, n) == (depth, nodes))
        return dict(rows[name], tau_ok=True, identical=True)

    monkeypatch.setattr(scale, "_oracle_run", run)
    model, _ = load("tiny-llama")
    r = scale.oracle_speedup(model, 8, 8, 0.15)["methods"]
    assert r["vanilla"]["predicted_speedup"] == 1.0 and r["vanilla"]["prediction_refused"] is None
    assert r["chain"]["predicted_speedup"] is None and "5.35x" in r["chain"]["prediction_refused"]
    assert r["eagle2"]["predicted_speedup"] == pytest.approx(3.97 * 0.02074 / 0.041)
    assert r["chain"]["measured_speedup"] == pytest.approx(195.7 / 46.2)  # measured: kept as measured
