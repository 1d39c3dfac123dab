"""Shared pieces of the synthetic generators: per-sample random streams, keys, text pools, fonts, wrapping."""

from __future__ import annotations

import functools
import hashlib
import random
import re

from PIL import Image, ImageDraw, ImageFont

SPLITS = ("train", "eval")
INK = 20  # text colour (grey level) on pages and cards
_SYLLABLES = ("ka", "lo", "mi", "ven", "dar", "tos", "ri", "bel", "qu", "zan", "no", "pel", "sha", "tur", "vi", "gor")
NAMES = ("Ada", "Boris", "Chen", "Dalia", "Emeka", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kira", "Luca", "Mila")


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def sample_rng(kind: str, seed: int, split: str, index: int) -> random.Random:
    """The random stream of one sample: a hash of (kind, seed, split, index), so samples are independent of ``n``
    (the first k of ``generate(n)`` are ``generate(k)``) and train / eval never share a stream."""
    digest = hashlib.sha256(f"{kind}/{seed}/{split}/{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:16], "big"))


def sample_key(kind: str, seed: int, split: str, index: int) -> str:
    return f"{kind}-{split}-s{seed}-{index:07d}"  # no dots: webdataset splits member names at the first dot


def code_word(rng: random.Random, syllables: int = 3) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(syllables))


_ASCII_WORD = re.compile(r"^[\x21-\x7e]+$")


@functools.lru_cache(maxsize=2)
def paragraphs(split: str) -> tuple[str, ...]:
    """Paragraphs (blank-line separated, whitespace collapsed, printable-ASCII words only: the default font has
    no other glyphs) of the local text corpus's ``split`` side, so train and eval pages never share a source."""
    from data_pipelines.local_text import load_local_text_corpus  # imports torch: only when text is needed

    out = []
    for doc in load_local_text_corpus()[split]:
        for block in re.split(r"\n\s*\n", doc):
            words = [w for w in block.split() if _ASCII_WORD.match(w)]
            if len(words) >= 8:
                out.append(" ".join(words))
    return tuple(out)


@functools.lru_cache(maxsize=32)
def font(size: int) -> ImageFont.FreeTypeFont:
    """PIL's embedded font (Aileron) at ``size`` px: the same on every machine with this Pillow."""
    return ImageFont.load_default(size=size)


@functools.lru_cache(maxsize=200_000)
def _width(size: int, word: str) -> float:
    return font(size).getlength(word)


def wrap(words: list[str], fnt: ImageFont.FreeTypeFont, width: float) -> list[str]:
    """Greedy word wrap to ``width`` px (line width = sum of cached word widths and spaces, kerning across spaces
    ignored); a word wider than a line is cut into pieces that fit."""
    size, lines, line, used = fnt.size, [], [], 0.0
    space = _width(size, " ")
    for word in words:
        while _width(size, word) > width and len(word) > 1:
            cut = max(1, int(len(word) * width / _width(size, word)) - 1)
            if line:
                lines.append(" ".join(line))
                line, used = [], 0.0
            lines.append(word[:cut])
            word = word[cut:]
        w = _width(size, word)
        if line and used + space + w > width:
            lines.append(" ".join(line))
            line, used = [], 0.0
        used += w + (space if line else 0.0)
        line.append(word)
    if line:
        lines.append(" ".join(line))
    return lines


def line_height(fnt: ImageFont.FreeTypeFont) -> int:
    ascent, descent = fnt.getmetrics()
    return ascent + descent + max(2, fnt.size // 5)


def text_card(rng: random.Random, text: str, size: int, width: int) -> tuple[Image.Image, list[float], list[str]]:
    """``text`` drawn on a pale card ``width`` px wide: (RGB image, normalised box of the text, the drawn lines)."""
    fnt, pad = font(size), rng.randint(8, 24)
    lines = wrap(text.split(), fnt, width - 2 * pad)
    lh = line_height(fnt)
    height = 2 * pad + lh * len(lines)
    background = tuple(rng.randint(225, 255) for _ in range(3))
    img = Image.new("RGB", (width, height), background)
    draw = ImageDraw.Draw(img)
    for i, line in enumerate(lines):
        draw.text((pad, pad + i * lh), line, font=fnt, fill=(INK, INK, INK))
    x0, y0, x1, y1 = Image.eval(img.convert("L"), lambda v: 255 if v < 128 else 0).getbbox()
    return img, [round(x0 / width, 4), round(y0 / height, 4), round(x1 / width, 4), round(y1 / height, 4)], lines
