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
SKIP_KINDS = (
    "truncated_tar",
    "bad_image",
    "bad_json",
    "image_too_large",
    "too_long",
    "missing_field",
    # conversations (``check_conversation``)
    "unknown_role",
    "bad_turn_order",
    "image_count_mismatch",
    "missing_image",
    "empty_answer",
    # tar reading (``tar_reader.read_tar_groups``)
    "non_adjacent_key",
    "member_too_large",
)
ROLES = ("system", "user", "assistant")
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
class Turn:
    """One turn of a conversation: who speaks (``ROLES``) and what, text and images in order."""

    role: str
    segments: list[Segment]


@dataclass
class Sample:
    """A caption / interleaved document / plain text (``segments``), or a conversation (``turns``; ``segments``
    then empty)."""

    key: str
    segments: list[Segment]
    meta: dict = field(default_factory=dict)
    qa: list[dict] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)

    @property
    def is_conversation(self) -> bool:
        return bool(self.turns)

    @property
    def all_segments(self) -> list[Segment]:
        """Every segment in order: the turns' for a conversation."""
        return [seg for turn in self.turns for seg in turn.segments] if self.turns else list(self.segments)

    @property
    def num_images(self) -> int:
        return sum(s.image is not None for s in self.all_segments)


def check_conversation(turns: list[Turn], key: str = "?") -> None:
    """Raise :class:`SkipSample` unless ``turns`` is a usable conversation: roles from ``ROLES``; an optional
    ``system`` turn first, then ``user`` and ``assistant`` alternating, starting with ``user`` and ending with
    ``assistant``; no empty assistant turn."""
    if not turns:
        raise SkipSample("bad_turn_order", f"{key}: a conversation without turns")
    for turn in turns:
        if turn.role not in ROLES:
            raise SkipSample("unknown_role", f"{key}: role {turn.role!r} is not one of {ROLES}")
    roles = [t.role for t in turns]
    body = roles[1:] if roles[0] == "system" else roles
    expected = ["user", "assistant"] * (len(body) // 2)
    if not body or body != expected or len(body) % 2:
        raise SkipSample("bad_turn_order", f"{key}: turns {roles} do not alternate user / assistant ending with one")
    for turn in turns:
        if turn.role == "assistant" and not any(s.image is not None or (s.text or "").strip() for s in turn.segments):
            raise SkipSample("empty_answer", f"{key}: an assistant turn is empty")


SampleSchema = Sample  # alias: the schema's in-memory form, exported under this name by ``data_pipelines``


def image_bytes(img: Image.Image, ext: str = "png") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format={"jpg": "JPEG", "jpeg": "JPEG"}.get(ext, ext.upper()))
    return buf.getvalue()


def encode_sample(sample: Sample) -> dict:
    """A dict for ``webdataset.ShardWriter.write``: ``__key__``, ``json`` and one entry per image."""
    members = {}

    def entries(segs: list[Segment]) -> list[dict]:
        out = []
        for seg in segs:
            if seg.image is not None:
                name = f"img{len(members)}.{seg.image_ext}"
                members[name] = seg.image
                out.append({"image": name})
            else:
                out.append({"text": seg.text})
        return out

    doc = {"segments": entries(sample.segments), "meta": sample.meta}
    if sample.turns:
        doc["turns"] = [{"role": t.role, "segments": entries(t.segments)} for t in sample.turns]
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
        if not isinstance(doc, dict) or not isinstance(doc.get("segments", []), list):
            raise SkipSample("missing_field", f"{key}: 'segments' is not a list")
        if "segments" not in doc and "turns" not in doc:
            raise SkipSample("missing_field", f"{key}: no 'segments' or 'turns' list")
        segments = _segments(doc.get("segments", []), raw, key)
        turns = _turns(doc["turns"], raw, key) if "turns" in doc else []
        return Sample(key=key, segments=segments, meta=doc.get("meta") or {}, qa=doc.get("qa") or [], turns=turns)
    if any(ext in raw for ext in IMAGE_EXTS):
        return _img2dataset(raw, key)
    if "txt" in raw:
        return Sample(key=key, segments=[Segment(text=_text(raw["txt"], key))])
    raise SkipSample("missing_field", f"{key}: no json, image or txt member (has {sorted(raw)})")


def _segments(entries, raw: dict, key: str) -> list[Segment]:
    segments = []
    for seg in entries:
        if isinstance(seg, dict) and isinstance(seg.get("text"), str):
            segments.append(Segment(text=seg["text"]))
        elif isinstance(seg, dict) and isinstance(seg.get("image"), str):
            name = seg["image"]
            if name not in raw:
                raise SkipSample("missing_image", f"{key}: image member {name!r} not in the shard")
            segments.append(Segment(image=raw[name], image_ext=name.rsplit(".", 1)[-1]))
        else:
            raise SkipSample("missing_field", f"{key}: a segment is neither text nor image: {seg!r:.60}")
    return segments


def _turns(entries, raw: dict, key: str) -> list[Turn]:
    if not isinstance(entries, list) or not all(isinstance(t, dict) for t in entries):
        raise SkipSample("missing_field", f"{key}: 'turns' is not a list of objects")
    turns = []
    for t in entries:
        if not isinstance(t.get("segments"), list):
            raise SkipSample("missing_field", f"{key}: a turn has no 'segments' list")
        turns.append(Turn(role=str(t.get("role")), segments=_segments(t["segments"], raw, key)))
    check_conversation(turns, key)
    return turns


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


def sample_regions(meta: dict) -> list[tuple[list[float], str]]:
    """A sample's boxed phrases, ``[(box, text)]`` with ``box`` ``[x0, y0, x1, y1]`` normalised to 0-1: the
    grounded-caption field ``meta["regions"]`` (``[{"box": [...], "text": "red square"}]``, as region-described
    datasets give them: Visual Genome regions, RefCOCO, GRIT's noun phrases), else the objects of this toolkit's
    scenes (``meta["objects"]``: box, size, colour, shape and position words). Regions without a 4-number box or
    text are left out."""
    if "regions" in meta:
        items = [(r.get("box"), r.get("text")) for r in meta["regions"] if isinstance(r, dict)]
    else:
        keys = ("size", "colour", "shape", "position")
        items = [(o.get("box"), " ".join(str(o[k]) for k in keys if k in o)) for o in meta.get("objects", [])]
    ok = lambda box: isinstance(box, list | tuple) and len(box) == 4 and all(isinstance(v, int | float) for v in box)
    return [([float(v) for v in box], text) for box, text in items if ok(box) and isinstance(text, str) and text]
