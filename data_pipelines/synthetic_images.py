"""Small synthetic image-text data generated on the fly (no network): captioned shapes on canvases.

The smallest image-text source: one call, one captioned image, no shards to write or read. Tests use it for
quick VLM batches (``tests/conftest.py`` and the shard fixtures), and ``scripts/bench_vlm_chunking.py`` trains on
it; the shard generators for training data are in ``data_pipelines/synthetic/``. Deterministic given the
``random.Random``.
"""

import random

from PIL import Image, ImageDraw

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40)}
SHAPES = ("square", "circle")
SIZES = ((64, 64), (96, 48), (48, 96), (80, 64))


def captioned_image(rng: random.Random) -> tuple[Image.Image, str]:
    """A shape of some colour on the left or right of a canvas of some size, and its caption."""
    colour, shape, (w, h) = rng.choice(list(COLOURS)), rng.choice(SHAPES), rng.choice(SIZES)
    side = rng.choice(("left", "right"))
    img = Image.new("RGB", (w, h), (255, 255, 255))
    x0 = 4 if side == "left" else w // 2 + 4
    box = (x0, h // 4, x0 + w // 2 - 8, 3 * h // 4)
    draw = ImageDraw.Draw(img)
    (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=COLOURS[colour])
    return img, f"a {colour} {shape} on the {side}."
