"""Batched decoding (chapter 7): B sequences, one target forward per step, ragged acceptance.

Each sequence of the batch is a ``generate.Decoder`` with its own prompt, drafter, sampling
generator and statistics; the batch shares the target's forward and one paged KV cache
(``minispec.kv.PagedKVCache``). A step:

    trees = [dec.propose() for each unfinished sequence]      each drafter drafts its own tree
    out   = target(root + tree of every row, plan=ragged)     ONE forward, rows right-padded
    rows  = [dec.verify(tree_r, logits of row r)]             each sequence accepts its own path
    kv.commit(rows per sequence)                              ragged commit, blocks freed
    finished sequences free their blocks and leave the batch
    waiting prompts take the freed rows (prefilled together)  continuous batching (``max_rows``)

Sequences differ in prompt length, accepted length and tree shape, so the batch is ragged:
the forward runs on a ragged attention plan (``attention.plan.prepare_ragged``, built from
``{sequence: new tokens}``): every row attends over its own prefix (read through its block table; all rows
in one attention call, padded with keys their masks hide, ``RaggedPlan``), and the linear layers are
row-invariant (the exact backend, ``minispec.exact``),
so each row computes, bit for bit, what that sequence's forward alone computes. Hence greedy
batched output equals unbatched output, and sampled output too, given each sequence's seed:
every random draw stays in its own sequence's generator.

With ``max_rows`` below the number of prompts, at most that many sequences decode at once, and a
finished sequence's cache row goes to the next waiting prompt at once (Orca's iteration-level
scheduling): the forwards stay full while answers of different lengths finish, instead of running
on fewer and fewer rows until the longest is done. A sequence's tokens do not depend on its company,
so which prompts share a step changes no bit.

Drafting is done sequence by sequence (each drafter holds its own context); the batching is in
the target's forward, which on a memory-bound machine costs about the same for B rows as for
one, until the rows make it compute-bound: speculation's gain shrinks as the batch grows
(``python -m minispec bench --batch-size B``).

References: Yu et al., "Orca: A Distributed Serving System for Transformer-Based Generative
Models" (2022, iteration-level batching); Kwon et al. (vLLM, 2023, paged KV).

Shapes: R rows in this step's forward (unfinished sequences), T = most new tokens of a row.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from .attention.plan import prepare_ragged
from .clock import phase_clock
from .drafters.base import Drafter
from .generate import Decoder, GenerationResult, _eos_ids, as_drafter, check_block_size, encode_checked, seeded
from .kv import PagedKVCache, RowKVCache
from .sampling import GREEDY, SamplingParams, as_params
from .transfer import to_device


class BatchDecoder:
    """B generations at once: ``prefill()`` once, then ``step()`` until ``done``.

    Each sequence is a ``Decoder`` on the shared paged cache; the batch runs the target's forwards
    (one over every prompt, then one per step over every unfinished sequence's tree) and hands each
    sequence its row through the Decoder's public steps: ``start`` after the prefill; ``propose``,
    ``inputs``, ``verify``, ``advance`` in a step.

    Args:
        target: a minispec Transformer.
        prompts: B lists of prompt token ids (checked by ``generate_batch``).
        drafters: None (vanilla) or one Drafter per sequence (each keeps its own context).
        params, eos: as for ``Decoder``; max_new_tokens: one budget, or one per sequence.
        generators: None or one sampling generator per sequence.
        block_size: tokens per KV block of the shared paged cache.
        kv: "paged" (chapter 7's pool of blocks) or "rows" (``RowKVCache``).
        max_rows: most sequences in a forward (None: every prompt at once); the others wait for a row.
    """

    def __init__(self, target, prompts: Sequence[Sequence[int]], drafters: Sequence[Drafter | None] | None = None,
                 params: SamplingParams = GREEDY, max_new_tokens: int | Sequence[int] = 64, eos: set[int] = frozenset(),
                 generators: Sequence[torch.Generator | None] | None = None, block_size: int = 16, kv: str = "paged",
                 max_rows: int | None = None):
        B = len(prompts)
        if max_rows is not None and (not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows < 1):
            raise ValueError(f"max_rows must be a positive number of sequences or None, got {max_rows!r}")
        self.rows = B if max_rows is None else min(max_rows, B)  # the cache's rows
        drafters = list(drafters) if drafters is not None else [None] * B
        generators = list(generators) if generators is not None else [None] * B
        if len(drafters) != B or len(generators) != B:
            raise ValueError(f"{B} prompts need {B} drafters and {B} generators, got {len(drafters)} and {len(generators)}")
        if len({id(d) for d in drafters if d is not None}) < sum(d is not None for d in drafters):
            raise ValueError("each sequence needs a drafter of its own (a drafter holds its sequence's context)")
        drafters = [as_drafter(d) for d in drafters]  # None: vanilla
        budgets = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * B
        if len(budgets) != B:
            raise ValueError(f"{B} prompts need one max_new_tokens or {B}, got {len(budgets)}")
        check_block_size(block_size)
        most = max(d.max_nodes for d in drafters)  # every row of a step's forward is padded to the largest tree
        capacity = [len(p) + n + most for p, n in zip(prompts, budgets)]
        if kv == "rows":  # every sequence a contiguous row of its own: a step reads its rows without gathers
            self.kv = RowKVCache.for_model(target, max(capacity), batch_size=self.rows)
        elif kv == "paged":  # chapter 7's pool of blocks, shared by the sequences (enough for the largest at once)
            n_blocks = sum(sorted((-(-c // block_size) for c in capacity), reverse=True)[:self.rows])
            self.kv = PagedKVCache.for_model(target, max(capacity), batch_size=self.rows, block_size=block_size,
                                             n_blocks=n_blocks)
        else:
            raise ValueError(f"kv must be 'paged' or 'rows', got {kv!r}")
        self.decs = [Decoder(target, ids, d, params, n, eos, g, kv=self.kv)
                     for ids, d, g, n in zip(prompts, drafters, generators, budgets)]
        self.target = target
        self.row_of: dict[int, int] = {}  # sequence -> its cache row, while it decodes
        self.waiting = list(range(B))  # sequences not yet prefilled, in prompt order
        self.layers = tuple(sorted({i for dec in self.decs for i in dec.layers}))
        self.phase_s = dict.fromkeys(("draft", "target", "verify", "commit", "hand_off"), 0.0)
        self.prefill_s = self.decode_s = 0.0
        self.clock = phase_clock(self, target.device)  # CUDA: events (minispec.clock); flushed by generate_batch
        self.steps = 0
        self.rows_per_step: list[int] = []  # sequences in each step's forward

    @property
    def done(self) -> bool:
        return all(dec.done for dec in self.decs)

    def active(self) -> list[int]:
        """The unfinished sequences that hold a cache row, in the order of their rows (the forward's row order)."""
        return sorted((b for b in self.row_of if not self.decs[b].done), key=self.row_of.__getitem__)

    def _forward(self, rows: dict[int, list[int]], positions: torch.Tensor | None = None, masks=None,
                 last_logits_only: bool = False):
        """One target forward over ``{sequence: its new tokens}`` (each on its cache row), right-padded into [R, T]."""
        T = max(len(t) for t in rows.values())
        tokens = torch.zeros(len(rows), T, dtype=torch.long)  # [R, T]
        for r, t in enumerate(rows.values()):
            tokens[r, :len(t)] = torch.tensor(t)
        dev, cfg = self.target.device, self.target.cfg
        plan = prepare_ragged(len(rows), T, dev, self.kv, {self.row_of[b]: len(t) for b, t in rows.items()},
                              None if positions is None else to_device(positions, dev), masks, self.target.attention,
                              cfg.max_seq_len)  # each row attends over its own sequence's prefix
        return self.target(to_device(tokens, dev), kv=self.kv, plan=plan, hidden_layers=self.layers,
                           last_logits_only=last_logits_only)

    def prefill(self) -> None:
        """The first ``max_rows`` prompts (all by default) take the cache's rows (``admit``)."""
        self.admit()

    def admit(self) -> list[int]:
        """Waiting prompts take the free cache rows, in prompt order; their prompts run in as few forwards as
        keep the padding small (``prefill_groups``: prompts of similar lengths together), then each sequence
        starts on its row (``Decoder.start``). Time counted in ``prefill_s``. Returns the sequences started."""
        t0, started = time.perf_counter(), []
        while self.waiting and len(self.row_of) < self.rows:
            taken = set(self.row_of.values())
            free = [r for r in range(self.rows) if r not in taken]
            new = [self.waiting.pop(0) for _ in range(min(len(free), len(self.waiting)))]
            self.row_of.update(zip(new, free))
            for group in prefill_groups([len(self.decs[b].ids) for b in new]):
                out = self._forward({new[i]: self.decs[new[i]].ids for i in group}, last_logits_only=True)
                self.kv.commit()
                for r, i in enumerate(group):
                    self.decs[new[i]].start(out, r)
            started += new
            self._finish()  # a sequence may be done at its first token: its row goes to the next prompt
        self.prefill_s += time.perf_counter() - t0
        return started

    def step(self) -> dict[int, list[int]]:
        """One target forward for every unfinished sequence. Returns {sequence: tokens it emitted}."""
        self.clock.start()
        lap = self.clock.lap
        active = self.active()
        trees = {b: self.decs[b].propose() for b in active}
        lap("draft")
        inputs = {b: self.decs[b].inputs(tree, self.kv.lengths[self.row_of[b]]) for b, tree in trees.items()}  # as alone
        T = max(len(tokens) for tokens, _, _ in inputs.values())
        positions = torch.zeros(len(active), T, dtype=torch.long)  # [R, T]; padding at the sequence's length
        for r, (b, (tokens, pos, _)) in enumerate(inputs.items()):
            positions[r] = self.kv.lengths[self.row_of[b]]
            positions[r, :len(tokens)] = pos
        masks = [None if m is None else to_device(m, self.target.device) for _, _, m in inputs.values()]
        out = self._forward({b: tokens for b, (tokens, _, _) in inputs.items()}, positions, masks)
        lap("target")
        verified = {b: self.decs[b].verify(tree, out.logits[r, :1 + len(tree)]) for r, (b, tree) in enumerate(trees.items())}
        lap("verify")
        keep: list[list[int] | None] = [None] * self.rows  # per cache row; None: nothing pending (a free row)
        for b, (_, rows) in verified.items():
            keep[self.row_of[b]] = rows
        self.kv.commit(keep)
        lap("commit")
        emitted = {b: self.decs[b].advance(trees[b], res, out, rows, r)
                   for r, (b, (res, rows)) in enumerate(verified.items())}
        self._finish()
        lap("hand_off")
        self.steps += 1
        self.rows_per_step.append(len(active))
        self.admit()  # waiting prompts take the rows just freed
        return emitted

    def _finish(self) -> None:
        """Finished sequences leave the batch: their cache rows (KV blocks) are freed for the waiting prompts."""
        for b in [b for b in self.row_of if self.decs[b].done]:
            row = self.row_of.pop(b)
            if self.kv.lengths[row]:
                self.kv.free(row)
        if isinstance(self.kv, RowKVCache) and not self.waiting:  # waiting prompts take the freed rows instead
            self._compact()

    def _compact(self) -> None:
        """The sequences in a ``RowKVCache``'s highest rows move into the rows freed below them (``RowKVCache.move``:
        one copy of one sequence's cache, once), so that the rows of every forward stay the cache's first R, read as
        views, instead of an ``index_select`` copying every row's keys and values in every layer of every step."""
        held = set(self.row_of.values())
        holes = [r for r in range(len(held)) if r not in held]  # as many as the rows held at or above len(held)
        movers = sorted((b for b, r in self.row_of.items() if r >= len(held)), key=self.row_of.__getitem__, reverse=True)
        for hole, b in zip(holes, movers):
            self.kv.move(self.row_of[b], hole)
            self.row_of[b] = hole


PREFILL_PADDING = 1.25  # a prefill forward computes at most this many token rows per prompt token


def prefill_groups(lengths: Sequence[int], padding: float = PREFILL_PADDING) -> list[list[int]]:
    """The sequences of each prefill forward: shortest prompt first, a forward taking the next prompt while
    its rows, right-padded to the longest, stay within ``padding`` x its prompt tokens. The linear layers
    compute every padded row, so one forward over prompts of 20 to 192 tokens costs ~3x their tokens; a
    forward more costs one more read of the weights. Rows are row-invariant, so the grouping changes no bit.

    Returns:
        lists of indices into ``lengths``, every index once.
    """
    groups: list[list[int]] = []
    tokens = 0  # of the last group
    for b in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if groups and (len(groups[-1]) + 1) * lengths[b] <= padding * (tokens + lengths[b]):
            groups[-1].append(b)
            tokens += lengths[b]
        else:
            groups.append([b])
            tokens = lengths[b]
    return groups


def _drafters(drafter, B: int) -> list[Drafter | None]:
    """One drafter per sequence: None, a list of B, a factory, or one drafter and B - 1 ``fresh()`` copies."""
    if drafter is None:
        return [None] * B
    if isinstance(drafter, Drafter):
        return [drafter] + [drafter.fresh() for _ in range(B - 1)]
    drafters = list(drafter) if isinstance(drafter, (list, tuple)) else [drafter() for _ in range(B)]
    if len(drafters) != B:
        raise ValueError(f"{B} prompts need {B} drafters, got {len(drafters)}")
    for d in drafters:
        if d is not None and not isinstance(d, Drafter):
            raise TypeError(f"{d!r} is not a minispec Drafter")
    return drafters


@torch.inference_mode()
def generate_batch(target, tokenizer, prompts: Sequence[str | Sequence[int]],
                   drafter: Sequence[Drafter] | Callable[[], Drafter] | None = None, temperature: float = 0.0,
                   top_k: int = 0, top_p: float = 1.0, max_new_tokens: int = 64, chat: bool = True,
                   seed: int | Sequence[int] | None = None, stop_at_eos: bool = True,
                   kv_block_size: int = 16, params: SamplingParams | None = None, kv: str = "paged",
                   max_rows: int | None = None) -> tuple[list[GenerationResult], BatchDecoder]:
    """Generate continuations of B prompts together (chapter 7); each equals ``generate`` alone.

    Args:
        prompts: B prompts, text or ids (as ``generate``'s ``prompt``).
        drafter: None (vanilla); a drafter (the other sequences get ``drafter.fresh()`` copies,
            sharing its weights); a list of B drafters; or a function returning a new drafter.
        seed: None, one seed for all, or one per prompt; sequence b samples from its own
            generator, so its output equals ``generate(..., seed=seed_b)``.
        kv_block_size: tokens per block of the shared paged KV cache.
        kv: "paged" (chapter 7's pool of blocks) or "rows" (``RowKVCache``: every sequence a contiguous row of its
            own, read without gathers: faster on the CPU, for as much memory as the longest sequence in every row).
        max_rows: at most this many sequences decode together (None: all); a finished sequence's row goes to
            the next prompt at once (continuous batching). Each output is the same either way.
        The rest as for ``generate``.
    Returns:
        (one GenerationResult per prompt, the BatchDecoder: batch timings ``prefill_s``,
        ``decode_s``, ``phase_s``, ``rows_per_step``). Per-sequence stats count forwards, tokens
        and acceptance; their times are the batch's.
    """
    params = as_params(params, temperature, top_k, top_p)  # validates
    if isinstance(prompts, str) or not len(prompts):
        raise ValueError("prompts must be a non-empty list of prompts")
    ids = [encode_checked(target, tokenizer, p, chat, max_new_tokens, f"prompt {i}") for i, p in enumerate(prompts)]
    B = len(ids)
    seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed] * B
    if len(seeds) != B:
        raise ValueError(f"{B} prompts need one seed or {B} seeds, got {len(seeds)}")
    eos = _eos_ids(target, tokenizer) if stop_at_eos else set()
    batch = BatchDecoder(target, ids, _drafters(drafter, B), params, max_new_tokens, eos, [seeded(s) for s in seeds],
                         kv_block_size, kv, max_rows)
    batch.prefill()
    while not batch.done:
        batch.step()
    batch.clock.flush()
    results = [dec.result(tokenizer) for dec in batch.decs]
    for r in results:  # the batch's times: each sequence shared every forward
        r.stats.prefill_s, r.stats.decode_s = batch.prefill_s, batch.decode_s
    return results, batch
