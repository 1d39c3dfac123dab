"""Attention pooling: one learned query reads an image's valid patches into a single summary vector.

SigLIP's multihead attention pooling ("MAP") head (Zhai et al. 2023, arXiv 2303.15343): the query attends over
the patches, then a pre-norm residual MLP. ``vision_tower.pretrain`` trains it with the tower (a linear layer on
its output gives the caption words' logits or the contrastive embedding), and :class:`~vision_tower.VisionTower`
keeps it (``summary=True``) so the VLM can hand every image token the image's summary as well as its own patch
(``ConceptMoEVLMConfig.vision_summary``, ``docs/seeing.md``).
"""

# Shape suffixes: B images, L patches per image, D feature width.

from __future__ import annotations

import torch
from torch import nn


def pool_heads(dim: int) -> int:
    """The largest head count of at most 8 that divides ``dim``."""
    return max(h for h in range(1, 9) if dim % h == 0)


class AttentionPool(nn.Module):
    """[B, L, D] patch features (+ [B, L] valid) -> [B, D]: ``pooled + MLP(LayerNorm(pooled))``, where ``pooled`` is
    one learned query's multihead attention over the valid patches. An image with no valid patch attends over its
    (zero) padding features instead, so its summary is finite, never NaN."""

    def __init__(self, dim: int, heads: int | None = None):
        super().__init__()
        self.query_1D = nn.Parameter(torch.randn(1, dim) * dim**-0.5)
        self.attn = nn.MultiheadAttention(dim, heads or pool_heads(dim), batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, features_BLD: torch.Tensor, valid_BL: torch.Tensor) -> torch.Tensor:
        valid_BL = valid_BL.bool()
        ignore_BL = ~valid_BL & valid_BL.any(1, keepdim=True)  # an empty image attends to its zero features
        query_B1D = self.query_1D.to(features_BLD.dtype).expand(len(features_BLD), 1, -1)
        pooled_B1D, _ = self.attn(query_B1D, features_BLD, features_BLD, key_padding_mask=ignore_BL, need_weights=False)
        pooled_BD = pooled_B1D[:, 0]
        return pooled_BD + self.mlp(self.norm(pooled_BD))
