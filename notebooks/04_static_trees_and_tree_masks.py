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
# # Chapter 4 — Static trees: one target forward for many draft paths
#
# A chain offers the target one guess per position. A **draft tree** offers several: the
# root's top-3 children, their top-2 children, and so on. The target scores the whole tree
# in **one forward**, each node attending only to the committed prefix and its own
# ancestors, thanks to a **tree attention mask** (SpecInfer, Miao et al. 2023). Medusa
# (Cai et al. 2024) and EAGLE (Li et al. 2024) ship fixed tree shapes, lists of "choices"
# named `mc_sim_7b_63`; chapter 2's `verify_tree` then keeps the longest accepted path.
#
# **Learning objectives**
# 1. Turn a choices list into a tree (parents in topological order, sibling ranks).
# 2. Build the tree attention mask, the position ids and the root-to-leaf paths
#    (`retrieve_indices`), and see a chain as the tree whose mask is causal.
# 3. Run one real tree step on SmolLM2-135M: draft EAGLE's tree with the distilled draft
#    model, score it with the target in one masked forward, verify it greedily.
# 4. Compare a chain ($k$ = 4) with EAGLE's static tree: $\tau$ and tokens/s, output
#    identical to plain greedy decoding.
# 5. Check that tree verification with one-hot $q$ is lossless when sampling (total variation).
# 6. Choose a static tree from per-rank acceptance rates, and see where extra nodes stop paying.
# 7. Implement exercises 4.1–4.6, each right after the section that teaches it.
#
# **Layout** (the same everywhere in minispec): a tree of $N$ nodes has `tokens[i]` and
# `parents[i]`, in topological order: `parents[i]` is $-1$ (a child of the **root**, the
# last committed token) or an earlier node. The target's forward runs over $N+1$ new tokens,
# the root at row 0 and node $i$ at row $i+1$ ("row = node + 1").
#
# **Exercises.** You write them in `exercises/ch04_static_trees.py` (generated from
# `solutions/`; same signatures and docstrings). These functions are deterministic: the grader
# runs yours on many seeded random trees (and on EAGLE's and Medusa's `mc_sim_7b_63`) and
# compares every output with minispec's own. Each check cell below grades one exercise and
# reports failures, it does not raise: until you fill in a stub it says "not implemented yet".
# From a terminal: `python -m minispec grade 4` or
# `pytest tests/test_exercises.py -m ch04 --impl exercises`.
#
# | exercise | function | task |
# |---|---|---|
# | 4.1 | `choices_to_parents` | a choices list $\to$ parents and sibling ranks (and its errors) |
# | 4.2 | `tree_mask` | the $[N+1, N+1]$ ancestor mask |
# | 4.3 | `tree_positions` | position ids: prefix length + depth (the root at the prefix length) |
# | 4.4 | `retrieve_indices` | root-to-leaf paths of node indices, padded with $-1$ |
# | 4.5 | `greedy_verify` | the accepted path of a tree under greedy verification |
# | 4.6 | `best_static_tree` | the $n$-node static tree of highest $E[\tau]$ under per-rank acceptance |

# %%
import inspect

import matplotlib.pyplot as plt
import numpy as np

from minispec import generate
from minispec import verify as vf
from minispec.drafters import DraftModel, TreeSpec
from minispec.drafters.draft_checkpoint import load_draft_model
from minispec.grading import check  # check("4.1"): grade one exercise of your exercises/ file (prints, never raises)
from minispec.kv import KVCache
from minispec.sampling import GREEDY, SamplingParams
from minispec.tokenizer import encode_prompt
from minispec.tree import EAGLE_MC_SIM_7B_63, MEDUSA_MC_SIM_7B_63, Tree, parse_choices


# %% [markdown]
# ## 1. From choices to a tree
#
# A static tree is written as **choices**: one tuple per node, the ranks of the candidates on
# the way down from the root. `(0,)` is the root's most likely child, `(1,)` its second,
# `(0, 1)` the second most likely child of `(0,)`. `parse_choices` sorts them by depth, then
# lexicographically (as Medusa and EAGLE do), which puts every parent before its children;
# node $i$'s parent is the index of `choices[i][:-1]`, and its **rank** `choices[i][-1]` tells
# the drafter which candidate to put there. EAGLE's default tree has 25 nodes and depth 5,
# Medusa's 63 nodes and depth 4.

# %%
small = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
ct = parse_choices(small)
print(f"{'node':>4}  {'choice':<10} {'parent':>6} {'rank':>4}")
for i, (c, j, r) in enumerate(zip(ct.choices, ct.parents, ct.ranks)):
    print(f"{i:>4}  {str(c):<10} {j:>6} {r:>4}")
for name, cs in (("EAGLE", EAGLE_MC_SIM_7B_63), ("Medusa", MEDUSA_MC_SIM_7B_63)):
    t = Tree.from_choices(cs)
    print(f"{name} mc_sim_7b_63: {len(t)} nodes, depth {t.depth}, {len(t.leaves())} leaves, "
          f"nodes per depth {np.bincount(t.depths())[1:].tolist()}")

# %% [markdown]
# ### Exercise 4.1 — `choices_to_parents(choices)`
#
# Turn a choices list into parents and sibling ranks, and reject the lists that are not a
# tree (the errors listed in the docstring).
#
# *Hint.* Which order of the choices puts every parent before its children, and is it the one
# the table above printed? Once the choices are in node order, how can you find the index of a
# choice's parent without searching the whole list each time? For the errors: what does a
# duplicate, or a choice whose parent is missing, look like in that lookup?

# %%
check("4.1")

# %% [markdown]
# ### The library's version
#
# Now that you have written it: `parse_choices` in `minispec/tree.py`.

# %%
show(parse_choices)


# %% [markdown]
# ## 2. The tree attention mask
#
# The target sees $N+1$ new tokens at once. Row $a$ of the mask (a query) may attend to
# column $b$ (a key) exactly when $b$ is $a$ itself or one of $a$'s ancestors; the root
# (row 0) is everyone's ancestor. The committed prefix in the KV cache is visible to every
# row and is not part of this mask. So a node's logits are exactly those of a causal forward
# over prefix + its own path: siblings never see each other.
#
# Exercise 4.2 builds that mask; after it, a naive version written for teaching is checked against
# the library's.

# %% [markdown]
# ### Exercise 4.2 — `tree_mask(parents)`
#
# Build the $[N+1, N+1]$ ancestor mask of root + $N$ nodes (row $a$ = query, column $b$ = key).
#
# The check compares your mask with the library's on many seeded random trees, EAGLE's and
# Medusa's `mc_sim_7b_63` and chains: any correct construction passes.
#
# *Hint.* Walking up from every row to the root works, and repeats itself. Since nodes come in
# topological order, what do you already know about a node's parent's row when you reach the
# node's own row? How does a node's row differ from its parent's?

# %%
check("4.2")

# %% [markdown]
# ### A naive version for teaching
#
# The visible columns of every row, found by walking up the parents, as lists of column indices;
# then an assert that they are exactly the `True` columns of the library's `Tree.mask` on the small
# tree, both `mc_sim_7b_63` trees and random trees, and that a chain's mask is the causal
# (lower-triangular) mask.

# %%
def naive_visible(parents):
    """Row a (0 = the root, a = node a - 1) -> the sorted columns it may attend to."""
    rows = []
    for a in range(len(parents) + 1):
        seen, i = {0}, a - 1  # everyone sees the root
        while i >= 0:  # the node itself, then its parent, grandparent, ...
            seen.add(i + 1)
            i = parents[i]
        rows.append(sorted(seen))
    return rows

rng = np.random.default_rng(0)
examples = [ct.parents, Tree.from_choices(EAGLE_MC_SIM_7B_63).parents, Tree.from_choices(MEDUSA_MC_SIM_7B_63).parents]
examples += [[int(rng.integers(-1, i)) if i else -1 for i in range(n)] for n in rng.integers(1, 40, size=50)]
for parents in examples:
    lib = Tree([0] * len(parents), parents).mask()  # [N + 1, N + 1] bool
    assert naive_visible(parents) == [row.nonzero().flatten().tolist() for row in lib]
chain = Tree.chain([0] * 6)
assert torch.equal(chain.mask(), torch.ones(7, 7, dtype=torch.bool).tril())
print(f"naive visible columns == Tree.mask on {len(examples)} trees; a chain's mask is causal")

# %% [markdown]
# ### The library's version
#
# Now that you have written it: `Tree.mask` in `minispec/tree.py`.

# %%
show(Tree.mask)

# %% [markdown]
# ### Drawing trees with real tokens
#
# To see real tokens we need a drafter. Load SmolLM2-135M-Instruct (the target) and
# minispec's distilled draft model (a few Transformer blocks sharing the target's
# embeddings), prefill the prompt, take the target's first greedy token as the **root**, and
# let the draft model fill in the small tree and EAGLE's tree: node $i$ gets the
# `ranks[i]`-th most likely token under its parent, one draft forward per level, with the
# same tree mask. Left: the tree (x = depth, siblings stacked by rank, labels = decoded
# tokens, prefixed by the node index); right: its mask (white = may attend).

# %%
smol, tok = minispec.load("smollm2-135m")
draft = load_draft_model(smol)
prompt = "Who wrote Romeo and Juliet?"
ids = encode_prompt(tok, prompt)
kv = KVCache.for_model(smol, capacity=len(ids) + 256)
with torch.inference_mode():
    out = smol(torch.tensor([ids]), kv=kv, last_logits_only=True)  # prefill
kv.commit()
root = int(out.logits[0, -1].argmax())  # the first new token: the root of the first tree
print(f"prompt: {len(ids)} tokens (chat template), root token {tok.decode([root])!r}")

def label(t):
    """A decoded token for a plot (spaces and newlines visible, no matplotlib math mode)."""
    return repr(tok.decode([t]))[1:-1].replace("$", r"\$") or "<empty>"

def layout(tree):
    """(x, y) of every row: x = depth, y = leaves one per line, a parent at its children's mean."""
    kids, ys, nxt = tree.children(), {}, [0]
    def place(row):
        if not kids[row]:
            ys[row] = nxt[0]; nxt[0] += 1
            return
        for c in kids[row]:
            place(c + 1)
        ys[row] = np.mean([ys[c + 1] for c in kids[row]])
    place(0)
    return [0] + tree.depths(), [ys[r] for r in range(len(tree) + 1)]

def draw_tree(ax, tree, root_token, notes=None, path=(), title=""):
    """Tree as a graph: node labels = decoded tokens (+ optional notes), the accepted path in green."""
    xs, ys = layout(tree)
    on_path = {0} | {i + 1 for i in path}
    for i, j in enumerate(tree.parents):
        a, b = j + 1, i + 1
        ax.plot([xs[a], xs[b]], [ys[a], ys[b]], color="tab:green" if b in on_path else "0.75",
                lw=2.5 if b in on_path else 1, zorder=1)
    for r in range(len(tree) + 1):
        text = f"root: {label(root_token)}" if r == 0 else f"{r - 1}: {label(tree.tokens[r - 1])}"
        if notes is not None and r > 0:
            text += f"\n{notes[r - 1]}"
        color = "0.85" if r == 0 else ("tab:green" if r in on_path else "white")
        ax.text(xs[r], ys[r], text, ha="center", va="center", fontsize=7, zorder=2,
                bbox=dict(boxstyle="round,pad=0.2", fc=color, ec="0.4"))
    ax.set_xlim(-0.5, max(xs) + 0.5); ax.set_ylim(max(ys) + 0.7, -0.7)
    ax.set_xticks(range(max(xs) + 1)); ax.set_yticks([]); ax.set_xlabel("depth")
    ax.set_title(title, fontsize=10)

def draw_mask(ax, tree, title="tree mask"):
    ax.imshow(tree.mask().numpy(), cmap="gray", interpolation="nearest")
    ax.set_xlabel("key row (0 = root, i + 1 = node i)"); ax.set_ylabel("query row"); ax.set_title(title, fontsize=10)

trees = {}
for name, spec in (("small", TreeSpec.static(small, name="small")), ("eagle", TreeSpec.parse("eagle"))):
    drafter = DraftModel(draft, tree=spec)
    drafter.prefill(ids + [root])  # the committed tokens: prompt + first token (the root)
    trees[name] = drafter.propose(GREEDY, budget=8)

for name, size in (("small", (11, 3.2)), ("eagle", (15, 6.5))):
    t = trees[name]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=size, gridspec_kw=dict(width_ratios=[2.2, 1]))
    draw_tree(a1, t, root, title=f"{name} tree: {len(t)} nodes, depth {t.depth} (root = {label(root)})")
    draw_mask(a2, t, f"{name} tree mask [{len(t) + 1} x {len(t) + 1}]")
    plt.tight_layout(); plt.show()

# %% [markdown]
# ## 3. Positions and paths
#
# **Positions.** Siblings are alternatives for the same slot, so they share a position:
# a node at depth $d$ sits at prefix length + $d$, where the prefix is what the KV cache
# holds before the root (the root is at the prefix length itself). With RoPE this makes
# each node's query and keys exactly those of a causal forward over its own path.
#
# **Paths.** `retrieve_indices` (Medusa / EAGLE) lists the root-to-leaf paths as node
# indices, one row per leaf, padded with $-1$ to the tree's depth. Every path a
# verifier can accept is a prefix of one of these rows.

# %%
t = trees["eagle"]
pos = t.positions(kv.length)
print(f"KV cache holds {kv.length} tokens; positions of root + nodes (prefix + depth):\n{pos.tolist()}")
ri = t.retrieve_indices()
print(f"\nretrieve_indices: [{ri.shape[0]} leaves, depth {ri.shape[1]}]\n{ri}")
print("\nthe paths as text (root first):")
for row in ri.tolist():
    path = [i for i in row if i >= 0]
    print(f"  {str(path):<18} {tok.decode([root] + [t.tokens[i] for i in path])!r}")
assert all(p == [i for i in row if i >= 0] for p, row in zip(t.paths(), ri.tolist()))

# %% [markdown]
# ### Exercise 4.3 — `tree_positions(parents, prefix_len)`
#
# The position ids of root + $N$ nodes: prefix length + depth (the root at the prefix length).
#
# *Hint.* In topological order, can a node's depth be read off something you have already
# computed?

# %%
check("4.3")

# %% [markdown]
# ### Exercise 4.4 — `retrieve_indices(parents)`
#
# The root-to-leaf paths of node indices, one row per leaf, padded with $-1$ to the tree's depth.
#
# *Hint.* Which nodes are leaves, and how do you find them from `parents` alone? From a leaf,
# which direction can you walk, and in which order does that give you the path? Mind the shape
# the docstring asks for when the tree is empty.

# %%
check("4.4")


# %% [markdown]
# ## 4. One real tree step on SmolLM2
#
# The step of `minispec.generate`, written out: the target runs once over
# `[root] + tree.tokens` with the tree's positions and mask on top of the KV cache,
# `verify_tree` (greedy) walks down from the root accepting the child whose token is the
# target's argmax, and the cache keeps the rows of the root and the accepted path
# (`kv.commit(rows)`), dropping the rest; then the drafter is told which tokens were
# committed (`drafter.commit(emitted)`), so it never has to work that out itself. Each node
# shows $p$ = the target's probability of its token given its path (from its parent's row).

# %%
def tree_step(drafter, kv):
    """Draft, score in one masked forward, verify greedily, commit. Returns what happened."""
    root = drafter.context[-1]  # the last committed token
    tree = drafter.propose(GREEDY, budget=8)
    tokens = torch.tensor([[root] + tree.tokens])  # [1, N + 1]: root + nodes
    with torch.inference_mode():
        logits = smol(tokens, positions=tree.positions(kv.length), mask=tree.mask(), kv=kv).logits[0]  # [N + 1, V]
    res = vf.verify_tree(tree, logits, mode="greedy")
    kv.commit([0] + [i + 1 for i in res.path])  # keep the root's and the accepted nodes' keys / values
    drafter.commit(res.emitted)  # the accepted drafts + the target's own token (a draft model reads no features)
    p = torch.softmax(logits.double(), -1)  # [N + 1, V]
    p_node = [p[j + 1, x].item() for x, j in zip(tree.tokens, tree.parents)]  # p(token | its path)
    return dict(root=root, tree=tree, logits=logits, p_node=p_node, res=res)

eagle = DraftModel(draft, tree="eagle")
eagle.prefill(ids + [root])
kv_before = kv.length
step = tree_step(eagle, kv)
t, res = step["tree"], step["res"]
fig, ax = plt.subplots(figsize=(15, 6.5))
draw_tree(ax, t, root, notes=[f"p={x:.2f}" for x in step["p_node"]], path=res.path,
          title=f"EAGLE tree scored by the target: accepted {len(res.path)} drafts, then {label(res.next_token)}")
plt.tight_layout(); plt.show()
print(f"accepted path {res.path}: {tok.decode([t.tokens[i] for i in res.path])!r}; "
      f"next token {tok.decode([res.next_token])!r}; this step committed {len(res.emitted)} tokens")
print(f"KV cache: {kv_before} -> {kv.length} tokens (root + {len(res.path)} accepted nodes kept, "
      f"{len(t) - len(res.path)} rejected nodes dropped)")

# %% [markdown]
# **The mask at work.** Each leaf's path, run through the target causally from scratch
# (prompt + root + path, no tree, no cache), must give the same logits as the tree forward
# gave that path's rows: one masked forward really is many causal forwards at once.

# %%
worst = 0.0
with torch.inference_mode():
    for path in t.paths():
        seq = ids + [root] + [t.tokens[i] for i in path]
        full = smol(torch.tensor([seq])).logits[0, -len(path) - 1:]  # rows of the root and the path
        tree_rows = step["logits"][[0] + [i + 1 for i in path]]
        worst = max(worst, (full - tree_rows).abs().max().item())
print(f"{len(t.paths())} root-to-leaf paths: max |causal logits - tree logits| = {worst:.2e}")
assert worst < 1e-3

# %% [markdown]
# ### Exercise 4.5 — `greedy_verify(parents, tokens, logits)`
#
# The accepted path of a tree under greedy verification, and the token emitted after it: what
# `verify_tree(..., mode="greedy")` returned in `tree_step` above.
#
# *Hint.* At each step you stand at one row of the logits: what does the target want there, and
# which nodes are allowed to offer it? What do you need to know, for each row, to answer that
# quickly? Which row do you move to when a child is accepted, and what is emitted when none is
# (including after a leaf)?

# %%
check("4.5")

# %% [markdown]
# ### Explorer: a few steps of drafting and verification
#
# The same step, repeated from the prompt. The slider picks a step; "drafted" shows the
# tree as the draft model proposed it, "verified" adds the target's probabilities and the
# accepted path. The cell first asserts that the tokens these steps commit are exactly
# plain greedy decoding's.

# %%
from minispec.lab.notebook import interact
from IPython.display import display

n_steps = 3 if FAST else 6
kv2 = KVCache.for_model(smol, capacity=len(ids) + 256)
with torch.inference_mode():
    first = int(smol(torch.tensor([ids]), kv=kv2, last_logits_only=True).logits[0, -1].argmax())
kv2.commit()
explorer_drafter = DraftModel(draft, tree="eagle")
explorer_drafter.prefill(ids + [first])
new, steps = [first], []
for _ in range(n_steps):
    steps.append(tree_step(explorer_drafter, kv2))
    new += steps[-1]["res"].emitted
vanilla = generate(smol, tok, prompt, max_new_tokens=len(new))
assert new == vanilla.tokens, "the tree steps must commit exactly the greedy tokens"
print(f"{n_steps} tree steps committed {len(new)} tokens (= plain greedy decoding): {tok.decode(new)!r}")

def show_step(step=0, stage="verified"):
    s = steps[step]
    tree, res = s["tree"], s["res"]
    verified = stage == "verified"
    fig, ax = plt.subplots(figsize=(15, 6))
    draw_tree(ax, tree, s["root"], notes=[f"p={x:.2f}" for x in s["p_node"]] if verified else None,
              path=res.path if verified else (),
              title=(f"step {step}: accepted {len(res.path)}, next {label(res.next_token)}" if verified
                     else f"step {step}: the draft's EAGLE tree after {label(s['root'])}"))
    plt.tight_layout(); plt.show()
    if verified:
        print(f"committed {tok.decode(res.emitted)!r} ({len(res.emitted)} tokens)")

interact(show_step, step=(0, n_steps - 1), stage=["drafted", "verified"]);  # fast mode: step 0, verified, once

# %% [markdown]
# ## 5. Chain vs static tree on SmolLM2 (on this CPU)
#
# Greedy decoding with the distilled draft as a chain ($k$ = 4 draft tokens) and as EAGLE's static
# tree (25 draft tokens over 5 levels). Either drafts one level per draft forward: the first
# (`_start`) gives the root's children, then one (`_extend`) per level that has children, so a step
# costs the chain 4 draft forwards and the tree 5 (the table's `draft fwd` column counts them over
# the run). The tree gives the target more chances per step, so $\tau$ rises; whether tokens/s rises
# too depends on how much more the wider target forward and draft forwards cost on this hardware
# (on a GPU at batch 1 extra rows cost little, chapter 9 measures how little; on a CPU they do not
# come free). Every run must emit exactly the vanilla tokens.

# %%
prompts = ["Who wrote Romeo and Juliet? Answer in two sentences.",
           "Write a Python function that returns the n-th Fibonacci number.",
           "List three tips for staying focused while studying."]
prompts, n_new = (prompts[:1], 32) if FAST else (prompts, 64)  # one prompt in CI: the identity tests cover more
generate(smol, tok, prompts[0], max_new_tokens=4)  # warm-up
methods = {"vanilla": None, "chain k=4": lambda: DraftModel(draft, k=4), "eagle static tree": lambda: DraftModel(draft, tree="eagle")}
rows = {m: [] for m in methods}
for pr in prompts:
    ref = None
    for m, make in methods.items():
        r = generate(smol, tok, pr, drafter=make() if make else None, max_new_tokens=n_new)
        ref = ref or r.tokens
        assert r.tokens == ref, f"{m}: greedy output differs from vanilla on {pr!r}"
        rows[m].append(r.stats)
print(f"CPU, torch threads {torch.get_num_threads()}, greedy, {len(prompts)} prompts x {n_new} new tokens")
print(f"{'method':<20} {'tau':>5} {'tokens/s':>9} {'target fwd':>10} {'draft fwd':>9}  acceptance by depth (prompt 1)")
for m, stats in rows.items():
    tau = sum(s.new_tokens for s in stats) / sum(s.target_forwards for s in stats)
    tps = sum(s.new_tokens for s in stats) / sum(s.total_s for s in stats)
    acc = " ".join(f"{a:.2f}" for a in stats[0].acceptance_by_position)
    print(f"{m:<20} {tau:>5.2f} {tps:>9.1f} {sum(s.target_forwards for s in stats):>10} "
          f"{sum(s.draft_forwards for s in stats):>9}  {acc}")
print("every run emitted exactly the vanilla greedy tokens")

# %% [markdown]
# ## 6. Sampling: a static tree is lossless (one-hot $q$) — SmolLM2-135M, shipped draft
#
# When sampling, a static tree's drafts are still deterministic (the top-ranked tokens of
# the draft), so `verify_tree` treats them as drawn from a **one-hot $q$** (chapter 2):
# accept child $x$ with probability $p_i(x)$, else remove $x$ from $p$ and renormalise. The
# emitted tokens must then have exactly the target's law, whatever the draft proposed.
#
# The check runs the real decode loop (`minispec.batch.generate_batch`, many runs at a time,
# each with its own seed): SmolLM2-135M-Instruct at temperature 1, top-k 3, after the open
# prompt "The best way to", with minispec's shipped distilled draft drafting EAGLE's static tree
# (cut to depth 2 by the budget of `max_new_tokens = 4`). The law of the first three new tokens
# (token 1 from the prefill, tokens 2-3 from the first tree step) is compared with the target's
# exact law (`minispec.lab.joint_law.first_tokens_law`, 27 outcomes) by total variation (TV) against
# `tv_bound(N, K)`, and by chapter 3's chi-square tests (`prefix_p_value` below $10^{-6}$ flags).
#
# Two deliberately wrong controls run beside it:
#
# - **blatant**: the same drafter, but its trees claim their drafts were *sampled* from a
#   uniform $q$ (`claim_uniform_q`), so verification uses the sampled-$q$ rule and accepts every
#   draft the target can emit: the output follows the draft's favourites;
# - **subtle**: the same trees, but the drafter **reads the verifier's random stream**
#   (`peek_verifier_stream`): it copies the loop's generator, looks at the uniform $u$ the
#   verifier will use for the root's first child, and when $u$ is in the top 65% of $[0, 1)$
#   swaps the root's first two children. Every tree holds the same top tokens; only their order
#   depends on $u$. One-hot verification is exact for *any* order fixed before the coin flips, so
#   this looks harmless, yet the child tried second now meets the high $u$ and the first a fresh
#   draw: the law moves, by a TV that only the chi-square tests see at these sample sizes (full
#   mode prints it).

# %%
from minispec.lab.joint_law import claim_uniform_q, decode_loop_exactness, peek_verifier_stream

runs = {"distilled draft, EAGLE static tree (one-hot q)": lambda: DraftModel(draft, tree="eagle"),
        "WRONG (blatant): same tree, claims uniform q": lambda: claim_uniform_q(DraftModel(draft, tree="eagle"))}
subtle = {"WRONG (subtle): same trees, order read from the verifier's stream":
          lambda: peek_verifier_stream(DraftModel(draft, tree="eagle"), band=0.65)}
tv4 = decode_loop_exactness(smol, tok, runs, subtle, fast=FAST,
                            models="target: SmolLM2-135M-Instruct; draft: minispec's distilled SmolLM2 draft")

# %% [markdown]
# ## 7. Choosing a static tree
#
# EAGLE's `mc_sim_7b_63` tree was chosen for a 7B model on GPUs. Which tree of $n$ nodes is best
# for *your* draft? A simple model (Medusa's, made systematic by Sequoia): the draft's rank-$r$
# candidate under any node is the target's token with probability $a_r$, whatever the depth.
# The node at choice $(r_1, \dots, r_d)$ is then reached and accepted with probability
# $a_{r_1} \cdots a_{r_d}$ (every node above it must be accepted too), and by linearity of
# expectation a tree's expected tokens per step is
#
# $$E[\tau] = 1 + \sum_{\text{nodes}} a_{r_1} \cdots a_{r_d}.$$
#
# The cell below scores EAGLE's tree and a chain under illustrative rates $a = (0.6, 0.15, 0.07,
# 0.04)$ (a draft whose top-1 is right 60% of the time; Sequoia measures them on held-out text).

# %%
from minispec.tree import path_value

rank_acc = [0.6, 0.15, 0.07, 0.04]
eagle_choices = [tuple(c) for c in EAGLE_MC_SIM_7B_63]
usable = [c for c in eagle_choices if all(r < len(rank_acc) for r in c)]  # ranks the model gives a rate for
def expected_tau(choices):
    return 1 + sum(path_value(c, rank_acc) for c in choices)
print(f"EAGLE's tree: {len(eagle_choices)} nodes; {len(usable)} use ranks < {len(rank_acc)}: "
      f"E[tau] = {expected_tau(usable):.3f}")
for k in (4, 8, len(usable)):
    print(f"a chain of {k:>2}: E[tau] = {expected_tau([(0,) * d for d in range(1, k + 1)]):.3f}")

# %% [markdown]
# ### Exercise 4.6 — `best_static_tree(rank_acc, n, max_depth)`
#
# The tree of $n$ nodes (choices of depth at most `max_depth`, each choice's parent included)
# with the highest $E[\tau]$ under the model, as a choices list sorted as `choices_to_parents`
# sorts it.
#
# *Hint.* Can a node ever be worth more than its parent? If not, what does that say about the
# best node you could add next to a tree that is already best for its size? How do you find that
# node without scoring every choice of depth $\le$ `max_depth` each time?

# %%
check("4.6")

# %% [markdown]
# ### The library's version
#
# `minispec.tree.best_static_tree` grows the tree from the root, always adding the frontier
# node of highest path value. Under the same rates it beats EAGLE's tree of the same size, and
# the curve shows where extra nodes stop paying: each new node adds less than the one before.

# %%
from minispec.tree import best_static_tree

best = best_static_tree(rank_acc, len(usable), max_depth=6)
print(f"best tree of {len(usable)} nodes: E[tau] = {expected_tau(best):.3f} (EAGLE's: {expected_tau(usable):.3f})")
print("nodes by depth:", [sum(len(c) == d for c in best) for d in range(1, 7)])
sizes = list(range(1, 65))
fig, ax = plt.subplots(figsize=(6, 3.2))
ax.plot(sizes, [expected_tau(best_static_tree(rank_acc, n, 6)) for n in sizes], label="best tree of n nodes")
ax.plot(sizes, [expected_tau([(0,) * d for d in range(1, n + 1)]) for n in sizes], label="chain of n")
ax.scatter([len(usable)], [expected_tau(usable)], color="k", zorder=3, label="EAGLE mc_sim (ranks < 4)")
ax.set_xlabel("draft nodes n"); ax.set_ylabel("model E[tau]"); ax.legend(); ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# ## Pen-and-paper questions
#
# Short questions to answer without a computer (answers at the end of the notebook).
#
# 1. **From choices to a tree.** Put the choices `[(1,), (0, 0), (0,), (0, 1), (0, 0, 0)]` in
#    node order and give `parents` and `ranks`. Which of `[(0,), (1, 0)]` and
#    `[(0,), (0, 0), (0,)]` does `choices_to_parents` reject, and why?
# 2. **Mask, positions, paths.** For the tree of question 1, write the $6 \times 6$ tree mask
#    (row and column 0 = the root), the positions when the KV cache holds 10 tokens before the
#    root, and `retrieve_indices`. How many entries of the mask are `True`, against a causal mask
#    over the same 6 rows?
# 3. **$E[\tau]$ of small static trees.** Under section 7's per-rank acceptance
#    $a = (0.6, 0.15, 0.07, 0.04)$, compute $E[\tau]$ of the tree of question 1 and of a chain of
#    5 nodes. Which 5 nodes make the best tree of 5, and what is its $E[\tau]$?
# 4. **Nodes against their cost.** Say a verify forward costs the same for 1 to 64 nodes on a GPU
#    (nearly so at batch 1: chapter 9 measures it); on a CPU say it costs $v(N) = 1 + N/40$ target forwards for $N$ nodes. Drafting is
#    ignored, so the predicted speedup is $E[\tau] / v(N)$. (a) Show that adding a node of path
#    value $w$ to a tree of $N$ nodes raises the speedup iff $w > E[\tau] / (40 + N)$. (b) Under
#    the rates of question 3 the best trees of 8, 9 and 10 nodes have $E[\tau]$ = 2.7134, 2.7834
#    and 2.8374. How many nodes should the CPU use, and what does the model predict? And the GPU?
#
# ## Summary
#
# - A static tree is a list of choices (ranks from the root). Sorted by depth, then
#   lexicographically, every parent comes before its children: `parents` and `ranks` in
#   topological order, the layout every tree in minispec uses (row = node + 1).
# - The tree attention mask lets row $a$ see column $b$ iff $b$ is $a$ or one of its ancestors:
#   siblings never see each other, so one masked forward gives every root-to-leaf path its
#   causal logits (checked on SmolLM2 in section 4). A chain's mask is the causal mask.
# - Siblings share a position, prefix length + depth; `retrieve_indices` lists the
#   root-to-leaf paths, and every path a verifier can accept is a prefix of one of them.
# - Greedy verification walks down from the root, accepting the child that carries the
#   target's argmax; the KV cache keeps the root and the accepted rows. The output is vanilla
#   greedy's, token for token. When sampling, the tree's deterministic drafts are verified with
#   one-hot $q$, and the law of the output is the target's (section 6).
# - Under per-rank acceptance, $E[\tau] = 1 + \sum_\text{nodes} a_{r_1} \cdots a_{r_d}$. A node is
#   never worth more than its parent, so the best tree grows one best frontier node at a time;
#   each node adds less than the one before, and the cost of verifying more nodes on the
#   hardware decides where to stop. Chapter 5 grows the tree from the draft's own confidence
#   at every step instead.
#
# ## References
#
# - Miao et al. *SpecInfer: Accelerating Generative Large Language Model Serving with Tree-based
#   Speculative Inference and Verification.* ASPLOS 2024. [arXiv:2305.09781](https://arxiv.org/abs/2305.09781)
# - Cai et al. *Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
#   Heads.* ICML 2024. [arXiv:2401.10774](https://arxiv.org/abs/2401.10774)
# - Li, Wei, Zhang, Zhang. *EAGLE: Speculative Sampling Requires Rethinking Feature
#   Uncertainty.* ICML 2024 (the `mc_sim_7b_63` tree). [arXiv:2401.15077](https://arxiv.org/abs/2401.15077)
# - Chen et al. *Sequoia: Scalable, Robust, and Hardware-aware Speculative Decoding.* 2024 (the
#   best static tree for given acceptance rates and hardware). [arXiv:2402.12374](https://arxiv.org/abs/2402.12374)
# - Li, Wei, Zhang, Zhang. *EAGLE-2: Faster Inference of Language Models with Dynamic Draft
#   Trees.* EMNLP 2024 (chapter 5). [arXiv:2406.16858](https://arxiv.org/abs/2406.16858)
#
# ## The whole chapter
#
# Your file, graded in one table (the same as `python -m minispec grade 4`), and what a
# finished chapter looks like: the reference answers in `solutions/` pass every check.

# %%
check(4, impl="exercises")

# %%
check(4, impl="solutions")

# %% [markdown]
# ## Your mask inside `generate`
#
# `use_impl` makes every `Tree.mask()` call your `tree_mask` (exercise 4.2) while a `with`
# block runs: SmolLM2 decodes with the draft's static EAGLE tree, and every tree forward
# attends through your mask. A wrong mask lets a node see a sibling, and the greedy output
# leaves vanilla's.

# %%
from minispec.grading.inside import decode_inside

decode_inside(lambda: generate(smol, tok, prompts[0], drafter=DraftModel(draft, tree="eagle"), max_new_tokens=n_new).tokens,
              generate(smol, tok, prompts[0], max_new_tokens=n_new).tokens, chapters=(4,));

# %% [markdown]
# ## Answers to the pen-and-paper questions
#
# <details><summary>1. From choices to a tree</summary>
#
# By depth, then lexicographically: `(0,), (1,), (0, 0), (0, 1), (0, 0, 0)` are nodes 0-4.
# `parents = [-1, -1, 0, 0, 2]` (`(0, 0)` and `(0, 1)` hang under node 0, `(0, 0, 0)` under
# node 2) and `ranks = [0, 1, 0, 1, 0]` (each choice's last entry). `[(0,), (1, 0)]` is rejected:
# the parent `(1,)` of `(1, 0)` is not a choice. `[(0,), (0, 0), (0,)]` is rejected: `(0,)`
# appears twice.
# </details>
#
# <details><summary>2. Mask, positions, paths</summary>
#
# Rows (0 = root, row $i + 1$ = node $i$), 1 = may attend:
#
# ```
# root     1 0 0 0 0 0
# node 0   1 1 0 0 0 0
# node 1   1 0 1 0 0 0
# node 2   1 1 0 1 0 0
# node 3   1 1 0 0 1 0
# node 4   1 1 0 1 0 1
# ```
#
# Positions: the root at 10, then prefix + depth: `[10, 11, 11, 12, 12, 13]`.
# `retrieve_indices` has one row per leaf (nodes 1, 3, 4), padded to depth 3:
# `[[1, -1, -1], [0, 3, -1], [0, 2, 4]]`. The mask has $1 + 2 + 2 + 3 + 3 + 4 = 15$ `True`
# entries; a causal mask over 6 rows has $1 + 2 + \dots + 6 = 21$.
# </details>
#
# <details><summary>3. E[tau] of small static trees</summary>
#
# Path values: `(0,)` 0.6, `(1,)` 0.15, `(0, 0)` 0.36, `(0, 1)` $0.6 \times 0.15 = 0.09$,
# `(0, 0, 0)` 0.216. The tree: $E[\tau] = 1 + 1.416 = 2.416$. The chain of 5:
# $1 + 0.6 + 0.36 + 0.216 + 0.1296 + 0.07776 = 2.383$. The best tree of 5 takes the 5 largest
# path values (a node is never worth more than its parent, so their parents come with them):
# 0.6, 0.36, 0.216, 0.15, 0.1296, i.e. `(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)` and `(1,)`: a
# chain of 4 plus the root's second child, $E[\tau] = 2.4556$. Question 1's tree loses because
# `(0, 1)` (0.09) is worth less than `(0, 0, 0, 0)` (0.1296).
# </details>
#
# <details><summary>4. Nodes against their cost</summary>
#
# (a) $\frac{E + w}{1 + (N+1)/40} > \frac{E}{1 + N/40} \iff (E + w)(40 + N) > E(41 + N) \iff
# w (40 + N) > E$. (b) Speedups: 8 nodes $2.7134 / 1.2 = 2.261$; 9 nodes $2.7834 / 1.225 = 2.272$;
# 10 nodes $2.8374 / 1.25 = 2.270$: 9 nodes. With the rule: the 9th node is worth
# $2.7834 - 2.7134 = 0.0700 > 2.7134 / 48 = 0.0565$, so it pays; the 10th is worth $0.0540 <
# 2.7834 / 49 = 0.0568$, so it does not (the 9th node is `(2,)`, worth 0.07; the 10th `(0, 0, 1)`,
# $0.6 \times 0.6 \times 0.15 = 0.054$). On the GPU every node adds $w > 0$ for free: use all 64
# (the best tree of 64 nodes of depth at most 6, the end of section 7's curve, has
# $E[\tau] = 3.853$ under these rates).
# </details>

# %%
# The answers' numbers, computed with the library.
ct1 = parse_choices([(1,), (0, 0), (0,), (0, 1), (0, 0, 0)])
print(f"question 1: node order {ct1.choices}, parents {ct1.parents}, ranks {ct1.ranks}")
for bad in ([(0,), (1, 0)], [(0,), (0, 0), (0,)]):
    try:
        parse_choices(bad)
        print(f"  {bad}: accepted")
    except ValueError as e:
        print(f"  {bad}: rejected ({e})")
t1 = Tree([0] * len(ct1.parents), ct1.parents)
print(f"question 2: mask\n{t1.mask().int().numpy()}\n  {int(t1.mask().sum())} True entries (causal over 6 rows: "
      f"{sum(range(1, 7))}); positions {t1.positions(10).tolist()}; retrieve_indices {t1.retrieve_indices().tolist()}")
E = lambda cs: 1 + sum(path_value(tuple(c), rank_acc) for c in cs)  # noqa: E731
best5 = best_static_tree(rank_acc, 5, 6)
print(f"question 3: E[tau] {E(ct1.choices):.3f} (the tree), {E([(0,) * d for d in range(1, 6)]):.3f} (a chain of 5), "
      f"{E(best5):.4f} (the best tree of 5: {best5})")
taus = {n: E(best_static_tree(rank_acc, n, 6)) for n in (8, 9, 10, 64)}
print("question 4: E[tau] " + ", ".join(f"{n} nodes {t:.4f}" for n, t in taus.items()) + "; CPU speedups "
      + ", ".join(f"{n}: {taus[n] / (1 + n / 40):.3f}" for n in (8, 9, 10)))
