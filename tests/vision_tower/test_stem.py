"""PatchConvStem: each patch convolved on its own, from the ImageProcessor's channels-last patches."""

import pytest
import torch
from safetensors.torch import save_file
from timm.data import Patchify

from vision_tower import VisionTower
from vision_tower.stem import PatchConvStem


def test_each_patch_is_convolved_as_the_image_crop_it_came_from():
    """The stem reads the processor's channels-last flattening back as the patch's own pixels: its output equals
    the convolutions run on that p x p crop of the image, and changing one patch changes only its embedding."""
    torch.manual_seed(0)
    p, stem = 8, PatchConvStem(8, 24).eval()
    image_3HW = torch.randn(3, 16, 24)
    cut = Patchify(p, channels_last=True)(image_3HW)
    patches_1NP, coord_N2 = cut["patches"][None], cut["patch_coord"]
    with torch.no_grad():
        out_1ND = stem(patches_1NP)
        for n, (y, x) in enumerate(coord_N2.tolist()):
            crop = image_3HW[:, y * p : (y + 1) * p, x * p : (x + 1) * p][None]
            want = stem.out(stem.convs(crop).flatten(1))[0]
            # the batched and the one-crop convolution sum in another order: float32 rounding, not a wrong pixel
            torch.testing.assert_close(out_1ND[0, n], want, atol=1e-5, rtol=1e-5)
        changed = patches_1NP.clone()
        changed[0, 3] += 1.0
        moved = (stem(changed) - out_1ND).abs().amax(-1)[0]
    assert moved[3] > 1e-3 and moved[torch.arange(len(moved)) != 3].max() == 0


def test_a_conv_stem_tower_saves_and_loads_and_refuses_a_linear_one(tmp_path):
    torch.manual_seed(0)
    sizes = dict(embed_dim=32, depth=1, num_heads=2, patch_size=8)
    tower = VisionTower(stem="conv", **sizes).eval()
    path = tmp_path / "tower.safetensors"
    save_file({k: v.contiguous() for k, v in tower.model.state_dict().items()}, str(path))
    loaded = VisionTower(stem="conv", weights=path, **sizes).eval()
    patches = torch.randn(2, 6, 8 * 8 * 3)
    coord = torch.tensor([[y, x] for y in range(2) for x in range(3)])[None].expand(2, -1, -1)
    valid = torch.ones(2, 6, dtype=torch.bool)
    with torch.no_grad():
        want = tower(patches, coord, valid).features_BLD
        torch.testing.assert_close(loaded(patches, coord, valid).features_BLD, want)
    with pytest.raises(ValueError, match="do not fit"):
        VisionTower(stem="linear", weights=path, **sizes)


@pytest.mark.parametrize(
    "kwargs, says",
    [
        (dict(stem="cnn"), "stem must be one of"),
        (dict(stem="conv", model_name="vit_tiny_patch16_224"), "needs a naflexvit model"),
        (dict(stem="conv", patch_size=14), "multiple of 4"),
    ],
)
def test_bad_stems_are_refused_in_one_line(kwargs, says):
    with pytest.raises(ValueError, match=says):
        VisionTower(**{**dict(embed_dim=32, depth=1, num_heads=2, patch_size=8), **kwargs})


def test_at_init_conv_embeddings_vary_across_patches_as_much_as_linear_ones():
    """With PyTorch's default init the stem's embeddings started ~50x flatter than timm's linear ones, and colour,
    read at once through the linear embedding, took hundreds of steps longer; the stem's own init keeps the two
    within a factor of 2."""
    torch.manual_seed(0)
    patches_1NP = torch.rand(1, 256, 8 * 8 * 3) * 2 - 1  # normalised pixels
    spread = {}
    for stem in ("linear", "conv"):
        tower = VisionTower(embed_dim=32, depth=1, num_heads=2, patch_size=8, stem=stem)
        with torch.no_grad():
            spread[stem] = tower.model.embeds.proj(patches_1NP)[0].std(0).mean().item()
    assert 0.5 < spread["conv"] / spread["linear"] < 2, spread
