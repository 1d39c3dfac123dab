"""Helpers for the tests that launch ``scripts/train_vlm.py`` (plain python or the deepspeed launcher) on the tiny
config and read what the run wrote."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
VENV_BIN = Path(sys.executable).parent
TINY = ROOT / "scripts" / "configs" / "tiny.yaml"


def env(port: int | None = None) -> dict:
    e = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(key, None)
    if port is not None:
        e["MASTER_PORT"] = str(port)
    return e


def make_shards(out: Path) -> Path:
    cmd = [sys.executable, str(ROOT / "scripts" / "make_shards.py"), "--synthetic", "scenes,text", "--out", str(out),
           "--num-samples", "48", "--seed", "0"]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, env=env())
    return out


def overrides(shards, **train) -> list[str]:
    sets = [f"data.shards=[{shards / 'train'}]", f"data.eval_shards=[{shards / 'eval'}]", "data.seq_len=256"]
    sets += [f"train.{k}={v}" for k, v in train.items()]
    return [arg for s in sets for arg in ("--set", s)]


def train_cmd(run_dir, shards, launcher="python", zero=None, resume=None, flags=(), **train) -> list[str]:
    port = str(29700 + os.getpid() % 200)
    head = (
        [sys.executable]
        if launcher == "python"
        else [str(VENV_BIN / "deepspeed"), "--num_gpus", "2", "--master_port", port]
    )
    cmd = head + [str(ROOT / "scripts" / "train_vlm.py"), "--config", str(TINY), "--out", str(run_dir), *flags]
    if zero is not None:
        cmd += ["--deepspeed", str(ROOT / "scripts" / "configs" / f"zero{zero}.json")]
    if resume is not None:
        cmd += ["--resume", resume]
    return cmd + overrides(shards, **train)


def run_train(*args, timeout=240, expect_rc=0, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(train_cmd(*args, **kwargs), capture_output=True, text=True, env=env(), timeout=timeout,
                          cwd=ROOT)  # fmt: skip
    assert proc.returncode == expect_rc, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def step_records(run_dir) -> dict[int, dict]:
    """The training record of each step; a step logged twice (a resume that repeated it) fails the test."""
    records = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("split") != "eval":
            assert rec["step"] not in records, f"step {rec['step']} logged twice"
            records[rec["step"]] = rec
    return records
