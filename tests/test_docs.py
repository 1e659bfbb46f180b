"""The docs point at files that exist: every relative link of README.md and docs/*.md, and every result
file, benchmark script, test, module or tool they name (a result file quoted with {a,b} names both).

A name with an upper-case placeholder (``profile_contextC_...``, ``gpu-NAME``) stands for a file the reader makes
and is not checked; ``out.json`` and the like are not under a checked folder."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NAMED = re.compile(r"(?<![\w/.-])((?:benchmarks|tests|tools|minispec|notebooks|exercises|solutions|data)/[\w.{},/*-]+)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def expand(name: str) -> list[str]:
    """'a_{x,y}_b.json' -> ['a_x_b.json', 'a_y_b.json']."""
    parts = re.split(r"\{([^{}]*)\}", name)
    options = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*options)]


def names(text: str) -> set[str]:
    found = set()
    for m in NAMED.finditer(text):
        name = m.group(1).rstrip(".,;:")
        if any(c.isupper() for c in name) or "*" in name or name.endswith("/NN"):
            continue  # a placeholder or a glob: a file the reader makes, or many
        found.update(expand(name))
    return found


def test_the_docs_name_each_other():
    assert (ROOT / "docs").is_dir() and len(DOCS) >= 4, [d.name for d in DOCS]
    readme = DOCS[0].read_text()
    for doc in DOCS[1:]:
        assert f"docs/{doc.name}" in readme, f"README.md does not link docs/{doc.name}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_link_and_named_file_exists(doc: Path):
    text = doc.read_text()
    missing = [link for link in LINK.findall(text)
               if not link.startswith(("http://", "https://", "mailto:")) and not (doc.parent / link).exists()]
    missing += [name for name in sorted(names(text)) if not (ROOT / name).exists()]
    assert not missing, f"{doc.relative_to(ROOT)} names files that do not exist: {missing}"


def test_the_checks_catch_a_missing_file(tmp_path: Path):
    """The two checks above can fail: a made-up result file and a broken link are found."""
    assert names("see `benchmarks/results/nothing_{a,b}_cpu.json` and benchmarks/results/profile_contextC_x.json") == {
        "benchmarks/results/nothing_a_cpu.json", "benchmarks/results/nothing_b_cpu.json"}
    doc = tmp_path / "x.md"
    doc.write_text("[gone](gone.md) [here](x.md)")
    assert [link for link in LINK.findall(doc.read_text()) if not (doc.parent / link).exists()] == ["gone.md"]
