"""The oracle drafter (chapter 9): known tau in closed form, output equal to vanilla greedy."""

import pytest
import torch

from minispec import generate, load
from minispec.lab.oracle import OracleDrafter, expected_tau
from minispec.sampling import SamplingParams

GREEDY = SamplingParams(0.0, 0, 1.0)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models decode fastest on one thread; a second one on a busy machine makes them crawl."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


def test_expected_tau_closed_form():
    assert expected_tau(0.0, 4) == 5.0  # every draft accepted: k + 1
    assert expected_tau(1.0, 4) == 1.0  # none: the bonus token only
    a = 0.7
    assert expected_tau(0.3, 5) == pytest.approx((1 - a ** 6) / (1 - a))
    with pytest.raises(ValueError):
        expected_tau(1.5, 3)


@pytest.mark.parametrize("p,k,tree_nodes", [(0.2, 4, None), (0.5, 6, None), (0.35, 3, 12)])
def test_expected_tau_matches_simulation(p, k, tree_nodes):
    """Play greedy verification against the stream itself: accepted = leading uncorrupted drafts, + 1 bonus."""
    stream = torch.randint(0, 50, (4000,), generator=torch.Generator().manual_seed(1)).tolist()
    oracle = OracleDrafter(stream, k=k, p_corrupt=p, seed=3, tree_nodes=tree_nodes, vocab_size=50)
    oracle.prefill(stream[:1])
    n, steps = 1, 0
    while n + k < len(stream):
        tree = oracle.propose(GREEDY, budget=k)
        assert len(tree) == (tree_nodes or k)
        node, accepted = -1, 0  # walk down: the child holding the true next token, if any
        while True:
            kids = [i for i, par in enumerate(tree.parents) if par == node and tree.tokens[i] == stream[n + accepted]]
            if not kids:
                break
            node, accepted = kids[0], accepted + 1
        oracle.commit(stream[n:n + accepted + 1])  # the accepted drafts + the target's token
        n, steps = n + accepted + 1, steps + 1
    tau = (n - 1) / steps
    assert abs(tau - expected_tau(p, k)) < 0.04 * expected_tau(p, k), (tau, expected_tau(p, k))  # ~1400 steps: SE ~1.5%


def test_corruptions_are_wrong_and_siblings_never_right():
    stream = list(range(40)) * 3
    oracle = OracleDrafter(stream, k=4, p_corrupt=1.0, tree_nodes=10, vocab_size=40)
    oracle.prefill(stream[:5])
    tree = oracle.propose(GREEDY, budget=4)
    truth = stream[5:9]
    depth = tree.depths()
    assert all(t != truth[d - 1] for t, d in zip(tree.tokens, depth))  # every node wrong
    assert len(tree) == 10 and tree.depth == 4
    assert [sum(d == level for d in depth) for level in (1, 2, 3, 4)] == [3, 3, 2, 2]  # wider near the root


@pytest.mark.parametrize("tree_nodes", [None, 16])
def test_generate_with_oracle_equals_vanilla_and_reaches_expected_tau(tiny, tree_nodes):
    model, tok = tiny
    prompt, n_new, p, k = "The oracle knows the stream.", 200, 0.3, 4
    vanilla = generate(model, tok, prompt, max_new_tokens=n_new + k, chat=False, stop_at_eos=False)
    oracle = OracleDrafter(vanilla.prompt_tokens + vanilla.tokens, k=k, p_corrupt=p, seed=0, tree_nodes=tree_nodes,
                           vocab_size=model.cfg.vocab_size)
    spec = generate(model, tok, prompt, drafter=oracle, max_new_tokens=n_new, chat=False)
    assert spec.tokens == vanilla.tokens[:n_new]
    assert oracle.off_stream == 0
    steps = spec.stats.tokens_per_step[1:-1]  # decode steps; the last may be cut by max_new_tokens
    tau = sum(steps) / len(steps)
    assert abs(tau - expected_tau(p, k)) < 0.15 * expected_tau(p, k), (tau, expected_tau(p, k))
    assert max(spec.stats.nodes) == (tree_nodes or k)


def test_for_prompt_builds_the_greedy_stream(tiny):
    model, tok = tiny
    oracle = OracleDrafter.for_prompt(model, tok, [5, 6, 7], 12, chat=False, k=2, p_corrupt=0.0)
    vanilla = generate(model, tok, [5, 6, 7], max_new_tokens=12, chat=False)
    assert oracle.stream == [5, 6, 7] + vanilla.tokens
    spec = generate(model, tok, [5, 6, 7], drafter=oracle, max_new_tokens=12, chat=False)
    assert spec.tokens == vanilla.tokens and spec.stats.tokens_per_step[1:4] == [3, 3, 3]  # p = 0: all accepted


def test_oracle_stops_drafting_off_stream(tiny):
    model, tok = tiny
    stream = [1, 2, 3] + [7] * 50  # not the model's greedy continuation
    oracle = OracleDrafter(stream, k=3, p_corrupt=0.0, vocab_size=256)
    r = generate(model, tok, [1, 2, 3], drafter=oracle, max_new_tokens=20, chat=False)
    assert r.tokens == generate(model, tok, [1, 2, 3], max_new_tokens=20, chat=False).tokens
    assert oracle.off_stream > 0


# --------------------------------------------------------------------------- re-anchoring and the loud tau check
def _greedy_stream(model, tok, prompt, n):
    r = generate(model, tok, prompt, max_new_tokens=n, chat=False, stop_at_eos=False)
    return r.prompt_tokens + r.tokens, r.tokens


def _with_one_wrong_token(stream, pos, vocab):
    wrong = list(stream)
    wrong[pos] = (wrong[pos] + 1) % vocab  # no longer the target's greedy token at pos
    return wrong


def _full_depth_tau(stats, k, n_new):
    from minispec.lab.scale import tau_check
    return tau_check(stats.tokens_per_step, k, 0.0, n_new)["tau_full"]


def test_oracle_reanchors_where_the_context_leaves_its_stream(tiny):
    """A stream wrong at one position stands for a near-tie that broke differently in a verify
    forward: the oracle re-anchors there once, and every later step drafts the target's stream."""
    model, tok = tiny
    prompt, n_new, k = [5, 6, 7, 8], 60, 4
    stream, vanilla = _greedy_stream(model, tok, prompt, n_new + k)
    pos = len(prompt) + 10
    oracle = OracleDrafter(_with_one_wrong_token(stream, pos, 256), k=k, p_corrupt=0.0, vocab_size=256, target=model)
    spec = generate(model, tok, prompt, drafter=oracle, max_new_tokens=n_new, chat=False, stop_at_eos=False)
    assert spec.tokens == vanilla[:n_new]
    assert oracle.reanchors == 1 and oracle.diverged_at == [pos] and oracle.off_stream == 0
    assert oracle.stream[:pos + 1] == stream[:pos + 1] and oracle.stream[pos + 1:len(stream)] == stream[pos + 1:]
    steps = spec.stats.tokens_per_step[1:]
    assert steps.count(k + 1) >= len(steps) - 3  # p = 0: every step but the one that met the wrong token
    assert oracle.reanchor_s > 0
    # the next generation starts again from the stream as given (and re-anchors again)
    generate(model, tok, prompt, drafter=oracle, max_new_tokens=n_new, chat=False, stop_at_eos=False)
    assert oracle.reanchors == 1 and oracle.diverged_at == [pos]


def test_oracle_without_target_stops_drafting_and_tau_collapses(tiny):
    model, tok = tiny
    prompt, n_new, k = [5, 6, 7, 8], 60, 4
    stream, vanilla = _greedy_stream(model, tok, prompt, n_new + k)
    pos = len(prompt) + 10
    oracle = OracleDrafter(_with_one_wrong_token(stream, pos, 256), k=k, p_corrupt=0.0, vocab_size=256)
    spec = generate(model, tok, prompt, drafter=oracle, max_new_tokens=n_new, chat=False, stop_at_eos=False)
    assert spec.tokens == vanilla[:n_new]  # still lossless
    assert oracle.reanchors == 0 and oracle.off_stream > 0 and oracle.diverged_at == [pos]
    assert _full_depth_tau(spec.stats, k, n_new) < 2.0  # promised k + 1 = 5


def test_oracle_does_not_reanchor_when_sampling(tiny):
    model, tok = tiny
    oracle = OracleDrafter.for_prompt(model, tok, [1, 2, 3], 30, chat=False, k=3, p_corrupt=0.0)
    assert oracle.target is model
    generate(model, tok, [1, 2, 3], drafter=oracle, max_new_tokens=30, chat=False, temperature=1.0, seed=0)
    assert oracle.reanchors == 0  # a sampled context leaves any greedy stream: no vanilla run per step


def test_tau_check_flags_a_collapse_and_accepts_the_promise():
    from minispec.lab.scale import tau_check
    k, p = 5, 0.3
    promise = expected_tau(p, k)
    budget = 400
    ok = tau_check([1] + [3] * 100, k, p, budget)  # mean 3 over the full-depth steps
    assert ok["ok"] and ok["full_steps"] == 100 and ok["tau_expected"] == pytest.approx(promise)
    collapsed = tau_check([1] + [3] * 20 + [1] * 80, k, p, budget)
    assert collapsed["ok"] is False and collapsed["tau_full"] == pytest.approx(1.4)
    exact = tau_check([1] + [6] * 10, k, 0.0, 100)  # p = 0: no variance, every step must commit k + 1
    assert exact["ok"] and tau_check([1] + [6] * 9 + [5], k, 0.0, 100)["ok"] is False
    assert tau_check([1, 2], k, p, 3)["ok"] is None  # no step had the full depth: nothing to say
    cut = tau_check([1, 6, 6, 2], k, 0.0, 15)  # the last step's budget (15 - 13 - 1 = 1) was cut: not counted
    assert cut["full_steps"] == 2 and cut["ok"]


def test_oracle_speedup_raises_when_tau_leaves_the_promise(tiny, monkeypatch):
    """Force a divergence in oracle_speedup's own oracle: without re-anchoring tau collapses and
    the comparison must fail loudly; with it the run keeps its promise."""
    from minispec.lab import scale

    model, _ = tiny
    real = scale.OracleDrafter

    class OneWrong(real):
        def __init__(self, stream, **kw):
            super().__init__(_with_one_wrong_token(stream, 16 + 6, model.cfg.vocab_size), **kw)

    monkeypatch.setattr(scale, "OracleDrafter", OneWrong)
    methods = {"vanilla": (0, 0), "chain": (4, 4)}
    with pytest.raises(scale.OracleTauError, match=r"chain: measured tau .* promised .*0 re-anchors"):
        scale.oracle_speedup(model, 16, 120, 0.2, methods=methods, reanchor=False)
    flagged = scale.oracle_speedup(model, 16, 120, 0.2, methods=methods, reanchor=False, check_tau=False)
    assert flagged["tau_ok_all"] is False and flagged["methods"]["chain"]["tau_ok"] is False
    r = scale.oracle_speedup(model, 16, 120, 0.2, methods=methods)
    chain = r["methods"]["chain"]
    assert r["identical_all"] and r["tau_ok_all"] and chain["reanchors"] == 1 and chain["diverged_at"] == [22]
    assert chain["reanchor_s"] > 0 and chain["phase_s_per_step"]["draft"] >= 0


# --------------------------------------------------------------------------- random_model keeps tied embeddings tied
def test_random_model_keeps_tied_embeddings_one_matrix():
    import dataclasses

    from minispec.model import Transformer
    from minispec.lab.scale import linear_params, llama_config, random_model

    cfg = llama_config("tiny-draft")
    assert cfg.tie_embeddings
    model = random_model(cfg)
    assert model.lm_head.weight is model.tok_emb.weight
    assert model.lm_head.weight.data_ptr() == model.tok_emb.weight.data_ptr()
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in Transformer(cfg).parameters())
    untied = random_model(dataclasses.replace(cfg, tie_embeddings=False))
    assert untied.lm_head.weight.data_ptr() != untied.tok_emb.weight.data_ptr()
    V, D = cfg.vocab_size, cfg.d_model
    assert sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in model.parameters()) == V * D
    # Llama-3.2-1B's published size (1.24B parameters) needs the tie: counted on the meta device
    with torch.device("meta"):
        big = Transformer(llama_config("llama-3.2-1b"))
    assert sum(p.numel() for p in big.parameters()) == 1_235_814_400
    assert linear_params(llama_config("llama-3.2-1b")) == 1_235_814_400 - 33 * 2048  # all but the 33 norms; the
    # tied matrix counts once as a parameter and once as the LM head's weight, read by every forward
