"""Vanilla speculative sampling's drafter: a small causal LM with the target's tokenizer.

As a chain (Leviathan et al. 2023; Chen et al. 2023) the draft model extends the context
autoregressively by k tokens, each sampled from q = probs(draft logits) processed exactly like
p (greedy: the argmax). As a tree (static choices or EAGLE-2 dynamic, see ``tree_drafter``) it
drafts level by level: one forward per level over all of that level's nodes, each attending to
the context and its own ancestors through a tree mask, as the target does when it verifies.

Its own KV cache holds the committed context; a chain's drafts stay in it until ``commit`` says
how many were accepted (the committed tokens but the last), so rejected drafts are rolled back
and accepted ones are not recomputed.
"""

from __future__ import annotations

import torch

from ..cuda_graphs import GraphedForward, static_prefill, token_buckets
from ..kv import KVCache, StaticKVCache
from .tree_drafter import GrowingTree, TreeDrafter, TreeSpec


class DraftModel(TreeDrafter):
    """Args:
        model: a minispec Transformer sharing the target's vocabulary.
        k: draft length (gamma) of a chain; ignored when ``tree`` is given.
        tree: a ``TreeSpec`` or its string form ('chain:4', 'eagle', '6,8,48', ...).
        capacity: the draft KV cache's size in tokens (grown on demand).
    """

    def __init__(self, model, k: int = 4, tree: "TreeSpec | str | None" = None, capacity: int = 1024):
        if tree is None and (not isinstance(k, int) or k < 1):
            raise ValueError(f"draft length k must be >= 1, got {k}")
        super().__init__(tree if tree is not None else k)
        self.model = model
        self.kv = KVCache.for_model(model, capacity)
        self.runner = None  # chapter 8: draft steps through CUDA graphs (``use_graphs``)
        self.cached: list[int] = []  # tokens whose keys/values are in self.kv: context, then fed drafts
        self._tree = GrowingTree()  # the nodes added since _start
        self._tokens: list[int] = []  # their tokens

    @property
    def k(self) -> int:
        return self.spec.depth

    def __repr__(self):
        return f"DraftModel({self.model.cfg.name or self.model.cfg.arch}, {self.model.cfg.n_layer} layers, {self.spec.name})"

    def check_target(self, target) -> None:
        if self.model.cfg.vocab_size != target.cfg.vocab_size:
            raise ValueError(f"vocab mismatch: draft has {self.model.cfg.vocab_size} tokens, target "
                             f"{target.cfg.vocab_size}; a draft model must share the target's tokenizer")

    def use_graphs(self, enabled: bool = True) -> bool:
        """Draft steps (the new committed tokens, then one forward per chain token or tree level)
        through ``GraphedForward`` over a static cache, one graph per token bucket; a context longer
        than every bucket (the prompt) runs as one eager forward. Returns ``enabled``."""
        enabled = bool(enabled)
        if enabled == (self.runner is not None):  # already so
            return enabled
        if enabled:
            self.kv = StaticKVCache.for_model(self.model, self.kv.capacity)
            self.runner = GraphedForward(self.model, self.kv, batch_buckets=(1,), pad=True, slot_masks=True,
                                         token_buckets=token_buckets(self.max_nodes + 1))
        else:
            self.kv, self.runner = KVCache.for_model(self.model, self.kv.capacity), None
        return enabled

    def _forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, last: bool = False):
        """The draft model over x [1, n] at ``positions`` [n] after what the cache holds; ``mask`` [n, S]
        over the cached tokens and the new ones (None: causal). Eager, or through the graph runner."""
        if self.runner is None:
            return self.model(x, positions=positions, mask=mask, kv=self.kv, last_logits_only=last)
        n, L = x.shape[1], self.kv.length
        if n > max(self.runner.token_buckets):  # longer than any bucket (a prompt): one eager forward
            return static_prefill(self.model, self.kv, x, last_logits_only=last)
        if mask is None:
            mask = torch.ones(n, L + n, dtype=torch.bool, device=x.device).tril(L)  # [n, S] causal after the cache
        slots = torch.zeros(1, n, self.kv.capacity, dtype=torch.bool, device=x.device)  # [1, n, C]
        slots[0, :, :mask.shape[1]] = mask
        return self.runner(x, positions[None], slot_mask=slots)

    def prefill(self, tokens: list[int], features=None) -> None:
        super().prefill(tokens)
        self.kv.reset()
        self.cached = []
        self.kv.reserve(len(tokens) + self.max_nodes + 1)

    def commit(self, tokens: list[int], features=None) -> None:
        # all committed tokens but the last are accepted drafts: the cached entries of the drafts
        # fed after the root stay valid up to there, the rest are rolled back
        valid = len(self.context) + len(tokens) - 1
        super().commit(tokens)
        drop = max(0, len(self.cached) - valid)
        self.kv.rollback(drop)
        del self.cached[len(self.cached) - drop:]

    def _start(self) -> torch.Tensor:
        new = self.context[len(self.cached):]  # committed tokens the draft has not seen (the root at least)
        pad = max(self.runner.token_buckets) if self.runner is not None else 0  # room for a padded bucket
        self.kv.reserve(self.kv.length + len(new) + self.max_nodes + pad)
        L = self.kv.length
        positions = torch.arange(L, L + len(new), device=self.model.device)  # [n]
        out = self._forward(torch.tensor([new], device=self.model.device), positions, None, last=True)
        self.kv.commit()
        self.cached += new
        self.forwards += 1
        self._tree, self._tokens = GrowingTree(), []
        return out.logits[0, -1]

    def _extend(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        self._tokens += tokens
        # [n] root position + depth, [n, S] context + earlier nodes + new (the root sits at len(cached) - 1)
        positions, mask = self._tree.add(parents, len(self.cached), self.model.device)
        x = torch.tensor([tokens], device=self.model.device)
        out = self._forward(x, positions, None if self._tree.is_chain else mask)  # a path: causal is the tree mask
        self.kv.commit()
        self.forwards += 1
        return out.logits[0]  # [n, V]

    def _end(self) -> None:
        if self._tree.is_chain:  # a chain's drafts stay cached: the next _start keeps the accepted ones
            self.cached += self._tokens
        else:
            self.kv.rollback(len(self._tree))
        self._tree, self._tokens = GrowingTree(), []
