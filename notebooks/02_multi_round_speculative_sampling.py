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
# # Chapter 2 — Multi-round speculative sampling: several candidates, and trees
#
# A chain offers the target one guess per position. Offering **several candidates** for the
# same position raises the chance that one of them is right; a **draft tree** does this at
# every depth. Verifying several candidates losslessly needs multi-round speculative
# sampling (MSS, Miao et al. 2023): one Leviathan step per candidate, on a target
# distribution that shrinks to the residual after each rejection.
#
# **Learning objectives**
# 1. Derive MSS for candidates drawn i.i.d. from $q$ (with replacement), and see why each
#    round must use the residual of the previous one.
# 2. Derive the variant for candidates drawn **without replacement** (recursive rejection
#    sampling), where $q$ also changes, and see that mixing the two rules is biased.
# 3. Know what **one-hot $q$** assumes (deterministic top-k drafts, as in EAGLE) and why it is
#    still exact.
# 4. Verify a draft **tree level by level**; see a chain as the degenerate tree.
# 5. Check all of them by exact enumeration, and on a real model by the TV distance of the
#    joint law of its first tokens, watching a wrong rule stop improving as samples grow.
# 6. Implement exercises 2.1–2.4, each right after the section that teaches it.
#
# Notation as in chapter 1: $p$ target, $q$ draft, candidates $x_0, \dots, x_{n-1}$ tried in order.
#
# **Exercises.** You write them in `exercises/ch02_multi_round.py`; each check cell below
# grades your file and prints PASS or FAIL (it never raises). From a terminal:
# `python -m minispec grade 2`. The file gives you chapter 1's `accept_prob` and `residual`.

# %%
import inspect

import matplotlib.pyplot as plt
import numpy as np

from minispec.lab import analysis as an  # chapter 1's formulas: acceptance rate, expected tokens, speedup
from minispec.lab import exactness as ex
from minispec import sampling
from minispec import verify as vf
from minispec.grading import check  # check("2.1"): grade one exercise of exercises/ (prints, never raises)


V = 6
g = torch.Generator().manual_seed(0)
p = sampling.probs(1.5 * torch.randn(V, generator=g, dtype=torch.float64), temperature=1.0)  # target [V]
q = sampling.probs(1.5 * torch.randn(V, generator=g, dtype=torch.float64), temperature=1.0)  # draft  [V]
print("p =", [round(v, 3) for v in p.tolist()])
print("q =", [round(v, 3) for v in q.tolist()])
print(f"alpha (one candidate) = {an.acceptance_rate(p, q).item():.4f}")

# %% [markdown]
# ## 1. MSS with replacement: candidates i.i.d. from $q$
#
# Set $p_0 = p$. Round $i$ is a chapter-1 step of $p_i$ against $q$: accept $x_i$ with
# probability $\min(1, p_i(x_i)/q(x_i))$; on rejection, continue with
# $p_{i+1} = \mathrm{norm}(\max(0, p_i - q))$. If all $n$ candidates are rejected, emit a
# token drawn from $p_n$.
#
# **Why it is exact.** Let $O_i$ be the law of the token emitted when the procedure is
# entered at round $i$ (with target $p_i$). After the last round $O_n = p_n$ by
# construction. For $i < n$, round $i$ accepts a token $y$ with probability
# $\min(p_i(y), q(y))$ and rejects with probability $1 - \alpha_i$,
# $\alpha_i = \sum_x \min(p_i(x), q(x))$; after a rejection the rest of the procedure emits
# $O_{i+1} = p_{i+1}$ (induction), a fresh candidate $x_{i+1} \sim q$ independent of the
# past. So, exactly as in chapter 1,
#
# $$
# O_i(y) = \min(p_i(y), q(y)) + (1-\alpha_i)\, \frac{\max(0, p_i(y) - q(y))}{1 - \alpha_i} = p_i(y),
# $$
#
# and at $i = 0$ the output has law $p$. The residual is essential: without it each round
# would just be a fresh chain-1 step, and rejections would bias toward what $q$ over-proposes.

# %% [markdown]
# ### Exercise 2.1 — `mss_with_replacement(candidates, p, q, chooser)`
#
# *Hint.* Read the induction backwards: round $i$ is a chapter-1 step whose target is $p_i$.
# What must $p_{i+1}$ be so that "accept here, or else whatever the later rounds emit" has
# law $p_i$? Does anything about $q$ change between rounds, given how the candidates were drawn?

# %%
check("2.1")

# %% [markdown]
# ## 2. Without replacement: recursive rejection sampling
#
# Drawing candidates i.i.d. wastes slots on duplicates. Drawing them **without
# replacement** gives $n$ distinct tokens, but then candidate $i$ is no longer a draw from
# $q$: it cannot be any of $x_0..x_{i-1}$. The proof above goes through if every round is a
# Leviathan step against the distribution its own candidate was actually drawn from, and the
# next round's target is what that step leaves over (Jeon et al. 2024; Yang et al. 2024).
# Exercise 2.2 is to work out both: from which distribution is $x_{i+1}$ drawn, given that
# $x_0..x_i$ were drawn and rejected, and what are $p_{i+1}$ and the $q$ of round $i + 1$?
#
# Each rule is exact only for its own way of drawing. The table gives the exact law of the
# emitted token against $p$ ($n = 3$) for each rule with its own drafting, and for distinct
# drafts verified with the i.i.d. rule. (The other mismatch cannot even be run: the
# without-replacement rule refuses repeated candidates, which its drafting cannot produce.)

# %%
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

# %% [markdown]
# ### Exercise 2.2 — `mss_without_replacement(candidates, p, q, chooser)`
#
# *Hint.* The one-step argument needs "the next candidate is distributed as the $q$ used in
# its acceptance ratio". After a rejection of $x_i$, what is the law of $x_{i+1}$ when the
# candidates were drawn without replacement? Update whatever must change so that this holds
# in every round (and leave the caller's tensors alone).

# %%
check("2.2")

# %% [markdown]
# ### The answer, a naive version and the library's
#
# Round $i$ is a Leviathan step of $p_i$ against $q_i$, the distribution $x_i$ was drawn from,
# and after rejecting $x_i$
#
# $$
# p_{i+1} = \mathrm{norm}(\max(0, p_i - q_i)), \qquad q_{i+1} = \mathrm{norm}(q_i \text{ with } x_i \text{ set to } 0).
# $$
#
# Given the rejection, $x_{i+1} \sim q_{i+1}$ (the next draw without replacement), so the
# induction step holds with $q_i$ in place of $q$. Note $p_{i+1}(x_i) = 0$: a rejection means
# $p_i(x_i) < q_i(x_i)$. With replacement $q_i = q$ in every round (section 1).
#
# MSS with replacement in plain Python lists; the next cell asserts that the exact joint
# law of (candidates, accepted index, emitted token) equals that of the library's
# `verify_candidates(..., mode="mss_replacement")`, with the candidates themselves drawn
# i.i.d. from $q$ inside the enumeration. Then the library's code.

# %%
def naive_mss(candidates, p, q, chooser):
    p, q = [float(v) for v in p], [float(v) for v in q]
    for i, x in enumerate(candidates):
        if chooser.bernoulli(min(1.0, p[x] / q[x])):
            return i, x
        r = [max(0.0, a - b) for a, b in zip(p, q)]
        p = [v / sum(r) for v in r] if sum(r) > 0 else p
    return None, chooser.categorical(torch.tensor(p, dtype=torch.float64))


# %%
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

# %%
show(vf._mss_replacement)
show(vf._mss_no_replacement)


# %% [markdown]
# ## 3. One-hot $q$: deterministic drafts
#
# EAGLE's drafts are the **top-k** tokens of the draft model: a deterministic function of
# the context, not samples. There is no $q$ the candidates were "drawn from" — or rather,
# conditional on the context, candidate $x_i$ was drawn from the point mass
# $\mathrm{one\_hot}(x_i)$. Plug that into MSS and each round becomes a Leviathan step
# against a point mass.
#
# **What it assumes:** the candidates must not depend on the verifier's random coins
# (they may depend on the context, and they may even be sampled beforehand — the argument
# is conditional on them). Then each round is an exact Leviathan step against a point mass,
# and the output has law $p$. What one-hot $q$ changes is the acceptance: a node accepts one of its
# candidates with probability $\sum_i p(x_i)$, the target's mass on them (question 2), where one
# sampled candidate gets $\alpha = \sum_x \min(p(x), q(x))$. Either can be the larger: a draft that
# ranks the target's favourite first gains, a well-calibrated draft whose top token the target
# dislikes loses (the cell below computes both for this section's $p$, $q$ and for a uniform $q$).
# Using the real-$q$ rule on top-k drafts is wrong (a control below).
#
# The library's one-hot rule against $p$, for three ways of choosing the candidates, and the
# real-$q$ rule on the top-3 drafts:

# %%
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

for name, pp, qq in (("this section's p, q", p, q),
                     ("p = (0.9, 0.1), uniform q", torch.tensor([0.9, 0.1], dtype=torch.float64),
                      torch.tensor([0.5, 0.5], dtype=torch.float64))):
    top1 = int(torch.argsort(-qq, stable=True)[0])
    print(f"{name}: one sampled candidate accepted w.p. alpha = {an.acceptance_rate(pp, qq).item():.3f}; "
          f"the top-1 of q under the one-hot rule w.p. p(top-1) = {pp[top1].item():.3f}")

# %% [markdown]
# ### Exercise 2.3 — `mss_onehot(candidates, p, chooser)`
#
# *Hint.* Take MSS with replacement and substitute $q = \mathrm{one\_hot}(x_i)$ in round $i$:
# simplify the acceptance probability and the residual by hand before you write any code.
# What happens to a candidate that appears twice?

# %%
check("2.3")

# %%
show(vf._mss_onehot)


# %% [markdown]
# ## 4. How much do more candidates help?
#
# The probability that *some* candidate is accepted at a node, computed exactly by
# enumeration, for each rule (with its own drafting) as the number of candidates grows.
# The draft's temperature changes how well $q$ matches $p$.

# %%
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

# %%
from minispec.lab.notebook import interact

def explore(n=2, draft_temperature=1.0):
    q_t = sampling.probs(logits_q, temperature=draft_temperature)
    acc = [p_accept(mode, n, q_t) for mode in MODES]
    fig, ax = plt.subplots(figsize=(6, 2.8))
    ax.barh(MODES, acc)
    ax.set(xlim=(0, 1), xlabel="P(some candidate accepted)", title=f"n={n}, draft temperature {draft_temperature:.2f}")
    plt.show()
    print("  ".join(f"{m}: {a:.3f}" for m, a in zip(MODES, acc)))

interact(explore, n=(1, 3), draft_temperature=(0.2, 2.0, 0.1));  # sliders (fast mode: the defaults once)

# %% [markdown]
# ## 5. Trees, level by level
#
# A draft tree gives every node several children. Layout (the same everywhere in minispec):
# nodes $0..N-1$ in topological order, `parents[i]` = $-1$ for a child of the root (the
# last committed token) or an earlier node; `tokens[i]` its token. Row 0 of $p$/$q$ is the
# distribution at the root, row $i+1$ the distribution after node $i$ ("row = node + 1").
#
# Verification walks down from the root: at the current node, run MSS over its children (in
# index order). If child $c$ is accepted, move to $c$ and repeat with row $c+1$; if none
# is accepted — or the node is a leaf — emit the MSS token (residual, or the bonus token
# from $p$ at a leaf) and stop. Each level is exact given the path so far, so by the same
# induction as chapter 1 the emitted sequence has the target's law. A **chain** is the
# degenerate tree `parents = [-1, 0, 1, ..., k-1]`: one candidate per level, which is
# exactly chapter 1's `verify_chain`.
#
# A small tree on a toy model (two children per node, two levels), verified a few times by
# the library's `verify_tree`. The library carries a draft tree as one object,
# `minispec.tree.Tree(tokens, parents, q)` (checked once, when it is built; chapter 4 gives it
# its attention mask), from the drafter through the decode loop to `verify_tree(tree, p, ...)`;
# `vf.verify_tree_lists(parents, tokens, p, q, ...)` is the same on bare lists, the signature of
# exercise 2.4.

# %%
from collections import Counter

from minispec.tree import Tree

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
tree = Tree(tokens, parents, Q)
g = torch.Generator().manual_seed(1)
for _ in range(4):
    r = vf.verify_tree(tree, P, mode="mss_no_replacement", generator=g)
    print(f"accepted path {r.path}, next token {r.next_token}, emitted {r.emitted}")
draws = 2_000
paths = Counter(tuple(vf.verify_tree(tree, P, mode="mss_no_replacement", generator=g).path)
                for _ in range(draws))
print(f"over {draws} verifications of this tree: " + ", ".join(f"path {list(k)}: {v / draws:.2f}" for k, v in sorted(paths.items())))

# %% [markdown]
# ### Exercise 2.4 — `verify_tree(parents, tokens, p, q, mode, chooser)`
#
# *Hint.* Two questions: for a given node, which nodes are its candidates, in which order,
# and which row of `p` / `q` do they use? And when does the walk stop? Reuse your 2.1–2.3
# for the node-level step; the chapter-1 chain is a good first test case.

# %%
check("2.4")

# %%
show(vf.verify_tree)

# %% [markdown]
# **A chain is the degenerate tree.** With the same generator state, `verify_tree` on
# `parents = [-1, 0, ..., k-1]` makes the same random choices as `verify_chain`, so the
# outputs are identical draw by draw; and their exact laws agree.

# %%
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
    r = vf.verify_tree(Tree.chain(xs, Qc), Pc, mode="chain", generator=torch.Generator().manual_seed(seed))
    mismatches += (len(r.path), r.next_token) != (n, nxt)
assert mismatches == 0
chain = ex.sequence_distribution(lambda c, ch: ex.chain_step(lm, c, k, ch), 2)
tree = ex.sequence_distribution(lambda c, ch: ex.tree_step(lm, c, [1] * k, "chain", ch), 2)
print(f"200 seeded draws: verify_tree(chain) == verify_chain every time; "
      f"exact laws of 2 tokens differ by {ex.max_abs_error(chain, tree):.1e}")

# %% [markdown]
# ## 6. Exact enumeration of every rule
#
# Every rule, on single nodes and on trees, over toy models with different supports; the
# law of the first two emitted tokens (several steps when a step emits one) against the
# target's. Greedy verification is compared with greedy decoding.

# %%
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

# %% [markdown]
# ## 7. A real model: trees on SmolLM2, the joint law of the first three tokens
#
# Chapter 1's real-model check, now with a draft **tree** per step. Target:
# **SmolLM2-135M-Instruct**; draft: **minispec's distilled 2-layer SmolLM2 draft** shipped in
# `minispec/checkpoints` (in FAST mode only, if SmolLM2 cannot be loaded, the seeded tiny
# presets stand in and the printed heading says so; they share no likely tokens, so the wrong
# rules are not asserted on them). Both sample at temperature 1 with
# top-$k$ = 4, so the target's law of its first three tokens lives on $4^3 = 64$ sequences
# and is computed exactly.
#
# Each step drafts a tree with **two children per node**, two levels deep (never deeper than
# the tokens still wanted), and verifies it level by level with one of the three rules, each
# with its own drafting: i.i.d. candidates, candidates without replacement, the top-2 of $q$
# (one-hot). Two wrong pairings run in the same cell: the real-$q$ rule on top-2 drafts (very
# wrong) and the i.i.d. rule on distinct drafts (subtly wrong, section 2). The threshold
# `tv_bound(N, K)` is exceeded by an honest sampler with probability below $10^{-6}$.
#
# The helpers are chapter 1's (section 6 there explains them; they live in
# `minispec.lab.joint_law`): next-token laws for many contexts from one packed forward, served
# through the `ToyLM` interface so that `exactness.tree_step` runs on them unchanged.

# %%
from IPython.display import Markdown, display
from minispec.sampling import SamplingParams
from minispec.tokenizer import encode_prompt
from minispec.lab.joint_law import joint_tv_check, load_tv_models, next_token_laws, packed_law

TV_TARGET, TV_DRAFT, tv_target, tv_draft, tv_tok = load_tv_models(FAST)
display(Markdown(f"**TV check — target: {TV_TARGET}; draft: {TV_DRAFT}**"))

# %%
TOP_K, LENGTH, DEPTH, BRANCH = 4, 3, 2, 2
params = SamplingParams(temperature=1.0, top_k=TOP_K)  # the same processing for p and q
ids = encode_prompt(tv_tok, "Tell me a story about a dragon.")  # chat template when the tokenizer has one
lm, law = packed_law(tv_target, tv_draft, ids, params, LENGTH)  # exact law of the first LENGTH tokens; the packed
# forward is checked against a plain forward of prompt + the deepest context


def tree_rule(mode, draft=None):
    """A step: draft BRANCH children per node, `depth` levels, verify with `mode`."""
    return lambda lm, ctx, depth, ch: ex.tree_step(lm, ctx, [BRANCH] * depth, mode, ch, draft)

CORRECT = {"mss_replacement, i.i.d. drafts": tree_rule("mss_replacement"),
           "mss_no_replacement, distinct drafts": tree_rule("mss_no_replacement"),
           "onehot, top-2 drafts": tree_rule("onehot")}
BLATANT = "WRONG: real-q rule, top-2 drafts"
SUBTLE = "WRONG: i.i.d. rule, distinct drafts"
steps = {**CORRECT, BLATANT: tree_rule("mss_replacement", "topk"), SUBTLE: tree_rule("mss_replacement", "no_replacement")}

N = 2_500 if FAST else 40_000
tv, bound, support, target = joint_tv_check(lm, law, steps, N, length=LENGTH, k=DEPTH)
print(f"target {TV_TARGET}, draft {TV_DRAFT}; top-k {TOP_K}; trees of {BRANCH} children per node, "
      f"up to {DEPTH} levels; {N} runs each")
print(f"threshold tv_bound(N={N}, K={len(target)}) = {bound:.4f}   (0.5 sqrt(K/N) = {0.5 * np.sqrt(len(target) / N):.4f})")
for name, r in tv.items():
    print(f"  {name:<38} TV = {r['tv']:.4f}   {'FLAGGED' if r['tv'] > bound else 'passes'}")
for name in CORRECT:
    assert tv[name]["tv"] <= bound, f"{name}: a correct rule must pass"
if TV_TARGET.startswith("SmolLM2"):
    assert tv[BLATANT]["tv"] > bound, "the wrong rule must be flagged"
else:  # random tiny models share no likely tokens (alpha = 0): every rule then just emits samples of p
    print("fallback models: the wrong rules cannot be told apart when alpha = 0, so they are not asserted")
if tv[SUBTLE]["tv"] > 0.02:  # the threshold must fall well below the bias: tv_bound(need, K) = 0.8 TV
    need = ex.samples_for_tv(0.8 * tv[SUBTLE]["tv"], len(target))
    print(f"the subtle mistake is off by about {tv[SUBTLE]['tv']:.3f} in TV; flagging it reliably takes about "
          f"{need:,} runs ({'this run draws enough' if N >= need else 'more than this run draws'})")
    if N >= need and TV_TARGET.startswith("SmolLM2"):
        assert tv[SUBTLE]["tv"] > bound, "with this many samples the subtle mistake must be flagged too"

# %% [markdown]
# ### TV against the number of samples
#
# The TV of the first $n$ runs, for growing $n$, on a log-log scale. An exact sampler's TV
# falls like the sampling bound $\frac12\sqrt{K/n}$ (slope $-\frac12$); a wrong one falls
# only until the sampling noise drops below its bias, then levels off at its true distance to
# the target. That plateau is what a TV check detects, and it tells how many samples a check
# needs: the dashed threshold must fall below the plateau. `exactness.samples_for_tv(x, K)`
# inverts the threshold: the fewest runs $n$ with `tv_bound(n, K)` $\le x$, which grows like
# $K / x^2$. Chapters 3-7 print it for their controls.

# %%
grid = np.unique(np.logspace(2, np.log10(N), 14).astype(int))
fig, ax = plt.subplots(figsize=(8, 4.2))
for name, r in tv.items():
    curve = [0.5 * np.abs(np.bincount(r["draws"][:m], minlength=len(target)) / m - target).sum() for m in grid]
    ax.loglog(grid, curve, "o-" if name in CORRECT else "s--", markersize=3, label=name)
ax.loglog(grid, 0.5 * np.sqrt(len(target) / grid), "k-", lw=1, label="0.5 sqrt(K/n): bound on the mean TV")
ax.loglog(grid, [ex.tv_bound(int(m), len(target)) for m in grid], "k:", lw=1, label="threshold tv_bound(n, K)")
ax.set(xlabel="samples n (runs of the decoding loop)", ylabel="TV(first 3 tokens, target)",
       title=f"{TV_TARGET}: TV against the number of samples")
ax.legend(fontsize=7)
plt.show()

# %% [markdown]
# ### GPT-2 and DistilGPT-2, when your machine has them
#
# The same tree check with GPT-2 as the target and DistilGPT-2 as the draft, from the Hugging
# Face cache or hub, which this course does not assume; the cell says whether it ran.

# %%
try:
    (gpt2, gpt2_tok), (distil, _) = minispec.load("gpt2"), minispec.load("distilgpt2")
except (minispec.ModelNotFound, OSError) as e:
    print(f"GPT-2 / DistilGPT-2 are not in a local cache here and the hub is not reachable: skipped "
          f"({type(e).__name__})")
else:
    display(Markdown("**TV check — target: GPT-2; draft: DistilGPT-2**"))
    lm2, law2 = packed_law(gpt2, distil, encode_prompt(gpt2_tok, "The quick brown fox", chat=False), params, LENGTH)
    tv2, bound2, _, _ = joint_tv_check(lm2, law2, {**CORRECT, BLATANT: steps[BLATANT]}, N, length=LENGTH, k=DEPTH)
    for name, r in tv2.items():
        print(f"  {name:<38} TV = {r['tv']:.4f}   {'FLAGGED' if r['tv'] > bound2 else 'passes'} (threshold {bound2:.4f})")
    for name in CORRECT:
        assert tv2[name]["tv"] <= bound2

# %% [markdown]
# ## 8. Timing on SmolLM2-135M (on this CPU)
#
# Greedy decoding with the distilled draft (chain SpS, $k$ = 2 and 4) and with prompt lookup,
# a drafter whose drafts are deterministic n-gram copies and are verified as one-hot $q$,
# against plain decoding. Trees for real models come with EAGLE (chapters 3–5). The prompt
# asks for text that repeats itself, which is where prompt lookup shines.

# %%
from minispec import generate
from minispec.drafters import DraftModel, PromptLookup
from minispec.lab.notebook import smollm2_and_draft, time_greedy

smol, smol_tok, smol_draft = smollm2_and_draft((TV_TARGET, TV_DRAFT, tv_target, tv_draft, tv_tok))
prompt = "Copy this list exactly, one item per line: apples, bananas, cherries, dates, figs, grapes, lemons."
drafters = {f"SpS, distilled draft, k={k}": DraftModel(smol_draft, k=k) for k in (2, 4)} if smol_draft is not None else {}
drafters["prompt lookup (one-hot q), k=4"] = PromptLookup(k=4)
n_new = 24 if FAST else 128
runs = time_greedy(smol, smol_tok, prompt, drafters, n_new)

# %% [markdown]
# ### Closing the cost model on this run
#
# Chapter 1's formula needs $\alpha$ and $c$. This run measured both: $\alpha$ is the fraction of
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

for name, d in drafters.items():
    print(f"{name}, one prompt, {n_new} tokens (noisy: a short run on a shared CPU)")
    print(cost_check([runs["vanilla"]], [runs[name]], k=d.k).table(), end="\n\n")

# %% [markdown]
# ## Pen-and-paper questions
#
# Short questions to answer without a computer (answers at the end of the notebook).
#
# 1. Drop the residual update: with $n = 2$ i.i.d. candidates, each round is a chapter-1 step
#    against the *original* $p$, and if both are rejected the token comes from
#    $r = \mathrm{norm}(\max(0, p - q))$. Write the law of the emitted token with
#    $m = \min(p, q)$ and $\alpha = \sum m$, and show that it differs from $p$ by
#    $(1 - \alpha)(m - \alpha r)$.
# 2. One-hot $q$ with $n$ distinct candidates: show that the probability that some candidate is
#    accepted is $\sum_i p(x_i)$. With top-$n$ drafts, when is that more than chapter 1's
#    $\alpha$ for one sampled draft?
# 3. $\tau$ of a given tree: the root has two children and each child one child of its own
#    (branching $[2, 1]$). At the root, MSS accepts some child with probability 0.8; below an
#    accepted child, its single child is accepted with probability 0.6. What is $\tau$ (tokens
#    per target forward)? Compare with a chain of two drafts accepted with probability 0.6 at
#    each level. Give the general formula.
# 4. Without replacement: why does a rejection of $x_i$ imply $p_{i+1}(x_i) = 0$? What breaks if
#    $q$ is not updated after the rejection?
# 5. $V = 2$, $p = (\frac12, \frac12)$, $q = (0.9, 0.1)$, and the draft is always the top-1
#    token of $q$ (token 0). What does the real-$q$ rule emit, and what does the one-hot rule emit?
#
# ## Summary
#
# - MSS tries candidates in order; each round is a chapter-1 step whose target is the residual
#   left by the previous rejections, so the emitted token has law $p$ whatever the number of
#   candidates.
# - Every round must use the distribution its own candidate was drawn from: $q$ for i.i.d.
#   candidates, $q$ with the earlier candidates removed for candidates without replacement, a
#   point mass for deterministic (top-k) drafts. Mixing a rule with another drafting is biased.
# - One-hot $q$ assumes only that the candidates do not depend on the verifier's coins; its
#   acceptance at a node is $\sum_i p(x_i)$, the target mass on the candidates.
# - A tree is verified level by level with MSS over the children of the accepted node; a chain
#   is the degenerate tree and gives chapter 1's verifier.
# - On a real model, the TV of the joint law of the first tokens follows $\frac12\sqrt{K/n}$
#   for a correct rule and levels off for a wrong one; a check must draw enough samples for
#   its threshold to fall below the bias it wants to catch.
#
# ## References
#
# - Miao et al. *SpecInfer: Accelerating Generative Large Language Model Serving with Tree-based
#   Speculative Inference and Verification.* ASPLOS 2024.
#   [arXiv:2305.09781](https://arxiv.org/abs/2305.09781)
# - Jeon et al. *Recursive Speculative Decoding: Accelerating LLM Inference via Sampling Without
#   Replacement.* 2024. [arXiv:2402.14160](https://arxiv.org/abs/2402.14160)
# - Yang et al. *Multi-Candidate Speculative Decoding.* 2024.
#   [arXiv:2401.06706](https://arxiv.org/abs/2401.06706)
# - Sun et al. *SpecTr: Fast Speculative Decoding via Optimal Transport.* NeurIPS 2023.
#   [arXiv:2310.15141](https://arxiv.org/abs/2310.15141)
# - Li, Wei, Zhang, Zhang. *EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty.*
#   ICML 2024 (top-k drafts, one-hot verification). [arXiv:2401.15077](https://arxiv.org/abs/2401.15077)
# - Cai et al. *Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads.*
#   2024 (static trees). [arXiv:2401.10774](https://arxiv.org/abs/2401.10774)
#
# ## The whole chapter
#
# Your file, graded in one table (the same as `python -m minispec grade 2`), and what a
# finished chapter looks like: the reference answers in `solutions/` pass every check.

# %%
check(2, impl="exercises")  # your file (the default unless MINISPEC_IMPL says otherwise)

# %% [markdown]
# ## Your verifier inside `generate`
#
# `use_impl` swaps the decode loop's tree verification for your `verify_tree` (exercise 2.4)
# while a `with` block runs: SmolLM2 decodes section 8's prompt with the distilled draft's
# 3-2-6 tree (prompt lookup where the draft is missing), every step's tree verified by your
# code. Greedy is verified as your `"onehot"` mode against the one-hot $p$ of the target's
# argmax, so the tokens must be vanilla's. Until 2.4 is done your file reports "not
# implemented yet" and the solutions show the run.

# %%
from minispec.grading.inside import decode_inside

tree_drafter = (lambda: DraftModel(smol_draft, tree="3,2,6")) if smol_draft is not None else (lambda: PromptLookup(k=4))
decode_inside(lambda: generate(smol, smol_tok, prompt, drafter=tree_drafter(), max_new_tokens=n_new).tokens,
              runs["vanilla"].tokens, chapters=(2,));

# %%
check(2, impl="solutions")

# %% [markdown]
# ## Answers to the pen-and-paper questions
#
# <details><summary>1. MSS without the residual update</summary>
#
# Round 0 emits $y$ with probability $m(y)$; after a rejection (probability $1 - \alpha$) round 1
# is a fresh step against $p$ and emits $y$ with probability $m(y)$; after two rejections $r$.
# So $P(y) = m + (1 - \alpha) m + (1 - \alpha)^2 r$, while $p = m + (1 - \alpha) r$:
# $P - p = (1 - \alpha)(m - \alpha r)$. It over-weights the tokens both models like (large
# $m$) and under-weights those only the target likes; it is exact only when $\alpha \in \{0, 1\}$.
# </details>
#
# <details><summary>2. Acceptance with one-hot q</summary>
#
# Round 0 accepts $x_0$ with probability $p(x_0)$. After rejecting $x_0, \dots, x_{i-1}$ (probability
# $1 - \sum_{j<i} p(x_j)$) the target is $p$ without them, renormalised, so round $i$ accepts with
# probability $\big(1 - \sum_{j<i} p(x_j)\big) \cdot \frac{p(x_i)}{1 - \sum_{j<i} p(x_j)} = p(x_i)$.
# Summing: $\sum_i p(x_i)$, the target's mass on the candidates. With top-$n$ drafts this beats a
# sampled draft's $\alpha = 1 - \mathrm{TV}(p, q)$ when the draft ranks well (the target's mass
# sits on the draft's top tokens) even if its probabilities are poorly calibrated.
# </details>
#
# <details><summary>3. τ of a tree</summary>
#
# $\tau = 1 + \sum_{\text{nodes}} P(\text{node on the accepted path})$: one token from the target
# plus one per accepted node. Here $1 + 0.8 + 0.8 \cdot 0.6 = 2.28$; the chain gives
# $1 + 0.6 + 0.6^2 = 1.96$. (The cell below prints both.)
# </details>
#
# <details><summary>4. Without replacement</summary>
#
# A candidate with $p_i(x_i) \ge q_i(x_i)$ is accepted with probability 1, so a rejection implies
# $p_i(x_i) < q_i(x_i)$ and $\max(0, p_i - q_i)(x_i) = 0$. If $q$ were not updated, round $i + 1$
# would use $q$ in its acceptance ratio while its candidate was drawn from $q_{i+1}$ (the earlier
# candidates removed): the one-step argument needs $P(\text{candidate} = y) = $ the $q$ in the
# ratio, so the output is biased (the "WRONG pairing" row of section 2).
# </details>
#
# <details><summary>5. The real-q rule on a deterministic draft</summary>
#
# Real-$q$ rule: accept token 0 with probability $\min(1, 0.5/0.9) = 5/9$, else draw from the
# residual $\mathrm{norm}(\max(0, p - q)) = (0, 1)$: the output is $(5/9, 4/9) \ne p$. One-hot
# rule: accept token 0 with probability $p(0) = 1/2$, else token 1: the output is $(1/2, 1/2) = p$.
# (The cell below enumerates both.)
# </details>

# %%
# Questions 3 and 5, checked.
print(f"question 3: tree tau = {1 + 0.8 + 0.8 * 0.6:.2f}, chain tau = {an.expected_tokens(0.6, 2):.2f}")
p2 = torch.tensor([0.5, 0.5], dtype=torch.float64)
q2 = torch.tensor([0.9, 0.1], dtype=torch.float64)
for mode, qq in (("mss_replacement", q2), ("onehot", None)):
    law = ex.outcome_distribution(lambda ch: vf.verify_candidates([0], p2, qq, mode=mode, chooser=ch)[1])
    print(f"question 5: {mode:<16} emits token 0 w.p. {law.get(0, 0.0):.4f}, token 1 w.p. {law.get(1, 0.0):.4f}")
