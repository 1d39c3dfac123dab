"""Chance levels: the score of the best *constant* answer on an evaluation set, per metric.

A model that ignores the images and the context and always gives the same answer scores this much; a score near
it means the model has learned the answer format and the answer prior, not the task.

- Text answers (``best_constant_answer``): every answer present in the docs is tried as the constant; the best
  mean score wins (ties: the first answer in sorted order). For exact match, and for the needle rule, that is the
  majority answer's share; for ANLS, near-misses of other answers count too.
- Per-group constants (``best_constant_per_group``): one constant per group (``cmoe_sceneqa``: the question type,
  which the question's wording gives away), each the best within its group; the score is the mean over all docs.
- Boxes (``best_constant_boxes``): per box metric, the best of the mean box, the coordinate-wise median box and
  every box on a 0.05 grid (x1 < x2, y1 < y2 in {0, 0.05, ..., 1}); so the chosen box may differ per metric.

The search runs on the eval docs themselves: an optimistic baseline (a constant tuned on the test set), which is
what a floor should be.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import numpy as np

from data_pipelines.prompts import BOX_DECIMALS, format_box
from eval import metrics

GRID_STEP = 0.05

Score = Callable[[str, str], float]  # (constant prediction, reference answer) -> score


def unbound_share(objects: Sequence[dict], attribute: str) -> float:
    """How often a reader is right that knows every value of ``attribute`` among a scene's ``objects`` but not which
    object has which, and names one of them at random: 1 / the distinct values (the ``unbound`` level of a binding
    question such as "What colour is the square?")."""
    return 1 / len({o[attribute] for o in objects})


def score_matrix(answers: Sequence[str], score: Score) -> tuple[list[str], np.ndarray]:
    """(candidates: the distinct answers sorted, scores [candidate, doc])."""
    candidates = sorted(set(answers))
    table = np.array([[score(c, a) for a in answers] for c in candidates], dtype=np.float64)
    return candidates, table.reshape(len(candidates), len(answers))


def best_constant_answer(
    answers: Sequence[str], score: Score, subsets: dict[str, Sequence[bool]] | None = None
) -> dict[str, tuple[float | None, str | None]]:
    """Per subset (``{"all": ...}`` when none are given; a mask over ``answers``): (best mean score, the constant).
    An empty subset gives (None, None): no score, as the task reports NaN for an empty bucket."""
    candidates, table = score_matrix(answers, score)
    subsets = subsets if subsets is not None else {"all": [True] * len(answers)}
    out = {}
    for name, mask in subsets.items():
        mask = np.asarray(mask, dtype=bool)
        if not mask.any():
            out[name] = (None, None)
            continue
        means = table[:, mask].mean(axis=1)
        best = int(np.argmax(means))  # first maximum: candidates are sorted, so ties go to the first answer
        out[name] = (float(means[best]), candidates[best])
    return out


def best_constant_per_group(answers: Sequence[str], groups: Sequence, score: Score) -> tuple[float | None, dict]:
    """(mean over all docs of the score of their group's best constant, {group: constant})."""
    if not answers:
        return None, {}
    constants, scores = {}, [0.0] * len(answers)
    for group in sorted(set(groups), key=str):
        mask = [g == group for g in groups]
        (_, constant) = best_constant_answer(answers, score, {"g": mask})["g"]
        constants[group] = constant
        for i, inside in enumerate(mask):
            if inside:
                scores[i] = score(constant, answers[i])
    return statistics.fmean(scores), constants


def _grid_boxes(step: float = GRID_STEP) -> np.ndarray:
    ticks = np.round(np.arange(0.0, 1.0 + step / 2, step), 6)
    lo, hi = np.triu_indices(len(ticks), k=1)  # every (a < b) pair of ticks
    spans = np.stack([ticks[lo], ticks[hi]], axis=1)  # [S, 2]
    xs, ys = np.repeat(spans, len(spans), axis=0), np.tile(spans, (len(spans), 1))
    return np.stack([xs[:, 0], ys[:, 0], xs[:, 1], ys[:, 1]], axis=1)  # [S*S, 4]: x1, y1, x2, y2


def _box_scores(candidates: np.ndarray, truth: np.ndarray) -> dict[str, np.ndarray]:
    """Mean of every ``metrics.BOX_METRICS`` entry per candidate box (as ``metrics.box_scores``, vectorised)."""
    c, t = candidates[:, None, :], truth[None, :, :]
    inter = np.clip(np.minimum(c[..., 2], t[..., 2]) - np.maximum(c[..., 0], t[..., 0]), 0, None) * np.clip(
        np.minimum(c[..., 3], t[..., 3]) - np.maximum(c[..., 1], t[..., 1]), 0, None
    )
    area = lambda b: np.clip(b[..., 2] - b[..., 0], 0, None) * np.clip(b[..., 3] - b[..., 1], 0, None)
    union = area(c) + area(t) - inter
    iou = np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)
    out = {"IoU": iou.mean(axis=1)}
    for th in metrics.ACC_THRESHOLDS:
        out[f"ACC@{th}"] = (iou >= th).mean(axis=1)
    cx, cy = (c[..., 0] + c[..., 2]) / 2, (c[..., 1] + c[..., 3]) / 2
    hit = (t[..., 0] <= cx) & (cx <= t[..., 2]) & (t[..., 1] <= cy) & (cy <= t[..., 3])
    out["Center_ACC"] = hit.mean(axis=1)
    return out


def best_constant_boxes(boxes: Sequence[Sequence[float]], chunk: int = 4096) -> dict[str, tuple[float, str]]:
    """Per box metric: (best mean score, the constant answer ``"[x1, y1, x2, y2]"``) over the mean box, the median
    box (both rounded to the answers' ``BOX_DECIMALS``) and the grid. The search is vectorised; the returned score
    is the chosen answer's, scored through ``metrics.parse_box`` / ``metrics.box_scores`` like a model's."""
    truth = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    if not len(truth):
        return {m: (None, None) for m in metrics.BOX_METRICS}
    centre = np.round(np.concatenate([truth.mean(0, keepdims=True), np.median(truth, 0, keepdims=True)]), BOX_DECIMALS)
    candidates = np.concatenate([centre, _grid_boxes()])
    best: dict[str, tuple[float, int]] = {}
    for start in range(0, len(candidates), chunk):
        for metric, means in _box_scores(candidates[start : start + chunk], truth).items():
            k = int(np.argmax(means))
            if metric not in best or means[k] > best[metric][0]:
                best[metric] = (float(means[k]), start + k)
    out = {}
    for metric, (_, k) in best.items():
        answer = format_box([float(x) for x in candidates[k]])
        box = metrics.parse_box(answer)
        out[metric] = (statistics.fmean(metrics.box_scores(gt, box)[metric] for gt in truth.tolist()), answer)
    return out
