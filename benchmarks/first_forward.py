"""Does a fresh process's first forward give the bits its later forwards give? Run in N fresh processes.

Each process loads the model, sets the thread count and computes the same two forwards three times each: one prompt
alone (``generate``'s prefill) and the first prefill forward of a batch decoder on the row cache over 24 prompts
(self-distillation's: a group of prompts of similar lengths). A row-invariant forward is a function of its input, so all three should be equal bit for bit; the script
reports, per process, how many of the rows of the first run differ from the second (the second and third are compared
too). Measured first on a 2-core AVX-512 Xeon at two threads (2026-11-29): in some processes the first forward's
attention computed differently for the rows one thread took, with no change in the code or input. Not part of CI: what
it finds depends on the machine and on chance.

    python benchmarks/first_forward.py --processes 8 --threads 2 --json benchmarks/results/first_forward_cpu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

PROMPTS = 24  # the batch decoder's prompts: its first prefill forward runs the first of their groups (``prefill_groups``)


def one_process(threads: int, offset: int) -> dict:
    """In this process: the two forwards, three times each; the rows of run 1 and run 3 that differ from run 2."""
    from minispec.batch import BatchDecoder, prefill_groups
    from minispec.loading import load
    from minispec.train import selfdistill as sd

    torch.set_num_threads(threads)
    model, tok = load(sd.TARGET)
    ids = sd.part_prompts(tok, sd.prompt_order()[offset:offset + 4 * PROMPTS], sd.parse_args([]))[:PROMPTS]

    group = prefill_groups([len(x) for x in ids])[0]

    def alone():
        return model(torch.tensor([max(ids[:3], key=len)])).hidden[0]  # [T, D]

    def batch():  # the first prefill forward of a batch decoder (what ``admit`` runs first)
        b = BatchDecoder(model, ids, None, max_new_tokens=8, kv="rows")
        b.row_of.update({s: s for s in range(len(ids))})
        b.waiting = []
        return b._forward({s: ids[s] for s in group}, last_logits_only=True).hidden  # [R, T, D]

    out = {}
    with torch.inference_mode():
        for name, fn in (("alone", alone), ("batch", batch)):
            runs = [fn().clone() for _ in range(3)]
            out[name] = {"first_vs_second_rows": int((runs[0] != runs[1]).any(-1).sum()),
                         "third_vs_second_rows": int((runs[2] != runs[1]).any(-1).sum()),
                         "rows": int(runs[0].shape[:-1].numel())}
    return out


def main(argv=None) -> int:
    from minispec.lab.benchinfo import save_json
    from minispec.args import at_least, thread_count

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=at_least(1), default=8)
    ap.add_argument("--threads", type=thread_count, default=2)
    ap.add_argument("--offset", type=at_least(0), default=40000, help="where in self-distillation's prompt order")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(one_process(args.threads, args.offset)))
        return 0
    found = []
    for i in range(args.processes):
        run = subprocess.run([sys.executable, __file__, "--child", "--threads", str(args.threads), "--offset",
                              str(args.offset)], capture_output=True, text=True, check=True)
        found.append(json.loads(run.stdout.strip().splitlines()[-1]))
        print(f"process {i}: " + ", ".join(f"{k} first run {v['first_vs_second_rows']}/{v['rows']} rows off, third "
                                          f"{v['third_vs_second_rows']}" for k, v in found[-1].items()), flush=True)
    summary = {k: {"processes_first_off": sum(f[k]["first_vs_second_rows"] > 0 for f in found),
                   "processes_third_off": sum(f[k]["third_vs_second_rows"] > 0 for f in found),
                   "processes": len(found)} for k in ("alone", "batch")}
    print("; ".join(f"{k}: the first forward differed in {s['processes_first_off']} of {s['processes']} processes, "
                    f"the third in {s['processes_third_off']}" for k, s in summary.items()))
    if args.json:
        print(f"saved {save_json(args.json, dict(benchmark='first_forward', settings=vars(args), runs=found, summary=summary))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
