"""Reference solutions of the chapter exercises (``solutions/chNN_*.py``).

Each exercise body sits between ``# BEGIN SOLUTION`` and ``# END SOLUTION``;
``tools/make_exercises.py`` turns these files into the stubs in ``exercises/``.
Grade them with ``python -m minispec grade N --impl solutions``.
"""
