"""What ``python -m minispec tune`` prints and asks: the cost curve and candidate table of a
``dispatch.TuneResult`` as text, and the calibration prompts it runs on. The dispatcher itself
(``minispec.auto``) measures and chooses; this is its report."""

from __future__ import annotations

from ..auto import HEAD_DTYPE_PROBE, TuneResult, describe_sampling
from .text_table import Col, text_table

TUNE_COLUMNS = [Col("method", width=18, left=True), Col("N", "d", 3), Col("tau", ".2f", 5), Col("tok/step", ".2f"),
                Col("draft ms", ".1f"), Col("verify ms", ".1f"), Col("loop ms", ".1f"), Col("predicted tok/s", ".1f"),
                Col("calibration tok/s", ".1f"), Col("prompts", "d"), Col("", left=True)]


def format_tune(r: TuneResult) -> str:
    """The cost curve, the candidate table and the choice as text."""
    sizes = sorted(next(iter(r.cost_curve.values())))
    lines = [f"verify cost: one target forward of N+1 tokens after {r.context} cached tokens (ms)"]
    lines += text_table([Col("batch", "d")] + [Col(f"N={n}", ".1f", 7) for n in sizes],
                        [[b] + [c[n] * 1e3 for n in sizes] for b, c in r.cost_curve.items()], indent="  ")
    if r.head_dtype_s:
        timed = ", ".join(f"{d} {s * 1e3:.2f} ms" for d, s in r.head_dtype_s.items())
        lines += ["", f"EAGLE-1/2 head, one draft of {HEAD_DTYPE_PROBE} after a target forward: {timed}; the candidates "
                      f"draft in {r.head_dtype}"]
    lines += ["", f"candidates at batch {r.batch_size}:"]
    rows = [[c.method, c.nodes, c.tau, c.step_tokens, c.draft_s * 1e3, c.verify_s * 1e3, c.loop_s * 1e3, c.predicted_tok_s,
             c.calibration_tok_s, c.prompts, " <- choice" if c.method == r.choice else ""]
            for c in sorted(r.candidates, key=lambda c: -c.predicted_tok_s)]
    lines += text_table(TUNE_COLUMNS, rows, indent="  ")
    lines.append("  (tau: tokens per target forward, prefill included; tok/step: per decode step, the model's tau;")
    lines.append("   prompts: calibration prompts run; fewer than the most: vanilla (its step is the same on every prompt),")
    lines.append("   raced out as a clear loser, or left behind when a quick calibration's time budget ran short; the")
    lines.append("   choice is the best predicted of those that ran the most prompts, and vanilla)")
    for m, why in r.skipped.items():
        lines.append(f"  {m:<16} skipped: {why}")
    sampled = "" if r.params.greedy else f" (calibrated sampled: {describe_sampling(r.params)}, seeded)"
    lines.append(f"\nchoice: {r.choice}{sampled}")
    return "\n".join(lines)


def calibration_prompts(limit: int, path=None) -> list[str]:
    """``tune``'s prompts: the questions of the JSONL file ``path`` when one is given (spread over its
    categories), else minispec's calibration set (``prompts.calibration_set``). Never a benchmark's
    unless asked for: a choice tuned on the benchmark that measures it would flatter it."""
    from ..prompts import calibration_set, spec_bench

    if path is not None:
        return [q["prompt"] for q in spec_bench(path, limit=limit)]
    return calibration_set(limit)
