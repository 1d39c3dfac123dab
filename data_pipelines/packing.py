"""Decoded samples -> token documents -> fixed-length packed rows -> the batch ``ConceptMoEVLM.forward`` takes.

A document is ``prefix + segments + suffix + eos``: the tokenizer's own special tokens around it
(``data_pipelines.tokenizer.special_affixes``: BOS, or [CLS] ... [SEP], or none), each run of consecutive text
segments tokenised as one text (the chat template renders them as one; a literal ``<image>`` in text stays text),
each image a span of ``num_tokens_for(image)`` slots holding ``image_token_id`` (``modality_ids == 1``), and one eos
unless the suffix already ends with it.

Packing rule (greedy next-fit, deterministic, no look-ahead):

* ``split_documents=False`` (default): rows hold whole documents. A document that does not fit the space left
  closes the row (the rest is padding) and opens the next one; a document longer than ``seq_len`` can never be
  placed and is skipped as ``too_long``. Right for VLM data: a question never loses its image or context.
* ``split_documents=True``: a document fills the row and runs on into the next one, split only at a text
  position or between image spans (an image's slots never straddle two rows); the continuation attends within
  its new row only. Only a document holding an image span longer than ``seq_len`` is ``too_long``.

Rows carry ``doc_ids`` (0, 1, 2, ... per document piece in the row; padding takes the next id), positions
restarting at 0 for every piece, and labels = input ids with -100 on image slots, on padding and on the first
token of every piece (the token before it belongs to another document, or there is none).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from data_pipelines.chat import interleave_ids
from data_pipelines.schema import MAX_IMAGE_PIXELS, Modality, Sample, SkipSample, open_image
from data_pipelines.tokenizer import CHAT_TOKENS, END_OF_TURN, ROLE_TOKENS, pad_id, special_affixes

IGNORE = -100
# What the loss covers (``labels``): ``auto`` the assistant turns of a conversation and every text token of any other
# sample; ``all`` every text token of every sample (role headers too); ``assistant`` the assistant turns only (other
# samples add context but no loss).
LOSS_ON = ("auto", "all", "assistant")


class TokenEncoder:
    """A tokenizer's text -> ids, with its special affixes and eos / pad ids worked out once.

    Takes an HF tokenizer, or a plain one with ``encode(text) -> ids`` and ``eos_id`` / ``pad_id`` attributes
    (``local_text.ByteTokenizer``)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.hf = callable(tokenizer) and hasattr(tokenizer, "get_vocab")
        if self.hf:
            self.prefix, self.suffix = special_affixes(tokenizer)
            self.eos_id, self.pad_id = tokenizer.eos_token_id, pad_id(tokenizer)
        else:
            self.prefix, self.suffix = [], []
            self.eos_id, self.pad_id = getattr(tokenizer, "eos_id", None), getattr(tokenizer, "pad_id", 0)
        self._split_special = True

    def text_ids(self, text: str) -> list[int]:
        if not self.hf:
            return list(self.tokenizer.encode(text))
        if self._split_special:  # special-token strings inside the text are text, never an image slot or eos
            try:
                return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            except TypeError:
                self._split_special = False
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def chat_ids(self) -> dict[str, int]:
        """Ids of the chat template's special tokens (``data_pipelines.chat``); the tokenizer must have them."""
        if not hasattr(self, "_chat_ids"):
            vocab = self.tokenizer.get_vocab() if self.hf else {}
            missing = [t for t in CHAT_TOKENS if t not in vocab]
            if missing:
                raise ValueError(
                    f"the tokenizer has no {missing}: conversations need the chat tokens (data_pipelines.chat; "
                    "VLMProcessor adds them, and the shipped tokenizer has them)"
                )
            self._chat_ids = {t: vocab[t] for t in CHAT_TOKENS}
        return self._chat_ids

    def closing(self) -> list[int]:
        """What ends a document: the tokenizer's suffix, then eos unless the suffix already ends with it."""
        tail = list(self.suffix)
        if self.eos_id is not None and (not tail or tail[-1] != self.eos_id):
            tail.append(self.eos_id)
        return tail


@dataclass
class EncodedDoc:
    key: str
    input_ids: list[int]
    modality_ids: list[int]  # 0 text, 1 image slot
    images: list  # decoded PIL images, in document order
    num_tokens: list[int]  # slots of each image
    image_starts: list[int]  # position of each image's first slot
    targets: list[bool] | None = None  # where the loss is (labels = ids there, -100 elsewhere); None: every text token

    def __post_init__(self):
        if self.targets is None:
            self.targets = [m == Modality.TEXT for m in self.modality_ids]

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_text_tokens(self) -> int:
        return len(self.input_ids) - sum(self.num_tokens)


class _DocBuilder:
    """Accumulates one token document: ids, modality, loss targets, images and where their slots start."""

    def __init__(self, key: str, image_processor, image_token_id: int, max_image_pixels: int):
        self.key, self.image_processor, self.image_token_id = key, image_processor, image_token_id
        self.max_image_pixels = max_image_pixels
        self.ids, self.modality, self.targets = [], [], []
        self.images, self.num_tokens, self.starts = [], [], []

    def text(self, ids: list[int], target: bool) -> None:
        self.ids += ids
        self.modality += [Modality.TEXT] * len(ids)
        self.targets += [target] * len(ids)

    def open(self, data: bytes) -> int:
        """Decode one image, keep it, return its slot count (``image_processor.num_tokens_for``)."""
        image = open_image(data, self.max_image_pixels)
        try:
            n = self.image_processor.num_tokens_for(image)
        except Exception as err:  # an image PIL opens but the processor rejects (e.g. 0 x N)
            raise SkipSample("bad_image", f"{self.key}: {type(err).__name__}: {err}") from None
        self.images.append(image)
        self.num_tokens.append(n)
        return n

    def segments(self, segments, enc: TokenEncoder, target: bool) -> None:
        """A turn's or a sample's segments through :func:`interleave_ids`, the text under ``target``."""
        pieces = [seg.text if seg.image is None else self.open(seg.image) for seg in segments]
        ids, modality, starts = interleave_ids(pieces, enc.text_ids, self.image_token_id)
        self.starts += [len(self.ids) + s for s in starts]
        self.ids += ids
        self.modality += modality
        self.targets += [target and m == Modality.TEXT for m in modality]

    def done(self) -> EncodedDoc:
        return EncodedDoc(self.key, self.ids, self.modality, self.images, self.num_tokens, self.starts, self.targets)


def encode_sample_tokens(
    sample: Sample,
    tokenizer,
    image_processor,
    image_token_id: int,
    max_image_pixels: int = MAX_IMAGE_PIXELS,
    loss_on: str = "auto",
) -> EncodedDoc:
    """One decoded sample -> its token document. Raises SkipSample (bad_image / image_too_large).

    ``tokenizer`` is an HF tokenizer or a :class:`TokenEncoder` (faster: affixes computed once). Slot counts come
    from the image size alone (``image_processor.num_tokens_for``); pixels are patchified at collation. A
    conversation goes through :func:`encode_conversation`; ``loss_on`` (``LOSS_ON``) sets the loss targets.
    """
    if loss_on not in LOSS_ON:
        raise ValueError(f"loss_on={loss_on!r} is invalid: allowed values are {LOSS_ON}")
    enc = tokenizer if isinstance(tokenizer, TokenEncoder) else TokenEncoder(tokenizer)
    if sample.is_conversation:
        return encode_conversation(sample, enc, image_processor, image_token_id, max_image_pixels, loss_on)
    doc = _DocBuilder(sample.key, image_processor, image_token_id, max_image_pixels)
    target = loss_on != "assistant"
    doc.text(list(enc.prefix), target)
    doc.segments(sample.segments, enc, target)
    doc.text(enc.closing(), target)
    return doc.done()


def encode_conversation(
    sample: Sample,
    enc: TokenEncoder,
    image_processor,
    image_token_id: int,
    max_image_pixels: int = MAX_IMAGE_PIXELS,
    loss_on: str = "auto",
) -> EncodedDoc:
    """A conversation through the chat template (``data_pipelines.chat``): per turn its role token, its content,
    ``<|end|>``; the same ids ``VLMProcessor`` gives the rendered conversation. Targets: with ``auto`` /
    ``assistant`` the content of the assistant turns and their ``<|end|>`` only (not system or user text, not image
    slots, not role tokens); with ``all`` every text token."""
    chat = enc.chat_ids()
    everything = loss_on == "all"
    doc = _DocBuilder(sample.key, image_processor, image_token_id, max_image_pixels)
    doc.text(list(enc.prefix), everything)
    for turn in sample.turns:
        answer = everything or turn.role == "assistant"
        doc.text([chat[ROLE_TOKENS[turn.role]]], everything)
        doc.segments(turn.segments, enc, answer)
        doc.text([chat[END_OF_TURN]], answer)
    doc.text(enc.closing(), everything)
    return doc.done()


@dataclass
class Row:
    """One packed row (unpadded lists) and where the stream stands after it: ``resume = (tag, offset)`` means the
    next row starts at token ``offset`` of the document added with ``tag``; ``offset == len(doc)`` means the
    document after it."""

    input_ids: list[int] = field(default_factory=list)
    modality_ids: list[int] = field(default_factory=list)
    doc_ids: list[int] = field(default_factory=list)
    position_ids: list[int] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    images: list = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    pieces: int = 0
    resume: tuple = (None, 0)

    def __len__(self) -> int:
        return len(self.input_ids)

    def place(self, doc: EncodedDoc, start: int, stop: int) -> None:
        ids, mods, targets = doc.input_ids[start:stop], doc.modality_ids[start:stop], doc.targets[start:stop]
        self.labels += [IGNORE] + [t if on else IGNORE for t, on in zip(ids[1:], targets[1:])]
        self.input_ids += ids
        self.modality_ids += mods
        self.doc_ids += [self.pieces] * len(ids)
        self.position_ids += range(len(ids))
        self.pieces += 1
        for image, start_i, n in zip(doc.images, doc.image_starts, doc.num_tokens):
            if start <= start_i < stop:
                self.images.append(image)
                self.num_tokens.append(n)


class Packer:
    """Greedy next-fit packing of :class:`EncodedDoc` into rows of ``seq_len`` (rule: module docstring).

    ``add`` is a generator of the rows it completes, each yielded as soon as it closes (before anything more is
    placed), so a consumer that stops there knows the stream position exactly (``Row.resume``)."""

    def __init__(self, seq_len: int, split_documents: bool = False):
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        self.seq_len, self.split_documents = seq_len, split_documents
        self.row = Row()
        self.rows = 0  # rows closed so far
        self.real_tokens = 0  # non-padding tokens in those rows

    @property
    def efficiency(self) -> float:
        """Real tokens / row capacity over the rows closed so far."""
        return self.real_tokens / max(1, self.rows * self.seq_len)

    def fits(self, doc: EncodedDoc) -> bool:
        """False when the document can never be placed (it is then ``too_long``)."""
        if not self.split_documents:
            return 0 < len(doc) <= self.seq_len
        return 0 < len(doc) and max(doc.num_tokens, default=0) <= self.seq_len

    def split_point(self, doc: EncodedDoc, start: int, limit: int) -> int:
        """The last position <= ``limit`` at which ``doc`` may be cut (not inside an image span), or ``start``."""
        for begin, n in zip(doc.image_starts, doc.num_tokens):
            if begin < limit < begin + n:
                return max(start, begin)
        return limit

    def add(self, doc: EncodedDoc, tag=None, start: int = 0) -> Iterator[Row]:
        if not self.fits(doc):
            raise SkipSample("too_long", f"{doc.key}: {len(doc)} tokens do not fit rows of {self.seq_len}")
        pos = start
        while pos < len(doc):
            room = self.seq_len - len(self.row)
            if len(doc) - pos <= room:
                stop = len(doc)
            elif self.split_documents:
                stop = self.split_point(doc, pos, pos + room)
            else:
                stop = pos
            if stop > pos:
                self.row.place(doc, pos, stop)
                pos = stop
            elif not len(self.row):  # fits() rules this out; never close an empty row
                raise RuntimeError(f"{doc.key}: nothing of the document fits an empty row at token {pos}")
            if len(self.row) == self.seq_len or pos < len(doc):  # full, or the rest goes to the next row
                yield self._close((tag, pos))

    def flush(self, tag=None) -> Row | None:
        """Close the open row (end of stream); None when it is empty."""
        return self._close((tag, 0)) if len(self.row) else None

    def _close(self, resume: tuple) -> Row:
        row, self.row = self.row, Row()
        row.resume = resume
        self.rows += 1
        self.real_tokens += len(row)
        return row


def collate_rows(rows: Sequence[Row], seq_len: int, pad_id: int, image_processor) -> dict[str, torch.Tensor]:
    """Rows -> ``ConceptMoEVLM.forward`` inputs, all ``[B, seq_len]`` long tensors plus the patches of every
    image of all rows in order (``patches`` [I, L, P*P*3], ``patch_coord`` [I, L, 2], ``patch_valid`` [I, L],
    ``grid_hw`` [I, 2]; I may be 0)."""
    b = len(rows)
    out = {
        "input_ids": torch.full((b, seq_len), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((b, seq_len), dtype=torch.long),
        "labels": torch.full((b, seq_len), IGNORE, dtype=torch.long),
        "doc_ids": torch.zeros((b, seq_len), dtype=torch.long),
        "position_ids": torch.zeros((b, seq_len), dtype=torch.long),
        "modality_ids": torch.zeros((b, seq_len), dtype=torch.long),
    }
    for i, row in enumerate(rows):
        n = len(row)
        out["input_ids"][i, :n] = torch.tensor(row.input_ids, dtype=torch.long)
        out["attention_mask"][i, :n] = 1
        out["labels"][i, :n] = torch.tensor(row.labels, dtype=torch.long)
        out["doc_ids"][i, :n] = torch.tensor(row.doc_ids, dtype=torch.long)
        out["doc_ids"][i, n:] = row.pieces  # padding: a segment of its own
        out["position_ids"][i, :n] = torch.tensor(row.position_ids, dtype=torch.long)
        out["modality_ids"][i, :n] = torch.tensor(row.modality_ids, dtype=torch.long)
    pixel = image_processor([image for row in rows for image in row.images])
    expected = [n for row in rows for n in row.num_tokens]
    if pixel["num_tokens"].tolist() != expected:  # the slots were sized by the same processor: a bug if not
        raise RuntimeError(f"image slots {expected} disagree with the processor's {pixel['num_tokens'].tolist()}")
    out.update({k: pixel[k] for k in ("patches", "patch_coord", "patch_valid", "grid_hw")})
    return out
