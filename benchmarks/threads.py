"""Vanilla decoding speed against the torch thread count, on an idle machine and beside a busy process.

A 2-core CPU shared with one other busy process is the common case on a laptop or a CI runner:
torch's OpenMP threads spin-wait for each other, so when one of them is descheduled every
matrix product waits for it. This measures vanilla tokens/s (SmolLM2-135M, greedy) for each
thread count, first alone, then with ``--busy`` pure-Python busy loops running beside it, and
writes what ``minispec.lab.env.default_threads`` chooses.

    python benchmarks/threads.py --threads 1,2 --busy 1 --max-new-tokens 64 --json benchmarks/results/threads_cpu.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

import torch

from minispec import generate, load
from minispec.lab.benchinfo import save_json
from minispec.lab.env import default_threads
from minispec.args import thread_counts
from minispec.prompts import own_prompts


def _spin(stop):
    while not stop.is_set():
        pass


def tokens_per_s(model, tok, prompts, threads: int, max_new_tokens: int) -> float:
    torch.set_num_threads(threads)
    generate(model, tok, prompts[0], max_new_tokens=8)  # warm-up
    new, t0 = 0, time.perf_counter()
    for p in prompts:
        new += generate(model, tok, p, max_new_tokens=max_new_tokens).stats.new_tokens
    return new / (time.perf_counter() - t0)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=thread_counts, default="1,2")
    ap.add_argument("--busy", type=int, default=1, help="busy processes beside the run in the loaded case")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    load_at_start, chosen = os.getloadavg()[0], default_threads()
    model, tok = load("smollm2-135m")
    prompts = [p["prompt"] for p in own_prompts()][: args.prompts]
    counts = args.threads
    rows = []
    for busy in (0, args.busy):
        stop = mp.Event()
        procs = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(busy)]
        for p in procs:
            p.start()
        try:
            for n in counts:
                tps = tokens_per_s(model, tok, prompts, n, args.max_new_tokens)
                rows.append(dict(threads=n, busy_processes=busy, tokens_per_s=tps))
                print(f"threads {n}, {busy} busy process(es) beside it: {tps:.1f} tokens/s", flush=True)
        finally:
            stop.set()
            for p in procs:
                p.join()
    result = dict(benchmark="threads", cores=os.cpu_count(), load_average_at_start=load_at_start,
                  default_threads_at_start=chosen,
                  max_new_tokens=args.max_new_tokens, prompts=len(prompts), rows=rows)
    if args.json:
        print(f"saved {save_json(args.json, result)}")
    return result


if __name__ == "__main__":
    main()
