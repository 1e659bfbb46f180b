"""Host values onto the device without a synchronisation: a step's indices, tokens, positions, masks.

The decode loop hands the device a few host values every step: the tokens to score, their positions and
tree mask, the accepted path the KV cache keeps. ``torch.tensor(values, device="cuda")`` copies them
from pageable host memory, and PyTorch's blocking copy waits for the GPU to finish everything queued
before it (a host synchronisation, hidden in a line that looks free). ``to_device`` copies through
pinned memory instead, asynchronously, in stream order: the GPU reads the values when it reaches the
copy, and the host goes on launching. PyTorch's pinned-memory cache keeps the staging block until the
copy is done, so reuse is safe.

On the CPU (and any device that is not CUDA) this is a plain tensor: the same values, no copy more.

Reference: NVIDIA, "CUDA C++ Best Practices Guide", section "Pinned Memory" and "Asynchronous and
Overlapping Transfers with Computation".
"""

from __future__ import annotations

from typing import Sequence

import torch


def to_device(values: Sequence | torch.Tensor, device: torch.device | str,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` (nested lists of numbers, or a CPU tensor) as a tensor on ``device``.

    Args:
        values: what to copy; a tensor already on ``device`` is returned as it is.
        device: the target device. On CUDA the copy goes through pinned memory, non-blocking.
        dtype: the tensor's dtype (default: torch's inference from ``values``, or the tensor's own).
    Returns:
        The tensor on ``device``; on CUDA valid in stream order (kernels launched later read the values).
    """
    dev = torch.device(device)
    t = values if torch.is_tensor(values) else torch.tensor(values, dtype=dtype)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if t.device.type == dev.type and (dev.index is None or t.device.index == dev.index):
        return t
    if dev.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(dev, non_blocking=True)  # staged in pinned memory: no wait for the GPU
    return t.to(dev)
