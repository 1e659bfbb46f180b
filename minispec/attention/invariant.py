"""Row-invariant attention: each query row's result does not depend on how many rows or keys come with it.

Why: greedy speculative decoding is exact only if the target's logits for a verified token
equal, bit for bit, the logits vanilla decoding computes for it. Vanilla sends one row per
step; verification sends the root and N draft tokens at once, over a cache that is longer by
the tree. A fused attention kernel (PyTorch's CPU SDPA, for instance) blocks its reductions
over keys and queries by sizes that depend on how many there are, so the same row reduces in
a different order (different rounding, ~1e-7 here, ~1e-5 after 30 layers) as the row count
changes, and an argmax near-tie can flip. Batch-invariant inference (He and Thinking Machines,
"Defeating Nondeterminism in LLM Inference", 2025; vLLM's and SGLang's batch-invariant modes)
fixes the order of every reduction; this is that idea for one attention step, in plain PyTorch:

    s   = (q / sqrt(hd)) @ k^T                      a dot product over hd per (row, key); k^T is
                                                    row-major (the CPU cache stores keys last)
    s   = -inf where the mask hides a key
    m   = max over keys of s                        max is exact in any order
    p   = exp(s - m)                                elementwise; a hidden key gives exactly 0
    o   = p @ v,  l = p @ 1                         numerator and denominator by matrix products
                                                    whose reductions run along the keys in key
                                                    order, over fixed blocks of KEY_BLOCK keys
                                                    counted from key 0, the block products added
                                                    in block order: a hidden key adds an exact 0
                                                    wherever it sits (``l`` takes 16 columns of
                                                    ones: one column would be a matrix-vector
                                                    product, whose kernel sums in lanes by key
                                                    position)
    out = o / l

so the visible keys of a row (the committed prefix, then the row's tree ancestors in tree
order, then itself: the very keys vanilla sees for that token) are summed in the same order
whatever else is in the batch. What this relies on: a matrix product of two row-major operands
computes each element the same way whatever the other rows and columns hold and however many
there are, so a hidden key's exact zero leaves the sum of the others as it was. Measured
exceptions, each avoided here:

    one row or one column          a matrix-vector kernel: query rows are padded to two, and
                                   the last block of keys to MIN_BLOCK_KEYS with hidden keys;
    a column-major operand         other kernels, whose result for a row depends on its place
                                   among few rows: the keys are read as a row-major k^T, which
                                   the CPU KV cache stores as such (``kv.contiguous.zeros_keys_last``);
    products under 400 multiply-adds   PyTorch's CPU ``bmm`` runs them in a loop kernel of its
                                   own: rows are padded up;
    a long reduction               MKL splits it into blocks whose size depends on its length
                                   (past ~512 keys with its AVX-512 kernels, ~200 with AVX2):
                                   hence the fixed key blocks;
    a scale inside the product     ``baddbmm``'s alpha is applied in another order for some
                                   shapes (MKL, 2 threads, hd = 8): q is scaled first;
    partial row / column blocks    MKL's AVX2 kernels compute rows in blocks of 6 and columns in
                                   blocks of 16, and a last, partial block in another order.

The last depends on the CPU, so ``attention_plan`` probes it once per head dim and thread count
and picks the cheapest ``AttentionPlan``: query rows padded to a multiple of m, keys padded with
hidden ones to whole blocks (every product then has one shape), or neither (MKL's AVX-512
kernels). ``tests/test_invariance.py`` checks the property on random shapes and trees on
whatever CPU runs the tests, with stand-in products for the CPU-dependent cases;
``python -m minispec check-env`` reports the plan and the property for this machine.

The cost over a fused kernel is the score matrix [rows, S] in memory (small while decoding;
a long prefill is chunked by rows, which changes nothing since rows are independent) and two
products per block of keys.

Shapes: B batch, H query heads, Hkv KV heads, G = H / Hkv, T query rows, S keys, hd head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..invariance import padded_rows
from .reference import check_shapes

MIN_ROWS = 2  # products over fewer query rows go to a matrix-vector kernel with its own order
BMM_NAIVE_BELOW = 400  # PyTorch's CPU bmm runs products with rows * cols * inner < 400 in a loop kernel of
#                        its own, with another order than its BLAS path: pad rows to stay above it
ONES_COLS = 16  # columns of the ones matrix that sums p (so that it is a matrix product too)
KEY_BLOCK = 256  # keys per product of p with v: a BLAS blocks a long reduction by sizes that depend on its
#                  length (MKL: above ~512 keys on AVX-512, ~200 on AVX2), so p @ v is summed over fixed
#                  blocks of keys counted from key 0, the block products added in block order
MIN_BLOCK_KEYS = 16  # the last block is padded with hidden keys up to this (a product of at least 2 x 16 x 16)
ROW_MULTIPLES = (1, 2, 4, 6, 8, 12, 16)  # query rows per product may be rounded up to a multiple of these
ROW_CHUNK = 2048  # query rows (g, t) per product: bounds the score matrix of a long prefill


@dataclass(frozen=True)
class AttentionPlan:
    """How ``invariant_attention`` shapes its products on this machine (chosen by ``attention_plan``).

    row_multiple: query rows per product padded with zero queries to a multiple of this (at least
        MIN_ROWS); pad_keys: keys padded with hidden ones to a multiple of KEY_BLOCK, so that every
        product has one shape whatever the key count (a BLAS whose last, partial block of columns or
        of the reduction is computed in another order); invariant: whether the probe found the rows
        independent of their company under this plan.
    """
    row_multiple: int = 1
    pad_keys: bool = False
    invariant: bool = True

    def describe(self) -> str:
        how = [f"query rows padded to a multiple of {self.row_multiple}"] if self.row_multiple > 1 else []
        how += [f"keys padded to a multiple of {KEY_BLOCK}"] if self.pad_keys else []
        return ", ".join([f"keys summed in blocks of {KEY_BLOCK}"] + how)


_PLANS: dict[tuple, AttentionPlan] = {}  # cache: (hd, dtype, threads) -> the plan probed on this CPU


def attention_plan(hd: int, dtype: torch.dtype = torch.float32) -> AttentionPlan:
    """The cheapest ``AttentionPlan`` under which rows of head dim ``hd`` are row-invariant on this CPU at
    the running thread count: probed once (random queries over prefixes of 0 to 600 keys, 1 to 33
    rows against 40, each row compared bit for bit), cached. With none invariant, the plain plan
    with ``invariant=False`` (``check-env`` warns)."""
    key = (hd, dtype, torch.get_num_threads())
    if key not in _PLANS:
        candidates = [AttentionPlan(m, pad) for m in ROW_MULTIPLES for pad in (False, True)]
        _PLANS[key] = next((c for c in candidates if _rows_invariant(c, hd, dtype)),
                           AttentionPlan(invariant=False))
    return _PLANS[key]


PROBE_LAYOUTS = ((1, 1, 1), (1, 3, 3), (2, 1, 4))  # (B, Hkv, G) the probe tries: a BLAS may thread a batch of
#                                                  products otherwise than one product


def _rows_invariant(plan: AttentionPlan, hd: int, dtype: torch.dtype) -> bool:
    """Do the rows of a causal block of N queries after a prefix of P keys equal, bit for bit, those of its
    first n queries alone, under ``plan``, for each of PROBE_LAYOUTS?"""
    g = torch.Generator().manual_seed(0)
    N = 40
    with torch.no_grad():
        for B, Hkv, G in PROBE_LAYOUTS:
            for P in (0, 5, 24, 250, 517):
                q, k, v = (torch.randn(B, h, n, hd, generator=g).to(dtype)
                           for h, n in ((Hkv * G, N), (Hkv, P + N), (Hkv, P + N)))
                full = invariant_attention(q, k, v, plan=plan)
                for n in (1, 2, 3, 4, 5, 7, 9, 13, 33):
                    if not torch.equal(invariant_attention(q[:, :, :n], k[:, :, :P + n], v[:, :, :P + n], plan=plan),
                                       full[:, :, :n]):
                        return False
    return True


def invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: torch.Tensor | None = None, plan: AttentionPlan | None = None) -> torch.Tensor:
    """Softmax attention whose every row is computed as it would be alone.

    Args:
        q: [B, H, T, hd] queries; k, v: [B, Hkv, S, hd] keys and values.
        mask: bool (True = may attend) of shape [T, S] or [B or 1, 1, T, S], or None: causal with
            the T queries at the last T key positions (every key visible when T = 1).
        plan: how to shape the products; None: ``attention_plan`` probed for this CPU (on another
            device, where minispec claims no row invariance, the plain plan).
    Returns:
        [B, H, T, hd] in q's dtype. Every row must see at least one key.
    """
    B, H, Hkv, T, hd = check_shapes(q, k, v)
    S, G = k.shape[2], H // Hkv
    if plan is None:
        plan = attention_plan(hd, q.dtype) if q.device.type == "cpu" else AttentionPlan()
    if mask is None and T > 1:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)  # [T, S]
    hidden = None
    if mask is not None:
        if mask.dtype != torch.bool or mask.shape[-2:] != (T, S) or mask.dim() not in (2, 4):
            raise ValueError(f"mask must be boolean [{T}, {S}] or [B or 1, 1, {T}, {S}], got {mask.dtype} "
                             f"{tuple(mask.shape)}")
        hidden = ~(mask if mask.dim() == 4 else mask[None, None])[:, :, None]  # [B or 1, 1, 1, T, S]
    qg = q.reshape(B, Hkv, G * T, hd)  # the G query heads of a KV head as rows (g, t)
    if G * T <= ROW_CHUNK:
        out = _rows(qg, k, v, hidden, G, T, plan)
    else:  # a long prefill: rows are independent, so chunks change no bit
        t_chunk = max(1, ROW_CHUNK // G)
        out = torch.cat([_rows(qg.unflatten(2, (G, T))[:, :, :, t0:t0 + t_chunk].flatten(2, 3), k, v,
                               None if hidden is None else hidden[..., t0:t0 + t_chunk, :], G,
                               min(t_chunk, T - t0), plan).unflatten(2, (G, -1)) for t0 in range(0, T, t_chunk)], dim=3)
    return out.reshape(B, H, T, hd)


_ONES: dict[tuple, torch.Tensor] = {}  # cache: (dtype, device) -> the largest [n, ONES_COLS] ones made so far


def _ones(S: int, like: torch.Tensor) -> torch.Tensor:
    """[S, ONES_COLS] ones of ``like``'s dtype and device (a view of a cached, never written buffer)."""
    key = (like.dtype, like.device)
    if key not in _ONES or _ONES[key].shape[0] < S:
        with torch.inference_mode(False), torch.no_grad():
            _ONES[key] = torch.ones(max(S, 2 * _ONES[key].shape[0] if key in _ONES else 1024), ONES_COLS,
                                    dtype=like.dtype, device=like.device)
    return _ONES[key][:S]


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[BH, R, K] @ [BH, K, C] or [R, K] @ [K, C]: every product of the attention goes through here (a test
    swaps in a stand-in)."""
    return torch.bmm(a, b) if a.dim() == 3 else torch.mm(a, b)


def padded_keys(S: int, pad_keys: bool) -> int:
    """How many keys the products run over for S keys: a multiple of KEY_BLOCK (``pad_keys``), else S with
    its last block padded to at least MIN_BLOCK_KEYS keys."""
    if pad_keys:
        return -(-S // KEY_BLOCK) * KEY_BLOCK
    last = S % KEY_BLOCK
    return S if last == 0 or last >= MIN_BLOCK_KEYS else S + MIN_BLOCK_KEYS - last


def _rows(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor | None, G: int,
          T: int, plan: AttentionPlan) -> torch.Tensor:
    """Attention of the query rows qg [B, Hkv, G*T, hd] (rows (g, t)) -> [B, Hkv, G*T, hd].

    Every product has two row-major operands, at least two rows and MIN_BLOCK_KEYS keys, at least
    BMM_NAIVE_BELOW multiply-adds, and reduces over at most KEY_BLOCK keys: the regime in which a
    BLAS computes an element the same way whatever the other rows and columns are
    (``tests/test_invariance.py``); ``plan`` adds what this CPU's BLAS needs beyond that.
    """
    B, Hkv, R, hd = qg.shape
    S = k.shape[2]
    kt = k.transpose(-1, -2)  # [B, Hkv, hd, S]: row-major when the cache stores keys last (KVCache on the CPU)
    S_ = padded_keys(S, plan.pad_keys)
    if S_ > S:  # hidden zero keys (p = 0 for them, so they add exact zeros)
        kt, v = F.pad(kt, (0, S_ - S)), F.pad(v, (0, 0, 0, S_ - S))
        hidden = F.pad(hidden if hidden is not None else torch.zeros(1, 1, 1, T, S, dtype=torch.bool, device=k.device),
                       (0, S_ - S), value=True)
    elif kt.stride(-1) != 1:
        kt = kt.contiguous()  # a copy of the keys, for any other layout
    last = S_ - (S_ - 1) // KEY_BLOCK * KEY_BLOCK  # keys in the last block
    per_row = min(hd * S_, last * (hd + ONES_COLS))  # multiply-adds per row of the smallest product
    R2 = padded_rows(R, max(MIN_ROWS, -(-BMM_NAIVE_BELOW // per_row)), plan.row_multiple)
    qg = qg * (1.0 / math.sqrt(hd))  # scaled here, elementwise: a BLAS may apply a product's alpha in another
    #                                  order for some shapes (MKL at 2 threads, hd = 8)
    if R2 > R:  # pad with zero queries; their results are dropped
        qg = F.pad(qg, (0, 0, 0, R2 - R))
    s = _product(qg.reshape(B * Hkv, R2, hd), kt.reshape(B * Hkv, hd, S_)).view(B, Hkv, R2, S_)  # [B, Hkv, R', S']
    if hidden is not None:  # view the first G*T rows as [G, T] so the [., 1, 1, T, S'] mask broadcasts
        s[:, :, :R].unflatten(2, (G, T)).masked_fill_(hidden, float("-inf"))
    if torch.is_grad_enabled() and s.requires_grad:  # training (a draft model): autograd keeps s
        p = torch.exp(s - s.amax(dim=-1, keepdim=True))
    else:
        p = s.sub_(s.amax(dim=-1, keepdim=True)).exp_()  # [B, Hkv, R', S']; hidden keys exactly 0
    p3, v3, ones = p.view(B * Hkv, R2, S_), v.reshape(B * Hkv, S_, hd), _ones(S_, v)  # [BH, R', S'], [BH, S', hd], [S', 16]
    o = l = None
    for s0 in range(0, S_, KEY_BLOCK):  # sums in key order, block by block: a key's place never moves
        n = min(KEY_BLOCK, S_ - s0)
        pb, vb, ob = (p3, v3, ones) if n == S_ else (p3.narrow(2, s0, n), v3.narrow(1, s0, n), ones.narrow(0, s0, n))
        lb = _product(pb.reshape(B * Hkv * R2, n), ob)  # [BH * R', 16]: the rows' sums of p ([BH, R', Sb] @ [Sb, 16])
        ob = _product(pb, vb)  # [BH, R', hd]
        o, l = (ob, lb) if o is None else (o + ob, l + lb)
    return (o / l.view(B * Hkv, R2, ONES_COLS)[..., :1]).view(B, Hkv, R2, hd)[:, :, :R]
