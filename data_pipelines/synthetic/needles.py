"""Needle in a haystack: a long interleaved context (corpus paragraphs and images) with one needle fact at a
chosen depth, either as a text segment or drawn inside an image, and the question that retrieves it.

Each sample is ``[context segment, ..., question]``. The haystack has ``U`` units (paragraphs of the split's side
of the local corpus; scene images; cards with a corpus sentence drawn on them); the needle is inserted before
unit ``round(depth * U)``, so ``depth`` 0 puts it first and 1 last. Depths and modalities follow a fixed grid
(sample ``i``: depth ``DEPTHS[i % 11]``, modality ``MODALITIES[(i // 11) % 2]``), so any 22 consecutive samples
cover every (depth, modality) pair. ``meta``::

    {"kind": "needles", "depth": 0.3, "needle_index": 7,   # segment index of the needle
     "needle_modality": "text" | "image", "needle": "The secret number of Mila is 4821.",
     "needle_box": [x1, y1, x2, y2] | null,                # normalised box of the drawn text (image needles)
     "context_segments": U + 1, "context_images": ..., "context_chars": ...,  # chars: text segments only
     "answer": "value" | "sentence"}

``qa = [{"type": "needle", "q": "What is the secret number of Mila?", "a": "The secret number of Mila is 4821.",
"value": "4821"}]``: the answer restates the needle sentence, the value last (``answer="sentence"``, the default, as
``cmoe_niah`` asks), so that it reaches the value by copying the sentence, as RULER's prompts end in an answer
prefix that repeats the key. A model that has learned to copy a sequence (docs/seeing.md, "Copying a needle") finds
the value that way far sooner than from the question alone. With ``answer="value"`` the answer is the value alone
(``"a": "4821"``, no ``"value"``); ``meta["answer"]`` says which.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from data_pipelines.schema import Sample, Segment, image_bytes
from data_pipelines.synthetic._common import (
    NAMES,
    check_split,
    code_word,
    paragraphs,
    sample_key,
    sample_rng,
    text_card,
)
from data_pipelines.synthetic.scenes import COLOURS, render_scene

DEPTHS = tuple(k / 10 for k in range(11))
MODALITIES = ("text", "image")
ANSWERS = ("value", "sentence")  # the ``answer`` option: the value alone, or the needle sentence restated


def needle_fact(rng: random.Random) -> tuple[str, str, str]:
    """(sentence, question, answer) of one needle."""
    if rng.random() < 0.5:
        name, number = rng.choice(NAMES), str(rng.randint(1000, 9999))
        return f"The secret number of {name} is {number}.", f"What is the secret number of {name}?", number
    colour, word = rng.choice(list(COLOURS)), code_word(rng)
    return f"The password for the {colour} door is {word}.", f"What is the password for the {colour} door?", word


def _haystack_unit(rng: random.Random, pool: tuple[str, ...], image_share: float) -> Segment:
    if rng.random() >= image_share:
        return Segment(text=rng.choice(pool))
    if rng.random() < 0.5:
        img, _ = render_scene(rng, max_objects=3)
    else:
        sentence = " ".join(rng.choice(pool).split()[:24])
        img, _, _ = text_card(rng, sentence, rng.choice((14, 16, 18)), rng.choice((256, 320, 384)))
    return Segment(image=image_bytes(img, "png"), image_ext="png")


def generate(
    n: int,
    seed: int,
    split: str = "train",
    min_units: int = 12,
    max_units: int = 40,
    image_share: float = 0.3,
    modalities: tuple[str, ...] | str = MODALITIES,
    answer: str = "sentence",
) -> Iterator[Sample]:
    """``n`` haystacks of ``min_units..max_units`` units (``image_share`` of them images), deterministic from
    (seed, split). ``modalities`` keeps the needles of those modalities (``"text"``: a copying stage with no
    reading of drawn text); the depth grid then cycles over the kept ones. ``answer``: ``"value"`` or
    ``"sentence"`` (the module docstring)."""
    check_split(split)
    if not 1 <= min_units <= max_units:
        raise ValueError(f"need 1 <= min_units <= max_units, got min_units={min_units}, max_units={max_units}")
    if not 0.0 <= image_share <= 1.0:
        raise ValueError(f"image_share must be in [0, 1], got {image_share}")
    if answer not in ANSWERS:
        raise ValueError(f"answer must be one of {ANSWERS}, got {answer!r}")
    kept = (modalities,) if isinstance(modalities, str) else tuple(modalities)
    if not kept or set(kept) - set(MODALITIES) or len(set(kept)) != len(kept):
        raise ValueError(f"modalities must be distinct values among {MODALITIES}, got {modalities!r}")
    pool = paragraphs(split)
    for i in range(n):
        rng = sample_rng("needles", seed, split, i)
        depth, modality = DEPTHS[i % len(DEPTHS)], kept[(i // len(DEPTHS)) % len(kept)]
        units = [_haystack_unit(rng, pool, image_share) for _ in range(rng.randint(min_units, max_units))]
        sentence, question, value = needle_fact(rng)
        needle_box = None
        if modality == "text":
            needle = Segment(text=sentence)
        else:
            img, needle_box, _ = text_card(rng, sentence, rng.choice((14, 16, 18, 20)), rng.choice((256, 320, 384)))
            needle = Segment(image=image_bytes(img, "png"), image_ext="png")
        at = round(depth * len(units))
        context = units[:at] + [needle] + units[at:]
        meta = {
            "kind": "needles",
            "depth": depth,
            "needle_index": at,
            "needle_modality": modality,
            "needle": sentence,
            "needle_box": needle_box,
            "context_segments": len(context),
            "context_images": sum(seg.image is not None for seg in context),
            "context_chars": sum(len(seg.text) for seg in context if seg.text is not None),
            "answer": answer,
        }
        qa = [{"type": "needle", "q": question, "a": value}]
        if answer == "sentence":
            qa = [{**qa[0], "a": sentence, "value": value}]
        segments = [*context, Segment(text=question)]
        yield Sample(key=sample_key("needles", seed, split, i), segments=segments, meta=meta, qa=qa)
