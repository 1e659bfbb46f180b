#!/usr/bin/env python3
"""SmolLM2 forward with the row-invariant attention of this checkout against that of another revision.

One process, one model, one KV cache after a prefill: each round runs a one-row step and tree
verify steps (binary trees of 8 and 32 nodes) with this checkout's ``invariant_attention`` and
with the one of ``--before`` (read with ``git show`` and imported as a module), interleaved in an
order that alternates from round to round, so a
slow period of the machine hits both alike. Reports medians (the first round is dropped as warm-up),
their ratio, and the median of the rounds' own ratios (paired: each round's after / before, the steps a
moment apart, which a noisy machine moves less), with the device. ``--prefix`` sets the keys in the
cache: e.g. 1029, where a one-row step sees 1030 keys and the last block of 128 holds 6 (the short
last block that 3fe632f..b1c25a6 stopped copying the cache for).

    python benchmarks/invariant_attention_ab.py --before ee3b993 --threads 2   # the attention before 17de9ec
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def load_revision(rev: str):
    """The row-invariant attention of git revision ``rev`` (``minispec/exact/attention.py``, or
    ``minispec/attention/invariant.py`` before the exact backend became a package), imported as a module of the
    package it lived in (a revision from before the move finds its ``minispec.invariance`` in ``minispec.exact.recipes``)."""
    for file, name in (("minispec/exact/attention.py", "minispec.exact._attention_before"),
                       ("minispec/attention/invariant.py", "minispec.attention._invariant_before")):
        r = subprocess.run(["git", "show", f"{rev}:{file}"], cwd=ROOT, capture_output=True, text=True)
        if r.returncode == 0:
            break
    else:
        raise SystemExit(f"{rev} has no row-invariant attention")
    import minispec.exact.recipes

    sys.modules.setdefault("minispec.invariance", minispec.exact.recipes)
    path = Path(tempfile.mkdtemp()) / "invariant_before.py"
    path.write_text(r.stdout)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def binary_tree_mask(T: int) -> torch.Tensor:
    from minispec.tree import Tree

    return Tree([0] * T, [-1] + [(i - 1) // 2 for i in range(1, T)]).mask()[1:, 1:]  # [T, T]


def main() -> None:
    from minispec.args import thread_count

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="git revision whose invariant attention is the baseline")
    ap.add_argument("--prefix", type=int, default=300, help="tokens in the KV cache before the steps")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=thread_count, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from minispec import models
    from minispec.exact import attention as after
    from minispec.kv import KVCache
    from minispec.lab.benchinfo import device_info

    old, own = load_revision(args.before), after.invariant_attention

    def before(q, k, v, mask=None, padding=None):  # the old module works its mask out itself: hand it the raw mask
        return old.invariant_attention(q, k, v, getattr(mask, "mask", mask), padding)
    model = models.load("smollm2-135m")[0]
    g = torch.Generator().manual_seed(0)
    kv = KVCache.for_model(model, 2048)
    times: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode():
        model(torch.randint(0, model.cfg.vocab_size, (1, args.prefix), generator=g), kv=kv)
        kv.commit(list(range(args.prefix)))
        for r in range(args.rounds):
            order = (("before", before), ("after", own))
            for name, fn in order if r % 2 else order[::-1]:  # alternating: neither goes first every round
                after.invariant_attention = fn  # what the "exact" backend calls
                for T in (1, 8, 32):
                    tokens = torch.randint(0, model.cfg.vocab_size, (1, T), generator=g)
                    t0 = time.perf_counter()
                    model(tokens, kv=kv, mask=binary_tree_mask(T) if T > 1 else None)
                    times.setdefault((name, T), []).append(time.perf_counter() - t0)
                    kv.discard()
    after.invariant_attention = own
    dev = device_info()
    print(f"{dev.get('gpu') or dev.get('cpu_model') or dev['cpu']}, {args.threads} threads, SmolLM2-135M after {args.prefix} tokens, "
          f"medians of {args.rounds - 1} interleaved rounds")
    for T in (1, 8, 32):
        b, a = (statistics.median(times[(n, T)][1:]) for n in ("before", "after"))
        paired = statistics.median(x / y for x, y in zip(times[("after", T)][1:], times[("before", T)][1:]))
        what = "one row" if T == 1 else f"{T}-node binary tree"
        print(f"{what:<22} {args.before}: {b * 1e3:6.1f} ms   this checkout: {a * 1e3:6.1f} ms   ratio {a / b:.3f}"
              f"   paired {paired:.3f}")


if __name__ == "__main__":
    main()
