"""Transformer building blocks: RMSNorm, RoPE, grouped-query attention (with joint QKV, Eq. 11), SwiGLU.

Packed and padded rows attend through a :class:`~vlm.backbone.doc_attention.DocAttention` plan built once per
layout from the document ids (no ``N x N`` mask is ever built, issue #16); ``None`` means one plain causal row (the
fast path of ``scaled_dot_product_attention``). :func:`attention_mask` is the dense reference of the same rule, for
tests and debugging only.
"""

# Shape suffixes (docs/paper.md §0): B batch rows, N positions per row (tokens, or concepts when the concept model
# runs these blocks; also the keys a query attends to), D model width, H query heads, G key/value heads,
# h query heads per KV head (H / G), K head dim, 1 a singleton axis.

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vlm.backbone.doc_attention import DocAttention, doc_attention, plan_doc_attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_f = x.float()
        x_f = x_f * torch.rsqrt(x_f.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x_f.to(x.dtype)


# ----------------------------------------------------------------------------- positions and masks
@dataclass
class SeqLayout:
    """Where the documents of each row are, at one resolution (tokens, or concepts)."""

    doc_BN: torch.Tensor  # long: document id of every position; padding has its own id (-1)
    pos_BN: torch.Tensor  # long: position inside its document (RoPE restarts per document)
    valid_BN: torch.Tensor  # bool: real (non-padding) positions
    start_BN: torch.Tensor  # bool: first real position of each document
    docs: DocAttention | None  # document-aware causal attention plan, or None for plain causal rows
    forced_BN: torch.Tensor | None = None  # bool: must-be boundaries (document starts + caller's); None = starts
    keys_B11N: torch.Tensor | None = None  # decode steps only: which cached keys the lone query sees (None = all)
    all_valid: bool = False  # no padding anywhere (every position is a real token)
    # long [B, N, 2]: how many tokens back the (left, up) tokens lie that Eq. 2 compares token n with, 0 = none
    # (2-D image chunking, ``vlm.image_scan``); None = the previous token only (the paper)
    neighbour_BN2: torch.Tensor | None = None

    def __post_init__(self):
        if self.forced_BN is None:
            self.forced_BN = self.start_BN


def attention_mask(doc_BN: torch.Tensor) -> torch.Tensor:
    """The dense reference [B, 1, N, N] (O(N²): tests and debugging only, the model never builds it): position i
    attends to j <= i of the same document; padding (id < 0) attends nothing (an all-False row)."""
    n = doc_BN.shape[1]
    causal_NN = torch.ones(n, n, dtype=torch.bool, device=doc_BN.device).tril()
    same_doc_BNN = (doc_BN[:, :, None] == doc_BN[:, None, :]) & (doc_BN[:, :, None] >= 0)
    return (same_doc_BNN & causal_NN)[:, None]


def positions_in_document(doc_BN: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... restarting wherever the document id changes along the row."""
    n = doc_BN.shape[1]
    idx_BN = torch.arange(n, device=doc_BN.device).expand_as(doc_BN)
    new_doc_BN = torch.ones_like(doc_BN, dtype=torch.bool)
    new_doc_BN[:, 1:] = doc_BN[:, 1:] != doc_BN[:, :-1]
    first_BN = torch.where(new_doc_BN, idx_BN, torch.zeros_like(idx_BN)).cummax(dim=1).values
    return idx_BN - first_BN


def make_layout(
    doc_BN: torch.Tensor | None,
    valid_BN: torch.Tensor | None,
    shape: tuple[int, int],
    device: torch.device,
    pos_BN: torch.Tensor | None = None,
    boundary_BN: torch.Tensor | None = None,
    neighbour_BN2: torch.Tensor | None = None,
) -> SeqLayout:
    """Build the layout of a row batch from optional document ids / padding mask / positions.

    Padding positions get document id -1 so that they never attend to, or are attended by, real tokens.
    ``boundary_BN`` marks extra positions that must close a concept (e.g. the last token of every modality
    span, so that no concept mixes text and image); document starts always are boundaries. ``neighbour_BN2``
    (see :class:`SeqLayout`) must point inside the token's own document.
    """
    b, n = shape
    all_valid = valid_BN is None or bool(valid_BN.all())
    plain = doc_BN is None and all_valid  # one document per row, no padding: SDPA's causal fast path
    if doc_BN is None:
        doc_BN = torch.zeros(b, n, dtype=torch.long, device=device)
    if valid_BN is None:
        valid_BN = torch.ones(b, n, dtype=torch.bool, device=device)
    valid_BN = valid_BN.bool()
    doc_BN = torch.where(valid_BN, doc_BN.long(), torch.full_like(doc_BN, -1, dtype=torch.long))
    prev_BN = torch.cat([torch.full_like(doc_BN[:, :1], -2), doc_BN[:, :-1]], dim=1)
    start_BN = valid_BN & (doc_BN != prev_BN)
    # ids -> segments: a reused id (doc_ids 0,0,1,1,0,0) is still a new document where it starts again
    segment_BN = torch.cumsum((doc_BN != prev_BN).long(), dim=1)
    doc_BN = torch.where(valid_BN, segment_BN, torch.full_like(segment_BN, -1))
    if pos_BN is None:
        pos_BN = positions_in_document(doc_BN)
    forced_BN = start_BN if boundary_BN is None else (start_BN | boundary_BN.bool()) & valid_BN
    return SeqLayout(
        doc_BN=doc_BN,
        pos_BN=pos_BN.long(),
        valid_BN=valid_BN,
        start_BN=start_BN,
        docs=None if plain else plan_doc_attention(doc_BN),
        forced_BN=forced_BN,
        all_valid=all_valid,
        neighbour_BN2=None if neighbour_BN2 is None else neighbour_BN2.long(),
    )


def rope_cos_sin(pos_BN: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin of shape [B, 1, N, head_dim] for rotate-half RoPE (the Llama / Qwen / OLMoE layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos_BN.device).float() / head_dim))
    angles_BNK = pos_BN.float()[..., None] * torch.cat([inv_freq, inv_freq])  # channel i pairs with i + K/2
    return angles_BNK.cos()[:, None].to(dtype), angles_BNK.sin()[:, None].to(dtype)


def apply_rope(x_BHNK: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x_BHNK.chunk(2, dim=-1)
    return x_BHNK * cos + torch.cat([-x2, x1], dim=-1) * sin


# ----------------------------------------------------------------------------- attention
class Attention(nn.Module):
    """Grouped-query attention through ``scaled_dot_product_attention``.

    With ``joint=True`` the layer also owns W_q^c, W_k^c, W_v^c and adds the concept's projections to
    Q, K and V (joint decoding, ConceptMoE Eq. 11): Q = z W_q + c W_q^c, and likewise for K and V.
    The concept terms join before RoPE, so they rotate with the token's position like the token terms (a choice the
    paper leaves open, docs/paper.md §8).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        bias: bool = False,
        qk_norm: str = "none",
        eps: float = 1e-6,
        joint: bool = False,
    ):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=False)
        self.qk_norm = qk_norm
        if qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)
        elif qk_norm == "full":
            self.q_norm, self.k_norm = RMSNorm(n_heads * head_dim, eps), RMSNorm(n_kv_heads * head_dim, eps)
        self.joint = joint
        if joint:
            self.q_c = nn.Linear(d_model, n_heads * head_dim, bias=False)
            self.k_c = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
            self.v_c = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
            self.q_c.init_role = self.k_c.init_role = self.v_c.init_role = "joint_qkv"

    def joint_qkv(self, x_BND: torch.Tensor, concept_BND: torch.Tensor | None):
        """Eq. 11: token projections plus, in joint layers, the concept's projections."""
        q, k, v = self.q_proj(x_BND), self.k_proj(x_BND), self.v_proj(x_BND)
        if self.joint and concept_BND is not None:
            q = q + self.q_c(concept_BND)
            k = k + self.k_c(concept_BND)
            v = v + self.v_c(concept_BND)
        return q, k, v

    def forward(
        self,
        x_BND: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layout: SeqLayout,
        concept_BND: torch.Tensor | None = None,
        kv=None,
    ) -> torch.Tensor:
        """Causal attention over the rows of ``layout``: plain rows take SDPA's causal fast path, packed / padded rows
        the layout's document plan (``vlm.backbone.doc_attention``). With a cache ``kv`` (``vlm.backbone.cache``), the
        new keys / values are appended; a decode step (one query) attends to the cached keys that
        ``layout.keys_B11N`` marks (all when None)."""
        b, n, _ = x_BND.shape
        q, k, v = self.joint_qkv(x_BND, concept_BND)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q_BHNK = q.view(b, n, self.n_heads, self.head_dim).transpose(1, 2)
        k_BGNK = k.view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v_BGNK = v.view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm == "head":
            q_BHNK, k_BGNK = self.q_norm(q_BHNK), self.k_norm(k_BGNK)
        q_BHNK, k_BGNK = apply_rope(q_BHNK, cos, sin), apply_rope(k_BGNK, cos, sin)
        if kv is not None:
            k_BGNK, v_BGNK = kv.update(k_BGNK, v_BGNK)
            if n == 1:  # a decode step
                out_BH1K = one_query_attention(q_BHNK, k_BGNK, v_BGNK, layout.keys_B11N)
                return self.o_proj(out_BH1K.transpose(1, 2).reshape(b, n, -1))
        if layout.docs is not None:  # packed documents and / or padding: never an N x N mask
            out_BHNK = doc_attention(q_BHNK, k_BGNK, v_BGNK, layout.docs)
        else:
            out_BHNK = F.scaled_dot_product_attention(
                q_BHNK,
                k_BGNK,
                v_BGNK,
                is_causal=k_BGNK.shape[2] == n,  # a lone query after a cache sees every key
                enable_gqa=self.n_kv_heads != self.n_heads,
            )
        return self.o_proj(out_BHNK.transpose(1, 2).reshape(b, n, -1))


def one_query_attention(q_BH1K, k_BGNK, v_BGNK, mask_B11N=None) -> torch.Tensor:
    """softmax(q kᵀ / √K) v for one query per row against a cache of N keys: the H query heads are grouped onto
    their G KV heads by a view (no copy of the cache, unlike expanding K/V for GQA). On CPU this runs ~1.8x faster
    than SDPA's flash kernel, whose blocking targets many queries."""
    b, h, _, hd = q_BH1K.shape
    g = k_BGNK.shape[1]
    q_BGhK = q_BH1K.reshape(b, g, h // g, hd)
    scores_BGhN = (q_BGhK @ k_BGNK.transpose(-1, -2)) * hd**-0.5
    if mask_B11N is not None:
        scores_BGhN = scores_BGhN.masked_fill(~mask_B11N, float("-inf"))
    probs_BGhN = scores_BGhN.float().softmax(dim=-1).to(v_BGNK.dtype)
    return (probs_BGhN @ v_BGNK).reshape(b, h, 1, hd)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the dense FFN, and the shared expert of an MoE layer."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
