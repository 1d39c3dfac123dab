"""The toolkit's default tokenizer, and loading any HF tokenizer folder in its place.

The default is a byte-level BPE trained with HF ``tokenizers`` on the train split of the local text corpus
(:func:`data_pipelines.local_text.load_local_text_corpus`, the standard library's docstrings), wrapped as a
``PreTrainedTokenizerFast`` and shipped in the package (``data_pipelines/assets/tokenizer/``), so no command
needs a preparation step. ``python scripts/build_tokenizer.py`` rebuilds it.

Special tokens (ids 0..4, never split by the BPE, skipped by ``decode(..., skip_special_tokens=True)``):

    <pad>    0  padding (labels ignore it)
    <eos>    1  end of text: appended after every document when documents are packed into rows
    <unk>    2  unknown; never produced, since every byte is in the byte-level base alphabet
    <bos>    3  beginning of text; defined for callers that want it, never added automatically
    <image>  4  one image slot; the processor / loader repeats it once per vision token

Any other HF tokenizer gets ``<image>`` and the chat tokens from :func:`add_vlm_tokens`, the one place they are added.

Encoding adds no special tokens on its own (no BOS, no EOS): ``decode(encode(text)) == text`` for any text.

Reproducible: BPE training in ``tokenizers`` counts words and breaks ties between equally frequent pairs by
pair id, and the ids follow the sorted byte alphabet, so the same corpus gives a byte-identical
``tokenizer.json`` on any machine, thread count or ``PYTHONHASHSEED``. The corpus itself depends on the Python
version (the standard library changes between releases), so ``BUILD_INFO.json`` next to the shipped files
records the Python version, the corpus hash and the library versions it was built with.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from pathlib import Path

import tokenizers
import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from data_pipelines.bpe import train_bpe_tokenizer
from data_pipelines.local_text import load_local_text_corpus

logger = logging.getLogger(__name__)

PAD, EOS, UNK, BOS, IMAGE_TOKEN = "<pad>", "<eos>", "<unk>", "<bos>", "<image>"
SPECIAL_TOKENS = (PAD, EOS, UNK, BOS, IMAGE_TOKEN)  # this order fixes their ids 0..4
# The chat template's role headers and end of turn (``data_pipelines.chat``): special tokens added after the BPE
# vocabulary (ids vocab_size .. vocab_size + 3), so adding them left every earlier id as it was.
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
END_OF_TURN = "<|end|>"
CHAT_TOKENS = (*ROLE_TOKENS.values(), END_OF_TURN)
DEFAULT_VOCAB_SIZE = 8192
DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parent / "assets" / "tokenizer"
BUILD_INFO_FILE = "BUILD_INFO.json"
# Files any of which makes a folder a tokenizer folder for AutoTokenizer (fast, BPE, SentencePiece, WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "vocab.txt")


def corpus_sha256(texts: list[str]) -> str:
    """Hash of a document list (order included): sha256 over each document's UTF-8 bytes followed by NUL."""
    h = hashlib.sha256()
    for text in texts:
        h.update(text.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


def bytes_per_token(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> float:
    """UTF-8 bytes per token over ``texts`` (no special tokens): the tokenizer's compression."""
    n_tokens = sum(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
    return sum(len(t.encode("utf-8")) for t in texts) / max(n_tokens, 1)


def wrap_tokenizer(fast: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    """The trained backend with the toolkit's special-token roles (pad / eos / unk / bos, ``<image>`` extra)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=fast.backend_tokenizer,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        bos_token=BOS,
        extra_special_tokens=[IMAGE_TOKEN, *CHAT_TOKENS],
        clean_up_tokenization_spaces=False,  # decode must give the text back as it was
    )


def build_default_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train the default byte-level BPE on the local text corpus (train split). ~2 s for 8192 tokens."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (bytes + special tokens), got {vocab_size}"
        )
    texts = load_local_text_corpus()["train"]
    return wrap_tokenizer(
        train_bpe_tokenizer(texts, vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False)
    )


def build_info(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> dict:
    """What a rebuild needs to match: interpreter, library versions, corpus hash; plus the eval compression."""
    corpus = load_local_text_corpus()
    return {
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "tokenizers": tokenizers.__version__,
        "transformers": transformers.__version__,
        "vocab_size": vocab_size,
        "special_tokens": {t: tokenizer.convert_tokens_to_ids(t) for t in (*SPECIAL_TOKENS, *CHAT_TOKENS)},
        "corpus": {
            "source": "data_pipelines.local_text.load_local_text_corpus() (stdlib docstrings), train split",
            "train_docs": len(corpus["train"]),
            "train_bytes": sum(len(t.encode("utf-8")) for t in corpus["train"]),
            "train_sha256": corpus_sha256(corpus["train"]),
        },
        "eval_bytes_per_token": round(bytes_per_token(tokenizer, corpus["eval"]), 4),
    }


def save_default_tokenizer(out_dir: str | os.PathLike, vocab_size: int = DEFAULT_VOCAB_SIZE):
    """Build the default tokenizer and write it (``save_pretrained`` files + ``BUILD_INFO.json``) to ``out_dir``
    (no default: the shipped copy, ``DEFAULT_TOKENIZER_DIR``, is only ever overwritten when passed explicitly).

    Returns ``(tokenizer, info)``.
    """
    tokenizer = build_default_tokenizer(vocab_size)
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    info = build_info(tokenizer, vocab_size)
    with open(os.path.join(out_dir, BUILD_INFO_FILE), "w") as f:
        json.dump(info, f, indent=2)
        f.write("\n")
    logger.info("tokenizer (vocab %d) written to %s", len(tokenizer), out_dir)
    return tokenizer, info


def load_tokenizer(path: str | os.PathLike | None = None) -> PreTrainedTokenizerBase:
    """``None``: the tokenizer shipped with the package; a folder: any HF tokenizer saved there
    (``AutoTokenizer.from_pretrained(path)``, offline)."""
    directory = DEFAULT_TOKENIZER_DIR if path is None else Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"tokenizer path {str(directory)!r} is not a directory")
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{str(directory)!r} holds no tokenizer: expected one of {', '.join(TOKENIZER_FILES)} "
            "(a tokenizer.save_pretrained folder)"
        )
    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"cannot load a tokenizer from {str(directory)!r}: {first_line}") from err


def add_vlm_tokens(tokenizer, chat: bool = True) -> int:
    """Give ``tokenizer`` (an HF one) ``<image>`` and, with ``chat``, the chat template's ``CHAT_TOKENS``: those it
    lacks are added as special tokens, in that order after its vocabulary, so no earlier id moves (the shipped
    tokenizer has them all and is left as it is). The one place the toolkit adds tokens; ``VLMProcessor`` adds
    all, the training loader ``<image>`` only. Returns the ``<image>`` id."""
    vocab = tokenizer.get_vocab()
    if missing := [t for t in (IMAGE_TOKEN, *(CHAT_TOKENS if chat else ())) if t not in vocab]:
        tokenizer.add_tokens(missing, special_tokens=True)
    return tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)


def pad_id(tokenizer) -> int:
    """The id padding uses: the tokenizer's pad token, else its eos, else 0 (labels ignore padding either way)."""
    return next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)


def special_affixes(tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer's own post-processor puts before and after a text (BOS; [CLS] / [SEP]; none)."""
    probe = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(probe) + 1):
        if full[start : start + len(probe)] == probe:
            return full[:start], full[start + len(probe) :]
    return [], []
