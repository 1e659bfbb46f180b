"""Paged attention in plain PyTorch (chapter 7): the prefix part of split tree attention, read
through a block table.

A paged KV cache (``minispec.kv.PagedKVCache``) keeps one layer's keys in a pool
[N, Hkv, bs, hd] of N blocks of bs token slots; sequence b's token n sits in block
``block_table[b, n // bs]`` at slot ``n % bs``. Split tree attention (``reference.py``) needs
the prefix only in its mask-free part, so paging changes one function: ``prefix_attention``
reads its keys and values through the table, and each sequence of a ragged batch has its own
prefix length. The tree part is unchanged (``suffix_attention`` on the new tokens' k, v, which
the model still holds) and the two are joined by the same log-sum-exp ``merge``:

    out_p, lse_p = paged_prefix_attention(q, k_pool, v_pool, block_table, prefix_lens)
    out_s, lse_s = suffix_attention(q, k_new, v_new, tree_mask)
    out = merge(out_p, lse_p, out_s, lse_s)          # = paged_split_attention(...)

This reference gathers each sequence's prefix into a contiguous tensor (a copy) and calls
``prefix_attention``; the Triton twin (``triton_paged.py``) looks the blocks up inside the kernel.

Reference: Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention" (vLLM, 2023).

Shapes: B batch, H = G * Hkv query heads, T new (tree) tokens, N pool blocks, bs block size,
W block-table width, P prefix tokens (per sequence), hd head dim.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .reference import merge, prefix_attention, suffix_attention


def check_paged(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                prefix_len: int | Sequence[int] | torch.Tensor) -> list[int]:
    """Validate q [B, H, T, hd], pools [N, Hkv, bs, hd], block_table [B, W]; return the B prefix lengths."""
    if q.dim() != 4 or k_pool.dim() != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(f"q must be [B, H, T, hd] and the pools one layer's [N, Hkv, bs, hd] blocks, got "
                         f"{tuple(q.shape)}, {tuple(k_pool.shape)}, {tuple(v_pool.shape)}")
    B, H, T, hd = q.shape
    N, Hkv, bs, _ = k_pool.shape
    if k_pool.shape[3] != hd or H % Hkv:
        raise ValueError(f"pool {tuple(k_pool.shape)} does not fit q {tuple(q.shape)}: head dims must match and "
                         f"{H} query heads be a multiple of {Hkv} KV heads")
    if block_table.dim() != 2 or block_table.shape[0] != B or block_table.is_floating_point():
        raise ValueError(f"block_table must be an integer [B={B}, W] tensor, got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    lens = [int(p) for p in (prefix_len.tolist() if torch.is_tensor(prefix_len) else
                             prefix_len if isinstance(prefix_len, (list, tuple)) else [prefix_len] * B)]
    room = block_table.shape[1] * bs
    if len(lens) != B or any(not 0 <= p <= room for p in lens):
        raise ValueError(f"prefix lengths {lens} must be {B} values in [0, {room}] (block table of "
                         f"{block_table.shape[1]} blocks of {bs} tokens)")
    return lens


def gather_paged(pool: torch.Tensor, table_row: torch.Tensor, n: int) -> torch.Tensor:
    """The first n tokens of one sequence, contiguous: pool [N, Hkv, bs, hd], table_row [W] -> [Hkv, n, hd]."""
    bs = pool.shape[2]
    pos = torch.arange(n, device=pool.device)
    blocks = table_row.to(pool.device).long()[pos // bs]  # [n] block of each token
    return pool[blocks, :, pos % bs].transpose(0, 1)  # [n, Hkv, hd] -> [Hkv, n, hd]


def paged_prefix_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                           prefix_len: int | Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query over its sequence's whole prefix, read through the block table; no mask.

    Args:
        q: [B, H, T, hd].
        k_pool, v_pool: one layer's blocks [N, Hkv, bs, hd] (``PagedKVCache.k_pool[layer]``).
        block_table: int [B, W], row b = sequence b's blocks in order (entries past its prefix unread).
        prefix_len: P, an int or one per sequence (a ragged batch; 0 allowed).
    Returns:
        out [B, H, T, hd] (q's dtype; zeros where P = 0) and lse [B, H, T] float32 (-inf where P = 0),
        equal to ``prefix_attention`` on each sequence's gathered prefix.
    """
    lens = check_paged(q, k_pool, v_pool, block_table, prefix_len)
    outs, lses = [], []
    for b, P in enumerate(lens):  # one sequence at a time: each has its own prefix length
        k = gather_paged(k_pool, block_table[b], P)[None]  # [1, Hkv, P, hd]
        v = gather_paged(v_pool, block_table[b], P)[None]
        out, lse = prefix_attention(q[b:b + 1], k, v)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)  # [B, H, T, hd], [B, H, T]


def paged_split_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                          k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                          prefix_len: int | Sequence[int] | torch.Tensor,
                          tree_mask: torch.Tensor | None) -> torch.Tensor:
    """Tree attention with the prefix in a paged cache: paged prefix + masked suffix, merged by log-sum-exp.

    Args:
        q: [B, H, T, hd]; k_new, v_new: [B, Hkv, T, hd] the new (tree) tokens' keys / values.
        k_pool, v_pool, block_table, prefix_len: the committed prefix, as in ``paged_prefix_attention``.
        tree_mask: bool [T, T] / [B or 1, T, T] among the new tokens, or None for causal.
    Returns:
        [B, H, T, hd], equal to ``split_attention`` over each sequence's gathered prefix + new tokens.
    """
    out_p, lse_p = paged_prefix_attention(q, k_pool, v_pool, block_table, prefix_len)
    out_s, lse_s = suffix_attention(q, k_new, v_new, tree_mask)
    return merge(out_p, lse_p, out_s, lse_s)
