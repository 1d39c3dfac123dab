import random
from collections import Counter

import pytest
import torch
from shard_kit import (
    SMALL_PIXEL_LIMIT,
    bad_records,
    cut_inside,
    good_sample,
    good_shards,
    keys_in,
    with_image_token,
    write,
)

from data_pipelines import make_dataloader
from data_pipelines.schema import SKIP_KINDS, encode_sample
from data_pipelines.tar_reader import expand_shards, read_tar_groups

SEQ = 192


@pytest.fixture(scope="module")
def tok(hf_tokenizer):
    return with_image_token(hf_tokenizer)


@pytest.fixture(scope="module")
def corrupt_dir(tmp_path_factory):
    """good-000..002.tar (30 good samples), faults.tar (one planted fault per kind amid 4 good samples), and
    cut.tar (3 good samples, then one cut in the middle of an image member)."""
    d = tmp_path_factory.mktemp("corrupt")
    rng = random.Random(1)
    good_shards(d, 30, per_shard=10)
    bad = list(bad_records(rng).values())
    good = [encode_sample(good_sample(100 + i, rng)) for i in range(4)]
    write(str(d / "faults-%03d.tar"), [good[0], *bad[:3], good[1], *bad[3:], good[2], good[3]])
    cut = write(str(d / "cut-%03d.tar"), [encode_sample(good_sample(200 + i, rng)) for i in range(4)])[0]
    cut_inside(cut, "k00203")
    return d


@pytest.fixture(scope="module")
def one_shard(tmp_path_factory):
    """The same faults in a single shard (fewer shards than splits: splitting by sample), cut in its last sample."""
    d = tmp_path_factory.mktemp("one")
    rng = random.Random(1)
    good = [encode_sample(good_sample(i, rng)) for i in range(34)]
    path = write(str(d / "one-%03d.tar"), [*good[:10], *bad_records(rng).values(), *good[10:]])[0]
    cut_inside(path, "k00033")
    return path


def expected_keys():
    return {f"k{i:05d}" for i in [*range(30), *range(100, 104), *range(200, 203)]}


def read_all(loader, tok):
    keys = []
    for batch in loader:
        keys += keys_in(batch, tok)
    return keys


def test_planted_faults_skipped_and_counted_good_samples_kept(corrupt_dir, tok):
    loader = make_dataloader(
        str(corrupt_dir / "*.tar"), tok, seq_len=SEQ, batch_size=3, epochs=1, max_image_pixels=SMALL_PIXEL_LIMIT
    )
    keys = read_all(loader, tok)
    assert sorted(keys) == sorted(expected_keys())  # every good sample exactly once
    stats = loader.stats()
    assert stats["samples"] == len(expected_keys())
    assert stats["skipped"] == WANT
    assert 0 < stats["packing_efficiency"] <= 1


def test_skips_are_logged(corrupt_dir, tok, caplog):
    loader = make_dataloader(
        str(corrupt_dir / "faults-*.tar"), tok, seq_len=SEQ, epochs=1, max_image_pixels=SMALL_PIXEL_LIMIT
    )
    with caplog.at_level("WARNING", logger="data_pipelines.loader"):
        list(loader)
    logged = [kind for kind in SKIP_KINDS for r in caplog.records if f"[{kind}," in r.getMessage()]
    assert Counter(logged) == {"bad_image": 2, "bad_json": 1, "image_too_large": 1, "too_long": 1, "missing_field": 1}


def test_tar_cut_at_a_member_boundary_is_truncated(tmp_path):
    path = write(str(tmp_path / "t-%03d.tar"), [encode_sample(good_sample(i, random.Random(i))) for i in range(3)])[0]
    data = open(path, "rb").read()
    end = data.rstrip(b"\0")  # drop the end-of-archive blocks: the file now ends right after a member
    open(path, "wb").write(end + b"\0" * (-len(end) % 512))
    groups, error = [], None
    try:
        for group in read_tar_groups(path):
            groups.append(group)
    except Exception as err:
        error = err
    assert type(error).__name__ == "TruncatedTar" and [g["__key__"] for g in groups] == ["k00000", "k00001"]


@pytest.mark.parametrize("n_shards, num_workers", [(1, 0), (5, 0), (3, 2), (6, 2)])  # by sample / by shard
def test_two_ranks_disjoint_and_complete(tmp_path, tok, n_shards, num_workers):
    paths = good_shards(tmp_path, 24, per_shard=-(-24 // n_shards))
    assert len(paths) == n_shards
    seen = []
    for rank in (0, 1):
        loader = make_dataloader(
            paths, tok, seq_len=SEQ, batch_size=2, rank=rank, world_size=2, num_workers=num_workers, epochs=1, seed=3
        )
        seen.append(read_all(loader, tok))
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == [f"k{i:05d}" for i in range(24)]
    assert min(len(s) for s in seen) > 0


PLANTED = {"truncated_tar": 1, "bad_image": 2, "bad_json": 1, "image_too_large": 1, "too_long": 1, "missing_field": 1}
WANT = {**dict.fromkeys(SKIP_KINDS, 0), **PLANTED}  # every kind reported, the planted ones exactly


@pytest.mark.parametrize(
    "shards, num_workers, split_documents",
    [("many", 0, False), ("many", 0, True), ("many", 2, True), ("one", 2, False)],
)
def test_resume_yields_the_uninterrupted_batches(corrupt_dir, one_shard, tok, shards, num_workers, split_documents):
    def loader():
        return make_dataloader(
            str(corrupt_dir / "*.tar") if shards == "many" else one_shard,
            tok,
            batch_size=2,
            seq_len=96 if split_documents else SEQ,
            num_workers=num_workers,
            shuffle_buffer=4,
            max_image_pixels=SMALL_PIXEL_LIMIT,
            split_documents=split_documents,
            epochs=4,
            seed=7,
        )

    reference = loader()
    batches, states, stats = [], [], []
    for batch in reference:
        batches.append(batch)
        states.append(reference.state_dict())
        stats.append(reference.stats())
    assert len(batches) > 8  # several epochs: resume points inside later epochs
    picks = {2, len(batches) // 2, len(batches) - 2}
    if split_documents:  # a point where the next row continues a document
        picks.add(next(k for k, st in enumerate(states) if any(w["offset"] for w in st["workers"])))
    for k in sorted(picks):
        resumed = loader()
        resumed.load_state_dict(states[k])
        assert resumed.stats() == stats[k]
        got = list(resumed)
        assert len(got) == len(batches) - k - 1
        for a, b in zip(batches[k + 1 :], got):
            assert a.keys() == b.keys()
            for key in a:
                assert torch.equal(a[key], b[key]), (k, key)
        assert resumed.stats() == reference.stats()  # nothing counted twice, nothing missed
    want = {**WANT, "too_long": 0} if split_documents else WANT  # split: the long text runs over several rows
    assert reference.stats()["skipped"] == {kind: 4 * n for kind, n in want.items()}  # once per epoch


def test_unusable_data_ends_an_endless_stream(tmp_path, tok):
    garbage = tmp_path / "garbage.tar"
    garbage.write_bytes(b"not a tar" * 100)
    loader = make_dataloader(str(garbage), tok, seq_len=SEQ, epochs=None)
    assert list(loader) == [] and loader.stats()["skipped"]["truncated_tar"] == 1


def test_state_from_another_configuration_is_refused(corrupt_dir, tok):
    a = make_dataloader(str(corrupt_dir / "good-*.tar"), tok, seq_len=SEQ, seed=0)
    b = make_dataloader(str(corrupt_dir / "good-*.tar"), tok, seq_len=SEQ, seed=1)
    with pytest.raises(ValueError, match="seed"):
        b.load_state_dict(a.state_dict())


def test_img2dataset_layout_read_as_is(tmp_path, tok):
    rng = random.Random(0)
    records, captions = [], []
    for i in range(5):
        img, caption = captioned_image_bytes(rng)
        captions.append(caption)
        records.append({"__key__": f"{i:09d}", "jpg": img, "txt": caption.encode(), "json": b'{"url": "x"}'})
    path = write(str(tmp_path / "%05d.tar"), records)
    loader = make_dataloader(path, tok, seq_len=SEQ, batch_size=8, epochs=1, shuffle=False)
    (batch,) = list(loader)
    stats = loader.stats()
    assert stats["samples"] == 5 and stats["images"] == 5 and sum(stats["skipped"].values()) == 0
    text_mask = (batch["modality_ids"] == 0) & (batch["attention_mask"] == 1)
    text = tok.decode(batch["input_ids"][text_mask])
    assert all(c in text for c in captions)
    assert batch["grid_hw"].shape == (5, 2) and int(batch["modality_ids"].sum()) == int(
        (batch["grid_hw"].prod(-1) // 4).sum()
    )


def captioned_image_bytes(rng):
    from data_pipelines.schema import image_bytes
    from data_pipelines.synthetic_images import captioned_image

    img, caption = captioned_image(rng)
    return image_bytes(img, "jpg"), caption


def test_shard_patterns(corrupt_dir):
    brace = expand_shards(str(corrupt_dir / "good-{000..002}.tar"))
    assert brace == expand_shards(str(corrupt_dir / "good-*.tar")) and len(brace) == 3
    assert len(expand_shards(corrupt_dir)) == 5
    with pytest.raises(FileNotFoundError):
        expand_shards(str(corrupt_dir / "nothing-*.tar"))


def test_batch_feeds_the_vlm(corrupt_dir, tok):
    from vlm import ConceptMoEVLM

    loader = make_dataloader(str(corrupt_dir / "good-000.tar"), tok, seq_len=SEQ, batch_size=2, epochs=1)
    batch = next(iter(loader))
    assert batch["grid_hw"].shape[0] > 0
    image_token_id = tok.convert_tokens_to_ids("<image>")
    model = ConceptMoEVLM.from_preset("tiny", image_token_id=image_token_id, vocab_size=len(tok))
    out = model(**batch)
    assert torch.isfinite(out.loss)
