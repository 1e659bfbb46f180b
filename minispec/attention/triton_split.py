"""Split tree attention in Triton: split-k prefix kernel, masked suffix kernel, log-sum-exp merge.

Three launches, each the Triton twin of a function in ``minispec.attention.reference``:

    _prefix_kernel   grid (B * Hkv, row blocks, splits). One program takes the G query heads
                     of one KV head for a block of (head, token) rows, so each key/value tile is
                     loaded once for all G heads (grouped-query attention), and walks its chunk
                     of the prefix in BLOCK_N tiles with FlashAttention's online softmax. No
                     mask: only the tile's tail past the prefix is masked off. Writes a partial
                     (out, lse) per split: Flash-Decoding's split-k.
    _suffix_kernel   grid (B * Hkv, row blocks). The same loop over the T tree keys with the
                     boolean tree mask; writes its (out, lse) as one more "split".
    _merge_kernel    grid (B * H, token blocks). Merges all partials by log-sum-exp:
                     out = sum_i out_i exp(lse_i - lse), lse = log sum_i exp(lse_i).

Keys and values are read from the KV cache's own layout [B, Hkv, S, hd] through strides (the
views ``KVCache.write`` returns). Prefix addressing lives in one function, ``_prefix_kv_rows``,
so a paged cache (chapter 7) only swaps it for a block-table lookup.

The prefix lengths are a device tensor [B] int32 that the kernels read (row b's tree keys sit at
cache rows P_b .. P_b + T - 1), so one launch serves rows of different lengths and a CUDA graph
captured once can replay for new lengths (a GPU test checks it: test_gpu_split_triton_graph_
replays_with_new_prefix_lengths); the launch grid depends only on shapes (the splits cover the
largest prefix the cache holds, S - T). The partial results of the splits live in one float32
workspace allocated once per call, or passed in and reused.

Runs on CUDA (fp16 / bf16 / fp32 inputs, fp32 accumulation) and on CPU tensors under the
Triton interpreter: set ``TRITON_INTERPRET=1`` before triton is first imported. fp32 products
use IEEE precision (``input_precision="ieee"``): Triton's GPU default, TF32, has a 10-bit
mantissa (errors ~1e-3), which the interpreter does not emulate, so the 1e-5 tolerances of the
CPU tests would hold there and not on a GPU. Only a GPU shows the kernels' speed, their
shared-memory fit (``launch_config``) and the TF32/IEEE difference.

References: Dao et al., "FlashAttention" (2022); Dao et al., "Flash-Decoding for long-context
inference" (2023); Tillet et al., "Triton" (2019).

Shapes: B batch, H = G * Hkv query heads, T tree tokens, P prefix tokens, S = P + T (S >= P_b + T
with per-row lengths P_b), hd head dim.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .reference import check_shapes, tree_mask_3d

LOG2E = 1.4426950408889634
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # triton.jit reads it when decorating below


@triton.jit
def _prefix_kv_rows(b, hkv, n, stride_b, stride_h, stride_n):
    """Element offsets of prefix tokens ``n`` (a tile of indices) of batch b, KV head hkv.

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
def _store_partial(O, L, out, lse, b, hkv, split, rows, d, G, T, so_b, so_h, so_s, so_t, sl_b, sl_h, sl_s,
                   HEAD_DIM: tl.constexpr):
    """Write a program's partial out [BM, BD] / lse [BM] to O [B, H, NS, T, hd] / L [B, H, NS, T]."""
    h, t = hkv * G + rows // T, rows % T
    row_ok = rows < G * T
    tl.store(O + b * so_b + h[:, None] * so_h + split * so_s + t[:, None] * so_t + d[None, :], out,
             mask=row_ok[:, None] & (d < HEAD_DIM)[None, :])
    tl.store(L + b * sl_b + h * sl_h + split * sl_s + t, lse, mask=row_ok)


@triton.jit
def _prefix_kernel(Q, K, V, O, L, Lens, chunk, qk_scale, Hkv, G, T,
                   sq_b, sq_h, sq_t, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
                   so_b, so_h, so_s, so_t, sl_b, sl_h, sl_s,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Split ``split`` of row b's prefix, keys [split * chunk, min((split + 1) * chunk, Lens[b])), no mask."""
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
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # [BN] token indices
        n_ok = n < end  # the last tile may run past the prefix (P not a multiple of BLOCK_N)
        ld = n_ok[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(K + _prefix_kv_rows(b, hkv, n, sk_b, sk_h, sk_n)[:, None] + d[None, :], mask=ld, other=0.0)
        v = tl.load(V + _prefix_kv_rows(b, hkv, n, sv_b, sv_h, sv_n)[:, None] + d[None, :], mask=ld, other=0.0)
        visible = n_ok[None, :] & (rows >= 0)[:, None]  # [BM, BN]: no tree mask over the prefix
        m_i, l_i, acc = _online_softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale)
    out, lse = _finish(acc, m_i, l_i)
    _store_partial(O, L, out, lse, b, hkv, split, rows, d, G, T, so_b, so_h, so_s, so_t, sl_b, sl_h, sl_s, HEAD_DIM)


@triton.jit
def _suffix_kernel(Q, K, V, M, O, L, Lens, split, qk_scale, Hkv, G, T,
                   sq_b, sq_h, sq_t, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sm_b, sm_t,
                   so_b, so_h, so_s, so_t, sl_b, sl_h, sl_s,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """The T tree keys at cache rows P_b..P_b+T-1 (P_b = Lens[b]), masked by M [B or 1, T, T] (uint8, 1 = attend)."""
    pid = tl.program_id(0)
    b, hkv = (pid // Hkv).to(tl.int64), pid % Hkv
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    t_q = rows % T
    row_ok = rows < G * T
    d = tl.arange(0, BLOCK_D)
    q = _load_q(Q, b, hkv, rows, d, G, T, sq_b, sq_h, sq_t, HEAD_DIM)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    prefix_len = tl.load(Lens + b)
    for j0 in range(0, T, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)  # [BN] tree key indices
        j_ok = j < T
        ld = j_ok[:, None] & (d < HEAD_DIM)[None, :]
        rows_kv = (prefix_len + j).to(tl.int64)
        k = tl.load(K + b * sk_b + hkv * sk_h + rows_kv[:, None] * sk_n + d[None, :], mask=ld, other=0.0)
        v = tl.load(V + b * sv_b + hkv * sv_h + rows_kv[:, None] * sv_n + d[None, :], mask=ld, other=0.0)
        ok = row_ok[:, None] & j_ok[None, :]
        tree = tl.load(M + b * sm_b + t_q[:, None] * sm_t + j[None, :], mask=ok, other=0)  # [BM, BN]
        m_i, l_i, acc = _online_softmax_step(q, k, v, ok & (tree != 0), m_i, l_i, acc, qk_scale)
    out, lse = _finish(acc, m_i, l_i)
    _store_partial(O, L, out, lse, b, hkv, split, rows, d, G, T, so_b, so_h, so_s, so_t, sl_b, sl_h, sl_s, HEAD_DIM)


@triton.jit
def _merge_kernel(O, L, Out, T, n_parts, so_bh, so_s, so_t, sl_bh, sl_s, sout_bh, sout_t,
                  HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Out[b, h, t] = sum_i O[b, h, i, t] * exp(L[b, h, i, t] - lse), merged online over the parts i."""
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
        m_new = tl.maximum(m, lse_i)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha, w = tl.exp(m - m_ref), tl.exp(lse_i - m_ref)
        den = den * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o_i
        m = m_new
    out = acc / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(Out + bh * sout_bh + t[:, None] * sout_t + d[None, :], out, mask=ok)


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(max(int(n), 1)))


def launch_config(dtype: torch.dtype, hd: int, rows: int, gpu: bool, block_m: int | None = None,
                  block_n: int | None = None) -> dict:
    """Tiles and pipeline depth of a prefix launch (a pure function of the shapes: unit-tested on CPU).

    Shared memory holds ``num_stages`` K and V tiles of BLOCK_N x BLOCK_D elements (plus q's
    tile). With 2-byte inputs and hd 128, BLOCK_N 64 over 3 stages (Triton's default) is 96 KiB;
    fp32 doubles it to 192 KiB, past an A100's 164 KiB (and all but the H100's 227 KiB once q's
    32 KiB tile is added), so 4-byte inputs take BLOCK_N 32 and 2 stages: 32 KiB of K / V per
    stage, 64 KiB. Only a GPU shows the fit: a launch that does not fit raises OutOfResources.

    Args:
        dtype: the inputs' dtype; hd: head dim; rows: G * T query rows per KV head.
        gpu: CUDA launch (else the interpreter: BLOCK_N 32, the stages are ignored).
        block_m, block_n: overrides of the row and key tiles.
    Returns:
        dict(BLOCK_M, BLOCK_N, BLOCK_D, num_stages, num_warps).
    """
    wide = dtype.itemsize >= 4  # fp32 (fp64): twice the bytes per tile of fp16 / bf16
    return dict(BLOCK_M=block_m or min(64, _pow2(rows)), BLOCK_N=block_n or (64 if gpu and not wide else 32),
                BLOCK_D=_pow2(hd), num_stages=2 if wide else 3, num_warps=4)


def prefix_lengths(prefix_len: int | torch.Tensor, B: int, T: int, S: int, device: torch.device) -> torch.Tensor:
    """The prefix lengths as the kernels read them: [B] int32 on ``device``.

    An int (every row's P, with S = P + T keys) is checked and turned into a tensor. A tensor
    [B] (int32 avoids a conversion) is taken as it is: row b's tree keys are cache rows
    P_b .. P_b + T - 1, so 0 <= P_b <= S - T; this is checked only on the CPU, since reading a
    GPU tensor back would stall the stream and cannot happen inside a CUDA graph."""
    if not torch.is_tensor(prefix_len):
        if prefix_len < 0 or prefix_len + T != S:
            raise ValueError(f"prefix_len={prefix_len} + {T} tree tokens != {S} keys")
        return torch.full((B,), prefix_len, dtype=torch.int32, device=device)
    if prefix_len.shape != (B,) or prefix_len.is_floating_point() or prefix_len.device != device:
        raise ValueError(f"prefix_len as a tensor must be integer [B={B}] on {device}, got {prefix_len.dtype} "
                         f"{tuple(prefix_len.shape)} on {prefix_len.device}")
    if device.type == "cpu" and not ((prefix_len >= 0) & (prefix_len + T <= S)).all():
        raise ValueError(f"prefix lengths {prefix_len.tolist()} + {T} tree tokens must fit {S} keys")
    return prefix_len.to(torch.int32)  # [B]; no copy when already int32


def num_splits_for(prefix_len: int, programs: int, block_n: int, device: torch.device) -> int:
    """Flash-Decoding's heuristic: enough splits that B * Hkv * row blocks * splits fills the GPU
    about twice, each split at least 4 tiles; 1-2 splits under the interpreter (CPU)."""
    tiles = triton.cdiv(max(prefix_len, 1), block_n)
    if device.type != "cuda":
        return min(2, tiles)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = triton.cdiv(2 * sms, max(programs, 1))
    return max(1, min(want, triton.cdiv(tiles, 4)))


def workspace_numel(B: int, H: int, T: int, hd: int, num_splits: int) -> int:
    """float32 elements of the partials: out [B, H, NS + 1, T, hd] then lse [B, H, NS + 1, T]."""
    return B * H * (num_splits + 1) * T * (hd + 1)


def split_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int | torch.Tensor,
                           tree_mask: torch.Tensor | None, num_splits: int | None = None,
                           block_m: int | None = None, block_n: int | None = None,
                           out: torch.Tensor | None = None, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """Split tree attention with the Triton kernels; equals ``reference.split_attention`` (row by row
    with its own prefix length when ``prefix_len`` is a tensor).

    Args:
        q: [B, H, T, hd]; k, v: [B, Hkv, S, hd], any strides with the head dim contiguous (e.g.
            views of the KV cache).
        prefix_len: P, committed tokens (may be 0), with S = P + T; or a tensor [B] (int32 on q's
            device) of per-row lengths P_b, row b's tree keys at cache rows P_b .. P_b + T - 1
            (S >= P_b + T; a CUDA graph captures it by address, so it may change between replays).
        tree_mask: bool [T, T] / [B or 1, T, T] among the tree tokens, None for causal.
        num_splits: prefix splits (default: a heuristic from the grid size and the GPU).
        block_m, block_n: row and key tile sizes (default ``launch_config``).
        out: optional [B, H, T, hd] result buffer in q's dtype (reused, e.g. by a graph).
        workspace: optional float32 buffer of at least ``workspace_numel`` elements for the partials.
    Returns:
        [B, H, T, hd] in q's dtype (``out`` when given).
    """
    B, H, Hkv, T, hd = check_shapes(q, k, v)
    q, k, v, lens, mask = _kernel_inputs(q, k, v, prefix_len, tree_mask)
    cfg = launch_config(q.dtype, hd, (H // Hkv) * T, q.device.type == "cuda", block_m, block_n)
    row_blocks = triton.cdiv((H // Hkv) * T, cfg["BLOCK_M"])
    P_max = k.shape[2] - T  # the splits cover the longest prefix the keys can hold; shorter rows leave splits empty
    ns = num_splits or num_splits_for(P_max, B * Hkv * row_blocks, cfg["BLOCK_N"], q.device)
    parts_o, parts_l = _partials(workspace, B, H, T, hd, ns, q.device)  # [B, H, ns + 1, T, hd], [B, H, ns + 1, T]
    chunk = triton.cdiv(triton.cdiv(P_max, ns), cfg["BLOCK_N"]) * cfg["BLOCK_N"]  # whole tiles per split
    _launch_parts(q, k, v, mask, lens, parts_o, parts_l, cfg, row_blocks, ns, chunk)
    return _launch_merge(parts_o, parts_l, _out_buffer(out, q), cfg["BLOCK_D"])


def _kernel_inputs(q, k, v, prefix_len, tree_mask):
    """q, k, v with a unit stride on hd, the prefix lengths [B] int32 and the tree mask [B or 1, T, T]
    as uint8 (a view, no copy), all checked to sit on q's device."""
    B, _, T, _ = q.shape
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    lens = prefix_lengths(prefix_len, B, T, k.shape[2], q.device)  # [B] int32
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))  # kernels assume unit stride on hd
    mask = tree_mask_3d(tree_mask, B, T, q.device)  # [B or 1, T, T] bool
    mask = mask.view(torch.uint8) if mask.stride(-1) == 1 else mask.contiguous().view(torch.uint8)  # no copy
    return q, k, v, lens, mask


def _partials(workspace: torch.Tensor | None, B: int, H: int, T: int, hd: int, ns: int, device):
    """The float32 partials of the ns prefix splits and the suffix, in ``workspace`` (checked) or a new
    allocation: out [B, H, ns + 1, T, hd], lse [B, H, ns + 1, T]."""
    n = workspace_numel(B, H, T, hd, ns)
    if workspace is None:
        workspace = torch.empty(n, device=device, dtype=torch.float32)  # one allocation per call
    elif workspace.numel() < n or workspace.dtype != torch.float32 or not workspace.is_contiguous() \
            or workspace.device != device:
        raise ValueError(f"workspace must be a contiguous float32 tensor of >= {n} elements on {device}, got "
                         f"{workspace.dtype} {workspace.numel()} on {workspace.device}")
    workspace = workspace.view(-1)
    parts_o = workspace[:B * H * (ns + 1) * T * hd].view(B, H, ns + 1, T, hd)  # splits + suffix
    parts_l = workspace[B * H * (ns + 1) * T * hd:n].view(B, H, ns + 1, T)
    return parts_o, parts_l


def _launch_parts(q, k, v, mask, lens, parts_o, parts_l, cfg: dict, row_blocks: int, ns: int, chunk: int) -> None:
    """The prefix kernel (ns splits of ``chunk`` keys, no mask) and the suffix kernel (the tree, masked)
    write their partial outputs and log-sum-exps into parts_o, parts_l."""
    B, H, T, hd = q.shape
    Hkv, G = k.shape[1], H // k.shape[1]
    qk_scale = LOG2E / math.sqrt(hd)
    so, sl = parts_o.stride(), parts_l.stride()
    _prefix_kernel[(B * Hkv, row_blocks, ns)](
        q, k, v, parts_o, parts_l, lens, chunk, qk_scale, Hkv, G, T,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), so[0], so[1], so[2], so[3], sl[0], sl[1], sl[2], HEAD_DIM=hd, **cfg)
    _suffix_kernel[(B * Hkv, row_blocks)](
        q, k, v, mask, parts_o, parts_l, lens, ns, qk_scale, Hkv, G, T,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(1),
        so[0], so[1], so[2], so[3], sl[0], sl[1], sl[2], HEAD_DIM=hd, **dict(cfg, BLOCK_N=_pow2(min(T, 64))))


def _out_buffer(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """``out`` checked to be a contiguous [B, H, T, hd] in q's dtype, or a new one."""
    if out is None:
        return torch.empty(q.shape, device=q.device, dtype=q.dtype)
    if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        B, H, T, hd = q.shape
        raise ValueError(f"out must be a contiguous {q.dtype} [{B}, {H}, {T}, {hd}], got {out.dtype} "
                         f"{tuple(out.shape)}")
    return out


def _launch_merge(parts_o: torch.Tensor, parts_l: torch.Tensor, out: torch.Tensor, block_d: int) -> torch.Tensor:
    """Merge the ns + 1 partials of every row by their log-sum-exps into ``out`` [B, H, T, hd]."""
    B, H, parts, T, hd = parts_o.shape
    BLOCK_T = min(64, _pow2(T, lo=1))
    po, pl = parts_o.view(B * H, parts, T, hd), parts_l.view(B * H, parts, T)
    ov = out.view(B * H, T, hd)
    _merge_kernel[(B * H, triton.cdiv(T, BLOCK_T))](
        po, pl, ov, T, parts, po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
        ov.stride(0), ov.stride(1), HEAD_DIM=hd, BLOCK_T=BLOCK_T, BLOCK_D=block_d)
    return out
