# Exercises generated from solutions/ch06_split_attention.py by tools/make_exercises.py.
# Replace each `raise NotImplementedError(...)` with your code; keep the signatures.
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
    raise NotImplementedError("Exercise 6.1: log-sum-exp merge of two partial softmaxes (stable, empty parts allowed)")


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
    raise NotImplementedError("Exercise 6.2: masked scores -> lse with logsumexp, out with exp(s - lse); empty rows give 0 / -inf")


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
    raise NotImplementedError("Exercise 6.3: FlashAttention's online softmax over key tiles (running max, sum and output)")


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
    raise NotImplementedError("Exercise 6.4: combine 6.1-6.3 into split tree attention (with grouped-query heads)")


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
    raise NotImplementedError("Exercise 6.5: the merge as a Triton kernel: program_id, arange offsets, masked tl.load / tl.store")


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
