"""minispec vanilla decoding vs transformers ``generate``: greedy tokens/s side by side.

Both run in this one process on the same weights, the same prompt token ids (Spec-Bench
questions, chat template applied) and the same thread count, interleaved per prompt so
machine drift affects both alike. Prints a table and the ratio; saves JSON.

    python benchmarks/vanilla_vs_hf.py --prompts 8 --max-new-tokens 128 --threads 2 \
        --json benchmarks/results/vanilla_vs_hf_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minispec import generate, load, load_hf
from minispec.benchinfo import save_json
from minispec.prompts import spec_bench
from minispec.tokenizer import encode_prompt


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--questions", default=None, help="Spec-Bench JSONL (default: ../shared/data/spec_bench.jsonl)")
    ap.add_argument("--prompts", type=int, default=8, help="number of questions, spread over categories")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per prompt and method")
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    model, tok = load(args.model)
    hf, _ = load_hf(args.model)
    questions = spec_bench(args.questions, limit=args.prompts)
    n = args.max_new_tokens

    def run_minispec(ids):
        t = time.perf_counter()
        r = generate(model, tok, ids, max_new_tokens=n)
        return r.tokens, time.perf_counter() - t

    @torch.inference_mode()
    def run_hf(ids):
        x = torch.tensor([ids])
        t = time.perf_counter()
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False)
        return out[0, x.shape[1]:].tolist(), time.perf_counter() - t

    warm = encode_prompt(tok, "Hello!")  # warm-up: first calls allocate and pick kernels
    run_minispec(warm), run_hf(warm)

    rows = []
    print(f"{'#':>2} {'category':<16} {'prompt':>6} {'new':>4} {'HF tok/s':>9} {'minispec tok/s':>15} {'ratio':>6} same")
    for i, q in enumerate(questions):
        ids = encode_prompt(tok, q["prompt"])
        t_ms, t_hf = [], []
        for r in range(args.repeats):
            order = (run_minispec, run_hf) if (i + r) % 2 == 0 else (run_hf, run_minispec)  # alternate who goes first
            for fn in order:
                toks, dt = fn(ids)
                (t_ms if fn is run_minispec else t_hf).append(dt)
                if fn is run_minispec:
                    ms_toks = toks
                else:
                    hf_toks = toks
        row = dict(question_id=q["question_id"], category=q["category"], prompt_tokens=len(ids),
                   new_tokens_minispec=len(ms_toks), new_tokens_hf=len(hf_toks), identical=ms_toks == hf_toks,
                   minispec_tok_s=len(ms_toks) / statistics.median(t_ms), hf_tok_s=len(hf_toks) / statistics.median(t_hf))
        row["ratio"] = row["minispec_tok_s"] / row["hf_tok_s"]
        rows.append(row)
        print(f"{i:>2} {q['category']:<16} {len(ids):>6} {len(ms_toks):>4} {row['hf_tok_s']:>9.1f} "
              f"{row['minispec_tok_s']:>15.1f} {row['ratio']:>6.2f} {'yes' if row['identical'] else 'NO'}", flush=True)

    tot_ms = sum(r["new_tokens_minispec"] / r["minispec_tok_s"] for r in rows)
    tot_hf = sum(r["new_tokens_hf"] / r["hf_tok_s"] for r in rows)
    summary = dict(minispec_tok_s=sum(r["new_tokens_minispec"] for r in rows) / tot_ms,
                   hf_tok_s=sum(r["new_tokens_hf"] for r in rows) / tot_hf,
                   identical=sum(r["identical"] for r in rows), n=len(rows))
    summary["ratio"] = summary["minispec_tok_s"] / summary["hf_tok_s"]
    print(f"\noverall: minispec {summary['minispec_tok_s']:.1f} tok/s, HF generate {summary['hf_tok_s']:.1f} tok/s, "
          f"ratio {summary['ratio']:.2f}x; identical outputs {summary['identical']}/{summary['n']}")
    if args.json:
        p = save_json(args.json, dict(benchmark="vanilla_vs_hf", settings=vars(args), summary=summary, rows=rows))
        print(f"saved {p}")


if __name__ == "__main__":
    main()
