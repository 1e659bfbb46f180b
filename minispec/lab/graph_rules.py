"""What a CUDA graph can capture, checked on any machine (chapter 8): op counts and host syncs.

A captured graph replays a fixed list of kernels on fixed addresses. So a step can be captured
only if, while it runs, (1) nothing waits for the device to hand a value to Python (a *host
sync*: ``.item()``, ``int(t)``, ``.tolist()``, ``.cpu()``, ``nonzero``, boolean-mask indexing,
whose output size depends on the data), and (2) every shape is the same from one step to the
next. And a step is worth capturing when it launches many small kernels: each costs the host a
few microseconds to launch, which a replay pays once.

All three are visible without a GPU, by recording the ATen operators a function dispatches
(``torch.utils._python_dispatch.TorchDispatchMode``): each operator stands for one kernel launch
(views launch nothing), and the host syncs are recognisable operators (``aten._local_scalar_dense``
behind ``.item()`` / ``int()`` / ``.tolist()``, ``aten.nonzero``, a copy to another device).
Running the same function on the ``meta`` device (shapes without data) counts the kernels of an
8B-parameter model's step without allocating its weights.

Shapes are frozen per graph, so steps of varying size are padded to a few *buckets*, one graph
each: ``padding_waste`` counts the padded slots of a set of buckets over the sizes that occur,
and ``best_buckets`` chooses the k buckets that waste least (a small dynamic programme).

References: NVIDIA, "CUDA Graphs" (CUDA C++ Programming Guide, "Graph capture" restrictions);
PyTorch, ``torch.cuda.graphs`` documentation ("Constraints").
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

NO_KERNEL_OPS = {"view", "_unsafe_view", "reshape", "expand", "slice", "select", "transpose", "t", "permute",
                 "unsqueeze", "squeeze", "as_strided", "alias", "split", "split_with_sizes", "chunk", "unbind", "narrow",
                 "detach", "unflatten", "flatten", "_reshape_alias", "lift_fresh", "view_as", "diagonal", "movedim",
                 "to", "contiguous", "type_as", "empty", "empty_like", "empty_strided"}
"""Operators that launch no kernel: views of existing memory, and conversions or allocations that
dispatch a separate operator when they do work (``to`` -> ``_to_copy``, ``contiguous`` -> ``clone``)."""

SYNC_OPS = {"_local_scalar_dense": ".item() / int() / float() / bool(): a device value read on the host",
            "item": ".item() / int() / float() / bool(): a device value read on the host",
            "nonzero": "nonzero / boolean-mask indexing: the output size depends on the data",
            "masked_select": "masked_select: the output size depends on the data",
            "unique": "unique: the output size depends on the data",
            "_unique2": "unique: the output size depends on the data",
            "repeat_interleave": "repeat_interleave with tensor repeats: the output size depends on the data"}
"""Operators that make the host wait for the device (name -> why)."""

SYNC_METHODS = {"tolist": ".tolist(): device values read on the host", "numpy": ".numpy(): a copy to the host",
                "cpu": ".cpu(): a copy to the host", "__bool__": "bool(tensor) (an `if` on a tensor): a host read",
                "__int__": "int(tensor): a host read", "__float__": "float(tensor): a host read",
                "__index__": "a tensor used as a Python index: a host read", "item": ".item(): a host read"}
"""Tensor methods that hand device data to Python: caught where they are called (on a CPU tensor
some of them dispatch no operator at all, yet on a GPU each is a synchronisation)."""


@dataclass
class OpRecord:
    """Every ATen operator one call dispatched: name, output shapes, devices."""
    ops: list[tuple[str, tuple]] = field(default_factory=list)  # (name, output shapes)
    hazards: list[str] = field(default_factory=list)  # host syncs found, in order

    @property
    def kernels(self) -> int:
        """Operators that launch work (``NO_KERNEL_OPS`` excluded): the kernel launches of the step."""
        return sum(1 for name, _ in self.ops if name not in NO_KERNEL_OPS)

    def counts(self) -> Counter:
        return Counter(name for name, _ in self.ops if name not in NO_KERNEL_OPS)

    def signature(self) -> list[tuple[str, tuple]]:
        """Operator names with their output shapes: two calls can share one graph only if equal."""
        return list(self.ops)


class _Recorder(TorchDispatchMode):
    """Records every ATen operator (one kernel launch unless it is a view) and the syncing ones."""

    def __init__(self, record: OpRecord):
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]  # "add.Tensor" -> "add"
        if name in SYNC_OPS:
            self.record.hazards.append(f"{name}: {SYNC_OPS[name]}")
        elif name in ("_to_copy", "copy_") and _crosses_devices(args, kwargs):
            self.record.hazards.append(f"{name}: a copy between devices (.cpu(), .to(...)) waits for the device")
        elif name in ("index", "index_put", "index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())):
            self.record.hazards.append(f"{name}: boolean-mask indexing: the output size depends on the data")
        out = func(*args, **kwargs)
        shapes = tuple(tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else (out,))
                       if isinstance(t, torch.Tensor))
        self.record.ops.append((name, shapes))
        return out


class _MethodWatch(TorchFunctionMode):
    """Catches the tensor methods that hand device data to Python (``SYNC_METHODS``)."""

    def __init__(self, record: OpRecord):
        super().__init__()
        self.record = record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNC_METHODS:
            self.record.hazards.append(f"{name}: {SYNC_METHODS[name]}")
        elif name == "to" and any(isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu"
                                  for a in (*args[1:], (kwargs or {}).get("device", "meta"))):
            self.record.hazards.append("to('cpu'): a copy to the host")
        return func(*args, **(kwargs or {}))


def _crosses_devices(args, kwargs) -> bool:
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    dev = kwargs.get("device")
    devices = {t.device.type for t in tensors} | ({torch.device(dev).type} if dev is not None else set())
    return len(devices) > 1


def record_ops(fn: Callable, *args, **kwargs) -> tuple[object, OpRecord]:
    """Run ``fn(*args, **kwargs)`` and record every ATen operator it dispatches.

    Returns:
        (fn's result, OpRecord). A host sync on a tensor of the ``meta`` device raises (there is no
        value to hand over): ``find_hazards`` catches that and reports it.
    """
    record = OpRecord()
    with _MethodWatch(record), _Recorder(record):
        out = fn(*args, **kwargs)
    return out, record


def find_hazards(fn: Callable, *calls: tuple[tuple, dict]) -> list[str]:
    """What keeps ``fn`` from being captured: host syncs in any call, and shapes that change between
    calls (give two or more calls with the inputs of consecutive steps).

    Args:
        fn: the step function.
        calls: (args, kwargs) of each call, e.g. ``((tokens_step1,), {"kv": kv})``.
    Returns:
        A list of findings, empty when the function can be captured.
    """
    found, signatures = [], []
    for i, (args, kwargs) in enumerate(calls):
        try:
            _, rec = record_ops(fn, *args, **kwargs)
        except Exception as e:  # noqa: BLE001  (a sync on the meta device raises)
            found.append(f"call {i}: raised {type(e).__name__} ({str(e).splitlines()[0][:120]}): a host sync "
                         "or a data-dependent shape")
            continue
        found += [f"call {i}: {h}" for h in dict.fromkeys(rec.hazards)]
        signatures.append(rec.signature())
    for i in range(1, len(signatures)):
        if signatures[i] != signatures[0]:
            n = next((j for j, (a, b) in enumerate(zip(signatures[0], signatures[i])) if a != b),
                     min(len(signatures[0]), len(signatures[i])))
            what = (f"operator {n}: {signatures[0][n]} then {signatures[i][n]}"
                    if n < min(len(signatures[0]), len(signatures[i])) else "a different number of operators")
            found.append(f"call {i}: shapes change between calls ({what})")
    return found


def dispatch_cost_s(reps: int = 2000, device: torch.device | str = "cpu") -> float:
    """Seconds the host spends to dispatch one small operator on this machine (an add of two
    8-element tensors: the kernel does almost nothing, so the time is the launch path).

    On a CUDA device the adds are queued asynchronously and the device is synchronised before
    and after the loop: the time per add is then the host's launch cost (the GPU runs each tiny
    kernel faster than the host queues the next)."""
    import time

    dev = torch.device(device)
    a, b = torch.ones(8, device=dev), torch.ones(8, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(100):
        torch.add(a, b)
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        torch.add(a, b)
    sync()
    return (time.perf_counter() - t0) / reps


# --------------------------------------------------------------------------- buckets: what padding costs
def padding_waste(sizes: Sequence[int], buckets: Sequence[int]) -> int:
    """Padded slots when every size is padded up to the smallest bucket that holds it.

    Args:
        sizes: the sizes that occur (a multiset: repeat a size as often as it occurs).
        buckets: the bucket sizes; the largest must hold every size.
    Returns:
        sum over sizes of (its bucket - size). ValueError if a size exceeds every bucket.
    """
    from ..cuda_graphs import pick_bucket

    return sum(pick_bucket(s, buckets) - s for s in sizes)


def best_buckets(sizes: Sequence[int], k: int) -> list[int]:
    """At most ``k`` buckets that minimise ``padding_waste(sizes, buckets)``: one graph each.

    An optimal set uses only sizes that occur (lowering a bucket to the largest size it holds
    wastes less), and its largest bucket is the largest size. Over the distinct sizes sorted,
    ``cost[j][i]`` is the least waste of the first i distinct sizes with j buckets, the last at
    size i - 1; a dynamic programme over (j, i), O(k n^2) for n distinct sizes.

    Args:
        sizes: the sizes that occur (a multiset), at least one; k: the most buckets (>= 1).
    Returns:
        the buckets, sorted (fewer than k when there are fewer distinct sizes). Ties go to the
        set found first (smaller buckets first).
    """
    if k < 1 or not len(sizes):
        raise ValueError(f"need k >= 1 and at least one size, got k={k}, {len(sizes)} sizes")
    count = Counter(int(s) for s in sizes)
    vals = sorted(count)  # distinct sizes
    n = len(vals)
    k = min(k, n)
    inf = float("inf")

    n_le, sum_le = [0], [0]  # prefix sums over the distinct sizes: how many, and their total
    for v in vals:
        n_le.append(n_le[-1] + count[v])
        sum_le.append(sum_le[-1] + v * count[v])

    def waste(lo: int, hi: int) -> int:  # the sizes vals[lo..hi] padded to vals[hi]
        return vals[hi] * (n_le[hi + 1] - n_le[lo]) - (sum_le[hi + 1] - sum_le[lo])

    cost = [[inf] * (n + 1) for _ in range(k + 1)]  # cost[j][i]: first i sizes, j buckets, last at i - 1
    back = [[0] * (n + 1) for _ in range(k + 1)]
    cost[0][0] = 0
    for j in range(1, k + 1):
        for i in range(1, n + 1):
            for prev in range(i):  # the previous bucket ends at size prev - 1 (prev = 0: none)
                c = cost[j - 1][prev] + waste(prev, i - 1)
                if c < cost[j][i]:
                    cost[j][i], back[j][i] = c, prev
    j = min(range(1, k + 1), key=lambda j: (cost[j][n], j))
    out, i = [], n
    while i > 0:
        out.append(vals[i - 1])
        i, j = back[j][i], j - 1
    return sorted(out)
