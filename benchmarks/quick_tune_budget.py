"""The quick calibration of ``auto`` (``lab.calibrate.quick_tune``) as it runs (racing, within ``QUICK_BUDGET_S``),
and without its budget, and without its race either, one after the other in one process, on this machine: wall
time, choice, prompts run and the candidate table of each.

    python benchmarks/quick_tune_budget.py [--threads 2]

Run it with nothing else on the machine. The README's calibration times on the 2-core AMD EPYC (AVX2 only)
come from this script.
"""

import argparse
import time

import torch

from minispec import auto, load
from minispec.lab import calibrate
from minispec.args import thread_count
from minispec.lab.tune_report import format_tune
from minispec.methods import Methods


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=thread_count, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load("smollm2-135m")
    methods = Methods(model)
    race = calibrate.QUICK_RACE
    for name, race_, budget in (("as it runs (race, budget)", race, calibrate.QUICK_BUDGET_S),
                                ("race, no budget", race, None), ("no race, no budget", None, None)):
        calibrate.QUICK_RACE = race_
        try:
            t = time.perf_counter()
            r = calibrate.quick_tune(model, tok, methods=methods, budget_s=budget)
            print(f"{name}: {time.perf_counter() - t:.1f} s, choice {r.choice}, prompts run "
                  f"{max(c.prompts for c in r.candidates)} ({args.threads} threads, {auto.machine_key()})", flush=True)
            print(format_tune(r), flush=True)
        finally:
            calibrate.QUICK_RACE = race


if __name__ == "__main__":
    main()
