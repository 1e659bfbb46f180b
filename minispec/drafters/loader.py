"""Load any drafter checkpoint for a target, detecting its format from the tensors it holds.

    EAGLE-1/2   official dir: config.json (Llama, num_hidden_layers 1, optional "bias") +
                model.safetensors or pytorch_model.bin with fc.weight [H, 2H] (+ fc.bias),
                layers.0.*, sometimes an embed_tokens.weight copy (checked against the target's
                embedding: a warning when they differ). Li et al. 2024 (EAGLE, EAGLE-2). A head
                of num_hidden_layers > 1 adds layers.1.* ... (pre-norm Llama layers, with
                input_layernorm), as the official code builds them.
    EAGLE-3     official dir: config.json (+ draft_vocab_size; no rope_theta means 10000) + weights
                with fc.weight [H, 3H], midlayer.*, norm.weight, lm_head.weight [Vd, H], d2t, t2d.
                Li et al. 2025.
    Medusa      {i}.0.linear.{weight,bias} (+ {i}.1.weight: Medusa-1's own LM heads), e.g.
                medusa_lm_head.safetensors / .pt with a config.json holding medusa_num_heads.
                Cai et al. 2024.
    minispec    single files name.safetensors + name.json ({"format", "config", ...}): the EAGLE-3,
                Medusa and EAGLE heads minispec trains, and the distilled draft model
                (format "minispec-draft-v1", ``draft_checkpoint.py``).

``load_drafter`` prints one line saying what it inferred (when verbose) and raises ValueError
when the checkpoint does not fit the target (hidden size, vocabulary) or has an unknown layout.
Pickled ``.bin`` / ``.pt`` files are read with ``torch.load(weights_only=True)`` only.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .draft_checkpoint import load_draft_model
from .draft_model import DraftModel
from .eagle import eagle_from_state
from .eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head
from .layouts import MEDUSA_KEY, check_embed, detect, fit, load_strict, read_checkpoint  # noqa: F401  (detect: re-exported)
from .medusa import MedusaDrafter, MedusaHeads
from .defaults import default_tree


def load_drafter(path_or_hub_id, target, tree=None, verbose: bool = True, draft_vocab: int | None = None,
                 head_dtype: torch.dtype | None = None):
    """Build the right drafter for ``target`` from a checkpoint of any supported layout.

    Args:
        path_or_hub_id: an official checkpoint directory, a weights file (``.safetensors`` with
            minispec's ``.json`` beside it, or ``.bin`` / ``.pt`` with a ``config.json`` beside it),
            or a Hugging Face hub id (downloaded only when the hub is reachable).
        target: the minispec Transformer the drafter serves.
        tree: the tree to draft (``TreeSpec`` or its string); default: the kind's method's tree in
            ``defaults.TABLE`` (Medusa: a chain as deep as the heads when they are fewer than the
            'medusa' tree needs, ``defaults.default_tree``).
        verbose: print one line with what was inferred.
        draft_vocab: EAGLE-1/2 and Medusa heads (which draft through an LM head of the target's vocabulary):
            draft over the K most frequent tokens (FR-Spec, ``minispec.drafters.vocab``); None: the full
            vocabulary.
        head_dtype: EAGLE-1/2 heads only: draft in this dtype (``EagleDrafter``); None: the target's.
    Returns:
        EagleDrafter | Eagle3Drafter | MedusaDrafter | DraftModel, on the target's device and dtype.
    Raises:
        ValueError: unknown layout, or a mismatch with the target (names both sizes).
        FileNotFoundError: nothing at the path and no reachable hub.
    """
    weights, state, meta, kind = read_checkpoint(path_or_hub_id)
    kw = {name: value for name, value in (("draft_vocab", draft_vocab), ("head_dtype", head_dtype)) if value is not None}
    for name in kw:
        if kind not in OPTIONS[name]:
            raise ValueError(f"{name} applies to {' and '.join(HEAD_NAMES[k] for k in OPTIONS[name])} heads, not to a "
                             f"{kind} checkpoint")
    dtype = next((v.dtype for v in state.values() if v.is_floating_point()), None)
    drafter, info = BUILDERS[kind](state, meta, target, weights, tree, **kw)
    if verbose:
        print(f"load_drafter: {info}, dtype {str(dtype).removeprefix('torch.')}) from {weights}")
    return drafter


def _draft_model(state: dict, meta: dict, target, weights: Path, tree):
    c = meta["config"]
    fit("draft model", c["d_model"], c["vocab_size"], target)
    drafter = DraftModel(load_draft_model(target, weights), tree=tree if tree is not None else default_tree("draft"))
    return drafter, f"draft model (hidden {c['d_model']}, {c['n_layer']} layers, vocab {c['vocab_size']}"


def _eagle3(state: dict, meta: dict, target, weights: Path, tree):
    cfg = meta.get("config", meta)
    H, Vd = state["fc.weight"].shape[0], state["lm_head.weight"].shape[0]
    V = cfg.get("vocab_size", state["t2d"].shape[0] if "t2d" in state else -1)
    fit("EAGLE-3", H, V, target)
    check_embed(state, target, weights)
    c = Eagle3Config.from_dict({**cfg, "draft_vocab_size": cfg.get("draft_vocab_size", Vd)})
    head = Eagle3Head(c)
    load_strict(head, state, weights)
    head = head.to(device=target.device, dtype=target.dtype).eval()
    drafter = Eagle3Drafter(target, head, tree=tree if tree is not None else default_tree("eagle3"))
    return drafter, (f"EAGLE-3 head (hidden {H}, 1 layer on target layers {drafter.target_layers}, vocab {V}, draft "
                     f"vocab {Vd}, rope_theta {c.rope_theta}{' (default: absent)' if 'rope_theta' not in cfg else ''}, "
                     "no fc bias")


def _medusa(state: dict, meta: dict, target, weights: Path, tree, **kw):
    cfg = meta.get("config", meta)
    state = {k.removeprefix("medusa_head."): v for k, v in state.items()}
    K = 1 + max(int(MEDUSA_KEY.match(k).group(1)) for k in state if MEDUSA_KEY.match(k))
    H = state["0.0.linear.weight"].shape[0]
    own = "0.1.weight" in state
    V = state["0.1.weight"].shape[0] if own else cfg.get("vocab_size", target.cfg.vocab_size)
    fit("Medusa", H, V, target)
    heads = MedusaHeads(H, K, V, own_lm_head=own)
    load_strict(heads, state, weights)
    heads = heads.to(device=target.device, dtype=target.dtype).eval()
    drafter = MedusaDrafter(target, heads, tree=tree if tree is not None else default_tree("medusa", heads=K), **kw)
    vocab = f", draft vocab {drafter.draft_vocab}" if drafter.draft_vocab else ""
    return drafter, (f"Medusa heads ({K} heads, hidden {H}, 1 layer each, vocab {V}{vocab}, "
                     f"{'own' if own else 'shared target'} LM head")


BUILDERS = {"draft": _draft_model, "eagle": eagle_from_state, "eagle3": _eagle3, "medusa": _medusa}
"""checkpoint kind -> (state, meta, target, weights file, tree, **OPTIONS) -> (drafter, what was inferred); EAGLE-1/2's
builder ``eagle.eagle_from_state`` also serves ``load_eagle``."""

OPTIONS = {"draft_vocab": ("eagle", "medusa"), "head_dtype": ("eagle",)}
"""``load_drafter``'s options -> the checkpoint kinds whose builders take them: a draft vocabulary restricts the LM head
that EAGLE-1/2 and Medusa heads draft through (EAGLE-3 heads bring their own, d2t); a head dtype casts an EAGLE-1/2 head."""
HEAD_NAMES = {"eagle": "EAGLE-1/2", "medusa": "Medusa"}
