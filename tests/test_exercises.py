"""One test per graded exercise, run on the implementation chosen by ``--impl`` / $MINISPEC_IMPL.

    pytest tests/test_exercises.py                    # minispec's own functions: all pass
    pytest tests/test_exercises.py --impl solutions   # reference answers: all pass
    pytest tests/test_exercises.py --impl exercises   # the stubs fail until you fill them in
    pytest tests/test_exercises.py -m ch01 --impl exercises

The check bodies live in minispec.grading (shared with ``python -m minispec grade N`` and the
notebooks' feedback cells).
"""

import pytest

from minispec.grading import assert_passes, chapter_module, chapters, default_impl


def _exercises():
    for ch in chapters():
        for ex in chapter_module(ch).EXERCISES:
            yield pytest.param(ex.id, marks=getattr(pytest.mark, f"ch{ch:02d}"), id=f"{ex.id}-{ex.name}")


@pytest.fixture(scope="session")
def impl(request):
    """--impl (registered by tests/conftest_grading.py), else $MINISPEC_IMPL, else minispec."""
    return request.config.getoption("--impl", default=None) or default_impl(fallback="minispec")


@pytest.mark.parametrize("ex_id", list(_exercises()))
def test_exercise(ex_id, impl):
    try:
        assert_passes(ex_id, impl)
        return
    except AssertionError as e:
        msg = f"[impl={impl}] {e}"
    pytest.fail(msg, pytrace=False)  # outside the except: no chained traceback, just the message
