"""The oracle drafter (chapter 9): known tau in closed form, output equal to vanilla greedy."""

import pytest
import torch

from minispec import generate, load
from minispec.drafters.oracle import OracleDrafter, expected_tau
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
