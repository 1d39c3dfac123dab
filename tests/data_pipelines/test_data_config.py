"""The typed run settings: every default stated once (in its dataclass), one YAML reader and one ``--set`` parser."""

import ast
import dataclasses
from pathlib import Path

import pytest

from data_pipelines.run_config import REQUIRED, ConfigError, DataConfig, apply_set, default_of, resolve_section

ROOT = Path(__file__).resolve().parents[2]
# The modules that read a run's settings: a default there for a setting's name would be a second one.
READERS = ["data_pipelines/loader.py", "data_pipelines/check.py", "scripts/bench_data.py", "scripts/train_vlm.py"]
# (probe.py, copy_probe.py and vision_pretraining.py are other jobs, with settings of their own: ProbeConfig,
# CopyProbeConfig, VisionPretrainConfig)
OTHER_JOBS = {"probe.py", "copy_probe.py", "vision_pretraining.py"}
READERS += [
    str(p.relative_to(ROOT)) for p in sorted((ROOT / "vlm" / "training").glob("*.py")) if p.name not in OTHER_JOBS
]
READERS += [str(p.relative_to(ROOT)) for p in sorted((ROOT / "eval" / "study").glob("*.py"))]
SETTING_CLASSES = {"DataConfig", "TrainConfig", "ModelSection"}


def _run_settings() -> dict[str, object]:
    from vlm.training.config import SECTIONS

    return {f.name: default_of(cls, f.name) for cls in SECTIONS.values() for f in dataclasses.fields(cls)}


def _literal(node) -> bool:
    """A value stated in the source; None and an empty (), [], {} say "not given" and are not defaults."""
    if isinstance(node, ast.Constant):
        return node.value is not None
    return isinstance(node, (ast.List, ast.Tuple)) and bool(node.elts) or isinstance(node, ast.Dict) and bool(node.keys)


def _stated_defaults(tree: ast.AST):
    """(name, line) of every literal default: a parameter's, or a class attribute's outside the setting classes."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            positional = a.posonlyargs + a.args
            pairs = list(zip(positional[len(positional) - len(a.defaults) :], a.defaults))
            pairs += [(k, d) for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            yield from ((arg.arg, d.lineno) for arg, d in pairs if _literal(d))
        elif isinstance(node, ast.ClassDef) and node.name not in SETTING_CLASSES:
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and _literal(item.value) and isinstance(item.target, ast.Name):
                    yield item.target.id, item.lineno


def test_every_setting_default_is_stated_once():
    settings = {name: d for name, d in _run_settings().items() if d is not REQUIRED}
    twice = []
    for path in READERS:
        for name, line in _stated_defaults(ast.parse((ROOT / path).read_text())):
            if name in settings:
                twice.append(f"{path}:{line}: {name}")
    assert not twice, "defaults of run settings stated outside their dataclass: " + ", ".join(twice)
    # the old second homes are gone
    import data_pipelines.loader as loader
    import vlm.training.config as config
    import vlm.training.step as step

    assert not hasattr(loader, "DATA_DEFAULTS") and not hasattr(step, "TrainSettings")
    assert not hasattr(config, "SCHEMA")


def test_make_dataloader_defaults_are_the_run_defaults():
    import inspect

    from data_pipelines.loader import make_dataloader

    params = inspect.signature(make_dataloader).parameters
    for name in ("seq_len", "batch_size", "num_workers", "split_documents", "loss_on"):
        assert params[name].default == default_of(DataConfig, name), name


def test_resolve_section_checks_types_ranges_and_choices():
    assert resolve_section(DataConfig, "data", {"shards": "a.tar"}) == DataConfig(shards=["a.tar"])
    with pytest.raises(ConfigError, match="missing required config field 'data.shards'"):
        resolve_section(DataConfig, "data", {})
    with pytest.raises(ConfigError, match="'data.seq_len' must be int, got str 'x'"):
        resolve_section(DataConfig, "data", {"shards": "a.tar", "seq_len": "x"})
    with pytest.raises(ConfigError, match="'data.loss_on' must be one of"):
        resolve_section(DataConfig, "data", {"shards": "a.tar", "loss_on": "everything"})
    with pytest.raises(ConfigError, match="'data.split_documents' must be bool"):
        resolve_section(DataConfig, "data", {"shards": "a.tar", "split_documents": 1})


def test_set_parser_creates_sections_and_reads_yaml_values():
    raw = {"data": None}
    for text in ("data.seq_len=64", "a.b.c=[1, 2]", "train.lr=1e-3", "x.y="):
        apply_set(raw, text)
    assert raw == {
        "data": {"seq_len": 64},
        "a": {"b": {"c": [1, 2]}},
        "train": {"lr": "1e-3"},
        "x": {"y": None},
    }  # YAML 1.1: a str, as float settings accept
    with pytest.raises(ConfigError, match="'seq_len' is not a section"):
        apply_set(raw, "data.seq_len.deeper=1")
    with pytest.raises(ConfigError, match="expected key.sub=value"):
        apply_set(raw, "novalue")


def test_study_runner_uses_the_same_set_parser(tmp_path):
    from eval.study.config import StudyConfigError, load_study_config

    path = tmp_path / "study.yaml"
    path.write_text("baseline: tiny-moe\n")
    with pytest.raises(StudyConfigError, match="expected key.sub=value"):
        load_study_config(str(path), ["seeds"])
    with pytest.raises(StudyConfigError, match="'baseline' is not a section"):
        load_study_config(str(path), ["baseline.x=1"])
