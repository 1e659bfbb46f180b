"""The drafter contract shared by every chapter's drafters, and the features the target hands over.

The decode loop (``minispec.generate.Decoder``) talks to a drafter through four calls, always in
this order:

    check_target(target)                       once: raise ValueError if the drafter cannot serve it
    prefill(tokens, features)                  tokens = the prompt + the first new token (the root
                                               of the first tree); features = the target's at the
                                               positions of tokens[:-1]
    propose(params, budget, generator) -> Tree a draft tree after the committed tokens
    commit(tokens, features)                   after each verification: the tokens it committed (the
                                               accepted drafts, then the target's own token, which
                                               is the next root), and the target's features at the
                                               positions that produced them (the old root and the
                                               accepted nodes), one row per token

so a drafter always knows the committed context (``self.context``) and, when it reads features,
those of every committed token but the last: f_0..f_{n-2} for context x_0..x_{n-1}. EAGLE pairs
f_t with x_{t+1}; ``prefill`` and ``commit`` deliver exactly such pairs. The loop never guesses
what was accepted, and a drafter never rediscovers it by comparing token lists.

How the proposal is verified travels with it (``Tree.verify_mode``): drafts sampled from q carry
q (Leviathan/Chen for a chain, MSS for a tree); deterministic drafts carry none and are verified
as one-hot q. Both are lossless.

Vanilla decoding is a drafter too: ``Vanilla`` proposes the empty tree (only the root), so the
target scores one token per step and the loop has no special case for it.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from ..sampling import SamplingParams
from ..tree import Tree


@dataclass
class Features:
    """The target's features at n positions: ``hidden`` [n, D] (after the final norm) and the
    inputs of the layers a drafter asked for, ``layers`` {i: [n, D]}."""

    hidden: torch.Tensor
    layers: dict[int, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def rows(self, idx) -> "Features":
        """The features at rows ``idx`` (a slice, a list or a LongTensor)."""
        return Features(self.hidden[idx], {i: h[idx] for i, h in self.layers.items()})


class Drafter(ABC):
    """Proposes draft trees; the decode loop verifies them and says what it committed.

    Attributes:
        max_nodes: most nodes a proposal can have (sizes the target's KV cache).
        reads_features: True when ``prefill`` / ``commit`` need the target's features (EAGLE,
            Medusa); the loop then computes them, else it passes None.
        target_layers: indices of the target layers whose INPUT hidden states the drafter reads
            (EAGLE-3); empty for the last hidden state only.
        forwards: draft-model or head forwards since ``prefill``.
        context: the committed tokens (prompt included); its last is the next tree's root.
    """

    max_nodes: int = 0
    reads_features: bool = False
    target_layers: tuple[int, ...] = ()
    forwards: int = 0

    def check_target(self, target) -> None:
        """Raise ValueError naming both sizes when the drafter cannot serve ``target``."""

    def prefill(self, tokens: list[int], features: Features | None = None) -> None:
        """Start a generation: ``tokens`` = prompt + first new token; ``features`` at tokens[:-1]
        (handed to ``observe``). A drafter with state of its own resets it, then calls this."""
        self.context = list(tokens)
        self.forwards = 0
        if features is not None:
            self.observe(features)

    @abstractmethod
    def propose(self, params: SamplingParams, budget: int, generator: torch.Generator | None = None) -> Tree:
        """Draft a tree after ``self.context`` (its last token is the tree's root).

        Args:
            params: the sampling parameters (q is processed exactly like p).
            budget: draft at most this many tokens deep (0: return an empty tree).
            generator: source of randomness for sampled drafts.
        """

    def commit(self, tokens: list[int], features: Features | None = None) -> None:
        """The loop committed ``tokens`` (accepted drafts + the target's token); ``features`` holds
        the target's features at the positions that produced them, one row per token (handed to
        ``observe``)."""
        self.context += tokens
        if features is not None:
            self.observe(features.rows(slice(0, len(tokens))))

    def observe(self, features: Features) -> None:
        """The hand-off: the target's features of newly committed tokens, one row per token, from
        ``prefill`` and ``commit``. A drafter that ``reads_features`` keeps what it needs (EAGLE the
        last hidden states, EAGLE-3 the inputs of ``target_layers``, Medusa the last row); the base
        drafter keeps nothing."""

    def use_graphs(self, enabled: bool = True) -> bool:
        """Run the draft steps through CUDA graphs (chapter 8, ``minispec.cuda_graphs``) where this
        drafter can; returns whether it does. The base drafter drafts eagerly: False."""
        return False

    def fresh(self) -> "Drafter":
        """A new drafter of the same kind for another sequence (a batch, chapter 7): its own state
        (context, KV caches), the same weights (every ``nn.Module`` attribute is shared, not copied)."""
        shared = {id(v): v for v in vars(self).values() if isinstance(v, torch.nn.Module)}
        new = copy.deepcopy(self, shared)
        new.prefill([])
        return new


class Vanilla(Drafter):
    """No drafting: every proposal is the empty tree, so each step is one plain decoding step (the
    root alone: one token, tau = 1). ``generate(..., drafter=None)`` decodes with it."""

    def propose(self, params: SamplingParams, budget: int, generator: torch.Generator | None = None) -> Tree:
        return Tree([], [])
