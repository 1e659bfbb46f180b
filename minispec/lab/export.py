"""``python -m minispec export``: a trained head in the official EAGLE layout, for serving engines.

An official EAGLE checkpoint is a directory with ``config.json`` (a Llama-style config with one
hidden layer) and ``model.safetensors`` (the head's tensors under the official names), which
vLLM's and SGLang's EAGLE speculative decoding load next to the target model:

    EAGLE-1/2   fc.weight [H, 2H] (+ fc.bias), layers.0.self_attn.*, layers.0.mlp.*,
                layers.0.post_attention_layernorm.weight; the target's LM head is used
    EAGLE-3     fc.weight [H, 3H], midlayer.*, norm.weight, lm_head.weight [Vd, H], d2t, t2d;
                config with draft_vocab_size, architectures ["LlamaForCausalLMEagle3"]

minispec's heads already use these names (``EagleHead`` / ``Eagle3Head``), so exporting is a
matter of the config and the dtype; ``minispec.drafters.load_drafter`` reads the result back
(the round trip is tested).

    python -m minispec export eagle3 --out exported/smollm2-135m-eagle3
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def export_head(head, out_dir: str | Path, max_position_embeddings: int | None = None,
                dtype: torch.dtype = torch.float16) -> Path:
    """Write ``head`` (an ``EagleHead`` or ``Eagle3Head``) as ``out_dir/config.json`` + ``model.safetensors``.

    Args:
        head: the head module; its state_dict keys are the official ones.
        out_dir: the directory to write (created).
        max_position_embeddings: the target's context, recorded in the config (serving engines read it).
        dtype: dtype of the floating-point tensors (d2t / t2d keep theirs).
    Returns:
        out_dir.
    """
    from safetensors.torch import save_file

    from ..drafters.eagle import EagleHead
    from ..drafters.eagle3 import Eagle3Head

    if isinstance(head, EagleHead):
        config = head.cfg.to_dict()
    elif isinstance(head, Eagle3Head):
        config = head.config.to_dict()
    else:
        raise TypeError(f"export writes EAGLE-1/2 and EAGLE-3 heads, not {type(head).__name__}")
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config["tie_word_embeddings"] = False
    if max_position_embeddings:
        config["max_position_embeddings"] = max_position_embeddings
    state = {k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous() for k, v in head.state_dict().items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main(argv=None) -> int:
    from .. import load
    from ..drafters import load_drafter
    from ..methods import shipped_head

    ap = argparse.ArgumentParser(prog="python -m minispec export", description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=["eagle", "eagle3"], help="which shipped head (or --head) to export")
    ap.add_argument("--head", default=None, help="a head checkpoint in any layout load_drafter reads (default: shipped)")
    ap.add_argument("--model", default="smollm2-135m", help="the target the head serves")
    ap.add_argument("--dtype", default="float16", choices=list(DTYPES))
    ap.add_argument("--out", required=True, help="directory to write config.json and model.safetensors into")
    args = ap.parse_args(argv)
    target, _ = load(args.model)
    drafter = load_drafter(str(args.head or shipped_head(args.kind, args.model)), target, verbose=False)
    out = export_head(drafter.head, args.out, target.cfg.max_seq_len, DTYPES[args.dtype])
    back = load_drafter(str(out), target, verbose=False)  # the round trip: the loader reads what was written
    n = sum(v.numel() for v in back.head.state_dict().values())
    print(f"wrote {out}/config.json and model.safetensors ({type(back.head).__name__}, {n / 1e6:.1f}M values, "
          f"{args.dtype}); read back by minispec.drafters.load_drafter")
    return 0
