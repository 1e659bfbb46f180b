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
``plan.attend(layer, q, k, v, kv)``, which stores the new keys and values and calls the plan's
attention backend (``minispec.attention``): once for the whole batch (``Plan``) or once per row
(``RaggedPlan``).

Shapes: B batch (R rows of a ragged batch), T new tokens, S = prefix + T keys, H query heads,
Hkv key/value heads, hd head dim, D model width.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import BACKENDS, SPLIT, Backend, causal_mask
from ..kv.protocol import KVCacheProtocol, RaggedKVCache


ROW_CALL_SCORES = 512  # what one row's own attention call costs beyond its scores, counted in (query, key) score
#                        entries (a rough price; its effect on a whole batched decode is what
#                        benchmarks/row_vs_paged_kv.py --row-call-scores 0,512 measures). A ragged batch
#                        attends in one call, padded to its longest row, unless the padding
#                        costs more than the calls it saves (a ragged decode step: one call; prompts of very
#                        different lengths: row by row). Either way the same bits (RaggedPlan)


@dataclass
class Plan:
    """One attention call for the whole batch: every row sees the same committed prefix.

    positions: [B, T] position ids of the new tokens.
    mask: [B or 1, 1, T, S] bool (True = may attend) over prefix + new keys, None for causal (a one-token
        step, or a split backend's plan: built once here for every layer otherwise, ``mask_pair``).
    tree: the split backends' [B or 1, T, T] mask among the new tokens when every new token sees
        the whole prefix (None: causal, or a mask that hides part of the prefix).
    attention: the backend function (``minispec.attention.BACKENDS``); a plan built without one
        (``cuda_graphs.static_plan``) takes the model's when the forward starts.
    memo: what a backend works out once per forward and every layer reuses (e.g. from the mask).
    """

    positions: torch.Tensor
    mask: torch.Tensor | None = None
    tree: torch.Tensor | None = None
    attention: Backend | None = None
    memo: dict = field(default_factory=dict, repr=False)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv: KVCacheProtocol | None) -> torch.Tensor:
        """q [B, H, T, hd], the new k, v [B, Hkv, T, hd] -> [B, H, T, hd], the new k, v stored in ``kv``."""
        if kv is not None:
            k, v = kv.write(layer, k, v)  # [B, Hkv, S, hd] committed prefix + new
        return self.attention(q, k, v, self)

    def use(self, attention: Backend) -> "Plan":
        """Give a plan built without a backend (``backend=None``: a static plan, or ``prepare`` called without
        one) the model's, when its forward starts. Returns the plan."""
        self.attention = attention
        return self

    def last(self, h: torch.Tensor) -> torch.Tensor:
        """Each row's last new token: h [B, T, D] -> [B, 1, D] (a prefill's LM head)."""
        return h[:, -1:]


@dataclass
class Row:
    """One row of a ragged batch: its sequence in the paged cache, its n new tokens (the first n
    of the row; the rest is padding) and its own ``Plan``, as its forward alone would build it."""

    seq: int
    n: int
    plan: Plan


@dataclass
class RaggedPlan(Plan):
    """A ragged batch: the linear layers run on all rows at once, and so does an attention backend that takes a
    full mask (not a split one): every row reads its own sequence (``kv.read_rows``: its prefix and new tokens,
    then entries its row of ``mask`` hides, up to the longest row). With the exact backend that computes, bit
    for bit, what the row's forward alone computes (``minispec.exact``: hidden keys add exact zeros). The split
    backends, whose prefix is one length for the whole batch, attend row by row, and so does every backend
    where padding the rows to the longest would cost more than the per-row calls it saves (``ROW_CALL_SCORES``:
    a prefill of prompts of very different lengths). A padding token's output is meaningless.

    mask: the [R, 1, T, S] mask over the rows' keys (None: row by row), extended with hidden keys to the S' keys
        ``read_rows`` returns on first use.
    """

    rows: list[Row] = field(default_factory=list)

    def use(self, attention: Backend) -> "RaggedPlan":
        for row in self.rows:
            row.plan.attention = row.plan.attention or attention
        return super().use(attention)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: RaggedKVCache) -> torch.Tensor:
        kv.store(layer, k, v)  # row r's first n_r tokens into its sequence's blocks
        if self.mask is not None:
            k_all, v_all = kv.read_rows(layer)  # [R, Hkv, S', hd], S' >= S: the keys past S are hidden too
            if self.mask.shape[-1] != k_all.shape[2]:
                self.mask = F.pad(self.mask, (0, k_all.shape[2] - self.mask.shape[-1]), value=False)
            return self.attention(q, k_all, v_all, self)
        out = torch.zeros_like(q)  # [R, H, T, hd]; a row's padding stays 0
        for r, row in enumerate(self.rows):
            k_r, v_r = kv.read(layer, row.seq)  # [1, Hkv, prefix_r + n_r, hd]
            out[r, :, :row.n] = row.plan.attention(q[r:r + 1, :, :row.n], k_r, v_r, row.plan)[0]
        return out

    def last(self, h: torch.Tensor) -> torch.Tensor:
        """Each row's n-th token: h [R, T, D] -> [R, 1, D]."""
        last = torch.tensor([row.n - 1 for row in self.rows], device=h.device)
        return h[torch.arange(h.shape[0], device=h.device), last][:, None]


def prepare(B: int, T: int, device, kv: KVCacheProtocol | None = None, positions: torch.Tensor | None = None,
            mask: torch.Tensor | None = None, backend: str | None = None, context: int | None = None) -> Plan:
    """The plan of a forward of T new tokens in each of B rows after ``kv``'s committed prefix.

    Args:
        kv: the cache (None: no prefix, nothing stored); its pending slots are reserved here.
        positions: [B, T] or [T] position ids; default prefix + arange(T).
        mask: None for causal, or bool (True = may attend) [T, T] / [B, T, T] among the new tokens
            (the committed prefix is always visible), or [T, S] / [B, T, S] over prefix + new keys.
        backend: the attention backend's name (``minispec.attention.BACKENDS``); None: the model's, given when
            its forward starts (``Plan.use``).
        context: positions must stay below it (the model's context length); None: unchecked.
    Raises:
        ValueError (a mask or position that does not fit), the cache's own error when it lacks room.
    """
    prefix = kv.length if kv is not None else 0
    if positions is None:
        positions = torch.arange(prefix, prefix + T, device=device)
    tree, mask = mask_pair(mask, B, T, prefix, device, backend in SPLIT)
    positions = positions.expand(B, T) if positions.dim() == 1 else positions
    check_context(positions, context)
    if kv is not None:
        kv.begin(B, T)  # raises on overflow before anything is written
    return Plan(positions, mask, tree, BACKENDS[backend] if backend else None)


def head_plan(plan: Plan | None, backend: str, B: int, T: int, device, kv: KVCacheProtocol | None = None,
              positions: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> Plan:
    """A drafter head's plan: ``plan`` as given (a graphed draft's static plan, which takes the head's
    ``backend`` here where it names none), else ``prepare``'s for these new tokens."""
    if plan is None:
        return prepare(B, T, device, kv, positions, mask, backend)
    return plan.use(BACKENDS[backend]) if plan.attention is None else plan


def _stores_rows(kv) -> bool:
    """``isinstance(kv, RaggedKVCache)`` without reading the cache's properties: on Python 3.11 a
    protocol check calls ``hasattr`` on every member, and a ragged cache's ``length`` raises (its
    sequences have no single length)."""
    return all(callable(getattr(type(kv), m, None)) for m in ("store", "read")) and hasattr(kv, "lengths")


def prepare_ragged(B: int, T: int, device, kv: RaggedKVCache, ragged: dict[int, int], positions: torch.Tensor | None = None,
                   masks: list | None = None, backend: str | None = None, context: int | None = None) -> RaggedPlan:
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
    attention = BACKENDS[backend] if backend else None  # None: the model's, when its forward starts
    rows = [Row(s, n, Plan(positions[r:r + 1, :n], *mask_pair(m, 1, n, p, device, backend in SPLIT)[::-1], attention))
            for r, (s, n, m, p) in enumerate(zip(seqs, ns, row_masks, prefix))]
    check_context(positions, context)
    kv.begin(B, ragged)
    S = max(p + n for p, n in zip(prefix, ns))
    scores = sum(n * (p + n) for p, n in zip(prefix, ns))  # (query, key) pairs the rows' own forwards compute
    one_call = backend not in SPLIT and B > 1 and B * T * S <= 2 * scores + B * ROW_CALL_SCORES
    return RaggedPlan(positions, ragged_mask(rows, prefix, T, S, device) if one_call else None, attention=attention,
                      rows=rows)


def ragged_mask(rows: list[Row], prefix: list[int], T: int, S: int, device) -> torch.Tensor:
    """The [R, 1, T, S] mask of a ragged batch's rows over ``read_rows``' keys (S = the longest prefix + n):
    row r's queries see what its own forward shows them (its ``Row.mask``, or every key of one new token,
    or causal), nothing past its own keys; a padding query sees its row's first key (its output is dropped)."""
    mask = torch.zeros(len(rows), 1, T, S, dtype=torch.bool, device=device)
    for r, (p, row) in enumerate(zip(prefix, rows)):
        n = row.n
        mask[r, 0, :n, :p + n] = row.plan.mask[0, 0] if row.plan.mask is not None else causal_mask(n, p + n, device)
        mask[r, 0, n:, 0] = True
    return mask


def check_context(positions: torch.Tensor, context: int | None) -> None:
    """ValueError when a position reaches ``context`` (reads the positions on the host)."""
    if context is not None and int(positions.max()) >= context:
        raise ValueError(f"position {int(positions.max())} is beyond the model's context of {context} tokens")


def mask_pair(mask: torch.Tensor | None, B: int, T: int, prefix: int, device,
              split: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(tree, mask): the split backends' [B or 1, T, T] suffix mask when the whole prefix is
    visible (else None), and the full [B, 1, T, S] mask (None: plain causal; built here, once for
    every layer, for a backend that is not ``split`` when T > 1 new tokens follow a prefix)."""
    tree = None
    if mask is None and T > 1 and prefix and not split:
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
