"""Reading the inputs of the R report (``eval.r_report``): training ``metrics.jsonl``, per-sample evaluation records
(the lmms-eval plugin's ``r_stats_<task>.jsonl``), lmms-eval's ``*_results.json`` and ``*_samples_<task>.jsonl``.
Malformed lines are skipped and counted, never fatal; unusable input raises ``ReportInputError``. Non-finite losses
and R values (NaN / inf, and steps the trainer skipped for a non-finite loss) are left out of the statistics but
counted and flagged per record (``nonfinite``), never dropped silently."""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from data_pipelines.jsonl import read_json_lines

logger = logging.getLogger(__name__)

MODALITIES = {"text": ("0", "text"), "image": ("1", "image")}  # keys accepted in the *_by_modality dicts
SERIES = ("r", "r_text", "r_image")
TRAIN_SCALARS = ("loss", "lm_loss", "ratio_loss", "balance_loss", "z_loss", "tokens_per_s", "lr")
SCORE_DICT_KEYS = ("scores", "metrics")  # per-sample dicts of metric -> value
NONFINITE_CHECKED = ("loss", "lm_loss", "ratio_loss", "balance_loss", "z_loss", "r", "r_text", "r_image")
TAIL_FRACTION = 0.1
MAX_SKIPPED_LISTED = 20
SAMPLE_LOG = re.compile(r"_samples_(?P<task>.+)\.jsonl$")  # lmms-eval's per-sample log of one task
SAMPLE_LOG_SKIP = {"doc_id", "doc_hash", "token_counts"}  # numeric fields of a sample log that are no score


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
    joined_scores: int = 0  # samples that got per-sample scores from an lmms-eval sample log
    nonfinite_eval_records: int = 0  # eval records of a training log with a non-finite loss or R


# ----------------------------------------------------------------------------------------------------------------
# Reading


def _num(x) -> float | None:
    """A finite number, or None (null, missing, bool, string, NaN/inf)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _is_nonfinite(x) -> bool:
    """NaN or +-inf, as a JSON number (Python's ``NaN`` / ``Infinity``) or as a string such as ``"nan"``."""
    if isinstance(x, str):
        try:
            x = float(x)
        except ValueError:
            return False
    return isinstance(x, float) and not math.isfinite(x)


def nonfinite_keys(rec: dict) -> list[str]:
    """The losses and R values of a record that are NaN / inf (``eval_`` prefixed too, and ``r_by_modality``
    entries), plus ``skipped`` when the trainer skipped the step for a non-finite loss."""
    keys = [k for k, v in rec.items() if k.removeprefix("eval_") in NONFINITE_CHECKED and _is_nonfinite(v)]
    if isinstance(rec.get("r_by_modality"), dict):
        keys += [f"r_by_modality.{m}" for m, v in rec["r_by_modality"].items() if _is_nonfinite(v)]
    return keys + ["skipped"] * (rec.get("skipped") is True)


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

    def skipped(lineno: int, why: str) -> None:
        records.skipped_lines += 1
        if len(records.skipped_at) < MAX_SKIPPED_LISTED:
            records.skipped_at.append(f"{path}:{lineno}")
        logger.warning("%s:%d: skipped malformed line (%s)", path, lineno, why)

    with path.open(encoding="utf-8", errors="replace") as f:
        return [obj for _, obj in read_json_lines(f, skipped)]


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


def _logged_scores(rec: dict) -> dict[str, float]:
    """The plain numeric metric fields of one lmms-eval sample-log line (bucket dicts are left out)."""
    return {k: v for k, v in ((k, _num(v)) for k, v in rec.items() if k not in SAMPLE_LOG_SKIP) if v is not None}


def _join_logged_scores(records: Records, logged: dict) -> None:
    """Per-sample scores of lmms-eval's sample logs onto the records with the same (task, doc_id); a score the
    record carries itself wins."""
    for sample in records.samples:
        scores = logged.get((sample["task"], sample["doc_id"]))
        if scores:
            sample["scores"] = scores | sample["scores"]
            records.joined_scores += 1


# ----------------------------------------------------------------------------------------------------------------
# One reader per record kind

RECORD_KINDS = ("step", "train_eval", "sample", "sample_log")
KIND_FIELD = "kind"  # a record that names its kind is read as that kind; files written before the field still load


def record_kind(rec: dict, log_task: str | None) -> str | None:
    """The kind of ``rec``: its ``kind`` field when it has one (an unknown kind: None), else told from its keys, as
    files written before the field hold them, first rule first:

    - ``sample_log``: a line of lmms-eval's ``*_samples_<task>.jsonl`` (``log_task``), with ``doc_id`` and no ``task``;
    - ``sample``: a per-sample record of the plugin (``r_stats_<task>.jsonl``): it has ``task``;
    - ``train_eval``: an eval record of a training log: ``"split": "eval"`` or ``eval_`` keys;
    - ``step``: a training step: a numeric ``step``;
    - None: anything else (not a record of the report).
    """
    if KIND_FIELD in rec:
        return rec[KIND_FIELD] if rec[KIND_FIELD] in RECORD_KINDS else None
    if log_task and "task" not in rec and "doc_id" in rec:
        return "sample_log"
    if "task" in rec:
        return "sample"
    if _is_train_eval(rec):
        return "train_eval"
    if _num(rec.get("step")) is not None:
        return "step"
    return None


@dataclass
class _Reading:
    """What the readers gather: the records, the steps by number (a later duplicate wins) and the scores of
    lmms-eval's sample logs by (task, doc_id), joined to the samples once every file is read."""

    records: Records
    steps: dict[int | float, dict] = field(default_factory=dict)
    logged_scores: dict[tuple[str, object], dict[str, float]] = field(default_factory=dict)


def _read_sample_log(rec: dict, reading: _Reading, log_task: str | None) -> bool:
    """Scores for the plugin's sample of the same (task, doc_id); not a record of its own (returns False)."""
    task = log_task or rec.get("task")
    if task is not None and "doc_id" in rec:
        reading.logged_scores[(str(task), rec["doc_id"])] = _logged_scores(rec)
    return False


def _read_sample(rec: dict, reading: _Reading, log_task: str | None) -> bool:
    if "task" not in rec:
        return False
    task = str(rec["task"])
    sample = {"task": task, "dataset": rec.get("dataset"), "doc_id": rec.get("doc_id")}
    sample["group"] = None if rec.get("group") is None else str(rec["group"])
    sample["scores"] = _sample_scores(rec, set(reading.records.results.get(task, {})))
    sample["nonfinite"] = nonfinite_keys(rec)
    reading.records.samples.append(sample | _ratios(rec))
    return True


def _read_train_eval(rec: dict, reading: _Reading, log_task: str | None) -> bool:
    reading.records.train_evals.append(rec)
    reading.records.nonfinite_eval_records += bool(nonfinite_keys(rec))
    return True


def _read_step(rec: dict, reading: _Reading, log_task: str | None) -> bool:
    step = _num(rec.get("step"))
    if step is None:
        return False
    step = int(step) if step.is_integer() else step
    reading.records.duplicate_steps += step in reading.steps
    scalars = {k: _num(rec.get(k)) for k in TRAIN_SCALARS}
    reading.steps[step] = {"step": step, "target_r": _num(rec.get("target_r"))} | scalars
    reading.steps[step] |= _ratios(rec) | {"nonfinite": nonfinite_keys(rec)}
    return True


# kind -> reader(rec, reading, log_task) -> whether rec is a record of the report (else counted as ignored)
READERS = {"step": _read_step, "train_eval": _read_train_eval, "sample": _read_sample, "sample_log": _read_sample_log}


# ----------------------------------------------------------------------------------------------------------------
# Loading a path


def _input_files(path: Path) -> tuple[list[Path], list[Path]]:
    """(JSONL files, lmms-eval ``*_results.json`` files) of a folder (recursively) or of one JSONL file."""
    if path.is_dir():
        jsonl_files = sorted(p for p in path.rglob("*.jsonl") if p.is_file())
        if not jsonl_files:
            raise ReportInputError(f"{path}: no *.jsonl file in this folder (expected metrics.jsonl or *.jsonl)")
        return jsonl_files, sorted(p for p in path.rglob("*_results.json") if p.is_file())
    if path.is_file():
        return [path], []
    raise ReportInputError(f"{path}: no such file or folder")


def _read_jsonl_files(path: Path, jsonl_files: list[Path], reading: _Reading) -> None:
    """Every record of every file through the reader of its kind (``record_kind``)."""
    records = reading.records
    try:
        for jsonl in jsonl_files:
            records.sources.append(str(jsonl))
            log_match = SAMPLE_LOG.search(jsonl.name)
            log_task = log_match["task"] if log_match else None
            for rec in _read_jsonl(jsonl, records):
                reader = READERS.get(record_kind(rec, log_task))
                records.ignored_records += not (reader and reader(rec, reading, log_task))
    except OSError as e:
        raise ReportInputError(f"{path}: cannot read ({e.strerror or e})") from None


def _report_what_was_read(path: Path, records: Records) -> None:
    """Warnings for duplicate steps and non-finite values, a note of ignored records, and ``ReportInputError``
    when nothing is left to report."""
    if records.duplicate_steps:
        logger.warning(
            "%s: %d steps logged more than once (resumed run?); kept the later record", path, records.duplicate_steps
        )
    _warn_nonfinite(path, records)
    if records.ignored_records:
        logger.info(
            "%s: ignored %d records that are neither a training step nor a sample", path, records.ignored_records
        )
    if not records.steps and not records.samples:
        what = f"{records.skipped_lines} malformed lines skipped, " if records.skipped_lines else ""
        raise ReportInputError(
            f"{path}: no training step or evaluation record to report ({what}{records.ignored_records} other records)"
        )


def load_records(path: str | Path) -> Records:
    """Read a run folder, an evaluation output folder or one JSONL file.

    A folder is searched recursively for ``*.jsonl`` (metrics and per-sample records) and lmms-eval
    ``*_results.json`` files. Raises ``ReportInputError`` when the path is missing or holds no usable record.
    """
    path = Path(path)
    records = Records(name=path.resolve().name if path.is_dir() else path.name)
    jsonl_files, results_files = _input_files(path)
    for results_file in results_files:  # sorted: a later (timestamped) results file overrides an earlier one
        for task, metrics in _read_results(results_file).items():
            records.results.setdefault(task, {}).update(metrics)
        records.sources.append(str(results_file))
    reading = _Reading(records)
    _read_jsonl_files(path, jsonl_files, reading)
    records.steps = [reading.steps[s] for s in sorted(reading.steps)]
    _join_logged_scores(records, reading.logged_scores)
    _report_what_was_read(path, records)
    return records


def train_eval_r(records: Records) -> dict[str, list[tuple[float, float]]]:
    """Held-out R per series (``r``, ``r_text``, ``r_image``) as (step, R) points, from a training log's eval records
    (``vlm.training.step.evaluate``'s ``eval_r`` / ``eval_r_text`` / ``eval_r_image``; unprefixed keys or counts of a
    ``"split": "eval"`` record are read like a step's). Records without a step or a finite R are left out."""
    points: dict[str, list[tuple[float, float]]] = {key: [] for key in SERIES}
    for rec in records.train_evals:
        step = _num(rec.get("step"))
        if step is None:
            continue
        prefixed = {k.removeprefix("eval_"): v for k, v in rec.items() if k.startswith("eval_")}
        ratios = _ratios(rec | prefixed)
        for key in SERIES:
            if ratios[key] is not None:
                points[key].append((step, ratios[key]))
    return {key: sorted(pts) for key, pts in points.items()}


def nonfinite_warning(records: Records) -> str | None:
    """One line naming the training steps / samples / eval records with a non-finite loss or R, or None."""
    steps = [s["step"] for s in records.steps if s["nonfinite"]]
    samples = sum(bool(s["nonfinite"]) for s in records.samples)
    parts = []
    if steps:
        at = ", ".join(map(str, steps[:MAX_SKIPPED_LISTED])) + (", ..." if len(steps) > MAX_SKIPPED_LISTED else "")
        parts.append(f"{len(steps)} training steps with a non-finite loss or R (NaN/inf or skipped) at steps {at}")
    if records.nonfinite_eval_records:
        parts.append(f"{records.nonfinite_eval_records} eval records with a non-finite loss or R")
    if samples:
        parts.append(f"{samples} evaluation samples with a non-finite R")
    return "; ".join(parts) + ": left out of the statistics" if parts else None


def _warn_nonfinite(path: Path, records: Records) -> None:
    if (line := nonfinite_warning(records)) is not None:
        logger.warning("%s: warning: %s", path, line)


# ----------------------------------------------------------------------------------------------------------------
# Summaries
