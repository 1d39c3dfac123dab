"""Model outputs and the chunking statistics reported with every forward (per-modality R: docs/paper.md §11)."""

# Shape suffixes (docs/paper.md §0): B batch rows, N tokens per row, D model width.

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

from vlm.backbone.chunking import ChunkOutput
from vlm.backbone.layers import SeqLayout


@dataclass
class BackboneOutput(ModelOutput):
    last_hidden_state: torch.Tensor | None = None  # [B, N, D] after the final norm
    aux: dict | None = None  # ratio_loss, balance_loss, z_loss (scalar tensors)
    chunk_stats: dict | None = None
    chunk: ChunkOutput | None = None  # p / b of the forward (None with chunking="none")
    cache: object | None = None  # vlm.backbone.cache.ConceptMoECache when use_cache (generation)


@dataclass
class ConceptMoECausalLMOutput(ModelOutput):
    """``loss`` = lm + λ·ratio + β·balance + z-weight·z; each term is also in ``aux`` for logging."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    aux: dict | None = None
    chunk_stats: dict | None = None
    cache: object | None = None  # vlm.backbone.cache.ConceptMoECache: pass it back with the next tokens
    chunk: ChunkOutput | None = None  # p / b of every token (None with chunking="none", and on decode steps)


ALWAYS_REPORTED = (0, 1)


@torch.no_grad()
def chunk_statistics(chunk: ChunkOutput | None, layout: SeqLayout, modality_BN: torch.Tensor | None) -> dict:
    """Counts behind R, overall and per modality id.

    A concept belongs to the modality of its boundary token (the token that closes its merge window).
    Per modality m: R_m = tokens_m / concepts_m, so sum_m concepts_m == concepts. Keys 0 (text) and 1
    (image) are always present; a modality without tokens in the batch has R_m = None. Counts (not ratios)
    are returned too so that training can aggregate them exactly over micro-batches and ranks.
    ``flip_rate`` is the fraction of real tokens whose boundary decision the noise changed.
    """
    valid_BN = layout.valid_BN
    b_BN = valid_BN if chunk is None else chunk.b_BN & valid_BN
    if modality_BN is None:
        modality_BN = torch.zeros_like(layout.doc_BN)
    tokens = int(valid_BN.sum())
    concepts = int(b_BN.sum())
    stats = {
        "tokens": tokens,
        "concepts": concepts,
        "r": tokens / max(concepts, 1),
        "mean_p": 1.0 if chunk is None else float((chunk.p_BN * valid_BN).sum()) / max(tokens, 1),
        "flip_rate": 0.0 if chunk is None else int(((chunk.b_BN != chunk.b_hard_BN) & valid_BN).sum()) / max(tokens, 1),
        "tokens_by_modality": {},
        "concepts_by_modality": {},
        "r_by_modality": {},
        "mean_p_by_modality": {},
        "flip_rate_by_modality": {},
    }
    present = torch.unique(modality_BN[valid_BN]).tolist()
    # Modality ids are opaque to the backbone; 0 and 1 are the VLM's text and image (``data_pipelines.Modality``,
    # which the backbone may not import), always reported so that logs keep one shape; R is None when absent.
    for m in sorted(set(present) | set(ALWAYS_REPORTED)):
        in_m = (modality_BN == m) & valid_BN
        t_m, c_m = int(in_m.sum()), int((b_BN & in_m).sum())
        stats["tokens_by_modality"][m] = t_m
        stats["concepts_by_modality"][m] = c_m
        stats["r_by_modality"][m] = t_m / max(c_m, 1) if t_m else None
        if chunk is None:
            stats["mean_p_by_modality"][m], stats["flip_rate_by_modality"][m] = 1.0, 0.0
        else:
            stats["mean_p_by_modality"][m] = float(chunk.p_BN[in_m].sum()) / max(t_m, 1)
            stats["flip_rate_by_modality"][m] = int((chunk.b_BN != chunk.b_hard_BN)[in_m].sum()) / max(t_m, 1)
    return stats
