"""Documents: multi-page text rendered to images, with a question whose answer is a span on one page.

Pages are greyscale PNGs of text from the local corpus (the split's own side: eval pages never reuse training
text), in PIL's embedded font at one of several sizes, 1 or 2 columns, with a "Page k of n" footer. Every page
holds one planted sentence "The code word on page k is WORD." with its own word, so answering needs the right page.
Each sample is ``[page image, ..., question]`` with ``meta``::

    {"kind": "documents", "num_pages": n, "page_size": [W, H], "font_size": 12, "columns": 2,
     "answer_page": 2,                      # 0-based index of the page image holding the answer
     "answer_box": [x1, y1, x2, y2],        # normalised box of the answer word on that page
     "code_words": ["...", ...],            # one per page
     "page_texts": ["line\\nline...", ...]} # exactly the lines drawn on each page (columns in reading order)

and ``qa = [{"type": "page_span", "q": "What is the code word on page 3?", "a": WORD, "page": 2}]``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from PIL import Image, ImageDraw

from data_pipelines.schema import Sample, Segment, image_bytes
from data_pipelines.synthetic._common import (
    INK,
    check_split,
    code_word,
    font,
    line_height,
    paragraphs,
    sample_key,
    sample_rng,
    wrap,
)

FONT_SIZES = (10, 12, 14, 16)
PAGE_WIDTHS = (384, 448, 512)
PAGE_ASPECTS = (1.414, 1.294)  # A4, US letter (height / width)


def _body_lines(rng: random.Random, pool: tuple[str, ...], fnt, col_width: float, capacity: int) -> list[str]:
    """Corpus paragraphs from a random start, wrapped, a blank line between paragraphs, until the page is full."""
    lines: list[str] = []
    i = rng.randrange(len(pool))
    while len(lines) < capacity:
        lines.extend(wrap(pool[i % len(pool)].split(), fnt, col_width))
        lines.append("")
        i += 1
    return lines


def render_page(
    rng: random.Random, pool: tuple[str, ...], page: int, num_pages: int, word: str, layout: dict
) -> tuple[Image.Image, str, list[float]]:
    """One page: (greyscale image, the drawn text, normalised box of ``word`` in the planted sentence)."""
    w, h, columns, fnt = layout["width"], layout["height"], layout["columns"], font(layout["font_size"])
    margin, gutter, lh = round(0.07 * w), round(0.05 * w), line_height(fnt)
    col_width = (w - 2 * margin - (columns - 1) * gutter) / columns
    per_column = (h - 2 * margin - 2 * lh) // lh  # two lines kept for the footer
    capacity = per_column * columns
    planted = wrap(f"The code word on page {page + 1} is {word}.".split(), fnt, col_width)
    body = _body_lines(rng, pool, fnt, col_width, capacity)
    # The planted sentence is a paragraph of its own: at a paragraph start when one leaves it room, else anywhere.
    fits = range(capacity - len(planted) - 1)
    starts = [k for k in fits if k == 0 or body[k - 1] == ""]
    cut = rng.choice(starts) if starts else rng.choice(fits)
    lead = [] if cut == 0 or body[cut - 1] == "" else [""]
    lines = (body[:cut] + lead + planted + [""] + body[cut:])[:capacity]
    at = cut + len(lead)  # first line of the planted sentence

    img = Image.new("L", (w, h), 255)
    draw = ImageDraw.Draw(img)
    box = None
    for k, line in enumerate(lines):
        x, y = margin + (k // per_column) * (col_width + gutter), margin + (k % per_column) * lh
        draw.text((x, y), line, font=fnt, fill=INK)
        if at <= k < at + len(planted) and f"{word}." in line.split():
            start = x + fnt.getlength(line[: line.rindex(word)])
            box = [start, y, start + fnt.getlength(word), y + lh]
    footer = f"Page {page + 1} of {num_pages}"
    draw.text(((w - fnt.getlength(footer)) / 2, h - margin - lh), footer, font=fnt, fill=INK)
    text = "\n".join([*lines, footer])
    norm = [round(box[0] / w, 4), round(box[1] / h, 4), round(box[2] / w, 4), round(box[3] / h, 4)]
    return img, text, norm


def render_document(rng: random.Random, split: str, min_pages: int = 2, max_pages: int = 5) -> tuple[list, dict]:
    """(page images, meta) of one document."""
    pool = paragraphs(split)
    width = rng.choice(PAGE_WIDTHS)
    font_size = rng.choice(FONT_SIZES)
    columns = 2 if font_size <= 12 and rng.random() < 0.5 else 1
    height = round(width * rng.choice(PAGE_ASPECTS))
    layout = {"width": width, "height": height, "columns": columns, "font_size": font_size}
    num_pages = rng.randint(min_pages, max_pages)
    words: list[str] = []
    while len(words) < num_pages:
        word = code_word(rng)
        if word not in words:
            words.append(word)
    pages, texts, boxes = [], [], []
    for p in range(num_pages):
        img, text, box = render_page(rng, pool, p, num_pages, words[p], layout)
        pages.append(img)
        texts.append(text)
        boxes.append(box)
    answer_page = rng.randrange(num_pages)
    meta = {
        "kind": "documents",
        "num_pages": num_pages,
        "page_size": [layout["width"], layout["height"]],
        "font_size": font_size,
        "columns": columns,
        "answer_page": answer_page,
        "answer_box": boxes[answer_page],
        "code_words": words,
        "page_texts": texts,
    }
    return pages, meta


def generate(n: int, seed: int, split: str = "train", min_pages: int = 2, max_pages: int = 5) -> Iterator[Sample]:
    """``n`` documents of ``min_pages..max_pages`` pages, deterministic from (seed, split)."""
    check_split(split)
    if not 1 <= min_pages <= max_pages:
        raise ValueError(f"need 1 <= min_pages <= max_pages, got min_pages={min_pages}, max_pages={max_pages}")
    for i in range(n):
        rng = sample_rng("documents", seed, split, i)
        pages, meta = render_document(rng, split, min_pages, max_pages)
        page = meta["answer_page"]
        question = f"What is the code word on page {page + 1}?"
        segments = [Segment(image=image_bytes(img, "png"), image_ext="png") for img in pages]
        segments.append(Segment(text=question))
        qa = [{"type": "page_span", "q": question, "a": meta["code_words"][page], "page": page}]
        yield Sample(key=sample_key("documents", seed, split, i), segments=segments, meta=meta, qa=qa)
