"""The decode loop: prefill, then one target forward per step, vanilla or speculative.

Vanilla decoding is speculative decoding with a draft tree of one node (the root alone: the
``Vanilla`` drafter, ``drafter=None``): each step feeds the target the last emitted token, reads
the distribution p for the next position, and emits one token. The speculative chapters extend
exactly this loop, with no special case for vanilla: a drafter proposes more nodes,
the same target forward scores them all, a verifier keeps an accepted path, and
``kv.commit(path)`` keeps its keys and values.

tau (mean tokens committed per target forward, bonus included) is 1.00 for vanilla.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .clock import phase_clock
from .cuda_graphs import GraphedForward, pick_bucket, static_prefill, token_buckets
from .drafters.base import Drafter, Features, Vanilla
from .kv import KVCache, PagedKVCache, StaticKVCache
from .sampling import GREEDY, SamplingParams, as_params, next_token
from .tokenizer import encode_prompt
from .transfer import to_device
from .tree import Tree
from .verify import verify_tree


PHASES = ("draft", "target", "verify", "commit", "hand_off", "other")
"""Where a decode step's time goes (``GenerationStats.phase_s``): the drafter's proposal, the target
forward over root + nodes, sampling and verification, the KV commit, the feature hand-off to the
drafter, and the rest of the loop (Python bookkeeping). On a GPU each phase gets the device time of the
work it launched (``minispec.clock``: CUDA events), not the host's time to launch it."""


def add_by_depth(total: list[int], counts: Sequence[int]) -> list[int]:
    """Per-depth counts pooled: ``total[d] += counts[d]`` for every depth, ``total`` grown in place to the
    deeper of the two (runs, steps or prompts reach different depths). Returns ``total``."""
    total.extend([0] * (len(counts) - len(total)))
    for d, c in enumerate(counts):
        total[d] += c
    return total


def acceptance_by_depth(tested: Sequence[int], accepted: Sequence[int]) -> list[float]:
    """alpha_d = accepted[d] / tested[d] at every depth tested (``accepted`` may stop sooner: 0 there)."""
    return [(accepted[d] if d < len(accepted) else 0) / t for d, t in enumerate(tested)]


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0  # prefill included
    prefill_s: float = 0.0
    decode_s: float = 0.0
    tokens_per_step: list[int] = field(default_factory=list)  # tokens committed by each target forward
    tested_at_depth: list[int] = field(default_factory=list)  # [d]: steps that verified a node at depth d + 1
    accepted_at_depth: list[int] = field(default_factory=list)  # [d]: steps that accepted a node at depth d + 1
    draft_forwards: int = 0
    nodes: list[int] = field(default_factory=list)  # draft nodes verified by each decode step
    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))  # decode time by phase

    def record(self, tree, path: list[int]) -> None:
        """Per-depth acceptance of one verified tree: depth d + 1 is tested when the tree reaches it
        and the first d were accepted."""
        if not len(tree):
            return
        add_by_depth(self.tested_at_depth, [1] * min(tree.depth, len(path) + 1))
        add_by_depth(self.accepted_at_depth, [1] * len(path))

    @property
    def acceptance_by_position(self) -> list[float]:
        """Acceptance rate at each draft depth, given that the earlier depths were accepted (alpha_d)."""
        return acceptance_by_depth(self.tested_at_depth, self.accepted_at_depth)

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of wall time, prefill included (what a user waits for)."""
        return self.new_tokens / self.total_s if self.total_s else 0.0

    @property
    def tau(self) -> float:
        """Mean tokens committed per target forward (bonus included; vanilla = 1.00)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    def as_dict(self) -> dict:
        return dict(prompt_tokens=self.prompt_tokens, new_tokens=self.new_tokens, target_forwards=self.target_forwards,
                    prefill_s=self.prefill_s, decode_s=self.decode_s, tokens_per_s=self.tokens_per_s, tau=self.tau,
                    draft_forwards=self.draft_forwards, acceptance_by_position=self.acceptance_by_position,
                    phase_s=dict(self.phase_s))


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]  # new tokens only
    prompt_tokens: list[int]
    stats: GenerationStats


def _eos_ids(model, tokenizer) -> set[int]:
    ids = {getattr(tokenizer, "eos_token_id", None), model.cfg.eos_token_id}
    return {int(i) for i in ids if i is not None}


def as_drafter(drafter) -> Drafter:
    """``drafter``, or ``Vanilla()`` for None; TypeError for anything that is not a ``Drafter``."""
    if drafter is None:
        return Vanilla()
    if isinstance(drafter, str):  # a method's name: its drafter comes from the method table
        raise TypeError(f"drafter={drafter!r} is a name, not a Drafter: pass "
                        f"minispec.methods.Methods(model).drafter({drafter!r}) (a method such as 'pld', 'eagle' "
                        "or 'eagle2@5/8/32')")
    if not isinstance(drafter, Drafter):
        raise TypeError(f"{drafter!r} is not a minispec Drafter: subclass minispec.drafters.Drafter "
                        "(propose, and prefill / commit to learn what the target committed)")
    return drafter


def seeded(seed: int | None) -> torch.Generator | None:
    """The sampling generator of one sequence: a CPU generator seeded with ``seed`` (None: torch's global RNG)."""
    return torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None


def check_block_size(kv_block_size) -> None:
    """A paged cache's block size must be a positive number of tokens (ValueError otherwise)."""
    if not isinstance(kv_block_size, int) or kv_block_size < 1:
        raise ValueError(f"kv_block_size must be a positive number of tokens, got {kv_block_size!r}")


class Decoder:
    """One generation as an object: ``prefill()`` once, then ``step()`` until ``done``, then ``result()``.

    Vanilla decoding is the drafter that proposes the empty tree (``Vanilla``). A step:

        tree = drafter.propose(...)                      draft: the drafter knows the context
        out  = target(root + tree.tokens, tree mask)     one forward scores every node
        res  = verify_tree(tree, logits, mode, params)   the proposal says how to verify it; p = probs(row, params)
                                                         for each row the walk reaches
        kv.commit(root + accepted path)                  keep their keys and values
        drafter.commit(emitted, features of kept rows)   tell the drafter what was committed

    Args: those of ``generate`` (``ids`` already encoded and checked; ``drafter`` None for vanilla);
    ``kv`` a cache to use instead of a new one (``BatchDecoder``, which then runs the target's
    forwards itself and hands each sequence its row: ``start``, ``inputs``, ``verify``, ``advance``).
    """

    def __init__(self, target, ids: list[int], drafter=None, params: SamplingParams = GREEDY,
                 max_new_tokens: int = 64, eos: set[int] = frozenset(), generator: torch.Generator | None = None,
                 kv_block_size: int | None = None, kv=None, graphs: bool = False):
        drafter = as_drafter(drafter)
        drafter.check_target(target)
        if kv_block_size is not None:
            check_block_size(kv_block_size)
        self.target, self.ids, self.drafter, self.params = target, list(ids), drafter, params
        self.max_new_tokens, self.eos, self.gen = max_new_tokens, eos, generator
        self.max_nodes = drafter.max_nodes
        self.reads_features = drafter.reads_features
        self.layers = tuple(drafter.target_layers) if self.reads_features else ()
        capacity = len(ids) + max_new_tokens + self.max_nodes
        self.runner = None  # chapter 8: the target's forwards through CUDA graphs (GraphedForward)
        self.drafter_graphs = False  # the drafter's own steps too (a draft model, an EAGLE head)
        if graphs:
            if kv is not None or kv_block_size is not None:
                raise ValueError("graphs=True decodes on its own static KV cache (minispec.cuda_graphs): it takes "
                                 "neither a shared cache nor kv_block_size")
            kv = self._graphed(capacity)
        else:
            drafter.use_graphs(False)  # a drafter graphed by an earlier generation drafts eagerly again
        if kv is None:
            kv = KVCache.for_model(target, capacity) if kv_block_size is None else \
                PagedKVCache.for_model(target, capacity, block_size=kv_block_size)  # chapter 7: same interface
        self.kv = kv
        self.new: list[int] = []
        self.stats = GenerationStats(prompt_tokens=len(ids))
        self.clock = phase_clock(self.stats, target.device)  # CUDA: events, so a phase gets the GPU time it launched

    def _graphed(self, capacity: int) -> StaticKVCache:
        """Chapter 8: the static cache and the graph runner of the target's forwards (and the drafter's)."""
        buckets = token_buckets(self.max_nodes + 1)
        kv = StaticKVCache.for_model(self.target, capacity - self.max_nodes + pick_bucket(self.max_nodes + 1, buckets))
        self.runner = GraphedForward(self.target, kv, batch_buckets=(1,), token_buckets=buckets, pad=True,
                                     hidden_layers=self.layers)  # padded rows need their slots too
        self.drafter_graphs = self.drafter.use_graphs(True)
        return kv

    def _features(self, out, rows, r: int = 0) -> Features | None:
        """The drafter's share of the forward ``out``: row ``r``'s hidden states at ``rows``."""
        if not self.reads_features:
            return None
        return Features(out.hidden[r, rows], {i: out.layer_inputs[i][r, rows] for i in self.layers})

    @property
    def done(self) -> bool:
        return len(self.new) >= self.max_new_tokens or (bool(self.new) and self.new[-1] in self.eos)

    def prefill(self) -> None:
        """The prompt's forward, then ``start``: the first new token and the drafter's prefill."""
        t0 = time.perf_counter()
        prompt = torch.tensor([self.ids], device=self.target.device)  # [1, P]
        if self.runner is not None:  # one long eager forward on the static cache (never a graph)
            out = static_prefill(self.target, self.kv, prompt, hidden_layers=self.layers, last_logits_only=True)
        else:
            out = self.target(prompt, kv=self.kv, hidden_layers=self.layers, last_logits_only=True)
        self.kv.commit()
        self.start(out)
        self.stats.prefill_s = time.perf_counter() - t0  # drafter's prefill included
        self.clock.start()

    def start(self, out, r: int = 0) -> None:
        """After the prompt's forward ``out`` (this sequence is its row ``r``; the cache committed): the
        first new token (the first tree's root), the drafter's prefill with the prompt's features."""
        self.new = [int(next_token(out.logits[r, -1], self.params, self.gen))]
        self.drafter.prefill(self.ids + self.new, self._features(out, slice(0, len(self.ids)), r))
        self.stats.target_forwards = self.stats.new_tokens = 1
        self.stats.tokens_per_step.append(1)

    def _lap(self, phase: str) -> None:  # time since the last lap goes to ``phase`` (minispec.clock)
        self.clock.lap(phase)

    def step(self) -> list[int]:
        """One target forward: draft, verify, commit. Returns the tokens it emitted."""
        self._lap("other")
        tree = self.propose()
        self._lap("draft" if self.max_nodes else "other")  # a drafter that never drafts has no draft phase
        out = self.forward(tree)
        self._lap("target")
        res, rows = self.verify(tree, out.logits[0])
        self._lap("verify")
        self.kv.commit(rows)
        self._lap("commit")
        emitted = self.advance(tree, res, out, rows)
        self._lap("hand_off")
        return emitted

    def propose(self) -> Tree:
        """The drafter's tree for this step (empty for vanilla), checked."""
        budget = self.max_new_tokens - len(self.new) - 1  # drafts beyond this could never be emitted
        tree = self.drafter.propose(self.params, budget, self.gen)
        self.check(tree, budget)
        return tree

    def inputs(self, tree: Tree, length: int) -> tuple[list[int], torch.Tensor, torch.Tensor | None]:
        """The target's inputs for ``tree`` after ``length`` cached tokens: the root and the nodes' tokens
        [N + 1], their positions (length + depth) [N + 1], and the tree mask [N + 1, N + 1], None for a
        chain (vanilla included: causal after the cache)."""
        return [self.new[-1]] + tree.tokens, tree.positions(length), None if tree.is_chain else tree.mask()

    def forward(self, tree: Tree):
        """The target's forward over root + the tree's nodes ([1, N + 1] rows), eager or replayed. A tree
        drafted on the device (``tree.tensors``, chapter 8) goes in as it is: no host round trip."""
        if tree.tensors is not None:
            t = tree.tensors  # root + nodes [N + 1], depths [N + 1], mask [N + 1, N + 1], on the device
            positions = (t.depths + self.kv.length)[None]  # [1, N + 1]
            if self.runner is not None:
                return self.runner(t.tokens[None], positions, t.mask)
            return self.target(t.tokens[None], positions=positions[0], mask=t.mask, kv=self.kv,
                               hidden_layers=self.layers)
        dev = self.target.device
        tokens, positions, mask = self.inputs(tree, self.kv.length)
        tokens = to_device([tokens], dev)  # [1, N + 1]: root + nodes (pinned on CUDA: no wait for the GPU)
        positions = None if mask is None else to_device(positions, dev)  # a chain: the cache's causal default
        mask = None if mask is None else to_device(mask, dev)
        if self.runner is not None:
            return self.runner(tokens, None if positions is None else positions[None], mask)
        return self.target(tokens, positions=positions, mask=mask, kv=self.kv, hidden_layers=self.layers)

    def verify(self, tree: Tree, logits: torch.Tensor):
        """Verify ``tree`` against the target's logits [N + 1, V] over root + nodes; returns the
        verification result and the rows to keep in the KV cache (the root and the accepted path)."""
        # logits [N + 1, V]; sampled, each row the walk reaches becomes probs(row, params) there, the others never
        res = verify_tree(tree, logits, mode=tree.verify_mode(self.params.greedy), generator=self.gen,
                          params=self.params)
        return res, [0] + [i + 1 for i in res.path]

    def advance(self, tree: Tree, res, out, rows: list[int], r: int = 0) -> list[int]:
        """After the KV commit: emit the verified tokens, tell the drafter (with the features of row
        ``r`` of ``out`` at the kept ``rows``), count. Returns the emitted tokens."""
        emitted = self._cut(res.emitted)
        self.drafter.commit(emitted, self._features(out, rows[:len(emitted)], r))
        self.new += emitted
        self.stats.new_tokens = len(self.new)
        self.stats.record(tree, res.path)
        self.stats.nodes.append(len(tree))
        self.stats.target_forwards += 1
        self.stats.tokens_per_step.append(len(emitted))
        return emitted

    def check(self, tree: Tree, budget: int) -> None:
        if len(tree) > self.max_nodes:
            raise ValueError(f"{self.drafter!r} proposed {len(tree)} nodes but declared max_nodes={self.max_nodes}")
        if len(tree):
            tree.check_depth(budget)  # a drafter must not draft past the tokens still wanted

    def _cut(self, emitted: list[int]) -> list[int]:
        """``emitted`` up to the token budget and the first end-of-sequence token."""
        emitted = emitted[: self.max_new_tokens - len(self.new)]
        for j, t in enumerate(emitted):
            if t in self.eos:
                return emitted[: j + 1]
        return emitted

    def result(self, tokenizer) -> GenerationResult:
        """The generation as a ``GenerationResult``: the new tokens, their text, the completed stats."""
        self.clock.flush()  # on a GPU: the phases whose events were still pending
        self.stats.new_tokens = len(self.new)
        self.stats.draft_forwards = self.drafter.forwards
        return GenerationResult(text=tokenizer.decode(self.new, skip_special_tokens=True), tokens=self.new,
                                prompt_tokens=self.ids, stats=self.stats)


def encode_checked(target, tokenizer, prompt, chat: bool, max_new_tokens: int, name: str = "the prompt") -> list[int]:
    """``prompt`` as token ids (chat template applied when ``chat``), after checking the request:
    a positive token budget, a non-empty prompt, prompt + budget within the context, ids in the
    vocabulary. ValueError names ``name`` and the problem."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if isinstance(prompt, str) and not prompt.strip():
        raise ValueError(f"{name} is empty (a chat template alone is no prompt)")
    ids = encode_prompt(tokenizer, prompt, chat)
    ctx = target.cfg.max_seq_len
    if not ids:
        raise ValueError(f"{name} is empty")
    if len(ids) + max_new_tokens > ctx:
        raise ValueError(f"{name} of {len(ids)} tokens + max_new_tokens={max_new_tokens} exceeds the model's "
                         f"context of {ctx} tokens; shorten the prompt or ask for fewer tokens")
    if max(ids) >= target.cfg.vocab_size or min(ids) < 0:
        raise ValueError(f"{name}: token ids must be in [0, {target.cfg.vocab_size}), got {min(ids)}..{max(ids)}")
    return ids


@torch.inference_mode()
def generate(target, tokenizer, prompt: str | Sequence[int], drafter=None, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, max_new_tokens: int = 64, chat: bool = True,
             seed: int | None = None, stop_at_eos: bool = True, kv_block_size: int | None = None,
             cuda_graphs: bool = False, params: SamplingParams | None = None) -> GenerationResult:
    """Generate a continuation of ``prompt`` with ``target``, optionally speculatively.

    Args:
        target: a minispec Transformer.
        tokenizer: its tokenizer (Hugging Face or ByteTokenizer).
        prompt: text (wrapped in the chat template when ``chat`` and the tokenizer has one) or ids.
        drafter: None for vanilla decoding, or a ``minispec.drafters.Drafter`` whose trees are
            verified losslessly: greedy output equals vanilla greedy, sampled output has p's law.
        temperature, top_k, top_p: sampling parameters (temperature 0 = greedy).
        max_new_tokens: upper bound on new tokens.
        seed: seed of the sampling generator (ignored when greedy).
        stop_at_eos: stop after the tokenizer's / model's end-of-sequence token.
        kv_block_size: None for the contiguous KV cache; a number of tokens for a paged cache with
            blocks of that size (``minispec.kv.PagedKVCache``, chapter 7). The output is the same.
        cuda_graphs: run the target's verify forwards, and a draft model's draft steps, through one
            captured graph per token bucket over a static KV cache (chapter 8,
            ``minispec.cuda_graphs``); an EAGLE head (eagle, eagle2, eagle3, copy's fallback) drafts
            a greedy chain or a dynamic tree as one graph per bucket, the tree built on the device
            and handed to the verify forward there (``minispec.drafters.graphed_draft``; sampled
            chains and static trees draft eagerly). Without CUDA the same runners call the
            forward directly on their static buffers. The output is the same.
        params: a ``SamplingParams`` built once by the caller, instead of temperature/top_k/top_p.
    Returns:
        GenerationResult(text, tokens, prompt_tokens, stats).
    """
    params = as_params(params, temperature, top_k, top_p)  # validates
    ids = encode_checked(target, tokenizer, prompt, chat, max_new_tokens)
    dec = Decoder(target, ids, drafter, params, max_new_tokens, _eos_ids(target, tokenizer) if stop_at_eos else set(),
                  seeded(seed), kv_block_size, graphs=cuda_graphs)
    dec.prefill()
    while not dec.done:
        dec.step()
    return dec.result(tokenizer)
