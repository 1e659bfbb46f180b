"""Training throughput of the EAGLE-1/2 head: the CE over the full vocabulary against the CE over the
draft vocabulary (``train eagle --draft-vocab``), side by side in one process on the same batches.

The full-vocabulary CE runs the 576 x 49152 LM head forward and backward on a fraction of the
positions (0.125: the recipe the shipped heads were trained with); the draft-vocabulary CE runs
the 8192 rows the head drafts from, on the same fraction (``train eagle``'s default) or on every
position. Data: the first
part of ``python -m minispec.train.selfdistill`` (run it first), whose features were recorded while
the target decoded; the top-k the full-vocabulary loss reads is computed once from those features.

    python benchmarks/eagle_train_speed.py --steps 30 --threads 1 --json benchmarks/results/eagle_train_speed_cpu.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from minispec import load
from minispec.lab.benchinfo import device_info, versions
from minispec.drafters.eagle import EagleConfig, EagleHead
from minispec.drafters.vocab import load_counts, top_tokens
from minispec.args import thread_count
from minispec.train.eagle import selfdistill_data, train_step


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per variant (after 3 warm-up steps)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=thread_count, default=1)
    ap.add_argument("--max-len", type=int, default=320)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, _ = load("smollm2-135m")
    target.requires_grad_(False)
    seqs, feats = selfdistill_data(1, args.max_len, target)
    with torch.no_grad():  # the stored top-k the full-vocabulary loss reads
        for f in feats:
            top = torch.log_softmax(target.lm_head(f["hidden"].float()), -1).topk(32, dim=-1)
            f["top_idx"], f["top_logp"] = top.indices.int(), top.values.half()
    draft = target.lm_head.weight[top_tokens(load_counts(), 8192)].detach()
    variants = {"full vocabulary, CE on 1/8 of positions": dict(ce_frac=0.125, draft_head=None),
                "draft vocabulary (8192), CE on 1/8 of positions": dict(ce_frac=0.125, draft_head=draft),
                "draft vocabulary (8192), CE on every position": dict(ce_frac=1.0, draft_head=draft)}
    heads = {name: EagleHead(EagleConfig.for_target(target.cfg)) for name in variants}
    opts = {name: torch.optim.AdamW(h.parameters(), lr=1e-3) for name, h in heads.items()}
    times = {name: [] for name in variants}
    tokens = {name: 0 for name in variants}
    g = torch.Generator().manual_seed(0)
    for step in range(args.steps + 3):  # interleaved: every variant on the same batch, in turn
        idx = torch.randperm(len(seqs), generator=g)[:args.batch_size].tolist()
        for name, v in variants.items():
            t0 = time.perf_counter()
            train_step(heads[name], target, seqs, feats, idx, opts[name], 0.1, v["ce_frac"], 0.1,
                       torch.Generator().manual_seed(step), draft_head=v["draft_head"])
            if step >= 3:
                times[name].append(time.perf_counter() - t0)
                tokens[name] += sum(len(seqs[i].tokens) for i in idx)
    rows = {name: dict(step_s=sum(t) / len(t), tokens_per_s=tokens[name] / sum(t)) for name, t in times.items()}
    base = next(iter(rows.values()))["tokens_per_s"]
    for name, r in rows.items():
        r["vs_full"] = r["tokens_per_s"] / base
        print(f"{name:48s} {r['step_s'] * 1000:8.1f} ms/step  {r['tokens_per_s']:8.1f} tokens/s  {r['vs_full']:.2f}x")
    if args.json:
        out = dict(date=time.strftime("%Y-%m-%d %H:%M:%S"), device=device_info(), versions=versions(),
                   settings=vars(args), sequences=len(seqs), rows=rows)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print("saved", args.json)


if __name__ == "__main__":
    main()
