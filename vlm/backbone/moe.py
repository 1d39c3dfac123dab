"""Mixture-of-Experts FFN: fine-grained SwiGLU experts, optional shared experts, top-k softmax router.

Dropless: every token reaches its k experts. Dispatch sorts the (token, expert) pairs by expert so each
expert runs one matmul on a contiguous slice (a loop over experts, never over tokens), then the
weighted outputs are added back per token with ``index_add_``.

The paper states only the number of activated experts (8 in every baseline); the router, shared experts and
auxiliary losses here are the project's choices (docs/paper.md §12.11).
"""

# Shape suffixes (docs/paper.md §0): T tokens of the batch flattened (padding dropped), D model width, E experts,
# A activated experts per token (top-k), F expert hidden width, S (token, expert) slots (T·A of them),
# s the slots of one expert.

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vlm.backbone.expert_parallel import expert_parallel_ffn
from vlm.backbone.layers import SwiGLU

logger = logging.getLogger(__name__)


@dataclass
class RouterStats:
    balance_loss: torch.Tensor  # scalar: E * sum_e f_e * P_e (1.0 when perfectly balanced)
    z_loss: torch.Tensor  # scalar: mean_t logsumexp(logits_t)^2
    tokens_per_expert_E: torch.Tensor  # long [E]: routed (token, expert) pairs per expert


def load_balancing_loss(probs_TE: torch.Tensor, expert_idx_TA: torch.Tensor) -> torch.Tensor:
    """Switch / DeepSeek auxiliary loss  L = E * sum_e f_e * P_e.

    f_e = fraction of the T*k routed slots that went to expert e (not differentiable),
    P_e = mean router probability of expert e (carries the gradient). Minimum 1 at uniform routing.
    """
    t, e = probs_TE.shape
    if t == 0:
        return probs_TE.sum()
    counts_E = torch.bincount(expert_idx_TA.reshape(-1), minlength=e).to(probs_TE.dtype)
    f_E = counts_E / expert_idx_TA.numel()
    p_E = probs_TE.mean(dim=0)
    return e * (f_E * p_E).sum()


def router_z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2 (keeps router logits small)."""
    if logits_TE.shape[0] == 0:
        return logits_TE.sum()
    return torch.logsumexp(logits_TE, dim=-1).pow(2).mean()


@functools.cache
def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``F.grouped_mm`` runs forward and backward here (CPU: yes; CUDA: bf16 on SM >= 80)."""
    if not hasattr(F, "grouped_mm"):
        return False
    try:
        x = torch.ones(4, 8, device=device, dtype=dtype, requires_grad=True)
        w = torch.ones(2, 8, 8, device=device, dtype=dtype, requires_grad=True)
        offs = torch.tensor([1, 4], device=device, dtype=torch.int32)
        F.grouped_mm(x, w, offs=offs).square().sum().backward()
        return True
    except (RuntimeError, NotImplementedError) as err:
        logger.info("grouped_mm unavailable on %s/%s (%s): MoE uses a loop over experts", device, dtype, err)
        return False


class MoE(nn.Module):
    """Routed experts stored stacked: ``w_gate_up`` [E, D, 2F] (gate | up halves), ``w_down`` [E, F, D]; under
    expert parallelism only this rank's ``E / N`` of them (``vlm.backbone.expert_parallel``)."""

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        top_k: int,
        expert_dim: int,
        shared_experts: int = 0,
        norm_topk_prob: bool = True,
        shared_dim: int | None = None,
        shared_gate: bool = False,
    ):
        """``shared_dim`` overrides the shared SwiGLU's width (default ``shared_experts * expert_dim``);
        ``shared_gate`` scales its output by sigmoid(w_g . x), a per-token gate (Qwen2-MoE's shared expert)."""
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, d_model, 2 * expert_dim))
        self.w_down = nn.Parameter(torch.empty(num_experts, expert_dim, d_model))
        self.shared = SwiGLU(d_model, shared_dim or shared_experts * expert_dim) if shared_experts > 0 else None
        self.shared_gate = nn.Linear(d_model, 1, bias=False) if shared_gate and self.shared is not None else None
        # "auto": grouped_mm on accelerators that have it; on CPU the loop over experts measured faster
        # (scripts/bench_model.py: 0.80x vs 0.71x of a dense FFN at d=256). "grouped" / "loop" force one.
        self.dispatch = "auto"
        # Expert parallelism (vlm.backbone.expert_parallel.shard_experts): None keeps every expert on this rank
        self.expert_shard = None

    def route(self, x_TD: torch.Tensor):
        """Softmax over all experts, keep the top-k (renormalised if ``norm_topk_prob``)."""
        logits_TE = self.router(x_TD).float()
        probs_TE = logits_TE.softmax(dim=-1)
        weight_TA, expert_idx_TA = probs_TE.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weight_TA = weight_TA / weight_TA.sum(dim=-1, keepdim=True)
        return logits_TE, probs_TE, weight_TA, expert_idx_TA

    def expert_ffn(self, x_SD: torch.Tensor, weight_S: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """weight_s · SwiGLU_e(x_s) for rows sorted by expert (``counts_E`` rows per expert).

        One grouped matmul per weight (see ``dispatch``), else a loop over experts (never over tokens).
        The routing weight scales the F-wide hidden state rather than the D-wide output (same result,
        less memory traffic). The loop unbinds the stacked weights once:
        indexing w[e] per expert would make autograd materialise E full-size weight gradients.
        """
        weight_S1 = weight_S[:, None].to(x_SD.dtype)
        grouped = self.dispatch == "grouped" or (self.dispatch == "auto" and x_SD.device.type != "cpu")
        if grouped and grouped_mm_supported(x_SD.device, x_SD.dtype):
            offs = torch.cumsum(counts_E, 0).to(torch.int32)
            gate, up = F.grouped_mm(x_SD, self.w_gate_up, offs=offs).chunk(2, dim=-1)
            return F.grouped_mm(F.silu(gate) * (up * weight_S1), self.w_down, offs=offs)
        outs = []
        w_gate_up, w_down = self.w_gate_up.unbind(0), self.w_down.unbind(0)
        counts = counts_E.tolist()
        for e, (x_sD, w_s1) in enumerate(zip(torch.split(x_SD, counts), torch.split(weight_S1, counts))):
            if x_sD.shape[0] > 0:
                gate, up = (x_sD @ w_gate_up[e]).chunk(2, dim=-1)
                outs.append((F.silu(gate) * (up * w_s1)) @ w_down[e])
        if not outs:  # no slot here (a rank whose experts got no token): a zero gradient still reaches them
            return x_SD.new_zeros((0, self.w_down.shape[-1])) + self.zero_expert_term()
        return torch.cat(outs)

    def zero_expert_term(self) -> torch.Tensor:
        """A scalar 0 that depends on every routed-expert weight: added to an output that used none of them, it gives
        each expert a zero gradient instead of none, as DDP / ZeRO expect."""
        return 0.0 * (self.w_gate_up.sum() + self.w_down.sum())

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        logits_TE, probs_TE, weight_TA, expert_idx_TA = self.route(x_TD)
        t, k = expert_idx_TA.shape
        flat_expert_S = expert_idx_TA.reshape(-1)
        counts_E = torch.bincount(flat_expert_S, minlength=self.num_experts)
        y_TD = self.shared(x_TD) if self.shared is not None else torch.zeros_like(x_TD)
        if self.shared_gate is not None:
            y_TD = torch.sigmoid(self.shared_gate(x_TD)) * y_TD
        if t > 0 or self.expert_shard is not None:  # dropless: sort (token, expert) pairs by expert, add back
            order_S = torch.argsort(flat_expert_S, stable=True)
            token_S = order_S // k
            x_SD, weight_S = x_TD.index_select(0, token_S), weight_TA.reshape(-1)[order_S]
            if self.expert_shard is None:
                y_SD = self.expert_ffn(x_SD, weight_S, counts_E)
            else:  # every rank joins the exchanges, even with no token of its own
                y_SD = expert_parallel_ffn(self, x_SD, weight_S, counts_E)
            y_TD = y_TD.index_add(0, token_S, y_SD.to(y_TD.dtype))
        else:  # a fully padded batch
            y_TD = y_TD + self.zero_expert_term().to(x_TD.dtype)
        stats = RouterStats(
            balance_loss=load_balancing_loss(probs_TE, expert_idx_TA),
            z_loss=router_z_loss(logits_TE),
            tokens_per_expert_E=counts_E,
        )
        return y_TD, stats
