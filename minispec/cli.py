"""Command line: ``python -m minispec <command>``.

    demo        generate for a prompt with SmolLM2-135M, a speculative method and vanilla side by side
                (its first run on a machine calibrates it once: see calibrate)
    calibrate   this machine's linear kernel and 'auto', measured once and saved for every later run
    bench       Spec-Bench-style comparison of decoding methods
    tune        tree dispatcher: measured verify-cost curve, candidates, the choice for this machine
    profile     per-method decode-step breakdown (draft, target, verify, commit, hand-off), bandwidth floor
    exactness   exact and empirical checks that every verifier is lossless
    grade N     per-exercise PASS/FAIL table of chapter N
    train draft distill the small SmolLM2 draft model on target-generated ShareGPT answers
    train eagle|eagle3|medusa   train an EAGLE-1/2 head, an EAGLE-3 head or Medusa heads
    export      a trained EAGLE-1/2 or EAGLE-3 head in the official layout (vLLM, SGLang)
    check-env   one [OK]/[FAIL] line per dependency
    gpu-suite   every GPU measurement in one run, one JSON each (--smoke: tiny shapes on the CPU)
"""

from __future__ import annotations

import argparse
import sys

from .args import thread_count


def _threads(args) -> int:
    """Set torch's CPU threads: --threads, else one per idle core (``minispec.lab.env.default_threads``)."""
    import torch

    from .lab.env import default_threads

    n = args.threads if args.threads is not None else default_threads()
    torch.set_num_threads(n)
    return n


def _demo(args) -> int:
    from . import SamplingParams, load
    from .auto import resolve
    from .lab import calibrate
    from .methods import Methods, parse_method

    args.params = SamplingParams(args.temperature, args.top_k, args.top_p)  # bad ones fail before the model loads
    if not args.prompt.strip():
        raise ValueError("the prompt is empty: give --prompt some text")
    spec = parse_method(args.method)
    threads = _threads(args)
    loaded = None
    if spec.base == "auto" and calibrate.needs_calibration(args.model, args.params):  # this machine's first demo
        print(calibrate.announce(args.model, args.params), flush=True)
        kernel, r, loaded = calibrate.calibrate(args.model, args.params)
        print("\n".join(calibrate.summary(kernel, r, args.model, args.params)), flush=True)
    model, tok = loaded or load(args.model)
    print(f"model {args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"{model.cfg.n_layer} layers; {threads} CPU thread{'s' * (threads > 1)} (--threads N to change)", flush=True)
    methods = Methods(model, args.model, drafter_path=args.drafter, draft_vocab=args.draft_vocab)
    spec = resolve(spec, methods, say=lambda line: print(line, flush=True), params=args.params)
    print(f"prompt: {args.prompt}\n", flush=True)
    runs = _demo_runs(args, model, tok, spec.name, methods.drafter(spec))
    print(demo_table(list(runs.items()), sampled=args.temperature > 0))
    return 0


def _demo_runs(args, model, tok, method: str, drafter) -> dict:
    """{method: [GenerationResult]}: one run on the prompt (its text printed); unless --no-compare,
    vanilla and the method again, both warm, interleaved on the prompt and a few of minispec's own."""
    from . import generate

    kw = dict(params=args.params, max_new_tokens=args.max_new_tokens, seed=args.seed)
    r = generate(model, tok, args.prompt, drafter=drafter, **kw)
    print(r.text, flush=True)
    if drafter is None or args.no_compare:
        return {method: [r]}
    # the run above paid one-time costs (kernel set-up for each row count, lazy loads) that vanilla,
    # run after it, would not: time both again, warm, interleaved prompt by prompt
    prompts = compare_prompts(args.prompt, args.compare_prompts)
    print(f"\n(timing vanilla and {method} again, both warm, interleaved on {len(prompts)} prompts ...)", flush=True)
    runs = {"vanilla": [], method: []}
    for p in prompts:
        runs["vanilla"].append(generate(model, tok, p, **kw))
        runs[method].append(generate(model, tok, p, drafter=drafter, **kw))
    return runs


def compare_prompts(prompt: str, n: int) -> list[str]:
    """The demo's timed prompts: ``prompt`` and ``n`` of minispec's own (one short prompt alone gives a
    noisy ratio), mixed as ``auto``'s calibration mixes them (one in three reuses its input,
    ``prompts.calibration_set``) but not the ones it calibrated on."""
    from .lab.calibrate import QUICK_PROMPTS
    from .prompts import calibration_set

    return [prompt] + calibration_set(QUICK_PROMPTS + n)[QUICK_PROMPTS:]


def demo_table(runs, sampled: bool) -> str:
    """method | tokens/s | speedup | tau | identical output, for (name, [GenerationResult per prompt]) pairs,
    vanilla first: tokens over the summed wall time, tau over the summed forwards."""
    from .lab.text_table import Col, text_table

    def rate(rs):
        return sum(r.stats.new_tokens for r in rs) / sum(r.stats.total_s for r in rs)

    def same(rs):
        if rs is base or base is None:
            return "-"
        if sampled:
            return "- (sampled: same law, other draws)"
        hits = sum(r.tokens == b.tokens for r, b in zip(rs, base))
        return "yes" if hits == len(rs) else f"NO ({hits}/{len(rs)} prompts)"

    base = runs[0][1] if runs[0][0] == "vanilla" else None
    rows = [[name, rate(rs), f"{rate(rs) / rate(base):.2f}x" if base is not None else "-",
             sum(r.stats.new_tokens for r in rs) / sum(r.stats.target_forwards for r in rs), " " + same(rs)]
            for name, rs in runs]
    cols = [Col("method", width=16, left=True), Col("tokens/s", ".1f", 9), Col("speedup", width=8), Col("tau", ".2f", 5),
            Col(" identical output", left=True)]
    rs = runs[-1][1]
    return "\n".join(["", *text_table(cols, rows),
                      f"({sum(r.stats.new_tokens for r in rs)} new tokens over {len(rs)} prompt{'s' * (len(rs) > 1)}, "
                      f"{'sampling' if sampled else 'greedy'}; tau = tokens per target forward)"])


def _tune(args) -> int:
    from . import load
    from .lab.benchinfo import save_json
    from .lab.tune import save_choice, tune
    from .lab.tune_report import calibration_prompts, format_tune
    from .sampling import SamplingParams

    params = SamplingParams(args.temperature, args.top_k, args.top_p)  # bad ones fail before the model loads
    _threads(args)
    target, tok = load(args.model)
    prompts = calibration_prompts(args.limit, args.questions)
    cands = [c.strip() for c in args.candidates.split(",") if c.strip()] if args.candidates else None
    kw = dict(candidates=cands) if cands else {}
    r = tune(target, tok, prompts, args.model, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
             params=params, head_dtype=args.head_dtype, **kw)
    print(format_tune(r))
    print(f"saved the choice to {save_choice(r)}")
    if args.json:
        print(f"saved {save_json(args.json, dict(benchmark='tune', prompts=len(prompts), **r.as_dict()))}")
    return 0


def _calibrate(args) -> int:
    from .lab import calibrate
    from .sampling import SamplingParams

    params = SamplingParams(args.temperature, args.top_k, args.top_p)  # bad ones fail before anything is timed
    _threads(args)
    print(calibrate.announce(args.model, params), flush=True)
    kernel, r, _ = calibrate.calibrate(args.model, params, force=args.force)
    print("\n".join(calibrate.summary(kernel, r, args.model, params)))
    return 0


def _calibrate_flags(c) -> None:
    c.add_argument("--model", default="smollm2-135m")
    c.add_argument("--threads", type=thread_count, default=None, help=THREADS_HELP)
    c.add_argument("--temperature", type=float, default=0.0, help="calibrate 'auto' for sampled decoding at this "
                   "temperature (default 0: greedy); saved apart from greedy's choice")
    c.add_argument("--top-k", type=int, default=0)
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--force", action="store_true", help="measure again although this machine has a calibration")


def _bench(args) -> int:
    from .lab.bench import format_table, run_bench
    from .lab.benchinfo import save_json
    from .prompts import spec_bench

    _threads(args)
    cats = args.categories.split(",") if args.categories else None
    questions = spec_bench(args.questions, limit=args.limit, categories=cats)
    result = run_bench(questions, methods=[m.strip() for m in args.methods.split(",") if m.strip()], model=args.model,
                       max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, k=args.k,
                       pld_k=args.pld_k, draft_path=args.draft, seed=args.seed, tree=args.tree,
                       drafter_path=args.drafter, draft_vocab=args.draft_vocab, batch_size=args.batch_size)
    print(format_table(result))
    if args.json:
        print(f"saved {save_json(args.json, dict(benchmark='bench', **result))}")
    return 0


def _check_env(args) -> int:
    from .lab.env import check_env

    return check_env()


THREADS_HELP = ("torch CPU threads, at least 1 (default: one per core idle now, measured over a quarter second from "
                "/proc/stat, else cores minus the load average: a thread more than the free cores makes decoding several "
                "times slower)")
DRAFT_VOCAB_HELP = ("eagle/eagle2/copy/medusa draft over the K most frequent tokens (FR-Spec; default: "
                    "minispec.methods.DRAFT_VOCAB, 0: the full vocabulary); verification always uses the full vocabulary")


def _demo_flags(d) -> None:
    d.add_argument("--model", default="smollm2-135m")
    d.add_argument("--prompt", default="Explain in three sentences why speculative decoding makes LLM inference faster.")
    d.add_argument("--max-new-tokens", type=int, default=128)
    d.add_argument("--temperature", type=float, default=0.0)
    d.add_argument("--top-k", type=int, default=0)
    d.add_argument("--top-p", type=float, default=1.0)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--threads", type=thread_count, default=None, help=THREADS_HELP)
    d.add_argument("--no-compare", action="store_true", help="skip the vanilla run that the speedup is measured against")
    d.add_argument("--compare-prompts", type=int, default=3,
                   help="minispec's own prompts timed beside yours for the comparison (interleaved, warm; one in "
                        "three reuses its input, as in auto's calibration, which uses others)")
    d.add_argument("--method", default="auto", help="vanilla, pld, sps, eagle, eagle2, eagle3, medusa, NAME@TREE or "
                   "auto (default: the tree dispatcher's choice for this machine, see calibrate and tune)")
    d.add_argument("--drafter", default=None, help="head checkpoint for eagle/eagle2/eagle3/medusa (default: shipped)")
    d.add_argument("--draft-vocab", type=int, default=None, help=DRAFT_VOCAB_HELP)


def _tune_flags(t) -> None:
    t.add_argument("--model", default="smollm2-135m")
    t.add_argument("--questions", default=None, help="a JSONL of questions to calibrate on (default: minispec's own "
                   "calibration prompts, never a benchmark's)")
    t.add_argument("--limit", type=int, default=8, help="calibration prompts (spread over Spec-Bench categories)")
    t.add_argument("--max-new-tokens", type=int, default=64)
    t.add_argument("--batch-size", type=int, default=1, help="choose for this batch size")
    t.add_argument("--candidates", default=None, help="comma list of methods (default: minispec.auto.DEFAULT_CANDIDATES)")
    t.add_argument("--head-dtype", default="auto", choices=["auto", "target", "f32", "bf16"],
                   help="the dtype the EAGLE-1/2 candidates draft in (auto: the faster on this machine, timed first)")
    t.add_argument("--threads", type=thread_count, default=None, help=THREADS_HELP)
    t.add_argument("--temperature", type=float, default=0.0,
                   help="choose for sampled decoding at this temperature (default 0: greedy); saved apart "
                        "from greedy's choice")
    t.add_argument("--top-k", type=int, default=0)
    t.add_argument("--top-p", type=float, default=1.0)
    t.add_argument("--json", default=None, help="also write the full result (with device and versions) here")


def _bench_flags(b) -> None:
    b.add_argument("--questions", default=None, help="Spec-Bench JSONL (default: ../shared/data/spec_bench.jsonl)")
    b.add_argument("--limit", type=int, default=None, help="at most this many questions, spread over categories")
    b.add_argument("--categories", default=None, help="comma list of categories")
    b.add_argument("--model", default="smollm2-135m")
    b.add_argument("--methods", default="hf,vanilla,auto",
                   help="comma list of hf,hf_assisted,hf_pld,vanilla,pld,sps,eagle,eagle2,eagle3,medusa,auto; a "
                        "branching method takes a tree as NAME@TREE, e.g. sps@eagle, eagle2@5/8/32")
    b.add_argument("--tree", default=None, help="tree for branching methods without @TREE: chain:K, eagle, medusa or "
                   "DEPTH,TOP_K,TOTAL_TOKENS (EAGLE-2 dynamic)")
    b.add_argument("--drafter", default=None, help="head checkpoint for eagle/eagle2/eagle3/medusa (default: shipped)")
    b.add_argument("--draft-vocab", type=int, default=None, help=DRAFT_VOCAB_HELP)
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--batch-size", type=int, default=1,
                   help="decode B questions at a time (chapter 7); identical = equal to the question decoded alone")
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--top-p", type=float, default=1.0)
    b.add_argument("--k", type=int, default=4, help="draft length of sps / hf_assisted")
    b.add_argument("--pld-k", type=int, default=8, help="draft length of pld / hf_pld")
    b.add_argument("--draft", default=None, help="draft checkpoint for sps / hf_assisted (default: the shipped one)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--threads", type=thread_count, default=None, help=THREADS_HELP)
    b.add_argument("--json", default=None, help="write the results (with device and versions) here")


def _here(name: str, flags, run):
    """A command whose flags are declared here: argv -> its parser -> ``run(args)``; a ValueError or a
    FileNotFoundError prints one line and exits 2."""
    def command(argv: list[str]) -> int:
        ap = argparse.ArgumentParser(prog=f"python -m minispec {name}")
        flags(ap)
        args = ap.parse_args(argv)
        try:
            return run(args)
        except (ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return command


def _elsewhere(module: str, func: str = "main"):
    """A command with its own parser in ``module``: argv goes there unchanged."""
    def command(argv: list[str]) -> int:
        import importlib

        return getattr(importlib.import_module(module, __package__), func)(argv)
    return command


def _train(argv: list[str]) -> int:
    """python -m minispec train draft|eagle|eagle3|medusa [--help]"""
    trainers = {"draft": "distill_draft", "eagle": "eagle", "eagle3": "eagle3", "medusa": "medusa"}
    if not argv or argv[0] not in trainers:
        print(f"usage: python -m minispec train {{{','.join(trainers)}}} [--help]", file=sys.stderr)
        return 2
    from .train import loop

    loop.BOUND_HEAP = True  # long CPU trainings: from the first step on, large freed tensors go back to the OS
    _elsewhere(f".train.{trainers[argv[0]]}")(argv[1:])
    return 0


COMMANDS = {  # name -> (the line ``python -m minispec --help`` shows, argv -> exit status)
    "demo": ("generate with SmolLM2-135M and print tokens/s", _here("demo", _demo_flags, _demo)),
    "calibrate": ("measure this machine's linear kernel and 'auto' once; every later run reads them",
                  _here("calibrate", _calibrate_flags, _calibrate)),
    "tune": ("tree dispatcher: measure costs and acceptance, choose the tree for this machine",
             _here("tune", _tune_flags, _tune)),
    "bench": ("Spec-Bench-style comparison of decoding methods (tokens/s, speedup, tau)",
              _here("bench", _bench_flags, _bench)),
    "train": ("train draft|eagle|eagle3|medusa: train a drafter for SmolLM2 (see train NAME --help)", _train),
    "grade": ("grade a chapter's exercises: grade N [--impl exercises|solutions|minispec]",
              _elsewhere(".grading", "grade_main")),
    "export": ("write a head in the official EAGLE layout (config.json + model.safetensors) for vLLM / SGLang",
               _elsewhere(".lab.export")),
    "profile": ("where a decode step's time goes, per method, and the memory-bandwidth floor", _elsewhere(".lab.profile")),
    "exactness": ("exact and empirical checks that every verifier is lossless", _elsewhere(".lab.exactness_report")),
    "gpu-suite": ("every GPU measurement in ~9 minutes, one JSON each: --out DIR [--smoke]", _elsewhere(".lab.gpu_suite")),
    "check-env": ("check that the dependencies are installed", _here("check-env", lambda ap: None, _check_env)),
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in COMMANDS:
        return COMMANDS[argv[0]][1](argv[1:])
    ap = argparse.ArgumentParser(prog="python -m minispec", description="minispec: speculative decoding, chapter by chapter")
    sub = ap.add_subparsers(dest="command", required=True)
    for name, (line, _) in COMMANDS.items():
        sub.add_parser(name, help=line, add_help=False)
    ap.parse_args(argv)  # no command, or an unknown one: argparse says so (or prints --help) and exits
    return 2
