"""A drafter that copies when the context repeats itself, and asks a learned drafter otherwise.

Summaries, retrieval-augmented answers and code edits repeat long stretches of their input. When
the last ``min_ngram`` tokens occurred earlier in the context, the tokens that followed them there
are a draft that costs nothing to make and is often accepted whole (prompt lookup, Saxena 2023;
suffix matching, SuffixDecoding, Oliaro et al. 2024). Elsewhere the copy has nothing to offer and
the fallback drafter (an EAGLE head) drafts as usual. Each step proposes ONE tree, from one of
the two; both stay informed of every committed token (the ``Drafter`` contract), so the fallback's
state (its KV cache, the target features it reads) is current whenever it is asked.

Exactness needs nothing new: a copied chain is deterministic and carries no q (verified as one-hot
q), the fallback's tree carries its own q or none (``Tree.verify_mode``); both verifications are
lossless, so greedy output equals vanilla and sampled output has the target's law.
"""

from __future__ import annotations

import torch

from ..sampling import SamplingParams
from ..tree import Tree
from .base import Drafter, Features
from .prompt_lookup import PromptLookup


class CopyingDrafter(Drafter):
    """Args:
        fallback: the drafter asked when no copy is found (e.g. an ``EagleDrafter``).
        k: most tokens copied per step.
        min_ngram, max_ngram: the context's last n tokens, n from max_ngram down to min_ngram, must
            occur earlier for a copy (min_ngram 2: one repeated token is no evidence of a copied span).
    Attributes:
        copied, asked: steps drafted by copying / by the fallback since ``prefill``.
    """

    def __init__(self, fallback: Drafter, k: int = 8, min_ngram: int = 2, max_ngram: int = 4):
        self.fallback = fallback
        self.lookup = PromptLookup(k=k, max_ngram=max_ngram, min_ngram=min_ngram)
        self.max_nodes = max(fallback.max_nodes, self.lookup.max_nodes)
        self.reads_features = fallback.reads_features
        self.target_layers = fallback.target_layers
        self.copied = self.asked = 0

    def __repr__(self):
        return f"CopyingDrafter({self.lookup!r}, else {self.fallback!r})"

    def check_target(self, target) -> None:
        self.fallback.check_target(target)

    @property
    def forwards(self) -> int:  # the fallback's draft forwards (copying runs none)
        return self.fallback.forwards

    @forwards.setter
    def forwards(self, n: int) -> None:  # Drafter.prefill resets it
        pass

    def prefill(self, tokens: list[int], features: Features | None = None) -> None:
        super().prefill(tokens)
        self.fallback.prefill(tokens, features)
        self.lookup.prefill(tokens)
        self.copied = self.asked = 0

    def propose(self, params: SamplingParams, budget: int, generator: torch.Generator | None = None) -> Tree:
        tree = self.lookup.propose(params, budget, generator)
        if len(tree):
            self.copied += 1
            return tree
        self.asked += 1
        return self.fallback.propose(params, budget, generator)

    def commit(self, tokens: list[int], features: Features | None = None) -> None:
        super().commit(tokens)
        self.fallback.commit(tokens, features)
        self.lookup.commit(tokens)

    def use_graphs(self, enabled: bool = True) -> bool:
        return self.fallback.use_graphs(enabled)
