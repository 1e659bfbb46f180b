"""How often EAGLE-1/2 heads' first draft is accepted when sampling, teacher-forced on held-out ShareGPT.

    python benchmarks/sampled_acceptance.py --heads old=/path/a.safetensors new=/path/b.safetensors \
        --temperatures 0,0.7,1 --json OUT.json

For every response position of the trainers' held-out set (the distill cache's first 32 examples, never
Spec-Bench), the head drafts from the target's true features as in ``train eagle``'s held-out acceptance,
over the draft vocabulary it drafts from at decode time (FR-Spec, ``minispec.methods.DRAFT_VOCAB["eagle"]``). At
temperature T > 0 speculative sampling accepts a draft x ~ q with probability min(1, p(x) / q(x)), so the
first draft is accepted with probability sum_x min(p(x), q(x)) = 1 - TV(p, q), p and q at temperature T; at
T = 0 it is whether q's argmax is p's. No sampling, so no sampling noise: a head change that helps greedy
decoding but hurts sampled decoding shows here in a minute, where a sampled Spec-Bench run differs by a few
percent from run to run.
"""
import argparse
import json
import sys
from types import SimpleNamespace

import torch

import minispec
from minispec.drafters.eagle import load_eagle
from minispec.drafters.vocab import load_counts, top_tokens
from minispec.lab.benchinfo import device_info, versions
from minispec.args import thread_count
from minispec.methods import DRAFT_VOCAB
from minispec.train.data import feature_data
from minispec.train.eagle import teacher_forced


@torch.inference_mode()
def first_draft_acceptance(head, target, seqs, feats, rows: torch.Tensor, temperatures: list[float]) -> dict:
    """{T: mean acceptance of the first draft over the held-out response positions} (see the module docstring)."""
    got = {t: 0.0 for t in temperatures}
    total = 0
    for i in range(len(seqs)):
        g, f_next, mask = teacher_forced(head, target, seqs, feats, i)  # [M, H], [M, H]
        zq = target.lm_head(g)[:, rows]  # [M, K] the head's logits over the draft vocabulary
        zp = target.lm_head(f_next)  # [M, V] the target's logits for the same tokens
        for t in temperatures:
            if t == 0:
                got[t] += float((rows[zq.argmax(-1)] == zp.argmax(-1)).sum())
            else:
                p, q = torch.softmax(zp / t, -1)[:, rows], torch.softmax(zq / t, -1)  # [M, K]
                got[t] += float(torch.minimum(p, q).sum())
        total += int(mask.sum())
    return {t: v / total for t, v in got.items()} | {"positions": total}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", nargs="+", required=True, help="NAME=PATH.safetensors (EAGLE-1/2 heads of SmolLM2-135M)")
    ap.add_argument("--temperatures", default="0,0.7,1", help="comma list; 0 is greedy")
    ap.add_argument("--draft-vocab", type=int, default=DRAFT_VOCAB["eagle"], help="draft over the K most frequent tokens")
    ap.add_argument("--threads", type=thread_count, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    temps = [float(t) for t in args.temperatures.split(",")]
    if any(t < 0 for t in temps):
        raise SystemExit(f"temperatures must be >= 0, got {args.temperatures}")
    torch.set_num_threads(args.threads)
    target, tok = minispec.load("smollm2-135m")
    data = feature_data(SimpleNamespace(heldout=32, extra_sharegpt=0, max_len=320, distill_prompts=0, topk=0), target, tok)
    rows = top_tokens(load_counts(), args.draft_vocab).to(target.device)  # [K]
    out = {}
    for spec in args.heads:
        name, path = spec.split("=", 1)
        head = load_eagle(path, target).head.float().eval()
        res = first_draft_acceptance(head, target, data.held, data.fheld, rows, temps)
        out[name] = dict(path=path, positions=res.pop("positions"), **{f"T={t:g}": a for t, a in res.items()})
        print(name, " ".join(f"{k} {v:.4f}" for k, v in out[name].items() if k.startswith("T=")), flush=True)
    if args.json:
        json.dump(dict(device=device_info(), versions=versions(), draft_vocab=args.draft_vocab,
                       heldout="the distill cache's first 32 examples (train eagle's held-out set)",
                       command="python benchmarks/sampled_acceptance.py " + " ".join(argv or sys.argv[1:]),
                       heads=out), open(args.json, "w"), indent=1)
        print("saved", args.json)


if __name__ == "__main__":
    main()
