"""The shipped instruction-tuning stages (``scripts/configs/stage1.yaml`` -> ``stage2.yaml``, as ``make demo`` runs
them) end to end at toy size: stage 1 on one-object colour / shape / position questions written with the
generator's options, stage 2 from stage 1's HF export, each exporting a model; ``stage2_long.yaml`` validates."""

import json
import subprocess
import sys

from train_kit import ROOT, env

from data_pipelines.make_shards import make_synthetic
from vlm.training.config import load_config

CONFIGS = ROOT / "scripts" / "configs"


def stage(config: str, out, shards, *sets: str) -> None:
    cmd = [sys.executable, str(ROOT / "scripts" / "train_vlm.py"), "--config", str(CONFIGS / config), "--out", str(out)]
    base = [
        f"data.shards=[{shards / 'train'}]",
        f"data.eval_shards=[{shards / 'eval'}]",
        "data.seq_len=256",
        "data.num_workers=0",
        "train.max_steps=2",
        "train.save_every=2",
        "train.log_every=1",
    ]
    for item in base + list(sets):
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "hf" / "config.json").is_file()


def test_stage1_then_stage2_train_and_export_at_toy_size(tmp_path):
    shards = tmp_path / "look"
    make_synthetic(
        ["scenes_chat"],
        str(shards),
        num_samples=24,
        seed=0,
        eval_samples=8,
        generator_options={"max_objects": 1, "types": ["colour", "shape", "position"]},
    )
    stage("stage1.yaml", tmp_path / "stage1", shards)
    stage(
        "stage2.yaml",
        tmp_path / "stage2",
        shards,
        f"model.init_from={tmp_path / 'stage1' / 'hf'}",
        "train.eval_every=2",
        "train.eval_batches=1",
    )
    steps = [json.loads(line) for line in (tmp_path / "stage2" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "loss" in s] == [1, 2] and any("eval_loss" in s for s in steps)
    assert load_config(str(CONFIGS / "stage2_long.yaml"))["train"]["max_steps"] == 1000
