"""Tile sizes and split counts of the Triton split kernel, chosen from the GPU's own limits (chapter 6).

A program of ``triton_split._split_kernel`` keeps in shared memory what its two ``tl.dot``
products read: ``num_stages`` K and V tiles of BLOCK_N x BLOCK_D elements (Triton's software
pipeline prefetches that many key tiles ahead), q's BLOCK_M x BLOCK_D tile and the BLOCK_M x
BLOCK_N probabilities cast to V's dtype. ``smem_bytes`` adds these up. ``launch_config`` takes
the first configuration of ``CONFIGS`` (largest tiles and deepest pipeline first) whose estimate
fits the device's shared memory per block:

    bf16, head dim 128      BLOCK_N 64, 3 stages: 120 KiB   H100 (227 KiB), A100 (163 KiB)
    (64 query rows)         BLOCK_N 64, 2 stages:  88 KiB   L4, A10, RTX 3090 / 4090 (99 KiB)
                            BLOCK_N 32, 2 stages:  52 KiB   T4 and other 64 KiB parts
                            BLOCK_M 32, BLOCK_N 32: 42 KiB  48 KiB without the opt-in

The estimate errs high: Triton 3.9 compiles the first of these into 48 KiB for sm90 and 40 KiB
for sm80 / sm86 / sm89 (compiled ahead of time on a CPU, ``triton.compile`` for a ``GPUTarget``),
so what it picks fits, with room; tests/test_triton_split.py compiles the kernel that way for
sm75 to sm90 and checks the compiled shared memory against each limit. Where a compiler still
reports OutOfResources at launch, ``triton_split`` steps down to the next configuration and
remembers the lower limit for that device. The device's limits (SM count, shared memory per
block) are read once per device and cached (``device_limits``), never per call. Only a GPU shows
how fast each configuration runs.

This module needs no triton: the choice is plain arithmetic, unit-tested on a CPU.

References: Tillet et al., "Triton" (2019); Dao et al., "Flash-Decoding for long-context
inference" (2023) for the number of splits.

Shapes: BLOCK_M query rows (the G query heads x T tree tokens of one KV head), BLOCK_N keys,
BLOCK_D the head dim rounded up to a power of two.
"""

from __future__ import annotations

import functools

import torch

# (BLOCK_M at most, BLOCK_N, num_stages), preferred first: big key tiles and a deep pipeline hide memory latency
CONFIGS = ((64, 64, 3), (64, 64, 2), (64, 32, 2), (32, 32, 2), (32, 16, 2), (16, 16, 1))
DEFAULT_SMEM = 163 * 1024  # an A100's opt-in shared memory per block: the limit assumed when none is given
INTERPRETER = dict(BLOCK_N=32, num_stages=1)  # the interpreter runs tiles as numpy arrays: no shared memory


def pow2(n: int, lo: int = 16) -> int:
    """The next power of two >= n, at least ``lo`` (``tl.dot`` needs every dimension >= 16)."""
    return max(lo, 1 << max(int(n) - 1, 0).bit_length())


def smem_bytes(block_m: int, block_n: int, block_d: int, num_stages: int, itemsize: int) -> int:
    """Shared memory of one program: ``num_stages`` K and V tiles, q's tile and the probabilities' tile."""
    return (num_stages * 2 * block_n * block_d + block_m * block_d + block_m * block_n) * itemsize


def launch_config(dtype: torch.dtype, hd: int, rows: int, gpu: bool, block_m: int | None = None,
                  block_n: int | None = None, smem: int | None = None) -> dict:
    """Tiles and pipeline depth of a launch (a pure function of the shapes and the limit: unit-tested on CPU).

    Args:
        dtype: the inputs' dtype; hd: head dim; rows: G * T query rows per KV head.
        gpu: a CUDA launch; else the interpreter's fixed tiles (``INTERPRETER``) unless ``smem`` is
            given, which chooses as a GPU with that limit would (to run a GPU's configuration on a CPU).
        block_m, block_n: overrides of the row and key tiles.
        smem: shared memory per block in bytes (default ``DEFAULT_SMEM``; the kernel passes the device's).
    Returns:
        dict(BLOCK_M, BLOCK_N, BLOCK_D, num_stages, num_warps): the first of ``CONFIGS`` that fits, else
        the smallest.
    """
    block_d = pow2(hd)
    if not gpu and smem is None:
        return dict(BLOCK_M=block_m or min(64, pow2(rows)), BLOCK_N=block_n or INTERPRETER["BLOCK_N"],
                    BLOCK_D=block_d, num_stages=INTERPRETER["num_stages"], num_warps=4)
    limit = DEFAULT_SMEM if smem is None else smem
    for cap, bn, stages in CONFIGS:
        bm, bn = block_m or min(cap, pow2(rows)), block_n or bn
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d, num_stages=stages, num_warps=4)
        if smem_bytes(bm, bn, block_d, stages, dtype.itemsize) <= limit:
            return cfg
    return cfg  # nothing fits the estimate: the smallest, and the compiler has the last word


def config_bytes(cfg: dict, dtype: torch.dtype) -> int:
    """``smem_bytes`` of a ``launch_config`` result."""
    return smem_bytes(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_D"], cfg["num_stages"], dtype.itemsize)


@functools.lru_cache(maxsize=None)
def device_limits(index: int) -> tuple[int, int]:
    """(SM count, shared memory per block with the opt-in, bytes) of CUDA device ``index``, read once."""
    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or getattr(props, "shared_memory_per_block", 0)
    return props.multi_processor_count, int(smem) or 48 * 1024


def cuda_index(device: torch.device) -> int:
    """The index of a CUDA device (``cuda`` without one: the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def num_splits_for(prefix_len: int, programs: int, block_n: int, device: torch.device) -> int:
    """Flash-Decoding's heuristic: enough splits that ``programs`` x splits fills the GPU about twice,
    each split at least 4 key tiles of the longest prefix the cache can hold; 1-2 splits under the
    interpreter (CPU), so that tests cover the merge.

    Args:
        prefix_len: the longest prefix (a cache's capacity minus the new tokens); programs: B * Hkv *
            row blocks; block_n: the key tile; device: the SM count is read once per device (cached).
    """
    tiles = -(-max(int(prefix_len), 1) // block_n)
    if device.type != "cuda":
        return min(2, tiles)
    sms = device_limits(cuda_index(device))[0]
    want = -(-2 * sms // max(programs, 1))
    return max(1, min(want, -(-tiles // 4)))
