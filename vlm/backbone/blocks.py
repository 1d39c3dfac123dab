"""Transformer blocks and stacks: the encoder E, the concept model C and the decoder D of Eq. (1) are each a
``Stack`` of pre-norm ``Block``s (attention, then an MoE or dense FFN)."""

# Shape suffixes (docs/paper.md §0): B batch rows, N positions per row (tokens, or concepts in the concept model),
# D model width, T the real positions of the batch flattened (what the MoE routes), 1 a singleton axis.

from __future__ import annotations

import torch
from torch import nn

from vlm.backbone.config import ConceptMoEConfig
from vlm.backbone.layers import Attention, RMSNorm, SeqLayout, SwiGLU, rope_cos_sin
from vlm.backbone.moe import MoE, RouterStats


class Block(nn.Module):
    """Pre-norm transformer block: x + Attn(norm(x) [, concept]); x + FFN(norm(x)), FFN = MoE or SwiGLU."""

    def __init__(
        self,
        config: ConceptMoEConfig,
        d_model: int,
        head_dim: int,
        num_experts: int,
        top_k: int,
        expert_dim: int,
        joint: bool = False,
    ):
        super().__init__()
        eps = config.rms_norm_eps
        self.attn_norm = RMSNorm(d_model, eps)
        self.attn = Attention(
            d_model,
            config.n_heads,
            config.n_kv_heads,
            head_dim,
            config.attention_bias,
            config.qk_norm,
            eps,
            joint=joint,
        )
        self.ffn_norm = RMSNorm(d_model, eps)
        if config.ffn == "moe":
            self.ffn = MoE(
                d_model,
                num_experts,
                top_k,
                expert_dim,
                config.shared_experts,
                config.norm_topk_prob,
                shared_dim=config.shared_expert_dim,
                shared_gate=config.shared_expert_gate,
            )
        else:
            self.ffn = SwiGLU(d_model, config.dense_ffn_dim)

    def forward(
        self, x_BND, cos, sin, layout: SeqLayout, concept_BND=None, kv=None
    ) -> tuple[torch.Tensor, RouterStats | None]:
        x_BND = x_BND + self.attn(self.attn_norm(x_BND), cos, sin, layout, concept_BND, kv)
        y_BND = self.ffn_norm(x_BND)
        if not isinstance(self.ffn, MoE):
            return x_BND + self.ffn(y_BND), None
        if layout.all_valid:  # no padding anywhere: every position is a real token
            out_TD, stats = self.ffn(y_BND.reshape(-1, y_BND.shape[-1]))
            return x_BND + out_TD.view_as(x_BND), stats
        out_TD, stats = self.ffn(y_BND[layout.valid_BN])  # padding never reaches the experts or the stats
        return x_BND.index_put((layout.valid_BN,), x_BND[layout.valid_BN] + out_TD), stats


class Stack(nn.Module):
    """Blocks run in ``schedule`` order (a looped concept model repeats indices; weights are shared)."""

    def __init__(self, blocks: list[Block], head_dim: int, theta: float, schedule: list[int] | None = None):
        super().__init__()
        self.layers = nn.ModuleList(blocks)
        self.head_dim, self.theta = head_dim, theta
        self.schedule = list(range(len(blocks))) if schedule is None else schedule

    def forward(self, x_BND, layout: SeqLayout, concept_BND=None, kv=None) -> tuple[torch.Tensor, list[RouterStats]]:
        """``kv``: one cache per entry of the schedule (a looped layer caches each of its applications)."""
        cos, sin = rope_cos_sin(layout.pos_BN, self.head_dim, self.theta, x_BND.dtype)
        router_stats = []
        for j, i in enumerate(self.schedule):
            x_BND, stats = self.layers[i](x_BND, cos, sin, layout, concept_BND, None if kv is None else kv[j])
            if stats is not None:
                router_stats.append(stats)
        return x_BND, router_stats
