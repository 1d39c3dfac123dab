"""Conversations through the packer: the loss covers the assistant answers and their end-of-turn token only."""

import io

import pytest
from PIL import Image

from data_pipelines.chat import END_OF_TURN, render
from data_pipelines.packing import IGNORE, Packer, TokenEncoder, encode_sample_tokens
from data_pipelines.schema import Modality, Sample, Segment, Turn
from data_pipelines.tokenizer import load_tokenizer
from vision_tower import ImageProcessor


def png(colour, size=(64, 32)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def two_turns_two_images() -> Sample:
    return Sample(
        key="chat",
        segments=[],
        turns=[
            Turn("system", [Segment(text="Answer briefly.")]),
            Turn("user", [Segment(image=png("red")), Segment(text="\nWhat colour is this?")]),
            Turn("assistant", [Segment(text="red")]),
            Turn("user", [Segment(text="And this one? "), Segment(image=png("blue", (32, 64)))]),
            Turn("assistant", [Segment(text="It is blue.")]),
        ],
    )


def labelled_spans(labels: list[int]) -> list[list[int]]:
    """Runs of consecutive labelled positions."""
    spans, current = [], []
    for label in labels:
        if label == IGNORE:
            if current:
                spans.append(current)
            current = []
        else:
            current.append(label)
    return spans + ([current] if current else [])


def test_labels_are_exactly_the_two_answers_and_their_end_of_turn(tok):
    proc = ImageProcessor(patch_size=16, max_patches=64)
    sample = two_turns_two_images()
    doc = encode_sample_tokens(sample, tok, proc, tok.convert_tokens_to_ids("<image>"))
    packer = Packer(512)
    assert list(packer.add(doc)) == []
    row = packer.flush()
    spans = labelled_spans(row.labels)
    assert [tok.decode(span) for span in spans] == [f"red{END_OF_TURN}", f"It is blue.{END_OF_TURN}"]
    # nothing else: no system / user text, no role token, no image slot, no closing eos
    labelled = [i for i, label in enumerate(row.labels) if label != IGNORE]
    assert all(row.modality_ids[i] == Modality.TEXT for i in labelled)
    assert (
        len(labelled)
        == sum(len(s) for s in spans)
        == len(tok("red", add_special_tokens=False)["input_ids"])
        + len(tok("It is blue.", add_special_tokens=False)["input_ids"])
        + 2
    )
    assert sum(m == Modality.IMAGE for m in row.modality_ids) == sum(doc.num_tokens) and len(doc.images) == 2


def test_conversation_ids_are_the_rendered_template_tokenised(tok):
    """Training's turn-by-turn encoding equals tokenising the rendered conversation (the inference path), with
    each <image> marker expanded to its slots."""
    proc = ImageProcessor(patch_size=16, max_patches=64)
    sample = two_turns_two_images()
    image_id = tok.convert_tokens_to_ids("<image>")
    doc = encode_sample_tokens(sample, tok, proc, image_id)
    text = render(sample.turns)
    expected, images = [], iter(doc.num_tokens)
    for i, piece in enumerate(text.split("<image>")):
        if i:
            expected += [image_id] * next(images)
        expected += tok(piece, add_special_tokens=False)["input_ids"]
    assert doc.input_ids == expected + TokenEncoder(tok).closing()


@pytest.mark.parametrize("loss_on,captions_labelled,roles_labelled", [("all", True, True), ("assistant", False, False)])
def test_loss_on_switch(tok, loss_on, captions_labelled, roles_labelled):
    proc = ImageProcessor(patch_size=16, max_patches=64)
    image_id = tok.convert_tokens_to_ids("<image>")
    caption = Sample(key="cap", segments=[Segment(image=png("green")), Segment(text="a green field")])
    doc = encode_sample_tokens(caption, tok, proc, image_id, loss_on=loss_on)
    assert any(doc.targets) == captions_labelled
    assert not any(t for t, m in zip(doc.targets, doc.modality_ids) if m == Modality.IMAGE)
    chat = encode_sample_tokens(two_turns_two_images(), tok, proc, image_id, loss_on=loss_on)
    user_id = tok.convert_tokens_to_ids("<|user|>")
    assert chat.targets[chat.input_ids.index(user_id)] == roles_labelled
    with pytest.raises(ValueError, match="loss_on"):
        encode_sample_tokens(caption, tok, proc, image_id, loss_on="answers")
