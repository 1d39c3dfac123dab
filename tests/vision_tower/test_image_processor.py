"""ImageProcessor: patch budget and aspect ratio, image modes, patch layout, persistence, errors."""

# Shape suffixes (docs/paper.md §0): L patches per image, P values per patch, 2 a (y, x) pair.

import json
from fractions import Fraction

import numpy as np
import pytest
import torch
from PIL import Image

from vision_tower import ImageProcessor

SIZES = [(320, 160), (96, 224), (1, 1), (4000, 3000), (1, 10000), (10000, 1), (3, 500), (224, 224), (640, 480)]


def unpatchify(patches_LP, coord_L2, valid_L, grid_hw, p):
    """Reference inverse of channels-last patchify, placing each patch by its (y, x) coordinate."""
    gh, gw = grid_hw
    img = torch.full((gh * p, gw * p, 3), float("nan"))
    for patch, (y, x) in zip(patches_LP[valid_L], coord_L2[valid_L].tolist()):
        img[y * p : (y + 1) * p, x * p : (x + 1) * p] = patch.view(p, p, 3)
    return img.permute(2, 0, 1)


def scale_range(k, side):
    """Scales s (in blocks per pixel) at which max(1, floor(side * s)) == k: [lo, hi)."""
    return (Fraction(k, side) if k > 1 else Fraction(0)), Fraction(k + 1, side)


@pytest.mark.parametrize("upscale", [False, True])
@pytest.mark.parametrize("patch_size,max_patches,merge", [(16, 256, 2), (14, 100, 1), (8, 36, 2), (16, 256, 4)])
def test_grid_respects_budget_aspect_and_covers_once(patch_size, max_patches, merge, upscale):
    proc = ImageProcessor(patch_size=patch_size, max_patches=max_patches, pixel_shuffle=merge, upscale=upscale)
    images = [Image.new("RGB", size, (40, 90, 200)) for size in SIZES]
    out = proc(images)
    budget, block = max_patches // merge**2, patch_size * merge
    assert out["patches"].shape == (len(SIZES), out["patch_valid"].shape[1], patch_size * patch_size * 3)
    assert out["patch_valid"].shape[1] == int(out["grid_hw"].prod(-1).max())
    for i, (w, h) in enumerate(SIZES):
        gh, gw = out["grid_hw"][i].tolist()
        assert gh % merge == 0 and gw % merge == 0 and gh * gw <= max_patches
        bh, bw = gh // merge, gw // merge
        # one scale s gives both sides (aspect kept within one block), at most native size unless upscale
        (lo_h, hi_h), (lo_w, hi_w) = scale_range(bh, h), scale_range(bw, w)
        lo, hi = max(lo_h, lo_w), min(hi_h, hi_w)
        assert lo < hi and (upscale or lo * block <= 1)
        # and the next scale where the grid grows breaks the budget (or the native size)
        grown = (bh + (hi_h == hi)) * (bw + (hi_w == hi))
        assert grown > budget or (not upscale and hi * block > 1)
        assert int(out["num_tokens"][i]) == gh * gw // merge**2 == proc.num_tokens_for(images[i])
        valid = out["patch_valid"][i]
        assert int(valid.sum()) == gh * gw
        coords = sorted(map(tuple, out["patch_coord"][i][valid].tolist()))
        assert coords == [(y, x) for y in range(gh) for x in range(gw)]
        assert not out["patches"][i][~valid].any() and not out["patch_coord"][i][~valid].any()


def test_default_grids():
    proc, up = ImageProcessor(), ImageProcessor(upscale=True)
    assert proc.grid_for(224, 224) == (14, 14) and proc.num_tokens_for(Image.new("RGB", (224, 224))) == 49
    assert up.grid_for(224, 224) == (16, 16) and up.num_tokens_for(Image.new("RGB", (224, 224))) == 64
    assert proc.grid_for(48, 96) == (2, 6)  # native: 48 px is one 32 px block (rounded down), 96 px three
    assert proc.grid_for(3000, 4000) == up.grid_for(3000, 4000) == (14, 18)  # landscape stays landscape
    assert proc.grid_for(10000, 1) == (128, 2)  # extreme aspect: one block wide, budget spent on the long side
    assert proc.grid_for(1, 1) == (2, 2) and up.grid_for(1, 1) == (16, 16)  # one block, or the whole budget


def test_block_aligned_small_image_keeps_its_pixels():
    arr = np.random.default_rng(2).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    x = ImageProcessor().preprocess(Image.fromarray(arr))
    torch.testing.assert_close(x, torch.from_numpy(arr).permute(2, 0, 1).float() / 127.5 - 1)


def test_patches_round_trip_to_resized_image():
    proc = ImageProcessor(patch_size=8, max_patches=64, pixel_shuffle=2)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in [(37, 90), (64, 64)]]
    out = proc(images)
    for i, image in enumerate(images):
        ref = proc.preprocess(image)
        gh, gw = out["grid_hw"][i].tolist()
        assert ref.shape == (3, gh * 8, gw * 8)
        rebuilt = unpatchify(out["patches"][i], out["patch_coord"][i], out["patch_valid"][i], (gh, gw), 8)
        torch.testing.assert_close(rebuilt, ref, atol=0, rtol=0)


def test_coordinates_are_y_then_x_and_normalised():
    # wide image: left half red, right half blue -> patches with small x are red
    arr = np.zeros((64, 128, 3), np.uint8)
    arr[:, :64, 0] = 255
    arr[:, 64:, 2] = 255
    out = ImageProcessor(patch_size=16, max_patches=32, pixel_shuffle=2)([Image.fromarray(arr)])
    assert out["grid_hw"][0].tolist() == [4, 8]
    patches, coord = out["patches"][0].view(-1, 16, 16, 3), out["patch_coord"][0]
    left, right = patches[coord[:, 1] == 0], patches[coord[:, 1] == 7]
    torch.testing.assert_close(left[..., 0], torch.ones_like(left[..., 0]))  # (255 / 255 - 0.5) / 0.5
    torch.testing.assert_close(left[..., 2], -torch.ones_like(left[..., 2]))
    torch.testing.assert_close(right[..., 2], torch.ones_like(right[..., 2]))


def _palette(transparent: bool) -> Image.Image:
    img = Image.new("P", (20, 30), 0)
    img.putpalette([10, 20, 30] + [0, 0, 0] * 255)
    if transparent:
        img.info["transparency"] = 0
    return img


WHITE, RED = (1.0, 1.0, 1.0), (1.0, -1.0, -1.0)
MODES = {
    "L": (Image.new("L", (30, 20), 255), WHITE),
    "1": (Image.new("1", (30, 20), 0), (-1.0, -1.0, -1.0)),
    "I;16 white": (Image.new("I;16", (30, 20), 65535), WHITE),
    "I;16 mid": (Image.fromarray(np.full((20, 30), 32768, np.uint16)), (0.0, 0.0, 0.0)),
    "I 8-bit": (Image.new("I", (30, 20), 255), WHITE),
    "F unit": (Image.fromarray(np.full((20, 30), 0.5, np.float32)), (0.0, 0.0, 0.0)),
    "RGBA transparent": (Image.new("RGBA", (30, 20), (0, 0, 0, 0)), WHITE),
    "RGBA opaque": (Image.new("RGBA", (30, 20), (255, 0, 0, 255)), RED),
    "LA transparent": (Image.new("LA", (30, 20), (0, 0)), WHITE),
    "La transparent": (Image.new("La", (30, 20), (0, 0)), WHITE),
    "P": (_palette(False), tuple(v / 127.5 - 1 for v in (10, 20, 30))),
    "P transparent": (_palette(True), WHITE),
    "CMYK white": (Image.new("CMYK", (30, 20), (0, 0, 0, 0)), WHITE),
    "CMYK red": (Image.new("CMYK", (30, 20), (0, 255, 255, 0)), RED),
}


@pytest.mark.parametrize("name", list(MODES))
def test_modes_give_rgb_patches(name):
    image, rgb = MODES[name]
    out = ImageProcessor(patch_size=8, max_patches=16)([image])
    valid = out["patch_valid"][0]
    pixels = out["patches"][0][valid].view(-1, 3)  # channels-last: every row is one pixel's (r, g, b)
    assert out["patches"].shape[-1] == 8 * 8 * 3
    torch.testing.assert_close(pixels, torch.tensor(rgb).expand_as(pixels), atol=2e-3, rtol=0)


def test_rgba_alpha_is_composited_over_white():
    arr = np.zeros((32, 32, 4), np.uint8)
    arr[:16, :, :] = (255, 0, 0, 255)  # top half opaque red, bottom half transparent black
    x = ImageProcessor(patch_size=8, max_patches=16).preprocess(Image.fromarray(arr, "RGBA"))
    torch.testing.assert_close(x[:, 0, 0], torch.tensor(RED))
    torch.testing.assert_close(x[:, -1, 0], torch.tensor(WHITE))


def test_non_images_raise_clear_errors():
    proc = ImageProcessor()
    with pytest.raises(TypeError, match="item 1 is a str"):
        proc([Image.new("RGB", (8, 8)), "cat.png"])
    with pytest.raises(TypeError, match="item 0 is a ndarray"):
        proc([np.zeros((8, 8, 3), np.uint8)])
    with pytest.raises(TypeError, match="sequence of PIL images"):
        proc("cat.png")
    with pytest.raises(TypeError, match="PIL"):
        proc.num_tokens_for(torch.zeros(3, 8, 8))
    with pytest.raises(ValueError, match="empty"):
        proc([Image.new("RGB", (0, 5))])


def test_empty_batch_and_single_image():
    proc = ImageProcessor()
    out = proc([])
    assert out["patches"].shape == (0, 0, 768) and out["grid_hw"].shape == (0, 2) and out["num_tokens"].shape == (0,)
    img = Image.new("RGB", (50, 70), (1, 2, 3))
    single, batch = proc(img), proc([img])
    assert all(torch.equal(single[k], batch[k]) for k in batch)


def test_deterministic():
    rng = np.random.default_rng(1)
    img = Image.fromarray(rng.integers(0, 256, (123, 77, 3), dtype=np.uint8))
    a, b = ImageProcessor()([img]), ImageProcessor()([img])
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(pixel_shuffle=3), "pixel_shuffle"),
        (dict(pixel_shuffle=2, max_patches=3), "max_patches"),
        (dict(patch_size=0), "patch_size"),
        (dict(patch_size=16.0), "patch_size"),
        (dict(mean=(0.5, 0.5)), "mean"),
        (dict(std=(0.5, 0.0, 0.5)), "std"),
        (dict(upscale="yes"), "upscale"),
    ],
)
def test_invalid_settings_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ImageProcessor(**kwargs)


def test_save_and_load(tmp_path):
    proc = ImageProcessor(14, 100, 1, mean=(0.1, 0.2, 0.3), std=(0.4, 0.5, 0.6), upscale=True)
    path = proc.save_pretrained(tmp_path / "proc")
    assert path.name == "preprocessor_config.json"  # transformers' file name (image_processor_config.json before)
    assert json.loads(path.read_text())["max_patches"] == 100 and json.loads(path.read_text())["upscale"]
    loaded = ImageProcessor.from_pretrained(tmp_path / "proc")
    assert loaded.to_dict() == proc.to_dict()
    img = Image.new("RGB", (99, 41), (5, 100, 200))
    assert torch.equal(loaded([img])["patches"], proc([img])["patches"])
    with pytest.raises(FileNotFoundError, match="image_processor_config.json"):
        ImageProcessor.from_pretrained(tmp_path / "missing")


def test_a_file_saved_before_the_pixel_shuffle_rename_loads(tmp_path):
    path = ImageProcessor(16, 64, 1).save_pretrained(tmp_path)
    fields = json.loads(path.read_text())
    fields["merge"] = fields.pop("pixel_shuffle")  # the field's first name
    path.write_text(json.dumps(fields))
    assert ImageProcessor.from_pretrained(tmp_path).pixel_shuffle == 1
