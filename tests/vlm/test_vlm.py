"""ConceptMoEVLM: image slots, interleaved causality, gradients, per-modality R, HF round trips, training."""

# Shape suffixes (docs/paper.md §0): B batch rows, N tokens per row.

import json
import random

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForImageTextToText

from data_pipelines.synthetic_images import captioned_image
from vision_tower import ImageProcessor, VisionTower
from vlm import ConceptMoEForCausalLM, ConceptMoEVLM, ConceptMoEVLMConfig, VLMProcessor


@pytest.fixture()
def processor(hf_tokenizer):
    return VLMProcessor(hf_tokenizer, ImageProcessor(patch_size=16, max_patches=64, pixel_shuffle=2))


def make_vlm(processor, seed=0, **overrides):
    torch.manual_seed(seed)
    overrides.setdefault("boundary_router_init", "random")
    return ConceptMoEVLM.from_preset("tiny", image_token_id=processor.image_token_id, max_patches=64, **overrides)


def images(n, seed=0):
    rng = random.Random(seed)
    return [captioned_image(rng)[0] for _ in range(n)]


def test_processor_expands_markers_into_image_slots(processor):
    imgs = [Image.new("RGB", (64, 64)), Image.new("RGB", (96, 48)), Image.new("L", (300, 40))]
    batch = processor(text=["<image> hi <image>", "no images here", "<image>"], images=[imgs[:2], [], imgs[2:]])
    counts = batch["num_tokens"].tolist()
    assert counts[0] == (64 // 32) * (64 // 32) and counts[1] == (48 // 32) * (96 // 32)
    assert batch["modality_ids"].sum(1).tolist() == [counts[0] + counts[1], 0, counts[2]]
    assert ((batch["input_ids"] == processor.image_token_id) == batch["modality_ids"].bool()).all()
    row0 = batch["input_ids"][0, : batch["attention_mask"][0].sum()].tolist()
    assert row0[: counts[0]] == [processor.image_token_id] * counts[0]  # first marker opens the row
    with pytest.raises(ValueError, match="markers"):
        processor(text=["<image> <image>"], images=[imgs[:1]])


def test_rows_with_0_1_and_3_images_and_slots_get_their_own_image(processor):
    model = make_vlm(processor).eval()
    texts = ["just text, no picture", "<image> a red square", "<image> one <image> two <image> three"]
    imgs = images(4)
    batch = processor(text=texts, images=[[], imgs[:1], imgs[1:]])
    with torch.no_grad():
        embeds = model.embed(
            batch["input_ids"],
            batch["modality_ids"],
            batch["attention_mask"],
            batch["patches"],
            batch["patch_coord"],
            batch["patch_valid"],
            batch["grid_hw"],
        )
        out = model(**batch, labels=batch["input_ids"])
        assert torch.isfinite(out.loss)
        for i, img in enumerate(imgs):  # each image's tokens sit, in order, in its own slots
            alone = processor.image_processor([img])
            expected = model.image_embeddings(
                alone["patches"], alone["patch_coord"], alone["patch_valid"], alone["grid_hw"]
            )
            start = sum(batch["num_tokens"][:i].tolist())
            slots = embeds[batch["modality_ids"].bool()][start : start + expected.shape[0]]
            assert torch.allclose(slots, expected, atol=1e-5)
        for row in range(3):  # a row's logits do not depend on the other rows or their images
            alone = processor(text=[texts[row]], images=[[[], imgs[:1], imgs[1:]][row]])
            n = int(alone["attention_mask"].sum())
            assert torch.allclose(model(**alone).logits[0], out.logits[row, :n], atol=1e-4)


@pytest.mark.parametrize("modality_boundaries", [False, True])
def test_interleaved_causality(processor, modality_boundaries):
    model = make_vlm(processor, modality_boundaries=modality_boundaries).eval()
    imgs = images(3, seed=1)
    text = "the <image> shows a green circle and <image> shows something blue"
    base = processor(text=[text], images=[imgs[:2]])
    # the vision tower sees a whole image at once, so causality holds at image granularity: nothing before
    # the second image's first slot may change when that image's pixels or the text after it change
    slots = (base["modality_ids"][0] == 1).nonzero().flatten()
    cut = int(slots[-base["num_tokens"][1]]) - 1
    changed = processor(
        text=["the <image> shows a green circle and <image> shows a red square!!"],
        images=[[imgs[0], imgs[2].resize(imgs[1].size)]],
    )
    assert torch.equal(changed["modality_ids"][:, : cut + 1], base["modality_ids"][:, : cut + 1])
    with torch.no_grad():
        a, b = model(**base).logits, model(**changed).logits
    assert torch.allclose(a[:, : cut + 1], b[:, : cut + 1], atol=1e-5)
    n = min(a.shape[1], b.shape[1])
    assert not torch.allclose(a[:, cut + 1 : n], b[:, cut + 1 : n], atol=1e-4)  # the future did change


def test_gradients_reach_vision_tower_projector_and_router(processor):
    model = make_vlm(processor).train()
    batch = processor(
        text=["<image> a blue circle on the left.", "<image> <image> two"], images=[images(1), images(2, seed=3)]
    )
    model(**batch, labels=batch["input_ids"]).loss.backward()
    for name, module in [
        ("vision tower", model.vision_tower),
        ("projector", model.projector),
        ("router", model.language_model.model.chunker),
    ]:
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        assert grads and sum(g.abs().sum() for g in grads) > 0, name


def test_per_modality_identity_and_single_modality_concepts(processor):
    batch = processor(text=["<image> a red square <image> and more text here"], images=[images(2, seed=4)])
    for modality_boundaries in (False, True):
        model = make_vlm(processor, modality_boundaries=modality_boundaries).eval()
        with torch.no_grad():
            stats = model(**batch).chunk_stats
            assert set(stats["r_by_modality"]) == {0, 1}
            assert sum(stats["concepts_by_modality"].values()) == stats["concepts"]
            assert sum(stats["tokens_by_modality"].values()) == stats["tokens"]
    # with modality_boundaries every concept's merge window holds a single modality
    mod = batch["modality_ids"][0]
    embeds = model.embed(
        batch["input_ids"],
        batch["modality_ids"],
        None,
        batch["patches"],
        batch["patch_coord"],
        batch["patch_valid"],
        batch["grid_hw"],
    )
    from vlm.model import modality_span_ends

    forced = modality_span_ends(batch["modality_ids"], torch.ones_like(mod, dtype=torch.bool)[None])
    with torch.no_grad():
        b = model.language_model.model(inputs_embeds=embeds, forced_boundaries=forced).chunk.b_BN[0]
    start = 0
    for end in b.nonzero().flatten().tolist():
        assert len(set(mod[start : end + 1].tolist())) == 1, (start, end)
        start = end + 1


@pytest.mark.parametrize("stem,summary", [("linear", False), ("conv", False), ("conv", True)])
def test_save_and_load_with_auto_classes(tmp_path, processor, stem, summary):
    model = make_vlm(processor, modality_boundaries=True, vision_stem=stem, vision_summary=summary).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).model_type == "conceptmoe_vlm"
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    proc2 = VLMProcessor.from_pretrained(tmp_path)
    assert isinstance(loaded, ConceptMoEVLM) and proc2.image_token_id == processor.image_token_id
    assert loaded.config.vision_stem == stem and loaded.config.vision_summary == summary
    batch = proc2(text=["<image> a yellow square"], images=[images(1)])
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, loaded(**batch).logits)


@pytest.mark.parametrize("summary", [False, True])
def test_vision_summary_hands_each_image_token_its_own_images_summary(processor, summary):
    """A change to one corner of image 0 reaches every token of image 0 through the summary (without it, only the
    tokens whose patches changed), and never a token of image 1."""
    model = make_vlm(processor, vision_summary=summary).eval()
    first, second = images(2)
    edited = first.copy()
    edited.paste((255, 0, 255), (0, 0, 8, 8))
    inputs = [
        model.image_embeddings(
            **{k: v for k, v in processor.image_processor([im, second]).items() if k != "num_tokens"}
        )
        for im in (first, edited)
    ]
    n0 = int(processor.image_processor([first])["num_tokens"][0])
    with torch.no_grad():
        changed_T = (inputs[0] - inputs[1]).abs().amax(-1) > 1e-6
    assert not changed_T[n0:].any()
    assert bool(changed_T[:n0].all()) == summary and changed_T[0]


def test_vision_words_add_the_embeddings_of_the_words_the_patches_detect(tmp_path, processor):
    """Every image token gains sum_k p_k E[ids_k] (p from the tower's word head), the gradient reaches those
    embedding rows, and a saved model rebuilds the head without the tower file."""
    torch.manual_seed(0)
    tower = VisionTower(**ConceptMoEVLMConfig.from_preset("tiny").tower_kwargs())
    head = tower.add_word_head([10, 20, 30])
    with torch.no_grad():
        head.linear.weight.zero_()
        head.linear.bias.copy_(torch.tensor([-10.0, 10.0, -10.0]))  # every patch says word 20
    path = tmp_path / "tower.safetensors"
    save_file({k: v.contiguous() for k, v in tower.state_dict().items()}, str(path))
    model = make_vlm(processor, vision_weights=str(path), vision_words=True).eval()
    plain = make_vlm(processor, vision_weights=str(path)).eval()
    plain.load_state_dict(model.state_dict(), strict=False)  # the same weights but the word head
    assert model.config.vision_word_count == 3 and model.config.vision_weights is None
    inputs = {k: v for k, v in processor.image_processor(images(2)).items() if k != "num_tokens"}
    added_TE = model.image_embeddings(**inputs) - plain.image_embeddings(**inputs)
    table_VE = model.get_input_embeddings().weight
    s = torch.sigmoid(torch.tensor(10.0))
    expected_E = s * table_VE[20] + (1 - s) * (table_VE[10] + table_VE[30])
    torch.testing.assert_close(added_TE, expected_E.expand_as(added_TE).detach(), atol=1e-5, rtol=1e-4)
    added_TE.sum().backward()
    assert table_VE.grad[[10, 20, 30]].abs().sum() > 0 and table_VE.grad[11].abs().sum() == 0
    model.save_pretrained(tmp_path / "hf")
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "hf").eval()
    assert loaded.config.vision_words and loaded.vision_tower.word_head.ids_K.tolist() == [10, 20, 30]
    batch = processor(text=["<image> a yellow square"], images=[images(1)])
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, loaded(**batch).logits)
    with pytest.raises(ValueError, match="vision_words=True is invalid: needs vision_weights"):
        make_vlm(processor, vision_words=True)


def test_without_a_projector_an_image_token_is_its_words_alone(tmp_path, processor):
    """vision_projector=False: each image token is exactly sum_k p_k E[ids_k], the model holds no projector (nor
    does its checkpoint), training reaches the embedding rows, and a saved model reloads the same."""
    torch.manual_seed(0)
    tower = VisionTower(**ConceptMoEVLMConfig.from_preset("tiny").tower_kwargs())
    head = tower.add_word_head([10, 20, 30])
    with torch.no_grad():
        head.linear.weight.zero_()
        head.linear.bias.copy_(torch.tensor([-10.0, 10.0, -10.0]))
    path = tmp_path / "tower.safetensors"
    save_file({k: v.contiguous() for k, v in tower.state_dict().items()}, str(path))
    model = make_vlm(processor, vision_weights=str(path), vision_words=True, vision_projector=False).eval()
    assert model.projector is None and not any(k.startswith("projector.") for k in model.state_dict())
    inputs = {k: v for k, v in processor.image_processor(images(2)).items() if k != "num_tokens"}
    tokens_TE = model.image_embeddings(**inputs)
    table_VE = model.get_input_embeddings().weight
    s = torch.sigmoid(torch.tensor(10.0))
    expected_E = s * table_VE[20] + (1 - s) * (table_VE[10] + table_VE[30])
    torch.testing.assert_close(tokens_TE, expected_E.expand_as(tokens_TE).detach(), atol=1e-5, rtol=1e-4)
    batch = processor(text=["<image> a yellow square"], images=[images(1)])
    model.train()(**batch, labels=batch["input_ids"]).loss.backward()
    assert table_VE.grad[20].abs().sum() > 0
    model.eval().save_pretrained(tmp_path / "hf")
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "hf").eval()
    assert loaded.projector is None and not loaded.config.vision_projector
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, loaded(**batch).logits)
    for fields in ({}, {"vision_words": True, "vision_weights": str(path), "vision_summary": True}):
        with pytest.raises(ValueError, match="vision_projector=False is invalid: needs vision_words=true"):
            make_vlm(processor, vision_projector=False, **fields)


def test_init_from_text_checkpoint_and_freezing(tmp_path, processor):
    torch.manual_seed(0)
    text_model = ConceptMoEForCausalLM(ConceptMoEVLMConfig.from_preset("tiny", vocab_size=320).text_config).eval()
    text_model.save_pretrained(tmp_path)
    vlm = ConceptMoEVLM.from_text_model(str(tmp_path), freeze_vision=True, max_patches=64).eval()
    assert vlm.config.image_token_id == 320 and vlm.config.text_config.vocab_size == 321  # one new token row
    ids = torch.randint(0, 320, (2, 20))
    with torch.no_grad():
        assert torch.allclose(vlm(ids).logits[..., :320], text_model(ids).logits, atol=1e-6)
    assert not any(p.requires_grad for p in vlm.vision_tower.parameters())
    assert all(p.requires_grad for p in vlm.language_model.parameters())
    frozen = ConceptMoEVLM.from_text_model(text_model, freeze_backbone=True, max_patches=64)
    assert not any(p.requires_grad for p in frozen.language_model.parameters())
    assert all(p.requires_grad for p in frozen.projector.parameters())


def test_short_training_on_captioned_images_loss_falls_and_reports_both_r(processor):
    model = make_vlm(processor, seed=0, boundary_router_init="identity").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(0)
    history = []
    for _ in range(60):
        pairs = [captioned_image(rng) for _ in range(8)]
        batch = processor(text=[f"<image> {cap}" for _, cap in pairs], images=[[img] for img, _ in pairs])
        out = model(**batch, labels=batch["input_ids"])
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        history.append((out.aux["lm_loss"].item(), out.chunk_stats["r_by_modality"]))
    first = sum(h[0] for h in history[:5]) / 5
    last = sum(h[0] for h in history[-10:]) / 10
    assert last < first - 1.0, (first, last)
    assert all({0, 1} <= set(h[1]) for h in history)
    assert all(1.0 <= h[1][1] <= 64 and 1.0 <= h[1][0] <= 64 for h in history)


def test_vision_weights_file_is_read_once_not_on_every_load(tmp_path, processor):
    from safetensors.torch import save_file

    source = make_vlm(processor, seed=1)
    weights = tmp_path / "tower.safetensors"
    save_file({k: v.contiguous() for k, v in source.vision_tower.model.state_dict().items()}, str(weights))
    model = make_vlm(processor, vision_weights=str(weights)).eval()
    for a, b in zip(model.vision_tower.parameters(), source.vision_tower.parameters()):
        assert torch.equal(a, b)
    model.save_pretrained(tmp_path / "ckpt")
    weights.unlink()  # the checkpoint holds the tower: loading must not need the original file
    loaded = ConceptMoEVLM.from_pretrained(tmp_path / "ckpt")
    assert loaded.config.vision_weights is None and loaded.config.vision_init_source == str(weights)
    for a, b in zip(model.vision_tower.parameters(), loaded.vision_tower.parameters()):
        assert torch.equal(a, b)


def test_reload_keeps_freezing_and_rebuilds_timm_buffers(tmp_path, processor):
    model = make_vlm(processor, vision_pos_embed="rope", freeze_vision=True, freeze_backbone=True).eval()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    assert not any(p.requires_grad for p in loaded.vision_tower.parameters())
    assert not any(p.requires_grad for p in loaded.language_model.parameters())
    assert all(p.requires_grad for p in loaded.projector.parameters())
    fresh = dict(model.vision_tower.named_buffers())
    for name, buf in loaded.vision_tower.named_buffers():  # RoPE bands are not in the checkpoint
        assert torch.equal(buf, fresh[name]), name
    batch = processor(text=["<image> a red square"], images=[images(1)])
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, loaded(**batch).logits)


def test_building_a_model_leaves_the_callers_config_alone(tmp_path, processor):
    from safetensors.torch import save_file

    source = make_vlm(processor, seed=2)
    weights = tmp_path / "tower.safetensors"
    save_file({k: v.contiguous() for k, v in source.vision_tower.model.state_dict().items()}, str(weights))
    config = ConceptMoEVLMConfig.from_preset(
        "tiny", image_token_id=processor.image_token_id, vision_weights=str(weights)
    )
    first, second = ConceptMoEVLM(config), ConceptMoEVLM(config)
    assert config.vision_weights == str(weights)
    for a, b in zip(first.vision_tower.parameters(), second.vision_tower.parameters()):
        assert torch.equal(a, b)


def test_preset_overrides_reach_the_backbone_and_vocab_can_grow(processor):
    model = ConceptMoEVLM.from_preset(
        "tiny", concept_merge="last", pixel_shuffle=1, image_token_id=processor.image_token_id
    )
    assert model.config.text_config.concept_merge == "last" and model.config.pixel_shuffle == 1
    model.resize_token_embeddings(600)
    assert model.get_input_embeddings().weight.shape[0] == 600 and model.get_output_embeddings().weight.shape[0] == 600


def test_text_only_batch_reports_both_modalities(processor):
    model = make_vlm(processor).eval()
    with torch.no_grad():
        stats = model(**processor(text=["only words", "and more words"])).chunk_stats
    assert stats["tokens_by_modality"][1] == 0 and stats["concepts_by_modality"][1] == 0
    assert stats["r_by_modality"][1] is None and stats["r_by_modality"][0] > 0


def test_processor_keeps_the_tokenizers_special_tokens_and_takes_flat_images(hf_tokenizer):
    from tokenizers.processors import TemplateProcessing

    from data_pipelines.bpe import train_bpe_tokenizer

    tok = train_bpe_tokenizer(
        ["a red square", "a blue circle"] * 20,
        vocab_size=280,
        special_tokens=("<pad>", "<eos>", "<unk>", "[CLS]", "[SEP]"),
    )
    cls_id, sep_id = tok.convert_tokens_to_ids("[CLS]"), tok.convert_tokens_to_ids("[SEP]")
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)]
    )
    proc = VLMProcessor(tok, ImageProcessor(max_patches=64))
    imgs = images(3)
    batch = proc(text=["<image> a red square", "two <image> <image>"], images=imgs, padding_side="left")
    row0 = batch["input_ids"][0][batch["attention_mask"][0].bool()].tolist()
    assert row0[0] == cls_id and row0[-1] == sep_id
    per_row = proc(
        text=["<image> a red square", "two <image> <image>"], images=[imgs[:1], imgs[1:]], padding_side="left"
    )
    assert torch.equal(batch["input_ids"], per_row["input_ids"]) and batch["attention_mask"][0, 0] == 0
    padded = proc(text=["a red square"], padding="max_length", max_length=32)
    assert padded["input_ids"].shape == (1, 32)
    plain = VLMProcessor(hf_tokenizer)  # no post-processor: no BOS invented
    assert plain(text=["a red square"])["input_ids"][0].tolist() == hf_tokenizer("a red square")["input_ids"]


def test_vlm_checkpoint_saved_with_the_old_field_names_loads(tmp_path, processor):
    model = make_vlm(processor, pixel_shuffle=1, concept_merge="last").eval()
    model.save_pretrained(tmp_path)
    fields = json.loads((tmp_path / "config.json").read_text())
    fields["vision_merge"] = fields.pop("pixel_shuffle")
    fields["text_config"]["merge"] = fields["text_config"].pop("concept_merge")
    fields["text_config"]["router_init"] = fields["text_config"].pop("boundary_router_init")
    (tmp_path / "config.json").write_text(json.dumps(fields))
    loaded = ConceptMoEVLM.from_pretrained(tmp_path).eval()
    assert loaded.config.pixel_shuffle == 1 and not hasattr(loaded.config, "vision_merge")
    assert loaded.config.text_config.concept_merge == "last" == loaded.language_model.config.concept_merge
    batch = VLMProcessor(processor.tokenizer, ImageProcessor(patch_size=16, max_patches=64, pixel_shuffle=1))(
        text=["<image> a yellow square"], images=[images(1)]
    )
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, loaded(**batch).logits)


def test_set_chunking_reaches_the_backbone_and_the_vlm_config(processor):
    model = make_vlm(processor).eval()
    model.set_chunking(chunking="fixed", target_r=3.0, modality_boundaries=True)
    for cfg in (model.config.text_config, model.language_model.config, model.language_model.model.config):
        assert (cfg.chunking, cfg.target_r) == ("fixed", 3.0)
    assert model.config.modality_boundaries
    before = model.config.to_dict()
    with pytest.raises(ValueError, match="noise_tau"):
        model.set_chunking(target_r=5.0, noise_tau=-1.0)
    with pytest.raises(ValueError, match="'d_model' is not a chunking setting"):
        model.set_chunking(target_r=5.0, d_model=8)
    with pytest.raises(ValueError, match="chunking='none' cannot be applied"):
        model.set_chunking(chunking="none", modality_boundaries=False)
    assert model.config.to_dict() == before  # a refused call changes nothing


def test_text_config_is_the_backbone_config_object(tmp_path, processor):
    """set_chunking writes ``config.text_config`` once: built, loaded and from_text_model models share one object."""
    built = make_vlm(processor)
    built.save_pretrained(tmp_path)
    for model in (built, ConceptMoEVLM.from_pretrained(tmp_path), ConceptMoEVLM.from_text_model(built.language_model)):
        assert model.config.text_config is model.language_model.config is model.language_model.model.config


def test_forward_refuses_unknown_keywords_and_ignores_num_tokens(processor):
    model = make_vlm(processor).eval()
    batch = processor(text=["<image> a red square"], images=[images(1)])
    assert "num_tokens" in batch  # part of every processor batch: model(**batch) must take it
    with torch.no_grad():
        with_counts = model(**batch).logits
        without = model(**{k: v for k, v in batch.items() if k != "num_tokens"}).logits
        assert torch.equal(with_counts, without)
        patches = batch.pop("patches")
        with pytest.raises(TypeError, match=r"\['patchs', 'pixel_values'\]"):
            model(**batch, patchs=patches, pixel_values=patches)
        with pytest.raises(TypeError, match="output_attentions"):
            model(**batch, patches=patches, output_attentions=True)


def test_the_backbone_reports_exactly_the_data_modalities():
    from data_pipelines import Modality
    from vlm.backbone.outputs import ALWAYS_REPORTED

    assert tuple(int(m) for m in Modality) == ALWAYS_REPORTED == (Modality.TEXT, Modality.IMAGE)


def test_generate_without_the_cache_equals_generate_with_it_on_image_prompts(processor):
    """``use_cache=False`` reruns the whole forward each step on the prompt plus the new tokens: the prompt's
    ``modality_ids`` must stretch over the new (text) tokens, and the tokens must equal the cached decode's."""
    model = make_vlm(processor).eval()
    texts = ["<image>\nWhat?", "<image>\nA longer question here?"]
    batch = processor(text=texts, images=[[img] for img in images(2)], padding_side="left", return_tensors="pt")
    cached = model.generate(**batch, max_new_tokens=5, do_sample=False)
    assert torch.equal(model.generate(**batch, max_new_tokens=5, do_sample=False, use_cache=False), cached)
