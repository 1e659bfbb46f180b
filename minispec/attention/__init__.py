"""Attention backends for the Transformer (chapter 6), chosen by name (``Transformer.set_attention``):

    dense         ``attention``: one SDPA call over prefix + new tokens with the plan's boolean mask
    flash         SDPA's fused kernels without copying K / V (``table.fused_attention``): the name the
                  backend table (``table``) gives it; with a mask the same call as dense
    split_torch   prefix without a mask + the new tokens with their tree mask, merged by log-sum-exp
                  (``reference.split_attention``)
    split_triton  the same split with Triton kernels (``triton_split.split_attention_triton``):
                  split-k over the prefix as in Flash-Decoding (Dao et al. 2023)

and any backend a package registers (``register``): ``minispec.exact`` adds "exact", the CPU's
row-invariant attention, which ``load()`` sets for CPU float32 models. A backend is a function
``(q, k, v, plan) -> out`` that an attention plan (``minispec.attention.plan``) calls in every layer.

The split backends apply when every new token sees the whole committed prefix: no mask (causal
among the new tokens) or one given among the new tokens, [T, T] / [B, T, T] (a draft tree). A
general [T, S] mask that hides part of the prefix falls back to ``attention``.

Triton is imported only by ``minispec.attention.triton_split`` (lazily, on first use of
``split_triton``), so this package imports without triton. On CPU the kernels run under the
Triton interpreter, which must be switched on (``TRITON_INTERPRET=1``) before triton is first imported.

Shapes: B batch, H query heads, Hkv KV heads, G = H / Hkv, T new tokens, S = prefix + T keys, hd head dim.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Callable

import torch

from .dense import attention, causal_mask


def dense(q, k, v, plan) -> torch.Tensor:
    """The "dense" backend: ``attention`` with the plan's mask."""
    return attention(q, k, v, plan.mask)


def flash(q, k, v, plan) -> torch.Tensor:
    """The "flash" backend (``table.fused_attention``; a plan without a mask is causal, as for dense)."""
    if plan.mask is None:
        return attention(q, k, v, None)
    from .table import fused_attention

    return fused_attention(q, k, v, plan.mask)


def split_torch(q, k, v, plan) -> torch.Tensor:
    """The "split_torch" backend (``reference.split_attention``); ``attention`` under a general mask."""
    if plan.mask is not None and plan.tree is None:
        return attention(q, k, v, plan.mask)
    from .reference import split_attention

    return split_attention(q, k, v, k.shape[2] - q.shape[2], plan.tree)


def split_triton(q, k, v, plan) -> torch.Tensor:
    """The "split_triton" backend (``triton_split.split_attention_triton``); ``attention`` under a general mask."""
    if plan.mask is not None and plan.tree is None:
        return attention(q, k, v, plan.mask)
    from .triton_split import split_attention_triton  # imports triton on first use

    return split_attention_triton(q, k, v, k.shape[2] - q.shape[2], plan.tree)


Backend = Callable  # (q [B, H, T, hd], k, v [B, Hkv, S, hd], plan) -> [B, H, T, hd]
BACKENDS: dict[str, Backend] = {"dense": dense, "flash": flash, "split_torch": split_torch, "split_triton": split_triton}
SPLIT = ("split_torch", "split_triton")  # attend the prefix unmasked: their plans carry the tree, not a full mask


def register(name: str, backend: Backend) -> None:
    """Add a backend under ``name`` (``minispec.exact`` registers "exact")."""
    BACKENDS[name] = backend


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


REFERENCE = ("attention_with_lse", "dense_attention", "dense_backend", "expand_kv", "merge", "prefix_attention",
             "sdpa_backend", "split_attention", "suffix_attention")  # ``reference``'s, importable from here too


def __getattr__(name: str):
    """The split reference's functions (chapter 6), loaded on first use: a forward on "dense" needs none of them."""
    if name in REFERENCE:
        from . import reference

        return getattr(reference, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
