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
from transformers import AutoTokenizer, BatchFeature

from vision_tower import ImageProcessor

PROCESSOR_FILE = "vlm_processor_config.json"


class VLMProcessor:
    image_token = "<image>"

    def __init__(self, tokenizer, image_processor: ImageProcessor | None = None):
        if self.image_token not in tokenizer.get_vocab():
            tokenizer.add_tokens([self.image_token], special_tokens=True)
        self.tokenizer = tokenizer
        self.image_processor = image_processor or ImageProcessor()
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)

    @property
    def pad_token_id(self) -> int:
        tok = self.tokenizer
        for candidate in (tok.pad_token_id, tok.eos_token_id):
            if candidate is not None:
                return candidate
        return 0

    def row(self, text: str, images: Sequence, num_tokens: list[int], add_special_tokens: bool) -> list[int]:
        """One row: text pieces tokenised separately, each marker replaced by its image's slots."""
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(images):
            raise ValueError(
                f"text has {len(pieces) - 1} {self.image_token} markers but {len(images)} images: {text[:80]!r}"
            )
        ids = []
        if add_special_tokens and self.tokenizer.bos_token_id is not None:
            ids.append(self.tokenizer.bos_token_id)
        for i, piece in enumerate(pieces):
            if piece:
                ids += self.tokenizer(piece, add_special_tokens=False)["input_ids"]
            if i < len(images):
                ids += [self.image_token_id] * num_tokens[i]
        return ids

    def __call__(
        self,
        text: str | Sequence[str],
        images: Sequence | None = None,
        return_tensors: str = "pt",
        padding_side: str = "right",
        add_special_tokens: bool = True,
        max_length: int | None = None,
    ) -> BatchFeature:
        """``images[i]`` is the list of images of row i (matched in order to its ``<image>`` markers).

        Returns input_ids, attention_mask, modality_ids (1 on image slots), and for the images of all rows
        in order: patches, patch_coord, patch_valid, grid_hw, num_tokens. ``max_length`` raises on longer
        rows rather than cutting an image in half.
        """
        if return_tensors != "pt":
            raise ValueError(f"return_tensors={return_tensors!r} is not supported; use 'pt'")
        if padding_side not in ("right", "left"):
            raise ValueError(f"padding_side={padding_side!r} is invalid: use 'right' or 'left'")
        texts = [text] if isinstance(text, str) else list(text)
        if images is None:
            images = [[] for _ in texts]
        elif isinstance(text, str) and (len(images) == 0 or not isinstance(images[0], (list, tuple))):
            images = [images]
        if len(images) != len(texts):
            raise ValueError(f"got {len(texts)} texts but images for {len(images)} rows")
        flat_images = [img for row_images in images for img in row_images]
        pixel = self.image_processor(flat_images)
        counts = pixel["num_tokens"].tolist()
        rows, start = [], 0
        for row_text, row_images in zip(texts, images):
            rows.append(self.row(row_text, row_images, counts[start : start + len(row_images)], add_special_tokens))
            start += len(row_images)
        longest = max(len(r) for r in rows)
        if max_length is not None and longest > max_length:
            raise ValueError(f"a row has {longest} tokens (images included), more than max_length={max_length}")
        input_ids = torch.full((len(rows), longest), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, r in enumerate(rows):
            span = slice(0, len(r)) if padding_side == "right" else slice(longest - len(r), longest)
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
