"""A linear layer whose CPU inference reads its weight as contiguous panels, and whose rows do
not depend on how many rows are computed.

Why: decoding a small model on a CPU is a stream of matrix-vector products, one weight matrix
after another. Verification of N draft tokens sends N + 1 rows through the same weights, so two
things matter for speculative decoding:

    cost        N + 1 rows should read the weights once, as one row does: then up to N of
                roughly 8 the forward stays near the memory-bandwidth floor instead of growing
                with N (see ``python -m minispec profile``);
    invariance  row i of a forward over N + 1 tokens must equal, bit for bit, what a forward of
                that row alone gives, so that greedy verification compares exactly the logits
                vanilla decoding would have computed and no argmax near-tie can flip.

``F.linear`` gives neither on the CPU: its BLAS switches kernel (and summation order) with the
row count, and each kernel reads the weight differently. Here the weight W [out, in] is copied
once into panels of PANEL output features, ``Wp[p] = W[p*PANEL:(p+1)*PANEL].T`` of shape
[P, in, PANEL], each one contiguous in memory, and a call is one batched product

    y[:, p*PANEL:(p+1)*PANEL] = x @ Wp[p]          x [M, in] shared by every panel (no copy)

Both operands are row-major and the sum over the input features runs along the rows of a panel,
so each output element is accumulated over ``in`` in the same order whatever M is (measured: on
an AVX-512 Xeon every SmolLM2 shape at M = 2..65, 1 and 2 threads; one row alone takes a
matrix-vector kernel, so M = 1 is padded to 2), and the panels stream through memory one after
another: on that machine the 121 products of a SmolLM2 forward take 23.0 ms at M = 2 where
oneDNN's prepacked weights take 26.0 ms, and 31.3 ms at M = 9 where ``F.linear`` takes 48.0 ms
(``benchmarks/linear_kernels.py``, ``benchmarks/results/linear_kernels_cpu.json``).
No CPU is trusted blindly: each kind of layer is probed once per thread count and computed by
the cheapest plan found invariant (``minispec.invariance.RowPlan``): as it is, its input features
in two halves, or its rows padded (one row to two; the panels on an AVX2-only CPU,
which vary at 1-3 rows, calls of fewer rows to four; ``F.linear`` on MKL's AVX2 kernels, which
compute rows in blocks of 6, to a multiple of 6).

The panels are one of two prepacked CPU kernels. The other, ``onednn``, is oneDNN's own prepacked
weight layout (``torch.ops.mkldnn._linear_pointwise``): on a 2-core AMD EPYC with AVX2 only, its rows
were invariant at every row count probed, so a one-row decode step needs no padding there, and its
121 products took 54.2 ms at one row where the panels, padded to four rows on that CPU, took
65.0 ms (``benchmarks/results/linear_kernels_epyc_avx2_cpu.json``); on an AVX-512 Xeon the panels
were faster. So by default (``Linear.cpu_kernel = "auto"``) each machine uses the one that is faster
there, timed once per CPU, torch build and thread count and cached, so that every process on the
machine computes the same bits (``minispec.kernel_choice``). ``Linear.cpu_kernel`` (or
``MINISPEC_LINEAR_KERNEL=auto|panels|onednn`` set before import) can name one for every layer; either
is probed and planned the same way, and "onednn" falls back to the panels where this PyTorch has no oneDNN.

Training (autograd), other dtypes and other devices use ``F.linear`` (probed and planned the
same way on the CPU; not under autograd, and not on a GPU, where minispec claims no row
invariance).

Shapes: [..., in] -> [..., out]; P = ceil(out / PANEL) panels.
"""

from __future__ import annotations

import mmap
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import thp_mode
from .invariance import RowPlan, linear_plan, pad_rows, padded_rows
from .kernel_choice import CPU_KERNELS, chosen_kernel, chosen_pad, machine_tag, onednn_available

PANEL = 32  # output features per weight panel (32 floats: two AVX-512 or four AVX2 registers per row)
KERNEL_CHOICES = ("auto", *CPU_KERNELS)  # what ``Linear.cpu_kernel`` may name ("auto": this machine's faster one)


def _kernel_from_env() -> str:
    name = os.environ.get("MINISPEC_LINEAR_KERNEL", "auto").strip() or "auto"
    if name not in KERNEL_CHOICES:
        raise ValueError(f"MINISPEC_LINEAR_KERNEL must be one of {', '.join(KERNEL_CHOICES)}, got {name!r}")
    return name


HUGE_PAGE = 2 << 20  # bytes of a huge page (x86-64 and arm64 Linux)
# ask for them where Linux may give them (THP "always" or "madvise"); ``False`` for before/after measurements
HUGE_PAGES = hasattr(mmap, "MADV_HUGEPAGE") and thp_mode() in ("always", "madvise")


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised CPU tensor that starts on a 2 MiB boundary in memory that Linux is asked to back with
    transparent huge pages (``madvise(MADV_HUGEPAGE)``, honoured where THP is "madvise" or "always"); a plain
    ``torch.empty`` where ``HUGE_PAGES`` is off or the tensor is smaller than one huge page.

    Why: a decode step streams every weight once. With 4 KiB pages that is a page-table walk every 4 KiB (two
    nested ones in a virtual machine), and the CPU's prefetchers stop at each page's end; with 2 MiB pages both
    go away where the host backs the memory with large pages too. Measured side by side in one process
    (``benchmarks/huge_pages.py``, ``benchmarks/results/huge_pages_epyc_avx512_cpu.json``): on a 2-core AMD EPYC
    VM with AVX-512 the 121 weight products of a SmolLM2 forward at two rows ran 1.08x faster from 2 MiB pages
    (1.13x and 1.25x in two more runs), while its whole decode forward on the panels (padded to four rows there)
    was no faster (0.98x; 0.93x); there oneDNN's kernel is the faster one anyway (``minispec.kernel_choice``).
    The values, and so every bit computed from them, are the same either way."""
    n = torch.Size(shape).numel() * dtype.itemsize
    if not HUGE_PAGES or n < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    # a private anonymous mapping (a shared one would be shmem, which THP leaves alone), one huge page longer
    # so that the tensor can start on a huge-page boundary; the tensor keeps the mapping alive
    m = mmap.mmap(-1, n + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(m, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE  # [start, start + n): the tensor's bytes in the mapping
    whole = n // HUGE_PAGE * HUGE_PAGE  # the bytes that fill whole huge pages
    # advised before the first touch (pages are given at the first fault); the last partial huge page in ordinary
    # pages, so that no tensor holds up to 2 MiB it does not use (as it would where THP is "always")
    try:
        m.madvise(mmap.MADV_HUGEPAGE, start, whole)
        m.madvise(mmap.MADV_NOHUGEPAGE, start + whole, len(m) - start - whole)
    except OSError:  # a kernel built without THP refuses the advice: ordinary pages, as torch.empty gives
        return torch.empty(shape, dtype=dtype)
    return raw[start:start + n].view(dtype).view(shape)


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


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state_dict) with a weight-panel CPU inference path
    whose rows do not depend on the row count.

    ``Linear.prepack = False`` switches every instance back to ``F.linear`` (for before/after
    measurements); ``Linear.row_invariant = False`` computes every call as it is, whatever the
    probe found (to show what the plans prevent); ``Linear.cpu_kernel`` names the prepacked
    kernel ("auto": this machine's faster one, ``minispec.kernel_choice``; "panels" or "onednn").
    Prepacked copies are rebuilt when the weight changes (in place or replaced).

    Under ``torch.compile`` a layer that has run eagerly (or been prepacked) traces without a graph break,
    with the row plan and prepacked copy of its last eager call (compile again after changing weights,
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
        return (Linear.prepack and w.device.type == "cpu" and w.dtype == x.dtype == torch.float32
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
        (oneDNN's prepacked weight; ``Linear.cpu_kernel``) or "f_linear"."""
        if not self._use_panels(x):
            return "f_linear"
        name = Linear.cpu_kernel
        if name == "auto":
            name = chosen_kernel(time_kernels)
        return "onednn" if name == "onednn" and onednn_available() else "panels"

    def _product(self, kernel: str, x: torch.Tensor, part: int | None = None, rows: int | None = None) -> torch.Tensor:
        """``kernel``'s product of x [M, in (or its half)] with the whole weight or the half ``part`` -> [rows, out]:
        the first ``rows`` rows of the result (default all M; fewer drop the rows a plan padded x with)."""
        m = x.shape[0] if rows is None else rows
        if kernel == "panels":  # the decode loop's path, kept to few ops: each costs microseconds at one row
            wp = self.panel_weight(part)  # [P, in', PANEL]
            y = torch.bmm(x.expand(wp.shape[0], -1, -1), wp)  # [P, M, PANEL]: every panel reads the same x
            # (methods, not indexing: y[:, 0] costs several microseconds more in Python, at every call)
            y = (y.select(1, 0) if m == 1 else y.narrow(1, 0, m).transpose(0, 1)).reshape(m, -1)  # [m, P * PANEL]
            if y.shape[1] != self.out_features:
                y = y.narrow(1, 0, self.out_features)  # [m, out]: the zero rows of the last panel dropped
            b = self.bias if part != 1 else None  # the bias goes with the first half
            return y if b is None else y + b
        w, b = self._part(part)
        if kernel == "onednn":
            y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.onednn_weight(part), b, "none", [], "")
        else:
            y = F.linear(x, w, b)
        return y if m == x.shape[0] else y.narrow(0, 0, m)

    def _split_product(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        h = self.in_features // 2
        return self._product(kernel, x[:, :h], 0) + self._product(kernel, x[:, h:], 1)

    def row_plan(self, x: torch.Tensor, kernel: str | None = None) -> RowPlan | None:
        """The plan that keeps this layer's rows independent of the row count for inputs like ``x``, at
        the running thread count (probed on first use, ``minispec.invariance``), for ``kernel`` (default:
        the one ``x`` takes); None where no invariance is kept (autograd, a GPU)."""
        if self.weight.device.type != "cpu" or (torch.is_grad_enabled() and (self.weight.requires_grad or
                                                                             x.requires_grad)):
            return None
        kernel = kernel or self.kernel(x)
        key = (kernel, self.in_features, self.out_features, self.bias is not None, x.dtype, x.device.type,
               type(self)._product)  # the function itself: a stand-in product (tests) is probed anew
        split = (lambda x2: self._split_product(kernel, x2)) if self.in_features >= 2 else None
        return linear_plan(key, lambda x2: self._product(kernel, x2), split, self.in_features, x.dtype, x.device)

    def _plan(self, x: torch.Tensor) -> tuple[str, int, int, int]:
        """(kernel, split, min_rows, multiple) for ``x``, remembered per kernel, dtype, grad mode and thread count.
        Under "auto", calls of fewer rows than this machine's ``pad_rows`` for the kernel are padded up to it
        (``time_kernels``): a kernel whose rows do not depend on the row count gives them the same bits in a call
        of more rows, and may give them sooner."""
        key = (self._use_panels(x), x.dtype, x.device.type, torch.is_grad_enabled(), x.requires_grad,
               torch.get_num_threads(), Linear.row_invariant, Linear.cpu_kernel)
        if self.__dict__.get("_plan_key") != key:
            plan = self.row_plan(x) if Linear.row_invariant else None
            if plan is None or not plan.invariant:
                self._plan_value = (self.kernel(x), 1, 1, 1)
            else:
                pad = chosen_pad(time_kernels, plan.kernel) if Linear.cpu_kernel == "auto" and \
                    plan.kernel in CPU_KERNELS else 1
                self._plan_value = (plan.kernel, plan.split, max(plan.min_rows, pad), plan.multiple)
            self._plan_key = key
        return self._plan_value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and "_plan_value" in self.__dict__:  # traced by torch.compile: the plan the
            return self.run(x, *self._plan_value)  # last eager call chose (a probe runs products, which a trace cannot)
        return self.run(x, *self._plan(x))

    def run(self, x: torch.Tensor, kernel: str, split: int = 1, min_rows: int = 1, multiple: int = 1) -> torch.Tensor:
        """``kernel``'s product of ``x`` [..., in] under a row plan (``forward`` runs this layer's own)."""
        x2 = x.reshape(-1, self.in_features)  # [M, in]
        m = x2.shape[0]
        if split > 1:  # the input features in two halves, the products added
            y = self._split_product(kernel, x2)  # [M, out]
        elif (m_ := padded_rows(m, min_rows, multiple)) > m:  # rows the kernel does not keep invariant: pad the
            y = self._product(kernel, pad_rows(x2, m_), rows=m)  # call (``pad_rows``), keep the first m rows
        else:
            y = self._product(kernel, x2)
        return y.reshape(*x.shape[:-1], self.out_features)


@torch.no_grad()
def prepack(module: nn.Module) -> nn.Module:
    """Build the prepacked weights (``Linear.cpu_kernel``'s) of every ``Linear`` in ``module`` and choose
    its row plan at the running thread count now rather than on its first forward, so that the first
    timed generation pays for neither.
    Returns ``module``."""
    for m in module.modules():
        if isinstance(m, Linear) and m.weight.device.type == "cpu":
            x = m.weight.new_empty(1, m.in_features)  # stands for an input of the weight's dtype
            kernel, split, _, _ = m._plan(x)
            if kernel in CPU_KERNELS:
                for part in ((None,) if split == 1 else (0, 1)):
                    (m.panel_weight if kernel == "panels" else m.onednn_weight)(part)
    return module


# ---- the timing behind Linear.cpu_kernel = "auto" (``minispec.kernel_choice`` caches what it finds)

CHOICE_SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # SmolLM2's qkv, out, gate_up, down
CHOICE_LAYERS = 8
CHOICE_ROWS = (1, 4, 8)
CHOICE_ROUNDS = 5
PAD_CANDIDATES = (1, 2, 4, 6, 8)  # rows a one-row call may be padded to, the fastest kept per kernel (``pad_rows``)


@torch.no_grad()
def time_kernels(shapes=CHOICE_SHAPES, layers: int = CHOICE_LAYERS, rows=CHOICE_ROWS, rounds: int = CHOICE_ROUNDS,
                 kernels=None) -> dict:
    """Time each prepacked kernel over ``layers`` x ``shapes`` random weights, interleaved, fastest of ``rounds``
    rounds (after one untimed round): the timer that ``kernel_choice`` runs once per machine for "auto".
    First a one-row call padded to each of PAD_CANDIDATES rows (at least its row plan's): a kernel may compute
    a few rows sooner than one (oneDNN's, on a 2-core AMD EPYC with AVX-512: padded to 6 rows, vanilla decoded
    1.08x faster, ``benchmarks/linear_kernel_decode.py``), and its rows' bits do not depend on the row count, so
    the fastest is that kernel's ``pad_rows``. Then each row count in ``rows`` under the row plan with that padding.

    Returns:
        {"kernel": the lower sum over ``rows``, "machine", "times_ms": {kernel: {rows: ms}},
         "pad_rows": {kernel: rows}, "pad_ms": {kernel: {rows padded to: ms}},
         "plans": {kernel: {"in->out": plan}}, "rows", "layers", "measured_at"}.
    """
    with torch.inference_mode(False):  # called from inside inference mode too: its tensors keep no version
        return _time_kernels(shapes, layers, rows, rounds, tuple(kernels or CPU_KERNELS))


def _time_kernels(shapes, layers: int, rows, rounds: int, kernels: tuple[str, ...]) -> dict:
    g = torch.Generator().manual_seed(0)
    stack = []
    for _ in range(layers):
        for n_in, n_out in shapes:
            layer = Linear(n_in, n_out, bias=False).requires_grad_(False)
            layer.weight.copy_(torch.randn(n_out, n_in, generator=g) * n_in ** -0.5)
            stack.append(layer)
    plans = {k: {} for k in kernels}
    runs = {k: [] for k in kernels}  # (layer, its plan's (kernel, split, min_rows, multiple))
    for k in kernels:
        for layer in stack:
            plan = layer.row_plan(layer.weight.new_zeros(1, layer.in_features), kernel=k)
            how = (k, plan.split, plan.min_rows, plan.multiple) if plan.invariant else (k, 1, 1, 1)
            plans[k][f"{layer.in_features}->{layer.out_features}"] = plan.describe()
            for part in ((None,) if how[1] == 1 else (0, 1)):  # the prepacked copy, built before timing
                (layer.panel_weight if k == "panels" else layer.onednn_weight)(part)
            runs[k].append((layer, how))
    xs = {m: {n_in: torch.randn(m, n_in, generator=g) for n_in in {s[0] for s in shapes}} for m in {1, *rows}}

    def fastest(counts: dict, runs_of) -> dict:  # {kernel: {count: best seconds}} over interleaved rounds
        best = {k: {c: float("inf") for c in counts[k]} for k in kernels}
        for r in range(rounds + 1):  # the first round is a warm-up
            for k in kernels:
                for c in counts[k]:
                    x, layer_runs = runs_of(k, c)
                    t = time.perf_counter()
                    for layer, how in layer_runs:
                        layer.run(x[layer.in_features], *how)
                    if r:
                        best[k][c] = min(best[k][c], time.perf_counter() - t)
        return best

    def padded(k, pad):  # kernel k's runs with one-row calls padded to ``pad`` rows (at least its plan's)
        return [(layer, (how[0], how[1], max(how[2], pad), how[3])) for layer, how in runs[k]]

    def candidates(k) -> list[int]:  # PAD_CANDIDATES less those that pad no layer beyond a smaller one's padding
        seen, keep = set(), []
        for pad in PAD_CANDIDATES:
            config = tuple(max(how[2], pad) for _, how in runs[k])
            if config not in seen:
                seen.add(config)
                keep.append(pad)
        return keep

    pad_s = fastest({k: candidates(k) for k in kernels}, lambda k, pad: (xs[1], padded(k, pad)))
    pad_ms = {k: {str(c): round(t * 1e3, 3) for c, t in pad_s[k].items()} for k in kernels}
    pad_rows = {k: int(min(pad_ms[k], key=pad_ms[k].get)) for k in kernels}
    best = fastest({k: rows for k in kernels}, lambda k, m: (xs[m], padded(k, pad_rows[k])))
    times_ms = {k: {str(m): round(best[k][m] * 1e3, 3) for m in rows} for k in kernels}
    # chosen on the recorded times, so that the record shows why: two kernels whose sums differ by less than the
    # rounding can no longer be recorded in one order and chosen in the other
    return {"kernel": min(kernels, key=lambda k: sum(times_ms[k].values())), "machine": machine_tag(),
            "times_ms": times_ms, "pad_rows": pad_rows, "pad_ms": pad_ms,
            "plans": plans, "rows": list(rows), "layers": layers, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
