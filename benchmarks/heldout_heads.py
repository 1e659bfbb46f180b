"""EAGLE-1/2 heads side by side on the trainers' held-out set: teacher-forced acceptance and chain tau.

    python benchmarks/heldout_heads.py --heads shipped=minispec/checkpoints/smollm2-135m-eagle.safetensors \
        new=/path/b.safetensors --json OUT.json

What ``train eagle`` reports for the head it trains (``minispec.train.eagle.evaluate``), for any heads and on all of
the held-out set (the distill cache's first 32 examples, never Spec-Bench) rather than the few sequences a training run
walks: "acceptance", P(the head's argmax is the target's greedy token) with the target's true features, and
"tau_chain<depth>", the greedy chain tau of the head drafting on its own features along the target's greedy text.
No timing and no sampling: the figures are the same on every run of the same machine and heads.
"""
import argparse
import json
import sys
from types import SimpleNamespace

import torch

import minispec
from minispec.drafters.eagle import load_eagle
from minispec.lab.benchinfo import device_info, versions
from minispec.args import thread_count
from minispec.train.data import feature_data
from minispec.train.eagle import evaluate


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", nargs="+", required=True, help="NAME=PATH.safetensors (EAGLE-1/2 heads of SmolLM2-135M)")
    ap.add_argument("--depth", type=int, default=5, help="chain length of the tau walk")
    ap.add_argument("--threads", type=thread_count, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    heads = [h.split("=", 1) for h in args.heads]
    if any(len(h) != 2 for h in heads):
        raise SystemExit(f"--heads takes NAME=PATH pairs, got {args.heads}")
    torch.set_num_threads(args.threads)
    target, tok = minispec.load("smollm2-135m")
    data = feature_data(SimpleNamespace(heldout=32, extra_sharegpt=0, max_len=320, distill_prompts=0, topk=0), target, tok)
    out = {}
    for name, path in heads:
        head = load_eagle(path, target).head.float().eval()
        out[name] = dict(path=path, **evaluate(head, target, data.held, data.fheld, depth=args.depth))
        print(name, " ".join(f"{k} {v:.4f}" for k, v in out[name].items() if isinstance(v, float)), flush=True)
    if args.json:
        json.dump(dict(device=device_info(), versions=versions(), depth=args.depth, sequences=len(data.held),
                       heldout="the distill cache's first 32 examples (train eagle's held-out set)",
                       command="python benchmarks/heldout_heads.py " + " ".join(argv or sys.argv[1:]), heads=out),
                  open(args.json, "w"), indent=1)
        print("saved", args.json)


if __name__ == "__main__":
    main()
