"""Faults found in writing and reading shards, one test (or two) per finding, each failing before its fix:

1. ``make_shards`` destroyed ``--out`` before reading any input (a missing input left an empty dataset; a stale
   eval split survived a run without one);
2. keys differing only in characters that ``safe_key`` replaces collapsed into one (the others "duplicates");
3. a key whose members are not adjacent in a tar counted two skips;
4. a huge (decompressed) tar member was read whole;
5. ``make_shards`` wrote images the loader refuses (over the pixel limit, cut data).
"""

import io
import json
import random
import subprocess
import sys
import tarfile
import tracemalloc
from pathlib import Path

import pytest
import webdataset
from PIL import Image
from shard_kit import good_sample, keys_in, with_image_token

from data_pipelines import make_dataloader
from data_pipelines.make_shards import main, make_from_source
from data_pipelines.schema import Sample, Segment, SkipSample, decode_sample, encode_sample, image_bytes, open_image
from data_pipelines.sources import SourceStats, from_jsonl
from data_pipelines.tar_reader import SKIP, read_tar_groups, skip_marked
from data_pipelines.writer import load_manifest, write_shards

REPO_ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20


def _docs(path: Path, n: int, start: int = 0) -> Path:
    path.write_text(
        "".join(
            json.dumps({"key": f"d{i}", "segments": [{"text": f"doc {i}"}]}) + "\n" for i in range(start, start + n)
        )
    )
    return path


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _read(split_dir: Path) -> list[Sample]:
    paths = load_manifest(split_dir)["paths"]
    return [decode_sample(r) for r in webdataset.WebDataset(paths, shardshuffle=False)]


def _beside(out: Path) -> list[str]:
    """What a run left next to ``out``: hidden stage / old folders must not stay."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith("."))


@pytest.fixture
def dataset(tmp_path) -> Path:
    """An existing dataset with train and eval splits (``--eval-fraction 0.3``)."""
    out = tmp_path / "out"
    assert (
        main(["--from-jsonl", str(_docs(tmp_path / "docs.jsonl", 40)), "--out", str(out), "--eval-fraction", "0.3"])
        == 0
    )
    assert sorted(p.name for p in out.iterdir()) == ["eval", "train"]
    return out


# --- 1. make_shards never destroys --out before it has something better ---------------------------------------


def test_missing_input_keeps_the_dataset_and_exits_2_with_one_line(dataset, tmp_path):
    before = _snapshot(dataset)
    cmd = [
        sys.executable,
        "scripts/make_shards.py",
        "--from-jsonl",
        str(tmp_path / "typo.jsonl"),
        "--out",
        str(dataset),
    ]
    result = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("make_shards: error:")]
    assert len(errors) == 1 and "nothing written" in errors[0] and str(dataset) in errors[0]
    assert _snapshot(dataset) == before and _beside(dataset) == []


def test_exception_mid_write_keeps_the_dataset(dataset):
    before = _snapshot(dataset)

    def failing():
        rng = random.Random(0)
        for i in range(5):
            yield good_sample(i, rng)
        raise RuntimeError("disk gone")

    with pytest.raises(RuntimeError, match="disk gone"):
        make_from_source(failing(), SourceStats(), {"type": "test"}, dataset, eval_fraction=0.5, max_count=2)
    assert _snapshot(dataset) == before and _beside(dataset) == []


def test_a_run_without_eval_leaves_no_stale_eval_split(dataset, tmp_path):
    assert main(["--from-jsonl", str(_docs(tmp_path / "new.jsonl", 5, start=100)), "--out", str(dataset)]) == 0
    assert sorted(p.name for p in dataset.iterdir()) == ["train"]
    assert load_manifest(dataset / "train")["samples"] == 5 and _beside(dataset) == []


def test_out_holding_other_files_is_refused_untouched(tmp_path, capsys):
    out = tmp_path / "mixed"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["--from-jsonl", str(_docs(tmp_path / "docs.jsonl", 3)), "--out", str(out)]) == 2
    assert "notes.txt" in capsys.readouterr().err
    assert _snapshot(out) == {"notes.txt": b"mine"} and _beside(out) == []


# --- 2. distinct source keys stay distinct ---------------------------------------------------------------------


def test_keys_differing_only_in_replaced_characters_stay_apart(tmp_path):
    keys = ["a b", "a.b", "a/b", "a_b"]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"key": k, "segments": [{"text": f"text of {k}"}]}) + "\n" for k in keys))
    stats = SourceStats()
    manifests = make_from_source(from_jsonl(path, stats), stats, {"type": "jsonl"}, tmp_path / "out")
    assert manifests["train"]["samples"] == 4 and stats.read == 4 and not stats.skipped
    back = _read(tmp_path / "out" / "train")
    assert sorted(s.segments[0].text for s in back) == sorted(f"text of {k}" for k in keys)
    assert len({s.key for s in back}) == 4 and all(s.key.startswith("a_b") for s in back)
    again = SourceStats()
    assert [s.key for s in from_jsonl(path, again)] == [s.key for s in from_jsonl(path)]  # stable across runs
    path.write_text(path.read_text() * 2)
    assert len(list(from_jsonl(path, again := SourceStats()))) == 4 and again.skipped == {"duplicate_key": 4}


# --- 3 and 4: the tar reader -----------------------------------------------------------------------------------


def _add(tar: tarfile.TarFile, name: str, data: bytes | None = None, size: int | None = None) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data) if data is not None else size
    tar.addfile(info, io.BytesIO(data) if data is not None else _Zeros(size))


class _Zeros(io.RawIOBase):
    """``size`` zero bytes, streamed: a compressible member that never exists whole in the test either."""

    def __init__(self, size: int):
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self.left)
        buffer[:n] = bytes(n)
        self.left -= n
        return n


def _members(sample: Sample) -> list[tuple[str, bytes]]:
    record = encode_sample(sample)
    return [(f"{record['__key__']}.{ext}", data) for ext, data in record.items() if ext != "__key__"]


def _loader_stats(path: str, hf_tokenizer, **options) -> tuple[dict, list[str]]:
    tok = with_image_token(hf_tokenizer)
    loader = make_dataloader(path, tok, seq_len=256, batch_size=2, epochs=1, shuffle=False, **options)
    keys = [k for batch in loader for k in keys_in(batch, tok)]
    return loader.stats(), keys


def test_non_adjacent_key_is_one_skipped_sample(tmp_path, hf_tokenizer):
    rng = random.Random(0)
    split, other, last = (_members(good_sample(i, rng, images=1)) for i in range(3))
    path = tmp_path / "scattered-000.tar"
    with tarfile.open(path, "w") as tar:
        for name, data in [split[0], *other, *split[1:], *last]:  # k00000's image after k00001's members
            _add(tar, name, data)
    groups = list(read_tar_groups(str(path)))
    assert [g["__key__"] for g in groups] == ["k00000", "k00001", "k00002"]
    assert groups[0][SKIP][0] == "non_adjacent_key" and set(groups[0]) == {"__key__", "__url__", SKIP}
    stats, keys = _loader_stats(str(path), hf_tokenizer)
    assert sorted(keys) == ["k00001", "k00002"] and stats["samples"] == 2
    assert {k: n for k, n in stats["skipped"].items() if n} == {"non_adjacent_key": 1}


def test_member_over_the_cap_is_skipped_without_reading_it(tmp_path, hf_tokenizer):
    rng = random.Random(0)
    path = tmp_path / "bomb-000.tar.gz"
    with tarfile.open(path, "w:gz", compresslevel=1) as tar:
        for name, data in _members(good_sample(0, rng, images=0)):
            _add(tar, name, data)
        _add(tar, "bomb.json", json.dumps({"segments": [{"text": "doc bomb: "}]}).encode())
        _add(tar, "bomb.txt", size=50 * MiB)  # inflates to 50 MiB from a few tens of KiB
        for name, data in _members(good_sample(1, rng, images=0)):
            _add(tar, name, data)
    assert path.stat().st_size < MiB
    tracemalloc.start()
    try:
        groups = list(read_tar_groups(str(path), max_member_bytes=MiB))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # tarfile's stream inflates 10 KiB of gzip at a time (at most ~10 MiB of zeros); never the 50 MiB member
    assert peak < 16 * MiB, f"reading peaked at {peak / MiB:.1f} MiB"
    assert [g["__key__"] for g in groups] == ["k00000", "bomb", "k00001"]
    assert groups[1][SKIP][0] == "member_too_large" and "txt" not in groups[1] and "json" not in groups[1]
    with pytest.raises(SkipSample, match="member_too_large"):
        skip_marked(groups[1])
    stats, keys = _loader_stats(str(path), hf_tokenizer, max_member_bytes=MiB)
    assert sorted(keys) == ["k00000", "k00001"]
    assert {k: n for k, n in stats["skipped"].items() if n} == {"member_too_large": 1}
    with pytest.raises(ValueError, match="max_member_bytes"):
        make_dataloader(str(path), hf_tokenizer, max_member_bytes=0)


# --- 5. the writer refuses what the loader refuses -------------------------------------------------------------


def _cut_png() -> bytes:
    rng = random.Random(0)
    img = Image.frombytes("RGB", (64, 64), bytes(rng.randrange(256) for _ in range(64 * 64 * 3)))
    data = image_bytes(img, "png")
    return data[: len(data) * 2 // 3]  # the header parses, the pixel data ends early


def _huge_png() -> bytes:
    buffer = io.BytesIO()
    Image.new("1", (10_000, 10_000)).save(buffer, "PNG")  # 100 megapixels in ~12 KB
    return buffer.getvalue()


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_writer_skips_the_images_the_loader_refuses(tmp_path):
    cut, huge = _cut_png(), _huge_png()
    for data, kind in ((cut, "bad_image"), (huge, "image_too_large")):
        with pytest.raises(SkipSample, match=kind):
            open_image(data)  # what the loader does with them
    good = good_sample(0, random.Random(0))
    samples = [good, Sample("cut", [Segment(image=cut)]), Sample("huge", [Segment(text="x"), Segment(image=huge)])]
    manifest = write_shards(samples, tmp_path)
    assert manifest["samples"] == 1 and manifest["skipped"] == {"bad_image": 1, "image_too_large": 1}
    assert [s.key for s in _read(tmp_path / "train")] == [good.key]


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_make_shards_skips_and_counts_them(tmp_path, capsys):
    (tmp_path / "cut.png").write_bytes(_cut_png())
    (tmp_path / "huge.png").write_bytes(_huge_png())
    (tmp_path / "ok.png").write_bytes(image_bytes(Image.new("RGB", (8, 8), (1, 2, 3))))
    path = tmp_path / "docs.jsonl"
    path.write_text(
        "".join(json.dumps({"segments": [{"image": f"{name}.png"}]}) + "\n" for name in ("cut", "huge", "ok"))
    )
    assert main(["--from-jsonl", str(path), "--out", str(tmp_path / "out")]) == 0
    assert "train: 1 samples (2 skipped {'bad_image': 1, 'image_too_large': 1})" in capsys.readouterr().out
    assert load_manifest(tmp_path / "out" / "train")["skipped"] == {"bad_image": 1, "image_too_large": 1}
    assert main(["--from-jsonl", str(path), "--out", str(tmp_path / "small"), "--max-image-pixels", "32"]) == 1
