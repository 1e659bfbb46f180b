"""Load any drafter checkpoint for a target, detecting its format from the tensors it holds.

    EAGLE-1/2   official dir: config.json (Llama, num_hidden_layers 1, optional "bias") +
                model.safetensors or pytorch_model.bin with fc.weight [H, 2H] (+ fc.bias),
                layers.0.*, sometimes an embed_tokens.weight copy (checked against the target's
                embedding: a warning when they differ). Li et al. 2024 (EAGLE, EAGLE-2).
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

import json
import re
import warnings
from pathlib import Path

import torch

from .registry import default_tree

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "medusa_lm_head.safetensors", "medusa_lm_head.pt")
_MEDUSA = re.compile(r"^(\d+)\.0\.linear\.weight$")


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(path, map_location="cpu", weights_only=True)  # never unpickles code
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path}: expected a flat dict of tensors")
    return state


def _resolve(path_or_hub_id) -> Path:
    """A local file / dir, or a Hugging Face hub id downloaded with ``snapshot_download``."""
    p = Path(path_or_hub_id)
    if p.exists():
        return p
    from ..models import hub_reachable

    text = str(path_or_hub_id)
    if text.count("/") != 1 or text.startswith((".", "/")):
        raise FileNotFoundError(f"no drafter checkpoint at {text}")
    if not hub_reachable():
        raise FileNotFoundError(f"{text} is not a local path and the Hugging Face hub is not reachable "
                                "(offline); download the checkpoint elsewhere and pass its directory")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(text, allow_patterns=["*.json", *WEIGHT_FILES]))


def _files(p: Path) -> tuple[Path, dict]:
    """(weights file, config/meta dict) for a directory or a single file."""
    if p.is_dir():
        weights = next((p / f for f in WEIGHT_FILES if (p / f).exists()), None)
        if weights is None:
            raise FileNotFoundError(f"{p}: no weights ({', '.join(WEIGHT_FILES)})")
        cfg = p / "config.json"
        return weights, json.loads(cfg.read_text()) if cfg.exists() else {}
    side = [p.with_suffix(".json"), p.parent / "config.json"]
    meta = next((json.loads(s.read_text()) for s in side if s.exists()), {})
    return p, meta


def detect(state: dict[str, torch.Tensor], meta: dict) -> str:
    """'draft' | 'eagle3' | 'eagle' | 'medusa' from the format field or the tensor names."""
    if meta.get("format") == "minispec-draft-v1":
        return "draft"
    keys = set(state)
    if "fc.weight" in keys and any(k.startswith("midlayer.") for k in keys):
        return "eagle3"
    if "fc.weight" in keys and any(k.startswith("layers.0.") for k in keys):
        return "eagle"
    if any(_MEDUSA.match(k.removeprefix("medusa_head.")) for k in keys):
        return "medusa"
    raise ValueError(f"unknown drafter layout: tensors {sorted(keys)[:8]}{' ...' if len(keys) > 8 else ''} match "
                     "none of EAGLE-1/2 (fc + layers.0.*), EAGLE-3 (fc + midlayer.*), Medusa ({i}.0.linear.*) "
                     "or minispec's draft model (format minispec-draft-v1)")


def _fit(kind: str, hidden: int, vocab: int, target) -> None:
    t = target.cfg
    bad = [f"hidden size {hidden} vs the target's {t.d_model}" if hidden != t.d_model else "",
           f"vocab size {vocab} vs the target's {t.vocab_size}" if vocab != t.vocab_size else ""]
    bad = [b for b in bad if b]
    if bad:
        raise ValueError(f"the {kind} checkpoint does not fit the target {t.name or t.arch}: " + "; ".join(bad))


def _check_embed(state: dict, target, where: Path) -> None:
    """Official heads sometimes carry a copy of the target's embedding: it must be the target's."""
    emb = state.pop("embed_tokens.weight", None)
    if emb is None:
        return
    mine = target.tok_emb.weight.detach().float().cpu()
    if emb.shape != mine.shape:
        raise ValueError(f"{where}: embed_tokens.weight {tuple(emb.shape)} does not fit the target's embedding "
                         f"{tuple(mine.shape)} (vocab size {emb.shape[0]} vs the target's {mine.shape[0]})")
    if not torch.allclose(emb.float(), mine, atol=1e-2 * float(mine.abs().max()), rtol=0):
        warnings.warn(f"{where}: the checkpoint's embed_tokens.weight differs from the target's embedding: was the head "
                      "trained for another model? (the target's embedding is used)", stacklevel=3)


def _shape_error(where: Path, want: dict, got: dict) -> ValueError:
    return ValueError(f"{where}: tensors do not match the head's config: missing {sorted(want.keys() - got.keys())[:4]}, "
                      f"unexpected {sorted(got.keys() - want.keys())[:4]}, "
                      f"wrong shape {sorted(k for k in want.keys() & got.keys() if want[k] != got[k])[:4]}")


def _load_strict(module, state: dict, where: Path) -> None:
    want = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if want != got:
        raise _shape_error(where, want, got)
    module.load_state_dict(state)


def load_drafter(path_or_hub_id, target, tree=None, verbose: bool = True, draft_vocab: int | None = None):
    """Build the right drafter for ``target`` from a checkpoint of any supported layout.

    Args:
        path_or_hub_id: an official checkpoint directory, a weights file (``.safetensors`` with
            minispec's ``.json`` beside it, or ``.bin`` / ``.pt`` with a ``config.json`` beside it),
            or a Hugging Face hub id (downloaded only when the hub is reachable).
        target: the minispec Transformer the drafter serves.
        tree: the tree to draft (``TreeSpec`` or its string); default: the kind's method's tree in
            ``registry.DEFAULT_TREES`` (Medusa: a chain as deep as the heads when they are fewer
            than the 'medusa' tree needs).
        verbose: print one line with what was inferred.
        draft_vocab: EAGLE-1/2 heads only: draft over the K most frequent tokens (FR-Spec,
            ``minispec.drafters.vocab``); None: the full vocabulary.
    Returns:
        EagleDrafter | Eagle3Drafter | MedusaDrafter | DraftModel, on the target's device and dtype.
    Raises:
        ValueError: unknown layout, or a mismatch with the target (names both sizes).
        FileNotFoundError: nothing at the path and no reachable hub.
    """
    src = _resolve(path_or_hub_id)
    weights, meta = _files(src)
    state = _read_weights(weights)
    kind = detect(state, meta)
    if draft_vocab is not None and kind != "eagle":
        raise ValueError(f"draft_vocab applies to EAGLE-1/2 heads (drafting through the target's LM head), not to a "
                         f"{kind} checkpoint")
    cfg = meta.get("config", meta)
    dtype = next((v.dtype for v in state.values() if v.is_floating_point()), None)
    dev = dict(device=target.device, dtype=target.dtype)
    if kind == "draft":
        from .draft_checkpoint import load_draft_model
        from .draft_model import DraftModel

        c = meta["config"]
        _fit("draft model", c["d_model"], c["vocab_size"], target)
        drafter = DraftModel(load_draft_model(target, weights), tree=tree if tree is not None else default_tree("draft"))
        info = f"draft model (hidden {c['d_model']}, {c['n_layer']} layers, vocab {c['vocab_size']}"
    elif kind == "eagle3":
        from .eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head

        H, Vd = state["fc.weight"].shape[0], state["lm_head.weight"].shape[0]
        V = cfg.get("vocab_size", state["t2d"].shape[0] if "t2d" in state else -1)
        _fit("EAGLE-3", H, V, target)
        _check_embed(state, target, weights)
        c = Eagle3Config.from_dict({**cfg, "draft_vocab_size": cfg.get("draft_vocab_size", Vd)})
        head = Eagle3Head(c)
        _load_strict(head, state, weights)
        drafter = Eagle3Drafter(target, head.to(**dev).eval(), tree=tree if tree is not None else default_tree("eagle3"))
        info = (f"EAGLE-3 head (hidden {H}, 1 layer on target layers {drafter.target_layers}, vocab {V}, draft vocab {Vd}, "
                f"rope_theta {c.rope_theta}{' (default: absent)' if 'rope_theta' not in cfg else ''}, no fc bias")
    elif kind == "eagle":
        from .eagle import EagleConfig, EagleDrafter, EagleHead

        H, V = state["fc.weight"].shape[0], cfg.get("vocab_size", -1)
        _fit("EAGLE-1/2", H, V, target)
        _check_embed(state, target, weights)
        bias = "fc.bias" in state  # the tensors decide; the config's "bias" (absent = True) may be missing
        head = EagleHead(EagleConfig.from_dict({**cfg, "bias": bias}))
        _load_strict(head, state, weights)
        drafter = EagleDrafter(target, head.to(**dev).eval(), tree=tree if tree is not None else default_tree("eagle"),
                               draft_vocab=draft_vocab)
        info = f"EAGLE-1/2 head (hidden {H}, 1 layer, vocab {V}, fc bias {bias}"
    else:
        from .medusa import MedusaDrafter, MedusaHeads

        state = {k.removeprefix("medusa_head."): v for k, v in state.items()}
        K = 1 + max(int(_MEDUSA.match(k).group(1)) for k in state if _MEDUSA.match(k))
        H = state["0.0.linear.weight"].shape[0]
        own = "0.1.weight" in state
        V = state["0.1.weight"].shape[0] if own else cfg.get("vocab_size", target.cfg.vocab_size)
        _fit("Medusa", H, V, target)
        heads = MedusaHeads(H, K, V, own_lm_head=own)
        _load_strict(heads, state, weights)
        default = "medusa" if K >= 4 else f"chain:{K}"
        drafter = MedusaDrafter(target, heads.to(**dev).eval(), tree=tree if tree is not None else default)
        info = f"Medusa heads ({K} heads, hidden {H}, 1 layer each, vocab {V}, {'own' if own else 'shared target'} LM head"
    if verbose:
        print(f"load_drafter: {info}, dtype {str(dtype).removeprefix('torch.')}) from {weights}")
    return drafter
