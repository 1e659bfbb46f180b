"""The static forward (chapter 8's body) compiled by ``torch.compile`` on the CPU against the same forward
eager: SmolLM2 decoding greedily one token a step on a ``StaticKVCache``, the two interleaved round by
round in one process.

On a GPU the static forward is what a CUDA graph captures; on the CPU its counterpart is compilation:
inductor fuses the forward's elementwise ops and reductions into generated C++ (the weight products stay
minispec's own, extern calls), one program per bucket, its shapes fixed. The model's call is compiled; its
plan (``static_plan``) is built eagerly before it, since on the CPU the plan reads its key blocks on the host
past 128 keys (a graph break in every step's trace otherwise). What this script reports:

    compile_s            tracing and compiling the one-token bucket, and the four-token one
    graph_breaks         of the one-token model call (``torch._dynamo.explain``)
    ms_per_step          median of each round's steps, eager and compiled, and their ratio
    same_tokens          whether the compiled decode emits the eager decode's tokens
    max_abs_logit_diff   compiled against eager logits (the generated code may round otherwise)
    rows_equal_buckets   whether each row of a four-token chain, compiled, equals the one-token compiled
                         forward of that token: what greedy identity needs if both ran compiled

    python benchmarks/compiled_forward.py [--threads 2] [--steps 40] [--rounds 3] [--capacity 384] [--json out.json]

Needs a C++ compiler (inductor's). Run it with nothing else on the machine. Not part of CI: timings are
machine-dependent (``tests/test_compile.py`` checks that the forward traces as one graph).
"""

import argparse
import statistics
import time

import torch

from minispec import load
from minispec.cuda_graphs import static_forward, static_plan, static_prefill
from minispec.kv import StaticKVCache
from minispec.exact.attention import ready
from minispec.lab.benchinfo import save_json
from minispec.args import thread_count

PROMPT = "Explain, step by step, how a bicycle's gears let a rider climb a steep hill with less effort."


def model_call(model, kv, tokens, plan):
    return model(tokens, kv=kv, plan=plan)


def with_plan(body):
    """``static_forward`` with its plan built outside ``body`` (the model's call, compiled): the plan's key blocks
    are read on the host (``minispec.exact.attention.ready``), which a trace cannot do without breaking its graph."""
    def forward(model, kv, tokens, positions, tree_mask):
        return body(model, kv, tokens, ready(static_plan(kv, positions, tree_mask)))
    return forward


def decode(model, forward, prompt: torch.Tensor, steps: int, capacity: int):
    """Greedy decoding of ``steps`` tokens through ``forward`` (static_forward, compiled or not): (tokens,
    logits [steps, V], seconds per step)."""
    kv = StaticKVCache.for_model(model, capacity)
    x = static_prefill(model, kv, prompt, last_logits_only=True).logits[0, -1].argmax()
    kv.commit()
    one = torch.ones(1, 1, 1, dtype=torch.bool)
    tokens, logits, seconds = [], [], []
    for _ in range(steps):
        t = time.perf_counter()
        kv.begin(1, 1)
        out = forward(model, kv, x.view(1, 1), kv.lengths[:1, None], one).logits[0, -1]
        kv.commit()
        seconds.append(time.perf_counter() - t)
        x = out.argmax()
        tokens.append(int(x))
        logits.append(out.clone())
    return tokens, torch.stack(logits), seconds


def chain_rows(model, forward, prompt: torch.Tensor, capacity: int, T: int = 4) -> list[bool]:
    """Whether each row of a forward of T chained tokens equals the one-token forward of that token."""
    kv = StaticKVCache.for_model(model, capacity)
    static_prefill(model, kv, prompt)
    kv.commit()
    chain = prompt[:, :T]
    kv.begin(1, T)
    rows = forward(model, kv, chain, kv.lengths[:1, None] + torch.arange(T),
                   torch.ones(T, T, dtype=torch.bool).tril()[None]).logits[0].clone()
    kv.discard()
    one = torch.ones(1, 1, 1, dtype=torch.bool)
    equal = []
    for j in range(T):
        kv.begin(1, 1)
        equal.append(torch.equal(forward(model, kv, chain[:, j:j + 1], kv.lengths[:1, None], one).logits[0, 0], rows[j]))
        kv.commit()
    return equal


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=thread_count, default=2)
    ap.add_argument("--steps", type=int, default=40, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--capacity", type=int, default=384, help="the static cache's slots (attended every step)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load("smollm2-135m")
    prompt = torch.tensor([tok.encode(PROMPT)])
    compiled = with_plan(torch.compile(model_call, dynamic=False))
    with torch.inference_mode():
        decode(model, static_forward, prompt, 2, args.capacity)  # eager first: row recipes, prepacked weights
        kv = StaticKVCache.for_model(model, args.capacity)
        kv.begin(1, 1)
        plan = ready(static_plan(kv, kv.lengths[:1, None], torch.ones(1, 1, 1, dtype=torch.bool)))
        explained = torch._dynamo.explain(model_call)(model, kv, prompt[:, :1], plan)
        torch._dynamo.reset()
        t = time.perf_counter()
        decode(model, compiled, prompt, 2, args.capacity)
        compile_1 = time.perf_counter() - t
        t = time.perf_counter()
        rows_equal = chain_rows(model, compiled, prompt, args.capacity)
        compile_4 = time.perf_counter() - t
        ms = {"eager": [], "compiled": []}
        for r in range(args.rounds):
            e_tok, e_logits, e_s = decode(model, static_forward, prompt, args.steps, args.capacity)
            c_tok, c_logits, c_s = decode(model, compiled, prompt, args.steps, args.capacity)
            ms["eager"].append(statistics.median(e_s) * 1e3)
            ms["compiled"].append(statistics.median(c_s) * 1e3)
            print(f"round {r}: eager {ms['eager'][-1]:.1f} ms/step, compiled {ms['compiled'][-1]:.1f} ms/step")
    result = dict(benchmark="compiled_forward", threads=args.threads, steps=args.steps, rounds=args.rounds,
                  capacity=args.capacity, prompt_tokens=prompt.shape[1],
                  compile_s={"1 token": round(compile_1, 1), "4 tokens": round(compile_4, 1)},
                  graph_breaks=explained.graph_break_count,
                  break_reasons=[b.reason.splitlines()[0] for b in explained.break_reasons],
                  ms_per_step={k: round(statistics.median(v), 2) for k, v in ms.items()},
                  ms_per_step_rounds={k: [round(x, 2) for x in v] for k, v in ms.items()},
                  compiled_over_eager=round(statistics.median(ms["compiled"]) / statistics.median(ms["eager"]), 3),
                  same_tokens=e_tok == c_tok, max_abs_logit_diff=float((e_logits - c_logits).abs().max()),
                  rows_equal_buckets=rows_equal)
    print(f"compile {result['compile_s']}, graph breaks {result['graph_breaks']}, ms/step {result['ms_per_step']} "
          f"(compiled/eager {result['compiled_over_eager']}), same tokens {result['same_tokens']}, "
          f"max |logit diff| {result['max_abs_logit_diff']:.2e}, four-token rows = one-token rows {rows_equal}")
    if args.json:
        print(f"saved {save_json(args.json, result)}")


if __name__ == "__main__":
    main()
