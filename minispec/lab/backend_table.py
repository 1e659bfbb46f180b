"""Measure the attention backend table on a GPU: dense / flash / split per (batch, context, tree rows).

For each grid point a static cache of ``context`` slots per row, every row holding ``context - T``
committed tokens and T new ones after them (a decode step, a chain or a tree under a random
ancestor mask), and the three backends of ``minispec.attention.table`` called exactly as a graph
runner calls them (``run_backend``: the dense and flash masks over the cache's slots, the split's
lengths as a device tensor). Each backend's ``calls`` back-to-back calls on distinct input copies
are captured in one CUDA graph (``attention_grid.capture_calls``; ``--eager`` times plain calls)
and the replay is timed with CUDA events after overwriting twice the L2 cache (cold KV reads),
the backends' repetitions interleaved. The fastest backend per point becomes the table, saved
as JSON naming the GPU (``table`` inside the file: ``attention.table.load_table`` reads it), with
every timing, the winner's margin over the runner-up, each backend's largest deviation from
dense, the SDPA kernel each SDPA call lands on, and the points that failed or ran out of time.

    python -m minispec.lab.backend_table --out benchmarks/results/gpu-NAME/backend_table.json
    python -m minispec.lab.backend_table --dry-run --out /tmp/backend_table.json   # CPU, tiny shapes

``--save`` also keeps the table where the graph runner reads it on this machine
(``attention.table.table_path``, named by the GPU): ``cuda_graphs.GraphedForward`` then picks each bucket's
backend from it instead of the default (``attention.table.table_for``).

``--dry-run`` runs every code path on the CPU at tiny shapes (the Triton kernel in the
interpreter, the "graph" a direct call): it checks the plumbing and that the three backends
agree; its times say nothing about a GPU. Grid points are visited corners first
(``attention_grid.coarse_first``), so a budget cut short still spans the grid.

Shapes: B batch, H query heads, Hkv KV heads, hd head dim, C = context cache slots, T tree rows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from .attention_grid import CALLS, capture_calls, coarse_first, flush_buffer, l2_bytes, random_inputs, timed, tree_mask

GPU_AXES = dict(batch=(1, 4, 16, 32), context=(1024, 4096, 8192, 16384, 32768), tree=(1, 8, 32, 64))
DRY_AXES = dict(batch=(1, 2), context=(24, 48), tree=(1, 5))
GPU_HEADS, DRY_HEADS = (32, 8, 128), (4, 2, 16)  # (H, Hkv, hd): Llama-3-8B's; a tiny GQA for the dry run


def measure_point(B: int, C: int, T: int, heads, device, dtype, reps: int, graphed: bool, flush) -> dict:
    """Time the three backends at one grid point; returns its row (``median_s``, ``best``, ``margin``, ...).

    A backend that fails (its warm-up, capture or a shape out of memory) is left out of the row and its
    error kept under ``failed``."""
    from ..attention.reference import dense_backend, sdpa_backend
    from ..attention.table import TABLE_BACKENDS, run_backend
    from ..attention.triton_split import SplitWorkspace

    H, Hkv, hd = heads
    P = C - T
    g = torch.Generator().manual_seed(C * 131 + T * 7 + B)
    kv_bytes = 2 * B * Hkv * C * hd * torch.finfo(dtype).bits // 8
    copies = max(1, min(CALLS, -(-2 * l2_bytes(device) // kv_bytes))) if device.type == "cuda" else 1
    tree = tree_mask(T, B, g).to(device)  # [B, T, T]
    mask = torch.cat([torch.ones(B, T, P, dtype=torch.bool, device=device), tree], -1)[:, None]  # [B, 1, T, C]
    lengths = torch.full((B,), P, dtype=torch.int32, device=device)
    inputs = random_inputs(B, H, Hkv, hd, C, T, copies, device, dtype, g)  # (q, the cache's k, v) per copy
    ws = SplitWorkspace()
    outs = {n: torch.empty(B, H, T, hd, device=device, dtype=dtype) for n in TABLE_BACKENDS}
    fns = {n: (lambda q, k, v, n=n: run_backend(n, q, k, v, lengths, tree, mask, out=outs[n], workspace=ws))
           for n in TABLE_BACKENDS}
    err, failed, ref = {}, {}, None
    for name, fn in list(fns.items()):  # warm-up, and every backend against dense on the first copy
        try:
            got = fn(*inputs[0]).float()
            ref = got if name == "dense" else ref
            err[name] = (got - ref).abs().max().item() if ref is not None else None
        except Exception as e:  # noqa: BLE001  (out of memory, a kernel that does not compile here: time the rest)
            failed[name] = f"{type(e).__name__}: {str(e)[:200]}"
            del fns[name]
    calls = len(inputs) if device.type == "cuda" else 1
    runs = {}
    for name, fn in fns.items():
        try:
            calls_of = [lambda fn=fn, i=i: fn(*inputs[i]) for i in range(calls)]
            runs[name] = capture_calls(calls_of, device) if graphed else (lambda c=calls_of: [f() for f in c])
        except Exception as e:  # noqa: BLE001
            failed[name] = f"capture: {type(e).__name__}: {str(e)[:200]}"
    times = {name: [] for name in runs}
    for _ in range(reps):
        for name, run in runs.items():  # interleaved: the same machine state for every backend
            times[name].append(timed(run, device, 1, flush) / calls)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    order = sorted(med, key=med.get)
    q, k, _ = inputs[0]
    return dict(batch=B, context=C, tree=T, prefix=P, heads=H, kv_heads=Hkv, head_dim=hd,
                dtype=str(dtype).replace("torch.", ""), kv_bytes=kv_bytes, input_copies=copies, calls_per_timing=calls,
                graphed=graphed, reps=reps, median_s=med, best=order[0] if order else None,
                margin=med[order[1]] / med[order[0]] if len(order) > 1 else None,
                max_abs_err_vs_dense={n: e for n, e in err.items() if n != "dense"}, failed=failed,
                sdpa_backend=dict(dense=dense_backend(q, k, mask),
                                  flash=sdpa_backend(q.reshape(B, Hkv, -1, hd), k, mask)))


def measure_table(device, dtype, batches, contexts, trees, heads=GPU_HEADS, reps: int = 10, graphed: bool = True,
                  deadline: float | None = None, on_row=None) -> dict:
    """The backend table over batch x context x tree rows.

    Args:
        device, dtype: where and in which precision to measure (a GPU; the dry run: the CPU, float32).
        batches, contexts, trees: the grid's axes (contexts: cache slots per row, each > every tree size).
        heads: (H, Hkv, hd); reps: timed repetitions per backend and point.
        graphed: time CUDA-graph replays (the graph runner's case) rather than eager calls.
        deadline: a ``time.perf_counter()`` value after which no new point starts (None: no limit).
        on_row: called with each row as it is measured.
    Returns:
        dict(table=BackendTable.to_dict() of the measured winners, results=[rows], skipped=[points], graphed,
        l2_flush_bytes); a point that raised is a row with its ``error``.
    """
    from ..attention.table import BackendTable

    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        from ..config import cpu_model
        name = f"cpu: {cpu_model() or 'unknown'} (dry run)"
    if min(contexts) <= max(trees):
        raise ValueError(f"every context (cache slots) must exceed every tree size: {contexts} vs {trees}")
    flush = flush_buffer(device)
    rows, skipped = [], []
    for B, C, T in coarse_first(batches, contexts, trees):
        if deadline is not None and time.perf_counter() > deadline:
            skipped.append(dict(batch=B, context=C, tree=T))
            continue
        try:
            row = measure_point(B, C, T, heads, device, dtype, reps, graphed, flush)
        except Exception as e:  # noqa: BLE001  (one point out of memory must not cost the rows measured)
            row = dict(batch=B, context=C, tree=T, error=f"{type(e).__name__}: {str(e)[:300]}")
        rows.append(row)
        if on_row is not None:
            on_row(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    best = {(r["batch"], r["context"], r["tree"]): r["best"] for r in rows if r.get("best")}
    if not best:
        raise RuntimeError("no grid point was measured: " + "; ".join(r.get("error", "skipped") for r in rows[:3]))
    mode = "eager calls" if not graphed else "CUDA-graph replays" if device.type == "cuda" else "direct calls (dry run)"
    table = BackendTable(name, best, source=f"measured: {mode}, {str(dtype).replace('torch.', '')}, heads {heads}")
    return dict(table=table.to_dict(), results=rows, skipped=skipped, graphed=graphed,
                l2_flush_bytes=flush.numel() * 4)


def save(path: Path, doc: dict, settings: dict) -> Path:
    """Write the table's JSON: the GPU's name, versions, settings, the table and every row."""
    from .benchinfo import versions

    try:
        import triton
        vers = dict(versions(), triton=triton.__version__)
    except ImportError:
        vers = versions()
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = dict(benchmark="backend_table", device=doc["table"]["device"], versions=vers, settings=settings,
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **doc)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def keep(doc: dict) -> Path:
    """Write ``doc``'s table where the graph runner on this GPU reads it (``attention.table.table_path``)."""
    from ..attention.table import table_path

    path = table_path(doc["table"]["device"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc["table"], indent=2) + "\n")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minispec.lab.backend_table", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: every code path, no GPU timing")
    ap.add_argument("--save", action="store_true", help="also keep the table where the graph runner reads it "
                    "(attention.table.table_path; not with --dry-run: a CPU's table is never read)")
    ap.add_argument("--eager", action="store_true", help="time eager calls instead of CUDA-graph replays")
    ap.add_argument("--budget-s", type=float, default=None, help="stop starting new grid points after this long")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per backend (default GPU 10, dry run 1)")
    ap.add_argument("--batch", type=int, nargs="+", help="batch sizes (default GPU 1 4 16 32)")
    ap.add_argument("--context", type=int, nargs="+", help="cache slots per row (default GPU 1024 .. 32768)")
    ap.add_argument("--tree", type=int, nargs="+", help="new tokens per row (default GPU 1 8 32 64)")
    args = ap.parse_args(argv)
    if args.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        # the CPU runs the kernel in Triton's interpreter, which must be on before triton is first imported (importing
        # minispec already did): start again with it on
        os.execve(sys.executable, [sys.executable, "-m", "minispec.lab.backend_table",
                                   *(sys.argv[1:] if argv is None else argv)], dict(os.environ, TRITON_INTERPRET="1"))
    if args.dry_run and args.save:
        print("error: --save keeps a GPU's table for the graph runner; a dry run's is never read", file=sys.stderr)
        return 2
    if not args.dry_run and not torch.cuda.is_available():
        print("error: no CUDA GPU here; --dry-run runs the same code paths on the CPU with tiny shapes",
              file=sys.stderr)
        return 2
    axes, heads = (DRY_AXES, DRY_HEADS) if args.dry_run else (GPU_AXES, GPU_HEADS)
    device, dtype = (torch.device("cpu"), torch.float32) if args.dry_run else (torch.device("cuda"), torch.bfloat16)
    batches, contexts, trees = args.batch or axes["batch"], args.context or axes["context"], args.tree or axes["tree"]
    reps = args.reps or (1 if args.dry_run else 10)
    deadline = time.perf_counter() + args.budget_s if args.budget_s else None

    def show(r):
        if "error" in r:
            print(f"B={r['batch']:>2} C={r['context']:>6} T={r['tree']:>2}  error: {r['error'][:100]}", flush=True)
            return
        times = "  ".join(f"{n} {t * 1e6:8.1f} us" for n, t in r["median_s"].items())
        print(f"B={r['batch']:>2} C={r['context']:>6} T={r['tree']:>2}  {times}  -> {r['best']}", flush=True)

    doc = measure_table(device, dtype, batches, contexts, trees, heads, reps, not args.eager, deadline, show)
    settings = dict(batch=list(batches), context=list(contexts), tree=list(trees), heads=list(heads), reps=reps,
                    dtype=str(dtype), dry_run=args.dry_run, budget_s=args.budget_s,
                    timing=("CUDA-graph replays" if not args.eager else "eager calls") + ", median, interleaved, "
                    + ("CUDA events, cold L2" if device.type == "cuda" else "time.perf_counter (dry run)"))
    path = save(args.out, doc, settings)
    print(f"saved {path} ({len(doc['table']['best'])} points measured, {len(doc['skipped'])} skipped)")
    if args.save:
        print(f"the graph runner reads it from {keep(doc)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
