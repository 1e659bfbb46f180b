"""Spec-Bench questions are read from a path; a malformed line names the file and the line."""

import json

import pytest

from minispec.prompts import spec_bench


def _write(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def _q(i, cat, text="What is 2 + 2?"):
    return dict(question_id=i, category=cat, turns=[text, "and then?"])


def test_reads_first_turns_spread_over_categories(tmp_path):
    f = _write(tmp_path / "q.jsonl", [_q(1, "math"), _q(2, "math"), "", _q(3, "coding", "Write a loop.")])
    rows = spec_bench(f, limit=2)
    assert [(r["question_id"], r["category"]) for r in rows] == [(1, "math"), (3, "coding")]
    assert rows[1]["prompt"] == "Write a loop."


@pytest.mark.parametrize("bad,why", [
    ("{not json", "line 2: not a Spec-Bench question"),
    (json.dumps({"question_id": 9, "turns": ["hi"]}), "missing field 'category'"),
    (json.dumps({"question_id": 9, "category": "x", "turns": []}), "'turns' must be a non-empty list"),
    (json.dumps({"question_id": 9, "category": "x", "turns": [""]}), "'turns' must be a non-empty list"),
])
def test_a_malformed_line_names_the_file_and_the_line(tmp_path, bad, why):
    f = _write(tmp_path / "q.jsonl", [_q(1, "math"), bad])
    with pytest.raises(ValueError, match=why) as e:
        spec_bench(f)
    assert str(f) in str(e.value)


def test_a_missing_file_says_how_to_give_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="MINISPEC_SPEC_BENCH"):
        spec_bench(tmp_path / "none.jsonl")
