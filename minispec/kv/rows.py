"""A ragged cache of rows (chapter 7's batches on the CPU): every sequence's keys and values in a row of their own.

The paged cache (``paged.py``) shares one pool of blocks among sequences of any length. Reading a whole ragged
batch from it at once (``read_rows``) gathers every row's blocks and, for the CPU's row-invariant attention, which
reads K^T row-major, transposes them: in a batched decode step on the CPU those copies are most of the step. Here
sequence b owns row b of two buffers [L, B, Hkv, cap, hd], K stored keys last for the exact attention (the layout it
reads, as ``KVCache`` stores it), so a step's rows are read as views of the buffers when they are the first R
rows in order, else with one ``index_select`` of rows per layer (a copy of every row's keys and values). So when
sequences finish, the batch decoder moves the highest rows into the freed ones (``move``: one copy of one
sequence's cache, once) and the rows that decode stay the first R. The price is the contiguous cache's: every
sequence holds ``capacity`` slots from the start.

The same ragged interface as ``PagedKVCache`` (``RaggedKVCache``): ``begin`` with one count, one per sequence or
``{sequence: count}``; ``store``, ``read``, ``read_rows``; ``commit`` with one keep list or one per sequence (a
tree's accepted path moves down to the next slots); ``discard``, ``rollback``, ``free``, ``reset``, ``reserve``;
and ``write`` / ``length`` when every sequence has the same length. Its own: ``move`` (a sequence to a free row).

Shapes: L layers, B batch, Hkv key/value heads, cap slots per sequence, hd head dim.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..transfer import to_device
from .contiguous import KVCacheOverflow, keys_last_for, stores_keys_last, zeros_keys_last
from .paged import RaggedLengths, new_slots, ragged_counts, ragged_keeps, ragged_rollback


class RowKVCache(RaggedLengths):
    """K/V of B sequences, sequence b in row b.

    State: ``k``, ``v`` [L, B, Hkv, cap, hd] (``k`` stored keys last for the exact attention: ``keys_last``);
    ``lengths[b]`` committed tokens of sequence b, ``pendings[b]`` its uncommitted ones (written after them);
    ``rows`` the sequences of the pending forward, in row order. Slots past a sequence's tokens hold stale (finite)
    entries that attention masks hide.
    """

    def __init__(self, n_layer: int, n_kv_head: int, head_dim: int, capacity: int, batch_size: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", keys_last: bool | None = None):
        if capacity <= 0 or batch_size <= 0:
            raise ValueError(f"capacity and batch_size must be positive, got {capacity} and {batch_size}")
        shape = (n_layer, batch_size, n_kv_head, capacity, head_dim)
        self.keys_last = stores_keys_last(device, keys_last)
        self.k = zeros_keys_last(shape, dtype, device, self.keys_last)  # keys-last: a row-major [L, B, Hkv, hd, cap]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.batch_size = batch_size
        self.lengths = [0] * batch_size  # committed tokens per sequence
        self.pendings = [0] * batch_size  # tokens written by the last forward, not yet committed
        self.rows = list(range(batch_size))  # the sequences of the pending forward's rows
        self._pending_slots = None  # the pending forward's (rows, toks, seq, pos) index tensors, shared by every layer
        self._read = None  # what its read_rows reads in every layer: (keys S, rows R, the rows' index or None: the
        #                    first R rows, in order)

    @classmethod
    def for_model(cls, model, capacity: int, batch_size: int = 1) -> "RowKVCache":
        """A cache for ``model`` (a minispec Transformer) of ``capacity`` tokens per sequence; keys stored keys-last for
        the exact attention only (``KVCache.for_model``)."""
        c = model.cfg
        return cls(c.n_layer, c.n_kv_head, c.head_dim, capacity, batch_size, model.dtype, model.device,
                   keys_last_for(model))

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def __repr__(self):
        return f"RowKVCache(lengths={self.lengths}, pending={self.pendings}, capacity={self.capacity})"

    # ------------------------------------------------------------------ the model's side
    def begin(self, batch_size: int, n_new: int | Sequence[int] | dict[int, int]) -> None:
        """Reserve n_new pending tokens per sequence: one count, one per sequence, or ``{sequence: count}`` for a
        forward over some sequences only (row r of the forward is the r-th key). Raises without changing anything
        if a sequence would pass its capacity."""
        if self.pending:
            raise RuntimeError(f"{self.pending} pending KV entries from the last forward: "
                               "call commit() or discard() first")
        rows, ns = ragged_counts(n_new, batch_size, self.batch_size)
        over = [b for b in range(self.batch_size) if self.lengths[b] + ns[b] > self.capacity]
        if over:
            raise KVCacheOverflow(f"KV cache overflow: sequences {over} would hold "
                                  f"{[self.lengths[b] + ns[b] for b in over]} tokens, capacity {self.capacity}; "
                                  "allocate a larger cache or reserve() more")
        dev = self.k.device
        self.pendings, self.rows, self._pending_slots = ns, rows, new_slots(rows, ns, self.lengths, dev)  # [n] each
        prefix = rows == list(range(len(rows)))  # the first R rows, in order: views will do
        self._read = (max((self.lengths[s] + ns[s] for s in rows), default=0), len(rows),
                      None if prefix else torch.tensor(rows, device=dev))

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store layer's new k, v [R, Hkv, T, hd] (T = the most pending; row r keeps its first pendings)."""
        if self._pending_slots is None or k.shape[2] != self.pending:
            raise RuntimeError(f"write of {k.shape[2]} tokens but {self.pending} were reserved with begin()")
        r, toks, seq, pos = self._pending_slots
        self.k[layer, seq, :, pos] = k[r, :, toks]  # [n, Hkv, hd] into their slots
        self.v[layer, seq, :, pos] = v[r, :, toks]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer's new k, v [B, Hkv, T, hd]; return prefix + new [B, Hkv, S, hd] (views; every sequence in
        the forward with the same length)."""
        S = {L + n for L, n in zip(self.lengths, self.pendings)}
        if self._pending_slots is not None and (len(S) != 1 or self._read[1] is not None):  # without begin(), store() raises
            raise RuntimeError(f"write() returns one [B, Hkv, S, hd] tensor, but the sequences hold "
                               f"{[L + n for L, n in zip(self.lengths, self.pendings)]} tokens; use store() and "
                               "read_rows() for a ragged batch")
        self.store(layer, k, v)
        S = S.pop()
        return self.k[layer, :, :, :S], self.v[layer, :, :, :S]

    def read(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V [1, Hkv, n, hd] of sequence ``seq``: its committed and pending tokens (views)."""
        n = self.lengths[seq] + self.pendings[seq]
        return self.k[layer, seq, :, :n][None], self.v[layer, seq, :, :n][None]

    def read_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V [R, Hkv, S, hd] of the pending forward's R rows, S = the longest row's tokens: row r
        holds its sequence's tokens, then stale entries its attention mask must hide (``RaggedPlan`` does). Views
        when the forward's rows are the cache's first R, in order; else one ``index_select`` of rows. K keeps the
        cache's layout: keys-last (the transpose of a row-major [R, Hkv, hd, S]) for the row-invariant attention."""
        S, R, idx = self._read
        if idx is None:  # the first R rows: views
            return self.k[layer, :R, :, :S], self.v[layer, :R, :, :S]
        k, v = self.k[layer, :, :, :S], self.v[layer, :, :, :S]  # rows elsewhere or out of order: copy those that run
        if self.keys_last:  # K still keys last
            return k.transpose(-1, -2).index_select(0, idx).transpose(-1, -2), v.index_select(0, idx)
        return k.index_select(0, idx), v.index_select(0, idx)

    # ------------------------------------------------------------------ the decode loop's side
    def commit(self, keep=None) -> None:
        """Keep pending entries: all (None), those at the given strictly increasing indices (0 = first new token;
        a draft tree's accepted path), or one such list (or None) per sequence. Kept entries move to the next slots."""
        for b, k in enumerate(ragged_keeps(keep, self.pendings)):  # every sequence validated before any changes
            L = self.lengths[b]
            if k != list(range(len(k))):  # compaction: the accepted path moves down to the next slots
                src = to_device([L + i for i in k], self.k.device)  # pinned on CUDA: no wait for the GPU
                dst = torch.arange(L, L + len(k), device=self.k.device)
                for buf in (self.k, self.v):
                    buf[:, b, :, dst] = buf[:, b, :, src]  # gathered before stored
            self.lengths[b] += len(k)
            self.pendings[b] = 0
        self._pending_slots = None

    def move(self, src: int, dst: int) -> None:
        """Sequence ``src``'s tokens move to the free row ``dst`` (one copy of its keys and values in every layer);
        row ``src`` is free after. The batch decoder moves rows so that those of its forwards stay the cache's first
        R, which ``read_rows`` reads as views. ValueError (nothing changed) for a row out of range, ``src`` =
        ``dst`` or a ``dst`` that holds tokens; RuntimeError with pending entries."""
        if self.pending:
            raise RuntimeError("commit() or discard() the pending entries before moving a sequence")
        if not (0 <= src < self.batch_size and 0 <= dst < self.batch_size) or src == dst:
            raise ValueError(f"cannot move row {src} to row {dst} in a cache of {self.batch_size} rows")
        if self.lengths[dst]:
            raise ValueError(f"row {dst} holds {self.lengths[dst]} tokens: a sequence moves into a free row")
        n = self.lengths[src]
        for buf in (self.k, self.v):
            buf[:, dst, :, :n] = buf[:, src, :, :n]  # [L, Hkv, n, hd]
        self.lengths[dst], self.lengths[src] = n, 0

    def discard(self) -> None:
        """Drop all pending entries."""
        self.pendings, self._pending_slots = [0] * self.batch_size, None

    def rollback(self, n: int | Sequence[int]) -> None:
        """Forget the last n committed tokens (an int, or one count per sequence): no copy."""
        if self.pending:
            raise RuntimeError("commit() or discard() the pending entries before rolling back")
        self.lengths = [L - x for L, x in zip(self.lengths, ragged_rollback(n, self.lengths))]

    def reset(self) -> None:
        """Forget every sequence and anything pending."""
        self.lengths, self.pendings, self._pending_slots = [0] * self.batch_size, [0] * self.batch_size, None

    def reserve(self, capacity: int) -> None:
        """Grow every row (at least doubling) to hold ``capacity`` tokens, keeping what it holds."""
        if self.pending and capacity > self.capacity:
            raise RuntimeError("commit() or discard() the pending entries before growing the cache")
        if capacity > self.capacity:
            old, shape = self.capacity, (*self.v.shape[:3], max(capacity, 2 * self.capacity), self.v.shape[4])
            k, v = zeros_keys_last(shape, self.k.dtype, self.k.device, self.keys_last), self.v.new_zeros(shape)
            k[:, :, :, :old], v[:, :, :, :old] = self.k, self.v
            self.k, self.v = k, v
