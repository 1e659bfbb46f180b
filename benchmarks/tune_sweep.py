#!/usr/bin/env python3
"""Does the tree dispatcher choose well? Tune, then sweep every candidate on the same Spec-Bench subset.

    python benchmarks/tune_sweep.py --limit 8 --threads 2

1. ``minispec.lab.tune.tune`` on the subset (short calibration generations) -> the choice;
2. ``minispec.lab.bench.run_bench`` of every candidate on the same subset, full length, interleaved
   per question in one process -> measured tokens/s;
3. reports the choice's measured tokens/s against the best measured one (target: within 10%).

Results: benchmarks/results/tune_sweep_<device>.json (device, versions, the cost curve, the
candidate table, the sweep table).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from minispec import load
from minispec.lab.bench import format_table, run_bench
from minispec.lab.benchinfo import save_json
from minispec.auto import DEFAULT_CANDIDATES
from minispec.lab.tune import save_choice, tune
from minispec.args import thread_count
from minispec.lab.tune_report import format_tune
from minispec.methods import Methods
from minispec.prompts import spec_bench

HERE = Path(__file__).resolve().parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--questions", default=None, help="Spec-Bench JSONL (default: ../shared/data/spec_bench.jsonl)")
    ap.add_argument("--limit", type=int, default=8, help="questions, spread over the categories")
    ap.add_argument("--calibration-tokens", type=int, default=64, help="max_new_tokens of tune's calibration runs")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="max_new_tokens of the sweep")
    ap.add_argument("--candidates", default=",".join(DEFAULT_CANDIDATES))
    ap.add_argument("--threads", type=thread_count, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    questions = spec_bench(args.questions, limit=args.limit)
    cands = [c.strip() for c in args.candidates.split(",") if c.strip()]
    target, tok = load(args.model)
    r = tune(target, tok, [q["prompt"] for q in questions], args.model, candidates=cands,
             max_new_tokens=args.calibration_tokens, methods=Methods(target, args.model))
    print(format_tune(r))
    save_choice(r)
    ran = [c.method for c in r.candidates]
    sweep = run_bench(questions, methods=ran, model=args.model, max_new_tokens=args.max_new_tokens)
    print(format_table(sweep))
    measured = {m: s["tokens_per_s"] for m, s in sweep["summary"].items()}
    best = max(measured, key=measured.get)
    ratio = measured[r.choice] / measured[best]
    verdict = "PASS" if ratio >= 0.9 else "MISS"
    print(f"\nchoice {r.choice}: {measured[r.choice]:.1f} tok/s; best in the sweep {best}: {measured[best]:.1f} tok/s; "
          f"ratio {ratio:.3f} ({verdict}: target >= 0.90)")
    not_identical = [m for m, s in sweep["summary"].items() if s["identical"] != s["n"]]
    if not_identical:
        print(f"WARNING: outputs differ from vanilla for {not_identical}")
    dev = torch.cuda.get_device_name(0).replace(" ", "_").lower() if torch.cuda.is_available() else "cpu"
    out = args.out or HERE / "results" / f"tune_sweep_{dev}.json"
    print(f"saved {save_json(out, dict(benchmark='tune_sweep', tune=r.as_dict(), sweep=sweep, choice=r.choice, best=best, ratio=ratio, settings=vars(args)))}")
    return 0 if ratio >= 0.9 else 1


if __name__ == "__main__":
    raise SystemExit(main())
