"""Decoding methods by name: what ``bench``, ``tune`` and ``demo`` run.

    vanilla      no drafter: one target forward per token
    pld          prompt lookup (n-gram copy), chain of pld_k, verified as one-hot q
    sps          the distilled draft model: chain of k (or a tree, see below)
    eagle        EAGLE-1/2 head, chain of 5
    eagle2       EAGLE-1/2 head, dynamic tree 6,10,60 (EAGLE-2's depth, top_k, total_tokens)
                 (both draft over the 8192 most frequent tokens, ``DRAFT_VOCAB``; verification is
                 over the full vocabulary)
    eagle3       EAGLE-3 head, chain of 5 (a dynamic tree when one is given)
    medusa       Medusa heads, Medusa's static mc_sim_7b_63 tree
    copy         the context's own continuation where its last tokens occurred before (prompt lookup),
                 else the EAGLE-1/2 head as ``eagle`` (``drafters.copying.CopyingDrafter``)
    auto         the method ``python -m minispec tune`` saved for this machine, else ``DEFAULT_AUTO``

A branching method takes another tree as ``NAME@TREE``: ``sps@eagle`` (the EAGLE static tree),
``eagle2@5/8/32`` (a dynamic tree; '/' keeps commas free for method lists), ``eagle@chain:4``.
"""

from __future__ import annotations

from importlib import resources

from .drafters import DraftModel, PromptLookup, TreeSpec
from .drafters.copying import CopyingDrafter
from .drafters.registry import DEFAULT_TREES  # noqa: F401  (re-exported: the one table of default trees)

# methods that draft through the target's LM head over a frequency-ranked draft vocabulary (FR-Spec,
# minispec.drafters.vocab) unless told otherwise: K tokens
DRAFT_VOCAB = {"eagle": 8192, "eagle2": 8192, "copy": 8192}
# what ``auto`` means on a machine where ``python -m minispec tune`` has not run (minispec.dispatch.auto_method)
DEFAULT_AUTO = "eagle@chain:2"
PLAIN = ("vanilla", "pld")
METHOD_NAMES = PLAIN + tuple(DEFAULT_TREES) + ("auto",)
HEADS = {"eagle": "eagle", "eagle2": "eagle", "eagle3": "eagle3", "medusa": "medusa", "copy": "eagle"}  # method -> head


def parse_method(method: str) -> tuple[str, str | None]:
    """'eagle2@5/8/32' -> ('eagle2', '5/8/32'); raises ValueError on an unknown name or a tree on a
    method that cannot branch."""
    base, _, tree = method.strip().partition("@")
    if base not in METHOD_NAMES:
        raise ValueError(f"unknown method {base!r}; choose from {', '.join(METHOD_NAMES)} (with @TREE for "
                         f"{', '.join(DEFAULT_TREES)})")
    if tree and base not in DEFAULT_TREES:
        raise ValueError(f"method {base!r} does not draft trees; @{tree} applies to {', '.join(DEFAULT_TREES)}")
    if tree:
        TreeSpec.parse(tree)  # validates
    return base, tree or None


def shipped_head(kind: str, model_name: str = "smollm2-135m"):
    """Path of the head shipped in minispec/checkpoints for ``kind`` (eagle, eagle3, medusa)."""
    return resources.files("minispec").joinpath("checkpoints", f"{model_name}-{kind}.safetensors")


class Methods:
    """Builds the drafter of a method for one target, loading each draft model or head once.

    Args:
        target: the target Transformer.
        model_name: its name (selects the shipped checkpoints).
        k: chain length of ``sps``; pld_k: draft length of ``pld``.
        tree: a tree for branching methods given without ``@TREE`` (None: each method's default).
        draft_path: draft model checkpoint for ``sps`` (default: the shipped one).
        draft_model: a loaded draft Transformer for ``sps`` instead (e.g. the tiny presets in tests).
        drafter_path: a head checkpoint (file, directory or hub id) for eagle / eagle2 / eagle3 / medusa.
        draft_vocab: draft vocabulary of eagle / eagle2: None for ``DRAFT_VOCAB``'s default, 0 for the
            full vocabulary, K for the K most frequent tokens.
    """

    def __init__(self, target, model_name: str = "smollm2-135m", k: int = 4, pld_k: int = 8, tree=None,
                 draft_path=None, drafter_path=None, draft_model=None, draft_vocab: int | None = None):
        self.target, self.model_name, self.k, self.pld_k = target, model_name, k, pld_k
        self.tree = TreeSpec.parse(tree) if tree is not None else None
        self.draft_path, self.drafter_path = draft_path, drafter_path
        self._draft = draft_model
        if draft_vocab is not None and (not isinstance(draft_vocab, int) or draft_vocab < 0):
            raise ValueError(f"draft_vocab must be 0 (full vocabulary) or a positive number of tokens, got {draft_vocab!r}")
        self.draft_vocab = draft_vocab
        self._heads: dict[str, object] = {}  # method -> drafter (its prefill resets it for each generation)

    def tree_of(self, method: str) -> TreeSpec | None:
        base, tree = parse_method(method)
        if base not in DEFAULT_TREES:
            return None
        if tree is not None:
            return TreeSpec.parse(tree)
        if self.tree is not None:
            return self.tree
        return TreeSpec.parse(self.k if base == "sps" else DEFAULT_TREES[base])

    def drafter(self, method: str):
        """The drafter of ``method`` (None for vanilla); heads are loaded once and reused."""
        base, _ = parse_method(method)
        if base == "auto":
            raise ValueError("resolve 'auto' with minispec.dispatch.auto_method first")
        if base == "vanilla":
            return None
        if base == "pld":
            return PromptLookup(k=self.pld_k)
        spec = self.tree_of(method)
        if base == "sps":
            if self._draft is None:
                from .drafters.draft_checkpoint import load_draft_model

                self._draft = load_draft_model(self.target, self.draft_path)
            return DraftModel(self._draft, tree=spec)
        if method not in self._heads:
            from .drafters.loader import load_drafter

            path = self.drafter_path or shipped_head(HEADS[base], self.model_name)
            vocab = DRAFT_VOCAB.get(base) if self.draft_vocab is None else self.draft_vocab
            vocab = vocab if base in DRAFT_VOCAB and vocab and vocab < self.target.cfg.vocab_size else None
            head = load_drafter(str(path), self.target, tree=spec, verbose=False, draft_vocab=vocab)
            self._heads[method] = CopyingDrafter(head, k=self.pld_k) if base == "copy" else head
        return self._heads[method]
