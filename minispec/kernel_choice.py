"""Which prepacked CPU kernel ``minispec.linear.Linear`` runs on this machine ("auto"): the faster one,
timed once per CPU, torch build and thread count, and cached so that every process on the machine
computes the same bits.

Why choose: the two kernels are each fastest somewhere. On an AVX-512 Xeon the weight panels took
23.0 ms for a SmolLM2 forward's products at two rows against oneDNN's 25.2 at one; on a 2-core AMD
EPYC with AVX2 only, the panels vary at 1-3 rows, so their row plan pads a decode step to four rows
(65.0 ms) while oneDNN varied at no row count (54.2 ms at one row; ``benchmarks/linear_kernels.py``).

Why cache: the kernels' sums run in other orders, so they give other bits, and a near-tie in the
logits can then pick another greedy token. Timed afresh in each process, a close call (or a busy
moment) could choose the panels in one run and oneDNN in the next, and the same prompt would give
another greedy text on the same machine. So the first process that needs the choice times it and
writes it under ``MINISPEC_CACHE`` with an exclusive create; every later process, and any that timed
it at the same moment, reads that file. Delete the file to time it again.

The timing (``minispec.linear.time_kernels``, handed in as ``timer``: this module knows no layer):
``CHOICE_LAYERS`` decoder layers of SmolLM2's shapes (random weights, about 113 MB per
kernel's copy: more than a CPU's last-level cache, so they stream from memory as a decode step's do),
each kernel under the row plan its probe chooses on this CPU (``minispec.invariance``: the padding it
needs here), at ``CHOICE_ROWS`` rows (a decode step, verifications of a few draft tokens), the kernels
interleaved round by round, the fastest round of each kept. The lower sum over the row counts wins.
Before that, each kernel's one-row call is timed padded to a few row counts (``linear.PAD_CANDIDATES``): a
kernel whose rows do not depend on the row count may compute a few rows sooner than one, and the fastest
padding is its ``pad_rows``, which "auto" then applies (``chosen_pad``; on a 2-core AMD EPYC with AVX-512,
oneDNN's one-row calls padded to 6 rows decoded vanilla 1.08x faster, ``benchmarks/linear_kernel_decode.py``).
It takes a few seconds, once; the probes it runs are the ones SmolLM2's layers would run anyway.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Callable

import torch

from .config import cache_dir, cpu_tag, thp_mode

CPU_KERNELS = ("panels", "onednn")  # the prepacked CPU kernels of ``minispec.linear``
Timer = Callable[[], dict]  # times the kernels on this machine: ``minispec.linear.time_kernels``

_CHOSEN: dict[int, dict] = {}  # this process: thread count -> this machine's record (``choice``)


@functools.cache
def onednn_available() -> bool:
    """Whether this PyTorch build has oneDNN's prepacked linear (``torch.ops.mkldnn._linear_pointwise``)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise") and \
        hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def machine_tag() -> str:
    """The CPU model, its vector instruction set as torch sees it, the torch version, whether the weight panels
    can live in 2 MiB pages ("thp": Linux's THP mode lets them; they stream faster there) and the running thread
    count, as a file name: what a kernel choice holds for."""
    return cpu_tag(f"torch{torch.__version__}", "thp" if thp_mode() in ("always", "madvise") else "nothp")


def choice_path() -> Path:
    return cache_dir() / "linear_kernel" / f"{machine_tag()}.json"


def chosen_kernel(timer: Timer) -> str:
    """The kernel "auto" means at the running thread count: read from this machine's cache file, else timed
    now by ``timer`` and written there, unless another process wrote it first."""
    return _record(timer)["kernel"]


def chosen_pad(timer: Timer, kernel: str) -> int:
    """The rows every shorter call of ``kernel`` is padded to under "auto" at the running thread count (the record's
    ``pad_rows``: the fastest padding of a one-row call among a few, timed with the choice; 1 where the record has
    none)."""
    return int(_record(timer).get("pad_rows", {}).get(kernel, 1))


def _record(timer: Timer) -> dict:
    threads = torch.get_num_threads()
    if threads not in _CHOSEN:
        _CHOSEN[threads] = choice(timer)
    return _CHOSEN[threads]


def choice(timer: Timer) -> dict:
    """This machine's record: {"kernel", "machine", "times_ms": {kernel: {rows: ms}}, ...}, read or made."""
    if not onednn_available():
        return {"kernel": "panels", "machine": machine_tag(), "why": "this PyTorch build has no oneDNN linear"}
    path = choice_path()
    saved = read_choice(path)
    if saved is not None:
        return saved
    return write_once(path, timer())


def read_choice(path: Path) -> dict | None:
    """The record at ``path``, or None where there is none or it names no known kernel."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("kernel") in CPU_KERNELS else None


def write_once(path: Path, record: dict) -> dict:
    """Write ``record`` to ``path`` unless a record is already there; return the one that stands (this
    one, where the cache cannot be written)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        try:
            os.link(tmp, path)  # atomic, and refused where another process's record is already there
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    except OSError:
        return record
    return read_choice(path) or record


def describe(timer: Timer) -> str:
    """One line: the kernel "auto" uses here and why (``check-env``)."""
    rec = choice(timer)
    if "times_ms" not in rec:
        return f"{rec['kernel']} ({rec.get('why', '')})"
    rows = "+".join(str(m) for m in rec["rows"])
    times = ", ".join(f"{k} {sum(t.values()):.1f} ms" for k, t in rec["times_ms"].items())
    pad = rec.get("pad_rows", {}).get(rec["kernel"], 1)
    pad = f"; one-row calls padded to {pad} rows, its fastest" if pad > 1 else ""
    return f"{rec['kernel']} (timed at {rows} rows on this machine: {times}{pad}; {choice_path()})"
