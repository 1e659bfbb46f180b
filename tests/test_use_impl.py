"""The learner's code inside generate (``minispec.grading.inside.use_impl``)."""

from __future__ import annotations

from types import SimpleNamespace

import importlib

import pytest
import torch

from minispec import generate
from minispec.attention import reference
from minispec.drafters import DraftModel
from minispec.grading import load_impl
from minispec.grading.inside import use_impl
from minispec.loading import load
from minispec.tree import Tree

gen_module = importlib.import_module("minispec.generate")


@pytest.fixture(scope="module")
def tiny():
    (model, tok), (draft, _) = load("tiny-llama"), load("tiny-gpt2-draft")
    return model, tok, draft


def counting(chapter: int, name: str, calls: dict):
    """The solutions' ``name`` of ``chapter``, counting its calls in ``calls[name]``."""
    fn = getattr(load_impl(chapter, "solutions"), name)

    def wrapped(*a, **kw):
        calls[name] = calls.get(name, 0) + 1
        return fn(*a, **kw)
    return SimpleNamespace(**{name: wrapped})


def test_generate_runs_on_the_swapped_verifier_and_mask(tiny, monkeypatch):
    model, tok, draft = tiny
    calls = {}
    impls = {2: counting(2, "verify_tree", calls), 4: counting(4, "tree_mask", calls)}
    monkeypatch.setattr("minispec.grading.inside.load_impl", lambda ch, impl: impls[ch])
    vanilla = generate(model, tok, "abcabc", max_new_tokens=24, chat=False, stop_at_eos=False).tokens
    for temperature in (0.0, 1.0):
        with use_impl("solutions", chapters=(2, 4)):
            mine = generate(model, tok, "abcabc", drafter=DraftModel(draft, tree="3,2,6"), max_new_tokens=24,
                            chat=False, stop_at_eos=False, temperature=temperature, seed=0)
        if temperature == 0.0:
            assert mine.tokens == vanilla
    assert calls["verify_tree"] >= 2 and calls["tree_mask"] >= 2, calls


def test_the_split_backend_merges_with_the_swapped_merge(tiny, monkeypatch):
    model, tok, draft = tiny
    calls = {}
    monkeypatch.setattr("minispec.grading.inside.load_impl", lambda ch, impl: counting(6, "merge_partials", calls))
    vanilla = generate(model, tok, "hello", max_new_tokens=12, chat=False, stop_at_eos=False).tokens
    model.set_attention("split_torch")
    try:
        with use_impl("solutions", chapters=(6,)):
            mine = generate(model, tok, "hello", drafter=DraftModel(draft, k=3), max_new_tokens=12, chat=False,
                            stop_at_eos=False).tokens
    finally:
        model.set_attention("dense")
    assert calls["merge_partials"] > 0 and mine == vanilla


def test_everything_is_restored_after_the_block_even_after_an_error(tiny):
    model, tok, draft = tiny
    before = (gen_module.verify_tree, Tree.mask, reference.merge)
    stub = SimpleNamespace(verify_tree=lambda *a: (_ for _ in ()).throw(NotImplementedError("Exercise 2.4")),
                           tree_mask=lambda parents: torch.ones(len(parents) + 1, len(parents) + 1, dtype=torch.bool),
                           merge_partials=lambda *a: None)
    with pytest.raises(NotImplementedError, match="2.4"):
        with use_impl(stub):
            generate(model, tok, "abc", drafter=DraftModel(draft, tree="3,2,6"), max_new_tokens=8, chat=False)
    assert (gen_module.verify_tree, Tree.mask, reference.merge) == before
    with pytest.raises(ValueError, match="chapters"):
        with use_impl("solutions", chapters=(3,)):
            pass
