"""Checkpoints that are complete or absent, verified before they are trusted, and never executed.

Writing ``checkpoints/step_XXXXXXXX``: DeepSpeed's ``save_checkpoint`` into ``tmp-step_XXXXXXXX``, each rank's own
state (data loader position, RNG states) as JSON; once every rank is done, the ranks hash the files in parallel and
rank 0 writes ``manifest.json`` (every file with its size and SHA-256, ``vlm.training.manifest``), renames the
folder to its final tag, points ``latest_complete`` at it (atomic write) and prunes. An interrupted write is never
picked up.

Reading: the folder must verify against its manifest for this world size (``verify``, checked by
``vlm.training.resume`` before ``load``); every ``torch.load``, ours
and DeepSpeed's, goes through the restricted unpickler (``vlm.training.safe_load``). Which checkpoint a run resumes
from is ``vlm.training.resume``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist

from vlm.training.expert_parallel import (
    expert_parallel_size,
    load_expert_shard,
    save_expert_shard,
    saved_expert_parallel,
)
from vlm.training.manifest import file_entries, list_files, write_manifest, write_text_atomic
from vlm.training.safe_load import weights_only_loading

log = logging.getLogger(__name__)

LATEST = "latest_complete"
TMP_PREFIX = "tmp-"
TAG_RE = re.compile(r"step_(\d{8})")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message is one line."""


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def step_of(tag: str) -> int | None:
    """The step a tag names, ``None`` for anything that is not exactly ``step_XXXXXXXX``."""
    match = TAG_RE.fullmatch(tag)
    return int(match.group(1)) if match else None


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_state_file(rank: int) -> str:
    return f"rank_state_{rank:05d}.json"


# -- RNG states as JSON (no pickle) ------------------------------------------------------------------------------


def rng_state() -> dict:
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


# -- writing ------------------------------------------------------------------------------------------------------


def save(engine, run_dir: str, step: int, client_state: dict, rank_state: dict, keep_last: int) -> str:
    """Save a complete checkpoint for ``step``; ``rank_state`` (JSON-able: loader position, RNG) is saved per rank."""
    root, tag = checkpoint_dir(run_dir), tag_for(step)
    tmp_tag = TMP_PREFIX + tag
    rank, world_size = rank_and_world()
    if rank == 0:
        shutil.rmtree(os.path.join(root, tmp_tag), ignore_errors=True)
    _barrier()
    engine.save_checkpoint(root, tag=tmp_tag, client_state=client_state, save_latest=False)
    save_expert_shard(engine.module, os.path.join(root, tmp_tag))  # expert parallelism: this rank's experts
    with open(os.path.join(root, tmp_tag, rank_state_file(rank)), "w", encoding="utf-8") as f:
        json.dump(rank_state, f)
    _barrier()
    entries = _checksums(os.path.join(root, tmp_tag), rank, world_size)
    if rank == 0:
        write_manifest(os.path.join(root, tmp_tag), step, world_size, entries)
        final = os.path.join(root, tag)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(os.path.join(root, tmp_tag), final)
        write_text_atomic(os.path.join(root, LATEST), tag)
        prune(root, keep_last, keep=tag)
        log.info("checkpoint %s complete", final)
    _barrier()
    return tag


def _checksums(folder: str, rank: int, world_size: int) -> dict[str, dict]:
    """Every file's size and SHA-256, the files split round-robin among the ranks (hashing runs at ~0.5-1 GB/s per
    process) and gathered on every rank."""
    mine = file_entries(folder, list_files(folder)[rank::world_size])
    if world_size == 1:
        return mine
    parts = [None] * world_size
    dist.all_gather_object(parts, mine)
    return {rel: entry for part in parts for rel, entry in part.items()}


def step_tags(root: str) -> list[str]:
    """The ``step_XXXXXXXX`` folders of ``root``, oldest first (complete or not: ``verify`` says)."""
    if not os.path.isdir(root):
        return []
    tags = [t for t in os.listdir(root) if step_of(t) is not None and os.path.isdir(os.path.join(root, t))]
    return sorted(tags, key=step_of)


def prune(root: str, keep_last: int, keep: str) -> None:
    """Drop all but the newest ``keep_last`` checkpoints and stale temporary folders; ``keep`` (the checkpoint just
    written and verified) is never dropped, nor anything newer than it."""
    tags = step_tags(root)
    newest_kept = tags[: tags.index(keep) + 1] if keep in tags else []
    for tag in newest_kept[:-keep_last]:
        shutil.rmtree(os.path.join(root, tag), ignore_errors=True)
    for name in os.listdir(root):
        if name.startswith(TMP_PREFIX):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


# -- reading ------------------------------------------------------------------------------------------------------


def check_same_expert_parallel(folder: str, model) -> None:
    """A one-line ``CheckpointError`` unless ``model`` splits its experts as the run that wrote ``folder`` did."""
    saved, now = saved_expert_parallel(folder), expert_parallel_size(model)
    if saved != now:
        raise CheckpointError(
            f"checkpoint {folder} was written at train.expert_parallel={saved}; this run has {now}: resume at "
            f"{saved}, or export it (python -m vlm.training.export) and start from the export with model.init_from"
        )


def load(engine, root: str, tag: str) -> tuple[dict, dict]:
    """Restore engine (model, optimiser) from ``root/tag``, a checkpoint already verified against its manifest
    (``vlm.training.resume.find_checkpoint``, once on rank 0: hashing it again on every rank would read every file
    once per rank); returns (client_state, this rank's rank_state). Raises ``CheckpointError`` (one line) when it
    will not load."""
    rank, _ = rank_and_world()
    folder = os.path.join(root, tag)
    check_same_expert_parallel(folder, engine.module)
    with weights_only_loading():
        path, client_state = engine.load_checkpoint(root, tag=tag, load_optimizer_states=True)
    if path is None:
        raise CheckpointError(f"DeepSpeed could not load checkpoint {folder}")
    load_expert_shard(engine.module, folder)
    try:
        with open(os.path.join(folder, rank_state_file(rank)), encoding="utf-8") as f:
            rank_state = json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {folder}: {rank_state_file(rank)} unreadable ({err})") from None
    return client_state, rank_state
