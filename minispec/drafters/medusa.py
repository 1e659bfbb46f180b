"""Medusa heads: K extra decoding heads on the target's last hidden state.

Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads". Head i is one residual block ``x + SiLU(W_i x + b_i)`` on the target's last hidden state
(after its final norm) followed by an LM head. Medusa-1 gives each head its own LM head (a copy
of the target's, trained); minispec shares the TARGET's LM head, frozen, which keeps the shipped
file to K * (H^2 + H) numbers. A checkpoint with per-head LM heads (official keys
``{i}.1.weight``) is read too (``own_lm_head=True``).

Alignment in minispec. The decode loop hands the drafter the target features of every
committed token but the last (the root x_{n-1}, whose features the target has not computed
yet). So the heads read f_{n-2}, the last observed feature (the one that predicted the root),
and head i predicts x_{n+i}, i = 0..K-1: the token i+1 positions after the root, i.e. head i at
position t predicts x_{t+i+2}. Training (``minispec.train.medusa``) fits exactly that: head i at
t against the target's distribution at position t+i+1.

Drafting: Medusa heads never see the drafted tokens, so every child of a node at depth d takes
the logits of head d, computed once per step from f_{n-2}: the K residual blocks, then ONE product
of their K outputs with the LM head they share. The ``medusa`` method (``defaults.TABLE``) drafts
over the 8,192 most frequent tokens (FR-Spec, ``minispec.drafters.vocab``, as the EAGLE-1/2 head
does): that LM head is the target's rows of those tokens (``ReducedLMHead``), so a step reads about
a sixth of SmolLM2's 49,152-row LM head once, where one product per head would read all of it K
times. A token outside the draft vocabulary is never drafted; verification runs over the full
vocabulary, so only acceptance can change. Any ``TreeSpec`` works (the static 'medusa' tree
``mc_sim_7b_63`` is Medusa's own); the trees are verified losslessly by minispec's verifiers
(greedy / one-hot q / Leviathan-Chen for sampled chains), NOT by Medusa's typical acceptance,
which changes the output distribution.

Shapes: K heads, H hidden, V vocab, Vd draft vocab, n nodes.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import exact
from .base import Features
from .tree_drafter import TreeDrafter, TreeSpec
from .defaults import default_tree
from .vocab import ReducedLMHead, draft_ids


class ResBlock(nn.Module):
    """x + SiLU(W x + b); W starts at zero, so an untrained head is the identity (official init)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x):
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K Medusa heads. Keys ``{i}.0.linear.{weight,bias}`` (and ``{i}.1.weight`` with own LM heads),
    as in the official ``medusa_lm_head`` checkpoints (one residual layer per head)."""

    def __init__(self, hidden: int, num_heads: int, vocab_size: int, own_lm_head: bool = False):
        super().__init__()
        self.hidden, self.num_heads, self.vocab_size, self.own_lm_head = hidden, num_heads, vocab_size, own_lm_head
        self.heads = nn.ModuleList(
            nn.Sequential(ResBlock(hidden), *([nn.Linear(hidden, vocab_size, bias=False)] if own_lm_head else []))
            for _ in range(num_heads))

    # the official files store the ModuleList's items at the top level: "0.0.linear.weight"
    def state_dict(self, *args, **kwargs):
        return {k.removeprefix("heads."): v for k, v in self.heads.state_dict(*args, **kwargs).items()}

    def load_state_dict(self, state, strict: bool = True, assign: bool = False):
        return self.heads.load_state_dict(state, strict=strict, assign=assign)

    def forward(self, f: torch.Tensor, lm_head=None) -> torch.Tensor:
        """Logits of every head.

        Args:
            f: [..., H] target last hidden states (after its final norm).
            lm_head: the LM head the heads share, a module [..., H] -> [..., V] (the target's ``lm_head``,
                or its rows of a draft vocabulary, ``ReducedLMHead``), applied to the K heads' outputs in
                one product; or a list of K such modules, one per head; None: each head's own LM head
                (``own_lm_head``).
        Returns:
            [K, ..., V] logits; head i's are row i.
        """
        x = torch.stack([head[0](f) for head in self.heads])  # [K, ..., H] every head's residual block
        if isinstance(lm_head, nn.Module):
            return lm_head(x)  # [K, ..., V]: one product for all heads
        if lm_head is None:
            if not self.own_lm_head:
                raise ValueError("these Medusa heads share the target's LM head: pass it (heads(f, target.lm_head))")
            lm_head = [head[1] for head in self.heads]
        return torch.stack([lm(x[i]) for i, lm in enumerate(lm_head)])  # [K, ..., V]


class MedusaDrafter(TreeDrafter):
    """Medusa heads as a ``TreeDrafter``; the tree's depth is at most K.

    Args:
        target: the target Transformer (its LM head is shared; features arrive through ``prefill``
            and ``commit``).
        heads: ``MedusaHeads``.
        tree: a ``TreeSpec`` or its string form; default Medusa's static tree.
        draft_vocab: draft over the K most frequent tokens only (FR-Spec, ``minispec.drafters.vocab``): the
            heads' LM head (the target's, or each head's own) restricted to those rows; None: the full
            vocabulary. Verification stays over the full vocabulary (lossless).
        token_counts: [V] counts that rank the tokens (default: the ones shipped for SmolLM2).
    """

    reads_features = True

    def __init__(self, target, heads: MedusaHeads, tree: "TreeSpec | str | int | None" = None,
                 draft_vocab: int | None = None, token_counts: torch.Tensor | None = None):
        super().__init__(tree if tree is not None else default_tree("medusa"))
        if self.spec.depth > heads.num_heads:
            raise ValueError(f"a tree of depth {self.spec.depth} needs {self.spec.depth} Medusa heads, "
                             f"these have {heads.num_heads}")
        self.heads, self.dtype, self.draft_vocab = heads, target.dtype, draft_vocab
        self.check_target(target)
        ids = None if draft_vocab is None else draft_ids(target.cfg.vocab_size, draft_vocab, token_counts)  # [Vd]
        if heads.own_lm_head:  # Medusa-1: one LM head per head, each restricted to the draft vocabulary
            self.lm_head = [h[1] if ids is None else ReducedLMHead(h[1], ids) for h in heads.heads]
        else:  # the target's, or its rows of the draft vocabulary: one product for all heads
            self.lm_head = target.lm_head if ids is None else ReducedLMHead(target.lm_head, ids)
        exact.follow(target, heads, *(self.lm_head if heads.own_lm_head else [self.lm_head]))  # as the target does
        self.prefill([])

    def __repr__(self):
        vocab = f", draft vocab {self.draft_vocab}" if self.draft_vocab else ""
        return f"MedusaDrafter({self.heads.num_heads} heads, {self.spec.name}{vocab})"

    def check_target(self, target) -> None:
        h, t = self.heads, target.cfg
        if (h.hidden, h.vocab_size) != (t.d_model, t.vocab_size):
            raise ValueError(f"Medusa heads (hidden {h.hidden}, vocab {h.vocab_size}) do not fit the target "
                             f"(hidden {t.d_model}, vocab {t.vocab_size})")

    def prefill(self, tokens: list[int], features: Features | None = None) -> None:
        self.observed, self.last = 0, None
        super().prefill(tokens, features)  # hands the features to observe

    def observe(self, features: Features) -> None:
        """Keep the last committed token's hidden state [H] (the heads read nothing else)."""
        self.last = features.hidden[-1]
        self.observed += len(features)

    @torch.inference_mode()
    def _start(self) -> torch.Tensor:
        n = len(self.context)
        if self.last is None or self.observed != n - 1:
            raise RuntimeError(f"Medusa drafter has features of {self.observed} tokens; a context of {n} "
                               f"needs {n - 1} (hand them over with prefill and commit)")
        # [K, V]: head i drafts depth i + 1 (-inf outside a draft vocabulary)
        self._logits = self.heads(self.last.to(self.dtype), self.lm_head)
        self._depths = []
        self.forwards += 1
        return self._logits[0]

    def _extend(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        for p in parents:
            self._depths.append(1 if p < 0 else self._depths[p] + 1)
        d = self._depths[-len(tokens):]  # children of a depth-d node come from head d
        return self._logits[torch.tensor(d)]  # [n, V]

    def _end(self) -> None:
        self._depths = []
