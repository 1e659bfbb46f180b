"""Does ``auto``'s quick calibration choose what is fastest on the demo's comparison? On this machine, in one
process: each quick candidate and vanilla timed as ``make demo`` times them (warm, interleaved prompt by prompt
on the demo's prompt and its three of minispec's own, 128 tokens: the reference ratios), then the quick
calibration run several times, at its 30 s budget and at tighter ones (a slower machine fits fewer prompts
in 30 s), each choice scored by its reference ratio.

    python benchmarks/calibration_fidelity.py [--threads 2] [--runs 3] [--budgets 30,15] [--json out.json]

Run it with nothing else on the machine.
"""

import argparse
import time

import torch

from minispec import dispatch, generate, load
from minispec.cli import compare_prompts
from minispec.lab.benchinfo import save_json
from minispec.linear import prepack
from minispec.methods import Methods

DEMO_PROMPT = "Explain in three sentences why speculative decoding makes LLM inference faster."


def reference(model, tok, methods, candidates, max_new_tokens: int) -> dict:
    """{method: tokens/s} over the demo's prompts, every method warm (one untimed run first), interleaved."""
    prompts = compare_prompts(DEMO_PROMPT, 3)
    drafters = {c: None if c == "vanilla" else methods.drafter(c) for c in ["vanilla", *candidates]}
    for d in drafters.values():
        generate(model, tok, prompts[0], drafter=d, max_new_tokens=16)
    tokens, seconds = dict.fromkeys(drafters, 0), dict.fromkeys(drafters, 0.0)
    for p in prompts:
        for c, d in drafters.items():
            s = generate(model, tok, p, drafter=d, max_new_tokens=max_new_tokens).stats
            tokens[c] += s.new_tokens
            seconds[c] += s.total_s
    return {c: tokens[c] / seconds[c] for c in drafters}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3, help="quick calibrations per budget")
    ap.add_argument("--budgets", default=f"{dispatch.QUICK_BUDGET_S:g},15", help="comma list of seconds")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="per reference prompt, as the demo")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load("smollm2-135m")
    methods = Methods(model)
    prepack(model)
    head = dispatch.head_dtype_costs(model, methods)
    dtype = min(head, key=head.get) if head else None  # the head's dtype, chosen as tune chooses it
    cands = [dispatch.with_head_dtype(c, dtype) if dtype and dispatch.HEAD_DTYPES[dtype] != model.dtype else c
             for c in dispatch.QUICK_CANDIDATES]
    t = time.perf_counter()
    ref = reference(model, tok, methods, cands, args.max_new_tokens)
    ratio = {c: r / ref["vanilla"] for c, r in ref.items()}
    print(f"reference on the demo's 4 prompts ({time.perf_counter() - t:.0f} s): "
          + ", ".join(f"{c} {r:.2f}x" for c, r in sorted(ratio.items(), key=lambda x: -x[1])), flush=True)
    best = max(ratio.values())
    runs = []
    for budget in [float(b) for b in args.budgets.split(",")]:
        for i in range(args.runs):
            t = time.perf_counter()
            r = dispatch.quick_tune(model, tok, methods=methods, budget_s=budget)
            row = dict(budget_s=budget, seconds=time.perf_counter() - t, choice=r.choice,
                       prompts={c.method: c.prompts for c in r.candidates},
                       predicted={c.method: c.predicted_tok_s for c in r.candidates},
                       reference_ratio=ratio.get(r.choice), of_best=ratio.get(r.choice, 0) / best)
            runs.append(row)
            print(f"budget {budget:g} s, run {i}: {row['seconds']:.1f} s, choice {r.choice} "
                  f"({ratio.get(r.choice, float('nan')):.2f}x on the reference, {row['of_best']:.2f} of the best), "
                  f"prompts {max(row['prompts'].values())}", flush=True)
    if args.json:
        print(f"saved {save_json(args.json, dict(benchmark='calibration_fidelity', threads=args.threads, head_dtype=dtype, reference_tok_s=ref, reference_ratio=ratio, runs=runs))}")


if __name__ == "__main__":
    main()
