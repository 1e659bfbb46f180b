"""Train an EAGLE-3 head for SmolLM2-135M-Instruct with training-time test.

Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test". At inference the head drafts step after step on its OWN outputs; EAGLE-3
trains it the same way ("training-time test"): for every position t of a sequence

    step 0    input (x_{t+1}, fc(fused target features at t)), RoPE position t, predicts x_{t+2}
    step j    input (x_{t+1+j}, the head's own pre-norm output of step j-1 at t), position t+j,
              predicts x_{t+j+2}; it attends to the step-0 keys of positions <= t (the committed
              context) and to its own keys of steps 1..j at t (its tree ancestors and itself)

which is exactly what ``Eagle3Drafter`` computes for a chain along the true tokens. The loss is
sum_j decay^j * CE(p~_{t+j+1}, q_j): the target's distribution at position t+j+1 (its top-k,
restricted to the draft vocabulary and renormalised) against the head's draft-vocab softmax.
There is no feature-regression loss (EAGLE-1's); the head's hidden state is its own.

Data: ``minispec.train.data``: the self-distilled ShareGPT cache (SmolLM2's own greedy answers)
plus extra ShareGPT conversations; its first 32 examples are held out. The draft vocabulary is
the ``--draft-vocab`` most frequent tokens of the training sequences (``build_vocab_map``).

    python -m minispec train eagle3 --steps 600
    torchrun --nproc_per_node 2 -m minispec train eagle3 --steps 600     # DDP (minispec.train.loop)

Shapes: B batch, T tokens, Tp = T - 1 head positions, H hidden, Hq / Hkv heads, hd head dim,
K top-k, Vd draft vocab, N selected rows.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..args import thread_count
from ..drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head, build_vocab_map, eagle3_layers
from ..drafters.defaults import shipped_head
from . import TARGET, bf16_help, ddp, loop, native_bf16
from .data import FeatureData, add_selfdistill_args, feature_data, selfdistill_data
from .eagle import level_attention
from .measure import record_measurement

FORMAT = "minispec-eagle3-v1"
DEFAULT_OUT = Path(str(shipped_head("eagle3")))  # minispec/checkpoints/smollm2-135m-eagle3.safetensors


# --------------------------------------------------------------------------- the unrolled head

def unroll(head: Eagle3Head, embed, fused: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Training-time test: run the head ``steps`` times on its own outputs at every position.

    Args:
        head: the EAGLE-3 head.
        embed: the target's token embedding (an nn.Embedding, frozen).
        fused: [B, T, 3H] fused target features (position t: layers entering (2, L//2, L-3)).
        tokens: [B, T] token ids.
        steps: unroll length (1 = plain teacher forcing).
    Returns:
        ``steps`` tensors [B, Tp, H]: the pre-norm output of step j at head position t (it scores
        token x_{t+j+2}). Positions whose inputs run past the sequence see token 0 (mask their loss).
    """
    B, T, _ = fused.shape
    Tp = T - 1
    c = head.config
    rep, scale = c.num_attention_heads // c.num_key_value_heads, c.head_dim ** -0.5
    h = head.fc(fused[:, :Tp])  # [B, Tp, H]
    pos = torch.arange(Tp, device=fused.device)[None].expand(B, Tp)  # [B, Tp]
    causal = torch.ones(Tp, Tp, dtype=torch.bool, device=fused.device).tril()  # [Tp, Tp]
    outs, ks, vs = [], [], []  # the keys / values of steps 0, 1, .. [B, Hq, Tp, hd]: step 0's causal (the committed
    for j in range(steps):     # context), the later steps' only at the same position t
        tok = F.pad(tokens[:, 1 + j:], (0, max(0, 1 + j + Tp - T)))[:, :Tp]  # [B, Tp] x_{t+1+j}
        q, k, v = head.attn_input(embed(tok).to(h.dtype), h, pos + j)  # q [B, Hq, Tp, hd], k/v [B, Hkv, Tp, hd]
        ks.append(k.repeat_interleave(rep, 1)), vs.append(v.repeat_interleave(rep, 1))
        h = head.finish(h, level_attention(q, ks, vs, causal, scale))  # [B, Tp, H]: the next step's hidden input
        outs.append(h)
    return outs


def target_map(head: Eagle3Head) -> torch.Tensor:
    """[V] long: the draft id of each target id, -1 outside the draft vocabulary."""
    c = head.config
    m = torch.full((c.vocab_size,), -1, dtype=torch.long, device=head.d2t.device)
    m[torch.arange(c.draft_vocab_size, device=head.d2t.device) + head.d2t] = torch.arange(c.draft_vocab_size, device=m.device)
    return m


def ttt_loss(head, embed, batch: dict, steps: int, decay: float, tmap: torch.Tensor, share=ddp.local):
    """Weighted soft cross-entropy of the unrolled head against the target (draft vocab only).

    Args:
        batch: from ``make_batch``: fused [B, T, 3H], tokens [B, T], top_idx / top_logp [B, T, K]
            (row r: the target's distribution of token r+1), rows [B, T] bool (rows with a loss).
        steps, decay: unroll length and step weight decay^j.
        tmap: ``target_map(head)``.
        share: ``ddp.share`` when ``batch`` is this rank's share of a global batch: each step's CE
            and accuracy are means over the rows of every rank (a step no rank has rows for is left out).
    Returns:
        (loss, [acc_j]): acc_j = P(head argmax == target argmax) at step j over the selected rows.
    """
    outs = unroll(head, embed, batch["fused"], batch["tokens"], steps)
    Tp = batch["tokens"].shape[1] - 1
    total, weights, accs = 0.0, 0.0, []
    for j, out in enumerate(outs):
        r = torch.arange(Tp, device=out.device) + j + 1  # [Tp] target rows of step j
        ok = r < batch["tokens"].shape[1]
        sel = batch["rows"][:, r.clamp(max=Tp)] & ok  # [B, Tp]
        rows = r.clamp(max=Tp)
        idx = tmap[batch["top_idx"][:, rows][sel]]  # [N, K] draft ids (-1: not in the draft vocab)
        logp = batch["top_logp"][:, rows][sel].float().masked_fill(idx < 0, float("-inf"))  # [N, K]
        keep = torch.isfinite(logp).any(-1)  # rows with some target mass inside the draft vocab
        p = torch.softmax(logp[keep], -1)  # [N', K] renormalised
        logq = torch.log_softmax(head.draft_logits(out[sel][keep]).float(), -1)  # [N', Vd]
        ce, n = share(-(p * logq.gather(1, idx[keep].clamp(min=0))).sum(-1).mean(), int(keep.sum()))
        if n == 0:
            continue
        total, weights = total + decay ** j * ce, weights + decay ** j
        top = batch["top_idx"][:, rows][sel][:, 0]  # [N] the target's argmax (target ids)
        accs.append(share(_acc(head, out[sel], top), int(sel.sum()))[0].item())
    return total / max(weights, 1e-9), accs


def _acc(head, out: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """Fraction of rows where the head's argmax (mapped to a target id) is the target's argmax."""
    with torch.no_grad():
        d = head.draft_logits(out).argmax(-1)  # [N] draft ids
        return (d + head.d2t[d] == top).float().mean()


def make_batch(seqs, feats, idx: list[int], layers, device: str | torch.device = "cpu") -> dict:
    """Right-padded batch of sequences ``idx`` (see ``ttt_loss``), built on the CPU and moved to ``device``;
    rows = response predictions."""
    T = max(len(seqs[i].tokens) for i in idx)
    B, K = len(idx), feats[idx[0]]["top_idx"].shape[1]
    H = feats[idx[0]]["hidden"].shape[1]
    out = dict(fused=torch.zeros(B, T, 3 * H), tokens=torch.zeros(B, T, dtype=torch.long),
               top_idx=torch.zeros(B, T, K, dtype=torch.long), top_logp=torch.zeros(B, T, K),
               rows=torch.zeros(B, T, dtype=torch.bool))
    for b, i in enumerate(idx):
        s, f, n = seqs[i], feats[i], len(seqs[i].tokens)
        out["fused"][b, :n] = torch.cat([f["layers"][l] for l in layers], -1).float()
        out["tokens"][b, :n] = s.tokens
        out["top_idx"][b, :n], out["top_logp"][b, :n] = f["top_idx"].long(), f["top_logp"].float()
        out["rows"][b, max(0, s.prompt_len - 1):n] = True  # row r predicts token r+1 of the response
    return {k: v.to(device) for k, v in out.items()}


@torch.no_grad()
def evaluate(head, embed, seqs, feats, layers, steps: int, tmap, batch_size: int = 8) -> dict:
    """Held-out teacher-forced acceptance per unroll step (acc_j: the head's argmax at step j equals
    the target's argmax, after j correct drafts) and the soft CE averaged over the steps."""
    was = head.training
    head.eval()
    sums, n, ce = [0.0] * steps, 0, 0.0
    for s in range(0, len(seqs), batch_size):
        idx = list(range(s, min(s + batch_size, len(seqs))))
        loss, accs = ttt_loss(head, embed, make_batch(seqs, feats, idx, layers, embed.weight.device), steps, 1.0, tmap)
        w = len(idx)
        sums = [a + b * w for a, b in zip(sums, accs)]
        ce, n = ce + loss.item() * w, n + w
    head.train(was)
    return {"acc_by_step": [round(a / n, 4) for a in sums], "soft_ce_mean_over_steps": round(ce / n, 4), "sequences": n}


# --------------------------------------------------------------------------- init, save

def init_head(target, d2t: torch.Tensor, t2d: torch.Tensor, seed: int = 0) -> Eagle3Head:
    """A head warm-started from the target: lm_head = the target's rows of the draft vocabulary,
    norm = the target's final norm, the hidden half of q/k/v and the MLP copied from the target's
    last layer, fc = [0, 0, I] (the high layer's features passed through)."""
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(target, len(d2t))).to(target.device)
    last, H = target.blocks[-1], head.config.hidden_size
    with torch.no_grad():
        head.d2t.copy_(d2t), head.t2d.copy_(t2d)
        head.lm_head.weight.copy_(target.lm_head.weight[(torch.arange(len(d2t)) + d2t).to(target.device)])
        head.norm.weight.copy_(target.norm.weight)
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * H:] = torch.eye(H, device=head.fc.weight.device)
        m = head.midlayer
        m.self_attn.wqkv.weight[:, :H].mul_(0.1)  # q, k, v of the embedding half: small random
        m.self_attn.wqkv.weight[:, H:] = last.attn.wqkv.weight  # of the hidden half: the target's
        m.self_attn.wo.weight.copy_(last.attn.wo.weight)
        m.mlp.gate_up.weight.copy_(last.mlp.gate_up.weight), m.mlp.down.weight.copy_(last.mlp.down.weight)
        m.hidden_norm.weight.copy_(last.attn_norm.weight)
        m.post_attention_layernorm.weight.copy_(last.mlp_norm.weight)
    return head


def warm_start(path: Path, target) -> Eagle3Head:
    """A head to train from the EAGLE-3 checkpoint at ``path`` (fp32 here), its draft vocabulary (d2t) kept.
    ValueError when ``path`` holds another kind of head."""
    from ..drafters.loader import load_drafter

    drafter = load_drafter(path, target, verbose=False)
    if not isinstance(drafter, Eagle3Drafter):
        raise ValueError(f"{path} holds a {type(drafter).__name__}, not an EAGLE-3 head")
    head = Eagle3Head(drafter.head.config).to(target.device)
    head.load_state_dict({k: v.float() for k, v in drafter.head.state_dict().items()})
    return head


def load_data(args, target, tok) -> FeatureData:
    """The training data: ``feature_data``'s, with ``--selfdistill-parts`` appended to train."""
    data = feature_data(args, target, tok)
    if args.selfdistill_parts:
        sd, fsd = selfdistill_data(args.selfdistill_parts, args.max_len, target,
                                   layers=eagle3_layers(target.cfg.n_layer), topk=args.topk, folder=args.selfdistill_dir,
                                   first=args.selfdistill_first)
        data.train, data.ftrain = data.train + sd, data.ftrain + fsd
    return data


def save_head(head: Eagle3Head, path: Path, record: dict) -> None:
    """fp16 safetensors in the official key layout (d2t int64, t2d bool) + the JSON record beside it."""
    from safetensors.torch import save_file

    sd = {k: (v.to(torch.float16) if v.is_floating_point() else v).detach().cpu().contiguous()
          for k, v in head.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path), metadata={"format": FORMAT, "target": TARGET})
    loop.write_record(path, record)


# --------------------------------------------------------------------------- main

def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m minispec train eagle3", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=".safetensors path (the .json record goes beside it)")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary: the most frequent training tokens")
    ap.add_argument("--ttt-steps", type=int, default=5, help="training-time test unroll length")
    ap.add_argument("--decay", type=float, default=0.8, help="loss weight of unroll step j: decay**j")
    ap.add_argument("--extra-sharegpt", type=int, default=256, help="ShareGPT conversations added to the distill cache")
    ap.add_argument("--max-len", type=int, default=320, help="tokens per training sequence")
    ap.add_argument("--distill-prompts", type=int, default=576, help="self-distilled training examples (target answers)")
    ap.add_argument("--heldout", type=int, default=32)
    add_selfdistill_args(ap, "the three layers' features and top-k rebuilt from their token ids by one "
                             "teacher-forced forward, cached")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="start from this EAGLE-3 checkpoint (its weights and draft vocabulary) instead of the target")
    ap.add_argument("--topk", type=int, default=32, help="target log-probs kept per position (soft labels)")
    ap.add_argument("--steps", type=int, default=600, help="optimizer steps (at most)")
    ap.add_argument("--minutes", type=float, default=0, help="training time budget; the schedule follows it when it ends first")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=native_bf16(), help=bf16_help())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=thread_count, default=1)
    ap.add_argument("--device", default="cpu", help="where the target computes the features and the head trains "
                                                    "(cuda: a GPU; one process)")
    ap.add_argument("--tf32", action="store_true", help="on a GPU, matrix products in TF32 (as train eagle --tf32)")
    ap.add_argument("--resume", action="store_true", help="continue from the last resumable checkpoint of --out")
    ap.add_argument("--measure", action=argparse.BooleanOptionalAction, default=True,
                    help="after training, measure greedy tau with minispec.generate and store it in the record")
    ap.add_argument("--measure-only", action="store_true", help="only (re)measure the checkpoint at --out")
    ap.add_argument("--measure-tokens", type=int, default=128)
    return ap.parse_args(argv)


def run_measure(args, target, tok, held, record: dict) -> dict:
    from ..drafters.loader import load_drafter

    head = load_drafter(args.out, target, verbose=False).head
    trees = {"chain:5": "chain:5", "dynamic:5,8,32": "5,8,32"}
    return record_measurement(args, target, tok, held, record, "eagle3", DEFAULT_OUT,
                              {k: (lambda t=t: Eagle3Drafter(target, head, tree=t)) for k, t in trees.items()})


def loop_settings(args) -> loop.Settings:
    """The loop's settings: ``--steps`` and ``--minutes`` both bound the run (whichever ends first)."""
    return loop.Settings.from_args("eagle3", args)


def trainer(args, target, head: Eagle3Head, data: FeatureData) -> loop.Trainer:
    """``head`` and ``ttt_loss`` on ``data`` for ``loop.fit``; the history keeps the step's loss, grad
    norm and accuracy by unroll step, and the held-out accuracy on 16 sequences."""
    tmap, embed, layers = target_map(head), target.tok_emb, eagle3_layers(target.cfg.n_layer)

    def heldout(n_seqs: int | None = None) -> dict:
        return evaluate(head, embed, data.held[:n_seqs], data.fheld[:n_seqs], layers, args.ttt_steps, tmap)

    def loss(model, batch, generator, share):
        total, accs = ttt_loss(model, embed, batch, args.ttt_steps, args.decay, tmap, share)
        return total, dict(acc=torch.tensor(accs))

    def log(n: dict) -> dict:
        return dict(train_loss=round(n["loss"], 4), grad_norm=round(n["grad_norm"], 3),
                    train_acc_by_step=[round(a, 3) for a in n["acc"]], heldout16=heldout(16))

    return loop.Trainer(model=head, lengths=[len(s.tokens) for s in data.train],
                        batch=lambda idx: make_batch(data.train, data.ftrain, idx, layers, target.device),
                        loss=loss, log=log, before=heldout)


def make_record(args, argv, head: Eagle3Head, data: FeatureData, run: loop.Run, counts: torch.Tensor,
                layers, final: dict) -> dict:
    """The JSON record of a run (before the measurement); ``counts`` [V]: the training tokens' counts."""
    train, held = data.train, data.held
    return dict(
        format=FORMAT, target=TARGET, config=head.config.to_dict(), target_layers=list(layers), dtype="float16", command=loop.command("python -m minispec train eagle3", argv), settings=loop.settings(args),
        data=dict(source="minispec.train.data.training_sequences (self-distilled ShareGPT cache + extra ShareGPT)"
                         + (" + minispec.train.selfdistill parts" if args.selfdistill_parts else ""),
                  train_sequences=len(train), heldout_sequences=len(held),
                  train_selfdistill_sequences=sum(s.source == "selfdistill" for s in train),
                  train_tokens=sum(len(s.tokens) for s in train), heldout_tokens=sum(len(s.tokens) for s in held),
                  draft_vocab_coverage_of_train_tokens=round((counts[head.t2d.cpu()].sum() / counts.sum()).item(), 4)),
        training=loop.training_record(
            run, loop_settings(args), len(train),
            f"sum_j {args.decay}^j soft-CE(target top-{args.topk} in draft vocab, q_j), j < {args.ttt_steps}",
            init=(f"warm start from {args.init_from.name}" if args.init_from is not None
                  else "warm start from the target's last layer / norm / lm_head rows")),
        eval=dict(heldout_before_training=run.init_eval, heldout=final,
                  note="teacher-forced: acc_by_step[j] = P(argmax of unroll step j == target argmax)"),
        **loop.stamp())


def main(argv=None) -> dict:
    """Train (resumably; under torchrun on every rank), save fp16 safetensors + JSON record, measure;
    returns the record (rank 0; {} elsewhere)."""
    args = parse_args(argv)
    t_start = time.perf_counter()
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
    target, tok = loop.start(args)
    if args.measure_only:
        loop.one_process("--measure-only")
        held = feature_data(args, target, tok, features=False).held
        return run_measure(args, target, tok, held, loop.read_record(args.out))
    data = loop.main_first(lambda: load_data(args, target, tok))
    counts = torch.bincount(torch.cat([s.tokens for s in data.train]), minlength=target.cfg.vocab_size)  # [V]
    if args.init_from is not None:
        head = warm_start(args.init_from, target)
    else:
        head = init_head(target, *build_vocab_map(counts, args.draft_vocab), args.seed)
    run = loop.fit(loop_settings(args), trainer(args, target, head, data))
    if not ddp.is_main():
        ddp.cleanup()
        return {}
    layers = eagle3_layers(target.cfg.n_layer)
    final = evaluate(head, target.tok_emb, data.held, data.fheld, layers, args.ttt_steps, target_map(head))
    measure = (lambda rec: run_measure(args, target, tok, data.held, rec)) if args.measure else None
    record = loop.finish(args.out, make_record(args, argv, head, data, run, counts, layers, final),
                         lambda out, rec: save_head(head, out, rec), run, t_start, measure=measure)
    print(json.dumps(dict(out=str(args.out), heldout=final, measured=record.get("measured", {}).get("results")), indent=2))
    ddp.cleanup()
    return record


if __name__ == "__main__":
    main()
