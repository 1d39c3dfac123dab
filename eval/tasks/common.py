"""Shared pieces of the local lmms-eval tasks: robust loading of the JSONL docs, prompts, visuals, per-sample scoring
and the aggregations (overall and per bucket).

Each task folder's ``utils.py`` binds these to its own ``data/`` folder (image paths in the JSONL are relative to
it). The YAMLs load ``data/test.jsonl`` with the ``text`` builder, one raw line per row, and ``process_docs``
parses the lines here: a malformed line or a doc whose image file is missing is skipped and counted (one warning
line each, a summary line), never a crash mid-run.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from PIL import Image

from data_pipelines import prompts
from data_pipelines.jsonl import read_json_lines
from eval import metrics
from eval.eval_data import LONGDOC_PAGES, NIAH_DEPTHS, NIAH_LENGTHS, NIAH_MODALITIES, SCENEQA_TYPES

logger = logging.getLogger("lmms-eval")

REQUIRED = {
    "cmoe_longdoc": ("id", "pages", "question", "answer", "num_pages"),
    "cmoe_niah": ("id", "segments", "question", "answer", "depth", "length", "modality"),
    "cmoe_refloc": ("id", "image", "expression", "bbox"),
    "cmoe_sceneqa": ("id", "image", "question", "answer", "type"),
    "cmoe_sceneqa_one": ("id", "image", "question", "answer", "type"),
}
MAX_LISTED = 5


# ----------------------------------------------------------------------------------------------------------------
# Loading


def image_paths(doc: dict) -> list[str]:
    """Every image path a doc refers to (relative as stored), in order: ``pages`` (documents), image ``segments``
    (needle haystacks), else ``image`` (scenes; none when the doc has no image)."""
    if "pages" in doc:
        return list(doc["pages"])
    if "segments" in doc:
        return [seg["image"] for seg in doc["segments"] if seg.get("image")]
    return [doc["image"]] if doc.get("image") else []


def _resolve(doc: dict, data_dir: Path) -> dict:
    """The doc with its image paths made absolute against ``data_dir``."""
    absolute = lambda p: str((data_dir / p).resolve())
    if "pages" in doc:
        doc["pages"] = [absolute(p) for p in doc["pages"]]
    elif "segments" in doc:
        doc["segments"] = [
            {"text": seg.get("text"), "image": absolute(seg["image"]) if seg.get("image") else None}
            for seg in doc["segments"]
        ]
    else:
        doc["image"] = absolute(doc["image"])
    return doc


def parse_lines(lines, data_dir: Path, task: str) -> tuple[list[dict], dict]:
    """Docs from raw JSONL lines: (docs, counts of ``malformed`` / ``missing_field`` / ``missing_image`` skips)."""
    docs, skipped = [], {"malformed": 0, "missing_field": 0, "missing_image": 0}

    def malformed(lineno: int, why: str) -> None:
        skipped["malformed"] += 1
        logger.warning("%s: line %d skipped, malformed JSON (%s)", task, lineno, why)

    for lineno, doc in read_json_lines(lines, malformed):
        missing = [k for k in REQUIRED[task] if k not in doc]
        if missing:
            skipped["missing_field"] += 1
            logger.warning("%s: line %d skipped, missing field(s) %s", task, lineno, missing)
            continue
        absent = [p for p in image_paths(doc) if not (data_dir / p).is_file()]
        if absent:
            skipped["missing_image"] += 1
            logger.warning("%s: line %d (%s) skipped, image file missing: %s", task, lineno, doc["id"], absent[0])
            continue
        docs.append(_resolve(doc, data_dir))
    return docs, skipped


def process_docs(dataset, data_dir: Path, task: str):
    """lmms-eval ``process_docs``: the ``text`` builder's raw lines -> a Dataset of parsed, validated docs."""
    from datasets import Dataset

    docs, skipped = parse_lines(dataset["text"], data_dir, task)
    if any(skipped.values()):
        logger.warning("%s: %d docs kept, skipped %s", task, len(docs), skipped)
    if not docs:
        raise ValueError(f"{task}: no usable doc in {data_dir / 'test.jsonl'} (skipped {skipped}); run make_eval_data")
    return Dataset.from_list(docs)


def _open(path: str) -> Image.Image:
    """An image, fully read (file handle closed), or a one-line FileNotFoundError."""
    try:
        with Image.open(path) as im:
            im.load()
            return im.copy()
    except (FileNotFoundError, OSError) as err:
        raise FileNotFoundError(f"image {path} cannot be read ({type(err).__name__})") from None


# ----------------------------------------------------------------------------------------------------------------
# Prompts and visuals


def _affixed(text: str, kwargs: dict | None) -> str:
    """The builder's text (``data_pipelines.prompts``, instruction included) inside the YAML's ``pre_prompt`` /
    ``post_prompt`` (empty in the shipped YAMLs: extra affixes for experiments only)."""
    kwargs = kwargs or {}
    return kwargs.get("pre_prompt", "") + text + kwargs.get("post_prompt", "")


def longdoc_visual(doc: dict) -> list[Image.Image]:
    """The pages, in order."""
    return [_open(p) for p in doc["pages"]]


def longdoc_text(doc: dict, lmms_eval_specific_kwargs: dict | None = None) -> str:
    """One ``<image>`` per page (one per line), then the question and the instruction (``prompts.longdoc``)."""
    return _affixed(prompts.longdoc(len(doc["pages"]), doc["question"]), lmms_eval_specific_kwargs)


def niah_visual(doc: dict) -> list[Image.Image]:
    """The haystack's images in context order (the needle's card among them for image needles)."""
    return [_open(seg["image"]) for seg in doc["segments"] if seg.get("image")]


def niah_text(doc: dict, lmms_eval_specific_kwargs: dict | None = None) -> str:
    """The interleaved context (text paragraphs and ``<image>`` markers, one per line), then the question and the
    instruction (``prompts.niah``)."""
    context = [None if seg.get("image") else seg["text"] for seg in doc["segments"]]
    return _affixed(prompts.niah(context, doc["question"]), lmms_eval_specific_kwargs)


def refloc_visual(doc: dict) -> list[Image.Image]:
    """The scene."""
    return [_open(doc["image"])]


def refloc_text(doc: dict, lmms_eval_specific_kwargs: dict | None = None) -> str:
    """The scene, then the box question about the referring expression and the instruction (``prompts.refloc``)."""
    return _affixed(prompts.refloc(doc["expression"]), lmms_eval_specific_kwargs)


sceneqa_visual = refloc_visual  # the scene


def sceneqa_text(doc: dict, lmms_eval_specific_kwargs: dict | None = None) -> str:
    """The scene, then the question and the instruction (``prompts.sceneqa``)."""
    return _affixed(prompts.sceneqa(doc["question"]), lmms_eval_specific_kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Per-sample results


def _first(results) -> str:
    return str(results[0]) if results else ""


def longdoc_results(doc: dict, results) -> dict:
    """ANLS and exact match, plus the same scores tagged with the page count for the per-bucket metrics."""
    pred = _first(results)
    a, em = metrics.anls(pred, doc["answer"]), metrics.exact_match(pred, doc["answer"])
    out = {"anls": a, "exact_match": em}
    for p in LONGDOC_PAGES:
        out[f"anls_pages_{p}"] = {"score": a, "pages": doc["num_pages"]}
        out[f"exact_match_pages_{p}"] = {"score": em, "pages": doc["num_pages"]}
    return out


def niah_results(doc: dict, results) -> dict:
    """``acc`` (needle found, 0/1) and the same score tagged with depth, length and modality for the per-bucket
    metrics and the grid."""
    score = metrics.needle_found(_first(results), doc["answer"])
    item = {"score": score, "depth": doc["depth"], "length": doc["length"], "modality": doc["modality"]}
    names = [f"acc_{m}" for m in NIAH_MODALITIES]
    names += [f"acc_depth_{round(d * 100)}" for d in NIAH_DEPTHS] + [f"acc_len_{n}" for n in NIAH_LENGTHS]
    return {"acc": score} | {name: dict(item) for name in names}


def refloc_results(doc: dict, results) -> dict:
    """IoU, ACC@0.1..0.9 and Center_ACC of the first ``[x1, y1, x2, y2]`` in the answer."""
    return metrics.box_scores(doc["bbox"], metrics.parse_box(_first(results)))


def sceneqa_results(doc: dict, results) -> dict:
    """``acc`` (normalised exact match, ``metrics.short_answer_match``) and the same score tagged with the question
    type for ``acc_count`` / ``acc_colour`` / ``acc_shape`` / ``acc_position``."""
    score = metrics.short_answer_match(_first(results), doc["answer"])
    return {"acc": score} | {f"acc_{t}": {"score": score, "type": doc["type"]} for t in SCENEQA_TYPES}


# ----------------------------------------------------------------------------------------------------------------
# Aggregations


def bucket(key: str, value):
    """An lmms-eval aggregation: mean ``score`` of the items whose ``key`` equals ``value`` (NaN when none)."""

    def aggregate(items) -> float:
        return metrics.bucket_mean(items, key, value)

    aggregate.__name__ = f"mean_{key}_{value}"
    aggregate.__doc__ = f"Mean score of the samples with {key} == {value!r} (NaN when there is none)."
    return aggregate


def niah_grid_and_bucket(key: str, value):
    """Like ``bucket``, and also writes the length x modality x depth grid to ``OUTPUT/cmoe_niah_grid.json``
    (lmms-eval passes ``args`` with the ``--output_path``)."""

    def aggregate(items, args=None) -> float:
        output_path = getattr(args, "output_path", None)
        if output_path:
            path = Path(output_path) / "cmoe_niah_grid.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            cells = metrics.grid(items, ("length", "modality", "depth"))
            path.write_text(json.dumps({"task": "cmoe_niah", "cells": cells}, indent=1) + "\n", encoding="utf-8")
        return metrics.bucket_mean(items, key, value)

    aggregate.__name__ = f"mean_{key}_{value}_and_grid"
    return aggregate


def sceneqa_hooks(data_dir: Path, task: str) -> dict:
    """The lmms-eval hooks of a sceneqa-style task (``cmoe_sceneqa``, ``cmoe_sceneqa_one``) bound to its ``data/``:
    ``process_docs``, the visual / text / results functions and one ``acc_<type>`` aggregation per question type."""

    def process(dataset):
        """Parse and validate ``data/test.jsonl`` (bad lines and missing images skipped and counted)."""
        return process_docs(dataset, data_dir, task)

    hooks = {"process_docs": process, "doc_to_visual": sceneqa_visual, "doc_to_text": sceneqa_text}
    hooks["process_results"] = sceneqa_results
    return hooks | {f"acc_{t}": bucket("type", t) for t in SCENEQA_TYPES}
