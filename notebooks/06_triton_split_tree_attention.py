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
# Importing minispec first matters here: with no GPU it switches on Triton's interpreter
# (TRITON_INTERPRET=1: the kernels run on CPU tensors), which must happen before anything imports triton.
import os, platform

import minispec
import torch
from minispec.lab.notebook import setup, show

FAST = setup()  # MINISPEC_FAST=1: smaller sample counts and shorter generations (CI sets it)

# %% [markdown]
# # Chapter 6 — Split tree attention in Triton: a mask-free prefix, a masked tree, one merge
#
# In a verify step the target scores $T$ tree tokens (chapter 4) in one forward. Each tree
# token attends to the **committed prefix** of $P$ tokens in the KV cache, all of it, and to
# its **ancestors in the tree**. With a long context almost all of the work is reading the
# prefix's keys and values; the tree part is a tiny $T \times T$ block. A dense kernel with
# one $T \times (P+T)$ boolean mask pays for the mask over the whole prefix and cannot
# use the layout of the problem.
#
# **Split attention** computes the two parts separately and merges them exactly:
# the prefix with no mask (split along the keys over many GPU programs, as in
# Flash-Decoding), the suffix with the tree mask, then a log-sum-exp merge.
#
# **Learning objectives**
# 1. Derive the log-sum-exp merge of two partial softmaxes, and why it is exact and stable;
#    write it in PyTorch and as a first Triton kernel (Triton-Puzzles style).
# 2. See the mask split: prefix all-visible, tree block masked.
# 3. Write FlashAttention's online softmax over key tiles in PyTorch, then as a split-k Triton
#    kernel over ragged per-row prefix lengths (Flash-Decoding), graded under the interpreter.
# 4. Read the library's Triton kernels (split-k prefix, masked suffix, merge) and check them
#    against the PyTorch references (on CPU through the Triton interpreter).
# 5. Switch the model's attention backend and check greedy decoding is unchanged.
# 6. Read a decode-attention roofline built from measured numbers: arithmetic intensity against
#    achieved FLOP/s, under the device's memory and compute roofs.
# 7. Implement exercises 6.1–6.6, each right after the section that teaches it.
#
# **Exercises.** You write them in `exercises/ch06_split_attention.py` (generated from
# `solutions/`; same signatures and docstrings). Each check cell grades *your* file and prints
# PASS or FAIL (it never raises). From a terminal: `python -m minispec grade 6`.

# %% [markdown]
# ## 1. The log-sum-exp merge
#
# For one query, scores $s_j = q \cdot k_j / \sqrt{d}$ over keys $j \in A \cup B$ (disjoint).
# Attention over a key set $X$ is $o_X = \sum_{j \in X} e^{s_j} v_j \,/\, Z_X$ with
# $Z_X = \sum_{j \in X} e^{s_j}$; write $\ell_X = \log Z_X$ (the log-sum-exp). Then
#
# $$Z_{A\cup B} = Z_A + Z_B \quad\Rightarrow\quad \ell = \operatorname{logaddexp}(\ell_A, \ell_B),$$
# $$o_{A \cup B} = \frac{Z_A o_A + Z_B o_B}{Z_A + Z_B} = o_A\, e^{\ell_A - \ell} + o_B\, e^{\ell_B - \ell}.$$
#
# Exact, not an approximation. The weights $e^{\ell_X - \ell} \le 1$ never overflow, however
# large the scores. An empty part ($P = 0$) has $Z = 0$, $\ell = -\infty$ and weight 0.
# Merging $n$ parts is the same formula with a sum, and can run *online*: the merge kernel
# below keeps a running max, exactly like FlashAttention's softmax over key tiles.

# %%
import inspect
import math

import matplotlib.pyplot as plt
from minispec.attention import attention_with_lse, merge

g = torch.Generator().manual_seed(0)
q, k, v = torch.randn(4, 16, generator=g), torch.randn(50, 16, generator=g), torch.randn(50, 16, generator=g)
whole, lse = attention_with_lse(q, k, v)                   # softmax over all 50 keys
a, b = attention_with_lse(q, k[:30], v[:30]), attention_with_lse(q, k[30:], v[30:])
merged, merged_lse = merge(*a, *b, return_lse=True)
print(f"max |merged - whole| = {(merged - whole).abs().max():.2e}, "
      f"max |lse diff| = {(merged_lse - lse).abs().max():.2e}")

# %% [markdown]
# ### Exercise 6.1 — `merge_partials`
#
# Log-sum-exp merge of two partial results; stable; empty parts. Implement `merge_partials` in
# `exercises/ch06_split_attention.py` (generated from `solutions/`; same signatures and
# docstrings): given `(out_a, lse_a)` and `(out_b, lse_b)` over disjoint key sets, return
# `(out, lse)` over their union. The grader runs it on random float64 inputs and compares with
# attention computed directly over all keys, to 1e-9 (the merge is exact, so only rounding may
# differ); it also shifts both lse by +1000 and passes empty parts (`lse = -inf`, `out = 0`),
# one or both.
#
# *Hints.* Which quantity can you subtract from both lse before exponentiating so that neither
# weight can overflow? When both parts are empty that quantity is $-\infty$ itself: what
# would $e^{-\infty - (-\infty)}$ give, and what finite stand-in leaves the weights at 0?

# %%
from minispec.grading import check, load_impl  # check("6.1"): grade one exercise (prints, never raises)

check("6.1")

# %% [markdown]
# ## 1b. Triton puzzle: the merge as a kernel
#
# Before reading the library's kernels (section 4), write the smallest one yourself: the merge
# above for $R$ rows of head dim $D$, inputs `out_p [R, D]`, `lse_p [R]`, `out_s [R, D]`,
# `lse_s [R]`. Triton in five lines:
#
# * **Programs.** `kernel[grid](...)` runs the function once per program; `tl.program_id(0)`
#   says which. Here `grid = (cdiv(R, BLOCK_R),)`: program $i$ owns rows
#   $i \cdot$ `BLOCK_R` $\ldots$ $(i+1) \cdot$ `BLOCK_R` $- 1$.
# * **Blocks.** Values are whole tiles: `tl.arange(0, BLOCK_R)` is a vector of `BLOCK_R` row
#   indices (a `tl.constexpr`, a power of two), `r[:, None] * D + d[None, :]` a
#   `[BLOCK_R, BLOCK_D]` tile of element offsets. Arithmetic (`tl.exp`, `tl.maximum`,
#   `tl.where`) works elementwise on tiles, with broadcasting as in torch.
# * **Pointers.** Tensor arguments arrive as pointers to their first element;
#   `ptr + offsets` is a tile of addresses.
# * **Masks.** The last program's rows past $R$ and the columns past $D$ (when $D$ is not a
#   power of two) do not exist: `tl.load(ptr + offs, mask=ok, other=x)` reads `x` there and
#   `tl.store(ptr + offs, val, mask=ok)` leaves them alone.
# * **Here** the kernels run in Triton's interpreter (numpy on CPU): same code, same
#   results, no GPU — slow, so the checks use small $R$.
#
# The empty part is the trap: with `lse_p = lse_s = -inf`, $m = -\infty$ and
# $e^{-\infty - (-\infty)}$ is nan. Exercise 6.2 below asks for this kernel; the cell after
# this one prints your stub and the given launcher, and tries your kernel on section 1's example.

# %%
dev = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels' device (CPU: the interpreter)
mine = load_impl(6, "exercises")
print(inspect.getsource(mine.merge_kernel.fn))   # @triton.jit wraps the function: .fn is your source
print(inspect.getsource(mine.merge_triton))      # the given launcher
try:                                              # try yours on the example of section 1 (R=4, D=16)
    got = mine.merge_triton(*(x.to(dev) for x in (*a, *b)), block_r=2).cpu()
    print(f"your kernel: max |merge_triton - merge| = {(got - merged).abs().max():.2e}")
except Exception as e:
    print(f"your kernel does not run yet: {type(e).__name__}: {e}"[:300])

# %% [markdown]
# ### Exercise 6.2 — `merge_kernel`
#
# The merge as a Triton kernel: program ids, masked loads / stores. Write `merge_kernel` in
# `exercises/ch06_split_attention.py` (the launcher `merge_triton` is given); the check compares
# it with the PyTorch merge on several $(R, D, \texttt{BLOCK\_R})$, rows past the last block,
# $D = 24$, empty parts and $\ell \approx 1000$.
#
# *Hints.* Which rows does program `tl.program_id(0)` own, and which of them (and which
# columns) exist? Work out the row-wise weights first, as vectors of `BLOCK_R`, then broadcast
# them over the `[BLOCK_R, BLOCK_D]` tiles. For the empty parts, use the same stand-in for an
# infinite maximum as in exercise 6.1.

# %%
check("6.2")

# %% [markdown]
# ## 2. The picture: a tree after a prefix
#
# A tree of $T$ tokens after $P$ committed tokens. Row $i$ of the mask is what tree token $i$
# sees: every prefix column, and its ancestors and itself among the tree columns. The prefix
# block needs no mask at all; only the $T \times T$ block does.

# %%
from minispec.tree import Tree

tree = Tree(tokens=[0] * 7, parents=[-1, -1, 0, 0, 1, 2, 4])  # N = 7 nodes; T = N + 1 with the root
tm = tree.mask()                                             # [T, T] ancestor mask among the tree tokens
P, T = 12, tm.shape[0]
full = torch.cat([torch.ones(T, P, dtype=torch.bool), tm], 1)  # [T, P + T]: what dense attention gets

fig, ax = plt.subplots(figsize=(9, 3.2))
img = torch.zeros(T, P + T, 3)
img[:, :P] = torch.tensor([0.55, 0.75, 0.95])                  # prefix: all visible, no mask
img[:, P:][tm] = torch.tensor([0.95, 0.6, 0.3])                # tree: visible
img[:, P:][~tm] = torch.tensor([0.97, 0.97, 0.97])             # tree: masked
ax.imshow(img.numpy(), aspect="auto")
ax.axvline(P - 0.5, color="k", lw=2)
ax.set_xlabel("key index: committed prefix | tree tokens"); ax.set_ylabel("tree token (query)")
ax.set_title(f"prefix (blue): split-k, mask-free  |  suffix (orange = visible): {T}x{T} tree mask")
plt.show()
print(f"mask entries: dense {full.numel()}, split needs only the tree block's {tm.numel()}")

# %% [markdown]
# ## 3. PyTorch references: dense, prefix, suffix, merge
#
# `minispec.attention.reference` has the twin of every kernel. `dense_attention` is one SDPA
# call with the full mask; `split_attention` = `prefix_attention` (no mask) +
# `suffix_attention` (tree mask) + `merge`. Grouped-query attention: query head $h$ uses KV
# head $h // G$; the references stack the $G$ query heads of a KV head as rows, so the keys
# are never copied $G$ times.

# %%
from minispec.attention import dense_attention, split_attention
from minispec.attention import reference

B, H, Hkv, hd = 2, 8, 2, 32
for P in (0, 1, 37, 100):
    qq = torch.randn(B, H, T, hd, generator=g)
    kk, vv = torch.randn(B, Hkv, P + T, hd, generator=g), torch.randn(B, Hkv, P + T, hd, generator=g)
    fm = torch.cat([torch.ones(T, P, dtype=torch.bool), tm], 1)
    err = (split_attention(qq, kk, vv, P, tm) - dense_attention(qq, kk, vv, fm)).abs().max().item()
    print(f"P={P:>3}: max |split - dense| = {err:.2e}")
    assert err < 1e-5

# %% [markdown]
# ### Exercise 6.3 — `masked_attention_lse`
#
# Masked attention that returns the row log-sum-exps (the tree suffix). Implement
# `masked_attention_lse(q, k, v, mask)`: softmax attention of `q [..., T, hd]` over
# `k, v [..., N, hd]` where only the `True` entries of the boolean `mask` (broadcastable to
# `[..., T, N]`) may attend, returning `(out, lse)`. A row whose mask is all `False` must give
# `out = 0` and `lse = -inf`, without nan. The grader tries random, causal, per-head and tree
# ancestor masks, with a row that sees nothing, in float64 to 1e-9.
#
# *Hints.* Which score value makes a masked key contribute nothing to both the log-sum-exp and
# the output? Once you have each row's lse, how do you turn the scores into probabilities
# without a second max-and-sum — and what must you do for a row whose lse is $-\infty$?

# %%
check("6.3")

# %% [markdown]
# ## 4. The Triton kernels
#
# Three stages, which the library runs in **one launch** (`_split_kernel` in
# `minispec/attention/triton_split.py`):
#
# * **prefix** — grid (batch x KV head, row blocks, splits). A program takes the $G$ query
#   heads of one KV head for all tree tokens (rows $(g, t)$), so each key/value tile is read
#   once for $G$ heads, and walks its chunk of the prefix in `BLOCK_N` tiles with the online
#   softmax. Only the last tile's tail past $P$ is masked (`mask=` loads + `tl.where`), so any
#   $P$ works. Each split writes a partial (out, lse).
# * **suffix** — the same loop over the $T$ tree keys with the tree mask, run by the last
#   split's program, which simply carries its running softmax on.
# * **merge** — the online log-sum-exp merge of all partials, done by whichever program
#   finishes last (each takes a ticket from an atomic counter), so no second launch waits.
#
# Keys and values are read straight from the KV cache's layout `[B, Hkv, S, hd]` through
# strides; the prefix addressing is one function, ready to become a block-table lookup for the
# paged cache of chapter 7.

# %% [markdown]
# ### Exercise 6.4 — `tiled_attention`
#
# The online softmax over key tiles (the prefix), in PyTorch: `tiled_attention(q, k, v, block)`
# returns `(out, lse)` equal to unmasked softmax attention over all $N$ keys, but reads the keys
# in tiles of `block` and never builds the full $T \times N$ score matrix. $N$ may be 0
# (`out = 0`, `lse = -inf`) and need not be a multiple of `block`. The grader tries
# $N \in \{0, 1, 7, 16, 37\}$ with tiles of 1, 4, 16 and 64 keys and sharp softmaxes, in
# float64 to 1e-9.
#
# *Hints.* Keep per query row a running max $m$, a running sum $l = \sum e^{s - m}$ and an
# unnormalised output $\text{acc} = \sum e^{s - m} v$. When a tile raises the max, by what
# factor must the old $l$ and acc be rescaled so that they refer to the new max? What are $m$,
# $l$ and acc before the first tile, and how do you read the lse off them at the end (and
# when no tile came)?

# %%
check("6.4")

# %% [markdown]
# ### From PyTorch to Triton: one split of a ragged prefix
#
# Exercise 6.4's loop becomes the body of a Triton program. The library's prefix kernel (printed
# after the exercise) adds grouped-query rows, strided cache reads and `exp2`; the exercise keeps
# the core. Inputs: queries `Q [B, R, D]` (the $R$ rows that share one KV head, e.g. $G \cdot T$),
# keys and values `K, V [B, N, D]`, and the prefix lengths `Lens [B]` (int32).
#
# * **Split-k (Flash-Decoding).** With one program per batch row, a decode step at batch 1 runs
#   one program per KV head on a GPU of 100+ SMs. Cutting each row's keys into `num_splits`
#   chunks of `chunk` keys gives $B \times$ `num_splits` programs: grid `(B, num_splits)`,
#   program $(b, s)$ takes the keys $[s \cdot \text{chunk}, \min((s+1) \cdot \text{chunk}, P_b))$
#   and writes a partial `(out, lse)` to `O [B, num_splits, R, D]` and `L [B, num_splits, R]`.
#   The given launcher `prefix_split_triton` merges the splits with section 1's merge.
# * **Ragged lengths.** In a batch every row has its own committed length $P_b$, read from a
#   tensor inside the kernel (`tl.load(Lens + b)`), so one launch, and one CUDA graph (chapter 8),
#   serves all lengths. The grid covers the longest row: a shorter row's split may end inside a
#   tile, and a later split may start past $P_b$ and hold no key at all (out 0, lse $-\infty$).
#   Keys past $P_b$ are not zeros: they are other tokens' data, or garbage.
# * **Loops and tiles.** `for n0 in range(start, end, BLOCK_N)` takes bounds computed at run time;
#   `n0 + tl.arange(0, BLOCK_N)` is a tile of key indices. `tl.dot(a, b)` multiplies two tiles
#   (each dimension at least 16), `tl.trans(k)` transposes, `tl.max(x, 1)` and `tl.sum(x, 1)`
#   reduce rows, `tl.full` / `tl.zeros` make fresh tiles (the running state).
# * **Precision.** On a GPU, `tl.dot` of float32 tiles runs in TF32 (10 mantissa bits, errors
#   around $10^{-3}$) unless asked for `input_precision="ieee"`; the interpreter computes in
#   float32 either way, so only a GPU shows the difference.
#
# The cell below prints your stub and the launcher, and tries your kernel on three rows of
# lengths 0, 37 and 100 (4 splits of 25 keys, $D = 24$) against `attention_with_lse` over each
# row's own keys.

# %%
print(inspect.getsource(mine.prefix_split_kernel.fn))
print(inspect.getsource(mine.prefix_split_triton))     # the given launcher: grid (B, splits), then the merge
lens = torch.tensor([0, 37, 100])                      # ragged: an empty row, a tail inside a tile, a full row
qb = torch.randn(3, 6, 24, generator=g)                # [B, R, D]: 6 rows, D = 24 (not a power of two)
kb, vb = torch.randn(3, 100, 24, generator=g), torch.randn(3, 100, 24, generator=g)  # [B, N, D]
want = [attention_with_lse(qb[i], kb[i, :P], vb[i, :P]) for i, P in enumerate(lens.tolist())]
try:
    got_o, got_l = (x.cpu() for x in mine.prefix_split_triton(qb.to(dev), kb.to(dev), vb.to(dev), lens.to(dev),
                                                                num_splits=4))
    err = max((got_o[i] - w[0]).abs().max().item() for i, w in enumerate(want))
    print(f"your kernel: max |out - attention over the first P_b keys| = {err:.2e}; lse of the empty row: "
          f"{got_l[0].tolist()[:3]} ...")
except Exception as e:
    print(f"your kernel does not run yet: {type(e).__name__}: {e}"[:300])

# %% [markdown]
# ### Exercise 6.5 — `prefix_split_kernel`
#
# The online softmax of one split as a Triton kernel. Write `prefix_split_kernel` in
# `exercises/ch06_split_attention.py` (the launcher `prefix_split_triton` is given). The check
# launches it over `(B, num_splits)` under the interpreter (float32 CPU tensors; CUDA on a GPU)
# and compares every split's partial `(out, lse)` with float64 softmax attention over that
# split's keys, to $10^{-5}$ (plus 4 float32 ulps of the split's largest score): ragged lengths
# with $P_b = 0$, lengths and chunks that are not multiples of `BLOCK_N`, splits that start past
# $P_b$, $D = 24$, $R$ not a power of two, sharp softmaxes whose max grows from tile to tile, and
# scores around $+1000$. The keys past $P_b$ hold random values, so a key that leaks in shows.
#
# *Hints.* Start from your 6.4, one tile at a time: which state lives across tiles, and what is
# it before the first one? In a tile, which keys are yours (and which lie past the split's end
# or past $P_b$), and which score makes the others count for nothing? If a split has no key, does
# the loop run at all, and what do your final divisions give? Each program writes the $R$ rows
# of its own split: where do they start in `O` and `L`?

# %%
check("6.5")

# %% [markdown]
# ### The library's kernels
#
# The same loop in `minispec/attention/triton_split.py`: `_online_softmax_step` is one tile of
# it, scoring in log2 units (`exp2`, with $\log_2 e$ folded into the scale); `_prefix_kernel`
# takes the $G$ query heads of one KV head as its rows and reads keys through strides from the
# cache's own layout, and `_prefix_kv_rows` is the one place where prefix addressing lives
# (chapter 7 swaps it for a block-table lookup); `_merge_kernel` merges all splits and the tree
# part online, the $n$-part version of your 6.2. `_split_kernel` runs the three stages in one launch
# from the same pieces.

# %%
from minispec.attention import triton_available
from minispec.attention import triton_split as ts

print("Triton kernels can run here:", triton_available(),
      "(interpreter)" if os.environ.get("TRITON_INTERPRET") == "1" else "(GPU)")
for f in (ts._prefix_kv_rows, ts._online_softmax_step, ts._prefix_kernel, ts._merge_kernel, ts._split_kernel):
    print(inspect.getsource(f.fn))

# %%
cases = [(1, 4, 4, 1, 0, 16), (2, 8, 2, 8, 37, 32), (1, 8, 1, 16, 100, 16)]  # (B, H, Hkv, T, P, hd)
for B, H, Hkv, T_, P, hd in cases:
    qq = torch.randn(B, H, T_, hd, generator=g)
    kk, vv = torch.randn(B, Hkv, P + T_, hd, generator=g), torch.randn(B, Hkv, P + T_, hd, generator=g)
    m = torch.ones(T_, T_, dtype=torch.bool).tril()                 # a chain: causal
    ref = split_attention(qq, kk, vv, P, m)
    out = ts.split_attention_triton(qq.to(dev), kk.to(dev), vv.to(dev), P, m.to(dev)).cpu()
    err = (out - ref).abs().max().item()
    print(f"B={B} H={H} Hkv={Hkv} T={T_:>2} P={P:>3}: max |triton - torch split| = {err:.2e}")
    assert err < 1e-4

# %% [markdown]
# ### Exercise 6.6 — `split_tree_attention`
#
# 6.4 + 6.3 + 6.1 with grouped-query heads: `split_tree_attention(q, k, v, prefix_len,
# tree_mask, block=16)` with `q [B, H, T, hd]` and `k, v [B, Hkv, prefix_len + T, hd]` (the
# cache prefix, then the tree) returns `[B, H, T, hd]`, equal to softmax attention with the
# mask [all prefix | `tree_mask`]: the prefix through your tiled attention (no mask), the tree
# through your masked attention, merged. The grader tries several $(B, H, H_{kv}, T, P)$,
# $P = 0$ included, with random trees, in float64 to 1e-9.
#
# *Hints.* Query head $h$ reads KV head $h // G$ with $G = H / H_{kv}$: how do you give every
# query head its KV head (the kernels above stack rows instead; either is exact)? Which slices
# of `k` and `v` are the prefix and which the tree? With $P = 0$ the prefix part is empty:
# does your 6.4 already return what your 6.1 expects from an empty part?

# %%
check("6.6")

# %%
# The library's answer to exercise 6.6, in minispec.attention.reference: prefix + suffix + merge.
print(inspect.getsource(reference.split_attention))

# %% [markdown]
# ## 5. The model's attention backend
#
# `Transformer.attention` (or `set_attention`) picks `"dense"`, `"split_torch"` or
# `"split_triton"` for every layer. The split backends apply when every new token sees the
# whole prefix — a causal step or a tree mask given among the new tokens, which is what
# `generate` passes; a general mask over prefix + tree falls back to dense. Greedy decoding
# must not change by a single token.

# %%
from minispec import generate, load
from minispec.drafters import PromptLookup

tiny, tok = load("tiny-llama")
n_new = 12 if FAST else 32
runs = {}
for backend in ("dense", "split_torch", "split_triton"):
    tiny.set_attention(backend)
    runs[backend] = generate(tiny, tok, "abcabcabc abc", drafter=PromptLookup(k=4), max_new_tokens=n_new).tokens
tiny.set_attention("dense")
print(runs["dense"])
assert runs["split_torch"] == runs["dense"] and runs["split_triton"] == runs["dense"]
print("greedy tokens identical with all three backends")

# %% [markdown]
# ## 6. A decode-attention roofline
#
# Per query row and key, attention does about $4\,d$ flops (two dot products) on a key and a
# value that are read once for all $G \cdot T$ rows of a KV head: arithmetic intensity
# $\approx G T$ flops per byte in bf16 (4d flops per row and key over 4d bytes of key and value).
# An H100 SXM's ridge is near 300 flops per byte (spec sheet: 989 TFLOP/s bf16 dense over
# 3.35 TB/s). SmolLM2 ($G = 3$) verifying a tree of $T \le 16$ rows sits at $I \le 48$, far
# below it: verify-time attention is **bound by memory bandwidth** there. Not always: Llama-3-8B
# ($G = 4$) with a 64-node tree gives $I = 256$, at the ridge, where the tree's attention starts
# to cost its flops too. For the shapes measured here the yardstick is GB/s of KV read against
# what a plain copy achieves on the same device. `benchmarks/bench_attention.py` measures that for
# dense SDPA with a mask, the two splits, FlexAttention with a block mask and plain causal
# attention of the same shape; the plots read every committed grid, found recursively under
# `benchmarks/results/` (the CPU's, and the H100's and H200's that `gpu-suite` wrote), each titled with
# the device that measured it.

# %%
import json
from pathlib import Path

results = Path(minispec.__file__).resolve().parent.parent / "benchmarks" / "results"
benches = []  # (path, device name, doc): every committed grid, CPU and GPU, found recursively
for f in sorted(results.rglob("attention*.json")):
    doc = json.loads(f.read_text())
    if doc.get("smoke") or "results" not in doc or doc.get("benchmark") not in ("bench_attention", "attention_grid"):
        continue
    info = doc["device"] if isinstance(doc["device"], dict) else doc.get("device_info", {})
    benches.append((f.relative_to(results), info.get("gpu") or info.get("cpu_model", "CPU"), doc))
if not benches:
    print("no benchmarks/results/**/attention*.json yet: run python benchmarks/bench_attention.py")
for rel, devname, bench in benches:
    bw = bench["copy_bandwidth_GBps"]
    rows = [r for r in bench["results"] if r["batch"] == max(x["batch"] for x in bench["results"])]
    trees = sorted({r["tree"] for r in rows})[-2:]
    fig, axes = plt.subplots(1, len(trees), figsize=(6 * len(trees), 3.8), squeeze=False)
    for T_, ax in zip(trees, axes[0]):
        sel = sorted((r for r in rows if r["tree"] == T_), key=lambda r: r["ctx"])
        for name in ("dense", "split_torch", "split_triton", "flex", "causal"):
            pts = [(r["ctx"], r["kv_GBps"][name]) for r in sel if name in r["kv_GBps"]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.axhline(bw, color="k", ls="--", label=f"copy {bw:.0f} GB/s")
        ax.set_xscale("log", base=2); ax.set_xlabel("prefix length (tokens)"); ax.set_ylabel("KV read GB/s")
        ax.set_title(f"T={T_}, batch {sel[0]['batch']}"); ax.legend(fontsize=8)
    fig.suptitle(f"{rel}: {devname} ({sel[0]['dtype']}, heads {sel[0]['heads']}/{sel[0]['kv_heads']}, "
                 f"hd {sel[0]['head_dim']})")
    plt.tight_layout(); plt.show()
    for n in bench["notes"][:4]:
        print(f"{rel}: note: {n}")

# %% [markdown]
# ### The roofline, from the measured times
#
# For each measured configuration (batch $B$, $H$ query / $H_{kv}$ KV heads, head dim $d$,
# $T$ tree tokens attending to $S = P + T$ keys, $b$ bytes per element):
#
# $$\text{FLOPs} = 4\,B\,T\,S\,H\,d \quad (q k^\top \text{ and } p\,v\text{: } 2 \text{ flops per multiply-add}),$$
# $$\text{bytes} = \underbrace{2\,B\,S\,H_{kv}\,d\,b}_{K,\,V \text{ read}} + \underbrace{2\,B\,T\,H\,d\,b}_{Q \text{ read},\ O \text{ written}},
# \qquad I = \text{FLOPs} / \text{bytes} \;\approx\; \frac{2\,G\,T}{b} \text{ for } S \gg T.$$
#
# The achieved FLOP/s is FLOPs / measured median time (and bytes/s likewise); the roofs
# are the device's copy bandwidth times $I$ (memory roof) and a large matmul's FLOP/s
# (compute roof, measured here). A point's height under $\min(\text{roofs})$ is what the
# kernel leaves on the table. Bytes count only Q, K, V, O: the dense kernel's mask and the
# softmax intermediates are extra traffic the formula does not charge.
#
# Where the points land depends on the device and dtype: the ridge $I^* = $ peak FLOP/s /
# bandwidth is a few flop/byte for one CPU core but hundreds on a GPU, and $I \approx 2GT/b$
# grows with the tree. Each committed grid is drawn against its own device's roofs: the copy
# bandwidth it measured, and a compute roof measured now when that device is this machine, taken
# from the spec sheet for an H100 or H200 (labelled so), and left out otherwise, so that no point
# sits under another machine's roof. The cell prints, for each, how many points fall right of the
# ridge and the best share of the roof any kernel reached.

# %%
import time

from minispec.lab.scale import H100_SPEC


def matmul_peak_here(dtype, threads):
    """FLOP/s of a large matmul in ``dtype`` on this machine (best of a few; CPU at ``threads`` threads)."""
    mdev = "cuda" if torch.cuda.is_available() else "cpu"
    n = (2048 if FAST else 4096) if mdev == "cuda" else (1024 if FAST else 2048)
    old_threads = torch.get_num_threads()
    if mdev == "cpu" and threads:
        torch.set_num_threads(threads)
    xa, xb = torch.randn(n, n, device=mdev, dtype=dtype), torch.randn(n, n, device=mdev, dtype=dtype)
    xa @ xb  # warm-up
    best = float("inf")
    for _ in range(5):
        if mdev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter(); xa @ xb
        if mdev == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    torch.set_num_threads(old_threads)
    return 2 * n ** 3 / best


here_gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
here_cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "CPU") \
    if Path("/proc/cpuinfo").exists() else platform.processor() or "CPU"
el = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
for rel, devname, bench in benches:
    info = bench["device"] if isinstance(bench["device"], dict) else bench.get("device_info", {})
    threads, dtype_name = info.get("torch_threads"), bench["results"][0]["dtype"]
    pts = []  # (name, label, intensity, FLOP/s, bytes/s)
    for r in bench["results"]:
        B_, T_, H_, Hkv_, d_ = r["batch"], r["tree"], r["heads"], r["kv_heads"], r["head_dim"]
        S_, b_ = r["ctx"] + T_, el[r["dtype"]]
        flops = 4 * B_ * T_ * S_ * H_ * d_
        nbytes = 2 * B_ * S_ * Hkv_ * d_ * b_ + 2 * B_ * T_ * H_ * d_ * b_
        assert 2 * B_ * S_ * Hkv_ * d_ * b_ == r["kv_bytes"]  # the benchmark's own K/V byte count agrees
        for name, t in r["median_s"].items():
            pts.append((name, f"B={B_} P={r['ctx']} T={T_}", flops / nbytes, flops / t, nbytes / t))
    # the compute roof of the device that measured the points: measured here when that is this machine, the
    # spec sheet's for an H100 / H200 (bf16), none otherwise (never this machine's roof under another's points)
    same = (info.get("gpu") == here_gpu) if info.get("gpu") else (here_gpu is None and info.get("cpu_model") == here_cpu)
    if same:
        peak, roof_from = matmul_peak_here(getattr(torch, dtype_name), threads), f"measured now on {devname}"
    elif info.get("gpu") and any(g in info["gpu"] for g in ("H100", "H200")) and dtype_name == "bfloat16":
        peak, roof_from = H100_SPEC["peak"], "the H100 SXM spec sheet's bf16 peak (not measured)"
    else:
        peak, roof_from = None, f"not shown: {devname} is not this machine and has no spec-sheet figure here"
    bw_bytes = bench["copy_bandwidth_GBps"] * 1e9
    print(f"\n{rel} ({devname}): memory roof copy {bw_bytes / 1e9:.1f} GB/s (measured there); compute roof {roof_from}"
          + (f": {peak / 1e9:.0f} GFLOP/s, ridge {peak / bw_bytes:.1f} flop/byte" if peak else ""))
    roof = (lambda I: min(peak, bw_bytes * I)) if peak else (lambda I: bw_bytes * I)
    above = [p_ for p_ in pts if p_[3] > roof(p_[2])]
    print(f"{len(pts)} points; flop/byte from {min(p_[2] for p_ in pts):.2f} to {max(p_[2] for p_ in pts):.2f}; "
          f"best share of the roof {max(p_[3] / roof(p_[2]) for p_ in pts):.0%}"
          + (f"; {sum(p_[2] > peak / bw_bytes for p_ in pts)} right of the ridge (compute-bound side)" if peak else "")
          + (f"; {len(above)} above the roof (the roof is not the device's true peak)" if above else ""))
    fig, ax = plt.subplots(figsize=(8, 4.6))
    xs = torch.logspace(-1, 3, 200).tolist()
    ax.plot(xs, [roof(x) for x in xs], "k-", lw=2, label="roof" + (f": min({peak / 1e9:.0f} GFLOP/s, " if peak else ": (")
            + f"{bw_bytes / 1e9:.0f} GB/s copy x I)")
    marker = {"dense": "o", "causal": "s", "split_torch": "^", "split_triton": "v", "flex": "D"}
    for name in dict.fromkeys(p_[0] for p_ in pts):
        mine_pts = [(I, fl) for nm, _, I, fl, _ in pts if nm == name]
        ax.scatter(*zip(*mine_pts), marker=marker.get(name, "x"), s=30, label=name, zorder=3)
    ax.set_xscale("log"); ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity I (flop / byte of Q, K, V, O)"); ax.set_ylabel("achieved FLOP/s")
    ax.set_title(f"decode-attention roofline: {devname} ({rel})", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    plt.show()

# %% [markdown]
# ## Pen-and-paper questions
#
# Short questions to answer without a computer (answers at the end of the notebook).
#
# 1. **A merge.** One query, head dimension 1. Over key set $A$ the softmax normaliser is
#    $Z_A = 3$ and the partial output $o_A = 2$; over the disjoint set $B$, $Z_B = 1$ and
#    $o_B = 6$. Give $\ell_A$, $\ell_B$, the merged $\ell$ and $o$, and each part's weight. Then
#    add 1000 to every score: what changes, and why must the merge not compute $e^{\ell_A}$?
# 2. **The rescale.** One query, head dimension 1, tiles of two keys. Tile 1 has scores $(1, 2)$
#    and values $(10, 20)$; tile 2 has one key, score 4, value 30. Give the running $m$, $l$ and
#    acc after tile 1, the factor $\alpha$ when tile 2 raises the max, and the final out and lse.
#    What out would a kernel that forgets to rescale return?
# 3. **Split-k sizing.** Llama-3-8B ($H = 32$ query heads, $H_{kv} = 8$, $d = 128$) verifies a
#    tree of $T = 16$ tokens after a prefix of $P = 32768$, batch 1, on an H100 SXM (132 SMs),
#    with one program per KV head and block of $G \cdot T$ rows (`BLOCK_M` = 64). How many
#    programs run without splitting, and what fraction of the SMs do they occupy? The library
#    takes $\min(\lceil 2 \cdot 132 / \text{programs} \rceil, \lceil \text{tiles} / 4 \rceil)$
#    splits (`BLOCK_N` = 64) and rounds each chunk up to whole tiles: how many splits, how many
#    keys per split, and how many splits hold a key?
# 4. **Arithmetic intensity.** Same model, bf16 (2 bytes). Per prefix key and KV head, how many
#    bytes of K and V are read, and how many flops do the $G \cdot T$ rows that share them do
#    (count $4d$ per row and key)? What is the intensity, and is the prefix read memory- or
#    compute-bound on an H100 SXM (989 TFLOP/s bf16 dense, 3.35 TB/s)? What if K and V were
#    expanded to one copy per query head? How many tree tokens would reach the ridge?
#
# ## Summary
#
# - Softmax over the union of disjoint key sets is recovered exactly from each part's
#   $(o, \ell)$: $\ell = \operatorname{logaddexp}(\ell_A, \ell_B)$, weights $e^{\ell_X - \ell} \le 1$;
#   an empty part has $\ell = -\infty$ and weight 0, and the merge must avoid
#   $-\infty - (-\infty)$.
# - Tree attention is a mask-free prefix (where the bytes are) plus a $T \times T$ masked tree
#   block, merged: the mask never touches the prefix.
# - The online softmax keeps a running max, sum and unnormalised output, and rescales the old
#   state by $e^{m_\text{old} - m_\text{new}}$ when the max grows; the same recurrence runs in
#   PyTorch (6.4), inside one Triton program (6.5) and across parts in the merge kernel.
# - Split-k (Flash-Decoding) gives a small batch enough programs to fill the GPU: one partial
#   $(o, \ell)$ per split, merged afterwards. With ragged prefix lengths read from a tensor, a
#   split may end inside a tile or hold no key, and must then store $o = 0$, $\ell = -\infty$.
# - One program reads each K/V tile once for all $G \cdot T$ rows of a KV head: the intensity is
#   about $G T$ flop/byte in bf16, far under an H100's ridge for speculative trees, so the
#   prefix read is memory-bound.
# - Triton's interpreter runs the very same kernels on CPU tensors, which makes exact tests
#   possible without a GPU; speed, shared-memory fit and TF32 show only on a GPU.
#
# ## References
#
# - Milakov, Gimelshein. *Online normalizer calculation for softmax.* 2018 (the running max and
#   sum). [arXiv:1805.02867](https://arxiv.org/abs/1805.02867)
# - Dao, Fu, Ermon, Rudra, Ré. *FlashAttention: Fast and Memory-Efficient Exact Attention with
#   IO-Awareness.* NeurIPS 2022. [arXiv:2205.14135](https://arxiv.org/abs/2205.14135)
# - Dao. *FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning.* 2023.
#   [arXiv:2307.08691](https://arxiv.org/abs/2307.08691)
# - Dao, Haziza, Massa, Sizov. *Flash-Decoding for long-context inference.* 2023 (blog post, no
#   paper: split-k over the keys, log-sum-exp merge).
#   [crfm.stanford.edu](https://crfm.stanford.edu/2023/10/12/flashdecoding.html)
# - Miao et al. *SpecInfer: Accelerating Generative Large Language Model Serving with Tree-based
#   Speculative Inference and Verification.* ASPLOS 2024 (tree attention masks).
#   [arXiv:2305.09781](https://arxiv.org/abs/2305.09781)
# - Tillet, Kung, Cox. *Triton: An Intermediate Language and Compiler for Tiled Neural Network
#   Computations.* MAPL 2019 (no arXiv version). [doi:10.1145/3315508.3329973](https://doi.org/10.1145/3315508.3329973)
#
# ## The whole chapter
#
# The functions of `exercises/ch06_split_attention.py`, each met in the section that teaches it:
#
# | exercise | function | task |
# |---|---|---|
# | 6.1 | `merge_partials` | log-sum-exp merge of two partial results; stable; empty parts (section 1) |
# | 6.2 | `merge_kernel` | the merge as a Triton kernel: program ids, masked loads / stores (section 1b) |
# | 6.3 | `masked_attention_lse` | masked attention that returns the row log-sum-exps (the tree suffix; section 3) |
# | 6.4 | `tiled_attention` | the online softmax over key tiles, in PyTorch (the prefix; section 4) |
# | 6.5 | `prefix_split_kernel` | one split of a ragged prefix as a Triton kernel (split-k; section 4) |
# | 6.6 | `split_tree_attention` | 6.4 + 6.3 + 6.1 with grouped-query heads (section 4) |
#
# Your file, graded in one table (the same as `python -m minispec grade 6`), and what a
# finished chapter looks like: the reference answers in `solutions/` pass every check.

# %%
check(6, impl="exercises")  # your file (the default unless MINISPEC_IMPL says otherwise)

# %%
check(6, impl="solutions")

# %% [markdown]
# ## Your merge inside `generate`
#
# `use_impl` makes the split attention backend merge its prefix and tree parts with your
# `merge_partials` (exercise 6.1) while a `with` block runs: SmolLM2 with `split_torch`
# attention decodes with prompt lookup, every attention row of every layer merged by your
# code, and the greedy tokens are compared with dense vanilla decoding's. (The split is exact
# up to rounding, not bit for bit: an exact near-tie could flip a token; on this prompt none
# does.)

# %%
from minispec.grading.inside import decode_inside

smol, smol_tok = minispec.load("smollm2-135m")
copy_prompt = "Copy this list exactly, one item per line: apples, bananas, cherries, dates, figs, grapes, lemons."
dense_tokens = generate(smol, smol_tok, copy_prompt, max_new_tokens=32).tokens
smol.set_attention("split_torch")
try:
    decode_inside(lambda: generate(smol, smol_tok, copy_prompt, drafter=PromptLookup(k=4), max_new_tokens=32).tokens,
                  dense_tokens, chapters=(6,))
finally:
    smol.set_attention("dense")

# %% [markdown]
# ## Answers to the pen-and-paper questions
#
# <details><summary>1. A merge</summary>
#
# $\ell_A = \ln 3 \approx 1.0986$, $\ell_B = \ln 1 = 0$, $\ell = \ln(3 + 1) = \ln 4 \approx 1.3863$.
# The weights are $e^{\ell_A - \ell} = 3/4$ and $e^{\ell_B - \ell} = 1/4$, so
# $o = 2 \cdot \tfrac34 + 6 \cdot \tfrac14 = 3$. Adding 1000 to every score multiplies both $Z$ by
# $e^{1000}$: both $\ell$ and the merged $\ell$ grow by 1000, the weights (differences of $\ell$)
# and $o = 3$ do not change. $e^{1000}$ itself overflows float32 (largest $\approx e^{88.7}$) and
# even float64 ($\approx e^{709.8}$), so the merge works with differences $\ell_X - \ell$ (or
# $\ell_X - \max$) only.
# </details>
#
# <details><summary>2. The rescale</summary>
#
# After tile 1: $m = 2$, $l = e^{1-2} + e^{0} = 1.3679$, $\text{acc} = 10 e^{-1} + 20 = 23.679$.
# Tile 2 raises the max to 4: $\alpha = e^{2 - 4} = e^{-2} = 0.1353$, so
# $l = 1.3679 \cdot 0.1353 + e^{0} = 1.1851$ and $\text{acc} = 23.679 \cdot 0.1353 + 30 = 33.205$.
# Then $o = 33.205 / 1.1851 = 28.018$ and $\ell = 4 + \ln 1.1851 = 4.170$, the same as directly:
# $(10e + 20e^2 + 30e^4)/(e + e^2 + e^4) = 28.018$, $\ln(e + e^2 + e^4) = 4.170$. Without the
# rescale the old terms stay measured against $e^2$ while the new one is against $e^4$:
# $(23.679 + 30)/(1.3679 + 1) = 22.67$, wrong. (The cell below recomputes these numbers.)
# </details>
#
# <details><summary>3. Split-k sizing</summary>
#
# $G = 32 / 8 = 4$, so a KV head has $G T = 64$ rows: one row block. Without splitting,
# $B \cdot H_{kv} \cdot 1 = 8$ programs run: 8 of 132 SMs, 6%. Tiles: $32768 / 64 = 512$; splits
# $= \min(\lceil 264 / 8 \rceil, \lceil 512 / 4 \rceil) = \min(33, 128) = 33$, giving 264
# programs, two per SM. Chunk: $\lceil 32768 / 33 \rceil = 993$ keys, rounded up to whole tiles
# $\lceil 993 / 64 \rceil \cdot 64 = 16 \cdot 64 = 1024$. Then $32768 / 1024 = 32$ splits hold
# keys and the 33rd starts at 32768 $\ge P$: an empty split, which must store out 0 and
# lse $-\infty$ for the merge to give it weight 0 (exercise 6.5's empty case).
# </details>
#
# <details><summary>4. Arithmetic intensity</summary>
#
# Per key and KV head: K and V, $2 \cdot d \cdot 2 = 512$ bytes. Flops: $4d = 512$ per row, for
# $G T = 64$ rows: 32768. Intensity $32768 / 512 = 64$ flop/byte ($= G T$ in bf16). The H100's
# ridge is $989 / 3.35 \approx 295$ flop/byte: the prefix read is memory-bound, at about a fifth
# of the ridge. With K and V expanded per query head each head reads its own copy: 4 times the
# bytes for the same flops, intensity $T = 16$. Reaching the ridge with $G = 4$ would take
# $295 / 4 \approx 74$ tree tokens.
# </details>

# %%
# Questions 1-4, recomputed.
lse_m = math.log(3 + 1)
print(f"1: lse = ln 4 = {lse_m:.4f}, weights {math.exp(math.log(3) - lse_m):.2f} / {math.exp(0 - lse_m):.2f}, "
      f"out = {2 * math.exp(math.log(3) - lse_m) + 6 * math.exp(0 - lse_m):.4f}")
o_q, l_q = attention_with_lse(torch.tensor([[1.0]]), torch.tensor([[1.0], [2.0], [4.0]]),
                              torch.tensor([[10.0], [20.0], [30.0]]))           # d = 1: scores 1, 2, 4
m1, l1, acc1 = 2.0, math.exp(-1) + 1, 10 * math.exp(-1) + 20
alpha = math.exp(m1 - 4)
l2, acc2 = l1 * alpha + 1, acc1 * alpha + 30
print(f"2: after tile 1 l = {l1:.4f}, acc = {acc1:.3f}; alpha = {alpha:.4f}; l = {l2:.4f}, acc = {acc2:.3f}; "
      f"out = {acc2 / l2:.3f} (direct {o_q.item():.3f}), lse = {4 + math.log(l2):.3f} (direct {l_q.item():.3f}); "
      f"no rescale: {(acc1 + 30) / (l1 + 1):.2f}")
programs, tiles = 1 * 8 * 1, 32768 // 64
ns = min(-(-2 * 132 // programs), -(-tiles // 4))
chunk = -(-(-(-32768 // ns)) // 64) * 64
print(f"3: {programs} programs ({programs / 132:.0%} of the SMs); {ns} splits of {chunk} keys; "
      f"{sum(s * chunk < 32768 for s in range(ns))} hold keys")
d_, G_, T_q, b_ = 128, 4, 16, 2                      # head dim, query heads per KV head, tree tokens, bytes (bf16)
kv_bytes = 2 * d_ * b_                                  # K and V of one key
print(f"4: intensity {4 * d_ * G_ * T_q / kv_bytes:.0f} flop/byte (expanded K/V: {4 * d_ * T_q / kv_bytes:.0f}); "
      f"ridge {989e12 / 3.35e12:.0f}; tree tokens to reach it with G = 4: {989e12 / 3.35e12 / G_:.0f}")
