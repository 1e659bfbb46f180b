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
# 5. Check all of them by exact enumeration, and empirically on real models.
# 6. Implement exercises 2.1–2.4 and grade them.
#
# Notation as in chapter 1: $p$ target, $q$ draft, candidates $x_0, \dots, x_{n-1}$ tried in order.

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

V = 6
g = torch.Generator().manual_seed(0)
p = sampling.probs(1.5 * torch.randn(V, generator=g, dtype=torch.float64), temperature=1.0)  # target [V]
q = sampling.probs(1.5 * torch.randn(V, generator=g, dtype=torch.float64), temperature=1.0)  # draft  [V]
print("p =", [round(v, 3) for v in p.tolist()])
print("q =", [round(v, 3) for v in q.tolist()])
print(f"alpha (one candidate) = {vf.acceptance_rate(p, q).item():.4f}")

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

# %%
show(vf._mss_replacement)


# %% [markdown]
# ### A naive version for teaching
#
# MSS with replacement in plain Python lists; the next cell asserts that the exact joint
# law of (candidates, accepted index, emitted token) equals that of the library's
# `verify_candidates(..., mode="mss_replacement")`, with the candidates themselves drawn
# i.i.d. from $q$ inside the enumeration.

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

# %% [markdown]
# ## 2. Without replacement: recursive rejection sampling
#
# Drawing candidates i.i.d. wastes slots on duplicates. Drawing them **without
# replacement** gives $n$ distinct tokens, but then candidate $i$ comes from
# $q_i$ = $q$ with $x_0..x_{i-1}$ removed and renormalised, not from $q$. The proof above
# goes through if every round uses the distribution its candidate actually came from:
# round $i$ is a Leviathan step of $p_i$ against $q_i$, and after rejecting $x_i$
#
# $$
# p_{i+1} = \mathrm{norm}(\max(0, p_i - q_i)), \qquad q_{i+1} = \mathrm{norm}(q_i \text{ with } x_i \text{ set to } 0).
# $$
#
# Given the rejection, $x_{i+1} \sim q_{i+1}$ (the next draw without replacement), so the
# induction step holds with $q_i$ in place of $q$ (Jeon et al. 2024; Yang et al. 2024).
# Note $p_{i+1}(x_i) = 0$: a rejection means $p_i(x_i) < q_i(x_i)$.
#
# Each rule is exact only for its own way of drawing. The table gives the exact law of the
# emitted token against $p$ ($n = 3$) for each rule with its own drafting, and for distinct
# drafts verified with the i.i.d. rule. (The other mismatch cannot even be run: the
# without-replacement rule refuses repeated candidates, which its drafting cannot produce.)

# %%
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

# %% [markdown]
# ## 3. One-hot $q$: deterministic drafts
#
# EAGLE's drafts are the **top-k** tokens of the draft model: a deterministic function of
# the context, not samples. There is no $q$ the candidates were "drawn from" — or rather,
# conditional on the context, candidate $x_i$ was drawn from the point mass
# $\mathrm{one\_hot}(x_i)$. Plug that into MSS: round $i$ accepts $x_i$ with probability
# $\min(1, p_i(x_i)/1) = p_i(x_i)$, and the residual
# $\mathrm{norm}(\max(0, p_i - \mathrm{one\_hot}(x_i)))$ is just $p_i$ with $x_i$ removed.
#
# **What it assumes:** the candidates must not depend on the verifier's random coins
# (they may depend on the context, and they may even be sampled beforehand — the argument
# is conditional on them). Then each round is an exact Leviathan step against a point mass,
# and the output has law $p$. What one-hot $q$ gives up is acceptance: a sampled draft that
# matches $p$ well is accepted with probability $\min(1, p/q)$, a one-hot one only with
# $p(x)$. Using the real-$q$ rule on top-k drafts is wrong (a control below).

# %%
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


# %% [markdown]
# ### How much do more candidates help?
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

# %% [markdown]
# ## 4. Trees, level by level
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

# %%
show(vf.verify_tree)

# %%
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
    r = vf.verify_tree(list(range(-1, k - 1)), xs, Pc, Qc, mode="chain", generator=torch.Generator().manual_seed(seed))
    mismatches += (len(r.path), r.next_token) != (n, nxt)
assert mismatches == 0
chain = ex.sequence_distribution(lambda c, ch: ex.chain_step(lm, c, k, ch), 2)
tree = ex.sequence_distribution(lambda c, ch: ex.tree_step(lm, c, [1] * k, "chain", ch), 2)
print(f"200 seeded draws: verify_tree(chain) == verify_chain every time; "
      f"exact laws of 2 tokens differ by {ex.max_abs_error(chain, tree):.1e}")

# %% [markdown]
# ## 5. Exact enumeration of every rule
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
# ## 6. Real models: MSS at the first position
#
# The GPT-2 / DistilGPT-2 pair (or the tiny presets when no hub is reachable; the cell says
# which) at the first generated position: $n = 3$ candidates per rule, verified with MSS,
# compared with direct sampling from $p$.

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

# %% [markdown]
# ## 7. Timing on SmolLM2-135M (on this CPU)
#
# Greedy decoding with the distilled draft (chain SpS, $k$ = 2 and 4) and with prompt lookup,
# a drafter whose drafts are deterministic n-gram copies and are verified as one-hot $q$,
# against plain decoding. Trees for real models come with EAGLE (chapters 3–5). The prompt
# asks for text that repeats itself, which is where prompt lookup shines.

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
prompt = "Copy this list exactly, one item per line: apples, bananas, cherries, dates, figs, grapes, lemons."
drafters = {f"SpS, distilled draft, k={k}": DraftModel(smol_draft, k=k) for k in (2, 4)} if smol_draft is not None else {}
drafters["prompt lookup (one-hot q), k=4"] = PromptLookup(k=4)

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
# Implement the functions in `exercises/ch02_multi_round.py` (generated from `solutions/`; same
# signatures and docstrings). All randomness goes through the `chooser` argument, so the
# grader can enumerate every random outcome of *your* code and compare its exact law with
# the target and with minispec's own implementation.
#
# | exercise | function | task |
# |---|---|---|
# | 2.1 | `mss_with_replacement` | MSS for i.i.d. candidates: residual of $p$ after each rejection |
# | 2.2 | `mss_without_replacement` | recursive rejection sampling: $q$ loses each rejected candidate |
# | 2.3 | `mss_onehot` | one-hot $q$: accept with $p_i(x_i)$, else remove $x_i$ from $p$ |
# | 2.4 | `verify_tree` | walk the tree level by level with 2.1 / 2.2 / 2.3 |
#
# Grade from a terminal with `python -m minispec grade 2` or
# `pytest tests/test_exercises.py -m ch02 --impl exercises`; in this notebook with
# `check("2.1")` (one exercise) or `check(2)` (the chapter). The cell below prints
# the stub of the first exercise, then grades your file: it reports failures, it does not
# raise, so until you fill in the stubs every line says "not implemented yet".

# %%
import inspect
from minispec.grading import check, load_impl

mine = load_impl(2, "exercises")
print(inspect.getsource(mine.mss_with_replacement))
check(2, impl="exercises")

# %%
# What a finished chapter looks like: the reference answers in solutions/ pass every check.
check(2, impl="solutions")
