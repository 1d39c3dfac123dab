"""The DeepSpeed config a run uses: the user's JSON (ZeRO stage, precision, optimiser, scheduler, monitors) with every
setting the run YAML also has reconciled — one source of truth per setting, as the HF Trainer does it.

For each setting in ``TIES`` the JSON may leave it out or write ``"auto"`` (filled from the YAML), or give the same
value; a different value stops the run at start with one line naming both places. Everything else in the JSON is
used as written: its optimiser type and betas, its ``scheduler`` (which then drives the learning rate, instead of
the YAML's warmup + cosine), ``bf16`` / ``fp16``, and its ``tensorboard`` / ``csv_monitor`` / ``wandb`` monitors,
which receive every ``metrics.jsonl`` record. The effective config is saved as ``RUN/ds_config.json``.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math

from vlm.training.config import ConfigError

AUTO = "auto"
DS_CONFIG_FILE = "ds_config.json"
# Schedulers whose parameters the YAML also describes: scheduler type -> {parameter: YAML field}.
_SCHEDULER_TIES = {
    "WarmupLR": {"warmup_max_lr": "train.lr", "warmup_num_steps": "train.warmup"},
    "WarmupDecayLR": {
        "warmup_max_lr": "train.lr",
        "warmup_num_steps": "train.warmup",
        "total_num_steps": "train.max_steps",
    },
    "WarmupCosineLR": {
        "warmup_num_steps": "train.warmup",
        "total_num_steps": "train.max_steps",
        "cos_min_ratio": "train.min_lr_ratio",
    },
}
MONITOR_PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard", "comet": "comet_ml"}


# JSON setting (dotted path) -> the YAML field that must agree with it.
TIES = {
    "train_micro_batch_size_per_gpu": "data.batch_size",
    "gradient_accumulation_steps": "train.grad_accum",
    "gradient_clipping": "train.grad_clip",
    "optimizer.params.lr": "train.lr",
    "optimizer.params.weight_decay": "train.weight_decay",
}


def _yaml_value(config: dict, key: str):
    section, name = key.split(".")
    return config[section][name]


def _get(ds: dict, path: str):
    node = ds
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _set(ds: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    node = ds
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return a == b


def reconcile(ds: dict, path: str, config: dict, yaml_key: str, source: str) -> None:
    """Fill ``ds[path]`` from the YAML when absent or ``"auto"``; raise ``ConfigError`` when it differs."""
    want, have = _yaml_value(config, yaml_key), _get(ds, path)
    if have is None or have == AUTO:
        _set(ds, path, want)
    elif not _same(have, want):
        raise ConfigError(
            f"{source} sets {path}={have!r} but the run config has {yaml_key}={want!r}: make them agree, "
            f'or write "{AUTO}" in the JSON'
        )


def read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            ds = json.load(f)
    except OSError as err:
        raise ConfigError(f"--deepspeed {path}: {err.strerror or err}") from None
    except ValueError as err:
        raise ConfigError(f"--deepspeed {path}: not valid JSON ({err})") from None
    if not isinstance(ds, dict):
        raise ConfigError(f"--deepspeed {path}: must hold a JSON object")
    return ds


def deepspeed_config(config: dict, path: str | dict | None, world_size: int) -> dict:
    """The effective DeepSpeed config of a run: the JSON at ``path`` (or a dict; ``None``: no ZeRO, AdamW) with the
    ``TIES`` and the scheduler's schedule parameters reconciled with the run ``config``."""
    source = path if isinstance(path, str) else "the DeepSpeed config"
    ds = read_json(path) if isinstance(path, str) else copy.deepcopy(path or {"zero_optimization": {"stage": 0}})
    ds.setdefault("optimizer", {"type": "AdamW", "params": {}})
    params = ds["optimizer"].setdefault("params", {})
    for json_path, yaml_key in TIES.items():
        reconcile(ds, json_path, config, yaml_key, source)
    params.setdefault("betas", [0.9, 0.95])
    params.setdefault("torch_adam", True)  # the CPU accelerator has no fused Adam; on GPUs set it to false
    micro, accum = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
    global_batch = micro * accum * world_size
    if ds.get("train_batch_size", AUTO) not in (AUTO, global_batch):
        raise ConfigError(
            f"{source} sets train_batch_size={ds['train_batch_size']} but data.batch_size x train.grad_accum x "
            f'{world_size} processes = {global_batch}: make them agree, or write "{AUTO}" in the JSON'
        )
    ds["train_batch_size"] = global_batch
    scheduler = ds.get("scheduler")
    if scheduler is not None:
        if not isinstance(scheduler, dict) or "type" not in scheduler:
            raise ConfigError(f'{source}: "scheduler" must be an object with a "type"')
        scheduler.setdefault("params", {})
        for param, yaml_key in _SCHEDULER_TIES.get(scheduler["type"], {}).items():
            reconcile(ds, f"scheduler.params.{param}", config, yaml_key, source)
    for name, package in MONITOR_PACKAGES.items():
        if (ds.get(name) or {}).get("enabled") and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{source} enables the {name} monitor but {package} is not installed")
    if ds.get("bf16", {}).get("enabled") and ds.get("fp16", {}).get("enabled"):
        raise ConfigError(f"{source} enables both bf16 and fp16: pick one")
    ds.setdefault("steps_per_print", 10**9)
    return ds


def schedule_owner(ds: dict) -> str:
    """Who sets the learning rate each step: the JSON's scheduler, or the YAML's warmup + cosine (``lr_at``)."""
    scheduler = ds.get("scheduler")
    return f"DeepSpeed scheduler {scheduler['type']}" if scheduler else "run config (warmup + cosine)"
