import io
import json

import numpy as np
import pytest
from PIL import Image

from data_pipelines import prompts
from data_pipelines.local_text import load_local_text_corpus
from data_pipelines.schema import encode_sample
from data_pipelines.synthetic import GENERATORS, generate, interleave, needles, scenes

KINDS = sorted(GENERATORS)
INSTRUCTIONS = (
    prompts.SCENEQA_INSTRUCTION,
    prompts.REFLOC_INSTRUCTION,
    prompts.LONGDOC_INSTRUCTION,
    prompts.NIAH_INSTRUCTION,
    prompts.NIAH_VALUE_INSTRUCTION,
)
N = {"scenes": 12, "documents": 3, "needles": 4, "text": 12, "copying": 12}
N |= {"scenes_chat": 12, "documents_chat": 3, "needles_chat": 4, "copying_chat": 12}


def _bytes(samples) -> list[dict]:
    return [encode_sample(s) for s in samples]


def _content(sample) -> bytes:
    """Everything of a sample but its key."""
    members = encode_sample(sample)
    return b"".join(v for k, v in sorted(members.items()) if k != "__key__")


def _pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


@pytest.mark.parametrize("kind", KINDS)
def test_same_seed_same_bytes_other_seed_other_bytes(kind):
    first = _bytes(generate(kind, N[kind], seed=1))
    assert first == _bytes(generate(kind, N[kind], seed=1))
    other = _bytes(generate(kind, N[kind], seed=2))
    assert all(a["__key__"] != b["__key__"] for a, b in zip(first, other))
    contents = [_content(s) for s in generate(kind, N[kind], seed=1)]
    other_contents = [_content(s) for s in generate(kind, N[kind], seed=2)]
    assert all(a != b for a, b in zip(contents, other_contents))
    if kind != "text":  # text: another seed is another order of the same corpus
        assert set(contents).isdisjoint(other_contents)


@pytest.mark.parametrize("kind", KINDS)
def test_train_and_eval_are_disjoint(kind):
    train, evaluation = list(generate(kind, N[kind], 0, "train")), list(generate(kind, N[kind], 0, "eval"))
    assert len(train) == len(evaluation) == N[kind]
    assert {s.key for s in train}.isdisjoint(s.key for s in evaluation)
    assert {_content(s) for s in train}.isdisjoint(_content(s) for s in evaluation)
    train_parts = {seg.image or seg.text for s in train for seg in s.all_segments}
    eval_parts = {seg.image or seg.text for s in evaluation for seg in s.all_segments}
    shared = train_parts & eval_parts
    # Only fixed question texts (documents: "What is the code word on page 1?") may recur across splits, and in
    # conversations the text around them (line breaks, instruction) and short answers ("2", "red").
    fixed = [qa["q"] for s in train + evaluation for qa in s.qa] + list(INSTRUCTIONS)
    answers = {qa["a"] for s in train + evaluation for qa in s.qa}

    def allowed(part: str) -> bool:
        for text in fixed:
            part = part.replace(text, "")
        return part.startswith("What is the") or not part.strip() or part in answers

    assert all(isinstance(p, str) and allowed(p) for p in shared), shared


@pytest.mark.parametrize("kind", ["scenes", "needles"])
def test_sample_i_does_not_depend_on_n(kind):
    assert _bytes(generate(kind, 2, 5)) == _bytes(generate(kind, 4, 5))[:2]


def test_unknown_kind_split_or_repeat_raise():
    with pytest.raises(ValueError, match="kind"):
        generate("videos", 1, 0)
    with pytest.raises(ValueError, match="split"):
        generate("scenes", 1, 0, "test")
    with pytest.raises(ValueError, match="repeat"):
        interleave(["text", "text"], 1, 0)


def test_interleave_is_round_robin_and_drops_exhausted_kinds():
    got = [s.meta["kind"] for s in interleave(["scenes", "text"], 3, 0, "eval")]
    assert got == ["scenes", "text"] * 3


def test_scene_boxes_are_tight_around_the_drawn_shapes():
    for sample in generate("scenes", 40, 3):
        pixels = _pixels(sample.segments[0].image)
        h, w, _ = pixels.shape
        meta = sample.meta
        assert meta["canvas"] == {"width": w, "height": h}
        inside_count = {}
        for obj in meta["objects"]:
            x0, y0, x1, y1 = obj["box_px"]
            assert [round(v * s) for v, s in zip(obj["box"], (w, h, w, h))] == obj["box_px"]
            crop = (pixels[y0:y1, x0:x1] == scenes.COLOURS[obj["colour"]]).all(-1)
            assert crop.mean() > 0.3, obj  # the shape fills its box
            assert crop[0].any() and crop[-1].any() and crop[:, 0].any() and crop[:, -1].any(), obj  # tight
            inside_count[obj["colour"]] = inside_count.get(obj["colour"], 0) + int(crop.sum())
        for colour, count in inside_count.items():  # no pixel of an object's colour outside the boxes
            assert (pixels == scenes.COLOURS[colour]).all(-1).sum() == count


def test_scene_qa_agrees_with_meta():
    for sample in generate("scenes", 30, 4):
        objects = sample.meta["objects"]
        by_type = {}
        for item in sample.qa:
            by_type.setdefault(item["type"], []).append(item)
        assert by_type["count"][0]["a"] == str(len(objects))
        box_qa = by_type["box"][0]
        target = next(o for o in objects if f"{o['colour']} {o['shape']}" in box_qa["q"])
        assert box_qa["box"] == target["box"]
        assert json.loads(box_qa["a"]) == [round(v, 2) for v in target["box"]]
        assert sample.segments[1].text and all(o["colour"] in sample.segments[1].text for o in objects)


def test_document_answer_is_on_the_stated_page():
    for sample in generate("documents", 4, 2):
        meta, (qa,) = sample.meta, sample.qa
        pages = [seg for seg in sample.segments if seg.image is not None]
        assert len(pages) == meta["num_pages"] == len(meta["page_texts"]) and sample.segments[-1].text == qa["q"]
        page = meta["answer_page"]
        assert qa["page"] == page and f"page {page + 1}?" in qa["q"] and qa["a"] == meta["code_words"][page]
        for k, text in enumerate(meta["page_texts"]):
            flat = " ".join(text.split())
            assert f"The code word on page {k + 1} is {meta['code_words'][k]}." in flat
            assert flat.endswith(f"Page {k + 1} of {meta['num_pages']}")
            assert all(word not in flat for j, word in enumerate(meta["code_words"]) if j != k)
        pixels = _pixels(pages[page].image)
        h, w, _ = pixels.shape
        assert [w, h] == meta["page_size"]
        x0, y0, x1, y1 = (round(v * s) for v, s in zip(meta["answer_box"], (w, h, w, h)))
        assert x1 - x0 > 5 and (pixels[y0:y1, x0:x1] < 128).any()  # ink where the answer word is drawn


def test_needle_depth_and_modality_are_honoured():
    samples = list(generate("needles", 22, 0, "eval"))
    assert {(s.meta["depth"], s.meta["needle_modality"]) for s in samples} == {
        (d, m) for d in needles.DEPTHS for m in needles.MODALITIES
    }
    for sample in samples:
        meta, (qa,) = sample.meta, sample.qa
        context, question = sample.segments[:-1], sample.segments[-1]
        assert question.text == qa["q"] and qa["a"] in meta["needle"]
        assert len(context) == meta["context_segments"]
        assert meta["context_images"] == sum(seg.image is not None for seg in context)
        assert meta["needle_index"] == round(meta["depth"] * (len(context) - 1))
        needle = context[meta["needle_index"]]
        if meta["needle_modality"] == "text":
            assert needle.text == meta["needle"]
        else:
            pixels = _pixels(needle.image)
            h, w, _ = pixels.shape
            x0, y0, x1, y1 = (round(v * s) for v, s in zip(meta["needle_box"], (w, h, w, h)))
            assert (pixels[y0:y1, x0:x1] < 128).any()
        assert sum(meta["needle"] in (seg.text or "") for seg in context) == (meta["needle_modality"] == "text")


def test_text_samples_are_the_corpus_split():
    corpus = load_local_text_corpus()
    evaluation = [s.segments[0].text for s in generate("text", 10_000, 0, "eval")]
    assert sorted(evaluation) == sorted(corpus["eval"])  # all of them, once each
    train = [s.segments[0].text for s in generate("text", 20, 0, "train")]
    assert set(train) <= set(corpus["train"]) and len(set(train)) == 20


def test_object_size_and_max_objects_draw_a_curriculum_stage():
    """``object_size`` (fractions of the short side) and ``max_objects=1``: one large shape per scene, its box as
    wide as drawn (a star's or triangle's mask may be a pixel short of the side), size words from the fraction."""
    samples = list(generate("scenes", 30, 5, max_objects=1, object_size=(0.6, 0.9)))
    for sample in samples:
        (obj,) = sample.meta["objects"]
        side = min(sample.meta["canvas"].values())
        x0, y0, x1, y1 = obj["box_px"]
        assert 0.6 * side - 2 <= max(x1 - x0, y1 - y0) <= 0.9 * side + 1, (obj, side)
        assert obj["size"] == "large"
    assert [s.meta for s in generate("scenes", 30, 5)] != [s.meta for s in samples]  # options change the draw
    assert [s.meta for s in generate("scenes", 3, 5)] == [s.meta for s in generate("scenes", 3, 5, object_size=None)]
    assert scenes.size_word(0.15) == "small" and scenes.size_word(0.26) == "medium" and scenes.size_word(0.8) == "large"
    for bad in ((0.5,), (0.6, 0.99), (0.7, 0.6), 0.5):
        with pytest.raises(ValueError, match="object_size"):
            next(generate("scenes", 1, 0, object_size=bad))


def test_interleave_routes_each_option_to_the_kinds_that_take_it():
    got = list(interleave(["scenes_chat", "text"], 4, 0, "train", {"max_objects": 1, "object_size": [0.5, 0.6]}))
    scenes_of = [s for s in got if s.meta["kind"] == "scenes_chat"]
    assert len(scenes_of) == 4 and all(s.meta["task"] in ("sceneqa", "refloc") for s in scenes_of)
    base = list(generate("scenes", 4, 0, max_objects=1, object_size=[0.5, 0.6]))
    assert {s.meta["source"] for s in scenes_of} <= {b.key for b in base}
    with pytest.raises(ValueError, match="max_objects taken by none of"):
        list(interleave(["text"], 1, 0, "train", {"max_objects": 1}))


def test_types_keeps_only_the_named_questions_and_changes_nothing_else():
    """``types`` filters each scene's qa items (a stage without the long box answers); images, captions and the
    other items stay byte-identical, and a conversation kind keeps drawing scenes until it has ``n``."""
    full = list(generate("scenes", 6, 3))
    kept = list(generate("scenes", 6, 3, types=["colour", "shape"]))
    for a, b in zip(full, kept):
        assert a.segments[0].image == b.segments[0].image and a.segments[1].text == b.segments[1].text
        assert b.qa == [q for q in a.qa if q["type"] in ("colour", "shape")]
    assert [s.qa for s in generate("scenes", 3, 3, types="count")] == [
        [q for q in s.qa if q["type"] == "count"] for s in full[:3]
    ]
    chats = list(generate("scenes_chat", 12, 3, types=["colour"]))  # several objects: some scenes give no item
    assert len(chats) == 12 and {c.meta["type"] for c in chats} == {"colour"}
    assert chats[-1].meta["index"] >= 12
    for bad in ([], ["size"], ["colour", "box", "area"]):
        with pytest.raises(ValueError, match="types must be"):
            next(generate("scenes", 1, 0, types=bad))


def test_needle_modalities_keep_only_those_needles():
    """``modalities="text"`` (a copying stage): every needle is a text segment, the depth grid still covered."""
    samples = list(generate("needles", 22, 0, "train", min_units=1, max_units=3, modalities="text"))
    assert {s.meta["needle_modality"] for s in samples} == {"text"}
    assert {s.meta["depth"] for s in samples} == set(needles.DEPTHS)
    both = list(generate("needles", 22, 0, "train", min_units=1, max_units=3, modalities=["text", "image"]))
    assert [s.meta for s in both] == [s.meta for s in generate("needles", 22, 0, "train", min_units=1, max_units=3)]
    for bad in ("audio", [], ["text", "text"]):
        with pytest.raises(ValueError, match="modalities"):
            next(generate("needles", 1, 0, modalities=bad))


def test_needle_sentence_answers_restate_the_needle_with_the_value_last():
    """The default (``answer="sentence"``, as ``cmoe_niah`` asks): the answer is the needle sentence, ending in the
    value, the user turn asks for the sentence; ``answer="value"``: the same haystacks, the value alone and its
    instruction."""
    values = list(generate("needles", 6, 0, "train", min_units=1, max_units=2, answer="value"))
    sentences = list(generate("needles", 6, 0, "train", min_units=1, max_units=2))
    for v, s in zip(values, sentences, strict=True):
        assert v.segments == s.segments and v.meta["answer"] == "value" and s.meta["answer"] == "sentence"
        assert s.qa[0]["a"] == s.meta["needle"] and s.qa[0]["value"] == v.qa[0]["a"] and "value" not in v.qa[0]
        assert s.qa[0]["a"].removesuffix(".").endswith(" " + v.qa[0]["a"])
    chats = list(generate("needles_chat", 2, 0, "train", min_units=1, max_units=2))
    for chat, base in zip(chats, sentences[:2], strict=True):
        user, assistant = chat.turns
        assert user.segments[-1].text.endswith(prompts.NIAH_INSTRUCTION)
        assert assistant.segments[0].text == base.meta["needle"]
    plain = next(generate("needles_chat", 1, 0, "train", min_units=1, max_units=2, answer="value"))
    assert plain.turns[0].segments[-1].text.endswith(prompts.NIAH_VALUE_INSTRUCTION)
    with pytest.raises(ValueError, match="answer must be one of"):
        next(generate("needles", 1, 0, answer="both"))


def test_copying_asks_for_one_line_by_its_first_word():
    samples = list(generate("copying", 40, seed=0, min_lines=1, max_lines=5, min_words=3, max_words=6))
    assert {s.meta["lines"] for s in samples} == {1, 2, 3, 4, 5}
    for s in samples:
        lines = s.segments[0].text.split("\n")
        firsts = [line.split()[0] for line in lines]
        (qa,) = s.qa
        assert len(lines) == s.meta["lines"] and len(set(firsts)) == len(firsts)  # the key names one line
        assert all(3 <= len(line.split()) <= 6 for line in lines)
        assert qa["a"] == lines[s.meta["line_index"]]
        assert qa["q"] == prompts.copy_request(qa["a"].split()[0]) == s.segments[1].text
    chat = next(generate("copying_chat", 1, seed=0))
    user, answer = ("".join(seg.text for seg in turn.segments) for turn in chat.turns)
    base = next(generate("copying", 1, seed=0))
    assert user == prompts.copy(base.segments[0].text, base.qa[0]["q"]) and answer == base.qa[0]["a"]
    with pytest.raises(ValueError, match="min_lines"):
        next(generate("copying", 1, seed=0, min_lines=3, max_lines=2))
