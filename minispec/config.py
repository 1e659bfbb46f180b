"""Project-wide switches, read in one place.

    MINISPEC_FAST=1     fast mode: notebooks and benchmarks scale sample counts and sizes down (CI sets it)
    MINISPEC_CACHE=dir  where downloaded and converted models live (default ~/.cache/minispec)
"""

from __future__ import annotations

import os
import re
from pathlib import Path


def fast() -> bool:
    """True when MINISPEC_FAST is set to a true value (1, true, yes)."""
    return os.environ.get("MINISPEC_FAST", "").strip().lower() in ("1", "true", "yes")


def cache_dir(create: bool = True) -> Path:
    """The model cache directory (created on demand; ``create=False``: its path only, for a reader)."""
    d = Path(os.environ.get("MINISPEC_CACHE") or Path.home() / ".cache" / "minispec").expanduser()
    if create:
        d.mkdir(parents=True, exist_ok=True)
    return d


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (None where there is none): what a calibration and a
    result file name the machine by."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        return None


def thp_mode() -> str | None:
    """Linux's transparent huge page mode ("always", "madvise" or "never"; None where there is none): whether
    memory that asks for 2 MiB pages (``minispec.exact.hugepages.huge_page_empty``) gets them."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return re.search(r"\[(\w+)\]", f.read()).group(1)
    except (OSError, AttributeError):
        return None


def file_tag(name: str) -> str:
    """``name`` as a file-name part: every run of other characters than letters, digits, '.' and '-' as one '_'."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", name).strip("_")


def cpu_tag(*parts: str) -> str:
    """This CPU as a file-name part: its model, its vector instruction set as torch sees it (one model name
    can cover CPUs with and without AVX-512), ``parts``, and torch's running thread count (a measurement made
    on 2 threads does not hold for 1). What the cached measurements (a calibration, a kernel choice) hold for."""
    import torch

    return file_tag("-".join([cpu_model() or "cpu", torch.backends.cpu.get_cpu_capability(), *parts,
                              f"{torch.get_num_threads()}t"]))
