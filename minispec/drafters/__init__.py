"""Drafters: propose a draft tree each step; the decode loop verifies it against the target.

    DraftModel     a smaller causal LM with the same tokenizer (vanilla speculative sampling);
                   chains, static trees or EAGLE-2 dynamic trees
    PromptLookup   n-gram match in the context (no model, deterministic drafts)
    TreeDrafter    the base of branching drafters; TreeSpec says which tree shape to draft
"""

from .base import Drafter
from .draft_model import DraftModel
from .prompt_lookup import PromptLookup
from .tree_drafter import STATIC_TREES, TreeDrafter, TreeSpec

__all__ = ["Drafter", "DraftModel", "PromptLookup", "STATIC_TREES", "TreeDrafter", "TreeSpec"]
