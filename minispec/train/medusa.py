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

Shapes: B batch, T tokens, K heads, N selected rows, V vocab, H hidden.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

from ..benchinfo import device_info, versions
from . import bf16_help, native_bf16
from .distill_draft import _shown
from ..drafters.medusa import MedusaDrafter, MedusaHeads
from .eagle3 import batch_indices, fit, load_data, record_measurement

TARGET = "smollm2-135m"
FORMAT = "minispec-medusa-v1"
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "checkpoints" / "smollm2-135m-medusa.safetensors"


def medusa_loss(heads: MedusaHeads, lm_head: torch.Tensor, hidden, top_idx, top_logp, rows, decay: float = 0.8,
                max_rows: int = 0, generator=None):
    """Soft cross-entropy of every head against the target's distribution i+1 positions later.

    Args:
        heads: the Medusa heads.
        lm_head: [V, H] the target's LM head weight (frozen).
        hidden: [B, T, H] target last hidden states; top_idx / top_logp [B, T, K'] the target's top-k
            at every position (row r: distribution of token r+1); rows [B, T] bool: rows with a loss.
        decay: weight decay**i of head i.
        max_rows: subsample at most this many positions per head (0: all), to bound the [N, V] logits.
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
        if not len(t_idx):
            continue
        b, t = t_idx.unbind(1)
        x = head[0](hidden[b, t])  # [N, H]
        z = (head[1](x) if heads.own_lm_head else x @ lm_head.t()).float()  # [N, V]
        logq = torch.log_softmax(z, -1)
        p = torch.softmax(top_logp[b, t + i + 1].float(), -1)  # [N, K'] renormalised top-k
        ce = -(p * logq.gather(1, top_idx[b, t + i + 1])).sum(-1).mean()
        total, weights = total + decay ** i * ce, weights + decay ** i
        accs.append((z.argmax(-1) == top_idx[b, t + i + 1, 0]).float().mean().item())
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
    path.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m minispec train medusa", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--heads", type=int, default=4, help="number of Medusa heads (the 'medusa' tree needs 4)")
    ap.add_argument("--decay", type=float, default=0.8, help="loss weight of head i: decay**i")
    ap.add_argument("--extra-sharegpt", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=320)
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
    ap.add_argument("--threads", type=int, default=1)
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


def main(argv=None) -> dict:
    from ..models import load

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()
    target, tok = load(TARGET)
    target.requires_grad_(False)
    train, held, ftrain, fheld, _ = load_data(args, target, tok)  # the EAGLE-3 feature cache (one forward)
    if args.measure_only:
        return run_measure(args, target, tok, held, json.loads(args.out.with_suffix(".json").read_text()))
    heads = MedusaHeads(target.cfg.d_model, args.heads, target.cfg.vocab_size)
    lm_head = target.lm_head.weight.detach()
    gen = torch.Generator()

    def batch_at(step):
        gen.manual_seed(args.seed * 7919 + step)  # row subsample: a function of the step (resumable)
        return make_batch(train, ftrain, batch_indices(step, len(train), args.batch_size, args.seed))

    def loss_of(batch):
        return medusa_loss(heads, lm_head, *batch, decay=args.decay, max_rows=args.max_rows, generator=gen)

    def log(step, loss, gnorm, accs):
        return dict(step=step, train_loss=round(loss, 4), grad_norm=round(gnorm, 3),
                    train_acc_by_head=[round(a, 3) for a in accs], heldout16=evaluate(heads, lm_head, held[:16], fheld[:16]))

    step, history, train_s, init_eval, resume_path = fit(
        "medusa", args, heads, batch_at, loss_of, log, lambda: evaluate(heads, lm_head, held, fheld))
    final = evaluate(heads, lm_head, held, fheld)
    record = dict(
        format=FORMAT, target=TARGET, dtype="float16",
        config=dict(hidden_size=heads.hidden, medusa_num_heads=heads.num_heads, medusa_num_layers=1,
                    vocab_size=heads.vocab_size, own_lm_head=False,
                    alignment="head i reads f_t (the last observed feature) and predicts x_{t+i+2}"),
        command="python -m minispec train medusa " + " ".join(argv if argv is not None else sys.argv[1:]),
        settings={k: (_shown(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "resume"},
        data=dict(source="minispec.train.data.training_sequences (self-distilled ShareGPT cache + extra ShareGPT)",
                  train_sequences=len(train), heldout_sequences=len(held),
                  train_tokens=sum(len(s.tokens) for s in train), heldout_tokens=sum(len(s.tokens) for s in held)),
        training=dict(steps=step, epochs=round(step * args.batch_size / len(train), 2),
                      optimizer="AdamW(0.9, 0.95)", schedule=f"linear warm-up {args.warmup}, cosine to 0.1*lr",
                      loss=f"sum_i {args.decay}^i soft-CE(target top-{args.topk} at t+i+1, head i at t)",
                      rows_per_head_per_step=args.max_rows, train_s=round(train_s, 1), history=history),
        eval=dict(heldout_before_training=init_eval, heldout=final, note="teacher-forced top-1 accuracy per head"),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=device_info(), versions=versions(),
    )
    save_heads(heads, args.out, record)
    resume_path.unlink(missing_ok=True)
    if args.measure:
        record = run_measure(args, target, tok, held, record)
    record["run_s"] = round(time.perf_counter() - t_start, 1)
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(dict(out=str(args.out), heldout=final, measured=record.get("measured", {}).get("results")), indent=2))
    return record


if __name__ == "__main__":
    main()
