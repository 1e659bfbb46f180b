"""The resumable training loop shared by ``train eagle3`` and ``train medusa`` (minispec.train.eagle3.fit)."""

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
