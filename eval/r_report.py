"""Compression-ratio report: R = tokens / concepts, in total and per modality, from training logs and evaluations.

Reads either
- a training run's ``metrics.jsonl`` (one object per optimiser step: ``step``, ``r``, ``r_text``, ``r_image``, ...;
  eval records, marked ``"split": "eval"`` or by ``eval_``-prefixed keys, are counted but kept apart), or
- per-sample evaluation records (``task``, optional ``dataset``, ``tokens``, ``concepts``, ``r``, ``r_text``,
  ``r_image``, optional scores), e.g. the ``*.jsonl`` files the lmms-eval plugin writes next to lmms-eval's own
  ``*_results.json``; task scores are taken from that results file when a folder holds one.

Ratios may also come as counts: ``tokens_by_modality`` / ``concepts_by_modality`` (keys ``"0"`` text, ``"1"``
image), read with the rule of ``vlm.outputs.chunk_statistics``: R_m = tokens_m / max(concepts_m, 1), and no R_m
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
from dataclasses import dataclass, field
from pathlib import Path

from eval.r_report_plot import plot_report

logger = logging.getLogger(__name__)

MODALITIES = {"text": ("0", "text"), "image": ("1", "image")}  # keys accepted in the *_by_modality dicts
SERIES = ("r", "r_text", "r_image")
TRAIN_SCALARS = ("loss", "lm_loss", "ratio_loss", "balance_loss", "z_loss", "tokens_per_s", "lr")
SCORE_DICT_KEYS = ("scores", "metrics")  # per-sample dicts of metric -> value
TAIL_FRACTION = 0.1
MAX_SKIPPED_LISTED = 20


class ReportInputError(ValueError):
    """Input that cannot give a report (missing path, nothing readable); the message is one line."""


@dataclass
class Records:
    """Everything read from the input, each record already normalised (see ``_ratios``)."""

    steps: list[dict] = field(default_factory=list)  # training steps, one per step, sorted by step
    train_evals: list[dict] = field(default_factory=list)  # eval records of a training log
    samples: list[dict] = field(default_factory=list)  # per-sample evaluation records
    results: dict[str, dict[str, float]] = field(default_factory=dict)  # task -> metric -> value (*_results.json)
    sources: list[str] = field(default_factory=list)
    name: str = ""  # shown in plot titles: the run folder or file name
    skipped_lines: int = 0
    skipped_at: list[str] = field(default_factory=list)  # "file:line" of the first skipped lines
    ignored_records: int = 0  # valid JSON objects that are neither a step nor a sample (e.g. lmms-eval sample logs)
    duplicate_steps: int = 0  # steps logged twice (a resumed run); the later record wins


# ----------------------------------------------------------------------------------------------------------------
# Reading


def _num(x) -> float | None:
    """A finite number, or None (null, missing, bool, string, NaN/inf)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _by_modality(d, modality: str) -> float | None:
    if not isinstance(d, dict):
        return None
    for key in MODALITIES[modality]:
        if key in d:
            return _num(d[key])
    return None


def _r_from_counts(tokens: float | None, concepts: float | None) -> float | None:
    """R = tokens / max(concepts, 1) as ``chunk_statistics`` computes it; None without tokens."""
    if tokens is None or concepts is None or tokens <= 0:
        return None
    return tokens / max(concepts, 1.0)


def _ratios(rec: dict) -> dict:
    """R total / text / image and the counts behind them, from whichever form the record carries.

    Explicit ratios win; otherwise ``r_by_modality``; otherwise counts (``tokens_by_modality`` /
    ``concepts_by_modality`` or flat ``tokens_text`` / ``concepts_text`` ...).
    """
    tokens_by, concepts_by = rec.get("tokens_by_modality"), rec.get("concepts_by_modality")
    out = {}
    for modality in MODALITIES:
        t = _num(rec.get(f"tokens_{modality}"))
        c = _num(rec.get(f"concepts_{modality}"))
        t = t if t is not None else _by_modality(tokens_by, modality)
        c = c if c is not None else _by_modality(concepts_by, modality)
        r = _num(rec.get(f"r_{modality}"))
        r = r if r is not None else _by_modality(rec.get("r_by_modality"), modality)
        out[f"tokens_{modality}"], out[f"concepts_{modality}"] = t, c
        out[f"r_{modality}"] = r if r is not None else _r_from_counts(t, c)

    tokens, concepts = _num(rec.get("tokens")), _num(rec.get("concepts"))
    if tokens is None and isinstance(tokens_by, dict):
        tokens = sum(v for v in map(_num, tokens_by.values()) if v is not None)
    if concepts is None and isinstance(concepts_by, dict):
        concepts = sum(v for v in map(_num, concepts_by.values()) if v is not None)
    r = _num(rec.get("r"))
    out["tokens"], out["concepts"] = tokens, concepts
    out["r"] = r if r is not None else _r_from_counts(tokens, concepts)
    return out


def _is_train_eval(rec: dict) -> bool:
    return rec.get("split") == "eval" or any(k.startswith("eval_") for k in rec)


def _sample_scores(rec: dict, metric_names: set[str]) -> dict[str, float]:
    """Per-sample scores: ``score``, the ``scores`` / ``metrics`` dicts, and fields named like a results metric."""
    scores = {}
    for key in SCORE_DICT_KEYS:
        if isinstance(rec.get(key), dict):
            scores.update({k: v for k, v in ((k, _num(v)) for k, v in rec[key].items()) if v is not None})
    for key in {"score"} | metric_names:
        v = _num(rec.get(key))
        if v is not None:
            scores[key] = v
    return scores


def _read_jsonl(path: Path, records: Records) -> list[dict]:
    """JSON objects of a JSONL file; malformed lines (and non-object values) are skipped, counted and logged."""
    objects = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                if not isinstance(obj, dict):
                    raise ValueError(f"a JSON {type(obj).__name__}, not an object")
            except ValueError as e:
                why = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
                records.skipped_lines += 1
                if len(records.skipped_at) < MAX_SKIPPED_LISTED:
                    records.skipped_at.append(f"{path}:{lineno}")
                logger.warning("%s:%d: skipped malformed line (%s)", path, lineno, why)
                continue
            objects.append(obj)
    return objects


def _read_results(path: Path) -> dict[str, dict[str, float]]:
    """lmms-eval's ``{"results": {task: {"metric,filter": value, ...}}}`` -> task -> metric -> value.

    The filter suffix ``,none`` is dropped; stderr entries, aliases and non-numeric values are left out.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except ValueError as e:
        logger.warning("%s: skipped, not valid JSON (%s)", path, str(e).splitlines()[0])
        return {}
    tasks = data.get("results") if isinstance(data, dict) else None
    if not isinstance(tasks, dict):
        logger.warning("%s: skipped, no 'results' object", path)
        return {}
    out = {}
    for task, metrics in tasks.items():
        if not isinstance(metrics, dict):
            continue
        for key, value in metrics.items():
            name = key.removesuffix(",none")
            value = _num(value)
            if value is None or "_stderr" in name or name == "alias":
                continue
            out.setdefault(task, {})[name] = value
    return out


def load_records(path: str | Path) -> Records:
    """Read a run folder, an evaluation output folder or one JSONL file.

    A folder is searched recursively for ``*.jsonl`` (metrics and per-sample records) and lmms-eval
    ``*_results.json`` files. Raises ``ReportInputError`` when the path is missing or holds no usable record.
    """
    path = Path(path)
    records = Records(name=path.resolve().name if path.is_dir() else path.name)
    if path.is_dir():
        jsonl_files = sorted(p for p in path.rglob("*.jsonl") if p.is_file())
        results_files = sorted(p for p in path.rglob("*_results.json") if p.is_file())
        if not jsonl_files:
            raise ReportInputError(f"{path}: no *.jsonl file in this folder (expected metrics.jsonl or *.jsonl)")
    elif path.is_file():
        jsonl_files, results_files = [path], []
    else:
        raise ReportInputError(f"{path}: no such file or folder")

    for results_file in results_files:  # sorted: a later (timestamped) results file overrides an earlier one
        for task, metrics in _read_results(results_file).items():
            records.results.setdefault(task, {}).update(metrics)
        records.sources.append(str(results_file))

    steps_by_number: dict[int | float, dict] = {}
    try:
        for jsonl in jsonl_files:
            records.sources.append(str(jsonl))
            for rec in _read_jsonl(jsonl, records):
                if "task" in rec:
                    task = str(rec["task"])
                    sample = {"task": task, "dataset": rec.get("dataset"), "doc_id": rec.get("doc_id")}
                    sample["scores"] = _sample_scores(rec, set(records.results.get(task, {})))
                    records.samples.append(sample | _ratios(rec))
                elif _is_train_eval(rec):
                    records.train_evals.append(rec)
                elif _num(rec.get("step")) is not None:
                    step = _num(rec["step"])
                    step = int(step) if step.is_integer() else step
                    records.duplicate_steps += step in steps_by_number
                    scalars = {k: _num(rec.get(k)) for k in TRAIN_SCALARS}
                    steps_by_number[step] = {"step": step, "target_r": _num(rec.get("target_r"))} | scalars
                    steps_by_number[step] |= _ratios(rec)
                else:
                    records.ignored_records += 1
    except OSError as e:
        raise ReportInputError(f"{path}: cannot read ({e.strerror or e})") from None
    records.steps = [steps_by_number[s] for s in sorted(steps_by_number)]

    if records.duplicate_steps:
        logger.warning(
            "%s: %d steps logged more than once (resumed run?); kept the later record", path, records.duplicate_steps
        )
    if records.ignored_records:
        logger.info(
            "%s: ignored %d records that are neither a training step nor a sample", path, records.ignored_records
        )
    if not records.steps and not records.samples:
        what = f"{records.skipped_lines} malformed lines skipped, " if records.skipped_lines else ""
        raise ReportInputError(
            f"{path}: no training step or evaluation record to report ({what}{records.ignored_records} other records)"
        )
    return records


# ----------------------------------------------------------------------------------------------------------------
# Summaries


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
    for key in SERIES:
        out[key] = _series_stats([s[key] for s in steps])
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
    return out


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
        tasks[task] = summary
    scores_only = {t: m for t, m in records.results.items() if t not in tasks}
    return {
        "samples": len(records.samples),
        "tasks": tasks,
        "overall": _group_summary(records.samples),
        "results_without_samples": scores_only,
    }


def summarize(records: Records, target_r: float | None = None) -> dict:
    """The JSON summary: ``train`` (per-step series) and ``eval`` (per task / dataset), each null without data."""
    return {
        "name": records.name,
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
        tails = {k: train[k]["mean_last_10pct"] for k in SERIES}
        fmt = {k: "n/a" if v is None else f"{v:.2f}" for k, v in tails.items()}
        parts.append(f"{train['steps']} steps, R last 10% {fmt['r']} (text {fmt['r_text']}, image {fmt['r_image']})")
    if (ev := summary["eval"]) is not None:
        parts.append(f"{ev['samples']} eval samples over {len(ev['tasks'])} tasks")
    if summary["skipped_lines"]:
        parts.append(f"{summary['skipped_lines']} malformed lines skipped")
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
