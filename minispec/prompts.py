"""Prompts: minispec's own short list for tests and notebooks, and Spec-Bench questions for benchmarks.

Spec-Bench (Xia et al., "Unlocking Efficiency in Large Language Model Inference", 2024) is
read from a path in its JSONL layout (``question_id``, ``category``, ``turns``); it is never
copied into the repository. The default path is ``../shared/data/spec_bench.jsonl`` beside
the checkout, or $MINISPEC_SPEC_BENCH.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path


def own_prompts() -> list[dict]:
    """minispec's prompt list: [{"category": ..., "prompt": ...}] (chat, code, math, ...)."""
    return json.loads(resources.files("minispec").joinpath("data/prompts.json").read_text())


def reuse_prompts() -> list[dict]:
    """minispec's prompts that paste a text and ask for a rewrite, an extraction, an answer from it or a
    summary (written for minispec, not taken from a benchmark): the requests in which an answer repeats
    its input, where a copying drafter pays. [{"category": ..., "prompt": ...}]"""
    return json.loads(resources.files("minispec").joinpath("data/reuse_prompts.json").read_text())


def calibration_set(n: int = 3) -> list[str]:
    """The dispatcher's calibration prompts: n of minispec's own prompts, one in three (the first of every
    three) a request that reuses its input (``reuse_prompts``), as users' requests often do.

    A reuse request comes first because a calibration cut short after one prompt chooses on it alone: on a
    plain first prompt (a list of study habits) every draft is accepted often and the largest tree looked
    best, which it is not on a mix of requests, while a copying drafter, chosen on a reuse request, drafts
    as the EAGLE head does where nothing repeats (``benchmarks/calibration_fidelity.py``)."""
    own, reuse = [p["prompt"] for p in own_prompts()], [p["prompt"] for p in reuse_prompts()]
    return [reuse[(i // 3) % len(reuse)] if i % 3 == 0 else own[(i - i // 3 - 1) % len(own)] for i in range(n)]


def default_spec_bench_path() -> Path | None:
    """$MINISPEC_SPEC_BENCH, else shared/data/spec_bench.jsonl next to the checkout, if present."""
    env = os.environ.get("MINISPEC_SPEC_BENCH")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent.parent
    for cand in (here.parent / "shared" / "data" / "spec_bench.jsonl", Path.cwd().parent / "shared" / "data" / "spec_bench.jsonl"):
        if cand.exists():
            return cand
    return None


def spec_bench(path: str | Path | None = None, limit: int | None = None, categories: list[str] | None = None) -> list[dict]:
    """Load Spec-Bench questions: [{"question_id", "category", "prompt"}] (first turn).

    Args:
        path: a JSONL file in Spec-Bench's layout; default ``default_spec_bench_path()``.
        limit: keep at most this many, spread round-robin over categories so every category appears.
        categories: keep only these categories.
    """
    path = Path(path) if path else default_spec_bench_path()
    if path is None or not path.exists():
        raise FileNotFoundError(f"Spec-Bench questions not found at {path}; pass a path in Spec-Bench's JSONL layout "
                                "(question_id, category, turns) or set MINISPEC_SPEC_BENCH")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
            turns = q["turns"]
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
                raise ValueError("'turns' must be a non-empty list whose first turn is a non-empty string")
            rows.append(dict(question_id=q["question_id"], category=q["category"], prompt=turns[0]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
            raise ValueError(f"{path}, line {n}: not a Spec-Bench question (JSON with question_id, category, turns): "
                             f"{what}") from None
    if categories:
        unknown = set(categories) - {r["category"] for r in rows}
        if unknown:
            raise ValueError(f"unknown categories {sorted(unknown)}; the file has {sorted({r['category'] for r in rows})}")
        rows = [r for r in rows if r["category"] in categories]
    if limit is not None:
        by_cat: dict[str, list[dict]] = {}
        for r in rows:
            by_cat.setdefault(r["category"], []).append(r)
        rows, i = [], 0
        while len(rows) < limit and any(i < len(v) for v in by_cat.values()):
            rows += [v[i] for v in by_cat.values() if i < len(v)][: limit - len(rows)]
            i += 1
    return rows
