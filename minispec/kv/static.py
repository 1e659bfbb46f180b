"""A contiguous KV cache whose committed lengths live on the device, so that a forward writing to it can be
captured in a CUDA graph (chapter 8; ``minispec.cuda_graphs`` runs forwards over it).

The contiguous ``KVCache`` keeps its length as a Python int and hands attention ``k[..., :length + T]``:
the key count changes every step, and so does every attention shape. Here the buffers [L, B, Hkv, C, hd]
have a fixed capacity C and attention reads all C slots every step (gpt-fast's static cache); which slots
hold committed entries is a device tensor ``lengths`` [B], read by the attention plan
(``cuda_graphs.static_plan``'s mask, or the split kernel's lengths) on the device. The host keeps a mirror
(``host_lengths``) for its own bookkeeping (room, commit, rollback), done between steps, outside any graph.

References: gpt-fast (PyTorch team, 2023: a static KV cache attended over its whole length with a mask).

Shapes: L layers, B batch, Hkv KV heads, C capacity, T new tokens, hd head dim.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..transfer import to_device
from .contiguous import KVCacheOverflow, zeros_keys_last


class StaticKVCache:
    """A contiguous KV cache with device-side lengths, so a forward that writes to it can be captured.

    ``write`` puts the new keys / values at ``write_pos`` (a [B, T] tensor set by ``static_forward``)
    and returns the whole buffer [B, Hkv, C, hd]; ``commit`` (outside any graph) keeps accepted
    entries, compacting a tree's accepted path as ``KVCache.commit`` does. A host mirror of the
    lengths lets the caller check capacity without reading the device.
    """

    def __init__(self, n_layer: int, n_kv_head: int, head_dim: int, capacity: int, batch_size: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (n_layer, batch_size, n_kv_head, capacity, head_dim)  # [L, B, Hkv, C, hd]
        self.k = zeros_keys_last(shape, dtype, device)  # keys-last in memory on the CPU (row-invariant attention)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity, self.batch_size = capacity, batch_size
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B] committed, read in graphs
        self.host_lengths = [0] * batch_size  # the same, on the host
        self.write_pos: torch.Tensor | None = None  # [B, T] slots of the forward in progress
        self.pending = (0, 0)  # (rows, tokens) written by the last forward, not yet committed
        self.generation = 0  # bumped when the buffers are reallocated: graphs captured before are stale

    @classmethod
    def for_model(cls, model, capacity: int, batch_size: int = 1) -> "StaticKVCache":
        c = model.cfg
        return cls(c.n_layer, c.n_kv_head, c.head_dim, capacity, batch_size, model.dtype, model.device)

    def __repr__(self):
        return (f"StaticKVCache(lengths={self.host_lengths}, pending={self.pending}, capacity={self.capacity}, "
                f"batch={self.batch_size})")

    @property
    def length(self) -> int:
        """Committed tokens of every row (the rows must agree), as ``KVCache.length``."""
        if len(set(self.host_lengths)) != 1:
            raise ValueError(f"rows hold different lengths {self.host_lengths}: read host_lengths")
        return self.host_lengths[0]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new k, v [b, Hkv, T, hd] at ``write_pos``; return all slots [b, Hkv, C, hd]."""
        b = k.shape[0]
        rows = torch.arange(b, device=k.device)[:, None]  # [b, 1]
        self.k[layer][rows, :, self.write_pos] = k.transpose(1, 2)  # indexed view [b, T, Hkv, hd]
        self.v[layer][rows, :, self.write_pos] = v.transpose(1, 2)
        return self.k[layer, :b], self.v[layer, :b]

    def begin(self, batch_size: int, n_new: int) -> None:
        """Declare the next forward's rows 0..batch_size-1 and n_new tokens each (host bookkeeping,
        outside any graph; ``static_plan`` sets the slots on the device); raises without changing
        anything when entries are pending or the rows lack room."""
        if self.pending != (0, 0):
            raise RuntimeError("the last forward's KV entries are pending: call kv.commit() or kv.discard() first")
        self.check_room(batch_size, n_new)
        self.pending = (batch_size, n_new)

    def check_room(self, rows: int, tokens: int) -> None:
        """Raise KVCacheOverflow unless rows 0..rows-1 can take ``tokens`` more slots each."""
        if rows > self.batch_size:
            raise ValueError(f"{rows} rows but the cache holds {self.batch_size}")
        if max(self.host_lengths[:rows]) + tokens > self.capacity:
            raise KVCacheOverflow(f"static KV cache: {max(self.host_lengths[:rows])} cached + {tokens} new (padded) "
                                  f"tokens > capacity {self.capacity}")

    def commit(self, keep: Sequence[Sequence[int]] | Sequence[int] | None = None) -> None:
        """Keep the last forward's entries: all of them (None), or per row the indices (strictly
        increasing, 0 = the row's first new token) of the accepted ones, moved to contiguous slots
        (one flat list for a forward of one row, as ``KVCache.commit`` takes)."""
        rows, T = self.pending
        if keep is not None and rows == 1 and (len(keep) == 0 or not isinstance(keep[0], (list, tuple))):
            keep = [keep]
        if keep is None:  # everything: a device add, no host round trip
            self.lengths[:rows] += T
            self.host_lengths[:rows] = [n + T for n in self.host_lengths[:rows]]
            self.pending = (0, 0)
            return
        keep = [[int(i) for i in row] for row in keep]
        if len(keep) != rows:
            raise ValueError(f"keep has {len(keep)} rows, the last forward wrote {rows}")
        for b, idx in enumerate(keep):
            if any(not 0 <= i < T for i in idx) or any(x >= y for x, y in zip(idx, idx[1:])):
                raise ValueError(f"keep[{b}]={idx} must be strictly increasing indices into {T} new tokens")
            n0 = self.host_lengths[b]
            if idx != list(range(len(idx))):  # compaction: gather the path, store it contiguously
                src = to_device(idx, self.k.device) + n0  # pinned, asynchronous: no wait for the GPU
                self.k[:, b, :, n0:n0 + len(idx)] = self.k[:, b].index_select(2, src)  # [L, Hkv, n, hd]
                self.v[:, b, :, n0:n0 + len(idx)] = self.v[:, b].index_select(2, src)
            self.host_lengths[b] = n0 + len(idx)
        self._upload_lengths()
        self.pending = (0, 0)

    def _upload_lengths(self) -> None:
        self.lengths.copy_(to_device(self.host_lengths, self.lengths.device, torch.long))  # pinned on CUDA: no wait

    def discard(self) -> None:
        self.pending = (0, 0)

    def rollback(self, n: int) -> None:
        """Forget the last n committed tokens of every row."""
        if self.pending != (0, 0):
            raise RuntimeError("commit() or discard() the pending entries before rolling back")
        if not 0 <= n <= min(self.host_lengths):
            raise ValueError(f"cannot roll back {n} tokens: the rows hold {self.host_lengths}")
        self.host_lengths = [m - n for m in self.host_lengths]
        self._upload_lengths()

    def reset(self) -> None:
        self.set_lengths([0] * self.batch_size)

    def reserve(self, capacity: int) -> None:
        """Grow to at least ``capacity`` slots (doubling), keeping what is cached. New buffers mean new
        addresses: graphs captured on the old ones are stale (``generation`` counts reallocations)."""
        if capacity <= self.capacity:
            return
        if self.pending != (0, 0):
            raise RuntimeError("commit() or discard() the pending entries before growing the cache")
        new = max(capacity, 2 * self.capacity)
        n = max(self.host_lengths)
        for name in ("k", "v"):
            old = getattr(self, name)
            shape = (*old.shape[:3], new, old.shape[4])  # [L, B, Hkv, C', hd]
            buf = zeros_keys_last(shape, old.dtype, old.device) if name == "k" else old.new_zeros(shape)
            buf[:, :, :, :n] = old[:, :, :, :n]
            setattr(self, name, buf)
        self.capacity, self.generation = new, self.generation + 1

    def set_lengths(self, lengths: Sequence[int]) -> None:
        """Declare rows 0..len-1 to hold that many committed tokens (benchmarks: a cache filled with
        arbitrary keys stands for a prefilled prompt, the cost of attention does not depend on them)."""
        if len(lengths) > self.batch_size or max(lengths) > self.capacity or min(lengths) < 0:
            raise ValueError(f"lengths {list(lengths)} do not fit batch {self.batch_size}, capacity {self.capacity}")
        self.host_lengths[:len(lengths)] = [int(n) for n in lengths]
        self._upload_lengths()
        self.pending = (0, 0)
