"""Convert a pretrained Hugging Face MoE into a ConceptMoE for continual training (ConceptMoE §4.3, Table 6).

The first ``encoder_layers`` source layers become the encoder, the last ``decoder_layers`` the decoder and the
rest the concept model; embeddings, norms, attention, routers and experts are copied exactly. What the paper
adds for CT is new: the chunk module (q / k projections, random init), last-token merging, zero-initialised
joint-decoding projectors in every decoder layer (Eq. 11), and, optionally, the compute reallocation of §3.5
(docs/paper.md §9; ``concept_top_k``: strategy 1; ``concept_loop`` over ``concept_loop_layers`` middle layers:
strategy 2).
With ``chunking="none"`` the converted model computes exactly what the source computes.

A checkpoint folder is read tensor by tensor (safetensors only) and checked first: every tensor the source
architecture has must be there with its shape, or the conversion is refused (:class:`ConversionError`, one line);
tensors it does not have are refused too unless ``allow_extra`` (then named in a warning and in the report).

Supported families: see :data:`FAMILIES`; anything else (dense models included) is refused with the list.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from vlm.accounting.flops import count, match_report
from vlm.accounting.source_checkpoint import ConversionError, first_line, listed, read_checkpoint
from vlm.backbone.config import ConceptMoEConfig
from vlm.backbone.model import ConceptMoEForCausalLM

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Family:
    """Where one HF MoE family keeps what the ConceptMoE block needs (config attribute names and layout).

    ``experts`` / ``expert_dim``: routed expert count and width; ``qk_norm``: "none", "head" (per head,
    Qwen3) or "full" (over all heads, before the split, OLMoE); ``qkv_bias``: attribute enabling q/k/v
    biases only; ``all_bias``: attribute enabling q/k/v *and* o_proj biases (o_proj bias has no
    counterpart here, so it is refused); ``norm_topk``: attribute of the renormalisation flag (None: always
    renormalised, Mixtral); ``gated_shared``: a sigmoid-gated shared expert of its own width (Qwen2-MoE).
    ``saved_moe`` / ``saved_experts``: how ``save_pretrained`` names the MoE block and each expert's gate / up /
    down projection (one tensor per expert on disk, fused in memory).
    """

    experts: str
    expert_dim: str
    qk_norm: str = "none"
    qkv_bias: str | None = None
    all_bias: str | None = None
    norm_topk: str | None = "norm_topk_prob"
    gated_shared: bool = False
    saved_moe: str = "mlp"
    saved_experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


FAMILIES: dict[str, Family] = {
    "OlmoeForCausalLM": Family("num_experts", "intermediate_size", qk_norm="full", all_bias="attention_bias"),
    "Qwen2MoeForCausalLM": Family("num_experts", "moe_intermediate_size", qkv_bias="qkv_bias", gated_shared=True),
    "Qwen3MoeForCausalLM": Family("num_experts", "moe_intermediate_size", qk_norm="head", all_bias="attention_bias"),
    "MixtralForCausalLM": Family(
        "num_local_experts",
        "intermediate_size",
        norm_topk=None,
        saved_moe="block_sparse_moe",
        saved_experts=("w1", "w3", "w2"),
    ),
}

# Source weight suffix inside ``model.layers.<i>.`` -> ConceptMoE Block suffix. Experts are handled apart.
_LAYER_KEYS = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    **{f"self_attn.{p}_proj.{w}": f"attn.{p}_proj.{w}" for p in "qkvo" for w in ("weight", "bias")},
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "mlp.gate.weight": "ffn.router.weight",
    **{f"mlp.shared_expert.{p}.weight": f"ffn.shared.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")},
    "mlp.shared_expert_gate.weight": "ffn.shared_gate.weight",
}
_TOP_KEYS = {"model.embed_tokens.weight": "model.embed_tokens.weight", "model.norm.weight": "model.norm.weight"}
_TOP_KEYS["lm_head.weight"] = "lm_head.weight"
# What conversion adds (initialised by ConceptMoEForCausalLM, never read from the source).
_NEW_KEYS = re.compile(r"model\.chunker\..*|model\.concept_norm\.weight|.*\.attn\.[qkv]_c\.weight")


def family_of(hf_config: PretrainedConfig) -> tuple[str, Family]:
    """The supported family named by ``architectures`` (config.json), else a one-line ``ValueError``."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in FAMILIES:
            return arch, FAMILIES[arch]
    found = archs[0] if archs else f"model_type={getattr(hf_config, 'model_type', None)!r}"
    raise ValueError(f"unsupported architecture {found}: supported MoE families are {', '.join(FAMILIES)}")


def source_fields(hf_config: PretrainedConfig) -> dict:
    """ConceptMoEConfig fields equal to the source model (a plain MoE: ``chunking="none"``, all layers in the
    concept model). Raises ``ValueError`` naming whatever the ConceptMoE block cannot reproduce exactly."""
    arch, fam = family_of(hf_config)
    c = hf_config

    def refuse(what: str) -> None:
        raise ValueError(f"{arch}: {what} is not supported by the conversion")

    if getattr(c, "hidden_act", "silu") != "silu":
        refuse(f"hidden_act={c.hidden_act!r} (experts are SwiGLU)")
    rope = dict(getattr(c, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        refuse(f"rope scaling type {rope_type!r} (only default RoPE is implemented)")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        refuse(f"partial_rotary_factor={rope['partial_rotary_factor']}")
    if getattr(c, "sliding_window", None) or getattr(c, "use_sliding_window", False):
        refuse(f"sliding-window attention (sliding_window={c.sliding_window})")
    if any(t != "full_attention" for t in getattr(c, "layer_types", None) or []):
        refuse(f"layer_types={c.layer_types}")
    if getattr(c, "mlp_only_layers", None) or getattr(c, "decoder_sparse_step", 1) != 1:
        refuse("dense (non-MoE) layers (mlp_only_layers / decoder_sparse_step != 1): every layer must be MoE")
    if getattr(c, "clip_qkv", None) is not None:
        refuse(f"clip_qkv={c.clip_qkv}")
    if fam.all_bias and getattr(c, fam.all_bias, False):
        refuse(f"{fam.all_bias}=True (an o_proj bias)")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if fam.qk_norm == "full" and head_dim * c.num_attention_heads != c.hidden_size:
        refuse("head_dim * num_attention_heads != hidden_size with a full-width q/k norm")
    shared = {}
    if fam.gated_shared and getattr(c, "shared_expert_intermediate_size", 0):
        shared = dict(shared_experts=1, shared_expert_dim=c.shared_expert_intermediate_size, shared_expert_gate=True)
    return dict(
        vocab_size=c.vocab_size,
        d_model=c.hidden_size,
        n_heads=c.num_attention_heads,
        n_kv_heads=c.num_key_value_heads or c.num_attention_heads,
        head_dim=head_dim,
        encoder_layers=0,
        concept_layers=c.num_hidden_layers,
        decoder_layers=0,
        num_experts=getattr(c, fam.experts),
        top_k=c.num_experts_per_tok,
        expert_dim=getattr(c, fam.expert_dim),
        norm_topk_prob=True if fam.norm_topk is None else bool(getattr(c, fam.norm_topk)),
        attention_bias=bool(fam.qkv_bias and getattr(c, fam.qkv_bias, False)),
        qk_norm=fam.qk_norm,
        rope_theta=float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))),
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        chunking="none",
        target_r=1.0,
        **shared,
    )


def conversion_configs(
    hf_config: PretrainedConfig,
    *,
    target_r: float = 1.5,
    chunking: str = "dynamic",
    encoder_layers: int = 4,
    decoder_layers: int = 4,
    loop: int = 1,
    loop_layers: int = 0,
    top_k: int | None = None,
    **overrides,
) -> tuple[ConceptMoEConfig, ConceptMoEConfig]:
    """(source-equivalent plain config, converted config): the paper's CT recipe (§4.3) on the source shape.

    ``top_k`` raises the concept model's experts per token (strategy 1), ``loop`` / ``loop_layers`` repeat
    its middle layers (strategy 2); ``overrides`` set any other ConceptMoEConfig field (e.g. ratio_loss_weight).
    """
    base = source_fields(hf_config)
    n_layers = base["concept_layers"]
    if encoder_layers < 0 or decoder_layers < 0 or encoder_layers + decoder_layers > n_layers:
        raise ValueError(
            f"encoder_layers={encoder_layers} + decoder_layers={decoder_layers} must fit in the source's {n_layers}"
        )
    split = dict(
        encoder_layers=encoder_layers,
        concept_layers=n_layers - encoder_layers - decoder_layers,
        decoder_layers=decoder_layers,
    )
    if chunking != "none" and split["concept_layers"] < 1:
        raise ValueError(f"chunking={chunking!r} needs at least one concept layer; lower encoder/decoder layers")
    source = ConceptMoEConfig(**base)
    recipe = dict(
        chunking=chunking,
        target_r=float(target_r) if chunking != "none" else 1.0,
        boundary_router="cosine",
        boundary_router_init="random",  # CT: W_q, W_k start random (§4.3; docs/paper.md §2)
        concept_merge="last",  # CT: last-token merge keeps the structural change small (§4; docs/paper.md §5)
        joint_layers=decoder_layers,  # zero-initialised W^c in every decoder layer (§4.3; docs/paper.md §8)
        joint_zero_init=True,
        concept_top_k=top_k,
        concept_loop=loop,
        concept_loop_layers=loop_layers,
    )
    return source, ConceptMoEConfig(**{**base, **split, **recipe, **overrides})


def convert_state_dict(src_sd: dict[str, torch.Tensor], config: ConceptMoEConfig) -> dict[str, torch.Tensor]:
    """Rename (and re-lay out) source weights for ``ConceptMoEForCausalLM(config)``.

    Source layer i goes to the encoder (i < L_E), the concept model, or the decoder (the last L_D). Fused HF
    experts ``gate_up_proj`` [E, 2F, D] (gate rows first) and ``down_proj`` [E, D, F] are transposed into
    ``w_gate_up`` [E, D, 2F] and ``w_down`` [E, F, D]. Any source weight without a place raises.
    """
    l_e, l_c = config.encoder_layers, config.concept_layers
    out = {}
    for key, w in src_sd.items():
        if key in _TOP_KEYS:
            out[_TOP_KEYS[key]] = w
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", key)
        if m is None:
            raise ValueError(f"source weight {key!r} has no counterpart in ConceptMoE")
        i, rest = int(m.group(1)), m.group(2)
        stack, j = (
            ("encoder", i) if i < l_e else ("concept_model", i - l_e) if i < l_e + l_c else ("decoder", i - l_e - l_c)
        )
        prefix = f"model.{stack}.layers.{j}."
        if rest == "mlp.experts.gate_up_proj":
            out[prefix + "ffn.w_gate_up"] = w.transpose(1, 2).contiguous()
        elif rest == "mlp.experts.down_proj":
            out[prefix + "ffn.w_down"] = w.transpose(1, 2).contiguous()
        elif rest in _LAYER_KEYS:
            out[prefix + _LAYER_KEYS[rest]] = w
        else:
            raise ValueError(f"source weight {key!r} has no counterpart in ConceptMoE")
    return out


@dataclass
class Conversion:
    model: ConceptMoEForCausalLM
    source_config: ConceptMoEConfig  # the source as a plain ConceptMoE (chunking="none"), for accounting
    report: dict = field(default_factory=dict)


def read_source_config(src: str | os.PathLike) -> PretrainedConfig:
    """``config.json`` of a local checkpoint folder, of a supported family; else a one-line ``ConversionError``."""
    if not Path(src).is_dir():
        raise ConversionError(f"{src}: no such checkpoint folder")
    try:
        config = AutoConfig.from_pretrained(src)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConversionError(f"{src}: cannot read config.json ({first_line(e)})") from None
    family_of(config)
    return config


def load_source(src: str | os.PathLike | PreTrainedModel, allow_extra: bool = False):
    """(HF config, state dict, ignored tensor names) of a model, or of a local HF folder whose family, features
    and tensors are checked before any weight is read (see :func:`read_checkpoint`)."""
    if isinstance(src, PreTrainedModel):
        if not getattr(src.config, "architectures", None):
            src.config.architectures = [type(src).__name__]
        return src.config, src.state_dict(), []
    hf_config = read_source_config(src)
    source_fields(hf_config)  # refuse unsupported features before reading any weight
    return (hf_config, *read_checkpoint(src, hf_config, family_of(hf_config)[1], allow_extra))


def convert(
    src: str | os.PathLike | PreTrainedModel, *, seq_len: int = 4096, allow_extra: bool = False, **recipe
) -> Conversion:
    """Convert ``src`` (a supported HF MoE or its folder) into a ``ConceptMoEForCausalLM``.

    ``recipe``: the keyword arguments of :func:`conversion_configs`. The report holds params / FLOPs of the
    source and of the converted model (``vlm.accounting.flops.count``, FLOPs at ``seq_len`` and the target R) and their
    ``match_report``. A folder with tensors the architecture lacks is refused unless ``allow_extra``.
    """
    hf_config, src_sd, ignored = load_source(src, allow_extra)
    arch, _ = family_of(hf_config)
    source_config, config = conversion_configs(hf_config, **recipe)
    dtype = src_sd["model.embed_tokens.weight"].dtype
    model = ConceptMoEForCausalLM(config)
    missing, unexpected = model.load_state_dict(convert_state_dict(src_sd, config), strict=False)
    untouched = [k for k in missing if not _NEW_KEYS.fullmatch(k)]
    if untouched or unexpected:
        raise ConversionError(
            f"weight mapping incomplete: missing {listed(untouched)}, unexpected {listed(unexpected)}"
        )
    model.to(dtype).eval()
    report = dict(
        source_architecture=arch,
        layers=dict(encoder=config.encoder_layers, concept=config.concept_layers, decoder=config.decoder_layers),
        new_weights=sorted(missing),
        ignored_source_tensors=ignored,
        source=count(source_config, seq_len),
        converted=count(config, seq_len),
        match=match_report(source_config, config, seq_len),
    )
    logger.info("converted %s: %d new tensors", arch, len(missing))
    return Conversion(model=model, source_config=source_config, report=report)


_ROWS = [
    ("params_total", "params total", 1e6, "M"),
    ("params_active", "params active", 1e6, "M"),
    ("flops_linear_per_token", "linear FLOPs / token", 1e6, "M"),
    ("flops_attn_per_token", "attention-map FLOPs / token", 1e6, "M"),
    ("flops_per_token", "total FLOPs / token", 1e6, "M"),
    ("kv_cache_per_token", "KV cache elements / token", 1, ""),
]


def format_report(report: dict) -> str:
    """A Markdown table of params / FLOPs before and after conversion, with the after / before ratio."""
    src, dst = report["source"], report["converted"]
    lines = [
        f"{report['source_architecture']} -> ConceptMoE (layers E/C/D = "
        f"{report['layers']['encoder']}/{report['layers']['concept']}/{report['layers']['decoder']}, "
        f"R = {dst['r']:g}, seq_len = {dst['seq_len']})",
        "| quantity | source | converted | ratio |",
        "|---|---|---|---|",
    ]
    for key, name, scale, unit in _ROWS:
        ratio = dst[key] / src[key] if src[key] else float("nan")
        lines.append(f"| {name} | {src[key] / scale:,.3f}{unit} | {dst[key] / scale:,.3f}{unit} | {ratio:.3f} |")
    return "\n".join(lines)


def save_conversion(conversion: Conversion, out_dir: str | os.PathLike) -> None:
    """``save_pretrained`` of the converted model, plus ``conversion_report.json`` next to it."""
    conversion.model.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "conversion_report.json"), "w") as f:
        json.dump(conversion.report, f, indent=2)
