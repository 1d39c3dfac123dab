import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from data_pipelines import synthetic
from eval.eval_data import TASKS, TASKS_DIR, write_eval_sets
from eval.tasks import common


def _digest_tree(root):
    """sha256 of every file under each task's data folder, by relative path."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for task in TASKS
        for p in sorted((root / task / "data").rglob("*"))
        if p.is_file()
    }


def _docs(root, task):
    return [json.loads(line) for line in (root / task / "data" / "test.jsonl").read_text().splitlines()]


def test_same_seed_same_bytes_other_seed_other_data(eval_tasks_dir, small_sets, tmp_path):
    again = tmp_path / "again"
    write_eval_sets(again, seed=0, **small_sets)
    assert _digest_tree(eval_tasks_dir) == _digest_tree(again)
    other = tmp_path / "other"
    write_eval_sets(other, seed=1, tasks=["cmoe_refloc"], refloc_n=3)
    assert _docs(other, "cmoe_refloc") != _docs(eval_tasks_dir, "cmoe_refloc")
    # the include path is self-contained: YAML and utils.py sit next to the data
    for task in TASKS:
        assert (eval_tasks_dir / task / f"{task}.yaml").is_file() and (eval_tasks_dir / task / "utils.py").is_file()


def test_buckets_and_fields(eval_tasks_dir):
    longdoc = _docs(eval_tasks_dir, "cmoe_longdoc")
    assert [d["num_pages"] for d in longdoc] == [1, 2] and all(len(d["pages"]) == d["num_pages"] for d in longdoc)
    niah = _docs(eval_tasks_dir, "cmoe_niah")
    assert [(d["depth"], d["modality"], d["length"]) for d in niah] == [(0.0, "text", "short"), (0.1, "text", "short")]
    assert all(d["needle"] in [s.get("text") for s in d["segments"]] for d in niah)  # text needles are in context
    for d in _docs(eval_tasks_dir, "cmoe_refloc"):
        x1, y1, x2, y2 = d["bbox"]
        assert 0 <= x1 < x2 <= 1 and 0 <= y1 < y2 <= 1 and d["expression"]


def test_disjoint_from_training_samples(eval_tasks_dir):
    """Eval docs come from the generators' eval split: no page text, haystack paragraph or scene image of
    training samples (same seed) appears in them."""
    train_pages = set()
    for s in synthetic.generate("documents", 30, 0, "train"):
        train_pages.update(line for text in s.meta["page_texts"] for line in text.splitlines() if len(line) > 30)
    train_paragraphs = {seg.text for s in synthetic.generate("needles", 30, 0, "train") for seg in s.segments[:-1]}
    train_images = {
        hashlib.sha256(seg.image).hexdigest()
        for s in synthetic.generate("scenes", 200, 0, "train")
        for seg in s.segments
        if seg.image
    }
    eval_root = eval_tasks_dir
    eval_images = {
        hashlib.sha256((eval_root / "cmoe_refloc" / "data" / d["image"]).read_bytes()).hexdigest()
        for d in _docs(eval_root, "cmoe_refloc")
    }
    assert not eval_images & train_images
    eval_paragraphs = {s["text"] for d in _docs(eval_root, "cmoe_niah") for s in d["segments"] if s.get("text")}
    assert not {p for p in eval_paragraphs if len(p) > 30} & train_paragraphs
    eval_keys = {d["key"] for t in TASKS for d in _docs(eval_root, t)}
    assert all("-eval-" in k for k in eval_keys)
    # page text: the eval documents regenerated from their recorded generator call, line by line
    eval_lines = set()
    for d in _docs(eval_root, "cmoe_longdoc"):
        g, pages = d["generator"], d["num_pages"]
        *_, sample = synthetic.generate(
            "documents", g["index"] + 1, g["seed"], g["split"], min_pages=pages, max_pages=pages
        )
        assert sample.qa[0]["a"] == d["answer"]
        eval_lines.update(line for text in sample.meta["page_texts"] for line in text.splitlines() if len(line) > 30)
    assert eval_lines and not eval_lines & train_pages


def test_bad_lines_and_missing_images_are_skipped_and_counted(eval_tasks_dir, caplog):
    data_dir = eval_tasks_dir / "cmoe_refloc" / "data"
    good = (data_dir / "test.jsonl").read_text().splitlines()
    missing = json.loads(good[0]) | {"image": "images/nope.png"}
    lines = [good[0], "{not json", json.dumps(missing), json.dumps({"id": "x"}), "[1, 2]", "", good[1]]
    with caplog.at_level(logging.WARNING, logger="lmms-eval"):
        docs, skipped = common.parse_lines(lines, data_dir, "cmoe_refloc")
    assert [d["id"] for d in docs] == [json.loads(good[0])["id"], json.loads(good[1])["id"]]
    assert skipped == {"malformed": 2, "missing_field": 1, "missing_image": 1}
    assert "line 2 skipped, malformed JSON" in caplog.text and "nope.png" in caplog.text
    with pytest.raises(FileNotFoundError, match="nope.png"):
        common.refloc_visual({"image": str(data_dir / "images" / "nope.png")})


def test_script_default_out_is_relative_to_the_current_directory(tmp_path):
    """``scripts/make_eval_data.py`` without ``--out`` writes ``./eval/tasks`` under the current directory (never into
    the installed package), with the task YAML and utils.py copied beside the data for ``--include_path``."""
    repo = Path(__file__).resolve().parents[2]
    shipped = sorted(p.name for p in (TASKS_DIR / "cmoe_refloc").iterdir())
    script = repo / "scripts" / "make_eval_data.py"
    cmd = [sys.executable, str(script), "--tasks", "cmoe_refloc", "--refloc-n", "2"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    subprocess.run(cmd, cwd=tmp_path, env=env, check=True, capture_output=True, timeout=120)
    task = tmp_path / "eval" / "tasks" / "cmoe_refloc"
    assert len(_docs(tmp_path / "eval" / "tasks", "cmoe_refloc")) == 2
    assert (task / "cmoe_refloc.yaml").is_file() and (task / "utils.py").is_file()
    assert sorted(p.name for p in (TASKS_DIR / "cmoe_refloc").iterdir()) == shipped  # the package is untouched
