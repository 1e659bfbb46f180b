"""Compare two checkpoints of the same drafter kind on SmolLM2-135M: greedy tau and identity to vanilla.

    python benchmarks/compare_heads.py --heads old=/path/a.safetensors new=/path/b.safetensors \
        --trees chain:5,5,8,32 --prompts 4 --max-new-tokens 64 --json OUT.json

Prompts: the first ``--prompts`` of ``minispec.prompts.own_prompts()`` (never Spec-Bench); each
head drafts every tree; tau = new tokens / target forwards (prefill included), as ``bench``.
"""
import argparse
import json
import time

import torch

import minispec
from minispec import generate
from minispec.lab.benchinfo import device_info, versions
from minispec.drafters.loader import load_drafter
from minispec.prompts import own_prompts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", nargs="+", required=True, help="NAME=PATH.safetensors (its .json record beside it)")
    ap.add_argument("--trees", default="chain:5;5,8,32", help="trees separated by ';'")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    heads = dict(h.split("=", 1) for h in args.heads)
    torch.set_num_threads(args.threads)
    target, tok = minispec.load("smollm2-135m")
    prompts = [p["prompt"] for p in own_prompts()[:args.prompts]]
    vanilla = {p: generate(target, tok, p, max_new_tokens=args.max_new_tokens).tokens for p in prompts}
    results = {}
    for name, path in heads.items():
        for tree in args.trees.split(";"):
            new = fwd = 0
            identical, t0 = True, time.perf_counter()
            for p in prompts:
                r = generate(target, tok, p, drafter=load_drafter(path, target, tree=tree, verbose=False),
                             max_new_tokens=args.max_new_tokens)
                identical &= r.tokens == vanilla[p]
                new, fwd = new + r.stats.new_tokens, fwd + r.stats.target_forwards
            results[f"{name}@{tree}"] = dict(tau=round(new / fwd, 3), identical_to_vanilla=identical,
                                             new_tokens=new, target_forwards=fwd,
                                             decode_s=round(time.perf_counter() - t0, 1))
            print(f"{name:>10} {tree:>8}  tau {new / fwd:.3f}  identical to vanilla: {identical}", flush=True)
    if args.json:
        out = dict(heads=heads, prompts=len(prompts), max_new_tokens=args.max_new_tokens, greedy=True,
                   results=results, device=device_info(), versions=versions())
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
