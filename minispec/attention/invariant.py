"""Row-invariant attention: each query row's result does not depend on how many rows or keys come with it.

Why: greedy speculative decoding is exact only if the target's logits for a verified token
equal, bit for bit, the logits vanilla decoding computes for it. Vanilla sends one row per
step; verification sends the root and N draft tokens at once, over a cache that is longer by
the tree. A fused attention kernel (PyTorch's CPU SDPA, for instance) blocks its reductions
over keys and queries by sizes that depend on how many there are, so the same row reduces in
a different order (different rounding, ~1e-7 here, ~1e-5 after 30 layers) as the row count
changes, and an argmax near-tie can flip. Batch-invariant inference (He and Thinking Machines,
"Defeating Nondeterminism in LLM Inference", 2025; vLLM's and SGLang's batch-invariant modes)
fixes the order of every reduction; this is that idea for one attention step, in plain PyTorch:

    s   = (q @ k^T) / sqrt(hd)                      a dot product over hd per (row, key), scaled in
                                                    the same product; k^T is row-major (the CPU
                                                    cache stores keys last)
    s   = -inf where the mask hides a key
    m   = max over keys of s                        max is exact in any order
    p   = exp(s - m)                                elementwise; a hidden key gives exactly 0
    o   = p @ v,  l = p @ 1                         numerator and denominator by matrix products
                                                    whose reductions run along the keys in key
                                                    order: a hidden key adds an exact 0 wherever
                                                    it sits (``l`` takes 16 columns of ones: one
                                                    column would be a matrix-vector product, whose
                                                    kernel sums in lanes by key position)
    out = o / l

so the visible keys of a row (the committed prefix, then the row's tree ancestors in tree
order, then itself: the very keys vanilla sees for that token) are summed in the same order
whatever else is in the batch. What this relies on: a matrix product of two row-major operands
computes each element the same way whatever the other rows and columns hold and however many
there are, so a hidden key's exact zero leaves the sum of the others as it was. Measured
exceptions, each avoided here: one row or one column (a matrix-vector kernel: one query row is
padded to two, one key to two), a column-major operand (other kernels, whose result for a row
depends on its place among few rows: the keys are read as a row-major k^T, which the CPU KV
cache stores as such, ``kv.contiguous.zeros_keys_last``), and in PyTorch's CPU ``bmm``
products under 400 multiply-adds (a loop kernel of its own: rows are padded up). ``tests/test_invariance.py`` checks the property on random shapes and trees on
whatever CPU runs the tests; ``python -m minispec check-env`` reports it for this machine.

The cost over a fused kernel is the score matrix [rows, S] in memory (small while decoding;
a long prefill is chunked by rows, which changes nothing since rows are independent).

Shapes: B batch, H query heads, Hkv KV heads, G = H / Hkv, T query rows, S keys, hd head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .reference import check_shapes

MIN_ROWS = 2  # products over fewer query rows go to a matrix-vector kernel with its own order
BMM_NAIVE_BELOW = 400  # PyTorch's CPU bmm runs products with rows * cols * inner < 400 in a loop kernel of
#                        its own, with another order than its BLAS path: pad rows to stay above it
ONES_COLS = 16  # columns of the ones matrix that sums p (so that it is a matrix product too)
ROW_CHUNK = 2048  # query rows (g, t) per product: bounds the score matrix of a long prefill


def invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention whose every row is computed as it would be alone.

    Args:
        q: [B, H, T, hd] queries; k, v: [B, Hkv, S, hd] keys and values.
        mask: bool (True = may attend) of shape [T, S] or [B or 1, 1, T, S], or None: causal with
            the T queries at the last T key positions (every key visible when T = 1).
    Returns:
        [B, H, T, hd] in q's dtype. Every row must see at least one key.
    """
    B, H, Hkv, T, hd = check_shapes(q, k, v)
    S, G = k.shape[2], H // Hkv
    if mask is None and T > 1:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)  # [T, S]
    hidden = None
    if mask is not None:
        if mask.dtype != torch.bool or mask.shape[-2:] != (T, S) or mask.dim() not in (2, 4):
            raise ValueError(f"mask must be boolean [{T}, {S}] or [B or 1, 1, {T}, {S}], got {mask.dtype} "
                             f"{tuple(mask.shape)}")
        hidden = ~(mask if mask.dim() == 4 else mask[None, None])[:, :, None]  # [B or 1, 1, 1, T, S]
    qg = q.reshape(B, Hkv, G * T, hd)  # the G query heads of a KV head as rows (g, t)
    if G * T <= ROW_CHUNK:
        out = _rows(qg, k, v, hidden, G, T)
    else:  # a long prefill: rows are independent, so chunks change no bit
        t_chunk = max(1, ROW_CHUNK // G)
        out = torch.cat([_rows(qg.unflatten(2, (G, T))[:, :, :, t0:t0 + t_chunk].flatten(2, 3), k, v,
                               None if hidden is None else hidden[..., t0:t0 + t_chunk, :], G,
                               min(t_chunk, T - t0)).unflatten(2, (G, -1)) for t0 in range(0, T, t_chunk)], dim=3)
    return out.reshape(B, H, T, hd)


_ONES: dict[tuple, torch.Tensor] = {}  # cache: (dtype, device) -> the largest [n, ONES_COLS] ones made so far


def _ones(S: int, like: torch.Tensor) -> torch.Tensor:
    """[S, ONES_COLS] ones of ``like``'s dtype and device (a view of a cached, never written buffer)."""
    key = (like.dtype, like.device)
    if key not in _ONES or _ONES[key].shape[0] < S:
        with torch.inference_mode(False), torch.no_grad():
            _ONES[key] = torch.ones(max(S, 2 * _ONES[key].shape[0] if key in _ONES else 1024), ONES_COLS,
                                    dtype=like.dtype, device=like.device)
    return _ONES[key][:S]


def _rows(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor | None, G: int,
          T: int) -> torch.Tensor:
    """Attention of the query rows qg [B, Hkv, G*T, hd] (rows (g, t)) -> [B, Hkv, G*T, hd].

    Every product has two row-major operands, at least two rows and two columns, and at least
    BMM_NAIVE_BELOW multiply-adds: the regime in which a BLAS computes an element the same way
    whatever the other rows and columns are (``tests/test_invariance.py``).
    """
    B, Hkv, R, hd = qg.shape
    if k.shape[2] < MIN_ROWS:  # one key (a one-token prompt): add a hidden zero key
        k, v = F.pad(k, (0, 0, 0, MIN_ROWS - k.shape[2])), F.pad(v, (0, 0, 0, MIN_ROWS - v.shape[2]))
        hidden = F.pad(hidden if hidden is not None else torch.zeros(1, 1, 1, T, 1, dtype=torch.bool, device=k.device),
                       (0, MIN_ROWS - 1), value=True)
    S = k.shape[2]
    need = max(MIN_ROWS, -(-BMM_NAIVE_BELOW // (S * min(hd, ONES_COLS))))  # rows every product below needs
    if R < need:  # pad with zero queries; their results are dropped
        qg = F.pad(qg, (0, 0, 0, need - R))
    kt = k.transpose(-1, -2)  # [B, Hkv, hd, S]: row-major when the cache stores keys last (KVCache on the CPU)
    if kt.stride(-1) != 1:
        kt = kt.contiguous()  # a copy of the keys, for any other layout
    R2, S_ = qg.shape[2], kt.shape[-1]
    s = torch.baddbmm(qg.new_empty(B * Hkv, R2, S_), qg.reshape(B * Hkv, R2, hd), kt.reshape(B * Hkv, hd, S_),
                      beta=0, alpha=1.0 / math.sqrt(hd)).view(B, Hkv, R2, S_)  # [B, Hkv, R', S]: (q k^T) / sqrt(hd)
    if hidden is not None:  # view the first G*T rows as [G, T] so the [., 1, 1, T, S] mask broadcasts
        s[:, :, :R].unflatten(2, (G, T)).masked_fill_(hidden, float("-inf"))
    if torch.is_grad_enabled() and s.requires_grad:  # training (a draft model): autograd keeps s
        p = torch.exp(s - s.amax(dim=-1, keepdim=True))
    else:
        p = s.sub_(s.amax(dim=-1, keepdim=True)).exp_()  # [B, Hkv, R', S]; hidden keys exactly 0
    o, l = torch.matmul(p, v), torch.matmul(p, _ones(S, v))  # [., R', hd], [., R', 16]: sums in key order
    return (o / l[..., :1])[:, :, :R]
