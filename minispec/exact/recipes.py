"""Row recipes: how a linear layer computes its rows so that none depends on how many rows come with it.

Greedy speculative decoding is identical to vanilla decoding by construction only if the
target's logits for a token do not depend on how many tokens the forward computes: vanilla
sends one row per step, verification the root and N draft nodes. Batch-invariant inference
(He and Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025) names the two
ways a row can change with its company, and minispec closes both on the CPU:

    matrix products   a BLAS picks its kernel, and with it the order of the sums, from the
                      shape: on an AVX-512 CPU one row alone (M = 1) takes a matrix-vector
                      kernel and gets other bits than the same row among two or more. Each
                      ``minispec.exact.linear.ExactLinear`` weight shape is probed here, at the running
                      thread count, and computed by the cheapest recipe that the probe finds
                      invariant (``RowRecipe``): the product as it is; a single row padded to two
                      (the M = 1 case); the input features in two halves whose products
                      are added; rows padded to a multiple of m (MKL's AVX2 kernels compute
                      rows in blocks of 6 and a last, partial block in another order); or
                      calls of few rows padded with more rows;
    attention         a fused kernel blocks its reductions by the number of queries and keys;
                      ``minispec.exact.attention`` reduces each row over its visible keys
                      in key order, in fixed blocks of keys, hidden keys adding exact zeros,
                      with the padding its own probe finds this CPU needs.

Everything else in the forward is elementwise or reduces within one row (norms, RoPE,
activations). ``tests/test_invariance.py`` checks the whole forward on SmolLM2;
``python -m minispec check-env`` reports what holds on this machine.

Shapes: M rows, n_in / n_out features.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

PROBE_ROWS = (*range(1, 18), 24, 32, 33, 48, 64, 65, 96, 127)  # row counts compared with REF_ROWS rows
REF_ROWS = 128
PAD_CHOICES = (2, 4, 8, 16)  # row counts a call may be padded up to (the smallest that works is used)
ROW_MULTIPLES = (2, 4, 6, 8, 12, 16)  # row counts a call may be rounded up to a multiple of (a BLAS whose kernel
#                                      computes rows in blocks of m and its last, partial block another way)

Product = Callable[[torch.Tensor], torch.Tensor]  # [M, n_in] -> [M, n_out]


def varying_rows(fn: Product, n_in: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> tuple[int, ...]:
    """The row counts M at which ``fn`` gives a row other bits than among REF_ROWS rows (1 also when
    one row alone differs at another place than the first).

    Args:
        fn: the product to probe; n_in: input features; dtype, device: of the probe's input
            (seeded from its own generator: the global random stream is left alone).
    """
    g = torch.Generator().manual_seed(0)
    x = torch.randn(REF_ROWS, n_in, generator=g).to(device=device, dtype=dtype)
    with torch.no_grad():
        ref = fn(x)  # [REF_ROWS, n_out]
        varies = {m for m in PROBE_ROWS if not torch.equal(fn(x[:m]), ref[:m])}
        if any(not torch.equal(fn(x[r:r + 1]), ref[r:r + 1]) for r in (1, 2, 3)):
            varies.add(1)
    return tuple(sorted(varies))


@dataclass(frozen=True)
class RowRecipe:
    """How a linear layer computes its rows so that none depends on the row count.

    kernel: the product used ("panels": the weight panels, "f_linear", or a stand-in);
    split: 1 = one product over all input features, 2 = the input features in two halves, the two
        products added; min_rows: calls with fewer rows are padded (``pad_rows``) up to this, None if
        no recipe is invariant; varies: the row counts at which the plain product varied; multiple:
        every call's rows are padded up to a multiple of this.
    """
    kernel: str
    split: int
    min_rows: int | None
    varies: tuple[int, ...]
    multiple: int = 1

    def rows(self, m: int) -> int:
        """How many rows a call of m rows computes under this recipe (m plus the rows it is padded with)."""
        return padded_rows(m, self.min_rows or 1, self.multiple)

    @property
    def invariant(self) -> bool:
        return self.min_rows is not None

    def describe(self) -> str:
        if not self.invariant:
            return f"varies at {_rows(self.varies)} rows, no recipe found"
        if not self.varies:
            return "invariant as it is"
        how = ("input split in two halves" if self.split > 1 else
               f"rows padded to a multiple of {self.multiple}" if self.multiple > 1 else
               f"calls of fewer rows padded to {self.min_rows}")
        return f"varies at {_rows(self.varies)} rows: {how}"


def _rows(ms: tuple[int, ...]) -> str:
    return ", ".join(map(str, ms[:6])) + (", ..." if len(ms) > 6 else "")


def choose_recipe(kernel: str, fn: Product, split_fn: Product | None, n_in: int, dtype: torch.dtype,
                device: torch.device) -> RowRecipe:
    """Probe ``fn`` and, where it varies, the fallbacks in order of cost: padding one row to two (a
    second row costs almost nothing while the weights stream from memory), ``split_fn`` (the same
    product over two halves of the input features: two calls and an add), rows padded to a multiple
    of m (MKL's AVX2 kernels, for one, compute rows in blocks of 6 and a last, partial block in
    another order), then padding to the smallest row count m0 above every varying one.

    The m0 recipe needs no probe of its own (calls of m0 rows or more are computed as they are, and the
    first probe found those invariant), and it never computes more rows than a multiple-of-m recipe
    with m >= m0, so only multiples below m0 are probed; nor is a multiple m of REF_ROWS probed when
    a varying row count is itself a multiple of m (such a call is computed as it is, and varied).
    On a CPU whose kernel varies at 1, 2 and 3 rows only, that is two probes (as it is, split), not four."""
    varies = varying_rows(fn, n_in, dtype, device)
    if not varies:
        return RowRecipe(kernel, 1, 1, varies)
    m0 = next((m for m in PAD_CHOICES if all(v < m for v in varies)), None)
    if m0 == PAD_CHOICES[0]:  # only one row alone varies: two rows cost about what one does
        return RowRecipe(kernel, 1, m0, varies)
    if split_fn is not None and not varying_rows(split_fn, n_in, dtype, device):
        return RowRecipe(kernel, 2, 1, varies)
    for m in ROW_MULTIPLES:
        if m0 is not None and m >= m0:
            break  # the m0 recipe pads no more rows than this one would
        if REF_ROWS % m == 0 and any(v % m == 0 for v in varies):
            continue  # a call of v rows is computed as it is under this recipe, and it varied
        if not varying_rows(lambda x: fn(pad_rows(x, padded_rows(x.shape[0], m, m)))[:x.shape[0]], n_in, dtype, device):
            return RowRecipe(kernel, 1, m, varies, multiple=m)
    return RowRecipe(kernel, 1, m0, varies)


@torch.compiler.assume_constant_result
def threads() -> int:
    """``torch.get_num_threads()``, which a forward traced by ``torch.compile`` takes as a constant: recipes are
    keyed by the thread count, and a compiled forward keeps the count it was compiled at."""
    return torch.get_num_threads()


_RECIPES: dict[tuple, RowRecipe] = {}  # cache: (kernel, n_in, n_out, bias, dtype, device, threads) -> RowRecipe


def linear_recipe(key: tuple, fn: Product, split_fn: Product | None, n_in: int, dtype: torch.dtype,
                device: torch.device) -> RowRecipe:
    """``choose_recipe`` for one kind of linear layer, cached by ``key`` and the running thread count (a
    kernel's choice can change with the threads, so a new count is probed again on first use)."""
    full = (*key, torch.get_num_threads())
    if full not in _RECIPES:
        _RECIPES[full] = choose_recipe(key[0], fn, split_fn, n_in, dtype, device)
    return _RECIPES[full]


def recipes() -> dict[tuple, RowRecipe]:
    """Every recipe chosen in this process: (kernel, n_in, n_out, bias, dtype, device, threads) -> RowRecipe."""
    return dict(_RECIPES)


def padded_rows(m: int, min_rows: int = 1, multiple: int = 1) -> int:
    """The row count a call of m rows is padded to: at least ``min_rows``, a multiple of ``multiple``."""
    return -(-max(m, min_rows) // multiple) * multiple


def pad_rows(x: torch.Tensor, min_rows: int) -> torch.Tensor:
    """[M, n] -> [max(M, min_rows), n]: rows appended, copies of x's own (x repeated, cut to length; zero rows
    when M = 0). What they hold does not matter: under a row recipe a row's result does not depend on the other
    rows of the call, whatever they hold, and copies take one op where zero rows take two (a one-row decode
    step pads every product)."""
    m = x.shape[0]
    if m >= min_rows:
        return x
    if m == 0:
        return x.new_zeros(min_rows, x.shape[1])
    y = torch.cat([x] * -(-min_rows // m))  # [k M, n]
    return y if y.shape[0] == min_rows else y[:min_rows]
