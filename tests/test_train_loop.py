"""The resumable training loop shared by ``train eagle3`` and ``train medusa`` (minispec.train.eagle3.fit), and the
order of the training sequences (minispec.train.data.training_sequences)."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from minispec.train.eagle3 import batch_indices, fit


def _args(out: Path, resume: bool, steps: int = 6) -> SimpleNamespace:
    return SimpleNamespace(lr=1e-2, warmup=2, steps=steps, minutes=0, bf16=False, eval_every=3, ckpt_every=2,
                           resume=resume, out=out)


def _run(tmp_path, resume: bool, stop_at: int | None = None):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    y = torch.randn(16, 3, generator=torch.Generator().manual_seed(2))

    ran = []

    def batch_at(step):
        ran.append(step)
        if step == stop_at:
            raise KeyboardInterrupt  # an interrupted run
        return batch_indices(step, 16, 4, seed=0)

    def loss_of(idx):
        return torch.nn.functional.mse_loss(model(x[idx]), y[idx]), [0.5]

    def log(step, loss, gnorm, accs):
        return dict(step=step, loss=loss)

    out = fit("toy", _args(tmp_path / "toy.safetensors", resume), model, batch_at, loss_of, log, lambda: {"before": 1})
    return model, out, ran


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path, monkeypatch):
    monkeypatch.setenv("MINISPEC_CACHE", str(tmp_path / "cache"))
    straight, (steps, history, _, init, resume_path), _ = _run(tmp_path, resume=False)
    assert steps == 6 and [h["step"] for h in history] == [3, 6] and init == {"before": 1}
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, resume=False, stop_at=5)
    assert resume_path.exists()  # the checkpoint after step 4 survived the interruption
    resumed, (steps, history, _, _, _), ran = _run(tmp_path, resume=True)
    assert ran == [4, 5]  # it continued from the checkpoint instead of starting over
    assert steps == 6 and [h["step"] for h in history] == [3, 6]  # history carried over, not repeated
    for a, b in zip(straight.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b)


def test_batches_are_a_seeded_permutation_per_epoch():
    epoch0 = [i for s in range(4) for i in batch_indices(s, 16, 4, seed=3)]
    assert sorted(epoch0) == list(range(16))  # every sequence once per epoch
    assert batch_indices(4, 16, 4, seed=3) != batch_indices(0, 16, 4, seed=3)  # a new order next epoch
    assert batch_indices(2, 16, 4, seed=3) == batch_indices(2, 16, 4, seed=3)  # a function of the step


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
