"""vlm/training/held_out.py and scripts/eval_shards.py: an export's held-out loss on shards is the training loop's
own eval on the same rows, the same for every call, and tells a model that learned the shards from one that did
not."""

import itertools
import json
import subprocess
import sys

import pytest
import torch
from train_kit import ROOT, env

from data_pipelines.make_shards import make_synthetic
from data_pipelines.tokenizer import load_tokenizer
from vision_tower import ImageProcessor
from vlm import ConceptMoEVLM, VLMProcessor
from vlm.training.held_out import held_out_loss, markdown
from vlm.training.loop import make_loader


def _export(out, seed: int):
    torch.manual_seed(seed)
    processor = VLMProcessor(load_tokenizer(), ImageProcessor(max_patches=16))
    model = ConceptMoEVLM.from_preset(
        "tiny", image_token_id=processor.image_token_id, vocab_size=len(processor.tokenizer), max_patches=16
    )
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return model, processor


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("held_out")
    make_synthetic(["copying_chat", "scenes_chat"], str(root / "shards"), num_samples=24, seed=0, eval_samples=8)
    model, processor = _export(root / "a", seed=0)
    _export(root / "b", seed=1)
    return root, model, processor


def test_loss_is_the_loss_on_the_loaders_rows_and_repeats(setup):
    root, model, processor = setup
    shards = [str(root / "shards" / "eval")]
    first = held_out_loss(root / "a", shards, seq_len=256, batch_size=2, batches=2)
    assert first == held_out_loss(root / "a", shards, seq_len=256, batch_size=2, batches=2)  # same rows each call
    config = {
        "data": {
            "shards": shards,
            "seq_len": 256,
            "batch_size": 2,
            "num_workers": 0,
            "max_patches": 16,
            "loss_on": "auto",
        },
        "train": {"seed": 0},
    }
    batches = list(itertools.islice(make_loader(config, processor, shards, rank=0, world_size=1, shuffle=False), 2))
    total, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            out = model.eval()(**b)
            n = int((b["labels"][:, 1:] != -100).sum())
            total, count = total + out.aux["lm_loss"].item() * n, count + n
    assert first.tokens == count and first.loss == pytest.approx(total / count, rel=1e-5)
    assert first.r_image is not None and first.r_text is not None  # scenes and text both scored
    other = held_out_loss(root / "b", shards, seq_len=256, batch_size=2, batches=2)
    assert other.tokens == first.tokens and other.loss != first.loss  # another model, the same rows
    assert "| `" in markdown([first, other]) and markdown([first, other]).count("\n") == 4


def test_bad_input_is_one_clear_error(setup, tmp_path):
    root, _, _ = setup
    with pytest.raises(ValueError, match="no saved model"):
        held_out_loss(tmp_path, [str(root / "shards" / "eval")], 256, 2)
    with pytest.raises(FileNotFoundError):
        held_out_loss(root / "a", [str(tmp_path / "missing")], 256, 2)


def test_script_prints_and_writes_rows_and_exits_2_on_bad_input(setup, tmp_path):
    root, _, _ = setup
    run = [sys.executable, str(ROOT / "scripts" / "eval_shards.py"), "--seq-len", "256", "--batch-size", "2"]
    out = tmp_path / "rows.json"
    shards = ["--shards", str(root / "shards" / "eval")]
    proc = subprocess.run(
        [*run, str(root / "a"), str(root / "b"), *shards, "--batches", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env(),
        cwd=ROOT,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [r["pretrained"] for r in rows] == [str(root / "a"), str(root / "b")] and proc.stdout.count("| `") == 2
    bad = subprocess.run([*run, str(tmp_path), *shards], capture_output=True, text=True, env=env(), cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("eval_shards: error:")
