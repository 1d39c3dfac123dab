"""The model card of an export (``vlm.model_card``): HF's format, the config's numbers, the training summary read
from a run's files, and the evaluation section that ``scripts/score_table.py`` replaces."""

import json

import yaml

from vlm.config import ConceptMoEVLMConfig
from vlm.model_card import NO_SCORES, SCORES_END, SCORES_START, render, set_scores, write_card
from vlm.training.export import training_summary


def test_card_is_hf_metadata_then_the_configs_numbers(tmp_path):
    config = ConceptMoEVLMConfig.from_preset("tiny", target_r=3.0, vision_stem="conv")
    text = render(config, 1_234_567, "a run")
    _, meta, body = text.split("---\n", 2)
    assert yaml.safe_load(meta) == {
        "library_name": "transformers",
        "pipeline_tag": "image-text-to-text",
        "tags": ["conceptmoe", "mixture-of-experts", "vision-language", "custom_code"],
    }
    assert body.startswith("\n# a run\n")
    assert "| target R (tokens per concept) | 3.0 |" in body and "| chunking | dynamic |" in body
    assert "1.23 M" in body and "3 convolutions per patch" in body and "trust_remote_code=True" in body
    assert "## Training" not in body  # no run: no training section
    fixed = render(ConceptMoEVLMConfig.from_preset("tiny", chunking="none"), 1, "baseline")
    assert "| chunking | none |" in fixed and "target R (tokens per concept)" not in fixed
    assert "boundary forced" not in body
    forced = render(ConceptMoEVLMConfig.from_preset("tiny", boundary_token_ids=[7, 9]), 1, "forced")
    assert "| boundary forced on token ids | 7, 9 |" in forced
    every = render(ConceptMoEVLMConfig.from_preset("tiny", boundary_token_ids=list(range(20))), 1, "every")
    assert "| boundary forced on token ids | 0, 1, 2, 3, 4, 5, 6, 7, ... (20 ids) |" in every


def test_scores_section_is_replaced_not_appended(tmp_path):
    write_card(tmp_path, ConceptMoEVLMConfig.from_preset("tiny"), 10, "x")
    assert NO_SCORES in (tmp_path / "README.md").read_text()
    assert set_scores(tmp_path, "| task | score |\n|---|---|\n| a | 0.5 |\n")
    assert set_scores(tmp_path, "| task | score |\n|---|---|\n| a | 0.9 |\n")
    text = (tmp_path / "README.md").read_text()
    assert text.count(SCORES_START) == text.count(SCORES_END) == 1
    assert "| a | 0.9 |" in text and "| a | 0.5 |" not in text and NO_SCORES not in text
    assert text.index("## Evaluation") < text.index("| a | 0.9 |") < text.index("## How to load")
    (tmp_path / "other").mkdir()
    assert not set_scores(tmp_path / "other", "x")  # no card: nothing written
    (tmp_path / "other" / "README.md").write_text("# someone else's card\n")
    assert not set_scores(tmp_path / "other", "x")
    assert (tmp_path / "other" / "README.md").read_text() == "# someone else's card\n"


def test_training_summary_reads_the_run_up_to_the_exported_step(tmp_path):
    config = {
        "model": {"preset": "tiny", "init_from": "runs/stage1/hf"},
        "data": {
            "shards": ["data/a/train", "data/b/train"],
            "eval_shards": ["data/a/eval"],
            "seq_len": 512,
            "loss_on": "auto",
        },
        "train": {"lr": 1e-3},
    }
    rows = [
        {"step": 9, "loss": 1.0, "r": 2.1, "r_text": 1.5, "r_image": 6.0},
        {"step": 10, "split": "eval", "eval_loss": 2.5, "eval_r": 2.4, "eval_r_text": 1.8, "eval_r_image": 7.0},
        {"step": 10, "loss": 1.0, "r": 2.0, "r_text": 1.6, "r_image": 5.0},
        {"step": 12, "loss": 1.0, "r": 9.0, "r_text": 9.0, "r_image": 9.0},  # after the exported step
    ]
    lines = [json.dumps(r) for r in rows] + ['{"step": 13, "lo']  # a line cut by a crash
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "ds_config.json").write_text(json.dumps({"train_batch_size": 8}))
    summary = training_summary(str(tmp_path), config, "step_00000010")
    assert summary["steps"] == 10 and summary["rows_per_step"] == 8 and summary["init_from"] == "runs/stage1/hf"
    assert summary["train_r"] == {"total": 2.0, "text": 1.6, "image": 5.0}
    assert summary["eval_r"] == {"total": 2.4, "text": 1.8, "image": 7.0} and summary["eval_loss"] == 2.5
    card = render(ConceptMoEVLMConfig.from_preset("tiny"), 10, "x", summary)
    assert "| R total / text / image, last held-out eval | 2.40 / 1.80 / 7.00 |" in card
    assert "`data/a/train`, `data/b/train`" in card and "| rows per step | 8 |" in card
