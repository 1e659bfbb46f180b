"""The tree dispatcher: choose the draft tree (or chain, or no speculation) for this machine.

Whether a bigger tree pays depends on the hardware. A tree of N nodes raises tau, the tokens
committed per target forward, but the verify forward of N + 1 tokens costs more than a forward
of one, and more so as the batch grows and the GPU (or CPU) leaves its memory-bound regime.
The dispatcher measures both sides on the user's machine and predicts, for each candidate c:

    tokens/s (per sequence) = tau_c / (t_verify(N_c, batch) + t_draft(c) + t_loop(c))

    t_verify(N, b)  measured: one target forward of N + 1 new tokens with a tree mask, after a
                    context of ``context`` tokens, batch b (the cost curve ``tune`` prints),
                    averaged over the tree sizes c actually proposed (prompt lookup, say, often
                    proposes nothing)
    t_draft(c)      measured: the "draft" phase of c's decode steps in a calibration run, per step
                    (``GenerationStats.phase_s``, the breakdown ``python -m minispec profile``
                    reports)
    tau_c           measured: new tokens per decode step in the same calibration run, decoded
                    greedily or at the sampling parameters asked for (``params``): a drafter's
                    tokens are accepted as they match the argmax when greedy, but with probability
                    min(1, p/q) when sampled, so a copied token (q one-hot) fares worse sampled than
                    a head's proposal and the choice can differ (each setting is saved on its own)
    t_loop(c)       measured: the other phases but the target forward, per step (sampling and
                    verification, KV compaction, the feature hand-off, Python): each method pays
                    its own, so a cheap drafter with a costly loop is not flattered

and picks the best. Before the candidates run, the EAGLE-1/2 head is timed drafting in float32 and in
bfloat16 (``head_dtype_costs``): a draft only proposes, so its dtype changes its cost and perhaps its
acceptance, never the output, and which dtype is faster depends on the CPU (bfloat16 halves the bytes a
one-row draft reads, which is what it waits for; without native bfloat16 the products also convert). Every
EAGLE-1/2 candidate then drafts in the faster one (``NAME+bf16`` where that is bfloat16), so the choice does
not cost a second set of candidates. At batch 1 the prediction differs from the decode speed the calibration run
measured only by the cost curve's t_verify against the forwards that run timed (both are
reported); the cost curve carries it to the batch size asked for. The calibration
runs are interleaved (every candidate on prompt 1, then every candidate on prompt 2, ...) so that
the drift of a shared machine hits every candidate alike. Vanilla decoding (tau 1, no draft) is
always a candidate, so the choice is never slower than no speculation by the model's own account.

Reference: Tang et al. (Meta), "Efficient Speculative Decoding for Llama at Scale: Challenges
and Solutions" (2025), section 3.4 (choosing the tree by batch size from measured costs).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import torch

from .config import cache_dir, cpu_tag, file_tag
from .drafters.base import Features
from .drafters.registry import DEFAULT_AUTO, DEFAULT_CANDIDATES, HEAD_DTYPE_PROBE, QUICK_CANDIDATES  # noqa: F401  (the table's)
from .kv import KVCache
from .methods import HEAD_DTYPES, MethodSpec, Methods, parse_method, with_head_dtype
from .sampling import GREEDY, SamplingParams
from .tree import Tree

DEFAULT_SIZES = (0, 1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


@dataclass
class CandidateResult:
    method: str
    nodes: int  # mean tree size N (draft tokens verified per step)
    tau: float  # new tokens per target forward, prefill included (as ``bench`` reports it)
    step_tokens: float  # new tokens per decode step (prefill excluded): the cost model's tau
    draft_s: float  # per step
    verify_s: float  # t_verify(N, batch) from the cost curve, averaged over the steps' tree sizes
    loop_s: float  # the rest of this method's step: its phases but draft and target, per step
    predicted_tok_s: float
    calibration_tok_s: float  # what the calibration run itself measured (batch 1, prefill included)
    prompts: int = 0  # calibration prompts it ran (fewer than the others: raced out or cut by the budget, ``_calibrate``)


@dataclass
class TuneResult:
    model: str
    batch_size: int
    context: int
    cost_curve: dict  # {batch: {N: seconds}}
    candidates: list[CandidateResult] = field(default_factory=list)
    choice: str = "vanilla"
    skipped: dict = field(default_factory=dict)  # method -> why it could not run
    calibration_s: float | None = None  # wall time of a quick calibration (resolve_auto); None for tune
    drafters: str | None = None  # registry.shipped_fingerprint of the checkpoints it measured (save_choice)
    params: SamplingParams = GREEDY  # how the calibration decoded: greedy, or sampled (seeded)
    head_dtype: str | None = None  # the EAGLE-1/2 head's dtype the candidates drafted in (a HEAD_DTYPES key); None: target's
    head_dtype_s: dict = field(default_factory=dict)  # {dtype: seconds of one HEAD_DTYPE_PROBE draft} when timed
    quick: list[str] | None = None  # a quick calibration's candidate list (``quick_tune``); None for tune

    def as_dict(self) -> dict:
        d = asdict(self)
        d["cost_curve"] = {str(b): {str(n): s for n, s in c.items()} for b, c in self.cost_curve.items()}
        return d


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


def interpolate(curve_b: dict, n: int) -> float:
    """t_verify at tree size n from a measured curve {N: seconds} (linear between points)."""
    xs = sorted(curve_b)
    if n <= xs[0]:
        return curve_b[xs[0]]
    for a, b in zip(xs, xs[1:]):
        if n <= b:
            return curve_b[a] + (curve_b[b] - curve_b[a]) * (n - a) / (b - a)
    a, b = xs[-2], xs[-1]  # extrapolate the last segment
    return curve_b[b] + (curve_b[b] - curve_b[a]) * (n - b) / (b - a)


def predicted_tokens_per_s(tau: float, verify_s: float, draft_s: float, loop_s: float = 0.0) -> float:
    """The dispatcher's cost model: tokens per second of one sequence (floats, or tensors with one
    entry per candidate)."""
    step_s = verify_s + draft_s + loop_s
    if bool((torch.as_tensor(step_s) <= 0).any()):
        raise ValueError(f"a decode step must take positive time, got verify {verify_s} + draft {draft_s} + loop {loop_s} s")
    return tau / step_s


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

    from .generate import generate

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


def choose(candidates: list) -> str:
    """The method with the best predicted tokens/s among the candidates that ran the most calibration prompts
    (those a race or the time budget left behind were compared on fewer) and vanilla, whose step costs the same
    on every prompt (it runs on the first only when racing)."""
    most = max(c.prompts for c in candidates)
    return max((c for c in candidates if c.prompts == most or c.method == "vanilla"),
               key=lambda c: c.predicted_tok_s).method


def _candidate(c: str, m: dict, curve_b: dict) -> CandidateResult:
    """One candidate's row from its calibration sums ``m`` (over ``m["prompts"]`` prompts) and the cost curve."""
    n = m["prompts"]
    steps = max(m["forwards"], 1)
    sizes = m["nodes"] or [0]
    draft_s = m["draft_s"] / steps
    verify_s = sum(interpolate(curve_b, k) for k in sizes) / len(sizes)
    loop_s = (m["decode_s"] - m["draft_s"] - m["target_s"]) / steps  # the measured phases (module docstring)
    step_tokens = m["tokens"] / steps
    return CandidateResult(c, round(sum(sizes) / len(sizes)), (m["tokens"] + n) / (m["forwards"] + n), step_tokens,
                           draft_s, verify_s, loop_s, predicted_tokens_per_s(step_tokens, verify_s, draft_s, loop_s),
                           (m["tokens"] + n) / m["total_s"], n)


def machine_key() -> str:
    """The machine a calibration holds for: the GPU's name, or the CPU's model, its vector instruction set and
    torch's thread count (``config.cpu_tag``)."""
    return file_tag(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else cpu_tag()


def sampling_tag(params: SamplingParams = GREEDY) -> str:
    """'' for greedy, else the sampling parameters as a file-name part ('-T0.7', '-T1-k50-p0.9')."""
    if params.greedy:
        return ""
    return f"-T{params.temperature:g}" + (f"-k{params.top_k}" if params.top_k else "") + \
        (f"-p{params.top_p:g}" if params.top_p < 1 else "")


def tune_path(model_name: str, batch_size: int = 1, params: SamplingParams = GREEDY):
    return cache_dir() / "tune" / f"{model_name}-{machine_key()}-b{batch_size}{sampling_tag(params)}.json"


def save_choice(r: TuneResult):
    from .drafters.registry import shipped_fingerprint

    r.drafters = shipped_fingerprint(r.model)
    path = tune_path(r.model, r.batch_size, r.params)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(r.as_dict(), indent=2) + "\n")
    return path


def saved_choice(model_name: str, batch_size: int = 1, params: SamplingParams = GREEDY) -> dict | None:
    """The saved tuning result for this machine, model, thread count, batch size and sampling, or None when
    there is none or it was measured with other shipped checkpoints than these (a release with a new head), or
    it is a quick calibration over another candidate list than ``QUICK_CANDIDATES`` (a release that changed
    the list): a stale choice is not a choice."""
    from .drafters.registry import shipped_fingerprint

    path = tune_path(model_name, batch_size, params)
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    if saved.get("calibration_s") is not None and saved.get("quick") != list(QUICK_CANDIDATES):
        return None
    return saved if saved.get("drafters", "") == shipped_fingerprint(model_name) else None


def auto_method(model_name: str = "smollm2-135m", batch_size: int = 1, strict: bool = False,
                params: SamplingParams = GREEDY) -> str:
    """The method ``tune`` (or ``resolve_auto``'s quick calibration) chose on this machine with the
    shipped checkpoints (``saved_choice``); without one, ``DEFAULT_AUTO`` (the method table's). Nothing
    is measured here. ``strict``: raise FileNotFoundError instead of falling back to the default."""
    saved = saved_choice(model_name, batch_size, params)
    if saved is None:
        if strict:
            raise FileNotFoundError(f"no tuning result for {model_name} at batch {batch_size} with the shipped "
                                    f"checkpoints on this machine ({tune_path(model_name, batch_size, params)}); "
                                    f"run: python -m minispec tune --model {model_name} --batch-size {batch_size}"
                                    + _tune_flags(params))
        return DEFAULT_AUTO
    return saved["choice"]


QUICK_SIZES = (0, 1, 2, 3, 4, 5, 8, 12)


QUICK_PROMPTS = 3  # quick_tune's calibration prompts at most: the first of ``prompts.calibration_set``
QUICK_RACE = 0.7  # quick_tune races: after each prompt, a candidate predicted below 0.7 x the best runs no more
QUICK_BUDGET_S = 30.0  # quick_tune's wall time: a next prompt starts only if it is predicted to end within it
QUICK_REPS = 3  # quick_tune's timed repetitions per tree size of the cost curve


def quick_tune(target, tok, model_name: str = "smollm2-135m", candidates=None, prompts: int = QUICK_PROMPTS,
               max_new_tokens: int = 32, methods=None, progress: bool = False,
               budget_s: float | None = QUICK_BUDGET_S, params: SamplingParams = GREEDY) -> TuneResult:
    """``tune`` within about ``budget_s`` seconds: the verify-cost curve over a few tree sizes, then the
    candidates (and vanilla) on up to ``prompts`` of minispec's own prompts, the first a request that
    reuses its input (``prompts.calibration_set``; never a benchmark's), racing (``QUICK_RACE``). Every
    candidate runs the first prompt; a next prompt runs for those predicted to end it within the budget,
    the best predicted first (``_within``), so a slow machine calibrates on fewer prompts rather than for
    longer (the first prompt alone can overrun it on a very slow one). candidates: default
    ``QUICK_CANDIDATES``; params: decode them greedily (default) or sampled."""
    from .prompts import calibration_set

    calib = calibration_set(prompts)
    candidates = list(QUICK_CANDIDATES if candidates is None else candidates)
    t0 = time.perf_counter()
    r = tune(target, tok, calib, model_name, candidates, max_new_tokens=max_new_tokens, context=128,
             sizes=QUICK_SIZES, methods=methods, progress=progress, race=QUICK_RACE, budget_s=budget_s, reps=QUICK_REPS,
             params=params)
    r.calibration_s, r.quick = time.perf_counter() - t0, candidates
    return r


def resolve_auto(target, tok, model_name: str = "smollm2-135m", batch_size: int = 1, methods=None,
                 say=None, params: SamplingParams = GREEDY) -> tuple[str, str]:
    """What ``auto`` means here: the saved choice for this machine, model, thread count, batch size and
    sampling (greedy, or ``params``: each temperature is calibrated once on its own), else a quick
    calibration (``quick_tune``, batch 1) made now and saved for next time, announced first through
    ``say`` when given.

    Returns:
        (method, one line that says what was chosen and how).
    """
    path = tune_path(model_name, batch_size, params)
    saved = saved_choice(model_name, batch_size, params)
    at = "" if params.greedy else f" at {describe_sampling(params)}"
    if saved is not None:
        how = f"calibrated on this machine in {saved['calibration_s']:.0f} s" if saved.get("calibration_s") else \
            "chosen by python -m minispec tune on this machine"
        return saved["choice"], f"auto = {saved['choice']} ({how}{at}; {path})"
    if batch_size != 1:
        return DEFAULT_AUTO, (f"auto = {DEFAULT_AUTO} (minispec's default: run python -m minispec tune --batch-size "
                              f"{batch_size}{_tune_flags(params)} to measure this batch size)")
    if say is not None:
        stale = ""
        if path.exists():  # saved, but stale (``saved_choice``): say why
            old = json.loads(path.read_text())
            stale = " (its last calibration ran other candidates)" if old.get("calibration_s") is not None and \
                old.get("quick") != list(QUICK_CANDIDATES) else " (its last calibration measured other shipped heads)"
        say(f"calibrating 'auto' for this machine{at}{stale} (once, about {QUICK_BUDGET_S:.0f} s) ...")
    r = quick_tune(target, tok, model_name, methods=methods, params=params)
    save_choice(r)
    best = next(c for c in r.candidates if c.method == r.choice)
    base = next(c for c in r.candidates if c.method == "vanilla")
    return r.choice, (f"auto = {r.choice} (calibrated now on this machine{at} in {r.calibration_s:.0f} s: predicted "
                      f"{best.predicted_tok_s / base.predicted_tok_s:.2f}x vanilla; saved to {path})")


def resolve(spec: "str | MethodSpec", methods: Methods, tok, batch_size: int = 1, say=print,
            params: SamplingParams = GREEDY) -> MethodSpec:
    """The one resolution of a method that ``demo`` and ``bench`` share: a parsed method as it is,
    ``auto`` as this machine's choice for decoding by ``params`` (``resolve_auto``; ``say`` announces a
    calibration and the choice)."""
    spec = parse_method(spec)
    if spec.base != "auto":
        return spec
    name, line = resolve_auto(methods.target, tok, methods.model_name, batch_size, methods=methods, say=say,
                              params=params)
    say(line)
    return parse_method(name)


def describe_sampling(params: SamplingParams) -> str:
    """'temperature 0.7, top-p 0.9': the sampling a calibration decoded with, in words."""
    return f"temperature {params.temperature:g}" + (f", top-k {params.top_k}" if params.top_k else "") + \
        (f", top-p {params.top_p:g}" if params.top_p < 1 else "")


def _tune_flags(params: SamplingParams) -> str:
    """The ``python -m minispec tune`` flags that calibrate for ``params`` ('' for greedy)."""
    if params.greedy:
        return ""
    return f" --temperature {params.temperature:g}" + (f" --top-k {params.top_k}" if params.top_k else "") + \
        (f" --top-p {params.top_p:g}" if params.top_p < 1 else "")
