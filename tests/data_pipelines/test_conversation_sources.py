"""Conversation sources: LLaVA instruction data and HF / OpenAI chat messages -> conversation samples; each bad
entry skipped and counted by kind; ``make_shards --from-llava / --from-messages`` writes shards that decode back to
the same conversations."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import webdataset
from PIL import Image

from data_pipelines.conversation_sources import from_llava, from_messages
from data_pipelines.make_shards import main
from data_pipelines.schema import Segment, Turn, decode_sample, image_bytes
from data_pipelines.sources import SourceStats
from data_pipelines.writer import load_manifest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _image(path: Path, colour, ext: str) -> bytes:
    data = image_bytes(Image.new("RGB", (10, 6), colour), ext)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


def _images(root: Path) -> dict[str, bytes]:
    (root / "notes.png").parent.mkdir(parents=True, exist_ok=True)
    (root / "notes.png").write_text("not an image")
    return {
        "red": _image(root / "coco" / "red.png", (255, 0, 0), "png"),
        "blue": _image(root / "blue.jpg", (0, 0, 255), "jpg"),
    }


def _text(text: str) -> Segment:
    return Segment(text=text)


def _img(data: bytes, ext: str) -> Segment:
    return Segment(image=data, image_ext=ext)


def _read(split_dir: Path):
    manifest = load_manifest(split_dir)
    return manifest, [decode_sample(r) for r in webdataset.WebDataset(manifest["paths"], shardshuffle=False)]


# --- LLaVA ------------------------------------------------------------------------------------------------------


def _h(value):
    return {"from": "human", "value": value}


def _g(value):
    return {"from": "gpt", "value": value}


LLAVA_GOOD = [
    {"id": "000000033471", "image": "coco/red.png", "conversations": [_h("<image>\nWhat colour?"), _g("Red.")]},
    {
        "id": "multi/1",
        "image": ["coco/red.png", "blue.jpg"],
        "conversations": [
            {"from": "system", "value": "Be terse."},
            _h("Compare <image> and<image>."),
            _g("Red, blue."),
            _h("Shapes?"),
            _g("Both rectangles.\n"),
        ],
    },
    {"id": 7, "image": "blue.jpg", "conversations": [_h("Describe the picture."), _g("Blue.")]},  # no marker
    {"conversations": [_h("Hi <b>there</b>"), _g("Hello!")]},  # text only, no id: key from the index
]
LLAVA_BAD = {
    "unknown_role": {"id": "b1", "conversations": [_h("hi"), {"from": "bot", "value": "yo"}]},
    "bad_turn_order": {"id": "b2", "conversations": [_h("hi"), _h("again"), _g("ok")]},
    "image_count_mismatch": {"id": "b3", "image": "blue.jpg", "conversations": [_h("<image> <image>"), _g("x")]},
    "missing_image": {"id": "b4", "image": "coco/gone.png", "conversations": [_h("<image>"), _g("x")]},
    "bad_image": {"id": "b5", "image": "notes.png", "conversations": [_h("<image>"), _g("x")]},
    "empty_answer": {"id": "b6", "conversations": [_h("hi"), _g("  \n")]},
    "missing_field": {"id": "b7", "image": "blue.jpg"},
    "duplicate_key": {"id": "000000033471", "conversations": [_h("same id"), _g("again")]},
}


def _llava_expected(images: dict) -> dict[str, tuple[list[Turn], dict]]:
    red, blue = _img(images["red"], "png"), _img(images["blue"], "jpg")
    return {
        "000000033471": ([Turn("user", [red, _text("\nWhat colour?")]), Turn("assistant", [_text("Red.")])], {}),
        "multi_1": (
            [
                Turn("system", [_text("Be terse.")]),
                Turn("user", [_text("Compare "), red, _text(" and"), blue, _text(".")]),
                Turn("assistant", [_text("Red, blue.")]),
                Turn("user", [_text("Shapes?")]),
                Turn("assistant", [_text("Both rectangles.\n")]),
            ],
            {},
        ),
        "7": ([Turn("user", [blue, _text("Describe the picture.")]), Turn("assistant", [_text("Blue.")])], {}),
        "llava_0000003": ([Turn("user", [_text("Hi <b>there</b>")]), Turn("assistant", [_text("Hello!")])], {}),
    }


def _llava_file(tmp_path: Path, image_root: Path) -> tuple[Path, dict]:
    images = _images(image_root)
    path = tmp_path / "llava.json"
    path.write_text(json.dumps(LLAVA_GOOD + list(LLAVA_BAD.values()), indent=1))
    return path, images


def test_llava_conversations_and_each_bad_kind_counted(tmp_path):
    path, images = _llava_file(tmp_path, tmp_path)
    stats = SourceStats()
    samples = list(from_llava(path, stats=stats))
    expected = _llava_expected(images)
    assert [s.key for s in samples] == list(expected)
    for sample in samples:
        assert sample.turns == expected[sample.key][0] and sample.segments == [] and sample.is_conversation
    assert [s.meta for s in samples] == [{"id": "000000033471"}, {"id": "multi/1"}, {"id": 7}, {}]
    assert stats.read == 4
    assert stats.skipped == {kind: 1 for kind in LLAVA_BAD}


def test_llava_jsonl_image_root_and_bad_json(tmp_path):
    images = _images(tmp_path / "imgs")
    lines = [json.dumps(e) for e in LLAVA_GOOD[:2]] + ["", "{broken", json.dumps(LLAVA_GOOD[3]), "[1, 2]"]
    path = tmp_path / "llava.jsonl"
    path.write_text("\n".join(lines) + "\n")
    stats = SourceStats()
    samples = list(from_llava(path, image_root=tmp_path / "imgs", stats=stats))
    expected = _llava_expected(images)
    assert [s.key for s in samples] == ["000000033471", "multi_1", "llava_0000005"]  # line numbers, from 1
    assert samples[1].turns == expected["multi_1"][0]
    assert stats.skipped == {"bad_json": 1, "missing_field": 1}  # a line that is no object has no conversations
    # without --image-root the paths are relative to the file's folder, where the images are not
    stats = SourceStats()
    assert [s.key for s in from_llava(path, stats=stats)] == ["llava_0000005"]
    assert stats.skipped == {"bad_json": 1, "missing_field": 1, "missing_image": 2}


def test_llava_broken_json_list_is_one_bad_json(tmp_path):
    path = tmp_path / "llava.json"
    path.write_text(json.dumps(LLAVA_GOOD)[:-20])
    stats = SourceStats()
    assert list(from_llava(path, stats=stats)) == []
    assert stats.skipped == {"bad_json": 1}
    stats = SourceStats()
    assert list(from_llava(tmp_path / "nope.json", stats=stats)) == []
    assert stats.skipped == {"missing_file": 1}


# --- messages ---------------------------------------------------------------------------------------------------


def _m(role, content):
    return {"role": role, "content": content}


MESSAGES_GOOD = [
    {
        "id": "m1",
        "messages": [
            _m("system", "You are terse."),
            _m("user", [{"type": "text", "text": "What is this?\n"}, {"type": "image"}]),
            _m("assistant", "A red rectangle."),
        ],
        "images": ["coco/red.png"],
    },
    {
        "id": "m2",
        "messages": [
            _m("user", [{"type": "image", "image": "blue.jpg"}, {"type": "text", "text": "and"}, {"type": "image"}]),
            _m("assistant", [{"type": "text", "text": "Blue"}, {"type": "text", "text": ", red."}]),
            _m("user", "Thanks"),
            _m("assistant", [{"type": "text", "text": "You're welcome.", "image": None}]),
        ],
        "images": ["coco/red.png"],
    },
    {
        "messages": [  # HF datasets' unified parts: unused fields are null
            _m("user", [{"type": "image", "text": None, "image": None}, {"type": "text", "text": "Hi", "image": None}]),
            _m("assistant", "Hello"),
        ],
        "images": ["blue.jpg"],
    },
]
MESSAGES_BAD = {
    "unknown_role": {"id": "x1", "messages": [_m("user", "hi"), _m("tool", "{}"), _m("assistant", "ok")]},
    "bad_turn_order": {"id": "x2", "messages": [_m("assistant", "ok"), _m("user", "hi")]},
    "image_count_mismatch": {"id": "x3", "messages": [_m("user", [{"type": "image"}]), _m("assistant", "?")]},
    "missing_image": {
        "id": "x4",
        "messages": [_m("user", [{"type": "image", "image": "gone.png"}]), _m("assistant", "?")],
    },
    "bad_image": {
        "id": "x5",
        "messages": [_m("user", [{"type": "image"}]), _m("assistant", "?")],
        "images": ["notes.png"],
    },
    "empty_answer": {"id": "x6", "messages": [_m("user", "hi"), _m("assistant", "")]},
    "missing_field": {"id": "x7", "images": []},
    "duplicate_key": {"id": "m1", "messages": [_m("user", "hi"), _m("assistant", "again")]},
}


def _messages_file(tmp_path: Path) -> tuple[Path, dict]:
    images = _images(tmp_path)
    lines = [json.dumps(e) for e in MESSAGES_GOOD] + ["{not json"] + [json.dumps(e) for e in MESSAGES_BAD.values()]
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, images


def test_messages_conversations_and_each_bad_kind_counted(tmp_path):
    path, images = _messages_file(tmp_path)
    red, blue = _img(images["red"], "png"), _img(images["blue"], "jpg")
    stats = SourceStats()
    samples = list(from_messages(path, stats=stats))
    assert [s.key for s in samples] == ["m1", "m2", "chats_0000003"]
    assert samples[0].turns == [
        Turn("system", [_text("You are terse.")]),
        Turn("user", [_text("What is this?\n"), red]),
        Turn("assistant", [_text("A red rectangle.")]),
    ]
    assert samples[1].turns == [
        Turn("user", [blue, _text("and"), red]),
        Turn("assistant", [_text("Blue"), _text(", red.")]),
        Turn("user", [_text("Thanks")]),
        Turn("assistant", [_text("You're welcome.")]),
    ]
    assert samples[2].turns == [Turn("user", [blue, _text("Hi")]), Turn("assistant", [_text("Hello")])]
    assert [s.meta for s in samples] == [{"id": "m1"}, {"id": "m2"}, {}]
    assert stats.read == 3
    assert stats.skipped == {"bad_json": 1, **{kind: 1 for kind in MESSAGES_BAD}}


@pytest.mark.parametrize(
    "entry",
    [
        {"messages": "hi"},
        {"messages": []},
        {"messages": [{"content": "no role"}, _m("assistant", "x")]},
        {"messages": [_m("user", 3), _m("assistant", "x")]},
        {"messages": [_m("user", [{"type": "video"}]), _m("assistant", "x")]},
        {"messages": [_m("user", "hi"), _m("assistant", "x")], "images": [{"path": "a.png"}]},
    ],
)
def test_messages_malformed_entry_is_missing_field(tmp_path, entry):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(entry) + "\n")
    stats = SourceStats()
    assert list(from_messages(path, stats=stats)) == []
    assert stats.skipped == {"missing_field": 1}


# --- make_shards --------------------------------------------------------------------------------------------------


def test_cli_from_llava_end_to_end(tmp_path):
    path, images = _llava_file(tmp_path, tmp_path / "images")
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "scripts/make_shards.py",
        "--from-llava",
        str(path),
        "--image-root",
        str(tmp_path / "images"),
    ]
    cmd += ["--out", str(out), "--max-count", "3"]
    result = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "4 samples read, 8 entries skipped" in result.stdout
    assert "skipped (unknown_role)" in result.stderr and "skipped (image_count_mismatch)" in result.stderr
    manifest, got = _read(out / "train")
    expected = _llava_expected(images)
    assert [s.key for s in got] == list(expected)
    assert [s.turns for s in got] == [turns for turns, _ in expected.values()]
    assert [s.meta for s in got] == [{"id": "000000033471"}, {"id": "multi/1"}, {"id": 7}, {}]
    assert manifest["samples"] == 4 and manifest["images"] == 4 and manifest["shard_samples"] == [3, 1]
    assert manifest["text_chars"] == sum(len(s.text) for g in got for s in g.all_segments if s.text is not None)
    source = manifest["source"]
    assert source["type"] == "llava" and source["image_root"] == str(tmp_path / "images")
    assert source["read"] == 4 and source["skipped"] == {kind: 1 for kind in LLAVA_BAD}


def test_cli_from_messages_in_process(tmp_path, capsys):
    path, _ = _messages_file(tmp_path)
    out = tmp_path / "out"
    assert main(["--from-messages", str(path), "--out", str(out)]) == 0
    assert "3 samples read, 9 entries skipped" in capsys.readouterr().out
    manifest, got = _read(out / "train")
    assert got == list(from_messages(path))
    assert manifest["source"]["type"] == "messages" and manifest["source"]["image_root"] is None
    assert manifest["source"]["skipped"] == {"bad_json": 1, **{kind: 1 for kind in MESSAGES_BAD}}
    with pytest.raises(SystemExit):
        main(["--from-jsonl", str(path), "--image-root", str(tmp_path), "--out", str(out)])
    assert "--image-root goes with" in capsys.readouterr().err
