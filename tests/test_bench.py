"""``python -m minispec bench`` end to end on a tiny model: every method on every question, each
answer compared with vanilla's, the tables printed; bad arguments refused before anything loads."""

import pytest

from minispec.lab.bench import format_table, run_bench

QUESTIONS = [dict(question_id=i, category=c, prompt=p)
             for i, (c, p) in enumerate([("qa", "Hello, world"), ("math", "12 + 30 = 12 + 30 ="), ("qa", "def f(x): f(x)")])]


@pytest.mark.parametrize("batch_size", [1, 2])
def test_bench_runs_every_method_and_compares_its_answers_with_vanilla(batch_size):
    r = run_bench(QUESTIONS, methods=["vanilla", "pld"], model="tiny-llama", max_new_tokens=12, progress=False,
                  batch_size=batch_size)
    s = r["summary"]
    assert set(s) == {"vanilla", "pld"}
    for m in s.values():  # greedy: prompt lookup's answers are vanilla's, question by question
        assert m["n"] == len(QUESTIONS) and m["identical"] == len(QUESTIONS) and m["tokens_per_s"] > 0
    assert s["vanilla"]["tau"] == 1.0 and s["vanilla"]["vs_vanilla"] == pytest.approx(1.0)
    assert set(r["by_category"]) == {"qa", "math"} and len(r["rows"]) == len(QUESTIONS)
    text = format_table(r)
    assert "vanilla" in text and "pld" in text and "math" in text


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(methods=["vanilla", "vanilla"]), "listed twice"),
    (dict(methods=["vanilla", "nonesuch"]), "nonesuch"),
    (dict(batch_size=0), "batch_size"),
    (dict(questions=[]), "no questions"),
])
def test_bad_arguments_are_refused_before_the_model_loads(kwargs, match):
    args = dict(questions=QUESTIONS, methods=["vanilla"], model="no-such-model", progress=False) | kwargs
    with pytest.raises(ValueError, match=match):  # a load of "no-such-model" would raise something else
        run_bench(**args)


def test_a_sampled_bench_does_not_report_token_identity():
    """Sampled, each method's answers follow the target's law but not vanilla's tokens, so the table shows
    "-" under identical and says why, instead of a misleading 0/n."""
    r = run_bench(QUESTIONS[:2], methods=["vanilla", "pld"], model="tiny-llama", max_new_tokens=8, progress=False,
                  temperature=0.7, seed=1)
    text = format_table(r)
    assert "not compared when sampling" in text and "/2" not in text
    assert r["settings"]["temperature"] == 0.7 and r["summary"]["pld"]["tokens_per_s"] > 0
