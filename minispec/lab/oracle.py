"""An oracle drafter with a known acceptance rate: the target's own greedy stream, corrupted at rate p.

To time speculative decoding on a model with random weights (chapter 9: a Llama-3.1-8B-shaped
target built on the GPU, no checkpoint) the acceptance rate must come from somewhere. The oracle
knows the target's greedy continuation (a vanilla run beforehand) and drafts it, replacing each
drafted token, independently with probability ``p_corrupt``, by a different random token. Greedy
verification accepts a draft up to its first corrupted token, so with alpha = 1 - p_corrupt

    tokens per step (tau) for a chain of k drafts = sum_{i=0..k} alpha^i = (1 - alpha^(k+1)) / (1 - alpha)

(the bonus token is the i = 0 term), as in Leviathan et al. (2023), section 3.5, with an
i.i.d. acceptance rate alpha. Tau is known before the run; the output must still equal vanilla.

Trees: ``tree_nodes`` > k adds wrong siblings along the drafted chain (more nodes per level near
the root, the shape of an EAGLE-2 tree), drawn so that none is the target's token. They cost
verify work but never change what is accepted, so tau stays the chain's formula for depth k: the
oracle tree measures the cost of a tree of that size at a known tau.

Drafts are deterministic given the seed and are verified with one-hot q (its trees carry no q),
so the oracle is lossless under sampling too, but its stream only matches greedy decoding.

Re-anchoring. The committed context can leave the stream under greedy decoding too: with random
bf16 weights the top-2 logits of a GPU forward are often close, and a forward over N + 1 rows
(verification) can break a near-tie differently from the one-row forward of the vanilla run
that made the stream. (On the CPU minispec's fp32 forward gives a row the same bits whatever
rows come with it, ``minispec.exact``, so this cannot happen there.) The target's token
wins, as it must, and from then on the old stream is the continuation of a context that no
longer exists: an oracle that kept drafting it would be rejected at every step, and one that
stops drafting makes tau collapse to 1. Given the target (``target=``; ``for_prompt`` passes
it), the oracle instead **re-anchors**: at the first proposal after a divergence it recomputes
the stream from the committed context, a vanilla greedy run of the target (``Decoder``, one row
per step) for as many tokens as the old stream still had ahead, and drafts that. The step in
which the near-tie broke loses its drafts after the divergence; every later step drafts the
target's own continuation again, so tau keeps its promise up to those rare steps. The time a
re-anchor takes is the measuring device's, not speculation's: it is counted in
``reanchor_s`` (``scale.oracle_speedup`` takes it out of the measured draft and decode time),
and the positions where the context left the stream in ``diverged_at``. Without a target, or
when sampling (every sampled step leaves a greedy stream), the oracle stops drafting at the
first divergence and counts the empty proposals in ``off_stream``.

References: Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative
Decoding" (2023); Li et al., "EAGLE-2: Faster Inference of Language Models with Dynamic Draft
Trees" (2024).
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from ..sampling import SamplingParams
from ..tree import Tree
from ..drafters.base import Drafter


def expected_tau(p_corrupt: float, k: int) -> float:
    """Expected tokens per target forward of the oracle with depth k: sum_{i=0..k} (1 - p)^i."""
    if not 0.0 <= p_corrupt <= 1.0 or k < 0:
        raise ValueError(f"need 0 <= p_corrupt <= 1 and k >= 0, got {p_corrupt}, {k}")
    return sum((1.0 - p_corrupt) ** i for i in range(k + 1))


def corruption_for_tau(tau: float, k: int) -> float:
    """The corruption rate p whose oracle of depth k promises ``tau`` tokens per forward: the
    inverse of ``expected_tau`` (decreasing in p from k + 1 at p = 0 to 1 at p = 1), by bisection
    to float precision. ValueError unless k >= 1 and 1 <= tau <= k + 1."""
    if k < 1 or not 1.0 <= tau <= k + 1:
        raise ValueError(f"need k >= 1 and 1 <= tau <= k + 1, got tau={tau}, k={k}")
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if expected_tau(mid, k) > tau:
            lo = mid  # too many tokens: corrupt more
        else:
            hi = mid
    return 0.5 * (lo + hi)


def tree_shape(depth: int, nodes: int) -> tuple[list[int], list[int]]:
    """A chain of ``depth`` nodes with ``nodes - depth`` extra leaves: the shape of the oracle's trees.

    The leaves hang beside the chain (siblings of its nodes), more of them near the root, as the
    nodes of an EAGLE-2 tree are. Order: level by level, the chain node first.

    Returns:
        (parents [nodes], spine [depth]: the index of the chain node at each level).
    """
    if depth < 1 or nodes < depth:
        raise ValueError(f"need depth >= 1 and nodes >= depth, got {depth}, {nodes}")
    extra = nodes - depth
    parents, spine = [], []
    for d in range(depth):
        up = spine[-1] if spine else -1  # the chain node one level up (-1: the root)
        spine.append(len(parents))
        parents += [up] * (1 + extra // depth + (d < extra % depth))
    return parents, spine


class OracleDrafter(Drafter):
    """Drafts the next k tokens of a known greedy stream, each corrupted with probability p_corrupt.

    Args:
        stream: the full greedy sequence, prompt included (``prompt_tokens + tokens`` of a
            vanilla greedy ``generate``): after a context of n tokens the oracle drafts stream[n:n+k].
        k: drafted depth per step.
        p_corrupt: probability that a drafted token is replaced by a different random token.
        seed: seeds the corruption.
        tree_nodes: total draft nodes per step (>= k); the extra ones are wrong siblings.
        vocab_size: token ids of corruptions and siblings are drawn below it (default: max(stream) + 1).
        target: the target model; given, the oracle re-anchors when greedy decoding leaves the
            stream (module docstring), else it stops drafting there.
    """

    def __init__(self, stream: Sequence[int], k: int = 5, p_corrupt: float = 0.2, seed: int = 0,
                 tree_nodes: int | None = None, vocab_size: int | None = None, target=None):
        self.stream0 = [int(t) for t in stream]  # the stream as given; every prefill starts from it again
        self.stream = list(self.stream0)
        self.target = target
        self.vocab_size = vocab_size or max(self.stream0) + 1
        tree_nodes = k if tree_nodes is None else tree_nodes
        if k < 1 or tree_nodes < k or not 0.0 <= p_corrupt <= 1.0:
            raise ValueError(f"need k >= 1, tree_nodes >= k and 0 <= p_corrupt <= 1; got {k}, {tree_nodes}, {p_corrupt}")
        if self.vocab_size < 2 + (tree_nodes - k):
            raise ValueError(f"vocabulary of {self.vocab_size} is too small for {tree_nodes - k} wrong siblings")
        self.k, self.p_corrupt, self.tree_nodes, self.seed = k, p_corrupt, tree_nodes, seed
        self.max_nodes = tree_nodes
        self.gen = torch.Generator().manual_seed(seed)
        self.off_stream = 0  # proposals skipped because the context had left the stream
        self.checked = 0  # context tokens already found equal to the stream
        self.forwards = 0  # no draft model: no draft forwards
        self.reanchors, self.reanchor_s, self.diverged_at = 0, 0.0, []  # see "Re-anchoring" above

    def __repr__(self):
        return f"OracleDrafter(k={self.k}, p_corrupt={self.p_corrupt}, tree_nodes={self.tree_nodes})"

    @property
    def expected_tau(self) -> float:
        return expected_tau(self.p_corrupt, self.k)

    def check_target(self, target) -> None:
        if self.vocab_size > target.cfg.vocab_size:
            raise ValueError(f"oracle vocabulary {self.vocab_size} exceeds the target's {target.cfg.vocab_size}")

    def prefill(self, tokens: list[int], features=None) -> None:
        super().prefill(tokens)
        self.gen.manual_seed(self.seed)
        self.stream = list(self.stream0)
        self.off_stream = self.checked = self.reanchors = 0
        self.reanchor_s, self.diverged_at = 0.0, []

    def _other(self, avoid: set[int]) -> int:
        """A uniformly random token id not in ``avoid``."""
        while True:
            t = int(torch.randint(0, self.vocab_size, (1,), generator=self.gen))
            if t not in avoid:
                return t

    def draft_chain(self, n: int, k: int) -> list[int]:
        """stream[n:n+k] (shorter at the stream's end), each token corrupted with probability p_corrupt."""
        truth = self.stream[n:n + k]
        bad = torch.rand(len(truth), generator=self.gen) < self.p_corrupt  # [k]
        return [self._other({t}) if b else t for t, b in zip(truth, bad.tolist())]

    def propose(self, params: SamplingParams, budget: int, generator: torch.Generator | None = None) -> Tree:
        context, n = self.context, len(self.context)
        if self.off_stream or context[self.checked:n] != self.stream[self.checked:n]:
            if not self.off_stream:
                self.diverged_at.append(next((i for i in range(self.checked, n)
                                              if i >= len(self.stream) or context[i] != self.stream[i]), n))
            if self.target is None or not params.greedy:
                self.off_stream += 1  # the context has left the stream: no more drafts
                return Tree([], [])
            self.reanchor()
        self.checked = n  # context[:n] matches: only newer tokens need checking next time
        chain = self.draft_chain(n, min(self.k, budget))
        if not chain:
            return Tree([], [])
        return self.with_siblings(chain, self.stream[n:n + len(chain)])

    @torch.inference_mode()
    def reanchor(self) -> None:
        """The stream from here on: the committed context + the target's greedy continuation of it
        (one-row vanilla steps, as the stream was made), as far ahead as the given stream reached
        (at least k tokens). Timed into ``reanchor_s``."""
        from ..generate import Decoder

        t0 = time.perf_counter()
        horizon = max(len(self.stream0) - len(self.context), self.k)
        horizon = min(horizon, self.target.cfg.max_seq_len - len(self.context))
        dec = Decoder(self.target, list(self.context), None, SamplingParams(0.0, 0, 1.0), max(horizon, 1))
        dec.prefill()
        while not dec.done:
            dec.step()
        self.stream = list(self.context) + dec.new
        self.reanchors += 1
        self.reanchor_s += time.perf_counter() - t0

    def with_siblings(self, chain: list[int], truth: list[int]) -> Tree:
        """The chain plus ``tree_nodes - k`` wrong leaves (shape: ``tree_shape``).

        A sibling is never the target's token, the drafted token, nor another sibling."""
        n = self.tree_nodes if len(chain) == self.k else len(chain)  # a chain cut by the budget: no siblings
        parents, spine = tree_shape(len(chain), n)
        tokens = [0] * n
        used = [{c, t} for c, t in zip(chain, truth)]  # per depth
        level = 0
        for i in range(n):
            if level + 1 < len(spine) and i == spine[level + 1]:
                level += 1
            if i == spine[level]:
                tokens[i] = chain[level]
            else:
                tokens[i] = self._other(used[level])
                used[level].add(tokens[i])
        return Tree(tokens, parents)

    @classmethod
    def for_prompt(cls, target, tokenizer, prompt, max_new_tokens: int, chat: bool = True, **kw) -> "OracleDrafter":
        """Run vanilla greedy decoding of ``prompt`` and return an oracle over its stream that
        re-anchors with ``target`` (keyword arguments go to the constructor; ``target=None`` turns
        re-anchoring off)."""
        from ..generate import generate

        r = generate(target, tokenizer, prompt, max_new_tokens=max_new_tokens, chat=chat, stop_at_eos=False)
        kw.setdefault("target", target)
        return cls(r.prompt_tokens + r.tokens, vocab_size=kw.pop("vocab_size", target.cfg.vocab_size), **kw)
