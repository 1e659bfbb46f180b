#!/usr/bin/env python3
"""Generate exercises/chNN_*.py from solutions/chNN_*.py, or check that they are in sync.

    python tools/make_exercises.py            write exercises/ from solutions/
    python tools/make_exercises.py --check    exit 1 (and say which file) if exercises/ is stale

In a solution file each exercise is a function body of the form

        # EXERCISE 1.2: <short task>
        # BEGIN SOLUTION
        <reference code>
        # END SOLUTION

The generated exercise keeps everything else (signature, docstring, the EXERCISE comment) and
replaces the BEGIN..END block by ``raise NotImplementedError("Exercise 1.2: <short task>")``
at the block's indentation. Standard library only (the pre-stop hook runs it with python3).
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATTERN = "ch[0-9][0-9]_*.py"
EXERCISE = re.compile(r"^(\s*)# EXERCISE (\d+\.\d+):\s*(\S.*?)\s*$")
BEGIN = re.compile(r"^(\s*)# BEGIN SOLUTION\s*$")
END = re.compile(r"^(\s*)# END SOLUTION\s*$")


class FormatError(ValueError):
    pass


def header(name: str) -> str:
    return (f"# Exercises generated from solutions/{name} by tools/make_exercises.py.\n"
            f"# Replace each `raise NotImplementedError(...)` with your code; keep the signatures.\n")


def make_exercise(source: str, name: str = "<solution>") -> tuple[str, list[str]]:
    """Return (exercise text, exercise ids) for one solution file's text."""
    out, ids, pending = [], [], None  # pending: (id, task, indent) of the last EXERCISE marker
    lines = source.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line = lines[i]
        if m := EXERCISE.match(line):
            if pending:
                raise FormatError(f"{name}:{i + 1}: EXERCISE {m[2]} follows EXERCISE {pending[0]} with no solution block")
            if m[2] in ids:
                raise FormatError(f"{name}:{i + 1}: EXERCISE {m[2]} appears twice")
            pending = (m[2], m[3], m[1])
            out.append(line)
        elif m := BEGIN.match(line):
            if not pending:
                raise FormatError(f"{name}:{i + 1}: BEGIN SOLUTION without an '# EXERCISE N.M: task' line before it")
            ex_id, task, indent = pending
            if m[1] != indent:
                raise FormatError(f"{name}:{i + 1}: BEGIN SOLUTION is not indented like its EXERCISE {ex_id} line")
            j = i + 1
            while j < len(lines) and not END.match(lines[j]):
                if BEGIN.match(lines[j]) or EXERCISE.match(lines[j]):
                    raise FormatError(f"{name}:{j + 1}: solution block of exercise {ex_id} (line {i + 1}) is not closed")
                j += 1
            if j == len(lines):
                raise FormatError(f"{name}:{i + 1}: BEGIN SOLUTION of exercise {ex_id} has no END SOLUTION")
            task_literal = f"Exercise {ex_id}: {task}".replace("\\", "\\\\").replace('"', '\\"')
            out.append(f'{indent}raise NotImplementedError("{task_literal}")\n')
            ids.append(ex_id)
            pending = None
            i = j
        elif END.match(line):
            raise FormatError(f"{name}:{i + 1}: END SOLUTION without BEGIN SOLUTION")
        else:
            out.append(line)
        i += 1
    if pending:
        raise FormatError(f"{name}: EXERCISE {pending[0]} has no BEGIN SOLUTION block")
    return header(name) + "".join(out), ids


def expected(root: Path) -> dict[str, str]:
    """{exercise file name: generated text} for every solutions/chNN_*.py under root."""
    files = sorted((root / "solutions").glob(PATTERN))
    if not files:
        raise FormatError(f"no solutions/{PATTERN} files under {root}")
    return {f.name: make_exercise(f.read_text(encoding="utf-8"), f.name)[0] for f in files}


def check(root: Path) -> list[str]:
    """Problems that make exercises/ out of sync with solutions/ (empty when in sync)."""
    want = expected(root)
    ex_dir = root / "exercises"
    problems = []
    for name, text in want.items():
        path = ex_dir / name
        if not path.exists():
            problems.append(f"exercises/{name} is missing")
            continue
        have = path.read_text(encoding="utf-8")
        if have != text:
            diff = difflib.unified_diff(text.splitlines(), have.splitlines(), f"generated/{name}",
                                        f"exercises/{name}", n=0, lineterm="")
            first = [d for d in diff if d.startswith(("+", "-")) and not d.startswith(("+++", "---"))][:4]
            problems.append(f"exercises/{name} differs from what solutions/{name} generates:\n    "
                            + "\n    ".join(first))
    for path in sorted(ex_dir.glob(PATTERN)):
        if path.name not in want:
            problems.append(f"exercises/{path.name} has no solutions/{path.name}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 if exercises/ is out of sync")
    ap.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    args = ap.parse_args(argv)
    try:
        if args.check:
            problems = check(args.root)
            if problems:
                print("exercises/ is out of sync with solutions/:\n  " + "\n  ".join(problems)
                      + "\nRun `python tools/make_exercises.py` to regenerate.", file=sys.stderr)
                return 1
            print(f"exercises/ in sync with solutions/ ({len(expected(args.root))} files)")
            return 0
        (args.root / "exercises").mkdir(exist_ok=True)
        for name, text in expected(args.root).items():
            path = args.root / "exercises" / name
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                path.write_text(text, encoding="utf-8")
                print(f"wrote exercises/{name}")
        return 0
    except FormatError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
