"""Run configuration: one YAML file, ``--set key.sub=value`` overrides (values parsed as YAML), defaults and
validation. Every fault fails at start with a one-line ``ConfigError`` naming the field: an unknown or wrong-typed
field, a number out of range (``RANGES``), a model override the model config does not take, malformed YAML;
``check_paths`` then checks that the paths it names exist (``build.check_data``: that the shards hold a sample)."""

from __future__ import annotations

import copy
import difflib
import inspect
import math
import os
from collections.abc import Callable

import yaml

from data_pipelines.loader import DATA_DEFAULTS
from data_pipelines.packing import LOSS_ON
from data_pipelines.tar_reader import expand_shards
from vlm.backbone.config import CHUNKING_SETTINGS, RENAMED_FIELDS, ConceptMoEConfig
from vlm.backbone.presets import PRESETS
from vlm.config import VISION_PRESETS, VLM_RENAMED_FIELDS, ConceptMoEVLMConfig

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
        # defaults: data_pipelines.loader.DATA_DEFAULTS (python -m data_pipelines.check --config reads them too)
        "eval_shards": (DATA_DEFAULTS["eval_shards"], (list, str, type(None))),
        "tokenizer": (DATA_DEFAULTS["tokenizer"], (str, type(None))),
        "seq_len": (DATA_DEFAULTS["seq_len"], (int,)),
        "batch_size": (DATA_DEFAULTS["batch_size"], (int,)),
        "num_workers": (DATA_DEFAULTS["num_workers"], (int,)),
        "max_patches": (DATA_DEFAULTS["max_patches"], (int,)),
        "split_documents": (DATA_DEFAULTS["split_documents"], (bool,)),
        "loss_on": (DATA_DEFAULTS["loss_on"], (str,)),  # one of data_pipelines.packing.LOSS_ON
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
        "router_lr_scale": (0.1, (float, int)),  # the boundary router's lr / lr (vlm.training.step.optimizer_groups)
        "keep_last": (2, (int,)),
        "log_every": (1, (int,)),
        "max_nonfinite": (5, (int,)),
        "export": (True, (bool,)),
    },
}
POSITIVE = {
    "data.batch_size",
    "data.max_patches",
    "train.max_steps",
    "train.save_every",
    "train.grad_accum",
    "train.keep_last",
    "train.log_every",
    "train.max_nonfinite",
    "train.eval_batches",
}
_AT_LEAST_1 = (lambda v: v >= 1, "must be >= 1")
_NOT_NEGATIVE = (lambda v: v >= 0, "must be >= 0")
_ABOVE_0 = (lambda v: v > 0, "must be > 0")
# numeric field -> (predicate, what it must be); every float must also be finite (``_check_value``).
RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    **dict.fromkeys(sorted(POSITIVE), _AT_LEAST_1),
    "data.seq_len": (lambda v: v >= 2, "must be >= 2"),  # a row predicts its tokens from the ones before
    "data.num_workers": _NOT_NEGATIVE,
    "train.eval_every": _NOT_NEGATIVE,  # 0: no evaluation
    "train.seed": _NOT_NEGATIVE,
    "train.warmup": _NOT_NEGATIVE,
    "train.lr": _ABOVE_0,
    "train.weight_decay": _NOT_NEGATIVE,
    "train.grad_clip": _ABOVE_0,
    "train.router_lr_scale": _ABOVE_0,
    "train.min_lr_ratio": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
}
CHOICES = {"data.loss_on": LOSS_ON}
SHARD_FIELDS = ("data.shards", "data.eval_shards")

# The presets ``ConceptMoEVLM.from_preset`` builds: the backbone's whose base has a vision tower.
VLM_PRESETS = tuple(name for name in PRESETS if name.removesuffix("-moe") in VISION_PRESETS)
# What ``model.overrides`` may change on a loaded checkpoint (``model.init_from``): the chunking settings
# ``set_chunking`` takes (training fields that never change a weight shape) plus the VLM's training switches (stage
# 2 unfreezes what stage 1 froze).
VLM_SWITCHES = ("freeze_vision", "freeze_backbone")
VLM_CHUNKING = ("modality_boundaries", "image_chunking")  # through ConceptMoEVLM.set_chunking
VLM_OVERRIDABLE = (*VLM_SWITCHES, *VLM_CHUNKING)
INIT_OVERRIDABLE = (*CHUNKING_SETTINGS, *VLM_OVERRIDABLE)
# Model fields the run sets itself (``build.build_model``): an override of them is refused, naming the config field.
SET_BY_RUN = {
    "vocab_size": "data.tokenizer",
    "image_token_id": "data.tokenizer",
    "bos_token_id": "data.tokenizer",
    "eos_token_id": "data.tokenizer",
    "pad_token_id": "data.tokenizer",
    "max_patches": "data.max_patches",
}
LEGACY_NAMES = {**RENAMED_FIELDS, **VLM_RENAMED_FIELDS}


class ConfigError(ValueError):
    """A bad config field; the message is one line naming the field."""


def first_line(err: BaseException) -> str:
    """The first line of an error's message (its type when the message is empty): one-line errors."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _yaml_problem(err: yaml.YAMLError) -> str:
    """``line L, column C: problem`` of a YAML parse error, on one line."""
    mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None) or first_line(err)
    return problem if mark is None else f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


def parse_override(text: str) -> tuple[list[str], object]:
    """``"train.lr=1e-3"`` -> (["train", "lr"], 0.001); the value is read as YAML."""
    key, sep, value = text.partition("=")
    path = key.strip().split(".")
    if not sep or not all(path):
        raise ConfigError(f"--set {text!r}: expected key.sub=value")
    try:
        return path, yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError(f"--set {key.strip()}: value {value!r} is not valid YAML ({_yaml_problem(err)})") from None


def apply_override(raw: dict, path: list[str], value) -> None:
    node = raw
    for part in path[:-1]:
        if node.get(part) is None:
            node[part] = {}
        node = node[part]
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


def _check_value(key: str, value) -> None:
    """A typed value against ``RANGES`` / ``CHOICES`` (every float finite; shard fields: paths)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config field '{key}' must be a finite number, got {value!r}")
    if key in RANGES and not RANGES[key][0](value):
        raise ConfigError(f"config field '{key}' {RANGES[key][1]}, got {value!r}")
    if key in CHOICES and value not in CHOICES[key]:
        raise ConfigError(f"config field '{key}' must be one of {', '.join(CHOICES[key])}, got {value!r}")
    if key in SHARD_FIELDS and isinstance(value, list) and not all(isinstance(p, str) and p for p in value):
        raise ConfigError(f"config field '{key}' must be a path (pattern) or a list of them, got {value!r}")
    if key == "data.shards" and value == []:
        raise ConfigError("config field 'data.shards' must name at least one shard, got []")


def _resolve_field(key: str, given: dict, name: str, default, types: tuple):
    """One field's value: the default when not given, else the given value checked for type and range."""
    if name not in given:
        if default is REQUIRED:
            raise ConfigError(f"missing required config field '{key}'")
        return copy.deepcopy(default)
    value = _as_float(given[name]) if float in types else given[name]
    if not _type_ok(value, types):
        allowed = " or ".join(t.__name__ for t in types)
        raise ConfigError(f"config field '{key}' must be {allowed}, got {type(value).__name__} {value!r}")
    _check_value(key, value)
    return value


def resolve(raw: dict) -> dict:
    """Defaults filled in and every field checked (the model's fields too: ``check_model``); returns a new dict."""
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
        out[section] = {
            name: _resolve_field(f"{section}.{name}", given, name, default, types)
            for name, (default, types) in fields.items()
        }
    for key in ("shards", "eval_shards"):
        if isinstance(out["data"][key], str):
            out["data"][key] = [out["data"][key]]
    check_model(out["model"], out["data"]["max_patches"])
    return out


# ----------------------------------------------------------------------------- model.preset / model.overrides
def _init_fields(cls, skip: tuple = ()) -> set[str]:
    """The named parameters of ``cls.__init__`` (its fields), less ``self`` and ``skip``."""
    params = inspect.signature(cls.__init__).parameters.values()
    return {p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD and p.name not in ("self", *skip)}


def model_fields() -> set[str]:
    """What ``ConceptMoEVLM.from_preset(preset, **overrides)`` takes: the VLM config's fields, its text config's
    (``from_preset`` routes those to ``text_config``) and their old names."""
    vlm = _init_fields(ConceptMoEVLMConfig, skip=("text_config",))
    return vlm | _init_fields(ConceptMoEConfig) | set(LEGACY_NAMES)


def _check_override_name(name, init_from: str | None, fields: set[str]) -> None:
    """An unknown key (closest field suggested), one the run sets itself, or one a checkpoint cannot change."""
    if not isinstance(name, str) or name not in fields:
        close = difflib.get_close_matches(str(name), sorted(fields - set(SET_BY_RUN)), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else "; see the fields of ConceptMoEVLMConfig, ConceptMoEConfig"
        raise ConfigError(f"unknown config field 'model.overrides.{name}'{hint}")
    if name in SET_BY_RUN:
        raise ConfigError(f"model.overrides.{name} cannot be overridden: the run sets it from {SET_BY_RUN[name]}")
    if init_from is not None and LEGACY_NAMES.get(name, name) not in INIT_OVERRIDABLE:
        raise ConfigError(
            f"model.overrides.{name} cannot change a loaded checkpoint (model.init_from); allowed: "
            + ", ".join(INIT_OVERRIDABLE)
        )


def check_model(model: dict, max_patches: int) -> None:
    """``model.preset`` is a VLM preset and ``model.overrides`` holds model fields only; without ``init_from`` the
    model config is built (not the model: cheap) so that its own rules (``RULES``, ``VLM_RULES``) check the values.
    On a checkpoint the values are checked against its config when it loads (``build.init_from_checkpoint``)."""
    if model["preset"] not in VLM_PRESETS:
        raise ConfigError(f"unknown model.preset {model['preset']!r}; allowed: {', '.join(VLM_PRESETS)}")
    fields = model_fields()
    for name in model["overrides"]:
        _check_override_name(name, model["init_from"], fields)
    if model["init_from"] is not None:
        return
    try:
        ConceptMoEVLMConfig.from_preset(model["preset"], max_patches=max_patches, **model["overrides"])
    except (ValueError, TypeError) as err:
        message = first_line(err)
        named = any(str(name) in message for name in model["overrides"])
        raise ConfigError(f"model.overrides{'' if named else '=' + repr(model['overrides'])}: {message}") from None


# ----------------------------------------------------------------------------- reading, writing
def _read_yaml(path: str):
    """The YAML document in ``path``; a missing / unreadable file or malformed YAML is a one-line ConfigError."""
    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {path!r}: {getattr(err, 'strerror', None) or first_line(err)}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML at {_yaml_problem(err)}") from None


def load_config(path: str | None, overrides: list[str] = ()) -> dict:
    """Read ``path`` (YAML), apply ``--set`` overrides in order, resolve defaults, validate."""
    raw = {}
    if path is not None:
        raw = _read_yaml(path) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: config must be a mapping with sections model, data, train")
    for text in overrides:
        apply_override(raw, *parse_override(text))
    return resolve(raw)


def save_config(config: dict, path: str) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)


# ----------------------------------------------------------------------------- paths that must exist
def _shards_problem(patterns: list[str]) -> str | None:
    """Expanded as the loader expands them (paths, brace patterns, globs, folders of ``*.tar``; a ``file:`` path is
    checked on the local filesystem; a URL such as ``pipe:CMD`` or ``http(s)://...`` is not: ``build.check_data``
    reads it)."""
    try:
        expand_shards(patterns)
    except (OSError, ValueError) as err:
        return first_line(err)
    return None


def _tokenizer_problem(path: str) -> str | None:
    return None if os.path.isdir(path) else f"{path!r} is not a directory (a tokenizer.save_pretrained folder)"


def _model_folder_problem(path: str) -> str | None:
    if os.path.isfile(os.path.join(path, "config.json")):
        return None
    return f"{path!r} is not a saved model folder (no {'config.json in it' if os.path.isdir(path) else 'such folder'})"


# field -> what is wrong with its value (None: nothing); a field left unset (None / []) is not checked.
PATH_RULES: dict[str, Callable[[object], str | None]] = {
    "data.shards": _shards_problem,
    "data.eval_shards": _shards_problem,
    "data.tokenizer": _tokenizer_problem,
    "model.init_from": _model_folder_problem,
}


def check_paths(config: dict) -> None:
    """Every path the config names exists (``PATH_RULES``), so that none is found missing hours into a run (an
    evaluation's shards at the first evaluation); shard URLs (``pipe:``, ``http(s)://``) are not looked for on the
    local filesystem. Raises a one-line ConfigError naming the field."""
    for key, problem_of in PATH_RULES.items():
        section, name = key.split(".")
        value = config[section][name]
        if value and (problem := problem_of(value)):
            raise ConfigError(f"{key}: {problem}")
