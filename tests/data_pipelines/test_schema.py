"""Conversations in the shard schema: ``encode_sample`` / ``decode_sample`` round-trip them exactly (through a real
tar too), and decoding skips a bad conversation with the right kind."""

import json

import pytest
from PIL import Image
from shard_kit import write

from data_pipelines.schema import (
    SKIP_KINDS,
    Sample,
    Segment,
    SkipSample,
    Turn,
    check_conversation,
    decode_sample,
    encode_sample,
    image_bytes,
)
from data_pipelines.tar_reader import read_tar_groups


def _img(colour, ext: str, size=(7, 5)) -> Segment:
    return Segment(image=image_bytes(Image.new("RGB", size, colour), ext), image_ext=ext)


def _conversation() -> Sample:
    turns = [
        Turn("system", [Segment(text="You are terse.")]),
        Turn("user", [_img((255, 0, 0), "png"), Segment(text="\nWhat is here, and here?"), _img((0, 0, 255), "jpg")]),
        Turn("assistant", [Segment(text="A red square; a blue one.  ")]),
        Turn("user", [Segment(text="Draw it — ünïcødé 🙂"), _img((0, 255, 0), "webp"), Segment(text="")]),
        Turn("assistant", [Segment(text="Here:"), _img((9, 9, 9), "jpeg"), Segment(text="done\n")]),
    ]
    return Sample(key="conv-1", segments=[], meta={"id": "a/b.c", "n": [1, {"x": None}], "é": "ü"}, turns=turns)


def test_conversation_round_trips_exactly():
    sample = _conversation()
    record = encode_sample(sample)
    images = [s for t in sample.turns for s in t.segments if s.image is not None]
    names = [f"img{i}.{s.image_ext}" for i, s in enumerate(images)]
    assert sorted(k for k in record if k not in ("__key__", "json")) == sorted(names)
    assert [record[n] for n in names] == [s.image for s in images]  # bytes stored as given, in order
    doc = json.loads(record["json"])
    assert doc["segments"] == []
    assert [t["role"] for t in doc["turns"]] == ["system", "user", "assistant", "user", "assistant"]
    second = [{"image": "img0.png"}, {"text": "\nWhat is here, and here?"}, {"image": "img1.jpg"}]
    assert doc["turns"][1]["segments"] == second
    back = decode_sample(record)
    assert back == sample
    assert back.is_conversation and back.num_images == 4
    assert [s.image_ext for s in back.all_segments if s.image is not None] == ["png", "jpg", "webp", "jpeg"]


def test_conversation_round_trips_through_a_tar(tmp_path):
    text_only = Sample(
        "text-only", [], turns=[Turn("user", [Segment(text="hi")]), Turn("assistant", [Segment(text="yo")])]
    )
    plain = Sample("doc", [Segment(text="a document"), _img((1, 2, 3), "png")], meta={"k": 1}, qa=[{"q": "?"}])
    samples = [_conversation(), text_only, plain]
    (path,) = write(str(tmp_path / "s-%06d.tar"), [encode_sample(s) for s in samples])
    back = [decode_sample(group) for group in read_tar_groups(path)]
    assert back == samples
    assert [s.is_conversation for s in back] == [True, True, False]


def _raw(turns, **members) -> dict:
    return {"__key__": "k", "json": json.dumps({"segments": [], "turns": turns, "meta": {}}).encode(), **members}


def _t(role, *segments) -> dict:
    return {"role": role, "segments": [{"text": s} if not s.startswith("img") else {"image": s} for s in segments]}


PNG = image_bytes(Image.new("RGB", (3, 3), (1, 2, 3)))
BAD_CONVERSATIONS = {
    "unknown_role": _raw([_t("user", "hi"), _t("bot", "hello")]),
    "unknown_role_llava_name": _raw([_t("human", "hi"), _t("assistant", "hello")]),
    "bad_turn_order": _raw([_t("user", "hi"), _t("user", "again"), _t("assistant", "ok")]),
    "bad_turn_order_ends_with_user": _raw([_t("user", "hi"), _t("assistant", "ok"), _t("user", "and?")]),
    "bad_turn_order_starts_with_assistant": _raw([_t("assistant", "ok"), _t("user", "hi")]),
    "bad_turn_order_system_late": _raw([_t("user", "hi"), _t("system", "be terse"), _t("assistant", "ok")]),
    "bad_turn_order_no_turns": _raw([]),
    "empty_answer": _raw([_t("user", "hi"), _t("assistant", " \n ")]),
    "empty_answer_no_segments": _raw([_t("system", "s"), _t("user", "hi"), _t("assistant")]),
    "missing_image": _raw([_t("user", "img0.png", "what?"), _t("assistant", "red")]),
    "missing_field": _raw([{"role": "user", "text": "hi"}, _t("assistant", "ok")]),
    "missing_field_turns_not_list": _raw({"role": "user"}),
    "missing_field_segment": _raw([{"role": "user", "segments": [{"video": "x"}]}, _t("assistant", "ok")]),
    "bad_json": {"__key__": "k", "json": b'{"turns": [{"role": "user", '},
}


@pytest.mark.parametrize("case", sorted(BAD_CONVERSATIONS))
def test_bad_conversation_skipped_with_its_kind(case):
    kind = next(k for k in SKIP_KINDS if case.startswith(k))
    with pytest.raises(SkipSample) as err:
        decode_sample(BAD_CONVERSATIONS[case])
    assert err.value.kind == kind


def test_good_conversation_edges_decode():
    # an assistant answering with an image only is an answer; an empty user turn is allowed; system is optional
    raw = _raw([_t("user"), _t("assistant", "img0.png")], **{"img0.png": PNG})
    assert decode_sample(raw).turns == [Turn("user", []), Turn("assistant", [Segment(image=PNG, image_ext="png")])]
    check_conversation([Turn("system", []), Turn("user", []), Turn("assistant", [Segment(text="x")])])


def test_sample_regions_reads_grounded_regions_or_the_scenes_objects_and_drops_bad_ones():
    from data_pipelines.schema import sample_regions

    meta = {"regions": [{"box": [0, 0.1, 0.5, 0.6], "text": "red square"}, {"box": [0, 1], "text": "x"}, {"text": "y"}]}
    assert sample_regions(meta) == [([0.0, 0.1, 0.5, 0.6], "red square")]
    objects = [
        {"box": [0.1, 0.2, 0.3, 0.4], "size": "small", "colour": "red", "shape": "square", "position": "top left"},
        {"box": None, "colour": "blue", "shape": "circle"},
    ]
    assert sample_regions({"objects": objects}) == [([0.1, 0.2, 0.3, 0.4], "small red square top left")]
    assert sample_regions({}) == []
