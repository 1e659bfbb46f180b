"""A readable decoder-only Transformer for the GPT-2 and Llama families.

One config class covers both:
    GPT-2  (Radford et al. 2019): learned positions, LayerNorm, GELU (tanh), fused qkv, biases.
    Llama  (Touvron et al. 2023): RoPE (Su et al. 2021), RMSNorm, SwiGLU, grouped-query
           attention (Ainslie et al. 2023), tied or untied LM head.

``forward(tokens, positions, mask, kv)`` takes a general boolean attention mask, so draft
trees (chapter 4) run through the same model: each new token attends to the whole committed
prefix in the KV cache plus whichever new tokens its mask row allows.

Shapes: B batch, T new tokens, S = prefix + T keys, D model width, H query heads,
Hkv key/value heads, hd head dim, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import attend, causal_mask, check_backend
from .kv import PagedKVCache
from .linear import Linear

@dataclass
class ModelConfig:
    arch: str  # "gpt2" | "llama"
    vocab_size: int
    n_layer: int
    n_head: int
    d_model: int
    d_ff: int
    max_seq_len: int
    n_kv_head: int | None = None  # None -> n_head (no GQA)
    head_dim: int | None = None  # None -> d_model // n_head
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    name: str = ""
    eos_token_id: int | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.arch not in ("gpt2", "llama"):
            raise ValueError(f"arch must be 'gpt2' or 'llama', got {self.arch!r}")
        self.n_kv_head = self.n_kv_head or self.n_head
        self.head_dim = self.head_dim or self.d_model // self.n_head
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}")


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [B, T, V] (or [B, 1, V] with last_logits_only)
    hidden: torch.Tensor  # [B, T, D] last hidden state after the final norm
    layer_inputs: dict[int, torch.Tensor]  # layer index -> [B, T, D] hidden entering that layer


@dataclass
class Ragged:
    """A ragged batch's attention plan: per forward row (sequence in the paged cache, its new
    tokens n, tree mask, full mask), each as that sequence's forward alone would build them."""
    rows: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]]


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        if x.dtype == self.weight.dtype == torch.float32:  # one dispatch: the same bits as the lines below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables for positions [B, T] -> cos, signed sin [B, 1, T, hd] (half-split layout).

    The sin table carries rotate_half's sign, [-sin | sin], so that ``apply_rope`` swaps the halves
    without negating one (exactly the same values: a sign flip is exact)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    ang = positions[..., None].float() * inv_freq  # [B, T, hd/2]
    sin = ang.sin()
    return torch.cat([ang, ang], dim=-1)[:, None].cos(), torch.cat([-sin, sin], dim=-1)[:, None]  # [B, 1, T, hd]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1]; ``sin`` from ``rope_cos_sin`` holds the sign."""
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([x2, x1], dim=-1) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        bias = cfg.arch == "gpt2"
        H, Hkv, hd = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.wqkv = Linear(cfg.d_model, (H + 2 * Hkv) * hd, bias=bias)  # fused q, k, v
        self.wo = Linear(H * hd, cfg.d_model, bias=bias)
        self.backend = "dense"  # attention backend (chapter 6), set by Transformer.set_attention

    def forward(self, x, rope, mask, kv, tree_mask=None):
        cfg = self.cfg
        B, T, _ = x.shape
        H, Hkv, hd = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        qkv = self.wqkv(x)  # [B, T, (H + 2 Hkv) * hd]
        qk = qkv[..., :(H + Hkv) * hd].view(B, T, H + Hkv, hd).transpose(1, 2)  # [B, H + Hkv, T, hd]
        v = qkv[..., (H + Hkv) * hd:].view(B, T, Hkv, hd).transpose(1, 2)  # [B, Hkv, T, hd]
        if rope is not None:  # q and k rotate by the same angles: one call for both
            qk = apply_rope(qk, *rope)
        q, k = qk.split([H, Hkv], dim=1)  # [B, H, T, hd], [B, Hkv, T, hd]
        if isinstance(mask, Ragged):  # chapter 7: each sequence attends over its own prefix, as if alone
            kv.store(self.layer, k, v)
            out = torch.zeros_like(q)  # [B, H, T, hd]; a row's padding stays 0
            for r, (seq, n, tree_r, mask_r) in enumerate(mask.rows):
                k_r, v_r = kv.read(self.layer, seq)  # [1, Hkv, prefix_r + n, hd]
                out[r, :, :n] = attend(self.backend, q[r:r + 1, :, :n], k_r, v_r, k_r.shape[2] - n, tree_r, mask_r)[0]
            return self.wo(out.transpose(1, 2).reshape(B, T, H * hd))
        if kv is not None:
            k, v = kv.write(self.layer, k, v)  # [B, Hkv, S, hd] committed prefix + new
        # dense: SDPA with the full mask; split_*: mask-free prefix + masked tree, merged by log-sum-exp
        out = attend(self.backend, q, k, v, k.shape[2] - T, tree_mask, mask)  # [B, H, T, hd]
        return self.wo(out.transpose(1, 2).reshape(B, T, H * hd))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gpt2 = cfg.arch == "gpt2"
        if self.gpt2:
            self.fc = Linear(cfg.d_model, cfg.d_ff)
            self.proj = Linear(cfg.d_ff, cfg.d_model)
        else:
            self.gate_up = Linear(cfg.d_model, 2 * cfg.d_ff, bias=False)  # fused SwiGLU gate, up
            self.down = Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x):
        if self.gpt2:
            return self.proj(F.gelu(self.fc(x), approximate="tanh"))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        Norm = (lambda d: nn.LayerNorm(d, eps=cfg.norm_eps)) if cfg.arch == "gpt2" else (lambda d: RMSNorm(d, cfg.norm_eps))
        self.attn_norm, self.attn = Norm(cfg.d_model), Attention(cfg, layer)
        self.mlp_norm, self.mlp = Norm(cfg.d_model), MLP(cfg)

    def forward(self, x, rope, mask, kv, tree_mask=None):
        x = x + self.attn(self.attn_norm(x), rope, mask, kv, tree_mask)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, attention: str = "dense"):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.arch == "gpt2" else None
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps) if cfg.arch == "gpt2" else RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.attention = attention

    @property
    def attention(self) -> str:
        """Attention backend: "dense" | "split_torch" | "split_triton" (see minispec.attention)."""
        return self.blocks[0].attn.backend if len(self.blocks) else self._attention

    @attention.setter
    def attention(self, name: str) -> None:
        self.set_attention(name)

    def set_attention(self, name: str) -> "Transformer":
        """Choose the attention backend of every layer; ValueError for an unknown name."""
        check_backend(name, self.device)
        self._attention = name
        for block in self.blocks:
            block.attn.backend = name
        return self

    @property
    def device(self) -> torch.device:
        return self.tok_emb.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_emb.weight.dtype

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                kv=None, hidden_layers: tuple[int, ...] = (), last_logits_only: bool = False,
                ragged: dict[int, int] | None = None) -> ModelOutput:
        """Run the model on T new tokens.

        Args:
            tokens: [B, T] or [T] token ids.
            positions: [B, T] or [T] position ids; default prefix_len + arange(T).
            mask: None for causal, or a boolean mask (True = may attend) of shape [T, T] / [B, T, T]
                among the new tokens (the committed prefix is always visible), or [T, S] /
                [B, T, S] over prefix + new keys. The split attention backends (``self.attention``)
                run for None and the [T, T] / [B, T, T] forms; a [T, S] mask falls back to dense.
            kv: optional KVCache; the new keys/values are written as *pending* entries that the
                caller keeps with ``kv.commit(...)`` or drops with ``kv.discard()``.
            hidden_layers: layer indices whose input hidden states to return (EAGLE-3 fusion).
            last_logits_only: compute the LM head for the last token only (prefill).
            ragged: a batch of sequences of different lengths on a paged KV cache (chapter 7):
                ``{sequence in kv: its n new tokens}`` in row order, tokens right-padded to T. Row r's
                first n tokens are its new ones; ``mask`` is None (causal) or one entry per row, None
                or a bool [n, n] tree mask; ``positions`` default to each sequence's length + arange.
                Every row computes what its sequence's forward alone computes, bit for bit (the
                linear layers are row-invariant, ``minispec.linear``, and attention runs per row);
                the padding rows' outputs are meaningless; last_logits_only takes each row's n-th.
        Returns:
            ModelOutput(logits [B, T, V], hidden [B, T, D], layer_inputs {i: [B, T, D]}).
        """
        cfg = self.cfg
        if tokens.dim() == 1:
            tokens = tokens[None]
        B, T = tokens.shape
        if ragged is not None:
            positions, mask = self._ragged_plan(ragged, tokens, positions, mask, kv)
            tree = None
        else:
            prefix = kv.length if kv is not None else 0
            if positions is None:
                positions = torch.arange(prefix, prefix + T, device=tokens.device)
            tree, mask = self._masks(mask, B, T, prefix, tokens.device)
        positions = positions.expand(B, T) if positions.dim() == 1 else positions
        if int(positions.max()) >= cfg.max_seq_len:
            raise ValueError(f"position {int(positions.max())} is beyond the model's context of {cfg.max_seq_len} tokens")
        if kv is not None:
            kv.begin(B, T if ragged is None else ragged)  # raises on overflow before anything is written
        try:
            x = self.tok_emb(tokens)  # [B, T, D]
            if cfg.arch == "gpt2":
                x = x + self.pos_emb(positions)
                rope = None
            else:
                rope = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
            layer_inputs = {}
            for i, block in enumerate(self.blocks):
                if i in hidden_layers:
                    layer_inputs[i] = x
                x = block(x, rope, mask, kv, tree)
            h = self.norm(x)  # [B, T, D]
        except BaseException:
            if kv is not None:
                kv.discard()
            raise
        if last_logits_only:
            h_last = h[:, -1:] if ragged is None else h[torch.arange(B), torch.tensor(list(ragged.values())) - 1][:, None]
        logits = self.lm_head(h_last if last_logits_only else h)  # [B, T or 1, V]
        return ModelOutput(logits=logits, hidden=h, layer_inputs=layer_inputs)

    def _masks(self, mask, B: int, T: int, prefix: int, device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(tree, mask): the split backends' [B or 1, T, T] suffix mask when the whole prefix is
        visible (else None), and the dense [B, 1, T, S] mask (None: plain causal)."""
        tree = None
        if mask is None and T > 1 and prefix and self.attention == "dense":
            mask = causal_mask(T, prefix + T, device)  # [T, S] built once, not in every layer
        if mask is not None:
            tree = (mask if mask.dim() == 3 else mask[None]) if mask.shape[-1] == T else None
            mask = self._full_mask(mask, B, T, prefix)
        return tree, mask

    def _ragged_plan(self, ragged: dict[int, int], tokens, positions, mask, kv) -> tuple[torch.Tensor, Ragged]:
        """Positions [B, T] and the per-row attention plan of a ragged batch (see ``forward``)."""
        B, T = tokens.shape
        seqs, ns = list(ragged), [int(n) for n in ragged.values()]
        if not isinstance(kv, PagedKVCache):
            raise TypeError("a ragged batch needs a paged KV cache (minispec.kv.PagedKVCache)")
        if len(seqs) != B or not all(1 <= n <= T for n in ns):
            raise ValueError(f"ragged={ragged} must give 1..{T} new tokens for each of the {B} rows")
        masks = [None] * B if mask is None else list(mask)
        if len(masks) != B:
            raise ValueError(f"a ragged batch takes one mask (or None) per row, got {len(masks)} for {B} rows")
        prefix = [kv.lengths[s] for s in seqs]
        if positions is None:
            positions = torch.tensor(prefix, device=tokens.device)[:, None] + torch.arange(T, device=tokens.device)
        return positions, Ragged([(s, n, *self._masks(m, 1, n, p, tokens.device))
                                  for s, n, m, p in zip(seqs, ns, masks, prefix)])

    @staticmethod
    def _full_mask(mask: torch.Tensor, B: int, T: int, prefix: int) -> torch.Tensor:
        """Bring a boolean mask to [B, 1, T, prefix + T] for SDPA."""
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be boolean (True = may attend), got {mask.dtype}")
        mask = mask if mask.dim() == 3 else mask[None]  # [B or 1, T, T or S]
        if mask.shape[-2] != T or mask.shape[-1] not in (T, prefix + T):
            raise ValueError(f"mask of shape {tuple(mask.shape)} does not fit {T} new tokens after a prefix of {prefix}")
        if mask.shape[-1] == T and prefix:
            seen = torch.ones(*mask.shape[:-1], prefix, dtype=torch.bool, device=mask.device)
            mask = torch.cat([seen, mask], dim=-1)  # [B, T, S]
        return mask.expand(B, T, prefix + T)[:, None]  # [B, 1, T, S]
