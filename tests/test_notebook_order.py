"""Exercises sit where their idea is taught, and no notebook prints an answer before the exercise.

For each reworked chapter, parsed from its jupytext source ``notebooks/NN_*.py``:
  (a) every graded exercise N.M has a statement (a markdown heading "Exercise N.M") and, after
      it, a check cell (``check("N.M")``) with no new section in between; both sit inside the
      section that teaches the idea (``TAUGHT_IN`` below); and no code cell before the check
      cell prints the library function that answers it (``show(...)`` / ``getsource(...)``);
  (b) the check cells are spread over the notebook: each is inside its own teaching section,
      not gathered in one block at the end.

Every chapter is checked; a new chapter joins ``CHAPTERS_CHECKED`` with its entries in
``TAUGHT_IN`` and ``ANSWERS``.
"""

from __future__ import annotations

import re
from pathlib import Path

import jupytext
import pytest
import torch

from minispec.grading import chapter_module

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"

# Chapters whose notebooks follow the rule: all of them.
CHAPTERS_CHECKED = ["01", "02", "03", "04", "05", "06", "07", "08", "09"]

# Exercise -> a phrase of the "## " heading of the section that teaches it (case-insensitive).
TAUGHT_IN = {
    "1.1": "one draft token", "1.2": "one draft token", "1.3": "a chain of",
    "1.4": "tokens per step", "1.5": "tokens per step",
    "2.1": "with replacement", "2.2": "without replacement", "2.3": "one-hot", "2.4": "trees, level by level",
    "5.1": "expand and rerank", "5.2": "expand and rerank", "5.3": "expand and rerank", "5.4": "the cost model",
    "3.1": "why the shifted token", "3.2": "the heads, their sizes", "3.3": "the heads, their sizes",
    "3.4": "training an eagle head", "3.5": "drafting a chain", "3.6": "training-time test",
    "4.1": "from choices to a tree", "4.2": "the tree attention mask", "4.3": "positions and paths",
    "4.4": "positions and paths", "4.5": "one real tree step", "4.6": "choosing a static tree",
    "6.1": "the log-sum-exp merge", "6.2": "triton puzzle", "6.3": "pytorch references",
    "6.4": "the triton kernels", "6.5": "the triton kernels", "6.6": "the triton kernels",
    "7.1": "reserving a forward", "7.2": "a tree step", "7.3": "ragged acceptance",
    "7.4": "paged attention equals contiguous",
    "8.1": "capture rules", "8.2": "static buffers", "8.3": "capture and replay", "8.4": "choosing buckets",
    "9.1": "on the meta device", "9.2": "the roofline of a decode step", "9.3": "the oracle draft",
    "9.4": "where speculation stops paying",
}

# Exercise -> the library functions (last dotted name) whose source is its answer. The function
# of the same name as the exercise is always included (minispec.verify shares the names).
ANSWERS = {
    "2.1": ["_mss_replacement", "verify_candidates"],
    "2.2": ["_mss_no_replacement", "_mss_replacement", "verify_candidates"],
    "2.3": ["_mss_onehot", "verify_candidates"],
    "3.1": ["forward"], "3.2": ["build_vocab_map"], "3.3": ["to_target_logits"], "3.4": ["eagle_loss"], "3.5": ["_chain", "_extend", "_start"],
    "3.6": ["unroll", "level_attention", "ttt_loss"],
    "4.1": ["parse_choices"], "4.2": ["mask"], "4.3": ["positions"], "4.4": ["retrieve_indices"], "4.5": ["verify_tree"],
    "5.3": ["_dynamic"],
    "6.1": ["merge"], "6.2": ["_merge_kernel", "merge"], "6.3": ["attention_with_lse", "suffix_attention"],
    "6.4": ["prefix_attention", "_online_softmax_step", "_prefix_kernel"],
    "6.5": ["_prefix_kernel", "_online_softmax_step", "prefix_attention"], "6.6": ["split_attention"],
    "8.1": ["find_hazards", "record_ops"], "8.2": ["static_forward"], "8.3": ["capture", "_capture", "_replay"],
    "7.4": ["read", "gather", "read_rows", "_slots"], "8.4": ["best_buckets"],
    "9.1": ["weight_bytes", "kv_bytes", "linear_params"], "9.2": ["flops_per_row", "ridge_rows"],
    "9.4": ["roofline_speedup"],
}


def notebook_source(chapter: str) -> Path:
    [path] = sorted(NOTEBOOKS.glob(f"{chapter}_*.py"))
    return path


def exercises(chapter: str) -> list[tuple[str, str]]:
    """[(id, function name)] of a chapter's graded exercises (minispec.grading.chNN)."""
    return [(ex.id, ex.name) for ex in chapter_module(int(chapter)).EXERCISES]


def _heading(cell) -> str | None:
    """The text of the first "## " heading of a markdown cell, if any."""
    if cell.cell_type != "markdown":
        return None
    m = re.search(r"(?m)^##\s+(.*)$", cell.source)
    return m[1].strip() if m else None


def code(cell) -> str:
    """A code cell's source without comments ("" for markdown)."""
    return re.sub(r"(?m)#.*$", "", cell.source) if cell.cell_type == "code" else ""


def is_exercise(cell) -> bool:
    """An exercise statement ("### Exercise N.M") or a check cell (check("N.M"))."""
    if cell.cell_type == "markdown":
        return bool(re.search(r"(?m)^#+\s*Exercise\s+\d+\.\d+", cell.source))
    return bool(re.search(r"""\bcheck\(\s*["']\d+\.\d+["']""", code(cell)))


def order_problems(chapter: str, text: str) -> list[str]:
    """Why the notebook source ``text`` of ``chapter`` breaks the rules above ([] if it does not)."""
    cells = jupytext.reads(text, fmt="py:percent").cells
    section = []  # the "## " heading each cell belongs to
    current = None
    for c in cells:
        current = _heading(c) or current
        section.append(current)
    out = []
    checks = []
    for ex_id, name in exercises(chapter):
        where = f"exercise {ex_id} ({name})"
        check_re = re.compile(r"""\bcheck\(\s*["']""" + re.escape(ex_id) + r"""["']""")
        found = [i for i, c in enumerate(cells) if check_re.search(code(c))]
        statement_re = re.compile(r"(?m)^#+\s*Exercise\s+" + re.escape(ex_id) + r"\b")
        statements = [i for i, c in enumerate(cells) if c.cell_type == "markdown" and statement_re.search(c.source)]
        names = sorted({name, *ANSWERS.get(ex_id, [])})
        show_re = re.compile(r"\b(?:show|getsource)\(\s*(?:[\w.]+\.)?(" + "|".join(map(re.escape, names)) + r")\s*\)")
        if not found:
            out.append(f"{where}: no check cell calling check({ex_id!r})")
            whole = [i for i, c in enumerate(cells) if re.search(r"\bcheck\(", code(c))]  # a chapter-wide check
            end = whole[0] if whole else len(cells)
            out += [f"{where}: cell {i} prints the library's answer ({m[0]}) before the exercise (cell {end})"
                    for i, c in enumerate(cells[:end]) if (m := show_re.search(code(c)))]
            continue
        ci = found[0]
        checks.append(ci)
        if not statements or statements[0] > ci:
            out.append(f"{where}: no markdown statement '### Exercise {ex_id}' before its check cell (cell {ci})")
        elif section[statements[0]] != section[ci]:
            out.append(f"{where}: a new section starts between its statement (cell {statements[0]}) and its "
                       f"check cell (cell {ci})")
        phrase = TAUGHT_IN.get(ex_id)
        if phrase is None:
            out.append(f"{where}: add it to TAUGHT_IN in this test (the section that teaches it)")
        else:
            taught = [i for i, c in enumerate(cells) if phrase in (_heading(c) or "").lower()]
            if not taught:
                out.append(f"{where}: no '## ' section heading containing {phrase!r}")
            elif phrase not in (section[ci] or "").lower():
                out.append(f"{where}: its check cell (cell {ci}) is in section {section[ci]!r}, not in the "
                           f"section that teaches it ({phrase!r}, cell {taught[0]})")
            else:
                stop = statements[0] if statements else ci
                lesson = [cells[j].source for j in range(taught[0], stop) if not is_exercise(cells[j])]
                if len("".join(lesson)) - len(section[ci]) < 200:  # the heading alone teaches nothing
                    out.append(f"{where}: the section {section[ci]!r} teaches nothing before the exercise")
        for i, c in enumerate(cells[:ci]):
            if m := show_re.search(code(c)):
                out.append(f"{where}: cell {i} prints the library's answer ({m[0]}) before the exercise's check "
                           f"cell (cell {ci})")
    # (b) not one block at the end: the check cells are separated by teaching sections
    if len(checks) > 1 and len({section[i] for i in checks}) == 1:
        out.append(f"all check cells sit in one section ({section[checks[0]]!r}): move each after the section "
                   "that teaches it")
    return out


@pytest.mark.parametrize("chapter", CHAPTERS_CHECKED)
def test_exercises_follow_their_sections(chapter):
    problems = order_problems(chapter, notebook_source(chapter).read_text())
    assert not problems, f"notebooks/{notebook_source(chapter).name}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("chapter", CHAPTERS_CHECKED)
def test_every_exercise_is_mapped(chapter):
    assert {ex_id for ex_id, _ in exercises(chapter)} <= set(TAUGHT_IN)


def test_the_check_can_fail():
    """The rules flag the old layout: every exercise in one block at the end, the answer printed above it."""
    text = notebook_source("01").read_text()
    cells = jupytext.reads(text, fmt="py:percent").cells
    head = jupytext.reads("# %% [markdown]\n# ## Exercises\n", fmt="py:percent").cells[0]
    moved = [c for c in cells if not is_exercise(c)] + [head] + [c for c in cells if is_exercise(c)]
    moved.insert(3, jupytext.reads("# %%\nshow(vf.verify_chain)\n", fmt="py:percent").cells[0])
    nb = jupytext.reads(text, fmt="py:percent")
    nb.cells = moved
    problems = order_problems("01", jupytext.writes(nb, fmt="py:percent"))
    assert any("prints the library's answer (show(vf.verify_chain))" in p for p in problems), problems
    assert any("not in the section that teaches it" in p for p in problems), problems
    assert any("all check cells sit in one section" in p for p in problems), problems


# Chapters whose real-model TV check runs on SmolLM2 (minispec.lab.joint_law) with a wrong control.
TV_CHAPTERS = ["01", "02", "03", "04", "05", "07"]
LOOP_CHAPTERS = ["03", "04", "05", "07"]  # the decode loop's check: one call of decode_loop_exactness each


def tv_problems(text: str) -> list[str]:
    """Every cell that runs a joint-law TV check names the models that ran and asserts that its wrong
    controls are flagged.

    Chapters 1-2 (``... = joint_tv_check(...)``): a "TV check — target: ..." line in that cell or an earlier
    cell of its section, and, on SmolLM2, ``assert ...["tv"] > bound`` in the same cell (the optional GPT-2
    checks name their models too). Chapters 3-5 and 7 check the decode loop with ONE call of
    ``minispec.lab.joint_law.decode_loop_exactness``, which asserts the verdict itself and must be given
    ``models="target: ..."``; a cell that runs ``loop_tv_check`` itself copies the section back."""
    problems, named, runs = [], None, 0
    for cell in jupytext.reads(text, fmt="py:percent").cells:
        if cell.cell_type == "markdown":
            if re.search(r"^## ", cell.source, re.M):
                named = None  # a new section: its checks must name their models again
            continue
        c = code(cell)
        first = c.strip().splitlines()[0] if c.strip() else ""
        if re.search(r"\bdecode_loop_exactness\(", c):
            runs += 1
            if not re.search(r"""models\s*=\s*f?["']target: """, cell.source):
                problems.append(f"decode_loop_exactness is not told its models (models=\"target: ...\"): {first!r}")
            continue
        if re.search(r"\bloop_tv_check\(", c):
            problems.append(f"a cell runs loop_tv_check itself (the section copied back): call "
                            f"minispec.lab.joint_law.decode_loop_exactness: {first!r}")
            continue
        m = re.search(r"\*\*TV check — target: ([^*]*)", c)
        named = m.group(1) if m else named
        if not re.search(r"=\s*joint_tv_check\(", c):
            continue
        runs += 1
        if named is None:
            problems.append(f"a TV check does not name its models: {first!r}")
        elif "GPT-2" not in named and not re.search(r'assert [^\n]*\["tv"\] > bound', c):
            problems.append(f"the TV check on {named!r} does not assert that its wrong controls are flagged: {first!r}")
    return problems + ([] if runs else ["no cell runs a joint-law TV check"])


@pytest.mark.parametrize("chapter", TV_CHAPTERS)
def test_tv_checks_name_their_model_and_flag_a_wrong_control(chapter):
    assert tv_problems(notebook_source(chapter).read_text()) == []


@pytest.mark.parametrize("chapter", LOOP_CHAPTERS)
def test_the_decode_loop_check_is_one_call_into_the_lab(chapter):
    text = notebook_source(chapter).read_text()
    assert len(re.findall(r"\bdecode_loop_exactness\(", text)) == 1


def test_the_tv_rule_can_fail():
    text = notebook_source("03").read_text()
    assert tv_problems(text.replace('models="target:', 'models="'))
    copied = text.replace("tv3 = decode_loop_exactness(", "res, bound, support, exact = loop_tv_check(")
    assert any("copied back" in p for p in tv_problems(copied))
    text1 = notebook_source("01").read_text()
    assert tv_problems(text1.replace("TV check — target:", "TV check:"))
    assert tv_problems(text1.replace('assert tv["WRONG: resample from p"]["tv"] > bound', "pass"))


# ------------------------------------------------- no function shown above an exercise passes it
def functions_above(cells, stop: int) -> tuple[dict, list[tuple[int, str]]]:
    """Execute the imports and the top-level ``def``s of the code cells before ``stop`` (nothing else:
    no model is loaded) and return (namespace, [(cell, name)] of the functions defined there)."""
    import ast

    ns: dict = {"__name__": "notebook"}
    defs = []
    for i, c in enumerate(cells[:stop]):
        if c.cell_type != "code":
            continue
        try:
            tree = ast.parse(re.sub(r"(?m)^\s*[%!].*$", "", c.source))  # IPython magics are not Python
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef)):
                try:
                    exec(compile(ast.Module([node], type_ignores=[]), f"cell {i}", "exec"), ns)
                except Exception:  # an optional import (triton, ...) that this machine lacks
                    continue
                if isinstance(node, ast.FunctionDef):
                    defs.append((i, node.name))
    return ns, defs


def helpers_that_pass(chapter: str, text: str) -> list[str]:
    """'cell i: f passes exercise N.M' for every function a notebook defines above an exercise's check cell
    that the exercise's grader accepts as the learner's answer (then the exercise is copying, not thinking)."""
    import inspect
    from types import SimpleNamespace

    from minispec.grading import chapter_module

    cells = jupytext.reads(text, fmt="py:percent").cells
    mod = chapter_module(int(chapter))
    out = []
    for ex in mod.EXERCISES:
        check_re = re.compile(r"""\bcheck\(\s*["']""" + re.escape(ex.id) + r"""["']""")
        found = [i for i, c in enumerate(cells) if check_re.search(code(c))]
        if not found:
            continue
        ns, defs = functions_above(cells, found[0])
        solution = getattr(_solutions(chapter), ex.name, None)
        arity = len(inspect.signature(solution).parameters) if solution is not None else None
        for i, name in defs:
            fn = ns[name]
            try:
                params = inspect.signature(fn).parameters.values()
            except (TypeError, ValueError):
                continue
            required = sum(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
            if arity is None or required > arity or len(list(params)) < min(arity, 1):
                continue
            impl = SimpleNamespace(**{k: v for k, v in vars(_solutions(chapter)).items() if not k.startswith("__")})
            setattr(impl, ex.name, fn)
            impl.__name__ = f"notebook cell {i}"
            passed, _ = ex.run(impl)
            if passed:
                out.append(f"cell {i}: {name} passes exercise {ex.id} ({ex.name}) as it is")
    return out


def _solutions(chapter: str):
    import importlib

    return importlib.import_module(f"solutions.{chapter_module(int(chapter)).MODULE}")


@pytest.mark.parametrize("chapter", CHAPTERS_CHECKED)
def test_no_function_above_an_exercise_passes_it(chapter):
    problems = helpers_that_pass(chapter, notebook_source(chapter).read_text())
    assert not problems, f"notebooks/{notebook_source(chapter).name}:\n  " + "\n  ".join(problems)


def test_a_naive_answer_above_its_exercise_is_caught():
    """Put a naive tree mask that returns the mask itself back above exercise 4.2: the check flags it."""
    text = notebook_source("04").read_text()
    naive = '''
# %%
def naive_mask(parents):
    n = len(parents) + 1
    m = [[False] * n for _ in range(n)]
    for a in range(n):
        m[a][0] = True
        i = a - 1
        while i >= 0:
            m[a][i + 1] = True
            i = parents[i]
    return torch.tensor(m)

'''
    anchor = "# %% [markdown]\n# ### Exercise 4.2"
    assert anchor in text
    problems = helpers_that_pass("04", text.replace(anchor, naive + anchor))
    assert any("naive_mask passes exercise 4.2" in p for p in problems), problems


# ------------------------------------------------- no give-away above an exercise, none in its docstring
_NAIVE_ONE_DRAFT = """def naive_one_draft(x, p, q, chooser):
    p, q = [float(v) for v in p], [float(v) for v in q]
    if chooser.bernoulli(min(1.0, p[x] / q[x])):
        return 1, x
    r = [max(0.0, pi - qi) for pi, qi in zip(p, q)]
    return 0, chooser.categorical(torch.tensor([ri / sum(r) for ri in r], dtype=torch.float64))
"""
_EXPAND_RERANK = """def naive_dynamic_tree(q_of, depth, top_k, total_tokens):
    cands, frontier = [], [-1]
    best = sorted(range(len(cands)), key=lambda c: -cands[c]["score"])[:total_tokens]
    return best
"""

# (exercise, where it may not stand: "code" / "markdown" above the check cell, or "doc" in the exercise's docstring,
#  a pattern of the give-away, what it gives away, a sample that puts it back)
GIVEAWAYS = [
    ("1.1", "doc", r"min\(1, ?p\(x\) ?/ ?q\(x\)\)|accept with probability 1 if p\(x\) > 0", "the acceptance rule",
     "Probability of accepting a drafted token x: min(1, p(x) / q(x))."),
    ("1.1", "markdown", r"q\(x\) = 0\$?[^.]*accepts iff", "the rule for q(x) = 0",
     "# (If $q(x) = 0$ for a proposed $x$ — impossible when $x \\sim q$ — minispec accepts iff $p(x) > 0$.)"),
    ("1.3", "code", r"(?s)def \w+\([^)]*chooser[^)]*\):\n(?:[ \t]+.*\n|\n)*?[ \t]+.*chooser\.bernoulli\(",
     "a complete accept/reject step with a chooser (exercise 1.3 for one draft)", _NAIVE_ONE_DRAFT),
    ("1.5", "code", r"(?s)speedup\(.*\.argmax\(|\.argmax\(.*speedup\(", "the best k, computed",
     "s = an.speedup(0.8, np.arange(13), 0.05)\nprint(np.arange(13)[s.argmax()])\n"),
    ("2.2", "markdown", r"q_\{i\s*\+\s*1\}\s*=", "the without-replacement update",
     "# $$ p_{i+1} = \\mathrm{norm}(\\max(0, p_i - q_i)), \\quad q_{i+1} = \\mathrm{norm}(q_i \\text{ without } x_i) $$"),
    ("3.1", "doc", r"cat\[\s*e(mbedding)?[\[(]x_\{?j", "the input rows' formula", "row j = cat[embedding[x_{j+1}], f_j]."),
    *[(ex, "code", r"def \w+\([^)]*\btotal_tokens\b", "a complete expand-and-rerank (exercises 5.1-5.3)", _EXPAND_RERANK)
      for ex in ("5.1", "5.2", "5.3")],
    *[(ex, "code", rf"\b{name}\b", f"minispec's own {name}, imported or called (the answer to delegate to)",
       f"from minispec.lab.scale import {name}\n") for ex, name in
      (("9.1", "step_bytes"), ("9.2", "roofline_step_s"), ("9.3", "corruption_for_tau"), ("9.4", "crossover_batch"))],
    ("9.1", "doc", r"fused q/k/v projection and the output projection", "the list of weights to add up",
     "Every weight is read once: the fused q/k/v projection and the output projection of each layer."),
    ("9.2", "doc", r"one multiply and one add for every weight|a dot product of head_dim", "the FLOPs of a row",
     "Its arithmetic, per row: one multiply and one add for every weight of the linear layers."),
    ("9.4", "doc", r"tokens per second of one over the other", "the speedup's formula",
     "speculation's speedup at batch B is the tokens per second of one over the other."),
]


def exercise_doc(ex_id: str) -> str:
    """The docstring of exercise ``ex_id``'s function (the same in solutions/ and exercises/)."""
    ex = next(e for e in chapter_module(int(ex_id.split(".")[0])).EXERCISES if e.id == ex_id)
    fn = getattr(_solutions(ex_id.split(".")[0].zfill(2)), ex.name)
    return getattr(fn, "fn", fn).__doc__ or ""


def giveaway_problems(chapter: str, text: str, docs: dict[str, str] | None = None) -> list[str]:
    """Every GIVEAWAYS entry of ``chapter`` found: in a code or markdown cell above the exercise's check cell, or
    in its docstring (``docs`` overrides the docstrings, to test the rule)."""
    cells = jupytext.reads(text, fmt="py:percent").cells
    out = []
    for ex_id, where, pattern, what, _ in GIVEAWAYS:
        if ex_id.split(".")[0].zfill(2) != chapter:
            continue
        if where == "doc":
            doc = (docs or {}).get(ex_id, exercise_doc(ex_id))
            if re.search(pattern, doc):
                out.append(f"exercise {ex_id}: its docstring gives away {what}")
            continue
        check_re = re.compile(r"""\bcheck\(\s*["']""" + re.escape(ex_id) + r"""["']""")
        ci = next((i for i, c in enumerate(cells) if check_re.search(code(c))), len(cells))
        for i, c in enumerate(cells[:ci]):
            body = code(c) if where == "code" else (c.source if c.cell_type == "markdown" else "")
            if re.search(pattern, body):
                out.append(f"exercise {ex_id}: cell {i} gives away {what} above its check cell (cell {ci})")
    return out


@pytest.mark.parametrize("chapter", CHAPTERS_CHECKED)
def test_no_giveaway_above_an_exercise_or_in_its_docstring(chapter):
    problems = giveaway_problems(chapter, notebook_source(chapter).read_text())
    assert not problems, f"notebooks/{notebook_source(chapter).name}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("ex_id, where, pattern, what, sample", GIVEAWAYS,
                         ids=[f"{g[0]}-{g[1]}-{i}" for i, g in enumerate(GIVEAWAYS)])
def test_each_giveaway_is_caught_when_put_back(ex_id, where, pattern, what, sample):
    chapter = ex_id.split(".")[0].zfill(2)
    text = notebook_source(chapter).read_text()
    if where == "doc":
        problems = giveaway_problems(chapter, text, {ex_id: exercise_doc(ex_id) + "\n" + sample})
    else:
        anchor = re.search(rf"(?m)^# %% \[markdown\]\n# ### Exercise {re.escape(ex_id)}\b", text)
        assert anchor, ex_id
        cell = ("# %% [markdown]\n" + sample if where == "markdown" else "# %%\n" + sample) + "\n\n"
        problems = giveaway_problems(chapter, text[:anchor.start()] + cell + text[anchor.start():])
    assert any(f"exercise {ex_id}" in p and what in p for p in problems), problems


# ------------------------------------------------- near misses the graders refuse
def _one_shot_attention(q, k, v, block):  # the right numbers, but every key at once: not tiled
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None]) @ v, lse


def _delegate(module: str, name: str):
    import importlib

    return lambda *args, **kwargs: getattr(importlib.import_module(module), name)(*args, **kwargs)


NEAR_MISSES = [
    ("6.4", _one_shot_attention, "at once"),
    ("9.1", _delegate("minispec.lab.scale", "step_bytes"), "calls minispec.lab.scale.step_bytes"),
    ("9.2", _delegate("minispec.lab.scale", "roofline_step_s"), "calls minispec.lab.scale.roofline_step_s"),
    ("9.3", _delegate("minispec.lab.oracle", "corruption_for_tau"), "calls minispec.lab.oracle.corruption_for_tau"),
    ("9.4", _delegate("minispec.lab.scale", "crossover_batch"), "calls minispec.lab.scale.crossover_batch"),
]


@pytest.mark.parametrize("ex_id, answer, needle", NEAR_MISSES, ids=[m[0] for m in NEAR_MISSES])
def test_a_near_miss_fails_its_exercise(ex_id, answer, needle):
    """6.4 answered without tiling, and 9.x answered by minispec's own function, fail: the right numbers are not
    the exercise."""
    from types import SimpleNamespace

    from minispec.grading import find_exercise

    ex = find_exercise(ex_id)
    impl = SimpleNamespace(**{k: v for k, v in vars(_solutions(ex_id.split(".")[0].zfill(2))).items()
                              if not k.startswith("__")})
    setattr(impl, ex.name, answer)
    passed, msg = ex.run(impl)
    assert not passed and needle in msg, msg


# ------------------------------------------------- one structure for every chapter
SECTIONS = ["## Pen-and-paper questions", "## Summary", "## References", "## The whole chapter",
            "## Answers to the pen-and-paper questions"]


def structure_problems(chapter: str, text: str) -> list[str]:
    """Learning objectives first; the closing sections in their order; exercises numbered in the
    order a reader meets them (N.1, N.2, ...)."""
    out = []
    if "**Learning objectives**" not in text:
        out.append("no '**Learning objectives**' near the top")
    at = [text.find("\n# " + s + "\n") for s in SECTIONS]
    out += [f"no {s!r} section" for s, i in zip(SECTIONS, at) if i < 0]
    found = [i for i in at if i >= 0]
    if found != sorted(found):
        out.append(f"the closing sections are not in the order {SECTIONS}")
    cells = jupytext.reads(text, fmt="py:percent").cells
    met = []
    for c in cells:
        for m in re.finditer(r"""\bcheck\(\s*["'](\d+)\.(\d+)["']""", code(c)):
            if (int(m[1]), int(m[2])) not in met:
                met.append((int(m[1]), int(m[2])))
    want = [(int(chapter), i) for i in range(1, len(met) + 1)]
    if met != want:
        out.append(f"exercises met in the order {['%d.%d' % e for e in met]}, not {['%d.%d' % e for e in want]}")
    return out


@pytest.mark.parametrize("chapter", CHAPTERS_CHECKED)
def test_every_chapter_has_one_structure(chapter):
    problems = structure_problems(chapter, notebook_source(chapter).read_text())
    assert not problems, f"notebooks/{notebook_source(chapter).name}:\n  " + "\n  ".join(problems)


def test_the_structure_rule_can_fail():
    text = notebook_source("04").read_text()
    assert any("not 4.1" in p or "order" in p for p in structure_problems("04", text.replace('check("4.1")', 'check("4.9")')))
    assert any("'## Summary'" in p for p in structure_problems("04", text.replace("\n# ## Summary\n", "\n# ## Recap\n")))
