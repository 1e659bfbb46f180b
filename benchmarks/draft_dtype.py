"""The EAGLE-1/2 head drafting in float32 against bfloat16 (``EagleDrafter(head_dtype=...)``), side by side.

A one-row draft level reads the head's layer and the LM-head rows of its draft vocabulary (~40 MB in
float32 for SmolLM2's head over 8192 tokens) and does little arithmetic with them, so on a CPU it waits
on memory; in bfloat16 it reads half. A draft only proposes: its precision can change acceptance (tau),
never the output, so every answer must equal vanilla's. On minispec's own prompts (never Spec-Bench),
greedy, interleaved prompt by prompt (vanilla, then each dtype), in one process. Reports per method:
tokens/s, the ratio to vanilla, tau, the draft phase's ms per step, and whether every answer is vanilla's.

    python benchmarks/draft_dtype.py --prompts 8 --max-new-tokens 128 --threads 2 --json benchmarks/results/draft_dtype_cpu.json
"""

from __future__ import annotations

import argparse
import time

import torch

from minispec import generate, load
from minispec.drafters.eagle import EagleDrafter
from minispec.lab.benchinfo import save_json
from minispec.args import thread_count
from minispec.methods import Methods
from minispec.prompts import own_prompts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="eagle@chain:2", help="an EAGLE-1/2 method of minispec.methods")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=thread_count, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, tok = load("smollm2-135m")
    base = Methods(target).drafter(args.method)
    if not isinstance(base, EagleDrafter):
        raise SystemExit(f"{args.method} is not an EAGLE-1/2 method")
    drafters = {name: EagleDrafter(target, base.head, tree=base.spec, draft_vocab=base.draft_vocab, head_dtype=dt)
                for name, dt in DTYPES.items()}
    prompts = [p["prompt"] for p in own_prompts()][: args.prompts]
    runs = {name: dict(seconds=0.0, tokens=0, forwards=0, draft_s=0.0, steps=0, identical=0)
            for name in ["vanilla", *drafters]}
    generate(target, tok, prompts[0], max_new_tokens=8)  # warm-up: first-call costs are nobody's
    for d in drafters.values():
        generate(target, tok, prompts[0], drafter=d, max_new_tokens=8)
    for p in prompts:
        ref = None
        for name in runs:
            t0 = time.perf_counter()
            r = generate(target, tok, p, drafter=drafters.get(name), max_new_tokens=args.max_new_tokens)
            dt = time.perf_counter() - t0
            ref = r.tokens if ref is None else ref
            m = runs[name]
            m["seconds"] += dt
            m["tokens"] += r.stats.new_tokens
            m["forwards"] += r.stats.target_forwards
            m["draft_s"] += r.stats.phase_s["draft"]
            m["steps"] += r.stats.target_forwards - 1
            m["identical"] += r.tokens == ref
    rows = {}
    for name, m in runs.items():
        rows[name] = dict(tokens_per_s=m["tokens"] / m["seconds"], tau=m["tokens"] / m["forwards"],
                          draft_ms_per_step=1e3 * m["draft_s"] / max(1, m["steps"]),
                          **{**m, "identical": f"{m['identical']}/{len(prompts)}"})
    for name, r in rows.items():
        r["vs_vanilla"] = r["tokens_per_s"] / rows["vanilla"]["tokens_per_s"]
        print(f"{name:9s} {r['tokens_per_s']:6.2f} tokens/s = {r['vs_vanilla']:.3f}x vanilla  tau {r['tau']:.2f}  "
              f"draft {r['draft_ms_per_step']:5.2f} ms/step  identical {r['identical']}", flush=True)
    result = dict(benchmark="draft_dtype", method=args.method, threads=args.threads, prompts=len(prompts),
                  max_new_tokens=args.max_new_tokens, questions="minispec own prompts", rows=rows)
    if args.json:
        print(f"saved {save_json(args.json, result)}")
    return result


if __name__ == "__main__":
    main()
