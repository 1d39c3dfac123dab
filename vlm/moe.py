"""Mixture-of-Experts FFN: fine-grained SwiGLU experts, optional shared experts, top-k softmax router.

Dropless: every token reaches its k experts. Dispatch sorts the (token, expert) pairs by expert so each
expert runs one matmul on a contiguous slice (a loop over experts, never over tokens), then the
weighted outputs are added back per token with ``index_add_``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vlm.layers import SwiGLU


@dataclass
class RouterStats:
    balance_loss: torch.Tensor  # scalar: E * sum_e f_e * P_e (1.0 when perfectly balanced)
    z_loss: torch.Tensor  # scalar: mean_t logsumexp(logits_t)^2
    tokens_per_expert_E: torch.Tensor  # long [E]: routed (token, expert) pairs per expert


def load_balancing_loss(probs_TE: torch.Tensor, expert_idx_TK: torch.Tensor) -> torch.Tensor:
    """Switch / DeepSeek auxiliary loss  L = E * sum_e f_e * P_e.

    f_e = fraction of the T*k routed slots that went to expert e (not differentiable),
    P_e = mean router probability of expert e (carries the gradient). Minimum 1 at uniform routing.
    """
    t, e = probs_TE.shape
    if t == 0:
        return probs_TE.sum()
    counts_E = torch.bincount(expert_idx_TK.reshape(-1), minlength=e).to(probs_TE.dtype)
    f_E = counts_E / expert_idx_TK.numel()
    p_E = probs_TE.mean(dim=0)
    return e * (f_E * p_E).sum()


def router_z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2 (keeps router logits small)."""
    if logits_TE.shape[0] == 0:
        return logits_TE.sum()
    return torch.logsumexp(logits_TE, dim=-1).pow(2).mean()


class MoE(nn.Module):
    def __init__(
        self,
        d_model: int,
        num_experts: int,
        top_k: int,
        expert_dim: int,
        shared_experts: int = 0,
        norm_topk_prob: bool = True,
    ):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.w_gate = nn.Parameter(torch.empty(num_experts, d_model, expert_dim))
        self.w_up = nn.Parameter(torch.empty(num_experts, d_model, expert_dim))
        self.w_down = nn.Parameter(torch.empty(num_experts, expert_dim, d_model))
        self.shared = SwiGLU(d_model, shared_experts * expert_dim) if shared_experts > 0 else None

    def route(self, x_TD: torch.Tensor):
        """Softmax over all experts, keep the top-k (renormalised if ``norm_topk_prob``)."""
        logits_TE = self.router(x_TD).float()
        probs_TE = logits_TE.softmax(dim=-1)
        weight_TK, expert_idx_TK = probs_TE.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weight_TK = weight_TK / weight_TK.sum(dim=-1, keepdim=True)
        return logits_TE, probs_TE, weight_TK, expert_idx_TK

    def experts(self, x_TD: torch.Tensor, weight_TK: torch.Tensor, expert_idx_TK: torch.Tensor):
        """Grouped dispatch: sort (token, expert) pairs by expert, one SwiGLU matmul per expert slice."""
        t, k = expert_idx_TK.shape
        flat_expert_S = expert_idx_TK.reshape(-1)
        order_S = torch.argsort(flat_expert_S, stable=True)
        token_S = order_S // k
        counts = torch.bincount(flat_expert_S, minlength=self.num_experts)
        x_SD = x_TD[token_S]
        outs = []
        for e, x_ED in enumerate(torch.split(x_SD, counts.tolist())):
            if x_ED.shape[0] == 0:
                continue
            h_EF = F.silu(x_ED @ self.w_gate[e]) * (x_ED @ self.w_up[e])
            outs.append(h_EF @ self.w_down[e])
        y_SD = torch.cat(outs) * weight_TK.reshape(-1)[order_S, None].to(x_TD.dtype)
        return torch.zeros_like(x_TD).index_add_(0, token_S, y_SD), counts

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        logits_TE, probs_TE, weight_TK, expert_idx_TK = self.route(x_TD)
        if x_TD.shape[0] == 0:
            y_TD, counts = torch.zeros_like(x_TD), torch.zeros(self.num_experts, dtype=torch.long)
        else:
            y_TD, counts = self.experts(x_TD, weight_TK, expert_idx_TK)
        if self.shared is not None:
            y_TD = y_TD + self.shared(x_TD)
        stats = RouterStats(
            balance_loss=load_balancing_loss(probs_TE, expert_idx_TK),
            z_loss=router_z_loss(logits_TE),
            tokens_per_expert_E=counts,
        )
        return y_TD, stats
