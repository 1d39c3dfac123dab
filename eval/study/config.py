"""The study configuration (``scripts/configs/study.yaml``): reading, ``--set`` overrides, ``--quick`` and checks.

The YAML has the sections described in ``scripts/configs/study.yaml`` itself: ``baseline``, ``chunked_defaults``,
``seeds``, ``jobs``, ``eval_limit``, ``data`` / ``eval`` (where the shards and the task data live, and the
arguments that build them when missing), ``train_base`` (the training YAML every run starts from, passed through
verbatim: a field the trainer learns later just works), ``arms``, ``claims`` and ``quick`` (a block deep-merged over
the rest by ``--quick``; a list replaces a list). ``{out}`` in a path is the study's output folder.

A staged study (``scripts/configs/study_staged.yaml``) adds ``stages``: training YAMLs run in order before
``train_base`` (the last stage), each starting from the export of the one before (``eval.study.arms.train_yaml``).
Each stage, and ``train_base``, may name a shipped training YAML in ``from``: its fields are read first and the
entry's own deep-merged over them. ``data`` is then a list of shard sets, each ``{dir, build}`` (make_shards.py
arguments), ``{creates, command}`` (any command, e.g. stage 0's tower, run once when its file is missing) or
``{command}`` (run before every study run, e.g. ``make demo-shards``, which skips what exists itself). ``eval``
likewise builds its task data by ``build`` (make_eval_data.py arguments, when the data is missing) or ``command``
(run every time, e.g. ``make demo-eval-data``, which keeps the tasks already built with its options).

Every fault is a one-line ``StudyConfigError`` naming the field, raised before anything runs: an arm name used
twice, a claim that compares an arm the study does not have, an arm that does not list a claim it serves (or the
reverse), a metric a task's YAML does not define.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import yaml

from data_pipelines import run_config

REQUIRED = ("baseline", "seeds", "eval_limit", "data", "eval", "train_base", "arms", "claims")
# Per-run numbers a claim may compare (eval.study.collect builds them); ``score:TASK:METRIC`` for task scores.
RUN_METRICS = (
    "train_loss",
    "train_lm_loss",
    "bits_per_token",
    "mean_score",
    "eval_r",
    "eval_r_text",
    "eval_r_image",
    "eval_r_err",
    "train_r",
    "train_r_text",
    "train_r_image",
    "r_in_band",
    "lmms_r",
    "lmms_r_text",
    "lmms_r_image",
    "train_step_s",
    "train_wall_s",
)
EXPECT = ("higher", "lower")
NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class StudyConfigError(ValueError):
    """A bad study config field; the message is one line naming it."""


def deep_merge(base: dict, over: dict) -> dict:
    """``base`` with ``over`` merged in: mappings merge key by key, anything else (lists too) is replaced."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _task_metrics(tasks_dir: Path, task: str) -> list[str] | None:
    """The metric names of ``TASKS_DIR/TASK/TASK.yaml``'s ``metric_list`` (None when the YAML is not there)."""
    path = tasks_dir / task / f"{task}.yaml"
    if not path.is_file():
        return None

    class _Loader(yaml.SafeLoader):
        pass

    _Loader.add_multi_constructor("!", lambda loader, suffix, node: None)  # lmms-eval's !function tags
    spec = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader) or {}
    return [str(m.get("metric")) for m in spec.get("metric_list") or [] if isinstance(m, dict)]


def _check_metric(where: str, metric: str, tasks: dict) -> None:
    if metric in RUN_METRICS:
        return
    parts = metric.split(":")
    if len(parts) == 3 and parts[0] == "score" and parts[2] in tasks.get(parts[1], ()):
        return
    raise StudyConfigError(
        f"{where}: unknown metric {metric!r}; allowed: {', '.join(RUN_METRICS)}, or score:TASK:METRIC with TASK and "
        "METRIC among eval.main_metrics"
    )


def _check_arms(cfg: dict) -> None:
    names = set()
    for i, arm in enumerate(cfg["arms"]):
        if not isinstance(arm, dict) or not isinstance(arm.get("name"), str) or not NAME.match(arm["name"]):
            raise StudyConfigError(f"arms[{i}]: needs a name of letters, digits, '.', '_' or '-'")
        if arm["name"] in names:
            raise StudyConfigError(f"arms[{i}]: name {arm['name']!r} is used twice")
        names.add(arm["name"])
        unknown = set(arm) - {
            "name",
            "chunking",
            "target_r",
            "strategy",
            "match",
            "after_match",
            "vlm",
            "train",
            "serves",
            "note",
        }
        if unknown:
            raise StudyConfigError(f"arms[{i}] ({arm['name']}): unknown field {sorted(unknown)[0]!r}")
    if cfg["arms"][0].get("chunking") != "none":
        raise StudyConfigError("arms[0] must be the baseline (chunking: none): every ratio is taken against it")


def _check_claims(cfg: dict) -> None:
    arms = {a["name"]: set(a.get("serves") or ()) for a in cfg["arms"]}
    tasks = cfg["eval"]["main_metrics"]
    ids = set()
    for i, claim in enumerate(cfg["claims"]):
        cid = claim.get("id")
        if not isinstance(cid, str) or cid in ids:
            raise StudyConfigError(f"claims[{i}]: needs an id of its own")
        ids.add(cid)
        if not claim.get("compare"):
            raise StudyConfigError(f"claims[{i}] ({cid}): needs a compare list")
        for j, comp in enumerate(claim["compare"]):
            where = f"claims[{i}] ({cid}).compare[{j}]"
            if comp.get("expect") not in EXPECT:
                raise StudyConfigError(f"{where}.expect must be one of {', '.join(EXPECT)}")
            for side in ("a", "b"):
                if comp.get(side) not in arms:
                    raise StudyConfigError(f"{where}.{side}: {comp.get(side)!r} is not an arm of the study")
                if cid not in arms[comp[side]]:
                    raise StudyConfigError(f"arm {comp[side]!r} serves claim {cid!r} ({where}): list it in its serves")
            _check_metric(where, comp.get("metric", ""), tasks)
            _check_metric(where, comp.get("b_metric", comp.get("metric", "")), tasks)
    for name, served in arms.items():
        if served - ids:
            raise StudyConfigError(f"arm {name!r} serves unknown claim {sorted(served - ids)[0]!r}")


def _check_eval(cfg: dict) -> None:
    ev = cfg["eval"]
    for key in ("tasks", "main_metrics", "tasks_dir"):
        if key not in ev:
            raise StudyConfigError(f"missing config field 'eval.{key}'")
    makers = [key for key in ("build", "command") if key in ev]
    if len(makers) != 1 or not isinstance(ev[makers[0]], list):
        raise StudyConfigError(
            "eval: needs build (make_eval_data.py arguments, run when the data is missing) or command (run every time)"
        )
    for task in ev["tasks"]:
        names = ev["main_metrics"].get(task)
        if not names:
            raise StudyConfigError(f"eval.main_metrics: no main metric for task {task!r}")
        shipped = _task_metrics(Path(__file__).resolve().parents[1] / "tasks", task)
        if shipped is None:
            raise StudyConfigError(f"eval.tasks: {task!r} is not a task of eval/tasks")
        for metric in names:
            if metric not in shipped:
                raise StudyConfigError(f"eval.main_metrics.{task}: {metric!r} is not in the task's metric_list")


STAGE_FIELDS = ("name", "from", "model", "data", "train")


def _read_from(entry: dict, where: str) -> dict:
    """A training YAML entry with its ``from`` file read first and the entry's own fields merged over it."""
    entry = dict(entry)
    source = entry.pop("from", None)
    if source is None:
        return entry
    try:
        base = run_config.read_config(str(source))
    except (run_config.ConfigError, OSError) as err:
        raise StudyConfigError(f"{where}.from: {str(err).splitlines()[0]}") from None
    return deep_merge(base, entry)


def _check_stages(cfg: dict) -> None:
    """``stages`` (optional): named training YAMLs run before ``train_base``; ``from`` files read."""
    cfg["train_base"] = _read_from(cfg["train_base"], "train_base")
    stages = cfg.setdefault("stages", [])
    if not isinstance(stages, list):
        raise StudyConfigError("stages must be a list of training YAMLs, each with a name")
    names = set()
    for i, stage in enumerate(stages):
        name = stage.get("name") if isinstance(stage, dict) else None
        if not isinstance(name, str) or not NAME.match(name) or name in ("train", "eval") or name in names:
            raise StudyConfigError(
                f"stages[{i}]: needs a name of its own (letters, digits, '.', '_', '-'; not train or eval)"
            )
        names.add(name)
        unknown = set(stage) - set(STAGE_FIELDS)
        if unknown:
            raise StudyConfigError(f"stages[{i}] ({name}): unknown field {sorted(unknown)[0]!r}")
        stages[i] = {"name": name, **_read_from({k: v for k, v in stage.items() if k != "name"}, f"stages[{i}]")}


def data_sets(study: dict) -> list[dict]:
    """The study's ``data`` as a list of entries (``{dir, build}``, ``{creates, command}`` or ``{command}``): one set or
    a list."""
    data = study["data"]
    return data if isinstance(data, list) else [data]


def _check_data(cfg: dict) -> None:
    """``data``: one ``{dir, build}`` (the shards every stage defaults to), or a list of shard sets, each ``{dir,
    build}``, ``{creates, command}`` or ``{command}``; with a list every stage names its own ``data.shards``."""
    data = cfg["data"]
    shapes = ({"dir", "build"}, {"creates", "command"}, {"command"})
    for i, entry in enumerate(data_sets(cfg)):
        where = f"data[{i}]" if isinstance(data, list) else "data"
        ok = isinstance(entry, dict) and set(entry) in shapes
        if not ok or not isinstance(entry.get("build", entry.get("command")), list):
            raise StudyConfigError(
                f"{where}: needs dir and build (make_shards.py arguments), or a command (with creates: when missing)"
            )
    if isinstance(data, list):
        for where, stage in [*((f"stages[{i}]", s) for i, s in enumerate(cfg["stages"])), ("train_base", None)]:
            stage = cfg["train_base"] if stage is None else stage
            if not (stage.get("data") or {}).get("shards"):
                raise StudyConfigError(f"{where}: needs data.shards (the study's data is a list of shard sets)")


def _fill_out(node, out: str):
    """``{out}`` in every string of ``node`` replaced by the output folder."""
    if isinstance(node, dict):
        return {k: _fill_out(v, out) for k, v in node.items()}
    if isinstance(node, list):
        return [_fill_out(v, out) for v in node]
    return node.replace("{out}", out) if isinstance(node, str) else node


def load_study_config(path: str, sets: list[str] = (), quick: bool = False, out: str | None = None) -> dict:
    """The study config: ``path`` read, ``--set`` applied, ``quick`` merged (with ``--quick``), checked; ``out``
    (default: the config's ``out``) fills ``{out}``. The result also holds ``out`` and ``quick``."""
    try:
        raw = run_config.read_config(path, sets)
    except run_config.ConfigError as err:
        raise StudyConfigError(f"study config: {err}") from None
    quick_block = raw.pop("quick", None) or {}
    cfg = deep_merge(raw, quick_block) if quick else raw
    for key in REQUIRED:
        if key not in cfg:
            raise StudyConfigError(f"missing config field {key!r}")
    cfg["out"] = out or cfg.get("out") or ("runs/study-quick" if quick else "runs/study")
    cfg["quick"] = quick
    cfg = _fill_out(cfg, cfg["out"])
    cfg.setdefault("title", None)  # the doc's heading (eval.study.markdown.DEFAULT_TITLE when unset)
    cfg.setdefault("jobs", 2)
    cfg.setdefault("r_band", 0.15)
    cfg.setdefault("prefill", {"tokens": 4096, "repeats": 3})
    if not isinstance(cfg["seeds"], int) or cfg["seeds"] < 1:
        raise StudyConfigError(f"seeds must be an int >= 1, got {cfg['seeds']!r}")
    _check_eval(cfg)
    _check_stages(cfg)
    _check_data(cfg)
    if not isinstance(cfg["arms"], list) or not cfg["arms"]:
        raise StudyConfigError("arms must be a non-empty list")
    _check_arms(cfg)
    _check_claims(cfg)
    if quick and "arms_run" in quick_block:
        cfg["arms_run"] = list(quick_block["arms_run"])
    return cfg


def select_arms(cfg: dict, names: list[str] | None) -> list[dict]:
    """The arms to run, in config order: ``names`` (``--arms``), else ``arms_run`` (``--quick``), else all. The
    baseline always runs: every prefill ratio is taken against it."""
    wanted = names or cfg.get("arms_run")
    known = [a["name"] for a in cfg["arms"]]
    if wanted:
        unknown = [n for n in wanted if n not in known]
        if unknown:
            raise StudyConfigError(f"--arms: unknown arm {unknown[0]!r}; the study has {', '.join(known)}")
        wanted = {known[0], *wanted}
    return [a for a in cfg["arms"] if not wanted or a["name"] in wanted]
