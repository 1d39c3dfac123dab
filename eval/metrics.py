"""Metric functions of the local evaluation tasks (pure Python, no torch, no lmms-eval import).

Definitions follow lmms-eval's own tasks so that numbers are comparable:

- ANLS (DocVQA): lower-cased, whitespace-collapsed strings; NL = Levenshtein / max(len), score = 1 - min NL over
  the references, set to 0 below the threshold 0.5 (lmms-eval divides by the raw lengths; on the stripped,
  single-word answers of these tasks the two are the same).
- Boxes (``refcoco_bbox_rec``): normalised ``[x1, y1, x2, y2]``; the first bracketed group of four numbers in the
  answer, ``[0, 0, 0, 0]`` when there is none; IoU; ACC@t = IoU >= t; Center_ACC = the predicted box's centre
  inside the ground-truth box (borders included).
- Needle accuracy: the answer appears in the prediction as a whole word (case-insensitive), the usual
  needle-in-a-haystack rule (a model may answer in a sentence).
- Short answers (``cmoe_sceneqa``): exact match after stripping, lower-casing and dropping a trailing period.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Sequence

from data_pipelines.prompts import box_iou, read_box

ANLS_THRESHOLD = 0.5
ACC_THRESHOLDS = (0.1, 0.3, 0.5, 0.7, 0.9)
BOX_METRICS = ("IoU", *(f"ACC@{t}" for t in ACC_THRESHOLDS), "Center_ACC")
_EDGE_PUNCT = "\"'`.,;:!?()[]{}<> "


def normalize_answer(text: str) -> str:
    """Lower case, whitespace collapsed (DocVQA's ANLS preprocessing)."""
    return " ".join(str(text).strip().lower().split())


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions all cost 1)."""
    if len(a) > len(b):
        a, b = b, a
    previous = list(range(len(a) + 1))
    for j, cb in enumerate(b, start=1):
        current = [j]
        for i, ca in enumerate(a, start=1):
            current.append(min(previous[i] + 1, current[i - 1] + 1, previous[i - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def anls(prediction: str, references: str | Sequence[str], threshold: float = ANLS_THRESHOLD) -> float:
    """Average normalised Levenshtein similarity of one prediction against its references (best reference)."""
    refs = [references] if isinstance(references, str) else list(references)
    if not refs:
        raise ValueError("anls needs at least one reference answer")
    pred = normalize_answer(prediction)
    best = 0.0
    for ref in refs:
        gt = normalize_answer(ref)
        longest = max(len(gt), len(pred))
        similarity = 1.0 if longest == 0 else 1.0 - levenshtein(gt, pred) / longest
        best = max(best, similarity)
    return best if best >= threshold else 0.0


def exact_match(prediction: str, references: str | Sequence[str]) -> float:
    """1.0 when the prediction equals a reference after normalisation and stripping edge punctuation, else 0.0."""
    refs = [references] if isinstance(references, str) else list(references)
    pred = normalize_answer(prediction).strip(_EDGE_PUNCT)
    return float(any(pred == normalize_answer(ref).strip(_EDGE_PUNCT) for ref in refs))


def short_answer(text: str) -> str:
    """A one-word-or-phrase answer normalised for ``cmoe_sceneqa``: whitespace stripped (and collapsed), lower
    case, trailing periods dropped ("Top left." -> "top left")."""
    return normalize_answer(text).rstrip(".").strip()


def short_answer_match(prediction: str, reference: str) -> float:
    """1.0 when the normalised prediction equals the normalised reference (``short_answer``), else 0.0."""
    return float(short_answer(prediction) == short_answer(reference))


def needle_found(prediction: str, answer: str) -> float:
    """1.0 when ``answer`` occurs in the prediction as a whole word (case-insensitive), else 0.0."""
    needle = normalize_answer(answer)
    if not needle:
        raise ValueError("needle_found needs a non-empty answer")
    pattern = r"(?<![0-9a-z])" + re.escape(needle) + r"(?![0-9a-z])"
    return float(re.search(pattern, normalize_answer(prediction)) is not None)


def parse_box(text: str) -> list[float]:
    """The first ``[a, b, c, d]`` of numbers in ``text``; ``[0, 0, 0, 0]`` when there is none (as refcoco)."""
    return read_box(text) or [0.0, 0.0, 0.0, 0.0]


def center_hit(gt: Sequence[float], pred: Sequence[float]) -> float:
    """1.0 when the centre of ``pred`` lies inside ``gt`` (borders included), else 0.0."""
    cx, cy = (pred[0] + pred[2]) / 2, (pred[1] + pred[3]) / 2
    return float(gt[0] <= cx <= gt[2] and gt[1] <= cy <= gt[3])


def box_scores(gt: Sequence[float], pred: Sequence[float]) -> dict[str, float]:
    """Every ``BOX_METRICS`` entry for one prediction."""
    iou = box_iou(gt, pred)
    out = {"IoU": iou}
    out.update({f"ACC@{t}": float(iou >= t) for t in ACC_THRESHOLDS})
    out["Center_ACC"] = center_hit(gt, pred)
    return out


def mean_or_nan(values: Iterable[float]) -> float:
    """Mean of the values; NaN when there are none (an empty bucket is not a score of 0)."""
    values = [float(v) for v in values]
    return statistics.fmean(values) if values else math.nan


def bucket_mean(items: Iterable[dict], key: str | None = None, value=None) -> float:
    """Mean ``score`` of the per-sample dicts whose ``key`` equals ``value`` (all of them when ``key`` is None)."""
    return mean_or_nan(it["score"] for it in items if key is None or it.get(key) == value)


def grid(items: Iterable[dict], keys: Sequence[str]) -> list[dict]:
    """Mean ``score`` and count per combination of ``keys`` present in the items, sorted by the key values."""
    cells: dict[tuple, list[float]] = {}
    for it in items:
        cells.setdefault(tuple(it.get(k) for k in keys), []).append(float(it["score"]))
    return [
        {**dict(zip(keys, cell)), "n": len(scores), "score": statistics.fmean(scores)}
        for cell, scores in sorted(cells.items(), key=lambda kv: tuple(map(_sort_key, kv[0])))
    ]


def _sort_key(v) -> tuple:
    """Numbers before strings, each in natural order."""
    return (0, float(v), "") if isinstance(v, int | float) and not isinstance(v, bool) else (1, 0.0, str(v))
