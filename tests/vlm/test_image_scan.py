"""``image_chunking``: scan orders, 2-D neighbours, and, for every choice, causality, packing independence and the
concept model's load equal to the reported concept count (stepwise decoding equal to the full forward, for every
choice: tests/vlm/backbone/test_generation.py)."""

# Shape suffixes (docs/paper.md §0): B batch rows, N tokens per row, D width, 2 a (left, up) pair.

import random

import pytest
import torch
import torch.nn.functional as F

from data_pipelines.synthetic_images import captioned_image
from vision_tower import ImageProcessor
from vlm import ConceptMoEVLM, VLMProcessor
from vlm.backbone.chunking import ChunkModule
from vlm.backbone.layers import make_layout
from vlm.image_scan import IMAGE_CHUNKING, neighbour_offsets, row_ends, scan_cells, scan_order, token_grids

IMAGE_KEYS = ("patches", "patch_coord", "patch_valid", "grid_hw")


@pytest.fixture()
def processor(hf_tokenizer):
    return VLMProcessor(hf_tokenizer, ImageProcessor(patch_size=16, max_patches=64, pixel_shuffle=2))


def make_vlm(processor, mode, seed=0, **overrides):
    torch.manual_seed(seed)
    model = ConceptMoEVLM.from_preset(
        "tiny",
        image_token_id=processor.image_token_id,
        max_patches=64,
        boundary_router_init="random",
        image_chunking=mode,
        **overrides,
    )
    return model.eval()


def images(n, seed=0, size=(128, 96)):
    """Scenes large enough for a 3 x 4 token grid (6 x 8 patches), so rows, snakes and Z-blocks all differ."""
    rng = random.Random(seed)
    return [captioned_image(rng)[0].resize(size) for _ in range(n)]


# ----------------------------------------------------------------------------- the scan orders themselves
@pytest.mark.parametrize("h, w", [(1, 1), (3, 4), (5, 2), (8, 8)])
def test_scan_orders_are_permutations_and_snake_steps_touch(h, w):
    for mode in IMAGE_CHUNKING:
        assert sorted(scan_order(h, w, mode).tolist()) == list(range(h * w)), mode
    cells = scan_cells(h, w, "snake")
    assert ((cells[1:] - cells[:-1]).abs().sum(-1) == 1).all()  # every step moves to a touching cell
    for mode in ("raster", "rows", "router2d"):
        assert torch.equal(scan_order(h, w, mode), torch.arange(h * w))


def test_zorder_fills_every_aligned_block_in_one_run():
    cells = scan_cells(8, 8, "zorder")
    for size in (2, 4, 8):
        block = (cells[:, 0] // size) * (8 // size) + cells[:, 1] // size
        runs = block.view(-1, size * size)
        assert (runs == runs[:, :1]).all(), size  # each consecutive run of size² tokens is one aligned block
    with pytest.raises(ValueError, match="image_chunking='hilbert' is invalid"):
        scan_order(2, 2, "hilbert")


def test_row_ends_and_neighbours_follow_their_definitions():
    grids = [(3, 4), (2, 1)]
    ends, offsets = row_ends(grids), neighbour_offsets(grids)
    start = 0
    for h, w in grids:
        for k in range(h * w):
            r, c = divmod(k, w)
            assert bool(ends[start + k]) == (c == w - 1)
            left, up = offsets[start + k].tolist()
            assert up == (w if r > 0 else 0)  # raster order: the cell above is w tokens back
            assert left == (1 if c > 0 or r == 0 else 0)  # a later row's first token has no left neighbour
        start += h * w


@pytest.mark.parametrize("kind", ["cosine", "linear"])
@torch.no_grad()
def test_router2d_p_is_the_min_over_neighbours_of_eq2(kind):
    torch.manual_seed(0)
    chunker = ChunkModule(16, kind)
    h_BND = torch.randn(2, 12, 16)
    g = torch.Generator().manual_seed(1)
    idx = torch.arange(12)
    back_BN2 = torch.stack([torch.randint(0, 2, (2, 12), generator=g), torch.randint(0, 4, (2, 12), generator=g)], -1)
    back_BN2 = torch.minimum(back_BN2, idx[None, :, None])  # never before the row
    back_BN2[:, 1:, 0] = back_BN2[:, 1:, 0].clamp_min((back_BN2[:, 1:, 1] == 0).long())  # at least one neighbour
    layout = make_layout(None, None, (2, 12), h_BND.device, neighbour_BN2=back_BN2)
    p_BN = chunker.boundary_probs(h_BND, layout)

    def pair(b, n, m):  # Eq. 2 (or the linear form) between token n and an earlier token m, by its definition
        if kind == "cosine":
            q, k = chunker.q_proj(h_BND[b, n]), chunker.k_proj(h_BND[b, m])
            return float((1 - F.cosine_similarity(q, k, dim=0)) / 2)
        return float(torch.sigmoid(chunker.proj(torch.cat([h_BND[b, m], h_BND[b, n]]))))

    for b in range(2):
        assert float(p_BN[b, 0]) == 1.0  # the document start
        for n in range(1, 12):
            expected = min(pair(b, n, n - back) for back in back_BN2[b, n].tolist() if back > 0)
            assert abs(float(p_BN[b, n]) - expected) < 1e-5, (b, n)
    later = h_BND.clone()
    later[:, 7] += 1.0  # a token's p never depends on later tokens
    assert torch.equal(chunker.boundary_probs(later, layout)[:, :7], p_BN[:, :7])
    one_d = torch.zeros(2, 12, 2, dtype=torch.long)
    one_d[..., 0] = 1  # (left, no up) everywhere: exactly the paper's 1-D router
    layout_1d = make_layout(None, None, (2, 12), h_BND.device, neighbour_BN2=one_d)
    plain = chunker.boundary_probs(h_BND, make_layout(None, None, (2, 12), h_BND.device))
    assert torch.allclose(chunker.boundary_probs(h_BND, layout_1d), plain, atol=1e-6)


# ----------------------------------------------------------------------------- the model under every choice
@pytest.mark.parametrize("mode", IMAGE_CHUNKING)
@torch.no_grad()
def test_image_tokens_fill_their_slots_in_scan_order(processor, mode):
    model = make_vlm(processor, mode)
    imgs = images(2, seed=1)
    batch = processor(text=["<image> left and <image> right"], images=[imgs])
    embeds = model.embed(batch["input_ids"], batch["modality_ids"], None, *(batch[k] for k in IMAGE_KEYS))
    slots = embeds[0][batch["modality_ids"][0].bool()]
    start = 0
    for img, (h, w) in zip(imgs, token_grids(batch["grid_hw"], model.config.pixel_shuffle)):
        alone = processor.image_processor([img])
        raster = model.image_embeddings(*(alone[k] for k in IMAGE_KEYS))  # the tower's row-major tokens
        assert torch.allclose(slots[start : start + h * w], raster[scan_order(h, w, mode)], atol=1e-5)
        start += h * w


@pytest.mark.parametrize("mode", IMAGE_CHUNKING)
@torch.no_grad()
def test_interleaved_causality(processor, mode):
    model = make_vlm(processor, mode)
    imgs = images(3, seed=2)
    base = processor(text=["the <image> shows a green circle and <image> shows blue"], images=[imgs[:2]])
    changed = processor(
        text=["the <image> shows a green circle and <image> shows a red square!!"], images=[[imgs[0], imgs[2]]]
    )
    slots = (base["modality_ids"][0] == 1).nonzero().flatten()
    cut = int(slots[-base["num_tokens"][1]]) - 1  # the last token before the second image
    a, b = model(**base), model(**changed)
    assert torch.allclose(a.logits[:, : cut + 1], b.logits[:, : cut + 1], atol=1e-5)
    assert torch.equal(a.chunk.b_BN[:, : cut + 1], b.chunk.b_BN[:, : cut + 1])
    n = min(a.logits.shape[1], b.logits.shape[1])
    assert not torch.allclose(a.logits[:, cut + 1 : n], b.logits[:, cut + 1 : n], atol=1e-4)


def concept_model_load(model, batch) -> int:
    """Concepts the concept model actually ran on (real positions of its input layout), counted by a hook."""
    seen = []
    hook = model.language_model.model.concept_model.register_forward_hook(
        lambda _m, args, _o: seen.append(int(args[1].valid_BN.sum()))
    )
    try:
        out = model(**batch)
    finally:
        hook.remove()
    return out, seen[0]


@pytest.mark.parametrize("mode", IMAGE_CHUNKING)
@torch.no_grad()
def test_packed_rows_equal_separate_rows_and_concepts_equal_the_load(processor, mode):
    model = make_vlm(processor, mode, seed=3)
    imgs = images(3, seed=3)
    texts, parts = ["a scene: <image>", "<image> two <image> pictures"], [imgs[:1], imgs[1:]]
    alone = [processor(text=[t], images=[p], add_special_tokens=False) for t, p in zip(texts, parts)]
    packed = processor(text=["".join(texts)], images=[imgs], add_special_tokens=False)
    assert torch.equal(packed["input_ids"], torch.cat([a["input_ids"] for a in alone], 1))
    lengths = [a["input_ids"].shape[1] for a in alone]
    doc_ids = torch.cat([torch.full((1, n), i) for i, n in enumerate(lengths)], 1)
    out, load = concept_model_load(model, {**packed, "doc_ids": doc_ids})
    assert load == out.chunk_stats["concepts"] == int(out.chunk.b_BN.sum())  # R = tokens / concepts actually run
    start = 0
    for a, n in zip(alone, lengths):
        single = model(**a)
        assert torch.allclose(out.logits[0, start : start + n], single.logits[0], atol=1e-4)
        assert torch.equal(out.chunk.b_BN[0, start : start + n], single.chunk.b_BN[0])
        start += n


@torch.no_grad()
def test_rows_never_let_a_concept_cross_a_token_row(processor):
    model = make_vlm(processor, "rows", seed=5)
    model.language_model.model.chunker.q_proj.weight.zero_()  # p = 0.5 everywhere: the router alone would merge all
    batch = processor(text=["<image> and <image>"], images=[images(2, seed=5)])
    b_N = model(**batch).chunk.b_BN[0]
    slots = batch["modality_ids"][0].bool().nonzero().flatten()
    start = 0
    for h, w in token_grids(batch["grid_hw"], model.config.pixel_shuffle):
        image_b = b_N[slots[start : start + h * w]].view(h, w)
        assert image_b[:, -1].all()  # every row's last token closes a concept
        start += h * w


def test_router2d_trains_and_choices_are_checked(processor):
    model = make_vlm(processor, "router2d").train()
    batch = processor(text=["<image> a blue circle on the left."], images=[images(1, seed=6)])
    model(**batch, labels=batch["input_ids"]).loss.backward()
    assert model.language_model.model.chunker.q_proj.weight.grad.abs().sum() > 0
    model.set_chunking(image_chunking="snake")
    assert model.config.image_chunking == "snake"
    with pytest.raises(ValueError, match="image_chunking='spiral' is invalid"):
        model.set_chunking(image_chunking="spiral")
    with pytest.raises(ValueError, match="router2d .* needs text_config.chunking='dynamic'"):
        ConceptMoEVLM.from_preset("tiny-moe", image_chunking="router2d")
    assert model.config.image_chunking == "snake"
    model.set_chunking(image_chunking="router2d")
    with pytest.raises(ValueError, match="router2d .* needs text_config.chunking='dynamic'"):
        model.set_chunking(chunking="fixed", target_r=2.0)  # the backbone side moving is checked too
    assert model.config.text_config.chunking == "dynamic" and model.language_model.config.chunking == "dynamic"
