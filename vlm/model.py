"""ConceptMoE vision-language model: vision tower -> projector -> image slots in the token rows -> backbone.

The whole interleaved sequence (text and image tokens) goes through encoder, chunker and concept model as
one flat sequence, as in the paper (§4.2); a single global target R holds over all tokens, and
``chunk_stats`` reports R per modality (0 = text, 1 = image; docs/paper.md §11). ``modality_boundaries`` is the
project's extension of docs/paper.md §12.6.
"""

# Shape suffixes (docs/paper.md §0): B batch rows (token sequences; images in the vision tower's patch batch),
# N tokens per row, D model / feature width, L patches per image, T image tokens of the batch flattened, 2 a pair.

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init

from data_pipelines.schema import Modality
from vision_tower import Projector, VisionTower, pixel_shuffle_merge
from vision_tower.words import word_embeddings
from vlm.backbone.config import rename_legacy_fields
from vlm.backbone.decoding import ConceptMoEGenerationMixin
from vlm.backbone.model import ConceptMoEForCausalLM
from vlm.backbone.outputs import ConceptMoECausalLMOutput
from vlm.config import ConceptMoEVLMConfig
from vlm.hub_code import HubCodeMixin
from vlm.image_scan import REORDERING, neighbour_offsets, reorder_image_tokens, row_ends, token_grids


def modality_span_ends(modality_BN: torch.Tensor, valid_BN: torch.Tensor) -> torch.Tensor:
    """The last token of every modality span: forcing a boundary there keeps every concept single-modality."""
    ends_BN = torch.zeros_like(valid_BN)
    ends_BN[:, :-1] = (modality_BN[:, :-1] != modality_BN[:, 1:]) & valid_BN[:, 1:]
    return ends_BN & valid_BN


def scatter_to_slots(slots_BN: torch.Tensor, values_T: torch.Tensor, fill_BN: torch.Tensor) -> torch.Tensor:
    """``fill_BN`` with the image slots (in row-major order, as the image tokens fill them) set to ``values_T``."""
    out = fill_BN.clone()
    out[slots_BN] = values_T.to(out.device, out.dtype)
    return out


def text_labels(labels_BN: torch.Tensor, modality_BN: torch.Tensor, attention_mask=None) -> torch.Tensor:
    """``labels_BN`` with image tokens and padding set to -100 (ignored)."""
    ignore_BN = modality_BN == Modality.IMAGE
    if attention_mask is not None:
        ignore_BN = ignore_BN | ~attention_mask.bool()
    return labels_BN.masked_fill(ignore_BN, -100)


class ConceptMoEVLM(HubCodeMixin, PreTrainedModel, ConceptMoEGenerationMixin):
    config_class = ConceptMoEVLMConfig
    _hub_auto_map = {"AutoModel": "ConceptMoEVLM", "AutoModelForImageTextToText": "ConceptMoEVLM"}  # vlm.hub_code
    base_model_prefix = ""
    _no_split_modules = ["Block"]

    def __init__(self, config: ConceptMoEVLMConfig):
        config = copy.deepcopy(config)  # __init__ records where the tower came from: never in the caller's object
        super().__init__(config)
        self.vision_tower = VisionTower(
            **config.tower_kwargs(), weights=config.vision_weights, pretrained=config.vision_pretrained
        )
        for module in self.vision_tower.modules():  # timm initialised (or loaded) it: never re-init
            module._is_hf_initialized = True
        if config.vision_words:  # its size, so that a saved model rebuilds the head without the tower file
            config.vision_word_count = self.vision_tower.require_word_head().num_words
        if config.vision_weights or config.vision_pretrained:
            # the weights now live in this model: a saved checkpoint must not re-read (or re-download) them
            config.vision_init_source = config.vision_weights or f"timm:{config.vision_model}"
            config.vision_weights, config.vision_pretrained = None, False
        d_model = config.text_config.d_model
        summary_dim = self.vision_tower.out_dim if config.vision_summary else 0
        self.projector = (
            Projector(
                self.vision_tower.out_dim * config.pixel_shuffle**2 + summary_dim, d_model, config.projector_hidden
            )
            if config.vision_projector
            else None  # image tokens are their words alone (vision_words)
        )
        self.language_model = ConceptMoEForCausalLM(config.text_config)
        self.post_init()
        self.apply_freezing()

    @classmethod
    def from_pretrained(cls, *args, **kwargs) -> ConceptMoEVLM:
        """HF loading, plus what loading cannot restore by itself: the freeze flags (loading swaps in new
        parameters) and timm's non-persistent buffers (e.g. RoPE bands, left uninitialised by meta-device init)."""
        model = super().from_pretrained(*args, **kwargs)
        for module in model.vision_tower.modules():
            if hasattr(module, "init_non_persistent_buffers"):
                module.init_non_persistent_buffers()
        model.apply_freezing()
        return model

    @classmethod
    def from_preset(cls, name: str, **overrides) -> ConceptMoEVLM:
        return cls(ConceptMoEVLMConfig.from_preset(name, **overrides))

    @classmethod
    def from_text_model(cls, text_model: ConceptMoEForCausalLM | str, **vlm_fields) -> ConceptMoEVLM:
        """The paper's VLM recipe: a trained text-only backbone + a fresh vision tower and projector.

        ``text_model`` is a model or a local checkpoint folder. When ``image_token_id`` (default: the text
        vocabulary size, i.e. a new token) lies outside the vocabulary, the embeddings and LM head grow
        by the missing rows (new rows initialised like the rest). Pass ``image_token_id=
        processor.image_token_id`` so that the processor's slots and the model agree. ``text_model`` itself
        is left untouched.
        """
        if isinstance(text_model, str):
            text_model = ConceptMoEForCausalLM.from_pretrained(text_model)
        else:
            text_model = copy.deepcopy(text_model)
        text_config = text_model.config
        image_token_id = vlm_fields.pop("image_token_id", text_config.vocab_size)
        if image_token_id >= text_config.vocab_size:
            text_model.resize_token_embeddings(image_token_id + 1)
        model = cls(ConceptMoEVLMConfig(text_config=text_model.config, image_token_id=image_token_id, **vlm_fields))
        model.language_model.load_state_dict(text_model.state_dict())
        model.apply_freezing()
        return model

    def set_chunking(
        self, modality_boundaries: bool | None = None, image_chunking: str | None = None, **settings
    ) -> None:
        """Change chunking settings in place: the backbone's (``ConceptMoEForCausalLM.set_chunking``: ``chunking``,
        ``target_r``, ``noise_tau``, ...) and the VLM's ``modality_boundaries`` and ``image_chunking``. The resulting
        VLM config is validated as a whole (e.g. router2d needs dynamic chunking, whichever side moves) before
        anything changes; ``config.text_config`` is the backbone's config object, so it is written once."""
        settings = rename_legacy_fields(settings, "set_chunking")
        fields = {k: v for k, v in self.config.to_dict().items() if k not in ("model_type", "text_config")}
        fields["text_config"] = {**self.config.text_config.to_dict(), **settings}
        fields["image_chunking"] = image_chunking or fields["image_chunking"]
        candidate = ConceptMoEVLMConfig(**fields)  # raises ValueError naming a bad field
        self.language_model.check_chunking_change(settings)
        for name in settings:
            setattr(self.config.text_config, name, getattr(candidate.text_config, name))
        if modality_boundaries is not None:
            self.config.modality_boundaries = bool(modality_boundaries)
        if image_chunking is not None:
            self.config.image_chunking = image_chunking

    def set_special_token_ids(self, bos_token_id=None, eos_token_id=None, pad_token_id=None) -> None:
        """The tokenizer's special ids (``**processor.special_token_ids``) into the config and the generation config,
        as HF models carry them: saved in ``config.json`` / ``generation_config.json``, and ``generate`` stops at
        any id of ``eos_token_id`` (``<|end|>`` and end of text) and pads finished rows with ``pad_token_id``."""
        ids = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id}
        for name, value in ids.items():
            setattr(self.config, name, value)
            if self.generation_config is not None:
                setattr(self.generation_config, name, value)

    def apply_freezing(self) -> None:
        """``freeze_vision`` / ``freeze_backbone``: stop gradients to the tower / to the language model."""
        self.vision_tower.requires_grad_(not self.config.freeze_vision)
        self.language_model.requires_grad_(not self.config.freeze_backbone)

    @torch.no_grad()
    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=self.config.text_config.initializer_range)
            if module.bias is not None:
                init.zeros_(module.bias)

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.language_model.set_input_embeddings(value)

    def get_output_embeddings(self):
        return self.language_model.get_output_embeddings()

    def set_output_embeddings(self, value):
        self.language_model.set_output_embeddings(value)

    # ------------------------------------------------------------------ images -> token embeddings
    def image_embeddings(self, patches, patch_coord, patch_valid, grid_hw) -> torch.Tensor:
        """[sum of num_tokens over the images, d_model], images in batch order, tokens row-major. With
        ``vision_summary`` each merged token is joined by its image's summary (``VisionTower.summarize``) before
        the projector; with ``vision_words`` the language model's embeddings of the words the token's patches detect
        are added after it (``vision_tower.words.word_embeddings``), or are the whole token without a projector
        (``vision_projector=False``)."""
        feats = self.vision_tower(patches, patch_coord, patch_valid)
        m = self.config.pixel_shuffle
        image_TD = 0.0
        if self.projector is not None:
            tokens_TD = pixel_shuffle_merge(feats.features_BLD, feats.coord_BL2, feats.valid_BL, grid_hw, m)
            if self.config.vision_summary:
                per_image_B = (grid_hw.to(tokens_TD.device).long().view(-1, 2) // m).prod(-1)  # as the merge counts
                summary_TD = self.vision_tower.summarize(feats).repeat_interleave(per_image_B, dim=0)
                tokens_TD = torch.cat([tokens_TD, summary_TD.to(tokens_TD.dtype)], dim=-1)
            image_TD = self.projector(tokens_TD)
        if self.config.vision_words:
            probs_BLK = self.vision_tower.word_probs(feats)
            probs_TlK = pixel_shuffle_merge(probs_BLK, feats.coord_BL2, feats.valid_BL, grid_hw, m)
            head = self.vision_tower.word_head
            embedding_VE = self.get_input_embeddings().weight
            words_TD = word_embeddings(probs_TlK.view(len(probs_TlK), m * m, -1), head.ids_K, embedding_VE)
            image_TD = image_TD + words_TD
        return image_TD

    def idle_image_pass(self, like: torch.Tensor) -> torch.Tensor:
        """The tower and projector (or word head) on one blank merge block: a text-only training batch still uses
        (and gives a zero gradient to) every vision parameter, like the batches of the other ranks."""
        m, p = self.config.pixel_shuffle, self.vision_tower.patch_size
        coord = torch.stack(torch.meshgrid(torch.arange(m), torch.arange(m), indexing="ij"), -1).reshape(1, m * m, 2)
        patches = like.new_zeros(1, m * m, p * p * 3)
        valid = torch.ones(1, m * m, dtype=torch.bool, device=like.device)
        grid = torch.tensor([[m, m]], device=like.device)
        return self.image_embeddings(patches, coord.to(like.device), valid, grid).sum()

    def image_slots(self, modality_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """[B, N] bool: the image slots (``modality_ids == 1`` on real tokens)."""
        slots_BN = modality_ids == Modality.IMAGE
        return slots_BN if attention_mask is None else slots_BN & attention_mask.bool()

    def embed(self, input_ids, modality_ids, attention_mask, patches, patch_coord, patch_valid, grid_hw):
        """Text embeddings with every image slot (``modality_ids == 1``) replaced by its image token, each image's
        tokens in the scan order of ``config.image_chunking`` (``vlm.image_scan``)."""
        embeds_BND = self.get_input_embeddings()(input_ids)
        slots_BN = self.image_slots(modality_ids, attention_mask)
        n_slots = int(slots_BN.sum())
        n_images = 0 if patches is None else patches.shape[0]
        if n_images == 0:
            if n_slots:
                raise ValueError(f"input has {n_slots} image slots but no images (pass patches from VLMProcessor)")
            if self.training:  # every rank must run the same modules (ZeRO-3 gathers, DDP/ZeRO buckets)
                embeds_BND = embeds_BND + 0.0 * self.idle_image_pass(embeds_BND)
            return embeds_BND
        image_TD = self.image_embeddings(patches, patch_coord, patch_valid, grid_hw).to(embeds_BND.dtype)
        if image_TD.shape[0] != n_slots:
            raise ValueError(
                f"input has {n_slots} image slots but its {n_images} images give {image_TD.shape[0]} tokens: "
                "build inputs with VLMProcessor and an ImageProcessor whose pixel_shuffle equals the model's"
            )
        if self.config.image_chunking in REORDERING:  # the grids cost a host sync: only where the order changes
            grids = token_grids(grid_hw, self.config.pixel_shuffle)
            image_TD = reorder_image_tokens(image_TD, grids, self.config.image_chunking)
        return embeds_BND.masked_scatter(slots_BN[..., None], image_TD)

    def chunking_inputs(self, modality_ids, attention_mask, grid_hw, use_cache: bool):
        """(forced boundaries [B, N] bool or None, router neighbours [B, N, 2] long or None) for the backbone:
        ``modality_boundaries`` ends every modality span; ``image_chunking`` ``rows`` ends every token row of an
        image, ``router2d`` gives image tokens their left / upper neighbours (``vlm.image_scan``)."""
        mode = self.config.image_chunking
        valid_BN = torch.ones_like(modality_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        forced_BN = neighbours_BN2 = None
        if self.config.modality_boundaries:
            forced_BN = modality_span_ends(modality_ids, valid_BN)
            if use_cache:  # generated tokens are text: a prompt ending on an image token ends an image span there
                forced_BN[:, -1] |= (modality_ids[:, -1] == Modality.IMAGE) & valid_BN[:, -1]
        if mode not in ("rows", "router2d") or grid_hw is None or grid_hw.numel() == 0:
            return forced_BN, neighbours_BN2
        slots_BN = self.image_slots(modality_ids, attention_mask)
        grids = token_grids(grid_hw, self.config.pixel_shuffle)
        if mode == "rows":
            ends_BN = scatter_to_slots(slots_BN, row_ends(grids), torch.zeros_like(valid_BN))
            forced_BN = ends_BN if forced_BN is None else forced_BN | ends_BN
        else:
            left_BN2 = torch.zeros(*valid_BN.shape, 2, dtype=torch.long, device=valid_BN.device)
            left_BN2[..., 0] = 1
            neighbours_BN2 = scatter_to_slots(slots_BN, neighbour_offsets(grids), left_BN2)
        return forced_BN, neighbours_BN2

    def full_modality_ids(self, input_ids: torch.Tensor, modality_ids: torch.Tensor | None) -> torch.Tensor:
        """[B, N] modality ids: ``input_ids == image_token_id`` by default; ``generate(use_cache=False)`` passes the
        prompt's, which the new tokens (text) extend."""
        if modality_ids is None:
            return (input_ids == self.config.image_token_id).long()
        if modality_ids.shape[1] < input_ids.shape[1]:
            new_Bn = modality_ids.new_full(
                (input_ids.shape[0], input_ids.shape[1] - modality_ids.shape[1]), Modality.TEXT
            )
            return torch.cat([modality_ids, new_Bn], dim=1)
        return modality_ids

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        modality_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        patches: torch.Tensor | None = None,
        patch_coord: torch.Tensor | None = None,
        patch_valid: torch.Tensor | None = None,
        grid_hw: torch.Tensor | None = None,
        num_tokens: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache=None,
        use_cache: bool = False,
        logits_to_keep: int = 0,
        return_dict: bool = True,
        **unexpected,
    ) -> ConceptMoECausalLMOutput:
        """Rows from :class:`vlm.VLMProcessor` (or the data pipelines): token ids with image slots, the patches of
        every image in the batch (any number per row, any sizes), and optional labels (ignored on image tokens and
        padding). ``num_tokens`` is accepted so that ``model(**batch)`` works, and ignored: the slots in
        ``input_ids`` say where the images go. ``modality_ids`` defaults to ``input_ids == image_token_id``.

        Generation: the prefill runs the images; later steps get only the new (text) tokens and the ``cache``. The
        output is always a :class:`ConceptMoECausalLMOutput`. Any other keyword is a ``TypeError`` naming it.
        """
        if unexpected:
            raise TypeError(
                f"ConceptMoEVLM.forward got unexpected keyword arguments {sorted(unexpected)}: it takes the batch of "
                "VLMProcessor or the data loader (images as patches, patch_coord, patch_valid, grid_hw)"
            )
        lm = self.language_model
        if cache is not None and cache.get_seq_length() > 0:  # decode: new tokens are text
            return lm(input_ids=input_ids, attention_mask=attention_mask, cache=cache, logits_to_keep=logits_to_keep)
        modality_ids = self.full_modality_ids(input_ids, modality_ids)
        embeds_BND = self.embed(input_ids, modality_ids, attention_mask, patches, patch_coord, patch_valid, grid_hw)
        if labels is not None:
            labels = text_labels(labels, modality_ids, attention_mask)
        forced_BN, neighbours_BN2 = self.chunking_inputs(modality_ids, attention_mask, grid_hw, use_cache)
        forced_BN = lm.model.token_boundaries(input_ids, forced_BN)  # the text config's boundary_token_ids
        return lm(
            inputs_embeds=embeds_BND,
            labels=labels,
            attention_mask=attention_mask,
            modality_ids=modality_ids,
            doc_ids=doc_ids,
            position_ids=position_ids,
            forced_boundaries=forced_BN,
            boundary_neighbours=neighbours_BN2,
            cache=cache,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
        )
