"""ATen ops of a one-row SmolLM2 decode forward after a prefill, every op counted (nested ones and views included).

    python benchmarks/forward_ops.py --context 300 --forwards 3 --json out.json

torch.profiler records a few one-row forwards after a ``--context``-token prefill; the ops per forward are
reported by name (most frequent first) with their total, and the attention backend and linear kernel they ran on
(``MINISPEC_LINEAR_KERNEL=panels|onednn`` names one; by default this machine's saved choice; ``--plain``: the plain
model, ``load(..., exact=False)``: ``nn.Linear`` and the dense attention). A count, not a time: it
does not depend on the machine's load, only on the code path the forward takes (which depends on the kernel).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

import torch


@torch.inference_mode()
def count_ops(model, context: int = 300, forwards: int = 3) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from minispec.kv import KVCache

    kv = KVCache.for_model(model, context + 2)
    g = torch.Generator().manual_seed(0)
    model(torch.randint(0, model.cfg.vocab_size, (1, context), generator=g), kv=kv)
    kv.commit()
    x = torch.tensor([[1]])
    for _ in range(2):  # warm: prepacked weights, plans
        model(x, kv=kv)
        kv.discard()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(forwards):
            model(x, kv=kv)
            kv.discard()
    ops = Counter(e.name for e in prof.events() if e.name.startswith("aten::"))
    per = {k: v / forwards for k, v in ops.most_common()}
    return {"context": context, "forwards": forwards, "aten_ops_per_forward": sum(per.values()), "by_name": per}


def main(argv=None) -> int:
    from minispec.args import thread_count

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--forwards", type=int, default=3)
    ap.add_argument("--threads", type=thread_count, default=1)
    ap.add_argument("--plain", action="store_true", help="the plain model (exact=False), not the exact backend")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from minispec import load

    from minispec.lab.benchinfo import linear_kernel, save_json

    model, _ = load("smollm2-135m", exact=not a.plain)
    r = count_ops(model, a.context, a.forwards)
    r.update(threads=a.threads, attention=model.attention, linear_kernel="nn.Linear" if a.plain else linear_kernel())
    print(f"{r['aten_ops_per_forward']:.0f} ATen ops per one-row forward after {a.context} tokens "
          f"({a.threads} thread{'s' * (a.threads > 1)}, attention {r['attention']}, linear kernel {r['linear_kernel']})")
    for name, n in list(r["by_name"].items())[:20]:
        print(f"  {n:7.0f}  {name}")
    if a.json:
        save_json(a.json, r)  # with the date, the device and the versions
    return 0


if __name__ == "__main__":
    sys.exit(main())
