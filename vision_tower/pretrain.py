"""Pretraining the vision tower on image-caption pairs: SigLIP's sigmoid loss, or caption-word classification.

Real VLMs start from a contrastively pretrained tower (LLaVA and nanoVLM from CLIP / SigLIP). This toolkit's towers
start from random weights, and a VLM trained from one learns to read only what its one answer token per sample
teaches the tower (``docs/seeing.md``). This module gives the tower a direct signal first: every image of a batch
is scored against every caption of the batch, and the tower learns whatever tells its image's caption from the
others (a shape, a colour, a position, a count), at any image budget the VLM will use.

- :class:`CaptionEncoder`: a small transformer over caption token ids, mean-pooled (the text side; thrown away
  after pretraining).
- The image side is the tower's own summary pool (:class:`~vision_tower.pool.AttentionPool`, SigLIP's "MAP" head,
  built by ``VisionTower(summary=True)``) and one linear layer on it. The pool is saved with the tower, so a VLM
  with ``vision_summary`` reads the same summary the words were learned from; the per-patch features the projector
  reads are trained through it too.
- :func:`sigmoid_contrastive_loss`: SigLIP's loss (Zhai et al. 2023, "Sigmoid Loss for Language Image
  Pre-Training", arXiv 2303.15343, Algorithm 1).
- :class:`ContrastivePretrainer`: tower + pool + caption encoder + the loss's learned temperature and bias.
- :func:`caption_idf` and :func:`caption_classification_loss`: SuperClass's objective (Huang et al. 2024,
  "Classification Done Right for Vision-Language Pre-Training", arXiv 2411.03313): the caption's own token ids are
  the image's class labels, a multi-hot target weighted by inverse document frequency, softmax cross-entropy.
- :func:`multilabel_loss`: the same labels as independent binary problems (sigmoid binary cross-entropy, as
  CatLIP trains on caption-derived labels: Mehta et al. 2024, arXiv 2404.15653), so one word's gradient is not
  shared out among the caption's other words by a softmax.
- :class:`CaptionClassPretrainer`: tower + pool + one linear layer over the tokenizer's vocabulary, with either
  loss. No text encoder and no batch of negatives: every word of every caption is a direct target for its own
  image, so each attribute a caption names (colour, shape, position) pulls on the tower from the first step.
- :func:`word_pairs`, :func:`pair_vocabulary` and :func:`pair_targets`: with the sigmoid loss, ordered pairs of
  nearby informative tokens of a caption ("red" ... "square", "square" ... "left") as labels beside the single
  words. A bag of words cannot tell "a red square and a blue circle" from "a blue square and a red circle"; its
  pairs can, so the summary has to carry which attribute goes with which object (binding).
- :func:`patch_word_loss` and :func:`region_word_loss`: word detectors on every patch, beside the summary's. The
  first pools them over the image by noisy-OR (multiple-instance learning on the caption's words, Fang et al. 2015,
  arXiv 1411.4952); the second labels each patch with the words of the boxed regions it lies in (box-supervised,
  from grounded captions or this toolkit's scene objects). A VLM reads patches, not the summary, and a question
  about one object among several can only find the right one if that object's own tokens say what it is.

``scripts/pretrain_vision.py`` trains it on webdataset image-caption shards and writes the tower's timm state dict
as ``.safetensors``, which ``ConceptMoEVLMConfig(vision_weights=...)`` loads.
"""

# Shape suffixes: B images (= captions) of a batch, L patches, D tower width, T caption tokens, E embedding width.

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vision_tower.tower import VisionTower


def sigmoid_contrastive_loss(
    image_BE: torch.Tensor, text_BE: torch.Tensor, log_scale: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """SigLIP's loss (arXiv 2303.15343, Algorithm 1): every (image i, caption j) pair is a binary problem,
    positive on the diagonal, ``-1/B * sum_ij log sigmoid(z_ij * (t * x_i . y_j + b))`` with ``z_ij`` = +1 if
    i = j else -1, ``t = exp(log_scale)``, embeddings L2-normalised here."""
    x_BE, y_BE = F.normalize(image_BE, dim=-1), F.normalize(text_BE, dim=-1)
    logits_BB = log_scale.exp() * x_BE @ y_BE.T + bias
    z_BB = 2 * torch.eye(len(logits_BB), device=logits_BB.device, dtype=logits_BB.dtype) - 1
    return -F.logsigmoid(z_BB * logits_BB).sum() / len(logits_BB)


class CaptionEncoder(nn.Module):
    """Token ids -> one caption embedding: learned positions, a pre-norm transformer, a mean over real tokens."""

    def __init__(self, vocab_size: int, dim: int, depth: int, heads: int, max_len: int, out_dim: int):
        super().__init__()
        self.max_len = max_len
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos_TD = nn.Parameter(torch.randn(max_len, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, out_dim)

    def forward(self, ids_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
        if ids_BT.shape[1] > self.max_len:
            raise ValueError(f"CaptionEncoder: captions of {ids_BT.shape[1]} tokens exceed max_len {self.max_len}")
        h_BTD = self.embed(ids_BT) + self.pos_TD[: ids_BT.shape[1]]
        h_BTD = self.norm(self.blocks(h_BTD, src_key_padding_mask=~mask_BT))
        weights_BT1 = mask_BT[..., None].to(h_BTD.dtype)
        return self.proj((h_BTD * weights_BT1).sum(1) / weights_BT1.sum(1).clamp(min=1))


@dataclass
class ContrastiveOutput:
    loss: torch.Tensor  # scalar
    image_BE: torch.Tensor
    text_BE: torch.Tensor


class ContrastivePretrainer(nn.Module):
    """A :class:`VisionTower` (built with ``summary=True``) whose summary, through one linear layer, is the image
    embedding; a caption encoder; SigLIP's learned temperature and bias (initialised as the paper does: t = 10,
    b = -10)."""

    score_name = "retrieval"  # what :meth:`batch_score` measures

    def __init__(
        self,
        tower: VisionTower,
        vocab_size: int,
        embed_dim: int = 128,
        text_dim: int = 128,
        text_depth: int = 2,
        text_heads: int = 4,
        max_caption_tokens: int = 64,
    ):
        super().__init__()
        self.tower = tower
        self.proj = nn.Linear(tower.require_summary_pool().out_dim, embed_dim)
        self.text = CaptionEncoder(vocab_size, text_dim, text_depth, text_heads, max_caption_tokens, embed_dim)
        self.log_scale = nn.Parameter(torch.tensor(math.log(10.0)))
        self.bias = nn.Parameter(torch.tensor(-10.0))

    def embed_images(self, patches, patch_coord, patch_valid) -> torch.Tensor:
        return self.proj(self.tower.summarize(self.tower(patches, patch_coord, patch_valid)))

    def forward(self, patches, patch_coord, patch_valid, ids_BT, mask_BT) -> ContrastiveOutput:
        image_BE = self.embed_images(patches, patch_coord, patch_valid)
        text_BE = self.text(ids_BT, mask_BT)
        loss = sigmoid_contrastive_loss(image_BE, text_BE, self.log_scale, self.bias)
        return ContrastiveOutput(loss, image_BE, text_BE)

    @torch.no_grad()
    def batch_score(self, out: ContrastiveOutput) -> float:
        """Held-out and logged score: :meth:`retrieval_accuracy` of the batch."""
        return self.retrieval_accuracy(out.image_BE, out.text_BE)

    @torch.no_grad()
    def retrieval_accuracy(self, image_BE: torch.Tensor, text_BE: torch.Tensor) -> float:
        """Share of images whose own caption scores highest among the batch's (chance 1 / B)."""
        scores_BB = F.normalize(image_BE, dim=-1) @ F.normalize(text_BE, dim=-1).T
        return (scores_BB.argmax(1) == torch.arange(len(scores_BB), device=scores_BB.device)).float().mean().item()


def caption_idf(captions: list[list[int]], vocab_size: int) -> torch.Tensor:
    """Inverse document frequency of every token id over ``captions`` (SuperClass's label weights):
    ``log(N / (1 + df))``, floored at 0, so a token in nearly every caption ("a", ".") weighs nothing."""
    df_V = torch.zeros(vocab_size)
    for ids in captions:
        df_V[torch.tensor(sorted(set(ids)), dtype=torch.long)] += 1
    return (math.log(len(captions)) - torch.log1p(df_V)).clamp(min=0.0)


def caption_words(captions: list[list[int]], idf_V: torch.Tensor) -> list[int]:
    """The token ids that some caption holds with IDF > 0 (the labels a caption can have), sorted."""
    return sorted({t for ids in captions for t in ids if idf_V[t] > 0})


def caption_targets(ids_BT: torch.Tensor, mask_BT: torch.Tensor, idf_V: torch.Tensor) -> torch.Tensor:
    """A caption's multi-hot over the vocabulary, each present token weighted by its IDF, normalised to sum 1
    (a caption with no weighted token gets an all-zero row, which adds no loss)."""
    hot_BV = torch.zeros(len(ids_BT), len(idf_V), device=ids_BT.device)
    hot_BV = hot_BV.scatter_add(1, ids_BT, mask_BT.float()).clamp(max=1.0)  # padding adds 0 wherever it points
    weighted_BV = hot_BV * idf_V
    return weighted_BV / weighted_BV.sum(1, keepdim=True).clamp(min=1e-12)


def caption_classification_loss(logits_BV: torch.Tensor, target_BV: torch.Tensor) -> torch.Tensor:
    """SuperClass's loss (arXiv 2411.03313, Sec. 3): softmax cross-entropy of the image's logits over the vocabulary
    against the caption's IDF-weighted, normalised multi-hot ``-mean_i sum_c y_ic log softmax(x_i)_c``."""
    return -(target_BV * F.log_softmax(logits_BV.float(), dim=-1)).sum(1).mean()


def multilabel_loss(logits_BV: torch.Tensor, target_BV: torch.Tensor) -> torch.Tensor:
    """Every token id with a nonzero :func:`caption_targets` weight is a positive label of its image, every other
    id a negative: ``mean_i sum_c BCE(sigmoid(x_ic), [y_ic > 0])`` (CatLIP's multi-label loss, arXiv 2404.15653,
    with the caption's informative token ids as the labels)."""
    labels_BV = (target_BV > 0).to(torch.float32)
    return F.binary_cross_entropy_with_logits(logits_BV.float(), labels_BV, reduction="sum") / len(logits_BV)


def patch_word_loss(logits_BLK: torch.Tensor, valid_BL: torch.Tensor, labels_BK: torch.Tensor) -> torch.Tensor:
    """Word detectors on every patch, pooled by noisy-OR (multiple-instance learning, Fang et al. 2015, "From
    Captions to Visual Concepts and Back", arXiv 1411.4952, Sec. 3.1): an image holds word ``k`` with probability
    ``P_k = 1 - prod_j (1 - sigmoid(x_jk))`` over its valid patches ``j``, trained with binary cross-entropy against
    the caption's 0/1 ``labels_BK``. ``log(1 - P_k) = -sum_j softplus(x_jk)``, so a positive costs
    ``-log(1 - exp(-s_k))`` and a negative ``s_k``, with ``s_k`` that sum: summed over words, averaged over images.
    One patch firing is enough for a positive and every patch must stay silent for a negative. Meant to put each
    word on the patches of the thing it names; measured (docs/seeing.md, "region labels"), one patch carries the
    colour but an object's shape, spread over several patches, ends up on none of them: see
    :func:`region_word_loss`."""
    s_BK = (F.softplus(logits_BLK.float()) * valid_BL[..., None].float()).sum(1)
    positive_BK = -torch.log(-torch.expm1(-s_BK.clamp(min=1e-6)))
    return torch.where(labels_BK > 0, positive_BK, s_BK).sum() / len(logits_BLK)


def region_word_loss(logits_BLK: torch.Tensor, valid_BL: torch.Tensor, target_BLK: torch.Tensor) -> torch.Tensor:
    """Box-supervised patch words: every valid patch whose centre lies in a region's box has that region's words
    (``target_BLK`` 0/1) as labels, every other word (and every word of a patch in no box) as a negative; sigmoid
    binary cross-entropy summed over the words, averaged over the valid patches. Each patch of an object then names
    that object's size, colour, shape and place itself (binding), which the caption's words pooled over the whole
    image (``multilabel_loss``) or over the best patch (:func:`patch_word_loss`) do not ask."""
    valid = valid_BL.bool()
    bce = F.binary_cross_entropy_with_logits(logits_BLK[valid].float(), target_BLK[valid].float(), reduction="sum")
    return bce / valid.sum().clamp(min=1)


CAPTION_LOSSES = {"softmax": caption_classification_loss, "sigmoid": multilabel_loss}
PAIR_MIN_COUNT = 5  # a pair of words is a label when at least this many training captions hold it
PATCH_PRIOR_ODDS = 400.0  # a patch word detector starts at sigmoid(-log 400) = 0.0025: an image of 64 patches ~0.15


def word_pairs(ids: Sequence[int], idf: Sequence[float], window: int) -> set[tuple[int, int]]:
    """Ordered pairs ``(a, b)`` of a caption's informative token ids (IDF > 0: the words a bag-of-words label
    keeps), ``b`` at most ``window`` informative tokens after ``a``: in "a small red square at the top left" with
    window 4 ("the" is in every caption), "red" pairs with "square", "at", "top" and "left", so colour-shape,
    shape-position and colour-position bindings are labels (a word the tokenizer splits gives several ids; its
    pieces pair too)."""
    kept = [t for t in ids if idf[t] > 0]
    return {(a, kept[j]) for i, a in enumerate(kept) for j in range(i + 1, min(i + 1 + window, len(kept)))}


def pair_vocabulary(
    captions: list[list[int]], idf_V: torch.Tensor, window: int, min_count: int = PAIR_MIN_COUNT
) -> dict[tuple[int, int], int]:
    """Every :func:`word_pairs` pair held by at least ``min_count`` of ``captions``, numbered in sorted order."""
    idf = idf_V.tolist()
    counts = Counter(pair for ids in captions for pair in word_pairs(ids, idf, window))
    return {pair: k for k, pair in enumerate(sorted(p for p, n in counts.items() if n >= min_count))}


def pair_targets(
    ids_BT: torch.Tensor, mask_BT: torch.Tensor, idf: Sequence[float], vocab: dict, window: int
) -> torch.Tensor:
    """Each caption's pairs (:func:`word_pairs`) as a 0/1 multi-hot over ``vocab`` (pairs outside it: no label)."""
    target_BP = torch.zeros(len(ids_BT), len(vocab), device=ids_BT.device)
    for b, (ids_T, mask_T) in enumerate(zip(ids_BT.tolist(), mask_BT.tolist())):
        ids = [t for t, real in zip(ids_T, mask_T) if real]
        hits = [vocab[pair] for pair in word_pairs(ids, idf, window) if pair in vocab]
        target_BP[b, hits] = 1.0
    return target_BP


@dataclass
class CaptionClassOutput:
    loss: torch.Tensor  # scalar
    logits_BV: torch.Tensor
    target_BV: torch.Tensor
    patch_loss: torch.Tensor | None = None  # scalar, with ``patch_labels``: :func:`patch_word_loss` (unweighted)
    region_loss: torch.Tensor | None = None  # scalar, with ``region_labels``: :func:`region_word_loss` (unweighted)


class CaptionClassPretrainer(nn.Module):
    """A :class:`VisionTower` (built with ``summary=True``) whose summary, through one linear layer, gives one logit
    per token id of the vocabulary, trained with ``loss``: ``"softmax"`` (:func:`caption_classification_loss`,
    SuperClass) or ``"sigmoid"`` (:func:`multilabel_loss`). ``idf_V`` (from :func:`caption_idf` over the training
    captions) is a buffer: the same weights for every batch. With ``pairs`` (a :func:`pair_vocabulary` of
    ``pair_window``; sigmoid only) the layer gives one logit more per pair, each a binary label of its own. With
    ``patch_labels`` > 0 a second linear layer scores each of ``patch_words`` (the token ids of the training captions'
    informative words: :func:`caption_words`) on every patch (the tower's :class:`~vision_tower.words.WordHead`, saved
    with it), and
    :func:`patch_word_loss` times ``patch_labels`` is added: the patch features themselves, not only the summary,
    name what they show. With ``region_labels`` > 0 the same layer is trained on ``region_BLK`` (each patch's words
    from the boxed regions it lies in: :func:`region_word_loss`) with that weight."""

    score_name = "r_precision"  # what :meth:`batch_score` measures

    def __init__(
        self,
        tower: VisionTower,
        idf_V: torch.Tensor,
        loss: str = "softmax",
        pairs: dict | None = None,
        pair_window: int = 4,
        patch_labels: float = 0.0,
        patch_words: Sequence[int] = (),
        region_labels: float = 0.0,
    ):
        super().__init__()
        if loss not in CAPTION_LOSSES:
            raise ValueError(f"loss must be one of {sorted(CAPTION_LOSSES)}, got {loss!r}")
        if pairs and loss != "sigmoid":
            raise ValueError("word-pair labels need the sigmoid loss (the multilabel objective)")
        self.loss_fn = CAPTION_LOSSES[loss]
        self.tower = tower
        self.pairs, self.pair_window, self._idf = pairs or {}, pair_window, idf_V.tolist()
        self.head = nn.Linear(tower.require_summary_pool().out_dim, len(idf_V) + len(self.pairs))
        self.register_buffer("idf_V", idf_V.float(), persistent=False)
        for name, weight in (("patch_labels", patch_labels), ("region_labels", region_labels)):
            if weight < 0 or (weight and not len(patch_words)):
                raise ValueError(f"{name} must be >= 0, and > 0 only with patch_words, got {weight}")
        self.patch_labels, self.region_labels = patch_labels, region_labels
        if patch_labels or region_labels:  # the tower's own word head: the tower file keeps it (vision_words)
            self.patch_head = tower.add_word_head(sorted(set(patch_words)))
            nn.init.constant_(self.patch_head.linear.bias, -math.log(PATCH_PRIOR_ODDS))

    @property
    def word_ids_K(self) -> torch.Tensor:
        """The token ids the patch word head scores, sorted."""
        return self.patch_head.ids_K

    def forward(self, patches, patch_coord, patch_valid, ids_BT, mask_BT, region_BLK=None) -> CaptionClassOutput:
        feats = self.tower(patches, patch_coord, patch_valid)
        logits = self.head(self.tower.summarize(feats))
        logits_BV, logits_BP = logits[:, : len(self.idf_V)], logits[:, len(self.idf_V) :]
        target_BV = caption_targets(ids_BT, mask_BT, self.idf_V)
        loss = self.loss_fn(logits_BV, target_BV)
        if self.pairs:
            target_BP = pair_targets(ids_BT, mask_BT, self._idf, self.pairs, self.pair_window)
            loss = loss + multilabel_loss(logits_BP, target_BP)
        patch_loss = region_loss = None
        if self.patch_labels or self.region_labels:
            logits_BLK = self.patch_head(feats.features_BLD)
        if self.patch_labels:
            patch_loss = patch_word_loss(logits_BLK, feats.valid_BL, target_BV[:, self.word_ids_K])
            loss = loss + self.patch_labels * patch_loss
        if self.region_labels and region_BLK is not None:
            region_loss = region_word_loss(logits_BLK, feats.valid_BL, region_BLK)
            loss = loss + self.region_labels * region_loss
        return CaptionClassOutput(loss, logits_BV, target_BV, patch_loss, region_loss)

    @torch.no_grad()
    def batch_score(self, out: CaptionClassOutput) -> float:
        """R-precision: of each caption's k weighted tokens, the share among the image's k highest logits."""
        hits = []
        for logits_V, target_V in zip(out.logits_BV, out.target_BV):
            wanted = target_V.nonzero().flatten()
            if len(wanted):
                top = logits_V.topk(len(wanted)).indices
                hits.append(torch.isin(top, wanted).float().mean().item())
        return sum(hits) / max(len(hits), 1)
