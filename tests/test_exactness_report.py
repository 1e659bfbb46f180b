"""The exactness command: all verifiers pass, every control is flagged, the JSON has the promised fields."""

import json

import pytest

from minispec.cli import main
from minispec.lab.exactness_report import run_all


SAMPLES = 1000


@pytest.fixture(scope="module")
def report():
    # 1000 draws per setting: every verifier passes and every control is flagged there too (measured; the
    # batched part keeps its 800, its controls 320). The evidence is the full run, 100,000 per setting
    # (benchmarks/results/exactness_full_cpu.json); this checks that the report is made and judged as the README says
    return run_all(full=False, samples=SAMPLES)


@pytest.mark.ch01
@pytest.mark.ch02
def test_every_verifier_passes_and_every_control_is_flagged(report):
    assert report["passed"]
    assert all(r["max_abs_error"] <= 1e-12 for r in report["enumeration"])
    assert report["controls_flagged"] and all(report["controls_flagged"].values())
    for r in report["empirical"]:
        assert {"tv", "p_value", "samples", "passed"} <= set(r) and r["samples"] == SAMPLES
    assert any(r["setting"].startswith("tiny-gpt2/") for r in report["empirical"])  # real model distributions
    assert all(r["support"] <= 20 for r in report["empirical"] if "support" in r)
    reduced = [r for r in report["empirical"] if r["setting"].endswith("_reduced_vocab")]  # FR-Spec drafting
    assert len(reduced) == 2 * 5 and all(r["passed"] for r in reduced)
    batched = report["batched"]  # the batched decode loop (chapter 7): each draft kind passes, drafts were accepted
    assert len(batched) == 3 and all(r["passed"] and r["drafts_accepted"] > r["samples"] / 4 for r in batched)
    assert {r["samples"] for r in batched} == {800}
    assert {r["samples"] for r in report["controls"] if r["part"] == "batched"} == {320}
    assert {r["verifier"] for r in report["controls"] if r["part"] == "batched"} == \
        {"batched_chain_k2_fake_uniform_q", "batched_tree_2,2,4_fake_uniform_q", "batched_copying_k2_fake_uniform_q"}
    n = len(report["empirical"]) + len(batched)  # the Bonferroni correction counts every empirical setting run
    assert report["criteria"]["chi_square_correction"] == f"Bonferroni over {n} empirical settings"
    assert report["criteria"]["chi_square_alpha"] == pytest.approx(0.001 / n)


def test_a_wrong_verifier_in_the_main_list_makes_the_command_fail(monkeypatch, capsys, tmp_path):
    from minispec.lab import exactness as ex
    from minispec.lab import exactness_report as er

    monkeypatch.setattr(er, "MODEL_VERIFIERS", ("chain_k1", "resample_from_p"))
    monkeypatch.setattr(ex, "run_empirical_suite", lambda **kw: ([], []))  # the synthetic settings: checked above
    monkeypatch.setitem(ex.VERIFIERS, "resample_from_p", ex.CONTROLS["resample_from_p"])
    saved = tmp_path / "report.json"
    assert main(["exactness", "--fast", "--samples", "1500", "--parts", "empirical", "--json", "--out", str(saved)]) == 1
    out = json.loads(capsys.readouterr().out.split("\nsaved ")[0])
    bad = [r for r in out["empirical"] if r["verifier"] == "resample_from_p"]
    assert bad and not all(r["passed"] for r in bad) and out["passed"] is False
    assert all(r["passed"] for r in out["empirical"] if r["verifier"] != "resample_from_p")  # it alone failed
    file = json.loads(saved.read_text())  # the same report, with the command, its exit status and the device
    assert file["exit_status"] == 1 and file["passed"] is False and "--out" in file["command"] and file["device"]
    assert file["empirical"] == out["empirical"]
