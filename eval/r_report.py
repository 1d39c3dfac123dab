"""Compression-ratio report: R = tokens / concepts, in total and per modality, from training logs and evaluations.

Reads either
- a training run's ``metrics.jsonl`` (one object per optimiser step: ``step``, ``r``, ``r_text``, ``r_image``, ...;
  eval records, marked ``"split": "eval"`` or by ``eval_``-prefixed keys, are counted but kept apart), or
- per-sample evaluation records (``task``, optional ``dataset``, ``tokens``, ``concepts``, ``r``, ``r_text``,
  ``r_image``, optional scores), e.g. the ``*.jsonl`` files the lmms-eval plugin writes next to lmms-eval's own
  ``*_results.json``; task scores are taken from that results file when a folder holds one. Per-sample scores
  of lmms-eval's own sample logs (``*_samples_<task>.jsonl``: plain numeric metric fields) are joined to the
  records by (task, doc_id); records with a ``group`` (page count, needle cell, ...) get a per-group summary.

Ratios may also come as counts: ``tokens_by_modality`` / ``concepts_by_modality`` (keys ``"0"`` text, ``"1"``
image), read with the rule of ``vlm.backbone.outputs.chunk_statistics``: R_m = tokens_m / max(concepts_m, 1), and no R_m
for a record without tokens of modality m.

The paper's Fig. 2c story (arXiv 2601.21420 §4.2): under one global target R the model compresses images more than
text, so the summary reports image-R / text-R next to the three series.

    from eval.r_report import write_report
    summary = write_report("runs/demo")          # runs/demo/r_report.json + runs/demo/r_report.png
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from pathlib import Path

from eval.r_report_io import (
    MAX_SKIPPED_LISTED,
    SERIES,
    TAIL_FRACTION,
    TRAIN_SCALARS,
    Records,
    ReportInputError,  # noqa: F401 - re-exported (scripts/r_report.py, tests)
    _num,
    _r_from_counts,
    load_records,
    nonfinite_warning,
)
from eval.r_report_plot import plot_report

logger = logging.getLogger(__name__)


def _stats(values: list[float | None]) -> dict:
    """n, mean, population std, min, max over the non-null values (all None when there is none)."""
    xs = [x for x in values if x is not None]
    if not xs:
        return {"n": 0, "mean": None, "std": None, "min": None, "max": None}
    return {"n": len(xs), "mean": statistics.fmean(xs), "std": statistics.pstdev(xs), "min": min(xs), "max": max(xs)}


def _series_stats(values: list[float | None]) -> dict:
    """``_stats`` plus first, last (non-null) and the mean over the last 10% of steps (at least one step)."""
    out = _stats(values)
    xs = [x for x in values if x is not None]
    tail = [x for x in values[-max(1, math.ceil(TAIL_FRACTION * len(values))) :] if x is not None]
    out["first"] = xs[0] if xs else None
    out["last"] = xs[-1] if xs else None
    out["mean_last_10pct"] = statistics.fmean(tail) if tail else None
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _weighted_r(samples: list[dict], suffix: str) -> float | None:
    """Token-weighted R = sum tokens / sum concepts over the samples that carry both counts."""
    pairs = [(s[f"tokens{suffix}"], s[f"concepts{suffix}"]) for s in samples]
    pairs = [(t, c) for t, c in pairs if t is not None and c is not None]
    if not pairs:
        return None
    return _r_from_counts(sum(t for t, _ in pairs), sum(c for _, c in pairs))


def _group_summary(samples: list[dict]) -> dict:
    out = {"n": len(samples)}
    for key, suffix in (("r", ""), ("r_text", "_text"), ("r_image", "_image")):
        out[key] = _stats([s[key] for s in samples]) | {"token_weighted": _weighted_r(samples, suffix)}
    per_metric: dict[str, list[float]] = {}
    for s in samples:
        for metric, value in s["scores"].items():
            per_metric.setdefault(metric, []).append(value)
    out["scores"] = {metric: statistics.fmean(vs) for metric, vs in per_metric.items()}
    return out


def _primary_score(scores: dict[str, float], first: tuple[str, ...] = ()) -> dict | None:
    """The score shown in the plot: the first of ``first`` (the results file's metrics), else ``score``, else any."""
    for metric in (*first, "score", *scores):
        if metric in scores:
            return {"metric": metric, "value": scores[metric]}
    return None


def _train_summary(records: Records, target_r: float | None) -> dict:
    steps = records.steps
    out = {"steps": len(steps), "first_step": steps[0]["step"], "last_step": steps[-1]["step"]}
    targets = [s["target_r"] for s in steps if s["target_r"] is not None]
    out["target_r"] = target_r if target_r is not None else (targets[-1] if targets else None)
    tail = steps[-max(1, math.ceil(TAIL_FRACTION * len(steps))) :]
    for key, suffix in zip(SERIES, ("", "_text", "_image")):
        out[key] = _series_stats([s[key] for s in steps])
        # summed tokens / summed concepts over the tail: a step with few image tokens and one concept would
        # otherwise weigh as much as a full one in the mean of per-step ratios
        out[key]["token_weighted_last_10pct"] = _weighted_r(tail, suffix)
    out["image_to_text_r"] = {
        "mean_last_10pct": _ratio(out["r_image"]["mean_last_10pct"], out["r_text"]["mean_last_10pct"]),
        "mean": _ratio(out["r_image"]["mean"], out["r_text"]["mean"]),
    }
    out["scalars"] = {
        k: _series_stats([s[k] for s in steps]) for k in TRAIN_SCALARS if any(s[k] is not None for s in steps)
    }
    last_eval = records.train_evals[-1] if records.train_evals else {}
    out["eval"] = {
        "records": len(records.train_evals),
        "last": {k: v for k, v in last_eval.items() if _num(v) is not None},
    }
    out["duplicate_steps"] = records.duplicate_steps
    out |= _nonfinite_summary(steps)
    out["eval"]["nonfinite_records"] = records.nonfinite_eval_records
    return out


def _nonfinite_summary(steps: list[dict]) -> dict:
    """Steps whose loss or R was NaN / inf (or skipped by the trainer): count, first step numbers, count per key."""
    flagged = [s for s in steps if s["nonfinite"]]
    by_key: dict[str, int] = {}
    for s in flagged:
        for key in s["nonfinite"]:
            by_key[key] = by_key.get(key, 0) + 1
    return {
        "nonfinite_steps": len(flagged),
        "nonfinite_at": [s["step"] for s in flagged[:MAX_SKIPPED_LISTED]],
        "nonfinite_by_key": dict(sorted(by_key.items())),
    }


def _eval_summary(records: Records) -> dict:
    by_task: dict[str, list[dict]] = {}
    for s in records.samples:
        by_task.setdefault(s["task"], []).append(s)
    tasks = {}
    for task in sorted(by_task):
        samples = by_task[task]
        summary = _group_summary(samples)
        results = records.results.get(task, {})
        summary["scores"] = summary["scores"] | results  # the results file wins over per-sample means
        summary["score"] = _primary_score(summary["scores"], first=tuple(results))
        datasets = sorted({s["dataset"] for s in samples if s["dataset"] is not None}, key=str)
        if datasets:
            summary["datasets"] = {}
            for ds in datasets:
                ds_summary = _group_summary([s for s in samples if s["dataset"] == ds])
                ds_summary["score"] = _primary_score(
                    ds_summary["scores"], first=tuple(results)
                )  # same headline as the task
                summary["datasets"][str(ds)] = ds_summary
        groups = sorted({s["group"] for s in samples if s["group"] is not None})
        if groups:
            summary["groups"] = {g: _group_summary([s for s in samples if s["group"] == g]) for g in groups}
        tasks[task] = summary
    scores_only = {t: m for t, m in records.results.items() if t not in tasks}
    return {
        "samples": len(records.samples),
        "nonfinite_samples": sum(bool(s["nonfinite"]) for s in records.samples),
        "joined_scores": records.joined_scores,
        "tasks": tasks,
        "overall": _group_summary(records.samples),
        "results_without_samples": scores_only,
    }


def summarize(records: Records, target_r: float | None = None) -> dict:
    """The JSON summary: ``train`` (per-step series) and ``eval`` (per task / dataset), each null without data.
    ``nonfinite_steps`` (training steps with a NaN / inf loss or R) and ``warnings`` sit at the top, never hidden."""
    warning = nonfinite_warning(records)
    return {
        "name": records.name,
        "nonfinite_steps": sum(bool(s["nonfinite"]) for s in records.steps),
        "warnings": [warning] if warning else [],
        "sources": records.sources,
        "skipped_lines": records.skipped_lines,
        "skipped_at": records.skipped_at,
        "ignored_records": records.ignored_records,
        "train": _train_summary(records, target_r) if records.steps else None,
        "eval": _eval_summary(records) if records.samples else None,
    }


# ----------------------------------------------------------------------------------------------------------------
# Plot


def _overview(summary: dict) -> str:
    parts = []
    if (train := summary["train"]) is not None:
        tails = {k: train[k]["token_weighted_last_10pct"] or train[k]["mean_last_10pct"] for k in SERIES}
        fmt = {k: "n/a" if v is None else f"{v:.2f}" for k, v in tails.items()}
        parts.append(
            f"{train['steps']} steps, R last 10% (tokens / concepts) {fmt['r']} (text {fmt['r_text']}, "
            f"image {fmt['r_image']})"
        )
    if (ev := summary["eval"]) is not None:
        parts.append(f"{ev['samples']} eval samples over {len(ev['tasks'])} tasks")
    if summary["skipped_lines"]:
        parts.append(f"{summary['skipped_lines']} malformed lines skipped")
    if summary["nonfinite_steps"]:
        parts.append(f"{summary['nonfinite_steps']} steps with a non-finite loss or R")
    return "; ".join(parts)


def write_report(path: str | Path, out_dir: str | Path | None = None, target_r: float | None = None) -> dict:
    """Read ``path`` and write ``r_report.json`` + ``r_report.png`` into ``out_dir`` (default: the run folder,
    or the JSONL file's folder). ``target_r`` overrides a ``target_r`` field of the log. Returns the summary,
    with the written paths under ``outputs``."""
    records = load_records(path)
    summary = summarize(records, target_r=target_r)
    path = Path(path)
    out_dir = Path(out_dir) if out_dir is not None else (path if path.is_dir() else path.parent)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / "r_report.json", out_dir / "r_report.png"
    plot_report(records, summary, png_path)
    summary["outputs"] = {"json": str(json_path), "png": str(png_path)}
    json_path.write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    logger.info("%s -> %s, %s", _overview(summary), json_path, png_path)
    return summary
