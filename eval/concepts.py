"""What the chunker merged: the concepts of one forward of a ConceptMoE VLM, token by token and image cell by cell.

ConceptMoE (arXiv 2601.21420) §3.2: the chunk module gives every token a boundary probability p_n (Eq. 2) and a
boundary decision b_n; a token with b_n = 1 closes a concept, and concept m is the window of tokens (φ(m−1), φ(m)]
that ends at the m-th boundary φ(m). Tokens after a row's last boundary belong to no concept yet: the open tail
(concept id -1). The ids here are the backbone's own: ``vlm.backbone.chunking.token_concepts``, the function
``merge_tokens`` assigns tokens to concepts with, on the boundaries the forward used (``out.chunk.b_BN``: in eval
mode p >= 0.5 plus the forced ones); p is never re-thresholded here.

Images: an image's tokens are consecutive slots (``modality_ids == 1``), images in batch order; the k-th slot holds
grid cell ``vlm.image_scan.scan_cells(h, w, config.image_chunking)[k]``, which gives ``ImageConcepts.labels_HW``, the
concept id of every cell of the token grid. A cell covers ``pixel_shuffle x pixel_shuffle`` patches of ``patch_size``
pixels of the image as the image processor resized it (``vision_tower/image_processor.py``).

    cmap = concept_map(model, processor, "<image>a red square on the left.", [img])    # a notebook
    cmap = concept_map_for_sample(model, processor, "data/demo/instruct/eval/*.tar", 0)   # a shard sample
    eval.concepts_plot.draw_concepts(cmap, "concepts.png")                              # the picture

``scripts/show_concepts.py`` is the command line. Bad input is a one-line ValueError.
"""

# Shape suffixes (docs/paper.md §0): B batch rows, N tokens of the row, H x W an image's token grid, L patches per
# image, P patch pixels * 3.

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from data_pipelines.packing import Packer, collate_rows, encode_sample_tokens
from data_pipelines.schema import Modality, SkipSample, decode_sample, open_image
from data_pipelines.tar_reader import TruncatedTar, expand_shards, read_tar_groups, skip_marked
from vlm.backbone.chunking import boundary_positions, token_concepts
from vlm.backbone.layers import make_layout
from vlm.image_scan import scan_cells, token_grids

IMAGE_MARKER = "<image>"


@dataclass
class Span:
    """One concept: the tokens [start, end] of the row, ``end`` its boundary token φ(m)."""

    id: int
    start: int
    end: int
    modality: int  # the boundary token's (how chunk_stats counts concepts per modality)
    mixed: bool  # holds text and image tokens (possible without modality_boundaries)
    p: float  # p at the boundary token
    text: str  # the text pieces, image slots as "[image i: k]"


@dataclass
class ImageConcepts:
    index: int  # 0-based, batch order
    start: int  # token index of the image's first slot
    grid: tuple[int, int]  # (h, w) token grid
    labels_HW: np.ndarray  # int: concept id of every cell, -1 = open tail
    p_HW: np.ndarray  # float: p of every cell's token
    b_HW: np.ndarray  # bool: the cell's token closes a concept
    size: tuple[int, int]  # (width, height) of the resized image, pixels: grid * cell_px
    cell_px: int  # pixels per cell side: patch_size * pixel_shuffle
    concept_ids: list[int]  # the concepts present, ascending (no -1)
    image: Image.Image | None = None  # the original resized to ``size`` (or rebuilt from the patches)

    @property
    def tokens(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def concepts(self) -> int:
        """The image's concepts as R counts them: those whose boundary token is one of its slots (a concept belongs
        to the modality of its boundary token, ``chunk_statistics``), so that summed over the images this is the
        forward's ``concepts_by_modality[IMAGE]``. ``concept_ids`` also holds the concepts that merely touch the
        image: one opened by text before it, or one still open at its last slot that text closes."""
        return int(self.b_HW.sum())


@dataclass
class ConceptMap:
    pieces: list[str]  # [N] decoded text of each token ("" on image slots)
    modality_N: np.ndarray  # int: 0 text, 1 image slot
    p_N: np.ndarray  # float: boundary probability
    b_N: np.ndarray  # bool: the boundaries the forward used
    concept_N: np.ndarray  # int: concept id, -1 = the open tail
    image_N: np.ndarray  # int: which image a slot belongs to, -1 on text
    spans: list[Span]  # [M] one per concept, in order
    images: list[ImageConcepts]
    stats: dict  # the forward's chunk_stats (r, r_by_modality, tokens, concepts, mean_p, ...)
    image_chunking: str = "raster"
    source: str = ""  # where the input came from (for titles)

    def r(self, modality: int | None = None) -> float | None:
        """R = tokens / concepts, overall or of one modality (None when it has no tokens)."""
        return self.stats["r"] if modality is None else self.stats["r_by_modality"].get(modality)

    @property
    def open_tail(self) -> int:
        return int((self.concept_N < 0).sum())


# ----------------------------------------------------------------------------- inputs
def open_image_file(path: str | os.PathLike) -> Image.Image:
    """A loaded image file, or a one-line ValueError naming it."""
    try:
        with open(path, "rb") as f:
            return open_image(f.read())
    except (OSError, SkipSample) as err:
        raise ValueError(f"cannot read image {os.fspath(path)!r}: {err}") from None


def with_image_markers(text: str, n_images: int) -> str:
    """``text`` with the missing ``<image>`` markers prepended (one per image); more markers than images is an error."""
    have = text.count(IMAGE_MARKER)
    if have > n_images:
        raise ValueError(f"the text has {have} {IMAGE_MARKER} markers but only {n_images} images are given")
    return IMAGE_MARKER * (n_images - have) + ("\n" if have < n_images and text else "") + text


def image_from_patches(patches_LP, coord_L2, valid_L, patch_size: int, mean=0.5, std=0.5) -> Image.Image:
    """The resized image the tower saw, from its normalised channels-last patches (``ImageProcessor``'s defaults)."""
    ys, xs = coord_L2[valid_L].T.tolist()
    gh, gw = max(ys) + 1, max(xs) + 1
    pixels = np.zeros((gh * patch_size, gw * patch_size, 3), dtype=np.float32)
    for y, x, patch in zip(ys, xs, patches_LP[valid_L].float().numpy()):
        tile = patch.reshape(patch_size, patch_size, 3)
        pixels[y * patch_size : (y + 1) * patch_size, x * patch_size : (x + 1) * patch_size] = tile
    return Image.fromarray((np.clip(pixels * std + mean, 0, 1) * 255).astype(np.uint8))


# ----------------------------------------------------------------------------- the map
@torch.no_grad()
def concept_map_from_batch(model, batch, tokenizer, images=None, source: str = "") -> ConceptMap:
    """The concepts of a one-row batch (``VLMProcessor`` output, or a collated shard row); ``images`` (PIL, in batch
    order) are drawn resized, else the images are rebuilt from ``batch["patches"]``. Puts ``model`` in eval mode
    (boundaries p >= 0.5 plus the forced ones, no noise)."""
    if batch["input_ids"].shape[0] != 1:
        raise ValueError(f"one row at a time: the batch has {batch['input_ids'].shape[0]} rows")
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in batch.items() if k != "labels" and torch.is_tensor(v)}
    out = model.eval()(**inputs)
    if out.chunk is None:
        chunking = model.config.text_config.chunking
        raise ValueError(f"the model has chunking={chunking!r}: it merges no tokens, so there are no concepts to show")
    valid_N = inputs.get("attention_mask", torch.ones_like(inputs["input_ids"]))[0].bool().cpu()
    ids_N = inputs["input_ids"][0].cpu()[valid_N]
    modality_N = inputs.get("modality_ids", torch.zeros_like(inputs["input_ids"]))[0].cpu()[valid_N].numpy()
    p_N = out.chunk.p_BN[0].float().cpu()[valid_N].numpy()
    b_BN = out.chunk.b_BN.cpu()
    b_N = b_BN[0][valid_N].numpy().astype(bool)
    bounds = np.flatnonzero(b_N)
    # concept ids exactly as the backbone's merge assigns them (-1: the open tail, or a window clipped at a document)
    mask, docs = inputs.get("attention_mask"), inputs.get("doc_ids")
    layout = make_layout(None if docs is None else docs.cpu(), None if mask is None else mask.cpu(), b_BN.shape, "cpu")
    concept_N = token_concepts(b_BN, *boundary_positions(b_BN), layout)[0][valid_N].numpy()

    mode = model.config.image_chunking
    image_N, image_maps = _images(model.config, batch, modality_N, p_N, b_N, concept_N, images)
    pieces = decode_pieces(tokenizer, ids_N.tolist(), modality_N)
    spans = []
    for m, end in enumerate(bounds):
        members = np.flatnonzero(concept_N == m)
        start = int(members.min()) if len(members) else int(end)
        mods = set(modality_N[start : end + 1].tolist())
        text = _span_text(pieces, modality_N, image_N, start, int(end))
        spans.append(Span(m, start, int(end), int(modality_N[end]), len(mods) > 1, float(p_N[end]), text))
    return ConceptMap(
        pieces, modality_N, p_N, b_N, concept_N, image_N, spans, image_maps, out.chunk_stats, mode, source
    )


def decode_pieces(tokenizer, ids: list[int], modality_N) -> list[str]:
    """Each text token's text ("" on image slots). A character split over byte-level tokens goes to the token that
    completes it (the ones before get "")."""
    pieces, pending = [], []
    for t, m in zip(ids, modality_N):
        if m == Modality.IMAGE:
            pieces.append("")
            pending = []
            continue
        pending.append(t)
        text = tokenizer.decode(pending)
        complete = not text.endswith("\ufffd") or len(pending) == 4  # a character has at most 4 bytes
        pieces.append(text if complete else "")
        pending = [] if complete else pending
    return pieces


def _images(config, batch, modality_N, p_N, b_N, concept_N, images) -> tuple[np.ndarray, list[ImageConcepts]]:
    """Per image its cells' concept ids / p / b (slot k -> cell ``scan_cells(h, w, mode)[k]``), and the image index
    of every slot."""
    image_N = np.full(len(modality_N), -1)
    slots = np.flatnonzero(modality_N == Modality.IMAGE)
    if "grid_hw" not in batch or batch["grid_hw"] is None or not len(slots):
        return image_N, []
    grids = token_grids(batch["grid_hw"].cpu(), config.pixel_shuffle)
    if sum(h * w for h, w in grids) != len(slots):
        raise ValueError(f"{len(slots)} image slots but the images' grids {grids} hold {sum(h * w for h, w in grids)}")
    mode = config.image_chunking
    cell_px, maps, first = config.patch_size * config.pixel_shuffle, [], 0
    for i, (h, w) in enumerate(grids):
        mine = slots[first : first + h * w]
        first += h * w
        image_N[mine] = i
        rc = scan_cells(h, w, mode).numpy()
        labels_HW, p_HW, b_HW = np.full((h, w), -1), np.zeros((h, w)), np.zeros((h, w), dtype=bool)
        labels_HW[rc[:, 0], rc[:, 1]] = concept_N[mine]
        p_HW[rc[:, 0], rc[:, 1]] = p_N[mine]
        b_HW[rc[:, 0], rc[:, 1]] = b_N[mine]
        size = (w * cell_px, h * cell_px)
        if images is not None and i < len(images):
            picture = images[i].convert("RGB").resize(size, Image.Resampling.BICUBIC)
        else:
            picture = image_from_patches(
                batch["patches"][i].cpu(),
                batch["patch_coord"][i].cpu(),
                batch["patch_valid"][i].cpu(),
                config.patch_size,
            )
        ids = sorted(set(labels_HW[labels_HW >= 0].tolist()))
        maps.append(ImageConcepts(i, int(mine[0]), (h, w), labels_HW, p_HW, b_HW, size, cell_px, ids, picture))
    return image_N, maps


def _span_text(pieces, modality_N, image_N, start: int, end: int) -> str:
    """The span's text, each run of image slots as ``[image i: k]`` (i 1-based)."""
    parts, n = [], start
    while n <= end:
        if modality_N[n] != Modality.IMAGE:
            parts.append(pieces[n])
            n += 1
            continue
        run = n
        while n <= end and modality_N[n] == Modality.IMAGE and image_N[n] == image_N[run]:
            n += 1
        parts.append(f"[image {image_N[run] + 1}: {n - run}]")
    return "".join(parts)


def concept_map(model, processor, text: str, images=(), source: str = "") -> ConceptMap:
    """The concepts of ``text`` (one ``<image>`` marker per image; missing ones are prepended) with ``images``
    (PIL images or paths), as ``processor`` builds the row and ``model`` chunks it."""
    images = [open_image_file(img) if isinstance(img, str | os.PathLike) else img for img in images]
    batch = processor(text=[with_image_markers(text, len(images))], images=[images])
    return concept_map_from_batch(model, batch, processor.tokenizer, images, source or "text")


def read_sample(shards, index: int):
    """The ``index``-th sample (0-based) of the shards in reading order (``expand_shards``' order, tar order: what
    the loader reads with ``shuffle=False``), decoded (``data_pipelines.schema.Sample``)."""
    if index < 0:
        raise ValueError(f"--index must be >= 0, got {index}")
    try:
        paths, seen = expand_shards(shards), 0
        for path in paths:
            for group in read_tar_groups(path):
                if seen == index:
                    try:
                        skip_marked(group)
                        return decode_sample(group)
                    except SkipSample as err:
                        raise ValueError(f"sample {index} of {shards!r} cannot be used: {err}") from None
                seen += 1
    except (FileNotFoundError, TruncatedTar) as err:
        raise ValueError(f"cannot read shards {shards!r}: {err}") from None
    raise ValueError(f"--index {index} is out of range: {shards!r} holds {seen} samples")


def sample_batch(processor, sample) -> tuple[dict, list[Image.Image]]:
    """One sample as the training loader feeds it (``encode_sample_tokens`` + ``collate_rows``, one row of its own
    length), and its decoded images."""
    try:
        doc = encode_sample_tokens(sample, processor.tokenizer, processor.image_processor, processor.image_token_id)
    except SkipSample as err:
        raise ValueError(f"sample {sample.key} cannot be used: {err}") from None
    packer = Packer(max(2, len(doc)))
    rows = list(packer.add(doc)) or [packer.flush()]
    return collate_rows(rows, len(rows[0]), processor.pad_token_id, processor.image_processor), doc.images


def concept_map_for_sample(model, processor, shards, index: int) -> ConceptMap:
    """The concepts of the ``index``-th sample of webdataset ``shards`` (paths, globs, brace patterns)."""
    sample = read_sample(shards, index)
    batch, images = sample_batch(processor, sample)
    return concept_map_from_batch(model, batch, processor.tokenizer, images, f"{shards} #{index} ({sample.key})")
