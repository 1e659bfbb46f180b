"""A batched decode on the row cache against chapter 7's paged pool, side by side: self-distillation's workload.

The same ShareGPT prompts (self-distillation's own order, never Spec-Bench), decoded greedily as one batch with
``generate_batch(..., kv=...)`` for each cache, the caches alternating round by round in one process; reports
tokens/s, ms per decode step and whether both caches gave the same tokens. ``--row-call-scores 0,512`` also
alternates the ragged plan's cost of a per-row attention call (``minispec.attention.plan.ROW_CALL_SCORES``; 0: a
ragged step attends in one call only when padding at most doubles its scores), each value with each cache.
``--stop-at-eos`` lets sequences finish at their end-of-sequence token, as self-distillation's do, and
``--uncompacted`` adds the row cache without the batch decoder's compaction (``BatchDecoder._compact``: once a sequence
has left, every layer of every step copies the rows that decode with an ``index_select``). Not part of CI: timings are
machine-dependent.

    python benchmarks/row_vs_paged_kv.py --batch-size 32 --max-new-tokens 96 --rounds 2 --threads 1 \\
        --json benchmarks/results/row_vs_paged_kv_cpu.json
"""

from __future__ import annotations

import argparse
import statistics

import torch


def main(argv=None) -> int:
    from minispec.attention import plan
    from minispec.batch import BatchDecoder, generate_batch
    from minispec.lab.benchinfo import save_json
    from minispec.args import at_least, thread_count
    from minispec.loading import load
    from minispec.train import selfdistill as sd

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-size", type=at_least(1), default=32)
    ap.add_argument("--max-new-tokens", type=at_least(1), default=96)
    ap.add_argument("--max-prompt-tokens", type=at_least(1), default=192)
    ap.add_argument("--offset", type=at_least(0), default=5000, help="where in self-distillation's prompt order")
    ap.add_argument("--rounds", type=at_least(1), default=2)
    ap.add_argument("--threads", type=thread_count, default=1)
    ap.add_argument("--row-call-scores", default=None,
                    help="comma-separated values of plan.ROW_CALL_SCORES to alternate (default: the shipped one)")
    ap.add_argument("--stop-at-eos", action="store_true", help="sequences finish at their end-of-sequence token")
    ap.add_argument("--uncompacted", action="store_true", help="also the row cache without the decoder's compaction")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        costs = [int(c) for c in args.row_call_scores.split(",")] if args.row_call_scores else [plan.ROW_CALL_SCORES]
    except ValueError:
        costs = [-1]
    if any(c < 0 for c in costs):
        ap.error(f"--row-call-scores must be counts >= 0, got {args.row_call_scores}")
    torch.set_num_threads(args.threads)
    model, tok = load(sd.TARGET)
    texts = sd.prompt_order()[args.offset:args.offset + 2 * args.batch_size]
    ids = sd.part_prompts(tok, texts, args)[:args.batch_size]
    shipped = plan.ROW_CALL_SCORES
    caches = ("paged", "rows") + (("rows-uncompacted",) if args.uncompacted else ())
    variants = [(kv, c) for c in costs for kv in caches]
    compact = BatchDecoder._compact
    name = (lambda kv, c: kv) if len(costs) == 1 else (lambda kv, c: f"{kv}@{c}")
    runs: dict[str, list[dict]] = {name(*v): [] for v in variants}
    tokens: dict[str, list] = {}
    try:
        for r in range(args.rounds):
            for kv, c in (variants if r % 2 == 0 else variants[::-1]):
                plan.ROW_CALL_SCORES = c
                BatchDecoder._compact = compact if kv != "rows-uncompacted" else (lambda self: None)
                results, batch = generate_batch(model, tok, ids, max_new_tokens=args.max_new_tokens, chat=False,
                                                stop_at_eos=args.stop_at_eos, kv=kv.split("-")[0])
                new = sum(len(x.tokens) for x in results)
                v = name(kv, c)
                runs[v].append(dict(new_tokens=new, decode_s=batch.decode_s, prefill_s=batch.prefill_s,
                                    steps=batch.steps, tokens_per_s=new / (batch.prefill_s + batch.decode_s),
                                    step_ms=batch.decode_s / batch.steps * 1e3))
                tokens[v] = [x.tokens for x in results]
                print(f"round {r} {v:10s}: {runs[v][-1]['tokens_per_s']:.1f} tok/s, {runs[v][-1]['step_ms']:.0f} ms/step")
    finally:
        plan.ROW_CALL_SCORES, BatchDecoder._compact = shipped, compact
    same = all(t == tokens[name(*variants[0])] for t in tokens.values())
    summary = {v: {k: statistics.median(x[k] for x in rs) for k in ("tokens_per_s", "step_ms")} for v, rs in runs.items()}
    base = summary[name(*variants[0])]["tokens_per_s"]
    print("median: " + ", ".join(f"{v} {s['tokens_per_s']:.1f} tok/s ({s['step_ms']:.0f} ms/step, "
                                 f"{s['tokens_per_s'] / base:.2f}x)" for v, s in summary.items()) + f"; same tokens: {same}")
    if args.json:
        print(f"saved {save_json(args.json, dict(benchmark='row_vs_paged_kv', settings=vars(args), runs=runs, summary=summary, same_tokens=same))}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
