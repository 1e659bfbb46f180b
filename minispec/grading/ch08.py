"""Checks of chapter 8's exercises (solutions/ch08_cuda_graphs.py): what a CUDA graph needs.

    8.1 capture_hazards   host-sync operators per call and the first operator where a call's record
                          departs from the first call's (names or shapes), on hand-made records and
                          on records of real functions (``graph_rules.record_ops``)
    8.2 static_mask       the [B, T, C] mask of a step over a static KV cache: exact, for chains,
                          trees, ragged lengths, a full cache; built without a host sync (its
                          operators are recorded and checked with ``graph_rules.find_hazards``)
    8.3 pad_to_bucket     tokens, positions and tree mask padded to the smallest bucket: exact,
                          unsorted buckets, exact fits, ValueError past the largest bucket
    8.4 choose_buckets    k buckets of least total padding, compared with a brute force over every
                          subset of the sizes

Each check runs hand-picked edge cases, then a few hundred random ones, against a reference
written here; ``--impl minispec`` answers with the library (``graph_rules.find_hazards``' own
recorder, ``cuda_graphs.static_plan``'s mask, ``pad_inputs`` + ``pick_bucket``,
``graph_rules.best_buckets``), so the reference and the library are checked against each other.
A failure names the case.
"""

from __future__ import annotations

import copy
import itertools
import random
from types import SimpleNamespace
from unittest import mock

import torch

from minispec.cuda_graphs import pad_inputs, pick_bucket, static_plan
from minispec.lab import graph_rules
from minispec.tree import Tree
from minispec.lab.graph_rules import SYNC_OPS, best_buckets, find_hazards, padding_waste, record_ops

from .checks import exercise, get

TITLE = "CUDA graphs: capture rules, static buffers, buckets"
MODULE = "ch08_cuda_graphs"
EXERCISES: list = []
N_RANDOM = 200


# --------------------------------------------------------------------------- references
def reference_hazards(calls, sync_ops):
    found = []
    for i, ops in enumerate(calls):
        found += [(i, "sync", name) for name in dict.fromkeys(n for n, _ in ops if n in sync_ops)]
    for i in range(1, len(calls)):
        a, b = list(calls[0]), list(calls[i])
        if a != b:
            n = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            found.append((i, "shape", n))
    return found


def reference_mask(lengths, tree_mask, capacity):
    B, T, _ = tree_mask.shape
    out = torch.zeros(B, T, capacity, dtype=torch.bool)
    for b in range(B):
        n = int(lengths[b])
        out[b, :, :n] = True
        out[b, :, n:n + T] = tree_mask[b]
    return out


def reference_pad(tokens, positions, tree_mask, batch_buckets, token_buckets):
    B, T = tokens.shape
    return pad_inputs(tokens, positions, tree_mask, pick_bucket(B, batch_buckets), pick_bucket(T, token_buckets))


def brute_force_waste(sizes, k):
    vals = sorted(set(sizes))
    return min(padding_waste(sizes, (*rest, vals[-1])) for r in range(min(k, len(vals)))
               for rest in itertools.combinations(vals[:-1], r))


# --------------------------------------------------------------------------- the library behind the signatures
class _Op:
    """Stands for an ATen operator: ``__name__`` as the dispatcher gives it, called it returns
    meta tensors of the recorded output shapes (so ``graph_rules``' recorder sees what it saw)."""

    def __init__(self, name, shapes):
        self.__name__, self.shapes = f"{name}.default", shapes

    def __call__(self, *args, **kwargs):
        return tuple(torch.empty(s, device="meta") for s in self.shapes)


def _lib_hazards(calls, sync_ops):
    """``graph_rules.find_hazards`` over calls that replay the given records through its recorder
    (``SYNC_OPS`` set to ``sync_ops``), its findings parsed back into tuples."""
    sigs = [[(n, tuple(tuple(s) for s in shapes)) for n, shapes in ops] for ops in calls]

    def replay(i):
        rec = graph_rules._Recorder.__new__(graph_rules._Recorder)  # the recorder's own bookkeeping, no mode entered
        rec.record = graph_rules.OpRecord()
        for name, shapes in sigs[i]:
            rec.__torch_dispatch__(_Op(name, shapes), ())
        return None, rec.record

    with mock.patch.object(graph_rules, "SYNC_OPS", {n: "a host sync" for n in sync_ops}), \
            mock.patch.object(graph_rules, "record_ops", lambda fn, i: replay(i)):
        found = find_hazards(None, *[((i,), {}) for i in range(len(calls))])
    out = []
    for f in found:
        head, _, rest = f.partition(": ")
        i = int(head.split()[1])
        if rest.startswith("shapes change"):
            n = int(rest.split("operator ")[1].split(":")[0]) if "operator " in rest else min(len(sigs[0]),
                                                                                             len(sigs[i]))
            out.append((i, "shape", n))
        else:
            out.append((i, "sync", rest.split(":")[0]))
    return sorted(out, key=lambda t: (t[1] == "shape", t[0]))  # syncs first, then shapes, each by call


def _lib_mask(lengths, tree_mask, capacity):
    """The mask ``static_plan`` builds for ``static_forward``'s attention, [B, 1, T, C] -> [B, T, C]."""
    B, T, _ = tree_mask.shape
    kv = SimpleNamespace(lengths=lengths, capacity=capacity, write_pos=None)
    return static_plan(kv, torch.zeros(B, T, dtype=torch.long), tree_mask).mask[:, 0]


def library():
    """minispec's own functions behind the exercises' signatures (``--impl minispec``)."""
    return SimpleNamespace(__name__="minispec.lab.graph_rules / minispec.cuda_graphs (chapter 8 adapter)",
                           capture_hazards=_lib_hazards, static_mask=_lib_mask, pad_to_bucket=reference_pad,
                           choose_buckets=best_buckets)


# --------------------------------------------------------------------------- helpers
def _frozen(fn, args, case: str):
    """fn(*args), failing if it modified any argument."""
    before = copy.deepcopy(args)
    out = fn(*args)
    for a, b in zip(args, before):
        same = torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        if not same:
            raise AssertionError(f"modified its arguments {case} (build new tensors / lists instead)")
    return out


def _as_findings(got, case):
    try:
        out = []
        for f in got:
            i, kind, what = f
            out.append((int(i), str(kind), what if kind == "sync" else int(what)))
        return out
    except (TypeError, ValueError):
        raise AssertionError(f"must return a list of (call, 'sync', name) / (call, 'shape', n) tuples, got {got!r} "
                             f"{case}") from None


# --------------------------------------------------------------------------- 8.1
MM, ADD, ITEM, NZ = ("mm", ((1, 8),)), ("add", ((1, 8),)), ("_local_scalar_dense", ((),)), ("nonzero", ((3, 1),))


def _real_records():
    """Records of real functions (graph_rules.record_ops), as the notebook shows them."""
    t = torch.tensor([3, 4, 5])

    def rec(fn):
        _, r = record_ops(fn)
        return r.ops
    with torch.inference_mode():
        yield "int(t.max()) in a step", [rec(lambda: int(t.max()) + 1), rec(lambda: int(t.max()) + 1)]
        yield "t[t > 3] then t[t > 4]", [rec(lambda: t[t > 3] * 2), rec(lambda: t[t > 4] * 2)]
        yield "a growing key count", [rec(lambda n=n: torch.ones(1, n) @ torch.ones(n, 2)) for n in (4, 5, 5)]
        yield "a static step", [rec(lambda: (t + 1) * 2), rec(lambda: (t + 1) * 2)]


def _hazard_cases(rng: random.Random):
    sync = set(SYNC_OPS)
    yield "one clean call", [[MM, ADD]], sync
    yield "no calls", [], sync
    yield "two equal clean calls", [[MM, ADD], [MM, ADD]], sync
    yield "a sync twice in one call", [[ITEM, MM, ITEM, ADD]], sync
    yield "two syncs, in first-seen order", [[NZ, MM, ITEM, NZ]], sync
    yield "a sync in the second call only", [[MM], [MM]] + [[MM, ITEM]], sync
    yield "a shape change at operator 1", [[MM, ADD], [MM, ("add", ((2, 8),))]], sync
    yield "a different operator at 0", [[MM, ADD], [ADD, ADD]], sync
    yield "a longer second call", [[MM, ADD], [MM, ADD, ADD]], sync
    yield "a shorter third call", [[MM, ADD, MM], [MM, ADD, MM], [MM]], sync
    yield "compared with call 0, not the previous call", [[MM], [ADD], [ADD]], sync
    yield "the sync set given, not the library's", [[("custom_sync", ((),)), ITEM]], {"custom_sync"}
    yield "sync and shape findings together", [[ITEM, MM], [ITEM, ("mm", ((2, 8),))]], sync
    for what, calls in _real_records():
        yield what, calls, sync
    names = ["mm", "add", "mul", "_local_scalar_dense", "nonzero", "cat", "masked_select"]
    for _ in range(N_RANDOM):
        base = [(rng.choice(names), ((rng.randint(1, 3), 8),)) for _ in range(rng.randint(0, 6))]
        calls = [list(base)]
        for _ in range(rng.randint(0, 3)):
            c = list(base)
            r = rng.random()
            if r < 0.3 and c:
                j = rng.randrange(len(c))
                c[j] = (c[j][0], ((c[j][1][0][0] + 1, 8),))
            elif r < 0.45:
                c.append((rng.choice(names), ((1, 8),)))
            elif r < 0.6 and c:
                c.pop(rng.randrange(len(c)))
            calls.append(c)
        yield "a random record", calls, set(rng.sample(sorted(sync), rng.randint(1, len(sync))))


@exercise(EXERCISES, "8.1", "capture_hazards")
def check_capture_hazards(impl):
    fn = get(impl, "capture_hazards")
    for what, calls, sync_ops in _hazard_cases(random.Random(81)):
        case = f"for {what}: calls={calls}, sync_ops={sorted(sync_ops)}"
        want = reference_hazards(calls, sync_ops)
        got = _as_findings(_frozen(fn, (calls, sync_ops), case), case)
        if got != want:
            hint = ""
            if sorted(map(str, got)) == sorted(map(str, want)):
                hint = " (the same findings in another order: host syncs first, call by call, then shape changes)"
            elif any(k == "sync" for _, k, _ in got) and len([f for f in got if f[1] == "sync"]) > len(
                    [f for f in want if f[1] == "sync"]):
                hint = " (each distinct sync operator once per call)"
            raise AssertionError(f"returned {got} {case}, expected {want}{hint}")


# --------------------------------------------------------------------------- 8.2
def _tree_masks(rng: random.Random, B: int, T: int) -> torch.Tensor:
    """B random tree ancestor masks [B, T, T] (root at 0, each node after its parent)."""
    return torch.stack([Tree([0] * (T - 1), [rng.randrange(i) - 1 for i in range(1, T)]).mask() for _ in range(B)])


def _mask_cases(rng: random.Random):
    chain = lambda T: torch.ones(T, T, dtype=torch.bool).tril()  # noqa: E731
    yield torch.tensor([0]), chain(1)[None], 1  # an empty cache, one token: the whole capacity is that token
    yield torch.tensor([5]), chain(1)[None], 8  # a vanilla step after 5 tokens
    yield torch.tensor([3, 0, 6]), chain(2).expand(3, 2, 2), 8  # ragged rows; row 2 fills the cache
    yield torch.tensor([2]), torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]]).bool(), 10
    yield torch.tensor([4, 1]), torch.eye(3, dtype=torch.bool).expand(2, 3, 3), 7  # padded rows: self only
    for _ in range(N_RANDOM // 4):
        B, T = rng.randint(1, 4), rng.randint(1, 6)
        C = T + rng.randint(0, 10)
        lengths = torch.tensor([rng.randint(0, C - T) for _ in range(B)])
        yield lengths, _tree_masks(rng, B, T), C


@exercise(EXERCISES, "8.2", "static_mask")
def check_static_mask(impl):
    fn = get(impl, "static_mask")
    for lengths, tm, C in _mask_cases(random.Random(82)):
        case = f"for lengths={lengths.tolist()}, capacity={C}, tree_mask of shape {list(tm.shape)}"
        want = reference_mask(lengths, tm, C)
        got = _frozen(fn, (lengths, tm, C), case)
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"must return a torch.Tensor, got {type(got).__name__} {case}")
        if got.dtype != torch.bool or tuple(got.shape) != tuple(want.shape):
            raise AssertionError(f"returned {got.dtype} {list(got.shape)} {case}, expected bool {list(want.shape)}")
        if not torch.equal(got, want):
            b, i, s = (x.item() for x in (got != want).nonzero()[0])
            n = int(lengths[b])
            where = ("a committed slot" if s < n else f"the slot of new token {s - n}" if s < n + tm.shape[1]
                     else "a slot past the new tokens")
            raise AssertionError(f"mask[{b}, {i}, {s}] = {bool(got[b, i, s])} {case}, expected {bool(want[b, i, s])} "
                                 f"(slot {s} is {where} of row {b})")
    tm = _tree_masks(random.Random(8), 2, 3)
    found = find_hazards(fn, ((torch.tensor([2, 5]), tm, 12), {}), ((torch.tensor([3, 7]), tm, 12), {}))
    if found:
        raise AssertionError("reads the lengths on the host or changes shape with them, so it could not run inside a "
                             "captured graph: " + "; ".join(found))


# --------------------------------------------------------------------------- 8.3
def _pad_cases(rng: random.Random):
    def inputs(B, T):
        tok = torch.randint(1, 100, (B, T), generator=torch.Generator().manual_seed(B * 31 + T))
        pos = torch.arange(T).expand(B, T) + torch.randint(1, 50, (B, 1), generator=torch.Generator().manual_seed(T))
        return tok, pos.clone(), _tree_masks(rng, B, T)
    yield (*inputs(1, 1), (1, 2, 4), (1, 2, 4))  # fits exactly: nothing to pad
    yield (*inputs(1, 3), (1, 2, 4), (1, 2, 4, 8))  # tokens padded, batch exact
    yield (*inputs(3, 5), (1, 2, 4, 8), (1, 2, 4, 8))  # both padded
    yield (*inputs(2, 5), (8, 2, 4), (16, 8, 6))  # unsorted buckets: the smallest that fits, not the first
    yield (*inputs(5, 61), (1, 2, 4, 8), (1, 2, 4, 8, 16, 32, 64))  # an EAGLE-2 tree of 60 nodes
    yield (*inputs(2, 4), (2,), (4,))  # one bucket each, exact
    for _ in range(N_RANDOM // 4):
        B, T = rng.randint(1, 6), rng.randint(1, 12)
        bb = rng.sample(range(1, 9), rng.randint(1, 4)) + [rng.randint(B, 8)]
        tb = rng.sample(range(1, 17), rng.randint(1, 5)) + [rng.randint(T, 16)]
        yield (*inputs(B, T), bb, tb)


@exercise(EXERCISES, "8.3", "pad_to_bucket")
def check_pad_to_bucket(impl):
    fn = get(impl, "pad_to_bucket")
    for tok, pos, tm, bb, tb in _pad_cases(random.Random(83)):
        case = f"for tokens of shape {list(tok.shape)}, batch_buckets={list(bb)}, token_buckets={list(tb)}"
        want = reference_pad(tok, pos, tm, bb, tb)
        got = _frozen(fn, (tok, pos, tm, bb, tb), case)
        try:
            got = tuple(got)
            assert len(got) == 3 and all(isinstance(x, torch.Tensor) for x in got)
        except (TypeError, AssertionError):
            raise AssertionError(f"must return (tokens, positions, tree_mask) tensors, got {got!r} {case}") from None
        for name, g_, w in zip(("tokens", "positions", "tree_mask"), got, want):
            if tuple(g_.shape) != tuple(w.shape):
                raise AssertionError(f"{name} has shape {list(g_.shape)} {case}, expected {list(w.shape)} (the "
                                     f"smallest bucket that holds [{tok.shape[0]}, {tok.shape[1]}])")
            if g_.dtype != w.dtype:
                raise AssertionError(f"{name} has dtype {g_.dtype} {case}, expected {w.dtype}")
            if not torch.equal(g_, w):
                idx = tuple(x.item() for x in (g_ != w).nonzero()[0])
                raise AssertionError(f"{name}{list(idx)} = {g_[idx].item()} {case}, expected {w[idx].item()}")
    tok, pos, tm = torch.ones(3, 2, dtype=torch.long), torch.zeros(3, 2, dtype=torch.long), _tree_masks(random.Random(0), 3, 2)
    for bb, tb in (((1, 2), (2, 4)), ((4,), (1,))):
        try:
            fn(tok, pos, tm, bb, tb)
        except ValueError:
            continue
        raise AssertionError(f"returned for tokens of shape [3, 2] with batch_buckets={list(bb)}, token_buckets="
                             f"{list(tb)} instead of raising ValueError (they exceed every bucket)")


# --------------------------------------------------------------------------- 8.4
def _bucket_cases(rng: random.Random):
    yield [7], 1
    yield [7], 3  # more buckets than distinct sizes
    yield [61] * 5 + [11], 1  # one bucket: the largest size
    yield [61] * 5 + [11], 2
    yield [1, 2, 3, 4, 5, 6, 7, 8], 3
    yield [1, 1, 1, 1, 10], 2  # frequency matters: a bucket at 1, not in the middle
    yield [1, 9, 10, 10, 10], 2  # not the most frequent sizes: the waste
    yield [2, 3, 5, 8, 13, 21, 34], 4
    yield [6, 5, 9, 61, 61, 33, 2, 61], 3  # unsorted input
    for _ in range(N_RANDOM):
        n = rng.randint(1, 14)
        pool = rng.sample(range(1, 65), rng.randint(1, 9))
        yield [rng.choice(pool) for _ in range(n)], rng.randint(1, 5)


@exercise(EXERCISES, "8.4", "choose_buckets")
def check_choose_buckets(impl):
    fn = get(impl, "choose_buckets")
    for sizes, k in _bucket_cases(random.Random(84)):
        case = f"for sizes={sizes}, k={k}"
        got = _frozen(fn, (sizes, k), case)
        try:
            got = sorted({int(b) for b in got})
        except (TypeError, ValueError):
            raise AssertionError(f"must return a list of ints, got {got!r} {case}") from None
        if not got or len(got) > k:
            raise AssertionError(f"returned {len(got)} distinct buckets {got} {case}: at least 1, at most k={k}")
        if max(got) < max(sizes):
            raise AssertionError(f"returned {got} {case}: size {max(sizes)} fits no bucket")
        best = brute_force_waste(sizes, k)
        waste = padding_waste(sizes, got)
        if waste != best:
            raise AssertionError(f"returned {got} {case}, which pads {waste} slots; the best {k} buckets pad {best} "
                                 f"(e.g. {best_buckets(sizes, k)})")
