"""Local data sources -> :class:`~data_pipelines.schema.Sample` streams for :mod:`data_pipelines.writer`.

- :func:`from_jsonl`: one interleaved document per line,
  ``{"key"?: str, "segments": [{"text": str} | {"image": path}], "meta"?: {}, "qa"?: []}``, image paths relative
  to the JSONL file;
- :func:`from_dir`: a folder holding ``*.jsonl`` files (each read with :func:`from_jsonl`), else an img2dataset
  ``files`` folder read as is: ``<key>.jpg|jpeg|png|webp`` + ``<key>.txt`` caption [+ ``<key>.json`` metadata], at
  any depth, becoming ``[image, caption]`` with the JSON as ``meta`` (the schema's img2dataset reading);
- :func:`from_text`: plain-text files; by default each file is one sample (documents stay whole for language
  modelling), with ``unit="paragraph"`` each blank-line separated block is one.

The conversation readers (LLaVA instruction data, HF / OpenAI chat messages) are in
:mod:`data_pipelines.conversation_sources`, on the same :class:`SourceStats`.

Image bytes are copied byte-exact (only their header is checked, with PIL); texts are kept exactly as read.
Bad entries (unreadable line, missing / undecodable image, missing caption, non-UTF-8 text, duplicate key, ...)
are skipped, counted by kind in a :class:`SourceStats` and logged — never a crash. Keys are made webdataset-safe
(letters, digits, ``_``, ``-``): the given key or the file's relative path, other characters become ``_``; a key
that this makes equal to an earlier one gets ``-<8 hex digits of its hash>`` added (``a.b`` / ``a/b`` stay apart).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from data_pipelines.jsonl import read_json_lines
from data_pipelines.schema import IMAGE_EXTS, Sample, Segment

logger = logging.getLogger(__name__)

_LOGGED_PER_KIND = 5  # warnings per skip kind; further skips of that kind are logged at debug level


@dataclass
class SourceStats:
    """Samples a source yielded and entries it skipped, by kind."""

    read: int = 0
    skipped: Counter = field(default_factory=Counter)
    _seen: set = field(default_factory=set, repr=False)  # the source keys, before safe_key
    _owners: dict = field(default_factory=dict, repr=False)  # safe key -> the source key that has it

    def skip(self, kind: str, message: str) -> None:
        self.skipped[kind] += 1
        level = logging.WARNING if self.skipped[kind] <= _LOGGED_PER_KIND else logging.DEBUG
        logger.log(level, "skipped (%s): %s", kind, message)

    def accept(self, sample: Sample) -> bool:
        """Count ``sample`` unless its (source) key was already used (then skip it as duplicate_key), and make its
        key webdataset-safe and unique: :func:`safe_key`, plus ``-<hash>`` when another source key has that."""
        original = sample.key
        if original in self._seen:
            self.skip("duplicate_key", original)
            return False
        self._seen.add(original)
        key = safe_key(original)
        if self._owners.setdefault(key, original) != original:  # "a.b" after "a/b": both are "a_b"
            key = f"{key}-{hashlib.sha256(original.encode()).hexdigest()[:8]}"
            self._owners.setdefault(key, original)
        sample.key = key
        self.read += 1
        return True

    def as_dict(self) -> dict:
        return {"read": self.read, "skipped": dict(sorted(self.skipped.items()))}


def safe_key(name: str) -> str:
    """``name`` with every character other than letters, digits, ``_`` and ``-`` replaced by ``_``."""
    return re.sub(r"[^A-Za-z0-9_\-]", "_", name) or "_"


def image_segment(path: Path, stats: SourceStats, where: str) -> Segment | None:
    """The file's bytes as an image segment, or None (counted) when missing, not an image, or of another format."""
    try:
        data = path.read_bytes()
    except OSError as err:
        stats.skip("missing_image", f"{where}: {err}")
        return None
    try:
        fmt = Image.open(io.BytesIO(data)).format  # header only: cheap, catches empty and non-image files
    except Exception as err:  # PIL raises UnidentifiedImageError, OSError, ...
        stats.skip("bad_image", f"{where}: {path}: {type(err).__name__}: {err}")
        return None
    ext = {"JPEG": "jpg", "MPO": "jpg", "PNG": "png", "WEBP": "webp"}.get(fmt)  # MPO: camera JPEGs
    if ext is None:
        stats.skip("bad_image", f"{where}: {path}: format {fmt} is not one of {IMAGE_EXTS}")
        return None
    return Segment(image=data, image_ext=ext)


def _document(doc, base: Path, key: str, stats: SourceStats, where: str) -> Sample | None:
    if not isinstance(doc, dict) or not isinstance(doc.get("segments"), list) or not doc["segments"]:
        stats.skip("missing_field", f"{where}: no non-empty 'segments' list")
        return None
    segments = []
    for seg in doc["segments"]:
        if isinstance(seg, dict) and isinstance(seg.get("text"), str) and "image" not in seg:
            segments.append(Segment(text=seg["text"]))
        elif isinstance(seg, dict) and isinstance(seg.get("image"), str) and "text" not in seg:
            image = image_segment(base / seg["image"], stats, where)
            if image is None:
                return None
            segments.append(image)
        else:
            stats.skip("missing_field", f"{where}: a segment is neither text nor image: {seg!r:.80}")
            return None
    meta, qa = doc.get("meta") or {}, doc.get("qa") or []
    if not isinstance(meta, dict) or not isinstance(qa, list):
        stats.skip("missing_field", f"{where}: 'meta' must be an object and 'qa' a list")
        return None
    if isinstance(doc.get("key"), str) and doc["key"]:
        key = doc["key"]  # made safe by SourceStats.accept
    return Sample(key=key, segments=segments, meta=meta, qa=qa)


def from_jsonl(path: str | os.PathLike, stats: SourceStats | None = None) -> Iterator[Sample]:
    """Interleaved documents of a JSONL file (see the module docstring); lines without a key get the key
    ``<file stem>_<line number>``."""
    stats = stats if stats is not None else SourceStats()
    path = Path(path)
    try:
        handle = open(path, "rb")
    except OSError as err:
        stats.skip("missing_file", str(err))
        return
    with handle:  # a JSON value that is no object is a document without segments (missing_field), as in shards
        bad = lambda lineno, why: stats.skip("bad_json", f"{path}:{lineno}: {why}")
        for lineno, doc in read_json_lines(handle, bad, objects_only=False):
            key = f"{path.stem}_{lineno:07d}"
            sample = _document(doc, path.parent, key, stats, f"{path}:{lineno}")
            if sample is not None and stats.accept(sample):
                yield sample


def _read_text(path: Path, stats: SourceStats) -> str | None:
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as err:
        stats.skip("missing_file", str(err))
    except UnicodeDecodeError as err:
        stats.skip("bad_text", f"{path}: not UTF-8: {err}")
    return None


def _pair(root: Path, stem: Path, files: dict[str, Path], stats: SourceStats) -> Sample | None:
    where = str(stem.relative_to(root))
    image_ext = next((e for e in IMAGE_EXTS if e in files), None)
    if image_ext is None:
        if set(files) != {"json"} or not stem.name.endswith("_stats"):  # img2dataset's <shard>_stats.json
            stats.skip("missing_image", f"{where}: {sorted(files)} without an image")
        return None
    if "txt" not in files:
        stats.skip("missing_caption", f"{where}: image without a .txt caption")
        return None
    image = image_segment(files[image_ext], stats, where)
    caption = _read_text(files["txt"], stats) if image is not None else None
    if caption is None:
        return None
    meta = {}
    if "json" in files:
        try:
            meta = json.loads(files["json"].read_bytes())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            stats.skip("bad_json", f"{where}.json: {err}")
            return None
        if not isinstance(meta, dict):
            stats.skip("bad_json", f"{where}.json: not a JSON object")
            return None
    return Sample(key=where, segments=[image, Segment(text=caption)], meta=meta)


def _pairs(root: Path, stats: SourceStats) -> Iterator[Sample]:
    """Image / caption pairs, one folder at a time (img2dataset folders hold millions of files in total)."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        groups: dict[str, dict[str, Path]] = {}
        for name in filenames:
            stem, dot, ext = name.rpartition(".")
            if dot and ext.lower() in (*IMAGE_EXTS, "txt", "json"):
                groups.setdefault(stem, {})[ext.lower()] = Path(dirpath, name)
        for stem in sorted(groups):
            sample = _pair(root, Path(dirpath, stem), groups[stem], stats)
            if sample is not None and stats.accept(sample):
                yield sample


def from_dir(path: str | os.PathLike, stats: SourceStats | None = None) -> Iterator[Sample]:
    """The ``*.jsonl`` files at the folder's top level (in name order) when it has any, else an
    img2dataset-style folder of image / caption pairs at any depth (keys: the relative path of the stem)."""
    stats = stats if stats is not None else SourceStats()
    root = Path(path)
    if not root.is_dir():
        stats.skip("missing_file", f"{root} is not a directory")
        return
    jsonl = sorted(root.glob("*.jsonl"))
    if jsonl:
        for file in jsonl:
            yield from from_jsonl(file, stats)
    else:
        yield from _pairs(root, stats)


def from_text(
    files: Iterable[str | os.PathLike], stats: SourceStats | None = None, unit: str = "file"
) -> Iterator[Sample]:
    """Plain-text (UTF-8) files as text samples: one per file, kept exactly (``unit="file"``, the default), or
    one per blank-line separated block, stripped (``unit="paragraph"``). Keys: ``<file number>_<stem>``
    [``_<block number>``], so files of the same name in different folders stay apart. Files that are empty or
    only whitespace are skipped and counted as ``empty``."""
    if unit not in ("file", "paragraph"):
        raise ValueError(f"unit must be 'file' or 'paragraph', got {unit!r}")
    stats = stats if stats is not None else SourceStats()
    for i, file in enumerate(files):
        path = Path(file)
        text = _read_text(path, stats)
        if text is None:
            continue
        if not text.strip():
            stats.skip("empty", str(path))
            continue
        blocks = [text] if unit == "file" else [b.strip() for b in re.split(r"\n\s*\n", text) if b.strip()]
        for j, block in enumerate(blocks):
            key = f"{i:06d}_{path.stem}" + (f"_{j:06d}" if unit == "paragraph" else "")
            sample = Sample(key=key, segments=[Segment(text=block)], meta={"source": path.name})
            if stats.accept(sample):
                yield sample
