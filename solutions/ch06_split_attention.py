"""Chapter 6 exercises: split tree attention, in plain PyTorch.

A verify step's T tree tokens attend to a long committed prefix (every tree token sees all of
it: no mask) and to the tree itself (the ancestor mask). Computing the two parts separately
and merging them by log-sum-exp is exact; it lets the prefix, where the memory traffic is,
run mask-free and split along the keys (Flash-Decoding), and the small T x T part carry the mask.

References:
    Dao et al., "FlashAttention" (2022): the online softmax over key tiles.
    Dao et al., "Flash-Decoding for long-context inference" (2023): split-k + log-sum-exp merge.
    Miao et al., "SpecInfer" (2023): tree attention masks.

Notation: scores s = q k^T / sqrt(hd); lse = log sum_j exp(s_j) (natural log) per query row;
out = softmax(s) v. A row that sees no key has lse = -inf and out = 0. Work in the inputs'
dtype (the grader uses float64).

Exercise 6.5 is a Triton kernel (the merge of 6.1, one program per block of rows). Without a GPU
it runs in Triton's interpreter on CPU tensors: this file switches it on before ``@triton.jit``
runs, unless TRITON_INTERPRET is already set.

Check your work: ``python -m minispec grade 6``, or ``minispec.grading.check("6.1")``, or
``pytest tests/test_exercises.py -m ch06 --impl exercises``.
"""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():  # no GPU: Triton's interpreter; must be on before @triton.jit decorates below
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint key sets A and B into attention over A u B.

    lse = log(exp(lse_a) + exp(lse_b)); out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse).
    Must not overflow for large lse (e.g. 1000) and must handle an empty part (lse = -inf,
    out = 0): then the other part is the answer; both empty gives out = 0, lse = -inf (no nan).

    Args:
        out_a, out_b: [..., hd] partial outputs (each a softmax-weighted mean of its values).
        lse_a, lse_b: [...] their log-sum-exps.
    Returns:
        (out [..., hd], lse [...]).
    """
    # EXERCISE 6.1: log-sum-exp merge of two partial softmaxes (stable, empty parts allowed)
    # BEGIN SOLUTION
    lse = torch.logaddexp(lse_a, lse_b)  # [...]
    ref = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # both empty: weights 0, not nan
    w_a, w_b = torch.exp(lse_a - ref)[..., None], torch.exp(lse_b - ref)[..., None]  # [..., 1]
    return out_a * w_a + out_b * w_b, lse
    # END SOLUTION


def masked_attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention that also returns each row's log-sum-exp (the tree suffix part).

    Args:
        q: [..., T, hd] queries; k, v: [..., N, hd] keys / values.
        mask: bool [..., T, N] (broadcastable), True = may attend.
    Returns:
        (out [..., T, hd], lse [..., T]); a row with no True in its mask gets out = 0, lse = -inf.
    """
    # EXERCISE 6.2: masked scores -> lse with logsumexp, out with exp(s - lse); empty rows give 0 / -inf
    # BEGIN SOLUTION
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [..., T, N]
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [..., T]
    ref = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(s - ref[..., None]) @ v, lse
    # END SOLUTION


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention over the keys in tiles of ``block``, with the online softmax (the prefix part).

    Keep per query row a running max m, a running sum l of exponentiated scores and an
    unnormalised output acc, and never build the full [T, N] score matrix. Questions to answer
    before coding: when a tile raises the running max, what factor makes the old l and acc
    consistent with the new max? How do you get out and lse from m, l and acc at the end?

    Args:
        q: [..., T, hd]; k, v: [..., N, hd] with N >= 0 (N need not be a multiple of block).
        block: keys per tile (>= 1).
    Returns:
        (out [..., T, hd], lse [..., T]) equal to softmax attention over all N keys; N = 0 gives
        out = 0 and lse = -inf.
    """
    # EXERCISE 6.3: FlashAttention's online softmax over key tiles (running max, sum and output)
    # BEGIN SOLUTION
    scale = 1.0 / math.sqrt(q.shape[-1])
    m = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)  # [..., T]
    l = torch.zeros(q.shape[:-1], dtype=q.dtype)  # noqa: E741
    acc = torch.zeros_like(q)  # [..., T, hd]
    for j in range(0, k.shape[-2], block):
        s = q @ k[..., j:j + block, :].transpose(-1, -2) * scale  # [..., T, block]
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp(m - m_new)  # rescales what was accumulated under the old max
        p = torch.exp(s - m_new[..., None])
        l = l * alpha + p.sum(-1)  # noqa: E741
        acc = acc * alpha[..., None] + p @ v[..., j:j + block, :]
        m = m_new
    seen = l > 0
    out = acc / torch.where(seen, l, torch.ones_like(l))[..., None]
    return out, torch.where(seen, m + torch.log(l), m)
    # END SOLUTION


def split_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
                         tree_mask: torch.Tensor, block: int = 16) -> torch.Tensor:
    """Tree attention = tiled prefix (6.3, no mask) + masked tree suffix (6.2), merged (6.1).

    Grouped-query attention: query head h uses KV head h // G with G = H / Hkv (expand k and v
    with ``repeat_interleave(G, dim=1)``).

    Args:
        q: [B, H, T, hd]; k, v: [B, Hkv, prefix_len + T, hd] (the cache prefix, then the T tree tokens).
        prefix_len: committed tokens, all visible to every tree token (may be 0).
        tree_mask: bool [T, T], row i = the tree tokens query i sees (its ancestors and itself).
        block: the prefix tile size for 6.3.
    Returns:
        [B, H, T, hd], equal to softmax attention with the mask [all prefix | tree_mask].
    """
    # EXERCISE 6.4: combine 6.1-6.3 into split tree attention (with grouped-query heads)
    # BEGIN SOLUTION
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # [B, H, S, hd]
    out_p, lse_p = tiled_attention(q, k[:, :, :prefix_len], v[:, :, :prefix_len], block)
    out_s, lse_s = masked_attention_lse(q, k[:, :, prefix_len:], v[:, :, prefix_len:], tree_mask)
    return merge_partials(out_p, lse_p, out_s, lse_s)[0]
    # END SOLUTION


@triton.jit
def merge_kernel(OP, LP, OS, LS, Out, R, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """The merge of 6.1 as a Triton kernel: program i handles rows i * BLOCK_R ... i * BLOCK_R + BLOCK_R - 1.

    Out[r] = (exp(LP[r] - m) OP[r] + exp(LS[r] - m) OS[r]) / (exp(LP[r] - m) + exp(LS[r] - m)),
    m = max(LP[r], LS[r]). A part with lse = -inf (empty) gets weight 0; a row whose parts are
    both empty gets Out = 0 (no nan).

    Args:
        OP, OS: pointers to the partial outputs, contiguous [R, D] (row r starts at r * D), float32.
        LP, LS: pointers to their log-sum-exps, [R].
        Out: pointer to the merged output, contiguous [R, D].
        R, D: rows and head dim (any values: mask rows >= R and columns >= D).
        BLOCK_R: rows per program (power of two); BLOCK_D: a power of two >= D.
    """
    # EXERCISE 6.5: the merge as a Triton kernel: program_id, arange offsets, masked tl.load / tl.store
    # BEGIN SOLUTION
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R] this program's rows
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D] columns
    row_ok = r < R
    ok = row_ok[:, None] & (d < D)[None, :]  # [BLOCK_R, BLOCK_D]
    offs = r[:, None] * D + d[None, :]
    lse_p = tl.load(LP + r, mask=row_ok, other=float("-inf"))
    lse_s = tl.load(LS + r, mask=row_ok, other=float("-inf"))
    m = tl.maximum(lse_p, lse_s)
    m = tl.where(m == float("-inf"), 0.0, m)  # both parts empty: exp(-inf - 0) = 0, not exp(nan)
    w_p, w_s = tl.exp(lse_p - m), tl.exp(lse_s - m)  # <= 1: no overflow
    num = (w_p[:, None] * tl.load(OP + offs, mask=ok, other=0.0)
           + w_s[:, None] * tl.load(OS + offs, mask=ok, other=0.0))
    den = w_p + w_s
    tl.store(Out + offs, num / tl.where(den > 0, den, 1.0)[:, None], mask=ok)
    # END SOLUTION


def merge_triton(out_p: torch.Tensor, lse_p: torch.Tensor, out_s: torch.Tensor, lse_s: torch.Tensor,
                 block_r: int = 16) -> torch.Tensor:
    """Launch ``merge_kernel`` (given, not an exercise): one program per ``block_r`` rows.

    Args:
        out_p, out_s: [R, D]; lse_p, lse_s: [R] (CPU tensors under the interpreter, else CUDA).
        block_r: rows per program (a power of two).
    Returns:
        out [R, D] float32, equal to ``merge_partials(out_p, lse_p, out_s, lse_s)[0]``.
    """
    R, D = out_p.shape
    out_p, lse_p, out_s, lse_s = (x.float().contiguous() for x in (out_p, lse_p, out_s, lse_s))
    out = torch.empty_like(out_p)
    merge_kernel[(triton.cdiv(R, block_r),)](out_p, lse_p, out_s, lse_s, out, R, D,
                                             BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(D))
    return out
