"""Chapter 6 exercises: split tree attention, in PyTorch and in Triton.

A verify step's T tree tokens attend to a long committed prefix (every tree token sees all of
it: no mask) and to the tree itself (the ancestor mask). Computing the two parts separately
and merging them by log-sum-exp is exact; it lets the prefix, where the memory traffic is,
run mask-free and split along the keys (Flash-Decoding), and the small T x T part carry the mask.

References:
    Dao et al., "FlashAttention" (2022): the online softmax over key tiles.
    Dao et al., "Flash-Decoding for long-context inference" (2023): split-k + log-sum-exp merge.
    Miao et al., "SpecInfer" (2023): tree attention masks.
    Tillet et al., "Triton" (2019): the kernel language of exercises 6.2 and 6.5.

Notation: scores s = q k^T / sqrt(hd); lse = log sum_j exp(s_j) (natural log) per query row;
out = softmax(s) v. A row that sees no key has lse = -inf and out = 0. Work in the inputs'
dtype (the grader uses float64 for the PyTorch exercises, float32 for the kernels).

Exercises 6.2 and 6.5 are Triton kernels. Without a GPU they run in Triton's interpreter on CPU
tensors: this file switches it on before ``@triton.jit`` runs, unless TRITON_INTERPRET is
already set.

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

from minispec.attention.reference import merge as _merge  # noqa: E402  (the launcher of 6.5 merges its splits)


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint key sets A and B into attention over A u B.

    Questions to answer before coding: how is the softmax normaliser of A u B made of those of A
    and B, and what weight does each partial output get? Which common quantity can you subtract
    before exponentiating so that nothing overflows when lse is around 1000? What if that
    quantity is -inf?

    Args:
        out_a, out_b: [..., hd] partial outputs (each a softmax-weighted mean of its values).
        lse_a, lse_b: [...] their log-sum-exps; -inf for an empty part (whose out is 0).
    Returns:
        (out [..., hd], lse [...]) over A u B. An empty part leaves the other as the answer;
        both empty gives out = 0, lse = -inf (no nan).
    """
    # EXERCISE 6.1: log-sum-exp merge of two partial softmaxes (stable, empty parts allowed)
    # BEGIN SOLUTION
    lse = torch.logaddexp(lse_a, lse_b)  # [...]
    ref = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # both empty: weights 0, not nan
    w_a, w_b = torch.exp(lse_a - ref)[..., None], torch.exp(lse_b - ref)[..., None]  # [..., 1]
    return out_a * w_a + out_b * w_b, lse
    # END SOLUTION


@triton.jit
def merge_kernel(OP, LP, OS, LS, Out, R, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """The merge of 6.1 as a Triton kernel over R rows: program i handles rows i * BLOCK_R ... (i + 1) * BLOCK_R - 1.

    Out[r] is the merged output of the partials (OP[r], LP[r]) and (OS[r], LS[r]). A part with
    lse = -inf is empty; a row whose parts are both empty gets Out = 0 (no nan). Questions: which
    rows of this program exist (and which columns, when D is not a power of two), and what do
    masked loads give for the others? Which per-row quantities are vectors of BLOCK_R, and how do
    they broadcast over a [BLOCK_R, BLOCK_D] tile?

    Args:
        OP, OS: pointers to the partial outputs, contiguous [R, D] (row r starts at r * D), float32.
        LP, LS: pointers to their log-sum-exps, [R].
        Out: pointer to the merged output, contiguous [R, D].
        R, D: rows and head dim (any values: mask rows >= R and columns >= D).
        BLOCK_R: rows per program (power of two); BLOCK_D: a power of two >= D.
    """
    # EXERCISE 6.2: the merge as a Triton kernel: program_id, arange offsets, masked tl.load / tl.store
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


def masked_attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention that also returns each row's log-sum-exp (the tree suffix part).

    Args:
        q: [..., T, hd] queries; k, v: [..., N, hd] keys / values.
        mask: bool [..., T, N] (broadcastable), True = may attend.
    Returns:
        (out [..., T, hd], lse [..., T]); a row with no True in its mask gets out = 0, lse = -inf.
    """
    # EXERCISE 6.3: masked attention that also returns each row's log-sum-exp (rows that see nothing: 0 / -inf)
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
    # EXERCISE 6.4: FlashAttention's online softmax over key tiles (running max, sum and output)
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


@triton.jit
def prefix_split_kernel(Q, K, V, Lens, O, L, R, N, D, chunk, scale,
                        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Exercise 6.4's online softmax as a Triton kernel, for one split of one batch row's prefix.

    Grid (B, num_splits): program (b, s) takes the R query rows of batch b and the keys
    [s * chunk, min((s + 1) * chunk, Lens[b])) of batch b, with no mask, reading them BLOCK_N
    keys at a time, and writes the partial (out, lse) of attention over that range. The
    prefix lengths are ragged: a split may end inside a tile, or start past Lens[b] and hold no
    key at all. Questions to answer before coding: which keys of a tile are not yours, and what
    must their scores be so that they count for nothing? What are the running max, sum and
    output before the first tile, and what does a split with no key store (out 0, lse -inf, no
    nan)? Does every tile you visit hold at least one of your keys?

    Args:
        Q: pointer to the queries, contiguous [B, R, D], float32.
        K, V: pointers to the keys / values, contiguous [B, N, D], float32; batch b uses its first
            Lens[b] keys (the rows past them hold other data).
        Lens: pointer to the prefix lengths P_b, [B] int32, 0 <= P_b <= N.
        O: pointer to the partial outputs, contiguous [B, num_splits, R, D]; L: their log-sum-exps
            (natural log), [B, num_splits, R]. Every program writes its R rows (and nothing else).
        R, N, D: rows per batch, keys per batch in K / V, head dim (D need not be a power of two).
        chunk: keys per split (>= 1; need not be a multiple of BLOCK_N).
        scale: the score scale, 1 / sqrt(D).
        BLOCK_R >= R, BLOCK_D >= D, BLOCK_N (keys per tile): powers of two, >= 16 (``tl.dot``'s
            minimum on a GPU, where float32 ``tl.dot`` also needs ``input_precision="ieee"``:
            its default, TF32, keeps 10 mantissa bits).
    """
    # EXERCISE 6.5: the online softmax of one split as a Triton kernel (ragged lengths, empty splits)
    # BEGIN SOLUTION
    b, split = tl.program_id(0), tl.program_id(1)
    r = tl.arange(0, BLOCK_R)  # [BLOCK_R] query rows
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D] columns
    rd_ok = (r < R)[:, None] & (d < D)[None, :]
    q = tl.load(Q + b * R * D + r[:, None] * D + d[None, :], mask=rd_ok, other=0.0)  # [BLOCK_R, BLOCK_D]
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)  # running max of the scores
    l = tl.zeros([BLOCK_R], tl.float32)  # noqa: E741  running sum of exp(s - m)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)  # running sum of exp(s - m) v
    start = split * chunk
    end = tl.minimum(start + chunk, tl.load(Lens + b))  # start >= end: an empty split, no tile
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key indices
        n_ok = n < end  # the last tile may run past the split or past P_b
        kv = b * N * D + n[:, None] * D + d[None, :]
        kv_ok = n_ok[:, None] & (d < D)[None, :]
        k = tl.load(K + kv, mask=kv_ok, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(V + kv, mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_R, BLOCK_N]
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: n0 < end, so the tile holds a key
        alpha = tl.exp(m - m_new)  # rescales what was accumulated under the old max
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)  # noqa: E741
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m = m_new
    seen = l > 0
    out = acc / tl.where(seen, l, 1.0)[:, None]
    lse = tl.where(seen, m + tl.log(tl.where(seen, l, 1.0)), float("-inf"))
    row = (b * tl.num_programs(1) + split) * R + r  # [BLOCK_R] rows of O / L
    tl.store(O + row[:, None] * D + d[None, :], out, mask=rd_ok)
    tl.store(L + row, lse, mask=r < R)
    # END SOLUTION


def prefix_split_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor,
                        num_splits: int = 2, block_n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch ``prefix_split_kernel`` over (batch, splits), then merge the splits (given, not an exercise).

    Args:
        q: [B, R, D]; k, v: [B, N, D]; lens: [B] integer prefix lengths (<= N). CPU tensors under
            the interpreter, else CUDA.
        num_splits: splits of the keys, ``cdiv(N, num_splits)`` keys each.
        block_n: keys per tile (a power of two >= 16).
    Returns:
        (out [B, R, D], lse [B, R]) float32: attention of batch b's rows over its first lens[b] keys.
    """
    B, R, D = q.shape
    N = k.shape[1]
    q, k, v = (x.float().contiguous() for x in (q, k, v))
    lens = lens.to(torch.int32).contiguous()
    chunk = max(1, triton.cdiv(N, num_splits))
    parts_o = torch.empty(B, num_splits, R, D, device=q.device)  # one partial (out, lse) per split
    parts_l = torch.empty(B, num_splits, R, device=q.device)
    prefix_split_kernel[(B, num_splits)](q, k, v, lens, parts_o, parts_l, R, N, D, chunk, 1.0 / math.sqrt(D),
                                         BLOCK_R=max(16, triton.next_power_of_2(R)), BLOCK_N=block_n,
                                         BLOCK_D=max(16, triton.next_power_of_2(D)))
    out, lse = parts_o[:, 0], parts_l[:, 0]
    for s in range(1, num_splits):
        out, lse = _merge(out, lse, parts_o[:, s], parts_l[:, s], return_lse=True)
    return out, lse


def split_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
                         tree_mask: torch.Tensor, block: int = 16) -> torch.Tensor:
    """Tree attention from the pieces of this chapter: the prefix without a mask, the tree with it.

    Grouped-query attention: query head h reads KV head h // G, with G = H / Hkv. Questions:
    which functions of 6.1, 6.3 and 6.4 compute which part, over which slices of k and v? How
    does each query head get its KV head? With prefix_len = 0, is the empty prefix part what
    your merge expects?

    Args:
        q: [B, H, T, hd]; k, v: [B, Hkv, prefix_len + T, hd] (the cache prefix, then the T tree tokens).
        prefix_len: committed tokens, all visible to every tree token (may be 0).
        tree_mask: bool [T, T], row i = the tree tokens query i sees (its ancestors and itself).
        block: the prefix tile size for 6.4.
    Returns:
        [B, H, T, hd], equal to softmax attention with the mask [all prefix | tree_mask].
    """
    # EXERCISE 6.6: split tree attention from 6.1, 6.3 and 6.4 (with grouped-query heads)
    # BEGIN SOLUTION
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # [B, H, S, hd]
    out_p, lse_p = tiled_attention(q, k[:, :, :prefix_len], v[:, :, :prefix_len], block)
    out_s, lse_s = masked_attention_lse(q, k[:, :, prefix_len:], v[:, :, prefix_len:], tree_mask)
    return merge_partials(out_p, lse_p, out_s, lse_s)[0]
    # END SOLUTION
