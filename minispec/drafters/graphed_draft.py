"""A whole EAGLE draft as one CUDA graph per bucket (chapter 8): the head's catch-up, every level, the tree.

An EAGLE head drafts in 1 + (depth - 1) small forwards a step, each a few dozen kernels: the most
launch-bound step of the decode loop. ``GraphedDraft`` records all of it once per bucket and
replays it with one launch. A draft, as ``EagleDrafter`` / ``Eagle3Drafter`` run it eagerly
(``TreeDrafter.propose``), is

    catch-up   the head's forward over the n pairs committed since the last draft (the accepted
               tokens and the new root, with the target's features), appended to its cache; the
               root's output feeds the first level
    levels     a chain (one argmax a level) or EAGLE-2's dynamic tree (expand top_k, rerank),
               each level one head forward whose nodes see the committed pairs, their ancestors
               and themselves (``minispec.drafters.device_tree``: the same trees, fixed shapes)
    tree       root + nodes, depths and the ancestor mask: the target's verify inputs

and here all three run on the device with shapes fixed by the bucket (the catch-up's n padded to
a token bucket T_b; the draft's depth): the head's cache is a ``StaticKVCache`` whose device
lengths the graph sets itself (committed pairs, then the nodes' slots level by level, back to the
committed pairs at the end: idempotent, so the warm-up runs before a capture leave it right),
and every plan is ``cuda_graphs.static_plan`` over the cache's capacity (a causal mask for the
catch-up, a slot mask for the levels). Padded catch-up rows come after the real ones: the causal
mask hides them from the real rows, and the nodes' slots overwrite them.

The host's share, before a replay: the new pairs' tokens and the committed count (one small
host-to-device copy), their features (a device-to-device copy), room in the cache; after it, the
host mirror of the cache's length. A context longer than the largest bucket (the prompt, at the
first draft) goes through the head in one eager forward first, as a prefill does.

Not graphed: sampled chains (q is sampled on the decode loop's CPU generator; those drafts run
eagerly, through the drafter's hooks over the same static cache) and static trees (the hooks too).

On a CPU, or with ``enabled=False``, ``capture`` is a direct call, so every step above runs and is
tested in CI: the graphed drafters give vanilla's greedy tokens, and their trees are the eager
drafters' trees. What only a GPU can show: that the capture succeeds (no host synchronisation
inside a draft), that a replay equals the eager draft, and the launch time it saves
(``minispec.lab.draft_timing.draft_times`` measures it side by side).

References: Li et al., "EAGLE-2" (2024); SGLang's EAGLE worker (CUDA graphs for the draft and
its "draft extend", 2024-2025); Tang et al., "Efficient Speculative Decoding for Llama at Scale"
(2025).

Shapes: T_b catch-up bucket, F feature width (EAGLE-1/2: H; EAGLE-3: 3H), H hidden, E extended
nodes, C cache capacity, V vocab.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..attention.plan import Plan
from ..cuda_graphs import TOKEN_BUCKETS, capture, pick_bucket, static_plan
from ..kv import StaticKVCache
from ..sampling import SamplingParams
from ..tree import DraftedTree, Tree
from .device_tree import Ancestry, TreeTensors, chain, dynamic, verify_inputs
from .tree_drafter import TreeSpec

Step = Callable[[torch.Tensor, torch.Tensor, Plan], torch.Tensor]


def step_plan(kv: StaticKVCache, positions: torch.Tensor, mask: torch.Tensor | None = None) -> Plan:
    """The plan of one eager head forward of T new pairs on a static cache: reserves them (``kv.begin``;
    they stay pending until ``kv.commit``) and shows them what ``mask`` shows.

    Args:
        positions: [T] position ids.
        mask: bool [T, S] over the cached and the new slots (S = kv.length + T), None: causal after the cache.
    """
    T, L = positions.shape[0], kv.length
    dev = positions.device
    kv.begin(1, T)
    if mask is None:
        mask = torch.ones(T, L + T, dtype=torch.bool, device=dev).tril(L)  # [T, S] causal after the cache
    slots = torch.zeros(1, T, kv.capacity, dtype=torch.bool, device=dev)  # [1, T, C]
    slots[0, :, :mask.shape[1]] = mask
    return static_plan(kv, positions[None], slot_mask=slots)


class GraphedDraft:
    """Replays one captured draft per (catch-up bucket, depth) over a head's static cache.

    Args:
        kv: the head's ``StaticKVCache`` (one row; one layer per decoder layer).
        step: the head's forward on a plan: (tokens [1, T], features [1, T, F or H], plan) -> hidden [1, T, H];
            the features of a node are its parent's hidden state.
        logits: hidden [n, H] -> logits [n, V] over the target's vocabulary.
        spec: the drafter's ``TreeSpec``: a chain or a dynamic tree.
        features: (F, dtype) of the catch-up features.
        enabled: False never captures (the direct call ``capture`` falls back to without CUDA).
        warmup: eager runs before each capture.
    ``captures`` counts the drafts recorded (or buckets set up), ``replays`` the drafts per bucket.
    """

    def __init__(self, kv: StaticKVCache, step: Step, logits: Callable[[torch.Tensor], torch.Tensor], spec: TreeSpec,
                 features: tuple[int, torch.dtype], enabled: bool = True, warmup: int = 2):
        if spec.kind not in ("chain", "dynamic"):
            raise ValueError(f"a graphed draft is a chain or a dynamic tree, not {spec.kind!r}")
        self.kv, self.step, self.logits, self.spec, self.features = kv, step, logits, spec, features
        top = pick_bucket(spec.depth + 1, TOKEN_BUCKETS + (spec.depth + 1,))  # a step commits depth + 1 pairs at most
        self.buckets = tuple(b for b in TOKEN_BUCKETS if b < top) + (top,)
        self.use_graphs = bool(enabled) and kv.lengths.is_cuda and torch.cuda.is_available()
        self.warmup = warmup
        self.graphs: dict[tuple[int, int], tuple] = {}  # (T_b, depth) -> (replay, static inputs)
        self.pool = None
        self.captures, self.replays = 0, {}
        self._generation = kv.generation

    def extended(self, depth: int) -> int:
        """Nodes a draft of ``depth`` levels runs through the head (all but the last level's)."""
        return (depth - 1) * (1 if self.spec.kind == "chain" else self.spec.top_k)

    @torch.inference_mode()
    def __call__(self, tokens: list[int], features: torch.Tensor, depth: int) -> TreeTensors:
        """Draft after the head's committed pairs and the n new ones.

        Args:
            tokens: [n] the new pairs' tokens x_{j+1} (the last is the root: the last committed token).
            features: [n, F] their features f_j (the target's), on the cache's device.
            depth: levels to draft (1 <= depth <= spec.depth).
        Returns:
            The tree's ``TreeTensors`` (static outputs: the next draft overwrites them). The n pairs are
            committed in the cache; the nodes are not.
        """
        kv, n = self.kv, len(tokens)
        if kv.pending != (0, 0):
            raise RuntimeError("the head cache has pending entries: commit() or discard() them before a draft")
        if not 1 <= depth <= self.spec.depth or n < 1 or features.shape[0] != n:
            raise ValueError(f"a draft of depth 1..{self.spec.depth} after 1 or more new pairs with one feature row "
                             f"each, got depth {depth}, {n} tokens, {features.shape[0]} feature rows")
        if n > self.buckets[-1]:  # a prompt: all but the last pair in one eager forward, as a prefill
            self._eager(tokens[:-1], features[:-1])
            tokens, features, n = tokens[-1:], features[-1:], 1
        T_b, L = pick_bucket(n, self.buckets), kv.length
        kv.reserve(L + max(T_b, n + self.extended(depth)))  # new buffers: the graphs captured before are stale
        if kv.generation != self._generation:
            self.graphs, self.pool, self._generation = {}, None, kv.generation
        replay, static = self.graphs.get((T_b, depth)) or (None, self._buffers(T_b))
        ints = torch.tensor([L, n] + list(tokens) + [0] * (T_b - n))  # [2 + T_b] committed, n, tokens padded
        static["ints"].copy_(ints.pin_memory() if kv.lengths.is_cuda else ints, non_blocking=kv.lengths.is_cuda)
        static["features"][:n] = features
        if replay is None:  # captured on first use, after the inputs are in: the warm-up runs draft this very step
            replay = self._capture(T_b, depth, static)
        out = replay()
        kv.host_lengths[0] = L + n  # the graph left the device lengths there
        self.replays[(T_b, depth)] = self.replays.get((T_b, depth), 0) + 1
        return out

    def _eager(self, tokens: list[int], features: torch.Tensor) -> None:
        """The head over n new pairs in one eager forward on the static cache, committed."""
        kv, dev = self.kv, self.kv.lengths.device
        L = kv.length
        kv.reserve(L + len(tokens))
        self.step(torch.tensor([tokens], device=dev), features[None],
                  step_plan(kv, torch.arange(L, L + len(tokens), device=dev)))
        kv.commit()

    def _buffers(self, T_b: int) -> dict[str, torch.Tensor]:
        """The static inputs of a bucket: [committed, n, T_b tokens] and the features [T_b, F]."""
        dev = self.kv.lengths.device
        F, dtype = self.features
        return dict(ints=torch.zeros(2 + T_b, dtype=torch.long, device=dev),
                    features=torch.zeros(T_b, F, dtype=dtype, device=dev))

    def _capture(self, T_b: int, depth: int, static: dict[str, torch.Tensor]):
        """Record the draft of a bucket on its static inputs, which hold the first draft's already: ``capture``'s
        warm-up runs write what that draft writes (the committed count, the new pairs' slots, the nodes' slots),
        nothing else. Returns the replay."""
        dev = self.kv.lengths.device

        def draft() -> TreeTensors:
            return self._draft(static["ints"], static["features"], T_b, depth)
        with torch.inference_mode():
            replay, self.pool = capture(draft, dev if self.use_graphs else torch.device("cpu"), self.pool, self.warmup)
        self.graphs[(T_b, depth)] = (replay, static)
        self.captures += 1
        return replay

    def _draft(self, ints: torch.Tensor, features: torch.Tensor, T_b: int, depth: int) -> TreeTensors:
        """The body a graph captures: no host synchronisation, every shape from (T_b, depth)."""
        kv, dev = self.kv, ints.device
        L0, n, toks = ints[0:1], ints[1:2], ints[2:]  # [1] committed pairs, [1] new pairs, [T_b] their tokens
        kv.lengths[:1].copy_(L0)
        causal = torch.ones(T_b, T_b, dtype=torch.bool, device=dev).tril()[None]  # [1, T_b, T_b]
        plan = static_plan(kv, (L0 + torch.arange(T_b, device=dev))[None], causal)  # pairs at positions L0 + j
        h = self.step(toks[None], features[None], plan)[0]  # [T_b, H]
        root_h, root = h.index_select(0, n - 1), toks.index_select(0, n - 1)  # [1, H] the root's output, [1] its token
        committed = L0 + n  # [1]
        E = max(1, self.extended(depth))
        anc, node_h = Ancestry(E, dev), h.new_zeros(E, h.shape[-1])  # [E, H] the extended nodes' outputs
        slots, node_slots = torch.arange(kv.capacity, device=dev), committed + torch.arange(E, device=dev)  # [C], [E]

        def extend(tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
            m, e0 = tokens.shape[0], anc.count
            depths, rows = anc.add(parents)  # [m], [m, E]
            mask = (slots < committed).expand(m, -1).clone()  # [m, C] the committed pairs
            mask.scatter_(1, node_slots.expand(m, -1), rows)  # [m, C] + their ancestors and themselves
            kv.lengths[:1].copy_(committed + e0)  # the nodes' slots follow the nodes extended before
            feat = torch.where((parents >= 0)[:, None], node_h[parents.clamp(min=0)], root_h)  # [m, H] parents' outputs
            plan = static_plan(kv, (committed - 1 + depths)[None], slot_mask=mask[None])  # root at committed - 1
            g = self.step(tokens[None], feat[None], plan)[0]  # [m, H]
            node_h[e0:e0 + m] = g
            return self.logits(g)  # [m, V]

        root_logits = self.logits(root_h)[0]  # [V]
        if self.spec.kind == "chain":
            tokens, parents = chain(root_logits, extend, depth)
        else:
            tokens, parents = dynamic(root_logits, extend, depth, self.spec.top_k, self.spec.total_tokens)
        kv.lengths[:1].copy_(committed)  # the nodes are never committed
        return verify_inputs(root, tokens, parents, depth)


class GraphedHead:
    """What an EAGLE drafter (a ``TreeDrafter`` with a head and its own KV cache) adds for graphs: ``use_graphs``
    swaps its cache for a ``StaticKVCache`` and sets up a ``GraphedDraft``; ``propose`` then drafts through
    it, greedy chains and dynamic trees (sampled or not: their drafts are deterministic), as a
    ``DraftedTree``; the rest (sampled chains) drafts eagerly through the hooks, over the same static cache.

    The drafter supplies ``_head_cache(static)`` (a new empty cache of its capacity), ``_new_pairs()`` (the
    pairs committed since its last draft: tokens [n] and features [n, F], the cache rolled back to the pairs it
    keeps), ``_step`` and ``_graph_logits`` (``GraphedDraft``'s step and logits) and ``_features`` ((F, dtype)).
    """

    graph: GraphedDraft | None = None

    def use_graphs(self, enabled: bool = True) -> bool:
        """Draft chains and dynamic trees through one CUDA graph per bucket (``GraphedDraft``); static trees
        draft eagerly. Returns whether this drafter graphs its drafts."""
        enabled = bool(enabled) and self.spec.kind in ("chain", "dynamic")
        if enabled != (self.graph is not None):
            self.kv = self._head_cache(static=enabled)
            self.graph = GraphedDraft(self.kv, self._step, self._graph_logits, self.spec, self._features()) \
                if enabled else None
            self.prefill([])  # the new cache starts empty
        return enabled

    def propose(self, params: SamplingParams, budget: int, generator: torch.Generator | None = None) -> Tree:
        depth = min(self.spec.depth, budget)
        if self.graph is None or depth <= 0 or not (params.greedy or self.spec.kind == "dynamic"):
            return super().propose(params, budget, generator)  # eager: the hooks (a sampled chain draws q on the host)
        tokens, features = self._new_pairs()
        tree = DraftedTree(self.graph(tokens, features, depth), depth)
        self.forwards += depth  # the head's forwards, counted as the eager draft counts them
        return tree
