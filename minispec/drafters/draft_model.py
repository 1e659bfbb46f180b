"""Vanilla speculative sampling's drafter: a small causal LM with the target's tokenizer.

As a chain (Leviathan et al. 2023; Chen et al. 2023) the draft model extends the context
autoregressively by k tokens, each sampled from q = probs(draft logits) processed exactly like
p (greedy: the argmax). As a tree (static choices or EAGLE-2 dynamic, see ``tree_drafter``) it
drafts level by level: one forward per level over all of that level's nodes, each attending to
the context and its own ancestors through a tree mask, as the target does when it verifies.

Its own KV cache keeps the longest prefix it shares with the committed context, so rejected
drafts are rolled back and accepted ones are not recomputed.
"""

from __future__ import annotations

import torch

from ..kv import KVCache
from .tree_drafter import TreeDrafter, TreeSpec


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
        self.cached: list[int] = []  # tokens whose keys/values are committed in self.kv
        self._depths: list[int] = []  # depth of each node added since _start
        self._anc: list[list[int]] = []  # ancestors (indices among added nodes) of each added node
        self._tokens: list[int] = []  # tokens of the nodes added since _start
        self._chain_only = True

    @property
    def k(self) -> int:
        return self.spec.depth

    def __repr__(self):
        return f"DraftModel({self.model.cfg.name or self.model.cfg.arch}, {self.model.cfg.n_layer} layers, {self.spec.name})"

    def check_target(self, target) -> None:
        if self.model.cfg.vocab_size != target.cfg.vocab_size:
            raise ValueError(f"vocab mismatch: draft has {self.model.cfg.vocab_size} tokens, target "
                             f"{target.cfg.vocab_size}; a draft model must share the target's tokenizer")

    def prefill(self, prompt: list[int]) -> None:
        self.kv.reset()
        self.cached = []
        self.forwards = 0
        self.kv.reserve(len(prompt) + self.max_nodes + 1)

    def _start(self, context: list[int]) -> torch.Tensor:
        common = 0  # longest common prefix of the cache and the context, never the whole context
        limit = min(len(self.cached), len(context) - 1)
        while common < limit and self.cached[common] == context[common]:
            common += 1
        self.kv.rollback(len(self.cached) - common)
        del self.cached[common:]
        new = context[common:]
        self.kv.reserve(self.kv.length + len(new) + self.max_nodes)
        out = self.model(torch.tensor([new], device=self.model.device), kv=self.kv, last_logits_only=True)
        self.kv.commit()
        self.cached += new
        self.forwards += 1
        self._depths, self._anc, self._tokens, self._chain_only = [], [], [], True
        return out.logits[0, -1]

    def _extend(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        n, done = len(tokens), len(self._depths)
        L = len(self.cached)  # the root sits at position L - 1
        chain = n == 1 and parents[0] == done - 1 and self._chain_only
        self._tokens += tokens
        for p in parents:
            self._depths.append(1 if p < 0 else self._depths[p] + 1)
            self._anc.append([] if p < 0 else self._anc[p] + [p])
        positions = torch.tensor(self._depths[done:], device=self.model.device) + L - 1  # [n] prefix + depth
        if chain:  # a path: the causal mask is the tree mask
            out = self.model(torch.tensor([tokens], device=self.model.device), positions=positions, kv=self.kv)
        else:
            self._chain_only = False
            mask = torch.zeros(n, L + done + n, dtype=torch.bool)  # [n, S]: context + earlier nodes + new
            mask[:, :L] = True
            for j in range(n):
                mask[j, [L + a for a in self._anc[done + j]]] = True
                mask[j, L + done + j] = True
            out = self.model(torch.tensor([tokens], device=self.model.device), positions=positions,
                             mask=mask.to(self.model.device), kv=self.kv)
        self.kv.commit()
        self.forwards += 1
        return out.logits[0]  # [n, V]

    def _end(self) -> None:
        n = len(self._depths)
        if self._chain_only:  # a chain's drafts stay cached: the next _start keeps the accepted ones
            self.cached += self._tokens
        else:
            self.kv.rollback(n)
        self._depths, self._anc, self._tokens = [], [], []
