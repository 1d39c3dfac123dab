"""The concept visualiser (eval/concepts.py, eval/concepts_plot.py, scripts/show_concepts.py) on tiny random models.

The regions and spans drawn must be exactly the backbone's concepts (ConceptMoE, arXiv 2601.21420, §3.2: concept m
is the tokens (φ(m−1), φ(m)] up to its boundary φ(m)), recomputed here from ``out.chunk.b_BN`` with
``vlm.backbone.chunking.boundary_positions``, image slots mapped to cells through ``vlm.image_scan.scan_cells``.
"""

# Shape suffixes (docs/paper.md §0): B batch rows, N tokens per row, H x W an image's token grid.

import copy
import importlib.util
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds

from data_pipelines.schema import Sample, Segment, encode_sample, image_bytes
from data_pipelines.synthetic_images import captioned_image
from eval.concepts import concept_map, concept_map_for_sample, with_image_markers
from eval.concepts_plot import draw_concepts, painted_labels, region_rgb, write_html
from vision_tower import ImageProcessor
from vlm import ConceptMoEVLM, ConceptMoEVLMConfig, VLMProcessor
from vlm.backbone.chunking import boundary_positions
from vlm.image_scan import scan_cells, token_grids

ROOT = Path(__file__).resolve().parents[2]
SCANS = ["raster", "snake", "zorder"] if hasattr(ConceptMoEVLMConfig(), "image_chunking") else ["raster"]
TEXT = "<image> a red square on the left. <image> What colour is the square?"


@pytest.fixture(scope="module")
def processor(hf_tokenizer):
    return VLMProcessor(copy.deepcopy(hf_tokenizer), ImageProcessor(patch_size=16, max_patches=64, pixel_shuffle=2))


def tiny(processor, seed=0, preset="tiny", **overrides):
    torch.manual_seed(seed)
    if preset == "tiny":
        overrides.setdefault("boundary_router_init", "random")
    return ConceptMoEVLM.from_preset(preset, image_token_id=processor.image_token_id, max_patches=64, **overrides)


def pictures(seed=0):
    """Two images with 4x4 and 2x3 token grids (so that the scan orders differ)."""
    rng = random.Random(seed)
    return [captioned_image(rng)[0].resize((128, 128)), captioned_image(rng)[0].resize((96, 64))]


def model_concepts(model, batch, scan):
    """The backbone's boundaries φ, per concept (text token indices, {(image, row, col)}), and the open tail."""
    with torch.no_grad():
        out = model.eval()(**batch)
    boundary_BM, valid_BM = boundary_positions(out.chunk.b_BN)
    phis = boundary_BM[0][valid_BM[0]].tolist()
    modality_N = batch["modality_ids"][0].tolist()
    slot_cell = {}  # token index -> (image, row, col)
    slots = [n for n, m in enumerate(modality_N) if m == 1]
    for i, (h, w) in enumerate(token_grids(batch["grid_hw"], model.config.pixel_shuffle)):
        for r, c in scan_cells(h, w, scan).tolist():  # the k-th slot of image i holds its k-th cell in scan order
            slot_cell[slots.pop(0)] = (i, r, c)

    def split(window):
        return {n for n in window if modality_N[n] == 0}, {slot_cell[n] for n in window if modality_N[n] == 1}

    windows = [range(prev + 1, phi + 1) for prev, phi in zip([-1, *phis[:-1]], phis)]
    return out, phis, [split(w) for w in windows], split(range(phis[-1] + 1, len(modality_N)))


def drawn_concepts(cmap, m):
    text = {n for n in np.flatnonzero(cmap.concept_N == m).tolist() if cmap.modality_N[n] == 0}
    cells = {(img.index, r, c) for img in cmap.images for r, c in zip(*np.nonzero(img.labels_HW == m))}
    return text, cells


@pytest.mark.parametrize("scan", SCANS)
@pytest.mark.parametrize("seed", [0, 1])  # seed 0: regions of several cells; seed 1: a concept per image token
def test_regions_and_spans_are_exactly_the_models_concepts(processor, scan, seed):
    model = tiny(processor, seed, **({"image_chunking": scan} if scan != "raster" else {}))
    images = pictures()
    cmap = concept_map(model, processor, TEXT, images)
    out, phis, concepts, tail = model_concepts(model, processor(text=[TEXT], images=[images]), scan)
    assert cmap.image_chunking == scan
    assert len(cmap.spans) == len(concepts) == out.chunk_stats["concepts"]
    assert cmap.stats["r"] == out.chunk_stats["r"] and cmap.r(1) == out.chunk_stats["r_by_modality"][1]
    for m, expected in enumerate(concepts):
        assert drawn_concepts(cmap, m) == expected, f"concept {m}"
        assert (cmap.spans[m].start, cmap.spans[m].end) == ((phis[m - 1] + 1) if m else 0, phis[m])
    assert drawn_concepts(cmap, -1) == tail  # the open tail
    assert [img.grid for img in cmap.images] == [(4, 4), (2, 3)]
    for img in cmap.images:  # what the region panel paints: each cell's pixels carry that cell's concept
        assert img.concept_ids == sorted(set(img.labels_HW[img.labels_HW >= 0].tolist()))
        painted = painted_labels(img)
        assert painted.shape == (img.size[1], img.size[0]) == (img.grid[0] * 32, img.grid[1] * 32)
        for dy in range(0, img.cell_px, 7):
            for dx in range(0, img.cell_px, 7):
                assert np.array_equal(painted[dy :: img.cell_px, dx :: img.cell_px], img.labels_HW)
        assert region_rgb(img).shape == (*painted.shape, 3)


def test_open_tail_is_marked_in_the_data_png_and_html(processor, tmp_path):
    """Fixed chunking (a boundary at positions 0, 4, 8, ...): the tokens after the last one are the open tail."""
    model = tiny(processor)
    model.set_chunking(chunking="fixed", target_r=4)
    cmap = concept_map(model, processor, "What colour is the square on the left of the picture?")
    n = len(cmap.pieces)
    assert n % 4 != 1 and cmap.images == []  # the text leaves a tail
    assert cmap.concept_N.tolist() == [(k + 3) // 4 if k <= 4 * ((n - 1) // 4) else -1 for k in range(n)]
    assert cmap.open_tail == (n - 1) % 4 and len(cmap.spans) == (n - 1) // 4 + 1
    png, page = draw_concepts(cmap, tmp_path / "c.png"), write_html(cmap, tmp_path / "c.html")
    assert png.stat().st_size > 1000
    assert page.read_text().count("class='t open'") == cmap.open_tail


def test_non_chunked_model_is_a_one_line_error(processor):
    with pytest.raises(ValueError, match=r"chunking='none'.*no concepts") as err:
        concept_map(tiny(processor, preset="tiny-moe"), processor, "hello")
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------- the command line
def run_cli(argv, capsys):
    spec = importlib.util.spec_from_file_location("show_concepts", ROOT / "scripts" / "show_concepts.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    try:
        script.main([str(a) for a in argv])
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def saved(processor, tmp_path_factory):
    """A tiny chunked model and a non-chunked one saved with the processor, two image files and a 2-sample shard."""
    root = tmp_path_factory.mktemp("show_concepts")
    for name, preset in (("chunked", "tiny"), ("moe", "tiny-moe")):
        tiny(processor, preset=preset).save_pretrained(root / name)
        processor.save_pretrained(root / name)
    images = pictures(1)
    for k, img in enumerate(images):
        img.save(root / f"img{k}.png")
    samples = [Sample(f"s{k}", [Segment(image=image_bytes(images[k])), Segment(text=f"caption {k}.")]) for k in (0, 1)]
    with wds.ShardWriter(str(root / "shard-%03d.tar"), maxcount=10, verbose=0) as writer:
        for sample in samples:
            writer.write(encode_sample(sample))
    return root


def test_cli_writes_png_and_html_and_prints_the_models_r(saved, capsys):
    out_png = saved / "out" / "c.png"
    out_png.parent.mkdir()
    argv = ["--model", saved / "chunked", "--image", saved / "img0.png", "--image", saved / "img1.png"]
    code, out, err = run_cli([*argv, "--text", "What is on the <image>?", "--out", out_png, "--html"], capsys)
    assert code == 0, err
    assert out_png.is_file() and out_png.with_suffix(".html").is_file() and len(out.strip().splitlines()) == 1
    model, processor = ConceptMoEVLM.from_pretrained(saved / "chunked"), VLMProcessor.from_pretrained(saved / "chunked")
    batch = processor(text=[with_image_markers("What is on the <image>?", 2)], images=[pictures(1)])
    with torch.no_grad():
        stats = model.eval()(**batch).chunk_stats
    r, r_text, r_image = map(float, re.search(r"R (\S+) text (\S+) image (\S+)", out).groups())
    assert (r, r_text, r_image) == pytest.approx((stats["r"], *(stats["r_by_modality"][m] for m in (0, 1))), abs=1e-4)
    assert f"{stats['tokens']} tokens, {stats['concepts']} concepts" in out


def test_cli_reads_a_shard_sample_and_refuses_bad_input_in_one_line(saved, capsys):
    shards = str(saved / "shard-*.tar")
    code, out, err = run_cli(
        ["--model", saved / "chunked", "--shards", shards, "--index", 1, "--out", saved / "s.png"], capsys
    )
    assert code == 0 and (saved / "s.png").is_file(), err
    model, processor = ConceptMoEVLM.from_pretrained(saved / "chunked"), VLMProcessor.from_pretrained(saved / "chunked")
    cmap = concept_map_for_sample(model, processor, shards, 1)
    assert "caption 1." in "".join(cmap.pieces) and len(cmap.images) == 1
    assert cmap.stats["concepts"] == len(cmap.spans)
    cases = {
        "out of range: .* holds 2 samples": ["--model", saved / "chunked", "--shards", shards, "--index", 5],
        "chunking='none'": ["--model", saved / "moe", "--image", saved / "img0.png"],
        "cannot read image": ["--model", saved / "chunked", "--image", saved / "chunked" / "config.json"],
    }
    for message, argv in cases.items():
        code, out, err = run_cli([*argv, "--out", saved / "bad.png"], capsys)
        errors = [line for line in err.splitlines() if line.startswith("show_concepts: error:")]
        assert code == 2 and len(errors) == 1 and re.search(message, errors[0]), err
        assert not (saved / "bad.png").exists()


def test_cli_legend_and_token_strip_count_an_images_concepts_alike(saved, capsys):
    """The legend's image counts (the forward's ``concepts_by_modality``: concepts whose boundary is an image slot)
    and the strip's ``[image 1: k tokens, c concepts]`` box are one count, also when a concept opened in the image
    is closed by the text after it (which the strip once counted too: 16 tokens / 4 concepts vs 5 concepts)."""
    text = "<image>What is it?"
    page = saved / "agree.html"
    code, _, err = run_cli(
        [
            "--model",
            saved / "chunked",
            "--image",
            saved / "img0.png",
            "--text",
            text,
            "--out",
            page.with_suffix(".png"),
            "--html",
        ],
        capsys,
    )
    assert code == 0, err
    html_text = page.read_text()
    legend = re.search(r"image R \S+ \((\d+) tokens / (\d+) concepts", html_text).groups()
    strip = re.findall(r"\[image 1: (\d+) tokens, (\d+) concepts\]", html_text)
    assert strip == [legend]
    model, processor = ConceptMoEVLM.from_pretrained(saved / "chunked"), VLMProcessor.from_pretrained(saved / "chunked")
    cmap = concept_map(model, processor, text, [saved / "img0.png"])
    (img,) = cmap.images
    assert legend == (str(img.tokens), str(img.concepts)) == ("16", str(cmap.stats["concepts_by_modality"][1]))
    assert len(img.concept_ids) > img.concepts  # a concept crosses into the text: the case the two counts split on
