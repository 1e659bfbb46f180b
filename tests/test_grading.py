"""The grading system itself: from a fresh shell the reference answers pass every chapter and the stubs
fail by name; minispec's own functions pass behind the exercises' signatures; every check catches the
wrong answers listed in WRONG (one table for all chapters); exercises/ stays generated from solutions/."""

import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from minispec import grading
from minispec.grading import chapter_module, chapters, check, find_exercise, grade, grade_main

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "make_exercises.py"
CHAPTERS = chapters()


def _all_exercises():
    return [ex for ch in CHAPTERS for ex in chapter_module(ch).EXERCISES]


def learner_env() -> dict:
    """The environment of a learner's fresh shell: no TRITON_INTERPRET (pytest's conftest sets it for the tests)
    and no MINISPEC_IMPL; this checkout first on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MINISPEC_IMPL")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def run_grade(*args, code: str | None = None):
    """``python -m minispec grade ARGS`` (or ``python -c CODE ARGS``) in a fresh process, as a learner runs it."""
    cmd = [sys.executable, *(("-c", code) if code else ("-m", "minispec", "grade")), *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=learner_env(), timeout=600)


# --------------------------------------------------------------------------- every chapter, as a learner grades it
def test_every_chapter_has_three_or_more_exercises_numbered_in_order():
    assert {1, 2, 3, 4, 5, 6, 7, 8, 9} <= set(CHAPTERS)
    for ch in CHAPTERS:
        ids = [ex.id for ex in chapter_module(ch).EXERCISES]
        assert len(ids) >= 3 and ids == [f"{ch}.{i}" for i in range(1, len(ids) + 1)], ids


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_reference_answers_pass_from_a_fresh_shell(chapter):
    """`python -m minispec grade N --impl solutions` in a new process without TRITON_INTERPRET: what the README
    tells a learner to run (chapter 6's kernels need the interpreter chosen before triton is imported)."""
    n = len(chapter_module(chapter).EXERCISES)
    r = run_grade(str(chapter), "--impl", "solutions")
    assert r.returncode == 0 and f"{n}/{n} exercises passed" in r.stdout, r.stdout + r.stderr
    assert r.stdout.count("PASS") == n and "FAIL" not in r.stdout


def test_stubs_fail_by_name_from_a_fresh_shell():
    r = run_grade("all", "--impl", "exercises")
    exercises = _all_exercises()
    assert r.returncode == 1 and r.stdout.count("PASS") == 0, r.stdout + r.stderr
    for ex in exercises:
        assert re.search(rf"^  {re.escape(ex.id)} +{ex.name} +FAIL  not implemented yet", r.stdout, re.M), ex.id
    for ch in CHAPTERS:
        assert f"0/{len(chapter_module(ch).EXERCISES)} exercises passed" in r.stdout


def test_kernels_graded_after_triton_was_imported_first_name_the_problem():
    """A learner who imports triton before minispec (no GPU, no TRITON_INTERPRET) gets triton's own functions
    compiled and a correct kernel could not run: the grader says so instead of failing the kernel."""
    code = "import sys, triton; from minispec.grading import grade_main; sys.exit(grade_main(sys.argv[1:]))"
    r = run_grade("6", "--impl", "solutions", code=code)
    if r.returncode == 0:
        pytest.skip("triton's interpreter was on already (a GPU machine, or TRITON_INTERPRET set by the caller)")
    kernels = [l for l in r.stdout.splitlines() if l.strip().startswith(("6.2", "6.5"))]
    assert len(kernels) == 2 and all("triton was imported before TRITON_INTERPRET=1 was set" in l for l in kernels), \
        r.stdout + r.stderr


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_library_passes_and_stubs_fail_in_process(chapter):
    """minispec's own functions (the adapters of minispec.grading.chNN.library) pass every check; the stubs fail
    each with "Exercise N.M name: not implemented yet (NotImplementedError: Exercise N.M: ...)"."""
    results = grade(chapter, "minispec")
    assert [r[0] for r in results] == [ex.id for ex in chapter_module(chapter).EXERCISES]
    assert not [r[3] for r in results if not r[2]]
    for ex_id, name, passed, msg in grade(chapter, "exercises"):
        assert not passed and msg.startswith(f"Exercise {ex_id} {name}: not implemented yet"), msg
        assert f"(NotImplementedError: Exercise {ex_id}: " in msg, msg


def test_stub_failure_is_an_assertion_error_with_the_exercise_name():
    with pytest.raises(AssertionError, match=r"^Exercise 1\.3 verify_chain: not implemented yet"):
        grading.assert_passes("1.3", "exercises")


def test_exercises_keep_signatures_and_docstrings():
    for ch in CHAPTERS:
        sol, exe = (grading.load_impl(ch, pkg, reload=False) for pkg in ("solutions", "exercises"))
        assert inspect.getdoc(sol) == inspect.getdoc(exe)
        for ex in chapter_module(ch).EXERCISES:
            f, g = (getattr(getattr(m, ex.name), "fn", getattr(m, ex.name)) for m in (sol, exe))  # @triton.jit: .fn
            assert inspect.signature(f) == inspect.signature(g), ex.name
            assert f.__doc__ and f.__doc__ == g.__doc__, ex.name
            src = inspect.getsource(g)
            assert f"# EXERCISE {ex.id}:" in src and f'raise NotImplementedError("Exercise {ex.id}:' in src
            assert "BEGIN SOLUTION" not in src


# --------------------------------------------------------------------------- the checks have teeth: wrong answers
def _solutions(ch: int):
    return grading.load_impl(ch, "solutions", reload=False)


class Lazy:
    """An override built when its test runs (a Triton kernel: triton is imported then, not at collection)."""

    def __init__(self, make):
        self.make = make


def _with(ch: int, **overrides):
    mod = _solutions(ch)
    ns = SimpleNamespace(**{k: v for k, v in vars(mod).items() if not k.startswith("__")})
    ns.__dict__.update({k: v.make() if isinstance(v, Lazy) else v for k, v in overrides.items()})
    return ns


def _resample_from_p(xs, p, q, chooser):  # residual replaced by p: biased
    for i, x in enumerate(xs):
        if not chooser.bernoulli(min(1.0, p[i, x].item() / q[i, x].item())):
            return i, chooser.categorical(p[i])
    return len(xs), chooser.categorical(p[len(xs)])


def _always_reject(xs, p, q, chooser):  # exact output law, but never accepts anything
    return 0, chooser.categorical(p[0])


def _own_rng(xs, p, q, chooser):  # randomness outside the chooser (seeded here, so the test is deterministic)
    g = torch.Generator().manual_seed(0)
    for i, x in enumerate(xs):
        if not bool(torch.rand((), generator=g) < min(1.0, p[i, x].item() / q[i, x].item())):
            return i, chooser.categorical(_solutions(1).residual(p[i], q[i]))
    return len(xs), chooser.categorical(p[len(xs)])


def _no_q_update(c, p, q, chooser):  # without-replacement drafts verified with the i.i.d. rule
    return _solutions(2).mss_with_replacement(c, p, q, chooser)


def _q_update(c, p, q, chooser):  # i.i.d. drafts verified with the without-replacement rule
    return _solutions(2).mss_without_replacement(c, p, q, chooser)


def _onehot_no_zeroing(c, p, chooser):
    for i, x in enumerate(c):
        if chooser.bernoulli(min(1.0, p[x].item())):
            return i, x
    return None, chooser.categorical(p)


def _root_only_tree(parents, tokens, p, q, mode, chooser):  # exact output, but stops after one level
    s = _solutions(2)
    kids = [i for i, j in enumerate(parents) if j == -1]
    xs = [tokens[i] for i in kids]
    idx, t = s.mss_onehot(xs, p[0], chooser) if mode == "onehot" else (
        s.mss_with_replacement if mode == "mss_replacement" else s.mss_without_replacement)(xs, p[0], q[0], chooser)
    return ([], t) if idx is None else ([kids[idx]], chooser.categorical(p[kids[idx] + 1]))


def _best_k_last_on_ties(alpha, c, k_max=16):
    """Best k by ">=": on a tie (alpha = 0 and c = 0: every k gives 1x) it keeps the largest k."""
    best, best_s = 0, 1.0
    for k in range(1, k_max + 1):
        s = sum(alpha ** i for i in range(k + 1)) / (k * c + 1)
        if s >= best_s:
            best, best_s = k, s
    return best


def _mask_without_self(parents):
    m = _solutions(4).tree_mask(parents).clone()
    m.fill_diagonal_(False)
    m[0, 0] = True
    return m


def _lexicographic_choices(choices):  # sorted without the depth key: parents before children, wrong order
    cs = sorted(tuple(c) for c in choices)
    index = {c: i for i, c in enumerate(cs)}
    return [index.get(c[:-1], -1) for c in cs], [c[-1] for c in cs]


def _unchecked_choices(choices):  # right order, but a missing parent silently becomes the root
    cs = sorted((tuple(c) for c in choices), key=lambda c: (len(c), c))
    index = {c: i for i, c in enumerate(cs)}
    return [index.get(c[:-1], -1) if len(c) > 1 else -1 for c in cs], [c[-1] for c in cs]


def _first_child_wins(parents, tokens, logits):  # accepts without comparing with the target's argmax
    path, row = [], 0
    while True:
        kids = [i for i, j in enumerate(parents) if j + 1 == row]
        if not kids:
            return path, int(logits[row].argmax())
        path.append(kids[0])
        row = kids[0] + 1


def _frontier_per_parent(fs, logp, k):  # next frontier = the first k children, not the k best of the level
    s, t, f, _ = _solutions(5).expand_level(fs, logp, k)
    return s, t, f, torch.arange(min(k, s.numel()))


def _no_parent_score(fs, logp, k):  # child scores forget the path: log q of the last step only
    return _solutions(5).expand_level(torch.zeros_like(fs), logp, k)


def _score_order(scores, par, dep, n):  # keeps the right set but not in topological order
    best = sorted(range(len(scores)), key=lambda c: (-scores[c], dep[c], c))[:n]
    index = {c: i for i, c in enumerate(best)}
    return best, [index.get(par[c], -1) for c in best]


def _ties_to_the_child(scores, par, dep, n):  # on equal scores the deeper node wins: can drop a parent
    best = sorted(range(len(scores)), key=lambda c: (-scores[c], -c))[:n]
    selected = sorted(best, key=lambda c: (dep[c], c))
    index = {c: i for i, c in enumerate(selected)}
    return selected, [index.get(par[c], -1) for c in selected]


def _no_rerank(next_logits, depth, top_k, total_tokens):  # keeps the first total_tokens candidates created
    from minispec.grading.ch05 import compose, reference_expand_level
    return compose(reference_expand_level, lambda s, p, d, n: (list(range(min(n, len(s)))),
                                                              [j for j in p[:n]]), next_logits, depth, top_k, total_tokens)


def _widest_first(rank_acc, n, max_depth):  # breadth first: every rank at depth 1, then depth 2, ...
    import itertools
    nodes = [c for d in range(1, max_depth + 1) for c in itertools.product(range(len(rank_acc)), repeat=d)]
    return sorted(nodes[:n], key=lambda c: (len(c), c))


def _best_nodes_without_parents(rank_acc, n, max_depth):  # the n best paths, ties to the deeper: may drop a parent
    import itertools
    from minispec.tree import path_value
    nodes = [c for d in range(1, max_depth + 1) for c in itertools.product(range(len(rank_acc)), repeat=d)]
    best = sorted(nodes, key=lambda c: (-path_value(c, rank_acc), -len(c)))[:n]
    return sorted(best, key=lambda c: (len(c), c))



def _speeds_of(taus, verify_s, draft_s, vanilla_draft=0.0):  # predicted tokens/s per n: (n, speed) of the first best
    speeds = [t / (v + (draft_s if n else vanilla_draft)) for n, (t, v) in enumerate(zip(taus, verify_s))]
    n = max(range(len(speeds)), key=lambda i: (speeds[i], -i))
    return n, speeds[n]


def _first_n_in_given_order(probs, verify_s, draft_s, max_nodes):  # the first n candidates, not the n largest
    m = min(max_nodes, len(probs))
    return _speeds_of([1 + sum(probs[:n]) for n in range(m + 1)], verify_s, draft_s)


def _no_bonus_token(probs, verify_s, draft_s, max_nodes):  # E[tau] without the bonus token
    top = sorted(probs, reverse=True)[:max_nodes]
    return _speeds_of([1.0] + [sum(top[:n]) for n in range(1, len(top) + 1)], verify_s, draft_s)


def _no_draft_time(probs, verify_s, draft_s, max_nodes):  # the tree's drafting is free
    return _solutions(5).best_tree_size(probs, verify_s, 0.0, max_nodes)


def _vanilla_pays_drafting(probs, verify_s, draft_s, max_nodes):  # n = 0 charged the draft time too
    top = sorted(probs, reverse=True)[:max_nodes]
    return _speeds_of([1 + sum(top[:n]) for n in range(len(top) + 1)], verify_s, draft_s, vanilla_draft=draft_s)


def _largest_on_a_tie(probs, verify_s, draft_s, max_nodes):  # ties go to the bigger tree
    top = sorted(probs, reverse=True)[:max_nodes]
    taus = [1 + sum(top[:n]) for n in range(len(top) + 1)]
    speeds = [t / (v + (draft_s if n else 0.0)) for n, (t, v) in enumerate(zip(taus, verify_s))]
    n = max(range(len(speeds)), key=lambda i: (speeds[i], i))
    return n, speeds[n]


def _budget_over_candidates(probs, verify_s, draft_s, max_nodes):  # loops to the budget, not to the candidates
    top, taus = sorted(probs, reverse=True), [1.0]
    for n in range(1, max_nodes + 1):
        taus.append(taus[-1] + top[n - 1])
    return _speeds_of(taus, verify_s, draft_s)


def _sorts_in_place(probs, verify_s, draft_s, max_nodes):  # right answer, but sorts the caller's list
    probs.sort(reverse=True)
    return _solutions(5).best_tree_size(probs, verify_s, draft_s, max_nodes)



def _feature_first(embedding, tokens, features):
    return torch.cat([features, embedding[torch.tensor(tokens[1:])]], -1)


def _no_shift(embedding, tokens, features):  # pairs f_j with x_j, the token that produced it
    return torch.cat([embedding[torch.tensor(tokens[:-1])], features], -1)


def _hard_ce(pred_feat, target_feat, pred_logits, top_idx, top_logp, w_cls=0.1):  # CE on the argmax only
    ce = torch.nn.functional.cross_entropy(pred_logits, top_idx[:, 0])
    return torch.nn.functional.smooth_l1_loss(pred_feat, target_feat) + w_cls * ce


def _detached(*args, **kw):  # right value, but a float: nothing to train
    return torch.tensor(_solutions(3).eagle_loss(*args, **kw).item())


def _ties_to_higher_id(counts, vd):
    V = counts.numel()
    kept = sorted(sorted(range(V), key=lambda t: (-int(counts[t]), -t))[:vd])
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    return torch.tensor(kept) - torch.arange(vd), t2d


def _absolute_d2t(counts, vd):
    d2t, t2d = _solutions(3).build_vocab_map(counts, vd)
    return d2t + torch.arange(vd), t2d


def _zeros_outside(logits, d2t, V):
    out = logits.new_zeros(*logits.shape[:-1], V)
    out[..., torch.arange(logits.shape[-1]) + d2t] = logits
    return out


def _chain_on_the_last_target_feature(head, embedding, lm_head, tokens, features, k):  # never feeds g back
    drafts, toks, feats = [], list(tokens[1:]), features
    for _ in range(k):
        g = head(embedding[torch.tensor(toks)][None], feats[None], torch.arange(len(toks)))[0, -1]
        drafts.append(int(lm_head(g).argmax()))
        toks.append(drafts[-1])
        feats = torch.cat([feats, features[-1:]])  # the target's last feature again, not the head's own
    return drafts


def _chain_from_the_first_prediction(head, embedding, lm_head, tokens, features, k):  # k tokens from one feature
    g = head(embedding[torch.tensor(tokens[1:])][None], features[None], torch.arange(len(tokens) - 1))[0, -1]
    return lm_head(g).topk(k).indices.tolist()



def _reserve_floor(tables, lengths, n_new, free_list, bs):  # floor instead of ceil
    need = [(L + n) // bs - len(t) for t, L, n in zip(tables, lengths, n_new)]
    if sum(max(0, k) for k in need) > len(free_list):
        return None
    free = list(free_list)
    return [list(t) + [free.pop() for _ in range(max(0, k))] for t, k in zip(tables, need)], free


def _reserve_in_place(tables, lengths, n_new, free_list, bs):  # right answer, but pops the caller's free list
    need = [-(-(L + n) // bs) - len(t) for t, L, n in zip(tables, lengths, n_new)]
    if sum(need) > len(free_list):
        return None
    return [list(t) + [free_list.pop() for _ in range(k)] for t, k in zip(tables, need)], free_list


def _reserve_from_front(tables, lengths, n_new, free_list, bs):  # a queue, not a stack
    out = _solutions(7).reserve_blocks(tables, lengths, n_new, free_list[::-1], bs)
    return None if out is None else (out[0], out[1][::-1])


def _reserve_partial(tables, lengths, n_new, free_list, bs):  # gives what it can, sequence by sequence
    free, new = list(free_list), []
    for t, L, n in zip(tables, lengths, n_new):
        k = -(-(L + n) // bs) - len(t)
        new.append(list(t) + [free.pop() for _ in range(min(k, len(free)))])
    return new, free


def _moves_with_in_place(table, length, keep, bs):
    slot = lambda n: (table[n // bs], n % bs)  # noqa: E731
    return [(slot(length + i), slot(length + j)) for j, i in enumerate(keep)]


def _moves_no_table(table, length, keep, bs):  # block index instead of the block id in the table
    slot = lambda n: (n // bs, n % bs)  # noqa: E731
    return [(slot(length + i), slot(length + j)) for j, i in enumerate(keep) if i != j]


def _moves_no_prefix(table, length, keep, bs):  # forgets the committed prefix before the pending entries
    return _solutions(7).compaction_moves(table, 0, keep, bs)


def _ragged_no_padding(lengths, pendings, accepted, finished, bs):  # frees counted from the committed blocks only
    new = [0 if f else L + a for L, a, f in zip(lengths, accepted, finished)]
    return new, [max(0, -(-L // bs) - -(-n // bs)) for L, n in zip(lengths, new)]


def _ragged_ignores_finished(lengths, pendings, accepted, finished, bs):
    return _solutions(7).ragged_commit(lengths, pendings, accepted, [False] * len(lengths), bs)


def _ragged_floor(lengths, pendings, accepted, finished, bs):
    new = [0 if f else L + a for L, a, f in zip(lengths, accepted, finished)]
    return new, [(L + p) // bs - n // bs for L, p, n in zip(lengths, pendings, new)]


def _merge_kernel_without_empty_guard():
    import triton
    import triton.language as tl

    def kernel(OP, LP, OS, LS, Out, R, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        d = tl.arange(0, BLOCK_D)
        ok = (r < R)[:, None] & (d < D)[None, :]
        lse_p = tl.load(LP + r, mask=r < R, other=0.0)
        lse_s = tl.load(LS + r, mask=r < R, other=0.0)
        m = tl.maximum(lse_p, lse_s)  # -inf when both parts are empty: exp(-inf - -inf) = nan
        w_p, w_s = tl.exp(lse_p - m), tl.exp(lse_s - m)
        offs = r[:, None] * D + d[None, :]
        num = w_p[:, None] * tl.load(OP + offs, mask=ok, other=0.0) + w_s[:, None] * tl.load(OS + offs, mask=ok,
                                                                                             other=0.0)
        tl.store(Out + offs, num / (w_p + w_s)[:, None], mask=ok)

    return triton.jit(kernel)



def _bytes_no_kv(cfg, batch, context, dtype):
    return _solutions(9).step_bytes(cfg, 1, 0, dtype)


def _bytes_query_heads(cfg, batch, context, dtype):  # KV with n_head heads: forgets grouped-query attention
    import dataclasses
    return _solutions(9).step_bytes(cfg, 1, 0, dtype) + _solutions(9).step_bytes(
        dataclasses.replace(cfg, n_kv_head=cfg.n_head), batch, context, dtype) - _solutions(9).step_bytes(
        dataclasses.replace(cfg, n_kv_head=cfg.n_head), 1, 0, dtype)


def _bytes_untied_head_skipped(cfg, batch, context, dtype):  # a tied LM head counted as free
    size = torch.finfo(dtype).bits // 8
    skip = cfg.vocab_size * cfg.d_model * size if cfg.tie_embeddings else 0
    return _solutions(9).step_bytes(cfg, batch, context, dtype) - skip


def _roof_sum(cfg, batch, new, context, dtype, bw, peak):  # memory + compute instead of the slower one
    s = _solutions(9)
    mem = s.step_bytes(cfg, batch, context, dtype) / bw
    comp = s.roofline_step_s(cfg, batch, new, context, dtype, float("inf"), peak)
    return mem + comp


def _roof_no_attention(cfg, batch, new, context, dtype, bw, peak):  # FLOPs of the linear layers only
    s = _solutions(9)
    size = torch.finfo(dtype).bits // 8
    return max(s.step_bytes(cfg, batch, context, dtype) / bw, batch * new * 2 * s.step_bytes(cfg, 1, 0, dtype) / size / peak)


def _tau_alpha(tau, k):  # returns the acceptance rate instead of the corruption rate
    return 1 - _solutions(9).corruption_for_tau(tau, k)


def _tau_no_bonus(tau, k):  # k terms: forgets the target's own token
    if k < 2:
        return _solutions(9).corruption_for_tau(tau, k)
    return _solutions(9).corruption_for_tau(min(tau, k), k - 1) if tau <= k else 0.0


def _tau_no_checks(tau, k):  # right inside the domain, but silent outside it
    return _solutions(9).corruption_for_tau(min(max(tau, 1.0), max(k, 1) + 1), max(k, 1))


def _cross_rows(cfg, nodes, tau, context, dtype, bw, peak, max_batch=4096):  # the verify forward of nodes rows
    s = _solutions(9)
    return next((b for b in range(1, max_batch + 1) if tau * s.roofline_step_s(cfg, b, 1, context, dtype, bw, peak)
                 < s.roofline_step_s(cfg, b, nodes, context, dtype, bw, peak)), None)


def _cross_max_batch(cfg, nodes, tau, context, dtype, bw, peak, max_batch=4096):  # "never" as max_batch, not None
    b = _solutions(9).crossover_batch(cfg, nodes, tau, context, dtype, bw, peak, max_batch)
    return max_batch if b is None else b



def _hazards_every_occurrence(calls, sync_ops):  # a sync operator reported each time it occurs
    out = [(i, "sync", n) for i, ops in enumerate(calls) for n, _ in ops if n in sync_ops]
    return out + [f for f in _solutions(8).capture_hazards(calls, sync_ops) if f[1] == "shape"]


def _hazards_vs_previous(calls, sync_ops):  # each call compared with the one before it, not with call 0
    out = [f for f in _solutions(8).capture_hazards(calls, sync_ops) if f[1] == "sync"]
    for i in range(1, len(calls)):
        out += [(i, "shape", n) for (_, _, n) in _solutions(8).capture_hazards([calls[i - 1], calls[i]], set())]
    return out


def _hazards_names_only(calls, sync_ops):  # compares operator names, not their shapes
    return _solutions(8).capture_hazards([[(n, ()) for n, _ in ops] for ops in calls], sync_ops)


def _hazards_library_set(calls, sync_ops):  # ignores the sync_ops argument
    from minispec.lab.graph_rules import SYNC_OPS
    return _solutions(8).capture_hazards(calls, set(SYNC_OPS))


def _mask_host_loop(lengths, tree_mask, capacity):  # right values, read on the host (the grader's own reference)
    from minispec.grading.ch08 import reference_mask

    return reference_mask(lengths, tree_mask, capacity)


def _mask_causal(lengths, tree_mask, capacity):  # ignores the tree: causal over the new tokens
    T = tree_mask.shape[1]
    return _solutions(8).static_mask(lengths, torch.ones(T, T, dtype=torch.bool).tril().expand_as(tree_mask), capacity)


def _mask_whole_row(lengths, tree_mask, capacity):  # the tree mask placed at slot 0, not after the prefix
    B, T, _ = tree_mask.shape
    out = _solutions(8).static_mask(lengths, tree_mask, capacity)
    out[:, :, :T] |= tree_mask
    return out


def _buckets_most_frequent(sizes, k):  # the k most frequent sizes (and the largest)
    from collections import Counter
    common = [s for s, _ in Counter(sizes).most_common(k - 1)]
    return sorted(set(common) | {max(sizes)})


def _buckets_powers_of_two(sizes, k):
    top = 1 << (max(sizes) - 1).bit_length()
    return [top >> i for i in range(k)][::-1]


def _buckets_evenly_spaced(sizes, k):
    vals = sorted(set(sizes))
    return sorted({vals[(len(vals) - 1) * i // k] for i in range(1, k)} | {vals[-1]})



def _merge_unshifted(out_a, lse_a, out_b, lse_b):  # exp(lse) without subtracting the max: overflows at +1000
    w_a, w_b = torch.exp(lse_a)[..., None], torch.exp(lse_b)[..., None]
    return (out_a * w_a + out_b * w_b) / (w_a + w_b), torch.logaddexp(lse_a, lse_b)


def _masked_softmax(q, k, v, mask):  # softmax of a row that sees nothing is nan
    s = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~mask, float("-inf"))
    return s.softmax(-1) @ v, torch.logsumexp(s, -1)


def _one_shot(q, k, v, block):  # the right numbers, every key at once: no tiling
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None]) @ v, lse


def _prefix_kernel_ignoring_lengths():  # reads the whole split, past P_b: keys of another sequence's data
    import triton
    import triton.language as tl

    def kernel(Q, K, V, Lens, O, L, R, N, D, chunk, scale,
               BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        b, split = tl.program_id(0), tl.program_id(1)
        r, d = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_D)
        rd_ok = (r < R)[:, None] & (d < D)[None, :]
        q = tl.load(Q + b * R * D + r[:, None] * D + d[None, :], mask=rd_ok, other=0.0)
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_R], tl.float32)  # noqa: E741
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        start = split * chunk
        end = tl.minimum(start + chunk, N)  # N, not Lens[b]
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            kv = b * N * D + n[:, None] * D + d[None, :]
            kv_ok = (n < end)[:, None] & (d < D)[None, :]
            k = tl.load(K + kv, mask=kv_ok, other=0.0)
            v = tl.load(V + kv, mask=kv_ok, other=0.0)
            s = tl.where((n < end)[None, :], tl.dot(q, tl.trans(k), input_precision="ieee") * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha, p = tl.exp(m - m_new), tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)  # noqa: E741
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m = m_new
        seen = l > 0
        row = (b * tl.num_programs(1) + split) * R + r
        tl.store(O + row[:, None] * D + d[None, :], acc / tl.where(seen, l, 1.0)[:, None], mask=rd_ok)
        tl.store(L + row, tl.where(seen, m + tl.log(tl.where(seen, l, 1.0)), float("-inf")), mask=r < R)

    return triton.jit(kernel)


def _split_without_tree_mask(q, k, v, prefix_len, tree_mask, block=16):  # the tree part sees every tree token
    return _solutions(6).split_tree_attention(q, k, v, prefix_len, torch.ones_like(tree_mask), block)


def _library_call(module: str, name: str):
    """An answer that calls minispec's own function of the exercise's name (imported when the test runs)."""
    import importlib

    return lambda *args, **kwargs: getattr(importlib.import_module(module), name)(*args, **kwargs)



def _ttt(mask_of, inputs_of):
    """3.6 with the level's attention mask and input features chosen by the two functions (j, Tp) / (j, features, g)."""
    import torch.nn.functional as F

    def ttt_loss(level, tokens, features, valid, steps, decay=0.8):
        B, T = tokens.shape
        Tp = T - 1
        g, total, weights = features[:, :-1], 0.0, 0.0
        for j in range(steps):
            tok = F.pad(tokens[:, 1 + j:], (0, j))[:, :Tp]
            g = level(tok, inputs_of(j, features, g, Tp), torch.arange(Tp)[None].expand(B, Tp) + j, mask_of(j, Tp))
            target, trained = F.pad(features[:, 1 + j:], (0, 0, 0, j))[:, :Tp], F.pad(valid[:, j:], (0, j))
            if trained.any():
                total, weights = total + decay ** j * F.smooth_l1_loss(g[trained], target[trained]), weights + decay ** j
        return total / weights
    return ttt_loss


def _causal_levels(j, Tp):  # every level sees every anchor's keys up to t: other anchors' guesses leak in
    return torch.cat([torch.ones(Tp, Tp, dtype=torch.bool).tril()] * (j + 1), 1)


def _own_chain(j, Tp):
    return torch.cat([torch.ones(Tp, Tp, dtype=torch.bool).tril()] + [torch.eye(Tp, dtype=torch.bool)] * j, 1)


def _true_features(j, features, g, Tp):  # every level teacher-forced on the target's features: no test of its own
    return torch.nn.functional.pad(features[:, j:], (0, 0, 0, j))[:, :Tp]



def _gather_committed_only(k_pool, v_pool, table, length, pending):  # forgets the pending tree's tokens
    return _solutions(7).gather_kv(k_pool, v_pool, table, length, 0)


def _gather_without_table(k_pool, v_pool, table, length, pending):  # token n in block n // bs: ignores the table
    bs, pos = k_pool.shape[2], torch.arange(length + pending)
    return k_pool[pos // bs, :, pos % bs].transpose(0, 1), v_pool[pos // bs, :, pos % bs].transpose(0, 1)


def _capture(side=True, waits=True, mode="thread_local", copy=True, replay=True, outputs=True):
    """8.3's answer with one of its steps left out or done otherwise."""
    def capture_replay(step, static_inputs, cuda, warmup=2, pool=None):
        s = cuda.Stream() if side else cuda.current_stream()
        if waits:
            s.wait_stream(cuda.current_stream())
        with cuda.stream(s):
            for _ in range(warmup):
                step()
        if waits:
            cuda.current_stream().wait_stream(s)
        graph = cuda.CUDAGraph()
        with cuda.graph(graph, pool=pool, **({"capture_error_mode": mode} if mode else {})):
            out = step()

        def run(**inputs):
            for name, x in inputs.items():
                if copy:
                    static_inputs[name].copy_(x)
                else:
                    static_inputs[name] = x.clone()  # a new tensor: the graph still reads the old address
            if not replay:
                return step()
            graph.replay()
            return out if outputs else tuple(o.clone() for o in out)
        return run, graph.pool()
    return capture_replay

# Every entry: (exercise, the solution's functions with one replaced by a wrong answer, a phrase the failure names).
WRONG = [
    ("1.1", dict(accept_prob=lambda p_x, q_x: min(1.0, p_x / q_x)), "ZeroDivisionError"),
    ("1.1", dict(accept_prob=lambda p_x, q_x: p_x / q_x if q_x else 1.0), "expected"),
    ("1.2", dict(residual=lambda p, q: (p - q).clamp(min=0)), "differs from norm"),
    ("1.2", dict(residual=lambda p, q: (p - q).clamp(min=0) / (p - q).clamp(min=0).sum()), "when p == q"),
    ("1.3", dict(verify_chain=_resample_from_p), "output distribution differs from p"),
    ("1.3", dict(verify_chain=_always_reject), "law of (n accepted, next token) differs"),
    ("1.3", dict(verify_chain=_own_rng), "differs"),
    ("1.4", dict(expected_tokens=lambda a, k: k * a + 1), "expected_tokens(alpha="),
    ("1.4", dict(expected_tokens=lambda a, k: (1 - a ** (k + 1)) / (1 - a)), "ZeroDivisionError"),
    ("1.5", dict(best_k=_best_k_last_on_ties), "on a tie the smallest k"),
    ("1.5", dict(best_k=lambda a, c, k_max=16: k_max), "best_k(alpha="),
    ("2.1", dict(mss_with_replacement=_q_update), "differs from p"),
    ("2.2", dict(mss_without_replacement=_no_q_update), "differs from p"),
    ("2.3", dict(mss_onehot=_onehot_no_zeroing), "differs from p"),
    ("2.4", dict(verify_tree=_root_only_tree), "differs from minispec's verify_tree"),
    ("3.1", dict(eagle_input=_feature_first), "embedding FIRST"),
    ("3.1", dict(eagle_input=_no_shift), "the shift"),
    ("3.2", dict(build_vocab_map=_ties_to_higher_id), "ties to the lower id"),
    ("3.2", dict(build_vocab_map=_absolute_d2t), "OFFSETS"),
    ("3.2", dict(build_vocab_map=lambda c, vd: _solutions(3).build_vocab_map(c, min(max(vd, 1), c.numel()))),
     "instead of raising"),
    ("3.3", dict(to_target_logits=_zeros_outside), "expected -inf"),
    ("3.3", dict(to_target_logits=lambda lg, d2t, V: _solutions(3).to_target_logits(lg, d2t * 0, V)), "logits["),
    ("3.4", dict(eagle_loss=lambda pf, tf, pl, ti, tl, w_cls=0.1: _solutions(3).eagle_loss(pf, tf, pl, ti, tl, 1.0)),
     "loss = "),
    ("3.4", dict(eagle_loss=_hard_ce), "loss = "),
    ("3.4", dict(eagle_loss=_detached), "differentiably"),
    ("3.5", dict(draft_chain=_chain_on_the_last_target_feature), "EagleDrafter drafts"),
    ("3.5", dict(draft_chain=_chain_from_the_first_prediction), "EagleDrafter drafts"),
    ("3.6", dict(ttt_loss=_ttt(_causal_levels, lambda j, f, g, Tp: g)), "must not see level 1's key"),
    ("3.6", dict(ttt_loss=_ttt(_own_chain, _true_features)), "the head's own level 0 output"),
    ("4.1", dict(choices_to_parents=_lexicographic_choices), "expected"),
    ("4.1", dict(choices_to_parents=_unchecked_choices), "instead of raising"),
    ("4.2", dict(tree_mask=_mask_without_self), "mask["),
    ("4.2", dict(tree_mask=lambda parents: torch.ones(len(parents) + 1, len(parents) + 1).tril().bool()), "mask["),
    ("4.3", dict(tree_positions=lambda parents, n: torch.arange(len(parents) + 1) + n), "positions["),
    ("4.4", dict(retrieve_indices=lambda parents: _solutions(4).retrieve_indices(parents).flip(0)), "retrieve_indices"),
    ("4.5", dict(greedy_verify=_first_child_wins), "expected path="),
    ("4.6", dict(best_static_tree=_widest_first), "the best"),
    ("4.6", dict(best_static_tree=_best_nodes_without_parents), "its parent"),
    ("5.1", dict(expand_level=_frontier_per_parent), "next_frontier"),
    ("5.1", dict(expand_level=_no_parent_score), "child_scores"),
    ("5.2", dict(rerank=_score_order), "rerank(total_tokens="),
    ("5.2", dict(rerank=_ties_to_the_child), "a child as likely as its parent"),
    ("5.3", dict(dynamic_tree=_no_rerank), "TreeDrafter drafts"),
    ("5.4", dict(best_tree_size=_first_n_in_given_order), "expected n="),
    ("5.4", dict(best_tree_size=_no_bonus_token), "expected n="),
    ("5.4", dict(best_tree_size=_no_draft_time), "expected n="),
    ("5.4", dict(best_tree_size=_vanilla_pays_drafting), "expected"),
    ("5.4", dict(best_tree_size=_largest_on_a_tie), "on a tie the smallest n"),
    ("5.4", dict(best_tree_size=_budget_over_candidates), "raised IndexError"),
    ("5.4", dict(best_tree_size=_sorts_in_place), "modified its arguments"),
    ("7.1", dict(reserve_blocks=_reserve_floor), "expected"),
    ("7.1", dict(reserve_blocks=_reserve_in_place), "modified its arguments"),
    ("7.1", dict(reserve_blocks=_reserve_from_front), "expected tables="),
    ("7.1", dict(reserve_blocks=_reserve_partial), "expected None"),
    ("7.2", dict(compaction_moves=_moves_with_in_place), "are not moves"),
    ("7.2", dict(compaction_moves=_moves_no_table), "is not a move"),
    ("7.2", dict(compaction_moves=_moves_no_prefix), "expected"),
    ("7.3", dict(ragged_commit=_ragged_no_padding), "tree padding"),
    ("7.3", dict(ragged_commit=_ragged_ignores_finished), "new_lengths="),
    ("7.3", dict(ragged_commit=_ragged_floor), "blocks_freed="),
    ("7.4", dict(gather_kv=_gather_committed_only), "the pending tree's tokens are missing"),
    ("7.4", dict(gather_kv=_gather_without_table), "differs from the cache's"),
    ("9.1", dict(step_bytes=_bytes_no_kv), "the KV cache is missing"),
    ("9.1", dict(step_bytes=_bytes_query_heads), "n_kv_head heads"),
    ("9.1", dict(step_bytes=_bytes_untied_head_skipped), "tied or not"),
    ("9.2", dict(roofline_step_s=_roof_sum), "not their sum"),
    ("9.2", dict(roofline_step_s=_roof_no_attention), "attention over the context"),
    ("9.3", dict(corruption_for_tau=_tau_alpha), "acceptance rate"),
    ("9.3", dict(corruption_for_tau=_tau_no_bonus), "k + 1 terms"),
    ("9.3", dict(corruption_for_tau=_tau_no_checks), "instead of raising ValueError"),
    ("9.4", dict(crossover_batch=_cross_rows), "expected"),
    ("9.4", dict(crossover_batch=_cross_max_batch), "expected None"),
    ("8.1", dict(capture_hazards=_hazards_every_occurrence), "each distinct sync operator once"),
    ("8.1", dict(capture_hazards=_hazards_vs_previous), "expected"),
    ("8.1", dict(capture_hazards=_hazards_names_only), "expected"),
    ("8.1", dict(capture_hazards=_hazards_library_set), "expected"),
    ("8.2", dict(static_mask=_mask_host_loop), "could not run inside a captured graph"),
    ("8.2", dict(static_mask=_mask_causal), "the slot of new token"),
    ("8.2", dict(static_mask=_mask_whole_row), "mask["),
    ("8.3", dict(capture_replay=_capture(side=False)), "no side stream"),
    ("8.3", dict(capture_replay=_capture(waits=False)), "does not wait"),
    ("8.3", dict(capture_replay=_capture(mode=None)), "capture_error_mode='thread_local'"),
    ("8.3", dict(capture_replay=_capture(copy=False)), "did not copy the input into the static tensor"),
    ("8.3", dict(capture_replay=_capture(replay=False)), "replay the graph"),
    ("8.3", dict(capture_replay=_capture(outputs=False)), "returned new tensors"),
    ("8.4", dict(choose_buckets=_buckets_most_frequent), "the best"),
    ("8.4", dict(choose_buckets=_buckets_powers_of_two), "the best"),
    ("8.4", dict(choose_buckets=_buckets_evenly_spaced), "the best"),
]
WRONG += [
    ("6.1", dict(merge_partials=_merge_unshifted), "+1000"),
    ("6.2", dict(merge_kernel=Lazy(_merge_kernel_without_empty_guard)), "empty parts"),
    ("6.3", dict(masked_attention_lse=_masked_softmax), "contains nan"),
    ("6.4", dict(tiled_attention=_one_shot), "keys of K or V at once"),
    ("6.5", dict(prefix_split_kernel=Lazy(_prefix_kernel_ignoring_lengths)), "differs from float64 softmax"),
    ("6.6", dict(split_tree_attention=_split_without_tree_mask), "out differs from the reference"),
    ("9.1", dict(step_bytes=_library_call("minispec.lab.scale", "step_bytes")), "calls minispec.lab.scale.step_bytes"),
    ("9.2", dict(roofline_step_s=_library_call("minispec.lab.scale", "roofline_step_s")), "minispec's own answer"),
    ("9.3", dict(corruption_for_tau=Lazy(lambda: __import__("minispec.lab.oracle", fromlist=["x"])
                                         .corruption_for_tau)), "calls minispec.lab.oracle.corruption_for_tau"),
    ("9.4", dict(crossover_batch=_library_call("minispec.lab.scale", "crossover_batch")), "minispec's own answer"),
]
WRONG.sort(key=lambda w: tuple(map(int, w[0].split("."))))  # chapter by chapter, stable within an exercise


@pytest.mark.parametrize("ex_id, overrides, needle", WRONG, ids=[f"{w[0]}-{i}" for i, w in enumerate(WRONG)])
def test_checks_catch_wrong_answers(ex_id, overrides, needle):
    ex = find_exercise(ex_id)
    passed, msg = ex.run(_with(ex.chapter, **overrides))
    assert not passed
    assert msg.startswith(f"Exercise {ex_id} {ex.name}: ") and needle in msg, msg


def test_every_exercise_has_a_wrong_answer_that_its_check_catches():
    assert {ex.id for ex in _all_exercises()} <= {w[0] for w in WRONG}


def test_missing_function_is_reported():
    passed, msg = find_exercise("1.2").run(SimpleNamespace(__name__="empty"))
    assert not passed and msg.startswith("Exercise 1.2 residual: ") and "no function residual" in msg


# --------------------------------------------------------------------------- runner, CLI, notebook helper
def test_check_prints_and_never_raises(capsys):
    check("1.2", impl="exercises")
    check("2.1", impl="solutions")
    check(1, impl="exercises")
    out = capsys.readouterr().out
    assert "FAIL  Exercise 1.2 residual: not implemented yet" in out
    assert "PASS  Exercise 2.1 mss_with_replacement: passed" in out
    assert "0/5 exercises passed" in out


def test_grade_main_exit_status(capsys):
    assert grade_main(["1", "--impl", "solutions"]) == 0
    out = capsys.readouterr().out
    assert "5/5 exercises passed" in out and out.count("PASS") == 5
    assert grade_main(["2", "--impl", "exercises"]) == 1
    out = capsys.readouterr().out
    assert "0/4 exercises passed" in out and out.count("FAIL") == 4 and "Exercise 2.4" in out
    assert grade_main(["99"]) == 2


def test_impl_from_environment(monkeypatch):
    monkeypatch.setenv("MINISPEC_IMPL", "solutions")
    assert grading.default_impl() == "solutions"
    assert grading.load_impl(1).__name__ == "solutions.ch01_rejection_sampling"
    monkeypatch.setenv("MINISPEC_IMPL", "bogus")
    with pytest.raises(ValueError, match="MINISPEC_IMPL"):
        grading.default_impl()



# --------------------------------------------------------------------------- tools/make_exercises.py
def _run_tool(*args, root: Path | None = None):
    cmd = [sys.executable, str(TOOL), *args] + (["--root", str(root)] if root else [])
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_make_exercises_check_passes_on_the_checkout():
    r = _run_tool("--check")
    assert r.returncode == 0, r.stderr


@pytest.fixture
def copy(tmp_path):
    for d in ("solutions", "exercises"):
        shutil.copytree(ROOT / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__"))
    assert _run_tool("--check", root=tmp_path).returncode == 0
    return tmp_path


def test_make_exercises_check_fails_on_an_edited_exercise(copy):
    f = copy / "exercises" / "ch01_rejection_sampling.py"
    f.write_text(f.read_text().replace('raise NotImplementedError("Exercise 1.2', 'return p  # ("Exercise 1.2', 1))
    r = _run_tool("--check", root=copy)
    assert r.returncode == 1
    assert "exercises/ch01_rejection_sampling.py differs" in r.stderr and "make_exercises.py" in r.stderr


def test_make_exercises_check_fails_on_a_changed_solution_then_regenerates(copy):
    f = copy / "solutions" / "ch02_multi_round.py"
    f.write_text(f.read_text().replace("Args:", "Arguments:", 1))
    r = _run_tool("--check", root=copy)
    assert r.returncode == 1 and "ch02_multi_round.py differs" in r.stderr
    assert _run_tool(root=copy).returncode == 0  # regenerate
    assert _run_tool("--check", root=copy).returncode == 0


def test_make_exercises_check_fails_on_missing_or_orphan_files(copy):
    (copy / "exercises" / "ch01_rejection_sampling.py").unlink()
    (copy / "exercises" / "ch09_orphan.py").write_text("")
    r = _run_tool("--check", root=copy)
    assert r.returncode == 1
    assert "ch01_rejection_sampling.py is missing" in r.stderr and "ch09_orphan.py has no solutions" in r.stderr


def test_make_exercises_rejects_malformed_markers(copy):
    f = copy / "solutions" / "ch01_rejection_sampling.py"
    f.write_text(f.read_text().replace("    # EXERCISE 1.2: ", "    # (no marker) ", 1))
    r = _run_tool("--check", root=copy)
    assert r.returncode == 1 and "BEGIN SOLUTION without an '# EXERCISE N.M: task' line" in r.stderr


def _build_notebooks(*args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "build_notebooks.py"), *args],
                          capture_output=True, text=True, timeout=120)


def test_build_notebooks_check_passes_and_notebooks_have_no_outputs():
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("jupytext")
    r = _build_notebooks("--check")
    assert r.returncode == 0, r.stderr
    sources = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
    assert [p.stem for p in sources] == [p.stem for p in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))]
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert code and all(not c.outputs and c.execution_count is None for c in code)
        assert "FAST = setup()" in code[0].source  # versions, FAST mode and the device: minispec.lab.notebook.setup
        assert any("check(" in c.source and 'impl="exercises"' in c.source for c in code)


def test_build_notebooks_check_names_a_notebook_out_of_sync_with_its_source(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("jupytext")
    shutil.copytree(ROOT / "notebooks", tmp_path / "notebooks", ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    src = tmp_path / "notebooks" / "03_eagle_feature_drafting.py"
    text = src.read_text(encoding="utf-8")
    assert text.count("\n# # Chapter 3 ") == 1
    src.write_text(text.replace("\n# # Chapter 3 ", "\n# # Chapter 3 (edited) ", 1), encoding="utf-8")
    r = _build_notebooks("--check", "--root", str(tmp_path))
    assert r.returncode == 1 and "notebooks/03_eagle_feature_drafting.ipynb differs" in r.stderr, r.stderr
    assert "python tools/build_notebooks.py" in r.stderr and "01_rejection" not in r.stderr
    r = _build_notebooks("--root", str(tmp_path))  # the writer brings the .ipynb back in sync
    assert r.returncode == 0 and "wrote notebooks/03_eagle_feature_drafting.ipynb" in r.stdout, r.stderr
    assert _build_notebooks("--check", "--root", str(tmp_path)).returncode == 0
    nb_path = tmp_path / "notebooks" / "01_rejection_sampling.ipynb"  # a notebook saved with outputs fails
    nb = nbformat.read(nb_path, as_version=4)
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", text="hi\n")]
    nbformat.write(nb, nb_path)
    r = _build_notebooks("--check", "--root", str(tmp_path))
    assert r.returncode == 1 and "notebooks/01_rejection_sampling.ipynb has outputs" in r.stderr, r.stderr
