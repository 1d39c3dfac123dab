"""``VLMProcessor``: text with ``<image>`` markers + images -> everything ``ConceptMoEVLM.forward`` needs.

HF conventions: ``processor(text=[...], images=[[...], ...], return_tensors="pt")``, ``save_pretrained`` /
``from_pretrained``. Any HF fast tokenizer works; ``<image>`` is added as a special token when missing, so the
model's vocabulary must cover ``len(processor.tokenizer)`` (``ConceptMoEVLMConfig(image_token_id=
processor.image_token_id)`` and a ``text_config.vocab_size`` at least that large).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import torch
from PIL import Image
from transformers import AutoTokenizer, BatchFeature

from data_pipelines.tokenizer import IMAGE_TOKEN, special_affixes
from vision_tower import ImageProcessor

PROCESSOR_FILE = "vlm_processor_config.json"


class VLMProcessor:
    image_token = IMAGE_TOKEN

    def __init__(self, tokenizer, image_processor: ImageProcessor | None = None):
        if self.image_token not in tokenizer.get_vocab():
            tokenizer.add_tokens([self.image_token], special_tokens=True)
        self.tokenizer = tokenizer
        self.image_processor = image_processor or ImageProcessor()
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.prefix_ids, self.suffix_ids = special_affixes(tokenizer)

    @property
    def pad_token_id(self) -> int:
        tok = self.tokenizer
        for candidate in (tok.pad_token_id, tok.eos_token_id):
            if candidate is not None:
                return candidate
        return 0

    def row(self, text: str, images: Sequence, num_tokens: list[int], add_special_tokens: bool) -> list[int]:
        """One row: text pieces tokenised separately, each marker replaced by its image's slots, wrapped in the
        tokenizer's own special tokens (its post-processor's, e.g. BOS, or [CLS] ... [SEP])."""
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(images):
            raise ValueError(
                f"text has {len(pieces) - 1} {self.image_token} markers but {len(images)} images: {text[:80]!r}"
            )
        ids = list(self.prefix_ids) if add_special_tokens else []
        for i, piece in enumerate(pieces):
            if piece:
                ids += self.tokenizer(piece, add_special_tokens=False)["input_ids"]
            if i < len(images):
                ids += [self.image_token_id] * num_tokens[i]
        return ids + (list(self.suffix_ids) if add_special_tokens else [])

    def rows_of_images(self, texts: list[str], images) -> list[list]:
        """``images`` per row (a list of lists), or flat in marker order across the rows (HF convention)."""
        if images is None:
            return [[] for _ in texts]
        if isinstance(images, Image.Image):
            images = [images]
        images = list(images)
        if all(isinstance(row, (list, tuple)) for row in images):
            if len(images) != len(texts):
                raise ValueError(f"got {len(texts)} texts but image lists for {len(images)} rows")
            return [list(row) for row in images]
        markers = [t.count(self.image_token) for t in texts]
        if sum(markers) != len(images):
            raise ValueError(f"{len(images)} images given flat, but the texts hold {sum(markers)} {self.image_token}")
        rows, start = [], 0
        for n in markers:
            rows.append(images[start : start + n])
            start += n
        return rows

    def __call__(
        self,
        text: str | Sequence[str],
        images: Sequence | None = None,
        return_tensors: str = "pt",
        padding: str = "longest",
        padding_side: str | None = None,
        add_special_tokens: bool = True,
        max_length: int | None = None,
    ) -> BatchFeature:
        """``images[i]`` is the list of images of row i (matched in order to its ``<image>`` markers), or a
        flat list matched to the markers of all rows in order.

        Returns input_ids, attention_mask, modality_ids (1 on image slots), and for the images of all rows
        in order: patches, patch_coord, patch_valid, grid_hw, num_tokens. ``padding="max_length"`` pads to
        ``max_length``; a longer row raises rather than cutting an image in half. ``padding_side`` defaults
        to the tokenizer's.
        """
        if return_tensors != "pt":
            raise ValueError(f"return_tensors={return_tensors!r} is not supported; use 'pt'")
        padding_side = padding_side or getattr(self.tokenizer, "padding_side", "right")
        if padding_side not in ("right", "left"):
            raise ValueError(f"padding_side={padding_side!r} is invalid: use 'right' or 'left'")
        if padding not in ("longest", "max_length") or (padding == "max_length" and max_length is None):
            raise ValueError(f"padding={padding!r} is invalid: use 'longest', or 'max_length' with max_length")
        texts = [text] if isinstance(text, str) else list(text)
        images = self.rows_of_images(texts, images)
        pixel = self.image_processor([img for row_images in images for img in row_images])
        counts = pixel["num_tokens"].tolist()
        rows, start = [], 0
        for row_text, row_images in zip(texts, images):
            rows.append(self.row(row_text, row_images, counts[start : start + len(row_images)], add_special_tokens))
            start += len(row_images)
        longest = max(len(r) for r in rows)
        if max_length is not None and longest > max_length:
            raise ValueError(f"a row has {longest} tokens (images included), more than max_length={max_length}")
        width = max_length if padding == "max_length" else longest
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            span = slice(0, len(r)) if padding_side == "right" else slice(width - len(r), width)
            input_ids[i, span] = torch.tensor(r, dtype=torch.long)
            attention_mask[i, span] = 1
        modality_ids = ((input_ids == self.image_token_id) & attention_mask.bool()).long()
        data = {"input_ids": input_ids, "attention_mask": attention_mask, "modality_ids": modality_ids, **pixel}
        return BatchFeature(data=data)

    def decode(self, ids, **kwargs) -> str:
        return self.tokenizer.decode(ids, **kwargs)

    def batch_decode(self, ids, **kwargs) -> list[str]:
        return self.tokenizer.batch_decode(ids, **kwargs)

    def save_pretrained(self, save_directory: str) -> None:
        os.makedirs(save_directory, exist_ok=True)
        self.tokenizer.save_pretrained(save_directory)
        self.image_processor.save_pretrained(save_directory)
        with open(os.path.join(save_directory, PROCESSOR_FILE), "w") as f:
            json.dump({"processor_class": type(self).__name__, "image_token": self.image_token}, f, indent=2)

    @classmethod
    def from_pretrained(cls, directory: str) -> VLMProcessor:
        if not os.path.exists(os.path.join(directory, PROCESSOR_FILE)):
            raise FileNotFoundError(f"{directory} holds no {PROCESSOR_FILE}: not a VLMProcessor.save_pretrained folder")
        return cls(AutoTokenizer.from_pretrained(directory), ImageProcessor.from_pretrained(directory))
