"""A linear layer whose CPU inference reads a weight prepacked once for oneDNN.

Why: decoding a small model on a CPU is a stream of matrix-vector products, one weight matrix
after another. ``F.linear`` hands each one to a BLAS that repacks the weight into its blocked
layout on every call, and switches to a different kernel (with a different summation order)
depending on how many rows come in. Verification of N draft tokens sends N + 1 rows through the
same weights, so both effects matter for speculative decoding:

    cost        with the weight already in oneDNN's blocked layout, N + 1 rows read the weights
                once, as one row does: up to N of roughly 8 the forward stays near the
                memory-bandwidth floor instead of doubling (see ``python -m minispec profile``);
    invariance  the packed kernel reduces each output element in the same order whatever the
                row count, so row i of a forward over N + 1 tokens equals, bit for bit, what a
                forward of that row alone gives. Greedy verification then compares exactly the
                logits vanilla decoding would have computed, and no argmax near-tie can flip.

This is the path torch.compile's CPU weight freezing takes (``torch.ops.mkldnn``
``_reorder_linear_weight`` + ``_linear_pointwise``), taken here by hand so the model stays
plain eager PyTorch. Training (autograd), other dtypes and other devices use ``F.linear``.

Shapes: [..., in] -> [..., out].
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

_MKLDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state_dict) with a prepacked-weight CPU inference path.

    ``Linear.prepack = False`` switches every instance back to ``F.linear`` (for before/after
    measurements). The packed copy is rebuilt when the weight changes (in place or replaced).
    """

    prepack: bool = True

    def _use_packed(self, x: torch.Tensor) -> bool:
        w = self.weight
        return (Linear.prepack and _MKLDNN and w.device.type == "cpu" and w.dtype == x.dtype == torch.float32
                and not (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)))

    def packed_weight(self) -> torch.Tensor:
        """The oneDNN-blocked copy of ``weight``, built on first use and after any change to it."""
        w = self.weight
        key = (w.data_ptr(), w._version, tuple(w.shape))
        if getattr(self, "_packed_key", None) != key:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
            self._packed_key = key
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._use_packed(x):
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight(), self.bias, "none", [], "")


@torch.no_grad()
def prepack(module: nn.Module) -> nn.Module:
    """Pack the weight of every ``Linear`` in ``module`` now rather than on its first forward, so that
    the first timed generation does not pay for it. Returns ``module``."""
    for m in module.modules():
        if isinstance(m, Linear) and m._use_packed(m.weight.detach()):
            m.packed_weight()
    return module
