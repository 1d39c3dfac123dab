"""Small webdataset shards for the loader / packing / check tests, good and planted-bad samples.

Every good sample's text starts with ``doc <key>:`` so that tests can find which samples a batch holds by
decoding its text tokens (``keys_in``).
"""

import copy
import json
import random
import re
import tarfile
from pathlib import Path

import webdataset as wds
from PIL import Image

from data_pipelines.schema import Sample, Segment, encode_sample, image_bytes
from data_pipelines.synthetic_images import captioned_image
from data_pipelines.tokenizer import add_vlm_tokens

SMALL_PIXEL_LIMIT = 150 * 150  # tests pass this as max_image_pixels; the "huge" image exceeds it
KEY_RE = re.compile(r"doc (k\d+):")


def with_image_token(tokenizer):
    """A copy of the shared fixture tokenizer with ``<image>`` (the session fixture stays untouched)."""
    tok = copy.deepcopy(tokenizer)
    add_vlm_tokens(tok, chat=False)
    return tok


def good_sample(i: int, rng: random.Random, images: int = 1) -> Sample:
    segs = [Segment(text=f"doc k{i:05d}: ")]
    for _ in range(images):
        img, caption = captioned_image(rng)
        ext = rng.choice(["png", "jpg"])
        segs += [Segment(image=image_bytes(img, ext), image_ext=ext), Segment(text=caption)]
    return Sample(key=f"k{i:05d}", segments=segs, meta={"i": i})


def write(path_pattern: str, records: list[dict], maxcount: int = 10_000) -> list[str]:
    """Write records (``encode_sample`` dicts or raw member dicts) with ``ShardWriter``; returns the paths."""
    Path(path_pattern).parent.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(path_pattern, maxcount=maxcount, verbose=0) as writer:
        for record in records:
            writer.write(record)
    return sorted(str(p) for p in Path(path_pattern).parent.glob("*.tar"))


def good_shards(directory: Path, n: int, per_shard: int, seed: int = 0, start: int = 0) -> list[str]:
    rng = random.Random(seed)
    records = [encode_sample(good_sample(start + i, rng, images=rng.choice([0, 1, 1, 2]))) for i in range(n)]
    return write(str(directory / "good-%03d.tar"), records, maxcount=per_shard)


def bad_records(rng: random.Random) -> dict[str, dict]:
    """One planted fault per skip kind (``truncated_tar`` is made by cutting a file: ``cut_inside``)."""
    image = Segment(image=image_bytes(captioned_image(rng)[0]))
    ok = encode_sample(Sample("ok", [Segment(text="doc k90000: "), image]))
    huge = Image.new("RGB", (300, 200), (10, 20, 30))
    return {
        "bad_image": {**ok, "__key__": "bad-zero", "img0.png": b""},
        "bad_image2": {**ok, "__key__": "bad-garbage", "img0.png": b"\x89PNG not really an image"},
        "bad_json": {"__key__": "bad-json", "json": b'{"segments": [{"text": "unterminated'},
        "missing_field": {"__key__": "bad-noseg", "json": json.dumps({"meta": {}}).encode()},
        "image_too_large": encode_sample(
            Sample("bad-huge", [Segment(text="doc huge: "), Segment(image=image_bytes(huge))])
        ),
        "too_long": encode_sample(Sample("bad-long", [Segment(text="doc long: " + "many words here " * 400)])),
    }


def cut_inside(path: str, key: str) -> None:
    """Truncate the tar in the middle of the data of the first member of ``key``."""
    with tarfile.open(path) as tar:
        member = next(m for m in tar.getmembers() if m.name.startswith(key + "."))
    with open(path, "r+b") as f:
        f.truncate(member.offset_data + max(1, member.size // 2))


def keys_in(batch, tokenizer) -> list[str]:
    """Keys of the samples whose ``doc <key>:`` text starts in this batch, in row order."""
    keys = []
    for ids, modality in zip(batch["input_ids"], batch["modality_ids"]):
        text = tokenizer.decode([int(t) for t, m in zip(ids, modality) if m == 0], skip_special_tokens=True)
        keys += KEY_RE.findall(text)
    return keys
