"""A staged study (``stages`` in a study YAML, ``scripts/configs/study_staged.yaml``): each stage's training YAML read
through ``from`` with the entry's own fields over it, the arm's model built in the first stage only, every later
stage started from the export before it, the config faults named in one line, and ``{creates, command}`` data
entries run once. The stages training end to end: ``test_study.py`` (the quick block has a stage before the last)."""

from pathlib import Path

import pytest
import yaml

from eval.study.arms import build_arms, stage_names, train_yaml
from eval.study.config import StudyConfigError, load_study_config
from eval.study.runner import Log, ensure_data

ROOT = Path(__file__).resolve().parents[2]
STAGED = ROOT / "scripts" / "configs" / "study_staged.yaml"


def test_stages_chain_through_their_exports(tmp_path):
    cfg = load_study_config(str(STAGED), out=str(tmp_path / "out"))
    moe, r2 = build_arms(cfg, cfg["arms"][:2])
    assert stage_names(cfg) == ["stage1_colour", "stage1", "train"]
    run = str(tmp_path / "out" / "runs" / "r2" / "seed1")
    first, middle, last = (train_yaml(cfg, r2, 1, stage, run) for stage in stage_names(cfg))
    shipped = {
        n: yaml.safe_load((ROOT / "scripts" / "configs" / f"{n}.yaml").read_text()) for n in ("stage1", "stage2")
    }
    # stage 1a: the baseline preset, the tower's settings of stage1_colour.yaml, the tower of {out}, the arm's shape
    over = first["model"]["overrides"]
    assert first["model"]["preset"] == "tiny-moe" and "init_from" not in first["model"]
    assert over["vision_stem"] == "conv" and over["freeze_vision"] is True and over["vision_words"] is True
    assert over["vision_weights"] == str(tmp_path / "out" / "tower" / "tower.safetensors")
    assert (
        over["target_r"] == 2.0
        and over["chunking"] == "dynamic"
        and over["concept_top_k"] == r2.overrides["concept_top_k"]
    )
    assert "target_r" not in train_yaml(cfg, moe, 1, "stage1_colour", run)["model"]["overrides"]
    # stages 1b and 2: the shipped YAML's fields, the entry's batch of 8 over them, the export before as the model
    assert middle["model"] == {
        "init_from": f"{run}/stage1_colour/hf",
        "overrides": shipped["stage1"]["model"]["overrides"],
    }
    assert last["model"]["init_from"] == f"{run}/stage1/hf"
    assert middle["train"] == {**shipped["stage1"]["train"], "seed": 1} and middle["data"]["batch_size"] == 8
    assert last["data"] == {**shipped["stage2"]["data"], "batch_size": 8} and last["train"]["max_steps"] == 300
    assert all("eval_shards" not in s["data"] for s in (first, middle))  # only the last stage evaluates


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"stages": [{"name": "train"}]}, r"stages\[0\]: needs a name of its own"),
        ({"stages": [{"name": "a", "form": "x.yaml"}]}, r"stages\[0\] \(a\): unknown field 'form'"),
        ({"stages": [{"name": "a", "from": "nope/missing.yaml"}]}, r"stages\[0\]\.from: "),
        ({"stages": [{"name": "a", "train": {"max_steps": 2}}]}, r"stages\[0\]: needs data\.shards"),
        ({"data": [{"dir": "x"}]}, r"data\[0\]: needs dir and build .*, or a command \(with creates"),
        (
            {"eval": {"tasks": ["cmoe_sceneqa"], "tasks_dir": "t", "main_metrics": {"cmoe_sceneqa": ["acc"]}}},
            r"eval: needs build \(make_eval_data.py arguments.*\) or command",
        ),
    ],
)
def test_stage_config_faults_are_one_line(tmp_path, edit, message):
    raw = yaml.safe_load(STAGED.read_text())
    raw.pop("quick", None)
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump({**raw, **edit}))
    with pytest.raises(StudyConfigError, match=message) as err:
        load_study_config(str(path), out=str(tmp_path / "out"))
    assert "\n" not in str(err.value)


def test_a_creates_entry_runs_once_and_only_when_missing(tmp_path):
    """A ``{creates, command}`` entry runs only while its file is missing; a ``{command}`` entry (``make
    demo-shards``, which skips what exists itself) runs every time."""
    made, shards, tasks = tmp_path / "tower" / "made.txt", tmp_path / "shards", tmp_path / "tasks"
    runs = tmp_path / "runs.txt"
    for split in ("train", "eval"):
        (shards / split).mkdir(parents=True)
        (shards / split / "manifest.json").write_text("{}")
    (tasks / "cmoe_sceneqa" / "data").mkdir(parents=True)
    (tasks / "cmoe_sceneqa" / "data" / "test.jsonl").write_text("")
    script = f"import pathlib, sys; p = pathlib.Path({str(made)!r}); p.parent.mkdir(); p.write_text(sys.executable)"
    study = {
        "data": [
            {"dir": str(shards), "build": ["--never-run"]},
            {"creates": str(made), "command": ["{python}", "-c", script]},
            {"command": ["{python}", "-c", f"open({str(runs)!r}, 'a').write('x')"]},
        ],
        "eval": {"tasks": ["cmoe_sceneqa"], "tasks_dir": str(tasks), "build": []},
    }
    log = Log(tmp_path / "study.log")
    ensure_data(study, log)
    assert Path(made.read_text()).name.startswith("python")  # {python} was this interpreter
    ensure_data(study, log)  # the file is there: the command (which would fail: the folder exists) does not run
    assert (tmp_path / "study.log").read_text().count(f"building {made}") == 1
    assert runs.read_text() == "xx"


def test_an_eval_command_runs_every_time_and_its_failure_stops_the_study(tmp_path):
    """``eval.command`` (the staged studies' ``make demo-eval-data``) runs before every study run, even with the
    task data present (the command itself keeps what is up to date); a failing one stops with a one-line error."""
    runs, tasks = tmp_path / "runs.txt", tmp_path / "tasks"
    (tasks / "cmoe_sceneqa" / "data").mkdir(parents=True)
    (tasks / "cmoe_sceneqa" / "data" / "test.jsonl").write_text("")
    ev = {"tasks": ["cmoe_sceneqa"], "tasks_dir": str(tasks)}
    study = {"data": [], "eval": {**ev, "command": ["{python}", "-c", f"open({str(runs)!r}, 'a').write('x')"]}}
    log = Log(tmp_path / "study.log")
    ensure_data(study, log)
    ensure_data(study, log)
    assert runs.read_text() == "xx"
    study["eval"]["command"] = ["{python}", "-c", "raise SystemExit(3)"]
    with pytest.raises(SystemExit, match="building the eval data into .* failed"):
        ensure_data(study, log)
