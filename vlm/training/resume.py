"""Which checkpoint a run starts from, and what it may do to its run folder.

- ``prepare_run_dir``: a folder that already holds a run (checkpoints or metrics) is refused unless the user says
  ``--resume`` (continue it) or ``--overwrite`` (its checkpoints, metrics, TensorBoard logs and export are removed).
- ``find_checkpoint``: ``--resume auto`` walks back from the newest ``step_XXXXXXXX`` folder of this run to the newest
  one that verifies against its manifest, logs why it skipped the others, and stops with a one-line
  ``CheckpointError`` when none verifies. ``latest_complete`` is only a hint, trusted when it names a checkpoint
  folder of this run by its plain tag; a run with no checkpoint and no metrics starts at step 0 (said in the log).
  ``--resume PATH`` takes that checkpoint folder, which must verify.
- ``set_aside_newer``: the checkpoints newer than the one resumed from (those that did not verify) are renamed
  ``rejected-step_XXXXXXXX`` — kept for inspection, never loaded or pruned, never overwritten by the resumed run.
- ``truncate_metrics``: the records after the resumed step are dropped from ``metrics.jsonl``, so it holds every
  step exactly once.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, field

from vlm.training.checkpoint import LATEST, CheckpointError, checkpoint_dir, step_of, step_tags
from vlm.training.manifest import verify, write_text_atomic

log = logging.getLogger(__name__)

METRICS = "metrics.jsonl"
REJECTED_PREFIX = "rejected-"
RUN_ARTEFACTS = ("checkpoints", METRICS, "tb", "hf")  # what --overwrite removes; config.yaml is rewritten


@dataclass
class Found:
    """The checkpoint to resume from, and the newer ones that were skipped with their reasons."""

    root: str
    tag: str
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def step(self) -> int:
        return step_of(self.tag)


def holds_a_run(run_dir: str) -> bool:
    """``run_dir`` has checkpoints (any, complete or not) or a non-empty ``metrics.jsonl``."""
    root = checkpoint_dir(run_dir)
    if os.path.isdir(root) and os.listdir(root):
        return True
    metrics = os.path.join(run_dir, METRICS)
    return os.path.isfile(metrics) and os.path.getsize(metrics) > 0


def prepare_run_dir(run_dir: str, resume: str | None, overwrite: bool, is_rank0: bool) -> None:
    """Refuse to silently reuse a run folder; with ``overwrite``, rank 0 clears the old run's artefacts."""
    if resume is not None and overwrite:
        raise CheckpointError("--resume and --overwrite exclude each other")
    if resume is not None or not holds_a_run(run_dir):
        return
    if not overwrite:
        raise CheckpointError(
            f"--out {run_dir} already holds a run (checkpoints or {METRICS}): pass --resume auto to continue it, "
            "or --overwrite to start it over"
        )
    if is_rank0:
        for name in RUN_ARTEFACTS:
            path = os.path.join(run_dir, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)
        log.info("--overwrite: removed the previous run's %s from %s", ", ".join(RUN_ARTEFACTS), run_dir)


def read_pointer(root: str) -> tuple[str | None, str | None]:
    """(tag, None) when ``root/latest_complete`` names a ``step_XXXXXXXX`` folder of ``root``; (None, why) if not."""
    path = os.path.join(root, LATEST)
    if not os.path.isfile(path):
        return None, f"{LATEST} missing"
    with open(path, "rb") as f:
        raw = f.read(256)
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None, f"{LATEST} is not text"
    if step_of(tag) is None:
        return None, f"{LATEST} holds {tag[:60]!r}, not a checkpoint tag of this run"
    if not os.path.isdir(os.path.join(root, tag)):
        return None, f"{LATEST} names {tag}, which does not exist"
    return tag, None


def newest_verified(root: str, world_size: int | None) -> tuple[str | None, dict[str, str]]:
    """Walk back from the newest ``step_XXXXXXXX`` folder of ``root``: (the first that verifies or None, the skipped
    newer ones with their reasons), each skip logged."""
    skipped = {}
    for tag in reversed(step_tags(root)):
        problem = verify(os.path.join(root, tag), world_size)
        if problem is None:
            return tag, skipped
        skipped[tag] = problem
        log.warning("checkpoint %s skipped: %s", tag, problem)
    return None, skipped


def find_checkpoint(run_dir: str, resume: str | None, world_size: int) -> Found | None:
    """The verified checkpoint to resume from (see the module docstring); ``None`` for a fresh start."""
    if resume is None:
        return None
    if resume != "auto":
        path = os.path.abspath(resume.rstrip("/"))
        problem = verify(path, world_size)
        if problem is not None:
            raise CheckpointError(f"--resume {resume}: {problem}")
        return Found(os.path.dirname(path), os.path.basename(path))
    root = checkpoint_dir(run_dir)
    pointer, why = read_pointer(root)
    if why is not None and os.path.isdir(root):
        log.warning("resume: ignoring %s (%s); looking at the checkpoint folders themselves", LATEST, why)
    tag, skipped = newest_verified(root, world_size)
    if tag is not None:
        note = "" if pointer in (None, tag) else f" ({LATEST} said {pointer})"
        log.info("resume: from %s%s", os.path.join(root, tag), note)
        return Found(root, tag, skipped)
    if skipped or holds_a_run(run_dir):
        reasons = "; ".join(f"{t}: {p}" for t, p in skipped.items()) or f"no checkpoint folder in {root}"
        raise CheckpointError(f"--resume auto: no checkpoint of {run_dir} verifies ({reasons})")
    log.info("resume: %s has no checkpoint yet; starting at step 0", run_dir)
    return None


def set_aside_newer(found: Found, run_dir: str) -> None:
    """Rename the skipped (newer, unverified) checkpoints ``rejected-<tag>`` and point ``latest_complete`` at
    ``found``; rank 0 only, and only in ``run_dir``'s own checkpoint folder (never another run's)."""
    if os.path.abspath(found.root) != os.path.abspath(checkpoint_dir(run_dir)):
        return
    for tag in found.skipped:
        target = os.path.join(found.root, REJECTED_PREFIX + tag)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(os.path.join(found.root, tag), target)
        log.warning("resume: %s set aside as %s", tag, target)
    write_text_atomic(os.path.join(found.root, LATEST), found.tag)


def truncate_metrics(run_dir: str, step: int) -> int:
    """Drop the ``metrics.jsonl`` records after ``step`` (written after the checkpoint, before the crash); returns
    how many were dropped. Unparseable lines (a write cut by the crash) are dropped too."""
    path = os.path.join(run_dir, METRICS)
    if not os.path.isfile(path):
        return 0
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    kept = []
    for line in lines:
        try:
            if int(json.loads(line)["step"]) <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            pass
    if len(kept) != len(lines):
        write_text_atomic(path, "".join(f"{line}\n" for line in kept))
        log.info("resume: dropped %d %s records after step %d", len(lines) - len(kept), METRICS, step)
    return len(lines) - len(kept)
