"""Run the exercise checks on an implementation: ``grade``, ``check`` (notebooks), ``grade_main`` (CLI).

Implementations (``impl``):
    "minispec"   the library's own functions behind the exercises' signatures (an adapter)
    "solutions"  solutions/chNN_*.py, the reference answers
    "exercises"  exercises/chNN_*.py, the learner's work (stubs until filled in)
or any module / object with the exercise functions as attributes. The default comes from the
MINISPEC_IMPL environment variable (pytest's ``--impl`` sets the same choice for the tests).

Chapter N's checks live in ``minispec.grading.chNN`` (``TITLE``, ``MODULE``, ``EXERCISES``,
``library()``); adding a chapter means adding that module.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

IMPLS = ("minispec", "solutions", "exercises")
ENV = "MINISPEC_IMPL"


def default_impl(fallback: str = "exercises") -> str:
    """$MINISPEC_IMPL if set (validated), else ``fallback``."""
    impl = os.environ.get(ENV, "").strip() or fallback
    if impl not in IMPLS:
        raise ValueError(f"{ENV}={impl!r}: choose one of {', '.join(IMPLS)}")
    return impl


def chapter_module(chapter: int | str) -> ModuleType:
    """minispec.grading.chNN for chapter N."""
    try:
        n = int(str(chapter).split(".")[0])
        return importlib.import_module(f"minispec.grading.ch{n:02d}")
    except (ValueError, ModuleNotFoundError):
        raise ValueError(f"no graded exercises for chapter {chapter!r}; chapters with exercises: "
                         f"{', '.join(map(str, chapters()))}") from None


def chapters() -> list[int]:
    """Chapters that have a minispec.grading.chNN module."""
    here = Path(__file__).parent
    return sorted(int(f.stem[2:]) for f in here.glob("ch[0-9][0-9].py"))


def _repo_root(package: str) -> Path | None:
    """The directory holding ``package/`` (solutions or exercises): the cwd or a parent, or the checkout."""
    cwd = Path.cwd().resolve()
    for d in [cwd, *cwd.parents, Path(__file__).resolve().parents[2]]:
        if (d / package / "__init__.py").exists():
            return d
    return None


def load_impl(chapter: int | str, impl=None, reload: bool = True):
    """The implementation of chapter ``chapter``'s exercises.

    Args:
        chapter: chapter number.
        impl: "minispec", "solutions", "exercises" (default $MINISPEC_IMPL or "exercises"), or a
            module / object with the exercise functions.
        reload: re-import solutions/exercises files so edits made since the last import count.
    Returns:
        A module or namespace with the chapter's exercise functions.
    """
    spec = chapter_module(chapter)
    impl = default_impl() if impl is None else impl
    if not isinstance(impl, str):
        return impl
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if impl == "minispec":
        return spec.library()
    if importlib.util.find_spec(impl) is None:
        root = _repo_root(impl)
        if root is None:
            raise ImportError(f"cannot find the {impl}/ package: run from the minispec checkout (the folder with "
                              f"{impl}/ and tools/) or put it on PYTHONPATH")
        sys.path.insert(0, str(root))
        importlib.invalidate_caches()
    name = f"{impl}.{spec.MODULE}"
    if reload and name in sys.modules:
        return importlib.reload(sys.modules[name])
    return importlib.import_module(name)


def find_exercise(ex_id: str):
    """The Exercise with id "N.M"."""
    for ex in chapter_module(ex_id).EXERCISES:
        if ex.id == ex_id:
            return ex
    ids = [e.id for e in chapter_module(ex_id).EXERCISES]
    raise ValueError(f"no exercise {ex_id!r}; chapter {ex_id.split('.')[0]} has {', '.join(ids)}")


def grade(chapter: int | str, impl="exercises") -> list[tuple[str, str, bool, str]]:
    """Run every check of a chapter.

    Args:
        chapter: chapter number.
        impl: see ``load_impl``.
    Returns:
        [(exercise id, function name, passed, message)], in exercise order. Never raises for a
        failing exercise; an implementation that cannot be imported fails every exercise.
    """
    spec = chapter_module(chapter)
    try:
        mod = load_impl(chapter, impl)
    except Exception as e:  # e.g. a syntax error in the learner's file
        msg = f"could not import the implementation: {type(e).__name__}: {e}"
        return [(ex.id, ex.name, False, f"{ex.prefix}: {msg}") for ex in spec.EXERCISES]
    return [(ex.id, ex.name, *ex.run(mod)) for ex in spec.EXERCISES]


def assert_passes(ex_id: str, impl=None) -> None:
    """Run one exercise's check; raise AssertionError "Exercise N.M name: ..." if it fails (for pytest)."""
    ex = find_exercise(ex_id)
    try:
        mod = load_impl(ex_id, impl, reload=False)
    except Exception as e:
        raise AssertionError(f"{ex.prefix}: could not import the implementation: {type(e).__name__}: {e}") from None
    ex(mod)


def _impl_label(chapter, impl) -> str:
    if not isinstance(impl, str):
        return getattr(impl, "__name__", type(impl).__name__)
    if impl == "minispec":
        return "minispec (the library's own functions)"
    return f"{impl}/{chapter_module(chapter).MODULE}.py"


def format_table(chapter, results, impl) -> str:
    """A per-exercise PASS/FAIL table with a total line."""
    spec = chapter_module(chapter)
    lines = [f"Chapter {int(chapter)}: {spec.TITLE}", f"implementation: {_impl_label(chapter, impl)}", ""]
    w = max(len(name) for _, name, _, _ in results)
    for ex_id, name, ok, msg in results:
        detail = "" if ok else "  " + msg.split(": ", 1)[-1]
        lines.append(f"  {ex_id:<5} {name:<{w}}  {'PASS' if ok else 'FAIL'}{detail}")
    passed = sum(ok for _, _, ok, _ in results)
    lines += ["", f"{passed}/{len(results)} exercises passed"]
    return "\n".join(lines)


def check(which: str | int, impl=None) -> None:
    """Notebook feedback: grade one exercise ("1.2") or a whole chapter ("1" or 1) and print the result.

    Never raises for a failing exercise (a stub just reports "not implemented yet").

    Args:
        which: "N.M" for one exercise, or a chapter number.
        impl: see ``load_impl``; default $MINISPEC_IMPL or "exercises".
    """
    impl = default_impl() if impl is None else impl
    if "." not in str(which):
        print(format_table(which, grade(which, impl), impl))
        return
    ex = find_exercise(str(which))
    try:
        ok, msg = ex.run(load_impl(which, impl))
    except Exception as e:
        ok, msg = False, f"{ex.prefix}: could not import the implementation: {type(e).__name__}: {e}"
    if ok:
        print(f"PASS  {msg}  [{_impl_label(which, impl)}]")
    else:
        print(f"FAIL  {msg}\n      [{_impl_label(which, impl)}: edit it and run this cell again]")


def grade_main(argv: list[str] | None = None) -> int:
    """``python -m minispec grade N [--impl exercises|solutions|minispec]``: print the table.

    Returns:
        0 if every exercise passed, 1 otherwise (2 for a bad chapter or impl).
    """
    ap = argparse.ArgumentParser(prog="python -m minispec grade",
                                 description="Grade a chapter's exercises and print a per-exercise PASS/FAIL table.")
    ap.add_argument("chapter", help=f"chapter number ({', '.join(map(str, chapters()))}) or 'all'")
    ap.add_argument("--impl", choices=IMPLS, default=None,
                    help=f"what to grade (default ${ENV} or 'exercises')")
    args = ap.parse_args(argv)
    try:
        impl = args.impl or default_impl()
        todo = chapters() if args.chapter == "all" else [int(chapter_module(args.chapter).__name__[-2:])]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ok = True
    for i, ch in enumerate(todo):
        results = grade(ch, impl)
        print(("\n" if i else "") + format_table(ch, results, impl), flush=True)
        ok &= all(r[2] for r in results)
    return 0 if ok else 1
