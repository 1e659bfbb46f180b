"""A batched decode on the row cache against chapter 7's paged pool, side by side: self-distillation's workload.

The same ShareGPT prompts (self-distillation's own order, never Spec-Bench), decoded greedily as one batch with
``generate_batch(..., kv=...)`` for each cache, the caches alternating round by round in one process; reports
tokens/s, ms per decode step and whether both caches gave the same tokens. Not part of CI: timings are
machine-dependent.

    python benchmarks/row_vs_paged_kv.py --batch-size 32 --max-new-tokens 96 --rounds 2 --threads 1 \\
        --json benchmarks/results/row_vs_paged_kv_cpu.json
"""

from __future__ import annotations

import argparse
import statistics

import torch


def main(argv=None) -> int:
    from minispec.batch import generate_batch
    from minispec.lab.benchinfo import save_json
    from minispec.lab.env import at_least
    from minispec.models import load
    from minispec.train import selfdistill as sd

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-size", type=at_least(1), default=32)
    ap.add_argument("--max-new-tokens", type=at_least(1), default=96)
    ap.add_argument("--max-prompt-tokens", type=at_least(1), default=192)
    ap.add_argument("--offset", type=at_least(0), default=5000, help="where in self-distillation's prompt order")
    ap.add_argument("--rounds", type=at_least(1), default=2)
    ap.add_argument("--threads", type=at_least(1), default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load(sd.TARGET)
    texts = sd.prompt_order()[args.offset:args.offset + 2 * args.batch_size]
    ids = sd.part_prompts(tok, texts, args)[:args.batch_size]
    runs: dict[str, list[dict]] = {"paged": [], "rows": []}
    tokens: dict[str, list] = {}
    for r in range(args.rounds):
        for kv in (("paged", "rows") if r % 2 == 0 else ("rows", "paged")):
            results, batch = generate_batch(model, tok, ids, max_new_tokens=args.max_new_tokens, chat=False,
                                            stop_at_eos=False, kv=kv)
            new = sum(len(x.tokens) for x in results)
            runs[kv].append(dict(new_tokens=new, decode_s=batch.decode_s, prefill_s=batch.prefill_s,
                                 steps=batch.steps, tokens_per_s=new / (batch.prefill_s + batch.decode_s),
                                 step_ms=batch.decode_s / batch.steps * 1e3))
            tokens[kv] = [x.tokens for x in results]
            print(f"round {r} {kv:5s}: {runs[kv][-1]['tokens_per_s']:.1f} tok/s, {runs[kv][-1]['step_ms']:.0f} ms/step")
    same = tokens["rows"] == tokens["paged"]
    summary = {kv: {k: statistics.median(x[k] for x in rs) for k in ("tokens_per_s", "step_ms")} for kv, rs in runs.items()}
    print(f"median: paged {summary['paged']['tokens_per_s']:.1f} tok/s ({summary['paged']['step_ms']:.0f} ms/step), "
          f"rows {summary['rows']['tokens_per_s']:.1f} tok/s ({summary['rows']['step_ms']:.0f} ms/step): "
          f"{summary['rows']['tokens_per_s'] / summary['paged']['tokens_per_s']:.2f}x; same tokens: {same}")
    if args.json:
        print(f"saved {save_json(args.json, dict(benchmark='row_vs_paged_kv', settings=vars(args), runs=runs, summary=summary, same_tokens=same))}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
