"""The one registry of drafting methods and their default trees.

``bench``, ``tune``, ``demo`` and ``methods.Methods`` choose trees through ``minispec.methods``,
which reads ``DEFAULT_TREES``; the drafters' constructors and ``load_drafter`` read the same table
through ``default_tree``, so a head loaded by hand drafts what ``--methods eagle3`` drafts.

Trees are ``TreeSpec`` strings (``minispec.drafters.tree_drafter``): ``chain:K``, a static tree
name, or a dynamic tree ``D,K,N`` (upstream EAGLE-2: depth D - 1, top_k K, total_token N + 1).
"""

from __future__ import annotations

DEFAULT_TREES = {"sps": "chain:4", "eagle": "chain:5", "eagle2": "6,10,60", "eagle3": "chain:5", "medusa": "medusa",
                 "copy": "chain:5"}
"""method -> the tree it drafts unless given ``NAME@TREE``."""

KIND_METHOD = {"draft": "sps", "eagle": "eagle", "eagle3": "eagle3", "medusa": "medusa"}
"""checkpoint kind (``loader.detect``) -> the method whose default tree a loaded drafter takes."""


def default_tree(name: str) -> str:
    """The default tree of a method (``eagle2``) or a checkpoint kind (``draft``)."""
    method = KIND_METHOD.get(name, name)
    if method not in DEFAULT_TREES:
        raise ValueError(f"no default tree for {name!r}; known: {', '.join(DEFAULT_TREES)} and kinds "
                         f"{', '.join(KIND_METHOD)}")
    return DEFAULT_TREES[method]
