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
