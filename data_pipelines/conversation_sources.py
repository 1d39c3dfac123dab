"""Conversation sources -> :class:`~data_pipelines.schema.Sample` streams with ``turns``, for the writer.

- :func:`from_llava`: LLaVA's instruction data, ``{"id", "image": path | [paths], "conversations": [{"from",
  "value": "...<image>..."}]}``; ``from`` is ``human`` / ``user`` (a user turn), ``gpt`` / ``assistant`` / ``model``
  (an assistant turn) or ``system`` (the schema's system turn, first only);
- :func:`from_messages`: chat messages in the HF / OpenAI shape, ``{"messages": [{"role", "content": str |
  [{"type": "text", "text"} | {"type": "image"[, "image": path]}]}], "images"?: [paths]}``.

Both take a JSON list or JSONL (told apart by the file's first character) and check every conversation with
:func:`~data_pipelines.schema.check_conversation`, as decoding a shard does. Image paths are relative to
``image_root`` (default: the file's folder) and must stay inside it once resolved (``os.path.realpath``: ``..``,
an absolute path, a symlink that points out): a data file then reads no image from elsewhere on the machine. An
entry with such a path is skipped as ``outside_image_root`` unless ``allow_outside_image_root=True``
(``make_shards --allow-outside-image-root``). Bad entries are skipped and counted by kind in a
:class:`~data_pipelines.sources.SourceStats`, as the other sources do.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from data_pipelines.jsonl import bad_json_reason, read_json_lines
from data_pipelines.schema import Sample, Segment, SkipSample, Turn, check_conversation
from data_pipelines.sources import SourceStats, image_segment

LLAVA_IMAGE = "<image>"  # where an image goes in a LLaVA turn's text
# LLaVA's speakers (``from``) -> the schema's roles: ShareGPT's human / gpt, and the chat names some exports use.
LLAVA_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}
OUTSIDE_IMAGE_ROOT = "outside_image_root"  # the skip kind of an image path that resolves outside the image root


@dataclass
class ImageRoot:
    """The folder a file's image paths are relative to; :meth:`locate` refuses a path that resolves outside it."""

    path: Path
    allow_outside: bool = False
    real: str = field(init=False)

    def __post_init__(self):
        self.real = os.path.realpath(self.path)

    def locate(self, name: str) -> Path | None:
        """``name`` resolved against the root (``..`` and symlinks followed), or None when that leaves the root
        and ``allow_outside`` is off. The resolved path is what gets read, so a link changed later is not
        followed."""
        real = os.path.realpath(self.path / name)  # an absolute name replaces the root here, then is checked
        if not self.allow_outside and os.path.commonpath([self.real, real]) != self.real:
            return None
        return Path(real)


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
    raw: _RawTurns, images: list[str], root: ImageRoot, entry: dict, stem: str, number: int, stats: SourceStats, where
) -> Sample | None:
    """Check and read one conversation: :func:`check_conversation` (unknown_role, bad_turn_order, empty_answer),
    as many image parts without a path as ``images`` (else image_count_mismatch), then the image files
    (outside_image_root, missing_image, bad_image). Key: the entry's ``id`` (kept in ``meta``) when it is a
    non-empty string or an integer, else ``<file stem>_<number>``."""
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
    queue = iter(images)  # in reading order, the parts without a path take the entry's images
    refs = [part for _, parts in raw for part in parts if isinstance(part, _ImageRef)]
    names = [ref.path if ref.path is not None else next(queue) for ref in refs]
    if any("\0" in name for name in names):  # no file has such a name (and os.path refuses it)
        stats.skip("missing_field", f"{where}: an image path holds a NUL character")
        return None
    files = [root.locate(name) for name in names]
    if None in files:  # before any file is read
        name = names[files.index(None)]
        stats.skip(OUTSIDE_IMAGE_ROOT, f"{where}: image {name!r} resolves outside the image root {root.path}")
        return None
    files.reverse()
    turns = []
    for role, parts in raw:
        segments = []
        for part in parts:
            if isinstance(part, str):
                segments.append(Segment(text=part))
                continue
            image = image_segment(files.pop(), stats, where)
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


def _llava(entry, root: ImageRoot, stem: str, number: int, stats: SourceStats, where: str) -> Sample | None:
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


def _messages(entry, root: ImageRoot, stem: str, number: int, stats: SourceStats, where: str) -> Sample | None:
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
    parse, path: str | os.PathLike, image_root: str | os.PathLike | None, stats: SourceStats | None, allow: bool
) -> Iterator[Sample]:
    stats = stats if stats is not None else SourceStats()
    path = Path(path)
    root = ImageRoot(Path(image_root) if image_root is not None else path.parent, allow_outside=allow)
    for number, where, entry in _json_entries(path, stats):
        sample = parse(entry, root, path.stem, number, stats, where)
        if sample is not None and stats.accept(sample):
            yield sample


def from_llava(
    path: str | os.PathLike,
    image_root: str | os.PathLike | None = None,
    stats: SourceStats | None = None,
    allow_outside_image_root: bool = False,
) -> Iterator[Sample]:
    """LLaVA's instruction data (a JSON list, or JSONL) as conversations: each speaker becomes its role
    (``LLAVA_ROLES``), any other is skipped (unknown_role). Each ``<image>`` in a turn's text is where the next of
    the entry's images goes (the marker is dropped, the text around it kept exactly); an entry with images and no
    marker gets them at the start of its first user turn, as LLaVA does; an entry without ``image`` is a text-only
    conversation. Image paths: see the module docstring."""
    yield from _conversations(_llava, path, image_root, stats, allow_outside_image_root)


def from_messages(
    path: str | os.PathLike,
    image_root: str | os.PathLike | None = None,
    stats: SourceStats | None = None,
    allow_outside_image_root: bool = False,
) -> Iterator[Sample]:
    """Chat messages (JSONL, or a JSON list) in the HF / OpenAI shape as conversations: ``content`` a string or a
    list of ``{"type": "text", "text": ...}`` / ``{"type": "image"}`` parts; an image part names its file
    (``"image": path``) or takes the next entry of the entry's ``images`` list. Roles must be ``system`` / ``user`` /
    ``assistant`` (else unknown_role). Image paths: see the module docstring."""
    yield from _conversations(_messages, path, image_root, stats, allow_outside_image_root)
