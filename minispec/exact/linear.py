"""The exact backend's linear layer: ``nn.Linear`` whose CPU rows do not depend on how many rows are
computed, on a prepacked weight that streams from memory as contiguous panels.

Why: decoding a small model on a CPU is a stream of matrix-vector products, one weight matrix after
another. Verification of N draft tokens sends N + 1 rows through the same weights, so two things matter:

    cost        N + 1 rows should read the weights once, as one row does: then up to N of roughly 8
                the forward stays near the memory-bandwidth floor instead of growing with N (see
                ``python -m minispec profile``);
    invariance  row i of a forward over N + 1 tokens must equal, bit for bit, what a forward of that row
                alone gives, so that greedy verification compares exactly the logits vanilla decoding
                would have computed and no argmax near-tie can flip.

``F.linear`` gives neither on the CPU: its BLAS switches kernel (and summation order) with the row count,
and each kernel reads the weight differently. Two prepacked kernels do better:

    panels  the weight W [out, in] copied once into panels of PANEL output features,
            ``Wp[p] = W[p*PANEL:(p+1)*PANEL].T`` of shape [P, in, PANEL], each contiguous (in 2 MiB pages,
            ``minispec.exact.hugepages``), and a call is one batched product
                y[:, p*PANEL:(p+1)*PANEL] = x @ Wp[p]          x [M, in] shared by every panel (no copy)
            Both operands are row-major and the sum over the input features runs along the rows of a panel,
            so each output element is accumulated over ``in`` in the same order whatever M is;
    onednn  oneDNN's own prepacked weight layout (``torch.ops.mkldnn._linear_pointwise``).

No CPU is trusted blindly: each kind of layer is probed once per kernel and thread count and computed by the
cheapest recipe found invariant (``minispec.exact.recipes.RowRecipe``): as it is, its input features in two halves,
or its rows padded. Which kernel runs ("auto") and how far a one-row call is padded come from this machine's
saved choice (``minispec.exact.kernels``), never from a timing here. ``ExactLinear.cpu_kernel`` (or
``MINISPEC_LINEAR_KERNEL=auto|panels|onednn`` set before import) names one for every layer; "onednn" falls
back to the panels where this PyTorch has no oneDNN.

Training (autograd), other dtypes and other devices use ``F.linear`` (probed the same way on the
CPU; not under autograd, and not on a GPU, where minispec claims no row invariance).

Shapes: [..., in] -> [..., out]; M rows; P = ceil(out / PANEL) panels.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from .hugepages import huge_page_empty
from .kernels import CPU_KERNELS, chosen_kernel, chosen_pad, onednn_available
from .recipes import RowRecipe, linear_recipe, pad_rows, padded_rows

PANEL = 32  # output features per weight panel (32 floats: two AVX-512 or four AVX2 registers per row)
KERNEL_CHOICES = ("auto", *CPU_KERNELS)  # what ``ExactLinear.cpu_kernel`` may name ("auto": this machine's choice)


def _kernel_from_env() -> str:
    name = os.environ.get("MINISPEC_LINEAR_KERNEL", "auto").strip() or "auto"
    if name not in KERNEL_CHOICES:
        raise ValueError(f"MINISPEC_LINEAR_KERNEL must be one of {', '.join(KERNEL_CHOICES)}, got {name!r}")
    return name


def panels(w: torch.Tensor, width: int = PANEL) -> torch.Tensor:
    """[out, in] -> [P, in, width]: panel p holds ``w[p*width:(p+1)*width].T``, contiguous; the last one is
    zero-padded to ``width`` output features. On the CPU, in huge pages (``huge_page_empty``)."""
    (n_out, n_in), P = w.shape, -(-w.shape[0] // width)
    shape = (P, n_in, width)
    wp = huge_page_empty(shape, w.dtype) if w.device.type == "cpu" else w.new_empty(shape)
    full = n_out // width  # whole panels, copied straight from w: no padded copy of w in between
    wp[:full].copy_(w[:full * width].view(full, width, n_in).transpose(1, 2))  # [full, in, width]
    if full < P:  # the last panel: its rows of w, then zeros
        wp[full, :, :n_out - full * width].copy_(w[full * width:].T)
        wp[full, :, n_out - full * width:].zero_()
    return wp


class ExactLinear(nn.Linear):
    """``nn.Linear`` (same parameters, same state_dict) whose CPU float32 inference runs a prepacked kernel
    under a row recipe: its rows do not depend on the row count. ``minispec.exact.apply`` turns a model's
    ``nn.Linear`` layers into these in place.

    ``ExactLinear.prepack = False`` switches every instance back to ``F.linear`` (for before/after
    measurements); ``ExactLinear.row_invariant = False`` computes every call as it is, whatever the probe
    found (to show what the recipes prevent); ``ExactLinear.cpu_kernel`` names the prepacked kernel ("auto":
    this machine's saved choice, ``minispec.exact.kernels``; "panels" or "onednn"). Prepacked copies are
    rebuilt when the weight changes (in place or replaced).

    Under ``torch.compile`` a layer that has run eagerly (or been prepacked) traces without a graph break,
    with the row recipe and prepacked copy of its last eager call (compile again after changing weights,
    dtype or threads); one that has not breaks the graph where it chooses them.
    """

    prepack: bool = True
    row_invariant: bool = True
    cpu_kernel: str = _kernel_from_env()

    PREPACKED = ("_panel_parts", "_onednn_parts")  # the caches ``_packed`` fills

    def __getstate__(self) -> dict:
        """Pickled and deep-copied without the prepacked copies (rebuilt on first use): oneDNN's are opaque
        tensors, which neither ``copy.deepcopy`` nor pickle can read."""
        return {k: v for k, v in self.__dict__.items() if k not in self.PREPACKED}

    def _use_panels(self, x: torch.Tensor) -> bool:
        """Whether ``x`` takes a prepacked CPU kernel (the panels or oneDNN's), not ``F.linear``."""
        w = self.weight
        return (ExactLinear.prepack and w.device.type == "cpu" and w.dtype == x.dtype == torch.float32
                and not (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)))

    def _part(self, part: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, bias) of the whole layer (None) or of the first / second half of its inputs (0 / 1;
        the bias goes with the first)."""
        if part is None:
            return self.weight, self.bias
        h = self.in_features // 2
        return (self.weight[:, :h], self.bias) if part == 0 else (self.weight[:, h:], None)

    def _packed(self, name: str, part: int | None, build) -> torch.Tensor:
        """``build(w)`` of the weight w [out, in'] (or of its input half ``part``), cached under ``name``
        and rebuilt on first use and after any change to the weight (in place or replaced)."""
        if torch.compiler.is_compiling() and part in self.__dict__.get(name, {}):  # traced by torch.compile, which
            return self.__dict__[name][part][1]  # cannot read a data pointer: the copy an eager call built
        w = self.weight
        key = (w.data_ptr(), w._version, tuple(w.shape))
        cache = self.__dict__.setdefault(name, {})
        if cache.get(part, (None,))[0] != key:
            with torch.no_grad():
                cache[part] = (key, build(self._part(part)[0].detach()))
        return cache[part][1]

    def panel_weight(self, part: int | None = None) -> torch.Tensor:
        """[P, in (or its half), PANEL]: the panels of ``weight`` (or of its input half ``part``),
        zero-padded to whole panels."""
        return self._packed("_panel_parts", part, panels)

    def onednn_weight(self, part: int | None = None) -> torch.Tensor:
        """oneDNN's prepacked copy of ``weight`` (or of its input half ``part``)."""
        return self._packed("_onednn_parts", part,
                            lambda wp: torch.ops.mkldnn._reorder_linear_weight(wp.contiguous(), None))

    def kernel(self, x: torch.Tensor) -> str:
        """The product that computes ``x``: "panels" (the weight panels, one batched product), "onednn"
        (oneDNN's prepacked weight; ``ExactLinear.cpu_kernel``) or "f_linear"."""
        if not self._use_panels(x):
            return "f_linear"
        name = ExactLinear.cpu_kernel
        if name == "auto":
            name = chosen_kernel()
        return "onednn" if name == "onednn" and onednn_available() else "panels"

    def _product(self, kernel: str, x: torch.Tensor, part: int | None = None, rows: int | None = None) -> torch.Tensor:
        """``kernel``'s product of x [M, in (or its half)] with the whole weight or the half ``part`` -> [rows, out]:
        the first ``rows`` rows of the result (default all M; fewer drop the rows a recipe padded x with). Kept to
        few ops (views included): a one-row decode step makes this call 121 times on SmolLM2."""
        m = x.shape[0] if rows is None else rows
        if kernel == "panels":
            wp = self.panel_weight(part)  # [P, in', PANEL]
            y = torch.bmm(x.as_strided((wp.shape[0], *x.shape), (0, *x.stride())), wp)  # [P, M, PANEL]: every panel
            #                                             reads the same x (x expanded over P: one view op, not two)
            if m == 1:  # one row: panel by panel its PANEL outputs, as one row (a copy where rows were padded)
                y = (y if y.shape[1] == 1 else y.narrow_copy(1, 0, 1)).view(1, -1)  # [1, P * PANEL]
            else:
                y = y[:, :m].transpose(0, 1).reshape(m, -1)  # [m, P * PANEL]
            if y.shape[1] != self.out_features:
                y = y[:, :self.out_features]  # [m, out]: the zero rows of the last panel dropped
            b = self.bias if part != 1 else None  # the bias goes with the first half
            return y if b is None else y + b
        w, b = self._part(part)
        if kernel == "onednn":
            y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.onednn_weight(part), b, "none", [], "")
        else:
            y = F.linear(x, w, b)
        return y if m == x.shape[0] else y.as_strided((m, y.shape[1]), y.stride())  # y[:m] in one view op

    def _split_product(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        h = self.in_features // 2
        return self._product(kernel, x[:, :h], 0) + self._product(kernel, x[:, h:], 1)

    def row_recipe(self, x: torch.Tensor, kernel: str | None = None) -> RowRecipe | None:
        """The recipe that keeps this layer's rows independent of the row count for inputs like ``x``, at
        the running thread count (probed on first use, ``minispec.exact.recipes``), for ``kernel`` (default:
        the one ``x`` takes); None where no invariance is kept (autograd, a GPU)."""
        if self.weight.device.type != "cpu" or (torch.is_grad_enabled() and (self.weight.requires_grad or
                                                                             x.requires_grad)):
            return None
        kernel = kernel or self.kernel(x)
        key = (kernel, self.in_features, self.out_features, self.bias is not None, x.dtype, x.device.type,
               type(self)._product)  # the function itself: a stand-in product (tests) is probed anew
        split = (lambda x2: self._split_product(kernel, x2)) if self.in_features >= 2 else None
        return linear_recipe(key, lambda x2: self._product(kernel, x2), split, self.in_features, x.dtype, x.device)

    def _recipe(self, x: torch.Tensor) -> tuple[str, int, int, int]:
        """(kernel, split, min_rows, multiple) for ``x``, remembered per kernel, dtype, grad mode and thread count.
        Under "auto", calls of fewer rows than this machine's saved ``pad_rows`` for the kernel are padded up to
        it (``minispec.exact.kernels.chosen_pad``): a kernel whose rows do not depend on the row count gives them
        the same bits in a call of more rows, and may give them sooner."""
        key = (self._use_panels(x), x.dtype, x.device.type, torch.is_grad_enabled(), x.requires_grad,
               torch.get_num_threads(), ExactLinear.row_invariant, ExactLinear.cpu_kernel)
        if self.__dict__.get("_recipe_key") != key:
            recipe = self.row_recipe(x) if ExactLinear.row_invariant else None
            if recipe is None or not recipe.invariant:
                self._recipe_value = (self.kernel(x), 1, 1, 1)
            else:
                pad = chosen_pad(recipe.kernel) if ExactLinear.cpu_kernel == "auto" and recipe.kernel in CPU_KERNELS else 1
                self._recipe_value = (recipe.kernel, recipe.split, max(recipe.min_rows, pad), recipe.multiple)
            self._recipe_key = key
        return self._recipe_value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and "_recipe_value" in self.__dict__:  # traced by torch.compile: the recipe the
            return self.run(x, *self._recipe_value)  # last eager call chose (a probe runs products, which a trace cannot)
        return self.run(x, *self._recipe(x))

    def run(self, x: torch.Tensor, kernel: str, split: int = 1, min_rows: int = 1, multiple: int = 1) -> torch.Tensor:
        """``kernel``'s product of ``x`` [..., in] under a row recipe (``forward`` runs this layer's own)."""
        shape = x.shape
        x2 = x if x.dim() == 2 else x.view(-1, shape[-1]) if x.is_contiguous() else x.reshape(-1, shape[-1])  # [M, in]
        m = x2.shape[0]
        if split > 1:  # the input features in two halves, the products added
            y = self._split_product(kernel, x2)  # [M, out]
        elif (m_ := padded_rows(m, min_rows, multiple)) > m:  # rows the kernel does not keep invariant: pad the
            y = self._product(kernel, pad_rows(x2, m_), rows=m)  # call (``pad_rows``), keep the first m rows
        else:
            y = self._product(kernel, x2)
        return y if len(shape) == 2 else y.view(*shape[:-1], self.out_features)


@torch.no_grad()
def prepack(module: nn.Module) -> nn.Module:
    """Build the prepacked weights (``ExactLinear.cpu_kernel``'s) of every ``ExactLinear`` in ``module`` and
    choose its row recipe at the running thread count now rather than on its first forward, so that the first
    timed generation pays for neither. Returns ``module``."""
    for m in module.modules():
        if isinstance(m, ExactLinear) and m.weight.device.type == "cpu":
            x = m.weight.new_empty(1, m.in_features)  # stands for an input of the weight's dtype
            kernel, split, _, _ = m._recipe(x)
            if kernel in CPU_KERNELS:
                for part in ((None,) if split == 1 else (0, 1)):
                    (m.panel_weight if kernel == "panels" else m.onednn_weight)(part)
    return module
