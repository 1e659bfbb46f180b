"""The minispec Transformer against transformers' own implementation on the same weights."""

import pytest
import torch
from transformers import DynamicCache

from minispec import KVCache, load, load_hf
from minispec.model import ModelConfig

TOL = 1e-4  # fp32
SMOLLM2_TOL = 2e-4  # fp32 over 30 layers of products summed in another order than transformers' F.linear: on an
#                     AVX2 EPYC after 10 cached steps, 5.5e-5 on the panels and 9.0e-5 (2 threads) to 1.01e-4 (a CI
#                     worker) on oneDNN's prepacked kernel, which "auto" chose there


def _hf_cached_logits(hf, x, split):
    """HF logits for x [B, T]: prefill x[:, :split], then one token at a time with its KV cache."""
    pkv = DynamicCache(config=hf.config)
    outs = [hf(x[:, :split], past_key_values=pkv, use_cache=True).logits]
    for t in range(split, x.shape[1]):
        outs.append(hf(x[:, t:t + 1], past_key_values=pkv, use_cache=True).logits)
    return torch.cat(outs, 1)


def _ms_cached_logits(model, x, split):
    kv = KVCache.for_model(model, capacity=x.shape[1], batch_size=x.shape[0])
    outs = [model(x[:, :split], kv=kv).logits]
    kv.commit()
    for t in range(split, x.shape[1]):
        outs.append(model(x[:, t:t + 1], kv=kv).logits)
        kv.commit()
    return torch.cat(outs, 1)


def _check_against_hf(model, hf, vocab, B=2, T=24, split=16, tol=TOL):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (B, T), generator=g)
    with torch.no_grad():
        full = (model(x).logits - hf(x).logits).abs().max().item()
        cached = (_ms_cached_logits(model, x, split) - _hf_cached_logits(hf, x, split)).abs().max().item()
    assert full <= tol, f"no cache: max |diff| {full:.2e}"
    assert cached <= tol, f"with KV cache (prompt + {T - split} decode steps): max |diff| {cached:.2e}"


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-gpt2-draft"])
def test_tiny_presets_match_transformers(name):
    model, _ = load(name)
    hf, _ = load_hf(name)
    _check_against_hf(model, hf, model.cfg.vocab_size)


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2, smollm2_hf):
    model, _ = smollm2
    hf, _ = smollm2_hf
    assert (model.cfg.arch, model.cfg.n_layer, model.cfg.d_model, model.cfg.vocab_size) == ("llama", 30, 576, 49152)
    assert model.cfg.n_kv_head == 3 and model.cfg.tie_embeddings
    _check_against_hf(model, hf, model.cfg.vocab_size, B=1, T=40, split=30, tol=SMOLLM2_TOL)


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_hidden_states_match_transformers(name):
    model, _ = load(name)
    hf, _ = load_hf(name)
    x = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model(x, hidden_layers=(0, 1))
        ref = hf(x, output_hidden_states=True).hidden_states  # [embeddings, after layer 0, ..., final (normed)]
    assert (out.layer_inputs[0] - ref[0]).abs().max() <= TOL
    assert (out.layer_inputs[1] - ref[1]).abs().max() <= TOL
    assert (out.hidden - ref[-1]).abs().max() <= TOL  # last hidden state after the final norm


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_tree_mask_equals_separate_branches(name):
    """Two sibling tokens after a prefix, each seeing only the prefix and itself, equal two separate runs."""
    model, _ = load(name)
    prefix = torch.tensor([[5, 17, 99, 42]])
    a, b = 7, 200
    with torch.no_grad():
        kv = KVCache.for_model(model, 16)
        model(prefix, kv=kv)
        kv.commit()
        mask = torch.eye(2, dtype=torch.bool)  # siblings: no attention to each other
        tree = model(torch.tensor([[a, b]]), positions=torch.tensor([4, 4]), mask=mask, kv=kv).logits[0]
        kv.discard()
        for i, t in enumerate((a, b)):
            alone = model(torch.cat([prefix, torch.tensor([[t]])], 1)).logits[0, -1]
            assert (tree[i] - alone).abs().max() <= TOL


def test_causal_default_equals_explicit_mask():
    model, _ = load("tiny-llama")
    x = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        kv = KVCache.for_model(model, 32)
        model(x[:, :5], kv=kv)
        kv.commit()
        implicit = model(x[:, 5:], kv=kv).logits
        kv.discard()
        explicit = model(x[:, 5:], kv=kv, mask=torch.ones(7, 7, dtype=torch.bool).tril()).logits
        kv.discard()
        full = model(x).logits[:, 5:]
    assert (implicit - explicit).abs().max() <= TOL and (implicit - full).abs().max() <= TOL


def test_last_logits_only():
    model, _ = load("tiny-gpt2")
    x = torch.randint(0, 256, (2, 6))
    with torch.no_grad():
        assert torch.allclose(model(x, last_logits_only=True).logits[:, 0], model(x).logits[:, -1], atol=1e-6)


def test_bad_mask_and_positions_raise():
    model, _ = load("tiny-gpt2")
    x = torch.tensor([[1, 2, 3]])
    with pytest.raises(TypeError, match="boolean"):
        model(x, mask=torch.ones(3, 3))
    with pytest.raises(ValueError, match="does not fit"):
        model(x, mask=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="context"):
        model(x, positions=torch.tensor([510, 511, 512]))


def test_config_validation():
    with pytest.raises(ValueError, match="arch"):
        ModelConfig("gptx", 10, 1, 2, 8, 16, 32)
    with pytest.raises(ValueError, match="multiple"):
        ModelConfig("llama", 10, 1, 3, 12, 16, 32, n_kv_head=2)
