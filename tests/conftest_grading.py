"""pytest plugin for the graded exercises: the ``--impl`` option.

Enabled from tests/conftest.py with ``pytest_plugins = ["conftest_grading"]``.

    pytest tests/test_exercises.py                     # minispec's own functions (default)
    pytest tests/test_exercises.py --impl solutions    # the reference answers
    pytest tests/test_exercises.py --impl exercises    # your work in exercises/
    MINISPEC_IMPL=exercises pytest tests/test_exercises.py   # the same, by environment
"""

from minispec.grading import IMPLS, default_impl


def pytest_addoption(parser):
    parser.addoption("--impl", choices=IMPLS, default=None,
                     help="implementation the exercise tests grade: minispec (default), solutions or exercises; "
                          "overrides $MINISPEC_IMPL")


def pytest_report_header(config):
    impl = config.getoption("--impl") or default_impl(fallback="minispec")
    return f"minispec exercises graded on: {impl}"
