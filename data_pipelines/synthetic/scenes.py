"""Scenes: shapes of several colours, sizes and positions on canvases of varied size and aspect ratio.

Each sample is ``[image, caption]`` with ``meta``::

    {"kind": "scenes", "canvas": {"width": W, "height": H}, "background": [r, g, b],
     "objects": [{"shape": "circle", "colour": "red", "size": "small", "position": "top left",
                  "box": [x1, y1, x2, y2],  # normalised to [0, 1], x2 / y2 exclusive
                  "box_px": [x1, y1, x2, y2]}, ...]}  # pixels, exclusive end: image.crop(box_px)

Boxes are measured on the rendered pixels (the tight box of each shape's mask); shapes never overlap and a scene
has each (colour, shape) pair at most once, so "the red square" always names one object. ``qa`` items carry
``type`` (count / colour / shape / position / box); box answers are ``"[x1, y1, x2, y2]"`` with 2 decimals and the
exact box under ``"box"``. Drawing is aliasing-free (PIL draws without anti-aliasing) and saved as PNG, so every
object pixel has exactly its colour.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence

from PIL import Image, ImageDraw

from data_pipelines import prompts
from data_pipelines.schema import Sample, Segment, image_bytes
from data_pipelines.synthetic._common import check_split, sample_key, sample_rng

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 40),
    "purple": (140, 60, 180),
    "orange": (245, 140, 30),
    "black": (20, 20, 20),
    "cyan": (40, 190, 200),
}
SHAPES = ("square", "circle", "triangle", "diamond", "star")
SIZES = {"small": (0.12, 0.18), "medium": (0.22, 0.30), "large": (0.34, 0.42)}  # side / the canvas's short side
BACKGROUNDS = ((255, 255, 255), (232, 232, 232), (250, 244, 228))
ASPECTS = (1.0, 4 / 3, 3 / 4, 16 / 9, 9 / 16, 2.0, 0.5, 3 / 2, 2 / 3)
AREAS = (128, 160, 192, 224, 256, 320)  # sqrt of the canvas area in pixels
QA_TYPES = ("count", "position", "box", "colour", "shape")  # the ``qa`` item types of ``questions``
MAX_OBJECT_SIZE = 0.95  # ``object_size`` bound: a shape always fits its canvas with a margin


def _polygon(shape: str, x0: int, y0: int, s: int) -> list[tuple[float, float]]:
    if shape == "triangle":
        return [(x0 + s / 2, y0), (x0 + s - 1, y0 + s - 1), (x0, y0 + s - 1)]
    if shape == "diamond":
        return [(x0 + s / 2, y0), (x0 + s - 1, y0 + s / 2), (x0 + s / 2, y0 + s - 1), (x0, y0 + s / 2)]
    r_out, cx, cy = (s - 1) / 2, x0 + (s - 1) / 2, y0 + (s - 1) / 2  # star: 5 points
    points = []
    for k in range(10):
        r, a = (r_out if k % 2 == 0 else r_out * 0.45), -math.pi / 2 + k * math.pi / 5
        points.append((cx + r * math.cos(a), cy + r * math.sin(a)))
    return points


def _draw_mask(shape: str, size: tuple[int, int], x0: int, y0: int, s: int) -> Image.Image:
    mask = Image.new("L", size, 0)
    draw = ImageDraw.Draw(mask)
    if shape == "square":
        draw.rectangle((x0, y0, x0 + s - 1, y0 + s - 1), fill=255)
    elif shape == "circle":
        draw.ellipse((x0, y0, x0 + s - 1, y0 + s - 1), fill=255)
    else:
        draw.polygon(_polygon(shape, x0, y0, s), fill=255)
    return mask


def _apart(a: tuple[int, ...], b: tuple[int, ...], gap: int = 3) -> bool:
    """Boxes (x0, y0, x1, y1) at least ``gap`` px apart along some axis."""
    return a[2] + gap <= b[0] or b[2] + gap <= a[0] or a[3] + gap <= b[1] or b[3] + gap <= a[1]


def position_word(cx: float, cy: float) -> str:
    """'top left' ... 'center' ... 'bottom right' for a normalised centre (thirds of the canvas)."""
    h = "left" if cx < 1 / 3 else "right" if cx > 2 / 3 else ""
    v = "top" if cy < 1 / 3 else "bottom" if cy > 2 / 3 else ""
    return f"{v} {h}".strip() or "center"


def size_word(fraction: float) -> str:
    """The size name of a shape whose side is ``fraction`` of the canvas's short side (the nearest ``SIZES`` band)."""
    return min(SIZES, key=lambda name: abs(fraction - sum(SIZES[name]) / 2))


def render_scene(
    rng: random.Random, max_objects: int = 5, object_size: tuple[float, float] | None = None
) -> tuple[Image.Image, dict]:
    """One canvas with 1..max_objects non-overlapping shapes, and its meta (see the module docstring).

    ``object_size`` (low, high): every shape's side drawn uniformly in that fraction of the canvas's short side,
    named by :func:`size_word`, instead of a size band of ``SIZES`` (a curriculum's large, easy objects)."""
    side, aspect = rng.choice(AREAS), rng.choice(ASPECTS)
    w, h = round(side * math.sqrt(aspect)), round(side / math.sqrt(aspect))
    background = rng.choice(BACKGROUNDS)
    img = Image.new("RGB", (w, h), background)
    n_objects = rng.choices(range(1, max_objects + 1), weights=[3, 3, 3, 2, 2][:max_objects])[0]
    pairs = rng.sample([(c, s) for c in COLOURS for s in SHAPES], n_objects)
    taken: list[tuple[int, int, int, int]] = []
    objects = []
    for colour, shape in pairs:
        if object_size is None:
            size_name = rng.choice(list(SIZES))
            fraction = rng.uniform(*SIZES[size_name])
        else:
            fraction = rng.uniform(*object_size)
            size_name = size_word(fraction)
        s = max(8, round(min(w, h) * fraction))
        for _ in range(50):  # rejection sampling: keep a 3 px gap to every placed shape
            x0, y0 = rng.randint(0, w - s), rng.randint(0, h - s)
            if all(_apart((x0, y0, x0 + s, y0 + s), other) for other in taken):
                break
        else:
            continue
        taken.append((x0, y0, x0 + s, y0 + s))
        mask = _draw_mask(shape, (w, h), x0, y0, s)
        img.paste(COLOURS[colour], (0, 0, w, h), mask)
        bx0, by0, bx1, by1 = mask.getbbox()
        box = [round(bx0 / w, 4), round(by0 / h, 4), round(bx1 / w, 4), round(by1 / h, 4)]
        position = position_word((bx0 + bx1) / 2 / w, (by0 + by1) / 2 / h)
        objects.append(
            {
                "shape": shape,
                "colour": colour,
                "size": size_name,
                "position": position,
                "box": box,
                "box_px": [bx0, by0, bx1, by1],
            }
        )
    meta = {"kind": "scenes", "canvas": {"width": w, "height": h}, "background": list(background), "objects": objects}
    return img, meta


def _where(position: str) -> str:
    if position == "center":
        return "in the center"
    return f"on the {position}" if position in ("left", "right") else f"at the {position}"


def caption(rng: random.Random, meta: dict) -> str:
    parts = [f"a {o['size']} {o['colour']} {o['shape']} {_where(o['position'])}" for o in meta["objects"]]
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    w, h = meta["canvas"]["width"], meta["canvas"]["height"]
    shape_word = "square" if w == h else "wide" if w > h else "tall"
    n = len(parts)
    template = rng.randrange(3)
    if template == 0:
        return f"{listed[0].upper()}{listed[1:]}."
    if template == 1:
        return f"A {shape_word} {w}x{h} image with {n} shape{'s' * (n > 1)}: {listed}."
    return f"This picture shows {listed}."


def questions(rng: random.Random, meta: dict) -> list[dict]:
    objects = meta["objects"]
    qa = [{"type": "count", "q": "How many shapes are there?", "a": str(len(objects))}]
    shape = rng.choice(SHAPES)
    qa.append(
        {"type": "count", "q": f"How many {shape}s are there?", "a": str(sum(o["shape"] == shape for o in objects))}
    )
    target = rng.choice(objects)
    name = f"{target['colour']} {target['shape']}"
    qa.append({"type": "position", "q": f"In which part of the image is the {name}?", "a": target["position"]})
    box_qa = {"type": "box", "q": prompts.refloc_question(name), "a": prompts.format_box(target["box"])}
    qa.append(box_qa | {"box": target["box"]})
    if sum(o["shape"] == target["shape"] for o in objects) == 1:
        qa.append({"type": "colour", "q": f"What colour is the {target['shape']}?", "a": target["colour"]})
    if sum(o["colour"] == target["colour"] for o in objects) == 1:
        qa.append({"type": "shape", "q": f"What shape is the {target['colour']} object?", "a": target["shape"]})
    return qa


def referring_expression(rng: random.Random, target: dict, objects: list[dict]) -> tuple[str, str]:
    """(expression, kind) naming ``target`` and no other object of ``objects``: "red square" (colour+shape),
    "square" (shape), "red object" (colour), "small square" (size+shape) or "square at the top left"
    (shape+position), one of those that are unambiguous in the scene, drawn with ``rng`` (cmoe_refloc's
    expressions, and the refloc conversations of ``scenes_chat``)."""
    unique = lambda **kv: sum(all(o[k] == v for k, v in kv.items()) for o in objects) == 1
    options = [(f"{target['colour']} {target['shape']}", "colour+shape")]
    if unique(shape=target["shape"]):
        options.append((target["shape"], "shape"))
    if unique(colour=target["colour"]):
        options.append((f"{target['colour']} object", "colour"))
    if unique(size=target["size"], shape=target["shape"]):
        options.append((f"{target['size']} {target['shape']}", "size+shape"))
    if unique(position=target["position"]):
        where = "in the center" if target["position"] == "center" else f"at the {target['position']}"
        options.append((f"{target['shape']} {where}", "shape+position"))
    return rng.choice(options)


def generate(
    n: int,
    seed: int,
    split: str = "train",
    max_objects: int = 5,
    object_size: Sequence[float] | None = None,
    types: Sequence[str] | None = None,
) -> Iterator[Sample]:
    """``n`` scene samples, deterministic from (seed, split) and the options (``render_scene``'s, and ``types``:
    the ``QA_TYPES`` kept in each sample's ``qa``, None for all; images and captions do not depend on it)."""
    check_split(split)
    types = (types,) if isinstance(types, str) else types  # one type, as ``make_shards --option types=colour`` gives
    if types is not None and (not types or set(types) - set(QA_TYPES)):
        raise ValueError(f"types must be a non-empty list of {', '.join(QA_TYPES)}, got {types!r}")
    if not 1 <= max_objects <= 5:
        raise ValueError(f"max_objects must be in 1..5, got {max_objects}")
    if object_size is not None:
        size_ok = isinstance(object_size, (list, tuple)) and len(object_size) == 2
        object_size = tuple(object_size) if size_ok else object_size
        if not size_ok or not 0.05 <= object_size[0] <= object_size[1] <= MAX_OBJECT_SIZE:
            raise ValueError(f"object_size must be (low, high) with 0.05 <= low <= high <= 0.95, got {object_size}")
    for i in range(n):
        rng = sample_rng("scenes", seed, split, i)
        img, meta = render_scene(rng, max_objects, object_size)
        segments = [Segment(image=image_bytes(img, "png"), image_ext="png"), Segment(text=caption(rng, meta))]
        qa = [item for item in questions(rng, meta) if types is None or item["type"] in types]
        yield Sample(key=sample_key("scenes", seed, split, i), segments=segments, meta=meta, qa=qa)
