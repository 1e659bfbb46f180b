"""This machine's saved kernel choice: which prepacked CPU kernel the exact backend runs, and the rows a
one-row call is padded to. Read here, never measured here.

Why a saved choice: the two prepacked kernels of ``minispec.exact.linear`` (the weight panels and oneDNN's
prepacked weights) sum in other orders, so they give other bits, and a near-tie in the logits can then pick
another greedy token. Each is fastest on some CPUs (``docs/results.md`` has the figures). Timed afresh in
each process, a close call could choose one kernel in one run and the other in the next, and the same
prompt would give another greedy text on the same machine. So the choice is made once, by an explicit lab
step (``python -m minispec calibrate``, which ``make demo`` runs on its first start; the timing is
``minispec.lab.calibrate.time_kernels``), written under ``MINISPEC_CACHE`` and read by every later process.

Without a saved choice the exact backend runs ``DEFAULT_KERNEL`` with no padding beyond its row recipe's
(``DEFAULT_PAD``): the weight panels, minispec's own kernel, available in every PyTorch build. Nothing here
times anything or writes a file; ``write_once`` is the lab's writer.

A choice holds for one CPU model, vector instruction set, torch version, Linux huge-page mode and thread
count (``machine_tag``): the file name says which.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

from ..config import cache_dir, cpu_tag, thp_mode

CPU_KERNELS = ("panels", "onednn")  # the prepacked CPU kernels of ``minispec.exact.linear``
DEFAULT_KERNEL = "panels"  # without a saved choice: minispec's own kernel, in every PyTorch build
DEFAULT_PAD = 1  # without a saved choice: one-row calls padded only as far as their row recipe needs


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
    return cache_dir(create=False) / "linear_kernel" / f"{machine_tag()}.json"


_READ: dict[int, dict | None] = {}  # this process: thread count -> the saved record (None: none saved)


def saved_choice() -> dict | None:
    """This machine's saved record at the running thread count ({"kernel", "pad_rows": {kernel: rows}, ...}),
    read once per process and thread count; None where none is saved."""
    threads = torch.get_num_threads()
    if threads not in _READ:
        _READ[threads] = read_choice(choice_path())
    return _READ[threads]


def chosen_kernel() -> str:
    """The kernel "auto" means here: the saved choice, else ``DEFAULT_KERNEL``; the panels where this PyTorch
    has no oneDNN."""
    rec = saved_choice()
    kernel = rec["kernel"] if rec is not None else DEFAULT_KERNEL
    return kernel if kernel != "onednn" or onednn_available() else "panels"


def chosen_pad(kernel: str) -> int:
    """The rows every shorter call of ``kernel`` is padded to under "auto" (the saved record's ``pad_rows``: the
    fastest padding of a one-row call among a few, timed with the choice); ``DEFAULT_PAD`` without a record."""
    rec = saved_choice()
    return int((rec or {}).get("pad_rows", {}).get(kernel, DEFAULT_PAD))


def read_choice(path: Path) -> dict | None:
    """The record at ``path``, or None where there is none or it names no known kernel."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("kernel") in CPU_KERNELS else None


def write_once(path: Path, record: dict) -> dict:
    """Write ``record`` to ``path`` unless a record is already there; return the one that stands (this
    one, where the cache cannot be written). The lab's writer (``minispec.lab.calibrate``)."""
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
    _READ.clear()
    return read_choice(path) or record


def describe() -> str:
    """One line: the kernel "auto" runs here and where that comes from (``check-env``); reads, never times."""
    rec = saved_choice()
    if rec is None:
        return (f"{chosen_kernel()} (the default: no calibration saved for this machine at {torch.get_num_threads()} "
                f"threads; python -m minispec calibrate measures it once)")
    times = ", ".join(f"{k} {sum(t.values()):.1f} ms" for k, t in rec.get("times_ms", {}).items())
    rows = "+".join(str(m) for m in rec.get("rows", []))
    pad = chosen_pad(rec["kernel"])
    pad = f"; one-row calls padded to {pad} rows, its fastest" if pad > 1 else ""
    timed = f"timed at {rows} rows on this machine: {times}" if times else "saved"
    return f"{chosen_kernel()} ({timed}{pad}; {choice_path()})"
