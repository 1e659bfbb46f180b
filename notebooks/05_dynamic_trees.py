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
# value is high:
#
# 1. **expand**: at each depth, take the `top_k` nodes with the highest path score and give each its
#    `top_k` most likely children (one drafter forward per depth, all nodes of the level in one
#    batch with the tree mask);
# 2. **rerank**: keep the `total_tokens` best-scoring nodes of all depths. A child never scores
#    above its parent (probabilities are ≤ 1), so the kept set is a connected tree.
#
# Whether a tree pays at all depends on the hardware: verifying N + 1 tokens in one target
# forward is almost free on a GPU at batch 1 and not free on a CPU. The **tree dispatcher**
# measures that cost on *this* machine and picks the tree with the best predicted tokens/s.
#
# Library code: `minispec/drafters/tree_drafter.py` (`TreeDrafter._dynamic`) and
# `minispec/dispatch.py`.

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

# %%
import inspect
import matplotlib.pyplot as plt
from minispec import verify as vf
from minispec.drafters import TreeDrafter, TreeSpec

print(inspect.getsource(TreeDrafter._dynamic))

# %% [markdown]
# ## 1. A dynamic tree on SmolLM2-135M
#
# The drafter is the shipped EAGLE-1/2 head when it is there (chapter 3), else the shipped
# distilled draft model: both implement the same two hooks, `_start` (root's children) and
# `_extend` (children of a level of new nodes), and `TreeDrafter` builds the tree from them.
# We record every candidate's score to see the rerank at work.

# %%
from minispec.drafters.base import Features
from minispec.methods import Methods, shipped_head
from minispec.tokenizer import encode_prompt
from minispec.sampling import GREEDY

smol, smol_tok = minispec.load("smollm2-135m")
methods = Methods(smol)
BASE = "eagle2" if shipped_head("eagle").is_file() else "sps"
print(f"drafter for this chapter: {BASE} ({'EAGLE-1/2 head' if BASE == 'eagle2' else 'distilled draft model'})")

prompt = "List three facts about the planet Mars."
ctx = encode_prompt(smol_tok, prompt)
spec = TreeSpec.parse("5,4,16")
drafter = methods.drafter(f"{BASE}@5/4/16")
with torch.inference_mode():  # the prefill: the first token (the root) and the features of the prompt
    out = smol(torch.tensor([ctx]), hidden_layers=drafter.target_layers)
root = int(out.logits[0, -1].argmax())
features = Features(out.hidden[0], {i: h[0] for i, h in out.layer_inputs.items()})
drafter.prefill(ctx + [root], features if drafter.reads_features else None)  # EAGLE heads read features
tree = drafter.propose(GREEDY, budget=8)
print(f"root: {smol_tok.decode([root])!r}; {len(tree)} nodes, depth {tree.depth}")
for path in tree.paths():
    print("  " + " | ".join(repr(smol_tok.decode([tree.tokens[i]])) for i in path))


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
# ## 2. Is the draft calibrated? Confidence vs acceptance
#
# The premise of EAGLE-2, measured: run greedy speculative decoding with a chain, record the
# draft's probability of each drafted token and whether the target accepted it, and bin.

# %%
from minispec import generate
from minispec.drafters.tree_drafter import TreeDrafter

from contextlib import contextmanager

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
from minispec.prompts import own_prompts
prompts = [p["prompt"] for p in own_prompts()][: 2 if FAST else 6]
for pr in prompts:
    log = []
    with recording(methods.drafter(f"{BASE}@chain:4"), log) as d:
        r = generate(smol, smol_tok, pr, drafter=d, max_new_tokens=32 if FAST else 128)
    out = r.tokens
    pos = 1  # the first token comes from the prefill; each proposal follows the tokens emitted so far
    for (tokens, confs), emitted in zip(log, r.stats.tokens_per_step[1:]):
        accepted = emitted - 1  # the bonus / correction token is not a draft
        for j, c in enumerate(confs):
            if j <= accepted:  # tested: the earlier drafts were accepted
                pairs.append((c, j < accepted))
import numpy as np
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
print(f"{len(pairs)} tested drafts; acceptance {acc.mean():.2f}, mean confidence {conf.mean():.2f}")

# %% [markdown]
# ## 3. Chain vs static tree vs dynamic tree on this machine
#
# Same prompts, greedy, every output checked against vanilla. tau counts the bonus token
# (vanilla = 1.00). On a CPU a target forward over N + 1 tokens costs noticeably more than
# over one, so a bigger tau does not always mean more tokens/s: section 4 measures why.

# %%
import platform
from minispec.prompts import own_prompts

configs = [f"{BASE}@chain:4", f"{BASE}@eagle", f"{BASE}@4/4/12", f"{BASE}@5/8/32"]
n_new = 32 if FAST else 128
prompts = [p["prompt"] for p in own_prompts()][: 2 if FAST else 6]
generate(smol, smol_tok, "Hi", max_new_tokens=4)  # warm-up
runs = {name: [] for name in ["vanilla"] + configs}
for pr in prompts:  # interleaved, so machine drift affects every method alike
    ref = generate(smol, smol_tok, pr, max_new_tokens=n_new)
    runs["vanilla"].append(ref)
    for name in configs:
        r = generate(smol, smol_tok, pr, drafter=methods.drafter(name), max_new_tokens=n_new)
        assert r.tokens == ref.tokens, f"{name}: output differs from vanilla greedy"
        runs[name].append(r)
print(f"device: this machine's CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads; "
      f"{len(prompts)} prompts x {n_new} tokens, greedy")
print(f"{'method':<18} {'nodes':>5} {'tau':>5} {'tokens/s':>9}")
for name, rs in runs.items():
    toks = sum(r.stats.new_tokens for r in rs)
    tau = toks / sum(r.stats.target_forwards for r in rs)
    tps = toks / sum(r.stats.total_s for r in rs)
    spec = methods.tree_of(name) if name != "vanilla" else None
    print(f"{name:<18} {spec.max_nodes if spec else 0:>5} {tau:>5.2f} {tps:>9.1f}")
print("every speculative output equals vanilla greedy")

# %% [markdown]
# ## 4. The verify-cost curve and the dispatcher
#
# `minispec.dispatch.verify_cost_curve` times one target forward of N + 1 tokens with a tree
# mask after a cached context. The dispatcher predicts each candidate's tokens/s as
# `tau / (t_verify(N) + t_draft + t_loop)` from a short calibration run and picks the best
# (`python -m minispec tune` does this from the command line and saves the choice that
# `--method auto` uses). Every candidate pays its own `t_loop`, the rest of its measured
# step time (sampling, verification, KV compaction, Python): prompt lookup drafts for free
# but still pays a longer verify and its own bookkeeping, and charging it vanilla's loop
# would flatter it.

# %%
import json, glob
from minispec import dispatch

sizes = (0, 4, 16, 32, 64) if FAST else dispatch.DEFAULT_SIZES
curve = dispatch.verify_cost_curve(smol, sizes=sizes, context=256, reps=3 if FAST else 7)
plt.figure(figsize=(6, 4))
plt.plot(list(curve[1]), [s * 1e3 for s in curve[1].values()], "o-", label="this machine (CPU), batch 1")
from pathlib import Path
results = Path(minispec.__file__).resolve().parents[1] / "benchmarks" / "results"
gpu = [f for f in sorted(results.glob("tune_*.json")) if json.loads(f.read_text())["device"].get("cuda")]
if gpu:
    g = json.loads(gpu[-1].read_text())
    c = g["cost_curve"]["1"]
    plt.plot([int(n) for n in c], [s * 1e3 for s in c.values()], "s-", label=f"{g['device'].get('gpu', 'GPU')}, batch 1")
else:
    print("no GPU tune result is committed in benchmarks/results/ yet: CPU curve only")
plt.xlabel("tree size N (tokens verified = N + 1)"); plt.ylabel("target forward (ms)"); plt.legend()
plt.title("verify cost, SmolLM2-135M, 256 cached tokens"); plt.show()

# %%
cands = ["vanilla", "pld", f"{BASE}@chain:4", f"{BASE}@eagle", f"{BASE}@4/4/12"] if FAST else list(dispatch.DEFAULT_CANDIDATES)
r = dispatch.tune(smol, smol_tok, dispatch.calibration_prompts(2 if FAST else 8), candidates=cands,
                  max_new_tokens=16 if FAST else 64, sizes=sizes, methods=methods, progress=False)
print(dispatch.format_tune(r))

# %% [markdown]
# ### Where a step's time goes
#
# The cost model needs three numbers per candidate: verify, draft and the rest of the loop.
# `python -m minispec profile` measures them from the decode loop's own clock
# (`GenerationStats.phase_s`: draft, target forward, verify, KV commit, feature hand-off,
# other), next to the machine's memory bandwidth and the floor it puts under one target
# forward (weight bytes / bandwidth). The committed result file, plotted: a method pays off
# when its step costs less than tau vanilla steps.

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
# ## 5. Exactness with a dynamic tree (GPT-2, TV distance)
#
# Dynamic trees hold deterministic top-k drafts, so minispec verifies them as one-hot q
# (chapter 2), which is lossless for any p. Empirically: the first token emitted by one
# speculative step with a dynamic tree from the draft model, at temperature 1, against the
# target's own distribution.

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
from minispec import exactness as ex
from minispec.drafters import DraftModel

# top-k 4 keeps the law of the second new token small (at most 16 tokens), so the TV bound is tight
params4 = SamplingParams(temperature=1.0, top_k=4)
with torch.inference_mode():
    p1 = probs(gpt_target(torch.tensor([ids])).logits[0, -1].double(), params4)
    law = torch.zeros_like(p1)  # exact law of the 2nd token: sum over the 1st
    for a in p1.nonzero().flatten().tolist():
        law += p1[a] * probs(gpt_target(torch.tensor([ids + [a]])).logits[0, -1].double(), params4)
N = 1000 if FAST else 8000
counts = torch.zeros(len(law), dtype=torch.float64)
accepted = 0
for s in range(N):  # the 2nd token comes from the first tree step (root = the prefill's token)
    r = generate(gpt_target, gpt_tok, ids, drafter=DraftModel(gpt_draft, tree="2,2,3"), max_new_tokens=4,
                 temperature=1.0, top_k=4, seed=s)
    counts[r.tokens[1]] += 1
    accepted += r.stats.accepted_at_depth[0] if r.stats.accepted_at_depth else 0
sup = int((law > 0).sum())
tv = 0.5 * (counts / N - law).abs().sum().item()
bound = ex.tv_bound(N, sup)
print(f"{target_name} target, {draft_name} draft, dynamic tree 2,2,3, temperature 1, top-k 4: "
      f"TV = {tv:.4f} over {N} samples, |support| = {sup}, bound {bound:.4f}; "
      f"a draft was accepted in {accepted / N:.0%} of the steps")
assert tv <= bound

# %% [markdown]
# ## Exercises
#
# Implement the functions in `exercises/ch05_dynamic_trees.py` (generated from `solutions/`; same
# signatures and docstrings). The checks compare your functions with minispec's `TreeDrafter` (through a toy drafter with seeded logits) and `dispatch`.
#
# | exercise | function | task |
# |---|---|---|
# | 5.1 | `expand_level` | one EAGLE-2 expansion: top-$k$ children per frontier node, path scores, next frontier |
# | 5.2 | `rerank` | keep the best `total_tokens` candidates as a connected tree, in topological order |
# | 5.3 | `predicted_tokens_per_s` | the dispatcher's cost model: $\tau$ / (verify time + draft time) |
# | 5.4 | `dynamic_tree` | a whole EAGLE-2 tree from a toy next-token function, with 5.1 and 5.2 |
#
# Grade from a terminal with `python -m minispec grade 5` or
# `pytest tests/test_exercises.py -m ch05 --impl exercises`; in this notebook with
# `check("5.1")` (one exercise) or `check(5)` (the chapter). The cell below prints
# the stub of the first exercise, then grades your file: it reports failures, it does not
# raise, so until you fill in the stubs every line says "not implemented yet".

# %%
import inspect
from minispec.grading import check, load_impl

mine = load_impl(5, "exercises")
print(inspect.getsource(mine.expand_level))
check(5, impl="exercises")

# %%
# What a finished chapter looks like: the reference answers in solutions/ pass every check.
check(5, impl="solutions")
