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
