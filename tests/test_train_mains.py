"""Every trainer's ``main`` end to end on the tiny target (minispec.train.loop's start, fit and save tail):
a few steps, the weights saved and loadable, and a JSON record holding every field of the record the same
command wrote for the head shipped in minispec/checkpoints (flags, data, training, eval, history)."""

import json
from pathlib import Path

import pytest
import torch

from minispec import load
from minispec.drafters.eagle3 import eagle3_layers
from minispec.train import distill_draft, eagle, eagle3, loop, medusa
from minispec.train.data import FeatureData, Sequence, target_features

SHIPPED = Path(__file__).resolve().parents[1] / "minispec" / "checkpoints"
ADDED_BY_HAND = {"command_note", "replaces", "measured"}  # in the shipped records, not written by --no-measure runs
COMMON = ["--steps", "3", "--batch-size", "2", "--eval-every", "2", "--ckpt-every", "2"]


@pytest.fixture(scope="module")
def tiny():
    target, tok = load("tiny-llama")
    target.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    seqs = [Sequence(torch.randint(0, target.cfg.vocab_size, (n,), generator=g), n // 3, "distill")
            for n in [12, 20, 9, 16, 24, 11, 13, 15]]
    feats = target_features(target, seqs, layers=eagle3_layers(target.cfg.n_layer), topk=4, cache=False)
    return target, tok, FeatureData(seqs[:6], seqs[6:], feats[:6], feats[6:])


@pytest.fixture
def patched(tiny, tmp_path, monkeypatch):
    """The trainers' target and data replaced by the tiny ones (no SmolLM2, no ShareGPT)."""
    target, tok, data = tiny
    monkeypatch.setenv("MINISPEC_CACHE", str(tmp_path / "cache"))

    def start(args):
        torch.manual_seed(args.seed)
        return target, tok

    def feature_data(args, target, tok, seed=0, features=True):
        return FeatureData(list(data.train), list(data.held), list(data.ftrain), list(data.fheld))

    monkeypatch.setattr(loop, "start", start)
    for module in (eagle, eagle3, medusa):
        monkeypatch.setattr(module, "feature_data", feature_data)
    return tiny


def _keys(d: dict) -> set:
    return set(d) - ADDED_BY_HAND


def _check_fields(record: dict, shipped_name: str) -> None:
    shipped = json.loads((SHIPPED / f"{shipped_name}.json").read_text())
    assert _keys(shipped) <= set(record), _keys(shipped) - set(record)
    for part in ("settings", "data", "training", "eval"):
        assert set(shipped[part]) <= set(record[part]), (part, set(shipped[part]) - set(record[part]))
    assert set(shipped["training"]["history"][-1]) <= set(record["training"]["history"][-1])
    assert record["command"].split(" --")[0] == shipped["command"].split(" --")[0]
    assert record["training"]["steps"] == 3 and [h["step"] for h in record["training"]["history"]] == [2, 3]


@pytest.mark.parametrize("name, module, flags", [
    ("eagle", eagle, ["--draft-vocab", "0", "--eval-tau-seqs", "1", "--final-tau-seqs", "1"]),
    ("eagle3", eagle3, ["--draft-vocab", "64", "--ttt-steps", "2", "--no-bf16"]),
    ("medusa", medusa, ["--heads", "2", "--max-rows", "16", "--no-bf16"]),
])
def test_head_trainers_main(name, module, flags, patched, tmp_path):
    from minispec.drafters.loader import load_drafter

    out = tmp_path / f"{name}.safetensors"
    record = module.main(COMMON + flags + ["--no-measure", "--out", str(out)])
    _check_fields(record, f"smollm2-135m-{name}")
    assert json.loads(out.with_suffix(".json").read_text()) == record
    assert not list((tmp_path / "cache").rglob("*.resume.pt"))  # the save tail removed the resume checkpoint
    load_drafter(out, patched[0], verbose=False)  # the weights load as users load them


def test_train_eagle_with_training_time_test_levels(patched, tmp_path, monkeypatch):
    """``train eagle --ttt-steps 2``: the record of a head trained on its own features too (each level's
    accuracy in the history, the levels in the loss), the weights loadable as users load them."""
    from minispec.drafters.loader import load_drafter

    monkeypatch.setattr(eagle, "draft_head_rows", lambda target, k: target.lm_head.weight[:k].detach())  # tiny vocab
    out = tmp_path / "eagle.safetensors"
    record = eagle.main(COMMON + ["--draft-vocab", "64", "--ttt-steps", "2", "--eval-tau-seqs", "1",
                                  "--final-tau-seqs", "1", "--no-bf16", "--no-measure", "--out", str(out)])
    _check_fields(record, "smollm2-135m-eagle")
    assert [len(h["train_acc_by_level"]) for h in record["training"]["history"]] == [2, 2]
    assert "levels j < 2" in record["training"]["loss"] and record["settings"]["ttt_steps"] == 2
    load_drafter(out, patched[0], verbose=False)


def test_distill_draft_main(patched, tmp_path, monkeypatch):
    target, tok, data = patched

    def examples(seqs, feats):  # the target's own top-k along each sequence's response
        return [dict(prompt=s.tokens[:s.prompt_len], response=s.tokens[s.prompt_len:],
                     top_idx=f["top_idx"][s.prompt_len - 1:-1], top_logp=f["top_logp"][s.prompt_len - 1:-1])
                for s, f in zip(seqs, feats)]

    cache = dict(train=examples(data.train, data.ftrain), heldout=examples(data.held, data.fheld), generation_s=0.0,
                 cached_examples=8, settings=dict(source="tiny"))
    monkeypatch.setattr(distill_draft, "load_or_make_data", lambda args, tok: cache)
    build = distill_draft.build_draft

    def build_draft(target, init_from):  # see test_the_draft_model_trains_with_the_default_attention
        draft = build(target, init_from)
        draft.attention = "split_torch"
        return draft

    monkeypatch.setattr(distill_draft, "build_draft", build_draft)
    out = tmp_path / "draft.safetensors"
    record = distill_draft.main(COMMON + ["--layers", "1", "--init-from", "1", "--topk", "4", "--no-bf16",
                                          "--out", str(out)])
    _check_fields(record, "smollm2-135m-draft")
    assert 0 <= record["eval"]["heldout"]["acceptance"] <= 1 and out.exists()


def test_the_draft_model_trains_with_the_default_attention(tiny):
    """The dense CPU attention is differentiable (out of place under autograd): train draft backpropagates."""
    target = tiny[0]
    draft = distill_draft.build_draft(target, [1])
    tokens = torch.randint(0, target.cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    sel = torch.zeros(2, 20, dtype=torch.bool)
    sel[:, 5:] = True
    top_idx = torch.randint(0, target.cfg.vocab_size, (30, 4), generator=torch.Generator().manual_seed(1))
    kl, _ = distill_draft.distill_loss(draft, tokens, sel, top_idx, torch.zeros(30, 4))
    kl.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in draft.parameters() if p.requires_grad)


def test_train_eagle_two_layers_from_a_one_layer_head_and_resume(patched, tmp_path, monkeypatch):
    """``train eagle --layers 2 --init-from`` a 1-layer head: fc and layer 0 come from it, layer 1 starts as
    the identity (the held-out metrics before training are the 1-layer head's), the record counts the
    layers, and a run interrupted after its checkpoint resumes to the weights of the uninterrupted one."""
    from minispec.drafters.eagle import EagleConfig, EagleHead, load_eagle

    target, _, data = patched
    one = tmp_path / "one.safetensors"
    cfg = EagleConfig.for_target(target.cfg)
    torch.manual_seed(0)
    eagle.save_head(EagleHead(cfg), one, dict(format=eagle.FORMAT, config=cfg.to_dict(), command="train eagle"))
    flags = COMMON + ["--draft-vocab", "0", "--eval-tau-seqs", "1", "--final-tau-seqs", "1", "--no-measure",
                      "--layers", "2", "--init-from", str(one)]
    straight = tmp_path / "straight.safetensors"
    record = eagle.main(flags + ["--out", str(straight)])
    assert record["config"]["num_hidden_layers"] == 2 and record["layers"] == 2 and record["settings"]["layers"] == 2
    assert record["init_from"]["layers_from_checkpoint"] == 1
    assert record["init_from"]["new_layers"].startswith("identity")
    before = eagle.evaluate(load_eagle(one, target).head.float(), target, data.held, data.fheld, tau_seqs=1)
    assert record["eval"]["heldout_before_training"] == before  # the identity layer changed nothing at step 0
    head = load_eagle(straight, target).head
    assert head.cfg.num_hidden_layers == 2 and head.layers[1].self_attn.wo.weight.abs().max() > 0  # it trained

    out = tmp_path / "resumed.safetensors"
    finish = loop.finish

    def interrupted(*args, **kw):
        raise KeyboardInterrupt  # after the last step: the checkpoint of step 2 stays

    monkeypatch.setattr(loop, "finish", interrupted)
    with pytest.raises(KeyboardInterrupt):
        eagle.main(flags + ["--out", str(out)])
    assert list((tmp_path / "cache").rglob("resumed.resume.pt"))
    monkeypatch.setattr(loop, "finish", finish)
    steps, make_batch = [], eagle.make_batch

    def counted(seqs, feats, idx, device="cpu"):
        steps.extend([idx] if len(idx) == 2 else [])  # a training batch (held-out ones come one by one)
        return make_batch(seqs, feats, idx, device)

    monkeypatch.setattr(eagle, "make_batch", counted)
    resumed = eagle.main(flags + ["--out", str(out), "--resume"])
    assert len(steps) == 1  # it ran step 3 alone, from the checkpoint of step 2
    assert resumed["training"]["steps"] == 3 and resumed["eval"]["heldout_before_training"] == before
    again = load_eagle(out, target).head
    for k, v in head.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k


def test_a_held_out_evaluation_leaves_the_eagle_training_step_as_it_was(tiny):
    """``train eagle`` evaluates between steps through an ``EagleDrafter``, which swaps its target's backend into
    the head in place; ``eagle.trainer`` makes that swap before the first step, so a step's gradients are the same
    bits before and after an evaluation (else a run resumed from a checkpoint, which runs no evaluation before its
    first step, trains otherwise than the uninterrupted run)."""
    from minispec.train import ddp

    target, _, data = tiny
    args = eagle.parse_args(["--draft-vocab", "0", "--layers", "2", "--eval-tau-seqs", "1", "--no-bf16"])
    torch.manual_seed(0)
    t = eagle.trainer(args, target, eagle.new_head(args, target), data, None)
    batch = t.batch([0, 4])

    def grads() -> dict[str, torch.Tensor]:
        t.model.zero_grad(set_to_none=True)
        loss, _ = t.loss(t.model, batch, torch.Generator().manual_seed(0), ddp.local)
        loss.backward()
        return {n: p.grad.clone() for n, p in t.model.named_parameters()}

    first = grads()
    t.before()  # the held-out evaluation ``loop.fit`` runs before a fresh run's first step
    again = grads()
    assert set(first) == set(again) and all(torch.equal(first[n], again[n]) for n in first), \
        [n for n in first if not torch.equal(first[n], again[n])]

def test_train_eagle3_from_a_checkpoint_on_selfdistilled_ids(patched, tmp_path, monkeypatch):
    """``train eagle3 --init-from --selfdistill-parts``: the head starts as the checkpoint (its held-out figures
    before training are that head's), keeps its draft vocabulary, and trains on the self-distilled sequences
    too, their three layers' features rebuilt from the ids."""
    from minispec.drafters.loader import load_drafter
    from minispec.train import selfdistill

    target, _, data = patched
    ids = tmp_path / "ids"
    ids.mkdir()
    g = torch.Generator().manual_seed(1)
    for part, lengths in enumerate([(12, 16), (14, 10, 18)]):  # trained on part 1 alone (--selfdistill-first 1)
        selfdistill.write_ids(selfdistill.part_path(ids, part, "ids"),
                              [dict(tokens=torch.randint(0, target.cfg.vocab_size, (n,), generator=g), prompt_len=3)
                               for n in lengths])
    monkeypatch.setattr(selfdistill, "ids_dir", lambda: ids)
    flags = COMMON + ["--draft-vocab", "64", "--ttt-steps", "2", "--no-bf16", "--no-measure", "--topk", "4"]
    first = tmp_path / "first.safetensors"
    eagle3.main(flags + ["--out", str(first)])
    start = load_drafter(first, target, verbose=False).head.float()
    out = tmp_path / "second.safetensors"
    record = eagle3.main(flags + ["--out", str(out), "--init-from", str(first), "--selfdistill-parts", "1",
                                  "--selfdistill-first", "1"])
    assert record["data"]["train_selfdistill_sequences"] == 3 and record["data"]["train_sequences"] == 9
    assert record["training"]["init"] == "warm start from first.safetensors"
    layers = eagle3_layers(target.cfg.n_layer)
    before = eagle3.evaluate(start, target.tok_emb, data.held, data.fheld, layers, 2, eagle3.target_map(start))
    assert record["eval"]["heldout_before_training"] == before
    trained = load_drafter(out, target, verbose=False).head
    assert torch.equal(trained.d2t, start.d2t)
    assert not torch.equal(trained.fc.weight.float(), start.fc.weight.half().float())  # it trained
    from minispec.drafters.eagle import EagleConfig, EagleHead

    one = tmp_path / "eagle1.safetensors"
    cfg = EagleConfig.for_target(target.cfg)
    eagle.save_head(EagleHead(cfg), one, dict(format=eagle.FORMAT, config=cfg.to_dict(), command="train eagle"))
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        eagle3.warm_start(one, target)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("module, flags", [
    (eagle, ["--draft-vocab", "0", "--eval-tau-seqs", "1", "--final-tau-seqs", "1"]),
    (eagle, ["--draft-vocab", "64", "--eval-tau-seqs", "1", "--final-tau-seqs", "1", "--tf32"]),
    (eagle3, ["--draft-vocab", "64", "--ttt-steps", "2", "--no-bf16"]),
    (eagle3, ["--draft-vocab", "64", "--ttt-steps", "2", "--bf16"]),
])
def test_trainers_on_the_gpu(module, flags, tiny, tmp_path, monkeypatch):
    """``--device cuda``: the same trainers with the tiny target on the GPU (features, batches, noise, CE
    subsampling, bf16 autocast there) train, checkpoint and save a head that loads on the CPU. Without CUDA it
    is skipped; the CPU path of every line is what the other tests here run."""
    import copy

    import minispec.drafters.vocab as vocab
    from minispec.drafters.loader import load_drafter

    target, tok, data = tiny
    gpu = copy.deepcopy(target).to("cuda")
    monkeypatch.setenv("MINISPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loop, "start", lambda args: (gpu, tok))
    monkeypatch.setattr(module, "feature_data", lambda args, target, tok, seed=0, features=True:
                        FeatureData(list(data.train), list(data.held), list(data.ftrain), list(data.fheld)))
    monkeypatch.setattr(vocab, "load_counts", lambda path=None: torch.arange(target.cfg.vocab_size))
    out = tmp_path / "gpu.safetensors"
    record = module.main(COMMON + flags + ["--device", "cuda", "--no-measure", "--out", str(out)])
    assert record["training"]["steps"] == 3 and record["settings"]["device"] == "cuda"
    assert list((tmp_path / "cache").rglob("*.resume.pt")) == []  # written at step 2, removed by the save tail
    head = load_drafter(out, target, verbose=False).head  # on the CPU target
    assert all(p.device.type == "cpu" and torch.isfinite(p).all() for p in head.parameters())


@pytest.mark.parametrize("draft_vocab, topk", [(0, 32), (64, 0)])
def test_train_eagle_reads_the_top_k_of_selfdistilled_parts_when_its_ce_needs_it(draft_vocab, topk, monkeypatch):
    """``--draft-vocab 0`` takes its CE against the stored top-k: self-distilled parts must bring it (without
    it, make_batch would fill zeros, a target distribution on token 0); the draft-vocabulary CE needs none."""
    asked = {}

    def selfdistill_data(parts, max_len, target=None, layers=(), topk=0, folder=None, first=0):
        asked.update(parts=parts, topk=topk, first=first)
        return [], []

    monkeypatch.setattr(eagle, "feature_data", lambda args, target, tok, seed=0: FeatureData([], [], [], []))
    monkeypatch.setattr(eagle, "selfdistill_data", selfdistill_data)
    monkeypatch.setattr("minispec.drafters.vocab.load_counts", lambda path=None: torch.arange(256))  # tiny vocab
    args = eagle.parse_args(["--draft-vocab", str(draft_vocab), "--selfdistill-parts", "3", "--selfdistill-first", "5"])
    eagle.load_data(args, load("tiny-llama")[0], None)
    assert asked == dict(parts=3, topk=topk, first=5)


def test_draft_head_rows_are_the_lm_head_rows_of_the_most_frequent_tokens():
    """LM_K for the draft-vocabulary CE (train eagle and chapter 3): the target's LM-head rows of the K most
    frequent tokens, in increasing id order, detached so the frozen target takes no gradient."""
    target = load("tiny-llama")[0]
    V = target.lm_head.weight.shape[0]
    counts = torch.zeros(V, dtype=torch.long)
    counts[[7, 2, 40, 11]] = torch.tensor([5, 9, 9, 1])  # ties to the lower id: 2, 40, 7, then 11
    rows = eagle.draft_head_rows(target, 3, counts)
    assert torch.equal(rows, target.lm_head.weight[[2, 7, 40]]) and not rows.requires_grad
    with pytest.raises(ValueError, match="draft vocabulary size"):
        eagle.draft_head_rows(target, V + 1, counts)


def test_two_writers_of_one_feature_part_do_not_collide(tiny, tmp_path, monkeypatch):
    """Two trainers started side by side (tools/gpu_heads.sh) compute the same held-out feature part: each
    writes its own temporary file, so the second to finish does not find its file moved away by the first."""
    import os

    import minispec.train.data as data

    target, _, d = tiny
    monkeypatch.setenv("MINISPEC_CACHE", str(tmp_path))
    save, pid, other = torch.save, os.getpid, []

    def save_while_another_process_writes_the_same_part(obj, path):
        save(obj, path)
        if not other:  # this writer's file is written; another process now writes and renames the same part
            other.append(None)
            os.getpid = lambda: pid() + 1
            try:
                other[0] = data.target_features(target, d.train[:2], name="race")
            finally:
                os.getpid = pid

    monkeypatch.setattr(data.torch, "save", save_while_another_process_writes_the_same_part)
    mine = data.target_features(target, d.train[:2], name="race")
    assert [f["hidden"].tolist() for f in mine] == [f["hidden"].tolist() for f in other[0]]
    files = sorted(p.name for p in (tmp_path / "features" / "race").iterdir())
    assert len(files) == 1 and files[0].endswith(".pt")
