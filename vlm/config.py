"""Configuration of :class:`vlm.ConceptMoEVLM`: a ConceptMoE backbone (``text_config``) plus a vision tower."""

from __future__ import annotations

from transformers import PretrainedConfig

from vision_tower.stem import STEMS
from vlm.backbone.config import (
    ConceptMoEConfig,
    Rule,
    check_rules,
    field_rule,
    init_fields,
    int_at_least,
    rename_legacy_fields,
)
from vlm.image_scan import IMAGE_CHUNKING

# Fields renamed since the first release: configs saved under the old name still load (mapped, with a warning).
VLM_RENAMED_FIELDS = {"vision_merge": "pixel_shuffle"}
_TOWER_FIELDS = ("vision_embed_dim", "vision_depth", "vision_heads", "patch_size")

VLM_RULES: tuple[Rule, ...] = (
    Rule(
        "image_token_id",
        lambda c: 0 <= c.image_token_id < c.text_config.vocab_size,
        "must be in [0, text_config.vocab_size={c.text_config.vocab_size})",
    ),
    field_rule("pixel_shuffle", lambda m: m in (1, 2, 4), "allowed values are 1 (none), 2 and 4 (2x2 / 4x4)"),
    Rule("max_patches", lambda c: c.max_patches >= c.pixel_shuffle**2, "must be >= pixel_shuffle**2"),
    *(
        field_rule(f, lambda v: v is None or (isinstance(v, int) and v >= 1), "must be None (timm's) or an int >= 1")
        for f in _TOWER_FIELDS
    ),
    Rule(
        "vision_embed_dim",
        lambda c: None in (c.vision_embed_dim, c.vision_heads) or c.vision_embed_dim % c.vision_heads == 0,
        "must be divisible by vision_heads",
    ),
    field_rule("image_chunking", lambda v: v in IMAGE_CHUNKING, f"allowed values are {', '.join(IMAGE_CHUNKING)}"),
    Rule(
        "image_chunking",
        lambda c: c.image_chunking != "router2d" or c.text_config.chunking == "dynamic",
        "router2d compares image tokens with two neighbours in the learned router: it needs "
        "text_config.chunking='dynamic' (got {c.text_config.chunking!r})",
    ),
    field_rule(
        "vision_model",
        lambda name: name.startswith(("naflexvit", "vit_")),
        "must name a timm NaFlexViT ('naflexvit_*') or ViT ('vit_*') model",
    ),
    field_rule("vision_stem", lambda v: v in STEMS, f"allowed values are {', '.join(STEMS)}"),
    Rule(
        "vision_stem",
        lambda c: (
            c.vision_stem != "conv"
            or (
                c.vision_model.startswith("naflexvit")
                and not c.vision_pretrained
                and (c.patch_size is None or c.patch_size % 4 == 0)
            )
        ),
        "'conv' needs a naflexvit vision_model, no vision_pretrained and a patch_size divisible by 4",
    ),
    field_rule("vision_words", lambda v: isinstance(v, bool), "must be true or false"),
    field_rule("vision_word_count", int_at_least(0), "must be an int >= 0"),
    Rule(
        "vision_words",
        lambda c: not c.vision_words or bool(c.vision_weights) or c.vision_word_count > 0,
        "needs vision_weights: a tower file with a word head (scripts/pretrain_vision.py --region-labels or "
        "--patch-labels writes one)",
    ),
    field_rule("vision_projector", lambda v: isinstance(v, bool), "must be true or false"),
    Rule(
        "vision_projector",
        lambda c: c.vision_projector or (c.vision_words and not c.vision_summary),
        "needs vision_words=true and vision_summary=false (without a projector an image token is its words alone)",
    ),
)

# Vision towers per preset: random-init NaFlexViTs small enough for CPU tests and demos.
VISION_PRESETS = {
    "tiny": dict(vision_embed_dim=64, vision_depth=2, vision_heads=2),
    "small": dict(vision_embed_dim=192, vision_depth=4, vision_heads=3),
}


class ConceptMoEVLMConfig(PretrainedConfig):
    """Backbone config + vision tower (timm), projector and how images enter the token sequence.

    Images become ``num_tokens`` slots each (patch grid / ``pixel_shuffle``²) in the token rows; the slots hold
    ``image_token_id`` and ``modality_ids == 1``. ``modality_boundaries`` forces a concept boundary on
    the last token of every modality span, so that no concept mixes text and image tokens (causal: the
    layout of a sequence — where its images are — is known before their content). ``image_chunking`` chooses how
    image tokens are scanned and chunked (``raster``, the paper's, or a 2-D aware choice: ``rows``, ``snake``,
    ``zorder``, ``router2d``; see ``vlm.image_scan``). ``vision_summary`` gives the tower its summary pool
    (``VisionTower(summary=True)``) and the projector reads each image token's features together with its image's
    summary, so an answer can read the whole image from any of its tokens (``docs/seeing.md``). ``vision_words``
    loads the tower's word head from ``vision_weights`` (``vision_word_count`` records its size, so a saved model
    rebuilds it) and adds to each image token the language model's embeddings of the words its patches detect
    (``vision_tower.words``). ``vision_projector=false`` (with ``vision_words``) drops the projector: each image token
    is then its words' embeddings alone, the tokens from which a small language model learns which colour goes with
    which shape (``docs/seeing.md``, "Initialisation").
    """

    model_type = "conceptmoe_vlm"
    sub_configs_defaults = {"text_config": ConceptMoEConfig}

    def __init__(
        self,
        text_config: ConceptMoEConfig | dict | None = None,
        vision_model: str = "naflexvit_base_patch16_gap",
        vision_embed_dim: int | None = 64,
        vision_depth: int | None = 2,
        vision_heads: int | None = 2,
        patch_size: int | None = 16,
        vision_pos_embed: str | None = None,
        vision_stem: str = "linear",
        vision_weights: str | None = None,
        vision_pretrained: bool = False,
        vision_summary: bool = False,
        vision_words: bool = False,
        vision_word_count: int = 0,
        vision_projector: bool = True,
        pixel_shuffle: int = 2,
        max_patches: int = 256,
        projector_hidden: int | None = None,
        image_token_id: int | None = None,
        modality_boundaries: bool = False,
        image_chunking: str = "raster",
        freeze_vision: bool = False,
        freeze_backbone: bool = False,
        bos_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        **kwargs,
    ):
        pixel_shuffle = rename_legacy_fields(
            {k: kwargs.pop(k) for k in VLM_RENAMED_FIELDS if k in kwargs}, "ConceptMoEVLMConfig", VLM_RENAMED_FIELDS
        ).get("pixel_shuffle", pixel_shuffle)
        if text_config is None:
            text_config = ConceptMoEConfig.from_preset("tiny")
        elif isinstance(text_config, dict):
            text_config = ConceptMoEConfig(**{k: v for k, v in text_config.items() if k != "model_type"})
        self.text_config = text_config
        self.vision_model, self.vision_embed_dim = vision_model, vision_embed_dim
        self.vision_depth, self.vision_heads, self.patch_size = vision_depth, vision_heads, patch_size
        self.vision_pos_embed = vision_pos_embed
        self.vision_stem = vision_stem
        self.vision_weights = vision_weights
        self.vision_pretrained = vision_pretrained
        self.vision_summary = vision_summary
        self.vision_words, self.vision_word_count = vision_words, vision_word_count
        self.vision_projector = vision_projector
        self.pixel_shuffle = pixel_shuffle
        self.max_patches = max_patches
        self.projector_hidden = projector_hidden
        self.image_token_id = text_config.vocab_size - 1 if image_token_id is None else image_token_id
        self.modality_boundaries = modality_boundaries
        self.image_chunking = image_chunking
        self.freeze_vision, self.freeze_backbone = freeze_vision, freeze_backbone
        # the tokenizer's, as HF models carry them (``VLMProcessor.special_token_ids``); the model's generation config
        # starts from them, so ``generate`` stops at any of ``eos_token_id`` (``<|end|>`` and end of text)
        self.bos_token_id, self.eos_token_id, self.pad_token_id = bos_token_id, eos_token_id, pad_token_id
        super().__init__(**kwargs)
        self.validate_fields()

    def tower_kwargs(self) -> dict:
        """The tower's architecture as ``VisionTower`` keyword arguments (no weights): what the VLM and the vision
        pretrainer build from."""
        return dict(
            model_name=self.vision_model,
            embed_dim=self.vision_embed_dim,
            depth=self.vision_depth,
            num_heads=self.vision_heads,
            patch_size=self.patch_size,
            pos_embed=self.vision_pos_embed,
            stem=self.vision_stem,
            summary=self.vision_summary,
            words=self.vision_word_count or self.vision_words,
        )

    def validate_fields(self) -> None:
        """Raise ``ValueError`` naming the first invalid field and its allowed values (the rules in ``VLM_RULES``)."""
        check_rules(self, VLM_RULES)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> ConceptMoEVLMConfig:
        """``tiny`` / ``small`` (and ``-moe`` baselines): the backbone preset plus a matching vision tower.

        ``overrides`` may hold VLM fields and backbone fields (the latter go to ``text_config``).
        """
        base = name.removesuffix("-moe")
        if base not in VISION_PRESETS:
            raise ValueError(f"unknown VLM preset {name!r}; allowed values are tiny, small, tiny-moe, small-moe")
        vlm_fields = init_fields(cls, skip=("text_config",))
        overrides = rename_legacy_fields(overrides, "ConceptMoEVLMConfig", VLM_RENAMED_FIELDS)
        text_overrides = {k: v for k, v in overrides.items() if k not in vlm_fields}
        vlm_overrides = {k: v for k, v in overrides.items() if k in vlm_fields}
        text_config = ConceptMoEConfig.from_preset(name, **text_overrides)
        return cls(text_config=text_config, **{**VISION_PRESETS[base], **vlm_overrides})
