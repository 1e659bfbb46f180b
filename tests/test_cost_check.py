"""Chapter 1's cost model closed on a run (``minispec.lab.cost_check``)."""

from __future__ import annotations

import pytest

from minispec import generate
from minispec.lab.cost_check import CostCheck, cost_check
from minispec.drafters import DraftModel
from minispec.generate import GenerationStats
from minispec.models import load
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
