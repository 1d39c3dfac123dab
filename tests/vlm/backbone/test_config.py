"""Config validation, presets, HF Auto registration, the save/load round trip, renamed fields and set_chunking."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from vlm import ConceptMoEConfig, ConceptMoEForCausalLM
from vlm.backbone.config import RENAMED_FIELDS


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(target_r=0.5), "target_r"),
        (dict(chunking="dynamic", target_r=1.0), "target_r"),
        (dict(top_k=9, num_experts=8), "top_k"),
        (dict(concept_top_k=9), "concept_top_k"),
        (dict(joint_layers=2, decoder_layers=1), "joint_layers"),
        (dict(chunking="adaptive"), "chunking"),
        (dict(boundary_router="mlp"), "boundary_router"),
        (dict(concept_merge="mean"), "concept_merge"),
        (dict(noise_tau=-1.0), "noise_tau"),
        (dict(n_heads=4, n_kv_heads=3), "n_kv_heads"),
        (dict(concept_loop=0), "concept_loop"),
        (dict(concept_loop_layers=5), "concept_loop_layers"),
        (dict(ratio_loss_weight=-0.1), "ratio_loss_weight"),
        (dict(ffn="conv"), "ffn"),
        (dict(chunking="none", concept_d_model=96), "concept_d_model"),
        (dict(head_dim=5), "head_dim"),
        (dict(shared_experts=0, shared_expert_dim=32), "shared_expert_dim"),
        (dict(shared_experts=0, shared_expert_gate=True), "shared_expert_gate"),
        (dict(boundary_token_ids=[-1]), "boundary_token_ids"),
        (dict(boundary_token_ids=[512]), "boundary_token_ids"),
        (dict(boundary_token_ids=["<|assistant|>"]), "boundary_token_ids"),
        (dict(chunking="none", boundary_token_ids=[3]), "boundary_token_ids"),
    ],
)
def test_invalid_values_raise_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=rf"ConceptMoEConfig\.{field}=.*invalid"):
        ConceptMoEConfig.from_preset("tiny", **overrides)


def test_unknown_preset_lists_the_allowed_ones():
    with pytest.raises(ValueError, match="tiny-moe"):
        ConceptMoEConfig.from_preset("huge")


def test_presets_and_their_baselines_differ_only_in_chunking_and_reallocation():
    for name in ("tiny", "small"):
        cmoe, base = ConceptMoEConfig.from_preset(name), ConceptMoEConfig.from_preset(f"{name}-moe")
        assert cmoe.chunking == "dynamic" and cmoe.target_r == 2.0 and base.chunking == "none"
        assert cmoe.concept_top_k > base.top_k  # strategy 1: the saved compute buys more active experts
        for field in ("d_model", "num_experts", "expert_dim", "encoder_layers", "concept_layers", "vocab_size"):
            assert getattr(cmoe, field) == getattr(base, field)


def test_concept_schedule_loops_the_middle_layers():
    cfg = ConceptMoEConfig(concept_layers=6, concept_loop=2, concept_loop_layers=2)
    assert cfg.concept_schedule() == [0, 1, 2, 3, 2, 3, 4, 5]
    assert ConceptMoEConfig(concept_layers=3, concept_loop=3).concept_schedule() == [0, 1, 2] * 3


@pytest.mark.parametrize(
    "preset,extra",
    [
        ("tiny", {}),
        ("tiny-moe", {}),
        (
            "tiny",
            dict(
                concept_d_model=96,
                concept_num_experts=6,
                concept_loop=2,
                tie_word_embeddings=True,
                qk_norm="head",
                attention_bias=True,
                boundary_token_ids=[3, 17],
            ),
        ),
    ],
)
def test_save_pretrained_round_trip_gives_identical_logits(tmp_path, preset, extra):
    model = ConceptMoEForCausalLM(ConceptMoEConfig.from_preset(preset, **extra)).eval()
    with torch.no_grad():  # move every weight off its init value: re-initialising on load would now show
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert AutoConfig.from_pretrained(tmp_path).model_type == "conceptmoe"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, ConceptMoEForCausalLM)
    assert loaded.config.to_diff_dict() | {"_name_or_path": ""} == model.config.to_diff_dict() | {"_name_or_path": ""}
    ids = torch.randint(0, 512, (2, 30))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_router_starts_at_identity_by_default():
    model = ConceptMoEForCausalLM(ConceptMoEConfig.from_preset("tiny"))
    assert torch.equal(model.model.chunker.q_proj.weight, torch.eye(64))
    random = ConceptMoEForCausalLM(ConceptMoEConfig.from_preset("tiny", boundary_router_init="random"))
    assert not torch.equal(random.model.chunker.q_proj.weight, torch.eye(64))


def test_moe_top_k_never_becomes_the_sampling_top_k(tmp_path):
    config = ConceptMoEConfig.from_preset("tiny")
    assert config.top_k == 2 and config.to_dict()["num_experts_per_tok"] == 2 and "top_k" not in config.to_dict()
    assert GenerationConfig.from_model_config(config).top_k != 2
    config.save_pretrained(tmp_path)
    assert ConceptMoEConfig.from_pretrained(tmp_path).top_k == 2


CONCEPT_DEFAULTS = {
    "concept_top_k": "num_experts_per_tok",
    "concept_num_experts": "num_experts",
    "concept_d_model": "d_model",
    "concept_expert_dim": "expert_dim",
}


def _to_old_field_names(config_json, renames: dict) -> None:
    """Rewrite a saved config.json as the first release wrote it: old field names, and a concept_* field that equals
    its token-level value stored as null ("same as the tokens")."""
    fields = json.loads(config_json.read_text())
    for old, new in renames.items():
        fields[old] = fields.pop(new)
    for name, token_level in CONCEPT_DEFAULTS.items():
        if fields[name] == fields[token_level]:
            fields[name] = None
    config_json.write_text(json.dumps(fields))


def test_checkpoint_saved_with_the_old_field_names_loads_with_identical_logits(tmp_path):
    model = ConceptMoEForCausalLM(
        ConceptMoEConfig.from_preset("tiny", concept_merge="last", boundary_router="linear", moe_z_loss_weight=0.01)
    ).eval()
    model.save_pretrained(tmp_path)
    _to_old_field_names(tmp_path / "config.json", RENAMED_FIELDS)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["merge"] == "last" and "concept_merge" not in saved and saved["concept_d_model"] is None
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    cfg = loaded.config
    assert (cfg.concept_merge, cfg.boundary_router, cfg.moe_z_loss_weight) == ("last", "linear", 0.01)
    assert cfg.concept_d_model == cfg.d_model and cfg.concept_top_k == model.config.concept_top_k
    assert not any(hasattr(cfg, old) for old in RENAMED_FIELDS)
    ids = torch.randint(0, 512, (2, 30))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_old_and_new_name_together_is_a_one_line_error():
    with pytest.raises(ValueError, match="'merge' was renamed to 'concept_merge'; pass only 'concept_merge'"):
        ConceptMoEConfig.from_preset("tiny", merge="last", concept_merge="sum")


def test_none_fields_resolve_to_their_token_level_values():
    """Aliases are read before defaults are filled: a stored ``num_experts_per_tok`` is also the concept model's."""
    cfg = ConceptMoEConfig(num_experts_per_tok=3, n_heads=4, decoder_layers=2, target_r=3, noise_tau=1)
    assert (cfg.top_k, cfg.concept_top_k, cfg.n_kv_heads, cfg.joint_layers) == (3, 3, 4, 2)
    assert (cfg.concept_d_model, cfg.concept_num_experts, cfg.concept_expert_dim) == (64, 8, 64)
    assert isinstance(cfg.target_r, float) and isinstance(cfg.noise_tau, float)
    cfg = ConceptMoEConfig(target_r_by_modality={0: 2, 1: 4}, ratio_loss_modality_weights={1: 1})
    assert cfg.target_r_by_modality == {"0": 2.0, "1": 4.0} and cfg.ratio_loss_modality_weights == {"1": 1.0}
    assert ConceptMoEConfig(merge="last", router="linear").to_dict()["concept_merge"] == "last"


def test_set_chunking_changes_every_config_object_and_validates(tmp_path):
    model = ConceptMoEForCausalLM(ConceptMoEConfig.from_preset("tiny", boundary_router_init="random")).eval()
    model.save_pretrained(tmp_path)
    for built in (model, ConceptMoEForCausalLM.from_pretrained(tmp_path)):  # set_chunking writes one object
        assert built.model.config is built.config
    ids = torch.randint(0, 512, (1, 64))
    model.set_chunking(chunking="fixed", target_r=4.0)
    assert model.config.chunking == model.model.config.chunking == "fixed"
    with torch.no_grad():
        assert model(ids).chunk_stats["concepts"] == 16  # a boundary every 4 tokens, what the model now reads
    with pytest.raises(ValueError, match="target_r"):
        model.set_chunking(chunking="dynamic", target_r=1.0)  # Eq. 4 needs R > 1
    assert model.config.chunking == "fixed" and model.config.target_r == 4.0  # a refused change changes nothing
    with pytest.raises(ValueError, match="cannot be applied"):
        model.set_chunking(chunking="none")
    with pytest.raises(ValueError, match="not a chunking setting"):
        model.set_chunking(d_model=32)
    fixed_built = ConceptMoEForCausalLM(ConceptMoEConfig.from_preset("tiny", chunking="fixed"))
    with pytest.raises(ValueError, match="cannot be applied"):
        fixed_built.set_chunking(chunking="dynamic")  # no boundary router to run
