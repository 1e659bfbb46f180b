"""Data-parallel EAGLE training (minispec.train.ddp): two CPU processes with PyTorch DDP on gloo
take the same optimizer steps as one process on the same global batches."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minispec import load
from minispec.drafters.eagle import EagleConfig, EagleHead
from minispec.train import ddp
from minispec.train.data import Sequence
from minispec.train.eagle import train_step

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo backend")

STEPS, BATCH = 3, 4


def _setting():
    """The tiny target, 8 sequences of unequal lengths (ranks hold unequal numbers of loss
    positions) with their features, a fresh head and its optimizer; identical in every process."""
    target, _ = load("tiny-llama")
    target.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    seqs, feats = [], []
    for n in [12, 20, 9, 16, 24, 11, 18, 14]:
        toks = torch.randint(0, target.cfg.vocab_size, (n,), generator=g)
        seqs.append(Sequence(toks, prompt_len=n // 3, source="test"))
        with torch.no_grad():
            out = target(toks[None])
            logp = torch.log_softmax(target.lm_head(out.hidden[0]).float(), -1)
        top_logp, top_idx = logp.topk(4, -1)
        feats.append(dict(hidden=out.hidden[0].float(), top_idx=top_idx, top_logp=top_logp))
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(target.cfg))
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2, betas=(0.9, 0.95))
    return target, seqs, feats, head, opt


def _train(mode: str = "ddp"):
    """STEPS steps on fixed global batches; returns (global loss per step, final head parameters).
    ``mode="nowrap"`` trains without DDP (each rank on its share alone), to check the test can fail."""
    torch.set_num_threads(1)
    target, seqs, feats, head, opt = _setting()
    model = head if mode == "nowrap" else ddp.wrap(head)
    losses = []
    for step in range(STEPS):
        idx = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(step))[:BATCH].tolist()
        loss = train_step(model, target, seqs, feats, idx, opt, ce_weight=0.1, ce_frac=1.0, noise=0.0)[0]
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in head.state_dict().items()}


def _worker(rank: int, world: int, port: int, mode: str, out: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    r, w, device = ddp.setup(use_cuda=False)
    assert (r, w, device.type) == (rank, world, "cpu") and dist.get_backend() == "gloo"
    try:
        torch.save(_train(mode), f"{out}.{rank}")
    finally:
        ddp.cleanup()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two(tmp_path, mode: str = "ddp"):
    out = str(tmp_path / mode)
    mp.spawn(_worker, args=(2, _free_port(), mode, out), nprocs=2, join=True)
    return [torch.load(f"{out}.{r}", weights_only=True) for r in range(2)]


def test_two_gloo_processes_match_one_process(tmp_path):
    one_losses, one_params = _train()  # a single process: no process group, the whole batch
    # fp32 sums in another order: losses agree to ~1e-7; AdamW's normalised updates (lr 1e-2 per step)
    # turn that into parameter differences of a few 1e-6, far below one step (1e-2)
    for losses, params in run_two(tmp_path):
        assert losses == pytest.approx(one_losses, rel=1e-5)
        for k, v in one_params.items():
            torch.testing.assert_close(params[k], v, rtol=1e-5, atol=3e-5, msg=k)
    assert one_losses[0] != one_losses[-1]  # the steps did move the head


def test_shard_splits_one_global_batch():
    idx = [7, 3, 5, 1, 0, 6]
    assert ddp.shard(idx, 0, 2) + ddp.shard(idx, 1, 2) == idx
    assert ddp.shard(idx, 2, 3) == [0, 6]
    assert ddp.shard(idx, 0, 1) == idx
    with pytest.raises(ValueError, match="multiple of the world size"):
        ddp.shard(idx, 0, 4)
