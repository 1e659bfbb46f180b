"""A readable decoder-only Transformer for the GPT-2 and Llama families.

One config class covers both:
    GPT-2  (Radford et al. 2019): learned positions, LayerNorm, GELU (tanh), fused qkv, biases.
    Llama  (Touvron et al. 2023): RoPE (Su et al. 2021), RMSNorm (Zhang and Sennrich 2019), SwiGLU,
           grouped-query attention (Ainslie et al. 2023), tied or untied LM head.

``forward(tokens, positions, mask, kv)`` takes a general boolean attention mask, so draft trees
(chapter 4) run through the same model: each new token attends to the whole committed prefix in the
KV cache plus whichever new tokens its mask row allows. Positions and masks become an attention plan
(``minispec.attention.plan``) before the forward; a ragged batch (chapter 7) or a static cache for
CUDA graphs (chapter 8) builds its own plan and passes it in, so the forward itself reads the same
for all: embed, blocks, norm, LM head. Each attention layer computes q, k, v and hands them to
``plan.attend``, which stores the new keys and values in the cache (any ``minispec.kv.KVCacheProtocol``)
and runs the model's attention backend (``minispec.attention``, chosen by name: ``set_attention``).

The layers are plain ``nn.Linear``; a backend that needs other layers swaps them in with one call
after the model is built, as gpt-fast's ``quantize.py`` swaps its linears (``load()`` does it for
CPU float32 models: ``minispec.exact``).

Shapes: B batch, T new tokens, S = prefix + T keys, D model width, H query heads,
Hkv key/value heads, hd head dim, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import BACKENDS, check_backend
from .attention.plan import Plan, prepare
from .kv.protocol import KVCacheProtocol


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


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))
        # d and eps as 0-dim CPU tensors: a Python number is converted anew in every op that takes it
        with torch.inference_mode(False):  # normal tensors, usable under autograd whatever mode builds the model
            self.consts = torch.tensor(float(d), device="cpu"), torch.tensor(eps, device="cpu")

    def forward(self, x):
        d, eps = self.consts
        h = x if x.dtype == torch.float32 else x.float()
        h = h * torch.rsqrt(torch.addcdiv(eps, (h * h).sum(-1, keepdim=True), d))  # [.., D]; addcdiv: eps + ss / d
        return (h if h.dtype == x.dtype else h.to(x.dtype)) * self.weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables for positions [B, T] -> cos, signed sin [B, 1, T, hd] (half-split layout).

    The sin table carries rotate_half's sign, [-sin | sin], so that ``apply_rope`` swaps the halves
    without negating one (exactly the same values: a sign flip is exact)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    ang = positions[..., None].float() * inv_freq  # [B, T, hd/2]
    sin = ang.sin()
    return torch.cat([ang, ang], dim=-1)[:, None].cos(), torch.cat([-sin, sin], dim=-1)[:, None]  # [B, 1, T, hd]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, swap: torch.Tensor | None = None) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1]; ``sin`` from ``rope_cos_sin`` holds the sign.
    ``swap``: x's shape of indices into its last dim, [hd/2, .., hd-1, 0, .., hd/2-1] (``RoPE``), which swaps the
    halves in one op."""
    if swap is not None:
        swapped = torch.gather(x, -1, swap)  # [.., hd]: [x2, x1]
    else:
        x1, x2 = x.split([x.shape[-1] // 2] * 2, dim=-1)
        swapped = torch.cat([x2, x1], dim=-1)
    out = x * cos + swapped * sin
    return out if out.dtype == x.dtype else out.to(x.dtype)


class RoPE:
    """``rope_cos_sin`` for every position below ``context``, computed once (per device), as gpt-fast's
    ``freqs_cis``: a forward gathers its positions' rows (the same values, elementwise) instead of recomputing them.

    Returns, for positions [B, T]: (cos, sin [B, 1, T, hd], the half-swap index [B, heads, T, hd]) for ``apply_rope``
    on the ``heads`` rotated heads (q's and k's)."""

    def __init__(self, head_dim: int, theta: float, context: int, heads: int):
        self.head_dim, self.theta, self.context, self.heads = head_dim, theta, context, heads
        self.tables: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tables = self.tables.get(positions.device)
        if tables is None:
            with torch.inference_mode(False):  # normal tensors, usable under autograd whatever mode builds them
                cos, sin = rope_cos_sin(torch.arange(self.context, device=positions.device)[None], self.head_dim, self.theta)
                half = self.head_dim // 2
                swap = torch.cat([torch.arange(half, self.head_dim), torch.arange(half)]).to(positions.device)
                tables = self.tables[positions.device] = cos[0, 0], sin[0, 0], swap  # [context, hd] each, [hd]
        cos, sin, swap = tables
        rows = positions[:, None]  # [B, 1, T]
        B, T = positions.shape
        return cos[rows], sin[rows], swap.expand(B, self.heads, T, -1)  # [B, 1, T, hd] each, [B, heads, T, hd]


class Attention(nn.Module):
    """Self-attention with RoPE and grouped-query heads (H query heads share Hkv key/value heads,
    never repeated in memory), one fused q / k / v projection. The target's layers and the EAGLE
    heads use it alike; where the new keys go and which keys a query sees is the plan's business
    (``minispec.attention.plan``).

    Args: the model width D, H, Hkv and hd; ``layer`` its index in the KV cache; ``bias`` (GPT-2);
    ``d_in`` the input width when it is not D (EAGLE-3 attends from [embedding, hidden], 2D).
    """

    def __init__(self, d_model: int, n_head: int, n_kv_head: int, head_dim: int, layer: int = 0, bias: bool = False,
                 d_in: int | None = None):
        super().__init__()
        self.layer, self.n_head, self.n_kv_head, self.head_dim = layer, n_head, n_kv_head, head_dim
        self.wqkv = nn.Linear(d_in or d_model, (n_head + 2 * n_kv_head) * head_dim, bias=bias)  # fused q, k, v
        self.wo = nn.Linear(n_head * head_dim, d_model, bias=bias)

    def qkv(self, x: torch.Tensor, rope, shape: tuple[int, int] | None = None) -> tuple[torch.Tensor, ...]:
        """x [B, T, d_in] (or its rows [B*T, d_in] with ``shape`` = (B, T)) -> q [B, H, T, hd], k, v [B, Hkv, T, hd];
        q and k rotated by ``rope`` (None: GPT-2)."""
        B, T = shape or x.shape[:2]
        H, Hkv, hd = self.n_head, self.n_kv_head, self.head_dim
        qkv = self.wqkv(x)  # [B*T, (H + 2 Hkv) hd] (or [B, T, ..])
        # [B, H + 2 Hkv, T, hd]; one new token: [B, 1, H + 2 Hkv, hd] is that already
        qkv = qkv.view(B, H + 2 * Hkv, 1, hd) if T == 1 else qkv.view(B, T, H + 2 * Hkv, hd).transpose(1, 2)
        qk, v = qkv.split([H + Hkv, Hkv], dim=1)  # [B, H + Hkv, T, hd], [B, Hkv, T, hd]
        if rope is not None:  # q and k rotate by the same angles: one call for both
            qk = apply_rope(qk, *rope)
        q, k = qk.split([H, Hkv], dim=1)  # [B, H, T, hd], [B, Hkv, T, hd]
        return q, k, v

    def out(self, attn: torch.Tensor, rows: bool = False) -> torch.Tensor:
        """The heads' outputs [B, H, T, hd] -> [B, T, D] (``rows``: [B*T, D])."""
        B, _, T, _ = attn.shape
        # one new token: the heads already lie in order, [B, H, 1, hd] is [B, H*hd]
        if T == 1:
            o = attn.view(B, -1) if attn.is_contiguous() else attn.reshape(B, -1)  # [B, H*hd]
        else:
            o = attn.transpose(1, 2).reshape(B * T, -1)  # [B*T, H*hd]
        y = self.wo(o)  # [B*T, D]
        return y if rows else y.view(B, T, -1)

    def forward(self, x, rope, plan: Plan, kv: KVCacheProtocol | None):
        """x [B, T, d_in] or its rows [B*T, d_in] (the Transformer's) -> the same shape with D features."""
        q, k, v = self.qkv(x, rope, plan.positions.shape)
        return self.out(plan.attend(self.layer, q, k, v, kv), rows=x.dim() == 2)

    def parts(self) -> dict[str, list[tuple[str, int]]]:
        """The fused weights' parts under their Hugging Face names, with their output rows (``hf_names``)."""
        H, Hkv, hd = self.n_head, self.n_kv_head, self.head_dim
        return {"wqkv": [("q_proj", H * hd), ("k_proj", Hkv * hd), ("v_proj", Hkv * hd)],
                "wo": [("o_proj", self.wo.out_features)]}


class MLP(nn.Module):
    """GPT-2's GELU MLP, or Llama's SwiGLU with its gate and up projections fused (target and EAGLE heads)."""

    def __init__(self, d_model: int, d_ff: int, gpt2: bool = False):
        super().__init__()
        self.gpt2 = gpt2
        if self.gpt2:
            self.fc = nn.Linear(d_model, d_ff)
            self.proj = nn.Linear(d_ff, d_model)
        else:
            self.gate_up = nn.Linear(d_model, 2 * d_ff, bias=False)  # fused SwiGLU gate, up
            self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x):
        if self.gpt2:
            return self.proj(F.gelu(self.fc(x), approximate="tanh"))
        d_ff = self.down.in_features
        gate, up = self.gate_up(x).split([d_ff, d_ff], dim=-1)
        return self.down(F.silu(gate) * up)

    def parts(self) -> dict[str, list[tuple[str, int]]]:
        d_ff = self.down.in_features
        return {"gate_up": [("gate_proj", d_ff), ("up_proj", d_ff)], "down": [("down_proj", self.down.out_features)]}


def hf_names(module: Attention | MLP) -> Attention | MLP:
    """Save and load ``module``'s fused projections under their Hugging Face (Llama) names, those of
    the official EAGLE checkpoints: wqkv as q_proj, k_proj, v_proj; wo as o_proj; gate_up as gate_proj,
    up_proj; down as down_proj (the one place these names are mapped for a module). Returns ``module``."""

    def save(mod, state: dict, prefix: str, local_metadata) -> None:
        for fused, parts in mod.parts().items():
            for kind in ("weight", "bias"):
                t = state.pop(f"{prefix}{fused}.{kind}", None)
                if t is not None:
                    state.update({f"{prefix}{name}.{kind}": p for (name, _), p in
                                  zip(parts, t.split([n for _, n in parts]))})

    def load(mod, state: dict, prefix: str, local_metadata, strict, missing, unexpected, error_msgs) -> None:
        for fused, parts in mod.parts().items():
            for kind in ("weight", "bias"):
                names = [f"{prefix}{name}.{kind}" for name, _ in parts]
                if all(n in state for n in names):
                    state[f"{prefix}{fused}.{kind}"] = torch.cat([state.pop(n) for n in names])
                elif any(n in state for n in names):
                    missing += [n for n in names if n not in state]

    module.register_state_dict_post_hook(save)
    module.register_load_state_dict_pre_hook(load)
    return module


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        Norm = (lambda d: nn.LayerNorm(d, eps=cfg.norm_eps)) if cfg.arch == "gpt2" else (lambda d: RMSNorm(d, cfg.norm_eps))
        gpt2 = cfg.arch == "gpt2"
        self.attn_norm = Norm(cfg.d_model)
        self.attn = Attention(cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.head_dim, layer, bias=gpt2)
        self.mlp_norm, self.mlp = Norm(cfg.d_model), MLP(cfg.d_model, cfg.d_ff, gpt2)

    def forward(self, x, rope, plan: Plan, kv: KVCacheProtocol | None):
        x = x + self.attn(self.attn_norm(x), rope, plan, kv)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, attention: str = "dense"):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.arch == "gpt2" else None
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps) if cfg.arch == "gpt2" else RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.rope = RoPE(cfg.head_dim, cfg.rope_theta, cfg.max_seq_len, cfg.n_head + cfg.n_kv_head) \
            if cfg.arch == "llama" else None
        self.attention = attention

    @property
    def attention(self) -> str:
        """The attention backend's name: "dense" | "split_torch" | "split_triton" | a registered one
        (``minispec.attention``)."""
        return self._attention

    @attention.setter
    def attention(self, name: str) -> None:
        self.set_attention(name)

    def set_attention(self, name: str) -> "Transformer":
        """Choose the attention backend of every layer; ValueError for an unknown name."""
        self._attention = check_backend(name, self.device)
        return self

    @property
    def device(self) -> torch.device:
        return self.tok_emb.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_emb.weight.dtype

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                kv: KVCacheProtocol | None = None, hidden_layers: tuple[int, ...] = (), last_logits_only: bool = False,
                plan: Plan | None = None) -> ModelOutput:
        """Run the model on T new tokens.

        Args:
            tokens: [B, T] or [T] token ids.
            positions, mask: what ``plan`` is built from when it is not given (``prepare``):
                positions [B, T] or [T], default prefix_len + arange(T); mask None for causal, or
                a boolean mask (True = may attend) of shape [T, T] / [B, T, T] among the new tokens
                (the committed prefix is always visible), or [T, S] / [B, T, S] over prefix + new
                keys. The split attention backends (``self.attention``) run for None and the
                [T, T] / [B, T, T] forms; a [T, S] mask falls back to dense.
            kv: optional KV cache (``minispec.kv.KVCacheProtocol``); the new keys/values are written
                as *pending* entries that the caller keeps with ``kv.commit(...)`` or drops with
                ``kv.discard()`` (a forward that raises discards them).
            hidden_layers: layer indices whose input hidden states to return (EAGLE-3 fusion).
            last_logits_only: compute the LM head for each row's last token only (prefill).
            plan: the attention plan (``minispec.attention.plan``), built before the forward: a
                ragged batch's (``prepare_ragged``, chapter 7) or a static cache's
                (``cuda_graphs.static_plan``, chapter 8); its slots already reserved in ``kv``. A plan
                built without a backend runs this model's.
        Returns:
            ModelOutput(logits [B, T, V], hidden [B, T, D], layer_inputs {i: [B, T, D]}).
        """
        tokens = tokens if tokens.dim() == 2 else tokens[None]  # [B, T]
        if plan is None:
            plan = self.plan(tokens, positions, mask, kv)
        elif positions is not None or mask is not None:
            raise ValueError("give positions and mask to the plan, not beside it")
        elif plan.attention is None:  # a plan built without a backend takes the model's
            plan.use(BACKENDS[self.attention])
        try:
            h, layer_inputs = self.run(tokens, plan, kv, hidden_layers)  # [B, T, D]
        except BaseException:
            if kv is not None:
                kv.discard()
            raise
        logits = self.lm_head(plan.last(h) if last_logits_only else h)  # [B, T or 1, V]
        return ModelOutput(logits=logits, hidden=h, layer_inputs=layer_inputs)

    def plan(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, mask: torch.Tensor | None = None,
             kv: KVCacheProtocol | None = None) -> Plan:
        """The plan of a forward of ``tokens`` [B, T] after ``kv``'s prefix, for this model's backend and context
        (``minispec.attention.plan.prepare``); the cache's pending slots are reserved."""
        B, T = tokens.shape
        return prepare(B, T, tokens.device, kv, positions, mask, self.attention, self.cfg.max_seq_len)

    def run(self, tokens: torch.Tensor, plan: Plan, kv, hidden_layers: tuple[int, ...] = ()):
        """Embedding, blocks, final norm: tokens [B, T] -> (hidden [B, T, D], layer_inputs {i: [B, T, D]}).
        The blocks work on the B*T rows, [B*T, D], as a linear layer takes them."""
        B, T = tokens.shape
        x = self.tok_emb(tokens.reshape(-1))  # [B*T, D]
        if self.rope is None:  # GPT-2: learned positions
            x, rope = x + self.pos_emb(plan.positions.reshape(-1)), None
        else:
            rope = self.rope(plan.positions)  # cos, sin [B, 1, T, hd], the half-swap index
        layer_inputs = {}
        for i, block in enumerate(self.blocks):
            if i in hidden_layers:
                layer_inputs[i] = x.view(B, T, -1)
            x = block(x, rope, plan, kv)
        return self.norm(x).view(B, T, -1), layer_inputs
