"""Render the course as a book: execute every notebook and write it to self-contained HTML.

    python tools/book.py --out build/book                 # every chapter, fast mode
    python tools/book.py --out build/book --only 01,03    # chapters 01 and 03
    python tools/book.py --out build/book --full          # full sample counts (slow)

Each notebook in notebooks/ runs top to bottom in a fresh kernel (nbclient; working directory
notebooks/), by default with MINISPEC_FAST=1 and OMP_NUM_THREADS=1 (values already set in the
environment win). The executed notebook and its HTML (nbconvert, figures embedded as data URIs)
go to OUT, with an index.html listing the chapters and saying when, where and in which mode the
book was built. notebooks/ is never written: the committed notebooks stay without outputs.
A chapter that fails is still written (its HTML shows the error); the others go on, and the
exit status is 1 with the failed chapters named.
"""

from __future__ import annotations

import argparse
import datetime
import html
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbconvert import HTMLExporter

ROOT = Path(__file__).resolve().parents[1]


def title(nb, default: str) -> str:
    """The first markdown heading of a notebook, or `default`."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return default


def kernel_env(fast: bool) -> dict:
    env = dict(os.environ)
    if fast:
        env.setdefault("MINISPEC_FAST", "1")
        env.setdefault("OMP_NUM_THREADS", "1")
    else:
        env.pop("MINISPEC_FAST", None)
    return env


def build_chapter(path: Path, out: Path, env: dict, timeout: int) -> tuple[str, str | None]:
    """Execute one notebook into `out` (.ipynb and .html); return (title, error or None)."""
    nb = nbformat.read(path, as_version=4)
    resources = {"metadata": {"path": str(path.parent)}}
    error = None
    try:
        NotebookClient(nb, timeout=timeout, resources=resources).execute(env=env)
    except Exception as e:  # a cell raised, timed out, or the kernel died: keep what ran
        error = f"{getattr(e, 'ename', type(e).__name__)}: {getattr(e, 'evalue', e)}"
    nbformat.write(nb, out / path.name)
    body, _ = HTMLExporter(embed_images=True).from_notebook_node(nb, resources=resources)
    (out / f"{path.stem}.html").write_text(body, encoding="utf-8")
    return title(nb, path.stem), error


def build_note(fast: bool, env: dict) -> str:
    from minispec.lab.benchinfo import device_info

    info = device_info()
    machine = f"{info.get('cpu_model', info['cpu'])}, {os.cpu_count()} cores"
    if info.get("gpu"):
        machine += f", {info['gpu']}"
    mode = (f"fast mode (MINISPEC_FAST={env['MINISPEC_FAST']}, OMP_NUM_THREADS={env.get('OMP_NUM_THREADS', '')})"
            if fast else "full mode")
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"Built {when} on {machine}, in {mode}."


def write_index(out: Path, rows: list[tuple[str, str, str | None, float]], note: str) -> Path:
    """rows: (notebook stem, title, error or None, seconds)."""
    items = "\n".join(
        f'<li><a href="{stem}.html">{html.escape(t)}</a> <small>({secs:.0f} s'
        + (f', <b>failed</b>: {html.escape(err)}' if err else "") + ")</small></li>"
        for stem, t, err, secs in rows)
    page = (f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>minispec: the course</title>\n'
            f"<style>body{{font-family:sans-serif;max-width:50em;margin:2em auto;line-height:1.6}}</style>"
            f"</head><body>\n<h1>minispec: speculative decoding, chapter by chapter</h1>\n"
            f"<ol>\n{items}\n</ol>\n<p><small>{html.escape(note)}</small></p>\n</body></html>\n")
    path = out / "index.html"
    path.write_text(page, encoding="utf-8")
    return path


def build(paths: list[Path], out: Path, fast: bool = True, timeout: int = 1800) -> list[str]:
    """Execute and render `paths` into `out`, write index.html; return the failed chapters' names."""
    out.mkdir(parents=True, exist_ok=True)
    env = kernel_env(fast)
    rows = []
    for i, path in enumerate(paths, 1):
        print(f"[{i}/{len(paths)}] {path.stem}: running", flush=True)
        start = time.perf_counter()
        t, error = build_chapter(path, out, env, timeout)
        secs = time.perf_counter() - start
        print(f"[{i}/{len(paths)}] {path.stem}: {'FAILED' if error else 'ok'} ({secs:.0f} s)"
              + (f": {error}" if error else ""), flush=True)
        rows.append((path.stem, t, error, secs))
    write_index(out, rows, build_note(fast, env))
    return [stem for stem, _, error, _ in rows if error]


def select(paths: list[Path], only: str | None) -> list[Path]:
    """Keep the notebooks whose number prefix ("01") is in the comma-separated `only`."""
    if not only:
        return paths
    wanted = {s.strip().zfill(2) for s in only.split(",") if s.strip()}
    return [p for p in paths if p.stem.split("_")[0] in wanted]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="output folder (created)")
    ap.add_argument("--only", help="comma-separated chapter numbers, e.g. 01,03")
    ap.add_argument("--full", action="store_true", help="do not set MINISPEC_FAST=1 (slow)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per cell (default 1800)")
    ap.add_argument("--notebooks", type=Path, default=ROOT / "notebooks", help="source folder")
    args = ap.parse_args(argv)
    paths = select(sorted(args.notebooks.glob("*.ipynb")), args.only)
    if not paths:
        ap.error(f"no notebooks selected in {args.notebooks}")
    if args.out.resolve() == args.notebooks.resolve():
        ap.error("--out must differ from the notebooks folder (the notebooks stay without outputs)")
    failed = build(paths, args.out, fast=not args.full, timeout=args.timeout)
    print(f"book: {args.out / 'index.html'}")
    if failed:
        print(f"failed chapter(s): {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
