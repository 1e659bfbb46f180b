#!/usr/bin/env python3
"""Tree-attention verify step: dense-mask SDPA vs fused SDPA vs split (PyTorch, Triton) vs FlexAttention vs causal.

One process, the same tensors for every method, repetitions interleaved across methods (so a
slow period of the machine hits all of them alike). Shapes are Llama-3-8B-like by default
(32 query heads, 8 KV heads, head dim 128): T tree tokens attend to a committed prefix of
``ctx`` tokens plus themselves through a random tree mask.

    python benchmarks/bench_attention.py                 # CUDA: full grid, bf16
    python benchmarks/bench_attention.py --device cpu    # small CPU grid, fp32, Triton skipped
    python benchmarks/bench_attention.py --device cpu --interpret   # ... with Triton's interpreter
    python benchmarks/bench_attention.py --batch 1 --ctx 8192 16384 32768 --graphed   # CUDA-graph replays

Reported per shape and method: median time; achieved bandwidth of the KV read
(2 * B * Hkv * (ctx + T) * hd * bytes / time, K and V each read once); its share of a copy
bandwidth measured in the same run (a large torch copy, read + write); ratios to every peer.
On GPU the inputs rotate among several copies whose total exceeds the L2 cache (cold L2).

Results: benchmarks/results/attention_<device>.json (via minispec.lab.benchinfo.save_json). The grid
itself lives in ``minispec.lab.attention_grid`` (also run by ``python -m minispec gpu-suite``).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if available")
    ap.add_argument("--interpret", action="store_true", help="on CPU, run the Triton kernels in the interpreter (slow)")
    ap.add_argument("--ctx", type=int, nargs="+", help="prefix lengths (default GPU 512..32768, CPU 256 1024)")
    ap.add_argument("--tree", type=int, nargs="+", help="tree sizes T (default GPU 8 16 32 64, CPU 16 64)")
    ap.add_argument("--batch", type=int, nargs="+", help="batch sizes (default GPU 1 4 16 32, CPU 1)")
    ap.add_argument("--heads", type=int, nargs=3, metavar=("H", "HKV", "HD"),
                    help="query heads, KV heads, head dim (default GPU 32 8 128, CPU 8 2 64)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per method (default GPU 30, CPU 5)")
    ap.add_argument("--graphed", action="store_true",
                    help="time replays of CUDA graphs of the calls (no launch overhead; on CPU: the calls themselves)")
    ap.add_argument("--max-gb", type=float, default=12.0,
                    help="skip the PyTorch split reference where its fp32 score matrices would exceed this")
    ap.add_argument("--json", type=Path, default=None,
                    help="output path (default benchmarks/results/attention_<device>.json)")
    return ap.parse_args(argv)


ARGS = parse() if __name__ == "__main__" else None
if ARGS is not None and ARGS.interpret:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
elif ARGS is not None:  # importing minispec would switch the interpreter on where there is no GPU: only --interpret does
    os.environ.setdefault("TRITON_INTERPRET", "0")

import torch  # noqa: E402

from minispec.attention import triton_available  # noqa: E402
from minispec.lab.attention_grid import copy_bandwidth, run_grid  # noqa: E402
from minispec.lab.benchinfo import save_json  # noqa: E402


def main(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = device.type == "cuda"
    if gpu and not torch.cuda.is_available():
        print("error: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if gpu else torch.float32
    ctxs = args.ctx or ([512, 2048, 8192, 32768] if gpu else [256, 1024])
    trees = args.tree or ([8, 16, 32, 64] if gpu else [16, 64])
    batches = args.batch or ([1, 4, 16, 32] if gpu else [1])
    H, Hkv, hd = args.heads or ((32, 8, 128) if gpu else (8, 2, 64))
    reps = args.reps or (30 if gpu else 5)
    bw = copy_bandwidth(device)
    triton_note = "" if triton_available(device) else " (split_triton skipped)"
    print(f"device: {torch.cuda.get_device_name(0) if gpu else 'CPU'} | dtype {str(dtype)[6:]} | heads {H}/{Hkv}, "
          f"hd {hd} | copy bandwidth {bw:.1f} GB/s | torch threads {torch.get_num_threads()}{triton_note}")
    names = ["dense", "flash", "split_torch", "split_triton", "flex", "causal"]
    head = f"{'B':>3} {'ctx':>6} {'T':>3} " + " ".join(f"{n + ' us':>16}" for n in names) + \
           f" {'best GB/s':>9} {'% copy':>6} {'triton/dense':>12}"
    print(head)

    def print_row(r):
        med = r["median_s"]
        best = min((n for n in med if n != "causal"), key=med.get)
        tri = f"{med['dense'] / med['split_triton']:.2f}x" if "split_triton" in med else "-"
        print(f"{r['batch']:>3} {r['ctx']:>6} {r['tree']:>3} " + " ".join(
            f"{med[n] * 1e6:>16.1f}" if n in med else f"{'-':>16}" for n in names)
              + f" {r['kv_GBps'][best]:>9.1f} {100 * r['copy_share'][best]:>5.1f}% {tri:>12}", flush=True)

    grid = run_grid(device, dtype, batches, ctxs, trees, (H, Hkv, hd), reps, args.max_gb, on_row=print_row,
                    bandwidth=bw, graphed=args.graphed)
    notes, rows = grid["notes"], grid["results"]
    for n in sorted(notes):
        print("note:", n)
    name = "cpu" if not gpu else re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(0).lower()).strip("_")
    path = args.json or ROOT / "benchmarks" / "results" / f"attention_{name}.json"
    save_json(path, dict(benchmark="bench_attention", settings=dict(
        device=str(device), dtype=str(dtype), heads=H, kv_heads=Hkv, head_dim=hd, ctx=ctxs, tree=trees, batch=batches,
        reps=reps, interpret=os.environ.get("TRITON_INTERPRET") == "1", graphed=args.graphed,
        timing="median; interleaved repetitions" + ("; CUDA-graph replays" if args.graphed else "") +
        ("; cold L2 by rotating input copies; CUDA events" if gpu else "; time.perf_counter")),
        copy_bandwidth_GBps=bw, notes=sorted(notes), results=rows))
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
