"""The copying probe (vlm.training.copy_probe, scripts/probe_copying.py): its rows, its training loop, its CLI."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from vlm.backbone.config import ConceptMoEConfig
from vlm.backbone.model import ConceptMoEForCausalLM
from vlm.training.copy_probe import FIRST_TOKEN, CopyProbeConfig, check_config, copy_rows, run, train_copying


def main(argv):
    path = Path(__file__).resolve().parents[3] / "scripts" / "probe_copying.py"
    spec = importlib.util.spec_from_file_location("probe_copying", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.main(argv)


@pytest.mark.parametrize("max_gap", [0, 5])
def test_copy_rows_repeat_the_sequence_after_a_gap_and_label_only_the_predictable_copy(max_gap):
    cfg = CopyProbeConfig(vocab_size=40, length=6, max_gap=max_gap)
    ids_BT, labels_BT = copy_rows(cfg, 32, torch.Generator().manual_seed(0))
    assert ids_BT.shape == labels_BT.shape == (32, 2 * 6 + max_gap)
    assert ids_BT.min() >= FIRST_TOKEN and ids_BT.max() < 40
    starts = set()
    for ids, labels in zip(ids_BT, labels_BT, strict=True):
        labelled = (labels != -100).nonzero().flatten()
        start = int(labelled[0]) - 1  # the second copy's first token is not labelled: nothing predicts it
        starts.add(start)
        assert labelled.tolist() == list(range(start + 1, start + 6))
        assert torch.equal(ids[start : start + 6], ids[:6])
        assert torch.equal(labels[labelled], ids[labelled])
    assert starts <= set(range(6, 6 + max_gap + 1))
    assert (len(starts) == 1) == (max_gap == 0)  # a fixed distance without a gap, several distances with one


def test_the_probe_learns_a_fixed_distance_copy_on_a_small_vocabulary():
    scores = run(CopyProbeConfig(vocab_size=64, length=8, max_gap=0, steps=150, eval_every=150))
    assert len(scores) == 1
    assert scores[0].copied > 0.5, scores  # chance 1 / 54; two seeds gave 1.0 at 100 steps


def test_bad_settings_are_one_line_errors(capsys):
    with pytest.raises(ValueError, match="unknown backbone fields"):
        check_config(CopyProbeConfig(overrides={"tie_embeddings": True}))
    with pytest.raises(SystemExit):
        main(["--length", "1"])
    assert "need length >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--set", "d_model=wide"])
    assert "the value must be JSON" in capsys.readouterr().err


def test_the_cli_prints_and_appends_one_line_per_evaluation(tmp_path, capsys):
    out = tmp_path / "copy.jsonl"
    argv = ["--vocab-size", "32", "--length", "4", "--max-gap", "2", "--rows", "2", "--steps", "3", "--eval-every"]
    assert main([*argv, "2", "--set", "tie_word_embeddings=true", "--out", str(out)]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [p["step"] for p in printed] == [2, 3]
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [w["step"] for w in written] == [2, 3]
    assert written[0]["config"]["overrides"] == {"tie_word_embeddings": True}
    assert written[0]["chance"] == round(1 / (32 - FIRST_TOKEN), 6)


def test_train_copying_refuses_a_model_of_another_vocabulary():
    model = ConceptMoEForCausalLM(ConceptMoEConfig.from_preset("tiny-moe", vocab_size=48))
    with pytest.raises(ValueError, match="the model has 48 tokens, the copy rows 64"):
        train_copying(model, CopyProbeConfig(vocab_size=64, steps=1))
