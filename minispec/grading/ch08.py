"""Checks of chapter 8's exercises (solutions/ch08_cuda_graphs.py): what a CUDA graph needs.

    8.1 capture_hazards   host-sync operators per call and the first operator where a call's record
                          departs from the first call's (names or shapes), on hand-made records and
                          on records of real functions (``graph_rules.record_ops``)
    8.2 static_mask       the [B, T, C] mask of a step over a static KV cache: exact, for chains,
                          trees, ragged lengths, a full cache; built without a host sync (its
                          operators are recorded and checked with ``graph_rules.find_hazards``)
    8.3 capture_replay    warm-up on a side stream, capture (thread-local error mode, a shared pool),
                          copy_ into the static inputs, replay: graded on the CPU against
                          ``StandInCUDA``, a stand-in for torch.cuda that records the calls and their
                          order and replays into the captured outputs; for real where CUDA is present
    8.4 choose_buckets    k buckets of least total padding, compared with a brute force over every
                          subset of the sizes

Each check runs hand-picked edge cases, then a few hundred random ones, against a reference
written here; ``--impl minispec`` answers with the library (``graph_rules.find_hazards``' own
recorder, ``cuda_graphs.static_plan``'s mask, ``graph_rules.best_buckets``), so the reference and
the library are checked against each other; 8.3's adapter runs ``cuda_graphs.capture`` itself with its
``torch.cuda`` swapped for the stand-in.
A failure names the case.
"""

from __future__ import annotations

import copy
import itertools
import random
from contextlib import contextmanager
from types import SimpleNamespace
from unittest import mock

import torch

from minispec.cuda_graphs import static_plan
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


def library_capture_replay(step, static_inputs, cuda, warmup=2, pool=None):
    """``minispec.cuda_graphs.capture`` behind 8.3's signature: the library's capture run against ``cuda`` (the
    stand-in, or torch.cuda on a GPU), its replay wrapped in the copy of the inputs into their static tensors."""
    from types import ModuleType

    from minispec import cuda_graphs

    proxy = ModuleType("torch")  # torch, with its cuda replaced by the given API while capture runs
    proxy.__dict__.update(vars(torch))
    proxy.cuda = cuda
    with mock.patch.object(cuda_graphs, "torch", proxy):
        replay, pool = cuda_graphs.capture(step, torch.device("cuda"), pool, warmup)

    def run(**inputs):
        for name, x in inputs.items():
            static_inputs[name].copy_(x)
        return replay()

    return run, pool


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
                           capture_hazards=_lib_hazards, static_mask=_lib_mask, capture_replay=library_capture_replay,
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
class _Stream:
    def __init__(self, api: "StandInCUDA", name: str):
        self.api, self.name = api, name

    def wait_stream(self, other: "_Stream") -> None:
        self.api.events.append(("wait", self.name, other.name))

    def __repr__(self):
        return f"<stream {self.name}>"


class _Graph:
    def __init__(self, api: "StandInCUDA", n: int):
        self.api, self.n, self.steps, self._pool = api, n, [], None

    def replay(self) -> None:
        """Run the captured steps again, each writing its outputs into the tensors its capture returned."""
        self.api.events.append(("replay", self.n))
        for fn, out in self.steps:
            with torch.no_grad():
                new = fn()
                for o, x in zip(_tensors(out), _tensors(new)):
                    o.copy_(x)

    def pool(self):
        return self._pool


def _tensors(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


class StandInCUDA:
    """The part of ``torch.cuda`` a capture uses, on a CPU (exercise 8.3's grader, and chapter 8's live demo).

    It records every call in order in ``events`` and keeps the semantics a learner must get right: a step is
    only *recorded* inside ``graph(...)`` (``capturable`` steps know whether they run eagerly, on which stream,
    or under capture), a replay re-runs the captured steps into the very output tensors the capture returned
    (as a CUDA graph overwrites its static outputs), and ``g.pool()`` is the pool the graph allocated from
    (the one passed in, or its own).

        cuda = StandInCUDA()
        step = cuda.capturable(lambda: x * 2)  # the function to capture; x a static input
    """

    def __init__(self):
        self.events: list[tuple] = []
        self.default = _Stream(self, "default")
        self._active = self.default
        self._capturing: _Graph | None = None
        self._counts = dict(stream=0, graph=0, pool=0)

    # the names of torch.cuda
    def Stream(self) -> _Stream:  # noqa: N802 (torch.cuda's name)
        self._counts["stream"] += 1
        s = _Stream(self, f"side-{self._counts['stream']}")
        self.events.append(("Stream", s.name))
        return s

    def current_stream(self) -> _Stream:
        return self._active

    @contextmanager
    def stream(self, s: _Stream):
        before, self._active = self._active, s
        self.events.append(("enter stream", s.name))
        try:
            yield
        finally:
            self._active = before
            self.events.append(("exit stream", s.name))

    def CUDAGraph(self) -> _Graph:  # noqa: N802 (torch.cuda's name)
        self._counts["graph"] += 1
        self.events.append(("CUDAGraph", self._counts["graph"]))
        return _Graph(self, self._counts["graph"])

    @contextmanager
    def graph(self, g: _Graph, pool=None, stream=None, capture_error_mode: str = "global"):
        if not isinstance(g, _Graph):
            raise TypeError(f"graph() takes the CUDAGraph to capture into, got {type(g).__name__}")
        if pool is None:
            self._counts["pool"] += 1
            pool = ("pool", self._counts["pool"])
        g._pool = pool
        self.events.append(("capture", g.n, pool, capture_error_mode, self._active.name))
        self._capturing = g
        try:
            yield
        finally:
            self._capturing = None
            self.events.append(("end capture", g.n))

    # the step under test
    def capturable(self, fn):
        """``fn`` as a step: eagerly it runs and records the stream it ran on; under capture it runs once to
        make the static outputs and is recorded in the graph, which replays it into them."""
        def step():
            if self._capturing is not None:
                out = fn()
                self._capturing.steps.append((fn, out))
                self.events.append(("step", "captured", self._capturing.n))
                return out
            self.events.append(("step", "eager", self._active.name))
            return fn()
        return step


def _capture_problem(events: list[tuple], warmup: int, pool) -> str | None:
    """What the learner's calls (``StandInCUDA.events`` of ``capture_replay``, before any ``run``) get wrong."""
    names = [e[0] for e in events]
    if "Stream" not in names:
        return "no side stream: warm up on a new cuda.Stream(), not on the stream that captures"
    side = next(e[1] for e in events if e[0] == "Stream")
    eager = [i for i, e in enumerate(events) if e[:2] == ("step", "eager")]
    if len(eager) != warmup:
        return f"step ran eagerly {len(eager)} times before the capture: the warm-up is {warmup} calls"
    if any(events[i][2] != side for i in eager):
        return "a warm-up call ran on the capturing (current) stream: run the warm-up inside `with cuda.stream(side):`"
    waits = [(i, e) for i, e in enumerate(events) if e[0] == "wait"]
    first = eager[0] if eager else next((i for i, e in enumerate(events) if e[0] == "capture"), len(events))
    if not any(e[1] == side and e[2] == "default" and i < first for i, e in waits):
        return ("the side stream does not wait for the current stream before the warm-up "
                "(side.wait_stream(cuda.current_stream())): it could run ahead of work queued before it")
    cap = [i for i, e in enumerate(events) if e[0] == "capture"]
    if len(cap) != 1:
        return f"{len(cap)} captures: capture the step once, in one `with cuda.graph(...)` block"
    c = events[cap[0]]
    last = eager[-1] if eager else -1
    if not any(e[1] == "default" and e[2] == side and last < i < cap[0] for i, e in waits):
        return ("the current stream does not wait for the side stream between the warm-up and the capture "
                "(cuda.current_stream().wait_stream(side)): the capture could start before the warm-up finished")
    if c[4] != "default":
        return "the capture ran inside the side stream's block: capture on the current stream, after the warm-up"
    if c[3] != "thread_local":
        return (f"capture_error_mode={c[3]!r}: capture with capture_error_mode='thread_local', so that only this "
                "thread's forbidden calls break the capture (in the default 'global' mode an unsafe CUDA call from "
                "any other thread, another decoder or a logger, fails it)")
    if pool is not None and c[2] is not pool:
        return "the graph did not allocate from the pool it was given: pass pool=pool to cuda.graph(...)"
    captured = [e for e in events if e[:2] == ("step", "captured")]
    if len(captured) != 1:
        return f"step ran {len(captured)} times under capture: once records it"
    if not any(e[0] == "end capture" for e in events):
        return "the capture block was not closed"
    return None


@exercise(EXERCISES, "8.3", "capture_replay")
def check_capture_replay(impl):
    fn = get(impl, "capture_replay")
    for warmup, shared in ((2, False), (1, True), (3, False)):
        cuda = StandInCUDA()
        x, w = torch.zeros(3), torch.tensor([1.0, 2.0, 3.0])
        static = {"x": x, "w": w}
        step = cuda.capturable(lambda: (static["x"] * static["w"], static["x"].sum()))
        pool = ("pool", "shared") if shared else None
        case = f"(warmup={warmup}, pool {'shared with an earlier graph' if shared else 'None'})"
        out = fn(step, static, cuda, warmup=warmup, pool=pool)
        try:
            run, got_pool = out
        except (TypeError, ValueError):
            raise AssertionError(f"capture_replay must return (run, pool), got {type(out).__name__} {case}") from None
        problem = _capture_problem(cuda.events, warmup, pool)
        if problem:
            raise AssertionError(f"{problem} {case}")
        graph = next(e[1] for e in cuda.events if e[0] == "capture")
        want_pool = next(e[2] for e in cuda.events if e[0] == "capture")
        if got_pool is not want_pool:
            raise AssertionError(f"returned pool {got_pool!r}, not the graph's g.pool() {case}")
        held = None
        for value in (torch.tensor([1.0, -1.0, 0.5]), torch.tensor([2.0, 0.0, 4.0])):
            n = len(cuda.events)
            res = run(x=value.clone())
            new = cuda.events[n:]
            if not (static["x"] is x and torch.equal(x, value)):
                raise AssertionError(f"run(x=...) did not copy the input into the static tensor the graph reads "
                                     f"(static_inputs['x'].copy_(value)); rebinding the name or a new tensor leaves the "
                                     f"captured address unchanged {case}")
            if [e for e in new if e[0] == "step"]:
                raise AssertionError(f"run() called step() again: replay the graph (g.replay()) {case}")
            if [e for e in new if e[0] == "replay"] != [("replay", graph)]:
                raise AssertionError(f"run() must replay the captured graph once, got {[e for e in new]} {case}")
            try:
                prod, total = res
            except (TypeError, ValueError):
                raise AssertionError(f"run() must return the step's outputs (a tuple here), got {res!r} {case}") from None
            if not (torch.equal(prod, value * w) and torch.equal(total, value.sum())):
                raise AssertionError(f"run(x={value.tolist()}) returned {prod.tolist()}, {total.item()}; the step "
                                     f"gives {(value * w).tolist()}, {value.sum().item()} {case}")
            if held is not None and not (prod is held[0] and total is held[1]):
                raise AssertionError(f"run() returned new tensors: a replay writes into the outputs the capture "
                                     f"returned; return those {case}")
            held = (prod, total)
    if torch.cuda.is_available():  # and for real
        dev = torch.device("cuda")
        x = torch.zeros(1024, device=dev)
        w = torch.linspace(0, 1, 1024, device=dev)
        static = {"x": x}
        run, _ = fn(lambda: (static["x"] * w).cumsum(0), static, torch.cuda, warmup=2, pool=None)
        for v in (torch.ones(1024, device=dev), torch.arange(1024.0, device=dev)):
            got = run(x=v).clone()
            if not torch.allclose(got, (v * w).cumsum(0)):
                raise AssertionError("on this GPU, a replay of the captured step did not compute the step on the new "
                                     "input")


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
