"""The argument types every command shares (``python -m minispec``, ``python -m minispec.train ...``, the
lab and ``benchmarks/`` scripts): a bad count is refused by name before anything loads, like every other bad
argument, not by a traceback from deep inside."""

from __future__ import annotations

import argparse


def at_least(minimum: int):
    """An argparse ``type``: a whole number >= ``minimum``, so that a bad count is refused with its name before
    anything loads, not by a traceback from deep inside."""
    def whole(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {n}")
        return n

    whole.__name__ = f"whole number >= {minimum}"  # how argparse names the type in its messages
    return whole


def thread_count(text: str) -> int:
    """The argparse ``type`` of every ``--threads`` (``python -m minispec`` and its lab, ``train`` and
    ``benchmarks/`` scripts): torch CPU threads, a whole number >= 1. 0 and negatives are refused by name before
    anything loads, like every other bad argument; a command picks its own default when the flag is left out
    (the CLI's: ``default_threads``)."""
    try:
        return at_least(1)(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} (torch CPU threads; leave --threads out for the default)") from None


thread_count.__name__ = "thread count"  # how argparse names the type in its messages


def thread_counts(text: str) -> list[int]:
    """The argparse ``type`` of a comma list of thread counts ('1,2'), each checked by ``thread_count``."""
    return [thread_count(t.strip()) for t in text.split(",")]


thread_counts.__name__ = "list of thread counts"
