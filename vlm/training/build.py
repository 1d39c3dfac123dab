"""The model and processor a training config describes: ``model.preset`` / ``model.overrides`` on a fresh model, or
``model.init_from`` a saved ConceptMoE folder; used by the training loop and by the export."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from data_pipelines.tokenizer import load_tokenizer
from vision_tower import ImageProcessor
from vlm.backbone.config import CHUNKING_SETTINGS, rename_legacy_fields
from vlm.model import ConceptMoEVLM
from vlm.processor import VLMProcessor
from vlm.training.config import ConfigError

# What ``model.overrides`` may change on a loaded checkpoint: the chunking settings ``set_chunking`` takes (training
# fields that never change a weight shape).
# plus the VLM's training switches (stage 2 unfreezes what stage 1 froze).
VLM_OVERRIDABLE = ("freeze_vision", "freeze_backbone", "modality_boundaries")
INIT_OVERRIDABLE = (*CHUNKING_SETTINGS, *VLM_OVERRIDABLE)


def init_from_checkpoint(config: dict, processor: VLMProcessor) -> ConceptMoEVLM:
    """``model.init_from``: a ``ConceptMoEVLM`` folder (training continues from it), or a text-only
    ``ConceptMoEForCausalLM`` folder — e.g. a converted MoE (``scripts/convert_to_conceptmoe.py``) — which gets a
    fresh vision tower and projector (``ConceptMoEVLM.from_text_model``, the paper's recipe)."""
    path = Path(config["model"]["init_from"])
    try:
        model_type = json.loads((path / "config.json").read_text())["model_type"]
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"model.init_from={str(path)!r} is not a saved model folder ({type(err).__name__})") from None
    if model_type == ConceptMoEVLM.config_class.model_type:
        model = ConceptMoEVLM.from_pretrained(str(path))
        if model.config.image_token_id != processor.image_token_id:
            raise ConfigError(
                f"model.init_from has image_token_id {model.config.image_token_id} but the tokenizer's <image> is "
                f"{processor.image_token_id}: set data.tokenizer to the checkpoint's tokenizer"
            )
    elif model_type == "conceptmoe":
        model = ConceptMoEVLM.from_text_model(
            str(path), image_token_id=processor.image_token_id, max_patches=config["data"]["max_patches"]
        )
    else:
        raise ConfigError(f"model.init_from={str(path)!r} holds a {model_type!r} model, not a ConceptMoE one")
    overrides = rename_legacy_fields(config["model"]["overrides"], "model.overrides")
    for name in overrides:
        if name not in INIT_OVERRIDABLE:
            raise ConfigError(
                f"model.overrides.{name} cannot change a loaded checkpoint (model.init_from); allowed: "
                + ", ".join(INIT_OVERRIDABLE)
            )
    vlm_switches = {k: bool(overrides.pop(k)) for k in VLM_OVERRIDABLE if k in overrides}
    try:
        model.set_chunking(**overrides)
    except ValueError as err:
        raise ConfigError(f"model.overrides: {err}") from None
    for name, value in vlm_switches.items():
        setattr(model.config, name, value)
    model.apply_freezing()
    return model


def build_model(config: dict) -> tuple[ConceptMoEVLM, VLMProcessor]:
    """The model and its processor from ``model.preset`` / ``model.overrides`` (or ``model.init_from``) and the
    tokenizer; the model carries the tokenizer's bos / eos (``<|end|>`` and end of text) / pad ids."""
    data = config["data"]
    processor = VLMProcessor(load_tokenizer(data["tokenizer"]), ImageProcessor(max_patches=data["max_patches"]))
    torch.manual_seed(config["train"]["seed"])  # identical initial weights on every rank
    if config["model"]["init_from"]:
        model = init_from_checkpoint(config, processor)
        model.set_special_token_ids(**processor.special_token_ids)
        return model, processor
    model = ConceptMoEVLM.from_preset(
        config["model"]["preset"],
        image_token_id=processor.image_token_id,
        vocab_size=len(processor.tokenizer),
        max_patches=data["max_patches"],
        **{**processor.special_token_ids, **config["model"]["overrides"]},
    )
    return model, processor
