"""Data-parallel training (minispec.train.ddp through minispec.train.loop): for every trainer (EAGLE-1/2,
EAGLE-3, Medusa), two CPU processes with PyTorch DDP on gloo take the same optimizer steps as one process
on the same global batches."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minispec import load
from minispec.drafters.eagle import EagleConfig, EagleHead
from minispec.drafters.eagle3 import build_vocab_map, eagle3_layers
from minispec.drafters.medusa import MedusaHeads
from minispec.train import ddp, eagle, eagle3, loop, medusa
from minispec.train.data import FeatureData, Sequence, target_features

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo backend")

METHODS = ("eagle", "eagle3", "medusa")
# 3 steps of 4 sequences, no random draws (no feature noise, CE on every position, no row subsampling)
COMMON = ["--steps", "3", "--batch-size", "4", "--lr", "1e-2", "--warmup", "1", "--eval-every", "100",
          "--ckpt-every", "100"]
FLAGS = dict(eagle=["--noise", "0", "--ce-frac", "1", "--draft-vocab", "0", "--eval-tau-seqs", "1", "--no-bf16"],
             eagle3=["--ttt-steps", "3", "--draft-vocab", "64", "--no-bf16"],
             medusa=["--heads", "3", "--max-rows", "0", "--no-bf16"])


def _data(target) -> FeatureData:
    """8 training sequences of unequal lengths (ranks hold unequal numbers of loss positions) and 2 held-out
    ones, with the tiny target's features; identical in every process."""
    g = torch.Generator().manual_seed(0)
    seqs = []
    for n in [12, 20, 9, 16, 24, 11, 18, 14, 15, 13]:
        toks = torch.randint(0, target.cfg.vocab_size, (n,), generator=g)
        seqs.append(Sequence(toks, prompt_len=n // 3, source="test"))
    feats = target_features(target, seqs, layers=eagle3_layers(target.cfg.n_layer), topk=4, cache=False)
    return FeatureData(seqs[:8], seqs[8:], feats[:8], feats[8:])


def _trainer(method: str, target, out: str):
    """The method's own trainer (its flags, model, loss and history entry) and its loop settings."""
    module = dict(eagle=eagle, eagle3=eagle3, medusa=medusa)[method]
    args = module.parse_args(COMMON + FLAGS[method] + ["--out", out])
    data = _data(target)
    torch.manual_seed(0)
    if method == "eagle":
        t = eagle.trainer(args, target, EagleHead(EagleConfig.for_target(target.cfg)), data, draft_head=None)
    elif method == "eagle3":
        counts = torch.bincount(torch.cat([s.tokens for s in data.train]), minlength=target.cfg.vocab_size)
        t = eagle3.trainer(args, target, eagle3.init_head(target, *build_vocab_map(counts, 64)), data)
    else:
        t = medusa.trainer(args, target, MedusaHeads(target.cfg.d_model, 3, target.cfg.vocab_size), data)
    return t, module.loop_settings(args)


def _train(method: str, out: str):
    """``loop.fit`` on the tiny target; returns (initial, final) parameters of the trained module."""
    torch.set_num_threads(1)
    target, _ = load("tiny-llama")
    target.requires_grad_(False)
    t, s = _trainer(method, target, out)
    before = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
    run = loop.fit(s, t)
    assert run.steps == 3
    return before, {k: v.detach().clone() for k, v in t.model.state_dict().items()}


def _worker(rank: int, world: int, port: int, out: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), MINISPEC_CACHE=os.path.dirname(out))
    r, w, device = ddp.setup(use_cuda=False)
    assert (r, w, device.type) == (rank, world, "cpu") and dist.get_backend() == "gloo"
    try:
        torch.save({m: _train(m, f"{out}-{m}.safetensors")[1] for m in METHODS}, f"{out}.{rank}")
    finally:
        ddp.cleanup()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Every method trained by two gloo processes (one spawn): {method: final parameters} of each rank."""
    out = str(tmp_path_factory.mktemp("ddp") / "run")
    mp.spawn(_worker, args=(2, _free_port(), out), nprocs=2, join=True)
    return [torch.load(f"{out}.{r}", weights_only=True) for r in range(2)]


@pytest.mark.parametrize("method", METHODS)
def test_two_gloo_processes_match_one_process(method, two_processes, tmp_path, monkeypatch):
    monkeypatch.setenv("MINISPEC_CACHE", str(tmp_path))
    before, one = _train(method, str(tmp_path / "h.safetensors"))  # a single process: the whole batch
    assert max((one[k] - v).abs().max().item() for k, v in before.items() if v.is_floating_point()) > 1e-3  # it moved
    # fp32 sums in another order: losses agree to ~1e-7; AdamW's normalised updates (lr 1e-2 per step) turn
    # that into parameter differences of up to ~2e-5 (EAGLE-3); ranks that weighted their shares' means
    # equally instead of by their positions end ~4e-2 away
    for rank in two_processes:
        for k, v in one.items():
            torch.testing.assert_close(rank[method][k], v, rtol=1e-5, atol=2e-4, msg=f"{method} {k}")


def test_share_weights_each_rank_by_its_items():
    """In one process ``share`` is the identity; ``local`` never communicates."""
    m = torch.tensor(2.5)
    assert ddp.share(m, 7) == (m, 7) and ddp.local(m, 0) == (m, 0)
    assert ddp.mean_over_ranks({"a": m}) == {"a": m}


def test_shard_splits_one_global_batch():
    idx = [7, 3, 5, 1, 0, 6]
    assert ddp.shard(idx, 0, 2) + ddp.shard(idx, 1, 2) == idx
    assert ddp.shard(idx, 2, 3) == [0, 6]
    assert ddp.shard(idx, 0, 1) == idx
    with pytest.raises(ValueError, match="multiple of the world size"):
        ddp.shard(idx, 0, 4)
