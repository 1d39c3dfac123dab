"""The whole backbone: causality, packing, padding, the `none` baseline, chunk statistics."""

# Shape suffixes (docs/paper.md §0): B batch rows, N tokens per row.

import pytest
import torch
from naive_reference import plain_moe_transformer_logits

from vlm import ConceptMoEConfig, ConceptMoEForCausalLM

MODES = [
    ("dynamic", "sum"),
    ("dynamic", "last"),
    ("fixed", "sum"),
    ("fixed", "last"),
    ("none", "sum"),
]


def tiny_model(chunking="dynamic", merge="sum", seed=0, **overrides):
    torch.manual_seed(seed)
    overrides.setdefault("boundary_router_init", "random")  # random q/k: boundaries vary from token to token
    config = ConceptMoEConfig.from_preset("tiny", chunking=chunking, concept_merge=merge, **overrides)
    return ConceptMoEForCausalLM(config).eval()


@pytest.mark.parametrize("chunking,merge", MODES)
def test_causality_future_tokens_never_change_past_logits(chunking, merge):
    model = tiny_model(chunking, merge)
    torch.manual_seed(1)
    ids = torch.randint(0, 512, (3, 48))
    with torch.no_grad():
        base = model(ids)
        r = base.chunk_stats["r"]
        assert chunking == "none" or 1.2 < r < 10, f"degenerate chunking (R={r}) would make this test vacuous"
        for t in (0, 7, 23, 40):
            changed = ids.clone()
            changed[:, t + 1 :] = torch.randint(0, 512, changed[:, t + 1 :].shape)
            logits = model(changed).logits
            assert torch.allclose(logits[:, : t + 1], base.logits[:, : t + 1], atol=1e-5)
            assert not torch.allclose(logits[:, t + 1 :], base.logits[:, t + 1 :], atol=1e-3)


@pytest.mark.parametrize("preset,extra", [("tiny", {}), ("tiny-moe", {}), ("tiny", {"concept_loop": 2})])
def test_none_mode_is_a_plain_moe_transformer(preset, extra):
    torch.manual_seed(0)
    model = ConceptMoEForCausalLM(ConceptMoEConfig.from_preset(preset, chunking="none", **extra)).eval()
    assert not hasattr(model.model, "chunker") and not hasattr(model.model, "concept_norm")
    ids = torch.randint(0, 512, (2, 12))
    doc = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    with torch.no_grad():
        logits = model(ids, doc_ids=doc).logits
        for row in range(2):
            reference = plain_moe_transformer_logits(model, ids[row], doc[row])
            assert torch.allclose(logits[row], reference, atol=1e-4)


@pytest.mark.parametrize("chunking,merge", MODES + [("dynamic-wide-looped", "sum")])
def test_packed_documents_equal_each_document_alone(chunking, merge):
    extra = {}
    if chunking == "dynamic-wide-looped":
        chunking, extra = "dynamic", dict(concept_d_model=96, concept_num_experts=4, concept_top_k=2, concept_loop=2)
    model = tiny_model(chunking, merge, **extra)
    torch.manual_seed(2)
    a, b, c = torch.randint(0, 512, (1, 13)), torch.randint(0, 512, (1, 20)), torch.randint(0, 512, (1, 7))
    packed = torch.cat([a, b, c], dim=1)
    doc = torch.tensor([[0] * 13 + [1] * 20 + [2] * 7])
    with torch.no_grad():
        logits = model(packed, doc_ids=doc).logits
        alone = torch.cat([model(x).logits for x in (a, b, c)], dim=1)
        # position_ids restarting at 0 mean the same as doc_ids (HF's flattening collator convention)
        pos = torch.cat([torch.arange(13), torch.arange(20), torch.arange(7)])[None]
        by_positions = model(packed, position_ids=pos).logits
    assert torch.allclose(logits, alone, atol=1e-5)
    assert torch.allclose(by_positions, alone, atol=1e-5)


@pytest.mark.parametrize("chunking,merge", MODES)
def test_padding_is_invisible(chunking, merge):
    model = tiny_model(chunking, merge)
    torch.manual_seed(3)
    short, long = torch.randint(0, 512, (1, 9)), torch.randint(0, 512, (1, 15))
    right = torch.cat([short, torch.zeros(1, 6, dtype=torch.long)], dim=1)
    left = torch.cat([torch.zeros(1, 6, dtype=torch.long), short], dim=1)
    ids = torch.cat([right, left, long])
    mask = torch.ones(3, 15, dtype=torch.long)
    mask[0, 9:] = 0
    mask[1, :6] = 0
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
        ref_short, ref_long = model(short).logits, model(long).logits
    assert torch.allclose(out.logits[0, :9], ref_short[0], atol=1e-5)
    assert torch.allclose(out.logits[1, 6:], ref_short[0], atol=1e-5)
    assert torch.allclose(out.logits[2], ref_long[0], atol=1e-5)
    assert out.chunk_stats["tokens"] == 9 + 9 + 15


def test_chunk_stats_per_modality_add_up():
    model = tiny_model("dynamic")
    ids = torch.randint(0, 512, (2, 40))
    modality = (torch.rand(2, 40) < 0.4).long()
    with torch.no_grad():
        stats = model(ids, modality_ids=modality).chunk_stats
    assert sum(stats["concepts_by_modality"].values()) == stats["concepts"]
    assert sum(stats["tokens_by_modality"].values()) == stats["tokens"] == 80
    for m, r in stats["r_by_modality"].items():
        assert r == pytest.approx(stats["tokens_by_modality"][m] / stats["concepts_by_modality"][m])
    assert stats["r"] == pytest.approx(80 / stats["concepts"])
    assert stats["flip_rate"] == 0.0  # eval mode: no noise


def test_eval_forward_is_deterministic_and_train_forward_is_noisy():
    model = tiny_model("dynamic", boundary_router_init="identity")
    ids = torch.randint(0, 512, (4, 64))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model(ids).logits)
        model.train()
        stats = model(ids).chunk_stats
    assert 0.0 < stats["flip_rate"] < 0.2


def test_joint_zero_init_decoder_ignores_concept_in_attention():
    model = tiny_model("dynamic", joint_zero_init=True)
    attn = model.model.decoder.layers[-1].attn
    assert attn.joint and attn.q_c.weight.abs().sum() == 0
    x = torch.randn(1, 5, 64)
    concept = torch.randn(1, 5, 64)
    assert all(torch.equal(a, b) for a, b in zip(attn.joint_qkv(x, concept), attn.joint_qkv(x, None)))
    model = tiny_model("dynamic")
    attn = model.model.decoder.layers[-1].attn
    assert not torch.equal(attn.joint_qkv(x, concept)[0], attn.joint_qkv(x, None)[0])


def test_concept_norm_init_scales_the_dechunked_concept_alone(tmp_path):
    """z = h + g * c at init (Eq. 9-10 with the concept model's output norm starting at gain g): the token's own state
    h and the boundaries are untouched, the concept added to it is scaled by exactly g."""
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(3))
    seen = {}
    for gain in (1.0, 0.1):
        model = tiny_model("dynamic", concept_norm_init=gain)
        hooks = [
            model.model.encoder.register_forward_hook(lambda m, a, out, g=gain: seen.__setitem__(("h", g), out[0])),
            model.model.decoder.register_forward_pre_hook(lambda m, a, g=gain: seen.__setitem__(("z", g), a[0])),
        ]
        with torch.no_grad():
            model(ids)
        for hook in hooks:
            hook.remove()
    h = seen["h", 1.0]
    assert torch.equal(seen["h", 0.1], h)
    added = seen["z", 1.0] - h
    assert added.abs().mean() > 0.1  # the default concept is not negligible: the test would catch a no-op
    assert torch.allclose(seen["z", 0.1] - h, 0.1 * added, atol=1e-5)
    model.save_pretrained(tmp_path)
    loaded = ConceptMoEForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.concept_norm_init == 0.1
    assert torch.equal(loaded.model.concept_norm.weight, model.model.concept_norm.weight)
    with pytest.raises(ValueError, match="concept_norm_init"):
        ConceptMoEConfig.from_preset("tiny", concept_norm_init=-0.5)


def test_embedding_init_std_sets_the_embeddings_alone_and_survives_save(tmp_path):
    model = tiny_model("dynamic", initializer_range=0.1, embedding_init_std=1.0)
    assert abs(model.get_input_embeddings().weight.std().item() - 1.0) < 0.05
    assert abs(model.get_output_embeddings().weight.std().item() - 0.1) < 0.01  # untied: the output layer keeps 0.1
    assert abs(model.model.encoder.layers[0].attn.q_proj.weight.std().item() - 0.1) < 0.01
    model.save_pretrained(tmp_path)
    assert ConceptMoEForCausalLM.from_pretrained(tmp_path).config.embedding_init_std == 1.0
    default = tiny_model("dynamic", initializer_range=0.1)
    assert abs(default.get_input_embeddings().weight.std().item() - 0.1) < 0.01  # None: initializer_range
    with pytest.raises(ValueError, match="embedding_init_std"):
        ConceptMoEConfig.from_preset("tiny", embedding_init_std=-1.0)


def test_loss_is_the_weighted_sum_of_its_terms():
    model = tiny_model("dynamic", moe_z_loss_weight=0.001)
    ids = torch.randint(0, 512, (2, 32))
    model.train()
    torch.manual_seed(0)
    out = model(ids, labels=ids)
    cfg, aux = model.config, out.aux
    expected = (
        aux["lm_loss"]
        + cfg.ratio_loss_weight * aux["ratio_loss"]
        + cfg.balance_loss_weight * aux["balance_loss"]
        + cfg.moe_z_loss_weight * aux["z_loss"]
    )
    assert torch.allclose(out.loss, expected)
    logits = out.logits[:, :-1].reshape(-1, cfg.vocab_size)
    assert torch.allclose(aux["lm_loss"], torch.nn.functional.cross_entropy(logits, ids[:, 1:].reshape(-1)))


@pytest.mark.parametrize("merge", ["sum", "last"])
def test_causality_in_training_mode_with_noise(merge):
    """Boundary noise is sampled per position: with the same seed, the past sees the same boundaries."""
    model = tiny_model("dynamic", merge).train()
    ids = torch.randint(0, 512, (2, 40))
    changed = ids.clone()
    changed[:, 21:] = torch.randint(0, 512, (2, 19))
    with torch.no_grad():
        torch.manual_seed(5)
        base = model(ids)
        torch.manual_seed(5)
        other = model(changed)
    assert base.chunk_stats["flip_rate"] > 0
    assert torch.allclose(base.logits[:, :21], other.logits[:, :21], atol=1e-5)


def test_reused_document_ids_are_still_separate_documents():
    model = tiny_model("dynamic")
    a, b, c = (torch.randint(0, 512, (1, 8)) for _ in range(3))
    with torch.no_grad():
        packed = model(torch.cat([a, b, c], 1), doc_ids=torch.tensor([[0] * 8 + [1] * 8 + [0] * 8])).logits
        assert torch.allclose(packed[:, 16:], model(c).logits, atol=1e-5)


def test_batch_without_labels_or_tokens_gives_finite_loss():
    model = tiny_model("dynamic").train()
    ids = torch.randint(0, 512, (2, 16))
    out = model(ids, labels=torch.full_like(ids, -100), attention_mask=torch.zeros_like(ids))
    assert torch.isfinite(out.loss) and out.aux["lm_loss"].item() == 0.0
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_forced_boundaries_close_concepts_without_splitting_documents():
    model = tiny_model("dynamic", boundary_router_init="identity")
    ids = torch.randint(0, 512, (1, 30))
    forced = torch.zeros(1, 30, dtype=torch.bool)
    forced[0, [4, 11, 12, 29]] = True
    with torch.no_grad():
        plain = model.model(ids)
        out = model.model(ids, forced_boundaries=forced)
    assert out.chunk.b_BN[forced].all() and (out.chunk.p_BN[forced] == 1).all()
    unforced = ~forced
    assert torch.equal(out.chunk.b_BN[unforced], plain.chunk.b_BN[unforced])  # nothing else moves
    assert out.chunk_stats["concepts"] >= plain.chunk_stats["concepts"]


def test_per_modality_target_r_is_a_weighted_sum_of_eq4():
    from vlm.backbone.chunking import ratio_loss

    torch.manual_seed(0)
    config = ConceptMoEConfig.from_preset(
        "tiny", target_r_by_modality={0: 1.5, 1: 4.0}, ratio_loss_modality_weights={1: 2.0}
    )
    assert config.target_r_by_modality == {"0": 1.5, "1": 4.0}  # JSON-safe keys
    model = ConceptMoEForCausalLM(config).eval()
    ids = torch.randint(0, 512, (2, 24))
    modality = (torch.arange(24) >= 10).long().expand(2, -1)
    with torch.no_grad():
        inner = model.model(ids, modality_ids=modality)
    p, b = inner.chunk.p_BN, inner.chunk.b_BN
    valid = torch.ones_like(b)
    expected = ratio_loss(p, b, valid & (modality == 0), 1.5) + 2.0 * ratio_loss(p, b, valid & (modality == 1), 4.0)
    assert torch.allclose(inner.aux["ratio_loss"], expected)
    stats = inner.chunk_stats
    for m in (0, 1):
        in_m = modality == m
        assert stats["mean_p_by_modality"][m] == pytest.approx(p[in_m].mean().item(), rel=1e-5)
    with pytest.raises(ValueError, match="target_r_by_modality"):
        ConceptMoEConfig.from_preset("tiny", target_r_by_modality={1: 1.0})


def test_left_and_right_padding_give_the_same_loss():
    """No target is ever predicted from a padding position, whichever side the padding is on."""
    model = tiny_model("dynamic")
    short, long = torch.randint(0, 512, (1, 9)), torch.randint(0, 512, (1, 15))
    pad = torch.zeros(1, 6, dtype=torch.long)
    real = torch.ones(1, 9, dtype=torch.long)
    losses = []
    for row, row_mask in (
        (torch.cat([short, pad], 1), torch.cat([real, pad], 1)),
        (torch.cat([pad, short], 1), torch.cat([pad, real], 1)),
    ):
        ids, mask = torch.cat([row, long]), torch.cat([row_mask, torch.ones(1, 15, dtype=torch.long)])
        with torch.no_grad():
            losses.append(model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).aux["lm_loss"])
    assert torch.allclose(losses[0], losses[1], atol=1e-5)
