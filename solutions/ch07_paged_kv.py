"""Chapter 7 exercises: a paged KV cache (allocator, compaction, ragged commits, and attention's gather).

A paged cache cuts KV memory into blocks of ``block_size`` token slots, shared by all
sequences through a free list. Sequence b owns the blocks listed in its block table
``tables[b]``, in token order: its first block holds its tokens 0 .. block_size - 1, the next
one the following block_size tokens, and so on (an offset inside a block counts from 0). A
sequence owns just enough blocks for the tokens it holds (committed + pending), never more.

A decode step reserves, before the target's forward, the blocks for all the pending tokens of
every sequence (the whole draft tree: "tree padding"), all or nothing; after verification it
keeps the accepted path (compaction), and the blocks that only rejected tokens touched go
back to the free list. The library's version is ``minispec.kv.PagedKVCache`` (begin, commit,
rollback, free, read); exercises 7.1-7.3 are its bookkeeping, on plain Python lists, and 7.4 is
what attention does with it: read a sequence's keys and values out of the pool through its table.

References:
    Kwon et al., "Efficient Memory Management for Large Language Model Serving with
        PagedAttention" (vLLM, 2023): block tables and a shared block pool.
    Miao et al., "SpecInfer" (2023) and Li et al., "EAGLE" (2024): keeping a draft tree's
        accepted path in the KV cache.

Check your work: ``python -m minispec grade 7``, or ``minispec.grading.check("7.1")``, or
``pytest tests/test_exercises.py -m ch07 --impl exercises``.
"""

from __future__ import annotations

from typing import Sequence

import torch


def reserve_blocks(tables: Sequence[Sequence[int]], lengths: Sequence[int], n_new: Sequence[int],
                   free_list: Sequence[int], block_size: int) -> tuple[list[list[int]], list[int]] | None:
    """Reserve the blocks for ``n_new[b]`` pending tokens after the ``lengths[b]`` committed tokens
    of every sequence b, all or nothing (``PagedKVCache.begin``).

    On entry sequence b owns exactly the blocks its ``lengths[b]`` tokens need; on return it owns
    exactly the blocks its ``lengths[b] + n_new[b]`` tokens need (never more). The free list is a
    stack: take blocks with ``pop()`` from its end, sequence 0 first, and append them to the
    sequence's table in the order taken. If the free list cannot cover every sequence, allocate
    nothing and return None. Never modify the arguments: return new lists.

    Questions to answer before coding: how many more blocks does sequence b need, and when does
    its last block still have room for the new tokens (exact block boundaries, n_new = 0)? Why
    must the decision "enough for everyone?" come before the first pop?

    Args:
        tables: B block tables (lists of block ids, in token order).
        lengths: B committed lengths.
        n_new: B pending token counts (>= 0; 0 = the sequence takes no part in this forward).
        free_list: ids of the free blocks (a stack: the last one is handed out first).
        block_size: token slots per block (>= 1).
    Returns:
        (new tables [B lists], new free list), or None if the pool is too small.
    """
    # EXERCISE 7.1: all-or-nothing block reservation for every sequence's pending tokens (tree padding)
    # BEGIN SOLUTION
    need = [-(-(L + n) // block_size) - len(t) for t, L, n in zip(tables, lengths, n_new)]  # ceil division
    if sum(need) > len(free_list):
        return None
    free = list(free_list)
    new_tables = [list(t) + [free.pop() for _ in range(k)] for t, k in zip(tables, need)]
    return new_tables, free
    # END SOLUTION


def compaction_moves(table: Sequence[int], length: int, keep: Sequence[int],
                     block_size: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The copies ``commit(keep)`` makes to move a draft tree's accepted path next to the prefix.

    A forward wrote a sequence's pending entries 0, 1, 2, ... right after its ``length``
    committed tokens, in token order through its block table. Committing ``keep`` (strictly
    increasing pending indices: the accepted root-to-leaf path) makes the j-th kept entry the
    sequence's token number ``length + j``.

    Questions to answer before coding: at which token position does pending entry i sit, and in
    which block and at which offset is a token position stored? Which kept entries are already
    where they belong? Why can no move overwrite an entry that a later move still has to read?

    Args:
        table: the sequence's block table (enough blocks for every pending entry).
        length: committed tokens before the commit.
        keep: strictly increasing indices into the pending entries (may be empty).
        block_size: token slots per block.
    Returns:
        [((src_block, src_offset), (dst_block, dst_offset)), ...] one per kept entry that is not
        already in its place (keep[j] != j), in the order of ``keep``. Copying them in this
        order is safe: no move overwrites a slot that a later move reads.
    """
    # EXERCISE 7.2: source and destination (block, offset) of every kept entry that moves
    # BEGIN SOLUTION
    def slot(n):
        return table[n // block_size], n % block_size

    return [(slot(length + i), slot(length + j)) for j, i in enumerate(keep) if i != j]
    # END SOLUTION


def ragged_commit(lengths: Sequence[int], pendings: Sequence[int], accepted: Sequence[int],
                  finished: Sequence[bool], block_size: int) -> tuple[list[int], list[int]]:
    """One batched verify step with ragged acceptance: new lengths, and the blocks each sequence frees.

    Before the commit, sequence b holds ``lengths[b]`` committed and ``pendings[b]`` pending
    tokens (its whole draft tree, for which blocks were reserved). Verification keeps
    ``accepted[b]`` of them (0 <= accepted[b] <= pendings[b]); sequence b then holds
    ``lengths[b] + accepted[b]`` tokens, and every block it no longer needs returns to the pool.
    A sequence with ``finished[b]`` (it emitted its end token) is then freed: length 0, all of
    its blocks returned.

    Questions to answer before coding: how many blocks did sequence b own just before the commit
    (what did the reservation of its tree cost?), and how many does it need after? Can a
    sequence free a block even when it accepted something? What does an empty sequence free?

    Args:
        lengths, pendings, accepted: B counts each.
        finished: B flags.
        block_size: token slots per block.
    Returns:
        (new lengths [B], blocks returned to the pool by each sequence [B]).
    """
    # EXERCISE 7.3: per-sequence lengths after a ragged commit, and whole blocks freed (finished ones free all)
    # BEGIN SOLUTION
    new_lengths, freed = [], []
    for L, p, a, done in zip(lengths, pendings, accepted, finished):
        owned = -(-(L + p) // block_size)  # tree padding: blocks for every pending token
        n = 0 if done else L + a
        new_lengths.append(n)
        freed.append(owned - -(-n // block_size))
    return new_lengths, freed
    # END SOLUTION


def gather_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, table: Sequence[int], length: int,
              pending: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's keys and values of one sequence, read out of the block pool through its block table:
    what paged attention reads for the sequence during a verify forward (``PagedKVCache.read``).

    The sequence holds ``length`` committed tokens and ``pending`` tokens of the forward in progress
    (the draft tree, whose slots were reserved and written: "tree padding"); every one of them is a
    key its tree's queries may attend to. Questions to answer before coding: in which block and at
    which offset does token n live? How many of the sequence's blocks does it use, and what sits in
    the slots of its last block past its tokens? Can you compute every token's (block, offset) at
    once and read them with one indexing per tensor?

    Args:
        k_pool, v_pool: [N, Hkv, block_size, hd] one layer's pool of N blocks.
        table: the sequence's block ids, in token order (enough blocks for length + pending tokens).
        length: its committed tokens; pending: the pending forward's tokens after them.
    Returns:
        (k, v), each [Hkv, length + pending, hd] in token order.
    """
    # EXERCISE 7.4: every token's (block, offset) from the block table, pending tree tokens included; one gather each
    # BEGIN SOLUTION
    bs = k_pool.shape[2]
    pos = torch.arange(length + pending, device=k_pool.device)  # [n] token positions
    blocks = torch.as_tensor(list(table), dtype=torch.long, device=k_pool.device)[pos // bs]  # [n] block of each token
    k = k_pool[blocks, :, pos % bs]  # [n, Hkv, hd]
    v = v_pool[blocks, :, pos % bs]
    return k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, n, hd]
    # END SOLUTION
