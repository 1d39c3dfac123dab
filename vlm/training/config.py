"""Run configuration: one YAML file with sections ``model``, ``data``, ``train``, ``--set key.sub=value`` overrides
(values parsed as YAML), defaults and validation. Each section is a dataclass whose fields state their default,
types, range and allowed values once (``data_pipelines.run_config.setting``): ``ModelSection``, ``DataConfig``
(owned by ``data_pipelines``), ``TrainConfig``. Every fault fails at start with a one-line ``ConfigError`` naming
the field: an unknown or wrong-typed field, a number out of range, a model override the model config does not take,
malformed YAML; ``check_paths`` then checks that the paths it names exist (``build.check_data``: that the shards hold
a sample). ``load_config`` returns the sections as plain dicts (what ``save_config`` writes and a run folder's
``config.yaml`` holds); ``TrainConfig(**config["train"])`` / ``DataConfig(**config["data"])`` give them typed."""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable

import yaml

from data_pipelines.run_config import (
    REQUIRED,
    ConfigError,
    DataConfig,
    above,
    at_least,
    first_line,
    read_config,
    resolve_section,
    setting,
    within,
)
from data_pipelines.tar_reader import expand_shards
from vlm.backbone.config import CHUNKING_SETTINGS, RENAMED_FIELDS, ConceptMoEConfig, init_fields
from vlm.backbone.presets import PRESETS
from vlm.config import VISION_PRESETS, VLM_RENAMED_FIELDS, ConceptMoEVLMConfig

__all__ = ["ConfigError", "DataConfig", "ModelSection", "TrainConfig", "check_paths", "load_config", "save_config"]

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


@dataclasses.dataclass(kw_only=True)
class ModelSection:
    """The ``model`` section: which VLM to build (``build.build_model``)."""

    preset: str = setting("tiny", (str,), choices=VLM_PRESETS)
    overrides: dict = setting({}, (dict,), doc="model config fields (check_model)")
    init_from: str | None = setting(None, (str, type(None)), doc="a ConceptMoEVLM, or a text ConceptMoE (CT)")


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    """The ``train`` section, and what ``vlm.training.step`` / ``single_process.train`` read of it."""

    max_steps: int = setting(REQUIRED, (int,), at_least(1))
    save_every: int = setting(REQUIRED, (int,), at_least(1))
    eval_every: int = setting(0, (int,), at_least(0), doc="0: no evaluation")
    eval_batches: int = setting(4, (int,), at_least(1))
    seed: int = setting(REQUIRED, (int,), at_least(0))
    grad_accum: int = setting(1, (int,), at_least(1))
    lr: float = setting(3e-3, (float, int), above(0))
    min_lr_ratio: float = setting(0.1, (float, int), within(0, 1))
    weight_decay: float = setting(0.01, (float, int), at_least(0))
    warmup: int = setting(10, (int,), at_least(0))
    grad_clip: float = setting(1.0, (float, int), above(0))
    router_lr_scale: float = setting(0.1, (float, int), above(0), doc="the router's lr / lr (step.optimizer_groups)")
    expert_parallel: int = setting(1, (int,), at_least(1), doc="ranks each MoE layer's experts are split over")
    keep_last: int = setting(2, (int,), at_least(1))
    log_every: int = setting(1, (int,), at_least(1))
    max_nonfinite: int = setting(5, (int,), at_least(1), doc="non-finite optimiser steps in a row before stopping")
    export: bool = setting(True, (bool,))


SECTIONS = {"model": ModelSection, "data": DataConfig, "train": TrainConfig}


def resolve(raw: dict) -> dict:
    """Defaults filled in and every field checked (the model's fields too: ``check_model``); returns a new dict of
    sections, each the ``asdict`` of its dataclass."""
    if not isinstance(raw, dict):
        raise ConfigError("config must be a mapping with sections model, data, train")
    unknown = sorted(set(raw) - set(SECTIONS), key=str)
    if unknown:
        raise ConfigError(f"unknown config section {unknown[0]!r}; allowed: {', '.join(SECTIONS)}")
    out = {name: dataclasses.asdict(resolve_section(cls, name, raw.get(name))) for name, cls in SECTIONS.items()}
    check_model(out["model"], out["data"]["max_patches"])
    return out


# ----------------------------------------------------------------------------- model.preset / model.overrides
def model_fields() -> set[str]:
    """What ``ConceptMoEVLM.from_preset(preset, **overrides)`` takes: the VLM config's fields, its text config's
    (``from_preset`` routes those to ``text_config``) and their old names."""
    vlm = init_fields(ConceptMoEVLMConfig, skip=("text_config",))
    return vlm | init_fields(ConceptMoEConfig) | set(LEGACY_NAMES)


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
def load_config(path: str | None, overrides: list[str] = ()) -> dict:
    """Read ``path`` (YAML; a run folder's saved ``config.yaml`` too), apply ``--set`` overrides in order, resolve
    defaults, validate."""
    return resolve(read_config(path, overrides))


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
