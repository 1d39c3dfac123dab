"""ConceptMoE configuration: one dataclass-like HF config, validated, with named presets.

Everything the paper varies is a field: encoder / concept / decoder depth, experts, the chunking mechanism
(ConceptMoE §3.2-3.4, docs/paper.md §2-§8) and the compute reallocation of §3.5 (docs/paper.md §9:
``concept_top_k`` for strategy 1, ``concept_loop`` for strategy 2,
``concept_d_model`` / ``concept_num_experts`` for strategy 3).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

CHUNKING_MODES = ("dynamic", "fixed", "none")
BOUNDARY_ROUTERS = ("cosine", "linear")
BOUNDARY_ROUTER_INITS = ("identity", "random")
CONCEPT_MERGES = ("sum", "last")
FFN_KINDS = ("moe", "dense")
QK_NORMS = ("none", "head", "full")

# Fields renamed since the first release: configs saved under the old name still load (mapped, with a warning).
RENAMED_FIELDS = {
    "router": "boundary_router",
    "router_init": "boundary_router_init",
    "merge": "concept_merge",
    "router_z_loss_weight": "moe_z_loss_weight",
}
# The chunking settings a built model may change in place (``set_chunking``): none of them changes a weight shape.
CHUNKING_SETTINGS = (
    "chunking",
    "target_r",
    "noise_tau",
    "ratio_loss_weight",
    "target_r_by_modality",
    "ratio_loss_modality_weights",
    "boundary_token_ids",
    "balance_loss_weight",
    "moe_z_loss_weight",
)


def init_fields(cls, skip: tuple = ()) -> set[str]:
    """A config class's fields: the named parameters of ``cls.__init__``, less ``self`` and ``skip`` (the one way
    fields are discovered: ``ConceptMoEVLMConfig.from_preset`` and the run config's ``model.overrides`` check)."""
    params = inspect.signature(cls.__init__).parameters.values()
    return {p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD and p.name not in ("self", *skip)}


def rename_legacy_fields(fields: dict, owner: str, renamed: dict[str, str] = RENAMED_FIELDS) -> dict:
    """``fields`` with every old field name replaced by its new one (a warning each); both names at once is an error."""
    out = dict(fields)
    for old, new in renamed.items():
        if old not in out:
            continue
        if new in out:
            raise ValueError(f"{owner}: '{old}' was renamed to '{new}'; pass only '{new}'")
        logger.warning("%s: field '%s' was renamed to '%s'; reading it as '%s'", owner, old, new, new)
        out[new] = out.pop(old)
    return out


# ----------------------------------------------------------------------------- validation as a table of rules
def int_at_least(low: int):
    """A rule: an int (a bool is not one) >= low; vlm/config.py uses it too."""
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


def _number(v) -> bool:
    """An int or float, not a bool (JSON's true / false would otherwise pass as 1 / 0)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _one_of(allowed: tuple):
    return lambda v: v in allowed


@dataclass(frozen=True)
class Rule:
    """``check(config)`` must hold, else ``field`` is invalid: ``message`` (formatted with ``c`` = the config)."""

    field: str
    check: Callable[[Any], bool]
    message: str


def field_rule(field: str, check: Callable[[Any], bool], message: str) -> Rule:
    """A rule on one field's value alone."""
    return Rule(field, lambda c: check(getattr(c, field)), message)


def check_rules(config, rules: tuple[Rule, ...]) -> None:
    """Raise ``ValueError`` naming the first field whose rule fails, its value and what is allowed."""
    for rule in rules:
        if not rule.check(config):
            value = getattr(config, rule.field)
            raise ValueError(
                f"{type(config).__name__}.{rule.field}={value!r} is invalid: {rule.message.format(c=config)}"
            )


def _modality_targets_ok(c) -> bool:
    targets = c.target_r_by_modality
    return targets is None or (c.chunking == "dynamic" and all(r > 1.0 for r in targets.values()))


def _modality_weights_ok(c) -> bool:
    weights = c.ratio_loss_modality_weights
    if weights is None:
        return True
    targets = c.target_r_by_modality
    return targets is not None and set(weights) <= set(targets) and all(w >= 0 for w in weights.values())


def _boundary_ids_ok(c) -> bool:
    ids = c.boundary_token_ids
    if ids is None:
        return True
    return c.chunked and isinstance(ids, list) and all(int_at_least(0)(i) and i < c.vocab_size for i in ids)


RULES: tuple[Rule, ...] = (
    *(
        field_rule(f, int_at_least(1), "must be an integer >= 1")
        for f in ("vocab_size", "d_model", "n_heads", "n_kv_heads", "num_experts", "expert_dim")
    ),
    *(
        field_rule(f, int_at_least(0), "must be an integer >= 0")
        for f in ("encoder_layers", "concept_layers", "decoder_layers", "shared_experts")
    ),
    Rule(
        "shared_expert_dim",
        lambda c: c.shared_expert_dim is None or (int_at_least(1)(c.shared_expert_dim) and c.shared_experts >= 1),
        "must be None or an int >= 1, with shared_experts >= 1 (it sets the shared SwiGLU's width)",
    ),
    Rule(
        "shared_expert_gate",
        lambda c: not c.shared_expert_gate or c.shared_experts >= 1,
        "needs shared_experts >= 1 (it gates the shared expert's output)",
    ),
    field_rule("chunking", _one_of(CHUNKING_MODES), f"allowed values are {CHUNKING_MODES}"),
    field_rule("boundary_router", _one_of(BOUNDARY_ROUTERS), f"allowed values are {BOUNDARY_ROUTERS}"),
    field_rule("boundary_router_init", _one_of(BOUNDARY_ROUTER_INITS), f"allowed values are {BOUNDARY_ROUTER_INITS}"),
    field_rule("concept_merge", _one_of(CONCEPT_MERGES), f"allowed values are {CONCEPT_MERGES}"),
    field_rule("ffn", _one_of(FFN_KINDS), f"allowed values are {FFN_KINDS}"),
    field_rule("qk_norm", _one_of(QK_NORMS), f"allowed values are {QK_NORMS}"),
    Rule("n_kv_heads", lambda c: c.n_heads % c.n_kv_heads == 0, "must divide n_heads={c.n_heads}"),
    Rule(
        "d_model",
        lambda c: c.head_dim is not None or c.d_model % c.n_heads == 0,
        "must be divisible by n_heads={c.n_heads} (or set head_dim)",
    ),
    Rule("top_k", lambda c: 1 <= c.top_k <= c.num_experts, "must be in [1, num_experts={c.num_experts}]"),
    *(
        field_rule(f, int_at_least(1), "must be an int >= 1 (None: the token-level value)")
        for f in ("concept_d_model", "concept_num_experts", "concept_top_k", "concept_expert_dim")
    ),
    Rule(
        "concept_top_k",
        lambda c: c.concept_top_k <= c.concept_num_experts,
        "must be in [1, concept_num_experts={c.concept_num_experts}]",
    ),
    Rule(
        "concept_d_model",
        lambda c: c.concept_d_model == c.d_model or c.concept_d_model % c.n_heads == 0,
        "must be divisible by n_heads={c.n_heads}",
    ),
    field_rule("concept_loop", int_at_least(1), "must be an int >= 1"),
    Rule(
        "concept_loop_layers",
        lambda c: int_at_least(0)(c.concept_loop_layers) and c.concept_loop_layers <= c.concept_layers,
        "must be in [0, concept_layers={c.concept_layers}] (0 = loop all concept layers)",
    ),
    field_rule("target_r", lambda r: r >= 1.0, "must be >= 1 (R = N / M)"),
    Rule(
        "target_r",
        lambda c: c.chunking != "dynamic" or c.target_r > 1.0,
        "must be > 1 with chunking='dynamic' (the ratio loss Eq. 4 divides by R - 1); use chunking='none' for R=1",
    ),
    Rule("head_dim", lambda c: c.token_head_dim % 2 == 0, "must be even (RoPE rotates pairs of channels)"),
    Rule("concept_d_model", lambda c: c.concept_head_dim % 2 == 0, "must give an even per-head width (RoPE)"),
    Rule(
        "concept_d_model",
        lambda c: c.chunked or c.concept_d_model == c.d_model,
        "must equal d_model with chunking='none' (the d <-> d_c projectors belong to chunk / dechunk)",
    ),
    field_rule("noise_tau", lambda t: t >= 0.0, "must be >= 0 (0 disables boundary noise; the paper uses 6)"),
    field_rule("ratio_loss_weight", lambda w: w >= 0.0, "must be >= 0"),
    field_rule(
        "embedding_init_std",
        lambda s: s is None or (_number(s) and s > 0),
        "must be None (initializer_range) or a number > 0",
    ),
    field_rule(
        "concept_norm_init",
        lambda s: _number(s) and s >= 0,
        "must be a number >= 0 (the dechunked concept's scale at init; 1: a unit-RMS concept)",
    ),
    Rule(
        "target_r_by_modality", _modality_targets_ok, "must be None or {{modality id: R > 1}} with chunking='dynamic'"
    ),
    Rule(
        "ratio_loss_modality_weights",
        _modality_weights_ok,
        "must be None or {{modality id: weight >= 0}} for modalities listed in target_r_by_modality",
    ),
    Rule(
        "boundary_token_ids",
        _boundary_ids_ok,
        "must be None or a list of token ids in [0, vocab_size={c.vocab_size}), with chunking 'dynamic' or 'fixed'",
    ),
    field_rule("balance_loss_weight", lambda w: w >= 0.0, "must be >= 0"),
    field_rule("moe_z_loss_weight", lambda w: w >= 0.0, "must be >= 0"),
    Rule(
        "joint_layers",
        lambda c: int_at_least(0)(c.joint_layers) and c.joint_layers <= c.decoder_layers,
        "must be in [0, decoder_layers={c.decoder_layers}]",
    ),
)


def _str_keyed(mapping: dict | None) -> dict | None:
    """JSON object keys are strings: keep modality ids so (read them back with int())."""
    return None if mapping is None else {str(k): float(v) for k, v in mapping.items()}


# ----------------------------------------------------------------------------- from __init__ arguments to fields
def read_aliases(fields: dict, kwargs: dict) -> dict:
    """``top_k`` given under its stored name ``num_experts_per_tok`` (see ``attribute_map``), and the old field names of
    a config saved before the renames (they arrive in, and are popped from, ``kwargs``)."""
    fields = dict(fields)
    stored_top_k = fields.pop("num_experts_per_tok")
    if stored_top_k is not None:
        fields["top_k"] = stored_top_k
    legacy = rename_legacy_fields({k: kwargs.pop(k) for k in RENAMED_FIELDS if k in kwargs}, "ConceptMoEConfig")
    return {**fields, **legacy}


def fill_defaults(fields: dict) -> dict:
    """None means "the same as": ``n_kv_heads`` the query heads, every ``concept_*`` field its token-level value
    (stored resolved), ``joint_layers`` every decoder layer."""
    same_as = {
        "n_kv_heads": "n_heads",
        "concept_d_model": "d_model",
        "concept_num_experts": "num_experts",
        "concept_top_k": "top_k",
        "concept_expert_dim": "expert_dim",
        "joint_layers": "decoder_layers",
    }
    return {**fields, **{k: fields[base] for k, base in same_as.items() if fields[k] is None}}


def normalise(fields: dict) -> dict:
    """R and tau as floats; per-modality maps with string keys (``_str_keyed``), as JSON will store them; boundary
    token ids as a list."""
    out = {**fields, "target_r": float(fields["target_r"]), "noise_tau": float(fields["noise_tau"])}
    for name in ("target_r_by_modality", "ratio_loss_modality_weights"):
        out[name] = _str_keyed(fields[name])
    ids = fields["boundary_token_ids"]
    out["boundary_token_ids"] = list(ids) if isinstance(ids, (list, tuple)) else ids
    return out


def resolve_fields(fields: dict, kwargs: dict) -> dict:
    """The stored value of every field from the ``__init__`` arguments (``kwargs`` loses the old field names)."""
    return normalise(fill_defaults(read_aliases(fields, kwargs)))


class ConceptMoEConfig(PretrainedConfig):
    """Configuration of :class:`vlm.ConceptMoEForCausalLM`.

    Chunking: ``chunking="none"`` is the plain MoE baseline (R = 1, no chunk/dechunk modules exist);
    ``"dynamic"`` learns boundaries (Eq. 2) held at ``target_r`` by the ratio loss (Eq. 3-4);
    ``"fixed"`` puts a boundary every ``target_r`` tokens (the paper's Fig. 8 ablation).
    ``boundary_router`` picks how boundaries are scored (``cosine``, Eq. 2, or ``linear``, Fig. 9) and
    ``boundary_router_init`` how its projections start; ``concept_merge`` how a chunk's tokens become one concept.
    ``boundary_token_ids`` (an extension, not in the paper) forces a boundary on every occurrence of those tokens,
    in training, prefill and decoding alike: on the chat template's ``<|assistant|>`` it makes the concept model read
    the whole question before the answer's first token is predicted (docs/seeing.md, "What in chunking slows binding").

    The concept model's fields (``concept_*``) default to the token-level values and are stored resolved (always
    ints after construction); they are how the saved compute is reallocated (the paper's §3.5):
      1. ``concept_top_k`` > ``top_k``: more active experts per concept;
      2. ``concept_loop`` > 1: the middle ``concept_loop_layers`` concept layers run ``concept_loop``
         times with shared weights;
      3. ``concept_d_model`` > ``d_model`` (with fewer ``concept_num_experts``): a wider concept model
         behind d -> d_c and d_c -> d projectors.

    Weights start at std ``initializer_range``, the token embeddings at ``embedding_init_std`` when it is set
    (unit-scale embeddings, as in muP: Yang et al. 2021, "Tensor Programs V"). At a large ``initializer_range``
    (0.1 = 0.8 / sqrt(d) at d = 64) the layers' outputs otherwise swamp embeddings of the same std, and with the
    dechunked concept added to each token (Eq. 9-10) too little of the token's own identity is left: the chunked
    ``tiny`` then fails to copy for some seeds (``tests/vlm/backbone/test_copying.py``; docs/seeing.md,
    "Initialisation"). With tied embeddings the output layer shares that std. ``concept_norm_init`` is the
    starting gain of the concept model's output norm (unit RMS at 1), so the dechunked concept added to each token
    (Eq. 9-10) starts scaled by it; below 1 the token's own state is a larger share of what the decoder reads.
    """

    model_type = "conceptmoe"
    keys_to_ignore_at_inference = ["past_key_values"]
    # ``top_k`` (experts per token) is stored as ``num_experts_per_tok``: under its own name generation would
    # read it as the sampling top-k (GenerationConfig.from_model_config copies same-named fields).
    attribute_map = {"top_k": "num_experts_per_tok"}

    def __init__(
        self,
        vocab_size: int = 512,
        d_model: int = 64,
        n_heads: int = 4,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        encoder_layers: int = 1,
        concept_layers: int = 2,
        decoder_layers: int = 1,
        ffn: str = "moe",
        num_experts: int = 8,
        top_k: int = 2,
        expert_dim: int = 64,
        shared_experts: int = 0,
        shared_expert_dim: int | None = None,
        shared_expert_gate: bool = False,
        dense_dim: int | None = None,
        norm_topk_prob: bool = True,
        balance_loss_weight: float = 0.01,
        moe_z_loss_weight: float = 0.0,
        concept_d_model: int | None = None,
        concept_num_experts: int | None = None,
        concept_top_k: int | None = None,
        concept_expert_dim: int | None = None,
        concept_loop: int = 1,
        concept_loop_layers: int = 0,
        target_r: float = 2.0,
        chunking: str = "dynamic",
        boundary_router: str = "cosine",
        boundary_router_init: str = "identity",
        concept_merge: str = "sum",
        noise_tau: float = 6.0,
        ratio_loss_weight: float = 0.03,
        target_r_by_modality: dict | None = None,
        ratio_loss_modality_weights: dict | None = None,
        boundary_token_ids: list[int] | None = None,
        joint_layers: int | None = None,
        joint_zero_init: bool = False,
        attention_bias: bool = False,
        qk_norm: str = "none",
        rope_theta: float = 10000.0,
        rms_norm_eps: float = 1e-6,
        max_position_embeddings: int = 32768,
        initializer_range: float = 0.02,
        embedding_init_std: float | None = None,
        concept_norm_init: float = 1.0,
        tie_word_embeddings: bool = False,
        num_experts_per_tok: int | None = None,
        **kwargs,
    ):
        fields = {k: v for k, v in locals().items() if k not in ("self", "kwargs", "tie_word_embeddings", "__class__")}
        for name, value in resolve_fields(fields, kwargs).items():
            setattr(self, name, value)
        kwargs.setdefault("tie_word_embeddings", tie_word_embeddings)
        super().__init__(**kwargs)
        self.tie_word_embeddings = tie_word_embeddings
        self.validate_fields()

    # ----------------------------------------------------------------- derived values
    @property
    def chunked(self) -> bool:
        """True when the model has chunk / dechunk modules (``dynamic`` or ``fixed``)."""
        return self.chunking != "none"

    @property
    def effective_r(self) -> float:
        """The compression the model is held at: ``target_r``, or 1 without chunking."""
        return self.target_r if self.chunked else 1.0

    @property
    def hidden_size(self) -> int:  # HF-conventional alias
        return self.d_model

    @property
    def num_hidden_layers(self) -> int:  # HF-conventional alias (used by caches / generation)
        return self.encoder_layers + self.concept_layers + self.decoder_layers

    @property
    def num_attention_heads(self) -> int:  # HF-conventional alias
        return self.n_heads

    @property
    def token_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def concept_head_dim(self) -> int:
        if self.concept_d_model == self.d_model:
            return self.token_head_dim
        return self.concept_d_model // self.n_heads

    @property
    def dense_ffn_dim(self) -> int:
        """Dense FFN width: by default the active width of the MoE (same active FLOPs)."""
        return self.dense_dim or (self.top_k + self.shared_experts) * self.expert_dim

    def concept_schedule(self) -> list[int]:
        """Indices of the concept layers in execution order (strategy 2 repeats the middle block).

        With ``concept_loop = n`` and ``concept_loop_layers = m`` the middle m layers run n times:
        L_C = 6, m = 2, n = 2 -> [0, 1, 2, 3, 2, 3, 4, 5]. ``m = 0`` loops all concept layers.
        """
        n_layers = self.concept_layers
        m = self.concept_loop_layers or n_layers
        start = (n_layers - m) // 2
        middle = list(range(start, start + m))
        return list(range(start)) + middle * self.concept_loop + list(range(start + m, n_layers))

    def _get_generation_parameters(self) -> dict:
        """``top_k`` here is the MoE's experts per token (an alias, see attribute_map), not a sampling setting."""
        return {k: v for k, v in super()._get_generation_parameters().items() if k != "top_k"}

    def validate_fields(self) -> None:
        """Raise ``ValueError`` naming the first invalid field and its allowed values (the rules in ``RULES``)."""
        check_rules(self, RULES)

    # ----------------------------------------------------------------- presets
    @classmethod
    def from_preset(cls, name: str, **overrides) -> ConceptMoEConfig:
        """Build a named configuration (``tiny``, ``small`` and their baselines ``tiny-moe``, ``small-moe``).

        ``overrides`` replace preset fields, e.g. ``from_preset("tiny", target_r=1.5, concept_merge="last")``; an old
        field name (``RENAMED_FIELDS``) is read as its new one.
        """
        overrides = rename_legacy_fields(overrides, "ConceptMoEConfig")
        from vlm.backbone.presets import PRESETS

        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; allowed values are {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})
