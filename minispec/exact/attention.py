"""The exact backend's attention ("exact"): each query row's result does not depend on how many rows or
keys come with it.

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
                                                    row-major (an exact model's CPU cache stores keys last)
    s   = -inf where the mask hides a key
    m   = max over keys of s                        max is exact in any order
    p   = exp(s - m)                                elementwise; a hidden key gives exactly 0
    o   = p @ v                                     a matrix product whose reduction runs along the
                                                    keys in key order, over fixed blocks of KEY_BLOCK
                                                    keys counted by rank from key 0 (a key's rank: how
                                                    many keys a row sees before it), the block
                                                    products added in block order: a hidden key adds
                                                    an exact 0 wherever it sits
    l   = sum of p over keys                        a running sum (``cumsum``) in key order, in
                                                    float64: sequential by definition, so a hidden
                                                    key's 0 changes nothing on any CPU
    out = o / l

so the visible keys of a row (the committed prefix, then the row's tree ancestors in tree
order, then itself: the very keys vanilla sees for that token) are summed in the same order
whatever else is in the batch. What this relies on: a matrix product of two row-major operands
computes each element the same way whatever the other rows and columns hold and however many
there are, so a hidden key's exact zero leaves the sum of the others as it was. Measured
exceptions, each avoided here:

    one row or one column          a matrix-vector kernel: query rows are padded to two, and
                                   the last block of keys to MIN_BLOCK_KEYS with hidden keys;
    few columns                    MKL's AVX2 kernels sum p @ v by key position (not in key
                                   order) when v has fewer than 16 columns: v's columns are
                                   padded with zeros to a multiple of V_COLS;
    a column-major operand         other kernels, whose result for a row depends on its place
                                   among few rows: the keys are read as a row-major k^T, which
                                   an exact model's CPU KV cache stores as such (``KVCache.for_model``);
    products under 400 multiply-adds   PyTorch's CPU ``bmm`` runs them in a loop kernel of its
                                   own: rows are padded up;
    a long reduction               MKL splits it into blocks whose size depends on its length
                                   (past ~400 keys with its AVX-512 kernels, 256 with AVX2):
                                   hence the fixed key blocks, counted by rank (``key_blocks``:
                                   a tree row's keys have holes between them);
    a scale inside the product     ``baddbmm``'s alpha is applied in another order for some
                                   shapes (MKL, 2 threads, hd = 8): q is scaled first;
    partial row / column blocks    MKL's AVX2 kernels compute rows in blocks of 6 and columns in
                                   blocks of 16, and a last, partial block in another order;
    a product split over threads   at 2 threads MKL splits a lone product (or one tall product's
                                   rows) between the threads at places that depend on the row
                                   count: the products run in a batch of at least one per thread
                                   (``batch_for_threads``), and the sum of p, once a product with
                                   16 columns of ones, is a running sum.

Partial blocks depend on the CPU, so ``attention_padding`` probes it once per head dim and thread count
and picks the cheapest ``AttentionPadding``: query rows padded to a multiple of m, keys padded with
hidden ones to whole blocks (every product then has one shape), or neither (MKL's AVX-512
kernels). ``tests/test_invariance.py`` checks the property on random shapes and trees on
whatever CPU runs the tests, with stand-in products for the CPU-dependent cases;
``python -m minispec check-env`` reports the padding and the property for this machine.

The cost over a fused kernel is the score matrix [rows, S] in memory (small while decoding;
a long prefill is chunked by rows, which changes nothing since rows are independent), a product
per block of keys and a running sum over the scores.

Shapes: B batch, H query heads, Hkv KV heads, G = H / Hkv, T query rows, S keys, hd head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..attention import attention, register
from ..attention.reference import check_shapes
from ..tree import Tree
from .recipes import padded_rows, threads

MIN_ROWS = 2  # products over fewer query rows go to a matrix-vector kernel with its own order
BMM_NAIVE_BELOW = 400  # PyTorch's CPU bmm runs products with rows * cols * inner < 400 in a loop kernel of
#                        its own, with another order than its BLAS path: pad rows to stay above it
V_COLS = 16  # v's columns are padded to a multiple of this (MKL's AVX2 kernels sum a narrower p @ v by key position)
KEY_BLOCK = 128  # keys per block of p @ v: a BLAS splits a reduction longer than ~256 keys (MKL's AVX2 kernels)
#                  or ~400 (its AVX-512 ones) at places that depend on its length, so p @ v is summed over fixed
#                  blocks of keys counted by rank from key 0, the block products added in block order
MAX_PRODUCT_KEYS = 2 * KEY_BLOCK  # keys in one product at most: a block gathered under a tree holds the
#                  keys of its ranks, up to KEY_BLOCK + the tree's size (trees of up to KEY_BLOCK tokens)
MIN_BLOCK_KEYS = 16  # the last block is padded with hidden keys up to this (a product of at least 2 x 16 x 16)
ROW_MULTIPLES = (1, 2, 4, 6, 8, 12, 16)  # query rows per product may be rounded up to a multiple of these
ROW_CHUNK = 2048  # query rows (g, t) per product: bounds the score matrix of a long prefill


@dataclass(frozen=True)
class AttentionPadding:
    """How ``invariant_attention`` shapes its products on this machine (chosen by ``attention_padding``).

    row_multiple: query rows per product padded with zero queries to a multiple of this (at least
        MIN_ROWS); pad_keys: keys padded with hidden ones to a multiple of KEY_BLOCK, so that every
        product has one shape whatever the key count (a BLAS whose last, partial block of columns or
        of the reduction is computed in another order); invariant: whether the probe found the rows
        independent of their company under this padding.
    """
    row_multiple: int = 1
    pad_keys: bool = False
    invariant: bool = True

    def describe(self) -> str:
        how = [f"query rows padded to a multiple of {self.row_multiple}"] if self.row_multiple > 1 else []
        how += [f"keys padded to a multiple of {KEY_BLOCK}"] if self.pad_keys else []
        return ", ".join([f"keys summed in blocks of {KEY_BLOCK}"] + how)


_PADDINGS: dict[tuple, AttentionPadding] = {}  # cache: (hd, dtype, threads) -> the padding probed on this CPU


def attention_padding(hd: int, dtype: torch.dtype = torch.float32) -> AttentionPadding:
    """The cheapest ``AttentionPadding`` under which rows of head dim ``hd`` are row-invariant on this CPU at
    the running thread count: probed once (random queries over prefixes of 0 to 557 keys, 1 to 33
    rows against 20 and 40, and the rows of a tree each against itself alone, compared bit for bit),
    cached. With none invariant, no padding
    with ``invariant=False`` (``check-env`` warns)."""
    key = (hd, dtype, threads())
    if key not in _PADDINGS:
        candidates = [AttentionPadding(m, pad) for m in ROW_MULTIPLES for pad in (False, True)]
        _PADDINGS[key] = next((c for c in candidates if _rows_invariant(c, hd, dtype)),
                              AttentionPadding(invariant=False))
    return _PADDINGS[key]


PROBE_LAYOUTS = ((1, 1, 1), (1, 3, 3), (2, 1, 4))  # (B, Hkv, G) the probe tries: a BLAS may thread a batch of
#                                                  products otherwise than one product


def _rows_invariant(padding: AttentionPadding, hd: int, dtype: torch.dtype) -> bool:
    """Under ``padding``, for each of PROBE_LAYOUTS: do the rows of a causal block of N queries after a prefix of
    P keys equal, bit for bit, those of its first n queries alone (for two N, so that a row also moves
    within the products); and does each row of a tree after P keys equal that row alone over its visible
    keys, packed together as vanilla decoding sees them (a tree row's ancestors sit apart)?"""
    g = torch.Generator().manual_seed(0)
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 5, 6, 4, 8]  # a tree of 12 tokens whose rows see keys with holes between them
    tree = Tree([0] * len(parents), parents).mask()[1:, 1:]  # [T, T] ancestors and self, root dropped
    with torch.no_grad():
        for B, Hkv, G in PROBE_LAYOUTS:
            for P in (0, 5, 24, 250, 517):
                for N in (20, 40):
                    q, k, v = (torch.randn(B, h, n, hd, generator=g).to(dtype)
                               for h, n in ((Hkv * G, N), (Hkv, P + N), (Hkv, P + N)))
                    full = invariant_attention(q, k, v, padding=padding)
                    for n in (1, 2, 3, 4, 5, 7, 9, 13, 33):
                        if n < N and not torch.equal(
                                invariant_attention(q[:, :, :n], k[:, :, :P + n], v[:, :, :P + n], padding=padding),
                                full[:, :, :n]):
                            return False
                T = len(parents)
                mask = torch.cat([torch.ones(T, P, dtype=torch.bool), tree], dim=1)  # [T, P + T]
                full = invariant_attention(q[:, :, :T], k[:, :, :P + T], v[:, :, :P + T], mask, padding=padding)
                for t in range(T):
                    keys = mask[t].nonzero().flatten()
                    if not torch.equal(invariant_attention(q[:, :, t:t + 1], k[:, :, keys], v[:, :, keys], padding=padding),
                                       full[:, :, t:t + 1]):
                        return False
    return True


@dataclass(frozen=True)
class MaskedKeys:
    """What a mask tells the products, worked out once (``masked_keys``) for every layer that shares it.

    mask: bool [T, S] or [B or 1, 1, T, S]; hidden: ~mask as [B or 1, 1, 1, T, S]; blocks: ``key_blocks(mask)``.
    """
    mask: torch.Tensor
    hidden: torch.Tensor
    blocks: list[torch.Tensor] | str | None


def masked_keys(mask: torch.Tensor) -> MaskedKeys:
    """Check a bool mask [T, S] / [B or 1, 1, T, S] and work out its hidden keys and key blocks (a few small ops
    and, past one block of keys, a read on the host): a forward's layers share one mask, so a plan does this once."""
    if mask.dtype != torch.bool or mask.dim() not in (2, 4) or (mask.dim() == 4 and mask.shape[1] != 1):
        raise ValueError(f"mask must be boolean [T, S] or [B or 1, 1, T, S], got {mask.dtype} {tuple(mask.shape)}")
    hidden = ~(mask if mask.dim() == 4 else mask[None, None])[:, :, None]  # [B or 1, 1, 1, T, S]
    return MaskedKeys(mask, hidden, key_blocks(mask))


def invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: torch.Tensor | MaskedKeys | None = None, padding: AttentionPadding | None = None,
                        scratch: dict | None = None) -> torch.Tensor:
    """Softmax attention whose every row is computed as it would be alone.

    Args:
        q: [B, H, T, hd] queries; k, v: [B, Hkv, S, hd] keys and values.
        mask: bool (True = may attend) of shape [T, S] or [B or 1, 1, T, S], or the ``masked_keys`` of one
            (what an attention plan hands every layer), or None: causal with the T queries at the last T key positions
            (every key visible when T = 1).
        padding: how to shape the products; None: ``attention_padding`` probed for this CPU (on another
            device, where minispec claims no row invariance, no padding beyond the minimum).
        scratch: buffers that every layer of a forward reuses (an attention plan's ``memo``); None: new ones.
    Returns:
        [B, H, T, hd] in q's dtype. Every row must see at least one key.
    """
    B, H, Hkv, T, hd = check_shapes(q, k, v)
    S, G = k.shape[2], H // Hkv
    if padding is None:
        padding = attention_padding(hd, q.dtype) if q.device.type == "cpu" else AttentionPadding()
    if mask is None and T > 1:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)  # [T, S]
    hidden = blocks = None
    if mask is not None:
        keys = mask if isinstance(mask, MaskedKeys) else masked_keys(mask)
        if keys.mask.shape[-2:] != (T, S):
            raise ValueError(f"mask must be boolean [{T}, {S}] or [B or 1, 1, {T}, {S}], got {tuple(keys.mask.shape)}")
        hidden, blocks = keys.hidden, keys.blocks
        if blocks == "per batch":  # trees that differ between batch rows and straddle a block boundary
            return torch.cat([invariant_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], keys.mask[b:b + 1], padding)
                              for b in range(B)])
    # scaled first, elementwise: a BLAS may apply a product's alpha in another order for some shapes (MKL at 2
    # threads, hd = 8); then the G query heads of a KV head as rows (g, t)
    qs = q * _scale(hd, q.dtype)  # [B, H, T, hd]
    B_ = batch_for_threads(B, Hkv) if q.device.type == "cpu" else B
    if B_ == B and G * T <= ROW_CHUNK:  # the common case: one call, the rows as they lie (a view where they can)
        rows = qs.view(B * Hkv, G * T, hd) if T == 1 or qs.is_contiguous() else qs.reshape(B * Hkv, G * T, hd)
        return _rows(rows, k, v, hidden, G, T, padding, blocks, scratch, (B, H, T, hd))
    qg = qs.reshape(B, Hkv, G * T, hd)  # [B, Hkv, G*T, hd]
    if B_ > B:
        qg, k, v = (F.pad(x, (0, 0, 0, 0, 0, 0, 0, B_ - B)) for x in (qg, k, v))
        if hidden is not None and hidden.shape[0] > 1:
            hidden = F.pad(hidden, (0, 0, 0, 0, 0, 0, 0, 0, 0, B_ - B))
    t_chunk = max(1, ROW_CHUNK // G)  # a long prefill: rows are independent, so chunks change no bit
    out = torch.cat([_rows(qg.unflatten(2, (G, T))[:, :, :, t0:t0 + t_chunk].reshape(B_ * Hkv, -1, hd), k, v,
                           None if hidden is None else hidden[..., t0:t0 + t_chunk, :], G, min(t_chunk, T - t0), padding,
                           blocks, scratch).unflatten(2, (G, -1)) for t0 in range(0, T, t_chunk)], dim=3)
    return out[:B].reshape(B, H, T, hd)


_SCALES: dict[int, torch.Tensor] = {}  # head dim -> 1 / sqrt(hd) as a 0-dim float32 CPU tensor


def _scale(hd: int, dtype: torch.dtype) -> torch.Tensor | float:
    """1 / sqrt(hd) as ``q * scale`` takes it: for float32 a 0-dim tensor (the same float32 value as the Python
    number, without an op that converts the number in every call); for other dtypes the number itself."""
    if dtype != torch.float32:
        return 1.0 / math.sqrt(hd)
    if hd not in _SCALES:
        with torch.inference_mode(False):  # a normal tensor, usable under autograd even if first made in inference
            _SCALES[hd] = torch.tensor(1.0 / math.sqrt(hd), dtype=torch.float32, device="cpu")
    return _SCALES[hd]


def batch_for_threads(B: int, Hkv: int) -> int:
    """The batch the products run with: B, or more (zero entries) when the B * Hkv products are fewer than
    the threads. A BLAS given fewer products than threads splits one product between threads, at places
    that depend on its shape (MKL at 2 threads), so a row's sum would depend on the row count; with at
    least one product per thread, each is computed whole by one thread."""
    return max(B, -(-threads() // Hkv))


def key_blocks(mask: torch.Tensor) -> list[torch.Tensor] | str | None:
    """The keys of each block of KEY_BLOCK keys that p @ v sums, where they are not runs of positions.

    Vanilla decoding sees a token's visible keys packed: the prefix, then its ancestors, then itself, so
    the i-th key it sees is key i and sits in block i // KEY_BLOCK. A tree row sees the same keys with
    holes between them (its siblings' and cousins' keys), so where a tree straddles a block boundary, a
    key's position would put it in another block than vanilla does. Blocks are therefore made of the
    keys whose *rank* (how many keys a row sees before it) falls in the block; under a tree mask a key's
    rank is the same for every row that sees it (the prefix and the key's own ancestors). Past one block
    this reads the mask on the host: the CPU path only (on CUDA, ``attend`` never comes here).

    Args:
        mask: bool [T, S] or [B or 1, 1, T, S].
    Returns:
        None where every key's rank falls in its position's block (no tree straddles a boundary), or
        the mask is no tree over a shared prefix, or the tree has more than KEY_BLOCK tokens (then
        positions decide, and rows are not claimed invariant); else a list with the sorted positions of each
        non-empty block, in block order; "per batch" where the blocks differ between batch rows.
    """
    m = mask.reshape(-1, *mask.shape[-2:])  # [Bm, T, S]
    S = m.shape[-1]
    if S <= KEY_BLOCK:  # one block: decided by the shape alone (no host read, e.g. in a CUDA-graph stand-in)
        return None
    holes = m.all(dim=1).all(dim=0).logical_not().nonzero()  # keys some row does not see
    c0 = int(holes[0]) if len(holes) else S  # the first: every row sees the keys before it, ranked by position
    if c0 >= S or c0 // KEY_BLOCK == (S - 1) // KEY_BLOCK:  # a rank lies between c0 and the position
        return None
    mt = m[..., c0:]  # [Bm, T, S - c0]: every row sees every key before c0, whose rank is its position
    r = mt.cumsum(-1, dtype=torch.int32) + (c0 - 1)  # the rank of each key from c0 that a row sees
    seen = mt.any(dim=1)  # [Bm, S - c0]
    hi, lo = r.masked_fill(~mt, -1).amax(dim=1), r.masked_fill(~mt, S).amin(dim=1)  # [Bm, S - c0]
    if not torch.equal(hi[seen], lo[seen]):  # not a tree over a shared prefix: no rank per key
        return None
    position = torch.arange(c0, S, device=m.device, dtype=torch.int32) // KEY_BLOCK
    tail = torch.where(seen, hi // KEY_BLOCK, position)  # [Bm, S - c0]; a key no row sees stays where it is
    if torch.equal(tail, position.expand_as(tail)):
        return None
    if not torch.equal(tail, tail[:1].expand_as(tail)):
        return "per batch"
    block = torch.cat([torch.arange(c0, device=m.device, dtype=torch.int32) // KEY_BLOCK, tail[0]])  # [S]
    blocks = [idx for j in range(int(block.max()) + 1) if (idx := (block == j).nonzero().flatten()).numel()]
    return None if max(len(b) for b in blocks) > MAX_PRODUCT_KEYS else blocks  # a tree past KEY_BLOCK tokens


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[BH, R, K] @ [BH, K, C]: every product of the attention goes through here (a test swaps in a stand-in)."""
    return torch.bmm(a, b)


def padded_keys(S: int, pad_keys: bool) -> int:
    """How many keys the products run over for S keys: a multiple of KEY_BLOCK (``pad_keys``), else S with
    its last block padded to at least MIN_BLOCK_KEYS keys."""
    if pad_keys:
        return -(-S // KEY_BLOCK) * KEY_BLOCK
    last = S % KEY_BLOCK
    return S if last == 0 or last >= MIN_BLOCK_KEYS else S + MIN_BLOCK_KEYS - last


def _rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor | None, G: int, T: int,
          padding: AttentionPadding, blocks: list[torch.Tensor] | None = None, scratch: dict | None = None,
          shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """Attention of the query rows q [B*Hkv, G*T, hd] (rows (g, t) of each KV head) -> [B, Hkv, G*T, hd], or
    ``shape`` (the caller's [B, H, T, hd]) where no row was padded.

    Every product has two row-major operands, at least two rows and MIN_BLOCK_KEYS keys, at least
    BMM_NAIVE_BELOW multiply-adds, and reduces over at most KEY_BLOCK keys: the regime in which a
    BLAS computes an element the same way whatever the other rows and columns are
    (``tests/test_invariance.py``); ``padding`` adds what this CPU's BLAS needs beyond that. ``blocks``: the
    keys of each block where they are not runs of positions (``key_blocks``). ``scratch``: see
    ``invariant_attention``. Kept to few ops (views included): a decode step makes this call once a layer.
    """
    BH, R, hd = q.shape
    B, Hkv, S = k.shape[0], k.shape[1], k.shape[2]
    S_ = padded_keys(S, padding.pad_keys)
    # past the first block (pad_keys off), a short last block copies neither keys nor values: the scores run
    # over the keys as they lie, and p and that block's values are padded below. Sk: the keys k and v hold
    Sk = S if S > KEY_BLOCK and not padding.pad_keys else S_
    kt = _heads(k, transpose=True)  # [BH, hd, S]: row-major when the cache stores keys last (an exact model's)
    if Sk > S:  # hidden zero keys (p = 0 for them, so they add exact zeros); padding k^T copies it row-major
        kt, v = F.pad(kt, (0, Sk - S)), F.pad(v, (0, 0, 0, Sk - S))
        hidden = F.pad(hidden if hidden is not None else torch.zeros(1, 1, 1, T, S, dtype=torch.bool, device=k.device),
                       (0, Sk - S), value=True)
    if kt.stride(-1) != 1:
        kt = kt.contiguous()  # a copy of the keys, for any other layout
    last = S_ - (S_ - 1) // KEY_BLOCK * KEY_BLOCK  # keys in the last block
    hd_ = -(-hd // V_COLS) * V_COLS  # v's columns in the products
    per_row = min(hd * S_, last * hd_)  # multiply-adds per row of the smallest product
    R2 = padded_rows(R, max(MIN_ROWS, -(-BMM_NAIVE_BELOW // per_row)), padding.row_multiple)
    if R2 > R:  # pad with zero queries; their results are dropped
        q = F.pad(q, (0, 0, 0, R2 - R))
    s = _product(q, kt)  # [BH, R', Sk]
    if hidden is not None:  # view the first G*T rows as [G, T] so the [., 1, 1, T, Sk] mask broadcasts
        s.view(B, Hkv, R2, Sk)[:, :, :R].unflatten(2, (G, T)).masked_fill_(hidden, float("-inf"))
    if torch.is_grad_enabled() and s.requires_grad:  # training (a draft model): autograd keeps s
        p = torch.exp(s - s.amax(dim=-1, keepdim=True))
        l = p.cumsum(-1, dtype=torch.float64)[..., -1:].to(p.dtype)  # [BH, R', 1]: a running sum in key order
    else:
        p = s.sub_(s.amax(dim=-1, keepdim=True)).exp_()  # [BH, R', Sk]; hidden keys exactly 0
        l = _sum_of_p(p, scratch)  # [BH, R', 1]
    if hd_ > hd:
        v = F.pad(v, (0, hd_ - hd))
    if S_ > Sk:  # a short last block: p padded with zeros (a small copy), so that every product reads p as
        p = F.pad(p, (0, S_ - Sk))  # it would with padded keys; that block's few values are padded below
    if blocks is None:  # runs of KEY_BLOCK keys from key 0 (the last one shorter), one view each
        parts = []
        for b in range(0, S_, KEY_BLOCK):
            n = min(KEY_BLOCK, S_ - b)
            pb = p if n == S_ else p.as_strided((BH, R2, n), p.stride(), b)  # p[:, :, b:b + n] (p is a new tensor)
            vb = _heads(v, b, min(n, Sk - b))  # [BH, n, hd']: its keys of v (the short last one padded below)
            parts.append((pb, vb if vb.shape[1] == n else F.pad(vb, (0, 0, 0, n - vb.shape[1]))))
    else:  # the keys whose rank falls in the block, gathered in key order, padded as a run would be
        v3 = _heads(v)  # [BH, Sk, hd']
        parts = []
        for block in blocks:
            n = block.numel()
            n_ = MAX_PRODUCT_KEYS if padding.pad_keys else max(n, MIN_BLOCK_KEYS)
            parts.append((F.pad(p.index_select(2, block), (0, n_ - n)), F.pad(v3.index_select(1, block), (0, 0, 0, n_ - n))))
    o = None
    for pb, vb in parts:  # in key order, block by block
        ob = _product(pb, vb)  # [BH, R', hd']
        o = ob if o is None else o + ob
    o = (o if hd_ == hd else o[..., :hd]) / l  # [BH, R', hd]
    if R2 == R and shape is not None:
        return o.view(shape)
    o = o.view(B, Hkv, R2, hd)
    o = o if R2 == R else o[:, :, :R]  # [B, Hkv, R, hd]
    return o if shape is None else o.reshape(shape)


def _heads(x: torch.Tensor, start: int = 0, n: int | None = None, transpose: bool = False) -> torch.Tensor:
    """Keys start..start+n of x [B, Hkv, S, c] as one batch of matrices [B*Hkv, n, c] (``transpose``: [B*Hkv, c, n]),
    as one view (``as_strided``) where B and Hkv merge, which a slice, a transpose and a reshape would make in five."""
    B, Hkv, S, c = x.shape
    n = S - start if n is None else n
    sb, sh, ss, sc = x.stride()
    if (B == 1 or sb == Hkv * sh) and not torch.compiler.is_compiling():  # (a trace cannot read a storage offset)
        size, stride = ((B * Hkv, c, n), (sh, sc, ss)) if transpose else ((B * Hkv, n, c), (sh, ss, sc))
        return x.as_strided(size, stride, x.storage_offset() + start * ss)
    x = x[:, :, start:start + n]
    return (x.transpose(-1, -2) if transpose else x).reshape(B * Hkv, *(x.shape[-1:-3:-1] if transpose else x.shape[-2:]))


def _sum_of_p(p: torch.Tensor, scratch: dict | None) -> torch.Tensor:
    """l = the sum of p [BH, R, S] over its keys, [BH, R, 1] in p's dtype: a running sum (``cumsum``) in key order in
    float64, whose last entry is cast back; on a hidden key's 0 it changes nothing, on any CPU. With ``scratch`` its
    float64 copy of p and the result are buffers that every layer of the forward reuses (three ops, not eleven)."""
    if scratch is None or torch.compiler.is_compiling():  # (a traced forward allocates its own)
        return p.cumsum(-1, dtype=torch.float64)[..., -1:].to(p.dtype)
    key = ("sum of p", tuple(p.shape), p.dtype, p.device)
    if key not in scratch:
        p64 = torch.empty(p.shape, dtype=torch.float64, device=p.device)
        scratch[key] = p64, p64[..., -1:], p.new_empty(*p.shape[:-1], 1)  # the copy, its last keys, l
    p64, last, l = scratch[key]
    p64.copy_(p).cumsum_(-1)  # the running sum in place: the same float64 additions in the same order
    return l.copy_(last)


def keys_of(plan) -> MaskedKeys | None:
    """The ``masked_keys`` of ``plan.mask``, worked out by the first layer for all (the hidden keys and key blocks
    are the same in every layer) and kept in ``plan.memo``; None for a causal plan without a mask."""
    if plan.mask is None:
        return None
    keys = plan.memo.get("masked_keys")
    if keys is None or keys.mask is not plan.mask:
        keys = plan.memo["masked_keys"] = masked_keys(plan.mask)
    return keys


def ready(plan):
    """Work out a CPU plan's ``masked_keys`` now rather than in the first layer: past 128 keys that reads the mask
    on the host, which a forward traced by ``torch.compile`` cannot do without breaking its graph, so a plan
    built before the traced call does it here. Returns the plan."""
    if plan.mask is not None and plan.mask.device.type == "cpu":
        keys_of(plan)
    return plan


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan) -> torch.Tensor:
    """The "exact" attention backend: ``invariant_attention`` with the plan's mask on the CPU; on any other
    device, where minispec claims no row invariance, the plain ``minispec.attention.attention``."""
    if q.device.type != "cpu":
        return attention(q, k, v, plan.mask)
    return invariant_attention(q, k, v, keys_of(plan), scratch=plan.memo)


register("exact", exact_attention)
