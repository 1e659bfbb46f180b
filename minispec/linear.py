"""A linear layer whose CPU inference reads a weight prepacked once for oneDNN, and whose rows do
not depend on how many rows are computed.

Why: decoding a small model on a CPU is a stream of matrix-vector products, one weight matrix
after another. ``F.linear`` hands each one to a BLAS that repacks the weight into its blocked
layout on every call, and switches to a different kernel (with a different summation order)
depending on how many rows come in. Verification of N draft tokens sends N + 1 rows through the
same weights, so both effects matter for speculative decoding:

    cost        with the weight already in oneDNN's blocked layout, N + 1 rows read the weights
                once, as one row does: up to N of roughly 8 the forward stays near the
                memory-bandwidth floor instead of doubling (see ``python -m minispec profile``);
    invariance  row i of a forward over N + 1 tokens must equal, bit for bit, what a forward of
                that row alone gives, so that greedy verification compares exactly the logits
                vanilla decoding would have computed and no argmax near-tie can flip. The packed
                kernel keeps each output element's summation order for most shapes and row
                counts, but not all on every CPU (on an AVX-512 machine the 1536 -> 576 product
                computes one row alone in another order). So each kind of layer is probed once
                per thread count and computed by the cheapest plan found invariant
                (``minispec.invariance.RowPlan``): as it is, its input features in two halves,
                or few rows padded with zero rows.

This is the path torch.compile's CPU weight freezing takes (``torch.ops.mkldnn``
``_reorder_linear_weight`` + ``_linear_pointwise``), taken here by hand so the model stays
plain eager PyTorch. Training (autograd), other dtypes and other devices use ``F.linear``
(probed and planned the same way on the CPU; not under autograd, and not on a GPU, where
minispec claims no row invariance).

Shapes: [..., in] -> [..., out].
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .invariance import RowPlan, linear_plan, pad_rows

_MKLDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state_dict) with a prepacked-weight CPU inference path
    whose rows do not depend on the row count.

    ``Linear.prepack = False`` switches every instance back to ``F.linear`` (for before/after
    measurements); ``Linear.row_invariant = False`` computes every call as it is, whatever the
    probe found (to show what the plans prevent). Packed copies are rebuilt when the weight
    changes (in place or replaced).
    """

    prepack: bool = True
    row_invariant: bool = True

    def _use_packed(self, x: torch.Tensor) -> bool:
        w = self.weight
        return (Linear.prepack and _MKLDNN and w.device.type == "cpu" and w.dtype == x.dtype == torch.float32
                and not (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)))

    def _part(self, part: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, bias) of the whole layer (None) or of the first / second half of its inputs (0 / 1;
        the bias goes with the first)."""
        if part is None:
            return self.weight, self.bias
        h = self.in_features // 2
        return (self.weight[:, :h], self.bias) if part == 0 else (self.weight[:, h:], None)

    def packed_weight(self, part: int | None = None) -> torch.Tensor:
        """The oneDNN-blocked copy of ``weight`` (or of its input half ``part``), built on first use and
        after any change to the weight."""
        w = self.weight
        key = (w.data_ptr(), w._version, tuple(w.shape))
        cache = self.__dict__.setdefault("_packed_parts", {})
        if cache.get(part, (None,))[0] != key:
            with torch.no_grad():
                cache[part] = (key, torch.ops.mkldnn._reorder_linear_weight(self._part(part)[0].detach().contiguous(),
                                                                            None))
        return cache[part][1]

    def kernel(self, x: torch.Tensor) -> str:
        """The product that computes ``x``: "packed" (the oneDNN prepacked weight) or "f_linear"."""
        return "packed" if self._use_packed(x) else "f_linear"

    def _product(self, kernel: str, x: torch.Tensor, part: int | None = None) -> torch.Tensor:
        """``kernel``'s product of x [..., in (or its half)] with the whole weight or the half ``part``."""
        w, b = self._part(part)
        if kernel == "packed":
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight(part), b, "none", [], "")
        return F.linear(x, w, b)

    def _split_product(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        h = self.in_features // 2
        return self._product(kernel, x[..., :h], 0) + self._product(kernel, x[..., h:], 1)

    def row_plan(self, x: torch.Tensor) -> RowPlan | None:
        """The plan that keeps this layer's rows independent of the row count for inputs like ``x``, at
        the running thread count (probed on first use, ``minispec.invariance``); None where no
        invariance is kept (autograd, a GPU)."""
        if self.weight.device.type != "cpu" or (torch.is_grad_enabled() and (self.weight.requires_grad or
                                                                             x.requires_grad)):
            return None
        kernel = self.kernel(x)
        key = (kernel, self.in_features, self.out_features, self.bias is not None, x.dtype, x.device.type,
               type(self)._product)  # the function itself: a stand-in product (tests) is probed anew
        split = (lambda x2: self._split_product(kernel, x2)) if self.in_features >= 2 else None
        return linear_plan(key, lambda x2: self._product(kernel, x2), split, self.in_features, x.dtype, x.device)

    def _plan(self, x: torch.Tensor) -> tuple[str, int, int]:
        """(kernel, split, min_rows) for ``x``, remembered per kernel, dtype, grad mode and thread count."""
        key = (self._use_packed(x), x.dtype, x.device.type, torch.is_grad_enabled(), x.requires_grad,
               torch.get_num_threads(), Linear.row_invariant)
        if self.__dict__.get("_plan_key") != key:
            plan = self.row_plan(x) if Linear.row_invariant else None
            self._plan_value = (self.kernel(x), 1, 1) if plan is None or not plan.invariant else \
                (plan.kernel, plan.split, plan.min_rows)
            self._plan_key = key
        return self._plan_value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel, split, need = self._plan(x)
        if split > 1:
            return self._split_product(kernel, x)
        if need > 1 and x.numel() < need * self.in_features:  # fewer rows than the kernel keeps invariant
            x2 = x.reshape(-1, self.in_features)  # [M, in]
            return self._product(kernel, pad_rows(x2, need))[:x2.shape[0]].reshape(*x.shape[:-1], self.out_features)
        return self._product(kernel, x)


@torch.no_grad()
def prepack(module: nn.Module) -> nn.Module:
    """Pack the weight of every ``Linear`` in ``module`` and choose its row plan at the running thread
    count now rather than on its first forward, so that the first timed generation pays for neither.
    Returns ``module``."""
    for m in module.modules():
        if isinstance(m, Linear) and m.weight.device.type == "cpu":
            x = m.weight.new_empty(1, m.in_features)  # stands for an input of the weight's dtype
            kernel, split, _ = m._plan(x)
            if kernel == "packed":
                for part in ((None,) if split == 1 else (0, 1)):
                    m.packed_weight(part)
    return module
