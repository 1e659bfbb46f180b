"""Graded exercises: the checks, shared by pytest, ``python -m minispec grade N`` and notebooks.

    from minispec.grading import check, grade
    check("1.2")                    # notebook feedback on exercises/ (prints, never raises)
    grade(1, impl="solutions")      # [(id, name, passed, message), ...]

Checks live in ``minispec.grading.chNN`` (one ``Exercise`` per exercise); the implementation
under test is "minispec" (the library, through an adapter), "solutions" or "exercises"
(``--impl`` in pytest, ``MINISPEC_IMPL`` in the environment).
"""

from .checks import Exercise
from .runner import IMPLS, assert_passes, chapter_module, chapters, check, default_impl, find_exercise, grade, \
    grade_main, load_impl

__all__ = ["Exercise", "IMPLS", "assert_passes", "chapter_module", "chapters", "check", "default_impl",
           "find_exercise", "grade", "grade_main", "load_impl"]
