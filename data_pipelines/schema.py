"""The sample schema of the toolkit's webdataset shards, and its encoding to / decoding from tar members.

One sample per key, written as these tar members:

    <key>.json        {"segments": [{"text": "..."}, {"image": "img0.png"}, ...], "meta": {...}, "qa": [...]}
    <key>.img0.png    the bytes of every image a segment names (png / jpg / jpeg / webp)

Also read as they are: img2dataset pairs (``<key>.jpg`` + ``<key>.txt`` [+ ``<key>.json`` metadata]) become
[image, caption]; text-only samples (``<key>.txt``) become [text].

Decoding never crashes on bad input: it raises :class:`SkipSample` with one of :data:`SKIP_KINDS`, which
readers count and report.
"""

from __future__ import annotations

import enum
import io
import json
from dataclasses import dataclass, field

from PIL import Image

IMAGE_EXTS = ("png", "jpg", "jpeg", "webp")
SKIP_KINDS = ("truncated_tar", "bad_image", "bad_json", "image_too_large", "too_long", "missing_field")
MAX_IMAGE_PIXELS = 64_000_000  # above this an image is skipped as image_too_large (decompression-bomb guard)


class Modality(enum.IntEnum):
    """What each token of a packed row is: the ``modality_ids`` of the loader, the processor and the model, and the
    keys of every per-modality R (``r_by_modality``; ``"0"`` / ``"1"`` once written to JSON)."""

    TEXT = 0
    IMAGE = 1


class SkipSample(Exception):
    """A sample that cannot be used; ``kind`` is one of SKIP_KINDS."""

    def __init__(self, kind: str, message: str):
        assert kind in SKIP_KINDS, kind
        super().__init__(f"{kind}: {message}")
        self.kind = kind


@dataclass
class Segment:
    text: str | None = None  # exactly one of text / image
    image: bytes | None = None  # encoded image file bytes (stored byte-exact in the shard)
    image_ext: str = "png"


@dataclass
class Sample:
    key: str
    segments: list[Segment]
    meta: dict = field(default_factory=dict)
    qa: list[dict] = field(default_factory=list)

    @property
    def num_images(self) -> int:
        return sum(s.image is not None for s in self.segments)


SampleSchema = Sample  # alias: the schema's in-memory form, exported under this name by ``data_pipelines``


def image_bytes(img: Image.Image, ext: str = "png") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format={"jpg": "JPEG", "jpeg": "JPEG"}.get(ext, ext.upper()))
    return buf.getvalue()


def encode_sample(sample: Sample) -> dict:
    """A dict for ``webdataset.ShardWriter.write``: ``__key__``, ``json`` and one entry per image."""
    segments, members = [], {}
    for seg in sample.segments:
        if seg.image is not None:
            name = f"img{len(members)}.{seg.image_ext}"
            members[name] = seg.image
            segments.append({"image": name})
        else:
            segments.append({"text": seg.text})
    doc = {"segments": segments, "meta": sample.meta}
    if sample.qa:
        doc["qa"] = sample.qa
    return {"__key__": sample.key, "json": json.dumps(doc, ensure_ascii=False).encode(), **members}


def open_image(data: bytes, max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """Decode image bytes to a loaded PIL image, or raise SkipSample (bad_image / image_too_large)."""
    if not data:
        raise SkipSample("bad_image", "zero-byte image")
    try:
        img = Image.open(io.BytesIO(data))
        if img.width * img.height > max_pixels:
            raise SkipSample("image_too_large", f"{img.width}x{img.height} > {max_pixels} pixels")
        img.load()
    except SkipSample:
        raise
    except Exception as err:  # PIL raises many kinds (UnidentifiedImageError, OSError, DecompressionBomb...)
        raise SkipSample("bad_image", f"{type(err).__name__}: {err}") from None
    return img


def decode_sample(raw: dict) -> Sample:
    """Tar members of one key (as webdataset groups them: ``{"__key__": ..., "json": bytes, ...}``) -> Sample."""
    key = raw.get("__key__", "?")
    if "json" in raw and any(ext in raw for ext in IMAGE_EXTS):  # img2dataset: image + caption + metadata
        return _img2dataset(raw, key)
    if "json" in raw:
        try:
            doc = json.loads(raw["json"])
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise SkipSample("bad_json", f"{key}: {err}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("segments"), list):
            raise SkipSample("missing_field", f"{key}: no 'segments' list")
        segments = []
        for seg in doc["segments"]:
            if isinstance(seg, dict) and isinstance(seg.get("text"), str):
                segments.append(Segment(text=seg["text"]))
            elif isinstance(seg, dict) and isinstance(seg.get("image"), str):
                name = seg["image"]
                if name not in raw:
                    raise SkipSample("missing_field", f"{key}: image member {name!r} not in the shard")
                segments.append(Segment(image=raw[name], image_ext=name.rsplit(".", 1)[-1]))
            else:
                raise SkipSample("missing_field", f"{key}: a segment is neither text nor image: {seg!r:.60}")
        return Sample(key=key, segments=segments, meta=doc.get("meta") or {}, qa=doc.get("qa") or [])
    if any(ext in raw for ext in IMAGE_EXTS):
        return _img2dataset(raw, key)
    if "txt" in raw:
        return Sample(key=key, segments=[Segment(text=_text(raw["txt"], key))])
    raise SkipSample("missing_field", f"{key}: no json, image or txt member (has {sorted(raw)})")


def _text(data: bytes, key: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SkipSample("missing_field", f"{key}: txt is not UTF-8: {err}") from None


def _img2dataset(raw: dict, key: str) -> Sample:
    ext = next(e for e in IMAGE_EXTS if e in raw)
    if "txt" not in raw:
        raise SkipSample("missing_field", f"{key}: image without a .txt caption")
    meta = {}
    if "json" in raw:
        try:
            meta = json.loads(raw["json"])
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise SkipSample("bad_json", f"{key}: {err}") from None
    segments = [Segment(image=raw[ext], image_ext=ext), Segment(text=_text(raw["txt"], key))]
    return Sample(key=key, segments=segments, meta=meta if isinstance(meta, dict) else {})
