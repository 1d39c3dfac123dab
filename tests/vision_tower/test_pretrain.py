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
    caption_words,
    multilabel_loss,
    pair_targets,
    pair_vocabulary,
    patch_word_loss,
    sigmoid_contrastive_loss,
    word_pairs,
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


def test_word_pairs_vocabulary_and_targets_follow_their_definitions():
    idf = [0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0]  # ids 0 and 5 are in every caption: not informative, never paired
    assert word_pairs([1, 5, 2, 3, 4], idf, window=2) == {(1, 2), (1, 3), (2, 3), (2, 4), (3, 4)}
    assert word_pairs([1, 5, 2], idf, window=1) == {(1, 2)}  # the uninformative id between them does not count
    assert word_pairs([5, 0], idf, window=4) == set()
    captions = [[1, 2, 3], [1, 2, 6], [2, 1]]
    vocab = pair_vocabulary(captions, torch.tensor(idf), window=1, min_count=2)
    assert vocab == {(1, 2): 0}  # (2, 3), (2, 6) and (2, 1) are held by one caption each
    vocab = pair_vocabulary(captions, torch.tensor(idf), window=1, min_count=1)
    assert list(vocab) == sorted([(1, 2), (2, 3), (2, 6), (2, 1)])
    ids_BT = torch.tensor([[1, 2, 3], [2, 1, 0]])
    mask_BT = torch.tensor([[1, 1, 1], [1, 1, 0]]).bool()
    target_BP = pair_targets(ids_BT, mask_BT, idf, vocab, window=1)
    want = torch.zeros(2, 4)
    want[0, [vocab[(1, 2)], vocab[(2, 3)]]] = 1
    want[1, vocab[(2, 1)]] = 1
    assert torch.equal(target_BP, want)
    tower = VisionTower(embed_dim=32, depth=1, num_heads=2, patch_size=8, summary=True)
    with pytest.raises(ValueError, match="sigmoid"):
        CaptionClassPretrainer(tower, torch.tensor(idf), loss="softmax", pairs=vocab)


def test_word_pair_labels_teach_a_tiny_tower_which_colour_is_on_the_left():
    """Two colours side by side, each pair of colours in both orders: the two images of a pair have the same bag
    of words (and the same word labels), so only the pair labels ("red" before "blue") tell them apart. With them,
    every image's own pair outscores the swapped pair of the other image."""
    colours = [(255, 0, 0), (0, 0, 255), (0, 160, 0), (255, 255, 0)]
    images, captions = [], []
    for a, b in [(0, 1), (1, 0), (2, 3), (3, 2)]:
        pixels = np.zeros((16, 32, 3), dtype=np.uint8)
        pixels[:, :16], pixels[:, 16:] = colours[a], colours[b]
        images.append(Image.fromarray(pixels))
        captions.append([1 + a, 5, 1 + b, 6])  # "COLOUR left COLOUR right": 5 and 6 are in every caption
    idf_V = caption_idf(captions, vocab_size=7)
    vocab = pair_vocabulary(captions, idf_V, window=1, min_count=1)
    assert len(vocab) == 4
    torch.manual_seed(0)
    tower = VisionTower(embed_dim=32, depth=1, num_heads=2, patch_size=8, summary=True)
    model = CaptionClassPretrainer(tower, idf_V, loss="sigmoid", pairs=vocab, pair_window=1)
    batch = PROC(images)
    fit(model, batch, torch.tensor(captions), torch.ones(4, 4, dtype=torch.bool), steps=200)
    with torch.no_grad():
        summary = model.tower.summarize(model.tower(batch["patches"], batch["patch_coord"], batch["patch_valid"]))
        pair_logits = model.head(summary)[:, 7:]
    for i, (a, _, b, _) in enumerate(captions):
        assert pair_logits[i, vocab[(a, b)]] > pair_logits[i, vocab[(b, a)]] + 1.0


def test_patch_word_loss_is_noisy_or_cross_entropy_over_the_valid_patches():
    torch.manual_seed(0)
    logits_BLK = torch.randn(3, 5, 4)
    valid_BL = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]]).bool()
    labels_BK = torch.tensor([[1, 0, 0, 1], [0, 1, 0, 0], [1, 1, 1, 1]]).float()
    want = 0.0
    for b in range(3):
        p_LK = torch.sigmoid(logits_BLK[b, valid_BL[b]]).double()
        image_K = 1 - (1 - p_LK).prod(0)  # noisy-OR: the image holds the word unless every patch says no
        want += -(labels_BK[b] * image_K.log() + (1 - labels_BK[b]) * (1 - image_K).log()).sum().item()
    assert patch_word_loss(logits_BLK, valid_BL, labels_BK).item() == pytest.approx(want / 3, rel=1e-5)
    garbage_BLK = logits_BLK.clone()
    garbage_BLK[~valid_BL] = 50.0  # padding patches say nothing
    assert torch.allclose(
        patch_word_loss(garbage_BLK, valid_BL, labels_BK), patch_word_loss(logits_BLK, valid_BL, labels_BK)
    )
    assert caption_words([[1, 2, 0], [2, 3, 0]], torch.tensor([0.0, 1.0, 0.5, 1.0, 2.0])) == [1, 2, 3]


def test_patch_labels_put_each_word_on_the_patches_that_show_it():
    """Two colours side by side, captions name both colours and nothing says which is where: with patch labels,
    each colour's detector fires more on every patch of its own half than on any of the other half's (the word
    sits on the patches of the thing it names), and a negative weight or a missing word list is refused."""
    colours = [(255, 0, 0), (0, 0, 255), (0, 160, 0), (255, 255, 0)]
    images, captions = [], []
    for a, b in [(0, 1), (1, 0), (2, 3), (3, 2), (0, 2), (3, 1)]:
        pixels = np.zeros((16, 32, 3), dtype=np.uint8)
        pixels[:, :16], pixels[:, 16:] = colours[a], colours[b]
        images.append(Image.fromarray(pixels))
        captions.append([1 + a, 1 + b, 5])  # 5 is in every caption: no label
    idf_V = caption_idf(captions, vocab_size=6)
    torch.manual_seed(0)
    tower = VisionTower(embed_dim=32, depth=1, num_heads=2, patch_size=8, summary=True)
    words = caption_words(captions, idf_V)
    assert words == [1, 2, 3, 4]
    model = CaptionClassPretrainer(tower, idf_V, loss="sigmoid", patch_labels=1.0, patch_words=words)
    batch = PROC(images)
    _, out = fit(model, batch, torch.tensor(captions), torch.ones(6, 3, dtype=torch.bool), steps=200)
    assert out.patch_loss is not None and out.patch_loss.item() < 1.0
    with torch.no_grad():
        feats = model.tower(batch["patches"], batch["patch_coord"], batch["patch_valid"])
        prob_BLK = torch.sigmoid(model.patch_head(feats.features_BLD))
    for i, (a, b, _) in enumerate(captions):
        left_L = feats.valid_BL[i] & (feats.coord_BL2[i, :, 1] < 2)  # patches 8 px wide: x 0-1 is the left half
        right_L = feats.valid_BL[i] & (feats.coord_BL2[i, :, 1] >= 2)
        assert prob_BLK[i, left_L, a - 1].min() > prob_BLK[i, right_L, a - 1].max() + 0.2
        assert prob_BLK[i, right_L, b - 1].min() > prob_BLK[i, left_L, b - 1].max() + 0.2
    with pytest.raises(ValueError, match="patch_labels"):
        CaptionClassPretrainer(tower, idf_V, loss="sigmoid", patch_labels=1.0)
    with pytest.raises(ValueError, match="patch_labels"):
        CaptionClassPretrainer(tower, idf_V, loss="sigmoid", patch_labels=-1.0, patch_words=words)


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
