"""The tree built on the device with fixed shapes (``minispec.drafters.device_tree``) is ``TreeDrafter``'s tree:
same tokens, parents and order, on random heads whose logits tie often; its verify inputs are ``Tree``'s."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minispec.drafters import device_tree
from minispec.drafters.tree_drafter import GrowingTree, TreeDrafter, TreeSpec
from minispec.sampling import GREEDY
from minispec.tree import Tree

pytestmark = pytest.mark.ch05

LEVELS = (-3.0, -1.0, 0.0, 0.0, 1.0, 2.5)  # logits drawn from few values: ties in top-k and in the rerank are common


def path_logits(seed: int, V: int):
    """A random 'head': the logits of a node's children are a function of the node's path from the root."""
    def logits_of(path: tuple) -> torch.Tensor:
        rng = random.Random(f"{seed}:{path}")
        return torch.tensor([rng.choice(LEVELS) for _ in range(V)])
    return logits_of


class PathDrafter(TreeDrafter):
    """``TreeDrafter`` on a path-logits head (hooks on host lists)."""

    def __init__(self, tree, logits_of):
        super().__init__(tree)
        self.logits_of, self.context = logits_of, [0, 0]

    def _start(self):
        self.paths = []
        return self.logits_of(())

    def _extend(self, tokens, parents):
        for t, p in zip(tokens, parents):
            self.paths.append((self.paths[p] if p >= 0 else ()) + (t,))
        return torch.stack([self.logits_of(path) for path in self.paths[-len(tokens):]])


def device_extend(logits_of, calls: list):
    """The same head as the device hook takes it: tensors in, logits [n, V] out (read on the host: a test)."""
    paths = []

    def extend(tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(tokens.shape))
        for t, p in zip(tokens.tolist(), parents.tolist()):
            paths.append((paths[p] if p >= 0 else ()) + (t,))
        return torch.stack([logits_of(path) for path in paths[-len(tokens):]])
    return extend


@st.composite
def dynamic_trees(draw):
    depth, K = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    V = draw(st.integers(K, 7))
    N = draw(st.integers(1, K + (depth - 1) * K * K))
    return depth, K, N, V, draw(st.integers(0, 10 ** 6))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(dynamic_trees(), st.integers(1, 4))
def test_device_dynamic_tree_is_tree_drafters(case, budget):
    """EAGLE-2's expand / rerank on fixed shapes: the very tree ``TreeDrafter._dynamic`` builds (tokens,
    parents, order), ties broken as ``rerank`` breaks them (-score, depth, id), also when a budget cuts depth."""
    depth, K, N, V, seed = case
    logits_of = path_logits(seed, V)
    want = PathDrafter(TreeSpec.dynamic(depth, K, N), logits_of).propose(GREEDY, budget)
    D = min(depth, budget)
    calls = []
    tokens, parents = device_tree.dynamic(logits_of(()), device_extend(logits_of, calls), D, K, N)
    assert (tokens.tolist(), parents.tolist()) == (want.tokens, want.parents)
    assert calls == [(K,)] * (D - 1)  # fixed shapes: every level after the first extends K nodes
    assert tokens.shape == (min(N, K + (D - 1) * K * K),)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.integers(1, 6), st.integers(2, 6), st.integers(0, 10 ** 6))
def test_device_chain_is_tree_drafters(depth, V, seed):
    logits_of = path_logits(seed, V)
    want = PathDrafter(TreeSpec.chain(depth), logits_of).propose(GREEDY, depth)
    tokens, parents = device_tree.chain(logits_of(()), device_extend(logits_of, []), depth)
    assert (tokens.tolist(), parents.tolist()) == (want.tokens, want.parents)


def test_ties_are_broken_by_depth_then_id():
    """A hand-made tie: every logit equal, so every candidate of a level scores the same; the rerank must keep
    the shallower ones first, then the lower ids (an unstable sort, or one by score alone, would not)."""
    flat = lambda path: torch.zeros(3)  # noqa: E731
    want = PathDrafter(TreeSpec.dynamic(3, 2, 5), flat).propose(GREEDY, 3)
    tokens, parents = device_tree.dynamic(flat(()), device_extend(flat, []), 3, 2, 5)
    assert (tokens.tolist(), parents.tolist()) == (want.tokens, want.parents)
    assert Tree(want.tokens, want.parents).depths() == [1, 1, 2, 2, 2]


@settings(max_examples=80, deadline=None, derandomize=True)
@given(st.lists(st.integers(-1, 30), min_size=1, max_size=24), st.integers(0, 10 ** 6))
def test_verify_inputs_are_trees(raw, seed):
    """``verify_inputs`` (ancestor mask, depths) equals ``Tree.mask`` and ``Tree.positions`` on random trees;
    ``Ancestry`` equals ``GrowingTree`` level by level."""
    parents = [min(p, i - 1) if p >= 0 else -1 for i, p in enumerate(raw)]  # topological: a parent before its child
    tree = Tree(list(range(len(parents))), parents)
    t = device_tree.verify_inputs(torch.tensor([7]), torch.tensor(tree.tokens), torch.tensor(parents), tree.depth)
    assert torch.equal(t.mask, tree.mask())
    assert torch.equal(t.depths, tree.positions(0))
    assert t.tokens.tolist() == [7] + tree.tokens and t.parents.tolist() == parents
    # too few ancestor steps miss the deepest ancestors (the loop count matters)
    if tree.depth > 1:
        short = device_tree.verify_inputs(torch.tensor([7]), torch.tensor(tree.tokens), torch.tensor(parents), 1)
        assert not torch.equal(short.mask, tree.mask())
    anc, grow = device_tree.Ancestry(len(parents), "cpu"), GrowingTree()
    rng, i = random.Random(seed), 0
    while i < len(parents):  # add the nodes in random-size levels (a level's parents were added before it)
        room = next((j for j in range(i, len(parents)) if parents[j] >= i), len(parents)) - i
        n = rng.randint(1, room)
        depth, rows = anc.add(torch.tensor(parents[i:i + n]))
        pos, mask = grow.add(parents[i:i + n], committed=3)
        assert torch.equal(depth + 2, pos) and torch.equal(rows[:, :i + n], mask[:, 3:])
        assert not rows[:, i + n:].any()
        i += n


# --------------------------------------------------------------------------- an EAGLE head's whole draft, graphed
def _head_drafter(kind: str, model, tree: str, capacity: int = 1024):
    from minispec.drafters.eagle import EagleConfig, EagleDrafter, EagleHead
    from minispec.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head

    torch.manual_seed(0)
    if kind == "eagle3":
        head = Eagle3Head(Eagle3Config.for_target(model, 96)).to(model.device).eval()
        return Eagle3Drafter(model, head, tree=tree, capacity=capacity)
    layers = 2 if kind == "eagle-2layers" else 1
    head = EagleHead(EagleConfig.for_target(model.cfg, num_hidden_layers=layers)).to(model.device).eval()
    return EagleDrafter(model, head, tree=tree, capacity=capacity)


def _drafts(drafter, model, seq: list[int], graphs: bool, steps: int = 9, no_sync: bool = False,
            again: int = -1) -> list[tuple]:
    """Prefill 20 tokens of ``seq``, then draft and commit 1..depth + 1 of the next tokens of ``seq`` (with the
    target's features) ``steps`` times: every draft's (tokens, parents). ``no_sync`` (CUDA): every draft after
    the first (the prompt's catch-up, eager) runs with host synchronisations made errors. ``again``: at that step
    draft twice before committing (EAGLE-1/2: the second recomputes the root's pair)."""
    from minispec.drafters.base import Features

    assert drafter.use_graphs(graphs) == graphs
    with torch.no_grad():
        out = model(torch.tensor([seq], device=model.device), hidden_layers=drafter.target_layers)
    feats = Features(out.hidden[0], {i: h[0] for i, h in out.layer_inputs.items()})
    rng, n = random.Random(1), 20
    drafter.prefill(seq[:n], feats.rows(slice(0, n - 1)))
    trees = []
    for _ in range(steps):
        depth = drafter.spec.depth
        if no_sync and trees:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            t = drafter.propose(GREEDY, budget=depth)
        finally:
            if no_sync:
                torch.cuda.set_sync_debug_mode("default")
        assert (t.tensors is not None) == graphs  # graphed: the tree came from the device
        trees.append((t.tokens, t.parents))
        if len(trees) == again + 1:
            t = drafter.propose(GREEDY, budget=depth)
            trees.append((t.tokens, t.parents))
        e = rng.randint(1, depth + 1)  # accepted drafts + the target's token
        drafter.commit(seq[n:n + e], feats.rows(slice(n - 1, n - 1 + e)))
        n += e
    return trees


@pytest.mark.ch08
@pytest.mark.parametrize("kind", ["eagle", "eagle-2layers", "eagle3"])
@pytest.mark.parametrize("tree", ["chain:4", "4,3,10"])
def test_graphed_head_drafts_are_eager_drafts(kind, tree):
    """``GraphedDraft`` (on the CPU: its direct call over a static head cache) drafts, step after step, the trees
    the eager hooks draft: a long first catch-up (the prompt), then catch-ups of 1 to depth + 1 pairs (every
    bucket), chains and dynamic trees, EAGLE-1/2 heads of one and two layers and an EAGLE-3 head."""
    from minispec import load

    model, _ = load("tiny-llama")
    seq = random.Random(0).choices(range(model.cfg.vocab_size), k=80)
    again = 3 if kind.startswith("eagle-") or kind == "eagle" else -1
    eager = _drafts(_head_drafter(kind, model, tree), model, seq, graphs=False, again=again)
    d = _head_drafter(kind, model, tree)
    assert _drafts(d, model, seq, graphs=True, again=again) == eager
    assert again < 0 or eager[again] == eager[again + 1]  # the same context, drafted twice: the same tree
    assert len({b for b, _ in d.graph.replays}) >= 2  # several catch-up buckets were replayed



@pytest.mark.ch08
def test_which_drafts_are_graphed_and_back_to_eager():
    """With graphs on, an EAGLE head graphs chains and dynamic trees; a static tree drafts eagerly (on its own
    eager cache); a later generation without graphs drafts eagerly again, on an eager cache."""
    from minispec import load
    from minispec.generate import Decoder
    from minispec.kv import KVCache

    model, _ = load("tiny-llama")
    for tree, graphed in (("eagle", False), ("chain:3", True), ("3,2,4", True)):
        d = _head_drafter("eagle", model, tree)
        dec = Decoder(model, list(range(3, 15)), d, max_new_tokens=6, graphs=True)
        assert dec.drafter_graphs == graphed and (d.graph is not None) == graphed
        dec.prefill()
        assert (dec.propose().tensors is not None) == graphed
        Decoder(model, list(range(3, 15)), d, max_new_tokens=6)
        assert d.graph is None and isinstance(d.kv, KVCache)

@pytest.mark.ch08
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_the_warm_up_runs_of_a_capture_change_nothing(kind, monkeypatch):
    """On a GPU ``capture`` first runs a draft eagerly ``warmup`` times (lazy initialisation), on the inputs of
    the draft that asked for the capture: those runs must leave the head cache as one draft leaves it. A stand-in
    for ``capture`` that runs them on the CPU, then returns the direct call: the drafts stay the eager ones."""
    from minispec import load
    from minispec.drafters import graphed_draft

    def capture_with_warm_up(fn, device, pool=None, warmup=2):
        for _ in range(warmup):
            fn()
        return fn, None
    monkeypatch.setattr(graphed_draft, "capture", capture_with_warm_up)
    model, _ = load("tiny-llama")
    seq = random.Random(0).choices(range(model.cfg.vocab_size), k=80)
    eager = _drafts(_head_drafter(kind, model, "4,3,10"), model, seq, graphs=False)
    d = _head_drafter(kind, model, "4,3,10")
    assert _drafts(d, model, seq, graphs=True) == eager and d.graph.captures >= 2

@pytest.mark.ch08
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("tree", ["chain:4", "4,3,10"])
def test_a_whole_draft_is_capturable(kind, tree):
    """The body a graph captures (``GraphedDraft._draft``: catch-up, levels, tree) checked on the CPU by
    ``lab.graph_rules.find_hazards``: no host synchronisation, and the same operators on the same shapes for
    another committed count, another number of new pairs in the bucket and other tokens (a head cache of 64
    slots: the CPU's row-invariant attention reads a mask on the host past 128 keys, a GPU's never)."""
    from minispec import load
    from minispec.lab.graph_rules import find_hazards

    model, _ = load("tiny-llama")
    d = _head_drafter(kind, model, tree, capacity=64)
    d.use_graphs(True)
    F, dtype = d.graph.features
    rng = random.Random(0)

    def call(committed: int, n: int) -> tuple:  # the static inputs of a draft of bucket 4, depth 3
        ints = torch.tensor([committed, n] + rng.choices(range(model.cfg.vocab_size), k=4))
        return (ints, torch.randn(4, F, dtype=dtype)), {}
    with torch.inference_mode():
        d.graph._draft(*call(3, 2)[0], 4, 3)  # first calls choose CPU kernels (kernel_choice): not a step's work
        found = find_hazards(lambda ints, f: d.graph._draft(ints, f, 4, 3), call(10, 3), call(17, 4), call(5, 1))
    assert found == []

@pytest.mark.ch08
def test_the_verify_forward_takes_the_tree_from_the_device():
    """In the decode loop with graphs on, the drafted tree reaches the target's verify forward as device tensors
    (root + tokens, positions, mask equal to what the host tree gives); the host reads it once, to verify."""
    from minispec import load
    from minispec.generate import Decoder
    from minispec.tree import Tree

    model, _ = load("tiny-llama")
    dec = Decoder(model, list(range(3, 15)), _head_drafter("eagle", model, "4,3,10"), max_new_tokens=12, graphs=True)
    dec.prefill()
    for _ in range(3):
        tree = dec.propose()
        assert tree.tensors is not None and tree._host is None
        out = dec.forward(tree)
        assert tree._host is None  # the forward read no host list
        res, rows = dec.verify(tree, out.logits[0])
        assert tree._host is not None and len(tree) == 10
        tokens, positions, _ = dec.inputs(tree, dec.kv.length)
        t = tree.tensors
        assert t.tokens.tolist() == tokens and torch.equal(t.depths + dec.kv.length, positions)
        assert torch.equal(t.mask, Tree(tree.tokens, tree.parents).mask())
        dec.kv.commit(rows)
        dec.advance(tree, res, out, rows)

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("tree", ["chain:4", "4,3,10"])
def test_cuda_draft_replays_equal_the_direct_call_without_a_host_sync(kind, tree):
    """What only a GPU shows: the whole draft is captured (no host synchronisation inside it: a replay under
    ``set_sync_debug_mode("error")`` raises on any), and a replay drafts, step after step, the trees that the
    same fixed-shape draft called directly (no graph, the same kernels) drafts."""
    from minispec import load

    model = load("tiny-llama")[0].cuda()
    seq = random.Random(0).choices(range(model.cfg.vocab_size), k=80)
    direct = _head_drafter(kind, model, tree)
    direct.use_graphs(True)
    direct.graph.use_graphs = False  # no capture: the direct call on the GPU
    want = _drafts(direct, model, seq, graphs=True)
    d = _head_drafter(kind, model, tree)
    assert _drafts(d, model, seq, graphs=True) == want  # captures every bucket it meets
    assert d.graph.use_graphs and d.graph.captures >= 2
    captures = d.graph.captures
    assert _drafts(d, model, seq, graphs=True, no_sync=True) == want  # replays only
    assert d.graph.captures == captures


@pytest.mark.ch08
def test_draft_times_compares_like_with_like():
    """``lab.draft_timing.draft_times`` (what a GPU script calls): both modes draft the same trees and tokens, the
    graphed one through its runner; times are reported, never asserted."""
    from minispec import load
    from minispec.lab.draft_timing import draft_times

    model, _ = load("tiny-llama")
    r = draft_times(model, _head_drafter("eagle", model, "3,2,4"), _head_drafter("eagle", model, "3,2,4"),
                    list(range(3, 15)), new_tokens=10, rounds=1)
    assert r["same_trees"] and r["same_tokens"] and r["steps"] >= 3 and r["captures"] >= 1
    assert r["cuda_graphs"] is False and r["device"] == "cpu" and r["eager_ms"] > 0 and r["graphed_ms"] > 0
