"""Drafters: propose a draft tree each step; the decode loop verifies it against the target.

    DraftModel     a smaller causal LM with the same tokenizer (vanilla speculative sampling)
    PromptLookup   n-gram match in the context (no model, deterministic drafts)
"""

from .base import Drafter
from .draft_model import DraftModel
from .prompt_lookup import PromptLookup

__all__ = ["Drafter", "DraftModel", "PromptLookup"]
