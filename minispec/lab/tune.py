"""The tree dispatcher's measurements (chapter 5): the verify-cost curve, each candidate's tau and draft
cost in calibration runs, and ``tune``, which chooses among them by the cost model of ``minispec.auto``.

A lab step, never run by the runtime: ``python -m minispec tune`` runs it at length, and
``python -m minispec calibrate`` (``minispec.lab.calibrate``, which ``make demo`` runs once) runs its quick
form; the choice is saved where ``minispec.auto.saved_choice`` reads it (``save_choice``). The calibration
runs are interleaved (every candidate on prompt 1, then every candidate on prompt 2, ...) so that the drift
of a shared machine hits every candidate alike.

Shapes: B batch, N tree nodes, H hidden.
"""

from __future__ import annotations

import json
import time

import torch

from ..auto import DEFAULT_CANDIDATES, DEFAULT_SIZES, TuneResult, _candidate, choose, tune_path
from ..drafters.base import Features
from ..drafters.defaults import HEAD_DTYPE_PROBE
from ..kv import KVCache
from ..methods import HEAD_DTYPES, Methods, with_head_dtype
from ..sampling import GREEDY, SamplingParams
from ..tree import Tree


@torch.inference_mode()
def verify_cost_curve(target, sizes=DEFAULT_SIZES, batch_sizes=(1,), context: int = 256, reps: int = 7) -> dict:
    """Seconds of one target forward of N + 1 tokens (a chain-shaped tree with an explicit tree
    mask, as a tree verification runs) after ``context`` cached tokens.

    Repetitions are interleaved over the sizes (so drift of a shared machine hits every size alike),
    each size keeps its fastest repetition (noise only ever adds time), and the curve is made
    non-decreasing in N (verifying more tokens never costs less).

    Returns:
        {batch: {N: seconds}}.
    """
    g = torch.Generator().manual_seed(0)
    curve = {}
    dev = target.device
    sizes = sorted(sizes)
    for b in batch_sizes:
        kv = KVCache.for_model(target, capacity=context + max(sizes) + 1, batch_size=b)
        prefix = torch.randint(0, target.cfg.vocab_size, (b, context), generator=g).to(dev)
        target(prefix, kv=kv, last_logits_only=True)
        kv.commit()
        inputs = {}
        for n in sizes:
            tree = Tree.chain(list(range(n)))
            tokens = torch.randint(0, target.cfg.vocab_size, (b, n + 1), generator=g).to(dev)
            inputs[n] = (tokens, tree.positions(context).to(dev), tree.mask().to(dev))
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for r in range(reps + 1):  # the first round is a warm-up
            for n in sizes:
                tokens, pos, mask = inputs[n]
                t = time.perf_counter()
                target(tokens, positions=pos, mask=mask, kv=kv)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                if r:
                    times[n].append(time.perf_counter() - t)
                kv.discard()
        best, curve[b] = 0.0, {}
        for n in sizes:
            best = max(best, min(times[n]))  # fastest repetition, then non-decreasing in N
            curve[b][n] = best
    return curve


def head_dtype_costs(target, methods: Methods, context: int = 128, reps: int = 4) -> dict[str, float]:
    """Seconds of one draft of ``HEAD_DTYPE_PROBE`` (the EAGLE-1/2 head, a chain of two) with the head in each
    dtype of ``HEAD_DTYPES``, after ``context`` tokens; {} when the head does not load (no checkpoint for
    this model).

    As in decoding, each draft runs right after a one-row target forward, which streams the target's weights
    through the caches (a draft timed alone in a loop would find a small head still cached, and flatter the
    smaller dtype); the dtypes are interleaved and each keeps its fastest of ``reps`` repetitions. The
    features are random: the head's products cost the same whatever the values."""
    try:
        drafters = {d: methods.drafter(HEAD_DTYPE_PROBE if t == target.dtype else with_head_dtype(HEAD_DTYPE_PROBE, d))
                    for d, t in HEAD_DTYPES.items()}  # the target's dtype: the plain name's head, loaded once
    except (FileNotFoundError, ValueError, ImportError):
        return {}
    with torch.inference_mode():  # not while building: a head's prepacked weights must not be inference tensors
        return _time_drafts(target, drafters, context, reps)


def _time_drafts(target, drafters: dict, context: int, reps: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    dev = target.device
    tokens = torch.randint(0, target.cfg.vocab_size, (context + 1,), generator=g).tolist()
    feats = Features(torch.randn(context, target.cfg.d_model, generator=g).to(dev, target.dtype))  # at tokens[:-1]
    kv = KVCache.for_model(target, capacity=context + 1)
    target(torch.tensor([tokens[:context]], device=dev), kv=kv, last_logits_only=True)
    kv.commit()
    one = torch.tensor([tokens[-1:]], device=dev)
    times: dict[str, list[float]] = {d: [] for d in drafters}
    for d in drafters.values():
        d.prefill(tokens, feats)
    for r in range(reps + 1):  # the first round is a warm-up
        for name, d in drafters.items():
            target(one, kv=kv, last_logits_only=True)  # a decode step's weights through the caches
            kv.discard()
            t = time.perf_counter()
            d.propose(GREEDY, d.max_nodes)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if r:
                times[name].append(time.perf_counter() - t)
    return {name: min(ts) for name, ts in times.items()}


def tune(target, tok, prompts: list[str], model_name: str = "smollm2-135m", candidates=DEFAULT_CANDIDATES,
         batch_size: int = 1, max_new_tokens: int = 64, context: int = 256, sizes=DEFAULT_SIZES, methods=None,
         progress: bool = True, race: float | None = None, budget_s: float | None = None, reps: int = 7,
         params: SamplingParams = GREEDY, seed: int = 0, head_dtype: str = "auto") -> TuneResult:
    """Measure the cost curve and each candidate's tau and draft cost; choose the best predicted one.

    Args:
        target, tok: the target model and tokenizer.
        prompts: calibration prompts (generations of ``max_new_tokens``, decoded by ``params``).
        candidates: method names (``minispec.methods``); those whose checkpoint is missing are skipped.
        batch_size: the batch size to choose for (the verify cost is measured at 1 and at this size).
        methods: a ``minispec.methods.Methods`` (default: one built for ``target`` and ``model_name``).
        race: None (every candidate on every prompt), or a fraction: after each prompt, the candidates
            predicted below ``race`` x the best so far run no further prompts (``_calibrate``).
        budget_s: None, or seconds of wall time (from the call, cost curve included): every candidate runs
            the first prompt, then a next prompt runs for the candidates predicted to end it within the budget,
            the best predicted first (``_calibrate``).
        reps: timed repetitions per tree size of the cost curve.
        params: the sampling parameters to choose for (default greedy); sampled calibrations are seeded,
            prompt i with ``seed + i`` for every candidate.
        head_dtype: the dtype the EAGLE-1/2 candidates draft in: "auto" (a float32 target: the faster of
            ``head_dtype_costs``, timed first), a key of ``HEAD_DTYPES``, or "target" (the target's, as a
            plain name does). A candidate that names its dtype (``eagle+bf16``) keeps it.
    Returns:
        TuneResult with the cost curve, one row per candidate and the choice.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not prompts:
        raise ValueError("tune needs at least one calibration prompt")
    if race is not None and not 0 < race <= 1:
        raise ValueError(f"race must be a fraction in (0, 1], got {race}")
    if budget_s is not None and not budget_s > 0:
        raise ValueError(f"budget_s must be positive seconds, got {budget_s}")
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    if head_dtype not in ("auto", "target", *HEAD_DTYPES):
        raise ValueError(f"head_dtype must be 'auto', 'target' or one of {', '.join(HEAD_DTYPES)}, got {head_dtype!r}")
    t0 = time.perf_counter()
    methods = methods or Methods(target, model_name)
    curve = verify_cost_curve(target, sizes, sorted({1, batch_size}), context, reps)
    result = TuneResult(model_name, batch_size, context, curve, params=params)
    if head_dtype == "auto" and target.dtype == torch.float32:  # a bf16 target's head is bf16 already
        result.head_dtype_s = head_dtype_costs(target, methods, context)
        head_dtype = min(result.head_dtype_s, key=result.head_dtype_s.get) if result.head_dtype_s else "target"
    if head_dtype in HEAD_DTYPES:
        result.head_dtype = head_dtype
        if HEAD_DTYPES[head_dtype] != target.dtype:  # plain names draft in the target's dtype already
            candidates = list(dict.fromkeys(with_head_dtype(c, head_dtype) for c in candidates))
    drafters = _build(methods, ["vanilla"] + [c for c in candidates if c != "vanilla"], result.skipped)
    deadline = None if budget_s is None else t0 + budget_s
    runs = _calibrate(target, tok, prompts, drafters, max_new_tokens, progress, curve[batch_size], race, deadline,
                      params, seed)
    result.candidates = [_candidate(c, m, curve[batch_size]) for c, m in runs.items()]
    result.choice = choose(result.candidates)
    return result


def _build(methods, candidates, skipped: dict) -> dict:
    """{candidate: drafter} for those that load; the others go to ``skipped`` with the reason."""
    drafters = {}
    for c in candidates:
        try:
            drafters[c] = methods.drafter(c)
        except (FileNotFoundError, ValueError, ImportError) as e:
            skipped[c] = f"{type(e).__name__}: {e}"
    return drafters


def _calibrate(target, tok, prompts, drafters: dict, max_new_tokens: int, progress: bool, curve_b: dict,
               race: float | None = None, deadline: float | None = None, params: SamplingParams = GREEDY,
               seed: int = 0) -> dict:
    """Generations decoded by ``params`` (prompt i seeded ``seed + i``), interleaved (every candidate on a
    prompt, then the next prompt): per candidate the summed decode-step tokens, forwards, phase times, tree
    sizes and prompts.

    With ``race`` (a fraction) and the cost curve ``curve_b``, the calibration races: after each prompt,
    a candidate whose prediction so far is below ``race`` x the best one's runs no further prompts (its row
    keeps the prompts it ran), and vanilla, whose step is one token without a draft on every prompt, runs
    on the first prompt only. A loser is seldom close: what racing saves is the time spent confirming it.

    With ``deadline`` (a ``time.perf_counter()`` value), every candidate runs the first prompt, and a next
    prompt starts only for the candidates predicted to finish it by the deadline (each taking as long as on
    the prompt before): all of them, else the best predicted so far that fit, if two or more do
    (``_within``): a slow machine calibrates on fewer prompts, not for longer, and spends what is left on
    the contenders."""
    from tqdm.auto import tqdm

    from ..generate import generate

    runs = {c: dict(tokens=0, forwards=0, decode_s=0.0, total_s=0.0, draft_s=0.0, target_s=0.0, nodes=[], prompts=0)
            for c in drafters}
    active = list(drafters)
    bar = tqdm(total=len(prompts) * len(drafters), desc="tune", disable=not progress)
    for i, p in enumerate(prompts):
        last_s = {}
        for c in active:
            t = time.perf_counter()
            s = generate(target, tok, p, drafter=drafters[c], max_new_tokens=max_new_tokens, params=params,
                         seed=seed + i).stats
            last_s[c] = time.perf_counter() - t
            m = runs[c]
            m["tokens"] += s.new_tokens - 1  # the prefill's token is not a decode step's
            m["forwards"] += s.target_forwards - 1
            m["decode_s"] += s.decode_s
            m["total_s"] += s.total_s
            m["draft_s"] += s.phase_s["draft"]
            m["target_s"] += s.phase_s["target"]
            m["nodes"] += s.nodes
            m["prompts"] += 1
            bar.update()
        if race is not None and i + 1 < len(prompts) and active:
            predicted = {c: _candidate(c, runs[c], curve_b).predicted_tok_s for c in active}
            best = max(predicted.values())
            active = [c for c in active if c != "vanilla" and predicted[c] >= race * best]
        if deadline is not None and i + 1 < len(prompts):
            active = _within(active, last_s, deadline - time.perf_counter(), runs, curve_b)
        bar.total = bar.n + (len(prompts) - i - 1) * len(active)
        if not active:
            break
    bar.close()
    return runs


def _within(active: list, last_s: dict, left_s: float, runs: dict, curve_b: dict) -> list:
    """The candidates that run the next prompt with ``left_s`` seconds of budget left, each predicted to take as
    long as on the prompt before: all of them if they fit; else the best predicted so far, as many as fit, when
    that is at least two (one alone would learn nothing about the choice, which is made among the candidates
    that ran the most prompts); else none."""
    if sum(last_s[c] for c in active) <= left_s:
        return active
    ranked = sorted(active, key=lambda c: _candidate(c, runs[c], curve_b).predicted_tok_s, reverse=True)
    n = 0
    while n < len(ranked) and sum(last_s[c] for c in ranked[:n + 1]) <= left_s:
        n += 1
    return ranked[:n] if n >= 2 else []


def save_choice(r: TuneResult):
    """Write a tuning result where ``dispatch.saved_choice`` reads it (the choice ``auto`` then means here)."""
    from ..drafters.defaults import shipped_fingerprint

    r.drafters = shipped_fingerprint(r.model)
    path = tune_path(r.model, r.batch_size, r.params)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(r.as_dict(), indent=2) + "\n")
    return path


