"""Compare checkpoints of the same drafter kind on SmolLM2-135M: greedy tau, tokens/s and identity to vanilla.

    python benchmarks/compare_heads.py --heads old=/path/a.safetensors new=/path/b.safetensors \
        --trees 'chain:5;5,8,32' --prompts 4 --max-new-tokens 64 --json OUT.json

Prompts: the first ``--prompts`` of ``minispec.prompts.own_prompts()`` (never Spec-Bench); each
head drafts every tree; tau = new tokens / target forwards (prefill included), as ``bench``. Timed
interleaved by prompt (vanilla, then every head and tree on the same prompt), so tokens/s and the ratio to
vanilla compare side by side in one process; loading a drafter is outside the timing.
"""
import argparse
import json
import time

import torch

import minispec
from minispec import generate
from minispec.lab.benchinfo import device_info, versions
from minispec.drafters.loader import load_drafter
from minispec.args import thread_count
from minispec.prompts import own_prompts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", nargs="+", required=True, help="NAME=PATH.safetensors (its .json record beside it)")
    ap.add_argument("--trees", default="chain:5;5,8,32", help="trees separated by ';'")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=thread_count, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    heads = dict(h.split("=", 1) for h in args.heads)
    torch.set_num_threads(args.threads)
    target, tok = minispec.load("smollm2-135m")
    prompts = [p["prompt"] for p in own_prompts()[:args.prompts]]
    configs = [(name, path, tree) for name, path in heads.items() for tree in args.trees.split(";")]
    acc = {f"{n}@{t}": dict(new_tokens=0, target_forwards=0, decode_s=0.0, identical_to_vanilla=True) for n, _, t in configs}
    vanilla_s = vanilla_new = 0
    for p in prompts:  # interleaved by prompt: a drift of the machine's speed falls on every config alike
        t0 = time.perf_counter()
        want = generate(target, tok, p, max_new_tokens=args.max_new_tokens).tokens
        vanilla_s, vanilla_new = vanilla_s + time.perf_counter() - t0, vanilla_new + len(want)
        for name, path, tree in configs:
            drafter = load_drafter(path, target, tree=tree, verbose=False)
            t0 = time.perf_counter()
            r = generate(target, tok, p, drafter=drafter, max_new_tokens=args.max_new_tokens)
            a = acc[f"{name}@{tree}"]
            a["decode_s"] += time.perf_counter() - t0
            a["identical_to_vanilla"] &= r.tokens == want
            a["new_tokens"] += r.stats.new_tokens
            a["target_forwards"] += r.stats.target_forwards
    vanilla_tps = vanilla_new / vanilla_s
    results = dict(vanilla=dict(new_tokens=vanilla_new, decode_s=round(vanilla_s, 1), tokens_per_s=round(vanilla_tps, 2)))
    for key, a in acc.items():
        tps = a["new_tokens"] / a["decode_s"]
        results[key] = dict(a, tau=round(a["new_tokens"] / a["target_forwards"], 3), decode_s=round(a["decode_s"], 1),
                            tokens_per_s=round(tps, 2), speedup_vs_vanilla=round(tps / vanilla_tps, 3))
        print(f"{key:>24}  tau {results[key]['tau']:.3f}  {tps:6.2f} tok/s  {tps / vanilla_tps:.2f}x vanilla  "
              f"identical to vanilla: {a['identical_to_vanilla']}", flush=True)
    if args.json:
        out = dict(heads=heads, prompts=len(prompts), max_new_tokens=args.max_new_tokens, greedy=True, threads=args.threads,
                   results=results, device=device_info(), versions=versions())
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
