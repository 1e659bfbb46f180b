#!/usr/bin/env python3
"""Write each notebooks/NN_*.ipynb from its text source notebooks/NN_*.py (jupytext percent format).

    python tools/build_notebooks.py           write the notebooks (no outputs, execution_count null)
    python tools/build_notebooks.py --check   exit 1 if a committed .ipynb differs from its .py or has outputs

The .py files are the course text. Edit them in any editor, or edit either file in Jupyter with
jupytext installed (notebooks/jupytext.toml pairs them: saving writes both), then run this script
so that the committed .ipynb has no outputs. Run the notebooks with
``MINISPEC_FAST=1 python -m pytest --nbmake notebooks``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WRITE = "python tools/build_notebooks.py"


def build(src: Path):
    """The notebook of a text source: its cells, no outputs, stable cell ids."""
    import jupytext

    nb = jupytext.read(src)
    for i, cell in enumerate(nb.cells):
        cell.id = f"{src.name[:2]}-{i:02d}"  # stable ids: rewriting gives the same file
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return nb


def cells(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source) for c in nb.cells]


def problems(path: Path, expected) -> list[str]:
    """Why the committed notebook at `path` is not `expected` (cell types and sources) without outputs."""
    import jupytext

    if not path.exists():
        return ["is missing"]
    nb = jupytext.read(path)
    found, want, out = cells(nb), cells(expected), []
    if len(found) != len(want):
        out.append(f"has {len(found)} cells, its source notebooks/{path.stem}.py has {len(want)}")
    elif found != want:
        i = next(i for i, (a, b) in enumerate(zip(found, want)) if a != b)
        out.append(f"differs from its source notebooks/{path.stem}.py (first at cell {i}, counting from 0)")
    if any(c.cell_type == "code" and (c.get("outputs") or c.get("execution_count") is not None) for c in nb.cells):
        out.append("has outputs or execution counts")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a notebook differs from its text source")
    ap.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    args = ap.parse_args(argv)
    try:
        import jupytext
    except ImportError:
        print("jupytext is not installed: pip install -e '.[dev]' (or pip install jupytext)", file=sys.stderr)
        return 2
    folder = args.root / "notebooks"
    sources = sorted(folder.glob("[0-9][0-9]_*.py"))
    errors = [f"notebooks/{p.name} has no text source {p.stem}.py (jupytext --to py:percent notebooks/{p.name})"
              for p in sorted(folder.glob("[0-9][0-9]_*.ipynb")) if not p.with_suffix(".py").exists()]
    if not sources:
        errors.append(f"no notebooks/NN_*.py sources in {folder}")
    for src in sources:
        nb, path = build(src), src.with_suffix(".ipynb")
        if args.check:
            errors += [f"notebooks/{path.name} {why}; rewrite it with: {WRITE}" for why in problems(path, nb)]
            continue
        text = jupytext.writes(nb, fmt="ipynb")
        if not path.exists() or path.read_text(encoding="utf-8").rstrip("\n") != text.rstrip("\n"):
            jupytext.write(nb, path)
            print(f"wrote notebooks/{path.name}")
    for e in errors:
        print(e, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
