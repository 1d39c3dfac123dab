"""ConceptMoE language backbone, ConceptMoE Eq. (1):

    Ĥ = E(H);  (C, P) = Chunk(Ĥ);  Ĉ = C(C);  Z = DeChunk(Ĉ, P);  Ẑ = D(Ĉ, Z)

E, C and D are stacks of MoE transformer blocks. With ``chunking="none"`` the chunk and dechunk steps
are skipped and the three stacks form one plain MoE transformer: the baseline, on the same code path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init

from vlm.backbone.cache import ConceptMoECache
from vlm.backbone.chunking import ChunkModule, chunk_to_concepts, fixed_boundaries, ratio_loss
from vlm.backbone.chunking import ChunkOutput as _ChunkOutput
from vlm.backbone.config import ConceptMoEConfig
from vlm.backbone.dechunk import ema_over_concepts, plug_back
from vlm.backbone.decoding import ConceptMoEGenerationMixin, check_prefill, decode, fill_prefill_state, new_cache
from vlm.backbone.layers import Attention, RMSNorm, SeqLayout, SwiGLU, make_layout, rope_cos_sin
from vlm.backbone.moe import MoE, RouterStats
from vlm.backbone.outputs import BackboneOutput, ConceptMoECausalLMOutput, chunk_statistics


class Block(nn.Module):
    """Pre-norm transformer block: x + Attn(norm(x) [, concept]); x + FFN(norm(x)), FFN = MoE or SwiGLU."""

    def __init__(
        self,
        config: ConceptMoEConfig,
        d_model: int,
        head_dim: int,
        num_experts: int,
        top_k: int,
        expert_dim: int,
        joint: bool = False,
    ):
        super().__init__()
        eps = config.rms_norm_eps
        self.attn_norm = RMSNorm(d_model, eps)
        self.attn = Attention(
            d_model,
            config.n_heads,
            config.n_kv_heads,
            head_dim,
            config.attention_bias,
            config.qk_norm,
            eps,
            joint=joint,
        )
        self.ffn_norm = RMSNorm(d_model, eps)
        if config.ffn == "moe":
            self.ffn = MoE(
                d_model,
                num_experts,
                top_k,
                expert_dim,
                config.shared_experts,
                config.norm_topk_prob,
                shared_dim=config.shared_expert_dim,
                shared_gate=config.shared_expert_gate,
            )
        else:
            self.ffn = SwiGLU(d_model, config.dense_ffn_dim)

    def forward(
        self, x_BND, cos, sin, layout: SeqLayout, concept_BND=None, kv=None
    ) -> tuple[torch.Tensor, RouterStats | None]:
        x_BND = x_BND + self.attn(self.attn_norm(x_BND), cos, sin, layout.mask_B1NN, concept_BND, kv)
        y_BND = self.ffn_norm(x_BND)
        if not isinstance(self.ffn, MoE):
            return x_BND + self.ffn(y_BND), None
        if layout.mask_B1NN is None:  # no padding anywhere: every position is a real token
            out_TD, stats = self.ffn(y_BND.reshape(-1, y_BND.shape[-1]))
            return x_BND + out_TD.view_as(x_BND), stats
        out_TD, stats = self.ffn(y_BND[layout.valid_BN])  # padding never reaches the experts or the stats
        return x_BND.index_put((layout.valid_BN,), x_BND[layout.valid_BN] + out_TD), stats


class Stack(nn.Module):
    """Blocks run in ``schedule`` order (a looped concept model repeats indices; weights are shared)."""

    def __init__(self, blocks: list[Block], head_dim: int, theta: float, schedule: list[int] | None = None):
        super().__init__()
        self.layers = nn.ModuleList(blocks)
        self.head_dim, self.theta = head_dim, theta
        self.schedule = list(range(len(blocks))) if schedule is None else schedule

    def forward(self, x_BND, layout: SeqLayout, concept_BND=None, kv=None) -> tuple[torch.Tensor, list[RouterStats]]:
        """``kv``: one cache per entry of the schedule (a looped layer caches each of its applications)."""
        cos, sin = rope_cos_sin(layout.pos_BN, self.head_dim, self.theta, x_BND.dtype)
        router_stats = []
        for j, i in enumerate(self.schedule):
            x_BND, stats = self.layers[i](x_BND, cos, sin, layout, concept_BND, None if kv is None else kv[j])
            if stats is not None:
                router_stats.append(stats)
        return x_BND, router_stats


def doc_ids_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """Packed-row convention (as HF's flattening collator): a new document starts wherever position == 0."""
    return torch.cumsum((position_ids == 0).long(), dim=1)


class ConceptMoEPreTrainedModel(PreTrainedModel):
    config_class = ConceptMoEConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["Block"]

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
            role = getattr(module, "init_role", None)
            if role == "boundary_qk" and self.config.router_init == "identity":
                init.eye_(module.weight)  # H-Net: W_q = W_k = I, so p starts as ½(1 − cos(ĥ_n, ĥ_{n−1}))
            elif role == "joint_qkv" and self.config.joint_zero_init:
                init.zeros_(module.weight)  # CT: the converted model starts exactly as the source model
        elif isinstance(module, RMSNorm):
            init.ones_(module.weight)
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
            d_model=config.concept_width,
            head_dim=config.concept_head_dim,
            num_experts=config.concept_experts,
            top_k=config.concept_k,
            expert_dim=config.concept_ffn_dim,
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
            self.chunker = ChunkModule(d, config.router)
        if config.chunked:
            self.concept_norm = RMSNorm(config.concept_width, config.rms_norm_eps)
            if config.concept_width != d:  # strategy 3: wider concept model behind projectors
                self.concept_in = nn.Linear(d, config.concept_width, bias=False)
                self.concept_out = nn.Linear(config.concept_width, d, bias=False)
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
        cache: ConceptMoECache | None = None,
        use_cache: bool = False,
        **kwargs,
    ) -> BackboneOutput:
        """The full forward (training, eval, and the prefill of generation when ``use_cache``), or — given a
        filled ``cache`` — decoding of the new tokens, one step each (``vlm.backbone.decoding``)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        h_BND = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if cache is not None and cache.get_seq_length() > 0:
            new_valid = None if attention_mask is None else attention_mask[:, -h_BND.shape[1] :].bool()
            return BackboneOutput(last_hidden_state=decode(self, h_BND, cache, new_valid), aux={}, cache=cache)
        if doc_ids is None and position_ids is not None:
            doc_ids = doc_ids_from_positions(position_ids)
        layout = make_layout(doc_ids, attention_mask, h_BND.shape[:2], h_BND.device, position_ids, forced_boundaries)
        if use_cache or cache is not None:
            check_prefill(layout)
            cache = cache if cache is not None else new_cache(self)
        enc_kv = concept_kv = dec_kv = None
        if cache is not None:
            enc_kv, concept_kv, dec_kv = cache.encoder, cache.concept, cache.decoder

        h_BND, router_stats = self.encoder(h_BND, layout, kv=enc_kv)
        chunk, aux = None, {}
        if not self.config.chunked:
            if cache is not None:
                fill_prefill_state(cache, layout, h_BND)
            h_BND, stats = self.concept_model(h_BND, layout, kv=concept_kv)
            h_BND, dec_stats = self.decoder(h_BND, layout, kv=dec_kv)
        else:
            chunk = self.chunk(h_BND, layout)
            concepts = chunk_to_concepts(h_BND, chunk, layout, self.config.merge)
            c_BMD, stats = self.concept_forward(concepts.c_BMD, concepts.layout, kv=concept_kv)
            ema_BMD = ema_over_concepts(c_BMD, concepts.p_BM)
            if cache is not None:
                fill_prefill_state(cache, layout, h_BND, chunk.b_BN, ema_BMD, self.config.merge)
            dechunked = plug_back(h_BND, ema_BMD, chunk.p_BN, chunk.b_BN)
            h_BND, dec_stats = self.decoder(dechunked.z_BND, layout, dechunked.concept_BND, kv=dec_kv)
            if self.config.chunking == "dynamic":
                aux["ratio_loss"] = self.ratio_objective(chunk, layout, modality_ids)
        router_stats += stats + dec_stats
        if router_stats:
            aux["balance_loss"] = torch.stack([s.balance_loss for s in router_stats]).mean()
            aux["z_loss"] = torch.stack([s.z_loss for s in router_stats]).mean()
        return BackboneOutput(
            last_hidden_state=self.norm(h_BND),
            aux=aux,
            chunk_stats=chunk_statistics(chunk, layout, modality_ids),
            chunk=chunk,
            cache=cache,
        )


class ConceptMoEForCausalLM(ConceptMoEPreTrainedModel, ConceptMoEGenerationMixin):
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
        cache=None,
        use_cache: bool = False,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> ConceptMoECausalLMOutput:
        """Logits for every position; with ``labels`` (aligned with the inputs, -100 = ignore) the loss.

        ``doc_ids`` [B, N] marks packed documents (no attention, merging or EMA across them; positions
        restart); ``attention_mask`` marks padding (0); ``modality_ids`` feeds ``chunk_stats`` (and the
        per-modality ratio losses when ``target_r_by_modality`` is set); ``forced_boundaries`` [B, N] bool
        marks tokens that must close a concept (p = b = 1 there, like a document start).

        Generation: ``use_cache=True`` returns ``cache`` (prefill); passing it back with the next tokens (and the
        attention mask grown by their columns) decodes them incrementally. ``logits_to_keep`` > 0 computes the
        logits of the last positions only.
        """
        out = self.model(
            input_ids=input_ids,
            inputs_embeds=inputs_embeds,
            doc_ids=doc_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            modality_ids=modality_ids,
            forced_boundaries=forced_boundaries,
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
            targets = labels[:, 1:]
            if attention_mask is not None:  # never predict a token from a padding position (left padding)
                targets = targets.masked_fill(~attention_mask[:, :-1].bool(), -100)
            targets = targets.flatten()
            nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets, ignore_index=-100, reduction="sum")
            aux["lm_loss"] = nll / (targets != -100).sum().clamp_min(1)  # 0, not NaN, when nothing is labelled
            cfg = self.config
            loss = aux["lm_loss"]
            if "ratio_loss" in aux:
                loss = loss + cfg.ratio_loss_weight * aux["ratio_loss"]
            if "balance_loss" in aux:
                loss = loss + cfg.balance_loss_weight * aux["balance_loss"]
                if cfg.router_z_loss_weight > 0:
                    loss = loss + cfg.router_z_loss_weight * aux["z_loss"]
        return ConceptMoECausalLMOutput(loss=loss, logits=logits, aux=aux, chunk_stats=out.chunk_stats, cache=out.cache)
