"""cmoe_longdoc hooks: the shared helpers of ``eval.tasks.common`` bound to this folder's ``data/``."""

from pathlib import Path

from eval.eval_data import LONGDOC_PAGES
from eval.tasks import common

DATA_DIR = Path(__file__).resolve().parent / "data"
TASK = "cmoe_longdoc"


def process_docs(dataset):
    """Parse and validate ``data/test.jsonl`` (bad lines and missing pages skipped and counted)."""
    return common.process_docs(dataset, DATA_DIR, TASK)


doc_to_visual = common.longdoc_visual
doc_to_text = common.longdoc_text
process_results = common.longdoc_results
for _p in LONGDOC_PAGES:  # anls_pages_1, exact_match_pages_1, ...: the per-page-count aggregations
    globals()[f"anls_pages_{_p}"] = common.bucket("pages", _p)
    globals()[f"exact_match_pages_{_p}"] = common.bucket("pages", _p)
