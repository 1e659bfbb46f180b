"""Chapter 9 exercises: the roofline of a decode step, the oracle's tau, and where speculation stops paying.

A decode step of a Llama-shaped model reads every weight of its linear layers once, whatever the
number of rows it computes, and the keys and values of every cached token of every sequence; it
computes, per row, a multiply-add per weight and attention over the cached tokens. The roofline
(Williams, Waterman, Patterson 2009) bounds its time by the longer of the two: the bytes over the
memory bandwidth, the FLOPs over the peak rate. Speculation adds N rows per sequence to a forward
and commits tau tokens per forward: it pays while the extra rows are (nearly) free.

The configuration ``cfg`` is a ``minispec.model.ModelConfig`` of the Llama family (no biases,
SwiGLU MLP) with the fields ``vocab_size``, ``n_layer``, ``n_head``, ``n_kv_head`` (grouped-query
attention: the KV heads, ``n_head`` a multiple of it), ``head_dim``, ``d_model``, ``d_ff`` and
``tie_embeddings``. In minispec's model a layer multiplies by the q, k and v projections (one
fused ``wqkv``: d_model inputs, a head_dim-wide output per query head and per key and value head)
and the output projection ``wo`` (head_dim per query head in, d_model out), then the MLP's gate
and up (``gate_up``: d_model in, d_ff each out) and ``down`` (d_ff in, d_model out); after the last
layer the LM head maps d_model to vocab_size. The embedding table is read one row per token and
counted nowhere; the norms' weights are negligible and not counted. The library's versions are in
``minispec.lab.scale`` and ``minispec.lab.oracle``.

Units: bytes, seconds, bytes/s (``bandwidth``), FLOP/s (``peak``).

References:
    Williams, Waterman, Patterson, "Roofline: An Insightful Visual Performance Model for
        Multicore Architectures" (CACM 2009).
    Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative Decoding" (2023):
        expected tokens per step with an i.i.d. acceptance rate.
    Chen et al., "MagicDec: Breaking the Latency-Throughput Tradeoff for Long Context Generation
        with Speculative Decoding" (2024): at long contexts the KV reads keep speculation paying.

Check your work: ``python -m minispec grade 9``, or ``minispec.grading.check("9.1")``, or
``pytest tests/test_exercises.py -m ch09 --impl exercises``.
"""

from __future__ import annotations

import torch


def step_bytes(cfg, batch: int, context: int, dtype: torch.dtype) -> int:
    """Bytes one decode forward reads from memory, all in ``dtype``: the weights it reads and the KV cache
    of ``batch`` sequences of ``context`` cached tokens each.

    Questions to answer before coding: which weights does a forward read once whatever its number of
    rows, and what are their shapes (the module docstring lists the layers)? Is a tied LM head read?
    What does each cached token keep, in each layer, with grouped-query attention? Embeddings, norms
    and activations are not counted.

    Args:
        cfg: a Llama-family ``ModelConfig``.
        batch: sequences in the forward (>= 1).
        context: cached tokens per sequence (>= 0).
        dtype: the weights' and the cache's dtype (a torch floating dtype).
    Returns:
        Bytes, an int.
    """
    # EXERCISE 9.1: weight bytes of one forward (every linear layer, the LM head too) plus the KV cache it reads
    # BEGIN SOLUTION
    size = torch.finfo(dtype).bits // 8
    H, Hkv, hd, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.d_model
    per_layer = D * (H + 2 * Hkv) * hd + H * hd * D + 3 * D * cfg.d_ff  # wqkv, wo, gate_up + down
    weights = cfg.n_layer * per_layer + cfg.vocab_size * D  # + the LM head
    kv = 2 * cfg.n_layer * Hkv * hd * batch * context  # a key and a value per layer, KV head, token
    return (weights + kv) * size
    # END SOLUTION


def roofline_step_s(cfg, batch: int, new_tokens: int, context: int, dtype: torch.dtype, bandwidth: float,
                    peak: float) -> float:
    """The roofline's lower bound on the seconds of one forward of ``new_tokens`` rows for each of
    ``batch`` sequences after ``context`` cached tokens.

    The forward cannot be faster than reading its bytes (your ``step_bytes``) at ``bandwidth``, nor
    than doing its arithmetic at ``peak`` (the notebook's roofline). Its arithmetic is every row's:
    the linear layers' products and attention over the ``context`` cached tokens (the new tokens'
    attention to one another is left out); every one of the batch x new_tokens rows costs the same.
    Questions to answer before coding: how many FLOPs does a row spend per weight? Which two
    products of attention grow with the context, in which layers and over which heads (query or
    KV heads)?

    Args:
        cfg, batch, context, dtype: as in ``step_bytes``.
        new_tokens: rows per sequence (1 for vanilla decoding, N + 1 to verify N draft tokens).
        bandwidth: memory bandwidth, bytes/s.
        peak: arithmetic peak, FLOP/s.
    Returns:
        Seconds, a float.
    """
    # EXERCISE 9.2: the slower of moving step_bytes and computing every row's FLOPs (linear layers + attention)
    # BEGIN SOLUTION
    size = torch.finfo(dtype).bits // 8
    weights = step_bytes(cfg, 1, 0, dtype) // size  # linear weights: multiply-adds per row
    per_row = 2 * weights + 4 * cfg.n_layer * cfg.n_head * cfg.head_dim * context
    return max(step_bytes(cfg, batch, context, dtype) / bandwidth, batch * new_tokens * per_row / peak)
    # END SOLUTION


def corruption_for_tau(tau: float, k: int) -> float:
    """The corruption rate p at which the oracle drafter of depth k promises ``tau`` tokens per forward.

    The oracle drafts the target's own next k tokens, each replaced, independently with
    probability p, by a wrong one; greedy verification accepts the drafts up to the first wrong
    one and adds the target's own token, so tokens per forward range from k + 1 (p = 0) down to 1
    (p = 1). ``minispec.lab.oracle.expected_tau(p, k)`` gives the promise for a p; return the
    p that gives ``tau``, to within 1e-9 in tau. The promise falls as p grows (strictly), so there
    is exactly one.

    Args:
        tau: the wanted tokens per forward, 1 <= tau <= k + 1.
        k: draft depth, >= 1.
    Returns:
        p in [0, 1], a float.
    Raises:
        ValueError: for k < 1 or tau outside [1, k + 1].
    """
    # EXERCISE 9.3: invert the oracle's promise: solve for p (it is monotone in p)
    # BEGIN SOLUTION
    if k < 1 or not 1 <= tau <= k + 1:
        raise ValueError(f"need k >= 1 and 1 <= tau <= k + 1, got tau={tau}, k={k}")

    def promise(p):
        return sum((1 - p) ** i for i in range(k + 1))

    lo, hi = 0.0, 1.0
    for _ in range(100):  # bisection: the interval halves each time
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if promise(mid) > tau else (lo, mid)
    return (lo + hi) / 2
    # END SOLUTION


def crossover_batch(cfg, nodes: int, tau: float, context: int, dtype: torch.dtype, bandwidth: float, peak: float,
                    max_batch: int = 4096) -> int | None:
    """The smallest batch at which speculation stops paying, on the roofline.

    Every sequence of the batch verifies ``nodes`` draft tokens per forward (so that forward has
    nodes + 1 rows per sequence) and commits ``tau`` tokens; vanilla decoding of the same batch
    runs forwards of one row per sequence and commits one token. Drafting is free (an oracle).
    Using your ``roofline_step_s``, find the smallest B in 1..max_batch at which speculation is
    slower than vanilla decoding, or None if it never is up to max_batch. Question to answer
    before coding: what is each one's speed in tokens per second at batch B?

    Args:
        cfg, context, dtype, bandwidth, peak: as in ``roofline_step_s``.
        nodes: draft tokens verified per sequence and forward (>= 1).
        tau: tokens committed per sequence and forward, 1 <= tau <= nodes + 1.
        max_batch: the largest batch to try.
    Returns:
        The batch size (int), or None.
    """
    # EXERCISE 9.4: speculation's roofline speedup as the batch grows; the first batch where it is below 1
    # BEGIN SOLUTION
    for b in range(1, max_batch + 1):
        vanilla = roofline_step_s(cfg, b, 1, context, dtype, bandwidth, peak)
        spec = roofline_step_s(cfg, b, nodes + 1, context, dtype, bandwidth, peak)
        if tau * vanilla / spec < 1:
            return b
    return None
    # END SOLUTION
