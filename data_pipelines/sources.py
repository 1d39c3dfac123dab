"""Local data sources -> :class:`~data_pipelines.schema.Sample` streams for :mod:`data_pipelines.writer`.

- :func:`from_jsonl`: one interleaved document per line,
  ``{"key"?: str, "segments": [{"text": str} | {"image": path}], "meta"?: {}, "qa"?: []}``, image paths relative
  to the JSONL file;
- :func:`from_dir`: a folder holding ``*.jsonl`` files (each read with :func:`from_jsonl`), else an img2dataset
  ``files`` folder read as is: ``<key>.jpg|jpeg|png|webp`` + ``<key>.txt`` caption [+ ``<key>.json`` metadata], at
  any depth, becoming ``[image, caption]`` with the JSON as ``meta`` (the schema's img2dataset reading);
- :func:`from_text`: plain-text files; by default each file is one sample (documents stay whole for language
  modelling), with ``unit="paragraph"`` each blank-line separated block is one;
- :func:`from_llava`: LLaVA's instruction data, ``{"id", "image": path | [paths], "conversations": [{"from":
  "human" | "gpt" | "system", "value": "...<image>..."}]}``, as conversations (``Sample.turns``);
- :func:`from_messages`: chat messages in the HF / OpenAI shape, ``{"messages": [{"role", "content": str |
  [{"type": "text", "text"} | {"type": "image"[, "image": path]}]}], "images"?: [paths]}``, as conversations.

Both conversation readers take a JSON list or JSONL (told apart by the file's first character), image paths
relative to ``image_root`` (default: the file's folder), and check every conversation with
:func:`~data_pipelines.schema.check_conversation`, as decoding a shard does.

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

from data_pipelines.jsonl import bad_json_reason, read_json_lines
from data_pipelines.schema import IMAGE_EXTS, Sample, Segment, SkipSample, Turn, check_conversation

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


def _image_segment(path: Path, stats: SourceStats, where: str) -> Segment | None:
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
            image = _image_segment(base / seg["image"], stats, where)
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
    image = _image_segment(files[image_ext], stats, where)
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


# --- conversations ---------------------------------------------------------------------------------------------

LLAVA_IMAGE = "<image>"  # where an image goes in a LLaVA turn's text
LLAVA_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


@dataclass
class _ImageRef:
    """An image part before its file is read: a path relative to the image root, or None for the next entry of the
    sample's image list."""

    path: str | None = None


_Part = str | _ImageRef
_RawTurns = list[tuple[str, list[_Part]]]  # (role, parts) of a conversation not yet checked or read


def _json_entries(path: Path, stats: SourceStats) -> Iterator[tuple[int, str, object]]:
    """``(number, where, value)`` for each entry of a JSON list file (numbered from 0) or a JSONL file (line
    numbers, from 1), told apart by the first character that is not blank: ``[`` is a JSON list. A JSON list that
    does not parse is one ``bad_json`` skip (nothing of it is read); in JSONL, each bad line is one."""
    try:
        handle = open(path, "rb")
    except OSError as err:
        stats.skip("missing_file", str(err))
        return
    with handle:
        head = b""
        while not head and (chunk := handle.read(4096)):
            head = chunk.lstrip(b"\xef\xbb\xbf \t\r\n")  # a UTF-8 byte-order mark or blanks before the first value
        handle.seek(0)
        if head.startswith(b"["):
            try:
                entries = json.loads(handle.read())
            except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
                stats.skip("bad_json", f"{path}: not a JSON list: {bad_json_reason(err)}")
                return
            for i, entry in enumerate(entries):
                yield i, f"{path}[{i}]", entry
        else:
            bad = lambda lineno, why: stats.skip("bad_json", f"{path}:{lineno}: {why}")
            for lineno, entry in read_json_lines(handle, bad, objects_only=False):
                yield lineno, f"{path}:{lineno}", entry


def _image_list(value, stats: SourceStats, where: str, field_name: str) -> list[str] | None:
    images = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(images, list) or not all(isinstance(p, str) and p for p in images):
        stats.skip("missing_field", f"{where}: {field_name!r} is neither an image path nor a list of them")
        return None
    return images


def _conversation(
    raw: _RawTurns, images: list[str], root: Path, entry: dict, stem: str, number: int, stats: SourceStats, where: str
) -> Sample | None:
    """Check and read one conversation: :func:`check_conversation` (unknown_role, bad_turn_order, empty_answer),
    as many image parts without a path as ``images`` (else image_count_mismatch), then the image files
    (missing_image, bad_image). Key: the entry's ``id`` (kept in ``meta``) when it is a non-empty string or an
    integer, else ``<file stem>_<number>``."""
    given = entry.get("id")
    has_id = (isinstance(given, str) and given != "") or (isinstance(given, int) and not isinstance(given, bool))
    key = str(given) if has_id else f"{stem}_{number:07d}"  # made safe by SourceStats.accept
    placeholder = lambda part: Segment(text=part) if isinstance(part, str) else Segment(image=b"")
    try:  # the cheap checks first, on placeholder images: no file is read for a conversation that is skipped
        check_conversation([Turn(role, [placeholder(p) for p in parts]) for role, parts in raw], key)
    except SkipSample as err:
        stats.skip(err.kind, f"{where}: {str(err).removeprefix(err.kind + ': ')}")
        return None
    unnamed = sum(isinstance(p, _ImageRef) and p.path is None for _, parts in raw for p in parts)
    if unnamed != len(images):
        stats.skip("image_count_mismatch", f"{where}: {unnamed} image markers / parts for {len(images)} images")
        return None
    queue = iter(images)
    turns = []
    for role, parts in raw:
        segments = []
        for part in parts:
            if isinstance(part, str):
                segments.append(Segment(text=part))
                continue
            image = _image_segment(root / (part.path if part.path is not None else next(queue)), stats, where)
            if image is None:
                return None
            segments.append(image)
        turns.append(Turn(role=role, segments=segments))
    return Sample(key=key, segments=[], meta={"id": given} if has_id else {}, turns=turns)


def _llava_turns(entry) -> tuple[_RawTurns, object] | str:
    """An entry's (turns, image value), or why it has none (missing_field)."""
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list) or not turns:
        return "no non-empty 'conversations' list"
    raw = []
    for turn in turns:
        if (
            not isinstance(turn, dict)
            or not isinstance(turn.get("from"), str)
            or not isinstance(turn.get("value"), str)
        ):
            return f"a turn is not a {{'from': str, 'value': str}} object: {turn!r:.80}"
        pieces = turn["value"].split(LLAVA_IMAGE)
        parts: list[_Part] = [pieces[0]] if pieces[0] else []
        for piece in pieces[1:]:  # each marker becomes an image part; the text around it is kept exactly
            parts += [_ImageRef(), piece] if piece else [_ImageRef()]
        raw.append((turn["from"], parts))
    return raw, entry.get("image")


def _llava(entry, root: Path, stem: str, number: int, stats: SourceStats, where: str) -> Sample | None:
    parsed = _llava_turns(entry)
    if isinstance(parsed, str):
        stats.skip("missing_field", f"{where}: {parsed}")
        return None
    raw, image_value = parsed
    images = _image_list(image_value, stats, where, "image")
    if images is None:
        return None
    for speaker, _ in raw:
        if speaker not in LLAVA_ROLES:
            stats.skip("unknown_role", f"{where}: 'from' {speaker!r} is not one of {sorted(LLAVA_ROLES)}")
            return None
    raw = [(LLAVA_ROLES[speaker], parts) for speaker, parts in raw]
    markers = any(isinstance(p, _ImageRef) for _, parts in raw for p in parts)
    first_user = next((parts for role, parts in raw if role == "user"), None)
    if images and not markers and first_user is not None:  # as LLaVA does: the images open the first user turn
        first_user[:0] = [_ImageRef() for _ in images]
    return _conversation(raw, images, root, entry, stem, number, stats, where)


def _content_parts(content) -> list[_Part] | None:
    """A message's content as parts (None: not a string, null or a list of text / image parts)."""
    if content is None or isinstance(content, str):
        return [content] if content else []
    if not isinstance(content, list):
        return None
    parts: list[_Part] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts += [part["text"]] if part["text"] else []
        elif kind == "image" and isinstance(part.get("image"), str | None):
            parts.append(_ImageRef(part.get("image") or None))  # no path: the next entry of "images"
        else:
            return None
    return parts


def _messages(entry, root: Path, stem: str, number: int, stats: SourceStats, where: str) -> Sample | None:
    messages = entry.get("messages") if isinstance(entry, dict) else None
    if not isinstance(messages, list) or not messages:
        stats.skip("missing_field", f"{where}: no non-empty 'messages' list")
        return None
    raw = []
    for message in messages:
        parts = _content_parts(message.get("content")) if isinstance(message, dict) else None
        if parts is None or not isinstance(message.get("role"), str):
            stats.skip("missing_field", f"{where}: a message is not a {{'role', 'content'}} object: {message!r:.80}")
            return None
        raw.append((message["role"], parts))  # roles are checked by check_conversation (unknown_role)
    images = _image_list(entry.get("images"), stats, where, "images")
    if images is None:
        return None
    return _conversation(raw, images, root, entry, stem, number, stats, where)


def _conversations(
    parse, path: str | os.PathLike, image_root: str | os.PathLike | None, stats: SourceStats | None
) -> Iterator[Sample]:
    stats = stats if stats is not None else SourceStats()
    path = Path(path)
    root = Path(image_root) if image_root is not None else path.parent
    for number, where, entry in _json_entries(path, stats):
        sample = parse(entry, root, path.stem, number, stats, where)
        if sample is not None and stats.accept(sample):
            yield sample


def from_llava(
    path: str | os.PathLike, image_root: str | os.PathLike | None = None, stats: SourceStats | None = None
) -> Iterator[Sample]:
    """LLaVA's instruction data (a JSON list, or JSONL) as conversations: ``human`` / ``gpt`` / ``system`` become
    ``user`` / ``assistant`` / ``system``, any other speaker is skipped (unknown_role). Each ``<image>`` in a
    turn's text is where the next of the entry's images goes (the marker is dropped, the text around it kept
    exactly); an entry with images and no marker gets them at the start of its first user turn, as LLaVA does; an
    entry without ``image`` is a text-only conversation. Image paths are relative to ``image_root`` (default: the
    file's folder)."""
    yield from _conversations(_llava, path, image_root, stats)


def from_messages(
    path: str | os.PathLike, image_root: str | os.PathLike | None = None, stats: SourceStats | None = None
) -> Iterator[Sample]:
    """Chat messages (JSONL, or a JSON list) in the HF / OpenAI shape as conversations: ``content`` a string or a
    list of ``{"type": "text", "text": ...}`` / ``{"type": "image"}`` parts; an image part names its file
    (``"image": path``) or takes the next entry of the entry's ``images`` list. Roles must be ``system`` / ``user`` /
    ``assistant`` (else unknown_role). Image paths are relative to ``image_root`` (default: the file's folder)."""
    yield from _conversations(_messages, path, image_root, stats)
