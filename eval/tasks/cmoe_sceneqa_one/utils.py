"""cmoe_sceneqa_one hooks: ``eval.tasks.common.sceneqa_hooks`` bound to this folder's ``data/``."""

from pathlib import Path

from eval.tasks import common

DATA_DIR = Path(__file__).resolve().parent / "data"
TASK = "cmoe_sceneqa_one"

# process_docs, doc_to_visual, doc_to_text, process_results and acc_count / acc_colour / acc_shape / acc_position
globals().update(common.sceneqa_hooks(DATA_DIR, TASK))
