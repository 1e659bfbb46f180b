"""The method table: every decoding method by name, what it loads, drafts and how ``auto`` resolves.

One row per method (``TABLE``). ``minispec.methods`` parses names against it and builds the
drafters; ``bench``, ``tune`` and ``demo`` take their method lists and candidates from it; the
drafters' constructors and ``load_drafter`` read their default trees from it (``default_tree``),
so a head loaded by hand drafts what ``--methods eagle3`` drafts. It imports nothing: the drafters
sit above it and ``methods`` above them, so the table has to live at the bottom to be read by both.

Trees are ``TreeSpec`` strings (``minispec.drafters.tree_drafter``): ``chain:K``, a static tree
name, or a dynamic tree ``D,K,N`` (upstream EAGLE-2: depth D - 1, top_k K, total_token N + 1).
The shipped checkpoints (``minispec/checkpoints``) are named here too (``shipped``).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources


@dataclass(frozen=True)
class Row:
    """One method of the table.

    head: the checkpoint kind it loads (``loader.detect``: draft, eagle, eagle3, medusa); None: no model.
    tree: the tree it drafts unless given ``NAME@TREE``; None: it does not branch.
    draft_vocab: K: it drafts through the target's LM head over the K most frequent tokens (FR-Spec,
        ``minispec.drafters.vocab``) unless told otherwise; None: the full vocabulary (EAGLE-3 drafts over
        the reduced vocabulary its head was trained with, d2t).
    """

    head: str | None = None
    tree: str | None = None
    draft_vocab: int | None = None


TABLE = {
    "vanilla": Row(),  # no drafter: one target forward per token
    "pld": Row(),  # prompt lookup (n-gram copy), chain of pld_k, verified as one-hot q
    "sps": Row("draft", "chain:4"),  # the distilled draft model (its chain length is Methods' k)
    "eagle": Row("eagle", "chain:5", 8192),
    "eagle2": Row("eagle", "6,10,60", 8192),  # EAGLE-2's dynamic tree: depth, top_k, total_tokens
    "eagle3": Row("eagle3", "chain:5"),  # EAGLE-3 drafts over its own reduced vocabulary (d2t)
    "medusa": Row("medusa", "medusa", 8192),  # Medusa's static mc_sim_7b_63 tree (see MEDUSA_TREE_HEADS)
    "copy": Row("eagle", "chain:5", 8192),  # the context's continuation where it repeats, else the EAGLE-1/2 head
    "auto": Row(),  # resolved before it runs: see DEFAULT_AUTO below
}

HF_METHODS = ("hf", "hf_assisted", "hf_pld")
"""transformers' baselines: ``bench`` runs them beside the table's methods (``minispec.lab.bench``)."""

# --- how ``auto`` resolves (minispec.auto): a saved ``tune`` choice for this machine, else a quick
# calibration over QUICK_CANDIDATES (batch 1), else DEFAULT_AUTO; ``tune`` tries DEFAULT_CANDIDATES
DEFAULT_AUTO = "eagle@chain:2"
QUICK_CANDIDATES = ("copy@chain:2", "copy", "eagle2@4/4/12")
"""The quick calibration's candidates: a short chain, a long one and a small tree. Each chain is a ``copy``: it drafts
as ``eagle@chain:K`` wherever the context does not repeat and copies where it does, so ``eagle@chain:K`` beside it
would add a near tie that a few sampled calibration tokens break at random; ``chain:3`` beside ``chain:2`` was
another (``benchmarks/calibration_fidelity.py --versus``, "Fewer, distinct quick candidates" in docs/results.md)."""
DEFAULT_CANDIDATES = ("vanilla", "pld", "copy", "sps", "sps@eagle", "sps@4/4/12", "eagle", "eagle@chain:3", "eagle2@4/4/12",
                      "eagle2@5/8/32", "eagle2", "eagle3", "eagle3@5/8/32", "medusa")

HEAD_DTYPE_PROBE = "eagle@chain:2"
"""What ``tune`` times in each head dtype (``dispatch.head_dtype_costs``) to choose the one every EAGLE-1/2
candidate drafts in (``NAME+bf16``, ``minispec.methods``)."""

MEDUSA_TREE_HEADS = 4
"""Medusa heads a ``medusa`` tree needs; a checkpoint with fewer drafts a chain as deep as its heads."""

DEFAULT_TREES = {m: r.tree for m, r in TABLE.items() if r.tree is not None}
"""method -> the tree it drafts unless given ``NAME@TREE`` (the branching methods)."""

KIND_METHOD = {"draft": "sps", "eagle": "eagle", "eagle3": "eagle3", "medusa": "medusa"}
"""checkpoint kind (``loader.detect``) -> the method whose default tree a loaded drafter takes."""


def default_tree(name: str, heads: int | None = None) -> str:
    """The default tree of a method (``eagle2``) or a checkpoint kind (``draft``); ``heads``: a Medusa
    checkpoint's head count (fewer than ``MEDUSA_TREE_HEADS``: a chain as deep as its heads)."""
    method = KIND_METHOD.get(name, name)
    if method not in DEFAULT_TREES:
        raise ValueError(f"no default tree for {name!r}; known: {', '.join(DEFAULT_TREES)} and kinds "
                         f"{', '.join(KIND_METHOD)}")
    if method == "medusa" and heads is not None and heads < MEDUSA_TREE_HEADS:
        return f"chain:{heads}"
    return DEFAULT_TREES[method]


def shipped(name: str):
    """The file ``minispec/checkpoints/NAME.safetensors`` (a ``Traversable``; its ``.json`` lies beside
    it): the one place a shipped checkpoint's path is built."""
    return resources.files("minispec").joinpath("checkpoints", f"{name}.safetensors")


def shipped_head(kind: str, model_name: str = "smollm2-135m"):
    """The checkpoint shipped for ``model_name`` of a kind: ``draft``, ``eagle``, ``eagle3``, ``medusa``
    (or ``token-counts``, the FR-Spec counts)."""
    return shipped(f"{model_name}-{kind}")


SHIPPED_KINDS = ("draft", "eagle", "eagle3", "medusa", "token-counts")


def shipped_fingerprint(model_name: str = "smollm2-135m") -> str:
    """A short hash of every checkpoint shipped for ``model_name`` (the ``SHIPPED_KINDS`` present): it
    changes when a release ships another head, so a choice measured with the old ones (``auto``'s
    calibration) can tell it is stale. "" when none is shipped."""
    import hashlib

    h = hashlib.sha256()
    for kind in SHIPPED_KINDS:
        f = shipped_head(kind, model_name)
        if f.is_file():
            h.update(kind.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16] if h.digest() != hashlib.sha256().digest() else ""
