"""Incremental decoding and generate(): every step equals the full forward, caches hold what they should."""

# Shape suffixes (docs/paper.md §0): B batch rows, N tokens per row.

import random

import pytest
import torch
from naive_reference import plain_moe_transformer_logits

from data_pipelines.synthetic_images import captioned_image
from vision_tower import ImageProcessor
from vlm import ConceptMoEConfig, ConceptMoEForCausalLM, ConceptMoEVLM, VLMProcessor

VARIANTS = {
    "none": dict(chunking="none"),
    "fixed": dict(chunking="fixed", target_r=2.0),
    "dynamic-sum": dict(),
    "dynamic-last": dict(concept_merge="last"),
    "linear-router": dict(boundary_router="linear"),
    "looped": dict(concept_layers=3, concept_loop=2, concept_loop_layers=1, concept_top_k=3),
    "wide": dict(concept_d_model=96, concept_num_experts=4, concept_top_k=3),
    # a quarter of the ids force a boundary, in the prompt and in the decoded tokens alike
    "boundary-tokens": dict(boundary_token_ids=list(range(3, 96, 4))),
    "fixed-boundary-tokens": dict(chunking="fixed", target_r=3.0, boundary_token_ids=list(range(3, 96, 4))),
}


def make_lm(seed=0, **overrides):
    torch.manual_seed(seed)
    fields = dict(
        vocab_size=96,
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        encoder_layers=1,
        concept_layers=2,
        decoder_layers=2,
        joint_layers=1,
        boundary_router_init="random",
        qk_norm="head",
        pad_token_id=0,
    )
    fields.update(overrides)
    return ConceptMoEForCausalLM(ConceptMoEConfig(**fields)).eval()


def left_padded_batch(lengths, total, vocab=96, seed=0):
    """Rows of different prompt lengths, left-padded to the same width, plus ``total - width`` more tokens."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), total), generator=g)
    mask = torch.ones(len(lengths), total, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, : width - n] = 0
    return ids.masked_fill(mask == 0, 0), mask, width


def decode_stepwise(model, ids, mask, width, **prefill_kwargs):
    """Prefill ``width`` columns, then feed the remaining columns one at a time; logits of every position."""
    out = model(input_ids=ids[:, :width], attention_mask=mask[:, :width], use_cache=True, **prefill_kwargs)
    logits = [out.logits]
    for t in range(width, ids.shape[1]):
        out = model(input_ids=ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=out.cache, use_cache=True)
        logits.append(out.logits)
    return torch.cat(logits, dim=1), out.cache


@pytest.mark.parametrize("variant", list(VARIANTS))
@torch.no_grad()
def test_stepwise_decoding_equals_the_full_forward(variant):
    model = make_lm(**VARIANTS[variant])
    ids, mask, width = left_padded_batch([9, 5, 2], total=24)
    full = model(input_ids=ids, attention_mask=mask)
    stepped, cache = decode_stepwise(model, ids, mask, width)
    real = mask.bool()
    assert torch.allclose(stepped[real], full.logits[real], atol=1e-4), (stepped - full.logits)[real].abs().max()
    # the concept cache holds one entry per boundary of the row (per token without chunking)
    boundaries = full.chunk_stats["concepts"] if model.config.chunked else int(real.sum())
    assert int(cache.concept_lengths().sum()) == boundaries
    if model.config.chunked:
        per_row = [model(input_ids=ids[i : i + 1, mask[i].bool()]).chunk_stats["concepts"] for i in range(3)]
        assert cache.concept_lengths().tolist() == per_row
        kv = cache.kv_bytes()
        assert kv["total"] == kv["token"] + kv["concept"] and 0 < kv["concept"] < kv["token"]


@torch.no_grad()
def test_only_rows_at_a_boundary_run_the_concept_model():
    model = make_lm()
    ids, mask, width = left_padded_batch([6, 6, 6, 6], total=20, seed=3)
    b_BN = model.model(input_ids=ids, attention_mask=mask).chunk.b_BN
    rows_seen = []
    hook = model.model.concept_model.register_forward_hook(lambda mod, args, out: rows_seen.append(args[0].shape[0]))
    try:
        decode_stepwise(model, ids, mask, width)
    finally:
        hook.remove()
    expected = [int(n) for n in b_BN[:, width:].sum(dim=0) if n > 0]
    assert rows_seen[1:] == expected  # after the prefill: one call per step with a boundary, on those rows only
    assert len(expected) < ids.shape[1] - width  # and some steps skipped the concept model entirely


@torch.no_grad()
def test_none_decoding_equals_an_independent_plain_moe():
    model = make_lm(chunking="none", qk_norm="none", joint_layers=0)
    ids, mask, width = left_padded_batch([7], total=15, seed=5)
    stepped, _ = decode_stepwise(model, ids, mask, width)
    reference = plain_moe_transformer_logits(model, ids[0])
    assert torch.allclose(stepped[0], reference, atol=1e-4)


@pytest.mark.parametrize("variant", ["none", "dynamic-sum", "looped"])
@torch.no_grad()
def test_greedy_generate_equals_argmax_over_repeated_full_forwards(variant):
    model = make_lm(**VARIANTS[variant])
    ids, mask, width = left_padded_batch([8, 3, 5], total=8)
    generated = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    seq, am = ids, mask
    for _ in range(10):
        nxt = model(input_ids=seq, attention_mask=am).logits[:, -1].argmax(-1, keepdim=True)
        seq, am = torch.cat([seq, nxt], 1), torch.cat([am, torch.ones_like(nxt)], 1)
    assert torch.equal(generated, seq)


@torch.no_grad()
def test_sampling_arguments_eos_and_seeds():
    model = make_lm()
    ids, mask, _ = left_padded_batch([6, 4], total=6)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=True, temperature=0.8, top_p=0.9, top_k=0)
    torch.manual_seed(1)
    a = model.generate(ids, **kwargs)
    torch.manual_seed(1)
    b = model.generate(ids, **kwargs)
    assert torch.equal(a, b) and a.shape == (2, 18)
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    eos = int(greedy[0, 7])  # the second generated token of row 0 becomes the end of sequence
    stopped = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos)
    assert int(stopped[0, 7]) == eos and (stopped[0, 8:] == 0).all()  # padded after its eos
    assert torch.equal(stopped[0, :8], greedy[0, :8])


def test_right_padded_prompts_are_refused_with_a_clear_error():
    model = make_lm()
    ids, mask = torch.randint(3, 96, (2, 6)), torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    with pytest.raises(ValueError, match="left-padded"):
        model(input_ids=ids, attention_mask=mask, use_cache=True)


# ----------------------------------------------------------------------------- the VLM
@pytest.fixture()
def processor(hf_tokenizer):
    return VLMProcessor(hf_tokenizer, ImageProcessor(patch_size=16, max_patches=64, pixel_shuffle=2))


def images(n, seed=0):
    rng = random.Random(seed)
    return [captioned_image(rng)[0] for _ in range(n)]


@pytest.mark.parametrize(
    "modality_boundaries, image_chunking, boundary_token_ids",
    [
        (False, "raster", None),
        (True, "raster", None),
        (True, "rows", None),
        (False, "snake", None),
        (False, "zorder", None),
        (False, "router2d", None),
        (True, "raster", list(range(5, 200, 3))),  # forced on a third of the text ids, prompt and decoded tokens
    ],
)
@torch.no_grad()
def test_vlm_stepwise_decoding_with_images_equals_the_full_forward(
    processor, modality_boundaries, image_chunking, boundary_token_ids
):
    """Every image scan (vlm/image_scan.py) too: 128 x 96 images give 3 x 4 token grids, where they all differ."""
    torch.manual_seed(0)
    model = ConceptMoEVLM.from_preset(
        "tiny",
        image_token_id=processor.image_token_id,
        max_patches=64,
        boundary_router_init="random",
        modality_boundaries=modality_boundaries,
        image_chunking=image_chunking,
        boundary_token_ids=boundary_token_ids,
    ).eval()
    imgs = [img.resize((128, 96)) for img in images(3)]
    prompts = ["<image> what colour is the shape?", "a short one", "two pictures <image> and <image>"]
    batch = processor(text=prompts, images=[imgs[:1], [], imgs[1:]], padding_side="left")
    width = batch["input_ids"].shape[1]
    extra = torch.randint(5, 200, (3, 8), generator=torch.Generator().manual_seed(0))
    full_ids = torch.cat([batch["input_ids"], extra], 1)
    full_mask = torch.cat([batch["attention_mask"], torch.ones_like(extra)], 1)
    full_modality = torch.cat([batch["modality_ids"], torch.zeros_like(extra)], 1)
    image_inputs = {k: batch[k] for k in ("patches", "patch_coord", "patch_valid", "grid_hw")}
    full = model(input_ids=full_ids, attention_mask=full_mask, modality_ids=full_modality, **image_inputs)
    out = model(**batch, use_cache=True)
    logits = [out.logits]
    for t in range(width, full_ids.shape[1]):
        out = model(input_ids=full_ids[:, t : t + 1], attention_mask=full_mask[:, : t + 1], cache=out.cache)
        logits.append(out.logits)
    stepped, real = torch.cat(logits, 1), full_mask.bool()
    assert torch.allclose(stepped[real], full.logits[real], atol=1e-4)
    assert int(out.cache.concept_lengths().sum()) == full.chunk_stats["concepts"]
    if boundary_token_ids:  # the VLM's own forward (embeddings in) forces them too
        at_BN = torch.isin(full_ids, torch.tensor(boundary_token_ids)) & full_mask.bool()
        assert bool(at_BN.any()) and bool(full.chunk.b_BN[at_BN].all())

    generated = model.generate(**batch, max_new_tokens=6, do_sample=False)
    seq, am, mod = batch["input_ids"], batch["attention_mask"], batch["modality_ids"]
    for _ in range(6):  # full forwards of the sequence so far, as generation sees it: what follows is text, so a
        # prompt ending on an image token closes the span there (use_cache=True; modality_boundaries forces it)
        out = model(input_ids=seq, attention_mask=am, modality_ids=mod, use_cache=True, **image_inputs)
        nxt = out.logits[:, -1].argmax(-1)
        seq, am = torch.cat([seq, nxt[:, None]], 1), torch.cat([am, torch.ones_like(nxt[:, None])], 1)
        mod = torch.cat([mod, torch.zeros_like(nxt[:, None])], 1)
    assert torch.equal(generated, seq)


@torch.no_grad()
def test_vlm_prompt_ending_on_an_image_closes_the_image_span(processor):
    torch.manual_seed(1)
    model = ConceptMoEVLM.from_preset(
        "tiny",
        image_token_id=processor.image_token_id,
        max_patches=64,
        boundary_router_init="random",
        modality_boundaries=True,
    ).eval()
    batch = processor(text=["look: <image>"], images=[images(1, seed=2)], padding_side="left")
    out = model(**batch, use_cache=True)
    assert out.chunk_stats["concepts_by_modality"][1] >= 1
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    step = model(
        input_ids=nxt, attention_mask=torch.cat([batch["attention_mask"], torch.ones_like(nxt)], 1), cache=out.cache
    )
    full = model(
        input_ids=torch.cat([batch["input_ids"], nxt], 1),
        modality_ids=torch.cat([batch["modality_ids"], torch.zeros_like(nxt)], 1),
        **{k: batch[k] for k in ("patches", "patch_coord", "patch_valid", "grid_hw")},
    )
    assert torch.allclose(step.logits[:, -1], full.logits[:, -1], atol=1e-4)


@torch.no_grad()
def test_beam_search_reorders_the_cache_like_recomputing_without_one():
    model = make_lm(concept_merge="last")
    ids, mask, _ = left_padded_batch([8, 5], total=8, seed=7)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, num_beams=3, do_sample=False)
    assert torch.equal(model.generate(ids, **kwargs), model.generate(ids, use_cache=False, **kwargs))


# ----------------------------------------------------------------------------- bad prompts: one-line errors
def _one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message and message
    return message


@torch.no_grad()
def test_generate_refuses_an_empty_prompt_or_an_empty_row():
    model = make_lm()
    with pytest.raises(ValueError, match="prompt is empty") as err:
        model.generate(torch.zeros(2, 0, dtype=torch.long), max_new_tokens=3)
    _one_line(err)
    ids, mask, _ = left_padded_batch([4, 3], total=4)
    mask[1] = 0  # the second row has no real token at all
    with pytest.raises(ValueError, match="prompt row 1 is empty") as err:
        model.generate(ids, attention_mask=mask, max_new_tokens=3)
    _one_line(err)
    with pytest.raises(ValueError, match="at least one token"):  # a prefill by hand, without generate
        model(input_ids=torch.zeros(1, 0, dtype=torch.long), use_cache=True)


@torch.no_grad()
def test_generate_refuses_prompt_plus_new_tokens_beyond_max_position_embeddings():
    model = make_lm(max_position_embeddings=24)
    ids = torch.randint(3, 96, (1, 25), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="prompt has 25 tokens, more than max_position_embeddings=24") as err:
        model.generate(ids, max_new_tokens=1, do_sample=False)
    _one_line(err)
    with pytest.raises(ValueError, match="prompt has 25 tokens"):  # HF's default max_length: still this error
        model.generate(ids, do_sample=False)
    with pytest.raises(ValueError, match=r"20 tokens \+ max_new_tokens=5 = 25 positions.*lower max_new_tokens to 4"):
        model.generate(ids[:, :20], max_new_tokens=5, do_sample=False)
    assert model.generate(ids[:, :20], max_new_tokens=4, do_sample=False).shape == (1, 24)  # exactly the limit
    # positions count real tokens (they restart after left padding), not the padded width: 18 + 6 fits
    ids, mask, _ = left_padded_batch([18, 9], total=18)
    ids, mask = (torch.cat([torch.zeros(2, 4, dtype=torch.long), t], 1) for t in (ids, mask))  # padded to width 22
    assert model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False).shape == (2, 28)
    with pytest.raises(ValueError, match="18 tokens \\+ max_new_tokens=7"):
        model.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False)
    # by hand: a prefill past the limit, and decoding past it, are refused too
    long_ids = torch.randint(3, 96, (1, 25))
    with pytest.raises(ValueError, match="25 positions, more than max_position_embeddings=24"):
        model(input_ids=long_ids, use_cache=True)
    out = model(input_ids=long_ids[:, :24], use_cache=True)
    with pytest.raises(ValueError, match="decoding past max_position_embeddings=24"):
        model(input_ids=long_ids[:, 24:], attention_mask=torch.ones(1, 25, dtype=torch.long), cache=out.cache)


@torch.no_grad()
def test_vlm_generate_refuses_empty_and_too_long_prompts(processor):
    batch = processor(text=["<image> what colour is the shape?"], images=[images(1)], padding_side="left")
    width = batch["input_ids"].shape[1]  # image slots included: they take positions like text tokens
    torch.manual_seed(0)
    model = ConceptMoEVLM.from_preset(
        "tiny", image_token_id=processor.image_token_id, max_patches=64, max_position_embeddings=width + 2
    ).eval()
    assert model.config.text_config.max_position_embeddings == width + 2
    with pytest.raises(ValueError, match="prompt is empty") as err:
        model.generate(input_ids=torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2)
    _one_line(err)
    with pytest.raises(ValueError, match=f"prompt of {width} tokens \\+ max_new_tokens=3") as err:
        model.generate(**batch, max_new_tokens=3, do_sample=False)
    _one_line(err)
    assert model.generate(**batch, max_new_tokens=2, do_sample=False).shape == (1, width + 2)
