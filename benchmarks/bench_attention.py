#!/usr/bin/env python3
"""Tree-attention verify step: dense-mask SDPA vs split (PyTorch, Triton) vs FlexAttention vs causal.

One process, the same tensors for every method, repetitions interleaved across methods (so a
slow period of the machine hits all of them alike). Shapes are Llama-3-8B-like by default
(32 query heads, 8 KV heads, head dim 128): T tree tokens attend to a committed prefix of
``ctx`` tokens plus themselves through a random tree mask.

    python benchmarks/bench_attention.py                 # CUDA: full grid, bf16
    python benchmarks/bench_attention.py --device cpu    # small CPU grid, fp32, Triton skipped
    python benchmarks/bench_attention.py --device cpu --interpret   # ... with Triton's interpreter

Reported per shape and method: median time; achieved bandwidth of the KV read
(2 * B * Hkv * (ctx + T) * hd * bytes / time, K and V each read once); its share of a copy
bandwidth measured in the same run (a large torch copy, read + write); ratios to every peer.
On GPU the inputs rotate among several copies whose total exceeds the L2 cache (cold L2).

Results: benchmarks/results/attention_<device>.json (via minispec.benchinfo.save_json).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import time
import warnings
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
    ap.add_argument("--max-gb", type=float, default=12.0,
                    help="skip the PyTorch split reference where its fp32 score matrices would exceed this")
    ap.add_argument("--json", type=Path, default=None,
                    help="output path (default benchmarks/results/attention_<device>.json)")
    return ap.parse_args(argv)


ARGS = parse() if __name__ == "__main__" else None
if ARGS is not None and ARGS.interpret:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import torch  # noqa: E402

from minispec.attention import dense_attention, split_attention, triton_available  # noqa: E402
from minispec.benchinfo import save_json  # noqa: E402

L2_BYTES = 50 * 2**20  # H100: 50 MiB; rotating inputs past 2x this keeps each call's KV cold


def tree_mask(T: int, B: int, g: torch.Generator) -> torch.Tensor:
    """[B, T, T] ancestor masks of random trees (each node: itself and its ancestors)."""
    out = torch.zeros(B, T, T, dtype=torch.bool)
    for b in range(B):
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, T)]
        for i in range(T):
            j = i
            while j >= 0:
                out[b, i, j] = True
                j = parents[j]
    return out


def copy_bandwidth(device: torch.device) -> float:
    """GB/s of a large device copy (bytes read + bytes written over time), median of 10."""
    n = (1 << 30 if device.type == "cuda" else 1 << 28) // 4
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    times = [timed(lambda: dst.copy_(src), device) for _ in range(12)][2:]
    return 2 * n * 4 / statistics.median(times) / 1e9


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def make_flex(device: torch.device):
    """(flex_attention callable, create_block_mask) or (None, reason)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:
        return None, f"FlexAttention unavailable: {e}"
    if device.type == "cuda":
        return (torch.compile(flex_attention, dynamic=False), create_block_mask), None
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    return (flex_attention, create_block_mask), "FlexAttention on CPU runs eagerly (unfused reference path)"


def lower_right_causal(T: int, S: int):
    try:
        from torch.nn.attention.bias import causal_lower_right
        return causal_lower_right(T, S)
    except ImportError:
        return torch.ones(T, S, dtype=torch.bool).tril(S - T)


def run_shape(B, H, Hkv, hd, P, T, device, dtype, reps, methods_ok, flex, max_gb, notes):
    S = P + T
    g = torch.Generator().manual_seed(P * 131 + T * 7 + B)
    kv_bytes = 2 * B * Hkv * S * hd * torch.finfo(dtype).bits // 8
    copies = max(1, min(16, math.ceil(2 * L2_BYTES / kv_bytes))) if device.type == "cuda" else 1
    mask = tree_mask(T, B, g).to(device)  # [B, T, T]
    full = torch.cat([torch.ones(B, T, P, dtype=torch.bool, device=device), mask], -1)[:, None]  # [B, 1, T, S]
    inputs = [tuple(torch.randn(*shape, generator=g).to(device, dtype)
                    for shape in ((B, H, T, hd), (B, Hkv, S, hd), (B, Hkv, S, hd))) for _ in range(copies)]
    causal = lower_right_causal(T, S)
    fns = {"dense": lambda q, k, v: dense_attention(q, k, v, full),
           "causal": lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
               q, k, v, attn_mask=causal, enable_gqa=H != Hkv)}
    score_gb = B * H * T * P * 4 * 3 / 1e9  # fp32 scores, probabilities, a temporary
    if score_gb <= max_gb:
        fns["split_torch"] = lambda q, k, v: split_attention(q, k, v, P, mask)
    else:
        notes.add(f"split_torch skipped where its fp32 score matrices exceed {max_gb} GB (--max-gb)")
    if methods_ok["split_triton"]:
        from minispec.attention.triton_split import split_attention_triton
        fns["split_triton"] = lambda q, k, v: split_attention_triton(q, k, v, P, mask)
    if flex is not None:
        flex_attention, create_block_mask = flex
        tm = mask

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx < P) | tm[b, q_idx, (kv_idx - P).clamp(min=0)]

        try:
            bm = create_block_mask(mask_mod, B, None, T, S, device=str(device))
            fns["flex"] = lambda q, k, v: flex_attention(q, k, v, block_mask=bm, enable_gqa=H != Hkv)
        except Exception as e:  # noqa: BLE001  (a torch version without support for these shapes)
            notes.add(f"FlexAttention skipped: {type(e).__name__}: {str(e)[:120]}")
    ref = fns["dense"](*inputs[0]).float()
    err = {}
    for name, fn in list(fns.items()):
        try:
            for _ in range(2):  # warm-up: compilation, autotuning, allocator
                out = fn(*inputs[0])
            if name != "causal":
                err[name] = (out.float() - ref).abs().max().item()
        except Exception as e:  # noqa: BLE001
            notes.add(f"{name} failed at B={B} ctx={P} T={T}: {type(e).__name__}: {str(e)[:160]}")
            del fns[name]
    if device.type == "cuda":
        torch.cuda.synchronize()
    times = {name: [] for name in fns}
    for r in range(reps):
        for name, fn in fns.items():  # interleaved: every method sees the same machine state
            times[name].append(timed(lambda: fn(*inputs[r % copies]), device))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return dict(batch=B, ctx=P, tree=T, heads=H, kv_heads=Hkv, head_dim=hd, dtype=str(dtype).replace("torch.", ""),
                kv_bytes=kv_bytes, input_copies=copies, reps=reps, median_s=med,
                kv_GBps={n: kv_bytes / t / 1e9 for n, t in med.items()},
                ratio={n: {m: med[n] / med[m] for m in med if m != n} for n in med},
                max_abs_err_vs_dense=err)


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
    notes = set()
    methods_ok = {"split_triton": triton_available(device)}
    if not methods_ok["split_triton"]:
        notes.add("split_triton skipped: " + ("pass --interpret to run the kernels in Triton's interpreter on CPU"
                                               if not gpu else "triton is not available"))
    elif not gpu:
        notes.add("split_triton ran in Triton's interpreter (numpy on CPU): its times say nothing about GPU speed")
    flex, why = make_flex(device)
    if why:
        notes.add(why)
    bw = copy_bandwidth(device)
    print(f"device: {torch.cuda.get_device_name(0) if gpu else 'CPU'} | dtype {str(dtype)[6:]} | heads {H}/{Hkv}, "
          f"hd {hd} | copy bandwidth {bw:.1f} GB/s | torch threads {torch.get_num_threads()}")
    rows = []
    names = ["dense", "split_torch", "split_triton", "flex", "causal"]
    head = f"{'B':>3} {'ctx':>6} {'T':>3} " + " ".join(f"{n + ' us':>16}" for n in names) + \
           f" {'best GB/s':>9} {'% copy':>6} {'triton/dense':>12}"
    print(head)
    for B in batches:
        for P in ctxs:
            for T in trees:
                r = run_shape(B, H, Hkv, hd, P, T, device, dtype, reps, methods_ok, flex, args.max_gb, notes)
                r["copy_share"] = {n: g / bw for n, g in r["kv_GBps"].items()}
                rows.append(r)
                med = r["median_s"]
                best = min((n for n in med if n != "causal"), key=med.get)
                tri = f"{med['dense'] / med['split_triton']:.2f}x" if "split_triton" in med else "-"
                print(f"{B:>3} {P:>6} {T:>3} " + " ".join(f"{med[n] * 1e6:>16.1f}" if n in med else f"{'-':>16}"
                                                          for n in names)
                      + f" {r['kv_GBps'][best]:>9.1f} {100 * r['copy_share'][best]:>5.1f}% {tri:>12}", flush=True)
    for n in sorted(notes):
        print("note:", n)
    name = "cpu" if not gpu else re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(0).lower()).strip("_")
    path = args.json or ROOT / "benchmarks" / "results" / f"attention_{name}.json"
    save_json(path, dict(benchmark="bench_attention", settings=dict(
        device=str(device), dtype=str(dtype), heads=H, kv_heads=Hkv, head_dim=hd, ctx=ctxs, tree=trees, batch=batches,
        reps=reps, interpret=os.environ.get("TRITON_INTERPRET") == "1", timing="median; interleaved repetitions" +
        ("; cold L2 by rotating input copies; CUDA events" if gpu else "; time.perf_counter")),
        copy_bandwidth_GBps=bw, notes=sorted(notes), results=rows))
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
