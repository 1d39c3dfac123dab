"""vlm.accounting.inference_cost: exact numbers on a hand-computable config, identities, and the limits of the
paper's Table 1."""

from __future__ import annotations

import pytest

from vlm import ConceptMoEConfig
from vlm.accounting.flops import count, match
from vlm.accounting.inference_cost import (
    decode_cost,
    distinct_experts,
    ideal_decode_speedup,
    ideal_kv_ratio,
    ideal_prefill_speedup,
    kv_cache_bytes,
    measure_device,
    prefill_cost,
)

# d = 8, 2 heads of 4 (MHA), 1 + 2 + 1 layers, 4 experts of width 4, top-1, vocab 16.
# Per layer: attention weights 8 * (2*2 + 2*2) * 4 = 256, router 8 * 4 = 32, one expert 3 * 8 * 4 = 96, norms 16.
# Linear FLOPs per token: 4 layers * 2 * (256 + 32 + 96) = 3072, LM head 2 * 8 * 16 = 256 -> 3328.
# Causal attention per token at N: 4 layers * 2 * H * hd * N = 64 N.
HAND = dict(
    vocab_size=16,
    d_model=8,
    n_heads=2,
    encoder_layers=1,
    concept_layers=2,
    decoder_layers=1,
    num_experts=4,
    top_k=1,
    expert_dim=4,
    chunking="none",
    target_r=1.0,
)


def hand(**overrides) -> ConceptMoEConfig:
    return ConceptMoEConfig(**{**HAND, **overrides})


def test_prefill_cost_exact():
    cost = prefill_cost(hand(), seq_len=10)
    assert cost["flops_linear"] == 10 * 3328
    assert cost["flops_attn"] == 10 * 64 * 10
    assert cost["flops"] == 39680
    # only the last position's logits: 9 LM heads fewer
    assert prefill_cost(hand(), 10, all_logits=False)["flops"] == 39680 - 9 * 256


def test_decode_cost_exact():
    cost = decode_cost(hand(), kv_len=10, batch=1, dtype_bytes=2)
    # one query over all 10 keys: 4 layers * 4 * H * hd * 10 = 1280 (twice the causal prefill's 64 N average)
    assert cost["flops_per_token"] == 3328 + 1280
    # weights: 4 layers * (norms 16 + attention 256 + router 32 + 1 expert 96) + LM head 128 + final norm 8
    # + 1 embedding row 8 = 1744 params; KV: 10 keys * 4 layers * 2 * 2 * 4 = 640 elements; fp16
    assert cost["weight_bytes_per_step"] == 2 * 1744
    assert cost["kv_bytes_per_step"] == 2 * 640
    assert cost["bytes_per_token"] == 2 * (1744 + 640)
    assert cost["time_s"] is None
    timed = decode_cost(hand(), 10, 1, dtype_bytes=2, peak_flops=4608.0, bandwidth=4768.0 / 2)
    assert timed["time_s"] == pytest.approx(2.0) and timed["bound"] == "memory"
    assert timed["tokens_per_s"] == pytest.approx(0.5)


def test_decode_batch_reads_more_experts_but_not_more_than_all():
    one = decode_cost(hand(), 10, batch=1, dtype_bytes=1)
    many = decode_cost(hand(), 10, batch=64, dtype_bytes=1)
    assert distinct_experts(4, 1, 1) == 1 and distinct_experts(4, 1, 0) == 0
    assert distinct_experts(4, 1, 1000) == pytest.approx(4.0)
    # batch 64 touches all 4 experts in every layer: 3 more experts * 96 params * 4 layers, + 63 embedding rows
    # (capped at the 16 x 8 table: 120 more)
    assert many["weight_bytes_per_step"] - one["weight_bytes_per_step"] == pytest.approx(3 * 96 * 4 + 120, rel=1e-6)
    assert many["kv_bytes_per_step"] == 64 * one["kv_bytes_per_step"]


def test_kv_cache_bytes_exact():
    kv = kv_cache_bytes(hand(), seq_len=10, batch=3, dtype_bytes=2)
    assert kv == dict(token=3 * 10 * 4 * 16 * 2, concept=0, total=3 * 10 * 4 * 16 * 2)
    chunked = hand(chunking="fixed", target_r=2.0)
    kv = kv_cache_bytes(chunked, seq_len=10, batch=1, dtype_bytes=2)
    assert kv["token"] == 10 * 2 * 16 * 2 and kv["concept"] == 5 * 2 * 16 * 2


def test_r1_candidate_is_ideal_one():
    """A candidate identical to the baseline (or chunked at R = 1 with no reallocation) has ideal 1.0."""
    base = ConceptMoEConfig.from_preset("tiny-moe")
    dev = dict(peak_flops=1e12, bandwidth=1e11, dtype_bytes=2)
    assert ideal_prefill_speedup(base, base, 4096) == 1.0
    assert ideal_decode_speedup(base, base, 4096, 8, **dev) == 1.0
    assert ideal_kv_ratio(base, base, 4096) == 1.0
    same = ConceptMoEConfig.from_preset("tiny-moe", chunking="fixed", target_r=1.0, joint_layers=0)
    assert ideal_kv_ratio(base, same, 4096) == pytest.approx(1.0)
    assert ideal_prefill_speedup(base, same, 4096) == pytest.approx(1.0)
    # decode differs only by the concept model's output norm (64 weights read on concept steps)
    assert ideal_decode_speedup(base, same, 4096, 8, **dev) == pytest.approx(1.0, rel=1e-4)


def test_prefill_ideal_tends_to_table1_attention_reduction():
    """No token layers, attention-only limit (N -> inf): S1's prefill saving -> R^2 (Table 1), S2's ->
    R^2 L_C / (L_C + L_loop)."""
    deep = {**HAND, "encoder_layers": 0, "decoder_layers": 0, "concept_layers": 4}
    base = ConceptMoEConfig(**deep)
    s1 = ConceptMoEConfig(**{**deep, "chunking": "fixed", "target_r": 2.0})
    s2 = ConceptMoEConfig(**{**deep, "chunking": "fixed", "target_r": 2.0, "concept_loop": 2, "concept_loop_layers": 2})
    n = 1 << 24
    assert ideal_prefill_speedup(base, s1, n, r=2.0) == pytest.approx(4.0, rel=1e-3)
    assert ideal_prefill_speedup(base, s2, n, r=2.0) == pytest.approx(4.0 * 4 / 6, rel=1e-3)
    assert ideal_kv_ratio(base, s1, 4096, r=2.0) == pytest.approx(2.0)  # Table 1: R
    assert ideal_kv_ratio(base, s2, 4096, r=2.0) == pytest.approx(2.0 * 4 / 6)  # R L_C / (L_C + L_loop)
    # decode, long KV, compute-bound: attention over N / R keys on 1/R of the steps -> R^2 again
    dev = dict(peak_flops=1.0, bandwidth=1e30)
    assert ideal_decode_speedup(base, s1, n, 1, r=2.0, **dev) == pytest.approx(4.0, rel=1e-3)


def test_kv_ratio_matches_table1_with_token_layers_excluded():
    """S1 at R = 2 from vlm.accounting.flops.match: the concept-layer part of the KV shrinks exactly by R (Table 1)."""
    base = ConceptMoEConfig.from_preset("small-moe")
    s1 = match(base, 2.0, 1, chunking="fixed")
    b, c = kv_cache_bytes(base, 4096, 2), kv_cache_bytes(s1, 4096, 2)
    n_tok = base.encoder_layers + base.decoder_layers
    per_layer = b["total"] / (n_tok + base.concept_layers)
    assert c["token"] == n_tok * per_layer
    assert (b["total"] - c["token"]) / c["concept"] == pytest.approx(2.0)
    assert ideal_kv_ratio(base, s1, 4096) == pytest.approx(
        count(base)["kv_cache_per_token"] / count(s1)["kv_cache_per_token"]
    )


def test_ideal_grows_with_length():
    """Matched linear FLOPs: the prefill saving comes from attention, so it grows with N (Fig. 5's trend)."""
    base = ConceptMoEConfig.from_preset("small-moe")
    s1 = match(base, 2.0, 1, chunking="fixed")
    ideals = [ideal_prefill_speedup(base, s1, n) for n in (1024, 4096, 32768)]
    assert 1.0 < ideals[0] < ideals[1] < ideals[2] < 4.0
    dev = dict(peak_flops=5e10, bandwidth=1e10, dtype_bytes=4, aligned=True)
    decode = [ideal_decode_speedup(base, s1, n, 1, **dev) for n in (1024, 16384)]
    assert decode[0] < decode[1]


def test_aligned_rows_read_concept_weights_once_per_concept_step():
    """Fixed chunking with equal prompts: all rows hit a boundary together, so the concept experts of the
    batch are read on 1/R of the steps; independent rows spread the reads over more steps."""
    s1 = hand(chunking="fixed", target_r=2.0)
    aligned = decode_cost(s1, 10, batch=4, aligned=True)["weight_bytes_per_step"]
    independent = decode_cost(s1, 10, batch=4, aligned=False)["weight_bytes_per_step"]
    assert aligned < independent
    assert decode_cost(s1, 10, 1, aligned=True) == decode_cost(s1, 10, 1, aligned=False)


def test_measure_device_cpu():
    hw = measure_device("cpu", repeats=1)
    assert hw["peak_flops"] > 1e8 and hw["bandwidth"] > 1e8
