"""Graphed against eager EAGLE drafting, side by side in one process (chapter 8): what a draft costs a step.

``draft_times`` decodes the same prompt greedily with two copies of a drafter, one drafting eagerly
(``TreeDrafter``'s hooks, one head forward a level, the tree read on the host at every level) and
one through ``drafters.graphed_draft.GraphedDraft`` (the whole draft, catch-up to tree, one CUDA
graph per bucket; the target's verify forwards graphed too), alternating the two over several rounds
and timing each step's draft (wall time, the device synchronised before and after: on a GPU what
a replay saves is host time, so the clock must include the host). Both decode greedily from the
same prompt, so they draft the same trees step after step (the function checks it, tree by tree)
and the medians compare like with like. The first round warms up (captures, lazy initialisation)
and is not timed. On a CPU both modes compute the same bits; on a GPU their kernels differ (masked
attention over the static cache's capacity against SDPA over the prefix), so a near tie may draft
another tree, and the graphed verify forward may break a near tie of the target's differently:
``same_trees`` and ``same_tokens`` say whether either happened (reported, not asserted).

``smollm2_draft_times`` is the call a GPU script makes: SmolLM2-135M and its shipped head for a
method (``eagle2`` by default) on the device asked for, on one of minispec's own prompts. Timings
are the machine's that runs it (the result says which device); nothing here asserts a speed.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..drafters.base import Drafter
from ..generate import Decoder
from ..sampling import GREEDY


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def _decode(model, drafter: Drafter, ids: list[int], new_tokens: int, graphs: bool) -> tuple[list[float], list, dict]:
    """One greedy decode, step by step as ``Decoder.step`` runs it, each draft timed alone: (draft seconds per
    step, the trees as (tokens, parents), the decoder's graph counters)."""
    dec = Decoder(model, ids, drafter, GREEDY, new_tokens, graphs=graphs)
    dec.prefill()
    times, trees = [], []
    while not dec.done:
        _sync(model.device)
        t0 = time.perf_counter()
        tree = dec.propose()
        _sync(model.device)
        times.append(time.perf_counter() - t0)
        out = dec.forward(tree)
        res, rows = dec.verify(tree, out.logits[0])
        dec.kv.commit(rows)
        dec.advance(tree, res, out, rows)
        trees.append((tree.tokens, tree.parents))
    graph = getattr(drafter, "graph", None) or getattr(getattr(drafter, "fallback", None), "graph", None)
    counters = dict(captures=graph.captures, replays=sum(graph.replays.values()), cuda_graphs=graph.use_graphs) \
        if graph is not None else {}
    return times, trees, dict(counters, tau=dec.stats.tau, tokens=list(dec.new))


def draft_times(model, eager: Drafter, graphed: Drafter, ids: list[int], new_tokens: int = 48, rounds: int = 3) -> dict:
    """Median draft time a step, eager against graphed, measured alternately in one process.

    Args:
        model: the target Transformer (a GPU's, for graphs to be captured; elsewhere the graphed path is
            ``capture``'s direct call and the comparison shows what the fixed shapes cost, not a launch saving).
        eager, graphed: two drafters of the same kind and weights (not one object twice: each keeps its mode).
        ids: the prompt's token ids.
        new_tokens: tokens decoded a round; rounds: timed rounds (after one untimed warm-up round).
    Returns:
        dict(device, eager_ms, graphed_ms, eager_over_graphed, steps (drafts timed per mode), same_trees (every
        step's tree equal in both modes), same_tokens, tau, graph counters).
    """
    times: dict[bool, list[float]] = {False: [], True: []}
    same_trees, info = True, {}
    for r in range(rounds + 1):
        runs = {g: _decode(model, graphed if g else eager, ids, new_tokens, g) for g in (False, True)}
        same_trees = same_trees and runs[False][1] == runs[True][1]
        info = runs[True][2]
        info["same_tokens"] = runs[False][2]["tokens"] == info["tokens"]
        if r:
            for g in (False, True):
                times[g] += runs[g][0]
    eager_ms, graphed_ms = (statistics.median(times[g]) * 1e3 for g in (False, True))
    dev = model.device
    return dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", dtype=str(model.dtype),
                eager_ms=eager_ms, graphed_ms=graphed_ms, eager_over_graphed=eager_ms / graphed_ms,
                steps=len(times[True]), same_trees=same_trees, same_tokens=info["same_tokens"], tau=info["tau"],
                captures=info.get("captures"), replays=info.get("replays"), cuda_graphs=info.get("cuda_graphs"))


def smollm2_draft_times(method: str = "eagle2", device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                        new_tokens: int = 48, rounds: int = 3, prompt: int = 0, model_name: str = "smollm2-135m",
                        drafter_path=None) -> dict:
    """``draft_times`` on SmolLM2-135M (its converted weights, ``models.load``) with the head a ``method`` ships
    (eagle, eagle2, eagle3 or copy), on ``own_prompts()[prompt]`` with the chat template.

    Args:
        model_name, drafter_path: another model and head (``Methods``' own; a dry run: a tiny model, a random head).
    Returns:
        ``draft_times``' dict, with method, model, prompt and new_tokens added.
    """
    from ..generate import encode_checked
    from ..methods import Methods
    from ..loading import load
    from ..prompts import own_prompts

    model, tok = load(model_name, device=device, dtype=dtype)
    text = own_prompts()[prompt]["prompt"]
    ids = encode_checked(model, tok, text, True, new_tokens)
    eager, graphed = (Methods(model, model_name, drafter_path=drafter_path).drafter(method)
                      for _ in range(2))  # two builders: two drafters
    out = draft_times(model, eager, graphed, ids, new_tokens, rounds)
    return dict(out, method=method, model=model_name, prompt=text, new_tokens=new_tokens)
