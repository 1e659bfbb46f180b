"""The one training loop of every minispec trainer (``train draft``, ``eagle``, ``eagle3``, ``medusa``).

Each method file holds its model and its loss and hands them to ``fit`` as a ``Trainer``; this
file holds what they share:

  data      optimizer step s trains on ``batch_indices(s)``: a seeded permutation of the training
            sequences per epoch, so a step's batch is a function of the step (a resumed run takes
            the same batches as an uninterrupted one).
  optim     AdamW(0.9, 0.95) on the trainable parameters (frozen ones, e.g. an LM head shared with
            the target, are neither optimised nor checkpointed), gradient clipping, optional bf16
            autocast (fp32 weights and optimizer state).
  device    ``--device`` (default cpu): where the target, the model trained and each batch live; the
            same code trains on a GPU (``--device cuda``), with the noise / subsampling generator there.
  schedule  linear warm-up (Goyal et al. 2017), then cosine decay to 0.1 x lr (Loshchilov & Hutter
            2017, "SGDR") over the run: ``steps`` optimizer steps or a ``minutes`` wall-time budget,
            whichever ends first; the cosine follows the larger fraction done. A time budget suits a
            shared CPU whose speed changes during a run.
  eval      the method's held-out metrics every ``eval_every`` steps and at the end (the history).
  resume    every ``ckpt_every`` steps: trainable weights, optimizer state, step, history and time
            in ``cache_dir()/<name>/<out stem>.resume.pt``; ``--resume`` continues from it.
  ranks     under ``torchrun``, PyTorch DDP (``minispec.train.ddp``): every rank draws the same
            global batch and trains on its ``ddp.shard``; the losses take their means through
            ``ddp.share``, so DDP's average of the ranks' gradients is the single-process gradient.
            Rank 0 alone evaluates, logs and checkpoints.
  record    ``settings`` / ``command`` / ``training_record`` / ``stamp`` build the JSON record saved
            beside the weights; ``finish`` is the save tail.

Shapes: n training sequences, B sequences per step.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

import torch

from ..lab.benchinfo import device_info, versions
from ..config import cache_dir
from . import TARGET, ddp

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- data order and schedule

def batch_indices(step: int, n: int, batch_size: int, seed: int) -> list[int]:
    """The global batch of optimizer step ``step``: a fresh seeded permutation of ``range(n)`` per epoch.

    Returns:
        ``batch_size`` sequence indices (every sequence once per epoch of n // batch_size steps).
    """
    epoch, i = divmod(step, max(n // batch_size, 1))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))  # [n]
    return perm[i * batch_size:(i + 1) * batch_size].tolist()


def progress(step: int, steps: int, elapsed_s: float, minutes: float) -> float:
    """Fraction of the run done: of ``steps`` (0: no step bound) or of a ``minutes`` budget (0: none),
    whichever is further along; the run ends when it reaches 1."""
    return max(step / steps if steps else 0.0, elapsed_s / (60 * minutes) if minutes else 0.0)


def lr_at(step: int, progress: float, lr: float, warmup: int, min_ratio: float = 0.1) -> float:
    """Linear warm-up over the first ``warmup`` steps, then cosine decay from ``lr`` to ``min_ratio * lr``
    as ``progress`` (the fraction of the run done, ``progress()``) goes from 0 to 1."""
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


# --------------------------------------------------------------------------- what a trainer hands the loop

@dataclass
class Settings:
    """The loop's settings; ``from_args`` reads them from a trainer's flags of the same names."""

    name: str  # resume folder under cache_dir() and the progress bar's label
    out: Path  # the weights' path; its stem names the resume file
    steps: int  # at most this many optimizer steps (0: only the time budget ends the run)
    batch_size: int  # sequences per optimizer step (all ranks together)
    lr: float
    warmup: int
    eval_every: int
    ckpt_every: int
    minutes: float = 0.0  # wall-time budget (0: none)
    seed: int = 0
    resume: bool = False
    weight_decay: float = 0.0
    bf16: bool = False
    clip: float = 1.0
    device: str = "cpu"  # where the model and its batches live (the trainer moves them there)

    def __post_init__(self):
        if not self.steps and not self.minutes:
            raise ValueError("a run needs --steps or --minutes")

    @classmethod
    def from_args(cls, name: str, args, **override) -> "Settings":
        """Settings from the parsed flags ``args`` (those of the same names; the rest keep their
        defaults), with ``override`` on top."""
        names = {f.name for f in fields(cls)}
        return cls(name=name, **{**{k: v for k, v in vars(args).items() if k in names}, **override})


@dataclass
class Trainer:
    """A method's model and loss, as ``fit`` trains them.

    model: the module trained (frozen parameters stay as they are and are not checkpointed).
    lengths: tokens of each training sequence (n = len(lengths); for tokens/s).
    batch: sequence indices -> the batch of those sequences (built outside the autocast region).
    loss: (model, batch, generator, share) -> (loss, stats): every mean over token positions goes
        through ``share`` (``ddp.share`` / ``ddp.local``); stats: name -> float tensor (a scalar or
        a vector), reported as their global values.
    log: step numbers (global: "loss", "grad_norm" and the loss's stats as floats / lists) -> the
        history entry's fields; it runs the periodic held-out evaluation (rank 0 only).
    before: () -> held-out metrics before training (rank 0 only; not rerun on resume).
    """

    model: torch.nn.Module
    lengths: list[int]
    batch: Callable[[list[int]], Any]
    loss: Callable
    log: Callable[[dict], dict]
    before: Callable[[], dict]


@dataclass
class Run:
    """What ``fit`` did: optimizer steps, history entries, training seconds (resumed ones included),
    the held-out metrics before training, and the resume checkpoint's path."""

    steps: int
    history: list = field(default_factory=list)
    train_s: float = 0.0
    init_eval: dict = field(default_factory=dict)
    resume_path: Path | None = None


class Objective(torch.nn.Module):
    """A model and its loss as one module whose forward is the loss.

    DDP prepares its gradient all-reduce in the wrapped module's forward; the losses call the
    model's submodules (EAGLE-3's unrolled steps, Medusa's heads), not its forward, so DDP wraps
    this module instead of the model."""

    def __init__(self, model: torch.nn.Module, loss: Callable):
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, batch, generator: torch.Generator | None):
        return self.loss(self.model, batch, generator, ddp.share)


# --------------------------------------------------------------------------- one step, the loop

def train_step(objective: torch.nn.Module, opt: torch.optim.Optimizer, batch, generator: torch.Generator | None = None,
               clip: float = 1.0, bf16: bool = False, device: str = "cpu") -> dict[str, torch.Tensor]:
    """One optimizer step on this rank's ``batch``: loss (bf16 autocast if asked), backward (DDP
    averages the ranks' gradients), gradient clipping at ``clip``, the optimizer step.

    Args:
        objective: an ``Objective``, wrapped by ``ddp.wrap`` under torchrun.
        device: where the batch lives (the autocast region's device type).
    Returns:
        {"loss", each of the loss's stats, "grad_norm"}: tensors, global values (averaged over ranks).
    """
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
        loss, stats = objective(batch, generator)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], clip)
    opt.step()
    out = ddp.mean_over_ranks(dict(loss=loss.detach(), **{k: torch.as_tensor(v).detach() for k, v in stats.items()}))
    return {**out, "grad_norm": gnorm}


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` without its frozen parameters (shared with the target: never saved here)."""
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in model.state_dict().items() if k not in frozen}


def _start(s: Settings, t: Trainer, opt: torch.optim.Optimizer) -> Run:
    """The run so far: the resume checkpoint's when ``s.resume`` finds one, else a fresh one (with
    the held-out metrics before training, on rank 0)."""
    path = cache_dir() / s.name / (s.out.stem + ".resume.pt")
    if not (s.resume and path.exists()):
        return Run(0, [], 0.0, t.before() if ddp.is_main() else {}, path)
    ck = torch.load(path, weights_only=True, map_location=s.device)
    missing, unexpected = t.model.load_state_dict(ck["model"], strict=False)
    frozen = {n for n, p in t.model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    if unexpected or not set(missing) <= frozen:
        raise RuntimeError(f"{path} does not fit this model: missing {missing}, unexpected {unexpected}")
    opt.load_state_dict(ck["opt"])
    return Run(ck["step"], ck["history"], ck["train_s"], ck["init_eval"], path)


def _checkpoint(run: Run, t: Trainer, opt: torch.optim.Optimizer, train_s: float) -> None:
    run.resume_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = run.resume_path.with_suffix(".tmp")
    torch.save(dict(model=trainable_state(t.model), opt=opt.state_dict(), step=run.steps, history=run.history,
                    train_s=train_s, init_eval=run.init_eval), tmp)
    tmp.replace(run.resume_path)  # never a half-written checkpoint


def _numbers(stats: dict[str, torch.Tensor]) -> dict:
    return {k: v.item() if v.dim() == 0 else v.tolist() for k, v in stats.items()}


def fit(s: Settings, t: Trainer) -> Run:
    """Train ``t.model`` with ``t.loss`` until ``progress`` reaches 1 (see the module docstring).

    Under torchrun every rank calls it; rank 0's clock drives the schedule, rank 0 alone evaluates,
    logs and checkpoints, and the returned history is rank 0's (empty elsewhere).
    """
    from tqdm import tqdm

    opt = torch.optim.AdamW([p for p in t.model.parameters() if p.requires_grad], lr=s.lr, betas=(0.9, 0.95),
                            weight_decay=s.weight_decay)
    run = _start(s, t, opt)
    if BOUND_HEAP:
        bounded_heap()  # from the first step on; the features before it ran faster on glibc's own threshold
    objective = ddp.wrap(Objective(t.model, t.loss))  # DDP broadcasts rank 0's weights here
    rank, world = ddp.rank(), ddp.world_size()
    t0, t_here, seen = time.perf_counter() - run.train_s, time.perf_counter(), 0
    elapsed = lambda: ddp.from_main(time.perf_counter() - t0)  # noqa: E731  one clock for every rank
    gen = torch.Generator(device=s.device)
    bar = tqdm(total=s.steps or None, initial=run.steps, desc=s.name, disable=not ddp.is_main())
    done = progress(run.steps, s.steps, elapsed(), s.minutes)
    while done < 1:
        for g in opt.param_groups:
            g["lr"] = lr_at(run.steps, done, s.lr, s.warmup)
        idx = batch_indices(run.steps, len(t.lengths), s.batch_size, s.seed)  # the global batch
        gen.manual_seed(s.seed * 7919 + run.steps + 1_000_003 * rank)  # noise / subsampling: a function of the step
        stats = train_step(objective, opt, t.batch(ddp.shard(idx, rank, world)), gen, s.clip, s.bf16, s.device)
        run.steps, seen = run.steps + 1, seen + sum(t.lengths[i] for i in idx)
        done = progress(run.steps, s.steps, elapsed(), s.minutes)
        bar.update(1)
        bar.set_postfix({k: f"{v:.3f}" if v.dim() == 0 else ",".join(f"{x:.2f}" for x in v.tolist())
                         for k, v in stats.items()})
        if not ddp.is_main():
            continue
        if run.steps % s.eval_every == 0 or done >= 1:
            run.history.append(dict(step=run.steps, **t.log(_numbers(stats)),
                                    train_s=round(time.perf_counter() - t0, 1),
                                    train_tokens_per_s=round(seen / (time.perf_counter() - t_here), 1)))
            bar.write(f"step {run.steps}: {json.dumps(run.history[-1])}")
        if run.steps % s.ckpt_every == 0 and done < 1:
            _checkpoint(run, t, opt, time.perf_counter() - t0)
    bar.close()
    run.train_s = time.perf_counter() - t0
    return run


# --------------------------------------------------------------------------- the main tail

BOUND_HEAP = False  # ``python -m minispec train ...`` sets it: ``fit`` calls ``bounded_heap`` before its first step
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MMAP_THRESHOLD = 128 * 1024  # glibc's initial threshold, kept fixed


def bounded_heap() -> bool:
    """Keep glibc's mmap threshold fixed at 128 KiB, so that every large freed tensor goes back to the OS.

    glibc raises the threshold to the size of a freed mmapped block (up to 32 MiB), after which a training
    step's activations, whose shapes change with every batch's longest sequence, come from the heap and
    fragment it: a CPU run of ``train eagle`` on 6.3M tokens of features grew by ~35 MB a step and was
    killed out of memory at 24 GB after 449 steps; with the threshold fixed its memory stayed flat
    (docs/results.md, "A CPU run that ran out of memory"). ``python -m minispec train ...`` sets ``BOUND_HEAP``, so
    that ``fit`` calls it before the first step, not before the target's teacher-forced feature forwards: their
    big activations, each a fresh mmap that page-faults afresh under the fixed threshold, ran at 0.63x the speed
    (312 against 490 tokens/s). A setting of the whole process, so the trainers' ``main`` called in a process of
    one's own (a test) leave that process's heap as it is. Returns True where set (glibc), else False."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not sys.platform.startswith("linux") or name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False


def start(args):
    """A trainer's first steps: join the ranks torchrun describes (``ddp.setup``: gloo, one CPU
    process per rank), set the threads and the seed, load the frozen target on ``args.device``
    (default cpu). Returns (target, tok)."""
    from ..loading import load

    device = getattr(args, "device", "cpu")
    if device != "cpu" and int(os.environ.get("WORLD_SIZE", 1)) > 1:  # torchrun's ranks
        raise SystemExit("--device runs in one process; several ranks train on the CPU (gloo)")
    ddp.setup(use_cuda=False)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    target, tok = load(TARGET, device=device)
    target.requires_grad_(False)
    return target, tok


def main_first(build: Callable[[], Any]) -> Any:
    """``build()`` on rank 0 first (it generates and caches the data), then on the other ranks (they
    read the caches); one call in a single process."""
    if not ddp.is_main():
        ddp.barrier()
    out = build()
    if ddp.is_main():
        ddp.barrier()
    return out


def one_process(what: str) -> None:
    if ddp.world_size() > 1:
        raise SystemExit(f"{what} runs in one process (not under torchrun)")


def shown(path: Path) -> str:
    """A path as recorded in the JSON: relative to the repository when inside it (no home dirs)."""
    return str(path.resolve().relative_to(REPO)) if path.resolve().is_relative_to(REPO) else path.name


def command(prefix: str, argv) -> str:
    """The command that reran this training: ``prefix`` + the arguments given."""
    return prefix + " " + " ".join(argv if argv is not None else sys.argv[1:])


def settings(args) -> dict:
    """Every flag's value (paths as ``shown``), ``--resume`` left out."""
    return {k: (shown(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "resume"}


def training_record(run: Run, s: Settings, n_train: int, loss: str, **extra) -> dict:
    """The record's "training" entry: steps, epochs, optimizer, schedule, loss, ``extra``, time, history."""
    return dict(steps=run.steps, epochs=round(run.steps * s.batch_size / n_train, 2), optimizer="AdamW(0.9, 0.95)",
                schedule=f"linear warm-up {s.warmup}, cosine to 0.1*lr", loss=loss, **extra,
                processes=ddp.world_size(), train_s=round(run.train_s, 1), history=run.history)


def stamp() -> dict:
    """The record's date, device and versions."""
    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=device_info(), versions=versions())


def write_record(out: Path, record: dict) -> None:
    """The JSON record beside the weights at ``out``."""
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")


def read_record(out: Path) -> dict:
    return json.loads(out.with_suffix(".json").read_text())


def finish(out: Path, record: dict, save: Callable[[Path, dict], None], run: Run, t_start: float,
           heldout: Callable[[], dict] | None = None, measure: Callable[[dict], dict] | None = None) -> dict:
    """The save tail (rank 0): ``save(out, record)`` the weights and the record; ``heldout()`` (the held-out
    metrics of the checkpoint as saved) into record["eval"]["heldout"]; ``measure(record)``; the run's
    seconds; the record rewritten; the resume checkpoint deleted. Returns the record."""
    save(out, record)
    if heldout is not None:
        record["eval"]["heldout"] = heldout()
    if measure is not None:
        record = measure(record)
    record["run_s"] = round(time.perf_counter() - t_start, 1)
    write_record(out, record)
    run.resume_path.unlink(missing_ok=True)
    return record
