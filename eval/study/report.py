"""``study.json`` and the study's doc (``docs/study.md``; ``OUT/study.md`` with ``--quick``) from the run files.

``gather`` reads every finished run of the selected arms (``eval.study.collect``), the prefill phase's
``prefill.json`` and the commands the runs recorded, aggregates mean ± std over seeds and judges the claims
(``eval.study.claims``). ``write`` saves it as ``OUT/study.json``, draws the plots (``eval.study.plots``) and writes
the doc (``eval.study.markdown``). Nothing here is typed by hand: ``--report-only`` rebuilds both from the files.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import yaml

from eval.study import plots
from eval.study.arms import Arm
from eval.study.claims import judge
from eval.study.collect import aggregate, chance_of, collect_run, read_json, run_dir

_CHANCE_METRICS = ("mean_score",)
SETTINGS = (
    ("train", "max_steps"),
    ("train", "lr"),
    ("train", "warmup"),
    ("train", "eval_batches"),
    ("data", "seq_len"),
    ("data", "batch_size"),
)


def run_settings(path: Path) -> dict:
    """The training settings a run used, from its own ``train.yaml`` (what the doc's setup line reports)."""
    try:
        config = yaml.safe_load((path / "train.yaml").read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        return {}
    return {f"{s}.{k}": (config.get(s) or {}).get(k) for s, k in SETTINGS}


def _finite(node):
    """``node`` with every non-finite float replaced by None (strict JSON)."""
    if isinstance(node, dict):
        return {k: _finite(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_finite(v) for v in node]
    return None if isinstance(node, float) and not math.isfinite(node) else node


def stages_summary(study: dict) -> list[dict]:
    """The stages before the last (a staged study): name, steps and shards of each, for the doc's setup."""
    return [
        {
            "name": st["name"],
            "max_steps": (st.get("train") or {}).get("max_steps"),
            "shards": list((st.get("data") or {}).get("shards") or ()),
        }
        for st in study.get("stages") or ()
    ]


def run_commands(path: Path) -> dict:
    """The train and eval commands one run recorded (the report shows the first run's)."""
    result = read_json(path / "result.json") or {}
    train, evaluation = result.get("train") or {}, result.get("eval") or {}
    stages = [rec.get("command") for name, rec in (train.get("stages") or {}).items() if name != "train"]
    return {"train": train.get("command"), "eval": evaluation.get("command"), "run": str(path), "stages": stages}


def add_prefill(agg: dict, prefill: dict, arms: list[Arm]) -> None:
    """Each arm's measured prefill-time ratio (``prefill.json``) as one more aggregated number."""
    for arm in arms:
        entry = (prefill.get("arms") or {}).get(arm.name)
        if entry and agg.get(arm.name):
            agg[arm.name]["prefill_ratio"] = {"mean": entry["ratio"], "std": None, "n": 1, "values": [entry["ratio"]]}


def gather(study: dict, arms: list[Arm]) -> dict:
    """Every number of the study (see the module docstring), as ``study.json`` holds it."""
    ev, band = study["eval"], study["r_band"]
    tasks, main = ev["tasks"], ev["main_metrics"]
    score_keys = [f"score:{t}:{m}" for t in tasks for m in main[t]]
    runs, agg, chance, commands, settings = {}, {}, {}, {}, []
    for arm in arms:
        runs[arm.name] = {}
        for seed in range(study["seeds"]):
            path = run_dir(study["out"], arm.name, seed)
            if not (path / "result.json").is_file():
                continue
            runs[arm.name][seed] = collect_run(path, arm.targets, band, main, tasks)
            if (mine := run_settings(path)) not in settings:
                settings.append(mine)
            commands = commands or run_commands(path)
        numbers = list(runs[arm.name].values())
        agg[arm.name] = aggregate(numbers)
        chance[arm.name] = (
            {k: chance_of(numbers[0], k, main, tasks) for k in (*_CHANCE_METRICS, *score_keys)} if numbers else {}
        )
    prefill = read_json(Path(study["out"]) / "prefill.json") or {}
    add_prefill(agg, prefill, arms)
    names = {a.name for a in arms}
    claims = [c for c in study["claims"] if all(x in names for comp in c["compare"] for x in (comp["a"], comp["b"]))]
    skipped_claims = [c["id"] for c in study["claims"] if c not in claims]
    return _finite(
        {
            "generated": time.strftime("%Y-%m-%d %H:%M:%S"),
            "quick": study["quick"],
            "out": study["out"],
            "seeds_requested": study["seeds"],
            "baseline": study["baseline"],
            "chunked_defaults": study.get("chunked_defaults"),
            "train_base": study["train_base"],
            "stages": stages_summary(study),
            "run_settings": settings,
            "eval": {
                "tasks": tasks,
                "main_metrics": {t: main[t] for t in tasks},
                "limit": study["eval_limit"],
                "tasks_dir": ev["tasks_dir"],
            },
            "r_band": band,
            "arms": [a.summary() for a in arms],
            "runs": runs,
            "aggregate": agg,
            "chance": chance,
            "prefill": prefill,
            "claims": judge(claims, agg, chance),
            "claims_not_in_this_selection": skipped_claims,
            "commands": commands,
            "seeds_by_arm": {a.name: sorted(runs[a.name]) for a in arms},
        }
    )


def _rel(path: Path, start: Path) -> str:
    return os.path.relpath(path, start).replace(os.sep, "/")


def write(study: dict, arms: list[Arm], doc: Path, plots_dir: Path, context: dict) -> dict:
    """Write ``OUT/study.json``, the plots under ``plots_dir`` and the doc; returns the gathered data.

    ``context``: ``command`` (the study's command line), ``outcomes`` ("arm/seedK" -> outcome of this invocation,
    or None for ``--report-only``), ``notes`` (a markdown file inserted verbatim when it exists)."""
    from eval.study.markdown import render

    data = gather(study, arms)
    data["invocation"] = {"command": context.get("command"), "outcomes": context.get("outcomes")}
    plots_dir.mkdir(parents=True, exist_ok=True)
    cfg_plots = study.get("plots") or {}
    names = [a.name for a in arms]
    wanted = cfg_plots.get("loss_arms", "all")
    loss_arms = names if wanted == "all" else [n for n in wanted if n in names]
    figures = {"loss": plots.loss_curves(study["out"], loss_arms, study["seeds"], plots_dir / "loss_curves.png")}
    r_arm = cfg_plots.get("r_arm") if cfg_plots.get("r_arm") in names else next((a.name for a in arms[1:]), None)
    if r_arm:
        figures["r_modality"] = plots.r_by_modality(study["out"], r_arm, study["seeds"], plots_dir / "r_modality.png")
    control = [n for n in cfg_plots.get("r_control") or () if n in names]
    if control:
        figures["r_control"] = plots.r_control(study["out"], control, study["seeds"], plots_dir / "r_control.png")
    sweep = [a for a in arms if a.name in (cfg_plots.get("score_vs_r") or names)]
    points = [
        (
            a.name,
            a.config.effective_r,
            data["aggregate"][a.name].get("mean_score"),
            data["aggregate"][a.name].get("bits_per_token"),
        )
        for a in sweep
    ]
    chance = next((c.get("mean_score") for c in data["chance"].values() if c), None)
    figures["score_vs_r"] = plots.score_vs_r(points, plots_dir / "score_vs_r.png", chance)
    data["plots"] = {k: str(v) for k, v in figures.items() if v is not None}
    data["plots_r_arm"] = r_arm
    out_json = Path(study["out"]) / "study.json"
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    notes_path = context.get("notes")
    notes = Path(notes_path).read_text(encoding="utf-8") if notes_path and Path(notes_path).is_file() else None
    links = {k: _rel(Path(v), doc.parent) for k, v in data["plots"].items()}
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(render(data, study, links, notes, notes_path), encoding="utf-8")
    return data
