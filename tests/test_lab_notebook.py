"""The notebooks' explorers: sliders for a person, one call at the defaults in fast mode (no widget built)."""

import sys

from minispec.lab import notebook


def test_fast_mode_calls_the_explorer_once_at_its_defaults_and_builds_no_widget(monkeypatch):
    monkeypatch.setenv("MINISPEC_FAST", "1")
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # importing it would raise ImportError
    seen = []
    notebook.interact(lambda alpha=0.8, k=4: seen.append((alpha, k)), alpha=(0.0, 1.0, 0.01), k=(0, 12))
    assert seen == [(0.8, 4)]


def test_otherwise_ipywidgets_interact_gets_the_controls(monkeypatch):
    import ipywidgets

    monkeypatch.delenv("MINISPEC_FAST", raising=False)
    calls = []
    monkeypatch.setattr(ipywidgets, "interact", lambda fn, **controls: calls.append((fn, controls)))
    fn = lambda n=2: n  # noqa: E731
    notebook.interact(fn, n=(1, 3))
    assert calls == [(fn, {"n": (1, 3)})]


def test_setup_prints_the_versions_and_the_device_and_returns_fast_mode(monkeypatch, capsys):
    monkeypatch.setattr("minispec.loading.hub_reachable", lambda *a, **k: False)  # no network wait in the test
    for value, want in (("1", True), ("", False)):
        monkeypatch.setenv("MINISPEC_FAST", value)
        assert notebook.setup() is want
        out = capsys.readouterr().out
        assert "minispec 0." in out and f"FAST mode: {'on' if want else 'off'}" in out and "device:" in out


def test_time_greedy_times_every_drafter_on_vanillas_tokens(capsys):
    import torch

    from minispec import load
    from minispec.drafters import DraftModel, PromptLookup

    target, tok = load("tiny-llama")
    draft, _ = load("tiny-llama")
    with torch.no_grad():
        draft.lm_head.weight.add_(0.05 * torch.randn(draft.lm_head.weight.shape, generator=torch.Generator().manual_seed(0)))
    runs = notebook.time_greedy(target, tok, "abcabc abc", {"chain": DraftModel(draft, k=3), "pld": PromptLookup(k=3)},
                                n_new=12)
    assert list(runs) == ["vanilla", "chain", "pld"]
    assert all(r.tokens == runs["vanilla"].tokens and len(r.tokens) == 12 for r in runs.values())
    out = capsys.readouterr().out
    assert all(line in out for line in ("vanilla", "chain", "pld", "device:", "tokens/s"))


def test_the_decode_loop_exactness_section_passes_honest_runs_and_fails_an_unflagged_control(monkeypatch, capsys):
    """minispec.lab.joint_law.decode_loop_exactness (chapters 3, 4, 5 and 7 in one call): the real loop with a
    static tree passes and its uniform-q liar is flagged; a "WRONG" control that is not flagged makes the call
    raise (the section's verdict cannot be skipped)."""
    import pytest
    import torch

    from minispec import load
    from minispec.drafters import DraftModel
    from minispec.lab import joint_law
    from minispec.lab.joint_law import claim_uniform_q, decode_loop_exactness

    target, tok = load("tiny-gpt2")
    draft, _ = load("tiny-gpt2")
    with torch.no_grad():  # a noisy copy of the target: its top-2 drafts are usually the target's top-2
        draft.lm_head.weight.add_(0.05 * torch.randn(draft.lm_head.weight.shape, generator=torch.Generator().manual_seed(0)))
    tree = lambda: DraftModel(draft, tree="2,2,3")  # noqa: E731
    kw = dict(fast=True, prompt="abc", n=(64, 64), top_k=2, models="target: tiny-gpt2; draft: its noisy copy")
    out = decode_loop_exactness(target, tok, {"tree": tree, "WRONG: lying": lambda: claim_uniform_q(tree())}, {}, **kw)
    assert out["res"]["tree"]["tv"] <= out["bound"] and out["subtle"] is None
    assert "TV check — target: tiny-gpt2" in capsys.readouterr().out
    honest = out["res"]["tree"]  # the same passing run, now labelled as a control that must be flagged
    monkeypatch.setattr(joint_law, "loop_tv_check", lambda *a, **k: ({"WRONG: not wrong": honest}, out["bound"],
                                                                     out["support"], out["exact"]))
    with pytest.raises(AssertionError, match="must be flagged"):
        decode_loop_exactness(target, tok, {"WRONG: not wrong": tree}, {}, **kw)


def test_packed_law_is_checked_against_a_plain_forward():
    from minispec import load
    from minispec.lab.joint_law import packed_law
    from minispec.sampling import SamplingParams

    (target, tok), (draft, _) = load("tiny-gpt2"), load("tiny-gpt2-draft")
    lm, law = packed_law(target, draft, tok.encode("abc"), SamplingParams(temperature=1.0, top_k=3), 2)
    assert len(law) == 9 and abs(sum(law.values()) - 1) < 1e-9 and lm.V >= 3
