"""Tokenizer helpers: a trivial byte tokenizer for the tiny presets, and prompt encoding.

Real models use their Hugging Face tokenizer; the tiny test presets use ``ByteTokenizer``
(UTF-8 bytes are the token ids). ``encode_prompt`` applies a chat template where the
tokenizer has one, the same way for minispec and for the transformers baselines.
"""

from __future__ import annotations

from typing import Sequence


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocab 256); no special tokens, no chat template."""

    vocab_size = 256
    eos_token_id = None
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")

    def __repr__(self):
        return "ByteTokenizer(vocab_size=256)"


def encode_prompt(tokenizer, prompt: str | Sequence[int], chat: bool = True) -> list[int]:
    """Prompt -> token ids.

    Args:
        tokenizer: a Hugging Face tokenizer or a ByteTokenizer.
        prompt: text, or token ids (returned unchanged).
        chat: wrap text as one user turn with the tokenizer's chat template, when it has one.
    Returns:
        list of token ids.
    """
    if not isinstance(prompt, str):
        return [int(t) for t in prompt]
    if chat and getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                               add_generation_prompt=True, tokenize=False)
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode(prompt)
    return list(tokenizer(prompt)["input_ids"])
