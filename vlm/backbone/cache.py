"""Inference caches (the decode state per row, docs/paper.md §12.8): token-level KV for the encoder and decoder, a
concept-level KV for the concept model (one entry per concept, so ~N/R), and the chunk state.

Token caches are column-aligned with the attention mask that generation grows (left padding included, masked
out as keys). Concept caches hold a different number of entries per row (rows close concepts at different
tokens); a decode step appends to the rows that hit a boundary only. Both grow by doubling, so appending one
entry costs O(1) amortised, never a copy of the whole cache.
"""

# Shape suffixes (docs/paper.md §0): B batch rows, N token columns (the keys cached so far), n new columns,
# M concepts per row, D model width, G key/value heads, K head dim, b the rows of a decode step that close a concept.

from __future__ import annotations

import torch


def _grown(buf: torch.Tensor, needed: int, dim: int = 2) -> torch.Tensor:
    """``buf`` with at least ``needed`` slots along ``dim`` (capacity doubles; old contents kept)."""
    cap = buf.shape[dim]
    if needed <= cap:
        return buf
    shape = list(buf.shape)
    shape[dim] = max(needed, 2 * cap)
    out = buf.new_zeros(shape)
    out.narrow(dim, 0, cap).copy_(buf)
    return out


class TokenKV:
    """K/V of one attention layer, one entry per column of the row batch: ``[B, G, N, K]``."""

    def __init__(self):
        self.k_BGNK: torch.Tensor | None = None
        self.v_BGNK: torch.Tensor | None = None
        self.length = 0

    def update(self, k_BGnK: torch.Tensor, v_BGnK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append n columns; return every cached column (the keys / values the new queries attend to)."""
        n = k_BGnK.shape[2]
        if self.k_BGNK is None:
            self.k_BGNK, self.v_BGNK = k_BGnK.clone(), v_BGnK.clone()
        else:
            self.k_BGNK = _grown(self.k_BGNK, self.length + n)
            self.v_BGNK = _grown(self.v_BGNK, self.length + n)
            self.k_BGNK[:, :, self.length : self.length + n] = k_BGnK
            self.v_BGNK[:, :, self.length : self.length + n] = v_BGnK
        self.length += n
        return self.k_BGNK[:, :, : self.length], self.v_BGNK[:, :, : self.length]

    def reorder(self, index_B: torch.Tensor) -> None:
        if self.k_BGNK is not None:
            self.k_BGNK, self.v_BGNK = self.k_BGNK[index_B], self.v_BGNK[index_B]

    def nbytes(self) -> int:
        if self.k_BGNK is None:
            return 0
        k = self.k_BGNK
        return 2 * k.shape[0] * k.shape[1] * self.length * k.shape[3] * k.element_size()


class ConceptKV:
    """K/V of one concept-model layer application: ``[B, G, M, K]``, the first ``len_B[b]`` entries of row b real.

    Prefill stores the batched concept sequence as it is (left-aligned concepts, padding slots after them);
    a decode step writes the new concept of each boundary row at that row's length, overwriting padding.
    """

    def __init__(self):
        self.k_BGMK: torch.Tensor | None = None
        self.v_BGMK: torch.Tensor | None = None
        self.rows_b: torch.Tensor | None = None  # rows of the decode step in progress (see ``for_rows``)
        self.at_b: torch.Tensor | None = None  # and where their new concept goes (their current lengths)

    def update(self, k_bGnK: torch.Tensor, v_bGnK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill (no rows bound; b = B, n = M): store all slots. Decode (rows bound; n = 1): append one concept
        to each bound row and return those rows' caches, ``[b, G, max_len, K]`` (the caller masks each row past
        its length)."""
        if self.rows_b is None:
            self.k_BGMK, self.v_BGMK = k_bGnK.clone(), v_bGnK.clone()
            return k_bGnK, v_bGnK
        rows_b, at_b = self.rows_b, self.at_b
        needed = int(at_b.max()) + 1
        self.k_BGMK, self.v_BGMK = _grown(self.k_BGMK, needed), _grown(self.v_BGMK, needed)
        self.k_BGMK[rows_b, :, at_b] = k_bGnK[:, :, 0]
        self.v_BGMK[rows_b, :, at_b] = v_bGnK[:, :, 0]
        if rows_b.numel() == self.k_BGMK.shape[0]:  # every row at a boundary (rows are sorted): no gather copy
            return self.k_BGMK[:, :, :needed], self.v_BGMK[:, :, :needed]
        return self.k_BGMK[rows_b, :, :needed], self.v_BGMK[rows_b, :, :needed]

    def for_rows(self, rows_b: torch.Tensor | None, at_b: torch.Tensor | None = None) -> ConceptKV:
        """Bind the rows that take one new concept each (at index ``at_b``) for the next ``update``; None: prefill."""
        self.rows_b, self.at_b = rows_b, at_b
        return self

    def reorder(self, index_B: torch.Tensor) -> None:
        if self.k_BGMK is not None:
            self.k_BGMK, self.v_BGMK = self.k_BGMK[index_B], self.v_BGMK[index_B]

    def nbytes(self, len_B: torch.Tensor) -> int:
        if self.k_BGMK is None:
            return 0
        k = self.k_BGMK
        return 2 * int(len_B.sum()) * k.shape[1] * k.shape[3] * k.element_size()


class ConceptMoECache:
    """Everything a decode step needs, per row of the batch.

    ``valid_BN``: which cached columns are real tokens (the generation attention mask); ``pos_B``: the next
    token's RoPE position. Chunk state (chunked models only): ``last_h_BD`` the previous encoder output
    (for the next boundary probability, Eq. 2), ``merge_BD`` the sum of encoder states since the last
    boundary (``sum`` merge), ``ema_BD`` the EMA of the current concept (Eq. 7-8: what plug-back adds),
    ``n_concepts_B`` the concept-cache length of every row.
    """

    def __init__(self, n_encoder: int, n_concept: int, n_decoder: int, chunked: bool):
        self.encoder = [TokenKV() for _ in range(n_encoder)]
        self.concept = [ConceptKV() if chunked else TokenKV() for _ in range(n_concept)]
        self.decoder = [TokenKV() for _ in range(n_decoder)]
        self.chunked = chunked
        self.valid_BN: torch.Tensor | None = None
        self.pos_B: torch.Tensor | None = None
        self.last_h_BD: torch.Tensor | None = None
        self.merge_BD: torch.Tensor | None = None
        self.ema_BD: torch.Tensor | None = None
        self.n_concepts_B: torch.Tensor | None = None

    def per_stack(self) -> dict[str, list]:
        """The KV caches of each stack, as the forward hands them to its encoder, concept model and decoder."""
        return {"encoder": self.encoder, "concept": self.concept, "decoder": self.decoder}

    # ------------------------------------------------------------------ HF generation protocol
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.valid_BN is None else self.valid_BN.shape[1]

    @property
    def is_croppable(self) -> bool:  # a concept cache cannot be rolled back token by token
        return False

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search: row i continues from row ``beam_idx[i]``."""
        for layer in self.encoder + self.concept + self.decoder:
            layer.reorder(beam_idx)
        for name in ("valid_BN", "pos_B", "last_h_BD", "merge_BD", "ema_BD", "n_concepts_B"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value[beam_idx])

    # ------------------------------------------------------------------ sizes
    def concept_lengths(self) -> torch.Tensor:
        """Entries in the concept-level cache of each row (= concepts so far; = tokens without chunking)."""
        if self.chunked:
            return self.n_concepts_B.clone()
        return self.valid_BN.sum(dim=1)

    def kv_bytes(self) -> dict:
        """Bytes of cached keys and values (real entries, not spare capacity): token-level (encoder and decoder,
        plus the concept model without chunking) and concept-level."""
        token = sum(layer.nbytes() for layer in self.encoder + self.decoder)
        if self.chunked:
            concept = sum(layer.nbytes(self.n_concepts_B) for layer in self.concept)
        else:
            token += sum(layer.nbytes() for layer in self.concept)
            concept = 0
        return {"token": token, "concept": concept, "total": token + concept}
