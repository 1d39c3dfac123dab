"""Run settings as typed dataclasses, and the one YAML reader and ``--set key.sub=value`` parser.

A setting is a dataclass field declared with ``setting(default, types, rule=..., choices=...)``: its default, the
types it accepts, its range and its allowed values stated once, next to its name. ``resolve_section`` turns a YAML
mapping into the dataclass, every fault a one-line ``ConfigError`` naming the field. ``DataConfig`` is the ``data``
section of a training run (``make_dataloader`` / ``loader_from_config``, ``python -m data_pipelines.check
--config`` and the benchmarks take it as it is); ``vlm.training.config`` declares the other sections the same way.
``read_yaml`` and ``apply_sets`` are shared by training, the checker and the study runner (``eval.study.config``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable

import yaml

from data_pipelines.packing import LOSS_ON

REQUIRED = dataclasses.MISSING  # ``setting(REQUIRED, ...)``: the user must give the field


class ConfigError(ValueError):
    """A bad config field; the message is one line naming the field."""


def first_line(err: BaseException) -> str:
    """The first line of an error's message (its type when the message is empty): one-line errors."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# ----------------------------------------------------------------------------- declaring a setting
Rule = Callable[[object], "str | None"]  # a value -> what is wrong with it (None: nothing)


def at_least(low) -> Rule:
    return lambda v: None if v >= low else f"must be >= {low}"


def above(low) -> Rule:
    return lambda v: None if v > low else f"must be > {low}"


def within(low, high) -> Rule:
    return lambda v: None if low <= v <= high else f"must be in [{low}, {high}]"


def setting(default, types: tuple, rule: Rule | None = None, choices: tuple | None = None, doc: str = ""):
    """A dataclass field that is a run setting: ``default`` (``REQUIRED``: none), the ``types`` a YAML value may
    have, a ``rule`` on its value and the ``choices`` it must be one of."""
    meta = {"types": types, "rule": rule, "choices": choices, "doc": doc}
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def default_of(cls, name: str):
    """The default of setting ``name`` of the dataclass ``cls`` (``REQUIRED`` when it has none)."""
    f = cls.__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


# ----------------------------------------------------------------------------- the data section
def _shards_problem(value) -> str | None:
    if isinstance(value, list) and not all(isinstance(p, str) and p for p in value):
        return "must be a path (pattern) or a list of them"
    return None


def _required_shards_problem(value) -> str | None:
    return "must name at least one shard" if value == [] else _shards_problem(value)


@dataclasses.dataclass(kw_only=True)
class DataConfig:
    """The ``data`` section of a training run: where the shards are and how they become batches."""

    shards: list[str] = setting(REQUIRED, (list, str), _required_shards_problem)
    eval_shards: list[str] | None = setting(None, (list, str, type(None)), _shards_problem)
    tokenizer: str | None = setting(None, (str, type(None)), doc="None: data_pipelines.tokenizer.load_tokenizer's")
    seq_len: int = setting(256, (int,), at_least(2), doc="a row predicts its tokens from the ones before")
    batch_size: int = setting(2, (int,), at_least(1))
    num_workers: int = setting(0, (int,), at_least(0))
    max_patches: int = setting(64, (int,), at_least(1), doc="the image processor's patch budget per image")
    split_documents: bool = setting(False, (bool,))
    loss_on: str = setting("auto", (str,), choices=LOSS_ON)

    def __post_init__(self):
        for name in ("shards", "eval_shards"):  # one pattern stands for a list of one
            if isinstance(getattr(self, name), str):
                setattr(self, name, [getattr(self, name)])


# ----------------------------------------------------------------------------- checking a section
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


def check_value(key: str, value, meta) -> object:
    """``value`` of field ``key`` checked against its setting's types, rule and choices; every float finite."""
    types = meta["types"]
    value = _as_float(value) if float in types else value
    if not _type_ok(value, types):
        allowed = " or ".join(t.__name__ for t in types)
        raise ConfigError(f"config field '{key}' must be {allowed}, got {type(value).__name__} {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config field '{key}' must be a finite number, got {value!r}")
    if meta["rule"] is not None and (problem := meta["rule"](value)):
        raise ConfigError(f"config field '{key}' {problem}, got {value!r}")
    if meta["choices"] is not None and value not in meta["choices"]:
        raise ConfigError(f"config field '{key}' must be one of {', '.join(meta['choices'])}, got {value!r}")
    return value


def resolve_section(cls, section: str, given) -> object:
    """The dataclass ``cls`` from a YAML mapping: unknown fields refused, missing ones defaulted (or refused when
    required), every given value checked (``check_value``)."""
    given = {} if given is None else given
    if not isinstance(given, dict):
        raise ConfigError(f"config section {section!r} must be a mapping")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    extra = sorted(set(given) - set(fields), key=str)
    if extra:
        raise ConfigError(f"unknown config field '{section}.{extra[0]}'; allowed: {', '.join(fields)}")
    values = {}
    for name, f in fields.items():
        if name in given:
            values[name] = check_value(f"{section}.{name}", given[name], f.metadata)
        elif default_of(cls, name) is REQUIRED:
            raise ConfigError(f"missing required config field '{section}.{name}'")
    return cls(**values)


# ----------------------------------------------------------------------------- the YAML reader, --set
def _yaml_problem(err: yaml.YAMLError) -> str:
    """``line L, column C: problem`` of a YAML parse error, on one line."""
    mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None) or first_line(err)
    return problem if mark is None else f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


def read_yaml(path: str) -> dict:
    """The YAML mapping in ``path`` (empty file: ``{}``); a missing / unreadable file, malformed YAML or a document
    that is not a mapping is a one-line ConfigError."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {path!r}: {getattr(err, 'strerror', None) or first_line(err)}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML at {_yaml_problem(err)}") from None
    if not isinstance(raw, (dict, type(None))):
        raise ConfigError(f"{path}: config must be a mapping")
    return raw or {}


def parse_set(text: str) -> tuple[list[str], object]:
    """``"train.lr=1e-3"`` -> (["train", "lr"], 0.001); the value is read as YAML."""
    key, sep, value = text.partition("=")
    path = key.strip().split(".")
    if not sep or not all(path):
        raise ConfigError(f"--set {text!r}: expected key.sub=value")
    try:
        return path, yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError(f"--set {key.strip()}: value {value!r} is not valid YAML ({_yaml_problem(err)})") from None


def apply_set(raw: dict, text: str) -> None:
    """``--set a.b.c=VALUE`` into ``raw``, creating sections on the way."""
    path, value = parse_set(text)
    node = raw
    for part in path[:-1]:
        if node.get(part) is None:
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise ConfigError(f"--set {'.'.join(path)}: {part!r} is not a section")
    node[path[-1]] = value


def read_config(path: str | None, sets: list[str] = ()) -> dict:
    """The YAML mapping at ``path`` (None: empty) with the ``--set`` overrides applied in order, unchecked."""
    raw = {} if path is None else read_yaml(path)
    for text in sets:
        apply_set(raw, text)
    return raw
