"""Model loading: local Hugging Face checkpoints, clear errors for unknown names and unsupported models."""

import pytest
import torch
import transformers

from minispec import ModelNotFound, load, load_hf
from minispec.loading import config_from_hf


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_load_local_checkpoint_dir(tmp_path, name):
    """The real hub-loading path, on a checkpoint saved locally (save_pretrained writes safetensors)."""
    hf, _ = load_hf(name)
    hf.save_pretrained(tmp_path)
    model, tok = load(str(tmp_path))
    x = torch.randint(0, 256, (1, 10))
    with torch.no_grad():
        assert (model(x).logits - hf(x).logits).abs().max() <= 1e-4
    assert model.cfg.arch == ("gpt2" if "gpt2" in name else "llama")


def test_unknown_model_name_is_a_clear_error():
    with pytest.raises(ModelNotFound, match="could not load model 'no-such-model-xyz'.*smollm2-135m"):
        load("no-such-model-xyz")


def test_gpt2_without_hub_names_the_model():
    # CI and this project's machines have no hub: the error must say which model and why
    import os

    if os.environ.get("HF_HUB_OFFLINE") != "1":
        pytest.skip("a hub may be reachable here; this test checks the offline error")
    with pytest.raises(ModelNotFound, match="'gpt2'"):
        load("gpt2")


def test_unsupported_architecture_is_rejected():
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                   attention_bias=True)
    with pytest.raises(ValueError, match="biases"):
        config_from_hf(cfg, "x")
    with pytest.raises(ValueError, match="not supported"):
        config_from_hf(transformers.BertConfig(), "bert")


def test_to_hf_round_trip():
    from minispec.loading import to_hf

    model, _ = load("tiny-llama")
    hf = to_hf(model)
    x = torch.randint(0, 256, (2, 7))
    with torch.no_grad():
        assert (model(x).logits - hf(x).logits).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="Llama"):
        to_hf(load("tiny-gpt2")[0])


def test_the_gguf_conversion_reads_each_file_once_and_leaves_gguf_as_it_was(tmp_path):
    """``ensure_smollm2`` converts inside ``_gguf_read_once``: a second read of the same GGUF file (transformers
    reads it for the config, the tokenizer and the weights) is the first reader, a name map is built once
    per argument, and the library's own functions are back afterwards. (The conversion itself runs in every
    fresh CI run, whose model cache starts empty.)"""
    import gguf
    import numpy as np

    from minispec.loading import _gguf_read_once

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with _gguf_read_once():
        first = gguf.GGUFReader(str(path))
        assert gguf.GGUFReader(str(path)) is first and gguf.GGUFReader(str(path)).tensors[0].name == "token_embd.weight"
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
    assert gguf.GGUFReader is reader and gguf.get_tensor_name_map is name_map
    assert gguf.GGUFReader(str(path)) is not gguf.GGUFReader(str(path))  # unmemoized again


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_load_and_a_forward_read_no_clock_and_write_nothing(tmp_path, monkeypatch, name):
    """No clock in the runtime (issue 61): ``load()`` (which gives a CPU float32 model the exact backend, its kernel
    this machine's saved choice or the default) and a forward on it time nothing and write nothing to the cache:
    every clock of ``time`` raises while they run, and the cache folder is never made."""
    import time

    from minispec.exact import kernels

    cache = tmp_path / "cache"
    monkeypatch.setenv("MINISPEC_CACHE", str(cache))
    monkeypatch.setattr(kernels, "_READ", {})  # nothing read in this process yet
    monkeypatch.setattr(kernels, "write_once", lambda *a: pytest.fail("the runtime wrote a kernel choice"))
    with pytest.MonkeyPatch.context() as clocks:
        for clock in ("perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time", "time_ns",
                      "process_time", "process_time_ns", "thread_time", "thread_time_ns"):
            def read(*a, _name=clock):
                raise AssertionError(f"time.{_name} was read")
            clocks.setattr(time, clock, read)
        model, _ = load(name)
        with torch.inference_mode():
            model(torch.tensor([[3, 1, 4, 1, 5]]))
    assert model.attention == "exact" and not cache.exists()
