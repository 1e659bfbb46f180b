# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %%
# Versions and FAST mode.
import os, platform

import torch
import minispec
from minispec import config

FAST = config.fast()  # MINISPEC_FAST=1: smaller sample counts and shorter generations (CI sets it)
print(f"python {platform.python_version()} | torch {torch.__version__} | minispec {minispec.__version__}")
print(f"FAST mode: {'on' if FAST else 'off'} (MINISPEC_FAST={os.environ.get('MINISPEC_FAST', '')!r})")
print(f"Hugging Face hub reachable: {minispec.models.hub_reachable()}")

# %% [markdown]
# # Chapter 1 — Rejection sampling: speculative decoding that is exactly lossless
#
# A small **draft** model proposes $k$ tokens; the big **target** model scores all of them in
# one forward pass; a rejection-sampling rule keeps a prefix of the drafts and adds one token
# of its own. Done right, the emitted tokens have *exactly* the target's distribution: the
# speedup is free in quality (Leviathan et al. 2023; Chen et al. 2023).
#
# **Learning objectives**
# 1. State the accept/reject rule $\min(1, p(x)/q(x))$ and the residual
#    $\mathrm{norm}(\max(0, p - q))$, and prove that the output is exactly $p$.
# 2. Derive the expected tokens per target forward $1 + \alpha + \dots + \alpha^k$ and the
#    speedup model $\frac{1-\alpha^{k+1}}{(1-\alpha)(kc+1)}$; choose $k$ from $\alpha$ and $c$.
# 3. Check losslessness two ways: exact enumeration of every random outcome (error at
#    float64 rounding) and the total-variation distance of samples on real models.
# 4. Measure $\tau$ (tokens per target forward) and tokens/s of speculative decoding on
#    SmolLM2-135M on this CPU.
# 5. Implement exercises 1.1–1.5 and grade them.
#
# **Notation** (used everywhere in minispec): $p$ target distribution, $q$ draft distribution,
# $k$ (gamma) draft length, $\alpha = \sum_x \min(p(x), q(x))$ acceptance rate,
# $\tau$ = mean tokens committed per target forward, bonus included (vanilla = 1.00).

# %%
import inspect

import matplotlib.pyplot as plt
import numpy as np

from minispec import exactness as ex
from minispec import sampling
from minispec import verify as vf

def show(obj):
    """Print the source of a minispec function (the notebook never redefines library code)."""
    print(inspect.getsource(obj))


# %% [markdown]
# ## 1. One draft token, accepted or not
#
# Take a tiny vocabulary and two distributions: the target $p$ and the draft $q$. The draft
# proposes $x \sim q$. We accept it with probability $\min\left(1, \frac{p(x)}{q(x)}\right)$:
# always when the target likes $x$ at least as much as the draft does, and in proportion
# $p(x)/q(x)$ when the draft over-proposes it. On rejection we draw a replacement from the
# **residual** $r = \mathrm{norm}(\max(0, p - q))$: only the tokens the draft under-proposed.

# %%
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

# %% [markdown]
# ### Why the residual makes the output exactly $p$
#
# The probability of emitting token $y$ in one step is "draft $y$ and accept it" plus "reject
# whatever was drafted, then draw $y$ from $r$":
#
# $$
# P(y) \;=\; q(y)\,\min\!\left(1, \frac{p(y)}{q(y)}\right) \;+\; P(\text{reject})\; r(y)
# \;=\; \min\big(p(y), q(y)\big) \;+\; (1-\alpha)\, \frac{\max\big(0, p(y) - q(y)\big)}{\sum_z \max\big(0, p(z)-q(z)\big)} .
# $$
#
# The rejection probability is $1 - \sum_x q(x)\min(1, p(x)/q(x)) = 1 - \sum_x \min(p(x), q(x)) = 1-\alpha$,
# and the residual's normaliser is $\sum_z \max(0, p(z) - q(z)) = \sum_z \big(p(z) - \min(p(z), q(z))\big) = 1 - \alpha$
# too. They cancel:
#
# $$
# P(y) = \min(p(y), q(y)) + \max(0, p(y) - q(y)) = p(y). \qquad\blacksquare
# $$
#
# **$k$ drafts.** Draft $i$ is examined only if drafts $0..i-1$ were accepted, and then the
# same one-step argument applies with $p_i, q_i$ (the distributions after the accepted
# prefix): the token emitted at position $i$ has law $p_i$. If all $k$ are accepted, the
# bonus token is a plain sample from $p_k$. So every committed token has the target's
# conditional law given the tokens before it: the whole sequence has the target's law.
#
# (If $q(x) = 0$ for a proposed $x$ — impossible when $x \sim q$ — minispec accepts iff
# $p(x) > 0$. If $p = q$ the residual is empty, but then nothing is ever rejected.)
#
# Drawing the replacement from $p$ instead of $r$ is the classic bug: it gives
# $\min(p, q) + (1-\alpha)p \neq p$.

# %%
wrong = torch.minimum(p, q) + (1 - alpha) * p
right = torch.minimum(p, q) + (1 - alpha) * r
print(f"max |P(y) - p(y)| with the residual:        {(right - p).abs().max().item():.2e}")
print(f"max |P(y) - p(y)| resampling from p instead: {(wrong - p).abs().max().item():.2e}")

# %% [markdown]
# The library versions (chapter 1 lives in `minispec/verify.py`). Every random choice goes
# through a `chooser` (`bernoulli(prob)`, `categorical(weights)`), which is what lets us
# enumerate them exactly below.

# %%
show(vf.accept_prob)
show(vf.residual)
show(vf.verify_chain)


# %% [markdown]
# ### A naive version for teaching
#
# The same step for one draft, in plain Python floats and lists, so every operation is
# visible. The next cell asserts that it has exactly the same law as the library's
# `verify_chain` with $k = 1$, for every possible draft $x$.

# %%
def naive_one_draft(x, p, q, chooser):
    """One drafted token x ~ q. Returns (accepted 0/1, emitted token)."""
    p, q = [float(v) for v in p], [float(v) for v in q]
    if chooser.bernoulli(min(1.0, p[x] / q[x])):
        return 1, x
    r = [max(0.0, pi - qi) for pi, qi in zip(p, q)]
    total = sum(r)
    return 0, chooser.categorical(torch.tensor([ri / total for ri in r], dtype=torch.float64))


# %%
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


# %% [markdown]
# ## 2. An empirical check: sample many speculative steps
#
# Draw $x \sim q$, verify it, and record the first emitted token; the histogram should match
# $p$, not $q$. `exactness.empirical_check` reports the total-variation distance and a
# chi-square p-value, and `tv_bound(n, V)` is a bound that the TV of $n$ honest samples
# exceeds with probability at most $10^{-6}$.

# %%
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

# %% [markdown]
# ## 3. Exact enumeration: the error is float64 rounding
#
# Sampling can only bound the error. Because every random choice goes through a chooser,
# `minispec.exactness` can do better: `EnumeratingChooser` replays the *same* verification
# code once per branch (each draft draw, each accept/reject coin, each residual or bonus
# draw), multiplying the probabilities along the way. Summing over all branches gives the
# exact law of the emitted tokens, to compare with the target's.

# %%
show(ex.EnumeratingChooser)
show(ex.enumerate_outcomes)

# %% [markdown]
# A `ToyLM` gives context-dependent $p(\cdot \mid \text{ctx})$ and $q(\cdot \mid \text{ctx})$
# on a tiny vocabulary, with temperature, top-k / top-p truncation, sparse or disjoint
# supports, $p = q$, and a one-hot target. We check the law of the first emitted tokens of
# chains with $k = 1, 2, 3$; then the deliberately wrong verifiers (`exactness.CONTROLS`),
# which must fail.

# %%
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
print(f"\nworst error over {len(rows)} exact checks: {worst:.2e} (float64 rounding)")

# %%
lm = ex.ToyLM(6, const=ex.control_pair())
for name, (program, greedy) in ex.CONTROLS.items():
    err = ex.enumeration_error(program, greedy, lm)
    what = inspect.getdoc(getattr(ex, name)) if hasattr(ex, name) else "the real-q MSS rule on deterministic top-k drafts"
    print(f"{name:<28} error {err:.3f}   {what.removeprefix('WRONG: ')}")
    assert err > 1e-3

# %% [markdown]
# ## 4. How many tokens per step, and how much faster?
#
# If each draft is accepted independently with probability $\alpha$, draft $i$ is reached
# and accepted with probability $\alpha^{i+1}$, and a step commits the accepted drafts plus
# one token (residual or bonus):
#
# $$
# \mathbb{E}[\text{tokens per step}] = \sum_{i=0}^{k} \alpha^i = \frac{1-\alpha^{k+1}}{1-\alpha}
# \quad (= k+1 \text{ at } \alpha = 1).
# $$
#
# With $c$ = (cost of a draft forward) / (cost of a target forward), a step costs $kc + 1$
# target forwards, and plain decoding makes one token per target forward:
#
# $$
# \text{speedup}(\alpha, k, c) = \frac{1-\alpha^{k+1}}{(1-\alpha)(kc+1)} .
# $$
#
# This model charges the target the same for $k+1$ tokens as for one (true while decoding
# is memory-bound) and ignores the rest of the overhead. First, an exact check of the
# formula: on a toy model whose $(p, q)$ is the same at every position, acceptance is
# i.i.d. with rate $\alpha$, and the enumerated mean number of emitted tokens must be the
# formula.

# %%
lm_const = ex.ToyLM(V, const=(p, q))
for k in (1, 2, 3):
    law = ex.outcome_distribution(lambda ch: ex.chain_step(lm_const, (), k, ch))
    mean_tokens = sum(w * len(out) for out, w in law.items())
    formula = vf.expected_tokens(alpha, k)
    print(f"k={k}: enumerated E[tokens/step] = {mean_tokens:.12f}, formula = {formula:.12f}")
    assert abs(mean_tokens - formula) <= 1e-12

# %%
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

# %% [markdown]
# Explore it: the sliders set $\alpha$, $k$ and $c$. (The widget needs a live Jupyter
# frontend; in a static view, the figure and the table above show fixed settings.)

# %%
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

# %% [markdown]
# ## 5. Real models: TV distance against direct target sampling
#
# The same check on a real target/draft pair: GPT-2 (target) and DistilGPT-2 (draft) when
# the Hugging Face hub or cache provides them; otherwise minispec's seeded tiny GPT-2
# presets (the cell says which it used). We take both models' next-token distributions
# after a prompt (temperature 1, top-k 32, the same processing for $p$ and $q$), restrict
# to the tokens either can emit, and compare speculative first tokens with tokens drawn
# directly from $p$: both TVs should be of the same (sampling-noise) size.

# %%
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


# %%
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
    return repr(s) if s.isprintable() and "\ufffd" not in s else f"id {t}"
labels = [label(int(support[i])) for i in top]
fig, ax = plt.subplots(figsize=(10, 3))
xs15 = np.arange(len(top))
ax.bar(xs15 - 0.27, p_lm[top], 0.27, label="target p")
ax.bar(xs15, np.array(spec["counts"])[top] / N, 0.27, label="speculative (empirical)")
ax.bar(xs15 + 0.27, q_lm[top], 0.27, label="draft q")
ax.set_xticks(xs15, labels, rotation=60, fontsize=8); ax.legend(fontsize=8)
ax.set_title(f"{target_name} / {draft_name}: the 15 most likely next tokens")
plt.show()

# %% [markdown]
# ## 6. Timing on SmolLM2-135M (on this CPU)
#
# Speculative decoding with minispec's distilled SmolLM2 draft against plain decoding of
# the same target, greedy, on this machine's CPU. Greedy verification accepts a draft iff
# it equals the target's argmax, so the outputs must be identical; we assert that. $\tau$
# and tokens/s are printed, not claimed: on a CPU with a 135M target the draft's own cost
# ($c$ above) is far from negligible, and a short run is noisy.

# %%
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
    print(f"NOTE: the distilled SmolLM2 draft is not available ({type(e).__name__}: {e}); "
          "so there is no SpS row; prompt lookup (a model-free drafter, one-hot q) is timed instead.")
prompt = "Explain in three sentences why speculative decoding makes LLM inference faster."
drafters = {"SpS, distilled draft, k=4": DraftModel(smol_draft, k=4)} if smol_draft is not None \
    else {"prompt lookup, k=4": PromptLookup(k=4)}

n_new = 24 if FAST else 128
generate(smol, smol_tok, prompt, max_new_tokens=4)  # warm-up (first-call overheads)
runs = {"vanilla": generate(smol, smol_tok, prompt, max_new_tokens=n_new)}
for name, d in drafters.items():
    runs[name] = generate(smol, smol_tok, prompt, drafter=d, max_new_tokens=n_new)
    assert runs[name].tokens == runs["vanilla"].tokens, f"{name}: greedy output differs from vanilla greedy"

print(f"device: this machine's CPU ({cpu_name()}), torch threads: {torch.get_num_threads()}, no GPU; greedy, "
      f"{n_new} new tokens, prompt {prompt[:60]!r}")
print(f"{'method':<32} {'tokens':>6} {'target fwd':>10} {'tau':>5} {'tokens/s':>9}  acceptance by depth")
for name, r in runs.items():
    s = r.stats
    acc = " ".join(f"{a:.2f}" for a in s.acceptance_by_position)
    print(f"{name:<32} {s.new_tokens:>6} {s.target_forwards:>10} {s.tau:>5.2f} {s.tokens_per_s:>9.1f}  {acc}")
print("every speculative run emitted exactly the vanilla greedy tokens")

# %% [markdown]
# ## Exercises
#
# Implement the functions in `exercises/ch01_rejection_sampling.py` (generated from `solutions/`; same
# signatures and docstrings). All randomness goes through the `chooser` argument, so the
# grader can enumerate every random outcome of *your* code and compare its exact law with
# the target and with minispec's own implementation.
#
# | exercise | function | task |
# |---|---|---|
# | 1.1 | `accept_prob` | $\min(1, p(x)/q(x))$, including $q(x) = 0$ |
# | 1.2 | `residual` | $\mathrm{norm}(\max(0, p - q))$ over the last dimension; $p$ if empty |
# | 1.3 | `verify_chain` | accept/reject $k$ drafts in order, residual or bonus token |
# | 1.4 | `expected_tokens` | $1 + \alpha + \dots + \alpha^k$ (careful at $\alpha = 1$) |
# | 1.5 | `speedup` | expected tokens / $(kc + 1)$ |
#
# Grade from a terminal with `python -m minispec grade 1` or
# `pytest tests/test_exercises.py -m ch01 --impl exercises`; in this notebook with
# `check("1.1")` (one exercise) or `check(1)` (the chapter). The cell below prints
# the stub of the first exercise, then grades your file: it reports failures, it does not
# raise, so until you fill in the stubs every line says "not implemented yet".

# %%
import inspect
from minispec.grading import check, load_impl

mine = load_impl(1, "exercises")
print(inspect.getsource(mine.accept_prob))
check(1, impl="exercises")

# %%
# What a finished chapter looks like: the reference answers in solutions/ pass every check.
check(1, impl="solutions")
