"""Split tree attention in Triton: the split-k prefix, the masked tree suffix and the log-sum-exp merge in one launch.

``_split_kernel``, grid (B * Hkv, row blocks, splits). A program takes the G query heads of one
KV head for a block of (head, token) rows, so each key / value tile is loaded once for all G
heads (grouped-query attention, no K / V copy), and walks its share of row b's prefix with
FlashAttention's online softmax, no mask: Flash-Decoding's split-k. The prefix length P_b is
read from a device tensor inside the kernel and cut there into ``splits`` chunks of whole key
tiles, so the split sizes follow the real length even when the cache's capacity is much larger.

  - the suffix inside the last split: the last split's program carries its running softmax on
    over the T tree keys (cache rows P_b .. P_b + T - 1) under the tree mask. The suffix is a
    continuation of the same online softmax, not a partial of its own: T keys are a few tiles
    at most, one more program for them would cost a launch slot and a partial's round trip.
  - the merge by the last program to finish: every program writes its partial (out, lse) to a
    float32 workspace, then takes a ticket from a per-(row, KV head, row block) counter
    (``tl.atomic_add``, acquire-release); the program that draws the last ticket merges all
    partials by log-sum-exp (out = sum_i out_i exp(lse_i - lse)), writes the output and resets
    the counter to 0 for the next call. Flash-Decoding merges in a second kernel; this is the
    "serial split-k" fix-up of CUTLASS and stream-K GEMMs, which saves that launch and needs no
    program to wait for another (no deadlock whatever order the GPU runs them in). With one
    split (a large batch fills the GPU alone) the program writes the output directly.

One launch per layer call, and nothing else: the lengths are a device tensor (or a Python int),
the tree mask is viewed as uint8 in place (``None``: causal, computed in the kernel), the
workspace and the counters come from a ``SplitWorkspace``, allocated once per shape bucket and
device and reused, and the output goes to ``out`` when given. Nothing reads a tensor's value on
the host and the grid depends only on shapes, so a CUDA graph captures the call and replays it
for new lengths. The SM count and shared-memory limit are read once per device (``tiles``).

``_prefix_kernel`` and ``_merge_kernel`` are the same stages as separate kernels, built from
the same device functions: chapter 6 teaches them one at a time, and its exercises 6.2 and 6.5
are checked against them (``minispec.grading.ch06``).

Keys and values are read from the KV cache's own layout [B, Hkv, C, hd] through strides, the
whole capacity C of a static cache included. Cache addressing lives in one function,
``_prefix_kv_rows``, so a paged cache (chapter 7, ``triton_paged``) only swaps it for a
block-table lookup.

Runs on CUDA (fp16 / bf16 / fp32 inputs, fp32 accumulation) and on CPU tensors under the
Triton interpreter: set ``TRITON_INTERPRET=1`` before triton is first imported. The
interpreter runs the programs one after another, so there the suffix's program always merges;
on a GPU any program may. fp32 products use IEEE precision (``input_precision="ieee"``):
Triton's GPU default, TF32, has a 10-bit mantissa (errors ~1e-3), which the interpreter does not
emulate. Only a GPU shows the kernel's speed, its shared-memory fit (``tiles.launch_config``),
the ordering of the workspace writes before the ticket (a CTA barrier, then the atomic's
release; the merge loads with ``.cg``, from L2) and the TF32/IEEE difference.

References: Dao et al., "FlashAttention" (2022); Dao et al., "Flash-Decoding for long-context
inference" (2023); Osama et al., "Stream-K" (2023) for the last-arriver fix-up; Tillet et al.,
"Triton" (2019).

Shapes: B batch, H = G * Hkv query heads, T tree tokens, C cache slots (C >= P_b + T), hd head dim.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .reference import check_shapes, tree_mask_3d
from .tiles import config_bytes, cuda_index, device_limits, launch_config, num_splits_for, pow2

__all__ = ["SplitWorkspace", "launch_config", "num_splits_for", "split_attention_triton"]

LOG2E = 1.4426950408889634
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # triton.jit reads it when decorating below


@triton.jit
def _prefix_kv_rows(b, hkv, n, stride_b, stride_h, stride_n):
    """Element offsets of cache tokens ``n`` (a tile of indices) of batch row b, KV head hkv.

    Contiguous cache: token n sits at row n. A paged cache replaces this body by a block-table
    lookup (page = table[b, n // PAGE], row = page * PAGE + n % PAGE)."""
    return b * stride_b + hkv * stride_h + n.to(tl.int64) * stride_n


@triton.jit
def _online_softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale):
    """One key tile of the online softmax (scores in log2 units, so exp2).

    q [BM, BD], k / v [BN, BD], visible [BM, BN] bool; running max m_i [BM], sum l_i [BM],
    unnormalised output acc [BM, BD]. Rows with no visible key so far keep m_i = -inf."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BM, BN]; fp32: no TF32 (ignored for 16-bit)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # avoid -inf - -inf for fully masked rows
    alpha = tl.exp2(m_i - m_ref)  # rescales what was accumulated under the old max
    p = tl.exp2(s - m_ref[:, None])  # [BM, BN]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _finish(acc, m_i, l_i):
    """(out [BM, BD], lse [BM] natural log) from the running state; empty rows: out 0, lse -inf."""
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    return out, lse


@triton.jit
def _load_q(Q, b, hkv, rows, d, G, T, sq_b, sq_h, sq_t, HEAD_DIM: tl.constexpr):
    """Rows r = g * T + t of KV head hkv: query head hkv * G + g, token t -> q tile [BM, BD]."""
    h, t = hkv * G + rows // T, rows % T
    ok = (rows < G * T)[:, None] & (d < HEAD_DIM)[None, :]
    return tl.load(Q + b * sq_b + h[:, None] * sq_h + t[:, None] * sq_t + d[None, :], mask=ok, other=0.0)


@triton.jit
def _store_rows(Out, out, b, hkv, rows, d, G, T, so_b, so_h, so_t, HEAD_DIM: tl.constexpr):
    """Write rows r = g * T + t of KV head hkv, out [BM, BD], to Out [B, H, T, hd] (cast to its dtype)."""
    h, t = hkv * G + rows // T, rows % T
    ok = (rows < G * T)[:, None] & (d < HEAD_DIM)[None, :]
    tl.store(Out + b * so_b + h[:, None] * so_h + t[:, None] * so_t + d[None, :], out, mask=ok)


@triton.jit
def _store_partial(O, L, out, lse, b, hkv, split, rows, d, G, T, so_b, so_h, so_s, so_t, sl_b, sl_h, sl_s,
                   HEAD_DIM: tl.constexpr):
    """Write a program's partial out [BM, BD] / lse [BM] to O [B, H, NS, T, hd] / L [B, H, NS, T]."""
    h, t = hkv * G + rows // T, rows % T
    row_ok = rows < G * T
    tl.store(O + b * so_b + h[:, None] * so_h + split * so_s + t[:, None] * so_t + d[None, :], out,
             mask=row_ok[:, None] & (d < HEAD_DIM)[None, :])
    tl.store(L + b * sl_b + h * sl_h + split * sl_s + t, lse, mask=row_ok)


@triton.jit
def _prefix_keys(q, K, V, b, hkv, start, end, d, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, m_i, l_i, acc, qk_scale,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """The online softmax over cache tokens [start, end) of row b, KV head hkv, in BLOCK_N tiles, no mask:
    only the last tile's tail past ``end`` is hidden (its loads masked, its scores -inf)."""
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # [BN] token indices
        n_ok = n < end
        ld = n_ok[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(K + _prefix_kv_rows(b, hkv, n, sk_b, sk_h, sk_n)[:, None] + d[None, :], mask=ld, other=0.0)
        v = tl.load(V + _prefix_kv_rows(b, hkv, n, sv_b, sv_h, sv_n)[:, None] + d[None, :], mask=ld, other=0.0)
        m_i, l_i, acc = _online_softmax_step(q, k, v, n_ok[None, :], m_i, l_i, acc, qk_scale)
    return m_i, l_i, acc


@triton.jit
def _tree_keys(q, K, V, M, b, hkv, rows, P, n_tree, d, G, T, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sm_b, sm_t,
               m_i, l_i, acc, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, CAUSAL: tl.constexpr):
    """The online softmax over the first ``n_tree`` (T or 0) tree keys, cache rows P .. P + n_tree - 1, under
    the tree mask M [B or 1, T, T] (uint8, 1 = attend; row stride sm_t, sm_b 0 when shared) or, CAUSAL, j <= t."""
    t_q = rows % T
    row_ok = rows < G * T
    for j0 in range(0, n_tree, BLOCK_T):
        j = j0 + tl.arange(0, BLOCK_T)  # [BT] tree key indices
        j_ok = j < n_tree
        ld = j_ok[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(K + _prefix_kv_rows(b, hkv, P + j, sk_b, sk_h, sk_n)[:, None] + d[None, :], mask=ld, other=0.0)
        v = tl.load(V + _prefix_kv_rows(b, hkv, P + j, sv_b, sv_h, sv_n)[:, None] + d[None, :], mask=ld, other=0.0)
        ok = row_ok[:, None] & j_ok[None, :]  # [BM, BT]
        if CAUSAL:
            tree = j[None, :] <= t_q[:, None]
        else:
            tree = tl.load(M + b * sm_b + t_q[:, None] * sm_t + j[None, :], mask=ok, other=0) != 0
        m_i, l_i, acc = _online_softmax_step(q, k, v, ok & tree, m_i, l_i, acc, qk_scale)
    return m_i, l_i, acc


@triton.jit
def _merge_step(m, den, acc, lse_i, o_i):
    """Fold one partial (o_i [BM, BD], lse_i [BM]) into the running merge: max m, weight sum den, output acc."""
    m_new = tl.maximum(m, lse_i)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # every part so far empty: weights exp(-inf) = 0
    alpha, w = tl.exp(m - m_ref), tl.exp(lse_i - m_ref)
    return m_new, den * alpha + w, acc * alpha[:, None] + w[:, None] * o_i


@triton.jit
def _split_kernel(Q, K, V, M, Out, Lens, P_int, WO, WL, Cnt, splits, qk_scale, Hkv, G, T,
                  sq_b, sq_h, sq_t, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sm_b, sm_t, so_b, so_h, so_t,
                  HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_T: tl.constexpr, LENS: tl.constexpr, CAUSAL: tl.constexpr):
    """Split ``split`` of row b's prefix (the last split also takes the tree), then the last program to finish
    merges all splits (module docstring). WO [slots, splits, BM, BD] / WL [slots, splits, BM] float32, Cnt
    [slots] int32 zeros, slot = (b * Hkv + hkv) * row blocks + row block; unused when splits == 1."""
    pid, rb, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, hkv = (pid // Hkv).to(tl.int64), pid % Hkv
    rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] (g, t) rows
    d = tl.arange(0, BLOCK_D)
    q = _load_q(Q, b, hkv, rows, d, G, T, sq_b, sq_h, sq_t, HEAD_DIM)  # [BM, BD]
    if LENS:
        P = tl.load(Lens + b).to(tl.int32)  # row b's committed length, read on the device
    else:
        P = P_int
    chunk = ((P + splits - 1) // splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N  # whole key tiles per split, from P
    start = split * chunk
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_i, l_i, acc = _prefix_keys(q, K, V, b, hkv, start, tl.minimum(start + chunk, P), d, sk_b, sk_h, sk_n,
                                 sv_b, sv_h, sv_n, m_i, l_i, acc, qk_scale, HEAD_DIM, BLOCK_N)
    n_tree = tl.where(split == splits - 1, T, 0)  # the last split goes on over the tree keys
    m_i, l_i, acc = _tree_keys(q, K, V, M, b, hkv, rows, P, n_tree, d, G, T, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
                               sm_b, sm_t, m_i, l_i, acc, qk_scale, HEAD_DIM, BLOCK_T, CAUSAL)
    out, lse = _finish(acc, m_i, l_i)
    if splits == 1:
        _store_rows(Out, out, b, hkv, rows, d, G, T, so_b, so_h, so_t, HEAD_DIM)
    else:
        r = tl.arange(0, BLOCK_M)
        row_ok = rows < G * T
        slot = (pid * tl.num_programs(1) + rb).to(tl.int64)
        part = slot * splits + split
        tl.store(WO + (part * BLOCK_M + r)[:, None] * BLOCK_D + d[None, :], out, mask=row_ok[:, None])
        tl.store(WL + part * BLOCK_M + r, lse, mask=row_ok)
        tl.debug_barrier()  # every thread's partial written before the ticket's release
        if tl.atomic_add(Cnt + slot, 1, sem="acq_rel") == splits - 1:  # the last ticket: all partials are in
            m = tl.full([BLOCK_M], float("-inf"), tl.float32)
            den = tl.zeros([BLOCK_M], tl.float32)
            merged = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            for i in range(0, splits):
                at = slot * splits + i
                lse_i = tl.load(WL + at * BLOCK_M + r, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
                o_i = tl.load(WO + (at * BLOCK_M + r)[:, None] * BLOCK_D + d[None, :], mask=row_ok[:, None],
                              other=0.0, cache_modifier=".cg")  # [BM, BD] from L2: other programs wrote it
                m, den, merged = _merge_step(m, den, merged, lse_i, o_i)
            merged = merged / tl.where(den > 0, den, 1.0)[:, None]
            _store_rows(Out, merged, b, hkv, rows, d, G, T, so_b, so_h, so_t, HEAD_DIM)
            tl.atomic_xchg(Cnt + slot, 0)  # ready for the next call (or graph replay)


@triton.jit
def _prefix_kernel(Q, K, V, O, L, Lens, chunk, qk_scale, Hkv, G, T,
                   sq_b, sq_h, sq_t, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
                   so_b, so_h, so_s, so_t, sl_b, sl_h, sl_s,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """The prefix stage alone (grid (B * Hkv, row blocks, splits)): split ``split`` of row b's prefix, keys
    [split * chunk, min((split + 1) * chunk, Lens[b])), no mask, its partial (out, lse) written to O, L."""
    pid, split = tl.program_id(0), tl.program_id(2)
    b, hkv = (pid // Hkv).to(tl.int64), pid % Hkv
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] (g, t) rows
    d = tl.arange(0, BLOCK_D)
    q = _load_q(Q, b, hkv, rows, d, G, T, sq_b, sq_h, sq_t, HEAD_DIM)  # [BM, BD]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    start = split * chunk
    end = tl.minimum(start + chunk, tl.load(Lens + b))  # this row's own prefix length P_b
    m_i, l_i, acc = _prefix_keys(q, K, V, b, hkv, start, end, d, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, m_i, l_i, acc,
                                 qk_scale, HEAD_DIM, BLOCK_N)
    out, lse = _finish(acc, m_i, l_i)
    _store_partial(O, L, out, lse, b, hkv, split, rows, d, G, T, so_b, so_h, so_s, so_t, sl_b, sl_h, sl_s, HEAD_DIM)


@triton.jit
def _merge_kernel(O, L, Out, T, n_parts, so_bh, so_s, so_t, sl_bh, sl_s, sout_bh, sout_t,
                  HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """The merge stage alone: Out[b, h, t] = sum_i O[b, h, i, t] * exp(L[b, h, i, t] - lse), merged online over
    the parts i."""
    bh = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    ok = (t < T)[:, None] & (d < HEAD_DIM)[None, :]
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    for i in range(0, n_parts):
        lse_i = tl.load(L + bh * sl_bh + i * sl_s + t, mask=t < T, other=float("-inf"))  # [BT]
        o_i = tl.load(O + bh * so_bh + i * so_s + t[:, None] * so_t + d[None, :], mask=ok, other=0.0)
        m, den, acc = _merge_step(m, den, acc, lse_i, o_i)
    out = acc / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(Out + bh * sout_bh + t[:, None] * sout_t + d[None, :], out, mask=ok)


class SplitWorkspace:
    """The kernel's scratch memory, allocated once per shape bucket and device and reused by every call.

    For each (device, slots, splits, BLOCK_M, BLOCK_D): float32 partials WO [slots, splits, BM, BD] and
    WL [slots, splits, BM], and int32 ticket counters [slots], zeroed once (each merge resets its own).
    A CUDA graph captures the buffers by address: they live as long as this object. Calls that share a
    workspace must not run at the same time (one stream, as minispec's decode loop; give each stream its
    own). ``output`` keeps one result buffer per (shape, dtype, device) for callers that consume each
    result before the next call (a layer's attention output, read at once by its output projection).
    """

    def __init__(self):
        self._parts: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._outs: dict[tuple, torch.Tensor] = {}

    def parts(self, device: torch.device, slots: int, splits: int, block_m: int, block_d: int):
        """(WO, WL, counters) for this bucket: allocated on its first call, the same tensors afterwards."""
        key = (device, slots, splits, block_m, block_d)
        if key not in self._parts:
            self._parts[key] = (torch.empty(slots * splits * block_m * block_d, device=device),
                                torch.empty(slots * splits * block_m, device=device),
                                torch.zeros(slots, dtype=torch.int32, device=device))
        return self._parts[key]

    def output(self, q: torch.Tensor) -> torch.Tensor:
        """A [B, H, T, hd] buffer in q's dtype and device, the same one for every call of this shape."""
        key = (q.device, q.dtype, tuple(q.shape))
        if key not in self._outs:
            self._outs[key] = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        return self._outs[key]

    @property
    def nbytes(self) -> int:
        """Bytes held (partials, counters and output buffers)."""
        tensors = [t for bufs in self._parts.values() for t in bufs] + list(self._outs.values())
        return sum(t.numel() * t.element_size() for t in tensors)


_WORKSPACES: dict[torch.device, SplitWorkspace] = {}  # the default workspace of each device (as cuBLAS keeps one)
_SMEM_CAP: dict[tuple, int] = {}  # (device, dtype, BLOCK_D) -> a limit lowered after OutOfResources


def default_workspace(device: torch.device) -> SplitWorkspace:
    """The workspace ``split_attention_triton`` uses when the caller passes none: one per device."""
    device = torch.device(device)
    if device not in _WORKSPACES:
        _WORKSPACES[device] = SplitWorkspace()
    return _WORKSPACES[device]


def check_lengths(lengths: int | torch.Tensor, B: int, T: int, C: int, device: torch.device,
                  validate: bool) -> int | torch.Tensor:
    """The committed lengths as the kernel reads them: an int P (every row, 0 <= P <= C - T), or an integer
    tensor [B] on ``device`` taken as it is (int32 or int64, no copy). ``validate`` reads a tensor's values
    on the host (0 <= P_b <= C - T): cheap on a CPU, a stall on a GPU and impossible inside a CUDA graph."""
    if not torch.is_tensor(lengths):
        if not 0 <= int(lengths) <= C - T:
            raise ValueError(f"prefix length {lengths} + {T} tree tokens must fit the {C} cached keys")
        return int(lengths)
    if lengths.shape != (B,) or lengths.dtype not in (torch.int32, torch.int64) or lengths.device != device:
        raise ValueError(f"lengths as a tensor must be an int32 / int64 integer [B={B}] on {device}, got "
                         f"{lengths.dtype} {tuple(lengths.shape)} on {lengths.device}")
    if validate and not ((lengths >= 0) & (lengths + T <= C)).all():
        raise ValueError(f"prefix lengths {lengths.tolist()} + {T} tree tokens must fit the {C} cached keys")
    return lengths


def tile_config(dtype: torch.dtype, hd: int, rows: int, device: torch.device, block_m=None, block_n=None,
                smem: int | None = None) -> dict:
    """``launch_config`` for this device: its shared memory per block (read once, cached), lowered where a
    launch has already run out of it; on a CPU the interpreter's tiles unless ``smem`` forces a GPU's choice."""
    gpu = device.type == "cuda"
    if gpu and smem is None:
        smem = device_limits(cuda_index(device))[1]
    if smem is not None:
        smem = min(smem, _SMEM_CAP.get((str(device), dtype, pow2(hd)), smem))
    return launch_config(dtype, hd, rows, gpu, block_m, block_n, smem)


def split_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: int | torch.Tensor,
                           tree_mask: torch.Tensor | None = None, num_splits: int | None = None,
                           block_m: int | None = None, block_n: int | None = None, out: torch.Tensor | None = None,
                           workspace: SplitWorkspace | None = None, smem: int | None = None,
                           validate: bool | None = None) -> torch.Tensor:
    """Split tree attention in one Triton launch; equals ``reference.split_attention`` row by row, each row
    over its own prefix.

    Args:
        q: [B, H, T, hd]; k, v: the cache [B, Hkv, C, hd] (its whole capacity; any strides with the head dim
            contiguous, e.g. views of the KV cache), row b's prefix at slots 0 .. P_b - 1 and its T new
            tokens at P_b .. P_b + T - 1.
        lengths: the committed lengths P_b: an int tensor [B] on q's device (int32 / int64; a CUDA graph
            captures it by address, so it may change between replays), or one int for every row.
        tree_mask: bool [T, T] / [B or 1, T, T] among the new tokens, None for causal.
        num_splits: prefix splits (default ``tiles.num_splits_for`` from the grid and the longest prefix
            the cache holds, C - T).
        block_m, block_n: row and key tile sizes (default: ``tiles.launch_config`` for the device).
        out: a contiguous [B, H, T, hd] buffer in q's dtype for the result (e.g. ``workspace.output(q)`` or a
            graph's static buffer); None allocates one.
        workspace: the partials' ``SplitWorkspace`` (default: one per device, ``default_workspace``).
        smem: shared memory per block to choose the tiles for (default: the device's; on a CPU, given, the
            interpreter runs the tiles a GPU with that limit would).
        validate: check the lengths' values on the host (default: on a CPU only).
    Returns:
        [B, H, T, hd] in q's dtype (``out`` when given).
    Raises:
        ValueError: shapes, devices, lengths, ``out`` that do not fit (nothing launched).
    """
    B, H, Hkv, T, hd = check_shapes(q, k, v)
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    lens = check_lengths(lengths, B, T, k.shape[2], q.device, q.device.type == "cpu" if validate is None else validate)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))  # the kernel reads hd with unit stride
    mask = None if tree_mask is None else tree_mask_3d(tree_mask, B, T, q.device)  # [B or 1, T, T] bool
    if mask is not None and mask.stride(-1) != 1:
        mask = mask.contiguous()
    out = _out_buffer(out, q)
    G = H // Hkv
    cfg = tile_config(q.dtype, hd, G * T, q.device, block_m, block_n, smem)
    workspace = workspace or default_workspace(q.device)
    while True:
        try:
            return _launch(q, k, v, lens, mask, out, cfg, num_splits, workspace)
        except triton.runtime.errors.OutOfResources:
            smaller = _step_down(q.device, q.dtype, hd, G * T, cfg, block_m, block_n)
            if smaller is None:
                raise
            cfg = smaller


def _launch(q, k, v, lens, mask, out, cfg: dict, num_splits: int | None, workspace: SplitWorkspace) -> torch.Tensor:
    """One launch of ``_split_kernel`` with the tiles ``cfg``: returns ``out``."""
    B, H, T, hd = q.shape
    Hkv, G = k.shape[1], H // k.shape[1]
    row_blocks = triton.cdiv(G * T, cfg["BLOCK_M"])
    ns = num_splits or num_splits_for(k.shape[2] - T, B * Hkv * row_blocks, cfg["BLOCK_N"], q.device)
    slots = B * Hkv * row_blocks if ns > 1 else 1  # one split: no partials (a token buffer for the pointers)
    wo, wl, cnt = workspace.parts(q.device, slots, ns, cfg["BLOCK_M"], cfg["BLOCK_D"])
    tensor = torch.is_tensor(lens)
    m = mask.view(torch.uint8) if mask is not None else None  # a view: no copy
    _split_kernel[(B * Hkv, row_blocks, ns)](
        q, k, v, m, out, lens if tensor else None, 0 if tensor else lens, wo, wl, cnt, ns, LOG2E / math.sqrt(hd),
        Hkv, G, T, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), (m.stride(0) if m.shape[0] > 1 else 0) if m is not None else 0,
        m.stride(1) if m is not None else 0, out.stride(0), out.stride(1), out.stride(2),
        HEAD_DIM=hd, BLOCK_T=min(pow2(T), cfg["BLOCK_N"]), LENS=tensor, CAUSAL=m is None, **cfg)
    return out


def _step_down(device: torch.device, dtype: torch.dtype, hd: int, rows: int, cfg: dict, block_m,
               block_n) -> dict | None:
    """After OutOfResources with ``cfg``: the next smaller configuration (None when none is left), its limit
    remembered for this device, dtype and head dim so that later calls start there."""
    need = config_bytes(cfg, dtype)
    smaller = launch_config(dtype, hd, rows, True, block_m, block_n, need - 1)
    if config_bytes(smaller, dtype) >= need:
        return None
    _SMEM_CAP[(str(device), dtype, pow2(hd))] = need - 1
    return smaller


def _out_buffer(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """``out`` checked to be a contiguous [B, H, T, hd] in q's dtype on q's device, or a new one."""
    if out is None:
        return torch.empty(q.shape, device=q.device, dtype=q.dtype)
    if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous() or out.device != q.device:
        B, H, T, hd = q.shape
        raise ValueError(f"out must be a contiguous {q.dtype} [{B}, {H}, {T}, {hd}] on {q.device}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    return out
