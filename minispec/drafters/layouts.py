"""Reading drafter checkpoints: the files, the tensors, the layout they hold and whether they fit.

What every builder of a head needs before it builds anything (``loader.load_drafter`` for all
layouts, ``eagle.load_eagle`` for EAGLE-1/2): find the weights and the config beside them
(locally or on the Hugging Face hub), read the tensors without unpickling code, name the layout
(``detect``), and check sizes against the target. The layouts are described in ``loader``.
It imports no drafter, so every drafter module may import it.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import torch

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "medusa_lm_head.safetensors", "medusa_lm_head.pt")
MEDUSA_KEY = re.compile(r"^(\d+)\.0\.linear\.weight$")


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(path, map_location="cpu", weights_only=True)  # never unpickles code
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path}: expected a flat dict of tensors")
    return state


def resolve(path_or_hub_id) -> Path:
    """A local file / dir, or a Hugging Face hub id downloaded with ``snapshot_download``."""
    p = Path(path_or_hub_id)
    if p.exists():
        return p
    from ..loading import hub_reachable

    text = str(path_or_hub_id)
    if text.count("/") != 1 or text.startswith((".", "/")):
        raise FileNotFoundError(f"no drafter checkpoint at {text}")
    if not hub_reachable():
        raise FileNotFoundError(f"{text} is not a local path and the Hugging Face hub is not reachable "
                                "(offline); download the checkpoint elsewhere and pass its directory")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(text, allow_patterns=["*.json", *WEIGHT_FILES]))


def files(p: Path) -> tuple[Path, dict]:
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
    if any(MEDUSA_KEY.match(k.removeprefix("medusa_head.")) for k in keys):
        return "medusa"
    raise ValueError(f"unknown drafter layout: tensors {sorted(keys)[:8]}{' ...' if len(keys) > 8 else ''} match "
                     "none of EAGLE-1/2 (fc + layers.0.*), EAGLE-3 (fc + midlayer.*), Medusa ({i}.0.linear.*) "
                     "or minispec's draft model (format minispec-draft-v1)")


def fit(kind: str, hidden: int, vocab: int, target) -> None:
    t = target.cfg
    bad = [f"hidden size {hidden} vs the target's {t.d_model}" if hidden != t.d_model else "",
           f"vocab size {vocab} vs the target's {t.vocab_size}" if vocab != t.vocab_size else ""]
    bad = [b for b in bad if b]
    if bad:
        raise ValueError(f"the {kind} checkpoint does not fit the target {t.name or t.arch}: " + "; ".join(bad))


def check_embed(state: dict, target, where: Path) -> None:
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
                      "trained for another model? (the target's embedding is used)", stacklevel=4)


def _shape_error(where: Path, want: dict, got: dict) -> ValueError:
    return ValueError(f"{where}: tensors do not match the head's config: missing {sorted(want.keys() - got.keys())[:4]}, "
                      f"unexpected {sorted(got.keys() - want.keys())[:4]}, "
                      f"wrong shape {sorted(k for k in want.keys() & got.keys() if want[k] != got[k])[:4]}")


def load_strict(module, state: dict, where: Path) -> None:
    want = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if want != got:
        raise _shape_error(where, want, got)
    module.load_state_dict(state)


def read_checkpoint(path_or_hub_id) -> tuple[Path, dict[str, torch.Tensor], dict, str]:
    """(weights file, tensors, config/meta dict, kind) of a checkpoint directory, file or hub id."""
    weights, meta = files(resolve(path_or_hub_id))
    state = read_weights(weights)
    return weights, state, meta, detect(state, meta)
