"""The end-to-end decode bench of ``tools/gpu_check.sh`` (section ``smollm2``): methods x eager / graphed x dtypes.

On a GPU: the real SmolLM2-135M (carried to the machine, ``minispec.lab.carry``), batch 1, greedy, each of
``vanilla``, ``eagle``, ``eagle2`` and ``copy`` decoded eagerly and through CUDA graphs (``generate(...,
cuda_graphs=True)``), in bfloat16 and float32 (TF32 off), on minispec's own prompts and a Spec-Bench subset.
Per configuration it reports tokens/s (wall time of ``generate``, prefill and graph captures included),
decode tokens/s, tau, the phases of a decode step (``GenerationStats.phase_s``, CUDA events on a GPU) and how
many greedy answers equal eager vanilla's in the same dtype. GPU kernels are not row-invariant, so an answer
may differ where a near-tie of the top two logits breaks another way in a forward over more rows: the count
is reported, not claimed. Per dtype, the ratios the GPU targets name: graphed over eager vanilla, each method
over vanilla in the same mode, and the bound tau x vanilla step / (draft + target per step) beside it
(``cost_check.predicted_speedup``, which refuses a bound above tau).

A configuration that fails (a method that cannot run graphed yet, say) is recorded with its error and
skipped for the rest of the run; the others go on. Prompts are run in order, every configuration on a
prompt before the next prompt (who goes first rotates), until the dtype's share of the deadline.

The dry run (``tools/gpu_check.sh --dry-run``, CI) runs the same function on the CPU with the tiny Llama and
a random EAGLE head written in the official layout, at a few tokens: every line, no figure of a GPU.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from ..generate import add_by_depth

METHODS = ("vanilla", "eagle", "eagle2", "copy")
MODES = ("eager", "graphed")
DTYPES = ("bfloat16", "float32")


class _Totals:
    def __init__(self):
        self.prompts = self.new_tokens = self.forwards = self.steps = 0
        self.wall_s = self.prefill_s = self.decode_s = 0.0
        self.phase_s: dict[str, float] = {}
        self.tested, self.accepted = [], []
        self.identical = 0

    def add(self, r, wall_s: float) -> None:
        s = r.stats
        self.prompts += 1
        self.new_tokens += s.new_tokens
        self.forwards += s.target_forwards
        self.steps += len(s.tokens_per_step) - 1
        self.wall_s += wall_s
        self.prefill_s += s.prefill_s
        self.decode_s += s.decode_s
        for k, v in s.phase_s.items():
            self.phase_s[k] = self.phase_s.get(k, 0.0) + v
        add_by_depth(self.tested, s.tested_at_depth)
        add_by_depth(self.accepted, s.accepted_at_depth)

    def summary(self) -> dict:
        steps = max(self.steps, 1)
        return dict(prompts=self.prompts, new_tokens=self.new_tokens, wall_s=self.wall_s, prefill_s=self.prefill_s,
                    decode_s=self.decode_s,
                    tokens_per_s=self.new_tokens / self.wall_s if self.wall_s else None,
                    decode_tokens_per_s=(self.new_tokens - self.prompts) / self.decode_s if self.decode_s else None,
                    tau=self.new_tokens / self.forwards if self.forwards else None,
                    step_ms=1e3 * self.decode_s / steps, phase_ms_per_step={k: 1e3 * v / steps for k, v in self.phase_s.items()},
                    identical_to_eager_vanilla=f"{self.identical}/{self.prompts}")


def run(load_model: Callable, make_methods: Callable, prompt_sets: dict[str, list[str]], max_new_tokens: int,
        deadline: float, dtypes=DTYPES, methods=METHODS, modes=MODES, warmup_tokens: int = 8) -> dict:
    """Bench every (dtype, mode, method) on every prompt (see the module doc).

    Args:
        load_model: dtype name -> (target, tokenizer) on the bench's device.
        make_methods: target -> ``minispec.methods.Methods`` (its ``drafter(name)``).
        prompt_sets: {set name: prompts (text)}; each set is reported apart and together.
        deadline: ``time.perf_counter()`` after which no new prompt starts; each dtype gets an equal share of
            what is left when it starts.
    Returns:
        dict(rows={dtype: {mode: {method: summary}}}, by_set (the same per prompt set), ratios, errors,
        skipped (prompts past the deadline), answers={dtype: {set: [{"mode/method": new tokens}] per prompt}}).
    """
    from ..generate import generate
    from ..tokenizer import encode_prompt

    configs = [(mode, m) for mode in modes for m in methods]
    rows, by_set, ratios, errors, skipped, answers = {}, {}, {}, [], [], {}
    for di, dtype in enumerate(dtypes):
        share = deadline if di == len(dtypes) - 1 else \
            time.perf_counter() + (deadline - time.perf_counter()) / (len(dtypes) - di)
        failed: dict[tuple[str, str], str] = {}
        try:
            model, tok = load_model(dtype)
            table = make_methods(model)
        except Exception as e:  # noqa: BLE001  (the other dtype may still run)
            errors.append(dict(dtype=dtype, error=f"loading: {type(e).__name__}: {e}"[:400]))
            continue
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32; bf16 matmuls are unaffected
        try:
            drafters = {}
            for m in methods:
                try:
                    drafters[m] = table.drafter(m)
                except Exception as e:  # noqa: BLE001
                    for mode in modes:
                        failed[(mode, m)] = f"drafter: {type(e).__name__}: {e}"[:400]
            warm = encode_prompt(tok, "Hello!")
            for mode, m in configs:  # warm-up: kernels, autotuning, lazy initialisation (not timed)
                if (mode, m) in failed:
                    continue
                try:
                    generate(model, tok, warm, drafter=drafters[m], max_new_tokens=warmup_tokens,
                             cuda_graphs=mode == "graphed")
                except Exception as e:  # noqa: BLE001
                    failed[(mode, m)] = f"{type(e).__name__}: {e}"[:400]
            totals = {c: _Totals() for c in configs}
            sets = {name: {c: _Totals() for c in configs} for name in prompt_sets}
            tokens = {}
            i = 0
            for set_name, prompts in prompt_sets.items():
                for prompt in prompts:
                    if time.perf_counter() > share:
                        skipped.append(dict(dtype=dtype, set=set_name, prompt=prompt[:60]))
                        continue
                    ids = encode_prompt(tok, prompt)
                    order = configs[i % len(configs):] + configs[:i % len(configs)]  # who goes first rotates
                    i += 1
                    got = {}
                    for c in order:
                        if c in failed:
                            continue
                        mode, m = c
                        try:
                            t = time.perf_counter()
                            r = generate(model, tok, ids, drafter=drafters[m], max_new_tokens=max_new_tokens,
                                         cuda_graphs=mode == "graphed")
                            got[c] = (r, time.perf_counter() - t)
                        except Exception as e:  # noqa: BLE001
                            failed[c] = f"{type(e).__name__}: {e}"[:400]
                    ref = got.get(("eager", "vanilla"))
                    for c, (r, wall) in got.items():
                        for agg in (totals[c], sets[set_name][c]):
                            agg.add(r, wall)
                            agg.identical += ref is not None and r.tokens == ref[0].tokens
                    tokens.setdefault(set_name, []).append({f"{mode}/{m}": r.tokens for (mode, m), (r, _) in got.items()})
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        rows[dtype] = {mode: {m: totals[(mode, m)].summary() for m in methods} for mode in modes}
        by_set[dtype] = {s: {mode: {m: sets[s][(mode, m)].summary() for m in methods} for mode in modes} for s in sets}
        ratios[dtype] = _ratios(rows[dtype], methods, modes)
        errors += [dict(dtype=dtype, mode=mode, method=m, error=e) for (mode, m), e in failed.items()]
        answers[dtype] = tokens
        del model, table, drafters
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return dict(rows=rows, by_set=by_set, ratios=ratios, errors=errors, skipped=skipped, answers=answers)


def _ratios(rows: dict, methods, modes) -> dict:
    """Graphed over eager vanilla; each method over vanilla in the same mode (tokens/s), with the bound."""
    from .cost_check import predicted_speedup

    def tps(mode, m):
        return rows.get(mode, {}).get(m, {}).get("tokens_per_s")

    out = {}
    if tps("eager", "vanilla") and tps("graphed", "vanilla"):
        out["graphed_vanilla_over_eager_vanilla"] = tps("graphed", "vanilla") / tps("eager", "vanilla")
    for mode in modes:
        van = rows.get(mode, {}).get("vanilla", {})
        for m in methods:
            r = rows.get(mode, {}).get(m, {})
            if m == "vanilla" or not r.get("tokens_per_s") or not van.get("tokens_per_s"):
                continue
            ph = r["phase_ms_per_step"]
            bound, why = (None, "no steps") if not r.get("tau") else predicted_speedup(
                r["tau"], (ph.get("draft", 0.0) + ph.get("target", 0.0)) / van["step_ms"])
            out[f"{mode}/{m}"] = dict(over_vanilla=r["tokens_per_s"] / van["tokens_per_s"], tau=r["tau"],
                                      bound=bound, bound_refused=why)
    return out
