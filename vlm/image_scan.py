"""How an image's tokens enter the token row, and which earlier token the chunker compares each with.

ConceptMoE (§4.2) chunks image tokens like text: in a 1-D scan, Eq. 2 compares every token with the one before it.
With raster order a concept can run off the end of one patch row into the start of the next (merging regions far
apart in the image), while tokens that touch vertically are never compared. ``image_chunking`` (a
:class:`vlm.ConceptMoEVLMConfig` field, default ``raster``, the paper's) chooses among:

- ``raster``: row-major order, left neighbour only (the paper);
- ``rows``: raster order plus a forced boundary on the last token of every token row, so no concept crosses a row;
- ``snake``: boustrophedon order (even rows left to right, odd rows right to left), so consecutive tokens always
  touch and a run of tokens is a connected 2-D region;
- ``zorder``: Z-order (Morton) order, so a run of tokens fills compact 2×2, 4×4, ... blocks;
- ``router2d``: raster order, but Eq. 2 also compares a token with its upper neighbour and puts a boundary only
  where the token differs from both (p = min(p_left, p_up)); a row's first token compares with the one above it only.
  Both neighbours come earlier in the row, so p stays causal.

Token positions (RoPE) and the processor's slots simply follow the sequence order: the k-th slot of an image holds
the token at grid cell ``scan_order(h, w, mode)[k]``. Images sit whole in the prompt (generation only adds text), so
prefill + incremental decoding is unchanged. FLOPs (``vlm.accounting.flops``, matrix products only): no choice adds
a parameter or a matrix product. ``snake`` / ``zorder`` permute tokens; ``rows``' forced boundaries count in the
measured R, and in the ratio loss's F like any boundary, so the global target R holds with them; ``router2d`` adds
one d-wide dot product per image token (its q and k projections are the ones Eq. 2 computes anyway).

The pure functions here are shared by the model (``vlm.model``) and the concept visualiser (``eval.concepts``).
"""

# Shape suffixes (docs/paper.md §0): T image tokens of a batch flattened (images in batch order, each in scan order),
# D width, 2 a (row, column) pair.

from __future__ import annotations

import torch

IMAGE_CHUNKING = ("raster", "rows", "snake", "zorder", "router2d")
REORDERING = ("snake", "zorder")  # the choices that change the order tokens enter the row


def token_grids(grid_hw: torch.Tensor, pixel_shuffle: int) -> list[tuple[int, int]]:
    """(rows, columns) of every image's token grid: its patch grid ``grid_hw`` [I, 2] over the pixel shuffle."""
    return [(int(h) // pixel_shuffle, int(w) // pixel_shuffle) for h, w in grid_hw.view(-1, 2).tolist()]


def _morton(r: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Interleaved bits of (row, column): the Z-order key (row bits on the odd places, so a 2x2 block reads
    (0,0) (0,1) (1,0) (1,1), like raster inside the block)."""
    key = torch.zeros_like(r)
    for bit in range(16):
        key |= ((c >> bit) & 1) << (2 * bit)
        key |= ((r >> bit) & 1) << (2 * bit + 1)
    return key


def scan_order(h: int, w: int, mode: str) -> torch.Tensor:
    """Row-major cell index (r * w + c) of the k-th token in the sequence, for an h x w token grid. [h * w] long."""
    if mode not in IMAGE_CHUNKING:
        raise ValueError(f"image_chunking={mode!r} is invalid; allowed values are {', '.join(IMAGE_CHUNKING)}")
    raster = torch.arange(h * w)
    if mode == "snake":
        grid = raster.view(h, w).clone()
        grid[1::2] = grid[1::2].flip(-1)
        return grid.flatten()
    if mode == "zorder":
        return raster[torch.argsort(_morton(raster // w, raster % w), stable=True)]
    return raster


def scan_cells(h: int, w: int, mode: str) -> torch.Tensor:
    """(row, column) of the k-th token in the sequence. [h * w, 2] long."""
    cell = scan_order(h, w, mode)
    return torch.stack([cell // w, cell % w], dim=-1)


def reorder_image_tokens(image_TD: torch.Tensor, grids: list[tuple[int, int]], mode: str) -> torch.Tensor:
    """Image tokens in row-major order per image (the tower's) -> the same tokens in ``mode``'s scan order."""
    if mode not in REORDERING:
        return image_TD
    index, offset = [], 0
    for h, w in grids:
        index.append(scan_order(h, w, mode) + offset)
        offset += h * w
    return image_TD[torch.cat(index).to(image_TD.device)] if index else image_TD


def row_ends(grids: list[tuple[int, int]]) -> torch.Tensor:
    """``rows``: True on the last token of every token row (raster order). [T] bool."""
    return torch.cat([(torch.arange(h * w) % w == w - 1) for h, w in grids] or [torch.zeros(0, dtype=torch.bool)])


def neighbour_offsets(grids: list[tuple[int, int]]) -> torch.Tensor:
    """``router2d``: how many tokens back the two tokens lie that Eq. 2 compares each image token with, (left, up);
    0 where there is none. Raster order, so the upper neighbour of cell (r, c) is w tokens back. A first-row token
    keeps its left neighbour (the token before the image for the first one); a first-column token of a later row
    compares with the token above it only. [T, 2] long."""
    parts = []
    for h, w in grids:
        cell = torch.arange(h * w)
        r, c = cell // w, cell % w
        left = torch.where((c > 0) | (r == 0), 1, 0)
        up = torch.where(r > 0, w, 0)
        parts.append(torch.stack([left, up], dim=-1))
    return torch.cat(parts) if parts else torch.zeros(0, 2, dtype=torch.long)
