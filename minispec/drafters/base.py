"""The drafter interface shared by every chapter's drafters."""

from __future__ import annotations

from typing import Protocol

import torch

from ..sampling import SamplingParams
from ..tree import Tree


class Drafter(Protocol):
    """Proposes draft trees; the decode loop verifies them.

    Attributes:
        q_kind: "real" when the drafts are sampled from q and ``Tree.q`` holds it (verified with
            Leviathan/Chen or MSS, lossless for any q), "onehot" when drafts are chosen
            deterministically from the context (verified as one-hot q, also lossless).
        max_nodes: most nodes a proposal can have (sizes the KV cache).
    """

    q_kind: str
    max_nodes: int

    def prefill(self, prompt: list[int]) -> None:
        """Called once with the prompt ids before decoding."""

    def propose(self, context: list[int], params: SamplingParams, budget: int,
                generator: torch.Generator | None = None) -> Tree:
        """Draft a tree after ``context`` (all committed tokens; its last is the tree's root).

        Args:
            context: committed token ids, prompt included.
            params: the sampling parameters (q is processed exactly like p).
            budget: draft at most this many tokens deep (0: return an empty tree).
            generator: source of randomness for sampled drafts.
        """

    # Optional, for drafters that read the target's features (EAGLE, Medusa):
    #   target_layers: tuple[int, ...]  layer indices whose input hidden states the drafter needs
    #   observe(hidden [n, D], layer_inputs {i: [n, D]}): called after the prefill with the prompt's
    #       features and after each verification with those of the committed rows (the root and
    #       the accepted path), so the drafter holds the features of every committed token but
    #       the last (the next tree's root).
