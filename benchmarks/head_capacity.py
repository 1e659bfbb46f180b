"""Capacity where it pays: acceptance by position, draft cost per level and predicted CPU tokens/s of
several heads for SmolLM2-135M (1- or 2-layer EAGLE-1/2 heads, EAGLE-3 heads, in any mix).

A deeper head drafts better but costs more per level; what matters on the CPU is tokens/s, not tau.
For each head (``--heads NAME=PATH``, any checkpoint ``load_drafter`` reads):

  acceptance   greedy decoding with a chain of 5 (``minispec.train.measure.measure``: the trainers'
               own measurement) on the first ``--prompts`` held-out ShareGPT examples of the
               trainers (``minispec.train.data``; never Spec-Bench): alpha_d = P(draft d accepted |
               drafts 1..d-1 accepted), tau (new tokens / target forwards, prefill counted) and
               whether every output equals vanilla.
  draft cost   ``propose`` of a chain of k = 1..5 timed along the same held-out texts (the target's
               greedy answers), one committed token per step, so the first head step runs one new
               pair as after a step that accepted no draft; interleaved over positions, k and heads
               (drift of a shared machine hits all alike), median over ``--reps`` positions. "step"
               = t(1): one head step with its draft LM head; "per level" = (t(5) - t(1)) / 4.
  verify cost  ``minispec.lab.tune.verify_cost_curve``: one target forward of k + 1 tokens after
               ``--context`` cached tokens (fastest repetition, non-decreasing in k).
  prediction   tokens per step of a chain of k from the alphas, E_k = 1 + sum_{i<=k} prod_{j<=i}
               alpha_j, and ``dispatch.predicted_tokens_per_s(E_k, t_verify(k), t_draft(k))``, the
               dispatcher's cost model without the loop's own overhead (sampling, verification, KV
               compaction: alike for every head); vanilla is 1 / t_verify(0). The best k per head.

    python benchmarks/head_capacity.py --heads one=minispec/checkpoints/smollm2-135m-eagle.safetensors \\
        two=/path/two.safetensors e3=minispec/checkpoints/smollm2-135m-eagle3.safetensors \\
        --prompts 32 --threads 2 --json benchmarks/results/head_capacity_cpu.json

EAGLE-1/2 heads draft over ``--draft-vocab`` tokens (the 'eagle' method's 8192 by default, 0: all);
EAGLE-3 heads over their own draft vocabulary.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import minispec
from minispec.lab.benchinfo import save_json
from minispec.auto import predicted_tokens_per_s
from minispec.drafters.base import Features
from minispec.drafters.layouts import read_checkpoint
from minispec.drafters.loader import load_drafter
from minispec.drafters.defaults import TABLE
from minispec.lab.tune import verify_cost_curve
from minispec.args import thread_count
from minispec.sampling import GREEDY
from minispec.train.data import training_sequences
from minispec.train.measure import measure, measure_prompts

CHAIN = 5


def load_heads(heads: dict, target, draft_vocab: int) -> dict:
    """{name: {k: drafter drafting a chain of k}} for k = 1..CHAIN, and each head's kind and layer count."""
    out = {}
    for name, path in heads.items():
        kind = read_checkpoint(path)[3]
        vocab = (draft_vocab or None) if kind == "eagle" else None
        chains = {k: load_drafter(path, target, tree=f"chain:{k}", verbose=False, draft_vocab=vocab)
                  for k in range(1, CHAIN + 1)}
        head = chains[1].head
        layers = head.cfg.num_hidden_layers if kind == "eagle" else 1
        out[name] = dict(kind=kind, layers=layers, draft_vocab=vocab, chains=chains,
                         params=sum(p.numel() for p in head.parameters()))
    return out


@torch.inference_mode()
def draft_costs(target, loaded: dict, held, reps: int, per_example: int) -> dict:
    """{name: {k: median seconds of propose(chain of k)}} along the held-out texts (module docstring)."""
    drafters = [(name, k, h["chains"][k]) for k in range(1, CHAIN + 1) for name, h in loaded.items()]
    layers = tuple(sorted({i for _, _, d in drafters for i in d.target_layers}))
    times = {(name, k): [] for name, k, _ in drafters}
    done = 0
    for s in held:
        toks, P = s.tokens.tolist(), s.prompt_len
        o = target(s.tokens[None].to(target.device), hidden_layers=layers)
        feats = Features(o.hidden[0], {i: h[0] for i, h in o.layer_inputs.items()})  # row t: after toks[:t+1]
        for _, _, d in drafters:  # the prompt's pairs go through the head once, untimed
            d.prefill(toks[:P + 1], feats.rows(slice(0, P)))
            d.propose(GREEDY, budget=CHAIN)
        for t in range(P + 1, min(len(toks) - 1, P + 1 + per_example)):
            for name, k, d in drafters:  # interleaved: every head and chain length at this position
                d.commit(toks[t:t + 1], feats.rows(slice(t - 1, t)))
                t0 = time.perf_counter()
                d.propose(GREEDY, budget=k)
                times[name, k].append(time.perf_counter() - t0)
            done += 1
            if done == reps:
                return {name: {k: statistics.median(times[name, k]) for k in range(1, CHAIN + 1)} for name in loaded}
    raise ValueError(f"the held-out texts gave {done} positions, fewer than --reps {reps}")


def expected_tokens(alphas: list[float], k: int) -> float:
    """Tokens per decode step of a chain of k: 1 + sum_{i<=k} prod_{j<=i} alpha_j (alpha_j: acceptance of
    draft j given drafts 1..j-1 accepted; 0 where never tested)."""
    total, run = 1.0, 1.0
    for a in (alphas + [0.0] * k)[:k]:
        run *= a
        total += run
    return total


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--heads", nargs="+", required=True, help="NAME=PATH (any layout load_drafter reads)")
    ap.add_argument("--prompts", type=int, default=32, help="held-out ShareGPT examples (at most 32)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=40, help="positions timed per head and chain length (median)")
    ap.add_argument("--per-example", type=int, default=20, help="positions timed per held-out text")
    ap.add_argument("--context", type=int, default=256, help="cached tokens before the timed verify forward")
    ap.add_argument("--draft-vocab", type=int, default=TABLE["eagle"].draft_vocab,
                    help="EAGLE-1/2 heads' draft vocabulary (0: the full vocabulary)")
    ap.add_argument("--threads", type=thread_count, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    heads = dict(h.split("=", 1) for h in args.heads)
    torch.set_num_threads(args.threads)
    target, tok = minispec.load("smollm2-135m")
    _, held = training_sequences(tok, heldout=32, distill_prompts=0)
    held = held[:args.prompts]
    prompts, sizes = measure_prompts(tok, held, n_heldout=len(held), n_own=0)

    loaded = load_heads(heads, target, args.draft_vocab)
    t0 = time.perf_counter()
    acc = measure(target, tok, {n: (lambda d=h["chains"][CHAIN]: d) for n, h in loaded.items()}, prompts,
                  args.max_new_tokens)
    acc_s = time.perf_counter() - t0
    draft = draft_costs(target, loaded, held, args.reps, args.per_example)
    verify = verify_cost_curve(target, sizes=range(CHAIN + 1), context=args.context)[1]  # {k: s}, batch 1
    vanilla_tok_s = predicted_tokens_per_s(1.0, verify[0], 0.0)

    results = {}
    for name, h in loaded.items():
        a = acc[name]["acceptance_by_position"]
        chains = {}
        for k in range(1, CHAIN + 1):
            e = expected_tokens(a, k)
            chains[k] = dict(tokens_per_step=round(e, 3), draft_ms=round(draft[name][k] * 1e3, 3),
                             verify_ms=round(verify[k] * 1e3, 3),
                             predicted_tok_s=round(predicted_tokens_per_s(e, verify[k], draft[name][k]), 2))
        best = max(chains, key=lambda k: chains[k]["predicted_tok_s"])
        results[name] = dict(path=heads[name], kind=h["kind"], layers=h["layers"], params=h["params"],
                             draft_vocab=h["draft_vocab"], tau_chain5=acc[name]["tau"],
                             acceptance_by_position=a, equal_to_vanilla=acc[name]["equal_to_vanilla"],
                             step_ms=round(draft[name][1] * 1e3, 3),
                             per_level_ms=round((draft[name][CHAIN] - draft[name][1]) / (CHAIN - 1) * 1e3, 3),
                             chains=chains, best_chain=best,
                             best_speedup_vs_vanilla=round(chains[best]["predicted_tok_s"] / vanilla_tok_s, 3))

    print(f"held-out ShareGPT prompts: {len(prompts)}, {args.max_new_tokens} new tokens, greedy, chain of {CHAIN}; "
          f"{torch.get_num_threads()} threads; acceptance runs {acc_s:.0f} s")
    print(f"{'head':>12} {'kind':>6} {'layers':>6} {'tau':>6}  {'alpha by position':<32} {'step ms':>8} "
          f"{'level ms':>8}  equal")
    for name, r in results.items():
        alphas = " ".join(f"{x:.2f}" for x in r["acceptance_by_position"])
        print(f"{name:>12} {r['kind']:>6} {r['layers']:>6} {r['tau_chain5']:>6.3f}  {alphas:<32} {r['step_ms']:>8.2f} "
              f"{r['per_level_ms']:>8.2f}  {r['equal_to_vanilla']}")
    print(f"\npredicted tokens/s (verify after {args.context} cached tokens; vanilla {vanilla_tok_s:.1f}):")
    print(f"{'head':>12} " + " ".join(f"{'chain:' + str(k):>10}" for k in range(1, CHAIN + 1)) + "   best")
    for name, r in results.items():
        print(f"{name:>12} " + " ".join(f"{r['chains'][k]['predicted_tok_s']:>10.1f}" for k in range(1, CHAIN + 1))
              + f"   chain:{r['best_chain']} ({r['best_speedup_vs_vanilla']:.2f}x vanilla)")
    out = dict(heads=heads, prompts=sizes, max_new_tokens=args.max_new_tokens, greedy=True, chain=CHAIN,
               reps=args.reps, context=args.context, verify_ms={k: round(s * 1e3, 3) for k, s in verify.items()},
               vanilla_tok_s=round(vanilla_tok_s, 2), acceptance_s=round(acc_s, 1), results=results,
               command="python benchmarks/head_capacity.py " + " ".join(sys.argv[1:] if argv is None else argv))
    if args.json:
        print(f"saved {save_json(args.json, out)}")
    return out


if __name__ == "__main__":
    main()
