"""The method table (``minispec/drafters/registry.py``) is the one source of methods: every name the
command line accepts has one row, and bench, tune, ``auto`` and the shipped checkpoints draw on it."""

import ast
from pathlib import Path

import pytest

import minispec
from minispec import dispatch, methods
from minispec.lab import bench
from minispec.drafters import TreeSpec, registry

ROOT = Path(minispec.__file__).resolve().parent


def test_every_accepted_method_has_exactly_one_row():
    assert methods.METHOD_NAMES == tuple(registry.TABLE)  # one row each (a dict: no name twice)
    for name in registry.TABLE:
        spec = methods.parse_method(name)
        assert spec.base == name and spec.row is registry.TABLE[name]
    for name, row in registry.TABLE.items():  # @TREE exactly for the rows with a default tree
        if row.tree is None:
            with pytest.raises(ValueError, match="does not draft trees"):
                methods.parse_method(f"{name}@chain:2")
        else:
            assert methods.parse_method(f"{name}@chain:2").tree == TreeSpec.chain(2)
            TreeSpec.parse(row.tree)  # every default tree parses
    with pytest.raises(ValueError, match="unknown method"):
        methods.parse_method("eagle4")


def test_bench_tune_and_auto_draw_on_the_table():
    assert bench.METHODS == registry.HF_METHODS + tuple(registry.TABLE)
    assert dispatch.DEFAULT_CANDIDATES is registry.DEFAULT_CANDIDATES
    assert dispatch.QUICK_CANDIDATES is registry.QUICK_CANDIDATES
    for name in (*registry.DEFAULT_CANDIDATES, *registry.QUICK_CANDIDATES, registry.DEFAULT_AUTO):
        assert methods.parse_method(name).base in registry.TABLE
    assert methods.DRAFT_VOCAB == {"eagle": 8192, "eagle2": 8192, "copy": 8192, "medusa": 8192}
    assert {m: registry.TABLE[m].head for m in methods.HEADS} == methods.HEADS


def test_default_trees_of_kinds_and_medusa():
    assert registry.default_tree("eagle2") == "6,10,60" and registry.default_tree("draft") == registry.TABLE["sps"].tree
    assert registry.default_tree("medusa") == "medusa" and registry.default_tree("medusa", heads=5) == "medusa"
    assert registry.default_tree("medusa", heads=3) == "chain:3"  # fewer heads than the static tree is deep
    assert TreeSpec.parse("medusa").depth == registry.MEDUSA_TREE_HEADS
    with pytest.raises(ValueError, match="no default tree"):
        registry.default_tree("pld")


def _constants(path: Path) -> set:
    return {n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant)}


def test_table_values_and_checkpoint_paths_live_in_the_table_only():
    """No other module spells a table-only value (eagle2's tree, auto's default, the candidates) or
    builds a path under ``checkpoints`` itself: they read ``registry``."""
    only_here = {registry.TABLE["eagle2"].tree, registry.DEFAULT_AUTO, "checkpoints", *registry.QUICK_CANDIDATES,
                 *registry.DEFAULT_CANDIDATES} - set(registry.TABLE)  # a bare method name is used everywhere
    offenders = {}
    for path in ROOT.rglob("*.py"):
        found = only_here & _constants(path)
        if path.relative_to(ROOT).parts[0] == "train":
            found -= {"6,10,60"}  # a trainer's evaluation lists the trees it measures
        if found and path.name != "registry.py":
            offenders[str(path.relative_to(ROOT))] = sorted(found)
    assert not offenders
    assert str(registry.shipped_head("eagle")).endswith("checkpoints/smollm2-135m-eagle.safetensors")
    assert registry.shipped_head("eagle").is_file()
