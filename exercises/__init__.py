"""The chapter exercises: fill in the functions in ``exercises/chNN_*.py``.

The stubs are generated from ``solutions/`` by ``tools/make_exercises.py`` (same signatures and
docstrings). Check your work with ``python -m minispec grade N`` (or
``minispec.grading.check("N.M")`` in a notebook, or
``pytest tests/test_exercises.py --impl exercises``).
"""
