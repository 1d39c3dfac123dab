"""VisionTower (timm NaFlexViT / plain ViT) and Projector on tiny configs."""

# Shape suffixes (docs/paper.md §0): B images of the patch batch, L patches per image, D feature width, 2 a pair.

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from vision_tower import ImageProcessor, Projector, VisionTower

TINY = dict(embed_dim=32, depth=2, num_heads=2, patch_size=8)
PROC = ImageProcessor(patch_size=8, max_patches=64, pixel_shuffle=2)


def images():
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in [(40, 90), (64, 64), (17, 5)]]


def make_tower(seed=0, **kwargs):
    torch.manual_seed(seed)
    tower = VisionTower(**{**TINY, **kwargs}).eval()
    # NaFlexViT-gap starts its layer scales at 1e-5: the blocks would barely touch the features, hiding any leak
    for module in tower.modules():
        if isinstance(getattr(module, "gamma", None), torch.nn.Parameter):
            module.gamma.data.fill_(1.0)
    return tower


def run(tower, batch):
    return tower(batch["patches"], batch["patch_coord"], batch["patch_valid"])


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(pos_embed="rope"),
        dict(pos_embed="factorized"),
        dict(model_name="vit_tiny_patch16_224"),
        dict(stem="conv"),
    ],
    ids=["naflex-learned", "naflex-rope", "naflex-factorized", "vit", "naflex-conv-stem"],
)
def test_features_of_an_image_do_not_depend_on_the_batch(kwargs):
    tower, imgs = make_tower(**kwargs), images()
    batch = PROC(imgs)
    with torch.no_grad():
        out = run(tower, batch)
        n, length = batch["patch_valid"].shape
        assert out.features_BLD.shape == (n, length, tower.out_dim) and tower.out_dim == 32
        assert torch.equal(out.valid_BL, batch["patch_valid"]) and torch.equal(out.coord_BL2, batch["patch_coord"])
        assert not out.features_BLD[~out.valid_BL].any()  # padding rows are zero
        for i, img in enumerate(imgs):
            alone = run(tower, PROC([img]))
            k = int(batch["patch_valid"][i].sum())
            torch.testing.assert_close(out.features_BLD[i, :k], alone.features_BLD[0, :k], atol=1e-5, rtol=0)
        # whatever the caller puts in the padding slots stays invisible
        junk = {**batch, "patches": batch["patches"].clone(), "patch_coord": batch["patch_coord"].clone()}
        junk["patches"][~batch["patch_valid"]] = 7.0
        junk["patch_coord"][~batch["patch_valid"]] = 50
        torch.testing.assert_close(run(tower, junk).features_BLD, out.features_BLD, atol=1e-5, rtol=0)
    # and the images really differ (the comparison above is not between constants)
    assert (out.features_BLD[0, :4] - out.features_BLD[1, :4]).abs().max() > 1e-2


def test_plain_vit_matches_timm_on_the_rebuilt_image():
    tower, imgs = make_tower(model_name="vit_tiny_patch16_224"), images()
    batch = PROC(imgs)
    assert tower.num_prefix_tokens == 1 and tower.patch_size == 8
    with torch.no_grad():
        out = run(tower, batch)
        for i, img in enumerate(imgs):
            ref_LD = tower.model.forward_features(PROC.preprocess(img)[None])[0, 1:]  # cls token dropped
            k = int(batch["patch_valid"][i].sum())
            torch.testing.assert_close(out.features_BLD[i, :k], ref_LD, atol=1e-5, rtol=0)


def test_naflex_prefix_tokens_are_dropped():
    tower = make_tower()
    assert tower.num_prefix_tokens == 4  # naflexvit_base_patch16_gap: 4 register tokens
    batch = PROC(images()[:1])
    with torch.no_grad():
        full = tower.model.forward_features(batch["patches"], batch["patch_coord"], batch["patch_valid"])["patches"]
        torch.testing.assert_close(run(tower, batch).features_BLD, full[:, 4:], atol=0, rtol=0)


def test_empty_batch():
    out = make_tower()(torch.zeros(0, 0, 192), torch.zeros(0, 0, 2, dtype=torch.long), torch.zeros(0, 0, dtype=bool))
    assert out.features_BLD.shape == (0, 0, 32)


@pytest.mark.parametrize("model_name", ["naflexvit_base_patch16_gap", "vit_tiny_patch16_224"])
def test_gradients_reach_the_tower(model_name):
    tower = make_tower(model_name=model_name).train()
    out = run(tower, PROC(images()))
    (out.features_BLD**2).sum().backward()
    grads = {name: p.grad for name, p in tower.named_parameters()}
    block_grads = [g for name, g in grads.items() if ".blocks." in f".{name}"]
    assert block_grads and all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in block_grads)
    embed = "model.embeds.proj.weight" if model_name.startswith("naflex") else "model.patch_embed.proj.weight"
    assert grads[embed].abs().sum() > 0


@pytest.mark.parametrize("layout", ["timm-safetensors", "tower-pth"])
def test_weights_from_a_local_file_reproduce_outputs(tmp_path, layout):
    source, batch = make_tower(seed=1), PROC(images())
    if layout == "timm-safetensors":
        path = tmp_path / "vit.safetensors"
        save_file({k: v.contiguous() for k, v in source.model.state_dict().items()}, str(path))
    else:
        path = tmp_path / "tower.pth"
        torch.save(source.state_dict(), path)  # VisionTower keys: "model." prefix
    loaded = VisionTower(**TINY, weights=path).eval()
    with torch.no_grad():
        torch.testing.assert_close(run(loaded, batch).features_BLD, run(source, batch).features_BLD, atol=0, rtol=0)
    assert not torch.equal(make_tower(seed=2).model.embeds.proj.weight, loaded.model.embeds.proj.weight)


def test_mismatched_weights_give_a_clear_error(tmp_path):
    path = tmp_path / "other.safetensors"
    other = VisionTower(**{**TINY, "embed_dim": 48, "depth": 3})
    save_file({k: v.contiguous() for k, v in other.model.state_dict().items()}, str(path))
    with pytest.raises(ValueError, match=r"Unexpected keys: blocks\.2\.") as err:
        VisionTower(**TINY, weights=path)
    assert "Shape mismatches: " in str(err.value) and "(48,) vs model (32,)" in str(err.value)
    with pytest.raises(ValueError, match="weights must be"):
        VisionTower(**TINY, weights=tmp_path / "w.txt")
    with pytest.raises(FileNotFoundError):
        VisionTower(**TINY, weights=tmp_path / "missing.safetensors")


def test_invalid_settings():
    with pytest.raises(ValueError, match="model_name"):
        VisionTower("resnet50")
    with pytest.raises(ValueError, match="model_name"):
        VisionTower("naflexvit_no_such_model")
    with pytest.raises(ValueError, match="pos_embed"):
        VisionTower("vit_tiny_patch16_224", pos_embed="rope")


def test_projector():
    proj = Projector(32 * 4, 24)
    assert proj.fc1.out_features == 24 and proj(torch.randn(5, 128)).shape == (5, 24)
    assert Projector(8, 16, hidden_dim=64).fc1.out_features == 64
    with pytest.raises(ValueError, match="out_dim"):
        Projector(8, 0)
