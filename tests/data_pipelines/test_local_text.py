import hashlib
import json
import os
import subprocess
import sys
from itertools import islice
from pathlib import Path

import pytest
import torch

from data_pipelines.local_text import ByteTokenizer, load_local_text_corpus, packed_batches

REPO_ROOT = Path(__file__).resolve().parents[2]
TOK = ByteTokenizer()


def _fingerprint(corpus: dict[str, list[str]]) -> str:
    return hashlib.sha256(json.dumps(corpus, sort_keys=True).encode("utf-8")).hexdigest()


@pytest.fixture(scope="module")
def corpus():
    return load_local_text_corpus()


def test_corpus_is_nonempty_real_text(corpus):
    assert len(corpus["train"]) > 500
    assert len(corpus["eval"]) > 5
    assert all(len(doc) >= 200 for split in corpus.values() for doc in split)
    assert sum(len(doc) for doc in corpus["train"]) > 200_000


def test_corpus_splits_are_disjoint_and_deduplicated(corpus):
    normalized = [" ".join(doc.split()) for split in ("train", "eval") for doc in corpus[split]]
    assert len(normalized) == len(set(normalized))


def test_corpus_is_deterministic_across_processes_and_hash_seeds(corpus):
    assert load_local_text_corpus() == corpus  # same process (cached parse)
    code = (
        "import hashlib, json; from data_pipelines.local_text import load_local_text_corpus; "
        "print(hashlib.sha256(json.dumps(load_local_text_corpus(), sort_keys=True).encode()).hexdigest())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == _fingerprint(corpus)


def test_corpus_options_keep_split_membership(corpus):
    small = load_local_text_corpus(max_docs=300)
    assert len(small["train"]) + len(small["eval"]) == 300
    assert set(small["train"]) <= set(corpus["train"])
    assert set(small["eval"]) <= set(corpus["eval"])
    longer = load_local_text_corpus(min_chars=1000)
    assert set(longer["train"]) <= set(corpus["train"])
    assert set(longer["eval"]) <= set(corpus["eval"])


def test_corpus_from_tree_skips_tests_short_and_duplicates(tmp_path):
    long_doc = ("A long docstring. " * 20).strip()
    (tmp_path / "a.py").write_text(f'"""{long_doc}"""\n\ndef f():\n    """short"""\n')
    (tmp_path / "b.py").write_text(f'class C:\n    """{long_doc}\n    """\n')  # same text, other whitespace
    (tmp_path / "broken.py").write_text("def (:\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text(f'"""Test {long_doc}"""\n')
    got = load_local_text_corpus(eval_fraction=0.0, stdlib_dir=str(tmp_path))
    assert got == {"train": [long_doc], "eval": []}


@pytest.mark.parametrize("bad", [{"min_chars": 0}, {"eval_fraction": 1.0}, {"max_docs": 0}])
def test_corpus_rejects_bad_arguments(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        load_local_text_corpus(**bad)


def test_byte_tokenizer_round_trips_unicode():
    text = "Grüße, 世界! λ → ∞ 🙂\n\ttabs"
    ids = TOK.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert len(ids) == len(text.encode("utf-8"))
    assert TOK.decode(ids) == text
    assert TOK.decode([TOK.bos_id, *ids, TOK.eos_id, TOK.pad_id]) == text
    assert TOK.encode("x", add_bos=True, add_eos=True) == [256, ord("x"), 257]
    assert TOK.decode([0xE4]) == "\ufffd"
    assert TOK.vocab_size == len(TOK) == 259


def _split_docs(ids: torch.Tensor) -> list[str]:
    """Texts of the eos-terminated documents in a flattened token stream (a trailing partial one dropped)."""
    ends = (ids.flatten() == TOK.eos_id).nonzero().flatten().tolist()
    starts = [0] + [end + 1 for end in ends[:-1]]
    return [TOK.decode(ids.flatten()[start:end]) for start, end in zip(starts, ends)]


def _docs():
    return [f"doc {i}: " + "ab" * (i % 7) + "é" * (i % 3) for i in range(40)]


def test_packed_batches_shapes_and_labels():
    batch = next(packed_batches(_docs(), TOK, seq_len=16, batch_size=3, seed=0))
    assert set(batch) == {"input_ids", "labels", "doc_ids", "attention_mask"}
    for value in batch.values():
        assert value.shape == (3, 16) and value.dtype == torch.long
    assert bool((batch["attention_mask"] == 1).all())  # drop_last=True: never padded
    assert torch.equal(batch["labels"], batch["input_ids"])


def test_packed_doc_ids_step_exactly_after_eos():
    for batch in islice(packed_batches(_docs(), TOK, seq_len=16, batch_size=4, seed=1), 20):
        ids, doc = batch["input_ids"], batch["doc_ids"]
        assert bool((doc[:, 0] == 0).all())
        step = doc[:, 1:] - doc[:, :-1]
        assert bool(((step == 0) | (step == 1)).all())
        assert torch.equal(step == 1, ids[:, :-1] == TOK.eos_id)


def test_packed_batches_cover_each_epoch_once():
    docs = _docs()
    batches = list(packed_batches(docs, TOK, seq_len=32, batch_size=4, seed=3, drop_last=False, epochs=1))
    stream = torch.cat([b["input_ids"][b["attention_mask"] == 1] for b in batches])
    assert stream[-1] == TOK.eos_id
    assert sorted(_split_docs(stream)) == sorted(docs)
    last = batches[-1]
    mask = last["attention_mask"]
    assert bool((mask[:, :-1] >= mask[:, 1:]).all())  # padding only at row ends
    assert bool((last["labels"][mask == 0] == -100).all())
    assert bool((last["input_ids"][mask == 0] == TOK.pad_id).all())
    assert torch.equal(last["labels"][mask == 1], last["input_ids"][mask == 1])
    dropped = list(packed_batches(docs, TOK, seq_len=32, batch_size=4, seed=3, epochs=1))
    assert len(dropped) == len(stream) // (32 * 4)
    assert all(b["input_ids"].shape == (4, 32) for b in dropped)


def test_packed_batches_are_deterministic_by_seed():
    def take(seed):
        return [b["input_ids"] for b in islice(packed_batches(_docs(), TOK, 24, 2, seed=seed), 12)]

    assert all(torch.equal(a, b) for a, b in zip(take(7), take(7)))
    assert not all(torch.equal(a, b) for a, b in zip(take(7), take(8)))


def test_packed_batches_reshuffle_each_epoch():
    docs = [f"{i:02d}" for i in range(50)]  # one epoch = 50 docs x 3 tokens = 150 tokens = 5 rows of 30
    first, second = islice(packed_batches(docs, TOK, seq_len=30, batch_size=5, seed=0), 2)
    first_docs, second_docs = _split_docs(first["input_ids"]), _split_docs(second["input_ids"])
    assert sorted(first_docs) == sorted(second_docs) == docs
    assert first_docs != second_docs
