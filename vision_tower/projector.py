"""Vision width -> backbone width."""

# Shape suffixes (docs/paper.md §0): T image tokens of the batch flattened, D feature width.

from __future__ import annotations

import torch
from torch import nn


class Projector(nn.Module):
    """Linear -> GELU -> Linear, the two-layer MLP connector of LLaVA-1.5 and nanoVLM.

    After a 2x2 pixel-shuffle merge ``in_dim`` is four times the tower's width; ``hidden_dim`` defaults to
    ``out_dim`` (the backbone width), so the first layer does the width change and the second mixes in LM space.
    """

    def __init__(self, in_dim: int, out_dim: int, hidden_dim: int | None = None):
        super().__init__()
        hidden_dim = out_dim if hidden_dim is None else hidden_dim
        for name, value in (("in_dim", in_dim), ("out_dim", out_dim), ("hidden_dim", hidden_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Projector: {name} must be a positive int, got {value!r}")
        self.in_dim, self.out_dim, self.hidden_dim = in_dim, out_dim, hidden_dim
        self.fc1 = nn.Linear(in_dim, hidden_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, out_dim)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x_TD)))
