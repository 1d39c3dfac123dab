"""Resume that never starts over, checkpoints that are verified before they are trusted, and run files that are never
executed: units on hand-made checkpoint folders, then real runs of scripts/train_vlm.py with faults injected."""

import json
import logging
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from train_kit import ROOT, env, run_train, step_records

from vlm.training import checkpoint
from vlm.training.checkpoint import CheckpointError, prune
from vlm.training.manifest import MANIFEST, verify, write_manifest
from vlm.training.resume import (
    find_checkpoint,
    prepare_run_dir,
    read_pointer,
    set_aside_newer,
    truncate_metrics,
)
from vlm.training.safe_load import UnsafeCheckpointError, load_weights

MARKER = "/tmp/conceptmoe_vlm_payload_ran"


class Payload:
    """Unpickling this runs a shell command: what a tampered checkpoint file would hold."""

    def __reduce__(self):
        return os.system, (f"touch {MARKER}",)


def fake_checkpoint(root: Path, step: int, world_size: int = 1) -> Path:
    folder = root / checkpoint.tag_for(step)
    folder.mkdir(parents=True)
    torch.save({"module": {"w": torch.full((4,), float(step))}}, folder / "mp_rank_00_model_states.pt")
    for rank in range(world_size):
        (folder / checkpoint.rank_state_file(rank)).write_text(json.dumps({"loader": {"next": step}}))
    write_manifest(str(folder), step, world_size)
    return folder


# -- units ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fault, reason",
    [
        (lambda f: (f / "rank_state_00000.json").unlink(), "rank_state_00000.json missing"),
        (lambda f: os.truncate(f / "mp_rank_00_model_states.pt", 100), "has 100 bytes"),
        (lambda f: (f / "rank_state_00000.json").write_text(json.dumps({"loader": {"next": 9}})), "checksum"),
        (lambda f: (f / MANIFEST).unlink(), "no manifest.json"),
        (lambda f: (f / MANIFEST).write_bytes(b"\xff\xfe{"), "unreadable"),
        (lambda f: (f / MANIFEST).write_text('{"format": 1}'), "unreadable"),
    ],
    ids=["deleted", "half_size", "changed", "no_manifest", "manifest_not_utf8", "manifest_incomplete"],
)
def test_verify_names_each_fault_in_one_line(tmp_path, fault, reason):
    folder = fake_checkpoint(tmp_path, 2)
    assert verify(str(folder), world_size=1) is None
    fault(folder)
    problem = verify(str(folder), world_size=1)
    assert problem is not None and reason in problem and "\n" not in problem


def test_verify_checks_the_world_size(tmp_path):
    folder = fake_checkpoint(tmp_path, 2, world_size=2)
    assert verify(str(folder), world_size=2) is None
    assert "written by 2 ranks, this run has 1" in verify(str(folder), world_size=1)


@pytest.mark.parametrize(
    "content, why",
    [
        (b"garbage", "not a checkpoint tag"),
        (b"", "not a checkpoint tag"),
        (b"step_00000099", "does not exist"),
        (b"\xff\xfe\x00", "not text"),
        (None, "missing"),
        ("other_run", "not a checkpoint tag"),
    ],
)
def test_pointer_must_name_a_checkpoint_of_this_run(tmp_path, content, why):
    root = tmp_path / "run" / "checkpoints"
    fake_checkpoint(root, 2)
    other = fake_checkpoint(tmp_path / "other" / "checkpoints", 2)
    if content == "other_run":
        content = str(other).encode()
    if content is not None:
        (root / checkpoint.LATEST).write_bytes(content)
    tag, reason = read_pointer(str(root))
    assert tag is None and why in reason
    (root / checkpoint.LATEST).write_text("step_00000002\n")
    assert read_pointer(str(root)) == ("step_00000002", None)


def test_resume_auto_walks_back_to_the_newest_verified_and_sets_the_others_aside(tmp_path, caplog):
    run = tmp_path / "run"
    root = run / "checkpoints"
    for step in (2, 4, 6):
        fake_checkpoint(root, step)
    os.truncate(root / "step_00000004" / "mp_rank_00_model_states.pt", 10)
    (root / "step_00000006" / MANIFEST).unlink()  # killed before the manifest: an interrupted write
    (root / checkpoint.LATEST).write_text(str(tmp_path / "elsewhere"))
    with caplog.at_level(logging.INFO):
        found = find_checkpoint(str(run), "auto", world_size=1)
    assert found.tag == "step_00000002" and list(found.skipped) == ["step_00000006", "step_00000004"]
    log = caplog.text
    assert "ignoring latest_complete" in log and "step_00000006 skipped: no manifest.json" in log
    assert "step_00000004 skipped: mp_rank_00_model_states.pt has 10 bytes" in log
    set_aside_newer(found, str(run))
    assert sorted(p.name for p in root.iterdir()) == [
        "latest_complete",
        "rejected-step_00000004",
        "rejected-step_00000006",
        "step_00000002",
    ]
    assert read_pointer(str(root)) == ("step_00000002", None)


def test_resume_auto_never_starts_over_silently(tmp_path):
    run = tmp_path / "run"
    assert find_checkpoint(str(run), "auto", world_size=1) is None  # nothing there yet: a fresh start
    fake_checkpoint(run / "checkpoints", 2)
    (run / "checkpoints" / "step_00000002" / "rank_state_00000.json").unlink()
    with pytest.raises(CheckpointError, match=r"no checkpoint of .* verifies \(step_00000002: rank_state_00000"):
        find_checkpoint(str(run), "auto", world_size=1)
    shutil.rmtree(run / "checkpoints")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')  # trained, but every checkpoint is gone
    with pytest.raises(CheckpointError, match="no checkpoint folder"):
        find_checkpoint(str(run), "auto", world_size=1)
    with pytest.raises(CheckpointError, match="--resume .*not a folder"):
        find_checkpoint(str(run), str(tmp_path / "nowhere"), world_size=1)


def test_a_used_run_folder_needs_resume_or_overwrite(tmp_path):
    run = tmp_path / "run"
    prepare_run_dir(str(run), None, overwrite=False, is_rank0=True)  # new folder: fine
    fake_checkpoint(run / "checkpoints", 2)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="already holds a run.*--resume auto.*--overwrite"):
        prepare_run_dir(str(run), None, overwrite=False, is_rank0=True)
    with pytest.raises(CheckpointError, match="exclude each other"):
        prepare_run_dir(str(run), "auto", overwrite=True, is_rank0=True)
    prepare_run_dir(str(run), "auto", overwrite=False, is_rank0=True)  # resuming: left as it is
    assert (run / "checkpoints").is_dir()
    prepare_run_dir(str(run), None, overwrite=True, is_rank0=True)
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]


def test_prune_keeps_the_newest_and_never_the_one_just_written(tmp_path):
    for step in (2, 4, 6, 8):
        fake_checkpoint(tmp_path, step)
    (tmp_path / "tmp-step_00000010").mkdir()
    prune(str(tmp_path), keep_last=2, keep="step_00000006")  # resumed at 6; 8 is newer (set aside or not)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004", "step_00000006", "step_00000008"]


def test_truncate_metrics_keeps_each_step_once(tmp_path):
    lines = [json.dumps({"step": s}) for s in (1, 2, 3)] + [json.dumps({"step": 2, "split": "eval"})]
    lines += [json.dumps({"step": s}) for s in (4, 5)] + ['{"step": 6, "lo']  # cut by the kill
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert truncate_metrics(str(tmp_path), 3) == 3
    kept = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kept] == [1, 2, 3, 2]


def test_rank_state_is_json_and_restores_every_rng():
    state = json.loads(json.dumps(checkpoint.rng_state()))
    want = (random.random(), np.random.rand(), torch.rand(1))
    checkpoint.set_rng_state(state)
    got = (random.random(), np.random.rand(), torch.rand(1))
    assert want[:2] == got[:2] and torch.equal(want[2], got[2])


def test_weights_only_loading_refuses_a_payload_and_loads_deepspeed_classes(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    Path(MARKER).unlink(missing_ok=True)
    torch.save({"module": {"w": torch.ones(2)}, "extra": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(UnsafeCheckpointError, match="refusing to load") as err:
        load_weights(str(tmp_path / "evil.pt"))
    assert "\n" not in str(err.value) and not os.path.exists(MARKER)
    torch.save({"stage": ZeroStageEnum.gradients, "scaler": LossScaler(1.0)}, tmp_path / "ds.pt")
    loaded = load_weights(str(tmp_path / "ds.pt"))
    assert loaded["stage"] == ZeroStageEnum.gradients and loaded["scaler"].cur_scale == 1.0


# -- real runs ----------------------------------------------------------------------------------------------------

ARGS = dict(zero=2, max_steps=4, save_every=2, keep_last=3, export="false")


@pytest.fixture(scope="module")
def base_run(shards, tmp_path_factory):
    """Four steps, checkpoints at 2 and 4; each test works on a copy."""
    run = tmp_path_factory.mktemp("resume") / "base"
    run_train(run, shards, **ARGS)
    return run


def copy_of(base_run, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    return run


def one_line_error(proc) -> str:
    """The error: the last line of stderr, the only one starting ``error:``, no traceback (log lines may precede)."""
    lines = proc.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert errors == lines[-1:] and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return lines[-1]


def test_resume_past_a_broken_checkpoint_repeats_the_uninterrupted_run(base_run, shards, tmp_path):
    run = copy_of(base_run, tmp_path)
    model_states = run / "checkpoints" / "step_00000004" / "mp_rank_00_model_states.pt"
    os.truncate(model_states, model_states.stat().st_size // 2)
    (run / "checkpoints" / checkpoint.LATEST).write_text("garbage")
    proc = run_train(run, shards, resume="auto", **ARGS)
    assert "step_00000004 skipped: mp_rank_00_model_states.pt has" in proc.stderr
    assert "resumed from" in proc.stderr and "at step 2" in proc.stderr
    got, want = step_records(run), step_records(base_run)  # each step once: the records after step 2 were dropped
    assert sorted(got) == [1, 2, 3, 4] and [got[s]["loss"] for s in got] == [want[s]["loss"] for s in want]
    assert (run / "checkpoints" / "rejected-step_00000004").is_dir()
    assert verify(str(run / "checkpoints" / "step_00000004"), world_size=1) is None


def test_no_verified_checkpoint_stops_with_one_line_and_deletes_nothing(base_run, shards, tmp_path):
    run = copy_of(base_run, tmp_path)
    (run / "checkpoints" / "step_00000002" / "rank_state_00000.json").unlink()
    os.truncate(run / "checkpoints" / "step_00000004" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", 64)
    metrics = (run / "metrics.jsonl").read_text()
    line = one_line_error(run_train(run, shards, resume="auto", expect_rc=2, **ARGS))
    assert "no checkpoint of" in line and "step_00000004: zero_pp_rank_0" in line
    assert (run / "metrics.jsonl").read_text() == metrics
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000002", "step_00000004"]


def test_an_existing_run_folder_is_refused_without_resume_or_overwrite(base_run, shards, tmp_path):
    run = copy_of(base_run, tmp_path)
    line = one_line_error(run_train(run, shards, expect_rc=2, **ARGS))
    assert "already holds a run" in line
    run_train(run, shards, flags=["--overwrite"], **{**ARGS, "max_steps": 2})
    assert sorted(step_records(run)) == [1, 2]
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000002"]


def plant_payload(folder: Path, name: str) -> None:
    """Add an os.system payload to a checkpoint file and re-write the manifest, as an attacker who controls the
    whole folder would: verification passes, only the restricted unpickler stands in the way."""
    path = folder / name
    state = torch.load(path, weights_only=False)
    state["note"] = Payload()
    torch.save(state, path)
    write_manifest(str(folder), checkpoint.step_of(folder.name), 1)


@pytest.mark.parametrize("name", ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"])
def test_a_planted_pickle_never_runs_on_resume_or_export(base_run, shards, tmp_path, name):
    from vlm.training.export import main as export_main

    run = copy_of(base_run, tmp_path)
    plant_payload(run / "checkpoints" / "step_00000004", name)
    Path(MARKER).unlink(missing_ok=True)
    line = one_line_error(run_train(run, shards, resume="auto", expect_rc=2, **{**ARGS, "max_steps": 6}))
    assert "refusing to load" in line and name in line and not os.path.exists(MARKER)
    proc = subprocess.run(
        [sys.executable, "-m", "vlm.training.export", str(run), "--out", str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        env=env(),
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2 and "refusing to load" in one_line_error(proc) and not os.path.exists(MARKER)
    assert export_main([str(run), "--tag", "step_00000002", "--out", str(tmp_path / "hf")]) == 0  # the clean one
