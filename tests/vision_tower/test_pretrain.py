"""vision_tower.pretrain: SigLIP's loss by its definition, padding that changes nothing, and a toy that learns."""

# Shape suffixes: B images (= captions), L patches, T caption tokens, E embedding width.

import math

import numpy as np
import torch
from PIL import Image

from vision_tower import ImageProcessor, VisionTower
from vision_tower.pretrain import ContrastivePretrainer, sigmoid_contrastive_loss

PROC = ImageProcessor(patch_size=8, max_patches=16, pixel_shuffle=2)


def tiny_pretrainer(seed=0, vocab=16):
    torch.manual_seed(seed)
    tower = VisionTower(embed_dim=32, depth=1, num_heads=2, patch_size=8)
    sizes = dict(embed_dim=16, text_dim=16, text_depth=1, text_heads=2, max_caption_tokens=8)
    return ContrastivePretrainer(tower, vocab, **sizes)


def test_sigmoid_loss_equals_the_papers_sum_over_pairs():
    torch.manual_seed(0)
    x_BE, y_BE = torch.randn(5, 7), torch.randn(5, 7)
    log_scale, bias = torch.tensor(0.7), torch.tensor(-2.5)
    xn, yn = x_BE / x_BE.norm(dim=-1, keepdim=True), y_BE / y_BE.norm(dim=-1, keepdim=True)
    total = 0.0
    for i in range(5):
        for j in range(5):
            z = 1.0 if i == j else -1.0
            logit = math.exp(0.7) * float(xn[i] @ yn[j]) - 2.5
            total += -math.log(1 / (1 + math.exp(-z * logit)))
    got = sigmoid_contrastive_loss(x_BE, y_BE, log_scale, bias)
    assert abs(got.item() - total / 5) < 1e-5


def test_padding_patches_and_caption_tokens_change_no_embedding():
    model = tiny_pretrainer().eval()
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in [(16, 32), (32, 32)]]
    batch = PROC(images)  # the first image has 8 patches, padded to the second's 16
    alone = PROC(images[:1])
    with torch.no_grad():
        both_BE = model.embed_images(batch["patches"], batch["patch_coord"], batch["patch_valid"])
        one_BE = model.embed_images(alone["patches"], alone["patch_coord"], alone["patch_valid"])
        ids_BT = torch.tensor([[3, 4, 5, 0, 0], [3, 4, 5, 6, 7]])
        mask_BT = ids_BT.ne(0) | torch.tensor([[0, 0, 0, 0, 0], [1, 1, 1, 1, 1]]).bool()
        short_BE = model.text(ids_BT[:1, :3], mask_BT[:1, :3])
        text_BE = model.text(ids_BT, mask_BT)
    assert torch.allclose(both_BE[0], one_BE[0], atol=1e-5)
    assert torch.allclose(text_BE[0], short_BE[0], atol=1e-5)
    assert not torch.allclose(text_BE[0], text_BE[1], atol=1e-3)


def test_a_tiny_tower_learns_which_caption_names_its_images_colour():
    """Eight flat colours, each with its own one-token caption: retrieval goes from chance (1/8) to every image."""
    colours = [
        (255, 0, 0),
        (0, 255, 0),
        (0, 0, 255),
        (255, 255, 0),
        (0, 255, 255),
        (255, 0, 255),
        (0, 0, 0),
        (255, 255, 255),
    ]
    batch = PROC([Image.new("RGB", (24, 16), c) for c in colours])
    ids_BT, mask_BT = torch.arange(1, 9)[:, None], torch.ones(8, 1, dtype=torch.bool)
    model = tiny_pretrainer(vocab=9)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(80):
        out = model(batch["patches"], batch["patch_coord"], batch["patch_valid"], ids_BT, mask_BT)
        first = out.loss.item() if first is None else first
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        out = model(batch["patches"], batch["patch_coord"], batch["patch_valid"], ids_BT, mask_BT)
    assert model.retrieval_accuracy(out.image_BE, out.text_BE) == 1.0
    assert out.loss.item() < first / 4
