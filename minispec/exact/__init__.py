"""The exact CPU backend: one call that makes a model's rows independent of their company, so that greedy
speculative decoding gives vanilla decoding's tokens bit for bit.

    model = minispec.exact.apply(model)      # what load() does for a CPU float32 model

What it guarantees. On the CPU, in float32 inference, a row of a forward (one token's logits and hidden
state) has the same bits whatever rows and keys come with it: the one row of a vanilla decode step, the
root and N draft nodes of a verification, a chain or a tree, one sequence or a ragged batch, on a
contiguous, paged or static cache. Greedy verification then compares exactly the logits vanilla decoding
computes, so no argmax near-tie can flip and speculative greedy output equals target greedy output bit
for bit. (Off the CPU, in other dtypes or under autograd the layers compute as plain ones do, and nothing
is claimed.)

Why it is needed. Batch-invariant inference (He and Thinking Machines, "Defeating Nondeterminism in LLM
Inference", 2025) names the two ways a row can change with its company, and this package closes both:

    matrix products   a BLAS picks its kernel, and with it the order of the sums, from the shape (one row
                      alone takes a matrix-vector kernel). Every ``nn.Linear`` becomes an ``ExactLinear``
                      (``linear.py``): the same parameters on a prepacked CPU kernel (weight panels or
                      oneDNN's layout), computed under a row recipe (``recipes.py``);
    attention         a fused kernel blocks its reductions by the number of queries and keys. The model's
                      attention backend becomes "exact" (``attention.py``): each row reduces over its
                      visible keys in key order, in fixed blocks of keys, hidden keys adding exact zeros.

How it is probed. Nothing about a CPU is assumed: each kind of linear layer is probed once per kernel and
thread count (random rows at 1 to 127 rows against 128, compared bit for bit) and computed by the cheapest
recipe found invariant (as it is, its input features in two halves, or its rows padded); the attention is
probed once per head dim and thread count (causal blocks and a tree after prefixes of 0 to 517 keys, in
three batch layouts) for the padding this CPU's BLAS needs. Probes compare bits and never time anything;
which prepacked kernel runs comes from this machine's saved choice or a documented default
(``kernels.py``). ``tests/test_invariance.py`` checks the whole SmolLM2 forward;
``python -m minispec check-env`` reports the recipes found on this machine.
"""

from __future__ import annotations

import torch.nn as nn

from .attention import exact_attention, invariant_attention  # registers the "exact" attention backend
from .linear import ExactLinear, prepack

__all__ = ["apply", "applied", "follow", "exact_attention", "invariant_attention", "ExactLinear", "prepack"]


def apply(module: nn.Module) -> nn.Module:
    """Swap the exact backend into ``module`` in place and return it: every ``nn.Linear`` in it becomes an
    ``ExactLinear`` (the same parameters and state_dict; on the CPU its prepacked weights are built and its row
    recipe chosen now, not on the first forward), and every part that names an attention backend (a
    ``Transformer``, an EAGLE head: an ``attention`` attribute) runs "exact". Works on a model built in code
    (``Transformer(cfg)``, a drafter's head) as on a loaded one."""
    for m in module.modules():
        if type(m) is nn.Linear:
            m.__class__ = ExactLinear  # a subclass that adds no state: the same module, other forward
        if isinstance(getattr(m, "attention", None), str):
            m.attention = "exact"
    return prepack(module)


def applied(module: nn.Module) -> bool:
    """Whether ``module``'s attention runs the exact backend (``apply`` sets it)."""
    return getattr(module, "attention", None) == "exact"


def follow(target: nn.Module, *modules: nn.Module) -> None:
    """Apply the exact backend to ``modules`` (a drafter's own layers) where ``target`` runs it, so that a
    draft computes as its target does."""
    if applied(target):
        for m in modules:
            apply(m)
