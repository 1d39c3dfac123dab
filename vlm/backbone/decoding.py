"""Incremental decoding (docs/paper.md §12.8; the paper describes no decode algorithm): prefill state, then one token
at a time with the caches of ``vlm.backbone.cache``.

One step, per row of the batch:

    encoder step -> p_n from (ĥ_{n-1}, ĥ_n) (Eq. 2; b = p >= 0.5, or every R tokens with fixed chunking)
    -> rows with b_n = 1 close a concept (merge state + ĥ_n, or ĥ_n) and only those rows run the concept
       model (gathered, one concept each, against their own concept-level KV cache; loops and the wide
       concept model included) -> EMA update (Eq. 7-8) -> plug back z_n = ĥ_n + ĉ^ema (Eq. 9-10)
    -> decoder step with joint QKV (Eq. 11)

Decoding always uses the deterministic boundaries of eval (no noise), so it reproduces the eval-mode full
forward over the same tokens.
"""

# Shape suffixes (docs/paper.md §0): B batch rows, N token columns so far (or keys of a cache), n new tokens per row,
# M concepts per row, D model width, b the rows that close a concept this step, 1 a singleton axis.

from __future__ import annotations

import torch
from transformers import GenerationMixin

from vlm.backbone.cache import ConceptMoECache
from vlm.backbone.chunking import fixed_boundary_at
from vlm.backbone.layers import SeqLayout


def new_cache(model) -> ConceptMoECache:
    """An empty cache shaped for ``model`` (a ``ConceptMoEModel``): one KV per applied layer of each stack."""
    return ConceptMoECache(
        n_encoder=len(model.encoder.schedule),
        n_concept=len(model.concept_model.schedule),
        n_decoder=len(model.decoder.schedule),
        chunked=model.config.chunked,
    )


def position_limit(config) -> int | None:
    """The model's position limit: ``max_position_embeddings`` of the config, or of its ``text_config`` (the VLM)."""
    for c in (config, getattr(config, "text_config", None)):
        limit = getattr(c, "max_position_embeddings", None)
        if limit:
            return int(limit)
    return None


def check_prompt(ids_BN: torch.Tensor | None, mask_BN: torch.Tensor | None) -> int | None:
    """The longest prompt in real tokens (= positions it takes: positions restart at 0 after left padding);
    a one-line ``ValueError`` for an empty prompt or an empty row. None when there is no prompt tensor."""
    if ids_BN is None:
        return None
    if ids_BN.dim() < 2 or ids_BN.shape[0] == 0 or ids_BN.shape[1] == 0:
        raise ValueError(
            f"generate: the prompt is empty (shape {tuple(ids_BN.shape)}): pass at least one token per row"
        )
    if mask_BN is None:
        return int(ids_BN.shape[1])
    real_B = mask_BN.bool().sum(dim=1)
    if bool((real_B == 0).any()):
        row = int((real_B == 0).nonzero()[0, 0])
        raise ValueError(f"generate: prompt row {row} is empty (its attention_mask has no 1): every row needs a token")
    return int(real_B.max())


def check_positions(config, prompt_tokens: int, new_tokens: int = 0) -> None:
    """Prompt + new tokens must fit the model's positions 0 .. max_position_embeddings - 1 (as HF counts
    ``max_length``: every token of the final sequence gets a position); else a one-line ``ValueError``."""
    limit = position_limit(config)
    if limit is None:
        return
    if prompt_tokens > limit:
        raise ValueError(f"generate: the prompt has {prompt_tokens} tokens, more than max_position_embeddings={limit}")
    if prompt_tokens + new_tokens > limit:
        raise ValueError(
            f"generate: prompt of {prompt_tokens} tokens + max_new_tokens={new_tokens} = {prompt_tokens + new_tokens} "
            f"positions, more than max_position_embeddings={limit}; lower max_new_tokens to {limit - prompt_tokens}"
        )


def check_prefill(layout: SeqLayout, max_positions: int | None = None) -> None:
    """Generation continues one left-padded document per row, each non-empty and within ``max_positions``."""
    if layout.valid_BN.shape[1] == 0:
        raise ValueError("generation needs a prompt of at least one token per row (got an empty prompt)")
    if not bool(layout.valid_BN.any(dim=1).all()):
        raise ValueError("generation needs at least one real token per row (a row's attention_mask has no 1)")
    if max_positions is not None and int(layout.pos_BN.max()) >= max_positions:
        n = int(layout.pos_BN.max()) + 1
        raise ValueError(f"the prompt takes {n} positions, more than max_position_embeddings={max_positions}")
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
    cache.valid_BN = layout.valid_BN.clone()
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


def _step_layout(pos_B: torch.Tensor, key_valid_BN: torch.Tensor) -> SeqLayout:
    """One new query per given row at RoPE position ``pos_B``, attending to the cached keys marked valid."""
    rows = pos_B.shape[0]
    real_B1 = torch.ones(rows, 1, dtype=torch.bool, device=pos_B.device)
    keys_B11N = None if bool(key_valid_BN.all()) else key_valid_BN[:, None, None, :]
    return SeqLayout(
        doc_BN=torch.zeros(rows, 1, dtype=torch.long, device=pos_B.device),
        pos_BN=pos_B[:, None],
        valid_BN=real_B1,
        start_BN=~real_B1,
        docs=None,  # one query per row: the one-query path, with keys_B11N over the cache
        keys_B11N=keys_B11N,
        all_valid=True,
    )


def step_boundaries(
    model, h_BD: torch.Tensor, cache: ConceptMoECache, forced_B: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(p_B, b_B) of the new token of every row: Eq. 2 from the stored previous state, or fixed every R tokens;
    a forced token (``boundary_token_ids``) gets p = 1, as in the full forward."""
    if model.config.chunking == "fixed":
        p_B = fixed_boundary_at(cache.pos_B, model.config.target_r).float()
    else:
        p_B = model.chunker.step_probs(cache.last_h_BD, h_BD)
    if forced_B is not None:
        p_B = torch.where(forced_B, torch.ones_like(p_B), p_B)
    return p_B, p_B >= 0.5


def concept_step(model, c_bD: torch.Tensor, rows_b: torch.Tensor, cache: ConceptMoECache) -> torch.Tensor:
    """Ĉ for one new concept in each row of ``rows_b``, against those rows' concept-level caches."""
    at_b = cache.n_concepts_B[rows_b]
    keys = int(at_b.max()) + 1
    key_valid_bM = torch.arange(keys, device=c_bD.device)[None] <= at_b[:, None]
    layout = _step_layout(at_b, key_valid_bM)
    kv = [layer.for_rows(rows_b, at_b) for layer in cache.concept]
    try:
        c_b1D, _ = model.concept_forward(c_bD[:, None], layout, kv=kv)
    finally:
        for layer in cache.concept:
            layer.for_rows(None)
    return c_b1D[:, 0]


def decode_step(
    model, h_BD: torch.Tensor, cache: ConceptMoECache, forced_B: torch.Tensor | None = None
) -> torch.Tensor:
    """One token per row through the whole model (``forced_B``: rows whose token must close a concept); returns the
    decoder output (before the final norm)."""
    b = h_BD.shape[0]
    cache.valid_BN = torch.cat([cache.valid_BN, cache.valid_BN.new_ones(b, 1)], dim=1)
    layout = _step_layout(cache.pos_B, cache.valid_BN)
    h_B1D, _ = model.encoder(h_BD[:, None], layout, kv=cache.encoder)
    if not model.config.chunked:
        h_B1D, _ = model.concept_model(h_B1D, layout, kv=cache.concept)
        out_B1D, _ = model.decoder(h_B1D, layout, kv=cache.decoder)
        cache.pos_B = cache.pos_B + 1
        return out_B1D[:, 0]

    enc_BD = h_B1D[:, 0]
    p_B, b_B = step_boundaries(model, enc_BD, cache, forced_B)
    if cache.merge_BD is not None:  # sum merge: the window since the last boundary, this token included
        window_BD = cache.merge_BD + enc_BD
        cache.merge_BD = torch.where(b_B[:, None], torch.zeros_like(window_BD), window_BD)
    else:
        window_BD = enc_BD
    rows_b = b_B.nonzero().squeeze(1)
    if rows_b.numel() > 0:
        c_bD = concept_step(model, window_BD[rows_b], rows_b, cache).float()
        p_b1 = p_B[rows_b].float()[:, None]
        cache.ema_BD[rows_b] = p_b1 * c_bD + (1.0 - p_b1) * cache.ema_BD[rows_b]
        cache.n_concepts_B[rows_b] += 1
    concept_B1D = cache.ema_BD[:, None].to(enc_BD.dtype)
    out_B1D, _ = model.decoder(h_B1D + concept_B1D, layout, concept_B1D, kv=cache.decoder)
    cache.last_h_BD = enc_BD
    cache.pos_B = cache.pos_B + 1
    return out_B1D[:, 0]


def decode(
    model,
    h_BnD: torch.Tensor,
    cache: ConceptMoECache,
    new_valid_Bn: torch.Tensor | None,
    forced_Bn: torch.Tensor | None = None,
) -> torch.Tensor:
    """n new tokens per row after a prefill, one step at a time (``forced_Bn`` [B, n]: tokens that must close a
    concept); returns the final-norm states [B, n, D]."""
    if new_valid_Bn is not None and not bool(new_valid_Bn.all()):
        raise ValueError("tokens after the prompt must all be real (attention_mask 1): padding is prompt-side only")
    limit = model.config.max_position_embeddings
    if int(cache.pos_B.max()) + h_BnD.shape[1] > limit:
        raise ValueError(f"decoding past max_position_embeddings={limit} (positions 0..{limit - 1} are all used)")
    forced = [None] * h_BnD.shape[1] if forced_Bn is None else forced_Bn.unbind(1)
    outs = [decode_step(model, h_BnD[:, i], cache, forced[i]) for i in range(h_BnD.shape[1])]
    return model.norm(torch.stack(outs, dim=1))


class ConceptMoEGenerationMixin(GenerationMixin):
    """HF ``generate`` on the project's cache: the model builds its own ``ConceptMoECache`` at prefill
    (HF's ``DynamicCache`` holds one token-level KV per layer, which a concept model cannot use)."""

    _is_stateful = True  # no token-by-token rollback: assisted decoding is refused by HF

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    def generate(self, inputs=None, generation_config=None, **kwargs):
        """HF ``generate``, refusing up front (one-line ``ValueError``) an empty prompt, an empty row, and a prompt
        that, with ``max_new_tokens``, would run past ``max_position_embeddings``."""
        ids_BN = inputs if inputs is not None else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        self._prompt_tokens = check_prompt(ids_BN, kwargs.get("attention_mask"))
        try:
            return super().generate(inputs, generation_config, **kwargs)
        finally:
            self._prompt_tokens = None

    def _validate_generated_length(self, generation_config, input_ids_length, has_default_max_length):
        """HF's checks, after the position budget: positions count real tokens, so the longest row's prompt."""
        prompt = getattr(self, "_prompt_tokens", None) or input_ids_length
        check_positions(self.config, prompt, generation_config.max_length - input_ids_length)
        super()._validate_generated_length(generation_config, input_ids_length, has_default_max_length)
