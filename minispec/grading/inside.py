"""The learner's code inside minispec's decode loop: ``use_impl`` swaps three of the library's pieces
for an implementation's (the learner's ``exercises/``, the ``solutions/``, or any module) while a
``with`` block runs, so ``minispec.generate`` decodes a real model on them:

    chapter 2, exercise 2.4   verify_tree     the decode loop's verification of every step's tree
    chapter 4, exercise 4.2   tree_mask       ``Tree.mask``: the attention mask of every tree forward
    chapter 6, exercise 6.1   merge_partials  the log-sum-exp merge of the split attention backends

Only the chapters asked for are swapped (``chapters=(2, 4, 6)``). A stub that still raises
NotImplementedError raises it from inside ``generate``; everything is restored on exit, also after
an error.

    with use_impl("exercises", chapters=(4,)):
        mine = generate(model, tok, prompt, drafter=...)     # every tree mask built by your tree_mask
"""

from __future__ import annotations

import importlib
from contextlib import ExitStack, contextmanager
from unittest import mock

import torch

from .runner import load_impl

CHAPTERS = (2, 4, 6)


def _verify_tree(fn):
    """minispec.verify.verify_tree's signature (a ``Tree``) over a chapter 2 ``verify_tree(parents, tokens,
    p, q, mode, chooser) -> (path, next_token)``: greedy is verified as one-hot drafts against the
    one-hot p of the argmax (exactly greedy), a sampled chain as MSS with replacement over one child
    per node."""
    from ..sampling import probs
    from ..verify import TorchChooser, VerifyResult

    def verify_tree(tree, p, *, mode, generator=None, chooser=None, p_from_probs=False, params=None):
        ch = chooser if chooser is not None else TorchChooser(generator)
        q, tokens = tree.q, tree.tokens
        if params is not None and mode != "greedy":  # the decode loop passes logits and the sampling parameters
            p = probs(p, params)  # [N + 1, V]: every row, as chapter 2's signature takes them
        if mode == "greedy":  # p holds logits: the target's choice is their argmax
            p = torch.zeros(p.shape, dtype=torch.float64).scatter_(-1, p.argmax(-1, keepdim=True).cpu(), 1.0)
            mode, q = "onehot", None
        elif mode == "chain":
            mode = "mss_replacement"
        path, token = fn(list(tree.parents), list(tokens), p, q, mode, ch)
        path = [int(i) for i in path]
        return VerifyResult(path, int(token), [tokens[i] for i in path] + [int(token)])

    return verify_tree


def _merge(fn):
    """minispec.attention's ``merge(out_p, lse_p, out_s, lse_s, return_lse=False)`` over a chapter 6
    ``merge_partials(out_a, lse_a, out_b, lse_b) -> (out, lse)``."""
    def merge(out_p, lse_p, out_s, lse_s, return_lse=False):
        out, lse = fn(out_p, lse_p, out_s, lse_s)
        return (out, lse) if return_lse else out

    return merge


@contextmanager
def use_impl(impl="exercises", chapters=CHAPTERS):
    """Within the block, minispec decodes with ``impl``'s verify_tree (chapter 2), tree_mask (chapter 4)
    and merge_partials (chapter 6), for the chapters in ``chapters``.

    Args:
        impl: "exercises", "solutions", "minispec" or a module / object with the functions.
        chapters: which of 2, 4 and 6 to swap in.
    """
    unknown = set(chapters) - set(CHAPTERS)
    if unknown:
        raise ValueError(f"use_impl swaps chapters {CHAPTERS} only, got {sorted(unknown)}")
    from ..attention import paged, reference
    gen_module = importlib.import_module("minispec.generate")  # the module (the package's ``generate`` is the function)
    from ..tree import Tree

    with ExitStack() as stack:
        if 2 in chapters:
            stack.enter_context(mock.patch.object(gen_module, "verify_tree", _verify_tree(load_impl(2, impl).verify_tree)))
        if 4 in chapters:
            tree_mask = load_impl(4, impl).tree_mask
            stack.enter_context(mock.patch.object(Tree, "mask", lambda self: tree_mask(list(self.parents))))
        if 6 in chapters:
            merge = _merge(load_impl(6, impl).merge_partials)
            for module in (reference, paged):
                stack.enter_context(mock.patch.object(module, "merge", merge))
        yield


def decode_inside(run, reference: list[int], chapters=CHAPTERS, impls=("exercises", "solutions")) -> dict:
    """Run ``run()`` (a greedy decode returning tokens) under ``use_impl(impl, chapters)`` for each impl and
    print whether its tokens equal ``reference`` (vanilla's). Like ``check``, it reports and does not
    raise for the learner's file (a stub: "not implemented yet"); the solutions must match.

    Returns:
        {impl: True (identical), False (differs) or None (not implemented yet)}.
    """
    names = {2: "verify_tree", 4: "tree_mask", 6: "merge_partials"}
    what = ", ".join(f"ch{c:02d}'s {names[c]}" for c in chapters)
    out = {}
    for impl in impls:
        try:
            with use_impl(impl, chapters):
                tokens = list(run())
        except NotImplementedError as e:
            print(f"{impl}: not implemented yet ({e})")
            out[impl] = None
            continue
        out[impl] = tokens == list(reference)
        first = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
        print(f"{impl}: {len(tokens)} tokens decoded on {what}: " +
              ("identical to vanilla" if out[impl] else f"DIFFERS from vanilla from token {first}"))
        if impl == "solutions" and not out[impl]:
            raise AssertionError(f"the solutions' {what} changed the greedy output")
    return out
