"""Exact and sampled joint laws of the first few tokens of a speculative loop on real models (chapters 1-2).

The course checks its verifiers on SmolLM2-135M with the shipped draft: the exact law of the first
``length`` tokens under top-k sampling is a finite table (1 + k + k^2 next-token distributions for
three tokens), and a speculative loop run n times must reproduce it up to the sampling error
``exactness.tv_bound(n, K)``. ``next_token_laws`` computes many next-token distributions in ONE
forward pass: the contexts are packed after the prompt with a tree attention mask (chapter 4), so
each row equals a separate forward of prompt + context. ``TableLM`` serves the tables through
``exactness.ToyLM``'s interface (``p(ctx)``, ``q(ctx)``) on a compact vocabulary, so the step
functions of ``minispec.lab.exactness`` run on the real model unchanged.

Chapters 3-5 and 7 check the real decode loop itself: ``loop_tv_check`` runs ``minispec.batch.generate_batch``
with a drafter (an EAGLE head, a static or dynamic tree) many times and compares the first tokens with
``first_tokens_law`` (TV bound and chi-square test, ``flagged``). Deliberately wrong controls:
``claim_uniform_q`` (blatant: the verifier is told the wrong q), ``share_verifier_stream`` and
``peek_verifier_stream`` (subtle: the drafts depend on the verifier's coin flips).

Shapes: L prompt tokens, T packed context tokens, V vocabulary.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from . import exactness as ex
from .. import verify as vf
from ..loading import load
from ..sampling import probs


def load_tv_models(fast: bool):
    """(target name, draft name, target, draft, tokenizer): SmolLM2-135M + its shipped distilled draft;
    in fast mode only, the seeded tiny presets when SmolLM2 cannot be loaded (labelled so)."""
    try:
        from minispec.drafters.draft_checkpoint import load_draft_model
        target, tok = load("smollm2-135m")
        draft = load_draft_model(target)
        return ("SmolLM2-135M-Instruct", f"minispec's distilled SmolLM2 draft ({draft.cfg.n_layer} layers)",
                target, draft, tok)
    except Exception as e:
        if not fast:
            raise
        print(f"SmolLM2-135M or its draft could not be loaded ({type(e).__name__}: {e})")
        (target, tok), (draft, _) = load("tiny-gpt2"), load("tiny-gpt2-draft")
        return ("tiny-gpt2 (seeded random weights; CI fast-mode fallback)",
                "tiny-gpt2-draft (seeded random weights; CI fast-mode fallback)", target, draft, tok)


def next_token_laws(model, prompt_ids, contexts, params):
    """{context: p(. | prompt + context) [V]} for token-id tuples `contexts`, from one forward pass."""
    nodes = sorted({c[:i] for c in contexts for i in range(1, len(c) + 1)}, key=len)  # every non-empty prefix
    at = {c: i for i, c in enumerate(nodes)}
    L, T = len(prompt_ids), len(nodes)
    tokens = list(prompt_ids) + [c[-1] for c in nodes]  # [L + T]
    positions = list(range(L)) + [L + len(c) - 1 for c in nodes]  # [L + T]
    mask = torch.ones(L + T, L + T, dtype=torch.bool).tril()  # [L+T, L+T]: causal over the prompt
    mask[L:, L:] = False
    for c, i in at.items():  # a packed token sees its own context (itself included)
        mask[L + i, [L + at[c[:j]] for j in range(1, len(c) + 1)]] = True
    with torch.inference_mode():
        logits = model(torch.tensor([tokens]), positions=torch.tensor(positions), mask=mask).logits[0]  # [L+T, V]
    row = {(): L - 1, **{c: L + i for c, i in at.items()}}
    return {c: probs(logits[row[c]].double(), params) for c in contexts}


class TableLM:
    """p(ctx), q(ctx) (ToyLM's interface) from tables of real next-token laws, on a compact vocabulary."""

    def __init__(self, P, Q):
        self.vocab = sorted({t for D in (P, Q) for row in D.values() for t in row.nonzero().flatten().tolist()})
        local, cols = {t: i for i, t in enumerate(self.vocab)}, torch.tensor(self.vocab)
        self.V = len(self.vocab)  # every row has all its mass on these tokens
        self.P = {tuple(local[t] for t in c): row[cols] for c, row in P.items()}  # {ctx: [V]}
        self.Q = {tuple(local[t] for t in c): row[cols] for c, row in Q.items()}

    def p(self, ctx):
        return self.P[ctx]

    def q(self, ctx):
        return self.Q[ctx]

    def text(self, tok, seq):
        return repr("".join(tok.decode([self.vocab[t]]) for t in seq))


def table_lm(target, draft, prompt_ids, params, depth):
    """Every law a loop emitting depth + 1 tokens can ask for: after each context of <= depth tokens
    that p or q can produce."""
    P, Q, level = {}, {}, [()]
    for d in range(depth + 1):
        P.update(next_token_laws(target, prompt_ids, level, params))
        Q.update(next_token_laws(draft, prompt_ids, level, params))
        level = [c + (t,) for c in level for t in ((P[c] > 0) | (Q[c] > 0)).nonzero().flatten().tolist()]
    return TableLM(P, Q)


def first_tokens(lm, step, length, k, chooser):
    """The first `length` tokens of a speculative loop: each step(lm, ctx, k', chooser) drafts
    k' = min(k, tokens still wanted - 1) tokens (the step's own residual/bonus token is the last one)."""
    out = ()
    while len(out) < length:
        out += step(lm, out, min(k, length - len(out) - 1), chooser)
    return out[:length]


def joint_tv_check(lm, law, steps, n, seed=0, length=3, k=2):
    """Sample n runs of each step rule; TV of the first `length` tokens to the exact `law`.
    Returns {name: dict(tv, counts, draws)}, the bound tv_bound(n, K), the support and the target law."""
    support = sorted(law)
    index = {s: i for i, s in enumerate(support)}
    target = np.array([law[s] for s in support] + [0.0])  # last bin: sequences the target never emits
    out = {}
    for name, step in steps.items():
        ch = vf.TorchChooser(torch.Generator().manual_seed(seed))
        draws = np.array([index.get(first_tokens(lm, step, length, k, ch), len(support)) for _ in range(n)])
        counts = np.bincount(draws, minlength=len(target))
        out[name] = dict(tv=0.5 * float(np.abs(counts / n - target).sum()), counts=counts, draws=draws)
    return out, ex.tv_bound(n, len(target)), support, target


def first_tokens_law(target, prompt_ids, params, length: int) -> dict[tuple, float]:
    """The exact law of the first ``length`` tokens the target samples after ``prompt_ids``:
    {token tuple: probability}, one packed forward per level (top-k keeps it finite)."""
    law = {(): 1.0}
    for _ in range(length):
        P = next_token_laws(target, prompt_ids, list(law), params)
        law = {c + (t,): pc * float(P[c][t]) for c, pc in law.items() for t in P[c].nonzero().flatten().tolist()}
    return law


def claim_uniform_q(drafter, vocab_size: int | None = None):
    """The wrong control of the loop checks: ``drafter``'s trees claim their drafts were sampled from a
    uniform q. Verification then accepts a draft x with min(1, p(x) / q(x)) = 1 whenever p(x) > 0, so
    the emitted tokens lean toward the drafter's favourites instead of following p."""
    V = vocab_size or next(m.cfg.vocab_size for m in (getattr(drafter, "target", None), getattr(drafter, "model", None))
                           if m is not None)
    propose = drafter.propose

    def lying(*a, **kw):
        tree = propose(*a, **kw)
        tree.q = torch.full((len(tree) + 1, V), 1.0 / V)  # [N + 1, V]
        return tree
    drafter.propose = lying
    return drafter


def share_verifier_stream(drafter):
    """A subtle control for sampled drafts: a drafter that draws its drafts from a copy of the
    loop's generator, so the uniforms behind its samples are the very ones the verifier then
    uses to accept them (the bug of seeding the draft sampler like the verifier). Each draft is
    still distributed as q, and q is reported honestly; only the independence of drafts and
    coin flips is lost, and with it exactness."""
    propose = drafter.propose

    def sharing(params, budget, generator=None):
        if generator is None:
            return propose(params, budget, generator)
        g = torch.Generator(device=generator.device)
        g.set_state(generator.get_state())  # the verifier's coming draws, replayed by the drafter
        return propose(params, budget, g)
    drafter.propose = sharing
    return drafter


def peek_verifier_stream(drafter, band: float):
    """A subtle control for deterministic (one-hot q) trees: a drafter that reads the verifier's
    random stream. Before proposing it copies the loop's generator and draws the uniform u that
    the verifier will use for the root's first child (``TorchChooser.bernoulli``); when u falls
    in the top ``band`` of [0, 1) (a draw that rejects whichever child is tried first, unless its
    p is above 1 - band) it swaps the root's first two children, so the second gets the doomed
    draw and the first a fresh one. The drafts stay the draft's own top tokens and every tree is
    valid; only their order depends on u, which the proof of exactness forbids (the drafts
    must be independent of the verifier's coin flips). The bias depends on ``band`` and vanishes
    at 0 and at 1 (the order is then independent of u)."""
    propose = drafter.propose

    def peeking(params, budget, generator=None):
        tree = propose(params, budget, generator)
        roots = [i for i, j in enumerate(tree.parents) if j == -1]
        if generator is None or len(roots) < 2:
            return tree
        g = torch.Generator(device=generator.device)
        g.set_state(generator.get_state())  # the verifier's next draws, without consuming them
        u = torch.rand((), dtype=torch.float64, generator=g, device=generator.device).item()
        if u < 1 - band:
            return tree
        b = roots[1]  # the second root child's subtree moves in front: b is tried first, then a
        order = [i for i in range(len(tree.tokens)) if _root_of(tree.parents, i) == b]
        order += [i for i in range(len(tree.tokens)) if _root_of(tree.parents, i) != b]  # still topological
        new = {old: k for k, old in enumerate(order)}
        tree.tokens = [tree.tokens[i] for i in order]
        tree.parents = [-1 if tree.parents[i] == -1 else new[tree.parents[i]] for i in order]
        return tree
    drafter.propose = peeking
    return drafter


def _root_of(parents, i: int) -> int:
    """The root child (depth-1 node) above node i."""
    while parents[i] != -1:
        i = parents[i]
    return i


def loop_tv_check(target, tok, prompt_ids, drafters: dict[str, Callable], params, n: int, length: int = 3,
                  batch: int = 32, seed: int = 0, law: dict | None = None, progress: bool = True,
                  company: Sequence[Sequence[int]] = (), control_max: int | None = None):
    """Run the real decode loop ``n`` times per drafter and compare its first ``length`` tokens with
    the exact law.

    Each run is one row of ``minispec.batch.generate_batch`` (``batch`` rows at a time, each with its
    own seed and its own drafter from the factory ``drafters[name]``); ``max_new_tokens = length + 1``,
    so token 1 comes from the prefill and tokens 2..length from the first speculative step(s),
    drafts and bonus included. Returns ({name: dict(tv, p_value, counts, draws, drafts_tested,
    drafts_accepted)}, the bound tv_bound(n, K), the support, the target law [K] (last bin: sequences
    the target never emits)). ``p_value`` is the chi-square tests' (``prefix_p_value``).

    ``company``: other prompts decoded in every batch beside the checked rows, with drafters from
    the same factory and their own seeds; their tokens are not counted. They make the forwards
    ragged (other prefix lengths, other trees, other acceptance), which must not change the law
    of the checked rows (chapter 7).

    ``control_max``: the wrong controls (names starting with "WRONG") are tested sequentially, so
    that their power does not hang on how good the drafter happens to be: looks at n, 2n, 4n, ...
    up to ``control_max`` runs, stopping at the first look that flags. Each look tests at level
    ``ALPHA / looks`` (chi-square and TV bound both), so by the union bound an exact sampler would
    still be flagged with probability at most 2 * ALPHA over all looks. A control's record then
    carries its own ``alpha`` and ``bound``, which ``flagged`` uses. Honest runs always take n.
    """
    from tqdm.auto import tqdm

    from ..batch import generate_batch

    if control_max is not None and control_max < n:
        raise ValueError(f"control_max ({control_max}) must be at least n ({n})")
    looks = [n]
    while control_max is not None and looks[-1] < control_max:
        looks.append(min(2 * looks[-1], control_max))

    law = law if law is not None else first_tokens_law(target, prompt_ids, params, length)
    support = sorted(law)
    index = {s: i for i, s in enumerate(support)}
    exact = np.array([law[s] for s in support] + [0.0])  # [K]
    out = {}
    for name, make in drafters.items():
        draws, tested, accepted = [], 0, 0
        plan = looks if name.startswith("WRONG") else [n]
        alpha = ALPHA / len(plan)
        for m in plan:
            for start in tqdm(range(len(draws), m, batch), desc=f"loop {name} (N = {m})", leave=False,
                              disable=not progress or None):
                rows = min(batch, m - start)
                prompts = [list(prompt_ids)] * rows + [list(c) for c in company]
                seeds = [seed * 10_000_019 + start + j for j in range(rows)]
                seeds += [seed * 10_000_019 + 5_000_000 + start * len(company) + j for j in range(len(company))]
                got, _ = generate_batch(target, tok, prompts, drafter=make, chat=False,
                                        max_new_tokens=length + 1, stop_at_eos=False, temperature=params.temperature,
                                        top_k=params.top_k, top_p=params.top_p, seed=seeds)
                for r in got[:rows]:
                    draws.append(index.get(tuple(r.tokens[:length]), len(support)))
                    tested += sum(r.stats.tested_at_depth)
                    accepted += sum(r.stats.accepted_at_depth)
            counts = np.bincount(np.array(draws), minlength=len(exact))
            out[name] = dict(tv=0.5 * float(np.abs(counts / m - exact).sum()),
                             p_value=prefix_p_value(draws, support, exact), counts=counts, draws=np.array(draws),
                             drafts_tested=tested, drafts_accepted=accepted)
            if len(plan) > 1:
                out[name].update(alpha=alpha, bound=ex.tv_bound(m, len(exact), delta=alpha), looks=len(plan))
                if flagged(out[name], None):
                    break
    return out, ex.tv_bound(n, len(exact)), support, exact


def prefix_p_value(draws, support, exact) -> float:
    """One p-value for "the first tokens follow the exact law", from chi-square tests of the law of
    the first l tokens for l = 1 .. L (``exactness.chi_square_p`` each), Bonferroni-combined:
    min(1, L * min_l p_l). A deviation at token 2 is diluted among the outcomes of token 3 in
    the full law; its prefix law concentrates it, so the test needs fewer runs to see it.

    draws: [n] indices into ``support`` (len(support): a sequence outside it); exact: [K + 1]."""
    draws, L = np.asarray(draws), len(support[0])
    ps = []
    for l in range(1, L + 1):
        prefixes = sorted({s[:l] for s in support})
        at = {c: i for i, c in enumerate(prefixes)}
        to = np.array([at[s[:l]] for s in support] + [len(prefixes)])  # support index -> prefix index
        law = np.bincount(to, weights=exact, minlength=len(prefixes) + 1)
        ps.append(ex.chi_square_p(np.bincount(to[draws], minlength=len(prefixes) + 1), law))
    return min(1.0, L * min(ps))


ALPHA = 1e-6  # an exact sampler fails the chi-square test with this probability (the TV bound's too)


def flagged(r: dict, bound: float | None) -> bool:
    """A run is flagged when its TV exceeds ``tv_bound`` or the chi-square test rejects the exact law
    at level ``ALPHA``. An exact sampler is flagged with probability at most 2 * ALPHA. The TV test
    catches a large deviation whatever its shape; the chi-square test, weighing each outcome by its
    own variance, catches a small one with far fewer runs. A sequentially tested control (``alpha``
    and ``bound`` in its record, ``loop_tv_check(control_max=...)``) is judged at its own level."""
    return r["tv"] > r.get("bound", bound) or r["p_value"] < r.get("alpha", ALPHA)


def show_loop_check(tok, support, exact, res, bound, title: str):
    """Print one line per run of ``loop_tv_check`` (TV, flagged or not, drafts accepted) and plot the
    empirical laws of the first tokens against the exact one. Returns the figure."""
    import matplotlib.pyplot as plt

    print(f"{title}\n{len(support)} outcomes of the first {len(support[0])} tokens; flagged when TV > "
          f"tv_bound(N, K={len(exact)}) = {bound:.4f} or the chi-square p-value < {ALPHA:g}")
    for name, r in res.items():
        print(f"  {name:<44} N = {len(r['draws']):>5}  TV = {r['tv']:.4f}  p = {r['p_value']:8.2g}  "
              f"{'FLAGGED' if flagged(r, bound) else 'passes '}  drafts accepted {r['drafts_accepted']}/{r['drafts_tested']}"
              + (f"  (sequential, up to {r['looks']} looks: TV bound {r['bound']:.4f}, alpha {r['alpha']:.2g})"
                 if "looks" in r else ""))
    for name, r in res.items():
        if name.startswith("WRONG") and r["tv"] <= r.get("bound", bound):  # flagged, if at all, by the chi-square test alone
            need = ex.samples_for_tv(0.8 * r["tv"], len(exact))
            print(f"  {name}: TV {r['tv']:.3f} at N = {len(r['draws'])} (sampling noise included); for the TV "
                  f"test alone to flag a deviation this large takes about {need:,} runs (tv_bound(n, K) = 0.8 TV)")
    fig, ax = plt.subplots(figsize=(9, 3))
    x, w = np.arange(len(support)), 0.8 / (len(res) + 1)
    ax.bar(x, exact[:-1], w, color="k", label="exact law (target)")
    for i, (name, r) in enumerate(res.items(), 1):
        ax.bar(x + i * w, r["counts"][:-1] / len(r["draws"]), w, label=name)
    ax.set_xticks(x + 0.4 - w / 2, [repr(tok.decode(list(s))) for s in support], rotation=30, fontsize=7, ha="right")
    ax.set(ylabel="probability", title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def assert_loop_check(res, bound) -> None:
    """The verdict of a ``loop_tv_check`` with controls: every run named "WRONG..." must be ``flagged``;
    every other run must pass (TV within the bound, chi-square p-value at least ``ALPHA``, no
    sequence outside the target's support)."""
    for name, r in res.items():
        what = (f"TV {r['tv']:.4f} (bound {r.get('bound', bound):.4f}), chi-square p {r['p_value']:.2g} "
                f"(alpha {r.get('alpha', ALPHA):g}), N = {len(r['draws'])}")
        if name.startswith("WRONG"):
            assert flagged(r, bound), f"{name}: the wrong control must be flagged: {what}"
        else:
            assert not flagged(r, bound) and r["counts"][-1] == 0, f"{name}: an exact sampler must pass: {what}"


def packed_law(target, draft, prompt_ids, params, length: int):
    """(TableLM, exact law of the first ``length`` tokens) of ``target`` after ``prompt_ids`` (chapters 1-2): the
    next-token laws of every context the loop can ask for, from packed forwards (``table_lm``), checked once:
    the deepest context's row equals a plain forward of prompt + context (to 1e-4)."""
    lm = table_lm(target, draft, prompt_ids, params, depth=length - 1)
    law = ex.target_distribution(lm, length)  # {(x1, .., x_length): p(x1) p(x2 | x1) ...}
    deepest = max(lm.P, key=len)
    with torch.inference_mode():
        plain = probs(target(torch.tensor([list(prompt_ids) + [lm.vocab[t] for t in deepest]])).logits[0, -1].double(),
                      params)
    err = float((plain[lm.vocab] - lm.p(deepest)).abs().max())
    assert err <= 1e-4, f"the packed forward differs from a plain forward by {err:.2g}"
    return lm, law


def decode_loop_exactness(target, tok, runs: dict[str, Callable], subtle: dict[str, Callable], *, models: str,
                          fast: bool, prompt: str = "The best way to", company: Sequence[str] = (),
                          n: tuple[int, int] = (64, 2048), length: int = 3, top_k: int = 3) -> dict:
    """The exactness check of the real decode loop that chapters 3, 4, 5 and 7 run, in one call.

    The target samples at temperature 1, top-k ``top_k``, after ``prompt`` (no chat template); the exact law
    of its first ``length`` tokens (``first_tokens_law``) is set against ``loop_tv_check`` of every factory in
    ``runs`` (the honest drafters and the blatant "WRONG" controls: N runs, the controls sequentially up to 8N)
    and, in full mode only, of ``subtle`` (controls whose deviation only the chi-square tests see at these
    sizes: N runs, up to 4N; they take minutes of decoding). N is ``n[0]`` in fast mode, ``n[1]`` otherwise.
    ``company``: prompts decoded beside the checked rows in every batch (chapter 7's ragged batches).
    Prints the heading "TV check — ``models``", every run's TV, p-value and verdict, draws the figures, and
    asserts the verdict (``assert_loop_check``): every honest run passes, every "WRONG" control is flagged.

    Returns:
        dict(res, bound, support, exact, subtle=(res, bound) or None).
    """
    import matplotlib.pyplot as plt

    from ..sampling import SamplingParams
    from ..tokenizer import encode_prompt

    params = SamplingParams(temperature=1.0, top_k=top_k)
    ids = encode_prompt(tok, prompt, chat=False)
    others = [encode_prompt(tok, p, chat=False) for p in company]
    law = first_tokens_law(target, ids, params, length=length)  # {(t1, .., t_length): probability}
    top = max(law, key=law.get)
    print(f"the target's first {length} tokens after {prompt!r}: {len(law)} outcomes, the most likely "
          f"{tok.decode(list(top))!r} with {law[top]:.1%}")
    N = n[0] if fast else n[1]
    res, bound, support, exact = loop_tv_check(target, tok, ids, runs, params, N, length=length, law=law,
                                               batch=64, company=others, control_max=8 * N)
    heading = f"TV check — {models}"
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
    except ImportError:
        get_ipython = lambda: None  # noqa: E731
    if get_ipython() is not None:  # a notebook: the heading as Markdown
        display(Markdown(f"**{heading}**"))
    else:
        print(heading)
    where = f"first {length} tokens after {prompt!r}, T = 1, top-k {top_k}" + (
        f", in batches with {len(company)} other prompt(s)" if company else "")
    show_loop_check(tok, support, exact, res, bound, where)
    plt.show()
    assert_loop_check(res, bound)  # every honest run passes, every "WRONG" run is flagged
    out = dict(res=res, bound=bound, support=support, exact=exact, subtle=None)
    if fast or not subtle:
        print("the subtle control: full mode only (MINISPEC_FAST unset; minutes of decoding); in fast mode (CI) "
              "tests/test_joint_law.py flags the same kind of control on tiny models")
        return out
    res_s, bound_s, _, _ = loop_tv_check(target, tok, ids, subtle, params, N, length=length, law=law, batch=64,
                                         company=others, control_max=4 * N)
    show_loop_check(tok, support, exact, res_s, bound_s, "the subtle control: " + where)
    plt.show()
    assert_loop_check(res_s, bound_s)
    out["subtle"] = (res_s, bound_s)
    return out
