"""The model and processor a training config describes: ``model.preset`` / ``model.overrides`` on a fresh model, or
``model.init_from`` a saved ConceptMoE folder; used by the training loop and by the export. ``check_data``: before
the model is built, that the shards hold a usable sample."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from data_pipelines.loader import loader_from_config
from data_pipelines.tokenizer import load_tokenizer
from vision_tower import ImageProcessor
from vlm.backbone.config import rename_legacy_fields
from vlm.model import ConceptMoEVLM
from vlm.processor import VLMProcessor
from vlm.training.config import VLM_CHUNKING, VLM_SWITCHES, ConfigError, DataConfig, first_line


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
    # names checked by load_config (config.check_model: INIT_OVERRIDABLE only); values by set_chunking
    overrides = rename_legacy_fields(config["model"]["overrides"], "model.overrides")
    vlm_switches = {k: bool(overrides.pop(k)) for k in VLM_SWITCHES if k in overrides}
    vlm_chunking = {k: overrides.pop(k) for k in VLM_CHUNKING if k in overrides}
    try:
        model.set_chunking(**vlm_chunking, **overrides)
    except ValueError as err:
        raise ConfigError(f"model.overrides: {err}") from None
    for name, value in vlm_switches.items():
        setattr(model.config, name, value)
    model.apply_freezing()
    return model


def build_processor(config: dict) -> VLMProcessor:
    """``data.tokenizer`` (the shipped one when unset) and an image processor of ``data.max_patches``."""
    try:
        tokenizer = load_tokenizer(config["data"]["tokenizer"])
    except (OSError, ValueError) as err:
        raise ConfigError(f"data.tokenizer: {first_line(err)}") from None
    return VLMProcessor(tokenizer, ImageProcessor(max_patches=config["data"]["max_patches"]))


def build_model(config: dict) -> tuple[ConceptMoEVLM, VLMProcessor]:
    """The model and its processor from ``model.preset`` / ``model.overrides`` (or ``model.init_from``) and the
    tokenizer; the model carries the tokenizer's bos / eos (``<|end|>`` and end of text) / pad ids."""
    data = config["data"]
    processor = build_processor(config)
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


def _no_sample_message(key: str, loader) -> str:
    """Why ``loader`` gave no batch: its skip counters (``loader.stats()``), or an empty shard list."""
    skipped = {kind: n for kind, n in loader.stats()["skipped"].items() if n}
    shards = f"{len(loader.cfg['shards'])} shard(s)"
    if not skipped:
        return f"data.{key}: no usable sample in {shards}: they hold no sample"
    kinds = ", ".join(f"{kind}: {n}" for kind, n in sorted(skipped.items(), key=lambda kv: -kv[1]))
    hint = " (raise data.seq_len or set data.split_documents)" if "too_long" in skipped else ""
    return f"data.{key}: no usable sample in {shards}: {sum(skipped.values())} skipped ({kinds}){hint}"


def check_data(config: dict, processor: VLMProcessor | None = None) -> None:
    """``data.shards`` and ``data.eval_shards`` (when set) each give a packed row: read through the training
    loader (same shard expansion, decoding, skip rules and packing), in order, stopping at the first row, so it
    costs a few samples unless the shards hold none usable. Raises a one-line ConfigError with the skip counts."""
    data = config["data"]
    processor = processor or build_processor(config)
    for key in ("shards", "eval_shards"):
        if not data[key]:
            continue
        try:
            loader = loader_from_config(
                DataConfig(**data),
                processor.tokenizer,
                processor.image_processor,
                data[key],
                batch_size=1,
                num_workers=0,
                seed=config["train"]["seed"],
                epochs=1,
                image_token_id=processor.image_token_id,
                shuffle=False,
            )
        except (OSError, ValueError) as err:
            raise ConfigError(f"data.{key}: {first_line(err)}") from None
        if next(iter(loader), None) is None:
            raise ConfigError(_no_sample_message(key, loader))
