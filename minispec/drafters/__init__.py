"""Drafters: propose a draft tree each step; the decode loop verifies it against the target.

    Vanilla        no drafting: the empty tree every step (plain decoding; ``drafter=None``)
    DraftModel     a smaller causal LM with the same tokenizer (vanilla speculative sampling)
    PromptLookup   n-gram match in the context (no model, deterministic drafts)
    CopyingDrafter the context's continuation when its last tokens repeat, else another drafter
    EagleDrafter   EAGLE-1/2 head: one decoder layer (or more) over the target's last hidden state (chapter 3)
    Eagle3Drafter  EAGLE-3 head: fused low/mid/high features, reduced draft vocabulary
    MedusaDrafter  Medusa heads: one residual block per future position on the last hidden state
    load_drafter   any of the heads from a checkpoint (official EAGLE layouts detected)
    TreeDrafter    the base of branching drafters: chains, static trees, EAGLE-2 dynamic trees;
                   TreeSpec says which shape to draft (chapters 4-5)
"""

from .base import Drafter, Vanilla
from .copying import CopyingDrafter
from .draft_model import DraftModel
from .eagle import EagleConfig, EagleDrafter, EagleHead, load_eagle
from .eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head, build_vocab_map, eagle3_layers
from .loader import load_drafter
from .medusa import MedusaDrafter, MedusaHeads
from .prompt_lookup import PromptLookup
from .tree_drafter import STATIC_TREES, TreeDrafter, TreeSpec

__all__ = ["CopyingDrafter", "Drafter", "DraftModel", "EagleConfig", "EagleDrafter", "EagleHead", "load_eagle", "Eagle3Config",
           "Eagle3Drafter", "Eagle3Head", "build_vocab_map", "eagle3_layers", "load_drafter", "MedusaDrafter",
           "MedusaHeads", "PromptLookup", "STATIC_TREES", "TreeDrafter", "TreeSpec", "Vanilla"]
