"""One source of truth per training setting (the run YAML and the DeepSpeed JSON never silently disagree), and
batches that reach the engine on its device and in its precision."""

import copy
import glob
import json

import pytest
import torch
from deepspeed.runtime.lr_schedules import WarmupLR
from safetensors.torch import load_file
from train_kit import ROOT, TINY, run_train, step_records

from vlm.training.build import build_model
from vlm.training.config import ConfigError, load_config
from vlm.training.ds_config import deepspeed_config
from vlm.training.single_process import LocalEngine
from vlm.training.step import NonFiniteGuard, evaluate, train_step

ZERO2 = json.loads((ROOT / "scripts" / "configs" / "zero2.json").read_text())


def run_config(*sets):
    return load_config(str(TINY), ["data.shards=[x]", *sets])


# -- reconciling the JSON with the YAML ---------------------------------------------------------------------------


def test_auto_and_absent_settings_are_filled_from_the_yaml():
    config = run_config("train.lr=0.02", "data.batch_size=3", "train.grad_accum=2", "train.grad_clip=0.5")
    ds = deepspeed_config(config, ZERO2, world_size=2)
    assert ds["optimizer"]["params"]["lr"] == 0.02 and ds["optimizer"]["params"]["weight_decay"] == 0.01
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (3, 2)
    assert ds["train_batch_size"] == 12 and ds["gradient_clipping"] == 0.5
    bare = deepspeed_config(config, {"zero_optimization": {"stage": 1}}, world_size=1)
    assert bare["optimizer"] == {
        "type": "AdamW",
        "params": {"lr": 0.02, "weight_decay": 0.01, "betas": [0.9, 0.95], "torch_adam": True},
    }
    assert deepspeed_config(config, bare, world_size=1) == bare  # reconciling twice changes nothing


@pytest.mark.parametrize(
    "path, value, yaml_key",
    [
        ("optimizer.params.lr", 0.1, "train.lr"),
        ("gradient_clipping", 5.0, "train.grad_clip"),
        ("train_micro_batch_size_per_gpu", 16, "data.batch_size"),
        ("gradient_accumulation_steps", 4, "train.grad_accum"),
        ("optimizer.params.weight_decay", 0.1, "train.weight_decay"),
        ("train_batch_size", 64, "data.batch_size x"),
    ],
)
def test_a_conflicting_json_value_is_one_line_naming_both_places(path, value, yaml_key):
    ds = copy.deepcopy(ZERO2)
    node = ds
    *parents, last = path.split(".")
    for part in parents:
        node = node[part]
    node[last] = value
    with pytest.raises(ConfigError) as err:
        deepspeed_config(run_config(), ds, world_size=1)
    message = str(err.value)
    assert f"{path}={value!r}" in message and yaml_key in message and "\n" not in message


def test_a_scheduler_takes_its_schedule_from_the_yaml_or_must_agree():
    ds = {**ZERO2, "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": "auto"}}}
    out = deepspeed_config(run_config("train.warmup=7", "train.max_steps=90", "train.min_lr_ratio=0.2"), ds, 1)
    assert out["scheduler"]["params"] == {"warmup_num_steps": 7, "total_num_steps": 90, "cos_min_ratio": 0.2}
    ds["scheduler"]["params"]["total_num_steps"] = 1000
    with pytest.raises(ConfigError, match=r"scheduler.params.total_num_steps=1000 .* train.max_steps=90"):
        deepspeed_config(run_config("train.max_steps=90"), ds, 1)
    with pytest.raises(ConfigError, match='"scheduler" must be an object with a "type"'):
        deepspeed_config(run_config(), {**ZERO2, "scheduler": {"params": {}}}, 1)


def test_unreadable_json_both_precisions_and_a_missing_monitor_package(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text('{"zero_optimization": ')
    with pytest.raises(ConfigError, match=r"ds.json: not valid JSON"):
        deepspeed_config(run_config(), str(bad), 1)
    with pytest.raises(ConfigError, match=r"--deepspeed .*nope.json: No such file"):
        deepspeed_config(run_config(), str(tmp_path / "nope.json"), 1)
    with pytest.raises(ConfigError, match="both bf16 and fp16"):
        deepspeed_config(run_config(), {"bf16": {"enabled": True}, "fp16": {"enabled": True}}, 1)
    with pytest.raises(ConfigError, match="comet monitor but comet_ml is not installed"):
        deepspeed_config(run_config(), {"comet": {"enabled": True}}, 1)


def test_the_cli_refuses_a_conflicting_json_before_building_anything(shards, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({**ZERO2, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}))
    proc = run_train(tmp_path / "run", shards, expect_rc=2, flags=["--deepspeed", str(ds)], max_steps=2, save_every=2)
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ") and "optimizer.params.lr=0.1" in proc.stderr
    assert not (tmp_path / "run").exists()


# -- an honoured JSON: its scheduler drives the learning rate, its monitors get the metrics ----------------------


def test_the_json_scheduler_and_monitor_are_honoured_and_the_effective_config_saved(shards, tmp_path):
    csv_dir = tmp_path / "csv"
    ds = {
        **ZERO2,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "linear", "warmup_min_lr": 0.0}},
        "csv_monitor": {"enabled": True, "output_path": str(csv_dir), "job_name": "job"},
    }
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    run = tmp_path / "run"
    run_train(
        run,
        shards,
        flags=["--deepspeed", str(tmp_path / "ds.json")],
        max_steps=4,
        save_every=4,
        warmup=3,
        lr=0.004,
        router_lr_scale=1e-9,
    )
    saved = json.loads((run / "ds_config.json").read_text())
    assert saved["scheduler"]["params"] == {
        "warmup_type": "linear",
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 0.004,
        "warmup_num_steps": 3,
    }
    assert saved["optimizer"]["params"]["lr"] == 0.004 and saved["train_batch_size"] == 2
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.004)
    reference = WarmupLR(optimizer, warmup_min_lr=0.0, warmup_max_lr=0.004, warmup_num_steps=3, warmup_type="linear")
    want = []
    for _ in range(4):
        want.append(optimizer.param_groups[0]["lr"])
        reference.step()
    got = [rec["lr"] for rec in step_records(run).values()]
    assert got == pytest.approx(want) and got[-1] > 0
    loss_csv = [p for p in glob.glob(str(csv_dir / "**" / "*.csv"), recursive=True) if p.endswith("train_loss.csv")]
    assert loss_csv and len(open(loss_csv[0]).read().splitlines()) >= 4
    # the router's own lr scale holds under the JSON scheduler too: W_q, W_k barely leave their identity init
    weights = load_file(run / "hf" / "model.safetensors")
    router = {k: v for k, v in weights.items() if ".chunker." in k}
    assert router and all(torch.allclose(v, torch.eye(v.shape[0]), atol=1e-6) for v in router.values())
    assert any(
        not torch.allclose(v, torch.eye(v.shape[0]), atol=1e-3)
        for k, v in weights.items()
        if v.ndim == 2 and v.shape[0] == v.shape[1] and ".chunker." not in k
    )


# -- device and precision -----------------------------------------------------------------------------------------


class ElsewhereEngine(LocalEngine):
    """A LocalEngine that says its device is ``meta`` (not the loader's ``cpu``) and records the device and dtype of
    every tensor it is called with; meta tensors hold no data, so it then runs the real model on ``real_batch``."""

    device = torch.device("meta")

    def __call__(self, **batch):
        self.seen = getattr(self, "seen", []) + [(k, v.device, v.dtype) for k, v in batch.items()]
        return self.module(**self.real_batch)


def vlm_batch(processor):
    from PIL import Image

    image = Image.new("RGB", (48, 32), (200, 30, 30))
    batch = dict(processor(text=["<image> a red square"], images=[[image]], return_tensors="pt"))
    batch["labels"] = batch["input_ids"].clone()
    return batch


def test_every_tensor_reaches_the_engine_device_in_its_precision(shards):
    model, processor = build_model(run_config(f"data.shards=[{shards / 'train'}]"))
    batch = vlm_batch(processor)
    assert batch["patches"].dtype == torch.float32 and batch["input_ids"].device.type == "cpu"
    engine = ElsewhereEngine(model, lr=1e-3)
    engine.real_batch = batch
    assert train_step(engine, [batch], NonFiniteGuard(3), step=1) is not None
    evaluate(engine, [batch], n_batches=1)
    assert engine.seen and all(device.type == "meta" for _, device, _ in engine.seen)
    assert {k: dtype for k, _, dtype in engine.seen}["patches"] == torch.float32  # the model's precision
    assert {k: dtype for k, _, dtype in engine.seen}["input_ids"] == torch.long
    bf16 = LocalEngine(model.to(torch.bfloat16), lr=1e-3)  # floating inputs follow the weights' precision
    stats = train_step(bf16, [batch], NonFiniteGuard(3), step=1)
    assert stats is not None and torch.isfinite(torch.tensor(stats.losses["loss"]))
