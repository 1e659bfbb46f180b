"""The machine's calibration, once, in one announced step: which prepacked CPU kernel the exact backend runs
(and how far it pads a one-row call), and what ``auto`` means for SmolLM2 at this thread count.

    python -m minispec calibrate        (``make demo`` runs it when this machine has no calibration yet)

1. The kernel (``calibrate_kernels``): ``CHOICE_LAYERS`` decoder layers of SmolLM2's shapes (random weights,
   about 113 MB per kernel's copy: more than a CPU's last-level cache, so they stream from memory as a decode
   step's do), each kernel under the row recipe its probe chooses on this CPU (``minispec.exact.recipes``), at
   ``CHOICE_ROWS`` rows (a decode step, verifications of a few draft tokens), the kernels interleaved round by
   round, the fastest round of each kept; the lower sum over the row counts wins. Saved with an exclusive
   create where ``minispec.exact.kernels`` reads it, so that every later process on the machine computes the
   same bits. It runs before the model loads, so the model loads on the chosen kernel.
2. ``auto`` (``quick_tune``): ``minispec.lab.tune.tune`` within about ``QUICK_BUDGET_S`` seconds on a few of
   minispec's own prompts, saved where ``minispec.auto.saved_choice`` reads it.

The runtime only reads what this writes (or uses the documented defaults: ``exact.kernels.DEFAULT_KERNEL``,
``dispatch.DEFAULT_AUTO``). ``python -m minispec tune`` is the long calibration of ``auto``; delete a saved
file to measure it again (or ``calibrate --force``).
"""

from __future__ import annotations

import time

import torch

from ..auto import QUICK_CANDIDATES, TuneResult, saved_choice, tune_path
from ..exact.linear import ExactLinear
from ..exact.kernels import CPU_KERNELS, choice_path, machine_tag, onednn_available, read_choice, write_once
from ..sampling import GREEDY, SamplingParams
from .tune import save_choice, tune

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
    from ..prompts import calibration_set

    calib = calibration_set(prompts)
    candidates = list(QUICK_CANDIDATES if candidates is None else candidates)
    t0 = time.perf_counter()
    r = tune(target, tok, calib, model_name, candidates, max_new_tokens=max_new_tokens, context=128,
             sizes=QUICK_SIZES, methods=methods, progress=progress, race=QUICK_RACE, budget_s=budget_s, reps=QUICK_REPS,
             params=params)
    r.calibration_s, r.quick = time.perf_counter() - t0, candidates
    return r




def calibrate_kernels(force: bool = False) -> dict:
    """This machine's kernel record at the running thread count: the saved one, else timed now
    (``time_kernels``) and saved with an exclusive create (a process that timed it at the same moment and
    wrote first decides for both). Without oneDNN there is nothing to choose: the panels, nothing timed or saved."""
    if not onednn_available():
        return {"kernel": "panels", "machine": machine_tag(), "why": "this PyTorch build has no oneDNN linear"}
    path = choice_path()
    saved = read_choice(path)
    if saved is not None and not force:
        return saved
    if force:
        path.unlink(missing_ok=True)
    return write_once(path, time_kernels())


def needs_calibration(model_name: str = "smollm2-135m", params: SamplingParams = GREEDY) -> bool:
    """Whether this machine, at the running thread count, lacks a saved kernel choice (where there is one to
    make) or a saved ``auto`` for ``model_name`` decoding by ``params``."""
    kernel = onednn_available() and read_choice(choice_path()) is None
    return kernel or saved_choice(model_name, 1, params) is None


def announce(model_name: str = "smollm2-135m", params: SamplingParams = GREEDY) -> str:
    """The one line that says what ``calibrate`` does, before it does it."""
    at = "" if params.greedy else f" at temperature {params.temperature:g}"
    n = torch.get_num_threads()
    return (f"calibrating this machine once at {n} thread{'s' * (n > 1)}: the faster linear kernel (seconds), "
            f"then 'auto' for {model_name}{at} (a budget of about {QUICK_BUDGET_S:.0f} s); saved under "
            f"{choice_path().parent.parent} and read by every later run ...")


def calibrate(model_name: str = "smollm2-135m", params: SamplingParams = GREEDY, force: bool = False,
              model=None) -> tuple:
    """Both steps: the kernel first (before the model loads), then ``auto`` on the model (``model``: a
    ``(Transformer, tokenizer)`` already loaded on the chosen kernel; default ``load(model_name)``).

    Returns:
        (kernel record, TuneResult or None where a saved ``auto`` was kept, (model, tokenizer)).
    """
    from .. import load

    kernel = calibrate_kernels(force)
    target, tok = model if model is not None else load(model_name)
    r = None
    if force or saved_choice(model_name, 1, params) is None:
        r = quick_tune(target, tok, model_name, params=params)
        save_choice(r)
    return kernel, r, (target, tok)


def summary(kernel: dict, r: TuneResult | None, model_name: str = "smollm2-135m",
            params: SamplingParams = GREEDY) -> list[str]:
    """What ``calibrate`` found, in two lines."""
    lines = [f"linear kernel: {kernel['kernel']}" + (f" (one-row calls padded to {kernel['pad_rows'][kernel['kernel']]} "
             "rows)" if kernel.get("pad_rows", {}).get(kernel["kernel"], 1) > 1 else "") + f"; {choice_path()}"]
    if r is None:
        lines.append(f"auto = {saved_choice(model_name, 1, params)['choice']} (kept; {tune_path(model_name, 1, params)})")
    else:
        best = next(c for c in r.candidates if c.method == r.choice)
        base = next(c for c in r.candidates if c.method == "vanilla")
        lines.append(f"auto = {r.choice} (calibrated in {r.calibration_s:.0f} s: predicted "
                     f"{best.predicted_tok_s / base.predicted_tok_s:.2f}x vanilla; {tune_path(model_name, 1, params)})")
    return lines


# ---- the kernel timing

CHOICE_SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # SmolLM2's qkv, out, gate_up, down
CHOICE_LAYERS = 8
CHOICE_ROWS = (1, 4, 8)
CHOICE_ROUNDS = 5
PAD_CANDIDATES = (1, 2, 4, 6, 8)  # rows a one-row call may be padded to, the fastest kept per kernel (``pad_rows``)


@torch.no_grad()
def time_kernels(shapes=CHOICE_SHAPES, layers: int = CHOICE_LAYERS, rows=CHOICE_ROWS, rounds: int = CHOICE_ROUNDS,
                 kernels=None) -> dict:
    """Time each prepacked kernel over ``layers`` x ``shapes`` random weights, interleaved, fastest of ``rounds``
    rounds (after one untimed round): what ``calibrate_kernels`` saves once per machine for "auto".
    First a one-row call padded to each of PAD_CANDIDATES rows (at least its row recipe's): a kernel may compute
    a few rows sooner than one (``benchmarks/linear_kernel_decode.py`` measures what that gives a decode), and
    its rows' bits do not depend on the row count, so the fastest is that kernel's ``pad_rows``. Then each row
    count in ``rows`` under the row recipe with that padding.

    Returns:
        {"kernel": the lower sum over ``rows``, "machine", "times_ms": {kernel: {rows: ms}},
         "pad_rows": {kernel: rows}, "pad_ms": {kernel: {rows padded to: ms}},
         "recipes": {kernel: {"in->out": recipe}}, "rows", "layers", "measured_at"}.
    """
    with torch.inference_mode(False):  # called from inside inference mode too: its tensors keep no version
        return _time_kernels(shapes, layers, rows, rounds, tuple(kernels or CPU_KERNELS))


def _time_kernels(shapes, layers: int, rows, rounds: int, kernels: tuple[str, ...]) -> dict:
    g = torch.Generator().manual_seed(0)
    stack = []
    for _ in range(layers):
        for n_in, n_out in shapes:
            layer = ExactLinear(n_in, n_out, bias=False).requires_grad_(False)
            layer.weight.copy_(torch.randn(n_out, n_in, generator=g) * n_in ** -0.5)
            stack.append(layer)
    recipes = {k: {} for k in kernels}
    runs = {k: [] for k in kernels}  # (layer, its recipe's (kernel, split, min_rows, multiple))
    for k in kernels:
        for layer in stack:
            recipe = layer.row_recipe(layer.weight.new_zeros(1, layer.in_features), kernel=k)
            how = (k, recipe.split, recipe.min_rows, recipe.multiple) if recipe.invariant else (k, 1, 1, 1)
            recipes[k][f"{layer.in_features}->{layer.out_features}"] = recipe.describe()
            for part in ((None,) if how[1] == 1 else (0, 1)):  # the prepacked copy, built before timing
                (layer.panel_weight if k == "panels" else layer.onednn_weight)(part)
            runs[k].append((layer, how))
    xs = {m: {n_in: torch.randn(m, n_in, generator=g) for n_in in {s[0] for s in shapes}} for m in {1, *rows}}

    def fastest(counts: dict, runs_of) -> dict:  # {kernel: {count: best seconds}} over interleaved rounds
        best = {k: {c: float("inf") for c in counts[k]} for k in kernels}
        for r in range(rounds + 1):  # the first round is a warm-up
            for k in kernels:
                for c in counts[k]:
                    x, layer_runs = runs_of(k, c)
                    t = time.perf_counter()
                    for layer, how in layer_runs:
                        layer.run(x[layer.in_features], *how)
                    if r:
                        best[k][c] = min(best[k][c], time.perf_counter() - t)
        return best

    def padded(k, pad):  # kernel k's runs with one-row calls padded to ``pad`` rows (at least its recipe's)
        return [(layer, (how[0], how[1], max(how[2], pad), how[3])) for layer, how in runs[k]]

    def candidates(k) -> list[int]:  # PAD_CANDIDATES less those that pad no layer beyond a smaller one's padding
        seen, keep = set(), []
        for pad in PAD_CANDIDATES:
            config = tuple(max(how[2], pad) for _, how in runs[k])
            if config not in seen:
                seen.add(config)
                keep.append(pad)
        return keep

    pad_s = fastest({k: candidates(k) for k in kernels}, lambda k, pad: (xs[1], padded(k, pad)))
    pad_ms = {k: {str(c): round(t * 1e3, 3) for c, t in pad_s[k].items()} for k in kernels}
    pad_rows = {k: int(min(pad_ms[k], key=pad_ms[k].get)) for k in kernels}
    best = fastest({k: rows for k in kernels}, lambda k, m: (xs[m], padded(k, pad_rows[k])))
    times_ms = {k: {str(m): round(best[k][m] * 1e3, 3) for m in rows} for k in kernels}
    # chosen on the recorded times, so that the record shows why: two kernels whose sums differ by less than the
    # rounding can no longer be recorded in one order and chosen in the other
    return {"kernel": min(kernels, key=lambda k: sum(times_ms[k].values())), "machine": machine_tag(),
            "times_ms": times_ms, "pad_rows": pad_rows, "pad_ms": pad_ms,
            "recipes": recipes, "rows": list(rows), "layers": layers, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
