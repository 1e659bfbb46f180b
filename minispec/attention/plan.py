"""The attention plan of one forward: what every layer's attention needs, built once before the
forward runs, as nano-vllm's ``prepare_prefill`` / ``prepare_decode`` build their context
(positions, masks, the cache slots).

    prepare(B, T, device, kv, positions, mask)    a batch whose rows share one prefix: a prompt,
                                                  a decode step, a draft chain or tree
    prepare_ragged(R, T, device, kv, {seq: n})  a ragged batch on a paged cache (chapter 7):
                                                  each row has its own prefix, new tokens and tree
    cuda_graphs.static_plan(kv, positions, ...)   a forward on a static cache, built on the device
                                                  so that a CUDA graph can capture it (chapter 8)

Building the plan reserves the new tokens' slots in the cache (``kv.begin``), so that a forward
never runs out of room half way. ``Transformer.forward(tokens, plan=..., kv=...)`` then reads
top-down (embed, blocks, norm, head), and each attention layer hands its q, k, v to
``plan.attend``, which stores the new keys and values and attends the way the plan says: one
call for the whole batch (``Plan``) or one per row (``RaggedPlan``).

Shapes: B batch (R rows of a ragged batch), T new tokens, S = prefix + T keys, H query heads,
Hkv key/value heads, hd head dim, D model width.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import attend, causal_mask
from .invariant import MaskedKeys, masked_keys
from ..kv.protocol import KVCacheProtocol, RaggedKVCache


ROW_CALL_SCORES = 512  # what one row's own attention call costs beyond its scores, counted in (query, key) score
#                        entries: roughly 200 us a layer against 0.5 us an entry in one timing of SmolLM2's 9 heads
#                        on one thread of a 2-core AMD EPYC (a rough price; its effect on a whole batched decode is
#                        what benchmarks/row_vs_paged_kv.py --row-call-scores 0,512 measures). A ragged batch
#                        attends in one call, padded to its longest row, unless the padding
#                        costs more than the calls it saves (a ragged decode step: one call; prompts of very
#                        different lengths: row by row). Either way the same bits (RaggedPlan)


@dataclass
class Plan:
    """One attention call for the whole batch: every row sees the same committed prefix.

    positions: [B, T] position ids of the new tokens.
    mask: the dense backend's bool mask [B or 1, 1, T, S] (True = may attend), None for causal.
    tree: the split backends' [B or 1, T, T] mask among the new tokens when every new token sees
        the whole prefix (None: causal, or a mask that hides part of the prefix: dense then).
    """

    positions: torch.Tensor
    mask: torch.Tensor | None = None
    tree: torch.Tensor | None = None
    keys: MaskedKeys | None = field(default=None, init=False, repr=False)  # the mask worked out once (CPU dense)

    def attend(self, backend: str, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv: KVCacheProtocol | None) -> torch.Tensor:
        """q [B, H, T, hd], the new k, v [B, Hkv, T, hd] -> [B, H, T, hd], the new k, v stored in ``kv``."""
        if kv is not None:
            k, v = kv.write(layer, k, v)  # [B, Hkv, S, hd] committed prefix + new
        # dense: one pass with the full mask; split_*: mask-free prefix + masked tree, merged by log-sum-exp
        return attend(backend, q, k, v, k.shape[2] - q.shape[2], self.tree, self.masked(backend, q))

    def masked(self, backend: str, q: torch.Tensor) -> torch.Tensor | MaskedKeys | None:
        """The mask as ``attend`` takes it: on the CPU's dense path, its ``masked_keys``, worked out by the first
        layer for all (the hidden keys and key blocks are the same in every layer); elsewhere the mask."""
        if self.mask is None or backend != "dense" or q.device.type != "cpu":
            return self.mask
        if self.keys is None or self.keys.mask is not self.mask:
            self.keys = masked_keys(self.mask)
        return self.keys

    def with_keys(self) -> "Plan":
        """Work out a CPU mask's ``masked_keys`` now rather than in the first layer: past 128 keys that reads the
        mask on the host, which a forward traced by ``torch.compile`` cannot do without breaking its graph, so a
        plan built before the traced call does it here. Returns the plan."""
        if self.mask is not None and self.mask.device.type == "cpu":
            self.keys = masked_keys(self.mask)
        return self

    def last(self, h: torch.Tensor) -> torch.Tensor:
        """Each row's last new token: h [B, T, D] -> [B, 1, D] (a prefill's LM head)."""
        return h[:, -1:]


@dataclass
class Row:
    """One row of a ragged batch: its sequence in the paged cache, its n new tokens (the first n
    of the row; the rest is padding) and its own ``Plan`` masks, as its forward alone builds them."""

    seq: int
    n: int
    tree: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass
class RaggedPlan(Plan):
    """A ragged batch: the linear layers run on all rows at once (row-invariant, ``minispec.linear``), and so
    does dense attention: every row reads its own sequence (``kv.read_rows``: its prefix and new tokens, then
    entries its row of ``mask`` hides, up to the longest row), which on the CPU computes, bit for bit, what
    the row's forward alone computes (``invariant.invariant_attention``: hidden keys add exact zeros, the
    regime its probe checks). The split backends, whose prefix is one length for the whole batch, attend
    row by row, and so does dense attention where padding the rows to the longest would cost more than the
    per-row calls it saves (``ROW_CALL_SCORES``: a prefill of prompts of very different lengths). A padding
    token's output is meaningless.

    mask: the dense backend's [R, 1, T, S] mask over the rows' keys (None: row by row), extended with hidden
        keys to the S' keys ``read_rows`` returns on first use.
    """

    rows: list[Row] = field(default_factory=list)

    def attend(self, backend, layer, q, k, v, kv: RaggedKVCache) -> torch.Tensor:
        kv.store(layer, k, v)  # row r's first n_r tokens into its sequence's blocks
        if self.mask is not None and backend == "dense":
            k_all, v_all = kv.read_rows(layer)  # [R, Hkv, S', hd], S' >= S: the keys past S are hidden too
            if self.mask.shape[-1] != k_all.shape[2]:
                self.mask = F.pad(self.mask, (0, k_all.shape[2] - self.mask.shape[-1]), value=False)
            return attend(backend, q, k_all, v_all, 0, None, self.masked(backend, q))
        out = torch.zeros_like(q)  # [R, H, T, hd]; a row's padding stays 0
        for r, row in enumerate(self.rows):
            k_r, v_r = kv.read(layer, row.seq)  # [1, Hkv, prefix_r + n_r, hd]
            out[r, :, :row.n] = attend(backend, q[r:r + 1, :, :row.n], k_r, v_r, k_r.shape[2] - row.n,
                                       row.tree, row.mask)[0]
        return out

    def last(self, h: torch.Tensor) -> torch.Tensor:
        """Each row's n-th token: h [R, T, D] -> [R, 1, D]."""
        last = torch.tensor([row.n - 1 for row in self.rows], device=h.device)
        return h[torch.arange(h.shape[0], device=h.device), last][:, None]


def prepare(B: int, T: int, device, kv: KVCacheProtocol | None = None, positions: torch.Tensor | None = None,
            mask: torch.Tensor | None = None, backend: str = "dense", context: int | None = None) -> Plan:
    """The plan of a forward of T new tokens in each of B rows after ``kv``'s committed prefix.

    Args:
        kv: the cache (None: no prefix, nothing stored); its pending slots are reserved here.
        positions: [B, T] or [T] position ids; default prefix + arange(T).
        mask: None for causal, or bool (True = may attend) [T, T] / [B, T, T] among the new tokens
            (the committed prefix is always visible), or [T, S] / [B, T, S] over prefix + new keys.
        backend: the attention backend the plan is for (dense builds its causal mask here, once).
        context: positions must stay below it (the model's context length); None: unchecked.
    Raises:
        ValueError (a mask or position that does not fit), the cache's own error when it lacks room.
    """
    prefix = kv.length if kv is not None else 0
    if positions is None:
        positions = torch.arange(prefix, prefix + T, device=device)
    tree, mask = mask_pair(mask, B, T, prefix, device, backend)
    positions = positions.expand(B, T) if positions.dim() == 1 else positions
    check_context(positions, context)
    if kv is not None:
        kv.begin(B, T)  # raises on overflow before anything is written
    return Plan(positions, mask, tree)


def _stores_rows(kv) -> bool:
    """``isinstance(kv, RaggedKVCache)`` without reading the cache's properties: on Python 3.11 a
    protocol check calls ``hasattr`` on every member, and a ragged cache's ``length`` raises (its
    sequences have no single length)."""
    return all(callable(getattr(type(kv), m, None)) for m in ("store", "read")) and hasattr(kv, "lengths")


def prepare_ragged(B: int, T: int, device, kv: RaggedKVCache, ragged: dict[int, int], positions: torch.Tensor | None = None,
                   masks: list | None = None, backend: str = "dense", context: int | None = None) -> RaggedPlan:
    """The plan of a ragged batch (chapter 7): ``ragged = {sequence in kv: its n new tokens}`` in row
    order, the tokens right-padded to [B, T].

    Args:
        kv: a paged cache (``RaggedKVCache``); every sequence's new slots are reserved here.
        positions: [R, T]; default each sequence's length + arange(T).
        masks: None (every row causal) or one entry per row: None or a bool [n, n] tree mask.
    """
    seqs, ns = list(ragged), [int(n) for n in ragged.values()]
    if not _stores_rows(kv):
        raise TypeError("a ragged batch needs a paged KV cache (minispec.kv.PagedKVCache)")
    if len(seqs) != B or not all(1 <= n <= T for n in ns):
        raise ValueError(f"ragged={ragged} must give 1..{T} new tokens for each of the {B} rows")
    row_masks = [None] * B if masks is None else list(masks)
    if len(row_masks) != B:
        raise ValueError(f"a ragged batch takes one mask (or None) per row, got {len(row_masks)} for {B} rows")
    prefix = [kv.lengths[s] for s in seqs]
    if positions is None:
        positions = torch.tensor(prefix, device=device)[:, None] + torch.arange(T, device=device)  # [R, T]
    rows = [Row(s, n, *mask_pair(m, 1, n, p, device, backend)) for s, n, m, p in zip(seqs, ns, row_masks, prefix)]
    check_context(positions, context)
    kv.begin(B, ragged)
    S = max(p + n for p, n in zip(prefix, ns))
    scores = sum(n * (p + n) for p, n in zip(prefix, ns))  # (query, key) pairs the rows' own forwards compute
    one_call = backend == "dense" and B > 1 and B * T * S <= 2 * scores + B * ROW_CALL_SCORES
    return RaggedPlan(positions, ragged_mask(rows, prefix, T, S, device) if one_call else None, rows=rows)


def ragged_mask(rows: list[Row], prefix: list[int], T: int, S: int, device) -> torch.Tensor:
    """The [R, 1, T, S] mask of a ragged batch's rows over ``read_rows``' keys (S = the longest prefix + n):
    row r's queries see what its own forward shows them (its ``Row.mask``, or every key of one new token,
    or causal), nothing past its own keys; a padding query sees its row's first key (its output is dropped)."""
    mask = torch.zeros(len(rows), 1, T, S, dtype=torch.bool, device=device)
    for r, (p, row) in enumerate(zip(prefix, rows)):
        n = row.n
        mask[r, 0, :n, :p + n] = row.mask[0, 0] if row.mask is not None else causal_mask(n, p + n, device)
        mask[r, 0, n:, 0] = True
    return mask


def check_context(positions: torch.Tensor, context: int | None) -> None:
    """ValueError when a position reaches ``context`` (reads the positions on the host)."""
    if context is not None and int(positions.max()) >= context:
        raise ValueError(f"position {int(positions.max())} is beyond the model's context of {context} tokens")


def mask_pair(mask: torch.Tensor | None, B: int, T: int, prefix: int, device,
          backend: str = "dense") -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(tree, mask): the split backends' [B or 1, T, T] suffix mask when the whole prefix is
    visible (else None), and the dense [B, 1, T, S] mask (None: plain causal)."""
    tree = None
    if mask is None and T > 1 and prefix and backend == "dense":
        mask = causal_mask(T, prefix + T, device)  # [T, S] built once, not in every layer
    if mask is not None:
        tree = (mask if mask.dim() == 3 else mask[None]) if mask.shape[-1] == T else None
        mask = full_mask(mask, B, T, prefix)
    return tree, mask


def full_mask(mask: torch.Tensor, B: int, T: int, prefix: int) -> torch.Tensor:
    """Bring a boolean mask to [B, 1, T, prefix + T] for the dense backend."""
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be boolean (True = may attend), got {mask.dtype}")
    mask = mask if mask.dim() == 3 else mask[None]  # [B or 1, T, T or S]
    if mask.shape[-2] != T or mask.shape[-1] not in (T, prefix + T):
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not fit {T} new tokens after a prefix of {prefix}")
    if mask.shape[-1] == T and prefix:
        seen = torch.ones(*mask.shape[:-1], prefix, dtype=torch.bool, device=mask.device)
        mask = torch.cat([seen, mask], dim=-1)  # [B, T, S]
    return mask.expand(B, T, prefix + T)[:, None]  # [B, 1, T, S]
