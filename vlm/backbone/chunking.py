"""The chunk module (ConceptMoE §3.2, Eq. 2-6; docs/paper.md §2-§5): boundary probabilities, boundary noise,
ratio loss, merging into concepts.

Causality: p_n depends on ĥ_{n-1} and ĥ_n only; concept m merges the window (φ(m-1), φ(m)] that ends
at its boundary token, so it depends on tokens <= φ(m). The first real token of every document is a
forced boundary (p = 1), as is every position the caller forces (``SeqLayout.forced_BN``), and a sum
window never crosses a document start (project conventions, docs/paper.md §12.1-§12.2).
"""

# Shape suffixes (docs/paper.md §0): B batch rows, N tokens per row, M concepts per row, D model width.

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vlm.backbone.doc_attention import plan_doc_attention
from vlm.backbone.layers import SeqLayout, positions_in_document


@dataclass
class ChunkOutput:
    p_BN: torch.Tensor  # float: raw boundary probability (1 at document starts, 0 on padding)
    b_BN: torch.Tensor  # bool: boundaries actually used (sampled with noise in training)
    b_hard_BN: torch.Tensor  # bool: p >= 0.5 (what eval uses), for the flip rate


@dataclass
class Concepts:
    c_BMD: torch.Tensor  # merged concepts, padded to the longest row's M
    boundary_BM: torch.Tensor  # long: token index φ(m) of each concept's boundary (0 on padding slots)
    p_BM: torch.Tensor  # float: p at each boundary (1 on padding slots), the EMA weights
    layout: SeqLayout  # concept-level documents / positions / mask


# ----------------------------------------------------------------------------- Eq. 2-6
def cosine_pair_probs(q_BND: torch.Tensor, k_BND: torch.Tensor) -> torch.Tensor:
    """Eq. 2 on aligned pairs: ½(1 − cos(q_i, k_i)), k_i the projection of the token q_i is compared with. [B, N]"""
    cos_BN = (F.normalize(q_BND.float(), dim=-1) * F.normalize(k_BND.float(), dim=-1)).sum(-1)
    return ((1.0 - cos_BN) / 2.0).clamp(0.0, 1.0)


def cosine_boundary_probs(q_BND: torch.Tensor, k_BND: torch.Tensor) -> torch.Tensor:
    """Eq. 2: p_n = ½(1 − cos(q_n, k_{n−1})), n >= 2. Returns [B, N-1] for positions 1..N-1."""
    return cosine_pair_probs(q_BND[:, 1:], k_BND[:, :-1])


def sharpen_boundary_probs(p: torch.Tensor, tau: float) -> torch.Tensor:
    """Eq. 5: p^{1/τ} if p >= 0.5, else 1 − (1 − p)^{1/τ}: the sampled b (Eq. 6) disagrees with the threshold
    decision p >= 0.5 with probability 1 − max(p, 1 − p)^{1/τ} (0.109 at p = 0.5, 0.017 at 0.1 / 0.9 for τ = 6)."""
    inv_tau = 1.0 / tau
    return torch.where(p >= 0.5, p.clamp_min(0).pow(inv_tau), 1.0 - (1.0 - p).clamp_min(0).pow(inv_tau))


def sample_boundaries(p: torch.Tensor, tau: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Eq. 6: b ~ Bernoulli(sharpen(p)) — the training-time "random flip boundary" noise."""
    return torch.bernoulli(sharpen_boundary_probs(p.detach(), tau), generator=generator).bool()


def ratio_loss(p_BN: torch.Tensor, b_BN: torch.Tensor, valid_BN: torch.Tensor, target_r: float) -> torch.Tensor:
    """Eq. 3-4: L = R/(R−1) · ((R−1)·F·G + (1−F)·(1−G)),  G = mean p,  F = mean b.

    Statistics over all real tokens of the local batch (not per sample), so hard samples may keep
    more concepts than easy ones. F is not differentiable; the gradient flows through G.
    """
    n = valid_BN.sum().clamp_min(1)
    g = (p_BN * valid_BN).sum() / n
    f = (b_BN & valid_BN).sum().to(p_BN.dtype) / n
    r = target_r
    return r / (r - 1.0) * ((r - 1.0) * f * g + (1.0 - f) * (1.0 - g))


def fixed_boundary_at(pos: torch.Tensor, target_r: float) -> torch.Tensor:
    """Fixed chunking (Fig. 8 ablation): position ``pos`` of a document closes a concept when floor(pos / R) changes
    there (every R tokens, also for fractional R). The one definition, for the full forward and decoding."""
    pos = pos.double()
    return torch.floor(pos / target_r) != torch.floor((pos - 1.0) / target_r)


def fixed_boundaries(layout: SeqLayout, target_r: float) -> torch.Tensor:
    """Fixed boundaries of whole rows: :func:`fixed_boundary_at` plus forced boundaries, on real tokens only."""
    return (fixed_boundary_at(layout.pos_BN, target_r) | layout.forced_BN) & layout.valid_BN


class ChunkModule(nn.Module):
    """Boundary router: ``cosine`` (Eq. 2, learned q/k projections) or ``linear`` (Fig. 9 ablation).

    The paper does not give the linear router's form; ours (docs/paper.md §12.5) scores
    p_n = σ(w·[ĥ_{n−1}; ĥ_n] + β): a learned function of the same two states the cosine router compares,
    without the cosine's scale invariance.
    """

    def __init__(self, d_model: int, kind: str):
        super().__init__()
        self.kind = kind
        if kind == "cosine":
            self.q_proj = nn.Linear(d_model, d_model, bias=False)
            self.k_proj = nn.Linear(d_model, d_model, bias=False)
            self.q_proj.init_role = self.k_proj.init_role = "boundary_qk"
        else:
            self.proj = nn.Linear(2 * d_model, 1)

    def boundary_probs(self, h_BND: torch.Tensor, layout: SeqLayout) -> torch.Tensor:
        if layout.neighbour_BN2 is not None:
            p_BN = self.neighbour_probs(h_BND, layout.neighbour_BN2)
        elif self.kind == "cosine":
            p_BN = F.pad(cosine_boundary_probs(self.q_proj(h_BND), self.k_proj(h_BND)), (1, 0), value=1.0)
        else:
            p_BN = F.pad(self.linear_pair_probs(h_BND[:, :-1], h_BND[:, 1:]), (1, 0), value=1.0)
        p_BN = torch.where(layout.forced_BN, torch.ones_like(p_BN), p_BN)
        return p_BN * layout.valid_BN

    def neighbour_probs(self, h_BND: torch.Tensor, neighbour_BN2: torch.Tensor) -> torch.Tensor:
        """2-D image chunking (``vlm.image_scan``, ``router2d``): Eq. 2 (or the linear form) between token n and each
        earlier token ``neighbour_BN2[:, n]`` points back to (left, up; 0 = none), and p_n = the smaller of the two:
        a boundary only where token n differs from every neighbour whose region it could join. With offsets (1, 0)
        everywhere this is the 1-D router. A token with no neighbour gets p = 1 (only document starts have none)."""
        idx_N = torch.arange(h_BND.shape[1], device=h_BND.device)
        if self.kind == "cosine":  # each projection once, whatever the number of neighbours
            q_BND, k_BND = self.q_proj(h_BND), self.k_proj(h_BND)
        p_BN = torch.ones(h_BND.shape[:2], device=h_BND.device)
        for back_BN in neighbour_BN2.unbind(-1):
            src_BN3 = (idx_N[None] - back_BN).clamp_min(0)[..., None]
            if self.kind == "cosine":
                pair_BN = cosine_pair_probs(q_BND, torch.gather(k_BND, 1, src_BN3.expand_as(k_BND)))
            else:
                pair_BN = self.linear_pair_probs(torch.gather(h_BND, 1, src_BN3.expand_as(h_BND)), h_BND)
            p_BN = torch.where(back_BN > 0, torch.minimum(p_BN, pair_BN), p_BN)
        return p_BN

    def linear_pair_probs(self, prev_h: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The linear router on aligned pairs: σ(w·[ĥ_prev; ĥ] + β), one p per pair (any leading shape)."""
        return torch.sigmoid(self.proj(torch.cat([prev_h, h], dim=-1)).squeeze(-1).float())

    def step_probs(self, prev_h_BD: torch.Tensor, h_BD: torch.Tensor) -> torch.Tensor:
        """p of one new token per row from its state and the previous token's (decoding; Eq. 2 as above)."""
        if self.kind == "cosine":
            return cosine_pair_probs(self.q_proj(h_BD), self.k_proj(prev_h_BD))
        return self.linear_pair_probs(prev_h_BD, h_BD)

    def forward(self, h_BND: torch.Tensor, layout: SeqLayout, tau: float) -> ChunkOutput:
        p_BN = self.boundary_probs(h_BND, layout)
        b_hard_BN = (p_BN >= 0.5) & layout.valid_BN  # Eq. 2's threshold, the centre of Eq. 5's noise
        if self.training and tau > 0:
            b_BN = (sample_boundaries(p_BN, tau) | layout.forced_BN) & layout.valid_BN
        else:
            b_BN = b_hard_BN
        return ChunkOutput(p_BN=p_BN, b_BN=b_BN, b_hard_BN=b_hard_BN)


# ----------------------------------------------------------------------------- merging (§3.2-3.3, Fig. 1)
def boundary_positions(b_BN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token index of every boundary, left-aligned and padded: (boundary_BM, valid_BM)."""
    n_concepts_B = b_BN.sum(dim=1)
    m = max(int(n_concepts_B.max()), 1)
    order_BN = torch.argsort((~b_BN).to(torch.int8), dim=1, stable=True)
    boundary_BM = order_BN[:, :m]
    valid_BM = torch.arange(m, device=b_BN.device)[None] < n_concepts_B[:, None]
    return torch.where(valid_BM, boundary_BM, torch.zeros_like(boundary_BM)), valid_BM


def merge_tokens(
    h_BND: torch.Tensor,
    b_BN: torch.Tensor,
    boundary_BM: torch.Tensor,
    valid_BM: torch.Tensor,
    layout: SeqLayout,
    mode: str,
) -> torch.Tensor:
    """Concepts from token states: ``last`` keeps ĥ_{φ(m)}; ``sum`` adds ĥ over (φ(m−1), φ(m)].

    Sum windows are clipped at document starts and exclude padding (docs/paper.md §12.2-§12.3); a token after the
    last boundary of a row belongs to no concept yet. Summation is a scatter-add (exact per window,
    unlike differences of a running cumsum).
    """
    b, n, d = h_BND.shape
    idx_BMD = boundary_BM[..., None].expand(-1, -1, d)
    if mode == "last":
        return torch.gather(h_BND, 1, idx_BMD) * valid_BM[..., None]
    m = boundary_BM.shape[1]
    concept_BN = token_concepts(b_BN, boundary_BM, valid_BM, layout)
    keep_BN = concept_BN >= 0
    src_BND = h_BND * keep_BN[..., None].to(h_BND.dtype)
    return torch.zeros(b, m, d, dtype=h_BND.dtype, device=h_BND.device).scatter_add(
        1, concept_BN.clamp_min(0)[..., None].expand(-1, -1, d), src_BND
    )


def token_concepts(
    b_BN: torch.Tensor, boundary_BM: torch.Tensor, valid_BM: torch.Tensor, layout: SeqLayout
) -> torch.Tensor:
    """The concept whose ``sum`` window holds token n (the index m of φ(m) >= n), or -1: padding, a token after the
    row's last boundary, or a window clipped at a document start (its boundary lies in a later document). [B, N]"""
    m = boundary_BM.shape[1]
    target_BN = torch.cumsum(b_BN.long(), dim=1) - b_BN.long()  # the boundaries before token n
    has_target_BN = target_BN < valid_BM.sum(dim=1, keepdim=True)
    target_BN = target_BN.clamp(max=m - 1)
    target_doc_BN = torch.gather(torch.gather(layout.doc_BN, 1, boundary_BM), 1, target_BN)
    keep_BN = has_target_BN & layout.valid_BN & (target_doc_BN == layout.doc_BN)
    return torch.where(keep_BN, target_BN, torch.full_like(target_BN, -1))


def concept_layout(layout: SeqLayout, boundary_BM: torch.Tensor, valid_BM: torch.Tensor) -> SeqLayout:
    """Documents at concept level: a concept keeps its boundary token's document; positions restart."""
    doc_BM = torch.gather(layout.doc_BN, 1, boundary_BM)
    doc_BM = torch.where(valid_BM, doc_BM, torch.full_like(doc_BM, -2))
    start_BM = torch.gather(layout.start_BN, 1, boundary_BM) & valid_BM
    all_valid = bool(valid_BM.all())
    plain = layout.docs is None and all_valid  # one document per row, every concept slot used: causal fast path
    return SeqLayout(
        doc_BN=doc_BM,
        pos_BN=positions_in_document(doc_BM),
        valid_BN=valid_BM,
        start_BN=start_BM,
        docs=None if plain else plan_doc_attention(doc_BM),  # packed concept rows: document-aware, O(M) memory
        all_valid=all_valid,
    )


def chunk_to_concepts(h_BND: torch.Tensor, chunk: ChunkOutput, layout: SeqLayout, mode: str) -> Concepts:
    boundary_BM, valid_BM = boundary_positions(chunk.b_BN)
    c_BMD = merge_tokens(h_BND, chunk.b_BN, boundary_BM, valid_BM, layout, mode)
    p_BM = torch.where(valid_BM, torch.gather(chunk.p_BN, 1, boundary_BM), torch.ones_like(boundary_BM).float())
    return Concepts(
        c_BMD=c_BMD, boundary_BM=boundary_BM, p_BM=p_BM, layout=concept_layout(layout, boundary_BM, valid_BM)
    )
