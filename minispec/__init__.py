"""minispec: speculative decoding for LLMs, built up chapter by chapter.

    from minispec import load, generate
    model, tokenizer = load("smollm2-135m")
    result = generate(model, tokenizer, "Explain speculative decoding.", max_new_tokens=64)
    print(result.text, result.stats.tokens_per_s)

Notation used throughout: p target distribution, q draft distribution, k (gamma) draft
length, accept with probability min(1, p/q), residual norm(max(0, p - q)), tau = mean tokens
committed per target forward (bonus included; vanilla = 1.00).

Triton's kernels (chapter 6, ``minispec.attention.triton_split``) run on a CPU only through Triton's
interpreter, which triton reads when it decorates a kernel, i.e. when it is first imported, and
``torch.compile`` imports it early. So, on a machine without CUDA, importing minispec switches the
interpreter on before anything else runs (``TRITON_INTERPRET=1`` unless it is set already).
"""

import os as _os

import torch as _torch

if not _torch.cuda.is_available():  # before any import below: torch.compile's first use imports triton
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from .generate import GenerationResult, GenerationStats, generate
from .kv import KVCache, KVCacheOverflow
from .model import ModelConfig, ModelOutput, Transformer
from .loading import ModelNotFound, load, load_hf
from .sampling import SamplingParams, probs, sample

__version__ = "0.1.0"

__all__ = ["GenerationResult", "GenerationStats", "generate", "KVCache", "KVCacheOverflow", "ModelConfig",
           "ModelOutput", "Transformer", "ModelNotFound", "load", "load_hf", "SamplingParams", "probs", "sample"]
