"""Weights in 2 MiB pages or in 4 KiB ones (``minispec.exact.hugepages.huge_page_empty``), side by side in one process,
interleaved round by round: a memory copy of 480 MB; the 121 weight products of a SmolLM2 forward on the weight
panels at two rows (one ``torch.bmm`` each, no row recipe); and the one-row decode forward after 256 cached tokens with
every layer on the panels under its row recipe. Only the panels live in huge pages (oneDNN's prepacked weights are
oneDNN's own), so the forward runs on the panels whatever kernel ``auto`` chose on this machine; that choice is
printed beside.

    python benchmarks/huge_pages.py [--threads 2] [--rounds 9] [--json out.json]

It also reports whether the kernel gave huge pages at all (``AnonHugePages`` of this process, and the THP mode in
/sys/kernel/mm/transparent_hugepage/enabled): with THP "never", or off Linux, both sides are 4 KiB pages. Run it
with nothing else on the machine. Not part of CI: timings are machine-dependent.
"""

import argparse
import statistics
import time
from pathlib import Path

import torch

from minispec import load
from minispec.config import thp_mode
from minispec.exact import hugepages
from minispec.exact.linear import ExactLinear as Linear, panels, prepack
from minispec.exact.hugepages import huge_page_empty
from minispec.exact.kernels import chosen_kernel
from minispec.lab.benchinfo import save_json
from minispec.args import thread_count
from minispec.lab.profile import _decode_forward

SIDES = ("4k", "2m")


def anon_huge_kb() -> int:
    rollup = Path("/proc/self/smaps_rollup")
    if not rollup.exists():
        return 0
    return next((int(line.split()[1]) for line in rollup.read_text().splitlines() if line.startswith("AnonHugePages")), 0)


def with_pages(side: str, fn):
    """``fn()`` with ``hugepages.HUGE_PAGES`` on ("2m") or off ("4k")."""
    before = hugepages.HUGE_PAGES
    hugepages.HUGE_PAGES = side == "2m" and before
    try:
        return fn()
    finally:
        hugepages.HUGE_PAGES = before


def median_ms(fn, n: int) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=thread_count, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    huge_before = anon_huge_kb()

    n = 120_000_000  # 480 MB of float32
    src = {s: with_pages(s, lambda: huge_page_empty((n,))).fill_(1.0) for s in SIDES}
    dst = {s: with_pages(s, lambda: huge_page_empty((n,))).fill_(0.0) for s in SIDES}

    auto_kernel = chosen_kernel()
    Linear.cpu_kernel = "panels"  # the forward below on the panels, whatever "auto" chose here
    model, _ = load("smollm2-135m")
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    packs = {s: with_pages(s, lambda: [panels(layer.weight.detach()) for layer in layers]) for s in SIDES}
    xs = {k: torch.randn(2, k) for k in {layer.in_features for layer in layers}}

    def products(side):
        for layer, wp in zip(layers, packs[side]):
            torch.bmm(xs[layer.in_features].expand(wp.shape[0], -1, -1), wp)

    # the model's own prepacked panels, rebuilt on each side's pages before each round of forwards
    forward = _decode_forward(model, 256)

    def repack(side):
        for m in layers:
            m.__dict__.pop("_panel_parts", None)
        with_pages(side, lambda: prepack(model))

    times = {k: {s: [] for s in SIDES} for k in ("copy_ms", "products_ms", "forward_ms")}
    with torch.inference_mode():
        for r in range(args.rounds + 1):  # round 0 warms up
            for s in SIDES:
                t = {"copy_ms": median_ms(lambda: dst[s].copy_(src[s]), 3),
                     "products_ms": median_ms(lambda: products(s), 5)}
                repack(s)
                forward()
                t["forward_ms"] = median_ms(forward, 10)
                if r:
                    for k, v in t.items():
                        times[k][s].append(v)
    huge_after = anon_huge_kb()
    summary = {k: {s: statistics.median(v[s]) for s in SIDES} for k, v in times.items()}
    for k, v in summary.items():
        v["4k_over_2m"] = v["4k"] / v["2m"]
    copy_gb_s = {s: 2 * n * 4 / summary["copy_ms"][s] / 1e6 for s in SIDES}
    print(f"THP: {thp_mode()}; AnonHugePages of this process {huge_before} -> {huge_after} kB; "
          f"the linear kernel 'auto' uses on this machine: {auto_kernel} (the forward here: panels)")
    print(f"copy of 480 MB: 4 KiB pages {copy_gb_s['4k']:.1f} GB/s, 2 MiB pages {copy_gb_s['2m']:.1f} GB/s")
    for k in ("products_ms", "forward_ms"):
        v = summary[k]
        print(f"{k[:-3]:9s} 4 KiB pages {v['4k']:.1f} ms, 2 MiB pages {v['2m']:.1f} ms: {v['4k_over_2m']:.2f}x")
    if args.json:
        print("saved", save_json(args.json, dict(benchmark="huge_pages", threads=args.threads, rounds=args.rounds,
                                                  thp=thp_mode(), auto_kernel=auto_kernel, anon_huge_kb=dict(before=huge_before, after=huge_after),
                                                  copy_gb_s=copy_gb_s, summary=summary, rounds_ms=times)))


if __name__ == "__main__":
    main()
