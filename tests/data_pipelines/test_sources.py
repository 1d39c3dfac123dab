import json
import subprocess
import sys
from pathlib import Path

import pytest
import webdataset
from PIL import Image

from data_pipelines.make_shards import main, make_from_source, make_synthetic
from data_pipelines.schema import decode_sample, image_bytes
from data_pipelines.sources import SourceStats, from_dir, from_jsonl, from_text
from data_pipelines.writer import load_manifest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _image(path: Path, colour, ext: str, size=(12, 9)) -> bytes:
    data = image_bytes(Image.new("RGB", size, colour), ext)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


def _read(split_dir: Path):
    manifest = load_manifest(split_dir)
    return manifest, [decode_sample(r) for r in webdataset.WebDataset(manifest["paths"], shardshuffle=False)]


def _jsonl_corpus(tmp_path: Path) -> tuple[Path, dict]:
    red = _image(tmp_path / "imgs" / "red.png", (255, 0, 0), "png")
    blue = _image(tmp_path / "imgs" / "blue.jpg", (0, 0, 255), "jpg")
    (tmp_path / "imgs" / "empty.png").write_bytes(b"")
    (tmp_path / "imgs" / "notes.png").write_text("not an image")
    lines = [
        {"segments": [{"text": "A red square:"}, {"image": "imgs/red.png"}, {"text": "done."}], "meta": {"a": 1}},
        {"key": "my.doc/1", "segments": [{"image": "imgs/blue.jpg"}, {"text": "blue"}], "qa": [{"q": "?", "a": "!"}]},
        "{not json",
        {"segments": [{"image": "imgs/missing.png"}]},
        {"segments": [{"image": "imgs/empty.png"}]},
        {"segments": [{"image": "imgs/notes.png"}]},
        {"segments": [{"video": "x.mp4"}]},
        {"meta": {}},
        "",
        {"key": "my.doc/1", "segments": [{"text": "same key again"}]},
    ]
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path, {"red": red, "blue": blue}


def test_jsonl_documents_and_bad_entries_counted(tmp_path):
    path, images = _jsonl_corpus(tmp_path)
    stats = SourceStats()
    samples = list(from_jsonl(path, stats))
    assert [s.key for s in samples] == ["docs_0000001", "my_doc_1"]
    first, second = samples
    assert [seg.text for seg in first.segments] == ["A red square:", None, "done."]
    assert first.segments[1].image == images["red"] and first.segments[1].image_ext == "png"
    assert first.meta == {"a": 1} and second.qa == [{"q": "?", "a": "!"}]
    assert second.segments[0].image == images["blue"] and second.segments[0].image_ext == "jpg"
    assert stats.read == 2
    assert stats.skipped == {"bad_json": 1, "missing_image": 1, "bad_image": 2, "missing_field": 2, "duplicate_key": 1}


def test_jsonl_written_and_read_back_byte_exact(tmp_path):
    path, _ = _jsonl_corpus(tmp_path)
    stats = SourceStats()
    manifests = make_from_source(from_jsonl(path, stats), stats, {"type": "jsonl"}, tmp_path / "out")
    assert set(manifests) == {"train"} and not (tmp_path / "out" / "eval").exists()
    manifest, got = _read(tmp_path / "out" / "train")
    assert got == list(from_jsonl(path))
    assert manifest["samples"] == 2 and manifest["images"] == 2
    assert manifest["source"]["read"] == 2 and manifest["source"]["skipped"]["bad_image"] == 2


def _img2dataset_folder(root: Path) -> dict:
    shard = root / "00000"
    files = {
        "000000000": _image(shard / "000000000.jpg", (10, 200, 30), "jpg"),
        "000000001": _image(shard / "000000001.png", (200, 10, 30), "png"),
        "000000002": _image(shard / "000000002.webp", (20, 20, 230), "webp"),
        "000010000": _image(root / "00001" / "000010000.jpg", (0, 0, 0), "jpg"),
    }
    for key in ("000000000", "000000001", "000000002"):
        (shard / f"{key}.txt").write_text(f"caption of {key}\n")
    (root / "00001" / "000010000.txt").write_text("last caption")
    for key in ("000000000", "000000002"):
        (shard / f"{key}.json").write_text(json.dumps({"key": key, "url": f"http://x/{key}", "status": "success"}))
    _image(shard / "000000003.jpg", (1, 2, 3), "jpg")  # no caption
    (shard / "000000004.txt").write_text("caption without image")
    (shard / "000000005.jpg").write_bytes(b"")  # zero-byte image
    (shard / "000000005.txt").write_text("broken")
    _image(shard / "000000006.jpg", (1, 2, 3), "jpg")
    (shard / "000000006.txt").write_text("bad json")
    (shard / "000000006.json").write_text("{oops")
    (root / "00000.parquet").write_bytes(b"PAR1")
    (root / "00000_stats.json").write_text("{}")
    return files


def test_img2dataset_folder_read_as_is(tmp_path):
    images = _img2dataset_folder(tmp_path)
    stats = SourceStats()
    samples = {s.key: s for s in from_dir(tmp_path, stats)}
    assert sorted(samples) == ["00000_000000000", "00000_000000001", "00000_000000002", "00001_000010000"]
    for key, sample in samples.items():
        image, caption = sample.segments
        assert image.image == images[key.split("_")[1]]
        assert caption.text == ("last caption" if key.startswith("00001") else f"caption of {key[6:]}\n")
    assert samples["00000_000000002"].segments[0].image_ext == "webp"
    assert samples["00000_000000000"].meta["url"] == "http://x/000000000"
    assert samples["00000_000000001"].meta == {}
    assert stats.skipped == {"missing_caption": 1, "missing_image": 1, "bad_image": 1, "bad_json": 1}


def test_dir_of_jsonl_documents(tmp_path):
    path, _ = _jsonl_corpus(tmp_path)
    (tmp_path / "more.jsonl").write_text(json.dumps({"segments": [{"text": "second file"}]}) + "\n")
    keys = [s.key for s in from_dir(tmp_path)]
    assert keys == ["docs_0000001", "my_doc_1", "more_0000001"]


def test_text_files_by_file_and_by_paragraph(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "notes.txt").write_text("First para.\n\n\n  Second para\nline two.\n\n")
    (tmp_path / "b" / "notes.txt").write_text("Other folder.")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "blank.txt").write_text(" \n\n ")
    files = [tmp_path / "a" / "notes.txt", tmp_path / "b" / "notes.txt", tmp_path / "latin1.txt"]
    files += [tmp_path / "blank.txt", tmp_path / "missing.txt"]
    stats = SourceStats()
    whole = list(from_text(files, stats))
    assert [s.segments[0].text for s in whole] == ["First para.\n\n\n  Second para\nline two.\n\n", "Other folder."]
    assert [s.key for s in whole] == ["000000_notes", "000001_notes"]
    assert stats.skipped == {"bad_text": 1, "empty": 1, "missing_file": 1}
    paragraphs = [s.segments[0].text for s in from_text(files, unit="paragraph")]
    assert paragraphs == ["First para.", "Second para\nline two.", "Other folder."]


def test_cli_synthetic_end_to_end(tmp_path):
    out = tmp_path / "syn"
    cmd = [sys.executable, "scripts/make_shards.py", "--synthetic", "scenes,documents,needles,text", "--out", str(out)]
    cmd += ["--num-samples", "3", "--eval-samples", "2", "--seed", "7", "--max-count", "5"]
    result = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["train", "eval"]
    for split, n in (("train", 12), ("eval", 8)):
        manifest, got = _read(out / split)
        assert manifest["samples"] == len(got) == n and manifest["seed"] == 7
        assert manifest["kind_samples"] == {k: n // 4 for k in ("scenes", "documents", "needles", "text")}
        assert manifest["images"] == sum(s.num_images for s in got)
        assert len(manifest["shards"]) == (n + 4) // 5
    # The same shards in-process: generation does not depend on the process (hash seed, imports).
    make_synthetic(["scenes", "documents", "needles", "text"], tmp_path / "again", 3, 7, 2, max_count=5)
    for path in sorted(out.rglob("*.tar")):
        assert path.read_bytes() == (tmp_path / "again" / path.relative_to(out)).read_bytes()


def test_cli_generator_options_reach_the_samples_and_the_manifest(tmp_path, capsys):
    out = tmp_path / "easy"
    argv = ["--synthetic", "scenes", "--out", str(out), "--num-samples", "6"]
    assert main(argv + ["--option", "max_objects=1", "--option", "object_size=0.6,0.9"]) == 0
    manifest, got = _read(out / "train")
    assert manifest["options"] == {"max_objects": 1, "object_size": [0.6, 0.9]}
    assert all(len(s.meta["objects"]) == 1 and s.meta["objects"][0]["size"] == "large" for s in got)
    capsys.readouterr()
    for bad, says in (
        (["--option", "object_size=2"], "object_size must be"),
        (["--option", "nope"], "KEY=VALUE"),
        (["--option", "min_units=3"], "min_units taken by none of"),
    ):
        with pytest.raises(SystemExit) as refused:
            main(argv + bad)
        assert refused.value.code == 2 and says in capsys.readouterr().err.splitlines()[-1], bad
    assert manifest == _read(out / "train")[0]  # the refused runs left the earlier OUT as it was


def test_cli_from_jsonl_with_eval_split_and_tokenizer(tmp_path, hf_tokenizer):
    path, _ = _jsonl_corpus(tmp_path)
    lines = [
        json.dumps({"key": f"doc{i}", "segments": [{"text": f"What colour is the square {i}?"}]}) for i in range(40)
    ]
    path.write_text(path.read_text() + "\n".join(lines) + "\n")
    hf_tokenizer.save_pretrained(tmp_path / "tok")
    cmd = [sys.executable, "scripts/make_shards.py", "--from-jsonl", str(path), "--out", str(tmp_path / "out")]
    cmd += ["--eval-fraction", "0.3", "--tokenizer", str(tmp_path / "tok")]
    result = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "7 entries skipped" in result.stdout and "skipped (bad_json)" in result.stderr
    (train_manifest, train), (eval_manifest, evaluation) = (
        _read(tmp_path / "out" / "train"),
        _read(tmp_path / "out" / "eval"),
    )
    assert len(train) + len(evaluation) == 42 and len(evaluation) > 3 and len(train) > 3
    assert {s.key for s in train}.isdisjoint(s.key for s in evaluation)
    for manifest, samples in ((train_manifest, train), (eval_manifest, evaluation)):
        texts = [seg.text for s in samples for seg in s.segments if seg.text is not None]
        assert manifest["text_tokens"] == sum(len(hf_tokenizer.encode(t, add_special_tokens=False)) for t in texts)


def test_cli_from_dir_and_from_text_in_process(tmp_path, capsys):
    _img2dataset_folder(tmp_path / "pairs")
    (tmp_path / "t.txt").write_text("one\n\ntwo\n")
    out = str(tmp_path / "o")
    assert main(["--from-dir", str(tmp_path / "pairs"), "--out", out, "--max-count", "3"]) == 0
    assert load_manifest(tmp_path / "o" / "train")["shard_samples"] == [3, 1]
    assert "4 samples read, 4 entries skipped" in capsys.readouterr().out
    assert main(["--from-text", str(tmp_path / "t.txt"), "--text-unit", "paragraph", "--out", out]) == 0
    manifest, got = _read(tmp_path / "o" / "train")
    assert [s.segments[0].text for s in got] == ["one", "two"] and manifest["source"]["unit"] == "paragraph"
    # Nothing to write over an existing dataset: refused (exit 2), the dataset kept; into a new folder: exit 1.
    assert main(["--from-text", str(tmp_path / "nope.txt"), "--out", out]) == 2
    assert "nothing written" in capsys.readouterr().err and _read(tmp_path / "o" / "train")[0] == manifest
    assert main(["--from-text", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "new")]) == 1
    assert "nothing written" in capsys.readouterr().err
