"""Verification: accept or reject drafted tokens so the output is exactly a sample from p.

Chapter 1 (one chain of drafts) and chapter 2 (several candidates per node: trees).

References:
    Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative Decoding"
        (2023): accept with probability min(1, p/q), resample from the residual. (Expected
        tokens per step and the speedup model: ``minispec.lab.analysis``.)
    Chen et al., "Accelerating Large Language Model Decoding with Speculative Sampling" (2023).
    Miao et al., "SpecInfer" (2023): multi-round speculative sampling (MSS) over the
        candidate children of a tree node.
    Li et al., "EAGLE" (2024), Algorithm 1: MSS on a draft tree; EAGLE's code treats top-k
        drafts as one-hot q (mode "onehot" below).
    Jeon et al., "Recursive Speculative Decoding" (2024) and Yang et al., "Multi-Candidate
        Speculative Decoding" (2024): candidates drawn WITHOUT replacement and recursive
        rejection sampling (mode "mss_no_replacement").

Notation: ``p`` target distribution, ``q`` draft distribution, both [V]; ``k`` (gamma) the
number of drafted tokens or candidates. Accept x with probability min(1, p(x)/q(x)); on
rejection draw from the residual norm(max(0, p - q)).

Every random choice goes through a small ``Chooser`` (``bernoulli(prob)``,
``categorical(dist)``). ``TorchChooser`` samples with a torch.Generator; the exact enumeration
in ``minispec.lab.exactness`` plugs in a chooser that walks every branch, so the very code below
is what gets checked against p, not a re-implementation of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np
import torch

from .sampling import SamplingParams, probs, sample
from .tree import Tree

MODES = ("greedy", "chain", "mss_replacement", "mss_no_replacement", "onehot")
_REAL_Q_MODES = ("chain", "mss_replacement", "mss_no_replacement")


# --------------------------------------------------------------------------- random choices
class Chooser(Protocol):
    """Where verifiers get their randomness from."""

    def bernoulli(self, prob: float) -> bool:
        """True with probability ``prob``."""

    def categorical(self, dist: torch.Tensor) -> int:
        """An index drawn from the non-negative weights ``dist`` [V] (normalised inside)."""


class TorchChooser:
    """Samples with an optional torch.Generator (``None``: torch's global RNG)."""

    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator

    def bernoulli(self, prob: float) -> bool:
        device = self.generator.device if self.generator is not None else None
        u = torch.rand((), dtype=torch.float64, generator=self.generator, device=device)
        return u.item() < prob

    def categorical(self, dist: torch.Tensor) -> int:
        return int(sample(dist, self.generator))  # inverse transform, on the generator's device


def _chooser(generator, chooser) -> Chooser:
    if generator is not None and chooser is not None:
        raise ValueError("pass either generator or chooser, not both")
    return chooser if chooser is not None else TorchChooser(generator)


# --------------------------------------------------------------------------- chapter 1 math
def accept_prob(p_x, q_x):
    """Probability of accepting a drafted token x: min(1, p(x) / q(x)).

    q(x) = 0 cannot happen when x really was drawn from q; we still define it so the verifier
    is total: accept with probability 1 if p(x) > 0 (the limit of p/q), 0 if p(x) = 0. So a
    token with p(x) = 0 is never accepted, whatever the draft claims.

    Args:
        p_x, q_x: floats, numpy arrays or torch tensors (broadcast together).
    Returns:
        The acceptance probability, same kind as the inputs.
    """
    if torch.is_tensor(p_x) or torch.is_tensor(q_x):
        p_x, q_x = torch.as_tensor(p_x), torch.as_tensor(q_x)
        ratio = (p_x / torch.where(q_x > 0, q_x, torch.ones_like(q_x))).clamp(max=1.0)
        return torch.where(q_x > 0, ratio, (p_x > 0).to(ratio.dtype))
    if isinstance(p_x, np.ndarray) or isinstance(q_x, np.ndarray):
        p_x, q_x = np.asarray(p_x, dtype=np.float64), np.asarray(q_x, dtype=np.float64)
        ratio = np.minimum(1.0, p_x / np.where(q_x > 0, q_x, 1.0))
        return np.where(q_x > 0, ratio, (p_x > 0).astype(np.float64))
    if q_x > 0:
        return min(1.0, p_x / q_x)
    return 1.0 if p_x > 0 else 0.0


def _normalise(w: torch.Tensor) -> torch.Tensor:
    """w / w.sum(-1); rows summing to 0 are returned unchanged (all zeros)."""
    s = w.sum(-1, keepdim=True)  # [..., 1]
    return torch.where(s > 0, w / torch.where(s > 0, s, torch.ones_like(s)), w)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The distribution to sample after a rejection: norm(max(0, p - q)).

    If p == q the residual is empty (all zeros). That row is only used after a rejection,
    and with p == q every draft is accepted, so it is reached with probability 0; we return
    p itself so the result is always a valid distribution supported inside supp(p).

    Args:
        p, q: [..., V] distributions.
    Returns:
        [..., V] residual distribution.
    """
    r = (p - q).clamp(min=0)  # [..., V]
    empty = r.sum(-1, keepdim=True) <= 0  # [..., 1]
    return _normalise(torch.where(empty, p, r))


# --------------------------------------------------------------------------- input checks
def _token_list(tokens, name: str) -> list[int]:
    if torch.is_tensor(tokens):
        if tokens.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(tokens.shape)}")
        return [int(t) for t in tokens.tolist()]
    return [int(t) for t in tokens]


def _check_dist(x: torch.Tensor, name: str) -> None:
    if bool(((x >= 0).all(-1) & ((x.sum(-1, dtype=torch.float64) - 1).abs() <= 1e-3)).all()):
        return  # the fast path: one check (NaN fails >= 0); diagnose below otherwise
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} has NaN or infinite entries")
    if (x < 0).any():
        raise ValueError(f"{name} has negative entries; pass probabilities (sampling.probs), not logits")
    bad = ((x.double().sum(-1) - 1).abs() > 1e-3).nonzero()
    if len(bad):
        raise ValueError(f"{name} rows must sum to 1; row {bad[0].tolist()} does not")


def _check_rows(x, rows: Sequence[int], V: int | None, name: str) -> torch.Tensor:
    if not torch.is_tensor(x) or x.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor [rows, V], got {getattr(x, 'shape', type(x))}")
    if x.shape[0] not in rows:
        raise ValueError(f"{name} must have {' or '.join(map(str, rows))} rows, got shape {tuple(x.shape)}")
    if V is not None and x.shape[1] != V:
        raise ValueError(f"{name} has vocabulary {x.shape[1]} but p has {V}")
    return x


def _check_tokens(tokens: list[int], V: int, name: str) -> None:
    for i, t in enumerate(tokens):
        if not 0 <= t < V:
            raise ValueError(f"{name}[{i}] = {t} is outside the vocabulary [0, {V})")


def _check_mode(mode: str, q) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
    if mode in _REAL_Q_MODES and q is None:
        raise ValueError(f"mode {mode!r} needs the draft distribution q")
    return "mss_replacement" if mode == "chain" else mode


# --------------------------------------------------------------------------- chapter 1: chain
def verify_chain(draft_tokens, p: torch.Tensor, q: torch.Tensor | None = None,
                 generator: torch.Generator | None = None, greedy: bool = False, *,
                 chooser: Chooser | None = None) -> tuple[int, int]:
    """Leviathan/Chen speculative sampling of one chain of k drafts.

    For i = 0..k-1 accept draft x_i with probability min(1, p_i(x_i)/q_i(x_i)); at the first
    rejection return a token from norm(max(0, p_i - q_i)); if all k are accepted return a
    bonus token from p_k. Greedy: accept while x_i == argmax p_i, next token argmax p_n.

    Args:
        draft_tokens: [k] drafted token ids, x_i drawn from q_i.
        p: [k+1, V] target distributions; row i is the distribution of position i (given the
            context and x_0..x_{i-1}). Logits are fine when greedy.
        q: [k, V] draft distributions x_i was drawn from (unused when greedy).
        generator: torch.Generator for the random choices.
        greedy: argmax matching instead of rejection sampling.
        chooser: alternative source of random choices (see ``Chooser``); excludes generator.
    Returns:
        (n, next_token): n accepted drafts (0..k) and the token emitted after them.
    """
    xs = _token_list(draft_tokens, "draft_tokens")
    k = len(xs)
    V = _check_rows(p, [k + 1], None, "p").shape[1]
    _check_tokens(xs, V, "draft_tokens")
    if greedy:
        best = p.argmax(-1).tolist()  # [k+1]
        n = 0
        while n < k and xs[n] == best[n]:
            n += 1
        return n, best[n]
    if q is None:
        raise ValueError("verify_chain needs q unless greedy=True")
    _check_rows(q, [k, k + 1], V, "q")
    _check_dist(p, "p")
    _check_dist(q, "q")
    ch = _chooser(generator, chooser)
    p, q = p.double(), q.double()
    for i, x in enumerate(xs):
        if not ch.bernoulli(accept_prob(p[i, x].item(), q[i, x].item())):
            return i, ch.categorical(residual(p[i], q[i]))
    return k, ch.categorical(p[k])


# --------------------------------------------------------------------------- chapter 2: MSS
def sample_candidates(q: torch.Tensor, n: int, replacement: bool = True,
                      generator: torch.Generator | None = None, *,
                      chooser: Chooser | None = None) -> list[int]:
    """Draw n candidate tokens from q [V], i.i.d. or without replacement.

    Without replacement, candidate i is drawn from q with candidates 0..i-1 removed and
    renormalised; if q has fewer than n tokens in its support, only those are returned.
    """
    ch = _chooser(generator, chooser)
    q = q.double()
    out = []
    for _ in range(n):
        if not replacement and len(out):
            q = q.clone()
            q[out[-1]] = 0
            if q.sum() <= 0:
                break
        out.append(ch.categorical(q))
    return out


def _mss_replacement(xs: list[int], p: torch.Tensor, q: torch.Tensor, ch: Chooser):
    """Candidates i.i.d. from q. Each round is one Leviathan step; q never changes.

    p and q may come in float32: an acceptance reads two entries (a float32 read as a Python float is
    its float64 value exactly), and the float64 copies the residuals need are made at the first
    rejection only, so a step whose drafts are all accepted converts nothing."""
    for i, x in enumerate(xs):
        if ch.bernoulli(accept_prob(p[x].item(), q[x].item())):
            return i, x
        q = q.double()  # no copy after the first rejection
        p = residual(p.double(), q)  # [V]
    return None, ch.categorical(p)


def _mss_no_replacement(xs: list[int], p: torch.Tensor, q: torch.Tensor, ch: Chooser):
    """Candidates drawn from q without replacement: recursive rejection sampling.

    Candidate i was drawn from q_i = q with x_0..x_{i-1} removed, renormalised. Round i is
    a Leviathan step of p_i against q_i; after rejecting x_i, p_{i+1} = norm(max(0, p_i -
    q_i)) (which has p_{i+1}(x_i) = 0, as rejection implies p_i(x_i) < q_i(x_i)) and
    q_{i+1} = q_i with x_i zeroed, renormalised.
    """
    for i, x in enumerate(xs):
        if ch.bernoulli(accept_prob(p[x].item(), q[x].item())):
            return i, x
        q = q.to(torch.float64, copy=True)  # [V], one copy per rejection (zeroed below)
        p = residual(p.double(), q)  # [V]
        q[x] = 0
        q = _normalise(q)  # all zeros only if q's support ran out (cannot happen honestly)
    return None, ch.categorical(p)


def _mss_onehot(xs: list[int], p: torch.Tensor, ch: Chooser):
    """Candidate i is treated as drawn from q = one-hot(x_i) (EAGLE's code).

    Accept x_i with probability p_i(x_i); on rejection p_{i+1} = norm(max(0, p_i -
    one_hot(x_i))) = p_i with x_i zeroed, renormalised (written so, in float64: the same numbers as
    ``residual(p, one_hot(x_i))`` without building the one-hot row).
    """
    for i, x in enumerate(xs):
        if ch.bernoulli(min(1.0, p[x].item())):
            return i, x
        r = p.to(torch.float64, copy=True)  # [V]
        r[x] = 0.0
        s = r.sum()
        if s > 0:  # else residual's empty case (all of p's mass on x, so x was accepted): p stays
            p = r / s
    return None, ch.categorical(p)


def verify_candidates(candidates, p: torch.Tensor, q: torch.Tensor | None = None, *, mode: str,
                      generator: torch.Generator | None = None,
                      chooser: Chooser | None = None) -> tuple[int | None, int]:
    """Multi-round speculative sampling (MSS) of the candidate children of one node.

    Modes and what each assumes (all lossless under their assumption):
        "greedy": accept the first candidate equal to argmax p; else emit argmax p.
        "mss_replacement" (alias "chain"): candidates drawn i.i.d. from q. Round i accepts x_i
            with min(1, p(x_i)/q(x_i)); after a rejection p <- norm(max(0, p - q)), q stays.
        "mss_no_replacement": candidates drawn from q without replacement, in this order
            (``sample_candidates(q, n, replacement=False)``); recursive rejection sampling:
            after rejecting x, p <- norm(max(0, p - q)) and q <- q with x zeroed, renormalised.
            Candidates must be distinct.
        "onehot": q ignored; candidate i is treated as q = one-hot(x_i): accept with p(x_i),
            else p <- p with x_i zeroed, renormalised. Meant for deterministic drafts (top-k of
            the draft, chosen from the context only), which are distinct; it is exact
            conditional on the candidates, so it holds for any candidates chosen without
            looking at the verifier's random draws (duplicates stay exact, just wasted).
    If no candidate is accepted, the returned token is drawn from the final residual p.

    Args:
        candidates: [n] candidate token ids, in the order they are tried.
        p: [V] target distribution at the node (logits are fine for "greedy").
        q: [V] draft distribution the candidates were drawn from (real-q modes only).
        mode: one of ``MODES``.
        generator / chooser: source of the random choices.
    Returns:
        (index of the accepted candidate or None, emitted token).
    """
    mode = _check_mode(mode, q)
    xs = _token_list(candidates, "candidates")
    if not torch.is_tensor(p) or p.dim() != 1:
        raise ValueError(f"p must be a 1-D tensor [V], got {getattr(p, 'shape', type(p))}")
    _check_tokens(xs, p.shape[0], "candidates")
    if mode != "greedy":
        _check_dist(p, "p")
    if mode in _REAL_Q_MODES[1:]:
        if not torch.is_tensor(q) or q.shape != p.shape:
            raise ValueError(f"q must have p's shape {tuple(p.shape)}, got {getattr(q, 'shape', type(q))}")
        _check_dist(q, "q")
    if mode == "mss_no_replacement" and len(set(xs)) != len(xs):
        raise ValueError(f"mss_no_replacement needs distinct candidates, got {xs}")
    return _verify_node(xs, p, q, mode, _chooser(generator, chooser) if mode != "greedy" else None)


def _verify_node(xs, p, q, mode, ch):
    if mode == "greedy":
        best = int(p.argmax())
        return (xs.index(best), best) if best in xs else (None, best)
    if not xs:  # a leaf: the bonus token (``sample`` draws in float64 from any float dtype)
        return None, ch.categorical(p)
    if mode == "onehot":
        return _mss_onehot(xs, p, ch)
    if mode == "mss_replacement":
        return _mss_replacement(xs, p, q, ch)
    return _mss_no_replacement(xs, p, q, ch)


# --------------------------------------------------------------------------- trees
@dataclass
class VerifyResult:
    """Outcome of verifying one draft tree.

    path: accepted node indices, root to deepest (may be empty).
    next_token: the token emitted after the path (bonus if the path ends at a leaf,
        residual/corrected token otherwise).
    emitted: tokens committed this step: tokens[path] + [next_token].
    """

    path: list[int]
    next_token: int
    emitted: list[int] = field(default_factory=list)

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def verify_tree(tree: Tree, p: torch.Tensor, *, mode: str, generator: torch.Generator | None = None,
                chooser: Chooser | None = None, p_from_probs: bool = False,
                params: SamplingParams | None = None) -> VerifyResult:
    """Verify a whole draft tree, level by level, with ``verify_candidates`` at each node.

    Indexing convention ("row = node + 1"): the root is the last committed token; row 0 of
    p/q is the distribution at the root (for its children), row i+1 the distribution after
    node i (for node i's children, or the bonus token if node i is a leaf). The children of
    a node (``tree.children()``) are tried in increasing index order (draw order, for
    "mss_no_replacement"). A chain (``Tree.chain``) behaves exactly like ``verify_chain``
    (same outputs for the same generator state).

    The tree's shape was checked when it was built (``Tree``); here only what needs p: the
    tokens lie in the vocabulary, the rows of p and q match the nodes.

    Args:
        tree: the draft tree: tokens [N], parents [N], and q [N, V] or [N+1, V], the draft
            distributions by row (the last node is a leaf, so row N is never used and may be
            left out). Only real-q modes read q.
        p: [N+1, V] target distributions (logits fine for "greedy").
        mode: see ``verify_candidates``: "greedy", "chain" / "mss_replacement",
            "mss_no_replacement", "onehot" (``tree.verify_mode`` picks the decode loop's).
        generator / chooser: source of the random choices.
        p_from_probs: p is ``sampling.probs``'s output (the decode loop's own): its rows are not
            checked again (a check costs as much as a node's verification). q always is.
        params: p holds the target's logits instead, and a row becomes ``sampling.probs(row, params)``
            only when the walk reaches it (the decode loop's way): the walk visits at most depth + 1
            of the N + 1 rows, so a tree's other rows are never turned into distributions.
    Returns:
        VerifyResult(path, next_token, emitted).
    """
    q = tree.q
    mode = _check_mode(mode, q)
    if not torch.is_tensor(p) or p.dim() != 2:
        raise ValueError(f"p must be a 2-D tensor [N+1, V], got {getattr(p, 'shape', type(p))}")
    N, V, tok = len(tree), p.shape[1], tree.tokens
    _check_tokens(tok, V, "tokens")
    _check_rows(p, [N + 1], V, "p")
    if mode != "greedy" and not p_from_probs and params is None:
        _check_dist(p, "p")
    if mode in _REAL_Q_MODES[1:]:
        _check_rows(q, [N, N + 1], V, "q")
        _check_dist(q, "q")
    children = tree.children()  # [N + 1] by row: children[0] = the root's
    if mode == "mss_no_replacement":
        for r, kids in enumerate(children):
            xs = [tok[i] for i in kids]
            if len(set(xs)) != len(xs):
                raise ValueError(f"mss_no_replacement needs distinct siblings; row {r} has {xs}")
    ch = _chooser(generator, chooser) if mode != "greedy" else None
    path, row = [], 0
    while True:
        kids = children[row]
        qrow = q[row] if mode in _REAL_Q_MODES[1:] and kids else None
        prow = p[row] if params is None or mode == "greedy" else probs(p[row], params)  # [V]
        idx, token = _verify_node([tok[i] for i in kids], prow, qrow, mode, ch)
        if idx is None:
            return VerifyResult(path, token, [tok[i] for i in path] + [token])
        path.append(kids[idx])
        row = kids[idx] + 1


def verify_tree_lists(parents, tokens, p: torch.Tensor, q: torch.Tensor | None = None, *, mode: str,
                      generator: torch.Generator | None = None, chooser: Chooser | None = None,
                      p_from_probs: bool = False) -> VerifyResult:
    """``verify_tree`` on bare lists, chapter 2's signature: the tree ``Tree(tokens, parents, q)``.

    Args:
        parents: [N] parent index of each node, -1 for the root's children, parents[i] < i.
        tokens: [N] token id of each node.
        p, q, mode, generator, chooser, p_from_probs: as for ``verify_tree`` (q: the tree's q).
    """
    tree = Tree(_token_list(tokens, "tokens"), _token_list(parents, "parents"), q)
    return verify_tree(tree, p, mode=mode, generator=generator, chooser=chooser, p_from_probs=p_from_probs)
