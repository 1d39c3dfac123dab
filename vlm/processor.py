"""``VLMProcessor``: text with ``<image>`` markers + images -> everything ``ConceptMoEVLM.forward`` needs.

A transformers ``ProcessorMixin`` (tokenizer + :class:`vision_tower.ImageProcessor` + chat template):
``processor(text=[...], images=[[...], ...], return_tensors="pt")``, ``apply_chat_template``, ``save_pretrained`` /
``from_pretrained``, and ``AutoProcessor`` for a folder holding an exported ``ConceptMoEVLM`` (``import vlm``
registers it). ``save_pretrained`` writes the tokenizer's files, ``processor_config.json`` (the image processor's
settings under ``image_processor``) and ``chat_template.jinja``; folders written before (``vlm_processor_config.json``
+ ``image_processor_config.json``) still load.

Any HF fast tokenizer works; ``<image>`` and the chat tokens (``data_pipelines.chat.CHAT_TOKENS``) are added as
special tokens when missing (``data_pipelines.tokenizer.add_vlm_tokens``), so the model's vocabulary must cover
``len(processor.tokenizer)`` (``ConceptMoEVLMConfig(image_token_id=processor.image_token_id)`` and a
``text_config.vocab_size`` at least that large). The chat template defaults to
``data_pipelines.chat.CHAT_TEMPLATE``; ``processor.chat_template`` can be edited and is saved with the processor.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from PIL import Image
from transformers import AutoTokenizer, BatchFeature, ProcessorMixin
from transformers.image_utils import load_image
from transformers.utils import PROCESSOR_NAME

from data_pipelines.chat import CHAT_TEMPLATE, END_OF_TURN, interleave_ids
from data_pipelines.tokenizer import IMAGE_TOKEN, add_vlm_tokens, pad_id, special_affixes
from vision_tower import ImageProcessor
from vlm.hub_code import add_auto_map, auto_map_entry, check_folder, write_code

LEGACY_PROCESSOR_FILE = "vlm_processor_config.json"  # what save_pretrained wrote before processor_config.json


class VLMProcessor(ProcessorMixin):
    image_token = IMAGE_TOKEN
    model_input_names = [
        "input_ids",
        "attention_mask",
        "modality_ids",
        "patches",
        "patch_coord",
        "patch_valid",
        "grid_hw",
        "num_tokens",
    ]

    def __init__(self, tokenizer, image_processor: ImageProcessor | None = None, chat_template: str | None = None):
        image_token_id = add_vlm_tokens(tokenizer)
        super().__init__(
            tokenizer,
            image_processor if image_processor is not None else ImageProcessor(),
            chat_template=CHAT_TEMPLATE if chat_template is None else chat_template,
        )
        self.image_token_id = image_token_id
        self.end_of_turn_id = tokenizer.convert_tokens_to_ids(END_OF_TURN)
        self.prefix_ids, self.suffix_ids = special_affixes(tokenizer)

    @property
    def special_token_ids(self) -> dict:
        """``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` for the model's config and generation config:
        generation stops at ``<|end|>`` (the end of an assistant turn) or the tokenizer's end of text."""
        eos = [self.end_of_turn_id]
        if self.tokenizer.eos_token_id not in (None, self.end_of_turn_id):
            eos.append(self.tokenizer.eos_token_id)
        return {"bos_token_id": self.tokenizer.bos_token_id, "eos_token_id": eos, "pad_token_id": self.pad_token_id}

    @property
    def pad_token_id(self) -> int:
        return pad_id(self.tokenizer)

    def row(self, text: str, images: Sequence, num_tokens: list[int], add_special_tokens: bool) -> list[int]:
        """One row: the text between markers and each marker's image slots through
        ``data_pipelines.chat.interleave_ids`` (the rule training encodes with), wrapped in the tokenizer's own
        special tokens (its post-processor's, e.g. BOS, or [CLS] ... [SEP])."""
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(images):
            raise ValueError(
                f"text has {len(pieces) - 1} {self.image_token} markers but {len(images)} images: {text[:80]!r}"
            )
        sequence: list[str | int] = [pieces[0]]
        for piece, n in zip(pieces[1:], num_tokens):
            sequence += [n, piece]
        body, _, _ = interleave_ids(sequence, self._text_ids, self.image_token_id)
        ids = (list(self.prefix_ids) if add_special_tokens else []) + body
        return ids + (list(self.suffix_ids) if add_special_tokens else [])

    def _text_ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

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
            return [[_as_image(img) for img in row] for row in images]
        markers = [t.count(self.image_token) for t in texts]
        if sum(markers) != len(images):
            raise ValueError(f"{len(images)} images given flat, but the texts hold {sum(markers)} {self.image_token}")
        rows, start = [], 0
        for n in markers:
            rows.append([_as_image(img) for img in images[start : start + n]])
            start += n
        return rows

    def __call__(
        self,
        text: str | Sequence[str] | None = None,
        images: Sequence | None = None,
        return_tensors: str | None = "pt",
        padding: str | bool = "longest",
        padding_side: str | None = None,
        add_special_tokens: bool = True,
        max_length: int | None = None,
        videos=None,
        audio=None,
        **kwargs,
    ) -> BatchFeature:
        """``images[i]`` is the list of images of row i (matched in order to its ``<image>`` markers), or a
        flat list matched to the markers of all rows in order; an image is a PIL image, or a path / URL.

        Returns input_ids, attention_mask, modality_ids (1 on image slots), and for the images of all rows
        in order: patches, patch_coord, patch_valid, grid_hw, num_tokens. ``padding="max_length"`` pads to
        ``max_length``; a longer row raises rather than cutting an image in half. ``padding_side`` defaults
        to the tokenizer's. Role and end-of-turn tokens in the text (a rendered chat template) are special
        tokens: they encode as their own ids.
        """
        if unsupported := sorted(k for k, v in kwargs.items() if v not in (None, False)):
            raise TypeError(f"VLMProcessor does not take {', '.join(unsupported)}")
        if videos is not None or audio is not None:
            raise ValueError("VLMProcessor handles text and images only (got videos or audio)")
        if text is None:
            raise ValueError("VLMProcessor needs text: one <image> marker per image, where the image goes")
        if return_tensors not in ("pt", None):
            raise ValueError(f"return_tensors={return_tensors!r} is not supported; use 'pt'")
        padding = "longest" if padding is True else padding  # True: HF callers (the pipelines, batched text)
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

    def save_pretrained(self, save_directory: str | os.PathLike, push_to_hub: bool = False, **kwargs) -> list[str]:
        """``ProcessorMixin.save_pretrained``, plus the code and ``auto_map`` entries that let ``AutoProcessor``
        load the folder without this repository (``trust_remote_code=True``; ``vlm.hub_code``)."""
        if push_to_hub:
            raise ValueError(
                "save_pretrained(push_to_hub=True) would upload before the processor's code is written: "
                "use processor.push_to_hub(repo_id), or save to a folder and upload it"
            )
        out = super().save_pretrained(save_directory, **kwargs)
        write_code(save_directory, [type(self).__module__, type(self.image_processor).__module__])
        config = os.path.join(str(save_directory), PROCESSOR_NAME)
        add_auto_map(config, {"AutoProcessor": auto_map_entry(type(self))})
        add_auto_map(config, {"AutoImageProcessor": auto_map_entry(type(self.image_processor))}, "image_processor")
        return out

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs) -> VLMProcessor:
        """``ProcessorMixin.from_pretrained`` (``processor_config.json``, the tokenizer's files,
        ``chat_template.jinja``), or a folder saved before the processor was a transformers one
        (``vlm_processor_config.json`` + the tokenizer's files + ``image_processor_config.json``; it gets the
        default chat template)."""
        check_folder(pretrained_model_name_or_path)
        folder = os.path.join(str(pretrained_model_name_or_path), kwargs.get("subfolder", ""))
        if os.path.isdir(folder) and not os.path.isfile(os.path.join(folder, PROCESSOR_NAME)):
            if not os.path.isfile(os.path.join(folder, LEGACY_PROCESSOR_FILE)):
                raise FileNotFoundError(
                    f"{folder} holds no {PROCESSOR_NAME} (nor the older {LEGACY_PROCESSOR_FILE}): "
                    "not a VLMProcessor.save_pretrained folder"
                )
            return cls(
                AutoTokenizer.from_pretrained(folder),
                ImageProcessor.from_pretrained(folder),
                chat_template=kwargs.get("chat_template"),
            )
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)


def _as_image(image):
    """A PIL image as it is; a path or URL (what chat messages may hold) loaded; anything else left to the image
    processor's type check."""
    return load_image(image) if isinstance(image, str) else image
