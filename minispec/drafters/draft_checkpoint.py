"""Load minispec's distilled draft model: a few Transformer blocks that share the target's embeddings.

A vanilla speculative-sampling drafter (Leviathan et al. 2023; Chen et al. 2023) needs a small
model with the target's tokenizer. SmolLM2-135M has no smaller sibling offline, so minispec
ships one: ``n_layer`` blocks of the target's width, trained by distillation
(``minispec.train.distill_draft``). The draft reuses the target's token embedding and LM head
(tied, frozen during training), so the checkpoint stores only its own blocks and final norm:

    smollm2-135m-draft.safetensors   blocks.{i}.*, norm.weight  (fp16)
    smollm2-135m-draft.json          {"format", "target", "config", "shared", "training", "eval", ...}

``load_draft_model(target)`` rebuilds the draft and points ``tok_emb.weight`` / ``lm_head.weight``
at the target's own tensors (same storage, no copy).
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from importlib import resources
from pathlib import Path

import torch

from ..model import ModelConfig, Transformer
from .defaults import shipped

FORMAT = "minispec-draft-v1"
DEFAULT_NAME = "smollm2-135m-draft"
SHARED = ("tok_emb.weight", "lm_head.weight")  # taken from the target, never stored
# Config fields the draft must share with the target for the shared tensors and tokens to fit.
MUST_MATCH = ("arch", "vocab_size", "d_model", "n_head", "n_kv_head", "head_dim")


def own_keys(model: Transformer) -> list[str]:
    """The parameter names a draft checkpoint stores (everything but the shared embedding / head)."""
    return [k for k in model.state_dict() if k not in SHARED]


def check_fits(cfg: dict, target_cfg: ModelConfig) -> None:
    """Raise ValueError naming every config field where a draft config does not fit the target.

    Args:
        cfg: the draft's config as stored in the checkpoint JSON.
        target_cfg: the target's ModelConfig.
    """
    bad = [f"{f}: checkpoint {cfg.get(f)!r} vs target {getattr(target_cfg, f)!r}"
           for f in MUST_MATCH if cfg.get(f) != getattr(target_cfg, f)]
    if bad:
        raise ValueError(f"the draft checkpoint does not fit this target ({target_cfg.name or target_cfg.arch}): "
                         + "; ".join(bad))


def load_draft_model(target: Transformer, path: str | Path | None = None) -> Transformer:
    """Build the draft model for ``target`` from a draft checkpoint.

    Args:
        target: the minispec Transformer the draft was distilled from (e.g. ``load("smollm2-135m")[0]``);
            its ``tok_emb.weight`` and ``lm_head.weight`` are shared with the draft.
        path: the draft's ``.safetensors`` file (its ``.json`` record lies beside it); default the
            checkpoint shipped in ``minispec/checkpoints``.
    Returns:
        The draft Transformer in eval mode, on the target's device and dtype, with
        ``draft.tok_emb.weight is target.tok_emb.weight`` and the same for ``lm_head.weight``.
    Raises:
        ValueError: the checkpoint does not fit the target (width, vocabulary, heads) or its
            tensors do not match its own config.
        FileNotFoundError: no checkpoint at ``path``.
    """
    from safetensors.torch import load_file

    with ExitStack() as stack:
        if path is None:
            path = stack.enter_context(resources.as_file(shipped(DEFAULT_NAME)))
        path = Path(path)
        meta_path = path.with_suffix(".json")
        if not path.exists() or not meta_path.exists():
            raise FileNotFoundError(f"draft checkpoint needs both {path} and {meta_path}")
        meta = json.loads(meta_path.read_text())
        own = load_file(str(path))  # safetensors only: no pickle
    if meta.get("format") != FORMAT:
        raise ValueError(f"{meta_path}: format {meta.get('format')!r} is not {FORMAT!r}")
    check_fits(meta["config"], target.cfg)
    cfg = ModelConfig(**{**meta["config"], "tie_embeddings": target.cfg.tie_embeddings})
    with torch.device("meta"):
        draft = Transformer(cfg)
    expected = {k: tuple(v.shape) for k, v in draft.state_dict().items() if k not in SHARED}
    got = {k: tuple(v.shape) for k, v in own.items()}
    if expected != got:
        missing, extra = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
        wrong = sorted(k for k in expected.keys() & got.keys() if expected[k] != got[k])
        raise ValueError(f"{path}: tensors do not match its config (n_layer={cfg.n_layer}, d_ff={cfg.d_ff}): "
                         f"missing {missing[:4]}, unexpected {extra[:4]}, wrong shape {wrong[:4]}")
    state = {k: v.to(device=target.device, dtype=target.dtype) for k, v in own.items()}
    state["tok_emb.weight"], state["lm_head.weight"] = target.tok_emb.weight, target.lm_head.weight
    draft.load_state_dict(state, strict=True, assign=True)
    draft.tok_emb.weight = target.tok_emb.weight  # the same Parameter objects: shared storage
    draft.lm_head.weight = target.lm_head.weight
    return draft.eval()
