"""The seeing probe (``vlm.training.probe``): a tiny VLM must learn to read a small object's colour.

This is the convergence test that keeps a later change from silently blinding the toolkit's models (issue #25):
every model the toolkit trained before it answered one constant per question type.
"""

import importlib.util
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from data_pipelines.synthetic import scenes
from eval.score_table import binomial_tail
from vision_tower import VisionTower
from vision_tower.boxes import patches_in_boxes
from vlm import ConceptMoEVLMConfig
from vlm.training.probe import ProbeConfig, SeeingProbe, Stage, scene_as_text, training_samples, true_words


def test_a_tiny_vlm_reads_a_small_objects_colour_after_a_size_curriculum():
    """Colour questions about one small object (12-42% of the short side, the generator's own sizes), held out;
    training sees large objects, then medium ones (the curriculum of docs/seeing.md). A blind model scores the
    best constant answer ("chance"): the score must beat it by a margin a binomial test at 1e-4 calls significant."""
    cfg = ProbeConfig(
        types=("colour",),
        stages=[Stage(0, 1, (0.6, 0.95)), Stage(60, 1, (0.3, 0.6))],
        steps=120,
        eval_every=120,
        eval_n=96,
        seed=0,
    )
    (score,) = SeeingProbe(cfg).run()
    n = cfg.eval_n
    right = round(score.accuracy["colour"] * n)
    assert score.chance["colour"] < 0.25 and score.distinct["colour"] > 3, score  # 8 colours, none dominant
    assert binomial_tail(right, n, score.chance["colour"]) < 1e-4, score
    assert score.r["image"] == 1.0 and score.r["text"] == 1.0  # tiny-moe: no chunking, every token its own concept


def test_probe_cli_refuses_bad_settings_in_one_line(capsys):
    """A probe that could not run (unknown type, a stage not at step 0 or out of order, sizes the generator refuses,
    rows too short for any conversation) stops with one line."""
    path = Path(__file__).resolve().parents[3] / "scripts" / "probe_seeing.py"
    spec = importlib.util.spec_from_file_location("probe_seeing", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    for argv, says in (
        (["--types", "color"], "types must be among"),
        (["--stage", "5:1"], "first --stage must start at step 0"),
        (["--stage", "0:1", "--stage", "0:2"], "increasing order"),
        (["--stage", "0:9"], "max_objects must be in 1..5"),
        (["--stage", "0:1:0.5"], "expected START:MAX_OBJECTS[:LOW-HIGH]"),
        (["--stage", "0:1:0.9-0.99"], "object_size must be"),
        (["--stage", "0:1:0.8-0.95:shape", "--types", "colour"], "a stage trains ['shape'], which are not among"),
        (["--stage", "0:1:0.8-0.95:shape:x"], "expected START:MAX_OBJECTS[:LOW-HIGH][:TYPES]"),
        (["--set", "pixel_shuffle"], "expected FIELD=JSON"),
        (["--turns", "some"], "turns must be 'one' or 'all'"),
        (["--scene-input", "audio"], "scene_input must be one of"),
        (["--scene-input", "true_words"], "needs vision_words=true"),
        (["--eval-objects", "3", "--eval-min-objects", "4"], "eval_min_objects <= eval_objects"),
        (["--types", "needle", "--needle-units", "3-1"], "min_units <= max_units"),
        (["--types", "needle", "--needle-modalities", "audio"], "modalities must be"),
        (["--seq-len", "32", "--steps", "1", "--eval-n", "1"], "skipped (too_long"),  # counted, then refused
    ):
        with pytest.raises(SystemExit) as stopped:
            script.main(argv)
        assert stopped.value.code == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert says in err[-1], (argv, err[-1])


def test_stage_syntax_takes_the_question_types_a_stage_trains():
    path = Path(__file__).resolve().parents[3] / "scripts" / "probe_seeing.py"
    spec = importlib.util.spec_from_file_location("probe_seeing", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.parse_stage("0:1:0.8-0.95:shape") == Stage(0, 1, (0.8, 0.95), ("shape",))
    assert script.parse_stage("300:1:colour,shape") == Stage(300, 1, None, ("colour", "shape"))
    assert script.parse_stage("300:2") == Stage(300, 2, None, None)
    cfg = ProbeConfig(types=("colour", "shape"), stages=[Stage(0, 1, None, ("shape",))])
    stream = training_samples(cfg, cfg.stages[0], 0)
    assert {next(stream).meta["type"] for _ in range(12)} == {"shape"}  # only the stage's type is trained
    both = training_samples(cfg, Stage(0, 1), 0)
    assert {next(both).meta["type"] for _ in range(12)} == {"colour", "shape"}
    multi = training_samples(ProbeConfig(types=("colour", "shape"), turns="all"), Stage(0, 1), 0)
    for sample in (next(multi) for _ in range(4)):  # both questions of a scene in one conversation
        assert sample.meta["type"] == "multi" and sorted(sample.meta["types"]) == ["colour", "shape"]


def test_held_out_binding_questions_come_from_scenes_of_several_objects():
    """``eval_min_objects`` 2: every held-out question is about a scene of 2-3 objects, asked the trained types."""
    cfg = ProbeConfig(types=("colour", "shape"), eval_objects=3, eval_min_objects=2, eval_n=40, steps=1)
    items = SeeingProbe(cfg).eval_items
    assert len(items) == 40 and {s.meta["type"] for s in items} == {"colour", "shape"}
    assert all(2 <= s.meta["objects"] <= 3 for s in items)
    mixed = SeeingProbe(ProbeConfig(types=("colour",), eval_objects=3, eval_n=40, steps=1)).eval_items
    assert {s.meta["objects"] for s in mixed} == {1, 2, 3}


def test_copy_steps_train_the_language_model_alone_before_the_questions():
    """``copy_steps``: copy rows for the language model (what a needle answer needs), the tower untouched."""
    probe = SeeingProbe(ProbeConfig(types=("needle",), seq_len=512, steps=1, eval_n=2, copy_steps=3))
    tower = {k: v.clone() for k, v in probe.model.named_parameters() if not k.startswith("language_model.")}
    embed = probe.model.language_model.get_input_embeddings().weight.clone()
    scores = probe.pretrain_copying()
    assert [s.step for s in scores] == [1, 2, 3]
    assert scores[0].chance == round(1 / (probe.model.language_model.config.vocab_size - 10), 6)
    assert not torch.equal(embed, probe.model.language_model.get_input_embeddings().weight)
    assert all(torch.equal(v, dict(probe.model.named_parameters())[k]) for k, v in tower.items())
    assert SeeingProbe(ProbeConfig(types=("needle",), seq_len=512, steps=1, eval_n=2)).pretrain_copying() == []
    with pytest.raises(ValueError, match="copy_steps >= 0"):
        SeeingProbe(ProbeConfig(copy_steps=-1))


def test_text_scene_input_writes_the_objects_out_in_place_of_the_image():
    cfg = ProbeConfig(types=("colour", "shape"), scene_input="text")
    for sample in (next(training_samples(cfg, Stage(0, 3), 0)) for _ in range(6)):
        (user, answer) = sample.turns
        assert all(seg.image is None for seg in user.segments)
        listing = user.segments[0].text
        assert listing == ", ".join(r["text"] for r in sample.meta["regions"]) + "."
        assert sample.meta["question"] in "".join(seg.text for seg in user.segments)
    probe = SeeingProbe(ProbeConfig(types=("colour",), scene_input="text", eval_n=4, steps=1))
    assert all(s.turns == scene_as_text(s).turns for s in probe.eval_items)  # held out as text too


def _probe_with_true_words(tmp_path, **options) -> SeeingProbe:
    tower = VisionTower(**ConceptMoEVLMConfig.from_preset("tiny-moe").tower_kwargs())
    tower.add_word_head([11, 12, 13])
    path = tmp_path / "tower.safetensors"
    save_file({k: v.contiguous() for k, v in tower.state_dict().items()}, str(path))
    overrides = {"vision_weights": str(path), "vision_words": True}
    return SeeingProbe(ProbeConfig(types=("colour",), overrides=overrides, scene_input="true_words", **options))


def test_true_words_give_each_image_the_words_of_its_own_objects(tmp_path):
    """Every training image gets the regions of its own sample: the patches inside the object's box show mostly
    that object's colour (images and regions out of step would mostly disagree)."""
    probe = _probe_with_true_words(tmp_path, stages=[Stage(0, 1, (0.4, 0.6))], steps=2, eval_n=2)
    rgb = {name: torch.tensor(value, dtype=torch.float32) for name, value in scenes.COLOURS.items()}
    seen = 0
    for _, batch, regions in probe.batches():
        assert len(regions) == len(batch["patches"]) > 1
        for i, (region,) in enumerate(regions):
            box_14 = torch.tensor([region["box"]])
            inside_L = patches_in_boxes(batch["patch_coord"][i], batch["grid_hw"][i], box_14)[:, 0]
            pixels = (batch["patches"][i][inside_L & batch["patch_valid"][i].bool()].view(-1, 3) * 0.5 + 0.5) * 255
            names = list(rgb)  # each pixel's named colour, where it is one (the background is not)
            dist_PC = torch.cdist(pixels, torch.stack([rgb[n] for n in names]))
            named = dist_PC.min(-1).indices[dist_PC.min(-1).values < 30]
            assert names[int(named.mode().values)] in region["text"].split(), region
            seen += 1
    assert seen >= 4 and len(probe.regions) <= 1  # handed out; at most the packer's one waiting document's left


def test_true_words_replace_the_word_heads_output_only_inside_the_block(tmp_path):
    probe = _probe_with_true_words(tmp_path, steps=1, eval_n=2)
    tower = probe.model.vision_tower
    image, _ = scenes.render_scene(random.Random(0))
    batch = probe.processor.image_processor([image])
    feats = tower(batch["patches"], batch["patch_coord"], batch["patch_valid"])
    target_BLK = torch.zeros_like(tower.word_probs(feats))
    target_BLK[0, 0, 1] = 1.0
    with true_words(tower, target_BLK):
        assert torch.equal(tower.word_probs(feats), target_BLK)
    assert not torch.equal(tower.word_probs(feats), target_BLK)  # the head again
    with pytest.raises(ValueError, match="needs vision_words=true"):
        SeeingProbe(ProbeConfig(scene_input="true_words"))
