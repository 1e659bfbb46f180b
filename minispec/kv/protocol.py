"""What a forward asks of a KV cache: the ``typing.Protocol`` the contiguous (``KVCache``), paged
(``PagedKVCache``) and static (``StaticKVCache``) caches implement, so that the model
and the attention plans (``minispec.attention.plan``) name no cache class.

A forward's life with a cache:

    begin(B, n_new)         reserve the pending slots (the attention plan does it, before the forward)
    write(layer, k, v)      each layer: store the new keys / values, return what attention reads
    commit(keep) / discard()  after it: keep all, a subset (a tree's accepted path), or none
    rollback(n), reset(), reserve(capacity)   the decode loop's other moves

A ragged batch (chapter 7) needs more: rows of different lengths cannot come back as one tensor,
so the cache stores a layer's new entries (``store``) and each row reads its own sequence
(``read``), or every row at once, each padded to the longest with entries its mask hides (``read_rows``);
the paged cache and the row cache do that (``RaggedKVCache``).

Shapes: B batch, Hkv key/value heads, T new tokens, S cached + new keys, hd head dim.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class KVCacheProtocol(Protocol):
    @property
    def length(self) -> int:
        """Committed tokens (the prefix every new token sees)."""

    def begin(self, batch_size: int, n_new) -> None:
        """Reserve room for n_new pending tokens per row; raise without changing anything if it cannot."""

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer's new k, v [B, Hkv, T, hd]; return the keys and values attention reads [B, Hkv, S, hd]."""

    def commit(self, keep: Sequence[int] | None = None) -> None:
        """Keep the pending entries: all (None) or those at the given indices."""

    def discard(self) -> None:
        """Drop the pending entries."""

    def rollback(self, n: int) -> None:
        """Forget the last n committed tokens."""

    def reset(self) -> None:
        """Forget everything."""

    def reserve(self, capacity: int) -> None:
        """Grow to hold at least ``capacity`` tokens."""


@runtime_checkable
class RaggedKVCache(KVCacheProtocol, Protocol):
    lengths: list[int]  # committed tokens per sequence

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store layer's new k, v [B, Hkv, T, hd]; row r keeps its first n_r tokens."""

    def read(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``seq``'s keys and values [1, Hkv, n, hd]: committed + pending."""

    def read_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's keys and values [R, Hkv, S, hd]: committed + pending, then entries to hide."""
