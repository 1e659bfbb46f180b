"""The decode loop: prefill, then one target forward per step, vanilla or speculative.

Vanilla decoding is speculative decoding with a draft tree of one node: each step feeds the
target the last emitted token, reads the distribution p for the next position, and emits
one token. The speculative chapters extend exactly this loop: a drafter proposes more nodes,
the same target forward scores them all, a verifier keeps an accepted path, and
``kv.commit(path)`` keeps its keys and values.

tau (mean tokens committed per target forward, bonus included) is 1.00 for vanilla.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .kv import KVCache
from .sampling import SamplingParams, next_token, probs
from .tokenizer import encode_prompt
from .tree import Tree
from .verify import verify_tree


PHASES = ("draft", "target", "verify", "commit", "hand_off", "other")
"""Where a decode step's time goes (``GenerationStats.phase_s``): the drafter's proposal, the target
forward over root + nodes, sampling and verification, the KV commit, the feature hand-off to the
drafter, and the rest of the loop (Python bookkeeping)."""


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
        tested = min(max(tree.depths()), len(path) + 1)
        for counts, n in ((self.tested_at_depth, tested), (self.accepted_at_depth, len(path))):
            counts.extend([0] * (n - len(counts)))
            for d in range(n):
                counts[d] += 1

    @property
    def acceptance_by_position(self) -> list[float]:
        """Acceptance rate at each draft depth, given that the earlier depths were accepted (alpha_d)."""
        acc = self.accepted_at_depth + [0] * (len(self.tested_at_depth) - len(self.accepted_at_depth))
        return [a / t for a, t in zip(acc, self.tested_at_depth)]

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


@torch.inference_mode()
def generate(target, tokenizer, prompt: str | Sequence[int], drafter=None, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, max_new_tokens: int = 64, chat: bool = True,
             seed: int | None = None, stop_at_eos: bool = True) -> GenerationResult:
    """Generate a continuation of ``prompt`` with ``target``, optionally speculatively.

    Args:
        target: a minispec Transformer.
        tokenizer: its tokenizer (Hugging Face or ByteTokenizer).
        prompt: text (wrapped in the chat template when ``chat`` and the tokenizer has one) or ids.
        drafter: None for vanilla decoding, or a drafter (``minispec.drafters``) whose trees are
            verified losslessly: greedy output equals vanilla greedy, sampled output has p's law.
        temperature, top_k, top_p: sampling parameters (temperature 0 = greedy).
        max_new_tokens: upper bound on new tokens.
        seed: seed of the sampling generator (ignored when greedy).
        stop_at_eos: stop after the tokenizer's / model's end-of-sequence token.
    Returns:
        GenerationResult(text, tokens, prompt_tokens, stats).
    """
    params = SamplingParams(temperature, top_k, top_p)  # validates
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if isinstance(prompt, str) and not prompt.strip():
        raise ValueError("the prompt is empty (a chat template alone is no prompt)")
    ids = encode_prompt(tokenizer, prompt, chat)
    ctx = target.cfg.max_seq_len
    if not ids:
        raise ValueError("the prompt is empty")
    if len(ids) + max_new_tokens > ctx:
        raise ValueError(f"prompt of {len(ids)} tokens + max_new_tokens={max_new_tokens} exceeds the model's "
                         f"context of {ctx} tokens; shorten the prompt or ask for fewer tokens")
    if max(ids) >= target.cfg.vocab_size or min(ids) < 0:
        raise ValueError(f"prompt token ids must be in [0, {target.cfg.vocab_size}), got {min(ids)}..{max(ids)}")
    if drafter is not None:
        if getattr(drafter, "q_kind", None) not in ("real", "onehot"):
            raise ValueError(f"drafter {drafter!r} must say whether its q is 'real' or 'onehot' (q_kind)")
        if hasattr(drafter, "check_target"):
            drafter.check_target(target)
    # greedy: argmax matching; real q: Leviathan/Chen (MSS over siblings); deterministic drafts: one-hot q
    plain = "greedy" if params.greedy else "onehot"  # also for empty trees: the next token is a sample from p
    mode = "chain" if not params.greedy and drafter is not None and drafter.q_kind == "real" else plain
    gen = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
    eos = _eos_ids(target, tokenizer) if stop_at_eos else set()
    stats = GenerationStats(prompt_tokens=len(ids))
    max_nodes = drafter.max_nodes if drafter is not None else 0
    kv = KVCache.for_model(target, capacity=len(ids) + max_new_tokens + max_nodes)

    # feature hand-off (EAGLE, Medusa): the drafter sees the target's hidden states of every committed token
    observe = getattr(drafter, "observe", None)
    layers = tuple(getattr(drafter, "target_layers", ())) if observe is not None else ()

    def hand_off(out, rows):
        if observe is not None:
            observe(out.hidden[0, rows], {i: h[0, rows] for i, h in out.layer_inputs.items()})

    t0 = time.perf_counter()
    out = target(torch.tensor([ids], device=target.device), kv=kv, hidden_layers=layers, last_logits_only=True)
    kv.commit()
    x = int(next_token(out.logits[0, -1], params, gen))  # the first new token: the root of the first tree
    if drafter is not None:
        drafter.prefill(ids)
        hand_off(out, slice(None))
    stats.target_forwards, stats.prefill_s = 1, time.perf_counter() - t0  # the drafter's prefill included
    new = [x]
    stats.tokens_per_step.append(1)

    t0 = time.perf_counter()
    phase, clock = stats.phase_s, [t0]

    def lap(name):  # time since the last lap goes to phase ``name``
        now = time.perf_counter()
        phase[name] += now - clock[0]
        clock[0] = now

    while len(new) < max_new_tokens and x not in eos:
        budget = max_new_tokens - len(new) - 1  # drafts beyond this could never be emitted
        lap("other")
        tree = drafter.propose(ids + new, params, budget, gen) if drafter is not None else EMPTY
        lap("draft" if drafter is not None else "other")
        if len(tree) > max_nodes:
            raise ValueError(f"{drafter!r} proposed {len(tree)} nodes but declared max_nodes={max_nodes}")
        if len(tree):
            tree.check_depth(budget)  # a drafter must not draft past the tokens still wanted
        tokens = torch.tensor([[x] + tree.tokens], device=target.device)  # [1, N + 1]: root + nodes
        if tree.is_chain:  # causal mask, default positions
            out = target(tokens, kv=kv, hidden_layers=layers)
        else:
            out = target(tokens, positions=tree.positions(kv.length).to(target.device), mask=tree.mask().to(target.device),
                         kv=kv, hidden_layers=layers)
        lap("target")
        logits = out.logits[0]  # [N + 1, V]
        p = logits if params.greedy else probs(logits, params)
        res = verify_tree(tree.parents, tree.tokens, p, tree.q, mode=mode if len(tree) else plain, generator=gen)
        rows = [0] + [i + 1 for i in res.path]  # the root and the accepted path
        lap("verify")
        kv.commit(rows)
        lap("commit")
        hand_off(out, rows)
        lap("hand_off")
        stats.record(tree, res.path)
        stats.nodes.append(len(tree))
        emitted = res.emitted[: max_new_tokens - len(new)]
        for j, t in enumerate(emitted):
            if t in eos:
                emitted = emitted[: j + 1]
                break
        new += emitted
        x = new[-1]
        stats.target_forwards += 1
        stats.tokens_per_step.append(len(emitted))
    lap("other")
    stats.decode_s = clock[0] - t0  # the sum of the phases
    stats.new_tokens = len(new)
    stats.draft_forwards = getattr(drafter, "forwards", 0) if drafter is not None else 0
    text = tokenizer.decode(new, skip_special_tokens=True)
    return GenerationResult(text=text, tokens=new, prompt_tokens=ids, stats=stats)


EMPTY = Tree([], [])
