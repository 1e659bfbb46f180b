"""EAGLE-1/2: a small head (one decoder layer, or a few) that drafts at the target's FEATURE level.

EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty")
observes that the target's last hidden state f_t (after the final norm) is easier to
extrapolate than tokens, provided the head also sees the token actually sampled next. The head
predicts the next feature from

    x_t     = fc(cat[embed(x_{t+1}), f_t])          # [H]; embedding FIRST, then the feature
    g_{t+1} = DecoderLayers(x_{t..})                 # Llama layer 0 without input_layernorm
                                                     # (then layers 1.., ordinary pre-norm ones),
                                                     # no final norm: the predicted f_{t+1}
    logits  = target.lm_head(g_{t+1})                # the target's frozen, shared LM head

and drafts autoregressively on its own predicted features. EAGLE-2 (Li et al. 2024, "EAGLE-2:
Faster Inference of Language Models with Dynamic Draft Trees") keeps the head and drafts a
dynamic tree from its probabilities (``TreeDrafter._dynamic``).

Alignment in minispec (identical in training, ``minispec.train.eagle``): when ``propose`` runs,
``prefill`` and ``commit`` (``base.Drafter``) have delivered the target's features f_0..f_{n-2}
of context[:-1]. Head position
j (RoPE position j) takes (embed(x_{j+1}), f_j) and outputs g_{j+1}, whose logits give x_{j+2}.
The head's KV cache keeps the pairs built from target features (the committed context); tree
nodes take (embed(y), g_parent) at position root + depth and are rolled back in ``_end``.

The decoder layers are built from the target's own ``Attention`` and ``MLP`` (``minispec.model``:
fused q/k/v and gate/up projections, grouped-query attention, the same RoPE and attention plan).
The official heads have one layer (config ``num_hidden_layers`` 1); a head with more, as the
official code builds them, runs layers 1.. after layer 0 as ordinary pre-norm Llama decoder
layers (with input_layernorm), one attention plan and one head KV cache layer each.
Checkpoints use the official EAGLE-1/2 key names (``EagleHead.state_dict()``, mapped by
``model.hf_names``): fc.weight [H, 2H] (+ fc.bias), layers.0.self_attn.{q,k,v,o}_proj.weight,
layers.0.mlp.{gate,up,down}_proj.weight, layers.0.post_attention_layernorm.weight; layers i >= 1
add layers.i.input_layernorm.weight to the same names.
``load_eagle`` reads minispec's single file (``name.safetensors`` + ``name.json`` whose "config"
is the Llama-style config.json) or an official directory (``config.json`` + ``model.safetensors``).

Shapes: B batch, T new positions, S cached + new keys, H hidden, nh / nkv heads, hd head dim, V vocab.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

import torch
import torch.nn as nn

from .. import exact
from ..attention.plan import Plan, head_plan
from ..kv import KVCache, StaticKVCache
from ..model import MLP, Attention, RMSNorm, hf_names, rope_cos_sin
from .base import Features
from .graphed_draft import GraphedHead, step_plan
from .tree_drafter import GrowingTree, TreeDrafter, TreeSpec
from .layouts import check_embed, fit, load_strict, read_checkpoint
from .defaults import default_tree, shipped
from .vocab import ReducedLMHead, draft_ids

DEFAULT_NAME = "smollm2-135m-eagle"


@dataclass
class EagleConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    bias: bool = True  # fc bias (official configs: absent means True)
    num_hidden_layers: int = 1  # decoder layers: 1 in the official heads; layers 1.. are pre-norm Llama layers

    def __post_init__(self):
        if not isinstance(self.num_hidden_layers, int) or self.num_hidden_layers < 1:
            raise ValueError(f"an EAGLE-1/2 head needs at least one decoder layer, the config says "
                             f"num_hidden_layers={self.num_hidden_layers!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "EagleConfig":
        """From an official-style Llama ``config.json`` dict of an EAGLE-1/2 head (``num_hidden_layers``
        absent means 1); ValueError for fewer than one layer."""
        nh = d["num_attention_heads"]
        return cls(d["hidden_size"], nh, d.get("num_key_value_heads", nh), d.get("head_dim") or d["hidden_size"] // nh,
                   d["intermediate_size"], d["vocab_size"], d.get("rms_norm_eps", 1e-5),
                   d.get("rope_theta", 10000.0), d.get("bias", True), d.get("num_hidden_layers", 1))

    def to_dict(self) -> dict:
        """The Llama-style config.json of an official EAGLE-1/2 checkpoint."""
        d = asdict(self)
        return dict(architectures=["LlamaForCausalLM"], model_type="llama",
                    num_hidden_layers=d.pop("num_hidden_layers"), hidden_act="silu", **d)

    @classmethod
    def for_target(cls, cfg, bias: bool = True, num_hidden_layers: int = 1) -> "EagleConfig":
        """A head of ``num_hidden_layers`` layers shaped like the layers of a minispec Llama target (``ModelConfig``)."""
        return cls(cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.d_ff, cfg.vocab_size, cfg.norm_eps,
                   cfg.rope_theta, bias, num_hidden_layers)


class _Layer(nn.Module):
    """Decoder layer ``index`` of the head: the target's ``Attention`` and ``MLP`` (GQA, RoPE), saved under the official Llama names (``hf_names``). Layer 0 has no input_layernorm
    (EAGLE's: its input is fc's output); layers 1.. are ordinary pre-norm Llama layers. ``index`` is
    also the layer of the head's KV cache that its attention uses."""

    def __init__(self, c: EagleConfig, index: int = 0):
        super().__init__()
        H = c.hidden_size
        self.self_attn = hf_names(Attention(H, c.num_attention_heads, c.num_key_value_heads, c.head_dim, layer=index))
        self.mlp = hf_names(MLP(H, c.intermediate_size))
        self.input_layernorm = RMSNorm(H, c.rms_norm_eps) if index else None
        self.post_attention_layernorm = RMSNorm(H, c.rms_norm_eps)

    def forward(self, x, rope, plan: Plan, kv):
        h = x if self.input_layernorm is None else self.input_layernorm(x)  # [B, T, H]
        x = x + self.self_attn(h, rope, plan, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleHead(nn.Module):
    """The EAGLE-1/2 head (``cfg.num_hidden_layers`` decoder layers); ``state_dict()`` keys are the official ones.
    ``attention`` names its attention backend (``minispec.attention``; "exact" where its target runs it)."""

    def __init__(self, cfg: EagleConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=cfg.bias)
        self.layers = nn.ModuleList(_Layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.attention = "dense"

    def forward(self, emb: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None, kv: KVCache | None = None, plan: Plan | None = None) -> torch.Tensor:
        """Predict the next features.

        Args:
            emb: [B, T, H] target embeddings of the tokens x_{t+1}.
            feat: [B, T, H] features f_t (target's, or the head's own predictions in a tree).
            positions: [T] or [B, T] RoPE positions.
            mask: None (causal after the cached prefix) or boolean [T, S] / [B, T, S], True = may attend.
            kv: optional KVCache with one layer per decoder layer; new entries are left pending (commit / discard).
            plan: the attention plan when the caller built it (a static cache's, ``cuda_graphs.static_plan``:
                then positions and mask are the plan's); None: ``prepare`` builds it.
        Returns:
            [B, T, H] predicted features g_{t+1}.
        """
        B, T, _ = emb.shape
        plan = head_plan(plan, self.attention, B, T, emb.device, kv, positions, mask)  # the target's kind of plan
        rope = rope_cos_sin(plan.positions, self.cfg.head_dim, self.cfg.rope_theta)  # [B, 1, T, hd] each
        try:
            x = self.fc(torch.cat([emb, feat], dim=-1))  # [B, T, 2H] -> [B, T, H]
            for layer in self.layers:  # one plan for all: each layer writes its own layer of the cache
                x = layer(x, rope, plan, kv)  # [B, T, H]
            return x
        except BaseException:
            if kv is not None:
                kv.discard()
            raise


class EagleDrafter(GraphedHead, TreeDrafter):
    """Args:
        target: the minispec Transformer whose features the head reads (its tok_emb and lm_head are used).
        head: an ``EagleHead`` trained for this target.
        tree: a ``TreeSpec`` or its string form ('chain:5', 'eagle', '6,10,60', ...);
            default ``defaults.DEFAULT_TREES['eagle']``.
        capacity: the head's KV cache size in tokens (grown on demand).
        draft_vocab: draft over the K most frequent tokens only (FR-Spec, ``minispec.drafters.vocab``);
            None: the full vocabulary. Verification stays over the full vocabulary (lossless).
        token_counts: [V] counts that rank the tokens (default: the ones shipped for SmolLM2).
        head_dtype: the dtype the head and its LM-head rows compute in (default: the head's own). A draft
            only proposes, so its precision changes acceptance, never the output: torch.bfloat16 halves
            the bytes a drafted level reads, which is what a one-row draft on a CPU waits for
            (``benchmarks/draft_dtype.py`` measures both on this machine). The logits come back in float32.
    ``use_graphs()`` (chapter 8, ``generate(..., cuda_graphs=True)``) drafts chains and dynamic trees as one
    CUDA graph per bucket (``graphed_draft.GraphedDraft``) over a static cache of the head.
    """

    reads_features = True
    target_layers: tuple[int, ...] = ()  # EAGLE-1/2 reads only the last hidden state

    def __init__(self, target, head: EagleHead, tree: "TreeSpec | str | int | None" = None, capacity: int = 1024,
                 draft_vocab: int | None = None, token_counts: torch.Tensor | None = None,
                 head_dtype: torch.dtype | None = None):
        super().__init__(tree if tree is not None else default_tree("eagle"))
        self.check_target(target, head)
        if head_dtype is not None and head_dtype != next(head.parameters()).dtype:  # a copy: the head may be shared
            head = cast_head(head, head_dtype)
        self.target, self.head = target, head.eval()
        self.draft_vocab = draft_vocab
        self.lm_head = target.lm_head
        if draft_vocab is not None:
            self.lm_head = ReducedLMHead(target.lm_head, draft_ids(target.cfg.vocab_size, draft_vocab, token_counts))
        self.head_dtype = next(self.head.parameters()).dtype
        if self.head_dtype != target.dtype:  # the LM-head rows a draft reads, in the head's dtype: a copy
            if isinstance(self.lm_head, ReducedLMHead):  # this drafter's own already
                self.lm_head = self.lm_head.to(self.head_dtype)
            else:  # the target's whole LM head
                V, H = target.lm_head.weight.shape
                self.lm_head = nn.Linear(H, V, bias=False, device="meta")
                self.lm_head.weight = nn.Parameter(target.lm_head.weight.detach().to(self.head_dtype), requires_grad=False)
        exact.follow(target, self.head, self.lm_head)  # the head computes as its target does (prepacked now)
        self.kv = self._head_cache(False, capacity)
        self.prefill([])

    def _head_cache(self, static: bool, capacity: int | None = None) -> KVCache | StaticKVCache:
        """An empty cache for the head, one layer per decoder layer (static: chapter 8's, for graphs)."""
        c, p = self.head.cfg, next(self.head.parameters())
        return (StaticKVCache if static else KVCache)(c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                                                      capacity or self.kv.capacity, dtype=p.dtype, device=p.device)

    @classmethod
    def from_pretrained(cls, target, path: str | Path | None = None, **kw) -> "EagleDrafter":
        """``load_eagle(path, target, **kw)``; default the head shipped for SmolLM2-135M."""
        return load_eagle(path, target, **kw)

    def __repr__(self):
        vocab = f", draft vocab {self.draft_vocab}" if self.draft_vocab else ""
        layers = f", {self.head.cfg.num_hidden_layers} layers" if self.head.cfg.num_hidden_layers > 1 else ""
        return f"EagleDrafter(hidden {self.head.cfg.hidden_size}{layers}, {self.spec.name}{vocab})"

    def check_target(self, target, head: EagleHead | None = None) -> None:
        c, t = (head or self.head).cfg, target.cfg
        if c.hidden_size != t.d_model or c.vocab_size != t.vocab_size:
            raise ValueError(f"EAGLE head (hidden_size {c.hidden_size}, vocab_size {c.vocab_size}) does not fit the "
                             f"target {t.name or t.arch} (hidden size {t.d_model}, vocab {t.vocab_size})")

    def prefill(self, tokens: list[int], features: Features | None = None) -> None:
        self.kv.reset()
        self.n_pairs = 0  # committed head pairs j = 0..n_pairs-1: (f_j, x_{j+1}) in the head's KV
        self.feats = torch.empty(max(64, 2 * len(tokens)), self.head.cfg.hidden_size, dtype=self.kv.k.dtype,
                                 device=self.kv.k.device)  # [cap, H] target features f_0, f_1, ...
        self.n_feats = 0
        self.kv.reserve(len(tokens) + self.max_nodes + 1)
        super().prefill(tokens, features)  # hands the features to observe

    def observe(self, features: Features) -> None:
        """Append the target's features [n, H] (its last hidden states) of newly committed tokens."""
        hidden = features.hidden
        n = hidden.shape[0]
        if self.n_feats + n > self.feats.shape[0]:
            grown = self.feats.new_empty(2 * (self.n_feats + n), self.feats.shape[1])
            grown[:self.n_feats] = self.feats[:self.n_feats]
            self.feats = grown
        self.feats[self.n_feats:self.n_feats + n] = hidden.to(self.feats.dtype)
        self.n_feats += n

    def _head(self, tokens: list[int], feat: torch.Tensor, positions: torch.Tensor, mask=None) -> torch.Tensor:
        """Run the head on new pairs; returns [T, H] predicted features (kept pending in the KV)."""
        dev = self.feats.device
        emb = self.target.tok_emb(torch.tensor([tokens], device=self.target.device)).to(dev, feat.dtype)  # [1, T, H]
        self.forwards += 1
        positions = positions.to(dev)
        plan = step_plan(self.kv, positions, mask) if self.graph is not None else None  # a static cache: its plan
        return self.head(emb, feat[None], positions, mask, self.kv, plan=plan)[0]

    # --- chapter 8: the draft as one CUDA graph (``GraphedHead``, ``graphed_draft.GraphedDraft``) ----------
    def _new_pairs(self) -> tuple[list[int], torch.Tensor]:
        """The pairs committed since the last draft (``_start``'s catch-up): their tokens and target features."""
        context, n = self.context, len(self.context)
        self._check_features()
        keep = min(self.n_pairs, n - 2)
        if keep < self.n_pairs:  # (a second draft of the same context recomputes the root's pair)
            self.kv.rollback(self.n_pairs - keep)
        self.n_pairs = n - 1
        return context[keep + 1:], self.feats[keep:n - 1]

    def _step(self, tokens: torch.Tensor, feat: torch.Tensor, plan) -> torch.Tensor:
        """The head on a static plan: tokens [1, T], features [1, T, H] -> predicted features [1, T, H]."""
        emb = self.target.tok_emb(tokens)  # [1, T, H]
        emb = (emb if emb.device == feat.device else emb.to(feat.device)).to(feat.dtype)
        return self.head(emb, feat, plan.positions, kv=self.kv, plan=plan)

    def _graph_logits(self, g: torch.Tensor) -> torch.Tensor:
        """``_logits`` with no device move where none is needed (g [n, H] -> [n, V])."""
        dev = self.target.device
        return self.lm_head((g if g.device == dev else g.to(dev)).to(self.head_dtype)).to(self.target.dtype)

    def _features(self) -> tuple[int, torch.dtype]:
        return self.head.cfg.hidden_size, self.head_dtype

    def _logits(self, g: torch.Tensor) -> torch.Tensor:
        z = self.lm_head(g.to(self.target.device, self.head_dtype))  # [.., V] (-inf outside a reduced vocab)
        return z.to(self.target.dtype)

    def _check_features(self) -> None:
        n = len(self.context)
        if n < 2 or self.n_feats != n - 1:
            raise RuntimeError(f"EagleDrafter has target features of {self.n_feats} tokens but needs {n - 1} for a "
                               f"context of {n}: hand them over with prefill and commit (minispec.generate does)")

    def _start(self) -> torch.Tensor:
        context, n = self.context, len(self.context)
        self._check_features()
        keep = min(self.n_pairs, n - 2)  # committed pairs stay; the last (the root's) is recomputed for its g
        self.kv.rollback(self.n_pairs - keep)
        new = context[keep + 1:]  # tokens x_{j+1} of pairs j = keep .. n-2
        self.kv.reserve(n + self.max_nodes)
        g = self._head(new, self.feats[keep:n - 1], torch.arange(keep, n - 1))  # [n-1-keep, H]
        self.kv.commit()
        self.n_pairs = n - 1
        self.root_g, self.node_g = g[-1], []  # predicted features of the root and of added nodes
        self.tree = GrowingTree()
        return self._logits(g[-1])  # [V]

    def _extend(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        feat = torch.stack([self.root_g if p < 0 else self.node_g[p] for p in parents])  # [n, H] parents' g
        # the root's pair sits at position n_pairs - 1: [n] root position + depth, [n, S] pairs + ancestors + self
        positions, mask = self.tree.add(parents, self.n_pairs, self.feats.device)
        g = self._head(tokens, feat, positions, None if self.tree.is_chain else mask)  # [n, H]; a path: causal
        self.kv.commit()
        self.node_g += list(g)
        return self._logits(g)  # [n, V]

    def _end(self) -> None:
        self.kv.rollback(len(self.tree))  # tree pairs hold predicted features: never keep them
        self.tree, self.node_g = GrowingTree(), []


def cast_head(head: EagleHead, dtype: torch.dtype) -> EagleHead:
    """A copy of ``head`` in ``dtype`` on its device (the original is left as it is)."""
    p = next(head.parameters())
    copy = EagleHead(head.cfg).to(device=p.device, dtype=dtype)
    copy.load_state_dict(head.state_dict())  # cast to dtype as it is copied
    return copy


def load_eagle(path: str | Path | None, target, tree: "TreeSpec | str | int | None" = None, **kw) -> EagleDrafter:
    """Build an ``EagleDrafter`` for ``target`` from a checkpoint.

    Args:
        path: minispec's ``name.safetensors`` (with ``name.json`` beside it, whose "config" is the
            Llama-style head config), or an official EAGLE-1/2 directory (``config.json`` +
            ``model.safetensors``); None: the head shipped for SmolLM2-135M.
        target: the minispec Transformer the head was trained on.
        tree, kw: passed to ``EagleDrafter``. The checkpoint is read as ``load_drafter`` reads
            every layout (``layouts.read_checkpoint``); this checks that it is an EAGLE-1/2 head.
    Returns:
        The drafter; the head on the target's device and dtype.
    Raises:
        FileNotFoundError, ValueError (the head does not fit the target or its own config).
    """
    with ExitStack() as stack:
        if path is None:
            path = stack.enter_context(resources.as_file(shipped(DEFAULT_NAME)))
        weights, state, meta, kind = read_checkpoint(path)
        if kind != "eagle":
            raise ValueError(f"{path} holds a {kind} checkpoint, not an EAGLE-1/2 head "
                             "(minispec.drafters.load_drafter reads every layout)")
        drafter, _ = eagle_from_state(state, meta, target, weights, tree=tree, **kw)
    return drafter


def eagle_from_state(state: dict, meta: dict, target, weights: Path, tree=None, **kw) -> tuple[EagleDrafter, str]:
    """An ``EagleDrafter`` from a checkpoint's tensors and config (``layouts.read_checkpoint``), and one
    line on what was inferred; the EAGLE-1/2 builder of ``load_drafter`` and of ``load_eagle``.
    kw: ``EagleDrafter``'s draft_vocab, capacity, token_counts, head_dtype."""
    cfg = meta.get("config", meta)
    if "vocab_size" not in cfg:  # the tensors do not say the vocabulary (the LM head is the target's)
        raise ValueError(f"{weights}: no EAGLE-1/2 head config with its vocab_size beside it (minispec's "
                         f"{weights.with_suffix('.json').name} with a \"config\", or an official config.json); "
                         "copy the head's .json with its .safetensors")
    H, V = state["fc.weight"].shape[0], cfg["vocab_size"]
    fit("EAGLE-1/2", H, V, target)
    check_embed(state, target, weights)
    bias = "fc.bias" in state  # the tensors decide; the config's "bias" (absent = True) may be missing
    head = EagleHead(EagleConfig.from_dict({**cfg, "bias": bias}))
    load_strict(head, state, weights)
    head = head.to(device=target.device, dtype=target.dtype).eval()
    drafter = EagleDrafter(target, head, tree=tree if tree is not None else default_tree("eagle"), **kw)
    n = head.cfg.num_hidden_layers
    return drafter, f"EAGLE-1/2 head (hidden {H}, {n} layer{'s' if n > 1 else ''}, vocab {V}, fc bias {bias}"
