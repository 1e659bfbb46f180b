"""Analysis: what speculation is expected to gain, from the acceptance rate and the cost of a draft.

Chapter 1's formulas, kept apart from the verifier (``minispec.verify``) that they describe: the
verifier decides what is emitted; these predict how much, and how fast.

References:
    Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative Decoding"
        (2023): acceptance rate alpha = 1 - TV(p, q), expected tokens per step (eq. 1),
        walltime speedup model (Thm 3.8).

Notation: ``p`` target distribution, ``q`` draft distribution, both [V]; ``alpha`` the
acceptance rate of one draft; ``k`` (gamma) the number of drafted tokens; ``c`` the cost of
one draft step over the cost of one target step.
"""

from __future__ import annotations

import numpy as np
import torch


def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """alpha = E_{x~q}[min(1, p(x)/q(x))] = sum_x min(p(x), q(x)) = 1 - TV(p, q). [...]"""
    return torch.minimum(p, q).sum(-1)


def _xp(*xs):
    return torch if any(torch.is_tensor(x) for x in xs) else np


def expected_tokens(alpha, k):
    """Expected tokens per target forward of a k-draft chain with i.i.d. acceptance alpha.

    E = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha), = k + 1 at alpha = 1
    (Leviathan et al. 2023, eq. 1). The bonus token is included, so k = 0 gives 1.

    Args:
        alpha: acceptance rate(s) in [0, 1]; float, numpy array or torch tensor.
        k: number of drafted tokens (>= 0), broadcast with alpha.
    Returns:
        float for scalar inputs, else an array/tensor of the broadcast shape.
    """
    xp = _xp(alpha, k)
    scalar = np.ndim(alpha) == 0 and np.ndim(k) == 0 and xp is np
    if xp is torch:
        a, kk = torch.as_tensor(alpha, dtype=torch.float64), torch.as_tensor(k, dtype=torch.float64)
    else:
        a, kk = np.asarray(alpha, dtype=np.float64), np.asarray(k, dtype=np.float64)
    if bool(xp.any(~((a >= 0) & (a <= 1)))):
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    if bool(xp.any(~(kk >= 0))):
        raise ValueError(f"k must be >= 0, got {k!r}")
    near1 = xp.abs(1 - a) < 1e-9
    safe = xp.where(near1, xp.zeros_like(a), a)
    closed = (1 - safe ** (kk + 1)) / (1 - safe)
    series = (kk + 1) - (1 - a) * kk * (kk + 1) / 2  # first-order expansion at alpha = 1
    out = xp.where(near1, series, closed)
    return float(out) if scalar else out


def speedup(alpha, k, c):
    """Walltime speedup model of Leviathan et al. (2023, Thm 3.8).

    speedup = expected_tokens(alpha, k) / (k * c + 1), with c = (cost of one draft step) /
    (cost of one target step). Ignores verification overhead beyond one target forward.

    Args:
        alpha, k, c: floats, numpy arrays or torch tensors (broadcast); c >= 0.
    Returns:
        float for scalar inputs, else an array/tensor.
    """
    xp = _xp(alpha, k, c)
    cc = torch.as_tensor(c, dtype=torch.float64) if xp is torch else np.asarray(c, dtype=np.float64)
    if bool(xp.any(~(cc >= 0))):
        raise ValueError(f"c (draft/target cost ratio) must be >= 0, got {c!r}")
    kk = torch.as_tensor(k, dtype=torch.float64) if xp is torch else np.asarray(k, dtype=np.float64)
    out = expected_tokens(alpha, k) / (kk * cc + 1)
    return float(out) if xp is np and np.ndim(out) == 0 else out
