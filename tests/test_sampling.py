import math

import pytest
import torch

from minispec.sampling import SamplingParams, next_token, probs, sample


def test_greedy_is_one_hot_on_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [3.0, 0.0, 0.0, 0.0]])
    p = probs(logits, SamplingParams())
    assert torch.equal(p, torch.tensor([[0.0, 1, 0, 0], [1, 0, 0, 0]]))
    assert next_token(logits, SamplingParams()).tolist() == [1, 0]


def test_temperature_scales_logits():
    logits = torch.randn(5, 11, dtype=torch.float64)
    for t in (0.5, 1.0, 2.0):
        assert torch.allclose(probs(logits, temperature=t), torch.softmax(logits / t, -1))


def test_top_k_keeps_k_largest_and_renormalises():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0, 0.0], dtype=torch.float64)
    p = probs(logits, temperature=1.0, top_k=2)
    expect = torch.zeros(5, dtype=torch.float64)
    expect[[1, 2]] = torch.softmax(torch.tensor([4.0, 3.0], dtype=torch.float64), -1)
    assert torch.allclose(p, expect)


def test_top_p_keeps_smallest_prefix_reaching_mass():
    base = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    logits = base.log()
    # 0.5 < 0.7 -> keep the 2nd; 0.8 >= 0.7 -> stop
    assert torch.allclose(probs(logits, temperature=1.0, top_p=0.7), torch.tensor([0.625, 0.375, 0, 0], dtype=torch.float64))
    # the most likely token always stays
    assert torch.allclose(probs(logits, temperature=1.0, top_p=0.1), torch.tensor([1.0, 0, 0, 0], dtype=torch.float64))
    assert torch.allclose(probs(logits, temperature=1.0, top_p=1.0), base)


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.99])
def test_top_p_keeps_what_transformers_keeps(top_p):
    """minispec's nucleus (a top-k of 64 tokens, widened while their mass is below top_p) keeps the same
    tokens as transformers' TopPLogitsWarper (a sort of the whole vocabulary), on peaked and flat rows
    of a 49,152-token vocabulary, whose nuclei range from one token to tens of thousands. Float32
    rounding of a cumulative mass (which depends on the CPU's vector width) may decide a token whose
    float64 mass before it lies within 1e-4 of top_p, in either implementation; every other token must
    agree."""
    from transformers.generation.logits_process import TopPLogitsWarper

    g = torch.Generator().manual_seed(5)
    logits = torch.cat([4 * torch.randn(3, 49152, generator=g), 0.3 * torch.randn(3, 49152, generator=g)])  # [6, V]
    ours = probs(logits, SamplingParams(temperature=1.0, top_p=top_p)) > 0
    theirs = torch.isfinite(TopPLogitsWarper(top_p)(None, logits.clone()))
    p64, order = torch.sort(torch.softmax(logits.double(), -1), -1, descending=True)
    before = torch.zeros_like(p64).scatter(-1, order, p64.cumsum(-1) - p64)  # float64 mass ranked before each token
    clear = (before - top_p).abs() > 1e-4
    assert torch.equal(ours[clear], theirs[clear]) and torch.equal(ours[clear], (before < top_p)[clear])
    assert clear.float().mean() > 0.99  # the undecided band is a sliver of the vocabulary
    assert (ours.sum(-1) >= 1).all() and (top_p < 0.5 or (ours.sum(-1) > 64).any())  # the widening is exercised


def test_top_k_and_top_p_compose_identically_for_p_and_q():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g)
    params = SamplingParams(temperature=0.8, top_k=10, top_p=0.9)
    p = probs(logits, params)
    assert torch.allclose(p.sum(-1), torch.ones(3))
    assert ((p > 0).sum(-1) <= 10).all()
    # same logits give the same distribution whichever role (p or q) they play
    assert torch.equal(p, probs(logits.clone(), params))


def test_sample_follows_distribution():
    p = torch.tensor([0.1, 0.6, 0.3])
    g = torch.Generator().manual_seed(1)
    x = sample(p.expand(20000, 3), g)
    freq = torch.bincount(x, minlength=3).float() / 20000
    assert (freq - p).abs().max() < 0.015


@pytest.mark.parametrize("kwargs, word", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"), (dict(top_k=-1), "top_k"), (dict(top_k=2.5), "top_k"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_p=-0.2), "top_p"),
])
def test_invalid_sampling_parameters_raise_clear_errors(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


def test_top_p_boundary_is_inclusive():
    """Mass exactly reaching top_p stops the nucleus: 4 equal tokens (0.25 each) at top_p 0.5 keep 2."""
    p = probs(torch.zeros(4, dtype=torch.float64), temperature=1.0, top_p=0.5)
    assert (p > 0).sum() == 2 and torch.allclose(p[p > 0], torch.tensor([0.5, 0.5], dtype=torch.float64))


# --------------------------------------------------------------------------- seeded sampling on any device
def test_sample_is_the_inverse_transform_of_one_uniform_per_row():
    """The token whose cumulative mass first exceeds u x total, u from the generator: exact by construction."""
    p = torch.softmax(torch.randn(6, 50, generator=torch.Generator().manual_seed(3)), -1)
    got = sample(p, torch.Generator().manual_seed(7))
    u = torch.rand(6, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    cdf = p.double().cumsum(-1)
    want = (cdf <= u * cdf[:, -1:]).sum(-1)  # how many tokens' cumulative mass stays at or below the draw
    assert torch.equal(got, want) and got.device == p.device


def test_sample_never_draws_a_token_without_mass():
    p = torch.zeros(4000, 7)
    p[:, [0, 3, 6]] = torch.tensor([0.2, 0.5, 0.3])  # zeros in front, between and after
    ids = sample(p, torch.Generator().manual_seed(0))
    assert set(ids.tolist()) == {0, 3, 6}
    with pytest.raises(ValueError, match="no mass"):
        sample(torch.zeros(2, 5))


def test_draw_device_is_the_generators():
    from minispec.sampling import draw_device

    p = torch.empty(2, 10, device="meta")  # probabilities on a device other than the generator's
    assert draw_device(p, torch.Generator()) == torch.device("cpu")
    assert draw_device(p, None) == torch.device("meta")


def test_sample_draws_on_the_generators_device(monkeypatch):
    """p goes to draw_device (the generator's), the token comes back to p's device: routed through
    draw_device, whose rule is tested above (the other device needs a GPU: tests marked gpu)."""
    import minispec.sampling as sampling

    calls = []
    monkeypatch.setattr(sampling, "draw_device", lambda p, g: calls.append((p.device, g)) or torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    ids = sampling.sample(torch.full((3, 4), 0.25), gen)
    assert calls == [(torch.device("cpu"), gen)] and ids.shape == (3,) and ids.device == torch.device("cpu")


def test_dynamic_tree_expansion_keeps_the_logits_device():
    """EAGLE-2's first level starts from a CPU score; the logits may live on a GPU (meta stands in)."""
    from minispec.drafters.tree_drafter import expand_level

    scores, tokens, _, nxt = expand_level(torch.zeros(1), torch.randn(1, 50, device="meta"), 4)
    assert scores.device == tokens.device == nxt.device == torch.device("meta") and scores.shape == (4,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_seeded_sample_equals_the_cpu_one():
    p = torch.softmax(torch.randn(4, 1000, generator=torch.Generator().manual_seed(5)), -1)
    cpu = sample(p, torch.Generator().manual_seed(9))
    gpu = sample(p.cuda(), torch.Generator().manual_seed(9))  # generate's CPU generator, CUDA probabilities
    assert gpu.device.type == "cuda" and torch.equal(gpu.cpu(), cpu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("drafter", ["vanilla", "chain", "tree"])
def test_gpu_seeded_sampled_generate_runs_and_repeats(drafter):
    """generate's CPU generator with CUDA logits: no device error, and the same seed gives the same tokens."""
    from minispec import generate, load
    from minispec.drafters import DraftModel

    (model, tok), (draft, _) = load("tiny-llama", device="cuda"), load("tiny-gpt2-draft", device="cuda")
    make = {"vanilla": lambda: None, "chain": lambda: DraftModel(draft, k=3),
            "tree": lambda: DraftModel(draft, tree="3,2,6")}[drafter]
    runs = [generate(model, tok, "abc abc", drafter=make(), temperature=1.0, seed=4, max_new_tokens=12).tokens
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) > 0
