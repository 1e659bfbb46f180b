"""Attention backends for the Transformer (chapter 6): dense-mask SDPA, PyTorch split, Triton split.

    dense         one pass over prefix + tree with the full boolean mask: on the CPU row-invariant
                  (``invariant.invariant_attention``: each query row reduces over its visible keys
                  in key order, so its bits do not depend on how many rows or keys come with it,
                  what keeps greedy verification identical to vanilla); elsewhere one SDPA call
    split_torch   prefix without a mask + tree suffix with the mask, merged by log-sum-exp
                  (``reference.split_attention``)
    split_triton  the same split with Triton kernels (``triton_split.split_attention_triton``):
                  split-k over the prefix as in Flash-Decoding (Dao et al. 2023)

The split backends apply when every new token sees the whole committed prefix: the model's
mask is None (causal among the new tokens) or given in the new-token form [T, T] / [B, T, T]
(a draft tree). A general [T, S] mask that hides part of the prefix falls back to dense.

Triton is imported only by ``minispec.attention.triton_split`` (lazily, on first use of
``split_triton``), so this package imports without triton. On CPU the kernels run under the
Triton interpreter, which must be switched on (``TRITON_INTERPRET=1``) before triton is
first imported.

Shapes: B batch, H query heads, Hkv KV heads, T new tokens, S = prefix + T keys, hd head dim.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch
import torch.nn.functional as F

from .invariant import invariant_attention
from .reference import attention_with_lse, dense_attention, dense_backend, expand_kv, merge, prefix_attention, \
    sdpa_backend, split_attention, suffix_attention

BACKENDS = ("dense", "split_torch", "split_triton")

__all__ = ["BACKENDS", "attend", "attention_with_lse", "check_backend", "causal_mask", "dense_attention",
           "dense_backend", "expand_kv", "invariant_attention", "merge", "prefix_attention", "sdpa_backend",
           "split_attention", "suffix_attention", "triton_available"]


def triton_available(device: torch.device | str | None = None) -> bool:
    """Whether the Triton kernels can run on ``device`` (default: CUDA if present, else CPU).

    CUDA tensors need triton and a GPU; CPU tensors need triton's interpreter, i.e.
    TRITON_INTERPRET=1 set before triton was first imported."""
    if importlib.util.find_spec("triton") is None:
        return False
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if dev.type == "cuda":
        return torch.cuda.is_available() and not interpret
    if dev.type != "cpu" or not interpret:
        return False
    mod = sys.modules.get("minispec.attention.triton_split")
    return mod is None or getattr(mod, "_INTERPRETED", True)


def check_backend(name: str, device: torch.device | str | None = None) -> str:
    """Validate a backend name (and, for split_triton, that kernels can run on ``device``)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "split_triton" and not triton_available(device):
        raise RuntimeError("split_triton cannot run here: it needs a CUDA GPU, or on CPU the Triton interpreter "
                           "(set TRITON_INTERPRET=1 before triton is first imported)")
    return name


def causal_mask(T: int, S: int, device) -> torch.Tensor:
    """[T, S] mask: new token i (at key index S-T+i) sees keys 0..S-T+i."""
    return torch.ones(T, S, dtype=torch.bool, device=device).tril(S - T)


def attend(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
           tree_mask: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of T new tokens over prefix + new keys with the chosen backend.

    Args:
        backend: "dense" | "split_torch" | "split_triton".
        q: [B, H, T, hd]; k, v: [B, Hkv, S, hd] with S = prefix_len + T.
        prefix_len: committed tokens before the new ones.
        tree_mask: bool [B or 1, T, T] among the new tokens when the whole prefix is visible
            (None with mask None means causal).
        mask: the full bool mask [B or 1, 1, T, S] / [T, S], or None for causal; on the CPU's dense path also
            its ``invariant.masked_keys`` (a plan works the mask out once for every layer).
    Returns:
        [B, H, T, hd]. The split backends run when mask is None or tree_mask is given; any
        other mask goes to dense (row-invariant on the CPU, SDPA elsewhere: ``dense_attention``,
        which expands K / V to the query heads under a mask so that SDPA need not fall back to
        its math kernel; ``sdpa_backend`` names the kernel).
    """
    T, S = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if backend != "dense" and (mask is None or tree_mask is not None):
        check_backend(backend, q.device)
        if backend == "split_torch":
            return split_attention(q, k, v, prefix_len, tree_mask)
        from .triton_split import split_attention_triton  # imports triton on first use

        return split_attention_triton(q, k, v, prefix_len, tree_mask)
    check_backend(backend)
    if q.device.type == "cpu":
        return invariant_attention(q, k, v, mask)
    if mask is None and (T == 1 or S == T):  # plain causal: no mask tensor needed
        return F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=gqa)
    mask = causal_mask(T, S, q.device) if mask is None else mask  # [T, S] or [B, 1, T, S]
    return dense_attention(q, k, v, mask)  # [B, H, T, hd]; GQA with a mask: K / V expanded (not the math kernel)
