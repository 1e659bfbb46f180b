"""The dense attention backend: one SDPA call over the committed prefix and the new tokens with a boolean mask,
its grouped-query heads folded into query rows so that no kernel copies K / V out to every query head.

Shapes: B batch, H query heads, Hkv KV heads, G = H / Hkv, T new tokens, S = prefix + T keys, hd head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of q [B, H, T, hd] over k, v [B, Hkv, S, hd] in one SDPA call (grouped-query: query
    head h reads KV head h // G, as ``repeat_interleave`` and SDPA's ``enable_gqa``).

    mask: None for causal (the T queries at the last T key positions), or bool (True = may attend) [T, S] or
    [B or 1, 1, T, S]. With a mask and G > 1 the G query heads of a KV head are folded into its query rows,
    q -> [B, Hkv, G*T, hd] with the mask repeated over G, so that SDPA runs plain multi-head attention and
    no kernel copies K / V out to every query head (PyTorch's memory-efficient CUDA kernel takes a mask but no
    GQA; its flash kernel takes GQA but no mask). Returns [B, H, T, hd]."""
    B, H, T, hd = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if mask is None:
        if T == 1 or S == T:  # plain causal: no mask tensor needed
            return F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=H != Hkv)
        mask = causal_mask(T, S, q.device)  # [T, S]
    if H == Hkv:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    G = H // Hkv
    rows = mask.repeat(*(1,) * (mask.dim() - 2), G, 1)  # [.., G*T, S]: row (g, t) is mask row t
    out = F.scaled_dot_product_attention(q.reshape(B, Hkv, G * T, hd), k, v, attn_mask=rows)  # [B, Hkv, G*T, hd]
    return out.reshape(B, H, T, hd)


def causal_mask(T: int, S: int, device) -> torch.Tensor:
    """[T, S] mask: new token i (at key index S-T+i) sees keys 0..S-T+i."""
    return torch.ones(T, S, dtype=torch.bool, device=device).tril(S - T)
