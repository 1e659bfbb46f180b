"""Train Medusa heads for SmolLM2-135M-Instruct (Medusa-1: frozen target, heads only).

Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads". Head i reads the target's last hidden state f_t (after its final norm) and, in
minispec's alignment (see ``minispec.drafters.medusa``), predicts x_{t+i+2}: the target's
distribution at position t+i+1 is its label. The loss is sum_i decay^i * CE(p~_{t+i+1}, q_i)
with p~ the target's top-k distribution renormalised (self-distillation, as Medusa-2's
recommended recipe for when the original training data is unknown). The LM head is the
target's, shared and frozen; each head's residual block starts at zero (the identity).

Data and features: ``minispec.train.data`` (the same cached target forward as EAGLE-3's; only
the last hidden state and the top-k are used). Held-out metric: teacher-forced top-1 accuracy
of each head against the target's argmax.

    python -m minispec train medusa --steps 300
    torchrun --nproc_per_node 2 -m minispec train medusa --steps 300     # DDP (minispec.train.loop)

Shapes: B batch, T tokens, K heads, N selected rows, V vocab, H hidden.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ..args import thread_count
from ..drafters.medusa import MedusaDrafter, MedusaHeads
from ..drafters.defaults import shipped_head
from . import TARGET, bf16_help, ddp, loop, native_bf16
from .data import FeatureData, feature_data
from .measure import record_measurement

FORMAT = "minispec-medusa-v1"
DEFAULT_OUT = Path(str(shipped_head("medusa")))  # minispec/checkpoints/smollm2-135m-medusa.safetensors


def medusa_loss(heads: MedusaHeads, lm_head: torch.Tensor, hidden, top_idx, top_logp, rows, decay: float = 0.8,
                max_rows: int = 0, generator=None, share=ddp.local):
    """Soft cross-entropy of every head against the target's distribution i+1 positions later.

    Args:
        heads: the Medusa heads.
        lm_head: [V, H] the target's LM head weight (frozen).
        hidden: [B, T, H] target last hidden states; top_idx / top_logp [B, T, K'] the target's top-k
            at every position (row r: distribution of token r+1); rows [B, T] bool: rows with a loss.
        decay: weight decay**i of head i.
        max_rows: subsample at most this many positions per head (0: all), to bound the [N, V] logits.
        share: ``ddp.share`` when the batch is this rank's share of a global one: each head's CE and
            accuracy are means over the rows of every rank (a head no rank has rows for is left out).
    Returns:
        (loss, [acc_i]): acc_i = P(head i's argmax == the target's argmax at t+i+1).
    """
    T = hidden.shape[1]
    total, weights, accs = 0.0, 0.0, []
    for i, head in enumerate(heads.heads):
        r = torch.arange(T) + i + 1  # [T] label rows of head i
        sel = rows[:, r.clamp(max=T - 1)] & (r < T)  # [B, T] positions t whose label row exists and counts
        t_idx = sel.nonzero()  # [N, 2] (b, t)
        if max_rows and len(t_idx) > max_rows:
            t_idx = t_idx[torch.randperm(len(t_idx), generator=generator)[:max_rows]]
        b, t = t_idx.unbind(1)
        x = head[0](hidden[b, t])  # [N, H]
        z = (head[1](x) if heads.own_lm_head else x @ lm_head.t()).float()  # [N, V]
        logq = torch.log_softmax(z, -1)
        p = torch.softmax(top_logp[b, t + i + 1].float(), -1)  # [N, K'] renormalised top-k
        ce, n = share(-(p * logq.gather(1, top_idx[b, t + i + 1])).sum(-1).mean(), len(t_idx))
        if n == 0:
            continue
        total, weights = total + decay ** i * ce, weights + decay ** i
        acc = (z.detach().argmax(-1) == top_idx[b, t + i + 1, 0]).float().mean()
        accs.append(share(acc, len(t_idx))[0].item())
    return total / max(weights, 1e-9), accs


def make_batch(seqs, feats, idx: list[int]):
    """Right-padded hidden [B, T, H], top_idx [B, T, K'], top_logp, rows [B, T] (response rows)."""
    T, H = max(len(seqs[i].tokens) for i in idx), feats[idx[0]]["hidden"].shape[1]
    K = feats[idx[0]]["top_idx"].shape[1]
    hidden, rows = torch.zeros(len(idx), T, H), torch.zeros(len(idx), T, dtype=torch.bool)
    top_idx, top_logp = torch.zeros(len(idx), T, K, dtype=torch.long), torch.zeros(len(idx), T, K)
    for b, i in enumerate(idx):
        n, f = len(seqs[i].tokens), feats[i]
        hidden[b, :n], top_idx[b, :n], top_logp[b, :n] = f["hidden"].float(), f["top_idx"].long(), f["top_logp"].float()
        rows[b, max(0, seqs[i].prompt_len - 1):n] = True
    return hidden, top_idx, top_logp, rows


@torch.no_grad()
def evaluate(heads, lm_head, seqs, feats, batch_size: int = 8) -> dict:
    """Held-out teacher-forced top-1 accuracy of each head (acc_i: head i vs the target's argmax)."""
    sums, n = [0.0] * heads.num_heads, 0
    for s in range(0, len(seqs), batch_size):
        idx = list(range(s, min(s + batch_size, len(seqs))))
        _, accs = medusa_loss(heads, lm_head, *make_batch(seqs, feats, idx))
        sums = [a + b * len(idx) for a, b in zip(sums, accs)]
        n += len(idx)
    return {"acc_by_head": [round(a / n, 4) for a in sums], "sequences": n}


def save_heads(heads: MedusaHeads, path: Path, record: dict) -> None:
    """fp16 safetensors with the official Medusa keys ({i}.0.linear.*) + the JSON record beside it."""
    from safetensors.torch import save_file

    sd = {k: v.detach().to(torch.float16).contiguous() for k, v in heads.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path), metadata={"format": FORMAT, "target": TARGET})
    loop.write_record(path, record)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m minispec train medusa", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--heads", type=int, default=4, help="number of Medusa heads (the 'medusa' tree needs 4)")
    ap.add_argument("--decay", type=float, default=0.8, help="loss weight of head i: decay**i")
    ap.add_argument("--extra-sharegpt", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=320)
    ap.add_argument("--distill-prompts", type=int, default=576, help="self-distilled training examples (target answers)")
    ap.add_argument("--heldout", type=int, default=32)
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps (at most)")
    ap.add_argument("--minutes", type=float, default=0, help="training time budget; the schedule follows it when it ends first")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    ap.add_argument("--max-rows", type=int, default=512, help="positions per head per step (bounds the [N, V] logits)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=native_bf16(), help=bf16_help())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=thread_count, default=1)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--measure", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--measure-only", action="store_true")
    ap.add_argument("--measure-tokens", type=int, default=128)
    return ap.parse_args(argv)


def run_measure(args, target, tok, held, record: dict) -> dict:
    from ..drafters.loader import load_drafter

    heads = load_drafter(args.out, target, verbose=False).heads
    trees = {"static:medusa": "medusa", "chain:4": "chain:4"}
    return record_measurement(args, target, tok, held, record, "medusa", DEFAULT_OUT,
                              {k: (lambda t=t: MedusaDrafter(target, heads, tree=t)) for k, t in trees.items()})


def loop_settings(args) -> loop.Settings:
    """The loop's settings: ``--steps`` and ``--minutes`` both bound the run (whichever ends first)."""
    return loop.Settings.from_args("medusa", args)


def trainer(args, target, heads: MedusaHeads, data: FeatureData) -> loop.Trainer:
    """``heads`` and ``medusa_loss`` on ``data`` for ``loop.fit``; the history keeps the step's loss, grad
    norm and accuracy by head, and the held-out accuracy on 16 sequences. Under torchrun each rank
    subsamples at most ceil(max_rows / world) rows per head of its share (its own draws)."""
    lm_head = target.lm_head.weight.detach()  # [V, H]
    max_rows = -(-args.max_rows // ddp.world_size())

    def loss(model, batch, generator, share):
        total, accs = medusa_loss(model, lm_head, *batch, decay=args.decay, max_rows=max_rows, generator=generator,
                                  share=share)
        return total, dict(acc=torch.tensor(accs))

    def log(n: dict) -> dict:
        return dict(train_loss=round(n["loss"], 4), grad_norm=round(n["grad_norm"], 3),
                    train_acc_by_head=[round(a, 3) for a in n["acc"]],
                    heldout16=evaluate(heads, lm_head, data.held[:16], data.fheld[:16]))

    return loop.Trainer(model=heads, lengths=[len(s.tokens) for s in data.train],
                        batch=lambda idx: make_batch(data.train, data.ftrain, idx), loss=loss, log=log,
                        before=lambda: evaluate(heads, lm_head, data.held, data.fheld))


def make_record(args, argv, heads: MedusaHeads, data: FeatureData, run: loop.Run, final: dict) -> dict:
    """The JSON record of a run (before the measurement)."""
    train, held = data.train, data.held
    return dict(
        format=FORMAT, target=TARGET, dtype="float16",
        config=dict(hidden_size=heads.hidden, medusa_num_heads=heads.num_heads, medusa_num_layers=1,
                    vocab_size=heads.vocab_size, own_lm_head=False,
                    alignment="head i reads f_t (the last observed feature) and predicts x_{t+i+2}"),
        command=loop.command("python -m minispec train medusa", argv), settings=loop.settings(args),
        data=dict(source="minispec.train.data.training_sequences (self-distilled ShareGPT cache + extra ShareGPT)",
                  train_sequences=len(train), heldout_sequences=len(held),
                  train_tokens=sum(len(s.tokens) for s in train), heldout_tokens=sum(len(s.tokens) for s in held)),
        training=loop.training_record(run, loop_settings(args), len(train),
                                      f"sum_i {args.decay}^i soft-CE(target top-{args.topk} at t+i+1, head i at t)",
                                      rows_per_head_per_step=args.max_rows),
        eval=dict(heldout_before_training=run.init_eval, heldout=final, note="teacher-forced top-1 accuracy per head"),
        **loop.stamp())


def main(argv=None) -> dict:
    """Train (resumably; under torchrun on every rank), save fp16 safetensors + JSON record, measure;
    returns the record (rank 0; {} elsewhere)."""
    args = parse_args(argv)
    t_start = time.perf_counter()
    target, tok = loop.start(args)
    if args.measure_only:
        loop.one_process("--measure-only")
        held = feature_data(args, target, tok, features=False).held
        return run_measure(args, target, tok, held, loop.read_record(args.out))
    data = loop.main_first(lambda: feature_data(args, target, tok))  # the EAGLE trainers' feature cache (one forward)
    heads = MedusaHeads(target.cfg.d_model, args.heads, target.cfg.vocab_size)
    run = loop.fit(loop_settings(args), trainer(args, target, heads, data))
    if not ddp.is_main():
        ddp.cleanup()
        return {}
    final = evaluate(heads, target.lm_head.weight.detach(), data.held, data.fheld)
    measure = (lambda rec: run_measure(args, target, tok, data.held, rec)) if args.measure else None
    record = loop.finish(args.out, make_record(args, argv, heads, data, run, final),
                         lambda out, rec: save_heads(heads, out, rec), run, t_start, measure=measure)
    print(json.dumps(dict(out=str(args.out), heldout=final, measured=record.get("measured", {}).get("results")), indent=2))
    ddp.cleanup()
    return record


if __name__ == "__main__":
    main()
