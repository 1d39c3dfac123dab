"""Write :class:`~data_pipelines.schema.Sample` streams to webdataset shards plus one manifest per split.

Layout of one split (``out_dir/<split>/``)::

    <split>-000000.tar, <split>-000001.tar, ...   webdataset.ShardWriter, max_count samples / max_size bytes each
    manifest.json                                 what is in them (below)

The manifest::

    {"split": "train", "shards": ["train-000000.tar", ...], "brace": "train-{000000..000001}.tar",
     "shard_samples": [1000, 412], "samples": 1412, "images": 2824, "text_chars": 301234,
     "text_tokens": 80211 | null, "tokenizer": "name_or_path" | null, "max_count": 1000, "max_size": 67108864,
     "skipped": {"image_too_large": 1, ...}, ...manifest_extra (generator, seed, source skips, ...)}

Shard names and ``brace`` are relative to the manifest's folder. ``text_chars`` / ``text_tokens`` count the text
*segments* only (a conversation's: its turns'; not ``qa`` or ``meta``); tokens are counted without special
tokens. Tar members carry mtime 0, so the same samples give byte-identical shards.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import webdataset

from data_pipelines.schema import IMAGE_EXTS, MAX_IMAGE_PIXELS, Sample, SkipSample, encode_sample, open_image

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_\-]+$")  # keys, split names: no dot (webdataset cuts member names at the first)
SHARD_NAME = re.compile(r"[A-Za-z0-9_\-]+-\d{6}\.tar")  # <split>-NNNNNN.tar
_LOGGED_PER_KIND = 5  # warnings per skip kind; further skips of that kind are logged at debug level


class TokenCounter:
    """Counts text tokens with a HF tokenizer (``encode(text, add_special_tokens=False)``) or any object whose
    ``encode(text)`` returns a list of ids (e.g. ``local_text.ByteTokenizer``)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.hf = hasattr(tokenizer, "convert_tokens_to_ids")

    def __call__(self, text: str) -> int:
        if self.hf:
            return len(self.tokenizer.encode(text, add_special_tokens=False))
        return len(self.tokenizer.encode(text))

    @property
    def name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", None) or type(self.tokenizer).__name__


def _check_sample(sample: Sample) -> None:
    if not isinstance(sample.key, str) or not _SAFE_NAME.match(sample.key):
        raise ValueError(f"sample key {sample.key!r} must be non-empty and use only letters, digits, '_' and '-'")
    for i, seg in enumerate(sample.all_segments):  # a conversation's: its turns'
        if (seg.text is None) == (seg.image is None):
            raise ValueError(f"sample {sample.key!r} segment {i}: exactly one of text / image must be set")
        if seg.image is not None and (seg.image_ext not in IMAGE_EXTS or not seg.image):
            raise ValueError(
                f"sample {sample.key!r} segment {i}: image_ext {seg.image_ext!r} must be one of {IMAGE_EXTS} "
                "and the image bytes non-empty"
            )


def check_images(sample: Sample, max_pixels: int = MAX_IMAGE_PIXELS) -> None:
    """Decode every image of ``sample`` fully, as the loader does (``schema.open_image``: the same pixel limit);
    raises SkipSample (bad_image / image_too_large)."""
    for seg in sample.all_segments:
        if seg.image is not None:
            open_image(seg.image, max_pixels).close()


class SplitWriter:
    """Writes one split, sample by sample; ``close()`` writes the manifest and returns it.

    Use it directly to route one stream into several splits; :func:`write_shards` is the one-call form.
    Shards are written into a hidden folder beside the split's (``.<split>.tmp-*``); ``close()`` then replaces the
    stale ``<split>-NNNNNN.tar`` files and manifest of an earlier run by the new ones (other files stay), and
    ``abort()`` drops the new ones: an earlier split is never removed before a new one is complete.
    A sample whose image the loader would refuse (``schema.open_image``: undecodable or cut data, more than
    ``max_image_pixels``) is not written: ``write`` returns False and the manifest's ``skipped`` counts it by kind.
    ``manifest_extra`` is read at ``close()``, so it may hold counters the sample iterator fills while writing.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        split: str = "train",
        max_count: int = 1000,
        max_size: int = 64 * 2**20,
        manifest_extra: dict | None = None,
        tokenizer=None,
        max_image_pixels: int = MAX_IMAGE_PIXELS,
    ):
        if not _SAFE_NAME.match(split):
            raise ValueError(f"split {split!r} must use only letters, digits, '_' and '-'")
        if max_count < 1 or max_size < 1:
            raise ValueError(f"max_count and max_size must be >= 1, got max_count={max_count}, max_size={max_size}")
        self.split, self.max_count, self.max_size = split, max_count, max_size
        self.max_image_pixels = max_image_pixels
        self.manifest_extra = manifest_extra if manifest_extra is not None else {}
        self.count_tokens = TokenCounter(tokenizer) if tokenizer is not None else None
        self.dir = Path(out_dir) / split
        self.dir.parent.mkdir(parents=True, exist_ok=True)
        self._stage = Path(tempfile.mkdtemp(prefix=f".{split}.tmp-", dir=self.dir.parent))  # published by close()
        self.skipped: Counter = Counter()
        self._writer: webdataset.ShardWriter | None = None  # opened on the first sample: no empty shard
        self._keys: set[str] = set()
        self._shard_samples: list[int] = []
        self.samples = self.images = self.text_chars = 0
        self.text_tokens = 0
        self.manifest: dict | None = None  # set by close()

    def write(self, sample: Sample) -> bool:
        """Write ``sample``; False (counted in ``skipped``) when the loader would refuse one of its images."""
        _check_sample(sample)
        if sample.key in self._keys:
            raise ValueError(f"duplicate sample key {sample.key!r} in split {self.split!r}")
        try:
            check_images(sample, self.max_image_pixels)
        except SkipSample as skip:
            self.skipped[skip.kind] += 1
            level = logging.WARNING if self.skipped[skip.kind] <= _LOGGED_PER_KIND else logging.DEBUG
            logger.log(level, "%s: skipped sample %r: %s", self.split, sample.key, skip)
            return False
        self._keys.add(sample.key)
        if self._writer is None:
            pattern = str(self._stage / f"{self.split}-%06d.tar")
            # mtime=0: reproducible tars; encoder=False: encode_sample already gives bytes.
            self._writer = webdataset.ShardWriter(
                pattern, maxcount=self.max_count, maxsize=self.max_size, verbose=0, mtime=0, encoder=False
            )
            self._shard_samples.append(0)
        shard_before = self._writer.shard
        self._writer.write(encode_sample(sample))
        if self._writer.shard != shard_before:  # ShardWriter opened a new tar for this sample
            self._shard_samples.append(0)
        self._shard_samples[-1] += 1
        self.samples += 1
        self.images += sample.num_images
        for seg in sample.all_segments:
            if seg.text is not None:
                self.text_chars += len(seg.text)
                if self.count_tokens is not None:
                    self.text_tokens += self.count_tokens(seg.text)
        return True

    def close(self) -> dict:
        """Finish the last shard, write the manifest, publish the split and return the manifest (idempotent); on an
        error nothing is published, as with ``abort()``."""
        if self.manifest is not None:
            return self.manifest
        try:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            manifest = self._manifest()
            (self._stage / MANIFEST).write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
            self._publish(manifest["shards"])
        except BaseException:
            self.abort()
            raise
        n = len(manifest["shards"])
        logger.info(
            "%s: %d samples, %d images in %d shards under %s", self.split, self.samples, self.images, n, self.dir
        )
        self.manifest = manifest
        return manifest

    def _manifest(self) -> dict:
        n = len(self._shard_samples)
        manifest = {
            "split": self.split,
            "shards": [f"{self.split}-{i:06d}.tar" for i in range(n)],
            "brace": f"{self.split}-{{{0:06d}..{n - 1:06d}}}.tar" if n else None,
            "shard_samples": list(self._shard_samples),
            "samples": self.samples,
            "images": self.images,
            "text_chars": self.text_chars,
            "text_tokens": self.text_tokens if self.count_tokens is not None else None,
            "tokenizer": self.count_tokens.name if self.count_tokens is not None else None,
            "max_count": self.max_count,
            "max_size": self.max_size,
            "skipped": dict(sorted(self.skipped.items())),
        }
        clash = sorted(set(manifest) & set(self.manifest_extra))
        if clash:
            raise ValueError(f"manifest_extra must not override the manifest's own fields {clash}")
        manifest.update(self.manifest_extra)
        return manifest

    def _publish(self, shards: list[str]) -> None:
        """Replace the split folder's stale shards and manifest by the staged ones, the manifest last."""
        self.dir.mkdir(exist_ok=True)
        (self.dir / MANIFEST).unlink(missing_ok=True)  # first: no manifest ever names a mix of old and new shards
        stale = [p for p in self.dir.iterdir() if re.fullmatch(rf"{self.split}-\d{{6}}\.tar", p.name)]
        for path in stale:
            path.unlink()
        if stale:
            logger.info("removed %d stale shards from %s", len(stale), self.dir)
        for name in [*shards, MANIFEST]:
            os.replace(self._stage / name, self.dir / name)
        shutil.rmtree(self._stage, ignore_errors=True)

    def abort(self) -> None:
        """Close the open tar and drop what this writer wrote; the split folder stays as it was (after an error)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        shutil.rmtree(self._stage, ignore_errors=True)

    def __enter__(self) -> SplitWriter:
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_shards(
    samples: Iterable[Sample],
    out_dir: str | os.PathLike,
    split: str = "train",
    max_count: int = 1000,
    max_size: int = 64 * 2**20,
    manifest_extra: dict | None = None,
    tokenizer=None,
    max_image_pixels: int = MAX_IMAGE_PIXELS,
) -> dict:
    """Write ``samples`` to ``out_dir/<split>/<split>-%06d.tar`` and ``out_dir/<split>/manifest.json``.

    Args:
        samples: any iterable of Samples; keys unique within the split, letters / digits / ``_`` / ``-`` only.
        max_count, max_size: a new shard starts once the current one holds ``max_count`` samples or
            ``max_size`` payload bytes (a shard may exceed ``max_size`` by its last sample).
        manifest_extra: fields added to the manifest (generator, seed, source, ...), read after writing.
        tokenizer: optional; when given the manifest's ``text_tokens`` counts the text segments' tokens.
        max_image_pixels: samples with a bigger image (or one that does not decode fully) are skipped and counted
            in the manifest's ``skipped``, as the loader would skip them.

    Returns the manifest dict (see the module docstring).
    """
    with SplitWriter(out_dir, split, max_count, max_size, manifest_extra, tokenizer, max_image_pixels) as writer:
        for sample in samples:
            writer.write(sample)
    return writer.manifest


class DatasetRefused(ValueError):
    """Replacing a dataset folder would lose data: it holds more than splits of shards, or the new one is empty."""


def _is_split_folder(path: Path) -> bool:
    """A folder of shards and a manifest only, as SplitWriter writes (safe to replace)."""
    names = (MANIFEST, MANIFEST + ".tmp")
    return path.is_dir() and all(
        p.is_file() and (p.name in names or SHARD_NAME.fullmatch(p.name)) for p in path.iterdir()
    )


def _dataset_samples(root: Path) -> int:
    return sum(json.loads(p.read_text())["samples"] for p in root.glob(f"*/{MANIFEST}"))


def _swap(stage: Path, out: Path) -> None:
    """Put ``stage`` in the place of ``out`` by renames; the old ``out`` is deleted once the new one is in."""
    if not out.exists():
        os.rename(stage, out)
        return
    old = out.parent / f".{out.name}.old-{stage.name.removeprefix(f'.{out.name}.tmp-')}"  # the stage's random part
    os.rename(out, old)
    try:
        os.rename(stage, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_dataset(out_dir: str | os.PathLike) -> Iterator[Path]:
    """A fresh hidden folder beside ``out_dir`` to write a whole dataset into (``<split>/`` folders); when the block
    ends without error it replaces ``out_dir``, which then holds exactly the splits written; on any error it is
    deleted and ``out_dir`` stays as it was. Raises DatasetRefused, keeping ``out_dir``, when ``out_dir`` holds
    anything but splits of shards, or when the block wrote no sample and ``out_dir`` is not empty."""
    out = Path(out_dir).resolve()
    if out.exists() and not out.is_dir():
        raise DatasetRefused(f"{out} is not a folder; refusing to replace it")
    old = sorted(p.name for p in out.iterdir()) if out.exists() else []
    foreign = [name for name in old if not _is_split_folder(out / name)]
    if foreign:
        raise DatasetRefused(f"{out} holds {foreign[0]!r}, not a split of shards; refusing to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield stage
        if old and _dataset_samples(stage) == 0:
            raise DatasetRefused(f"nothing written: no usable samples; {out} keeps its dataset (no empty one over it)")
        _swap(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def load_manifest(split_dir: str | os.PathLike) -> dict:
    """The manifest of ``split_dir`` (``out_dir/<split>``), with ``paths``: the shards' full paths."""
    manifest = json.loads((Path(split_dir) / MANIFEST).read_text())
    manifest["paths"] = [str(Path(split_dir) / name) for name in manifest["shards"]]
    return manifest
