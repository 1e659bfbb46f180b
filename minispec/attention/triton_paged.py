"""Paged prefix attention in Triton (chapter 7): split-k over a prefix read through a block table.

The twin of ``paged.paged_prefix_attention``. It is ``triton_split._prefix_kernel`` with one
change, the addressing of a prefix token (see ``_prefix_kv_rows`` there): token n of sequence b
is read from block ``table[b, n // PAGE]`` at slot ``n % PAGE`` of the pool [N, Hkv, PAGE, hd],
and each sequence stops at its own prefix length (a ragged batch). A key tile may span several
blocks: every token looks its block up, so the block size need not divide the tile.

    _paged_prefix_kernel  grid (B * Hkv, row blocks, splits); one program = the G query heads of
                          one KV head (each key tile loaded once for all of them), a block of
                          (head, token) rows, one chunk of the prefix: a partial (out, lse).

The splits are then merged by log-sum-exp in PyTorch (lse = logsumexp_i lse_i, out = sum_i
out_i exp(lse_i - lse)) and (out, lse) returned, ready for ``merge`` with the masked suffix.
The online softmax, query loads and partial stores are ``triton_split``'s own helpers.

Runs on CUDA and, with ``TRITON_INTERPRET=1`` set before triton is first imported, on CPU.

References: Kwon et al., "PagedAttention" (vLLM, 2023); Dao et al., "Flash-Decoding" (2023).

Shapes: B batch, H = G * Hkv query heads, T new tokens, N pool blocks, PAGE block size, W
block-table width, P prefix tokens (per sequence), NS splits, hd head dim.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import triton
import triton.language as tl

from .paged import check_paged
from .triton_split import LOG2E, _finish, _load_q, _online_softmax_step, _store_partial, num_splits_for, tile_config


@triton.jit
def _paged_prefix_kernel(Q, K, V, Tab, Lens, O, L, chunk, qk_scale, Hkv, G, T, PAGE,
                         sq_b, sq_h, sq_t, sk_blk, sk_h, sk_n, sv_blk, sv_h, sv_n, st_b,
                         so_b, so_h, so_s, so_t, sl_b, sl_h, sl_s,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    """Split ``split`` of sequence b's prefix, tokens [split * chunk, min((split + 1) * chunk, Lens[b])), no mask."""
    pid, split = tl.program_id(0), tl.program_id(2)
    b, hkv = (pid // Hkv).to(tl.int64), pid % Hkv
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] (g, t) rows
    d = tl.arange(0, BLOCK_D)
    q = _load_q(Q, b, hkv, rows, d, G, T, sq_b, sq_h, sq_t, HEAD_DIM)  # [BM, BD]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    start = split * chunk
    end = tl.minimum(start + chunk, tl.load(Lens + b))  # this sequence's own prefix length
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # [BN] token indices
        n_ok = n < end
        page = tl.load(Tab + b * st_b + n // PAGE, mask=n_ok, other=0).to(tl.int64)  # [BN] block of each token
        slot = (n % PAGE).to(tl.int64)  # [BN] its row in the block
        ld = n_ok[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(K + (page * sk_blk + hkv * sk_h + slot * sk_n)[:, None] + d[None, :], mask=ld, other=0.0)
        v = tl.load(V + (page * sv_blk + hkv * sv_h + slot * sv_n)[:, None] + d[None, :], mask=ld, other=0.0)
        visible = n_ok[None, :] & (rows >= 0)[:, None]  # [BM, BN]: no mask over the prefix
        m_i, l_i, acc = _online_softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale)
    out, lse = _finish(acc, m_i, l_i)
    _store_partial(O, L, out, lse, b, hkv, split, rows, d, G, T, so_b, so_h, so_s, so_t, sl_b, sl_h, sl_s, HEAD_DIM)


def paged_prefix_attention_triton(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                                  block_table: torch.Tensor, prefix_len: int | Sequence[int] | torch.Tensor,
                                  num_splits: int | None = None, block_m: int | None = None,
                                  block_n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged prefix attention with a Triton kernel; equals ``paged.paged_prefix_attention``.

    Args:
        q: [B, H, T, hd]; k_pool, v_pool: one layer's blocks [N, Hkv, bs, hd], head dim contiguous.
        block_table: int [B, W]; prefix_len: an int or one per sequence.
        num_splits: prefix splits (default: Flash-Decoding's heuristic, ``num_splits_for``).
        block_m, block_n: row and key tile sizes (default ``triton_split.tile_config``: the largest
            tiles that fit the device's shared memory; fp32 multiplies in IEEE precision, not TF32).
    Returns:
        out [B, H, T, hd] in q's dtype and lse [B, H, T] float32 (out 0, lse -inf where P = 0).
    """
    lens = check_paged(q, k_pool, v_pool, block_table, prefix_len)
    B, H, T, hd = q.shape
    Hkv, page = k_pool.shape[1], k_pool.shape[2]
    if not (q.device == k_pool.device == v_pool.device == block_table.device):
        raise ValueError(f"q, pools and block_table must be on one device, got {q.device}, {k_pool.device}, "
                         f"{v_pool.device}, {block_table.device}")
    q, k_pool, v_pool = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k_pool, v_pool))
    table = block_table.to(torch.int32).contiguous()
    lens_t = torch.tensor(lens, dtype=torch.int32, device=q.device)
    G, P = H // Hkv, max(lens)
    cfg = tile_config(q.dtype, hd, G * T, q.device, block_m, block_n)  # tiles that fit the device's shared memory
    row_blocks = triton.cdiv(G * T, cfg["BLOCK_M"])
    ns = num_splits or num_splits_for(P, B * Hkv * row_blocks, cfg["BLOCK_N"], q.device)
    chunk = triton.cdiv(triton.cdiv(P, ns), cfg["BLOCK_N"]) * cfg["BLOCK_N"]  # whole tiles per split
    parts_o = torch.empty(B, H, ns, T, hd, device=q.device, dtype=torch.float32)  # [B, H, NS, T, hd]
    parts_l = torch.empty(B, H, ns, T, device=q.device, dtype=torch.float32)  # [B, H, NS, T]
    so, sl = parts_o.stride(), parts_l.stride()
    _paged_prefix_kernel[(B * Hkv, row_blocks, ns)](
        q, k_pool, v_pool, table, lens_t, parts_o, parts_l, chunk, LOG2E / math.sqrt(hd), Hkv, G, T, page,
        q.stride(0), q.stride(1), q.stride(2), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), table.stride(0),
        so[0], so[1], so[2], so[3], sl[0], sl[1], sl[2],
        HEAD_DIM=hd, **cfg)
    lse = torch.logsumexp(parts_l, dim=2)  # [B, H, T]; -inf where every split is empty
    w = torch.exp(parts_l - torch.where(torch.isfinite(lse), lse, 0.0)[:, :, None])  # [B, H, NS, T]; 0 for empty splits
    out = (parts_o * w[..., None]).sum(2)  # [B, H, T, hd]
    return out.to(q.dtype), lse
