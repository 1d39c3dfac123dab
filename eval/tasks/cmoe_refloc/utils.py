"""cmoe_refloc hooks: the shared helpers of ``eval.tasks.common`` bound to this folder's ``data/``."""

from pathlib import Path

from eval.tasks import common

DATA_DIR = Path(__file__).resolve().parent / "data"
TASK = "cmoe_refloc"


def process_docs(dataset):
    """Parse and validate ``data/test.jsonl`` (bad lines and missing images skipped and counted)."""
    return common.process_docs(dataset, DATA_DIR, TASK)


doc_to_visual = common.refloc_visual
doc_to_text = common.refloc_text
process_results = common.refloc_results
