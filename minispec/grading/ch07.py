"""Checks of chapter 7's exercises (solutions/ch07_paged_kv.py): a paged KV cache's bookkeeping.

    7.1 reserve_blocks     all-or-nothing reservation of every sequence's pending tokens (tree
                           padding): ceil on exact block boundaries, zero pending, a pool that is
                           exactly big enough or one block short, the free list used as a stack
    7.2 compaction_moves   the (block, offset) copies that move a tree's accepted path next to the
                           prefix, across block boundaries, on shuffled block tables
    7.3 ragged_commit      per-sequence lengths after a ragged commit and the whole blocks each
                           sequence returns (finished sequences return all of theirs)
    7.4 gather_kv          one sequence's keys and values read out of the pool through its block
                           table, the pending tree's tokens included (``PagedKVCache.read``)

Each check runs a list of hand-picked edge cases, then a few hundred random ones, against a
reference written here; ``--impl minispec`` answers with ``minispec.kv.PagedKVCache`` objects,
so the reference and the library are checked against each other. 7.4 is graded against a real
``PagedKVCache`` after ragged prefills, a freed and reused sequence (shuffled tables) and a tree
step's pending tokens, with every slot no token was written to holding NaN. A failure names the case.
"""

from __future__ import annotations

import copy
import random
from types import SimpleNamespace

import torch

from minispec.kv import KVPoolExhausted, PagedKVCache

from .checks import exercise, get

TITLE = "Paged KV cache: block allocation, tree compaction, ragged acceptance"
MODULE = "ch07_paged_kv"
EXERCISES: list = []
N_RANDOM = 300


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------- references
def reference_reserve(tables, lengths, n_new, free_list, block_size):
    need = [_cdiv(L + n, block_size) - len(t) for t, L, n in zip(tables, lengths, n_new)]
    if sum(need) > len(free_list):
        return None
    free = list(free_list)
    return [list(t) + [free.pop() for _ in range(k)] for t, k in zip(tables, need)], free


def reference_moves(table, length, keep, block_size):
    def slot(n):
        return table[n // block_size], n % block_size

    return [(slot(length + i), slot(length + j)) for j, i in enumerate(keep) if i != j]


def reference_ragged(lengths, pendings, accepted, finished, block_size):
    new = [0 if f else L + a for L, a, f in zip(lengths, accepted, finished)]
    freed = [_cdiv(L + p, block_size) - _cdiv(n, block_size) for L, p, n in zip(lengths, pendings, new)]
    return new, freed


# --------------------------------------------------------------------------- the library behind the signatures
def _cache(n_blocks: int, block_size: int, batch: int) -> PagedKVCache:
    return PagedKVCache(1, 1, 1, max(1, n_blocks), block_size, batch)  # 1 layer, 1 head, head dim 1: bookkeeping only


def _lib_reserve(tables, lengths, n_new, free_list, block_size):
    ids = [b for t in tables for b in t] + list(free_list)
    kv = _cache(max(ids, default=0) + 1, block_size, len(tables))
    kv.tables, kv.lengths, kv.free_list = [list(t) for t in tables], list(lengths), list(free_list)
    try:
        kv.begin(len(tables), list(n_new))
    except KVPoolExhausted:
        return None
    return kv.tables, kv.free_list


def _lib_moves(table, length, keep, block_size):
    """Label every slot with its own (block, offset), let PagedKVCache.commit move the entries, and
    read back which slot's label each destination received."""
    kv = _cache(max(table, default=0) + 1, block_size, 1)
    kv.tables, kv.lengths = [list(table)], [length]
    kv.pendings = [len(table) * block_size - length]
    blk = torch.arange(kv.n_blocks, dtype=torch.float32)[:, None].expand(-1, block_size)  # [N, bs]
    off = torch.arange(block_size, dtype=torch.float32)[None].expand(kv.n_blocks, -1)  # [N, bs]
    kv.k_pool[0, :, 0, :, 0] = blk  # k holds each slot's block, v its offset
    kv.v_pool[0, :, 0, :, 0] = off
    kv.commit(list(keep))
    moves = []
    for j in range(len(keep)):
        n = length + j
        dst = (table[n // block_size], n % block_size)
        src = (int(kv.k_pool[0, dst[0], 0, dst[1], 0]), int(kv.v_pool[0, dst[0], 0, dst[1], 0]))
        if src != dst:
            moves.append((src, dst))
    return moves


def _lib_ragged(lengths, pendings, accepted, finished, block_size):
    B = len(lengths)
    kv = _cache(sum(_cdiv(L + p, block_size) for L, p in zip(lengths, pendings)), block_size, B)
    kv.begin(B, list(lengths))  # the prompts
    kv.commit()
    kv.begin(B, list(pendings))  # every sequence's draft tree
    owned = [len(t) for t in kv.tables]
    kv.commit([list(range(a)) for a in accepted])  # each keeps its own accepted path
    for b, f in enumerate(finished):
        if f:
            kv.free(b)
    return list(kv.lengths), [o - len(t) for o, t in zip(owned, kv.tables)]


def library():
    """minispec's PagedKVCache behind the exercises' signatures (``--impl minispec``)."""
    return SimpleNamespace(__name__="minispec.kv.PagedKVCache (chapter 7 adapter)", reserve_blocks=_lib_reserve,
                           compaction_moves=_lib_moves, ragged_commit=_lib_ragged, gather_kv=_lib_gather)


def _lib_gather(k_pool, v_pool, table, length, pending):
    """PagedKVCache.read on a one-layer, one-sequence cache holding the given pool and table."""
    N, Hkv, bs, hd = k_pool.shape
    kv = PagedKVCache(1, Hkv, hd, N, bs, 1, k_pool.dtype)
    kv.k_pool, kv.v_pool = k_pool[None], v_pool[None]  # [1, N, Hkv, bs, hd]
    kv.tables, kv.lengths, kv.pendings = [list(table)], [length], [pending]
    k, v = kv.read(0, 0)  # [1, Hkv, n, hd]
    return k[0], v[0]


# --------------------------------------------------------------------------- helpers
def _ints(x, what: str, case: str) -> list[int]:
    try:
        return [int(v) for v in x]
    except (TypeError, ValueError):
        raise AssertionError(f"{what} must be a list of integers, got {x!r} {case}") from None


def _call_frozen(fn, args, case: str):
    """fn(*args), failing if it modified any argument."""
    before = copy.deepcopy(args)
    out = fn(*args)
    if args != before:
        raise AssertionError(f"modified its arguments {case} (return new lists instead): before {before}, after {args}")
    return out


# --------------------------------------------------------------------------- 7.1
def _reserve_cases(rng: random.Random):
    # (tables, lengths, n_new, free_list, block_size) as fixed hand-written edge cases ...
    yield [[]], [0], [0], [0, 1], 4  # nothing cached, nothing pending: no block
    yield [[]], [0], [1], [3, 2], 4  # the first token takes one block, popped from the end
    yield [[5]], [4], [0], [1, 2], 4  # exact boundary, zero pending: no block
    yield [[5]], [4], [1], [1, 2], 4  # exact boundary: the next token needs a new block
    yield [[5]], [3], [1], [1, 2], 4  # fills the last slot of its block: no new block
    yield [[5]], [3], [2], [1, 2], 4  # one slot left, two tokens: one new block
    yield [[0, 7]], [8], [8], [3, 1], 4  # exactly two more blocks
    yield [[0, 7]], [8], [9], [3, 1], 4  # needs three, two free: nothing
    yield [[0], [1]], [2, 3], [3, 2], [4, 5], 3  # the pool is exactly big enough: the free list empties
    yield [[0], [1]], [2, 3], [3, 4], [4, 5], 3  # sequence 0 fits, sequence 1 does not: nothing at all
    yield [[0], [], [1, 2]], [1, 0, 6], [0, 5, 0], [7, 3, 9, 4], 3  # zero pending for some sequences
    yield [[2]], [5], [3], [1], 5  # a full block plus 3 tokens: one more block, the last free one
    yield [[], []], [0, 0], [16, 17], [0, 1, 2, 3, 4], 16  # ceil on a fresh sequence
    yield [[4], [2]], [1, 1], [3, 3], [0, 1, 3, 5, 6, 7], 1  # block size 1: a block per token
    for _ in range(N_RANDOM):
        bs = rng.choice([1, 2, 3, 4, 8, 16])
        B = rng.randint(1, 5)
        lengths = [rng.choice([0, bs, 2 * bs, rng.randint(0, 5 * bs)]) for _ in range(B)]
        n_new = [rng.choice([0, 1, bs, bs - 1, rng.randint(0, 3 * bs)]) for _ in range(B)]
        owned = [_cdiv(L, bs) for L in lengths]
        need = sum(_cdiv(L + n, bs) for L, n in zip(lengths, n_new)) - sum(owned)
        n_free = max(0, need + rng.choice([-2, -1, 0, 0, 1, 3]))
        ids = list(range(sum(owned) + n_free))
        rng.shuffle(ids)
        tables, i = [], 0
        for k in owned:
            tables.append(ids[i:i + k])
            i += k
        yield tables, lengths, n_new, ids[i:], bs


@exercise(EXERCISES, "7.1", "reserve_blocks")
def check_reserve_blocks(impl):
    fn = get(impl, "reserve_blocks")
    for tables, lengths, n_new, free_list, bs in _reserve_cases(random.Random(7)):
        case = (f"for tables={tables}, lengths={lengths}, n_new={n_new}, free_list={free_list}, "
                f"block_size={bs}")
        want = reference_reserve(tables, lengths, n_new, free_list, bs)
        got = _call_frozen(fn, (tables, lengths, n_new, free_list, bs), case)
        if want is None:
            if got is not None:
                need = sum(_cdiv(L + n, bs) - len(t) for t, L, n in zip(tables, lengths, n_new))
                raise AssertionError(f"returned {got!r} {case}, expected None: the sequences need {need} more blocks "
                                     f"and only {len(free_list)} are free (all or nothing)")
            continue
        if got is None:
            raise AssertionError(f"returned None {case}: the {len(free_list)} free blocks are enough, expected "
                                 f"tables={want[0]}, free_list={want[1]}")
        try:
            got_tables, got_free = got
            got_tables = [_ints(t, "each table", case) for t in got_tables]
        except (TypeError, ValueError):
            raise AssertionError(f"must return (tables, free_list) or None, got {got!r} {case}") from None
        got_free = _ints(got_free, "the free list", case)
        if got_tables != want[0] or got_free != want[1]:
            raise AssertionError(f"returned tables={got_tables}, free_list={got_free} {case}, expected "
                                 f"tables={want[0]}, free_list={want[1]}")


# --------------------------------------------------------------------------- 7.2
def _moves_cases(rng: random.Random):
    # (table, length, keep, block_size)
    yield [3, 1], 2, [], 4  # nothing kept
    yield [3, 1], 2, [0, 1, 2], 4  # a chain fully accepted: nothing moves
    yield [3, 1], 2, [1], 4  # the second pending entry replaces the first
    yield [3, 1], 4, [0, 2], 4  # length on a block boundary: everything in block 1
    yield [3, 1], 3, [0, 2], 4  # the kept entry crosses back from block 1 to block 3
    yield [6, 2, 9], 3, [0, 1, 5], 3  # a path whose leaf sits two blocks on
    yield [6, 2, 9], 0, [2, 4, 7], 3  # an empty prefix: moves start at position 0
    yield [5, 0, 4, 8], 1, [0, 3, 6, 9], 3  # every kept entry in a different block
    yield [7, 2, 5, 1], 0, [1, 3], 1  # block size 1: every position its own block
    yield [0], 0, [0], 16  # one token, in place
    for _ in range(N_RANDOM):
        bs = rng.choice([1, 2, 3, 4, 8])
        length = rng.choice([0, bs, rng.randint(0, 4 * bs)])
        T = rng.randint(1, 3 * bs + 2)
        nb = _cdiv(length + T, bs)
        table = rng.sample(range(nb + rng.randint(0, 4)), nb)  # shuffled, distinct block ids
        keep = sorted(rng.sample(range(T), rng.randint(0, T)))
        if keep and rng.random() < 0.5:  # a root-to-leaf path keeps the root row 0
            keep = sorted({0, *keep})
        yield table, length, keep, bs


def _pair(x, case):
    try:
        (a, b), (c, d) = x
        return (int(a), int(b)), (int(c), int(d))
    except (TypeError, ValueError):
        raise AssertionError(f"each move must be ((src_block, src_offset), (dst_block, dst_offset)), got {x!r} "
                             f"{case}") from None


@exercise(EXERCISES, "7.2", "compaction_moves")
def check_compaction_moves(impl):
    fn = get(impl, "compaction_moves")
    for table, length, keep, bs in _moves_cases(random.Random(72)):
        case = f"for table={table}, length={length}, keep={keep}, block_size={bs}"
        want = reference_moves(table, length, keep, bs)
        got = _call_frozen(fn, (table, length, keep, bs), case)
        try:
            got = [_pair(m, case) for m in got]
        except TypeError:
            raise AssertionError(f"must return a list of moves, got {got!r} {case}") from None
        if got != want:
            extra = [m for m in got if m not in want]
            hint = ("; entries already in place (keep[j] == j) are not moves" if any(s == d for s, d in got) else
                    f"; e.g. {extra[0]} is not a move of commit(keep)" if extra else "")
            raise AssertionError(f"returned {got} {case}, expected {want}{hint}")


# --------------------------------------------------------------------------- 7.3
def _ragged_cases(rng: random.Random):
    # (lengths, pendings, accepted, finished, block_size)
    yield [4], [0], [0], [False], 4  # nothing pending: nothing moves, nothing freed
    yield [4], [4], [0], [False], 4  # the whole tree rejected: its one padding block goes back
    yield [4], [5], [0], [False], 4  # a tree spanning two blocks, all rejected: two whole blocks freed
    yield [4], [5], [4], [False], 4  # accepted up to the block boundary: the second block goes back
    yield [4], [5], [5], [False], 4  # all accepted: nothing freed
    yield [3], [6], [1], [False], 4  # the accepted token fills the prefix's block: the tree's block goes
    yield [5, 0, 8], [4, 3, 9], [2, 3, 1], [False, False, False], 4  # ragged acceptance
    yield [5, 0, 8], [4, 3, 9], [2, 3, 1], [False, True, False], 4  # sequence 1 finished: all of its blocks
    yield [0, 0], [0, 0], [0, 0], [True, False], 2  # an empty sequence finishing frees nothing
    yield [7, 2], [3, 5], [3, 2], [False, False], 1  # block size 1: one block per token
    yield [16, 15], [16, 17], [16, 1], [False, True], 16
    for _ in range(N_RANDOM):
        bs = rng.choice([1, 2, 3, 4, 8, 16])
        B = rng.randint(1, 6)
        lengths = [rng.choice([0, bs, rng.randint(0, 5 * bs)]) for _ in range(B)]
        pendings = [rng.choice([0, 1, bs, rng.randint(0, 3 * bs)]) for _ in range(B)]
        accepted = [rng.choice([0, p, rng.randint(0, p)]) for p in pendings]
        finished = [rng.random() < 0.2 for _ in range(B)]
        yield lengths, pendings, accepted, finished, bs


@exercise(EXERCISES, "7.3", "ragged_commit")
def check_ragged_commit(impl):
    fn = get(impl, "ragged_commit")
    for lengths, pendings, accepted, finished, bs in _ragged_cases(random.Random(73)):
        case = (f"for lengths={lengths}, pendings={pendings}, accepted={accepted}, finished={finished}, "
                f"block_size={bs}")
        want_len, want_freed = reference_ragged(lengths, pendings, accepted, finished, bs)
        got = _call_frozen(fn, (lengths, pendings, accepted, finished, bs), case)
        try:
            got_len, got_freed = got
        except (TypeError, ValueError):
            raise AssertionError(f"must return (new_lengths, blocks_freed), got {got!r} {case}") from None
        got_len, got_freed = _ints(got_len, "new_lengths", case), _ints(got_freed, "blocks_freed", case)
        if got_len != want_len:
            raise AssertionError(f"new_lengths={got_len} {case}, expected {want_len}")
        if got_freed != want_freed:
            b = next(i for i, (x, y) in enumerate(zip(got_freed, want_freed)) if x != y) if len(got_freed) == len(
                want_freed) else 0
            raise AssertionError(f"blocks_freed={got_freed} {case}, expected {want_freed} (sequence {b} owned "
                                 f"{_cdiv(lengths[b] + pendings[b], bs)} blocks with its tree padding and keeps "
                                 f"{_cdiv(want_len[b], bs)})")


# --------------------------------------------------------------------------- 7.4
def _filled_cache(seed: int, block_size: int):
    """A 2-layer PagedKVCache after a ragged prefill, a freed and refilled sequence (its new blocks out of
    order) and a tree step's pending tokens (reserved and written, not committed). Every slot no token
    was written to holds NaN."""
    g = torch.Generator().manual_seed(740 + seed)
    B, Hkv, hd = 3, 2, 4
    kv = PagedKVCache(2, Hkv, hd, n_blocks=40, block_size=block_size, batch_size=B, dtype=torch.float64)
    kv.k_pool.fill_(float("nan")), kv.v_pool.fill_(float("nan"))

    def forward(n_new):
        kv.begin(B, n_new)
        T = max(n_new)
        for layer in range(2):
            kv.store(layer, torch.randn(B, Hkv, T, hd, generator=g, dtype=torch.float64),
                     torch.randn(B, Hkv, T, hd, generator=g, dtype=torch.float64))

    lens = [int(x) for x in torch.randint(0, 3 * block_size, (B,), generator=g)]
    lens[seed % B] = 0  # an empty sequence
    forward(lens)
    kv.commit()
    kv.free(1)  # its blocks go back to the pool (a stack): the refill takes them in another order
    forward([0, 2 * block_size + 1, 0])
    kv.commit()
    tree = [int(x) for x in torch.randint(1, 2 * block_size + 2, (B,), generator=g)]  # a tree step's T per row
    forward(tree)  # pending: reserved (tree padding) and written, not committed
    return kv


@exercise(EXERCISES, "7.4", "gather_kv")
def check_gather_kv(impl):
    fn = get(impl, "gather_kv")
    for seed, bs in enumerate((4, 1, 16, 5, 8)):
        kv = _filled_cache(seed, bs)
        for layer in range(2):
            for b in range(kv.batch_size):
                L, p, table = kv.lengths[b], kv.pendings[b], list(kv.tables[b])
                case = f"for sequence {b} of {L} committed + {p} pending tokens, blocks of {bs}, table {table}"
                want_k, want_v = (x[0] for x in kv.read(layer, b))  # [Hkv, n, hd]
                out = fn(kv.k_pool[layer].clone(), kv.v_pool[layer].clone(), list(table), L, p)
                try:
                    k, v = out
                except (TypeError, ValueError):
                    raise AssertionError(f"gather_kv must return (k, v), got {type(out).__name__} {case}") from None
                for name, got, want in (("k", k, want_k), ("v", v, want_v)):
                    if not isinstance(got, torch.Tensor):
                        raise AssertionError(f"{name} must be a tensor, got {type(got).__name__} {case}")
                    if tuple(got.shape) != tuple(want.shape):
                        hint = (" (the pending tree's tokens are missing: its queries attend to them too)"
                                if got.dim() == 3 and got.shape[1] == L and p else "")
                        raise AssertionError(f"{name} has shape {tuple(got.shape)}, expected {tuple(want.shape)} "
                                             f"[Hkv, length + pending, hd] {case}{hint}")
                    if torch.isnan(got).any():
                        t = int(torch.isnan(got).any(-1).any(0).nonzero()[0])
                        raise AssertionError(f"{name} token {t} was read from a slot no token was written to {case} "
                                             f"(token {t} lives in block table[{t // bs}], offset {t % bs})")
                    if not torch.equal(got, want):
                        t = int((got != want).any(-1).any(0).nonzero()[0])
                        raise AssertionError(f"{name} token {t} differs from the cache's {case}: token {t} lives in "
                                             f"block table[{t // bs}] = {table[t // bs]}, offset {t % bs}")
