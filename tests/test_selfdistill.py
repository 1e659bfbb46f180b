"""minispec.train.selfdistill: features recorded while decoding equal one teacher-forced forward."""

import json

import torch

from minispec import load
from minispec.batch import generate_batch
from minispec.train import selfdistill
from minispec.train.selfdistill import FeatureRecorder, spec_bench_texts


def test_recorded_features_equal_a_teacher_forced_forward():
    model, tok = load("tiny-llama")
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7]]  # ragged: different lengths in one batch
    recorders = [FeatureRecorder() for _ in prompts]
    results, _ = generate_batch(model, tok, prompts, drafter=recorders, max_new_tokens=12, chat=False,
                                stop_at_eos=False)
    with torch.inference_mode():
        for r, rec in zip(results, recorders):
            tokens = torch.tensor([r.prompt_tokens + r.tokens])
            assert rec.features.shape == (tokens.shape[1] - 1, model.cfg.d_model)
            assert torch.equal(model(tokens).hidden[0, :-1].half(), rec.features)  # bit for bit: row invariance


def test_vanilla_output_is_unchanged_by_recording():
    model, tok = load("tiny-llama")
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    plain, _ = generate_batch(model, tok, prompts, max_new_tokens=10, chat=False, stop_at_eos=False)
    rec, _ = generate_batch(model, tok, prompts, drafter=[FeatureRecorder() for _ in prompts], max_new_tokens=10,
                            chat=False, stop_at_eos=False)
    assert [r.tokens for r in plain] == [r.tokens for r in rec]


def test_spec_bench_questions_are_banned(tmp_path, monkeypatch):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"turns": ["What is  2+2?", "And 3+3?"]}) + "\n")
    assert spec_bench_texts(path) == {"What is 2+2?", "And 3+3?"}
    monkeypatch.setattr(selfdistill, "spec_bench_texts", lambda path=None: {"What is 2+2?"})
    import minispec.train.sharegpt as sharegpt  # prompt_order reads the prompts there
    monkeypatch.setattr(sharegpt, "sharegpt_prompts", lambda: ["What is 2+2?"] * 700 + [f"prompt {i}" for i in range(50)])
    order = selfdistill.prompt_order(seed=0)
    assert "What is 2+2?" not in order and len(order) <= 750 - selfdistill.SKIP
