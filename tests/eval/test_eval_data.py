import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from data_pipelines import prompts, synthetic
from data_pipelines.chat import turn_text
from data_pipelines.synthetic import conversations
from eval import metrics
from eval.eval_data import NIAH_LENGTHS, SCENEQA_TYPES, TASKS, TASKS_DIR, write_eval_sets
from eval.tasks import common


class _TaskLoader(yaml.SafeLoader):
    """Reads a task YAML, ``!function`` tags as plain strings."""


_TaskLoader.add_multi_constructor("!", lambda loader, suffix, node: loader.construct_scalar(node))


def _task_yaml(task) -> dict:
    return yaml.load((TASKS_DIR / task / f"{task}.yaml").read_text(), Loader=_TaskLoader)


def _yaml_kwargs(task) -> dict:
    """The YAML's ``lmms_eval_specific_kwargs`` (pre / post affixes), as lmms-eval passes them to doc_to_text."""
    return _task_yaml(task)["lmms_eval_specific_kwargs"]["default"]


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


def test_keep_leaves_same_options_alone_and_rebuilds_the_rest(small_sets, tmp_path):
    """``keep`` (make_eval_data.py --keep, which make demo runs every time) skips a task whose manifest records the
    same options and whose JSONL is intact, and rebuilds one built with other sizes or edited since."""
    out = tmp_path / "tasks"
    write_eval_sets(out, seed=0, tasks=["cmoe_refloc", "cmoe_sceneqa_one"], refloc_n=3, sceneqa_one_n=2)
    refloc = out / "cmoe_refloc" / "data" / "test.jsonl"
    stamp = refloc.stat().st_mtime_ns
    kept = write_eval_sets(
        out, seed=0, tasks=["cmoe_refloc", "cmoe_sceneqa_one"], refloc_n=3, sceneqa_one_n=3, keep=True
    )
    assert refloc.stat().st_mtime_ns == stamp and kept["cmoe_refloc"]["docs"] == 3  # same options: untouched
    assert kept["cmoe_sceneqa_one"]["docs"] == 3 * len(SCENEQA_TYPES)  # other size: rebuilt (4 docs per scene)
    assert len(_docs(out, "cmoe_sceneqa_one")) == 3 * len(SCENEQA_TYPES)
    refloc.write_text(refloc.read_text()[:-2])  # a damaged file no longer hashes as recorded: rebuilt
    write_eval_sets(out, seed=0, tasks=["cmoe_refloc"], refloc_n=3, keep=True)
    assert len(_docs(out, "cmoe_refloc")) == 3
    before = _docs(out, "cmoe_refloc")
    write_eval_sets(out, seed=1, tasks=["cmoe_refloc"], refloc_n=3, keep=True)  # another seed: rebuilt
    assert _docs(out, "cmoe_refloc") != before


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
    cmd = [sys.executable, str(script), "--tasks", "cmoe_refloc,cmoe_sceneqa", "--refloc-n", "2", "--sceneqa-n", "1"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    subprocess.run(cmd, cwd=tmp_path, env=env, check=True, capture_output=True, timeout=120)
    task = tmp_path / "eval" / "tasks" / "cmoe_refloc"
    assert len(_docs(tmp_path / "eval" / "tasks", "cmoe_refloc")) == 2
    assert (task / "cmoe_refloc.yaml").is_file() and (task / "utils.py").is_file()
    sceneqa = json.loads((tmp_path / "eval" / "tasks" / "cmoe_sceneqa" / "data" / "manifest.json").read_text())
    assert sceneqa["options"]["n"] == 1 and sceneqa["chance"]["acc_count"] == 1.0  # one count doc: its answer
    assert sorted(p.name for p in (TASKS_DIR / "cmoe_refloc").iterdir()) == shipped  # the package is untouched


def _conversations(kind: str, generator: dict, **options) -> list:
    """``kind``'s conversations on the generator sample an eval doc was made from (its recorded kind, seed, split
    and index)."""
    g = generator
    *_, base = synthetic.generate(g["kind"], g["index"] + 1, g["seed"], g["split"], **options)
    return conversations.conversations(kind, base, g["seed"], g["split"], g["index"])


def _user_turn(kind: str, generator: dict, question: str, **options):
    (conv,) = [c for c in _conversations(kind, generator, **options) if c.meta["question"] == question]
    return conv.turns[0]


def _image_bytes(segments) -> list[bytes]:
    return [seg.image for seg in segments if seg.image is not None]


def test_chat_kinds_speak_the_tasks_language(eval_tasks_dir):
    """The user turn of each chat kind's conversation on an eval doc's base sample is exactly the task's
    ``doc_to_text`` (with the YAML's affixes), and carries the doc's images in order."""
    root = eval_tasks_dir
    data = lambda task: root / task / "data"
    read = lambda task, rel: (data(task) / rel).read_bytes()
    for doc in _docs(root, "cmoe_sceneqa"):
        user = _user_turn("scenes_chat", doc["generator"], doc["question"])
        assert turn_text(user) == common.sceneqa_text(doc, _yaml_kwargs("cmoe_sceneqa"))
        assert turn_text(user) == prompts.sceneqa(doc["question"])
        assert _image_bytes(user.segments) == [read("cmoe_sceneqa", doc["image"])]
    for doc in _docs(root, "cmoe_longdoc"):
        pages = doc["num_pages"]
        user = _user_turn("documents_chat", doc["generator"], doc["question"], min_pages=pages, max_pages=pages)
        assert turn_text(user) == common.longdoc_text(doc, _yaml_kwargs("cmoe_longdoc"))
        assert _image_bytes(user.segments) == [read("cmoe_longdoc", p) for p in doc["pages"]]
    for doc in _docs(root, "cmoe_niah"):
        units = NIAH_LENGTHS[doc["length"]]
        user = _user_turn("needles_chat", doc["generator"], doc["question"], min_units=units, max_units=units)
        assert turn_text(user) == common.niah_text(doc, _yaml_kwargs("cmoe_niah"))
        assert _image_bytes(user.segments) == [read("cmoe_niah", s["image"]) for s in doc["segments"] if s.get("image")]
    # refloc: the eval doc draws its own target; the scenes_chat box question goes through the same builder
    for doc in _docs(root, "cmoe_refloc"):
        refloc = [c for c in _conversations("scenes_chat", doc["generator"]) if c.meta["task"] == "refloc"]
        for conv in refloc:
            as_doc = {"expression": conv.meta["expression"]}
            assert turn_text(conv.turns[0]) == common.refloc_text(as_doc, _yaml_kwargs("cmoe_refloc"))
            assert metrics.parse_box(turn_text(conv.turns[1])) == [round(v, 2) for v in conv.qa[0]["box"]]
        assert common.refloc_text(doc, _yaml_kwargs("cmoe_refloc")) == prompts.refloc(doc["expression"])
        assert _image_bytes(refloc[0].turns[0].segments) == [read("cmoe_refloc", doc["image"])]


@pytest.mark.parametrize("task", ["cmoe_sceneqa", "cmoe_sceneqa_one"])
def test_sceneqa_docs(eval_tasks_dir, task):
    docs = _docs(eval_tasks_dir, task)
    assert task == "cmoe_sceneqa" or all(d["num_objects"] == 1 for d in docs)
    by_scene = {}
    for d in docs:
        by_scene.setdefault(d["generator"]["index"], []).append(d)
        assert d["answer"] == d["answer"].lower() and d["group"] == d["type"] in SCENEQA_TYPES
        assert common.sceneqa_text(d).endswith(f"\n{d['question']}\n{prompts.SCENEQA_INSTRUCTION}")
    assert sorted(by_scene) == [0, 1, 2] and len({d["id"] for d in docs}) == len(docs)
    for scene_docs in by_scene.values():
        g = scene_docs[0]["generator"]
        *_, sample = synthetic.generate(g["kind"], g["index"] + 1, g["seed"], g["split"], **g.get("options", {}))
        types = [qa["type"] for qa in sample.qa]
        assert [d["type"] for d in scene_docs] == [t for t in SCENEQA_TYPES if t in types]  # one doc per type, in order
        assert all({"q": d["question"], "a": d["answer"], "type": d["type"]} in sample.qa for d in scene_docs)
        for d in scene_docs:  # a reader of the scene's values that cannot bind them: one of them at random
            values = {o[d["type"]] for o in sample.meta["objects"]} if d["type"] != "count" else None
            assert d.get("unbound") == (None if values is None else pytest.approx(1 / len(values)))
    unbound = json.loads((eval_tasks_dir / task / "data" / "manifest.json").read_text()).get("unbound", {})
    for t in ("colour", "shape", "position") if task == "cmoe_sceneqa" else ():  # one object: nothing to bind
        levels = [d["unbound"] for d in docs if d["type"] == t]
        assert unbound.get(f"acc_{t}") == (pytest.approx(sum(levels) / len(levels)) if levels else None)
    assert task == "cmoe_sceneqa" or unbound == {}
    scores = common.sceneqa_results(docs[0], [docs[0]["answer"].upper() + ". "])
    assert scores["acc"] == 1.0 and scores[f"acc_{docs[0]['type']}"] == {"score": 1.0, "type": docs[0]["type"]}
    assert common.sceneqa_results(docs[0], ["no idea"])["acc"] == 0.0


def test_manifests_hold_the_chance_level_of_every_metric(eval_tasks_dir):
    for task in TASKS:
        manifest = json.loads((eval_tasks_dir / task / "data" / "manifest.json").read_text())
        names = [m["metric"] for m in _task_yaml(task)["metric_list"]]
        assert sorted(manifest["chance"]) == sorted(names) == sorted(manifest["chance_constant"]), task
        assert all(v is None or 0.0 <= v <= 1.0 for v in manifest["chance"].values()), manifest["chance"]
    # recomputed by hand: the majority answer's share per sceneqa type, each type's own majority for acc
    docs = _docs(eval_tasks_dir, "cmoe_sceneqa")
    chance = json.loads((eval_tasks_dir / "cmoe_sceneqa" / "data" / "manifest.json").read_text())["chance"]
    hits = 0
    for t in SCENEQA_TYPES:
        answers = [d["answer"] for d in docs if d["type"] == t]
        best = max((answers.count(a) for a in set(answers)), default=0)
        hits += best
        assert chance[f"acc_{t}"] == (pytest.approx(best / len(answers)) if answers else None)
    assert chance["acc"] == pytest.approx(hits / len(docs))
    # refloc: the chosen constant box scores what the manifest says, and no worse than the mean box
    docs = _docs(eval_tasks_dir, "cmoe_refloc")
    manifest = json.loads((eval_tasks_dir / "cmoe_refloc" / "data" / "manifest.json").read_text())
    mean_box = [sum(d["bbox"][k] for d in docs) / len(docs) for k in range(4)]
    for metric, answer in manifest["chance_constant"].items():
        scored = [common.refloc_results(d, [answer])[metric] for d in docs]
        assert manifest["chance"][metric] == pytest.approx(sum(scored) / len(docs))
        mean_scores = [metrics.box_scores(d["bbox"], mean_box)[metric] for d in docs]
        assert manifest["chance"][metric] >= sum(mean_scores) / len(docs) - 0.02  # the grid / rounding may lose a bit
    niah = json.loads((eval_tasks_dir / "cmoe_niah" / "data" / "manifest.json").read_text())["chance"]
    assert niah["acc"] == 0.5 and niah["acc_image"] is None  # 2 distinct answers; no image needle in 2 docs
