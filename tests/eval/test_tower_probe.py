"""Linear probes of a vision tower (``eval/tower_probe.py``, ``scripts/probe_tower.py``): the probe finds what is
linearly there and nothing that is not, features ignore padding, labels stay aligned with their pictures, and a
tower file is rebuilt from the record beside it."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from data_pipelines.synthetic.scenes import COLOURS, SHAPES
from data_pipelines.tokenizer import load_tokenizer
from eval import tower_probe
from eval.tower_probe import linear_probe_accuracy, load_tower, one_object_scenes, probe_tower, tower_features
from vision_tower import VisionTower
from vlm.config import ConceptMoEVLMConfig
from vlm.training.vision_pretraining import write_tower

TOWER = {"vision_embed_dim": 32, "vision_depth": 1, "vision_heads": 2, "vision_stem": "conv"}
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "probe_tower.py"


def tiny_tower(seed: int = 0) -> VisionTower:
    torch.manual_seed(seed)
    kwargs = ConceptMoEVLMConfig.from_preset("tiny", **TOWER).tower_kwargs()
    return VisionTower(**{**kwargs, "summary": True}).eval()


def test_linear_probe_reads_a_linear_label_and_not_noise():
    gen = torch.Generator().manual_seed(0)
    x_ND = torch.randn(600, 12, generator=gen)
    words = ["a", "b", "c"]
    y = [words[i] for i in torch.bucketize(x_ND[:, 3] * 2 + x_ND[:, 7], torch.tensor([-1.0, 1.0])).tolist()]
    assert linear_probe_accuracy(x_ND[:400], y[:400], x_ND[400:], y[400:]) > 0.9
    noise = [words[i] for i in torch.randint(0, 3, (600,), generator=gen).tolist()]
    assert linear_probe_accuracy(x_ND[:400], noise[:400], x_ND[400:], noise[400:]) < 0.5  # chance 1/3


def test_features_of_an_image_do_not_depend_on_its_batch():
    tower = tiny_tower()
    images, _ = one_object_scenes(6, seed=3)
    alone = tower_features(tower, images[:1])
    batched = tower_features(tower, images, batch=6)  # other canvas sizes: the first image's row is padded
    assert set(alone) == {"patches", "summary"} and batched["patches"].shape == (6, 2 * TOWER["vision_embed_dim"])
    for name in alone:
        torch.testing.assert_close(batched[name][:1], alone[name], atol=1e-5, rtol=1e-4)


def test_a_random_conv_tower_carries_colour_and_the_labels_follow_their_pictures():
    scores = {(s.features, s.attribute): s for s in probe_tower(tiny_tower(), n_train=300, n_test=150)}
    colour = scores["patches", "colour"]
    assert colour.accuracy > colour.chance + 0.3  # the colour of the object's pixels is linear in the patches
    images, labels = one_object_scenes(3, seed=0)
    again_images, again_labels = one_object_scenes(3, seed=0)
    assert labels == again_labels and all(a.tobytes() == b.tobytes() for a, b in zip(images, again_images))
    assert all(set(label) == {"colour", "shape", "position"} for label in labels)


def test_a_tower_file_is_rebuilt_from_its_record_with_or_without_its_summary_pool(tmp_path):
    tower = tiny_tower(1)
    out = tmp_path / "tower.safetensors"
    fields = {"vision_model": "naflexvit_base_patch16_gap", "patch_size": 16, "vision_pos_embed": None, **TOWER}
    write_tower(out, tower, {"tower": fields})
    images, _ = one_object_scenes(2, seed=5)
    loaded = load_tower(out)
    for name, value in tower_features(tower, images).items():
        torch.testing.assert_close(tower_features(loaded, images)[name], value)
    timm_only = tmp_path / "timm_only.safetensors"
    save_file({k: v for k, v in load_file(str(out)).items() if not k.startswith("summary_pool.")}, str(timm_only))
    timm_only.with_suffix(".json").write_text(json.dumps({"tower": fields}))
    assert set(tower_features(load_tower(timm_only), images)) == {"patches"}


def test_probe_script_prints_one_line_per_feature_set_and_refuses_bad_input(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("probe_tower", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "tower.safetensors"
    write_tower(out, tiny_tower(), {"tower": TOWER})
    assert script.main([str(out), "--train", "40", "--test", "20", "--json", str(tmp_path / "p.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["summary", "patches"] and "chance" in lines[0]
    assert len(json.loads((tmp_path / "p.json").read_text())) == 6
    assert script.main([str(out), "--train", "4", "--test", "2", "--words"]) == 2  # a tower without a word head
    assert capsys.readouterr().err.count("\n") == 1
    tokenizer = load_tokenizer()
    with_head = tiny_tower()
    with_head.add_word_head(sorted({t for w in (*COLOURS, *SHAPES) for t in tokenizer(" " + w)["input_ids"]}))
    write_tower(out, with_head, {"tower": TOWER})
    assert script.main([str(out), "--train", "4", "--test", "2", "--words"]) == 0
    assert capsys.readouterr().out.splitlines()[2].startswith("word head: colour named ")
    assert script.main([str(tmp_path / "missing.safetensors")]) == 2
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script.main([str(out), "--set", "depth=3"])
    capsys.readouterr()
    narrower = tmp_path / "narrow.safetensors"
    write_tower(narrower, tiny_tower(), {"tower": {**TOWER, "vision_embed_dim": 64, "vision_heads": 4}})
    assert script.main([str(narrower), "--train", "4", "--test", "2"]) == 2  # weights that do not fit the record
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.parametrize("bound", [True, False])
def test_the_binding_probe_tells_bound_features_from_a_bag_of_attributes(monkeypatch, bound):
    """Oracle features built from each scene's objects: one slot per (shape, colour) pair reads every shape's
    colour; the bag of the scene's colours and shapes (what the word labels alone ask for) reads no better than
    ``unbound`` (one of the scene's colours at random) and far below the bound features."""
    scenes_by_image: dict[int, list[dict]] = {}
    original = tower_probe.binding_scenes

    def remembered(n, seed):
        images, scenes = original(n, seed)
        scenes_by_image.update({id(image): objs for image, objs in zip(images, scenes)})
        return images, scenes

    def oracle(tower, images, max_patches=64):
        rows = []
        for image in images:
            x = torch.zeros(len(SHAPES) * len(COLOURS) + len(SHAPES) + len(COLOURS))
            for o in scenes_by_image[id(image)]:
                s, c = SHAPES.index(o["shape"]), list(COLOURS).index(o["colour"])
                if bound:
                    x[s * len(COLOURS) + c] = 1
                else:
                    x[len(SHAPES) * len(COLOURS) + s] = x[len(SHAPES) * len(COLOURS) + len(SHAPES) + c] = 1
            rows.append(x)
        return {"patches": torch.stack(rows)}

    monkeypatch.setattr(tower_probe, "binding_scenes", remembered)
    monkeypatch.setattr(tower_probe, "tower_features", oracle)
    (score,) = tower_probe.probe_binding(None, n_train=600, n_test=300)
    assert score.attribute == "colour_of_shape" and 0.3 < score.unbound < 0.5 and score.chance < 0.25
    if bound:
        assert score.accuracy > 0.95
    else:
        assert score.accuracy < score.unbound + 0.1


class PixelTower(torch.nn.Module):
    """A stand-in tower whose features are each patch's mean RGB: it carries colour where the colour is, and no
    shape, so the per-object probe must read colour from the object's own patches (labels aligned) and not shape."""

    patch_size = 16

    def forward(self, patches, patch_coord, patch_valid):
        from vision_tower.tower import VisionFeatures

        rgb_BL3 = patches.reshape(*patches.shape[:2], -1, 3).mean(2) * patch_valid[..., None]
        return VisionFeatures(rgb_BL3, patch_valid.bool(), patch_coord.long())


def test_the_object_probe_reads_each_objects_colour_from_its_own_patches():
    scores = {(s.features, s.attribute): s for s in tower_probe.probe_objects(PixelTower(), n_train=300, n_test=150)}
    assert set(scores) == {(f, a) for f in tower_probe.OBJECT_FEATURES for a in ("colour", "shape")}
    for features in tower_probe.OBJECT_FEATURES:
        colour, shape = scores[(features, "colour")], scores[(features, "shape")]
        assert colour.accuracy > 0.75 and colour.chance < 0.25  # 8 colours: misaligned labels would read ~0.15
        assert shape.accuracy < colour.accuracy - 0.3


class WordPixelTower(PixelTower):
    """:class:`PixelTower` with a word head that names a colour on the patches painted in that colour alone (mean
    RGB within 0.05 of it, the processor's normalisation undone), no shape anywhere; ``bag=True``: every word on
    every patch. Each word is one token id; "triangle" is two pieces, which must both be named to count."""

    ids = {**{c: [100 + i] for i, c in enumerate(COLOURS)}, **{s: [200 + i] for i, s in enumerate(SHAPES)}}
    ids["triangle"] = [300, 301]

    def __init__(self, bag: bool = False):
        super().__init__()
        self.bag = bag
        self.ids_K = torch.tensor(sorted({t for pieces in self.ids.values() for t in pieces}))
        self.rgb_K3 = torch.full((len(self.ids_K), 3), -9.0)  # no patch is this colour
        for colour, rgb in COLOURS.items():
            self.rgb_K3[self.ids_K.tolist().index(self.ids[colour][0])] = torch.tensor(rgb) / 127.5 - 1.0

    def require_word_head(self):
        return self

    def word_probs(self, feats):
        if self.bag:
            return feats.valid_BL[..., None].float().expand(-1, -1, len(self.ids_K))
        near_BLK = (feats.features_BLD[..., None, :] - self.rgb_K3).abs().amax(-1) < 0.05
        return (near_BLK & feats.valid_BL[..., None]).float()


def test_the_word_head_probe_counts_each_objects_own_words_and_the_others():
    n = 60
    ids = WordPixelTower.ids
    colours, shapes = tower_probe.probe_word_head(WordPixelTower(), ids, n=n)
    assert (colours.attribute, shapes.attribute, colours.objects) == ("colour", "shape", shapes.objects)
    # small objects seldom fill a patch; a patch of one colour lies in that colour's box only
    assert colours.named > 0.15 and colours.foreign == 0.0
    assert shapes.named == shapes.foreign == 0.0
    names = list(COLOURS)  # each detector asked as the next colour's word: the objects' own words are never named
    rotated = {**ids, **{c: ids[names[(i + 1) % len(names)]] for i, c in enumerate(names)}}
    wrong, _ = tower_probe.probe_word_head(WordPixelTower(), rotated, n=n)
    assert wrong.named == 0.0 and wrong.foreign > 0.0
    scenes = tower_probe.binding_scenes(n, 10)[1]
    mixed = {a: sum(len({o[a] for o in s}) > 1 for s in scenes for _ in s) for a in ("colour", "shape")}
    bag = {s.attribute: s for s in tower_probe.probe_word_head(WordPixelTower(bag=True), ids, n=n)}
    assert colours.objects == sum(len(s) for s in scenes)
    for a in ("colour", "shape"):
        assert bag[a].named == 1.0 and bag[a].foreign == mixed[a] / colours.objects
    one_piece = {**ids, "triangle": [300, 999]}  # a piece the head does not name: refused, not counted as unnamed
    with pytest.raises(ValueError, match="triangle"):
        tower_probe.probe_word_head(WordPixelTower(bag=True), one_piece, n=2)
