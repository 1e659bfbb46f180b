"""tau and draft cost of the EAGLE-1/2 head against its draft vocabulary size K (FR-Spec).

For each K (0 = the full vocabulary) the shipped EAGLE-1/2 head drafts over the K most frequent
tokens (``minispec.drafters.vocab``); verification stays over the full vocabulary, so every
answer must equal vanilla's. Reports, in one process:

  level_ms     one draft level (head layer + LM head rows) for 1 node (a chain step) and for
               top_k = 10 nodes (an EAGLE-2 tree level), median of repetitions
  vs_target    that cost over one single-token target forward (the issue's budget: <= 0.10)
  tau          mean tokens per target forward of a chain of 5 and the 6,10,60 dynamic tree on
               minispec's own prompts (never Spec-Bench), greedy

    python benchmarks/draft_vocab.py --prompts 6 --max-new-tokens 64 --threads 2 --json benchmarks/results/draft_vocab_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minispec import generate, load
from minispec.lab.benchinfo import save_json
from minispec.drafters.base import Features
from minispec.kv import KVCache
from minispec.args import thread_count
from minispec.methods import Methods
from minispec.prompts import own_prompts
from minispec.tokenizer import encode_prompt


def _median_ms(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


@torch.inference_mode()
def level_costs(target, drafter, context: list[int], reps: int) -> dict:
    """ms of one draft level of 1 and 10 nodes after ``context`` (features from a real prefill)."""
    kv = KVCache.for_model(target, len(context) + 16)
    out = target(torch.tensor([context]), kv=kv)
    drafter.prefill(context, Features(out.hidden[0, :-1]))

    def level(n):
        drafter._start()
        t0 = time.perf_counter()
        drafter._extend(context[-n:], [-1] * n)
        dt = time.perf_counter() - t0
        drafter._end()
        return dt

    res = {}
    for n in (1, 10):
        level(n)
        res[f"level_{n}_ms"] = statistics.median(level(n) for _ in range(reps)) * 1e3
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", default="0,32768,16384,8192,4096,2048", help="comma list of K (0 = full vocabulary)")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=thread_count, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, tok = load("smollm2-135m")
    prompts = [p["prompt"] for p in own_prompts()][: args.prompts]
    context = encode_prompt(tok, prompts[0], chat=True)
    kv = KVCache.for_model(target, len(context) + 2)
    with torch.inference_mode():
        target(torch.tensor([context[:-1]]), kv=kv)
        kv.commit()

        def one():
            target(torch.tensor([context[-1:]]), kv=kv)
            kv.discard()

        t_target = _median_ms(one, args.reps)
    vanilla = {p: generate(target, tok, p, max_new_tokens=args.max_new_tokens).tokens for p in prompts}
    rows = []
    for K in (int(k) for k in args.vocab.split(",")):
        methods = Methods(target, draft_vocab=K)
        row = dict(draft_vocab=K or target.cfg.vocab_size, **level_costs(target, methods.drafter("eagle"), context, args.reps))
        row.update(level_1_vs_target=row["level_1_ms"] / t_target, level_10_vs_target=row["level_10_ms"] / t_target)
        for name, method in (("chain5", "eagle"), ("tree_6_10_60", "eagle2")):
            new = fwd = same = 0
            for p in prompts:
                r = generate(target, tok, p, drafter=methods.drafter(method), max_new_tokens=args.max_new_tokens)
                new, fwd, same = new + r.stats.new_tokens, fwd + r.stats.target_forwards, same + (r.tokens == vanilla[p])
            row[f"tau_{name}"], row[f"identical_{name}"] = new / fwd, f"{same}/{len(prompts)}"
        rows.append(row)
        print(f"K={row['draft_vocab']:6d}  level(1) {row['level_1_ms']:5.2f} ms = {row['level_1_vs_target']:.3f} x target  "
              f"level(10) {row['level_10_ms']:5.2f} ms = {row['level_10_vs_target']:.3f} x  tau chain5 {row['tau_chain5']:.2f} "
              f"({row['identical_chain5']})  tau 6,10,60 {row['tau_tree_6_10_60']:.2f} ({row['identical_tree_6_10_60']})",
              flush=True)
    result = dict(benchmark="draft_vocab", target_forward_ms=t_target, threads=args.threads, prompts=len(prompts),
                  max_new_tokens=args.max_new_tokens, rows=rows)
    if args.json:
        print(f"saved {save_json(args.json, result)}")
    return result


if __name__ == "__main__":
    main()
