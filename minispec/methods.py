"""Decoding methods by name: what ``bench``, ``tune`` and ``demo`` run.

    vanilla      no drafter: one target forward per token
    pld          prompt lookup (n-gram copy), chain of pld_k, verified as one-hot q
    sps          the distilled draft model: chain of k (or a tree, see below)
    eagle        EAGLE-1/2 head, chain of 5
    eagle2       EAGLE-1/2 head, dynamic tree 6,10,60 (EAGLE-2's depth, top_k, total_tokens)
    eagle3       EAGLE-3 head, chain of 5 (a dynamic tree when one is given)
    medusa       Medusa heads, Medusa's static mc_sim_7b_63 tree
    copy         the context's own continuation where its last tokens occurred before (prompt lookup),
                 else the EAGLE-1/2 head as ``eagle`` (``drafters.copying.CopyingDrafter``)
    auto         the method ``python -m minispec tune`` saved for this machine, else ``DEFAULT_AUTO``

eagle, eagle2, copy and medusa draft over the 8192 most frequent tokens (FR-Spec, ``DRAFT_VOCAB``);
verification is over the full vocabulary, so decoding stays lossless.

A branching method takes another tree as ``NAME@TREE``: ``sps@eagle`` (the EAGLE static tree),
``eagle2@5/8/32`` (a dynamic tree; '/' keeps commas free for method lists), ``eagle@chain:4``.
A method that drafts with the EAGLE-1/2 head (eagle, eagle2, copy) takes ``+DTYPE`` before the tree:
``eagle+bf16@chain:2`` drafts with a bfloat16 copy of the head and of the LM-head rows it reads
(``EagleDrafter(head_dtype=...)``; ``+f32``: float32); without one the head computes in the target's dtype.
The output is the same, only the draft's cost and acceptance can differ, so ``tune`` (and ``auto``'s
calibration) times the head in both and drafts in the faster (``dispatch.head_dtype_costs``).

The table itself (head, default tree, draft vocabulary, Medusa's default, ``auto``'s candidates)
is ``TABLE`` in ``drafters/defaults.py``, re-exported here: it sits below the drafters, which read
their default trees from it. A name is parsed once (``parse_method``) into a ``MethodSpec`` that
goes unchanged to ``Methods.drafter``; ``auto`` is resolved by ``minispec.auto.resolve``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .drafters import DraftModel, PromptLookup, TreeSpec, load_drafter
from .drafters.copying import CopyingDrafter
from .drafters.draft_checkpoint import load_draft_model
from .drafters.defaults import (DEFAULT_AUTO, DEFAULT_TREES, HF_METHODS, TABLE, Row, shipped_head)  # noqa: F401  (re-exported)

# methods that draft through the target's LM head over a frequency-ranked draft vocabulary (FR-Spec)
DRAFT_VOCAB = {m: r.draft_vocab for m, r in TABLE.items() if r.draft_vocab}
PLAIN = tuple(m for m, r in TABLE.items() if r.tree is None and m != "auto")
METHOD_NAMES = tuple(TABLE)
HEADS = {m: r.head for m, r in TABLE.items() if r.head not in (None, "draft")}  # method -> head checkpoint kind
HEAD_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}  # NAME+DTYPE: the EAGLE-1/2 head drafts in this dtype
CASTABLE = tuple(m for m, r in TABLE.items() if r.head == "eagle")  # the methods that take +DTYPE


@dataclass(frozen=True)
class MethodSpec:
    """A method as asked for, parsed once.

    name: as given, e.g. 'eagle2@5/8/32' (tables and the drafter cache key on it).
    base: its row of ``TABLE``, e.g. 'eagle2'.
    tree: the tree given with ``@TREE``; None: the default one (``Methods.tree_of``).
    head_dtype: the key of ``HEAD_DTYPES`` given with ``+DTYPE`` ('bf16', 'f32'); None: the target's dtype.
    """

    name: str
    base: str
    tree: TreeSpec | None = None
    head_dtype: str | None = None

    @property
    def row(self) -> Row:
        return TABLE[self.base]


def parse_method(method: "str | MethodSpec") -> MethodSpec:
    """'eagle2@5/8/32' -> MethodSpec('eagle2@5/8/32', 'eagle2', the 5/8/32 tree); 'eagle+bf16@chain:2' ->
    MethodSpec(.., 'eagle', chain 2, 'bf16'). Raises ValueError on an unknown name, an unknown tree, a tree
    on a method that cannot branch, or a head dtype on a method without an EAGLE-1/2 head."""
    if isinstance(method, MethodSpec):
        return method
    base, _, tree = method.strip().partition("@")
    base, plus, dtype = base.partition("+")
    if base not in TABLE:
        raise ValueError(f"unknown method {base!r}; choose from {', '.join(METHOD_NAMES)} (with @TREE for "
                         f"{', '.join(DEFAULT_TREES)})")
    if tree and base not in DEFAULT_TREES:
        raise ValueError(f"method {base!r} does not draft trees; @{tree} applies to {', '.join(DEFAULT_TREES)}")
    if plus:
        if base not in CASTABLE:
            raise ValueError(f"method {base!r} has no EAGLE-1/2 head to cast; +{dtype} applies to {', '.join(CASTABLE)}")
        if dtype not in HEAD_DTYPES:
            raise ValueError(f"unknown head dtype +{dtype} in {method.strip()!r}; choose from "
                             f"{', '.join('+' + d for d in HEAD_DTYPES)}")
    return MethodSpec(method.strip(), base, TreeSpec.parse(tree) if tree else None, dtype or None)


def with_head_dtype(method: "str | MethodSpec", dtype: str) -> str:
    """'copy@chain:2', 'bf16' -> 'copy+bf16@chain:2': the method with its EAGLE-1/2 head in ``dtype`` (a key of
    ``HEAD_DTYPES``). A method without that head, or one that names its dtype already, comes back as it is."""
    spec = parse_method(method)
    if spec.base not in CASTABLE or spec.head_dtype is not None:
        return spec.name
    tree = spec.name.partition("@")[2]
    return parse_method(f"{spec.base}+{dtype}" + (f"@{tree}" if tree else "")).name  # parse_method checks dtype


def parse_methods(methods) -> list[MethodSpec]:
    """A comma list (or a sequence) of names, each parsed once; ``HF_METHODS`` are left to ``bench``."""
    names = [m.strip() for m in methods.split(",")] if isinstance(methods, str) else list(methods)
    return [parse_method(m) for m in names if m and m not in HF_METHODS]


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
        draft_vocab: draft vocabulary of the methods in ``DRAFT_VOCAB`` (eagle, eagle2, copy, medusa): None
            for ``DRAFT_VOCAB``'s default, 0 for the full vocabulary, K for the K most frequent tokens.
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

    def tree_of(self, method: "str | MethodSpec") -> TreeSpec | None:
        """The tree ``method`` drafts: its ``@TREE``, else this builder's ``tree``, else the table's
        (``sps``: a chain of ``k``); None for a method that does not branch."""
        spec = parse_method(method)
        if spec.base not in DEFAULT_TREES:
            return None
        if spec.tree is not None:
            return spec.tree
        if self.tree is not None:
            return self.tree
        return TreeSpec.parse(self.k if spec.base == "sps" else spec.row.tree)

    def drafter(self, method: "str | MethodSpec"):
        """The drafter of ``method`` (None for vanilla); heads are loaded once and reused."""
        spec = parse_method(method)
        if spec.base == "auto":
            raise ValueError("resolve 'auto' with minispec.auto.resolve first")
        if spec.base == "vanilla":
            return None
        if spec.base == "pld":
            return PromptLookup(k=self.pld_k)
        if spec.base == "sps":
            if self._draft is None:
                self._draft = load_draft_model(self.target, self.draft_path)
            return DraftModel(self._draft, tree=self.tree_of(spec))
        if spec.name not in self._heads:
            self._heads[spec.name] = self._load_head(spec)
        return self._heads[spec.name]

    def _vocab(self, spec: MethodSpec) -> int | None:
        """The draft vocabulary of a head method: this builder's, else the table's; None when the
        method drafts over the full vocabulary (or K would not reduce it)."""
        vocab = spec.row.draft_vocab if self.draft_vocab is None else self.draft_vocab
        return vocab if spec.row.draft_vocab and vocab and vocab < self.target.cfg.vocab_size else None

    def _load_head(self, spec: MethodSpec):
        path = self.drafter_path or shipped_head(spec.row.head, self.model_name)
        head = load_drafter(str(path), self.target, tree=self.tree_of(spec), verbose=False, draft_vocab=self._vocab(spec),
                            head_dtype=HEAD_DTYPES.get(spec.head_dtype))
        return CopyingDrafter(head, k=self.pld_k) if spec.base == "copy" else head
