"""Do the self-distilled parts hold the target's own greedy answers, as this machine computes them?

    python benchmarks/selfdistill_agreement.py --parts 0 9 104 --json OUT.json

For each part, one teacher-forced forward of SmolLM2-135M (minispec, float32, this machine) over every
sequence; at each answer position the target's argmax is compared with the token the part holds. A part
made on another device (a GPU's transformers ``generate``) from the same weights agrees everywhere except
at near-ties of the two devices' arithmetic, and a near-tie changes the rest of that answer only through
its own position: the forward here is teacher-forced, so each position is judged on its own. A part made
from other weights would disagree at a few percent of its positions. Reports the agreement per part, the
sequences whose every answer token agrees, and the smallest top-2 logit gap at the disagreements.
"""
import argparse
import json
import time

import torch

import minispec
from minispec.lab.benchinfo import device_info, versions
from minispec.args import thread_count
from minispec.train.selfdistill import ids_dir, part_path, read_ids


@torch.inference_mode()
def part_agreement(target, seqs: list[dict]) -> dict:
    """Positions where the target's argmax equals the held answer token, over one part's sequences."""
    agree = total = whole = 0
    gaps = []
    for s in seqs:
        toks, n = s["tokens"].long(), s["prompt_len"]
        logits = target(toks[None]).logits[0]  # [T, V]: position t predicts token t + 1
        pred = logits[n - 1:-1].argmax(-1)  # [answer]
        held = toks[n:]
        ok = pred == held
        agree, total, whole = agree + int(ok.sum()), total + len(held), whole + bool(ok.all())
        if not ok.all():
            top2 = logits[n - 1:-1][~ok].topk(2, -1).values  # [k, 2]
            gaps += (top2[:, 0] - top2[:, 1]).tolist()
    return dict(sequences=len(seqs), answer_tokens=total, agree=agree, rate=agree / max(total, 1),
                whole_sequences_agree=whole, max_gap_at_disagreement=max(gaps) if gaps else None)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", type=int, nargs="+", required=True)
    ap.add_argument("--threads", type=thread_count, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, _ = minispec.load("smollm2-135m")
    index = {p["part"]: p for p in json.loads((ids_dir() / "index.json").read_text())["parts"]}
    rows = []
    for i in args.parts:
        t0 = time.perf_counter()
        r = dict(part=i, generator=index[i].get("generator", "not recorded"), **part_agreement(target, read_ids(part_path(ids_dir(), i, "ids"))))
        r["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(r)
        print(f"part {i} ({r['generator']}): {r['agree']}/{r['answer_tokens']} answer tokens agree ({r['rate']:.4f}), "
              f"{r['whole_sequences_agree']}/{r['sequences']} sequences whole; largest top-2 gap at a "
              f"disagreement {r['max_gap_at_disagreement']}", flush=True)
    if args.json:
        out = dict(benchmark="selfdistill_agreement", device=device_info(), versions=versions(),
                   date=time.strftime("%Y-%m-%d %H:%M:%S"), parts=rows)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
