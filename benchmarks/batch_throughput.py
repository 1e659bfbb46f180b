"""Throughput of batched decoding (chapter 7): tokens/s at batch sizes 1, 4, 16 for transformers'
batched ``generate``, minispec's batched vanilla and batched EAGLE-2, on the same Spec-Bench
questions, in one process (``minispec.lab.bench.run_bench`` once per batch size).

Speculation trades extra rows in the target's forward for fewer forwards. At batch 1 those rows
are nearly free (the forward streams the weights once whatever the row count, up to the memory
floor); at batch B the forward already carries B rows, the draft trees multiply them by N + 1,
and past the compute knee every extra row costs its FLOPs: speculation's gain over batched
vanilla shrinks, and turns into a loss, as B grows. Notebook 07 plots the JSON this writes.

    python benchmarks/batch_throughput.py --limit 16 --max-new-tokens 64 --threads 2 \\
        --json benchmarks/results/batch_throughput_cpu.json
"""

from __future__ import annotations

import argparse

import torch

from minispec.lab.bench import format_table, run_bench
from minispec.lab.benchinfo import save_json
from minispec.args import thread_count
from minispec.prompts import spec_bench


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--methods", default="hf,vanilla,eagle2")
    ap.add_argument("--limit", type=int, default=16, help="Spec-Bench questions (a multiple of every batch size)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=thread_count, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    methods = [m.strip() for m in args.methods.split(",")]
    questions = spec_bench(limit=args.limit)
    runs = {}
    for B in sizes:
        r = run_bench(questions, methods=methods, max_new_tokens=args.max_new_tokens, batch_size=B)
        print(f"\nbatch size {B}\n" + format_table(dict(r, by_category={})), flush=True)
        runs[B] = dict(summary=r["summary"], settings=r["settings"])
    table = {B: {m: round(runs[B]["summary"][m]["tokens_per_s"], 2) for m in methods} for B in sizes}
    print("\ntokens/s by batch size:", table)
    gain = {B: {m: round(runs[B]["summary"][m]["tokens_per_s"] / runs[B]["summary"]["vanilla"]["tokens_per_s"], 3)
                for m in methods} for B in sizes} if "vanilla" in methods else {}
    out = dict(benchmark="batch_throughput", command="python benchmarks/batch_throughput.py " + " ".join(argv or []),
               batch_sizes=sizes, methods=methods, questions=len(questions), max_new_tokens=args.max_new_tokens,
               threads=args.threads, tokens_per_s=table, vs_vanilla=gain,
               identical={B: {m: f"{runs[B]['summary'][m]['identical']}/{runs[B]['summary'][m]['n']}" for m in methods}
                          for B in sizes},
               tau={B: {m: runs[B]["summary"][m]["tau"] for m in methods} for B in sizes}, runs=runs)
    if args.json:
        print(f"saved {save_json(args.json, out)}")
    return out


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
