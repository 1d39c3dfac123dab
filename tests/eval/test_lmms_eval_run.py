"""A real ``python -m lmms_eval`` run of the five local tasks with the tiny checkpoint (--limit 2), the per-sample
R records it leaves next to the results, the R report over that folder and the score table (score, chance, R)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eval.r_report import write_report

REPO_ROOT = Path(__file__).resolve().parents[2]
TASKS = ("cmoe_longdoc", "cmoe_niah", "cmoe_refloc", "cmoe_sceneqa", "cmoe_sceneqa_one")
METRICS = {
    "cmoe_longdoc": ["anls", "exact_match", "anls_pages_1", "anls_pages_2", "exact_match_pages_1"],
    "cmoe_niah": ["acc", "acc_text", "acc_depth_0", "acc_depth_10", "acc_len_short"],
    "cmoe_refloc": ["IoU", "ACC@0.1", "ACC@0.3", "ACC@0.5", "ACC@0.7", "ACC@0.9", "Center_ACC"],
    "cmoe_sceneqa": ["acc", "acc_count"],  # --limit 2: scene 0's first two docs (count, then its next type)
    "cmoe_sceneqa_one": ["acc", "acc_count", "acc_colour"],  # one object: count, colour, shape, position
}


@pytest.fixture(scope="module")
def lmms_run(tiny_checkpoint, eval_tasks_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lmms_out")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "lmms_eval",
        "--model",
        "conceptmoe",
        "--model_args",
        f"pretrained={tiny_checkpoint}",
        "--batch_size",
        "2",
        "--tasks",
        ",".join(TASKS),
        "--include_path",
        str(eval_tasks_dir),
        "--limit",
        "2",
        "--output_path",
        str(out),
        "--log_samples",
        "--verbosity",
        "DEBUG",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


def test_results_hold_every_metric(lmms_run):
    (results_file,) = lmms_run.rglob("*_results.json")
    results = json.loads(results_file.read_text())["results"]
    for task in TASKS:
        for metric in METRICS[task]:
            value = results[task][f"{metric},none"]
            assert isinstance(value, float) and 0.0 <= value <= 1.0, (task, metric, value)
    assert math.isnan(results["cmoe_longdoc"]["anls_pages_32,none"])  # a page count the data does not hold
    grid = json.loads((lmms_run / "cmoe_niah_grid.json").read_text())["cells"]
    assert sum(c["n"] for c in grid) == 2


def test_per_sample_r_records_and_report(lmms_run):
    for task in TASKS:
        (stats,) = lmms_run.rglob(f"r_stats_{task}.jsonl")
        assert stats.parent == next(lmms_run.rglob("*_results.json")).parent  # next to lmms-eval's results
        records = [json.loads(line) for line in stats.read_text().splitlines()]
        assert sorted(r["doc_id"] for r in records) == [0, 1]
        for r in records:
            assert r["tokens"] == sum(r["tokens_by_modality"].values()) > 0
            assert r["concepts"] == sum(r["concepts_by_modality"].values()) >= 1
            assert r["r"] == pytest.approx(r["tokens"] / r["concepts"]) and r["r_image"] is not None
    summary = write_report(lmms_run)
    tasks = summary["eval"]["tasks"]
    assert sorted(tasks) == list(TASKS)
    assert tasks["cmoe_refloc"]["score"]["metric"] == "IoU" and tasks["cmoe_refloc"]["r_image"]["n"] == 2
    assert set(tasks["cmoe_longdoc"]["groups"]) == {"pages=1", "pages=2"}
    assert "anls" in tasks["cmoe_longdoc"]["groups"]["pages=2"]["scores"]  # joined from lmms-eval's sample log
    assert (lmms_run / "r_report.png").read_bytes()[:4] == b"\x89PNG"


def test_score_table(lmms_run, eval_tasks_dir):
    from eval.score_table import rows, write_table

    table = rows(lmms_run, eval_tasks_dir)
    assert sorted({r["task"] for r in table}) == list(TASKS)
    for row in table:
        assert row["chance"] is None or 0.0 <= row["chance"] <= 1.0, row  # None: a bucket the data does not hold
        assert row["r"] is not None and row["r"] >= 1.0 and row["r_image"] is not None, row
    assert all(r["chance"] is not None for r in table if r["metric"] in ("acc", "anls", "IoU"))
    text = write_table(lmms_run, eval_tasks_dir)
    assert len(text.splitlines()) == len(table) + 2 and (lmms_run / "score_table.md").is_file()
