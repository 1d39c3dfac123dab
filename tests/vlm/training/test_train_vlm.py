"""scripts/train_vlm.py end to end (real deepspeed launches on tiny configs) and the training package's units:
config validation, non-finite-loss skipping, ZeRO-2/3 checkpoints, exact resume after kill -9, HF export."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from train_kit import ROOT, TINY, env, run_train, step_records, train_cmd

from vlm.training.build import build_model
from vlm.training.config import ConfigError, load_config
from vlm.training.manifest import verify
from vlm.training.single_process import LocalEngine
from vlm.training.step import NonFiniteGuard, NonFiniteLossError, train_step


def test_wrong_config_field_fails_at_start_with_one_line_error(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "train_vlm.py"),
            "--config",
            str(TINY),
            "--out",
            str(tmp_path / "run"),
            "--set",
            "train.learning_rate=1e-3",
        ],
        capture_output=True,
        text=True,
        env=env(),
        timeout=60,
    )
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "train.learning_rate" in proc.stderr
    with pytest.raises(ConfigError, match=r"'train.max_steps' must be int, got str"):
        load_config(str(TINY), ["train.max_steps=many"])
    with pytest.raises(ConfigError, match=r"'data.batch_size' must be >= 1"):
        load_config(str(TINY), ["data.batch_size=0"])
    assert load_config(str(TINY), ["train.lr=1e-3", "model.overrides={target_r: 1.5}"])["train"]["lr"] == 1e-3


def test_nonfinite_loss_skips_step_counts_and_stops(shards):
    config = load_config(
        str(TINY), [f"data.shards=[{shards / 'train'}]", "model.overrides={boundary_router_init: random}"]
    )
    model, processor = build_model(config)
    batch = dict(processor(text=["a red square on the left"], images=[[]], return_tensors="pt"))
    batch = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "modality_ids")}
    batch["labels"] = batch["input_ids"].clone()
    engine, guard = LocalEngine(model, lr=1e-2), NonFiniteGuard(limit=3)
    before = [p.detach().clone() for p in model.parameters()]
    poison = model.get_output_embeddings().register_forward_hook(lambda m, i, out: out * float("nan"))
    assert train_step(engine, [batch], guard, step=1) is None  # skipped: no backward, no optimiser step
    assert engine.global_steps == 0 and guard.total == 1 and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    poison.remove()
    stats = train_step(engine, [batch], guard, step=2)
    assert stats is not None and engine.global_steps == 1 and guard.in_a_row == 0 and guard.total == 1
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # this one did step
    model.get_output_embeddings().register_forward_hook(lambda m, i, out: out * float("inf"))
    assert train_step(engine, [batch], guard, step=3) is None
    assert train_step(engine, [batch], guard, step=4) is None
    with pytest.raises(NonFiniteLossError, match="3 optimiser steps in a row"):
        train_step(engine, [batch], guard, step=5)


def test_two_process_deepspeed_zero2_trains_checkpoints_and_logs(shards, tmp_path):
    run = tmp_path / "run"
    run_train(
        run, shards, launcher="deepspeed", zero=2, max_steps=3, save_every=2, eval_every=2, grad_accum=2, export="false"
    )
    records = step_records(run)
    assert sorted(records) == [1, 2, 3]
    for rec in records.values():
        for key in (
            "step",
            "loss",
            "lm_loss",
            "ratio_loss",
            "balance_loss",
            "r",
            "r_text",
            "r_image",
            "tokens_per_s",
            "lr",
            "target_r",
        ):
            assert key in rec, key
        by_m = rec["tokens_by_modality"]
        assert by_m["0"] + by_m["1"] == rec["tokens"]
        assert rec["r"] == pytest.approx(rec["tokens"] / rec["concepts"])
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"split": "eval"' in line]
    assert evals and all(e["eval_r"] >= 1.0 and e["eval_r_text"] >= 1.0 for e in evals)  # eval-mode R, no noise
    assert all(e["eval_r_image"] is None or e["eval_r_image"] >= 1.0 for e in evals)
    ckpt = run / "checkpoints"
    assert (ckpt / "latest_complete").read_text() == "step_00000003"
    assert sorted(p.name for p in (ckpt / "step_00000003").glob("rank_state_*")) == [
        "rank_state_00000.json",
        "rank_state_00001.json",
    ]
    assert verify(str(ckpt / "step_00000003"), world_size=2) is None  # the manifest lists both ranks' files
    assert (run / "config.yaml").is_file()


def test_zero3_save_load_and_export_reloads(shards, tmp_path):
    """ZeRO-3 on two processes: save, resume from it, export the gathered weights; the HF folder reloads with the
    Auto classes and gives the same logits as the checkpoint's weights. (Every rank runs the vision tower even on
    a text-only batch, so ZeRO-3's per-module gathers stay in step across ranks.)"""
    from transformers import AutoModelForImageTextToText

    from vlm import VLMProcessor
    from vlm.training.export import export_checkpoint, full_state_dict

    run = tmp_path / "run"
    run_train(run, shards, launcher="deepspeed", zero=3, max_steps=2, save_every=2, export="false")
    run_train(run, shards, launcher="deepspeed", zero=3, resume="auto", max_steps=3, save_every=3, export="false")
    records = step_records(run)
    assert sorted(records) == [1, 2, 3]
    out = export_checkpoint(str(run), str(tmp_path / "hf"))
    config = load_config(str(run / "config.yaml"))
    model, _ = build_model(config)
    model.load_state_dict(full_state_dict(str(run / "checkpoints"), "step_00000003"), strict=False)
    model.tie_weights()
    reloaded = AutoModelForImageTextToText.from_pretrained(out).eval()
    processor = VLMProcessor.from_pretrained(out)
    batch = processor(text=["a blue circle", "two red squares"], images=[[], []], return_tensors="pt")
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "modality_ids")}
    with torch.no_grad():
        assert torch.equal(model.eval()(**inputs).logits, reloaded(**inputs).logits)
    # the export's model card: what the run was (vlm.model_card; loading elsewhere: tests/vlm/test_hub_code.py)
    card = (tmp_path / "hf" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\npipeline_tag: image-text-to-text\n")
    assert "at step_00000003" in card and "| steps | 3 |" in card and "vlm_model.ConceptMoEVLM" not in card
    assert "auto_map" in (tmp_path / "hf" / "config.json").read_text()


@pytest.mark.parametrize("launcher", ["python", "deepspeed"])
def test_kill_9_then_resume_auto_gives_identical_losses(shards, tmp_path, launcher):
    """ZeRO-2, one process (plain python) or two (deepspeed launcher): the whole process group is killed with
    SIGKILL at an arbitrary point after step 3 was logged; ``--resume auto`` then repeats the reference's losses."""
    args = dict(launcher=launcher, zero=2, max_steps=6, save_every=2, export="false")
    reference = tmp_path / "reference"
    run_train(reference, shards, **args)
    run = tmp_path / "killed"
    proc = subprocess.Popen(
        train_cmd(run, shards, **args),
        env=env(),
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    metrics, deadline = run / "metrics.jsonl", time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(step_records(run)) < 6
    run_train(run, shards, resume="auto", **args)
    got, want = step_records(run), step_records(reference)
    assert sorted(got) == sorted(want) == list(range(1, 7))
    assert [got[s]["loss"] for s in got] == [want[s]["loss"] for s in want]


def test_init_from_a_text_checkpoint_or_a_vlm_checkpoint(shards, tmp_path):
    """``model.init_from``: a text-only ConceptMoE (e.g. a converted MoE) gets a fresh vision tower, a VLM folder
    is continued as it is; only training-time fields may be overridden; a real run trains from it."""
    from data_pipelines import load_tokenizer
    from vlm import ConceptMoEConfig, ConceptMoEForCausalLM

    torch.manual_seed(3)
    text = ConceptMoEForCausalLM(
        ConceptMoEConfig.from_preset("tiny", vocab_size=len(load_tokenizer()), boundary_router_init="random")
    )
    text.save_pretrained(tmp_path / "text")
    base = [f"data.shards=[{shards / 'train'}]", f"model.init_from={tmp_path / 'text'}"]
    config = load_config(str(TINY), base + ["model.overrides={target_r: 1.5}"])
    model, processor = build_model(config)
    assert model.config.image_token_id == processor.image_token_id
    assert model.language_model.config.target_r == 1.5
    for name, value in text.state_dict().items():
        assert torch.equal(model.language_model.state_dict()[name], value), name
    model.save_pretrained(tmp_path / "vlm")
    again, _ = build_model(load_config(str(TINY), [base[0], f"model.init_from={tmp_path / 'vlm'}"]))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    with pytest.raises(ConfigError, match="d_model"):
        build_model(load_config(str(TINY), base + ["model.overrides={d_model: 8}"]))
    with pytest.raises(ConfigError, match="not a saved model folder"):
        build_model(load_config(str(TINY), [base[0], f"model.init_from={tmp_path / 'missing'}"]))
    run = tmp_path / "run"
    proc = subprocess.run(
        train_cmd(run, shards, max_steps=2, save_every=2, export="false")
        + ["--set", f"model.init_from={tmp_path / 'text'}"],
        capture_output=True,
        text=True,
        env=env(),
        timeout=240,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(step_records(run)) == [1, 2]
