"""The imports among minispec's modules form no circle, and the runtime imports nothing from the lab:
walked with ``ast``, every ``import`` counted, the ones inside functions too (a lazy import hides a
circle or an upward arrow from Python, not from a reader)."""

import ast
from pathlib import Path

import minispec

ROOT = Path(minispec.__file__).resolve().parent


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _known() -> dict[str, Path]:
    return {_module(p): p for p in ROOT.rglob("*.py")}


def imports(path: Path, known, tree: ast.AST | None = None) -> set[str]:
    """The minispec modules ``path`` imports, anywhere in it (or in ``tree``, a part of it); ``from pkg import
    name`` counts as an import of ``pkg.name`` when that is a module, else of ``pkg``."""
    name = _module(path)
    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree if tree is not None else ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(pkg[:len(pkg) - node.level + 1] + ([node.module] if node.module else [])) if node.level \
                else node.module
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known and "." in t:  # `import minispec.drafters.eagle.X` -> the module part
                t = t.rsplit(".", 1)[0]
            if t in known and t != name:
                found.add(t)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan), as a path."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def import_graph() -> dict[str, set[str]]:
    known = _known()
    return {m: imports(p, known) for m, p in known.items()}


LAB = ("minispec.lab", "minispec.train", "minispec.grading")  # measure / check, train, grade: the lab's floor
FRONT_DOORS = {"minispec.cli", "minispec.__main__"}  # `python -m minispec ...` reaches both floors


def in_lab(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in LAB)


def upward_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """{runtime module: the lab modules it imports} (the front doors excepted)."""
    out = {}
    for m, deps in graph.items():
        if in_lab(m) or m in FRONT_DOORS:
            continue
        if up := sorted(d for d in deps if in_lab(d)):
            out[m] = up
    return out


def test_no_import_circle_among_minispec_modules():
    found = cycles(import_graph())
    assert not found, "import circles (strongly connected modules): " + "; ".join(" <-> ".join(c) for c in found)


def test_the_runtime_imports_nothing_from_the_lab():
    """The layout's promise (README, Layout): ``minispec/`` and its ``attention/``, ``kv/``, ``drafters/``
    decode; ``lab/``, ``train/`` and ``grading/`` measure, train and grade, and only they (and the
    command line) import both."""
    assert not upward_imports(import_graph())


def test_the_layering_check_flags_an_upward_import():
    g = {"minispec.verify": {"minispec.lab.exactness"}, "minispec.lab.bench": {"minispec.verify"},
         "minispec.cli": {"minispec.lab.bench"}, "minispec.drafters.eagle": {"minispec.train.eagle"}}
    assert upward_imports(g) == {"minispec.verify": ["minispec.lab.exactness"],
                                 "minispec.drafters.eagle": ["minispec.train.eagle"]}
    g = import_graph()
    assert "minispec.lab.bench" in g["minispec.cli"] and "minispec.train.eagle" in g["minispec.grading.ch03"]
    assert {"minispec.auto", "minispec.generate", "minispec.drafters.eagle"} <= set(g)  # runtime modules walked


def test_the_walk_sees_lazy_relative_and_package_imports():
    g = import_graph()
    assert "minispec.auto" in g["minispec.cli"]  # inside a function: `from .auto import ...`
    assert "minispec.drafters.defaults" in g["minispec.drafters.eagle"]  # `from .defaults import ...`
    assert "minispec.drafters.loader" in g["minispec.drafters"]  # the package's __init__
    assert "minispec.train.loop" in g["minispec.train.eagle"]  # `from . import ddp, loop`


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


# ------------------------------------------------------------------------- the reading set of one forward

READING_SET_MAX = 1_000  # lines a reader must read to follow one forward (issue 61: nanoGPT's model.py is 330)


def module_level_imports(path: Path, known) -> set[str]:
    """The minispec modules ``path`` imports at module level (its top-level statements, ``if`` blocks included;
    not inside a function or class): what Python runs when the module is imported, named as ``imports`` names
    them."""
    tree = ast.parse(path.read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    top += [n for block in tree.body if isinstance(block, ast.If) for n in ast.walk(block)
            if isinstance(n, (ast.Import, ast.ImportFrom))]
    shallow = ast.Module(body=top, type_ignores=[])
    return imports(path, known, shallow)


def reading_set(root: str = "minispec.model") -> dict[str, int]:
    """{module: lines} of ``root`` and every minispec module it imports at module level, transitively."""
    known = _known()
    todo, seen = [root], {}
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen[m] = len(known[m].read_text().splitlines())
        todo += sorted(module_level_imports(known[m], known))
    return seen


def test_one_forward_reads_at_most_a_thousand_lines():
    """model.py and what it imports at module level: the plain path, none of a backend's machinery (the exact CPU
    backend is swapped in by ``minispec.exact.apply``, which ``load()`` calls)."""
    files = reading_set()
    listing = ", ".join(f"{m} {n}" for m, n in sorted(files.items()))
    assert sum(files.values()) <= READING_SET_MAX, f"{sum(files.values())} lines: {listing}"
    assert not [m for m in files if m.startswith("minispec.exact")], listing
    assert "minispec.exact" in reading_set("minispec.loading") and "minispec.attention.plan" in files  # the walk walks


def test_the_walk_of_module_level_imports_skips_imports_inside_functions():
    g = import_graph()
    known = _known()
    assert "minispec.auto" in g["minispec.cli"]  # inside a function
    assert "minispec.auto" not in module_level_imports(known["minispec.cli"], known)
    assert "minispec.args" in module_level_imports(known["minispec.cli"], known)  # at the top


# ------------------------------------------------------------------------- rooms named for what they hold

def test_train_takes_its_argument_checks_from_the_runtime_not_the_lab():
    """``train/`` checks its flags with ``minispec.args`` (as the command line and the lab do), not the lab's env."""
    g = import_graph()
    assert "minispec.args" in g["minispec.train.eagle"]
    assert not {m: "minispec.lab.env" for m, deps in g.items() if m.startswith("minispec.train") and "minispec.lab.env" in deps}


def test_drafters_draft_and_import_no_decode_loop():
    """A drafter is a part of the loop, never its driver: nothing under ``drafters/`` imports ``generate`` or
    ``batch`` (the oracle drafter, which runs the loop to know the target's stream, is a lab instrument)."""
    g = import_graph()
    up = {m: sorted(d & {"minispec.generate", "minispec.batch"}) for m, d in g.items() if m.startswith("minispec.drafters")}
    assert not {m: d for m, d in up.items() if d}
    assert "minispec.lab.oracle" in g and "minispec.generate" in g["minispec.lab.oracle"]  # the walk sees it there


SAME_NAME_ALLOWED = {  # one name in two packages where each is that thing's part on its floor
    "eagle": "drafters/ drafts with the head, train/ trains it", "eagle3": "the same for EAGLE-3",
    "medusa": "the same for Medusa", "paged": "kv/ holds the paged cache, attention/ attends over it",
    "attention": "attention/ is the package, exact/attention the exact backend's attention function",
}


def _names() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for p in ROOT.rglob("*.py"):
        stem = p.parent.name if p.name == "__init__.py" else p.stem
        out.setdefault(stem, []).append(str(p.relative_to(ROOT)))
    return out


def _one_letter_apart(a: str, b: str) -> bool:
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b)) == 1
    short, long_ = sorted((a, b), key=len)
    return any(long_[:i] + long_[i + 1:] == short for i in range(len(long_)))


def test_no_two_modules_share_a_name_or_differ_by_one_letter():
    """Rooms named for what they hold (issue 61): no ``model`` beside ``models``, no ``profile`` in two packages
    meaning two things. Chapter graders (``ch01`` .. ``ch09``) and the parallel names above are the exceptions."""
    names = _names()
    same = {n: ps for n, ps in names.items() if len(ps) > 1 and n not in SAME_NAME_ALLOWED}
    close = [(a, b) for a in names for b in names if a < b and _one_letter_apart(a, b)
             and not (a.startswith("ch") and b.startswith("ch")) and {a, b} != {"eagle", "eagle3"}]
    assert not same and not close, (same, close)
    assert _one_letter_apart("model", "models") and _one_letter_apart("paged", "pages") and not _one_letter_apart("a", "a")
