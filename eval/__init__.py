"""Evaluation of trained checkpoints: benchmark scores, compression ratios, perplexity.

- ``lmms_plugin`` / ``lmms_entry`` / ``lmms_generation``: the lmms-eval model plugin
  (``lmms-eval --model conceptmoe --model_args pretrained=DIR``): batched generation and log-likelihoods, chunking
  overrides for eval-time studies, and per-sample R (total / text / image) of every prompt.
- ``tasks/``: local lmms-eval tasks (``--include_path eval/tasks``): ``cmoe_longdoc`` (multi-page document QA),
  ``cmoe_niah`` (needle in an interleaved text / image haystack), ``cmoe_refloc`` (referring-expression
  localisation); ``eval_data`` generates their data from the synthetic generators (``scripts/make_eval_data.py``).
- ``metrics``: the tasks' metric functions (ANLS, exact match, box IoU ...), pure Python.
- ``r_report`` (+ ``r_report_io``, ``r_report_plot``): the per-modality compression report of a training run or
  an evaluation output (the paper's Fig. 2c; docs/paper.md §11), as JSON and PNG (``scripts/r_report.py``).
- ``ppl``: text-only perplexity / bits per token / bits per byte on the held-out local text corpus
  (``scripts/eval_ppl.py``).
"""
