"""A preallocated, contiguous key/value cache with commit (compaction) and rollback.

One forward of T new tokens writes their keys and values *pending* after the committed
prefix. The decode loop then keeps the accepted ones:

    commit()          keep all T (vanilla decoding, a fully accepted chain)
    commit([0, 2, 5]) keep a subset: the accepted root-to-leaf path of a draft tree. Its
                      entries move down to the next contiguous slots (compaction), since an
                      accepted sibling's KV does not sit where the next token belongs.
    discard()         keep none
    rollback(n)       drop the last n committed tokens

Reference for the layout and the idea of caching keys/values: Pope et al., "Efficiently
Scaling Transformer Inference" (2022). Tree compaction as in SpecInfer (Miao et al. 2023)
and EAGLE (Li et al. 2024).

Shapes: L layers, B batch, Hkv key/value heads, C capacity (tokens), hd head dim.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..transfer import to_device


def zeros_keys_last(shape, dtype: torch.dtype, device, keys_last: bool | None = None) -> torch.Tensor:
    """A zero key buffer of logical shape [..., C, hd] that is stored keys-last ([..., hd, C] in memory, returned
    transposed) where ``keys_last`` (None: on the CPU): then ``k.transpose(-1, -2)`` is a row-major [hd, S] matrix
    and the row-invariant attention (``minispec.exact.attention``) computes q @ k^T as a product of two row-major
    operands without copying the keys. Otherwise the usual hd-last layout that fused kernels (SDPA's) expect."""
    if not stores_keys_last(device, keys_last):
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.zeros(*shape[:-2], shape[-1], shape[-2], dtype=dtype, device=device).transpose(-1, -2)


def stores_keys_last(device, keys_last: bool | None = None) -> bool:
    """``keys_last`` as a cache was given it, or where it was not (None) the default: keys-last on the CPU."""
    return torch.device(device).type == "cpu" if keys_last is None else keys_last


def keys_last_for(model) -> bool:
    """Whether a cache for ``model`` stores its keys keys-last: for the CPU's row-invariant attention ("exact")."""
    return model.device.type == "cpu" and getattr(model, "attention", "exact") == "exact"


def span(x: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """Tokens start..start+n of a layer's keys or values x [B, Hkv, C, hd]: ``x[:, :, start:start + n]`` as one view
    op (a slice is two; a decode step takes four of these a layer)."""
    if torch.compiler.is_compiling():  # a trace cannot read a storage offset
        return x[:, :, start:start + n]
    B, Hkv, _, hd = x.shape
    return x.as_strided((B, Hkv, n, hd), x.stride(), x.storage_offset() + start * x.stride(2))


class KVCacheOverflow(RuntimeError):
    """Raised when a write would exceed the cache's capacity; the cache is left unchanged."""


class KVCache:
    def __init__(self, n_layer: int, n_kv_head: int, head_dim: int, capacity: int, batch_size: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", keys_last: bool | None = None):
        if capacity <= 0 or batch_size <= 0:
            raise ValueError(f"capacity and batch_size must be positive, got {capacity}, {batch_size}")
        shape = (n_layer, batch_size, n_kv_head, capacity, head_dim)  # [L, B, Hkv, C, hd]
        self.keys_last = stores_keys_last(device, keys_last)
        self.k = zeros_keys_last(shape, dtype, device, self.keys_last)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity, self.batch_size = capacity, batch_size
        self._views()
        self.length = 0  # committed tokens
        self.pending = 0  # tokens written by the last forward, not yet committed

    @classmethod
    def for_model(cls, model, capacity: int, batch_size: int = 1) -> "KVCache":
        """A cache shaped for ``model`` (a minispec Transformer), on its device and dtype; its keys stored keys-last
        for the CPU's row-invariant attention ("exact"), else as SDPA reads them."""
        c = model.cfg
        return cls(c.n_layer, c.n_kv_head, c.head_dim, capacity, batch_size, model.dtype, model.device,
                   keys_last_for(model))

    def __repr__(self):
        return f"KVCache(length={self.length}, pending={self.pending}, capacity={self.capacity}, batch={self.batch_size})"

    def begin(self, batch_size: int, n_new: int) -> None:
        """Reserve room for n_new pending tokens; raises without changing anything if it cannot."""
        if self.pending:
            raise RuntimeError(f"{self.pending} pending KV entries from the last forward: call commit() or discard() first")
        if batch_size != self.batch_size:
            raise ValueError(f"batch of {batch_size} does not match the KV cache's batch of {self.batch_size}")
        if self.length + n_new > self.capacity:
            raise KVCacheOverflow(
                f"KV cache overflow: {self.length} cached + {n_new} new tokens > capacity {self.capacity}; "
                "allocate a larger cache (e.g. prompt length + max_new_tokens + draft tokens)")
        self.pending = n_new

    def _views(self) -> None:
        """Each layer's k and v [B, Hkv, C, hd], viewed once per buffer rather than in every write."""
        # select, not unbind: autograd refuses in-place writes into one of unbind's several outputs (training)
        self.layers = [(self.k[i], self.v[i]) for i in range(self.k.shape[0])]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer's new k, v [B, Hkv, T, hd] after the prefix; return prefix + new [B, Hkv, S, hd]."""
        s, T = self.length, k.shape[2]
        if T != self.pending:
            raise RuntimeError(f"write of {T} tokens but {self.pending} were reserved with begin()")
        k_layer, v_layer = self.layers[layer]  # [B, Hkv, C, hd] each
        if torch.is_grad_enabled():  # (training) autograd records the writes
            k_layer[:, :, s:s + T] = k
            v_layer[:, :, s:s + T] = v
            return k_layer[:, :, :s + T], v_layer[:, :, :s + T]
        span(k_layer, s, T).copy_(k)
        span(v_layer, s, T).copy_(v)
        return span(k_layer, 0, s + T), span(v_layer, 0, s + T)

    def commit(self, keep: Sequence[int] | torch.Tensor | None = None) -> None:
        """Keep pending entries: all of them (None), or those at the given indices (0 = first new
        token), which must be strictly increasing; kept entries move to contiguous slots."""
        if keep is None:
            self.length += self.pending
            self.pending = 0
            return
        keep = [int(i) for i in keep]
        if any(not 0 <= i < self.pending for i in keep) or any(a >= b for a, b in zip(keep, keep[1:])):
            raise ValueError(f"keep={keep} must be strictly increasing indices into the {self.pending} pending entries")
        if keep != list(range(len(keep))):  # compaction: gather, then store contiguously
            src = to_device(keep, self.k.device) + self.length  # pinned on CUDA: no wait for the GPU
            dst = slice(self.length, self.length + len(keep))
            self.k[:, :, :, dst] = self.k.index_select(3, src)  # [L, B, Hkv, n, hd]
            self.v[:, :, :, dst] = self.v.index_select(3, src)
        self.length += len(keep)
        self.pending = 0

    def reserve(self, capacity: int) -> None:
        """Grow to hold at least ``capacity`` tokens (doubling), keeping what is cached."""
        if capacity <= self.capacity:
            return
        if self.pending:
            raise RuntimeError("commit() or discard() the pending entries before growing the cache")
        new = max(capacity, 2 * self.capacity)
        for name in ("k", "v"):
            old = getattr(self, name)
            shape = (*old.shape[:3], new, old.shape[4])  # [L, B, Hkv, C', hd]
            buf = zeros_keys_last(shape, old.dtype, old.device, self.keys_last) if name == "k" else old.new_zeros(shape)
            buf[:, :, :, :self.length] = old[:, :, :, :self.length]
            setattr(self, name, buf)
        self.capacity = new
        self._views()

    def discard(self) -> None:
        """Drop all pending entries."""
        self.pending = 0

    def rollback(self, n: int) -> None:
        """Forget the last n committed tokens."""
        if self.pending:
            raise RuntimeError("commit() or discard() the pending entries before rolling back")
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot roll back {n} tokens: the cache holds {self.length}")
        self.length -= n

    def reset(self) -> None:
        self.length = self.pending = 0
