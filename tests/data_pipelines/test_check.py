import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from shard_kit import SMALL_PIXEL_LIMIT, bad_records, cut_inside, good_sample, good_shards, with_image_token, write

from data_pipelines.check import check_shards, main
from data_pipelines.local_text import ByteTokenizer
from data_pipelines.schema import SKIP_KINDS, encode_sample

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("check")
    rng = random.Random(2)
    good_shards(d, 12, per_shard=6)
    write(str(d / "faults-%03d.tar"), [*bad_records(rng).values(), encode_sample(good_sample(50, rng))])
    cut = write(str(d / "cut-%03d.tar"), [encode_sample(good_sample(60 + i, rng)) for i in range(3)])[0]
    cut_inside(cut, "k00062")
    return d


PLANTED = {"truncated_tar": 1, "bad_image": 2, "bad_json": 1, "image_too_large": 1, "too_long": 1, "missing_field": 1}
WANT = {**dict.fromkeys(SKIP_KINDS, 0), **PLANTED}  # every kind reported, the planted ones exactly


def test_cli_json_end_to_end(shards, hf_tokenizer, tmp_path):
    tok_dir = tmp_path / "tok"
    with_image_token(hf_tokenizer).save_pretrained(tok_dir)
    patterns = [str(shards / "good-*.tar"), str(shards / "faults-{000..000}.tar"), str(shards / "cut-000.tar")]
    options = ["--json", "--tokenizer", str(tok_dir), "--seq-len", "256", "--max-image-pixels", str(SMALL_PIXEL_LIMIT)]
    cmd = [sys.executable, "-m", "data_pipelines.check", *patterns, *options]
    out = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert set(report) == {"samples", "images", "text_tokens", "skipped"}
    assert report["samples"] == 12 + 1 + 2 and report["skipped"] == WANT
    assert report["images"] > 0 and report["text_tokens"] > 0
    assert "bad_image" in out.stderr  # the skips are logged too


def test_byte_level_fallback_counts_the_same_samples(shards):
    stats = check_shards(shards, ByteTokenizer(), seq_len=256, max_image_pixels=SMALL_PIXEL_LIMIT)
    assert stats["samples"] == 15 and stats["skipped"] == WANT


def test_exit_status(shards, tmp_path, capsys):
    assert main([str(shards / "good-000.tar"), "--json"]) == 0  # default tokenizer, or the byte-level fallback
    assert json.loads(capsys.readouterr().out)["samples"] == 6
    garbage = tmp_path / "garbage.tar"
    garbage.write_bytes(b"not a tar at all" * 100)
    assert main([str(garbage)]) == 1  # nothing readable
    assert "truncated_tar: 1" in capsys.readouterr().out
    assert main([str(tmp_path / "missing-*.tar")]) == 2
