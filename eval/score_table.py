"""One table of an evaluation: per task and metric the score, the chance level and the task's eval-mode R.

    python scripts/score_table.py EVAL_OUTPUT_DIR [--tasks-dir eval/tasks] [--out FILE.md]

Reads, under ``EVAL_OUTPUT_DIR`` (lmms-eval's ``--output_path``):

- the newest lmms-eval ``*_results.json`` (by modification time, then name): the scores;
- ``r_report.json`` (``scripts/r_report.py EVAL_OUTPUT_DIR`` writes it; the newest one when there are several),
  ``eval.tasks.<task>.{r,r_text,r_image}.token_weighted`` (summed tokens / summed concepts over the task's
  samples, measured on the prompt forward in eval mode), or, without it, the same summary computed from the
  plugin's ``r_stats_<task>.jsonl`` in memory; R columns stay empty when neither exists;
- ``TASKS_DIR/<task>/data/manifest.json`` (``scripts/make_eval_data.py`` writes it): ``chance`` per metric;
- the newest lmms-eval ``*_samples_<task>.jsonl`` of each task (``--log_samples``): ``n``, the docs a metric
  scored, and ``p``, the one-sided binomial tail P(X >= right | n, chance): how likely a model that only knows the
  best constant answer scores this well. Both only for metrics whose every per-sample score is 0 or 1 (a plain
  number, or cmoe_sceneqa's typed ``{"score", "type"}`` items, counted under ``acc_<type>``); empty otherwise.
- the manifest's ``unbound`` levels, where it has them (the sceneqa tasks' colour / shape / position: a reader that
  names one of the scene's values at random, knowing them all but not which object has which), and ``p unbound``,
  the binomial tail against that level: whether the answers bind an attribute to the object the question names.
  The two columns appear only in tables that have such a level.

Writes ``score_table.md`` (the markdown table) and ``score_table.json`` (the same rows) into ``EVAL_OUTPUT_DIR``
and returns the markdown. When the results name a local model folder (lmms-eval's ``pretrained=DIR``) whose model
card this toolkit wrote (``vlm.model_card``), the card's evaluation section becomes this table. Metrics the
results report as NaN (a bucket without docs) are left out. The chance levels are those of the full eval set: a
``--limit`` run scores a subset of it.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from eval.eval_data import DEFAULT_OUT
from eval.r_report_io import SAMPLE_LOG, SAMPLE_LOG_SKIP, ReportInputError, _num, _read_results
from vlm.model_card import set_scores

logger = logging.getLogger(__name__)

COLUMNS = ("task", "metric", "score", "chance", "n", "p", "R total", "R text", "R image")
BINDING_COLUMNS = ("unbound", "p unbound")  # after "p", in tables with an unbound level
R_KEYS = ("r", "r_text", "r_image")


def newest(paths) -> Path | None:
    """The most recently modified path (ties: the last name), or None."""
    paths = sorted(paths, key=lambda p: (p.stat().st_mtime, p.name))
    return paths[-1] if paths else None


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        logger.warning("%s: skipped (%s)", path, str(err).splitlines()[0])
        return None
    return data if isinstance(data, dict) else None


def task_r(eval_dir: Path) -> dict[str, dict[str, float | None]]:
    """task -> {"r", "r_text", "r_image"}: token-weighted eval-mode R of the R report (file, else computed)."""
    summary = None
    report = newest(p for p in eval_dir.rglob("r_report.json") if p.is_file())
    if report is not None:
        summary = _read_json(report)
    if summary is None and any(eval_dir.rglob("r_stats_*.jsonl")):
        from eval.r_report import summarize
        from eval.r_report_io import load_records

        try:
            summary = summarize(load_records(eval_dir))
        except ReportInputError as err:
            logger.warning("no R report: %s", err)
    tasks = ((summary or {}).get("eval") or {}).get("tasks") or {}
    out = {}
    for task, entry in tasks.items():
        out[task] = {}
        for key in R_KEYS:
            stats = entry.get(key) or {}
            value = _num(stats.get("token_weighted"))
            out[task][key] = value if value is not None else _num(stats.get("mean"))
    return out


def task_levels(tasks_dir: Path, task: str) -> tuple[dict[str, float | None], dict[str, float | None]]:
    """(metric -> chance level, metric -> unbound level) from the task's data manifest, read once (both {} when
    there is none; the unbound levels {} for a task without them)."""
    path = tasks_dir / task / "data" / "manifest.json"
    manifest = _read_json(path) if path.is_file() else None
    if manifest is None:
        logger.warning("%s: no manifest, chance levels left empty (run scripts/make_eval_data.py)", path)
        return {}, {}
    return tuple({m: _num(v) for m, v in (manifest.get(key) or {}).items()} for key in ("chance", "unbound"))


def binomial_tail(right: int, n: int, p: float) -> float:
    """P(X >= right) for X ~ Binomial(n, p), summed in log space (exact terms overflow a float past n ~ 1,000)."""
    if right <= 0 or p >= 1.0:
        return 1.0
    if right > n or p <= 0.0:
        return 0.0
    logs = [
        math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * math.log(p) + (n - i) * math.log1p(-p)
        for i in range(right, n + 1)
    ]
    top = max(logs)
    return min(1.0, math.exp(top) * sum(math.exp(v - top) for v in logs))


def _binary_items(line: dict) -> dict[str, float]:
    """metric -> this sample's score, for the scores that are a plain number or a typed ``{"score", "type"}``."""
    out = {}
    for key, value in line.items():
        if isinstance(value, dict) and set(value) == {"score", "type"} and key == f"acc_{value['type']}":
            out[key] = _num(value["score"])
        elif isinstance(value, int | float) and not isinstance(value, bool) and key not in SAMPLE_LOG_SKIP:
            out[key] = _num(value)
    return out


def sample_counts(eval_dir: Path) -> dict[str, dict[str, tuple[int, int]]]:
    """task -> metric -> (n, right) from the newest sample log of each task, for 0/1 metrics only."""
    logs: dict[str, Path] = {}
    for path in sorted(eval_dir.rglob("*_samples_*.jsonl"), key=lambda p: (p.stat().st_mtime, p.name)):
        if (found := SAMPLE_LOG.search(path.name)) is not None:
            logs[found["task"]] = path
    out = {}
    for task, path in logs.items():
        counts: dict[str, list] = {}
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as err:
            logger.warning("%s: skipped (%s)", path, err)
            continue
        for text in lines:
            try:
                line = json.loads(text)
            except ValueError:
                continue
            for metric, score in _binary_items(line if isinstance(line, dict) else {}).items():
                n, right, binary = counts.setdefault(metric, [0, 0, True])
                counts[metric] = [n + 1, right + (score == 1.0), binary and score in (0.0, 1.0)]
        out[task] = {m: (n, right) for m, (n, right, binary) in counts.items() if binary}
    return out


def results_file(eval_dir: str | Path) -> Path:
    """The newest lmms-eval ``*_results.json`` under ``eval_dir``."""
    eval_dir = Path(eval_dir)
    if not eval_dir.is_dir():
        raise ReportInputError(f"{eval_dir}: no such folder")
    found = newest(p for p in eval_dir.rglob("*_results.json") if p.is_file())
    if found is None:
        raise ReportInputError(f"{eval_dir}: no lmms-eval *_results.json under this folder")
    return found


def model_folder(results_path: Path) -> Path | None:
    """The local folder lmms-eval loaded (``pretrained=DIR`` in the results' ``model_args``), or None."""
    args = (_read_json(results_path) or {}).get("config", {}).get("model_args")
    if isinstance(args, dict):
        folder = args.get("pretrained")
    else:
        pairs = dict(part.split("=", 1) for part in str(args or "").split(",") if "=" in part)
        folder = pairs.get("pretrained")
    return Path(folder) if folder and Path(folder).is_dir() else None


def rows(eval_dir: str | Path, tasks_dir: str | Path = DEFAULT_OUT) -> list[dict]:
    """One row per (task, metric) of the newest results file: score, chance, R total / text / image."""
    eval_dir, tasks_dir = Path(eval_dir), Path(tasks_dir)
    found = results_file(eval_dir)
    results = _read_results(found)
    if not results:
        raise ReportInputError(f"{found}: no task scores")
    logger.info("scores from %s", found)
    r, counts = task_r(eval_dir), sample_counts(eval_dir)
    out = []
    for task in sorted(results):
        chance, unbound = task_levels(tasks_dir, task)
        task_r_values = r.get(task, {})
        for metric, score in results[task].items():
            n, right = counts.get(task, {}).get(metric, (None, None))
            level = chance.get(metric)
            out.append(
                {
                    "task": task,
                    "metric": metric,
                    "score": score,
                    "chance": level,
                    "n": n,
                    "p": binomial_tail(right, n, level) if n and level is not None else None,
                    "r": task_r_values.get("r"),
                    "r_text": task_r_values.get("r_text"),
                    "r_image": task_r_values.get("r_image"),
                }
            )
            if (bound := unbound.get(metric)) is not None:
                out[-1]["unbound"] = bound
                out[-1]["p_unbound"] = binomial_tail(right, n, bound) if n else None
    return out


def _cell(value, digits: int) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return ""
    return f"{value:.{digits}f}" if isinstance(value, float | int) else str(value)


def _p(value: float | None) -> str:
    return "" if value is None else f"{value:.2g}"


def markdown(table: list[dict]) -> str:
    """The rows as a markdown table (scores and chance with 3 decimals, p with 2 significant digits, R with 2)."""
    binding = any("unbound" in row for row in table)
    columns = COLUMNS[:6] + BINDING_COLUMNS * binding + COLUMNS[6:]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * 2 + "---:|" * (len(columns) - 2)]
    for row in table:
        cells = [row["task"], row["metric"], _cell(row["score"], 3), _cell(row["chance"], 3)]
        cells += [_cell(row.get("n"), 0), _p(row.get("p"))]
        cells += [_cell(row.get("unbound"), 3), _p(row.get("p_unbound"))] if binding else []
        cells += [_cell(row[k], 2) for k in R_KEYS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_table(eval_dir: str | Path, tasks_dir: str | Path = DEFAULT_OUT, out: str | Path | None = None) -> str:
    """Build the table, write ``score_table.md`` and ``score_table.json`` (``out``: the markdown's path, default
    ``EVAL_OUTPUT_DIR/score_table.md``; the JSON goes beside it) and return the markdown."""
    table = rows(eval_dir, tasks_dir)
    text = markdown(table)
    md_path = Path(out) if out is not None else Path(eval_dir) / "score_table.md"
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(text, encoding="utf-8")
    md_path.with_suffix(".json").write_text(json.dumps(table, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    folder = model_folder(results_file(eval_dir))
    if folder is not None and set_scores(folder, CARD_NOTE + text):
        logger.info("model card %s/README.md: evaluation section updated", folder)
    return text


CARD_NOTE = (
    "Scored with lmms-eval through the ConceptMoE-VLM plugin. chance: the best constant answer's score on the same "
    "items; p: the one-sided binomial tail of a model that only knows that answer; unbound (scene questions): a "
    "reader that names one of the scene's colours / shapes / positions at random, p unbound its tail; R: tokens per "
    "concept in eval mode, per modality.\n\n"
)
