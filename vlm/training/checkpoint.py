"""Checkpoints: DeepSpeed ``save_checkpoint`` into a temporary tag, per-rank client files (data loader position
and RNG states), then rename to the final tag and point ``latest_complete`` at it (written atomically) once every
rank has finished. An interrupted write is never picked up; the last ``keep_last`` complete checkpoints stay."""

from __future__ import annotations

import logging
import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

LATEST = "latest_complete"
TMP_PREFIX = "tmp-"


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def save(engine, run_dir: str, step: int, client_state: dict, rank_state: dict, keep_last: int) -> str:
    """Save a complete checkpoint for ``step``; ``rank_state`` (loader position, RNG) is saved per rank."""
    root, tag = checkpoint_dir(run_dir), tag_for(step)
    tmp_tag = TMP_PREFIX + tag
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        shutil.rmtree(os.path.join(root, tmp_tag), ignore_errors=True)
    _barrier()
    engine.save_checkpoint(root, tag=tmp_tag, client_state=client_state, save_latest=False)
    torch.save(rank_state, os.path.join(root, tmp_tag, f"rank_state_{rank:05d}.pt"))
    _barrier()
    if rank == 0:
        final = os.path.join(root, tag)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(os.path.join(root, tmp_tag), final)
        _write_atomic(os.path.join(root, LATEST), tag)
        prune(root, keep_last)
        log.info("checkpoint %s complete", final)
    _barrier()
    return tag


def complete_tags(root: str) -> list[str]:
    if not os.path.isdir(root):
        return []
    return sorted(t for t in os.listdir(root) if t.startswith("step_") and os.path.isdir(os.path.join(root, t)))


def prune(root: str, keep_last: int) -> None:
    """Drop all but the newest ``keep_last`` complete checkpoints, and stale temporary ones."""
    latest = latest_tag(root)
    for tag in complete_tags(root)[:-keep_last]:
        if tag != latest:
            shutil.rmtree(os.path.join(root, tag), ignore_errors=True)
    for name in os.listdir(root):
        if name.startswith(TMP_PREFIX):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def latest_tag(root: str) -> str | None:
    path = os.path.join(root, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        tag = f.read().strip()
    return tag if os.path.isdir(os.path.join(root, tag)) else None


def resolve_resume(run_dir: str, resume: str | None) -> tuple[str, str] | None:
    """``auto``: the latest complete checkpoint of ``run_dir`` (None when there is none); a path: that tag folder."""
    if resume is None:
        return None
    if resume == "auto":
        root = checkpoint_dir(run_dir)
        tag = latest_tag(root)
        return (root, tag) if tag else None
    path = os.path.abspath(resume.rstrip("/"))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--resume {resume!r}: no such checkpoint folder")
    return os.path.dirname(path), os.path.basename(path)


def load(engine, root: str, tag: str) -> tuple[dict, dict]:
    """Restore engine (model, optimiser) from ``root/tag``; returns (client_state, this rank's rank_state)."""
    path, client_state = engine.load_checkpoint(root, tag=tag, load_optimizer_states=True)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {os.path.join(root, tag)}")
    rank = dist.get_rank() if dist.is_initialized() else 0
    rank_file = os.path.join(root, tag, f"rank_state_{rank:05d}.pt")
    if not os.path.isfile(rank_file):
        raise FileNotFoundError(f"{rank_file} missing: was the checkpoint written with a different world size?")
    rank_state = torch.load(rank_file, weights_only=False)
    return client_state, rank_state
