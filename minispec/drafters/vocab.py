"""Frequency-ranked draft vocabulary: draft over the K most frequent tokens only (FR-Spec).

Zhao et al., "FR-Spec: Accelerating Large-Vocabulary Language Models via Frequency-Ranked
Speculative Sampling" (2025). A feature-level head (EAGLE-1/2, Medusa) drafts through the target's
LM head, a [V, H] matrix: for SmolLM2-135M, 49,152 x 576 = 21% of the target's weights, read once
per drafted level (EAGLE) or per step (Medusa's heads, in one product). Most of those rows are tokens a draft almost never proposes, so the head
drafts over the K most frequent tokens only:

    logits_draft = W[ids] @ g            # [K] instead of [V]; ids = the K most frequent tokens
    q            = softmax over ids, 0 elsewhere

No retraining is needed, and verification still runs the target over the full vocabulary, so
decoding stays lossless: with a real q that is 0 outside ``ids``, Leviathan/Chen's residual
max(0, p - q) puts the target's mass back on every other token; deterministic (greedy / tree)
drafts are verified as one-hot q. Only acceptance can drop, when the target's choice lies
outside ``ids``.

Token counts come from text the target's heads are trained on (ShareGPT V3 assistant replies,
never benchmark prompts), tokenised with the target's tokenizer (``count_tokens``) by the training
tool ``python -m minispec.train.token_counts --out minispec/checkpoints/smollm2-135m-token-counts.safetensors``
(the runtime imports nothing from ``minispec.train``).

Shapes: H hidden, V target vocab, K draft vocab.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch

from .defaults import shipped

DEFAULT_COUNTS = "smollm2-135m-token-counts"


def load_counts(path: str | Path | None = None) -> torch.Tensor:
    """Token counts [V] (int64) from a ``.safetensors`` file; default: the ones shipped for SmolLM2."""
    from safetensors.torch import load_file

    if path is None:
        with resources.as_file(shipped(DEFAULT_COUNTS)) as p:
            return load_file(str(p))["counts"].long()
    return load_file(str(path))["counts"].long()


def top_tokens(counts: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` most frequent token ids (ties to the lower id), in increasing id order: [k] long."""
    V = counts.numel()
    if not isinstance(k, int) or not 0 < k <= V:
        raise ValueError(f"draft vocabulary size must be an integer in 1..{V}, got {k!r}")
    order = torch.sort(counts.long(), descending=True, stable=True).indices  # [V], most frequent first
    return order[:k].sort().values


def draft_ids(vocab_size: int, k: int, token_counts: torch.Tensor | None = None) -> torch.Tensor:
    """The draft vocabulary of a target with ``vocab_size`` tokens: its ``k`` most frequent tokens by
    ``token_counts`` [vocab_size] (default: the counts shipped for SmolLM2), [k] long in increasing id order.

    Raises:
        ValueError: the counts cover another vocabulary, or ``k`` is not in 1..vocab_size.
    """
    counts = load_counts() if token_counts is None else torch.as_tensor(token_counts)
    if counts.numel() != vocab_size:
        raise ValueError(f"token counts cover {counts.numel()} tokens but the target's vocabulary has {vocab_size}: "
                         "count tokens with the target's tokenizer (python -m minispec.train.token_counts)")
    return top_tokens(counts, k)


class ReducedLMHead(torch.nn.Module):
    """The target's LM head restricted to the rows ``ids``; returns full-vocabulary logits with
    -inf outside ``ids``, so sampling, top-k and verification code see the usual [.., V] shape.

    Args:
        lm_head: the target's LM head (a Linear with weight [V, H]); its rows are copied once.
        ids: [K] token ids to keep.
    """

    def __init__(self, lm_head: torch.nn.Linear, ids: torch.Tensor):
        super().__init__()
        V, H = lm_head.weight.shape
        ids = torch.as_tensor(ids, dtype=torch.long, device=lm_head.weight.device)
        if ids.dim() != 1 or not len(ids) or int(ids.min()) < 0 or int(ids.max()) >= V:
            raise ValueError(f"draft vocabulary ids must be a non-empty 1-D list of ids in [0, {V})")
        self.vocab_size = V
        self.register_buffer("ids", ids, persistent=False)  # [K]
        self.head = torch.nn.Linear(H, len(ids), bias=False).to(lm_head.weight.device, lm_head.weight.dtype)
        with torch.no_grad():
            self.head.weight.copy_(lm_head.weight[ids])  # [K, H]
        self.head.requires_grad_(False)

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        small = self.head(g)  # [.., K]
        full = small.new_full((*small.shape[:-1], self.vocab_size), float("-inf"))  # [.., V]
        return full.index_copy_(-1, self.ids, small)


def count_tokens(tok, texts, vocab_size: int) -> torch.Tensor:
    """Occurrences of each token id in ``texts`` (no special tokens): [vocab_size] int64."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    batch = 256
    for i in range(0, len(texts), batch):
        for ids in tok(texts[i:i + batch], add_special_tokens=False)["input_ids"]:
            counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size)
    return counts
