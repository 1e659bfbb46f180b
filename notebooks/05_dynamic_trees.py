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

# %% [markdown]
# # Chapter 5 — Dynamic draft trees (EAGLE-2) and the tree dispatcher
#
# A static tree (chapter 4) spends the same nodes on every step, whether the draft is sure of
# itself or not. EAGLE-2 (Li et al. 2024) observed that a draft's **confidence is calibrated**:
# a draft token with probability 0.9 is accepted far more often than one with 0.2. So the
# product of draft probabilities along a path estimates the chance that the target accepts
# the whole path (its *global acceptance probability*), and the tree can be grown where that
# value is high: **expand** the most promising nodes level by level, then **rerank** all the
# candidates and keep the best `total_tokens`. Whether a bigger tree pays depends on the
# hardware, so a **tree dispatcher** measures the cost of verification on *this* machine and
# picks the tree with the best predicted tokens/s.
#
# **Learning objectives**
# 1. Derive why, under greedy verification and a calibrated draft, the product of draft
#    probabilities along a path estimates the probability that the target accepts it, and
#    measure the calibration of a real draft.
# 2. Write $E[\tau]$ of any tree as $1 + \sum_v P(\text{accept } v)$ and estimate it for a tree
#    drafted on SmolLM2, next to the measured $\tau$.
# 3. Build an EAGLE-2 tree by hand (expand, rerank) on a toy model and check it against
#    minispec's `TreeDrafter`; see which candidates a real rerank keeps and drops.
# 4. Extend chapter 1's cost model to trees, $\text{speedup} \approx E[\tau] / (c_\text{draft} +
#    v(N))$ with a verify cost $v(N)$ that grows with the tree, and use it as the dispatcher does
#    to choose the size of tree that pays on a machine.
# 5. Translate minispec's `D,K,N` into upstream EAGLE's `depth`, `top_k`, `total_token`.
# 6. Implement exercises 5.1–5.4, each right after the section that teaches it.
#
# Notation as in chapters 1–4: $q$ draft, $p$ target, $\tau$ tokens committed per target forward
# (bonus included, vanilla = 1). A node's **score** is the log of the product of draft
# probabilities along its path, so "product" is a sum of log-probabilities in the code.
#
# **Exercises.** You write them in `exercises/ch05_dynamic_trees.py`; each check cell below
# grades your file and prints PASS or FAIL (it never raises). From a terminal:
# `python -m minispec grade 5`. Library code: `minispec/drafters/tree_drafter.py`
# (`TreeDrafter._dynamic`, `expand_level`, `rerank`) and `minispec/auto.py`.

# %%
# Versions, FAST mode and the device: the first cell of every chapter (minispec.lab.notebook.setup).
import os, platform

import minispec
import torch
from minispec.lab.notebook import setup, show

FAST = setup()  # MINISPEC_FAST=1: smaller sample counts and shorter generations (CI sets it)

# %%
import inspect
import math
import random
from contextlib import contextmanager

import matplotlib.pyplot as plt
import numpy as np

from minispec import generate
from minispec.drafters import TreeDrafter, TreeSpec, tree_drafter
from minispec.grading import check  # check("5.1"): grade one exercise (prints, never raises)
from minispec.methods import Methods, shipped_head
from minispec.prompts import own_prompts
from minispec.sampling import GREEDY
from minispec.tokenizer import encode_prompt


# The target of this chapter, and its drafter: the shipped EAGLE-1/2 head when it is there
# (chapter 3), else the shipped distilled draft model. Both implement the same two hooks,
# `_start` (logits of the root's children) and `_extend` (logits of the children of a level of
# new nodes), and `TreeDrafter` builds chains, static and dynamic trees from them.
smol, smol_tok = minispec.load("smollm2-135m")
methods = Methods(smol)
BASE = "eagle2" if shipped_head("eagle").is_file() else "sps"
print(f"drafter for this chapter: {BASE} ({'EAGLE-1/2 head' if BASE == 'eagle2' else 'distilled draft model'})")

# %% [markdown]
# ## 1. Why the product of draft probabilities estimates acceptance
#
# Take a draft tree with root $r$ (the last committed token) and greedy verification: one
# target forward gives the target's argmax $y(u)$ after the root and after every node $u$. A
# node $v$ at depth $d$, with path $r = v_0 \to v_1 \to \dots \to v_d = v$ and tokens
# $x_{v_1}, \dots, x_{v_d}$, is accepted iff **every** token on its path is the target's choice:
#
# $$ v \text{ accepted} \iff x_{v_i} = y(v_{i-1}) \quad \text{for } i = 1, \dots, d. $$
#
# By the chain rule,
#
# $$ P(v \text{ accepted}) = \prod_{i=1}^{d} P\big(x_{v_i} = y(v_{i-1}) \,\big|\, v_{i-1} \text{ accepted}\big). $$
#
# Each factor is "the target agrees with the draft's token at this position, given the context
# so far". The draft model gave that token probability $q(x_{v_i} \mid \text{path})$. The draft
# is **calibrated** if, among all the drafted tokens it gives probability about $c$, a fraction
# about $c$ is the target's choice. Then each factor is $\approx q(x_{v_i} \mid \text{path})$
# and
#
# $$ P(v \text{ accepted}) \approx \prod_{i=1}^{d} q(x_{v_i} \mid x_{v_1}, \dots, x_{v_{i-1}})
#    = e^{\text{score}(v)}, \qquad \text{score}(v) = \sum_{i=1}^{d} \log q(x_{v_i} \mid \dots). $$
#
# This is EAGLE-2's *global acceptance probability* of $v$. It is an estimate: the draft does
# not know the target, and calibration holds on average over contexts, not at each one. With a
# sampling target and one-hot $q$ (chapter 2) the factor becomes $p(x_{v_i} \mid \text{path})$,
# and calibration means $q$ tracks $p$ on average; the same argument applies.
#
# The premise, measured: run greedy speculative decoding with a chain, record the draft's
# probability of each drafted token and whether the target accepted it (only drafts whose
# predecessors were accepted were *tested*), and bin.

# %%
@contextmanager
def recording(drafter, log):
    """Within the block, each proposal of a chain drafter appends (tokens, the draft probability
    of each token) to ``log``: the hooks _start / _extend are wrapped, then restored."""
    propose, start, extend, confs = drafter.propose, drafter._start, drafter._extend, []
    def s():
        out = start(); confs.append(out); return out
    def e(tokens, parents):
        out = extend(tokens, parents); confs.append(out[0]); return out
    def p(params, budget, generator=None):
        confs.clear()
        tree = propose(params, budget, generator)
        log.append((tree.tokens, [float(torch.softmax(l.float(), -1)[t]) for l, t in zip(confs, tree.tokens)]))
        return tree
    drafter._start, drafter._extend, drafter.propose = s, e, p
    try:
        yield drafter
    finally:
        del drafter._start, drafter._extend, drafter.propose

pairs = []  # (draft probability, accepted)
prompts = [p["prompt"] for p in own_prompts()][: 2 if FAST else 6]
for pr in prompts:
    log = []
    with recording(methods.drafter(f"{BASE}@chain:4"), log) as d:
        r = generate(smol, smol_tok, pr, drafter=d, max_new_tokens=32 if FAST else 128)
    for (tokens, confs), emitted in zip(log, r.stats.tokens_per_step[1:]):  # entry 0 is the prefill
        accepted = emitted - 1  # the bonus / correction token is not a draft
        for j, c in enumerate(confs):
            if j <= accepted:  # tested: the earlier drafts were accepted
                pairs.append((c, j < accepted))
conf = np.array([c for c, _ in pairs]); acc = np.array([a for _, a in pairs], dtype=float)
bins = np.linspace(0, 1, 6)
idx = np.clip(np.digitize(conf, bins) - 1, 0, 4)
xs = [conf[idx == b].mean() for b in range(5) if (idx == b).any()]
ys = [acc[idx == b].mean() for b in range(5) if (idx == b).any()]
ns = [int((idx == b).sum()) for b in range(5) if (idx == b).any()]
plt.figure(figsize=(5, 4)); plt.plot([0, 1], [0, 1], "k--", lw=1, label="perfect calibration")
plt.plot(xs, ys, "o-", label=f"{BASE} draft ({len(pairs)} tested drafts)")
for x, y, n in zip(xs, ys, ns):
    plt.annotate(str(n), (x, y), xytext=(4, -10), textcoords="offset points", fontsize=8)
plt.xlabel("draft probability of the drafted token"); plt.ylabel("acceptance rate"); plt.legend()
plt.title("confidence vs acceptance (greedy, SmolLM2-135M)"); plt.show()
print(f"{len(pairs)} tested drafts; acceptance {acc.mean():.2f}, mean confidence {conf.mean():.2f} "
      f"(a calibrated draft has the two equal on average)")

# %% [markdown]
# ## 2. $E[\tau]$ of a tree
#
# Siblings carry distinct tokens, so at most one child of an accepted node matches the
# target's argmax: the accepted nodes form one path from the root, and the step commits
# $\tau = 1 + \#\{\text{accepted nodes}\}$ tokens (the $+1$ is the bonus token). By linearity of
# expectation,
#
# $$ E[\tau] = 1 + \sum_{v \in T} P(v \text{ accepted}) \;\approx\; 1 + \sum_{v \in T} e^{\text{score}(v)} . $$
#
# For a chain with the same acceptance $\alpha$ at every position this is chapter 1's
# $1 + \alpha + \dots + \alpha^k$. For a tree it says what to build: with a budget of $N$
# nodes, keep the $N$ nodes of highest score. That is exactly EAGLE-2's **rerank**, and it is
# automatically a tree, because a child's score is its parent's plus $\log q \le 0$.
#
# A sanity check on a toy model where calibration holds *by construction*: a "target" whose
# choice after each path is drawn from the draft's own $q$. The toy draft is a dictionary
# from paths (tuples of tokens below the root) to next-token probabilities over a vocabulary
# of 5, filled lazily from a seeded generator. Any tree works for the identity; we use a
# small hand-made one.

# %%
V_TOY = 5
TOY: dict[tuple, list[float]] = {}  # path below the root -> draft probabilities of the next token [V_TOY]

def toy_q(path: tuple) -> list[float]:
    """The toy draft: next-token probabilities after ``path`` (seeded by the path, so fixed)."""
    if path not in TOY:
        rng = random.Random(f"toy-{path}")
        w = [rng.random() ** 3 for _ in range(V_TOY)]  # cubed: some paths confident, some not
        TOY[path] = [x / sum(w) for x in w]
    return TOY[path]

def path_product(path: tuple) -> float:
    """Product of the draft's probabilities along ``path``: the estimate of P(accepted)."""
    return math.prod(toy_q(path[:i])[t] for i, t in enumerate(path))

def top(path, k):
    """The k most likely next tokens of the toy draft after ``path``."""
    return sorted(range(V_TOY), key=lambda t: -toy_q(path)[t])[:k]

toy_tree = [(a,) for a in top((), 2)] + [(a, b) for a in top((), 2) for b in top((a,), 2)]  # nodes, as paths
toy_tree.append(toy_tree[2] + (top(toy_tree[2], 1)[0],))  # and one node at depth 3

def simulate_tau(tree_paths, n, seed=0):
    """Tokens per step, n steps, when the target's choice after each path is drawn from toy_q (calibrated)."""
    rng, taus, nodes = random.Random(seed), [], set(tree_paths)
    for _ in range(n):
        path = ()
        while True:  # walk down while the target's choice is a node of the tree
            y = rng.choices(range(V_TOY), weights=toy_q(path))[0]
            if path + (y,) not in nodes:
                break
            path += (y,)
        taus.append(1 + len(path))  # accepted drafts + the bonus token
    return np.array(taus)

predicted = 1 + sum(path_product(v) for v in toy_tree)
taus = simulate_tau(toy_tree, 4000 if FAST else 40000)
se = taus.std() / len(taus) ** 0.5
print(f"toy tree {toy_tree}: E[tau] = 1 + sum of path products = {predicted:.3f}; "
      f"simulated with a calibrated target: {taus.mean():.3f} +- {se:.3f} over {len(taus)} steps")
assert abs(predicted - taus.mean()) < 4 * se

# %% [markdown]
# ## 3. Expand and rerank, by hand on the toy model
#
# Enumerating every path is out of the question ($V^d$ of them), so EAGLE-2 grows the tree
# greedily, in two phases, for a tree of depth $D$, branching $K$ and $N$ nodes:
#
# 1. **expand** ($D$ levels): level 1 is the root's $K$ most likely children. At each further
#    level, the $K$ best-scoring candidates of the level before (the *frontier*) each get their
#    $K$ most likely children. One draft forward per level: the frontier's $K$ nodes go
#    through the drafter together, with the tree mask of chapter 4. Every child is a
#    **candidate**: $K + (D - 1)K^2$ of them.
# 2. **rerank**: keep the $N$ best-scoring candidates of all levels, ties to the shallower
#    one (so a child with $q = 1$ never displaces its parent), in topological order.
#
# Exercises 5.1-5.3 build it on the toy model of section 2 (`toy_q`); after them, a naive version
# in plain Python and minispec's `TreeDrafter` draft the same trees.

# %% [markdown]
# ### Exercise 5.1 — `expand_level(frontier_scores, child_logp, top_k)`
#
# The library's version of one expansion works on tensors: $F$ frontier nodes with their
# scores, and a matrix of the draft's log-probabilities of each one's children.
#
# *Hint.* What is a child's score, given its parent's? "The best children" appears twice in
# the expansion: once per parent, once for the whole level. Which of the two decides the next
# frontier? `torch.topk` works on rows as well as on flat vectors; the docstring fixes the
# order of the outputs.

# %%
check("5.1")

# %% [markdown]
# ### Exercise 5.2 — `rerank(scores, parents_cand, depths, total_tokens)`
#
# *Hint.* Which sort key picks the best candidates, and what must it say about equal scores so
# that a parent is never dropped while its child is kept? The output must list parents before
# their children: which second ordering guarantees that? Parents are returned as positions in
# *your* output list, not as candidate ids.

# %%
check("5.2")

# %% [markdown]
# ### Exercise 5.3 — `dynamic_tree(next_logits, depth, top_k, total_tokens)`
#
# A whole tree with your 5.1 and 5.2, on the same kind of toy model as above (logits from a
# path). *Hint.* Between levels you need, for each frontier node, its score and its path (to
# ask `next_logits` for its children). Which per-candidate lists must you keep so that rerank
# gets everything it needs at the end?

# %%
check("5.3")

# %% [markdown]
# ### A naive version, and the library's `TreeDrafter`
#
# Now that you have written them: a naive version in plain Python, straight from the two
# sentences at the top of this section: a candidate is a dictionary, scores are sums of Python
# `math.log`s, "best" is `sorted`.

# %%
def naive_dynamic_tree(q_of, depth, top_k, total_tokens, record=None):
    """EAGLE-2 by hand. q_of(path) -> next-token probabilities (a list). Returns (tokens, parents)
    in topological order, parents as indices into the returned nodes (-1 = the root)."""
    cands = []  # every candidate: path, parent (a candidate id, -1 = the root), depth, score
    frontier = [-1]  # level 1 expands the root alone
    for d in range(1, depth + 1):
        level = []
        for f in frontier:
            path, base = (cands[f]["path"], cands[f]["score"]) if f >= 0 else ((), 0.0)
            q = q_of(path)
            for t in sorted(range(len(q)), key=lambda t: -q[t])[:top_k]:  # the top_k children
                cands.append(dict(path=path + (t,), parent=f, depth=d, score=base + math.log(q[t])))
                level.append(len(cands) - 1)
        frontier = sorted(level, key=lambda c: -cands[c]["score"])[:top_k]  # the best of the whole level
    best = sorted(range(len(cands)), key=lambda c: (-cands[c]["score"], cands[c]["depth"], c))[:total_tokens]
    kept = sorted(best, key=lambda c: (cands[c]["depth"], c))  # topological order
    if record is not None:
        record.extend(dict(c, kept=i in best) for i, c in enumerate(cands))
    pos = {c: i for i, c in enumerate(kept)}
    return ([cands[c]["path"][-1] for c in kept],
            [pos[cands[c]["parent"]] if cands[c]["parent"] >= 0 else -1 for c in kept])

cands = []
tokens, parents = naive_dynamic_tree(toy_q, 3, 2, 5, record=cands)
for c in cands:
    print(f"  depth {c['depth']}  path {str(c['path']):<10} q-product {math.exp(c['score']):.3f}  "
          f"{'kept' if c['kept'] else 'dropped'}")
print(f"tree (3,2,5): tokens {tokens}, parents {parents}; "
      f"E[tau] estimate {1 + sum(math.exp(c['score']) for c in cands if c['kept']):.3f}")

# %% [markdown]
# The same toy model through minispec's own `TreeDrafter`: `PathDrafter` (from the grading
# module) is a `TreeDrafter` whose `_start` / `_extend` hooks read a `next_logits(path)`
# function, so `library_dynamic_tree` runs `TreeDrafter._dynamic` itself. The log of the toy
# probabilities serves as logits (the log-softmax gives them back). The two must agree on
# every shape.

# %%
from minispec.grading.ch05 import PathDrafter, library_dynamic_tree  # noqa: F401  (PathDrafter: the toy drafter)

def toy_logits(path):
    return torch.tensor(toy_q(tuple(path)), dtype=torch.float64).log()  # [V_TOY]

for depth, top_k, total in [(1, 3, 3), (2, 2, 4), (3, 2, 5), (3, 3, 9), (4, 3, 12), (4, 5, 30)]:
    mine = naive_dynamic_tree(toy_q, depth, top_k, total)
    lib = library_dynamic_tree(toy_logits, depth, top_k, total)
    assert mine == lib, (depth, top_k, total, mine, lib)
print("the naive expand / rerank drafts exactly TreeDrafter's tree on every shape tried")

# %% [markdown]
# ### The library's version
#
# Now that you have written them: the two phases in `minispec/drafters/tree_drafter.py`, and
# `TreeDrafter._dynamic`, which calls the drafter's hooks one level at a time (a frontier
# node's logits come from `_extend`, which runs the $K$ frontier nodes through the drafter in
# one batch).

# %%
show(tree_drafter.expand_level)
show(tree_drafter.rerank)
show(TreeDrafter._dynamic)

# %% [markdown]
# ## 4. A dynamic tree on SmolLM2-135M: its $E[\tau]$, and what the rerank keeps
#
# The same algorithm on the real drafter, for one step after a prompt. To see the rerank at
# work we record every candidate: `spying` wraps the library's `expand_level` and `rerank` for
# the duration of a block (`_dynamic` looks them up in `tree_drafter` at each call) and logs
# their inputs and outputs, without changing what they return.

# %%
from minispec.drafters.base import Features

@contextmanager
def spying(log):
    """Within the block, each dynamic tree appends its candidates to ``log``: a dict with the
    candidates' tokens, scores, parent candidates, depths and the kept ones. Restores the
    library's functions afterwards."""
    real_expand, real_rerank = tree_drafter.expand_level, tree_drafter.rerank
    cur = {}
    def expand(frontier_scores, child_logp, top_k):
        s, t, f, nxt = real_expand(frontier_scores, child_logp, top_k)
        if frontier_scores.numel() == 1 and not cur.get("open"):  # level 1: a new tree
            cur.clear(); cur.update(open=True, tokens=[])
        cur["tokens"] += t.tolist()
        return s, t, f, nxt
    def rerank(scores, parents_cand, depths, total_tokens):
        nodes, parents = real_rerank(scores, parents_cand, depths, total_tokens)
        log.append(dict(tokens=cur["tokens"], scores=list(scores), parents=list(parents_cand), depths=list(depths),
                        kept=list(nodes)))
        cur["open"] = False
        return nodes, parents
    tree_drafter.expand_level, tree_drafter.rerank = expand, rerank
    try:
        yield log
    finally:
        tree_drafter.expand_level, tree_drafter.rerank = real_expand, real_rerank

def estimated_tau(rec):
    """1 + the sum of the kept nodes' path products: E[tau] of the tree for a calibrated draft."""
    return 1 + sum(math.exp(rec["scores"][c]) for c in rec["kept"])

prompt = "List three facts about the planet Mars."
ctx = encode_prompt(smol_tok, prompt)
spec = TreeSpec.parse("5,4,16")
drafter = methods.drafter(f"{BASE}@5/4/16")
with torch.inference_mode():  # the prefill: the first token (the root) and the features of the prompt
    out = smol(torch.tensor([ctx]), hidden_layers=drafter.target_layers)
root = int(out.logits[0, -1].argmax())
features = Features(out.hidden[0], {i: h[0] for i, h in out.layer_inputs.items()})
drafter.prefill(ctx + [root], features if drafter.reads_features else None)  # EAGLE heads read features
spy = []
with spying(spy):
    tree = drafter.propose(GREEDY, budget=8)
rec = spy[0]
assert [rec["tokens"][c] for c in rec["kept"]] == tree.tokens  # the spy saw this very tree
print(f"root: {smol_tok.decode([root])!r}; {len(tree)} nodes kept of {len(rec['scores'])} candidates, depth {tree.depth}")
for path in tree.paths():
    print("  " + " | ".join(repr(smol_tok.decode([tree.tokens[i]])) for i in path))
print(f"E[tau] estimate of this tree: 1 + sum of path products = {estimated_tau(rec):.2f} tokens per step")


# %%
def draw(tree, labels, ax, title):
    """Tree as a graph: x = depth, y = order of the leaves below each node."""
    depths, kids = tree.depths(), tree.children()[1:]  # children() row 0 is the root's
    ys, next_y = {}, [0]
    def place(i):
        if not kids[i]:
            ys[i] = next_y[0]; next_y[0] += 1
        else:
            for c in kids[i]:
                place(c)
            ys[i] = sum(ys[c] for c in kids[i]) / len(kids[i])
    roots = [i for i, p in enumerate(tree.parents) if p == -1]
    for r in roots:
        place(r)
    y0 = sum(ys[r] for r in roots) / len(roots)
    for i, p in enumerate(tree.parents):
        px, py = (0, y0) if p == -1 else (depths[p], ys[p])
        ax.plot([px, depths[i]], [py, ys[i]], color="0.7", zorder=1)
    ax.scatter([0], [y0], s=250, color="black", zorder=2)
    ax.scatter(depths, [ys[i] for i in range(len(tree))], s=250, color="tab:blue", zorder=2)
    for i in range(len(tree)):
        ax.annotate(labels[i], (depths[i], ys[i]), xytext=(8, -3), textcoords="offset points", fontsize=8)
    ax.set_title(title); ax.set_xlabel("depth"); ax.set_yticks([])

fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw=dict(width_ratios=[3, 2]))
draw(tree, [repr(smol_tok.decode([t])) for t in tree.tokens], a, f"EAGLE-2 tree ({BASE}), {spec.name}")
b.imshow(tree.mask().numpy(), cmap="Blues"); b.set_title("tree attention mask (row 0 = root)")
b.set_xlabel("key (node + 1)"); b.set_ylabel("query (node + 1)")
plt.tight_layout(); plt.show()

# %% [markdown]
# ### Kept vs dropped candidates
#
# Every candidate of that step, by depth and score (log path product). The rerank keeps the
# $N = 16$ highest (blue), whatever their depth: a cut at a horizontal line. Ringed candidates
# were on a frontier, so they were expanded (they have candidate children): EAGLE-2 expands only $K$ nodes per level, so a
# kept node may have no candidate children at all, and a dropped node may have been expanded
# (its children score lower still and are dropped too). Grey lines join a candidate to its
# parent.

# %%
sc, dp, pa = np.array(rec["scores"]), np.array(rec["depths"]), rec["parents"]
kept = np.zeros(len(sc), dtype=bool); kept[rec["kept"]] = True
jit = np.random.default_rng(0).uniform(-0.15, 0.15, len(sc))
x = dp + jit
fig, ax = plt.subplots(figsize=(8, 5))
for c, p in enumerate(pa):
    if p >= 0:
        ax.plot([x[p], x[c]], [sc[p], sc[c]], color="0.85", lw=0.8, zorder=1)
ax.scatter(x[~kept], sc[~kept], color="0.6", s=25, label=f"dropped ({(~kept).sum()})", zorder=2)
ax.scatter(x[kept], sc[kept], color="tab:blue", s=40, label=f"kept by rerank ({kept.sum()})", zorder=3)
fr = sorted({p for p in pa if p >= 0})  # expanded: the candidates that have children
ax.scatter(x[fr], sc[fr], facecolors="none", edgecolors="black", s=110, label="expanded (frontier)", zorder=4)
cut = sc[kept].min()
ax.axhline(cut, color="tab:red", ls="--", lw=1, label=f"cut: {kept.sum()}th best score")
for c in np.argsort(-sc)[:6]:
    ax.annotate(repr(smol_tok.decode([rec["tokens"][c]])), (x[c], sc[c]), xytext=(6, 2), textcoords="offset points", fontsize=8)
ax.set_xticks(range(1, spec.depth + 1)); ax.set_xlabel("depth"); ax.set_ylabel("score = log(product of q along the path)")
ax.set_title(f"all {len(sc)} candidates of one EAGLE-2 step ({BASE}, {spec.name})"); ax.legend(fontsize=8, loc="lower left")
plt.show()
print("kept per depth:", {d: int(kept[dp == d].sum()) for d in range(1, spec.depth + 1)},
      "| candidates per depth:", {d: int((dp == d).sum()) for d in range(1, spec.depth + 1)})

# %% [markdown]
# ## 5. Chain vs static tree vs dynamic tree on this machine
#
# Same prompts, greedy, every output checked against vanilla. `tau` counts the bonus token
# and the prefill (vanilla = 1.00); `tok/step` is the mean over decode steps alone, the number
# section 2's formula predicts. For the dynamic trees the spy records every tree, and
# `E[tau] est.` is the mean over steps of $1 + \sum_v e^{\text{score}(v)}$: if the draft were
# perfectly calibrated it would match `tok/step`; an overconfident draft predicts more than it
# gets. On a CPU a target forward over $N + 1$ tokens costs noticeably more than over one, so a
# bigger $\tau$ does not always mean more tokens/s: section 6 measures why.

# %%
configs = [f"{BASE}@chain:4", f"{BASE}@eagle", f"{BASE}@4/4/12", f"{BASE}@5/8/32"]
n_new = 32 if FAST else 128
generate(smol, smol_tok, "Hi", max_new_tokens=4)  # warm-up
runs = {name: [] for name in ["vanilla"] + configs}
trees = {name: [] for name in configs}  # spied candidates of every dynamic tree
for pr in prompts[:1] if FAST else prompts:  # interleaved, so machine drift affects every method alike
    ref = generate(smol, smol_tok, pr, max_new_tokens=n_new)
    runs["vanilla"].append(ref)
    for name in configs:
        with spying(trees[name]):
            r = generate(smol, smol_tok, pr, drafter=methods.drafter(name), max_new_tokens=n_new)
        assert r.tokens == ref.tokens, f"{name}: output differs from vanilla greedy"
        runs[name].append(r)
print(f"device: this machine's CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads; "
      f"{len(runs['vanilla'])} prompts x {n_new} tokens, greedy")
print(f"{'method':<18} {'nodes':>5} {'tau':>5} {'tok/step':>8} {'E[tau] est.':>11} {'tokens/s':>9}")
for name, rs in runs.items():
    toks = sum(r.stats.new_tokens for r in rs)
    tau = toks / sum(r.stats.target_forwards for r in rs)
    steps = [n for r in rs for n in r.stats.tokens_per_step[1:]]  # entry 0 is the prefill
    tps = toks / sum(r.stats.total_s for r in rs)
    tspec = methods.tree_of(name) if name != "vanilla" else None
    est = f"{np.mean([estimated_tau(t) for t in trees[name]]):.2f}" if trees.get(name) else "-"
    print(f"{name:<18} {tspec.max_nodes if tspec else 0:>5} {tau:>5.2f} {np.mean(steps):>8.2f} {est:>11} {tps:>9.1f}")
print("every speculative output equals vanilla greedy")

# %% [markdown]
# Chapter 1's cost model, closed on these runs (`minispec.lab.cost_check`, in units of one vanilla
# decode step): the i.i.d. formula with the pooled $\alpha$ and $k$ = the tree's depth, then the
# same with $\alpha$ by depth ($1 + \alpha_1 + \alpha_1\alpha_2 + \dots$ holds for a tree too: it is
# the probability of reaching each depth), then with the measured verify cost $v(N)$ and loop
# time $\ell$, which closes on the measured decode speedup. Section 6 explains the gap.

# %%
from minispec.lab.cost_check import cost_check

print(f"{'method':<18} {'alpha':>5} {'c':>6} {'v(N)':>6} {'loop':>6} | {'Leviathan':>9} {'by depth':>8} "
      f"{'+verify':>8} {'+loop':>7} {'measured':>8}")
for name in configs:
    cc = cost_check(runs["vanilla"], runs[name])
    pred = [line[3] for line in cc.predictions()]
    print(f"{name:<18} {cc.alpha:>5.2f} {cc.c:>6.3f} {cc.v:>6.2f} {cc.loop:>6.2f} | {pred[0]:>8.2f}x {pred[1]:>7.2f}x "
          f"{pred[3]:>7.2f}x {pred[4]:>6.2f}x {cc.measured:>7.2f}x")

# %% [markdown]
# ## 6. The cost model, from chapter 1's
#
# Chapter 1 measured time in target forwards: a chain step costs $k$ draft forwards at $c$ each
# plus **one** target forward, and commits $E[\tau]$ tokens, so
# $\text{speedup} = E[\tau] / (kc + 1)$. Two of its assumptions break for trees:
#
# - the target forward verifies $N + 1$ tokens, and its cost $t_\text{verify}(N)$ grows with
#   $N$: almost flat on a GPU at batch 1 until the matrix units fill up, nearly linear on a CPU;
# - the rest of a step (sampling, verification, KV compaction, Python) is not free.
#
# In seconds, one step costs $t_\text{draft} + t_\text{verify}(N) + t_\text{loop}$, so
#
# $$ \text{tokens/s} = \frac{E[\tau]}{t_\text{draft} + t_\text{verify}(N) + t_\text{loop}}, \qquad
#    \text{speedup} \approx \frac{E[\tau]}{c_\text{draft} + v(N) + \ell}, $$
#
# with $v(N) = t_\text{verify}(N) / t_\text{verify}(0) \ge 1$, $c_\text{draft} = t_\text{draft} /
# t_\text{verify}(0)$ and $\ell$ the extra loop time, all in units of one vanilla forward.
# Chapter 1 is the case $v(N) = 1$, $c_\text{draft} = kc$, $\ell = 0$. For a dynamic tree
# $c_\text{draft}$ is about $D$ draft forwards (one per level, over $K$ nodes), and
# $E[\tau](N)$ of the best tree of $N$ nodes (section 2 says which nodes those are) is
# **concave** in $N$: each node added is worth less than the ones before. A concave gain over a
# growing cost has a best $N$, and it depends on the machine through $v(N)$.
# `minispec.auto.predicted_tokens_per_s` prices every candidate tree this way.

# %% [markdown]
# ### Exercise 5.4 — `best_tree_size(path_probs, verify_s, draft_s, max_nodes)`
#
# The dispatcher's question for one step, answered exactly: the candidates of an expansion
# (their path products, in any order), a measured verify-time curve `verify_s[n]` (a target
# forward over the root and $n$ nodes) and the time to draft a tree. Which number of nodes
# $n \le$ `max_nodes` gives the most tokens per second, and how many?
#
# *Hint.* Section 2 says what a tree of $n$ nodes is worth; which $n$ of the candidates would
# you keep, and do they form a tree? What does a step with $n = 0$ cost (vanilla decoding
# drafts nothing)? The speed need not be monotone in $n$, so look at every $n$; on a tie keep
# the smaller tree. What if there are fewer candidates than the budget? The grader compares
# with a brute force over every subset of candidates, on ties, cases where vanilla wins, and
# the candidates of real expansions of the toy models.

# %%
check("5.4")

# %% [markdown]
# ### The verify-cost curve and the dispatcher
#
# `minispec.auto.verify_cost_curve` times one target forward of $N + 1$ tokens with a tree
# mask after a cached context. The dispatcher predicts each candidate's tokens/s as
# `tau / (t_verify(N) + t_draft + t_loop)` from a short calibration run and picks the best
# (`python -m minispec tune` does this from the command line and saves the choice that
# `--method auto` uses). Every candidate pays its own `t_loop`, the rest of its measured
# step time: prompt lookup drafts for free but still pays a longer verify and its own
# bookkeeping, and charging it vanilla's loop would flatter it.
#
# The choice depends on how the user decodes. Greedy, a drafted token is accepted whenever it is
# the target's argmax; sampled, with probability $\min(1, p(x)/q(x))$, so a drafter that copies
# (one-hot $q$) keeps only $p(x)$ of each copied token, while a head's proposals keep
# $\sum_x \min(p, q)$ on average. `auto.tune(..., params=SamplingParams(0.7))` calibrates
# sampled (seeded) and saves that choice apart from the greedy one; `auto` reads the one that
# matches the request.

# %%
import json
from pathlib import Path
from minispec import auto
from minispec.lab import tune as tuning, tune_report

show(auto.predicted_tokens_per_s)
sizes = (0, 4, 16, 32, 64) if FAST else auto.DEFAULT_SIZES
curve = tuning.verify_cost_curve(smol, sizes=sizes, context=256, reps=3 if FAST else 7)
plt.figure(figsize=(6, 4))
plt.plot(list(curve[1]), [s * 1e3 for s in curve[1].values()], "o-", label="this machine (CPU), batch 1")
results = Path(minispec.__file__).resolve().parents[1] / "benchmarks" / "results"
gpu = [f for f in sorted(results.rglob("tune_*.json")) if json.loads(f.read_text())["device"].get("cuda")]
if gpu:
    g = json.loads(gpu[-1].read_text())
    c = g["cost_curve"]["1"]
    plt.plot([int(n) for n in c], [s * 1e3 for s in c.values()], "s-", label=f"{g['device'].get('gpu', 'GPU')}, batch 1")
else:
    print("no GPU tune result is committed in benchmarks/results/ yet: CPU curve only")
plt.xlabel("tree size N (tokens verified = N + 1)"); plt.ylabel("target forward (ms)"); plt.legend()
plt.title("verify cost, SmolLM2-135M, 256 cached tokens"); plt.show()

# %% [markdown]
# The model applied to section 4's step: keeping the $N$ best of its candidates gives
# $E[\tau](N) = 1 + $ the sum of the $N$ largest path products; the measured curve gives
# $t_\text{verify}(N)$ (interpolated); the draft time of that tree is timed here. The loop time
# is left out, and this one step is a confident one (its $E[\tau]$ estimate is above the run
# averages of section 5), so the numbers are optimistic; the shape is the point: where the
# verify curve rises faster than the concave gain, a bigger tree stops paying.

# %%
import time
reps = 3 if FAST else 10
t0 = time.perf_counter()
for _ in range(reps):
    drafter.propose(GREEDY, budget=8)
draft_s = (time.perf_counter() - t0) / reps
ns = np.arange(0, len(sc) + 1)
tau_n = 1 + np.concatenate([[0.0], np.cumsum(np.sort(np.exp(sc))[::-1])])  # [N + 1] E[tau] of the best N
ks = sorted(curve[1])
verify_n = np.interp(ns, ks, [curve[1][k] for k in ks])  # [N + 1] seconds (flat beyond the last size)
pred = auto.predicted_tokens_per_s(torch.tensor(tau_n), torch.tensor(verify_n),
                                       torch.tensor(np.where(ns > 0, draft_s, 0.0))).numpy()
fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
a.plot(ns, tau_n); a.set(xlabel="N (nodes kept)", ylabel="E[tau] estimate", title="gain: concave in N")
b.plot(ns, pred); b.axhline(pred[0], color="0.5", ls="--", lw=1, label="vanilla")
b.plot([ns[pred.argmax()]], [pred.max()], "r*", markersize=12, label=f"best N = {ns[pred.argmax()]}")
b.set(xlabel="N (nodes kept)", ylabel="predicted tokens/s (no loop time)", title="this CPU"); b.legend()
plt.tight_layout(); plt.show()
print(f"draft time of the {spec.name} tree: {draft_s * 1e3:.1f} ms; verify {verify_n[0] * 1e3:.1f} ms at N=0, "
      f"{verify_n[-1] * 1e3:.1f} ms at N={ns[-1]}")
from minispec.grading import load_impl
n_ref, tps_ref = load_impl(5, "solutions").best_tree_size(np.exp(sc).tolist(), verify_n.tolist(), draft_s, len(sc))
print(f"exercise 5.4's reference answer on these numbers: N = {n_ref}, {tps_ref:.1f} tokens/s")
assert n_ref == ns[pred.argmax()]

# %% [markdown]
# ### Explore: the toy tree of section 3 on this machine's clock
#
# The sliders set $D$, $K$ and $N$ of an EAGLE-2 tree grown on section 3's toy model (by
# `naive_dynamic_tree`, drawn as in section 4, each node labelled with its token and its path
# product). Its $E[\tau]$ is $1 + $ the sum of the kept path products, exact for the toy's
# calibrated target (section 2). The predicted tokens/s prices that tree with this machine's
# numbers: the verify curve measured above at $N$ (`auto.interpolate`, extrapolated past
# the last size) and $D$ draft levels at the cost per level of the SmolLM2 tree timed above
# (its draft time divided by its depth). Vanilla is one token per forward over the root alone.
# (The widget needs a live Jupyter frontend; in a static view it shows the default setting.)

# %%
from minispec.lab.notebook import interact
from minispec.tree import Tree

level_s = draft_s / spec.depth  # seconds per draft level, from the SmolLM2 tree timed above
vanilla_tps = auto.predicted_tokens_per_s(1.0, auto.interpolate(curve[1], 0), 0.0)

def explore_tree(D=3, K=2, N=5):
    n_cands = K + (D - 1) * K * K
    N = min(N, n_cands)  # the rerank cannot keep more than the candidates
    tokens, parents = naive_dynamic_tree(toy_q, D, K, N)
    paths = []
    for t, p in zip(tokens, parents):  # topological order: a parent's path is known before its children's
        paths.append((paths[p] if p >= 0 else ()) + (t,))
    probs = [path_product(v) for v in paths]
    tau = 1 + sum(probs)
    verify = auto.interpolate(curve[1], N)
    tps = auto.predicted_tokens_per_s(tau, verify, D * level_s)
    fig, ax = plt.subplots(figsize=(8, min(8, 0.25 * N + 2.5)))
    draw(Tree(tokens=tokens, parents=parents), [f"{t}: {q:.3f}" for t, q in zip(tokens, probs)], ax,
         f"toy tree D={D}, K={K}, N={N} ({n_cands} candidates); token: path product")
    ax.set_xticks(range(D + 1)); plt.show()
    print(f"E[tau] = 1 + sum of path products = {tau:.3f}; step = verify {verify * 1e3:.1f} ms + draft "
          f"{D} x {level_s * 1e3:.1f} ms -> predicted {tps:.1f} tokens/s ({tps / vanilla_tps:.2f}x vanilla's "
          f"{vanilla_tps:.1f})")

interact(explore_tree, D=(1, 5), K=(1, V_TOY), N=(1, 40));  # sliders (fast mode: the defaults once)

# %% [markdown]
# The dispatcher does the same with measured numbers for every candidate: $\tau$ and the draft
# and loop times from a short calibration run, the verify time from the curve.
# First it times one EAGLE draft with the head in float32 and in bfloat16 (a draft only
# proposes, so its dtype can change its cost and acceptance, never the output), and every EAGLE
# candidate then drafts in the faster (`eagle2+bf16@...` when that is bfloat16).

# %%
cands = ["vanilla", "pld", f"{BASE}@chain:4", f"{BASE}@eagle", f"{BASE}@4/4/12"] if FAST else list(auto.DEFAULT_CANDIDATES)
r = tuning.tune(smol, smol_tok, tune_report.calibration_prompts(2 if FAST else 8), candidates=cands,
                  max_new_tokens=16 if FAST else 64, sizes=sizes, reps=3 if FAST else 7, methods=methods,
                  progress=False)
print(tune_report.format_tune(r))

# %% [markdown]
# ### Where a step's time goes
#
# The cost model needs three numbers per candidate: verify, draft and the rest of the loop.
# `python -m minispec profile` measures them from the decode loop's own clock
# (`GenerationStats.phase_s`: draft, target forward, verify, KV commit, feature hand-off,
# other), next to the machine's memory bandwidth and the floor it puts under one target
# forward (weight bytes / bandwidth). The committed result file, plotted: a method pays off
# when its step costs less than $\tau$ vanilla steps.

# %%
prof_file = results / "profile_cpu.json"
prof = json.loads(prof_file.read_text())
phases = list(next(iter(prof["methods"].values()))["phase_ms"])
names = list(prof["methods"])
fig, ax = plt.subplots(figsize=(7, 4))
bottom = [0.0] * len(names)
for ph in phases:
    vals = [prof["methods"][m]["phase_ms"][ph] for m in names]
    ax.bar(names, vals, bottom=bottom, label=ph)
    bottom = [b + v for b, v in zip(bottom, vals)]
van = prof["methods"]["vanilla"]["step_ms"]
for i, m in enumerate(names):  # the break-even step time: tau vanilla steps
    ax.plot([i - 0.4, i + 0.4], [prof["methods"][m]["tau"] * van] * 2, "k--", lw=1)
ax.axhline(prof["weight_floor_ms"], color="gray", lw=1)
ax.text(len(names) - 0.5, prof["weight_floor_ms"], " weight floor", va="bottom", ha="right", color="gray")
ax.set_ylabel("ms per decode step"); ax.legend(fontsize=8)
ax.set_title(f"{prof['device'].get('cpu_model', 'CPU')}, {prof['threads']} threads (dashes: tau x vanilla step)")
plt.xticks(rotation=20); plt.show()
print(f"copy bandwidth {prof['copy_bandwidth_gb_s']:.1f} GB/s, weight floor {prof['weight_floor_ms']:.1f} ms; "
      f"verify t(N)/t(0): " + ", ".join(f"N={n}: {r:.2f}" for n, r in prof["verify_ratio"].items()))

# %% [markdown]
# ## 7. minispec's `D,K,N` and upstream EAGLE's parameters
#
# minispec names a dynamic tree `D,K,N` (or `D/K/N`): $D$ levels of draft nodes below the root,
# branching $K$, $N$ drafted nodes kept. Upstream EAGLE (`EaModel.from_pretrained(...,
# depth=, top_k=, total_token=)`) counts the root as a token and counts the expansions *after*
# the root's children:
#
# | | depth | top_k | tokens in the tree |
# |---|---|---|---|
# | minispec `D,K,N` | $D$ (draft levels) | $K$ | $N$ (drafts only) |
# | upstream EAGLE | `depth` $= D - 1$ | `top_k` $= K$ | `total_token` $= N + 1$ (root included) |
# | example | minispec `6,10,59` | | upstream `depth=5, top_k=10, total_token=60` (its default) |
#
# Both draft the same candidates ($K + (D - 1)K^2$ of them) and keep the same tree; the target
# verifies $N + 1$ tokens either way.

# %%
for name in ["6,10,59", "5,4,16", "4,4,12", "5,8,32"]:
    s = TreeSpec.parse(name)
    print(f"minispec {s.depth},{s.top_k},{s.total_tokens:<3} = upstream depth={s.depth - 1}, top_k={s.top_k}, "
          f"total_token={s.total_tokens + 1}: {s.top_k + (s.depth - 1) * s.top_k ** 2} candidates, "
          f"{s.total_tokens + 1} tokens verified")

# %% [markdown]
# ## 8. Exactness with a dynamic tree: SmolLM2-135M, temperature 1 (TV distance)
#
# Dynamic trees hold deterministic top-k drafts, so minispec verifies them as one-hot $q$
# (chapter 2), which is lossless for any $p$, however the tree was grown. The check runs the
# real decode loop (`minispec.batch.generate_batch`, many runs at a time, each with its own
# seed): SmolLM2-135M-Instruct at temperature 1, top-k 3, with this chapter's drafter growing
# a dynamic tree `2,4,8` (depth 2, top-4 expansion, 8 nodes kept) after the open prompt "The
# best way to". The law of the first three new tokens (token 1 from the prefill, tokens 2-3
# from the first tree step) is compared with the target's exact law
# (`minispec.lab.joint_law.first_tokens_law`, 27 outcomes) by total variation against
# `tv_bound(N, K)` and by the chi-square tests of chapter 3 (`prefix_p_value` below $10^{-6}$ flags).
#
# Two deliberately wrong controls run beside it: the same dynamic trees claiming their drafts
# were *sampled* from a uniform $q$ (`claim_uniform_q`, blatant: verification accepts every draft
# the target can emit), and the same trees reordered by a drafter that reads the verifier's
# random stream (`peek_verifier_stream`, subtle, chapter 4): a deviation that only the
# chi-square tests see at these sample sizes (full mode prints its TV). How far a control strays depends on the drafter (a
# head whose drafts follow the target more closely makes both controls milder), so the controls
# are tested *sequentially* (`control_max`): when $N$ runs do not flag one, it gets $2N$, $4N$, ...
# runs, each look at level $\alpha$ / looks, so that an exact sampler would still be flagged with
# probability at most $2\alpha$ over all looks. The honest run always takes $N$.

# %%
from minispec.lab.joint_law import claim_uniform_q, decode_loop_exactness, peek_verifier_stream

tv_drafter = methods.drafter(f"{BASE}@2,4,8")
runs = {f"{BASE}, dynamic tree 2,4,8 (one-hot q)": tv_drafter.fresh,
        "WRONG (blatant): same trees, claim uniform q": lambda: claim_uniform_q(tv_drafter.fresh(), smol.cfg.vocab_size)}
subtle = {"WRONG (subtle): same trees, order read from the verifier's stream":
          lambda: peek_verifier_stream(tv_drafter.fresh(), band=0.3)}
tv5 = decode_loop_exactness(smol, smol_tok, runs, subtle, fast=FAST,
                            models=f"target: SmolLM2-135M-Instruct; drafter: {BASE} "
                                   f"({'shipped EAGLE-1/2 head' if BASE == 'eagle2' else 'shipped distilled draft'})")

# %% [markdown]
# ## Pen-and-paper questions
#
# Short questions to answer without a computer (answers at the end of the notebook).
#
# 1. A calibrated draft, greedy verification. The root's two most likely children are $a$
#    ($q = 0.6$) and $b$ ($q = 0.3$); below $a$, the most likely child $c$ has $q(c \mid a) = 0.5$.
#    What is $E[\tau]$ of the tree $\{a, b, c\}$? Of the chain $a \to c$? Which third node would
#    the rerank pick if it could keep only two, and why is that the right choice?
# 2. Show that the rerank's kept set is always connected (every kept node's parent is kept).
#    Where does the proof need the tie rule "on equal scores, the shallower first"? Give a case
#    with $q = 1$ where dropping the rule breaks the tree.
# 3. Two trees: $N = 16$ with $E[\tau] = 3.0$ and $N = 60$ with $E[\tau] = 3.4$, both with
#    $c_\text{draft} = 0.3$ and no loop time. On a GPU, $v(N) = 1$ up to $N = 64$; on a CPU,
#    $v(N) \approx 1 + N/40$. Which tree does the cost model pick on each machine, and what
#    speedups does it predict?
#
# ## Summary
#
# - Under greedy verification a node is accepted iff every token on its path is the target's
#   argmax; with a calibrated draft, its probability is about the product of the draft's
#   probabilities along the path, $e^{\text{score}(v)}$. The measured calibration curve says how
#   far a real draft is from that.
# - The accepted nodes form one path, so $E[\tau] = 1 + \sum_v P(v \text{ accepted})$. For a
#   budget of $N$ nodes the best tree keeps the $N$ highest scores, which is EAGLE-2's rerank;
#   it is connected because a child never scores above its parent (ties to the shallower).
# - EAGLE-2 grows the candidates greedily: $D$ levels, each expanding the $K$ best nodes of the
#   level before, one draft forward per level; a naive version in plain Python drafts exactly
#   `TreeDrafter`'s tree.
# - Chapter 1's cost model becomes $\text{speedup} \approx E[\tau] / (c_\text{draft} + v(N) +
#   \ell)$: $E[\tau]$ is concave in $N$ and $v(N)$ grows with it, so the best tree depends on
#   the hardware; the dispatcher measures $v(N)$, $\tau$ and the draft and loop times here and
#   picks the best predicted tokens/s.
# - minispec's `D,K,N` is upstream EAGLE's `depth = D - 1`, `top_k = K`, `total_token = N + 1`.
# - Dynamic trees hold deterministic drafts, verified losslessly with one-hot $q$.
#
# ## References
#
# - Li, Wei, Zhang, Zhang. *EAGLE-2: Faster Inference of Language Models with Dynamic Draft
#   Trees.* EMNLP 2024. [arXiv:2406.16858](https://arxiv.org/abs/2406.16858)
# - Li, Wei, Zhang, Zhang. *EAGLE: Speculative Sampling Requires Rethinking Feature
#   Uncertainty.* ICML 2024. [arXiv:2401.15077](https://arxiv.org/abs/2401.15077)
# - Leviathan, Kalman, Matias. *Fast Inference from Transformers via Speculative Decoding.*
#   ICML 2023 (the cost model of chapter 1). [arXiv:2211.17192](https://arxiv.org/abs/2211.17192)
# - Chen et al. *Accelerating Large Language Model Decoding with Speculative Sampling.* 2023.
#   [arXiv:2302.01318](https://arxiv.org/abs/2302.01318)
# - Miao et al. *SpecInfer: Accelerating Generative Large Language Model Serving with Tree-based
#   Speculative Inference and Verification.* ASPLOS 2024. [arXiv:2305.09781](https://arxiv.org/abs/2305.09781)
# - Cai et al. *Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
#   Heads.* ICML 2024. [arXiv:2401.10774](https://arxiv.org/abs/2401.10774)
# - Chen et al. *Sequoia: Scalable, Robust, and Hardware-aware Speculative Decoding.* 2024 (tree
#   size chosen for the hardware). [arXiv:2402.12374](https://arxiv.org/abs/2402.12374)
#
# ## The whole chapter
#
# Your file, graded in one table (the same as `python -m minispec grade 5`), and what a
# finished chapter looks like: the reference answers in `solutions/` pass every check.

# %%
check(5, impl="exercises")

# %%
check(5, impl="solutions")

# %% [markdown]
# ## Answers to the pen-and-paper questions
#
# <details><summary>1. E[tau] of a small tree</summary>
#
# Path products: $a$: 0.6, $b$: 0.3, $c$: $0.6 \times 0.5 = 0.3$. Tree: $E[\tau] = 1 + 0.6 +
# 0.3 + 0.3 = 2.2$. Chain $a \to c$: $1 + 0.6 + 0.3 = 1.9$. With two nodes, $a$ is kept first
# (0.6), then $b$ and $c$ tie at 0.3: either adds 0.3 to $E[\tau]$, so both give 1.9; the rerank
# breaks the tie to the shallower, $b$. Adding a node adds its own acceptance probability,
# whatever its depth, so the best $N$ nodes are the $N$ largest products.
# </details>
#
# <details><summary>2. The kept set is connected</summary>
#
# $\text{score}(\text{child}) = \text{score}(\text{parent}) + \log q \le \text{score}(\text{parent})$.
# If a child is kept, every candidate ranked above it is kept. Its parent has a score at least
# as high; if strictly higher it ranks above the child; if equal ($q = 1$, log 0), only the
# tie rule puts it above (it is shallower). Without the rule: parent and child both at score
# $-0.5$, the cut falls between them, and a sort that happens to put the child first keeps a
# node whose parent is not in the tree.
# </details>
#
# <details><summary>3. The cost model on two machines</summary>
#
# GPU: $3.0 / (0.3 + 1) = 2.31$ vs $3.4 / 1.3 = 2.62$: the big tree. CPU: $v(16) = 1.4$ gives
# $3.0 / 1.7 = 1.76$; $v(60) = 2.5$ gives $3.4 / 2.8 = 1.21$: the small tree. The extra 44
# nodes add only 0.4 to $E[\tau]$ (concave gain) but cost 1.1 forwards on the CPU.
# </details>

# %%
# The answers' numbers, computed.
print(f"question 1: tree E[tau] {1 + 0.6 + 0.3 + 0.6 * 0.5:.2f}, chain a -> c {1 + 0.6 + 0.6 * 0.5:.2f}")
for name, v in (("GPU", lambda n: 1.0), ("CPU", lambda n: 1 + n / 40)):
    print(f"question 3 ({name}): N=16 {3.0 / (0.3 + v(16)):.2f}x, N=60 {3.4 / (0.3 + v(60)):.2f}x")
