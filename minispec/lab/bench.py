"""``python -m minispec bench``: Spec-Bench-style comparison of decoding methods in one process.

Methods run on the same questions, interleaved per question (so machine drift affects all of
them alike), with the same prompt token ids (chat template applied) and thread count:

    hf           transformers ``generate`` (the baseline every speedup is relative to)
    hf_assisted  transformers assisted generation with minispec's distilled draft
    hf_pld       transformers prompt lookup decoding (``prompt_lookup_num_tokens``)
    vanilla, pld, sps, eagle, eagle2, eagle3, medusa, auto, NAME@TREE
                 minispec's decoding methods (see ``minispec.methods``): plain decoding, prompt
                 lookup, the distilled draft model, EAGLE-1/2 / EAGLE-3 / Medusa heads, chains,
                 static or dynamic trees, and the tree dispatcher's choice

Reported per method and per category: tokens/s, speedup vs ``hf``, tau (tokens per target
forward, bonus included), acceptance by draft position, and how many answers are
token-identical to ``vanilla`` (meaningful at temperature 0).

Reference: Xia et al., "Unlocking Efficiency in Large Language Model Inference: A
Comprehensive Survey of Speculative Decoding" (2024) — Spec-Bench.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..generate import acceptance_by_depth, add_by_depth
from ..methods import HF_METHODS, METHOD_NAMES, MethodSpec, parse_methods
from ..sampling import GREEDY, SamplingParams
from .text_table import Col, text_table

METHODS = HF_METHODS + METHOD_NAMES  # the method table's (minispec.drafters.defaults): transformers' and minispec's


@dataclass
class _Totals:
    tokens: int = 0
    seconds: float = 0.0
    forwards: int = 0
    identical: int = 0
    n: int = 0
    tested: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def add(self, tokens, seconds, stats, identical):
        self.tokens += len(tokens)
        self.seconds += seconds
        self.identical += bool(identical)
        self.n += 1
        if stats is not None:
            self.forwards += stats.target_forwards
            add_by_depth(self.tested, stats.tested_at_depth)
            add_by_depth(self.accepted, stats.accepted_at_depth)

    def summary(self, hf_tok_s: float | None, vanilla_tok_s: float | None = None) -> dict:
        tps = self.tokens / self.seconds if self.seconds else 0.0
        return dict(tokens_per_s=tps, speedup=tps / hf_tok_s if hf_tok_s else None,
                    vs_vanilla=tps / vanilla_tok_s if vanilla_tok_s else None,
                    tau=self.tokens / self.forwards if self.forwards else None,
                    acceptance_by_position=acceptance_by_depth(self.tested, self.accepted),
                    identical=self.identical, n=self.n, new_tokens=self.tokens, seconds=self.seconds)


def _runners(specs: list[MethodSpec], hf_methods, model_name, k, draft_path, pld_k, tree=None, drafter_path=None,
             batch_size=1, draft_vocab=None, sampling=GREEDY):
    """Build one callable per method: ids, params, seed -> (new tokens, seconds, stats or None); with
    ``batch_size`` > 1: B prompts, params, B seeds -> (B answers, seconds, B stats). ``auto`` resolves to
    this machine's choice for decoding by ``sampling``."""
    from .. import generate, load
    from ..auto import resolve
    from ..methods import Methods
    from . import calibrate

    loaded = None
    if any(s.base == "auto" for s in specs) and calibrate.needs_calibration(model_name, sampling):
        print(calibrate.announce(model_name, sampling), flush=True)  # what auto means here, measured once
        kernel, r, loaded = calibrate.calibrate(model_name, sampling)
        print("\n".join(calibrate.summary(kernel, r, model_name, sampling)), flush=True)
    target, tok = loaded or load(model_name)
    made = Methods(target, model_name, k=k, pld_k=pld_k, tree=tree, draft_path=draft_path, drafter_path=drafter_path,
                   draft_vocab=draft_vocab)
    runners, resolved = {}, {}
    for spec in specs:
        real = resolve(spec, made, batch_size, say=lambda line: print(line, flush=True), params=sampling)
        if spec.base == "auto":
            resolved[spec.name] = real.name
        runners[spec.name] = _minispec_runner(target, tok, made, real, batch_size)
    if batch_size > 1:  # the reference of ``identical``: each question decoded alone, vanilla greedy
        runners["_alone"] = lambda ids, params, seed: (generate(target, tok, ids, max_new_tokens=params["max_new_tokens"],
                                                                 temperature=0.0).tokens, 0.0, None)
    if hf_methods:
        runners.update(_hf_runners(hf_methods, model_name, target, tok, k, pld_k, draft_path, batch_size))
    return runners, tok, resolved


def _minispec_runner(target, tok, made, spec: MethodSpec, batch_size: int):
    """``generate`` (``generate_batch`` for B > 1) with the method's drafter, timed."""
    from .. import generate
    from ..batch import generate_batch

    def run(ids, params, seed):
        t = time.perf_counter()
        r = generate(target, tok, ids, drafter=made.drafter(spec), max_new_tokens=params["max_new_tokens"],
                     params=params["sampling"], seed=seed)
        return r.tokens, time.perf_counter() - t, r.stats

    def run_batch(ids, params, seeds):  # ids: B prompts -> (B answers, seconds, B stats)
        t = time.perf_counter()
        rs, _ = generate_batch(target, tok, ids, drafter=made.drafter(spec), max_new_tokens=params["max_new_tokens"],
                               params=params["sampling"], seed=seeds)
        return [r.tokens for r in rs], time.perf_counter() - t, [r.stats for r in rs]

    return run_batch if batch_size > 1 else run


def _hf_runners(hf_methods, model_name, target, tok, k, pld_k, draft_path, batch_size) -> dict:
    """transformers' ``generate``: plain, assisted by minispec's distilled draft, prompt lookup."""
    from .. import load_hf
    from ..loading import to_hf

    hf, _ = load_hf(model_name)
    extra = {"hf": {}, "hf_pld": dict(prompt_lookup_num_tokens=pld_k)}
    if "hf_assisted" in hf_methods:
        from ..drafters.draft_checkpoint import load_draft_model

        assistant = to_hf(load_draft_model(target, draft_path))
        assistant.generation_config.num_assistant_tokens = k
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        extra["hf_assisted"] = dict(assistant_model=assistant)
    make = _hf_batch_runner if batch_size > 1 else _hf_runner
    return {m: make(hf, tok, target, **extra[m]) for m in HF_METHODS if m in hf_methods}


def _hf_kw(params: dict) -> dict:
    sampling = params["temperature"] > 0
    return dict(do_sample=sampling, temperature=params["temperature"] if sampling else None,
                top_p=params["top_p"] if sampling else None, top_k=None)


def _hf_runner(hf, tok, target, **extra):
    @torch.inference_mode()
    def run(ids, params, seed):
        x = torch.tensor([ids])
        torch.manual_seed(seed)
        t = time.perf_counter()
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=params["max_new_tokens"], **_hf_kw(params),
                          **extra)
        return out[0, x.shape[1]:].tolist(), time.perf_counter() - t, None
    return run


def _hf_batch_runner(hf, tok, target, **extra):
    pad = tok.pad_token_id if tok.pad_token_id is not None else target.cfg.eos_token_id
    eos = {tok.eos_token_id, target.cfg.eos_token_id} - {None}

    @torch.inference_mode()
    def run_batch(ids, params, seeds):  # left-padded batch, as transformers generates batches
        T = max(len(x) for x in ids)
        x = torch.tensor([[pad] * (T - len(i)) + list(i) for i in ids])  # [B, T]
        att = torch.tensor([[0] * (T - len(i)) + [1] * len(i) for i in ids])
        torch.manual_seed(seeds[0])
        t = time.perf_counter()
        out = hf.generate(x, attention_mask=att, max_new_tokens=params["max_new_tokens"], **_hf_kw(params),
                          pad_token_id=pad, **extra)
        seconds = time.perf_counter() - t
        answers = []
        for row in out[:, T:].tolist():  # a finished row continues with padding: cut after its end
            cut = next((j + 1 for j, tkn in enumerate(row) if tkn in eos), len(row))
            answers.append(row[:cut])
        return answers, seconds, [None] * len(ids)
    return run_batch


def run_bench(questions: list[dict], methods=("hf", "vanilla", "sps", "pld"), model: str = "smollm2-135m",
              max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0, k: int = 4, pld_k: int = 8,
              draft_path=None, seed: int = 0, progress: bool = True, tree=None, drafter_path=None,
              draft_vocab: int | None = None, batch_size: int = 1) -> dict:
    """Run every method on every question, interleaved per question (per batch of questions).

    Args:
        questions: [{"question_id", "category", "prompt"}] (see ``minispec.prompts.spec_bench``).
        methods: names from ``METHODS``, or ``NAME@TREE`` for a branching method (``minispec.methods``).
        model: target model name for ``minispec.load``.
        k: draft length of ``sps`` (and of ``hf_assisted``); pld_k: prompt lookup draft length.
        draft_path: the draft checkpoint for ``sps`` / ``hf_assisted`` (default: the shipped one).
        tree: tree for branching methods listed without ``@TREE`` (default: each method's own).
        drafter_path: head checkpoint for eagle / eagle2 / eagle3 / medusa (default: the shipped ones).
        draft_vocab: draft vocabulary of eagle / eagle2 / copy / medusa (None: ``methods.DRAFT_VOCAB``, 0: the full vocabulary).
        batch_size: B > 1 decodes B questions at a time (``minispec.batch``; ``hf``: transformers'
            batched ``generate``, left-padded); tokens/s is then the batch's throughput, and
            ``identical`` compares each answer with the question decoded alone (vanilla, greedy).
    Returns:
        {"summary": {method: {...}}, "by_category": {category: {method: {...}}}, "rows": [...]}.
    """
    from ..tokenizer import encode_prompt

    methods = [m.strip() for m in methods]
    specs, sampling = _check(questions, methods, temperature, top_p, batch_size)
    runners, tok, resolved = _runners(specs, [m for m in methods if m in HF_METHODS], model, k, draft_path, pld_k, tree,
                                      drafter_path, batch_size=batch_size, draft_vocab=draft_vocab, sampling=sampling)
    params = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, sampling=sampling)
    warm = encode_prompt(tok, "Hello!")
    for m in methods:  # warm-up: first calls allocate buffers and pick kernels
        if batch_size > 1:
            runners[m]([warm, warm[1:]], dict(params, max_new_tokens=8), [seed, seed])
        else:
            runners[m](warm, dict(params, max_new_tokens=8), seed)
    totals, by_cat, rows = _run_questions(questions, methods, runners, tok, params, seed, batch_size, progress)

    def summarise(t: dict[str, _Totals]) -> dict:
        def tps(m):
            return t[m].tokens / t[m].seconds if m in t and t[m].seconds else None
        return {m: t[m].summary(tps("hf"), tps("vanilla")) for m in methods}

    return dict(summary=summarise(totals), by_category={c: summarise(t) for c, t in by_cat.items()}, rows=rows,
                settings=dict(model=model, methods=list(methods), max_new_tokens=max_new_tokens, temperature=temperature,
                              top_p=top_p, k=k, pld_k=pld_k, draft=str(draft_path) if draft_path else "shipped",
                              tree=str(tree) if tree else "default", auto=resolved.get("auto"),
                              drafter=str(drafter_path) if drafter_path else "shipped",
                              seed=seed, questions=len(questions), threads=torch.get_num_threads(),
                              batch_size=batch_size,
                              identical_to="each question alone, vanilla greedy" if batch_size > 1 else "vanilla"))


def _check(questions, methods, temperature, top_p, batch_size) -> tuple[list[MethodSpec], SamplingParams]:
    """Every argument checked before anything loads; minispec's methods parsed and the sampling
    parameters built (once)."""
    sampling = SamplingParams(temperature, 0, top_p)
    specs = parse_methods(methods)  # raises on an unknown method or tree
    if len(set(methods)) != len(methods):
        raise ValueError(f"a method is listed twice: {methods}")
    if not questions:
        raise ValueError("no questions to run")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if batch_size > 1 and {"hf_assisted", "hf_pld"} & set(methods):
        raise ValueError("hf_assisted and hf_pld generate one sequence at a time (transformers); bench them at "
                         "--batch-size 1")
    return specs, sampling


def _run_questions(questions, methods, runners, tok, params, seed, batch_size, progress):
    """Every method on every question (batch of questions), who goes first rotating: per-method and
    per-category totals and one row per question."""
    from tqdm.auto import tqdm

    from ..tokenizer import encode_prompt

    totals = {m: _Totals() for m in methods}
    by_cat: dict[str, dict[str, _Totals]] = {}
    rows = []
    batches = [questions[i:i + batch_size] for i in range(0, len(questions), batch_size)]
    bar = tqdm(total=len(questions), desc="bench" if batch_size == 1 else f"bench (batches of {batch_size})",
               disable=not progress)
    for i, qs in enumerate(batches):
        ids = [encode_prompt(tok, q["prompt"]) for q in qs]
        seeds = [seed + i * batch_size + j for j in range(len(qs))]
        order = list(methods[i % len(methods):]) + list(methods[:i % len(methods)])  # rotate who goes first
        results, refs = _run_batch(runners, order, ids, params, seeds, batch_size)
        for q, x, ref, j in zip(qs, ids, refs, range(len(qs))):
            cat = by_cat.setdefault(q["category"], {m: _Totals() for m in methods})
            row = dict(question_id=q["question_id"], category=q["category"], prompt_tokens=len(x))
            for m in methods:
                tokens, seconds, stats = results[m][j]
                same = ref is not None and tokens == ref
                totals[m].add(tokens, seconds, stats, same)
                cat[m].add(tokens, seconds, stats, same)
                row[m] = dict(new_tokens=len(tokens), seconds=seconds, identical=same,
                              tau=stats.tau if stats is not None else None)
            rows.append(row)
        bar.update(len(qs))
    bar.close()
    return totals, by_cat, rows


def _run_batch(runners, order, ids, params, seeds, batch_size):
    """({method: [(answer, seconds, stats) per question]}, the reference answer of each question)."""
    if batch_size == 1:
        results = {m: [runners[m](ids[0], params, seeds[0])] for m in order}
        return results, [results["vanilla"][0][0] if "vanilla" in results else None]
    batch = {m: runners[m](ids, params, seeds) for m in order}  # (answers, seconds, stats) per method
    results = {m: [(a, s / len(ids), st) for a, st in zip(answers, stats)]  # the batch's time, shared
               for m, (answers, s, stats) in batch.items()}
    return results, [runners["_alone"](x, params, None)[0] for x in ids]


BENCH_COLUMNS = [Col("category", width=16, left=True), Col("method", width=12, left=True), Col("tok/s", ".1f", 7),
                 Col("vs hf", width=6), Col("vs van", width=6), Col("tau", ".2f", 5), Col("identical", width=9),
                 Col(" acceptance by position", left=True)]


def format_table(result: dict) -> str:
    """The summary and per-category tables as text."""
    methods = result["settings"]["methods"]

    def ratio(x):
        return f"{x:.2f}x" if x is not None else None

    sampled = result["settings"].get("temperature", 0.0) > 0  # then answers follow p's law, not vanilla's tokens

    def block(name, summ):
        return [[name, m, s["tokens_per_s"], ratio(s["speedup"]), ratio(s.get("vs_vanilla")), s["tau"],
                 "-" if sampled else f"{s['identical']}/{s['n']}",
                 " " + " ".join(f"{a:.2f}" for a in s["acceptance_by_position"])]
                for m, s in ((m, summ[m]) for m in methods)]

    rows = block("ALL", result["summary"])
    for c, summ in result["by_category"].items():
        rows += block(c, summ)
    note = ["identical: not compared when sampling (each method's answers follow the target's law, checked by "
            "python -m minispec exactness; their tokens differ from vanilla's)"] if sampled else []
    return "\n".join(text_table(BENCH_COLUMNS, rows) + note)
