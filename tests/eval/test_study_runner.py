"""``eval.study.runner.run_all``'s progress: one bar of the runs on a terminal (every outcome counts), none when
asked not to; the log lines keep going to stdout and the study log."""

import json

import pytest
from terminal_kit import Terminal

from eval.study.arms import Arm
from eval.study.collect import run_dir
from eval.study.runner import Log, run_all
from vlm import ConceptMoEConfig


@pytest.mark.parametrize("show_progress", [True, False])
def test_progress_bar_counts_every_run_once(tmp_path, monkeypatch, capsys, show_progress):
    config = ConceptMoEConfig.from_preset("tiny")
    arms = [Arm(name, config, {}, {}, None) for name in ("base", "chunked", "late")]
    study = {"out": str(tmp_path)}
    for name in ("base", "chunked"):  # finished before: never redone
        (run_dir(tmp_path, name, 0)).mkdir(parents=True)
        (run_dir(tmp_path, name, 0) / "result.json").write_text(json.dumps({"arm": name}))
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    log = Log(tmp_path / "study.log")
    outcomes = run_all(study, arms, seeds=1, jobs=2, budget_min=0.0, log=log, show_progress=show_progress)
    assert outcomes == {"base/seed0": "done", "chunked/seed0": "done", "late/seed0": "budget"}  # the budget is spent
    bars = terminal.getvalue()
    assert ("study: 100%" in bars and "3/3" in bars) if show_progress else "study" not in bars
    out = capsys.readouterr().out
    assert "late/seed0: not started, the budget is spent" in out
    assert "late/seed0: not started" in (tmp_path / "study.log").read_text()
