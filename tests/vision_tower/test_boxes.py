"""patch_centres / patches_in_boxes: the geometry region labels and object probes share."""

import torch

from vision_tower.boxes import patch_centres, patches_in_boxes


def test_patch_centres_are_cell_middles_as_fractions_of_each_side():
    coord_L2 = torch.tensor([[0, 0], [1, 3], [2, 1]])
    torch.testing.assert_close(
        patch_centres(coord_L2, (3, 4)), torch.tensor([[1 / 6, 1 / 8], [0.5, 7 / 8], [5 / 6, 3 / 8]])
    )


def test_a_patch_is_in_a_box_when_its_centre_is_edges_included():
    coord_L2 = torch.tensor([[y, x] for y in range(2) for x in range(4)])  # a 2 x 4 grid, centres x 1/8, 3/8, ...
    box_R4 = torch.tensor([[0.0, 0.0, 0.375, 0.5], [0.5, 0.5, 1.0, 1.0], [0.4, 0.0, 0.6, 1.0]])  # (x0, y0, x1, y1)
    inside_LR = patches_in_boxes(coord_L2, torch.tensor([2, 4]), box_R4)
    assert inside_LR[:, 0].nonzero().flatten().tolist() == [0, 1]  # top row, x centres 1/8 and 3/8 (edge)
    assert inside_LR[:, 1].nonzero().flatten().tolist() == [6, 7]  # bottom row, right half
    assert not inside_LR[:, 2].any()  # a strip between the centres holds none
