"""The one training loop of every trainer (minispec.train.loop): resumable runs, the seeded batch order, the
schedule, the save tail; and the order of the training sequences (minispec.train.data.training_sequences)."""

import json
import math
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minispec.train import loop
from minispec.train.loop import batch_indices, lr_at, progress


def _settings(out: Path, resume: bool, steps: int = 6) -> loop.Settings:
    return loop.Settings(name="toy", out=out, steps=steps, batch_size=4, lr=1e-2, warmup=2, eval_every=3, ckpt_every=2,
                         resume=resume)


def _run(tmp_path, resume: bool, stop_at: int | None = None):
    """A linear model fitted by the loop on 16 fixed examples; ``stop_at`` interrupts it at that step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    y = torch.randn(16, 3, generator=torch.Generator().manual_seed(2))
    ran = []

    def batch(idx):
        ran.append(idx)
        if len(ran) - 1 == stop_at:  # the step about to run (a run that starts at step 0)
            raise KeyboardInterrupt  # an interrupted run
        return idx

    def loss(m, idx, generator, share):
        err, _ = share(torch.nn.functional.mse_loss(m(x[idx]), y[idx]), len(idx))
        return err, dict(acc=torch.tensor([0.5, 0.25]))

    t = loop.Trainer(model=model, lengths=[5] * 16, batch=batch, loss=loss,
                     log=lambda n: dict(loss=n["loss"], acc=n["acc"]), before=lambda: {"before": 1})
    return model, loop.fit(_settings(tmp_path / "toy.safetensors", resume), t), ran


def test_fit_bounds_the_heap_at_its_first_step_only_when_asked(tmp_path, monkeypatch):
    """``python -m minispec train`` sets ``loop.BOUND_HEAP``: ``fit`` then fixes glibc's mmap threshold once, before
    its first step (after the features, which run faster without it); a ``fit`` called otherwise leaves the heap alone."""
    monkeypatch.setenv("MINISPEC_CACHE", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(loop, "bounded_heap", lambda: calls.append("heap"))
    _run(tmp_path / "a", resume=False)
    assert calls == []
    monkeypatch.setattr(loop, "BOUND_HEAP", True)
    model, run, ran = _run(tmp_path / "b", resume=False)
    assert calls == ["heap"] and run.steps == 6


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path, monkeypatch):
    monkeypatch.setenv("MINISPEC_CACHE", str(tmp_path / "cache"))
    straight, run, ran = _run(tmp_path, resume=False)
    assert run.steps == 6 and [h["step"] for h in run.history] == [3, 6] and run.init_eval == {"before": 1}
    assert run.history[0]["acc"] == [0.5, 0.25] and run.history[0]["train_tokens_per_s"] > 0
    assert ran == [batch_indices(s, 16, 4, seed=0) for s in range(6)]
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, resume=False, stop_at=5)
    assert run.resume_path.exists()  # the checkpoint after step 4 survived the interruption
    resumed, run2, ran = _run(tmp_path, resume=True)
    assert ran == [batch_indices(s, 16, 4, seed=0) for s in (4, 5)]  # it continued instead of starting over
    assert run2.steps == 6 and [h["step"] for h in run2.history] == [3, 6]  # history carried over, not repeated
    for a, b in zip(straight.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b)


def test_batches_are_a_seeded_permutation_per_epoch():
    epoch0 = [i for s in range(4) for i in batch_indices(s, 16, 4, seed=3)]
    assert sorted(epoch0) == list(range(16))  # every sequence once per epoch
    assert batch_indices(4, 16, 4, seed=3) != batch_indices(0, 16, 4, seed=3)  # a new order next epoch
    assert batch_indices(2, 16, 4, seed=3) == batch_indices(2, 16, 4, seed=3)  # a function of the step
    assert len(batch_indices(5, 3, 4, seed=0)) == 3  # fewer sequences than a batch: one step per epoch


def test_schedule_warms_up_then_follows_the_fraction_done():
    assert [lr_at(s, 0.0, 1.0, 4) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(10, 0.0, 1.0, 4) == pytest.approx(1.0) and lr_at(10, 1.0, 1.0, 4) == pytest.approx(0.1)
    assert lr_at(10, 0.5, 1.0, 4) == pytest.approx(0.1 + 0.9 * 0.5)  # cosine midpoint
    assert lr_at(10, 3.0, 1.0, 4) == pytest.approx(0.1)  # past the end: the floor
    assert progress(30, 100, 0.0, 0) == 0.3 and progress(30, 100, 30.0, 1.0) == 0.5  # whichever is further
    assert progress(30, 0, 45.0, 1.0) == 0.75  # time only (train eagle --minutes)
    with pytest.raises(ValueError, match="--steps or --minutes"):
        loop.Settings(name="x", out=Path("x"), steps=0, batch_size=1, lr=1.0, warmup=0, eval_every=1, ckpt_every=1)


def test_settings_follow_the_flags(tmp_path):
    from minispec.train import eagle, eagle3, medusa

    a = eagle.parse_args(["--minutes", "5", "--steps", "7", "--out", str(tmp_path / "e.safetensors")])
    assert eagle.loop_settings(a).steps == 0 and eagle.loop_settings(a).minutes == 5  # --steps ignored
    assert eagle.loop_settings(eagle.parse_args(["--steps", "7"])).steps == 7
    s = eagle3.loop_settings(eagle3.parse_args(["--minutes", "5", "--steps", "7", "--no-bf16"]))
    assert (s.steps, s.minutes, s.bf16, s.weight_decay, s.name) == (7, 5, False, 0.0, "eagle3")
    assert medusa.parse_args([]).distill_prompts == 576  # the flag medusa's data loading reads


def test_the_save_tail_writes_weights_record_and_drops_the_resume_file(tmp_path):
    out, resume = tmp_path / "h.safetensors", tmp_path / "h.resume.pt"
    resume.write_text("x")
    saved = []
    run = loop.Run(steps=3, resume_path=resume)
    rec = loop.finish(out, dict(eval={}), lambda o, r: saved.append(o), run, t_start=0.0,
                      heldout=lambda: {"acc": 1.0}, measure=lambda r: {**r, "measured": True})
    assert saved == [out] and not resume.exists()
    assert json.loads(out.with_suffix(".json").read_text()) == rec
    assert rec["eval"]["heldout"] == {"acc": 1.0} and rec["measured"] and rec["run_s"] > 0
    assert loop.shown(Path(loop.__file__)) == "minispec/train/loop.py" and loop.shown(tmp_path / "a.b") == "a.b"
    assert math.isclose(loop.training_record(run, _settings(out, False), 6, "l")["epochs"], 2.0)


def test_training_sequences_order_and_held_out_prompts(smollm2, monkeypatch):
    """ShareGPT replies first, then distilled examples, and the ShareGPT selection is the same whatever
    the number of distilled examples (so their cached feature parts are shared); never a held-out prompt."""
    from minispec.tokenizer import encode_prompt
    from minispec.train import data

    _, tok = smollm2
    pairs = [(f"question {i}?", f"answer {i}.") for i in range(40)]
    ex = lambda i: dict(prompt=torch.tensor(encode_prompt(tok, pairs[i][0], chat=True)),  # noqa: E731
                        response=torch.tensor(tok.encode(f"distilled {i}", add_special_tokens=False)))
    held_ex = [ex(i) for i in range(3)]
    monkeypatch.setattr(data, "sharegpt_pairs", lambda: list(pairs))
    runs = {}
    for n in (0, 5):
        monkeypatch.setattr(data, "_distill_examples", lambda tok, heldout, prompts: ([ex(3 + i) for i in range(prompts)], held_ex))
        runs[n] = data.training_sequences(tok, heldout=3, extra_sharegpt=10, distill_prompts=n)
    (t0, _), (t5, h5) = runs[0], runs[5]
    assert [s.source for s in t5] == ["sharegpt"] * 10 + ["distill"] * 5 and len(t0) == 10
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(t0, t5[:10]))
    held_prompts = {tuple(s.tokens[:s.prompt_len].tolist()) for s in h5}
    assert len(h5) == 3 and not held_prompts & {tuple(s.tokens[:s.prompt_len].tolist()) for s in t5}


def test_a_device_other_than_the_cpu_runs_in_one_process(monkeypatch):
    """Under torchrun the ranks train on the CPU (gloo); --device cuda is refused before anything loads."""
    from types import SimpleNamespace

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="one process"):
        loop.start(SimpleNamespace(device="cuda", threads=1, seed=0))


HEAP_PROBE = """
import sys, torch
from minispec.train.loop import bounded_heap
if sys.argv[1] == "fixed":
    assert bounded_heap()
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
big = torch.ones(6 << 20)  # 24 MiB, mmapped; freeing it raises glibc's dynamic threshold to 24 MiB
del big
a = torch.ones(4 << 20)  # 16 MiB, touched
pin = torch.ones(16 << 10)  # 64 KiB allocated after it, so that a heap could not shrink past it
before = rss()
del a
print((before - rss()) >> 20)  # MiB given back to the OS
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")
def test_bounded_heap_gives_freed_tensors_back():
    """``loop.bounded_heap`` (``python -m minispec train`` sets it): a freed 16 MiB tensor goes back to the OS even after a
    freed 24 MiB block raised glibc's mmap threshold; with the threshold left to glibc, it stays in the heap
    (what grew a long CPU training by ~35 MB a step until it ran out of memory)."""
    freed = {mode: int(subprocess.run([sys.executable, "-c", HEAP_PROBE, mode], capture_output=True, text=True,
                                      check=True).stdout) for mode in ("fixed", "glibc")}
    assert freed["fixed"] >= 15, freed
    assert freed["glibc"] < 4, freed
