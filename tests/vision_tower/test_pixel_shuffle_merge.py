"""pixel_shuffle_merge against a per-patch loop, for shuffled slots, both merge factors, and gradients."""

import pytest
import torch

from vision_tower import pixel_shuffle_merge

GRIDS = [(4, 6), (2, 2), (8, 2)]


def batch(grids, dim=5, seed=0):
    """Features with every image's patches in a random slot order, padded to the longest image."""
    g = torch.Generator().manual_seed(seed)
    length = max(h * w for h, w in grids) + 3
    feats = torch.randn(len(grids), length, dim, generator=g)
    coord = torch.zeros(len(grids), length, 2, dtype=torch.long)
    valid = torch.zeros(len(grids), length, dtype=torch.bool)
    for i, (h, w) in enumerate(grids):
        slots = torch.randperm(length, generator=g)[: h * w]
        ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        coord[i, slots] = torch.stack([ys.flatten(), xs.flatten()], -1)
        valid[i, slots] = True
    return feats, coord, valid, torch.tensor(grids)


def naive(feats, coord, valid, grids, m):
    rows = []
    for i, (h, w) in enumerate(grids):
        at = {tuple(coord[i, s].tolist()): feats[i, s] for s in range(feats.shape[1]) if valid[i, s]}
        for by in range(h // m):
            for bx in range(w // m):
                rows.append(torch.cat([at[(by * m + dy, bx * m + dx)] for dy in range(m) for dx in range(m)]))
    return torch.stack(rows)


@pytest.mark.parametrize("merge", [1, 2, 4])
def test_matches_naive_loop(merge):
    grids = GRIDS if merge < 4 else [(4, 8), (4, 4), (8, 4)]  # grids are multiples of the merge
    feats, coord, valid, grid_hw = batch(grids)
    out = pixel_shuffle_merge(feats, coord, valid, grid_hw, merge)
    assert out.shape == (sum(h * w for h, w in grids) // merge**2, 5 * merge**2)
    torch.testing.assert_close(out, naive(feats, coord, valid, grids, merge), atol=0, rtol=0)


def test_merge_one_is_row_major_valid_features():
    feats, coord, valid, grid_hw = batch([(2, 3)], dim=1)
    out = pixel_shuffle_merge(feats, coord, valid, grid_hw, 1)
    order = (coord[0, :, 0] * 3 + coord[0, :, 1])[valid[0]].argsort()
    torch.testing.assert_close(out[:, 0], feats[0, valid[0], 0][order], atol=0, rtol=0)


def test_gradient_reaches_valid_patches_only():
    feats, coord, valid, grid_hw = batch(GRIDS)
    feats.requires_grad_(True)
    weights = torch.randn(sum(h * w for h, w in GRIDS) // 4, 20)
    (pixel_shuffle_merge(feats, coord, valid, grid_hw, 2) * weights).sum().backward()
    assert not feats.grad[~valid].any()
    assert torch.equal(feats.grad[valid].ne(0).all(-1), torch.ones(int(valid.sum()), dtype=torch.bool))


def test_empty_and_inconsistent_inputs():
    out = pixel_shuffle_merge(
        torch.zeros(0, 0, 5),
        torch.zeros(0, 0, 2, dtype=torch.long),
        torch.zeros(0, 0, dtype=torch.bool),
        torch.zeros(0, 2, dtype=torch.long),
        2,
    )
    assert out.shape == (0, 20)
    feats, coord, valid, grid_hw = batch([(3, 4)])
    with pytest.raises(ValueError, match="multiples of merge=2"):
        pixel_shuffle_merge(feats, coord, valid, grid_hw, 2)
    feats, coord, valid, _ = batch([(2, 4)])
    with pytest.raises(ValueError, match="valid"):
        pixel_shuffle_merge(feats, coord, valid, torch.tensor([[2, 2]]), 2)
