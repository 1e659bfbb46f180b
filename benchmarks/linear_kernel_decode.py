"""The two prepacked CPU kernels of ``minispec.exact.linear`` in the decode loop: greedy tokens/s, side by side.

``benchmarks/linear_kernels.py`` times the 121 linear products of a SmolLM2 forward alone; this script
times what a user sees: ``generate`` on minispec's own prompts with every ``Linear`` on the weight
panels (``Linear.cpu_kernel = "panels"``), on oneDNN's prepacked weights ("onednn") or on the default, "auto"
(whichever ``python -m minispec calibrate`` timed faster on this machine, ``minispec.exact.kernels``, with its one-row calls padded to the rows it
timed fastest for that kernel, printed), vanilla and one speculative method, the three interleaved prompt by
prompt in one process (so drift of a shared machine hits them alike). Each kernel runs under the row recipe its own
probe chose on this CPU (printed). Reports tokens/s, the ratios to the panels and to oneDNN, and whether every
greedy answer equals vanilla's on the same kernel (the identity each kernel's recipe must keep) and the panels'.
Not part of CI: timings are machine-dependent.

    python benchmarks/linear_kernel_decode.py --prompts 8 --max-new-tokens 96 --threads 2 \\
        --json benchmarks/results/linear_kernel_decode_cpu.json
"""

from __future__ import annotations

import argparse
import time

import torch

from minispec import generate, load
from minispec.lab.benchinfo import save_json
from minispec.exact.linear import ExactLinear as Linear, prepack
from minispec.exact.kernels import CPU_KERNELS, describe, onednn_available
from minispec.args import thread_count
from minispec.methods import Methods
from minispec.prompts import own_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8, help="minispec's own prompts (never Spec-Bench)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=thread_count, default=2)
    ap.add_argument("--method", default="eagle@chain:2", help="the speculative method timed beside vanilla")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not onednn_available():
        raise SystemExit("this PyTorch build has no oneDNN linear (torch.ops.mkldnn._linear_pointwise)")
    torch.set_num_threads(args.threads)
    model, tok = load("smollm2-135m")
    methods = Methods(model)
    prompts = [p["prompt"] for p in own_prompts()][:args.prompts]
    print(f"'auto' on this machine: {describe()}")
    default, recipes = Linear.cpu_kernel, {}
    kernels = (*CPU_KERNELS, "auto")
    for kernel in kernels:  # prepacked copies and row recipes before any timing; one warm-up run each
        Linear.cpu_kernel = kernel
        prepack(model)
        generate(model, tok, prompts[0], drafter=methods.drafter(args.method), max_new_tokens=8)
        with torch.inference_mode():
            recipes[kernel] = sorted({layer.row_recipe(torch.zeros(1, layer.in_features)).describe()
                                    for layer in model.modules() if isinstance(layer, Linear)})
        print(f"{kernel}: row recipes {recipes[kernel]}")
    runs = [(k, m) for k in kernels for m in ("vanilla", args.method)]
    seconds, tokens, answers = {r: 0.0 for r in runs}, {r: 0 for r in runs}, {r: [] for r in runs}
    for i, prompt in enumerate(prompts):
        for kernel, method in runs:
            Linear.cpu_kernel = kernel
            drafter = None if method == "vanilla" else methods.drafter(method)
            t = time.perf_counter()
            r = generate(model, tok, prompt, drafter=drafter, max_new_tokens=args.max_new_tokens)
            seconds[kernel, method] += time.perf_counter() - t
            tokens[kernel, method] += len(r.tokens)
            answers[kernel, method].append(r.tokens)
        print(f"prompt {i + 1}/{len(prompts)} done")
    Linear.cpu_kernel = default
    rows = []
    print(f"\n{'kernel':8} {'method':16} {'tok/s':>7} {'vs panels':>9} {'vs onednn':>9}  = vanilla (same kernel)  = panels")
    for kernel, method in runs:
        tps = tokens[kernel, method] / seconds[kernel, method]
        base, onednn = (tokens[k, method] / seconds[k, method] for k in CPU_KERNELS)
        same = sum(a == b for a, b in zip(answers[kernel, method], answers[kernel, "vanilla"]))
        cross = sum(a == b for a, b in zip(answers[kernel, method], answers["panels", method]))
        rows.append(dict(kernel=kernel, method=method, tok_s=tps, vs_panels=tps / base, vs_onednn=tps / onednn,
                         tokens=tokens[kernel, method], seconds=seconds[kernel, method], equal_to_vanilla=same,
                         equal_to_panels=cross))
        print(f"{kernel:8} {method:16} {tps:7.1f} {tps / base:8.2f}x {tps / onednn:8.2f}x  {same:>2}/{len(prompts)}"
              f"{'':20}{cross:>2}/{len(prompts)}")
    if args.json:
        print("saved", save_json(args.json, dict(benchmark="linear_kernel_decode", threads=args.threads,
                                                 prompts=len(prompts), max_new_tokens=args.max_new_tokens,
                                                 method=args.method, row_recipes=recipes, rows=rows,
                                                 command="python benchmarks/linear_kernel_decode.py " +
                                                 f"--prompts {args.prompts} --max-new-tokens {args.max_new_tokens} "
                                                 f"--threads {args.threads} --method {args.method} --json {args.json}")))


if __name__ == "__main__":
    main()
