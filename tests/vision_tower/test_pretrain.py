"""vision_tower.pretrain: SigLIP's and SuperClass's losses by their definitions, padding that changes nothing, and
toys that learn."""

# Shape suffixes: B images (= captions), L patches, T caption tokens, E embedding width.

import math

import numpy as np
import pytest
import torch
from PIL import Image

from vision_tower import ImageProcessor, VisionTower
from vision_tower.pretrain import (
    CaptionClassPretrainer,
    ContrastivePretrainer,
    caption_classification_loss,
    caption_idf,
    caption_targets,
    multilabel_loss,
    sigmoid_contrastive_loss,
)

PROC = ImageProcessor(patch_size=8, max_patches=16, pixel_shuffle=2)


def tiny_pretrainer(seed=0, vocab=16):
    torch.manual_seed(seed)
    tower = VisionTower(embed_dim=32, depth=1, num_heads=2, patch_size=8, summary=True)
    sizes = dict(embed_dim=16, text_dim=16, text_depth=1, text_heads=2, max_caption_tokens=8)
    return ContrastivePretrainer(tower, vocab, **sizes)


def fit(model, batch, ids_BT, mask_BT, steps: int):
    """``steps`` of AdamW (lr 1e-2) on one batch; the first step's loss and the trained model's eval-mode output."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs = (batch["patches"], batch["patch_coord"], batch["patch_valid"], ids_BT, mask_BT)
    first = None
    for _ in range(steps):
        out = model(*inputs)
        first = out.loss.item() if first is None else first
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        return first, model(*inputs)


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


def test_caption_idf_and_targets_follow_their_definitions():
    captions = [[1, 2, 3], [1, 2, 2], [1, 4]]
    idf_V = caption_idf(captions, vocab_size=6)
    df = {0: 0, 1: 3, 2: 2, 3: 1, 4: 1, 5: 0}
    for token, count in df.items():
        assert abs(idf_V[token].item() - max(0.0, math.log(3) - math.log(1 + count))) < 1e-6
    ids_BT = torch.tensor([[1, 2, 3, 0], [4, 4, 0, 0], [1, 0, 0, 0]])  # 0 is padding here, never a label
    mask_BT = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]]).bool()
    target_BV = caption_targets(ids_BT, mask_BT, idf_V)
    want = idf_V * torch.tensor([0, 1, 1, 1, 0, 0.0])  # caption 0: tokens 1, 2, 3, each once, weighted by IDF
    assert torch.allclose(target_BV[0], want / want.sum())
    assert torch.allclose(target_BV[1], torch.tensor([0, 0, 0, 0, 1, 0.0]))  # a repeated token counts once
    assert target_BV[2].sum() == 0  # only a token in every caption (IDF 0): no target, no loss
    logits_BV = torch.randn(3, 6)
    by_hand = -sum(float(target_BV[i] @ torch.log_softmax(logits_BV[i], -1)) for i in range(3)) / 3
    assert abs(caption_classification_loss(logits_BV, target_BV).item() - by_hand) < 1e-6
    labels = [[0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 1, 0], [0] * 6]  # positives: the ids of IDF > 0 (3 and 4)
    bce = 0.0
    for i, row in enumerate(labels):
        for c, y in enumerate(row):
            p = 1 / (1 + math.exp(-logits_BV[i, c].item()))
            bce -= math.log(p) if y else math.log(1 - p)
    assert abs(multilabel_loss(logits_BV, target_BV).item() - bce / 3) < 1e-5


@pytest.mark.parametrize("loss", ["softmax", "sigmoid"])
def test_a_tiny_tower_learns_the_words_of_its_images_caption(loss):
    """Four images, each a colour on the left or right half: captions ``[colour, side]``. Every word is learned:
    each image's two highest logits are its own caption's two words."""
    colours = [(255, 0, 0), (0, 0, 255)]
    images, captions = [], []
    for c, colour in enumerate(colours):
        for s in range(2):  # left, right
            pixels = np.zeros((16, 32, 3), dtype=np.uint8)
            pixels[:, 16 * s : 16 * s + 16] = colour
            images.append(Image.fromarray(pixels))
            captions.append([1 + c, 3 + s])
    batch = PROC(images)
    ids_BT, mask_BT = torch.tensor(captions), torch.ones(4, 2, dtype=torch.bool)
    torch.manual_seed(0)
    tower = VisionTower(embed_dim=32, depth=1, num_heads=2, patch_size=8, summary=True)
    model = CaptionClassPretrainer(tower, caption_idf(captions, vocab_size=5), loss=loss)
    _, out = fit(model, batch, ids_BT, mask_BT, steps=200)
    assert model.batch_score(out) == 1.0
    if loss == "softmax":
        assert out.loss.item() < math.log(2) + 0.05  # the floor: two equally weighted words each get half
    else:
        assert out.loss.item() < 0.5  # five independent labels per image, each nearly certain


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
    first, out = fit(model, batch, ids_BT, mask_BT, steps=80)
    assert model.retrieval_accuracy(out.image_BE, out.text_BE) == 1.0
    assert out.loss.item() < first / 4
