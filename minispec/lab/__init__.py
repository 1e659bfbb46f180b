"""The lab: what measures, checks, trains, grades or exports minispec, apart from the runtime that decodes.

Nothing in the runtime (``minispec/*.py``, ``attention/``, ``kv/``, ``drafters/``) imports from here, from
``minispec.train`` or from ``minispec.grading`` (tests/test_layout.py walks the imports); the command line
(``minispec.cli``) is the one front door that reaches both.
"""
