"""Pixel-shuffle merge: each merge x merge block of patch features becomes one token (4x fewer image tokens at 2)."""

# Shape suffixes (docs/paper.md §0): B images of the patch batch, L patches per image, D feature width,
# V the valid patches of the batch flattened, T merged image tokens of the batch, l the patches of one merge block,
# 2 a (y, x) pair.

from __future__ import annotations

import torch


def pixel_shuffle_merge(
    features_BLD: torch.Tensor,
    coord_BL2: torch.Tensor,
    valid_BL: torch.Tensor,
    grid_hw: torch.Tensor,
    merge: int,
) -> torch.Tensor:
    """Valid patch features of every image -> [sum_i gh_i * gw_i / merge**2, D * merge**2].

    Images in batch order, each in row-major order of its merged grid; a merged token concatenates the features
    of its block in (dy, dx) row-major order (the space-to-depth of nanoVLM / InternVL / Idefics3, placed by
    coordinate rather than by slot). merge=1 returns the valid features in row-major grid order.
    One scatter for the whole batch, so it is differentiable and costs no Python loop.
    """
    if not isinstance(merge, int) or merge < 1:
        raise ValueError(f"pixel_shuffle_merge: merge must be a positive int, got {merge!r}")
    n, _, dim = features_BLD.shape
    m = merge
    grid_hw = grid_hw.to(features_BLD.device).long().view(n, 2)
    gh_B, gw_B = grid_hw.unbind(-1)
    tokens_B = (gh_B // m) * (gw_B // m)
    offset_B = torch.cumsum(tokens_B, 0) - tokens_B
    b_V, l_V = valid_BL.bool().nonzero(as_tuple=True)
    y_V, x_V = coord_BL2[b_V, l_V].long().unbind(-1)
    ok = (
        bool(((gh_B % m == 0) & (gw_B % m == 0)).all())
        and bool((valid_BL.sum(1) == gh_B * gw_B).all())
        and bool(((y_V < gh_B[b_V]) & (x_V < gw_B[b_V]) & (y_V >= 0) & (x_V >= 0)).all())
    )
    if not ok:
        raise ValueError(
            f"pixel_shuffle_merge: grid_hw must be multiples of merge={m}, and each image must have gh * gw valid "
            "patches with coordinates inside its grid (as ImageProcessor makes them)"
        )
    token_V = offset_B[b_V] + (y_V // m) * (gw_B[b_V] // m) + x_V // m
    sub_V = (y_V % m) * m + x_V % m
    total = int(tokens_B.sum())
    merged_TlD = features_BLD.new_zeros(total, m * m, dim).index_put((token_V, sub_V), features_BLD[b_V, l_V])
    return merged_TlD.reshape(total, m * m * dim)
