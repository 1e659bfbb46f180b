"""Vanilla speculative sampling's drafter: a small causal LM with the target's tokenizer.

Each step the draft model extends the context autoregressively by k tokens, each sampled
from q = probs(draft logits) processed exactly like p (greedy: the argmax). Its own KV cache
keeps the longest prefix it shares with the committed context, so rejected drafts are rolled
back and accepted ones are not recomputed.

References: Leviathan et al. (2023); Chen et al. (2023).
"""

from __future__ import annotations

import torch

from ..kv import KVCache
from ..sampling import SamplingParams, probs, sample
from ..tree import Tree


class DraftModel:
    """Args:
        model: a minispec Transformer sharing the target's vocabulary.
        k: draft length (gamma).
        capacity: the draft KV cache's size in tokens (grown on demand).
    """

    q_kind = "real"

    def __init__(self, model, k: int = 4, capacity: int = 1024):
        if k < 1:
            raise ValueError(f"draft length k must be >= 1, got {k}")
        self.model, self.k, self.max_nodes = model, k, k
        self.kv = KVCache.for_model(model, capacity)
        self.cached: list[int] = []  # tokens whose keys/values are committed in self.kv
        self.forwards = 0

    def __repr__(self):
        return f"DraftModel({self.model.cfg.name or self.model.cfg.arch}, {self.model.cfg.n_layer} layers, k={self.k})"

    def check_target(self, target) -> None:
        if self.model.cfg.vocab_size != target.cfg.vocab_size:
            raise ValueError(f"vocab mismatch: draft has {self.model.cfg.vocab_size} tokens, target "
                             f"{target.cfg.vocab_size}; a draft model must share the target's tokenizer")

    def prefill(self, prompt: list[int]) -> None:
        self.kv.reset()
        self.cached = []
        self.forwards = 0
        self.kv.reserve(len(prompt) + self.k + 1)

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        """Run the draft on tokens after its cache, commit them, return the last logits [V]."""
        self.kv.reserve(self.kv.length + len(tokens))
        out = self.model(torch.tensor([tokens], device=self.model.device), kv=self.kv, last_logits_only=True)
        self.kv.commit()
        self.cached += tokens
        self.forwards += 1
        return out.logits[0, -1]

    @torch.inference_mode()
    def propose(self, context: list[int], params: SamplingParams, budget: int,
                generator: torch.Generator | None = None) -> Tree:
        k = min(self.k, budget)
        if k <= 0:
            return Tree([], [])
        common = 0  # longest common prefix of the cache and the context, never the whole context
        limit = min(len(self.cached), len(context) - 1)
        while common < limit and self.cached[common] == context[common]:
            common += 1
        self.kv.rollback(len(self.cached) - common)
        del self.cached[common:]
        logits = self._feed(context[common:])
        drafts, qs = [], []
        for i in range(k):
            if params.greedy:
                x = int(logits.argmax())
            else:
                q = probs(logits, params)  # [V], processed like p
                x = int(sample(q, generator))
                qs.append(q)
            drafts.append(x)
            if i + 1 < k:
                logits = self._feed([x])
        return Tree.chain(drafts, torch.stack(qs) if qs else None)
