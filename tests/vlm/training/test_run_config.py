"""Training-config validation: every fault fails at start with a one-line ``ConfigError`` naming the field (unknown
model overrides and presets, model-rule values, non-finite / out-of-range numbers, malformed YAML, missing paths,
shards without a usable sample), and overrides on a checkpoint reaching the model. Fast: no training runs."""

from pathlib import Path

import pytest
import webdataset as wds
import yaml

from data_pipelines.run_config import read_config
from data_pipelines.schema import Sample, Segment, encode_sample
from vlm.training.build import check_data
from vlm.training.config import ConfigError, DataConfig, TrainConfig, check_paths, load_config, resolve, save_config
from vlm.training.step import lr_at

ROOT = Path(__file__).resolve().parents[3]
TINY = str(ROOT / "scripts" / "configs" / "tiny.yaml")


def config_error(*sets: str, path: str = TINY) -> str:
    """The one-line message ``load_config(path, sets)`` fails with."""
    with pytest.raises(ConfigError) as info:
        load_config(path, list(sets))
    message = str(info.value)
    assert "\n" not in message, message
    return message


def write_shard(path: Path, texts: list[str]) -> str:
    """One webdataset shard of text samples (``raw``: a sample dict written as it is, e.g. broken JSON)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with wds.TarWriter(str(path)) as writer:
        for i, text in enumerate(texts):
            writer.write(encode_sample(Sample(key=f"s{i:04d}", segments=[Segment(text=text)])))
    return str(path)


# ----------------------------------------------------------------------------- model.preset / model.overrides
def test_unknown_model_override_names_the_key_and_suggests_the_closest_field():
    message = config_error("model.overrides={target_rr: 4.0}")
    assert "model.overrides.target_rr" in message and "'target_r'" in message
    assert "'freeze_vision'" in config_error("model.overrides={freeze_visoin: true}")  # a VLM field
    assert "data.tokenizer" in config_error("model.overrides={vocab_size: 100}")  # set from the tokenizer
    assert "data.max_patches" in config_error("model.overrides={max_patches: 16}")
    # every field from_preset routes (VLM, backbone, legacy names) still loads
    fields = "{target_r: 1.5, freeze_vision: true, concept_merge: last, pixel_shuffle: 2, router_init: random}"
    assert load_config(TINY, [f"model.overrides={fields}"])["model"]["overrides"]["target_r"] == 1.5


def test_unknown_override_on_a_checkpoint_suggests_and_unchangeable_field_is_refused():
    assert "'target_r'" in config_error("model.init_from=ckpt", "model.overrides={target_rr: 4.0}")
    message = config_error("model.init_from=ckpt", "model.overrides={d_model: 8}")
    assert "d_model" in message and "init_from" in message


def test_unknown_preset_lists_the_presets():
    message = config_error("model.preset=huge")
    assert "'huge'" in message and all(name in message for name in ("tiny", "small", "tiny-moe", "small-moe"))


@pytest.mark.parametrize(
    "overrides, field",
    [
        ("{target_r: 0.5}", "target_r"),
        ("{chunking: sometimes}", "chunking"),
        ("{top_k: 99}", "top_k"),
        ("{pixel_shuffle: 3}", "pixel_shuffle"),
        ("{target_r: many}", "model.overrides"),
        ("{vision_stem: cnn}", "vision_stem"),
        ("{vision_stem: conv, patch_size: 14}", "vision_stem"),
    ],
)
def test_model_rule_violations_fail_at_load(overrides, field):
    assert field in config_error(f"model.overrides={overrides}")


# ----------------------------------------------------------------------------- numbers: finite and in range
@pytest.mark.parametrize(
    "setting, fragment",
    [
        ("train.lr=.inf", "'train.lr' must be a finite number"),
        ("train.lr=.nan", "'train.lr' must be a finite"),
        ("train.lr=inf", "'train.lr' must be a finite"),
        ("train.grad_clip=-.inf", "'train.grad_clip' must be a fin"),
        ("train.lr=0", "'train.lr' must be > 0"),
        ("train.lr=-1e-3", "'train.lr' must be > 0"),
        ("train.weight_decay=-0.1", "'train.weight_decay' must be >= 0"),
        ("train.warmup=-1", "'train.warmup' must"),
        ("train.grad_clip=0", "'train.grad_clip' must be > 0"),
        ("train.eval_every=-1", "'train.eval_every' must be"),
        ("train.min_lr_ratio=1.5", "'train.min_lr_ratio' must be in [0, 1]"),
        ("train.min_lr_ratio=-0.1", "min_lr"),
        ("data.num_workers=-1", "'data.num_workers' must be >= 0"),
        ("train.seed=-1", "'train.seed' must be >= 0"),
        ("data.batch_size=0", "'data.batch_size' must be >= 1"),
        ("train.max_steps=0", "'train.max_steps' must be"),
        ("data.seq_len=1", "'data.seq_len' must be >= 2"),
        ("data.shards=[]", "'data.shards' must"),
        ("data.shards=[1]", "'data.shards' must"),
    ],
)
def test_numeric_fields_must_be_finite_and_in_range(setting, fragment):
    assert fragment in config_error(setting)


def test_boundary_values_are_accepted():
    config = load_config(TINY, ["train.eval_every=0", "train.min_lr_ratio=0", "train.weight_decay=0", "train.seed=0"])
    assert config["train"]["min_lr_ratio"] == 0 and config["train"]["eval_every"] == 0


# ----------------------------------------------------------------------------- YAML: file and --set
def test_malformed_yaml_file_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  preset: tiny\ndata: [shards\ntrain: {}\n")
    message = config_error(path=str(bad))
    assert "bad.yaml:" in message and "line" in message and "invalid YAML" in message
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n- b\n")
    assert "mapping" in config_error(path=str(listed))


def test_missing_config_file():
    assert "no/such.yaml" in config_error(path="no/such.yaml")


@pytest.mark.parametrize("setting", ["train.lr=[1", "train.lr={a: ", "model.overrides={target_r: [}"])
def test_set_value_that_is_not_yaml(setting):
    message = config_error(setting)
    assert setting.split("=")[0] in message and "not valid YAML" in message


def test_set_without_key():
    assert "key.sub=value" in config_error("=3")
    assert "key.sub=value" in config_error("train..lr=3")


# ----------------------------------------------------------------------------- paths that must exist
@pytest.fixture()
def good(tmp_path) -> Path:
    """Two shards of short text samples under ``tmp_path/good``."""
    for i in range(2):
        write_shard(tmp_path / "good" / f"good-{i:03d}.tar", [f"doc {i}: a red square on the left"] * 3)
    return tmp_path / "good"


def paths_error(*sets: str) -> str:
    with pytest.raises(ConfigError) as info:
        check_paths(load_config(TINY, list(sets)))
    assert "\n" not in str(info.value)
    return str(info.value)


def test_paths_are_checked_at_start(good, tmp_path):
    ok = [f"data.shards=[{good}]", "data.eval_shards=null"]
    assert "data.shards" in paths_error(f"data.shards=[{tmp_path / 'nowhere'}]")
    assert "data.eval_shards" in paths_error(ok[0], f"data.eval_shards=[{tmp_path / 'nowhere'}]")
    assert "data.tokenizer" in paths_error(*ok, f"data.tokenizer={tmp_path / 'no-tokenizer'}")
    assert "not a saved model folder" in paths_error(*ok, f"model.init_from={tmp_path / 'missing'}")
    assert "data.shards" in paths_error(f"data.shards=['{good}/good-{{005..006}}.tar']")  # brace, no match
    assert "data.shards" in paths_error(f"data.shards=['{tmp_path}/*.tar']")  # glob, no match


def test_shard_patterns_expand_as_the_loader_expands_them(good):
    for pattern in (str(good), f"{good}/good-{{000..001}}.tar", f"{good}/*.tar", f"{good}/good-000.tar"):
        check_paths(load_config(TINY, [f"data.shards=['{pattern}']", f"data.eval_shards='{pattern}'"]))


# ----------------------------------------------------------------------------- shards with a usable sample
def test_check_data_passes_on_usable_shards(good):
    check_data(load_config(TINY, [f"data.shards=[{good}]", f"data.eval_shards=[{good}/good-001.tar]"]))


def test_shards_without_a_usable_sample_fail_with_the_skip_counts(good, tmp_path):
    long = write_shard(tmp_path / "long" / "long-000.tar", ["many words here " * 200] * 4)
    with pytest.raises(ConfigError) as info:
        check_data(load_config(TINY, [f"data.shards=[{long}]", "data.eval_shards=null", "data.seq_len=32"]))
    message = str(info.value)
    assert "\n" not in message and "data.shards" in message and "4 skipped" in message and "too_long: 4" in message
    empty = tmp_path / "empty" / "empty-000.tar"
    write_shard(empty, [])
    with pytest.raises(ConfigError, match=r"data\.eval_shards: no usable sample"):
        check_data(load_config(TINY, [f"data.shards=[{good}]", f"data.eval_shards=[{empty}]"]))


def test_checkpoint_overrides_reach_the_vlm_chunking_and_switches(tmp_path):
    """``model.overrides`` on a ``model.init_from`` checkpoint: image_chunking / modality_boundaries through
    ``set_chunking`` (validated), the freeze flags as switches; a bad combination is a one-line ConfigError."""
    from vlm.training.build import build_model

    model, processor = build_model(load_config(TINY))
    model.save_pretrained(tmp_path / "ckpt")
    ckpt = f"model.init_from={tmp_path / 'ckpt'}"
    overrides = "model.overrides={image_chunking: rows, modality_boundaries: true, freeze_vision: true}"
    loaded, _ = build_model(load_config(TINY, [ckpt, overrides]))
    assert (loaded.config.image_chunking, loaded.config.modality_boundaries) == ("rows", True)
    assert loaded.config.freeze_vision and not any(p.requires_grad for p in loaded.vision_tower.parameters())
    with pytest.raises(ConfigError, match="model.overrides: .*router2d .* needs text_config.chunking='dynamic'"):
        build_model(load_config(TINY, [ckpt, "model.overrides={image_chunking: router2d, chunking: fixed}"]))


# ----------------------------------------------------------------------------- one typed run config
def test_every_shipped_run_yaml_loads_and_study_yamls_load_as_studies():
    from eval.study.config import deep_merge, load_study_config

    runs = studies = 0
    for path in sorted((ROOT / "scripts" / "configs").glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        if set(raw) <= {"model", "data", "train"}:  # a run config (train_vlm.py --config)
            config = load_config(str(path), [] if "shards" in (raw.get("data") or {}) else ["data.shards=[x.tar]"])
            assert TrainConfig(**config["train"]).max_steps >= 1 and DataConfig(**config["data"]).shards, path
            runs += 1
        else:  # a study config (scripts/study.py --config), its train_base a run config less shards and seed
            base = load_study_config(str(path), out=str(ROOT / "runs" / "unused"))["train_base"]
            assert resolve(deep_merge(base, {"data": {"shards": ["x.tar"]}, "train": {"seed": 0}}))["train"], path
            studies += 1
    assert runs >= 5 and studies >= 1


def test_config_saved_by_an_older_run_loads(tmp_path):
    """A run folder's config.yaml written before the typed sections (model / data / train, every field spelled out,
    the defaults of the time) loads, and a reload of a saved config is the same config."""
    old = {
        "model": {"preset": "tiny", "overrides": {"target_r": 2.0}, "init_from": None},
        "data": {"shards": ["data/tiny/train-*.tar"], "eval_shards": None, "tokenizer": None, "seq_len": 256}
        | {"batch_size": 2, "num_workers": 0, "max_patches": 64, "split_documents": False, "loss_on": "auto"},
        "train": {"max_steps": 40, "save_every": 20, "eval_every": 0, "eval_batches": 4, "seed": 0, "grad_accum": 1}
        | {"lr": 0.003, "min_lr_ratio": 0.1, "weight_decay": 0.01, "warmup": 10, "grad_clip": 1.0}
        | {"router_lr_scale": 0.1, "keep_last": 2, "log_every": 1, "max_nonfinite": 5, "export": True},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    config = load_config(str(tmp_path / "config.yaml"))
    assert config == {**old, "train": {**old["train"], "expert_parallel": 1}}  # a field added since: its default
    save_config(config, str(tmp_path / "again.yaml"))
    assert load_config(str(tmp_path / "again.yaml")) == config


def test_set_keeps_its_spelling_everywhere(tmp_path):
    """``--set key.sub=value`` (value read as YAML) means the same to training, the checker and the study runner."""
    sets = ["train.lr=1e-3", "data.shards=[a.tar, b.tar]", "model.overrides.target_r=1.5", "data.eval_shards=null"]
    config = load_config(TINY, sets)
    assert config["train"]["lr"] == 1e-3 and config["data"]["shards"] == ["a.tar", "b.tar"]
    assert config["model"]["overrides"]["target_r"] == 1.5 and config["data"]["eval_shards"] is None
    assert read_config(TINY, sets)["model"]["overrides"]["target_r"] == 1.5  # the reader the checker and study use
    assert config_error("train.lr") == "--set 'train.lr': expected key.sub=value"


def test_lr_schedule_reads_the_train_section():
    train = TrainConfig(**load_config(TINY, ["train.max_steps=100", "train.warmup=10", "train.lr=1.0"])["train"])
    assert lr_at(4, train) == pytest.approx(0.5) and lr_at(10, train) == pytest.approx(1.0)
    assert lr_at(100, train) == pytest.approx(train.min_lr_ratio)
