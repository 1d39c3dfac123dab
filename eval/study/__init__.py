"""The compute-matched study: does ConceptMoE (arXiv 2601.21420) help a VLM, and where?

``scripts/study.py --config scripts/configs/study.yaml`` (``make study``) trains every arm of the config through
``scripts/train_vlm.py``, evaluates it through lmms-eval, times a long prefill, and writes ``docs/study.md`` with one
table, plots and a verdict per claim. The modules, in the order they run:

- ``config``: the study YAML, ``--set``, ``--quick``, checks;
- ``arms``: compute-matched configs (``vlm.accounting.flops.match``) and each run's training YAML;
- ``runner``: data, the runs (subprocesses, resumable, a budget), the prefill phase (``prefill``);
- ``collect``: every number from the runs' files; ``claims``: the verdicts;
- ``report``, ``markdown``, ``plots``: ``study.json``, the doc and the figures;
- ``cli``: the command line.
"""
