"""Shared pieces of the exercise checks: the ``Exercise`` record and exact-law helpers.

A check is a function ``check(impl)`` that takes the implementation (a module, or any object
with the exercise's functions as attributes) and raises AssertionError when it is wrong.
``@exercise(registry, "1.3", "verify_chain")`` wraps it into an ``Exercise`` whose every failure,
a stub's NotImplementedError or a crash included, is an AssertionError starting
"Exercise 1.3 verify_chain: ...", the same text in pytest, in ``python -m minispec grade`` and in
notebook feedback cells.

Distribution checks use exact enumeration (``minispec.lab.exactness``): the learner's function is
called with an ``EnumeratingChooser`` once per branch of its random choices, so the law of its
output is computed exactly (float64) and compared with the target and with the law of
minispec's own implementation on the same inputs.
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from minispec.lab.exactness import max_abs_error, outcome_distribution

_PACKAGE = Path(__file__).resolve().parent.parent  # minispec/: frames inside it are not the learner's
TOL = 1e-9  # exact laws are equal up to float64 rounding (~1e-16); this leaves room for other formulas


@dataclass(frozen=True)
class Exercise:
    """One graded exercise: id "N.M", the function the learner writes, and its check."""

    id: str
    name: str
    func: Callable  # raw check(impl): raises AssertionError (messages without the prefix)

    @property
    def chapter(self) -> int:
        return int(self.id.split(".")[0])

    @property
    def prefix(self) -> str:
        return f"Exercise {self.id} {self.name}"

    def __call__(self, impl) -> None:
        """Run the check; any failure is an AssertionError whose message names the exercise."""
        try:
            self.func(impl)
        except AssertionError as e:
            msg = str(e) or "check failed"
            raise AssertionError(msg if msg.startswith("Exercise ") else f"{self.prefix}: {msg}") from None
        except NotImplementedError as e:
            raise AssertionError(f"{self.prefix}: not implemented yet (NotImplementedError: {e})") from None
        except Exception as e:  # a crash in the learner's code is a failed exercise, with where it happened
            raise AssertionError(f"{self.prefix}: raised {type(e).__name__}: {e}{_where(e)}") from e

    def run(self, impl) -> tuple[bool, str]:
        """(passed, message) without raising."""
        try:
            self(impl)
        except AssertionError as e:
            return False, str(e)
        return True, f"{self.prefix}: passed"


def exercise(registry: list, ex_id: str, name: str) -> Callable[[Callable], Exercise]:
    """Decorator: register ``check(impl)`` as exercise ``ex_id`` (function ``name``) in ``registry``."""

    def wrap(func: Callable) -> Exercise:
        ex = Exercise(ex_id, name, func)
        registry.append(ex)
        return ex

    return wrap


def _where(e: BaseException) -> str:
    """' (at file.py:12 in f)' for the innermost frame outside the minispec package, if any."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if _PACKAGE not in Path(f.filename).resolve().parents]
    if not frames:
        return ""
    f = frames[-1]
    return f" (at {f.filename.rsplit('/', 1)[-1]}:{f.lineno} in {f.name})"


# --------------------------------------------------------------------------- helpers for checks
def get(impl, name: str) -> Callable:
    """The function ``name`` of the implementation, or a clear failure."""
    fn = getattr(impl, name, None)
    if not callable(fn):
        raise AssertionError(f"the implementation {getattr(impl, '__name__', impl)!r} has no function {name}")
    return fn


def law(program: Callable) -> dict:
    """Exact law {outcome: probability} of ``program(chooser)``."""
    return outcome_distribution(program)


def fmt_diff(got: dict, want: dict, label: Callable[[object], str] = repr) -> str:
    """'P(<worst outcome>) = 0.300, expected 0.180' for the outcome where two laws differ most."""
    keys = set(got) | set(want)
    worst = max(keys, key=lambda x: abs(got.get(x, 0.0) - want.get(x, 0.0)))
    return f"P({label(worst)}) = {got.get(worst, 0.0):.4g}, expected {want.get(worst, 0.0):.4g}"


def compare_laws(got: dict, want: dict, what: str, where: str, label: Callable = repr) -> float:
    """Raise AssertionError "<what> by <error> (max abs) <where>: P(..) = .., expected .." if the laws
    differ by more than TOL; ``what`` reads like "output distribution differs from p"."""
    if abs(sum(got.values()) - 1.0) > 1e-6:
        raise AssertionError(f"{what}: probabilities of the outcomes sum to {sum(got.values()):.6g}, not 1, {where}")
    err = max_abs_error(got, want)
    if not err <= TOL:
        raise AssertionError(f"{what} by {err:.3g} (max abs) {where}: {fmt_diff(got, want, label)}")
    return err


def as_int(x, what: str) -> int:
    """int(x) for Python / numpy / 0-d torch integers; a clear failure otherwise."""
    try:
        return int(x)
    except (TypeError, ValueError):
        raise AssertionError(f"{what} must be an integer token id or index, got {x!r}") from None


def refusing(impl, name: str, forbidden: dict[str, Callable]) -> Callable:
    """The implementation's function ``name``, wrapped so that a call into one of ``forbidden`` during it fails.

    ``forbidden`` maps a name ("minispec.lab.scale.step_bytes") to a library function whose answer is the
    exercise's: calling it (under any alias, imported or not, from any depth of the learner's code) is
    delegating, not answering; so is the learner's function being that very function. Watched with
    ``sys.setprofile``: every Python-level call made while the function runs is compared with the forbidden
    functions' code objects. Only ``--impl minispec`` (a chapter's ``library()`` namespace, marked
    ``minispec_library=True``) may answer with them.
    """
    fn = get(impl, name)
    if getattr(impl, "minispec_library", False):
        return fn
    codes = {f.__code__: where for where, f in forbidden.items()}

    def watched(*args, **kwargs):
        hits: list[str] = []

        def profile(frame, event, arg):
            if event == "call" and frame.f_code in codes:
                hits.append(codes[frame.f_code])

        before = sys.getprofile()
        sys.setprofile(profile)
        try:
            out = fn(*args, **kwargs)
        finally:
            sys.setprofile(before)
        if hits:
            raise AssertionError(f"it calls {hits[0]}, minispec's own answer to this exercise: write the computation "
                                 "yourself (the check compares it with minispec's)")
        return out

    return watched
