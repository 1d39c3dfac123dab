"""cmoe_sceneqa_one hooks: the shared helpers of ``eval.tasks.common`` bound to this folder's ``data/``."""

from pathlib import Path

from eval.eval_data import SCENEQA_TYPES
from eval.tasks import common

DATA_DIR = Path(__file__).resolve().parent / "data"
TASK = "cmoe_sceneqa_one"


def process_docs(dataset):
    """Parse and validate ``data/test.jsonl`` (bad lines and missing images skipped and counted)."""
    return common.process_docs(dataset, DATA_DIR, TASK)


doc_to_visual = common.sceneqa_visual
doc_to_text = common.sceneqa_text
process_results = common.sceneqa_results
for _t in SCENEQA_TYPES:  # acc_count, acc_colour, acc_shape, acc_position: the per-type aggregations
    globals()[f"acc_{_t}"] = common.bucket("type", _t)
