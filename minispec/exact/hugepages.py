"""Weight panels in 2 MiB pages: an uninitialised CPU tensor that Linux is asked to back with transparent
huge pages.

Why: a decode step streams every weight once. With 4 KiB pages that is a page-table walk every 4 KiB (two
nested ones in a virtual machine), and the CPU's prefetchers stop at each page's end; with 2 MiB pages both
go away where the host backs the memory with large pages too (``benchmarks/huge_pages.py`` measures it side
by side; ``docs/results.md`` has the figures). The values, and so every bit computed from them, are the same
either way.
"""

from __future__ import annotations

import mmap

import torch

from ..config import thp_mode

HUGE_PAGE = 2 << 20  # bytes of a huge page (x86-64 and arm64 Linux)
# ask for them where Linux may give them (THP "always" or "madvise"); ``False`` for before/after measurements
HUGE_PAGES = hasattr(mmap, "MADV_HUGEPAGE") and thp_mode() in ("always", "madvise")


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised CPU tensor that starts on a 2 MiB boundary in memory that Linux is asked to back with
    transparent huge pages (``madvise(MADV_HUGEPAGE)``, honoured where THP is "madvise" or "always"); a plain
    ``torch.empty`` where ``HUGE_PAGES`` is off or the tensor is smaller than one huge page."""
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
