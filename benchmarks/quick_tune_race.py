"""The quick calibration of ``auto`` (``dispatch.quick_tune``) with and without its race, one after the other in
one process, on this machine: wall time, choice and the candidate table of each.

    python benchmarks/quick_tune_race.py [--threads 2]

Run it with nothing else on the machine. The README's 63.5 s (no race) and 59.3 s (race) on the 2-core AMD EPYC
(AVX2 only, 2 threads, 2026-11-27) come from this script.
"""

import argparse
import time

import torch

from minispec import dispatch, load
from minispec.lab.tune_report import format_tune
from minispec.linear import prepack
from minispec.methods import Methods


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load("smollm2-135m")
    methods = Methods(model)
    prepack(model)
    race = dispatch.QUICK_RACE
    for r_ in (None, race):
        dispatch.QUICK_RACE = r_
        try:
            t = time.perf_counter()
            r = dispatch.quick_tune(model, tok, methods=methods)
            print(f"race {r_}: {time.perf_counter() - t:.1f} s, choice {r.choice} ({args.threads} threads, "
                  f"{dispatch.machine_key()})", flush=True)
            print(format_tune(r), flush=True)
        finally:
            dispatch.QUICK_RACE = race


if __name__ == "__main__":
    main()
