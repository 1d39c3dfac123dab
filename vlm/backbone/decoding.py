"""Incremental decoding (SPEC §13): prefill state, then one token at a time with the caches of ``vlm.backbone.cache``.

One step, per row of the batch:

    encoder step -> p_n from (ĥ_{n-1}, ĥ_n) (Eq. 2; b = p >= 0.5, or every R tokens with fixed chunking)
    -> rows with b_n = 1 close a concept (merge state + ĥ_n, or ĥ_n) and only those rows run the concept
       model (gathered, one concept each, against their own concept-level KV cache; loops and the wide
       concept model included) -> EMA update (Eq. 7-8) -> plug back z_n = ĥ_n + ĉ^ema (Eq. 9-10)
    -> decoder step with joint QKV (Eq. 11)

Decoding always uses the deterministic boundaries of eval (no noise), so it reproduces the eval-mode full
forward over the same tokens.
"""

from __future__ import annotations

import torch
from transformers import GenerationMixin

from vlm.backbone.cache import ConceptMoECache
from vlm.backbone.layers import SeqLayout


def new_cache(model) -> ConceptMoECache:
    """An empty cache shaped for ``model`` (a ``ConceptMoEModel``): one KV per applied layer of each stack."""
    return ConceptMoECache(
        n_encoder=len(model.encoder.schedule),
        n_concept=len(model.concept_model.schedule),
        n_decoder=len(model.decoder.schedule),
        chunked=model.config.chunked,
    )


def check_prefill(layout: SeqLayout) -> None:
    """Generation continues one left-padded document per row."""
    if not bool(layout.valid_BN[:, -1].all()):
        raise ValueError("generation needs left-padded prompts: the last column of every row must be a real token")
    if bool((layout.start_BN.sum(dim=1) > 1).any()):
        raise ValueError("generation continues one document per row: do not pass packed rows (doc_ids) with a cache")


def fill_prefill_state(
    cache: ConceptMoECache,
    layout: SeqLayout,
    h_BND: torch.Tensor,
    b_BN: torch.Tensor | None = None,
    ema_BMD: torch.Tensor | None = None,
    merge: str = "sum",
) -> None:
    """The per-row decode state after a prefill (the KV caches were filled by the forward itself).

    ``h_BND`` is the encoder output Ĥ. Chunked models also keep: the last encoder state, the sum of the
    states after the row's last boundary (what the next concept will add, ``sum`` merge), the EMA at the
    row's last concept, and the number of concepts (the concept-cache length of the row).
    """
    cache.valid_BT = layout.valid_BN.clone()
    cache.pos_B = layout.pos_BN[:, -1] + 1
    if b_BN is None:
        return
    b, n, _ = h_BND.shape
    n_concepts_B = b_BN.sum(dim=1)
    idx_N = torch.arange(n, device=h_BND.device)
    last_boundary_B = torch.where(b_BN, idx_N, torch.full_like(idx_N, -1)).max(dim=1).values
    open_BN = (idx_N[None] > last_boundary_B[:, None]) & layout.valid_BN
    cache.last_h_BD = h_BND[:, -1].clone()
    cache.merge_BD = (h_BND * open_BN[..., None].to(h_BND.dtype)).sum(dim=1) if merge == "sum" else None
    rows_B = torch.arange(b, device=h_BND.device)
    cache.ema_BD = ema_BMD.float()[rows_B, (n_concepts_B - 1).clamp_min(0)]
    cache.n_concepts_B = n_concepts_B


def _step_layout(pos_R: torch.Tensor, key_valid_RT: torch.Tensor) -> SeqLayout:
    """One new query per row at RoPE position ``pos_R``, attending to the cached keys marked valid."""
    r = pos_R.shape[0]
    real_R1 = torch.ones(r, 1, dtype=torch.bool, device=pos_R.device)
    mask = None if bool(key_valid_RT.all()) else key_valid_RT[:, None, None, :]
    return SeqLayout(
        doc_BN=torch.zeros(r, 1, dtype=torch.long, device=pos_R.device),
        pos_BN=pos_R[:, None],
        valid_BN=real_R1,
        start_BN=~real_R1,
        mask_B1NN=mask,
    )


def step_boundaries(model, h_BD: torch.Tensor, cache: ConceptMoECache) -> tuple[torch.Tensor, torch.Tensor]:
    """(p_B, b_B) of the new token of every row: Eq. 2 from the stored previous state, or fixed every R tokens."""
    if model.config.chunking == "fixed":
        pos = cache.pos_B.double()
        r = model.config.target_r
        b_B = torch.floor(pos / r) != torch.floor((pos - 1.0) / r)
        return b_B.float(), b_B
    p_B = model.chunker.step_probs(cache.last_h_BD, h_BD)
    return p_B, p_B >= 0.5


def concept_step(model, c_RD: torch.Tensor, rows_R: torch.Tensor, cache: ConceptMoECache) -> torch.Tensor:
    """Ĉ for one new concept in each row of ``rows_R``, against those rows' concept-level caches."""
    at_R = cache.n_concepts_B[rows_R]
    keys = int(at_R.max()) + 1
    key_valid_RM = torch.arange(keys, device=c_RD.device)[None] <= at_R[:, None]
    layout = _step_layout(at_R, key_valid_RM)
    kv = [layer.for_rows(rows_R, at_R) for layer in cache.concept]
    try:
        c_R1D, _ = model.concept_forward(c_RD[:, None], layout, kv=kv)
    finally:
        for layer in cache.concept:
            layer.for_rows(None)
    return c_R1D[:, 0]


def decode_step(model, h_BD: torch.Tensor, cache: ConceptMoECache) -> torch.Tensor:
    """One token per row through the whole model; returns the decoder output (before the final norm)."""
    b = h_BD.shape[0]
    cache.valid_BT = torch.cat([cache.valid_BT, cache.valid_BT.new_ones(b, 1)], dim=1)
    layout = _step_layout(cache.pos_B, cache.valid_BT)
    h_B1D, _ = model.encoder(h_BD[:, None], layout, kv=cache.encoder)
    if not model.config.chunked:
        h_B1D, _ = model.concept_model(h_B1D, layout, kv=cache.concept)
        out_B1D, _ = model.decoder(h_B1D, layout, kv=cache.decoder)
        cache.pos_B = cache.pos_B + 1
        return out_B1D[:, 0]

    enc_BD = h_B1D[:, 0]
    p_B, b_B = step_boundaries(model, enc_BD, cache)
    if cache.merge_BD is not None:  # sum merge: the window since the last boundary, this token included
        window_BD = cache.merge_BD + enc_BD
        cache.merge_BD = torch.where(b_B[:, None], torch.zeros_like(window_BD), window_BD)
    else:
        window_BD = enc_BD
    rows_R = b_B.nonzero().squeeze(1)
    if rows_R.numel() > 0:
        c_RD = concept_step(model, window_BD[rows_R], rows_R, cache).float()
        p_R1 = p_B[rows_R].float()[:, None]
        cache.ema_BD[rows_R] = p_R1 * c_RD + (1.0 - p_R1) * cache.ema_BD[rows_R]
        cache.n_concepts_B[rows_R] += 1
    concept_B1D = cache.ema_BD[:, None].to(enc_BD.dtype)
    out_B1D, _ = model.decoder(h_B1D + concept_B1D, layout, concept_B1D, kv=cache.decoder)
    cache.last_h_BD = enc_BD
    cache.pos_B = cache.pos_B + 1
    return out_B1D[:, 0]


def decode(model, h_BnD: torch.Tensor, cache: ConceptMoECache, new_valid_Bn: torch.Tensor | None) -> torch.Tensor:
    """n new tokens per row after a prefill, one step at a time; returns the final-norm states [B, n, D]."""
    if new_valid_Bn is not None and not bool(new_valid_Bn.all()):
        raise ValueError("tokens after the prompt must all be real (attention_mask 1): padding is prompt-side only")
    outs = [decode_step(model, h_BnD[:, i], cache) for i in range(h_BnD.shape[1])]
    return model.norm(torch.stack(outs, dim=1))


class ConceptMoEGenerationMixin(GenerationMixin):
    """HF ``generate`` on the project's cache: the model builds its own ``ConceptMoECache`` at prefill
    (HF's ``DynamicCache`` holds one token-level KV per layer, which a concept model cannot use)."""

    _is_stateful = True  # no token-by-token rollback: assisted decoding is refused by HF

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False
