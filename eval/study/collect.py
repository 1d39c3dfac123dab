"""Every number of the study, read from the files each run wrote (never typed by hand), and their mean ± std.

A run folder ``OUT/runs/<arm>/seed<k>/`` holds ``train/metrics.jsonl`` (the trainer's records:
``vlm/training/metrics.py``, ``vlm/training/step.py`` ``evaluate``), ``eval/score_table.json`` and
``eval/r_report.json`` (``eval/score_table.py``, ``eval/r_report.py`` over the lmms-eval output) and ``result.json``
(the study's own record: wall times, commands). From them, per run:

- ``train_loss`` / ``train_lm_loss``: mean ``loss`` (all terms) / ``lm_loss`` over the last 10% of the steps;
- ``bits_per_token``, ``eval_r``, ``eval_r_text``, ``eval_r_image``: the last held-out evaluation of the run
  (``"split": "eval"``: eval mode, no boundary noise, on the eval shards);
- ``eval_r_err``: ``|eval_r / target - 1|`` (with per-modality targets: the larger of the text and image errors);
- ``train_r``, ``train_r_text``, ``train_r_image``: mean per-step R over the second half of training (train mode,
  with noise), and ``r_in_band``: the fraction of those steps whose R is within ``band`` (±15%) of its target
  (the record's ``target_r``; with per-modality targets, text and image each within band of theirs);
- ``train_step_s``: the sum of the per-step times (tokens / tokens_per_s: forward, backward, optimiser step; no
  start-up, evaluation or checkpointing); ``train_wall_s``: the training subprocess's wall time (``result.json``);
  in a staged study both summed over the stages (``result.json``'s ``train.stages``);
- ``score:TASK:METRIC`` (and ``chance``), ``mean_score`` (mean of each task's main score), and the eval-mode R of
  the lmms-eval prompts: ``lmms_r*`` over all tasks, ``lmms_task_r`` per task (token-weighted, the R report's).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from pathlib import Path

from data_pipelines.jsonl import read_json_lines

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
R_KEYS = ("r", "r_text", "r_image")


def run_dir(out: str | Path, arm: str, seed: int) -> Path:
    return Path(out) / "runs" / arm / f"seed{seed}"


def read_json(path: Path) -> dict | list | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    """(train step records that were not skipped, held-out eval records) of a ``metrics.jsonl``, by step. Read with
    the toolkit's JSONL reader: a malformed line (a kill mid-write) is skipped with a warning naming it."""
    steps, evals = [], []

    def bad(lineno: int, why: str) -> None:
        logger.warning("%s:%d: skipped malformed line (%s)", path, lineno, why)

    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            records = [rec for _, rec in read_json_lines(f, bad)]
    except OSError:
        return [], []
    for rec in records:
        if rec.get("split") == "eval":
            evals.append(rec)
        elif not rec.get("skipped") and rec.get("loss") is not None:
            steps.append(rec)
    return sorted(steps, key=lambda r: r["step"]), sorted(evals, key=lambda r: r["step"])


def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _mean(values) -> float | None:
    values = [v for v in (_num(x) for x in values) if v is not None]
    return sum(values) / len(values) if values else None


def _rel_err(value, target) -> float | None:
    value, target = _num(value), _num(target)
    return None if value is None or not target else abs(value / target - 1.0)


def in_band(rec: dict, targets: dict, band: float) -> bool | None:
    """Whether a step's R is within ``band`` of each target (``{"r": None}`` means the record's ``target_r``)."""
    errs = [_rel_err(rec.get(k), rec.get("target_r") if t is None else t) for k, t in targets.items()]
    return None if any(e is None for e in errs) or not errs else all(e <= band for e in errs)


def step_seconds(steps: list[dict]) -> float:
    """The sum of the per-step times of a run's step records (tokens / tokens_per_s)."""
    return sum(s["tokens"] / s["tokens_per_s"] for s in steps if s.get("tokens_per_s"))


def train_numbers(steps: list[dict], evals: list[dict], targets: dict, band: float) -> dict:
    """The training-side numbers of one run (see the module docstring); ``targets`` as ``Arm.targets``."""
    out: dict = {"steps": steps[-1]["step"] if steps else 0}
    if steps:
        last = steps[-1]["step"]
        tail = [s for s in steps if s["step"] > 0.9 * last] or steps[-1:]
        half = [s for s in steps if s["step"] > 0.5 * last] or steps[-1:]
        out["train_loss"] = _mean(s.get("loss") for s in tail)
        out["train_lm_loss"] = _mean(s.get("lm_loss") for s in tail)
        for key in R_KEYS:
            out[f"train_{key}"] = _mean(s.get(key) for s in half)
        band_targets = {k: (None if k == "r" else v) for k, v in targets.items()}  # total: the record's
        flags = [in_band(s, band_targets, band) for s in half] if targets else []
        flags = [f for f in flags if f is not None]
        out["r_in_band"] = sum(flags) / len(flags) if flags else None
        out["train_step_s"] = step_seconds(steps)
        out["target_r"] = _num(steps[-1].get("target_r"))
    if evals:
        ev = evals[-1]
        out["bits_per_token"] = _num(ev.get("eval_bits_per_token"))
        for key in R_KEYS:
            out[f"eval_{key}"] = _num(ev.get(f"eval_{key}"))
        errs = [_rel_err(ev.get(f"eval_{k}"), v) for k, v in targets.items()]
        out["eval_r_err"] = max(errs) if errs and None not in errs else None
    return out


def eval_numbers(eval_dir: Path, main_metrics: dict, tasks: list[str]) -> dict:
    """Scores, chance levels and lmms-eval R of one run from its ``score_table.json`` and ``r_report.json``."""
    out: dict = {"scores": {}, "chance": {}, "lmms_task_r": {}}
    for row in read_json(eval_dir / "score_table.json") or []:
        task, metric = row.get("task"), row.get("metric")
        out["scores"].setdefault(task, {})[metric] = _num(row.get("score"))
        out["chance"].setdefault(task, {})[metric] = _num(row.get("chance"))
        out["lmms_task_r"][task] = {k: _num(row.get(k)) for k in R_KEYS}
    for task, metrics in main_metrics.items():
        for metric in metrics:
            out[f"score:{task}:{metric}"] = (out["scores"].get(task) or {}).get(metric)
    mains = [(out["scores"].get(t) or {}).get(main_metrics[t][0]) for t in tasks]
    out["mean_score"] = sum(mains) / len(mains) if mains and None not in mains else None
    report = read_json(eval_dir / "r_report.json") or {}
    overall = ((report.get("eval") or {}).get("overall")) or {}
    for key in R_KEYS:
        stats = overall.get(key) or {}
        out[f"lmms_{key}"] = _num(stats.get("token_weighted"))
    return out


def chance_of(numbers: dict, metric: str, main_metrics: dict, tasks: list[str]) -> float | None:
    """The chance level of a per-run metric (a task score, or the mean of the main scores), else None."""
    chance = numbers.get("chance") or {}
    if metric.startswith("score:"):
        _, task, name = metric.split(":")
        return (chance.get(task) or {}).get(name)
    if metric == "mean_score":
        levels = [(chance.get(t) or {}).get(main_metrics[t][0]) for t in tasks]
        return sum(levels) / len(levels) if levels and None not in levels else None
    return None


def collect_run(path: Path, targets: dict, band: float, main_metrics: dict, tasks: list[str]) -> dict:
    """All numbers of one finished run (``result.json`` present), read from its files."""
    result = read_json(path / "result.json") or {}
    steps, evals = read_metrics(path / "train" / METRICS_FILE)
    numbers = {**train_numbers(steps, evals, targets, band), **eval_numbers(path / "eval", main_metrics, tasks)}
    numbers["train_wall_s"] = _num((result.get("train") or {}).get("wall_s"))  # every stage's, in a staged study
    earlier = [name for name in (result.get("train") or {}).get("stages") or {} if name != "train"]
    if earlier and "train_step_s" in numbers:  # the stages before the last count too, like the wall time
        numbers["train_step_s"] += sum(step_seconds(read_metrics(path / n / METRICS_FILE)[0]) for n in earlier)
    numbers["eval_wall_s"] = _num((result.get("eval") or {}).get("wall_s"))
    return numbers


def aggregate(runs: list[dict]) -> dict:
    """metric -> {"mean", "std" (over seeds, n-1; None with one run), "n", "values"} for every numeric metric."""
    keys = sorted({k for r in runs for k, v in r.items() if _num(v) is not None})
    out = {}
    for key in keys:
        values = [v for v in (_num(r.get(key)) for r in runs) if v is not None]
        std = statistics.stdev(values) if len(values) >= 2 else None
        out[key] = {"mean": sum(values) / len(values), "std": std, "n": len(values), "values": values}
    return out
