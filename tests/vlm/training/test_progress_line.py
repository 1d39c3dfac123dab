"""The rank-0 progress line of ``scripts/train_vlm.py`` (``vlm.training.metrics.MetricsWriter``): a step that ran the
held-out eval prints its line, whatever ``log_every`` says, with the eval loss and eval-mode R that metrics.jsonl
records for it."""

import json
import re

from train_kit import run_train


def test_the_eval_steps_line_carries_the_eval_loss_and_r(shards, tmp_path):
    run = tmp_path / "run"
    proc = run_train(run, shards, max_steps=3, eval_every=2, log_every=3, save_every=3, export="false")
    lines = {int(m.group(1)): line for line in proc.stderr.splitlines() if (m := re.search(r" step (\d+)/3 ", line))}
    assert sorted(lines) == [2, 3]  # step 1 is not a log_every step; step 2 ran the eval, step 3 is the last
    evals = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines() if '"split": "eval"' in r]
    assert [e["step"] for e in evals] == [2]
    want = f"| eval loss {evals[0]['eval_loss']:.4f} R {evals[0]['eval_r']:.2f}"
    assert lines[2].endswith(want), lines[2]
    assert " loss " in lines[2].split("|")[0] and "eval" not in lines[3]  # the training figures stay first
