"""``scripts/eval_ppl.py``'s progress: a bar of the batches on a terminal, none with ``--quiet``, the same numbers."""

import importlib.util
import json
from pathlib import Path

import pytest
from terminal_kit import Terminal

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "eval_ppl.py"


def _script():
    spec = importlib.util.spec_from_file_location("eval_ppl_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("quiet", [False, True])
def test_progress_bar_counts_the_batches_unless_quiet(tiny_checkpoint, monkeypatch, capsys, quiet):
    from eval.ppl import evaluate_ppl

    expected = evaluate_ppl(str(tiny_checkpoint), seq_len=32, batch_size=8, max_docs=2)
    batches = -(-expected["windows"] // 8)
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    argv = [str(tiny_checkpoint), "--seq-len", "32", "--batch-size", "8", "--max-docs", "2"] + ["--quiet"] * quiet
    assert _script().main(argv) == 0
    assert json.loads(capsys.readouterr().out) == expected  # the bar changes nothing the script reports
    if quiet:
        assert terminal.getvalue() == ""
    else:
        assert "ppl: 100%" in terminal.getvalue() and f"{batches}/{batches}" in terminal.getvalue()
