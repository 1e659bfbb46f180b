"""Does ``auto``'s quick calibration choose what is fastest on the demo's comparison? On this machine, in one
process: each quick candidate and vanilla timed as ``make demo`` times them (warm, interleaved prompt by prompt
on the demo's prompt and its three of minispec's own, 128 tokens: the reference ratios), then the quick
calibration run several times, at its 30 s budget and at tighter ones (a slower machine fits fewer prompts
in 30 s), each choice scored by its reference ratio. ``--temperature T`` does all of it sampled (the reference
seeded per prompt, on ``--reference-prompts`` of them: a sampled ratio is noisier than a greedy one), and
``--candidates`` calibrates over another list than ``QUICK_CANDIDATES``, and ``--versus`` over a second one too, the
two alternating run by run and scored on one reference over both:

    python benchmarks/calibration_fidelity.py [--threads 2] [--runs 3] [--budgets 30,15] [--temperature 0.7]
        [--reference-prompts 7] [--candidates A,B,C] [--versus A,C] [--json out.json]

Run it with nothing else on the machine.
"""

import argparse
import dataclasses
import time

import torch

from minispec import auto, generate, load
from minispec.lab import calibrate, tune
from minispec.cli import compare_prompts
from minispec.lab.benchinfo import save_json
from minispec.methods import HEAD_DTYPES, Methods, with_head_dtype
from minispec.args import thread_count
from minispec.sampling import GREEDY, SamplingParams

DEMO_PROMPT = "Explain in three sentences why speculative decoding makes LLM inference faster."


def reference(model, tok, methods, candidates, max_new_tokens: int, params: SamplingParams = GREEDY,
              n_prompts: int = 3) -> dict:
    """{method: tokens/s} over the demo's prompt and ``n_prompts`` of minispec's own (the demo's 3), every method
    warm (one untimed run first), interleaved, decoded by ``params`` (sampled: seed i on prompt i, every method)."""
    prompts = compare_prompts(DEMO_PROMPT, n_prompts)
    drafters = {c: None if c == "vanilla" else methods.drafter(c) for c in ["vanilla", *candidates]}
    for d in drafters.values():
        generate(model, tok, prompts[0], drafter=d, max_new_tokens=16)
    tokens, seconds = dict.fromkeys(drafters, 0), dict.fromkeys(drafters, 0.0)
    for i, p in enumerate(prompts):
        for c, d in drafters.items():
            s = generate(model, tok, p, drafter=d, max_new_tokens=max_new_tokens, params=params,
                         seed=None if params.greedy else i).stats
            tokens[c] += s.new_tokens
            seconds[c] += s.total_s
    return {c: tokens[c] / seconds[c] for c in drafters}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=thread_count, default=2)
    ap.add_argument("--runs", type=int, default=3, help="quick calibrations per budget")
    ap.add_argument("--budgets", default=f"{calibrate.QUICK_BUDGET_S:g},15", help="comma list of seconds")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="per reference prompt, as the demo")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (as the demo); else sampled")
    ap.add_argument("--candidates", default=",".join(auto.QUICK_CANDIDATES), help="comma list (default QUICK_CANDIDATES)")
    ap.add_argument("--versus", default=None,
                    help="a second comma list, calibrated as many times and scored on the same reference")
    ap.add_argument("--reference-prompts", type=int, default=3, help="minispec's own prompts beside the demo's")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    params = SamplingParams(args.temperature) if args.temperature > 0 else GREEDY
    torch.set_num_threads(args.threads)
    model, tok = load("smollm2-135m")
    methods = Methods(model)
    head = tune.head_dtype_costs(model, methods)
    dtype = min(head, key=head.get) if head else None  # the head's dtype, chosen as tune chooses it
    lists = [[with_head_dtype(c, dtype) if dtype and HEAD_DTYPES[dtype] != model.dtype else c
              for c in names.split(",")] for names in filter(None, (args.candidates, args.versus))]
    union = list(dict.fromkeys(c for cands in lists for c in cands))
    t = time.perf_counter()
    ref = reference(model, tok, methods, union, args.max_new_tokens, params, args.reference_prompts)
    ratio = {c: r / ref["vanilla"] for c, r in ref.items()}
    print(f"reference on {args.reference_prompts + 1} prompts, {auto.describe_sampling(params)} "
          f"({time.perf_counter() - t:.0f} s): "
          + ", ".join(f"{c} {r:.2f}x" for c, r in sorted(ratio.items(), key=lambda x: -x[1])), flush=True)
    best = max(ratio.values())
    runs = []
    # the lists alternate run by run, so that drift of the machine hits each alike
    for budget, i, cands in [(float(b), i, c) for b in args.budgets.split(",") for i in range(args.runs) for c in lists]:
        t = time.perf_counter()
        r = calibrate.quick_tune(model, tok, candidates=cands, methods=methods, budget_s=budget, params=params)
        row = dict(candidates=cands, budget_s=budget, seconds=time.perf_counter() - t, choice=r.choice,
                   prompts={c.method: c.prompts for c in r.candidates},
                   predicted={c.method: c.predicted_tok_s for c in r.candidates},
                   reference_ratio=ratio.get(r.choice), of_best=ratio.get(r.choice, 0) / best)
        runs.append(row)
        print(f"list {lists.index(cands)}, budget {budget:g} s, run {i}: {row['seconds']:.1f} s, choice {r.choice} "
              f"({ratio.get(r.choice, float('nan')):.2f}x on the reference, {row['of_best']:.2f} of the best), "
              f"prompts {max(row['prompts'].values())}", flush=True)
    if args.json:
        print(f"saved {save_json(args.json, dict(benchmark='calibration_fidelity', threads=args.threads, head_dtype=dtype, candidates=lists, sampling=dataclasses.asdict(params), reference_prompts=args.reference_prompts + 1, reference_tok_s=ref, reference_ratio=ratio, runs=runs))}")


if __name__ == "__main__":
    main()
