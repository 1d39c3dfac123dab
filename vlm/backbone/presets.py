"""Named configurations. Each ConceptMoE preset has a compute-matched plain-MoE baseline ``<name>-moe``.

The ConceptMoE presets are strategy 1 of the paper's §3.5 (docs/paper.md §9) at R = 2: the same layers as the
baseline, with the concept model's top-k raised until total params and non-attention FLOPs per token match the baseline
within 2% (``vlm.accounting.flops.match(baseline, 2.0, 1)`` reproduces them; a test checks it). At d = 64 the chunk
module and joint-decoding projections alone are 2.9% of the parameters, so ``tiny`` also gives its
concept model one expert fewer (7 of 8); ``small`` keeps all 32.

Ratio-loss weight λ: the paper uses 0.03 (inherited from H-Net) for runs of hundreds of billions of
tokens. The tiny and small presets exist for runs of a few hundred CPU steps, where λ = 0.03 lets R
overshoot (8-15 early, still ~3 after 800 steps on a d=64 prototype); λ = 0.3 settles R within ~10% of
the target in ~150 steps. Use ``ratio_loss_weight=0.03`` for long runs (docs/paper.md §12.12).
"""

TINY_MOE = dict(
    vocab_size=512,
    d_model=64,
    n_heads=4,
    n_kv_heads=2,
    encoder_layers=1,
    concept_layers=2,
    decoder_layers=1,
    num_experts=8,
    top_k=2,
    expert_dim=64,
    shared_experts=1,
    chunking="none",
    target_r=1.0,
    max_position_embeddings=4096,
)

SMALL_MOE = dict(
    vocab_size=8192,
    d_model=256,
    n_heads=8,
    n_kv_heads=4,
    encoder_layers=2,
    concept_layers=6,
    decoder_layers=2,
    num_experts=32,
    top_k=4,
    expert_dim=128,
    shared_experts=1,
    chunking="none",
    target_r=1.0,
    max_position_embeddings=8192,
)

# Our guess at a paper-scale baseline in the spirit of MoE-A0.5B-12B (docs/paper.md §12.12). The paper gives
# L_E = L_D = 4 and top-8 (§4), not widths, expert counts, GQA or vocabulary. 24 layers (4 + 16 + 4), d = 1536,
# 12 heads of 128 with 4 KV heads, 256 fine-grained experts of width 384, top-8, no shared expert, 128K vocabulary:
# 11.4B total, 0.50B active without embeddings / LM head (0.89B with them). With top-8, total / active
# expert params is E / 8, so 12B / 0.5B needs about 250+ experts; 64-128 would give ~6B or ~1B active.
# For accounting only (`python -m vlm.accounting.flops`): not in PRESETS, never instantiated by the project.
PAPER_SCALE_MOE = dict(
    vocab_size=128000,
    d_model=1536,
    n_heads=12,
    n_kv_heads=4,
    encoder_layers=4,
    concept_layers=16,
    decoder_layers=4,
    num_experts=256,
    top_k=8,
    expert_dim=384,
    shared_experts=0,
    chunking="none",
    target_r=1.0,
    max_position_embeddings=32768,
)

CHUNKED = dict(chunking="dynamic", target_r=2.0, ratio_loss_weight=0.3, noise_tau=6.0, concept_merge="sum")

PRESETS: dict[str, dict] = {
    "tiny-moe": TINY_MOE,
    "tiny": {**TINY_MOE, **CHUNKED, "concept_top_k": 5, "concept_num_experts": 7},
    "small-moe": SMALL_MOE,
    "small": {**SMALL_MOE, **CHUNKED, "concept_top_k": 10},
}
