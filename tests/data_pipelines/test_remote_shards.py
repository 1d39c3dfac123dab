"""Shards in object storage: ``http://`` (a real local HTTP server in a thread), ``pipe:`` and ``file:`` specs read
through webdataset's own opener (``gopen``) and the training loader, with the strict checks of local shards."""

import functools
import http.server
import io
import logging
import random
import tarfile
import threading
from pathlib import Path

import pytest
import torch
from shard_kit import good_sample, good_shards, keys_in, with_image_token

from data_pipelines import make_dataloader
from data_pipelines.check import main as check_main
from data_pipelines.schema import encode_sample
from data_pipelines.tar_reader import SKIP, TruncatedTar, expand_shards, read_tar_groups

SEQ = 192
N_SHARDS, PER_SHARD = 4, 6
BRACE = "good-{000..003}.tar"


class ShardHandler(http.server.SimpleHTTPRequestHandler):
    """Serves the shard folder; a name in ``server.cut`` gets its full Content-Length but only the first half of its
    bytes, then the connection closes (a download cut mid-stream)."""

    def do_GET(self):
        name = self.path.lstrip("/")
        if name not in self.server.cut:
            return super().do_GET()
        data = (Path(self.directory) / name).read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data[: len(data) // 2])
        self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def tok(hf_tokenizer):
    return with_image_token(hf_tokenizer)


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("served")
    assert len(good_shards(d, N_SHARDS * PER_SHARD, per_shard=PER_SHARD)) == N_SHARDS
    return d


@pytest.fixture(scope="module")
def server(shard_dir):
    """A threaded HTTP server on an ephemeral localhost port serving ``shard_dir``."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(ShardHandler, directory=str(shard_dir)))
    httpd.cut = set()
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def url(server, name: str) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}/{name}"


def loader_for(shards, tok, **options):
    settings = dict(seq_len=SEQ, batch_size=2, epochs=1, seed=5, shuffle_buffer=4, num_workers=0)
    return make_dataloader(shards, tok, **{**settings, **options})


def batches_and_stats(loader) -> tuple[list[dict], dict]:
    return list(loader), loader.stats()


def assert_same_batches(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want) > 0
    for a, b in zip(got, want):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def keys_read(loader, tok) -> list[str]:
    return [key for batch in loader for key in keys_in(batch, tok)]


# ----------------------------------------------------------------------------- the same samples as local files
def test_http_brace_url_reads_the_same_batches_as_local_files(shard_dir, server, tok):
    local = batches_and_stats(loader_for(str(shard_dir / BRACE), tok, num_workers=2))
    remote = batches_and_stats(loader_for(url(server, BRACE), tok, num_workers=2))
    assert_same_batches(remote[0], local[0])
    assert remote[1] == local[1] and remote[1]["samples"] == N_SHARDS * PER_SHARD
    assert not any(remote[1]["skipped"].values())


def test_pipe_and_file_specs_read_the_same_batches_as_local_files(shard_dir, tok):
    local = batches_and_stats(loader_for(str(shard_dir / BRACE), tok))
    for spec in (f"pipe:cat {shard_dir / BRACE}", f"file:{shard_dir / 'good-*.tar'}", f"file://{shard_dir}"):
        assert_same_batches(batches_and_stats(loader_for(spec, tok))[0], local[0])


def test_http_ranks_are_disjoint_and_resume_continues_exactly(server, tok):
    seen = [keys_read(loader_for(url(server, BRACE), tok, rank=r, world_size=2, num_workers=2), tok) for r in (0, 1)]
    assert not set(seen[0]) & set(seen[1]) and min(map(len, seen)) > 0
    assert sorted(seen[0] + seen[1]) == [f"k{i:05d}" for i in range(N_SHARDS * PER_SHARD)]
    reference = loader_for(url(server, BRACE), tok, epochs=2, batch_size=1)
    batches, states = [], []
    for batch in reference:
        batches.append(batch)
        states.append(reference.state_dict())
    assert len(batches) >= 6
    for k in (1, len(batches) // 2, len(batches) - 3):  # inside shards: a stream is read again from its start
        resumed = loader_for(url(server, BRACE), tok, epochs=2, batch_size=1)
        resumed.load_state_dict(states[k])
        assert_same_batches(list(resumed), batches[k + 1 :])
        assert resumed.stats() == reference.stats()


# ----------------------------------------------------------------------------- faults
def _groups_before_the_cut(data: bytes, tmp_path: Path) -> list[str]:
    """Keys a local file of ``data`` (a cut shard) yields before its TruncatedTar."""
    path = tmp_path / "cut.tar"
    path.write_bytes(data)
    keys = []
    with pytest.raises(TruncatedTar):
        for group in read_tar_groups(str(path)):
            keys.append(group["__key__"])
    return keys


def test_http_shard_cut_mid_stream_is_one_truncated_tar(shard_dir, server, tok, tmp_path, caplog):
    server.cut = {"good-001.tar"}
    try:
        with caplog.at_level(logging.WARNING, logger="data_pipelines.loader"):
            loader = loader_for(url(server, BRACE), tok, shuffle=False)
            keys = keys_read(loader, tok)
    finally:
        server.cut = set()
    data = (shard_dir / "good-001.tar").read_bytes()
    kept = _groups_before_the_cut(data[: len(data) // 2], tmp_path)  # as the same bytes cut in a local file
    others = [f"k{i:05d}" for i in range(N_SHARDS * PER_SHARD) if i // PER_SHARD != 1]
    assert 0 < len(kept) < PER_SHARD and sorted(keys) == sorted(others + kept)
    assert {k: n for k, n in loader.stats()["skipped"].items() if n} == {"truncated_tar": 1}
    assert "good-001.tar: curl exited with status 18 (the transfer ended early)" in caplog.text


def test_http_missing_shard_is_one_truncated_tar_naming_the_http_error(shard_dir, server, tok, caplog):
    with caplog.at_level(logging.WARNING, logger="data_pipelines.loader"):
        loader = loader_for([url(server, "good-000.tar"), url(server, "nowhere.tar")], tok)
        assert len(keys_read(loader, tok)) == PER_SHARD
    assert {k: n for k, n in loader.stats()["skipped"].items() if n} == {"truncated_tar": 1}
    assert "nowhere.tar: curl exited with status 22 (HTTP error status >= 400)" in caplog.text


def test_failing_pipe_command_is_counted_and_named(shard_dir, tok, caplog):
    good = str(shard_dir / "good-000.tar")
    with caplog.at_level(logging.WARNING, logger="data_pipelines.loader"):
        loader = loader_for([good, "pipe:false", f"pipe:cat {good}; exit 3"], tok, shuffle=False)
        keys = keys_read(loader, tok)
    # the exit-3 stream: its groups but the last (held back until the command's status is known)
    assert sorted(keys) == sorted([f"k{i:05d}" for i in [*range(PER_SHARD), *range(PER_SHARD - 1)]])
    assert {k: n for k, n in loader.stats()["skipped"].items() if n} == {"truncated_tar": 2}
    assert "pipe:false: command exited with status 1 (ReadError: empty file)" in caplog.text
    assert "; exit 3: command exited with status 3" in caplog.text


def _tar(path: Path, members: list[tuple[str, bytes]]) -> str:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def _members(i: int) -> list[tuple[str, bytes]]:
    record = encode_sample(good_sample(i, random.Random(i), images=1))
    return [(f"{record['__key__']}.{ext}", data) for ext, data in record.items() if ext != "__key__"]


def test_stream_counts_a_non_adjacent_key_when_it_reappears(tmp_path):
    first, other, last = _members(0), _members(1), _members(2)
    path = _tar(tmp_path / "scattered.tar", [*first, *other, ("k00000.extra.txt", b"stray"), *last])
    local = list(read_tar_groups(path))  # a headers-only first pass: the whole key is one skip
    assert [g["__key__"] for g in local] == ["k00000", "k00001", "k00002"] and local[0][SKIP][0] == "non_adjacent_key"
    streamed = list(read_tar_groups(f"pipe:cat {path}"))  # no first pass: the first run is a sample, then one skip
    assert [g["__key__"] for g in streamed] == ["k00000", "k00001", "k00000", "k00002"]
    assert SKIP not in streamed[0] and "json" in streamed[0] and streamed[2][SKIP][0] == "non_adjacent_key"


def test_stream_member_over_the_cap_is_skipped(tmp_path):
    path = _tar(tmp_path / "big.tar", [*_members(0), ("big.txt", bytes(3 * 2**20)), *_members(1)])
    groups = list(read_tar_groups(f"pipe:cat {path}", max_member_bytes=2**20))
    assert [g["__key__"] for g in groups] == ["k00000", "big", "k00001"]
    assert groups[1][SKIP][0] == "member_too_large" and "txt" not in groups[1]


# ----------------------------------------------------------------------------- spec lists, checker, run config
def test_specs_expand_as_webdataset_expands_them(shard_dir, tmp_path):
    assert expand_shards("http://h/s-{00..02}.tar") == ["http://h/s-00.tar", "http://h/s-01.tar", "http://h/s-02.tar"]
    assert expand_shards(["pipe:cat a-{0..1}.tar"]) == ["pipe:cat a-0.tar", "pipe:cat a-1.tar"]  # not looked for
    assert expand_shards(f"file:{shard_dir / BRACE}") == expand_shards(str(shard_dir / BRACE))  # local paths
    with pytest.raises(FileNotFoundError, match="no shard matches"):
        expand_shards(f"file:{tmp_path / 'missing-*.tar'}")


def test_checker_reads_http_shards(server, capsys):
    assert check_main([url(server, BRACE), "--json", "--num-workers", "2"]) == 0
    assert f'"samples": {N_SHARDS * PER_SHARD}' in capsys.readouterr().out


def test_run_config_accepts_urls_and_checks_file_specs_locally(shard_dir, tmp_path):
    from vlm.training.config import ConfigError, check_paths, load_config

    tiny = str(Path(__file__).resolve().parents[2] / "scripts" / "configs" / "tiny.yaml")
    remote = ["http://storage.invalid/train-{000..009}.tar", "pipe:aws s3 cp s3://b/eval-000.tar -"]
    check_paths(load_config(tiny, [f"data.shards=['{remote[0]}']", f"data.eval_shards=['{remote[1]}']"]))
    check_paths(load_config(tiny, [f"data.shards=['file:{shard_dir / BRACE}']", "data.eval_shards=null"]))
    with pytest.raises(ConfigError, match="data.shards: no shard matches"):
        check_paths(load_config(tiny, [f"data.shards=['file:{tmp_path}/nowhere.tar']", "data.eval_shards=null"]))
