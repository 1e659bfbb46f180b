"""Prompt lookup decoding: draft the tokens that followed the last n-gram earlier in the context.

No model and no training: when the answer repeats the prompt (summaries, code edits, RAG),
the continuation of an earlier match of the current suffix is a good guess. Drafts are
deterministic, so they are verified as one-hot q, which keeps sampling lossless.

Reference: Saxena, "Prompt Lookup Decoding" (2023); transformers' ``prompt_lookup_num_tokens``.
"""

from __future__ import annotations

import torch

from ..sampling import SamplingParams
from ..tree import Tree
from .base import Drafter


class PromptLookup(Drafter):
    """Args:
        k: most tokens drafted per step.
        max_ngram, min_ngram: try suffix n-grams from longest to shortest.
    """

    def __init__(self, k: int = 8, max_ngram: int = 3, min_ngram: int = 1):
        if k < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need k >= 1 and 1 <= min_ngram <= max_ngram, got k={k}, {min_ngram}..{max_ngram}")
        self.k, self.max_ngram, self.min_ngram = k, max_ngram, min_ngram
        self.max_nodes = k

    def __repr__(self):
        return f"PromptLookup(k={self.k}, ngram={self.min_ngram}..{self.max_ngram})"

    def propose(self, params: SamplingParams, budget: int, generator: torch.Generator | None = None) -> Tree:
        k = min(self.k, budget)
        if k <= 0:
            return Tree([], [])
        return Tree.chain(self.lookup(self.context, k))  # deterministic drafts: no q, verified as one-hot

    def lookup(self, context: list[int], k: int) -> list[int]:
        """The up to k tokens after the most recent earlier occurrence of the longest matching suffix n-gram."""
        L = len(context)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            suffix = context[L - n:]
            for start in range(L - n - 1, -1, -1):  # most recent match first, excluding the suffix itself
                if context[start:start + n] == suffix:
                    follow = context[start + n:start + n + k]
                    if follow:
                        return follow
        return []
