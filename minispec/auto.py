"""The tree dispatcher: choose the draft tree (or chain, or no speculation) for this machine.

Whether a bigger tree pays depends on the hardware. A tree of N nodes raises tau, the tokens
committed per target forward, but the verify forward of N + 1 tokens costs more than a forward
of one, and more so as the batch grows and the GPU (or CPU) leaves its memory-bound regime.
The dispatcher measures both sides on the user's machine (``minispec.lab.tune``, an explicit lab step:
``python -m minispec calibrate`` once, ``tune`` at length) and predicts, for each candidate c:

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

This module is the runtime's half: the cost model, the choice among measured candidates, and what ``auto``
means here: the saved choice for this machine, model, thread count, batch size and sampling, else
``DEFAULT_AUTO``. It never times anything and never writes a file.

Reference: Tang et al. (Meta), "Efficient Speculative Decoding for Llama at Scale: Challenges
and Solutions" (2025), section 3.4 (choosing the tree by batch size from measured costs).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch

from .config import cache_dir, cpu_tag, file_tag
from .drafters.defaults import DEFAULT_AUTO, DEFAULT_CANDIDATES, HEAD_DTYPE_PROBE, QUICK_CANDIDATES  # noqa: F401  (the table's)
from .methods import MethodSpec, Methods, parse_method
from .sampling import GREEDY, SamplingParams

DEFAULT_SIZES = (0, 1, 2, 4, 8, 12, 16, 24, 32, 48, 64)  # tree sizes N of the verify-cost curve ``tune`` measures


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
    calibration_s: float | None = None  # wall time of a quick calibration (``lab.calibrate.quick_tune``); None for tune
    drafters: str | None = None  # registry.shipped_fingerprint of the checkpoints it measured (save_choice)
    params: SamplingParams = GREEDY  # how the calibration decoded: greedy, or sampled (seeded)
    head_dtype: str | None = None  # the EAGLE-1/2 head's dtype the candidates drafted in (a HEAD_DTYPES key); None: target's
    head_dtype_s: dict = field(default_factory=dict)  # {dtype: seconds of one HEAD_DTYPE_PROBE draft} when timed
    quick: list[str] | None = None  # a quick calibration's candidate list (``quick_tune``); None for tune

    def as_dict(self) -> dict:
        d = asdict(self)
        d["cost_curve"] = {str(b): {str(n): s for n, s in c.items()} for b, c in self.cost_curve.items()}
        return d


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
    return cache_dir(create=False) / "tune" / f"{model_name}-{machine_key()}-b{batch_size}{sampling_tag(params)}.json"


def saved_choice(model_name: str, batch_size: int = 1, params: SamplingParams = GREEDY) -> dict | None:
    """The saved tuning result for this machine, model, thread count, batch size and sampling, or None when
    there is none or it was measured with other shipped checkpoints than these (a release with a new head), or
    it is a quick calibration over another candidate list than ``QUICK_CANDIDATES`` (a release that changed
    the list): a stale choice is not a choice."""
    from .drafters.defaults import shipped_fingerprint

    path = tune_path(model_name, batch_size, params)
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    if saved.get("calibration_s") is not None and saved.get("quick") != list(QUICK_CANDIDATES):
        return None
    return saved if saved.get("drafters", "") == shipped_fingerprint(model_name) else None


def auto_method(model_name: str = "smollm2-135m", batch_size: int = 1, strict: bool = False,
                params: SamplingParams = GREEDY) -> str:
    """The method ``tune`` (or ``calibrate``'s quick one) chose on this machine with the
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


def resolve_auto(model_name: str = "smollm2-135m", batch_size: int = 1,
                 params: SamplingParams = GREEDY) -> tuple[str, str]:
    """What ``auto`` means here: the saved choice for this machine, model, thread count, batch size and sampling
    (greedy, or ``params``: each temperature is calibrated on its own), else ``DEFAULT_AUTO``. Nothing is
    measured here: ``python -m minispec calibrate`` (which ``make demo`` runs once) or ``tune`` saves a choice.

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
    if path.exists():  # saved, but stale (``saved_choice``): say why
        old = json.loads(path.read_text())
        why = "its last calibration ran other candidates" if old.get("calibration_s") is not None and \
            old.get("quick") != list(QUICK_CANDIDATES) else "its last calibration measured other shipped heads"
    else:
        why = "no calibration saved for this machine"
    flags = (f" --batch-size {batch_size}" if batch_size != 1 else "") + _tune_flags(params)
    command = f"python -m minispec {'tune' if batch_size != 1 else 'calibrate'}{flags}"
    return DEFAULT_AUTO, f"auto = {DEFAULT_AUTO} (minispec's default{at}: {why}; {command} measures it)"


def resolve(spec: "str | MethodSpec", methods: Methods, batch_size: int = 1, say=print,
            params: SamplingParams = GREEDY) -> MethodSpec:
    """The one resolution of a method that ``demo`` and ``bench`` share: a parsed method as it is,
    ``auto`` as this machine's choice for decoding by ``params`` (``resolve_auto``; ``say`` tells the choice)."""
    spec = parse_method(spec)
    if spec.base != "auto":
        return spec
    name, line = resolve_auto(methods.model_name, batch_size, params)
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
