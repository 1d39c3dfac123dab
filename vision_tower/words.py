"""Word detectors on every patch, and image tokens that carry the text embeddings of the words they detect.

Stage 0 (``scripts/pretrain_vision.py --region-labels`` or ``--patch-labels``) trains a :class:`WordHead` on the
tower's patch features: one sigmoid detector per caption word, each word named by its token id in the VLM's
tokenizer. The tower file keeps it (``word_head.*`` keys). With ``ConceptMoEVLMConfig.vision_words`` the VLM adds
to every image token the language model's own input embeddings of the words its patches detect
(:func:`word_embeddings`): a probability-weighted mix of embedding rows, as Ovis builds its visual tokens from a
learned visual vocabulary (Lu et al. 2024, "Ovis: Structural Embedding Alignment for Multimodal Large Language
Model", arXiv 2405.20797, Sec. 3), here with the text's own table, so that a token of a red square enters the
language model looking like the words "red" and "square" and a question naming the square can find it the way it
finds an earlier word (``docs/seeing.md``, "Image tokens in the text's words").
"""

# Shape suffixes (docs/paper.md §0): B images, L patches per image, D feature width, K detected words,
# T merged image tokens, l the patches of one merge block, E the language model's width, V its vocabulary.

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

WORD_PREFIX = "word_head."  # a tower file's keys of the word head


class WordHead(nn.Module):
    """[B, L, D] patch features -> [B, L, K] logits, one per word of ``ids_K`` (token ids, a persistent buffer, so
    a saved tower or VLM says which word each detector names)."""

    def __init__(self, dim: int, word_ids: Sequence[int]):
        super().__init__()
        ids = [int(i) for i in word_ids]  # checked as Python ints: HF loading builds modules on the meta device
        if not ids or min(ids) < 0:
            raise ValueError(f"WordHead: word_ids must be a non-empty list of token ids, got {ids[:8]!r}")
        self.linear = nn.Linear(dim, len(ids))
        self.register_buffer("ids_K", torch.tensor(ids, dtype=torch.long))

    @property
    def num_words(self) -> int:
        return len(self.ids_K)

    def forward(self, features_BLD: torch.Tensor) -> torch.Tensor:
        return self.linear(features_BLD)


def word_embeddings(probs_TlK: torch.Tensor, ids_K: torch.Tensor, embedding_VE: torch.Tensor) -> torch.Tensor:
    """[T, l, K] detector probabilities of each merged token's patches -> [T, E]: ``sum_k p_k E[ids_k]`` with ``p_k``
    the largest probability of word ``k`` over the token's patches (a token holding one patch of the square says
    "square" as loudly as that patch does)."""
    if int(ids_K.max()) >= len(embedding_VE):
        raise ValueError(
            f"word_embeddings: the word head names token id {int(ids_K.max())}, outside the language model's "
            f"{len(embedding_VE)} embeddings (a tower trained with another tokenizer?)"
        )
    return probs_TlK.amax(1).to(embedding_VE.dtype) @ embedding_VE[ids_K]
