"""Which attention backend a step should use, looked up in a table the GPU measured (chapters 6 and 8).

Three backends compute the attention of T new tokens (a token, a chain, a tree's rows) over a KV
cache [B, Hkv, C, hd] whose row b holds P_b committed tokens and the new ones at P_b .. P_b + T - 1:

    dense   the model's own masked attention: one SDPA call with the full boolean mask [B, 1, T, C], the
            G query heads of each KV head folded into its query rows (``attention.dense``: no K / V copy,
            SDPA's memory-efficient kernel takes it as plain multi-head attention); on a CPU the exact
            backend's row-invariant twin (``minispec.exact``)
    flash   SDPA's fused kernels without copying K / V (``fused_attention``): no mask, flash attention
            with its own GQA; with a mask the same folded SDPA call as dense (so over a static cache,
            whose unused slots always need the mask, the two time alike: the lab reports both)
    split   the Triton split kernel (``triton_split.split_attention_triton``): split-k over each
            row's own prefix length (a device tensor), the tree under its mask, one launch

Which one is fastest depends on the batch, the context, the tree and the GPU (the split pays for
its merge and launch where the prefix is short; the masked SDPA call reads every slot of the
capacity, committed or not, and computes scores for all of them), so
the choice is a table: ``minispec.lab.backend_table`` times the three on a GPU over a grid of
(batch, context, tree rows) and saves the winners as JSON naming the GPU; ``choose_backend``
looks a shape up in it. The lookup is plain Python on ints the caller already knows (a graph
runner: its batch bucket, the cache's capacity, its token bucket): a bisection per axis and a
dict, no tensor, no device, so it runs per captured bucket or per eager step alike. A shape
between grid points takes the measured point at or below it on every axis (the first point
below the grid).

Without a measured table, ``default_table``: on a CPU dense everywhere (the CPU's dense path is
row-invariant, what keeps speculative greedy output equal to vanilla's bit for bit; the Triton
kernels run there only in the interpreter); on CUDA the split where batch x context >=
``SPLIT_KEYS`` keys, dense elsewhere. That rule picks the faster of the two at every shape of
the committed H100 and H200 grids (``benchmarks/results/gpu-h100/attention_grid.json``,
``gpu-h200/``: the earlier three-launch kernel, eager) where one was at least 10% faster, except
at batch 1 and context 8192, where the split won at two of the four tree sizes and lost at the
other two on each GPU (tests/test_backend_table.py checks this against the files). A measured
table replaces it: ``table_for(device)`` returns the one ``lab.backend_table --save`` left for this
GPU on this machine (``table_path``), else the default.

Shapes: B batch, H = G * Hkv query heads, T new tokens, C cache slots (the context), hd head dim.
"""

from __future__ import annotations

import bisect
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from .dense import attention
from .reference import check_shapes, dense_attention

TABLE_BACKENDS = ("dense", "flash", "split")
AXES = dict(batch=(1, 2, 4, 8, 16, 32), context=(1024, 2048, 4096, 8192, 16384, 32768), tree=(1, 2, 4, 8, 16, 32, 64))
SPLIT_KEYS = 16384  # default on CUDA: the split where batch x context reaches this many keys


@dataclass(frozen=True)
class BackendTable:
    """The best backend per grid point (batch, context, tree rows), and the GPU it was measured on.

    best: {(batch, context, tree): backend}; the axes are the sorted coordinates it covers. A grid
    point missing from ``best`` (a shape that failed or ran out of time) takes ``fallback``.
    """

    device: str
    best: dict
    fallback: str = "dense"
    source: str = "measured"
    axes: tuple = field(init=False, repr=False)

    def __post_init__(self):
        if bad := sorted({b for b in self.best.values() if b not in TABLE_BACKENDS} | (
                {self.fallback} - set(TABLE_BACKENDS))):
            raise ValueError(f"unknown attention backends {bad} in the table; choose from {', '.join(TABLE_BACKENDS)}")
        if not self.best:
            raise ValueError("an attention backend table needs at least one entry")
        axes = tuple(tuple(sorted({key[i] for key in self.best})) for i in range(3))
        object.__setattr__(self, "axes", axes)

    def choose(self, batch: int, context: int, tree_rows: int) -> str:
        """The backend for ``batch`` rows of ``tree_rows`` new tokens over ``context`` keys (host ints)."""
        point = tuple(_at_or_below(axis, x) for axis, x in zip(self.axes, (batch, context, tree_rows)))
        return self.best.get(point, self.fallback)

    def to_dict(self) -> dict:
        """JSON-ready: {device, source, fallback, best: [[batch, context, tree, backend], ...]}."""
        return dict(device=self.device, source=self.source, fallback=self.fallback,
                    best=[[*key, name] for key, name in sorted(self.best.items())])

    @classmethod
    def from_dict(cls, d: dict) -> "BackendTable":
        """The inverse of ``to_dict``; raises ValueError naming what is missing or unknown."""
        try:
            best = {(int(b), int(c), int(t)): str(name) for b, c, t, name in d["best"]}
            return cls(str(d["device"]), best, d.get("fallback", "dense"), d.get("source", "measured"))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not an attention backend table ({type(e).__name__}: {e}); expected device and "
                             "best = [[batch, context, tree, backend], ...]") from None


def _at_or_below(axis: tuple, x: int) -> int:
    """The largest grid coordinate <= x, or the smallest when x is below them all."""
    i = bisect.bisect_right(axis, x)
    return axis[max(i - 1, 0)]


def load_table(path: str | Path) -> BackendTable:
    """A table saved by ``minispec.lab.backend_table`` (its ``table`` entry) or by ``BackendTable.to_dict``."""
    doc = json.loads(Path(path).read_text())
    return BackendTable.from_dict(doc.get("table", doc))


def table_path(device_name: str) -> Path:
    """Where the table measured on the GPU named ``device_name`` is kept on this machine
    (``python -m minispec.lab.backend_table --save`` writes it) and where a graph runner looks for it."""
    from ..config import cache_dir, file_tag

    return cache_dir(create=False) / "backend_table" / f"{file_tag(device_name)}.json"


def table_for(device: torch.device | str) -> BackendTable:
    """The table a graph runner on ``device`` uses: the one measured on this GPU and saved here (``table_path``)
    if there is one, else ``default_table``. A CPU always takes the default (dense: row-invariant)."""
    device = torch.device(device)
    if device.type == "cuda":
        path = table_path(torch.cuda.get_device_name(device))
        if path.exists():
            return load_table(path)
    return default_table(device.type)


@functools.lru_cache(maxsize=None)
def default_table(device_type: str) -> BackendTable:
    """The table used when none was measured: dense everywhere on a CPU; on CUDA split where batch x
    context >= ``SPLIT_KEYS``, dense elsewhere, over ``AXES`` (module docstring)."""
    if device_type != "cuda":
        return BackendTable("cpu", {(1, 1, 1): "dense"}, source="default: dense on a CPU (row-invariant)")
    best = {(b, c, t): "split" if b * c >= SPLIT_KEYS else "dense"
            for b in AXES["batch"] for c in AXES["context"] for t in AXES["tree"]}
    return BackendTable("cuda", best, source=f"default: split where batch x context >= {SPLIT_KEYS}")


def choose_backend(batch: int, context: int, tree_rows: int, table: BackendTable | None = None,
                   device_type: str = "cuda") -> str:
    """The attention backend ("dense" | "flash" | "split") for a step of ``batch`` rows, each of ``tree_rows``
    new tokens over ``context`` keys (a static cache: its capacity), from ``table`` or ``default_table``.

    Host-only and cheap (a bisection per axis and a dict lookup): safe to call per step or per graph bucket.
    """
    if min(batch, context, tree_rows) < 1:
        raise ValueError(f"batch={batch}, context={context} and tree_rows={tree_rows} must all be >= 1")
    return (table or default_table(device_type)).choose(batch, context, tree_rows)


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The "flash" backend: SDPA's fused kernels, grouped-query heads without copying K / V.

    Args:
        q: [B, H, T, hd]; k, v: [B, Hkv, C, hd].
        mask: bool [B or 1, 1, T, C] / [T, C] (True = may attend), or None: every query sees every key.
    Returns:
        [B, H, T, hd] in q's dtype. Without a mask flash attention takes the GQA itself; with one, the G query
        heads of each KV head are stacked as G * T query rows of that KV head (``attention.dense.attention``,
        the same call as the dense backend's), which the memory-efficient kernel takes as plain multi-head
        attention (the mask repeated G times: bytes per key, not K / V per head).
    """
    B, H, Hkv, T, hd = check_shapes(q, k, v)
    if mask is None:  # flash attention takes GQA itself
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=H != Hkv)
    if mask.dtype != torch.bool or mask.shape[-2:] != (T, k.shape[2]):
        raise ValueError(f"mask must be boolean [.., {T}, {k.shape[2]}], got {mask.dtype} {tuple(mask.shape)}")
    return attention(q, k, v, mask)


def run_backend(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                tree_mask: torch.Tensor | None, mask: torch.Tensor, out: torch.Tensor | None = None,
                workspace=None) -> torch.Tensor:
    """One backend's attention over a static cache, as a graph runner would call it (and the lab times it).

    Args:
        name: "dense" | "flash" | "split".
        q: [B, H, T, hd]; k, v: the cache [B, Hkv, C, hd], the new tokens already written at lengths[b] + j.
        lengths: [B] int committed lengths on q's device (split); tree_mask: bool [B or 1, T, T] among the new
            tokens, None causal (split); mask: bool [B, 1, T, C] over the cache's slots (dense, flash), e.g.
            ``cuda_graphs.static_plan``'s.
        out, workspace: the split's result buffer and ``SplitWorkspace`` (None: allocated / the default).
    Returns:
        [B, H, T, hd].
    """
    if name == "dense":
        return dense_attention(q, k, v, mask)
    if name == "flash":
        return fused_attention(q, k, v, mask)
    if name == "split":
        from .triton_split import split_attention_triton  # imports triton on first use

        return split_attention_triton(q, k, v, lengths, tree_mask, out=out, workspace=workspace)
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(TABLE_BACKENDS)}")
