"""ConceptMoE configuration: one dataclass-like HF config, validated, with named presets.

Field names follow the project's public API (issue 2). Everything the paper varies is a field:
encoder / concept / decoder depth, experts, the chunking mechanism (SPEC §1-§5) and the compute
reallocation of SPEC §6 (``concept_top_k`` for strategy 1, ``concept_loop`` for strategy 2,
``concept_d_model`` / ``concept_num_experts`` for strategy 3).
"""

from __future__ import annotations

from transformers import PretrainedConfig

CHUNKING_MODES = ("dynamic", "fixed", "none")
ROUTERS = ("cosine", "linear")
MERGES = ("sum", "last")
FFN_KINDS = ("moe", "dense")
QK_NORMS = ("none", "head", "full")
ROUTER_INITS = ("identity", "random")


class ConceptMoEConfig(PretrainedConfig):
    """Configuration of :class:`vlm.ConceptMoEForCausalLM`.

    Chunking: ``chunking="none"`` is the plain MoE baseline (R = 1, no chunk/dechunk modules exist);
    ``"dynamic"`` learns boundaries (Eq. 2) held at ``target_r`` by the ratio loss (Eq. 3-4);
    ``"fixed"`` puts a boundary every ``target_r`` tokens (the paper's Fig. 8 ablation).

    Concept-model overrides (``concept_*``) default to the token-level values; they are how the
    saved compute is reallocated (SPEC §6):
      1. ``concept_top_k`` > ``top_k``: more active experts per concept;
      2. ``concept_loop`` > 1: the middle ``concept_loop_layers`` concept layers run ``concept_loop``
         times with shared weights;
      3. ``concept_d_model`` > ``d_model`` (with fewer ``concept_num_experts``): a wider concept model
         behind d -> d_c and d_c -> d projectors.
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
        router_z_loss_weight: float = 0.0,
        concept_d_model: int | None = None,
        concept_num_experts: int | None = None,
        concept_top_k: int | None = None,
        concept_expert_dim: int | None = None,
        concept_loop: int = 1,
        concept_loop_layers: int = 0,
        target_r: float = 2.0,
        chunking: str = "dynamic",
        router: str = "cosine",
        router_init: str = "identity",
        merge: str = "sum",
        noise_tau: float = 6.0,
        ratio_loss_weight: float = 0.03,
        target_r_by_modality: dict | None = None,
        ratio_loss_modality_weights: dict | None = None,
        joint_layers: int | None = None,
        joint_zero_init: bool = False,
        attention_bias: bool = False,
        qk_norm: str = "none",
        rope_theta: float = 10000.0,
        rms_norm_eps: float = 1e-6,
        max_position_embeddings: int = 32768,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = False,
        num_experts_per_tok: int | None = None,
        **kwargs,
    ):
        if num_experts_per_tok is not None:  # the stored name of top_k (see attribute_map)
            top_k = num_experts_per_tok
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        self.head_dim = head_dim
        self.encoder_layers = encoder_layers
        self.concept_layers = concept_layers
        self.decoder_layers = decoder_layers
        self.ffn = ffn
        self.num_experts = num_experts
        self.top_k = top_k
        self.expert_dim = expert_dim
        self.shared_experts = shared_experts
        self.shared_expert_dim = shared_expert_dim
        self.shared_expert_gate = shared_expert_gate
        self.dense_dim = dense_dim
        self.norm_topk_prob = norm_topk_prob
        self.balance_loss_weight = balance_loss_weight
        self.router_z_loss_weight = router_z_loss_weight
        self.concept_d_model = concept_d_model
        self.concept_num_experts = concept_num_experts
        self.concept_top_k = concept_top_k
        self.concept_expert_dim = concept_expert_dim
        self.concept_loop = concept_loop
        self.concept_loop_layers = concept_loop_layers
        self.target_r = float(target_r)
        self.chunking = chunking
        self.router = router
        self.router_init = router_init
        self.merge = merge
        self.noise_tau = float(noise_tau)
        self.ratio_loss_weight = ratio_loss_weight
        # JSON object keys are strings: keep them so, and read them with int() (modality ids)
        self.target_r_by_modality = (
            None if target_r_by_modality is None else {str(k): float(v) for k, v in target_r_by_modality.items()}
        )
        self.ratio_loss_modality_weights = (
            None
            if ratio_loss_modality_weights is None
            else {str(k): float(v) for k, v in ratio_loss_modality_weights.items()}
        )
        self.joint_layers = decoder_layers if joint_layers is None else joint_layers
        self.joint_zero_init = joint_zero_init
        self.attention_bias = attention_bias
        self.qk_norm = qk_norm
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
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
    def concept_width(self) -> int:
        return self.concept_d_model or self.d_model

    @property
    def concept_head_dim(self) -> int:
        if self.concept_width == self.d_model:
            return self.token_head_dim
        return self.concept_width // self.n_heads

    @property
    def concept_experts(self) -> int:
        return self.concept_num_experts or self.num_experts

    @property
    def concept_k(self) -> int:
        return self.concept_top_k or self.top_k

    @property
    def concept_ffn_dim(self) -> int:
        return self.concept_expert_dim or self.expert_dim

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

    # ----------------------------------------------------------------- validation
    def validate_fields(self) -> None:
        """Raise ``ValueError`` naming the first invalid field and its allowed values."""

        def need(ok: bool, field: str, allowed: str) -> None:
            if not ok:
                raise ValueError(f"ConceptMoEConfig.{field}={getattr(self, field)!r} is invalid: {allowed}")

        def positive_int(field: str) -> None:
            value = getattr(self, field)
            need(isinstance(value, int) and value >= 1, field, "must be an integer >= 1")

        def non_negative_int(field: str) -> None:
            value = getattr(self, field)
            need(isinstance(value, int) and value >= 0, field, "must be an integer >= 0")

        for field in ("vocab_size", "d_model", "n_heads", "n_kv_heads", "num_experts", "expert_dim"):
            positive_int(field)
        for field in ("encoder_layers", "concept_layers", "decoder_layers", "shared_experts"):
            non_negative_int(field)
        need(
            self.shared_expert_dim is None
            or (isinstance(self.shared_expert_dim, int) and self.shared_expert_dim >= 1 and self.shared_experts >= 1),
            "shared_expert_dim",
            "must be None or an int >= 1, with shared_experts >= 1 (it sets the shared SwiGLU's width)",
        )
        need(
            not self.shared_expert_gate or self.shared_experts >= 1,
            "shared_expert_gate",
            "needs shared_experts >= 1 (it gates the shared expert's output)",
        )
        need(self.chunking in CHUNKING_MODES, "chunking", f"allowed values are {CHUNKING_MODES}")
        need(self.router in ROUTERS, "router", f"allowed values are {ROUTERS}")
        need(self.router_init in ROUTER_INITS, "router_init", f"allowed values are {ROUTER_INITS}")
        need(self.merge in MERGES, "merge", f"allowed values are {MERGES}")
        need(self.ffn in FFN_KINDS, "ffn", f"allowed values are {FFN_KINDS}")
        need(self.qk_norm in QK_NORMS, "qk_norm", f"allowed values are {QK_NORMS}")
        need(self.n_heads % self.n_kv_heads == 0, "n_kv_heads", f"must divide n_heads={self.n_heads}")
        need(
            self.head_dim is not None or self.d_model % self.n_heads == 0,
            "d_model",
            f"must be divisible by n_heads={self.n_heads} (or set head_dim)",
        )
        need(1 <= self.top_k <= self.num_experts, "top_k", f"must be in [1, num_experts={self.num_experts}]")
        for field in ("concept_d_model", "concept_num_experts", "concept_top_k", "concept_expert_dim"):
            value = getattr(self, field)
            need(value is None or (isinstance(value, int) and value >= 1), field, "must be None or an int >= 1")
        need(
            1 <= self.concept_k <= self.concept_experts,
            "concept_top_k",
            f"must be in [1, concept experts={self.concept_experts}]",
        )
        need(
            self.concept_width == self.d_model or self.concept_width % self.n_heads == 0,
            "concept_d_model",
            f"must be divisible by n_heads={self.n_heads}",
        )
        need(isinstance(self.concept_loop, int) and self.concept_loop >= 1, "concept_loop", "must be an int >= 1")
        need(
            isinstance(self.concept_loop_layers, int) and 0 <= self.concept_loop_layers <= self.concept_layers,
            "concept_loop_layers",
            f"must be in [0, concept_layers={self.concept_layers}] (0 = loop all concept layers)",
        )
        need(self.target_r >= 1.0, "target_r", "must be >= 1 (R = N / M)")
        need(
            self.chunking != "dynamic" or self.target_r > 1.0,
            "target_r",
            "must be > 1 with chunking='dynamic' (the ratio loss Eq. 4 divides by R - 1); use chunking='none' for R=1",
        )
        need(self.token_head_dim % 2 == 0, "head_dim", "must be even (RoPE rotates pairs of channels)")
        need(self.concept_head_dim % 2 == 0, "concept_d_model", "must give an even per-head width (RoPE)")
        need(
            self.chunked or self.concept_width == self.d_model,
            "concept_d_model",
            "must equal d_model with chunking='none' (the d <-> d_c projectors belong to chunk / dechunk)",
        )
        need(self.noise_tau >= 0.0, "noise_tau", "must be >= 0 (0 disables boundary noise; the paper uses 6)")
        need(self.ratio_loss_weight >= 0.0, "ratio_loss_weight", "must be >= 0")
        need(
            self.target_r_by_modality is None
            or (self.chunking == "dynamic" and all(r > 1.0 for r in self.target_r_by_modality.values())),
            "target_r_by_modality",
            "must be None or {modality id: R > 1} with chunking='dynamic'",
        )
        need(
            self.ratio_loss_modality_weights is None
            or (
                self.target_r_by_modality is not None
                and set(self.ratio_loss_modality_weights) <= set(self.target_r_by_modality)
                and all(w >= 0 for w in self.ratio_loss_modality_weights.values())
            ),
            "ratio_loss_modality_weights",
            "must be None or {modality id: weight >= 0} for modalities listed in target_r_by_modality",
        )
        need(self.balance_loss_weight >= 0.0, "balance_loss_weight", "must be >= 0")
        need(self.router_z_loss_weight >= 0.0, "router_z_loss_weight", "must be >= 0")
        need(
            isinstance(self.joint_layers, int) and 0 <= self.joint_layers <= self.decoder_layers,
            "joint_layers",
            f"must be in [0, decoder_layers={self.decoder_layers}]",
        )

    # ----------------------------------------------------------------- presets
    @classmethod
    def from_preset(cls, name: str, **overrides) -> ConceptMoEConfig:
        """Build a named configuration (``tiny``, ``small`` and their baselines ``tiny-moe``, ``small-moe``).

        ``overrides`` replace preset fields, e.g. ``from_preset("tiny", target_r=1.5, merge="last")``.
        """
        from vlm.backbone.presets import PRESETS

        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; allowed values are {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})
