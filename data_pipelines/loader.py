"""``make_dataloader``: webdataset shards -> packed, resumable, fault-tolerant batches for ``ConceptMoEVLM``.

Per worker, a ``webdataset.DataPipeline`` of four stages::

    tar groups (shards of this rank/worker, read in order) -> block shuffle -> decode + encode -> pack + collate

Order. Epoch ``e`` permutes the shard list with ``Random(f"{seed}:shards:{e}")`` (same on every rank). With at
least ``world_size * num_workers`` shards, split ``s = rank * W + worker`` reads shards ``perm[s::splits]``;
with fewer, every split reads all shards and keeps groups ``j`` with ``j % splits == s``. Either way the splits
are disjoint and together cover the epoch. Samples are shuffled within consecutive blocks of
``shuffle_buffer`` samples by ``Random(f"{seed}:{e}:{s}:{block}")``, so the order depends only on
(seed, epoch, rank, worker) and any position in it can be reached again.

Resume. Packing yields a row as soon as it closes, and a batch as soon as its last row closes, so after every
batch the stream stands at an exact point: "the next row starts at token ``offset`` of sample ``next`` (the
emission index within the epoch) of epoch ``epoch``". Each batch carries its worker's state (that point, the
tar position where its shuffle block starts, counters); the loader keeps the state of the last batch it handed
out per worker and which worker is due next (torch serves workers round-robin), and a fresh loader rotates its
workers so that one comes first. Resuming re-reads one block of raw tar members, discards the samples before
``next`` without decoding them, and packs on from ``offset``. Counters are not counted twice: events at
positions before the saved high-water marks (``hw_emit`` samples, ``hw_shard`` shards) are recounted as seen.

Faults. ``read_tar_groups`` reads each tar with ``tarfile`` streaming; an archive that is cut or corrupt
(read error, or no end-of-archive block after the last member) counts one ``truncated_tar``; the groups before
it are kept, the group being read is dropped, reading goes on with the next shard. A key whose members are not
adjacent (``non_adjacent_key``) or one with a member over ``max_member_bytes`` (``member_too_large``) is one
skipped sample. Decoding raises ``SkipSample`` (schema), packing adds ``too_long``; each skip is counted, logged
(rate-limited; the rest at DEBUG on ``data_pipelines.loader.skips``) and the stream goes on. Counters are cumulative
over epochs; ``loader.stats()`` sums them over workers.

Shards in object storage. A shard spec may also be a URL webdataset's ``gopen`` opens (``pipe:CMD``,
``http(s)://...``, brace patterns expanded; ``tar_reader.expand_shards``): read as a stream with the same checks (a
stream cut anywhere is a ``truncated_tar``, and so is a command that exits with a failure status, its status in the
message). Sharding across ranks and workers and the resume state are the same as for local files (positions count
groups, not bytes); resuming inside a remote shard reads it again from its start and skips to the position.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import random
import time
from collections.abc import Iterator
from functools import partial
from itertools import islice

import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from data_pipelines.packing import LOSS_ON, Packer, TokenEncoder, collate_rows, encode_sample_tokens
from data_pipelines.run_config import DataConfig, default_of
from data_pipelines.schema import MAX_IMAGE_PIXELS, SKIP_KINDS, SkipSample, decode_sample
from data_pipelines.tar_reader import MAX_MEMBER_BYTES, TruncatedTar, expand_shards, read_tar_groups, skip_marked
from data_pipelines.tokenizer import add_vlm_tokens
from vision_tower import ImageProcessor

logger = logging.getLogger(__name__)
skip_logger = logging.getLogger(f"{__name__}.skips")  # one record per skipped sample (the checker's --verbose)

STATE_VERSION = 1


def _zero_counts() -> dict:
    return {
        "samples": 0,
        "images": 0,
        "text_tokens": 0,
        "rows": 0,
        "real_tokens": 0,
        "skipped": dict.fromkeys(SKIP_KINDS, 0),
    }


def _fresh_state() -> dict:
    position = {"epoch": 0, "next": 0, "offset": 0, "block": [0, 0, 0], "hw_emit": 0, "hw_shard": 0}
    return {**position, "done": False, "counts": _zero_counts()}


class _SkipLog:
    """One warning per skip for the first few of each kind, then at most one per ``interval`` seconds; the others
    at DEBUG level (``skip_logger``)."""

    def __init__(self, first: int = 5, interval: float = 10.0):
        self.first, self.interval, self.last = first, interval, {}

    def __call__(self, kind: str, total: int, message: str) -> None:
        now = time.monotonic()
        if total <= self.first or now - self.last.get(kind, -1e9) >= self.interval:
            self.last[kind] = now
            skip_logger.warning("skipped sample [%s, %d so far in this worker]: %s", kind, total, message)
        else:
            skip_logger.debug("skipped sample [%s, %d so far in this worker]: %s", kind, total, message)


class _WorkerStream:
    """The batches of one split (rank, worker), from a resume state; see the module docstring."""

    def __init__(self, cfg: dict, split: int, n_splits: int, state: dict):
        self.cfg, self.split, self.n_splits = cfg, split, n_splits
        self.state = copy.deepcopy(state)
        self.counts = self.state["counts"]
        self.block_size = max(1, cfg["shuffle_buffer"]) if cfg["shuffle"] else 1
        self.blocks: dict[int, list] = {}  # block index -> tar position where it starts
        self.hw_emit = self.hw_shard = 0
        self.log = _SkipLog()

    # ------------------------------------------------------------------ stage 1: tar groups
    def plan(self, epoch: int) -> tuple[list[str], bool]:
        shards = self.cfg["shards"]
        order = list(range(len(shards)))
        if self.cfg["shuffle"]:
            random.Random(f"{self.cfg['seed']}:shards:{epoch}").shuffle(order)
        if len(shards) >= self.n_splits:
            return [shards[i] for i in order[self.split :: self.n_splits]], False
        return [shards[i] for i in order], True

    def groups(self, epoch: int, start: list) -> Iterator[tuple[list, dict, list]]:
        """(position before, group, position after); a position is [shard, groups into it, groups in epoch]."""
        shards, by_sample = self.plan(epoch)
        first, skip, index = start
        for p in range(first, len(shards)):
            k = 0
            try:
                for group in read_tar_groups(shards[p], self.cfg["max_member_bytes"]):
                    if p == first and k < skip:
                        k += 1
                        continue
                    before = [p, k, index]
                    k, index = k + 1, index + 1
                    if not by_sample or (index - 1) % self.n_splits == self.split:
                        yield before, group, [p, k, index]
            except TruncatedTar as err:
                if p >= self.hw_shard and (not by_sample or p % self.n_splits == self.split):
                    self.skip("truncated_tar", str(err))
            self.hw_shard = max(self.hw_shard, p + 1)

    # ------------------------------------------------------------------ stage 2: block shuffle
    def shuffled(self, groups: Iterator, epoch: int, first: int) -> Iterator[tuple[int, dict]]:
        """(emission index, group) from emission index ``first`` on; earlier ones of its block are not decoded."""
        size, b = self.block_size, first // self.block_size
        while block := list(islice(groups, size)):
            self.blocks = {b: block[0][0], b + 1: block[-1][2]}
            order = list(range(len(block)))
            if size > 1:
                random.Random(f"{self.cfg['seed']}:{epoch}:{self.split}:{b}").shuffle(order)
            for j, i in enumerate(order):
                if b * size + j >= first:
                    yield b * size + j, block[i][1]
            b += 1

    # ------------------------------------------------------------------ stage 3: decode + encode
    def encoded(self, items: Iterator, packer: Packer) -> Iterator[tuple[int, object]]:
        cfg = self.cfg
        for e, group in items:
            counted = e >= self.hw_emit
            self.hw_emit = max(self.hw_emit, e + 1)
            try:
                skip_marked(group)  # non_adjacent_key / member_too_large, found while reading the tar
                doc = encode_sample_tokens(
                    decode_sample(group),
                    cfg["encoder"],
                    cfg["image_processor"],
                    cfg["image_token_id"],
                    cfg["max_image_pixels"],
                    cfg["loss_on"],
                )
                if not packer.fits(doc):
                    raise SkipSample("too_long", f"{doc.key}: {len(doc)} tokens, rows hold {cfg['seq_len']}")
            except SkipSample as skip:
                if counted:
                    self.skip(skip.kind, f"{group.get('__url__')}: {skip}")
                continue
            if counted:
                self.counts["samples"] += 1
                self.counts["images"] += len(doc.images)
                self.counts["text_tokens"] += doc.num_text_tokens
            yield e, doc

    def skip(self, kind: str, message: str) -> None:
        self.counts["skipped"][kind] += 1
        self.log(kind, self.counts["skipped"][kind], message)

    # ------------------------------------------------------------------ stage 4: pack + collate
    def __iter__(self) -> Iterator[tuple[dict | None, dict]]:
        cfg, st = self.cfg, self.state
        packer = Packer(cfg["seq_len"], cfg["split_documents"])
        packer.rows, packer.real_tokens = self.counts["rows"], self.counts["real_tokens"]
        rows, epoch, resumed = [], st["epoch"], True
        if st["done"]:
            return
        while cfg["epochs"] is None or epoch < cfg["epochs"]:
            first, offset = (st["next"], st["offset"]) if resumed else (0, 0)
            start = st["block"] if resumed else [0, 0, 0]
            self.hw_emit, self.hw_shard = (st["hw_emit"], st["hw_shard"]) if resumed else (0, 0)
            placed = 0
            pipeline = wds.DataPipeline(
                partial(self.groups, epoch, start),
                partial(self.shuffled, epoch=epoch, first=first),
                partial(self.encoded, packer=packer),
            )
            for e, doc in pipeline:
                placed += 1
                for row in packer.add(doc, e, offset if e == first else 0):
                    rows.append(row)
                    if len(rows) == cfg["batch_size"]:
                        nxt, off = (e + 1, 0) if row.resume[1] >= len(doc) else (e, row.resume[1])
                        self.mark(epoch, nxt, off)
                        batch = self.collate(rows, packer)
                        yield batch, self.snapshot()
                        rows = []
            if placed == 0 and first == 0:  # a whole epoch with nothing usable: stop rather than spin
                logger.warning("split %d: epoch %d placed no sample; ending this stream", self.split, epoch)
                break
            epoch, resumed = epoch + 1, False
        if (row := packer.flush()) is not None:
            rows.append(row)
        batch = self.collate(rows, packer) if rows else None
        st["done"] = True
        yield batch, self.snapshot()

    def mark(self, epoch: int, nxt: int, offset: int) -> None:
        """Record "the next row starts at token ``offset`` of sample ``nxt`` of ``epoch``" (a batch just closed)."""
        block = self.blocks[nxt // self.block_size]
        self.state.update(
            epoch=epoch, next=nxt, offset=offset, block=block, hw_emit=self.hw_emit, hw_shard=self.hw_shard
        )

    def snapshot(self) -> dict:
        return copy.deepcopy(self.state)

    def collate(self, rows: list, packer: Packer) -> dict:
        self.counts["rows"], self.counts["real_tokens"] = packer.rows, packer.real_tokens
        return collate_rows(rows, self.cfg["seq_len"], self.cfg["encoder"].pad_id, self.cfg["image_processor"])


class ShardDataset(IterableDataset):
    """torch IterableDataset over :class:`_WorkerStream`; items are ``(batch | None, logical worker, state)``."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg = cfg
        self.states = [_fresh_state() for _ in range(max(1, cfg["num_workers"]))]
        self.rotation = 0

    def __iter__(self):
        info = get_worker_info()
        n_workers = len(self.states)
        worker = 0 if info is None else (info.id + self.rotation) % n_workers
        split, n_splits = self.cfg["rank"] * n_workers + worker, self.cfg["world_size"] * n_workers
        for batch, state in _WorkerStream(self.cfg, split, n_splits, self.states[worker]):
            yield batch, worker, state


class ShardLoader:
    """Iterable of batches (dicts of tensors for ``ConceptMoEVLM.forward``), resumable with ``state_dict`` /
    ``load_state_dict``; ``stats()`` for the counters. Iterating again continues where the last loop stopped."""

    def __init__(self, cfg: dict, pin_memory: bool = False):
        self.cfg, self.pin_memory = cfg, pin_memory
        self.dataset = ShardDataset(cfg)
        self.next_worker = 0  # the logical worker torch's round-robin serves next

    def __iter__(self) -> Iterator[dict]:
        n_workers = len(self.dataset.states)
        self.dataset.rotation = self.next_worker  # workers copy the dataset (states included) when they start
        loader = DataLoader(
            self.dataset, batch_size=None, num_workers=self.cfg["num_workers"], pin_memory=self.pin_memory
        )
        for batch, worker, state in loader:
            self.dataset.states[worker] = state
            self.next_worker = self.dataset.rotation = (worker + 1) % n_workers
            if batch is not None:  # None: a worker's closing counters
                yield batch

    def _fingerprint(self) -> dict:
        keys = (
            "seed",
            "rank",
            "world_size",
            "num_workers",
            "seq_len",
            "batch_size",
            "shuffle",
            "shuffle_buffer",
            "split_documents",
            "image_token_id",
            "loss_on",
        )
        shards = hashlib.sha256("\n".join(self.cfg["shards"]).encode()).hexdigest()[:16]
        return {**{k: self.cfg[k] for k in keys}, "shards": shards}

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "config": self._fingerprint(),
            "next_worker": self.next_worker,
            "workers": copy.deepcopy(self.dataset.states),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')!r}; this loader reads {STATE_VERSION}")
        mine = self._fingerprint()
        for key, value in state["config"].items():
            if mine.get(key) != value:
                raise ValueError(f"loader state was saved with {key}={value!r}, this loader has {mine.get(key)!r}")
        self.dataset.states = copy.deepcopy(state["workers"])
        self.next_worker = state["next_worker"]

    def stats(self) -> dict:
        """Counters over all workers of this rank: samples, images, text_tokens, skipped {kind: n}, rows,
        packing_efficiency (real tokens / row capacity of the rows handed out)."""
        total = _zero_counts()
        for state in self.dataset.states:
            for key, value in state["counts"].items():
                if key == "skipped":
                    for kind, n in value.items():
                        total["skipped"][kind] += n
                else:
                    total[key] += value
        total["packing_efficiency"] = total["real_tokens"] / max(1, total["rows"] * self.cfg["seq_len"])
        return total


def _check_loader_args(cfg: dict) -> None:
    """One-line ``ValueError`` for a ``make_dataloader`` setting out of range."""
    lows = {"seq_len": 2, "batch_size": 1, "world_size": 1, "num_workers": 0, "max_image_pixels": 1}
    for name, low in (lows | {"shuffle_buffer": 0, "max_member_bytes": 1}).items():
        if not isinstance(value := cfg[name], int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if not 0 <= cfg["rank"] < cfg["world_size"]:
        raise ValueError(f"rank must be in [0, world_size={cfg['world_size']}), got {cfg['rank']!r}")
    if cfg["loss_on"] not in LOSS_ON:
        raise ValueError(f"loss_on={cfg['loss_on']!r} is invalid: allowed values are {LOSS_ON}")
    if cfg["epochs"] is not None and cfg["epochs"] < 1:
        raise ValueError(f"epochs must be None (forever) or >= 1, got {cfg['epochs']!r}")


def make_dataloader(
    shards,
    tokenizer,
    image_processor: ImageProcessor | None = None,
    seq_len: int = default_of(DataConfig, "seq_len"),
    batch_size: int = default_of(DataConfig, "batch_size"),
    rank: int = 0,
    world_size: int = 1,
    num_workers: int = default_of(DataConfig, "num_workers"),
    seed: int = 0,
    shuffle_buffer: int = 1000,
    epochs: int | None = None,
    image_token_id: int | None = None,
    max_image_pixels: int = MAX_IMAGE_PIXELS,
    shuffle: bool = True,
    split_documents: bool = default_of(DataConfig, "split_documents"),
    pin_memory: bool = False,
    loss_on: str = default_of(DataConfig, "loss_on"),
    max_member_bytes: int = MAX_MEMBER_BYTES,
) -> ShardLoader:
    """Packed ``[batch_size, seq_len]`` batches from webdataset shards (paths, brace patterns, globs, folders, and
    ``file:`` / ``pipe:`` / ``http(s)://`` specs: ``tar_reader.expand_shards``).

    Batches hold ``input_ids, attention_mask, labels, doc_ids, position_ids, modality_ids`` ([B, N] long) and
    ``patches, patch_coord, patch_valid, grid_hw`` for the images of all rows in order: ``model(**batch)``.
    ``epochs=None`` streams forever; with ``epochs=k`` the last batch may hold fewer rows. ``image_token_id``
    defaults to the tokenizer's ``<image>`` (added as a special token when missing, as ``VLMProcessor`` does).
    ``split_documents``: see ``data_pipelines.packing``. ``shuffle=False`` reads shards and samples in order.
    ``loss_on`` (``packing.LOSS_ON``): ``auto`` labels the assistant turns of conversations and all text elsewhere.
    ``max_member_bytes``: a sample with a bigger tar member (decompressed) is skipped as ``member_too_large``.
    The data settings default to a training run's (``DataConfig``); ``loader_from_config`` takes them from one.
    """
    settings = dict(
        seq_len=seq_len,
        batch_size=batch_size,
        rank=rank,
        world_size=world_size,
        num_workers=num_workers,
        seed=seed,
        shuffle=shuffle,
        shuffle_buffer=shuffle_buffer,
        epochs=epochs,
        max_image_pixels=max_image_pixels,
        split_documents=split_documents,
        loss_on=loss_on,
        max_member_bytes=max_member_bytes,
    )
    _check_loader_args(settings)
    encoder = tokenizer if isinstance(tokenizer, TokenEncoder) else TokenEncoder(tokenizer)
    if image_token_id is None:
        image_token_id = _image_token_id(encoder.tokenizer)
    if num_workers > 0:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # workers fork after the tokenizer was used
    image_processor = image_processor or ImageProcessor()
    cfg = dict(shards=expand_shards(shards), encoder=encoder, image_processor=image_processor, **settings)
    return ShardLoader(cfg | {"image_token_id": image_token_id}, pin_memory=pin_memory)


def loader_from_config(
    data: DataConfig, tokenizer, image_processor: ImageProcessor | None = None, shards=None, **options
) -> ShardLoader:
    """``make_dataloader`` with a run's data settings (``seq_len``, ``batch_size``, ``num_workers``,
    ``split_documents``, ``loss_on``); ``shards`` default to ``data.shards``; ``options`` are the other arguments
    of ``make_dataloader`` (rank, world_size, seed, epochs, shuffle, image_token_id, ...)."""
    settings = dict(
        seq_len=data.seq_len,
        batch_size=data.batch_size,
        num_workers=data.num_workers,
        split_documents=data.split_documents,
        loss_on=data.loss_on,
    )
    return make_dataloader(data.shards if shards is None else shards, tokenizer, image_processor, **settings | options)


def _image_token_id(tokenizer) -> int:
    if not hasattr(tokenizer, "get_vocab"):  # a plain tokenizer (ByteTokenizer): the first id past its vocabulary
        return len(tokenizer)
    return add_vlm_tokens(tokenizer, chat=False)
