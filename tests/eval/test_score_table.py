"""``scripts/score_table.py`` on a synthetic lmms-eval output folder: the newest results, chance levels from the task
manifests, R from the R report (or computed from the per-sample records)."""

import json
import math
import os
import runpy
import sys
from pathlib import Path

import pytest

from eval.score_table import binomial_tail, markdown, rows, write_table

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "score_table.py"


def _results(path: Path, scores: dict, mtime: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    results = {task: {"alias": task} | {f"{m},none": v for m, v in ms.items()} for task, ms in scores.items()}
    for task in scores:
        results[task]["acc_stderr,none"] = 0.1
    path.write_text(json.dumps({"results": results}).replace("Infinity", "NaN"))
    os.utime(path, (mtime, mtime))


@pytest.fixture
def folders(tmp_path):
    out, tasks = tmp_path / "eval_out", tmp_path / "tasks"
    model = out / "runs__demo__hf"
    _results(model / "20250101_000000_results.json", {"cmoe_sceneqa": {"acc": 0.1}}, 1_000)
    newest = {"cmoe_sceneqa": {"acc": 0.8, "acc_count": 0.9, "acc_shape": float("inf")}, "cmoe_refloc": {"IoU": 0.4}}
    _results(model / "20250102_000000_results.json", newest, 2_000)  # NaN for acc_shape (no doc of that type)
    for task, chance in (("cmoe_sceneqa", {"acc": 0.42, "acc_count": 0.3, "acc_shape": None}), ("cmoe_refloc", {})):
        (tasks / task / "data").mkdir(parents=True)
        (tasks / task / "data" / "manifest.json").write_text(json.dumps({"task": task, "chance": chance}))
    report = {
        "eval": {
            "tasks": {
                "cmoe_sceneqa": {
                    "r": {"mean": 9.0, "token_weighted": 3.5},
                    "r_text": {"mean": 2.0, "token_weighted": 2.25},
                    "r_image": {"mean": 5.0, "token_weighted": None},
                }
            }
        }
    }
    (out / "r_report.json").write_text(json.dumps(report))
    return out, tasks


def test_table_from_newest_results_manifests_and_r_report(folders):
    out, tasks = folders
    table = rows(out, tasks)
    got = {(r["task"], r["metric"]): r for r in table}
    assert sorted(got) == [("cmoe_refloc", "IoU"), ("cmoe_sceneqa", "acc"), ("cmoe_sceneqa", "acc_count")]
    assert got["cmoe_sceneqa", "acc"] == {
        "task": "cmoe_sceneqa",
        "metric": "acc",
        "score": 0.8,
        "chance": 0.42,
        "n": None,
        "p": None,
        "r": 3.5,
        "r_text": 2.25,
        "r_image": 5.0,
    }
    assert got["cmoe_refloc", "IoU"]["chance"] is None and got["cmoe_refloc", "IoU"]["r"] is None
    text = markdown(table)
    assert text.splitlines()[0] == "| task | metric | score | chance | n | p | R total | R text | R image |"
    assert "| cmoe_sceneqa | acc | 0.800 | 0.420 |  |  | 3.50 | 2.25 | 5.00 |" in text
    assert "| cmoe_refloc | IoU | 0.400 |  |  |  |  |  |  |" in text
    assert write_table(out, tasks) == text == (out / "score_table.md").read_text()
    assert json.loads((out / "score_table.json").read_text()) == table


def test_r_from_the_per_sample_records_without_a_report(folders):
    out, tasks = folders
    (out / "r_report.json").unlink()
    records = [
        {
            "task": "cmoe_refloc",
            "doc_id": i,
            "tokens_by_modality": {"0": 30, "1": 60},
            "concepts_by_modality": {"0": 10, "1": 10},
        }
        for i in range(2)
    ]
    (out / "runs__demo__hf" / "r_stats_cmoe_refloc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (row,) = [r for r in rows(out, tasks) if r["task"] == "cmoe_refloc"]
    assert (row["r"], row["r_text"], row["r_image"]) == (pytest.approx(4.5), pytest.approx(3.0), pytest.approx(6.0))


def test_script(folders, tmp_path, capsys, monkeypatch):
    out, tasks = folders
    monkeypatch.setattr(
        sys, "argv", [str(SCRIPT), str(out), "--tasks-dir", str(tasks), "--out", str(tmp_path / "t.md")]
    )
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert done.value.code == 0 and "| cmoe_sceneqa | acc_count | 0.900 | 0.300 |  |  |" in capsys.readouterr().out
    assert (tmp_path / "t.md").is_file()
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), str(tmp_path / "empty")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert done.value.code == 2 and "no lmms-eval *_results.json" in capsys.readouterr().err


def test_n_and_binomial_p_from_the_sample_logs_for_0_1_metrics_only(folders):
    """From the newest sample log of a task: plain 0/1 scores and typed items counted under their own type; a
    fractional metric (IoU) gets no n or p; p is the chance model's tail P(X >= right)."""
    out, tasks = folders
    model = out / "runs__demo__hf"
    old = [{"doc_id": 0, "acc": 0.0, "acc_count": {"score": 0.0, "type": "count"}}]
    (model / "20250101_000000_samples_cmoe_sceneqa.jsonl").write_text("".join(json.dumps(x) + "\n" for x in old))
    os.utime(model / "20250101_000000_samples_cmoe_sceneqa.jsonl", (1_000, 1_000))
    lines = []
    for i in range(10):
        typ = "count" if i < 6 else "colour"
        score = float(i < 5)  # count: 5 of 6 right; colour: 0 of 4
        lines.append(
            {
                "doc_id": i,
                "acc": score,
                "acc_count": {"score": score, "type": typ},
                "acc_colour": {"score": score, "type": typ},
                "target": "3",
            }
        )
    (model / "20250102_000000_samples_cmoe_sceneqa.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    refloc = [{"doc_id": i, "IoU": 0.25 * i, "ACC@0.5": float(i > 1)} for i in range(4)]
    (model / "20250102_000000_samples_cmoe_refloc.jsonl").write_text("".join(json.dumps(x) + "\n" for x in refloc))
    got = {(r["task"], r["metric"]): r for r in rows(out, tasks)}
    assert (got["cmoe_sceneqa", "acc"]["n"], got["cmoe_sceneqa", "acc_count"]["n"]) == (10, 6)
    assert got["cmoe_sceneqa", "acc"]["p"] == pytest.approx(binomial_tail(5, 10, 0.42))
    assert got["cmoe_sceneqa", "acc_count"]["p"] == pytest.approx(6 * 0.3**5 * 0.7 + 0.3**6)
    assert got["cmoe_refloc", "IoU"]["n"] is None and got["cmoe_refloc", "IoU"]["p"] is None
    assert binomial_tail(0, 5, 0.5) == 1.0 and binomial_tail(3, 3, 0.5) == pytest.approx(0.125)
    assert binomial_tail(2, 5, 0.0) == 0.0 and binomial_tail(6, 5, 0.5) == 0.0 and binomial_tail(2, 5, 1.0) == 1.0
    # a thousand docs: the exact sum's terms overflow a float; by symmetry the tail past the mean at p 0.5 is
    # (1 + P(X = 500)) / 2
    half = math.comb(1000, 500) / 2**1000
    assert binomial_tail(500, 1000, 0.5) == pytest.approx((1 + half) / 2, rel=1e-9)
    assert 0.0 < binomial_tail(560, 1073, 0.4) < 1e-15


def test_table_goes_into_the_scored_exports_model_card(folders, tmp_path):
    from vlm.config import ConceptMoEVLMConfig
    from vlm.model_card import write_card

    out, tasks = folders
    export = tmp_path / "export"
    export.mkdir()
    write_card(export, ConceptMoEVLMConfig.from_preset("tiny"), 10, "x")
    newest = out / "runs__demo__hf" / "20250102_000000_results.json"
    data = json.loads(newest.read_text())
    data["config"] = {"model_args": f"pretrained={export},max_new_tokens=16"}
    newest.write_text(json.dumps(data))
    os.utime(newest, (2_000, 2_000))
    text = write_table(out, tasks)
    card = (export / "README.md").read_text()
    assert text in card and "chance: the best constant answer" in card
    assert card.index("## Evaluation") < card.index(text) < card.index("## How to load")


def test_unbound_level_and_its_tail_appear_only_where_the_manifest_has_one(folders):
    """A sceneqa manifest with ``unbound`` levels adds the two binding columns; the tail is taken against that
    level with the same n and right answers as ``p``; tasks without it leave the cells empty."""
    out, tasks = folders
    path = tasks / "cmoe_sceneqa" / "data" / "manifest.json"
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps(manifest | {"unbound": {"acc_count": 0.5}}))
    model = out / "runs__demo__hf"
    lines = [
        {"doc_id": i, "acc": float(i < 5), "acc_count": {"score": float(i < 5), "type": "count"}} for i in range(6)
    ]
    (model / "20250102_000000_samples_cmoe_sceneqa.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    table = rows(out, tasks)
    got = {(r["task"], r["metric"]): r for r in table}
    count = got["cmoe_sceneqa", "acc_count"]
    assert count["unbound"] == 0.5 and count["p_unbound"] == pytest.approx(binomial_tail(5, 6, 0.5))
    assert count["p"] == pytest.approx(binomial_tail(5, 6, 0.3)) and "unbound" not in got["cmoe_refloc", "IoU"]
    text = markdown(table).splitlines()
    assert text[0] == "| task | metric | score | chance | n | p | unbound | p unbound | R total | R text | R image |"
    assert f"| cmoe_sceneqa | acc_count | 0.900 | 0.300 | 6 | {count['p']:.2g} | 0.500 | 0.11 |" in "\n".join(text)
    assert "| cmoe_refloc | IoU | 0.400 |  |  |  |  |  |  |  |  |" in text
