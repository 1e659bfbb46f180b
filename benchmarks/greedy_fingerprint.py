"""Greedy tokens of every method on minispec's own prompts, saved or compared: a refactor's "bit for bit" check.

    python benchmarks/greedy_fingerprint.py --out before.json            # save
    python benchmarks/greedy_fingerprint.py --compare before.json        # rerun and compare, exit 1 on any change

Every method decodes each of the first ``--prompts`` of minispec's own prompts greedily; the file holds the
token ids per method and prompt, the torch version and the CPU. A change in any token is reported by method
and prompt.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch

METHODS = ("vanilla", "pld", "sps", "eagle", "eagle2", "eagle3", "medusa", "copy")


def fingerprint(methods, n_prompts: int, max_new_tokens: int) -> dict:
    from minispec import generate, load
    from minispec.methods import Methods
    from minispec.prompts import own_prompts

    model, tok = load("smollm2-135m")
    table = Methods(model)
    prompts = [p["prompt"] for p in own_prompts()[:n_prompts]]
    out = {}
    for m in methods:
        drafter = None if m == "vanilla" else table.drafter(m)
        out[m] = [generate(model, tok, p, drafter=drafter, max_new_tokens=max_new_tokens).tokens for p in prompts]
        print(f"{m}: done", file=sys.stderr)
    return {"tokens": out, "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "max_new_tokens": max_new_tokens, "prompts": n_prompts}


def main(argv=None) -> int:
    from minispec.args import thread_count

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=thread_count, default=2)
    ap.add_argument("--out", help="save the fingerprint here")
    ap.add_argument("--compare", help="compare with this saved fingerprint (exit 1 on any difference)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    ref = json.load(open(a.compare)) if a.compare else None
    methods = a.methods.split(",") if ref is None else list(ref["tokens"])
    n = a.prompts if ref is None else ref["prompts"]
    mnt = a.max_new_tokens if ref is None else ref["max_new_tokens"]
    got = fingerprint(methods, n, mnt)
    if a.out:
        json.dump(got, open(a.out, "w"), indent=1)
    if ref is None:
        return 0
    bad = [(m, i) for m in methods for i in range(n) if got["tokens"][m][i] != ref["tokens"][m][i]]
    for m, i in bad:
        print(f"DIFFERS: {m} on prompt {i}")
    print(f"{len(methods) * n - len(bad)}/{len(methods) * n} generations identical to {a.compare}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
