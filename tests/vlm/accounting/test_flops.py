"""vlm.accounting.flops: params against the real model, FLOPs against torch's FlopCounterMode, compute matching."""

# Shape suffixes (docs/paper.md §0): B batch rows, N tokens per row.

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from vlm import ConceptMoEConfig, ConceptMoEForCausalLM
from vlm.accounting.flops import count, format_table, match, match_report
from vlm.backbone.moe import MoE
from vlm.backbone.presets import PAPER_SCALE_MOE

SMALLER = dict(  # small-moe's shape (GQA, shared expert, 2 + L_C + 2 layers) at a fraction of its size
    vocab_size=1000,
    d_model=128,
    n_heads=8,
    n_kv_heads=4,
    encoder_layers=2,
    concept_layers=3,
    decoder_layers=2,
    num_experts=8,
    top_k=2,
    expert_dim=48,
    shared_experts=1,
    target_r=2.0,
)

PARAM_CASES = {
    "tiny-moe": ("tiny-moe", {}),
    "tiny": ("tiny", {}),
    "smaller-small-moe": (None, {**SMALLER, "chunking": "none", "target_r": 1.0}),
    "smaller-small": (None, {**SMALLER, "concept_top_k": 5}),
    "s2-loop": ("tiny", dict(concept_loop=3, concept_loop_layers=1, concept_top_k=3)),
    "s3-wide": (
        "tiny",
        dict(concept_d_model=96, concept_num_experts=4, concept_top_k=2, concept_expert_dim=48),
    ),
    "linear-router": ("tiny", dict(boundary_router="linear")),
    "fixed-chunking": ("tiny", dict(chunking="fixed", concept_d_model=128, concept_top_k=2)),
    "bias-qknorm-head": (None, {**SMALLER, "attention_bias": True, "qk_norm": "head"}),
    "bias-qknorm-full-headdim": ("tiny", dict(attention_bias=True, qk_norm="full", head_dim=24)),
    "dense": ("tiny", dict(ffn="dense")),
    "dense-width": ("tiny-moe", dict(ffn="dense", dense_dim=100)),
    "tied": ("tiny", dict(tie_word_embeddings=True)),
    "no-joint": (None, {**SMALLER, "joint_layers": 1}),
    "gated-shared-width": (None, {**SMALLER, "shared_expert_dim": 40, "shared_expert_gate": True}),
}


def make_config(preset: str | None, overrides: dict) -> ConceptMoEConfig:
    return ConceptMoEConfig.from_preset(preset, **overrides) if preset else ConceptMoEConfig(**overrides)


@pytest.mark.parametrize("case", sorted(PARAM_CASES))
def test_params_total_equals_model(case):
    config = make_config(*PARAM_CASES[case])
    with torch.device("meta"):
        model = ConceptMoEForCausalLM(config)
    assert count(config)["params_total"] == sum(p.numel() for p in model.parameters())


def test_params_active_drops_unused_experts():
    config = ConceptMoEConfig.from_preset("tiny-moe")
    c = count(config)
    layers = config.encoder_layers + config.concept_layers + config.decoder_layers
    unused = layers * (config.num_experts - config.top_k) * 3 * config.d_model * config.expert_dim
    assert c["params_active"] == c["params_total"] - unused
    assert c["params_active_nonembed"] == c["params_active"] - 2 * config.vocab_size * config.d_model


WIDE_LOOP = dict(concept_d_model=96, concept_num_experts=4, concept_top_k=3, concept_loop=2, concept_loop_layers=1)


@pytest.mark.parametrize(
    "preset, overrides",
    [
        ("tiny-moe", {}),
        ("tiny", {}),
        ("tiny", WIDE_LOOP),
        ("tiny-moe", dict(ffn="dense", n_kv_heads=4)),
        ("tiny", dict(shared_expert_dim=40, shared_expert_gate=True)),
    ],
)
def test_flops_match_flop_counter(preset, overrides):
    """Exact: dropless MoE runs one matmul per expert on exactly its tokens; r is the measured N / M.

    The MATH SDPA backend exposes attention as bmm, counted over the full N x N square (no causal
    saving), i.e. twice the causal convention of ``count``. The EMA's block matmul (a bmm outside the
    three stacks) and the lm_head (``model.model`` is called) are excluded.
    """
    torch.manual_seed(0)
    config = ConceptMoEConfig.from_preset(preset, **overrides)
    model = ConceptMoEForCausalLM(config).eval()
    for module in model.modules():
        if isinstance(module, MoE):
            module.dispatch = "loop"  # FlopCounterMode has no formula for grouped_mm; the loop is equal
    n = 48
    ids = torch.randint(0, config.vocab_size, (1, n))
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = model.model(ids)
    m = int(out.chunk.b_BN.sum()) if config.chunked else n
    assert 1 <= m < n or not config.chunked
    c = count(config, seq_len=n, r=n / m)
    per_module = counter.get_flop_counts()
    linear = sum(v for op, v in per_module["Global"].items() if str(op) in ("aten.mm", "aten.addmm"))
    head = 2 * config.d_model * config.vocab_size
    assert linear == pytest.approx((c["flops_linear_per_token"] - head) * n, rel=1e-12)
    attn = sum(
        v
        for name, ops in per_module.items()
        if name.split(".")[-1] in ("encoder", "concept_model", "decoder")
        for op, v in ops.items()
        if str(op) == "aten.bmm"
    )
    assert attn == pytest.approx(2 * c["flops_attn_per_token"] * n, rel=1e-12)


@pytest.mark.parametrize("strategy", [1, 2, 3])
def test_table1_attention_and_kv_reductions(strategy):
    """Concept-only MHA model: the paper's Table 1 R^2, R^2 L_C / (L_C + L_loop), R^1.5 (d_c = sqrt(R) d)
    attention-map reductions and R, R L_C / (L_C + L_loop), sqrt(R) KV-cache reductions."""
    r, d = 4.0, 64
    shape = dict(d_model=d, n_heads=4, encoder_layers=0, concept_layers=4, decoder_layers=0, vocab_size=64)
    base = ConceptMoEConfig(**shape, chunking="none", target_r=1.0)
    knobs = {1: {}, 2: dict(concept_loop=2, concept_loop_layers=2), 3: dict(concept_d_model=2 * d)}[strategy]
    cand = ConceptMoEConfig(**shape, chunking="dynamic", target_r=r, **knobs)
    rep = match_report(base, cand, seq_len=1024)
    attn = {1: r**2, 2: r**2 * 4 / 6, 3: r**1.5}[strategy]
    kv = {1: r, 2: r * 4 / 6, 3: math.sqrt(r)}[strategy]
    assert rep["attn_flops_ratio"] == pytest.approx(1 / attn)
    assert rep["kv_cache_ratio"] == pytest.approx(1 / kv)


BASELINES = {
    "small-moe": ConceptMoEConfig.from_preset("small-moe"),
    "paper": ConceptMoEConfig(**PAPER_SCALE_MOE),
}


@pytest.mark.parametrize("base_name", sorted(BASELINES))
@pytest.mark.parametrize("strategy, r", [(1, 2.0), (1, 1.5), (2, 2.0), (3, 2.0)])
def test_match_within_two_percent(base_name, strategy, r):
    base = BASELINES[base_name]
    config, report = match(base, r, strategy, return_report=True)
    assert report["within_tolerance"] and report["max_mismatch"] <= 0.02
    b, c = count(base), count(config)
    assert abs(c["params_total"] / b["params_total"] - 1) <= 0.02
    assert abs(c["flops_linear_per_token"] / b["flops_linear_per_token"] - 1) <= 0.02
    assert c["flops_attn_per_token"] < b["flops_attn_per_token"]  # the saving the paper leaves unmatched
    assert config.chunking == "dynamic" and config.target_r == r
    for field in ("d_model", "vocab_size", "encoder_layers", "decoder_layers", "concept_layers", "top_k"):
        assert getattr(config, field) == getattr(base, field), field
    config.validate_fields()
    if strategy == 1:
        assert config.concept_top_k > base.top_k and config.concept_loop == 1 and config.concept_d_model == base.d_model
    if strategy == 2:
        assert config.concept_loop > 1 and config.concept_d_model == base.d_model
    if strategy == 3:
        assert config.concept_d_model > base.d_model and config.concept_num_experts < base.num_experts
        assert config.concept_head_dim % 8 == 0
    if base_name == "small-moe":
        with torch.device("meta"):
            model = ConceptMoEForCausalLM(config)
        assert sum(p.numel() for p in model.parameters()) == c["params_total"]


def test_match_pins_overrides_and_warns_when_unreachable(caplog):
    base = ConceptMoEConfig.from_preset("small-moe")
    config = match(base, 2.0, 2, concept_loop_layers=3, boundary_router="linear")
    assert config.concept_loop_layers == 3 and config.boundary_router == "linear"
    with caplog.at_level(logging.WARNING, logger="vlm.accounting.flops"):
        config, report = match(base, 2.0, 1, concept_top_k=base.top_k, return_report=True)
    assert config.concept_top_k == base.top_k and not report["within_tolerance"]
    assert report["flops_linear_mismatch"] < -0.02 and "off by" in caplog.text


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_presets_match_their_baselines(name):
    """vlm/backbone/presets.py: the chunked presets are strategy 1 at R = 2 of their ``-moe`` baselines."""
    base, preset = ConceptMoEConfig.from_preset(f"{name}-moe"), ConceptMoEConfig.from_preset(name)
    report = match_report(base, preset)
    fix = match(base, preset.target_r, 1)
    suggestion = {k: getattr(fix, k) for k in ("concept_top_k", "concept_num_experts")}
    assert report["within_tolerance"], f"{name}: {report}; match(..., 1) suggests {suggestion}"


def test_cli_table():
    table = format_table()
    assert "paper-moe" in table and "S3 R=2" in table and table.count("\n") >= 12
