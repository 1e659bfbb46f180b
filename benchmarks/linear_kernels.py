"""The linear-layer kernels of a decode step side by side: time per forward's worth of products, and
whether a row's bits depend on the row count.

For every linear layer of a model (SmolLM2: 121 products per forward), in the order a
forward runs them so the weights stream from memory as they do when decoding, each candidate is
timed at several row counts M, the candidates interleaved round by round in one process:

    panels     minispec's path: the weight as contiguous [in, 32] panels, one torch.bmm
    f_linear   F.linear (the BLAS picks its kernel from M)
    onednn     oneDNN's prepacked weights (torch.ops.mkldnn._linear_pointwise), where available
    numpy      with ``--numpy``: NumPy's own BLAS (OpenBLAS in NumPy's wheels) at the same thread count
               (``threadpoolctl``), a reference only: at one row it is a matrix-vector kernel, which on
               some CPUs reads the weights faster than the others, but its rows change bits with M (see
               the probe), so minispec cannot verify with it what it decodes with it

(each candidate runs a few untimed passes before its timed ones in every round, so its own weight
copy is as warm in the caches as when decoding uses it alone), and each kind of weight is probed for the row counts at which its rows change
(``minispec.exact.recipes.varying_rows``). Not part of CI: timings are machine-dependent.

    python benchmarks/linear_kernels.py --threads 2 --json benchmarks/results/linear_kernels_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F


NUMPY_IDLE_S = 0.5  # seconds after NumPy's passes before the next candidate runs


def kernels(layers, numpy: bool = False) -> dict:
    """{name: product(layer, x)} for the candidates this PyTorch build has (and NumPy's BLAS with ``numpy``)."""
    out = {"panels": lambda layer, x: layer._product("panels", x),
           "f_linear": lambda layer, x: F.linear(x, layer.weight)}
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        packed = {id(layer): torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach().contiguous(), None)
                  for layer in layers}
        out["onednn"] = lambda layer, x: torch.ops.mkldnn._linear_pointwise(x, packed[id(layer)], layer.bias, "none",
                                                                            [], "")
    if numpy:
        w_np = {id(layer): layer.weight.detach().numpy() for layer in layers}  # the same memory, [out, in]
        out["numpy"] = lambda layer, x: torch.from_numpy(x.numpy() @ w_np[id(layer)].T)  # bias-free layers only
    return out


def numpy_blas(threads: int):
    """NumPy's BLAS held to ``threads`` threads for the run (a context manager) and its name, e.g. 'openblas
    (Haswell)'; raises SystemExit naming the missing package without threadpoolctl."""
    try:
        from threadpoolctl import threadpool_info, threadpool_limits
    except ImportError:
        raise SystemExit("--numpy needs threadpoolctl to hold NumPy's BLAS to --threads: pip install threadpoolctl")
    info = [i for i in threadpool_info() if i["user_api"] == "blas" and "numpy" in i["filepath"].lower()] \
        or [i for i in threadpool_info() if i["user_api"] == "blas"]
    name = f"{info[0]['internal_api']} ({info[0].get('architecture')})" if info else "unknown"
    return threadpool_limits(limits=threads, user_api="blas"), name


def main(argv=None) -> int:
    from minispec.args import thread_count

    from minispec.lab.benchinfo import save_json
    from minispec.exact.recipes import varying_rows
    from torch.nn import Linear
    from minispec.loading import load

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=thread_count, default=2)
    ap.add_argument("--rows", default="1,2,5,9,17", help="row counts M to time")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds (the median is reported)")
    ap.add_argument("--passes", type=int, default=3, help="untimed then timed passes per candidate and round")
    ap.add_argument("--numpy", action="store_true", help="NumPy's own BLAS as a reference (needs threadpoolctl)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = load(args.model)
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    if args.numpy and any(layer.bias is not None for layer in layers):
        raise SystemExit(f"--numpy times bias-free products only; {args.model} has biases")
    limits, blas = numpy_blas(args.threads) if args.numpy else (contextlib.nullcontext(), None)
    cands = kernels(layers, args.numpy)
    weight_mb = sum(layer.weight.numel() * layer.weight.element_size() for layer in layers) / 2**20
    print(f"{args.model}: {len(layers)} linear products per forward, {weight_mb:.0f} MiB of weights; "
          f"{args.threads} threads")
    if blas:
        print(f"numpy: NumPy's BLAS, {blas}, {args.threads} threads (a reference: its rows vary with M)")
    times: dict = {}
    with torch.inference_mode(), limits:
        for m in [int(r) for r in args.rows.split(",")]:
            xs = [torch.randn(m, layer.in_features) for layer in layers]
            samples = {name: [] for name in cands}
            for r in range(args.rounds + 1):  # one warm-up round
                for name, fn in cands.items():
                    for p in range(2 * args.passes):  # the first passes bring this candidate's weight copy into
                        t0 = time.perf_counter()      # the caches, as steady decoding with one copy would
                        for layer, x in zip(layers, xs):
                            fn(layer, x)
                        if r >= 1 and p >= args.passes:
                            samples[name].append(time.perf_counter() - t0)
                    if name == "numpy":  # OpenBLAS's threads spin for ~0.1-0.2 s after a call, which slows the
                        time.sleep(NUMPY_IDLE_S)  # next candidate's two threads ~3x: let them go to sleep first
            times[m] = {name: statistics.median(s) * 1e3 for name, s in samples.items()}
            print(f"M = {m:3d}: " + "  ".join(f"{name} {ms:6.2f} ms" for name, ms in times[m].items())
                  + f"  (panels {times[m]['f_linear'] / times[m]['panels']:.2f}x F.linear)")
        varies = {}
        for layer in layers:
            key = f"{layer.in_features}->{layer.out_features}"
            if key not in varies:
                varies[key] = {name: list(varying_rows(lambda x, fn=fn, layer=layer: fn(layer, x), layer.in_features))
                               for name, fn in cands.items()}
    print("row counts at which a row's bits change (among 1..17, 24, 32, 33, 48, 64, 65, 96, 127 vs 128 rows):")
    for key, v in varies.items():
        print(f"  {key:12s} " + "  ".join(f"{name}: {rows or 'none'}" for name, rows in v.items()))
    if args.json:
        print(f"saved {save_json(args.json, dict(benchmark='linear_kernels', model=args.model, threads=args.threads, rounds=args.rounds, numpy_blas=blas, ms_per_forward=times, varying_rows=varies))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
