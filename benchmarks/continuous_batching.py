"""Continuous batching against static batches, side by side: self-distillation's workload.

The same ShareGPT prompts (self-distillation's own order, never Spec-Bench), greedy, decoded ``--max-rows`` at a
time by ``generate_batch`` on the row cache in two ways, alternating round by round in one process: static
batches of ``--max-rows`` prompts, each running until its longest answer is done, and one call with
``max_rows=--max-rows``, where a finished answer's row goes to the next prompt at once. Reports tokens/s, decode
steps, mean rows per step and whether both gave the same tokens. Not part of CI: timings are machine-dependent.

    python benchmarks/continuous_batching.py --prompts 64 --max-rows 32 --max-new-tokens 256 --rounds 1 \\
        --threads 1 --json benchmarks/results/continuous_batching_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main(argv=None) -> int:
    from minispec.batch import generate_batch
    from minispec.lab.benchinfo import save_json
    from minispec.args import at_least, thread_count
    from minispec.loading import load
    from minispec.train import selfdistill as sd

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=at_least(1), default=64)
    ap.add_argument("--max-rows", type=at_least(1), default=32)
    ap.add_argument("--max-new-tokens", type=at_least(1), default=256)
    ap.add_argument("--max-prompt-tokens", type=at_least(1), default=192)
    ap.add_argument("--offset", type=at_least(0), default=5000, help="where in self-distillation's prompt order")
    ap.add_argument("--rounds", type=at_least(1), default=1)
    ap.add_argument("--threads", type=thread_count, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load(sd.TARGET)
    texts = sd.prompt_order()[args.offset:args.offset + 2 * args.prompts]
    ids = sd.part_prompts(tok, texts, args)[:args.prompts]
    kw = dict(max_new_tokens=args.max_new_tokens, chat=False, stop_at_eos=True, kv="rows")

    def static():
        out, steps, rows = [], 0, 0
        for s in range(0, len(ids), args.max_rows):
            results, batch = generate_batch(model, tok, ids[s:s + args.max_rows], **kw)
            out += [r.tokens for r in results]
            steps, rows = steps + batch.steps, rows + sum(batch.rows_per_step)
        return out, steps, rows

    def continuous():
        results, batch = generate_batch(model, tok, ids, max_rows=args.max_rows, **kw)
        return [r.tokens for r in results], batch.steps, sum(batch.rows_per_step)

    ways = {"static": static, "continuous": continuous}
    runs: dict[str, list[dict]] = {w: [] for w in ways}
    tokens: dict[str, list] = {}
    for r in range(args.rounds):
        for w in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            t0 = time.perf_counter()
            tokens[w], steps, rows = ways[w]()
            wall = time.perf_counter() - t0
            new = sum(len(t) for t in tokens[w])
            runs[w].append(dict(new_tokens=new, wall_s=wall, tokens_per_s=new / wall, steps=steps,
                                rows_per_step=rows / steps))
            print(f"round {r} {w:10s}: {new / wall:.1f} tok/s, {steps} steps, {rows / steps:.1f} rows a step "
                  f"(of {args.max_rows}), {wall:.0f} s")
    same = tokens["static"] == tokens["continuous"]
    summary = {w: {k: statistics.median(x[k] for x in rs) for k in ("tokens_per_s", "steps", "rows_per_step")}
               for w, rs in runs.items()}
    ratio = summary["continuous"]["tokens_per_s"] / summary["static"]["tokens_per_s"]
    print(f"median: static {summary['static']['tokens_per_s']:.1f} tok/s, continuous "
          f"{summary['continuous']['tokens_per_s']:.1f} tok/s: {ratio:.2f}x; same tokens: {same}")
    if args.json:
        print(f"saved {save_json(args.json, dict(benchmark='continuous_batching', settings=vars(args), runs=runs, summary=summary, ratio=ratio, same_tokens=same))}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
