"""Where a patch sits in its image, and which boxes hold it: one definition for region labels and object probes."""

# Shape suffixes: L patches of one image, R boxes, 2 a (y, x) pair, 4 a box (x0, y0, x1, y1).

from __future__ import annotations

import torch


def patch_centres(coord_L2: torch.Tensor, grid_hw) -> torch.Tensor:
    """[L, 2] (y, x) centre of each patch as a fraction of its image's side, from its (y, x) cell on the
    ``grid_hw`` (rows, columns) grid the image processor cut: cell 0 of a 4-wide grid is centred at 0.125."""
    grid_2 = torch.as_tensor(grid_hw, dtype=torch.float32, device=coord_L2.device).view(2)
    return (coord_L2.float() + 0.5) / grid_2


def patches_in_boxes(coord_L2: torch.Tensor, grid_hw, box_R4: torch.Tensor) -> torch.Tensor:
    """[L, R] bool: the centre of patch ``l`` (:func:`patch_centres`) lies inside box ``r``, given as normalised
    (x0, y0, x1, y1), edges included."""
    cy_L1, cx_L1 = patch_centres(coord_L2, grid_hw)[:, None].unbind(-1)
    box_R4 = box_R4.to(cy_L1)
    return (cx_L1 >= box_R4[:, 0]) & (cx_L1 <= box_R4[:, 2]) & (cy_L1 >= box_R4[:, 1]) & (cy_L1 <= box_R4[:, 3])
