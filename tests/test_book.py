"""tools/book.py on two tiny notebooks (one draws a figure, one fails), never the real course."""

import importlib.util
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("book", ROOT / "tools" / "book.py")
book = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(book)


def _notebook(path, *cells):
    nb = new_notebook(cells=list(cells))
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


def test_select():
    paths = [Path("01_a.ipynb"), Path("02_b.ipynb"), Path("03_c.ipynb")]
    assert book.select(paths, "01, 3") == [paths[0], paths[2]]
    assert book.select(paths, None) == paths


def test_book(tmp_path, capsys):
    src, out = tmp_path / "notebooks", tmp_path / "book"
    src.mkdir()
    _notebook(src / "01_tiny.ipynb", new_markdown_cell("# Tiny chapter\n\nSome text."),
              new_code_cell("import os\nimport matplotlib.pyplot as plt\n"
                            "print('fast', os.environ.get('MINISPEC_FAST'))\nplt.plot([0, 1], [1, 0]);"))
    _notebook(src / "02_broken.ipynb", new_markdown_cell("## Broken chapter"),
              new_code_cell("raise ValueError('boom')"))

    assert book.main(["--out", str(out), "--notebooks", str(src), "--timeout", "60"]) == 1
    assert "02_broken" in capsys.readouterr().err

    page = (out / "01_tiny.html").read_text()
    assert "Tiny chapter" in page and "data:image/png;base64" in page and "fast 1" in page
    assert "boom" in (out / "02_broken.html").read_text()
    index = (out / "index.html").read_text()
    assert 'href="01_tiny.html">Tiny chapter' in index and 'href="02_broken.html">Broken chapter' in index
    assert "failed" in index and "fast mode" in index
    assert nbformat.read(out / "01_tiny.ipynb", 4).cells[1].outputs  # executed copy in out ...
    assert not nbformat.read(src / "01_tiny.ipynb", 4).cells[1].outputs  # ... source untouched
