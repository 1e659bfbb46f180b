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
# # Chapter 3 — EAGLE: drafting at the feature level
#
# Chapters 1–2 drafted with a small *model*. EAGLE (Li et al. 2024, "EAGLE: Speculative
# Sampling Requires Rethinking Feature Uncertainty") drafts with a **one-layer head** that
# reads the target's own **features** — its last hidden state $f_t$ after the final norm —
# and predicts the next feature; the target's frozen LM head turns predicted features into
# draft tokens. Two observations make it work:
#
# 1. **Features are easier to extrapolate than tokens**: $f_{t+1}$ is a smooth function of the
#    past features, and the LM head on top is shared, so a single decoder layer suffices.
# 2. **Feature uncertainty**: $f_{t+1}$ depends on which token was *sampled* at $t+1$, which
#    $f_t$ alone does not know. So the head also reads the embedding of that token — the
#    **shifted token** $x_{t+1}$ — and its input is $\mathrm{fc}(\mathrm{cat}[e(x_{t+1}), f_t])$,
#    embedding first.
#
# EAGLE-2 keeps the head and grows a *dynamic tree* from its (calibrated) confidence
# (chapter 5). **EAGLE-3** (Li et al. 2025) fuses low, middle and high target layers instead
# of the last hidden state, drops the feature-regression loss, drafts over a reduced
# vocabulary, and trains the head on its *own* outputs ("training-time test"). **Medusa**
# (Cai et al. 2024), for comparison, puts $K$ independent heads on $f_t$ that never see the
# drafted tokens.
#
# **Learning objectives**
# 1. Explain feature uncertainty and the one-token shift of EAGLE's input pairs.
# 2. Read the heads' architectures and their sizes next to a 2-layer draft model.
# 3. Train an EAGLE head for a few steps on CPU with SmoothL1 + 0.1 × cross-entropy.
# 4. Measure acceptance per draft position for SpS, Medusa, EAGLE-1 and EAGLE-3 on SmolLM2.
# 5. Check that the draft's confidence is calibrated (EAGLE-2's premise) and that decoding
#    with an EAGLE head at temperature 1 keeps the target's distribution.
# 6. Implement exercises 3.1–3.6 and grade them (3.5: draft a chain at the feature level, the head feeding itself;
#    3.6: EAGLE-3's training-time test, training the levels the head drafts on its own features).
#
# Library code: `minispec/drafters/eagle.py`, `eagle3.py`, `medusa.py`, `loader.py`;
# training: `minispec/train/eagle.py`, `eagle3.py`, `medusa.py`.

# %%
# Versions, FAST mode and the device: the first cell of every chapter (minispec.lab.notebook.setup).
import os, platform

import minispec
import torch
from minispec.lab.notebook import setup, show

FAST = setup()  # MINISPEC_FAST=1: smaller sample counts and shorter generations (CI sets it)

# %%
import inspect
import json
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from minispec import generate
from minispec.drafters.eagle import EagleConfig, EagleHead
from minispec.drafters.loader import load_drafter
from minispec.grading import check  # check("3.1"): grade one exercise of your exercises/ file (prints, never raises)
from minispec.methods import Methods, shipped_head
from minispec.tokenizer import encode_prompt

smol, smol_tok = minispec.load("smollm2-135m")
print(f"target: SmolLM2-135M-Instruct, {smol.cfg.n_layer} layers, hidden {smol.cfg.d_model}, vocab {smol.cfg.vocab_size}")

# The heads shipped with minispec for SmolLM2-135M (python -m minispec train eagle | eagle3 | medusa).
HEADS = {kind: Path(str(shipped_head(kind))) for kind in ("eagle", "eagle3", "medusa")}
missing = [f"{p} (+ {p.with_suffix('.json').name})" for p in HEADS.values()
           if not (p.is_file() and p.with_suffix(".json").is_file())]
if missing:
    raise FileNotFoundError("this notebook needs the heads shipped in minispec/checkpoints; missing: "
                            + "; ".join(missing) + ". Train them with `python -m minispec train eagle` "
                            "(and eagle3, medusa), or reinstall minispec with its checkpoints.")
for kind, p in HEADS.items():
    print(f"{kind:>7}: {p.name} ({p.stat().st_size / 2**20:.1f} MiB)")

# %% [markdown]
# ## 1. Why features, and why the shifted token
#
# Feature uncertainty, measured: take a prompt, the target's two most likely next tokens $a$
# and $b$, and the feature the target computes *after* each of them. If the two branches lead
# to very different features, no function of $f_t$ alone can predict $f_{t+1}$: it would have
# to average two distant targets. Given the token actually taken, the next feature is
# determined. We compare that gap with how far the feature moves in one ordinary step.

# %%
prompt_ids = encode_prompt(smol_tok, "Write a short poem about the sea.")
with torch.inference_mode():
    out = smol(torch.tensor([prompt_ids]))
    f_t = out.hidden[0, -1]  # [H] the feature at the last prompt position
    top2 = out.logits[0, -1].softmax(-1).topk(2)
    nxt = {}
    for tok_id in top2.indices.tolist():  # the feature after each branch
        nxt[tok_id] = smol(torch.tensor([prompt_ids + [tok_id]])).hidden[0, -1]
    steps = (out.hidden[0, 1:] - out.hidden[0, :-1]).norm(dim=-1)  # [T-1] ordinary one-step moves
a, b = top2.indices.tolist()
gap = (nxt[a] - nxt[b]).norm().item()
print(f"the target's two most likely next tokens: {smol_tok.decode([a])!r} (p={top2.values[0]:.2f}), "
      f"{smol_tok.decode([b])!r} (p={top2.values[1]:.2f})")
print(f"||f_t+1(a) - f_t+1(b)|| = {gap:.1f}; ||f_t+1(a) - f_t|| = {(nxt[a] - f_t).norm():.1f}; "
      f"median one-step move ||f_j+1 - f_j|| in the prompt = {steps.median():.1f}; ||f_t|| = {f_t.norm():.1f}")
print(f"the two branches' next features are {gap / steps.median().item():.0%} of an ordinary step apart: a head "
      f"that sees f_t but not the sampled token must aim between them; given the token, the target is one point")

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 3.6), gridspec_kw=dict(width_ratios=[1, 1.4]))
ax1.bar(["f(a) vs f(b)\n(two branches)", "f(a) vs f_t\n(one step)", "median step\nin the prompt"],
        [gap, (nxt[a] - f_t).norm().item(), steps.median().item()], color=["tab:red", "tab:blue", "0.6"])
ax1.set_ylabel("L2 distance"); ax1.set_title("feature uncertainty: the sampled token decides f_t+1")
# the shifted pairs the head reads: position j = (embedding of x_j+1, feature f_j) -> g_j+1
n = 5
for j in range(n):
    ax2.text(j, 2, f"x{j}", ha="center", va="center", bbox=dict(boxstyle="round", fc="w"))
    if j < n - 1:
        ax2.text(j, 1, f"f{j}", ha="center", va="center", bbox=dict(boxstyle="round", fc="lightblue"))
        ax2.text(j, 0, f"g{j + 1}", ha="center", va="center", bbox=dict(boxstyle="round", fc="moccasin"))
        ax2.annotate("", (j + 0.05, 1.2), (j + 0.95, 1.8), arrowprops=dict(arrowstyle="->", color="tab:red"))
        ax2.annotate("", (j, 0.2), (j, 0.8), arrowprops=dict(arrowstyle="->"))
ax2.text(n - 0.6, 1, "head input at j:\ncat[e(x_j+1), f_j]\n(red: the shift)", fontsize=9)
ax2.set_xlim(-0.6, n + 0.8); ax2.set_ylim(-0.5, 2.5); ax2.axis("off")
ax2.set_title("EAGLE's pairs: token x_j+1 with feature f_j; output g_j+1 predicts f_j+1")
plt.tight_layout(); plt.show()

# %% [markdown]
# ### Exercise 3.1 — `eagle_input(embedding, tokens, features)`
#
# Implement `eagle_input` in `exercises/ch03_eagle.py`: the head's input rows for a context, one per
# head position $j$, each pairing $f_j$ with a token's embedding (the shifted pairs, embedding first).
#
# *Hint.* Look at the right-hand figure: which token does feature $f_j$ travel with, and which
# token of the context has no feature yet? Count the rows you must return from the shapes in
# the docstring, and mind the order of the two halves of each row.

# %%
check("3.1")

# %% [markdown]
# The head itself (`EagleHead.forward`): `fc` on the concatenation, then one Llama decoder
# layer without its input norm (the features are already normed) and no final norm; its
# output is a predicted feature, scored by the target's own LM head. The official heads have
# that one layer; a deeper head (`num_hidden_layers` > 1 in its config, `train eagle --layers`)
# runs ordinary pre-norm Llama layers after it, each with its own layer of the head's KV cache:
# that is the loop over `self.layers`.

# %%
print(inspect.getsource(EagleHead.forward))

# %% [markdown]
# ## 2. The heads, their sizes, and the 2-layer draft model
#
# `load_drafter` detects a checkpoint's kind from its tensor names (EAGLE-1/2, EAGLE-3,
# Medusa, minispec's draft model) and says what it inferred. All heads share the target's
# token embedding and LM head (frozen), so they store only what is theirs; so does the
# distilled 2-layer draft model of chapters 1–2. Counts below are each drafter's **own**
# parameters; EAGLE-3 also carries its own small LM head over the draft vocabulary.

# %%
drafters = {kind: load_drafter(str(p), smol) for kind, p in HEADS.items()}
heads = {"EAGLE-1/2": drafters["eagle"].head, "EAGLE-3": drafters["eagle3"].head, "Medusa": drafters["medusa"].heads}
print(heads["EAGLE-1/2"])
print(heads["EAGLE-3"])
print(heads["Medusa"])

# %% [markdown]
# What EAGLE-3 changes, visible in its modules: `fc` takes $3H$ inputs (the hidden states
# entering three target layers, low / middle / high, instead of the last one); the layer's
# attention reads $2H$ = `cat[input_layernorm(embedding), hidden_norm(h)]`; it has its own
# final `norm` and an `lm_head` over a **draft vocabulary** of the most frequent training
# tokens, mapped back to target ids by `d2t` (exercises 3.2–3.3). At its next drafting step the
# head is fed its *own* output hidden state, not a target feature, and it is trained that way
# too (the **training-time test** of section 8 and exercise 3.6: the head runs on its own outputs
# for several levels, each level's loss weighted $\text{decay}^j$), so there is no
# feature-regression loss. Medusa's heads are one residual block each on $f_t$;
# head $i$ guesses the token $i+1$ positions ahead without seeing the drafts in between.

# %%
from minispec.drafters.draft_checkpoint import load_draft_model

draft_model = load_draft_model(smol)
shared = {id(smol.tok_emb.weight), id(smol.lm_head.weight)}
count = lambda m: sum(p.numel() for p in m.parameters() if id(p) not in shared)  # noqa: E731  own params only
sizes = {**{k: count(h) for k, h in heads.items()}, "2-layer draft model": count(draft_model)}
target_n = sum(p.numel() for p in smol.parameters())
for name, n in sizes.items():
    print(f"{name:<20} {n / 1e6:6.2f} M own parameters ({n / target_n:.1%} of the target's {target_n / 1e6:.1f} M)")
e3 = heads["EAGLE-3"].config
print(f"EAGLE-3 drafts over {e3.draft_vocab_size} of {e3.vocab_size} target tokens; fused target layers "
      f"{drafters['eagle3'].target_layers} (inputs of layers 2, L//2, L-3 for L = {smol.cfg.n_layer})")
plt.figure(figsize=(6, 3))
plt.barh(list(sizes), [n / 1e6 for n in sizes.values()], color=["tab:blue", "tab:green", "tab:orange", "0.5"])
plt.xlabel("own parameters (millions)"); plt.title("drafter sizes for SmolLM2-135M"); plt.tight_layout(); plt.show()

# %% [markdown]
# ### Exercise 3.2 — `build_vocab_map(token_counts, draft_vocab_size)`
#
# Implement `build_vocab_map`: EAGLE-3's draft vocabulary, the `d2t` offsets and the `t2d` mask.
#
# *Hint.* Decide first which target ids are kept (the most frequent ones; the docstring says
# how to break ties), then in which order they become draft ids. `d2t` stores an *offset*, not
# a target id: what must you add to draft id $i$ to get its target id back? And which inputs
# must be refused?

# %%
check("3.2")

# %% [markdown]
# ### Exercise 3.3 — `to_target_logits(draft_logits, d2t, vocab_size)`
#
# Implement `to_target_logits`: the head's draft-vocabulary logits placed into the target
# vocabulary, $-\infty$ elsewhere.
#
# *Hint.* Where does draft id $i$ land in the target vocabulary (exercise 3.2)? Start from a
# tensor that gives every target id probability zero under the draft, then fill in the draft
# ids; your function must accept any leading dimensions and keep the input's dtype.

# %%
check("3.3")

# %% [markdown]
# ## 3. Training an EAGLE head, in miniature
#
# The shipped head was trained by `python -m minispec train eagle` (recipe below, from its
# JSON record). Here we run the same loss, `minispec.train.eagle.eagle_loss`, from a random
# head for a few dozen steps on a handful of SmolLM2's own greedy answers:
#
# $$\mathcal{L} = \mathrm{SmoothL1}(g_{t+1}, f_{t+1}) + 0.1 \cdot \mathrm{CE}\big(\mathrm{softmax}(\mathrm{LM}_K(f_{t+1})),\ \mathrm{softmax}(\mathrm{LM}_K(g_{t+1}))\big)$$
#
# where $\mathrm{LM}_K$ is the target's LM head restricted to the draft vocabulary: the
# $K = 8192$ most frequent tokens, the only ones the head ever proposes (FR-Spec). The target's
# distribution comes from its own next feature $f_{t+1}$, renormalised over the same $K$ tokens,
# so nothing but the features is stored, and the CE costs $K/V = 1/6$ of a full-vocabulary one
# (`eagle_loss(..., draft_head=None)`, `train eagle --draft-vocab 0`, takes the full-vocabulary CE
# against the target's stored top-k instead). EAGLE's uniform noise goes on the input features
# (the head must cope with its own imperfect features when it drafts). Four sequences are far too
# few to generalise: this shows the mechanics and the loss falling, not a useful head.

# %%
import time
from minispec.prompts import own_prompts
from minispec.train import eagle as train_eagle
from minispec.train.data import Sequence, target_features

n_seq, n_tok, n_steps = (4, 32, 40) if FAST else (8, 96, 200)
seqs = []
for p in [x["prompt"] for x in own_prompts()][:n_seq]:  # the target's own greedy answers (self-distillation)
    r = generate(smol, smol_tok, p, max_new_tokens=n_tok)
    seqs.append(Sequence(torch.tensor(r.prompt_tokens + r.tokens), len(r.prompt_tokens), "own"))
feats = target_features(smol, seqs, cache=False)  # one frozen target forward per sequence: the features f
draft_head = train_eagle.draft_head_rows(smol, 8192)  # [K, D]: LM_K, the draft vocabulary's rows

torch.manual_seed(0)
head = EagleHead(EagleConfig.for_target(smol.cfg))
opt = torch.optim.AdamW(head.parameters(), lr=1e-3, betas=(0.9, 0.95))
batch = train_eagle.make_batch(seqs, feats, list(range(len(seqs))))
gen = torch.Generator().manual_seed(0)
hist = []
t0 = time.perf_counter()
for step in range(n_steps):
    loss, l1, ce, acc = train_eagle.eagle_loss(head, smol, batch, ce_weight=0.1, ce_frac=0.25, noise=0.1, generator=gen,
                                               draft_head=draft_head)
    opt.zero_grad(); loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0); opt.step()
    hist.append((loss.item(), l1.item(), ce.item(), acc.item()))
hist = np.array(hist)
print(f"{n_steps} steps on {len(seqs)} sequences ({int(batch[-1].sum())} loss positions) in "
      f"{time.perf_counter() - t0:.0f} s; loss {hist[0, 0]:.2f} -> {hist[-1, 0]:.2f}, "
      f"top-1 agreement with the target on the CE positions {hist[0, 3]:.2f} -> {hist[-1, 3]:.2f} (training data)")
fig, axs = plt.subplots(1, 3, figsize=(13, 3.2))
for ax, col, name in zip(axs, (1, 2, 3), ("SmoothL1 (features)", "soft CE (tokens)", "top-1 agreement")):
    ax.plot(hist[:, col]); ax.set_title(name); ax.set_xlabel("step")
plt.tight_layout(); plt.show()

# %%
# How the shipped heads were trained: their JSON records (written by the training commands).
for kind, p in HEADS.items():
    rec = json.loads(p.with_suffix(".json").read_text())
    tr = rec.get("training", {})
    print(f"{kind}: {rec.get('command', '(no command recorded)')}")
    print(f"    steps {tr.get('steps', '?')}, loss: {tr.get('loss', '?')}, train time {tr.get('train_s', '?')} s, "
          f"data {rec.get('data', {}).get('train_sequences', '?')} sequences")
    ev = rec.get("eval", {}).get("heldout")
    if ev is not None:
        print(f"    held-out (teacher-forced) eval: {ev}")

# %% [markdown]
# ### Exercise 3.4 — `eagle_loss(pred_feat, target_feat, pred_logits, top_idx, top_logp, w_cls)`
#
# Implement `eagle_loss`: SmoothL1 on features + $w_{cls}$ × soft cross-entropy against the
# target's top-$K$, on $N$ positions: the loss above in EAGLE's original, full-vocabulary form
# (`--draft-vocab 0`), where the head's distribution spans all $V$ tokens and the target's is
# stored as its top-$K$ log-probabilities.
#
# *Hint.* The two terms are separate: the feature term compares $g_{t+1}$ with $f_{t+1}$; the
# token term needs the target's distribution over its $K$ kept tokens (the stored
# log-probabilities need not sum to 1) and the head's log-probabilities *at those same
# tokens*. Average over positions, and keep everything a torch operation so gradients flow.

# %%
check("3.4")

# %% [markdown]
# ## 4. Acceptance per draft position: SpS vs Medusa vs EAGLE-1 vs EAGLE-3
#
# Greedy decoding on SmolLM2 with a chain from each drafter. $\alpha_d$ = (steps that accepted
# the depth-$d$ draft) / (steps that tested it, i.e. accepted depths $1..d-1$): the acceptance
# of the $d$-th draft token given the earlier ones were right, as in EAGLE's "0-α … n-α" plots
# (the $d$-th EAGLE draft is made from $d-1$ of the head's own features). Every output is checked
# against vanilla greedy: speculative decoding must not change it. A rate rests on the number of
# tests printed beside it (a handful at the deep positions, fewer still in FAST mode); "-" and a
# missing bar mean that depth was never reached.

# %%
methods = Methods(smol)
medusa_depth = min(4, drafters["medusa"].heads.num_heads)
make = {
    "SpS (2-layer draft), chain 5": lambda: methods.drafter("sps@chain:5"),
    f"Medusa, chain {medusa_depth}": lambda: load_drafter(str(HEADS["medusa"]), smol, tree=f"chain:{medusa_depth}", verbose=False),
    "EAGLE-1, chain 5": lambda: load_drafter(str(HEADS["eagle"]), smol, tree="chain:5", verbose=False),
    "EAGLE-3, chain 5": lambda: load_drafter(str(HEADS["eagle3"]), smol, tree="chain:5", verbose=False),
}
n_new = 32 if FAST else 128
prompts = [p["prompt"] for p in own_prompts()][-1:] if FAST else [p["prompt"] for p in own_prompts()][-6:]
refs = {pr: generate(smol, smol_tok, pr, max_new_tokens=n_new) for pr in prompts}  # vanilla greedy
rows = {}
for name, mk in make.items():
    d = mk()
    tested, accepted, new, fwd = np.zeros(5), np.zeros(5), 0, 0
    for pr, ref in refs.items():
        r = generate(smol, smol_tok, pr, drafter=d, max_new_tokens=n_new)
        assert r.tokens == ref.tokens, f"{name}: output differs from vanilla greedy on {pr!r}"
        s = r.stats
        tested[:len(s.tested_at_depth)] += s.tested_at_depth
        accepted[:len(s.accepted_at_depth)] += s.accepted_at_depth
        new, fwd = new + s.new_tokens, fwd + s.target_forwards
    rows[name] = (np.divide(accepted, tested, out=np.full(5, np.nan), where=tested > 0), new / fwd, tested)
print(f"greedy, {len(prompts)} prompts x {n_new} new tokens; every output equals vanilla greedy")
print(f"{'drafter':<30} {'tau':>5} " + " ".join(f"{'a_' + str(d):>6}" for d in range(1, 6)))
for name, (alpha, tau, tested) in rows.items():
    print(f"{name:<30} {tau:>5.2f} " + " ".join(f"{'-':>6}" if np.isnan(a) else f"{a:6.2f}" for a in alpha)
          + f"   tests per depth {tested.astype(int).tolist()}")
emitted = torch.tensor([t for r in refs.values() for t in r.tokens])
inside = drafters["eagle3"].head.t2d[emitted].float().mean().item()
print(f"EAGLE-3's draft vocabulary holds {inside:.1%} of the {len(emitted)} tokens the target emitted here; "
      f"the rest can never be drafted (q = 0), only emitted by the target itself")

# %%
fig, ax = plt.subplots(figsize=(9, 3.8))
w = 0.8 / len(rows)
for i, (name, (alpha, tau, _)) in enumerate(rows.items()):
    ax.bar(np.arange(1, 6) + (i - (len(rows) - 1) / 2) * w, np.nan_to_num(alpha), w, label=f"{name} (tau {tau:.2f})")
ax.set_xlabel("draft position d"); ax.set_ylabel("acceptance alpha_d (given d-1 accepted)")
ax.set_xticks(range(1, 6)); ax.set_ylim(0, 1); ax.legend(fontsize=8)
ax.set_title("acceptance per draft position, SmolLM2-135M, greedy"); plt.tight_layout(); plt.show()

# %% [markdown]
# ## 5. Is the EAGLE head calibrated? (EAGLE-2's premise)
#
# EAGLE-2 grows its tree where the head is confident, which pays only if confidence predicts
# acceptance. Measured on the vanilla greedy answers of section 4's prompts, teacher-forced
# (the head reads the target's true features, as for the first draft position): for every
# position, the head's top probability and whether its top token is the target's greedy token.

# %%
eagle_head = drafters["eagle"].head
conf, hit = [], []
with torch.inference_mode():
    for r in refs.values():  # section 4's vanilla greedy answers
        seq = torch.tensor([r.prompt_tokens + r.tokens])  # [1, T]
        o = smol(seq)
        g = eagle_head(smol.tok_emb(seq[:, 1:]), o.hidden[:, :-1], torch.arange(seq.shape[1] - 1))  # [1, T-1, H]
        q = smol.lm_head(g)[0, :-1].float().softmax(-1)  # [T-2, V] head position j drafts x_j+2
        greedy = o.logits[0, 1:-1].argmax(-1)  # [T-2] the target's greedy token after x_0..x_j+1
        P = len(r.prompt_tokens)
        c, t = q.max(-1)
        conf += c[P - 2:].tolist(); hit += (t == greedy)[P - 2:].tolist()  # answer positions only
conf, hit = np.array(conf), np.array(hit, dtype=float)
bins = np.linspace(0, 1, 6)
idx = np.clip(np.digitize(conf, bins) - 1, 0, 4)
xs = [conf[idx == b].mean() for b in range(5) if (idx == b).any()]
ys = [hit[idx == b].mean() for b in range(5) if (idx == b).any()]
ns = [int((idx == b).sum()) for b in range(5) if (idx == b).any()]
plt.figure(figsize=(5, 4)); plt.plot([0, 1], [0, 1], "k--", lw=1, label="perfect calibration")
plt.plot(xs, ys, "o-", label=f"EAGLE head ({len(conf)} positions)")
for x, y, n in zip(xs, ys, ns):
    plt.annotate(str(n), (x, y), xytext=(4, -10), textcoords="offset points", fontsize=8)
plt.xlabel("head confidence (top probability)"); plt.ylabel("acceptance (top token = target greedy)")
plt.legend(); plt.title("confidence vs acceptance, SmolLM2-135M"); plt.show()
print(f"{len(conf)} positions: acceptance {hit.mean():.2f}, mean confidence {conf.mean():.2f}; "
      f"acceptance when confidence > 0.8: {hit[conf > 0.8].mean() if (conf > 0.8).any() else float('nan'):.2f} "
      f"({int((conf > 0.8).sum())} positions), when < 0.4: "
      f"{hit[conf < 0.4].mean() if (conf < 0.4).any() else float('nan'):.2f} ({int((conf < 0.4).sum())} positions)")

# %% [markdown]
# ## 6. Exactness with the shipped EAGLE head in the loop: SmolLM2-135M, temperature 1
#
# Greedy equality (section 4) says nothing about sampling. Here the real decode loop
# (`minispec.batch.generate_batch`, many runs at a time, each with its own seed) samples
# SmolLM2-135M-Instruct at temperature 1, top-k 3, after an open prompt ("The best way to", where
# the target's first three tokens spread over 27 outcomes, printed below with the largest share), with the shipped
# EAGLE-1/2 head drafting a **sampled chain of 2** (real $q$: the head's own distribution,
# verified by Leviathan/Chen rejection sampling, chapter 1). We compare the law of the first
# three new tokens (token 1 from the prefill, tokens 2-3 from the first speculative step: drafts
# accepted, or a residual draw, or the bonus) with the target's exact law,
# `minispec.lab.joint_law.first_tokens_law` (packed forwards, as in chapters 1-2).
#
# Two deliberately wrong controls run beside the honest head:
#
# - **blatant**: the same chain, but its proposals claim they were drawn from a **uniform** $q$
#   (`claim_uniform_q`). Verification then accepts a draft with $\min(1, p(x)/q(x)) = 1$ whenever
#   the target can emit $x$, so the emitted law becomes the head's;
# - **subtle**: the same chain with honest $q$, but the head draws its drafts from a *copy* of the
#   loop's generator (`share_verifier_stream`): the uniform behind draft $x$ is the very one the
#   verifier then compares with $p(x)/q(x)$. Each draft still follows $q$; what breaks is the
#   independence of drafts and coin flips that chapter 1's proof uses. The law moves too little
#   for the TV bound at these sample sizes (the printout gives the TV measured and the runs the TV
#   test alone would need). It takes hundreds of runs, minutes of SmolLM2 decoding, so it runs in
#   full mode only; in fast mode (CI) `tests/test_joint_law.py` flags the same kind of control on
#   tiny models.
#
# How far a control strays depends on the head: one whose drafts follow the target more closely
# makes both controls milder. So the controls are tested *sequentially* (`control_max`): when $N$
# runs do not flag one, it gets $2N$, $4N$, ... runs, each look at level $\alpha$ / looks, so that an
# exact sampler would still be flagged with probability at most $2\alpha$ over all looks. The
# honest runs always take $N$.
#
# A run is flagged when its TV exceeds `tv_bound(N, K)` **or** Pearson's chi-square tests
# (`exactness.chi_square_p`, small bins merged) of the laws of the first one, two and three
# tokens reject the exact law: `joint_law.prefix_p_value` takes the smallest of the three
# p-values times 3 (Bonferroni) and flags below $10^{-6}$; an honest sampler is flagged with
# probability below $2 \cdot 10^{-6}$. The TV test catches any large deviation; the chi-square
# tests, weighing each outcome by its own variance, catch a small one with far fewer runs, and
# the shorter prefixes see a deviation at token 2 before token 3's outcomes dilute it. For each control that only the chi-square test flags, the printout adds
# chapter 2's line: how many runs the TV test alone would need (`exactness.samples_for_tv`).

# %%
from minispec.lab.joint_law import claim_uniform_q, decode_loop_exactness, share_verifier_stream

eagle_chain = load_drafter(str(HEADS["eagle"]), smol, tree="chain:2", verbose=False)
runs = {"EAGLE-1/2 head, chain:2 (real q)": eagle_chain.fresh,
        "WRONG (blatant): same chain, claims uniform q": lambda: claim_uniform_q(eagle_chain.fresh())}
if not FAST:  # the EAGLE-3 head too (its q lives on a reduced vocabulary, mapped back by d2t)
    runs["EAGLE-3 head, chain:2 (real q)"] = load_drafter(str(HEADS["eagle3"]), smol, tree="chain:2", verbose=False).fresh
subtle = {"WRONG (subtle): same chain, drafts from the verifier's stream": lambda: share_verifier_stream(eagle_chain.fresh())}
tv3 = decode_loop_exactness(smol, smol_tok, runs, subtle, fast=FAST,
                            models="target: SmolLM2-135M-Instruct; drafter: minispec's shipped EAGLE heads")

# %% [markdown]
# ## 7. Drafting a chain: the head feeds itself
#
# The head turns the context's pairs $(e(x_{j+1}), f_j)$ into predicted features; its output at
# the last pair, $g_{n-1}$, stands for the target's feature at the last committed token, and the
# LM head turns it into the first draft token $d_1$. For $d_2$ the head needs the pair
# $(e(d_1), f_{n-1})$, but the target has not run on the new tokens, so there is no $f_{n-1}$:
# EAGLE pairs $d_1$ with the head's **own** prediction $g_{n-1}$, and so on down the chain. This
# is autoregression at the feature level, and why the head is trained on noisy features
# (`--noise`): from the second draft on it reads its own, imperfect outputs, and acceptance falls
# with depth (section 4's curves).
#
# The cell below lets the shipped head draft a chain of 5 after a prompt and the target's first
# token, and sets it beside what the target itself then emits (greedy).

# %%
from minispec.drafters.base import Features
from minispec.sampling import GREEDY

chain_ids = encode_prompt(smol_tok, "Write a short poem about the sea.")
with torch.inference_mode():
    out = smol(torch.tensor([chain_ids]))
context = chain_ids + [int(out.logits[0, -1].argmax())]  # the prompt and the target's first token
chain5 = load_drafter(str(HEADS["eagle"]), smol, tree="chain:5", verbose=False)
chain5.prefill(context, Features(out.hidden[0]))  # f_0 .. f_{n-1}: the target's features of the prompt
drafts = chain5.propose(GREEDY, budget=5).tokens
truth = generate(smol, smol_tok, chain_ids, max_new_tokens=6, chat=False).tokens[1:6]
print("head drafts:  ", [smol_tok.decode([t]) for t in drafts])
print("target emits: ", [smol_tok.decode([t]) for t in truth])
accepted = next((i for i, (a, b) in enumerate(zip(drafts, truth)) if a != b), len(drafts))
print(f"greedy verification would accept the first {accepted} of 5")

# %% [markdown]
# ### Exercise 3.5 — `draft_chain(head, embedding, lm_head, tokens, features, k)`
#
# Draft $k$ tokens greedily with an EAGLE-1/2 head, as `EagleDrafter` does with a chain. The
# check runs small random heads in float64 and compares your tokens with `EagleDrafter`'s.
#
# *Hint.* Which pairs does the context give you, and which position does the head's last output
# stand for? Once a draft token exists, which feature can sit beside it in the next pair? You may
# rerun the head over all pairs at every step (no KV cache needed): is the result the same?

# %%
check("3.5")

# %% [markdown]
# ## 8. Training-time test: training the levels the head drafts on its own features
#
# Section 7's chain is drafted on the head's own features from the second token on, yet section 3
# trained it only on the target's: every training pair was $(x_{t+1}, f_t)$ with the true $f_t$. The
# deeper the draft, the further its input is from anything it saw in training, and acceptance falls
# with depth (section 4). EAGLE-3 (Li et al. 2025) trains the way it drafts, the **training-time
# test**; HASS (Zhang et al. 2024) applies it to EAGLE-1/2 heads, and so does
# `python -m minispec train eagle --ttt-steps N`. In one forward over a sequence, every position $t$
# is an *anchor* whose chain is drafted $N$ levels deep at once: level 0 is the teacher-forced head;
# level $j$ reads the head's own level-$(j-1)$ output at the same anchor beside the token $j$ steps
# further on, sits $j$ positions further on, and predicts the target's feature $j + 1$ steps ahead.
# What makes it a drafted chain and not $N$ independent heads is the attention mask: a level's row
# may see the committed pairs (level 0's keys) only up to its anchor, and of the later levels only
# its own chain, as `EagleDrafter`'s tree mask allows (chapter 4). Each level's loss is weighted
# $\text{decay}^j$: the first drafts matter most, since a chain is accepted only up to its first miss.

# %% [markdown]
# ### Exercise 3.6 — `ttt_loss(level, tokens, features, valid, steps, decay)`
#
# Write the unrolled loss: for each level, the tokens, input features, positions and attention mask it
# runs on (through the given `level`, which runs the head's next level), its targets and the anchors
# where they exist, then the decay-weighted loss. The check runs random float64 heads of one and two
# layers on minispec's tiny Llama target and compares with `minispec.train.eagle.unroll`; a wrong
# level names what it read.
#
# *Hint.* Draw the keys of a 3-level unroll over 4 anchors as a grid (level by row, anchor by column)
# and shade what anchor 2's level-2 row may see. Which target does level $j$ at the last anchors
# have?

# %%
check("3.6")

# %% [markdown]
# ### With and without it: acceptance by depth, from section 3's miniature run
#
# Section 3's head trained level 0 only. A second head starts from the same random weights and
# trains on the same sequences for the same steps with the training-time test over 3 levels
# (`minispec.train.eagle.ttt_loss`: each level's SmoothL1 and draft-vocabulary cross-entropy). Then
# both draft 3 levels on their own features (`unroll`, no noise), and the cell prints how often each
# level's top token (over the 8192-token draft vocabulary) is the target's greedy token at that depth,
# on the training sequences. A run this short moves the heads a little; the cell prints what it
# measured, and the shipped heads' records (section 3) hold the full training runs.

# %%
LEVELS = 3
torch.manual_seed(0)  # section 3's start
head_ttt = EagleHead(EagleConfig.for_target(smol.cfg))
opt_ttt = torch.optim.AdamW(head_ttt.parameters(), lr=1e-3, betas=(0.9, 0.95))
gen = torch.Generator().manual_seed(0)
t0 = time.perf_counter()
for step in range(n_steps):
    loss_ttt, *_ = train_eagle.ttt_loss(head_ttt, smol, batch, ce_weight=0.1, ce_frac=0.25, noise=0.1, steps=LEVELS,
                                        decay=0.8, draft_head=draft_head, generator=gen)
    opt_ttt.zero_grad(); loss_ttt.backward()
    torch.nn.utils.clip_grad_norm_(head_ttt.parameters(), 1.0); opt_ttt.step()
print(f"training-time test: {n_steps} steps of {LEVELS} levels in {time.perf_counter() - t0:.0f} s")
by_depth = {}
with torch.no_grad():
    for name, h in (("section 3's head (level 0 only)", head), (f"training-time test ({LEVELS} levels)", head_ttt)):
        *_, accs = train_eagle.ttt_loss(h, smol, batch, ce_weight=0.1, ce_frac=1.0, noise=0.0, steps=LEVELS,
                                        decay=0.8, draft_head=draft_head)
        by_depth[name] = accs
for name, accs in by_depth.items():
    print(f"{name:<36} top-1 agreement by draft depth: " + "  ".join(f"d{j + 1} {a:.3f}" for j, a in enumerate(accs)))
fig, ax = plt.subplots(figsize=(6, 3))
for i, (name, accs) in enumerate(by_depth.items()):
    ax.bar(np.arange(1, LEVELS + 1) + (i - 0.5) * 0.38, accs, 0.38, label=name)
ax.set(xlabel="draft depth (the head on its own features from depth 2)", ylabel="top-1 = target's greedy",
       xticks=range(1, LEVELS + 1), title=f"{n_steps} training steps on {len(seqs)} sequences (training data)")
ax.legend(fontsize=8); plt.tight_layout(); plt.show()

# %% [markdown]
# ## Pen-and-paper questions
#
# Short questions to answer without a computer (answers at the end of the notebook).
#
# 1. **Feature uncertainty, in numbers.** After some context the target emits "a" with
#    probability 0.6 and "b" with 0.4, and the feature after "a" lies 10 away (L2) from the
#    feature after "b". A head that sees only $f_t$ must output one vector: which one minimises
#    its expected squared error, and what is that error? What is it for a head that also reads
#    the token actually sampled? Which token does EAGLE's row $j$ pair with $f_j$, and why is it
#    available both in training and while drafting?
# 2. **The head's size, and what a drafted token costs.** SmolLM2-135M has $H = 576$,
#    $d_{ff} = 1536$, 9 query heads and 3 KV heads of dimension 64, 30 layers, a vocabulary of
#    $V = 49152$ and tied embeddings. (a) How many weights (norms and biases ignored) has one
#    decoder layer? (b) The EAGLE-1 head is `fc` $[576 \times 1152]$ plus one such layer: how
#    many weights, and how many target layers is that? (c) A token costs one multiply-add per
#    weight it goes through. Drafting one costs the head plus the LM head ($H \times V$); a
#    target forward costs 30 layers plus the LM head. What fraction of a target forward is a
#    draft step, and what share of the draft step is the LM head?
# 3. **A reduced draft vocabulary (EAGLE-3, FR-Spec).** Give the head of question 2 an LM head
#    over the 8192 most frequent tokens only. (a) What does a draft step cost now, as a fraction
#    of a target forward? (b) Say the acceptance of every draft token is $\alpha = 0.6$ with the
#    full vocabulary and $0.6 \times 0.92$ with the cut (the 8192 tokens hold 92% of what the
#    target emits, and the head was as good on the rest). For a chain of 3 with independent
#    positions, compare $E[\tau] = 1 + \alpha + \alpha^2 + \alpha^3$ and the speedup
#    $E[\tau] / (1 + 3 c_\text{draft})$ ($c_\text{draft}$: a draft step in target forwards, other
#    costs ignored) with and without the cut. (c) Why can the cut never change the output's
#    distribution?
# 4. **The loss's two terms.** (a) At one position the target's stored top-2 log-probabilities
#    are $\ln 0.5$ ("the") and $\ln 0.3$ ("a"). Against which distribution does exercise 3.4's
#    soft cross-entropy score the head? A head gives "the" probability 0.5 and "a" 0.3: its soft
#    CE? Its hard CE against the target's argmax alone? The lowest soft CE any head can reach
#    here, and with which $q$? (b) Early in training the feature term is 0.4 and the soft CE 3.5
#    nats. With $w_{cls} = 0.1$, what share of the loss is the token term?
#
# ## Summary
#
# - The next feature depends on the token sampled after the current one (feature uncertainty),
#   so EAGLE's head reads the shifted pairs $\mathrm{cat}[e(x_{j+1}), f_j]$ and predicts
#   $f_{j+1}$; the target's frozen LM head turns a predicted feature into a draft token.
# - The head is `fc` plus one decoder layer: about 1.2 target layers on SmolLM2 (question 2).
#   For a small target, the LM head costs far more than the head per drafted token; a reduced
#   draft vocabulary (EAGLE-3's `d2t` / `t2d`, FR-Spec) cuts it, and tokens outside it get
#   $q = 0$: the target still emits them through the residual or the bonus token.
# - EAGLE-1/2 train with SmoothL1 on features + 0.1 × soft cross-entropy against the target's
#   top-$K$; EAGLE-3 fuses three target layers, drops the feature loss and trains on its own
#   outputs (training-time test). Medusa's heads never see the drafted tokens.
# - From the second draft on the head reads its own features, so acceptance falls with the draft
#   position (section 4); every greedy output still equals vanilla's.
# - The head's confidence tracks acceptance (section 5), EAGLE-2's premise for dynamic trees
#   (chapter 5); sampling with the head in the loop keeps the target's law (section 6).
#
# ## References
#
# - Li, Wei, Zhang, Zhang. *EAGLE: Speculative Sampling Requires Rethinking Feature
#   Uncertainty.* ICML 2024. [arXiv:2401.15077](https://arxiv.org/abs/2401.15077)
# - Li, Wei, Zhang, Zhang. *EAGLE-2: Faster Inference of Language Models with Dynamic Draft
#   Trees.* EMNLP 2024. [arXiv:2406.16858](https://arxiv.org/abs/2406.16858)
# - Li, Wei, Zhang, Zhang. *EAGLE-3: Scaling up Inference Acceleration of Large Language Models
#   via Training-Time Test.* 2025. [arXiv:2503.01840](https://arxiv.org/abs/2503.01840)
# - Zhao et al. *FR-Spec: Accelerating Large-Vocabulary Language Models via Frequency-Ranked
#   Speculative Sampling.* 2025. [arXiv:2502.14856](https://arxiv.org/abs/2502.14856)
# - Cai et al. *Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
#   Heads.* ICML 2024. [arXiv:2401.10774](https://arxiv.org/abs/2401.10774)
#
# ## The whole chapter
#
# Exercises 3.1–3.6 sit after the sections that teach them; their functions are in
# `exercises/ch03_eagle.py` (generated from `solutions/`; same signatures and docstrings). The
# checks compare your functions with minispec's own code (`EagleDrafter`'s head input,
# `minispec.drafters.eagle3`, `minispec.train.eagle.eagle_loss`) on seeded random tensors.
#
# | exercise | function | task |
# |---|---|---|
# | 3.1 | `eagle_input` | the head's input rows $\mathrm{cat}[e(x_{j+1}), f_j]$: the shifted pairs, embedding first |
# | 3.2 | `build_vocab_map` | EAGLE-3's draft vocabulary: `d2t` offsets and the `t2d` mask |
# | 3.3 | `to_target_logits` | draft-vocabulary logits into the target vocabulary, $-\infty$ elsewhere |
# | 3.4 | `eagle_loss` | SmoothL1 on features + $w_{cls}$ × soft cross-entropy against the target's top-$K$ |
# | 3.5 | `draft_chain` | a greedy chain at the feature level: each draft token paired with the head's own feature |
# | 3.6 | `ttt_loss` | the training-time test: each level's inputs, positions, attention mask and targets, decay-weighted |
#
# Your file, graded in one table (the same as `python -m minispec grade 3` or
# `pytest tests/test_exercises.py -m ch03 --impl exercises`), and what a finished chapter looks
# like: the reference answers in `solutions/` pass every check.

# %%
check(3, impl="exercises")

# %%
check(3, impl="solutions")

# %% [markdown]
# ## Answers to the pen-and-paper questions
#
# <details><summary>1. Feature uncertainty, in numbers</summary>
#
# The expected squared error is smallest at the mean, $0.6 f(a) + 0.4 f(b)$, which lies 4 from
# $f(a)$ and 6 from $f(b)$: the error is $0.6 \times 4^2 + 0.4 \times 6^2 = 9.6 + 14.4 = 24$
# ($= p(1-p) D^2$ with $D = 10$), and the head's guess is a feature the target never produces.
# Given the sampled token the next feature is determined: error 0. Row $j$ pairs $f_j$ with
# $x_{j+1}$, the token emitted *from* $f_j$. In training it is the next token of the text;
# while drafting it is the token just committed or just drafted, so it always exists when the
# head runs.
# </details>
#
# <details><summary>2. The head's size, and what a drafted token costs</summary>
#
# (a) Attention: $q$ and $o$ are $576 \times 576 = 331{,}776$ each, $k$ and $v$
# $576 \times 192 = 110{,}592$ each (3 KV heads × 64), 884,736 in all; the MLP is
# $3 \times 576 \times 1536 = 2{,}654{,}208$: a layer has 3,538,944 weights.
# (b) `fc` has $576 \times 1152 = 663{,}552$, so the head has 4,202,496, 1.19 target layers
# (section 2's 4.20 M also counts `fc`'s bias and the layer's norm, 1,152 more).
# (c) The LM head is $576 \times 49152 = 28{,}311{,}552$; a draft step is 32,514,048 and a target
# forward $30 \times 3{,}538{,}944 + 28{,}311{,}552 = 134{,}479{,}872$: a draft step costs 24.2% of a
# target forward, and 87.1% of it is the LM head.
# </details>
#
# <details><summary>3. A reduced draft vocabulary</summary>
#
# (a) The LM head shrinks to $576 \times 8192 = 4{,}718{,}592$; a draft step is
# $4{,}202{,}496 + 4{,}718{,}592 = 8{,}921{,}088$, 6.6% of a target forward (was 24.2%).
# (b) Full vocabulary: $E[\tau] = 1 + 0.6 + 0.36 + 0.216 = 2.176$, cost
# $1 + 3 \times 0.2418 = 1.725$, speedup 1.26. Cut: $\alpha = 0.552$, $E[\tau] = 2.025$, cost
# $1 + 3 \times 0.0663 = 1.199$, speedup 1.69. Acceptance drops by 7% of $\tau$, the step's cost by
# 31%: on a small target the cut wins clearly. On a large target the draft step is a smaller
# fraction of a forward (about 10% with Llama-3.1-8B's shapes and its 128256 tokens) and the
# trade is closer.
# (c) Every token outside the cut gets logit $-\infty$, so $q = 0$ there exactly (exercise 3.3).
# Verification accepts a draft with $\min(1, p/q)$ and otherwise samples the residual
# $\mathrm{norm}(\max(0, p - q))$, which holds all of $p$'s mass on the tokens the draft cannot
# propose. The law stays $p$ whatever $q$ is; only the acceptance falls.
# </details>
#
# <details><summary>4. The loss's two terms</summary>
#
# (a) The stored top-2 renormalised: $p = (0.5, 0.3) / 0.8 = (0.625, 0.375)$. Soft CE
# $= -(0.625 \ln 0.5 + 0.375 \ln 0.3) = 0.433 + 0.451 = 0.885$ nats. Hard CE against "the" alone:
# $-\ln 0.5 = 0.693$. The soft CE is at least the entropy of $p$ (Gibbs' inequality),
# $-(0.625 \ln 0.625 + 0.375 \ln 0.375) = 0.662$ nats, reached by $q = (0.625, 0.375)$ on those two
# tokens and 0 elsewhere. (b) $0.1 \times 3.5 = 0.35$ against $0.4$: the token term is
# $0.35 / 0.75 = 47\%$ of the loss. Cross-entropy over a 49152-token vocabulary is measured in
# nats and runs about ten times the feature term, so the weight 0.1 puts the two on a similar
# scale rather than making the token term negligible.
# </details>

# %%
# The answers' numbers, computed (questions 2-3 from SmolLM2's own config).
import math

p_a, D_ab = 0.6, 10.0
print(f"question 1: expected squared error of the mean feature {p_a * (1 - p_a) * D_ab ** 2:.1f}")
c = smol.cfg
layer = 2 * c.d_model * c.n_head * c.head_dim + 2 * c.d_model * c.n_kv_head * c.head_dim + 3 * c.d_model * c.d_ff
fc, lm = c.d_model * 2 * c.d_model, c.d_model * c.vocab_size
head_w, target_w = fc + layer, c.n_layer * layer + lm
print(f"question 2: a layer {layer:,} weights; the head {head_w:,} ({head_w / layer:.2f} layers); a draft step "
      f"{(head_w + lm) / target_w:.1%} of a target forward, {lm / (head_w + lm):.1%} of it the LM head")
cut = head_w + c.d_model * 8192
for name, alpha, cost in (("full vocabulary", 0.6, (head_w + lm) / target_w), ("8192 tokens", 0.6 * 0.92, cut / target_w)):
    tau = sum(alpha ** i for i in range(4))
    print(f"question 3 ({name}): draft step {cost:.1%} of a target forward, E[tau] {tau:.3f}, speedup "
          f"{tau / (1 + 3 * cost):.2f}")
p2 = torch.tensor([0.5, 0.3]) / 0.8
print(f"question 4: soft CE {-(p2 * torch.log(torch.tensor([0.5, 0.3]))).sum():.3f} nats, hard CE {-math.log(0.5):.3f}, "
      f"the floor (entropy) {-(p2 * p2.log()).sum():.3f}; the token term's share {0.35 / 0.75:.0%}")
