"""Vision pretraining (SigLIP, SuperClass) end to end: real shards in, a tower file the VLM loads out; bad input
counted.

The behaviour it buys (a VLM that reads shapes sooner) is measured by ``scripts/probe_seeing.py`` in docs/seeing.md.
"""

import importlib.util
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from data_pipelines.make_shards import make_synthetic
from vision_tower import ImageProcessor, VisionTower
from vlm import ConceptMoEVLM
from vlm.training.vision_pretraining import VisionPretrainConfig, pretrain_vision, region_targets

TOWER = {"vision_embed_dim": 32, "vision_depth": 1, "vision_heads": 2}


def load_script():
    path = Path(__file__).resolve().parents[3] / "scripts" / "pretrain_vision.py"
    spec = importlib.util.spec_from_file_location("pretrain_vision", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def add_bad_shard(folder: Path) -> None:
    """One shard with a corrupt image and a text-only sample (both skipped, counted by kind)."""
    with tarfile.open(folder / "bad.tar", "w") as tar:
        members = {
            "a.json": json.dumps({"segments": [{"image": "img0.png"}, {"text": "a red square"}]}).encode(),
            "a.img0.png": b"not a png",
            "b.json": json.dumps({"segments": [{"text": "only words"}]}).encode(),
        }
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_pretraining_writes_a_tower_the_vlm_loads_and_counts_what_it_skipped(tmp_path):
    make_synthetic(
        ["scenes"],
        str(tmp_path / "shards"),
        num_samples=24,
        seed=0,
        eval_samples=16,
        generator_options={"max_objects": 1},
    )
    add_bad_shard(tmp_path / "shards" / "train")
    out = tmp_path / "tower.safetensors"
    lines = []
    cfg = VisionPretrainConfig(
        shards=[str(tmp_path / "shards" / "train")],
        eval_shards=[str(tmp_path / "shards" / "eval")],
        out=str(out),
        tower=TOWER,
        steps=4,
        batch_size=8,
        warmup=2,
        eval_every=4,
        log_every=1,
    )
    record = pretrain_vision(cfg, log=lines.append)
    assert record["pairs"] == {"train": 24, "held_out": 16}
    assert record["skipped"] == {"bad_image": 1, "missing_field": 1}
    assert record["eval"][-1]["step"] == 4 and record["eval"][-1]["retrieval_chance"] == 1 / 8
    assert json.loads(out.with_suffix(".json").read_text())["skipped"] == record["skipped"]
    assert sum(line.startswith("step ") for line in lines) == 4

    saved = load_file(str(out))
    weights = {k: v for k, v in saved.items() if not k.startswith("summary_pool.")}
    model = ConceptMoEVLM.from_preset("tiny-moe", vision_weights=str(out), **TOWER)
    tower_state = model.vision_tower.model.state_dict()
    assert set(tower_state) == set(weights) and model.vision_tower.summary_pool is None
    assert all(torch.equal(tower_state[k], weights[k]) for k in weights)
    # vision_summary keeps the pool the objective trained: the same tensors, under the tower's summary_pool
    pooled = ConceptMoEVLM.from_preset("tiny-moe", vision_weights=str(out), vision_summary=True, **TOWER)
    pool_state = {"summary_pool." + k: v for k, v in pooled.vision_tower.summary_pool.state_dict().items()}
    assert set(pool_state) == set(saved) - set(weights) and all(torch.equal(saved[k], v) for k, v in pool_state.items())
    timm_only = tmp_path / "timm_only.safetensors"
    save_file(weights, str(timm_only))
    with pytest.raises(ValueError, match="summary=True needs the summary pool's weights"):
        ConceptMoEVLM.from_preset("tiny-moe", vision_weights=str(timm_only), vision_summary=True, **TOWER)
    fresh = ConceptMoEVLM.from_preset("tiny-moe", **TOWER).vision_tower.model.state_dict()
    assert not all(torch.equal(fresh[k], weights[k]) for k in weights)  # training moved the tower
    with pytest.raises(ValueError, match="do not fit"):  # a tower of another width refuses in one error
        ConceptMoEVLM.from_preset("tiny-moe", vision_weights=str(out))
    with pytest.raises(ValueError, match="exists"):  # a second run never replaces the tower unasked
        pretrain_vision(cfg, log=lines.append)
    assert torch.equal(load_file(str(out))[next(iter(weights))], weights[next(iter(weights))])


def test_region_targets_label_the_patches_whose_centres_lie_in_each_box():
    from PIL import Image

    batch = ImageProcessor(patch_size=8, max_patches=16, pixel_shuffle=2)([Image.new("RGB", (32, 16))] * 2)
    # a 2 x 4 grid of 8 px patches: the box x 0-0.5, y 0-1 holds the left four; the box x 0.6-1, y 0.5-1 the
    # lower two of the right half (centres x 0.625, 0.875; y 0.75)
    regions = [[([0.0, 0.0, 0.5, 1.0], [7, 9, 3])], [([0.6, 0.5, 1.0, 1.0], [9])]]
    target_BLK = region_targets(batch, regions, {7: 0, 9: 1})  # id 3 is no label word
    coord = batch["patch_coord"]
    for i in range(8):
        y, x = coord[0, i].tolist()
        assert target_BLK[0, i].tolist() == ([1.0, 1.0] if x < 2 else [0.0, 0.0])
        y, x = coord[1, i].tolist()
        assert target_BLK[1, i].tolist() == ([0.0, 1.0] if x >= 2 and y == 1 else [0.0, 0.0])


@pytest.mark.parametrize(
    ("objective", "label_pairs", "patch_labels", "region_labels"),
    [
        ("superclass", 0, 0.0, 0.0),
        ("multilabel", 0, 0.0, 0.0),
        ("multilabel", 2, 0.0, 0.0),
        ("multilabel", 0, 1.0, 0.0),
        ("multilabel", 0, 0.0, 1.0),
    ],
)
def test_caption_word_pretraining_writes_a_tower_the_vlm_loads(
    tmp_path, objective, label_pairs, patch_labels, region_labels
):
    make_synthetic(["scenes"], str(tmp_path / "shards"), num_samples=24, seed=0, eval_samples=16)
    out = tmp_path / "tower.safetensors"
    cfg = VisionPretrainConfig(
        shards=[str(tmp_path / "shards" / "train")],
        eval_shards=[str(tmp_path / "shards" / "eval")],
        out=str(out),
        tower=TOWER,
        objective=objective,
        label_pairs=label_pairs,
        patch_labels=patch_labels,
        region_labels=region_labels,
        steps=3,
        batch_size=8,
        warmup=1,
        eval_every=3,
    )
    lines = []
    record = pretrain_vision(cfg, log=lines.append)
    assert record["config"]["objective"] == objective
    assert ("word-pair labels" in lines[0]) == bool(label_pairs), lines[0]
    assert any("patch_loss" in line for line in lines) == bool(patch_labels), lines
    assert any("region_loss" in line for line in lines) == bool(region_labels), lines
    assert 0.0 <= record["eval"][-1]["eval_r_precision"] <= 1.0 and "retrieval_chance" not in record["eval"][-1]
    assert ("eval_region_loss" in record["eval"][-1]) == bool(region_labels)  # held out with its region targets
    words = bool(patch_labels or region_labels)  # the patch word head is the tower's and travels with it
    model = ConceptMoEVLM.from_preset(
        "tiny-moe", vision_weights=str(out), vision_summary=True, vision_words=words, **TOWER
    )
    own = model.vision_tower.state_dict()  # the timm model's keys under model., the summary pool's, the word head's
    weights = load_file(str(out))
    assert any(k.startswith("word_head.") for k in weights) == words
    kept = ("summary_pool.", "word_head.")
    assert all(torch.equal(own[k if k.startswith(kept) else "model." + k], v) for k, v in weights.items())


def test_pretrain_cli_refuses_bad_settings_in_one_line(tmp_path, capsys):
    script = load_script()
    for argv, says in (
        (["--out", "t.pt"], "out must be a .safetensors path"),
        (["--set", "embed_dim=32"], "expected FIELD=JSON"),
        (["--batch-size", "1"], "batch_size must be >= 2"),
        (["--preset", "huge"], "preset must be one of"),
        (["--objective", "clip"], "invalid choice"),
        (["--label-pairs", "2"], "only with objective multilabel"),
        (["--patch-labels", "1"], "only with objective superclass or multilabel"),
        (["--objective", "multilabel", "--patch-labels", "-1"], "patch_labels must be >= 0"),
        (["--region-labels", "1"], "region_labels must be >= 0, and > 0 only with objective superclass"),
    ):
        base = ["--shards", str(tmp_path), "--out", str(tmp_path / "t.safetensors")]
        with pytest.raises(SystemExit):
            script.main(base + argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert says in err[-1], err
    assert script.main(["--shards", str(tmp_path / "none*.tar"), "--out", str(tmp_path / "t.safetensors")]) == 2
    assert "no shard matches" in capsys.readouterr().err


def test_two_processes_train_the_tower_one_process_trains(tmp_path, monkeypatch):
    """torchrun with 2 ranks splits each global batch: the same batches as one process, so the same tower up to
    summation order; rank 0 alone writes, and the record says how many processes ran."""
    make_synthetic(["scenes"], str(tmp_path / "shards"), num_samples=24, seed=0, generator_options={"max_objects": 1})
    root = Path(__file__).resolve().parents[3]
    script = str(root / "scripts" / "pretrain_vision.py")
    common = ["--objective", "multilabel", "--shards", str(tmp_path / "shards" / "train"), "--steps", "3"]
    common += ["--batch-size", "8", "--warmup", "1", "--threads", "1", "--lr", "0.01"]
    common += [f"--set={k}={json.dumps(v)}" for k, v in {**TOWER, "vision_stem": "conv"}.items()]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    launch = {
        1: [sys.executable, script],
        2: [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script],
    }
    towers = {}
    for world, cmd in launch.items():
        out = tmp_path / f"tower{world}.safetensors"
        proc = subprocess.run(cmd + common + ["--out", str(out)], capture_output=True, text=True, env=env, cwd=root)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert json.loads(out.with_suffix(".json").read_text())["processes"] == world
        assert proc.stdout.count("step 1/3") == 1  # rank 0 logs for both
        towers[world] = load_file(str(out))
    torch.manual_seed(0)  # the tower as pretrain_vision builds it (seed 0) before any step
    cfg = VisionPretrainConfig(shards=[], out="x.safetensors", tower={**TOWER, "vision_stem": "conv"})
    initial = VisionTower(**{**cfg.tower_config().tower_kwargs(), "summary": True}).model.state_dict()
    assert set(towers[1]) == set(towers[2]) and not all(torch.equal(initial[k], towers[1][k]) for k in initial)
    for k, v in towers[1].items():
        torch.testing.assert_close(towers[2][k], v, atol=5e-4, rtol=1e-3, msg=k)  # steps of lr 1e-2 apart if wrong
    monkeypatch.setenv("WORLD_SIZE", "3")  # a global batch that does not split is refused before any work
    with pytest.raises(ValueError, match="must split into 3"):
        VisionPretrainConfig(shards=[], out=str(tmp_path / "t.safetensors"), batch_size=8).check()
