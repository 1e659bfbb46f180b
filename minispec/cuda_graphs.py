"""CUDA graphs for the draft and verify forwards, one graph per (batch, tokens) bucket (chapter 8).

At small batch a decode step is hundreds of short kernels, and on a fast GPU the CPU that
launches them one by one (Python, the dispatcher, the driver) takes longer than the GPU takes to
run them. A CUDA graph records the kernels of one forward once and replays them with a single
launch. Capture freezes every shape and every address, so

  - inputs are copied into preallocated *static* buffers and outputs read from static buffers;
  - shapes come from a small set of buckets: B sequences padded to the next batch bucket B_b,
    T new tokens (a vanilla step: 1, a chain: k + 1, a tree: N + 1) padded to the next token
    bucket T_b; one graph per (B_b, T_b) pair that is used, captured on first use;
  - nothing inside a step may synchronise with the host (``.item()``, ``int(tensor)``, a
    device-to-host copy, a shape that depends on a tensor's value).

What cannot be captured, and what this module does instead:
  preparing an eager forward's attention plan (``minispec.attention.plan.prepare``) reads
  ``int(positions.max())`` (a host sync), and the contiguous ``KVCache`` keeps its length as a
  Python int: ``write`` slices ``k[..., :length + T]``, so the key count S, and with it every
  attention shape, changes each step. The forward itself has neither: ``Transformer.forward``
  runs whatever plan it is given. So ``static_forward`` is the model's own forward on another
  plan, ``static_plan``, built on the device over a ``StaticKVCache`` whose committed lengths
  live in a device tensor [B]:
      write slots   length[b] + arange(T_b), computed on the device;
      keys          the cache's whole capacity C, every step;
      mask          [B_b, 1, T_b, C]: committed keys (< length[b]) plus the new tokens' own slots
                    as the tree mask allows, built on the device.
  The host's share (``StaticKVCache.begin``: room, pending entries) runs before the replay.
  Attending over the whole capacity with a mask is what gpt-fast does; it costs attention over
  C keys instead of length + T (size the cache to the request, not the model's context).
  Each bucket picks its attention backend once, when it is set up: ``attention.table.choose_backend(
  B_b, C, T_b, table)``, the table measured on this GPU if one was saved here (``table_for``), else
  the default (a CPU: dense). "dense" is the model's own masked backend (the exact one on a CPU),
  "flash" SDPA's fused path, and "split" the one-launch Triton split kernel
  (``SplitAttention``): it reads each row's prefix length from ``kv.lengths`` on the device, attends
  the prefix without a mask and the bucket's tree under its tree mask (no [B, 1, T, C] mask is
  built), into a ``SplitWorkspace`` and an output buffer the bucket holds: no host read, no
  allocation per call after the first, so a graph captures it and replays it for new lengths.
  Padding is harmless by construction: padded tokens write only into slots past a row's committed
  length (never committed, overwritten later), real tokens never see them, and padded rows see
  only their own token (no all-masked softmax row).

On a CPU, or with ``enabled=False``, ``GraphedForward`` runs the very same steps (buckets, padding,
inputs copied into the bucket's static buffers, ``begin``, the plan, the model's forward, one
"replay" per call) with the capture replaced by a direct call of ``static_forward`` on those
buffers: ``capture`` is the one function that needs CUDA. With the exact backend's row-invariant
attention and linear plans (``minispec.exact``) the CPU path gives the eager forward's logits bit for
bit, padded or not, over the whole capacity or not: that is what CI proves. What only a GPU can
show: that capture succeeds (no host synchronisation, no allocation outside the graph's pool),
that a replay launches the same kernels as the eager padded forward (bitwise equal there too),
and how much launch time it saves (``gpu-suite``; ``tests/test_cuda_graphs.py``'s CUDA tests). A split
bucket runs on the CPU too, its kernel in the Triton interpreter (greedy tokens equal to dense's, its
workspace reused, no host read: ``tests/test_cuda_graphs.py``); that it captures, and whether it beats
the masked path at long contexts, only a GPU shows (``tools/gpu_check.sh``'s ``split`` section).
The model's call on such a plan also traces under ``torch.compile`` as one graph, without a graph break
or a recompile from step to step (``tests/test_compile.py``): on a CPU, compiling it is capture's
counterpart (``benchmarks/compiled_forward.py`` times it against eager).

The decode loop runs on it with ``generate(..., cuda_graphs=True)`` / ``Decoder(graphs=True)``:
the target's verify forwards (vanilla, chain, tree) go through one ``GraphedForward`` over a
``StaticKVCache``, and a draft model's (``DraftModel(graphs=True)``) draft steps through another; an
EAGLE head's whole draft (catch-up, levels, the tree built on the device) is one graph per bucket
(``minispec.drafters.graphed_draft``).

References: NVIDIA, "CUDA Graphs" (CUDA C++ Programming Guide); PyTorch ``torch.cuda.graph``
("Accelerating PyTorch with CUDA Graphs", 2021); gpt-fast (PyTorch team, 2023: a static KV cache
attended over its whole length with a mask); vLLM and SGLang (graphs per batch-size bucket);
Li et al., "EAGLE-2" (2024) and Tang et al., "Efficient Speculative Decoding for Llama at Scale"
(2025) on graphing draft and verify steps.

Shapes: L layers, B batch (B_b its bucket), T new tokens (T_b its bucket), C cache capacity,
Hkv KV heads, hd head dim, D model width, V vocab.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .attention import BACKENDS, check_backend
from .attention.plan import Plan
from .attention.table import BackendTable, choose_backend, table_for
from .kv.static import StaticKVCache
from .model import ModelOutput

CAPTURE_MODE = "thread_local"  # torch.cuda.graph's capture_error_mode (``capture``)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class SplitAttention:
    """The "split" backend of one graph bucket: ``triton_split.split_attention_triton`` over a ``StaticKVCache``,
    each row's prefix length read from ``kv.lengths`` on the device, the new tokens under the plan's tree mask.

    The bucket's ``SplitWorkspace`` (partials, ticket counters) and its output buffer are allocated on the
    first call (a graph's warm-up) and reused by every later call and replay; nothing reads a value on the
    host (``validate=False``: the host checked the room, ``StaticKVCache.check_room``). One instance per
    bucket: its calls run one after another on one stream (the layers of a forward), each layer's output
    read by its output projection before the next layer writes the buffer again. (On a CPU the static
    cache stores its keys keys-last for the exact backend, and the kernel, in the interpreter there,
    reads a contiguous copy of them each call; a GPU's cache is head-dim-last and read in place.)
    """

    def __init__(self, kv: StaticKVCache):
        from .attention.triton_split import SplitWorkspace  # imports triton on first use

        self.kv, self.workspace = kv, SplitWorkspace()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan) -> torch.Tensor:
        """q [b, H, T, hd]; k, v the cache's slots [b, Hkv, C, hd] (the new ones written at lengths + j) -> [b, H, T, hd]."""
        from .attention.triton_split import split_attention_triton

        return split_attention_triton(q, k, v, self.kv.lengths[:q.shape[0]], plan.tree, out=self.workspace.output(q),
                                      workspace=self.workspace, validate=False)


def static_plan(kv: StaticKVCache, positions: torch.Tensor, tree_mask: torch.Tensor | None = None,
                slot_mask: torch.Tensor | None = None, attention=None) -> Plan:
    """The attention plan of a forward on ``kv``, built on the device: capturable, unlike ``prepare``
    (no host synchronisation, no value-dependent shape; the pending slots are reserved by the caller,
    ``kv.begin``, outside any graph).

    Args:
        positions: [B, T] position ids of the new tokens (< the model's context: not checked here).
        tree_mask: bool [B, T, T], True where new token i may see new token j; every committed slot is
            visible. Or instead ``slot_mask``: bool [B, T, C] over the cache's slots (the new tokens sit
            at slots length[b] + j), for drafts that see only part of what is cached (a draft tree's
            earlier levels).
        attention: the plan's backend (None: the model's, when its forward starts); a ``SplitAttention``
            takes the tree mask as it is and no mask over the slots.
    Returns:
        ``Plan(positions, mask [B, 1, T, C])``: masked attention over the cache's whole capacity, or for a
        ``SplitAttention`` ``Plan(positions, tree=tree_mask [B, T, T])``; either way the new tokens' slots
        length[b] + arange(T) are set in ``kv.write_pos`` [B, T].
    """
    B, T = positions.shape
    dev = positions.device
    lengths = kv.lengths[:B]  # [B]
    kv.write_pos = lengths[:, None] + torch.arange(T, device=dev)  # [B, T] slots of the new tokens
    if isinstance(attention, SplitAttention):
        if tree_mask is None:
            raise ValueError("the split attention sees each row's whole committed prefix: give a tree_mask, not a "
                             "slot_mask")
        return Plan(positions, tree=tree_mask, attention=attention)  # tree [B, T, T]
    if slot_mask is None:
        keys = torch.arange(kv.capacity, device=dev)  # [C]
        mask = (keys[None, None, :] < lengths[:, None, None]).expand(B, T, kv.capacity).clone()  # [B, T, C] prefix
        mask.scatter_(2, kv.write_pos[:, None, :].expand(B, T, T), tree_mask)  # [b, i, slot_j] = tree_mask[b, i, j]
    else:
        mask = slot_mask  # [B, T, C]
    return Plan(positions, mask=mask[:, None], attention=attention)  # [B, 1, T, C]


def static_forward(model, kv: StaticKVCache, tokens: torch.Tensor, positions: torch.Tensor,
                   tree_mask: torch.Tensor | None = None, slot_mask: torch.Tensor | None = None,
                   hidden_layers: tuple[int, ...] = (), last_logits_only: bool = False, attention=None) -> ModelOutput:
    """One forward of ``model`` over new tokens, written to ``kv``: the body a CUDA graph captures.

    The model's own ``forward`` on the plan ``static_plan`` builds: no host synchronisation and no
    value-dependent shape, every shape follows from the inputs'.

    Args:
        model: a minispec Transformer.
        tokens: [B, T] ids; positions, tree_mask, slot_mask: as ``static_plan`` takes them.
        hidden_layers: layer indices whose input hidden states to return (EAGLE-3).
        last_logits_only: the LM head for the last token only (a prefill).
        attention: the plan's backend, as ``static_plan`` takes it (None: the model's).
    Returns:
        ModelOutput(logits [B, T or 1, V], hidden [B, T, D], layer_inputs {i: [B, T, D]}).
    """
    plan = static_plan(kv, positions, tree_mask, slot_mask, attention)
    return model(tokens, kv=kv, plan=plan, hidden_layers=hidden_layers, last_logits_only=last_logits_only)


def static_prefill(model, kv: StaticKVCache, tokens: torch.Tensor, hidden_layers: tuple[int, ...] = (),
                   last_logits_only: bool = False) -> ModelOutput:
    """Causal forward of [B, P] new tokens after what ``kv`` holds, eagerly (one long forward, no
    bucket, never captured); the entries stay pending until ``kv.commit()``."""
    B, P = tokens.shape
    dev = tokens.device
    pos = kv.lengths[:B, None] + torch.arange(P, device=dev)  # [B, P]
    causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril().expand(B, P, P)
    kv.begin(B, P)
    return static_forward(model, kv, tokens, pos, causal, hidden_layers=hidden_layers,
                          last_logits_only=last_logits_only)


def token_buckets(max_tokens: int, buckets: Sequence[int] = TOKEN_BUCKETS) -> tuple[int, ...]:
    """``buckets``, with ``max_tokens`` added when it exceeds them all (a tree of 60 nodes: 61 rows)."""
    return tuple(sorted(set(buckets) | ({max_tokens} if max_tokens > max(buckets) else set())))


def pick_bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= n; ValueError when n exceeds them all."""
    for b in sorted(buckets):
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {max(buckets)}")


def pad_inputs(tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor, B_b: int, T_b: int):
    """Pad a step's inputs to a bucket.

    Args:
        tokens, positions: [B, T]; tree_mask: bool [B, T, T].
    Returns:
        (tokens [B_b, T_b], positions [B_b, T_b], tree_mask [B_b, T_b, T_b]): padded tokens are id 0
        at position 0; padded mask rows see only themselves, and no real row sees a padded column.
    """
    B, T = tokens.shape
    if B > B_b or T > T_b:
        raise ValueError(f"inputs [{B}, {T}] do not fit the bucket [{B_b}, {T_b}]")
    tok = tokens.new_zeros(B_b, T_b)
    pos = positions.new_zeros(B_b, T_b)
    tok[:B, :T], pos[:B, :T] = tokens, positions
    m = torch.eye(T_b, dtype=torch.bool, device=tree_mask.device).repeat(B_b, 1, 1)  # [B_b, T_b, T_b]
    m[:B, :T, :T] = tree_mask
    return tok, pos, m


def pad_slot_mask(slot_mask: torch.Tensor, lengths: torch.Tensor, B_b: int, T_b: int) -> torch.Tensor:
    """A slot mask [B, T, C] padded to [B_b, T_b, C]: a padded token (slot length[b] + j) sees only
    itself; a real token keeps its row (which never shows a padded token's slot)."""
    B, T, C = slot_mask.shape
    j = torch.arange(T_b, device=slot_mask.device)
    own = (lengths[:B_b, None] + j)[:, :, None] == torch.arange(C, device=slot_mask.device)  # [B_b, T_b, C]
    out = own.clone()
    out[:B, :T] = slot_mask
    return out


def capture(fn: Callable[[], ModelOutput], device: torch.device, pool=None, warmup: int = 2):
    """Record ``fn``'s kernels in a CUDA graph: returns (replay, pool), where ``replay()`` launches them
    again in one call and returns ``fn``'s output tensors (static: the next replay overwrites them).

    The one CUDA-only piece of this module. Elsewhere it returns ``fn`` itself, a direct call: the
    computation a replay launches, so every other step of ``GraphedForward`` (buckets, padding,
    static buffers, replay counts) runs and is tested on the CPU. What only a GPU can show: that
    capture succeeds (no host synchronisation, no allocation outside the pool), that a replay
    equals the eager padded forward bit for bit, and the launch time it saves.

    Capture is thread-local (``CAPTURE_MODE``): only this thread's CUDA calls are checked against the
    capture, so another thread's work (a data loader, a second model, a profiler) neither breaks it
    nor is refused while it runs; in the default global mode any thread's synchronising call fails
    the capture (tests/test_cuda_graphs.py's GPU test runs one beside it).
    """
    if torch.device(device).type != "cuda":
        return fn, None
    side = torch.cuda.Stream()  # warm-up off the capturing stream: lazy initialisation, autotuning
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):  # writes pending slots only, never committed
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode=CAPTURE_MODE):
        out = fn()

    def replay() -> ModelOutput:
        graph.replay()
        return out
    return replay, graph.pool()


class GraphedForward:
    """Replays one captured CUDA graph per (batch, tokens) bucket of a model forward over a StaticKVCache.

    Args:
        model: a minispec Transformer (on CUDA for graphs).
        kv: its StaticKVCache; batch buckets above ``kv.batch_size`` are dropped and
            ``kv.batch_size`` is added, so padded rows always exist in the cache.
        batch_buckets, token_buckets: the bucket sizes.
        enabled: False never captures (the direct call ``capture`` falls back to without CUDA).
        pad: pad calls to their bucket (default: only when graphs are used).
        warmup: eager runs on a side stream before each capture (lazy initialisation, autotuning).
        hidden_layers: layers whose input hidden states to return too (EAGLE-3 reads them).
        slot_masks: calls give a ``slot_mask`` over the cache's slots instead of a ``tree_mask`` (attended
            by the model's masked backend: the split needs every committed slot visible).
        table: the attention backend table each bucket looks its backend up in (``choose_backend(B_b,
            kv.capacity, T_b, table)``: "dense", "flash" or "split"); None: ``attention.table.table_for``
            (the table measured on this GPU if saved here, else the default: dense on a CPU).
    Calls return views of static buffers, valid until the next call: clone what must outlive it.
    ``captures`` counts the graphs recorded (or buckets set up), ``replays`` the calls per bucket,
    ``backends`` the backend each bucket attends with, ``workspaces`` each split bucket's ``SplitWorkspace``.
    """

    def __init__(self, model, kv: StaticKVCache, batch_buckets: Sequence[int] = BATCH_BUCKETS,
                 token_buckets: Sequence[int] = TOKEN_BUCKETS, enabled: bool = True, pad: bool | None = None,
                 warmup: int = 2, hidden_layers: tuple[int, ...] = (), slot_masks: bool = False,
                 table: BackendTable | None = None):
        self.model, self.kv = model, kv
        self.batch_buckets = tuple(sorted({b for b in batch_buckets if b <= kv.batch_size} | {kv.batch_size}))
        self.token_buckets = tuple(sorted(token_buckets))
        self.use_graphs = bool(enabled) and model.device.type == "cuda" and torch.cuda.is_available()
        self.pad = self.use_graphs if pad is None else pad
        self.warmup, self.hidden_layers, self.slot_masks = warmup, tuple(hidden_layers), slot_masks
        self.graphs: dict[tuple[int, int], tuple] = {}  # (B_b, T_b) -> (replay, static inputs)
        self.pool = None  # one memory pool for all graphs: they never run concurrently and keep their outputs
        self.captures, self.replays = 0, {}
        self.table = table if table is not None else table_for(model.device)
        self.backends: dict[tuple[int, int], str] = {}  # (B_b, T_b) -> "dense" | "flash" | "split"
        self.workspaces: dict[tuple[int, int], object] = {}  # (B_b, T_b) -> its SplitWorkspace (split buckets)
        self._generation = kv.generation

    def bucket(self, B: int, T: int) -> tuple[int, int]:
        return pick_bucket(B, self.batch_buckets), pick_bucket(T, self.token_buckets)

    def backend_for(self, B_b: int, T_b: int) -> str:
        """The attention backend of bucket (B_b, T_b): looked up in ``table`` (host ints only); "dense" for slot masks."""
        if self.slot_masks:
            return "dense"
        return choose_backend(B_b, self.kv.capacity, T_b, self.table)

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                 tree_mask: torch.Tensor | None = None, slot_mask: torch.Tensor | None = None) -> ModelOutput:
        """Forward of new tokens [B, T] (positions [B, T], default length + arange(T); tree_mask bool
        [T, T] or [B, T, T], default causal; or, with ``slot_masks``, slot_mask bool [B, T, C]); the
        entries stay pending in the cache until ``kv.commit``."""
        B, T = tokens.shape
        if (slot_mask is not None) != self.slot_masks:
            raise ValueError("this GraphedForward takes " + ("a slot_mask [B, T, C]" if self.slot_masks else
                                                               "a tree_mask, not a slot_mask"))
        B_b, T_b = self.bucket(B, T) if self.pad else (B, T)
        self.kv.check_room(B_b, T_b)  # the padded rows and tokens write too
        self.kv.begin(B, T)  # host bookkeeping (raises while entries are pending); the plan sets the slots
        try:
            out = self._replay(B_b, T_b, self._padded(tokens, positions, tree_mask, slot_mask, B_b, T_b))
        except BaseException:
            self.kv.discard()
            raise
        return ModelOutput(logits=out.logits[:B, :T], hidden=out.hidden[:B, :T],
                           layer_inputs={i: h[:B, :T] for i, h in out.layer_inputs.items()})

    def _padded(self, tokens, positions, tree_mask, slot_mask, B_b: int, T_b: int) -> dict[str, torch.Tensor]:
        """A call's inputs padded to the bucket [B_b, T_b], under the names of the static buffers."""
        B, T = tokens.shape
        dev = self.model.device
        if positions is None:
            positions = self.kv.lengths[:B, None] + torch.arange(T, device=dev)  # [B, T]
        if self.slot_masks:
            ones = torch.ones(B, T, T, dtype=torch.bool, device=dev)
            tokens, positions, _ = pad_inputs(tokens, positions, ones, B_b, T_b)
            return dict(tokens=tokens, positions=positions,
                        slot_mask=pad_slot_mask(slot_mask, self.kv.lengths, B_b, T_b))
        if tree_mask is None:
            tree_mask = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        tokens, positions, m = pad_inputs(tokens, positions, tree_mask.expand(B, T, T), B_b, T_b)
        return dict(tokens=tokens, positions=positions, tree_mask=m)

    def _replay(self, B_b: int, T_b: int, inputs: dict[str, torch.Tensor]) -> ModelOutput:
        """The bucket's graph (captured on first use) replayed on ``inputs`` copied into its static buffers."""
        if self.kv.generation != self._generation:  # the cache grew: its buffers moved
            self.graphs, self.pool, self._generation = {}, None, self.kv.generation
            self.backends, self.workspaces = {}, {}
        replay, static = self.graphs.get((B_b, T_b)) or self._capture(B_b, T_b)
        for name, x in inputs.items():
            static[name].copy_(x)  # into the captured addresses
        out = replay()
        self.replays[(B_b, T_b)] = self.replays.get((B_b, T_b), 0) + 1
        return out

    def _capture(self, B_b: int, T_b: int):
        dev = self.model.device
        static = dict(tokens=torch.zeros(B_b, T_b, dtype=torch.long, device=dev),
                      positions=torch.zeros(B_b, T_b, dtype=torch.long, device=dev))
        if self.slot_masks:
            static["slot_mask"] = torch.zeros(B_b, T_b, self.kv.capacity, dtype=torch.bool, device=dev)
        else:
            static["tree_mask"] = torch.eye(T_b, dtype=torch.bool, device=dev).repeat(B_b, 1, 1)
        name = self.backend_for(B_b, T_b)
        if name == "split":
            check_backend("split_triton", dev)  # a GPU, or the Triton interpreter on a CPU: else a clear error
        # dense: None, the model's own masked backend (the exact one on a CPU)
        attention = SplitAttention(self.kv) if name == "split" else BACKENDS["flash"] if name == "flash" else None

        def forward() -> ModelOutput:
            return static_forward(self.model, self.kv, hidden_layers=self.hidden_layers, attention=attention, **static)
        with torch.inference_mode():
            replay, self.pool = capture(forward, dev if self.use_graphs else torch.device("cpu"), self.pool,
                                        self.warmup)
        self.graphs[(B_b, T_b)] = (replay, static)
        self.backends[(B_b, T_b)] = name
        if name == "split":
            self.workspaces[(B_b, T_b)] = attention.workspace
        self.captures += 1
        return self.graphs[(B_b, T_b)]


@torch.inference_mode()
def greedy_decode(model, prompts: torch.Tensor, max_new_tokens: int, enabled: bool = True, pad: bool | None = None,
                  **options) -> torch.Tensor:
    """Vanilla greedy decoding of a batch of equal-length prompts through ``GraphedForward``.

    The prefill runs eagerly (one long forward, no bucket); every decode step replays a graph.

    Args:
        prompts: [B, P] token ids on the model's device.
        enabled, pad, options: ``GraphedForward``'s (buckets, ``table``).
    Returns:
        [B, max_new_tokens] new token ids.
    """
    B, P = prompts.shape
    kv = StaticKVCache.for_model(model, capacity=P + max_new_tokens, batch_size=B)
    x = static_prefill(model, kv, prompts).logits[:, -1].argmax(-1)  # [B]
    kv.commit()
    step = GraphedForward(model, kv, enabled=enabled, pad=pad, **options)
    new = [x]
    for _ in range(max_new_tokens - 1):
        x = step(x[:, None]).logits[:, -1].argmax(-1)  # [B]
        kv.commit()
        new.append(x)
    return torch.stack(new, 1)
