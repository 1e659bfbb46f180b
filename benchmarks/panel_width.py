"""The weight panels' width: the 121 products of a SmolLM2 forward at the two rows a one-row decode step pads
to, with the weights cut into panels of 16, 32, 64 and 128 output features (``minispec.exact.linear.PANEL`` is 32),
interleaved round by round in one process, each width's pass timed after an untimed one.

    python benchmarks/panel_width.py [--threads 2] [--rounds 12] [--json out.json]

Run it with nothing else on the machine. Not part of CI: timings are machine-dependent.
"""

import argparse
import statistics
import time

import torch

from minispec import load
from minispec.lab.benchinfo import save_json
from minispec.exact.linear import PANEL, panels
from torch.nn import Linear
from minispec.args import thread_count

WIDTHS = (16, 32, 64, 128)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=thread_count, default=2)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load("smollm2-135m")
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    packs = {w: [panels(layer.weight.detach(), w) for layer in layers] for w in WIDTHS}
    xs = {n: torch.randn(2, n) for n in {layer.in_features for layer in layers}}

    def forward(width):
        for layer, wp in zip(layers, packs[width]):
            torch.bmm(xs[layer.in_features].expand(wp.shape[0], -1, -1), wp)

    times = {w: [] for w in WIDTHS}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for w in WIDTHS:
                forward(w)  # untimed: this width's panels through the caches as decoding would have them
                t = time.perf_counter()
                forward(w)
                times[w].append(time.perf_counter() - t)
    median_ms = {w: statistics.median(ts[1:]) * 1e3 for w, ts in times.items()}
    for w, ms in median_ms.items():
        print(f"panel width {w:4d}: {ms:6.2f} ms for the {len(layers)} products at 2 rows"
              + ("  (minispec's PANEL)" if w == PANEL else ""))
    if args.json:
        print(f"saved {save_json(args.json, dict(benchmark='panel_width', threads=args.threads, rounds=args.rounds, products=len(layers), rows=2, median_ms={str(w): ms for w, ms in median_ms.items()}))}")


if __name__ == "__main__":
    main()
