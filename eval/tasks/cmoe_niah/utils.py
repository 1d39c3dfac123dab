"""cmoe_niah hooks: the shared helpers of ``eval.tasks.common`` bound to this folder's ``data/``."""

from pathlib import Path

from eval.eval_data import NIAH_DEPTHS, NIAH_LENGTHS
from eval.tasks import common

DATA_DIR = Path(__file__).resolve().parent / "data"
TASK = "cmoe_niah"


def process_docs(dataset):
    """Parse and validate ``data/test.jsonl`` (bad lines and missing images skipped and counted)."""
    return common.process_docs(dataset, DATA_DIR, TASK)


doc_to_visual = common.niah_visual
doc_to_text = common.niah_text
process_results = common.niah_results
acc_text = common.niah_grid_and_bucket("modality", "text")  # also writes OUTPUT_PATH/cmoe_niah_grid.json
acc_image = common.bucket("modality", "image")
for _d in NIAH_DEPTHS:  # acc_depth_0 ... acc_depth_100 (percent)
    globals()[f"acc_depth_{round(_d * 100)}"] = common.bucket("depth", _d)
for _n in NIAH_LENGTHS:  # acc_len_short, acc_len_medium, acc_len_long
    globals()[f"acc_len_{_n}"] = common.bucket("length", _n)
