"""Run configuration: one YAML file, ``--set key.sub=value`` overrides (values parsed as YAML), defaults and
validation. An unknown or wrong-typed field fails at start with a one-line ``ConfigError`` naming it."""

from __future__ import annotations

import copy

import yaml

from data_pipelines.packing import LOSS_ON

# field -> (default, allowed types); ``None`` default with ``required`` means the user must set it.
REQUIRED = object()
SCHEMA: dict[str, dict[str, tuple]] = {
    "model": {
        "preset": ("tiny", (str,)),
        "overrides": ({}, (dict,)),
        "init_from": (None, (str, type(None))),  # a local checkpoint: a ConceptMoEVLM, or a text ConceptMoE (CT)
    },
    "data": {
        "shards": (REQUIRED, (list, str)),
        "eval_shards": (None, (list, str, type(None))),
        "tokenizer": (None, (str, type(None))),
        "seq_len": (256, (int,)),
        "batch_size": (2, (int,)),
        "num_workers": (0, (int,)),
        "max_patches": (64, (int,)),
        "split_documents": (False, (bool,)),
        "loss_on": ("auto", (str,)),  # one of data_pipelines.packing.LOSS_ON
    },
    "train": {
        "max_steps": (REQUIRED, (int,)),
        "save_every": (REQUIRED, (int,)),
        "eval_every": (0, (int,)),
        "eval_batches": (4, (int,)),
        "seed": (REQUIRED, (int,)),
        "grad_accum": (1, (int,)),
        "lr": (3e-3, (float, int)),
        "min_lr_ratio": (0.1, (float, int)),
        "weight_decay": (0.01, (float, int)),
        "warmup": (10, (int,)),
        "grad_clip": (1.0, (float, int)),
        "keep_last": (2, (int,)),
        "log_every": (1, (int,)),
        "max_nonfinite": (5, (int,)),
        "export": (True, (bool,)),
    },
}
POSITIVE = {
    "data.seq_len", "data.batch_size", "data.max_patches", "train.max_steps", "train.save_every", "train.grad_accum",
    "train.keep_last", "train.log_every", "train.max_nonfinite", "train.eval_batches",
}  # fmt: skip


CHOICES = {"data.loss_on": LOSS_ON}


class ConfigError(ValueError):
    """A bad config field; the message is one line naming the field."""


def parse_override(text: str) -> tuple[list[str], object]:
    """``"train.lr=1e-3"`` -> (["train", "lr"], 0.001); the value is read as YAML."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key.sub=value")
    key, value = text.split("=", 1)
    return key.strip().split("."), yaml.safe_load(value) if value.strip() else None


def apply_override(raw: dict, path: list[str], value) -> None:
    node = raw
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {'.'.join(path)}: {part!r} is not a section")
    node[path[-1]] = value


def _type_ok(value, types: tuple) -> bool:
    if isinstance(value, bool) and bool not in types:
        return False
    return isinstance(value, types)


def _as_float(value):
    """YAML 1.1 reads ``1e-3`` (no dot) as a string; accept it for float fields."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def resolve(raw: dict) -> dict:
    """Defaults filled in and every field checked; returns a new nested dict."""
    if not isinstance(raw, dict):
        raise ConfigError("config must be a mapping with sections model, data, train")
    unknown = set(raw) - set(SCHEMA)
    if unknown:
        raise ConfigError(f"unknown config section {sorted(unknown)[0]!r}; allowed: {', '.join(SCHEMA)}")
    out = {}
    for section, fields in SCHEMA.items():
        given = raw.get(section) or {}
        if not isinstance(given, dict):
            raise ConfigError(f"config section {section!r} must be a mapping")
        extra = set(given) - set(fields)
        if extra:
            name = sorted(extra)[0]
            raise ConfigError(f"unknown config field '{section}.{name}'; allowed: {', '.join(fields)}")
        out[section] = {}
        for name, (default, types) in fields.items():
            key = f"{section}.{name}"
            if name not in given:
                if default is REQUIRED:
                    raise ConfigError(f"missing required config field '{key}'")
                out[section][name] = copy.deepcopy(default)
                continue
            value = _as_float(given[name]) if float in types else given[name]
            if not _type_ok(value, types):
                allowed = " or ".join(t.__name__ for t in types)
                raise ConfigError(f"config field '{key}' must be {allowed}, got {type(value).__name__} {value!r}")
            if key in POSITIVE and value < 1:
                raise ConfigError(f"config field '{key}' must be >= 1, got {value!r}")
            if key in CHOICES and value not in CHOICES[key]:
                raise ConfigError(f"config field '{key}' must be one of {', '.join(CHOICES[key])}, got {value!r}")
            out[section][name] = value
    for key in ("shards", "eval_shards"):
        if isinstance(out["data"][key], str):
            out["data"][key] = [out["data"][key]]
    return out


def load_config(path: str | None, overrides: list[str] = ()) -> dict:
    """Read ``path`` (YAML), apply ``--set`` overrides in order, resolve defaults, validate."""
    raw = {}
    if path is not None:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    for text in overrides:
        apply_override(raw, *parse_override(text))
    return resolve(raw)


def save_config(config: dict, path: str) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
