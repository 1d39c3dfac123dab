"""Helpers for the tests that launch ``scripts/train_vlm.py`` (plain python or the deepspeed launcher) on the tiny
config and read what the run wrote."""

import json
import os
import signal
import subprocess
import sys
import time
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
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "make_shards.py"),
        "--synthetic",
        "scenes,text",
        "--out",
        str(out),
        "--num-samples",
        "48",
        "--seed",
        "0",
    ]
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
    proc = subprocess.run(
        train_cmd(*args, **kwargs), capture_output=True, text=True, env=env(), timeout=timeout, cwd=ROOT
    )
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


def torchrun_node_cmd(run_dir, shards, node_rank: int, port: int, nnodes: int = 2, **kwargs) -> list[str]:
    """One "node" of a multi-node run simulated on this host: ``torchrun`` with one process, rendezvous at
    127.0.0.1:``port``; ``kwargs`` as ``train_cmd``'s (``zero``, ``resume``, train fields)."""
    head = [
        str(VENV_BIN / "torchrun"),
        "--nnodes",
        str(nnodes),
        "--nproc_per_node",
        "1",
        "--node_rank",
        str(node_rank),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
    ]
    return head + train_cmd(run_dir, shards, launcher="python", **kwargs)[1:]


def node_log(run_dir, node_rank: int) -> Path:
    """Where ``start_nodes`` writes a node's output (appended to, so a resume adds to it)."""
    return Path(run_dir).parent / f"{Path(run_dir).name}-node{node_rank}.log"


def start_nodes(run_dir, shards, port: int, nnodes: int = 2, **kwargs) -> list[subprocess.Popen]:
    """Start every node of a simulated multi-node run, each in its own session (``os.killpg`` ends one node);
    output goes to ``node_log`` files, never a pipe nobody drains."""
    procs = []
    for rank in range(nnodes):
        with open(node_log(run_dir, rank), "a") as log:
            cmd = torchrun_node_cmd(run_dir, shards, rank, port, nnodes, **kwargs)
            procs.append(subprocess.Popen(cmd, env=env(), cwd=ROOT, start_new_session=True, stdout=log, stderr=log))
    return procs


def wait_nodes(procs, run_dir, timeout=240) -> None:
    """Wait for every node; a node that fails (or runs past ``timeout``) fails the test with its log's tail."""
    for rank, proc in enumerate(procs):
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                kill_node(p)
            rc = "timeout"
        assert rc == 0, f"node {rank}: {rc}\n" + node_log(run_dir, rank).read_text()[-3000:]


def kill_node(proc: subprocess.Popen) -> None:
    """SIGKILL a whole simulated node at once: the ``torchrun`` agent and every process under it (torchrun starts
    its workers in sessions of their own, so killing the agent's process group alone would leave them running)."""
    import psutil

    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    deadline = time.time() + 30
    while time.time() < deadline and not all(_dead(p) for p in tree):
        time.sleep(0.05)


def _dead(p) -> bool:
    """Gone or a zombie (a killed worker whose agent died first is reaped by init, maybe late)."""
    import psutil

    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
