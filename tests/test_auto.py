"""The tree dispatcher (chapter 5): cost model, cost curve, tune's choice, and the 'auto' method: measured by the
lab (``minispec.lab.tune``, ``minispec.lab.calibrate``), read by the runtime (``minispec.auto``)."""

import dataclasses
import json
import subprocess
import sys
import time

import pytest

from minispec import auto, load

from minispec.lab import calibrate, tune_report
from minispec.lab import tune as tuning
from minispec.drafters import TreeSpec
from minispec.methods import DEFAULT_AUTO, MethodSpec, Methods, parse_method, with_head_dtype


@pytest.fixture(scope="module")
def tiny():
    model, tok = load("tiny-llama")
    return model, tok, load("tiny-gpt2-draft")[0]


def test_cost_model_and_interpolation():
    assert auto.predicted_tokens_per_s(3.0, 0.02, 0.01) == pytest.approx(100.0)
    assert auto.predicted_tokens_per_s(1.0, 0.02, 0.0, loop_s=0.03) == pytest.approx(20.0)
    assert auto.predicted_tokens_per_s(1.0, 0.05, 0.0, loop_s=-0.01) == pytest.approx(25.0)  # a residual
    with pytest.raises(ValueError, match="positive time"):
        auto.predicted_tokens_per_s(1.0, 0.01, 0.0, loop_s=-0.02)
    curve = {0: 1.0, 4: 3.0, 8: 4.0}
    assert auto.interpolate(curve, 2) == pytest.approx(2.0)
    assert auto.interpolate(curve, 6) == pytest.approx(3.5)
    assert auto.interpolate(curve, 12) == pytest.approx(5.0)  # the last segment extended
    assert auto.interpolate(curve, 0) == 1.0


def test_method_names():
    spec = parse_method("eagle2@5/8/32")  # parsed once: name, row of the table, tree
    assert (spec.name, spec.base, spec.tree) == ("eagle2@5/8/32", "eagle2", TreeSpec.dynamic(5, 8, 32))
    assert parse_method(spec) is spec and spec.row.head == "eagle"
    assert parse_method(" sps ") == MethodSpec("sps", "sps", None)
    with pytest.raises(ValueError, match="unknown method"):
        parse_method("magic")
    with pytest.raises(ValueError, match="does not draft trees"):
        parse_method("pld@eagle")
    with pytest.raises(ValueError, match="unknown tree"):
        parse_method("sps@oak")
    spec = parse_method("eagle+bf16@chain:2")  # the EAGLE-1/2 head in bfloat16
    assert (spec.base, spec.tree, spec.head_dtype) == ("eagle", TreeSpec.chain(2), "bf16")
    assert parse_method("copy+bf16").head_dtype == "bf16" and parse_method("eagle2").head_dtype is None
    with pytest.raises(ValueError, match="no EAGLE-1/2 head to cast"):
        parse_method("sps+bf16@chain:2")
    with pytest.raises(ValueError, match="unknown head dtype"):
        parse_method("eagle+fp8")
    assert with_head_dtype("copy@chain:2", "bf16") == "copy+bf16@chain:2" and with_head_dtype("eagle2", "bf16") == "eagle2+bf16"
    assert with_head_dtype("eagle2@5/8/32", "f32") == "eagle2+f32@5/8/32"
    assert with_head_dtype("sps@chain:2", "bf16") == "sps@chain:2" and with_head_dtype("eagle+f32", "bf16") == "eagle+f32"
    with pytest.raises(ValueError, match="unknown head dtype"):
        with_head_dtype("eagle", "fp8")


@pytest.mark.ch05
def test_verify_cost_curve_shape(tiny):
    model, _, _ = tiny
    curve = tuning.verify_cost_curve(model, sizes=(0, 4, 16), batch_sizes=(1, 2), context=32, reps=2)
    assert set(curve) == {1, 2} and set(curve[1]) == {0, 4, 16}
    assert all(t > 0 for c in curve.values() for t in c.values())


@pytest.mark.ch05
def test_tune_chooses_the_best_predicted_candidate(tiny):
    model, tok, draft = tiny
    methods = Methods(model, "tiny-llama", draft_model=draft, k=3)
    cands = ("vanilla", "pld", "sps", "sps@2/2/4", "eagle")
    r = tuning.tune(model, tok, ["abcabcabc", "1, 2, 3, 4"], "tiny-llama", candidates=cands, max_new_tokens=16,
                    context=32, sizes=(0, 2, 4, 8), methods=methods, progress=False)
    got = {c.method: c for c in r.candidates}
    assert set(got) == {"vanilla", "pld", "sps", "sps@2/2/4"}
    assert "eagle" in r.skipped  # no EAGLE head for tiny-llama
    assert r.head_dtype is None and r.head_dtype_s == {}  # nor one to time in two dtypes
    assert got["vanilla"].tau == 1.0 and got["vanilla"].nodes == 0 and got["vanilla"].draft_s == 0.0
    assert got["sps"].nodes == 3 and got["sps@2/2/4"].nodes == 4 and got["sps"].draft_s > 0
    for c in r.candidates:
        assert c.predicted_tok_s == pytest.approx(
            auto.predicted_tokens_per_s(c.step_tokens, c.verify_s, c.draft_s, c.loop_s))
        assert c.step_tokens >= 1.0 and c.verify_s + c.draft_s + c.loop_s > 0
    assert r.choice == max(r.candidates, key=lambda c: c.predicted_tok_s).method
    text = tune_report.format_tune(r)
    assert "choice: " + r.choice in text and "verify cost" in text


@pytest.mark.ch05
def test_each_candidate_pays_its_own_loop_overhead(tiny, monkeypatch):
    """t_loop(c): the phases of c's own steps but the draft and the target forward, per step (module docstring of
    ``minispec.auto``), not vanilla's: a cheap drafter with a costly loop is not flattered. The calibration
    runs report known phase times (the generations stubbed: pld's loop costs 5 ms a step, vanilla's 1 ms), so the
    loop overhead each candidate must carry, and its prediction, are known in advance."""
    import types

    model, tok, draft = tiny
    methods = Methods(model, "tiny-llama", draft_model=draft, k=3)
    gen_module = sys.modules["minispec.generate"]
    steps = 10  # decode steps per generation (plus the prefill's token)

    def fake_generate(target, tok_, prompt, drafter=None, **kw):
        per_step = {"draft": 0.002, "target": 0.010, "loop": 0.005} if drafter is not None else \
            {"draft": 0.0, "target": 0.010, "loop": 0.001}
        tokens = 3 if drafter is not None else 1  # tokens per step
        decode_s = steps * sum(per_step.values())
        stats = types.SimpleNamespace(new_tokens=steps * tokens + 1, target_forwards=steps + 1, decode_s=decode_s,
                                      total_s=decode_s + 0.02, nodes=[4] * steps if drafter is not None else [0] * steps,
                                      phase_s={"draft": steps * per_step["draft"], "target": steps * per_step["target"]})
        return types.SimpleNamespace(stats=stats)

    monkeypatch.setattr(gen_module, "generate", fake_generate)
    r = tuning.tune(model, tok, ["abcabcabc"], "tiny-llama", candidates=("vanilla", "pld"), max_new_tokens=8,
                    context=16, sizes=(0, 4), methods=methods, progress=False, reps=1)
    got = {c.method: c for c in r.candidates}
    assert got["vanilla"].loop_s == pytest.approx(0.001) and got["pld"].loop_s == pytest.approx(0.005)
    assert got["pld"].draft_s == pytest.approx(0.002) and got["pld"].step_tokens == pytest.approx(3.0)
    assert got["pld"].predicted_tok_s == pytest.approx(3.0 / (got["pld"].verify_s + 0.002 + 0.005))


@pytest.mark.ch05
def test_a_racing_calibration_stops_running_the_losers(tiny, monkeypatch):
    """``race``: after each prompt, a candidate predicted below race x the best runs no further prompts, and
    vanilla runs on the first only; without it every candidate runs every prompt. The prediction of each
    prompt's survivors is stubbed (a fixed order), so which candidate runs what is known in advance."""
    model, tok, draft = tiny
    methods = Methods(model, "tiny-llama", draft_model=draft, k=3)
    cands, prompts = ("vanilla", "pld", "sps", "sps@2/2/4"), ["abcabcabc", "1, 2, 3, 4", "x y x y x y"]
    speed = {"vanilla": 1.0, "pld": 0.5, "sps": 1.5, "sps@2/2/4": 1.4}  # tokens/s the stub predicts
    real = auto._candidate
    monkeypatch.setattr(tuning, "_candidate", lambda c, m, curve_b: dataclasses.replace(
        real(c, m, curve_b), predicted_tok_s=speed[c]))
    ran = {}
    for race in (None, 0.7, 1.0):
        r = tuning.tune(model, tok, prompts, "tiny-llama", candidates=cands, max_new_tokens=8, context=32,
                        sizes=(0, 2, 4), methods=methods, progress=False, race=race)
        ran[race] = {c.method: c.prompts for c in r.candidates}
        assert r.choice == "sps"
    assert ran[None] == {c: 3 for c in cands}
    assert ran[0.7] == {"vanilla": 1, "pld": 1, "sps": 3, "sps@2/2/4": 3}  # 0.5 < 0.7 x 1.5 <= 1.4
    assert ran[1.0] == {"vanilla": 1, "pld": 1, "sps": 3, "sps@2/2/4": 1}
    r = tuning.tune(model, tok, prompts, "tiny-llama", candidates=("vanilla",), max_new_tokens=8, context=32,
                    sizes=(0, 2), methods=methods, progress=False, race=0.7)  # nothing left to race after prompt 1
    assert [(c.method, c.prompts) for c in r.candidates] == [("vanilla", 1)] and r.choice == "vanilla"
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="race must be a fraction"):
            tuning.tune(model, tok, prompts, "tiny-llama", candidates=cands, methods=methods, progress=False, race=bad)


@pytest.mark.ch05
def test_a_calibration_with_a_budget_starts_no_prompt_it_cannot_finish(tiny, monkeypatch):
    """``budget_s``: every candidate runs the first prompt; a next prompt runs for the candidates that, at their
    last times, end it within the budget: all, else the best predicted that fit if two or more do. The clock
    is the real one plus 10 s per generation and the predictions are stubbed (sps > vanilla > pld), so which
    prompts fit and who runs them is known in advance (3 candidates: 30 s a prompt)."""
    import types

    model, tok, draft = tiny
    methods = Methods(model, "tiny-llama", draft_model=draft, k=3)
    cands, prompts = ("vanilla", "pld", "sps"), ["abcabcabc", "1, 2, 3, 4", "x y x y x y"]
    gen_module = sys.modules["minispec.generate"]
    real_generate, offset = gen_module.generate, [0.0]

    def slow_generate(*a, **kw):
        r = real_generate(*a, **kw)
        offset[0] += 10.0
        return r

    monkeypatch.setattr(gen_module, "generate", slow_generate)
    monkeypatch.setattr(tuning, "time", types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + offset[0]))
    speed = {"vanilla": 1.0, "pld": 0.5, "sps": 1.5}
    real = auto._candidate
    monkeypatch.setattr(tuning, "_candidate", lambda c, m, curve_b: dataclasses.replace(
        real(c, m, curve_b), predicted_tok_s=speed[c]))
    ran = {}
    for budget in (None, 45.0, 55.0, 75.0, 1.0):
        r = tuning.tune(model, tok, prompts, "tiny-llama", candidates=cands, max_new_tokens=8, context=32,
                        sizes=(0, 2, 4), methods=methods, progress=False, budget_s=budget, reps=1)
        ran[budget] = {c.method: c.prompts for c in r.candidates}
    assert ran[None] == {c: 3 for c in cands}
    assert ran[75.0] == {c: 2 for c in cands}  # 30 s + 30 s fit in 75, a third prompt would end at 90
    assert ran[45.0] == ran[1.0] == {c: 1 for c in cands}  # the first prompt always runs; one alone would not
    assert ran[55.0] == {"vanilla": 2, "pld": 1, "sps": 2}  # 25 s left after the first: the best two
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="budget_s must be positive"):
            tuning.tune(model, tok, prompts, "tiny-llama", candidates=cands, methods=methods, progress=False,
                        budget_s=bad)
    with pytest.raises(ValueError, match="reps must be >= 1"):
        tuning.tune(model, tok, prompts, "tiny-llama", candidates=cands, methods=methods, progress=False, reps=0)


def test_the_choice_is_made_among_the_candidates_that_ran_the_most_prompts():
    """A candidate a race or the budget left behind after one prompt keeps a prediction from fewer prompts
    than the others: it is not compared with them; vanilla, whose step is the same on every prompt, is."""
    def row(method, predicted, prompts):
        return auto.CandidateResult(method, 0, 1.0, 1.0, 0.0, 0.01, 0.0, predicted, predicted, prompts)

    assert auto.choose([row("vanilla", 20, 1), row("eagle2", 37, 1), row("copy", 32, 3), row("eagle", 30, 3)]) == "copy"
    assert auto.choose([row("vanilla", 20, 1), row("copy", 19, 3), row("eagle", 18, 3)]) == "vanilla"
    assert auto.choose([row("vanilla", 20, 1), row("eagle2", 37, 1), row("copy", 32, 1)]) == "eagle2"


def test_auto_reads_the_saved_choice(tmp_path, monkeypatch):
    monkeypatch.setenv("MINISPEC_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="minispec tune"):
        auto.auto_method("tiny-llama", strict=True)
    assert auto.auto_method("tiny-llama") == DEFAULT_AUTO  # no saved tune: the shipped default, nothing measured
    assert not auto.tune_path("tiny-llama").exists()
    path = auto.tune_path("tiny-llama")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"choice": "pld"}))
    assert auto.auto_method("tiny-llama") == "pld"


def test_a_choice_measured_with_other_shipped_heads_is_stale(tmp_path, monkeypatch):
    """A release that ships another head changes ``shipped_fingerprint``; a choice saved with the old
    heads is then no choice: ``auto_method`` falls back to the default and ``resolve_auto`` says why."""
    from minispec.drafters import defaults

    monkeypatch.setenv("MINISPEC_CACHE", str(tmp_path))
    heads = tmp_path / "ckpt"
    heads.mkdir()
    monkeypatch.setattr(defaults, "shipped_head", lambda kind, model_name="m": heads / f"{model_name}-{kind}.st")
    assert defaults.shipped_fingerprint("m") == ""  # nothing shipped
    (heads / "m-eagle.st").write_bytes(b"head one")
    one = defaults.shipped_fingerprint("m")
    (heads / "m-eagle.st").write_bytes(b"head two")
    two = defaults.shipped_fingerprint("m")
    (heads / "m-draft.st").write_bytes(b"a draft")
    assert len({one, two, defaults.shipped_fingerprint("m")}) == 3 and len(one) == 16
    (heads / "m-draft.st").unlink()
    path = auto.tune_path("m")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"choice": "pld", "drafters": one}))
    assert auto.saved_choice("m") is None and auto.auto_method("m") == DEFAULT_AUTO
    with pytest.raises(FileNotFoundError, match="shipped checkpoints"):
        auto.auto_method("m", strict=True)
    path.write_text(json.dumps({"choice": "pld", "drafters": two}))
    assert auto.auto_method("m") == "pld"
    r = auto.TuneResult("m", 1, 16, {1: {0: 0.01}}, choice="sps")
    (heads / "m-eagle.st").write_bytes(b"head three")
    assert auto.resolve_auto("m") == (DEFAULT_AUTO, f"auto = {DEFAULT_AUTO} (minispec's default: its last "
                                          "calibration measured other shipped heads; python -m minispec calibrate "
                                          "measures it)")
    tuning.save_choice(r)
    assert json.loads(path.read_text())["drafters"] == defaults.shipped_fingerprint("m") != two
    assert auto.auto_method("m") == "sps"


def test_tune_cli_on_a_tiny_model(tmp_path):
    env = dict(__import__("os").environ, MINISPEC_CACHE=str(tmp_path), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "minispec", "tune", "--model", "tiny-llama", "--candidates", "vanilla,pld",
                          "--limit", "2", "--max-new-tokens", "8", "--json", str(tmp_path / "t.json")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "choice:" in out.stdout and "candidates at batch 1" in out.stdout
    saved = json.loads((tmp_path / "t.json").read_text())
    assert saved["choice"] in ("vanilla", "pld") and saved["device"]


def test_cost_curve_is_non_decreasing(tiny):
    model, _, _ = tiny
    curve = tuning.verify_cost_curve(model, sizes=(8, 0, 2, 4, 16), context=16, reps=1)[1]
    values = [curve[n] for n in sorted(curve)]
    assert values == sorted(values) and list(curve) == [0, 2, 4, 8, 16]


def test_auto_is_calibrated_by_the_lab_once_on_own_prompts_and_read_by_the_runtime(tiny, tmp_path, monkeypatch):
    """The runtime measures nothing: without a saved choice ``resolve_auto`` is ``DEFAULT_AUTO`` and names the
    command that calibrates. ``calibrate.calibrate`` (the lab step ``make demo`` runs once) times a quick
    calibration on minispec's own prompts, saved per machine, model and thread count; the runtime then reads it."""
    import torch

    model, tok, draft = tiny
    monkeypatch.setenv("MINISPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(calibrate, "QUICK_CANDIDATES", ("pld", "sps"))
    monkeypatch.setattr(auto, "QUICK_CANDIDATES", ("pld", "sps"))
    seen = {}
    real_tune = calibrate.tune

    def spy(target, tok_, prompts, *a, **kw):
        seen["prompts"], seen["budget_s"] = prompts, kw.get("budget_s")
        return real_tune(target, tok_, prompts, *a, **kw)

    monkeypatch.setattr(calibrate, "tune", spy)
    method, line = auto.resolve_auto("tiny-llama")
    assert (method, line) == (DEFAULT_AUTO, f"auto = {DEFAULT_AUTO} (minispec's default: no calibration saved for this "
                                            "machine; python -m minispec calibrate measures it)") and not seen
    assert calibrate.needs_calibration("tiny-llama")
    monkeypatch.setattr(calibrate, "calibrate_kernels", lambda force=False: {"kernel": "panels"})  # test_kernel_choice's
    kernel, r, _ = calibrate.calibrate("tiny-llama", model=(model, tok))
    from minispec.prompts import own_prompts, reuse_prompts
    own, reuse = [p["prompt"] for p in own_prompts()], [p["prompt"] for p in reuse_prompts()]
    assert seen["prompts"] == [reuse[0], own[0], own[1]]  # minispec's own, one reusing its input; never a benchmark's
    assert seen["budget_s"] == calibrate.QUICK_BUDGET_S
    path = auto.tune_path("tiny-llama")
    assert path.exists() and f"-{torch.get_num_threads()}t-" in path.name
    saved = json.loads(path.read_text())
    assert saved["choice"] == r.choice and saved["calibration_s"] > 0 and saved["quick"] == ["pld", "sps"]
    assert r.choice in ("vanilla", "pld", "sps") and calibrate.summary(kernel, r, "tiny-llama")[1].startswith(
        f"auto = {r.choice} (calibrated in")
    seen.clear()
    again, line2 = auto.resolve_auto("tiny-llama")
    assert again == r.choice and "calibrated on this machine" in line2 and not seen  # read back, not measured again
    assert calibrate.calibrate("tiny-llama", model=(model, tok))[1] is None and not seen  # calibrated once


def test_a_quick_choice_over_another_candidate_list_is_stale(tiny, tmp_path, monkeypatch):
    """A quick calibration saves its candidate list; a release that changes ``QUICK_CANDIDATES`` makes its choice
    stale (``auto`` is the default again, and says why, until calibrated again), as one saved before the list was
    recorded; ``python -m minispec tune``'s choice (no ``calibration_s``) is not a quick one and stays."""
    monkeypatch.setenv("MINISPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(auto, "QUICK_CANDIDATES", ("pld", "sps"))
    monkeypatch.setattr(calibrate, "QUICK_CANDIDATES", ("pld", "sps"))
    path = auto.tune_path("tiny-llama")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"choice": "pld", "calibration_s": 1.0, "quick": ["pld", "sps"]}))
    assert auto.auto_method("tiny-llama") == "pld"
    for stale in ({"quick": ["pld"]}, {}):  # another list; none recorded
        path.write_text(json.dumps({"choice": "pld", "calibration_s": 1.0, **stale}))
        assert auto.saved_choice("tiny-llama") is None and auto.auto_method("tiny-llama") == DEFAULT_AUTO
    assert "its last calibration ran other candidates" in auto.resolve_auto("tiny-llama")[1]
    model, tok, draft = tiny
    monkeypatch.setattr(calibrate, "calibrate_kernels", lambda force=False: {"kernel": "panels"})
    _, r, _ = calibrate.calibrate("tiny-llama", model=(model, tok))
    assert json.loads(path.read_text())["quick"] == ["pld", "sps"] and auto.auto_method("tiny-llama") == r.choice
    path.write_text(json.dumps({"choice": "pld", "calibration_s": None, "quick": None}))  # tune's, over its own list
    assert auto.auto_method("tiny-llama") == "pld"


def test_the_calibration_set_mixes_own_prompts_with_input_reuse(tmp_path):
    from minispec.prompts import calibration_set, own_prompts, reuse_prompts

    own, reuse = [p["prompt"] for p in own_prompts()], [p["prompt"] for p in reuse_prompts()]
    six = calibration_set(6)
    assert six == [reuse[0], own[0], own[1], reuse[1], own[2], own[3]]  # cut short after one, it has seen reuse
    assert tune_report.calibration_prompts(4) == calibration_set(4)  # tune's default: never a benchmark's
    qs = tmp_path / "q.jsonl"
    qs.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["a question"]}) + "\n")
    assert tune_report.calibration_prompts(1, qs) == ["a question"]  # a file only when one is given


def test_sampled_auto_is_calibrated_sampled_and_saved_apart_from_greedy(tiny, tmp_path, monkeypatch):
    """A sampled request's ``auto`` is chosen by a calibration decoded at its own sampling parameters (seeded:
    prompt i with seed i for every candidate), saved in its own file: the greedy choice is neither read for it
    nor overwritten by it, and the line that tells it names the temperature."""
    from minispec.sampling import GREEDY, SamplingParams

    model, tok, draft = tiny
    monkeypatch.setenv("MINISPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(auto, "QUICK_CANDIDATES", ("pld", "sps"))
    monkeypatch.setattr(calibrate, "QUICK_CANDIDATES", ("pld", "sps"))
    monkeypatch.setattr(calibrate, "calibrate_kernels", lambda force=False: {"kernel": "panels"})
    calls = []
    gen_module = sys.modules["minispec.generate"]  # the module (``minispec.generate`` is also the function)
    real_generate = gen_module.generate

    def spy(*a, **kw):
        calls.append((kw.get("params"), kw.get("seed")))
        return real_generate(*a, **kw)

    monkeypatch.setattr(gen_module, "generate", spy)
    hot = SamplingParams(temperature=0.7, top_p=0.9)
    greedy_path, hot_path = auto.tune_path("tiny-llama"), auto.tune_path("tiny-llama", params=hot)
    assert greedy_path != hot_path and hot_path.name.endswith("-b1-T0.7-p0.9.json")
    greedy_path.parent.mkdir(parents=True)
    greedy_path.write_text(json.dumps({"choice": "pld", "calibration_s": 1.0, "quick": ["pld", "sps"]}))  # a greedy choice
    calibrate.write_once(calibrate.choice_path(), {"kernel": "panels", "machine": calibrate.machine_tag()})  # and a kernel
    assert calibrate.needs_calibration("tiny-llama", hot) and not calibrate.needs_calibration("tiny-llama")
    assert "at temperature 0.7, top-p 0.9" in auto.resolve_auto("tiny-llama", params=hot)[1] and not calls
    _, r, _ = calibrate.calibrate("tiny-llama", hot, model=(model, tok))
    assert calls and {p for p, _ in calls} == {hot}  # every calibration generation sampled at hot
    prompts = len({s for _, s in calls})
    assert sorted({s for _, s in calls}) == list(range(prompts))  # seeded by prompt, alike for every candidate
    method, line = auto.resolve_auto("tiny-llama", params=hot)
    assert method == r.choice and "at temperature 0.7, top-p 0.9" in line and "calibrated on this machine" in line
    saved = json.loads(hot_path.read_text())
    assert saved["choice"] == method and saved["params"] == {"temperature": 0.7, "top_k": 0, "top_p": 0.9}
    assert json.loads(greedy_path.read_text())["choice"] == "pld"  # greedy's choice untouched
    calls.clear()
    assert auto.resolve_auto("tiny-llama")[0] == "pld" and not calls
    assert auto.auto_method("tiny-llama", params=hot) == method and auto.auto_method("tiny-llama") == "pld"
    with pytest.raises(FileNotFoundError, match="--temperature 0.5"):
        auto.auto_method("tiny-llama", strict=True, params=SamplingParams(temperature=0.5))
    assert auto.sampling_tag(GREEDY) == "" and auto.sampling_tag(SamplingParams(1.0, 50)) == "-T1-k50"
