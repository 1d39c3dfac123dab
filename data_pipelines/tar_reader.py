"""Shard lists and tar reading for the loader: paths / braces / globs / folders, and tar members grouped by key.

Reading is webdataset's format and key convention (``base_plus_ext``: ``a.b.img0.png`` -> key ``a``, member
``b.img0.png``), with stricter fault detection than ``webdataset.tarfile_to_samples``: that one stops silently on
a corrupt header, and lets the half-read sample of a cut shard leak into the next shard's first sample. A sample
whose members are not adjacent, or that holds a member over ``MAX_MEMBER_BYTES``, comes as one marked group (one
skip), never as parts or as the inflated bytes of a compressed bomb.
"""

from __future__ import annotations

import glob
import os
import re
import tarfile
from collections.abc import Iterator, Sequence

import webdataset as wds
from webdataset.tariterators import base_plus_ext

from data_pipelines.schema import SkipSample

_META = re.compile(r"__[^/]*__($|/)")
MAX_MEMBER_BYTES = 256 * 2**20  # a sample with a bigger member (decompressed) is skipped: member_too_large
SKIP = "__skip__"  # a group's mark: (skip kind, message) for a sample the reader could not read


class TruncatedTar(Exception):
    pass


def expand_shards(shards: str | os.PathLike | Sequence) -> list[str]:
    """Paths, brace patterns (``shard-{000..009}.tar``), globs and folders (every ``*.tar`` below) -> paths."""
    out: list[str] = []
    for pattern in [shards] if isinstance(shards, str | os.PathLike) else list(shards):
        for path in wds.shardlists.expand_urls(os.fspath(pattern)):
            if os.path.isdir(path):
                found = sorted(glob.glob(os.path.join(path, "**", "*.tar"), recursive=True))
            elif glob.has_magic(path):
                found = sorted(glob.glob(path, recursive=True))
            else:
                found = [path] if os.path.exists(path) else []
            if not found:
                raise FileNotFoundError(f"no shard matches {os.fspath(pattern)!r}")
            out += found
    if not out:
        raise ValueError("no shards given")
    return list(dict.fromkeys(out))


def _member_key(info: tarfile.TarInfo) -> tuple[str, str] | None:
    """(key, member suffix) of a sample's data member; None for what the reader ignores (folders, links, webdataset's
    ``__meta__`` names, names without a key, suffixes webdataset reserves: ``__key__``, ...)."""
    prefix, suffix = base_plus_ext(info.name)
    if not info.isreg() or prefix is None or _META.match(info.name) or suffix.startswith("__"):
        return None
    return prefix, suffix.lower()


def non_adjacent_keys(path: str) -> set[str]:
    """Keys whose members are not all adjacent in the tar. Reads the headers only (member data is skipped: seeks
    in a plain tar, streamed decompression in a compressed one); on a read error, those found before it."""
    seen: set[str] = set()
    found: set[str] = set()
    last = None
    try:
        with tarfile.open(path, "r:*") as tar:
            for info in tar:
                member = _member_key(info)
                if member is None or member[0] == last:
                    continue
                last = member[0]
                if last in seen:
                    found.add(last)
                seen.add(last)
    except (tarfile.TarError, OSError, EOFError):
        pass  # read_tar_groups reports the fault
    return found


def skip_marked(group: dict) -> None:
    """Raise SkipSample when the reader marked ``group`` as unusable (non_adjacent_key, member_too_large)."""
    if SKIP in group:
        raise SkipSample(*group[SKIP])


def _marked(key: str, path: str, kind: str, message: str) -> dict:
    return {"__key__": key, "__url__": path, SKIP: (kind, f"{key}: {message}")}


def read_tar_groups(path: str, max_member_bytes: int = MAX_MEMBER_BYTES) -> Iterator[dict]:
    """Members of one tar grouped by key (webdataset's ``base_plus_ext``), as ``{"__key__", ext: bytes, ...}``.

    A sample that cannot be read comes as one group without members, marked ``__skip__: (kind, message)``
    (:func:`skip_marked` raises it): ``non_adjacent_key`` when its key's members are not adjacent in the tar (found
    by a headers-only first pass; the key's later members are dropped), ``member_too_large`` when a member holds
    more than ``max_member_bytes`` (its size from the tar header; nothing of it is read).

    Raises TruncatedTar after the last complete group when the file cannot be opened or the archive is cut or
    corrupt (tarfile stops silently on a bad header, so a plain ``.tar`` must also end with a zero block); the
    group being read at that point is dropped.
    """
    if max_member_bytes < 1:
        raise ValueError(f"max_member_bytes must be >= 1, got {max_member_bytes!r}")
    scattered = non_adjacent_keys(path)
    group, last, seen = None, None, set()
    try:
        with open(path, "rb") as f:
            with tarfile.open(fileobj=f, mode="r|*") as tar:
                for info in tar:
                    last = info
                    member = _member_key(info)
                    if member is None:
                        continue
                    key, suffix = member
                    if group is not None and group["__key__"] != key:  # complete: the next key has begun
                        yield group
                        group = None
                    if group is None:
                        if key in seen and key in scattered:  # a later run of a key already skipped
                            continue
                        group = {"__key__": key, "__url__": path}
                        if key in seen or key in scattered:
                            group = _marked(key, path, "non_adjacent_key", "its members are not adjacent in the tar")
                        seen.add(key)
                    if SKIP in group:
                        continue
                    if info.size > max_member_bytes:  # the header's size: the member's decompressed bytes
                        message = f"member {suffix!r} holds {info.size:,} bytes > max_member_bytes={max_member_bytes:,}"
                        group = _marked(key, path, "member_too_large", message)
                        continue
                    group[suffix] = tar.extractfile(info).read(max_member_bytes)  # bounded, whatever the header says
            if path.endswith(".tar"):
                end = 0 if last is None else last.offset_data + -(-last.size // 512) * 512
                f.seek(end)
                block = f.read(512)
                if len(block) < 512 or any(block):
                    raise tarfile.ReadError(f"no end-of-archive block after byte {end}")
    except (tarfile.TarError, OSError, EOFError) as err:
        raise TruncatedTar(f"{path}: {type(err).__name__}: {err}") from None
    if group is not None:
        yield group
