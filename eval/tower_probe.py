"""Linear probes of a vision tower: which attributes of one small object its features carry.

A language model can only learn to read what its image tokens hold, so before (and instead of) training a VLM on a
tower, ask the tower: render one-object scenes at the generator's sizes (``data_pipelines.synthetic.scenes``,
12-42% of the short side), cut them with the VLM's own ``ImageProcessor``, run the tower, and fit one multinomial
logistic regression per attribute (colour, shape, position) on the features of ``n_train`` scenes; the held-out
accuracy on ``n_test`` other scenes is what a linear reader gets from the tower. Two feature sets:

- ``summary``: the tower's summary pool (one vector per image; present when the weights carry it, as
  ``scripts/pretrain_vision.py`` writes them), the vector ``vision_summary`` hands every image token of the VLM;
- ``patches``: the mean and the max of the valid patch features, concatenated (no learned pooling).

Chance is the held-out share of the attribute's most common training label (the best constant answer). The scenes
come from fixed seeds, so two towers are compared on the same pictures.

With ``binding`` (:func:`probe_binding`), one more attribute, ``colour_of_shape``: scenes of 2-3 objects, and per
shape one probe that reads the colour of that shape's object (on the scenes holding exactly one of it), as
"What colour is the square?" asks. A tower that carries the colours present but not which object wears which gives
a reader at best ``unbound`` = the mean of 1 / (the scene's distinct colours): one of them named at random.

:func:`probe_objects` asks where the attributes sit, object by object in scenes of 2-3 objects: ``object`` is the
mean and max of the patches whose centres lie in the object's box, ``token`` the features of the one pixel-shuffle
block holding the patch nearest its centre (its patches concatenated: exactly what one image token of the VLM
reads). A question about one object among several ("What shape is the red object?") can only be answered by
attention to tokens that carry both of its attributes, so ``token`` is the ceiling of what such a lookup reads.

:func:`probe_word_head` asks a tower's word head (what ``vision_words`` hands the language model) the same
question without a fitted probe: on how many objects does some patch name the object's own colour / shape, and on
how many another object's.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from data_pipelines.synthetic.scenes import SHAPES, render_scene
from eval.chance import unbound_share
from vision_tower import ImageProcessor, VisionTower
from vision_tower.boxes import patch_centres, patches_in_boxes
from vlm.config import ConceptMoEVLMConfig

ATTRIBUTES = ("colour", "shape", "position")
BINDING = "colour_of_shape"  # the attribute of :func:`probe_binding`
FEATURE_SETS = ("summary", "patches")
OBJECT_FEATURES = ("object", "token")  # :func:`probe_objects`: one object's patches, one LM token at its centre


@dataclass
class ProbeScore:
    features: str  # "summary" | "patches"
    attribute: str  # one of ATTRIBUTES
    accuracy: float  # held-out accuracy of the linear probe
    chance: float  # held-out accuracy of the most common training label
    n_train: int
    n_test: int
    unbound: float | None = None  # binding only: the best reader of the scene's colours without their objects


def one_object_scenes(n: int, seed: int, object_size: tuple[float, float] | None = None) -> tuple[list, list[dict]]:
    """``n`` one-object scenes (PIL images) and their labels ``{attribute: word}``."""
    rng = random.Random(seed)
    images, labels = [], []
    while len(images) < n:
        image, meta = render_scene(rng, max_objects=1, object_size=object_size)
        if meta["objects"]:  # placement never fails for one object; guard anyway
            images.append(image)
            labels.append({a: meta["objects"][0][a] for a in ATTRIBUTES})
    return images, labels


def load_tower(weights: str | Path, preset: str = "tiny", **overrides) -> VisionTower:
    """The tower in ``weights``, its architecture read from the ``.json`` record beside it (``pretrain_vision``
    writes one) unless ``overrides`` (the VLM config's ``vision_*`` names) say otherwise; summary pool kept when the
    file holds one."""
    record = Path(weights).with_suffix(".json")
    fields = json.loads(record.read_text())["tower"] if record.exists() else {}
    kwargs = ConceptMoEVLMConfig.from_preset(preset, **{**fields, **overrides}).tower_kwargs()
    try:
        return VisionTower(**{**kwargs, "summary": True}, weights=weights).eval()
    except ValueError as err:
        if "summary pool" not in str(err):
            raise
        return VisionTower(**{**kwargs, "summary": False}, weights=weights).eval()


@torch.no_grad()
def tower_features(
    tower: VisionTower, images: list, max_patches: int = 64, pixel_shuffle: int = 2, batch: int = 64
) -> dict[str, torch.Tensor]:
    """``{"patches": [N, 2D]}`` (mean and max over valid patches) plus ``{"summary": [N, D]}`` when the tower has
    its summary pool; images cut as the VLM's processor cuts them (``max_patches``, grid in ``pixel_shuffle``
    blocks)."""
    processor = ImageProcessor(tower.patch_size, max_patches, pixel_shuffle)
    out: dict[str, list[torch.Tensor]] = {"patches": [], "summary": []}
    for i in range(0, len(images), batch):
        cut = processor(images[i : i + batch])
        feats = tower(cut["patches"], cut["patch_coord"], cut["patch_valid"])
        valid_BL1 = feats.valid_BL[..., None]
        mean_BD = feats.features_BLD.sum(1) / valid_BL1.sum(1).clamp(min=1)
        max_BD = feats.features_BLD.masked_fill(~valid_BL1, float("-inf")).amax(1)
        out["patches"].append(torch.cat([mean_BD, max_BD], -1))
        if tower.summary_pool is not None:
            out["summary"].append(tower.summarize(feats))
    return {name: torch.cat(parts).float() for name, parts in out.items() if parts}


def linear_probe_accuracy(
    x_train_ND: torch.Tensor, y_train: list[str], x_test_ND: torch.Tensor, y_test: list[str], l2: float = 1e-3
) -> float:
    """Held-out accuracy of a multinomial logistic regression (standardised features, L2 ``l2``, L-BFGS)."""
    classes = sorted(set(y_train))
    index = {c: i for i, c in enumerate(classes)}
    mean_D, std_D = x_train_ND.mean(0), x_train_ND.std(0).clamp(min=1e-6)
    xs, xt = (x_train_ND - mean_D) / std_D, (x_test_ND - mean_D) / std_D
    target_N = torch.tensor([index[y] for y in y_train])
    weight_DC = torch.zeros(xs.shape[1], len(classes), requires_grad=True)
    bias_C = torch.zeros(len(classes), requires_grad=True)
    opt = torch.optim.LBFGS([weight_DC, bias_C], max_iter=200, history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(xs @ weight_DC + bias_C, target_N) + l2 * weight_DC.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        predicted = (xt @ weight_DC + bias_C).argmax(-1).tolist()
    return sum(classes[p] == y for p, y in zip(predicted, y_test, strict=True)) / len(y_test)


def _scene_features(make, tower: VisionTower, n_train: int, n_test: int, seed: int, max_patches: int):
    """((train features, train labels), (test features, test labels)): ``make(n, seed)`` scenes, train from ``seed``
    and test from ``seed + 1``, through :func:`tower_features`."""
    out = []
    for n, scene_seed in ((n_train, seed), (n_test, seed + 1)):
        images, labels = make(n, scene_seed)
        out.append((tower_features(tower, images, max_patches), labels))
    return out


def probe_tower(
    tower: VisionTower, n_train: int = 2000, n_test: int = 500, seed: int = 0, max_patches: int = 64
) -> list[ProbeScore]:
    """One :class:`ProbeScore` per feature set and attribute (train scenes from ``seed``, test from ``seed + 1``)."""
    (train_feats, train_labels), (test_feats, test_labels) = _scene_features(
        one_object_scenes, tower, n_train, n_test, seed, max_patches
    )
    scores = []
    for features in FEATURE_SETS:
        if features not in train_feats:
            continue
        for attribute in ATTRIBUTES:
            y_train = [label[attribute] for label in train_labels]
            y_test = [label[attribute] for label in test_labels]
            majority = Counter(y_train).most_common(1)[0][0]
            accuracy = linear_probe_accuracy(train_feats[features], y_train, test_feats[features], y_test)
            chance = sum(y == majority for y in y_test) / len(y_test)
            scores.append(ProbeScore(features, attribute, accuracy, chance, n_train, n_test))
    return scores


def binding_scenes(n: int, seed: int) -> tuple[list, list[list[dict]]]:
    """``n`` scenes of 2-3 objects at the generator's sizes (PIL images) and their objects' metadata."""
    rng = random.Random(seed)
    images, objects = [], []
    while len(images) < n:
        image, meta = render_scene(rng, max_objects=3)
        if len(meta["objects"]) >= 2:
            images.append(image)
            objects.append(meta["objects"])
    return images, objects


def _colour_of(shape: str, scenes: list[list[dict]]) -> tuple[list[int], list[str]]:
    """(scene indices, colours) of the scenes holding exactly one ``shape``: that object's colour."""
    picked = [(i, [o for o in objs if o["shape"] == shape]) for i, objs in enumerate(scenes)]
    return [i for i, hit in picked if len(hit) == 1], [hit[0]["colour"] for _, hit in picked if len(hit) == 1]


def probe_binding(
    tower: VisionTower, n_train: int = 3000, n_test: int = 800, seed: int = 10, max_patches: int = 64
) -> list[ProbeScore]:
    """One ``colour_of_shape`` :class:`ProbeScore` per feature set: per shape, a linear probe fitted to the colour
    of that shape's object; accuracy, chance (each shape's most common training colour) and ``unbound`` pooled
    over the shapes' held-out items."""
    (train_feats, train_scenes), (test_feats, test_scenes) = _scene_features(
        binding_scenes, tower, n_train, n_test, seed, max_patches
    )
    scores = []
    for features in train_feats:
        right = chance = unbound = items = 0.0
        for shape in SHAPES:
            train_idx, y_train = _colour_of(shape, train_scenes)
            test_idx, y_test = _colour_of(shape, test_scenes)
            if len(set(y_train)) < 2 or not y_test:
                continue
            x_train, x_test = train_feats[features][train_idx], test_feats[features][test_idx]
            right += linear_probe_accuracy(x_train, y_train, x_test, y_test) * len(y_test)
            majority = Counter(y_train).most_common(1)[0][0]
            chance += sum(y == majority for y in y_test)
            unbound += sum(unbound_share(test_scenes[i], "colour") for i in test_idx)
            items += len(y_test)
        scores.append(ProbeScore(features, BINDING, right / items, chance / items, n_train, n_test, unbound / items))
    return scores


def object_patches(
    coord_L2: torch.Tensor, grid: torch.Tensor, box, centre_L2: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """(the [L] mask of the patches whose centres lie in ``box``, the index of the patch nearest the box's centre,
    which the mask always holds: an object smaller than a patch still has its nearest patch)."""
    x0, y0, x1, y1 = box
    inside_L = patches_in_boxes(coord_L2, grid, torch.tensor([box]))[:, 0]
    nearest = int((centre_L2 - torch.tensor([(y0 + y1) / 2, (x0 + x1) / 2])).square().sum(-1).argmin())
    inside_L[nearest] = True
    return inside_L, nearest


@torch.no_grad()
def object_features(
    tower: VisionTower, images: list, scenes: list[list[dict]], max_patches: int = 64, pixel_shuffle: int = 2
) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """(``{"object": [N, 2D], "token": [N, s*s*D]}``, the N objects' metadata) over every object of ``scenes``."""
    processor = ImageProcessor(tower.patch_size, max_patches, pixel_shuffle)
    out: dict[str, list[torch.Tensor]] = {name: [] for name in OBJECT_FEATURES}
    objects = []
    for i in range(0, len(images), 64):
        cut = processor(images[i : i + 64])
        feats = tower(cut["patches"], cut["patch_coord"], cut["patch_valid"])
        for b, scene in enumerate(scenes[i : i + 64]):
            valid_L = feats.valid_BL[b]
            coord_L2, x_LD = feats.coord_BL2[b][valid_L], feats.features_BLD[b][valid_L]
            grid, block_L = cut["grid_hw"][b], coord_L2 // pixel_shuffle
            centre_L2 = patch_centres(coord_L2, grid)
            for obj in scene:
                inside_L, nearest = object_patches(coord_L2, grid, obj["box"], centre_L2)
                out["object"].append(torch.cat([x_LD[inside_L].mean(0), x_LD[inside_L].amax(0)]))
                token_D = torch.zeros(pixel_shuffle**2, x_LD.shape[1])  # a block's missing patches read as zeros
                in_block = (block_L == block_L[nearest]).all(-1)
                token_D[(coord_L2[in_block] % pixel_shuffle) @ torch.tensor([pixel_shuffle, 1])] = x_LD[in_block]
                out["token"].append(token_D.flatten())
                objects.append(obj)
    return {name: torch.stack(parts).float() for name, parts in out.items()}, objects


def probe_objects(
    tower: VisionTower, n_train: int = 1500, n_test: int = 400, seed: int = 10, max_patches: int = 64
) -> list[ProbeScore]:
    """One :class:`ProbeScore` per :data:`OBJECT_FEATURES` set and attribute (colour, shape): linear probes of each
    object's own attribute from its own features, over every object of ``n_train`` / ``n_test`` scenes of 2-3
    objects (:func:`binding_scenes`; train from ``seed``, test from ``seed + 1``)."""
    (x_train, train_objects), (x_test, test_objects) = (
        object_features(tower, *binding_scenes(n, scene_seed), max_patches)
        for n, scene_seed in ((n_train, seed), (n_test, seed + 1))
    )
    scores = []
    for features in OBJECT_FEATURES:
        for attribute in ("colour", "shape"):
            y_train = [o[attribute] for o in train_objects]
            y_test = [o[attribute] for o in test_objects]
            majority = Counter(y_train).most_common(1)[0][0]
            accuracy = linear_probe_accuracy(x_train[features], y_train, x_test[features], y_test)
            chance = sum(y == majority for y in y_test) / len(y_test)
            scores.append(ProbeScore(features, attribute, accuracy, chance, len(y_train), len(y_test)))
    return scores


@dataclass
class WordHeadScore:
    attribute: str  # "colour" | "shape"
    named: float  # share of the objects whose own word some patch in their box names
    foreign: float  # share of the objects on whose patches another object's word (one they lack) is named
    objects: int
    threshold: float


@torch.no_grad()
def probe_word_head(
    tower: VisionTower,
    word_ids: dict[str, list[int]],
    n: int = 120,
    seed: int = 10,
    max_patches: int = 64,
    threshold: float = 0.5,
) -> list[WordHeadScore]:
    """What the tower's word head (``--region-labels`` / ``--patch-labels``; ``vision_words`` hands its words to the
    language model) says object by object, in ``n`` scenes of 2-3 objects (:func:`binding_scenes`): a word is named
    on a patch when every piece of it (``word_ids``: word -> its token ids) is above ``threshold``. For colour and
    shape, ``named``: some patch in the object's box (:func:`object_patches`) names the object's own word;
    ``foreign``: some patch there names another object's word that this object does not have. A question about one
    object among several is answered by a lookup of the tokens that name it: an object whose shape no token names
    cannot be found by its shape or asked its shape (docs/seeing.md, "Initialisation")."""
    head = tower.require_word_head()
    place = {int(t): k for k, t in enumerate(head.ids_K.tolist())}
    missing = sorted(w for w, ids in word_ids.items() if not ids or any(t not in place for t in ids))
    if missing:
        raise ValueError(f"probe_word_head: the word head does not name {', '.join(missing)}")
    cols = {w: [place[t] for t in ids] for w, ids in word_ids.items()}
    processor = ImageProcessor(tower.patch_size, max_patches, 2)
    images, scenes = binding_scenes(n, seed)
    named, foreign, objects = Counter(), Counter(), 0
    for i in range(0, len(images), 64):
        cut = processor(images[i : i + 64])
        feats = tower(cut["patches"], cut["patch_coord"], cut["patch_valid"])
        says_BLK = tower.word_probs(feats) > threshold
        for b, scene in enumerate(scenes[i : i + 64]):
            valid_L = feats.valid_BL[b]
            coord_L2, says_LK = feats.coord_BL2[b][valid_L], says_BLK[b][valid_L]
            centre_L2 = patch_centres(coord_L2, cut["grid_hw"][b])
            for obj in scene:
                says = says_LK[object_patches(coord_L2, cut["grid_hw"][b], obj["box"], centre_L2)[0]]
                objects += 1
                for attribute in ("colour", "shape"):
                    named[attribute] += bool(says[:, cols[obj[attribute]]].all(-1).any())
                    others = {o[attribute] for o in scene} - {obj[attribute]}
                    foreign[attribute] += any(bool(says[:, cols[w]].all(-1).any()) for w in others)
    return [WordHeadScore(a, named[a] / objects, foreign[a] / objects, objects, threshold) for a in ("colour", "shape")]


def scores_json(scores: list) -> list[dict]:
    return [asdict(s) for s in scores]
