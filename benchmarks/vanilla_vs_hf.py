"""minispec vanilla decoding vs transformers ``generate``: greedy tokens/s side by side.

A two-method view of ``python -m minispec bench`` (``minispec/lab/bench.py`` does the work): both
run in this one process on the same weights, the same prompt token ids (Spec-Bench questions,
chat template applied) and the same thread count, interleaved per question so machine drift
affects both alike. Prints a per-question table and the ratio; saves JSON.

    python benchmarks/vanilla_vs_hf.py --prompts 10 --max-new-tokens 128 --threads 2 \
        --json benchmarks/results/vanilla_vs_hf_cpu.json
"""

from __future__ import annotations

import argparse

import torch

from minispec.lab.bench import run_bench
from minispec.lab.benchinfo import save_json
from minispec.args import thread_count
from minispec.prompts import spec_bench


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--questions", default=None, help="Spec-Bench JSONL (default: ../shared/data/spec_bench.jsonl)")
    ap.add_argument("--prompts", type=int, default=8, help="number of questions, spread over categories")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=thread_count, default=2)
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    result = run_bench(spec_bench(args.questions, limit=args.prompts), methods=("hf", "vanilla"), model=args.model,
                       max_new_tokens=args.max_new_tokens, progress=False)
    print(f"{'#':>2} {'category':<16} {'prompt':>6} {'new':>4} {'HF tok/s':>9} {'minispec tok/s':>15} {'ratio':>6} same")
    for i, r in enumerate(result["rows"]):
        hf, ms = r["hf"], r["vanilla"]
        hf_tps, ms_tps = hf["new_tokens"] / hf["seconds"], ms["new_tokens"] / ms["seconds"]
        print(f"{i:>2} {r['category']:<16} {r['prompt_tokens']:>6} {ms['new_tokens']:>4} {hf_tps:>9.1f} {ms_tps:>15.1f} "
              f"{ms_tps / hf_tps:>6.2f} {'yes' if hf['identical'] else 'NO'}")
    s = result["summary"]
    summary = dict(minispec_tok_s=s["vanilla"]["tokens_per_s"], hf_tok_s=s["hf"]["tokens_per_s"],
                   ratio=s["vanilla"]["speedup"], identical=s["hf"]["identical"], n=s["hf"]["n"])
    print(f"\noverall: minispec {summary['minispec_tok_s']:.1f} tok/s, HF generate {summary['hf_tok_s']:.1f} tok/s, "
          f"ratio {summary['ratio']:.2f}x; identical outputs {summary['identical']}/{summary['n']}")
    if args.json:
        p = save_json(args.json, dict(benchmark="vanilla_vs_hf", summary=summary, methods=result["summary"],
                                      **{k: v for k, v in result.items() if k != "summary"}))
        print(f"saved {p}")


if __name__ == "__main__":
    main()
