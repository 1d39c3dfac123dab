"""lmms-eval task definitions (``--include_path eval/tasks``); shared helpers in ``eval.tasks.common``."""
