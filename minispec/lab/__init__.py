"""The lab: what measures, checks and exports minispec (``minispec.train`` trains it and
``minispec.grading`` grades the course's exercises), apart from the runtime that decodes.

Nothing in the runtime (``minispec/*.py``, ``attention/``, ``kv/``, ``drafters/``) imports from here, from
``minispec.train`` or from ``minispec.grading`` (``tests/test_import_graph.py`` walks the imports); the
command line (``minispec.cli``) is the one front door that reaches both.

    bench, profile, tune_report     the commands that measure decoding (python -m minispec bench|profile|tune)
    exactness, exactness_report,    the exactness harness: enumeration, empirical TV / chi-square, the
    joint_law                       law of the first tokens, deliberately wrong controls
    analysis, cost_check            chapter 1's formulas and its cost model closed on a run
    graph_rules, scale,             chapters 8-9: what breaks a CUDA graph, Llama-shaped scaling, the
    attention_grid, backend_table,  attention timing grid, the attention backend table a GPU measures,
    gpu_suite                       every GPU measurement in one command
    export                          heads in the official EAGLE layouts
    benchinfo, env, tables          what a result file records, the environment report, result tables
"""
