"""What an image budget does to an evaluation task's images: tokens, and how far each image is shrunk.

The image processor (``vision_tower.image_processor``) fits every image into ``max_patches`` patches, never
enlarging it: a scene of 300 x 220 px costs 15 tokens at 64 patches (after the 2 x 2 pixel shuffle), and so does a
page of 512 x 724 px, drawn at a fifth of its size. Whether a model can read a page's print or a needle drawn on a
card depends on the second number, which a score alone does not show. :func:`budget_rows` reads a task's data
(``OUT/<task>/data/test.jsonl`` and its images, as ``eval.eval_data`` writes them; only the image headers are
read) and reports, per budget:

- ``tokens_image``: language-model tokens per image (median and maximum), ``tokens_doc``: all images of one doc
  (maximum);
- ``scale``: the linear scale of each image's shorter-drawn side, ``min(grid_h * patch / height, grid_w * patch /
  width)`` (median and minimum; 1.0 is native size);
- ``text_px``: where a doc gives the ``font_size`` its pages were drawn at (``cmoe_longdoc``), that size times the
  vertical scale: the height the model's tower sees a line of print at (median and minimum).

``python scripts/image_budget.py --max-patches 64,256,1024`` prints it for every task (``docs/seeing.md``,
"What reading print would take").
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from eval.tasks.common import image_paths
from vision_tower.image_processor import ImageProcessor


@dataclass
class BudgetRow:
    """One task at one budget (the module docstring defines each number)."""

    task: str
    max_patches: int
    docs: int
    images: int
    tokens_image_median: float
    tokens_image_max: int
    tokens_doc_max: int
    scale_median: float
    scale_min: float
    text_px_median: float | None = None  # only where docs give a font_size
    text_px_min: float | None = None


def _image_size(path: Path) -> tuple[int, int]:
    try:
        with Image.open(path) as img:  # reads the header only
            return img.size
    except (OSError, UnidentifiedImageError) as err:
        raise ValueError(f"image_budget: cannot read image {path}: {err}") from None


def budget_rows(
    task_dir: str | Path, budgets: list[int], pixel_shuffle: int = 2, patch_size: int = 16
) -> list[BudgetRow]:
    """One :class:`BudgetRow` per budget for the task in ``task_dir`` (the folder holding ``data/test.jsonl``)."""
    task_dir = Path(task_dir)
    data = task_dir / "data"
    jsonl = data / "test.jsonl"
    if not jsonl.is_file():
        raise ValueError(f"image_budget: {jsonl} not found (build the task's data: python scripts/make_eval_data.py)")
    docs = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    sizes = [[_image_size(data / p) for p in image_paths(doc)] for doc in docs]
    rows = []
    for budget in budgets:
        proc = ImageProcessor(patch_size=patch_size, max_patches=budget, pixel_shuffle=pixel_shuffle)
        tokens, doc_tokens, scales, text_px = [], [], [], []
        for doc, doc_sizes in zip(docs, sizes):
            total = 0
            for width, height in doc_sizes:
                grid_h, grid_w = proc.grid_for(height, width)
                tokens.append(grid_h * grid_w // pixel_shuffle**2)
                total += tokens[-1]
                scales.append(min(grid_h * patch_size / height, grid_w * patch_size / width))
                if doc.get("font_size"):
                    text_px.append(doc["font_size"] * grid_h * patch_size / height)
            doc_tokens.append(total)
        if not tokens:
            raise ValueError(f"image_budget: {jsonl} holds no images")
        rows.append(
            BudgetRow(
                task=task_dir.name,
                max_patches=budget,
                docs=len(docs),
                images=len(tokens),
                tokens_image_median=statistics.median(tokens),
                tokens_image_max=max(tokens),
                tokens_doc_max=max(doc_tokens),
                scale_median=statistics.median(scales),
                scale_min=min(scales),
                text_px_median=statistics.median(text_px) if text_px else None,
                text_px_min=min(text_px) if text_px else None,
            )
        )
    return rows


def markdown(rows: list[BudgetRow]) -> str:
    """The rows as a markdown table."""
    lines = [
        "| task | max_patches | images (docs) | tokens per image: median / max | image tokens per doc: max "
        "| scale: median / min | print height px: median / min |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        text = "-" if r.text_px_median is None else f"{r.text_px_median:.1f} / {r.text_px_min:.1f}"
        lines.append(
            f"| `{r.task}` | {r.max_patches} | {r.images} ({r.docs}) "
            f"| {r.tokens_image_median:g} / {r.tokens_image_max} | {r.tokens_doc_max} "
            f"| {r.scale_median:.2f} / {r.scale_min:.2f} | {text} |"
        )
    return "\n".join(lines) + "\n"
