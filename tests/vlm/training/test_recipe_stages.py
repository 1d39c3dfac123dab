"""The shipped recipe's stages (as ``make demo`` runs them) end to end at toy size: stage 0 pretrains the tower on
caption words and region labels (``scripts/pretrain_vision.py --objective multilabel --region-labels 10``, the tower
``stage1_colour.yaml`` names), stage 1a (``scripts/configs/stage1_colour.yaml``) loads it, frozen, with its word head
(image tokens are its words alone: no projector), and trains on one-object
questions written with the generator's options, stage 1b (``stage1.yaml``) and stage 2 (``stage2.yaml``) each start
from the HF export before them with the tower still as pretrained; ``stage2_long.yaml`` validates. ``make
instruct-bind``'s path runs too: stage 1a with its model settings (``BIND_MODEL_SET``: each modality's own target R,
the concept norm's starting gain), the binding stage (``stage_bind.yaml``) from stage 1b's export, stage 2 from the
binding stage's, its shards with a brace pattern of some binding shards added (``BIND_KEEP``). The shard lists the
YAMLs name are the ones ``make demo`` makes and passes to each stage."""

import json
import re
import shlex
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from train_kit import ROOT, env

from data_pipelines.make_shards import make_synthetic
from vlm import ConceptMoEVLM
from vlm.training.config import load_config
from vlm.training.vision_pretraining import TOWER_FIELDS

CONFIGS = ROOT / "scripts" / "configs"


def stage(config: str, out, shards, *sets: str) -> None:
    cmd = [sys.executable, str(ROOT / "scripts" / "train_vlm.py"), "--config", str(CONFIGS / config), "--out", str(out)]
    base = [
        f"data.shards=[{shards / 'train'}]",
        f"data.eval_shards=[{shards / 'eval'}]",
        "data.seq_len=256",
        "data.num_workers=0",
        "train.max_steps=2",
        "train.save_every=2",
        "train.log_every=1",
    ]
    for item in base + list(sets):
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "hf" / "config.json").is_file()


@pytest.fixture(scope="module")
def toy_tower(tmp_path_factory):
    """Stage 0 at toy size, as ``make demo`` runs it: the tower ``stage1_colour.yaml`` names, with its word head
    (region labels), pretrained for 2 steps on one-object scenes."""
    tmp_path = tmp_path_factory.mktemp("tower")
    make_synthetic(
        ["scenes"],
        str(tmp_path / "vision"),
        num_samples=16,
        seed=0,
        eval_samples=4,
        generator_options={"max_objects": 1},
    )
    tower = tmp_path / "tower.safetensors"
    overrides = load_config(str(CONFIGS / "stage1_colour.yaml"))["model"]["overrides"]
    stage1_tower = {k: v for k, v in overrides.items() if k in TOWER_FIELDS}  # stage 0 builds the tower stage 1a loads
    assert stage1_tower["vision_stem"] == "conv" and overrides["vision_words"] is True
    assert overrides["vision_projector"] is False and overrides["vision_summary"] is False
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "pretrain_vision.py"),
        "--objective",
        "multilabel",
        "--shards",
        str(tmp_path / "vision" / "train"),
        *[f"--set={k}={json.dumps(v)}" for k, v in stage1_tower.items()],
        "--steps",
        "2",
        "--batch-size",
        "8",
        "--warmup",
        "1",
        "--region-labels",
        "10",
        "--out",
        str(tower),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tower


def test_stage1_then_stage2_train_and_export_at_toy_size(tmp_path, toy_tower):
    shards = tmp_path / "look"
    make_synthetic(
        ["scenes_chat"],
        str(shards),
        num_samples=24,
        seed=0,
        eval_samples=8,
        generator_options={"max_objects": 1, "types": ["colour", "shape", "position"]},
    )
    tower = toy_tower
    bind_sets = shlex.split(makefile_value("BIND_MODEL_SET"))[1::2]  # the items of its `--set ITEM` pairs
    assert bind_sets and all(item.startswith("model.overrides.") for item in bind_sets)
    tower_set = f"model.overrides.vision_weights={tower}"
    stage("stage1_colour.yaml", tmp_path / "stage1_colour", shards, tower_set, *bind_sets)
    stage("stage1.yaml", tmp_path / "stage1", shards, f"model.init_from={tmp_path / 'stage1_colour' / 'hf'}")
    stage("stage_bind.yaml", tmp_path / "stage_bind", shards, f"model.init_from={tmp_path / 'stage1' / 'hf'}")
    stage(
        "stage2.yaml",
        tmp_path / "stage2",
        shards,
        f"model.init_from={tmp_path / 'stage_bind' / 'hf'}",
        f'data.shards=[{shards / "train"},"{shards / "train"}/train-{{000000..000000}}.tar"]',  # as BIND_KEEP adds
        "train.eval_every=2",
        "train.eval_batches=1",
    )
    steps = [json.loads(line) for line in (tmp_path / "stage2" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "loss" in s] == [1, 2] and any("eval_loss" in s for s in steps)
    long, short = (load_config(str(CONFIGS / name))["train"] for name in ("stage2_long.yaml", "stage2.yaml"))
    assert long["max_steps"] > short["max_steps"] and long["save_every"] <= long["max_steps"]
    # each stage exports stage 0's tower and word head, untouched (the summary pool stays behind: vision_summary off)
    pretrained = {k: v for k, v in load_file(str(tower)).items() if not k.startswith("summary_pool.")}
    assert any(k.startswith("word_head.") for k in pretrained)
    for name in ("stage1_colour", "stage1", "stage_bind", "stage2"):
        model = ConceptMoEVLM.from_pretrained(str(tmp_path / name / "hf"))
        text = model.config.text_config  # instruct-bind's settings travel with every export
        assert text.target_r_by_modality == {"0": 2.0, "1": 2.0} and text.concept_norm_init == 0.1, name
        exported = model.vision_tower.state_dict()
        assert len(exported) == len(pretrained) and model.projector is None, name
        for k, v in pretrained.items():
            assert torch.equal(exported[k if k.startswith("word_head.") else "model." + k], v), (name, k)


def makefile_value(name: str) -> str:
    """The value of the Makefile's ``NAME := ...`` line (continuations joined), e.g. ``make instruct-bind``'s stage-1a
    settings ``BIND_MODEL_SET``."""
    makefile = (ROOT / "Makefile").read_text()
    return re.search(rf"^{name} := (.*)$", makefile.replace("\\\n", " "), re.M).group(1)


def test_instruct_bind_passes_its_stage2_settings_that_stage2_yaml_knows():
    items = shlex.split(makefile_value("BIND_STAGE2_SET"))
    assert items[0::2] == ["--set"] * (len(items) // 2)
    sets = dict(item.split("=", 1) for item in items[1::2])
    train = load_config(str(CONFIGS / "stage2.yaml"))["train"]
    assert sets and all(k.startswith("train.") and k[len("train.") :] in train for k in sets), sets
    steps, every = int(sets["train.max_steps"]), int(sets["train.save_every"])
    assert steps > train["max_steps"] and steps % every == 0  # longer than make demo's stage 2, ends on a save
    target = (ROOT / "Makefile").read_text().split("\ninstruct-bind:")[1].split("\n\n")[0]
    assert 'STAGE2_SET="$(BIND_STAGE2_SET) $(STAGE2_SET)"' in target


def expanded(name: str) -> str:
    """:func:`makefile_value` with its ``$(NAME)`` references to other ``NAME := ...`` lines expanded, as make does."""
    return re.sub(r"\$\((\w+)\)", lambda m: expanded(m.group(1)), makefile_value(name))


def test_instruct_copy_bind_text_stage_builds_the_binding_model_that_stage1a_starts_from(tmp_path, toy_tower):
    """``make instruct-copy-bind``'s path at toy size: the text stage (``stage0_text.yaml``) builds the model with the
    words-alone tokens and instruct-bind's model settings (``COPY_BIND_TEXT_SET``) on copy requests, stage 1a starts
    from its export (``FROM_TEXT``) and keeps all of it: tied embeddings, each modality's target R, the concept norm's
    gain, image tokens that are the tower's words alone; the Makefile keeps copy requests in the later mixes."""
    copying, look = tmp_path / "copying", tmp_path / "look"
    make_synthetic(["copying_chat"], str(copying), num_samples=24, seed=0, eval_samples=8)
    options = {"max_objects": 1, "types": ["colour"]}
    make_synthetic(["scenes_chat"], str(look), num_samples=16, seed=0, eval_samples=4, generator_options=options)
    text_sets = shlex.split(expanded("COPY_BIND_TEXT_SET"))
    assert text_sets[0::2] == ["--set"] * (len(text_sets) // 2)
    stage(
        "stage0_text.yaml",
        tmp_path / "stage0_text",
        copying,
        f"model.overrides.vision_weights={toy_tower}",
        *text_sets[1::2],
    )
    makefile = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    from_text = shlex.split(
        re.search(r"^FROM_TEXT = (.*)$", makefile, re.M).group(1).replace("$(DEMO_RUN)", str(tmp_path))
    )
    stage("stage1_colour.yaml", tmp_path / "stage1_colour", look, *from_text[1::2])
    for name in ("stage0_text", "stage1_colour"):
        model = ConceptMoEVLM.from_pretrained(str(tmp_path / name / "hf"))
        text = model.config.text_config
        assert text.tie_word_embeddings and text.initializer_range == 0.02, name  # the copy's init
        assert text.target_r_by_modality == {"0": 2.0, "1": 2.0} and text.concept_norm_init == 0.1, name
        assert model.config.vision_words and model.projector is None, name
        lm = model.language_model
        assert lm.get_output_embeddings().weight is lm.get_input_embeddings().weight, name
    # later mixes keep some copy requests: a quoted brace pattern of the copying shards (binding stage and stage 2)
    keep = re.search(r"^COPY_KEEP = (.*)$", makefile, re.M).group(1)
    assert re.fullmatch(r',"\$\(DEMO_DATA\)/copying/train/train-\{0+\.\.0*[1-9]\d*\}\.tar"', keep)
    target = makefile.split("\ninstruct-copy-bind:")[1].split("\n\n")[0]
    assert "TEXT_STAGE=1" in target and "BIND_STAGE=1" in target and "BIND_EXTRA='$(COPY_KEEP)'" in target
    assert "/needles_long/train$(COPY_KEEP)" in target and '"$(COPY_BIND_STAGE2_SET) $(STAGE2_SET)"' in target
    stage2 = shlex.split(expanded("COPY_BIND_STAGE2_SET"))[1::2]
    data = load_config(str(CONFIGS / "stage2.yaml"))["data"]
    sets = dict(item.split("=", 1) for item in stage2)
    assert all(k.split(".")[0] in ("train", "data") for k in sets) and {"seq_len", "batch_size"} <= set(data)
    assert int(sets["data.seq_len"]) >= 1280  # the short needle haystacks (~1,100 tokens) fit a row


def test_make_demo_passes_each_stage_its_yaml_shards_and_makes_them():
    makefile = (ROOT / "Makefile").read_text().replace("$(DEMO_DATA)", "data/demo")
    made = set(re.findall(r"--out data/demo/(\w+)", makefile))
    variables = dict(re.findall(r"^(\w+) = (\S+)$", makefile, re.M))

    def expand(value: str) -> str:  # the Makefile's $(NAME) references to its `NAME = ...` lines, as make does
        return re.sub(
            r"\$\((\w+)\)", lambda m: expand(variables[m.group(1)]) if m.group(1) in variables else m.group(0), value
        )

    configs = {"scripts/configs/stage1_colour.yaml", "scripts/configs/stage1.yaml", "$(STAGE2)"}
    passed = {}  # each `$(DS)` command of the demo recipe: its --config -> the shard list it passes
    demo = makefile[makefile.index("\ndemo:") : makefile.index("\ninstruct-long:")]
    keep = "$(if $(BIND_STAGE),$(BIND_KEEP))"  # BIND_STAGE=1: stage 2 keeps asking binding questions
    for command in demo.split("$(DS) ")[1:]:
        shards = re.search(r"--set 'data\.shards=\[([^\]]*)\]'", command).group(1)
        config = re.match(r"--config (\S+)", command).group(1)
        assert (keep in shards) == (config == "$(STAGE2)"), config
        passed[config] = expand(shards.replace(keep, "")).split(",")
    # a brace pattern of the binding shards that make demo makes (quoted: YAML reads a bare { as a mapping)
    assert re.fullmatch(r',"data/demo/bind/train/train-\{0+\.\.0*[1-9]\d*\}\.tar"', expand(variables["BIND_KEEP"]))
    text_cmd = makefile[makefile.index("\nTEXT_CMD = ") : makefile.index("\nFROM_TEXT = ")]  # TEXT_STAGE=1's stage
    assert "$(if $(TEXT_STAGE),$(COPYING_SHARDS) && $(TEXT_CMD))" in makefile and "--config" in text_cmd
    passed["scripts/configs/stage0_text.yaml"] = re.search(r"data\.shards=\[([^\]]*)\]", text_cmd).group(1).split(",")
    configs.add("scripts/configs/stage0_text.yaml")
    bind_cmd = makefile[makefile.index("\nBIND_CMD = ") : makefile.index("\nSCENEQA_N ")]  # BIND_STAGE=1's stage
    assert "$(if $(BIND_STAGE),$(BIND_SHARDS) && $(BIND_CMD))" in demo and "--config" in bind_cmd
    bind_shards = re.search(r"data\.shards=\[([^\]]*)\]", bind_cmd).group(1)
    assert bind_shards.endswith("$(BIND_EXTRA)")  # instruct-copy-bind adds its copy requests there
    passed["scripts/configs/stage_bind.yaml"] = bind_shards.replace("$(BIND_EXTRA)", "").split(",")
    configs.add("scripts/configs/stage_bind.yaml")
    assert set(passed) == configs
    for config, shards in passed.items():
        data = load_config(str(ROOT / config.replace("$(STAGE2)", "scripts/configs/stage2.yaml")))["data"]
        assert shards == data["shards"], config
        for shard in data["shards"] + (data.get("eval_shards") or []):
            assert shard.startswith("data/demo/") and shard.split("/")[2] in made, (config, shard)


def test_text_stage_then_needle_stage_train_tied_and_export_at_toy_size(tmp_path):
    """The needle recipe's stages: ``stage0_text.yaml`` builds the model with tied embeddings and trains on copy
    requests (text only), ``stage_needles.yaml`` starts from its export on text needles whose answer restates the
    needle; both exports keep the language model's output layer tied to its input embeddings."""
    copying, needles = tmp_path / "copying", tmp_path / "needles"
    make_synthetic(["copying_chat"], str(copying), num_samples=48, seed=0, eval_samples=8)
    options = {"min_units": 1, "max_units": 2, "modalities": "text"}
    make_synthetic(["needles_chat"], str(needles), num_samples=8, seed=0, eval_samples=4, generator_options=options)
    stage("stage0_text.yaml", tmp_path / "text", copying, "model.overrides.vision_weights=null")
    stage("stage_needles.yaml", tmp_path / "needles_stage", needles, f"model.init_from={tmp_path / 'text' / 'hf'}")
    before = ConceptMoEVLM.from_pretrained(str(tmp_path / "text" / "hf")).language_model
    model = ConceptMoEVLM.from_pretrained(str(tmp_path / "needles_stage" / "hf")).language_model
    assert model.config.tie_word_embeddings and before.config.tie_word_embeddings
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert not torch.equal(model.get_input_embeddings().weight, before.get_input_embeddings().weight)  # it trained
    for name in ("stage0_text.yaml", "stage_needles.yaml"):
        data = load_config(str(CONFIGS / name))["data"]
        assert data["shards"][0].startswith("data/demo/") and data["seq_len"] >= 512, name
