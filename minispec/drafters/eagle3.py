"""EAGLE-3: a one-layer draft head on fused low/mid/high target features, trained by training-time test.

Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test". Compared with EAGLE-1/2 (``drafters/eagle.py``) the head

  * reads three target layers, not the last hidden state: the hidden states ENTERING layers
    (2, L//2, L-3), concatenated [3H] and fused by ``fc`` [H, 3H] (no bias);
  * drafts over its own small vocabulary (``draft_vocab_size``, the most frequent tokens of the
    training data) with its own ``lm_head`` [Vd, H] and final ``norm``; ``d2t`` maps a draft id
    to a target id (target_id = draft_id + d2t[draft_id]) and ``t2d`` [V] marks the target ids
    the draft vocabulary keeps;
  * feeds its attention ``cat[input_layernorm(embed(token)), hidden_norm(h)]`` [2H], with the
    residual taken from the un-normed h;
  * at its next step is fed its OWN pre-norm output hidden state as h (no fc again): training
    unrolls the head on its own outputs ("training-time test", ``minispec.train.eagle3``), so it
    no longer needs to imitate the target's features.

The layer's attention and MLP are the target's own modules (``minispec.model``: fused
projections, grouped-query attention, the same RoPE and attention plan). Key names follow the
official checkpoints (``fc.weight``, ``midlayer.*`` with ``self_attn.{q,k,v,o}_proj`` and
``mlp.{gate,up,down}_proj``, mapped by ``model.hf_names``, ``norm.weight``, ``lm_head.weight``,
``d2t``, ``t2d``), so ``Eagle3Head.load_state_dict`` reads them as they are.

Alignment in minispec (as for EAGLE-1): when ``propose`` runs, ``prefill`` and ``commit`` have delivered
the target features f_0..f_{n-2} of context[:-1]; the last context token x_{n-1} is the root.
Head position j takes (x_{j+1}, f_j) at RoPE position j and predicts x_{j+2}; so head position
n-2 (the root with f_{n-2}) scores the root's children. A tree node at depth d takes (its token,
the head's output hidden at its parent) at position n-2+d, attending to the committed positions,
its tree ancestors and itself.

Shapes: T new positions, S keys, H hidden, Hq / Hkv heads, hd head dim, Vd draft vocab, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .. import exact
from ..attention.plan import Plan, head_plan
from ..kv import KVCache, StaticKVCache
from ..model import MLP, Attention, RMSNorm, hf_names, rope_cos_sin
from .base import Features
from .graphed_draft import GraphedHead, step_plan
from .tree_drafter import GrowingTree, TreeDrafter, TreeSpec
from .defaults import default_tree


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0  # official EAGLE-3 configs often omit it: 10000 then
    head_dim: int | None = None
    max_position_embeddings: int = 2048

    def __post_init__(self):
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d: dict) -> "Eagle3Config":
        """A Llama-style config dict (official ``config.json`` or minispec's) -> Eagle3Config."""
        need = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", "draft_vocab_size")
        missing = [k for k in need if k not in d]
        if missing:
            raise ValueError(f"EAGLE-3 config lacks {missing}")
        return cls(d["hidden_size"], d["intermediate_size"], d["num_attention_heads"],
                   d.get("num_key_value_heads") or d["num_attention_heads"], d["vocab_size"], d["draft_vocab_size"],
                   d.get("rms_norm_eps", 1e-5), d.get("rope_theta") or 10000.0, d.get("head_dim"),
                   d.get("max_position_embeddings", 2048))

    def to_dict(self) -> dict:
        return dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                    hidden_act="silu", **self.__dict__)

    @classmethod
    def for_target(cls, target, draft_vocab_size: int) -> "Eagle3Config":
        c = target.cfg
        return cls(c.d_model, c.d_ff, c.n_head, c.n_kv_head, c.vocab_size, draft_vocab_size, c.norm_eps,
                   c.rope_theta, c.head_dim, c.max_seq_len)


def eagle3_layers(n_layer: int) -> tuple[int, int, int]:
    """The target layers whose INPUT hidden states EAGLE-3 fuses: low, middle, high."""
    return (2, n_layer // 2, n_layer - 3) if n_layer >= 6 else (0, n_layer // 2, n_layer - 1)


class _MidLayer(nn.Module):
    """The head's decoder layer: the target's ``Attention`` (from [embedding, hidden], 2H wide) and
    ``MLP`` (GQA, RoPE), saved under the official names (``hf_names``)."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        H = c.hidden_size
        self.hidden_norm = RMSNorm(H, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.self_attn = hf_names(Attention(H, c.num_attention_heads, c.num_key_value_heads, c.head_dim, d_in=2 * H))
        self.post_attention_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.mlp = hf_names(MLP(H, c.intermediate_size))


class Eagle3Head(nn.Module):
    """The EAGLE-3 draft head (official key layout). The token embedding is the target's, passed in.
    ``attention`` names its attention backend (``minispec.attention``; "exact" where its target runs it)."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.config = c
        H = c.hidden_size
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.midlayer = _MidLayer(c)
        self.norm = RMSNorm(H, c.rms_norm_eps)
        self.lm_head = nn.Linear(H, c.draft_vocab_size, bias=False)
        self.attention = "dense"
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))

    def attn_input(self, emb: torch.Tensor, h: torch.Tensor, positions: torch.Tensor):
        """Start of the layer: emb, h [B, T, H] (h fused or the head's own), positions [B, T] -> q [B, Hq, T, hd],
        k, v [B, Hkv, T, hd] (RoPE applied)."""
        c, m = self.config, self.midlayer
        x = torch.cat([m.input_layernorm(emb), m.hidden_norm(h)], dim=-1)  # [B, T, 2H], embedding first
        return m.self_attn.qkv(x, rope_cos_sin(positions, c.head_dim, c.rope_theta))

    def finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """End of the layer: residual h [B, T, H] + o_proj(attn [B, Hq, T, hd]), then the MLP -> [B, T, H] pre-norm."""
        m = self.midlayer
        x = h + m.self_attn.out(attn)
        return x + m.mlp(m.post_attention_layernorm(x))

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Pre-norm output hidden [..., H] -> logits over the draft vocabulary [..., Vd]."""
        return self.lm_head(self.norm(out))

    def to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits [..., Vd] -> target-vocab logits [..., V], -inf outside the draft vocab."""
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        ids = torch.arange(self.config.draft_vocab_size, device=logits.device) + self.d2t  # [Vd] target ids
        return full.index_copy_(-1, ids, logits)

    def forward(self, emb, h, positions, kv: KVCache, mask: torch.Tensor | None = None,
                plan: Plan | None = None) -> torch.Tensor:
        """One step over T new positions with a KV cache (inference).

        Args:
            emb: [1, T, H] target embeddings of the input tokens.
            h: [1, T, 3H] fused target features (fc is applied) or [1, T, H] the head's own outputs.
            positions: [1, T] RoPE positions.
            kv: the head's cache (one layer); the new keys/values are left pending.
            mask: None (causal over the new tokens) or boolean [T, S] over cached + new keys.
            plan: the attention plan when the caller built it (a static cache's, ``cuda_graphs.static_plan``:
                then positions and mask are the plan's); None: ``prepare`` builds it.
        Returns:
            [1, T, H] pre-norm output hidden states.
        """
        if h.shape[-1] == 3 * self.config.hidden_size:
            h = self.fc(h)
        B, T, _ = emb.shape
        plan = head_plan(plan, self.attention, B, T, emb.device, kv, positions, mask)  # prefix + causal or the tree's
        try:
            q, k, v = self.attn_input(emb, h, plan.positions)
            return self.finish(h, plan.attend(self.midlayer.self_attn.layer, q, k, v, kv))  # GQA: no K / V repeated
        except BaseException:
            kv.discard()
            raise


def build_vocab_map(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft vocabulary: the ``draft_vocab_size`` most frequent target tokens, in id order.

    Args:
        token_counts: [V] how often each target token occurs in the training data.
        draft_vocab_size: Vd <= V.
    Returns:
        d2t [Vd] long (target_id = draft_id + d2t[draft_id]), t2d [V] bool (kept target ids).
    """
    V = token_counts.numel()
    if not 0 < draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size must be in 1..{V}, got {draft_vocab_size}")
    order = torch.argsort(token_counts.double(), descending=True, stable=True)  # ties: lower id first
    kept = order[:draft_vocab_size].sort().values  # [Vd] target ids, increasing
    d2t = kept - torch.arange(draft_vocab_size)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d


class Eagle3Drafter(GraphedHead, TreeDrafter):
    """EAGLE-3 drafting through ``TreeDrafter``: chains, static trees, EAGLE-2 dynamic trees.

    Args:
        target: the target Transformer (its token embedding is used; its features arrive through
            ``prefill`` and ``commit``).
        head: a trained ``Eagle3Head``.
        tree: a ``TreeSpec`` or its string form ('chain:5', 'eagle', '5,8,32', ...); default
            ``defaults.DEFAULT_TREES['eagle3']``.
        capacity: the head's KV cache size in tokens (grown on demand).
    ``use_graphs()`` (chapter 8, ``generate(..., cuda_graphs=True)``) drafts chains and dynamic trees as one
    CUDA graph per bucket (``graphed_draft.GraphedDraft``) over a static cache of the head.
    """

    reads_features = True

    def __init__(self, target, head: Eagle3Head, tree: "TreeSpec | str | int | None" = None, capacity: int = 1024):
        super().__init__(tree if tree is not None else default_tree("eagle3"))
        self.head, self.embed = head, target.tok_emb
        self.target_layers = eagle3_layers(target.cfg.n_layer)
        self.kv = self._head_cache(False, capacity)
        self.check_target(target)
        exact.follow(target, head)  # the head computes as its target does
        self.prefill([])

    def _head_cache(self, static: bool, capacity: int | None = None) -> KVCache | StaticKVCache:
        """An empty one-layer cache for the head (static: chapter 8's, for graphs)."""
        c, w = self.head.config, self.head.fc.weight
        return (StaticKVCache if static else KVCache)(1, c.num_key_value_heads, c.head_dim,
                                                      capacity or self.kv.capacity, dtype=w.dtype, device=w.device)

    def __repr__(self):
        c = self.head.config
        return f"Eagle3Drafter(hidden {c.hidden_size}, draft vocab {c.draft_vocab_size}, {self.spec.name})"

    def check_target(self, target) -> None:
        c, t = self.head.config, target.cfg
        if (c.hidden_size, c.vocab_size) != (t.d_model, t.vocab_size):
            raise ValueError(f"EAGLE-3 head (hidden {c.hidden_size}, vocab {c.vocab_size}) does not fit the target "
                             f"(hidden {t.d_model}, vocab {t.vocab_size})")

    def prefill(self, tokens: list[int], features: Features | None = None) -> None:
        self.kv.reset()
        self.pending: list[torch.Tensor] = []  # fused features [n, 3H] not yet run through the head
        self.observed = 0  # target features received (= committed head positions after _start)
        super().prefill(tokens, features)  # hands the features to observe

    @torch.inference_mode()
    def observe(self, features: Features) -> None:
        """Receive the target's features of newly committed tokens: the inputs {i: [n, H]} of its layers."""
        fused = torch.cat([features.layers[i] for i in self.target_layers], dim=-1)  # [n, 3H] low, mid, high
        self.pending.append(fused.to(self.head.fc.weight.dtype))
        self.observed += fused.shape[0]

    def _emb(self, tokens: list[int]) -> torch.Tensor:
        return self.embed(torch.tensor([tokens], device=self.embed.weight.device)).to(self.head.fc.weight.dtype)

    def _new_pairs(self) -> tuple[list[int], torch.Tensor]:
        """The pairs committed since the last draft: tokens [T], fused features [T, 3H] (positions done..n-2)."""
        context = self.context
        n, done = len(context), self.kv.length
        if self.observed != n - 1 or not self.pending:
            raise RuntimeError(f"EAGLE-3 drafter has features of {self.observed} tokens and {done} cached; a context of "
                               f"{n} needs {n - 1} (hand them over with prefill and commit)")
        feats = torch.cat(self.pending)  # [T, 3H]
        self.pending = []
        return context[done + 1:], feats

    def _step(self, tokens: torch.Tensor, h: torch.Tensor, plan) -> torch.Tensor:
        """The head on a static plan: tokens [1, T], h [1, T, 3H or H] -> output hidden [1, T, H]."""
        return self.head(self.embed(tokens).to(h.dtype), h, plan.positions, self.kv, plan=plan)

    def _graph_logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.head.to_target_logits(self.head.draft_logits(out))

    def _features(self) -> tuple[int, torch.dtype]:
        return 3 * self.head.config.hidden_size, self.head.fc.weight.dtype

    def _plan(self, positions: torch.Tensor, mask: torch.Tensor | None):
        """A static cache's plan for an eager head forward (graphs on), else None (the head prepares its own)."""
        return step_plan(self.kv, positions[0], mask) if self.graph is not None else None

    def _start(self) -> torch.Tensor:
        context = self.context
        n, done = len(context), self.kv.length
        tokens, feats = self._new_pairs()
        feats = feats[None]  # [1, T, 3H] positions done..n-2
        self.kv.reserve(n + self.max_nodes + 1)
        positions = torch.arange(done, n - 1, device=feats.device)[None]
        out = self.head(self._emb(tokens), feats, positions, self.kv, plan=self._plan(positions, None))  # [1, T, H]
        self.kv.commit()
        self.forwards += 1
        self._root_hidden = out[0, -1]  # [H] the root's output: the hidden input of depth-1 nodes
        self._hidden, self._tree = [], GrowingTree()
        return self.head.to_target_logits(self.head.draft_logits(out[0, -1]))

    def _extend(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        L = self.kv.length - len(self._tree)  # committed positions; the root at L - 1
        h = torch.stack([self._root_hidden if p < 0 else self._hidden[p] for p in parents])[None]  # [1, n, H]
        positions, mask = self._tree.add(parents, L, h.device)  # [n], [n, S]
        positions = positions[None]  # [1, n]
        out = self.head(self._emb(tokens), h, positions, self.kv, mask, plan=self._plan(positions, mask))  # [1, n, H]
        self.kv.commit()
        self.forwards += 1
        self._hidden += list(out[0])
        return self.head.to_target_logits(self.head.draft_logits(out[0]))  # [n, V]

    def _end(self) -> None:
        self.kv.rollback(len(self._tree))  # keep only the committed positions
        self._hidden, self._tree = [], GrowingTree()
