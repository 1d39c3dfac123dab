import json
import logging
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from shard_kit import SMALL_PIXEL_LIMIT, bad_records, cut_inside, good_sample, good_shards, with_image_token, write
from terminal_kit import Terminal

from data_pipelines.check import check_shards, main, parse_args, settings
from data_pipelines.local_text import ByteTokenizer
from data_pipelines.run_config import DataConfig
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
    cmd = [sys.executable, "-m", "data_pipelines.check", *patterns, *options, "--num-workers", "2", "--verbose"]
    out = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert set(report) == {"samples", "images", "text_tokens", "skipped", "shards", "seconds"}
    assert report["samples"] == 12 + 1 + 2 and report["skipped"] == WANT and report["shards"] == 4
    assert report["images"] > 0 and report["text_tokens"] > 0 and report["seconds"] > 0
    assert "bad_image" in out.stderr  # --verbose: each skipped sample is logged too (from the worker processes)


def test_byte_level_fallback_counts_the_same_samples(shards):
    stats = check_shards(
        DataConfig(shards=str(shards), seq_len=256), ByteTokenizer(), max_image_pixels=SMALL_PIXEL_LIMIT
    )
    assert stats["samples"] == 15 and stats["skipped"] == WANT


def test_exit_status(shards, tmp_path, capsys):
    assert main([str(shards / "good-000.tar"), "--json", "--num-workers", "0"]) == 0  # default tokenizer (or bytes)
    assert json.loads(capsys.readouterr().out)["samples"] == 6
    garbage = tmp_path / "garbage.tar"
    garbage.write_bytes(b"not a tar at all" * 100)
    assert main([str(garbage), "--num-workers", "0"]) == 1  # nothing readable
    assert "truncated_tar: 1" in capsys.readouterr().out
    assert main([str(tmp_path / "missing-*.tar")]) == 2
    assert main([]) == 2  # no shards, no config
    assert "no shards" in capsys.readouterr().err


def _options(tok_dir) -> list[str]:
    return ["--num-workers", "0", "--tokenizer", str(tok_dir), "--max-image-pixels", str(SMALL_PIXEL_LIMIT)]


@pytest.fixture(scope="module")
def tok_dir(hf_tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    with_image_token(hf_tokenizer).save_pretrained(path)
    return path


def test_summary_is_one_line_of_skips_by_kind_and_the_time(shards, tok_dir, capsys, caplog):
    with caplog.at_level(logging.WARNING):
        assert main([str(shards), *_options(tok_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("read 15 samples, ") and " s (0 workers)" in lines[0]
    assert lines[0].split(" shards in ")[0].endswith("from 4")  # good-000, good-001, faults, cut
    kinds = ", ".join(f"{kind}: {n}" for kind, n in WANT.items() if n)
    assert lines[1] == f"skipped 7 ({kinds})"
    assert not [r for r in caplog.records if "skipped sample" in r.getMessage()]  # details only with --verbose
    with caplog.at_level(logging.WARNING):
        assert main([str(shards / "faults-000.tar"), *_options(tok_dir), "--verbose"]) == 0
    assert sum("skipped sample [bad_image" in r.getMessage() for r in caplog.records) == 2
    assert logging.getLogger("data_pipelines.loader.skips").level == logging.NOTSET  # main() leaves it as it was


def _config(tmp_path, data: dict) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": {"preset": "tiny"}, "data": data, "train": {"max_steps": 1}}))
    return str(path)


def test_config_gives_shards_and_data_settings(shards, tok_dir, tmp_path, capsys):
    data = {"shards": [str(shards / "faults-*.tar")], "tokenizer": str(tok_dir), "seq_len": 256}
    assert main(["--config", _config(tmp_path, data), "--json", *_options(tok_dir)[:2]]) == 0
    assert json.loads(capsys.readouterr().out)["skipped"]["too_long"] == 1
    split = _config(tmp_path, {**data, "split_documents": True})  # the long text now runs over several rows
    assert main(["--config", split, "--json", *_options(tok_dir)[:2]]) == 0
    assert json.loads(capsys.readouterr().out)["skipped"]["too_long"] == 0
    # the command line wins: its shards, and --no-split-documents
    good = str(shards / "good-000.tar")
    assert main([good, "--config", split, "--json", "--no-split-documents", *_options(tok_dir)[:2]]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == 6
    run = settings(parse_args(["--config", _config(tmp_path, {"shards": "x.tar", "max_patches": 16}), "--workers=0"]))
    assert run == DataConfig(shards=["x.tar"], max_patches=16)
    # --set overrides the config as training's --set does
    run = settings(parse_args(["--config", _config(tmp_path, {"shards": "x.tar"}), "--set", "data.seq_len=32"]))
    assert run.seq_len == 32


def test_defaults_are_the_training_defaults():
    from vlm.training.config import SECTIONS

    assert SECTIONS["data"] is DataConfig  # the run's data section is the checker's settings
    assert settings(parse_args(["x.tar", "--workers=0"])) == DataConfig(shards=["x.tar"])  # without --config too


@pytest.mark.parametrize(
    "text, message",
    [
        (None, "No such file"),
        ("data: [1", "invalid YAML at line 1"),
        ("train: {}", "no 'data' section"),
        ("data: {shards: x.tar, seq_lenn: 3}", "unknown config field 'data.seq_lenn'"),
        ("data: {shards: x.tar, seq_len: 1}", "config field 'data.seq_len' must be >= 2"),
    ],
)
def test_bad_config_exits_2_with_one_line(tmp_path, capsys, text, message):
    path = tmp_path / "run.yaml"
    if text is not None:
        path.write_text(text)
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_strict_exits_1_when_anything_was_skipped_and_says_so(shards, tok_dir, capsys):
    assert main([str(shards), *_options(tok_dir), "--strict", "--quiet"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("read 15 samples, ") and lines[1].startswith("skipped 7 (")
    assert lines[1].endswith("; --strict: failed")
    assert main([str(shards), *_options(tok_dir), "--strict", "--json", "--quiet"]) == 1
    out = capsys.readouterr()
    assert json.loads(out.out)["samples"] == 15 and out.err.strip() == "error: --strict: 7 samples skipped"
    assert main([str(shards / "good-000.tar"), *_options(tok_dir), "--strict", "--quiet"]) == 0  # nothing skipped
    assert capsys.readouterr().out.splitlines()[1] == "skipped 0"
    assert main([str(shards), *_options(tok_dir), "--quiet"]) == 0  # without --strict skips are reported, not fatal


@pytest.mark.parametrize("quiet", [False, True])
def test_progress_bar_on_a_terminal_unless_quiet(shards, tok_dir, monkeypatch, quiet):
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert main([str(shards / "faults-000.tar"), *_options(tok_dir)] + ["--quiet"] * quiet) == 0
    if quiet:
        assert "checking" not in terminal.getvalue()
    else:  # the bar's last state counts what the report counts
        assert "checking: " in terminal.getvalue() and "1 samples, 6 skipped" in terminal.getvalue()
