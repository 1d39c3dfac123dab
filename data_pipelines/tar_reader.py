"""Shard lists and tar reading for the loader: local paths / braces / globs / folders, ``file:`` paths, and URLs
(``pipe:CMD``, ``http(s)://``, ... : anything webdataset's ``gopen`` opens) read as streams; tar members grouped by key.

Reading is webdataset's format and key convention (``base_plus_ext``: ``a.b.img0.png`` -> key ``a``, member
``b.img0.png``), with stricter fault detection than ``webdataset.tarfile_to_samples``: that one stops silently on
a corrupt header, and lets the half-read sample of a cut shard leak into the next shard's first sample. A sample
whose members are not adjacent, or that holds a member over ``MAX_MEMBER_BYTES``, comes as one marked group (one
skip), never as parts or as the inflated bytes of a compressed bomb.

Streams. A URL spec is opened by ``webdataset.gopen.gopen`` (``pipe:`` runs the command with a shell; ``http(s)://``
runs ``curl -f``) and read once, front to back; the same strict end check applies (a stream cut mid-member or
between members is ``TruncatedTar``), and a command that exits with a failure status is ``TruncatedTar`` naming
the status, even when its output looked complete. A stream cannot be read twice, so the headers-only first pass that
finds non-adjacent keys in a local file is not made: the key's first run is read as a sample of its own and the
key's reappearance after other keys is the one ``non_adjacent_key`` skip (its later runs are dropped).
"""

from __future__ import annotations

import glob
import os
import re
import select
import signal
import subprocess
import tarfile
import time
from collections.abc import Generator, Iterator, Sequence
from urllib.parse import urlparse
from urllib.request import url2pathname

import webdataset as wds
from webdataset.gopen import Pipe, gopen, gopen_schemes
from webdataset.tariterators import base_plus_ext

from data_pipelines.schema import SkipSample

_META = re.compile(r"__[^/]*__($|/)")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
MAX_MEMBER_BYTES = 256 * 2**20  # a sample with a bigger member (decompressed) is skipped: member_too_large
SKIP = "__skip__"  # a group's mark: (skip kind, message) for a sample the reader could not read
URL_SCHEMES = tuple(sorted(s for s in gopen_schemes if s != "__default__"))  # streamed: pipe, http, https, gs, ...
DRAIN_BYTES = 2**20  # after the end-of-archive block, read at most this much of a command's output before closing
EXIT_WAIT_S = 5.0  # how long a command may take to exit once its output is closed; then it is killed
CURL_EXITS = {
    6: "could not resolve the host",
    7: "could not connect",
    18: "the transfer ended early",
    22: "HTTP error status >= 400",
    28: "timed out",
    56: "the connection broke",
}


class TruncatedTar(Exception):
    pass


def shard_scheme(spec: str) -> str | None:
    """``file``, a URL scheme ``gopen`` opens (``URL_SCHEMES``), or None for a plain local path."""
    match = _SCHEME.match(spec)
    scheme = match.group(1).lower() if match else None
    return scheme if scheme == "file" or scheme in URL_SCHEMES else None


def is_url(spec: str) -> bool:
    """Whether ``spec`` is read as a stream through ``gopen`` (not a local path nor a ``file:`` path)."""
    return shard_scheme(spec) not in (None, "file")


def _local_matches(path: str) -> list[str]:
    """A folder's ``*.tar`` (recursively), a glob's matches, or the path itself when it exists."""
    if os.path.isdir(path):
        return sorted(glob.glob(os.path.join(path, "**", "*.tar"), recursive=True))
    if glob.has_magic(path):
        return sorted(glob.glob(path, recursive=True))
    return [path] if os.path.exists(path) else []


def expand_shards(shards: str | os.PathLike | Sequence) -> list[str]:
    """Shard specs -> shard list. Brace patterns (``shard-{000..009}.tar``) are expanded everywhere, as webdataset
    does; local paths, globs and folders (every ``*.tar`` below) must match files; a ``file:PATH`` is the local
    PATH; URLs (``pipe:CMD``, ``http(s)://...``) are kept as they are, unchecked (globs and folders are local only)."""
    out: list[str] = []
    for pattern in [shards] if isinstance(shards, str | os.PathLike) else list(shards):
        try:
            specs = wds.shardlists.expand_urls(os.fspath(pattern))
        except AssertionError as err:  # webdataset's ${NAME} without a WDS_NAME environment variable
            raise ValueError(f"shard spec {os.fspath(pattern)!r}: {err}") from None
        for spec in specs:
            if is_url(spec):
                out.append(spec)
                continue
            found = _local_matches(url2pathname(urlparse(spec).path) if shard_scheme(spec) else spec)
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
    """Keys whose members are not all adjacent in the local tar ``path``. Reads the headers only (member data is
    skipped: seeks in a plain tar, streamed decompression in a compressed one); on a read error, those found before
    it."""
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


class _HeaderProbe(tarfile.TarInfo):
    """A TarInfo that leaves on its TarFile (``header_stop``) the header error that ended the member list: tarfile
    ends silently on a missing, cut or corrupt header; only ``EOFHeaderError`` (a zero block) is a proper end."""

    @classmethod
    def fromtarfile(cls, tar):
        tar.header_stop = None
        try:
            return super().fromtarfile(tar)
        except tarfile.HeaderError as err:
            tar.header_stop = err
            raise


def _start_group(key: str, spec: str, seen: set, scattered: set) -> dict | None:
    """The group a new run of ``key`` starts: plain, marked ``non_adjacent_key`` (a key in ``scattered``, or seen
    before: added to ``scattered``), or None for a later run of a key already marked (dropped)."""
    if key in seen and key in scattered:
        return None
    group = {"__key__": key, "__url__": spec}
    if key in seen or key in scattered:
        group = _marked(key, spec, "non_adjacent_key", "its members are not adjacent in the tar")
        scattered.add(key)
    seen.add(key)
    return group


def _groups(stream, spec: str, max_member_bytes: int, scattered: set) -> Generator[dict, None, dict | None]:
    """Yield the complete groups of the tar in ``stream``; return the last one once the archive has ended properly
    (raises ``tarfile.ReadError`` when it has not)."""
    group, seen = None, set()
    with tarfile.open(fileobj=stream, mode="r|*", tarinfo=_HeaderProbe) as tar:
        for info in tar:
            member = _member_key(info)
            if member is None:
                continue
            key, suffix = member
            if group is not None and group["__key__"] != key:  # complete: the next key has begun
                yield group
                group = None
            if group is None and (group := _start_group(key, spec, seen, scattered)) is None:
                continue
            if SKIP in group:
                continue
            if info.size > max_member_bytes:  # the header's size: the member's decompressed bytes
                message = f"member {suffix!r} holds {info.size:,} bytes > max_member_bytes={max_member_bytes:,}"
                group = _marked(key, spec, "member_too_large", message)
                continue
            group[suffix] = tar.extractfile(info).read(max_member_bytes)  # bounded, whatever the header says
        stop = getattr(tar, "header_stop", None)
        if not isinstance(stop, tarfile.EOFHeaderError):
            raise tarfile.ReadError(f"no end-of-archive block at byte {tar.offset} ({stop or 'no header'})")
    return group


def _exit_problem(pipe: Pipe, status: int) -> str:
    """What a failed command's exit status says (curl's common statuses named)."""
    command = pipe.args[0][0] if pipe.args[0] else "?"
    program = command[0] if isinstance(command, list | tuple) else "command"
    if status < 0:
        return f"{program} was killed by signal {-status}"
    meaning = CURL_EXITS.get(status) if program == "curl" else None
    return f"{program} exited with status {status}" + (f" ({meaning})" if meaning else "")


def _drain(pipe_file, limit: int, deadline: float) -> None:
    """Read and drop a command's remaining output until its end, ``limit`` bytes or ``deadline`` (monotonic)."""
    fd = pipe_file.fileno()
    while limit > 0 and (seconds := deadline - time.monotonic()) > 0:
        if not select.select([fd], [], [], seconds)[0]:
            return
        chunk = os.read(fd, min(limit, 2**16))
        if not chunk:
            return
        limit -= len(chunk)


def _finish(stream, outcome: str) -> str | None:
    """Close ``stream``; for a command (``Pipe``), what went wrong by its exit status, else None. ``outcome``: ``end``
    (the archive ended properly: the rest of the output is drained so the command ends by itself), ``error`` (reading
    failed: the command may still report why) or ``left`` (the reader stopped early: the command is stopped)."""
    if not isinstance(stream, Pipe):
        stream.close()
        return None
    deadline = time.monotonic() + (0 if outcome == "left" else EXIT_WAIT_S)
    try:
        if outcome == "end":
            _drain(stream.stream, DRAIN_BYTES, deadline)
        stream.stream.close()
    except (OSError, ValueError):
        pass
    proc = stream.proc
    try:
        status = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        stream.status = proc.wait()
        return None  # stopped by us: the tar itself says what, if anything, was wrong
    stream.status = status  # Pipe.close() / __del__ find the stream closed and do nothing more
    if outcome == "left" or status in (*stream.ignore_status, -signal.SIGPIPE):
        return None
    return _exit_problem(stream, status)


def read_tar_groups(path: str, max_member_bytes: int = MAX_MEMBER_BYTES) -> Iterator[dict]:
    """Members of one tar grouped by key (webdataset's ``base_plus_ext``), as ``{"__key__", ext: bytes, ...}``;
    ``path`` is a local path or a URL (``is_url``: opened with ``gopen`` and read as a stream).

    A sample that cannot be read comes as one group without members, marked ``__skip__: (kind, message)``
    (:func:`skip_marked` raises it): ``non_adjacent_key`` when its key's members are not adjacent in the tar (in a
    local file found by a headers-only first pass, the key's later members dropped; in a stream found when the key
    reappears, see the module docstring), ``member_too_large`` when a member holds more than ``max_member_bytes``
    (its size from the tar header; nothing of it is kept).

    Raises TruncatedTar after the last complete group when the shard cannot be opened, the archive is cut or
    corrupt (tarfile stops silently on a bad header, so the archive must end with a zero block), or its command
    exits with a failure status; the group being read at that point is dropped.
    """
    if max_member_bytes < 1:
        raise ValueError(f"max_member_bytes must be >= 1, got {max_member_bytes!r}")
    streaming = is_url(path)
    scattered = set() if streaming else non_adjacent_keys(path)
    try:
        stream = gopen(path, "rb") if streaming else open(path, "rb")
    except (OSError, ValueError) as err:
        raise TruncatedTar(f"{path}: {type(err).__name__}: {err}") from None
    outcome, error = "left", None
    try:
        data = stream.stream if isinstance(stream, Pipe) else stream  # the command's output itself: its status
        last = yield from _groups(data, path, max_member_bytes, scattered)  # is checked once, at the end (_finish)
        outcome = "end"
    except (tarfile.TarError, OSError, EOFError) as err:
        outcome, error = "error", f"{type(err).__name__}: {err}"
    finally:
        failed = _finish(stream, outcome)
    if failed:
        raise TruncatedTar(f"{path}: {failed}" + (f" ({error})" if error else ""))
    if error:
        raise TruncatedTar(f"{path}: {error}")
    if last is not None:
        yield last
