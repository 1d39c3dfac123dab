"""The instruction kinds (``scenes_chat``, ``documents_chat``, ``needles_chat``, ``copying_chat``): conversations on
the base samples, asked with the shared prompt builders, deterministic, unique keys, and writable through
``make_shards``."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from data_pipelines import prompts
from data_pipelines.chat import render, turn_text
from data_pipelines.schema import check_conversation, decode_sample, encode_sample
from data_pipelines.synthetic import conversations, generate

REPO = Path(__file__).resolve().parents[2]
CHAT_KINDS = sorted(conversations.KINDS)
BASE = {"scenes_chat": "scenes", "documents_chat": "documents", "needles_chat": "needles", "copying_chat": "copying"}


def _images(segments):
    return [seg.image for seg in segments if seg.image is not None]


@pytest.mark.parametrize("kind", CHAT_KINDS)
def test_conversations_ask_the_base_samples_with_the_shared_builders(kind):
    n_base = 3
    bases = list(generate(BASE[kind], n_base, 7, "train"))
    expected = [c for i, b in enumerate(bases) for c in conversations.conversations(kind, b, 7, "train", i)]
    samples = list(generate(kind, len(expected), 7, "train"))
    assert [encode_sample(s) for s in samples] == [encode_sample(s) for s in expected]
    assert len({s.key for s in samples}) == len(samples)
    for sample in samples:
        base = bases[sample.meta["index"]]
        assert sample.is_conversation and not sample.segments and sample.meta["kind"] == kind
        assert sample.meta["source"] == base.key and "." not in sample.key
        check_conversation(sample.turns, sample.key)
        user, assistant = sample.turns
        assert [user.role, assistant.role] == ["user", "assistant"]
        assert _images(user.segments) == _images(base.segments)  # the base sample's images, in order
        (qa,) = sample.qa
        assert turn_text(assistant) == qa["a"]
        text, task = turn_text(user), sample.meta["task"]
        if task == "sceneqa":
            assert text == prompts.sceneqa(qa["q"]) and qa in base.qa and qa["type"] in prompts.SCENEQA_TYPES
        elif task == "refloc":
            target = next(o for o in base.meta["objects"] if o["box"] == qa["box"])
            assert text == prompts.refloc(sample.meta["expression"]) and qa["a"] == prompts.format_box(target["box"])
            assert sample.meta["expression"].split()[0] in (target["colour"], target["shape"], target["size"])
        elif task == "longdoc":
            assert text == prompts.longdoc(base.meta["num_pages"], qa["q"]) and qa == base.qa[0]
        elif task == "copy":
            assert text == prompts.copy(base.segments[0].text, qa["q"]) and qa == base.qa[0]
        else:
            context = [seg.text if seg.image is None else None for seg in base.segments[:-1]]
            assert task == "niah" and text == prompts.niah(context, qa["q"]) and qa == base.qa[0]
        rendered = render(sample.turns)
        assert rendered == f"<|user|>{text}<|end|><|assistant|>{qa['a']}<|end|>"
        again = decode_sample(encode_sample(sample))
        assert render(again.turns) == rendered and _images(again.all_segments) == _images(user.segments)


def test_scenes_chat_covers_every_qa_item_of_a_scene():
    base = next(generate("scenes", 1, 3, "eval"))
    samples = conversations.conversations("scenes_chat", base, 3, "eval", 0)
    assert [s.qa[0]["type"] for s in samples] == [qa["type"] for qa in base.qa]
    assert {s.meta["task"] for s in samples} == {"sceneqa", "refloc"}
    assert all(s.key.startswith("scenes_chat-eval-s3-0000000-") for s in samples)
    for sample in samples:  # the image's objects as grounded phrases, the field region labels read
        regions = sample.meta["regions"]
        assert [r["box"] for r in regions] == [o["box"] for o in base.meta["objects"]]
        for region, obj in zip(regions, base.meta["objects"], strict=True):
            assert region["text"].split() == " ".join(obj[k] for k in ("size", "colour", "shape", "position")).split()


@pytest.mark.parametrize("kind", CHAT_KINDS)
def test_prefix_property_and_splits(kind):
    n = {"scenes_chat": 13, "documents_chat": 3, "needles_chat": 3, "copying_chat": 5}[kind]
    long = [encode_sample(s) for s in generate(kind, n, 1, "train")]
    assert [encode_sample(s) for s in generate(kind, n - 2, 1, "train")] == long[: n - 2]
    evaluation = list(generate(kind, n, 1, "eval"))
    assert len(long) == len(evaluation) == n
    train_images = {img for m in long for k, img in m.items() if k.startswith("img")}
    assert train_images.isdisjoint(img for s in evaluation for img in _images(s.all_segments))


def test_make_shards_writes_the_chat_kinds(tmp_path):
    out = tmp_path / "shards"
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "make_shards.py"),
        "--synthetic",
        ",".join(CHAT_KINDS),
        "--out",
        str(out),
        "--num-samples",
        "2",
        "--eval-samples",
        "1",
        "--seed",
        "0",
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for split, n in (("train", 2), ("eval", 1)):
        manifest = json.loads((out / split / "manifest.json").read_text())
        assert manifest["samples"] == len(CHAT_KINDS) * n and manifest["kind_samples"] == dict.fromkeys(CHAT_KINDS, n)
        members: dict[str, dict] = {}
        for shard in manifest["shards"]:
            with tarfile.open(out / split / shard) as tar:
                for member in tar.getmembers():
                    key, ext = member.name.split(".", 1)
                    members.setdefault(key, {"__key__": key})[ext] = tar.extractfile(member).read()
        samples = [decode_sample(raw) for raw in members.values()]
        assert sorted(s.meta["kind"] for s in samples) == sorted(CHAT_KINDS * n)
        assert all(s.is_conversation and f"-{split}-" in s.key for s in samples)


def test_turns_all_asks_every_question_of_a_scene_in_one_conversation():
    """``turns="all"``: one conversation per scene, its questions those of the one-per-item conversations (same
    answers), the image in the first user turn only, every answer a loss target; seeded and deterministic."""
    from data_pipelines.packing import TokenEncoder, encode_sample_tokens
    from data_pipelines.tokenizer import load_tokenizer
    from vision_tower import ImageProcessor

    singles = list(generate("scenes_chat", 40, 0, "train", max_objects=1))
    multi = list(generate("scenes_chat", 6, 0, "train", max_objects=1, turns="all"))
    assert [m.key for m in multi] == [m.key for m in generate("scenes_chat", 6, 0, "train", max_objects=1, turns="all")]
    enc = TokenEncoder(load_tokenizer())
    for sample in multi:
        check_conversation(sample.turns, sample.key)  # raises SkipSample if the turns were out of order
        assert sample.key.endswith("-all") and sample.meta["type"] == "multi"
        mine = [s for s in singles if s.meta["source"] == sample.meta["source"]]
        assert sorted(q["a"] for q in sample.qa) == sorted(s.qa[0]["a"] for s in mine) and len(mine) > 1
        users = [t for t in sample.turns if t.role == "user"]
        assert len(users) == len(mine) and len(sample.turns) == 2 * len(mine)
        assert [sum(seg.image is not None for seg in t.segments) for t in users] == [1] + [0] * (len(users) - 1)
        for user, answer, qa in zip(users[1:], sample.turns[3::2], sample.qa[1:]):
            assert turn_text(user).startswith(qa["q"]) and turn_text(answer) == qa["a"]
        doc = encode_sample_tokens(sample, enc, ImageProcessor(max_patches=64), 4)
        labelled = enc.tokenizer.decode([i for i, t in zip(doc.input_ids, doc.targets) if t])
        assert all(qa["a"] in labelled for qa in sample.qa)  # every turn's answer carries the loss
    orders = {tuple(s.meta["types"]) for s in generate("scenes_chat", 30, 0, "train", max_objects=1, turns="all")}
    assert len(orders) > 1  # the order of the questions is drawn per scene
    with pytest.raises(ValueError, match="turns must be one of"):
        next(generate("scenes_chat", 1, 0, "train", turns="some"))
