"""Chapter 8 exercises: what a CUDA graph needs (no host syncs, static shapes, static buffers, buckets).

A CUDA graph records the kernels of one step once and replays them with a single launch, on
the same addresses and with the same shapes. So a step that is to be captured

  - must not make the host wait for the device (a *host sync*: ``.item()``, ``int(t)``,
    ``nonzero``, boolean-mask indexing, a copy to the host), nor change a shape from one step
    to the next (exercise 8.1 finds both in a record of the operators a step dispatched);
  - reads its inputs from static buffers: the KV cache keeps its committed lengths in a device
    tensor, every step attends over the cache's whole capacity, and a mask built on the device
    hides what a row must not see (exercise 8.2);
  - is captured once, after a warm-up, and replayed: new inputs are copied into the captured
    tensors, and the outputs are the captured ones, overwritten by the next replay (exercise 8.3);
  - has one of a few shapes: the batch and the new tokens of a step are padded up to a bucket,
    one graph per bucket, and the buckets are chosen to waste little (8.4).

The library's versions are in ``minispec.kv`` (``StaticKVCache``), ``minispec.cuda_graphs`` (``static_forward``,
``capture``, ``pad_inputs``, ``pick_bucket``, ``GraphedForward``) and ``minispec.lab.graph_rules``
(``record_ops``, ``find_hazards``, ``padding_waste``, ``best_buckets``).

References:
    NVIDIA, "CUDA Graphs" (CUDA C++ Programming Guide): capture and its restrictions.
    PyTorch, "Accelerating PyTorch with CUDA Graphs" (2021) and ``torch.cuda.graph``.
    gpt-fast (PyTorch team, 2023): a static KV cache attended over its whole length with a mask.
    vLLM and SGLang: one graph per batch-size bucket.

Check your work: ``python -m minispec grade 8``, or ``minispec.grading.check("8.1")``, or
``pytest tests/test_exercises.py -m ch08 --impl exercises``.
"""

from __future__ import annotations

from typing import Sequence

import torch


def capture_hazards(calls: Sequence[Sequence[tuple[str, tuple]]], sync_ops: set[str]) -> list[tuple]:
    """What keeps a step from being captured, read off the operators its calls dispatched.

    ``calls`` holds one record per call of the step (consecutive steps, in order); a record is the
    list of the operators that call dispatched, in order, each as ``(name, output_shapes)`` (as in
    ``minispec.lab.graph_rules.OpRecord.ops``, e.g. ``("mm", ((1, 576),))``).

    Two kinds of findings, in this order:
      1. host syncs: for each call i in order, ``(i, "sync", name)`` for each distinct operator
         name of that call that is in ``sync_ops``, in the order of its first occurrence;
      2. changing shapes: for each call i >= 1 whose record differs from call 0's (names or
         shapes), ``(i, "shape", n)`` where n is the index of the first operator at which the
         two records differ, or the length of the shorter record when one is a prefix of the
         other.

    Args:
        calls: one list of (operator name, output shapes) per call.
        sync_ops: the names of the operators that make the host wait for the device.
    Returns:
        the findings as tuples; empty when the step can be captured.
    """
    # EXERCISE 8.1: host-sync operators of every call, then the first operator where a call's record departs from call 0's
    # BEGIN SOLUTION
    found = []
    for i, ops in enumerate(calls):
        seen = []
        for name, _ in ops:
            if name in sync_ops and name not in seen:
                seen.append(name)
        found += [(i, "sync", name) for name in seen]
    first = list(calls[0]) if calls else []
    for i, ops in enumerate(calls[1:], 1):
        ops = list(ops)
        if ops != first:
            n = next((j for j, (a, b) in enumerate(zip(first, ops)) if a != b), min(len(first), len(ops)))
            found.append((i, "shape", n))
    return found
    # END SOLUTION


def static_mask(lengths: torch.Tensor, tree_mask: torch.Tensor, capacity: int) -> torch.Tensor:
    """The attention mask of a captured step over a static KV cache of ``capacity`` slots.

    Row b of the batch holds ``lengths[b]`` committed tokens in slots 0 .. lengths[b] - 1; the
    step's T new tokens are written to the slots that follow, new token j of row b at slot
    ``lengths[b] + j``. Every new token attends over the whole capacity, so the mask says, for
    new token i of row b and slot s, whether i may see what s holds: every committed slot, and
    the slot of new token j exactly when ``tree_mask[b, i, j]``; nothing else (slots past the
    new tokens hold stale or no entries).

    Build it with tensor operations only: it runs inside the captured graph, so it must not read
    ``lengths`` on the host (no ``.item()``, ``int()``, ``.tolist()``, no Python loop over the
    values). The grader records the operators your function dispatches and fails on a host sync.

    Args:
        lengths: long [B], committed tokens per row (lengths[b] + T <= capacity).
        tree_mask: bool [B, T, T], True where new token i may see new token j.
        capacity: slots of the cache, C.
    Returns:
        bool [B, T, C].
    """
    # EXERCISE 8.2: the [B, T, C] mask over the cache's slots: the committed prefix plus the tree mask placed after it
    # BEGIN SOLUTION
    B, T, _ = tree_mask.shape
    slots = torch.arange(capacity, device=lengths.device)  # [C]
    mask = (slots[None, None, :] < lengths[:, None, None]).expand(B, T, capacity).clone()  # [B, T, C] the prefix
    write_pos = lengths[:, None] + torch.arange(T, device=lengths.device)  # [B, T] slots of the new tokens
    mask.scatter_(2, write_pos[:, None, :].expand(B, T, T), tree_mask)  # mask[b, i, write_pos[b, j]] = tree_mask[b, i, j]
    return mask
    # END SOLUTION


def capture_replay(step, static_inputs: dict, cuda, warmup: int = 2, pool=None):
    """Capture ``step`` in a CUDA graph and return a function that replays it on new inputs.

    ``step()`` reads its inputs from the tensors of ``static_inputs`` (name -> tensor) and returns its
    outputs. ``cuda`` is the graph API: ``torch.cuda`` on a GPU, or the grader's stand-in on a CPU, with
    the same names: ``cuda.Stream()``, ``cuda.current_stream()``, ``with cuda.stream(s):``,
    ``s.wait_stream(other)``, ``cuda.CUDAGraph()``, ``with cuda.graph(g, pool=..., capture_error_mode=...):``,
    ``g.replay()``, ``g.pool()``.

    The chapter's section on capture says why each step is there. Questions to answer before coding:
    where do the warm-up calls run, and what must each stream wait for? Which memory pool does the graph
    allocate from, and which capture error mode keeps another thread's CUDA calls from breaking this
    capture? How do new inputs reach a graph that replays fixed addresses? What does a replay return?

    Args:
        step: the function to capture (no arguments).
        static_inputs: the tensors ``step`` reads; their addresses are what the graph replays.
        cuda: the graph API (``torch.cuda`` or a stand-in).
        warmup: eager calls of ``step`` before the capture.
        pool: a memory pool to share with graphs captured before (``g.pool()`` of one), or None.
    Returns:
        (run, pool): ``run(**inputs)`` puts each input into the static tensor of the same name, replays the
        graph once and returns the step's outputs, the very tensors the capture returned (the next replay
        overwrites them); ``pool`` the graph's memory pool (``g.pool()``).
    """
    # EXERCISE 8.3: warm-up on a side stream, capture (thread-local error mode, shared pool), copy_ inputs, replay
    # BEGIN SOLUTION
    side = cuda.Stream()  # warm-up off the stream that will capture: lazy initialisation, workspaces
    side.wait_stream(cuda.current_stream())  # ... after everything queued so far
    with cuda.stream(side):
        for _ in range(warmup):
            step()
    cuda.current_stream().wait_stream(side)  # capture after the warm-up's work
    graph = cuda.CUDAGraph()
    with cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):  # only this thread's calls count
        out = step()  # recorded, not run: its outputs live in the graph's pool

    def run(**inputs):
        for name, x in inputs.items():
            static_inputs[name].copy_(x)  # into the captured addresses
        graph.replay()
        return out  # overwritten by the next replay: clone what must outlive it

    return run, graph.pool()
    # END SOLUTION


def choose_buckets(sizes: Sequence[int], k: int) -> list[int]:
    """At most ``k`` buckets that minimise the padding of ``sizes``: one CUDA graph per bucket.

    Every size s is padded up to the smallest bucket >= s, wasting (bucket - s) slots; the total
    waste is the sum over ``sizes`` (a multiset: a size that occurs 5 times counts 5 times).
    Return a set of at most k buckets that holds every size (the largest bucket is at least
    the largest size) with the least total waste; when several sets tie, any of them.

    Hint: some optimal set uses only sizes that occur, and its largest bucket is the largest
    size. Sort the distinct sizes and think about the best waste of the first i of them with j
    buckets, the j-th bucket at the i-th size (a dynamic programme; the grader compares your
    waste with a brute force over every subset).

    Args:
        sizes: the sizes that occur, at least one (positive integers).
        k: the most buckets (>= 1).
    Returns:
        the buckets (a list of ints).
    """
    # EXERCISE 8.4: the k buckets of least total padding, by dynamic programming over the sorted distinct sizes
    # BEGIN SOLUTION
    vals = sorted(set(sizes))
    count = {v: 0 for v in vals}
    for s in sizes:
        count[s] += 1
    n, inf = len(vals), float("inf")

    def waste(lo, hi):  # sizes vals[lo..hi] padded to vals[hi]
        return sum((vals[hi] - vals[x]) * count[vals[x]] for x in range(lo, hi + 1))

    best = [[inf] * (n + 1) for _ in range(k + 1)]  # best[j][i]: first i sizes with j buckets, the last at vals[i-1]
    prev = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0
    for j in range(1, k + 1):
        for i in range(1, n + 1):
            for p in range(i):
                c = best[j - 1][p] + waste(p, i - 1)
                if c < best[j][i]:
                    best[j][i], prev[j][i] = c, p
    j = min(range(1, k + 1), key=lambda j: best[j][n])
    out, i = [], n
    while i > 0:
        out.append(vals[i - 1])
        i, j = prev[j][i], j - 1
    return sorted(out)
    # END SOLUTION
