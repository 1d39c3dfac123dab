import io
import json
import random

import pytest
import webdataset
from braceexpand import braceexpand
from PIL import Image

from data_pipelines.local_text import ByteTokenizer
from data_pipelines.schema import Sample, Segment, decode_sample, image_bytes
from data_pipelines.writer import SplitWriter, load_manifest, write_shards


def _noise_image(rng: random.Random, ext: str) -> bytes:
    w, h = rng.randint(8, 40), rng.randint(8, 40)
    img = Image.frombytes("RGB", (w, h), bytes(rng.randrange(256) for _ in range(w * h * 3)))
    return image_bytes(img, ext)


def make_samples(n: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        segments = [Segment(text=f'doc {i}: Grüße, 世界 🙂\n\ttabs and "quotes" {rng.random()}')]
        for _ in range(i % 3):
            ext = rng.choice(["png", "jpg", "webp"])
            segments.append(Segment(image=_noise_image(rng, ext), image_ext=ext))
            segments.append(Segment(text=f"after image {rng.randint(0, 99)}"))
        meta = {"i": i, "nested": {"box": [0.1, 0.2, 0.3, 0.4]}, "ü": "ok"}
        qa = [{"q": f"what is {i}?", "a": str(i)}] if i % 2 else []
        samples.append(Sample(key=f"sample-{i:04d}", segments=segments, meta=meta, qa=qa))
    return samples


def read_split(split_dir) -> list[Sample]:
    manifest = load_manifest(split_dir)
    urls = list(braceexpand(str(split_dir / manifest["brace"])))
    assert urls == manifest["paths"]
    return [decode_sample(raw) for raw in webdataset.WebDataset(urls, shardshuffle=False)]


def test_round_trip_preserves_text_images_meta_and_qa(tmp_path):
    samples = make_samples(25)
    manifest = write_shards(samples, tmp_path, "train", max_count=4)
    got = read_split(tmp_path / "train")
    assert got == samples  # dataclass equality: every text, image byte, ext, meta and qa
    assert manifest["samples"] == len(got) == 25
    assert manifest["images"] == sum(s.num_images for s in got)
    assert manifest["text_chars"] == sum(len(seg.text) for s in got for seg in s.segments if seg.text is not None)
    assert manifest["text_tokens"] is None
    assert manifest["shards"] == [f"train-{i:06d}.tar" for i in range(7)]
    assert manifest["brace"] == "train-{000000..000006}.tar"
    assert manifest["shard_samples"] == [4] * 6 + [1]
    assert json.loads((tmp_path / "train" / "manifest.json").read_text()) == manifest
    assert sorted(p.name for p in (tmp_path / "train").iterdir()) == sorted(manifest["shards"] + ["manifest.json"])


def test_images_decode_after_round_trip(tmp_path):
    write_shards(make_samples(6), tmp_path, "eval")
    for sample in read_split(tmp_path / "eval"):
        for seg in sample.segments:
            if seg.image is not None:
                Image.open(io.BytesIO(seg.image)).load()


def test_max_size_starts_new_shards(tmp_path):
    samples = make_samples(12)
    manifest = write_shards(samples, tmp_path, max_count=1000, max_size=2000)
    assert len(manifest["shards"]) > 1
    assert sum(manifest["shard_samples"]) == 12
    assert read_split(tmp_path / "train") == samples


def test_same_samples_give_byte_identical_shards(tmp_path):
    for run in ("a", "b"):
        write_shards(make_samples(9), tmp_path / run, max_count=4)
    names = sorted(p.name for p in (tmp_path / "a" / "train").iterdir())
    for name in names:
        assert (tmp_path / "a" / "train" / name).read_bytes() == (tmp_path / "b" / "train" / name).read_bytes()


def test_token_counts_with_hf_and_byte_tokenizers(tmp_path, hf_tokenizer):
    samples = make_samples(5)
    texts = [seg.text for s in samples for seg in s.segments if seg.text is not None]
    manifest = write_shards(samples, tmp_path / "hf", tokenizer=hf_tokenizer)
    assert manifest["text_tokens"] == sum(len(hf_tokenizer.encode(t, add_special_tokens=False)) for t in texts)
    manifest = write_shards(samples, tmp_path / "bytes", tokenizer=ByteTokenizer())
    assert manifest["text_tokens"] == sum(len(t.encode("utf-8")) for t in texts)
    assert manifest["tokenizer"] == "ByteTokenizer"


def test_manifest_extra_is_merged_and_read_at_close(tmp_path):
    extra = {"generator": "test", "seed": 3, "counts": {}}

    def stream():
        for sample in make_samples(3):
            extra["counts"][sample.key] = 1
            yield sample

    manifest = write_shards(stream(), tmp_path, manifest_extra=extra)
    assert manifest["generator"] == "test" and manifest["seed"] == 3 and len(manifest["counts"]) == 3
    with pytest.raises(ValueError, match="samples"):
        write_shards(make_samples(1), tmp_path, manifest_extra={"samples": 0})


def test_empty_stream_writes_no_shard_and_stale_shards_are_removed(tmp_path):
    write_shards(make_samples(9), tmp_path, max_count=2)
    (tmp_path / "train" / "notes.txt").write_text("kept")
    manifest = write_shards([], tmp_path)
    assert manifest["shards"] == [] and manifest["brace"] is None and manifest["samples"] == 0
    assert sorted(p.name for p in (tmp_path / "train").iterdir()) == ["manifest.json", "notes.txt"]


def test_writer_prints_nothing(tmp_path, capsys):
    write_shards(make_samples(7), tmp_path, max_count=2)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    "bad, match",
    [
        (Sample(key="a.b", segments=[Segment(text="x")]), "key"),
        (Sample(key="", segments=[Segment(text="x")]), "key"),
        (Sample(key="k", segments=[Segment()]), "exactly one"),
        (Sample(key="k", segments=[Segment(image=b"x", image_ext="gif")]), "image_ext"),
    ],
)
def test_invalid_samples_raise_with_the_field(tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        write_shards([bad], tmp_path)


def test_duplicate_keys_raise_and_leave_no_manifest(tmp_path):
    sample = make_samples(1)[0]
    with pytest.raises(ValueError, match="duplicate"):
        write_shards([sample, sample], tmp_path)
    assert not (tmp_path / "train" / "manifest.json").exists()


def test_split_writer_routes_one_stream_into_two_splits(tmp_path):
    samples = make_samples(10)
    with SplitWriter(tmp_path, "train") as train, SplitWriter(tmp_path, "eval") as evaluation:
        for i, sample in enumerate(samples):
            (evaluation if i % 5 == 0 else train).write(sample)
    assert read_split(tmp_path / "train") == [s for i, s in enumerate(samples) if i % 5]
    assert read_split(tmp_path / "eval") == samples[::5]
    assert train.manifest["samples"] == 8 and evaluation.manifest["samples"] == 2
