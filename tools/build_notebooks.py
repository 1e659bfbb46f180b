#!/usr/bin/env python3
"""Write notebooks/NN_*.ipynb from cell sources: chapters 1-2 below, later ones in tools/notebooks/nbNN_*.py.

    python tools/build_notebooks.py           write the notebooks (no outputs, execution_count null)
    python tools/build_notebooks.py --check   exit 1 if the committed notebooks differ from this script

Edit the notebooks here, not in Jupyter, so that the committed JSON stays output-free and
reviewable. Run them with ``MINISPEC_FAST=1 python -m pytest --nbmake notebooks/0*.ipynb``.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "notebooks"


def md(s: str):
    return new_markdown_cell(textwrap.dedent(s).strip("\n"))


def code(s: str):
    return new_code_cell(textwrap.dedent(s).strip("\n"))


# --------------------------------------------------------------------------- shared cells
SETUP = code('''
    # Versions and FAST mode.
    import os, platform
    
    import torch
    import minispec
    from minispec import config
    
    FAST = config.fast()  # MINISPEC_FAST=1: smaller sample counts and shorter generations (CI sets it)
    print(f"python {platform.python_version()} | torch {torch.__version__} | minispec {minispec.__version__}")
    print(f"FAST mode: {'on' if FAST else 'off'} (MINISPEC_FAST={os.environ.get('MINISPEC_FAST', '')!r})")
    print(f"Hugging Face hub reachable: {minispec.models.hub_reachable()}")
''')

LOAD_GPT2 = code('''
    from minispec.sampling import SamplingParams, probs
    from minispec.tokenizer import encode_prompt
    
    def load_pair():
        """GPT-2 target + DistilGPT-2 draft when a hub or cache has them, else the seeded tiny GPT-2 presets."""
        try:
            return ("gpt2", "distilgpt2"), minispec.load("gpt2"), minispec.load("distilgpt2")
        except (minispec.ModelNotFound, OSError) as e:
            print(f"gpt2 / distilgpt2 are not available here ({type(e).__name__}); "
                  "using the tiny presets instead: tiny-gpt2 (target) and tiny-gpt2-draft (draft)")
            return ("tiny-gpt2", "tiny-gpt2-draft"), minispec.load("tiny-gpt2"), minispec.load("tiny-gpt2-draft")
    
    (target_name, draft_name), (gpt_target, gpt_tok), (gpt_draft, _) = load_pair()
    print(f"target: {target_name} ({gpt_target.cfg.n_layer} layers, vocab {gpt_target.cfg.vocab_size}); "
          f"draft: {draft_name} ({gpt_draft.cfg.n_layer} layers)")
    
    params = SamplingParams(temperature=1.0, top_k=32)  # q is processed exactly like p
    ids = encode_prompt(gpt_tok, "The quick brown fox", chat=False)
    with torch.inference_mode():
        p_full = probs(gpt_target(torch.tensor([ids])).logits[0, -1].double(), params)  # [V]
        q_full = probs(gpt_draft(torch.tensor([ids])).logits[0, -1].double(), params)  # [V]
    support = ((p_full > 0) | (q_full > 0)).nonzero().flatten()  # tokens either model can emit
    p_lm, q_lm = p_full[support], q_full[support]  # [V_eff]: exact, nothing outside has mass
    print(f"next-token distributions after {len(ids)} prompt tokens, {params}: "
          f"|supp p ∪ supp q| = {len(support)}, alpha = sum min(p, q) = {vf.acceptance_rate(p_lm, q_lm).item():.3f}")
''')


def timing_cell(drafters: str) -> str:
    return code(f'''
    import platform
    from minispec import generate
    from minispec.drafters import DraftModel, PromptLookup
    
    def cpu_name() -> str:
        try:
            for line in open("/proc/cpuinfo"):
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
        except OSError:
            pass
        return platform.processor() or platform.machine()
    
    smol, smol_tok = minispec.load("smollm2-135m")
    try:
        from minispec.drafters.draft_checkpoint import load_draft_model
        smol_draft = load_draft_model(smol)
    except (ImportError, FileNotFoundError) as e:
        smol_draft = None
        print(f"NOTE: the distilled SmolLM2 draft is not available ({{type(e).__name__}}: {{e}}); "
              "so there is no SpS row; prompt lookup (a model-free drafter, one-hot q) is timed instead.")
    {textwrap.indent(textwrap.dedent(drafters).strip(), "    ").strip()}
    
    n_new = 24 if FAST else 128
    generate(smol, smol_tok, prompt, max_new_tokens=4)  # warm-up (first-call overheads)
    runs = {{"vanilla": generate(smol, smol_tok, prompt, max_new_tokens=n_new)}}
    for name, d in drafters.items():
        runs[name] = generate(smol, smol_tok, prompt, drafter=d, max_new_tokens=n_new)
        assert runs[name].tokens == runs["vanilla"].tokens, f"{{name}}: greedy output differs from vanilla greedy"
    
    print(f"device: this machine's CPU ({{cpu_name()}}), torch threads: {{torch.get_num_threads()}}, no GPU; greedy, "
          f"{{n_new}} new tokens, prompt {{prompt[:60]!r}}")
    print(f"{{'method':<32}} {{'tokens':>6}} {{'target fwd':>10}} {{'tau':>5}} {{'tokens/s':>9}}  acceptance by depth")
    for name, r in runs.items():
        s = r.stats
        acc = " ".join(f"{{a:.2f}}" for a in s.acceptance_by_position)
        print(f"{{name:<32}} {{s.new_tokens:>6}} {{s.target_forwards:>10}} {{s.tau:>5.2f}} {{s.tokens_per_s:>9.1f}}  {{acc}}")
    print("every speculative run emitted exactly the vanilla greedy tokens")
    ''')


CHOOSER_NOTE = """All randomness goes through the `chooser` argument, so the
        grader can enumerate every random outcome of *your* code and compare its exact law with
        the target and with minispec's own implementation."""


def exercises_cells(ch: int, rows: list[tuple[str, str, str]], note: str = CHOOSER_NOTE) -> list:
    table = "\n        ".join(f"| {i} | `{name}` | {task} |" for i, name, task in rows)  # indented like the template
    from minispec.grading import chapter_module
    module = chapter_module(ch).MODULE
    return [
        md(f'''
        ## Exercises

        Implement the functions in `exercises/{module}.py` (generated from `solutions/`; same
        signatures and docstrings). {note}

        | exercise | function | task |
        |---|---|---|
        {table}

        Grade from a terminal with `python -m minispec grade {ch}` or
        `pytest tests/test_exercises.py -m ch{ch:02d} --impl exercises`; in this notebook with
        `check("{ch}.1")` (one exercise) or `check({ch})` (the chapter). The cell below prints
        the stub of the first exercise, then grades your file: it reports failures, it does not
        raise, so until you fill in the stubs every line says "not implemented yet".
        '''),
        code(f'''
        import inspect
        from minispec.grading import check, load_impl
        
        mine = load_impl({ch}, "exercises")
        print(inspect.getsource(mine.{rows[0][1]}))
        check({ch}, impl="exercises")
        '''),
        code(f'''
        # What a finished chapter looks like: the reference answers in solutions/ pass every check.
        check({ch}, impl="solutions")
        '''),
    ]


# --------------------------------------------------------------------------- chapter 1
def chapter1():
    cells = [
        SETUP,
        md(r'''
        # Chapter 1 — Rejection sampling: speculative decoding that is exactly lossless

        A small **draft** model proposes $k$ tokens; the big **target** model scores all of them in
        one forward pass; a rejection-sampling rule keeps a prefix of the drafts and adds one token
        of its own. Done right, the emitted tokens have *exactly* the target's distribution: the
        speedup is free in quality (Leviathan et al. 2023; Chen et al. 2023).

        **Learning objectives**
        1. State the accept/reject rule $\min(1, p(x)/q(x))$ and the residual
           $\mathrm{norm}(\max(0, p - q))$, and prove that the output is exactly $p$.
        2. Derive the expected tokens per target forward $1 + \alpha + \dots + \alpha^k$ and the
           speedup model $\frac{1-\alpha^{k+1}}{(1-\alpha)(kc+1)}$; choose $k$ from $\alpha$ and $c$.
        3. Check losslessness two ways: exact enumeration of every random outcome (error at
           float64 rounding) and the total-variation distance of samples on real models.
        4. Measure $\tau$ (tokens per target forward) and tokens/s of speculative decoding on
           SmolLM2-135M on this CPU.
        5. Implement exercises 1.1–1.5 and grade them.

        **Notation** (used everywhere in minispec): $p$ target distribution, $q$ draft distribution,
        $k$ (gamma) draft length, $\alpha = \sum_x \min(p(x), q(x))$ acceptance rate,
        $\tau$ = mean tokens committed per target forward, bonus included (vanilla = 1.00).
        '''),
        code('''
        import inspect
        
        import matplotlib.pyplot as plt
        import numpy as np
        
        from minispec import exactness as ex
        from minispec import sampling
        from minispec import verify as vf
        
        def show(obj):
            """Print the source of a minispec function (the notebook never redefines library code)."""
            print(inspect.getsource(obj))
        '''),
        md(r'''
        ## 1. One draft token, accepted or not

        Take a tiny vocabulary and two distributions: the target $p$ and the draft $q$. The draft
        proposes $x \sim q$. We accept it with probability $\min\left(1, \frac{p(x)}{q(x)}\right)$:
        always when the target likes $x$ at least as much as the draft does, and in proportion
        $p(x)/q(x)$ when the draft over-proposes it. On rejection we draw a replacement from the
        **residual** $r = \mathrm{norm}(\max(0, p - q))$: only the tokens the draft under-proposed.
        '''),
        code('''
        V = 8
        g = torch.Generator().manual_seed(0)
        p = sampling.probs(1.5 * torch.randn(V, generator=g, dtype=torch.float64), temperature=1.0)  # target [V]
        q = sampling.probs(1.5 * torch.randn(V, generator=g, dtype=torch.float64), temperature=1.0)  # draft  [V]
        alpha = vf.acceptance_rate(p, q).item()
        r = vf.residual(p, q)
        
        print(f"alpha = sum_x min(p, q) = {alpha:.4f}   (P(reject) = {1 - alpha:.4f})")
        print(f"{'x':>2} {'p(x)':>7} {'q(x)':>7} {'accept':>7} {'r(x)':>7}")
        for x in range(V):
            print(f"{x:>2} {p[x]:7.4f} {q[x]:7.4f} {vf.accept_prob(p[x].item(), q[x].item()):7.4f} {r[x]:7.4f}")
        
        fig, ax = plt.subplots(figsize=(8, 3))
        xs = np.arange(V)
        ax.bar(xs - 0.3, p, 0.3, label="target p")
        ax.bar(xs, q, 0.3, label="draft q")
        ax.bar(xs + 0.3, torch.minimum(p, q), 0.3, label="min(p, q): accepted mass", color="tab:green")
        ax.bar(xs + 0.3, (1 - alpha) * r, 0.3, bottom=torch.minimum(p, q), label="(1 - alpha) r: residual mass", color="tab:red")
        ax.set_xlabel("token x"); ax.set_ylabel("probability"); ax.legend(fontsize=8); ax.set_title("accepted + residual = p")
        plt.show()
        '''),
        md(r'''
        ### Why the residual makes the output exactly $p$

        The probability of emitting token $y$ in one step is "draft $y$ and accept it" plus "reject
        whatever was drafted, then draw $y$ from $r$":

        $$
        P(y) \;=\; q(y)\,\min\!\left(1, \frac{p(y)}{q(y)}\right) \;+\; P(\text{reject})\; r(y)
        \;=\; \min\big(p(y), q(y)\big) \;+\; (1-\alpha)\, \frac{\max\big(0, p(y) - q(y)\big)}{\sum_z \max\big(0, p(z)-q(z)\big)} .
        $$

        The rejection probability is $1 - \sum_x q(x)\min(1, p(x)/q(x)) = 1 - \sum_x \min(p(x), q(x)) = 1-\alpha$,
        and the residual's normaliser is $\sum_z \max(0, p(z) - q(z)) = \sum_z \big(p(z) - \min(p(z), q(z))\big) = 1 - \alpha$
        too. They cancel:

        $$
        P(y) = \min(p(y), q(y)) + \max(0, p(y) - q(y)) = p(y). \qquad\blacksquare
        $$

        **$k$ drafts.** Draft $i$ is examined only if drafts $0..i-1$ were accepted, and then the
        same one-step argument applies with $p_i, q_i$ (the distributions after the accepted
        prefix): the token emitted at position $i$ has law $p_i$. If all $k$ are accepted, the
        bonus token is a plain sample from $p_k$. So every committed token has the target's
        conditional law given the tokens before it: the whole sequence has the target's law.

        (If $q(x) = 0$ for a proposed $x$ — impossible when $x \sim q$ — minispec accepts iff
        $p(x) > 0$. If $p = q$ the residual is empty, but then nothing is ever rejected.)

        Drawing the replacement from $p$ instead of $r$ is the classic bug: it gives
        $\min(p, q) + (1-\alpha)p \neq p$.
        '''),
        code('''
        wrong = torch.minimum(p, q) + (1 - alpha) * p
        right = torch.minimum(p, q) + (1 - alpha) * r
        print(f"max |P(y) - p(y)| with the residual:        {(right - p).abs().max().item():.2e}")
        print(f"max |P(y) - p(y)| resampling from p instead: {(wrong - p).abs().max().item():.2e}")
        '''),
        md('''
        The library versions (chapter 1 lives in `minispec/verify.py`). Every random choice goes
        through a `chooser` (`bernoulli(prob)`, `categorical(weights)`), which is what lets us
        enumerate them exactly below.
        '''),
        code('''
        show(vf.accept_prob)
        show(vf.residual)
        show(vf.verify_chain)
        '''),
        md('''
        ### A naive version for teaching

        The same step for one draft, in plain Python floats and lists, so every operation is
        visible. The next cell asserts that it has exactly the same law as the library's
        `verify_chain` with $k = 1$, for every possible draft $x$.
        '''),
        code('''
        def naive_one_draft(x, p, q, chooser):
            """One drafted token x ~ q. Returns (accepted 0/1, emitted token)."""
            p, q = [float(v) for v in p], [float(v) for v in q]
            if chooser.bernoulli(min(1.0, p[x] / q[x])):
                return 1, x
            r = [max(0.0, pi - qi) for pi, qi in zip(p, q)]
            total = sum(r)
            return 0, chooser.categorical(torch.tensor([ri / total for ri in r], dtype=torch.float64))
        '''),
        code('''
        P2, Q1 = torch.stack([p, p]), q[None]  # [2, V] target rows (row 1 = bonus position), [1, V] draft row
        
        def library_one_draft(x, chooser):
            n, nxt = vf.verify_chain([x], P2, Q1, chooser=chooser)
            return n, (x if n else nxt)  # (accepted?, first emitted token)
        
        worst = 0.0
        for x in range(V):
            naive = ex.outcome_distribution(lambda ch: naive_one_draft(x, p, q, ch))
            lib = ex.outcome_distribution(lambda ch: library_one_draft(x, ch))
            worst = max(worst, ex.max_abs_error(naive, lib))
        assert worst <= 1e-12, worst
        print(f"naive == library for every draft x: max abs difference of the exact laws {worst:.1e}")
        '''),
        md('''
        ## 2. An empirical check: sample many speculative steps

        Draw $x \\sim q$, verify it, and record the first emitted token; the histogram should match
        $p$, not $q$. `exactness.empirical_check` reports the total-variation distance and a
        chi-square p-value, and `tv_bound(n, V)` is a bound that the TV of $n$ honest samples
        exceeds with probability at most $10^{-6}$.
        '''),
        code('''
        def spec_first_token(p, q, g):
            x = int(torch.multinomial(q, 1, generator=g))
            n, nxt = vf.verify_chain([x], torch.stack([p, p]), q[None], generator=g)
            return x if n else nxt
        
        N = 5_000 if FAST else 100_000
        res = ex.empirical_check(spec_first_token, p, q, N, torch.Generator().manual_seed(1))
        print(f"{N} speculative steps: TV(empirical, p) = {res['tv']:.4f} (bound {res['tv_bound']:.4f}), "
              f"chi-square p-value {res['p_value']:.3f}")
        assert res["tv"] <= res["tv_bound"]
        
        fig, ax = plt.subplots(figsize=(8, 3))
        ax.bar(xs - 0.2, p, 0.4, label="target p")
        ax.bar(xs + 0.2, np.array(res["counts"]) / N, 0.4, label=f"speculative, {N} samples")
        ax.plot(xs, q, "k_", markersize=20, label="draft q")
        ax.set_xlabel("token"); ax.set_ylabel("frequency"); ax.legend(fontsize=8)
        plt.show()
        '''),
        md(r'''
        ## 3. Exact enumeration: the error is float64 rounding

        Sampling can only bound the error. Because every random choice goes through a chooser,
        `minispec.exactness` can do better: `EnumeratingChooser` replays the *same* verification
        code once per branch (each draft draw, each accept/reject coin, each residual or bonus
        draw), multiplying the probabilities along the way. Summing over all branches gives the
        exact law of the emitted tokens, to compare with the target's.
        '''),
        code('''
        show(ex.EnumeratingChooser)
        show(ex.enumerate_outcomes)
        '''),
        md('''
        A `ToyLM` gives context-dependent $p(\\cdot \\mid \\text{ctx})$ and $q(\\cdot \\mid \\text{ctx})$
        on a tiny vocabulary, with temperature, top-k / top-p truncation, sparse or disjoint
        supports, $p = q$, and a one-hot target. We check the law of the first emitted tokens of
        chains with $k = 1, 2, 3$; then the deliberately wrong verifiers (`exactness.CONTROLS`),
        which must fail.
        '''),
        code('''
        rows = []
        for k in (1, 2, 3):
            program = lambda lm, ctx, ch, k=k: ex.chain_step(lm, ctx, k, ch)
            for setting in ex.SETTINGS:
                lm = ex.ToyLM(3, setting, seed=7)  # V = 3; law of the first 2 emitted tokens
                rows.append((k, setting, ex.enumeration_error(program, False, lm, length=2)))
        print(f"{'k':>2} {'setting':<14} {'max abs error':>14}   (V=3, first 2 emitted tokens)")
        for k, setting, err in rows:
            print(f"{k:>2} {setting:<14} {err:>14.2e}")
        worst = max(r[-1] for r in rows)
        assert worst <= 1e-12
        print(f"\\nworst error over {len(rows)} exact checks: {worst:.2e} (float64 rounding)")
        '''),
        code('''
        lm = ex.ToyLM(6, const=ex.control_pair())
        for name, (program, greedy) in ex.CONTROLS.items():
            err = ex.enumeration_error(program, greedy, lm)
            what = inspect.getdoc(getattr(ex, name)) if hasattr(ex, name) else "the real-q MSS rule on deterministic top-k drafts"
            print(f"{name:<28} error {err:.3f}   {what.removeprefix('WRONG: ')}")
            assert err > 1e-3
        '''),
        md(r'''
        ## 4. How many tokens per step, and how much faster?

        If each draft is accepted independently with probability $\alpha$, draft $i$ is reached
        and accepted with probability $\alpha^{i+1}$, and a step commits the accepted drafts plus
        one token (residual or bonus):

        $$
        \mathbb{E}[\text{tokens per step}] = \sum_{i=0}^{k} \alpha^i = \frac{1-\alpha^{k+1}}{1-\alpha}
        \quad (= k+1 \text{ at } \alpha = 1).
        $$

        With $c$ = (cost of a draft forward) / (cost of a target forward), a step costs $kc + 1$
        target forwards, and plain decoding makes one token per target forward:

        $$
        \text{speedup}(\alpha, k, c) = \frac{1-\alpha^{k+1}}{(1-\alpha)(kc+1)} .
        $$

        This model charges the target the same for $k+1$ tokens as for one (true while decoding
        is memory-bound) and ignores the rest of the overhead. First, an exact check of the
        formula: on a toy model whose $(p, q)$ is the same at every position, acceptance is
        i.i.d. with rate $\alpha$, and the enumerated mean number of emitted tokens must be the
        formula.
        '''),
        code('''
        lm_const = ex.ToyLM(V, const=(p, q))
        for k in (1, 2, 3):
            law = ex.outcome_distribution(lambda ch: ex.chain_step(lm_const, (), k, ch))
            mean_tokens = sum(w * len(out) for out, w in law.items())
            formula = vf.expected_tokens(alpha, k)
            print(f"k={k}: enumerated E[tokens/step] = {mean_tokens:.12f}, formula = {formula:.12f}")
            assert abs(mean_tokens - formula) <= 1e-12
        '''),
        code('''
        alphas = np.linspace(0, 1, 101)
        fig, axs = plt.subplots(1, 3, figsize=(14, 3.6))
        for k in (1, 2, 4, 8):
            axs[0].plot(alphas, vf.expected_tokens(alphas, k), label=f"k={k}")
        axs[0].set(xlabel="acceptance rate alpha", ylabel="expected tokens per step", title="tokens per target forward")
        ks = np.arange(0, 13)
        for a in (0.5, 0.7, 0.8, 0.9):
            axs[1].plot(ks, vf.expected_tokens(a, ks), "o-", markersize=3, label=f"alpha={a}")
        axs[1].set(xlabel="draft length k", ylabel="expected tokens per step", title="diminishing returns in k")
        cs = np.linspace(0, 0.5, 101)
        for k in (1, 2, 4, 8):
            axs[2].plot(cs, vf.speedup(0.8, k, cs), label=f"k={k}")
        axs[2].axhline(1, color="gray", lw=0.8)
        axs[2].set(xlabel="cost ratio c = draft / target", ylabel="speedup", title="speedup at alpha = 0.8")
        for a in axs:
            a.legend(fontsize=8)
        plt.tight_layout(); plt.show()
        
        for a, c in [(0.6, 0.05), (0.8, 0.05), (0.8, 0.2), (0.9, 0.02)]:
            s = vf.speedup(a, ks, c)
            print(f"alpha={a}, c={c}: best k in 0..12 = {ks[s.argmax()]}, speedup {s.max():.2f}x "
                  f"(expected tokens/step {vf.expected_tokens(a, int(ks[s.argmax()])):.2f})")
        '''),
        md('''
        Explore it: the sliders set $\\alpha$, $k$ and $c$. (The widget needs a live Jupyter
        frontend; in a static view, the figure and the table above show fixed settings.)
        '''),
        code('''
        import ipywidgets as widgets
        
        def explore(alpha=0.8, k=4, c=0.1):
            ks = np.arange(0, 13)
            s = vf.speedup(alpha, ks, c)
            fig, ax = plt.subplots(figsize=(6, 3))
            ax.plot(ks, s, "o-")
            ax.plot([k], [vf.speedup(alpha, k, c)], "r*", markersize=14)
            ax.axhline(1, color="gray", lw=0.8)
            ax.set(xlabel="draft length k", ylabel="speedup", title=f"alpha={alpha:.2f}, c={c:.2f}")
            plt.show()
            print(f"k={k}: expected tokens/step {vf.expected_tokens(alpha, k):.3f}, speedup {vf.speedup(alpha, k, c):.3f}x; "
                  f"best k in 0..12: {ks[s.argmax()]} ({s.max():.3f}x)")
        
        widgets.interact(explore,
                         alpha=widgets.FloatSlider(value=0.8, min=0.0, max=1.0, step=0.01),
                         k=widgets.IntSlider(value=4, min=0, max=12),
                         c=widgets.FloatSlider(value=0.1, min=0.0, max=1.0, step=0.01));
        '''),
        md('''
        ## 5. Real models: TV distance against direct target sampling

        The same check on a real target/draft pair: GPT-2 (target) and DistilGPT-2 (draft) when
        the Hugging Face hub or cache provides them; otherwise minispec's seeded tiny GPT-2
        presets (the cell says which it used). We take both models' next-token distributions
        after a prompt (temperature 1, top-k 32, the same processing for $p$ and $q$), restrict
        to the tokens either can emit, and compare speculative first tokens with tokens drawn
        directly from $p$: both TVs should be of the same (sampling-noise) size.
        '''),
        LOAD_GPT2,
        code('''
        def direct_token(p, q, g):
            return int(torch.multinomial(p, 1, generator=g))
        
        N = 4_000 if FAST else 50_000
        g = torch.Generator().manual_seed(2)
        spec = ex.empirical_check(spec_first_token, p_lm, q_lm, N, g)
        direct = ex.empirical_check(direct_token, p_lm, q_lm, N, g)
        print(f"{target_name} target, {draft_name} draft, {N} samples each, V_eff = {len(p_lm)}")
        for name, r in (("speculative (k=1)", spec), ("direct from p", direct)):
            print(f"  {name:<18} TV = {r['tv']:.4f}   bound {r['tv_bound']:.4f}   chi-square p = {r['p_value']:.3f}")
        assert spec["tv"] <= spec["tv_bound"] and direct["tv"] <= direct["tv_bound"]
        
        top = torch.argsort(p_lm, descending=True)[:15]
        def label(t):
            s = gpt_tok.decode([t])
            return repr(s) if s.isprintable() and "\\ufffd" not in s else f"id {t}"
        labels = [label(int(support[i])) for i in top]
        fig, ax = plt.subplots(figsize=(10, 3))
        xs15 = np.arange(len(top))
        ax.bar(xs15 - 0.27, p_lm[top], 0.27, label="target p")
        ax.bar(xs15, np.array(spec["counts"])[top] / N, 0.27, label="speculative (empirical)")
        ax.bar(xs15 + 0.27, q_lm[top], 0.27, label="draft q")
        ax.set_xticks(xs15, labels, rotation=60, fontsize=8); ax.legend(fontsize=8)
        ax.set_title(f"{target_name} / {draft_name}: the 15 most likely next tokens")
        plt.show()
        '''),
        md('''
        ## 6. Timing on SmolLM2-135M (on this CPU)

        Speculative decoding with minispec's distilled SmolLM2 draft against plain decoding of
        the same target, greedy, on this machine's CPU. Greedy verification accepts a draft iff
        it equals the target's argmax, so the outputs must be identical; we assert that. $\\tau$
        and tokens/s are printed, not claimed: on a CPU with a 135M target the draft's own cost
        ($c$ above) is far from negligible, and a short run is noisy.
        '''),
        timing_cell('''
            prompt = "Explain in three sentences why speculative decoding makes LLM inference faster."
            drafters = {"SpS, distilled draft, k=4": DraftModel(smol_draft, k=4)} if smol_draft is not None \\
                else {"prompt lookup, k=4": PromptLookup(k=4)}
        '''),
        *exercises_cells(1, [
            ("1.1", "accept_prob", "$\\min(1, p(x)/q(x))$, including $q(x) = 0$"),
            ("1.2", "residual", "$\\mathrm{norm}(\\max(0, p - q))$ over the last dimension; $p$ if empty"),
            ("1.3", "verify_chain", "accept/reject $k$ drafts in order, residual or bonus token"),
            ("1.4", "expected_tokens", "$1 + \\alpha + \\dots + \\alpha^k$ (careful at $\\alpha = 1$)"),
            ("1.5", "speedup", "expected tokens / $(kc + 1)$"),
        ]),
    ]
    return cells


# --------------------------------------------------------------------------- chapter 2
def chapter2():
    cells = [
        SETUP,
        md(r'''
        # Chapter 2 — Multi-round speculative sampling: several candidates, and trees

        A chain offers the target one guess per position. Offering **several candidates** for the
        same position raises the chance that one of them is right; a **draft tree** does this at
        every depth. Verifying several candidates losslessly needs multi-round speculative
        sampling (MSS, Miao et al. 2023): one Leviathan step per candidate, on a target
        distribution that shrinks to the residual after each rejection.

        **Learning objectives**
        1. Derive MSS for candidates drawn i.i.d. from $q$ (with replacement), and see why each
           round must use the residual of the previous one.
        2. Derive the variant for candidates drawn **without replacement** (recursive rejection
           sampling), where $q$ also changes, and see that mixing the two rules is biased.
        3. Know what **one-hot $q$** assumes (deterministic top-k drafts, as in EAGLE) and why it is
           still exact.
        4. Verify a draft **tree level by level**; see a chain as the degenerate tree.
        5. Check all of them by exact enumeration, and empirically on real models.
        6. Implement exercises 2.1–2.4 and grade them.

        Notation as in chapter 1: $p$ target, $q$ draft, candidates $x_0, \dots, x_{n-1}$ tried in order.
        '''),
        code('''
        import inspect
        
        import matplotlib.pyplot as plt
        import numpy as np
        
        from minispec import exactness as ex
        from minispec import sampling
        from minispec import verify as vf
        
        def show(obj):
            """Print the source of a minispec function (the notebook never redefines library code)."""
            print(inspect.getsource(obj))
        
        V = 6
        g = torch.Generator().manual_seed(0)
        p = sampling.probs(1.5 * torch.randn(V, generator=g, dtype=torch.float64), temperature=1.0)  # target [V]
        q = sampling.probs(1.5 * torch.randn(V, generator=g, dtype=torch.float64), temperature=1.0)  # draft  [V]
        print("p =", [round(v, 3) for v in p.tolist()])
        print("q =", [round(v, 3) for v in q.tolist()])
        print(f"alpha (one candidate) = {vf.acceptance_rate(p, q).item():.4f}")
        '''),
        md(r'''
        ## 1. MSS with replacement: candidates i.i.d. from $q$

        Set $p_0 = p$. Round $i$ is a chapter-1 step of $p_i$ against $q$: accept $x_i$ with
        probability $\min(1, p_i(x_i)/q(x_i))$; on rejection, continue with
        $p_{i+1} = \mathrm{norm}(\max(0, p_i - q))$. If all $n$ candidates are rejected, emit a
        token drawn from $p_n$.

        **Why it is exact.** Let $O_i$ be the law of the token emitted when the procedure is
        entered at round $i$ (with target $p_i$). After the last round $O_n = p_n$ by
        construction. For $i < n$, round $i$ accepts a token $y$ with probability
        $\min(p_i(y), q(y))$ and rejects with probability $1 - \alpha_i$,
        $\alpha_i = \sum_x \min(p_i(x), q(x))$; after a rejection the rest of the procedure emits
        $O_{i+1} = p_{i+1}$ (induction), a fresh candidate $x_{i+1} \sim q$ independent of the
        past. So, exactly as in chapter 1,

        $$
        O_i(y) = \min(p_i(y), q(y)) + (1-\alpha_i)\, \frac{\max(0, p_i(y) - q(y))}{1 - \alpha_i} = p_i(y),
        $$

        and at $i = 0$ the output has law $p$. The residual is essential: without it each round
        would just be a fresh chain-1 step, and rejections would bias toward what $q$ over-proposes.
        '''),
        code('''
        show(vf._mss_replacement)
        '''),
        md('''
        ### A naive version for teaching

        MSS with replacement in plain Python lists; the next cell asserts that the exact joint
        law of (candidates, accepted index, emitted token) equals that of the library's
        `verify_candidates(..., mode="mss_replacement")`, with the candidates themselves drawn
        i.i.d. from $q$ inside the enumeration.
        '''),
        code('''
        def naive_mss(candidates, p, q, chooser):
            p, q = [float(v) for v in p], [float(v) for v in q]
            for i, x in enumerate(candidates):
                if chooser.bernoulli(min(1.0, p[x] / q[x])):
                    return i, x
                r = [max(0.0, a - b) for a, b in zip(p, q)]
                p = [v / sum(r) for v in r] if sum(r) > 0 else p
            return None, chooser.categorical(torch.tensor(p, dtype=torch.float64))
        '''),
        code('''
        def law_of(verifier, n, replacement=True):
            def run(ch):
                xs = vf.sample_candidates(q, n, replacement=replacement, chooser=ch)
                return (tuple(xs), *verifier(xs, ch))
            return ex.outcome_distribution(run)
        
        for n in (1, 2, 3):
            naive = law_of(lambda xs, ch: naive_mss(xs, p, q, ch), n)
            lib = law_of(lambda xs, ch: vf.verify_candidates(xs, p, q, mode="mss_replacement", chooser=ch), n)
            err = ex.max_abs_error(naive, lib)
            assert err <= 1e-12, err
            emitted = {}
            for (_, _, tok), w in lib.items():
                emitted[tok] = emitted.get(tok, 0.0) + w
            target_err = max(abs(emitted.get(x, 0.0) - p[x].item()) for x in range(V))
            print(f"n={n}: naive vs library {err:.1e}; emitted token vs p {target_err:.1e} ({len(lib)} outcomes)")
        '''),
        md(r'''
        ## 2. Without replacement: recursive rejection sampling

        Drawing candidates i.i.d. wastes slots on duplicates. Drawing them **without
        replacement** gives $n$ distinct tokens, but then candidate $i$ comes from
        $q_i$ = $q$ with $x_0..x_{i-1}$ removed and renormalised, not from $q$. The proof above
        goes through if every round uses the distribution its candidate actually came from:
        round $i$ is a Leviathan step of $p_i$ against $q_i$, and after rejecting $x_i$

        $$
        p_{i+1} = \mathrm{norm}(\max(0, p_i - q_i)), \qquad q_{i+1} = \mathrm{norm}(q_i \text{ with } x_i \text{ set to } 0).
        $$

        Given the rejection, $x_{i+1} \sim q_{i+1}$ (the next draw without replacement), so the
        induction step holds with $q_i$ in place of $q$ (Jeon et al. 2024; Yang et al. 2024).
        Note $p_{i+1}(x_i) = 0$: a rejection means $p_i(x_i) < q_i(x_i)$.

        Each rule is exact only for its own way of drawing. The table gives the exact law of the
        emitted token against $p$ ($n = 3$) for each rule with its own drafting, and for distinct
        drafts verified with the i.i.d. rule. (The other mismatch cannot even be run: the
        without-replacement rule refuses repeated candidates, which its drafting cannot produce.)
        '''),
        code('''
        show(vf._mss_no_replacement)
        
        n = 3
        print(f"{'drafting':<22} {'verified with':<20} {'max |law - p|':>14}")
        errors = {}
        for replacement, mode in [(True, "mss_replacement"), (False, "mss_no_replacement"), (False, "mss_replacement")]:
            def run(ch):
                xs = vf.sample_candidates(q, n, replacement=replacement, chooser=ch)
                return vf.verify_candidates(xs, p, q, mode=mode, chooser=ch)[1]
            law = ex.outcome_distribution(run)
            errors[replacement, mode] = err = max(abs(law.get(x, 0.0) - p[x].item()) for x in range(V))
            wrong = "   <- WRONG pairing" if (mode == "mss_replacement") != replacement else ""
            print(f"{'i.i.d. (replacement)' if replacement else 'without replacement':<22} {mode:<20} {err:>14.2e}{wrong}")
        assert errors[True, "mss_replacement"] <= 1e-12 and errors[False, "mss_no_replacement"] <= 1e-12
        assert errors[False, "mss_replacement"] > 1e-6
        '''),
        md(r'''
        ## 3. One-hot $q$: deterministic drafts

        EAGLE's drafts are the **top-k** tokens of the draft model: a deterministic function of
        the context, not samples. There is no $q$ the candidates were "drawn from" — or rather,
        conditional on the context, candidate $x_i$ was drawn from the point mass
        $\mathrm{one\_hot}(x_i)$. Plug that into MSS: round $i$ accepts $x_i$ with probability
        $\min(1, p_i(x_i)/1) = p_i(x_i)$, and the residual
        $\mathrm{norm}(\max(0, p_i - \mathrm{one\_hot}(x_i)))$ is just $p_i$ with $x_i$ removed.

        **What it assumes:** the candidates must not depend on the verifier's random coins
        (they may depend on the context, and they may even be sampled beforehand — the argument
        is conditional on them). Then each round is an exact Leviathan step against a point mass,
        and the output has law $p$. What one-hot $q$ gives up is acceptance: a sampled draft that
        matches $p$ well is accepted with probability $\min(1, p/q)$, a one-hot one only with
        $p(x)$. Using the real-$q$ rule on top-k drafts is wrong (a control below).
        '''),
        code('''
        show(vf._mss_onehot)
        
        def onehot_error(draw, n=3):
            law = ex.outcome_distribution(lambda ch: vf.verify_candidates(draw(ch), p, mode="onehot", chooser=ch)[1])
            return max(abs(law.get(x, 0.0) - p[x].item()) for x in range(V))
        
        topk = torch.argsort(-q, stable=True)[:3].tolist()
        cases = {
            "top-3 of q (EAGLE)": lambda ch: topk,
            "i.i.d. samples of q": lambda ch: vf.sample_candidates(q, 3, chooser=ch),
            "fixed, with a duplicate": lambda ch: [topk[0], topk[0], topk[1]],
        }
        for name, draw in cases.items():
            err = onehot_error(draw)
            print(f"one-hot rule, candidates {name:<26} max |law - p| = {err:.2e}")
            assert err <= 1e-12
        law = ex.outcome_distribution(lambda ch: vf.verify_candidates(topk, p, q, mode="mss_replacement", chooser=ch)[1])
        bad = max(abs(law.get(x, 0.0) - p[x].item()) for x in range(V))
        print(f"real-q rule on the top-3 drafts (WRONG)            max |law - p| = {bad:.2e}")
        assert bad > 1e-6
        '''),
        md(r'''
        ### How much do more candidates help?

        The probability that *some* candidate is accepted at a node, computed exactly by
        enumeration, for each rule (with its own drafting) as the number of candidates grows.
        The draft's temperature changes how well $q$ matches $p$.
        '''),
        code('''
        def p_accept(mode, n, q_draft):
            def run(ch):
                if mode == "onehot":
                    xs = torch.argsort(-q_draft, stable=True)[:n].tolist()
                else:
                    xs = vf.sample_candidates(q_draft, n, replacement=mode == "mss_replacement", chooser=ch)
                return vf.verify_candidates(xs, p, None if mode == "onehot" else q_draft, mode=mode, chooser=ch)[0] is not None
            return ex.outcome_distribution(run).get(True, 0.0)
        
        MODES = ("mss_replacement", "mss_no_replacement", "onehot")
        logits_q = torch.log(q)
        ns = range(1, 4 if FAST else 5)
        fig, axs = plt.subplots(1, 2, figsize=(11, 3.5))
        for ax, temp in zip(axs, (1.0, 0.5)):
            q_t = sampling.probs(logits_q, temperature=temp)
            for mode in MODES:
                ax.plot(list(ns), [p_accept(mode, n, q_t) for n in ns], "o-", label=mode)
            ax.set(xlabel="candidates n", ylabel="P(some candidate accepted)", title=f"draft temperature {temp}",
                   xticks=list(ns))
            ax.legend(fontsize=8)
        plt.tight_layout(); plt.show()
        for mode in MODES:
            print(f"{mode:<20} " + "  ".join(f"n={n}: {p_accept(mode, n, q):.3f}" for n in ns))
        '''),
        code('''
        import ipywidgets as widgets
        
        def explore(n=2, draft_temperature=1.0):
            q_t = sampling.probs(logits_q, temperature=draft_temperature)
            acc = [p_accept(mode, n, q_t) for mode in MODES]
            fig, ax = plt.subplots(figsize=(6, 2.8))
            ax.barh(MODES, acc)
            ax.set(xlim=(0, 1), xlabel="P(some candidate accepted)", title=f"n={n}, draft temperature {draft_temperature:.2f}")
            plt.show()
            print("  ".join(f"{m}: {a:.3f}" for m, a in zip(MODES, acc)))
        
        widgets.interact(explore, n=widgets.IntSlider(value=2, min=1, max=3),
                         draft_temperature=widgets.FloatSlider(value=1.0, min=0.2, max=2.0, step=0.1));
        '''),
        md(r'''
        ## 4. Trees, level by level

        A draft tree gives every node several children. Layout (the same everywhere in minispec):
        nodes $0..N-1$ in topological order, `parents[i]` = $-1$ for a child of the root (the
        last committed token) or an earlier node; `tokens[i]` its token. Row 0 of $p$/$q$ is the
        distribution at the root, row $i+1$ the distribution after node $i$ ("row = node + 1").

        Verification walks down from the root: at the current node, run MSS over its children (in
        index order). If child $c$ is accepted, move to $c$ and repeat with row $c+1$; if none
        is accepted — or the node is a leaf — emit the MSS token (residual, or the bonus token
        from $p$ at a leaf) and stop. Each level is exact given the path so far, so by the same
        induction as chapter 1 the emitted sequence has the target's law. A **chain** is the
        degenerate tree `parents = [-1, 0, 1, ..., k-1]`: one candidate per level, which is
        exactly chapter 1's `verify_chain`.
        '''),
        code('''
        show(vf.verify_tree)
        '''),
        code('''
        from collections import Counter
        
        class BlendLM:
            """Toy setup: a draft that half agrees with the target, q = (p + q_other) / 2, at every context."""
            def __init__(self, base):
                self.base = base
            def p(self, ctx):
                return self.base.p(ctx)
            def q(self, ctx):
                return 0.5 * (self.base.p(ctx) + self.base.q(ctx))
        
        lm = BlendLM(ex.ToyLM(5, "temperature", seed=4))
        parents, tokens, P, Q = ex.draft_tree(lm, (), [2, 2], "no_replacement", vf.TorchChooser(torch.Generator().manual_seed(0)))
        print(f"parents {parents}, tokens {tokens}; p, q rows: {tuple(P.shape)} (row 0 = root, row i+1 = after node i)")
        for i, (j, t) in enumerate(zip(parents, tokens)):
            print(f"  node {i}: token {t}, child of {'the root' if j < 0 else f'node {j}'}")
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            r = vf.verify_tree(parents, tokens, P, Q, mode="mss_no_replacement", generator=g)
            print(f"accepted path {r.path}, next token {r.next_token}, emitted {r.emitted}")
        draws = 2_000
        paths = Counter(tuple(vf.verify_tree(parents, tokens, P, Q, mode="mss_no_replacement", generator=g).path)
                        for _ in range(draws))
        print(f"over {draws} verifications of this tree: " + ", ".join(f"path {list(k)}: {v / draws:.2f}" for k, v in sorted(paths.items())))
        '''),
        md('''
        **A chain is the degenerate tree.** With the same generator state, `verify_tree` on
        `parents = [-1, 0, ..., k-1]` makes the same random choices as `verify_chain`, so the
        outputs are identical draw by draw; and their exact laws agree.
        '''),
        code('''
        k = 3
        lm = ex.ToyLM(4, "top_k", seed=5)
        mismatches = 0
        for seed in range(200):
            g = torch.Generator().manual_seed(seed)
            xs = []
            for _ in range(k):  # draft k tokens, each from q given the drafts before it
                xs += vf.sample_candidates(lm.q(tuple(xs)), 1, generator=g)
            Pc = torch.stack([lm.p(tuple(xs[:i])) for i in range(k + 1)])  # [k+1, V]
            Qc = torch.stack([lm.q(tuple(xs[:i])) for i in range(k)])  # [k, V]
            n, nxt = vf.verify_chain(xs, Pc, Qc, generator=torch.Generator().manual_seed(seed))
            r = vf.verify_tree(list(range(-1, k - 1)), xs, Pc, Qc, mode="chain", generator=torch.Generator().manual_seed(seed))
            mismatches += (len(r.path), r.next_token) != (n, nxt)
        assert mismatches == 0
        chain = ex.sequence_distribution(lambda c, ch: ex.chain_step(lm, c, k, ch), 2)
        tree = ex.sequence_distribution(lambda c, ch: ex.tree_step(lm, c, [1] * k, "chain", ch), 2)
        print(f"200 seeded draws: verify_tree(chain) == verify_chain every time; "
              f"exact laws of 2 tokens differ by {ex.max_abs_error(chain, tree):.1e}")
        '''),
        md('''
        ## 5. Exact enumeration of every rule

        Every rule, on single nodes and on trees, over toy models with different supports; the
        law of the first two emitted tokens (several steps when a step emits one) against the
        target's. Greedy verification is compared with greedy decoding.
        '''),
        code('''
        shapes = {"node n=2": [2], "node n=3": [3], "chain k=2": [1, 1], "tree [2,1]": [2, 1]}
        modes = ("mss_replacement", "mss_no_replacement", "onehot", "greedy")
        settings = ("random", "top_k", "sparse_q") if FAST else ("random", "top_k", "top_p", "sparse_q", "disjoint", "greedy_target")
        table = {}
        for mode in modes:
            for shape_name, branching in shapes.items():
                program = lambda lm, ctx, ch, b=branching, m=mode: ex.tree_step(lm, ctx, b, m, ch)
                errs = [ex.enumeration_error(program, mode == "greedy", ex.ToyLM(3, s, seed=11), length=2) for s in settings]
                table[mode, shape_name] = max(errs)
        print(f"max abs error over settings {settings}, V=3, first 2 tokens")
        print(f"{'mode':<20}" + "".join(f"{s:>14}" for s in shapes))
        for mode in modes:
            print(f"{mode:<20}" + "".join(f"{table[mode, s]:>14.1e}" for s in shapes))
        assert max(table.values()) <= 1e-12
        '''),
        md('''
        ## 6. Real models: MSS at the first position

        The GPT-2 / DistilGPT-2 pair (or the tiny presets when no hub is reachable; the cell says
        which) at the first generated position: $n = 3$ candidates per rule, verified with MSS,
        compared with direct sampling from $p$.
        '''),
        LOAD_GPT2,
        code('''
        def mss_first_token(mode, n=3):
            def draw(p, q, g):
                if mode == "onehot":
                    xs = torch.argsort(-q, stable=True)[:n].tolist()
                else:
                    xs = vf.sample_candidates(q, n, replacement=mode == "mss_replacement", generator=g)
                return vf.verify_candidates(xs, p, None if mode == "onehot" else q, mode=mode, generator=g)[1]
            return draw
        
        N = 4_000 if FAST else 40_000
        g = torch.Generator().manual_seed(3)
        samplers = {m: mss_first_token(m) for m in MODES}
        samplers["direct from p"] = lambda p, q, g: int(torch.multinomial(p, 1, generator=g))
        print(f"{target_name} target, {draft_name} draft, {N} samples each, V_eff = {len(p_lm)}")
        for name, draw in samplers.items():
            r = ex.empirical_check(draw, p_lm, q_lm, N, g)
            print(f"  {name:<20} TV = {r['tv']:.4f}   bound {r['tv_bound']:.4f}   chi-square p = {r['p_value']:.3f}")
            assert r["tv"] <= r["tv_bound"]
        '''),
        md('''
        ## 7. Timing on SmolLM2-135M (on this CPU)

        Greedy decoding with the distilled draft (chain SpS, $k$ = 2 and 4) and with prompt lookup,
        a drafter whose drafts are deterministic n-gram copies and are verified as one-hot $q$,
        against plain decoding. Trees for real models come with EAGLE (chapters 3–5). The prompt
        asks for text that repeats itself, which is where prompt lookup shines.
        '''),
        timing_cell('''
            prompt = "Copy this list exactly, one item per line: apples, bananas, cherries, dates, figs, grapes, lemons."
            drafters = {f"SpS, distilled draft, k={k}": DraftModel(smol_draft, k=k) for k in (2, 4)} if smol_draft is not None else {}
            drafters["prompt lookup (one-hot q), k=4"] = PromptLookup(k=4)
        '''),
        *exercises_cells(2, [
            ("2.1", "mss_with_replacement", "MSS for i.i.d. candidates: residual of $p$ after each rejection"),
            ("2.2", "mss_without_replacement", "recursive rejection sampling: $q$ loses each rejected candidate"),
            ("2.3", "mss_onehot", "one-hot $q$: accept with $p_i(x_i)$, else remove $x_i$ from $p$"),
            ("2.4", "verify_tree", "walk the tree level by level with 2.1 / 2.2 / 2.3"),
        ]),
    ]
    return cells


NOTEBOOKS = {
    "01_rejection_sampling.ipynb": chapter1,
    "02_multi_round_speculative_sampling.ipynb": chapter2,
}


def _discover_chapters() -> None:
    """Later chapters live in tools/notebooks/nbNN_*.py: each defines NAME (the .ipynb file name) and
    cells() (using md / code / SETUP / exercises_cells from this module)."""
    import importlib.util
    sys.modules.setdefault("build_notebooks", sys.modules[__name__])
    for path in sorted((ROOT / "tools" / "notebooks").glob("nb[0-9][0-9]_*.py")):
        spec = importlib.util.spec_from_file_location(f"_nb_{path.stem}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        NOTEBOOKS[mod.NAME] = mod.cells


_discover_chapters()


def build(name: str):
    nb = new_notebook(cells=NOTEBOOKS[name]())
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, c in enumerate(nb.cells):
        c["id"] = f"{name[:2]}-{i:02d}"  # stable ids: rebuilding gives the same file
    return nb


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a notebook differs from this script's output")
    args = ap.parse_args(argv)
    stale = []
    for name in NOTEBOOKS:
        text = nbformat.writes(build(name)) + "\n"
        path = OUT / name
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
        elif not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            print(f"wrote notebooks/{name}")
    if stale:
        print(f"out of date (run python tools/build_notebooks.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
