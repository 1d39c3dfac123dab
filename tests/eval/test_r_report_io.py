"""Reading the R report's inputs (``eval.r_report_io``): one reader per record kind, chosen by the record's ``kind``
field, or by its keys for files written before the field."""

import json
from pathlib import Path

import pytest

from eval.r_report_io import load_records, record_kind


def _write_lines(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.parametrize(
    "rec,log_task,kind",
    [
        ({"step": 3, "loss": 2.0, "r": 2.0}, None, "step"),
        ({"step": 3, "split": "eval", "loss": 2.0}, None, "train_eval"),
        ({"step": 3, "eval_loss": 2.0}, None, "train_eval"),
        ({"task": "vqa", "doc_id": 0, "r": 2.0}, None, "sample"),
        ({"task": "vqa", "doc_id": 0, "r": 2.0}, "vqa", "sample"),  # the plugin's record, whatever the file name
        ({"doc_id": 0, "exact_match": 1.0}, "vqa", "sample_log"),
        ({"doc_id": 0, "exact_match": 1.0}, None, None),  # outside a sample log: nothing the report reads
        ({"step": "three"}, None, None),
        ({"kind": "step", "step": 3, "task": "vqa"}, None, "step"),  # a named kind is never guessed
        ({"kind": "train_eval", "step": 3}, None, "train_eval"),
        ({"kind": "checkpoint", "step": 3}, None, None),
    ],
)
def test_record_kind_is_the_kind_field_else_the_keys_of_todays_files(rec, log_task, kind):
    assert record_kind(rec, log_task) == kind


def test_records_naming_their_kind_go_to_that_reader(tmp_path):
    lines = [
        {"kind": "step", "step": 1, "loss": 3.0, "r": 2.0, "task": "pretrain"},  # keys alone would say: a sample
        {"kind": "step", "step": 2, "loss": 2.5, "tokens": 12, "concepts": 4},
        {"kind": "train_eval", "step": 2, "loss": 2.7, "r": 2.5},  # keys alone would say: a step
        {"kind": "sample", "task": "vqa", "doc_id": 7, "tokens": 10, "concepts": 5, "score": 1.0},
        {"kind": "sample"},  # no task: nothing to file it under
        {"kind": "step", "loss": 1.0},  # no step number
        {"kind": "checkpoint", "step": 9},
        {"step": 3, "loss": 2.0, "r": 4.0},  # no kind: read as today's files are
    ]
    records = load_records(_write_lines(tmp_path / "metrics.jsonl", lines))
    assert [(s["step"], s["loss"], s["r"]) for s in records.steps] == [(1, 3.0, 2.0), (2, 2.5, 3.0), (3, 2.0, 4.0)]
    assert [(e["step"], e["r"]) for e in records.train_evals] == [(2, 2.5)]
    (sample,) = records.samples
    assert (sample["task"], sample["doc_id"], sample["r"], sample["scores"]) == ("vqa", 7, 2.0, {"score": 1.0})
    assert records.ignored_records == 3


def test_sample_log_scores_join_the_plugins_samples_and_are_no_records_of_their_own(tmp_path):
    _write_lines(tmp_path / "r_stats_vqa.jsonl", [{"task": "vqa", "doc_id": 0, "r": 2.0, "score": 0.5}])
    _write_lines(tmp_path / "model_samples_vqa.jsonl", [{"doc_id": 0, "exact_match": 1.0, "score": 0.0}])
    records = load_records(tmp_path)
    (sample,) = records.samples
    assert sample["scores"] == {"exact_match": 1.0, "score": 0.5}  # the plugin's own score wins
    assert (records.joined_scores, records.ignored_records) == (1, 1)
