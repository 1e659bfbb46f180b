"""A paged key/value cache (chapter 7): a shared pool of fixed-size blocks and per-sequence block tables.

The contiguous cache gives every sequence ``capacity`` slots up front. A paged cache (vLLM's
PagedAttention) cuts the memory into blocks of ``block_size`` token slots, shared by all
sequences; sequence b owns the blocks listed in its block table, in order, so its token n
lives in block ``tables[b][n // block_size]`` at offset ``n % block_size``. Sequences of very
different lengths then share one pool, and a finished sequence gives its blocks back.

Same interface as ``KVCache`` (begin / write / commit / discard / rollback / reset / reserve /
length / for_model), so ``Transformer.forward`` runs with either. The choices of this module:

* Pending tokens are written straight to their final slots, after the committed ones.
  ``commit()`` just moves the length; ``discard()`` and ``rollback(n)`` move it back and return
  the blocks that no longer hold a committed token to the free list. Rollback is O(1) in tokens
  (no key or value is copied) and needs no saved allocator state: the only state is the
  lengths, and sequence b always owns exactly ceil((length + pending) / block_size) blocks.
  (The alternative, snapshotting the free list and block tables before each forward and
  restoring them on rejection, stores more and still needs compaction for a tree's path.)
* Tree padding: ``begin(B, T)`` reserves the blocks for all T pending tokens of every
  sequence, the whole draft tree, before anything is written, all or nothing. A forward never
  writes into an unallocated block or allocates between layers; if the pool is short it
  raises ``KVPoolExhausted`` and leaves every sequence as it was.
* Tree compaction: ``commit([0, 2, 5])`` keeps the accepted root-to-leaf path; its entries
  move down to the next slots (crossing blocks as needed), like ``KVCache.commit``, and the
  blocks the rejected nodes padded go back to the pool.
* Ragged batches: lengths may differ per sequence (``lengths``). ``begin`` takes one count of
  new tokens or one per sequence; ``commit`` one keep list or one per sequence; ``rollback``
  one count or one per sequence; ``free(b)`` empties one sequence. ``length`` (the model's
  prefix) and ``write`` (prefix + new as one tensor) need equal lengths; a paged attention
  kernel (``minispec.attention.paged``) reads ragged sequences through ``block_table()``.

References: Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention" (vLLM, 2023); tree compaction as in SpecInfer (Miao et al. 2023) and EAGLE
(Li et al. 2024).

Shapes: L layers, B batch, Hkv key/value heads, N pool blocks, bs block size, hd head dim.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .contiguous import KVCacheOverflow


class KVPoolExhausted(KVCacheOverflow):
    """The block pool has too few free blocks for a forward; the cache is left unchanged."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _is_list(k) -> bool:
    return isinstance(k, (list, tuple)) or (torch.is_tensor(k) and k.dim() == 1)


def ragged_counts(n_new, batch_size: int, sequences: int) -> tuple[list[int], list[int]]:
    """A ragged ``begin``'s arguments -> (the forward's rows: its sequences in row order, new tokens per sequence).
    ``n_new``: one count for every sequence, one per sequence, or ``{sequence: count}``; ValueError if it does not
    fit ``sequences`` sequences or a forward of ``batch_size`` rows."""
    if isinstance(n_new, dict):
        rows = [int(s) for s in n_new]
        if len(set(rows)) != len(rows) or any(not 0 <= s < sequences for s in rows):
            raise ValueError(f"sequences {rows} must be distinct indices into the batch of {sequences}")
        ns = [0] * sequences
        for s, n in zip(rows, n_new.values()):
            ns[s] = int(n)
    else:
        rows = list(range(sequences))
        ns = [int(n) for n in (n_new if isinstance(n_new, (list, tuple)) else [n_new] * sequences)]
    if batch_size != len(rows):
        raise ValueError(f"batch of {batch_size} does not match the KV cache's batch of {len(rows)}")
    if len(ns) != sequences or min(ns) < 0:
        raise ValueError(f"n_new={n_new} must be a count >= 0 or one per sequence ({sequences})")
    return rows, ns


def new_slots(rows: list[int], pendings: list[int], lengths: list[int], device) -> tuple[torch.Tensor, ...]:
    """Where a ragged forward's new tokens go, as index tensors [n] (n = the pending tokens of its rows): the forward
    row of each, its index among its row's new tokens, its sequence and its position in that sequence."""
    ns = torch.tensor([pendings[s] for s in rows], device=device)  # [R]
    r = torch.repeat_interleave(torch.arange(len(rows), device=device), ns)  # [n]: forward row of each new token
    toks = torch.cat([torch.arange(pendings[s], device=device) for s in rows])  # [n]: index among the row's new ones
    seq = torch.tensor(rows, device=device)[r]  # [n]
    return r, toks, seq, torch.tensor(lengths, device=device)[seq] + toks  # position: after the committed tokens


def ragged_keeps(keep, pendings: list[int]) -> list[list[int]]:
    """A ragged ``commit``'s ``keep`` (None, one list of indices, or one list or None per sequence) -> the pending
    indices each sequence keeps, all validated before any is used (ValueError)."""
    per_seq = keep is not None and len(keep) == len(pendings) and all(k is None or _is_list(k) for k in keep)
    keeps = list(keep) if per_seq else [keep] * len(pendings)
    keeps = [list(range(n)) if k is None else [int(i) for i in k] for k, n in zip(keeps, pendings)]
    for k, n in zip(keeps, pendings):
        if any(not 0 <= i < n for i in k) or any(a >= b for a, b in zip(k, k[1:])):
            raise ValueError(f"keep={k} must be strictly increasing indices into the {n} pending entries")
    return keeps


def ragged_rollback(n, lengths: list[int]) -> list[int]:
    """A ragged ``rollback``'s n (one count, or one per sequence) -> the count per sequence (ValueError past a
    sequence's committed tokens)."""
    ns = [int(x) for x in (n if isinstance(n, (list, tuple)) else [n] * len(lengths))]
    if len(ns) != len(lengths) or any(not 0 <= x <= L for x, L in zip(ns, lengths)):
        raise ValueError(f"cannot roll back {n} tokens: the cache holds {lengths}")
    return ns


class RaggedLengths:
    """The lengths of a ragged cache's sequences (``lengths`` committed, ``pendings`` uncommitted, per sequence),
    as the single-prefix interface reads them; shared by ``PagedKVCache`` and ``rows.RowKVCache``."""

    lengths: list[int]
    pendings: list[int]

    @property
    def length(self) -> int:
        """The committed length shared by all sequences (the model's prefix); ValueError if ragged."""
        if len(set(self.lengths)) > 1:
            raise ValueError(f"sequences have different lengths {self.lengths}: a ragged batch has no single "
                             "length; read .lengths")
        return self.lengths[0]

    @property
    def pending(self) -> int:
        """Pending tokens of the last forward (the most of any sequence; 0 = nothing pending)."""
        return max(self.pendings)

    def free(self, seq: int) -> None:
        """Sequence ``seq`` is finished: forget its tokens."""
        if self.pending:
            raise RuntimeError("commit() or discard() the pending entries before freeing a sequence")
        if not 0 <= seq < len(self.lengths):
            raise ValueError(f"no sequence {seq} in a batch of {len(self.lengths)}")
        self.lengths[seq] = 0


class PagedKVCache(RaggedLengths):
    """K/V of B sequences in a pool of blocks.

    State: ``k_pool``, ``v_pool`` [L, N, Hkv, bs, hd]; ``tables[b]`` the blocks of sequence b in
    token order; ``lengths[b]`` its committed tokens, ``pendings[b]`` its uncommitted ones;
    ``free_list`` the unowned blocks. Every block is either free or in exactly one table.
    """

    def __init__(self, n_layer: int, n_kv_head: int, head_dim: int, n_blocks: int, block_size: int = 16,
                 batch_size: int = 1, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if n_blocks <= 0 or block_size <= 0 or batch_size <= 0:
            raise ValueError(f"n_blocks, block_size and batch_size must be positive, got {n_blocks}, {block_size}, "
                             f"{batch_size}")
        shape = (n_layer, n_blocks, n_kv_head, block_size, head_dim)  # [L, N, Hkv, bs, hd]
        self.k_pool = torch.zeros(shape, dtype=dtype, device=device)
        self.v_pool = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size, self.batch_size = block_size, batch_size
        self.free_list = list(range(n_blocks - 1, -1, -1))  # a stack: pop() hands out block 0 first
        self.tables: list[list[int]] = [[] for _ in range(batch_size)]  # sequence -> its blocks, in order
        self.lengths = [0] * batch_size  # committed tokens per sequence
        self.pendings = [0] * batch_size  # tokens written by the last forward, not yet committed
        self._pending_slots = None  # this forward's slot indices (see _write_slots), while tokens are pending
        self.rows = list(range(batch_size))  # the sequences of the pending forward's rows
        self._reads: dict = {}  # sequence (or "rows") -> its (blocks, offsets) for read() (read_rows()), per forward

    @classmethod
    def for_model(cls, model, capacity: int, batch_size: int = 1, block_size: int = 16,
                  n_blocks: int | None = None) -> "PagedKVCache":
        """A cache for ``model`` (a minispec Transformer); the pool defaults to ``capacity`` tokens per sequence."""
        c = model.cfg
        n_blocks = n_blocks or batch_size * _cdiv(capacity, block_size)
        return cls(c.n_layer, c.n_kv_head, c.head_dim, n_blocks, block_size, batch_size, model.dtype, model.device)

    @property
    def n_blocks(self) -> int:
        return self.k_pool.shape[1]

    def __repr__(self):
        return (f"PagedKVCache(lengths={self.lengths}, pending={self.pendings}, blocks free {len(self.free_list)}"
                f"/{self.n_blocks} of {self.block_size} tokens, batch={self.batch_size})")

    # ------------------------------------------------------------------ allocation
    def _release_beyond(self, b: int, n_tokens: int) -> None:
        """Return sequence b's blocks past the first n_tokens to the pool."""
        keep = _cdiv(n_tokens, self.block_size)
        while len(self.tables[b]) > keep:
            self.free_list.append(self.tables[b].pop())

    def begin(self, batch_size: int, n_new: int | Sequence[int] | dict[int, int]) -> None:
        """Reserve the blocks for n_new pending tokens per sequence; all or nothing: raises without
        changing anything if it cannot. ``n_new``: one count for every sequence, one per sequence, or
        ``{sequence: count}`` for a forward over some of the sequences only (row r of the forward is
        the r-th key; the others, e.g. finished ones, take no part). ``rows`` lists them."""
        if self.pending:
            raise RuntimeError(f"{self.pending} pending KV entries from the last forward: "
                               "call commit() or discard() first")
        rows, ns = ragged_counts(n_new, batch_size, self.batch_size)
        bs = self.block_size
        need = [_cdiv(L + n, bs) - len(t) for L, n, t in zip(self.lengths, ns, self.tables)]
        if sum(need) > len(self.free_list):
            raise KVPoolExhausted(
                f"KV block pool exhausted: {ns} new tokens after {self.lengths} cached need {sum(need)} more blocks "
                f"of {bs} tokens (per sequence {need}), but only {len(self.free_list)} of {self.n_blocks} are free; "
                "free finished sequences or allocate a larger pool")
        for b, n in enumerate(need):  # tree padding: every block the whole pending write touches, up front
            self.tables[b] += [self.free_list.pop() for _ in range(n)]
        self.pendings, self.rows, self._reads = ns, rows, {}
        self._pending_slots = self._write_slots()

    def _write_slots(self):
        """Index tensors for this forward's writes (and reads), built once and used by every layer."""
        dev, bs = self.k_pool.device, self.block_size
        table = self.block_table().long()  # [B, W]
        rows, toks, seq, pos = new_slots(self.rows, self.pendings, self.lengths, dev)  # [n] each
        write = rows, toks, table[seq, pos // bs], pos % bs  # (source row, source token) -> (block, offset)
        S = {L + n for L, n in zip(self.lengths, self.pendings)}
        read = None
        if len(S) == 1 and len(self.rows) == self.batch_size:  # one [B, Hkv, S, hd] tensor holds prefix + new
            pos = torch.arange(S.pop(), device=dev)
            read = table[:, pos // bs], pos % bs  # [B, S] blocks, [S] offsets
        return write, read

    @property
    def ragged(self) -> bool:
        """Whether the pending forward's sequences differ in length (or leave some sequences out):
        then ``write`` cannot return one tensor and each sequence attends on its own (``read``)."""
        return self._pending_slots is not None and self._pending_slots[1] is None

    # ------------------------------------------------------------------ the model's side
    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store layer's new k, v [B, Hkv, T, hd] (T = the most pending; row b keeps its first pendings[b])."""
        T = k.shape[2]
        if self._pending_slots is None or T != self.pending:
            raise RuntimeError(f"write of {T} tokens but {self.pending} were reserved with begin()")
        rows, toks, blk, off = self._pending_slots[0]
        self.k_pool[layer, blk, :, off] = k[rows, :, toks]  # [n, Hkv, hd] into their slots
        self.v_pool[layer, blk, :, off] = v[rows, :, toks]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer's new k, v [B, Hkv, T, hd]; return prefix + new [B, Hkv, S, hd] (a gathered copy).

        This is the contiguous cache's interface, for attention that wants one [B, Hkv, S, hd]
        tensor; it copies the prefix out of the blocks in every layer. Paged attention kernels
        skip the copy: ``store``, then read the pool through ``block_table()``."""
        if self._pending_slots is not None and self._pending_slots[1] is None:
            raise RuntimeError(f"write() returns one [B, Hkv, S, hd] tensor, but the sequences hold "
                               f"{[L + n for L, n in zip(self.lengths, self.pendings)]} tokens; use store() and "
                               "paged attention for a ragged batch")
        self.store(layer, k, v)
        blk, off = self._pending_slots[1]
        return (self.k_pool[layer, blk, :, off].transpose(1, 2),  # [B, S, Hkv, hd] -> [B, Hkv, S, hd]
                self.v_pool[layer, blk, :, off].transpose(1, 2))

    def read(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V [1, Hkv, n, hd] of sequence ``seq``: its committed tokens and those of
        the pending forward (a copy, what a ragged batch's attention reads sequence by sequence)."""
        if seq not in self._reads:  # the same slots in every layer of this forward
            self._reads[seq] = self._slots(seq, range(self.lengths[seq] + self.pendings[seq]))
        blk, off = self._reads[seq]
        return (self.k_pool[layer, blk, :, off].transpose(0, 1)[None],  # [n, Hkv, hd] -> [1, Hkv, n, hd]
                self.v_pool[layer, blk, :, off].transpose(0, 1)[None])

    def read_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V [R, Hkv, S, hd] of the pending forward's R rows at once (a copy), S = the most
        blocks of a row x ``block_size``: row r holds its sequence's blocks in order (its committed and pending
        tokens first), then repeats of its first block, whose entries past its own tokens the row's attention
        mask must hide (``RaggedPlan`` does). Whole blocks are gathered (one ``index_select`` per layer, where
        ``read`` gathers each row's tokens one by one), and K comes back as the transpose of a row-major
        [R, Hkv, hd, S], the layout the CPU's row-invariant attention reads."""
        if "rows" not in self._reads:  # the same blocks in every layer of this forward
            tables = [self.tables[s] or [0] for s in self.rows]
            nb = max(map(len, tables))
            self._reads["rows"] = len(tables), nb, torch.tensor([b for t in tables for b in t + t[:1] * (nb - len(t))],
                                                                device=self.k_pool.device)  # [R * nb] block ids
        R, nb, blocks = self._reads["rows"]
        _, Hkv, bs, hd = self.k_pool.shape[1:]
        k = self.k_pool[layer].index_select(0, blocks).view(R, nb, Hkv, bs, hd)
        v = self.v_pool[layer].index_select(0, blocks).view(R, nb, Hkv, bs, hd)
        kt = k.permute(0, 2, 4, 1, 3).reshape(R, Hkv, hd, nb * bs)  # [R, Hkv, hd, S] row-major
        return kt.transpose(-1, -2), v.transpose(1, 2).reshape(R, Hkv, nb * bs, hd)  # [R, Hkv, S, hd] both

    def gather(self, seq: int, pending: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The contiguous K and V [L, Hkv, n, hd] of sequence ``seq``: its committed tokens (and the
        pending ones too if ``pending``). A copy; for reference attention and tests."""
        n = self.lengths[seq] + (self.pendings[seq] if pending else 0)
        blk, off = self._slots(seq, range(n))
        return (self.k_pool[:, blk, :, off].permute(1, 2, 0, 3),  # [n, L, Hkv, hd] -> [L, Hkv, n, hd]
                self.v_pool[:, blk, :, off].permute(1, 2, 0, 3))

    def _slots(self, b: int, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """(block ids, offsets) [n] of token positions of sequence b."""
        dev = self.k_pool.device
        pos = torch.as_tensor(list(positions), dtype=torch.long, device=dev)  # [n]
        table = torch.tensor(self.tables[b] or [0], dtype=torch.long, device=dev)
        return table[pos // self.block_size], pos % self.block_size

    def block_table(self) -> torch.Tensor:
        """int32 [B, max blocks] block ids of every sequence, padded with -1 (never read)."""
        width = max(1, max(len(t) for t in self.tables))
        rows = [t + [-1] * (width - len(t)) for t in self.tables]
        return torch.tensor(rows, dtype=torch.int32, device=self.k_pool.device)

    # ------------------------------------------------------------------ the decode loop's side
    def commit(self, keep=None) -> None:
        """Keep pending entries: all (None), those at the given strictly increasing indices (0 = first
        new token; a draft tree's accepted path), or one such list (or None) per sequence (ragged
        acceptance). Kept entries move to contiguous slots; blocks left without a token return to the pool."""
        keeps = ragged_keeps(keep, self.pendings)  # every sequence validated before any changes
        for b, k in enumerate(keeps):
            L = self.lengths[b]
            if k != list(range(len(k))):  # compaction: the accepted path moves down to the next slots
                s_blk, s_off = self._slots(b, [L + i for i in k])
                d_blk, d_off = self._slots(b, range(L, L + len(k)))
                for pool in (self.k_pool, self.v_pool):
                    pool[:, d_blk, :, d_off] = pool[:, s_blk, :, s_off]  # [n, L, Hkv, hd], gathered before stored
            self.lengths[b] += len(k)
            self.pendings[b] = 0
            self._release_beyond(b, self.lengths[b])  # the blocks only rejected nodes padded
        self._pending_slots = None

    def discard(self) -> None:
        """Drop all pending entries (their blocks return to the pool)."""
        for b in range(self.batch_size):
            self.pendings[b] = 0
            self._release_beyond(b, self.lengths[b])
        self._pending_slots = None

    def rollback(self, n: int | Sequence[int]) -> None:
        """Forget the last n committed tokens (an int, or one count per sequence): O(1), no copy."""
        if self.pending:
            raise RuntimeError("commit() or discard() the pending entries before rolling back")
        for b, x in enumerate(ragged_rollback(n, self.lengths)):
            self.lengths[b] -= x
            self._release_beyond(b, self.lengths[b])

    def free(self, seq: int) -> None:
        """Sequence ``seq`` is finished: forget its tokens, its blocks return to the pool."""
        super().free(seq)
        self._release_beyond(seq, 0)

    def reset(self) -> None:
        """Free every sequence and drop anything pending."""
        self.pendings, self._pending_slots = [0] * self.batch_size, None
        for b in range(self.batch_size):
            self.lengths[b] = 0
            self._release_beyond(b, 0)

    def reserve(self, capacity: int) -> None:
        """Grow the pool (at least doubling) so that every sequence can hold ``capacity`` tokens."""
        need = sum(max(0, _cdiv(capacity, self.block_size) - len(t)) for t in self.tables)
        short = need - len(self.free_list)
        if short <= 0:
            return
        if self.pending:
            raise RuntimeError("commit() or discard() the pending entries before growing the cache")
        old = self.n_blocks
        new = max(old + short, 2 * old)
        for name in ("k_pool", "v_pool"):
            pool = getattr(self, name)
            buf = pool.new_zeros(pool.shape[0], new, *pool.shape[2:])  # [L, N', Hkv, bs, hd]
            buf[:, :old] = pool
            setattr(self, name, buf)
        self.free_list[:0] = range(new - 1, old - 1, -1)  # new blocks at the bottom of the stack
