"""One way to print a result table: ``bench``, ``tune``, ``profile``, ``demo``, the exactness report and
the cost check print theirs with it.

    >>> print("\\n".join(text_table([Col("method", left=True), Col("tau", ".2f")], [["eagle", 2.5], ["vanilla", None]])))
    method   tau
    eagle   2.50
    vanilla    -

Numbers are formatted with the column's format spec and right-aligned, text as it is; None
prints as '-'. A column is as wide as its header, its widest cell and its ``width``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Col:
    """A column: its header, the format spec of its numbers ('.2f'), a least width, and whether
    it aligns left (names, free text) rather than right (numbers)."""

    header: str
    fmt: str = ""
    width: int = 0
    left: bool = False


def _cell(value, col: Col) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return format(value, col.fmt)


def text_table(cols: list[Col], rows: list[list], indent: str = "") -> list[str]:
    """The header line and one line per row (each a list of values, one per column)."""
    cells = [[_cell(v, c) for v, c in zip(row, cols)] for row in rows]
    widths = [max(c.width, len(c.header), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]

    def line(values):
        return (indent + " ".join(v.ljust(w) if c.left else v.rjust(w)
                                  for v, w, c in zip(values, widths, cols))).rstrip()

    return [line([c.header for c in cols])] + [line(r) for r in cells]
