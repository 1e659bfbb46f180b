"""Split tree attention in plain PyTorch: mask-free prefix + masked suffix, merged by log-sum-exp.

In a verify step T tree tokens attend to (a) the committed prefix of P tokens in the KV cache,
which every tree token sees whole, and (b) the T tree tokens themselves through the tree's
ancestor mask. Softmax over the union of two key sets is exactly recoverable from the two
partial softmaxes and their log-sum-exps:

    lse = logaddexp(lse_p, lse_s)
    out = out_p * exp(lse_p - lse) + out_s * exp(lse_s - lse)

so the prefix part (almost all of the memory traffic) needs no mask and can be split along
the keys across many programs, while the small T x T part carries the mask.

References:
    Dao et al., "FlashAttention" (2022): tiling with the online softmax (running max + sum).
    Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context inference" (2023): split-k
        over the keys, one partial (out, lse) per split, merged by log-sum-exp.
    Meta's EAGLE serving work ("Efficient LLM inference with speculative decoding", 2025):
        tree attention as a mask-free prefix pass plus a masked tree pass, then a merge.
    Miao et al., "SpecInfer" (2023): token-tree attention masks.

Shapes: B batch, H query heads, Hkv key/value heads, G = H / Hkv (grouped-query attention,
query head h uses KV head h // G, as ``repeat_interleave`` and SDPA's ``enable_gqa``), T tree
(new) tokens, P prefix tokens, S = P + T keys, hd head dim. ``lse`` is the natural-log
log-sum-exp of the scaled scores, float32 (float64 for float64 inputs; -inf where a query sees
no key).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .dense import attention


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Validate q [B, H, T, hd], k / v [B, Hkv, S, hd]; return (B, H, Hkv, T, hd)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [B, heads, tokens, hd], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    B, H, T, hd = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    if k.shape[0] != B or k.shape[3] != hd:
        raise ValueError(f"k {tuple(k.shape)} does not fit q {tuple(q.shape)} (batch and head dim must match)")
    Hkv = k.shape[1]
    if H % Hkv:
        raise ValueError(f"{H} query heads are not a multiple of {Hkv} KV heads")
    return B, H, Hkv, T, hd


def tree_mask_3d(tree_mask: torch.Tensor | None, B: int, T: int, device) -> torch.Tensor:
    """The suffix mask as bool [B or 1, T, T]; None means causal among the T new tokens."""
    if tree_mask is None:
        return torch.ones(1, T, T, dtype=torch.bool, device=device).tril()
    if tree_mask.dtype != torch.bool:
        raise TypeError(f"tree_mask must be boolean (True = may attend), got {tree_mask.dtype}")
    m = tree_mask if tree_mask.dim() == 3 else tree_mask[None]  # [B or 1, T, T]
    if m.dim() != 3 or m.shape[1:] != (T, T) or m.shape[0] not in (1, B):
        raise ValueError(f"tree_mask of shape {tuple(tree_mask.shape)} does not fit {T} tree tokens and batch {B}: "
                         f"expected [{T}, {T}] or [1 or {B}, {T}, {T}]")
    return m


def _grouped(q: torch.Tensor, Hkv: int) -> torch.Tensor:
    """q [B, H, T, hd] -> [B, Hkv, G*T, hd]: the G query heads of a KV head stacked as rows (no KV copy)."""
    B, H, T, hd = q.shape
    return q.reshape(B, Hkv, (H // Hkv) * T, hd)


def _ungrouped(x: torch.Tensor, H: int) -> torch.Tensor:
    """[B, Hkv, G*T, ...] -> [B, H, T, ...]."""
    B, Hkv, GT = x.shape[:3]
    return x.reshape(B, H, GT * Hkv // H, *x.shape[3:])


def expand_kv(x: torch.Tensor, H: int) -> torch.Tensor:
    """Repeat each KV head for its G = H / Hkv query heads: [B, Hkv, S, hd] -> [B, H, S, hd] (a copy).

    Head h of the result is KV head h // G, as ``repeat_interleave(G, 1)`` and SDPA's ``enable_gqa``."""
    B, Hkv, S, hd = x.shape
    return x[:, :, None].expand(B, Hkv, H // Hkv, S, hd).reshape(B, H, S, hd)  # [B, Hkv, G, S, hd] -> [B, H, S, hd]


def sdpa_backend(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None = None, is_causal: bool = False,
                 device_type: str | None = None, capability: tuple[int, int] | None = None) -> str:
    """The kernel ``F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
    enable_gqa=True)`` runs on CUDA, by PyTorch's dispatch rules (``sdp_utils.cpp``, inference,
    no dropout, dense tensors), tried in its default order:

        flash      sm80+, fp16 / bf16, no attn_mask, q/k/v head dim equal and <= 256, is_causal
                   only when T == S; GQA (Hkv < H) supported
        efficient  sm50+, fp16 / fp32 (bf16 on sm80+), any attn_mask, head dim a multiple of 8
                   (2-byte) / 4 (fp32) where tensor cores are used; no GQA in the torch releases
                   this was written for (pytorch#191085 proposes it); ``dense_attention`` folds
                   the G query heads of a KV head into its rows instead
        math       everything else: upcasts to fp32 and materialises the [B, H, T, S] scores

    Not modelled: cuDNN attention (recent torch tries it first on sm90 / sm100 with a new enough
    cuDNN), efficient's pointer-alignment check, user overrides (``torch.nn.attention.sdpa_kernel``).
    Only a GPU shows what really runs: tests/test_attention.py::test_gpu_sdpa_backend_rules runs
    the predicted kernel alone and checks that the ones before it refuse.

    Args:
        q: [B, H, T, hd]; k: [B, Hkv, S, hd] as handed to SDPA (only shapes, dtype, strides read).
        mask: the attn_mask or None; is_causal: SDPA's flag.
        device_type: "cuda" or other (default q's device); capability: (major, minor) of the
            GPU (default: torch's report for q's device, else (9, 0)). Both are data, so the
            rules are tested on a CPU.
    Returns:
        "flash" | "efficient" | "math" on CUDA; "cpu" elsewhere (PyTorch's CPU kernels, not modelled).
    """
    device_type = device_type or q.device.type
    if device_type != "cuda":
        return "cpu"
    if capability is None:
        capability = torch.cuda.get_device_capability(q.device) if q.is_cuda else (9, 0)
    (H, T, hd), (Hkv, S) = (q.shape[1], q.shape[2], q.shape[3]), (k.shape[1], k.shape[2])
    half = q.dtype in (torch.float16, torch.bfloat16)
    unit_stride = q.stride(-1) == 1 and k.stride(-1) == 1
    flash = (capability >= (8, 0) and half and mask is None and k.shape[-1] == hd <= 256 and unit_stride
             and not (is_causal and T != S) and H % Hkv == 0)
    if flash:
        return "flash"
    dtypes = (torch.float16, torch.float32) + ((torch.bfloat16,) if capability >= (8, 0) else ())
    tensor_cores = capability >= (8, 0) or (capability >= (7, 0) and half)
    align = (8 if half else 4) if tensor_cores else 1  # torch's minimum_gemm_alignment
    efficient = capability >= (5, 0) and q.dtype in dtypes and hd % align == 0 and H == Hkv and unit_stride
    return "efficient" if efficient else "math"


def dense_backend(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, **kw) -> str:
    """``sdpa_backend`` of the SDPA call ``dense_attention(q, k, v, mask)`` makes: with a mask and GQA the G query
    heads of a KV head are folded into its query rows (``minispec.attention.attention``), so SDPA sees Hkv heads
    of G*T rows and no GQA."""
    B, H, T, hd = q.shape
    Hkv = k.shape[1]
    if mask is not None and Hkv != H:
        q = q.reshape(B, Hkv, H // Hkv * T, hd)  # [B, Hkv, G*T, hd]: the shapes SDPA gets
    return sdpa_backend(q, k, mask, **kw)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """One SDPA call over prefix + tree with a boolean mask: the reference the split must equal
    (``minispec.attention.attention``, the "dense" backend's, with its shapes checked).

    With a mask and fewer KV heads than query heads, the G query heads of a KV head become its query rows
    (no K / V copy): on CUDA that lets the memory-efficient kernel run instead of the fp32 math fallback
    (``dense_backend`` says which; only a GPU can time the difference).

    Args:
        q: [B, H, T, hd] queries; k, v: [B, Hkv, S, hd] keys / values (prefix + tree).
        mask: bool [B or 1, 1, T, S] or [T, S] (True = may attend), or None for causal.
    Returns:
        [B, H, T, hd] in q's dtype.
    """
    B, H, Hkv, T, hd = check_shapes(q, k, v)
    if mask is not None and (mask.dtype != torch.bool or mask.shape[-2:] != (T, k.shape[2])):
        raise ValueError(f"mask must be boolean [.., {T}, {k.shape[2]}], got {mask.dtype} {tuple(mask.shape)}")
    return attention(q, k, v, mask)


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention that also returns the log-sum-exp of each row's scores.

    Args:
        q: [..., M, hd]; k, v: [..., N, hd] (same leading dims, or broadcastable).
        mask: bool broadcastable to [..., M, N] (True = may attend), or None.
    Returns:
        out [..., M, hd] in q's dtype and lse [..., M] (float32, float64 for float64 inputs);
        a row that sees no key gets out = 0 and lse = -inf.
    """
    dt = _acc_dtype(q)
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = torch.matmul(q.to(dt), k.to(dt).transpose(-1, -2)) * scale  # [..., M, N]
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [..., M]; -inf for an empty row (and for N = 0)
    finite = torch.isfinite(lse)
    p = torch.exp(s - torch.where(finite, lse, 0.0)[..., None])  # [..., M, N]; rows sum to 1 (or 0)
    out = torch.matmul(p, v.to(dt))  # [..., M, hd]
    return out.to(q.dtype), lse


def prefix_attention(q: torch.Tensor, k_prefix: torch.Tensor,
                     v_prefix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query over the whole prefix, no mask.

    Args:
        q: [B, H, T, hd]; k_prefix, v_prefix: [B, Hkv, P, hd] (P may be 0).
    Returns:
        out [B, H, T, hd] (q's dtype; zeros when P = 0) and lse [B, H, T] float32 (-inf when P = 0).
    """
    B, H, Hkv, T, hd = check_shapes(q, k_prefix, v_prefix)
    out, lse = attention_with_lse(_grouped(q, Hkv), k_prefix, v_prefix, None)  # rows = (g, t)
    return _ungrouped(out, H), _ungrouped(lse, H)


def suffix_attention(q: torch.Tensor, k_suf: torch.Tensor, v_suf: torch.Tensor,
                     tree_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the T tree tokens over themselves through the tree mask.

    Args:
        q: [B, H, T, hd]; k_suf, v_suf: [B, Hkv, T, hd] the tree tokens' keys / values.
        tree_mask: bool [T, T] or [B or 1, T, T], row i = which tree tokens query i sees (its
            ancestors and itself); None = causal.
    Returns:
        out [B, H, T, hd] and lse [B, H, T] float32 (-inf, out 0 for a row that sees nothing).
    """
    B, H, Hkv, T, hd = check_shapes(q, k_suf, v_suf)
    if k_suf.shape[2] != T:
        raise ValueError(f"the suffix has {k_suf.shape[2]} keys but there are {T} tree queries")
    m = tree_mask_3d(tree_mask, B, T, q.device)  # [B or 1, T, T]
    G = H // Hkv
    m = m[:, None, None].expand(m.shape[0], 1, G, T, T).reshape(m.shape[0], 1, G * T, T)  # rows (g, t)
    out, lse = attention_with_lse(_grouped(q, Hkv), k_suf, v_suf, m)
    return _ungrouped(out, H), _ungrouped(lse, H)


def merge(out_p: torch.Tensor, lse_p: torch.Tensor, out_s: torch.Tensor, lse_s: torch.Tensor,
          return_lse: bool = False):
    """Exact softmax over the union of two key sets from the two partial results.

    lse = logaddexp(lse_p, lse_s); out = out_p * exp(lse_p - lse) + out_s * exp(lse_s - lse).
    A part with lse = -inf (an empty prefix) gets weight 0; if both are -inf the output is 0.

    Args:
        out_p, out_s: [..., hd] partial outputs; lse_p, lse_s: [...] their log-sum-exps.
        return_lse: also return the merged lse (to merge further parts).
    Returns:
        out [..., hd] in out_p's dtype (and lse [...] if return_lse).
    """
    if out_p.shape != out_s.shape or lse_p.shape != lse_s.shape or out_p.shape[:-1] != lse_p.shape:
        raise ValueError(f"cannot merge out {tuple(out_p.shape)} / {tuple(out_s.shape)} with lse "
                         f"{tuple(lse_p.shape)} / {tuple(lse_s.shape)}")
    dt = _acc_dtype(out_p)
    lse_p, lse_s = lse_p.to(dt), lse_s.to(dt)
    lse = torch.logaddexp(lse_p, lse_s)  # [...]
    ref = torch.where(torch.isfinite(lse), lse, 0.0)  # both parts empty: weights exp(-inf) = 0, not nan
    w_p, w_s = torch.exp(lse_p - ref)[..., None], torch.exp(lse_s - ref)[..., None]  # [..., 1]
    out = (out_p.to(dt) * w_p + out_s.to(dt) * w_s).to(out_p.dtype)
    return (out, lse) if return_lse else out


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
                    tree_mask: torch.Tensor | None) -> torch.Tensor:
    """Tree attention as prefix (no mask) + suffix (tree mask), merged by log-sum-exp.

    Args:
        q: [B, H, T, hd]; k, v: [B, Hkv, S, hd] with S = prefix_len + T (cache prefix, then the tree).
        prefix_len: P, the committed tokens every tree token sees.
        tree_mask: bool [T, T] / [B or 1, T, T] among the tree tokens, or None for causal.
    Returns:
        [B, H, T, hd], equal to ``dense_attention`` with the mask [all prefix | tree_mask].
    """
    B, H, Hkv, T, hd = check_shapes(q, k, v)
    if prefix_len < 0 or prefix_len + T != k.shape[2]:
        raise ValueError(f"prefix_len={prefix_len} + {T} tree tokens != {k.shape[2]} keys")
    out_p, lse_p = prefix_attention(q, k[:, :, :prefix_len], v[:, :, :prefix_len])
    out_s, lse_s = suffix_attention(q, k[:, :, prefix_len:], v[:, :, prefix_len:], tree_mask)
    return merge(out_p, lse_p, out_s, lse_s)
