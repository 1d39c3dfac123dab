"""scripts/gpu_smoke.py stays runnable: CI has no GPU, so it runs the same checks on CPU at toy size (the real
proof is the script on a GPU; its output goes in docs/benchmarks.md)."""

import subprocess
import sys

import torch
from train_kit import ROOT, env


def smoke(*args, timeout=600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_smoke.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=ROOT, timeout=timeout)


def test_without_a_gpu_it_says_so_in_one_line():
    if torch.cuda.is_available():
        return
    proc = smoke("--out", "/nonexistent/never-written")
    assert proc.returncode == 1 and proc.stdout.strip().startswith("FAIL cuda") and len(proc.stdout.splitlines()) == 1


def test_every_check_passes_on_cpu_at_toy_size(tmp_path):
    proc = smoke(
        "--allow-cpu",
        "--out",
        str(tmp_path),
        "--preset",
        "tiny",
        "--steps",
        "4",
        "--seq-len",
        "256",
        "--samples",
        "16",
        "--bench-preset",
        "tiny-moe",
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("PASS", "FAIL", "SKIP"))]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [line.split()[:2] for line in lines] == [
        ["PASS", name] for name in ("shards", "train", "export", "generate", "bench")
    ] + [["SKIP", "expert_parallel"]]
    assert "resumed at 2" in lines[1] and "bf16" in lines[1]
