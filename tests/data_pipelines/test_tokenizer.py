"""The default tokenizer: shipped, offline, special tokens, lossless, save/load identity, reproducible build."""

import copy
import json

import pytest
import tokenizers
import transformers

from data_pipelines.local_text import load_local_text_corpus
from data_pipelines.tokenizer import (
    BUILD_INFO_FILE,
    CHAT_TOKENS,
    DEFAULT_TOKENIZER_DIR,
    IMAGE_TOKEN,
    SPECIAL_TOKENS,
    add_vlm_tokens,
    build_default_tokenizer,
    corpus_sha256,
    load_tokenizer,
)

TEXTS = [
    "Return the sum of a and b.\n\n    >>> add(2, 3)\n    5\n",
    "héllo wörld — ünïcödé, 日本語のテキスト, emoji 🙂🚀, tabs\tand  double  spaces ",
    "What colour is the square? <image> Where is the circle?",
    "  leading and trailing spaces , punctuation . after spaces !  ",
    "",
]


@pytest.fixture(scope="module")
def shipped():
    return load_tokenizer()


def test_load_tokenizer_offline_default(shipped, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = load_tokenizer()
    bpe_vocab = json.loads((DEFAULT_TOKENIZER_DIR / BUILD_INFO_FILE).read_text())["vocab_size"]
    assert len(tok) == len(shipped) == bpe_vocab + len(CHAT_TOKENS)
    assert [tok.pad_token, tok.eos_token, tok.unk_token, tok.bos_token] == ["<pad>", "<eos>", "<unk>", "<bos>"]
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2, 3, 4]
    # the chat tokens come after the BPE vocabulary (adding them moved no earlier id) and are never split
    assert tok.convert_tokens_to_ids(list(CHAT_TOKENS)) == list(range(bpe_vocab, bpe_vocab + len(CHAT_TOKENS)))
    assert all(t in tok.all_special_tokens for t in CHAT_TOKENS)


def test_image_token_is_one_special_id(shipped):
    image_id = shipped.convert_tokens_to_ids("<image>")
    assert image_id in shipped.all_special_ids
    ids = shipped("a<image>b <image><image>", add_special_tokens=False)["input_ids"]
    assert ids.count(image_id) == 3
    assert "<image>" not in shipped.decode(ids, skip_special_tokens=True)


def test_add_vlm_tokens_appends_only_the_missing_ones_in_order(shipped, hf_tokenizer):
    tok = copy.deepcopy(hf_tokenizer)
    before, n = tok.get_vocab(), len(tok)
    assert add_vlm_tokens(tok, chat=False) == n and len(tok) == n + 1  # the loader's: <image> alone
    assert add_vlm_tokens(tok) == n and tok.convert_tokens_to_ids(list(CHAT_TOKENS)) == list(range(n + 1, n + 5))
    assert add_vlm_tokens(tok) == n and len(tok) == n + 5  # nothing twice
    assert {t: i for t, i in tok.get_vocab().items() if t in before} == before  # no earlier id moved
    ids = tok(f"a{IMAGE_TOKEN}{CHAT_TOKENS[0]}b", add_special_tokens=False)["input_ids"]
    assert ids[1:3] == [n, n + 1]  # special: never split, nor merged with the text around them
    shipped_ids = shipped.get_vocab()
    assert add_vlm_tokens(shipped) == 4 and shipped.get_vocab() == shipped_ids  # has them all: left as it is


def test_encode_adds_no_special_tokens(shipped):
    assert shipped("hello")["input_ids"] == shipped("hello", add_special_tokens=False)["input_ids"]


def test_decode_encode_round_trip(shipped):
    for text in TEXTS + load_local_text_corpus()["eval"][:20]:
        assert shipped.decode(shipped(text)["input_ids"]) == text


def test_save_load_identity(shipped, tmp_path):
    shipped.save_pretrained(tmp_path)
    reloaded = load_tokenizer(tmp_path)
    assert (tmp_path / "tokenizer.json").read_bytes() == (DEFAULT_TOKENIZER_DIR / "tokenizer.json").read_bytes()
    for text in TEXTS:
        assert reloaded(text)["input_ids"] == shipped(text)["input_ids"]
    assert reloaded.all_special_tokens == shipped.all_special_tokens
    assert reloaded.get_vocab() == shipped.get_vocab()


def test_build_is_deterministic():
    a, b = build_default_tokenizer(vocab_size=512), build_default_tokenizer(vocab_size=512)
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert len(a) == 512 + len(CHAT_TOKENS)  # the BPE vocabulary, then the chat tokens


def test_rebuild_reproduces_shipped_tokenizer(tmp_path):
    """Same corpus (Python version) and library versions -> byte-identical tokenizer.json (~2 s)."""
    info = json.loads((DEFAULT_TOKENIZER_DIR / BUILD_INFO_FILE).read_text())
    here = {"tokenizers": tokenizers.__version__, "transformers": transformers.__version__}
    if corpus_sha256(load_local_text_corpus()["train"]) != info["corpus"]["train_sha256"]:
        pytest.skip(
            f"the stdlib corpus differs from the one the shipped tokenizer was built on (Python {info['python']})"
        )
    if any(info[k] != v for k, v in here.items()):
        pytest.skip(f"library versions {here} differ from the build's")
    build_default_tokenizer(info["vocab_size"]).save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").read_bytes() == (DEFAULT_TOKENIZER_DIR / "tokenizer.json").read_bytes()


def test_folder_without_tokenizer_raises(tmp_path):
    (tmp_path / "notes.txt").write_text("no tokenizer here")
    with pytest.raises(FileNotFoundError, match="holds no tokenizer"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_tokenizer(tmp_path / "missing")


def test_unreadable_tokenizer_raises_one_line(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load a tokenizer from") as info:
        load_tokenizer(tmp_path)
    assert "\n" not in str(info.value)
