"""``make_shards`` as users run it: LLaVA speaker names, images that resolve outside ``--image-root`` (skipped unless
allowed), text token counts with the shipped tokenizer by default, and the progress bar (a terminal only, never
with ``--quiet``). Real JSON files and images under tmp_path, real shards written and read back."""

import json
import os

import pytest
import webdataset
from PIL import Image
from terminal_kit import Terminal

from data_pipelines.conversation_sources import from_messages
from data_pipelines.make_shards import main
from data_pipelines.schema import decode_sample, image_bytes
from data_pipelines.sources import SourceStats
from data_pipelines.tokenizer import DEFAULT_TOKENIZER_DIR, load_tokenizer
from data_pipelines.writer import load_manifest


def _read(split_dir):
    manifest = load_manifest(split_dir)
    return manifest, [decode_sample(r) for r in webdataset.WebDataset(manifest["paths"], shardshuffle=False)]


def _png(path, colour) -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = image_bytes(Image.new("RGB", (8, 5), colour), "png")
    path.write_bytes(data)
    return data


def _turn(speaker: str, value: str) -> dict:
    return {"from": speaker, "value": value}


def test_llava_speakers_user_assistant_model_and_system_become_roles(tmp_path, capsys):
    entries = [
        {"id": "sharegpt", "conversations": [_turn("human", "Hi"), _turn("gpt", "Hello")]},
        {
            "id": "chat",
            "conversations": [
                _turn("user", "Hi"),
                _turn("assistant", "Hey"),
                _turn("user", "Bye"),
                _turn("model", "Ciao"),
            ],
        },
        {"id": "sys", "conversations": [_turn("system", "Be terse."), _turn("user", "Q?"), _turn("assistant", "A.")]},
        {"id": "bot", "conversations": [_turn("user", "Hi"), _turn("bot", "Yo")]},  # still not a speaker we know
        {"id": "late-system", "conversations": [_turn("user", "Hi"), _turn("system", "x"), _turn("gpt", "y")]},
    ]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(entries))
    assert main(["--from-llava", str(path), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    assert "3 samples read, 2 entries skipped" in capsys.readouterr().out
    manifest, got = _read(tmp_path / "out" / "train")
    roles = {s.key: [(t.role, t.segments[0].text) for t in s.turns] for s in got}
    assert roles == {
        "sharegpt": [("user", "Hi"), ("assistant", "Hello")],
        "chat": [("user", "Hi"), ("assistant", "Hey"), ("user", "Bye"), ("assistant", "Ciao")],
        "sys": [("system", "Be terse."), ("user", "Q?"), ("assistant", "A.")],
    }
    assert manifest["source"]["skipped"] == {"unknown_role": 1, "bad_turn_order": 1}


@pytest.fixture
def escape(tmp_path):
    """An image root holding one image, a symlink out of it and one inside it; a secret image beside the root; a
    LLaVA file whose entries reach it by ``..``, an absolute path and the symlink."""
    root = tmp_path / "root"
    inside = _png(root / "coco" / "in.png", (255, 0, 0))
    secret = _png(tmp_path / "secret.png", (0, 0, 255))
    os.symlink(tmp_path / "secret.png", root / "link.png")
    os.symlink(root / "coco" / "in.png", root / "alias.png")  # a link that stays inside is fine
    images = {
        "in": "coco/in.png",
        "dotdot-inside": "coco/../coco/in.png",
        "alias": "alias.png",
        "dotdot": "../secret.png",
        "absolute": str(tmp_path / "secret.png"),
        "symlink": "link.png",
    }
    chat = [_turn("human", "<image>"), _turn("gpt", "x")]
    entries = [{"id": key, "image": image, "conversations": chat} for key, image in images.items()]
    (tmp_path / "d.json").write_text(json.dumps(entries))
    return tmp_path, inside, secret


def test_images_resolving_outside_the_image_root_are_skipped_by_kind(escape, capsys):
    tmp_path, inside, _ = escape
    cmd = ["--from-llava", str(tmp_path / "d.json"), "--image-root", str(tmp_path / "root"), "--quiet"]
    assert main([*cmd, "--out", str(tmp_path / "out")]) == 0
    assert "3 samples read, 3 entries skipped {'outside_image_root': 3}" in capsys.readouterr().out
    manifest, got = _read(tmp_path / "out" / "train")
    assert sorted(s.key for s in got) == ["alias", "dotdot-inside", "in"]
    assert all(s.turns[0].segments[0].image == inside for s in got)
    assert manifest["source"]["skipped"] == {"outside_image_root": 3}
    assert manifest["source"]["allow_outside_image_root"] is False


def test_outside_images_are_read_when_the_user_opts_in(escape, capsys):
    tmp_path, _, secret = escape
    cmd = ["--from-llava", str(tmp_path / "d.json"), "--image-root", str(tmp_path / "root"), "--quiet"]
    assert main([*cmd, "--out", str(tmp_path / "out"), "--allow-outside-image-root"]) == 0
    assert "6 samples read, 0 entries skipped" in capsys.readouterr().out
    manifest, got = _read(tmp_path / "out" / "train")
    images = {s.key: s.turns[0].segments[0].image for s in got}
    assert [images[k] for k in ("dotdot", "absolute", "symlink")] == [secret] * 3
    assert manifest["source"]["allow_outside_image_root"] is True
    with pytest.raises(SystemExit):  # the flag belongs to the conversation sources
        main(["--from-text", str(tmp_path / "d.json"), "--out", str(tmp_path / "o2"), "--allow-outside-image-root"])
    assert "--allow-outside-image-root goes with" in capsys.readouterr().err


def test_messages_image_parts_are_held_to_the_root_too(escape):
    tmp_path, _, _ = escape
    user = lambda image: {"role": "user", "content": [{"type": "image", "image": image}]}
    lines = [
        {"id": i, "messages": [user(p), {"role": "assistant", "content": "x"}]}
        for i, p in enumerate(["coco/in.png", "../secret.png", "link.png"])
    ]
    path = tmp_path / "root" / "m.jsonl"  # without an image root, the file's folder is the root
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    stats = SourceStats()
    assert [s.key for s in from_messages(path, stats=stats)] == ["0"]
    assert stats.skipped == {"outside_image_root": 2}
    stats = SourceStats()
    assert len(list(from_messages(path, stats=stats, allow_outside_image_root=True))) == 3


def test_manifest_counts_text_tokens_with_the_shipped_tokenizer_by_default(tmp_path, hf_tokenizer, capsys):
    args = ["--synthetic", "text,scenes_chat", "--num-samples", "6", "--eval-samples", "2", "--quiet"]
    assert main([*args, "--out", str(tmp_path / "out")]) == 0
    assert "text tokens" in capsys.readouterr().out
    manifest, got = _read(tmp_path / "out" / "train")
    shipped = load_tokenizer()
    texts = [seg.text for s in got for seg in s.all_segments if seg.text is not None]
    assert manifest["text_tokens"] == sum(len(shipped.encode(t, add_special_tokens=False)) for t in texts) > 0
    assert manifest["tokenizer"] == str(DEFAULT_TOKENIZER_DIR)
    other = tmp_path / "tok"
    hf_tokenizer.save_pretrained(other)  # --tokenizer still chooses another one
    assert main([*args, "--out", str(tmp_path / "out2"), "--tokenizer", str(other)]) == 0
    manifest = load_manifest(tmp_path / "out2" / "train")
    assert manifest["text_tokens"] == sum(len(hf_tokenizer.encode(t, add_special_tokens=False)) for t in texts)
    assert manifest["tokenizer"] == str(other)


@pytest.mark.parametrize("quiet", [False, True])
def test_progress_bar_on_a_terminal_unless_quiet(tmp_path, monkeypatch, capsys, quiet):
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    args = ["--synthetic", "text", "--num-samples", "5", "--eval-samples", "2", "--out", str(tmp_path / "out")]
    assert main(args + ["--quiet"] * quiet) == 0
    bars = terminal.getvalue()
    if quiet:
        assert "%|" not in bars
    else:  # one bar per split, each run to its end
        assert "train: 100%" in bars and "5/5" in bars and "eval: 100%" in bars and "2/2" in bars
    assert "%|" not in capsys.readouterr().out  # the summary lines on stdout carry no bar


def test_no_progress_bar_when_stderr_is_not_a_terminal(tmp_path, capsys):
    assert main(["--synthetic", "text", "--num-samples", "3", "--out", str(tmp_path / "out")]) == 0
    assert "%|" not in capsys.readouterr().err
