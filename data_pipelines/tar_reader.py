"""Shard lists and tar reading for the loader: paths / braces / globs / folders, and tar members grouped by key.

Reading is webdataset's format and key convention (``base_plus_ext``: ``a.b.img0.png`` -> key ``a``, member
``b.img0.png``), with stricter fault detection than ``webdataset.tarfile_to_samples``: that one stops silently on
a corrupt header, and lets the half-read sample of a cut shard leak into the next shard's first sample.
"""

from __future__ import annotations

import glob
import os
import re
import tarfile
from collections.abc import Iterator, Sequence

import webdataset as wds
from webdataset.tariterators import base_plus_ext

_META = re.compile(r"__[^/]*__($|/)")


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


def read_tar_groups(path: str) -> Iterator[dict]:
    """Members of one tar grouped by key (webdataset's ``base_plus_ext``), as ``{"__key__", ext: bytes, ...}``.

    Raises TruncatedTar after the last complete group when the file cannot be opened or the archive is cut or
    corrupt (tarfile stops silently on a bad header, so a plain ``.tar`` must also end with a zero block); the
    group being read at that point is dropped.
    """
    group, last = None, None
    try:
        with open(path, "rb") as f:
            with tarfile.open(fileobj=f, mode="r|*") as tar:
                for info in tar:
                    last = info
                    prefix, suffix = base_plus_ext(info.name)
                    if not info.isreg() or prefix is None or _META.match(info.name):
                        continue
                    if group is not None and group["__key__"] != prefix:  # complete: the next key has begun
                        yield group
                        group = None
                    group = group or {"__key__": prefix, "__url__": path}
                    group[suffix.lower()] = tar.extractfile(info).read()
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
