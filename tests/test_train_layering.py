"""The runtime imports nothing from training: no module of minispec outside ``minispec/train`` imports
``minispec.train`` (absolute or relative), except the tooling that runs trainers or grades their losses."""

import ast
from pathlib import Path

import minispec

ROOT = Path(minispec.__file__).resolve().parent
TOOLING = {"cli.py", "grading"}  # `python -m minispec train ...` dispatches there; grading checks eagle_loss


def _imports_train(path: Path) -> list[str]:
    pkg = path.relative_to(ROOT.parent).with_suffix("").parts[:-1]  # ("minispec", "drafters") for drafters/x.py
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(pkg[:len(pkg) - node.level + 1]) if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            names = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        found += [n for n in names if n == "minispec.train" or n.startswith("minispec.train.")]
    return found


def test_no_runtime_module_imports_training_code():
    offenders = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("train", *TOOLING) or str(rel) in TOOLING:
            continue
        if hits := _imports_train(path):
            offenders[str(rel)] = hits
    assert not offenders


def test_the_walk_sees_relative_imports(tmp_path):
    assert _imports_train(ROOT / "grading" / "ch03.py")  # `from minispec.train import eagle`
    assert _imports_train(ROOT / "train" / "eagle.py")  # `from . import ddp, loop` inside minispec.train
