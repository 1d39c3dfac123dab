"""ConceptMoE language backbone, ConceptMoE Eq. (1) (§3.1; docs/paper.md §1):

    Ĥ = E(H);  (C, P) = Chunk(Ĥ);  Ĉ = C(C);  Z = DeChunk(Ĉ, P);  Ẑ = D(Ĉ, Z)

E, C and D are stacks of MoE transformer blocks. With ``chunking="none"`` the chunk and dechunk steps
are skipped and the three stacks form one plain MoE transformer: the baseline, on the same code path.
"""

# Shape suffixes (docs/paper.md §0): B batch rows, N tokens per row, n new tokens per row, M concepts per row,
# D model width.

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init

from vlm.backbone.blocks import Block, Stack
from vlm.backbone.cache import ConceptMoECache
from vlm.backbone.chunking import ChunkModule, chunk_to_concepts, fixed_boundaries, ratio_loss
from vlm.backbone.chunking import ChunkOutput as _ChunkOutput
from vlm.backbone.config import CHUNKING_SETTINGS, ConceptMoEConfig, rename_legacy_fields
from vlm.backbone.dechunk import ema_over_concepts, plug_back
from vlm.backbone.decoding import ConceptMoEGenerationMixin, check_prefill, decode, fill_prefill_state, new_cache
from vlm.backbone.layers import RMSNorm, SeqLayout, make_layout
from vlm.backbone.moe import MoE
from vlm.backbone.outputs import BackboneOutput, ConceptMoECausalLMOutput, chunk_statistics
from vlm.hub_code import HubCodeMixin


def doc_ids_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """Packed-row convention (as HF's flattening collator): a new document starts wherever position == 0."""
    return torch.cumsum((position_ids == 0).long(), dim=1)


def next_token_loss(logits_BNV: torch.Tensor, labels_BN: torch.Tensor, attention_mask=None) -> torch.Tensor:
    """Mean cross-entropy of each position's logits against the next label (-100 ignored; 0, not NaN, when nothing
    is labelled)."""
    targets = labels_BN[:, 1:]
    if attention_mask is not None:  # never predict a token from a padding position (left padding)
        targets = targets.masked_fill(~attention_mask[:, :-1].bool(), -100)
    targets = targets.flatten()
    nll = F.cross_entropy(logits_BNV[:, :-1].flatten(0, 1).float(), targets, ignore_index=-100, reduction="sum")
    return nll / (targets != -100).sum().clamp_min(1)


class ConceptMoEPreTrainedModel(HubCodeMixin, PreTrainedModel):
    config_class = ConceptMoEConfig
    _hub_auto_map = {"AutoModel": "ConceptMoEModel"}  # save_pretrained writes the code too (vlm.hub_code)
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["Block"]

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        role = getattr(module, "init_role", None)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            embedding_std = self.config.embedding_init_std if isinstance(module, nn.Embedding) else None
            init.normal_(module.weight, mean=0.0, std=std if embedding_std is None else embedding_std)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
            if role == "boundary_qk" and self.config.boundary_router_init == "identity":
                init.eye_(module.weight)  # H-Net: W_q = W_k = I, so p starts as ½(1 − cos(ĥ_n, ĥ_{n−1}))
            elif role == "joint_qkv" and self.config.joint_zero_init:
                init.zeros_(module.weight)  # CT: the converted model starts exactly as the source model
        elif isinstance(module, RMSNorm):
            init.constant_(module.weight, self.config.concept_norm_init if role == "concept_norm" else 1.0)
        elif isinstance(module, MoE):
            for w in (module.w_gate_up, module.w_down):
                init.normal_(w, mean=0.0, std=std)


class ConceptMoEModel(ConceptMoEPreTrainedModel):
    def __init__(self, config: ConceptMoEConfig):
        super().__init__(config)
        d, hd, theta = config.d_model, config.token_head_dim, config.rope_theta
        token_block = dict(
            d_model=d, head_dim=hd, num_experts=config.num_experts, top_k=config.top_k, expert_dim=config.expert_dim
        )
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.encoder = Stack([Block(config, **token_block) for _ in range(config.encoder_layers)], hd, theta)
        concept_block = dict(
            d_model=config.concept_d_model,
            head_dim=config.concept_head_dim,
            num_experts=config.concept_num_experts,
            top_k=config.concept_top_k,
            expert_dim=config.concept_expert_dim,
        )
        self.concept_model = Stack(
            [Block(config, **concept_block) for _ in range(config.concept_layers)],
            config.concept_head_dim,
            theta,
            config.concept_schedule(),
        )
        first_joint = config.decoder_layers - (config.joint_layers if config.chunked else 0)
        self.decoder = Stack(
            [Block(config, **token_block, joint=i >= first_joint) for i in range(config.decoder_layers)], hd, theta
        )
        self.norm = RMSNorm(d, config.rms_norm_eps)
        if config.chunking == "dynamic":
            self.chunker = ChunkModule(d, config.boundary_router)
        if config.chunked:
            self.concept_norm = RMSNorm(config.concept_d_model, config.rms_norm_eps)
            self.concept_norm.init_role = "concept_norm"  # its gain starts at config.concept_norm_init
            if config.concept_d_model != d:  # strategy 3: wider concept model behind projectors
                self.concept_in = nn.Linear(d, config.concept_d_model, bias=False)
                self.concept_out = nn.Linear(config.concept_d_model, d, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    # ------------------------------------------------------------------ the steps of Eq. (1)
    def chunk(self, h_BND: torch.Tensor, layout: SeqLayout) -> _ChunkOutput:
        """(P, B) from Ĥ: learned boundaries (dynamic) or one every R tokens (fixed)."""
        if self.config.chunking == "fixed":
            b_BN = fixed_boundaries(layout, self.config.target_r)
            return _ChunkOutput(p_BN=b_BN.float(), b_BN=b_BN, b_hard_BN=b_BN)
        return self.chunker(h_BND, layout, self.config.noise_tau)

    def ratio_objective(self, chunk: _ChunkOutput, layout: SeqLayout, modality_BN) -> torch.Tensor:
        """Eq. 4 with one global target R over all real tokens (the paper), or — the "adaptive R per
        modality" extension — a weighted sum of Eq. 4 per modality, each with its own target."""
        cfg = self.config
        if cfg.target_r_by_modality is None:
            return ratio_loss(chunk.p_BN, chunk.b_BN, layout.valid_BN, cfg.target_r)
        if modality_BN is None:
            modality_BN = torch.zeros_like(layout.doc_BN)
        weights = cfg.ratio_loss_modality_weights or {}
        total = chunk.p_BN.new_zeros(())
        for m, target in cfg.target_r_by_modality.items():
            in_m = layout.valid_BN & (modality_BN == int(m))
            if in_m.any():  # an absent modality would add its constant R/(R-1) and make the log jump
                total = total + weights.get(m, 1.0) * ratio_loss(chunk.p_BN, chunk.b_BN, in_m, target)
        return total

    def concept_forward(self, c_BMD: torch.Tensor, layout: SeqLayout, kv=None):
        """Ĉ = C(C): the concept model at width d_c (with the d <-> d_c projectors of strategy 3)."""
        if hasattr(self, "concept_in"):
            c_BMD = self.concept_in(c_BMD)
        c_BMD, stats = self.concept_model(c_BMD, layout, kv=kv)
        c_BMD = self.concept_norm(c_BMD)
        if hasattr(self, "concept_out"):
            c_BMD = self.concept_out(c_BMD)
        return c_BMD, stats

    def forward(
        self,
        input_ids=None,
        inputs_embeds=None,
        doc_ids=None,
        position_ids=None,
        attention_mask=None,
        modality_ids=None,
        forced_boundaries=None,
        boundary_neighbours=None,
        cache: ConceptMoECache | None = None,
        use_cache: bool = False,
        **kwargs,
    ) -> BackboneOutput:
        """Eq. (1) over whole rows (training, eval, and the prefill of generation when ``use_cache``); given a filled
        ``cache``, the new tokens are decoded one step each instead (:meth:`decode`)."""
        h_BND = self.embed(input_ids, inputs_embeds)
        forced_boundaries = self.token_boundaries(input_ids, forced_boundaries)
        if cache is not None and cache.get_seq_length() > 0:
            return self.decode(h_BND, cache, attention_mask, forced_boundaries)
        layout = self.layout(h_BND, doc_ids, position_ids, attention_mask, forced_boundaries, boundary_neighbours)
        cache = self.prefill_cache(layout, cache, use_cache)
        kv = cache.per_stack() if cache is not None else {}
        h_BND, enc_stats = self.encoder(h_BND, layout, kv=kv.get("encoder"))  # Ĥ = E(H)
        chunk = ema_BMD = concept_BND = None
        if self.config.chunked:
            chunk = self.chunk(h_BND, layout)  # (P, B): Eq. 2 (dynamic) or every R tokens (fixed)
            concepts = chunk_to_concepts(h_BND, chunk, layout, self.config.concept_merge)  # C
            c_BMD, con_stats = self.concept_forward(concepts.c_BMD, concepts.layout, kv=kv.get("concept"))  # Ĉ = C(C)
            ema_BMD = ema_over_concepts(c_BMD, concepts.p_BM)  # Eq. 7-8
            dechunked = plug_back(h_BND, ema_BMD, chunk.p_BN, chunk.b_BN)  # Z = DeChunk(Ĉ, P): Eq. 9-10
            z_BND, concept_BND = dechunked.z_BND, dechunked.concept_BND
        else:  # the plain MoE baseline: the concept model runs on the tokens themselves
            z_BND, con_stats = self.concept_model(h_BND, layout, kv=kv.get("concept"))
        out_BND, dec_stats = self.decoder(z_BND, layout, concept_BND, kv=kv.get("decoder"))  # Ẑ = D(Ĉ, Z): Eq. 11
        if cache is not None:
            b_BN = None if chunk is None else chunk.b_BN
            fill_prefill_state(cache, layout, h_BND, b_BN, ema_BMD, self.config.concept_merge)
        return BackboneOutput(
            last_hidden_state=self.norm(out_BND),
            aux=self.aux_losses(chunk, layout, modality_ids, enc_stats + con_stats + dec_stats),
            chunk_stats=chunk_statistics(chunk, layout, modality_ids),
            chunk=chunk,
            cache=cache,
        )

    # ------------------------------------------------------------------ the pieces forward() calls
    def embed(self, input_ids, inputs_embeds) -> torch.Tensor:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        return self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds

    def token_boundaries(self, input_ids, forced_BN=None):
        """``forced_BN`` [B, N] bool or None, or'ed with the positions of ``config.boundary_token_ids`` in
        ``input_ids`` (callers that pass embeddings, the VLM, call this with their own ids)."""
        ids = self.config.boundary_token_ids
        if not ids or input_ids is None or not self.config.chunked:
            return forced_BN
        at_BN = self._boundary_id_table(tuple(ids), input_ids.device)[input_ids]
        return at_BN if forced_BN is None else forced_BN | at_BN

    def _boundary_id_table(self, ids: tuple, device) -> torch.Tensor:
        """[vocab] bool, True at ``ids``: built once per id set and device (a lookup per forward, no host copy)."""
        cache = self.__dict__.setdefault("_boundary_tables", {})
        key = (ids, str(device))
        if key not in cache:
            table_V = torch.zeros(self.config.vocab_size, dtype=torch.bool, device=device)
            table_V[list(ids)] = True
            cache[key] = table_V
        return cache[key]

    @staticmethod
    def layout(h_BND, doc_ids, position_ids, attention_mask, forced_boundaries, boundary_neighbours=None) -> SeqLayout:
        """Documents, positions, padding, forced boundaries and the router's neighbours of the rows (doc ids default
        from positions)."""
        if doc_ids is None and position_ids is not None:
            doc_ids = doc_ids_from_positions(position_ids)
        shape, device = h_BND.shape[:2], h_BND.device
        return make_layout(doc_ids, attention_mask, shape, device, position_ids, forced_boundaries, boundary_neighbours)

    def prefill_cache(self, layout: SeqLayout, cache: ConceptMoECache | None, use_cache: bool):
        """The cache this forward fills (generation's prefill), or None when nothing is cached."""
        if not (use_cache or cache is not None):
            return None
        check_prefill(layout, self.config.max_position_embeddings)
        return cache if cache is not None else new_cache(self)

    def aux_losses(self, chunk: _ChunkOutput | None, layout: SeqLayout, modality_BN, router_stats) -> dict:
        """The auxiliary objectives: ratio loss (dynamic chunking) and the experts' balance and z losses."""
        aux = {}
        if self.config.chunking == "dynamic":
            aux["ratio_loss"] = self.ratio_objective(chunk, layout, modality_BN)
        if router_stats:
            aux["balance_loss"] = torch.stack([s.balance_loss for s in router_stats]).mean()
            aux["z_loss"] = torch.stack([s.z_loss for s in router_stats]).mean()
        return aux

    def decode(
        self, h_BnD: torch.Tensor, cache: ConceptMoECache, attention_mask=None, forced_Bn=None
    ) -> BackboneOutput:
        """Incremental decoding after a prefill: each new token runs one step (``vlm.backbone.decoding``), and only
        tokens that close a concept (``forced_Bn`` [B, n] bool: must close one) run the concept model."""
        new_valid_Bn = None if attention_mask is None else attention_mask[:, -h_BnD.shape[1] :].bool()
        out_BnD = decode(self, h_BnD, cache, new_valid_Bn, forced_Bn)
        return BackboneOutput(last_hidden_state=out_BnD, aux={}, cache=cache)


class ConceptMoEForCausalLM(ConceptMoEPreTrainedModel, ConceptMoEGenerationMixin):
    _hub_auto_map = {"AutoModel": "ConceptMoEModel", "AutoModelForCausalLM": "ConceptMoEForCausalLM"}
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: ConceptMoEConfig):
        super().__init__(config)
        self.model = ConceptMoEModel(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_chunking(self, **settings) -> None:
        """Change chunking settings of this built model in place: the one way training stages, evaluation at another
        R and studies do it. ``settings`` are fields of ``CHUNKING_SETTINGS`` (``chunking``, ``target_r``,
        ``noise_tau``, ``ratio_loss_weight``, ...); the resulting config is validated as a whole.

        Modules are fixed when a model is built: ``dynamic`` needs the boundary router of a model built ``dynamic``,
        and a chunked model cannot become ``none`` (or back), since chunk / dechunk modules exist only in chunked
        models. ``fixed`` on a ``dynamic`` model forces R at evaluation.
        """
        settings = rename_legacy_fields(settings, "set_chunking")
        self.check_chunking_change(settings)
        fields = {k: v for k, v in self.config.to_dict().items() if k != "model_type"}
        candidate = ConceptMoEConfig(**{**fields, **settings})  # raises ValueError naming a bad field
        for name in settings:  # self.model.config is self.config: one object to write
            setattr(self.config, name, getattr(candidate, name))

    def check_chunking_change(self, settings: dict) -> None:
        """What a config alone cannot check: every name is a chunking setting, and this built model has the modules
        the wanted ``chunking`` needs (``set_chunking``)."""
        unknown = sorted(set(settings) - set(CHUNKING_SETTINGS))
        if unknown:
            raise ValueError(f"set_chunking: {unknown[0]!r} is not a chunking setting; allowed: {CHUNKING_SETTINGS}")
        current, wanted = self.config.chunking, settings.get("chunking", self.config.chunking)
        if (wanted == "none") != (current == "none") or (wanted == "dynamic" and not hasattr(self.model, "chunker")):
            raise ValueError(
                f"set_chunking: chunking={wanted!r} cannot be applied to a model built with chunking={current!r} "
                "(the chunk / dechunk modules and the boundary router exist only in models built with them)"
            )

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(
        self,
        input_ids=None,
        labels=None,
        doc_ids=None,
        modality_ids=None,
        attention_mask=None,
        position_ids=None,
        inputs_embeds=None,
        forced_boundaries=None,
        boundary_neighbours=None,
        cache=None,
        use_cache: bool = False,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> ConceptMoECausalLMOutput:
        """Logits for every position; with ``labels`` (aligned with the inputs, -100 = ignore) the loss.

        ``doc_ids`` [B, N] marks packed documents (no attention, merging or EMA across them; positions restart);
        ``attention_mask`` marks padding (0); ``modality_ids`` feeds ``chunk_stats`` (and per-modality ratio losses);
        ``forced_boundaries`` [B, N] bool marks tokens that must close a concept; ``boundary_neighbours`` [B, N, 2]
        long: how many tokens back the router's (left, up) comparison tokens lie (2-D image chunking,
        ``vlm.image_scan``; default the previous token). ``use_cache=True`` returns ``cache`` (prefill); passing it
        back with the next tokens (and the mask grown by their columns) decodes them incrementally.
        ``logits_to_keep`` > 0: logits of the last positions only.
        """
        out = self.model(
            input_ids=input_ids,
            inputs_embeds=inputs_embeds,
            doc_ids=doc_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            modality_ids=modality_ids,
            forced_boundaries=forced_boundaries,
            boundary_neighbours=boundary_neighbours,
            cache=cache,
            use_cache=use_cache,
        )
        hidden_BND = out.last_hidden_state
        if logits_to_keep and labels is None:
            hidden_BND = hidden_BND[:, -logits_to_keep:]
        logits = self.lm_head(hidden_BND)
        aux = dict(out.aux)
        loss = None
        if labels is not None:
            aux["lm_loss"] = next_token_loss(logits, labels, attention_mask)
            loss = self.total_loss(aux)
        return ConceptMoECausalLMOutput(
            loss=loss, logits=logits, aux=aux, chunk_stats=out.chunk_stats, cache=out.cache, chunk=out.chunk
        )

    def total_loss(self, aux: dict) -> torch.Tensor:
        """``lm_loss`` plus the weighted auxiliary objectives present in ``aux`` (ratio, balance, z losses)."""
        cfg = self.config
        loss = aux["lm_loss"]
        if "ratio_loss" in aux:
            loss = loss + cfg.ratio_loss_weight * aux["ratio_loss"]
        if "balance_loss" in aux:
            loss = loss + cfg.balance_loss_weight * aux["balance_loss"]
            if cfg.moe_z_loss_weight > 0:
                loss = loss + cfg.moe_z_loss_weight * aux["z_loss"]
        return loss
