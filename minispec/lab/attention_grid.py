"""The chapter-6 attention grid: one tree-verify attention call, timed per backend and shape.

Backends (the same tensors for each): ``dense`` (one SDPA call with the full boolean mask, the
reference), ``flash`` (SDPA's fused kernels with the grouped-query heads stacked as rows, no K / V
copy: ``attention.table.fused_attention``), ``split_torch`` and ``split_triton`` (mask-free prefix
+ masked tree suffix, merged by log-sum-exp; ``minispec.attention``; the Triton one a single
launch into a reused workspace and output buffer), ``flex`` (FlexAttention with a block mask) and
``causal`` (SDPA's lower-right causal mask: the cost of attention without any tree, a floor).

Per shape: the median time per call; the achieved bandwidth of the KV read (2 * B * Hkv * (ctx +
T) * hd * bytes / time, K and V each read once); its share of a copy bandwidth measured in the
same run; every ratio between methods; the SDPA kernel the dense and causal calls land on
(``sdpa_backend``: flash / efficient / math on CUDA). Each timing is one CUDA event pair around
``calls`` back-to-back calls (per-call time reported), so that a small shape measures the GPU's
work rather than one launch's latency; before it, outside the timed region, a buffer twice the
L2 cache is overwritten (``timed``'s ``flush``), and the calls read distinct input copies, so
every call reads its KV from HBM (cold L2) even where all the copies together fit in L2 (B = 1,
ctx 512: 16 copies are ~35 MB against the H100's 50 MB). With ``graphed=True`` the ``calls`` calls
of each method are captured once in a CUDA graph (``capture_calls``) and each timing replays it:
the GPU's time without the host's launch overhead, what a decode step under graphs pays
(methods that cannot be captured are listed under ``failed``). Repetitions are interleaved across
methods so that a slow period of the machine hits all of them alike. A shape that fails (e.g.
out of memory) is recorded as a row with its ``error``; the grid goes on with the next shape.

On a CPU the same functions run (the flush is a plain tensor write, timing uses
``time.perf_counter``, a "graph" is the calls themselves); what only a GPU shows is the capture
and the timings themselves.

``benchmarks/bench_attention.py`` (a command line) and ``python -m minispec gpu-suite`` both run
``run_grid``. With a ``deadline`` it stops adding shapes when time runs out and lists the rest.

References: Dao et al., "FlashAttention" (2022); Dao et al., "Flash-Decoding" (2023); Dong et
al., "Flex Attention: A Programming Model for Generating Optimized Attention Kernels" (2024).

Shapes: B batch, H query heads, Hkv KV heads, hd head dim, P = ctx prefix tokens, T tree tokens,
S = P + T keys.
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
import time
import warnings

import torch

from ..attention import dense_attention, dense_backend, sdpa_backend, split_attention, triton_available
from ..attention.table import fused_attention
from ..tree import Tree

L2_BYTES = 50 * 2**20  # H100 / H200: 50 MiB (used when torch does not report the L2 size)
CALLS = 8  # back-to-back calls per timing on a GPU (at most the number of input copies)


def l2_bytes(device: torch.device) -> int:
    """The GPU's L2 cache size as torch reports it, else ``L2_BYTES``."""
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or L2_BYTES)
    return L2_BYTES


def tree_mask(T: int, B: int, g: torch.Generator) -> torch.Tensor:
    """[B, T, T] ancestor masks of random trees (each node: itself and its ancestors)."""
    def one() -> torch.Tensor:  # row 0 the root; node i's parent drawn from 0..i-1 (Tree counts nodes after the root)
        return Tree([0] * (T - 1), [int(torch.randint(0, i, (1,), generator=g)) - 1 for i in range(1, T)]).mask()

    return torch.stack([one() for _ in range(B)])


def flush_buffer(device: torch.device) -> torch.Tensor:
    """A buffer whose overwrite evicts the L2 cache: twice its size on a GPU; 1 MiB on a CPU (the same
    code path; CPU caches are not what the grid measures)."""
    nbytes = 2 * l2_bytes(device) if device.type == "cuda" else 1 << 20
    return torch.empty(nbytes // 4, dtype=torch.float32, device=device)


def timed(fn, device: torch.device, calls: int = 1, flush: torch.Tensor | None = None) -> float:
    """Seconds per call of ``fn`` over ``calls`` back-to-back calls.

    Args:
        fn: the work (no arguments); called ``calls`` times.
        device: CUDA: one event pair around all the calls (GPU time, launches overlapped);
            else ``time.perf_counter``.
        calls: back-to-back calls in the timed region.
        flush: a buffer larger than the L2 cache, overwritten before the timed region (so the
            first call finds nothing of its inputs in L2), or None.
    Returns:
        the elapsed time divided by ``calls``.
    """
    if flush is not None:
        flush.fill_(1.0)  # a write, not a read: evicts the L2's lines; queued before the start event
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def capture_calls(calls: list, device: torch.device):
    """One CUDA graph of ``calls`` (functions of no argument) run back to back, returned as its replay.

    The calls run twice first on a side stream (compilation, autotuning, allocator), then are
    captured in thread-local mode (another thread's CUDA work does not break the capture). On a
    CPU the returned function makes the calls themselves: the same code path, whose only
    GPU-specific parts are the capture and the launch time a replay saves.
    """
    if device.type != "cuda":
        return lambda: [call() for call in calls]
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            for call in calls:
                call()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for call in calls:
            call()
    return graph.replay  # the bound method keeps the graph (and its memory pool) alive


def copy_bandwidth(device: torch.device, nbytes: int | None = None, reps: int = 12) -> float:
    """GB/s of a large device copy (bytes read + bytes written over time), median after 2 warm-ups.

    Args:
        nbytes: size of the copied tensor (default 1 GiB on a GPU, 256 MiB on a CPU).
    """
    n = (nbytes or (1 << 30 if device.type == "cuda" else 1 << 28)) // 4
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    times = [timed(lambda: dst.copy_(src), device) for _ in range(reps)][2:]
    return 2 * n * 4 / statistics.median(times) / 1e9


def make_flex(device: torch.device):
    """((flex_attention callable, create_block_mask), note) or (None, reason)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:
        return None, f"FlexAttention unavailable: {e}"
    if device.type == "cuda":
        import torch._dynamo.config as dynamo_config

        # one compilation per shape (dynamic=False): lift the recompile limit (default 8), past which
        # torch.compile silently runs the function eagerly, i.e. unfused, and the grid would time that
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), 1024))
        return (torch.compile(flex_attention, dynamic=False), create_block_mask), None
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    return (flex_attention, create_block_mask), "FlexAttention on CPU runs eagerly (unfused reference path)"


def lower_right_causal(T: int, S: int):
    try:
        from torch.nn.attention.bias import causal_lower_right
        return causal_lower_right(T, S)
    except ImportError:
        return torch.ones(T, S, dtype=torch.bool).tril(S - T)


def random_inputs(B, H, Hkv, hd, S, T, copies, device, dtype, g):
    """``copies`` tuples (q [B, H, T, hd], k [B, Hkv, S, hd], v [B, Hkv, S, hd]).

    On a GPU drawn there (a CPU draw of several GB would take longer than the timing); on a CPU
    from ``g``, as the CPU results in benchmarks/results were made."""
    shapes = ((B, H, T, hd), (B, Hkv, S, hd), (B, Hkv, S, hd))
    if device.type == "cuda":
        gd = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
        return [tuple(torch.randn(*s, generator=gd, device=device, dtype=dtype) for s in shapes) for _ in range(copies)]
    return [tuple(torch.randn(*s, generator=g).to(device, dtype) for s in shapes) for _ in range(copies)]


def run_shape(B, H, Hkv, hd, P, T, device, dtype, reps, methods_ok, flex, max_gb, notes, flush=None, graphed=False):
    """Time every available method on one shape; returns the shape's result row (see module doc).

    A method that fails in its warm-up (or, graphed, its capture) is dropped from the row and its
    error kept in ``failed``; an error while timing propagates (``run_grid`` records it as the
    shape's error)."""
    S = P + T
    g = torch.Generator().manual_seed(P * 131 + T * 7 + B)
    kv_bytes = 2 * B * Hkv * S * hd * torch.finfo(dtype).bits // 8
    copies = max(1, min(16, math.ceil(2 * l2_bytes(device) / kv_bytes))) if device.type == "cuda" else 1
    mask = tree_mask(T, B, g).to(device)  # [B, T, T]
    full = torch.cat([torch.ones(B, T, P, dtype=torch.bool, device=device), mask], -1)[:, None]  # [B, 1, T, S]
    inputs = random_inputs(B, H, Hkv, hd, S, T, copies, device, dtype, g)
    fns = _methods(B, H, Hkv, P, T, S, mask, full, device, methods_ok, flex, max_gb, notes)
    err, failed = _warm_up(fns, inputs[0], notes, f"B={B} ctx={P} T={T}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    calls = min(copies, CALLS) if device.type == "cuda" else 1
    if graphed:
        runs = _captured(fns, inputs, calls, device, failed, notes, f"B={B} ctx={P} T={T}")
    else:
        nxt = itertools.cycle(range(copies))  # the calls of one timing read distinct copies
        runs = {name: (lambda fn=fn: fn(*inputs[next(nxt)])) for name, fn in fns.items()}
    times = {name: [] for name in runs}
    for _ in range(reps):
        for name, run in runs.items():  # interleaved: every method sees the same machine state
            times[name].append(timed(run, device, 1 if graphed else calls, flush) / (calls if graphed else 1))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    q, k, _ = inputs[0]
    backend = dict(dense=dense_backend(q, k, full), causal=sdpa_backend(q, k, None, is_causal=T == S))
    return dict(batch=B, ctx=P, tree=T, heads=H, kv_heads=Hkv, head_dim=hd, dtype=str(dtype).replace("torch.", ""),
                kv_bytes=kv_bytes, input_copies=copies, calls_per_timing=calls, graphed=graphed, reps=reps,
                median_s=med,
                kv_GBps={n: kv_bytes / t / 1e9 for n, t in med.items()},
                ratio={n: {m: med[n] / med[m] for m in med if m != n} for n in med},
                max_abs_err_vs_dense=err, sdpa_backend=backend, failed=failed)


def _captured(fns: dict, inputs, calls: int, device, failed: dict, notes, where: str) -> dict:
    """{name: the replay of one graph of ``calls`` calls of the method on distinct input copies}; a method whose
    capture fails is dropped from ``fns`` and its error kept in ``failed``."""
    runs = {}
    for name, fn in list(fns.items()):
        try:
            runs[name] = capture_calls([functools.partial(fn, *inputs[i % len(inputs)]) for i in range(calls)], device)
        except Exception as e:  # noqa: BLE001  (a method that cannot be captured: time the others)
            failed[name] = f"capture: {type(e).__name__}: {str(e)[:150]}"
            notes.add(f"{name} failed at {where}: {failed[name]}")
            del fns[name]
    return runs


def _methods(B, H, Hkv, P, T, S, mask, full, device, methods_ok, flex, max_gb, notes) -> dict:
    """{name: (q, k, v) -> output} of the methods this shape can run, "dense" first (the reference)."""
    causal = lower_right_causal(T, S)
    fns = {"dense": lambda q, k, v: dense_attention(q, k, v, full),
           "flash": lambda q, k, v: fused_attention(q, k, v, full),
           "causal": lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
               q, k, v, attn_mask=causal, enable_gqa=H != Hkv)}
    score_gb = B * H * T * P * 4 * 3 / 1e9  # fp32 scores, probabilities, a temporary
    if score_gb <= max_gb:
        fns["split_torch"] = lambda q, k, v: split_attention(q, k, v, P, mask)
    else:
        notes.add(f"split_torch skipped where its fp32 score matrices exceed {max_gb} GB (--max-gb)")
    if methods_ok["split_triton"]:
        from ..attention.triton_split import SplitWorkspace, split_attention_triton
        ws = SplitWorkspace()  # allocated on the warm-up, reused by every timed call (as a decode step's layers)
        fns["split_triton"] = lambda q, k, v: split_attention_triton(q, k, v, P, mask, out=ws.output(q), workspace=ws)
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
    return fns


def _warm_up(fns: dict, inputs, notes, where: str) -> tuple[dict, dict]:
    """Run each method twice (compilation, autotuning, allocator); a method that fails is dropped
    from ``fns``. Returns ({name: max abs error vs dense}, {name: why it failed})."""
    ref = out = None
    err, failed = {}, {}
    for name, fn in list(fns.items()):  # "dense" first: the reference of the others
        try:
            for _ in range(2):
                out = fn(*inputs)
            if name == "dense":
                ref = out.float()
            elif name != "causal" and ref is not None:
                err[name] = (out.float() - ref).abs().max().item()
        except Exception as e:  # noqa: BLE001  (e.g. out of memory in one method: time the others)
            failed[name] = f"{type(e).__name__}: {str(e)[:160]}"
            notes.add(f"{name} failed at {where}: {failed[name]}")
            del fns[name]
    return err, failed  # the warm-up outputs are freed on return, before timing


def coarse_first(*axes):
    """Grid points (tuples over ``axes``) ordered corners first, then points with one interior
    coordinate, and so on: cut short by a deadline, the points measured still span the grid."""
    def interior(point):
        return sum(x not in (min(ax), max(ax)) for x, ax in zip(point, axes))
    return sorted(itertools.product(*axes), key=interior)  # stable: ties keep product order


def run_grid(device, dtype, batches, ctxs, trees, heads=(32, 8, 128), reps=30, max_gb=12.0, deadline=None,
             on_row=None, bandwidth=None, graphed=False) -> dict:
    """The attention grid over batch x ctx x tree.

    Args:
        device, dtype: where and in which precision to run.
        batches, ctxs, trees: the grid's axes (B, P, T).
        heads: (H, Hkv, hd); the default is Llama-3-8B's (32 query heads, 8 KV heads, head dim 128).
        reps: timed repetitions per method and shape.
        max_gb: skip split_torch where its fp32 score matrices would exceed this.
        deadline: ``time.perf_counter()`` value after which no new shape starts (None: no limit).
        on_row: called with each result row as it is measured (printing); not with failed shapes.
        bandwidth: a copy bandwidth (GB/s) measured earlier in the same run; measured here if None.
        graphed: time replays of CUDA graphs of the calls (module docstring) instead of eager calls.
    Returns:
        dict(copy_bandwidth_GBps, notes, results=[rows], skipped=[{batch, ctx, tree}], order,
        l2_flush_bytes, graphed). A shape that raised (out of memory, say) is a row {batch, ctx, tree, ...,
        error}; the rows measured before and after it are kept.
    """
    device = torch.device(device)
    H, Hkv, hd = heads
    notes = set()
    methods_ok = {"split_triton": triton_available(device)}
    if not methods_ok["split_triton"]:
        notes.add("split_triton skipped: " + ("run with TRITON_INTERPRET=1 (bench_attention: --interpret) to use "
                                               "Triton's interpreter on CPU" if device.type != "cuda"
                                               else "triton is not available"))
    elif device.type != "cuda":
        notes.add("split_triton ran in Triton's interpreter (numpy on CPU): its times say nothing about GPU speed")
    flex, why = make_flex(device)
    if why:
        notes.add(why)
    bw = bandwidth if bandwidth is not None else copy_bandwidth(device)
    flush = flush_buffer(device)
    rows, skipped = [], []
    order = "coarse-first" if deadline is not None else "batch, ctx, tree"
    points = coarse_first(batches, ctxs, trees) if deadline is not None else itertools.product(batches, ctxs, trees)
    for B, P, T in points:
        if deadline is not None and time.perf_counter() > deadline:
            skipped.append(dict(batch=B, ctx=P, tree=T))
            continue
        try:
            r = run_shape(B, H, Hkv, hd, P, T, device, dtype, reps, methods_ok, flex, max_gb, notes, flush, graphed)
        except Exception as e:  # noqa: BLE001  (one shape out of memory must not cost the rows measured)
            r = dict(batch=B, ctx=P, tree=T, heads=H, kv_heads=Hkv, head_dim=hd,
                     dtype=str(dtype).replace("torch.", ""), error=f"{type(e).__name__}: {str(e)[:300]}")
        if "error" not in r:
            r["copy_share"] = {n: g / bw for n, g in r["kv_GBps"].items()}
            if on_row is not None:
                on_row(r)
        rows.append(r)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the next shape's inputs may be several GB (and after an OOM)
    if skipped:
        notes.add(f"{len(skipped)} shapes skipped: the time budget ran out (listed in 'skipped')")
    if failed := sum("error" in r for r in rows):
        notes.add(f"{failed} shapes failed: their rows hold the 'error'")
    return dict(copy_bandwidth_GBps=bw, notes=sorted(notes), results=rows, skipped=skipped, order=order,
                l2_flush_bytes=flush.numel() * 4, graphed=graphed)
