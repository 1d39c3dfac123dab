"""A checkpoint's manifest: every file of the checkpoint folder with its size and SHA-256, written last (atomically)
once every rank has finished writing. A folder verifies when the manifest reads and every file it lists is there
with that size and checksum; anything else is a one-line reason, so resume can say why it skipped a checkpoint.

    {"format": 1, "step": 100, "world_size": 2, "files": {"mp_rank_00_model_states.pt": {"bytes": .., "sha256": ..}}}
"""

from __future__ import annotations

import hashlib
import json
import os

MANIFEST = "manifest.json"
FORMAT = 1
_CHUNK = 1 << 20


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, fsync and rename: readers see the old or the new file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def list_files(folder: str) -> list[str]:
    """Every regular file under ``folder`` (relative paths, sorted), the manifest itself excluded."""
    out = []
    for base, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(base, name), folder)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def file_entries(folder: str, files: list[str]) -> dict[str, dict]:
    """``{file: {"bytes", "sha256"}}`` for ``files`` of ``folder`` (ranks split a checkpoint's files among them)."""
    out = {}
    for rel in files:
        path = os.path.join(folder, rel)
        out[rel] = {"bytes": os.path.getsize(path), "sha256": sha256_of(path)}
    return out


def write_manifest(folder: str, step: int, world_size: int, entries: dict[str, dict] | None = None) -> dict:
    """Write ``folder/manifest.json`` last, from ``entries`` (default: checksum every file here); returns it."""
    files = entries if entries is not None else file_entries(folder, list_files(folder))
    manifest = {"format": FORMAT, "step": step, "world_size": world_size, "files": dict(sorted(files.items()))}
    write_text_atomic(os.path.join(folder, MANIFEST), json.dumps(manifest, indent=1))
    return manifest


def read_manifest(folder: str) -> dict:
    """The manifest of ``folder``; ``ValueError`` with a one-line reason when it is absent or unreadable."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        raise ValueError(f"no {MANIFEST} (an interrupted write, or a checkpoint from before manifests)")
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read().decode("utf-8"))
        files = manifest["files"]
        if manifest["format"] != FORMAT or not isinstance(files, dict):
            raise ValueError(f"format {manifest['format']!r}")
        for rel, entry in files.items():
            if os.path.isabs(rel) or ".." in rel.split(os.sep) or not isinstance(entry["bytes"], int):
                raise ValueError(f"bad entry {rel!r}")
        int(manifest["step"]), int(manifest["world_size"])
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{MANIFEST} unreadable ({type(err).__name__}: {err})") from None
    return manifest


def verify(folder: str, world_size: int | None = None) -> str | None:
    """``None`` when ``folder`` is a complete, intact checkpoint (for ``world_size`` ranks, when given); otherwise
    the first problem found, as one line."""
    if not os.path.isdir(folder):
        return "not a folder"
    try:
        manifest = read_manifest(folder)
    except ValueError as err:
        return str(err)
    if world_size is not None and manifest["world_size"] != world_size:
        return f"written by {manifest['world_size']} ranks, this run has {world_size}"
    for rel, entry in manifest["files"].items():
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            return f"{rel} missing"
        size = os.path.getsize(path)
        if size != entry["bytes"]:
            return f"{rel} has {size} bytes, the manifest says {entry['bytes']}"
        if sha256_of(path) != entry.get("sha256"):
            return f"{rel} checksum differs from the manifest"
    return None
