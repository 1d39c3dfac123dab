"""vlm.accounting.convert: HF MoE -> ConceptMoE. Exact logits without chunking, CT start and target R, save/load,
CLI, errors."""

# Shape suffixes (docs/paper.md §0): B batch rows, N tokens per row.

from __future__ import annotations

import json
import logging
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

from vlm import ConceptMoEForCausalLM, ConceptMoEVLM
from vlm.accounting.convert import FAMILIES, conversion_configs, convert, save_conversion
from vlm.accounting.flops import count

REPO = str(Path(__file__).resolve().parents[3])
COMMON = dict(
    vocab_size=120,
    hidden_size=64,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
    rms_norm_eps=1e-5,
)
TINY = {
    "olmoe": lambda **kw: T.OlmoeConfig(**{**COMMON, "intermediate_size": 32, "num_experts": 6, **kw}),
    "qwen2_moe": lambda **kw: T.Qwen2MoeConfig(
        **{**COMMON, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "num_experts": 6, **kw}
    ),
    "qwen3_moe": lambda **kw: T.Qwen3MoeConfig(
        **{**COMMON, "moe_intermediate_size": 32, "head_dim": 24, "num_experts": 6, "norm_topk_prob": True, **kw}
    ),
    "mixtral": lambda **kw: T.MixtralConfig(
        **{**COMMON, "intermediate_size": 32, "num_local_experts": 6, "rope_parameters": {"rope_theta": 5e4}, **kw}
    ),
}


FAMILY_CLASS = {
    "olmoe": "OlmoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


def random_source(family: str, seed: int = 0, **kw) -> T.PreTrainedModel:
    """A tiny HF MoE with every weight random, norms and biases included (so a wrong mapping cannot pass)."""
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(TINY[family](**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.3 if p.dim() == 1 else 0.15)
    return model


def left_padded_batch(vocab: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids_BN = torch.randint(0, vocab, (3, 19), generator=g)
    mask_BN = torch.ones_like(ids_BN)
    mask_BN[1, :6] = 0
    mask_BN[2, :2] = 0
    return ids_BN, mask_BN


@pytest.mark.parametrize("family", sorted(TINY))
def test_unchunked_conversion_reproduces_source_logits(family):
    source = random_source(family)
    model = convert(source, chunking="none", encoder_layers=1, decoder_layers=2).model
    assert [len(s.layers) for s in (model.model.encoder, model.model.concept_model, model.model.decoder)] == [1, 2, 2]
    ids_BN, mask_BN = left_padded_batch(COMMON["vocab_size"])
    position_ids = (mask_BN.cumsum(-1) - 1).clamp_min(0)  # HF needs them with left padding (as generate() does)
    with torch.no_grad():
        want = source(input_ids=ids_BN, attention_mask=mask_BN, position_ids=position_ids).logits
        got = model(input_ids=ids_BN, attention_mask=mask_BN).logits
    valid = mask_BN.bool()
    assert want[valid].abs().max() > 1.0  # logits large enough for the comparison to mean something
    assert torch.allclose(got[valid], want[valid], atol=1e-4), (got[valid] - want[valid]).abs().max()
    # the parameter count of the equivalent plain config is the real model's
    assert count(model.config)["params_total"] == sum(p.numel() for p in model.parameters())


def test_chunked_conversion_adds_only_the_paper_modules_and_round_trips(tmp_path):
    source = random_source("qwen2_moe")
    conv = convert(source, target_r=1.5, encoder_layers=1, decoder_layers=2, top_k=4, loop=2, loop_layers=1)
    model, cfg = conv.model, conv.model.config
    assert (cfg.chunking, cfg.concept_merge, cfg.boundary_router_init, cfg.joint_layers, cfg.joint_zero_init) == (
        "dynamic",
        "last",
        "random",
        2,
        True,
    )
    assert cfg.concept_top_k == 4 and cfg.concept_schedule() == [0, 0, 1]
    assert conv.report["new_weights"] == sorted(
        ["model.chunker.q_proj.weight", "model.chunker.k_proj.weight", "model.concept_norm.weight"]
        + [f"model.decoder.layers.{i}.attn.{p}_c.weight" for i in range(2) for p in "qkv"]
    )
    for layer in model.model.decoder.layers:
        assert all(not m.weight.detach().any() for m in (layer.attn.q_c, layer.attn.k_c, layer.attn.v_c))
    assert not torch.allclose(model.model.chunker.q_proj.weight, torch.eye(64))  # random, not identity
    rep = conv.report
    assert rep["converted"]["flops_linear_per_token"] != rep["source"]["flops_linear_per_token"]
    assert set(rep["match"]) >= {"params_mismatch", "flops_linear_mismatch", "attn_flops_ratio"}

    save_conversion(conv, tmp_path)
    assert json.loads((tmp_path / "conversion_report.json").read_text())["source_architecture"] == "Qwen2MoeForCausalLM"
    loaded = T.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, ConceptMoEForCausalLM)
    ids_BN, mask_BN = left_padded_batch(COMMON["vocab_size"])
    with torch.no_grad():
        want = model(input_ids=ids_BN, attention_mask=mask_BN).logits
        got = loaded(input_ids=ids_BN, attention_mask=mask_BN).logits
    assert torch.equal(got, want)

    vlm = ConceptMoEVLM.from_text_model(str(tmp_path), max_patches=16).eval()  # the converted backbone, multimodal
    with torch.no_grad():
        vlm_logits = vlm(input_ids=ids_BN, attention_mask=mask_BN).logits[..., : COMMON["vocab_size"]]
    assert torch.allclose(vlm_logits, want, atol=1e-5)


def test_unsupported_families_and_features_raise_clear_errors(tmp_path):
    dense = T.LlamaForCausalLM(T.LlamaConfig(**{**COMMON, "intermediate_size": 32}))
    dense.save_pretrained(tmp_path / "llama")
    for src in (dense, str(tmp_path / "llama")):
        with pytest.raises(ValueError, match="unsupported architecture LlamaForCausalLM: supported") as err:
            convert(src)
        assert all(name in str(err.value) for name in FAMILIES)
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "original_max_position_embeddings": 256}
    refused = {
        "rope scaling type 'yarn'": ("mixtral", dict(rope_parameters=yarn)),
        "dense": ("qwen3_moe", dict(mlp_only_layers=[2])),
        "sliding-window": ("mixtral", dict(sliding_window=8)),
        "o_proj bias": ("olmoe", dict(attention_bias=True)),
    }
    for message, (family, fields) in refused.items():
        hf_config = TINY[family](**fields)
        hf_config.architectures = [FAMILY_CLASS[family]]
        with pytest.raises(ValueError, match=message):
            conversion_configs(hf_config, chunking="none", encoder_layers=1, decoder_layers=1)
    with pytest.raises(ValueError, match="must fit"):
        convert(random_source("olmoe"), encoder_layers=4, decoder_layers=4)


def test_cli_end_to_end(tmp_path):
    random_source("olmoe").save_pretrained(tmp_path / "src")
    cmd = [sys.executable, os.path.join(REPO, "scripts", "convert_to_conceptmoe.py"), "--src", str(tmp_path / "src")]
    cmd += ["--out", str(tmp_path / "out"), "--encoder-layers", "1", "--decoder-layers", "1", "--top-k", "3"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": REPO}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "| params total |" in done.stdout and "OlmoeForCausalLM" in done.stdout
    report = json.loads((tmp_path / "out" / "conversion_report.json").read_text())
    assert report["converted"]["r"] == 1.5 and report["layers"] == {"encoder": 1, "concept": 3, "decoder": 1}
    model = ConceptMoEForCausalLM.from_pretrained(tmp_path / "out")
    assert model.config.concept_top_k == 3 and model.config.concept_merge == "last"


def test_cli_refuses_a_dense_checkpoint_with_exit_code_2(tmp_path, monkeypatch, capsys):
    T.LlamaForCausalLM(T.LlamaConfig(**{**COMMON, "intermediate_size": 32})).save_pretrained(tmp_path / "llama")
    script = os.path.join(REPO, "scripts", "convert_to_conceptmoe.py")
    monkeypatch.setattr(sys, "argv", [script, "--src", str(tmp_path / "llama"), "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(script, run_name="__main__")
    assert exit_info.value.code == 2
    assert "unsupported architecture LlamaForCausalLM" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- checkpoint folders: complete or refused
SCRIPT = os.path.join(REPO, "scripts", "convert_to_conceptmoe.py")


def saved_source(folder: Path, family: str = "qwen3_moe", **kw) -> tuple[T.PreTrainedModel, Path]:
    """A tiny random source and its ``save_pretrained`` folder (one safetensors file, experts saved one by one)."""
    source = random_source(family, **kw)
    source.save_pretrained(folder)
    return source, folder


def edit_tensors(folder: Path, edit) -> None:
    """Rewrite ``model.safetensors`` after ``edit(tensors)`` changed the name -> tensor dict in place."""
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def run_script(*args: str) -> int:
    """``main()`` of scripts/convert_to_conceptmoe.py in this process; its exit code (0 when it returns)."""
    try:
        runpy.run_path(SCRIPT)["main"](list(args))
    except SystemExit as e:
        return e.code
    return 0


@pytest.mark.parametrize("family,kw", [(f, {}) for f in sorted(TINY)] + [("qwen3_moe", {"tie_word_embeddings": True})])
def test_folder_conversion_reads_saved_experts_and_reproduces_the_source(tmp_path, family, kw):
    source, folder = saved_source(tmp_path / "src", family, **kw)
    conv = convert(folder, chunking="none", encoder_layers=1, decoder_layers=2)
    assert conv.report["ignored_source_tensors"] == []
    ids_BN, mask_BN = left_padded_batch(COMMON["vocab_size"])
    position_ids = (mask_BN.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        want = source(input_ids=ids_BN, attention_mask=mask_BN, position_ids=position_ids).logits
        got = conv.model(input_ids=ids_BN, attention_mask=mask_BN).logits
    valid = mask_BN.bool()
    assert torch.allclose(got[valid], want[valid], atol=1e-4), (got[valid] - want[valid]).abs().max()


def _drop_layer(tensors: dict, layer: int) -> None:
    for key in [k for k in tensors if k.startswith(f"model.layers.{layer}.")]:
        del tensors[key]


def _truncate(folder: Path) -> None:
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


BROKEN = {  # fault -> (how the folder is broken, a regex the one-line error must match)
    "no_embeddings": (
        lambda d: edit_tensors(d, lambda t: t.pop("model.embed_tokens.weight")),
        re.escape("1 missing (model.embed_tokens.weight)"),
    ),
    "missing_expert": (
        lambda d: edit_tensors(d, lambda t: t.pop("model.layers.2.mlp.experts.3.up_proj.weight")),
        re.escape("1 missing (model.layers.2.mlp.experts.3.up_proj.weight)"),
    ),
    "missing_layer": (lambda d: edit_tensors(d, lambda t: _drop_layer(t, 4)), r"missing \(.*, \.\.\. and \d+ more\)"),
    "wrong_shape": (
        lambda d: edit_tensors(d, lambda t: t.update({"model.norm.weight": torch.ones(63)})),
        r"1 with a wrong shape \(model\.norm\.weight \[63\] != \[64\]\)",
    ),
    "extra_tensor": (
        lambda d: edit_tensors(d, lambda t: t.update({"model.mtp.proj.weight": torch.ones(4, 4)})),
        r"1 not in the architecture \(model\.mtp\.proj\.weight; --allow-extra",
    ),
    "truncated_file": (_truncate, re.escape("model.safetensors: not a readable safetensors file")),
    "unreadable_config": (lambda d: (d / "config.json").write_text("{not json"), "cannot read config.json"),
    "no_config": (lambda d: (d / "config.json").unlink(), "cannot read config.json"),
    "no_weights": (lambda d: (d / "model.safetensors").unlink(), "no \\*.safetensors weights"),
}


@pytest.mark.parametrize("fault", list(BROKEN))
def test_cli_refuses_an_incomplete_or_broken_checkpoint_with_one_line(tmp_path, capsys, fault):
    _, folder = saved_source(tmp_path / "src")
    breaks, message = BROKEN[fault]
    breaks(folder)
    capsys.readouterr()
    code = run_script(
        "--src", str(folder), "--out", str(tmp_path / "out"), "--encoder-layers", "1", "--decoder-layers", "1"
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("convert_to_conceptmoe: error: "), err
    assert re.search(message, err), err
    assert "Traceback" not in err and not (tmp_path / "out").exists()
    with pytest.raises(ValueError):  # the library refuses too: never a partly random model
        convert(folder, chunking="none", encoder_layers=1, decoder_layers=1)


def test_allow_extra_converts_and_names_the_ignored_tensors(tmp_path, caplog):
    source, folder = saved_source(tmp_path / "src")
    extra = {f"model.mtp.layers.{i}.weight": torch.ones(4, 4) for i in range(7)}
    edit_tensors(folder, lambda t: t.update(extra))
    with caplog.at_level(logging.WARNING, logger="vlm.accounting.convert"):
        code = run_script(
            "--src",
            str(folder),
            "--out",
            str(tmp_path / "out"),
            "--chunking",
            "none",
            "--encoder-layers",
            "1",
            "--decoder-layers",
            "1",
            "--allow-extra",
        )
    assert code == 0
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warning) == 1 and "ignoring 7 tensors not in the architecture: model.mtp.layers.0.weight" in warning[0]
    assert "... and 2 more" in warning[0]
    report = json.loads((tmp_path / "out" / "conversion_report.json").read_text())
    assert report["ignored_source_tensors"] == sorted(extra)
    converted = ConceptMoEForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids_BN = torch.randint(0, COMMON["vocab_size"], (2, 9))
    with torch.no_grad():
        assert torch.allclose(converted(input_ids=ids_BN).logits, source(input_ids=ids_BN).logits, atol=1e-4)


def _train_hf(model, batches, steps: int, lr: float) -> None:
    """A few AdamW steps on an HF causal LM (linear warmup), enough to give the source real structure."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    model.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 10)
        model(**next(batches)).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()


def test_continual_training_starts_near_the_source_loss_and_reaches_target_r():
    from data_pipelines.local_text import ByteTokenizer, load_local_text_corpus, packed_batches
    from vlm.training.single_process import TrainConfig, evaluate, train

    torch.manual_seed(0)
    corpus, tok = load_local_text_corpus(max_docs=2000), ByteTokenizer()

    def batches(split: str, seed: int):  # rows attend across packed documents, as the HF source was trained
        return ({k: v for k, v in b.items() if k != "doc_ids"} for b in packed_batches(corpus[split], tok, 64, 8, seed))

    source = T.AutoModelForCausalLM.from_config(
        TINY["qwen3_moe"](vocab_size=tok.vocab_size, num_hidden_layers=4, moe_intermediate_size=64, num_experts=8)
    )
    _train_hf(source, batches("train", 0), steps=SOURCE_STEPS, lr=5e-3)
    held_out = list(zip(range(4), batches("eval", 0)))
    with torch.no_grad():
        source_loss = sum(source(**b).loss.item() for _, b in held_out) / len(held_out)
    assert source_loss < 3.5  # learned something (uniform over bytes: ln 259 = 5.56)

    model = convert(source, target_r=1.5, encoder_layers=1, decoder_layers=1, ratio_loss_weight=0.3).model
    start = evaluate(model, (b for _, b in held_out), n_batches=4)
    history = train(
        model, batches("train", 1), TrainConfig(max_steps=CT_STEPS, save_every=CT_STEPS, seed=0, lr=1e-3, warmup=5)
    )
    end = evaluate(model, (b for _, b in held_out), n_batches=4)
    print(
        f"source {source_loss:.3f}  CT start {start['eval_loss']:.3f} (R {start['eval_r']:.2f})  "
        f"CT end {end['eval_loss']:.3f} (R {end['eval_r']:.2f})"
    )
    assert start["eval_loss"] < source_loss + 0.4  # chunking and re-routing cost little at the start
    assert end["eval_loss"] < source_loss + 0.2
    assert abs(end["eval_r"] - 1.5) <= 0.25, end  # eval R (p >= 0.5) at the target
    assert abs(sum(h["r"] for h in history[-10:]) / 10 - 1.5) <= 0.25


SOURCE_STEPS, CT_STEPS = 80, 60
