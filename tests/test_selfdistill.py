"""minispec.train.selfdistill: features recorded while decoding equal one teacher-forced forward."""

import json

import pytest
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
    first = ["What is 2+2?"] * 700 + [f"prompt {i}" for i in range(50)]
    monkeypatch.setattr(sharegpt, "sharegpt_prompts", lambda: list(first))
    monkeypatch.setattr(sharegpt, "sharegpt_later_prompts", lambda: ["later 1", "What is 2+2?", "later 2"])
    order = selfdistill.prompt_order(seed=0)
    assert "What is 2+2?" not in order and len(order) <= 750 - selfdistill.SKIP + 2
    assert sorted(order[-2:]) == ["later 1", "later 2"]  # every first-turn prompt comes first


def _decode(model, tok, prompts, n=12):
    recorders = [FeatureRecorder() for _ in prompts]
    results, _ = generate_batch(model, tok, prompts, drafter=recorders, max_new_tokens=n, chat=False,
                                stop_at_eos=False)
    return [dict(tokens=torch.tensor(r.prompt_tokens + r.tokens, dtype=torch.int32), prompt_len=len(r.prompt_tokens),
                 hidden=rec.features) for r, rec in zip(results, recorders)]


def test_ids_round_trip_and_features_rebuilt_from_them_equal_the_recorded(tmp_path, monkeypatch):
    """A fresh machine has the committed ids but not the recorded features: one teacher-forced forward
    (``target_features``, sequences batched with padding) rebuilds them bit for bit, EAGLE-3's layers too."""
    import pytest

    from minispec.drafters.eagle3 import eagle3_layers
    from minispec.train.data import selfdistill_data

    monkeypatch.setenv("MINISPEC_CACHE", str(tmp_path / "cache"))
    model, tok = load("tiny-llama")
    seqs = _decode(model, tok, [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7], [2, 7]])
    ids = tmp_path / "ids"
    ids.mkdir()
    selfdistill.write_ids(selfdistill.part_path(ids, 0, "ids"), seqs)
    back = selfdistill.read_ids(selfdistill.part_path(ids, 0, "ids"))
    assert [(b["tokens"].tolist(), b["prompt_len"]) for b in back] == [(s["tokens"].tolist(), s["prompt_len"]) for s in seqs]

    with pytest.raises(ValueError, match="pass the target"):
        selfdistill_data(1, 64, folder=ids)  # nothing recorded here and no target to rebuild with
    got, feats = selfdistill_data(1, 10, model, folder=ids)  # max_len 10 cuts the two longer ones
    for s, g, f in zip(seqs, got, feats):
        n = min(len(s["tokens"]) - 1, 10)
        assert g.tokens.tolist() == s["tokens"][:n].tolist() and g.source == "selfdistill"
        assert torch.equal(f["hidden"], s["hidden"][:n])  # bit for bit
    _, feats3 = selfdistill_data(1, 64, model, layers=eagle3_layers(model.cfg.n_layer), topk=4, folder=ids)
    assert set(feats3[0]["layers"]) == set(eagle3_layers(model.cfg.n_layer)) and feats3[0]["top_idx"].shape[1] == 4

    recorded = tmp_path / "cache" / "selfdistill"
    recorded.mkdir(parents=True)
    marked = [dict(s, hidden=s["hidden"] + 1) for s in seqs]  # to tell the recording from a rebuild
    torch.save(dict(sequences=marked), selfdistill.part_path(recorded, 0))
    _, feats = selfdistill_data(1, 64, folder=ids)  # read as recorded: no target needed
    assert all(torch.equal(f["hidden"], m["hidden"]) for f, m in zip(feats, marked))
    with pytest.raises(SystemExit, match="holds 1 self-distilled parts, parts 0-1 asked"):
        selfdistill_data(2, 64, model, folder=ids)

    later = _decode(model, tok, [[4, 4, 2], [8, 1, 6, 1]])  # a second part, read alone with first=1
    selfdistill.write_ids(selfdistill.part_path(ids, 1, "ids"), later)
    got, feats = selfdistill_data(1, 64, model, folder=ids, first=1)  # part 1 not recorded: rebuilt
    assert [g.tokens.tolist() for g in got] == [s["tokens"][:-1].tolist() for s in later]
    assert all(torch.equal(f["hidden"], s["hidden"][:len(s["tokens"]) - 1]) for f, s in zip(feats, later))  # bit for bit
    with pytest.raises(ValueError, match="pass the target"):
        selfdistill_data(2, 64, folder=ids)  # part 1 not recorded and no target
    got, feats = selfdistill_data(2, 64, model, folder=ids)  # part 0 as recorded, part 1 rebuilt
    assert len(got) == 5 and all(torch.equal(f["hidden"], m["hidden"]) for f, m in zip(feats[:3], marked))
    assert all(torch.equal(f["hidden"], s["hidden"][:len(s["tokens"]) - 1]) for f, s in zip(feats[3:], later))
    torch.save(dict(sequences=later), selfdistill.part_path(recorded, 1))
    got, feats = selfdistill_data(2, 64, folder=ids)  # both recorded now: parts 0 and 1, no target needed
    assert len(got) == 5 and all(torch.equal(f["hidden"], m["hidden"]) for f, m in zip(feats, marked + later))
    with pytest.raises(ValueError, match="first must be >= 0"):
        selfdistill_data(1, 64, folder=ids, first=-1)


def test_main_resumes_at_the_next_part_and_keeps_its_settings(tmp_path, monkeypatch):
    import pytest

    import minispec.loading

    monkeypatch.setenv("MINISPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(minispec.loading, "load", lambda name: load("tiny-llama"))
    monkeypatch.setattr(selfdistill, "prompt_order", lambda seed=0: [f"prompt {i}" for i in range(5)])
    flags = ["--part-prompts", "2", "--batch-size", "2", "--max-new-tokens", "4", "--ids-out", str(tmp_path / "ids")]
    selfdistill.main(flags + ["--parts", "1"])
    first = selfdistill.read_ids(selfdistill.part_path(tmp_path / "ids", 0, "ids"))
    selfdistill.main(flags + ["--parts", "5"])  # resumes at part 1; the five prompts end within part 2
    index = json.loads((tmp_path / "ids" / "index.json").read_text())
    assert [p["part"] for p in index["parts"]] == [0, 1, 2] and [p["sequences"] for p in index["parts"]] == [2, 2, 1]
    assert selfdistill.existing_parts(tmp_path / "ids") == 3
    assert selfdistill.existing_parts(tmp_path / "cache" / "selfdistill", "part") == 3
    again = selfdistill.read_ids(selfdistill.part_path(tmp_path / "ids", 0, "ids"))
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(first, again))  # part 0 was not redone
    with pytest.raises(SystemExit, match="--max-new-tokens 4"):
        selfdistill.main(flags[:-4] + ["--max-new-tokens", "8", "--ids-out", str(tmp_path / "ids")])


def test_a_batch_of_several_parts_writes_the_parts_of_one_part_at_a_time(tmp_path, monkeypatch):
    """``--batch-size`` a multiple of ``--part-prompts``: the parts' prompts are decoded together, and each part
    (ids and recorded features) is what decoding it alone writes."""
    import minispec.loading

    monkeypatch.setenv("MINISPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(minispec.loading, "load", lambda name: load("tiny-llama"))
    monkeypatch.setattr(selfdistill, "prompt_order", lambda seed=0: [f"prompt {i} " * (i + 1) for i in range(5)])
    calls = []
    make_part = selfdistill.make_part
    monkeypatch.setattr(selfdistill, "make_part", lambda t, tok, ids, args: calls.append(len(ids)) or make_part(t, tok, ids, args))
    for batch in ("2", "4"):
        selfdistill.main(["--part-prompts", "2", "--batch-size", batch, "--max-new-tokens", "5", "--parts", "3",
                          "--ids-out", str(tmp_path / batch), "--out", str(tmp_path / f"feats{batch}")])
    assert calls == [2, 2, 1, 4, 1]  # parts 0 and 1 in one call at batch 4
    for i in range(3):
        one, two = (selfdistill.read_ids(selfdistill.part_path(tmp_path / b, i, "ids")) for b in ("2", "4"))
        assert [s["tokens"].tolist() for s in one] == [s["tokens"].tolist() for s in two] and len(one) == (2 if i < 2 else 1)
        f1, f2 = (torch.load(selfdistill.part_path(tmp_path / f"feats{b}", i), weights_only=True) for b in ("2", "4"))
        assert all(torch.equal(a["hidden"], b["hidden"]) for a, b in zip(f1["sequences"], f2["sequences"]))


def _flags(tmp_path, *more):
    return ["--part-prompts", "2", "--batch-size", "4", "--max-new-tokens", "6", "--ids-out", str(tmp_path / "ids"),
            "--out", str(tmp_path / "feats"), *more]


def test_transformers_generator_gives_minispecs_greedy_answers_from_an_exported_prompts_file(tmp_path, monkeypatch):
    """The GPU path (transformers' batched generate, several parts per call, prompts read from an
    ``--export-prompts`` file on a machine without ShareGPT) writes the parts minispec's batch decoder writes
    on the CPU: the same sequences, token for token (tiny-llama, float32, no EOS: every answer runs to the end)."""
    import minispec.loading

    monkeypatch.setenv("MINISPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(minispec.loading, "load", lambda name: load("tiny-llama"))
    load_hf = minispec.loading.load_hf
    monkeypatch.setattr(minispec.loading, "load_hf", lambda name: load_hf("tiny-llama"))
    monkeypatch.setattr(selfdistill, "prompt_order", lambda seed=0: [f"prompt number {i}" for i in range(7)])
    prompts = tmp_path / "prompts.npz"
    selfdistill.main(_flags(tmp_path, "--parts", "4", "--export-prompts", str(prompts)))
    assert not (tmp_path / "ids" / "index.json").exists()  # exporting generates nothing
    assert [len(v) for v in selfdistill.read_prompts(prompts).values()] == [2, 2, 2, 1]

    monkeypatch.setattr(selfdistill, "prompt_order", lambda seed=0: 1 / 0)  # no ShareGPT on the GPU machine
    gpu = _flags(tmp_path, "--generator", "transformers", "--prompts-file", str(prompts))
    selfdistill.main(gpu + ["--parts", "1"])
    selfdistill.main(gpu + ["--parts", "3"])  # resumes at part 1; parts 1 and 2 in one call (batch 4)
    with pytest.raises(SystemExit, match="not of part 4"):
        selfdistill.main(gpu + ["--parts", "1"])
    index = json.loads((tmp_path / "ids" / "index.json").read_text())
    assert [p["part"] for p in index["parts"]] == [0, 1, 2, 3]
    assert all(p["generator"] == "transformers generate (cpu)" for p in index["parts"])
    got = [s for i in range(4) for s in selfdistill.read_ids(selfdistill.part_path(tmp_path / "ids", i, "ids"))]

    model, tok = load("tiny-llama")
    ids = [s["tokens"][:s["prompt_len"]].tolist() for s in got]
    assert [bytes(x).decode() for x in ids] == [f"prompt number {i}" for i in range(7)]
    results, _ = generate_batch(model, tok, ids, max_new_tokens=6, chat=False)
    assert [s["tokens"].tolist() for s in got] == [r.prompt_tokens + r.tokens for r in results]


def test_bad_flag_combinations_are_refused():
    with pytest.raises(SystemExit):
        selfdistill.parse_args(["--device", "cuda"])  # minispec's decoder runs on the CPU
    with pytest.raises(SystemExit):
        selfdistill.parse_args(["--export-prompts", "a.npz", "--prompts-file", "b.npz"])


def test_committed_parts_match_their_index():
    """The parts in data/selfdistill are whole: each holds the sequences and tokens its index entry counts."""
    folder = selfdistill.ids_dir()
    index = json.loads((folder / "index.json").read_text())
    n = selfdistill.existing_parts(folder)
    assert n == len(index["parts"]) and [p["part"] for p in index["parts"]] == list(range(n))
    for entry in index["parts"]:
        seqs = selfdistill.read_ids(selfdistill.part_path(folder, entry["part"], "ids"))
        assert len(seqs) == entry["sequences"] and sum(len(s["tokens"]) for s in seqs) == entry["tokens"]
        assert all(0 < s["prompt_len"] < len(s["tokens"]) for s in seqs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_transformers_generator_on_the_gpu(tmp_path, monkeypatch):
    """``--generator transformers --device cuda`` (what tools/gpu_heads.sh runs): the parts are written whole,
    their index names the GPU, and the prompts are the file's. Without CUDA it is skipped; the CPU test above
    runs every other line of that path."""
    import minispec.loading

    monkeypatch.setenv("MINISPEC_CACHE", str(tmp_path / "cache"))
    load_hf = minispec.loading.load_hf
    monkeypatch.setattr(minispec.loading, "load_hf", lambda name: load_hf("tiny-llama"))
    _, tok = load("tiny-llama")
    prompts = tmp_path / "prompts.npz"
    sent = {0: [list(b"first prompt"), list(b"second")], 1: [list(b"third one here")]}
    selfdistill.export_prompts(prompts, sent)
    selfdistill.main(_flags(tmp_path, "--generator", "transformers", "--device", "cuda", "--prompts-file",
                            str(prompts), "--parts", "2"))
    index = json.loads((tmp_path / "ids" / "index.json").read_text())
    assert [p["generator"] for p in index["parts"]] == [f"transformers generate ({torch.cuda.get_device_name()})"] * 2
    for i, want in sent.items():
        got = selfdistill.read_ids(selfdistill.part_path(tmp_path / "ids", i, "ids"))
        assert [s["tokens"][:s["prompt_len"]].tolist() for s in got] == want
        assert all(len(s["tokens"]) == s["prompt_len"] + 6 for s in got)  # no EOS in tiny-llama: 6 new tokens
