"""Data-parallel training with PyTorch DDP, for trainers launched under ``torchrun``.

PyTorch's DistributedDataParallel (Li et al. 2020, "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB) keeps one replica of the model per process and,
during ``backward()``, all-reduces the gradients in buckets so that every rank ends the step
with the AVERAGE of the ranks' gradients; identical optimizers then keep the replicas identical.
Nothing here re-implements that: ``wrap`` hands the module to ``torch.nn.parallel.DistributedDataParallel``.

Launch (one process per GPU, or several CPU processes):

    torchrun --nproc_per_node 2 -m minispec train eagle ...

``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``;
``setup`` reads them (without them it is the single process: rank 0 of 1, no process group).

Batches: every rank builds the SAME global batch of sequence indices (the single-process one)
and ``shard`` gives each rank its contiguous share. If each rank's loss is the mean over its
share and the shares are equal, the DDP average of the ranks' gradients is the gradient of the
mean over the whole batch, i.e. the single-process gradient. A global batch that world size does
not divide is rejected (unequal shares would weight the ranks wrongly). The losses are means over
token positions, though, and the ranks hold different numbers of them: ``share`` turns a rank's
mean over its n positions into mean x world x n / N (N: every rank's positions), whose average over
the ranks is the mean over all N, so DDP's gradient average is again the single-process gradient.
Every trainer's loss takes its means through ``share`` when ``minispec.train.loop`` trains it, and
through ``local`` (no communication) when it evaluates.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def setup(use_cuda: bool | None = None) -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes; returns (rank, world_size, device).

    ``use_cuda`` (default: CUDA is available) picks the ``nccl`` backend and the GPU
    ``cuda:LOCAL_RANK``; otherwise ``gloo`` on the CPU. With ``WORLD_SIZE`` unset or 1 no process
    group is created.
    """
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world)
    return rank, world, device


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main() -> bool:
    """True on rank 0 (and in a single process): the rank that evaluates, logs and saves."""
    return rank() == 0


def wrap(module: torch.nn.Module, device: torch.device | None = None) -> torch.nn.Module:
    """``DistributedDataParallel(module)`` when several processes train, else ``module`` itself."""
    if world_size() == 1:
        return module
    ids = [device.index] if device is not None and device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(module, device_ids=ids)


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The plain module inside a DDP wrapper (for evaluation and saving)."""
    return module.module if isinstance(module, torch.nn.parallel.DistributedDataParallel) else module


def shard(indices: list[int], rank: int, world: int) -> list[int]:
    """This rank's contiguous share of one global batch: ``indices[rank * n : (rank + 1) * n]``."""
    if len(indices) % world:
        raise ValueError(f"a global batch of {len(indices)} sequences does not split evenly over {world} "
                         f"processes; use a --batch-size that is a multiple of the world size")
    n = len(indices) // world
    return list(indices[rank * n:(rank + 1) * n])


def local(mean: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """A mean over ``n`` items of a batch this process holds whole: (``mean``, ``n``) as they are."""
    return mean, n


def share(mean: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """This rank's share of a mean over the items of the global batch, and the number of those items.

    Args:
        mean: this rank's mean over its ``n`` items (any value when ``n`` is 0).
        n: how many items (token positions) this rank's mean is over.
    Returns:
        (mean x world x n / N, N) with N the items of every rank (one all-reduce): the average of the
        shares over the ranks is the mean over all N items. In a single process: (mean, n). A rank
        without items gives a zero share (which still reaches every parameter, as DDP requires).
        Every rank must call it the same number of times in the same order (a collective).
    """
    world = world_size()
    if world == 1:
        return mean, n
    total = torch.tensor([float(n)], dtype=torch.float64)
    dist.all_reduce(total)
    N = int(total.item())
    if n == 0:
        return torch.nan_to_num(mean) * 0.0, N  # the mean of no items is nan; its gradient is 0 here
    return mean * (world * n / N), N


def mean_over_ranks(stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor averaged over the ranks (one all-reduce), e.g. the global value of a ``share``;
    ``stats`` itself in a single process."""
    world = world_size()
    if world == 1:
        return stats
    flat = torch.cat([v.detach().double().reshape(-1) for v in stats.values()])
    dist.all_reduce(flat)
    flat /= world
    out, i = {}, 0
    for k, v in stats.items():
        out[k] = flat[i:i + v.numel()].reshape(v.shape).float()
        i += v.numel()
    return out


def from_main(x: float) -> float:
    """Rank 0's value of ``x`` on every rank (e.g. its clock, for a time-based schedule)."""
    if world_size() == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64)
    dist.broadcast(t, 0)
    return t.item()


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def cleanup() -> None:
    """Leave the process group (a no-op in a single process)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
