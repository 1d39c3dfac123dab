"""Dechunk: EMA over concepts (ConceptMoE Eq. 7-8), plug-back to tokens with the STE confidence (Eq. 9-10);
docs/paper.md §6-§7."""

# Shape suffixes (docs/paper.md §0): B batch rows, N tokens per row, M concepts per row, D model width;
# the blocked EMA scan splits M into J blocks of m concepts each.

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Dechunked:
    z_BND: torch.Tensor  # ĥ_n + STE(c_n) · ĉ^ema_{ψ(n)}: the decoder's input
    concept_BND: torch.Tensor  # ĉ^ema_{ψ(n)} without the STE factor: the joint-decoding input (Eq. 11)
    plug_idx_BN: torch.Tensor  # long: ψ(n) = (number of boundaries <= n) − 1, clamped at 0


class _StraightThroughOne(torch.autograd.Function):
    """Forward: exactly 1. Backward: identity. So STE(c)·x equals x but the router still gets ∂/∂c."""

    @staticmethod
    def forward(ctx, x):
        return torch.ones_like(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def ste(x: torch.Tensor) -> torch.Tensor:
    return _StraightThroughOne.apply(x)


def ema_over_concepts(c_BMD: torch.Tensor, p_BM: torch.Tensor, block: int = 64) -> torch.Tensor:
    """Eq. 7-8: ĉ^ema_m = p_m · ĉ_m + (1 − p_m) · ĉ^ema_{m−1}, computed without a loop over positions.

    Closed form ema_m = Σ_{j<=m} p_j ĉ_j Π_{j<i<=m} (1 − p_i). The sequence is cut into blocks of
    ``block`` concepts: inside a block the lower-triangular decay matrix comes from differences of a
    float64 cumulative log(1 − p) (only non-positive exponents), and one short pass over blocks carries
    the state. p = 1 (every document start) is an exact reset: products across it are zero, never
    exp(-inf) arithmetic, so packed documents cannot leak into each other (docs/paper.md §12.9).
    """
    b, m, d = c_BMD.shape
    nb = -(-m // block)
    pad = nb * block - m
    p_BJm = torch.nn.functional.pad(p_BM.float(), (0, pad), value=1.0).view(b, nb, block)
    x_BJmD = p_BJm[..., None] * torch.nn.functional.pad(c_BMD.float(), (0, 0, 0, pad)).view(b, nb, block, d)

    decay = 1.0 - p_BJm
    reset = decay <= 0
    log_decay = torch.where(reset, torch.zeros_like(decay), torch.log(decay.clamp_min(1e-30))).double()
    cum = torch.cumsum(log_decay, dim=-1)  # log Π_{k<=i} (1 − p_k) within the block
    seg = torch.cumsum(reset.long(), dim=-1)  # resets seen so far within the block
    tri = torch.ones(block, block, dtype=torch.bool, device=c_BMD.device).tril()
    same_seg = seg[..., :, None] == seg[..., None, :]
    exponent = torch.where(tri & same_seg, cum[..., :, None] - cum[..., None, :], float("-inf"))
    intra_BJmD = torch.exp(exponent).float() @ x_BJmD
    carry_BJm = torch.where(seg == 0, torch.exp(cum), torch.zeros_like(cum)).float()

    state_BD = torch.zeros(b, d, dtype=torch.float32, device=c_BMD.device)
    outs = []
    for i in range(nb):
        out_BmD = intra_BJmD[:, i] + carry_BJm[:, i, :, None] * state_BD[:, None, :]
        state_BD = out_BmD[:, -1]
        outs.append(out_BmD)
    return torch.cat(outs, dim=1)[:, :m].to(c_BMD.dtype)


def plug_back(h_BND: torch.Tensor, ema_BMD: torch.Tensor, p_BN: torch.Tensor, b_BN: torch.Tensor) -> Dechunked:
    """Eq. 9-10: z_n = ĥ_n + STE(c_n) · ĉ^ema_{ψ(n)},  c_n = p_n if b_n else 1 − p_n.

    Concept m is broadcast to positions [φ(m), φ(m+1)); the STE factor is 1 in the forward pass and
    passes the gradient to the raw p (the confidence of the boundary decision actually taken).
    """
    plug_idx_BN = (torch.cumsum(b_BN.long(), dim=1) - 1).clamp_min(0)
    concept_BND = torch.gather(ema_BMD, 1, plug_idx_BN[..., None].expand(-1, -1, ema_BMD.shape[-1]))
    confidence_BN = torch.where(b_BN, p_BN, 1.0 - p_BN)
    z_BND = h_BND + concept_BND * ste(confidence_BN)[..., None].to(h_BND.dtype)
    return Dechunked(z_BND=z_BND, concept_BND=concept_BND, plug_idx_BN=plug_idx_BN)
