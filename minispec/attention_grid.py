"""The chapter-6 attention grid: one tree-verify attention call, timed per backend and shape.

Backends (the same tensors for each): ``dense`` (one SDPA call with the full boolean mask, the
reference), ``split_torch`` and ``split_triton`` (mask-free prefix + masked tree suffix, merged by
log-sum-exp; ``minispec.attention``), ``flex`` (FlexAttention with a block mask) and ``causal``
(SDPA's lower-right causal mask: the cost of attention without any tree, a floor).

Per shape: the median time; the achieved bandwidth of the KV read (2 * B * Hkv * (ctx + T) * hd *
bytes / time, K and V each read once); its share of a copy bandwidth measured in the same run; and
every ratio between methods. On a GPU the inputs rotate among copies whose total exceeds twice
the L2 cache, so each call reads its KV from HBM (cold L2), and repetitions are interleaved
across methods so that a slow period of the machine hits all of them alike.

``benchmarks/bench_attention.py`` (a command line) and ``python -m minispec gpu-suite`` both run
``run_grid``. With a ``deadline`` it stops adding shapes when time runs out and lists the rest.

References: Dao et al., "FlashAttention" (2022); Dao et al., "Flash-Decoding" (2023); Dong et
al., "Flex Attention: A Programming Model for Generating Optimized Attention Kernels" (2024).

Shapes: B batch, H query heads, Hkv KV heads, hd head dim, P = ctx prefix tokens, T tree tokens,
S = P + T keys.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
import warnings

import torch

from .attention import dense_attention, split_attention, triton_available

L2_BYTES = 50 * 2**20  # H100 / H200: 50 MiB (used when torch does not report the L2 size)


def l2_bytes(device: torch.device) -> int:
    """The GPU's L2 cache size as torch reports it, else ``L2_BYTES``."""
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or L2_BYTES)
    return L2_BYTES


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


def timed(fn, device: torch.device) -> float:
    """Seconds of one call of ``fn``: CUDA events on a GPU, ``time.perf_counter`` on a CPU."""
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


def _inputs(B, H, Hkv, hd, S, T, copies, device, dtype, g):
    """``copies`` tuples (q [B, H, T, hd], k [B, Hkv, S, hd], v [B, Hkv, S, hd]).

    On a GPU drawn there (a CPU draw of several GB would take longer than the timing); on a CPU
    from ``g``, as the CPU results in benchmarks/results were made."""
    shapes = ((B, H, T, hd), (B, Hkv, S, hd), (B, Hkv, S, hd))
    if device.type == "cuda":
        gd = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
        return [tuple(torch.randn(*s, generator=gd, device=device, dtype=dtype) for s in shapes) for _ in range(copies)]
    return [tuple(torch.randn(*s, generator=g).to(device, dtype) for s in shapes) for _ in range(copies)]


def run_shape(B, H, Hkv, hd, P, T, device, dtype, reps, methods_ok, flex, max_gb, notes):
    """Time every available method on one shape; returns the shape's result row (see module doc)."""
    S = P + T
    g = torch.Generator().manual_seed(P * 131 + T * 7 + B)
    kv_bytes = 2 * B * Hkv * S * hd * torch.finfo(dtype).bits // 8
    copies = max(1, min(16, math.ceil(2 * l2_bytes(device) / kv_bytes))) if device.type == "cuda" else 1
    mask = tree_mask(T, B, g).to(device)  # [B, T, T]
    full = torch.cat([torch.ones(B, T, P, dtype=torch.bool, device=device), mask], -1)[:, None]  # [B, 1, T, S]
    inputs = _inputs(B, H, Hkv, hd, S, T, copies, device, dtype, g)
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
        from .attention.triton_split import split_attention_triton
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


def coarse_first(*axes):
    """Grid points (tuples over ``axes``) ordered corners first, then points with one interior
    coordinate, and so on: cut short by a deadline, the points measured still span the grid."""
    def interior(point):
        return sum(x not in (min(ax), max(ax)) for x, ax in zip(point, axes))
    return sorted(itertools.product(*axes), key=interior)  # stable: ties keep product order


def run_grid(device, dtype, batches, ctxs, trees, heads=(32, 8, 128), reps=30, max_gb=12.0, deadline=None,
             on_row=None, bandwidth=None) -> dict:
    """The attention grid over batch x ctx x tree.

    Args:
        device, dtype: where and in which precision to run.
        batches, ctxs, trees: the grid's axes (B, P, T).
        heads: (H, Hkv, hd); the default is Llama-3-8B's (32 query heads, 8 KV heads, head dim 128).
        reps: timed repetitions per method and shape.
        max_gb: skip split_torch where its fp32 score matrices would exceed this.
        deadline: ``time.perf_counter()`` value after which no new shape starts (None: no limit).
        on_row: called with each result row as it is measured (printing).
        bandwidth: a copy bandwidth (GB/s) measured earlier in the same run; measured here if None.
    Returns:
        dict(copy_bandwidth_GBps, notes, results=[rows], skipped=[{batch, ctx, tree}], order).
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
    rows, skipped = [], []
    order = "coarse-first" if deadline is not None else "batch, ctx, tree"
    points = coarse_first(batches, ctxs, trees) if deadline is not None else itertools.product(batches, ctxs, trees)
    for B, P, T in points:
        if deadline is not None and time.perf_counter() > deadline:
            skipped.append(dict(batch=B, ctx=P, tree=T))
            continue
        r = run_shape(B, H, Hkv, hd, P, T, device, dtype, reps, methods_ok, flex, max_gb, notes)
        r["copy_share"] = {n: g / bw for n, g in r["kv_GBps"].items()}
        rows.append(r)
        if on_row is not None:
            on_row(r)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the next shape's inputs may be several GB
    if skipped:
        notes.add(f"{len(skipped)} shapes skipped: the time budget ran out (listed in 'skipped')")
    return dict(copy_bandwidth_GBps=bw, notes=sorted(notes), results=rows, skipped=skipped, order=order)
