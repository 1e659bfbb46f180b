"""The method table (``minispec/drafters/defaults.py``) is the one source of methods: every name the
command line accepts has one row, and bench, tune, ``auto`` and the shipped checkpoints draw on it."""

import ast
from pathlib import Path

import pytest

import minispec
from minispec import auto, methods
from minispec.lab import bench
from minispec.drafters import TreeSpec, defaults

ROOT = Path(minispec.__file__).resolve().parent


def test_every_accepted_method_has_exactly_one_row():
    assert methods.METHOD_NAMES == tuple(defaults.TABLE)  # one row each (a dict: no name twice)
    for name in defaults.TABLE:
        spec = methods.parse_method(name)
        assert spec.base == name and spec.row is defaults.TABLE[name]
    for name, row in defaults.TABLE.items():  # @TREE exactly for the rows with a default tree
        if row.tree is None:
            with pytest.raises(ValueError, match="does not draft trees"):
                methods.parse_method(f"{name}@chain:2")
        else:
            assert methods.parse_method(f"{name}@chain:2").tree == TreeSpec.chain(2)
            TreeSpec.parse(row.tree)  # every default tree parses
    with pytest.raises(ValueError, match="unknown method"):
        methods.parse_method("eagle4")


def test_bench_tune_and_auto_draw_on_the_table():
    assert bench.METHODS == defaults.HF_METHODS + tuple(defaults.TABLE)
    assert auto.DEFAULT_CANDIDATES is defaults.DEFAULT_CANDIDATES
    assert auto.QUICK_CANDIDATES is defaults.QUICK_CANDIDATES
    for name in (*defaults.DEFAULT_CANDIDATES, *defaults.QUICK_CANDIDATES, defaults.DEFAULT_AUTO):
        assert methods.parse_method(name).base in defaults.TABLE
    assert methods.DRAFT_VOCAB == {"eagle": 8192, "eagle2": 8192, "copy": 8192, "medusa": 8192}
    assert {m: defaults.TABLE[m].head for m in methods.HEADS} == methods.HEADS


def test_default_trees_of_kinds_and_medusa():
    assert defaults.default_tree("eagle2") == "6,10,60" and defaults.default_tree("draft") == defaults.TABLE["sps"].tree
    assert defaults.default_tree("medusa") == "medusa" and defaults.default_tree("medusa", heads=5) == "medusa"
    assert defaults.default_tree("medusa", heads=3) == "chain:3"  # fewer heads than the static tree is deep
    assert TreeSpec.parse("medusa").depth == defaults.MEDUSA_TREE_HEADS
    with pytest.raises(ValueError, match="no default tree"):
        defaults.default_tree("pld")


def _constants(path: Path) -> set:
    return {n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant)}


def test_table_values_and_checkpoint_paths_live_in_the_table_only():
    """No other module spells a table-only value (eagle2's tree, auto's default, the candidates) or
    builds a path under ``checkpoints`` itself: they read ``defaults``."""
    only_here = {defaults.TABLE["eagle2"].tree, defaults.DEFAULT_AUTO, "checkpoints", *defaults.QUICK_CANDIDATES,
                 *defaults.DEFAULT_CANDIDATES} - set(defaults.TABLE)  # a bare method name is used everywhere
    offenders = {}
    for path in ROOT.rglob("*.py"):
        found = only_here & _constants(path)
        if path.relative_to(ROOT).parts[0] == "train":
            found -= {"6,10,60"}  # a trainer's evaluation lists the trees it measures
        if found and path.name != "defaults.py":
            offenders[str(path.relative_to(ROOT))] = sorted(found)
    assert not offenders
    assert str(defaults.shipped_head("eagle")).endswith("checkpoints/smollm2-135m-eagle.safetensors")
    assert defaults.shipped_head("eagle").is_file()
